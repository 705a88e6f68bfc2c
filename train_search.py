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
import json
import os
import random
import re
import string
import time
import uuid
from collections import Counter
from dataclasses import dataclass

import aiohttp
import fire
import numpy as np
import torch
from tqdm import tqdm

from lib.async_rollout import gather_groups
from lib.chat_format import closing_ids, encode, encode_batch, render_text
from lib.deadlines import with_deadline
from lib.client import InferenceClient
from lib.config import load_config
from lib.run import (Run, RunConfig, checkpoint_due, close_run, finish_training, log_step, open_run, out_of_time,
                     rollout_step, save_checkpoint, start_training, sync_weights, train_step)
from lib.supervise import Supervisor
from lib.wiki_data import read_qa


@dataclass
class Config(RunConfig):  # the run's fields (servers, trainer, GRPO, async, logging) are lib/run.py's RunConfig
    # == the search task: data and retrieval ==
    run_dir: str = "runs/search"  # metrics.jsonl, traces.jsonl, evals/, checkpoints/, final/
    data_dir: str = ""  # dir with corpus.jsonl and {train,dev,test}.jsonl; "" = bundled synthetic data
    bundled_hops: str = ""  # bundled questions' hop counts, e.g. "2,3,4" (none answered by one search); "" = the mix, half 1-hop
    retrieval_addr: str = ""  # a running Search-R1/ASearcher-style server; "" = start lib/retrieval
    topk: int = 3  # documents per search
    tool_timeout_s: float = 30.0  # one retrieval call; past it the call is retried, then a tool failure
    tool_latency_s: float = 0.0  # sleep before each retrieval call: stands in for a slower search engine in benchmarks
    tool_retries: int = 3  # attempts before the episode gets a tool-failure message
    max_tool_failure_rate: float = 0.5  # stop the run when more tool calls than this fail over tool_failure_window steps; 1 = never
    tool_failure_window: int = 5  # steps
    max_info_chars: int = 3000  # cap of one <information> block
    # == the search task: episode ==
    max_steps: int = 200  # GRPO steps
    max_turns: int = 32  # model turns per episode
    reward: str = "f1"  # "f1" (ASearcher) or "em" (exact match, Search-R1)
    max_tokens: int = 2048  # context budget of one episode: prompt + all turns + tool output
    max_new_tokens_per_turn: int = 128  # tokens per generation request; a turn cut by it goes on (same turn) while the budget lasts
    prompt: str = "full"  # "full" (ASearcher-style instructions) or "short" (the question only)
    use_tool: bool = True  # False: the no-tool baseline (answer from memory: no search in the prompt, the demonstrations or the episode)
    # One episode's deadline, from its start: up to 32 turns, each a re-sent context and a search. On 2
    # busy CPU cores, with every episode at the embedded default's 1,024-token budget (the untrained
    # model), one step's 32 episodes took 167 s and the test evaluation's 300 at once 1,243 s (the
    # warm-started model evaluates them in ~40 s). Raise it for big evaluations on a slow server.
    episode_timeout_s: float = 1800.0
    # == the search task: warm start stages (lib/warm_start.py) ==
    warm_start_worlds: int = 1  # counterfactual worlds (the training world's names, other facts) for demonstrations
    warm_start_corpus_lm: bool = False  # also train on the corpus as plain text ("pretraining")
    warm_start_direct_steps: int = 0  # then SFT steps on demonstrations of which a fraction answer without searching
    warm_start_direct_frac: float = 0.6  # ... that fraction: they answer from their own world's facts, which are stale here
    warm_start_direct_lr: float = 5e-4  # stage 2's learning rate


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


def prompt_text(tokenizer, question: str, apply_chat_template: bool, template: str = PROMPT_TEMPLATE) -> str:
    text = template.format(question=question)
    if apply_chat_template and tokenizer.chat_template:
        return render_text(tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True)
    return text


