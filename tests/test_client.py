"""lib.client.InferenceClient against lib.cpu_server (SGLang's HTTP API) and, where a behaviour needs
a server to misbehave on cue (5xx, pauses that cut a stop string), against small in-test fakes.

One real CPU server (a tiny random Qwen2) serves the whole module.
"""
import asyncio
import contextlib
import time

import aiohttp
import pytest
from aiohttp import web
from transformers import AutoTokenizer

from lib.client import GenerationAborted, InferenceClient, InferenceServerError
from lib.launch import free_port, launch_cpu_server
from lib.tiny_model import build_tiny_model

TEXTS = [f"Ilvan Moresk was born in Tarqua in {1800 + i}. Pem Varo founded the Ostrel Guild. "
         f"<answer> {i} </answer>" for i in range(300)]
ARCH = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2)
CONTEXT_LENGTH = 1024  # long enough that a full-context generation outlasts a pause under any load
# Sampled with a per-request seed (a lib.cpu_server extra; SGLang has it too): repeatable and varied,
# where a random model's greedy output tends to repeat one token.
SEEDED = {"sampling_seed": 7, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("client") / "model"), TEXTS, seed=0, **ARCH)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    server = launch_cpu_server(model_dir, context_length=CONTEXT_LENGTH, num_threads=1,
                               log_path=str(tmp_path_factory.mktemp("client_log") / "cpu_server.log"), timeout_s=120)
    yield server
    server.terminate()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer("Ilvan Moresk was born in")["input_ids"]


def with_client(addresses, body, **client_kw):
    """`await body(client)` on a fresh event loop (no pytest-asyncio here), closing the client after."""
    async def main():
        client = InferenceClient(addresses, **client_kw)
        try:
            return await body(client)
        finally:
            await client.close()
    return asyncio.run(main())


# --- generation against the CPU server ---

def test_length_finish_gives_one_logprob_per_output_token(server, prompt):
    async def body(client):
        return await client.generate(prompt, max_new_tokens=9, extra_sampling_params=SEEDED)
    gen = with_client([server.address], body)
    assert gen.finish_reason == "length" and gen.matched is None
    assert len(gen.output_ids) == len(gen.logprobs) == len(gen.versions) == 9
    assert all(lp <= 0 for lp in gen.logprobs)
    assert gen.prompt_tokens == len(prompt) and gen.weight_version == "default" and gen.num_resumes == 0


def test_stop_string_ends_generation_reports_the_match_and_keeps_its_tokens(server, prompt, tokenizer):
    async def body(client):
        free = await client.generate(prompt, max_new_tokens=16, extra_sampling_params=SEEDED)
        # the decoded text of token k, which completes only at token k if it does not occur before it
        for k in range(2, 16):
            before, stop = tokenizer.decode(free.output_ids[:k]), tokenizer.decode(free.output_ids[k:k + 1])
            if stop.strip() and stop not in before:
                break
        else:
            pytest.fail(f"no usable stop string in {free.text!r}")
        return k, stop, free, await client.generate(prompt, max_new_tokens=16, stop=[stop, "zzzz"],
                                                    extra_sampling_params=SEEDED)
    k, stop, free, gen = with_client([server.address], body)
    assert gen.finish_reason == "stop" and gen.matched == stop
    assert gen.output_ids == free.output_ids[:k + 1]
    assert len(gen.logprobs) == k + 1
    assert gen.text == tokenizer.decode(free.output_ids[:k]) and stop not in gen.text


def test_stop_token_id_ends_generation_and_is_reported_as_an_int(server, prompt):
    async def body(client):
        free = await client.generate(prompt, max_new_tokens=16, extra_sampling_params={"sampling_seed": 7})
        k = next(i for i in range(3, 16) if free.output_ids[i] not in free.output_ids[:i])
        stop_id = free.output_ids[k]
        gen = await client.generate(prompt, max_new_tokens=16, stop_token_ids=[stop_id],
                                    extra_sampling_params={"sampling_seed": 7})
        return k, stop_id, free, gen
    k, stop_id, free, gen = with_client([server.address], body)
    assert gen.finish_reason == "stop" and gen.matched == stop_id and isinstance(gen.matched, int)
    assert gen.output_ids == free.output_ids[:k + 1] and len(gen.logprobs) == k + 1


