"""Learning curve of the reflect agent's SFT warm start: greedy accuracy (turn 1 / after reflection)
every N steps on dev questions and on warm-start questions the model was trained on (a gap between
the two is memorisation).

Each evaluation runs the real episode code (train_reflect.evaluate) against a CPU-server process.

    python bench/reflect_warm_start_curve.py --steps 2000 --eval_every 500                      # CPU
    python bench/reflect_warm_start_curve.py --steps 3000 --device cuda --server_device cuda    # GPU, fast

Prints JSON rows (step, seconds, dev / seen accuracy) and appends them to --out; --save keeps the model.
"""
import asyncio
import json
import os
import sys
import tempfile
import time

import fire
import torch
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train_reflect as tr  # noqa: E402
from bench.sft_curve import CurveRecorder  # noqa: E402
from lib.client import InferenceClient  # noqa: E402
from lib.launch import launch_cpu_server  # noqa: E402
from lib.math_data import default_math_dir, read_split  # noqa: E402
from lib.tiny_model import default_tiny_model_dir  # noqa: E402
from lib.warm_start import sft_warm_start  # noqa: E402


def main(steps: int = 2000, eval_every: int = 500, eval_size: int = 200, lr: float = 2e-3, batch_size: int = 16,
         problems: int = 2000, reflect_frac: float = 0.3, device: str = "cpu", server_device: str = "cpu",
         threads: int | None = None, seed: int = 0, base: str = "", name: str = "", out: str = "", save: str = ""):
    """`problems`: size of the warm-start split (lib/math_data.default_math_dir's num_warmstart)."""
    if threads:
        torch.set_num_threads(threads)
    cfg = tr.Config(max_tokens=384, max_new_tokens_per_turn=64, max_turns=2, warm_start_reflect_frac=reflect_frac,
                    seed=seed)
    base = base or default_tiny_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(base)
    reflection_ids = tr.build_reflection_ids(tokenizer, True)
    data_dir = default_math_dir(seed=0, num_warmstart=problems)
    seen = read_split(data_dir, "warmstart")
    demos = tr.build_demonstrations(tokenizer, cfg, seen, reflection_ids)
    dev = read_split(data_dir, "dev")[:eval_size]
    work = tempfile.mkdtemp(prefix="reflect-wscurve-")
    server = launch_cpu_server(base, device=server_device, num_threads=1, random_seed=seed,
                               log_path=os.path.join(work, "server.log"))
    loop = asyncio.new_event_loop()
    client = InferenceClient([server.address])
    reward_pool = tr.RewardPool(1, cfg.reward_timeout_s, preload=tr.reward_fn)
    t_start = time.time()
    recorder = CurveRecorder(work, device, client, loop, out)

    def evaluate(step, model, tok):
        recorder.load_on_server(step, model, tok)

        async def go():
            args = (client, tokenizer, reflection_ids, reward_pool, cfg)
            return (await tr.evaluate(*args, dev))[1], (await tr.evaluate(*args, seen[:eval_size]))[1]

        m_dev, m_seen = loop.run_until_complete(go())
        recorder.record({"name": name, "step": step, "lr": lr, "batch_size": batch_size, "problems": problems,
                         "reflect_frac": reflect_frac, "device": device,
                         **{f"dev_{k}": round(v, 3) for k, v in m_dev.items()},
                         **{f"seen_{k}": round(v, 3) for k, v in m_seen.items()}})

    try:
        final = save or os.path.join(work, "final")
        sft_warm_start(base, demos, final, steps=steps, lr=lr, batch_size=batch_size, seed=seed, device=device,
                       callback=evaluate, callback_every=eval_every)
        with open(os.path.join(final, "warm_start.json")) as f:
            print(f"final SFT loss (a warm-start batch): {json.load(f)['final_loss']:.3f}; total {time.time() - t_start:.0f} s")
    finally:
        loop.run_until_complete(client.close())
        reward_pool.close()
        server.terminate()


if __name__ == "__main__":
    fire.Fire(main)
