"""Check lib/launch.py and lib/client.py against a real SGLang server, or against lib.cpu_server.

Launches the server with lib.launch, runs the client through every call the trainer uses, compares
the served log-probs with a transformers forward of the same model, prints a PASS/FAIL table, and
writes every raw request/response pair the client exchanged to $OUT (default ./check_sglang_out),
one JSON file per check, so the contract in docs/sglang_contract.md can be confirmed.

    # GPU machine with SGLang (requirements-gpu.txt, or the offline kit: eval "$(bash .kit/install.sh)")
    python bench/check_sglang.py --model-path /path/to/hf_model         # a tiny model is built if omitted
    # anywhere: the same checks against our CPU server
    python bench/check_sglang.py --server cpu

Exit status 0 only if every check passed.
"""
import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from lib.client import GenerationAborted, InferenceClient, InferenceServerError  # noqa: E402
from lib.launch import launch_cpu_server, launch_sglang  # noqa: E402
from lib.model_names import resolve_model_path  # noqa: E402

SGLANG_KIT_ARGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none"]
PROMPTS = ["The capital of France is", "Question: who founded the Ostrel Guild?\nAnswer:",
           "def fibonacci(n):", "Once upon a time", "1 + 1 = 2. 2 + 2 =", "<search> tallest mountain </search>",
           "The quick brown fox", "In 1803, the city of"]


