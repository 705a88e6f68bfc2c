"""Does the compiled trainer recompile from step to step? A small random Qwen2 (4 layers, hidden 512,
vocab 32k) in lib's GPU defaults (bf16 + fp32 master, varlen attention, compiled layers and head),
then `--steps` steps of log-probs + one update on batches of 64 rows whose lengths change every
step. Prints each step's times; run it under `TORCH_LOGS=recompiles` to see why dynamo recompiles.
On a CPU nothing is compiled (lib's default), so it only checks that the script runs.

    TORCH_LOGS=recompiles python bench/check_recompiles.py [--steps 10]
"""
import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lib.actor import Actor  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rows", type=int, default=64)
    args = p.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model_dir = tempfile.mkdtemp(prefix="check_recompiles_")
    Qwen2ForCausalLM(Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=2,
                                 max_position_embeddings=4096)).save_pretrained(model_dir)
    on_gpu = torch.cuda.is_available()
    actor = Actor(model_dir, lr=1e-5, dtype="bfloat16" if on_gpu else "float32", max_tokens_per_mb=4096)
    print(f"device {actor.device}, compiled layers: {actor.compile_layers}", flush=True)
    g = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        length = int(torch.randint(300, 700, (1,), generator=g))
        lens = torch.randint(100, length + 1, (args.rows,), generator=g)
        attention_mask = (torch.arange(length)[None] < lens[:, None]).long()
        loss_mask = attention_mask.clone()
        loss_mask[:, :50] = 0  # a 50-token prompt
        batch = {"input_ids": torch.randint(5, 30000, (args.rows, length), generator=g) * attention_mask,
                 "attention_mask": attention_mask, "loss_mask": loss_mask,
                 "logprobs": torch.zeros(args.rows, length), "advantages": torch.randn(args.rows, generator=g),
                 "rewards": torch.zeros(args.rows), "versions": torch.zeros(args.rows, length, dtype=torch.long)}
        t0 = time.perf_counter()
        batch["proximal_logprobs"] = actor.compute_logprobs(batch)
        t1 = time.perf_counter()
        actor.update(batch)
        t2 = time.perf_counter()
        print(f"step {step}: padded length {length}, longest {int(lens.max())}: "
              f"logp {t1 - t0:.2f} s, update {t2 - t1:.2f} s", flush=True)
    print("dynamo:", dict(torch._dynamo.utils.counters["stats"]))


if __name__ == "__main__":
    main()
