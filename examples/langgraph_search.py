"""Train a LangGraph agent with GRPO: a copy of train_agent.py whose `run_agent` is a LangGraph graph.

The agent (`build_agent`) is ordinary LangGraph code, unaware of training: a chat model with a
`search` tool over the encyclopedia's retrieval server, looping model -> tools -> model until the
model answers. `run_agent` builds it on `langchain_openai.ChatOpenAI` pointed at the episode's
base URL (lib/openai_proxy.py, which generates with the policy on the inference server and records
every sampled token) and returns the F1 of the final answer against the gold answers, with the
agent's counts (searches, failed searches, answered). Everything below `# --- end of your agent ---`
is train_agent.py's: the GRPO loop over the segments each episode recorded.

    pip install -r requirements.txt -r requirements-agents.txt
    python examples/langgraph_search.py                   # embedded default, CPU, no hub
    python examples/langgraph_search.py --model_path Qwen/Qwen2.5-1.5B-Instruct --server sglang --trainer_dtype bfloat16

Sync GRPO in one trainer process (async mode and torchrun: train_reflect.py, train_search.py).
Reads top to bottom: config, the agent (its tool, reward, run_agent), one episode, group rollout,
training rows, evaluation, data, warm start (embedded default only), the run's set-up, one GRPO
step, main() with the loop. docs/train_agent.md: how to bring your own agent the same way.
"""
import asyncio
import dataclasses
import functools
import gc
import json
import math
import os
import random
import re
import string
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere: lib/ is next door

import aiohttp
import fire
import numpy as np
import openai
import torch
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from tqdm import tqdm

from lib.actor import Actor
from lib.agent_workers import AgentWorkers, num_workers
from lib.async_rollout import BackgroundLoop, gather_groups, rollout_deadline_s, with_deadline
from lib.checkpoint import read_checkpoint_extra
from lib.client import InferenceClient, model_eos_ids
from lib.config import load_config, to_dict
from lib.grpo import equal_reward_groups, grpo_advantages, logprob_mismatch, mismatch_warning
from lib.launch import launch_cpu_server, launch_sglang
from lib.metrics import MetricsLogger, continue_jsonl
from lib.model_names import resolve_model_path
from lib.openai_proxy import OpenAIProxy, sdk_aiohttp_client
from lib.padding import concat_padded_tensors
from lib.ranks import server_seed
from lib.supervise import Supervisor
from lib.traces import episode_record, write_traces
from lib.weight_sync import ServerWeightSync


