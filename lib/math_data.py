"""Synthetic GSM8K-format arithmetic word problems for the embedded default of the reflect task.

Each record is `{"question": ..., "answer": "worked steps ...\\n#### N"}`, the format of
`openai/gsm8k` (`main`), so the script's data path is the one the real recipe uses. The problems are
chains of 1-3 steps of +, -, * over small numbers with a few templates, names and objects: a
model of a few million parameters trained for minutes on 2 CPU cores can learn part of them, and
the rest gives RL something to improve.

Splits: `warmstart` (worked solutions for the SFT warm start), `train` (RL prompts), `dev`
(periodic evaluation), `test` (final evaluation). No question appears in two splits. The files are
byte-identical for a given seed and sizes.

`numbers="large"` draws the same kinds of problems over three- and four-digit numbers in two to four
steps (`{name} has 12 boxes with 85 pens in each. She sells 347 pens. ...`): a language model's mental
arithmetic fails on them where a calculator does not, so the tool has a worth to learn.
"""
import json
import os
import random

from lib.cache import build_once, cache_root

# Bump when the generator changes, so cached data built by an older version is not reused.
GENERATOR_VERSION = 2

SPLITS = ("test", "dev", "warmstart", "train")

NAMES = [("Tom", "He"), ("Anna", "She"), ("Ben", "He"), ("Mia", "She"), ("Sam", "He"), ("Lily", "She"),
         ("Max", "He"), ("Emma", "She"), ("Leo", "He"), ("Zoe", "She"), ("Jack", "He"), ("Ella", "She")]
OBJECTS = ["apples", "books", "pens", "cards", "eggs", "stamps", "shells", "coins", "cookies", "marbles"]
CONTAINERS = ["boxes", "bags", "baskets", "jars"]


# The two sizes of problem: the same kinds of sentences over other ranges of numbers.
RANGES = {
    "small": {"containers_p": 0.25, "groups": (2, 5), "per_group": (2, 10), "count": (2, 20), "steps": ([1, 2, 3], [5, 3, 2]),
              "mul_below": 31, "sub_from": 2, "n": (1, 10), "k": (2, 3), "spelled": True},
    "large": {"containers_p": 0.4, "groups": (12, 48), "per_group": (15, 99), "count": (100, 999),
              "steps": ([2, 3, 4], [4, 4, 2]), "mul_below": 2000, "sub_from": 200, "n": (100, 999), "k": (3, 9),
              "spelled": False},
}
NUMBER_SIZES = tuple(RANGES)
SPELLED = {2: "twice", 3: "three times", 4: "four times"}


def _start(rng: random.Random, name: str, obj: str, r: dict):
    """The first sentence, its worked line and the starting count (`r`: the size's RANGES)."""
    if rng.random() < r["containers_p"]:
        groups, per_group = rng.randint(*r["groups"]), rng.randint(*r["per_group"])
        container = rng.choice(CONTAINERS)
        total = groups * per_group
        text = f"{name} has {groups} {container} with {per_group} {obj} in each."
        work = f"{name} has {groups} * {per_group} = {total} {obj}."
        return text, work, total
    count = rng.randint(*r["count"])
    return f"{name} has {count} {obj}.", None, count


def _step(rng: random.Random, pronoun: str, obj: str, count: int, friend: str, r: dict):
    """One follow-up sentence that changes the count, its worked line and the new count."""
    ops = ["add", "sub"] + (["mul"] if count < r["mul_below"] else [])
    op = rng.choice(ops)
    if op == "sub" and count < r["sub_from"]:
        op = "add"
    if op == "add":
        n = rng.randint(*r["n"])
        object_pronoun = "him" if pronoun == "He" else "her"
        text = rng.choice([f"{pronoun} buys {n} more {obj}.", f"{pronoun} finds {n} more {obj}.",
                           f"{friend} gives {object_pronoun} {n} {obj}."])
        return text, f"{count} + {n} = {count + n}.", count + n
    if op == "sub":
        n = rng.randint(r["n"][0], min(count - 1, r["n"][1]))
        text = rng.choice([f"{pronoun} gives {n} {obj} to {friend}.", f"{pronoun} loses {n} {obj}.",
                           f"{pronoun} sells {n} {obj}."])
        return text, f"{count} - {n} = {count - n}.", count - n
    k = rng.randint(*r["k"])
    word = SPELLED[k] if r["spelled"] else f"{k} times"
    text = f"Then {pronoun.lower()} ends up with {word} as many {obj}."
    return text, f"{count} * {k} = {count * k}.", count * k


