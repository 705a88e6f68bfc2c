"""Weight sync trainer -> inference server, by NCCL broadcast and by disk, with an agreement check.

    NCCL_CUMEM_ENABLE=0 python bench/bench_nccl_sync.py --model-path /tmp/q15 --server sglang

The trainer (lib/actor.py, GPU 0) perturbs its weights, pushes them with lib/weight_sync.py's
DistributedWeightSync (per-tensor and flattened buckets) and sync_weights_from_disk, and checks
that the server's greedy output changed and that its log-probs on it match the trainer's.
Prints a markdown table.
"""
import argparse
import asyncio
import os
import tempfile
import time

import torch

from lib.actor import Actor
from lib.client import InferenceClient
from lib.launch import free_port, launch_cpu_server, launch_sglang
from lib.weight_sync import DistributedWeightSync, sync_weights_from_disk

KIT_ARGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none"]


async def probe(client, prompt):
    gen = await client.generate(prompt, max_new_tokens=16, temperature=0.0, extra_sampling_params={"ignore_eos": True})
    return gen.output_ids, gen.logprobs


def trainer_logprobs(actor, prompt, output_ids):
    ids = torch.tensor([prompt + output_ids])
    lp = actor.compute_logprobs({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return lp[0, len(prompt):].tolist()


async def main(a):
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    if a.server == "sglang":
        server = launch_sglang(a.model_path, base_gpu_id=1, mem_fraction_static=0.5, dtype="bfloat16",
                               extra_args=KIT_ARGS, log_path="/tmp/sglang_sync.log")
    else:
        server = launch_cpu_server(a.model_path, device="cuda", dtype="bfloat16", log_path="/tmp/cpu_sync.log")
    rows = []
    try:
        client = InferenceClient([server.address])
        actor = Actor(a.model_path, dtype="bfloat16", device="cuda:0")
        n_bytes = sum(p.numel() * 2 for p in actor.model.parameters())
        prompt = list(range(5, 37))
        before, _ = await probe(client, prompt)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in actor.model.parameters():
                p.add_(torch.randn_like(p) * a.noise)
        sync = DistributedWeightSync(client, master_port=free_port(), world_size=2, rank_offsets=[1], backend="nccl")
        t0 = time.perf_counter()
        await sync.init()
        rows.append(("nccl init group", time.perf_counter() - t0, ""))
        version = 0
        for flattened in (False, True):
            for rep in range(a.repeats):
                version += 1
                torch.cuda.synchronize()
                t = await sync.update(actor.named_full_parameters(torch.bfloat16), version, bucket_mb=a.bucket_mb,
                                      flattened=flattened)
                rows.append((f"nccl {'flattened' if flattened else 'per-tensor'} update {rep}", t, ""))
        after, server_lp = await probe(client, prompt)
        mine = trainer_logprobs(actor, prompt, after)
        diff = max(abs(x - y) for x, y in zip(mine, server_lp))
        rows.append(("agreement after nccl", float("nan"),
                     f"greedy output changed: {after != before}; max |server - trainer| log-prob {diff:.3g}"))
        await sync.close()
        with tempfile.TemporaryDirectory(dir=a.tmp_dir) as d:
            for rep in range(2):
                version += 1
                t = await sync_weights_from_disk(actor, client, os.path.join(d, "w"), version)
                rows.append((f"disk (save_hf + /update_weights_from_disk) {rep}", t, ""))
        again, server_lp2 = await probe(client, prompt)
        rows.append(("agreement after disk", float("nan"), f"same output as after nccl: {again == after}"))
        await client.close()
    finally:
        server.terminate()
    print(f"\nmodel {a.model_path}: {n_bytes / 1e9:.2f} GB bf16, server {a.server}, bucket {a.bucket_mb} MB")
    print("| what | seconds | note |\n| --- | ---: | --- |")
    for what, s, note in rows:
        print(f"| {what} | {s:.3f} | {note} |")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--server", choices=["sglang", "cpu"], default="sglang")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=512)
    p.add_argument("--noise", type=float, default=0.02)
    p.add_argument("--tmp-dir", default="/tmp")
    asyncio.run(main(p.parse_args()))
