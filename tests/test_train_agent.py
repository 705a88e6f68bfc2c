"""train_agent.py: the default agent's reward, episodes of any number of segments, the reward an
agent returns or posts, the sampling lock and the deadline, all through the real proxy in front of
a scripted server; then GRPO end to end on the CPU server with the tiny model."""
import asyncio
import json
import os

import aiohttp
import pytest
import torch

openai = pytest.importorskip("openai")

import lib.agent_episode as ae  # noqa: E402
import lib.run  # noqa: E402
import train_agent as ta  # noqa: E402
from lib.async_rollout import gather_groups  # noqa: E402
from lib.client import InferenceClient  # noqa: E402
from lib.openai_proxy import OpenAIProxy  # noqa: E402
from lib.scripted_server import Reply, ScriptedServer  # noqa: E402
from tests.test_reflect import FixedProducer  # noqa: E402

ITEM = {"question": "Tom has 3 apples. He buys 4 more apples. How many apples does Tom have now?",
        "answer": "3 + 4 = 7.\n#### 7"}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from lib.tiny_model import default_tiny_model_dir

    return AutoTokenizer.from_pretrained(default_tiny_model_dir())


def with_proxy(tokenizer, script, fn):
    """Run `await fn(proxy)` against the proxy train_agent.main builds, in front of a scripted server
    playing `script`: (its result, the server)."""
    async def go(address):
        client = InferenceClient([address], max_retries=0)
        proxy = OpenAIProxy(client, tokenizer, stop_token_ids=[tokenizer.eos_token_id], max_context_tokens=384,
                            default_max_tokens=64, train_sampling={"temperature": 1.0})
        await proxy.start()
        try:
            return await fn(proxy)
        finally:
            await ta.close_agent()
            await proxy.close()
            await client.close()
    with ScriptedServer(tokenizer, script) as server:
        return asyncio.run(go(server.address)), server


def episode_of(tokenizer, script, train=True):
    return with_proxy(tokenizer, script, lambda proxy: ae.arun_episode(proxy, ta.run_agent, ITEM, 1.0, train))


async def rollout_groups(proxy, items, group_size, cfg=None, agent=None):
    """(groups, failed) as a training rollout of train_agent.py gets them (lib.run.rollout_groups)."""
    cfg = cfg or ta.Config()
    return await gather_groups([ae.rollout_group(proxy, agent or ta.run_agent, item, cfg.temperature, group_size, True,
                                                 cfg.episode_timeout_s) for item in items])


def train_rows(episodes, group_size=2, **config):
    """lib.run's steps 1-2 over these episodes of train_agent.py: (batch, episodes, metrics)."""
    groups = [episodes[i:i + group_size] for i in range(0, len(episodes), group_size)]
    run = lib.run.Run(ta.Config(batch_size=len(groups), group_size=group_size, **config), producer=FixedProducer(groups))
    return lib.run.rollout_step(run, ae.episode_metrics)


def recorded(reward, segments):
    """An episode as lib/agent_episode.py makes it, of these recorded segments."""
    return {"reward": reward, "rewards": torch.tensor([reward]), "segments": segments, "stats": {}, "requests": 1,
            "length_cut": False, "tool_calls": 0, "tool_call_parse_failures": 0, "num_turns": 1, "finish_reason": "done",
            "discarded_turns": 0}


# --- (a) the default agent's reward ---
@pytest.mark.parametrize("text,reward", [
    ("3 + 4 = 7.\n#### 7", 1.0),
    ("#### 7.0", 1.0),
    ("The answer is\n####   $7.", 1.0),
    ("#### 1,007", 0.0),
    ("#### 8", 0.0),
    ("7", 0.0),  # no final line: not an answer
    ("#### seven", 0.0),
    ("#### 7 ... #### 9", 0.0),  # the last final line counts
    ("#### " + "7" * 100_000, 0.0),  # a huge number: cut at 31 digits, never converted whole
    ("####" * 50_000, 0.0),
    ("#### 7e99999999", 1.0),  # the number is 7; the rest of the line is not read as an exponent
    ("", 0.0),
])
def test_math_reward_is_one_only_for_the_gold_number_after_the_last_marker(text, reward):
    assert ta.math_reward(text, ITEM["answer"]) == reward


