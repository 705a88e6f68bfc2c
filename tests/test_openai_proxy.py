"""lib/openai_proxy.py: an agent written with the openai SDK, run against the proxy in front of a
scripted SGLang stand-in, is recorded token for token: one segment per unbroken conversation, the
sampled ids with the server's log-probs, tool calls both ways, concurrent sessions apart, and every
bad request answered with a 4xx that changes nothing."""
import asyncio
import json

import aiohttp
import pytest

openai = pytest.importorskip("openai")

from lib.chat_format import (parse_tool_calls, render_ids, render_text, template_renders_tools,  # noqa: E402
                             to_template_messages)
from lib.client import InferenceClient  # noqa: E402
from lib.openai_proxy import OpenAIProxy, SessionFailed  # noqa: E402
from lib.scripted_server import Reply, ScriptedServer  # noqa: E402
from lib.tiny_model import TOOLS_CHAT_TEMPLATE  # noqa: E402

SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Search the encyclopedia.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from lib.tiny_model import default_tiny_model_dir

    return AutoTokenizer.from_pretrained(default_tiny_model_dir())


def run_agent(tokenizer, script, agent, incremental_streaming=False, **proxy_kwargs):
    """Run `await agent(proxy)` against a proxy in front of a scripted server: (its result, server)."""
    proxy_kwargs.setdefault("chat_template", TOOLS_CHAT_TEMPLATE)

    async def go(address):
        client = InferenceClient([address], max_retries=0)
        proxy = OpenAIProxy(client, tokenizer, **proxy_kwargs)
        await proxy.start()
        try:
            return await agent(proxy)
        finally:
            await proxy.close()
            await client.close()
    with ScriptedServer(tokenizer, script, incremental_streaming=incremental_streaming) as server:
        return asyncio.run(go(server.address)), server


def sdk(proxy, key):
    return openai.AsyncOpenAI(base_url=proxy.url, api_key=key, max_retries=0)


def user(text):
    return {"role": "user", "content": text}


def sampled(segments):
    """Every trained token of an episode, segment after segment: (ids, log-probs)."""
    ids, lps = [], []
    for s in segments:
        mask = s["loss_mask"][0].bool()
        ids += s["input_ids"][0][mask].tolist()
        lps += s["logprobs"][0][mask].tolist()
    return ids, lps


def assert_trained_once(segments, server):
    """The episode's trained tokens are exactly the server's sampled ones, in order, with its log-probs."""
    ids, lps = sampled(segments)
    want_ids, want_lps = served(server)
    assert ids == want_ids and lps == pytest.approx(want_lps, abs=1e-6)


def served(server):
    ids = [t for a in server.answers for t in a["output_ids"]]
    lps = [row[0] for a in server.answers for row in a["meta_info"]["output_token_logprobs"]]
    return ids, lps


# --- token-exact recording ---
def test_a_conversation_is_one_segment_holding_every_sampled_token_with_its_logprob(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        messages = [user("Who founded the Ostrel Guild?")]
        async with sdk(proxy, key) as llm:
            for follow_up in ("Are you sure?", "Say it again."):
                reply = await llm.chat.completions.create(model="policy", messages=messages)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content}, user(follow_up)]
            await llm.chat.completions.create(model="policy", messages=messages)
        return proxy.end_session(key), messages

    script = [Reply("Pem Varo.", eos=True), Reply("Yes, Pem Varo.", eos=True), Reply("Pem Varo.", eos=True)]
    (episode, messages), server = run_agent(tokenizer, script, agent)
    [segment] = episode["segments"]
    ids = segment["input_ids"][0].tolist()
    assert_trained_once(episode["segments"], server)
    assert (segment["logprobs"][0][segment["loss_mask"][0] == 0] == 0).all()
    for body in server.requests:  # each request continued the record, token for token
        assert ids[:len(body["input_ids"])] == body["input_ids"]
    # here the sampled ids are the text's own encoding, so the record is the template's rendering
    conversation = messages + [{"role": "assistant", "content": "Pem Varo."}]
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(conversation, tokenize=False).rstrip("\n")
    assert episode["requests"] == 3 and episode["new_segments"] == 1
    assert segment["versions"][0][segment["loss_mask"][0].bool()].eq(0).all()


def test_earlier_turns_keep_the_ids_the_model_sampled_not_a_re_encoding_of_their_text(tokenizer):
    text = "Pem Varo"
    unusual = [tokenizer.convert_tokens_to_ids(c) for c in tokenizer.convert_ids_to_tokens(
        tokenizer(text, add_special_tokens=False)["input_ids"]) for c in c]  # one id per character
    assert unusual != tokenizer(text, add_special_tokens=False)["input_ids"]

    async def agent(proxy):
        key = proxy.new_session()
        async with sdk(proxy, key) as llm:
            first = await llm.chat.completions.create(model="policy", messages=[user("Who?")])
            assert first.choices[0].message.content == text
            await llm.chat.completions.create(model="policy", messages=[
                user("Who?"), {"role": "assistant", "content": text}, user("Sure?")])
        return proxy.end_session(key)

    episode, server = run_agent(tokenizer, [Reply(ids=unusual, eos=True), Reply("Yes.", eos=True)], agent)
    prompt = server.requests[0]["input_ids"]
    second = server.requests[1]["input_ids"]
    assert second[len(prompt):len(prompt) + len(unusual) + 1] == unusual + [tokenizer.eos_token_id]
    assert len(episode["segments"]) == 1


