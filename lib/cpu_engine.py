"""The engine of lib/cpu_server.py: a transformers model that batches concurrent requests, samples
them as SGLang does and takes weight updates, behind an asyncio scheduler (`Server`) that the HTTP
handlers hand requests to.

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
"""
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import reprlib
import stat
import time
import uuid

import torch

from lib.http_body import BadRequest
from lib.lora_serving import ServedAdapters

logger = logging.getLogger("cpu_server")

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


def short_repr(value) -> str:
    """repr of a client's value for an error message, cut to a readable length."""
    return reprlib.repr(value)


def checked_number(field: str, value, kind: type, low, high, low_open: bool = False):
    """`value` as `kind` (int, or float which also takes ints) if it lies in [low, high] (or
    (low, high] when low_open); otherwise a 400 that names the field and the allowed range.
    Booleans are not numbers here, and NaN and infinities are never in range."""
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise BadRequest(f"{field} must be {'a number' if kind is float else 'an integer'}, got {short_repr(value)}")
    in_range = (low < value if low_open else low <= value) and value <= high
    if not in_range or (isinstance(value, float) and not math.isfinite(value)):
        raise BadRequest(f"{field} must be in {'(' if low_open else '['}{low}, {high}], got {short_repr(value)}")
    return kind(value)


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
    return checked_number("sampling_params.top_k (or -1 for the whole vocabulary)", value, int, 1, vocab_size)


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
                raise BadRequest(f"sampling_params.{name}={short_repr(value)} is not supported by lib.cpu_server; "
                                 f"leave it at {_ONLY_DEFAULT[name]!r} or use SGLang")
            continue
        if name not in known:
            raise BadRequest(f"unknown sampling parameter {short_repr(name)}; known: {sorted(known | set(_ONLY_DEFAULT))}")
        if value is None:
            continue
        field = f"sampling_params.{name}"
        if name in ("max_new_tokens", "min_new_tokens"):
            value = checked_number(field, value, int, 0, MAX_NEW_TOKENS)
        elif name == "n":  # prompts x n is bounded by MAX_ITEMS_PER_CALL, once the prompts are known
            value = checked_number(field, value, int, 1, INT64_MAX)
        elif name == "sampling_seed":
            value = checked_number(field, value, int, INT64_MIN, INT64_MAX)
        elif name == "top_k":
            value = _top_k(value, vocab_size)
        elif name == "temperature":
            value = checked_number(field, value, float, 0.0, MAX_TEMPERATURE)
        elif name == "top_p":
            value = checked_number(field, value, float, 0.0, 1.0, low_open=True)
        elif name == "min_p":
            value = checked_number(field, value, float, 0.0, 1.0)
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
    input_top_logprobs: list = dataclasses.field(default_factory=list)  # per prompt token from logprob_start_len; None first
    # Streamed requests (stream: true): set by the scheduler after each step that may have added tokens,
    # with `visible` the number of output tokens complete at that moment (read on the event loop).
    progress: asyncio.Event | None = None
    visible: int = 0
    adapter: object = None  # the lib.lora_serving.Adapter it is generated with (`lora_path`), None = the base model


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
        self.adapters = ServedAdapters(self.model)  # LoRA adapters by name (lib/lora_serving.py)
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
                    r.input_top_logprobs = []
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

    def _forward(self, input_ids, attention_mask, position_ids, cache, logits_to_keep, reqs):
        self.stats["num_forward_batches"] += 1
        self.stats["max_batch_size_seen"] = max(self.stats["max_batch_size_seen"], input_ids.shape[0])
        with self.adapters.applied([r.adapter for r in reqs]):  # row i under reqs[i]'s LoRA adapter, if any
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
        logits, cache = self._forward(input_ids, mask, position_ids, None, 0 if want_input_logprobs else 1, reqs)
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
        if req.top_logprobs_num:  # the most likely tokens at each prompt position, by the same log-probs
            start = max(req.logprob_start_len, 1)
            values, top_ids = logprobs[start - 1:len(ids) - 1].topk(min(req.top_logprobs_num, logprobs.shape[1]), dim=-1)
            req.input_top_logprobs = [None] * (start - req.logprob_start_len) + [
                list(zip(v, i)) for v, i in zip(values.tolist(), top_ids.tolist())]

    def _decode(self) -> list[Request]:
        self.stats["num_decode_batches"] += 1
        ones = torch.ones((len(self.rows), 1), dtype=self.attention_mask.dtype, device=self.device)
        self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)
        position_ids = self.attention_mask.sum(-1, keepdim=True) - 1
        logits, self.cache = self._forward(self.next_token_ids[:, None], self.attention_mask, position_ids,
                                           self.cache, 1, self.rows)
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
                    raise BadRequest(f"{path} has tensor {short_repr(name)} which the served model lacks; "
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
                raise BadRequest(f"the served model has no parameter {short_repr(name)}")
            if shape != self.param_shapes[name]:
                raise BadRequest(f"{name!r} was sent with shape {short_repr(shape)}, the served model has "
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
        raise BadRequest(f"model_path {short_repr(model_path)} is not a directory; give the directory that "
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
        # SGLang's `lora_path`: the name of a loaded adapter (or null), one for all inputs or one per input
        lora = body.get("lora_path")
        if isinstance(lora, list) and not (is_batch and len(lora) == n):
            raise BadRequest(f"lora_path is a list of {len(lora)}; give one name per input ({n}) or one name for all")
        adapters = [self.runner.adapters.lookup(name) for name in (lora if isinstance(lora, list) else [lora] * n)]
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
            adapters = [a for a in adapters for _ in range(n_samples)]
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
                raise BadRequest(f"{name} must be {types.__name__}, got {short_repr(value)}")
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
        for ids, p, r, adapter in zip(batch, params, rids, adapters):
            max_new = min(p.max_new_tokens, context - len(ids))
            req = Request(rid=r, input_ids=ids, params=p, return_logprob=flags["return_logprob"],
                          logprob_start_len=flags["logprob_start_len"],
                          return_text_in_logprobs=flags["return_text_in_logprobs"], max_new_tokens=max_new,
                          created_s=now, deadline_s=now + self.args.request_timeout_s, future=loop.create_future(),
                          top_logprobs_num=flags["top_logprobs_num"] if flags["return_logprob"] else 0,
                          progress=asyncio.Event() if flags["stream"] else None, adapter=adapter)
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
                meta["input_top_logprobs"] = [None if best is None else [[lp, t, token_text(t)] for lp, t in best]
                                              for best in r.input_top_logprobs] if start == 0 else []
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
