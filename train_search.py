"""Train a search agent with GRPO.

The model thinks in <think>, queries a retrieval server with <search> q </search>, reads the results
in <information>, may open a page with <access> id </access>, and ends with <answer> a </answer>.
Reward: F1 of the answer against the gold answers.

    python train_search.py --max_turns 32                    # embedded default, CPU, no hub
    python train_search.py --config configs/search_qwen2.5_3b.yaml   # Qwen2.5 + SGLang on GPUs

Reads top to bottom: config, prompt, parsers, tools, reward, one episode, group rollout,
evaluation, data, warm start, the run (set-up and tear-down), one GRPO step phase by phase,
main() with the GRPO loop.
"""
import asyncio
import collections
import dataclasses
import functools
import json
import os
import random
import re
import string
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
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
from lib.supervise import Supervisor
from lib.tiny_model import default_tiny_model_dir
from lib.traces import trace_records, trainer_logprobs_by_episode, write_traces
from lib.weight_sync import ServerWeightSync


@dataclass
class Config:
    # --- run ---
    run_dir: str = "runs/search"  # metrics.jsonl, traces.jsonl, checkpoints/
    seed: int = 0
    seeded_sampling: bool = False  # each request's sampling seed from (seed, item index, sample, position): runs repeat
    max_steps: int = 200  # GRPO steps
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
    base_gpu_id: int = 1  # first GPU of the SGLang server (the trainer uses GPU 0; under torchrun GPUs 0..N-1)
    tp_size: int = 1
    dp_size: int = 1
    num_servers: int = 1  # SGLang servers side by side, each on tp_size x dp_size GPUs from base_gpu_id on
    mem_fraction_static: float | None = None
    sglang_extra_args: str = "--attention-backend triton --sampling-backend pytorch --grammar-backend none"
    max_concurrent_requests: int = 256
    trainer_dtype: str = "float32"  # "bfloat16" on GPUs
    # --- data and retrieval ---
    data_dir: str = ""  # dir with corpus.jsonl and {train,dev,test}.jsonl; "" = bundled synthetic data
    retrieval_addr: str = ""  # a running Search-R1/ASearcher-style server; "" = start lib/retrieval
    topk: int = 3  # documents per search
    tool_timeout_s: float = 30.0
    tool_latency_s: float = 0.0  # sleep before each retrieval call: stands in for a slower search engine in benchmarks
    tool_retries: int = 3  # attempts before the episode gets a tool-failure message
    max_tool_failure_rate: float = 0.5  # stop the run when more tool calls than this fail over tool_failure_window steps; 1 = never
    tool_failure_window: int = 5  # steps
    max_info_chars: int = 3000  # cap of one <information> block
    # --- episode ---
    max_turns: int = 32
    reward: str = "f1"  # "f1" (ASearcher) or "em" (exact match, Search-R1)
    max_tokens: int = 2048  # context budget of one episode: prompt + all turns + tool output
    max_new_tokens_per_turn: int = 128  # tokens per generation request; a turn cut by it goes on (same turn) while the budget lasts
    stop_token_ids: list = field(default_factory=list)  # ids that end a turn; [] = the model's EOS set (tokenizer + generation_config)
    temperature: float = 1.0
    prompt: str = "full"  # "full" (ASearcher-style instructions) or "short" (the question only)
    apply_chat_template: bool = True  # wrap the prompt in the tokenizer's chat template
    use_tool: bool = True  # False: the no-tool baseline (answer from memory: no search in the prompt, the demonstrations or the episode)
    # One episode's deadline, from its start (which includes waiting for the server behind every other
    # episode started with it): past it the episode is cancelled and its group fails, counted in
    # rollout/failed_groups, instead of hanging the run; 0 = none. Up to 32 turns, each a re-sent context
    # and a search. On 2 busy CPU cores, with every episode at the embedded default's 1,024-token budget
    # (the untrained model), one step's 32 episodes took 167 s and the test evaluation's 300 at once
    # 1,243 s (the warm-started model evaluates them in ~40 s). Raise it for big evaluations on a slow server.
    episode_timeout_s: float = 1800.0
    # --- GRPO ---
    batch_size: int = 8  # questions per step
    group_size: int = 4  # episodes per question
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_betas: tuple = (0.9, 0.999)
    freeze_embeddings: bool = False  # RL on the rest of the model (tied embeddings: the LM head too)
    adam_eps: float = 1e-8  # larger = tiny, noisy per-parameter gradients take smaller steps
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
    # --- warm start (SFT on demonstrations that search and answer, before GRPO; any model) ---
    warm_start_steps: int | None = None  # 0 = no warm start; None = 1200 for the embedded tiny model, 0 for a pretrained one
    warm_start_lr: float | None = None  # None = 2e-3 for the embedded tiny model, 5e-5 for a pretrained one
    warm_start_batch_size: int = 16
    warm_start_worlds: int = 1  # counterfactual worlds (the training world's names, other facts) for demonstrations
    warm_start_corpus_lm: bool = False  # also train on the corpus as plain text ("pretraining")
    warm_start_direct_steps: int = 0  # then SFT steps on demonstrations of which a fraction answer without searching
    warm_start_direct_frac: float = 0.6  # ... that fraction: they answer from their own world's facts, which are stale here
    warm_start_direct_lr: float = 5e-4
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
PROMPT_TEMPLATE = (
    "Answer the question. Reason inside <think> and </think> every time you get new information. "
    "To look something up, call the search engine with <search> query </search>; the top results "
    "come back between <information> and </information>. To read a whole page, write <access> page "
    "title </access>. Search as often as you need. When you know the answer, give it inside <answer> "
    "and </answer> in a few words, for example <answer> Beijing </answer>.\nQuestion: {question}\n"
)
# The embedded tiny model learns the tags from its warm start and needs no instructions: a short
# prompt halves the tokens of a CPU training step.
SHORT_PROMPT_TEMPLATE = "Question: {question}\n"
PROMPTS = {"full": PROMPT_TEMPLATE, "short": SHORT_PROMPT_TEMPLATE}
STOP_STRINGS = ["</search>", "</access>", "</answer>"]
# --use_tool False: the no-tool baseline answers from memory
NO_TOOL_PROMPT_TEMPLATE = (
    "Answer the question. Reason inside <think> and </think>. Give the answer inside <answer> and </answer> in a "
    "few words, for example <answer> Beijing </answer>.\nQuestion: {question}\n"
)