def test_the_warm_start_demonstrations_are_the_conversations_the_proxy_renders(tokenizer):
    cfg = ta.Config(warm_start_reflect_frac=1.0)  # every demonstration recovers from a wrong first answer
    (demo,) = ta.build_demonstrations(tokenizer, cfg, [ITEM])
    wrong = "#### " + tokenizer.decode([i for i, m in zip(demo["input_ids"], demo["loss_mask"]) if not m]).split("#### ")[1]
    messages = [{"role": "user", "content": ta.PROMPT.format(question=ITEM["question"])},
                {"role": "assistant", "content": wrong.split("<")[0].strip()},
                {"role": "user", "content": ta.REFLECTION}, {"role": "assistant", "content": ITEM["answer"]}]
    rendered = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    assert demo["input_ids"] == rendered  # the tokens the proxy gives the model, turn by turn
    assert 0 < demo["loss_mask"].count(0) < len(rendered) and wrong.split("<")[0].strip() != "#### 7"


@pytest.mark.parametrize("script,reward,requests", [
    ([Reply("3 + 4 = 7.\n#### 7", eos=True)], 1.0, 1),
    ([Reply("3 + 4 = 8.\n#### 8", eos=True), Reply("3 + 4 = 7.\n#### 7", eos=True)], ta.TURN_DISCOUNT, 2),
    ([Reply("#### 8", eos=True), Reply("#### 9", eos=True)], 0.0, 2),
    ([Reply("}}{{ <tool_call> #### ##", eos=True), Reply("\u00ff" * 50)], 0.0, 2),  # garbage, then cut by length
])
def test_the_default_agent_is_rewarded_for_the_gold_answer_with_a_discount_per_retry(tokenizer, script, reward, requests):
    episode, server = episode_of(tokenizer, script)
    assert episode["reward"] == pytest.approx(reward) and episode["requests"] == requests == len(server.requests)
    assert len(episode["segments"]) == 1  # the conversation only grows: one training sequence
    segment = episode["segments"][0]
    sampled = segment["input_ids"][0][segment["loss_mask"][0].bool()].tolist()
    assert sampled == [t for a in server.answers for t in a["output_ids"]]  # every sampled token, once
    assert all(body["sampling_params"]["temperature"] == 1.0 for body in server.requests)


def test_an_evaluation_episode_samples_at_the_eval_temperature(tokenizer):
    cfg = ta.Config(eval_temperature=0.0)
    (episodes, metrics), server = with_proxy(tokenizer, [Reply("#### 7", eos=True)], lambda proxy: ae.evaluate(
        proxy, ta.run_agent, [ITEM], cfg.eval_temperature, cfg.episode_timeout_s))
    assert metrics["reward"] == 1.0 and server.requests[0]["sampling_params"]["temperature"] == 0.0


# --- (b) any number of segments per episode ---
def two_segment_agent(reward):
    async def agent(base_url, api_key, item, temperature):
        llm = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        first = [{"role": "user", "content": item["question"]}]
        reply = await llm.chat.completions.create(model="policy", messages=first)
        # the agent rewrites its history (a summary in place of the exchange): a new segment
        summary = [{"role": "user", "content": "Summary: " + (reply.choices[0].message.content or "")}]
        await llm.chat.completions.create(model="policy", messages=summary)
        await llm.close()
        return reward
    return agent


async def no_model_agent(base_url, api_key, item, temperature):
    return 0.0  # answered without calling the model: nothing sampled


def test_every_segment_of_an_episode_trains_with_its_episodes_advantage_and_none_is_counted(tokenizer, monkeypatch):
    async def group(proxy):
        episodes = []
        for agent in (two_segment_agent(1.0), no_model_agent):
            monkeypatch.setattr(ta, "run_agent", agent)
            episodes.append(await ae.arun_episode(proxy, ta.run_agent, ITEM, 1.0, train=True))
        return episodes
    episodes, server = with_proxy(tokenizer, [Reply("abc", eos=True), Reply("de", eos=True)], group)
    assert [len(e["segments"]) for e in episodes] == [2, 0]
    batch, episodes, metrics = train_rows(episodes)
    assert [i for i, _ in lib.run.episode_rows(episodes)] == [0, 0] and metrics["rollout/episodes_without_segments"] == 1
    advantages = torch.cat([e["advantages"] for e in episodes])
    assert advantages[0] > 0 > advantages[1]  # the group statistics count each episode once
    assert torch.equal(batch["advantages"], advantages[[0, 0]]) and batch["rewards"].tolist() == [1.0, 1.0]
    trained = [batch["input_ids"][r][batch["loss_mask"][r].bool()].tolist() for r in range(2)]
    assert trained == [a["output_ids"] for a in server.answers]  # each segment trains its own reply


