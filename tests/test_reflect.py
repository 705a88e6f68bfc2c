"""train_reflect.py: reward, reflection boundary, discount, data loading, and 2-step runs of both modes."""
import asyncio
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch

import train_reflect as tr
import lib.run
from lib.run import episode_rows
from lib.reward_pool import RewardPool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- reward ---
@pytest.mark.parametrize("completion, answer", [
    ("3 + 4 = 7.\n#### 7", "3 + 4 = 7.\n#### 7"),
    ("#### 1,000", "#### 1000"),
    ("#### 1000", "#### 1,000"),
    ("The total is $5.00.", "#### 5"),
    ("So she has 18 marbles", "#### 18"),
    ("#### 12 apples", "#### 12"),
    ("The answer is \\boxed{42}.", "#### 42"),
    ("\\boxed{\\frac{3}{4}}", "#### 0.75"),
    ("\\boxed{\\dfrac{10}{4}}", "#### 2.5"),
    ("\\boxed{5 \\text{ dollars}}", "#### 5"),
    ("#### 3/4", "#### 0.75"),
    ("The change is -5", "#### -5"),
    ("#### 7.0", "#### 7"),
    ("#### 0.5", "#### .5"),
    ("She scored 50%", "#### 50"),
    ("First 3 + 4 = 7, then 7 * 2 = 14", "#### 14"),
    ("#### 9\nwait, no: 10", "#### 9"),  # the #### line wins over a later number
    ("\\boxed{8} and then 9", "#### 8"),  # the boxed answer wins over a later number
])
def test_reward_is_one_for_the_gold_number_in_any_accepted_format(completion, answer):
    assert tr.reward_fn(completion, answer) == 1.0


@pytest.mark.parametrize("completion, answer", [
    ("#### 8", "#### 7"),
    ("I do not know.", "#### 7"),
    ("", "#### 7"),
    ("#### -5", "#### 5"),
    ("#### 1.5", "#### 15"),
    ("#### 1,0000", "#### 10000"),  # not a thousands separator: reads as 1, then 0000
    ("\\boxed{}", "#### 0"),
    ("#### 7", "no gold number here"),
])
def test_reward_is_zero_for_wrong_or_missing_answers(completion, answer):
    assert tr.reward_fn(completion, answer) == 0.0


ADVERSARIAL = {
    "code in boxed": "\\boxed{__import__('os').system('touch {marker}')}",
    "python eval bait": "#### __import__('os').system('touch {marker}') or 123456789",
    "100k characters": "9 " * 50_000,
    "deeply nested latex": "\\boxed{" + "{\\frac{1}{" * 20_000 + "2" + "}}" * 20_000 + "}",
    "huge exponent": "#### 10^{10^{10^{100}}} \\boxed{9**9**9**9}",
    "huge number": "#### " + "9" * 100_000,
    "unclosed boxed": "\\boxed{" * 10_000,
    "many hashes": "####" * 25_000,
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_outputs_finish_fast_and_execute_nothing(name, tmp_path):
    marker = tmp_path / "executed"
    completion = ADVERSARIAL[name].replace("{marker}", str(marker))
    t0 = time.monotonic()
    reward = tr.reward_fn(completion, "#### 123456789")
    assert time.monotonic() - t0 < 1.0
    assert reward == 0.0  # the bait's number comes after code that is never run: the first number wins
    assert not marker.exists()


def sleep_forever(completion, answer):
    time.sleep(3600)


def kill_worker(completion, answer):
    os._exit(1)


@pytest.fixture(scope="module")
def reward_pool():
    pool = RewardPool(num_workers=1, timeout_s=2.0, preload=tr.reward_fn)
    yield pool
    pool.close()


def test_reward_pool_scores_in_a_worker_process(reward_pool):
    assert asyncio.run(reward_pool.score(tr.reward_fn, "#### 7", "#### 7")) == 1.0


def test_a_hanging_reward_scores_zero_within_the_timeout_and_the_pool_recovers(reward_pool):
    asyncio.run(reward_pool.score(tr.reward_fn, "#### 1", "#### 1"))  # workers up before timing
    timeouts = reward_pool.num_timeouts
    t0 = time.monotonic()
    assert asyncio.run(reward_pool.score(sleep_forever, "", "")) == 0.0
    assert time.monotonic() - t0 < 2.0 + 1.0
    assert reward_pool.num_timeouts == timeouts + 1
    assert asyncio.run(reward_pool.score(tr.reward_fn, "#### 7", "#### 7")) == 1.0


def test_a_dying_worker_scores_zero_is_counted_and_the_pool_recovers(reward_pool):
    failures = reward_pool.num_failures
    assert asyncio.run(reward_pool.score(kill_worker, "", "")) == 0.0
    assert reward_pool.num_failures == failures + 1
    assert asyncio.run(reward_pool.score(tr.reward_fn, "#### 7", "#### 7")) == 1.0


def test_the_reward_workers_of_a_trainer_killed_with_sigkill_exit():
    """A killed trainer never shuts its pool down; its workers must not wait for it for ever."""
    from tests.killed_trainer import after_sigkill

    workers, left = after_sigkill("""
import asyncio, time
from lib.reward_pool import RewardPool, _ready
pool = RewardPool(num_workers=2, timeout_s=5.0, preload=_ready)
asyncio.run(pool.score(_ready))  # the workers are up
print(" ".join(str(pid) for pid in pool._pool._processes), flush=True)
time.sleep(600)
""", timeout_s=10)
    assert len(workers) == 2 and not left, "reward workers outlived their trainer"


# --- episodes against a scripted server ---
@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from lib.tiny_model import default_tiny_model_dir

    return AutoTokenizer.from_pretrained(default_tiny_model_dir())


class ScriptedClient:
    """Answers each generate call with the next scripted reply: text -> its token ids (+ eos
    unless the reply is marked as cut by length), made-up log-probs and the current version."""

    def __init__(self, tokenizer, replies: list[tuple[str, bool]], version: int = 3):
        self.tokenizer, self.replies, self.version = tokenizer, list(replies), version
        self.sent: list[dict] = []  # what the server "sampled": ids and log-probs per call
        self.prompts: list[list[int]] = []

    async def generate(self, input_ids, *, max_new_tokens, temperature, stop_token_ids, trajectory_id, **kw):
        text, ends_turn = self.replies.pop(0)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][:max_new_tokens]
        if ends_turn and len(ids) < max_new_tokens:
            ids = ids + [self.tokenizer.eos_token_id]
        logprobs = [-0.01 * (i + 1) for i in range(len(ids))]
        self.prompts.append(list(input_ids))
        self.sent.append({"ids": ids, "logprobs": logprobs})
        return SimpleNamespace(output_ids=ids, logprobs=logprobs, versions=[self.version] * len(ids),
                               finish_reason="stop" if ends_turn else "length")

    def end_trajectory(self, trajectory_id):
        pass


