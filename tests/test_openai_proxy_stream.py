"""lib/openai_proxy.py streams a reply while the model generates it: chunks arrive before the
generation ends, their deltas joined are the reply a plain request gets (content, reasoning, tool
calls, log-probs), the openai SDK's stream helpers assemble it, and a client that leaves
mid-stream stops the generation and has nothing recorded. Against lib.scripted_server streaming
as SGLang does (the output so far in each event, or only the new tokens)."""
import asyncio
import time

import aiohttp
import pytest

openai = pytest.importorskip("openai")

from lib.scripted_server import Reply  # noqa: E402
from tests.test_openai_proxy import SEARCH_TOOL, run_agent, sampled, tokenizer, user  # noqa: E402, F401 (fixture)

CALL = '<tool_call>{"name": "search", "arguments": {"query": "Ostrel Guild"}}</tool_call>'
REPLIES = {  # what the model writes, and the request fields that read it
    "text": ("Pem Varo founded the Ostrel Guild in 1820.", {}),
    "tool call only": (CALL, {"tools": [SEARCH_TOOL]}),
    "text then a tool call": ("Let me look.\n" + CALL, {"tools": [SEARCH_TOOL]}),
    "a stop string": ("<answer> Pem Varo </answer> and more", {"stop": ["</answer>"]}),
    "thinking": ("<think>The founder is named in the text.</think>\n\nPem Varo.", {}),
    "leading space": ("  Pem Varo.", {"tools": [SEARCH_TOOL]}),
    "characters split across tokens": ("Pem Varo héllo 🎉 ok", {}),
}


def run(tokenizer, script, agent, incremental=False):
    return run_agent(tokenizer, script, agent, incremental_streaming=incremental)


def joined(chunks) -> dict:
    """A chat stream's chunks assembled as an agent reads them."""
    content, reasoning, calls, logprobs, finish = "", "", [], [], None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            calls += [(c.function.name, c.function.arguments) for c in choice.delta.tool_calls or []]
            logprobs += [(e.token, e.logprob, tuple(e.bytes)) for e in (choice.logprobs.content or [])] if choice.logprobs else []
            finish = choice.finish_reason or finish
    return {"content": content, "reasoning": reasoning, "calls": calls, "logprobs": logprobs, "finish": finish}


def plain(reply) -> dict:
    message, choice = reply.choices[0].message, reply.choices[0]
    return {"content": message.content or "", "reasoning": getattr(message, "reasoning_content", None) or "",
            "calls": [(c.function.name, c.function.arguments) for c in message.tool_calls or []],
            "logprobs": [(e.token, e.logprob, tuple(e.bytes)) for e in choice.logprobs.content],
            "finish": choice.finish_reason}


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("name", list(REPLIES))
def test_a_streamed_chat_reply_joins_into_the_plain_reply(tokenizer, name, incremental):
    text, fields = REPLIES[name]

    async def agent(proxy):
        key = proxy.new_session()
        async with openai.AsyncOpenAI(base_url=proxy.url, api_key=key, max_retries=0) as llm:
            whole = await llm.chat.completions.create(model="policy", messages=[user("Q")], logprobs=True, **fields)
            stream = await llm.chat.completions.create(model="policy", messages=[user("Q")], logprobs=True,
                                                       stream=True, **fields)
            chunks = [c async for c in stream]
        return whole, chunks, proxy.end_session(key, train_discarded=True)  # the same prompt twice: both trained

    (whole, chunks, episode), server = run(tokenizer, [Reply(text, eos=True)] * 2, agent, incremental)
    assert joined(chunks) == {**plain(whole), "logprobs": joined(chunks)["logprobs"]}
    # the log-probs differ between the two requests (the server counts them), their tokens do not
    assert [e[0] for e in joined(chunks)["logprobs"]] == [e[0] for e in plain(whole)["logprobs"]]
    assert [e[1] for e in joined(chunks)["logprobs"]] == pytest.approx(
        [row[0] for row in server.answers[1]["meta_info"]["output_token_logprobs"]])
    ids, _ = sampled(episode["segments"])
    assert ids == server.answers[0]["output_ids"] + server.answers[1]["output_ids"]  # both recorded, once each