def prompt_template(cfg) -> str:
    return PROMPTS[cfg.prompt] if cfg.use_tool or cfg.prompt == "short" else NO_TOOL_PROMPT_TEMPLATE


def build_prompt_ids(tokenizer, question: str, apply_chat_template: bool, template: str = PROMPT_TEMPLATE) -> list[int]:
    text = template.format(question=question)
    if apply_chat_template and tokenizer.chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                  add_generation_prompt=True, return_dict=False))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --- parsers ---
def _last_tag(text: str, tag: str) -> str | None:
    """Content of the last complete <tag> ... </tag>, stripped; None if there is none or it is empty.
    One pass over the tags (linear time: model output is untrusted, and a regex from every unclosed
    opening tag to the end would be quadratic). A closing tag pairs with the latest opening tag before it,
    so a nested or restarted tag keeps its innermost part."""
    contents, opened_at = [], None
    for m in re.finditer(rf"<(/?){tag}>", text, flags=re.IGNORECASE):
        if not m.group(1):
            opened_at = m.end()
        elif opened_at is not None:
            contents.append(text[opened_at:m.start()])
            opened_at = None
    for content in reversed(contents):
        if content.strip():
            return content.strip()
    return None


def parse_search_query(text: str) -> str | None:
    return _last_tag(text, "search")


def parse_access(text: str) -> str | None:
    return _last_tag(text, "access")


def parse_answer(text: str) -> str | None:
    return _last_tag(text, "answer")


# --- tools ---
class ToolError(Exception):
    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


async def call_tool(session: aiohttp.ClientSession, url: str, payload: dict, cfg: Config) -> dict:
    """POST with a timeout and retries with exponential backoff; a 4xx is not retried."""
    last_error, status = "", None
    for attempt in range(cfg.tool_retries):
        try:
            async with session.post(url, json=payload, timeout=aiohttp.ClientTimeout(total=cfg.tool_timeout_s)) as r:
                if r.status < 400:
                    return await r.json()
                last_error, status = f"HTTP {r.status}", r.status
                if r.status < 500:
                    break
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            last_error = type(e).__name__
        if attempt + 1 < cfg.tool_retries:
            await asyncio.sleep(0.5 * 2**attempt)
    # The message goes into the model's context: the cause, not the server's address.
    raise ToolError(f"failed after {attempt + 1} attempts ({last_error})", status)


def doc_title_text(doc: dict) -> tuple[str, str]:
    # Our server returns title/text; Search-R1's wiki servers return only contents = '"Title"\ntext'.
    if "title" in doc and "text" in doc:
        return doc["title"], doc["text"]
    title, _, text = doc.get("contents", "").partition("\n")
    return title.strip('"'), text


def format_docs(docs: list, max_chars: int) -> str:
    lines = []
    for i, item in enumerate(docs):
        doc = item.get("document", item)  # with return_scores each item is {"document", "score"}
        title, text = doc_title_text(doc)
        lines.append(f"Doc {i + 1} (Title: {title}) {text}")
    return "\n".join(lines)[:max_chars]