def build_prompt_ids(tokenizer, question: str, apply_chat_template: bool, template: str = PROMPT_TEMPLATE) -> list[int]:
    return encode(tokenizer, prompt_text(tokenizer, question, apply_chat_template, template))


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
    stop_ids = cfg.stop_token_ids or [tokenizer.eos_token_id]
    try:
        for _ in range(cfg.max_turns):
            budget = cfg.max_tokens - len(input_ids)
            if budget <= 0:
                finish = "max_tokens"
                break
            gen = await client.generate(
                input_ids, max_new_tokens=budget, piece_tokens=cfg.max_new_tokens_per_turn, temperature=temperature,
                stop=STOP_STRINGS if cfg.use_tool else ["</answer>"],
                stop_token_ids=stop_ids, trajectory_id=trajectory_id)
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
            closing = closing_ids(tokenizer, gen.output_ids, stop_ids)  # a call that ended at <|endoftext|>, say
            input_ids += closing
            loss_mask += [0] * len(closing)
            logprobs += [0.0] * len(closing)
            versions += [-1] * len(closing)
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
        "top_answer_share": top_answer_share(episodes),
    }


def top_answer_share(episodes: list[dict]) -> float:
    """The share of the questions answered with the single most common answer: a policy farming the F1
    reward with one phrase (`member of` scores 0.4 against the gold alias `City of Zelga`) answers many
    different questions alike, which the reward alone hides (gemma-3-270m, docs/benchmarks.md)."""
    answers = collections.Counter(normalize_answer(e["answer"]) for e in episodes if e["answer"])
    return answers.most_common(1)[0][1] / len(episodes) if answers else 0.0


def episode_metrics(episodes: list[dict]) -> dict:
    """The task's metrics of a training rollout (logged under rollout/)."""
    return {"exact_match": float(np.mean([e["exact_match"] for e in episodes])),
            "tool_calls": float(np.mean([e["num_tool_calls"] for e in episodes])),
            "tool_failures": sum(e["num_tool_failures"] for e in episodes),
            "answered": float(np.mean([e["finish_reason"] == "answer" for e in episodes])),
            "answer_in_evidence": float(np.mean([e["answer_in_evidence"] for e in episodes]))}


def check_tool_failures(cfg: Config, recent_tool_calls: collections.deque, episodes: list[dict], retrieval_addr: str):
    """A tool that keeps failing would train the policy on failure messages: stop instead.
    `recent_tool_calls`: (calls, failures) per step, over the last tool_failure_window steps."""
    recent_tool_calls.append((sum(e["num_tool_calls"] for e in episodes), sum(e["num_tool_failures"] for e in episodes)))
    calls, failures = map(sum, zip(*recent_tool_calls))
    full_window = len(recent_tool_calls) == cfg.tool_failure_window and calls >= 10  # not on a few calls
    if full_window and failures > cfg.max_tool_failure_rate * calls:
        raise RuntimeError(
            f"{failures} of the last {calls} tool calls failed over {cfg.tool_failure_window} steps "
            f"(max_tool_failure_rate {cfg.max_tool_failure_rate}): check the retrieval server at "
            f"{retrieval_addr} (retrieval*.log in {cfg.run_dir}), or raise max_tool_failure_rate")


# --- data ---
def bundled_data_dir(cfg: Config, seed: int = 0, names_seed: int | None = None) -> str:
    """The bundled encyclopedia (lib/wiki_data.py; a world of `seed`, the names of `names_seed`'s), its
    questions of `cfg.bundled_hops`: the training world and the warm start's worlds alike."""
    from lib.wiki_data import default_wiki_dir, parse_hops

    return default_wiki_dir(seed=seed, names_seed=names_seed, hops=parse_hops(cfg.bundled_hops))


# --- warm start ---