def test_a_4xx_raises_at_once_with_the_servers_message(server, prompt):
    async def body(client):
        t0 = time.monotonic()
        with pytest.raises(InferenceServerError) as info:
            await client.generate(prompt, max_new_tokens=CONTEXT_LENGTH)
        return info.value, time.monotonic() - t0
    error, elapsed_s = with_client([server.address], body, retry_backoff_s=5.0)
    assert error.status == 400 and "maximum context length" in str(error)
    assert elapsed_s < 5.0, "a 4xx must not be retried"


def test_a_failed_weight_update_raises_with_the_servers_message(server):
    async def body(client):
        with pytest.raises(InferenceServerError, match="Failed to update weights") as info:
            await client.update_weights_from_disk("/nonexistent/checkpoint")
        return info.value
    assert with_client([server.address], body).address == server.address


async def _until_running(client, min_tokens_s: float = 0.1):
    """Wait until the server decodes a request, then a little longer so it has produced some tokens."""
    deadline = time.monotonic() + 30
    while (await client.get_server_info())[0]["num_running_requests"] == 0:
        assert time.monotonic() < deadline, "the request never started running"
        await asyncio.sleep(0.01)
    await asyncio.sleep(min_tokens_s)


def test_pause_cuts_an_inflight_generation_and_continue_resumes_it_under_the_new_version(server, prompt):
    max_new_tokens = CONTEXT_LENGTH - len(prompt)
    greedy = {"ignore_eos": True}

    async def body(client):
        client.set_version(3)
        inflight = asyncio.create_task(client.generate(prompt, max_new_tokens=max_new_tokens, temperature=0.0,
                                                       extra_sampling_params=greedy))
        await _until_running(client)
        await client.pause_generation()
        sent_while_paused = asyncio.create_task(client.generate(prompt, max_new_tokens=4, temperature=0.0))
        await asyncio.sleep(0.3)
        assert not inflight.done() and not sent_while_paused.done()
        await client.continue_generation(version=4)
        resumed, late = await inflight, await sent_while_paused
        uninterrupted = await client.generate(prompt, max_new_tokens=max_new_tokens, temperature=0.0,
                                              extra_sampling_params=greedy)
        return resumed, late, uninterrupted
    resumed, late, uninterrupted = with_client([server.address], body)
    assert resumed.num_resumes == 1 and resumed.finish_reason == "length"
    assert len(resumed.output_ids) == len(resumed.logprobs) == max_new_tokens
    num_old = resumed.versions.count(3)
    assert 0 < num_old < max_new_tokens, "the pause must land mid-generation"
    assert resumed.versions == [3] * num_old + [4] * (max_new_tokens - num_old)
    assert late.versions == [4] * len(late.output_ids)
    # Same weights before and after the pause, so the pieces join into the uninterrupted greedy output.
    assert resumed.output_ids == uninterrupted.output_ids
    assert max(abs(a - b) for a, b in zip(resumed.logprobs, uninterrupted.logprobs)) < 1e-4