class InlinePool:
    """The reward pool's interface without processes, for episode tests."""

    async def score(self, fn, *args):
        return fn(*args)


ITEM = {"question": "Tom has 3 apples. He buys 4 more apples. How many apples does Tom have now?",
        "answer": "3 + 4 = 7.\n#### 7"}


def run_episode(tokenizer, replies, **cfg_overrides):
    cfg = tr.Config(**{"max_turns": 3, "turn_discount": 0.9, "max_tokens": 1024, **cfg_overrides})
    client = ScriptedClient(tokenizer, replies)
    reflection_ids = tr.build_reflection_ids(tokenizer, cfg.apply_chat_template)
    episode = asyncio.run(tr.arun_episode(client, tokenizer, reflection_ids, InlinePool(), cfg, ITEM, 1.0))
    return episode, client


def test_reflection_trajectory_is_the_chat_template_rendering_of_the_conversation(tokenizer):
    replies = [("3 + 4 = 8.\n#### 8", True), ("#### 6", True), ("3 + 4 = 7.\n#### 7", True)]
    episode, _ = run_episode(tokenizer, replies)
    conversation = [{"role": "user", "content": tr.PROMPT_TEMPLATE.format(question=ITEM["question"])}]
    for text, _ in replies:
        conversation += [{"role": "assistant", "content": text}, {"role": "user", "content": tr.REFLECTION}]
    rendered = tokenizer.apply_chat_template(conversation[:-1], tokenize=False)
    ids = episode["input_ids"][0].tolist()
    assert tokenizer.decode(ids, skip_special_tokens=False) == rendered.rstrip("\n")
    assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"][: len(ids)]


def test_every_sampled_token_is_trained_on_once_with_the_servers_logprob(tokenizer):
    episode, client = run_episode(tokenizer, [("#### 8", True), ("#### 7", True)])
    mask = episode["loss_mask"][0].bool()
    assert episode["input_ids"][0][mask].tolist() == [t for s in client.sent for t in s["ids"]]
    assert episode["logprobs"][0][mask].tolist() == pytest.approx([lp for s in client.sent for lp in s["logprobs"]])
    assert (episode["logprobs"][0][~mask] == 0).all()
    assert (episode["versions"][0][mask] == 3).all() and (episode["versions"][0][~mask] == -1).all()
    # the second call saw exactly the trajectory so far: prompt, first turn, reflection
    assert client.prompts[1] == episode["input_ids"][0].tolist()[: len(client.prompts[1])]


