"""train_search.py's episode against real servers and against lib.scripted_server (SGLang's answer
shapes, hostile ones included, for scripted model output), the tool paths, and the whole script
(2 steps, then a resume; async; torchrun) end to end on the embedded default."""
import asyncio
import dataclasses
import json
import os
import subprocess
import sys

import aiohttp
import pytest
from transformers import AutoTokenizer

import train_search as ts
from lib.client import GenerationAborted, InferenceClient
from lib.launch import launch_cpu_server
from lib.ranks import server_seed
from lib.retrieval import launch_retrieval_server
from lib.scripted_server import Reply, ScriptedServer, continuing
from lib.tiny_model import default_tiny_model_dir
from lib.wiki_data import read_qa

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


@pytest.fixture(scope="module")
def retrieval(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    docs = [{"id": "0", "contents": '"Ostrel Guild"\nThe Ostrel Guild was founded by Pem Varo in Tarqua.'},
            {"id": "1", "contents": '"Tarqua"\nTarqua is a harbour town.'}]
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    srv = launch_retrieval_server(str(corpus))
    yield srv.address
    srv.terminate()


def scripted_episode(tokenizer, script, cfg, retrieval_addr="http://127.0.0.1:9"):
    """arun_episode with the real client against a scripted SGLang stand-in; (episode, server)."""
    async def go(address):
        client = InferenceClient([address], max_retries=0)
        try:
            async with aiohttp.ClientSession() as session:
                return await ts.arun_episode(client, session, tokenizer, cfg, ITEM, retrieval_addr, 1.0)
        finally:
            await client.close()
    with ScriptedServer(tokenizer, script) as server:
        ep = asyncio.run(go(server.address))
    return ep, server


def model_text(tokenizer, ep):
    ids, mask = ep["input_ids"][0].tolist(), ep["loss_mask"][0].tolist()
    return tokenizer.decode([t for t, m in zip(ids, mask) if m])


def test_tool_output_is_masked_and_decoding_reproduces_the_conversation(tokenizer, retrieval):
    turns = ["<think> look it up </think><search> Ostrel Guild </search>", "<answer> Pem Varo </answer>"]
    cfg = ts.Config(max_turns=4, tool_retries=1, tool_timeout_s=5)
    ep, _ = scripted_episode(tokenizer, [Reply(turns[0] + " and more"), Reply(turns[1])], cfg, retrieval)
    ids = ep["input_ids"][0].tolist()
    prompt_text = tokenizer.decode(ts.build_prompt_ids(tokenizer, ITEM["question"], True))
    info = ep["turn_texts"][1][1]
    assert "Pem Varo" in info and ep["num_tool_failures"] == 0
    expected = prompt_text + turns[0] + f"\n\n<information>{info}</information>\n\n" + turns[1]
    assert tokenizer.decode(ids) == expected
    assert model_text(tokenizer, ep) == turns[0] + turns[1]
    assert ep["rewards"].item() == 1.0 and ep["finish_reason"] == "answer" and ep["num_turns"] == 2


def test_a_tool_call_ended_by_another_stop_id_is_closed_by_the_templates_untrained_end_of_turn(tokenizer, retrieval):
    # a tag in other case is not the stop string but still a call; the turn then ended at
    # <|endoftext|> (Qwen2.5 stops on it too) and continues as a turn closed by <|im_end|> would
    endoftext, im_end = tokenizer.convert_tokens_to_ids("<|endoftext|>"), tokenizer.eos_token_id
    call = tokenizer("<search> Ostrel Guild </SEARCH>", add_special_tokens=False)["input_ids"]
    cfg = ts.Config(max_turns=4, tool_retries=1, tool_timeout_s=5, stop_token_ids=[im_end, endoftext])
    ep, server = scripted_episode(tokenizer, [Reply(ids=call + [endoftext]), Reply("<answer> Pem Varo </answer>")],
                                  cfg, retrieval)
    ids, mask = ep["input_ids"][0].tolist(), ep["loss_mask"][0].tolist()
    end = len(server.requests[0]["input_ids"]) + len(call) + 1
    assert ep["num_tool_calls"] == 1 and ids[end - 1:end + 1] == [endoftext, im_end] and mask[end - 1:end + 1] == [1, 0]
    assert server.requests[1]["input_ids"] == ids[:len(server.requests[1]["input_ids"])]
    assert model_text(tokenizer, ep) == "<search> Ostrel Guild </SEARCH><|endoftext|><answer> Pem Varo </answer>"


def test_an_answer_read_from_a_result_has_evidence_and_a_guess_has_none(tokenizer, retrieval):
    cfg = ts.Config(max_turns=4, tool_retries=1, tool_timeout_s=5)
    turns = ["<search> Ostrel Guild </search>", "<answer> Pem Varo </answer>"]
    ep, _ = scripted_episode(tokenizer, [Reply(turns[0]), Reply(turns[1])], cfg, retrieval)
    assert ep["answer_in_evidence"] and ep["rewards"].item() == 1.0
    ep, _ = scripted_episode(tokenizer, [Reply("<answer> Pem Varo </answer>")], cfg, retrieval)
    assert not ep["answer_in_evidence"] and ep["rewards"].item() == 1.0  # right, but not read anywhere
    ep, _ = scripted_episode(tokenizer, [Reply(turns[0]), Reply("<answer> Pem </answer>")], cfg, retrieval)
    assert ep["answer_in_evidence"]  # whole words of a result
    ep, _ = scripted_episode(tokenizer, [Reply(turns[0]), Reply("<answer> Pe </answer>")], cfg, retrieval)
    assert not ep["answer_in_evidence"]  # part of a word is not evidence


def test_no_tool_baseline_answers_from_memory_and_never_searches(tokenizer, retrieval):
    cfg = ts.Config(max_turns=4, use_tool=False)
    prompt = tokenizer.decode(ts.build_prompt_ids(tokenizer, ITEM["question"], True, ts.prompt_template(cfg)))
    assert "<search>" not in prompt and "<answer>" in prompt
    script = [Reply("<think> x </think><search> Ostrel Guild </search> then <answer> Pem Varo </answer>")]
    ep, server = scripted_episode(tokenizer, script, cfg, retrieval)
    assert server.requests[0]["sampling_params"]["stop"] == ["</answer>"]
    assert ep["num_tool_calls"] == 0 and ep["num_turns"] == 1 and ep["answer"] == "Pem Varo"


def test_a_pretrained_model_is_warm_started_on_its_own_turns_only(tokenizer):
    from lib.wiki_data import default_wiki_dir

    data_dir = default_wiki_dir(seed=0)
    cfg = ts.Config(warm_start_worlds=0)
    [demo] = ts.build_demonstrations(tokenizer, cfg, read_qa(os.path.join(data_dir, "warmstart.jsonl"))[:1],
                                     os.path.join(data_dir, "corpus.jsonl"), loss_on_tool_tokens=False)
    trained = tokenizer.decode([t for t, m in zip(demo["input_ids"], demo["loss_mask"]) if m])
    assert "<information>" not in trained and "Question:" not in trained and "<search>" in trained
    assert trained.endswith("</answer><|im_end|>")
    [demo] = ts.build_demonstrations(tokenizer, dataclasses.replace(cfg, use_tool=False),
                                     read_qa(os.path.join(data_dir, "warmstart.jsonl"))[:1],
                                     os.path.join(data_dir, "corpus.jsonl"), direct_frac=1.0)
    assert "<search>" not in tokenizer.decode(demo["input_ids"])


def test_every_sampled_token_of_a_turn_cut_into_pieces_is_in_the_trajectory_once_with_its_logprob(tokenizer):
    cfg = ts.Config(max_turns=2, max_new_tokens_per_turn=3)
    turn = "<think> the founder of the guild is known </think><answer> Pem Varo </answer>"
    ep, server = scripted_episode(tokenizer, [continuing(turn, tokenizer)], cfg)
    sampled = [t for a in server.answers for t in a["output_ids"]]
    sampled_lps = [row[0] for a in server.answers for row in a["meta_info"]["output_token_logprobs"]]
    mask = ep["loss_mask"][0].tolist()
    assert len(server.answers) > 5, "the turn came in many pieces"
    assert [t for t, m in zip(ep["input_ids"][0].tolist(), mask) if m] == sampled
    assert [lp for lp, m in zip(ep["logprobs"][0].tolist(), mask) if m] == pytest.approx(sampled_lps, abs=1e-7)
    assert ep["num_turns"] == 1 and ep["finish_reason"] == "answer" and ep["rewards"].item() == 1.0


def test_an_answer_cut_by_the_turn_length_is_parsed_from_the_whole_turn(tokenizer):
    """'<answer> Pem' then ' Varo </answer>': parsed piece by piece this was no_action, reward 0."""
    cfg = ts.Config(max_turns=4, max_new_tokens_per_turn=4)
    ep, server = scripted_episode(tokenizer, [continuing("<answer> Pem Varo </answer>", tokenizer)], cfg)
    assert len(server.requests) >= 2
    assert ep["finish_reason"] == "answer" and ep["answer"] == "Pem Varo" and ep["rewards"].item() == 1.0
    assert ep["num_turns"] == 1


def test_a_search_cut_by_the_turn_length_still_calls_the_tool(tokenizer, retrieval):
    cfg = ts.Config(max_turns=3, max_new_tokens_per_turn=3, tool_retries=1, tool_timeout_s=5)
    search_turn = continuing("<search> Ostrel Guild </search>", tokenizer)
    answer_turn = continuing("<answer> Pem Varo </answer>", tokenizer)

    def model(body):  # each turn in as many pieces as the client asks for
        tool_answered = "<information>Doc" in tokenizer.decode(body["input_ids"])
        return answer_turn(body) if tool_answered else search_turn(body)
    ep, server = scripted_episode(tokenizer, [model], cfg, retrieval)
    assert len(server.requests) > 3
    assert ep["num_tool_calls"] == 1 and "Pem Varo" in ep["turn_texts"][1][1]
    assert ep["finish_reason"] == "answer" and ep["rewards"].item() == 1.0


def test_a_stop_string_split_by_a_length_cut_ends_the_turn_and_an_invented_block_is_never_trained(tokenizer, retrieval):
    """The server of the second piece never sees '</search>' and lets the model write on: an
    invented <information> block and answer. The client cuts the turn where '</search>' completes."""
    invented = "<search> Ostrel Guild </search><information> Pem Varo is a fish </information><answer> fish </answer>"
    ids = tokenizer(invented, add_special_tokens=False)["input_ids"]
    k = next(n for n in range(1, len(ids)) if "</search>" in tokenizer.decode(ids[:n])) - 1
    cfg = ts.Config(max_turns=3, max_new_tokens_per_turn=k, tool_retries=1, tool_timeout_s=5)
    script = [Reply(ids=ids[:k]), Reply(ids=ids[k:]), continuing("<answer> Pem Varo </answer>", tokenizer)]
    ep, _ = scripted_episode(tokenizer, script, cfg, retrieval)
    assert model_text(tokenizer, ep) == "<search> Ostrel Guild </search><answer> Pem Varo </answer>"
    assert ep["num_tool_calls"] == 1 and ep["rewards"].item() == 1.0


def test_eos_sampled_as_the_last_token_of_a_piece_ends_the_turn(tokenizer):
    """Both servers report it as length; the episode used to ask the model to go on after its own
    end of turn and reward what came next."""
    think = tokenizer("<think> I am done </think>", add_special_tokens=False)["input_ids"]
    cfg = ts.Config(max_turns=4, max_new_tokens_per_turn=len(think) + 1)
    ep, server = scripted_episode(tokenizer, [Reply(ids=think, eos=True), Reply("<answer> Pem Varo </answer>")], cfg)
    assert server.answers[0]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(server.requests) == 1 and ep["finish_reason"] == "no_action" and ep["rewards"].item() == 0.0


def test_an_aborted_generation_fails_its_group_which_is_dropped_and_counted(tokenizer):
    calls = {"n": 0}

    def script(body):
        calls["n"] += 1
        return Reply("<answer> Pem", abort_after=1) if calls["n"] == 2 else Reply("<answer> Pem Varo </answer>")

    async def go(address, items):
        async with aiohttp.ClientSession() as session:
            return await ts.rollout_groups(InferenceClient([address], max_retries=0), session, tokenizer, cfg, items,
                                           "http://127.0.0.1:9", 1.0, 2)
    cfg = ts.Config(max_turns=2)
    with ScriptedServer(tokenizer, [script]) as server:
        groups, failed = asyncio.run(go(server.address, [ITEM, ITEM]))
    assert failed == 1 and len(groups) == 1 and len(groups[0]) == 2
    assert all(e["rewards"].item() == 1.0 for e in groups[0])
    with ScriptedServer(tokenizer, [Reply("x", abort_after=0)]) as server:
        with pytest.raises(RuntimeError, match="all 2 groups"):
            asyncio.run(go(server.address, [ITEM, ITEM]))


def test_the_episode_raises_on_an_abort_rather_than_scoring_it(tokenizer):
    with pytest.raises(GenerationAborted):
        scripted_episode(tokenizer, [Reply("<answer> Pem Varo </answer>", abort_after=3)], ts.Config())


def test_a_missing_page_is_an_answer_not_a_tool_failure(tokenizer, retrieval):
    cfg = ts.Config(max_turns=3, tool_retries=1, tool_timeout_s=5)
    ep, _ = scripted_episode(tokenizer, [Reply("<access> Nowhere Hall </access>"), Reply("<answer> x </answer>")],
                             cfg, retrieval)
    assert ep["num_tool_calls"] == 1 and ep["num_tool_failures"] == 0
    assert ep["turn_texts"][1][1] == "There is no page titled Nowhere Hall."


def test_tool_that_stays_down_puts_a_failure_message_in_context_and_is_counted(tokenizer):
    cfg = ts.Config(max_turns=4, tool_retries=2, tool_timeout_s=1)
    ep, _ = scripted_episode(tokenizer, [Reply("<search> Ostrel Guild </search>"), Reply("<answer> no idea </answer>")],
                             cfg, retrieval_addr="http://127.0.0.1:9")
    message = ep["turn_texts"][1][1]
    assert ep["num_tool_calls"] == 1 and ep["num_tool_failures"] == 1
    assert "The search tool failed" in message and "2 attempts" in message
    assert "127.0.0.1" not in message, "the server's address is not the model's business"
    assert ep["finish_reason"] == "answer" and ep["rewards"].item() == 0.0


def test_episode_ends_cleanly_at_max_turns(tokenizer, retrieval):
    cfg = ts.Config(max_turns=3, tool_retries=1, tool_timeout_s=5)
    ep, _ = scripted_episode(tokenizer, [Reply("<search> again </search>")], cfg, retrieval)
    assert ep["num_turns"] == 3 and ep["finish_reason"] == "max_turns" and ep["rewards"].item() == 0.0


def test_episode_ends_cleanly_at_the_context_budget(server, tokenizer):
    prompt_len_ = len(ts.build_prompt_ids(tokenizer, ITEM["question"], True))
    cfg = ts.Config(max_turns=50, max_new_tokens_per_turn=16, max_tokens=prompt_len_ + 40)
    ep = run_episode(InferenceClient([server.address]), tokenizer, cfg)
    assert ep["input_ids"].shape[1] <= cfg.max_tokens
    assert ep["finish_reason"] in ("max_tokens", "no_action", "answer")
    assert ep["num_turns"] < 50


def test_malformed_model_output_never_crashes_an_episode(tokenizer):
    garbage = ["<search></search><answer>", "</answer><access>\x00\udcff</access>", "<<search>>", "\ufffd" * 50]
    cfg = ts.Config(max_turns=4, tool_retries=1, tool_timeout_s=1)
    for text in garbage:
        ep, _ = scripted_episode(tokenizer, [Reply(text.encode("utf-8", "replace").decode("utf-8")), Reply(text)], cfg)
        assert ep["rewards"].item() == 0.0 and ep["num_turns"] >= 1


def test_warm_start_demonstrations_search_each_hop_or_answer_directly(tokenizer):
    from lib.wiki_data import default_wiki_dir

    data_dir = default_wiki_dir(seed=0)
    items = read_qa(os.path.join(data_dir, "warmstart.jsonl"))[:40]
    cfg = ts.Config(prompt="short", topk=2)
    demos = ts.build_demonstrations(tokenizer, cfg, items, os.path.join(data_dir, "corpus.jsonl"), direct_frac=0.5)
    texts = [tokenizer.decode(d["input_ids"]) for d in demos]
    direct = [t for t in texts if "<search>" not in t]
    assert 10 <= len(direct) <= 30  # about half
    for item, text, demo in zip(items, texts, demos):
        gold = item["answer"][0]
        if "<search>" in text:  # one search per hop, then the answer read from the results
            assert text.count("<search>") == len(item["hop_queries"]) and f"The answer is {gold}." in text
            # the model's turns, for the warm start's check: each search, then the answer, with its end of turn
            turns = [tokenizer.decode(demo["input_ids"][a:b]) for a, b in demo["model_turns"]]
            assert turns == [f"<think> I need to search {q}. </think>\n<search> {q} </search>"
                             for q in item["hop_queries"]] + [f"<think> The answer is {gold}. </think>\n<answer> "
                                                              f"{gold} </answer><|im_end|>"]
        else:
            assert f"<think> From memory: {gold}. </think>\n<answer> {gold} </answer>" in text
            assert "model_turns" not in demo  # answered from memory: nothing copied to check
    plain = ts.build_demonstrations(tokenizer, cfg, items, os.path.join(data_dir, "corpus.jsonl"))
    assert all("<search>" in tokenizer.decode(d["input_ids"]) for d in plain)  # the default: every one searches


def test_the_warm_starts_copy_check_acts_for_the_default_recipe_only(monkeypatch, capsys):
    """Which warm starts get stage 1's check, and its verdict: the default recipe of the embedded model
    only (lib.warm_start's SFT and check stubbed: the wiring is what is tested here)."""
    import lib.warm_start as ws

    calls = []
    monkeypatch.setattr(ws, "warm_start_stages", lambda name, base, examples, **kw: calls.append(kw) or "built")
    counts = {}
    monkeypatch.setattr(ws, "reproduced", lambda model_dir, examples, key, seed: counts[model_dir])
    data_dir = ts.bundled_data_dir(ts.Config())
    for cfg, embedded, checked in [(ts.Config(), True, True), (ts.Config(warm_start_steps=50), True, False),
                                   (ts.Config(), False, False), (ts.Config(use_tool=False), True, False),
                                   (ts.Config(model_path="x", warm_start_steps=50), False, False)]:
        assert ts.warm_started_model(cfg, "base", data_dir, embedded) == "built"
        check = calls[-1]["stage1_ok"]
        assert (check is not None) == checked
        if check is None:
            continue
        counts.update(missed=(29, 150), copied=(30, 150))
        assert check("copied") and not check("missed")
        assert "writes every turn of 29 of 150 searching demonstrations" in capsys.readouterr().out


@pytest.mark.slow
def test_two_steps_then_resume_from_checkpoint(tmp_path):
    run_dir = str(tmp_path / "run")
    args = [sys.executable, "train_search.py", "--run_dir", run_dir, "--batch_size", "2", "--group_size", "2",
            "--max_turns", "2", "--max_new_tokens_per_turn", "16", "--max_tokens", "384", "--eval_every", "0", "--test_size", "2",
            "--warm_start_steps", "2", "--warm_start_batch_size", "2", "--warm_start_direct_steps", "2",
            "--warm_start_worlds", "0", "--checkpoint_every", "1", "--lr", "1e-4"]
    first = subprocess.run(args + ["--max_steps", "2", "--learnability_probe", "True", "--eval_size", "2"], cwd=REPO,
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["probe/questions"] for r in rows if "probe/questions" in r] == [2]  # before the first step
    train_rows = [r for r in rows if "rollout/reward" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    assert all(r["logprob/server_trainer_abs_diff_max"] < 1e-3 for r in train_rows)
    assert os.path.exists(os.path.join(run_dir, "final", "model.safetensors"))

    second = subprocess.run(args + ["--max_steps", "3", "--resume", "True"], cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 2 (policy version 2," in second.stdout
    # The server's sampling does not replay the run's first steps: its seed depends on the step.
    assert f"server sampling seed {server_seed(0, 2)}" in second.stdout and server_seed(0, 2) != server_seed(0, 0)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in rows if "rollout/reward" in r] == [1, 2, 3]
    # After the resume the server holds the trained weights, so the log-probs still agree.
    assert rows[-2]["logprob/server_trainer_abs_diff_max"] < 1e-3


COMMON = ["--batch_size", "2", "--group_size", "2", "--max_turns", "2", "--max_new_tokens_per_turn", "16", "--max_tokens", "384",
          "--eval_every", "0", "--test_size", "2", "--warm_start_steps", "2", "--warm_start_batch_size", "2",
          "--warm_start_direct_steps", "2", "--checkpoint_every", "1", "--lr", "1e-4", "--max_steps", "2", "--tensorboard", "False",
          "--warm_start_worlds", "0"]  # the warm-start split's demonstrations only: a cheap key for the tests' warm start


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
def test_colocated_sleep_mode_with_tensor_sync_runs_two_steps_with_the_trained_weights_served(tmp_path):
    run_dir = str(tmp_path / "colocated")
    args = [sys.executable, "train_search.py", "--run_dir", run_dir, "--weight_sync", "tensor",
            "--colocate_sleep", "True", *COMMON]
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    # step 2 was sampled after the server was released, resumed and handed step 1's weights
    assert all(r["logprob/server_trainer_abs_diff_max"] < 1e-3 for r in rows)


@pytest.mark.slow
def test_torchrun_two_ranks_train_on_their_share_of_rank0s_batch(tmp_path):
    run_dir = str(tmp_path / "fsdp")
    # 3 x 3 = 9 episodes: rank 0 holds 5 rows, rank 1 holds 4, and 4 mini-batches are asked for.
    # torch.chunk split them into 3 and 4 parts: the ranks ran different numbers of optimizer steps.
    common = dict(zip(COMMON[::2], COMMON[1::2]))
    common.update({"--batch_size": "3", "--group_size": "3", "--ppo_minibatches": "4"})
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "train_search.py",
            "--run_dir", run_dir, "--weight_sync", "nccl", *[x for kv in common.items() for x in kv]]  # FSDP2 over gloo
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # 9 episodes per step, 5 and 4 per rank; loss stats are rank 0's
        assert r["loss/minibatches"] == 4
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
    # 4 episodes in 2 mini-batches (2 optimizer steps) that together cover every generated token once.
    assert rows[0]["loss/minibatches"] == 2 and rows[0]["loss/num_tokens"] == rows[0]["rollout/gen_tokens"]
