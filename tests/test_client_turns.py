"""One `generate()` call is one model turn: length continuations are joined, and stops (strings,
EOS ids) apply to the whole turn whatever each answer's finish_reason says. Against
lib.scripted_server, which applies SGLang's own finishing rules to scripted model output."""
import asyncio

import pytest
from transformers import AutoTokenizer

from lib.client import GenerationAborted, InferenceClient, InferenceServerError
from lib.scripted_server import Reply, ScriptedServer
from lib.tiny_model import default_tiny_model_dir

STOPS = ["</search>", "</answer>"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_tiny_model_dir())


def generate(server, **kw):
    async def go():
        client = InferenceClient([server.address], max_retries=0)
        try:
            return await client.generate([1, 2, 3], **kw)
        finally:
            await client.close()
    return asyncio.run(go())


def ids_until(tokenizer, text: str, end: str) -> list[int]:
    """The shortest prefix of text's tokens whose decoding contains `end`."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for n in range(1, len(ids) + 1):
        if end in tokenizer.decode(ids[:n]):
            return ids[:n]
    raise AssertionError(f"{end!r} not in {text!r}")


def test_a_stop_string_split_by_a_length_cut_ends_the_turn_at_the_token_that_completes_it(tokenizer):
    """Piece 1 ends in '</sea', piece 2 begins 'rch>' and the model writes on (an invented
    <information> block); the server of piece 2 never sees '</search>'."""
    full = "<search> Ostrel Guild </search><information> made up </information>"
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    upto = ids_until(tokenizer, full, "</search>")
    cut = len(upto) - 1  # the piece boundary falls inside the stop string
    assert "</search>" not in tokenizer.decode(ids[:cut])
    script = [Reply(ids=ids[:cut]), Reply(ids=ids[cut:])]
    with ScriptedServer(tokenizer, script) as server:
        gen = generate(server, max_new_tokens=200, piece_tokens=cut, stop=STOPS)
        assert len(server.requests) == 2 and server.requests[1]["input_ids"] == [1, 2, 3] + ids[:cut]
    assert gen.output_ids == upto and len(gen.logprobs) == len(upto) == len(gen.versions)
    assert gen.finish_reason == "stop" and gen.matched == "</search>" and gen.num_continuations == 1
    assert "<information>" not in tokenizer.decode(gen.output_ids)


def test_length_continuations_join_into_one_turn_with_every_token_and_logprob(tokenizer):
    text = "<think> a long thought about the guild and its founder </think><answer> Pem Varo </answer>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [ids[i:i + 4] for i in range(0, len(ids), 4)]
    with ScriptedServer(tokenizer, [Reply(ids=p) for p in pieces]) as server:
        gen = generate(server, max_new_tokens=500, piece_tokens=4, stop=STOPS)
        rows = len(server.requests)
    assert gen.output_ids == ids and tokenizer.decode(gen.output_ids) == text
    assert gen.finish_reason == "stop" and gen.matched == "</answer>"
    assert rows == len(pieces) and gen.num_continuations == len(pieces) - 1
    assert len(set(gen.logprobs)) == len(ids), "each sampled token keeps its own server log-prob"


def test_eos_sampled_as_the_last_allowed_token_ends_the_turn_though_the_server_says_length(tokenizer):
    eos = tokenizer.eos_token_id
    with ScriptedServer(tokenizer, [Reply(ids=[50, 51, 52], eos=True), Reply(ids=[60, 61])]) as server:
        gen = generate(server, max_new_tokens=100, piece_tokens=4, stop_token_ids=[eos])
        assert len(server.requests) == 1, "nothing is asked after the model's own end of turn"
    assert gen.output_ids == [50, 51, 52, eos] and gen.finish_reason == "stop" and gen.matched == eos


def test_any_id_of_the_eos_set_ends_the_turn(tokenizer):
    other_eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    with ScriptedServer(tokenizer, [Reply(ids=[50, other_eos, 51, 52])]) as server:
        gen = generate(server, max_new_tokens=2, piece_tokens=2, stop_token_ids=[tokenizer.eos_token_id, other_eos])
        assert len(server.requests) == 1
    assert gen.output_ids == [50, other_eos] and gen.finish_reason == "stop" and gen.matched == other_eos


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(tokenizer):
    ids = ids_until(tokenizer, "<answer> Pem </answer> more", "</answer>")
    with ScriptedServer(tokenizer, [Reply(ids=ids + [70, 71])]) as server:
        gen = generate(server, max_new_tokens=len(ids), stop=STOPS)
    assert gen.output_ids == ids and gen.finish_reason == "stop" and gen.matched == "</answer>"


def test_the_turn_stops_at_max_new_tokens_across_pieces(tokenizer):
    with ScriptedServer(tokenizer, [Reply(ids=[50, 51, 52, 53, 54, 55])]) as server:
        gen = generate(server, max_new_tokens=10, piece_tokens=4, stop=STOPS)
        asked = [r["sampling_params"]["max_new_tokens"] for r in server.requests]
    assert asked == [4, 4, 2] and len(gen.output_ids) == 10 and gen.finish_reason == "length"


def test_an_abort_that_is_not_a_pause_raises(tokenizer):
    with ScriptedServer(tokenizer, [Reply("<think> half a", abort_after=2)]) as server:
        with pytest.raises(GenerationAborted, match="scripted abort"):
            generate(server, max_new_tokens=50, stop=STOPS)


@pytest.mark.parametrize("shape", ["short", "nan", "null", "mismatch"])
def test_malformed_logprobs_raise_instead_of_entering_a_trajectory(tokenizer, shape):
    with ScriptedServer(tokenizer, [Reply("<answer> x </answer>", logprobs=shape)]) as server:
        with pytest.raises(InferenceServerError, match="log-prob"):
            generate(server, max_new_tokens=50, stop=STOPS)


def test_a_server_error_raises_after_the_retries_and_names_the_server(tokenizer):
    with ScriptedServer(tokenizer, [Reply("<answer> x </answer>", status=500)]) as server:
        with pytest.raises(InferenceServerError, match="HTTP 500") as info:
            generate(server, max_new_tokens=50, stop=STOPS)
        assert server.address in str(info.value)


# --- streamed turns (on_tokens): SGLang's `stream: true`, events with the output so far or only the new tokens ---
def generate_streamed(server, **kw):
    runs = []

    async def go():
        client = InferenceClient([server.address], max_retries=0)
        try:
            return await client.generate([1, 2, 3], on_tokens=lambda *run: runs.append(run), **kw)
        finally:
            await client.close()
    return asyncio.run(go()), runs


@pytest.mark.parametrize("incremental", [False, True])
def test_a_streamed_turn_hands_over_each_token_once_and_equals_the_plain_turn(tokenizer, incremental):
    script = [Reply("<search> Ostrel Guild </search>", eos=True)]
    with ScriptedServer(tokenizer, script) as server:
        plain = generate(server, max_new_tokens=200, stop_token_ids=[tokenizer.eos_token_id])
    with ScriptedServer(tokenizer, script, incremental_streaming=incremental) as server:
        streamed, runs = generate_streamed(server, max_new_tokens=200, stop_token_ids=[tokenizer.eos_token_id])
        assert server.requests[0]["stream"] is True
    assert len(runs) == len(streamed.output_ids) > 1  # one event per token here
    assert [t for ids, _, _ in runs for t in ids] == streamed.output_ids == plain.output_ids
    assert [lp for _, lps, _ in runs for lp in lps] == streamed.logprobs
    assert (streamed.finish_reason, streamed.matched, streamed.text) == (plain.finish_reason, plain.matched, plain.text)


@pytest.mark.parametrize("incremental", [False, True])
def test_a_streamed_turn_ends_at_the_token_completing_a_stop_string_and_aborts_the_rest(tokenizer, incremental):
    """As test_a_stop_string_split_by_a_length_cut...: the server of piece 2 never sees '</search>', so
    it streams on; the client cuts the turn there, hands over nothing after it, and aborts piece 2."""
    full = "<search> Ostrel Guild </search><information> made up </information>"
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    upto = ids_until(tokenizer, full, "</search>")
    cut = len(upto) - 1
    script = [Reply(ids=ids[:cut]), Reply(ids=ids[cut:], token_delay_s=0.05)]
    with ScriptedServer(tokenizer, script, incremental_streaming=incremental) as server:
        gen, runs = generate_streamed(server, max_new_tokens=200, piece_tokens=cut, stop=STOPS)
        aborts = [b for path, b in zip(server.control_calls, server.control_bodies) if path == "/abort_request"]
        assert aborts == [{"rid": server.requests[1]["rid"], "abort_all": False}]
    assert gen.output_ids == upto and [t for run_ids, _, _ in runs for t in run_ids] == upto
    assert gen.finish_reason == "stop" and gen.matched == "</search>"


def test_a_cancelled_generate_asks_the_server_to_abort_its_request_by_rid(tokenizer):
    with ScriptedServer(tokenizer, [Reply("<answer> x </answer>", delay_s=5.0)]) as server:
        async def go():
            client = InferenceClient([server.address], max_retries=0)
            task = asyncio.create_task(client.generate([1, 2, 3], max_new_tokens=20))
            while not server.requests:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await client.close()  # waits for the abort to be sent
        asyncio.run(go())
        assert server.control_calls == ["/abort_request"]
        assert server.control_bodies == [{"rid": server.requests[0]["rid"], "abort_all": False}]


def test_a_server_without_top_logprobs_is_a_4xx_naming_them(tokenizer):
    with ScriptedServer(tokenizer, [Reply("<answer> x </answer>")]) as server:
        with pytest.raises(InferenceServerError, match="output_top_logprobs") as refused:
            generate(server, max_new_tokens=20, top_logprobs=3)
        assert server.requests[0]["top_logprobs_num"] == 3
    assert refused.value.status == 400
