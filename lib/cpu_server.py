"""An inference server on transformers + aiohttp that speaks SGLang 0.5.15's HTTP subset.

For machines where SGLang cannot run (CPU machines, CI, laptops): the launcher and client in lib
talk to it exactly as they talk to `python -m sglang.launch_server`, and its command-line flags are
SGLang's where SGLang has them:

    python -m lib.cpu_server --model-path PATH [--port 30000] [--device cpu|cuda] [--dtype auto]

Endpoints: /generate, /health, /health_generate, /get_model_info, /get_server_info, /flush_cache,
/pause_generation, /continue_generation, /abort_request, /update_weights_from_disk,
/init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group,
/update_weights_from_tensor, /release_memory_occupation, /resume_memory_occupation.
The field names and response shapes follow docs/sglang_contract.md.

Batching: one scheduler coroutine owns the running batch. Each iteration it admits waiting
requests (prefilled together in one forward), merges them into the running batch's KV cache
(left-padded to a common length, so requests that arrive while others decode join mid-flight),
then runs one decode step for every running row. Finished rows leave the cache at once. Every
model forward, weight copy and cache edit runs on one worker thread, one at a time, so the event
loop keeps answering /health, /pause_generation and /abort_request during a forward and weights
never change halfway through one.

Log-probs (SGLang's default convention, `RETURN_ORIGINAL_LOGPROB` off): the reported log-prob of a
sampled token is `log_softmax(logits / temperature)` in float32 at that token, taken from the full
temperature-scaled distribution *before* top-k / top-p / min-p truncation (those only restrict
what may be sampled). A temperature below 1e-6 means greedy decoding (argmax) and then the log-prob
is `log_softmax(logits)`, because SGLang rewrites such requests to temperature 1, top_k 1. So at
temperature 1.0 the log-probs equal a plain fp32 forward's `log_softmax` over the same tokens.
Prompt log-probs (`logprob_start_len >= 0`) are the untempered `log_softmax(logits)`, as in SGLang.

Where it differs from SGLang (docs/sglang_contract.md has SGLang's side):
- `/health` answers 200 without generating (SGLang's runs a 1-token generation and so gives 503
  while paused); `/health_generate` does generate.
- No prefix cache: `cached_tokens` is always 0 and `/flush_cache` has nothing to flush.
- `retract` pauses like `in_place` (nothing to free); an aborted running request ends without the
  one extra decode step SGLang runs; `num_retractions` and `reasoning_tokens` are always 0.
- Not supported, refused with a 400 rather than ignored: penalties, grammars, `logit_bias`;
  `stream` with a batch or n > 1. A streamed request's events carry the output so far (SGLang's
  default) or only what is new (`--incremental-streaming-output`), text included.
- `top_logprobs_num` gives `output_top_logprobs` (from the same log-probs as the sampled token's),
  not `input_top_logprobs`.
- `--random-seed` defaults to 0 (SGLang: random); `--dtype auto` is float32 on CPU.
- `/update_weights_from_tensor` takes only lib.tensor_ipc's payload (handles of shared tensors;
  any other pickle content is a 400) and no `load_format`.
- `/release_memory_occupation` frees nothing (there is no KV pool to free, and the weights stay
  where they are); it marks the server released, so that /generate is refused (400) until
  `/resume_memory_occupation`, and it is itself refused while requests run or wait.
- Weight updates copy tensors by their Hugging Face state-dict names (SGLang's `load_weights`
  also accepts those names).
- Stricter than SGLang on hostile input, all refused with a 400 before anything runs:
  sampling numbers out of range (`top_k` beyond the vocabulary, `temperature` above
  MAX_TEMPERATURE, seeds outside int64, ...), more than MAX_STOP_STRINGS stop strings or
  MAX_STOP_CHARS characters of them, strings holding a lone surrogate (`"\ud800"`), NaN/Infinity
  literals, `rank_offset` 0 (the server would become the broadcast source), non-float dtypes, and
  names or shapes the model lacks. One group join or distributed receive at a time: another one
  meanwhile is a 409.
- `sampling_seed` is hashed (all 64 bits) into the request's generator seed, so a seed gives other
  samples than SGLang's for the same seed (as every sample here does).

Hostile input (limits are the constants below and the flags): a request body must arrive within
--body-timeout-s (else 408) and fit --max-body-mb (else 413); a `text` longer than the context could
hold is refused before it is tokenized, and tokenizing and checkpoint reads run off the event loop,
so /health keeps answering; a client that disconnects cancels its handler and frees its rows at the
next step (pauses, weight updates and group joins run to the end regardless). A request that breaks
a step fails alone where it can be told apart: a row with no token left to sample ends with an
abort, and a failed prefill is retried one newcomer at a time (Runner.step).
"""
import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import reprlib
import stat
import threading
import time
import uuid

import torch
from aiohttp import web

from lib.http_body import BadRequest, errors_as_json, lone_surrogate, parse_json_body, read_body

logger = logging.getLogger("cpu_server")

MAX_BODY_BYTES = web.AppKey("max_body_bytes", int)
BODY_TIMEOUT_S = web.AppKey("body_timeout_s", float)
SCHEDULER_TASK = web.AppKey("scheduler", asyncio.Task)
MAX_ITEMS_PER_CALL = 4096  # prompts x n of one /generate call; bounds what one request can queue
GREEDY_TEMPERATURE = 1e-6  # SGLang's _SAMPLING_EPS: below it a request is decoded greedily
MAX_TEMPERATURE = 100.0  # far above any useful value; bounded so logits / temperature stays finite
MAX_NEW_TOKENS = 2**31 - 1  # int32, as SGLang's tensors; the context length bounds it further
SGLANG_TOP_K_ALL = 1 << 30  # SGLang's default top_k, meaning the whole vocabulary, as -1 does
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
# Every running row's stop strings are checked after every step, on the one thread all rows share:
# bounded so that one request cannot slow its batch-mates (3M stop strings made a 16-token request
# beside it take 4 s instead of 0.07 s).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024  # all of one request's stop strings together
MAX_TOP_LOGPROBS = 100  # top_logprobs_num: the most likely tokens reported at each step
MAX_WORLD_SIZE = 2**16
WEIGHT_DTYPES = ("float32", "bfloat16", "float16", "float64")  # what a weight update may send
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's /release_memory_occupation tags


def _short(value) -> str:
    """repr of a client's value for an error message, cut to a readable length."""
    return reprlib.repr(value)


def _number(field: str, value, kind: type, low, high, low_open: bool = False):
    """`value` as `kind` (int, or float which also takes ints) if it lies in [low, high] (or
    (low, high] when low_open); otherwise a 400 that names the field and the allowed range.
    Booleans are not numbers here, and NaN and infinities are never in range."""
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise BadRequest(f"{field} must be {'a number' if kind is float else 'an integer'}, got {_short(value)}")
    in_range = (low < value if low_open else low <= value) and value <= high
    if not in_range or (isinstance(value, float) and not math.isfinite(value)):
        raise BadRequest(f"{field} must be in {'(' if low_open else '['}{low}, {high}], got {_short(value)}")
    return kind(value)


def _field(body: dict, name: str, kind: type, default=None, required: bool = False):
    """body[name] if it is a `kind` (a bool is not an int), the default when absent or null."""
    value = body.get(name)
    if value is None:
        if required:
            raise BadRequest(f"missing field {name!r}")
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise BadRequest(f"{name} must be {kind.__name__}, got {_short(value)}")
    return value


# --- sampling parameters ---

@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop: list = dataclasses.field(default_factory=list)
    stop_token_ids: list = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    sampling_seed: int | None = None
    n: int = 1  # samples per prompt; the answer is a prompt-major list


# SGLang parameters this server accepts only at their no-op value (SGLang accepts them; silently
# ignoring a non-default value would give the caller different samples than they asked for).
_ONLY_DEFAULT = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None, "stop_regex": None,
    "logit_bias": None, "custom_params": None, "stream_interval": None,
}


def _check_type(name, value, types):
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise BadRequest(f"sampling_params.{name} must be {getattr(types, '__name__', types)}, got a bool")
    if not isinstance(value, types):
        raise BadRequest(f"sampling_params.{name} has the wrong type {type(value).__name__}")
    return value


def _top_k(value, vocab_size: int) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value in (-1, SGLANG_TOP_K_ALL):
        return -1
    return _number("sampling_params.top_k (or -1 for the whole vocabulary)", value, int, 1, vocab_size)