@pytest.mark.parametrize("case", ["cut inside its thinking", "a </think> in a reply that does not think"])
def test_a_plain_and_a_streamed_reply_split_reasoning_from_content_by_one_rule(tokenizer, case):
    """Chat and Responses, plain and streamed: a reply that thinks, cut before `</think>`, is all
    reasoning (streamed once, as reasoning); a reply that does not think keeps a `</think>` in its content."""
    if case == "cut inside its thinking":
        text = "<think>The founder is named in the text.</think>Pem Varo."
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        cut = next(k for k in range(len(ids)) if tokenizer.decode(ids[:k]).startswith("<think>The founder is"))
        fields, want = {"max_tokens": cut}, (tokenizer.decode(ids[:cut]).removeprefix("<think>").strip(), "")
        assert want[0].startswith("The founder is") and "</think>" not in tokenizer.decode(ids[:cut])
    else:
        text = "Pem Varo.</think> He founded the guild."
        fields, want = {}, ("", text)

    async def agent(proxy):
        key = proxy.new_session()
        async with openai.AsyncOpenAI(base_url=proxy.url, api_key=key, max_retries=0) as llm:
            whole = plain(await llm.chat.completions.create(model="policy", messages=[user("Q")], logprobs=True,
                                                            **fields))
            streamed = joined([c async for c in await llm.chat.completions.create(
                model="policy", messages=[user("Q")], stream=True, **fields)])
            fields_r = {"max_output_tokens": fields["max_tokens"]} if fields else {}
            response = await llm.responses.create(model="policy", input="Q", **fields_r)
            events = [e async for e in await llm.responses.create(model="policy", input="Q", stream=True, **fields_r)]
        reasoning = "".join(c.text for o in response.output if o.type == "reasoning" for c in o.content)
        final = events[-1].response
        return ((whole["reasoning"], whole["content"]), (streamed["reasoning"], streamed["content"]),
                (reasoning, response.output_text),
                ("".join(e.delta for e in events if e.type == "response.reasoning_text.delta"),
                 "".join(e.delta for e in events if e.type == "response.output_text.delta")),
                ("".join(c.text for o in final.output if o.type == "reasoning" for c in o.content), final.output_text))

    splits, _ = run(tokenizer, [Reply(text, eos=True)], agent)
    assert list(splits) == [want] * 5  # chat plain, chat streamed, responses plain, its deltas, its final response


def test_chunks_arrive_while_the_model_generates(tokenizer):
    text = " ".join(["Pem Varo founded the Ostrel Guild."] * 4)

    async def agent(proxy):
        key = proxy.new_session()
        arrivals = []
        async with openai.AsyncOpenAI(base_url=proxy.url, api_key=key, max_retries=0) as llm:
            started = time.perf_counter()
            stream = await llm.chat.completions.create(model="policy", messages=[user("Q")], stream=True)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    arrivals.append(time.perf_counter() - started)
            total = time.perf_counter() - started
        return arrivals, total, proxy.end_session(key)

    (arrivals, total_s, episode), server = run(tokenizer, [Reply(text, eos=True, token_delay_s=0.03)], agent)
    tokens = len(server.answers[0]["output_ids"])
    assert total_s > 0.03 * tokens
    assert len(arrivals) > tokens // 2 and arrivals[0] < total_s / 4
    assert len(episode["segments"]) == 1