def test_a_reply_cut_by_max_tokens_is_closed_by_an_untrained_end_of_turn(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        async with sdk(proxy, key) as llm:
            cut = await llm.chat.completions.create(model="policy", messages=[user("Count.")], max_tokens=3)
            await llm.chat.completions.create(model="policy", messages=[
                user("Count."), {"role": "assistant", "content": cut.choices[0].message.content}, user("Go on.")])
        return proxy.end_session(key), cut

    (episode, cut), server = run_agent(tokenizer, [Reply("one two three four five"), Reply("six", eos=True)], agent)
    assert cut.choices[0].finish_reason == "length"
    assert server.requests[0]["sampling_params"]["max_new_tokens"] == 3
    ids, mask = episode["segments"][0]["input_ids"][0].tolist(), episode["segments"][0]["loss_mask"][0].tolist()
    end = len(server.requests[0]["input_ids"]) + 3
    assert ids[end] == tokenizer.eos_token_id and mask[end] == 0
    assert ids.count(tokenizer.eos_token_id) == 4  # user, cut reply (added), user, final reply (sampled)


def test_a_reply_closed_by_another_stop_id_is_followed_by_the_templates_untrained_end_of_turn(tokenizer):
    # Qwen2.5 stops on <|endoftext|> as well as <|im_end|>, but its template closes a turn with
    # <|im_end|>: the next turn must condition on that, as the template renders the conversation
    endoftext, im_end = tokenizer.convert_tokens_to_ids("<|endoftext|>"), tokenizer.eos_token_id
    assert endoftext != im_end
    said = tokenizer("Pem Varo.", add_special_tokens=False)["input_ids"]

    async def agent(proxy):
        key = proxy.new_session()
        async with sdk(proxy, key) as llm:
            first = await llm.chat.completions.create(model="policy", messages=[user("Who?")])
            await llm.chat.completions.create(model="policy", messages=[
                user("Who?"), {"role": "assistant", "content": first.choices[0].message.content}, user("Sure?")])
        return proxy.end_session(key), first

    script = [Reply(ids=said + [endoftext]), Reply("Yes.", eos=True)]
    (episode, first), server = run_agent(tokenizer, script, agent, stop_token_ids=[im_end, endoftext])
    assert first.choices[0].finish_reason == "stop" and first.choices[0].message.content == "Pem Varo."
    [segment] = episode["segments"]
    ids, mask = segment["input_ids"][0].tolist(), segment["loss_mask"][0].tolist()
    end = len(server.requests[0]["input_ids"]) + len(said) + 1
    assert ids[end - 1:end + 1] == [endoftext, im_end] and mask[end - 1:end + 1] == [1, 0]
    assert server.requests[1]["input_ids"] == ids[:len(server.requests[1]["input_ids"])]
    assert_trained_once(episode["segments"], server)


def test_a_stop_string_is_left_out_of_the_content_but_its_tokens_stay_trained(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        async with sdk(proxy, key) as llm:
            reply = await llm.chat.completions.create(model="policy", messages=[user("Search.")], stop=["</search>"])
        return proxy.end_session(key), reply

    (episode, reply), server = run_agent(tokenizer, [Reply("<search> Ostrel </search> then more")], agent)
    assert reply.choices[0].message.content == "<search> Ostrel " and reply.choices[0].finish_reason == "stop"
    ids, _ = sampled(episode["segments"])
    assert tokenizer.decode(ids).endswith("</search>")
    assert server.requests[0]["sampling_params"]["stop"] == ["</search>"]


def test_a_rewritten_history_starts_a_new_segment_and_each_sampled_token_is_trained_once(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        async with sdk(proxy, key) as llm:
            a = await llm.chat.completions.create(model="policy", messages=[user("Q1")])
            history = [user("Q1"), {"role": "assistant", "content": a.choices[0].message.content}, user("Q2")]
            b = await llm.chat.completions.create(model="policy", messages=history)
            summary = [user("Earlier you said " + b.choices[0].message.content + ". Q3")]
            await llm.chat.completions.create(model="policy", messages=summary)
        return proxy.end_session(key)

    script = [Reply("Alpha.", eos=True), Reply("Beta.", eos=True), Reply("Gamma.", eos=True)]
    episode, server = run_agent(tokenizer, script, agent)
    assert len(episode["segments"]) == 2 and episode["new_segments"] == 2
    assert_trained_once(episode["segments"], server)
    second = episode["segments"][1]
    assert second["input_ids"][0].tolist()[:len(server.requests[2]["input_ids"])] == server.requests[2]["input_ids"]


def test_asking_twice_from_the_same_point_forks_a_segment_that_trains_only_its_new_reply(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        async with sdk(proxy, key) as llm:
            a = await llm.chat.completions.create(model="policy", messages=[user("Q")])
            history = [user("Q"), {"role": "assistant", "content": a.choices[0].message.content}, user("Again")]
            await llm.chat.completions.create(model="policy", messages=history)
            await llm.chat.completions.create(model="policy", messages=history)  # a second sample, same context
        return proxy.end_session(key, train_discarded=True)  # B, which C replaces, is trained too

    script = [Reply("A.", eos=True), Reply("B.", eos=True), Reply("C.", eos=True)]
    episode, server = run_agent(tokenizer, script, agent)
    first, fork = episode["segments"]
    assert server.requests[1]["input_ids"] == server.requests[2]["input_ids"]  # the fork saw the same tokens
    assert fork["input_ids"][0].tolist()[:len(server.requests[2]["input_ids"])] == server.requests[2]["input_ids"]
    assert_trained_once(episode["segments"], server)  # A, B in the first; C alone in the fork


def test_concurrent_requests_on_one_conversation_fork_instead_of_interleaving(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        async with sdk(proxy, key) as llm:
            a = await llm.chat.completions.create(model="policy", messages=[user("Q")])
            history = [user("Q"), {"role": "assistant", "content": a.choices[0].message.content}, user("Next")]
            await asyncio.gather(*[llm.chat.completions.create(model="policy", messages=history) for _ in range(2)])
        return proxy.end_session(key, train_discarded=True)  # two samples of one prompt: both trained

    script = [Reply("A.", eos=True), Reply("B.", eos=True, delay_s=0.2), Reply("C.", eos=True, delay_s=0.2)]
    episode, server = run_agent(tokenizer, script, agent)
    assert len(episode["segments"]) == 2
    assert sorted(sampled(episode["segments"])[0]) == sorted(served(server)[0])


# --- what is trained: the replies the agent went on from ---
def assistant(reply):
    return {"role": "assistant", "content": reply.choices[0].message.content}


def answers(server, *indices):
    return [t for i in indices for t in server.answers[i]["output_ids"]]


def test_a_reply_asked_for_again_is_not_trained_and_the_one_the_agent_went_on_from_is(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        async with sdk(proxy, key) as llm:
            a = await llm.chat.completions.create(model="policy", messages=[user("Q")])
            history = [user("Q"), assistant(a), user("Again")]
            await llm.chat.completions.create(model="policy", messages=history)  # B: the agent throws it away
            c = await llm.chat.completions.create(model="policy", messages=history)  # and asks again
            await llm.chat.completions.create(model="policy", messages=history + [assistant(c), user("Thanks")])
        return proxy.end_session(key)

    script = [Reply("A.", eos=True), Reply("B.", eos=True), Reply("C.", eos=True), Reply("D.", eos=True)]
    episode, server = run_agent(tokenizer, script, agent)
    assert sampled(episode["segments"])[0] == answers(server, 0, 2, 3)  # A, then C and D: B is not trained
    assert episode["discarded_turns"] == 1 and episode["requests"] == 4
    first, fork = episode["segments"]
    # the first segment ends with A (B and the prompt it was sampled for are cut); the fork goes on from C
    assert first["input_ids"][0].tolist() == server.requests[0]["input_ids"] + answers(server, 0)
    assert fork["input_ids"][0].tolist()[:len(server.requests[3]["input_ids"])] == server.requests[3]["input_ids"]
    assert first["loss_mask"][0].tolist()[-1] == 1


def test_a_branch_the_agent_went_back_from_is_not_trained_with_every_reply_that_continued_it(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        async with sdk(proxy, key) as llm:
            a = await llm.chat.completions.create(model="policy", messages=[user("Q")])
            history = [user("Q"), assistant(a), user("Go on")]
            b = await llm.chat.completions.create(model="policy", messages=history)
            await llm.chat.completions.create(model="policy", messages=history + [assistant(b), user("More")])  # C
            b2 = await llm.chat.completions.create(model="policy", messages=history)  # back to before B
            await llm.chat.completions.create(model="policy", messages=history + [assistant(b2), user("Done?")])
        return proxy.end_session(key)

    script = [Reply(f"{x}.", eos=True) for x in ("A", "B", "C", "B2", "D")]
    episode, server = run_agent(tokenizer, script, agent)
    assert sampled(episode["segments"])[0] == answers(server, 0, 3, 4)  # A, B2, D: B and C (which continued B) not
    assert episode["discarded_turns"] == 2


def test_replies_to_different_prompts_are_all_trained_and_the_alternatives_can_be_kept(tokenizer):
    async def agent(proxy, train_discarded):
        key = proxy.new_session()
        async with sdk(proxy, key) as llm:
            a = await llm.chat.completions.create(model="policy", messages=[user("Q")])
            for follow_up in ("Why?", "When?", "When?"):  # two questions from one point, the second asked twice
                await llm.chat.completions.create(model="policy", messages=[user("Q"), assistant(a), user(follow_up)])
            await llm.chat.completions.create(model="policy", messages=[user("A sub-agent's own question")])
        return proxy.end_session(key, train_discarded=train_discarded)

    script = [Reply(f"{x}.", eos=True) for x in ("A", "B", "C", "C2", "E")]
    for train_discarded, trained in ((False, (0, 1, 3, 4)), (True, (0, 1, 2, 3, 4))):
        episode, server = run_agent(tokenizer, script, lambda proxy: agent(proxy, train_discarded))
        assert sorted(sampled(episode["segments"])[0]) == sorted(answers(server, *trained))
        assert episode["discarded_turns"] == 1  # C, asked for again: counted whether it is trained or not


def test_a_text_completion_asked_for_again_is_not_trained(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        async with sdk(proxy, key) as llm:
            await llm.completions.create(model="policy", prompt="Q:")
            b = await llm.completions.create(model="policy", prompt="Q:")
            await llm.completions.create(model="policy", prompt="Q:" + b.choices[0].text + " And?")
        return proxy.end_session(key)

    script = [Reply(" A.", eos=True), Reply(" B.", eos=True), Reply(" C.", eos=True)]
    episode, server = run_agent(tokenizer, script, agent)
    assert sampled(episode["segments"])[0] == answers(server, 1, 2) and episode["discarded_turns"] == 1


def test_concurrent_sessions_are_recorded_apart(tokenizer):
    def echo(body):  # the model answers with the number in the last user turn
        prompt = tokenizer.decode(body["input_ids"])
        return Reply(f"n={prompt.rsplit('count ', 1)[1].split('<', 1)[0]}.", eos=True, delay_s=0.05)

    async def one(proxy, n):
        key = proxy.new_session()
        async with sdk(proxy, key) as llm:
            messages = [user(f"count {n}")]
            reply = await llm.chat.completions.create(model="policy", messages=messages)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content}, user(f"count {n + 100}")]
            await llm.chat.completions.create(model="policy", messages=messages)
        return n, proxy.end_session(key)

    async def agent(proxy):
        return await asyncio.gather(*[one(proxy, n) for n in range(8)])

    episodes, server = run_agent(tokenizer, [echo], agent)
    assert len(server.requests) == 16
    for n, episode in episodes:
        [segment] = episode["segments"]
        ids, _ = sampled([segment])
        assert tokenizer.decode(ids, skip_special_tokens=True) == f"n={n}.n={n + 100}."




# --- the in-process HTTP client ---
def test_the_in_process_http_client_gets_the_answers_and_the_recording_a_socket_gets(tokenizer):
    def run(in_process):
        async def agent(proxy):
            if in_process:
                await proxy.close()  # the in-process client needs no listening socket
            key = proxy.new_session()
            answers = []
            async with openai.AsyncOpenAI(base_url=proxy.url, api_key=key, max_retries=0,
                                          http_client=proxy.http_client() if in_process else None) as llm:
                messages = [user("Who founded the Ostrel Guild?")]
                reply = await llm.chat.completions.create(model="policy", messages=messages, tools=[SEARCH_TOOL])
                call = reply.choices[0].message.tool_calls[0]
                answers.append((reply.choices[0].finish_reason, call.function.name, call.function.arguments,
                                reply.usage.model_dump()))
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": call.id, "content": "Pem Varo founded it."}]
                chunks = [c async for c in await llm.chat.completions.create(
                    model="policy", messages=messages, tools=[SEARCH_TOOL], stream=True, logprobs=True,
                    stream_options={"include_usage": True})]
                answers.append(("".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                                [c.choices[0].finish_reason for c in chunks if c.choices], chunks[-1].usage.model_dump(),
                                [t.logprob for c in chunks if c.choices and c.choices[0].logprobs
                                 for t in c.choices[0].logprobs.content]))
                with pytest.raises(openai.BadRequestError) as bad:
                    await llm.chat.completions.create(model="policy", messages=messages, temperature=3)
                answers.append((bad.value.status_code, bad.value.param, bad.value.code))
                with pytest.raises(openai.AuthenticationError) as unknown:
                    await llm.with_options(api_key="agentrl-nope").chat.completions.create(
                        model="policy", messages=messages)
                answers.append((unknown.value.status_code, unknown.value.code))
                answers.append([m.id async for m in llm.models.list()])
            episode = proxy.end_session(key)
            return answers, [{k: v.tolist() for k, v in s.items()} for s in episode["segments"]], episode["requests"]

        script = [Reply('<tool_call>{"name": "search", "arguments": {"query": "Ostrel Guild"}}</tool_call>', eos=True),
                  Reply("Pem Varo.", eos=True)]
        return run_agent(tokenizer, script, agent)[0]

    over_http, in_process = run(False), run(True)
    assert in_process == over_http
    assert in_process[0][0][0] == "tool_calls" and in_process[0][1][0] == "Pem Varo." and in_process[2] == 2


# --- tokenizing on the event loop ---
def test_the_proxys_encoder_gives_the_tokenizers_own_ids_for_any_text(tokenizer):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from lib.chat_format import encode

    specials = [t for t in tokenizer.all_special_tokens] + ["<|im_start|>", "<|im_end|>", "<tool_call>"]
    pieces = st.one_of(st.sampled_from(specials + ["\n", " ", "user", "assistant", "#### 12", "é", "🎉"]), st.text(max_size=12))

    @settings(max_examples=300, deadline=None, database=None)
    @given(text=st.lists(pieces, max_size=12).map("".join))
    def check(text):
        assert encode(tokenizer, text) == tokenizer(text, add_special_tokens=False)["input_ids"]
    check()


def test_a_tokenizer_that_splits_special_tokens_is_encoded_as_its_call_would(tokenizer):
    import copy

    from lib.chat_format import encode

    split = copy.deepcopy(tokenizer)
    split.split_special_tokens = True  # the Rust encoder is then set up otherwise: the proxy must not bypass __call__
    text = "<|im_start|>user\nhi<|im_end|>\n"
    assert encode(split, text) == split(text, add_special_tokens=False)["input_ids"] != encode(tokenizer, text)


# --- tool calls ---
@pytest.mark.parametrize("text, expected", [
    ('<tool_call>{"name": "search", "arguments": {"query": "Pem"}}</tool_call>', (None, [("search", {"query": "Pem"})])),
    ('Let me look.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>{"name": "b", "arguments": '
     '"{\\"x\\": 1}"}</tool_call>', ("Let me look.", [("a", {}), ("b", {"x": 1})])),
])
def test_qwen_tool_call_blocks_parse_into_openai_tool_calls(text, expected):
    content, calls = parse_tool_calls(text)
    assert content == expected[0]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected[1]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "search", "arguments": {"query": </tool_call>',  # not JSON
    '<tool_call>{"arguments": {"query": "x"}}</tool_call>',  # no name
    '<tool_call>{"name": "search", "arguments": ["x"]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "search", "arguments": {"query": "x"}}',  # never closed (cut by length)
    '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>oops</tool_call>',  # one of two broken
])
def test_a_malformed_tool_call_comes_back_as_plain_content(tokenizer, text):
    assert parse_tool_calls(text) == (text, None)

    async def agent(proxy):
        key = proxy.new_session()
        async with sdk(proxy, key) as llm:
            reply = await llm.chat.completions.create(model="policy", messages=[user("Q")], tools=[SEARCH_TOOL])
        return reply, proxy.end_session(key)

    (reply, episode), _ = run_agent(tokenizer, [Reply(text, eos=True)], agent)
    assert reply.choices[0].message.content == text and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop" and episode["tool_call_parse_failures"] == 1


def tool_conversation(stream):
    async def agent(proxy):
        key = proxy.new_session()
        async with sdk(proxy, key) as llm:
            messages = [user("Who founded the Ostrel Guild?")]
            if stream:
                chunks = [c async for c in await llm.chat.completions.create(
                    model="policy", messages=messages, tools=[SEARCH_TOOL], stream=True,
                    stream_options={"include_usage": True})]
                call = next(c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls)
                finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
                usage = chunks[-1].usage
                assistant = {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.id, "type": "function",
                     "function": {"name": call.function.name, "arguments": call.function.arguments}}]}
            else:
                reply = await llm.chat.completions.create(model="policy", messages=messages, tools=[SEARCH_TOOL])
                call, finish, usage = reply.choices[0].message.tool_calls[0], reply.choices[0].finish_reason, reply.usage
                assert reply.choices[0].message.content is None
                assistant = reply.choices[0].message.model_dump(exclude_none=True)
            messages += [assistant, {"role": "tool", "tool_call_id": call.id, "content": "Pem Varo founded it."}]
            final = await llm.chat.completions.create(model="policy", messages=messages, tools=[SEARCH_TOOL])
        return (call.function.name, json.loads(call.function.arguments), finish, usage.completion_tokens,
                final.choices[0].message.content, proxy.end_session(key))
    return agent


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_go_out_as_openai_tool_calls_and_tool_results_come_back_rendered(tokenizer, stream):
    call_text = '<tool_call>{"name": "search", "arguments": {"query": "Ostrel Guild"}}</tool_call>'
    script = [Reply(call_text, eos=True), Reply("Pem Varo", eos=True)]
    (name, args, finish, completion_tokens, final, episode), server = run_agent(
        tokenizer, script, tool_conversation(stream))
    assert (name, args, finish, final) == ("search", {"query": "Ostrel Guild"}, "tool_calls", "Pem Varo")
    assert completion_tokens == len(server.answers[0]["output_ids"])
    [segment] = episode["segments"]
    assert_trained_once([segment], server)
    first = server.requests[0]["input_ids"]
    new = tokenizer.decode(server.requests[1]["input_ids"][len(first) + len(server.answers[0]["output_ids"]):])
    assert new == "\n<|im_start|>user\n<tool_response>\nPem Varo founded it.\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert '"name": "search"' in tokenizer.decode(first)  # the tool was rendered into the system turn
    assert episode["tool_calls"] == 1


# --- tools for a chat template without a tools section (SmolLM2's ChatML, the tiny model's plain one) ---
@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from lib.model_names import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))  # built once, then cached


def test_a_template_renders_tools_only_if_it_shows_both_the_tool_list_and_the_calls(tokenizer):
    from lib.tiny_model import CHAT_TEMPLATE

    assert template_renders_tools(tokenizer, TOOLS_CHAT_TEMPLATE)
    assert not template_renders_tools(tokenizer, CHAT_TEMPLATE)
    lists_only = TOOLS_CHAT_TEMPLATE.replace("fn['name']", "'?'")  # shows the tools, writes calls without a name
    assert not template_renders_tools(tokenizer, lists_only)


@pytest.mark.slow
def test_smollm2s_template_does_not_render_tools(smollm2_tokenizer):
    assert not template_renders_tools(smollm2_tokenizer)


@pytest.mark.parametrize("system", [True, False])
@pytest.mark.parametrize("tools", [[SEARCH_TOOL], None])
def test_tools_as_text_on_plain_chatml_gives_the_ids_the_tools_template_gives(tokenizer, system, tools):
    from lib.tiny_model import CHAT_TEMPLATE

    call = lambda i, q: {"id": i, "type": "function",  # noqa: E731
                         "function": {"name": "search", "arguments": json.dumps({"query": q})}}
    messages = to_template_messages([{"role": "system", "content": "Be brief."}] * system + [
        user("Who founded the Ostrel Guild?"),
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call("a", "Ostrel Guild"), call("b", "Pem")]},
        {"role": "tool", "tool_call_id": "a", "content": "Pem Varo founded it."},  # two results: one user turn
        {"role": "tool", "tool_call_id": "b", "content": "Pem Varo, a smith."},
        {"role": "assistant", "content": None, "tool_calls": [call("c", "Varo")]},
        {"role": "tool", "tool_call_id": "c", "content": "nothing"}, user("So?")])
    assert (render_ids(tokenizer, messages, tools, CHAT_TEMPLATE, tools_as_text=True)
            == render_ids(tokenizer, messages, tools, TOOLS_CHAT_TEMPLATE))


