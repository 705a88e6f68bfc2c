"""Train a calculator agent with GRPO: one tool and a verifiable answer, the template to fork.

The model solves a GSM8K-style word problem. For arithmetic it writes `<calc> 12 * 7 </calc>`; the
episode appends `<result> 84 </result>` and the model goes on; it ends with a final line `#### N`.
Reward: 1 if N equals the gold answer (exact fractions), else 0.

    python train_calc.py                                     # embedded default, CPU, no hub
    python train_calc.py --model_path Qwen/Qwen2.5-1.5B-Instruct --server sglang --trainer_dtype bfloat16

Sync or async GRPO (`--mode async`: rollouts keep running during the update); under torchrun the
trainer is sharded (FSDP2). Reads top to bottom: config, prompt, parsers, tool, reward, one
episode, group rollout, evaluation, data, warm start, the run (set-up and tear-down), one GRPO step
phase by phase, main() with the GRPO loop. A fork for a new task edits the prompt, parsers, tool,
reward and demonstrations; arun_episode's loop and the GRPO step stay as they are.
"""
import ast
import asyncio
import operator
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
from lib.deadlines import in_thread, with_deadline
from lib.client import InferenceClient
from lib.config import load_config
from lib.reward_pool import RewardPool
from lib.run import (Run, RunConfig, checkpoint_due, close_run, finish_training, log_step, open_run, out_of_time,
                     rollout_step, save_checkpoint, start_training, sync_weights, train_step)


@dataclass
class Config(RunConfig):  # the run's fields (servers, trainer, GRPO, async, logging) are lib/run.py's RunConfig
    # == the calculator task ==
    run_dir: str = "runs/calc"  # metrics.jsonl, traces.jsonl, evals/, checkpoints/, final/
    data_dir: str = ""  # dir of {train,dev,test}.jsonl rows {"question", "answer": "... #### N"}; "" = bundled problems
    bundled_numbers: str = "small"  # bundled problems' numbers: "small" (1-2 digits) or "large" (3-4 digits, 2-4 steps: mental arithmetic fails)
    use_tool: bool = True  # False: the no-tool baseline (no calculator in the prompt, the demonstrations or the episode)
    reward_timeout_s: float = 5.0  # per call; a timeout scores 0 and is counted
    reward_workers: int = 1  # processes of the reward pool


# --- prompt ---
PROMPT_TEMPLATE = "{question}\nUse <calc> expression </calc> to calculate. Put the final answer after ####."
NO_TOOL_PROMPT_TEMPLATE = "{question}\nPut the final answer after ####."  # --use_tool False: the baseline
STOP_STRINGS = ["</calc>"]  # a turn that ends here is a calculator call
RESULT_TEMPLATE = "<result> {} </result>"  # the calculator's answer, appended after the call


def build_prompt_ids(tokenizer, question: str, cfg: Config) -> list[int]:
    text = (PROMPT_TEMPLATE if cfg.use_tool else NO_TOOL_PROMPT_TEMPLATE).format(question=question)
    if cfg.apply_chat_template and tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --- parsers ---
# Model output is untrusted: plain string search and linear-time regexes, nothing evaluated.
_ANSWER = re.compile(r"[ \t]*(-?\d+(?:,\d{3})*(?:\.\d+)?)(?!\d)")
_MAX_NUMBER_CHARS = 64  # gold answers are short; longer "numbers" are junk and costly to convert


def parse_calc(text: str) -> str | None:
    """The expression of the last complete `<calc> ... </calc>` (a turn ends at the first)."""
    end = text.rfind("</calc>")
    start = text.rfind("<calc>", 0, end) if end >= 0 else -1
    return text[start + len("<calc>"):end].strip() if start >= 0 else None


def to_fraction(token: str) -> Fraction | None:
    token = token.replace(",", "").strip()
    if not token or len(token) > _MAX_NUMBER_CHARS:
        return None
    try:
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


def parse_answer(text: str) -> Fraction | None:
    """The number after the last `####` (`1,000`, `-3`, `2.5`); None when there is none."""
    marker = text.rfind("####")
    found = _ANSWER.match(text, marker + 4) if marker >= 0 else None
    return to_fraction(found.group(1)) if found else None


