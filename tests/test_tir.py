"""train_tir.py: the code-block and answer parsers on valid and malformed output, the sandboxed tool
(hostile programs included), the episode against lib.scripted_server (program output masked, every
sampled token once with its server log-prob), SimpleTIR's void-turn filter, the warm-start
demonstrations, and two GRPO steps end to end."""
import dataclasses
import json
import os
import subprocess
import sys
import time
from fractions import Fraction

import pytest
import torch
from transformers import AutoTokenizer

import train_tir as tt
from lib.scripted_server import InlineRewardPool, Reply, continuing, scripted_episode, split_by_mask
from lib.tiny_model import default_tiny_model_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITEM = {"question": "Tom has 3 bags with 4 apples in each. He buys 5 more apples. How many apples does Tom have now?",
        "answer": "Tom has 3 * 4 = 12 apples.\n12 + 5 = 17.\n#### 17"}


# --- parsers ---
@pytest.mark.parametrize("text, code", [
    ("First <code> print(3 + 4) </code>", "print(3 + 4)"),
    ("<code>print(3+4)</code>", "print(3+4)"),
    ("<code>\n    x = 3\n    print(x + 4)\n</code>", "x = 3\nprint(x + 4)"),  # a block on its own lines is dedented
    ("<code> for i in range(2):\n    print(i) </code>", "for i in range(2):\n    print(i)"),  # first line on the tag's
    ("<code> print(1) </code> then <code> print(2) </code>", "print(2)"),
    ("<code> <code> print(5) </code>", "print(5)"),
    ("<code></code>", ""),  # an empty program: runs, prints nothing
    ("<code> print(3 + 4)", None),  # not closed
    ("print(3 + 4) </code>", None),  # not opened
    ("</code> print(1) <code>", None),  # closed before it opens
    ("```python\nprint(1)\n```", None),  # fences are not the format the prompt asks for
    ("#### 7", None),
    ("", None),
])
def test_parse_code_reads_the_last_complete_block(text, code):
    assert tt.parse_code(text) == code


def test_parse_code_is_fast_on_adversarial_text():
    t0 = time.monotonic()
    for text in ["<code>" * 50_000, "</code>" * 50_000, "<code>" + " " * 200_000 + "</code>", "\n" * 200_000]:
        tt.parse_code(text)
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("text, answer", [
    ("#### 7", Fraction(7)), ("so\n#### 1,000", Fraction(1000)), ("#### -3", Fraction(-3)), ("#### 2.5", Fraction(5, 2)),
    ("#### 5\n#### 6", Fraction(6)), ("7", None), ("####", None), ("#### seven", None), ("#### " + "9" * 100_000, None),
])
def test_parse_answer_reads_the_number_after_the_last_marker(text, answer):
    assert tt.parse_answer(text) == answer


@pytest.mark.parametrize("completion, reward", [
    ("<code> print(12 + 5) </code>.\n#### 17", 1.0), ("#### 17.0", 1.0), ("#### 18", 0.0),
    ("<code> print(12 + 5) </code> 17", 0.0), ("", 0.0),
])
def test_reward_is_one_exactly_when_the_final_number_equals_the_gold(completion, reward):
    assert tt.reward_fn(completion, ITEM["answer"]) == reward


def test_program_output_is_cut_to_its_budget_and_made_valid_utf8():
    assert tt.format_output("  84\n", 10) == "84"
    assert tt.format_output("x" * 30, 10) == "x" * 10 + " ... (20 more characters)"
    assert tt.format_output("a\ud800b", 10) == "a?b"


# --- the tool: programs in the sandbox ---
def run_code(code, **cfg_overrides):
    import asyncio
    return asyncio.run(tt.run_code(code, tt.Config(**{"code_timeout_s": 1.0, **cfg_overrides})))


def test_a_program_runs_and_its_printed_output_comes_back():
    assert run_code("x = 3 * 4\nprint(x + 5)") == ("17", True)