def tool_rounds():
    """An agent that calls tools until the model answers: each call answered with a result."""
    async def agent(proxy):
        key = proxy.new_session()
        messages, calls = [user("Who founded the Ostrel Guild?")], []
        async with sdk(proxy, key) as llm:
            while True:
                reply = await llm.chat.completions.create(model="policy", messages=messages, tools=[SEARCH_TOOL])
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                assert reply.choices[0].finish_reason == "tool_calls"
                for call in message.tool_calls:
                    calls.append((call.function.name, json.loads(call.function.arguments)))
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": f"result {len(calls)}"})
        return calls, messages, proxy.end_session(key)
    return agent


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_two_rounds_of_tool_calls_through_a_template_without_tools_are_one_segment_trained_once(
        request, tokenizer, model):
    from lib.tiny_model import CHAT_TEMPLATE

    tok, template = (tokenizer, CHAT_TEMPLATE) if model == "tiny" else (request.getfixturevalue("smollm2_tokenizer"), None)
    queries = ["Ostrel Guild", "Pem Varo"]
    script = [Reply(f'<tool_call>{{"name": "search", "arguments": {{"query": "{q}"}}}}</tool_call>', eos=True)
              for q in queries] + [Reply("Pem Varo.", eos=True)]
    (calls, messages, episode), server = run_agent(tok, script, tool_rounds(), chat_template=template)
    assert calls == [("search", {"query": q}) for q in queries] and messages[-1]["content"] == "Pem Varo."
    [segment] = episode["segments"]
    assert_trained_once([segment], server)
    ids = segment["input_ids"][0].tolist()
    for body in server.requests:  # each request continued the record, token for token
        assert ids[:len(body["input_ids"])] == body["input_ids"]
    # what the model saw is the documented text: tools in the system turn, calls and results as text
    seen = tok.decode(ids)
    assert seen == render_text(tok, to_template_messages(messages), [SEARCH_TOOL], add_generation_prompt=False,
                               chat_template=template, tools_as_text=True).rstrip("\n")
    assert seen.startswith('<|im_start|>system\n# Tools\n<tools>\n{"name": "search", ')
    assert "<|im_start|>user\n<tool_response>\nresult 2\n</tool_response><|im_end|>" in seen
    assert episode["tool_calls"] == 2 and episode["tool_call_parse_failures"] == 0


