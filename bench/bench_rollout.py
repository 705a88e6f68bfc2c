"""Rollout throughput of lib/client.py (+ a trivial multi-turn workflow) against the inference
server's own throughput on the same requests.

    python bench/bench_rollout.py --model-path /tmp/q15                         # launches SGLang (GPU)
    python bench/bench_rollout.py --model-path M --address http://127.0.0.1:30000   # a running server
    python bench/bench_rollout.py --server cpu --num-prompts 8 --new-tokens 16  # lib's CPU server

Every mode generates the same tokens: `--num-prompts` random prompts of `--prompt-len` ids,
`--new-tokens` sampled tokens each (temperature 1, ignore_eos, log-probs returned):

- native batch: ONE `/generate` whose `input_ids` is the list of all prompts (the server schedules
  the whole batch itself; no per-request HTTP). This is "the server's own throughput".
- raw concurrent: one bare aiohttp POST per prompt, all at once (per-request HTTP, no lib code).
- client: `InferenceClient.generate` per prompt, all at once (what the trainer uses).
- raw / client multi-turn: each episode is `--turns` turns of new_tokens/turns tokens, with
  `--tool-tokens` fixed "tool output" ids appended after each turn (a trajectory of input_ids,
  loss_mask and log-probs is built, as a workflow does); raw = bare aiohttp, client = lib's client
  with a sticky trajectory_id.

Each repeat runs every mode once on fresh prompts, with the prefix cache flushed before each mode.
Overhead = 1 - (mode tokens/s) / (reference tokens/s), computed on the best run of each mode.
Generated tokens only are counted.
"""
import argparse
import asyncio
import json
import os
import random
import sys
import time

import aiohttp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from lib.client import InferenceClient  # noqa: E402
from lib.launch import launch_cpu_server, launch_sglang  # noqa: E402

KIT_ARGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none"]


def sampling(n):
    return {"max_new_tokens": n, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True}


async def post(http, address, body):
    async with http.post(address + "/generate", json=body) as r:
        text = await r.text()
        if r.status != 200:
            raise RuntimeError(f"/generate HTTP {r.status}: {text[:300]}")
        return json.loads(text)


async def native_batch(address, prompts, n, http, **_):
    answers = await post(http, address, {"input_ids": prompts, "sampling_params": sampling(n), "return_logprob": True})
    return sum(len(a["output_ids"]) for a in answers)


async def raw_concurrent(address, prompts, n, http, **_):
    answers = await asyncio.gather(*(post(http, address, {"input_ids": p, "sampling_params": sampling(n),
                                                           "return_logprob": True}) for p in prompts))
    return sum(len(a["output_ids"]) for a in answers)


async def client_concurrent(address, prompts, n, client, **_):
    gens = await asyncio.gather(*(client.generate(p, max_new_tokens=n, temperature=1.0,
                                                  extra_sampling_params={"ignore_eos": True}) for p in prompts))
    assert all(len(g.output_ids) == len(g.logprobs) == n for g in gens)
    return sum(len(g.output_ids) for g in gens)


