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

Endpoints: `POST /v1/chat/completions`, `POST /v1/responses` (the OpenAI Agents SDK's), `POST
/v1/completions` (each plain or `stream: true` server-sent events, sent as the model generates),
`GET /v1/models`, and `POST /agentrl/reward {"reward": x}` for agents that score themselves (the
session's key as the API key, or its base URL `proxy.session_url(key)` = `.../s/<key>/v1`). Every
bad request, and every unknown path, gets a 4xx in OpenAI's error shape, naming the field; nothing
about a session changes on a rejected request. With `train_sampling`, a training session samples
with the trainer's settings only (another temperature, top_p, ... is a 400 naming it).

Recording (docs/openai_proxy.md): a request whose messages extend an earlier request of the session
(its messages, then the assistant reply the proxy gave, then new messages) continues that
request's tokens: the sampled tokens stay as they were, only the new messages are tokenized
(lib/chat_format.py) and appended with loss_mask 0. A request that does not extend one (the agent
rewrote its history, changed its tools, or asked twice from the same point) starts a new segment,
rendered by the chat template, where only the new reply is trained on. So every sampled token is in
exactly one segment with loss_mask 1 and the log-prob the server reported for it. Each segment is a
training sequence with the episode's reward; replies the agent did not go on from (one it asked for
again, the unused choices of `n` > 1) are cut out of them by end_session (`discarded_turns`). A turn
is recorded only as its answer is handed to the client: a client that disconnects cancels its
generation, and a reply that fails to build is a 500 that records nothing (docs/reliability.md has
the limits on hostile requests).

This module is the server and the three API dialects' reading of requests; what a session records
(the invariant above, in one place) is lib/proxy_record.py, the streamed events' shapes
lib/proxy_events.py, a reply's text as it streams lib/reply_stream.py.
"""
import array
import asyncio
import collections
import functools
import itertools
import json
import math
import os
import re
import sys
import time
import uuid

from aiohttp import web

from lib.chat_format import (LONE_SURROGATE, LONG_TEXT_CHARS, ChatFormatError, PromptTooLong, continuation_ids, encode,
                             end_of_turn_token, message_key, parse_tool_calls, render_text, template_renders_tools,
                             to_template_messages, token_bytes_reader)
from lib.client import GenerationAborted, InferenceServerError
from lib.cpu_engine import MAX_STOP_CHARS
from lib.http_body import BadRequest, body_too_large, lone_surrogate, parse_json_body, read_body
from lib.proxy_events import ChatChunks, CompletionChunks, ResponseEvents, legacy_logprobs, usage_of
from lib.proxy_record import Session, episode_of, record_all
from lib.reply_stream import THINK_START, ReplyText, split_reasoning

# Request fields accepted and ignored (they do not change sampling), in every API.
_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier"}


class SessionFailed(RuntimeError):
    """A generation of the session failed (an abort that was not a pause, a server error): its
    episode is not what the policy would have written, so it must not be trained on."""


def _error(status: int, message: str, *, param: str | None = None, code: str | None = None) -> tuple[int, dict]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


_TOO_LARGE_HINTS = {"/v1/chat/completions": "shorten the conversation", "/v1/responses": "shorten the conversation",
                    "/v1/completions": "shorten the prompt", "/agentrl/reward": "send {\"reward\": x}"}
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
        if isinstance(payload, _Events):
            return httpx.Response(status, request=request, stream=_byte_stream(httpx, payload),
                                  headers={"Content-Type": "text/event-stream"})
        response = httpx.Response(status, request=request, content=json.dumps(payload).encode(),
                                  headers={"Content-Type": "application/json; charset=utf-8"})
        if record is not None:
            record()  # handed over: the caller gets this response with nothing awaited in between
        return response

    async def aclose(self):
        pass


def _byte_stream(httpx, events: "_Events"):
    """A streamed reply as the body of an httpx response: its last part is recorded as the SDK
    reads it; an SDK that stops reading closes it, and with it the generation."""
    class Stream(httpx.AsyncByteStream):
        async def __aiter__(self):
            async for data, record in events:
                if record is not None:
                    record()
                yield data

        async def aclose(self):
            await events.aclose()
    return Stream()


class OpenAIProxy:
    def __init__(self, client, tokenizer, *, stop_token_ids: list[int] | None = None, model_name: str = "policy",
                 max_context_tokens: int | None = None, default_max_tokens: int = 1024, chat_template: str | None = None,
                 train_sampling: dict | None = None, host: str = "127.0.0.1", port: int = 0,
                 max_body_bytes: int = 32 << 20, body_timeout_s: float = 30.0):
        """`stop_token_ids`: ids that end a turn (the model's EOS set, lib.client.model_eos_ids).
        `max_context_tokens`: a session's prompt + reply budget; a request past it gets OpenAI's
        400 `context_length_exceeded` and `max_tokens` is cut to what is left. `chat_template`
        overrides the tokenizer's; one without a tools section gets tools written into the messages'
        text (lib/chat_format.py, with_tools_as_text). `train_sampling`: the sampling settings the
        trainer recomputes log-probs with, e.g. `{"temperature": cfg.temperature}` (the rest at their
        neutral values: top_p 1, top_k -1, min_p 0, no penalties: the whole vocabulary); a training
        session then samples with exactly these, and a request that sets another value gets a 400
        naming it. None: every request samples as it asks (evaluation, or an untrained proxy)."""
        # The proxy tokenizes a short text on the event loop and a long one on a thread of its own; the
        # Rust tokenizer's thread pool would only compete with the trainer and a CPU server for cores
        # (docs/benchmarks.md).
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.train_sampling = None
        if train_sampling is not None:
            unknown = set(train_sampling) - set(_SAMPLING)
            if unknown:
                raise ValueError(f"train_sampling takes {', '.join(_SAMPLING)}; got {', '.join(sorted(unknown))}")
            self.train_sampling = {**{name: default for name, (*_, default) in _SAMPLING.items()},
                                   **{name: _SAMPLING[name][2](v) for name, v in train_sampling.items()}}
            _check_train_sampling(self.train_sampling)
        self.client, self.tokenizer = client, tokenizer
        self.model_name = model_name
        self.max_context_tokens = max_context_tokens
        self.default_max_tokens = default_max_tokens
        self.chat_template = chat_template
        self.end_of_turn, self.end_of_turn_id = end_of_turn_token(tokenizer, chat_template)
        self.tools_as_text = not template_renders_tools(tokenizer, chat_template)
        self.stop_token_ids = sorted(set(stop_token_ids or []) | {self.end_of_turn_id})
        self.token_text = token_bytes_reader(tokenizer)  # id -> (text, UTF-8 bytes), for logprobs
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
        self.sessions: dict[str, Session] = {}
        self._prompt_cache: collections.OrderedDict = collections.OrderedDict()  # (message keys, tools) -> ids
        self.url = ""
        self._runner = None

    # --- lifecycle, on the event loop the client runs on ---
    async def start(self) -> str:
        app = web.Application(client_max_size=self.max_body_bytes)
        # One route for every path and method: unknown ones get their 404 / 405 in OpenAI's error shape.
        app.router.add_route("*", "/{path:.*}", self._http)
        # handler_cancellation: a client that disconnects cancels its handler, and with it the request to
        # the inference server (which then aborts it: SGLang and lib/cpu_server.py do), instead of
        # generating a turn nobody receives.
        # shutdown_timeout: close() cancels the requests still generating (nothing of them is recorded)
        # after 0.1 s, instead of waiting for them up to aiohttp's default of 60 s (0 would mean no limit).
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.1)
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
    def new_session(self, train: bool = True) -> str:
        """A new episode's key: hand it to the agent as its API key (or its base URL,
        `session_url(key)`). `train=False`: an episode that is not trained on (evaluation), free to
        sample as it asks whatever `train_sampling` says."""
        key = "agentrl-" + uuid.uuid4().hex
        self.sessions[key] = Session(key, train)
        return key

    def session_url(self, key: str) -> str:
        """A base URL that carries the session, for agents whose client is built once with a fixed
        API key: `http://127.0.0.1:PORT/s/<key>/v1`."""
        return f"http://{self.host}:{self.port}/s/{key}/v1"

    def end_session(self, key: str, train_discarded: bool = False) -> dict:
        """The episode: `segments` (trajectory dicts of [1, T] tensors: input_ids, loss_mask,
        logprobs, versions, attention_mask; segments without a trained token are left out), the
        `reward` posted to /agentrl/reward (None if none was) and the session's counts, among them
        `discarded_turns`, how many replies the agent did not go on from (a retry's superseded reply,
        the unused choices of an `n` > 1 request: `discarded_turns()`). Those are not trained on
        (a segment ends before its first one) unless `train_discarded`. Raises SessionFailed if a
        generation of the session failed."""
        session = self.sessions.pop(key)
        self.client.end_trajectory(key)
        if session.error is not None:
            raise SessionFailed(f"a generation of session {key} failed: {session.error}")
        return episode_of(session, train_discarded)

    # --- handlers: an answer is (status, a JSON object | server-sent events as bytes, record), whichever transport ---
    def _session_of(self, authorization: str) -> Session:
        key = authorization[7:].strip() if authorization[:7].lower() == "bearer " else ""
        session = self.sessions.get(key)
        if session is None:
            raise _Refused(401, "unknown or missing API key: use the key of a live session (proxy.new_session()) "
                                "as the API key, or its base URL (proxy.session_url(key))", code="invalid_api_key")
        return session

    @staticmethod
    def _route(method: str, path: str, authorization: str) -> tuple[str, str]:
        """(endpoint, authorization) of a request: a session's base URL (`/s/<key>/v1/...`) stands
        for its API key. Raises the 404 or 405, in OpenAI's error shape, for any other path."""
        if path.startswith("/s/"):
            key, _, rest = path[3:].partition("/")
            path, authorization = "/" + rest, "Bearer " + key
        endpoint = path.rstrip("/") or "/"
        if endpoint.startswith("/v1/models/"):
            endpoint = "/v1/models/{model}"
        allowed = _ENDPOINTS.get(endpoint)
        if allowed is None:
            raise _Refused(404, f"no endpoint {path}: the proxy serves {', '.join(f'{m} {p}' for p, m in _ENDPOINTS.items())}",
                           code="unknown_url")
        if method != allowed:
            raise _Refused(405, f"{path} takes {allowed}, not {method}", code="method_not_allowed")
        return endpoint, authorization

    async def _http(self, request):
        """aiohttp's route for every path: the body read, the answer sent."""
        raw = b""
        try:
            endpoint, authorization = self._route(request.method, request.path, request.headers.get("Authorization", ""))
            if request.method == "POST":
                self._session_of(authorization)  # a wrong key is told before the body is read
                raw = await read_body(request, max_body_bytes=self.max_body_bytes, timeout_s=self.body_timeout_s,
                                      too_large_hint=_TOO_LARGE_HINTS.get(endpoint, ""))
        except BadRequest as e:
            status, payload = _error(e.status, str(e), param=getattr(e, "param", None), code=getattr(e, "code", None))
            return web.json_response(payload, status=status)
        status, payload, record = await self._answer(request.method, request.path,
                                                     request.headers.get("Authorization", ""), raw)
        if isinstance(payload, _Events):
            return await self._send_events(request, payload)
        response = web.json_response(payload, status=status)
        if request.transport is None or request.transport.is_closing():
            return response  # the client left (its handler's cancellation is on its way): nothing to record or send
        if record is not None:
            # Kept in the same step of the event loop that hands the answer to the connection (nothing
            # below waits before writing it): a client that left earlier has cancelled this handler
            # (handler_cancellation), and the next request of a client that got it finds it recorded.
            record()
        try:
            await response.prepare(request)
            await response.write_eof()
        except ConnectionResetError:  # the client left while the answer was being written: no traceback for it
            pass
        return response

    @staticmethod
    async def _send_events(request, events: "_Events") -> web.StreamResponse:
        """A streamed reply, part by part as it is generated; its last part is recorded in the step
        that writes it, if the client is still there (as a plain answer is)."""
        response = web.StreamResponse(status=200, headers=_EVENT_STREAM_HEADERS)
        try:
            await response.prepare(request)
            async for data, record in events:
                if record is not None:
                    if request.transport is None or request.transport.is_closing():
                        return response
                    record()
                await response.write(data)
            await response.write_eof()
        except ConnectionResetError:  # the client left mid-stream: its generation is stopped below
            pass
        finally:
            await events.aclose()
        return response

    async def _answer(self, method: str, path: str, authorization: str, raw: bytes):
        """(status, a JSON object | server-sent events, `record` or None): `record()` keeps the turn
        for training, and the transport calls it as it hands the answer over, so a turn whose client
        left, or whose answer failed to build, is never trained on."""
        endpoint = None
        try:
            endpoint, authorization = self._route(method, path, authorization)
            if endpoint == "/v1/models":
                return 200, {"object": "list", "data": [self._model_card()]}, None
            if endpoint == "/v1/models/{model}":
                if path.rstrip("/").rsplit("/", 1)[1] != self.model_name:
                    raise _Refused(404, f"the proxy serves one model, {self.model_name!r}", param="model",
                                   code="model_not_found")
                return 200, self._model_card(), None
            session = self._session_of(authorization)
            if endpoint == "/agentrl/reward":
                return *self._reward(session, raw), None
            return await {"/v1/chat/completions": self._chat, "/v1/completions": self._completion,
                          "/v1/responses": self._responses}[endpoint](session, parse_json_body(raw))
        except PromptTooLong as e:  # told before its arguments were decoded
            refused = self._too_long(e.chars)
        except ChatFormatError as e:
            if endpoint == "/v1/responses":  # its items were read as chat messages: say so, and name its field
                refused = _Refused(400, f"input (read as chat messages, instructions first): {e}", param="input")
            else:
                refused = _Refused(400, str(e), param="messages")
        except RecursionError:  # a field nested hundreds deep that no check above named
            refused = _Refused(400, "the request nests lists or objects too deeply to render")
        except BadRequest as e:  # parse_json_body's, or a _Refused one with its field and code
            refused = e
        return *_error(refused.status, str(refused), param=getattr(refused, "param", None),
                       code=getattr(refused, "code", None)), None

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "agentrl"}

    def _reward(self, session: Session, raw: bytes):
        body = parse_json_body(raw)
        reward = body.get("reward") if isinstance(body, dict) else None
        try:  # an int of hundreds of digits overflows float(); Infinity, NaN and 1e999 parse to non-finite floats
            reward = float(reward) if isinstance(reward, (int, float)) and not isinstance(reward, bool) else None
        except OverflowError:
            reward = None
        if reward is None or not math.isfinite(reward):  # a non-finite reward makes the group's advantages NaN
            raise _Refused(400, "send {\"reward\": <a finite number>}", param="reward")
        if not math.isfinite(array.array("f", [reward])[0]):  # rewards are trained on as float32: 1e39 is inf there
            raise _Refused(400, f"reward {reward:g} is past float32's range (about ±3.4e38), in which the trainer "
                                "reads rewards; send a smaller one", param="reward")
        session.reward = reward
        return 200, {"status": "ok"}

    # --- the three APIs: each reads its request into the same fields, _generate samples, each writes its answer ---
    async def _chat(self, session: Session, body):
        params = self._read_params(session, body, _CHAT_FIELDS)
        params["messages"] = self._messages(body.get("messages"))
        completion_id, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
        if params["stream"]:
            return 200, await self._stream(session, params, ChatChunks(self.model_name, completion_id, created, params)), None
        plan, turns = await self._generate(session, params)
        payload = {"id": completion_id, "object": "chat.completion", "created": created, "model": self.model_name,
                   "choices": [{"index": i, "message": t["message"], "finish_reason": t["finish"],
                                "logprobs": {"content": t["logprobs"]} if params["logprobs"] else None}
                               for i, t in enumerate(turns)],
                   "usage": usage_of(plan, turns)}
        return 200, payload, lambda: record_all(session, plan, turns, self.end_of_turn)

    async def _completion(self, session: Session, body):
        params = self._read_params(session, body, _COMPLETION_FIELDS)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise _Refused(400, "prompt must be a non-empty string (one prompt a request)", param="prompt")
        if lone_surrogate(prompt):
            raise _Refused(400, f"prompt {LONE_SURROGATE}", param="prompt")
        if self.max_prompt_chars is not None and len(prompt) > self.max_prompt_chars:
            raise self._too_long(len(prompt))
        for name, neutral in (("echo", False), ("suffix", None), ("best_of", 1)):
            if body.get(name) not in (None, neutral):
                raise _Refused(400, f"{name} is not supported by agentrl's proxy (only {json.dumps(neutral)})", param=name)
        params["prompt_text"], params["parse_tools"] = prompt, False
        completion_id, created = "cmpl-" + uuid.uuid4().hex, int(time.time())
        if params["stream"]:
            chunks = CompletionChunks(self.model_name, completion_id, created, params, len(prompt))
            return 200, await self._stream(session, params, chunks), None
        plan, turns = await self._generate(session, params)
        choices = [{"index": i, "text": t["text"], "finish_reason": t["finish"],
                    "logprobs": legacy_logprobs(t["logprobs"], len(prompt)) if params["logprobs"] else None}
                   for i, t in enumerate(turns)]
        payload = {"id": completion_id, "object": "text_completion", "created": created, "model": self.model_name,
                   "choices": choices, "usage": usage_of(plan, turns)}
        return 200, payload, lambda: record_all(session, plan, turns, self.end_of_turn)

    async def _responses(self, session: Session, body):
        """OpenAI's Responses API, as the OpenAI Agents SDK calls it: `input` items (messages,
        function calls and their outputs) and `instructions` read as chat messages, function tools
        as chat tools; the answer is one `message` item and/or `function_call` items."""
        params = self._read_params(session, body, _RESPONSES_FIELDS)
        params["messages"] = self._messages(_response_input_as_messages(body.get("input"), body.get("instructions")))
        response = ResponseEvents(self.model_name, body, params)
        if params["stream"]:
            return 200, await self._stream(session, params, response), None
        plan, turns = await self._generate(session, params)
        return 200, response.finished(plan, turns), lambda: record_all(session, plan, turns, self.end_of_turn)

    async def _stream(self, session: Session, params: dict, api):
        """A reply streamed as it is generated: server-sent events of `api` (ChatChunks,
        CompletionChunks, ResponseEvents), an async iterator of (bytes, record or None) whose last
        item carries `record`, which the transport calls as it hands that item over (the turns are
        recorded only if the client got the whole reply). A request refused, or a generation that
        fails, before its first token gets its error status as a plain request does; a failure
        after it ends the stream with an error event."""
        plan = await self._plan(session, params)
        runs: asyncio.Queue = asyncio.Queue()  # (choice, ids, logprobs, tops) as they arrive; None at the end
        release = _hold(plan)
        task = asyncio.ensure_future(self._sample(session, params, plan, lambda *run: runs.put_nowait(run)))
        task.add_done_callback(lambda _: (release(), runs.put_nowait(None)))
        try:
            first = await runs.get()
        except asyncio.CancelledError:
            task.cancel()
            raise
        if first is None and task.exception() is not None:
            raise task.exception()
        texts = [ReplyText(self.tokenizer, stop=params["stop"], parse_tools=params["parse_tools"],
                           thinking=self._opens_thinking(params, plan))
                 for _ in range(params["n"])]
        return _Events(self._events(session, params, plan, api, task, runs, first, texts), task)

    async def _events(self, session, params, plan, api, task, runs, run, texts):
        pending = [[] for _ in texts]  # per choice: log-prob entries of tokens whose text was not sent yet

        def send(i, deltas):
            events = []
            for kind, text in deltas:
                out = api.delta(i, kind, text, pending[i])
                if out:
                    pending[i] = []
                events += out
            return events
        try:
            yield _sse(api.start()), None
            while run is not None:
                i, ids, logprobs, tops = run
                if params["logprobs"]:
                    pending[i] += self._logprob_entries(ids, logprobs, tops)
                events = send(i, texts[i].add(ids))
                if events:
                    yield _sse(events), None
                run = await runs.get()
            try:
                turns = [self._reply(params, plan, gen) for gen in task.result()]
            except _Refused as e:  # OpenAI's error event; the SDKs raise it as an APIError
                yield _sse([_error(e.status, str(e))[1]]), None
                return
            events = []
            for i, (turn, text) in enumerate(zip(turns, texts)):
                content = turn["text"] if "prompt_text" in params else turn["message"]["content"]
                events += send(i, text.finish(turn["message"].get("reasoning_content"), content))
                events += api.end_choice(i, turn, pending[i])
            yield _sse(events + api.end(plan, turns), done=api.done), lambda: record_all(session, plan, turns, self.end_of_turn)
        finally:
            task.cancel()

    def _opens_thinking(self, params: dict, plan: dict) -> bool | None:
        """Did the chat template open `<think>` at the end of the prompt (the reply starts inside it)?
        None for a text completion (its reply is never split into reasoning and content)."""
        if "prompt_text" in params:
            return None
        return self.tokenizer.decode(plan["prompt"][-4:]).rstrip().endswith(THINK_START)

    # --- the request's fields ---
    def _read_params(self, session: Session, body, fields: dict) -> dict:
        """The fields every API shares, read from `body` by their names in `fields` (the API's own
        names: max_tokens, max_output_tokens...), checked as OpenAI checks them."""
        if not isinstance(body, dict):
            raise _Refused(400, "the body must be a JSON object")
        for name, value in body.items():
            if name in fields["read"] or name in _IGNORED:
                continue
            if name in fields["neutral"]:
                if value is None or value in fields["neutral"][name]:
                    continue
                raise _Refused(400, f"{name} is not supported by agentrl's proxy (only {name}=null"
                                    f"{''.join(f' or {json.dumps(v)}' for v in fields['neutral'][name])})", param=name)
            raise _Refused(400, f"unrecognized request argument supplied: {name}", param=name)

        def integer(name, low, high=2 ** 31 - 1):
            value = body.get(name)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise _Refused(400, f"{name} must be an integer in [{low}, {high}], got {value!r}", param=name)
            return value

        n = integer("n", 1, MAX_N) or 1
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
                                 or not all(isinstance(s, str) for s in stop)):
            raise _Refused(400, f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings", param="stop")
        if stop and sum(map(len, stop)) > MAX_STOP_CHARS:  # each token's stop check reads them all
            raise _Refused(400, f"stop holds {sum(map(len, stop))} characters; at most {MAX_STOP_CHARS} in all its "
                                "strings (as the CPU server allows)", param="stop")
        if stop and lone_surrogate(stop):
            raise _Refused(400, f"stop {LONE_SURROGATE}", param="stop")
        tools = _read_tools(body.get("tools"), fields["flat_tools"])
        tool_choice = body.get("tool_choice")
        if tool_choice not in (None, "auto", "none"):
            raise _Refused(400, "tool_choice must be \"auto\" or \"none\": the proxy cannot force a tool call",
                           param="tool_choice")
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise _Refused(400, "stream_options must be an object", param="stream_options")
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise _Refused(400, f"stream must be true or false, got {stream!r}", param="stream")
        logprobs = body.get("logprobs")
        if fields is _COMPLETION_FIELDS:  # the legacy API's logprobs is a count of alternatives
            top_logprobs, logprobs = integer("logprobs", 0, 5), logprobs is not None
        else:
            top_logprobs = integer("top_logprobs", 0, 20)
            include = body.get("include") or []
            if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
                raise _Refused(400, "include must be a list of strings", param="include")
            logprobs = bool(logprobs) or "message.output_text.logprobs" in include
        if top_logprobs and not logprobs:
            raise _Refused(400, "top_logprobs needs logprobs (chat: logprobs: true; Responses: include "
                                "message.output_text.logprobs)", param="top_logprobs")
        seed = integer("seed", 0, 2 ** 63 - 1)
        max_tokens = None
        for name in fields["max_tokens"]:
            max_tokens = max_tokens or integer(name, 1)
        constrained = _constrained_decoding(body, fields)  # SGLang's json_schema or regex, or {}
        return {
            "n": n, "sampling": self._sampling(session, body, constrained), "seed": seed,
            "max_tokens": max_tokens or self.default_max_tokens, "stop": stop or None, "extra": constrained,
            "tools": tools, "parse_tools": bool(tools) and tool_choice != "none",
            "stream": bool(stream), "include_usage": bool(stream_options.get("include_usage")), "logprobs": logprobs,
            "top_logprobs": top_logprobs or 0,
        }

    def _sampling(self, session: Session, body: dict, constrained) -> dict:
        """The sampling settings of a request. In a training session of a proxy given `train_sampling`,
        every setting is the trainer's: a request may leave it out or repeat it; another value is a
        400 naming it (the trainer recomputes log-probs with its own, so a reply sampled otherwise
        would get wrong importance weights)."""
        given = {}
        for name, (low, high, kind, _) in _SAMPLING.items():
            value = body.get(name)
            if value is None:
                continue
            if (isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int)
                    or not low <= value <= high or (name == "top_p" and value == 0)
                    or (name == "top_k" and value == 0) or (name == "repetition_penalty" and value == 0)):
                allowed = "-1 or an integer >= 1" if name == "top_k" else f"a number in [{low}, {high}]"
                raise _Refused(400, f"{name} must be {allowed}{' (not 0)' if name in ('top_p', 'repetition_penalty') else ''}"
                                    f", got {value!r}", param=name)
            given[name] = kind(value)
        if self.train_sampling is None or not session.train:
            return {**{name: default for name, (*_, default) in _SAMPLING.items()}, **given}
        for name, value in given.items():
            if value != self.train_sampling[name]:
                raise _Refused(400, f"{name}={value} is not the trainer's {name}={self.train_sampling[name]}: the trainer "
                                    f"recomputes log-probs with its own settings over the whole vocabulary, so a reply "
                                    f"sampled with another {name} would get wrong importance weights. Leave {name} out "
                                    f"(the proxy then samples with the trainer's) or send {self.train_sampling[name]}; an "
                                    f"evaluation episode may set it: proxy.new_session(train=False)",
                               param=name, code="sampling_fixed_for_training")
        if constrained:
            raise _Refused(400, "structured output (response_format / text.format json, regex) constrains sampling to a grammar "
                                "the trainer does not apply when it recomputes log-probs, so training on it would get "
                                "wrong importance weights; parse the model's text instead, or use it in an evaluation "
                                "episode: proxy.new_session(train=False)", param=constrained_field(body),
                           code="sampling_fixed_for_training")
        return dict(self.train_sampling)

    def _messages(self, messages) -> list[dict]:
        messages = to_template_messages(messages, self.max_prompt_chars)
        _check_tool_messages(messages)
        return messages

    # --- generation ---
    async def _generate(self, session: Session, params: dict) -> tuple[dict, list[dict]]:
        """The request's prompt (planned against the session's record), its `n` samples, and each
        read as a turn. Nothing is recorded here: the transport records the turns as it hands the
        answer over."""
        plan = await self._plan(session, params)
        release = _hold(plan)
        try:
            gens = await self._sample(session, params, plan)
        finally:
            release()
        return plan, [self._reply(params, plan, gen) for gen in gens]

    async def _sample(self, session: Session, params: dict, plan: dict, on_tokens=None) -> list:
        """The request's `n` generations; `on_tokens(i, ids, logprobs, tops)` streams sample i's
        tokens as they come. A failed generation is a 4xx or 503 _Refused (and fails the session)."""
        sampling = params["sampling"]
        extra = {**params["extra"], **{name: sampling[name] for name in ("min_p", "presence_penalty", "frequency_penalty",
                                                                         "repetition_penalty")
                                       if sampling[name] != _SAMPLING[name][3]}}

        async def sample(i: int):
            seed = params["seed"]  # n samples of one seed would be n copies: each gets its own
            return await self.client.generate(
                plan["prompt"], max_new_tokens=plan["max_new_tokens"], temperature=sampling["temperature"],
                top_p=sampling["top_p"], top_k=sampling["top_k"], stop=params["stop"], stop_token_ids=self.stop_token_ids,
                trajectory_id=session.key, top_logprobs=params["top_logprobs"],
                extra_sampling_params={**extra, **({"sampling_seed": (seed + i) % 2 ** 63} if seed is not None else {})}
                or None, on_tokens=None if on_tokens is None else functools.partial(on_tokens, i))
        tasks = []
        try:
            if params["n"] == 1:
                gens = [await sample(0)]
            else:
                tasks = [asyncio.ensure_future(sample(i)) for i in range(params["n"])]
                gens = await asyncio.gather(*tasks)
        except GenerationAborted as e:
            session.error = str(e)
            raise _Refused(503, f"the inference server failed: {e}")
        except InferenceServerError as e:
            if e.status is not None and 400 <= e.status < 500:  # refused before sampling (e.g. over its context length)
                top = params["top_logprobs"] and "output_top_logprobs" in str(e)  # a server without them
                raise _Refused(400, f"the inference server refused the request: {e}",
                               param=("logprobs" if "prompt_text" in params else "top_logprobs") if top else None)
            session.error = str(e)
            raise _Refused(503, f"the inference server failed: {e}")
        finally:
            for task in tasks:  # one sample failed: the others are not waited for (nor recorded)
                task.cancel()
        return gens
    # --- recording ---
    async def _plan(self, session: Session, params: dict) -> dict:
        """The prompt of this request: the longest earlier state of the session that it extends, or a
        fresh rendering (docstring at the top)."""
        if "prompt_text" in params:
            return await self._plan_text(session, params)
        messages, tools = params["messages"], params["tools"]
        keys = tuple(message_key(m) for m in messages)
        tools_key = json.dumps(tools, sort_keys=True)
        # What the template renders (contents, tool calls, tools): a cheap measure of its length
        chars = sum(len(content) + len(calls) for _, content, calls, _ in keys) + len(tools_key)
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise self._too_long(chars)
        best = None
        for segment in session.segments:
            for index, (state_keys, state_tools, length, closed) in enumerate(segment.states):
                if (state_tools == tools_key and len(state_keys) < len(keys) and keys[:len(state_keys)] == state_keys
                        and (best is None or len(state_keys) >= len(best[2][0]))):
                    best = (segment, index, segment.states[index])

        def render():  # the template's text of this request's conversation, with the generation prompt
            return render_text(self.tokenizer, messages, tools, add_generation_prompt=True,
                               chat_template=self.chat_template, tools_as_text=self.tools_as_text)

        def tokenize():  # (the tokens after `best`, None, text) or (None, the whole prompt, text); text may be None
            if best is not None:
                segment, index, (state_keys, *_) = best
                before = segment.rendered if index == len(segment.states) - 1 else None
                # Rendered once: the text up to the state's reply is what the last request rendered, and
                # the reply ends at the next end of turn (unless its own text holds one: rendered twice).
                _, content, calls, _ = keys[len(state_keys) - 1]
                if before is not None and self.end_of_turn not in content and self.end_of_turn not in calls:
                    text = render()
                    cut = text.find(self.end_of_turn, len(before)) if text.startswith(before) else -1
                    if cut >= 0:
                        return encode(self.tokenizer, text[cut + len(self.end_of_turn):]), None, text
                delta = continuation_ids(self.tokenizer, messages[:len(state_keys)], messages, tools,
                                         end_of_turn=self.end_of_turn, chat_template=self.chat_template,
                                         tools_as_text=self.tools_as_text)
                if delta is not None:
                    return delta, None, None
            text = render()
            return None, encode(self.tokenizer, text), text
        # A GRPO group sends the same first request group_size times: a short fresh prompt is rendered
        # and tokenized once, then taken from this cache (the same messages and tools give the same ids;
        # not with tool calls, whose ids a template may render and message keys leave out).
        cacheable = (best is None and chars <= _PROMPT_CACHE_CHARS
                     and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages))
        cache_key = (keys, tools_key) if cacheable else None
        if cache_key is not None and cache_key in self._prompt_cache:
            self._prompt_cache.move_to_end(cache_key)
            ids, text = self._prompt_cache[cache_key]
            delta, rendered = None, list(ids)
        # A long conversation is rendered and tokenized on a thread (encode lets go of the GIL there), so
        # that the event loop goes on serving the other sessions (a 30 MB message held it for 54 s).
        elif chars > LONG_TEXT_CHARS:
            delta, rendered, text = await asyncio.to_thread(tokenize)
        else:
            delta, rendered, text = tokenize()
            if cache_key is not None:
                self._prompt_cache[cache_key] = (array.array("q", rendered), text)
                if len(self._prompt_cache) > _PROMPT_CACHE_SIZE:
                    self._prompt_cache.popitem(last=False)
        plan = {"segment": None, "in_place": False, "prefix": None, "keys": keys, "tools_key": tools_key,
                "prompt": rendered, "text": None,
                # what the next request renders only beyond: this conversation through its last end of turn
                "rendered": None if text is None else text[:text.rfind(self.end_of_turn) + len(self.end_of_turn)]}
        if delta is not None:
            # Decided after tokenizing: another request of the session may have moved on meanwhile.
            segment, index, (_, _, length, closed) = best
            closing = [] if closed else [self.end_of_turn_id]  # not sampled, not trained (mask 0)
            plan.update(segment=segment, in_place=index == len(segment.states) - 1 and not segment.busy,
                        prefix=length, delta=closing + delta, prompt=segment.ids[:length] + closing + delta)
        return self._budget(plan, params)

    async def _plan_text(self, session: Session, params: dict) -> dict:
        """/v1/completions: a prompt that begins with an earlier prompt + completion of the session
        continues that record (the sampled tokens kept, only the new text tokenized); any other is
        tokenized whole into a new segment."""
        text = params["prompt_text"]
        best = None
        for segment in session.segments:
            for state_text, length in segment.text_states:
                if text.startswith(state_text) and (best is None or len(state_text) >= len(best[1])):
                    best = (segment, state_text, length)
        if len(text) > LONG_TEXT_CHARS:
            ids = await asyncio.to_thread(encode, self.tokenizer, text[len(best[1]):] if best else text)
        else:
            ids = encode(self.tokenizer, text[len(best[1]):] if best else text)
        plan = {"segment": None, "in_place": False, "prefix": None, "prompt": ids, "text": text}
        if best is not None:
            segment, _, length = best
            plan.update(segment=segment, in_place=length == len(segment.ids) and not segment.busy, prefix=length,
                        delta=ids, prompt=segment.ids[:length] + ids)
        if not plan["prompt"]:
            raise _Refused(400, "the prompt has no tokens", param="prompt")
        return self._budget(plan, params)

    def _budget(self, plan: dict, params: dict) -> dict:
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

    def _reply(self, params: dict, plan: dict, gen) -> dict:
        """A generation read as a turn: the assistant `message` (and `text`, for /v1/completions), its
        `finish` reason and `logprobs` entries for the answer, and what _record keeps. Changes nothing."""
        out = gen.output_ids
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        if gen.finish_reason == "stop" and isinstance(gen.matched, str) and gen.matched in text:
            text = text[:text.find(gen.matched)]  # OpenAI leaves the stop sequence out of the content
        # A model that thinks in <think> tags: the rule the stream follows too (lib/reply_stream.py)
        reasoning, answer = split_reasoning(text, self._opens_thinking(params, plan))
        content, calls = parse_tool_calls(answer) if params["parse_tools"] else (answer, None)
        parse_failed = params["parse_tools"] and calls is None and "<tool_call>" in answer
        stopped = bool(out) and out[-1] in self.stop_token_ids
        finish = "tool_calls" if calls else ("length" if gen.finish_reason == "length" and not stopped else "stop")
        # Closed as the template closes a turn: any other ending (a cut, a stop string, another stop id
        # such as Qwen2.5's <|endoftext|>) gets the template's end of turn before the next turn.
        closed = bool(out) and out[-1] == self.end_of_turn_id
        message = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        logprobs = self._logprob_entries(out, gen.logprobs, gen.top_logprobs) if params["logprobs"] else None
        # How the next request names this turn: as the agent sends it back (reasoning_content is not
        # rendered back; the tokens the model sampled, thinking included, stay in the record).
        key = None if "prompt_text" in params else message_key(to_template_messages([message])[0])
        return {"message": message, "text": text, "finish": finish, "gen": gen, "closed": closed,
                "parse_failed": parse_failed, "logprobs": logprobs, "key": key}

    def _logprob_entries(self, ids: list[int], logprobs: list[float], tops: list | None) -> list[dict]:
        """OpenAI's `logprobs.content` entries of these sampled tokens: each token's text and UTF-8
        bytes, its log-prob and (given `tops`, the server's [(logprob, id), ...] per token) the most
        likely tokens alike."""
        def entry(token_id, logprob):
            token, raw = self.token_text(token_id)
            return {"token": token, "logprob": logprob, "bytes": raw}
        return [{**entry(t, lp), "top_logprobs": [entry(i, v) for v, i in top] if top is not None else []}
                for t, lp, top in zip(ids, logprobs, tops if tops is not None else itertools.repeat(None))]