@dataclass
class Config:
    # --- run ---
    run_dir: str = "runs/langgraph_search"  # metrics.jsonl, traces.jsonl, checkpoints/, final/
    seed: int = 0
    max_steps: int = 50  # GRPO steps
    resume: bool = False  # continue from the latest checkpoint in run_dir
    checkpoint_every: int = 10  # steps; 0 = never
    # --- model and inference server ---
    model_path: str = ""  # HF dir or hub id of a chat model with tool calling; "" = the embedded tiny model, warm-started on tool calls
    server: str = "cpu"  # "cpu" (lib/cpu_server), "sglang", or "external" (server_addrs)
    server_addrs: list = field(default_factory=list)  # external servers, ["http://host:port", ...]
    server_device: str = "cpu"  # device of the CPU-capable server ("cuda" works too)
    server_threads: int = 1  # torch threads of the CPU server (the trainer keeps the rest)
    base_gpu_id: int = 1  # first GPU of the SGLang server (the trainer uses GPU 0)
    tp_size: int = 1
    mem_fraction_static: float | None = None
    sglang_extra_args: str = "--attention-backend triton --sampling-backend pytorch --grammar-backend none"
    trainer_dtype: str = "float32"  # "bfloat16" on GPUs
    trainer_threads: int = 0  # torch threads of the trainer; 0 = torch's default
    # --- data and retrieval ---
    data_dir: str = ""  # dir with corpus.jsonl and {train,dev,test}.jsonl; "" = bundled synthetic data
    retrieval_addr: str = ""  # a running Search-R1/ASearcher-style server; "" = start lib/retrieval
    topk: int = 2  # passages per search
    tool_timeout_s: float = 30.0
    tool_retries: int = 3  # attempts before the tool answers with a failure message
    max_info_chars: int = 1500  # cap of one search result
    # --- episode ---
    max_turns: int = 6  # model calls per episode (LangGraph's recursion limit follows from it)
    max_tokens: int = 1536  # context budget of one episode (the proxy's): prompt + all turns + tool output
    max_new_tokens_per_turn: int = 96  # the agent's max_tokens per model call
    stop_token_ids: list = field(default_factory=list)  # ids that end a turn; [] = the model's EOS set
    temperature: float = 1.0  # training sessions sample with exactly this (the proxy refuses another value)
    eval_temperature: float = 0.0  # evaluation sessions (not trained on): 0 = greedy
    # One episode's deadline, from its start (which includes waiting for the server behind every other
    # episode started with it): past it the episode is cancelled and its group fails, counted in
    # rollout/failed_groups, instead of hanging the run; 0 = none. At most 6 model calls of 96 tokens and
    # their searches: the embedded default's test evaluation (100 at once) generates at most half the tokens
    # of train_calc.py's (500 x 256, 137 s on 2 busy CPU cores). Raise it for big evaluations on a slow server.
    episode_timeout_s: float = 600.0
    # Run run_agent in this many worker processes, each with an event loop of its own: an SDK spends
    # milliseconds of CPU per model call, and on the trainer's loop (which also serves the proxy) those
    # run one after another while a GPU waits (docs/openai_proxy.md). 0 = on the trainer's loop; -1 =
    # 0 with the CPU server (its cores are the server's), else half the cores, at most 8. With workers,
    # run_agent, start_agent and close_agent must be module-level; items and results go by pickle.
    agent_workers: int = -1
    # --- GRPO ---
    batch_size: int = 4  # questions per step
    group_size: int = 4  # episodes per question
    lr: float = 5e-5
    grad_clip: float = 1.0
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.28
    scale_adv_by_std: bool = True  # divide by the group's reward std; Dr. GRPO: False, with loss_agg seq-mean-token-sum-norm
    drop_equal_groups: bool = False  # dynamic sampling: drop groups whose rewards are all equal
    loss_agg: str = "token-mean"  # DAPO's; "seq-mean-token-mean" (GRPO), "seq-mean-token-sum-norm" (Dr. GRPO)
    behav_imp_weight_cap: float = 2.0  # cap of the server->trainer importance weight per token; 0 = no cap
    behav_imp_weight_mode: str = "truncate"  # above the cap: "truncate" to it (TIS) or "mask" the token out (AReaL)
    max_tokens_per_mb: int = 8192  # micro-batch token budget of the trainer
    pack_sequences: bool = False  # padding-free rows; best with a varlen attention on GPUs
    attn_implementation: str | None = None  # trainer attention: None = lib's varlen when packed, else sdpa
    trainer_gradient_checkpointing: bool = False  # recompute activations in backward: ~half the memory, ~20% slower
    trainer_compile: bool | None = None  # torch.compile the decoder layers; None = on with one GPU
    trainer_offload_optimizer: bool = False  # bf16, one GPU: fp32 master + AdamW state in CPU memory between updates
    weight_sync: str = "disk"  # "disk" (safetensors + /update_weights_from_disk) or "nccl" (broadcast; gloo on CPUs)
    # --- warm start (embedded default only) ---
    warm_start_steps: int = 4000  # SFT steps on tool-calling demonstrations (copying answers out of results comes last)
    warm_start_worlds: int = 1  # counterfactual worlds (same names, other facts) whose questions are demonstrations too
    warm_start_lr: float = 2e-3
    warm_start_batch_size: int = 8
    # --- evaluation and logging ---
    eval_every: int = 10  # steps; 0 = only at the end
    eval_size: int = 50  # dev questions per evaluation
    test_size: int = 100  # test questions at the end
    trace_every: int = 1  # write trajectories (traces.jsonl, token by token; python -m lib.viewer) every N steps; 0 = never
    trace_groups: int = 1  # groups traced per traced step
    tensorboard: bool = True
    wandb_project: str | None = None


# --- your agent: the only part to edit ---
# The agent: LangGraph, nothing of agentrl in it.
PROMPT = "Answer the question in a few words. Look facts up with the search tool.\nQuestion: {question}"


def build_agent(llm, tools):
    """model -> (tool calls? tools -> model) -> END: the ReAct loop, as LangGraph's docs build it."""
    model = llm.bind_tools(tools)

    async def call_model(state: MessagesState):
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition, {"tools": "tools", END: END})
    graph.add_edge("tools", "model")
    return graph.compile()


# --- the tool: search over the retrieval server ---
def format_docs(docs: list, max_chars: int) -> str:
    lines = []
    for i, item in enumerate(docs):
        doc = item.get("document", item)
        if "title" in doc and "text" in doc:
            title, text = doc["title"], doc["text"]
        else:  # Search-R1's servers return contents = '"Title"\ntext'
            title, _, text = doc.get("contents", "").partition("\n")
            title = title.strip('"')
        lines.append(f"Doc {i + 1} (Title: {title}) {text}")
    return "\n".join(lines)[:max_chars]


def make_search_tool(http: aiohttp.ClientSession, retrieval_addr: str, cfg: Config, counts: dict):
    @tool
    async def search(query: str) -> str:
        """Search the encyclopedia; returns the top passages."""
        counts["searches"] += 1
        last_error = ""
        for attempt in range(cfg.tool_retries):  # retried with backoff; then the model reads the failure
            try:
                async with http.post(f"{retrieval_addr}/retrieve", json={"queries": [query], "topk": cfg.topk},
                                     timeout=aiohttp.ClientTimeout(total=cfg.tool_timeout_s)) as r:
                    if r.status < 400:
                        return format_docs((await r.json())["result"][0], cfg.max_info_chars)
                    last_error = f"HTTP {r.status}"
                    if r.status < 500:
                        break
            except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, TypeError, ValueError) as e:
                last_error = type(e).__name__
            if attempt + 1 < cfg.tool_retries:
                await asyncio.sleep(0.5 * 2 ** attempt)
        counts["failures"] += 1
        return f"The search tool failed ({last_error})."
    return search


