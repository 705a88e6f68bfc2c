"""An agent written with any SDK as a GRPO episode: one proxy session (lib/openai_proxy.py) around the
agent's `run_agent`, in the trajectory format lib/run.py trains on.

A script with an agent (train_agent.py, examples/langgraph_search.py) writes `run_agent(base_url,
api_key, item, temperature)` and calls `attach_agent` after lib.run.open_run: the run's rollouts
and evaluations then go through the proxy, which generates with the policy and records every token
the model sampled. Each episode's `segments` (one per unbroken conversation) are its training rows,
each with the episode's reward and advantage (lib.run.episode_rows).

What a row is credited with (docs/train_agent.md, "What is trained"): by default only the replies
the agent went on from are trained (a reply it asked for again and the unused choices of an `n` > 1
request are cut out: lib.proxy_record.discarded_turns), and each of an episode's k rows weighs 1/k
in the per-sequence loss_aggs, so that an episode counts once whatever its number of segments. The
agent Config's `train_discarded_turns` and `segment_weight` ("segment": 1 a row) choose otherwise.
"""
import asyncio
import math

import numpy as np
import torch

from lib.agent_workers import AgentWorkers, num_workers
from lib.async_rollout import gather_groups
from lib.deadlines import with_deadline
from lib.openai_proxy import OpenAIProxy

# names the trainer logs or keeps itself (the session's counts, the episode's keys): an agent's stats may not take them
RESERVED_STATS = {"reward", "rewards", "item", "segments", "stats", "advantage", "advantages", "keep", "rows",
                  "episodes", "requests", "length_cut", "tool_calls", "tool_call_parse_failures",
                  "segments_per_episode", "episodes_without_segments", "trained_rows", "gen_tokens",
                  "equal_reward_groups", "failed_groups", "completion_tokens", "failed", "question", "gold",
                  "num_turns", "versions", "discarded_turns", "row_weight"}
# How an episode's k rows weigh in the per-sequence loss_aggs: "episode", 1/k each (the episode counts
# once, as a one-row episode does); "segment", 1 each (an episode of k segments counts k times).
SEGMENT_WEIGHTS = ("episode", "segment")


def check_segment_weight(segment_weight: str):
    if segment_weight not in SEGMENT_WEIGHTS:
        raise ValueError(f"segment_weight must be one of {SEGMENT_WEIGHTS}, got {segment_weight!r}")


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


async def arun_episode(proxy: OpenAIProxy, run_agent, item, temperature: float, train: bool, *,
                       train_discarded: bool = False, segment_weight: str = "episode") -> dict:
    """Run the agent once in a session of its own; returns the session's `segments` (training
    sequences, [1, T] tensors: docs/trajectory.md, each with its `row_weight`) and counts, the reward
    (`reward`, and `rewards [1]` for lib.run), the agent's `stats` (also as keys of their own, for the
    traces) and the item. A session whose generation failed raises (lib.openai_proxy.SessionFailed),
    which drops the group. `run_agent`: the agent, or AgentWorkers.run (the same in a worker process).
    `train_discarded`: also train the replies the agent did not go on from; `segment_weight`: one of
    SEGMENT_WEIGHTS."""
    check_segment_weight(segment_weight)
    key = proxy.new_session(train=train)  # evaluation sessions are not trained on and sample as they ask
    try:
        result = await run_agent(proxy.session_url(key), key, item, temperature)
    finally:
        episode = proxy.end_session(key, train_discarded=train_discarded)
    for segment in episode["segments"]:
        segment["row_weight"] = 1.0 / len(episode["segments"]) if segment_weight == "episode" else 1.0
    reward, stats = agent_result(result)
    if reward is None:
        reward = episode["reward"]
    if reward is None:
        raise ValueError("run_agent returned None and the episode posted no reward: return the reward, or POST "
                         "{\"reward\": x} to /agentrl/reward with the episode's key")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"run_agent must return a finite number (or None after posting one), got {reward!r}")
    fields = item if isinstance(item, dict) else {}
    segments = episode["segments"]
    # every sampled token's policy version, for the async producer's staleness bound
    versions = torch.cat([s["versions"] for s in segments], 1) if segments else torch.zeros(1, 0, dtype=torch.long)
    return {**episode, "versions": versions, "question": fields.get("question"), "gold": fields.get("answer"), "num_turns": episode["requests"],
            "finish_reason": "max_tokens" if episode["length_cut"] else "done", **stats,
            "reward": float(reward), "rewards": torch.tensor([float(reward)]), "stats": stats, "item": item}