async def run_tool(session, retrieval_addr: str, kind: str, arg: str, cfg: Config) -> tuple[str, bool]:
    """Returns (text for the <information> block, ok)."""
    if cfg.tool_latency_s:
        await asyncio.sleep(cfg.tool_latency_s)
    try:
        if kind == "search":
            out = await call_tool(session, f"{retrieval_addr}/retrieve",
                                  {"queries": [arg], "topk": cfg.topk, "return_scores": False}, cfg)
            return format_docs(out["result"][0], cfg.max_info_chars), True
        out = await call_tool(session, f"{retrieval_addr}/access", {"title": arg}, cfg)
        title, text = doc_title_text(out["result"])
        return f"Page (Title: {title}) {text}"[: cfg.max_info_chars], True
    except ToolError as e:
        if kind == "access" and e.status == 404:  # a title that does not exist: an answer, not a failure
            return f"There is no page titled {arg}.", True
        return f"The {kind} tool failed: {e}", False
    except (KeyError, IndexError, TypeError, ValueError) as e:
        return f"The {kind} tool returned a malformed result ({type(e).__name__})", False


# --- reward ---
_PUNCTUATION = set(string.punctuation)


def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(pred: str, golds: str | list[str]) -> float:
    golds = [golds] if isinstance(golds, str) else golds
    return float(any(normalize_answer(pred) == normalize_answer(g) for g in golds))


def f1_score(pred: str, golds: str | list[str]) -> float:
    golds = [golds] if isinstance(golds, str) else golds
    best = 0.0
    pred_tokens = normalize_answer(pred).split()
    for gold in golds:
        gold_tokens = normalize_answer(gold).split()
        if not gold_tokens or not pred_tokens:  # normalised away (the letter answer "A"): as exact match does
            best = max(best, float(gold_tokens == pred_tokens))
            continue
        common = Counter(pred_tokens) & Counter(gold_tokens)
        overlap = sum(common.values())
        if overlap == 0:
            continue
        precision, recall = overlap / len(pred_tokens), overlap / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def compute_reward(answer: str | None, golds: str | list[str], metric: str = "f1") -> float:
    """F1 (ASearcher) or exact match (Search-R1) against the best gold answer; no answer scores 0.
    F1 gives partial credit, which a small policy can farm: `capital of X` scores 0.33 against the
    gold alias `City of Y` (docs/benchmarks.md)."""
    if answer is None:
        return 0.0
    return exact_match(answer, golds) if metric == "em" else f1_score(answer, golds)


# --- one episode ---
async def arun_episode(client: InferenceClient, session, tokenizer, cfg: Config, item: dict,
                       retrieval_addr: str, temperature: float, trajectory_id: str | None = None) -> dict:
    """One multi-turn trajectory (docs/trajectory.md). Token ids in, token ids out: generated tokens
    enter the trajectory exactly as the server sampled them, with its log-probs; tool output is
    tokenized on its own and masked out of the loss. A turn is one `client.generate` call: its
    pieces (`max_new_tokens_per_turn` each) are joined by the client and end at the first stop
    string or EOS across all of them."""
    prompt_ids = build_prompt_ids(tokenizer, item["question"], cfg.apply_chat_template, prompt_template(cfg))
    input_ids, loss_mask, logprobs, versions = list(prompt_ids), [0] * len(prompt_ids), [0.0] * len(prompt_ids), [-1] * len(prompt_ids)
    trajectory_id = trajectory_id or uuid.uuid4().hex  # a training item's: "<item index>/<sample>"
    answer, finish, turns, tool_calls, tool_failures, texts = None, "max_turns", 0, 0, 0, []
    retrieved = []  # the text of every result the agent read
    try:
        for _ in range(cfg.max_turns):
            budget = cfg.max_tokens - len(input_ids)
            if budget <= 0:
                finish = "max_tokens"
                break
            gen = await client.generate(
                input_ids, max_new_tokens=budget, piece_tokens=cfg.max_new_tokens_per_turn, temperature=temperature,
                stop=STOP_STRINGS if cfg.use_tool else ["</answer>"],
                stop_token_ids=cfg.stop_token_ids or [tokenizer.eos_token_id], trajectory_id=trajectory_id)
            turns += 1
            input_ids += gen.output_ids
            loss_mask += [1] * len(gen.output_ids)
            logprobs += gen.logprobs
            versions += gen.versions
            text = tokenizer.decode(gen.output_ids, skip_special_tokens=False)
            texts.append(("model", text))
            answer = parse_answer(text)
            if answer is not None:
                finish = "answer"
                break
            query, page = (parse_search_query(text), parse_access(text)) if cfg.use_tool else (None, None)
            if query is None and page is None:
                # The turn ended without a tool call: at EOS (or an empty tag), or at the context budget.
                finish = "max_tokens" if gen.finish_reason == "length" else "no_action"
                break
            tool_calls += 1
            info, ok = await run_tool(session, retrieval_addr, "search" if query is not None else "access",
                                      query if query is not None else page, cfg)
            tool_failures += not ok
            retrieved += [info] if ok else []
            info_ids = tokenizer(f"\n\n<information>{info}</information>\n\n", add_special_tokens=False)["input_ids"]
            texts.append(("tool", info))
            if len(input_ids) + len(info_ids) >= cfg.max_tokens:
                finish = "max_tokens"
                break
            input_ids += info_ids
            loss_mask += [0] * len(info_ids)
            logprobs += [0.0] * len(info_ids)
            versions += [-1] * len(info_ids)
    finally:
        client.end_trajectory(trajectory_id)
    reward = compute_reward(answer, item["answer"], cfg.reward)
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
        "num_tool_failures": tool_failures,
        "finish_reason": finish,
        "exact_match": exact_match(answer, item["answer"]) if answer is not None else 0.0,
        "answer": answer,
        # the answer's words appear in a result the agent read: an answer with evidence, not a guess
        "answer_in_evidence": answer is not None and normalize_answer(answer) != ""
                              and f" {normalize_answer(answer)} " in f" {normalize_answer(' '.join(retrieved))} ",
        "question": item["question"],
        "category": item.get("category"),  # an optional field of the item: evaluations break down by it
        "gold": item["answer"],
        "turn_texts": texts,
    }


