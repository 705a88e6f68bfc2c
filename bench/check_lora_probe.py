"""Does SGLang's prompt log-prob answer move with a LoRA adapter as the trainer's does? A diagnostic for the
adapter probe (lib/weight_sync.py): SGLang with --enable-lora beside lib's LoRA actor on one GPU; the adapters
at their start (B = 0) and then moved by a scale S from it, saved in bf16 and fp32, each loaded under its own
name; per scale, the trainer's mean |move| of the probe's log-probs and each served copy's move and miss.

    python bench/check_lora_probe.py --model-path smollm2-135m-instruct [--rank 8]
"""
import argparse
import asyncio
import os
import tempfile

import torch

from lib.actor import Actor
from lib.client import InferenceClient
from lib.launch import launch_sglang
from lib.lora import DEFAULT_TARGET_MODULES, lora_modules
from lib.model_names import resolve_model_path
from lib.run import LORA_PROBE_TEXT

p = argparse.ArgumentParser()
p.add_argument("--model-path", default="smollm2-135m-instruct")
p.add_argument("--rank", type=int, default=8)
p.add_argument("--scales", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2, 3e-2])
p.add_argument("--gpu", type=int, default=0)
args = p.parse_args()
path = resolve_model_path(args.model_path)
targets = list(DEFAULT_TARGET_MODULES)
server = launch_sglang(path, base_gpu_id=args.gpu, mem_fraction_static=0.15, extra_args=[
    "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
    "--enable-lora", "--max-lora-rank", str(args.rank), "--lora-target-modules", *targets])
try:
    torch.manual_seed(0)
    actor = Actor(path, dtype="bfloat16", device=f"cuda:{args.gpu}", lora_rank=args.rank, lora_alpha=32.0,
                  lora_target_modules=targets)
    ids = actor.tokenizer(LORA_PROBE_TEXT)["input_ids"][:64]
    client = InferenceClient([server.address])
    tmp = tempfile.mkdtemp()

    async def served(name):
        await client.load_lora_adapter(name, os.path.join(tmp, name))
        return torch.tensor((await client.prompt_logprobs(ids, name))[0])

    async def main():
        base_none = torch.tensor((await client.prompt_logprobs(ids, None))[0])
        trainer0 = actor.probe_logprobs(ids)
        start = {}
        for dt in (torch.bfloat16, torch.float32):
            name = f"start-{str(dt)[6:]}"
            actor.save_adapter(os.path.join(tmp, name), dtype=dt)
            start[dt] = await served(name)
        print(f"B = 0: trainer vs server without adapter {(base_none - trainer0).abs().mean():.4f}; server with the "
              f"start adapter vs without: bf16 {(start[torch.bfloat16] - base_none).abs().mean():.4f}, fp32 "
              f"{(start[torch.float32] - base_none).abs().mean():.4f}")
        g = torch.Generator().manual_seed(1)
        direction = [torch.randn(m.lora_B["default"].weight.shape, generator=g) for _, m in lora_modules(actor.model)]
        print("| scale of B | trainer's move | server move bf16 | miss bf16 | server move fp32 | miss fp32 |")
        for k, scale in enumerate(args.scales):
            with torch.no_grad():
                for (_, m), d in zip(lora_modules(actor.model), direction):
                    m.lora_B["default"].weight.copy_(d.to(m.lora_B["default"].weight.device) * scale)
            move = actor.probe_logprobs(ids) - trainer0
            row = [f"{scale:g}", f"{move.abs().mean():.4f}"]
            for dt in (torch.bfloat16, torch.float32):
                name = f"v{k}-{str(dt)[6:]}"
                actor.save_adapter(os.path.join(tmp, name), dtype=dt)
                smove = await served(name) - start[dt]
                row += [f"{smove.abs().mean():.4f}", f"{(smove - move).abs().mean():.4f}"]
            print("| " + " | ".join(row) + " |", flush=True)
        await client.close()

    asyncio.run(main())
finally:
    server.terminate()
