"""train_search.py's episode against real servers, the tool-failure path, and the whole script
(2 steps, then a resume) end to end on the embedded default."""
import asyncio
import json
import os
import subprocess
import sys

import aiohttp
import pytest
from transformers import AutoTokenizer

import train_search as ts
from lib.client import Generation, InferenceClient
from lib.launch import launch_cpu_server
from lib.tiny_model import default_tiny_model_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITEM = {"question": "Who founded the Ostrel Guild?", "answer": ["Pem Varo"]}


@pytest.fixture(scope="module")
def model_dir():
    return default_tiny_model_dir()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = launch_cpu_server(model_dir, num_threads=1)
    yield srv
    srv.terminate()


class RecordingClient(InferenceClient):
    """The real client, keeping every generation the server returned."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.record = []

    async def generate(self, input_ids, **kw):
        gen = await super().generate(input_ids, **kw)
        self.record.append((list(input_ids), gen))
        return gen


class ScriptedClient:
    """Stands in for the server where a test needs the model to call a tool: returns the token ids
    of scripted turns (a random tiny model never writes <search>)."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.calls = tokenizer, list(turns), 0

    async def generate(self, input_ids, *, max_new_tokens, **kw):
        text = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][:max_new_tokens]
        finish = "stop" if len(ids) < max_new_tokens else "length"
        return Generation(output_ids=ids, logprobs=[-0.5] * len(ids), finish_reason=finish, matched=None, text=text,
                          prompt_tokens=len(input_ids), cached_tokens=0, weight_version="0", versions=[0] * len(ids))

    def end_trajectory(self, trajectory_id):
        pass


def run_episode(client, tokenizer, cfg, retrieval_addr="http://127.0.0.1:9", temperature=1.0):
    async def go():
        async with aiohttp.ClientSession() as session:
            return await ts.arun_episode(client, session, tokenizer, cfg, ITEM, retrieval_addr, temperature)

    return asyncio.run(go())


def test_every_sampled_token_is_in_the_trajectory_once_with_its_server_logprob(server, tokenizer):
    cfg = ts.Config(max_turns=3, max_new_tokens_per_turn=12, max_tokens=1024)
    client = RecordingClient([server.address])
    ep = run_episode(client, tokenizer, cfg)
    ids, mask, lps = ep["input_ids"][0].tolist(), ep["loss_mask"][0].tolist(), ep["logprobs"][0].tolist()
    prompt = ts.build_prompt_ids(tokenizer, ITEM["question"], cfg.apply_chat_template)
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
    pos = len(prompt)
    assert client.record, "the episode generated nothing"
    for sent, gen in client.record:
        assert sent == ids[:pos], "each turn is sent the trajectory so far, token for token"
        assert ids[pos: pos + len(gen.output_ids)] == gen.output_ids
        assert mask[pos: pos + len(gen.output_ids)] == [1] * len(gen.output_ids)
        assert lps[pos: pos + len(gen.output_ids)] == pytest.approx(gen.logprobs, abs=0)
        pos += len(gen.output_ids)
    assert pos == len(ids) and sum(mask) == sum(len(g.output_ids) for _, g in client.record)


def test_tool_output_is_masked_and_decoding_reproduces_the_conversation(tokenizer):
    turns = ["<think> look it up </think><search> Ostrel Guild </search>", "<answer> Pem Varo </answer>"]
    cfg = ts.Config(max_turns=4, tool_retries=1, tool_timeout_s=2)
    ep = run_episode(ScriptedClient(tokenizer, turns), tokenizer, cfg)
    ids, mask = ep["input_ids"][0].tolist(), ep["loss_mask"][0].tolist()
    prompt_text = tokenizer.decode(ts.build_prompt_ids(tokenizer, ITEM["question"], True))
    info = ep["turn_texts"][1][1]
    expected = prompt_text + turns[0] + f"\n\n<information>{info}</information>\n\n" + turns[1]
    assert tokenizer.decode(ids) == expected
    model_part = [t for t, m in zip(ids, mask) if m]
    assert tokenizer.decode(model_part) == turns[0] + turns[1]
    assert ep["rewards"].item() == 1.0 and ep["finish_reason"] == "answer" and ep["num_turns"] == 2


def test_tool_that_stays_down_puts_a_failure_message_in_context_and_is_counted(tokenizer):
    turns = ["<search> Ostrel Guild </search>", "<answer> no idea </answer>"]
    cfg = ts.Config(max_turns=4, tool_retries=2, tool_timeout_s=1)
    ep = run_episode(ScriptedClient(tokenizer, turns), tokenizer, cfg, retrieval_addr="http://127.0.0.1:9")
    assert ep["num_tool_calls"] == 1 and ep["num_tool_failures"] == 1
    assert "The search tool failed" in ep["turn_texts"][1][1] and "2 attempts" in ep["turn_texts"][1][1]
    assert ep["finish_reason"] == "answer" and ep["rewards"].item() == 0.0


def test_episode_ends_cleanly_at_max_turns(tokenizer):
    cfg = ts.Config(max_turns=3, tool_retries=1, tool_timeout_s=1)
    ep = run_episode(ScriptedClient(tokenizer, ["<search> again </search>"]), tokenizer, cfg)
    assert ep["num_turns"] == 3 and ep["finish_reason"] == "max_turns" and ep["rewards"].item() == 0.0


def test_episode_ends_cleanly_at_the_context_budget(server, tokenizer):
    prompt_len = len(ts.build_prompt_ids(tokenizer, ITEM["question"], True))
    cfg = ts.Config(max_turns=50, max_new_tokens_per_turn=16, max_tokens=prompt_len + 40)
    ep = run_episode(InferenceClient([server.address]), tokenizer, cfg)
    assert ep["input_ids"].shape[1] <= cfg.max_tokens
    assert ep["finish_reason"] in ("max_tokens", "no_action", "answer")
    assert ep["num_turns"] < 50