def test_in_place_pause_holds_an_inflight_generation_through_a_weight_update(server, prompt, model_dir, tmp_path):
    """Async mode's default pause: the request is not cut (no re-send), its tokens keep the version it
    was sent under, and what it samples after the update comes from the new weights."""
    other = build_tiny_model(str(tmp_path / "other"), TEXTS, seed=1, **ARCH)
    max_new_tokens = CONTEXT_LENGTH - len(prompt)

    async def body(client):
        old = await client.generate(prompt, max_new_tokens=max_new_tokens, temperature=1.0,
                                    extra_sampling_params=SEEDED)
        client.set_version(3)
        inflight = asyncio.create_task(client.generate(prompt, max_new_tokens=max_new_tokens, temperature=1.0,
                                                       extra_sampling_params=SEEDED))
        await _until_running(client)
        await client.pause_generation("in_place")
        try:
            await client.update_weights_from_disk(other, weight_version="4", flush_cache=False)
            await client.continue_generation(version=4)
            held = await inflight
            new = await client.generate(prompt, max_new_tokens=max_new_tokens, temperature=1.0,
                                        extra_sampling_params=SEEDED)
        finally:
            await client.update_weights_from_disk(model_dir, weight_version="0")  # the module's server, as it was
        return old, held, new
    old, held, new = with_client([server.address], body)
    assert held.num_resumes == 0 and held.finish_reason == "length"
    assert len(held.output_ids) == len(held.logprobs) == max_new_tokens
    assert held.versions == [3] * max_new_tokens, "a held piece keeps the version it was sent under"
    assert old.output_ids != new.output_ids, "the two models must differ for this test to mean anything"
    # Same seed, one random stream (a held request is not re-sent): the held generation starts as the
    # old model's output and, after the update, leaves it.
    same = next((i for i, (a, b) in enumerate(zip(held.output_ids, old.output_ids)) if a != b), max_new_tokens)
    assert 0 < same < max_new_tokens, "the pause must land mid-generation and the new weights take over"


def test_abort_request_while_not_paused_raises_generation_aborted(server, prompt):
    """An abort that is not a pause is an infrastructure failure: its output must not become
    training data, so the call raises instead of returning a short turn."""
    async def body(client):
        task = asyncio.create_task(client.generate(prompt, max_new_tokens=CONTEXT_LENGTH - len(prompt),
                                                   extra_sampling_params=SEEDED))
        await _until_running(client, min_tokens_s=0.05)
        await client.abort_request()
        with pytest.raises(GenerationAborted) as info:
            await task
        return str(info.value)
    message = with_client([server.address], body)
    assert "not by a pause" in message and server.address in message


def test_a_streamed_generation_cut_by_a_pause_resumes_and_hands_over_every_token_once(server, prompt):
    max_new_tokens = CONTEXT_LENGTH - len(prompt)
    greedy = {"ignore_eos": True}
    runs = []

    async def body(client):
        inflight = asyncio.create_task(client.generate(prompt, max_new_tokens=max_new_tokens, temperature=0.0,
                                                       extra_sampling_params=greedy,
                                                       on_tokens=lambda *run: runs.append(run)))
        await _until_running(client)
        assert runs, "tokens are handed over while the generation runs"
        await client.pause_generation()
        await asyncio.sleep(0.2)
        await client.continue_generation(version=1)
        resumed = await inflight
        uninterrupted = await client.generate(prompt, max_new_tokens=max_new_tokens, temperature=0.0,
                                              extra_sampling_params=greedy)
        return resumed, uninterrupted
    resumed, uninterrupted = with_client([server.address], body)
    assert resumed.num_resumes == 1 and 0 < resumed.versions.count(0) < max_new_tokens
    assert [t for ids, _, _ in runs for t in ids] == resumed.output_ids == uninterrupted.output_ids
    assert [lp for _, lps, _ in runs for lp in lps] == resumed.logprobs


