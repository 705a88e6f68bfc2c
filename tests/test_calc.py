"""train_calc.py: the calculator on valid and hostile input, the parsers, the reward, the episode
against lib.scripted_server (SGLang's answer shapes, hostile ones included), the warm-start
demonstrations, and the whole script (2 steps, then a resume) end to end."""
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

import train_calc as tc
from lib.client import GenerationAborted
from lib.ranks import server_seed
from lib.reward_pool import RewardPool
from lib.scripted_server import InlineRewardPool, Reply, continuing, scripted_episode, split_by_mask
from lib.tiny_model import default_tiny_model_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITEM = {"question": "Tom has 3 bags with 4 apples in each. He buys 5 more apples. How many apples does Tom have now?",
        "answer": "Tom has 3 * 4 = 12 apples.\n12 + 5 = 17.\n#### 17"}


# --- the calculator ---
@pytest.mark.parametrize("expression, value", [
    ("12 * 7", "84"), ("3 + 4", "7"), ("10 - 12", "-2"), ("7 / 2", "3.5"), ("-7 / 2", "-3.5"), ("1 / 3", "1/3"),
    ("1 / 3 * 3", "1"), ("-(2 + 3) * 4", "-20"), ("0.1 + 0.2", "0.3"), ("2.50 * 2", "5"), ("((((1))))", "1"),
    ("  3+4  ", "7"), ("100 / 8", "12.5"), ("1 / 1000000000000", "0.000000000001"),
    ("(" * 99 + "1" + ")" * 99, "1"),  # redundant parentheses nest no operation: bounded by the length alone
])
def test_the_calculator_computes_exactly_with_numbers_four_operations_and_parentheses(expression, value):
    assert tc.calculate(expression) == value


