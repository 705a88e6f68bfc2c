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
NUMBER_SIZES = ("small", "large")

NAMES = [("Tom", "He"), ("Anna", "She"), ("Ben", "He"), ("Mia", "She"), ("Sam", "He"), ("Lily", "She"),
         ("Max", "He"), ("Emma", "She"), ("Leo", "He"), ("Zoe", "She"), ("Jack", "He"), ("Ella", "She")]
OBJECTS = ["apples", "books", "pens", "cards", "eggs", "stamps", "shells", "coins", "cookies", "marbles"]
CONTAINERS = ["boxes", "bags", "baskets", "jars"]


def _start(rng: random.Random, name: str, obj: str):
    """The first sentence, its worked line and the starting count."""
    if rng.random() < 0.25:
        groups, per_group = rng.randint(2, 5), rng.randint(2, 10)
        container = rng.choice(CONTAINERS)
        total = groups * per_group
        text = f"{name} has {groups} {container} with {per_group} {obj} in each."
        work = f"{name} has {groups} * {per_group} = {total} {obj}."
        return text, work, total
    count = rng.randint(2, 20)
    return f"{name} has {count} {obj}.", None, count


def _step(rng: random.Random, pronoun: str, obj: str, count: int, friend: str):
    """One follow-up sentence that changes the count, its worked line and the new count."""
    ops = ["add", "sub"] + (["mul"] if count <= 30 else [])
    op = rng.choice(ops)
    if op == "sub" and count < 2:
        op = "add"
    if op == "add":
        n = rng.randint(1, 10)
        object_pronoun = "him" if pronoun == "He" else "her"
        text = rng.choice([f"{pronoun} buys {n} more {obj}.", f"{pronoun} finds {n} more {obj}.",
                           f"{friend} gives {object_pronoun} {n} {obj}."])
        return text, f"{count} + {n} = {count + n}.", count + n
    if op == "sub":
        n = rng.randint(1, min(count - 1, 10))
        text = rng.choice([f"{pronoun} gives {n} {obj} to {friend}.", f"{pronoun} loses {n} {obj}.",
                           f"{pronoun} sells {n} {obj}."])
        return text, f"{count} - {n} = {count - n}.", count - n
    k = rng.randint(2, 3)
    word = {2: "twice", 3: "three times", 4: "four times"}[k]
    text = f"Then {pronoun.lower()} ends up with {word} as many {obj}."
    return text, f"{count} * {k} = {count * k}.", count * k


def _start_large(rng: random.Random, name: str, obj: str):
    """`_start` over larger numbers: 100-999 items, or 12-48 containers of 15-99."""
    if rng.random() < 0.4:
        groups, per_group = rng.randint(12, 48), rng.randint(15, 99)
        container = rng.choice(CONTAINERS)
        total = groups * per_group
        text = f"{name} has {groups} {container} with {per_group} {obj} in each."
        return text, f"{name} has {groups} * {per_group} = {total} {obj}.", total
    count = rng.randint(100, 999)
    return f"{name} has {count} {obj}.", None, count


def _step_large(rng: random.Random, pronoun: str, obj: str, count: int, friend: str):
    """`_step` over larger numbers: adds and removes 100-999, multiplies by 3-9 while below 2,000."""
    ops = ["add", "sub"] + (["mul"] if count < 2000 else [])
    op = rng.choice(ops)
    if op == "sub" and count < 200:
        op = "add"
    if op == "add":
        n = rng.randint(100, 999)
        object_pronoun = "him" if pronoun == "He" else "her"
        text = rng.choice([f"{pronoun} buys {n} more {obj}.", f"{pronoun} finds {n} more {obj}.",
                           f"{friend} gives {object_pronoun} {n} {obj}."])
        return text, f"{count} + {n} = {count + n}.", count + n
    if op == "sub":
        n = rng.randint(100, min(count - 1, 999))
        text = rng.choice([f"{pronoun} gives {n} {obj} to {friend}.", f"{pronoun} loses {n} {obj}.",
                           f"{pronoun} sells {n} {obj}."])
        return text, f"{count} - {n} = {count - n}.", count - n
    k = rng.randint(3, 9)
    text = f"Then {pronoun.lower()} ends up with {k} times as many {obj}."
    return text, f"{count} * {k} = {count * k}.", count * k


def make_problem(rng: random.Random, numbers: str = "small") -> dict:
    """One word problem with its worked solution: 1-3 arithmetic steps over small numbers, or 2-4
    over large ones."""
    (name, pronoun), obj = rng.choice(NAMES), rng.choice(OBJECTS)
    friend = rng.choice([n for n, _ in NAMES if n != name])
    start, step = (_start, _step) if numbers == "small" else (_start_large, _step_large)
    sentences, work = [], []
    text, line, count = start(rng, name, obj)
    sentences.append(text)
    if line:
        work.append(line)
    # Mostly one or two steps: a model of a few million parameters learns those within minutes,
    # and the three-step problems leave headroom for RL.
    if numbers == "small":
        num_steps = rng.choices([1, 2, 3], weights=[5, 3, 2])[0] - (1 if line else 0)
    else:
        num_steps = rng.choices([2, 3, 4], weights=[4, 4, 2])[0] - (1 if line else 0)
    for _ in range(num_steps):
        text, line, count = step(rng, pronoun, obj, count, friend)
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