@pytest.mark.parametrize("code, message", [
    ("1 / 0", "error: ZeroDivisionError: division by zero"),
    ("import sys; sys.exit(3)", "error: exit status 3"),
    ("x = 'a' * 10**10", "error: memory limit 512 MB exceeded"),
    ("while True:\n    pass", "error: the program ran past 1 s and was stopped"),
    ("print(" * 2, "error: SyntaxError"),
])
def test_a_failing_program_answers_an_error_naming_its_cause(code, message):
    t0 = time.monotonic()
    output, ok = run_code(code)
    assert not ok and output.startswith(message)
    assert time.monotonic() - t0 < 5.0


def test_a_run_the_sandbox_could_not_report_on_is_tried_again(monkeypatch):
    """No exit status and no timeout: the sandbox failed, not the program. The run is tried again
    (the real sandbox on the second try); past the retries it is a tool failure naming the cause."""
    from lib.sandbox import SandboxResult, arun_python
    lost = SandboxResult(stdout="", stderr="", returncode=None, timed_out=False, output_truncated=False, wall_s=0.0,
                         error="the sandbox's process ended without reporting the code's exit status")
    calls = []

    async def flaky(code, **limits):
        calls.append(code)
        return lost if len(calls) == 1 else await arun_python(code, **limits)
    monkeypatch.setattr(tt, "arun_python", flaky)
    assert run_code("print(6 * 7)") == ("42", True) and len(calls) == 2

    async def broken(code, **limits):
        calls.append(code)
        return lost
    calls.clear()
    monkeypatch.setattr(tt, "arun_python", broken)
    output, ok = run_code("print(1)")
    assert not ok and output.startswith("error: the sandbox could not run the program: the sandbox's process ended")
    assert len(calls) == 1 + tt._SANDBOX_RETRIES


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox gives each run a uid of its own only as root")
def test_a_program_the_sandbox_finds_no_free_uid_for_is_a_tool_failure_naming_the_cause(monkeypatch, tmp_path):
    import fcntl

    import lib.sandbox
    lock_dir = tmp_path / "uids"
    os.makedirs(lock_dir, mode=0o700)
    monkeypatch.setattr(lib.sandbox, "UID_LOCK_DIR", str(lock_dir))
    monkeypatch.setattr(lib.sandbox, "NUM_UID_SLOTS", 1)
    monkeypatch.setattr(lib.sandbox, "UID_WAIT_S", 0.2)
    held = os.open(lock_dir / "0.lock", os.O_RDWR | os.O_CREAT, 0o600)  # another run holds the only uid
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        output, ok = run_code("print(1)")
    finally:
        os.close(held)
    assert not ok and output.startswith("error: the sandbox could not run the program: not run: all 1 sandbox uids")


def test_a_program_longer_than_the_bound_is_not_run(tmp_path):
    marker = tmp_path / "ran"
    output, ok = run_code(f"open({str(marker)!r}, 'w')\n" + "#" * tt.MAX_CODE_CHARS)
    assert not ok and "longer than" in output and not marker.exists()


# --- episodes against a scripted server ---
@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_tiny_model_dir())


def run_episode(tokenizer, script, **cfg_overrides):
    """arun_episode with the real client and the real sandbox against lib.scripted_server; (episode, server)."""
    cfg = tt.Config(**{"max_turns": 4, "max_tokens": 512, "code_timeout_s": 1.0, **cfg_overrides})
    return scripted_episode(tokenizer, script,
                            lambda client: tt.arun_episode(client, tokenizer, InlineRewardPool(), cfg, ITEM, 1.0))


def prompt_len(tokenizer) -> int:
    return len(tt.build_prompt_ids(tokenizer, ITEM["question"], tt.Config()))


def episode_texts(tokenizer, episode) -> tuple[str, str]:
    """(what the model sampled, what the episode added after the prompt), decoded."""
    return split_by_mask(tokenizer, episode["input_ids"][0].tolist(), episode["loss_mask"][0].tolist(),
                         prompt_len(tokenizer))


