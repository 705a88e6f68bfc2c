"""Train a math agent that reflects on wrong answers, with GRPO, synchronously or asynchronously.

The model solves a GSM8K-style word problem and ends with `#### N`. When the answer is wrong it
receives a reflection turn ("Your answer is either wrong or not parsable ...") and tries again, up
to `max_turns`; the reward is 1 for a correct answer, times `turn_discount` per extra turn.

    python train_reflect.py                                   # embedded default, CPU, no hub
    python train_reflect.py --mode async --max_staleness 2    # rollouts overlap the update
    python train_reflect.py --agent openai                    # the same agent written with the openai SDK
    python train_reflect.py --config configs/reflect_qwen2.5_1.5b.yaml   # Qwen2.5 + SGLang on GPUs

Reads top to bottom: config, prompt, reward, one episode (as a token loop, and as an openai-SDK
agent behind lib/openai_proxy.py, in train_agent.py's shape), group rollout, evaluation, data, warm
start, the run's set-up and tear-down, one GRPO step phase by phase
(rollout_step, train_step, sync_weights, log_step, save_checkpoint), main() with the loop.
"""
import asyncio
import dataclasses
import functools
import gc
import os
import random
import re
import time
import uuid
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
from lib.grpo import (equal_reward_groups, grpo_advantages, logprob_mismatch, merge_stats, minibatch_rows,
                      mismatch_warning)
from lib.launch import launch_cpu_server, launch_sglang
from lib.metrics import MetricsLogger, continue_jsonl
from lib.model_names import resolve_model_path
from lib.openai_proxy import OpenAIProxy, sdk_aiohttp_client
from lib.padding import concat_padded_tensors
from lib.ranks import broadcast_from_rank0, init_trainer_ranks, server_seed
from lib.reward_pool import RewardPool
from lib.supervise import Supervisor
from lib.tiny_model import default_tiny_model_dir
from lib.traces import episode_record, trainer_logprobs_by_episode, write_traces
from lib.weight_sync import ServerWeightSync