# --- sampling fields, budget, failures, reward ---
def test_sampling_fields_reach_the_server_as_sglang_sampling_params(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        async with sdk(proxy, key) as llm:
            await llm.chat.completions.create(model="policy", messages=[user("Q")], temperature=0.7, top_p=0.9,
                                              max_completion_tokens=17, stop="END", seed=42)
        return proxy.end_session(key)

    _, server = run_agent(tokenizer, [Reply("ok", eos=True)], agent, stop_token_ids=[7])
    params = server.requests[0]["sampling_params"]
    assert params["temperature"] == 0.7 and params["top_p"] == 0.9 and params["max_new_tokens"] == 17
    assert params["stop"] == ["END"] and params["sampling_seed"] == 42
    assert set(params["stop_token_ids"]) == {7, tokenizer.eos_token_id}


def test_the_context_budget_cuts_max_tokens_and_then_refuses_with_context_length_exceeded(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        async with sdk(proxy, key) as llm:
            reply = await llm.chat.completions.create(model="policy", messages=[user("Q")], max_tokens=100)
            messages = [user("Q"), {"role": "assistant", "content": reply.choices[0].message.content}, user("More")]
            with pytest.raises(openai.BadRequestError) as refused:
                await llm.chat.completions.create(model="policy", messages=messages)
        return reply, refused.value, proxy.end_session(key)

    prompt_len = len(tokenizer(tokenizer.apply_chat_template([user("Q")], tokenize=False, add_generation_prompt=True),
                               add_special_tokens=False)["input_ids"])
    (reply, refused, episode), server = run_agent(tokenizer, [Reply("a b c d e f g h i j k l")], agent,
                                                  max_context_tokens=prompt_len + 5)
    assert server.requests[0]["sampling_params"]["max_new_tokens"] == 5 and reply.choices[0].finish_reason == "length"
    assert refused.code == "context_length_exceeded" and len(server.requests) == 1
    assert episode["requests"] == 1 and len(episode["segments"]) == 1


def test_an_aborted_generation_fails_its_session(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        async with sdk(proxy, key) as llm:
            with pytest.raises(openai.InternalServerError):
                await llm.chat.completions.create(model="policy", messages=[user("Q")])
        with pytest.raises(SessionFailed, match="aborted"):
            proxy.end_session(key)
        return key not in proxy.sessions
    gone, _ = run_agent(tokenizer, [Reply("x y z", abort_after=1)], agent)
    assert gone


def test_a_request_the_server_refuses_is_a_400_and_the_session_goes_on(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        async with sdk(proxy, key) as llm:
            with pytest.raises(openai.BadRequestError, match="refused"):
                await llm.chat.completions.create(model="policy", messages=[user("Q")])
            reply = await llm.chat.completions.create(model="policy", messages=[user("Q")])
        return reply.choices[0].message.content, proxy.end_session(key)
    (content, episode), _ = run_agent(tokenizer, [Reply(status=400), Reply("fine", eos=True)], agent)
    assert content == "fine" and len(episode["segments"]) == 1


def test_a_posted_reward_and_the_model_list(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        async with sdk(proxy, key) as llm:
            models = await llm.models.list()
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
            ok = await http.post(proxy.url.replace("/v1", "/agentrl/reward"), json={"reward": 0.75})
            bad = await http.post(proxy.url.replace("/v1", "/agentrl/reward"), json={"reward": "high"})
        return [m.id for m in models.data], ok.status, bad.status, proxy.end_session(key)
    (ids, ok, bad, episode), _ = run_agent(tokenizer, [Reply("x", eos=True)], agent, model_name="my-policy")
    assert ids == ["my-policy"] and (ok, bad) == (200, 400) and episode["reward"] == 0.75


BAD_BODIES = [
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 2.5}, "max_completion_tokens"),
    ({"stop": 5}, "stop"),
    ({"seed": "x"}, "seed"),
    ({"seed": 2 ** 64}, "seed"),
    ({"max_tokens": 10 ** 12}, "max_tokens"),
    ({"stop": ["a"] * 17}, "stop"),
    ({"tool_choice": "required", "tools": [SEARCH_TOOL]}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"top_k": 0}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"stream": "yes"}, "stream"),
    ({"frobnicate": True}, "frobnicate"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}]}, "messages"),
]


