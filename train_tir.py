"""Train a tool-integrated reasoning (TIR) agent with GRPO: the model writes Python, a sandbox runs it.

The model solves a GSM8K-style word problem. To compute, it writes a program in a tagged block,
`<code> print(12 * 7) </code>`; the episode runs it in lib.sandbox (a child process with bounded
time, memory, output and processes, no network) and appends what it printed, `<output> 84 </output>`,
and the model goes on; it ends with a final line `#### N`. Reward: 1 if N equals the gold answer
(exact fractions), else 0.

    python train_tir.py                                      # embedded default, CPU, no hub
    python train_tir.py --model_path Qwen/Qwen2.5-1.5B-Instruct --server sglang --trainer_dtype bfloat16

Forked from train_calc.py (`diff train_calc.py train_tir.py` is the task code): the prompt, the
parsers, the tool (a program run in the sandbox, awaited, so the event loop never waits on it), the
demonstrations, and SimpleTIR's void-turn filter (`--filter_void_turns`: an episode with a turn that
has neither code nor an answer is left out of the loss, counted). Sync or async GRPO (`--mode
async`); under torchrun the trainer is sharded (FSDP2). Reads top to bottom: config, prompt,
parsers, tool, reward, one episode, group rollout, evaluation, data, warm start, the run (set-up
and tear-down), one GRPO step phase by phase, main() with the GRPO loop.
"""
import asyncio
import re
import textwrap
import time
import uuid
import weakref
from dataclasses import dataclass
from fractions import Fraction

import fire
import numpy as np
import torch
from tqdm import tqdm

from lib.async_rollout import gather_groups
from lib.deadlines import with_deadline
from lib.client import InferenceClient
from lib.config import load_config
from lib.reward_pool import RewardPool
from lib.run import (Run, RunConfig, checkpoint_due, close_run, finish_training, log_step, open_run, out_of_time,
                     rollout_step, save_checkpoint, start_training, sync_weights, train_step)
from lib.sandbox import arun_python


@dataclass
class Config(RunConfig):  # the run's fields (servers, trainer, GRPO, async, logging) are lib/run.py's RunConfig
    # == the code task ==
    run_dir: str = "runs/tir"  # metrics.jsonl, traces.jsonl, evals/, checkpoints/, final/
    data_dir: str = ""  # dir of {train,dev,test}.jsonl rows {"question", "answer": "... #### N"}; "" = bundled problems
    bundled_numbers: str = "small"  # bundled problems' numbers: "small" (1-2 digits) or "large" (3-4 digits, 2-4 steps: mental arithmetic fails)
    use_tool: bool = True  # False: the no-tool baseline (no code in the prompt or the demonstrations; no program runs)
    reward_timeout_s: float = 5.0  # per call; a timeout scores 0 and is counted
    reward_workers: int = 1  # processes of the reward pool
    # SimpleTIR: an episode with a void turn (one that ended with neither a code block nor a final answer)
    # is left out of the loss; its reward still counts in its group's advantages. Counted in rollout/left_out.
    filter_void_turns: bool = False
    # == the sandbox (lib/sandbox.py) ==
    code_timeout_s: float = 5.0  # wall-clock limit of one program; past it the program is killed: a tool failure
    code_memory_mb: int = 512  # address-space limit of one program
    code_max_output_bytes: int = 65536  # what the sandbox keeps of a program's stdout and stderr
    max_output_chars: int = 256  # what of that goes back into the context, in <output>
    code_concurrency: int = 8  # programs running at once (an evaluation starts hundreds of episodes together)


# --- prompt ---
PROMPT_TEMPLATE = ("{question}\nTo calculate, write a Python program in <code> </code>; what it prints comes back in "
                   "<output> </output>. Put the final answer after ####.")
STOP_STRINGS = ["</code>"]  # a turn that ends here is a program to run
OUTPUT_TEMPLATE = "<output> {} </output>"  # what the program printed (or its error), appended after the block
NO_TOOL_PROMPT_TEMPLATE = "{question}\nPut the final answer after ####."  # --use_tool False: the baseline


def build_prompt_ids(tokenizer, question: str, cfg: Config) -> list[int]:
    text = (PROMPT_TEMPLATE if cfg.use_tool else NO_TOOL_PROMPT_TEMPLATE).format(question=question)
    if cfg.apply_chat_template and tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --- parsers ---
# Model output is untrusted: plain string search and linear-time regexes here; the program itself
# runs only in the sandbox.
_ANSWER = re.compile(r"[ \t]*(-?\d+(?:,\d{3})*(?:\.\d+)?)(?!\d)")
_MAX_NUMBER_CHARS = 64  # gold answers are short; longer "numbers" are junk and costly to convert


def parse_code(text: str) -> str | None:
    """The program of the last complete `<code> ... </code>` (a turn ends at the first), ready to
    run: code on the tag's own line (`<code> print(1) </code>`) loses its leading spaces, a block
    that starts on the next line is dedented as a whole. None when there is no complete block."""
    end = text.rfind("</code>")
    start = text.rfind("<code>", 0, end) if end >= 0 else -1
    if start < 0:
        return None
    first, newline, rest = text[start + len("<code>"):end].partition("\n")
    code = first.lstrip() + newline + rest if first.strip() else textwrap.dedent(rest)
    return code.rstrip()


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