def test_the_openai_sdks_stream_helpers_assemble_the_streamed_reply(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        async with openai.AsyncOpenAI(base_url=proxy.url, api_key=key, max_retries=0) as llm:
            async with llm.chat.completions.stream(model="policy", messages=[user("Q")], tools=[SEARCH_TOOL]) as stream:
                kinds = [event.type async for event in stream]
                final = await stream.get_final_completion()
            async with llm.responses.stream(model="policy", input="Q") as stream:
                deltas = [event.delta async for event in stream if event.type == "response.output_text.delta"]
                response = await stream.get_final_response()
        return kinds, final, deltas, response, proxy.end_session(key)

    script = [Reply("Let me look.\n" + CALL, eos=True), Reply("<think>Recall it.</think>Pem Varo founded it.", eos=True)]
    (kinds, final, deltas, response, episode), _ = run(tokenizer, script, agent)
    assert [o.type for o in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "Recall it."
    message = final.choices[0].message
    assert message.content == "Let me look." and message.tool_calls[0].function.name == "search"
    assert "content.delta" in kinds and "tool_calls.function.arguments.done" in kinds
    assert len(deltas) > 1 and "".join(deltas) == response.output_text == "Pem Varo founded it."
    assert episode["requests"] == 2


@pytest.mark.parametrize("api", ["completions", "responses"])
def test_a_streamed_completion_and_response_join_into_the_plain_ones(tokenizer, api):
    async def agent(proxy):
        key = proxy.new_session()
        async with openai.AsyncOpenAI(base_url=proxy.url, api_key=key, max_retries=0) as llm:
            if api == "completions":
                whole = await llm.completions.create(model="policy", prompt="Q:", logprobs=0, stop=["</answer>"])
                stream = await llm.completions.create(model="policy", prompt="Q:", logprobs=0, stop=["</answer>"],
                                                      stream=True)
                chunks = [c async for c in stream]
                return ((whole.choices[0].text, whole.choices[0].logprobs.tokens, whole.choices[0].logprobs.text_offset),
                        ("".join(c.choices[0].text for c in chunks if c.choices),
                         [t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens],
                         [o for c in chunks if c.choices for o in c.choices[0].logprobs.text_offset]))
            whole = await llm.responses.create(model="policy", input="Q", tools=[{
                "type": "function", "name": "search", "parameters": SEARCH_TOOL["function"]["parameters"]}])
            stream = await llm.responses.create(model="policy", input="Q", stream=True, tools=[{
                "type": "function", "name": "search", "parameters": SEARCH_TOOL["function"]["parameters"]}])
            events = [e async for e in stream]
            final = events[-1].response
            text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            added = [e.item.type for e in events if e.type == "response.output_item.added"]
            thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
            kinds = [e.type for e in events]
            return ([(o.type, getattr(o, "name", None)) for o in whole.output], whole.output_text,
                    whole.output[0].content[0].text), (
                [(o.type, getattr(o, "name", None)) for o in final.output], text, added, thinking,
                kinds.index("response.reasoning_text.delta") < kinds.index("response.reasoning_text.done")
                < kinds.index("response.output_text.delta"), final.output[0].content[0].text)

    text = "<think>Look it up.</think>Founded by Pem Varo.\n" + CALL if api == "responses" else "<answer> x </answer> y"
    (whole, streamed), _ = run(tokenizer, [Reply(text, eos=True)] * 2, agent)
    if api == "completions":
        assert streamed == whole and whole[0] == "<answer> x "
    else:
        items, output_text, reasoning = whole
        assert items == streamed[0] == [("reasoning", None), ("message", None), ("function_call", "search")]
        assert streamed[1] == output_text == "Founded by Pem Varo." and streamed[2] == ["reasoning", "message",
                                                                                      "function_call"]
        # the reasoning streams as deltas too, and is done before the message's text begins
        assert streamed[3] == streamed[5] == reasoning == "Look it up." and streamed[4]


@pytest.mark.parametrize("incremental", [False, True])
def test_a_client_that_leaves_mid_stream_stops_the_generation_and_nothing_is_recorded(tokenizer, incremental):
    async def agent(proxy):
        key = proxy.new_session()
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
            async with http.post(proxy.url + "/chat/completions",
                                 json={"model": "policy", "messages": [user("Q")], "stream": True}) as response:
                got = b""
                while b'"content": "' not in got.replace(b'"content": ""', b""):
                    got += await response.content.readany()
                # leaving here closes the connection mid-stream
        await asyncio.sleep(0.5)
        return proxy.end_session(key)

    text = " ".join(["Pem Varo founded the Ostrel Guild."] * 6)
    episode, server = run(tokenizer, [Reply(text, eos=True, token_delay_s=0.05)], agent, incremental)
    assert episode["segments"] == [] and episode["requests"] == 0
    assert server.control_calls == ["/abort_request"]
    assert server.control_bodies[0]["rid"] == server.requests[0]["rid"]


def test_reply_text_decoded_token_by_token_is_the_whole_decoding(tokenizer):
    from lib.reply_stream import ReplyText
    text = "Pem Varo héllo 🎉 ok, naïve café – 東京 " * 8 + "<answer> done </answer>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    stream = ReplyText(tokenizer, stop=None, parse_tools=False, thinking=None)
    assert stream.by_parts  # a byte-level BPE: each token is decoded alone
    sent = "".join(delta for i in ids for _, delta in stream.add([i]))
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert sent == whole and stream.finish(None, whole) == []


def test_concurrent_streams_on_one_conversation_fork_and_train_each_token_once(tokenizer):
    async def agent(proxy):
        key = proxy.new_session()
        async with openai.AsyncOpenAI(base_url=proxy.url, api_key=key, max_retries=0) as llm:
            a = await llm.chat.completions.create(model="policy", messages=[user("Q")])
            history = [user("Q"), {"role": "assistant", "content": a.choices[0].message.content}, user("Next")]

            async def streamed():
                return [c async for c in await llm.chat.completions.create(model="policy", messages=history, stream=True)]
            await asyncio.gather(streamed(), streamed())
        return proxy.end_session(key, train_discarded=True)  # two samples of one prompt: both trained

    script = [Reply("A.", eos=True), Reply("B b b.", eos=True, token_delay_s=0.05),
              Reply("C c c.", eos=True, token_delay_s=0.05)]
    episode, server = run(tokenizer, script, agent)
    assert len(episode["segments"]) == 2
    assert sorted(sampled(episode["segments"])[0]) == sorted(t for a in server.answers for t in a["output_ids"])


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 8])
def test_a_streamed_reply_stops_at_the_first_stop_string_and_sends_no_part_of_it_whatever_the_chunks(
        tokenizer, chunk):
    from lib.reply_stream import ReplyText
    text = "Pem Varo </answ héllo </ans </b  then </b> and </answer> more"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stream = ReplyText(tokenizer, stop=["</answer>", "</b>"], parse_tools=False, thinking=None)
    sent = ""
    for i in range(0, len(ids), chunk):
        sent += "".join(delta for _, delta in stream.add(ids[i:i + chunk]))
        assert "Pem Varo </answ héllo </ans </b  then ".startswith(sent)  # no part of a stop string, ever
    assert sent == "Pem Varo </answ héllo </ans </b  then "
