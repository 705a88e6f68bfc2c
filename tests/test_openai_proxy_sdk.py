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
from lib.scripted_server import Reply  # noqa: E402
from lib.tiny_model import TOOLS_CHAT_TEMPLATE  # noqa: E402
from tests.test_openai_proxy import smollm2_tokenizer, tokenizer, user  # noqa: E402, F401 (fixtures)


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
@pytest.mark.parametrize("transport", [pytest.param("httpx", marks=pytest.mark.slow),
                                       pytest.param("aiohttp", marks=pytest.mark.slow), "in_process"])
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


# --- against the scripted SGLang stand-in ---
def scripted(tokenizer, script, agent, **proxy_kwargs):
    from tests.test_openai_proxy import run_agent
    return run_agent(tokenizer, script, agent, **proxy_kwargs)


def refused_with(error) -> tuple:
    return type(error).__name__, error.param, error.code


# --- 2. sampling settings during training ---
def test_a_training_session_samples_with_the_trainers_settings_and_refuses_others_by_name(tokenizer):
    async def agent(proxy):
        key, free = proxy.new_session(), proxy.new_session(train=False)
        refusals, messages = [], []
        async with openai.AsyncOpenAI(base_url=proxy.url, api_key=key, max_retries=0) as llm:
            for fields in ({"temperature": 0.7}, {"top_p": 0.9}, {"extra_body": {"top_k": 20}},
                           {"extra_body": {"min_p": 0.1}}, {"presence_penalty": 0.5},
                           {"response_format": {"type": "json_object"}}):
                with pytest.raises(openai.BadRequestError) as e:
                    await llm.chat.completions.create(model="policy", messages=[user("Q")], **fields)
                refusals.append(refused_with(e.value))
                messages.append(e.value.message)
            await llm.chat.completions.create(model="policy", messages=[user("Q")])  # left out: the trainer's
            await llm.chat.completions.create(model="policy", messages=[user("Q")], temperature=0.8, top_p=1.0)
        async with openai.AsyncOpenAI(base_url=proxy.url, api_key=free, max_retries=0) as llm:  # evaluation
            await llm.chat.completions.create(model="policy", messages=[user("Q")], temperature=0.0,
                                              extra_body={"top_k": 20})
        return refusals, messages, proxy.end_session(key), proxy.end_session(free)

    (refusals, messages, episode, _), server = scripted(tokenizer, [Reply("ok", eos=True)], agent,
                                                        train_sampling={"temperature": 0.8})
    assert [param for _, param, _ in refusals] == ["temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                                   "response_format"]
    assert all(code == "sampling_fixed_for_training" for _, _, code in refusals)
    assert "temperature=0.7 is not the trainer's temperature=0.8" in messages[0]
    trained_params, free_params = [b["sampling_params"] for b in server.requests[:2]], server.requests[2]["sampling_params"]
    assert len(server.requests) == 3  # the refused requests never reached the server
    for params in trained_params:
        assert (params["temperature"], params["top_p"], params["top_k"]) == (0.8, 1.0, -1) and "min_p" not in params
    assert (free_params["temperature"], free_params["top_k"]) == (0.0, 20)
    assert episode["requests"] == 2


def test_train_sampling_names_what_it_takes():
    with pytest.raises(ValueError, match="train_sampling takes temperature"):
        OpenAIProxy(None, None, train_sampling={"temp": 1.0})  # checked before the tokenizer is touched


@pytest.mark.parametrize("setting", [{"top_p": 0.9}, {"top_k": 20}, {"min_p": 0.05}, {"repetition_penalty": 1.05},
                                     {"presence_penalty": 0.5}, {"frequency_penalty": -0.5}])
def test_train_sampling_that_the_importance_weights_cannot_honour_is_refused_naming_the_field(setting):
    # the trainer recomputes log-probs at its temperature over the whole vocabulary, and the server's
    # log-probs ignore a top_p/top_k/min_p cut: a training session sampled so would get biased ratios
    [(name, value)] = setting.items()
    with pytest.raises(ValueError, match=rf"train_sampling {name}={value}.*leave {name} out"):
        OpenAIProxy(None, None, train_sampling={"temperature": 0.8, **setting})  # before the tokenizer is touched


def test_train_sampling_may_state_the_neutral_values(tokenizer):
    neutral = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
               "frequency_penalty": 0.0}
    proxy = OpenAIProxy(None, tokenizer, train_sampling={"temperature": 0.8, **neutral})
    assert proxy.train_sampling == {"temperature": 0.8, **neutral}