# --- reward ---
def normalize_answer(s: str) -> str:
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def f1_score(pred: str, golds: list[str]) -> float:
    best, pred_tokens = 0.0, normalize_answer(pred).split()
    for gold in golds:
        gold_tokens = normalize_answer(gold).split()
        overlap = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if overlap:
            precision, recall = overlap / len(pred_tokens), overlap / len(gold_tokens)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


# --- run_agent: one episode of the agent against the episode's base URL ---
AGENT = {"cfg": Config(), "retrieval_addr": ""}  # what run_agent uses besides its arguments: start_agent() sets it


def start_agent(cfg: Config, retrieval_addr: str):
    """Called once before the first episode in every process that runs episodes (this one, and each
    worker process with cfg.agent_workers): the settings and the retrieval server of run_agent."""
    AGENT.update(cfg=cfg, retrieval_addr=retrieval_addr)


_http_clients: dict = {}  # event loop -> (the search tool's aiohttp session, the HTTP client of every ChatOpenAI)


def agent_http_clients() -> tuple:
    """The search tool's aiohttp session and one HTTP client for the ChatOpenAI of every episode on
    this event loop: the openai SDK's aiohttp transport (`DefaultAioHttpClient`). ChatOpenAI's
    default httpx pool walks every pooled connection on each request and holds one per concurrent
    episode: 6.7 ms of CPU per request against 3.7 ms (bench/bench_proxy_requests.py --langchain).
    None (ChatOpenAI's default) on an SDK without the aiohttp extra."""
    loop = asyncio.get_running_loop()
    if loop not in _http_clients:
        _http_clients[loop] = (aiohttp.ClientSession(), sdk_aiohttp_client())
    return _http_clients[loop]


async def run_agent(base_url: str, api_key: str, item: dict, temperature: float) -> dict:
    """Run the LangGraph agent once on `item` ({"question", "answer": [gold, ...]}) against the
    OpenAI-compatible server at `base_url`, as it would run anywhere. Returns the F1 of its final
    answer as the reward, and its stats: the F1 again, its counts (each logged as rollout/<name> and
    eval/<name>), how it finished and its answer (in the traces)."""
    cfg = AGENT["cfg"]
    tool_http, chat_http = agent_http_clients()
    llm = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, temperature=temperature,
                     max_tokens=cfg.max_new_tokens_per_turn, max_retries=0, http_async_client=chat_http)
    counts = {"searches": 0, "failures": 0}
    agent = build_agent(llm, [make_search_tool(tool_http, AGENT["retrieval_addr"], cfg, counts)])
    answer, finish = "", "answer"
    try:
        state = await agent.ainvoke({"messages": [("user", PROMPT.format(question=item["question"]))]},
                                    {"recursion_limit": 2 * cfg.max_turns})
        answer = state["messages"][-1].content or ""
        if state["messages"][-1].response_metadata.get("finish_reason") == "length":
            finish = "max_tokens"
    except GraphRecursionError:  # still calling tools after max_turns model calls
        finish = "max_turns"
    except openai.BadRequestError as e:
        if e.code != "context_length_exceeded":  # the proxy's budget is cfg.max_tokens
            raise
        finish = "max_tokens"
    f1 = f1_score(answer, item["answer"]) if answer else 0.0
    return {"reward": f1, "f1": f1, "searches": counts["searches"], "tool_failures": counts["failures"],
            "answered": finish == "answer", "finish_reason": finish, "answer": answer}


async def close_agent():
    """Called once at the end of the run, on the rollout loop: close what run_agent keeps open."""
    clients = _http_clients.pop(asyncio.get_running_loop(), None)
    if clients is not None:
        await clients[0].close()
        if clients[1] is not None:
            await clients[1].aclose()
# --- end of your agent ---


# --- one episode: a proxy session around run_agent ---
# names the trainer logs itself (the session's counts, the episode's keys): an agent's stats may not take them
RESERVED_STATS = {"reward", "item", "segments", "stats", "advantage", "rows", "episodes", "requests", "length_cut",
                  "tool_calls", "tool_call_parse_failures", "segments_per_episode", "episodes_without_segments",
                  "trained_rows", "gen_tokens", "equal_reward_groups", "failed_groups", "completion_tokens", "failed"}


async def arun_episode(proxy: OpenAIProxy, cfg: Config, item: dict, train: bool, agent=None) -> dict:
    """Run the agent once in a session of its own; returns the session's `segments` (training
    sequences, [1, T] tensors: docs/trajectory.md), the reward, the agent's `stats` and the
    session's counts. A session whose generation failed raises (lib.openai_proxy.SessionFailed),
    which drops the group. `agent`: what runs it, run_agent by default (AgentWorkers.run: the same in a worker process)."""
    agent = agent or run_agent
    key = proxy.new_session(train=train)  # evaluation sessions are not trained on and sample as they ask
    try:
        result = await agent(proxy.session_url(key), key, item, cfg.temperature if train else cfg.eval_temperature)
    finally:
        episode = proxy.end_session(key)
    reward, stats = agent_result(result)
    if reward is None:
        reward = episode["reward"]
    if reward is None:
        raise ValueError("run_agent returned None and the episode posted no reward: return the reward, or POST "
                         "{\"reward\": x} to /agentrl/reward with the episode's key")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"run_agent must return a finite number (or None after posting one), got {reward!r}")
    return {**episode, "reward": float(reward), "stats": stats, "item": item}