HOSTILE = {
    "power tower": "9**9**9",
    "power": "2 ** 10",
    "import": "__import__('os').system('touch {marker}')",
    "eval bait": "eval(\"__import__('os').system('touch {marker}')\")",
    "name": "x + 1",
    "call": "abs(-1)",
    "attribute": "(1).__class__",
    "string": "'a' * 9",
    "list": "[1] * 9",
    "lambda": "(lambda: 1)()",
    "walrus": "(x := 1)",
    "comparison": "1 < 2",
    "conditional": "1 if 1 else 2",
    "floor division": "7 // 2",
    "modulo": "7 % 2",
    "bitwise": "2 ^ 3",
    "unary plus and invert": "~+1",
    "bool": "True + 1",
    "complex": "1j * 1j",
    "statement": "1; import os",
    "assignment": "x = 1",
    "ellipsis": "...",
    "empty": "",
    "unclosed": "(1 + 2",
    "newline": "3 +\n 4",
    "null byte": "1\x00 + 2",
    "huge literal": "9" * 16,
    "huge float": "1e400",
    "huge product": "99999999 * 99999999 * 99999999",
    "tiny fraction": "1" + " / 7" * 20,
    "division by zero": "1 / (2 - 2)",
    "deep nesting": "(1+" * 40 + "1" + ")" * 40,
    "unary chain": "-" * 199 + "1",
    "long sum": "+".join(["1"] * 60),
    "too long": "1 + " * 100 + "1",
    "megabyte": "1" * 1_000_000,
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_expressions_return_an_error_string_quickly_and_run_nothing(name, tmp_path):
    marker = tmp_path / "executed"
    t0 = time.monotonic()
    result = tc.calculate(HOSTILE[name].replace("{marker}", str(marker)))
    assert time.monotonic() - t0 < 0.1
    assert result.startswith("error: ")
    assert not marker.exists()


def test_calculator_errors_name_their_cause():
    assert tc.calculate("1 / 0") == "error: division by zero"
    assert tc.calculate("99999999 * 99999999 * 99999999") == "error: number out of range"
    assert tc.calculate("2 ** 3") == "error: only numbers, + - * / and parentheses are allowed"
    assert tc.calculate("(1+" * 40 + "1" + ")" * 40) == "error: expression nested too deeply"
    assert "longer than" in tc.calculate("1 + " * 100 + "1")


ARITHMETIC_ISH = st.text(alphabet=st.sampled_from(list("0123456789+-*/(). eEjx_\n,%^~<>=ab'\"[]")), max_size=80)


@settings(max_examples=300, deadline=None, database=None)
@given(ARITHMETIC_ISH | st.text(max_size=80))
def test_the_calculator_never_raises_and_answers_a_number_or_an_error(expression):
    result = tc.calculate(expression)
    assert isinstance(result, str)
    if not result.startswith("error: "):
        assert Fraction(result) is not None  # "84", "3.5" and "1/3" all read back exactly


# --- parsers ---
@pytest.mark.parametrize("text, expression", [
    ("First <calc> 3 + 4 </calc>", "3 + 4"),
    ("<calc>3+4</calc>", "3+4"),
    ("<calc> 1 </calc> then <calc> 2 * 2 </calc>", "2 * 2"),
    ("<calc> <calc> 5 </calc>", "5"),
    ("<calc></calc>", ""),  # a call with an empty expression: the calculator answers with an error
    ("<calc> 3 + 4", None),
    ("3 + 4 </calc>", None),
    ("#### 7", None),
])
def test_parse_calc_reads_the_last_complete_call(text, expression):
    assert tc.parse_calc(text) == expression


@pytest.mark.parametrize("text, answer", [
    ("#### 7", Fraction(7)), ("so\n#### 1,000", Fraction(1000)), ("#### -3", Fraction(-3)),
    ("#### 2.5", Fraction(5, 2)), ("#### 7 apples", Fraction(7)), ("#### 5\n#### 6", Fraction(6)),
    ("7", None), ("####", None), ("#### seven", None), ("#### " + "9" * 100_000, None),
])
def test_parse_answer_reads_the_number_after_the_last_marker(text, answer):
    assert tc.parse_answer(text) == answer


# --- reward ---
@pytest.mark.parametrize("completion, reward", [
    ("<calc> 12 + 5 </calc>.\n#### 17", 1.0),
    ("#### 17.0", 1.0),  # exact fractions: 17.0 is 17
    ("#### 17,", 1.0),
    ("#### 18", 0.0),
    ("<calc> 12 + 5 </calc> 17", 0.0),  # no final line
    ("", 0.0),
    ("#### 17\nno wait\n#### 16", 0.0),  # the last marker counts
])
def test_reward_is_one_exactly_when_the_final_number_equals_the_gold(completion, reward):
    assert tc.reward_fn(completion, ITEM["answer"]) == reward


def test_a_gold_without_a_number_scores_zero():
    assert tc.reward_fn("#### 7", "no number here") == 0.0


@pytest.mark.parametrize("completion", ["9 " * 50_000, "####" * 25_000, "#### " + "1," * 50_000, "<calc>" * 20_000])
def test_the_reward_of_adversarial_text_is_zero_and_fast(completion):
    t0 = time.monotonic()
    assert tc.reward_fn(completion, ITEM["answer"]) == 0.0
    assert time.monotonic() - t0 < 1.0


def test_the_reward_runs_in_the_time_bounded_pool():
    pool = RewardPool(1, 10.0, preload=tc.reward_fn)  # reward_fn must import by name in a spawned worker
    try:
        assert asyncio.run(pool.score(tc.reward_fn, "#### 17", ITEM["answer"])) == 1.0
    finally:
        pool.close()


# --- episodes against a scripted server ---
@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_tiny_model_dir())


def run_episode(tokenizer, script, **cfg_overrides):
    """arun_episode with the real client against lib.scripted_server; (episode, server)."""
    cfg = tc.Config(**{"max_turns": 4, "max_tokens": 512, **cfg_overrides})
    return scripted_episode(tokenizer, script,
                            lambda client: tc.arun_episode(client, tokenizer, InlineRewardPool(), cfg, ITEM, 1.0))


def prompt_len(tokenizer) -> int:
    return len(tc.build_prompt_ids(tokenizer, ITEM["question"], tc.Config()))