@dataclass
class Config:
    # --- run ---
    run_dir: str = "runs/reflect"  # metrics.jsonl, traces.jsonl, checkpoints/
    seed: int = 0
    seeded_sampling: bool = False  # each request's sampling seed from (seed, item index, sample, position): runs repeat
    max_steps: int = 200  # GRPO steps
    time_budget_s: float = 0.0  # stop training after this many seconds (then test); 0 = no limit
    mode: str = "sync"  # "sync": rollout, then update; "async": rollouts keep running during the update
    agent: str = "tokens"  # "tokens": arun_episode's token loop; "openai": the same agent on the openai SDK, through lib/openai_proxy.py
    openai_http_client: str = "aiohttp"  # --agent openai: the SDK's HTTP transport, "aiohttp" (DefaultAioHttpClient), "httpx" (its default) or "in_process" (proxy.http_client(): no socket)
    resume: bool = False  # continue from the latest checkpoint in run_dir
    checkpoint_every: int = 10  # steps; 0 = never
    # --- model and inference server ---
    model_path: str = ""  # HF dir or hub id; "" = the embedded tiny model, SFT warm-started
    server: str = "cpu"  # "cpu" (lib/cpu_server), "sglang", or "external" (server_addrs)
    server_addrs: list = field(default_factory=list)  # external servers, ["http://host:port", ...]
    server_device: str = "cpu"  # device of the CPU-capable server ("cuda" works too)
    server_threads: int = 1  # torch threads of the CPU server (the trainer keeps the rest)
    base_gpu_id: int = 1  # first GPU of the SGLang server (the trainer uses GPU 0)
    tp_size: int = 1
    dp_size: int = 1
    mem_fraction_static: float | None = None
    sglang_extra_args: str = "--attention-backend triton --sampling-backend pytorch --grammar-backend none"
    max_concurrent_requests: int = 256
    trainer_dtype: str = "float32"  # "bfloat16" on GPUs
    trainer_threads: int = 0  # torch threads of the trainer; 0 = torch's default
    # --- data ---
    dataset: str = ""  # "" = bundled synthetic problems; a hub id ("openai/gsm8k"); or a local dir of {train,dev,test}.{jsonl,parquet}
    dataset_config: str = "main"  # hub config name
    dev_size: int = 300  # held out of train when the dataset has no dev/validation split
    # --- episode ---
    max_turns: int = 2  # 1 = single-turn RLVR
    turn_discount: float = 0.9  # reward x turn_discount^(turns - 1)
    max_tokens: int = 1024  # context budget of one episode: prompt + all turns + reflections
    max_new_tokens_per_turn: int = 128
    stop_token_ids: list = field(default_factory=list)  # ids that end a turn; [] = the model's EOS set (tokenizer + generation_config)
    temperature: float = 1.0
    apply_chat_template: bool = True  # wrap prompts in the tokenizer's chat template
    # One episode's deadline, from its start (which includes waiting for the server behind every other
    # episode started with it): past it the episode is cancelled and its group fails, counted in
    # rollout/failed_groups, instead of hanging the run; 0 = none. The longest wait of the embedded default
    # is the test evaluation's, 500 episodes at once: 105 s on 2 busy CPU cores with every turn at its
    # 64-token budget (the untrained model). In async mode it also spans the updates an episode overlaps.
    episode_timeout_s: float = 600.0
    # --- reward ---
    reward_timeout_s: float = 5.0  # per call; a timeout scores 0 and is counted
    reward_workers: int = 1  # processes of the reward pool
    # --- GRPO ---
    batch_size: int = 8  # questions per step
    group_size: int = 4  # episodes per question
    lr: float = 1e-6
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # or "cosine"
    grad_clip: float = 1.0
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.28
    kl_coef: float = 0.0  # k3 KL to the initial model; 0 = no reference model
    scale_adv_by_std: bool = True  # divide by the group's reward std; Dr. GRPO: False, with loss_agg seq-mean-token-sum-norm
    drop_equal_groups: bool = False  # dynamic sampling (DAPO): drop groups whose rewards are all equal, refill the batch
    refill_rounds: int = 2  # dynamic sampling: at most this many more rollouts per step to refill the batch
    neg_adv_scale: float = 1.0  # weight of below-average episodes; 0 = learn from the better ones only
    ppo_minibatches: int = 1  # optimizer steps per batch, each on a random 1/N of the rows (PPO clipping then acts)
    loss_agg: str = "token-mean"  # DAPO's; "seq-mean-token-mean" (GRPO), "seq-mean-token-sum-norm" (Dr. GRPO)
    behav_imp_weight_cap: float = 2.0  # cap of the server->trainer importance weight per token; 0 = no cap
    behav_imp_weight_mode: str = "truncate"  # above the cap: "truncate" to it (TIS) or "mask" the token out (AReaL)
    max_tokens_per_mb: int = 16384  # micro-batch token budget of the trainer
    pack_sequences: bool | None = None  # padding-free rows (varlen attention); None: on GPUs only (padded rows are faster on CPU)
    attn_implementation: str | None = None  # trainer attention: None = lib's varlen when packed, else sdpa
    trainer_gradient_checkpointing: bool = False  # recompute activations in backward: ~half the memory, ~20% slower
    trainer_compile: bool | None = None  # torch.compile the decoder layers; None = on with one GPU
    trainer_offload_optimizer: bool = False  # bf16, one GPU: fp32 master + AdamW state in CPU memory between updates
    weight_sync: str = "disk"  # "disk" (safetensors + /update_weights_from_disk), "nccl" (broadcast; gloo on CPUs)
    # or "tensor" (server on the trainer's GPU/machine: handles of the trainer's tensors, no copy to disk)
    colocate_sleep: bool = False  # sync mode, server on the trainer's GPU: it frees its memory while the trainer works
    weight_sync_bucket_mb: float = 512  # nccl: tensors per update call, one flattened broadcast each
    weight_sync_master_address: str = "127.0.0.1"  # nccl: the trainer's address as servers on other machines reach it
    # --- async mode ---
    # a group starts only if a step within max_staleness versions will train it (nothing generated
    # is dropped as stale), and the trainer takes the oldest groups first (lib/async_rollout.py)
    max_staleness: int = 1  # every token is trained at most this many versions after its weights'
    async_capacity: int = 0  # groups started and not yet trained on; 0 = (max_staleness + 1) x batch_size
    # how the weight sync pauses the servers: "in_place" holds in-flight requests (their KV stays)
    # and they go on under the new weights, "abort" cuts them (the client re-sends prompt + output;
    # SGLang then waits ~1 s per pause) and flushes the prefix cache (docs/client.md)
    pause_mode: str = "in_place"
    # each request names its policy version as SGLang's prefix-cache namespace (`extra_key`), so no
    # prefix cached under other weights is reused; False: old prefixes are reused (servers without extra_key)
    prefix_cache_per_version: bool = True
    # --- warm start (SFT on worked solutions before GRPO; any model) ---
    warm_start_steps: int | None = None  # 0 = no warm start; None = 1500 for the embedded tiny model, 0 for a pretrained one
    warm_start_lr: float | None = None  # None = 2e-3 for the embedded tiny model, 5e-5 for a pretrained one
    warm_start_batch_size: int = 16
    warm_start_reflect_frac: float = 0.3  # demonstrations that recover from a wrong first answer
    warm_start_direct_steps: int = 0  # then SFT steps on demonstrations of which a fraction give the final line only
    warm_start_direct_frac: float = 0.6  # ... that fraction ("#### N", no worked steps)
    warm_start_direct_lr: float = 5e-4
    warm_start_problems: int = 20000  # distinct synthetic problems for the warm start (the train split changes with it)
    # --- evaluation and logging ---
    eval_every: int = 10  # steps; 0 = only at the end
    eval_size: int = 200  # dev questions per evaluation
    test_size: int = 500  # test questions at the end
    test_at_start: bool = False  # also the test split before the first step (a learning curve's starting point)
    trace_every: int = 1  # write trajectories (traces.jsonl, token by token) every N steps; 0 = never
    trace_groups: int = 1  # groups traced per traced step (group_size episodes each)
    trace_backend: str = "jsonl"  # "jsonl", or "mlflow": metrics and traces also go to MLflow (run_dir/mlflow.db)
    tensorboard: bool = True
    wandb_project: str | None = None