def agent_result(result) -> tuple:
    """(reward, stats) of what run_agent returned: a reward, None, or a dict of the reward under
    "reward" and the agent's own stats: numbers and bools (logged as their mean over the step's
    episodes, rollout/<name> and eval/<name>) and strings (shown in the traces: "answer", "finish_reason")."""
    if not isinstance(result, dict):
        return result, {}
    stats = {k: v for k, v in result.items() if k != "reward"}
    for name, value in stats.items():
        if not isinstance(name, str) or name in RESERVED_STATS:
            raise ValueError(f"run_agent's stat {name!r} takes a name the trainer logs itself: rename it")
        if not isinstance(value, (bool, str)) and not (isinstance(value, (int, float)) and math.isfinite(value)):
            raise ValueError(f"run_agent's stat {name!r} must be a finite number, a bool or a string, got {value!r}")
    return result.get("reward"), stats


def mean_stats(episodes: list[dict]) -> dict:
    """The agent's number and bool stats, each averaged over the episodes that report it."""
    names = dict.fromkeys(k for e in episodes for k, v in e["stats"].items() if not isinstance(v, str))
    return {k: float(np.mean([e["stats"][k] for e in episodes if k in e["stats"]])) for k in names}


# --- group rollout ---
async def rollout_group(proxy, cfg, item, group_size: int, train: bool, agent=None) -> list[dict]:
    # Each episode under its deadline: one that runs past it is cancelled and fails the group.
    return list(await asyncio.gather(*[with_deadline(arun_episode(proxy, cfg, item, train, agent), cfg.episode_timeout_s,
                                                     item) for _ in range(group_size)]))


async def rollout_groups(proxy, cfg, items, group_size: int, train: bool, agent=None):
    """(groups, number of failed groups): every group at once; a group with a failed episode (an
    exception in run_agent, a server error, past episode_timeout_s) is dropped, its traceback
    printed, and counted."""
    return await gather_groups([rollout_group(proxy, cfg, item, group_size, train, agent) for item in items])


# --- training rows ---
def build_batch(episodes: list[dict], group_size: int, scale_by_std: bool = True, drop_equal_groups: bool = False):
    """GRPO over episodes, then one training row per segment. Returns (batch, info): `batch` is
    the padded segments of the kept episodes with `rewards [R]` and `advantages [R]` (each
    segment's episode's), {} when there is nothing to train; `info` has per episode `rewards`,
    `advantages`, `keep`, the episode of each row (`row_episode`), the groups whose rewards are
    all equal and the episodes that recorded no segment (nothing sampled: nothing to train).
    An episode with many segments counts once in its group's statistics."""
    rewards = torch.tensor([e["reward"] for e in episodes], dtype=torch.float32)
    advantages = grpo_advantages(rewards, group_size, scale_by_std=scale_by_std)
    equal = equal_reward_groups(rewards, group_size)
    keep = ~equal if drop_equal_groups else torch.ones_like(equal)
    row_episode = [i for i, e in enumerate(episodes) if keep[i] for _ in e["segments"]]
    batch = {}
    if row_episode:
        batch = concat_padded_tensors([s for i, e in enumerate(episodes) if keep[i] for s in e["segments"]])
        batch["rewards"], batch["advantages"] = rewards[row_episode], advantages[row_episode]
    info = {"rewards": rewards, "advantages": advantages, "keep": keep, "row_episode": row_episode,
            "equal_reward_groups": int(equal.sum()) // group_size,
            "episodes_without_segments": sum(not e["segments"] for e in episodes)}
    return batch, info


# --- evaluation ---
async def evaluate(proxy, cfg, items, agent=None) -> dict:
    """One episode per item in sessions that are not trained on, at cfg.eval_temperature."""
    groups, failed = await rollout_groups(proxy, cfg, items, 1, train=False, agent=agent)
    episodes = [g[0] for g in groups]
    return {
        "failed": failed,
        "reward": float(np.mean([e["reward"] for e in episodes])),
        "requests": float(np.mean([e["requests"] for e in episodes])),
        "completion_tokens": float(np.mean([e["completion_tokens"] for e in episodes])),
        **mean_stats(episodes),
    }


# --- data ---
def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for row in rows:  # Search-R1 files name the gold list golden_answers; ASearcher's use answer
        gold = row.get("answer", row.get("golden_answers"))
        row["answer"] = [gold] if isinstance(gold, str) else list(gold)
    return rows


# --- warm start (embedded default only) ---
SEARCH_TOOL_SCHEMA = convert_to_openai_tool(make_search_tool(None, "", Config(), {}))  # what ChatOpenAI sends


