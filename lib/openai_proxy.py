"""An OpenAI-compatible chat server in front of `lib.client.InferenceClient` that records, token by
token, what the policy sampled: agents written with the `openai` SDK, LangChain or LangGraph are
trained unchanged.

    proxy = OpenAIProxy(client, tokenizer, stop_token_ids=eos_ids)
    await proxy.start()                                   # http://127.0.0.1:PORT/v1, on the running loop
    key = proxy.new_session()                             # one episode = one session = one API key
    agent = AsyncOpenAI(base_url=proxy.url, api_key=key)  # the agent's own code, unchanged
    # (or http_client=proxy.http_client(): the same requests handed over in-process, no socket)
    ...
    episode = proxy.end_session(key)                      # {"segments": [trajectory, ...], "reward": ..., stats}

Endpoints: `POST /v1/chat/completions` (plain and `stream: true` server-sent events), `GET
/v1/models`, and `POST /agentrl/reward {"reward": x}` for agents that score themselves (the
session's key as the API key). Every bad request gets a 4xx in OpenAI's error shape, naming the
field; nothing about a session changes on a rejected request.

Recording (docs/openai_proxy.md): a request whose messages extend an earlier request of the session
(its messages, then the assistant reply the proxy gave, then new messages) continues that
request's tokens: the sampled tokens stay as they were, only the new messages are tokenized
(lib/chat_format.py) and appended with loss_mask 0. A request that does not extend one (the agent
rewrote its history, changed its tools, or asked twice from the same point) starts a new segment,
rendered by the chat template, where only the new reply is trained on. So every sampled token is in
exactly one segment with loss_mask 1 and the log-prob the server reported for it. Each segment is a
training sequence with the episode's reward. A turn is recorded only as its answer is handed to the
client: a client that disconnects cancels its generation, and a reply that fails to build is a 500
that records nothing (docs/reliability.md has the limits on hostile requests).
"""
import asyncio
import json
import math
import os
import sys
import time
import uuid

import torch
from aiohttp import web

from lib.chat_format import (LONE_SURROGATE, LONG_TEXT_CHARS, ChatFormatError, PromptTooLong, continuation_ids,
                             end_of_turn_token, message_key, parse_tool_calls, render_ids,
                             template_renders_tools, to_template_messages)
from lib.client import GenerationAborted, InferenceServerError
from lib.http_body import BadRequest, body_too_large, lone_surrogate, parse_json_body, read_body

# Fields of a chat completion request: read, ignored (harmless for sampling), or refused with a
# 400 unless they hold their neutral value.
_READ = {"model", "messages", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "seed", "n",
         "stream", "stream_options", "tools", "tool_choice", "logprobs", "top_logprobs"}
_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
            "safety_identifier"}
_NEUTRAL = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},),
            "response_format": ({"type": "text"},), "functions": (), "function_call": (), "reasoning_effort": (),
            "modalities": (["text"],), "audio": (), "prediction": (), "web_search_options": ()}


class SessionFailed(RuntimeError):
    """A generation of the session failed (an abort that was not a pause, a server error): its
    episode is not what the policy would have written, so it must not be trained on."""


class _Segment:
    def __init__(self, ids, mask, logprobs, versions):
        self.ids, self.mask, self.logprobs, self.versions = ids, mask, logprobs, versions
        # After each reply: (message keys through the reply, tools key, token count, closed by a stop token)
        self.states: list[tuple[tuple, str, int, bool]] = []
        self.busy = False  # a request is generating on it: a concurrent one forks instead


class _Session:
    def __init__(self, key: str):
        self.key = key
        self.segments: list[_Segment] = []
        self.reward = None
        self.error = None
        self.stats = {"requests": 0, "completion_tokens": 0, "tool_calls": 0, "tool_call_parse_failures": 0,
                      "length_cut": 0, "new_segments": 0}


def _error(status: int, message: str, *, param: str | None = None, code: str | None = None) -> tuple[int, dict]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