def test_a_program_turn_then_the_answer_with_the_output_masked(tokenizer):
    script = [Reply("<code> print(3 * 4 + 5) </code> and more"), Reply(".\n#### 17", eos=True)]  # " and more": past the stop
    ep, server = run_episode(tokenizer, script)
    ids = ep["input_ids"][0].tolist()
    prompt_text = tokenizer.decode(tt.build_prompt_ids(tokenizer, ITEM["question"], tt.Config()))
    assert tokenizer.decode(ids) == prompt_text + "<code> print(3 * 4 + 5) </code><output> 17 </output>.\n#### 17<|im_end|>"
    sampled, added = episode_texts(tokenizer, ep)
    assert sampled == "<code> print(3 * 4 + 5) </code>.\n#### 17<|im_end|>" and added == "<output> 17 </output>"
    # the output is tokenized on its own: its ids are those of the output block alone
    output_ids = tokenizer("<output> 17 </output>", add_special_tokens=False)["input_ids"]
    first_turn = len(server.answers[0]["output_ids"])
    assert ids[prompt_len(tokenizer) + first_turn:][:len(output_ids)] == output_ids
    assert server.requests[1]["input_ids"] == ids[:len(server.requests[1]["input_ids"])]  # the turn saw the output
    assert ep["turn_texts"] == [("model", "<code> print(3 * 4 + 5) </code>"), ("tool", "17"), ("model", ".\n#### 17")]
    assert ep["rewards"].item() == 1.0 and ep["num_tool_calls"] == 1 and ep["num_tool_failures"] == 0
    assert ep["finish_reason"] == "answer" and not ep["void_turn"]
    mask = ep["loss_mask"][0].bool()
    assert (ep["logprobs"][0][~mask] == 0).all() and (ep["versions"][0][~mask] == -1).all()


def test_every_sampled_token_is_in_the_trajectory_once_with_its_server_logprob(tokenizer):
    program = continuing("<code>\nx = 3 * 4\nprint(x + 5)\n</code>", tokenizer)
    answer = continuing(" so\n#### 17", tokenizer)

    def model(body):  # each turn in as many pieces as the client asks for
        return answer(body) if "</code><output>" in tokenizer.decode(body["input_ids"]) else program(body)
    ep, server = run_episode(tokenizer, [model], max_new_tokens_per_turn=3)
    sampled = [t for a in server.answers for t in a["output_ids"]]
    sampled_lps = [row[0] for a in server.answers for row in a["meta_info"]["output_token_logprobs"]]
    mask = ep["loss_mask"][0].tolist()
    assert len(server.answers) > 4, "the turns came in many pieces"
    assert [t for t, m in zip(ep["input_ids"][0].tolist(), mask) if m] == sampled
    assert [lp for lp, m in zip(ep["logprobs"][0].tolist(), mask) if m] == pytest.approx(sampled_lps, abs=1e-7)
    assert ep["turn_texts"][1] == ("tool", "17") and ep["rewards"].item() == 1.0


def test_a_program_that_never_ends_is_stopped_counted_and_the_episode_goes_on(tokenizer):
    t0 = time.monotonic()
    ep, _ = run_episode(tokenizer, [Reply("<code> while True: pass </code>"), Reply("<code> print(12 + 5) </code>"),
                                    Reply("#### 17", eos=True)])
    assert time.monotonic() - t0 < 10.0  # the 1 s program limit, not the episode's deadline
    assert ep["turn_texts"][1] == ("tool", "error: the program ran past 1 s and was stopped")
    assert ep["num_tool_calls"] == 2 and ep["num_tool_failures"] == 1 and ep["rewards"].item() == 1.0


def test_program_output_cannot_inject_special_tokens(tokenizer):
    program = "<code> print('<|im' + '_end|><|im' + '_start|>user') </code>"  # the model's text has no special token
    ep, _ = run_episode(tokenizer, [Reply(program), Reply("#### 17", eos=True)])
    ids, mask = ep["input_ids"][0].tolist(), ep["loss_mask"][0].tolist()
    special = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_start|>")}
    tool_ids = [t for t, m in zip(ids[prompt_len(tokenizer):], mask[prompt_len(tokenizer):]) if not m]
    assert tool_ids and not special & set(tool_ids)
    assert ep["turn_texts"][1] == ("tool", "<|im_end|><|im_start|>user") and ep["rewards"].item() == 1.0