def test_a_turn_cut_by_length_is_closed_with_an_untrained_end_of_turn(tokenizer):
    episode, client = run_episode(tokenizer, [("3 + 4 = 7 and so on and so on", False), ("#### 7", True)],
                                  max_new_tokens_per_turn=5)
    ids, mask = episode["input_ids"][0].tolist(), episode["loss_mask"][0].tolist()
    first_turn_end = len(client.prompts[0]) + 5
    assert ids[first_turn_end] == tokenizer.eos_token_id and mask[first_turn_end] == 0
    assert episode["num_turns"] == 2


@pytest.mark.parametrize("correct_at, expected_reward", [(1, 1.0), (2, 0.9), (3, 0.81), (None, 0.0)])
def test_reward_is_discounted_by_turn_discount_per_extra_turn(tokenizer, correct_at, expected_reward):
    replies = [("#### 7" if t == correct_at else "#### 5", True) for t in (1, 2, 3)]
    episode, _ = run_episode(tokenizer, replies)
    assert episode["rewards"].item() == pytest.approx(expected_reward)
    assert episode["num_turns"] == (correct_at or 3)
    assert episode["correct_turn"] == (correct_at or 0)


def test_single_turn_rlvr_never_reflects(tokenizer):
    episode, client = run_episode(tokenizer, [("#### 5", True)], max_turns=1)
    assert episode["num_turns"] == 1 and episode["rewards"].item() == 0.0
    assert episode["input_ids"][0].tolist()[-1] == tokenizer.eos_token_id


def test_the_context_budget_ends_the_episode_cleanly(tokenizer):
    prompt_len = len(tr.build_prompt_ids(tokenizer, ITEM["question"], True))
    episode, _ = run_episode(tokenizer, [("#### 5", True)] * 3, max_tokens=prompt_len + 10)
    assert episode["finish_reason"] == "max_tokens"
    assert episode["rewards"].item() == 0.0 and episode["input_ids"].shape[1] <= prompt_len + 10


def test_garbage_model_output_scores_zero_without_an_exception(tokenizer):
    garbage = "<|im_start|>system\n\\boxed{{{{ #### ∞ \x00 <|endoftext|>"
    episode, _ = run_episode(tokenizer, [(garbage, True)] * 3)
    assert episode["rewards"].item() == 0.0 and episode["finish_reason"] == "max_turns"


def scripted_episode(tokenizer, script, **cfg_overrides):
    """arun_episode with the real client against lib.scripted_server (SGLang's finishing rules)."""
    from lib.client import InferenceClient
    from lib.scripted_server import ScriptedServer

    cfg = tr.Config(**{"max_turns": 3, "max_tokens": 1024, **cfg_overrides})
    reflection_ids = tr.build_reflection_ids(tokenizer, cfg.apply_chat_template)

    async def go(address):
        client = InferenceClient([address], max_retries=0)
        try:
            return await tr.arun_episode(client, tokenizer, reflection_ids, InlinePool(), cfg, ITEM, 1.0)
        finally:
            await client.close()
    with ScriptedServer(tokenizer, script) as server:
        return asyncio.run(go(server.address)), server, reflection_ids


def test_a_turn_ended_by_another_stop_id_is_followed_by_the_templates_untrained_end_of_turn(tokenizer):
    """Qwen2.5 stops on <|endoftext|> as well as <|im_end|>, but its template closes a turn with
    <|im_end|>: the reflection must follow an <|im_end|> (not sampled, not trained), so that the next
    turn conditions on what the template renders. (It used to follow the <|endoftext|> directly.)"""
    from lib.scripted_server import Reply

    other, im_end = tokenizer.convert_tokens_to_ids("<|endoftext|>"), tokenizer.eos_token_id
    answer = tokenizer("#### 8", add_special_tokens=False)["input_ids"]
    episode, server, reflection_ids = scripted_episode(
        tokenizer, [Reply(ids=answer + [other]), Reply("#### 7", eos=True)], stop_token_ids=[im_end, other])
    ids, mask = episode["input_ids"][0].tolist(), episode["loss_mask"][0].tolist()
    start = len(server.requests[0]["input_ids"])
    assert ids[start:start + len(answer) + 2 + len(reflection_ids)] == answer + [other, im_end] + reflection_ids
    assert mask[start:start + len(answer) + 2] == [1] * (len(answer) + 1) + [0]
    assert server.requests[1]["input_ids"] == ids[:len(server.requests[1]["input_ids"])]
    # without the sampled <|endoftext|>, the trajectory is the template's rendering of the dialogue
    conversation = [{"role": "user", "content": tr.PROMPT_TEMPLATE.format(question=ITEM["question"])},
                    {"role": "assistant", "content": "#### 8"}, {"role": "user", "content": tr.REFLECTION},
                    {"role": "assistant", "content": "#### 7"}]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False).rstrip("\n")
    assert tokenizer.decode(ids[:start + len(answer)] + ids[start + len(answer) + 1:]) == rendered
    assert episode["rewards"].item() == pytest.approx(0.9)