# --- tool: the sandbox ---
# The program runs in a child process (lib.sandbox: time, memory, output, processes and file sizes
# bounded, no network). arun_python is awaited, so the event loop goes on with every other episode
# while it runs; a tool that blocked the loop instead would stall them all.
MAX_CODE_CHARS = 4000  # a longer block is answered with an error and not run
_SANDBOX_RETRIES = 2  # when the sandbox itself fails (not the program): tries after the first, with backoff
_code_slots = weakref.WeakKeyDictionary()  # event loop -> asyncio.Semaphore of cfg.code_concurrency


def format_output(text: str, max_chars: int) -> str:
    """Program output as it goes into the context: stripped, at most `max_chars` characters (a note
    says how much was cut), and valid UTF-8 (a lone surrogate the program printed becomes U+FFFD)."""
    text = text.strip().encode("utf-8", "replace").decode("utf-8")
    if len(text) > max_chars:
        text = f"{text[:max_chars]} ... ({len(text) - max_chars} more characters)"
    return text


async def run_code(code: str, cfg: Config) -> tuple[str, bool]:
    """(the text for `<output>`, whether the program ran to its end with exit status 0). Never raises:
    a program that fails, runs past `code_timeout_s` or is killed answers `error: ...`, which the model
    reads and the episode counts as a tool failure. A run the sandbox could not start or could not
    report on is tried again (`_SANDBOX_RETRIES`, with backoff) before that."""
    if len(code) > MAX_CODE_CHARS:
        return f"error: program longer than {MAX_CODE_CHARS} characters, not run", False
    slots = _code_slots.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(cfg.code_concurrency))
    for attempt in range(_SANDBOX_RETRIES + 1):
        try:
            async with slots:
                result = await arun_python(code, timeout_s=cfg.code_timeout_s, memory_mb=cfg.code_memory_mb,
                                           max_output_bytes=cfg.code_max_output_bytes)
            # No exit status and no limit that stopped it: the sandbox failed around the program.
            not_started = result.returncode is None and not (result.timed_out or result.output_truncated)
        except OSError as e:  # no run at all: out of file descriptors or processes
            result, not_started = f"{type(e).__name__}: {e}", True
        if not not_started:
            break
        await asyncio.sleep(0.1 * 2**attempt)
    if not_started:
        reason = result if isinstance(result, str) else result.error
        return format_output(f"error: the sandbox could not run the program: {reason}", cfg.max_output_chars), False
    if result.timed_out:
        return f"error: the program ran past {cfg.code_timeout_s:g} s and was stopped", False
    if result.returncode != 0:  # the sandbox names a limit it enforced; else a traceback's last line names the exception
        lines = result.stderr.strip().splitlines()
        cause = result.error or (lines[-1] if lines else f"exit status {result.returncode}")
        return format_output(f"error: {cause}", cfg.max_output_chars), False
    return format_output(result.stdout, cfg.max_output_chars), True


# --- reward ---
def reward_fn(completion: str, answer: str) -> float:
    """1 if the number after the last `####` equals GSM8K's gold (after its last `####`), else 0."""
    pred, gold = parse_answer(completion), to_fraction(answer.rsplit("####", 1)[-1])
    return float(pred is not None and gold is not None and pred == gold)


# --- one episode ---
async def arun_episode(client: InferenceClient, tokenizer, reward_pool: RewardPool, cfg: Config, item: dict,
                       temperature: float, trajectory_id: str | None = None) -> dict:
    """One trajectory (docs/trajectory.md): turns until one ends without a code block (at EOS).
    Token ids in, token ids out: generated tokens enter the trajectory exactly as the server sampled
    them, with its log-probs; each `<output>` is tokenized on its own (special tokens the program
    printed stay text), with loss_mask 0. A turn is one `client.generate` call: its pieces
    (`max_new_tokens_per_turn` each) are joined by the client and end at the first `</code>` or EOS
    id across all of them. A turn that ends at EOS with neither a code block nor a final answer is a
    void turn (SimpleTIR), recorded in `void_turn` for `--filter_void_turns`."""
    prompt_ids = build_prompt_ids(tokenizer, item["question"], cfg)
    input_ids, loss_mask, logprobs, versions = list(prompt_ids), [0] * len(prompt_ids), [0.0] * len(prompt_ids), [-1] * len(prompt_ids)

    def append(ids, lps=None, vers=None):
        input_ids.extend(ids)
        loss_mask.extend([1 if lps is not None else 0] * len(ids))
        logprobs.extend(lps if lps is not None else [0.0] * len(ids))
        versions.extend(vers if vers is not None else [-1] * len(ids))

    trajectory_id = trajectory_id or uuid.uuid4().hex  # a training item's: "<item index>/<sample>" (seeded_sampling)
    finish, turns, tool_calls, tool_failures, void_turn, texts = "max_turns", 0, 0, 0, False, []
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
            code = parse_code(text) if cfg.use_tool else None
            if code is None:  # the turn ended at EOS (the answer) or at the context budget
                finish = "max_tokens" if gen.finish_reason == "length" else "answer"
                void_turn = finish == "answer" and parse_answer(text) is None
                break
            # Awaited: the program runs in a child process while the loop serves every other episode.
            result, ok = await run_code(code, cfg)
            tool_calls, tool_failures = tool_calls + 1, tool_failures + (not ok)
            texts.append(("tool", result))
            # split_special_tokens: a program that prints "<|im_end|>" adds text, not an end-of-turn token
            result_ids = tokenizer(OUTPUT_TEMPLATE.format(result), add_special_tokens=False,
                                   split_special_tokens=True)["input_ids"]
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
        "num_tool_failures": tool_failures,  # programs that failed, ran out of time or were not run
        "void_turn": void_turn,  # the last turn ended at EOS with neither code nor an answer
        "finish_reason": finish,
        "answer": str(answer) if (answer := parse_answer(completion)) is not None else None,
        "question": item["question"],
        "category": item.get("category"),  # an optional field of the item: evaluations break down by it
        "gold": item["answer"],
        "turn_texts": texts,
    }