def parse_sampling_params(raw, vocab_size: int) -> SamplingParams:
    """Validate a `sampling_params` dict as SGLang's SamplingParams would, and stricter on numbers:
    unknown names, wrong types and out-of-range values (each named with its allowed range) are a
    400, never silently ignored or left to fail inside a model step."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params must be a JSON object")
    params = SamplingParams()
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    for name, value in raw.items():
        if name in _ONLY_DEFAULT:
            if value is not None and value != _ONLY_DEFAULT[name]:
                raise BadRequest(f"sampling_params.{name}={_short(value)} is not supported by lib.cpu_server; "
                                 f"leave it at {_ONLY_DEFAULT[name]!r} or use SGLang")
            continue
        if name not in known:
            raise BadRequest(f"unknown sampling parameter {_short(name)}; known: {sorted(known | set(_ONLY_DEFAULT))}")
        if value is None:
            continue
        field = f"sampling_params.{name}"
        if name in ("max_new_tokens", "min_new_tokens"):
            value = _number(field, value, int, 0, MAX_NEW_TOKENS)
        elif name == "n":  # prompts x n is bounded by MAX_ITEMS_PER_CALL, once the prompts are known
            value = _number(field, value, int, 1, INT64_MAX)
        elif name == "sampling_seed":
            value = _number(field, value, int, INT64_MIN, INT64_MAX)
        elif name == "top_k":
            value = _top_k(value, vocab_size)
        elif name == "temperature":
            value = _number(field, value, float, 0.0, MAX_TEMPERATURE)
        elif name == "top_p":
            value = _number(field, value, float, 0.0, 1.0, low_open=True)
        elif name == "min_p":
            value = _number(field, value, float, 0.0, 1.0)
        elif name in ("ignore_eos", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens"):
            _check_type(name, value, bool)
        elif name == "stop":
            value = [value] if isinstance(value, str) else value
            if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
                raise BadRequest(f"sampling_params.stop holds {len(value)} stop strings; at most {MAX_STOP_STRINGS}")
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise BadRequest("sampling_params.stop must be a string or a list of strings")
            chars = sum(map(len, value))
            if chars > MAX_STOP_CHARS:
                raise BadRequest(f"sampling_params.stop holds {chars} characters; at most {MAX_STOP_CHARS} in all "
                                 f"its strings")
            value = [s for s in value if s]
        elif name == "stop_token_ids":
            value = [value] if isinstance(value, int) and not isinstance(value, bool) else value
            if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                raise BadRequest("sampling_params.stop_token_ids must be a list of integers")
            # A set, looked up once a step; ids outside the vocabulary can never be sampled.
            value = {t for t in value if 0 <= t < vocab_size}
        setattr(params, name, value)
    if params.min_new_tokens > params.max_new_tokens:
        raise BadRequest(f"sampling_params.min_new_tokens must be in [0, max_new_tokens={params.max_new_tokens}], "
                         f"got {params.min_new_tokens}")
    if params.temperature < GREEDY_TEMPERATURE:
        params.temperature, params.top_k = 1.0, 1  # SGLang's greedy rewrite
    return params


# --- one request ---

@dataclasses.dataclass
class Request:
    rid: str
    input_ids: list
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    return_text_in_logprobs: bool
    max_new_tokens: int  # params.max_new_tokens capped by the context length
    created_s: float
    deadline_s: float
    future: asyncio.Future
    output_ids: list = dataclasses.field(default_factory=list)
    output_logprobs: list = dataclasses.field(default_factory=list)
    input_logprobs: list = dataclasses.field(default_factory=list)
    finish_reason: dict | None = None
    abort_message: str | None = None  # set from the event loop; the worker thread acts on it
    generator: torch.Generator | None = None
    top_logprobs_num: int = 0  # also the most likely tokens of each step (SGLang's top_logprobs_num)
    output_top_logprobs: list = dataclasses.field(default_factory=list)  # per token: [(logprob, id), ...]
    # Streamed requests (stream: true): set by the scheduler after each step that may have added tokens,
    # with `visible` the number of output tokens complete at that moment (read on the event loop).
    progress: asyncio.Event | None = None
    visible: int = 0


# --- the model runner: everything here runs on the single worker thread ---

def _kv_tensors(cache) -> list:
    """[(keys [B, H, L, D], values [B, H, L, D]) per layer] of a DynamicCache, across versions."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def _make_cache(kv: list):
    from transformers import DynamicCache

    try:
        return DynamicCache(ddp_cache_data=kv)
    except TypeError:  # transformers 4.x
        return DynamicCache.from_legacy_cache(tuple(kv))


