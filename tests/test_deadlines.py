"""No silent hang in a run: every episode has a deadline (`episode_timeout_s`), past which it is
cancelled and its group fails, counted, while the step goes on with the other groups (sync and async
mode, training and evaluation, the token loop and agents behind the OpenAI proxy); a rollout that
outlives its episodes' deadline stops the run with an error naming what was still running and where.
Each test runs the real episode code against lib.scripted_server with a stub tool that never returns,
and bounds itself (asyncio.wait_for, get_groups' and run's timeouts) so that it fails, not hangs,
where the deadline is missing."""
import asyncio
import dataclasses
import threading
import time

import pytest
from transformers import AutoTokenizer

import train_calc as tc
import train_reflect as tr
import train_search as ts
from lib.async_rollout import BackgroundLoop, RolloutProducer
from lib.deadlines import RolloutTimeout
from lib.client import InferenceClient
from lib.scripted_server import Reply, ScriptedServer
from lib.tiny_model import default_tiny_model_dir

FINE = {"question": "Tom has 3 apples. He buys 4 more apples. How many apples does Tom have now?",
        "answer": "3 + 4 = 7.\n#### 7"}
STUCK = {"question": "Ann has 5 pears. She eats 2 pears. How many pears does Ann have now?",
         "answer": "5 - 2 = 3.\n#### 3"}
DEADLINE_S = 1.5  # the episodes that do finish take ~0.1 s, more on a loaded 2-core box
TEST_BOUND_S = 20  # what a test waits before it counts the rollout as hung


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_tiny_model_dir())


@pytest.fixture
def bg_loop():
    loop = BackgroundLoop()
    yield loop
    loop.close()


class InlinePool:
    """The reward pool's interface without processes."""

    async def score(self, fn, *args):
        return fn(*args)


class RewardThatNeverReturns(InlinePool):
    """Scores every answer but STUCK's, which it never returns."""

    async def score(self, fn, completion, answer):
        if answer == STUCK["answer"]:
            await asyncio.Event().wait()
        return fn(completion, answer)


def by_question(tokenizer, stuck_reply: Reply, fine_reply: Reply):
    """A scripted model that writes `stuck_reply` for STUCK's question and `fine_reply` otherwise."""
    def model(body):
        return stuck_reply if "Ann has 5 pears" in tokenizer.decode(body["input_ids"]) else fine_reply
    return [model]


async def bounded(coro):
    """The test's own bound: without an episode deadline the rollout hangs, and the test fails here."""
    return await asyncio.wait_for(coro, TEST_BOUND_S)


# --- sync mode: train_calc.py, its tool never returns ---
def test_a_tool_that_never_returns_fails_its_group_at_the_deadline_and_the_step_goes_on(tokenizer, monkeypatch,
                                                                                          capsys):
    release = threading.Event()
    calculate = tc.calculate

    def tool_that_never_returns(expression):
        if "999" in expression:
            release.wait(TEST_BOUND_S)  # "never": until the test ends
        return calculate(expression)
    monkeypatch.setattr(tc, "calculate", tool_that_never_returns)
    cfg = tc.Config(max_turns=3, max_tokens=512, episode_timeout_s=DEADLINE_S)
    script = by_question(tokenizer, Reply("<calc> 999 + 1 </calc>"), Reply("#### 7", eos=True))

    async def go(address):
        client = InferenceClient([address], max_retries=0)
        try:
            t0 = time.monotonic()
            out = await bounded(tc.rollout_groups(client, tokenizer, InlinePool(), cfg, [FINE, STUCK, FINE], 1.0, 2))
            return out, time.monotonic() - t0
        finally:
            release.set()
            await client.close()
    with ScriptedServer(tokenizer, script) as server:
        (groups, failed), elapsed = asyncio.run(go(server.address))
    assert failed == 1 and len(groups) == 2  # rollout/failed_groups == 1; the other groups are trained on
    assert all(e["rewards"].item() == 1.0 for g in groups for e in g)
    assert elapsed < DEADLINE_S + 5
    err = capsys.readouterr().err
    assert "EpisodeTimeout: episode of 'Ann has 5 pears" in err and "episode_timeout_s = 1.5 s" in err
    assert "turns=1" in err and "`result = await in_thread(calculate, expression)`" in err  # where it was stuck


