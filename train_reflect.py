"""Train a math agent that reflects on wrong answers, with GRPO, synchronously or asynchronously.

The model solves a GSM8K-style word problem and ends with `#### N`. When the answer is wrong it
receives a reflection turn ("Your answer is either wrong or not parsable ...") and tries again, up
to `max_turns`; the reward is 1 for a correct answer, times `turn_discount` per extra turn.

    python train_reflect.py                                   # embedded default, CPU, no hub
    python train_reflect.py --mode async --max_staleness 2    # rollouts overlap the update
    python train_reflect.py --config configs/reflect_qwen2.5_1.5b.yaml   # Qwen2.5 + SGLang on GPUs

The same agent written with the openai SDK and trained through lib/openai_proxy.py is
train_agent.py's default agent. Reads top to bottom: config, prompt, reward, one episode, group
rollout, evaluation, data, warm start, the run's set-up (lib/run.py), main() with the GRPO loop
(rollout_step, train_step, sync_weights, log_step, save_checkpoint).
"""
import asyncio
import os
import random
import re
import time
import uuid
from dataclasses import dataclass
from fractions import Fraction

import fire
import numpy as np
import torch
from tqdm import tqdm

from lib.async_rollout import gather_groups
from lib.chat_format import encode, encode_batch, render_text
from lib.deadlines import with_deadline
from lib.client import InferenceClient
from lib.config import load_config
from lib.reward_pool import RewardPool
from lib.run import (Run, RunConfig, checkpoint_due, close_run, finish_training, log_step, open_run, out_of_time,
                     rollout_step, save_checkpoint, start_training, sync_weights, train_step)


@dataclass
class Config(RunConfig):  # the run's fields (servers, trainer, GRPO, async, logging) are lib/run.py's RunConfig
    # == the math task with reflection ==
    run_dir: str = "runs/reflect"  # metrics.jsonl, traces.jsonl, evals/, checkpoints/, final/
    max_steps: int = 200  # GRPO steps
    dataset: str = ""  # "" = bundled synthetic problems; a hub id ("openai/gsm8k"); or a local dir of {train,dev,test}.{jsonl,parquet}
    dataset_config: str = "main"  # hub config name
    dev_size: int = 300  # held out of train when the dataset has no dev/validation split
    max_turns: int = 2  # 1 = single-turn RLVR
    turn_discount: float = 0.9  # reward x turn_discount^(turns - 1)
    max_tokens: int = 1024  # context budget of one episode: prompt + all turns + reflections
    max_new_tokens_per_turn: int = 128  # tokens per generation request; a turn cut by it goes on while the budget lasts
    reward_timeout_s: float = 5.0  # per call; a timeout scores 0 and is counted
    reward_workers: int = 1  # processes of the reward pool
    # == the math task: warm start stages (lib/warm_start.py) ==
    warm_start_reflect_frac: float = 0.3  # demonstrations that recover from a wrong first answer
    warm_start_direct_steps: int = 0  # then SFT steps on demonstrations of which a fraction give the final line only
    warm_start_direct_frac: float = 0.6  # ... that fraction ("#### N", no worked steps)
    warm_start_direct_lr: float = 5e-4  # stage 2's learning rate
    warm_start_problems: int = 20000  # distinct synthetic problems for the warm start (the train split changes with it)


# --- prompt ---
PROMPT_TEMPLATE = "{question}\nSolve the problem step by step. Put the final answer after ####."
REFLECTION = "Your answer is either wrong or not parsable to the reference answer. Please try to answer it more accurately."


def render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    return encode(tokenizer, render_text(tokenizer, messages, add_generation_prompt=add_generation_prompt))


def prompt_text(tokenizer, question: str, apply_chat_template: bool) -> str:
    text = PROMPT_TEMPLATE.format(question=question)
    if apply_chat_template and tokenizer.chat_template:
        return render_text(tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True)
    return text


def build_prompt_ids(tokenizer, question: str, apply_chat_template: bool) -> list[int]:
    return encode(tokenizer, prompt_text(tokenizer, question, apply_chat_template))


