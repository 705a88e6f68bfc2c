"""Server-trainer log-prob gap under a LoRA adapter, against the same gap on the base model: what the
probe of lib/weight_sync.py (`PROBE_TOLERANCE`) must tell apart from a server that ignores its adapter.

    python bench/check_lora_gap.py --device cuda                      # random Qwen2 model, bf16 and fp32
    python bench/check_lora_gap.py --device cuda --model-path /tmp/q15 --dtypes bfloat16

Trainer: lib/actor.py with `lora_rank` (peft, fp32 adapters over the frozen base in the given dtype),
its adapters set to random values (B ~ N(0, --b-std)). Server: lib/cpu_engine.py's Runner on the same
device and dtype, the adapter loaded from the trainer's PEFT directory (lib/lora_serving.py). Both give
the prompt log-probs of one fixed sequence; printed: mean and max |server - trainer| with the adapter
and without, and how far the adapter moved the trainer's log-probs from the base's (mean |lora - base|).
"""
import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lib.actor import Actor  # noqa: E402
from lib.cpu_engine import Request, Runner, SamplingParams  # noqa: E402
from lib.cpu_server import parse_args as server_args  # noqa: E402
from lib.lora import DEFAULT_TARGET_MODULES, lora_modules  # noqa: E402
from lib.lora_serving import read_adapter  # noqa: E402
from lib.tiny_model import build_tiny_model  # noqa: E402


def server_logprobs(runner: Runner, ids: list[int], adapter) -> torch.Tensor:
    req = Request(rid="probe", input_ids=ids, params=SamplingParams(max_new_tokens=1, top_k=1), return_logprob=True,
                  logprob_start_len=0, return_text_in_logprobs=False, max_new_tokens=1, created_s=0.0,
                  deadline_s=float("inf"), future=None, adapter=adapter)
    runner.step([req], do_decode=False)
    return torch.tensor([row[0] for row in req.input_logprobs[1:]])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="", help="an HF model directory; '' = a random Qwen2 model of 0.4B shape")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--b-std", type=float, default=0.003)
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()
    work = tempfile.mkdtemp()
    model = args.model_path or build_tiny_model(
        os.path.join(work, "model"), [f"w{i} x{i * 7} y {i % 13} z" for i in range(3000)], seed=0, vocab_size=2048,
        hidden_size=1536, num_hidden_layers=8, intermediate_size=4096, num_attention_heads=12, num_key_value_heads=2)
    ids = [(i * 37) % 2000 + 3 for i in range(args.tokens)]
    print("| dtype | gap with adapter (mean / max) | gap on base (mean / max) | adapter moved (mean) |")
    print("| --- | --- | --- | --- |")
    for dtype in args.dtypes.split(","):
        actor = Actor(model, dtype=dtype, device=args.device, lora_rank=args.rank, lora_alpha=32.0,
                      lora_target_modules=list(DEFAULT_TARGET_MODULES))
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _, module in lora_modules(actor.model):
                b = module.lora_B["default"].weight
                b.copy_((torch.randn(b.shape, generator=g) * args.b_std).to(b.device))
        actor.save_adapter(os.path.join(work, "adapter"))
        runner = Runner(server_args(["--model-path", model, "--device", args.device, "--dtype", dtype,
                                     "--context-length", str(args.tokens + 64)]))
        runner.adapters.load(read_adapter("probe", os.path.join(work, "adapter"), runner.model, 1 << 36))
        lora, base = server_logprobs(runner, ids, runner.adapters.loaded["probe"]), server_logprobs(runner, ids, None)
        t_lora, t_base = actor.probe_logprobs(ids), actor.probe_logprobs(ids, adapters=False)
        print(f"| {dtype} | {(lora - t_lora).abs().mean():.2e} / {(lora - t_lora).abs().max():.2e} | "
              f"{(base - t_base).abs().mean():.2e} / {(base - t_base).abs().max():.2e} | "
              f"{(t_lora - t_base).abs().mean():.3f} |", flush=True)
        del actor, runner
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
