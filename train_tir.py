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
import dataclasses
import functools
import os
import random
import re
import textwrap
import time
import uuid
import weakref
from dataclasses import dataclass, field
from fractions import Fraction

import fire
import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from lib.actor import Actor
from lib.async_rollout import BackgroundLoop, RolloutProducer, gather_groups, rollout_deadline_s, with_deadline
from lib.checkpoint import read_checkpoint_extra
from lib.client import InferenceClient, model_eos_ids
from lib.config import load_config, to_dict
from lib.eval_records import record_evaluation
from lib.grpo import (equal_reward_groups, grpo_advantages, logprob_mismatch, merge_stats, minibatch_rows,
                      mismatch_warning)
from lib.learnability import learnability_report
from lib.launch import launch_cpu_server, launch_sglang
from lib.metrics import MetricsLogger, continue_jsonl
from lib.model_names import resolve_model_path
from lib.padding import concat_padded_tensors
from lib.ranks import broadcast_from_rank0, init_trainer_ranks, server_seed
from lib.reward_pool import RewardPool
from lib.sandbox import arun_python
from lib.supervise import Supervisor
from lib.tiny_model import default_tiny_model_dir
from lib.traces import trace_records, trainer_logprobs_by_episode, write_traces
from lib.weight_sync import ServerWeightSync