# --- group rollout ---
def rewards_all_equal(group: list[dict]) -> bool:
    """No learning signal in this group: GRPO gives every episode advantage 0."""
    return bool(equal_reward_groups(torch.cat([e["rewards"] for e in group]), len(group)).all())


async def rollout_group(client, session, tokenizer, cfg, item, retrieval_addr, temperature, group_size) -> list[dict]:
    # Each episode under its deadline: one that runs past it fails the group (dropped and counted).
    return list(await asyncio.gather(*[
        with_deadline(arun_episode(client, session, tokenizer, cfg, item, retrieval_addr, temperature,
                                   trajectory_id=f"{item['index']}/{k}" if "index" in item else None),
                      cfg.episode_timeout_s, item) for k in range(group_size)]))


async def rollout_groups(client, session, tokenizer, cfg, items, retrieval_addr, temperature, group_size):
    """(groups, number of failed groups): group_size episodes per question, all questions at once;
    the client's concurrency limit and the server's batching decide how many generate at the same
    time. A group with a failed episode (server error or abort) is dropped and counted."""
    return await gather_groups([rollout_group(client, session, tokenizer, cfg, item, retrieval_addr, temperature,
                                              group_size) for item in items])


# --- evaluation ---
async def evaluate(client, session, tokenizer, cfg, items, retrieval_addr) -> tuple[list[dict], dict]:
    """Greedy, one episode per question: (the episodes, their metrics)."""
    groups, failed = await rollout_groups(client, session, tokenizer, cfg, items, retrieval_addr, 0.0, 1)
    episodes = [g[0] for g in groups]
    return episodes, {
        "failed": failed,
        "exact_match": float(np.mean([e["exact_match"] for e in episodes])),
        "f1": float(np.mean([compute_reward(e["answer"], e["gold"], "f1") for e in episodes])),
        "turns": float(np.mean([e["num_turns"] for e in episodes])),
        "searches": float(np.mean([e["num_tool_calls"] for e in episodes])),
        "answered": float(np.mean([e["finish_reason"] == "answer" for e in episodes])),
        "answer_in_evidence": float(np.mean([e["answer_in_evidence"] for e in episodes])),
    }


# --- data ---
def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for row in rows:  # Search-R1 files name the gold list golden_answers; ASearcher's use answer
        gold = row.get("answer", row.get("golden_answers"))
        row["answer"] = [gold] if isinstance(gold, str) else list(gold)
    return rows


# --- warm start ---
def build_demonstrations(tokenizer, cfg: Config, items: list[dict], corpus_path: str,
                         loss_on_tool_tokens: bool = True, direct_frac: float = 0.0, seed: int = 0) -> list[dict]:
    """Successful trajectories for SFT: per hop, search the hop's query and read the real BM25
    results; then answer. Pieces are tokenized exactly as arun_episode tokenizes them.

    A fraction `direct_frac` of them answer at once, without searching: right in the
    demonstration's own world, a guess from stale memory in the training world, whose facts differ
    (like a chat model answering from what it memorised). RL then has a decision to learn, search
    or not, that the reward makes plain.

    By default the loss covers every token, tool output included: a model trained from scratch
    learns to copy names (question -> query, information -> answer) sooner from the many
    repetitions in the passages than from its own turns alone. A pretrained model is trained on
    its own turns only (`loss_on_tool_tokens` False). Every turn of the model ends as its chat
    template ends one; the episode's stop strings end the others."""
    from lib.retrieval import bm25_search, load_bm25
    from lib.warm_start import end_of_turn_ids

    index = load_bm25(corpus_path)
    end_of_turn = end_of_turn_ids(tokenizer)
    tool_mask = 1 if loss_on_tool_tokens else 0
    rng = random.Random(seed)
    examples = []
    for item in items:
        ids = build_prompt_ids(tokenizer, item["question"], cfg.apply_chat_template, prompt_template(cfg))
        mask = [tool_mask] * len(ids)
        direct = rng.random() < direct_frac
        for query in ([] if direct else item["hop_queries"]):
            model_text = f"<think> I need to search {query}. </think>\n<search> {query} </search>"
            docs = bm25_search(index, [query], cfg.topk)[0]
            tool_text = f"\n\n<information>{format_docs(docs, cfg.max_info_chars)}</information>\n\n"
            model_ids = tokenizer(model_text, add_special_tokens=False)["input_ids"]
            tool_ids = tokenizer(tool_text, add_special_tokens=False)["input_ids"]
            ids += model_ids + tool_ids
            mask += [1] * len(model_ids) + [tool_mask] * len(tool_ids)
        # a direct answer has its own words: the answer after "The answer is" is copied from results
        lead = "From memory:" if direct else "The answer is"
        final = f"<think> {lead} {item['answer'][0]}. </think>\n<answer> {item['answer'][0]} </answer>"
        final_ids = tokenizer(final, add_special_tokens=False)["input_ids"] + end_of_turn
        ids += final_ids
        mask += [1] * len(final_ids)
        if len(ids) <= cfg.max_tokens:
            examples.append({"input_ids": ids, "loss_mask": mask})
    return examples