def _left_pad(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class Runner:
    """The model, the running batch (rows, attention mask, KV cache) and the decoding rules."""

    def __init__(self, args):
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.args = args
        self.device = torch.device(args.device)
        self.dtype = _resolve_dtype(args.dtype, args.device)
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=self.dtype).to(self.device).eval()
        self.vocab_size = self.model.config.vocab_size
        self.context_length = args.context_length or getattr(self.model.config, "max_position_embeddings", 4096)
        eos = set()
        try:
            gen_eos = GenerationConfig.from_pretrained(args.model_path).eos_token_id
        except OSError:
            gen_eos = self.model.config.eos_token_id
        for ids in (gen_eos, self.model.config.eos_token_id, self.tokenizer.eos_token_id):
            eos |= set(ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids])
        self.eos_token_ids = eos
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else min(eos or {0})
        self.generator = torch.Generator(self.device).manual_seed(args.random_seed)
        self.param_shapes = {name: list(t.shape) for name, t in self.model.state_dict().items()}
        self.max_checkpoint_bytes = 8 * sum(math.prod(s) for s in self.param_shapes.values()) + 2**24
        # A token covers at most as many characters as its vocabulary entry has (byte-level BPE
        # entries have one character per byte); x2 leaves room for normalizers that merge characters.
        # A longer text cannot fit the context, so it is refused without tokenizing it.
        self.max_prompt_chars = 2 * self.context_length * max(map(len, self.tokenizer.get_vocab()))
        # The running batch: row i of `attention_mask [B, L]` and of every cache tensor is rows[i].
        self.rows: list[Request] = []
        self.attention_mask: torch.Tensor | None = None
        self.cache = None
        self.next_token_ids: torch.Tensor | None = None  # [B] last sampled token, fed next step
        self.stats = {"num_forward_batches": 0, "num_prefill_batches": 0, "num_decode_batches": 0,
                      "max_batch_size_seen": 0, "num_generated_tokens": 0, "num_finished_requests": 0}

    # -- one scheduler step --
    def step(self, admitted: list[Request], do_decode: bool) -> list[Request]:
        """Drop aborted rows, prefill `admitted` and merge them in, run one decode step if asked.
        Returns the requests that finished. A failure fails only the rows it can be pinned on: a
        prefill that fails is retried one newcomer at a time (the running batch is untouched until
        it succeeds); a decode forward is shared by every running row, so its failure ends them all."""
        with torch.inference_mode():
            finished = self._drop_aborted()
            for req in admitted:
                if req.abort_message is not None:
                    req.finish_reason = _abort_reason(req.abort_message, waiting=True)
                    finished.append(req)
                elif req.max_new_tokens == 0:
                    req.finish_reason = {"type": "length", "length": 0}
                    finished.append(req)
            admitted = [r for r in admitted if r.finish_reason is None]
            if admitted:
                finished += self._prefill_apart_on_failure(admitted)
            if do_decode and self.rows:
                try:
                    finished += self._decode()
                except Exception as e:
                    logger.exception("decode step failed; ending the %d running requests", len(self.rows))
                    finished += self.fail_all(f"model step failed: {e!r}")
        self.stats["num_finished_requests"] += len(finished)
        return finished

    def fail_all(self, message: str) -> list[Request]:
        """End every running row with an abort naming `message`, and empty the batch."""
        failed = self.rows
        for r in failed:
            r.finish_reason = _abort_reason(message)
        self.rows, self.attention_mask, self.cache, self.next_token_ids = [], None, None, None
        return failed

    def _prefill_apart_on_failure(self, reqs: list[Request]) -> list[Request]:
        try:
            return self._prefill(reqs)
        except Exception as e:
            if len(reqs) > 1:  # one of them may be the cause: each alone, so only that one fails
                for r in reqs:
                    r.output_ids, r.output_logprobs, r.input_logprobs, r.finish_reason = [], [], [], None
                return [done for r in reqs for done in self._prefill_apart_on_failure([r])]
            logger.exception("prefill of request %s failed", reqs[0].rid)
            reqs[0].finish_reason = _abort_reason(f"model step failed: {e!r}")
            return reqs

    def _drop_aborted(self) -> list[Request]:
        now = time.monotonic()
        for req in self.rows:
            if req.abort_message is None and now > req.deadline_s:
                req.abort_message = f"request exceeded the server's --request-timeout-s {self.args.request_timeout_s}"
        done = [r for r in self.rows if r.abort_message is not None]
        for req in done:
            req.finish_reason = _abort_reason(req.abort_message)
        self._keep([r.finish_reason is None for r in self.rows])
        return done

    def _forward(self, input_ids, attention_mask, position_ids, cache, logits_to_keep):
        self.stats["num_forward_batches"] += 1
        self.stats["max_batch_size_seen"] = max(self.stats["max_batch_size_seen"], input_ids.shape[0])
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep)
        return out.logits.float(), out.past_key_values

    def _prefill(self, reqs: list[Request]) -> list[Request]:
        self.stats["num_prefill_batches"] += 1
        length = max(len(r.input_ids) for r in reqs)
        input_ids = torch.full((len(reqs), length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), length), dtype=torch.long)
        for i, r in enumerate(reqs):
            input_ids[i, length - len(r.input_ids):] = torch.tensor(r.input_ids)
            mask[i, length - len(r.input_ids):] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        want_input_logprobs = any(r.return_logprob and r.logprob_start_len >= 0 for r in reqs)
        logits, cache = self._forward(input_ids, mask, position_ids, None, 0 if want_input_logprobs else 1)
        if want_input_logprobs:
            for i, r in enumerate(reqs):
                if r.return_logprob and r.logprob_start_len >= 0:
                    self._fill_input_logprobs(r, logits[i, length - len(r.input_ids):])
        tokens, *sampled = self._sample(logits[:, -1], reqs)
        finished = self._append(reqs, tokens, *sampled)
        keep = [r.finish_reason is None for r in reqs]
        if not any(keep):
            return finished
        idx = torch.tensor([i for i, k in enumerate(keep) if k], device=self.device)
        kv = [(k[idx], v[idx]) for k, v in _kv_tensors(cache)]
        new_rows = [r for r, k in zip(reqs, keep) if k]
        new_mask, new_next = mask[idx], tokens[idx]
        if self.rows:  # merge into the running batch, left-padding whichever is shorter
            old_kv = _kv_tensors(self.cache)
            total = max(self.attention_mask.shape[1], new_mask.shape[1])
            kv = [(torch.cat([_left_pad(ok, total, 2), _left_pad(nk, total, 2)]),
                   torch.cat([_left_pad(ov, total, 2), _left_pad(nv, total, 2)]))
                  for (ok, ov), (nk, nv) in zip(old_kv, kv)]
            new_mask = torch.cat([_left_pad(self.attention_mask, total, 1), _left_pad(new_mask, total, 1)])
            new_next = torch.cat([self.next_token_ids, new_next])
            new_rows = self.rows + new_rows
        new_cache = _make_cache(kv)  # built before anything is replaced: a failure leaves the batch as it was
        self.rows, self.attention_mask, self.next_token_ids, self.cache = new_rows, new_mask, new_next, new_cache
        return finished

    def _fill_input_logprobs(self, req: Request, logits_of_prompt: torch.Tensor):
        # logits_of_prompt[t] predicts prompt token t+1; the first prompt token has no log-prob.
        logprobs = torch.log_softmax(logits_of_prompt, dim=-1)
        ids = req.input_ids
        rows = [[None, ids[0], None]] + [[logprobs[t - 1, ids[t]].item(), ids[t], None] for t in range(1, len(ids))]
        req.input_logprobs = rows[req.logprob_start_len:]

    def _decode(self) -> list[Request]:
        self.stats["num_decode_batches"] += 1
        ones = torch.ones((len(self.rows), 1), dtype=self.attention_mask.dtype, device=self.device)
        self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)
        position_ids = self.attention_mask.sum(-1, keepdim=True) - 1
        logits, self.cache = self._forward(self.next_token_ids[:, None], self.attention_mask, position_ids, self.cache, 1)
        tokens, *sampled = self._sample(logits[:, -1], self.rows)
        finished = self._append(self.rows, tokens, *sampled)
        self.next_token_ids = tokens
        self._keep([r.finish_reason is None for r in self.rows])
        return finished

    def _keep(self, keep: list[bool]):
        """Shrink the running batch to the rows where keep is True, then drop the leading cache
        columns that are padding in every remaining row (left by rows that have left)."""
        if all(keep):
            return
        if not any(keep):
            self.rows, self.attention_mask, self.cache, self.next_token_ids = [], None, None, None
            return
        idx = torch.tensor([i for i, k in enumerate(keep) if k], device=self.device)
        self.rows = [r for r, k in zip(self.rows, keep) if k]
        self.attention_mask, self.next_token_ids = self.attention_mask[idx], self.next_token_ids[idx]
        first_used = int(self.attention_mask.any(0).long().argmax())
        self.attention_mask = self.attention_mask[:, first_used:]
        self.cache = _make_cache([(k[idx, :, first_used:], v[idx, :, first_used:]) for k, v in _kv_tensors(self.cache)])

    def _sample(self, logits: torch.Tensor, reqs: list[Request]):
        """logits [B, V] float32 → (sampled token ids [B], their log-probs [B] (see module doc),
        broken [B]: rows with no distribution to sample from, to be ended rather than sampled,
        top [B]: each row's `top_logprobs_num` most likely tokens [(log-prob, id), ...] by the same
        log-probs, or None)."""
        logits = logits.clone()
        for i, r in enumerate(reqs):
            if len(r.output_ids) < r.params.min_new_tokens:
                # SGLang's min-new-tokens penalizer: stop tokens cannot be sampled before the minimum.
                ban = list((set() if r.params.ignore_eos else self.eos_token_ids) | set(r.params.stop_token_ids))
                logits[i, [t for t in ban if 0 <= t < logits.shape[1]]] = float("-inf")
        temperature = torch.tensor([r.params.temperature for r in reqs], device=logits.device)[:, None]
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        # A row whose every token is banned (stop_token_ids covering the vocabulary under
        # min_new_tokens) or whose logits hold NaN has no distribution: made uniform here so the
        # batch's draw cannot fail, and ended by _append, so it never takes other rows down with it.
        broken = logprobs.isnan().any(-1)
        if broken.any():
            logits = logits.masked_fill(broken[:, None], 0.0)
            logprobs = logprobs.masked_fill(broken[:, None], -math.log(logits.shape[1]))
        top = [None] * len(reqs)
        for i, r in enumerate(reqs):
            if r.top_logprobs_num:
                values, ids = logprobs[i].topk(min(r.top_logprobs_num, logprobs.shape[1]))
                top[i] = list(zip(values.tolist(), ids.tolist()))
        greedy = [r.params.top_k == 1 for r in reqs]
        tokens = logits.argmax(-1)
        if all(greedy):
            return tokens, logprobs.gather(-1, tokens[:, None])[:, 0], broken, top
        probs = logprobs.exp()
        top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else logits.shape[1] for r in reqs], device=logits.device)
        top_p = torch.tensor([r.params.top_p for r in reqs], device=logits.device)
        min_p = torch.tensor([r.params.min_p for r in reqs], device=logits.device)
        if (top_k < logits.shape[1]).any() or (top_p < 1).any() or (min_p > 0).any():
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            rank = torch.arange(logits.shape[1], device=logits.device)[None]
            cut = rank >= top_k[:, None]
            cut |= (sorted_probs.cumsum(-1) - sorted_probs) > top_p[:, None]
            cut |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
            sorted_probs = sorted_probs.masked_fill(cut, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        shared = [i for i, r in enumerate(reqs) if not greedy[i] and r.generator is None]
        if shared:  # one draw for all rows on the server's generator; seeded requests draw alone
            idx = torch.tensor(shared, device=logits.device)
            tokens[idx] = torch.multinomial(probs[idx], 1, generator=self.generator)[:, 0]
        for i, r in enumerate(reqs):
            if not greedy[i] and r.generator is not None:
                tokens[i] = torch.multinomial(probs[i], 1, generator=r.generator)[0]
        return tokens, logprobs.gather(-1, tokens[:, None])[:, 0], broken, top

    def _append(self, reqs: list[Request], tokens: torch.Tensor, token_logprobs: torch.Tensor,
                broken: torch.Tensor, top: list) -> list[Request]:
        finished = []
        for r, token, logprob, no_distribution, best in zip(reqs, tokens.tolist(), token_logprobs.tolist(),
                                                            broken.tolist(), top):
            if no_distribution:
                r.finish_reason = _abort_reason("no token can be sampled: every token's probability is 0 or NaN "
                                                "(stop_token_ids and EOS cover the vocabulary while min_new_tokens "
                                                "bans them, or the logits hold NaN)")
                finished.append(r)
                continue
            if best is not None:  # first: a reader of output_ids[:visible] finds every row's top log-probs
                r.output_top_logprobs.append(best)
            r.output_ids.append(token)
            r.output_logprobs.append(logprob)
            self.stats["num_generated_tokens"] += 1
            r.finish_reason = self._check_finished(r)
            if r.finish_reason is not None:
                finished.append(r)
        return finished

    def _check_finished(self, r: Request) -> dict | None:
        """SGLang's order (Req.update_finish_state): length, stop strings on
        the decoded tail of the output, then stop token ids / EOS (both off under ignore_eos)."""
        if len(r.output_ids) >= r.max_new_tokens:
            return {"type": "length", "length": r.max_new_tokens}
        token = r.output_ids[-1]
        if r.params.stop:
            # A stop string of n UTF-8 bytes spans at most n tokens (each token decodes to >= 1
            # byte); decoding only that tail keeps the check O(1) per step.
            tail_tokens = max(len(s.encode()) for s in r.params.stop) + 2
            tail = self.decode(r.output_ids[-tail_tokens:], r.params)
            for stop in r.params.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        if not r.params.ignore_eos and (token in r.params.stop_token_ids or token in self.eos_token_ids):
            return {"type": "stop", "matched": token}
        return None

    def decode(self, ids: list, params: SamplingParams) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens,
                                     spaces_between_special_tokens=params.spaces_between_special_tokens)

    def output_text(self, r: Request) -> str:
        """The decoded output with the matched stop trimmed (SGLang's detokenizer, no_stop_trim
        off): a matched stop token is left out of the text and the text is cut at the first
        occurrence of a matched stop string. output_ids always keep every generated token."""
        ids, reason = r.output_ids, r.finish_reason or {}
        trim = not r.params.no_stop_trim and reason.get("type") == "stop"
        if trim and isinstance(reason.get("matched"), int):
            ids = ids[:-1]
        text = self.decode(ids, r.params)
        if trim and isinstance(reason.get("matched"), str):
            pos = text.find(reason["matched"])
            text = text[:pos] if pos >= 0 else text
        return text

    # -- weights --
    def read_checkpoint(self, model_path: str) -> list:
        """[(name, tensor)] of the safetensors checkpoint in the directory `model_path` (taken
        literally: no glob patterns), checked against the served model's names and shapes. Reads
        files and touches no weight, so it runs on any thread; a bad checkpoint raises here, before
        anything is copied, and the weights stay exactly as they were."""
        from safetensors.torch import load

        files = _checkpoint_files(model_path)
        size = sum(os.stat(path).st_size for path in files)
        if size > self.max_checkpoint_bytes:
            raise BadRequest(f"the *.safetensors files in {model_path!r} hold {size} bytes, more than the served "
                             f"model can take in float64 ({self.max_checkpoint_bytes}); wrong directory?")
        named = []
        for path in files:
            for name, tensor in load(_read_regular_file(path)).items():
                if name not in self.param_shapes:
                    raise BadRequest(f"{path} has tensor {_short(name)} which the served model lacks; "
                                     f"is it the same architecture as {self.args.model_path!r}?")
                if list(tensor.shape) != self.param_shapes[name]:
                    raise BadRequest(f"{name!r} has shape {list(tensor.shape)} in {path}, the served model has "
                                     f"{self.param_shapes[name]}")
                named.append((name, tensor))
        seen = {name for name, _ in named}
        missing = [n for n in self.param_shapes if n not in seen and not self._is_tied(n)]
        if missing:
            raise BadRequest(f"checkpoint {model_path!r} lacks {len(missing)} tensors, e.g. {missing[:3]}")
        return named

    def _is_tied(self, name: str) -> bool:
        return name == "lm_head.weight" and getattr(self.model.config, "tie_word_embeddings", False)

    def check_named_shapes(self, names: list, shapes: list):
        """A 400 unless each name is a tensor of the served model with exactly that shape."""
        for name, shape in zip(names, shapes):
            if name not in self.param_shapes:
                raise BadRequest(f"the served model has no parameter {_short(name)}")
            if shape != self.param_shapes[name]:
                raise BadRequest(f"{name!r} was sent with shape {_short(shape)}, the served model has "
                                 f"{self.param_shapes[name]}")

    def copy_named_tensors(self, named: list):
        params = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in named:
                params[name].copy_(tensor)