def test_malformed_model_output_never_crashes_an_episode(tokenizer):
    garbage = ["<search></search><answer>", "</answer><access>\x00\udcff</access>", "<<search>>", "\ufffd" * 50]
    cfg = ts.Config(max_turns=4, tool_retries=1, tool_timeout_s=1)
    ep = run_episode(ScriptedClient(tokenizer, garbage), tokenizer, cfg)
    assert ep["rewards"].item() == 0.0 and ep["num_turns"] >= 1


def test_warm_start_demonstrations_search_each_hop_or_answer_directly(tokenizer):
    from lib.wiki_data import default_wiki_dir

    data_dir = default_wiki_dir(seed=0)
    items = ts.read_jsonl(os.path.join(data_dir, "warmstart.jsonl"))[:40]
    cfg = ts.Config(prompt="short", topk=2)
    demos = ts.build_demonstrations(tokenizer, cfg, items, os.path.join(data_dir, "corpus.jsonl"), direct_frac=0.5)
    texts = [tokenizer.decode(d["input_ids"]) for d in demos]
    direct = [t for t in texts if "<search>" not in t]
    assert 10 <= len(direct) <= 30  # about half
    for item, text in zip(items, texts):
        gold = item["answer"][0]
        if "<search>" in text:  # one search per hop, then the answer read from the results
            assert text.count("<search>") == len(item["hop_queries"]) and f"The answer is {gold}." in text
        else:
            assert f"<think> From memory: {gold}. </think>\n<answer> {gold} </answer>" in text
    plain = ts.build_demonstrations(tokenizer, cfg, items, os.path.join(data_dir, "corpus.jsonl"))
    assert all("<search>" in tokenizer.decode(d["input_ids"]) for d in plain)  # the default: every one searches


@pytest.mark.slow
def test_two_steps_then_resume_from_checkpoint(tmp_path):
    run_dir = str(tmp_path / "run")
    args = [sys.executable, "train_search.py", "--run_dir", run_dir, "--batch_size", "2", "--group_size", "2",
            "--max_turns", "2", "--max_new_tokens_per_turn", "16", "--eval_every", "0", "--test_size", "2",
            "--warm_start_steps", "2", "--warm_start_batch_size", "2", "--warm_start_direct_steps", "2",
            "--checkpoint_every", "1", "--lr", "1e-4"]
    first = subprocess.run(args + ["--max_steps", "2"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    train_rows = [r for r in rows if "rollout/reward" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    assert all(r["logprob/server_trainer_abs_diff_max"] < 1e-3 for r in train_rows)
    assert os.path.exists(os.path.join(run_dir, "final", "model.safetensors"))

    second = subprocess.run(args + ["--max_steps", "3", "--resume", "True"], cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 2 (policy version 2)" in second.stdout
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in rows if "rollout/reward" in r] == [1, 2, 3]
    # After the resume the server holds the trained weights, so the log-probs still agree.
    assert rows[-2]["logprob/server_trainer_abs_diff_max"] < 1e-3


COMMON = ["--batch_size", "2", "--group_size", "2", "--max_turns", "2", "--max_new_tokens_per_turn", "16",
          "--eval_every", "0", "--test_size", "2", "--warm_start_steps", "2", "--warm_start_batch_size", "2",
          "--warm_start_direct_steps", "2", "--checkpoint_every", "1", "--lr", "1e-4", "--max_steps", "2", "--tensorboard", "False"]


def train_rows(run_dir):
    return [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "rollout/reward" in r]


@pytest.mark.slow
def test_async_mode_with_tool_latency_and_broadcast_sync_runs_two_steps(tmp_path):
    run_dir = str(tmp_path / "async")
    args = [sys.executable, "train_search.py", "--run_dir", run_dir, "--mode", "async", "--tool_latency_s", "0.05",
            "--weight_sync", "nccl", *COMMON]  # "nccl" is a gloo group on CPUs
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)  # max_staleness 1
    assert all(r["logprob/server_trainer_abs_diff_mean"] < 0.05 for r in rows)
    assert os.path.exists(os.path.join(run_dir, "final", "model.safetensors"))


@pytest.mark.slow
def test_torchrun_two_ranks_train_on_their_share_of_rank0s_batch(tmp_path):
    run_dir = str(tmp_path / "fsdp")
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "train_search.py",
            "--run_dir", run_dir, "--weight_sync", "nccl", *COMMON]  # FSDP2 over gloo on CPUs
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # 4 episodes per step, 2 per rank; loss stats are rank 0's
        assert r["logprob/server_trainer_abs_diff_max"] < 1e-3
        assert r["loss/num_tokens"] < r["rollout/gen_tokens"]
    assert os.path.exists(os.path.join(run_dir, "final", "model.safetensors"))


@pytest.mark.slow
def test_time_budget_stops_after_a_step_with_a_checkpoint_and_minibatches_split_the_update(tmp_path):
    run_dir = str(tmp_path / "budget")
    args = [sys.executable, "train_search.py", "--run_dir", run_dir, *COMMON, "--max_steps", "50",
            "--checkpoint_every", "10", "--time_budget_s", "0.01", "--ppo_minibatches", "2"]
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1]  # the budget ran out during step 1
    assert "test after 1 steps" in out.stdout
    assert os.path.exists(os.path.join(run_dir, "checkpoints", "latest"))  # saved at the stop, not at step 10
    # 4 episodes in 2 mini-batches: each optimizer step saw about half of the generated tokens.
    assert rows[0]["loss/num_tokens"] < rows[0]["rollout/gen_tokens"]