def test_eos_as_the_last_allowed_token_closes_the_turn_once(tokenizer):
    """The server reports it as length; the turn is still closed by the sampled EOS, trained on."""
    from lib.scripted_server import Reply

    answer = tokenizer("#### 7", add_special_tokens=False)["input_ids"]
    episode, server, _ = scripted_episode(tokenizer, [Reply(ids=answer, eos=True)],
                                          max_new_tokens_per_turn=len(answer) + 1)
    assert server.answers[0]["meta_info"]["finish_reason"]["type"] == "length"
    ids, mask = episode["input_ids"][0].tolist(), episode["loss_mask"][0].tolist()
    assert ids[-len(answer) - 1:] == answer + [tokenizer.eos_token_id] and mask[-1] == 1
    assert ids.count(tokenizer.eos_token_id) == 1 + tr.build_prompt_ids(tokenizer, ITEM["question"], True).count(
        tokenizer.eos_token_id)


def test_an_aborted_turn_drops_the_group_and_is_counted(tokenizer):
    from lib.client import InferenceClient
    from lib.scripted_server import Reply, ScriptedServer

    cfg = tr.Config(max_turns=1)
    reflection_ids = tr.build_reflection_ids(tokenizer, True)
    calls = {"n": 0}

    def script(body):
        calls["n"] += 1
        return Reply("#### 7", abort_after=1) if calls["n"] == 3 else Reply("#### 7", eos=True)

    async def go(address):
        client = InferenceClient([address], max_retries=0)
        groups = await tr.rollout_groups(client, tokenizer, reflection_ids, InlinePool(), cfg, [ITEM, ITEM], 1.0, 2)
        await client.close()
        return groups
    with ScriptedServer(tokenizer, [script]) as server:
        groups, failed = asyncio.run(go(server.address))
    assert failed == 1 and len(groups) == 1 and [e["rewards"].item() for e in groups[0]] == [1.0, 1.0]


# --- the same agent on the openai SDK, through lib/openai_proxy.py ---
def both_paths(tokenizer, script_fn, http_client="aiohttp", **cfg_overrides):
    """The token loop and the openai-SDK agent (tests/reflect_openai_agent.py), each against a fresh
    scripted server playing the same model output: (token episode, its server), (SDK episode, its server)."""
    from lib.client import InferenceClient
    from lib.openai_proxy import OpenAIProxy
    from lib.scripted_server import ScriptedServer
    from tests.reflect_openai_agent import close_openai_clients, rollout_groups_openai

    cfg = tr.Config(**{"max_turns": 3, "max_tokens": 1024, **cfg_overrides})
    reflection_ids = tr.build_reflection_ids(tokenizer, cfg.apply_chat_template)

    async def go(address, agent):
        client = InferenceClient([address], max_retries=0)
        proxy = None
        if agent == "openai":
            proxy = OpenAIProxy(client, tokenizer, stop_token_ids=cfg.stop_token_ids, max_context_tokens=cfg.max_tokens,
                                default_max_tokens=cfg.max_new_tokens_per_turn)
            await proxy.start()
        try:
            if proxy:
                groups, failed = await rollout_groups_openai(proxy, InlinePool(), cfg, [ITEM], 1.0, 1, http_client)
            else:
                groups, failed = await tr.rollout_groups(client, tokenizer, reflection_ids, InlinePool(), cfg, [ITEM],
                                                         1.0, 1)
            assert failed == 0
            return groups[0][0]
        finally:
            if proxy:
                await close_openai_clients()
                await proxy.close()
            await client.close()
    out = []
    for agent in ("tokens", "openai"):
        with ScriptedServer(tokenizer, script_fn()) as server:
            out.append((asyncio.run(go(server.address, agent)), server))
    return out