def _abort_reason(message: str, waiting: bool = False) -> dict:
    """SGLang's FINISH_ABORT.to_json(); its own aborts say "Aborted" (running) or "Abort in
    waiting queue"; ours name the cause when it is not a plain abort."""
    if message is None or message == "Aborted":
        message = "Abort in waiting queue" if waiting else "Aborted"
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def _checkpoint_files(model_path: str) -> list[str]:
    if not os.path.isdir(model_path):
        raise BadRequest(f"model_path {_short(model_path)} is not a directory; give the directory that "
                         f"save_pretrained(path, safe_serialization=True) wrote (*.safetensors)")
    names = sorted(n for n in os.listdir(model_path) if n.endswith(".safetensors"))
    if not names:
        raise BadRequest(f"no *.safetensors files in {model_path!r}; save the model with "
                         f"save_pretrained(path, safe_serialization=True)")
    return [os.path.join(model_path, n) for n in names]


def _read_regular_file(path: str) -> bytes:
    """The bytes of `path`, refusing anything but a regular file: opening a FIFO waits for a
    writer and a device may never end. Opened non-blocking, so that the check cannot hang, and read
    by Python, which lets go of the GIL while it waits (safetensors' own reader holds it: one
    blocked open froze the whole server, /health and SIGTERM included)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadRequest(f"{path} is not a regular file (a FIFO, device or socket); refusing to read it")
        return f.read()


def _on_daemon_thread(fn) -> asyncio.Future:
    """fn() on a new daemon thread, as a future of the running loop. For a call that may never
    return: torch's TCPStore client waits for the store's first reply with no timeout (torch 2.13),
    so a join to a listener that never answers would hold an executor's thread, and the process's
    exit, for good. Such a thread is left behind instead (one per --weight-sync-timeout-s at most,
    since joins go one at a time) until the listener closes its connection."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error):
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def run():
        try:
            result, error = fn(), None
        except Exception as e:
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop has closed meanwhile
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="weight-group-join", daemon=True).start()
    return future


def _generator_seed(sampling_seed: int) -> int:
    """A 64-bit generator seed that depends on every bit of the int64 `sampling_seed`: torch's CPU
    generator (mt19937) keeps only the low 32 bits of its seed, so 1, 2**32 + 1 and -2**63 + 1 would
    sample alike. Distinct seeds now collide only by chance (2**-32 for a pair, on CPU)."""
    digest = hashlib.blake2b(sampling_seed.to_bytes(8, "little", signed=True), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        # float32 on CPU: bf16 matmuls there are slow and their log-probs drift from the trainer's.
        return torch.float32 if device == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16, "half": torch.float16}[dtype]


def _parse_dtype(name) -> torch.dtype:
    name = name.removeprefix("torch.") if isinstance(name, str) else name
    if name not in WEIGHT_DTYPES:
        raise BadRequest(f"dtype {_short(name)} is not a weight dtype; use one of {list(WEIGHT_DTYPES)}")
    return getattr(torch, name)


# --- the server: event loop side ---

