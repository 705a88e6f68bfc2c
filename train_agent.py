"""Train your own agent with GRPO: copy this file and replace `run_agent`, the only task part.

`run_agent(base_url, api_key, item, temperature)` runs one episode of your agent against an
OpenAI-compatible server and returns its reward. Write it with any SDK or framework (the `openai`
SDK, LangChain/LangGraph, the OpenAI Agents SDK through the Responses API): the server is
lib/openai_proxy.py, which generates with the policy on the inference server and records every
token the model sampled. Each episode is one proxy session (lib/agent_episode.py); what it recorded
(one or more segments: one per unbroken conversation) is trained with the episode's GRPO advantage,
the replies the agent did not go on from left out and the episode counting once (docs/train_agent.md).

The default agent is a small math solver on the bundled arithmetic word problems, written with
the plain `openai` SDK: it answers, and after a wrong answer is told so and tries once more;
reward 1 for the gold number after `####` (0.9 at the second try).

    python train_agent.py                                 # embedded default: tiny model, CPU, no hub
    python train_agent.py --model_path Qwen/Qwen2.5-1.5B-Instruct --server sglang --trainer_dtype bfloat16

With SGLang, run_agent runs in worker processes of its own (--agent_workers; docs/train_agent.md).
The run's plumbing (servers, trainer, weight sync, checkpoints, sync or async GRPO, torchrun) is
lib/run.py's, as for every script. Reads top to bottom: config, your agent, the warm start of the
embedded model, data, set-up, main() with the GRPO loop. docs/train_agent.md: how to plug in other
frameworks, what is trained, the deadline and the sampling lock.
"""
import asyncio
import os
import random
import re
import sys
import time
from dataclasses import dataclass
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run from anywhere: lib/ is next door

import fire
import openai
from tqdm import tqdm

from lib.agent_episode import attach_agent, episode_metrics
from lib.agent_workers import num_workers
from lib.config import load_config
from lib.openai_proxy import sdk_aiohttp_client
from lib.run import (Run, RunConfig, checkpoint_due, close_run, finish_training, log_step, open_run, out_of_time,
                     rollout_step, save_checkpoint, start_training, sync_weights, train_step)


@dataclass
class Config(RunConfig):  # the run's fields (servers, trainer, GRPO, async, logging) are lib/run.py's RunConfig
    # == your agent ==
    run_dir: str = "runs/agent"  # metrics.jsonl, traces.jsonl, evals/, checkpoints/, final/
    max_steps: int = 200  # GRPO steps
    data_dir: str = ""  # dir with {train,dev,test}.jsonl, one item (a JSON object given to run_agent) a line; "" = bundled math problems
    max_tokens: int = 1024  # context budget of one episode's conversation (the proxy's): a request past it gets a 400
    max_new_tokens_per_turn: int = 128  # a model call's max_tokens when the agent sets none
    eval_temperature: float = 0.0  # evaluation sessions (not trained on): 0 = greedy; training ones sample at `temperature` only
    # One episode's deadline, from its start (which includes waiting for the server behind every other
    # episode started with it): past it the episode is cancelled and its group is dropped, counted in
    # rollout/failed_groups, instead of hanging the run; 0 = none. The default agent's longest wait is
    # the test evaluation's (500 episodes at once, 2 turns of 64 tokens): about 105 s on 2 busy CPU
    # cores. Raise it for long agents on a slow server.
    episode_timeout_s: float = 600.0
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
    # == warm start of the default agent (lib/warm_start.py) ==
    warm_start_reflect_frac: float = 0.3  # demonstrations that recover from a wrong first answer
    warm_start_direct_steps: int = 0  # then SFT steps on demonstrations of which a fraction give the final line only
    warm_start_direct_frac: float = 0.6  # ... that fraction ("#### N", no worked steps)
    warm_start_direct_lr: float = 5e-4  # stage 2's learning rate
    warm_start_problems: int = 20000  # distinct synthetic problems for the warm start (the train split changes with it)