def episode_texts(tokenizer, episode) -> tuple[str, str]:
    """(what the model sampled, what the episode added after the prompt), decoded."""
    return split_by_mask(tokenizer, episode["input_ids"][0].tolist(), episode["loss_mask"][0].tolist(),
                         prompt_len(tokenizer))


def test_a_calculator_turn_then_the_answer_with_the_result_masked(tokenizer):
    script = [Reply("<calc> 3 * 4 + 5 </calc> and more"), Reply(".\n#### 17", eos=True)]  # " and more": past the stop
    ep, server = run_episode(tokenizer, script)
    ids = ep["input_ids"][0].tolist()
    prompt_text = tokenizer.decode(tc.build_prompt_ids(tokenizer, ITEM["question"], tc.Config()))
    assert tokenizer.decode(ids) == prompt_text + "<calc> 3 * 4 + 5 </calc><result> 17 </result>.\n#### 17<|im_end|>"
    sampled, added = episode_texts(tokenizer, ep)
    assert sampled == "<calc> 3 * 4 + 5 </calc>.\n#### 17<|im_end|>" and added == "<result> 17 </result>"
    assert server.requests[1]["input_ids"] == ids[:len(server.requests[1]["input_ids"])]  # the turn saw the result
    assert ep["turn_texts"] == [("model", "<calc> 3 * 4 + 5 </calc>"), ("tool", "17"), ("model", ".\n#### 17")]
    assert ep["rewards"].item() == 1.0 and ep["num_tool_calls"] == 1 and ep["finish_reason"] == "answer"
    mask = ep["loss_mask"][0].bool()
    assert (ep["logprobs"][0][~mask] == 0).all() and (ep["versions"][0][~mask] == -1).all()


def test_a_calculator_error_goes_back_to_the_model_and_the_episode_goes_on(tokenizer):
    ep, _ = run_episode(tokenizer, [Reply("<calc> 9**9**9 </calc>"), Reply("<calc> 12 + 5 </calc>"),
                                         Reply("#### 17", eos=True)])
    assert ep["turn_texts"][1] == ("tool", "error: only numbers, + - * / and parentheses are allowed")
    assert ep["num_tool_calls"] == 2 and ep["num_tool_failures"] == 1 and ep["rewards"].item() == 1.0


def test_every_sampled_token_of_a_turn_cut_into_pieces_is_in_the_trajectory_once_with_its_logprob(tokenizer):
    ep, server = run_episode(tokenizer, [continuing("I will add. #### 17", tokenizer)], max_new_tokens_per_turn=3)
    sampled = [t for a in server.answers for t in a["output_ids"]]
    sampled_lps = [row[0] for a in server.answers for row in a["meta_info"]["output_token_logprobs"]]
    mask = ep["loss_mask"][0].tolist()
    assert len(server.answers) > 3, "the turn came in many pieces"
    assert [t for t, m in zip(ep["input_ids"][0].tolist(), mask) if m] == sampled
    assert [lp for lp, m in zip(ep["logprobs"][0].tolist(), mask) if m] == pytest.approx(sampled_lps, abs=1e-7)
    assert ep["num_turns"] == 1 and ep["rewards"].item() == 1.0


def test_a_calculator_call_cut_by_the_turn_length_still_runs(tokenizer):
    calc_turn = continuing("<calc> 3 * 4 + 5 </calc>", tokenizer)
    answer_turn = continuing(".\n#### 17", tokenizer)

    def model(body):  # each turn in as many pieces as the client asks for
        return answer_turn(body) if "<result>" in tokenizer.decode(body["input_ids"]) else calc_turn(body)
    ep, server = run_episode(tokenizer, [model], max_new_tokens_per_turn=3)
    assert len(server.requests) > 4
    assert ep["num_tool_calls"] == 1 and ep["turn_texts"][1] == ("tool", "17")
    assert ep["rewards"].item() == 1.0 and ep["finish_reason"] in ("answer", "max_tokens")


