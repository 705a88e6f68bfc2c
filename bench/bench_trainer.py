"""Trainer throughput and MFU of lib/actor.py's GRPO update (packed sequences, token-budget
micro-batches), on whatever device is present.

    python bench/bench_trainer.py --model-path /tmp/qwen2.5-1.5b-random --dtype bfloat16 \
        --num-seqs 64 --mean-len 1024 --max-tokens-per-mb 32768 [--gradient-checkpointing]
    torchrun --nproc-per-node 2 bench/bench_trainer.py ...       # FSDP2 over 2 GPUs

FLOPs counted: 6 * (non-embedding params + LM head) per token for the dense part, plus
6 * layers * hidden * len^2 per sequence for causal attention (QK^T and AV, forward 2x, backward 4x,
halved by the causal mask). Peak bf16 dense: H100/H200 SXM 989 TFLOP/s.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lib.actor import Actor  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--mean-len", type=int, default=1024)
    p.add_argument("--max-tokens-per-mb", type=int, default=32768)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--steps", type=int, default=4, help="timed updates; the best after the first is reported")
    p.add_argument("--padded", action="store_true", help="padded rows instead of packing (sdpa has no varlen)")
    p.add_argument("--attn", default=None, help="attn_implementation: default lib's varlen when packed; sdpa, eager")
    p.add_argument("--no-master-weights", action="store_true",
                   help="the old path: fp32 parameters under bf16 autocast instead of bf16 params + fp32 master")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="torch.compile each decoder layer (auto: lib's default, on for one GPU)")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one more update")
    a = p.parse_args()
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0

    actor = Actor(a.model_path, lr=1e-6, dtype=a.dtype, max_tokens_per_mb=a.max_tokens_per_mb,
                  gradient_checkpointing=a.gradient_checkpointing, total_steps=100,
                  packed=not a.padded, attn_implementation=a.attn, master_weights=not a.no_master_weights,
                  compile_layers={'auto': None, 'on': True, 'off': False}[a.compile])
    cfg = actor.model.config
    g = torch.Generator().manual_seed(rank)
    lengths = torch.randint(a.mean_len // 2, a.mean_len * 3 // 2 + 1, (a.num_seqs,), generator=g)
    T = int(lengths.max())
    input_ids = torch.randint(0, min(cfg.vocab_size, 4000), (a.num_seqs, T), generator=g)
    attention_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    loss_mask = attention_mask.clone()
    loss_mask[:, : a.mean_len // 4] = 0  # a prompt
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
             "advantages": torch.randn(a.num_seqs)}
    batch["logprobs"] = actor.compute_logprobs(batch).cpu()  # behaviour = current policy

    n_params = sum(p.numel() for p in actor.model.parameters())
    n_embed = cfg.vocab_size * cfg.hidden_size
    dense = n_params - (0 if cfg.tie_word_embeddings else n_embed)  # tied: the matrix works as LM head
    tokens = int(lengths.sum())
    flops = 6 * dense * tokens + 6 * cfg.num_hidden_layers * cfg.hidden_size * float((lengths.float() ** 2).sum())

    times = []
    for step in range(a.steps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.time()
        stats = actor.update(batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.time() - t0)
    t0 = time.time()
    actor.compute_logprobs(batch)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t_logp = time.time() - t0
    if a.profile and rank == 0:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            actor.update(batch)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    best = min(times[1:]) if len(times) > 1 else times[0]
    mem_gb = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else float("nan")
    if rank == 0:
        print(f"packed={not a.padded} attn={actor.model.config._attn_implementation} "
              f"params={next(actor.model.parameters()).dtype} master_weights={actor.master_model is not actor.model} "
              f"compile={a.compile} fused_adam={actor.optimizer.defaults.get('fused')} gradient_checkpointing={a.gradient_checkpointing} "
              f"max_tokens_per_mb={a.max_tokens_per_mb}")
        print(f"| model params | GPUs | seqs x mean len | tokens/step/GPU | update s | tokens/s/GPU | TFLOP/s/GPU | MFU | logp s | peak mem GB | micro-batches |")
        print(f"| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        tflops = flops / best / 1e12
        print(f"| {n_params / 1e9:.2f}B | {world} | {a.num_seqs} x {a.mean_len} | {tokens} | {best:.2f} | "
              f"{tokens / best:,.0f} | {tflops:.0f} | {tflops / a.peak_tflops:.1%} | {t_logp:.2f} | {mem_gb:.1f} | "
              f"{stats['num_micro_batches']} |")
        print("update times s:", [round(t, 3) for t in times], "loss", stats["loss"])
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
