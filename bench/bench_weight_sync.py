"""Seconds per full weight update trainer -> inference server, by NCCL broadcast (per tensor and
flattened buckets) and by disk, with an agreement check on a fixed probe.

    NCCL_CUMEM_ENABLE=0 python bench/bench_weight_sync.py --model-path /tmp/q15     # SGLang on GPU 1
    python bench/bench_weight_sync.py --model-path M --address http://127.0.0.1:30000  # a running server
    python bench/bench_weight_sync.py --server cpu                                   # lib's CPU server, gloo

Trainer side: lib/actor.py's Actor on GPU 0 (fp32 master weights) and lib/weight_sync.py
(DistributedWeightSync over lib/process_group.py; no SGLang code in the trainer). Each timed update
includes the fp32 -> bf16 cast of every parameter (`Actor.named_full_parameters`), the HTTP call
and the broadcasts, and ends when the server has answered (its weights are loaded).

Agreement: the server decodes greedily `--probe-new-tokens` tokens after each of `--probe-prompts`
fixed prompts; the trainer computes the log-probs of those same tokens. Reported before any update
(server and trainer load the same checkpoint: the bf16 noise floor), after the NCCL updates of
perturbed weights, and after a disk update of the same weights.
"""
import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from lib.actor import Actor  # noqa: E402
from lib.client import InferenceClient  # noqa: E402
from lib.launch import free_port, launch_cpu_server, launch_sglang  # noqa: E402
from lib.weight_sync import DistributedWeightSync, sync_weights_from_disk  # noqa: E402

KIT_ARGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none"]


async def probe(client, prompts, n):
    gens = await asyncio.gather(*(client.generate(p, max_new_tokens=n, temperature=0.0,
                                                  extra_sampling_params={"ignore_eos": True}) for p in prompts))
    return [g.output_ids for g in gens], [g.logprobs for g in gens], gens[0].weight_version