# --- your agent: the only part to edit ---
# The default: a math solver written with the plain `openai` SDK (train_reflect.py's agent, written
# as an agent): it answers, and after a wrong answer is told so and tries once more.
PROMPT = "{question}\nSolve the problem step by step. Put the final answer after ####."
REFLECTION = "Your answer is either wrong or not parsable to the reference answer. Please try to answer it more accurately."
MAX_TURNS = 2  # model calls per episode
TURN_DISCOUNT = 0.9  # reward x TURN_DISCOUNT per extra call
# A number as GSM8K writes its answers: sign, digits with thousands commas, decimals. Bounded
# quantifiers on a bounded slice of the text: the reward never runs long on model output, and
# never evaluates it.
_NUMBER = re.compile(r"-?\d[\d,]{0,30}(?:\.\d{1,16})?")


def final_number(text: str) -> Fraction | None:
    """The number right after the last `####` (`#### 1,234`, `#### $-3.5`), exactly; None if none."""
    _, marker, tail = text.rpartition("####")
    match = _NUMBER.match(tail[:64].strip().lstrip("$").strip()) if marker else None
    return Fraction(match.group().replace(",", "")) if match else None


def math_reward(text: str, answer: str) -> float:
    """1 if the model's final number equals the gold one (`answer`'s after its last `####`), else 0."""
    pred, gold = final_number(text), final_number(answer)
    return float(pred is not None and pred == gold)


def start_agent(cfg: Config):
    """Called once before the first episode in every process that runs episodes (this one, and each
    worker process with cfg.agent_workers): set what run_agent reads besides its arguments (settings,
    a tool server's address) in module globals here. The default agent needs nothing."""


_openai_clients: dict = {}  # event loop -> AsyncOpenAI


def openai_client() -> openai.AsyncOpenAI:
    """One SDK client (one connection pool) per event loop, copied per episode with its URL and key:
    a new AsyncOpenAI costs ~40 ms (an SSL context), a copy ~0.04 ms. The SDK's aiohttp transport:
    its default httpx pool costs about twice the CPU per request (docs/openai_proxy.md)."""
    loop = asyncio.get_running_loop()
    if loop not in _openai_clients:
        _openai_clients[loop] = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="set-per-episode",
                                                   max_retries=0, http_client=sdk_aiohttp_client())
    return _openai_clients[loop]


async def run_agent(base_url: str, api_key: str, item: dict, temperature: float) -> float | None:
    """Run one episode of your agent against the OpenAI-compatible server at `base_url` with
    `api_key` (either alone identifies the episode: a client built once with a fixed key works with
    the URL), and return its reward, a finite number. Return None if the agent posted its reward
    itself (POST {"reward": x} to base_url minus its /v1, plus /agentrl/reward: docs/train_agent.md).

    `item` is one line of the data (here {"question", "answer"}). `temperature` is the trainer's
    during training (leave it out or send it: the proxy refuses any other sampling setting) and
    cfg.eval_temperature for evaluation. A 400 with code `context_length_exceeded` means the
    conversation outgrew cfg.max_tokens: end the episode and score what you have."""
    llm = openai_client().with_options(base_url=base_url, api_key=api_key)
    messages = [{"role": "user", "content": PROMPT.format(question=item["question"])}]
    for turn in range(MAX_TURNS):
        try:
            reply = await llm.chat.completions.create(model="policy", messages=messages, temperature=temperature)
        except openai.BadRequestError as e:
            if e.code != "context_length_exceeded":
                raise
            return 0.0
        text = reply.choices[0].message.content or ""
        if math_reward(text, item["answer"]):
            return TURN_DISCOUNT ** turn
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": REFLECTION}]
    return 0.0


async def close_agent():
    """Called once at the end of the run, on the rollout loop: close what run_agent keeps open."""
    for loop in [k for k in _openai_clients if k is asyncio.get_running_loop()]:
        await _openai_clients.pop(loop).close()
# --- end of your agent ---