async def retrying_agent(base_url, api_key, item, temperature):
    llm = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    first = [{"role": "user", "content": item["question"]}]
    await llm.chat.completions.create(model="policy", messages=first)  # thrown away: the agent asks again
    reply = await llm.chat.completions.create(model="policy", messages=first)
    summary = [{"role": "user", "content": "Summary: " + (reply.choices[0].message.content or "")}]
    await llm.chat.completions.create(model="policy", messages=summary)  # a new conversation: a second segment
    await llm.close()
    return 1.0


@pytest.mark.parametrize("credit", [{}, {"train_discarded_turns": True}, {"segment_weight": "segment"}])
def test_an_episode_trains_the_replies_its_agent_went_on_from_and_its_k_rows_weigh_one_over_k(tokenizer, credit):
    cfg = ta.Config(**credit)
    options = {"train_discarded": cfg.train_discarded_turns, "segment_weight": cfg.segment_weight}

    async def group(proxy):
        return [await ae.arun_episode(proxy, agent, ITEM, 1.0, True, **options)
                for agent in (retrying_agent, two_segment_agent(0.0))]
    script = [Reply(x, eos=True) for x in ("abc", "de", "fgh", "ij", "kl")]
    episodes, server = with_proxy(tokenizer, script, group)
    retried = [a["output_ids"] for a in server.answers[:3]]
    batch, episodes, metrics = train_rows(episodes, **credit)
    trained = [batch["input_ids"][r][batch["loss_mask"][r].bool()].tolist() for r in range(len(batch["rewards"]))]
    assert metrics["rollout/discarded_turns"] == 1 and episodes[0]["discarded_turns"] == 1
    if credit.get("train_discarded_turns"):  # the reply asked for again is trained too
        assert trained[:3] == retried and batch["row_weights"].tolist() == pytest.approx([1 / 3] * 3 + [1 / 2] * 2)
    else:  # the one the agent went on from, and the summary's
        assert trained[:2] == retried[1:]
        weights = [1.0] * 4 if credit.get("segment_weight") == "segment" else [1 / 2] * 4
        assert batch["row_weights"].tolist() == pytest.approx(weights)
    assert [r["row_weight"] for e in episodes for r in e["segments"]] == pytest.approx(batch["row_weights"].tolist())


def test_a_segment_weight_other_than_episode_or_segment_is_refused_before_anything_starts(tokenizer):
    with pytest.raises(ValueError, match="segment_weight must be one of"):
        ae.attach_agent(lib.run.Run(ta.Config(segment_weight="1/k")), ta.run_agent)  # no proxy, no client yet
    with pytest.raises(ValueError, match="segment_weight must be one of"):
        with_proxy(tokenizer, [Reply("#### 7", eos=True)], lambda proxy: ae.arun_episode(
            proxy, ta.run_agent, ITEM, 1.0, True, segment_weight="1/k"))


def test_a_step_whose_episodes_recorded_nothing_has_nothing_to_train():
    batch, _, metrics = train_rows([recorded(r, []) for r in (1.0, 0.0)])
    assert batch == {} and metrics["rollout/episodes_without_segments"] == 2 and metrics["rollout/trained_rows"] == 0


def test_a_group_whose_rewards_are_equal_is_dropped_when_asked():
    segment = {k: torch.ones(1, 3, dtype=torch.long) for k in ("input_ids", "loss_mask", "attention_mask", "versions")}
    segment["logprobs"] = torch.zeros(1, 3)
    batch, episodes, metrics = train_rows([recorded(r, [segment]) for r in (1.0, 1.0, 1.0, 0.0)], drop_equal_groups=True,
                                          refill_rounds=0)
    assert [e["keep"].item() for e in episodes] == [False, False, True, True]
    assert metrics["rollout/equal_reward_groups"] == 1 and len(batch["advantages"]) == 2


