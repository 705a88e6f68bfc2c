"""lib/openai_proxy.py as agent authors meet it through the real SDKs: the openai SDK's timeouts and
retries against a slow inference server, episodes cancelled mid-request, sampling settings that
would break training, logprobs as OpenAI gives them, n samples, errors on every route, tool
validation, per-session base URLs, structured output, reasoning, the Responses API (the OpenAI
Agents SDK's Runner) and /v1/completions."""
import asyncio
import json
import logging
import time

import pytest
from aiohttp import web

openai = pytest.importorskip("openai")

from lib.client import InferenceClient  # noqa: E402
from lib.openai_proxy import OpenAIProxy  # noqa: E402
from lib.tiny_model import TOOLS_CHAT_TEMPLATE  # noqa: E402
from tests.test_openai_proxy import tokenizer, user  # noqa: E402, F401 (a fixture)


class TimedServer:
    """An inference server whose i-th /generate answer waits `delays_s[i]` (the last repeats) and
    then samples `reply_ids`; each answer's log-probs are -0.01 x (its index + 1), so a test can
    tell which request a recorded token came from. Notes requests that were cancelled (their
    client hung up), as SGLang and lib's CPU server abort them."""

    def __init__(self, reply_ids: list[int], delays_s: list[float]):
        self.reply_ids, self.delays_s = reply_ids, delays_s
        self.bodies, self.cancelled, self.answered = [], [], []

    async def generate(self, request):
        body = await request.json()
        index = len(self.bodies)
        self.bodies.append(body)
        try:
            await asyncio.sleep(self.delays_s[min(index, len(self.delays_s) - 1)])
        except asyncio.CancelledError:
            self.cancelled.append(index)
            raise
        self.answered.append(index)
        out = self.reply_ids[:body["sampling_params"]["max_new_tokens"]]
        last = out[-1] if out else None
        stops = set(body["sampling_params"].get("stop_token_ids") or [])
        finish = {"type": "stop", "matched": last} if last in stops else {"type": "length", "length": len(out)}
        return web.json_response({"text": "", "output_ids": out, "meta_info": {
            "id": str(index), "finish_reason": finish, "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(out), "cached_tokens": 0, "weight_version": "0",
            "output_token_logprobs": [[-0.01 * (index + 1), t, None] for t in out]}})

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def with_proxy(tokenizer, server: TimedServer, agent, **proxy_kwargs):
    """`await agent(proxy)` against a proxy in front of `server`, all on one event loop."""
    proxy_kwargs.setdefault("chat_template", TOOLS_CHAT_TEMPLATE)

    async def go():
        client = InferenceClient([await server.start()], max_retries=0)
        proxy = OpenAIProxy(client, tokenizer, **proxy_kwargs)
        await proxy.start()
        try:
            return await agent(proxy)
        finally:
            await proxy.close()
            await client.close()
            await server.runner.cleanup()
    return asyncio.run(go())


def reply_ids(tokenizer, text="Pem Varo."):
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def trained(episode):
    """(ids, log-probs) of every trained token of an episode."""
    ids, lps = [], []
    for s in episode["segments"]:
        mask = s["loss_mask"][0].bool()
        ids += s["input_ids"][0][mask].tolist()
        lps += s["logprobs"][0][mask].tolist()
    return ids, lps


def sdk_transports(proxy):
    """The openai SDK's three ways to reach the proxy: httpx (its default), aiohttp, in-process."""
    from openai import DefaultAioHttpClient
    return {"httpx": None, "aiohttp": DefaultAioHttpClient(), "in_process": proxy.http_client()}


# --- 1. a reply is trained only if its client received it ---
@pytest.mark.parametrize("transport", ["httpx", "aiohttp", "in_process"])
def test_sdk_timeouts_and_retries_leave_only_the_reply_the_agent_got(tokenizer, transport):
    ids = reply_ids(tokenizer)
    server = TimedServer(ids, delays_s=[3.0, 3.0, 0.0])  # two attempts time out, the third answers

    async def agent(proxy):
        key = proxy.new_session()
        llm = openai.AsyncOpenAI(base_url=proxy.url, api_key=key, timeout=0.5, max_retries=2,
                                 http_client=sdk_transports(proxy)[transport])
        async with llm:
            reply = await llm.chat.completions.create(model="policy", messages=[user("Who founded it?")])
        await asyncio.sleep(0.3)  # any late recording would land now
        return reply, proxy.end_session(key)

    reply, episode = with_proxy(tokenizer, server, agent)
    assert reply.choices[0].message.content == "Pem Varo."
    assert len(server.bodies) == 3 and server.cancelled == [0, 1] and server.answered == [2]
    [segment] = episode["segments"]  # no orphan segment from the attempts that timed out
    assert trained(episode) == (ids, pytest.approx([-0.03] * len(ids)))  # the third answer's tokens
    assert episode["requests"] == 1 and episode["completion_tokens"] == len(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_a_cancelled_episode_records_nothing_and_logs_no_traceback(tokenizer, stream, caplog):
    ids = reply_ids(tokenizer)
    server = TimedServer(ids, delays_s=[1.0])

    async def agent(proxy):
        from openai import DefaultAioHttpClient
        key = proxy.new_session()
        async with openai.AsyncOpenAI(base_url=proxy.url, api_key=key, max_retries=0,
                                      http_client=DefaultAioHttpClient()) as llm:
            async def episode():
                reply = await llm.chat.completions.create(model="policy", messages=[user("Q")], stream=stream)
                if stream:
                    async for _ in reply:
                        pass
            tasks = [asyncio.create_task(episode()) for _ in range(4)]
            await asyncio.sleep(0.5)
            for task in tasks:  # async training drops the episodes (a deadline, a stale group)
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.sleep(1.0)  # past the server's delay: a generation left running would be answered
        return proxy.end_session(key)

    with caplog.at_level(logging.DEBUG):
        episode = with_proxy(tokenizer, server, agent)
    assert sorted(server.cancelled) == [0, 1, 2, 3] and server.answered == []
    assert episode["segments"] == [] and episode["requests"] == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