def test_a_generation_cut_by_the_deadline_leaves_no_request_in_flight_and_nothing_recorded(tokenizer):
    cfg = tc.Config(max_turns=3, max_tokens=512, episode_timeout_s=DEADLINE_S)
    script = by_question(tokenizer, Reply("#### 3", eos=True, delay_s=2.0), Reply("#### 7", eos=True))

    async def go(address):
        client = InferenceClient([address], max_retries=0, max_concurrent_requests=8)
        try:
            groups, failed = await bounded(tc.rollout_groups(client, tokenizer, InlinePool(), cfg, [FINE, STUCK],
                                                             1.0, 2))
            return groups, failed, dict(client._in_flight), dict(client._routes), client._semaphore._value
        finally:
            await client.close()
    with ScriptedServer(tokenizer, script) as server:
        groups, failed, in_flight, routes, free_slots = asyncio.run(go(server.address))
    assert failed == 1 and [e["question"] for g in groups for e in g] == [FINE["question"]] * 2
    assert sum(in_flight.values()) == 0 and routes == {} and free_slots == 8  # the cut requests are gone


def test_an_evaluation_episode_past_its_deadline_is_counted_as_failed(tokenizer):
    cfg = tr.Config(max_turns=1, max_tokens=512, episode_timeout_s=DEADLINE_S)
    reflection_ids = tr.build_reflection_ids(tokenizer, True)
    script = by_question(tokenizer, Reply("#### 3", eos=True), Reply("#### 7", eos=True))

    async def go(address):
        client = InferenceClient([address], max_retries=0)
        try:
            return await bounded(tr.evaluate(client, tokenizer, reflection_ids, RewardThatNeverReturns(), cfg,
                                             [FINE, STUCK, FINE]))
        finally:
            await client.close()
    with ScriptedServer(tokenizer, script) as server:
        _, metrics = asyncio.run(go(server.address))
    assert metrics["failed"] == 1 and metrics["acc_final"] == 1.0


def test_an_openai_sdk_agent_past_its_deadline_fails_its_group_and_its_proxy_session_is_ended(tokenizer):
    from lib.openai_proxy import OpenAIProxy

    from tests.reflect_openai_agent import close_openai_clients, rollout_groups_openai

    cfg = tr.Config(max_turns=1, max_tokens=512, episode_timeout_s=DEADLINE_S)
    script = by_question(tokenizer, Reply("#### 3", eos=True), Reply("#### 7", eos=True))

    async def go(address):
        client = InferenceClient([address], max_retries=0)
        proxy = OpenAIProxy(client, tokenizer, max_context_tokens=cfg.max_tokens)
        await proxy.start()
        try:
            # The SDK's first request sets it up (its platform is probed in a thread): not under a deadline.
            await rollout_groups_openai(proxy, InlinePool(), dataclasses.replace(cfg, episode_timeout_s=0), [FINE], 1.0,
                                        1, "in_process")
            groups, failed = await bounded(rollout_groups_openai(proxy, RewardThatNeverReturns(), cfg, [FINE, STUCK],
                                                                 1.0, 2, "in_process"))
            return groups, failed, dict(proxy.sessions), dict(client._routes)
        finally:
            await close_openai_clients()
            await proxy.close()
            await client.close()
    with ScriptedServer(tokenizer, script) as server:
        groups, failed, sessions, routes = asyncio.run(go(server.address))
    assert failed == 1 and len(groups) == 1 and all(e["rewards"].item() == 1.0 for e in groups[0])
    assert sessions == {} and routes == {}  # the cancelled episodes' sessions were ended, not left recording