def turn_lengths(n, turns):
    return [n // turns + (1 if i < n % turns else 0) for i in range(turns)]


async def raw_multi_turn(address, prompts, n, http, turns, tool, **_):
    async def episode(prompt):
        ids, generated = list(prompt), 0
        for i, k in enumerate(turn_lengths(n, turns)):
            a = await post(http, address, {"input_ids": ids, "sampling_params": sampling(k), "return_logprob": True})
            ids += a["output_ids"]
            generated += len(a["output_ids"])
            if i < turns - 1:
                ids += tool
        return generated
    return sum(await asyncio.gather(*(episode(p) for p in prompts)))


async def client_multi_turn(address, prompts, n, client, turns, tool, **_):
    async def episode(index, prompt):
        traj = {"input_ids": list(prompt), "loss_mask": [0] * len(prompt), "logprobs": [0.0] * len(prompt),
                "versions": [-1] * len(prompt)}
        tid = f"ep{index}-{random.random()}"
        try:
            for i, k in enumerate(turn_lengths(n, turns)):
                g = await client.generate(traj["input_ids"], max_new_tokens=k, temperature=1.0, trajectory_id=tid,
                                          extra_sampling_params={"ignore_eos": True})
                traj["input_ids"] += g.output_ids
                traj["loss_mask"] += [1] * len(g.output_ids)
                traj["logprobs"] += g.logprobs
                traj["versions"] += g.versions
                if i < turns - 1:  # the tool's answer: tokenized on its own, loss_mask 0
                    traj["input_ids"] += tool
                    traj["loss_mask"] += [0] * len(tool)
                    traj["logprobs"] += [0.0] * len(tool)
                    traj["versions"] += [-1] * len(tool)
        finally:
            client.end_trajectory(tid)
        return sum(traj["loss_mask"])
    return sum(await asyncio.gather(*(episode(i, p) for i, p in enumerate(prompts))))


MODES = {"native batch": native_batch, "raw concurrent": raw_concurrent, "client": client_concurrent,
         "raw multi-turn": raw_multi_turn, "client multi-turn": client_multi_turn}


async def run(a, address):
    rng = random.Random(a.seed)
    client = InferenceClient([address], max_concurrent_requests=max(a.num_prompts, 1), request_timeout_s=1800)
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=1800))
    tool = [rng.randrange(a.low_id, a.high_id) for _ in range(a.tool_tokens)]
    results = {m: [] for m in a.modes}
    try:
        # warm-up (kernels, CUDA graphs at this batch size, connections)
        warm = [[rng.randrange(a.low_id, a.high_id) for _ in range(a.prompt_len)] for _ in range(a.num_prompts)]
        await native_batch(address, warm, 8, http)
        await client_concurrent(address, warm, 8, client)
        for rep in range(a.repeats):
            prompts = [[rng.randrange(a.low_id, a.high_id) for _ in range(a.prompt_len)] for _ in range(a.num_prompts)]
            order = list(a.modes) if rep % 2 == 0 else list(reversed(a.modes))  # alternate, against drift
            for mode in order:
                await client.flush_cache()
                t0 = time.perf_counter()
                tokens = await MODES[mode](address, prompts, a.new_tokens, http=http, client=client, turns=a.turns,
                                           tool=tool)
                elapsed = time.perf_counter() - t0
                results[mode].append({"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed})
                print(f"rep {rep} {mode:18} {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:,.0f} tok/s", flush=True)
    finally:
        await http.close()
        await client.close()
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: the embedded tiny model")
    p.add_argument("--server", choices=["sglang", "cpu"], default="sglang")
    p.add_argument("--address", default=None, help="use a running server instead of launching one")
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--mem-fraction-static", type=float, default=0.8)
    p.add_argument("--device", default="cuda", help="cpu server: device")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--tool-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--low-id", type=int, default=100)
    p.add_argument("--high-id", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--json", default=None, help="write the raw results here")
    a = p.parse_args()
    a.modes = [m.strip() for m in a.modes.split(",")]
    if a.model_path is None:
        from lib.tiny_model import default_tiny_model_dir

        a.model_path = default_tiny_model_dir()
    server = None
    t0 = time.perf_counter()
    if a.address:
        address = a.address
    elif a.server == "sglang":
        server = launch_sglang(a.model_path, base_gpu_id=a.base_gpu_id, mem_fraction_static=a.mem_fraction_static,
                               dtype="bfloat16", random_seed=0, extra_args=KIT_ARGS, log_path="/tmp/bench_rollout_sglang.log")
        address = server.address
    else:
        import torch

        device = a.device if torch.cuda.is_available() else "cpu"
        server = launch_cpu_server(a.model_path, device=device, max_running_requests=max(a.num_prompts, 1),
                                   random_seed=0, dtype="bfloat16" if device != "cpu" else "float32",
                                   log_path="/tmp/bench_rollout_cpu.log")
        address = server.address
    start_s = time.perf_counter() - t0
    try:
        results = asyncio.run(run(a, address))
    finally:
        if server is not None:
            server.terminate()
    best = {m: max(r["tokens_per_s"] for r in rs) for m, rs in results.items() if rs}
    ref = best.get("native batch")
    print(f"\nmodel {a.model_path}, server {a.address or a.server} (start {start_s:.0f} s), {a.num_prompts} prompts x "
          f"{a.prompt_len} ids, {a.new_tokens} new tokens (ignore_eos, T=1, log-probs), multi-turn {a.turns} turns + "
          f"{a.tool_tokens} tool ids, best of {a.repeats}")
    print("| mode | tokens/s (best) | all runs tok/s | vs native batch | vs raw of the same shape |")
    print("| --- | ---: | --- | ---: | ---: |")
    pairs = {"client": "raw concurrent", "client multi-turn": "raw multi-turn"}
    for m in a.modes:
        if m not in best:
            continue
        runs = ", ".join(f"{r['tokens_per_s']:,.0f}" for r in results[m])
        vs_native = f"{1 - best[m] / ref:+.1%} overhead" if ref and m != "native batch" else "reference"
        raw = pairs.get(m)
        vs_raw = f"{1 - best[m] / best[raw]:+.1%} overhead" if raw in best else ""
        print(f"| {m} | {best[m]:,.0f} | {runs} | {vs_native} | {vs_raw} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "server_start_s": start_s, "results": results, "best": best}, f, indent=1)


if __name__ == "__main__":
    main()