@dataclass
class Config:
    # --- run ---
    run_dir: str = "runs/tir"  # metrics.jsonl, traces.jsonl, checkpoints/, final/
    seed: int = 0
    max_steps: int = 100  # GRPO steps
    time_budget_s: float = 0.0  # stop training after this many seconds (then test); 0 = no limit
    mode: str = "sync"  # "sync": rollout, then update; "async": rollouts keep running during the update
    resume: bool = False  # continue from the latest checkpoint in run_dir
    checkpoint_every: int = 10  # steps; 0 = never
    # --- model and inference server ---
    model_path: str = ""  # a known name (smollm2-135m-instruct), HF dir or hub id; "" = the embedded tiny model
    server: str = "cpu"  # "cpu" (lib/cpu_server), "sglang", or "external" (server_addrs)
    server_addrs: list = field(default_factory=list)  # external servers, ["http://host:port", ...]
    server_device: str = "cpu"  # device of the CPU-capable server ("cuda" works too)
    server_threads: int = 1  # torch threads of the CPU server (the trainer keeps the rest)
    base_gpu_id: int = 1  # first GPU of the SGLang server (the trainer uses GPU 0)
    tp_size: int = 1  # SGLang tensor parallelism
    mem_fraction_static: float | None = None  # SGLang's share of GPU memory (weights + KV cache); None = its default
    sglang_extra_args: str = "--attention-backend triton --sampling-backend pytorch --grammar-backend none"
    trainer_dtype: str = "float32"  # "bfloat16" on GPUs
    trainer_threads: int = 0  # torch threads of the trainer; 0 = torch's default
    # --- data ---
    data_dir: str = ""  # dir of {train,dev,test}.jsonl rows {"question", "answer": "... #### N"}; "" = bundled problems
    bundled_numbers: str = "small"  # bundled problems' numbers: "small" (1-2 digits) or "large" (3-4 digits, 2-4 steps: mental arithmetic fails)
    # --- episode ---
    max_turns: int = 6  # model turns per episode; every code block ends one
    max_tokens: int = 512  # context budget of one episode: prompt + all turns + program outputs
    max_new_tokens_per_turn: int = 64  # tokens per generation request; a turn cut by it goes on while the budget lasts
    stop_token_ids: list = field(default_factory=list)  # ids that end a turn; [] = the model's EOS set (tokenizer + generation_config)
    temperature: float = 1.0
    apply_chat_template: bool = True  # wrap the prompt in the tokenizer's chat template
    use_tool: bool = True  # False: the no-tool baseline (no code in the prompt or the demonstrations; no program runs)
    # One episode's deadline, from its start (which includes waiting for the server behind every other
    # episode started with it): past it the episode is cancelled and its group fails, counted in
    # rollout/failed_groups, instead of hanging the run; 0 = none. The longest wait of the embedded default
    # is the test evaluation's, 500 episodes at once: 137 s on 2 busy CPU cores with every episode at its
    # 256-token budget (the untrained model). Raise it for big evaluations on a slow server.
    episode_timeout_s: float = 600.0
    # --- tool: the sandbox (lib/sandbox.py) ---
    code_timeout_s: float = 5.0  # wall-clock limit of one program; past it the program is killed: a tool failure
    code_memory_mb: int = 512  # address-space limit of one program
    code_max_output_bytes: int = 65536  # what the sandbox keeps of a program's stdout and stderr
    max_output_chars: int = 256  # what of that goes back into the context, in <output>
    code_concurrency: int = 8  # programs running at once (an evaluation starts hundreds of episodes together)
    # --- reward ---
    reward_timeout_s: float = 5.0  # per call; a timeout scores 0 and is counted
    reward_workers: int = 1  # processes of the reward pool
    # --- GRPO ---
    batch_size: int = 8  # questions per step
    group_size: int = 4  # episodes per question
    lr: float = 1e-6
    grad_clip: float = 1.0
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.28
    scale_adv_by_std: bool = True  # divide by the group's reward std; Dr. GRPO: False, with loss_agg seq-mean-token-sum-norm
    drop_equal_groups: bool = False  # dynamic sampling (DAPO): drop groups whose rewards are all equal, refill the batch
    refill_rounds: int = 2  # dynamic sampling: at most this many more rollouts per step to refill the batch
    neg_adv_scale: float = 1.0  # weight of below-average episodes; 0 = learn from the better ones only
    ppo_minibatches: int = 1  # optimizer steps per batch, each on a random 1/N of the rows (PPO clipping then acts)
    # SimpleTIR: an episode with a void turn (one that ended with neither a code block nor a final answer)
    # is left out of the loss; its reward still counts in its group's advantages. Counted in rollout/void_filtered.
    filter_void_turns: bool = False
    loss_agg: str = "token-mean"  # DAPO's; "seq-mean-token-mean" (GRPO), "seq-mean-token-sum-norm" (Dr. GRPO)
    behav_imp_weight_cap: float = 2.0  # cap of the server->trainer importance weight per token; 0 = no cap
    behav_imp_weight_mode: str = "truncate"  # above the cap: "truncate" to it (TIS) or "mask" the token out (AReaL)
    max_tokens_per_mb: int = 16384  # micro-batch token budget of the trainer
    pack_sequences: bool | None = None  # padding-free rows (varlen attention); None: on GPUs only (padded rows are faster on CPU)
    attn_implementation: str | None = None  # trainer attention: None = lib's varlen when packed, else sdpa
    trainer_gradient_checkpointing: bool = False  # recompute activations in backward: ~half the memory, ~20% slower
    trainer_compile: bool | None = None  # torch.compile the decoder layers; None = on with one GPU
    trainer_offload_optimizer: bool = False  # bf16, one GPU: fp32 master + AdamW state in CPU memory between updates
    weight_sync: str = "disk"  # "disk" (safetensors + /update_weights_from_disk) or "nccl" (broadcast; gloo on CPUs)
    # --- async mode ---
    # a group starts only if a step within max_staleness versions will train it (nothing generated
    # is dropped as stale), and the trainer takes the oldest groups first (lib/async_rollout.py)
    max_staleness: int = 1  # every token is trained at most this many versions after its weights'
    async_capacity: int = 0  # groups started and not yet trained on; 0 = (max_staleness + 1) x batch_size
    # how the weight sync pauses the server: "in_place" holds in-flight requests (their KV stays) and
    # they go on under the new weights, "abort" cuts them (the client re-sends prompt + output) and
    # flushes the prefix cache (docs/client.md)
    pause_mode: str = "in_place"
    # each request names its policy version as SGLang's prefix-cache namespace (`extra_key`), so no
    # prefix cached under other weights is reused; False: old prefixes are reused (servers without extra_key)
    prefix_cache_per_version: bool = True
    # --- warm start (SFT on demonstrations from gold solutions, before GRPO; any model) ---
    warm_start_steps: int | None = None  # 0 = no warm start; None = 300 for the embedded tiny model, 0 for a pretrained one
    warm_start_lr: float | None = None  # None = 2e-3 for the embedded tiny model, 5e-5 for a pretrained one
    warm_start_batch_size: int = 16
    # --- evaluation and logging ---
    eval_every: int = 10  # steps; 0 = only at the end
    eval_size: int = 200  # dev questions per evaluation
    test_size: int = 500  # test questions at the end
    test_at_start: bool = False  # also the test split before the first step (a learning curve's starting point)
    # before the first step, group_size samples of each dev question at the training temperature: pass@k,
    # the share of groups whose rewards differ (GRPO's signal) and a verdict (lib/learnability.py)
    learnability_probe: bool = False
    trace_every: int = 1  # write trajectories (traces.jsonl, token by token) every N steps; 0 = never
    trace_groups: int = 1  # groups traced per traced step (group_size episodes each)
    trace_backend: str = "jsonl"  # "jsonl", or "mlflow": metrics and traces also go to MLflow (run_dir/mlflow.db)
    tensorboard: bool = True
    wandb_project: str | None = None


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
                       temperature: float) -> dict:
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

    trajectory_id = uuid.uuid4().hex
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