def make_problem(rng: random.Random, numbers: str = "small") -> dict:
    """One word problem with its worked solution: 1-3 arithmetic steps over small numbers, or 2-4
    over large ones."""
    r = RANGES[numbers]
    (name, pronoun), obj = rng.choice(NAMES), rng.choice(OBJECTS)
    friend = rng.choice([n for n, _ in NAMES if n != name])
    sentences, work = [], []
    text, line, count = _start(rng, name, obj, r)
    sentences.append(text)
    if line:
        work.append(line)
    # Small: mostly one or two steps (a model of a few million parameters learns those within
    # minutes, and the three-step problems leave headroom for RL). Large: two to four.
    num_steps = rng.choices(*r["steps"])[0] - (1 if line else 0)
    for _ in range(num_steps):
        text, line, count = _step(rng, pronoun, obj, count, friend, r)
        sentences.append(text)
        work.append(line)
    question = " ".join(sentences) + f" How many {obj} does {name} have now?"
    return {"question": question, "answer": "\n".join(work) + f"\n#### {count}"}


def build_math_data(out_dir: str, seed: int = 0, num_train: int = 20000, num_dev: int = 300,
                    num_test: int = 500, num_warmstart: int = 2000, numbers: str = "small") -> dict[str, str]:
    """Write `{split}.jsonl` for warmstart/train/dev/test into `out_dir`; returns split -> path.

    Splits are drawn in the order test, dev, warmstart, train from one random stream, skipping
    questions already drawn, so test and dev stay the same when only `num_train` changes.
    """
    if numbers not in NUMBER_SIZES:
        raise ValueError(f"numbers={numbers!r}: choose one of {NUMBER_SIZES}")
    sizes = {"test": num_test, "dev": num_dev, "warmstart": num_warmstart, "train": num_train}
    rng = random.Random(seed)
    seen: set[str] = set()
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for split in SPLITS:
        records = []
        # The space holds millions of distinct questions; the cap only guards against tiny spaces.
        attempts = 0
        while len(records) < sizes[split]:
            attempts += 1
            if attempts > 100 * sizes[split] + 1000:
                raise ValueError(f"could not draw {sizes[split]} distinct {split} problems; lower the split sizes")
            problem = make_problem(rng, numbers)
            if problem["question"] in seen:
                continue
            seen.add(problem["question"])
            records.append(problem)
        paths[split] = os.path.join(out_dir, f"{split}.jsonl")
        with open(paths[split], "w", encoding="utf-8", newline="\n") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
    return paths


def default_math_dir(seed: int = 0, num_warmstart: int = 2000, numbers: str = "small") -> str:
    """The default-sized data set under the cache, built on first use. A larger `num_warmstart` gives
    the SFT warm start more distinct problems; test and dev stay the same, train changes."""
    if numbers not in NUMBER_SIZES:
        raise ValueError(f"numbers={numbers!r}: choose one of {NUMBER_SIZES}")
    suffix = ("" if num_warmstart == 2000 else f"-w{num_warmstart}") + ("" if numbers == "small" else f"-{numbers}")
    out_dir = os.path.join(cache_root(), f"math-data-v{GENERATOR_VERSION}-seed{seed}{suffix}")
    return build_once(out_dir, lambda tmp: build_math_data(tmp, seed=seed, num_warmstart=num_warmstart,
                                                            numbers=numbers))


def read_split(out_dir: str, split: str) -> list[dict]:
    with open(os.path.join(out_dir, f"{split}.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def iter_math_texts(out_dir: str):
    """Question and answer texts for training the tokenizer. Dev and test are left out so that no
    held-out text shapes the vocabulary."""
    for split in ("warmstart", "train"):
        for record in read_split(out_dir, split):
            yield record["question"]
            yield record["answer"]