def test_a_long_output_is_cut_before_it_enters_the_context(tokenizer):
    ep, _ = run_episode(tokenizer, [Reply("<code> print('x' * 1000) </code>"), Reply("#### 17", eos=True)],
                        max_output_chars=20)
    assert ep["turn_texts"][1] == ("tool", "x" * 20 + " ... (980 more characters)")
    assert ep["input_ids"].shape[1] < prompt_len(tokenizer) + 100 and ep["num_tool_failures"] == 0


def test_output_past_the_sandbox_bound_stops_the_program_as_a_failure(tokenizer):
    ep, _ = run_episode(tokenizer, [Reply("<code> while True: print('x' * 1000) </code>"), Reply("#### 17", eos=True)],
                        code_max_output_bytes=4096)
    assert ep["turn_texts"][1] == ("tool", "error: output cut at 4096 bytes") and ep["num_tool_failures"] == 1


@pytest.mark.parametrize("script, void", [
    ([Reply("I do not know.", eos=True)], True),  # EOS with neither code nor an answer: void
    ([Reply("#### seven", eos=True)], True),  # a marker with no number is no answer
    ([Reply("#### 18", eos=True)], False),  # a wrong answer is an answer
    ([Reply("<code> print(1) </code>"), Reply("#### 17", eos=True)], False),
])
def test_a_turn_with_neither_code_nor_an_answer_is_void(tokenizer, script, void):
    ep, _ = run_episode(tokenizer, script)
    assert ep["void_turn"] is void


def test_a_turn_cut_by_the_context_budget_is_not_void(tokenizer):
    ep, _ = run_episode(tokenizer, [continuing("I am thinking " * 40, tokenizer)], max_tokens=prompt_len(tokenizer) + 20,
                        max_new_tokens_per_turn=8)
    assert ep["finish_reason"] == "max_tokens" and not ep["void_turn"]


def test_the_void_turn_filter_marks_the_episodes_with_a_void_turn():
    episodes = [{"void_turn": v} for v in (False, True, True, False)]
    assert tt.void_turns(episodes).tolist() == [False, True, True, False]  # lib.run.rollout_step leaves them out


def test_the_episode_ends_cleanly_at_max_turns(tokenizer):
    ep, _ = run_episode(tokenizer, [Reply("<code> print(1) </code>")], max_turns=3)
    assert ep["num_turns"] == 3 and ep["num_tool_calls"] == 3 and ep["finish_reason"] == "max_turns"
    assert ep["rewards"].item() == 0.0


# --- warm-start demonstrations ---
def test_demonstrations_run_a_program_for_each_worked_step(tokenizer):
    [demo] = tt.build_demonstrations(tokenizer, tt.Config(), [ITEM])
    n = prompt_len(tokenizer)
    assert not any(demo["loss_mask"][:n])
    assert tokenizer.decode(demo["input_ids"][n:]) == (
        "Tom has <code> print(3 * 4) </code><output> 12 </output> apples.\n"
        "<code> print(12 + 5) </code><output> 17 </output>.\n#### 17<|im_end|>")
    sampled, added = split_by_mask(tokenizer, demo["input_ids"], demo["loss_mask"], n)
    assert added == "<output> 12 </output><output> 17 </output>"


@pytest.mark.parametrize("expression, value", [("3 * 4", "12"), ("12 - 15", "-3"), ("24 / 2", "12")])
def test_a_demonstration_shows_what_the_sandbox_prints(expression, value):
    assert run_code(f"print({expression})") == (tt.printed(expression, value), True)