# --- tool: the calculator ---
# The expression is parsed with `ast` (which runs nothing) and walked by hand: numbers, + - * /,
# parentheses, unary minus. No `**` (9**9**9 would take forever), and every number, given or
# intermediate, is bounded, so a call costs microseconds and runs inline in the episode.
MAX_EXPRESSION_CHARS = 200
MAX_DEPTH = 32  # of nested operations: (1 + (2 + ...)) and chains 1 + 2 + ...
MAX_MAGNITUDE = 10**15  # of every number's numerator and denominator
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class CalcError(ValueError):
    pass


def _evaluate(node: ast.AST, depth: int) -> Fraction:
    if depth > MAX_DEPTH:
        raise CalcError("expression nested too deeply")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = Fraction(repr(node.value))  # repr: 0.1 is 1/10, not the float's binary fraction
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = -_evaluate(node.operand, depth + 1)
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left, depth + 1), _evaluate(node.right, depth + 1)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalcError("division by zero")
        value = _OPS[type(node.op)](left, right)
    else:
        raise CalcError("only numbers, + - * / and parentheses are allowed")
    if abs(value.numerator) > MAX_MAGNITUDE or value.denominator > MAX_MAGNITUDE:
        raise CalcError("number out of range")
    return value


def format_number(x: Fraction) -> str:
    """84, 3.5, or 1/3 when the decimal does not end: exact, so the model can copy it into `#### N`."""
    if x.denominator == 1:
        return str(x.numerator)
    decimal = f"{float(x):.12f}".rstrip("0")
    return decimal if Fraction(decimal) == x else f"{x.numerator}/{x.denominator}"


def calculate(expression: str) -> str:
    """The calculator: the value of `expression`, or `error: ...`. Never raises, never runs its input."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: expression longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        return format_number(_evaluate(ast.parse(expression.strip(), mode="eval").body, 0))
    except CalcError as e:
        return f"error: {e}"
    except (SyntaxError, ValueError, TypeError, OverflowError, MemoryError, RecursionError):
        return "error: not an arithmetic expression"


# --- reward ---
def reward_fn(completion: str, answer: str) -> float:
    """1 if the number after the last `####` equals GSM8K's gold (after its last `####`), else 0."""
    pred, gold = parse_answer(completion), to_fraction(answer.rsplit("####", 1)[-1])
    return float(pred is not None and gold is not None and pred == gold)