def test_a_langgraph_agent_whose_tool_never_returns_fails_its_group(tokenizer, monkeypatch):
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    import examples.langgraph_search as lg
    from lib import agent_episode
    from lib.async_rollout import gather_groups
    from lib.openai_proxy import OpenAIProxy
    from lib.tiny_model import TOOLS_CHAT_TEMPLATE

    def search_that_never_returns(http, retrieval_addr, cfg, counts):
        @tool
        async def search(query: str) -> str:
            """Search the encyclopedia; returns the top passages."""
            await asyncio.Event().wait()
        return search
    monkeypatch.setattr(lg, "make_search_tool", search_that_never_returns)
    tools_tokenizer = AutoTokenizer.from_pretrained(default_tiny_model_dir())
    tools_tokenizer.chat_template = TOOLS_CHAT_TEMPLATE
    cfg = lg.Config(episode_timeout_s=DEADLINE_S)
    stuck, fine = dict(STUCK, answer=["3"]), dict(FINE, answer=["7"])
    call = Reply('<tool_call>{"name": "search", "arguments": {"query": "pears"}}</tool_call>', eos=True)
    script = by_question(tools_tokenizer, call, Reply("7", eos=True))

    async def go(address):
        client = InferenceClient([address], max_retries=0)
        proxy = OpenAIProxy(client, tools_tokenizer, max_context_tokens=cfg.max_tokens)
        await proxy.start()
        lg.start_agent(cfg, "http://127.0.0.1:9")
        try:
            groups, failed = await bounded(gather_groups([agent_episode.rollout_group(
                proxy, lg.run_agent, item, cfg.temperature, 2, True, cfg.episode_timeout_s) for item in (fine, stuck)]))
            return groups, failed, dict(proxy.sessions)
        finally:
            await lg.close_agent()
            await proxy.close()
            await client.close()
    with ScriptedServer(tools_tokenizer, script) as server:
        groups, failed, sessions = asyncio.run(go(server.address))
    assert failed == 1 and len(groups) == 1 and [e["reward"] for e in groups[0]] == [1.0, 1.0]
    assert sessions == {}


# --- async mode: train_search.py through the RolloutProducer, its tool never returns ---
def test_in_async_mode_a_tool_that_never_returns_fails_its_group_and_the_producer_goes_on(tokenizer, bg_loop,
                                                                                          monkeypatch):
    run_tool = ts.run_tool

    async def tool_that_never_returns(session, retrieval_addr, kind, arg, cfg):
        if arg == "pears":
            await asyncio.Event().wait()
        return await run_tool(session, retrieval_addr, kind, arg, cfg)
    monkeypatch.setattr(ts, "run_tool", tool_that_never_returns)
    cfg = ts.Config(max_turns=4, max_tokens=1024, episode_timeout_s=DEADLINE_S)
    script = by_question(tokenizer, Reply("<search> pears </search>"), Reply("<answer> 7 </answer>", eos=True))
    items = [dict(FINE, answer=["7"]), dict(STUCK, answer=["3"])] + [dict(FINE, answer=["7"])] * 10

    with ScriptedServer(tokenizer, script) as server:
        client = InferenceClient([server.address], max_retries=0)
        producer = RolloutProducer(  # one group at a time: the stuck one holds up every later one until it fails
            bg_loop, lambda item: ts.rollout_group(client, None, tokenizer, cfg, item, "http://127.0.0.1:9", 1.0, 2),
            lambda i: items[i], capacity=1, max_staleness=100).start()
        try:
            groups = producer.get_groups(3, timeout_s=TEST_BOUND_S)
        finally:
            producer.stop()
            bg_loop.run(client.close(), timeout_s=30)
    assert producer.num_failed == 1  # rollout/failed_groups == 1, its place in the step empty (as in sync mode) ...
    assert len(groups) == 2 and all(e["rewards"].item() == 1.0 for g in groups for e in g)  # ... and the step goes on


