"""Does the compiled trainer compile again from step to step, and on which shapes? lib's GPU defaults
(bf16 + fp32 master, varlen attention, compiled layers and head) on a random Qwen2 (a small one, or
`--model-path`), then steps of log-probs + one update, each on ONE packed micro-batch whose token
count N is chosen to probe a suspect: a new N mod 16 (Triton specialises kernel arguments divisible
by 16), a last log-prob chunk of one row (N - 1 = 1 mod 2048: size-1 dims are specialised), one
sequence only, a longer sequence than any before. Prints each step's times and dynamo's graph count;
run it under `TORCH_LOGS=recompiles` to see dynamo's reasons. On a CPU nothing is compiled (lib's
default), so it only checks that the script runs.

    TORCH_LOGS=recompiles python bench/check_recompiles.py [--model-path DIR] [--rows 24]
"""
import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lib.actor import Actor  # noqa: E402

# (label, N mod 16 wanted or None, extra): each step's micro-batch. The first two compile and warm up.
PROBES = [
    ("warm-up, N = 5 mod 16", 5, None),
    ("warm-up, N = 11 mod 16", 11, None),
    ("N = 3 mod 16 (seen kind)", 3, None),
    ("N = 0 mod 16 (first multiple of 16)", 0, None),
    ("N = 0 mod 16 again", 0, None),
    ("N = 8 mod 16", 8, None),
    ("last log-prob chunk of one row", None, "chunk1"),
    ("one sequence only", None, "one_seq"),
    ("a sequence longer than any before", None, "long"),
    ("N = 7 mod 16 (seen kind)", 7, None),
]


def lengths_for(rows: int, base: int, residue, extra, g) -> list[int]:
    lens = torch.randint(base // 2, base + 1, (rows,), generator=g).tolist()
    if extra == "one_seq":
        return [base]
    if extra == "long":
        lens[0] = 3 * base
    if extra == "chunk1":  # N - 1 = 1 mod 2048 (lib's logits_chunk_tokens): a last chunk of one row
        residue_2048 = 2
        lens[-1] += (residue_2048 - sum(lens)) % 2048
        return lens
    if residue is not None:
        lens[-1] += (residue - sum(lens)) % 16
    return lens


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: a random Qwen2, 4 layers, hidden 512")
    p.add_argument("--rows", type=int, default=24)
    p.add_argument("--base-len", type=int, default=600, help="rows are base/2 .. base tokens long")
    args = p.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model_dir = args.model_path
    if model_dir is None:
        model_dir = tempfile.mkdtemp(prefix="check_recompiles_")
        Qwen2ForCausalLM(Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                     num_attention_heads=8, num_key_value_heads=2,
                                     max_position_embeddings=8192)).save_pretrained(model_dir)
    on_gpu = torch.cuda.is_available()
    actor = Actor(model_dir, lr=1e-5, dtype="bfloat16" if on_gpu else "float32", max_tokens_per_mb=1 << 20)
    vocab = actor.model.config.vocab_size
    print(f"device {actor.device}, compiled layers: {actor.compile_layers}", flush=True)
    g = torch.Generator().manual_seed(1)
    counters = torch._dynamo.utils.counters
    for step, (label, residue, extra) in enumerate(PROBES):
        lens = torch.tensor(lengths_for(args.rows, args.base_len, residue, extra, g))
        length = int(lens.max())
        attention_mask = (torch.arange(length)[None] < lens[:, None]).long()
        loss_mask = attention_mask.clone()
        loss_mask[:, :50] = 0  # a 50-token prompt
        rows = len(lens)
        batch = {"input_ids": torch.randint(5, vocab - 1, (rows, length), generator=g) * attention_mask,
                 "attention_mask": attention_mask, "loss_mask": loss_mask,
                 "logprobs": torch.zeros(rows, length), "advantages": torch.randn(rows, generator=g),
                 "rewards": torch.zeros(rows), "versions": torch.zeros(rows, length, dtype=torch.long)}
        graphs = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        batch["proximal_logprobs"] = actor.compute_logprobs(batch)
        t1 = time.perf_counter()
        actor.update(batch)
        if on_gpu:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        n = int(lens.sum())
        print(f"step {step}: {label:38s} N {n:6d} (mod 16: {n % 16:2d}, mod 2048: {n % 2048:4d}), "
              f"{rows:2d} seqs, longest {length:5d}: logp {t1 - t0:6.2f} s, update {t2 - t1:6.2f} s, "
              f"new graphs {counters['stats']['unique_graphs'] - graphs}", flush=True)
    print("dynamo:", dict(counters["stats"]))


if __name__ == "__main__":
    main()