def _scenarios(tokenizer):
    from lib.scripted_server import Reply

    answer = tokenizer("#### 7", add_special_tokens=False)["input_ids"]
    other = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    prompt_len = len(tr.build_prompt_ids(tokenizer, ITEM["question"], True))
    return {
        "reflect twice": (lambda: [Reply("3 + 4 = 8.\n#### 8", eos=True), Reply("#### 6", eos=True),
                                   Reply("3 + 4 = 7.\n#### 7", eos=True)], {}),
        "turn cut by length": (lambda: [Reply("3 + 4 = 7 and so on and so on"), Reply("#### 7", eos=True)],
                               {"max_new_tokens_per_turn": 5}),
        "context budget": (lambda: [Reply("#### 5", eos=True)], {"max_tokens": prompt_len + 10}),
        "eos as the last allowed token": (lambda: [Reply(ids=answer, eos=True)],
                                          {"max_new_tokens_per_turn": len(answer) + 1}),
        "another eos id": (lambda: [Reply(ids=answer[:-1] + [other]), Reply("#### 7", eos=True)],
                           {"stop_token_ids": [tokenizer.eos_token_id, other]}),
    }


@pytest.mark.parametrize("scenario", ["reflect twice", "turn cut by length", "context budget",
                                      "eos as the last allowed token", "another eos id"])
@pytest.mark.parametrize("http_client", ["aiohttp", "httpx", "in_process"])
def test_the_openai_sdk_agent_gives_the_token_loops_trajectory_id_for_id(tokenizer, scenario, http_client):
    script_fn, overrides = _scenarios(tokenizer)[scenario]
    (tokens, token_server), (sdk, sdk_server) = both_paths(tokenizer, script_fn, http_client=http_client,
                                                           **overrides)
    [segment] = sdk["segments"]  # the conversation only grows: one training row
    assert episode_rows([sdk]) == [(0, segment)] and episode_rows([tokens]) == [(0, tokens)]
    for key in ("input_ids", "loss_mask", "versions", "attention_mask"):
        assert torch.equal(tokens[key], segment[key]), key
    assert torch.allclose(tokens["logprobs"], segment["logprobs"]) and torch.equal(tokens["rewards"], sdk["rewards"])
    for key in ("num_turns", "correct_turn", "finish_reason", "turn_texts", "shows_work"):
        assert tokens[key] == sdk[key], key
    assert [r["input_ids"] for r in token_server.requests] == [r["input_ids"] for r in sdk_server.requests]
    assert ([r["sampling_params"]["max_new_tokens"] for r in token_server.requests]
            == [r["sampling_params"]["max_new_tokens"] for r in sdk_server.requests])


