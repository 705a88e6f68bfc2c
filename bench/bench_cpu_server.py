"""Generate throughput of lib.cpu_server against plain `model.generate` on the same batch.

    python bench/bench_cpu_server.py [--model-path DIR] [--batch-sizes 1 8 32] [--prompt-tokens 64]
                                     [--new-tokens 128] [--num-threads 2]

For each batch size B: B concurrent /generate requests (one prompt each, sampled at temperature 1,
ignore_eos so every row makes exactly --new-tokens tokens), timed from the first send to the last
answer; then `model.generate` on the same B prompts, left-padded, in this process with the same
thread count. tokens/s counts generated tokens only; each figure is the best of --repeats runs,
alternating server and model.generate, because the 2-core machine is shared and interference only
ever slows a run down. The model defaults to the embedded tiny model.
"""
import argparse
import concurrent.futures
import os
import platform
import socket
import subprocess
import sys
import time

import requests
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def tiny_model_dir() -> str:
    from lib import tiny_model

    try:
        return tiny_model.default_tiny_model_dir()
    except ImportError:  # the bundled data modules are not there yet: same architecture, stand-in text
        out_dir = os.path.join(tiny_model.cache_root(), "bench-tiny-qwen2")
        if not os.path.exists(os.path.join(out_dir, "model.safetensors")):
            texts = [f"Ilvan Moresk was born in Tarqua in {1800 + i}. Pem Varo founded the Ostrel Guild "
                     f"and wrote {i * 7 % 97} books about the river." for i in range(3000)]
            tiny_model.build_tiny_model(out_dir, texts, seed=0)
        return out_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_path: str, num_threads: int, max_running: int):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lib.cpu_server", "--model-path", model_path, "--port", str(port),
                             "--num-threads", str(num_threads), "--max-running-requests", str(max_running),
                             "--log-level", "warning"], cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except requests.ConnectionError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("lib.cpu_server did not start; run it by hand to see why")
        time.sleep(0.2)


def server_tokens_per_s(url: str, prompts: list, new_tokens: int) -> float:
    def one(ids):
        body = {"input_ids": ids, "return_logprob": True,
                "sampling_params": {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}}
        out = requests.post(url + "/generate", json=body, timeout=3600).json()
        return len(out["output_ids"])

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        t0 = time.perf_counter()
        n_tokens = sum(pool.map(one, prompts))
        return n_tokens / (time.perf_counter() - t0)


def generate_tokens_per_s(model, prompts: list, new_tokens: int, pad_id: int) -> float:
    length = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (length - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             pad_token_id=pad_id)
    return (out.shape[1] - length) * len(prompts) / (time.perf_counter() - t0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    from transformers import AutoModelForCausalLM

    model_path = args.model_path or tiny_model_dir()
    torch.set_num_threads(args.num_threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    pad_id = model.config.pad_token_id or 0
    g = torch.Generator().manual_seed(0)
    proc, url = start_server(model_path, args.num_threads, max(args.batch_sizes))
    rows = []
    try:
        warm = [torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist()]
        server_tokens_per_s(url, warm, 8)
        generate_tokens_per_s(model, warm, 8, pad_id)
        for batch in args.batch_sizes:
            # Prompt lengths vary by up to 25% so padding is part of the work, as in real traffic.
            prompts = [torch.randint(3, vocab, (args.prompt_tokens - (i * 7) % max(1, args.prompt_tokens // 4),),
                                     generator=g).tolist() for i in range(batch)]
            server, plain = 0.0, 0.0
            for _ in range(args.repeats):
                server = max(server, server_tokens_per_s(url, prompts, args.new_tokens))
                plain = max(plain, generate_tokens_per_s(model, prompts, args.new_tokens, pad_id))
            rows.append((batch, server, plain))
    finally:
        proc.kill()
        proc.wait()

    n_params = sum(t.numel() for t in model.parameters())
    print(f"model {model_path} ({n_params / 1e6:.1f} M parameters), prompt ~{args.prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens per row, {args.num_threads} torch threads, best of {args.repeats}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}")
    print("| batch | cpu_server tokens/s | model.generate tokens/s | ratio |")
    print("| ---: | ---: | ---: | ---: |")
    for batch, server, plain in rows:
        print(f"| {batch} | {server:.0f} | {plain:.0f} | {server / plain:.2f} |")


if __name__ == "__main__":
    main()