def void_turns(episodes: list[dict]) -> torch.Tensor:
    """SimpleTIR's filter (`filter_void_turns`): the episodes [B] to leave out of the loss, those with a
    void turn. SimpleTIR (Xue et al., 2025) traces the instability of multi-turn TIR training to
    low-probability tokens after tool output and keeps the episodes that show it out of the gradient."""
    return torch.tensor([e["void_turn"] for e in episodes], dtype=torch.bool)


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
        "void_turns": float(np.mean([e["void_turn"] for e in episodes])),
    }


def episode_metrics(episodes: list[dict]) -> dict:
    """The task's metrics of a training rollout (logged under rollout/)."""
    return {"tool_calls": float(np.mean([e["num_tool_calls"] for e in episodes])),
            "tool_failures": float(np.mean([e["num_tool_failures"] for e in episodes])),
            "void_turns": float(np.mean([e["void_turn"] for e in episodes]))}  # fraction of episodes


# --- data ---
def load_splits(cfg: Config) -> dict[str, list[dict]]:
    """train/dev/test lists of {"question", "answer"} (GSM8K's columns). GSM8K itself from the hub,
    or parquet files: copy load_splits from train_reflect.py."""
    from lib.math_data import default_math_dir, read_split

    data_dir = cfg.data_dir or default_math_dir(seed=0, numbers=cfg.bundled_numbers)
    return {split: read_split(data_dir, split) for split in ("train", "dev", "test")}


# --- warm start ---
_WORKED_STEP = re.compile(r"(\d+(?: [-+*/] \d+)+) = (-?\d+)")  # "3 + 4 = 7" in the bundled gold solutions


def printed(expression: str, value: str) -> str:
    """What `print(expression)` shows for a worked step whose gold value is the integer `value`:
    Python's `/` gives a float (`print(24 / 2)` shows 12.0). The demonstrations take the output from
    here, not from running thousands of programs; a test checks it against the sandbox."""
    return str(float(value)) if "/" in expression else str(int(value))


def build_demonstrations(tokenizer, cfg: Config, items: list[dict]) -> list[dict]:
    """Successful trajectories for SFT, tokenized piece by piece as arun_episode builds them: each
    worked step `3 + 4 = 7` of a gold solution becomes a model piece ending in
    `<code> print(3 + 4) </code>` (loss_mask 1) and the tool piece `<output> 7 </output>` (0); the
    final `#### N` and the chat template's end-of-turn close it. Without the tool (`use_tool` False)
    the gold solution is the model's one piece. The prompt is not trained on (as in train_calc.py,
    where copying the question's numbers formed sooner without it)."""
    from lib.warm_start import end_of_turn_ids

    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    end_of_turn = end_of_turn_ids(tokenizer)
    examples = []
    for item in items:
        ids = build_prompt_ids(tokenizer, item["question"], cfg)
        mask = [0] * len(ids)
        pieces = _WORKED_STEP.split(item["answer"]) if cfg.use_tool else [item["answer"]]  # text, expression, value, text, expression, value, ..., text
        for text, expression, value in zip(pieces[0:-1:3], pieces[1::3], pieces[2::3]):
            model_ids = encode(f"{text}<code> print({expression}) </code>")
            tool_ids = encode(OUTPUT_TEMPLATE.format(printed(expression, value)))
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
    return warm_start("tir-warm-start", base, lambda tokenizer: build_demonstrations(tokenizer, cfg, items),
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
def main(config: str | None = "configs/tir_tiny.yaml", **overrides):
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
            batch, episodes, metrics = rollout_step(run, episode_metrics,
                                                    leave_out=void_turns if cfg.filter_void_turns else None)
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
