"""Learning curve of the search agent's SFT warm start: dev EM/F1 of greedy episodes every N steps.

The embedded default must start RL with non-zero reward; this measures how many SFT steps (and which
settings) get the tiny model there. Each evaluation runs the real episode code (train_search.evaluate)
against a CPU-server process and the BM25 retrieval server over the training world's corpus.

    python bench/warm_start_curve.py --steps 2000 --eval_every 250                    # CPU
    python bench/warm_start_curve.py --steps 4000 --device cuda --server_device cuda   # GPU, fast

Prints a table (step, seconds, loss-free dev EM / F1 / answered / searches) and appends JSON rows to --out.
"""
import asyncio
import json
import os
import sys
import tempfile
import time

import aiohttp
import fire
import torch
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train_search as ts  # noqa: E402
from lib.wiki_data import read_qa  # noqa: E402
from bench.sft_curve import CurveRecorder  # noqa: E402
from lib.client import InferenceClient  # noqa: E402
from lib.launch import launch_cpu_server  # noqa: E402
from lib.retrieval import launch_retrieval_server  # noqa: E402
from lib.tiny_model import default_tiny_model_dir  # noqa: E402
from lib.warm_start import sft_warm_start  # noqa: E402
from lib.wiki_data import default_wiki_dir  # noqa: E402


def main(steps: int = 2000, eval_every: int = 250, eval_size: int = 100, worlds: int = 1, lr: float = 2e-3,
         batch_size: int = 8, corpus_lm: bool = False, topk: int = 3, max_tokens: int = 1024, prompt: str = "full",
         device: str = "cpu", server_device: str = "cpu", threads: int | None = None, seed: int = 0,
         name: str = "", out: str = "", save: str = "", traces: str = "", arch: dict | None = None):
    """`arch`: overrides of the tiny model's architecture, e.g. --arch '{"num_hidden_layers": 6}'."""
    if threads:
        torch.set_num_threads(threads)
    cfg = ts.Config(topk=topk, max_tokens=max_tokens, max_new_tokens_per_turn=64, max_turns=32,
                    warm_start_worlds=worlds, warm_start_corpus_lm=corpus_lm, prompt=prompt)
    base = default_tiny_model_dir(**(arch or {}))
    tokenizer = AutoTokenizer.from_pretrained(base)
    t0 = time.time()
    data_dir = default_wiki_dir(seed=0)
    demos = ts.warm_start_examples(tokenizer, cfg, data_dir)
    lengths = [len(d["input_ids"]) for d in demos]
    print(f"{len(demos)} examples in {time.time() - t0:.0f} s, mean {sum(lengths) / len(lengths):.0f} tokens")

    dev = read_qa(os.path.join(data_dir, "dev.jsonl"))[:eval_size]
    work = tempfile.mkdtemp(prefix="wscurve-")
    retrieval = launch_retrieval_server(os.path.join(data_dir, "corpus.jsonl"))
    server = launch_cpu_server(base, device=server_device, num_threads=1, random_seed=seed,
                               log_path=os.path.join(work, "server.log"))
    loop = asyncio.new_event_loop()
    client = InferenceClient([server.address])
    rows = []
    recorder = CurveRecorder(work, device, client, loop, out)

    def evaluate(step, model, tok):
        recorder.load_on_server(step, model, tok)

        async def go():
            async with aiohttp.ClientSession() as session:
                return await ts.rollout_groups(client, session, tokenizer, cfg, dev, retrieval.address, 0.0, 1)

        episodes = loop.run_until_complete(go())
        m = {"exact_match": sum(e["exact_match"] for e in episodes) / len(episodes),
             "f1": sum(e["rewards"].item() for e in episodes) / len(episodes),
             "answered": sum(e["finish_reason"] == "answer" for e in episodes) / len(episodes),
             "searches": sum(e["num_tool_calls"] for e in episodes) / len(episodes)}
        one_hop = [e["exact_match"] for e, q in zip(episodes, dev) if q["hops"] == 1]
        m["em_1hop"] = sum(one_hop) / max(1, len(one_hop))
        m["em_multihop"] = (sum(e["exact_match"] for e in episodes) - sum(one_hop)) / max(1, len(episodes) - len(one_hop))
        if traces:
            with open(traces, "a") as f:
                for e, q in zip(episodes, dev):
                    f.write(json.dumps({"name": name, "step": step, "hops": q["hops"], "question": q["question"],
                                        "gold": q["answer"], "hop_queries": q["hop_queries"],
                                        "em": e["exact_match"], "turns": e["turn_texts"]}) + "\n")
        rows.append(recorder.record({
            "name": name, "step": step, "worlds": worlds, "lr": lr, "batch_size": batch_size, "corpus_lm": corpus_lm,
            "prompt": prompt, "topk": topk, "device": device, "arch": arch or {},
            "demo_tokens": round(sum(lengths) / len(lengths)), **{k: round(v, 4) for k, v in m.items()}}))

    try:
        final = save or os.path.join(work, "final")
        sft_warm_start(base, demos, final, steps=steps, lr=lr, batch_size=batch_size, seed=seed, device=device,
                       callback=evaluate, callback_every=eval_every)
    finally:
        loop.run_until_complete(client.close())
        server.terminate()
        retrieval.terminate()
    print(f"\n{'step':>6} {'train s':>8} {'EM':>6} {'EM 1-hop':>9} {'EM 2+':>6} {'F1':>6} {'answered':>9} {'searches':>9}")
    for r in rows:
        print(f"{r['step']:>6} {r['train_s']:>8.0f} {r['exact_match']:>6.3f} {r['em_1hop']:>9.3f} {r['em_multihop']:>6.3f} "
              f"{r['f1']:>6.3f} {r['answered']:>9.2f} {r['searches']:>9.2f}")


if __name__ == "__main__":
    fire.Fire(main)