def test_an_in_place_pause_holds_a_streamed_generation_which_then_goes_on(server, prompt):
    max_new_tokens = CONTEXT_LENGTH - len(prompt)
    runs = []

    async def body(client):
        inflight = asyncio.create_task(client.generate(prompt, max_new_tokens=max_new_tokens, temperature=0.0,
                                                       extra_sampling_params={"ignore_eos": True},
                                                       on_tokens=lambda *run: runs.append(run)))
        await _until_running(client)
        await client.pause_generation("in_place")
        await asyncio.sleep(0.2)  # a step under way when the pause came may still land
        held = len(runs)
        await asyncio.sleep(0.5)
        assert len(runs) == held and not inflight.done(), "nothing is streamed while paused"
        await client.continue_generation()
        return await inflight, held
    gen, held = with_client([server.address], body)
    assert gen.num_resumes == 0 and len(runs) > held
    assert [t for ids, _, _ in runs for t in ids] == gen.output_ids and len(gen.output_ids) == max_new_tokens


def test_a_streamed_generation_equals_a_plain_one_with_the_same_seed(server, prompt):
    runs = []

    async def body(client):
        plain = await client.generate(prompt, max_new_tokens=24, extra_sampling_params=SEEDED, top_logprobs=2)
        streamed = await client.generate(prompt, max_new_tokens=24, extra_sampling_params=SEEDED, top_logprobs=2,
                                         on_tokens=lambda *run: runs.append(run))
        return plain, streamed
    plain, streamed = with_client([server.address], body)
    assert len(runs) > 1 and [t for ids, _, _ in runs for t in ids] == streamed.output_ids == plain.output_ids
    assert streamed.logprobs == plain.logprobs and streamed.text == plain.text
    assert [top for _, _, tops in runs for top in tops] == streamed.top_logprobs == plain.top_logprobs


def test_top_logprobs_are_the_most_likely_tokens_by_the_sampled_tokens_own_log_probs(server, prompt):
    async def body(client):
        greedy = await client.generate(prompt, max_new_tokens=8, temperature=0.0, top_logprobs=3)
        sampled = await client.generate(prompt, max_new_tokens=8, extra_sampling_params=SEEDED, top_logprobs=5)
        return greedy, sampled
    greedy, sampled = with_client([server.address], body)
    assert [len(top) for top in greedy.top_logprobs] == [3] * 8 and [len(top) for top in sampled.top_logprobs] == [5] * 8
    for gen in (greedy, sampled):
        for token, logprob, top in zip(gen.output_ids, gen.logprobs, gen.top_logprobs):
            values = [v for v, _ in top]
            assert values == sorted(values, reverse=True) and logprob <= values[0] + 1e-6
            if token in [i for _, i in top]:
                assert dict((i, v) for v, i in top)[token] == pytest.approx(logprob, abs=1e-6)
    assert [top[0][1] for top in greedy.top_logprobs] == greedy.output_ids  # greedy samples the most likely


@pytest.mark.parametrize("stream", [False, True])
def test_a_cancelled_generation_stops_running_on_the_server(server, prompt, stream):
    async def body(client):
        task = asyncio.create_task(client.generate(prompt, max_new_tokens=CONTEXT_LENGTH - len(prompt),
                                                   extra_sampling_params=SEEDED,
                                                   on_tokens=(lambda *run: None) if stream else None))
        await _until_running(client, min_tokens_s=0.05)
        task.cancel()
        cancelled = time.monotonic()
        while (await client.get_server_info())[0]["num_running_requests"]:
            assert time.monotonic() - cancelled < 5, "the cancelled request still runs"
            await asyncio.sleep(0.02)
        return time.monotonic() - cancelled
    assert with_client([server.address], body) < 5


# --- routing, retries and pause edge cases, against fakes ---

def _answer(output_ids, finish_reason, weight_version="fake", token_texts=None, text=""):
    texts = token_texts or [None] * len(output_ids)
    return {"text": text, "output_ids": output_ids,
            "meta_info": {"finish_reason": finish_reason, "prompt_tokens": 1, "cached_tokens": 0,
                          "weight_version": weight_version,
                          "output_token_logprobs": [[-1.0, t, s] for t, s in zip(output_ids, texts)]}}