# --- 3. logprobs as OpenAI gives them ---
def test_logprobs_carry_each_tokens_text_and_utf8_bytes_not_the_vocabularys_spelling(tokenizer):
    text = "Pem Varo héllo 🎉 ok"

    async def agent(proxy):
        key = proxy.new_session()
        async with openai.AsyncOpenAI(base_url=proxy.url, api_key=key, max_retries=0) as llm:
            reply = await llm.chat.completions.create(model="policy", messages=[user("Q")], logprobs=True)
            with pytest.raises(openai.BadRequestError) as top:
                await llm.chat.completions.create(model="policy", messages=[user("Q")], logprobs=True, top_logprobs=2)
        return reply, top.value, proxy.end_session(key)

    (reply, top, episode), server = scripted(tokenizer, [Reply(text, eos=True)], agent)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == len(server.answers[0]["output_ids"])
    assert [e.logprob for e in entries] == pytest.approx([r[0] for r in server.answers[0]["meta_info"]["output_token_logprobs"]])
    assert bytes(b for e in entries[:-1] for b in e.bytes).decode() == text  # the last is <|im_end|>
    assert not any("Ġ" in e.token for e in entries) and " V" in [e.token for e in entries]  # the vocabulary says "ĠV"
    split = [e.token for e in entries if e.token.startswith("bytes:")]  # é and 🎉 span several tokens here
    assert split and all(len(e.bytes) == 1 for e in entries if e.token.startswith("bytes:"))
    assert refused_with(top)[1] == "top_logprobs"


def test_a_streamed_reply_that_is_only_a_tool_call_carries_its_logprobs(tokenizer):
    from tests.test_openai_proxy import SEARCH_TOOL
    call = '<tool_call>{"name": "search", "arguments": {"query": "Ostrel"}}</tool_call>'

    async def agent(proxy):
        key = proxy.new_session()
        async with openai.AsyncOpenAI(base_url=proxy.url, api_key=key, max_retries=0) as llm:
            stream = await llm.chat.completions.create(model="policy", messages=[user("Q")], tools=[SEARCH_TOOL],
                                                       logprobs=True, stream=True)
            return [c async for c in stream]

    chunks, server = scripted(tokenizer, [Reply(call, eos=True)], agent)
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert calls and calls[0][0].function.name == "search"
    assert len(entries) == len(server.answers[0]["output_ids"])
    assert "".join(e.token for e in entries[:-1]) == call


