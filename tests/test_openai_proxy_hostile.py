"""lib/openai_proxy.py under hostile input (issue 27, P1-P8): model output and request bodies of
any shape get a 2xx or a 4xx naming the field, never a 5xx; a refused request changes nothing; a
huge request does not hold up other sessions; a client that goes away takes its generation with
it; and a turn is recorded for training only as its answer is handed to the client. Each test
failed on the code before (docs/reliability.md, round 2)."""
import asyncio
import json
import re
import time

import aiohttp
import pytest
from aiohttp import web
from hypothesis import example, given, settings
from hypothesis import strategies as st

openai = pytest.importorskip("openai")

from lib import openai_proxy  # noqa: E402
from lib.chat_format import MAX_JSON_DEPTH, parse_tool_calls  # noqa: E402
from lib.client import InferenceClient  # noqa: E402
from lib.openai_proxy import OpenAIProxy  # noqa: E402
from lib.scripted_server import Reply  # noqa: E402
from tests.test_openai_proxy import SEARCH_TOOL, run_agent, sdk, tokenizer, user  # noqa: E402, F401 (a fixture)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


async def post(proxy, key, path, raw: str | bytes, timeout_s: float = 60):
    """(status, JSON answer) of a raw body posted with the session's key."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
        async with http.post(proxy.url.replace("/v1", "") + path, data=raw,
                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            return r.status, json.loads(await r.text() or "null") if r.content_type == "application/json" else None


def chat_body(messages, **fields) -> str:
    return json.dumps({"model": "policy", "messages": messages, **fields})


# --- P1: a tool call nested thousands deep; a failure after generation records nothing ---
def test_a_tool_call_nested_thousands_deep_is_a_counted_parse_failure_not_a_500(tokenizer):
    text = "<tool_call>" + nested(1500) + "</tool_call>"  # json.loads gives up near 1000
    assert parse_tool_calls(text) == (text, None)

    async def agent(proxy):
        key = proxy.new_session()
        async with sdk(proxy, key) as llm:
            reply = await llm.chat.completions.create(model="policy", messages=[user("Q")], tools=[SEARCH_TOOL],
                                                      max_tokens=4000)
        return reply, proxy.end_session(key)

    (reply, episode), server = run_agent(tokenizer, [Reply(text, eos=True)], agent)
    assert reply.choices[0].message.content == text and reply.choices[0].finish_reason == "stop"
    assert episode["tool_call_parse_failures"] == 1 and len(episode["segments"]) == 1


# --- round 3, P1: a tool call whose JSON escapes a lone surrogate ---
@pytest.mark.parametrize("call", ['{"name": "\\ud800", "arguments": {}}',
                                  '{"name": "search", "arguments": {"query": "\\udfff"}}',
                                  '{"name": "search", "arguments": "{\\"query\\": \\"\\\\ud800\\"}"}'],
                         ids=["name", "arguments", "arguments-as-a-string"])
def test_a_tool_call_escaping_a_lone_surrogate_is_not_a_call(call):
    text = f"<tool_call>{call}</tool_call>"
    assert parse_tool_calls(text) == (text, None)


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_escaping_a_lone_surrogate_is_returned_as_content_counted_and_recorded(tokenizer, stream):
    # the model's escape cannot be rendered back as a call (no UTF-8 for it): read as text, its turn
    # is the agent's to judge; it was a 400 blaming the client's messages[0] (plain) or an exception
    # that cut the event stream (streamed), the generation lost either way
    text = '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>'

    async def agent(proxy):
        key = proxy.new_session()
        async with sdk(proxy, key) as llm:
            if not stream:
                reply = await llm.chat.completions.create(model="policy", messages=[user("Q")], tools=[SEARCH_TOOL])
                content, calls, finish = (reply.choices[0].message.content, reply.choices[0].message.tool_calls,
                                          reply.choices[0].finish_reason)
            else:
                content, calls, finish = "", None, None
                async for chunk in await llm.chat.completions.create(model="policy", messages=[user("Q")],
                                                                     tools=[SEARCH_TOOL], stream=True):
                    delta = chunk.choices[0].delta
                    content += delta.content or ""
                    calls = calls or delta.tool_calls
                    finish = chunk.choices[0].finish_reason or finish
        return (content, calls, finish), proxy.end_session(key)

    ((content, calls, finish), episode), server = run_agent(tokenizer, [Reply(text, eos=True)], agent)
    assert content == text and calls is None and finish == "stop"
    assert episode["tool_call_parse_failures"] == 1 and episode["requests"] == 1
    [segment] = episode["segments"]
    assert segment["input_ids"][0][segment["loss_mask"][0].bool()].tolist() == server.answers[0]["output_ids"]


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 3000])
def test_tool_call_arguments_nested_past_the_limit_are_a_parse_failure(depth):
    text = '<tool_call>{"name": "f", "arguments": {"a": ' + nested(depth - 1) + '}}</tool_call>'
    assert parse_tool_calls(text) == (text, None)
    ok = '<tool_call>{"name": "f", "arguments": {"a": ' + nested(MAX_JSON_DEPTH - 1) + '}}</tool_call>'
    assert parse_tool_calls(ok)[1] is not None


def test_a_failure_after_generation_is_a_500_and_records_nothing(tokenizer, monkeypatch):
    def broken(text):
        raise RuntimeError("a bug in reading the reply")
    monkeypatch.setattr(openai_proxy, "parse_tool_calls", broken)

    async def agent(proxy):
        key = proxy.new_session()
        status, _ = await post(proxy, key, "/v1/chat/completions", chat_body([user("Q")], tools=[SEARCH_TOOL]))
        return status, proxy.end_session(key)

    (status, episode), server = run_agent(tokenizer, [Reply("sampled, never sent", eos=True)], agent)
    assert status == 500 and len(server.requests) == 1
    assert episode["segments"] == [] and episode["requests"] == 0 and episode["completion_tokens"] == 0


# --- P1 / P8: the tool-call parser on any text ---
def regex_reading(text):
    """parse_tool_calls as it was (a regex, quadratic), for texts without deep nesting: the rewrite
    must read every text as it did, ids aside."""
    blocks = list(re.finditer(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL))
    if not blocks or "<tool_call>" in re.sub(r"<tool_call>(.*?)</tool_call>", "", text, flags=re.DOTALL):
        return text, None
    calls = []
    for block in blocks:
        try:
            call = json.loads(block.group(1).strip())
            args = call.get("arguments", {}) if isinstance(call, dict) else None
            args = json.loads(args) if isinstance(args, str) else args
        except (ValueError, AttributeError):
            return text, None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"] \
                or not isinstance(args, dict):
            return text, None
        calls.append((call["name"], args))
    content = re.sub(r"<tool_call>(.*?)</tool_call>", "", text, flags=re.DOTALL).strip()
    return content or None, calls


PIECES = ["<tool_call>", "</tool_call>", '{"name": "a", "arguments": {"x": [1, {"y": 2}]}}', '{"name": "b"}',
          '{"name": "c", "arguments": "{\\"q\\": 1}"}', '{"name": ""}', "[", "]", "{", "}", '"', "\n", " ", "text",
          "<tool_", "call>", "[" * 70, "]" * 70, "null", "é🎉"]


@settings(max_examples=400, deadline=None, database=None)
@example(pieces=["<tool_", "<tool_call>", '{"name": "b"}', "</tool_call>", "call>"])
@given(pieces=st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=6)), max_size=16))
def test_parse_tool_calls_never_raises_and_reads_every_text_as_the_regex_did(pieces):
    text = "".join(pieces)
    content, calls = parse_tool_calls(text)
    if calls is None:
        assert content == text
    else:
        assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls)
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:  # past it, the new limit decides
        want_content, want_calls = regex_reading(text)
        assert content == want_content
        assert want_calls == (None if calls is None else
                              [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls])


@pytest.mark.parametrize("text", ["<tool_call>" * 16000, "<tool_call>x" * 16000, "</tool_call>" * 16000,
                                  "<tool_call></tool_call>" * 16000, "<tool_call>[" * 16000,
                                  '<tool_call>{"name": "a", "arguments": {}}</tool_call>' * 4000],
                         ids=["open", "open-text", "close", "empty-blocks", "open-bracket", "valid-calls"])
def test_parse_tool_calls_takes_linear_time(text):
    start = time.perf_counter()
    parse_tool_calls(text)
    assert time.perf_counter() - start < 1.0  # was 22 s for 16000 <tool_call> (quadratic)


# --- P2: deep arguments in the history ---
@pytest.mark.parametrize("arguments", [nested(2000), '{"a": ' + nested(MAX_JSON_DEPTH) + "}",
                                       json.loads('{"a": ' + nested(MAX_JSON_DEPTH) + "}")],
                         ids=["string-2000-deep", "string-past-the-limit", "object-past-the-limit"])
def test_history_arguments_nested_past_the_limit_are_a_400_naming_them(tokenizer, arguments):
    messages = [user("Q"), {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "search", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "a", "content": "r"}]

    async def agent(proxy):
        key = proxy.new_session()
        answer = await post(proxy, key, "/v1/chat/completions", chat_body(messages, tools=[SEARCH_TOOL]))
        return answer, proxy.end_session(key)

    ((status, answer), episode), server = run_agent(tokenizer, [Reply("x", eos=True)], agent)
    assert status == 400 and answer["error"]["param"] == "messages"
    assert "messages[1].tool_calls[0].function.arguments" in answer["error"]["message"]
    assert server.requests == [] and episode["requests"] == 0


# --- P3 / P4: a reward that is not a finite number ---
@pytest.mark.parametrize("raw", ['{"reward": 1' + "9" * 399 + "}", '{"reward": Infinity}', '{"reward": -Infinity}',
                                 '{"reward": 1e999}', '{"reward": -1e999}', '{"reward": NaN}'],
                         ids=["400-digits", "Infinity", "-Infinity", "1e999", "-1e999", "NaN"])
def test_a_reward_that_is_not_a_finite_float_is_a_400_and_keeps_the_reward(tokenizer, raw):
    async def agent(proxy):
        key = proxy.new_session()
        first = await post(proxy, key, "/agentrl/reward", '{"reward": 0.5}')
        refused = await post(proxy, key, "/agentrl/reward", raw)
        return first, refused, proxy.end_session(key)

    (first, (status, answer), episode), _ = run_agent(tokenizer, [Reply("x", eos=True)], agent)
    assert first[0] == 200 and status == 400 and answer["error"]["param"] == "reward"
    assert episode["reward"] == 0.5


@pytest.mark.parametrize("raw", ['{"reward": 1e39}', '{"reward": -3.5e38}', '{"reward": 1' + "0" * 39 + "}"],
                         ids=["1e39", "-3.5e38", "int-1e39"])
def test_a_reward_past_float32s_range_is_a_400_naming_the_field(tokenizer, raw):
    # finite as a Python float, but inf in the float32 rewards tensor: the group's advantages are NaN
    async def agent(proxy):
        key = proxy.new_session()
        largest = await post(proxy, key, "/agentrl/reward", '{"reward": 3.4028234663852886e38}')
        refused = await post(proxy, key, "/agentrl/reward", raw)
        return largest, refused, proxy.end_session(key)

    (largest, (status, answer), episode), _ = run_agent(tokenizer, [Reply("x", eos=True)], agent)
    assert largest[0] == 200 and status == 400 and answer["error"]["param"] == "reward"
    assert "float32" in answer["error"]["message"] and episode["reward"] == 3.4028234663852886e38


@pytest.mark.parametrize("stop", [["a"] * 17, ["a" * 1025], ["a" * 600, "b" * 600]],
                         ids=["17 strings", "1,025 characters", "1,200 characters in all"])
def test_too_many_or_too_long_stop_strings_are_a_400_naming_the_field(tokenizer, stop):
    # as the CPU server bounds them (lib/cpu_engine.py): every token's stop check reads them all
    async def agent(proxy):
        key = proxy.new_session()
        return await post(proxy, key, "/v1/chat/completions", chat_body([user("Q")], stop=stop))

    (status, answer), server = run_agent(tokenizer, [Reply("x", eos=True)], agent)
    assert status == 400 and answer["error"]["param"] == "stop" and server.requests == []


def test_sixteen_stop_strings_of_1024_characters_in_all_are_served(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        return await post(proxy, key, "/v1/chat/completions", chat_body([user("Q")], stop=["ab" * 32] * 16))

    (status, answer), server = run_agent(tokenizer, [Reply("x", eos=True)], agent)
    assert status == 200 and server.requests[0]["sampling_params"]["stop"] == ["ab" * 32] * 16


@pytest.fixture(scope="module")
def live_proxy(tokenizer):
    """A proxy in front of a scripted server answering "ok", on a background loop: (proxy, server)."""
    from lib.async_rollout import BackgroundLoop
    from lib.scripted_server import ScriptedServer
    from lib.tiny_model import TOOLS_CHAT_TEMPLATE

    with ScriptedServer(tokenizer, [Reply("ok", eos=True)]) as server:
        bg = BackgroundLoop()
        client = InferenceClient([server.address], max_retries=0)
        proxy = OpenAIProxy(client, tokenizer, chat_template=TOOLS_CHAT_TEMPLATE, default_max_tokens=4)
        bg.run(proxy.start())
        yield proxy, server
        bg.run(proxy.close())
        bg.run(client.close())
        bg.close()


@settings(max_examples=100, deadline=None, database=None)
@given(reward=st.one_of(st.floats(), st.integers(-10 ** 400, 10 ** 400), st.booleans(), st.none(), st.text(max_size=4),
                        st.lists(st.floats(), max_size=2)))
def test_any_reward_gets_a_200_that_keeps_a_finite_float_or_a_400_that_changes_nothing(live_proxy, reward):
    import math

    import requests

    proxy, _ = live_proxy
    key = proxy.new_session()
    r = requests.post(proxy.url.replace("/v1", "/agentrl/reward"), data=json.dumps({"reward": reward}, allow_nan=True),
                      headers={"Authorization": f"Bearer {key}"}, timeout=10)
    episode = proxy.end_session(key)
    if r.status_code == 200:
        assert isinstance(episode["reward"], float) and math.isfinite(episode["reward"])
        assert episode["reward"] == float(reward) and not isinstance(reward, (bool, str))
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == "reward" and episode["reward"] is None


@settings(max_examples=100, deadline=None, database=None)
@given(arguments=st.one_of(st.integers(0, 1500).map(nested), st.integers(0, 1500).map(lambda n: '{"a": ' + nested(n) + "}"),
                           st.text(st.characters(exclude_categories=()), max_size=8),
                           st.recursive(st.none() | st.floats() | st.text(max_size=3),
                                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                                            st.text(max_size=3), inner, max_size=3), max_leaves=8).map(json.dumps)))
def test_any_tool_call_arguments_in_the_history_get_a_200_or_a_400_that_changes_nothing(live_proxy, arguments):
    import requests

    proxy, server = live_proxy
    key = proxy.new_session()
    messages = [user("Q"), {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "search", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "a", "content": "r"}]
    sent = len(server.requests)
    r = requests.post(proxy.url + "/chat/completions", data=chat_body(messages, tools=[SEARCH_TOOL]),
                      headers={"Authorization": f"Bearer {key}"}, timeout=10)
    episode = proxy.end_session(key)
    assert r.status_code in (200, 400), r.text[:300]
    if r.status_code == 400:
        assert len(server.requests) == sent and episode["requests"] == 0 and episode["segments"] == []


# --- P5: a lone surrogate ---
LONE = "\ud800"


@pytest.mark.parametrize("fields, where", [
    ({"messages": [user(LONE)]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a" + LONE}]}]}, "messages[0]"),
    ({"messages": [user("Q"), {"role": "assistant", "content": "", "tool_calls": [{"id": "a", "type": "function",
      "function": {"name": "search", "arguments": '{"query": "\\ud800"}'}}]}, user("R")]}, "messages[1]"),
    ({"messages": [{"role": "user", "content": "Q", "name": LONE}]}, "messages[0]"),
    ({"messages": [user("Q")], "tools": [{"type": "function", "function": {"name": "f", "description": LONE}}]},
     "tools"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(tokenizer, fields, where):
    async def agent(proxy):
        key = proxy.new_session()
        answer = await post(proxy, key, "/v1/chat/completions", json.dumps({"model": "policy", **fields}))
        return answer, proxy.end_session(key)

    ((status, answer), episode), server = run_agent(tokenizer, [Reply("x", eos=True)], agent)
    assert status == 400 and where in answer["error"]["message"], answer
    assert answer["error"]["param"] == where.split("[")[0]
    assert server.requests == [] and episode["requests"] == 0


# --- P6: a huge message does not hold up the other sessions ---
def with_arguments(arguments: str) -> list[dict]:
    return [user("Q"), {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "search", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "a", "content": "r"}]


@pytest.mark.parametrize("messages, budget", [
    ([user("word " * 1_600_000)], 2048),  # 8 MB, past any budget-sized text: refused before it is rendered
    (with_arguments("[" + "[]," * 2_000_000 + "[]]"), 2048),  # 6 MB of arguments: refused before they are decoded
    ([user(" ".join(map(str, range(150_000))))], 100_000),  # 1 MB, 1M tokens: tokenized off the event loop, refused
], ids=["8MB-content-refused-untokenized", "6MB-arguments-refused-undecoded", "1MB-tokenized-off-the-loop"])
def test_a_huge_message_does_not_hold_up_another_sessions_requests(tokenizer, messages, budget):
    async def agent(proxy):
        huge_key, small_key = proxy.new_session(), proxy.new_session()
        huge = asyncio.create_task(post(proxy, huge_key, "/v1/chat/completions", chat_body(messages)))
        waits, last = [], time.perf_counter()
        async with sdk(proxy, small_key) as llm:
            while not huge.done():  # a short request every 0.1 s: how much longer than that did each take?
                await asyncio.sleep(0.1)
                await llm.chat.completions.create(model="policy", messages=[user("Q")], max_tokens=2)
                waits.append(time.perf_counter() - last - 0.1)
                last = time.perf_counter()
        return await huge, waits, proxy.end_session(huge_key)

    ((status, answer), waits, episode), _ = run_agent(tokenizer, [Reply("ok", eos=True)], agent,
                                                      max_context_tokens=budget)
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert max(waits) < 1.0, waits  # was the whole tokenization: 54 s for 30.8 MB
    assert episode["requests"] == 0 and episode["segments"] == []


def test_a_long_text_is_encoded_into_the_ids_a_short_one_would_get(tokenizer):
    from lib.chat_format import LONG_TEXT_CHARS, encode

    text = "<|im_start|>user\nWho founded the Ostrel Guild? é🎉 #### 12<|im_end|>\n" * (LONG_TEXT_CHARS // 40)
    assert len(text) > LONG_TEXT_CHARS  # encoded by encode_batch, which lets other threads run meanwhile
    assert encode(tokenizer, text) == tokenizer(text, add_special_tokens=False)["input_ids"]


# --- P7: a client that disconnects ---
class SlowServer:
    """An inference server that takes `delay_s` to answer and notes when a request is cancelled
    (its client hung up): SGLang and lib's CPU server abort such a request."""

    def __init__(self, delay_s: float):
        self.delay_s, self.started, self.cancelled = delay_s, [], []

    async def generate(self, request):
        self.started.append(time.perf_counter())
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled.append(time.perf_counter())
            raise
        return web.json_response({"text": "late", "output_ids": [5], "meta_info": {
            "id": "x", "finish_reason": {"type": "stop", "matched": 5}, "prompt_tokens": 1, "completion_tokens": 1,
            "output_token_logprobs": [[-0.5, 5, None]]}})

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_aborts_its_generation_and_nothing_is_recorded(tokenizer, stream):
    from lib.tiny_model import TOOLS_CHAT_TEMPLATE

    async def go():
        upstream = SlowServer(delay_s=1.5)
        client = InferenceClient([await upstream.start()], max_retries=0)
        proxy = OpenAIProxy(client, tokenizer, chat_template=TOOLS_CHAT_TEMPLATE)
        await proxy.start()
        try:
            key = proxy.new_session()
            body = chat_body([user("Q")], stream=stream).encode()
            reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
            while not upstream.started:
                await asyncio.sleep(0.01)
            writer.close()  # the agent gives up (a timeout, a cancelled task)
            closed = time.perf_counter()
            while not upstream.cancelled and time.perf_counter() - closed < upstream.delay_s + 0.5:
                await asyncio.sleep(0.01)
            aborted_after_s = (upstream.cancelled or [float("inf")])[0] - closed
            await asyncio.sleep(upstream.delay_s + 0.2 - (time.perf_counter() - closed))  # had it run on, it would be done
            return aborted_after_s, proxy.end_session(key)
        finally:
            await proxy.close()
            await client.close()
            await upstream.runner.cleanup()

    aborted_after_s, episode = asyncio.run(go())
    assert aborted_after_s < 0.5  # was never: the generation ran on to its end (17-21 s) and was recorded
    assert episode["segments"] == [] and episode["requests"] == 0 and episode["completion_tokens"] == 0