# --- prompt ---
PROMPT_TEMPLATE = "{question}\nSolve the problem step by step. Put the final answer after ####."
REFLECTION = "Your answer is either wrong or not parsable to the reference answer. Please try to answer it more accurately."


def render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def build_prompt_ids(tokenizer, question: str, apply_chat_template: bool) -> list[int]:
    text = PROMPT_TEMPLATE.format(question=question)
    if apply_chat_template and tokenizer.chat_template:
        return render_ids(tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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
            if not gen.output_ids or gen.output_ids[-1] not in end_ids:
                append([eos])  # a turn cut by length: close it as the chat template would; not sampled, not trained on
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


# --- one episode, as an agent written with the openai SDK (--agent openai) ---
_openai_clients: dict = {}  # (proxy url, event loop, http_client) -> AsyncOpenAI


def openai_client(proxy: OpenAIProxy, http_client: str = "aiohttp"):
    """One SDK client (one connection pool) per event loop for every episode: building an
    AsyncOpenAI takes ~40 ms (an SSL context), a copy with another api_key (`with_options`) ~0.04 ms.
    `http_client`: "aiohttp" is the SDK's own aiohttp transport (`DefaultAioHttpClient`, the
    `openai[aiohttp]` extra), "httpx" its default one, "in_process" the proxy's own client that
    hands requests to it without a socket (`proxy.http_client()`). The default httpx pool walks
    every pooled connection on each request and response, and with one connection per concurrent
    episode that was a third of the proxy path's cost (docs/benchmarks.md). Close with
    `close_openai_clients()`."""
    from openai import AsyncOpenAI

    loop = asyncio.get_running_loop()
    key = (proxy.url, loop, http_client)
    if key not in _openai_clients:
        if http_client not in ("aiohttp", "httpx", "in_process"):
            raise ValueError(f"openai_http_client must be 'aiohttp', 'httpx' or 'in_process', got {http_client!r}")
        transport = None  # "httpx": the SDK's default client
        if http_client == "in_process":
            transport = proxy.http_client()
        elif http_client == "aiohttp":
            transport = sdk_aiohttp_client()
        _openai_clients[key] = AsyncOpenAI(base_url=proxy.url, api_key="per-episode", max_retries=0,
                                           http_client=transport)
    return _openai_clients[key]


async def close_openai_clients():
    """Close the SDK clients of the running event loop (their connection pools)."""
    loop = asyncio.get_running_loop()
    for key in [k for k in _openai_clients if k[1] is loop]:
        await _openai_clients.pop(key).close()


async def run_agent(base_url: str, api_key: str, item: dict, temperature: float, *, sdk, reward_pool: RewardPool,
                    cfg: Config) -> dict:
    """arun_episode's loop as an agent author writes it, in train_agent.py's shape (a run_agent against
    the episode's base URL and key; here also the shared SDK client `sdk` to copy, the reward pool
    and the config): chat messages in, text out, no token in sight. Returns the reward and the
    episode's stats."""
    from openai import BadRequestError  # only this path needs the SDK

    llm = sdk.with_options(base_url=base_url, api_key=api_key)
    messages = [{"role": "user", "content": PROMPT_TEMPLATE.format(question=item["question"])}]
    score, turns, finish, texts = 0.0, 0, "max_turns", []
    for turn in range(cfg.max_turns):
        try:
            reply = await llm.chat.completions.create(model="policy", messages=messages, temperature=temperature,
                                                      max_tokens=cfg.max_new_tokens_per_turn)
        except BadRequestError as e:
            if e.code != "context_length_exceeded":  # the proxy's context budget is cfg.max_tokens
                raise
            finish = "max_tokens"
            break
        turns += 1
        text = reply.choices[0].message.content or ""
        texts.append(text)
        score = await reward_pool.score(reward_fn, text, item["answer"])
        if score > 0:
            finish = "correct"
            break
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": REFLECTION}]
    return {
        "reward": score * cfg.turn_discount ** (turns - 1) if turns else 0.0,
        "num_turns": turns,
        "correct_turn": turns if score > 0 else 0,
        "shows_work": bool(texts) and shows_work(texts[0]),
        "finish_reason": finish,
        "turn_texts": texts,
    }


async def arun_episode_openai(proxy: OpenAIProxy, tokenizer, reflection_ids, reward_pool: RewardPool, cfg: Config,
                              item: dict, temperature: float) -> dict:
    """run_agent in a proxy session of its own, as train_agent.py runs an episode. The proxy renders
    the messages with the chat template, keeps the tokens the server sampled, and hands back the
    session's `segments` (one per unbroken conversation: this agent only appends, so one), each a
    training row with the episode's reward; for the same sampled tokens the segment is
    arun_episode's trajectory, id for id (tests/test_reflect.py checks)."""
    # A training session samples at the trainer's temperature only (the proxy refuses others);
    # evaluation (greedy) is not trained on.
    key = proxy.new_session(train=temperature != 0.0)
    try:
        result = await run_agent(proxy.session_url(key), key, item, temperature, reward_pool=reward_pool, cfg=cfg,
                                 sdk=openai_client(proxy, cfg.openai_http_client))
    finally:
        episode = proxy.end_session(key)
    segments = episode["segments"]
    return {
        "segments": segments,
        # every sampled token's version, for the async producer's staleness check
        "versions": torch.cat([s["versions"] for s in segments], 1) if segments else torch.zeros(1, 0, dtype=torch.long),
        "rewards": torch.tensor([result.pop("reward")], dtype=torch.float32),
        **result,
        "question": item["question"],
        "gold": item["answer"],
    }


TRAJECTORY_KEYS = ("input_ids", "loss_mask", "logprobs", "versions", "attention_mask")  # a training row's tensors


def episode_rows(episodes: list[dict]) -> list[tuple[int, dict]]:
    """(episode index, trajectory) per training row, in batch order: every segment the openai
    agent's session recorded (none if it sampled nothing), or the token loop's episode itself."""
    return [(i, row) for i, e in enumerate(episodes) for row in e.get("segments", [e])]


# --- group rollout ---
def rewards_all_equal(group: list[dict]) -> bool:
    """No learning signal in this group: GRPO gives every episode advantage 0."""
    return bool(equal_reward_groups(torch.cat([e["rewards"] for e in group]), len(group)).all())


async def rollout_group(client, tokenizer, reflection_ids, reward_pool, cfg, item, temperature, group_size) -> list[dict]:
    # Each episode under its deadline: one that runs past it fails the group (dropped and counted).
    if cfg.agent == "openai":  # `client` is then the proxy
        episodes = [arun_episode_openai(client, tokenizer, reflection_ids, reward_pool, cfg, item, temperature)
                    for _ in range(group_size)]
    else:
        episodes = [arun_episode(client, tokenizer, reflection_ids, reward_pool, cfg, item, temperature,
                                 trajectory_id=f"{item['index']}/{k}" if "index" in item else None)
                    for k in range(group_size)]
    return list(await asyncio.gather(*[with_deadline(e, cfg.episode_timeout_s, item) for e in episodes]))


async def rollout_groups(client, tokenizer, reflection_ids, reward_pool, cfg, items, temperature, group_size):
    """(groups, number of failed groups): all groups at once; the client's concurrency limit and the
    server's batching decide how many generate at the same time. A group with a failed episode
    (server error or abort) is dropped and counted."""
    return await gather_groups([rollout_group(client, tokenizer, reflection_ids, reward_pool, cfg, item, temperature,
                                              group_size) for item in items])


# --- evaluation ---
async def evaluate(client, tokenizer, reflection_ids, reward_pool, cfg, items) -> dict:
    """Greedy, one episode per question: accuracy at the first turn, after reflection, mean turns."""
    groups, failed = await rollout_groups(client, tokenizer, reflection_ids, reward_pool, cfg, items, 0.0, 1)
    episodes = [g[0] for g in groups]
    return {
        "failed": failed,
        "acc_turn1": float(np.mean([e["correct_turn"] == 1 for e in episodes])),
        "acc_final": float(np.mean([e["correct_turn"] > 0 for e in episodes])),
        "turns": float(np.mean([e["num_turns"] for e in episodes])),
        "reward": float(np.mean([e["rewards"].item() for e in episodes])),
        "shows_work": float(np.mean([e["shows_work"] for e in episodes])),
    }


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
    examples = []
    for item in items:
        ids = build_prompt_ids(tokenizer, item["question"], cfg.apply_chat_template)
        mask = [context] * len(ids)
        if cfg.max_turns > 1 and rng.random() < cfg.warm_start_reflect_frac:
            wrong = tokenizer(wrong_attempt(item["answer"], rng), add_special_tokens=False)["input_ids"] + end_of_turn
            ids, mask = ids + wrong + reflection_ids, mask + [0] * len(wrong) + [context] * len(reflection_ids)
        direct = direct_frac > 0 and rng.random() < direct_frac
        final = "#### " + item["answer"].rsplit("####", 1)[-1].strip() if direct else item["answer"]
        solution = tokenizer(final, add_special_tokens=False)["input_ids"] + end_of_turn
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
                             what_direct="warm start, stage 2 (some answers without worked steps)")