@contextlib.asynccontextmanager
async def fake_server(generate, **routes):
    """An aiohttp server on a free port whose /generate is `generate(body) -> dict` (async)."""
    app = web.Application()

    async def handle_generate(request):
        answer = await generate(await request.json())
        return answer if isinstance(answer, web.Response) else web.json_response(answer)
    app.router.add_post("/generate", handle_generate)
    for path, handler in routes.items():
        app.router.add_post("/" + path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_a_trajectory_stays_on_one_server_and_new_ones_go_to_the_least_loaded():
    hold = None

    def named(name):
        async def generate(body):
            if body["sampling_params"]["max_new_tokens"] == 99:
                await hold.wait()  # keeps a request in flight on this server
            return _answer([1], {"type": "length", "length": 1}, weight_version=name)
        return generate

    async def main():
        nonlocal hold
        hold = asyncio.Event()
        async with fake_server(named("x")) as x, fake_server(named("y")) as y:
            client = InferenceClient([x, y])
            served = lambda gen: gen.weight_version  # noqa: E731 - each fake names itself there
            a1 = await client.generate([1], max_new_tokens=1, trajectory_id="a")
            b1 = await client.generate([1], max_new_tokens=1, trajectory_id="b")
            a2 = await client.generate([1], max_new_tokens=1, trajectory_id="a")
            b2 = await client.generate([1], max_new_tokens=1, trajectory_id="b")
            assert (served(a1), served(b1)) == ("x", "y"), "two trajectories spread over two servers"
            assert (served(a2), served(b2)) == ("x", "y"), "later turns stay where the trajectory started"
            client.end_trajectory("a")
            client.end_trajectory("b")
            # Equal live trajectories: the server with fewer requests in flight wins the tie.
            busy = asyncio.create_task(client.generate([1], max_new_tokens=99))
            await asyncio.sleep(0.1)
            c1 = await client.generate([1], max_new_tokens=1, trajectory_id="c")
            hold.set()
            assert served(await busy) == "x" and served(c1) == "y"
            await client.close()
    asyncio.run(main())


def test_5xx_is_retried_with_backoff_until_the_server_answers():
    calls = []

    async def flaky(body):
        calls.append(time.monotonic())
        if len(calls) < 3:
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        return _answer([7, 8], {"type": "length", "length": 2})

    async def main():
        async with fake_server(flaky) as address:
            client = InferenceClient([address], retry_backoff_s=0.05, max_retries=3)
            gen = await client.generate([1], max_new_tokens=2)
            await client.close()
            return gen
    gen = asyncio.run(main())
    assert gen.output_ids == [7, 8] and len(calls) == 3
    assert calls[1] - calls[0] >= 0.05 and calls[2] - calls[1] >= 0.1, "backoff doubles from retry_backoff_s"


def test_connection_refused_is_retried_then_raises_naming_the_address():
    address = f"http://127.0.0.1:{free_port()}"

    async def body(client):
        with pytest.raises(InferenceServerError) as info:
            await client.generate([1], max_new_tokens=2)
        return str(info.value)
    message = with_client([address], body, max_retries=2, retry_backoff_s=0.01)
    assert address in message and "after 3 attempt(s)" in message and "cannot connect" in message


def test_a_stop_string_cut_in_two_by_a_pause_still_ends_the_generation():
    """The server that resumes sees only its own piece ("wer> more"), so "</answer>" must be found by
    the client across the cut; the output ends at the token that completed it."""
    state = {"paused": asyncio.Event, "calls": 0}

    async def generate(body):
        state["calls"] += 1
        if state["calls"] == 1:
            await state["paused"].wait()  # in flight when the pause comes: answered as aborted
            return _answer([10, 11], {"type": "abort", "message": "Aborted"}, text="is </ans")
        assert body["input_ids"] == [1, 10, 11] and body["return_text_in_logprobs"]
        assert body["sampling_params"]["max_new_tokens"] == 8
        return _answer([12, 13, 14], {"type": "length", "length": 8}, token_texts=["wer", "> ", "more"],
                       text="wer> more")

    async def pause(request):
        state["paused"].set()
        return web.json_response({"status": "ok"})

    async def resume(request):
        return web.json_response({"status": "ok"})

    async def main():
        state["paused"] = asyncio.Event()
        async with fake_server(generate, pause_generation=pause, continue_generation=resume) as address:
            client = InferenceClient([address])
            task = asyncio.create_task(client.generate([1], max_new_tokens=10, stop=["</answer>"]))
            await asyncio.sleep(0.1)
            await client.pause_generation()
            await client.continue_generation(version=1)
            gen = await task
            await client.close()
            return gen
    gen = asyncio.run(main())
    assert gen.finish_reason == "stop" and gen.matched == "</answer>"
    assert gen.output_ids == [10, 11, 12, 13] and gen.versions == [0, 0, 1, 1]
    assert gen.text == "is "


@contextlib.asynccontextmanager
async def weight_server(apply_before_drop: bool):
    """A server whose first /update_weights_from_disk drops the connection without an answer, after
    applying the update (apply_before_drop) or before applying it; later calls answer normally."""
    state = {"version": "0", "posts": 0}

    async def update(request):
        body = await request.json()
        state["posts"] += 1
        if state["posts"] == 1:
            if apply_before_drop:
                state["version"] = body["weight_version"]
            request.transport.close()  # the answer is lost
            return web.Response()
        state["version"] = body["weight_version"]
        return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})

    async def model_info(request):
        return web.json_response({"weight_version": state["version"]})

    app = web.Application()
    app.router.add_post("/update_weights_from_disk", update)
    app.router.add_get("/model_info", model_info)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("applied", [True, False])