def drop_void_turns(keep: torch.Tensor, episodes: list[dict]) -> tuple[torch.Tensor, int]:
    """SimpleTIR's filter: `keep [B]` without the episodes that have a void turn, and how many of the
    kept it took out. SimpleTIR (Xue et al., 2025) traces the instability of multi-turn TIR training to
    low-probability tokens after tool output and keeps the episodes that show it (a void turn) out
    of the gradient."""
    void = torch.tensor([e["void_turn"] for e in episodes], dtype=torch.bool)
    return keep & ~void, int((keep & void).sum())


# --- group rollout ---
def rewards_all_equal(group: list[dict]) -> bool:
    """No learning signal in this group: GRPO gives every episode advantage 0."""
    return bool(equal_reward_groups(torch.cat([e["rewards"] for e in group]), len(group)).all())


async def rollout_group(client, tokenizer, reward_pool, cfg, item, temperature, group_size) -> list[dict]:
    # Each episode under its deadline: one that runs past it fails the group (dropped and counted).
    return list(await asyncio.gather(*[
        with_deadline(arun_episode(client, tokenizer, reward_pool, cfg, item, temperature), cfg.episode_timeout_s, item)
        for _ in range(group_size)]))


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


# --- the run: set-up and tear-down ---
@dataclass
class Run:
    """What the loop touches: built by setup(), closed by close(). Under torchrun rank 0 alone holds
    the server, the client, the reward pool, the rollouts, the logger and the trace file (None on
    the other ranks); every rank holds its shard of the actor."""
    cfg: Config
    rank: int = 0
    world_size: int = 1
    cpu_group: object = None  # gloo group for Python objects under torchrun
    tokenizer: object = None
    train_items: list = None
    dev_items: list = None
    test_items: list = None
    supervisors: list = field(default_factory=list)  # of the servers launched here
    bg: BackgroundLoop = None  # the event loop of every client call and episode
    client: InferenceClient = None
    reward_pool: RewardPool = None
    actor: Actor = None
    weight_sync: ServerWeightSync = None
    producer: RolloutProducer = None  # async mode
    logger: MetricsLogger = None
    trace_file: object = None
    ckpt_dir: str = ""
    resumed: bool = False
    step: int = 0
    version: int = 0  # policy version: weight syncs so far
    data_position: int = 0  # index of the next train item
    reward_counts: tuple = (0, 0)  # the reward pool's (timeouts, failures) when this step's rollout began

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def check_config(cfg: Config):
    if cfg.trace_backend not in ("jsonl", "mlflow"):
        raise ValueError(f"trace_backend must be 'jsonl' or 'mlflow', got {cfg.trace_backend!r}")
    if cfg.mode not in ("sync", "async"):
        raise ValueError(f"mode must be 'sync' or 'async', got {cfg.mode!r}")
    if cfg.pause_mode not in ("in_place", "abort", "retract"):
        raise ValueError(f"pause_mode must be 'in_place', 'abort' or 'retract', got {cfg.pause_mode!r}")
    if cfg.weight_sync not in ("disk", "nccl"):
        raise ValueError(f"weight_sync must be 'disk' or 'nccl', got {cfg.weight_sync!r}")
    if cfg.server not in ("cpu", "sglang", "external"):
        raise ValueError(f"server must be 'cpu', 'sglang' or 'external', got {cfg.server!r}")
    if cfg.behav_imp_weight_mode not in ("truncate", "mask"):
        raise ValueError(f"behav_imp_weight_mode must be 'truncate' or 'mask', got {cfg.behav_imp_weight_mode!r}")


def setup(cfg: Config) -> Run:
    """Ranks, seeds, model, data, servers, client, actor, weight sync, the resumed checkpoint, the
    logger and (async mode) the rollout producer. If any of it fails, what was opened is closed."""
    check_config(cfg)
    # Under torchrun every rank holds a shard of the model (FSDP2, lib/actor.py); rank 0 alone runs the
    # server, the rollouts, the rewards, evaluation and logging; every rank trains on its rows of rank 0's batch.
    world_size, rank, cpu_group = init_trainer_ranks()
    run = Run(cfg, rank=rank, world_size=world_size, cpu_group=cpu_group)
    try:
        _setup(run)
    except BaseException:
        close(run)
        raise
    return run