# --- the SDK's aiohttp transport ---
def test_the_requirements_give_the_openai_sdk_its_aiohttp_transport_and_the_agents_client_uses_it():
    import pathlib

    lines = (pathlib.Path(__file__).parent.parent / "requirements.txt").read_text().splitlines()
    assert any(line.replace(" ", "").startswith("openai[aiohttp]") for line in lines)

    async def transport():
        client = openai_proxy.sdk_aiohttp_client()
        try:
            return type(client._transport).__module__
        finally:
            await client.aclose()
    assert "aiohttp" in asyncio.run(transport())  # not httpx's own pool (docs/openai_proxy.md: what it costs)


# --- the Responses API and /v1/completions: any body gets a 2xx or a 4xx ---
_values = st.recursive(st.none() | st.booleans() | st.integers(-10 ** 20, 10 ** 20) | st.floats()
                       | st.text(st.characters(exclude_categories=()), max_size=8),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                       max_leaves=10)
_item = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "web_search", 5]),
    "role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "robot"]),
    "content": st.one_of(st.text(max_size=8), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["input_text", "output_text", "input_image"]), "text": st.text(max_size=8)}), max_size=2),
        _values),
    "call_id": st.sampled_from(["c1", "c2"]) | _values, "name": st.sampled_from(["search", "bad name"]) | _values,
    "arguments": st.sampled_from(["{}", '{"q": "x"}', "not json"]) | _values, "output": _values})
