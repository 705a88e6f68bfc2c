"""Overhead of the OpenAI-proxy path (an openai-SDK agent behind lib/openai_proxy.py) against the
token path, on train_reflect.py's episodes.

    python bench/bench_proxy.py                                   # embedded default, lib's CPU server
    python bench/bench_proxy.py --model-path M --server sglang    # a real model on SGLang (GPU)

Paths: `tokens` (train_reflect.arun_episode, token ids to the server), `openai` (the same agent on
the openai SDK, tests/reflect_openai_agent.py, on the trainer's event loop), `agent`
(train_agent.py's default agent, the same conversation, on the trainer's event loop) and
`agent_workers` (the same in `--agent-workers` processes, train_agent.py --agent_workers N:
only the proxy and the inference client stay on the trainer's loop).

Both paths run the same questions greedily (temperature 0), so they generate the same tokens
(tests/test_reflect.py proves the two paths build the same trajectory for the same sampled
tokens) and the difference in wall time is the proxy's cost: HTTP from the SDK to the proxy,
chat-template rendering, and the SDK itself. The paths alternate, `--rounds` times each, with the
server's prefix cache flushed before every round; the table gives the median.
"""
import argparse
import asyncio
import dataclasses
import gc
import os
import statistics
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the proxy tokenizes on the event loop; no thread pool beside the server
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import train_agent as ta  # noqa: E402
import train_reflect as tr  # noqa: E402
from lib import agent_episode  # noqa: E402
from lib.agent_workers import AgentWorkers  # noqa: E402
from lib.async_rollout import gather_groups  # noqa: E402
from lib.client import InferenceClient, model_eos_ids  # noqa: E402
from lib.config import load_config  # noqa: E402
from lib.launch import launch_cpu_server, launch_sglang  # noqa: E402
from lib.openai_proxy import OpenAIProxy  # noqa: E402
from lib.reward_pool import RewardPool  # noqa: E402
from lib.run import episode_rows  # noqa: E402
from tests.reflect_openai_agent import close_openai_clients, rollout_groups_openai  # noqa: E402
from lib.tiny_model import default_tiny_model_dir  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="", help="HF model dir; '' = the embedded reflect warm start")
    p.add_argument("--server", default="cpu", choices=["cpu", "sglang"])
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument("--server-threads", type=int, default=1)
    p.add_argument("--http-client", default="aiohttp", choices=["aiohttp", "httpx", "in_process"],
                   help="the openai SDK's HTTP transport (train_reflect's openai_http_client) on the `openai` path")
    p.add_argument("--paths", default="tokens,openai,agent,agent_workers",
                   help="which paths to time, comma-separated (tokens is the baseline and always runs)")
    p.add_argument("--agent-workers", type=int, default=8, help="processes of the agent_workers path")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave out the gc.freeze() that train_reflect.main runs after its setup")
    p.add_argument("--warm-start-steps", type=int, default=300,
                   help="SFT steps of the embedded model (reflect_tiny.yaml: 1500); 300 answer like it, in fewer minutes")
    p.add_argument("--warm-start-direct-steps", type=int, default=None,
                   help="stage-2 SFT steps (answers without worked steps: ~10 tokens); 0 = worked solutions (longer replies)")
    args = p.parse_args()
    paths = ["tokens"] + [x for x in args.paths.split(",") if x and x != "tokens"]
    unknown = set(paths) - {"tokens", "openai", "agent", "agent_workers"}
    if unknown:
        p.error(f"unknown paths {sorted(unknown)}")
    if ta.MAX_TURNS != args.max_turns and {"agent", "agent_workers"} & set(paths):
        p.error(f"train_agent.py's agent has {ta.MAX_TURNS} turns: --max-turns {ta.MAX_TURNS} for the agent paths")

    from transformers import AutoTokenizer

    cfg = load_config(tr.Config, "configs/reflect_tiny.yaml",
                         {"max_turns": args.max_turns, "warm_start_steps": args.warm_start_steps,
                          **({} if args.warm_start_direct_steps is None
                             else {"warm_start_direct_steps": args.warm_start_direct_steps})})
    model_path = args.model_path or tr.warm_started_model(cfg, default_tiny_model_dir(), embedded=True)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    cfg = dataclasses.replace(cfg, stop_token_ids=model_eos_ids(model_path, tokenizer))
    reflection_ids = tr.build_reflection_ids(tokenizer, cfg.apply_chat_template)
    items = tr.load_splits(cfg)["dev"][: args.questions]
    if args.server == "sglang":
        server = launch_sglang(model_path, base_gpu_id=0, extra_args=cfg.sglang_extra_args.split())
    else:
        server = launch_cpu_server(model_path, num_threads=args.server_threads)
    reward_pool = RewardPool(1, 5.0, preload=tr.reward_fn)

    async def bench():
        client = InferenceClient([server.address])
        proxy = OpenAIProxy(client, tokenizer, stop_token_ids=cfg.stop_token_ids, max_context_tokens=cfg.max_tokens,
                            default_max_tokens=cfg.max_new_tokens_per_turn)
        await proxy.start()
        agent_cfg = ta.Config(eval_temperature=0.0, episode_timeout_s=cfg.episode_timeout_s)
        workers = AgentWorkers(ta.run_agent, args.agent_workers, init=ta.start_agent, init_args=(agent_cfg,),
                               close=ta.close_agent) if "agent_workers" in paths else None
        if not args.no_gc_freeze:
            gc.freeze()  # as train_reflect.main does before its loop
        times = {path: [] for path in paths}
        cpu = {path: [] for path in paths}  # this process's CPU seconds: the agent, the SDK, the proxy, the client
        tokens = {}
        for path in paths * (args.rounds + 1):  # the first round of each warms up
            await client.flush_cache()
            t0, c0 = time.perf_counter(), time.process_time()
            if path == "openai":
                groups, failed = await rollout_groups_openai(proxy, reward_pool, cfg, items, 0.0, args.group_size,
                                                             args.http_client)
                rows = [row for g in groups for _, row in episode_rows(g)]
            elif path == "tokens":
                groups, failed = await tr.rollout_groups(client, tokenizer, reflection_ids, reward_pool, cfg, items, 0.0,
                                                         args.group_size)
                rows = [row for g in groups for _, row in episode_rows(g)]
            else:  # train=False: greedy, as the token path here
                agent = workers.run if path == "agent_workers" else ta.run_agent
                groups, failed = await gather_groups([agent_episode.rollout_group(
                    proxy, agent, item, 0.0, args.group_size, False, agent_cfg.episode_timeout_s) for item in items])
                rows = [s for g in groups for e in g for s in e["segments"]]
            elapsed = time.perf_counter() - t0
            assert failed == 0
            tokens[path] = sum(int(row["loss_mask"].sum()) for row in rows)
            times[path].append(elapsed)
            cpu[path].append(time.process_time() - c0)
        await close_openai_clients()
        await ta.close_agent()
        if workers is not None:
            await workers.close()
        await proxy.close()
        await client.close()
        return {k: v[1:] for k, v in times.items()}, {k: v[1:] for k, v in cpu.items()}, tokens

    try:
        times, cpu, tokens = asyncio.run(bench())
    finally:
        reward_pool.close()
        server.terminate()
    base = statistics.median(times["tokens"])
    episodes = args.questions * args.group_size
    print(f"\n{episodes} episodes ({args.questions} questions x {args.group_size}), max_turns {args.max_turns}, greedy; "
          f"median of {args.rounds} rounds, {args.server} server, openai path's SDK over {args.http_client}, "
          f"{args.agent_workers} agent workers, gc.freeze {'off' if args.no_gc_freeze else 'on'}, {os.cpu_count()} CPUs")
    print("| path | rollout s (median) | min | max | generated tokens | tokens/s | overhead vs tokens | trainer-process CPU s (median) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in paths:
        med = statistics.median(times[path])
        print(f"| {path} | {med:.3f} | {min(times[path]):.3f} | {max(times[path]):.3f} | {tokens[path]} | "
              f"{tokens[path] / med:.0f} | {100 * (med / base - 1):+.1f}% | {statistics.median(cpu[path]):.3f} |")
    if len(set(tokens.values())) > 1:
        print("note: the paths generated different token counts; greedy decoding should make them equal")


if __name__ == "__main__":
    main()