def test_warm_start_demonstrations_never_train_on_the_wrong_first_answer(tokenizer):
    cfg = tr.Config(max_turns=2, warm_start_reflect_frac=1.0)
    reflection_ids = tr.build_reflection_ids(tokenizer, True)
    [demo] = tr.build_demonstrations(tokenizer, cfg, [ITEM], reflection_ids)
    untrained = tokenizer.decode([t for t, m in zip(demo["input_ids"], demo["loss_mask"]) if not m])
    assert "####" in untrained and "#### 7" not in untrained and untrained.endswith(tokenizer.eos_token)
    assert tokenizer.decode(demo["input_ids"]).count(tr.REFLECTION) == 1
    solution = tokenizer(ITEM["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert demo["input_ids"][-len(solution):] == solution and all(demo["loss_mask"][-len(solution):])


def test_a_pretrained_model_is_warm_started_on_its_own_answers_only(tokenizer):
    cfg = tr.Config(max_turns=2, warm_start_reflect_frac=1.0)
    reflection_ids = tr.build_reflection_ids(tokenizer, True)
    [demo] = tr.build_demonstrations(tokenizer, cfg, [ITEM], reflection_ids, loss_on_prompt=False)
    trained = tokenizer.decode([t for t, m in zip(demo["input_ids"], demo["loss_mask"]) if m])
    assert trained == ITEM["answer"] + "<|im_end|>"  # not the question, the wrong answer or the reflection turn


def test_direct_demonstrations_give_the_final_line_only(tokenizer):
    reflection_ids = tr.build_reflection_ids(tokenizer, True)
    items = [ITEM] * 40
    demos = tr.build_demonstrations(tokenizer, tr.Config(max_turns=1), items, reflection_ids, direct_frac=0.5)
    prompt_len = len(tr.build_prompt_ids(tokenizer, ITEM["question"], True))
    answers = [tokenizer.decode(d["input_ids"][prompt_len:], skip_special_tokens=True) for d in demos]
    assert set(answers) == {"#### 7", ITEM["answer"]}
    assert 10 <= answers.count("#### 7") <= 30  # about half
    assert [tr.shows_work(a) for a in answers] == [a == ITEM["answer"] for a in answers]
    # frac 0 (the default): every demonstration works the problem out
    plain = tr.build_demonstrations(tokenizer, tr.Config(max_turns=2), items, reflection_ids)
    assert all(tokenizer.decode(d["input_ids"]).count("3 + 4 = 7") == 1 for d in plain)


def test_shows_work_looks_for_a_calculation_before_the_answer():
    assert tr.shows_work("3 + 4 = 7.\n#### 7") and tr.shows_work("3 + 4 = 7, so 7")
    assert not tr.shows_work("#### 7") and not tr.shows_work("7") and not tr.shows_work("#### 3 + 4 = 7")


# --- data ---
def test_gsm8k_style_files_load_and_dev_is_carved_from_train(tmp_path):
    import datasets

    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(30)]
    datasets.Dataset.from_list(rows[:20]).to_parquet(str(tmp_path / "train.parquet"))
    datasets.Dataset.from_list(rows[20:]).to_parquet(str(tmp_path / "test.parquet"))
    splits = tr.load_splits(tr.Config(dataset=str(tmp_path), dev_size=5))
    assert (len(splits["train"]), len(splits["dev"]), len(splits["test"])) == (15, 5, 10)
    assert not {r["question"] for r in splits["train"]} & {r["question"] for r in splits["dev"]}
    assert splits["test"][0] == rows[20]


def test_a_dev_split_in_the_files_is_used_as_is(tmp_path):
    for split, n in (("train", 6), ("dev", 2), ("test", 3)):
        with open(tmp_path / f"{split}.jsonl", "w") as f:
            for i in range(n):
                f.write(json.dumps({"question": f"{split} {i}", "answer": f"#### {i}"}) + "\n")
    splits = tr.load_splits(tr.Config(dataset=str(tmp_path)))
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [6, 2, 3]


# --- the training step's options ---
def test_neg_adv_scale_weights_only_the_below_average_episodes():
    from lib.grpo import grpo_advantages

    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    plain, _, _ = lib.run.advantages_and_keep(tr.Config(group_size=2), rewards)
    scaled, equal, keep = lib.run.advantages_and_keep(tr.Config(group_size=2, neg_adv_scale=0.25), rewards)
    assert torch.equal(plain, grpo_advantages(rewards, 2))
    assert scaled[0] == plain[0] > 0 and scaled[1] == 0.25 * plain[1] and plain[1] < 0
    assert scaled[2:].tolist() == [0.0, 0.0] and equal.tolist() == [False, False, True, True] and keep.all()


class RecordingActor:
    """An actor that scores every token 0 and records the rows of each update."""

    def __init__(self):
        self.updates = []

    def compute_logprobs(self, rows):
        return torch.zeros_like(rows["logprobs"])

    def update(self, rows, step):
        self.updates.append(rows["input_ids"][:, 0].tolist())
        return {"num_tokens": int(rows["loss_mask"].sum()), "loss": 1.0}


@pytest.mark.parametrize("ppo_minibatches,expected", [(1, 1), (2, 2), (9, 5)])  # at most one step per row
def test_ppo_minibatches_make_that_many_optimizer_steps_over_disjoint_rows(ppo_minibatches, expected):
    actor = RecordingActor()
    run = lib.run.Run(tr.Config(ppo_minibatches=ppo_minibatches), actor=actor)
    batch = {"input_ids": torch.arange(5)[:, None].repeat(1, 3), "loss_mask": torch.ones(5, 3, dtype=torch.long),
             "logprobs": torch.zeros(5, 3), "advantages": torch.ones(5), "rewards": torch.ones(5)}
    metrics = lib.run.train_step(run, batch)
    assert len(actor.updates) == metrics["loss/minibatches"] == expected
    assert sorted(row for rows in actor.updates for row in rows) == [0, 1, 2, 3, 4]
    assert metrics["loss/num_tokens"] == 15 and metrics["logprob/server_trainer_abs_diff_max"] == 0.0


def test_a_step_with_no_rows_trains_nothing():
    actor = RecordingActor()
    metrics = lib.run.train_step(lib.run.Run(tr.Config(), actor=actor), {})
    assert actor.updates == [] and set(metrics) == {"perf/logp_s", "perf/update_s"}


class FixedProducer:
    """Stands in for the async producer: hands out the groups it was given, all fresh."""
    num_failed = num_wasted_tokens = num_dropped_stale = 0

    def __init__(self, groups):
        self.groups = groups

    def get_groups(self, num_groups, timeout_s=None):
        out, self.groups = self.groups[:num_groups], self.groups[num_groups:]
        return out

    def data_ledger(self):
        return 0, []


def sdk_episode(reward, *segment_lengths):
    segments = [{"input_ids": torch.arange(n)[None], "loss_mask": torch.ones(1, n, dtype=torch.long),
                 "logprobs": torch.zeros(1, n), "versions": torch.zeros(1, n, dtype=torch.long),
                 "attention_mask": torch.ones(1, n, dtype=torch.long)} for n in segment_lengths]
    return {"segments": segments, "rewards": torch.tensor([reward]), "num_turns": 1, "correct_turn": int(reward > 0),
            "shows_work": False, "finish_reason": "correct" if reward else "max_turns"}


def test_every_segment_of_an_sdk_agents_episode_is_a_row_with_its_episodes_advantage():
    from lib.grpo import grpo_advantages

    episodes = [sdk_episode(1.0, 3, 5), sdk_episode(0.0)]  # two segments; none (the agent sampled nothing)
    run = lib.run.Run(tr.Config(batch_size=1, group_size=2), producer=FixedProducer([episodes]),
                 reward_pool=SimpleNamespace(num_timeouts=0, num_failures=0))
    batch, got, metrics = lib.run.rollout_step(run, tr.episode_metrics)
    advantage = grpo_advantages(torch.tensor([1.0, 0.0]), 2)[0]
    assert batch["advantages"].tolist() == [advantage] * 2 and batch["rewards"].tolist() == [1.0, 1.0]
    assert batch["attention_mask"].sum(1).tolist() == [3, 5] and metrics["rollout/gen_tokens"] == 8
    assert metrics["rollout/reward"] == 0.5 and metrics["rollout/episodes"] == 2  # each episode counted once
    assert [i for i, _ in episode_rows(got)] == [0, 0]


def test_a_step_whose_sdk_agent_sampled_nothing_has_nothing_to_train():
    run = lib.run.Run(tr.Config(batch_size=1, group_size=2), producer=FixedProducer([[sdk_episode(1.0), sdk_episode(0.0)]]),
                 reward_pool=SimpleNamespace(num_timeouts=0, num_failures=0))
    batch, _, metrics = lib.run.rollout_step(run, tr.episode_metrics)
    assert batch == {} and metrics["rollout/gen_tokens"] == 0 and metrics["rollout/kept_groups"] == 1


# --- end to end ---
E2E = dict(max_steps=2, batch_size=2, group_size=2, max_turns=2, max_new_tokens_per_turn=24,
           eval_every=0, eval_size=4, test_size=4, warm_start_steps=4, warm_start_batch_size=4, warm_start_direct_steps=2,
           checkpoint_every=1, tensorboard=False, trainer_threads=1, warm_start_problems=2000)


@pytest.mark.slow
@pytest.mark.parametrize("mode,weight_sync,pause_mode", [("sync", "disk", "in_place"), ("async", "nccl", "in_place"),
                                                        ("async", "disk", "abort")])  # "nccl" is gloo on CPUs
def test_two_grpo_steps_run_end_to_end_and_resume(mode, weight_sync, pause_mode, tmp_path):
    run_dir = str(tmp_path / mode)
    result = tr.main(config="configs/reflect_tiny.yaml", run_dir=run_dir, mode=mode, weight_sync=weight_sync,
                     pause_mode=pause_mode, **E2E)
    assert set(result) == {"acc_turn1", "acc_final", "turns", "reward", "shows_work", "failed"} and result["failed"] == 0
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "loss/pg" in r or "rollout/reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["logprob/server_trainer_abs_diff_mean"] < 0.05  # trainer and server agree on the policy
        assert r["rollout/staleness_max"] <= (1 if mode == "async" else 0)
        assert r["rollout/failed_groups"] == 0 and r["logprob/behaviour_weight_max"] > 0.5
        assert r["rollout/dropped_stale_groups"] == 0 and r["rollout/wasted_tokens"] == 0  # admission control
        assert r["logprob/mismatch_kl_k3"] >= 0.0 and 0 <= r["logprob/behaviour_capped_fraction"] <= 1
    assert any("test/acc_final" in r for r in rows)
    assert os.path.exists(os.path.join(run_dir, "traces.jsonl"))
    # resume continues from step 2's checkpoint to step 3
    tr.main(config="configs/reflect_tiny.yaml", run_dir=run_dir, mode=mode, weight_sync=weight_sync, resume=True,
            pause_mode=pause_mode, **{**E2E, "max_steps": 3})
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in rows if "rollout/reward" in r] == [1, 2, 3]
    assert rows[-2]["logprob/server_trainer_abs_diff_mean"] < 0.05  # the resumed weights reached the server