COPY_MIN_SHARE = 0.2  # of stage 1's checked demonstrations: 41-51% in builds that copy, 3-9% in ones that did not


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
    # Each demonstration as (text, trained) pieces after its prompt; every query searched and every piece
    # tokenized in one call for all demonstrations (the same results as one at a time, a third of the time).
    directs = [rng.random() < direct_frac for _ in items]
    queries = [query for item, direct in zip(items, directs) if not direct for query in item["hop_queries"]]
    results = iter(bm25_search(index, queries, cfg.topk) if queries else [])
    pieces = []
    for item, direct in zip(items, directs):
        turns = []
        for query in ([] if direct else item["hop_queries"]):
            turns.append((f"<think> I need to search {query}. </think>\n<search> {query} </search>", 1))
            turns.append((f"\n\n<information>{format_docs(next(results), cfg.max_info_chars)}</information>\n\n",
                          tool_mask))
        # a direct answer has its own words: the answer after "The answer is" is copied from results
        lead = "From memory:" if direct else "The answer is"
        turns.append((f"<think> {lead} {item['answer'][0]}. </think>\n<answer> {item['answer'][0]} </answer>", 1))
        pieces.append(turns)
    texts = [prompt_text(tokenizer, item["question"], cfg.apply_chat_template, prompt_template(cfg)) for item in items]
    token_ids = iter(encode_batch(tokenizer, texts + [text for turns in pieces for text, _ in turns]))
    prompts = [next(token_ids) for _ in items]
    examples = []
    for turns, ids, direct in zip(pieces, prompts, directs):
        mask, model_turns = [tool_mask] * len(ids), []
        for k, (_, trained) in enumerate(turns):
            piece_ids = next(token_ids) + (end_of_turn if k == len(turns) - 1 else [])  # the answer ends the turn
            if k % 2 == 0:  # the model's turns: searches, then the answer (tool results between them)
                model_turns.append((len(ids), len(ids) + len(piece_ids)))
            ids += piece_ids
            mask += [trained] * len(piece_ids)
        if len(ids) <= cfg.max_tokens:
            # model_turns: for the warm start's check of a searching demonstration (warm_started_model)
            examples.append({"input_ids": ids, "loss_mask": mask} | ({} if direct else {"model_turns": model_turns}))
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
    from lib.wiki_data import SPLITS

    examples = build_demonstrations(tokenizer, cfg, read_qa(os.path.join(data_dir, "warmstart.jsonl")),
                                    os.path.join(data_dir, "corpus.jsonl"), loss_on_tool_tokens, direct_frac, cfg.seed)
    for seed in range(1, cfg.warm_start_worlds + 1):
        world = bundled_data_dir(cfg, seed=seed, names_seed=0)
        items = [q for split in SPLITS for q in read_qa(os.path.join(world, f"{split}.jsonl"))]
        examples += build_demonstrations(tokenizer, cfg, items, os.path.join(world, "corpus.jsonl"),
                                         loss_on_tool_tokens, direct_frac, cfg.seed + seed)
    if cfg.warm_start_corpus_lm:
        examples += corpus_lm_examples(tokenizer, os.path.join(data_dir, "corpus.jsonl"))
    return examples


def warm_started_model(cfg: Config, base: str, data_dir: str, embedded: bool) -> str:
    """`base` after the SFT warm start (built once, cached under what it trains on), or `base` itself
    with warm_start_steps 0. The demonstrations come from `data_dir`'s warm-start split, else the
    bundled encyclopedia's. The no-tool baseline's demonstrations all answer from memory."""
    from lib.warm_start import reproduced, steps_and_lr, warm_start_stages

    if not os.path.exists(os.path.join(data_dir, "warmstart.jsonl")):
        data_dir = bundled_data_dir(cfg)
    steps, lr = steps_and_lr(cfg.warm_start_steps, cfg.warm_start_lr, embedded, embedded_steps=1200)

    searching = []  # stage 1's demonstrations (all of them search), for its check

    def examples(tokenizer, direct_frac=0.0):
        built = warm_start_examples(tokenizer, cfg, data_dir, direct_frac if cfg.use_tool else 1.0,
                                    loss_on_tool_tokens=embedded)
        if direct_frac == 0.0:
            searching[:] = built
        return built

    def copies(model_dir) -> bool:
        """Did stage 1 learn to copy: names from the question into queries, the answer out of the results?
        GRPO does not teach it (docs/benchmarks.md), and the embedded model learns it as a phase change that
        a build can miss (a missed build: test EM 0.003). A build that copies reproduces 41-51% of the
        sampled demonstrations' turns, a missed one 3-9%; a missed one trains on. The embedded model's default
        recipe only: 2 s on 2 cores (SmolLM2: 2 minutes; a light warm start of a pretrained model is meant
        to copy little anyway, RL teaches the rest; a recipe of your own steps is yours to judge)."""
        right, n = reproduced(model_dir, searching, "model_turns", seed=cfg.seed)
        print(f"warm start check: the model writes every turn of {right} of {n} searching demonstrations "
              f"token for token (teacher-forced)", flush=True)
        return right >= COPY_MIN_SHARE * n

    # stage 2 (warm_start_direct_steps): some demonstrations answer from memory, as a chat model does
    return warm_start_stages("search-warm-start", base, examples, steps=steps, lr=lr,
                             batch_size=cfg.warm_start_batch_size, seed=cfg.seed,
                             direct_steps=cfg.warm_start_direct_steps, direct_lr=cfg.warm_start_direct_lr,
                             direct_frac=cfg.warm_start_direct_frac,
                             what_direct="warm start, stage 2 of 2 (some answers without searching)",
                             stage1_ok=copies if embedded and cfg.use_tool and cfg.warm_start_steps is None
                             else None)