def test_a_result_the_model_invents_after_a_split_stop_string_is_cut_and_never_trained(tokenizer):
    """The server of the second piece never sees '</calc>' and lets the model write its own result
    and answer; the client cuts the turn where '</calc>' completes, and the calculator answers."""
    invented = "<calc> 3 * 4 + 5 </calc><result> 99 </result>\n#### 99"
    ids = tokenizer(invented, add_special_tokens=False)["input_ids"]
    k = next(n for n in range(1, len(ids)) if "</calc>" in tokenizer.decode(ids[:n])) - 1
    ep, _ = run_episode(tokenizer, [Reply(ids=ids[:k]), Reply(ids=ids[k:]), Reply("\n#### 17", eos=True)],
                             max_new_tokens_per_turn=k)
    sampled, added = episode_texts(tokenizer, ep)
    assert sampled == "<calc> 3 * 4 + 5 </calc>\n#### 17<|im_end|>" and added == "<result> 17 </result>"
    assert ep["rewards"].item() == 1.0


def test_eos_sampled_as_the_last_token_of_a_piece_ends_the_turn(tokenizer):
    """The server reports it as length; the turn still ends there, its EOS sampled and trained on once."""
    answer = tokenizer("#### 17", add_special_tokens=False)["input_ids"]
    ep, server = run_episode(tokenizer, [Reply(ids=answer, eos=True), Reply("<calc> 1 + 1 </calc>")],
                                  max_new_tokens_per_turn=len(answer) + 1)
    assert server.answers[0]["meta_info"]["finish_reason"]["type"] == "length"
    ids, mask = ep["input_ids"][0].tolist(), ep["loss_mask"][0].tolist()
    assert len(server.requests) == 1 and ids[-1] == tokenizer.eos_token_id and mask[-1] == 1
    assert ep["finish_reason"] == "answer" and ep["rewards"].item() == 1.0


def test_an_episode_ends_cleanly_at_max_turns(tokenizer):
    ep, _ = run_episode(tokenizer, [Reply("<calc> 1 + 1 </calc>")], max_turns=3)
    assert ep["num_turns"] == 3 and ep["finish_reason"] == "max_turns" and ep["rewards"].item() == 0.0


def test_an_episode_ends_cleanly_at_the_context_budget(tokenizer):
    budget = prompt_len(tokenizer) + 30
    ep, _ = run_episode(tokenizer, [continuing("<calc> 1 + 1 </calc>" * 10, tokenizer)], max_tokens=budget,
                             max_new_tokens_per_turn=4, max_turns=50)
    assert ep["finish_reason"] == "max_tokens" and ep["input_ids"].shape[1] <= budget
    assert ep["rewards"].item() == 0.0


def test_an_abort_raises_and_drops_its_group_which_is_counted(tokenizer):
    cfg = tc.Config(max_turns=2)
    calls = {"n": 0}

    def script(body):
        calls["n"] += 1
        return Reply("#### 17", abort_after=1) if calls["n"] == 3 else Reply("#### 17", eos=True)

    (groups, failed), _ = scripted_episode(
        tokenizer, [script], lambda client: tc.rollout_groups(client, tokenizer, InlineRewardPool(), cfg, [ITEM, ITEM],
                                                              1.0, 2))
    assert failed == 1 and len(groups) == 1 and [e["rewards"].item() for e in groups[0]] == [1.0, 1.0]
    with pytest.raises(GenerationAborted):
        run_episode(tokenizer, [Reply("<calc> 1 + 1 </calc>", abort_after=2)])


# --- warm-start demonstrations ---
def test_demonstrations_call_the_calculator_for_each_worked_step(tokenizer):
    [demo] = tc.build_demonstrations(tokenizer, tc.Config(), [ITEM])
    n = prompt_len(tokenizer)
    assert demo["input_ids"][:n] == tc.build_prompt_ids(tokenizer, ITEM["question"], tc.Config())
    assert not any(demo["loss_mask"][:n])  # the prompt is not trained on
    assert tokenizer.decode(demo["input_ids"][n:]) == (
        "Tom has <calc> 3 * 4 </calc><result> 12 </result> apples.\n<calc> 12 + 5 </calc><result> 17 </result>.\n"
        "#### 17<|im_end|>")
    sampled, added = split_by_mask(tokenizer, demo["input_ids"], demo["loss_mask"], n)
    assert sampled == "Tom has <calc> 3 * 4 </calc> apples.\n<calc> 12 + 5 </calc>.\n#### 17<|im_end|>"
    assert added == "<result> 12 </result><result> 17 </result>"