def build_demonstrations(tokenizer, cfg: Config, items: list[dict], corpus_path: str) -> list[dict]:
    """Conversations the agent should have: per hop, a search tool call with the hop's query and the
    real BM25 results as the tool's answer; then the answer. Rendered by the chat template with the
    tool schema ChatOpenAI sends, so the warm start learns the exact tool-call text the proxy parses.
    The loss covers every token (copying names from results forms sooner, as in train_search.py)."""
    from lib.retrieval import bm25_search, load_bm25

    index = load_bm25(corpus_path)
    examples = []
    for item in items:
        messages = [{"role": "user", "content": PROMPT.format(question=item["question"])}]
        for query in item["hop_queries"]:
            messages += [{"role": "assistant", "content": "", "tool_calls": [
                             {"type": "function", "function": {"name": "search", "arguments": {"query": query}}}]},
                         {"role": "tool", "content": format_docs(bm25_search(index, [query], cfg.topk)[0],
                                                                 cfg.max_info_chars)}]
        messages.append({"role": "assistant", "content": item["answer"][0]})
        text = tokenizer.apply_chat_template(messages, tools=[SEARCH_TOOL_SCHEMA], tokenize=False).rstrip("\n")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= cfg.max_tokens:
            examples.append({"input_ids": ids, "loss_mask": [1] * len(ids)})
    return examples


def embedded_model_and_data(cfg: Config) -> tuple[str, str]:
    """Build (once, cached) the tiny model with a tool-calling chat template, the synthetic
    encyclopedia and the SFT warm start on tool-calling demonstrations."""
    import shutil

    from transformers import AutoTokenizer

    from lib.cache import build_once
    from lib.tiny_model import TOOLS_CHAT_TEMPLATE, default_tiny_model_dir
    from lib.warm_start import warm_start, warm_start_dir
    from lib.wiki_data import default_wiki_dir

    data_dir = cfg.data_dir or default_wiki_dir(seed=0)
    base = default_tiny_model_dir()

    def with_tools_template(tmp):  # the tiny model, its chat template able to render tools
        for name in os.listdir(base):
            shutil.copy(os.path.join(base, name), tmp)
        tokenizer = AutoTokenizer.from_pretrained(base)
        tokenizer.chat_template = TOOLS_CHAT_TEMPLATE
        tokenizer.save_pretrained(tmp)
    tools_base = build_once(warm_start_dir("tiny-tools", {"base": base, "template": TOOLS_CHAT_TEMPLATE}),
                            with_tools_template)

    def examples(tokenizer):
        demos = build_demonstrations(tokenizer, cfg, read_jsonl(os.path.join(data_dir, "warmstart.jsonl")),
                                     os.path.join(data_dir, "corpus.jsonl"))
        # Worlds with the training world's names and other facts: the answer is only in the results,
        # so the model learns to copy names from them (400 steps on the warm-start split alone
        # learned the tool-call format but not copying: dev F1 0.0, docs/benchmarks.md).
        for seed in range(1, cfg.warm_start_worlds + 1):
            world = default_wiki_dir(seed=seed, names_seed=0)
            items = [q for split in ("warmstart", "train", "dev", "test")
                     for q in read_jsonl(os.path.join(world, f"{split}.jsonl"))]
            demos += build_demonstrations(tokenizer, cfg, items, os.path.join(world, "corpus.jsonl"))
        return demos
    out = warm_start("langgraph-search-warm-start", tools_base, examples, steps=cfg.warm_start_steps,
                     lr=cfg.warm_start_lr, batch_size=cfg.warm_start_batch_size, seed=cfg.seed)
    return out, data_dir


# --- the run: set-up and tear-down ---
@dataclass
class Run:
    """What the loop touches: built by setup(), closed by close()."""
    cfg: Config
    tokenizer: object = None
    train_items: list = None
    dev_items: list = None
    test_items: list = None
    supervisors: list = field(default_factory=list)  # of the servers launched here
    bg: BackgroundLoop = None  # the event loop of every client call and episode
    client: InferenceClient = None
    proxy: OpenAIProxy = None  # the agent's OpenAI-compatible server
    agent: object = None  # what runs an episode: None = run_agent, or AgentWorkers.run (cfg.agent_workers)
    agent_workers: AgentWorkers = None
    actor: Actor = None
    weight_sync: ServerWeightSync = None
    logger: MetricsLogger = None
    trace_file: object = None
    ckpt_dir: str = ""
    resumed: bool = False
    step: int = 0
    version: int = 0  # policy version: weight syncs so far
    data_position: int = 0  # index of the next train item


def check_config(cfg: Config):
    if cfg.server not in ("cpu", "sglang", "external"):
        raise ValueError(f"server must be 'cpu', 'sglang' or 'external', got {cfg.server!r}")
    if cfg.server == "external" and not cfg.server_addrs:
        raise ValueError("server 'external' needs server_addrs: --server_addrs '[\"http://host:port\"]'")
    if cfg.weight_sync not in ("disk", "nccl"):
        raise ValueError(f"weight_sync must be 'disk' or 'nccl', got {cfg.weight_sync!r}")
    num_workers(cfg.agent_workers, beside_cpu_server=cfg.server == "cpu")  # refuses a bad value before anything starts


def setup(cfg: Config) -> Run:
    """Seeds, model, data, servers (retrieval, inference), client, proxy, actor, weight sync, the
    resumed checkpoint and the logger. If any of it fails, what was opened is closed."""
    check_config(cfg)
    run = Run(cfg)
    try:
        _setup(run)
    except BaseException:
        close(run)
        raise
    return run