def test_bad_requests_get_a_4xx_naming_the_field_and_change_nothing(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        url = proxy.url + "/chat/completions"
        answers = []
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
            for fields, param in BAD_BODIES:
                body = {"model": "policy", "messages": [user("Q")], **fields}
                async with http.post(url, json=body) as r:
                    answers.append((param, r.status, (await r.json())["error"]))
            for raw in (b"{not json", b"[1, 2]", b""):
                async with http.post(url, data=raw, headers={"Content-Type": "application/json"}) as r:
                    answers.append(("body", r.status, (await r.json())["error"]))
        async with aiohttp.ClientSession() as http:
            for auth in ({}, {"Authorization": "Bearer agentrl-not-a-session"}):
                async with http.post(url, json={"model": "policy", "messages": [user("Q")]}, headers=auth) as r:
                    answers.append(("key", r.status, (await r.json())["error"]))
        return answers, proxy.end_session(key)

    (answers, episode), server = run_agent(tokenizer, [Reply("x", eos=True)], agent)
    for param, status, error in answers:
        if param == "key":
            assert status == 401 and error["code"] == "invalid_api_key"
        elif param == "body":
            assert status == 400 and error["message"]
        else:
            assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error", param
            assert param in error["message"] or param == "messages", error
    assert server.requests == [] and episode["requests"] == 0 and episode["segments"] == []


# --- any body: a 2xx or a 4xx, and a refused one changes nothing ---
def test_any_request_body_gets_a_2xx_or_a_4xx_and_a_refused_one_changes_nothing(tokenizer):
    import requests
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from lib.async_rollout import BackgroundLoop

    text = st.text(st.characters(exclude_categories=()), max_size=12)
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**30, 10**30), st.floats(), text)
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
                          max_leaves=12)
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool", "system", "robot", 5]),
                                     "content": st.one_of(text, values)},
                                    optional={"tool_calls": values, "name": values, "tool_call_id": values})
    fields = st.sampled_from(["temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "seed", "n",
                              "stream", "stream_options", "tools", "tool_choice", "logprobs", "top_logprobs",
                              "logit_bias", "presence_penalty", "response_format", "user", "frobnicate"])
    bodies = st.fixed_dictionaries({"messages": st.one_of(st.lists(message, max_size=3), values)},
                                   optional={"model": values}).flatmap(
        lambda base: st.dictionaries(fields, values, max_size=4).map(lambda extra: {**base, **extra}))

    with ScriptedServer(tokenizer, [Reply("ok", eos=True)]) as server:
        bg = BackgroundLoop()
        client = InferenceClient([server.address], max_retries=0)
        proxy = OpenAIProxy(client, tokenizer, chat_template=TOOLS_CHAT_TEMPLATE, default_max_tokens=4)
        bg.run(proxy.start())
        key = proxy.new_session()
        seen = set()
        try:
            @settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
            @given(body=bodies)
            def check(body):
                session = proxy.sessions[key]
                before = (len(server.requests), session.stats["requests"], len(session.segments))
                r = requests.post(proxy.url + "/chat/completions", data=json.dumps(body, allow_nan=True),
                                  headers={"Authorization": f"Bearer {key}"}, timeout=10)
                assert r.status_code in (200, 400), (r.status_code, r.text[:300])
                seen.add(r.status_code)
                if r.status_code == 400:
                    assert r.json()["error"]["message"]
                    assert (len(server.requests), session.stats["requests"], len(session.segments)) == before
            check()
            assert seen == {200, 400}  # the strategy reaches both answers
        finally:
            proxy.end_session(key)
            bg.run(proxy.close())
            bg.run(client.close())
            bg.close()


