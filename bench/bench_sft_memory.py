"""Peak memory and time of one SFT micro-batch (forward + backward) at a large vocabulary: the warm start's
two loss paths, `chunked_head` (`lib.warm_start.accumulate_gradients` past FULL_LOGITS_MAX_BYTES of logits:
the LM head in chunks, on the trained positions only) and `hf_full_logits` (HF's forward: full
[rows, length, vocab] fp32 logits, cross-entropy over every position; lib's path below that size).

A random model of the given shape (Qwen2 layout, `--hidden`, `--layers`, `--vocab`) and random rows; each
variant runs in a fresh process so that one's peak does not hide the other's. On a GPU the peak is
`torch.cuda.max_memory_allocated`; on a CPU the growth of the process's peak RSS over the model's load.

    python bench/bench_sft_memory.py --vocab 262144 --rows 4 --length 1024       # Gemma 3's vocabulary
"""
import json
import os
import resource
import subprocess
import sys
import time

import fire
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _one(variant: str, vocab: int, hidden: int, layers: int, rows: int, length: int, trained: float, device: str):
    from transformers import AutoModelForCausalLM, Qwen2Config

    import lib.warm_start as ws

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(4096, length),
                         tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, length), generator=gen)
    cut = int(length * (1 - trained))  # the last `trained` share of each row is trained (a prompt, then an answer)
    batch = [{"input_ids": r.tolist(), "loss_mask": [0] * cut + [1] * (length - cut)} for r in ids]
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (Linux reports KiB)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_gpu = torch.cuda.memory_allocated() / 2**30
    start = time.perf_counter()
    # lib's two paths, each forced whatever the size (lib takes the chunked head past 1 GiB of logits)
    ws.FULL_LOGITS_MAX_BYTES = 0 if variant == "chunked_head" else float("inf")
    loss = ws.accumulate_gradients(model, batch, 0, device, rows * length)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30 - base_gpu
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20 - base_rss
    print(json.dumps({"variant": variant, "peak_gib": peak, "seconds": time.perf_counter() - start, "loss": loss}))


def main(vocab: int = 262144, hidden: int = 256, layers: int = 2, rows: int = 4, length: int = 1024,
         trained: float = 0.4, device: str = "", one: str = ""):
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if one:
        return _one(one, vocab, hidden, layers, rows, length, trained, device)
    results = []
    for variant in ("hf_full_logits", "chunked_head"):
        out = subprocess.run([sys.executable, __file__, "--one", variant, "--vocab", str(vocab), "--hidden", str(hidden),
                              "--layers", str(layers), "--rows", str(rows), "--length", str(length),
                              "--trained", str(trained), "--device", device],
                             capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    where = torch.cuda.get_device_name(0) if device.startswith("cuda") else f"CPU, {os.cpu_count()} cores"
    print(f"\none SFT micro-batch: {rows} rows x {length} tokens ({trained:.0%} trained), vocab {vocab:,}, "
          f"hidden {hidden}, {layers} layers, fp32, {where}")
    print("| loss path | peak memory (GiB) | seconds | loss |")
    print("| --- | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['variant']} | {r['peak_gib']:.2f} | {r['seconds']:.2f} | {r['loss']:.4f} |")


if __name__ == "__main__":
    fire.Fire(main)