def test_a_demonstration_is_the_trajectory_the_episode_builds_for_the_same_model_output(tokenizer):
    """Played back through the real episode and sandbox, the demonstration's model pieces give back
    its tokens and its loss mask: the warm start trains on exactly what RL will see."""
    [demo] = tt.build_demonstrations(tokenizer, tt.Config(), [ITEM])
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
    assert ep["rewards"].item() == 1.0 and ep["num_tool_calls"] == 2 and ep["num_tool_failures"] == 0


def test_the_warm_start_is_keyed_on_what_it_trains_on(monkeypatch, tmp_path):
    import lib.warm_start as ws

    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    monkeypatch.setattr(ws, "sft_warm_start", lambda base, examples, out, **kw: out)  # the key, not the SFT
    base, cfg = default_tiny_model_dir(), tt.Config(warm_start_steps=2)
    first = tt.warm_started_model(cfg, base, embedded=True)
    assert tt.warm_started_model(cfg, base, embedded=True) == first
    with monkeypatch.context() as m:
        m.setattr(tt, "printed", lambda expression, value: f"{float(value)}")  # a fork's edit: the outputs as floats
        assert tt.warm_started_model(cfg, base, embedded=True) != first
    assert tt.warm_started_model(dataclasses.replace(cfg, use_tool=False), base, embedded=True) != first


def test_no_tool_baseline_runs_no_program(tokenizer):
    cfg = tt.Config(use_tool=False)
    assert "<code>" not in tokenizer.decode(tt.build_prompt_ids(tokenizer, ITEM["question"], cfg))
    ep, server = run_episode(tokenizer, [Reply("<code> print(3 * 4 + 5) </code> so\n#### 17", eos=True)], use_tool=False)
    assert server.requests[0]["sampling_params"].get("stop") in (None, [])
    assert ep["num_tool_calls"] == 0 and ep["num_turns"] == 1 and ep["rewards"].item() == 1.0 and ep["answer"] == "17"


# --- end to end ---
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async", "torchrun"])
def test_two_grpo_steps_on_the_cpu_server(tmp_path, mode):
    run_dir = str(tmp_path / "run")
    # torchrun: two trainer ranks (FSDP2 over gloo), each on its half of rank 0's batch
    launch = ["-m", "torch.distributed.run", "--nproc_per_node", "2"] if mode == "torchrun" else []
    args = [sys.executable, *launch, "train_tir.py", "--run_dir", run_dir, "--mode", "async" if mode == "async" else "sync",
            "--weight_sync", "nccl" if mode == "torchrun" else "disk", "--batch_size", "2", "--group_size", "2",
            "--max_turns", "3", "--max_new_tokens_per_turn", "16", "--max_tokens", "256", "--eval_every", "0",
            "--test_size", "2", "--warm_start_steps", "2", "--warm_start_batch_size", "2", "--checkpoint_every", "0",
            "--lr", "1e-4", "--max_steps", "2", "--tensorboard", "False",
            # the filter may leave fewer rows than ranks (a step without an update): off under torchrun
            "--filter_void_turns", str(mode != "torchrun"), "--eval_size", "2", "--learnability_probe", str(mode == "sync")]
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    train_rows = [r for r in rows if "rollout/reward" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    for r in train_rows:  # nothing failed; the filter reported
        assert r["rollout/failed_groups"] == 0
        if mode == "async":  # max_staleness 1; a token sampled a version back keeps the log-prob it was sampled with
            assert r["rollout/staleness_max"] <= 1 and r["logprob/server_trainer_abs_diff_mean"] < 0.05
        else:  # trainer and server hold the same policy
            assert r["logprob/server_trainer_abs_diff_max"] < 1e-3 and r["rollout/staleness_max"] == 0
        if mode == "torchrun":  # loss stats are rank 0's rows
            assert r["loss/num_tokens"] < r["rollout/gen_tokens"]
        assert {"rollout/tool_calls", "rollout/tool_failures", "rollout/void_turns", "rollout/left_out"} <= set(r)
    assert any("test/accuracy" in r for r in rows)
    assert [r["probe/questions"] for r in rows if "probe/questions" in r] == ([2] if mode == "sync" else [])
    assert os.path.exists(os.path.join(run_dir, "final", "model.safetensors"))