def test_in_async_mode_no_group_ending_within_the_rollout_deadline_names_the_items_in_flight(bg_loop):
    from lib.deadlines import with_deadline

    async def episode_that_never_ends():
        turns = 2  # noqa: F841 (shown in the error)
        await asyncio.Event().wait()

    producer = RolloutProducer(bg_loop, lambda item: with_deadline(episode_that_never_ends(), 60, item),
                               lambda i: {"question": f"question {i}"}, capacity=2, max_staleness=0).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(RolloutTimeout) as error:
            producer.get_groups(1, timeout_s=0.5)
        assert time.monotonic() - t0 < 0.5 + 5
    finally:
        producer.stop()
    message = str(error.value)
    assert "gave 0 of 1 groups" in message and "items in flight: [0, 1]" in message
    assert "episode of 'question 0'" in message and "episode of 'question 1'" in message
    assert "turns=2" in message and "await asyncio.Event().wait()" in message


# --- the deadline of a whole rollout ---
def test_a_rollout_past_its_deadline_stops_with_an_error_naming_the_items_turns_and_tools_still_running(
        tokenizer, bg_loop, monkeypatch):
    async def tool_that_never_returns(session, retrieval_addr, kind, arg, cfg):
        await asyncio.Event().wait()
    monkeypatch.setattr(ts, "run_tool", tool_that_never_returns)
    cfg = ts.Config(max_turns=4, max_tokens=1024, episode_timeout_s=60)  # the rollout's deadline comes first here
    script = by_question(tokenizer, Reply("<search> pears </search>"), Reply("<answer> 7 </answer>", eos=True))
    with ScriptedServer(tokenizer, script) as server:
        client = InferenceClient([server.address], max_retries=0)
        try:
            with pytest.raises(RolloutTimeout) as error:
                bg_loop.run(ts.rollout_groups(client, None, tokenizer, cfg, [dict(FINE, answer=["7"]),
                                                                             dict(STUCK, answer=["3"])],
                                              "http://127.0.0.1:9", 1.0, 2),
                            timeout_s=2.0, what="step 1's rollout")
        finally:
            bg_loop.run(client.close(), timeout_s=30)
    message = str(error.value)
    assert message.startswith("step 1's rollout did not finish within 2 s")
    assert "2 x episode of 'Ann has 5 pears" in message and "Tom has" not in message  # which items
    assert "turns=1" in message and "tool_calls=1" in message  # which turn
    assert "await run_tool(" in message  # which tool


def test_a_rollout_whose_event_loop_is_blocked_stops_with_an_error_naming_the_blocking_line(tokenizer, bg_loop):
    class RewardThatBlocksTheLoop(InlinePool):
        async def score(self, fn, completion, answer):
            if answer == STUCK["answer"]:
                blocking_reward()
            return fn(completion, answer)

    release = threading.Event()

    def blocking_reward():
        release.wait(TEST_BOUND_S)  # a synchronous call on the event loop: no asyncio deadline can interrupt it

    bg_loop.answer_timeout_s = 0.5
    cfg = tc.Config(max_turns=3, max_tokens=512, episode_timeout_s=60)
    script = by_question(tokenizer, Reply("#### 3", eos=True), Reply("#### 7", eos=True))
    with ScriptedServer(tokenizer, script) as server:
        client = InferenceClient([server.address], max_retries=0)
        try:
            with pytest.raises(RolloutTimeout) as error:
                bg_loop.run(tc.rollout_groups(client, tokenizer, RewardThatBlocksTheLoop(), cfg, [FINE, STUCK], 1.0, 1),
                            timeout_s=0.5, what="the test evaluation")
            with pytest.raises(RuntimeError, match="still blocked"):  # the run's clean-up does not wait on it again
                bg_loop.run(client.close(), timeout_s=30)
        finally:
            release.set()
            bg_loop.run(client.close(), timeout_s=30)
    message = str(error.value)
    assert "the event loop is blocked in an episode of 'Ann has 5 pears" in message
    assert "reward = await reward_pool.score(reward_fn" in message and "blocking_reward" in message
    assert "await in_thread(tool, ...)" in message  # the fix