def test_a_continuing_request_renders_the_template_once_and_gets_the_ids_of_two_renderings(tokenizer, monkeypatch):
    """The text before the state's reply is what the last request rendered, so a continuing request
    renders only its own conversation; its new tokens are those continuation_ids cuts from two."""
    from lib import openai_proxy
    from lib.chat_format import continuation_ids
    rendered = []
    render = openai_proxy.render_text
    monkeypatch.setattr(openai_proxy, "render_text", lambda *a, **k: rendered.append(1) or render(*a, **k))

    async def agent(proxy):
        key = proxy.new_session()
        messages = [{"role": "system", "content": "Be brief."}, user("Who founded the Ostrel Guild?")]
        async with sdk(proxy, key) as llm:
            for follow_up in ("Sure?", "Thanks."):
                reply = await llm.chat.completions.create(model="policy", messages=messages, tools=[SEARCH_TOOL])
                messages += [reply.choices[0].message.model_dump(exclude_none=True), user(follow_up)]
        return messages, proxy.end_session(key)

    (messages, episode), server = run_agent(tokenizer, [Reply("Pem Varo.", eos=True), Reply("Yes, Pem Varo.", eos=True)],
                                            agent)
    assert len(rendered) == 2 and len(episode["segments"]) == 1
    history = messages[:3]  # through the first reply
    delta = continuation_ids(tokenizer, to_template_messages(history), to_template_messages(messages[:4]), [SEARCH_TOOL],
                             end_of_turn="<|im_end|>", chat_template=TOOLS_CHAT_TEMPLATE)
    first, second = server.requests[0]["input_ids"], server.requests[1]["input_ids"]
    assert second == first + server.answers[0]["output_ids"] + delta