def build_reflection_ids(tokenizer, apply_chat_template: bool) -> list[int]:
    """Tokens that follow the end-of-turn token of a model turn: the reflection as a user turn and
    the opening of the next assistant turn. Cut from two templated conversations that differ only
    by that user turn, so a trajectory's tokens are the chat template's rendering of the dialogue."""
    if not (apply_chat_template and tokenizer.chat_template):
        return tokenizer(f"\n\n{REFLECTION}\n\n", add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    dialogue = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "#### 2"}]
    before = render_ids(tokenizer, dialogue, add_generation_prompt=False)
    after = render_ids(tokenizer, dialogue + [{"role": "user", "content": REFLECTION}], add_generation_prompt=True)
    if eos not in before:
        raise ValueError(f"the chat template does not end an assistant turn with eos {tokenizer.eos_token!r}; "
                         "set the tokenizer's eos_token to the end-of-turn token")
    end = len(before) - 1 - before[::-1].index(eos)
    if after[: end + 1] != before[: end + 1]:
        raise ValueError("the chat template renders an assistant turn differently when a user turn follows it; "
                         "the reflection turn cannot be cut by difference")
    return after[end + 1:]


# --- reward ---
# Never evaluates the completion: it extracts one number with linear-time regexes and compares it
# as an exact fraction. No math-verify: GSM8K gold answers are plain numbers, which this
# handles, and its LaTeX parsing of untrusted text is slower and has no time bound of its own.
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|(?<![\w.])-?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*(-?[\d.,]+)\s*\}\s*\{\s*(-?[\d.,]+)\s*\}")
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:/[+-]?(?:\d+(?:\.\d*)?|\.\d+))?")
_MAX_NUMBER_CHARS = 64  # gold answers are short; longer "numbers" are junk and costly to convert
_MAX_BOXED_CHARS = 1000


def to_fraction(token: str) -> Fraction | None:
    token = token.replace(",", "").replace(" ", "")
    # Plain decimals and simple fractions only: Fraction() also reads exponents ("1e9999999" is a
    # ten-million-digit integer and seconds of work), which no GSM8K answer uses.
    if not token or len(token) > _MAX_NUMBER_CHARS or not _PLAIN_NUMBER.fullmatch(token):
        return None
    try:
        if "/" in token:
            num, den = token.split("/", 1)
            return Fraction(num) / Fraction(den)
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


def numbers_in(text: str) -> list[str]:
    return _NUMBER.findall(_FRAC.sub(r"\1/\2", text))