def mean_stats(episodes: list[dict]) -> dict:
    """The agent's number and bool stats, each averaged over the episodes that report it."""
    names = dict.fromkeys(k for e in episodes for k, v in e["stats"].items() if not isinstance(v, str))
    return {k: float(np.mean([e["stats"][k] for e in episodes if k in e["stats"]])) for k in names}


async def rollout_group(proxy, run_agent, item, temperature: float, group_size: int, train: bool,
                        timeout_s: float, **credit) -> list[dict]:
    # Each episode under its deadline: one that runs past it is cancelled and fails the group.
    # `credit`: arun_episode's train_discarded and segment_weight.
    return list(await asyncio.gather(*[with_deadline(arun_episode(proxy, run_agent, item, temperature, train, **credit),
                                                     timeout_s, item) for _ in range(group_size)]))


async def evaluate(proxy, run_agent, items, temperature: float, timeout_s: float) -> tuple[list[dict], dict]:
    """One episode per item in sessions that are not trained on: (the episodes, their metrics)."""
    groups, failed = await gather_groups([rollout_group(proxy, run_agent, item, temperature, 1, False, timeout_s)
                                          for item in items])
    episodes = [g[0] for g in groups]
    return episodes, {
        "failed": failed,
        "reward": float(np.mean([e["reward"] for e in episodes])),
        "requests": float(np.mean([e["requests"] for e in episodes])),
        "completion_tokens": float(np.mean([e["completion_tokens"] for e in episodes])),
        **mean_stats(episodes),
    }


def episode_metrics(episodes: list[dict]) -> dict:
    """The rollout metrics of agents' episodes (logged under rollout/): the sessions' counts and the
    agent's own stats."""
    return {
        "requests": float(np.mean([e["requests"] for e in episodes])),
        "length_cut": float(np.mean([e["length_cut"] for e in episodes])),
        "tool_calls": float(np.mean([e["tool_calls"] for e in episodes])),
        "tool_call_parse_failures": int(sum(e["tool_call_parse_failures"] for e in episodes)),
        "segments_per_episode": float(np.mean([len(e["segments"]) for e in episodes])),
        "episodes_without_segments": sum(not e["segments"] for e in episodes),
        "trained_rows": sum(len(e["segments"]) for e in episodes if e["keep"].item()),
        # replies the agents did not go on from (asked for again, unused choices of n > 1): not trained
        # unless train_discarded_turns
        "discarded_turns": int(sum(e["discarded_turns"] for e in episodes)),
        **mean_stats(episodes),
    }


def attach_agent(run, run_agent, start_agent=None, close_agent=None, start_args: tuple = ()):
    """Give an open lib.run Run (rank 0) the proxy and the agent's rollouts: `start_agent(*start_args)`
    in this process and in each worker (cfg.agent_workers), `close_agent()` at the end; training
    sessions sample at cfg.temperature only (the proxy refuses another setting), evaluation ones at
    cfg.eval_temperature. What a training row is credited with: the agent Config's
    `train_discarded_turns` (default False) and `segment_weight` (default "episode"; SEGMENT_WEIGHTS)."""
    cfg = run.cfg
    credit = {"train_discarded": bool(getattr(cfg, "train_discarded_turns", False)),
              "segment_weight": getattr(cfg, "segment_weight", "episode")}
    check_segment_weight(credit["segment_weight"])  # before anything starts
    workers = num_workers(cfg.agent_workers, beside_cpu_server=cfg.server == "cpu")
    proxy = OpenAIProxy(run.client, run.tokenizer, stop_token_ids=cfg.stop_token_ids,
                        max_context_tokens=cfg.max_tokens, default_max_tokens=cfg.max_new_tokens_per_turn,
                        train_sampling={"temperature": cfg.temperature})
    run.bg.run(proxy.start())
    pool = None

    async def close():
        if pool is not None:
            await pool.close()
        elif close_agent is not None:
            await close_agent()
    run.closers.append(lambda: (run.bg.run(close(), timeout_s=60), run.bg.run(proxy.close(), timeout_s=30)))
    if start_agent is not None:
        start_agent(*start_args)
    if workers:  # run_agent in processes of its own, each with its own event loop
        pool = AgentWorkers(run_agent, workers, init=start_agent, init_args=start_args, close=close_agent)
    agent = pool.run if pool else run_agent
    run.rollout_group = lambda item, temperature, group_size: rollout_group(
        proxy, agent, item, temperature, group_size, True, run.cfg.episode_timeout_s, **credit)
    run.evaluate = lambda items: evaluate(proxy, agent, items, run.cfg.eval_temperature, run.cfg.episode_timeout_s)
