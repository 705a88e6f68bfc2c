"""Does a prefix cached under old weights shape sampling after a weight update? (real SGLang, a GPU)

The measurement of docs/client.md "Prefix cache and versions", with and without the client's
per-version cache key:
  1. a prompt prefix P (400 tokens) is cached under weights A (key "policy-v0");
  2. the weights become B = A + noise (2% of each tensor's std), `flush_cache: false`, as the async
     scripts update (the server is never idle there);
  3. the log-probs of 100 fixed tokens T after P (teacher-forced) are asked for
     - with the old key: SGLang may reuse P's KV computed under A ("stale");
     - with the new key "policy-v1", as lib.client sends after the update ("keyed");
  4. the cache is flushed (the server is idle now) and T's log-probs computed afresh under B ("fresh").
Printed: cached prompt tokens and mean / max |log-prob - fresh| of each, beside the whole A-vs-B
difference. With the key, the gap is the engine's own run-to-run noise (bf16).

    python bench/check_prefix_cache.py --model-path smollm2-135m-instruct [--base-gpu-id 0]
"""
import argparse
import json
import os
import sys
import tempfile
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.check_sglang import SGLANG_KIT_ARGS  # noqa: E402  (the flags the offline SGLang kit needs)
from lib.launch import launch_sglang  # noqa: E402
from lib.model_names import resolve_model_path  # noqa: E402


def post(address: str, path: str, body: dict | None) -> dict | str:
    request = urllib.request.Request(address + path, data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=600) as answer:
        text = answer.read().decode()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def teacher_forced(address: str, prefix: list[int], tokens: list[int], key: str) -> tuple[list[float], int]:
    """Log-probs of `tokens` after `prefix` under the server's weights, and the cached prompt tokens."""
    answer = post(address, "/generate", {
        "input_ids": prefix + tokens, "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
        "return_logprob": True, "logprob_start_len": len(prefix), "extra_key": key})
    rows = answer["meta_info"]["input_token_logprobs"]
    logprobs = [row[0] for row in rows if row[0] is not None][-len(tokens):]
    return logprobs, int(answer["meta_info"].get("cached_tokens", 0))


def gap(a: list[float], b: list[float]) -> tuple[float, float]:
    d = (torch.tensor(a) - torch.tensor(b)).abs()
    return d.mean().item(), d.max().item()


def measure(model_path: str, *, base_gpu_id: int = 0, mem_fraction_static: float = 0.3, prefix_tokens: int = 400,
            probe_tokens: int = 100, noise: float = 0.02, extra_args=tuple(SGLANG_KIT_ARGS)) -> dict:
    """{row name: (log-probs, cached prompt tokens)} for the rows printed by main(); "fresh" is the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    text = " ".join(f"Fact {i}: the river Ostrel flows {i * 7} miles north of Tarqua." for i in range(200))
    ids = tokenizer(text)["input_ids"]
    prefix, probe = ids[:prefix_tokens], ids[prefix_tokens:prefix_tokens + probe_tokens]

    work = tempfile.mkdtemp(prefix="prefix_cache_")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():
        for w in model.parameters():
            w.add_(torch.randn_like(w.float()).mul_(noise * w.float().std().nan_to_num(0.0)).to(w.dtype))
    model.save_pretrained(os.path.join(work, "b"))
    tokenizer.save_pretrained(os.path.join(work, "b"))

    server = launch_sglang(model_path, base_gpu_id=base_gpu_id, mem_fraction_static=mem_fraction_static,
                           dtype="bfloat16", random_seed=0, extra_args=list(extra_args),
                           log_path=os.path.join(work, "sglang.log"))
    rows = {}
    try:
        a = server.address
        rows["weights A"] = teacher_forced(a, prefix, probe, "probe-a")  # for the whole A-vs-B gap
        teacher_forced(a, prefix, probe, "policy-v0")  # P (and T) cached under A with the run's key
        answer = post(a, "/update_weights_from_disk", {"model_path": os.path.join(work, "b"), "flush_cache": False})
        assert answer.get("success"), answer
        rows["old key"] = teacher_forced(a, prefix, probe, "policy-v0")
        rows["new key"] = teacher_forced(a, prefix, probe, "policy-v1")
        rows["new key again"] = teacher_forced(a, prefix, probe, "policy-v1")  # B's own cache reused
        post(a, "/flush_cache", None)
        rows["fresh"] = teacher_forced(a, prefix, probe, "policy-v1")
    finally:
        server.terminate()
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="a local HF model or a known name (smollm2-135m-instruct)")
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--mem-fraction-static", type=float, default=0.3)
    p.add_argument("--prefix-tokens", type=int, default=400)
    p.add_argument("--probe-tokens", type=int, default=100)
    p.add_argument("--noise", type=float, default=0.02, help="B = A + noise x std(tensor) x N(0, 1)")
    p.add_argument("--extra-args", default=" ".join(SGLANG_KIT_ARGS))
    args = p.parse_args()
    rows = measure(resolve_model_path(args.model_path), base_gpu_id=args.base_gpu_id,
                   mem_fraction_static=args.mem_fraction_static, prefix_tokens=args.prefix_tokens,
                   probe_tokens=args.probe_tokens, noise=args.noise, extra_args=args.extra_args.split())
    fresh = rows["fresh"][0]
    print(f"{args.model_path}: prefix {args.prefix_tokens} tokens, {args.probe_tokens} probe tokens, "
          f"B = A + {args.noise:g} std noise")
    print("| request after the update | cached prompt tokens | mean abs diff vs fresh | max |")
    print("|---|---|---|---|")
    for name, label in (("old key", "old key (no per-version key): reuses A's KV"),
                        ("new key", "new key policy-v1 (lib.client)"),
                        ("new key again", "new key again (B's own cache)"), ("fresh", "fresh after flush_cache")):
        lps, cached = rows[name]
        mean, mx = gap(lps, fresh)
        print(f"| {label} | {cached} | {mean:.4f} | {mx:.4f} |")
    mean, mx = gap(rows["weights A"][0], fresh)
    print(f"| (weights A vs B, whole difference) | - | {mean:.4f} | {mx:.4f} |")


if __name__ == "__main__":
    main()