def corpus_lm_examples(tokenizer, corpus_path: str, chunk_tokens: int = 256) -> list[dict]:
    """The encyclopedia itself as language-model text, in chunks of whole passages: the tiny
    model's "pretraining on Wikipedia". Every name of the world then has a trained embedding, which
    the agent needs to copy it from a question or a search result (names are often single tokens;
    a token never seen in training cannot be copied)."""
    examples, ids = [], []
    with open(corpus_path) as f:
        texts = [json.loads(line)["contents"] + "\n\n" for line in f if line.strip()]
    for piece in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        if ids and len(ids) + len(piece) > chunk_tokens:
            examples.append({"input_ids": ids, "loss_mask": [1] * len(ids)})
            ids = []
        ids = ids + piece
    if ids:
        examples.append({"input_ids": ids, "loss_mask": [1] * len(ids)})
    return examples


def warm_start_examples(tokenizer, cfg: Config, data_dir: str, direct_frac: float = 0.0,
                        loss_on_tool_tokens: bool = True) -> list[dict]:
    """SFT data of the warm start: demonstrations on the warm-start split (questions about a
    part of the world that train/dev/test never ask about) and on `warm_start_worlds`
    counterfactual worlds (lib/wiki_data: the same names, other facts: the model learns to read
    answers from search results on the very tokens it meets in training, and cannot memorise
    them), plus the training world's corpus as language-model text if `warm_start_corpus_lm`."""
    from lib.wiki_data import SPLITS, default_wiki_dir

    examples = build_demonstrations(tokenizer, cfg, read_jsonl(os.path.join(data_dir, "warmstart.jsonl")),
                                    os.path.join(data_dir, "corpus.jsonl"), loss_on_tool_tokens, direct_frac, cfg.seed)
    for seed in range(1, cfg.warm_start_worlds + 1):
        world = default_wiki_dir(seed=seed, names_seed=0)
        items = [q for split in SPLITS for q in read_jsonl(os.path.join(world, f"{split}.jsonl"))]
        examples += build_demonstrations(tokenizer, cfg, items, os.path.join(world, "corpus.jsonl"),
                                         loss_on_tool_tokens, direct_frac, cfg.seed + seed)
    if cfg.warm_start_corpus_lm:
        examples += corpus_lm_examples(tokenizer, os.path.join(data_dir, "corpus.jsonl"))
    return examples


def warm_started_model(cfg: Config, base: str, data_dir: str, embedded: bool) -> str:
    """`base` after the SFT warm start (built once, cached under what it trains on), or `base` itself
    with warm_start_steps 0. The demonstrations come from `data_dir`'s warm-start split, else the
    bundled encyclopedia's. The no-tool baseline's demonstrations all answer from memory."""
    from lib.warm_start import steps_and_lr, warm_start_stages
    from lib.wiki_data import default_wiki_dir

    if not os.path.exists(os.path.join(data_dir, "warmstart.jsonl")):
        data_dir = default_wiki_dir(seed=0)
    steps, lr = steps_and_lr(cfg.warm_start_steps, cfg.warm_start_lr, embedded, embedded_steps=1200)

    def examples(tokenizer, direct_frac=0.0):
        return warm_start_examples(tokenizer, cfg, data_dir, direct_frac if cfg.use_tool else 1.0,
                                   loss_on_tool_tokens=embedded)
    # stage 2 (warm_start_direct_steps): a fraction of the demonstrations answer from memory, as a chat model does
    return warm_start_stages("search-warm-start", base, examples, steps=steps, lr=lr,
                             batch_size=cfg.warm_start_batch_size, seed=cfg.seed,
                             direct_steps=cfg.warm_start_direct_steps, direct_lr=cfg.warm_start_direct_lr,
                             direct_frac=cfg.warm_start_direct_frac,
                             what_direct="warm start, stage 2 (some answers without searching)")


