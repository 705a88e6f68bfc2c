"""The optimizer step with its state in CPU memory (lib/offload_adamw.py) against the same step with
everything on the GPU, at the parameter shapes of Qwen2.5 releases (random values; no model is built).

    python bench/bench_offload.py [--archs qwen2.5-1.5b qwen2.5-3b] [--steps 5]

Per arch: the fused AdamW step with fp32 master weights, moments and gradients on the GPU (what
`Actor` does without `offload_optimizer`), then `offloaded_adamw_step` from page-locked buffers with
the copies on one stream (`overlap=False`) and with copies in and out overlapped (the default).
Times are medians of `--steps` after one warm-up step; "GB/s each way" = 12 bytes a parameter
(master + two moments) over the step time.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.make_random_model import ARCHS  # noqa: E402
from lib.offload_adamw import into_host_buffers, offloaded_adamw_step  # noqa: E402


def param_shapes(arch: str) -> list[torch.Size]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**ARCHS[arch]))
    return [p.shape for p in model.parameters()]


def timed(step, steps: int) -> float:
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", nargs="+", default=["qwen2.5-1.5b", "qwen2.5-3b"], choices=sorted(ARCHS))
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shapes | params | step on the GPU s | offloaded, one stream s | offloaded, overlapped s | "
          "GB/s each way (overlapped) | GPU memory the optimizer holds: in memory / offloaded, between steps GB | "
          "offloaded step's GPU peak above that GB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for arch in args.archs:
        shapes = param_shapes(arch)
        numel = sum(s.numel() for s in shapes)
        grads = [torch.randn(s, device=device).to(torch.bfloat16) for s in shapes]
        models = [torch.zeros(s, device=device, dtype=torch.bfloat16) for s in shapes]

        # everything on the GPU: fp32 masters, moments, gradients (cast up as Actor does)
        masters_gpu = [torch.randn(s, device=device) for s in shapes]
        in_memory = torch.optim.AdamW(masters_gpu, lr=1e-5, fused=True)

        def gpu_step():
            for m, g in zip(masters_gpu, grads):
                m.grad = g.float()
            in_memory.step()
            for m in masters_gpu:
                m.grad = None
        base = torch.cuda.memory_allocated()  # bf16 gradients and weights
        gpu_s = timed(gpu_step, args.steps)
        held_gpu = (torch.cuda.memory_allocated() - base) / 1e9 + 4 * numel / 1e9  # + the masters made before
        del in_memory, masters_gpu
        torch.cuda.empty_cache()

        masters = [torch.zeros(s, requires_grad=True) for s in shapes]  # trained: their moments are made too
        offloaded = torch.optim.AdamW(masters, lr=1e-5)
        buffers = into_host_buffers(offloaded)  # as Actor(offload_optimizer=True) holds them
        seq_s = timed(lambda: offloaded_adamw_step(offloaded, masters, grads, models, device=device, overlap=False),
                      args.steps)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ovl_s = timed(lambda: offloaded_adamw_step(offloaded, masters, grads, models, device=device), args.steps)
        peak = (torch.cuda.max_memory_allocated() - base) / 1e9
        held_off = (torch.cuda.memory_allocated() - base) / 1e9
        print(f"| {arch} | {numel / 1e9:.2f}B | {gpu_s:.3f} | {seq_s:.3f} | {ovl_s:.3f} | "
              f"{12 * numel / ovl_s / 1e9:.1f} | {held_gpu:.1f} / {held_off:.1f} | {peak:.1f} |")
        del offloaded, masters, buffers, grads, models
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