def agreement(actor, prompts, outputs, server_lps) -> dict:
    seqs = [p + o for p, o in zip(prompts, outputs)]
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    lp = actor.compute_logprobs({"input_ids": ids, "attention_mask": mask})
    diffs = []
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        mine = lp[i, len(p):len(p) + len(o)].tolist()
        diffs += [abs(x - y) for x, y in zip(mine, server_lps[i])]
    return {"max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs), "tokens": len(diffs)}


async def main(a):
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    server = None
    t0 = time.perf_counter()
    if a.address:
        address = a.address
    elif a.server == "sglang":
        extra = KIT_ARGS + (["--disable-cuda-graph"] if a.disable_cuda_graph else [])
        server = launch_sglang(a.model_path, base_gpu_id=a.base_gpu_id, mem_fraction_static=a.mem_fraction_static,
                               dtype="bfloat16", random_seed=0, extra_args=extra, log_path="/tmp/bench_sync_sglang.log")
        address = server.address
    else:
        device = f"cuda:{a.base_gpu_id}" if cuda else "cpu"
        server = launch_cpu_server(a.model_path, device=device, dtype="bfloat16" if cuda else "float32",
                                   random_seed=0, log_path="/tmp/bench_sync_cpu.log")
        address = server.address
    start_s = time.perf_counter() - t0
    rows, report = [], {"model_path": a.model_path, "server": a.address or a.server, "server_start_s": start_s}
    try:
        client = InferenceClient([address], request_timeout_s=900)
        t0 = time.perf_counter()
        actor = Actor(a.model_path, dtype="bfloat16" if cuda else "float32", device="cuda:0" if cuda else "cpu")
        report["actor_load_s"] = time.perf_counter() - t0
        params = list(actor.model.parameters())
        report["num_tensors"] = len(params)
        report["bf16_bytes"] = sum(p.numel() * 2 for p in params)
        rng = random.Random(0)
        vocab = min(actor.model.config.vocab_size, a.high_id)
        prompts = [[rng.randrange(a.low_id, vocab) for _ in range(a.probe_prompt_len)] for _ in range(a.probe_prompts)]

        out0, lps0, _ = await probe(client, prompts, a.probe_new_tokens)
        report["agreement_before"] = agreement(actor, prompts, out0, lps0)
        print("agreement before any update (same checkpoint on both sides):", report["agreement_before"], flush=True)

        torch.manual_seed(0)
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn_like(p) * a.noise)

        sync = DistributedWeightSync(client, master_port=free_port(), world_size=2, rank_offsets=[1], backend=backend)
        t0 = time.perf_counter()
        await sync.init()
        rows.append({"path": "nccl init group" if cuda else "gloo init group", "runs_s": [time.perf_counter() - t0]})
        version = 0
        configs = [(False, mb) for mb in a.bucket_mb] + [(True, mb) for mb in a.bucket_mb]
        for flattened, bucket_mb in configs:
            times = []
            for _ in range(a.repeats):
                version += 1
                if cuda:
                    torch.cuda.synchronize()
                times.append(await sync.update(actor.named_full_parameters(torch.bfloat16), version,
                                               bucket_mb=bucket_mb, flattened=flattened))
            rows.append({"path": f"{backend} {'flattened' if flattened else 'per-tensor'}, bucket {bucket_mb:g} MB",
                         "runs_s": times})
            print(rows[-1], flush=True)
        out1, lps1, wv1 = await probe(client, prompts, a.probe_new_tokens)
        report["agreement_after_broadcast"] = {**agreement(actor, prompts, out1, lps1),
                                               "outputs_changed": out1 != out0, "weight_version": wv1,
                                               "expected_version": str(version)}
        print("agreement after broadcast:", report["agreement_after_broadcast"], flush=True)
        await sync.close()

        if a.disk_repeats:
            with tempfile.TemporaryDirectory(dir=a.tmp_dir) as d:
                times = []
                for _ in range(a.disk_repeats):
                    version += 1
                    times.append(await sync_weights_from_disk(actor, client, os.path.join(d, "w"), version))
                rows.append({"path": "disk: save_hf safetensors + /update_weights_from_disk", "runs_s": times})
                print(rows[-1], flush=True)
            out2, lps2, _ = await probe(client, prompts, a.probe_new_tokens)
            report["agreement_after_disk"] = {**agreement(actor, prompts, out2, lps2),
                                              "same_outputs_as_after_broadcast": out2 == out1}
            print("agreement after disk:", report["agreement_after_disk"], flush=True)
        await client.close()
    finally:
        if server is not None:
            server.terminate()
    report["rows"] = rows
    gb = report["bf16_bytes"] / 1e9
    print(f"\nmodel {a.model_path}: {gb:.2f} GB bf16, {report['num_tensors']} tensors; server {report['server']} "
          f"(start {start_s:.0f} s); trainer Actor load {report['actor_load_s']:.0f} s")
    print("| path | first s | steady s (median of the rest) | all runs s | steady GB/s |")
    print("| --- | ---: | ---: | --- | ---: |")
    for r in rows:
        runs = r["runs_s"]
        steady = statistics.median(runs[1:]) if len(runs) > 1 else float("nan")
        rate = f"{gb / steady:.1f}" if len(runs) > 1 and "init" not in r["path"] else ""
        print(f"| {r['path']} | {runs[0]:.3f} | {steady:.3f} | {', '.join(f'{t:.3f}' for t in runs)} | {rate} |")
    for key in ("agreement_before", "agreement_after_broadcast", "agreement_after_disk"):
        if key in report:
            print(f"{key}: {report[key]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--server", choices=["sglang", "cpu"], default="sglang")
    p.add_argument("--address", default=None, help="a running server (its workers must reach this host)")
    p.add_argument("--base-gpu-id", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=0.8)
    p.add_argument("--disable-cuda-graph", action="store_true", help="faster server start; sync cost is the same")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[512.0])
    p.add_argument("--disk-repeats", type=int, default=2)
    p.add_argument("--noise", type=float, default=0.02)
    p.add_argument("--probe-prompts", type=int, default=8)
    p.add_argument("--probe-prompt-len", type=int, default=32)
    p.add_argument("--probe-new-tokens", type=int, default=16)
    p.add_argument("--low-id", type=int, default=5)
    p.add_argument("--high-id", type=int, default=4000)
    p.add_argument("--tmp-dir", default="/tmp")
    p.add_argument("--json", default=None)
    asyncio.run(main(p.parse_args()))