# --- the run: set-up and tear-down ---
@dataclass
class Run:
    """What the loop touches: built by setup(), closed by close(). Under torchrun rank 0 alone holds
    the servers, the client, the tool session, the rollouts, the logger and the trace file (None on
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
    retrieval_addr: str = ""
    bg: BackgroundLoop = None  # the event loop of every client call and episode
    client: InferenceClient = None
    session: aiohttp.ClientSession = None  # for tool calls
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
    recent_tool_calls: collections.deque = None  # (calls, failures) per step, over tool_failure_window steps

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
        raise ValueError("weight_sync nccl sends to each server's TP ranks: use num_servers instead of dp_size")
    if cfg.reward not in ("f1", "em"):
        raise ValueError(f"reward must be 'f1' or 'em', got {cfg.reward!r}")
    if cfg.behav_imp_weight_mode not in ("truncate", "mask"):
        raise ValueError(f"behav_imp_weight_mode must be 'truncate' or 'mask', got {cfg.behav_imp_weight_mode!r}")


def setup(cfg: Config) -> Run:
    """Ranks, seeds, model, data, servers, client, actor, weight sync, the resumed checkpoint, the
    logger and (async mode) the rollout producer. If any of it fails, what was opened is closed."""
    check_config(cfg)
    # Under torchrun every rank holds a shard of the model (FSDP2, lib/actor.py); rank 0 alone runs the
    # servers, the rollouts, evaluation and logging; every rank trains on its rows of rank 0's batch.
    world_size, rank, cpu_group = init_trainer_ranks()
    run = Run(cfg, rank=rank, world_size=world_size, cpu_group=cpu_group,
              recent_tool_calls=collections.deque(maxlen=cfg.tool_failure_window))
    try:
        _setup(run)
    except BaseException:
        close(run)
        raise
    return run


def _setup(run: Run):
    from lib.retrieval import launch_retrieval_server
    from lib.wiki_data import default_wiki_dir

    cfg, is_main = run.cfg, run.is_main
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.run_dir, exist_ok=True)
    from transformers import AutoTokenizer

    if not is_main:
        dist.barrier()  # rank 0 builds the cache first; the others then find it there
    data_dir = cfg.data_dir or default_wiki_dir(seed=0)  # the bundled encyclopedia by default
    # a known name is built once and cached; then the warm start (cached too), if the run has one
    model_path = warm_started_model(cfg, resolve_model_path(cfg.model_path) or default_tiny_model_dir(), data_dir,
                                    embedded=not cfg.model_path)
    if is_main and run.world_size > 1:
        dist.barrier()
    if not data_dir:
        raise ValueError("set data_dir to a folder with train.jsonl, dev.jsonl, test.jsonl (and corpus.jsonl "
                         "unless retrieval_addr points at a running retrieval server)")
    run.tokenizer = AutoTokenizer.from_pretrained(model_path)
    if not cfg.stop_token_ids:  # a turn ends on any of the model's EOS ids (Qwen2.5: <|im_end|> and <|endoftext|>)
        cfg = run.cfg = dataclasses.replace(cfg, stop_token_ids=model_eos_ids(model_path, run.tokenizer))
    run.train_items = read_jsonl(os.path.join(data_dir, "train.jsonl"))
    run.dev_items = read_jsonl(os.path.join(data_dir, "dev.jsonl"))[: cfg.eval_size]
    run.test_items = read_jsonl(os.path.join(data_dir, "test.jsonl"))[: cfg.test_size]

    # Servers (rank 0): started here and killed with this process, or given by the user. A resumed run
    # seeds the server's sampling by its step, so it does not replay the start of the run.
    run.ckpt_dir = os.path.join(cfg.run_dir, "checkpoints")
    resume_extra = read_checkpoint_extra(os.path.join(run.ckpt_dir, "latest")) if cfg.resume else None
    sampling_seed = server_seed(cfg.seed, resume_extra["step"] if resume_extra else 0)
    # Launched servers are supervised (lib/supervise.py): the retrieval server, which holds no state,
    # is restarted on its address when it dies; a dead inference server stops the run with its log.
    addrs, supervisors = [], run.supervisors
    run.retrieval_addr = cfg.retrieval_addr.rstrip("/")
    if is_main and not run.retrieval_addr:
        corpus = os.path.join(data_dir, "corpus.jsonl")
        retrieval = launch_retrieval_server(corpus, log_path=os.path.join(cfg.run_dir, "retrieval.log"))
        run.retrieval_addr, port = retrieval.address, int(retrieval.address.rsplit(":", 1)[1])

        def relaunch_retrieval():
            log_path = os.path.join(cfg.run_dir, f"retrieval.restart{supervisors[0].restarts + 1}.log")
            return launch_retrieval_server(corpus, port=port, log_path=log_path)
        supervisors.append(Supervisor("retrieval server", retrieval, relaunch_retrieval))
    if is_main and cfg.server == "external":
        addrs = list(cfg.server_addrs)
    elif is_main and cfg.server == "sglang":
        for i in range(cfg.num_servers):
            server = launch_sglang(model_path, base_gpu_id=cfg.base_gpu_id + i * cfg.tp_size * cfg.dp_size,
                                   tp_size=cfg.tp_size, dp_size=cfg.dp_size,
                                   mem_fraction_static=cfg.mem_fraction_static, random_seed=sampling_seed,
                                   extra_args=cfg.sglang_extra_args.split()
                                   + (["--enable-memory-saver"] if cfg.colocate_sleep else []),
                                   log_path=os.path.join(cfg.run_dir, f"sglang{i}.log"))
            supervisors.append(Supervisor("inference server", server))
            addrs.append(server.address)
    elif is_main:
        server = launch_cpu_server(model_path, device=cfg.server_device, num_threads=cfg.server_threads,
                                   random_seed=sampling_seed, log_path=os.path.join(cfg.run_dir, "cpu_server.log"))
        supervisors.append(Supervisor("inference server", server))
        addrs = [server.address]

    # Every client call runs on one event loop in a background thread, so in async mode the
    # trainer (this thread) can update while episodes run.
    run.bg = BackgroundLoop()
    if is_main:
        run.client = InferenceClient(addrs, max_concurrent_requests=cfg.max_concurrent_requests,
                                     version_cache_key=cfg.prefix_cache_per_version,
                                     sampling_seed=cfg.seed if cfg.seeded_sampling else None)

        async def new_session():  # aiohttp sessions belong to the loop they are made in
            return aiohttp.ClientSession()
        run.session = run.bg.run(new_session())
    run.actor = Actor(model_path, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=tuple(cfg.adam_betas),
                      adam_eps=cfg.adam_eps, warmup_steps=cfg.warmup_steps, total_steps=cfg.max_steps,
                      lr_schedule=cfg.lr_schedule, grad_clip=cfg.grad_clip,
                      temperature=cfg.temperature, max_tokens_per_mb=cfg.max_tokens_per_mb, dtype=cfg.trainer_dtype,
                      kl_coef=cfg.kl_coef, ref_model_path=model_path if cfg.kl_coef > 0 else None,
                      eps_clip_low=cfg.eps_clip_low, eps_clip_high=cfg.eps_clip_high, loss_agg=cfg.loss_agg,
                      loss_norm_tokens=cfg.max_tokens, freeze_embeddings=cfg.freeze_embeddings,
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
        run.step, run.version = extra["step"], extra["version"]
        run.data_position = extra.get("data_position", run.step * cfg.batch_size)
        random.setstate(extra["python_rng"])
        if "numpy_rng" in extra:  # checkpoints written before it was saved lack it
            np.random.set_state(extra["numpy_rng"])
        torch.set_rng_state(extra["torch_rng"])
        # The server still holds the initial weights: give it the resumed policy.
        run.weight_sync.sync(run.version)
        run.resumed = True
        if is_main:
            print(f"resumed from step {run.step} (policy version {run.version}); server sampling seed {sampling_seed}")
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
                run.bg, lambda item: rollout_group(run.client, run.session, run.tokenizer, cfg, item,
                                                   run.retrieval_addr, cfg.temperature, cfg.group_size),
                functools.partial(item_at, run), capacity=cfg.async_capacity or (cfg.max_staleness + 1) * cfg.batch_size,
                max_staleness=cfg.max_staleness, batch_groups=cfg.batch_size, start_index=run.data_position,
                version=run.version)


def close(run: Run):
    """Everything setup() opened, in reverse order; also after an error, when some of it may be missing."""
    try:
        if run.producer is not None:
            run.producer.stop()
        for opened in (run.trace_file, run.logger):
            if opened is not None:
                opened.close()
        if run.weight_sync is not None:
            run.weight_sync.close()
        if run.session is not None:
            run.bg.run(run.session.close(), timeout_s=30)
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
        groups, failed = run_rollout(run, rollout_groups(run.client, run.session, run.tokenizer, run.cfg, items,
                                                         run.retrieval_addr, run.cfg.temperature,
                                                         run.cfg.group_size), what)
    except RuntimeError:
        for s in run.supervisors:
            s.check()  # a dead server is the clearer cause
        raise
    run.data_position += num_groups
    return groups, failed


def check_tool_failures(run: Run, episodes: list[dict]):
    """A tool that keeps failing would train the policy on failure messages: stop instead."""
    cfg = run.cfg
    run.recent_tool_calls.append((sum(e["num_tool_calls"] for e in episodes),
                                  sum(e["num_tool_failures"] for e in episodes)))
    calls, failures = map(sum, zip(*run.recent_tool_calls))
    full_window = len(run.recent_tool_calls) == cfg.tool_failure_window and calls >= 10  # not on a few calls
    if full_window and failures > cfg.max_tool_failure_rate * calls:
        raise RuntimeError(
            f"{failures} of the last {calls} tool calls failed over {cfg.tool_failure_window} steps "
            f"(max_tool_failure_rate {cfg.max_tool_failure_rate}): check the retrieval server at "
            f"{run.retrieval_addr} (retrieval*.log in {cfg.run_dir}), or raise max_tool_failure_rate")


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
        check_tool_failures(run, episodes)
        full = concat_padded_tensors([{k: v for k, v in e.items() if isinstance(v, torch.Tensor)} for e in episodes])
        rewards = full["rewards"]
        # a token's staleness: the version this step trains at minus the version that sampled it
        token_staleness = (run.version - full["versions"])[full["loss_mask"].bool()].float()

        # 2. advantages (per sequence, broadcast over its tokens by the loss); a group whose
        # rewards are all equal has advantage exactly 0, and dynamic sampling drops it
        full["advantages"], equal, keep = advantages_and_keep(cfg, rewards)
        if equal.all():
            tqdm.write(f"step {run.step + 1}: every group's rewards are equal: no learning signal this step")
        batch = {k: v[keep] for k, v in full.items()}
        for i, e in enumerate(episodes):  # for the traces (tensors: out of a trace record's stats)
            e["advantages"], e["keep"] = full["advantages"][i:i + 1], keep[i:i + 1]
        metrics = {
            "rollout/reward": rewards.mean().item(),
            "rollout/episodes": len(episodes),
            "rollout/exact_match": float(np.mean([e["exact_match"] for e in episodes])),
            "rollout/turns": float(np.mean([e["num_turns"] for e in episodes])),
            "rollout/tool_calls": float(np.mean([e["num_tool_calls"] for e in episodes])),
            "rollout/tool_failures": sum(e["num_tool_failures"] for e in episodes),
            "rollout/answered": float(np.mean([e["finish_reason"] == "answer" for e in episodes])),
            "rollout/answer_in_evidence": float(np.mean([e["answer_in_evidence"] for e in episodes])),
            "rollout/max_tokens_hit": float(np.mean([e["finish_reason"] == "max_tokens" for e in episodes])),
            "rollout/seq_len": full["attention_mask"].sum(1).float().mean().item(),
            "rollout/gen_tokens": int(full["loss_mask"].sum()),
            "rollout/kept_groups": int(keep.sum()) // cfg.group_size,
            "rollout/equal_reward_groups": int(equal.sum()) // cfg.group_size,
            "rollout/staleness_mean": token_staleness.mean().item() if token_staleness.numel() else 0.0,
            "rollout/staleness_max": token_staleness.max().item() if token_staleness.numel() else 0.0,
            # sampled tokens of groups not trained on: dropped as stale, or by dynamic sampling
            "rollout/wasted_tokens": (run.producer.num_wasted_tokens if run.producer else 0) - wasted_before
                                     + int(full["loss_mask"][~keep].sum()),
            "rollout/failed_groups": failed_groups,
            "tools/server_restarts": sum(s.restarts for s in run.supervisors),
        }
    if cfg.colocate_sleep and run.is_main:  # the server is idle until the sync: lend its memory to the trainer
        run.bg.run(run.client.release_memory_occupation())
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
        "perf/gen_tokens_per_s": metrics["rollout/gen_tokens"] / max(metrics["perf/rollout_s"], 1e-6),
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
                                correct=lambda e: e["exact_match"], tool_failures=lambda e: e["num_tool_failures"])
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
    rollout = evaluate(run.client, run.session, run.tokenizer, run.cfg, items, run.retrieval_addr)
    episodes, metrics = run_rollout(run, rollout, what)
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
def main(config: str | None = "configs/search_tiny.yaml", **overrides):
    cfg = load_config(Config, config, overrides)
    run = setup(cfg)
    cfg = run.cfg
    try:
        if run.is_main and run.step == 0 and cfg.eval_every:
            print(f"step 0 dev: {run_evaluation(run, 'eval', run.dev_items)}")
        if run.is_main and run.step == 0 and cfg.test_at_start:
            print(f"test before training: {run_evaluation(run, 'test', run.test_items)}")
        if run.is_main and run.step == 0 and cfg.learnability_probe:  # does the model leave GRPO anything to learn?
            probe = rollout_groups(run.client, run.session, run.tokenizer, cfg, run.dev_items, run.retrieval_addr,
                                   cfg.temperature, cfg.group_size)
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
                progress.set_postfix(reward=f"{metrics['rollout/reward']:.3f}", dev_em=metrics.get("eval/exact_match", ""))
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