_responses_body = st.fixed_dictionaries({"input": st.one_of(st.text(max_size=8), st.lists(_item, max_size=4), _values)},
                                        optional={"model": _values, "instructions": _values, "stream": _values,
                                                  "tools": _values, "text": _values, "max_output_tokens": _values,
                                                  "temperature": _values, "include": _values, "top_logprobs": _values,
                                                  "previous_response_id": _values, "frobnicate": _values})
_completions_body = st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=12), _values)},
                                          optional={"model": _values, "stream": _values, "logprobs": _values, "n": _values,
                                                    "echo": _values, "suffix": _values, "best_of": _values,
                                                    "max_tokens": _values, "stop": _values, "seed": _values})


@settings(max_examples=60, deadline=None, database=None)
@given(endpoint_body=st.one_of(_responses_body.map(lambda b: ("/responses", b)),
                               _completions_body.map(lambda b: ("/completions", b))))
def test_any_responses_or_completions_body_gets_a_2xx_or_a_4xx_that_changes_nothing(live_proxy, endpoint_body):
    import requests

    proxy, server = live_proxy
    path, body = endpoint_body
    key = proxy.new_session()
    sent = len(server.requests)
    r = requests.post(proxy.url + path, data=json.dumps(body, allow_nan=True),
                      headers={"Authorization": f"Bearer {key}"}, timeout=10)
    episode = proxy.end_session(key)
    assert r.status_code in (200, 400), (r.status_code, r.text[:300])
    if r.status_code == 400:
        assert r.json()["error"]["message"]
        assert len(server.requests) == sent and episode["requests"] == 0 and episode["segments"] == []