def test_a_demonstration_is_the_trajectory_the_episode_builds_for_the_same_model_output(tokenizer):
    """Played back through the real episode, the demonstration's model pieces give back its tokens
    and its loss mask: the warm start trains on exactly what RL will see."""
    [demo] = tc.build_demonstrations(tokenizer, tc.Config(), [ITEM])
    n = prompt_len(tokenizer)
    pieces, current = [], []
    for token, m in zip(demo["input_ids"][n:], demo["loss_mask"][n:]):
        if m:
            current.append(token)
        elif current:
            pieces, current = pieces + [current], []
    ep, _ = run_episode(tokenizer, [Reply(ids=p) for p in pieces + [current]])
    assert ep["input_ids"][0].tolist() == demo["input_ids"]
    assert ep["loss_mask"][0].tolist()[n:] == demo["loss_mask"][n:]
    assert ep["rewards"].item() == 1.0 and ep["num_tool_calls"] == 2


def test_the_warm_start_is_keyed_on_what_it_trains_on(monkeypatch, tmp_path):
    """The cache key holds a hash of the built demonstrations: a fork's edit that changes them (the
    tool's answers, a template, the no-tool baseline) gets a new warm start, never the cached one."""
    import lib.warm_start as ws

    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    monkeypatch.setattr(ws, "sft_warm_start", lambda base, examples, out, **kw: out)  # the key, not the SFT
    base, cfg = default_tiny_model_dir(), tc.Config(warm_start_steps=2)
    first = tc.warm_started_model(cfg, base, embedded=True)
    assert first != base and tc.warm_started_model(cfg, base, embedded=True) == first  # deterministic
    with monkeypatch.context() as m:
        m.setattr(tc, "calculate", lambda expression: "42")  # the tool's answers are in the demonstrations
        assert tc.warm_started_model(cfg, base, embedded=True) != first
    with monkeypatch.context() as m:
        m.setattr(tc, "RESULT_TEMPLATE", "<output> {} </output>")
        assert tc.warm_started_model(cfg, base, embedded=True) != first
    assert tc.warm_started_model(dataclasses.replace(cfg, use_tool=False), base, embedded=True) != first
    assert tc.warm_started_model(dataclasses.replace(cfg, warm_start_lr=1e-3), base, embedded=True) != first
    assert tc.warm_started_model(dataclasses.replace(cfg, warm_start_steps=0), base, embedded=True) == base
    # a pretrained model warm-starts only when asked to
    assert tc.warm_started_model(tc.Config(), base, embedded=False) == base


def test_no_tool_baseline_neither_offers_nor_runs_the_calculator(tokenizer):
    cfg = tc.Config(use_tool=False)
    prompt = tokenizer.decode(tc.build_prompt_ids(tokenizer, ITEM["question"], cfg))
    assert "<calc>" not in prompt and "####" in prompt
    [demo] = tc.build_demonstrations(tokenizer, cfg, [ITEM])
    n = len(tc.build_prompt_ids(tokenizer, ITEM["question"], cfg))
    assert tokenizer.decode(demo["input_ids"][n:]) == ITEM["answer"] + "<|im_end|>" and all(demo["loss_mask"][n:])
    # a calculator call the model writes anyway is text: no stop string ends the turn there, nothing runs
    ep, server = run_episode(tokenizer, [Reply("<calc> 3 * 4 + 5 </calc> so\n#### 17", eos=True)], use_tool=False)
    assert server.requests[0]["sampling_params"].get("stop") in (None, [])
    assert ep["num_tool_calls"] == 0 and ep["num_turns"] == 1 and ep["rewards"].item() == 1.0
    assert ep["answer"] == "17"


