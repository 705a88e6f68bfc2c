"""A stand-in for SGLang that plays back scripted model output, to test a workflow against every
answer shape a real server gives, hostile ones included, without a model.

    from lib.scripted_server import Reply, ScriptedServer

    script = [Reply("<search> Ostrel Guild </search> and more"), Reply("<answer> Pem Varo </answer>", eos=True)]
    with ScriptedServer(tokenizer, script) as server:
        client = InferenceClient([server.address])
        ...                       # run the real episode code against server.address
    server.requests               # every /generate body it received, in order

Each `/generate` request takes the next reply of the script (the last one is repeated once the
script runs out); a reply may also be a function `body -> Reply` (`continuing` makes one that plays
a single model turn across the requests a client cuts it into). A `Reply` is what the model
would sample if nothing stopped it. The server then applies SGLang's rules (0.5.15,
`Req.check_finished`) to those tokens, token by token and in SGLang's order: `max_new_tokens`
first (so an EOS sampled as the last allowed token is reported as `length`), then the stop token
ids and the model's EOS, then the stop strings, looked for in the decoded output of this request
only (a stop string split across two requests is not seen, as in SGLang). The matched stop string
stays in `output_ids` and is trimmed from `text`. Each sampled token gets its own log-prob, -0.001
times a counter over the server's life, so a test can tell every sampled token apart.

Hostile answers: `abort_after=k` answers finish_reason abort after k tokens (what SGLang sends on a
server-side timeout or a failed forward); `logprobs="short" | "nan" | "mismatch" | "null"` breaks
the log-prob rows; `status=500` answers an HTTP error with no body; `delay_s` waits before answering.

A request with `stream: true` is answered as SGLang streams: one server-sent event per token,
`data: {...}` with the output so far (`ScriptedServer(incremental_streaming=True)`: only the new
token and its text, as SGLang's `--incremental-streaming-output`), the last with its finish_reason,
then `data: [DONE]`; `token_delay_s` waits before each event.

The helpers every workflow's tests use, at the end of this file:

    episode, server = scripted_episode(tokenizer, script,
                                       lambda client: arun_episode(client, tokenizer, InlineRewardPool(), cfg, item, 1.0))
    sampled, added = split_by_mask(tokenizer, episode["input_ids"][0].tolist(), episode["loss_mask"][0].tolist(), n)
"""
import asyncio
import dataclasses
import json
import threading

from aiohttp import web

from lib.client import InferenceClient


@dataclasses.dataclass
class Reply:
    text: str = ""  # what the model writes, tokenized with the server's tokenizer ...
    ids: list[int] | None = None  # ... or its token ids as they are
    eos: bool = False  # the model then samples its EOS token
    abort_after: int | None = None  # answer finish_reason abort after this many tokens
    logprobs: str = "ok"  # "ok", or a broken shape: "short", "nan", "mismatch", "null"
    status: int = 200  # any other status is an HTTP error answer
    delay_s: float = 0.0
    token_delay_s: float = 0.0  # streamed: the wait before each token's event