def _setup(run: Run):
    cfg, is_main = run.cfg, run.is_main
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.trainer_threads:
        torch.set_num_threads(cfg.trainer_threads)
    os.makedirs(cfg.run_dir, exist_ok=True)
    from transformers import AutoTokenizer

    if not is_main:
        dist.barrier()  # rank 0 builds the cache first; the others then find it there
    # a known name is built once and cached; then the warm start (cached too), if the run has one
    model_path = warm_started_model(cfg, resolve_model_path(cfg.model_path) or default_tiny_model_dir(),
                                    embedded=not cfg.model_path)
    if is_main and run.world_size > 1:
        dist.barrier()
    run.tokenizer = AutoTokenizer.from_pretrained(model_path)
    if not cfg.stop_token_ids:  # a turn ends on any of the model's EOS ids (Qwen2.5: <|im_end|> and <|endoftext|>)
        cfg = run.cfg = dataclasses.replace(cfg, stop_token_ids=model_eos_ids(model_path, run.tokenizer))
    splits = load_splits(cfg)
    run.train_items, run.dev_items, run.test_items = (splits["train"], splits["dev"][: cfg.eval_size],
                                                      splits["test"][: cfg.test_size])

    # Servers (rank 0): started here and killed with this process, or given by the user. A resumed run
    # seeds the server's sampling by its step, so it does not replay the start of the run.
    run.ckpt_dir = os.path.join(cfg.run_dir, "checkpoints")
    resume_extra = read_checkpoint_extra(os.path.join(run.ckpt_dir, "latest")) if cfg.resume else None
    sampling_seed = server_seed(cfg.seed, resume_extra["step"] if resume_extra else 0)
    # The launched server is supervised (lib/supervise.py): if it dies, the run stops with its log.
    addrs = []
    if is_main and cfg.server == "external":
        addrs = list(cfg.server_addrs)
    elif is_main and cfg.server == "sglang":
        server = launch_sglang(model_path, base_gpu_id=cfg.base_gpu_id, tp_size=cfg.tp_size,
                               mem_fraction_static=cfg.mem_fraction_static, random_seed=sampling_seed,
                               extra_args=cfg.sglang_extra_args.split(),
                               log_path=os.path.join(cfg.run_dir, "sglang.log"))
        run.supervisors.append(Supervisor("inference server", server))
        addrs = [server.address]
    elif is_main:
        server = launch_cpu_server(model_path, device=cfg.server_device, num_threads=cfg.server_threads,
                                   random_seed=sampling_seed, log_path=os.path.join(cfg.run_dir, "cpu_server.log"))
        run.supervisors.append(Supervisor("inference server", server))
        addrs = [server.address]

    # Every client call runs on one event loop in a background thread, so in async mode the
    # trainer (this thread) can update while episodes run.
    run.bg = BackgroundLoop()
    if is_main:
        run.client = InferenceClient(addrs, version_cache_key=cfg.prefix_cache_per_version)
        run.reward_pool = RewardPool(cfg.reward_workers, cfg.reward_timeout_s, preload=reward_fn)
    run.actor = Actor(model_path, lr=cfg.lr, grad_clip=cfg.grad_clip,
                      temperature=cfg.temperature, max_tokens_per_mb=cfg.max_tokens_per_mb, dtype=cfg.trainer_dtype,
                      eps_clip_low=cfg.eps_clip_low, eps_clip_high=cfg.eps_clip_high, loss_agg=cfg.loss_agg,
                      loss_norm_tokens=cfg.max_tokens,
                      packed=cfg.pack_sequences, attn_implementation=cfg.attn_implementation,
                      gradient_checkpointing=cfg.trainer_gradient_checkpointing, compile_layers=cfg.trainer_compile,
                      offload_optimizer=cfg.trainer_offload_optimizer,
                      behaviour_weight_cap=cfg.behav_imp_weight_cap or None,
                      behaviour_cap_mode=cfg.behav_imp_weight_mode)

    # Weight sync (lib/weight_sync.py): "disk" = safetensors + /update_weights_from_disk; "nccl" = the
    # trainer and the server's TP workers join one process group once, then each step broadcasts the
    # new weights (NCCL on GPUs, gloo on CPUs).
    run.weight_sync = ServerWeightSync(cfg.weight_sync, run.actor, run.client, run.bg.run, num_servers=len(addrs),
                                       tp_size=cfg.tp_size, disk_dir=os.path.join(cfg.run_dir, "weights"))

    if cfg.resume and resume_extra is None:
        print(f"--resume True: no checkpoint in {run.ckpt_dir}; starting from step 0")
    if resume_extra is not None:
        extra = run.actor.load_checkpoint(os.path.join(run.ckpt_dir, "latest"))
        run.step, run.version, run.data_position = extra["step"], extra["version"], extra["data_position"]
        random.setstate(extra["python_rng"])
        np.random.set_state(extra["numpy_rng"])
        torch.set_rng_state(extra["torch_rng"])
        # The server still holds the initial weights: give it the resumed policy.
        run.weight_sync.sync(run.version)
        run.resumed = True
        if is_main:
            print(f"resumed from step {run.step} (policy version {run.version}, data position "
                  f"{run.data_position}); server sampling seed {sampling_seed}")
    if is_main:
        run.client.set_version(run.version)
        # One run per file: a fresh start moves an earlier run's rows aside, a resume drops the rows of
        # steps after its checkpoint (they are about to be run again).
        resume_step = run.step if run.resumed else None
        run.logger = MetricsLogger(cfg.run_dir, to_dict(cfg), tensorboard=cfg.tensorboard,
                                   wandb_project=cfg.wandb_project, resume_step=resume_step,
                                   mlflow=cfg.trace_backend == "mlflow")
        run.trace_file = open(continue_jsonl(os.path.join(cfg.run_dir, "traces.jsonl"), resume_step), "a")
        if cfg.mode == "async":
            run.producer = RolloutProducer(
                run.bg, lambda item: rollout_group(*episode_args(run), item, cfg.temperature, cfg.group_size),
                functools.partial(item_at, run), capacity=cfg.async_capacity or (cfg.max_staleness + 1) * cfg.batch_size,
                max_staleness=cfg.max_staleness, batch_groups=cfg.batch_size, start_index=run.data_position,
                version=run.version)