def test_a_weight_update_whose_answer_is_lost_is_checked_by_version_and_sent_again_only_if_needed(applied):
    async def main():
        async with weight_server(apply_before_drop=applied) as (address, state):
            client = InferenceClient([address], retry_backoff_s=0.01)
            answers = await client.update_weights_from_disk("/ckpt/7", weight_version="7")
            await client.close()
            return answers, state
    answers, state = asyncio.run(main())
    assert answers[0]["success"] and state["version"] == "7"
    assert state["posts"] == (1 if applied else 2), "loaded once, whichever side of the drop the load fell"


def test_each_request_carries_the_policy_version_as_its_prefix_cache_key_and_can_leave_it_out():
    # SGLang namespaces its radix cache by `extra_key`: a prefix cached under version 0's weights is
    # not reused by a request sent under version 1's.
    keys = []

    async def generate(body):
        keys.append(body.get("extra_key", "absent"))
        return _answer([1], {"type": "length", "length": 1})

    async def main():
        async with fake_server(generate) as address:
            client = InferenceClient([address])
            await client.generate([5, 6], max_new_tokens=1)
            client.set_version(1)
            await client.generate([5, 6], max_new_tokens=1)
            await client.close()
            plain = InferenceClient([address], version_cache_key=False)
            await plain.generate([5, 6], max_new_tokens=1)
            await plain.close()
    asyncio.run(main())
    assert keys == ["policy-v0", "policy-v1", "absent"]


def test_the_cpu_server_takes_sglangs_extra_key_and_refuses_one_of_the_wrong_type(server, prompt):
    async def body(client):
        return await client.generate(prompt, max_new_tokens=2, extra_sampling_params=SEEDED)
    assert len(with_client([server.address], body).output_ids) == 2  # sent with extra_key "policy-v0"

    async def post(extra_key):
        async with aiohttp.ClientSession() as session:
            async with session.post(server.address + "/generate", json={
                    "input_ids": prompt, "extra_key": extra_key, "sampling_params": {"max_new_tokens": 1}}) as r:
                return r.status, await r.text()
    status, text = asyncio.run(post({"not": "a string"}))
    assert status == 400 and "extra_key" in text