@pytest.mark.slow
def test_async_at_max_staleness_0_reproduces_sync_exactly(tmp_path, monkeypatch):
    # Same seeds, seeded sampling: the same trajectories each step, in the same order (two PPO mini-batches:
    # which rows each one trains depends on it), and the same weights at the end. A step's groups finish
    # in reverse item order here, so async mode must put them back in item order, as sync mode has them.
    rollout_group = tr.rollout_group

    async def finishing_in_reverse(client, tokenizer, reflection_ids, reward_pool, cfg, item, *args):
        group = await rollout_group(client, tokenizer, reflection_ids, reward_pool, cfg, item, *args)
        if "index" in item:  # a training item
            await asyncio.sleep(0.3 * (cfg.batch_size - 1 - item["index"] % cfg.batch_size))
        return group
    monkeypatch.setattr(tr, "rollout_group", finishing_in_reverse)
    runs = {}
    for mode in ("sync", "async"):
        run_dir = str(tmp_path / mode)
        tr.main(config="configs/reflect_tiny.yaml", run_dir=run_dir, mode=mode, max_staleness=0, seeded_sampling=True,
                **{**E2E, "max_steps": 3, "checkpoint_every": 0, "test_size": 2, "ppo_minibatches": 2,
                   "trace_groups": E2E["batch_size"]})
        rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
        traces = [json.loads(line) for line in open(os.path.join(run_dir, "traces.jsonl"))]
        weights = safetensors.torch.load_file(os.path.join(run_dir, "final", "model.safetensors"))
        runs[mode] = ([r for r in rows if "rollout/reward" in r], traces, weights)
    (sync_rows, sync_traces, sync_weights), (async_rows, async_traces, async_weights) = runs["sync"], runs["async"]
    assert len(sync_rows) == len(async_rows) == 3
    for a, b in zip(sync_rows, async_rows):
        assert a["rollout/reward"] == b["rollout/reward"] and a["rollout/gen_tokens"] == b["rollout/gen_tokens"] > 0
        assert b["rollout/staleness_max"] == 0 and a["loss/loss"] == pytest.approx(b["loss/loss"], abs=1e-6)
    assert sum(r["loss/grad_norm"] for r in sync_rows) > 0  # the weights moved
    in_order = lambda traces: [(t["step"], t["group"], t["index"], t["tokens"]["id"], t["tokens"]["ver"])  # noqa: E731
                               for t in traces]
    assert len(sync_traces) == 3 * E2E["batch_size"] * E2E["group_size"]
    assert in_order(sync_traces) == in_order(async_traces)
    # The same weights, to rounding: the server's log-probs (the behaviour policy's, in the loss) come from batches
    # that group concurrent requests as they arrive, so their last bits can differ, and Adam turns a rounding
    # difference in a near-zero gradient into an update difference (one element of 65,536 at 1.03e-6 in one suite
    # run of 2026-11-29). Another mini-batch order or other rows would move many elements by about the lr (5e-5).
    for name, w in sync_weights.items():
        diff = (async_weights[name] - w).abs()
        assert diff.max() <= 1e-5 and (diff > 1e-6).float().mean() < 1e-3, (name, diff.max().item())