def last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0 or i - start > 8:
        return None
    depth, j = 0, i
    for j in range(i, min(len(text), i + _MAX_BOXED_CHARS)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def extract_answer(completion: str) -> Fraction | None:
    """The final answer: the number after the last `####`, else the last number in the last
    `\\boxed{}`, else the last number in the text. Thousands separators, currency signs, unit words,
    `%`, trailing `.0` and simple fractions (`3/4`, `\\frac{3}{4}`) are normalised away."""
    marker = completion.rfind("####")
    if marker >= 0:
        found = numbers_in(completion[marker + 4 :].split("\n", 1)[0])
        if found:
            return to_fraction(found[0])
    boxed = last_boxed(completion)
    if boxed is not None:
        found = numbers_in(boxed)
        if found:
            return to_fraction(found[-1])
    found = numbers_in(completion)
    return to_fraction(found[-1]) if found else None


def gold_answer(answer: str) -> Fraction | None:
    """GSM8K's gold: the text after the last `####`."""
    return to_fraction(answer.rsplit("####", 1)[-1].strip())


def reward_fn(completion: str, answer: str) -> float:
    pred, gold = extract_answer(completion), gold_answer(answer)
    return float(pred is not None and gold is not None and pred == gold)


def shows_work(completion: str) -> bool:
    """Whether an answer works the problem out (a calculation with '=') before its final answer.
    Logged, not rewarded: it shows which way RL moves the embedded default's policy."""
    return "=" in completion.split("####")[0]


# --- one episode ---
async def arun_episode(client: InferenceClient, tokenizer, reflection_ids: list[int], reward_pool: RewardPool,
                       cfg: Config, item: dict, temperature: float, trajectory_id: str | None = None) -> dict:
    """One trajectory (docs/trajectory.md): answer, and after a wrong answer reflect and answer again.
    Token ids in, token ids out: generated tokens enter the trajectory exactly as the server sampled
    them, with its log-probs; the end-of-turn and reflection tokens have loss_mask 0. A turn ends
    on any of the model's EOS ids (`cfg.stop_token_ids`), sampled tokens kept as they are."""
    eos = tokenizer.eos_token_id
    end_ids = cfg.stop_token_ids or [eos]
    prompt_ids = build_prompt_ids(tokenizer, item["question"], cfg.apply_chat_template)
    input_ids, loss_mask, logprobs, versions = list(prompt_ids), [0] * len(prompt_ids), [0.0] * len(prompt_ids), [-1] * len(prompt_ids)

    def append(ids, lps=None, vers=None):
        input_ids.extend(ids)
        loss_mask.extend([1 if lps is not None else 0] * len(ids))
        logprobs.extend(lps if lps is not None else [0.0] * len(ids))
        versions.extend(vers if vers is not None else [-1] * len(ids))

    trajectory_id = trajectory_id or uuid.uuid4().hex  # a training item's: "<item index>/<sample>"
    score, turns, finish, texts = 0.0, 0, "max_turns", []
    try:
        for turn in range(cfg.max_turns):
            budget = cfg.max_tokens - len(input_ids)
            if budget <= 0:
                finish = "max_tokens"
                break
            gen = await client.generate(
                input_ids, max_new_tokens=min(cfg.max_new_tokens_per_turn, budget), temperature=temperature,
                stop_token_ids=end_ids, trajectory_id=trajectory_id)
            turns += 1
            append(gen.output_ids, gen.logprobs, gen.versions)
            if gen.output_ids[-1:] != [eos]:
                # cut by length, or ended by another stop id (Qwen2.5's <|endoftext|>): closed as the chat
                # template closes a turn, so the next one sees what it renders; not sampled, not trained on
                append([eos])
            text = tokenizer.decode(gen.output_ids, skip_special_tokens=True)
            texts.append(text)
            score = await reward_pool.score(reward_fn, text, item["answer"])
            if score > 0:
                finish = "correct"
                break
            if turn + 1 < cfg.max_turns:
                if len(input_ids) + len(reflection_ids) >= cfg.max_tokens:
                    finish = "max_tokens"
                    break
                append(reflection_ids)
    finally:
        client.end_trajectory(trajectory_id)
    reward = score * cfg.turn_discount ** (turns - 1) if turns else 0.0
    t = lambda xs, dtype: torch.tensor([xs], dtype=dtype)  # noqa: E731
    return {
        "input_ids": t(input_ids, torch.long),
        "loss_mask": t(loss_mask, torch.long),
        "logprobs": t(logprobs, torch.float32),
        "versions": t(versions, torch.long),
        "attention_mask": torch.ones(1, len(input_ids), dtype=torch.long),
        "rewards": torch.tensor([reward], dtype=torch.float32),
        "num_turns": turns,
        "correct_turn": turns if score > 0 else 0,  # 0 = never correct
        "shows_work": bool(texts) and shows_work(texts[0]),
        "finish_reason": finish,
        "question": item["question"],
        "gold": item["answer"],
        "turn_texts": texts,
    }


# --- group rollout ---
async def rollout_group(client, tokenizer, reflection_ids, reward_pool, cfg, item, temperature, group_size) -> list[dict]:
    # Each episode under its deadline: one that runs past it fails the group (dropped and counted).
    return list(await asyncio.gather(*[
        with_deadline(arun_episode(client, tokenizer, reflection_ids, reward_pool, cfg, item, temperature,
                                   trajectory_id=f"{item['index']}/{k}" if "index" in item else None),
                      cfg.episode_timeout_s, item) for k in range(group_size)]))


async def rollout_groups(client, tokenizer, reflection_ids, reward_pool, cfg, items, temperature, group_size):
    """(groups, number of failed groups): all groups at once; the client's concurrency limit and the
    server's batching decide how many generate at the same time. A group with a failed episode
    (server error or abort) is dropped and counted."""
    return await gather_groups([rollout_group(client, tokenizer, reflection_ids, reward_pool, cfg, item, temperature,
                                              group_size) for item in items])


# --- evaluation ---
async def evaluate(client, tokenizer, reflection_ids, reward_pool, cfg, items) -> tuple[list[dict], dict]:
    """Greedy, one episode per question: (the episodes, their metrics: accuracy at the first turn,
    after reflection, mean turns)."""
    groups, failed = await rollout_groups(client, tokenizer, reflection_ids, reward_pool, cfg, items, 0.0, 1)
    episodes = [g[0] for g in groups]
    return episodes, {
        "failed": failed,
        "acc_turn1": float(np.mean([e["correct_turn"] == 1 for e in episodes])),
        "acc_final": float(np.mean([e["correct_turn"] > 0 for e in episodes])),
        "turns": float(np.mean([e["num_turns"] for e in episodes])),
        "reward": float(np.mean([e["rewards"].item() for e in episodes])),
        "shows_work": float(np.mean([e["shows_work"] for e in episodes])),
    }


def episode_metrics(episodes: list[dict]) -> dict:
    """The task's metrics of a training rollout (logged under rollout/)."""
    return {"acc_turn1": float(np.mean([e["correct_turn"] == 1 for e in episodes])),
            "acc_final": float(np.mean([e["correct_turn"] > 0 for e in episodes])),
            "shows_work": float(np.mean([e["shows_work"] for e in episodes]))}


# --- data ---
def load_splits(cfg: Config) -> dict[str, list[dict]]:
    """train/dev/test lists of {"question", "answer"} (GSM8K's columns)."""
    if not cfg.dataset:
        from lib.math_data import default_math_dir, read_split

        data_dir = default_math_dir(seed=0, num_warmstart=cfg.warm_start_problems)
        return {split: read_split(data_dir, split) for split in ("train", "dev", "test")}
    import datasets

    if os.path.isdir(cfg.dataset):
        files = {}
        for name in sorted(os.listdir(cfg.dataset)):
            split, _, ext = name.partition(".")
            if ext in ("jsonl", "json", "parquet"):
                files[split] = os.path.join(cfg.dataset, name)
        if not files:
            raise FileNotFoundError(f"no {{train,dev,test}}.{{jsonl,parquet}} files in {cfg.dataset}")
        kind = "parquet" if next(iter(files.values())).endswith(".parquet") else "json"
        ds = datasets.load_dataset(kind, data_files=files)
    else:
        ds = datasets.load_dataset(cfg.dataset, cfg.dataset_config)
    rows = lambda split: [{"question": r["question"], "answer": r["answer"]} for r in ds[split]]  # noqa: E731
    train = rows("train")
    dev_name = next((s for s in ("dev", "validation") if s in ds), None)
    if dev_name:
        dev = rows(dev_name)
    else:  # GSM8K has only train and test: hold a fixed random slice of train out for dev
        order = np.random.RandomState(1234).permutation(len(train))
        dev = [train[i] for i in order[: cfg.dev_size]]
        train = [train[i] for i in order[cfg.dev_size:]]
    return {"train": train, "dev": dev, "test": rows("test")}


# --- warm start ---
def wrong_attempt(answer: str, rng: random.Random) -> str:
    """The worked solution with its final result changed: a plausible wrong first turn."""
    gold = answer.rsplit("####", 1)[-1].strip()
    wrong = str(int(gold) + rng.choice([-3, -2, -1, 1, 2, 3, 10]))
    head, _, _ = answer.rpartition("####")
    head = head[::-1].replace(gold[::-1], wrong[::-1], 1)[::-1]  # the last occurrence: the final step's result
    return f"{head}#### {wrong}"


def build_demonstrations(tokenizer, cfg: Config, items: list[dict], reflection_ids: list[int],
                         direct_frac: float = 0.0, loss_on_prompt: bool = True) -> list[dict]:
    """Successful trajectories for SFT, tokenized exactly as arun_episode builds them. Some recover
    from a wrong first answer after the reflection turn; a fraction `direct_frac`
    give the final line (`#### N`) without worked steps, so RL has a behaviour to learn: working
    the steps out is right far more often.

    By default the loss covers every token except the wrong answer: a model trained from scratch
    learns to copy the question's numbers into its worked steps sooner when it also models the
    question (the search task measured the same for copying from passages). A pretrained model is
    trained on its own answers only (`loss_on_prompt` False). Each answer ends as the model's chat
    template ends a turn."""
    from lib.warm_start import end_of_turn_ids

    rng = random.Random(cfg.seed)
    end_of_turn, context = end_of_turn_ids(tokenizer), int(loss_on_prompt)
    # What each demonstration says is drawn first, then every text is tokenized in one call (the
    # same ids as one at a time, in half the time: a warm start's key is built on every run).
    wrongs, finals = [], []
    for item in items:
        reflects = cfg.max_turns > 1 and rng.random() < cfg.warm_start_reflect_frac
        wrongs.append(wrong_attempt(item["answer"], rng) if reflects else None)
        direct = direct_frac > 0 and rng.random() < direct_frac
        finals.append("#### " + item["answer"].rsplit("####", 1)[-1].strip() if direct else item["answer"])
    prompts = [prompt_text(tokenizer, item["question"], cfg.apply_chat_template) for item in items]
    token_ids = iter(encode_batch(tokenizer, prompts + [w for w in wrongs if w is not None] + finals))
    prompt_ids = [next(token_ids) for _ in items]
    wrong_ids = [None if w is None else next(token_ids) for w in wrongs]
    examples = []
    for ids, wrong, solution in zip(prompt_ids, wrong_ids, token_ids):
        mask = [context] * len(ids)
        if wrong is not None:
            wrong = wrong + end_of_turn
            ids, mask = ids + wrong + reflection_ids, mask + [0] * len(wrong) + [context] * len(reflection_ids)
        solution = solution + end_of_turn
        ids, mask = ids + solution, mask + [1] * len(solution)
        if len(ids) <= cfg.max_tokens:
            examples.append({"input_ids": ids, "loss_mask": mask})
    return examples


def warm_started_model(cfg: Config, base: str, embedded: bool) -> str:
    """`base` after the SFT warm start on the synthetic problems' worked solutions (built once, cached
    under what it trains on), or `base` itself with warm_start_steps 0."""
    from lib.math_data import default_math_dir, read_split
    from lib.warm_start import steps_and_lr, warm_start_stages

    items = read_split(default_math_dir(seed=0, num_warmstart=cfg.warm_start_problems), "warmstart")
    steps, lr = steps_and_lr(cfg.warm_start_steps, cfg.warm_start_lr, embedded, embedded_steps=1500)

    def examples(tokenizer, direct_frac=0.0):
        reflection_ids = build_reflection_ids(tokenizer, cfg.apply_chat_template)
        return build_demonstrations(tokenizer, cfg, items, reflection_ids, direct_frac, loss_on_prompt=embedded)
    # stage 2 (warm_start_direct_steps): a fraction of the demonstrations write most answers without working them out
    return warm_start_stages("reflect-warm-start", base, examples, steps=steps, lr=lr,
                             batch_size=cfg.warm_start_batch_size, seed=cfg.seed,
                             direct_steps=cfg.warm_start_direct_steps, direct_lr=cfg.warm_start_direct_lr,
                             direct_frac=cfg.warm_start_direct_frac,
                             what_direct="warm start, stage 2 of 2 (some answers without worked steps)")


# --- the run: lib's plumbing with this task's pieces ---
def setup(cfg: Config) -> Run:
    """lib's run (ranks, model, servers, client, actor, weight sync, resume, logger), then this task's
    reflection prompt, reward pool and rollouts, bound to them."""
    run = open_run(cfg, lambda base, embedded: warm_started_model(cfg, base, embedded), lambda: load_splits(cfg))
    try:
        if run.is_main:
            reflection_ids = build_reflection_ids(run.tokenizer, run.cfg.apply_chat_template)
            run.reward_pool = RewardPool(cfg.reward_workers, cfg.reward_timeout_s, preload=reward_fn)
            run.rollout_group = lambda item, temperature, group_size: rollout_group(
                run.client, run.tokenizer, reflection_ids, run.reward_pool, run.cfg, item, temperature, group_size)
            run.evaluate = lambda items: evaluate(run.client, run.tokenizer, reflection_ids, run.reward_pool,
                                                  run.cfg, items)
    except BaseException:
        close_run(run)
        raise
    return run


# --- main: the GRPO loop ---
def main(config: str | None = "configs/reflect_tiny.yaml", **overrides):
    cfg = load_config(Config, config, overrides)
    run = setup(cfg)
    cfg = run.cfg
    try:
        start_training(run)  # the step-0 evaluations and learnability probe; async mode's producer starts
        progress = tqdm(total=cfg.max_steps, initial=run.step, desc=f"GRPO ({cfg.mode})", disable=not run.is_main)
        train_start, stopping = time.time(), False
        while run.step < cfg.max_steps and not stopping:
            t0 = time.time()
            # 1. rollout, 2. advantages: the rows to train, on every rank
            batch, episodes, metrics = rollout_step(run, episode_metrics)
            metrics["perf/rollout_s"] = time.time() - t0
            # 3. proximal log-probs, 4. PPO update: each rank on its share of the rows
            metrics.update(train_step(run, batch))
            # 5. weight sync and version bump, when anything was trained
            metrics.update(sync_weights(run, trained=bool(batch)))
            run.step += 1
            # 6. log: metrics, the dev evaluation every eval_every steps, traces
            metrics["perf/step_s"] = time.time() - t0
            log_step(run, metrics, episodes, batch, context_role="reflection", correct=lambda e: e["correct_turn"] > 0)
            progress.update(1)
            if run.is_main:
                progress.set_postfix(reward=f"{metrics['rollout/reward']:.3f}", dev_acc=metrics.get("eval/acc_final", ""))
            # 7. checkpoint
            stopping = out_of_time(run, train_start)
            if checkpoint_due(run, stopping):
                save_checkpoint(run)
        progress.close()
        return finish_training(run)  # the test evaluation, the final weights
    finally:
        close_run(run)


if __name__ == "__main__":
    fire.Fire(main)