# --- the run: lib's plumbing with this task's pieces ---
def setup(cfg: Config) -> Run:
    """lib's run (ranks, model, servers, client, actor, weight sync, resume, logger), then this task's
    retrieval server (supervised: it holds no state, so it is restarted on its address when it dies),
    the session of its tool calls and its rollouts, bound to them."""
    from lib.retrieval import launch_retrieval_server

    if cfg.reward not in ("f1", "em"):
        raise ValueError(f"reward must be 'f1' or 'em', got {cfg.reward!r}")
    data_dir = cfg.data_dir or bundled_data_dir(cfg)
    splits = lambda: {split: read_qa(os.path.join(data_dir, f"{split}.jsonl")) for split in ("train", "dev", "test")}  # noqa: E731
    run = open_run(cfg, lambda base, embedded: warm_started_model(cfg, base, data_dir, embedded), splits)
    try:
        retrieval_addr = cfg.retrieval_addr.rstrip("/")
        if run.is_main and not retrieval_addr:
            t0 = time.time()
            run.say("retrieval server: indexing the corpus (BM25) and starting")
            corpus = os.path.join(data_dir, "corpus.jsonl")
            retrieval = launch_retrieval_server(corpus, log_path=os.path.join(cfg.run_dir, "retrieval.log"))
            retrieval_addr, port = retrieval.address, int(retrieval.address.rsplit(":", 1)[1])
            supervisor = Supervisor("retrieval server", retrieval, lambda: launch_retrieval_server(
                corpus, port=port, log_path=os.path.join(cfg.run_dir, f"retrieval.restart{supervisor.restarts + 1}.log")))
            run.supervisors.append(supervisor)
            run.say(f"retrieval server ready at {retrieval_addr}", t0)
        if run.is_main:
            async def new_session():  # aiohttp sessions belong to the loop they are made in
                return aiohttp.ClientSession()
            session = run.bg.run(new_session())
            run.closers.append(lambda: run.bg.run(session.close(), timeout_s=30))
            run.task["retrieval_addr"] = retrieval_addr
            run.rollout_group = lambda item, temperature, group_size: rollout_group(
                run.client, session, run.tokenizer, run.cfg, item, retrieval_addr, temperature, group_size)
            run.evaluate = lambda items: evaluate(run.client, session, run.tokenizer, run.cfg, items, retrieval_addr)
    except BaseException:
        close_run(run)
        raise
    return run


# --- main: the GRPO loop ---
def main(config: str | None = "configs/search_tiny.yaml", **overrides):
    cfg = load_config(Config, config, overrides)
    run = setup(cfg)
    cfg = run.cfg
    try:
        start_training(run)  # the step-0 evaluations and learnability probe; async mode's producer starts
        progress = tqdm(total=cfg.max_steps, initial=run.step, desc=f"GRPO ({cfg.mode})", disable=not run.is_main)
        train_start, stopping = time.time(), False
        recent_tool_calls = collections.deque(maxlen=cfg.tool_failure_window)
        while run.step < cfg.max_steps and not stopping:
            t0 = time.time()
            # 1. rollout, 2. advantages: the rows to train, on every rank
            batch, episodes, metrics = rollout_step(run, episode_metrics)
            if run.is_main:
                check_tool_failures(cfg, recent_tool_calls, episodes, run.task["retrieval_addr"])
            metrics["perf/rollout_s"] = time.time() - t0
            # 3. proximal log-probs, 4. PPO update: each rank on its share of the rows
            metrics.update(train_step(run, batch))
            # 5. weight sync and version bump, when anything was trained
            metrics.update(sync_weights(run, trained=bool(batch)))
            run.step += 1
            # 6. log: metrics, the dev evaluation every eval_every steps, traces
            metrics["perf/step_s"] = time.time() - t0
            log_step(run, metrics, episodes, batch, correct=lambda e: e["exact_match"],
                     tool_failures=lambda e: e["num_tool_failures"])
            progress.update(1)
            if run.is_main:
                progress.set_postfix(reward=f"{metrics['rollout/reward']:.3f}", dev_em=metrics.get("eval/exact_match", ""))
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