# --- one episode ---
async def arun_episode(client: InferenceClient, tokenizer, reward_pool: RewardPool, cfg: Config, item: dict,
                       temperature: float, trajectory_id: str | None = None) -> dict:
    """One trajectory (docs/trajectory.md): turns until one ends without a calculator call (at EOS).
    Token ids in, token ids out: generated tokens enter the trajectory exactly as the server sampled
    them, with its log-probs; each `<result>` is tokenized on its own, with loss_mask 0. A turn is
    one `client.generate` call: its pieces (`max_new_tokens_per_turn` each) are joined by the client
    and end at the first `</calc>` or EOS id across all of them."""
    prompt_ids = build_prompt_ids(tokenizer, item["question"], cfg)
    input_ids, loss_mask, logprobs, versions = list(prompt_ids), [0] * len(prompt_ids), [0.0] * len(prompt_ids), [-1] * len(prompt_ids)

    def append(ids, lps=None, vers=None):
        input_ids.extend(ids)
        loss_mask.extend([1 if lps is not None else 0] * len(ids))
        logprobs.extend(lps if lps is not None else [0.0] * len(ids))
        versions.extend(vers if vers is not None else [-1] * len(ids))

    trajectory_id = trajectory_id or uuid.uuid4().hex  # a training item's: "<item index>/<sample>" (seeded_sampling)
    finish, turns, tool_calls, tool_failures, texts = "max_turns", 0, 0, 0, []
    try:
        for _ in range(cfg.max_turns):
            budget = cfg.max_tokens - len(input_ids)
            if budget <= 0:
                finish = "max_tokens"
                break
            gen = await client.generate(
                input_ids, max_new_tokens=budget, piece_tokens=cfg.max_new_tokens_per_turn, temperature=temperature,
                stop=STOP_STRINGS if cfg.use_tool else [],
                stop_token_ids=cfg.stop_token_ids or [tokenizer.eos_token_id], trajectory_id=trajectory_id)
            turns += 1
            append(gen.output_ids, gen.logprobs, gen.versions)
            text = tokenizer.decode(gen.output_ids, skip_special_tokens=True)
            texts.append(("model", text))
            expression = parse_calc(text) if cfg.use_tool else None
            if expression is None:  # the turn ended at EOS (the answer) or at the context budget
                finish = "max_tokens" if gen.finish_reason == "length" else "answer"
                break
            # In a thread, off the event loop: a tool that hangs then stops only its own episode, at its
            # deadline (episode_timeout_s), not every episode of the step.
            result = await in_thread(calculate, expression)
            tool_calls, tool_failures = tool_calls + 1, tool_failures + result.startswith("error")
            texts.append(("tool", result))
            result_ids = tokenizer(RESULT_TEMPLATE.format(result), add_special_tokens=False)["input_ids"]
            if len(input_ids) + len(result_ids) >= cfg.max_tokens:
                finish = "max_tokens"
                break
            append(result_ids)
    finally:
        client.end_trajectory(trajectory_id)
    completion = "".join(text for role, text in texts if role == "model")
    reward = await reward_pool.score(reward_fn, completion, item["answer"])
    t = lambda xs, dtype: torch.tensor([xs], dtype=dtype)  # noqa: E731
    return {
        "input_ids": t(input_ids, torch.long),
        "loss_mask": t(loss_mask, torch.long),
        "logprobs": t(logprobs, torch.float32),
        "versions": t(versions, torch.long),
        "attention_mask": torch.ones(1, len(input_ids), dtype=torch.long),
        "rewards": torch.tensor([reward], dtype=torch.float32),
        "num_turns": turns,
        "num_tool_calls": tool_calls,
        "num_tool_failures": tool_failures,  # calls answered with an error
        "finish_reason": finish,
        "answer": str(answer) if (answer := parse_answer(completion)) is not None else None,
        "question": item["question"],
        "category": item.get("category"),  # an optional field of the item: evaluations break down by it
        "gold": item["answer"],
        "turn_texts": texts,
    }


# --- group rollout ---
async def rollout_group(client, tokenizer, reward_pool, cfg, item, temperature, group_size) -> list[dict]:
    # Each episode under its deadline: one that runs past it fails the group (dropped and counted).
    return list(await asyncio.gather(*[
        with_deadline(arun_episode(client, tokenizer, reward_pool, cfg, item, temperature,
                                   trajectory_id=f"{item['index']}/{k}" if "index" in item else None),
                      cfg.episode_timeout_s, item) for k in range(group_size)]))


async def rollout_groups(client, tokenizer, reward_pool, cfg, items, temperature, group_size):
    """(groups, number of failed groups): all at once; a group with a failed episode is dropped and counted."""
    return await gather_groups([rollout_group(client, tokenizer, reward_pool, cfg, item, temperature, group_size)
                                for item in items])


# --- evaluation ---
async def evaluate(client, tokenizer, reward_pool, cfg, items) -> tuple[list[dict], dict]:
    """Greedy, one episode per question: (the episodes, their metrics)."""
    groups, failed = await rollout_groups(client, tokenizer, reward_pool, cfg, items, 0.0, 1)
    episodes = [g[0] for g in groups]
    return episodes, {
        "failed": failed,
        "accuracy": float(np.mean([e["rewards"].item() for e in episodes])),
        "tool_calls": float(np.mean([e["num_tool_calls"] for e in episodes])),
        "tool_failures": float(np.mean([e["num_tool_failures"] for e in episodes])),
        "max_tokens_hit": float(np.mean([e["finish_reason"] == "max_tokens" for e in episodes])),
    }


def episode_metrics(episodes: list[dict]) -> dict:
    """The task's metrics of a training rollout (logged under rollout/)."""
    return {"tool_calls": float(np.mean([e["num_tool_calls"] for e in episodes])),
            "tool_failures": float(np.mean([e["num_tool_failures"] for e in episodes]))}


# --- data ---
def load_splits(cfg: Config) -> dict[str, list[dict]]:
    """train/dev/test lists of {"question", "answer"} (GSM8K's columns). GSM8K itself from the hub,
    or parquet files: copy load_splits from train_reflect.py."""
    from lib.math_data import default_math_dir, read_split

    data_dir = cfg.data_dir or default_math_dir(seed=0, numbers=cfg.bundled_numbers)
    return {split: read_split(data_dir, split) for split in ("train", "dev", "test")}