_FIELDS = {"/chat/completions": ({"messages": [{"role": "user", "content": "Q"}]}, [
               "temperature", "top_p", "top_k", "min_p", "presence_penalty", "repetition_penalty", "max_tokens", "stop",
               "seed", "n", "stream", "stream_options", "tools", "tool_choice", "logprobs", "top_logprobs",
               "response_format", "regex", "logit_bias", "user"]),
           "/responses": ({"input": "Q"}, [
               "instructions", "tools", "tool_choice", "stream", "text", "max_output_tokens", "temperature", "include",
               "top_logprobs", "metadata", "truncation", "reasoning"]),
           "/completions": ({"prompt": "Q:"}, [
               "max_tokens", "stop", "seed", "n", "stream", "logprobs", "echo", "suffix", "best_of", "regex", "top_k"])}


@settings(max_examples=80, deadline=None, database=None)
@given(case=st.sampled_from(sorted(_FIELDS)).flatmap(
    lambda path: st.tuples(st.just(path), st.sampled_from(_FIELDS[path][1]), _values)))
def test_any_value_of_any_field_on_a_valid_request_gets_a_2xx_or_a_4xx_naming_it(live_proxy, case):
    import requests

    proxy, server = live_proxy
    path, field, value = case
    key = proxy.new_session()
    sent = len(server.requests)
    r = requests.post(proxy.url + path, data=json.dumps({**_FIELDS[path][0], field: value}, allow_nan=True),
                      headers={"Authorization": f"Bearer {key}"}, timeout=10)
    episode = proxy.end_session(key)
    assert r.status_code in (200, 400), (r.status_code, r.text[:300])
    if r.status_code == 400:
        assert r.json()["error"]["param"] in (field, f"{field}.format", "text.format"), r.text[:300]
        assert len(server.requests) == sent and episode["requests"] == 0