# --- the run: set-up and tear-down ---
@dataclass
class Run:
    """What the loop touches: built by setup(), closed by close(). Under torchrun rank 0 alone holds
    the servers, the client, the reward pool, the rollouts, the logger and the trace file (None on
    the other ranks); every rank holds its shard of the actor."""
    cfg: Config
    rank: int = 0
    world_size: int = 1
    cpu_group: object = None  # gloo group for Python objects under torchrun
    tokenizer: object = None
    reflection_ids: list = None
    train_items: list = None
    dev_items: list = None
    test_items: list = None
    supervisors: list = field(default_factory=list)  # of the servers launched here
    bg: BackgroundLoop = None  # the event loop of every client call and episode
    client: InferenceClient = None
    reward_pool: RewardPool = None
    proxy: OpenAIProxy = None  # --agent openai: the agent's OpenAI-compatible server
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
    if cfg.weight_sync not in ("disk", "nccl", "tensor"):
        raise ValueError(f"weight_sync must be 'disk', 'nccl' or 'tensor', got {cfg.weight_sync!r}")
    if cfg.colocate_sleep and cfg.mode != "sync":
        raise ValueError("colocate_sleep needs mode sync: in async mode the server generates while the trainer works")
    if cfg.weight_sync == "nccl" and cfg.dp_size > 1:
        raise ValueError("weight_sync nccl sends to the server's TP ranks: use dp_size 1")
    if cfg.agent not in ("tokens", "openai"):
        raise ValueError(f"agent must be 'tokens' or 'openai', got {cfg.agent!r}")
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
    run.reflection_ids = build_reflection_ids(run.tokenizer, cfg.apply_chat_template)
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
        server = launch_sglang(model_path, base_gpu_id=cfg.base_gpu_id, tp_size=cfg.tp_size, dp_size=cfg.dp_size,
                               mem_fraction_static=cfg.mem_fraction_static, random_seed=sampling_seed,
                               extra_args=cfg.sglang_extra_args.split()
                               + (["--enable-memory-saver"] if cfg.colocate_sleep else []),
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
        run.client = InferenceClient(addrs, max_concurrent_requests=cfg.max_concurrent_requests,
                                     version_cache_key=cfg.prefix_cache_per_version,
                                     sampling_seed=cfg.seed if cfg.seeded_sampling else None)
        run.reward_pool = RewardPool(cfg.reward_workers, cfg.reward_timeout_s, preload=reward_fn)
    run.actor = Actor(model_path, lr=cfg.lr, weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps,
                      total_steps=cfg.max_steps, lr_schedule=cfg.lr_schedule, grad_clip=cfg.grad_clip,
                      temperature=cfg.temperature, max_tokens_per_mb=cfg.max_tokens_per_mb, dtype=cfg.trainer_dtype,
                      kl_coef=cfg.kl_coef, ref_model_path=model_path if cfg.kl_coef > 0 else None,
                      eps_clip_low=cfg.eps_clip_low, eps_clip_high=cfg.eps_clip_high, loss_agg=cfg.loss_agg,
                      loss_norm_tokens=cfg.max_tokens,
                      packed=cfg.pack_sequences, attn_implementation=cfg.attn_implementation,
                      gradient_checkpointing=cfg.trainer_gradient_checkpointing, compile_layers=cfg.trainer_compile,
                      offload_optimizer=cfg.trainer_offload_optimizer,
                      behaviour_weight_cap=cfg.behav_imp_weight_cap or None,
                      behaviour_cap_mode=cfg.behav_imp_weight_mode)

    # Weight sync (lib/weight_sync.py): "disk" = safetensors + /update_weights_from_disk; "nccl" = the
    # trainer and every server's TP workers join one process group once, then each step broadcasts the
    # new weights (NCCL on GPUs, gloo on CPUs).
    run.weight_sync = ServerWeightSync(cfg.weight_sync, run.actor, run.client, run.bg.run, num_servers=len(addrs),
                                       tp_size=cfg.tp_size, disk_dir=os.path.join(cfg.run_dir, "weights"),
                                       bucket_mb=cfg.weight_sync_bucket_mb,
                                       master_address=cfg.weight_sync_master_address)

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
    if is_main and cfg.agent == "openai":
        # The agent's chat requests go to this OpenAI-compatible server, which generates through
        # the client and records every sampled token; its context budget is the episode's.
        run.proxy = OpenAIProxy(run.client, run.tokenizer, stop_token_ids=cfg.stop_token_ids,
                                max_context_tokens=cfg.max_tokens, default_max_tokens=cfg.max_new_tokens_per_turn,
                                train_sampling={"temperature": cfg.temperature})
        run.bg.run(run.proxy.start())
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
    # What is built by now (model, tokenizer, libraries) lives as long as the run; frozen, it is left
    # out of garbage collections, whose full passes would otherwise scan all of it on the event loop in
    # the middle of a rollout (0.1-0.3 s each; the openai agent's SDK allocates enough to trigger one
    # every few hundred requests: docs/benchmarks.md).
    gc.freeze()


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
        if run.proxy is not None:
            run.bg.run(close_openai_clients(), timeout_s=30)
            run.bg.run(run.proxy.close(), timeout_s=30)
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
    """What rollout_group and evaluate take before the items: the agent's server first."""
    return run.proxy or run.client, run.tokenizer, run.reflection_ids, run.reward_pool, run.cfg


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
        rewards = torch.cat([e["rewards"] for e in episodes])

        # 2. advantages per episode over its group; a group whose rewards are all equal has advantage
        # exactly 0, and dynamic sampling drops it. Each training row (an episode, or each segment
        # of one) has its episode's reward and advantage, broadcast over its tokens by the loss.
        advantages, equal, keep = advantages_and_keep(cfg, rewards)
        if equal.all():
            tqdm.write(f"step {run.step + 1}: every group's rewards are equal: no learning signal this step")
        rows = episode_rows(episodes)
        row_episode = torch.tensor([i for i, _ in rows], dtype=torch.long)
        full = concat_padded_tensors([{k: row[k] for k in TRAJECTORY_KEYS} for _, row in rows])
        full["rewards"], full["advantages"], row_keep = rewards[row_episode], advantages[row_episode], keep[row_episode]
        batch = {k: v[row_keep] for k, v in full.items()} if rows else {}
        # a token's staleness: the version this step trains at minus the version that sampled it
        token_staleness = (run.version - full["versions"])[full["loss_mask"].bool()].float() if rows else torch.zeros(0)
        for i, e in enumerate(episodes):  # for the traces (tensors: out of a trace record's stats)
            e["advantages"], e["keep"] = advantages[i:i + 1], keep[i:i + 1]
        metrics = {
            "rollout/reward": rewards.mean().item(),
            "rollout/episodes": len(episodes),
            "rollout/acc_turn1": float(np.mean([e["correct_turn"] == 1 for e in episodes])),
            "rollout/acc_final": float(np.mean([e["correct_turn"] > 0 for e in episodes])),
            "rollout/turns": float(np.mean([e["num_turns"] for e in episodes])),
            "rollout/shows_work": float(np.mean([e["shows_work"] for e in episodes])),
            "rollout/max_tokens_hit": float(np.mean([e["finish_reason"] == "max_tokens" for e in episodes])),
            "rollout/seq_len": full["attention_mask"].sum(1).float().mean().item() if rows else 0.0,
            "rollout/gen_tokens": int(full["loss_mask"].sum()) if rows else 0,
            "rollout/kept_groups": int(keep.sum()) // cfg.group_size,
            "rollout/equal_reward_groups": int(equal.sum()) // cfg.group_size,
            "rollout/staleness_mean": token_staleness.mean().item() if token_staleness.numel() else 0.0,
            "rollout/staleness_max": token_staleness.max().item() if token_staleness.numel() else 0.0,
            # sampled tokens of groups not trained on: dropped as stale, or by dynamic sampling
            "rollout/wasted_tokens": (run.producer.num_wasted_tokens if run.producer else 0) - wasted_before
                                     + (int(full["loss_mask"][~row_keep].sum()) if rows else 0),
            "rollout/failed_groups": failed_groups,
        }
    if cfg.colocate_sleep and run.is_main:  # the server is idle until the sync: lend its memory to the trainer
        run.bg.run(run.client.release_memory_occupation())
    batch = broadcast_from_rank0(batch, run.cpu_group)
    return (batch if len(batch.get("rewards", ())) >= run.world_size else {}), episodes, metrics  # a row for every rank


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
        parts = minibatch_rows(len(rows["rewards"]), num_mb, seed=cfg.seed + run.step)
        stats = merge_stats([run.actor.update({k: v[part] for k, v in rows.items()}, step=run.step)
                             for part in parts])
        stats["minibatches"] = len(parts)
        metrics.update({f"loss/{k}": v for k, v in stats.items()})  # rank 0's rows under FSDP
    metrics["perf/update_s"] = time.time() - t2
    return metrics


def sync_weights(run: Run, trained: bool) -> dict:
    """5. weight sync: pause generation, push the new weights, continue; bump the version. A step
    with nothing trained leaves the weights and the version as they are (a server that lent its
    memory, colocate_sleep, gets the same weights back)."""
    cfg, t3 = run.cfg, time.time()
    if trained or cfg.colocate_sleep:
        run.version += int(trained)
        # sync mode has nothing in flight: "abort" leaves SGLang in a state it can always flush
        pause_mode = cfg.pause_mode if run.producer is not None else "abort"
        if run.is_main:
            run.bg.run(run.client.pause_generation(pause_mode))
        if cfg.colocate_sleep:  # the server takes its memory back: weights first (the sync fills them), then its cache
            torch.cuda.empty_cache()  # what the update freed goes back to the driver, for the server
            if run.is_main:
                run.bg.run(run.client.resume_memory_occupation(["weights"]))
        # a held request keeps its KV (and SGLang can flush only an idle server: its scheduler
        # dies on a failed flush), so the prefix cache is flushed only where nothing is held
        run.weight_sync.sync(run.version, flush_cache=pause_mode == "abort")
        if cfg.colocate_sleep and run.is_main:
            run.bg.run(run.client.resume_memory_occupation(["kv_cache", "cuda_graph"]))
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
    if cfg.trace_every and run.step % cfg.trace_every == 0:  # a record per training row of the first groups
        rows = episode_rows(episodes)
        row_keep = torch.cat([episodes[i]["keep"] for i, _ in rows]) if rows else torch.zeros(0, dtype=torch.bool)
        trainer_lp = trainer_logprobs_by_episode(row_keep, batch.get("rank_proximal_logprobs"), run.rank,
                                                 run.world_size)
        records = [episode_record({**episodes[i], **row}, run.tokenizer, step=run.step, group=i // cfg.group_size,
                                  index=i % cfg.group_size, advantage=episodes[i]["advantages"].item(),
                                  trainer_logprobs=trainer_lp[r], context_role="reflection",
                                  correct=float(episodes[i]["correct_turn"] > 0))
                   for r, (i, row) in enumerate(rows) if i < cfg.trace_groups * cfg.group_size]
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
    metrics = run_rollout(run, evaluate(*episode_args(run), items), what)
    if log:
        run.logger.log(run.step, {f"{split}/{k}": v for k, v in metrics.items()})
    return metrics


def out_of_time(run: Run, start: float) -> bool:
    # Under torchrun rank 0's clock decides for every rank, so all ranks leave the loop together.
    budget = run.cfg.time_budget_s
    return broadcast_from_rank0(bool(budget) and time.time() - start > budget, run.cpu_group)


# --- main: the GRPO loop ---
def main(config: str | None = "configs/reflect_tiny.yaml", **overrides):
    cfg = load_config(Config, config, overrides)
    run = setup(cfg)
    cfg = run.cfg
    try:
        if run.is_main and run.step == 0 and cfg.eval_every:
            print(f"step 0 dev: {run_evaluation(run, 'eval', run.dev_items)}")
        if run.is_main and run.step == 0 and cfg.test_at_start:
            print(f"test before training: {run_evaluation(run, 'test', run.test_items)}")
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
                progress.set_postfix(reward=f"{metrics['rollout/reward']:.3f}", dev_acc=metrics.get("eval/acc_final", ""))
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