# --- the reward an agent returns or posts ---
async def posting_agent(base_url, api_key, item, temperature):
    async with aiohttp.ClientSession() as http:
        async with http.post(base_url.removesuffix("/v1") + "/agentrl/reward", json={"reward": 0.25}) as r:
            assert r.status == 200
    return None


@pytest.mark.parametrize("agent,expected", [
    (posting_agent, 0.25),
    (lambda *a: asyncio.sleep(0, result=None), "posted no reward"),
    (lambda *a: asyncio.sleep(0, result=float("nan")), "finite number"),
    (lambda *a: asyncio.sleep(0, result="1"), "finite number"),
])
def test_the_reward_is_returned_or_posted_and_must_be_a_finite_number(tokenizer, monkeypatch, agent, expected):
    monkeypatch.setattr(ta, "run_agent", agent)
    if isinstance(expected, float):
        episode, _ = episode_of(tokenizer, [Reply("x", eos=True)])
        assert episode["reward"] == expected
    else:
        with pytest.raises(ValueError, match=expected):
            episode_of(tokenizer, [Reply("x", eos=True)])


async def agent_with_stats(base_url, api_key, item, temperature):
    return {"reward": 0.5, "searches": 3, "answered": True, "answer": "7"}


def test_an_agent_may_return_its_own_stats_beside_the_reward(tokenizer, monkeypatch):
    monkeypatch.setattr(ta, "run_agent", agent_with_stats)
    episode, _ = episode_of(tokenizer, [Reply("x", eos=True)])
    assert episode["reward"] == 0.5 and episode["stats"] == {"searches": 3, "answered": True, "answer": "7"}
    other = {**episode, "stats": {"searches": 1}}
    assert ae.mean_stats([episode, other]) == {"searches": 2.0, "answered": 1.0}  # strings go to traces only


@pytest.mark.parametrize("result,expected", [
    ({"reward": 1.0, "requests": 2}, "logs itself"),
    ({"reward": 1.0, "searches": float("inf")}, "finite number"),
    ({"reward": 1.0, "messages": [1]}, "finite number"),
    ({"searches": 1}, "posted no reward"),
])
def test_an_agents_stats_must_be_numbers_or_strings_under_names_of_its_own(tokenizer, monkeypatch, result, expected):
    monkeypatch.setattr(ta, "run_agent", lambda *a: asyncio.sleep(0, result=result))
    with pytest.raises(ValueError, match=expected):
        episode_of(tokenizer, [Reply("x", eos=True)])


# --- the sampling lock and the deadline drop a group, counted ---
def test_an_agent_sampling_at_another_temperature_fails_its_group_naming_it(tokenizer, monkeypatch):
    async def hot_agent(base_url, api_key, item, temperature):
        llm = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        try:
            await llm.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                              temperature=0.7)
        finally:
            await llm.close()
        return 1.0
    monkeypatch.setattr(ta, "run_agent", hot_agent)
    with pytest.raises(RuntimeError, match="all 1 groups") as e:
        with_proxy(tokenizer, [Reply("x", eos=True)], lambda proxy: rollout_groups(proxy, [ITEM], 2))
    assert e.value.__cause__.code == "sampling_fixed_for_training" and "temperature" in str(e.value.__cause__)


def test_an_episode_past_its_deadline_drops_its_group_and_the_others_train(tokenizer, monkeypatch):
    async def agent(base_url, api_key, item, temperature):
        if item["question"] == "slow":
            await asyncio.sleep(30)
        return 1.0
    monkeypatch.setattr(ta, "run_agent", agent)
    cfg = ta.Config(episode_timeout_s=0.5)
    (groups, failed), _ = with_proxy(tokenizer, [Reply("x", eos=True)], lambda proxy: rollout_groups(
        proxy, [{"question": "slow"}, {"question": "fast"}], 2, cfg))
    assert failed == 1 and len(groups) == 1 and [e["item"]["question"] for e in groups[0]] == ["fast", "fast"]


# --- run_agent in worker processes (cfg.agent_workers) ---
async def slow_question_agent(base_url, api_key, item, temperature):  # module-level: a worker imports it by name
    if item["question"] == "slow":
        await asyncio.sleep(60)
    return await ta.run_agent(base_url, api_key, item, temperature)