# --- what each API reads; helpers of the three APIs ---
# The sampling settings a request may set: (low, high, type, the server's default). top_k, min_p and
# repetition_penalty are vLLM's and SGLang's extensions of OpenAI's API (the SDKs send them as extra_body).
_SAMPLING = {"temperature": (0.0, 2.0, float, 1.0), "top_p": (0.0, 1.0, float, 1.0), "top_k": (-1, 2 ** 31 - 1, int, -1),
             "min_p": (0.0, 1.0, float, 0.0), "presence_penalty": (-2.0, 2.0, float, 0.0),
             "frequency_penalty": (-2.0, 2.0, float, 0.0), "repetition_penalty": (0.0, 2.0, float, 1.0)}
MAX_N = 16  # samples a request: each is a whole generation and a segment of its own
# Stop strings: fewer than the CPU server takes (64), and its bound on their characters in all, so a
# request the proxy passes is one it serves; every streamed token's stop check reads them all.
MAX_STOP_STRINGS = 16
def _check_train_sampling(train_sampling: dict):
    """Refuses a training setting other than the temperature at a value that is not neutral: the
    trainer recomputes log-probs at its temperature over the whole vocabulary, with no cut and no
    penalty, so replies sampled otherwise would get silently biased ratios (and lib's CPU server
    reports the log-probs from before a top_p/top_k/min_p cut, so even the behaviour side is off)."""
    for name, value in train_sampling.items():
        if name != "temperature" and value != _SAMPLING[name][3]:
            raise ValueError(f"train_sampling {name}={value}: the trainer's log-probs are recomputed at its temperature "
                             f"over the whole vocabulary and the server's do not reflect {name}, so the importance "
                             f"weights of replies sampled with it would be biased; leave {name} out (or at "
                             f"{_SAMPLING[name][3]}) for training, and set it in evaluation sessions only")


