"""Train a LangGraph agent with GRPO: the agent is ordinary LangGraph code, unaware of training.

The agent (`build_agent`) is a LangGraph graph: a chat model with a `search` tool over the
encyclopedia's retrieval server, looping model -> tools -> model until the model answers. Its
chat model is `langchain_openai.ChatOpenAI` pointed at lib/openai_proxy.py, which generates with
the policy on the inference server and records every sampled token. Reward: F1 of the final answer
against the gold answers.

    pip install -r requirements.txt -r requirements-agents.txt
    python examples/langgraph_search.py                   # embedded default, CPU, no hub
    python examples/langgraph_search.py --model_path Qwen/Qwen2.5-1.5B-Instruct --server sglang --trainer_dtype bfloat16

Sync GRPO in one trainer process (async mode and torchrun: train_reflect.py, train_search.py).
Reads top to bottom: config, the agent, its tool, reward, one episode, group rollout, evaluation,
data, warm start (embedded default only), main() with the GRPO loop. To train your own agent, swap
`build_agent` and the tool for yours and keep the rest: the agent only needs a chat model whose
base_url and api_key it is given.
"""
import asyncio
import dataclasses
import functools
import json
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
    temperature: float = 1.0
    # One episode's deadline, from its start (which includes waiting for the server behind every other
    # episode started with it): past it the episode is cancelled and its group fails, counted in
    # rollout/failed_groups, instead of hanging the run; 0 = none. At most 6 model calls of 96 tokens and
    # their searches: the embedded default's test evaluation (100 at once) generates at most half the tokens
    # of train_calc.py's (500 x 256, 137 s on 2 busy CPU cores). Raise it for big evaluations on a slow server.
    episode_timeout_s: float = 600.0
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
    warm_start_steps: int = 4000  # SFT steps on tool-calling demonstrations (1200 did not copy answers: dev F1 0.03)
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


# --- the agent: LangGraph, nothing of agentrl in it ---
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


# --- one episode ---
_chat_http_clients: dict = {}  # event loop -> the HTTP client every episode's ChatOpenAI shares


def chat_http_client():
    """One HTTP client for the ChatOpenAI of every episode on this event loop: the openai SDK's
    aiohttp transport (`DefaultAioHttpClient`). ChatOpenAI's default httpx pool walks every pooled
    connection on each request and holds one per concurrent episode: 6.7 ms of CPU per request
    against 3.7 ms (bench/bench_proxy_requests.py --langchain). None (ChatOpenAI's default) on an
    SDK without the aiohttp extra."""
    loop = asyncio.get_running_loop()
    if loop not in _chat_http_clients:
        _chat_http_clients[loop] = sdk_aiohttp_client()
    return _chat_http_clients[loop]


async def close_chat_http_client():
    client = _chat_http_clients.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.aclose()


async def arun_episode(proxy: OpenAIProxy, http, retrieval_addr: str, cfg: Config, item: dict, temperature: float) -> dict:
    """Run the agent once as it would run anywhere; the proxy session records it. The result's
    `segments` are training sequences (one per unbroken conversation; a LangGraph ReAct loop only
    appends, so one) that share the episode's reward."""
    key = proxy.new_session(train=temperature != 0.0)  # evaluation (greedy) is not trained on
    llm = ChatOpenAI(model="policy", base_url=proxy.url, api_key=key, temperature=temperature,
                     max_tokens=cfg.max_new_tokens_per_turn, max_retries=0, http_async_client=chat_http_client())
    counts = {"searches": 0, "failures": 0}
    agent = build_agent(llm, [make_search_tool(http, retrieval_addr, cfg, counts)])
    messages, answer, finish = [], None, "answer"
    try:
        state = await agent.ainvoke({"messages": [("user", PROMPT.format(question=item["question"]))]},
                                    {"recursion_limit": 2 * cfg.max_turns})
        messages = state["messages"]
        answer = messages[-1].content
        if messages[-1].response_metadata.get("finish_reason") == "length":
            finish = "max_tokens"
    except GraphRecursionError:  # still calling tools after max_turns model calls
        finish = "max_turns"
    except openai.BadRequestError as e:
        if e.code != "context_length_exceeded":  # the proxy's budget is cfg.max_tokens
            raise
        finish = "max_tokens"
    finally:
        episode = proxy.end_session(key)
    return {
        "segments": episode["segments"],
        "reward": f1_score(answer, item["answer"]) if answer else 0.0,
        "num_model_calls": episode["requests"],
        "num_searches": counts["searches"],
        "num_tool_failures": counts["failures"],
        "tool_call_parse_failures": episode["tool_call_parse_failures"],
        "finish_reason": finish,
        "answer": answer,
        "question": item["question"],
        "gold": item["answer"],
        "messages": [{"role": m.type, "content": m.content, "tool_calls": getattr(m, "tool_calls", None) or None}
                     for m in messages],
    }