def close(run: Run):
    """Everything setup() opened, in reverse order; also after an error, when some of it may be missing."""
    try:
        if run.producer is not None:
            run.producer.stop()
        for opened in (run.trace_file, run.logger, run.reward_pool):
            if opened is not None:
                opened.close()
        if run.weight_sync is not None:
            run.weight_sync.close()
        if run.client is not None:
            run.bg.run(run.client.close(), timeout_s=30)
    finally:
        if run.bg is not None:
            run.bg.close()
        for s in run.supervisors:
            s.stop()
        if run.world_size > 1:
            dist.destroy_process_group()


@functools.lru_cache(maxsize=2)
def epoch_order(seed: int, num_items: int) -> np.ndarray:
    return np.random.RandomState(seed).permutation(num_items)


def item_at(run: Run, index: int) -> dict:
    # The data order is a function of (seed, index), so a resumed run sees the same questions.
    epoch, offset = divmod(index, len(run.train_items))
    return {**run.train_items[epoch_order(run.cfg.seed + epoch, len(run.train_items))[offset]], "index": index}


def episode_args(run: Run) -> tuple:
    """What rollout_group and evaluate take before the items."""
    return run.client, run.tokenizer, run.reward_pool, run.cfg


def run_rollout(run: Run, rollout, what: str):
    # A rollout starts all its episodes at once, so it ends by their deadline; if not, the event
    # loop is stuck: the run stops, naming the episodes still running and where each is.
    return run.bg.run(rollout, timeout_s=rollout_deadline_s(run.cfg.episode_timeout_s), what=what)


# --- one GRPO step ---
def take_groups(run: Run, num_groups: int, what: str) -> tuple[list, int]:
    """(groups, how many failed): sync mode rolls out the next items now; async mode takes the
    oldest groups the producer has been generating."""
    if run.producer is not None:
        failed_before = run.producer.num_failed
        groups = run.producer.get_groups(num_groups, timeout_s=rollout_deadline_s(run.cfg.episode_timeout_s))
        run.data_position = run.producer.data_position()
        return groups, run.producer.num_failed - failed_before
    items = [item_at(run, run.data_position + i) for i in range(num_groups)]
    try:
        groups, failed = run_rollout(run, rollout_groups(*episode_args(run), items, run.cfg.temperature,
                                                         run.cfg.group_size), what)
    except RuntimeError:
        for s in run.supervisors:
            s.check()  # a dead server is the clearer cause
        raise
    run.data_position += num_groups
    return groups, failed