# Fresh prompts kept rendered (least recently used out): at most this many, each of at most this many
# characters of messages and tools (as JSON), so at most ~16 MB of ids.
_PROMPT_CACHE_SIZE, _PROMPT_CACHE_CHARS = 256, 8192
_ENDPOINTS = {"/v1/chat/completions": "POST", "/v1/responses": "POST", "/v1/completions": "POST", "/v1/models": "GET",
              "/v1/models/{model}": "GET", "/agentrl/reward": "POST"}
# Per API: fields read, fields refused with a 400 unless they hold their neutral value, the names of
# its length limit, and whether its tools are flat ({"type": "function", "name": ...}: Responses).
_CHAT_FIELDS = {
    "read": {"model", "messages", "max_tokens", "max_completion_tokens", "stop", "seed", "n", "stream", "stream_options",
             "tools", "tool_choice", "logprobs", "top_logprobs", "response_format", "regex", *_SAMPLING},
    "neutral": {"logit_bias": ({},), "functions": (), "function_call": (), "reasoning_effort": (),
                "modalities": (["text"],), "audio": (), "prediction": (), "web_search_options": ()},
    "max_tokens": ("max_completion_tokens", "max_tokens"), "flat_tools": False}
_COMPLETION_FIELDS = {
    "read": {"model", "prompt", "max_tokens", "stop", "seed", "n", "stream", "stream_options", "logprobs", "echo",
             "suffix", "best_of", "regex", *_SAMPLING},
    "neutral": {"logit_bias": ({},)}, "max_tokens": ("max_tokens",), "flat_tools": False}
