"""Time of an SFT warm-start step of the embedded tiny model on this machine, in variants.

The quick start's wait before its first GRPO step is mostly the tiny model's warm start (the search
agent: 1,200 + 200 SFT steps of batch 8; the math agent: 1,500 + 150 of batch 16). This times
`lib.warm_start.accumulate_gradients` + the optimizer step on the task's real demonstrations and
prints a table (median ms a step after warm-up, padded and real tokens a step, speed-up):

    python bench/bench_warm_start.py --task search        # or --task reflect

Variants, NAME or NAME_TOKENS (micro-batches of at most TOKENS padded tokens, default 2048):
`unsorted` (rows micro-batched in the order drawn: the step before 2026-11-28), `sorted` (grouped
by length first: less padding; lib's step, at 1,024 tokens on a CPU), `bf16` (sorted, under CPU
bfloat16 autocast: faster where the CPU has native bf16, but it cost the tiny model its copying,
docs/benchmarks.md, so lib does not use it).
"""
import os
import random
import statistics
import sys
import time

import fire
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _examples(task: str, tokenizer) -> tuple[list[dict], int]:
    from lib.config import load_config
    if task == "search":
        import train_search
        from lib.wiki_data import default_wiki_dir
        cfg = load_config(train_search.Config, "configs/search_tiny.yaml", {})
        return (train_search.warm_start_examples(tokenizer, cfg, default_wiki_dir(seed=0), 0.0, loss_on_tool_tokens=True),
                cfg.warm_start_batch_size)
    import train_reflect
    from lib.math_data import default_math_dir, read_split
    cfg = load_config(train_reflect.Config, "configs/reflect_tiny.yaml", {})
    items = read_split(default_math_dir(seed=0, num_warmstart=cfg.warm_start_problems), "warmstart")
    reflection_ids = train_reflect.build_reflection_ids(tokenizer, cfg.apply_chat_template)
    return train_reflect.build_demonstrations(tokenizer, cfg, items, reflection_ids), cfg.warm_start_batch_size


def main(task: str = "search", steps: int = 12, warmup: int = 3,
         variants: str = "unsorted_2048,sorted_2048,sorted_1024,bf16_1024",
         seed: int = 0):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lib.tiny_model import default_tiny_model_dir
    from lib.warm_start import _micro_batches, accumulate_gradients

    base = default_tiny_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(base)
    examples, batch_size = _examples(task, tokenizer)
    print(f"{task}: {len(examples)} demonstrations, batch {batch_size}, {torch.get_num_threads()} threads", flush=True)
    rows = []
    for name in (variants.split(",") if isinstance(variants, str) else variants):
        torch.manual_seed(seed)
        rng = random.Random(seed)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        kind, _, budget = name.partition("_")
        budget, sort = int(budget or 2048), kind != "unsorted"
        times, padded, real = [], 0, 0
        for i in range(warmup + steps):
            batch = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "bf16"):
                loss = accumulate_gradients(model, batch, tokenizer.pad_token_id or 0, "cpu", budget, group_by_length=sort)
            optimizer.step()
            if i >= warmup:
                times.append(time.perf_counter() - start)
                groups = _micro_batches(sorted(batch, key=lambda ex: len(ex["input_ids"])) if sort else batch, budget)
                padded += sum(len(g) * max(len(ex["input_ids"]) for ex in g) for g in groups)
                real += sum(len(ex["input_ids"]) for ex in batch)
        rows.append((name, statistics.median(times), padded / steps, real / steps, loss))
        print(f"  {name}: {statistics.median(times) * 1000:.0f} ms a step", flush=True)
    print(f"\n| variant | ms / step (median of {steps}) | padded tokens / step | real tokens / step | speed-up | loss (last step) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, t, p, r, loss in rows:
        print(f"| {name} | {t * 1000:.0f} | {p:.0f} | {r:.0f} | {rows[0][1] / t:.2f}× | {loss:.3f} |")


if __name__ == "__main__":
    fire.Fire(main)
