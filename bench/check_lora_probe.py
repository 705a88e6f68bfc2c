"""The LoRA adapter test (`lib.weight_sync.ServerWeightSync.verify_adapters`) against a real SGLang server.

SGLang with --enable-lora beside lib's bf16 LoRA actor on one GPU. The test is run as a run runs it, and against
servers made to misbehave, to show it passes the one and stops the others:

- follows: adapter sync, adapters at their start (a fresh run), then adapters trained away from zero (a resume);
- ignores: the same server, asked with no adapter named (what a server that drops its adapters serves);
- doubles: the adapters' config written with twice their lora_alpha (a scale the trainer does not use);
- merged: merged full-weight sync by disk; then a server that answers every weight update and keeps its weights.

Then the diagnostic that set the test's bounds: B set to a random direction times a scale, SGLang asked under
each adapter: the trainer's mean |move| of the probe's log-probs, SGLang's move and its miss.

    python bench/check_lora_probe.py --model-path smollm2-135m-instruct [--rank 8]
"""
import argparse
import asyncio
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lib.actor import Actor
from lib.async_rollout import BackgroundLoop
from lib.client import InferenceClient
from lib.launch import launch_cpu_server, launch_sglang
from lib.lora import DEFAULT_TARGET_MODULES, lora_modules
from lib.model_names import resolve_model_path
from lib.run import LORA_PROBE_TEXT
from lib.weight_sync import ServerIgnoresAdapter, ServerWeightSync

p = argparse.ArgumentParser()
p.add_argument("--model-path", default="smollm2-135m-instruct")
p.add_argument("--rank", type=int, default=8)
p.add_argument("--scales", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2, 3e-2])
p.add_argument("--gpu", type=int, default=0)
p.add_argument("--cpu", action="store_true", help="lib's CPU server and an fp32 trainer instead (a dry run)")
args = p.parse_args()
path = resolve_model_path(args.model_path)
targets = list(DEFAULT_TARGET_MODULES)
if args.cpu:
    server = launch_cpu_server(path, num_threads=1)
else:
    server = launch_sglang(path, base_gpu_id=args.gpu, mem_fraction_static=0.15, extra_args=[
        "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
        "--enable-lora", "--max-lora-rank", str(args.rank), "--lora-target-modules", *targets])
bg = BackgroundLoop()
try:
    torch.manual_seed(0)
    actor = Actor(path, dtype="float32" if args.cpu else "bfloat16", device="cpu" if args.cpu else f"cuda:{args.gpu}",
                  lora_rank=args.rank, lora_alpha=32.0, lora_target_modules=targets)
    ids = actor.tokenizer(LORA_PROBE_TEXT)["input_ids"][:64]
    tmp = tempfile.mkdtemp()
    client = InferenceClient([server.address])

    def verify(case: str, sync: ServerWeightSync, version: int):
        try:
            m = sync.verify_adapters(version)
            print(f"| {case} | {m['lora/probe_base_gap']:.4f} | {m['lora/probe_test_move']:.4f} | "
                  f"{m['lora/probe_test_miss']:.4f} | passed |", flush=True)
        except ServerIgnoresAdapter as e:
            print(f"| {case} | | | | stopped: {str(e)[:220]} |", flush=True)

    def adapter_sync() -> ServerWeightSync:
        return ServerWeightSync("disk", actor, client, bg.run, num_servers=1, disk_dir=os.path.join(tmp, "a"),
                                probe_ids=ids)

    print("| case | servers' noise | test move | server's miss | verdict |\n| --- | --- | --- | --- | --- |")
    verify("follows, adapters at their start", adapter_sync(), 0)
    ask = client.prompt_logprobs

    async def ignoring(input_ids, lora_path=None):
        return await ask(input_ids, None)
    client.prompt_logprobs = ignoring
    verify("ignores, adapters at their start", adapter_sync(), 0)
    client.prompt_logprobs = ask

    def doubled(where, dtype):
        Actor.save_adapter(actor, where, dtype)
        config = os.path.join(where, "adapter_config.json")
        c = json.load(open(config))
        c["lora_alpha"] = 2 * c["lora_alpha"]
        json.dump(c, open(config, "w"))
    actor.save_adapter = doubled
    verify("doubles (lora_alpha x2 in its config)", adapter_sync(), 0)
    del actor.save_adapter

    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # adapters trained away from zero, as a resumed run's
        for _, m in lora_modules(actor.model):
            w = m.lora_B["default"].weight
            w.copy_(torch.randn(w.shape, generator=g).to(w) * 0.01)
    trained = adapter_sync()
    trained.sync(1)
    verify("follows, trained adapters (resumed)", trained, 1)
    client.prompt_logprobs = ignoring
    verify("ignores, trained adapters (resumed)", trained, 1)
    client.prompt_logprobs = ask

    client.set_lora_adapter(None)
    merged = ServerWeightSync("disk", actor, client, bg.run, num_servers=1, disk_dir=os.path.join(tmp, "m"),
                              lora_sync="merged", probe_ids=ids)
    merged.sync(1)
    verify("follows, merged sync (disk)", merged, 1)
    update = client.update_weights_from_disk

    async def kept(model_path, **kw):
        return [{"success": True}]
    client.update_weights_from_disk = kept
    verify("keeps its weights, merged sync (disk)", merged, 1)
    client.update_weights_from_disk = update
    bg.run(client.update_weights_from_disk(path))

    async def served(name):
        await client.load_lora_adapter(name, os.path.join(tmp, name))
        return torch.tensor((await client.prompt_logprobs(ids, name))[0])

    async def diagnostic():
        with torch.no_grad():
            for _, m in lora_modules(actor.model):
                m.lora_B["default"].weight.zero_()
        base_none = torch.tensor((await client.prompt_logprobs(ids, None))[0])
        trainer0 = actor.probe_logprobs(ids)
        actor.save_adapter(os.path.join(tmp, "start"), dtype=torch.bfloat16)
        start = await served("start")
        print(f"\nB = 0: trainer vs server without adapter {(base_none - trainer0).abs().mean():.4f}; server with the "
              f"start adapter vs without: {(start - base_none).abs().mean():.4f}")
        g = torch.Generator().manual_seed(1)
        direction = [torch.randn(m.lora_B["default"].weight.shape, generator=g) for _, m in lora_modules(actor.model)]
        print("| scale of B | trainer's move | server's move | server's miss |\n| --- | --- | --- | --- |")
        for k, scale in enumerate(args.scales):
            with torch.no_grad():
                for (_, m), d in zip(lora_modules(actor.model), direction):
                    m.lora_B["default"].weight.copy_(d.to(m.lora_B["default"].weight.device) * scale)
            move = actor.probe_logprobs(ids) - trainer0
            actor.save_adapter(os.path.join(tmp, f"v{k}"), dtype=torch.bfloat16)
            smove = await served(f"v{k}") - start
            print(f"| {scale:g} | {move.abs().mean():.4f} | {smove.abs().mean():.4f} | "
                  f"{(smove - move).abs().mean():.4f} |", flush=True)
        await client.close()
    bg.run(diagnostic())
finally:
    bg.close()
    server.terminate()