def _setup(run: Run):
    cfg = run.cfg
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.trainer_threads:
        torch.set_num_threads(cfg.trainer_threads)
    os.makedirs(cfg.run_dir, exist_ok=True)
    from transformers import AutoTokenizer

    from lib.retrieval import launch_retrieval_server
    from lib.wiki_data import default_wiki_dir

    if cfg.model_path:
        model_path, data_dir = resolve_model_path(cfg.model_path), cfg.data_dir or default_wiki_dir(seed=0)
    else:
        model_path, data_dir = embedded_model_and_data(cfg)
    run.tokenizer = AutoTokenizer.from_pretrained(model_path)
    if not cfg.stop_token_ids:  # a turn ends on any of the model's EOS ids (Qwen2.5: <|im_end|> and <|endoftext|>)
        cfg = run.cfg = dataclasses.replace(cfg, stop_token_ids=model_eos_ids(model_path, run.tokenizer))
    splits = {s: read_jsonl(os.path.join(data_dir, f"{s}.jsonl")) for s in ("train", "dev", "test")}
    run.train_items, run.dev_items, run.test_items = (splits["train"], splits["dev"][: cfg.eval_size],
                                                      splits["test"][: cfg.test_size])
    if not run.train_items:
        raise ValueError("the train split is empty: nothing to train on")

    # Servers: retrieval and inference, started here and killed with this process (supervised), or given.
    # A resumed run seeds the server's sampling by its step, so it does not replay the start of the run.
    run.ckpt_dir = os.path.join(cfg.run_dir, "checkpoints")
    resume_extra = read_checkpoint_extra(os.path.join(run.ckpt_dir, "latest")) if cfg.resume else None
    if cfg.resume and resume_extra is None:
        print(f"--resume True: no checkpoint in {run.ckpt_dir}; starting from step 0")
    sampling_seed = server_seed(cfg.seed, resume_extra["step"] if resume_extra else 0)
    addrs = list(cfg.server_addrs)
    retrieval_addr = cfg.retrieval_addr.rstrip("/")
    if not retrieval_addr:
        retrieval = launch_retrieval_server(os.path.join(data_dir, "corpus.jsonl"),
                                            log_path=os.path.join(cfg.run_dir, "retrieval.log"))
        run.supervisors.append(Supervisor("retrieval server", retrieval))
        retrieval_addr = retrieval.address
    start_agent(cfg, retrieval_addr)
    if cfg.server != "external":
        if cfg.server == "sglang":
            server = launch_sglang(model_path, base_gpu_id=cfg.base_gpu_id, tp_size=cfg.tp_size,
                                   mem_fraction_static=cfg.mem_fraction_static, random_seed=sampling_seed,
                                   extra_args=cfg.sglang_extra_args.split(),
                                   log_path=os.path.join(cfg.run_dir, "sglang.log"))
        else:
            server = launch_cpu_server(model_path, device=cfg.server_device, num_threads=cfg.server_threads,
                                       random_seed=sampling_seed, log_path=os.path.join(cfg.run_dir, "cpu_server.log"))
        run.supervisors.append(Supervisor("inference server", server))
        addrs = [server.address]

    # Every client call and every episode runs on one event loop in a background thread; this thread
    # trains. The agent's requests go to the proxy, which generates through the client and records the
    # sampled tokens; a training session samples with the trainer's temperature only.
    run.bg = BackgroundLoop()
    run.client = InferenceClient(addrs)
    run.proxy = OpenAIProxy(run.client, run.tokenizer, stop_token_ids=cfg.stop_token_ids,
                            max_context_tokens=cfg.max_tokens, default_max_tokens=cfg.max_new_tokens_per_turn,
                            train_sampling={"temperature": cfg.temperature})
    run.bg.run(run.proxy.start())
    workers = num_workers(cfg.agent_workers, beside_cpu_server=cfg.server == "cpu")
    if workers:  # run_agent in processes of its own, each with its own event loop
        run.agent_workers = AgentWorkers(run_agent, workers, init=start_agent,
                                         init_args=(cfg, retrieval_addr), close=close_agent)
        run.agent = run.agent_workers.run
    run.actor = Actor(model_path, lr=cfg.lr, grad_clip=cfg.grad_clip, temperature=cfg.temperature,
                      max_tokens_per_mb=cfg.max_tokens_per_mb, dtype=cfg.trainer_dtype,
                      eps_clip_low=cfg.eps_clip_low, eps_clip_high=cfg.eps_clip_high, loss_agg=cfg.loss_agg,
                      loss_norm_tokens=cfg.max_tokens,
                      packed=cfg.pack_sequences, attn_implementation=cfg.attn_implementation,
                      gradient_checkpointing=cfg.trainer_gradient_checkpointing, compile_layers=cfg.trainer_compile,
                      offload_optimizer=cfg.trainer_offload_optimizer,
                      behaviour_weight_cap=cfg.behav_imp_weight_cap or None,
                      behaviour_cap_mode=cfg.behav_imp_weight_mode)
    run.weight_sync = ServerWeightSync(cfg.weight_sync, run.actor, run.client, run.bg.run, num_servers=len(addrs),
                                       tp_size=cfg.tp_size, disk_dir=os.path.join(cfg.run_dir, "weights"))

    if resume_extra is not None:
        extra = run.actor.load_checkpoint(os.path.join(run.ckpt_dir, "latest"))
        run.step, run.version, run.data_position = extra["step"], extra["version"], extra["data_position"]
        random.setstate(extra["python_rng"])
        np.random.set_state(extra["numpy_rng"])
        torch.set_rng_state(extra["torch_rng"])
        run.weight_sync.sync(run.version)  # the server still holds the initial weights: give it the resumed policy
        run.resumed = True
        print(f"resumed from step {run.step} (policy version {run.version}, data position {run.data_position})")
    run.client.set_version(run.version)
    resume_step = run.step if run.resumed else None
    run.logger = MetricsLogger(cfg.run_dir, to_dict(cfg), tensorboard=cfg.tensorboard,
                               wandb_project=cfg.wandb_project, resume_step=resume_step)
    run.trace_file = open(continue_jsonl(os.path.join(cfg.run_dir, "traces.jsonl"), resume_step), "a")
    # What is built by now lives as long as the run; frozen, it is left out of garbage collections,
    # whose full passes would otherwise scan all of it on the event loop mid-rollout (docs/openai_proxy.md).
    gc.freeze()