class ScriptedServer:
    def __init__(self, tokenizer, script: list, host: str = "127.0.0.1", incremental_streaming: bool = False):
        self.tokenizer = tokenizer
        self.script = list(script)
        self.requests: list[dict] = []
        self.answers: list[dict] = []  # what it answered to each, in order (the server's own record)
        self.control_calls: list[str] = []  # paths of every other call, in order
        self.control_bodies: list = []  # and their bodies
        self.incremental_streaming = incremental_streaming
        self.eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self._counter = 0
        self._host = host
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="scripted-server")
        self._runner = None
        self.address = ""

    # --- lifecycle ---
    def __enter__(self):
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    async def _start(self):
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        for path in ("pause_generation", "continue_generation", "update_weights_from_disk", "flush_cache",
                     "abort_request"):
            app.router.add_post("/" + path, self._control)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.address = f"http://{self._host}:{port}"

    # --- handlers ---
    async def _health(self, request):
        return web.Response(text="ok")

    async def _control(self, request):
        self.control_calls.append(request.path)
        self.control_bodies.append(await request.json() if request.can_read_body else None)
        if request.path == "/update_weights_from_disk":
            return web.json_response({"success": True, "message": "scripted", "num_paused_requests": 0})
        return web.json_response({"status": "ok"})

    async def _generate(self, request):
        body = await request.json()
        self.requests.append(body)
        entry = self.script[min(len(self.requests) - 1, len(self.script) - 1)]
        reply = entry(body) if callable(entry) else entry
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)
        if reply.status != 200:
            return web.Response(status=reply.status)
        answer = self.answer(reply, body)
        self.answers.append(answer)
        if body.get("stream"):
            return await self._stream(request, reply, answer)
        return web.json_response(answer)

    async def _stream(self, request, reply: Reply, answer: dict):
        """`answer` as SGLang streams it, one event per token (see the module docstring)."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        ids, meta, sent = answer["output_ids"], answer["meta_info"], ""
        for k in range(1, len(ids) + 1):
            if reply.token_delay_s:
                await asyncio.sleep(reply.token_delay_s)
            start = k - 1 if self.incremental_streaming else 0
            last = k == len(ids)
            text = answer["text"] if last else self.tokenizer.decode(ids[:k], skip_special_tokens=True)
            if self.incremental_streaming:
                text, sent = text[len(sent):], text
            event = {"text": text, "output_ids": ids[start:k],
                     "meta_info": {**meta, "finish_reason": meta["finish_reason"] if last else None,
                                   "completion_tokens": k,
                                   "output_token_logprobs": meta["output_token_logprobs"][start:k]}}
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        if not ids:
            await response.write(b"data: " + json.dumps(answer).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    def answer(self, reply: Reply, body: dict) -> dict:
        """SGLang's answer to `body` when the model samples `reply`."""
        params = body.get("sampling_params") or {}
        max_new_tokens = int(params.get("max_new_tokens", 128))
        stop_ids = self.eos_ids | {int(t) for t in params.get("stop_token_ids") or []}
        stops = params.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        sampled = list(reply.ids) if reply.ids is not None else self.tokenizer(reply.text, add_special_tokens=False)["input_ids"]
        if reply.eos:
            sampled.append(self.tokenizer.eos_token_id)
        out, finish = [], None
        for token in sampled:
            if reply.abort_after is not None and len(out) >= reply.abort_after:
                break
            out.append(token)
            if len(out) >= max_new_tokens:
                finish = {"type": "length", "length": max_new_tokens}
            elif token in stop_ids:
                finish = {"type": "stop", "matched": token}
            else:
                text = self.tokenizer.decode(out, skip_special_tokens=False)
                matched = next((s for s in stops if s and s in text), None)
                if matched is not None:
                    finish = {"type": "stop", "matched": matched}
            if finish is not None:
                break
        if reply.abort_after is not None and finish is None:
            finish = {"type": "abort", "message": "scripted abort", "status_code": 500}
        if finish is None:  # the script ran out before anything stopped it: the model would go on
            finish = {"type": "length", "length": max_new_tokens}
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        if finish["type"] == "stop" and isinstance(finish["matched"], str):
            text = text[:text.find(finish["matched"])] if finish["matched"] in text else text
        rows = []
        for token in out:
            self._counter += 1
            token_text = self.tokenizer.decode([token]) if body.get("return_text_in_logprobs") else None
            rows.append([-0.001 * self._counter, token, token_text])
        if reply.logprobs == "short" and rows:
            rows = rows[:-1]
        elif reply.logprobs == "nan" and rows:
            rows[0][0] = float("nan")
        elif reply.logprobs == "null" and rows:
            rows[0][0] = None
        elif reply.logprobs == "mismatch" and rows:
            rows[-1][1] = rows[-1][1] + 1
        return {"text": text, "output_ids": out,
                "meta_info": {"id": f"scripted-{len(self.requests)}", "finish_reason": finish,
                              "prompt_tokens": len(body.get("input_ids") or []), "completion_tokens": len(out),
                              "cached_tokens": 0, "weight_version": "default", "output_token_logprobs": rows}}


def continuing(text_or_ids, tokenizer=None):
    """A script entry for one model turn of `text_or_ids` that a client may fetch in several
    requests: each request gets the rest of the turn after the longest part of it that its
    input_ids already end with."""
    ids = tokenizer(text_or_ids, add_special_tokens=False)["input_ids"] if isinstance(text_or_ids, str) else list(text_or_ids)

    def reply(body: dict) -> Reply:
        held = body["input_ids"]
        done = max((k for k in range(1, min(len(ids), len(held)) + 1) if held[-k:] == ids[:k]), default=0)
        return Reply(ids=ids[done:])
    return reply


# --- helpers for workflow tests ---
class InlineRewardPool:
    """lib.reward_pool.RewardPool's interface without its processes: the reward runs inline, so an
    episode test needs no worker start-up (the pool itself has its own tests)."""

    num_timeouts = 0
    num_failures = 0

    async def score(self, fn, *args):
        return fn(*args)


def scripted_episode(tokenizer, script: list, episode):
    """Run `episode(client)` (an async function of a real lib.client.InferenceClient, e.g. a lambda
    around the script's arun_episode) against a ScriptedServer playing `script`; returns (what it
    returned, the server), whose `requests` and `answers` are the server's own record."""
    async def go(address):
        client = InferenceClient([address], max_retries=0)
        try:
            return await episode(client)
        finally:
            await client.close()
    with ScriptedServer(tokenizer, script) as server:
        return asyncio.run(go(server.address)), server


def split_by_mask(tokenizer, ids: list[int], mask: list[int], start: int = 0) -> tuple[str, str]:
    """(decoded tokens with loss_mask 1, decoded tokens with loss_mask 0), from position `start` on:
    what the model sampled and what the episode added around it."""
    pairs = list(zip(ids, mask))[start:]
    return tokenizer.decode([t for t, m in pairs if m]), tokenizer.decode([t for t, m in pairs if not m])