# --- end to end ---
SMALL = ["--batch_size", "2", "--group_size", "2", "--max_turns", "3", "--max_new_tokens_per_turn", "16", "--max_tokens",
         "128", "--eval_every", "0", "--test_size", "2", "--warm_start_steps", "2", "--warm_start_batch_size", "2",
         "--lr", "1e-4", "--tensorboard", "False"]


@pytest.mark.slow
def test_two_grpo_steps_then_resume_from_the_checkpoint(tmp_path):
    run_dir = str(tmp_path / "run")
    args = [sys.executable, "train_calc.py", "--run_dir", run_dir, *SMALL, "--checkpoint_every", "1"]
    first = subprocess.run(args + ["--max_steps", "2", "--test_at_start", "True", "--learnability_probe", "True",
                                   "--eval_size", "2"],
                           cwd=REPO, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    # before the first step: the learnability probe; at the end the test, paired with the test before
    assert [r["probe/questions"] for r in rows if "probe/questions" in r] == [2] and "learnability probe:" in first.stdout
    assert "paired with the test before the first step" in first.stdout
    assert "test/paired_diff" in [r for r in rows if "test/accuracy" in r][-1]
    for step in (0, 2):  # one record per test question, before and after
        with open(os.path.join(run_dir, "evals", f"test_step{step}.jsonl")) as f:
            assert len(f.readlines()) == 2
    train_rows = [r for r in rows if "rollout/reward" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    for r in train_rows:  # trainer and server agree on the policy; nothing failed
        assert r["logprob/server_trainer_abs_diff_max"] < 1e-3 and r["rollout/failed_groups"] == 0
    assert any("test/accuracy" in r for r in rows)
    assert os.path.exists(os.path.join(run_dir, "final", "model.safetensors"))
    assert os.path.exists(os.path.join(run_dir, "traces.jsonl"))

    second = subprocess.run(args + ["--max_steps", "3", "--resume", "True"], cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 2 (policy version 2" in second.stdout
    # The server's sampling does not replay the run's first steps: its seed depends on the step.
    assert f"server sampling seed {server_seed(0, 2)}" in second.stdout
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in rows if "rollout/reward" in r] == [1, 2, 3]
    # After the resume the server holds the trained weights, so the log-probs still agree.
    assert rows[-2]["logprob/server_trainer_abs_diff_max"] < 1e-3


@pytest.mark.slow
def test_async_mode_with_pause_mode_abort_runs_two_steps_within_the_staleness_bound(tmp_path):
    run_dir = str(tmp_path / "async")
    args = [sys.executable, "train_calc.py", "--run_dir", run_dir, *SMALL, "--mode", "async", "--pause_mode", "abort",
            "--checkpoint_every", "0", "--max_steps", "2"]
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "rollout/reward" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # max_staleness 1: no group is older than one version; off-policy tokens keep their log-probs
        assert r["rollout/staleness_max"] <= 1 and r["rollout/failed_groups"] == 0
        assert r["logprob/server_trainer_abs_diff_mean"] < 0.05
    assert os.path.exists(os.path.join(run_dir, "final", "model.safetensors"))


@pytest.mark.slow
def test_torchrun_two_ranks_train_on_their_share_of_rank0s_batch(tmp_path):
    run_dir = str(tmp_path / "fsdp")
    settings = dict(zip(SMALL[::2], SMALL[1::2]))
    settings.update({"--batch_size": "3", "--group_size": "3", "--ppo_minibatches": "2", "--checkpoint_every": "0",
                     "--max_steps": "2", "--weight_sync": "nccl"})  # FSDP2 and the weight broadcast over gloo
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "train_calc.py",
            "--run_dir", run_dir, *[x for kv in settings.items() for x in kv]]
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "rollout/reward" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # 9 episodes per step, 5 and 4 per rank; loss stats are rank 0's
        assert r["loss/minibatches"] == 2 and r["logprob/server_trainer_abs_diff_max"] < 1e-3
        assert r["loss/num_tokens"] < r["rollout/gen_tokens"]
    assert os.path.exists(os.path.join(run_dir, "final", "model.safetensors"))