# --- warm start ---
_WORKED_STEP = re.compile(r"(\d+(?: [-+*/] \d+)+) = -?\d+")  # "3 + 4 = 7" in the bundled gold solutions


def build_demonstrations(tokenizer, cfg: Config, items: list[dict]) -> list[dict]:
    """Successful trajectories for SFT, tokenized piece by piece as arun_episode builds them, in the
    model's own chat template: each worked step `3 + 4 = 7` of a gold solution becomes a model piece
    ending in `<calc> 3 + 4 </calc>` (loss_mask 1) and the tool piece `<result> 7 </result>` (0); the
    final `#### N` and the template's end-of-turn close it. Without the tool (`use_tool` False) the
    gold solution is the model's one piece. The prompt is not trained on: here copying formed sooner
    without it (dev 0.20 vs 0.11 after 300 of 1000 SFT steps, 0.94 vs 0.76 after 1000; H100, one
    seed), unlike train_reflect.py's."""
    from lib.warm_start import end_of_turn_ids

    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    end_of_turn = end_of_turn_ids(tokenizer)
    examples = []
    for item in items:
        ids = build_prompt_ids(tokenizer, item["question"], cfg)
        mask = [0] * len(ids)
        pieces = _WORKED_STEP.split(item["answer"]) if cfg.use_tool else [item["answer"]]  # text, expression, ..., text
        for text, expression in zip(pieces[0:-1:2], pieces[1::2]):
            model_ids = encode(f"{text}<calc> {expression} </calc>")
            tool_ids = encode(RESULT_TEMPLATE.format(calculate(expression)))
            ids, mask = ids + model_ids + tool_ids, mask + [1] * len(model_ids) + [0] * len(tool_ids)
        final = encode(pieces[-1]) + end_of_turn
        ids, mask = ids + final, mask + [1] * len(final)
        if len(ids) <= cfg.max_tokens:
            examples.append({"input_ids": ids, "loss_mask": mask})
    return examples


def warm_started_model(cfg: Config, base: str, embedded: bool) -> str:
    """`base` after an SFT warm start on demonstrations of the bundled warm-start problems (built once,
    cached under what it trains on), or `base` itself with warm_start_steps 0."""
    from lib.math_data import default_math_dir, read_split
    from lib.warm_start import steps_and_lr, warm_start

    items = read_split(default_math_dir(seed=0, numbers=cfg.bundled_numbers), "warmstart")
    steps, lr = steps_and_lr(cfg.warm_start_steps, cfg.warm_start_lr, embedded, embedded_steps=300)
    return warm_start("calc-warm-start", base, lambda tokenizer: build_demonstrations(tokenizer, cfg, items),
                      steps=steps, lr=lr, batch_size=cfg.warm_start_batch_size, seed=cfg.seed)


# --- the run: lib's plumbing with this task's pieces ---
def setup(cfg: Config) -> Run:
    """lib's run (ranks, model, servers, client, actor, weight sync, resume, logger), then this task's
    reward pool and its rollouts, bound to them."""
    run = open_run(cfg, lambda base, embedded: warm_started_model(cfg, base, embedded), lambda: load_splits(cfg))
    try:
        if run.is_main:
            run.reward_pool = RewardPool(cfg.reward_workers, cfg.reward_timeout_s, preload=reward_fn)
            run.rollout_group = lambda item, temperature, group_size: rollout_group(
                run.client, run.tokenizer, run.reward_pool, run.cfg, item, temperature, group_size)
            run.evaluate = lambda items: evaluate(run.client, run.tokenizer, run.reward_pool, run.cfg, items)
    except BaseException:
        close_run(run)
        raise
    return run


# --- main: the GRPO loop ---
def main(config: str | None = "configs/calc_tiny.yaml", **overrides):
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
            log_step(run, metrics, episodes, batch, tool_failures=lambda e: e["num_tool_failures"])
            progress.update(1)
            if run.is_main:
                progress.set_postfix(reward=f"{metrics['rollout/reward']:.3f}", step_s=f"{metrics['perf/step_s']:.1f}")
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