# --- warm start: the default agent's conversations (a data set of yours: set warm_start_steps 0) ---
def build_demonstrations(tokenizer, cfg: Config, items: list[dict], direct_frac: float = 0.0) -> list[dict]:
    """The conversations the default agent should have, each message rendered as the proxy renders it
    (the chat template): the question; for some a wrong final line and the reflection; the worked
    solution (for a fraction `direct_frac`, its final line alone). The loss covers every token but the
    wrong answer: a model trained from scratch copies the question's numbers sooner when it also
    models the question (train_reflect.py measured it)."""
    rng = random.Random(cfg.seed)
    examples = []
    for item in items:
        gold = item["answer"].rsplit("####", 1)[-1].strip()
        turns = [{"role": "user", "content": PROMPT.format(question=item["question"])}]
        if rng.random() < cfg.warm_start_reflect_frac:
            turns += [{"role": "assistant", "content": f"#### {int(gold) + rng.choice([-2, -1, 1, 2])}"},
                      {"role": "user", "content": REFLECTION}]
        direct = direct_frac > 0 and rng.random() < direct_frac
        turns.append({"role": "assistant", "content": f"#### {gold}" if direct else item["answer"]})
        ids, mask, before = [], [], ""
        for k in range(len(turns)):  # each message's tokens: the rendering up to it minus the rendering before it
            upto = tokenizer.apply_chat_template(turns[:k + 1], tokenize=False)
            piece = tokenizer(upto[len(before):], add_special_tokens=False)["input_ids"]
            wrong = turns[k]["role"] == "assistant" and k < len(turns) - 1
            ids, mask, before = ids + piece, mask + [int(not wrong)] * len(piece), upto
        if len(ids) <= cfg.max_tokens:
            examples.append({"input_ids": ids, "loss_mask": mask})
    return examples


def warm_started_model(cfg: Config, base: str, embedded: bool) -> str:
    """`base` after the SFT warm start on the default agent's conversations over the bundled problems
    (built once, cached under what it trains on), or `base` itself with warm_start_steps 0 (the
    default for a pretrained model)."""
    from lib.math_data import default_math_dir, read_split
    from lib.warm_start import steps_and_lr, warm_start_stages

    items = read_split(default_math_dir(seed=0, num_warmstart=cfg.warm_start_problems), "warmstart")
    steps, lr = steps_and_lr(cfg.warm_start_steps, cfg.warm_start_lr, embedded, embedded_steps=1500)
    return warm_start_stages("agent-warm-start", base, lambda tokenizer, direct_frac=0.0: build_demonstrations(
        tokenizer, cfg, items, direct_frac), steps=steps, lr=lr, batch_size=cfg.warm_start_batch_size, seed=cfg.seed,
        direct_steps=cfg.warm_start_direct_steps, direct_lr=cfg.warm_start_direct_lr,
        direct_frac=cfg.warm_start_direct_frac, what_direct="warm start, stage 2 of 2 (some answers without worked steps)")


# --- data ---
def load_splits(cfg: Config) -> dict[str, list[dict]]:
    from lib.math_data import default_math_dir, read_split

    data_dir = cfg.data_dir or default_math_dir(seed=0, num_warmstart=cfg.warm_start_problems)
    missing = [s for s in ("train", "dev", "test") if not os.path.exists(os.path.join(data_dir, f"{s}.jsonl"))]
    if missing:
        raise FileNotFoundError(f"{data_dir} has no {', '.join(s + '.jsonl' for s in missing)}: data_dir needs "
                                "train.jsonl, dev.jsonl and test.jsonl, one JSON object (an item for run_agent) a line")
    splits = {split: read_split(data_dir, split) for split in ("train", "dev", "test")}
    if not splits["train"]:
        raise ValueError(f"{data_dir}/train.jsonl is empty: nothing to train on")
    return splits


# --- the run: lib's plumbing with your agent ---
def setup(cfg: Config) -> Run:
    """lib's run (ranks, model, servers, client, actor, weight sync, resume, logger), then the proxy
    your agent talks to and its rollouts (lib/agent_episode.py)."""
    num_workers(cfg.agent_workers, beside_cpu_server=cfg.server == "cpu")  # refuses a bad value before anything starts
    run = open_run(cfg, lambda base, embedded: warm_started_model(cfg, base, embedded), lambda: load_splits(cfg))
    try:
        if run.is_main:
            attach_agent(run, run_agent, start_agent, close_agent, start_args=(run.cfg,))
    except BaseException:
        close_run(run)
        raise
    return run


# --- main: the GRPO loop ---
def main(config: str | None = "configs/agent_tiny.yaml", **overrides):
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
            log_step(run, metrics, episodes, batch)
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