_TOO_LARGE_HINTS = {"/v1/chat/completions": "shorten the conversation", "/agentrl/reward": "send {\"reward\": x}"}
_EVENT_STREAM_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class _Refused(BadRequest):
    """lib.http_body's BadRequest with the two fields OpenAI's error shape adds: the request field at
    fault and an error code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message, status)
        self.param, self.code = param, code


def sdk_aiohttp_client():
    """The openai SDK's aiohttp transport (`DefaultAioHttpClient`, the `openai[aiohttp]` extra) for an
    agent's client of this proxy, or None (the SDK's default httpx client) where the SDK lacks it.
    The httpx pool walks every pooled connection on each request, and holds one per concurrent
    episode: about twice the CPU per request (docs/benchmarks.md). Build it on the event loop the
    agents run on."""
    try:
        from openai import DefaultAioHttpClient
        return DefaultAioHttpClient()
    except (ImportError, RuntimeError):  # an SDK before 1.9x, or without the aiohttp extra
        print("the openai SDK's aiohttp client needs `pip install 'openai[aiohttp]'`; using its httpx client "
              "(slower: docs/benchmarks.md)")
        return None


class _InProcessTransport:
    """An httpx transport (the one under the openai SDK's client) that answers from the proxy's
    handlers: OpenAIProxy.http_client()."""

    def __init__(self, proxy: "OpenAIProxy"):
        self.proxy = proxy

    async def handle_async_request(self, request):
        httpx = sys.modules[type(request).__module__.split(".")[0]]  # httpx, or the SDK's fork of it (httpx2)
        raw = await request.aread()
        if len(raw) > self.proxy.max_body_bytes:
            refused = body_too_large(self.proxy.max_body_bytes, _TOO_LARGE_HINTS.get(request.url.path, ""))
            (status, payload), record = _error(refused.status, str(refused)), None
        else:
            # The SDK's `timeout` travels in the request (a socket transport enforces it while reading the
            # answer): past it, the answer is given up (its generation cancelled, nothing recorded) and
            # the SDK sees the timeout its retries expect.
            read_timeout_s = (request.extensions.get("timeout") or {}).get("read")
            try:
                status, payload, record = await asyncio.wait_for(
                    self.proxy._answer(request.method, request.url.path, request.headers.get("Authorization", ""),
                                       raw), read_timeout_s)
            except asyncio.TimeoutError:
                raise httpx.ReadTimeout(f"the proxy did not answer within {read_timeout_s} s", request=request) from None
        events = isinstance(payload, bytes)
        response = httpx.Response
        response = response(status, request=request, content=payload if events else json.dumps(payload).encode(),
                            headers={"Content-Type": "text/event-stream" if events else "application/json; charset=utf-8"})
        if record is not None:
            record()  # handed over: the caller gets this response with nothing awaited in between
        return response

    async def aclose(self):
        pass


class OpenAIProxy:
    def __init__(self, client, tokenizer, *, stop_token_ids: list[int] | None = None, model_name: str = "policy",
                 max_context_tokens: int | None = None, default_max_tokens: int = 1024, chat_template: str | None = None,
                 host: str = "127.0.0.1", port: int = 0, max_body_bytes: int = 32 << 20, body_timeout_s: float = 30.0):
        """`stop_token_ids`: ids that end a turn (the model's EOS set, lib.client.model_eos_ids).
        `max_context_tokens`: a session's prompt + reply budget; a request past it gets OpenAI's
        400 `context_length_exceeded` and `max_tokens` is cut to what is left. `chat_template`
        overrides the tokenizer's; one without a tools section gets tools written into the messages'
        text (lib/chat_format.py, with_tools_as_text)."""
        # The proxy tokenizes a short text on the event loop and a long one on a thread of its own; the
        # Rust tokenizer's thread pool would only compete with the trainer and a CPU server for cores
        # (docs/benchmarks.md).
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.client, self.tokenizer = client, tokenizer
        self.model_name = model_name
        self.max_context_tokens = max_context_tokens
        self.default_max_tokens = default_max_tokens
        self.chat_template = chat_template
        self.end_of_turn, self.end_of_turn_id = end_of_turn_token(tokenizer, chat_template)
        self.tools_as_text = not template_renders_tools(tokenizer, chat_template)
        self.stop_token_ids = sorted(set(stop_token_ids or []) | {self.end_of_turn_id})
        # A token covers at most as many characters as its vocabulary entry has (byte-level BPE entries
        # have one character per byte), so a conversation longer than budget x the longest entry cannot
        # fit: it is refused before the template renders it (x2 leaves room for JSON's escapes, templates
        # and normalizers that drop characters), as lib/cpu_server.py refuses a long text. Without a
        # budget, the tokenizer's model_max_length bounds it (HF's "unknown" is 1e30).
        self.char_budget_tokens = max_context_tokens or (
            tokenizer.model_max_length if tokenizer.model_max_length < 1 << 31 else None)
        self.max_prompt_chars = (None if self.char_budget_tokens is None else
                                 2 * self.char_budget_tokens * max(map(len, tokenizer.get_vocab())))
        self.host, self.port = host, port
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s
        self.sessions: dict[str, _Session] = {}
        self.url = ""
        self._runner = None

    # --- lifecycle, on the event loop the client runs on ---
    async def start(self) -> str:
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self._http)
        app.router.add_get("/v1/models", self._http)
        app.router.add_post("/agentrl/reward", self._http)
        # handler_cancellation: a client that disconnects cancels its handler, and with it the request to
        # the inference server (which then aborts it: SGLang and lib/cpu_server.py do), instead of
        # generating a turn nobody receives.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{self.port}/v1"
        return self.url

    async def close(self):
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def http_client(self):
        """An HTTP client for the openai SDK that hands its requests to this proxy in the same
        process, with no socket between them: `AsyncOpenAI(base_url=proxy.url, api_key=key,
        http_client=proxy.http_client())`. Everything else is as over HTTP (the SDK builds and parses
        the same requests and replies; the proxy answers them with the same code); what goes is the
        HTTP framing on both sides, 0.3-0.45 ms of CPU per request, though not rollout time on the
        embedded default (docs/benchmarks.md). Only for agents on the event loop the proxy runs on."""
        from openai import DefaultAsyncHttpxClient

        return DefaultAsyncHttpxClient(transport=_InProcessTransport(self))

    # --- sessions ---
    def new_session(self) -> str:
        """A new episode's key: hand it to the agent as its API key."""
        key = "agentrl-" + uuid.uuid4().hex
        self.sessions[key] = _Session(key)
        return key

    def end_session(self, key: str) -> dict:
        """The episode: `segments` (trajectory dicts of [1, T] tensors: input_ids, loss_mask,
        logprobs, versions, attention_mask; segments without a sampled token are left out), the
        `reward` posted to /agentrl/reward (None if none was) and the session's counts. Raises
        SessionFailed if a generation of the session failed."""
        session = self.sessions.pop(key)
        self.client.end_trajectory(key)
        if session.error is not None:
            raise SessionFailed(f"a generation of session {key} failed: {session.error}")
        t = lambda xs, dtype: torch.tensor([xs], dtype=dtype)  # noqa: E731
        segments = [{"input_ids": t(s.ids, torch.long), "loss_mask": t(s.mask, torch.long),
                     "logprobs": t(s.logprobs, torch.float32), "versions": t(s.versions, torch.long),
                     "attention_mask": torch.ones(1, len(s.ids), dtype=torch.long)}
                    for s in session.segments if any(s.mask)]
        return {"segments": segments, "reward": session.reward, **session.stats}

    # --- handlers: an answer is (status, a JSON object | server-sent events as bytes, record), whichever transport ---
    def _session_of(self, authorization: str) -> _Session:
        key = authorization[7:].strip() if authorization[:7].lower() == "bearer " else ""
        session = self.sessions.get(key)
        if session is None:
            raise _Refused(401, "unknown or missing API key: use the key of a live session (proxy.new_session())",
                           code="invalid_api_key")
        return session

    async def _http(self, request):
        """aiohttp's route for every endpoint: the body read, the answer sent."""
        raw = b""
        if request.method == "POST":
            try:
                self._session_of(request.headers.get("Authorization", ""))  # a wrong key is told before the body is read
                raw = await read_body(request, max_body_bytes=self.max_body_bytes, timeout_s=self.body_timeout_s,
                                      too_large_hint=_TOO_LARGE_HINTS.get(request.path, ""))
            except BadRequest as e:
                status, payload = _error(e.status, str(e), param=getattr(e, "param", None), code=getattr(e, "code", None))
                return web.json_response(payload, status=status)
        status, payload, record = await self._answer(request.method, request.path,
                                                     request.headers.get("Authorization", ""), raw)
        events = isinstance(payload, bytes)
        response = (web.StreamResponse(status=status, headers=_EVENT_STREAM_HEADERS) if events
                    else web.json_response(payload, status=status))
        if request.transport is None or request.transport.is_closing():
            return response  # the client left (its handler's cancellation is on its way): nothing to record or send
        if record is not None:
            # Kept in the same step of the event loop that hands the answer to the connection (nothing
            # below waits before writing it): a client that left earlier has cancelled this handler
            # (handler_cancellation), and the next request of a client that got it finds it recorded.
            record()
        try:
            await response.prepare(request)
            if events:
                await response.write(payload)
            await response.write_eof()
        except ConnectionResetError:  # the client left while the answer was being written: no traceback for it
            pass
        return response

    async def _answer(self, method: str, path: str, authorization: str, raw: bytes):
        """(status, a JSON object | server-sent events, `record` or None): `record()` keeps the turn
        for training, and the transport calls it as it hands the answer over, so a turn whose client
        left, or whose answer failed to build, is never trained on."""
        try:
            if (method, path) == ("GET", "/v1/models"):
                return 200, {"object": "list", "data": [
                    {"id": self.model_name, "object": "model", "created": 0, "owned_by": "agentrl"}]}, None
            if (method, path) == ("POST", "/agentrl/reward"):
                return *self._reward(authorization, raw), None
            if (method, path) == ("POST", "/v1/chat/completions"):
                return await self._chat(authorization, raw)
            raise _Refused(404, f"no endpoint {method} {path}: the proxy serves POST /v1/chat/completions, "
                                "GET /v1/models and POST /agentrl/reward")
        except BadRequest as e:  # parse_json_body's, or a _Refused one with its field and code
            return *_error(e.status, str(e), param=getattr(e, "param", None), code=getattr(e, "code", None)), None

    def _reward(self, authorization: str, raw: bytes):
        session = self._session_of(authorization)
        body = parse_json_body(raw)
        reward = body.get("reward") if isinstance(body, dict) else None
        try:  # an int of hundreds of digits overflows float(); Infinity, NaN and 1e999 parse to non-finite floats
            reward = float(reward) if isinstance(reward, (int, float)) and not isinstance(reward, bool) else None
        except OverflowError:
            reward = None
        if reward is None or not math.isfinite(reward):  # a non-finite reward makes the group's advantages NaN
            raise _Refused(400, "send {\"reward\": <a finite number>}", param="reward")
        session.reward = reward
        return 200, {"status": "ok"}

    async def _chat(self, authorization: str, raw: bytes):
        session = self._session_of(authorization)
        try:
            params = self._read_params(parse_json_body(raw))
            plan = await self._plan(session, params)
        except PromptTooLong as e:  # told before its arguments were decoded
            raise self._too_long(e.chars)
        except ChatFormatError as e:
            raise _Refused(400, str(e), param="messages")
        except RecursionError:  # a field nested hundreds deep that no check above named
            raise _Refused(400, "the request nests lists or objects too deeply to render")
        segment = plan["segment"]
        if segment is not None and plan["in_place"]:
            segment.busy = True
        try:
            gen = await self.client.generate(
                plan["prompt"], max_new_tokens=plan["max_new_tokens"], temperature=params["temperature"],
                top_p=params["top_p"], stop=params["stop"], stop_token_ids=self.stop_token_ids,
                trajectory_id=session.key, extra_sampling_params=params["extra"])
        except GenerationAborted as e:
            session.error = str(e)
            raise _Refused(503, f"the inference server failed: {e}")
        except InferenceServerError as e:
            if e.status is not None and 400 <= e.status < 500:  # refused before sampling (e.g. over its context length)
                raise _Refused(400, f"the inference server refused the request: {e}")
            session.error = str(e)
            raise _Refused(503, f"the inference server failed: {e}")
        finally:
            if segment is not None and plan["in_place"]:
                segment.busy = False
        turn = self._reply(params, gen)
        completion_id = "chatcmpl-" + uuid.uuid4().hex
        usage = {"prompt_tokens": len(plan["prompt"]), "completion_tokens": len(gen.output_ids),
                 "total_tokens": len(plan["prompt"]) + len(gen.output_ids)}
        logprobs = None
        if params["logprobs"]:
            logprobs = {"content": [{"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
                                    for text, lp in zip(self.tokenizer.convert_ids_to_tokens(gen.output_ids),
                                                        gen.logprobs)]}
        if params["stream"]:
            payload = self._events(completion_id, turn["message"], turn["finish"], logprobs,
                                   usage if params["include_usage"] else None)
        else:
            payload = {
                "id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": [{"index": 0, "message": turn["message"], "finish_reason": turn["finish"],
                             "logprobs": logprobs}],
                "usage": usage}
        return 200, payload, lambda: self._record(session, plan, turn)

    def _events(self, completion_id, message, finish, logprobs, usage) -> bytes:
        """The whole reply as server-sent events, in the chunks the SDKs assemble: role, content,
        tool calls, finish reason, usage (when asked), [DONE]."""
        base = {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
        if message["content"]:
            chunks.append({"choices": [{"index": 0, "delta": {"content": message["content"]}, "finish_reason": None,
                                        "logprobs": logprobs}]})
        if message.get("tool_calls"):
            chunks.append({"choices": [{"index": 0, "finish_reason": None, "delta": {"tool_calls": [
                {"index": i, **call} for i, call in enumerate(message["tool_calls"])]}}]})
        chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        if usage is not None:
            chunks.append({"choices": [], "usage": usage})
        return "".join(f"data: {json.dumps({**base, **chunk})}\n\n" for chunk in chunks).encode() + b"data: [DONE]\n\n"

    # --- the request's fields ---
    def _read_params(self, body) -> dict:
        if not isinstance(body, dict):
            raise _Refused(400, "the body must be a JSON object")
        for name, value in body.items():
            if name in _READ or name in _IGNORED:
                continue
            if name in _NEUTRAL:
                if value is None or value in _NEUTRAL[name]:
                    continue
                raise _Refused(400, f"{name} is not supported by agentrl's proxy (only {name}=null"
                                    f"{''.join(f' or {json.dumps(v)}' for v in _NEUTRAL[name])})", param=name)
            raise _Refused(400, f"unrecognized request argument supplied: {name}", param=name)

        def number(name, default, low, high):
            value = body.get(name)
            if value is None:
                return default
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise _Refused(400, f"{name} must be a number in [{low}, {high}], got {value!r}", param=name)
            return float(value)

        def integer(name, low, high=2 ** 31 - 1):
            value = body.get(name)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise _Refused(400, f"{name} must be an integer in [{low}, {high}], got {value!r}", param=name)
            return value

        if integer("n", 1) not in (None, 1):
            raise _Refused(400, "n > 1 is not supported: ask once per sample (each is its own turn)", param="n")
        if body.get("top_logprobs"):
            raise _Refused(400, "top_logprobs is not supported (logprobs: true gives each sampled token's)",
                           param="top_logprobs")
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (not isinstance(stop, list) or len(stop) > 16 or not all(isinstance(s, str) for s in stop)):
            raise _Refused(400, "stop must be a string or a list of at most 16 strings", param="stop")
        tools = body.get("tools")
        if tools is not None:
            if not isinstance(tools, list) or not all(
                    isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                    and isinstance(t["function"].get("name"), str) for t in tools):
                raise _Refused(400, "tools must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}}",
                               param="tools")
            if lone_surrogate(tools):
                raise _Refused(400, f"tools {LONE_SURROGATE}", param="tools")
        tool_choice = body.get("tool_choice")
        if tool_choice not in (None, "auto", "none"):
            raise _Refused(400, "tool_choice must be \"auto\" or \"none\": the proxy cannot force a tool call",
                           param="tool_choice")
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise _Refused(400, "stream_options must be an object", param="stream_options")
        seed = integer("seed", 0, 2 ** 63 - 1)
        max_tokens = integer("max_completion_tokens", 1) or integer("max_tokens", 1) or self.default_max_tokens
        return {
            "messages": to_template_messages(body.get("messages"), self.max_prompt_chars),
            "temperature": number("temperature", 1.0, 0.0, 2.0), "top_p": number("top_p", 1.0, 1e-9, 1.0),
            "max_tokens": max_tokens, "stop": stop or None, "extra": {"sampling_seed": seed} if seed is not None else None,
            "tools": tools or None, "parse_tools": bool(tools) and tool_choice != "none",
            "stream": bool(body.get("stream")), "include_usage": bool(stream_options.get("include_usage")),
            "logprobs": bool(body.get("logprobs")),
        }

    # --- recording ---
    async def _plan(self, session: _Session, params: dict) -> dict:
        """The prompt of this request: the longest earlier state of the session that it extends, or a
        fresh rendering (docstring at the top)."""
        messages, tools = params["messages"], params["tools"]
        keys = tuple(message_key(m) for m in messages)
        tools_key = json.dumps(tools, sort_keys=True)
        # What the template renders (contents, tool calls, tools), as JSON: a cheap measure of its length
        chars = sum(map(len, keys)) + len(tools_key)
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise self._too_long(chars)
        best = None
        for segment in session.segments:
            for index, (state_keys, state_tools, length, closed) in enumerate(segment.states):
                if (state_tools == tools_key and len(state_keys) < len(keys) and keys[:len(state_keys)] == state_keys
                        and (best is None or len(state_keys) >= len(best[2][0]))):
                    best = (segment, index, segment.states[index])

        def tokenize():  # (the tokens after `best`, None) or (None, the whole prompt)
            if best is not None:
                delta = continuation_ids(self.tokenizer, messages[:len(best[2][0])], messages, tools,
                                         end_of_turn=self.end_of_turn, chat_template=self.chat_template,
                                         tools_as_text=self.tools_as_text)
                if delta is not None:
                    return delta, None
            return None, render_ids(self.tokenizer, messages, tools, self.chat_template,
                                    tools_as_text=self.tools_as_text)
        # A long conversation is rendered and tokenized on a thread (encode lets go of the GIL there), so
        # that the event loop goes on serving the other sessions (a 30 MB message held it for 54 s).
        if chars > LONG_TEXT_CHARS:
            delta, rendered = await asyncio.to_thread(tokenize)
        else:
            delta, rendered = tokenize()
        plan = {"segment": None, "in_place": False, "prefix": None, "keys": keys, "tools_key": tools_key,
                "prompt": rendered}
        if delta is not None:
            # Decided after tokenizing: another request of the session may have moved on meanwhile.
            segment, index, (_, _, length, closed) = best
            closing = [] if closed else [self.end_of_turn_id]  # a turn cut by length or a stop string
            plan.update(segment=segment, in_place=index == len(segment.states) - 1 and not segment.busy,
                        prefix=length, delta=closing + delta, prompt=segment.ids[:length] + closing + delta)
        max_new_tokens = params["max_tokens"]
        if self.max_context_tokens is not None:
            room = self.max_context_tokens - len(plan["prompt"])
            if room <= 0:
                raise _Refused(400, f"this conversation is {len(plan['prompt'])} tokens; the session's context budget "
                                    f"is {self.max_context_tokens}", param="messages", code="context_length_exceeded")
            max_new_tokens = min(max_new_tokens, room)
        plan["max_new_tokens"] = max_new_tokens
        return plan

    def _too_long(self, chars: int) -> _Refused:
        return _Refused(400, f"these messages and tools come to at least {chars} characters (as JSON); "
                             f"{self.char_budget_tokens} tokens (the context budget) hold at most "
                             f"{self.max_prompt_chars} with this tokenizer", param="messages",
                        code="context_length_exceeded")

    def _reply(self, params: dict, gen) -> dict:
        """A generation read as a turn: the assistant `message` and its `finish` reason for the
        answer, and what _record keeps. Changes nothing."""
        out = gen.output_ids
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        if gen.finish_reason == "stop" and isinstance(gen.matched, str) and gen.matched in text:
            text = text[:text.find(gen.matched)]  # OpenAI leaves the stop sequence out of the content
        content, calls = parse_tool_calls(text) if params["parse_tools"] else (text, None)
        parse_failed = params["parse_tools"] and calls is None and "<tool_call>" in text
        closed = bool(out) and out[-1] in self.stop_token_ids
        finish = "tool_calls" if calls else ("length" if gen.finish_reason == "length" and not closed else "stop")
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return {"message": message, "finish": finish, "gen": gen, "closed": closed, "parse_failed": parse_failed,
                "key": message_key(to_template_messages([message])[0])}  # how the next request names this turn

    def _record(self, session: _Session, plan: dict, turn: dict):
        """Keep a turn whose answer was sent: its tokens, the session's counts, the state it leaves."""
        gen = turn["gen"]
        out = list(gen.output_ids)
        segment = plan["segment"]
        if segment is not None and plan["in_place"] and len(segment.ids) == plan["prefix"]:
            n = len(plan["delta"])
            segment.ids += plan["delta"]
            segment.mask += [0] * n
            segment.logprobs += [0.0] * n
            segment.versions += [-1] * n
        else:
            # A new segment: the prompt as context only. Tokens sampled earlier keep their single
            # trained copy in the segment they were recorded in.
            prompt = plan["prompt"]
            segment = _Segment(list(prompt), [0] * len(prompt), [0.0] * len(prompt), [-1] * len(prompt))
            session.segments.append(segment)
            session.stats["new_segments"] += 1
        segment.ids += out
        segment.mask += [1] * len(out)
        segment.logprobs += list(gen.logprobs)
        segment.versions += list(gen.versions)
        session.stats["requests"] += 1
        session.stats["completion_tokens"] += len(out)
        session.stats["tool_calls"] += len(turn["message"].get("tool_calls", []))
        session.stats["tool_call_parse_failures"] += turn["parse_failed"]
        session.stats["length_cut"] += turn["finish"] == "length"
        segment.states.append((plan["keys"] + (turn["key"],), plan["tools_key"], len(segment.ids), turn["closed"]))