_RESPONSES_FIELDS = {
    "read": {"model", "input", "instructions", "max_output_tokens", "tools", "tool_choice", "stream", "stream_options",
             "top_logprobs", "include", "text", *_SAMPLING},
    "neutral": {"previous_response_id": (), "conversation": (), "prompt": (), "reasoning": (), "background": (False,),
                "max_tool_calls": (), "truncation": ("disabled",), "context_management": (),
                "prompt_cache_retention": ()},
    "max_tokens": ("max_output_tokens",), "flat_tools": True}
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _read_tools(tools, flat: bool) -> list[dict] | None:
    """The request's function tools, checked as OpenAI checks them: unique names of 1-64 letters,
    digits, `_` or `-`, `parameters` a JSON Schema object. Chat tools are kept as sent (the template
    renders them); Responses' flat tools become chat tools."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise _Refused(400, "tools must be a list of function tools", param="tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _Refused(400, f"{where}: only function tools are supported ({{\"type\": \"function\", ...}}), got "
                                f"type {tool.get('type') if isinstance(tool, dict) else tool!r}", param="tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool} if flat else tool.get("function")
        if not isinstance(fn, dict):
            raise _Refused(400, f"{where}.function must be an object with a name", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise _Refused(400, f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                           param="tools")
        if name in names:
            raise _Refused(400, f"{where}: a second tool named {name!r}; tool names must be unique", param="tools")
        names.add(name)
        schema = fn.get("parameters")
        if schema is not None and (not isinstance(schema, dict) or (schema and schema.get("type") != "object")):
            raise _Refused(400, f"{where}.function.parameters must be a JSON Schema of an object "
                                f"({{\"type\": \"object\", \"properties\": {{...}}}}), got {json.dumps(schema)[:200]}",
                           param="tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _Refused(400, f"{where}.function.description must be a string", param="tools")
        out.append({"type": "function", "function": fn} if flat else tool)
    if lone_surrogate(out):
        raise _Refused(400, f"tools {LONE_SURROGATE}", param="tools")
    return out


def _check_tool_messages(messages: list[dict]):
    """OpenAI's rules for tool results: a `tool` message answers one of the tool calls of the
    assistant message before it (tool messages between), and every call is answered before the
    conversation goes on. Raises ChatFormatError naming the message."""
    calls, caller = None, None  # the ids of the latest assistant tool calls not answered yet; its index
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            if calls is None:
                raise ChatFormatError(f"messages[{i}]: a message with role 'tool' must answer a tool call of the "
                                      "assistant message before it")
            if m.get("tool_call_id") not in calls:
                raise ChatFormatError(f"messages[{i}].tool_call_id {m.get('tool_call_id')!r} answers none of the tool "
                                      f"calls of messages[{caller}] still open ({', '.join(map(repr, calls)) or 'none'})")
            calls.remove(m.get("tool_call_id"))
            continue
        if calls:
            raise ChatFormatError(f"messages[{caller}] called tools whose results are missing (tool_call_id "
                                  f"{', '.join(map(repr, calls))}); answer each with a role 'tool' message before "
                                  "messages[{i}]".replace("{i}", str(i)))
        calls, caller = ([c["id"] for c in m["tool_calls"]], i) if m.get("tool_calls") else (None, None)


def _constrained_decoding(body: dict, fields: dict) -> dict:
    """SGLang's sampling params for structured output: `json_schema` (as text) for `response_format`
    (chat, completions) or `text.format` (Responses), `regex` for the `regex` extension (SGLang's
    and vLLM's extra_body), or {} for plain text."""
    regex = body.get("regex")
    if regex is not None and (not isinstance(regex, str) or not regex or lone_surrogate(regex)):
        raise _Refused(400, "regex must be a non-empty string (a regular expression the reply must match)", param="regex")
    schema = _json_schema(body, fields)
    if schema is not None and regex is not None:
        raise _Refused(400, "give one of response_format and regex: the server constrains a reply to one grammar",
                       param="regex")
    return {"json_schema": schema} if schema is not None else {"regex": regex} if regex is not None else {}


def _json_schema(body: dict, fields: dict) -> str | None:
    field = "text.format" if "text" in body else "response_format"
    spec = (body.get("text") or {}).get("format") if fields is _RESPONSES_FIELDS and isinstance(body.get("text"), dict) \
        else body.get("response_format")
    if fields is _RESPONSES_FIELDS and body.get("text") is not None and not isinstance(body.get("text"), dict):
        raise _Refused(400, "text must be an object ({\"format\": {\"type\": \"text\"}})", param="text")
    if spec is None or spec == {"type": "text"}:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        schema = (spec.get("schema") if fields is _RESPONSES_FIELDS
                  else (spec.get("json_schema") or {}).get("schema") if isinstance(spec.get("json_schema"), dict) else None)
        if not isinstance(schema, dict):
            raise _Refused(400, f"{field} of type json_schema needs its schema, a JSON Schema object "
                                f"({'schema' if fields is _RESPONSES_FIELDS else 'json_schema.schema'})", param=field)
        return json.dumps(schema)
    raise _Refused(400, f"{field}.type must be text, json_object or json_schema, got {kind!r}", param=field)


def constrained_field(body: dict) -> str:
    return "regex" if body.get("regex") is not None else "text.format" if "text" in body else "response_format"


def _sse(events, done: bool = False) -> bytes:
    """Server-sent events: each object as a `data:` line (with its `event:` name when it has a type,
    as the Responses API sends them), then `data: [DONE]` for the chat and completions APIs."""
    out = []
    for event in events:
        name = event.get("type") if isinstance(event.get("type"), str) and event.get("sequence_number") is not None else None
        out.append((f"event: {name}\n" if name else "") + f"data: {json.dumps(event)}\n\n")
    return "".join(out).encode() + (b"data: [DONE]\n\n" if done else b"")


def _part_text(part, where: str):
    """A Responses content part as a chat text part (other kinds are left for to_template_messages to refuse)."""
    if isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text"):
        return {"type": "text", "text": part.get("text")}
    return part


def _response_input_as_messages(items, instructions) -> list:
    """Responses `input` (a string, or items: messages, function calls, their outputs) and
    `instructions` as chat messages; an assistant message and the function calls after it are one
    assistant turn, as the proxy answered them."""
    messages = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _Refused(400, "instructions must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _Refused(400, "input must be a string or a non-empty list of items", param="input")
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            content = item.get("content")
            if isinstance(content, list):
                content = [_part_text(p, f"input[{i}]") for p in content]
            messages.append({"role": item.get("role"), "content": content})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1].get("role") == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = [_part_text(p, f"input[{i}]") for p in output]
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind != "reasoning":  # the model's reasoning is not rendered back (thinking templates drop it)
            raise _Refused(400, f"input[{i}] of type {kind!r} is not supported (message, function_call, "
                                "function_call_output, reasoning)", param="input")
    return messages


def _hold(plan: dict):
    """Mark the segment a request continues in place as generating (a concurrent request on it forks
    instead), from its planning on, with nothing awaited in between; returns the release."""
    segment = plan["segment"] if plan["in_place"] else None
    if segment is None:
        return lambda: None
    segment.busy = True

    def release():
        segment.busy = False
    return release


class _Events:
    """A reply being streamed: iterates (bytes, record | None) as lib's transports send them;
    `aclose()` also stops its generation (a client that left)."""

    def __init__(self, events, task):
        self.events, self.task = events, task

    def __aiter__(self):
        return self.events

    async def aclose(self):
        self.task.cancel()
        await self.events.aclose()


# How each API streams a reply: start() before the first token, delta() for each run of text
# (ReplyText's kinds, with the log-prob entries of the tokens since the last delta sent; an
# empty answer keeps them for the next), end_choice() once its turn is read, end() last.