# --- 4. n samples, errors on every route, tool validation ---
@pytest.mark.parametrize("train_discarded", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_n_samples_are_n_choices_each_recorded_as_its_own_segment(tokenizer, stream, train_discarded):
    async def agent(proxy):
        key = proxy.new_session()
        async with openai.AsyncOpenAI(base_url=proxy.url, api_key=key, max_retries=0) as llm:
            reply = await llm.chat.completions.create(model="policy", messages=[user("Q")], n=3, seed=7, stream=stream)
            if stream:
                texts = {}
                async for chunk in reply:
                    for c in chunk.choices:
                        texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
                texts = [texts[i] for i in range(3)]
            else:
                texts = [c.message.content for c in reply.choices]
            # the agent goes on with the second sample: that segment continues
            follow = await llm.chat.completions.create(model="policy", messages=[
                user("Q"), {"role": "assistant", "content": texts[1]}, user("More")])
        return texts, follow.choices[0].message.content, proxy.end_session(key, train_discarded=train_discarded)

    script = [Reply("one", eos=True), Reply("two", eos=True), Reply("three", eos=True), Reply("four", eos=True)]
    (texts, follow, episode), server = scripted(tokenizer, script, agent)
    assert sorted(texts) == ["one", "three", "two"] and follow == "four"
    assert sorted(b["sampling_params"]["sampling_seed"] for b in server.requests[:3]) == [7, 8, 9]
    assert episode["requests"] == 4 and episode["discarded_turns"] == 2  # the choices the agent did not go on from
    ids, _ = trained(episode)
    continued = [s for s in episode["segments"] if tokenizer.decode(s["input_ids"][0]).endswith("four<|im_end|>")]
    assert len(continued) == 1 and f"{texts[1]}<|im_end|>" in tokenizer.decode(continued[0]["input_ids"][0])
    if train_discarded:
        assert len(episode["segments"]) == 3
        assert sorted(ids) == sorted(t for a in server.answers for t in a["output_ids"])  # each sampled token once
    else:  # only the conversation the agent went on with: its choice, then the follow-up
        assert len(episode["segments"]) == 1
        assert tokenizer.decode(ids) == f"{texts[1]}<|im_end|>four<|im_end|>"


def test_of_n_samples_the_agent_goes_on_from_none_of_the_first_choice_alone_is_trained(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        async with openai.AsyncOpenAI(base_url=proxy.url, api_key=key, max_retries=0) as llm:
            reply = await llm.chat.completions.create(model="policy", messages=[user("Q")], n=3, seed=7)
        return reply.choices[0].message.content, proxy.end_session(key)

    script = [Reply("one", eos=True), Reply("two", eos=True), Reply("three", eos=True)]
    (first, episode), _ = scripted(tokenizer, script, agent)
    [segment] = episode["segments"]  # what an SDK's `choices[0]` reads: the choice an agent takes
    assert tokenizer.decode(trained(episode)[0]) == f"{first}<|im_end|>" and episode["discarded_turns"] == 2


def test_every_path_and_method_answers_in_openais_error_shape(tokenizer):
    import aiohttp

    async def agent(proxy):
        key = proxy.new_session()
        out = []
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
            for method, path in (("GET", "/v1/chat/completions"), ("POST", "/v1/nothing"), ("GET", "/"),
                                 ("DELETE", "/v1/models"), ("PUT", "/agentrl/reward"), ("GET", "/v1/models/other")):
                async with http.request(method, f"http://{proxy.host}:{proxy.port}{path}") as r:
                    out.append((r.status, r.content_type, (await r.json())["error"]["message"]))
        async with openai.AsyncOpenAI(base_url=proxy.url, api_key=key, max_retries=0) as llm:
            with pytest.raises(openai.NotFoundError):
                await llm.get("/nothing", cast_to=object)
            model = await llm.models.retrieve("policy")
        return out, model.id

    (answers, model), _ = scripted(tokenizer, [Reply("x", eos=True)], agent)
    assert [status for status, _, _ in answers] == [405, 404, 404, 405, 405, 404]
    assert all(kind == "application/json" and message for _, kind, message in answers)
    assert "takes POST" in answers[0][2] and model == "policy"


BAD_TOOLS = [
    ([{"type": "function", "function": {"name": "web search"}}], "name"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "name"),
    ([{"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}], "parameters"),
    ([{"type": "function", "function": {"name": "s", "parameters": "a schema"}}], "parameters"),
    ([{"type": "function", "function": {"name": "s"}}, {"type": "function", "function": {"name": "s"}}], "unique"),
    ([{"type": "retrieval"}], "only function tools"),
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": "{}"}}
BAD_MESSAGES = [
    ([user("Q"), {"role": "tool", "tool_call_id": "call_1", "content": "r"}], "must answer a tool call"),
    ([user("Q"), {"role": "assistant", "content": None, "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "call_2", "content": "r"}], "answers none"),
    ([user("Q"), {"role": "assistant", "content": None, "tool_calls": [CALL]}, user("and?")], "results are missing"),
]


def test_tools_and_tool_messages_are_checked_as_openai_checks_them(tokenizer):
    from tests.test_openai_proxy import SEARCH_TOOL

    async def agent(proxy):
        key = proxy.new_session()
        out = []
        async with openai.AsyncOpenAI(base_url=proxy.url, api_key=key, max_retries=0) as llm:
            for tools, _ in BAD_TOOLS:
                with pytest.raises(openai.BadRequestError) as e:
                    await llm.chat.completions.create(model="policy", messages=[user("Q")], tools=tools)
                out.append((e.value.param, e.value.message))
            for messages, _ in BAD_MESSAGES:
                with pytest.raises(openai.BadRequestError) as e:
                    await llm.chat.completions.create(model="policy", messages=messages, tools=[SEARCH_TOOL])
                out.append((e.value.param, e.value.message))
            ok = [user("Q"), {"role": "assistant", "content": None, "tool_calls": [CALL]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "r"}]
            await llm.chat.completions.create(model="policy", messages=ok, tools=[SEARCH_TOOL])
        return out, proxy.end_session(key)

    (out, episode), server = scripted(tokenizer, [Reply("x", eos=True)], agent)
    for (param, message), (_, want) in zip(out, BAD_TOOLS + BAD_MESSAGES):
        assert want in message and param in ("tools", "messages"), message
    assert len(server.requests) == 1 and episode["requests"] == 1


# --- 5. structured output, reasoning, a base URL per session ---
def test_response_format_reaches_sglang_as_a_json_schema_and_the_cpu_server_names_itself_when_it_cannot(tokenizer):
    from lib.cpu_engine import parse_sampling_params
    from lib.http_body import BadRequest
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}

    async def agent(proxy):
        key = proxy.new_session()
        async with openai.AsyncOpenAI(base_url=proxy.url, api_key=key, max_retries=0) as llm:
            await llm.chat.completions.create(model="policy", messages=[user("Q")], response_format={
                "type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
            await llm.chat.completions.create(model="policy", messages=[user("Q")],
                                              response_format={"type": "json_object"})
            await llm.completions.create(model="policy", prompt="Q:", extra_body={"regex": "[A-Z][a-z]+"})
            with pytest.raises(openai.BadRequestError) as both:
                await llm.chat.completions.create(model="policy", messages=[user("Q")], extra_body={"regex": "a+"},
                                                  response_format={"type": "json_object"})
        return both.value.param

    both, server = scripted(tokenizer, [Reply('{"answer": "Pem"}', eos=True)], agent)
    assert [json.loads(b["sampling_params"]["json_schema"]) for b in server.requests[:2]] == [schema, {"type": "object"}]
    assert server.requests[2]["sampling_params"]["regex"] == "[A-Z][a-z]+" and "json_schema" not in server.requests[2]["sampling_params"]
    assert both == "regex" and len(server.requests) == 3
    with pytest.raises(BadRequest, match="json_schema.*not supported by lib.cpu_server.*use SGLang"):
        parse_sampling_params({"json_schema": json.dumps(schema)}, vocab_size=100)


def test_thinking_is_split_into_reasoning_content_and_the_conversation_stays_one_segment(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        async with openai.AsyncOpenAI(base_url=proxy.session_url(key), api_key="unused", max_retries=0) as llm:
            first = await llm.chat.completions.create(model="policy", messages=[user("Q")])
            message = first.choices[0].message
            messages = [user("Q"), {"role": "assistant", "content": message.content}, user("Sure?")]
            second = await llm.chat.completions.create(model="policy", messages=messages)
        return message, second.choices[0].message.content, proxy.end_session(key)

    script = [Reply("<think>The guild's founder is in the text.</think>Pem Varo.", eos=True), Reply("Yes.", eos=True)]
    (message, second, episode), server = scripted(tokenizer, script, agent)
    assert message.content == "Pem Varo." and message.model_extra["reasoning_content"] == "The guild's founder is in the text."
    assert second == "Yes."
    [segment] = episode["segments"]  # the thinking tokens stay in the record, as sampled
    ids, _ = trained(episode)
    assert ids == [t for a in server.answers for t in a["output_ids"]]
    assert server.requests[1]["input_ids"][:len(server.requests[0]["input_ids"])] == server.requests[0]["input_ids"]


def test_a_client_built_once_on_a_sessions_base_url_is_recorded_in_that_session(tokenizer):
    async def agent(proxy):
        keys = [proxy.new_session(), proxy.new_session()]
        for i, key in enumerate(keys):
            async with openai.AsyncOpenAI(base_url=proxy.session_url(key), api_key="sk-anything", max_retries=0) as llm:
                await llm.chat.completions.create(model="policy", messages=[user(f"Q{i}")])
        async with openai.AsyncOpenAI(base_url=proxy.session_url("agentrl-gone"), api_key="x", max_retries=0) as llm:
            with pytest.raises(openai.AuthenticationError):
                await llm.chat.completions.create(model="policy", messages=[user("Q")])
        return [proxy.end_session(key) for key in keys]

    episodes, _ = scripted(tokenizer, [Reply("a", eos=True), Reply("b", eos=True)], agent)
    assert [e["requests"] for e in episodes] == [1, 1]
    assert [tokenizer.decode(e["segments"][0]["input_ids"][0]).count(f"Q{i}") for i, e in enumerate(episodes)] == [1, 1]


# --- 6. the Responses API (the OpenAI Agents SDK) and /v1/completions ---
@pytest.mark.parametrize("api, streamed", [("responses", False), pytest.param("responses", True, marks=pytest.mark.slow),
                                           pytest.param("chat", False, marks=pytest.mark.slow)])
def test_an_openai_agents_sdk_agent_with_a_function_tool_runs_through_the_proxy(tokenizer, api, streamed):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # no trace export to OpenAI's servers
    looked_up = []

    @agents.function_tool
    def search(query: str) -> str:
        """Search the encyclopedia."""
        looked_up.append(query)
        return "Pem Varo founded the Ostrel Guild."

    async def agent(proxy):
        key = proxy.new_session()
        async with openai.AsyncOpenAI(base_url=proxy.session_url(key), api_key="unused", max_retries=0) as llm:
            model = (agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel)(
                model="policy", openai_client=llm)
            bot = agents.Agent(name="searcher", instructions="Answer with a name.", tools=[search], model=model)
            if streamed:
                run = agents.Runner.run_streamed(bot, "Who founded the Ostrel Guild?")
                async for _ in run.stream_events():
                    pass
            else:
                run = await agents.Runner.run(bot, "Who founded the Ostrel Guild?")
        return run.final_output, proxy.end_session(key)

    call = '<tool_call>{"name": "search", "arguments": {"query": "Ostrel Guild"}}</tool_call>'
    final = "<think>The result names him.</think>Pem Varo."  # reasoning too, streamed as its own item
    (answer, episode), server = scripted(tokenizer, [Reply(call, eos=True), Reply(final, eos=True)], agent)
    assert answer == "Pem Varo." and looked_up == ["Ostrel Guild"]
    [segment] = episode["segments"]  # the second call continued the first: one conversation, trained once
    ids, _ = trained(episode)
    assert ids == [t for a in server.answers for t in a["output_ids"]]
    assert server.requests[1]["input_ids"][:len(server.requests[0]["input_ids"])] == server.requests[0]["input_ids"]
    seen = tokenizer.decode(segment["input_ids"][0])
    assert seen.startswith("<|im_start|>system\nAnswer with a name.") and "Pem Varo founded the Ostrel Guild." in seen
    assert episode["tool_calls"] == 1


def test_completions_continue_their_own_text_and_keep_the_sampled_tokens(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        async with openai.AsyncOpenAI(base_url=proxy.url, api_key=key, max_retries=0) as llm:
            prompt = "Q: Who founded the Ostrel Guild?\nA:"
            first = await llm.completions.create(model="policy", prompt=prompt, max_tokens=8, logprobs=0)
            prompt += first.choices[0].text + "\nQ: Sure?\nA:"
            second = await llm.completions.create(model="policy", prompt=prompt, max_tokens=8, stream=True)
            text = "".join([c.choices[0].text async for c in second if c.choices])
            with pytest.raises(openai.BadRequestError) as echo:
                await llm.completions.create(model="policy", prompt=prompt, echo=True)
        return first, text, echo.value.param, proxy.end_session(key)

    (first, text, echo, episode), server = scripted(tokenizer, [Reply(" Pem Varo"), Reply(" Yes")], agent)
    assert first.choices[0].text == " Pem Varo" and text == " Yes" and echo == "echo"
    assert "".join(first.choices[0].logprobs.tokens) == " Pem Varo" and first.choices[0].finish_reason == "length"
    [segment] = episode["segments"]
    assert trained(episode)[0] == [t for a in server.answers for t in a["output_ids"]]
    assert server.requests[1]["input_ids"][:len(server.requests[0]["input_ids"]) + 8] == segment["input_ids"][0].tolist()[
        :len(server.requests[0]["input_ids"]) + 8]


def test_a_responses_request_it_cannot_serve_is_a_400_naming_its_field(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        out = []
        async with openai.AsyncOpenAI(base_url=proxy.url, api_key=key, max_retries=0) as llm:
            for fields in ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "r"}]},
                           {"input": "Q", "previous_response_id": "resp_1"},
                           {"input": "Q", "tools": [{"type": "web_search"}]},
                           {"input": [{"type": "image_generation_call", "id": "x"}]},
                           {"input": "Q", "include": 5}):
                with pytest.raises(openai.BadRequestError) as e:
                    await llm.responses.create(model="policy", **fields)
                out.append((e.value.param, e.value.message))
        return out, proxy.end_session(key)

    (out, episode), server = scripted(tokenizer, [Reply("x", eos=True)], agent)
    assert [param for param, _ in out] == ["input", "previous_response_id", "tools", "input", "include"]
    assert "must answer a tool call" in out[0][1] and server.requests == [] and episode["requests"] == 0


def test_closing_the_proxy_cancels_generations_in_flight_instead_of_waiting_for_them(tokenizer):
    server = TimedServer(reply_ids(tokenizer), delays_s=[5.0])

    async def agent(proxy):
        key = proxy.new_session()
        async with openai.AsyncOpenAI(base_url=proxy.url, api_key=key, max_retries=0) as llm:
            request = asyncio.create_task(llm.chat.completions.create(model="policy", messages=[user("Q")]))
            while not server.bodies:
                await asyncio.sleep(0.01)
            t0 = time.perf_counter()
            await proxy.close()  # the end of a run, with an episode still waiting for its turn
            closed_after_s = time.perf_counter() - t0
            with pytest.raises(openai.APIConnectionError):
                await request
        for _ in range(100):
            if server.cancelled:
                break
            await asyncio.sleep(0.01)
        return closed_after_s, proxy.end_session(key)

    closed_after_s, episode = with_proxy(tokenizer, server, agent)
    assert closed_after_s < 1.0  # was 5 s here (aiohttp waited for the handler, up to 60 s)
    assert server.cancelled == [0] and server.answered == [] and episode["requests"] == 0


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_the_logprob_bytes_of_any_texts_tokens_add_up_to_its_utf8_as_tokenized(request, tokenizer, model):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from lib.chat_format import token_bytes_reader
    tok = tokenizer if model == "tiny" else request.getfixturevalue("smollm2_tokenizer")
    read = token_bytes_reader(tok)

    @settings(max_examples=200, deadline=None, database=None)
    @given(text=st.text(st.characters(exclude_categories=("Cs",)), max_size=40))
    def check(text):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        entries = [read(i) for i in ids]
        # the text as tokenized: the tokenizer's normalizer may have changed it (NFC: U+2F800 is U+4E3D), and a
        # vocabulary without some byte drops it (SmolLM2 has no 0xF1): the decoding shows what the tokens hold
        assert bytes(b for _, raw in entries for b in raw).decode(errors="replace") == tok.decode(ids)
        for token, raw in entries:  # the text is the bytes, or says which bytes they are
            assert token == (bytes(raw).decode() if _utf8(raw) else "bytes:" + "".join(f"\\x{b:02x}" for b in raw))
    check()


def _utf8(raw: list[int]) -> bool:
    try:
        bytes(raw).decode()
        return True
    except UnicodeDecodeError:
        return False


def test_a_groups_shared_first_prompt_is_rendered_once_and_gets_the_same_ids(tokenizer, monkeypatch):
    from lib import openai_proxy
    from tests.test_openai_proxy import SEARCH_TOOL
    from lib.chat_format import render_ids
    rendered = []
    render = openai_proxy.render_text
    monkeypatch.setattr(openai_proxy, "render_text", lambda *a, **k: rendered.append(1) or render(*a, **k))

    async def agent(proxy):
        async def episode(tools):
            key = proxy.new_session()
            async with openai.AsyncOpenAI(base_url=proxy.url, api_key=key, max_retries=0) as llm:
                await llm.chat.completions.create(model="policy", messages=[user("Q")], **tools)
            return proxy.end_session(key)
        await asyncio.gather(*(episode({}) for _ in range(4)))
        await asyncio.gather(*(episode({"tools": [SEARCH_TOOL]}) for _ in range(2)))

    _, server = scripted(tokenizer, [Reply("ok", eos=True)], agent)
    plain, tooled = [b["input_ids"] for b in server.requests[:4]], [b["input_ids"] for b in server.requests[4:]]
    assert len(rendered) == 2  # once per distinct (messages, tools)
    assert all(ids == plain[0] for ids in plain) and all(ids == tooled[0] for ids in tooled)
    assert plain[0] == render_ids(tokenizer, [user("Q")], None, TOOLS_CHAT_TEMPLATE) and tooled[0] != plain[0]