def close(run: Run):
    """Everything setup() opened, in reverse order; also after an error, when some of it may be missing."""
    try:
        for opened in (run.trace_file, run.logger, run.weight_sync):
            if opened is not None:
                opened.close()
        if run.proxy is not None:
            run.bg.run(run.agent_workers.close() if run.agent_workers else close_agent(), timeout_s=60)
            run.bg.run(run.proxy.close(), timeout_s=30)
        if run.client is not None:
            run.bg.run(run.client.close(), timeout_s=30)
    finally:
        if run.bg is not None:
            run.bg.close()
        for s in run.supervisors:
            s.stop()


@functools.lru_cache(maxsize=2)
def epoch_order(seed: int, num_items: int) -> np.ndarray:
    return np.random.RandomState(seed).permutation(num_items)


def item_at(run: Run, index: int) -> dict:
    # The data order is a function of (seed, index), so a resumed run sees the same items.
    epoch, offset = divmod(index, len(run.train_items))
    return run.train_items[epoch_order(run.cfg.seed + epoch, len(run.train_items))[offset]]


def run_rollout(run: Run, rollout, what: str):
    # A rollout starts all its episodes at once, so it ends by their deadline; if not, the event
    # loop is stuck: the run stops, naming the episodes still running and where each is.
    return run.bg.run(rollout, timeout_s=rollout_deadline_s(run.cfg.episode_timeout_s), what=what)


# --- one GRPO step ---
def rollout_step(run: Run) -> tuple[dict, list[dict], dict]:
    """1. rollout and 2. advantages. Returns (batch: a row per segment of the kept episodes, {} when
    there is nothing to train; the episodes, each with its `advantage` and its batch `rows`; the
    rollout's metrics)."""
    cfg = run.cfg
    for s in run.supervisors:
        s.check()
    # 1. rollout: group_size episodes of the agent per item, each in its own proxy session
    items = [item_at(run, run.data_position + i) for i in range(cfg.batch_size)]
    try:
        groups, failed_groups = run_rollout(run, rollout_groups(run.proxy, cfg, items, cfg.group_size, train=True, agent=run.agent),
                                            f"step {run.step + 1}'s rollout")
    except RuntimeError:
        for s in run.supervisors:
            s.check()  # a dead server is the clearer cause
        raise
    run.data_position += cfg.batch_size
    episodes = [e for g in groups for e in g]

    # 2. advantages per episode over its group; every segment of an episode is a training row
    # with the episode's reward and advantage (an episode without a segment trains nothing)
    batch, info = build_batch(episodes, cfg.group_size, cfg.scale_adv_by_std, cfg.drop_equal_groups)
    for i, e in enumerate(episodes):  # for the traces
        e["advantage"] = info["advantages"][i].item()
        e["rows"] = [row for row, j in enumerate(info["row_episode"]) if j == i]
    metrics = {
        "rollout/reward": info["rewards"].mean().item(),
        "rollout/episodes": len(episodes),
        "rollout/requests": float(np.mean([e["requests"] for e in episodes])),
        "rollout/length_cut": float(np.mean([e["length_cut"] for e in episodes])),
        "rollout/tool_calls": float(np.mean([e["tool_calls"] for e in episodes])),
        "rollout/tool_call_parse_failures": int(sum(e["tool_call_parse_failures"] for e in episodes)),
        "rollout/segments_per_episode": float(np.mean([len(e["segments"]) for e in episodes])),
        "rollout/episodes_without_segments": info["episodes_without_segments"],
        "rollout/trained_rows": len(info["row_episode"]),
        "rollout/gen_tokens": int(batch["loss_mask"].sum()) if batch else 0,
        "rollout/equal_reward_groups": info["equal_reward_groups"],
        "rollout/failed_groups": failed_groups,
        **{f"rollout/{k}": v for k, v in mean_stats(episodes).items()},
    }
    return batch, episodes, metrics