@pytest.mark.slow
def test_dynamic_sampling_refills_the_batch_and_a_step_with_nothing_to_train_keeps_the_version(tmp_path):
    # group_size 1: every group's rewards are "all equal", so dynamic sampling drops each one and
    # refills twice per step; nothing is ever trained, so the weights and the version stay.
    run_dir = str(tmp_path / "dapo")
    tr.main(config="configs/reflect_tiny.yaml", run_dir=run_dir, drop_equal_groups=True, refill_rounds=2,
            **{**E2E, "group_size": 1, "checkpoint_every": 2})
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "rollout/reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/episodes"] == 2 * 3  # batch_size groups, then two refills of as many
        assert r["rollout/kept_groups"] == 0 and r["rollout/wasted_tokens"] == r["rollout/gen_tokens"] > 0
        assert "loss/pg" not in r
    extra = torch.load(os.path.join(run_dir, "checkpoints", "latest", "trainer_state.pt"), weights_only=False)["extra"]
    assert extra["version"] == 0 and extra["data_position"] == 2 * 2 * 3


@pytest.mark.slow
def test_torchrun_two_ranks_train_on_their_share_of_rank0s_batch(tmp_path):
    run_dir = str(tmp_path / "fsdp")
    flags = [f"--{k}={v}" for k, v in {**E2E, "checkpoint_every": 2}.items()]
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "train_reflect.py",
            "--run_dir", run_dir, "--weight_sync", "nccl", *flags]  # FSDP2 and the weight group over gloo on CPUs
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "rollout/reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # 4 episodes per step, 2 per rank; loss stats are rank 0's
        assert r["logprob/server_trainer_abs_diff_max"] < 1e-3
        assert r["loss/num_tokens"] < r["rollout/gen_tokens"]
    assert any("test/acc_final" in r for r in rows)
    assert os.path.exists(os.path.join(run_dir, "final", "model.safetensors"))
    assert os.path.exists(os.path.join(run_dir, "checkpoints", "latest"))