class RecordingClient(InferenceClient):
    """Keeps every raw exchange, so each check can dump exactly what the server said."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.exchanges = []

    async def _request(self, method, address, path, body=None, **kwargs):
        record = {"method": method, "path": path, "request": body}
        self.exchanges.append(record)
        try:
            record["response"] = await super()._request(method, address, path, body, **kwargs)
        except InferenceServerError as e:
            record["error"], record["status"] = str(e), e.status
            raise
        return record["response"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", choices=["sglang", "cpu"], default="sglang")
    p.add_argument("--model-path", default=None, help="local HF model; default: build a tiny random Qwen2 in $OUT")
    p.add_argument("--dtype", default=None, help="server dtype (default: bfloat16 for sglang, float32 for cpu)")
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--mem-fraction-static", type=float, default=0.5, help="leaves room for the reference model")
    p.add_argument("--context-length", type=int, default=None, help="default: min(model's, 4096)")
    p.add_argument("--extra-args", default=" ".join(SGLANG_KIT_ARGS), help="passed to sglang.launch_server")
    p.add_argument("--timeout-s", type=float, default=900.0, help="server start-up limit")
    return p.parse_args()


def build_tiny(out_dir: str) -> str:
    from lib.tiny_model import build_tiny_model

    texts = [f"The city of Tarqua was founded in {1800 + i}. Pem Varo founded the Ostrel Guild. "
             f"<answer> {i} </answer> The quick brown fox jumps over the lazy dog." for i in range(300)]
    # head_dim 64: what SGLang's attention kernels expect of a real model
    return build_tiny_model(os.path.join(out_dir, "tiny_model"), texts, seed=0, vocab_size=512, hidden_size=256,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=512)


class Checks:
    def __init__(self, client: RecordingClient, tokenizer, model_path: str, context_length: int, dtype: str,
                 device: str, out_dir: str):
        self.client, self.tokenizer, self.model_path = client, tokenizer, model_path
        self.context_length, self.dtype, self.device, self.out_dir = context_length, dtype, device, out_dir
        self.prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
        self.decode_tokens_per_s = None
        self._reference = None

    def reference(self):
        if self._reference is None:
            self._reference = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).to(self.device).eval()
        return self._reference

    def long_generation_tokens(self, duration_s: float) -> int:
        """A max_new_tokens that takes about `duration_s` to decode alone, within the context."""
        room = self.context_length - len(self.prompts[0]) - 1
        return max(16, min(room, int((self.decode_tokens_per_s or 50) * duration_s)))

    async def generate_single(self):
        c = self.client
        gen = await c.generate(self.prompts[0], max_new_tokens=16)
        assert gen.finish_reason in ("length", "stop"), gen.finish_reason
        assert 0 < len(gen.output_ids) == len(gen.logprobs) == len(gen.versions) <= 16
        assert all(lp <= 0 for lp in gen.logprobs) and gen.prompt_tokens == len(self.prompts[0])
        t0 = time.monotonic()
        timed = await c.generate(self.prompts[0], max_new_tokens=128, temperature=0.0,
                                 extra_sampling_params={"ignore_eos": True})
        self.decode_tokens_per_s = len(timed.output_ids) / (time.monotonic() - t0)
        assert timed.finish_reason == "length" and timed.matched is None and len(timed.output_ids) == 128
        return (f"finish {gen.finish_reason}, {len(gen.output_ids)} tokens, weight_version {gen.weight_version!r}; "
                f"single-request decode {self.decode_tokens_per_s:.0f} tok/s")

    async def generate_16_concurrent(self):
        t0 = time.monotonic()
        gens = await asyncio.gather(*(self.client.generate(self.prompts[i % len(self.prompts)], max_new_tokens=64,
                                                           extra_sampling_params={"ignore_eos": True})
                                      for i in range(16)))
        elapsed_s = time.monotonic() - t0
        assert all(g.finish_reason == "length" and len(g.output_ids) == len(g.logprobs) == 64 for g in gens)
        return f"16 x 64 tokens in {elapsed_s:.2f} s ({16 * 64 / elapsed_s:.0f} tok/s)"

    async def stop_strings(self):
        # Sampled, so no repeatability is needed: whatever comes out must obey the stop rules.
        stops = ["e ", " t", "in", "an", "er", "\n", "."]
        for attempt in range(8):
            gen = await self.client.generate(self.prompts[attempt % len(self.prompts)], max_new_tokens=128, stop=stops,
                                             extra_sampling_params={"ignore_eos": True})
            if gen.finish_reason == "stop":
                break
        else:
            raise AssertionError(f"no stop string matched in 8 tries; last text {gen.text!r}")
        full = self.tokenizer.decode(gen.output_ids)
        before = self.tokenizer.decode(gen.output_ids[:-1])
        assert isinstance(gen.matched, str) and gen.matched in stops, gen.matched
        assert gen.matched in full, "the matched stop string is in the decoded output_ids (not trimmed there)"
        assert not any(s in before for s in stops), "it is completed by the last token, not earlier"
        assert gen.text == full[:full.find(gen.matched)], (gen.text, full)
        assert len(gen.logprobs) == len(gen.output_ids)
        return f"matched {gen.matched!r} at token {len(gen.output_ids)}; text trimmed at it, ids keep it"

    async def stop_token_ids(self):
        sample = await self.client.generate(self.prompts[1], max_new_tokens=64, extra_sampling_params={"ignore_eos": True})
        stop_ids = sorted(set(sample.output_ids))[:32]
        for attempt in range(8):
            gen = await self.client.generate(self.prompts[1], max_new_tokens=256, stop_token_ids=stop_ids)
            if gen.finish_reason == "stop":
                break
        else:
            raise AssertionError("no stop token matched in 8 tries")
        assert isinstance(gen.matched, int) and gen.output_ids[-1] == gen.matched
        assert gen.matched not in gen.output_ids[:-1] or gen.matched not in stop_ids
        assert len(gen.logprobs) == len(gen.output_ids)
        which = "a stop_token_id" if gen.matched in stop_ids else "the model's EOS"
        return f"matched {gen.matched} ({which}) as the last of {len(gen.output_ids)} output ids"

    async def logprobs_vs_transformers(self):
        model, lines, worst = self.reference(), [], 0.0
        for temperature in (1.0, 0.7):
            gens = await asyncio.gather(*(self.client.generate(p, max_new_tokens=32, temperature=temperature,
                                                               extra_sampling_params={"ignore_eos": True})
                                          for p in self.prompts))
            diffs = []
            for prompt, gen in zip(self.prompts, gens):
                with torch.no_grad():
                    ids = torch.tensor([prompt + gen.output_ids], device=self.device)
                    logits = model(ids).logits.float()[0, len(prompt) - 1:-1]
                ref = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(gen.output_ids, device=self.device)[:, None])
                diffs += (ref[:, 0].cpu() - torch.tensor(gen.logprobs)).abs().tolist()
            mean, top = sum(diffs) / len(diffs), max(diffs)
            worst = max(worst, mean)
            lines.append(f"T={temperature}: mean |d| {mean:.2e}, max {top:.2e}")
        # fp32 server: the same numbers up to kernel order; bf16: bf16 rounding of the logits' inputs.
        bound = 1e-3 if self.dtype in ("float32", "float") else 5e-2
        assert worst < bound, f"mean |d| {worst:.3g} >= {bound} ({self.dtype} server vs fp32 reference)"
        return f"vs fp32 transformers on {self.device}, {self.dtype} server: " + "; ".join(lines)

    async def streamed_equals_plain(self):
        # lib.client's streamed generate (SGLang's `stream: true`): the runs handed to on_tokens arrive
        # while the turn decodes and join into exactly the plain (non-streamed) greedy generation.
        c, n = self.client, 64
        plain = await c.generate(self.prompts[3], max_new_tokens=n, temperature=0.0, extra_sampling_params={"ignore_eos": True})
        runs, arrivals, t0 = [], [], time.monotonic()

        def on_tokens(ids, logprobs, tops):
            runs.append((list(ids), list(logprobs)))
            arrivals.append(time.monotonic() - t0)

        streamed = await c.generate(self.prompts[3], max_new_tokens=n, temperature=0.0, on_tokens=on_tokens,
                                    extra_sampling_params={"ignore_eos": True})
        total_s = time.monotonic() - t0
        joined = [t for ids, _ in runs for t in ids]
        assert streamed.output_ids == plain.output_ids == joined, "streamed ids differ from the plain generation"
        assert [lp for _, lps in runs for lp in lps] == streamed.logprobs
        assert len(runs) > 1, f"one run only: the reply came whole ({len(joined)} tokens)"
        diff = max(abs(a - b) for a, b in zip(streamed.logprobs, plain.logprobs))
        assert diff < 5e-2, f"streamed and plain log-probs differ by {diff:.3g}"
        return (f"{len(runs)} runs for {n} tokens, first after {arrivals[0]:.3f} s of {total_s:.3f} s; ids equal the plain "
                f"generation, log-probs within {diff:.2e}")

    async def paused_midway(self, start, new_version: int, while_paused=None):
        """Start a long generation (`start(n)` returns the task), pause while it decodes, run
        `while_paused()` if given, continue under `new_version`: (n, the Generation, what
        while_paused returned, how long the pause call took). The decode rate measured at the start
        may be stale (a loaded machine): a generation that ended before the pause is tried again, longer."""
        c = self.client
        for attempt in range(3):
            n = self.long_generation_tokens(3.0)
            t0, ended = time.monotonic(), []
            task = start(n)
            task.add_done_callback(lambda _: ended.append(time.monotonic()))
            await asyncio.sleep(min(1.0, 0.3 * n / (self.decode_tokens_per_s or 50)))
            if task.done():  # it ended before the pause: decoding is faster than measured
                await task
                self.decode_tokens_per_s = max(2 * (self.decode_tokens_per_s or 50), n / max(ended[0] - t0, 1e-3))
                continue
            t1 = time.monotonic()
            await c.pause_generation()
            pause_s = time.monotonic() - t1
            extra = await while_paused(task) if while_paused else await asyncio.sleep(0.3)
            await c.continue_generation(version=new_version)
            return n, await task, extra, pause_s
        raise AssertionError("every generation ended before the pause (3 tries, each longer)")

    async def streamed_through_a_pause(self):
        c = self.client
        got = []
        c.set_version(20)

        def start(n):
            got.clear()
            return asyncio.create_task(c.generate(self.prompts[2], max_new_tokens=n, temperature=0.0,
                                                  on_tokens=lambda ids, lps, tops: got.extend(ids),
                                                  extra_sampling_params={"ignore_eos": True}))

        n, gen, _, _ = await self.paused_midway(start, 21)
        c.set_version(0)
        k = gen.versions.count(20)
        assert gen.num_resumes == 1, f"expected one resume, got {gen.num_resumes}"
        assert got == gen.output_ids and len(gen.output_ids) == n and 0 < k < n
        return f"streamed {n} tokens through a pause at token {k}, every token handed over once"

    async def top_logprobs(self):
        k = 5
        gen = await self.client.generate(self.prompts[1], max_new_tokens=16, top_logprobs=k,
                                         extra_sampling_params={"ignore_eos": True})
        assert gen.top_logprobs is not None and len(gen.top_logprobs) == len(gen.output_ids)
        for lp, tops in zip(gen.logprobs, gen.top_logprobs):
            assert len(tops) == k, tops
            values = [v for v, _ in tops]
            assert values == sorted(values, reverse=True), "top log-probs not in decreasing order"
            assert lp <= values[0] + 1e-3, f"sampled token's log-prob {lp} above the top one {values[0]}"
        hits = sum(tok in [t for _, t in tops] for tok, tops in zip(gen.output_ids, gen.top_logprobs))
        greedy = await self.client.generate(self.prompts[1], max_new_tokens=16, top_logprobs=k, temperature=0.0,
                                            extra_sampling_params={"ignore_eos": True})
        assert all(tops[0][1] == tok for tok, tops in zip(greedy.output_ids, greedy.top_logprobs)), \
            "a greedy token is not the first of its top log-probs"
        return (f"{k} per token, decreasing; sampled (T=1) token among them at {hits}/{len(gen.output_ids)} steps; "
                f"greedy: always the first")

    async def prompt_top_logprobs(self):
        # /generate with logprob_start_len 0 and top_logprobs_num: the prompt's log-probs and, per
        # prompt position, its most likely tokens (lib/cpu_server.py answers the same shape).
        k, prompt = 3, self.prompts[2]
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": k}
        meta = (await self.client._request("POST", self.client.addresses[0], "/generate", body))["meta_info"]
        rows, tops = meta["input_token_logprobs"], meta.get("input_top_logprobs")
        assert [r[1] for r in rows] == prompt and rows[0][0] is None, f"input_token_logprobs {str(rows)[:200]}"
        assert tops is not None and len(tops) == len(prompt), f"input_top_logprobs {str(tops)[:200]}"
        assert not tops[0], f"first prompt token's top log-probs should be empty, got {tops[0]}"
        with torch.no_grad():
            ref = torch.log_softmax(self.reference()(torch.tensor([prompt], device=self.device)).logits.float()[0], -1)
        agree = 0
        for t in range(1, len(prompt)):
            values = [v for v, _, _ in tops[t]]
            assert len(tops[t]) == k and values == sorted(values, reverse=True), tops[t]
            assert rows[t][0] <= values[0] + 1e-3, f"prompt token's log-prob {rows[t][0]} above the top one {values[0]}"
            agree += tops[t][0][1] == int(ref[t - 1].argmax())
        assert agree >= 0.8 * (len(prompt) - 1), f"top token agrees with fp32 transformers at {agree}/{len(prompt) - 1}"
        return (f"{len(prompt)} prompt positions, first {tops[0]!r}, {k} per position, decreasing; top token = fp32 "
                f"transformers' at {agree}/{len(prompt) - 1}")

    async def cancelled_generate_aborts_its_request(self):
        # A caller that gives up (the proxy's client disconnected, an episode's deadline) cancels the
        # generate: the client posts /abort_request with that request's rid, and the server stops it.
        n = self.long_generation_tokens(20.0)
        task = asyncio.create_task(self.client.generate(self.prompts[4], max_new_tokens=n,
                                                        extra_sampling_params={"ignore_eos": True}))
        await asyncio.sleep(1.0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:
            running = await _running_requests(self.client)
            if running == 0:
                break
            await asyncio.sleep(0.2)
        assert running == 0, f"{running} requests still running 10 s after the cancel"
        return f"cancelled a {n}-token request after 1 s: 0 running {time.monotonic() - t0:.2f} s later"

    async def error_400(self):
        try:
            await self.client.generate(self.prompts[0], max_new_tokens=self.context_length + 1)
        except InferenceServerError as e:
            assert e.status == 400, e.status
            return f"400: {str(e).split('HTTP 400: ')[-1][:90]}"
        raise AssertionError("a request longer than the context was accepted")

    async def pause_continue_inflight(self):
        c = self.client
        c.set_version(10)

        def start(n):
            return asyncio.create_task(c.generate(self.prompts[2], max_new_tokens=n, temperature=0.0,
                                                  extra_sampling_params={"ignore_eos": True}))

        async def while_paused(inflight):
            late = asyncio.create_task(c.generate(self.prompts[3], max_new_tokens=4, temperature=0.0))
            await asyncio.sleep(0.5)
            assert not inflight.done() and not late.done(), "requests wait while paused"
            return late

        n, gen, late, pause_s = await self.paused_midway(start, 11, while_paused)
        late_gen = await late
        c.set_version(0)
        k = gen.versions.count(10)
        assert gen.num_resumes == 1, f"expected one resume, got {gen.num_resumes} (did the request end before the pause?)"
        assert len(gen.output_ids) == len(gen.logprobs) == n and gen.finish_reason == "length"
        assert 0 < k < n and gen.versions == [10] * k + [11] * (n - k)
        assert set(late_gen.versions) == {11}
        return f"cut at token {k}/{n}, resumed under version 11; pause call took {pause_s:.2f} s"

    async def abort_request(self):
        n = self.long_generation_tokens(3.0)
        task = asyncio.create_task(self.client.generate(self.prompts[4], max_new_tokens=n,
                                                        extra_sampling_params={"ignore_eos": True}))
        await asyncio.sleep(min(0.5, 0.3 * n / (self.decode_tokens_per_s or 50)))
        await self.client.abort_request()
        try:  # an abort that is not a pause is an infrastructure failure: generate raises
            gen = await task
        except GenerationAborted as e:
            return f"abort answered and raised GenerationAborted: {str(e)[:120]}"
        raise AssertionError(f"generate returned finish_reason {gen.finish_reason!r} instead of raising")

    async def flush_cache(self):
        texts = await self.client.flush_cache()
        assert all("flushed" in t.lower() for t in texts), texts
        return texts[0].splitlines()[0]

    async def update_weights_from_disk(self):
        c = self.client
        prompt = self.prompts[0]
        before = await c.generate(prompt, max_new_tokens=16, temperature=0.0, extra_sampling_params={"ignore_eos": True})
        perturbed = tempfile.mkdtemp(prefix="perturbed-", dir=self.out_dir)
        try:
            model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
            torch.manual_seed(0)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * p.std().clamp(min=1e-3))
            model.save_pretrained(perturbed)
            self.tokenizer.save_pretrained(perturbed)
            del model
            answers = await c.update_weights_from_disk(perturbed, weight_version="perturbed")
            after = await c.generate(prompt, max_new_tokens=16, temperature=0.0, extra_sampling_params={"ignore_eos": True})
            await c.update_weights_from_disk(self.model_path, weight_version="original")
            restored = await c.generate(prompt, max_new_tokens=16, temperature=0.0, extra_sampling_params={"ignore_eos": True})
        finally:
            shutil.rmtree(perturbed, ignore_errors=True)
        assert answers[0]["success"] is True
        assert after.weight_version == "perturbed" and restored.weight_version == "original"
        assert after.output_ids != before.output_ids, "new weights changed nothing"
        assert restored.output_ids == before.output_ids, "restoring the weights did not restore the greedy output"
        return "outputs changed with the new weights and came back with the old; weight_version echoed"

    async def info(self):
        model_info, server_info = (await self.client.get_model_info())[0], (await self.client.get_server_info())[0]
        assert "weight_version" in model_info and "model_path" in model_info, sorted(model_info)
        return f"model_type {model_info.get('model_type')}, server version {server_info.get('version')}"


async def _running_requests(client) -> int:
    """Requests the server holds now: lib.cpu_server reports them in /get_server_info, SGLang per
    scheduler in /get_load (`num_reqs`: running and waiting)."""
    info = (await client.get_server_info())[0]
    if "num_running_requests" in info:
        return int(info["num_running_requests"]) + int(info.get("num_waiting_requests", 0))
    load = await client._request("GET", client.addresses[0], "/get_load")
    loads = load if isinstance(load, list) else [load]
    if loads and all(isinstance(x, dict) and "num_reqs" in x for x in loads):
        return sum(int(x["num_reqs"]) for x in loads)
    raise AssertionError(f"no running-request count: /get_server_info keys {sorted(info)[:20]}, /get_load {str(load)[:200]}")


async def run_checks(address: str, model_path: str, out_dir: str, dtype: str, context: int) -> list[dict]:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    client = RecordingClient([address], request_timeout_s=300.0, max_retries=1, retry_backoff_s=0.5)
    checks = Checks(client, tokenizer, model_path, context, dtype, device, out_dir)
    results = []
    for name in ["generate_single", "generate_16_concurrent", "stop_strings", "stop_token_ids",
                 "logprobs_vs_transformers", "streamed_equals_plain", "streamed_through_a_pause", "top_logprobs",
                 "prompt_top_logprobs", "cancelled_generate_aborts_its_request", "error_400", "pause_continue_inflight", "abort_request",
                 "flush_cache", "update_weights_from_disk", "info"]:
        client.exchanges = []
        t0 = time.monotonic()
        try:
            detail, status = await asyncio.wait_for(getattr(checks, name)(), timeout=600), "PASS"
        except AssertionError as e:
            detail, status = f"{e}", "FAIL"
        except Exception as e:
            detail, status = f"{type(e).__name__}: {e}", "ERROR"
            traceback.print_exc()
            if client._paused:  # a failed pause check must not block the checks after it
                await client.continue_generation()
        results.append({"check": name, "status": status, "seconds": round(time.monotonic() - t0, 2), "detail": detail})
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            json.dump({"result": results[-1], "exchanges": client.exchanges}, f, indent=1)
        print(f"{status:5} {name} ({results[-1]['seconds']} s): {detail}", flush=True)
    await client.close()
    return results


def main():
    args = parse_args()
    out_dir = os.path.abspath(os.environ.get("OUT") or "check_sglang_out")
    os.makedirs(out_dir, exist_ok=True)
    model_path = resolve_model_path(args.model_path) or build_tiny(out_dir)  # a known name: lib/model_names.py
    dtype = args.dtype or ("bfloat16" if args.server == "sglang" else "float32")
    log_path = os.path.join(out_dir, f"{args.server}_server.log")
    # The server gets the context the checks assume (a model's own may be longer: SmolLM2's is 8192).
    context = args.context_length or min(getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", 4096), 4096)
    t0 = time.monotonic()
    if args.server == "sglang":
        server = launch_sglang(model_path, base_gpu_id=args.base_gpu_id, mem_fraction_static=args.mem_fraction_static,
                               context_length=context, dtype=dtype, random_seed=0,
                               extra_args=args.extra_args.split(), log_path=log_path, timeout_s=args.timeout_s)
    else:
        server = launch_cpu_server(model_path, dtype=dtype, context_length=context, random_seed=0,
                                   log_path=log_path, timeout_s=args.timeout_s)
    start_s = time.monotonic() - t0
    print(f"{args.server} server up at {server.address} in {start_s:.1f} s (log {log_path})", flush=True)
    try:
        results = asyncio.run(run_checks(server.address, model_path, out_dir, dtype, context))
    finally:
        server.terminate()
    width = max(len(r["check"]) for r in results)
    print(f"\n{'check':{width}}  result  seconds  detail")
    for r in results:
        print(f"{r['check']:{width}}  {r['status']:6}  {r['seconds']:7.2f}  {r['detail']}")
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"server": args.server, "model_path": model_path, "dtype": dtype, "server_start_s": round(start_s, 1),
                   "torch": torch.__version__, "results": results}, f, indent=1)
    print(f"\nraw exchanges and results in {out_dir}")
    sys.exit(0 if all(r["status"] == "PASS" for r in results) else 1)


if __name__ == "__main__":
    main()