def train_step(run: Run, batch: dict) -> dict:
    """3. proximal log-probs (the trainer's; `logprobs` stays the server's) into
    `batch["proximal_logprobs"]`, then 4. the PPO update; nothing when `batch` is empty."""
    cfg, metrics = run.cfg, {}
    t1 = time.time()
    if batch:
        batch["proximal_logprobs"] = run.actor.compute_logprobs(batch)
        mismatch = logprob_mismatch(batch["proximal_logprobs"], batch["logprobs"], batch["loss_mask"],
                                    cfg.behav_imp_weight_cap or None)
        if (warning := mismatch_warning(mismatch)):
            tqdm.write(warning)
        metrics.update({f"logprob/{k}": v for k, v in mismatch.items()})
    metrics["perf/logp_s"] = time.time() - t1
    t2 = time.time()
    if batch:
        metrics.update({f"loss/{k}": v for k, v in run.actor.update(batch, step=run.step).items()})
    metrics["perf/update_s"] = time.time() - t2
    return metrics


def sync_weights(run: Run, trained: bool) -> dict:
    """5. weight sync: pause generation, push the new weights, continue; bump the version. A step
    with nothing trained leaves the weights and the version as they are."""
    t3 = time.time()
    if trained:
        run.version += 1
        run.bg.run(run.client.pause_generation())
        run.weight_sync.sync(run.version)
        run.bg.run(run.client.continue_generation(run.version))
    return {"perf/sync_s": time.time() - t3}


def log_step(run: Run, metrics: dict, episodes: list[dict], batch: dict):
    """6. log: the step's metrics row, with the dev evaluation every eval_every steps, and its
    traces: one record per segment, trainer log-probs included."""
    cfg = run.cfg
    metrics["policy/version"] = run.version
    if cfg.eval_every and run.step % cfg.eval_every == 0:
        ev = run_evaluation(run, "eval", run.dev_items, log=False)
        metrics.update({f"eval/{k}": v for k, v in ev.items()})
        tqdm.write(f"step {run.step} dev: {ev}")
    run.logger.log(run.step, metrics)
    if cfg.trace_every and run.step % cfg.trace_every == 0:
        records = []
        for i, e in enumerate(episodes[: cfg.trace_groups * cfg.group_size]):
            item = e["item"] if isinstance(e["item"], dict) else {}
            for k, segment in enumerate(e["segments"]):
                row = e["rows"][k] if e["rows"] else None  # None: dropped, never scored by the trainer
                records.append(episode_record(
                    {**segment, **e["stats"], "rewards": torch.tensor([e["reward"]]), "question": item.get("question"),
                     "gold": item.get("answer"), "requests": e["requests"], "segment": k},
                    run.tokenizer, step=run.step, group=i // cfg.group_size, index=i % cfg.group_size,
                    advantage=e["advantage"], context_role="tool",
                    trainer_logprobs=batch["proximal_logprobs"][row] if row is not None else None))
        write_traces(run.trace_file, records)


def save_checkpoint(run: Run):
    """7. checkpoint: model, optimizer, scheduler, the counters and the RNGs."""
    run.actor.save_checkpoint(os.path.join(run.ckpt_dir, "latest"), extra={
        "step": run.step, "version": run.version, "data_position": run.data_position,
        "python_rng": random.getstate(), "numpy_rng": np.random.get_state(), "torch_rng": torch.get_rng_state()})


def run_evaluation(run: Run, split: str, items: list[dict], log: bool = True) -> dict:
    """One episode per item in sessions that are not trained on: their metrics, also logged under
    `{split}/...` at this step unless `log` is False (log_step adds the dev evaluation to the step's row)."""
    what = "the test evaluation" if split == "test" else f"step {run.step}'s evaluation"
    metrics = run_rollout(run, evaluate(run.proxy, run.cfg, items, run.agent), what)
    if log:
        run.logger.log(run.step, {f"{split}/{k}": v for k, v in metrics.items()})
    return metrics


# --- main: the GRPO loop ---
def main(config: str | None = "configs/langgraph_search_tiny.yaml", **overrides):
    cfg = load_config(Config, config, overrides)
    run = setup(cfg)
    cfg = run.cfg
    try:
        if run.step == 0 and cfg.eval_every:
            print(f"step 0 dev: {run_evaluation(run, 'eval', run.dev_items)}")
        progress = tqdm(total=cfg.max_steps, initial=run.step, desc="GRPO (LangGraph agent)")
        while run.step < cfg.max_steps:
            t0 = time.time()
            # 1. rollout, 2. advantages: a row per segment of the kept episodes
            batch, episodes, metrics = rollout_step(run)
            metrics["perf/rollout_s"] = time.time() - t0
            # 3. proximal log-probs, 4. PPO update
            metrics.update(train_step(run, batch))
            # 5. weight sync and version bump, when anything was trained
            metrics.update(sync_weights(run, trained=bool(batch)))
            run.step += 1
            # 6. log
            metrics["perf/step_s"] = time.time() - t0
            log_step(run, metrics, episodes, batch)
            progress.update(1)
            progress.set_postfix(reward=f"{metrics['rollout/reward']:.3f}", step_s=f"{metrics['perf/step_s']:.1f}")
            # 7. checkpoint
            if cfg.checkpoint_every and (run.step % cfg.checkpoint_every == 0 or run.step == cfg.max_steps):
                save_checkpoint(run)
        progress.close()

        test_metrics = run_evaluation(run, "test", run.test_items)
        print(f"test after {run.step} steps: {test_metrics}")
        run.actor.save_hf(os.path.join(cfg.run_dir, "final"))
        return test_metrics
    finally:
        close(run)


if __name__ == "__main__":
    fire.Fire(main)