def with_agent_workers(agent, num_workers, fn):
    """`await fn(proxy, workers)` with `agent` run by AgentWorkers as train_agent.setup builds them."""
    from lib.agent_workers import AgentWorkers

    async def go(proxy):
        workers = AgentWorkers(agent, num_workers, init=ta.start_agent, init_args=(ta.Config(),), close=ta.close_agent)
        try:
            return await fn(proxy, workers)
        finally:
            await workers.close()
    return go


def test_agent_workers_below_minus_one_are_refused():
    with pytest.raises(ValueError, match="agent_workers must be -1"):
        ta.setup(ta.Config(agent_workers=-2))  # before anything starts


def test_an_episode_run_in_a_worker_process_records_every_token_the_server_sampled(tokenizer):
    script = [Reply("#### 8", eos=True), Reply("3 + 4 = 7.\n#### 7", eos=True)]
    episode, server = with_proxy(tokenizer, script, with_agent_workers(ta.run_agent, 1, lambda proxy, workers: (
        ae.arun_episode(proxy, workers.run, ITEM, 1.0, True))))
    assert episode["reward"] == pytest.approx(ta.TURN_DISCOUNT) and episode["requests"] == 2
    segment = episode["segments"][0]
    sampled = segment["input_ids"][0][segment["loss_mask"][0].bool()].tolist()
    assert sampled == [t for a in server.answers for t in a["output_ids"]]


def test_an_episode_in_a_worker_past_its_deadline_drops_its_group_ends_its_session_and_the_others_train(tokenizer):
    async def rollout(proxy, workers):
        await rollout_groups(proxy, [ITEM], 2, agent=workers.run)  # both workers started
        result = await rollout_groups(proxy, [{"question": "slow", "answer": "#### 7"}, ITEM], 2,
                                      ta.Config(episode_timeout_s=2.0), workers.run)
        return result, len(proxy.sessions), sum(len(w.jobs) for w in workers._workers)
    ((groups, failed), open_sessions, running), _ = with_proxy(tokenizer, [Reply("#### 7", eos=True)],
                                                                with_agent_workers(slow_question_agent, 2, rollout))
    assert failed == 1 and [e["reward"] for e in groups[0]] == [1.0, 1.0] and groups[0][0]["item"] == ITEM
    assert open_sessions == 0 and running == 0


# --- set-up and tear-down ---
def test_a_setup_that_fails_midway_closes_what_it_opened(tmp_path, monkeypatch):
    from lib.async_rollout import BackgroundLoop
    from lib.tiny_model import default_tiny_model_dir

    for split in ("train", "dev", "test"):
        (tmp_path / f"{split}.jsonl").write_text(json.dumps(ITEM) + "\n")
    loops = []
    monkeypatch.setattr(lib.run, "BackgroundLoop", lambda: loops.append(BackgroundLoop()) or loops[-1])
    monkeypatch.setattr(ta, "warm_started_model", lambda cfg, base, embedded: default_tiny_model_dir())

    def broken_proxy(*args, **kwargs):
        raise RuntimeError("the proxy did not start")
    monkeypatch.setattr(ae, "OpenAIProxy", broken_proxy)
    with pytest.raises(RuntimeError, match="the proxy did not start"):
        ta.setup(ta.Config(run_dir=str(tmp_path / "run"), data_dir=str(tmp_path), server="external",
                           server_addrs=["http://127.0.0.1:9"], tensorboard=False))
    assert len(loops) == 1 and loops[0].loop.is_closed()  # the event loop it had started is closed


# --- (c) end to end ---
E2E = dict(max_steps=2, batch_size=2, group_size=2, max_new_tokens_per_turn=24, eval_every=0, eval_size=4, test_size=4,
           warm_start_steps=4, warm_start_batch_size=4, warm_start_direct_steps=2, warm_start_problems=2000,
           checkpoint_every=1, tensorboard=False, trainer_threads=1)