# --- group rollout ---
async def rollout_group(proxy, http, retrieval_addr, cfg, item, temperature, group_size) -> list[dict]:
    # Each run of the agent under its deadline: one that runs past it fails the group (dropped and counted).
    return list(await asyncio.gather(*[
        with_deadline(arun_episode(proxy, http, retrieval_addr, cfg, item, temperature), cfg.episode_timeout_s, item)
        for _ in range(group_size)]))


async def rollout_groups(proxy, http, retrieval_addr, cfg, items, temperature, group_size):
    """(groups, number of failed groups): a group with a failed episode (server error, abort) is
    dropped and counted."""
    return await gather_groups([rollout_group(proxy, http, retrieval_addr, cfg, item, temperature, group_size)
                                for item in items])


# --- evaluation ---
async def evaluate(proxy, http, retrieval_addr, cfg, items) -> dict:
    """Greedy, one episode per question."""
    groups, failed = await rollout_groups(proxy, http, retrieval_addr, cfg, items, 0.0, 1)
    episodes = [g[0] for g in groups]
    return {
        "failed": failed,
        "f1": float(np.mean([e["reward"] for e in episodes])),
        "searches": float(np.mean([e["num_searches"] for e in episodes])),
        "answered": float(np.mean([e["finish_reason"] == "answer" for e in episodes])),
        "tool_call_parse_failures": float(np.mean([e["tool_call_parse_failures"] for e in episodes])),
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
    from lib.warm_start import code_fingerprint, sft_warm_start, warm_start_dir
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
    code = code_fingerprint(build_demonstrations, format_docs)
    settings = {"base": tools_base, "steps": cfg.warm_start_steps, "lr": cfg.warm_start_lr,
                "batch": cfg.warm_start_batch_size, "data": data_dir, "prompt": PROMPT, "topk": cfg.topk,
                "tool": SEARCH_TOOL_SCHEMA, "max_tokens": cfg.max_tokens, "worlds": cfg.warm_start_worlds, "code": code}
    out = warm_start_dir("langgraph-search-warm-start", settings)
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        tokenizer = AutoTokenizer.from_pretrained(tools_base)
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
        print(f"warm start: {len(demos)} tool-calling demonstrations, {cfg.warm_start_steps} SFT steps")
        t0 = time.time()
        sft_warm_start(tools_base, demos, out, steps=cfg.warm_start_steps, lr=cfg.warm_start_lr,
                       batch_size=cfg.warm_start_batch_size, seed=cfg.seed)
        print(f"warm start built in {time.time() - t0:.0f} s: {out}")
    return out, data_dir


# --- main: the GRPO loop ---
def main(config: str | None = "configs/langgraph_search_tiny.yaml", **overrides):
    cfg = load_config(Config, config, overrides)
    if cfg.server not in ("cpu", "sglang", "external"):
        raise ValueError(f"server must be 'cpu', 'sglang' or 'external', got {cfg.server!r}")
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
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if not cfg.stop_token_ids:  # a turn ends on any of the model's EOS ids (Qwen2.5: <|im_end|> and <|endoftext|>)
        cfg = dataclasses.replace(cfg, stop_token_ids=model_eos_ids(model_path, tokenizer))
    splits = {s: read_jsonl(os.path.join(data_dir, f"{s}.jsonl")) for s in ("train", "dev", "test")}
    train_items, dev_items, test_items = splits["train"], splits["dev"][: cfg.eval_size], splits["test"][: cfg.test_size]

    @functools.lru_cache(maxsize=2)
    def epoch_order(epoch: int):
        return np.random.RandomState(cfg.seed + epoch).permutation(len(train_items))

    def item_at(index: int) -> dict:
        epoch, offset = divmod(index, len(train_items))
        return train_items[epoch_order(epoch)[offset]]

    # Servers: retrieval and inference, started here and killed with this process (supervised), or given.
    ckpt_dir = os.path.join(cfg.run_dir, "checkpoints")
    resume_extra = read_checkpoint_extra(os.path.join(ckpt_dir, "latest")) if cfg.resume else None
    sampling_seed = server_seed(cfg.seed, resume_extra["step"] if resume_extra else 0)
    supervisors, addrs = [], list(cfg.server_addrs)
    retrieval_addr = cfg.retrieval_addr.rstrip("/")
    if not retrieval_addr:
        retrieval = launch_retrieval_server(os.path.join(data_dir, "corpus.jsonl"),
                                            log_path=os.path.join(cfg.run_dir, "retrieval.log"))
        supervisors.append(Supervisor("retrieval server", retrieval))
        retrieval_addr = retrieval.address
    if cfg.server != "external":
        if cfg.server == "sglang":
            server = launch_sglang(model_path, base_gpu_id=cfg.base_gpu_id, tp_size=cfg.tp_size,
                                   mem_fraction_static=cfg.mem_fraction_static, random_seed=sampling_seed,
                                   extra_args=cfg.sglang_extra_args.split(),
                                   log_path=os.path.join(cfg.run_dir, "sglang.log"))
        else:
            server = launch_cpu_server(model_path, device=cfg.server_device, num_threads=cfg.server_threads,
                                       random_seed=sampling_seed, log_path=os.path.join(cfg.run_dir, "cpu_server.log"))
        supervisors.append(Supervisor("inference server", server))
        addrs = [server.address]

    # Every client call runs on one event loop in a background thread; this thread trains. The
    # agent's chat requests go to the proxy, which generates through the client.
    bg = BackgroundLoop()
    run = bg.run
    client = InferenceClient(addrs)
    proxy = OpenAIProxy(client, tokenizer, stop_token_ids=cfg.stop_token_ids, max_context_tokens=cfg.max_tokens,
                        default_max_tokens=cfg.max_new_tokens_per_turn,
                        train_sampling={"temperature": cfg.temperature})
    run(proxy.start())

    async def open_http():
        return aiohttp.ClientSession()
    http = run(open_http())
    actor = Actor(model_path, lr=cfg.lr, grad_clip=cfg.grad_clip, temperature=cfg.temperature,
                  max_tokens_per_mb=cfg.max_tokens_per_mb, dtype=cfg.trainer_dtype,
                  eps_clip_low=cfg.eps_clip_low, eps_clip_high=cfg.eps_clip_high, loss_agg=cfg.loss_agg,
                  loss_norm_tokens=cfg.max_tokens,
                  packed=cfg.pack_sequences, attn_implementation=cfg.attn_implementation,
                  gradient_checkpointing=cfg.trainer_gradient_checkpointing, compile_layers=cfg.trainer_compile,
                  offload_optimizer=cfg.trainer_offload_optimizer,
                  behaviour_weight_cap=cfg.behav_imp_weight_cap or None, behaviour_cap_mode=cfg.behav_imp_weight_mode)
    weight_sync = ServerWeightSync(cfg.weight_sync, actor, client, run, num_servers=len(addrs), tp_size=cfg.tp_size,
                                   disk_dir=os.path.join(cfg.run_dir, "weights"))

    step, version, data_position = 0, 0, 0
    if resume_extra is not None:
        extra = actor.load_checkpoint(os.path.join(ckpt_dir, "latest"))
        step, version, data_position = extra["step"], extra["version"], extra["data_position"]
        random.setstate(extra["python_rng"])
        np.random.set_state(extra["numpy_rng"])
        torch.set_rng_state(extra["torch_rng"])
        weight_sync.sync(version)  # the server still holds the initial weights: give it the resumed policy
        print(f"resumed from step {step} (policy version {version}, data position {data_position})")
    client.set_version(version)
    resume_step = step if resume_extra is not None else None
    logger = MetricsLogger(cfg.run_dir, to_dict(cfg), tensorboard=cfg.tensorboard, wandb_project=cfg.wandb_project,
                           resume_step=resume_step)
    trace_file = open(continue_jsonl(os.path.join(cfg.run_dir, "traces.jsonl"), resume_step), "a")
    episode_args = (proxy, http, retrieval_addr, cfg)

    def run_rollout(rollout, what: str):
        # A rollout starts all its episodes at once, so it ends by their deadline; if not, the event
        # loop is stuck: the run stops, naming the episodes still running and where each is.
        return run(rollout, timeout_s=rollout_deadline_s(cfg.episode_timeout_s), what=what)

    try:
        if step == 0 and cfg.eval_every:
            metrics = run_rollout(evaluate(*episode_args, dev_items), "the step-0 evaluation")
            logger.log(0, {f"eval/{k}": v for k, v in metrics.items()})
            print(f"step 0 dev: {metrics}")
        progress = tqdm(total=cfg.max_steps, initial=step, desc="GRPO (LangGraph agent)")
        while step < cfg.max_steps:
            t0 = time.time()
            for s in supervisors:
                s.check()
            # 1. rollout: group_size runs of the agent per question; a group with a failed run (server
            # error, past episode_timeout_s) is dropped and counted
            items = [item_at(data_position + i) for i in range(cfg.batch_size)]
            groups, failed_groups = run_rollout(rollout_groups(*episode_args, items, cfg.temperature, cfg.group_size),
                                                f"step {step + 1}'s rollout")
            data_position += cfg.batch_size
            episodes = [e for g in groups for e in g]
            rewards = torch.tensor([e["reward"] for e in episodes], dtype=torch.float32)

            # 2. advantages per episode, over its group; every segment of an episode is a training
            # row with the episode's reward and advantage
            advantages = grpo_advantages(rewards, cfg.group_size, scale_by_std=cfg.scale_adv_by_std)
            equal = equal_reward_groups(rewards, cfg.group_size)
            keep = ~equal if cfg.drop_equal_groups else torch.ones_like(equal)
            rows = [(segment, r, a, i) for i, (e, r, a, k) in enumerate(zip(episodes, rewards, advantages, keep)) if k
                    for segment in e["segments"]]
            batch = concat_padded_tensors([s for s, _, _, _ in rows]) if rows else {}
            if rows:
                batch["rewards"] = torch.stack([r for _, r, _, _ in rows])
                batch["advantages"] = torch.stack([a for _, _, a, _ in rows])
            t_rollout = time.time() - t0

            # 3. proximal log-probs (the trainer's; `logprobs` stays the server's), then 4. the update
            t1 = time.time()
            mismatch, stats = {}, {}
            if rows:
                batch["proximal_logprobs"] = actor.compute_logprobs(batch)
                mismatch = logprob_mismatch(batch["proximal_logprobs"], batch["logprobs"], batch["loss_mask"],
                                            cfg.behav_imp_weight_cap or None)
                if (warning := mismatch_warning(mismatch)):
                    tqdm.write(warning)
            t_logp = time.time() - t1
            t2 = time.time()
            if rows:
                stats = actor.update(batch)
            t_update = time.time() - t2

            # 5. weight sync: pause generation, push the new weights, continue; bump the version
            t3 = time.time()
            version += 1
            run(client.pause_generation())
            weight_sync.sync(version)
            run(client.continue_generation(version))
            t_sync = time.time() - t3
            step += 1

            # 6. log
            step_s = time.time() - t0
            metrics = {
                "rollout/reward": rewards.mean().item(),
                "rollout/model_calls": float(np.mean([e["num_model_calls"] for e in episodes])),
                "rollout/searches": float(np.mean([e["num_searches"] for e in episodes])),
                "rollout/tool_failures": int(sum(e["num_tool_failures"] for e in episodes)),
                "rollout/tool_call_parse_failures": int(sum(e["tool_call_parse_failures"] for e in episodes)),
                "rollout/answered": float(np.mean([e["finish_reason"] == "answer" for e in episodes])),
                "rollout/segments_per_episode": float(np.mean([len(e["segments"]) for e in episodes])),
                "rollout/gen_tokens": int(batch["loss_mask"].sum()) if rows else 0,
                "rollout/equal_reward_groups": int(equal.sum()) // cfg.group_size,
                "rollout/failed_groups": failed_groups,
                **{f"logprob/{k}": v for k, v in mismatch.items()},
                "perf/step_s": step_s, "perf/rollout_s": t_rollout, "perf/logp_s": t_logp,
                "perf/update_s": t_update, "perf/sync_s": t_sync,
                **{f"loss/{k}": v for k, v in stats.items()},
            }
            if cfg.eval_every and step % cfg.eval_every == 0:
                ev = run_rollout(evaluate(*episode_args, dev_items), f"step {step}'s evaluation")
                metrics.update({f"eval/{k}": v for k, v in ev.items()})
                tqdm.write(f"step {step} dev: {ev}")
            logger.log(step, metrics)
            progress.update(1)
            progress.set_postfix(reward=f"{metrics['rollout/reward']:.3f}", step_s=f"{step_s:.1f}")
            if cfg.trace_every and step % cfg.trace_every == 0:  # token by token, trainer log-probs included
                records, row_of = [], {id(segment): k for k, (segment, _, _, _) in enumerate(rows)}
                for i, e in enumerate(episodes[: cfg.trace_groups * cfg.group_size]):
                    for segment in e["segments"]:
                        row = row_of.get(id(segment))  # None: its group was dropped, never scored by the trainer
                        records.append(episode_record(
                            {**segment, "rewards": rewards[i:i + 1], "finish_reason": e["finish_reason"],
                             "question": e["question"], "gold": e["gold"], "answer": e["answer"],
                             "num_searches": e["num_searches"], "num_model_calls": e["num_model_calls"]},
                            tokenizer, step=step, group=i // cfg.group_size, index=i % cfg.group_size,
                            advantage=advantages[i].item(), context_role="tool", tool_failures=e["num_tool_failures"],
                            trainer_logprobs=batch["proximal_logprobs"][row] if row is not None else None))
                write_traces(trace_file, records)

            # 7. checkpoint
            if cfg.checkpoint_every and (step % cfg.checkpoint_every == 0 or step == cfg.max_steps):
                actor.save_checkpoint(os.path.join(ckpt_dir, "latest"), extra={
                    "step": step, "version": version, "data_position": data_position, "python_rng": random.getstate(),
                    "numpy_rng": np.random.get_state(), "torch_rng": torch.get_rng_state()})
        progress.close()

        test_metrics = run_rollout(evaluate(*episode_args, test_items), "the test evaluation")
        logger.log(step, {f"test/{k}": v for k, v in test_metrics.items()})
        print(f"test after {step} steps: {test_metrics}")
        actor.save_hf(os.path.join(cfg.run_dir, "final"))
        return test_metrics
    finally:
        trace_file.close()
        logger.close()
        try:
            weight_sync.close()
            run(http.close(), timeout_s=30)
            run(close_chat_http_client(), timeout_s=30)
            run(proxy.close(), timeout_s=30)
            run(client.close(), timeout_s=30)
        finally:
            bg.close()
            for s in supervisors:
                s.stop()


if __name__ == "__main__":
    fire.Fire(main)
