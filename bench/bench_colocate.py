"""Colocated trainer + SGLang on one GPU: weight sync by tensor handles vs through the disk, and
what sleeping the server (release/resume memory occupation) frees and costs.

    python bench/bench_colocate.py --model-path /tmp/q15 [--mem-fraction-static 0.5]

Starts SGLang on GPU 0 with `--enable-memory-saver`, builds the trainer's Actor (bf16 + fp32
master weights) on the same GPU, moves the trainer's weights away from the server's (noise), then:
tensor syncs (`lib.weight_sync.sync_weights_from_tensor`, timed, best and median of N), one disk sync,
greedy outputs before/after and the server/trainer log-prob gap on them; then release (all tags)
and resume (weights, then kv_cache + cuda_graph), timed, with the GPU's free memory after each.
"""
import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lib.actor import Actor  # noqa: E402
from lib.client import InferenceClient  # noqa: E402
from lib.launch import launch_sglang  # noqa: E402
from lib.weight_sync import sync_weights_from_disk, sync_weights_from_tensor  # noqa: E402

KIT_ARGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none"]
PROMPTS = [[5, 17, 42, 99, 7, 300, 12, 8], [11, 250, 3, 77, 1000, 64]]


def free_gb() -> float:
    return torch.cuda.mem_get_info(0)[0] / 1e9


async def greedy(client, n=16):
    return await asyncio.gather(*(client.generate(p, max_new_tokens=n, temperature=0.0,
                                                  extra_sampling_params={"ignore_eos": True}) for p in PROMPTS))


def gap(actor, gens) -> float:
    worst = 0.0
    for prompt, g in zip(PROMPTS, gens):
        ids = torch.tensor([prompt + g.output_ids])
        lp = actor.compute_logprobs({"input_ids": ids, "attention_mask": torch.ones_like(ids)})[0, len(prompt):]
        worst = max(worst, (lp - torch.tensor(g.logprobs)).abs().max().item())
    return worst


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--mem-fraction-static", type=float, default=0.5)
    p.add_argument("--syncs", type=int, default=5)
    p.add_argument("--cuda-graph", action="store_true", help="let SGLang capture CUDA graphs (slower start)")
    a = p.parse_args()
    rows = []
    free_start = free_gb()
    t0 = time.perf_counter()
    server = launch_sglang(a.model_path, base_gpu_id=0, mem_fraction_static=a.mem_fraction_static,
                           extra_args=KIT_ARGS + ["--enable-memory-saver"] + ([] if a.cuda_graph else ["--disable-cuda-graph"]),
                           log_path="/tmp/bench_colocate_sglang.log", timeout_s=600)
    print(f"SGLang up in {time.perf_counter() - t0:.0f} s; GPU free {free_start:.1f} -> {free_gb():.1f} GB", flush=True)
    client = InferenceClient([server.address], request_timeout_s=600)
    try:
        actor = Actor(a.model_path, dtype="bfloat16", device="cuda:0", compile_layers=False)
        n_params = sum(p.numel() for p in actor.model.parameters())
        rows.append(("GPU free with server + trainer resident", f"{free_gb():.1f} GB"))
        before = await greedy(client)
        torch.manual_seed(0)
        with torch.no_grad():
            for master in actor.master_model.parameters():
                master.add_(torch.randn_like(master) * 0.02)
        actor._copy_master_to_model()
        times = []
        for version in range(1, a.syncs + 1):
            torch.cuda.synchronize()
            times.append(await sync_weights_from_tensor(actor, client, version))
        after = await greedy(client)
        changed = [g.output_ids for g in after] != [g.output_ids for g in before]
        rows.append((f"tensor sync, {n_params / 1e9:.2f}B bf16 (best / median of {a.syncs}; first)",
                     f"{min(times) * 1e3:.0f} / {statistics.median(times) * 1e3:.0f} ms; {times[0] * 1e3:.0f} ms"))
        rows.append(("outputs changed by the sync / weight_version", f"{changed} / {after[0].weight_version}"))
        rows.append(("server vs trainer log-prob gap after tensor sync (max |Δ|)", f"{gap(actor, after):.3f}"))
        with tempfile.TemporaryDirectory() as tmp:
            disk_s = await sync_weights_from_disk(actor, client, os.path.join(tmp, "w"), a.syncs + 1)
        again = await greedy(client)
        rows.append(("disk sync (safetensors write + /update_weights_from_disk)", f"{disk_s * 1e3:.0f} ms"))
        rows.append(("disk sync gives the tensor sync's outputs", str([g.output_ids for g in again] == [g.output_ids for g in after])))

        # sleep: the trainer's activations would go where the server was
        torch.cuda.empty_cache()
        awake = free_gb()
        t = time.perf_counter()
        await client.release_memory_occupation()
        release_s = time.perf_counter() - t
        asleep = free_gb()
        t = time.perf_counter()
        await client.resume_memory_occupation(["weights"])
        resume_w_s = time.perf_counter() - t
        t = time.perf_counter()
        await sync_weights_from_tensor(actor, client, a.syncs + 2)
        sync_after_s = time.perf_counter() - t
        t = time.perf_counter()
        await client.resume_memory_occupation(["kv_cache", "cuda_graph"])
        resume_kv_s = time.perf_counter() - t
        woke = free_gb()
        final = await greedy(client)
        rows.append(("GPU free: awake / released / resumed", f"{awake:.1f} / {asleep:.1f} / {woke:.1f} GB"))
        rows.append(("release (all tags) / resume weights / tensor sync / resume kv_cache+cuda_graph",
                     f"{release_s * 1e3:.0f} / {resume_w_s * 1e3:.0f} / {sync_after_s * 1e3:.0f} / {resume_kv_s * 1e3:.0f} ms"))
        rows.append(("outputs after sleep + resume + sync equal those before the sleep",
                     str([g.output_ids for g in final] == [g.output_ids for g in again])))
        rows.append(("server vs trainer log-prob gap after sleep (max |Δ|)", f"{gap(actor, final):.3f}"))
    finally:
        await client.close()
        server.terminate()
    print(f"| {torch.cuda.get_device_name(0)}, mem_fraction_static {a.mem_fraction_static} | |")
    print("| --- | ---: |")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    asyncio.run(main())