@pytest.mark.slow
def test_the_agent_trains_in_async_mode_with_the_token_scripts_plumbing(tmp_path):
    run_dir = str(tmp_path / "async")
    result = ta.main(config="configs/agent_tiny.yaml", run_dir=run_dir, mode="async", max_staleness=1,
                     **{**E2E, "checkpoint_every": 0})
    assert result["failed"] == 0
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "rollout/reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/failed_groups"] == 0 and r["rollout/gen_tokens"] > 0 and r["rollout/staleness_max"] <= 1
        assert r["logprob/server_trainer_abs_diff_mean"] < 0.05  # the proxy's tokens are the ones the server scored


@pytest.mark.slow
def test_two_grpo_steps_run_end_to_end_and_resume(tmp_path):
    run_dir = str(tmp_path / "agent")
    result = ta.main(config="configs/agent_tiny.yaml", run_dir=run_dir, **E2E)
    assert set(result) == {"failed", "reward", "requests", "completion_tokens"} and result["failed"] == 0
    assert 1 <= result["requests"] <= ta.MAX_TURNS
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "rollout/reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/failed_groups"] == 0 and r["rollout/episodes"] == 4 and r["rollout/gen_tokens"] > 0
        assert r["rollout/segments_per_episode"] == 1.0 and r["rollout/trained_rows"] == 4
        assert r["logprob/server_trainer_abs_diff_mean"] < 0.05  # the proxy's tokens are the ones the server scored
        assert "loss/loss" in r and r["policy/version"] == r["step"]
    assert any("test/reward" in r for r in rows)
    traces = [json.loads(line) for line in open(os.path.join(run_dir, "traces.jsonl"))]
    assert {t["step"] for t in traces} == {1, 2} and all(t["tokens"]["tlp"] is not None for t in traces)
    # resume continues from step 2's checkpoint to step 3, on the resumed weights
    ta.main(config="configs/agent_tiny.yaml", run_dir=run_dir, resume=True, **{**E2E, "max_steps": 3})
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "rollout/reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert steps[-1]["logprob/server_trainer_abs_diff_mean"] < 0.05 and steps[-1]["policy/version"] == 3


# --- other frameworks, as docs/train_agent.md plugs them in ---
async def langchain_agent(base_url, api_key, item, temperature):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, temperature=temperature, max_retries=0)
    reply = await llm.ainvoke([("user", item["question"])])
    return ta.math_reward(reply.content, item["answer"])


async def agents_sdk_agent(base_url, api_key, item, temperature):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    llm = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    agent = Agent(name="solver", instructions="Answer with a number.",
                  model=OpenAIResponsesModel(model="policy", openai_client=llm),
                  model_settings=ModelSettings(temperature=temperature))
    result = await Runner.run(agent, item["question"])
    return ta.math_reward(result.final_output, item["answer"])


@pytest.mark.parametrize("agent,module", [(langchain_agent, "langchain_openai"), (agents_sdk_agent, "agents")])
def test_an_agent_of_another_framework_trains_through_the_same_entry_point(tokenizer, monkeypatch, agent, module):
    pytest.importorskip(module)
    monkeypatch.setattr(ta, "run_agent", agent)
    episode, server = episode_of(tokenizer, [Reply("#### 7", eos=True)])
    assert episode["reward"] == 1.0 and len(episode["segments"]) == 1 and episode["requests"] == 1
    segment = episode["segments"][0]
    assert segment["input_ids"][0][segment["loss_mask"][0].bool()].tolist() == server.answers[0]["output_ids"]
    assert server.requests[0]["sampling_params"]["temperature"] == 1.0  # the trainer's


@pytest.mark.slow
def test_a_run_whose_agent_never_calls_the_model_trains_nothing_and_keeps_the_version(tmp_path, monkeypatch):
    monkeypatch.setattr(ta, "run_agent", no_model_agent)
    run_dir = str(tmp_path / "idle")
    ta.main(config="configs/agent_tiny.yaml", run_dir=run_dir, **{**E2E, "checkpoint_every": 2, "test_size": 2})
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "rollout/reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/episodes_without_segments"] == 4 and r["rollout/trained_rows"] == 0
        assert r["policy/version"] == 0 and not any(k.startswith("loss/") for k in r)
    extra = torch.load(os.path.join(run_dir, "checkpoints", "latest", "trainer_state.pt"), weights_only=False)["extra"]
    assert extra["version"] == 0 and extra["data_position"] == 2 * 2