class Server:
    def __init__(self, args):
        self.args = args
        self.runner = Runner(args)
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model")
        self.tokenizer_worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        # Group joins and receives wait on the trainer: one at a time, never on the default executor,
        # which reads checkpoints (six joins to a listener that never answered once left
        # /update_weights_from_disk unanswered for 600 s). Receives run here; joins on their own thread.
        self.group_worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-group")
        self.group_op: str | None = None  # the one running, e.g. "joining group 'g' at host:port"
        self.weight_version = args.weight_version
        self.model_path = args.model_path
        self.waiting: list[Request] = []
        self.paused = False
        self.wakeup = asyncio.Event()
        self.idle = asyncio.Event()  # set whenever no step is in flight
        self.idle.set()
        self.groups: dict = {}
        self.released: set = set()  # memory tags released by /release_memory_occupation
        self.updates_pending = 0
        self.no_update = asyncio.Event()  # set while no weight update is pending
        self.no_update.set()

    async def run_on_worker(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    @contextlib.asynccontextmanager
    async def one_group_op(self, what: str):
        """Run the block as the only group operation (join or receive); a second one is refused
        with a 409 instead of waiting behind a trainer that may never come."""
        if self.group_op is not None:
            raise BadRequest(f"the server is already {self.group_op}; one weight-group operation at a time: "
                             f"retry when it ends (it gives up after --weight-sync-timeout-s "
                             f"{self.args.weight_sync_timeout_s} s)", 409)
        self.group_op = what
        try:
            yield
        finally:
            self.group_op = None

    # -- scheduler --
    async def scheduler(self):
        while True:
            aborted_waiting = [r for r in self.waiting if r.abort_message is not None]
            has_aborts = aborted_waiting or any(r.abort_message is not None for r in self.runner.rows)
            if not has_aborts and (self.paused or not (self.waiting or self.runner.rows)):
                self.wakeup.clear()
                try:
                    # Wake at least every second so per-request timeouts fire even when idle.
                    await asyncio.wait_for(self.wakeup.wait(), timeout=1.0)
                except asyncio.TimeoutError:
                    self._expire_waiting()
                continue
            admitted = aborted_waiting
            self.waiting = [r for r in self.waiting if r.abort_message is None]
            if not self.paused:
                admitted += self._admit()
            self.idle.clear()
            try:
                finished = await self.run_on_worker(self.runner.step, admitted, not self.paused)
            except Exception as e:  # last resort (Runner.step fails only the rows at fault): never hang
                logger.exception("model step failed")
                finished = admitted + self.runner.fail_all(f"model step failed: {e!r}")
                for r in admitted:
                    r.finish_reason = r.finish_reason or _abort_reason(f"model step failed: {e!r}")
            finally:
                self.idle.set()
            for r in finished:
                if not r.future.done():
                    r.future.set_result(r)
            for r in self.runner.rows + finished:
                if r.progress is not None:
                    r.visible = len(r.output_ids)
                    r.progress.set()
            await asyncio.sleep(0)  # let handlers enqueue newcomers between steps

    def _admit(self) -> list[Request]:
        room = self.args.max_running_requests - len(self.runner.rows)
        admitted, prefill_tokens = [], 0
        while self.waiting and len(admitted) < room:
            n = len(self.waiting[0].input_ids)
            if admitted and (len(admitted) + 1) * max(prefill_tokens, n) > self.args.max_prefill_tokens:
                break
            prefill_tokens = max(prefill_tokens, n)
            admitted.append(self.waiting.pop(0))
        return admitted

    def _expire_waiting(self):
        now = time.monotonic()
        for r in self.waiting:
            if r.abort_message is None and now > r.deadline_s:
                r.abort_message = f"request waited longer than --request-timeout-s {self.args.request_timeout_s}"
                self.wakeup.set()

    # -- /generate --
    async def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, computed on the tokenizer thread so that the event loop keeps
        answering; a text too long to fit the context whatever its tokens is refused untokenized."""
        limit = self.runner.max_prompt_chars
        for text in texts:
            if len(text) > limit:
                raise BadRequest(f"a text of {len(text)} characters cannot fit the model's context length "
                                 f"({self.runner.context_length} tokens); texts over {limit} characters are "
                                 f"refused without tokenizing")
        return await asyncio.get_running_loop().run_in_executor(
            self.tokenizer_worker, lambda: [self.runner.tokenizer(t)["input_ids"] for t in texts])

    async def build_requests(self, body: dict) -> tuple[list[Request], bool]:
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        if "text" in body and "input_ids" not in body and body["text"] is not None:
            text = body["text"]
            is_batch = isinstance(text, list)
            texts = text if is_batch else [text]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise BadRequest("text must be a string or a non-empty list of strings")
            batch = await self.tokenize(texts)
        elif body.get("input_ids") is not None:
            ids = body["input_ids"]
            is_batch = isinstance(ids, list) and len(ids) > 0 and isinstance(ids[0], list)
            batch = ids if is_batch else [ids]
        else:
            raise BadRequest("give input_ids (a list of token ids, or a list of such lists) or text")
        for ids in batch:
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise BadRequest("input_ids must be a list of integers or a list of lists of integers")
            if not ids:
                raise BadRequest("input_ids is empty; give at least one token")
            if min(ids) < 0 or max(ids) >= self.runner.vocab_size:
                raise BadRequest(f"input_ids holds a token id outside [0, {self.runner.vocab_size})")
            if len(ids) >= self.runner.context_length:
                raise BadRequest(f"The input ({len(ids)} tokens) is longer than the model's context length "
                                 f"({self.runner.context_length} tokens).")
        n = len(batch)
        extra_key = body.get("extra_key")  # SGLang's prefix-cache namespace; this server has no cache
        if not (extra_key is None or isinstance(extra_key, str) or (
                isinstance(extra_key, list) and len(extra_key) == n and all(isinstance(k, str) for k in extra_key))):
            raise BadRequest("extra_key must be a string, or a list of strings with one per input")
        raw_params = body.get("sampling_params")
        if isinstance(raw_params, list):
            if len(raw_params) != n:
                raise BadRequest(f"sampling_params is a list of {len(raw_params)}, input has {n} items")
        else:
            raw_params = [raw_params] * n
        params = [parse_sampling_params(p, self.runner.vocab_size) for p in raw_params]
        n_samples = params[0].n
        if any(p.n != n_samples for p in params):
            raise BadRequest("sampling_params.n must be the same for every item of a batch")
        rid = body.get("rid")
        if rid is None:
            rids = [uuid.uuid4().hex for _ in range(n)]
        elif is_batch and isinstance(rid, str):
            rids = [f"{rid}_{i}" for i in range(n)]
        elif is_batch:
            if not (isinstance(rid, list) and len(rid) == n and all(isinstance(x, str) for x in rid)):
                raise BadRequest("rid of a batch must be a string or a list of strings, one per input")
            rids = rid
        else:
            if not isinstance(rid, str):
                raise BadRequest("rid must be a string")
            rids = [rid]
        if n * n_samples > MAX_ITEMS_PER_CALL:
            raise BadRequest(f"{n * n_samples} generations in one call; at most {MAX_ITEMS_PER_CALL}, send several calls")
        if len(set(rids)) != len(rids):
            raise BadRequest("rid values must be unique within a batch")
        if n_samples > 1:  # SGLang: prompt-major copies with fresh rids, answered as a list
            batch = [ids for ids in batch for _ in range(n_samples)]
            params = [p for p in params for _ in range(n_samples)]
            raw_params = [raw for raw in raw_params for _ in range(n_samples)]
            rids = [uuid.uuid4().hex for _ in batch]
            is_batch = True
        flags = {}
        for name, types, default in (("return_logprob", bool, False), ("logprob_start_len", int, -1),
                                     ("return_text_in_logprobs", bool, False), ("stream", bool, False),
                                     ("top_logprobs_num", int, 0)):
            value = body.get(name, default)
            value = default if value is None else value
            if isinstance(value, list) and is_batch and name == "return_logprob":
                # one flag per item, as SGLang allows; this server takes them only when all agree
                value = value[0] if value and all(v == value[0] for v in value) else None
            if not isinstance(value, types) or (types is int and isinstance(value, bool)):
                raise BadRequest(f"{name} must be {types.__name__}, got {_short(value)}")
            flags[name] = value
        if flags["stream"] and is_batch:
            raise BadRequest("stream=true takes one prompt and n=1 in lib.cpu_server; send a batch without stream")
        if not 0 <= flags["top_logprobs_num"] <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {flags['top_logprobs_num']}")
        context = self.runner.context_length
        for ids, p, raw in zip(batch, params, raw_params):
            # SGLang's TokenizerManager._validate_one_request: a request whose explicit
            # max_new_tokens could outgrow the context is refused up front (unless the server allows
            # auto-truncation); the default max_new_tokens is only capped, as SGLang's scheduler does.
            explicit = (raw or {}).get("max_new_tokens") is not None
            if explicit and p.max_new_tokens + len(ids) > context and not self.args.allow_auto_truncate:
                raise BadRequest(
                    f"Requested token count exceeds the model's maximum context length of {context} tokens. "
                    f"You requested a total of {p.max_new_tokens + len(ids)} tokens: {len(ids)} tokens from the "
                    f"input messages and {p.max_new_tokens} tokens for the completion. Please reduce the number "
                    f"of tokens in the input messages or the completion to fit within the limit.")
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        requests = []
        for ids, p, r in zip(batch, params, rids):
            max_new = min(p.max_new_tokens, context - len(ids))
            req = Request(rid=r, input_ids=ids, params=p, return_logprob=flags["return_logprob"],
                          logprob_start_len=flags["logprob_start_len"],
                          return_text_in_logprobs=flags["return_text_in_logprobs"], max_new_tokens=max_new,
                          created_s=now, deadline_s=now + self.args.request_timeout_s, future=loop.create_future(),
                          top_logprobs_num=flags["top_logprobs_num"] if flags["return_logprob"] else 0,
                          progress=asyncio.Event() if flags["stream"] else None)
            if p.sampling_seed is not None:
                req.generator = torch.Generator(self.runner.device).manual_seed(_generator_seed(p.sampling_seed))
            requests.append(req)
        return requests, is_batch

    def response(self, r: Request, start: int = 0, upto: int | None = None, text: str | None = None,
                 final: bool = True) -> dict:
        """SGLang's answer for request `r`; for a streamed event, its output tokens [start, upto)
        (`completion_tokens` counts all up to `upto`), with `text`, and no finish_reason unless `final`."""
        upto = len(r.output_ids) if upto is None else upto
        meta = {
            "id": r.rid,
            "finish_reason": r.finish_reason if final else None,
            "prompt_tokens": len(r.input_ids),
            "weight_version": self.weight_version,
            "completion_tokens": upto,
            "cached_tokens": 0,
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "e2e_latency": time.monotonic() - r.created_s,
            "response_sent_to_client_ts": time.time(),
        }
        if r.return_logprob:
            token_text = (lambda t: self.runner.tokenizer.decode([t])) if r.return_text_in_logprobs else (lambda t: None)
            meta["input_token_logprobs"] = [[lp, t, token_text(t)] for lp, t, _ in r.input_logprobs] if start == 0 else []
            meta["output_token_logprobs"] = [[lp, t, token_text(t)] for lp, t in
                                             zip(r.output_logprobs[start:upto], r.output_ids[start:upto])]
            meta["output_token_logprobs_length"] = upto - start
            if r.top_logprobs_num:
                meta["output_top_logprobs"] = [[[lp, t, token_text(t)] for lp, t in best]
                                               for best in r.output_top_logprobs[start:upto]]
        return {"text": self.runner.output_text(r) if text is None else text, "output_ids": r.output_ids[start:upto],
                "meta_info": meta}

    async def stream(self, r: Request):
        """The events of a streamed request, as SGLang sends them: after each step that added
        tokens, the output so far (`--incremental-streaming-output`: only its new tokens and text),
        then the finished answer. A reader that stops (its client left) aborts the request."""
        incremental = self.args.incremental_streaming_output
        await self.no_update.wait()
        self.waiting.append(r)
        self.wakeup.set()
        sent, sent_text = 0, ""
        try:
            while not r.future.done():
                await r.progress.wait()
                r.progress.clear()
                upto = r.visible
                if upto > sent and not r.future.done():
                    text = self.runner.decode(r.output_ids[:upto], r.params)
                    yield self.response(r, sent if incremental else 0, upto,
                                        text[len(sent_text):] if incremental else text, final=False)
                    sent, sent_text = upto, text
            if incremental:
                yield self.response(r, sent, None, self.runner.output_text(r)[len(sent_text):])
            else:
                yield self.response(r)
        finally:
            if not r.future.done():  # the reader stopped: free its row
                r.abort_message = r.abort_message or "client disconnected"
                self.wakeup.set()

    @contextlib.asynccontextmanager
    async def exclusive_update(self, abort_all: bool):
        """SGLang's model_update_lock, writer side: unless generation is paused, requests already
        in flight finish first and new ones wait until the update is done, so every request is
        generated by one version of the weights."""
        self.updates_pending += 1
        self.no_update.clear()
        try:
            if abort_all:
                self.abort()
            while not self.paused and (self.runner.rows or self.waiting or not self.idle.is_set()):
                await asyncio.sleep(0.005)
            yield
        finally:
            self.updates_pending -= 1
            if self.updates_pending == 0:
                self.no_update.set()

    async def submit(self, requests: list[Request]) -> list[Request]:
        await self.no_update.wait()
        self.waiting.extend(requests)
        self.wakeup.set()
        try:
            return list(await asyncio.gather(*(r.future for r in requests)))
        except asyncio.CancelledError:  # the client went away: free its rows
            for r in requests:
                r.abort_message = r.abort_message or "client disconnected"
            self.wakeup.set()
            raise

    def abort(self, rid=None, message="Aborted") -> int:
        """Abort every request whose rid starts with `rid` (SGLang's scheduler matches by prefix,
        so a batch's base rid reaches all its items), or all requests when rid is None."""
        n = 0
        for r in self.waiting + self.runner.rows:
            if (rid is None or r.rid.startswith(rid)) and r.abort_message is None:
                r.abort_message = message
                n += 1
        self.wakeup.set()
        return n


# --- HTTP handlers ---

def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def _refuse_constant(name: str):
    raise BadRequest(f"{name} is not a JSON number; send finite numbers")


# UTF-8 cannot carry a surrogate, so only a JSON escape (\ud800) can put one into a string.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _check_unicode(body: dict):
    """A 400 naming the field of the first string that holds a lone surrogate (an escape not part of
    a pair): not text, it cannot be encoded to UTF-8, and the tokenizer raised on it (a 500)."""
    if found := lone_surrogate(body):
        field, text, at = found
        raise BadRequest(f"{field} holds a lone UTF-16 surrogate ({text[at]!r} at character {at}); send valid "
                         "Unicode text")


async def _json_body(request: web.Request, allow_empty: bool = True):
    raw = await read_body(request, max_body_bytes=request.app[MAX_BODY_BYTES], timeout_s=request.app[BODY_TIMEOUT_S],
                          too_large_hint="raise the server's --max-body-mb")
    body = parse_json_body(raw, allow_empty=allow_empty, parse_constant=_refuse_constant)
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):  # walked only then: a body of millions of token ids costs nothing extra
        _check_unicode(body)
    return body


async def _stream_events(request, events) -> web.StreamResponse:
    """Server-sent events, `data: {...}` each, then `data: [DONE]`, as SGLang streams /generate."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        async for event in events:
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:  # the client left: `events` was closed, which aborted its request
        pass
    finally:
        await events.aclose()
    return response


def _finish_even_if_client_leaves(handler):
    """A client that disconnects cancels its handler (handler_cancellation), which frees the rows
    of a /generate; a pause, weight update or group join must instead finish, or fail, as a whole
    (a cancelled pause would also cancel the other clients' futures it waits on)."""
    async def shielded(request):
        return await asyncio.shield(handler(request))
    return shielded


def build_app(server: Server) -> web.Application:
    app = web.Application(client_max_size=int(server.args.max_body_mb * 2**20),
                          middlewares=[errors_as_json(_error, logger)])
    app[MAX_BODY_BYTES] = int(server.args.max_body_mb * 2**20)
    app[BODY_TIMEOUT_S] = server.args.body_timeout_s
    runner = server.runner

    async def generate(request):
        body = await _json_body(request, allow_empty=False)
        if server.released:
            raise BadRequest(f"the server's memory is released ({sorted(server.released)}); "
                             f"call /resume_memory_occupation first")
        requests, is_batch = await server.build_requests(body)
        if requests[0].progress is not None:
            return await _stream_events(request, server.stream(requests[0]))
        done = await server.submit(requests)
        out = [server.response(r) for r in done]
        return web.json_response(out if is_batch else out[0])

    async def health(request):
        return web.Response(status=200)

    async def health_generate(request):
        req, _ = await server.build_requests({"input_ids": [runner.pad_token_id],
                                              "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        try:
            await asyncio.wait_for(asyncio.shield(server.submit(req)), timeout=server.args.health_timeout_s)
        except asyncio.TimeoutError:
            req[0].abort_message = "health check timed out"
            server.wakeup.set()
            return _error(503, f"a 1-token generation did not finish within {server.args.health_timeout_s} s"
                               + (" (generation is paused)" if server.paused else ""))
        return web.Response(status=200)

    async def get_model_info(request):
        return web.json_response({"model_path": server.model_path,
                                  "tokenizer_path": server.args.tokenizer_path or server.args.model_path,
                                  "is_generation": True, "preferred_sampling_params": None,
                                  "weight_version": server.weight_version, "has_image_understanding": False,
                                  "has_audio_understanding": False, "model_type": runner.model.config.model_type,
                                  "architectures": getattr(runner.model.config, "architectures", None)})

    async def get_server_info(request):
        info = {k: v for k, v in vars(server.args).items()}
        info.update(runner.stats)
        info.update({"model_path": server.model_path, "weight_version": server.weight_version,
                     "context_length": runner.context_length, "version": "lib.cpu_server",
                     "num_running_requests": len(runner.rows), "num_waiting_requests": len(server.waiting),
                     "paused": server.paused, "internal_states": [dict(runner.stats)]})
        return web.json_response(info)

    async def flush_cache(request):
        # No prefix cache here, so there is nothing to flush; answered as SGLang answers (plain
        # text; refused while requests are running or waiting, as SGLang's scheduler does).
        if runner.rows or server.waiting:
            return web.Response(status=400, text="Cache not flushed because there are pending requests. "
                                                 f"#queue-req: {len(server.waiting)}, #running-req: {len(runner.rows)}\n")
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation will not be performed.)\n")

    async def pause_generation(request):
        body = await _json_body(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise BadRequest(f"mode must be 'abort', 'in_place' or 'retract', got {mode!r}")
        server.paused = True
        if mode == "abort":
            # Requests sent from now on wait for /continue_generation; only these are aborted.
            in_flight = server.waiting + server.runner.rows
            server.abort()
            await asyncio.gather(*(r.future for r in in_flight))
        # Return only once no forward is in flight, so a weight update that follows never
        # overlaps a step.
        while not server.idle.is_set():
            await asyncio.sleep(0.005)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(request):
        await _json_body(request)
        server.paused = False
        server.wakeup.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(request):
        body = await _json_body(request)
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(abort_all, bool) or not isinstance(rid, (str, type(None))):
            raise BadRequest("abort_request takes {'rid': str, 'abort_all': bool}")
        if abort_all:
            server.abort()
        elif rid:
            server.abort(rid)
        return web.Response(status=200)

    async def update_weights_from_disk(request):
        body = await _json_body(request, allow_empty=False)
        path = _field(body, "model_path", str, required=True)
        version = _field(body, "weight_version", str)
        abort_all = _field(body, "abort_all_requests", bool, False)
        t0 = time.monotonic()
        try:
            # Read and checked on an executor thread while requests carry on; only the copy waits
            # for in-flight requests, and it starts once the whole checkpoint has passed the checks.
            named = await asyncio.get_running_loop().run_in_executor(None, runner.read_checkpoint, path)
            async with server.exclusive_update(abort_all):
                await server.run_on_worker(runner.copy_named_tensors, named)
        except Exception as e:  # as SGLang: any failed load is a 400 with success false, old weights kept
            logger.warning("update_weights_from_disk(%r) failed: %r", path, e)
            return web.json_response({"success": False, "message": f"Failed to update weights: {e}",
                                      "num_paused_requests": 0}, status=400)
        server.model_path = path
        if version is not None:
            server.weight_version = version
        return web.json_response({"success": True, "num_paused_requests": 0,
                                  "message": f"Succeeded to update model weights in {time.monotonic() - t0:.2f} s."})

    async def init_weights_update_group(request):
        body = await _json_body(request, allow_empty=False)
        try:
            addr, port = body["master_address"], body["master_port"]
            rank_offset, world_size = body["rank_offset"], body["world_size"]
        except KeyError as e:
            raise BadRequest(f"missing field {e.args[0]!r}; need master_address, master_port, rank_offset, "
                             f"world_size (and optionally group_name, backend)")
        if not isinstance(addr, str) or not addr:
            raise BadRequest(f"master_address must be a non-empty string, got {_short(addr)}")
        port = _number("master_port", port, int, 1, 65535)
        world_size = _number("world_size", world_size, int, 2, MAX_WORLD_SIZE)
        # Rank 0 is the trainer, the source of every broadcast: a server there would "receive" its
        # own uninitialised buffers. This server is one rank, so it must also be below world_size.
        rank_offset = _number("rank_offset (rank 0 is the trainer)", rank_offset, int, 1, world_size - 1)
        group_name = _field(body, "group_name", str, "weight_update_group")
        backend = _field(body, "backend", str, "nccl")
        if not group_name:
            raise BadRequest("group_name must be a non-empty string")
        if backend not in ("nccl", "gloo"):
            raise BadRequest(f"backend must be 'nccl' or 'gloo', got {_short(backend)}")
        if group_name in server.groups:
            return web.json_response({"success": False, "message": f"group {group_name!r} already exists; "
                                      f"destroy it first"}, status=400)
        if backend == "nccl" and runner.device.type == "cpu":
            backend = "gloo"  # NCCL cannot move CPU tensors; a CPU server always takes part over gloo.
        from lib.process_group import destroy_custom_process_group, init_custom_process_group

        timeout_s = server.args.weight_sync_timeout_s
        async with server.one_group_op(f"joining group {group_name!r} at {addr}:{port}"):
            # Blocks until the trainer joins, off the event loop and off the model thread. torch's own
            # timeout does not cover the store's first reply, so the wait is bounded here too.
            joined = _on_daemon_thread(lambda: init_custom_process_group(
                backend, f"tcp://{addr}:{port}", world_size, rank_offset, group_name, timeout_s=timeout_s))
            try:
                server.groups[group_name] = await asyncio.wait_for(asyncio.shield(joined), timeout_s)
            except asyncio.TimeoutError:
                def leave_late_group(done):  # a join that succeeds after we answered must not stay
                    if done.exception() is None:
                        destroy_custom_process_group(done.result())
                joined.add_done_callback(leave_late_group)
                return web.json_response({"success": False, "message": f"Failed to initialize custom process group: "
                                          f"nothing at {addr}:{port} answered as the trainer's store within "
                                          f"--weight-sync-timeout-s {timeout_s} s."}, status=400)
            except Exception as e:
                return web.json_response({"success": False,
                                          "message": f"Failed to initialize custom process group: {e}."}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def update_weights_from_distributed(request):
        body = await _json_body(request, allow_empty=False)
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        group_name = _field(body, "group_name", str, "weight_update_group")
        load_format = _field(body, "load_format", str)
        version = _field(body, "weight_version", str)
        abort_all = _field(body, "abort_all_requests", bool, False)
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes)):
            raise BadRequest("names, dtypes and shapes must be lists of equal length")
        if load_format not in (None, "flattened_bucket"):
            raise BadRequest(f"load_format {_short(load_format)} is not supported; use null or 'flattened_bucket'")
        if not all(isinstance(n, str) for n in names):
            raise BadRequest("names must be strings (Hugging Face state-dict names)")
        if not all(isinstance(s, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in s) for s in shapes):
            raise BadRequest("shapes must be lists of integers")
        torch_dtypes = [_parse_dtype(d) for d in dtypes]
        if group_name not in server.groups:
            return web.json_response({"success": False, "message": f"Group {group_name} not in "
                                      f"{list(server.groups)}. Please call `init_weights_update_group` first."},
                                     status=400)
        try:  # everything is checked before the first byte is received
            runner.check_named_shapes(names, shapes)
        except BadRequest as e:
            return web.json_response({"success": False, "message": f"Failed to update parameter online: {e}."},
                                     status=400)
        pg = server.groups[group_name]

        def receive():
            import torch.distributed as dist

            device = runner.device
            if load_format == "flattened_bucket":
                # SGLang's FlattenedTensorBucket: each tensor's bytes (tensor.flatten().view(uint8)),
                # concatenated in order, sent as one uint8 broadcast; mixed dtypes allowed.
                nbytes = [math.prod(s) * torch.empty(0, dtype=d).element_size() for s, d in zip(shapes, torch_dtypes)]
                flat = torch.empty(sum(nbytes), dtype=torch.uint8, device=device)
                dist.broadcast(flat, src=0, group=pg)
                # clone: a slice's byte offset need not be aligned to its dtype, which view(dtype) requires
                return [(n, part.clone().view(d).view(s)) for n, part, d, s in zip(names, flat.split(nbytes), torch_dtypes, shapes)]
            tensors = [torch.empty(s, dtype=d, device=device) for s, d in zip(shapes, torch_dtypes)]
            handles = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in tensors]
            for h in handles:
                h.wait()
            return list(zip(names, tensors))
        async with server.one_group_op(f"receiving {len(names)} tensors on group {group_name!r}"):
            try:
                async with server.exclusive_update(abort_all):
                    # Received off the model thread (paused in-place rows and the event loop carry on),
                    # then copied in one go between steps: no forward ever sees half-updated weights.
                    named = await asyncio.get_running_loop().run_in_executor(server.group_worker, receive)
                    await server.run_on_worker(runner.copy_named_tensors, named)
            except Exception as e:
                return web.json_response({"success": False, "message": f"Failed to update parameter online: {e}."},
                                         status=400)
        if version is not None:
            server.weight_version = version
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def destroy_weights_update_group(request):
        body = await _json_body(request, allow_empty=False)
        group_name = _field(body, "group_name", str, "weight_update_group")
        pg = server.groups.pop(group_name, None)
        if pg is None:
            return web.json_response({"success": False, "message": "The group to be destroyed does not exist."},
                                     status=400)
        from lib.process_group import destroy_custom_process_group

        await asyncio.get_running_loop().run_in_executor(None, destroy_custom_process_group, pg)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def update_weights_from_tensor(request):
        from lib.tensor_ipc import PayloadError, load_named_tensors

        body = await _json_body(request, allow_empty=False)
        entries = body.get("serialized_named_tensors")
        version = _field(body, "weight_version", str)
        abort_all = _field(body, "abort_all_requests", bool, False)
        _field(body, "flush_cache", bool, True)  # no prefix cache: checked, nothing to flush
        if _field(body, "load_format", str) is not None:
            raise BadRequest("load_format is not supported here; send null (lib.tensor_ipc's payload)")
        if not (isinstance(entries, list) and entries and all(isinstance(e, str) for e in entries)):
            raise BadRequest("serialized_named_tensors must be a non-empty list of base64 strings, one per TP rank")

        def load():  # opening shared memory / IPC handles: off the event loop
            named = load_named_tensors(entries[0], int(server.args.max_body_mb * 2**20))
            runner.check_named_shapes([n for n, _ in named], [list(t.shape) for _, t in named])
            for name, tensor in named:
                if not tensor.is_floating_point():
                    raise BadRequest(f"{name!r} was sent as {tensor.dtype}; weights are floating point")
            return named
        try:
            named = await asyncio.get_running_loop().run_in_executor(None, load)
            async with server.exclusive_update(abort_all):
                await server.run_on_worker(runner.copy_named_tensors, named)
        except (BadRequest, PayloadError) as e:  # checked before any weight changed
            return web.json_response({"success": False, "message": f"Failed to update weights: {e}"}, status=400)
        del named  # the trainer's memory is only borrowed until we answer
        if version is not None:
            server.weight_version = version
        return web.json_response({"success": True, "message": "Success"})

    def _memory_tags(body) -> set:
        tags = body.get("tags") if isinstance(body, dict) else None
        if tags is None:
            return set(MEMORY_TAGS)
        if not (isinstance(tags, list) and all(t in MEMORY_TAGS for t in tags)):
            raise BadRequest(f"tags must be null or a list of {list(MEMORY_TAGS)}, got {_short(tags)}")
        return set(tags)

    async def release_memory_occupation(request):
        tags = _memory_tags(await _json_body(request))
        if runner.rows or server.waiting:
            raise BadRequest(f"requests are running ({len(runner.rows)}) or waiting ({len(server.waiting)}); "
                             f"pause generation (mode abort) before releasing memory")
        server.released |= tags
        return web.json_response(None)

    async def resume_memory_occupation(request):
        server.released -= _memory_tags(await _json_body(request))
        return web.json_response(None)

    async def update_weight_version(request):
        body = await _json_body(request, allow_empty=False)
        version = _field(body, "new_version", str)
        if not version:
            raise BadRequest("new_version (a non-empty string) is required")
        if _field(body, "abort_all_requests", bool, True):
            server.abort()
        server.weight_version = version
        return web.json_response({"success": True, "message": f"Weight version updated to {version}",
                                  "new_version": version})

    async def on_startup(app):
        app[SCHEDULER_TASK] = asyncio.create_task(server.scheduler())

    async def on_cleanup(app):
        app[SCHEDULER_TASK].cancel()
        for executor in (server.worker, server.tokenizer_worker, server.group_worker):
            executor.shutdown(wait=False, cancel_futures=True)

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    r = app.router
    r.add_post("/generate", generate)
    r.add_put("/generate", generate)
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    r.add_get("/get_model_info", get_model_info)
    r.add_get("/model_info", get_model_info)
    r.add_get("/get_server_info", get_server_info)
    r.add_get("/server_info", get_server_info)
    r.add_post("/update_weight_version", update_weight_version)
    r.add_route("*", "/flush_cache", flush_cache)
    r.add_post("/pause_generation", _finish_even_if_client_leaves(pause_generation))
    r.add_post("/continue_generation", continue_generation)
    r.add_post("/abort_request", abort_request)
    r.add_post("/update_weights_from_disk", _finish_even_if_client_leaves(update_weights_from_disk))
    r.add_post("/init_weights_update_group", _finish_even_if_client_leaves(init_weights_update_group))
    r.add_post("/update_weights_from_distributed", _finish_even_if_client_leaves(update_weights_from_distributed))
    r.add_post("/destroy_weights_update_group", _finish_even_if_client_leaves(destroy_weights_update_group))
    r.add_post("/update_weights_from_tensor", _finish_even_if_client_leaves(update_weights_from_tensor))
    r.add_route("*", "/release_memory_occupation", release_memory_occupation)
    r.add_route("*", "/resume_memory_occupation", resume_memory_occupation)
    return app


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="HF-format model directory")
    p.add_argument("--tokenizer-path", default=None, help="defaults to --model-path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="cpu", help="cpu or cuda (or cuda:N)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
                   help="auto: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--max-running-requests", type=int, default=32, help="rows decoded together at most")
    p.add_argument("--max-prefill-tokens", type=int, default=16384,
                   help="bound on (rows x padded length) of one prefill forward; one request always fits")
    p.add_argument("--context-length", type=int, default=None, help="defaults to max_position_embeddings")
    p.add_argument("--allow-auto-truncate", action="store_true",
                   help="cap max_new_tokens so prompt + output fits the context (finish_reason length) "
                        "instead of refusing the request with a 400, as SGLang does by default")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--weight-version", default="default", help="initial weight_version reported in meta_info")
    p.add_argument("--request-timeout-s", type=float, default=3600.0,
                   help="a request still running after this long is aborted (finish_reason abort)")
    p.add_argument("--max-body-mb", type=float, default=64.0, help="larger request bodies get a 413")
    p.add_argument("--body-timeout-s", type=float, default=60.0,
                   help="a request body not fully received this long after its headers gets a 408")
    p.add_argument("--health-timeout-s", type=float, default=20.0)
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="a streamed /generate sends each step's new tokens and text only (SGLang's flag); "
                        "default: the output so far, as SGLang does")
    p.add_argument("--weight-sync-timeout-s", type=float, default=600.0,
                   help="how long /init_weights_update_group and collectives wait for the trainer")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.random_seed)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    server = Server(args)
    logger.info("serving %s on http://%s:%d (device %s, dtype %s, context %d)", args.model_path, args.host,
                args.port, args.device, server.runner.dtype, server.runner.context_length)
    # handler_cancellation: a client that disconnects cancels its handler, so its rows are freed
    web.run_app(build_app(server), host=args.host, port=args.port, print=None, access_log=None,
                handler_cancellation=True)


if __name__ == "__main__":
    main()