def advantages_and_keep(cfg: Config, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GRPO advantages [B] (below-average ones weighted by neg_adv_scale), whether each row's group
    has all-equal rewards [B], and the rows to train [B] (dynamic sampling drops those groups)."""
    adv = grpo_advantages(rewards, cfg.group_size, scale_by_std=cfg.scale_adv_by_std)
    equal = equal_reward_groups(rewards, cfg.group_size)
    keep = ~equal if cfg.drop_equal_groups else torch.ones_like(equal)
    return torch.where(adv < 0, adv * cfg.neg_adv_scale, adv), equal, keep


def rollout_step(run: Run) -> tuple[dict, list[dict], dict]:
    """1. rollout and 2. advantages, on rank 0; then every rank gets the rows to train. Returns
    (batch: the kept rows, on every rank, {} when there are fewer than ranks: nothing to train;
    episodes: rank 0's, each with its `advantages [1]` and `keep [1]`; the rollout's metrics)."""
    cfg, batch, episodes, metrics = run.cfg, None, [], {}
    if run.is_main:
        for s in run.supervisors:
            s.check()
        run.reward_counts = (run.reward_pool.num_timeouts, run.reward_pool.num_failures)
        # 1. rollout: sync mode runs this step's groups now; async mode takes groups that have
        # been generating in the background, dropping any that are too stale.
        # A group with a failed episode (server error, abort, past episode_timeout_s) is dropped
        # and counted, never trained on.
        wasted_before = run.producer.num_wasted_tokens if run.producer else 0
        groups, failed_groups = take_groups(run, cfg.batch_size, f"step {run.step + 1}'s rollout")
        # dynamic sampling (DAPO): a group whose rewards are all equal has no learning signal;
        # more groups are rolled out (at most `refill_rounds` times) until batch_size have some
        for _ in range(cfg.refill_rounds if cfg.drop_equal_groups else 0):
            missing = cfg.batch_size - sum(not rewards_all_equal(g) for g in groups)
            if missing <= 0:
                break
            more, failed = take_groups(run, missing, f"step {run.step + 1}'s refill")
            groups, failed_groups = groups + more, failed_groups + failed
        episodes = [e for g in groups for e in g]
        full = concat_padded_tensors([{k: v for k, v in e.items() if isinstance(v, torch.Tensor)} for e in episodes])
        rewards = full["rewards"]
        # a token's staleness: the version this step trains at minus the version that sampled it
        token_staleness = (run.version - full["versions"])[full["loss_mask"].bool()].float()

        # 2. advantages (per sequence, broadcast over its tokens by the loss); a group whose
        # rewards are all equal has advantage exactly 0, and dynamic sampling drops it
        full["advantages"], equal, keep = advantages_and_keep(cfg, rewards)
        void_filtered = 0
        if cfg.filter_void_turns:  # out of the loss; their rewards counted in the advantages above
            keep, void_filtered = drop_void_turns(keep, episodes)
        if equal.all():
            tqdm.write(f"step {run.step + 1}: every group's rewards are equal: no learning signal this step")
        batch = {k: v[keep] for k, v in full.items()}
        for i, e in enumerate(episodes):  # for the traces (tensors: out of a trace record's stats)
            e["advantages"], e["keep"] = full["advantages"][i:i + 1], keep[i:i + 1]
        metrics = {
            "rollout/reward": rewards.mean().item(),
            "rollout/tool_calls": float(np.mean([e["num_tool_calls"] for e in episodes])),
            "rollout/tool_failures": float(np.mean([e["num_tool_failures"] for e in episodes])),
            "rollout/void_turns": float(np.mean([e["void_turn"] for e in episodes])),  # fraction of episodes
            "rollout/void_filtered": void_filtered,  # episodes left out of the loss for it
            "rollout/turns": float(np.mean([e["num_turns"] for e in episodes])),
            "rollout/max_tokens_hit": float(np.mean([e["finish_reason"] == "max_tokens" for e in episodes])),
            "rollout/seq_len": full["attention_mask"].sum(1).float().mean().item(),
            "rollout/gen_tokens": int(full["loss_mask"].sum()),
            "rollout/kept_groups": int(keep.sum()) // cfg.group_size,
            "rollout/equal_reward_groups": int(equal.sum()) // cfg.group_size,
            "rollout/staleness_mean": token_staleness.mean().item() if token_staleness.numel() else 0.0,
            "rollout/staleness_max": token_staleness.max().item() if token_staleness.numel() else 0.0,
            # sampled tokens not trained on: of groups dropped as stale or by dynamic sampling, of void turns
            "rollout/wasted_tokens": (run.producer.num_wasted_tokens if run.producer else 0) - wasted_before
                                     + int(full["loss_mask"][~keep].sum()),
            "rollout/failed_groups": failed_groups,
        }
    batch = broadcast_from_rank0(batch, run.cpu_group)
    return (batch if len(batch["rewards"]) >= run.world_size else {}), episodes, metrics  # a row for every rank


def train_step(run: Run, batch: dict) -> dict:
    """3. proximal log-probs and 4. the PPO update, on this rank's rows of `batch` (none: nothing
    to train). This rank's proximal log-probs go to `batch["rank_proximal_logprobs"]` for the traces."""
    cfg, metrics = run.cfg, {}
    rows = {k: v[run.rank::run.world_size] for k, v in batch.items()}  # this rank's share of the batch
    # 3. proximal log-probs, recomputed by the trainer (decoupled PPO: `logprobs` stays the
    # behaviour policy's, as the server reported them). In sync mode the two policies are
    # the same, so their gap is a bug detector.
    t1 = time.time()
    if batch:
        rows["proximal_logprobs"] = batch["rank_proximal_logprobs"] = run.actor.compute_logprobs(rows)
        mismatch = logprob_mismatch(rows["proximal_logprobs"], rows["logprobs"], rows["loss_mask"],
                                    cfg.behav_imp_weight_cap or None)
        if (warning := mismatch_warning(mismatch)):
            tqdm.write(warning)
        metrics.update({f"logprob/{k}": v for k, v in mismatch.items()})  # server vs trainer, all ranks
    metrics["perf/logp_s"] = time.time() - t1

    # 4. PPO update: one optimizer step per mini-batch; after the first, the policy has moved
    # away from the proximal one and the clip bounds it. Every rank runs the same number of
    # steps (its collectives must pair up): the count fits the rank with the fewest rows.
    t2 = time.time()
    if batch:
        num_mb = max(1, min(cfg.ppo_minibatches, len(batch["rewards"]) // run.world_size))
        # one mini-batch: every row in rollout order (the loss sums in the same order as ever)
        parts = minibatch_rows(len(rows["rewards"]), num_mb, seed=cfg.seed + run.step) if num_mb > 1 else [slice(None)]
        stats = merge_stats([run.actor.update({k: v[part] for k, v in rows.items()}, step=run.step)
                             for part in parts])
        stats["minibatches"] = len(parts)
        metrics.update({f"loss/{k}": v for k, v in stats.items()})  # rank 0's rows under FSDP
    metrics["perf/update_s"] = time.time() - t2
    return metrics


def sync_weights(run: Run, trained: bool) -> dict:
    """5. weight sync: pause generation, push the new weights, continue; bump the version. A step
    with nothing trained leaves the weights and the version as they are."""
    cfg, t3 = run.cfg, time.time()
    if trained:
        run.version += 1
        # sync mode has nothing in flight: "abort" leaves SGLang in a state it can always flush
        pause_mode = cfg.pause_mode if run.producer is not None else "abort"
        if run.is_main:
            run.bg.run(run.client.pause_generation(pause_mode))
        # a held request keeps its KV (and SGLang can flush only an idle server: its scheduler
        # dies on a failed flush), so the prefix cache is flushed only where nothing is held
        run.weight_sync.sync(run.version, flush_cache=pause_mode == "abort")
        if run.is_main:
            if run.producer is not None:
                run.producer.set_version(run.version)
            run.bg.run(run.client.continue_generation(run.version))  # requests cut or held by the pause go on
    return {"perf/sync_s": time.time() - t3}


def log_step(run: Run, metrics: dict, episodes: list[dict], batch: dict):
    """6. log (rank 0): the step's metrics row, with the dev evaluation every eval_every steps, and
    its traces (after step 3: trainer log-probs exist)."""
    if not run.is_main:
        return
    cfg = run.cfg
    metrics.update({
        "rollout/dropped_stale_groups": run.producer.num_dropped_stale if run.producer else 0,
        "reward/timeouts": run.reward_pool.num_timeouts - run.reward_counts[0],
        "reward/worker_failures": run.reward_pool.num_failures - run.reward_counts[1],
        "perf/trained_tokens_per_s": metrics["rollout/gen_tokens"] / max(metrics["perf/step_s"], 1e-6),
    })
    if run.actor.device.type == "cuda":  # the trainer's high-water mark this step and what it holds now
        # (while the server generates), and the GPU's free memory now
        metrics["perf/trainer_peak_mem_gb"] = torch.cuda.max_memory_allocated(run.actor.device) / 1e9
        metrics["perf/trainer_mem_gb"] = torch.cuda.memory_allocated(run.actor.device) / 1e9
        metrics["perf/gpu_free_gb"] = torch.cuda.mem_get_info(run.actor.device)[0] / 1e9
        torch.cuda.reset_peak_memory_stats(run.actor.device)
    if cfg.eval_every and run.step % cfg.eval_every == 0:
        metrics.update({f"eval/{k}": v for k, v in run_evaluation(run, "eval", run.dev_items, log=False).items()})
    run.logger.log(run.step, metrics)
    if cfg.trace_every and run.step % cfg.trace_every == 0:
        keep = torch.cat([e["keep"] for e in episodes])
        trainer_lp = trainer_logprobs_by_episode(keep, batch.get("rank_proximal_logprobs"), run.rank, run.world_size)
        records = trace_records(run.step, episodes, torch.cat([e["advantages"] for e in episodes]), trainer_lp,
                                run.tokenizer, cfg.group_size, cfg.trace_groups, context_role="tool",
                                tool_failures=lambda e: e["num_tool_failures"])
        write_traces(run.trace_file, records)
        run.logger.log_traces(run.step, records)


def save_checkpoint(run: Run):
    """7. checkpoint: model, optimizer, scheduler (every rank writes its shard), the counters and the RNGs."""
    run.actor.save_checkpoint(os.path.join(run.ckpt_dir, "latest"), extra={
        "step": run.step, "version": run.version, "data_position": run.data_position,
        "python_rng": random.getstate(), "numpy_rng": np.random.get_state(), "torch_rng": torch.get_rng_state()})


def run_evaluation(run: Run, split: str, items: list[dict], log: bool = True) -> dict:
    """Greedy episodes on `items` (rank 0): their metrics, also logged under `{split}/...` at this
    step unless `log` is False (log_step adds the dev evaluation to the step's row)."""
    what = "the test evaluation" if split == "test" else f"step {run.step}'s evaluation"
    episodes, metrics = run_rollout(run, evaluate(*episode_args(run), items), what)
    # one record per question (evals/), and the final test paired with the test before training
    metrics.update(record_evaluation(run.cfg.run_dir, split, run.step, episodes))
    if log:
        run.logger.log(run.step, {f"{split}/{k}": v for k, v in metrics.items()})
    return metrics


def out_of_time(run: Run, start: float) -> bool:
    # Under torchrun rank 0's clock decides for every rank, so all ranks leave the loop together.
    budget = run.cfg.time_budget_s
    return broadcast_from_rank0(bool(budget) and time.time() - start > budget, run.cpu_group)


# --- main: the GRPO loop ---
def main(config: str | None = "configs/tir_tiny.yaml", **overrides):
    cfg = load_config(Config, config, overrides)
    run = setup(cfg)
    cfg = run.cfg
    try:
        if run.is_main and run.step == 0 and cfg.eval_every:
            print(f"step 0 dev: {run_evaluation(run, 'eval', run.dev_items)}")
        if run.is_main and run.step == 0 and cfg.test_at_start:
            print(f"test before training: {run_evaluation(run, 'test', run.test_items)}")
        if run.is_main and run.step == 0 and cfg.learnability_probe:  # does the model leave GRPO anything to learn?
            probe = rollout_groups(*episode_args(run), run.dev_items, cfg.temperature, cfg.group_size)
            groups, _ = run_rollout(run, probe, "the learnability probe")
            run.logger.log(run.step, learnability_report(groups))
        if run.producer is not None:
            run.producer.start()
        progress = tqdm(total=cfg.max_steps, initial=run.step, desc=f"GRPO ({cfg.mode})", disable=not run.is_main)
        train_start, stopping = time.time(), False
        while run.step < cfg.max_steps and not stopping:
            t0 = time.time()
            # 1. rollout, 2. advantages: the rows to train, on every rank
            batch, episodes, metrics = rollout_step(run)
            metrics["perf/rollout_s"] = time.time() - t0
            # 3. proximal log-probs, 4. PPO update: each rank on its share of the rows
            metrics.update(train_step(run, batch))
            # 5. weight sync and version bump, when anything was trained
            metrics.update(sync_weights(run, trained=bool(batch)))
            run.step += 1
            # 6. log
            metrics["perf/step_s"] = time.time() - t0
            log_step(run, metrics, episodes, batch)
            progress.update(1)
            if run.is_main:
                progress.set_postfix(reward=f"{metrics['rollout/reward']:.3f}", step_s=f"{metrics['perf/step_s']:.1f}")
            # 7. checkpoint
            stopping = out_of_time(run, train_start)
            if cfg.checkpoint_every and (run.step % cfg.checkpoint_every == 0 or run.step == cfg.max_steps or stopping):
                save_checkpoint(run)
        progress.close()
        if run.producer is not None:  # the test evaluation alone uses the server
            run.producer.stop()
            run.producer = None

        test_metrics = None
        if run.is_main:
            test_metrics = run_evaluation(run, "test", run.test_items)
            print(f"test after {run.step} steps: {test_metrics}")
        run.actor.save_hf(os.path.join(cfg.run_dir, "final"))
        return test_metrics
    finally:
        close(run)


if __name__ == "__main__":
    fire.Fire(main)
