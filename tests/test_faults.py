"""Faults a run must survive or report: servers that die (supervised restarts, clear errors), a
trainer killed mid-checkpoint and resumed, per-step files that hold one run, a cache that moves."""
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import requests

from lib.metrics import continue_jsonl
from lib.supervise import Supervisor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- supervision ---

def test_a_dead_stateless_server_is_restarted_on_its_address_and_counted(tmp_path):
    from lib.retrieval import launch_retrieval_server

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "0", "contents": '"Tarqua"\nTarqua is a harbour town.'}) + "\n")
    server = launch_retrieval_server(str(corpus))
    port = int(server.address.rsplit(":", 1)[1])
    sup = Supervisor("retrieval server", server, lambda: launch_retrieval_server(str(corpus), port=port),
                     poll_s=0.1, backoff_s=0.1)
    try:
        os.killpg(server.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while sup.restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sup.restarts == 1 and sup.server is not server and sup.server.address == server.address
        answer = requests.post(server.address + "/retrieve", json={"queries": ["Tarqua"], "topk": 1}, timeout=10)
        assert answer.status_code == 200 and "harbour" in json.dumps(answer.json())
        sup.check()  # restarted: nothing to report
    finally:
        sup.stop()


class _Proc:
    """A server-shaped object around a process that exits on its own."""

    def __init__(self, code: int, log_path: str):
        self.process = subprocess.Popen([sys.executable, "-c", f"print('model step failed'); raise SystemExit({code})"],
                                        stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
        self.address, self.log_path = "http://127.0.0.1:1", log_path

    def terminate(self):
        self.process.wait()


def test_a_dead_inference_server_is_reported_with_its_exit_code_and_log(tmp_path):
    sup = Supervisor("inference server", _Proc(3, str(tmp_path / "server.log")), poll_s=0.05)
    deadline = time.monotonic() + 30
    while sup.error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match="inference server .* exited with code 3.*not restarted(.|\n)*model step failed"):
        sup.check()
    sup.stop()


# --- per-step files of a run ---

def test_a_fresh_run_moves_an_earlier_runs_rows_aside_and_a_resume_drops_rows_after_its_step(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    rows = [{"step": s, "x": s} for s in (0, 1, 2, 3)]
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "x"')  # cut by a kill
    continue_jsonl(path, resume_step=2)
    assert [json.loads(line)["step"] for line in open(path)] == [0, 1, 2]
    continue_jsonl(path, resume_step=None)
    assert not os.path.exists(path)
    moved = [p for p in os.listdir(tmp_path) if p.startswith("metrics.before-")]
    assert len(moved) == 1 and [json.loads(line)["step"] for line in open(tmp_path / moved[0])] == [0, 1, 2]


def test_a_runs_settings_are_written_beside_its_metrics_as_json(tmp_path):
    from lib.metrics import MetricsLogger

    logger = MetricsLogger(str(tmp_path), {"lr": 1e-5, "mode": "async", "stop": (2, 0)}, tensorboard=False)
    logger.close()
    assert json.load(open(tmp_path / "config.json")) == {"lr": 1e-5, "mode": "async", "stop": [2, 0]}
    assert not os.path.exists(tmp_path / "config.json.tmp")


# --- the cache ---

def test_warm_start_cache_keys_do_not_depend_on_where_the_cache_lives(tmp_path, monkeypatch):
    from lib.warm_start import warm_start_dir

    names = []
    for root in (tmp_path / "a", tmp_path / "elsewhere" / "b"):
        monkeypatch.setenv("AGENTRL_CACHE", str(root))
        settings = {"base": str(root / "tiny-qwen2-1234"), "data": str(root / "wiki-data-v2-seed0"), "steps": 10,
                    "user_data": "/data/mine"}
        names.append(os.path.basename(warm_start_dir("search-warm-start", settings)))
    assert names[0] == names[1]
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "a"))
    other = {"base": str(tmp_path / "a" / "tiny-qwen2-9999"), "data": str(tmp_path / "a" / "wiki-data-v2-seed0"),
             "steps": 10, "user_data": "/data/mine"}
    assert os.path.basename(warm_start_dir("search-warm-start", other)) != names[0]


# --- a whole run under faults ---

SMALL = ["--batch_size", "2", "--group_size", "2", "--max_turns", "2", "--max_new_tokens_per_turn", "16",
         "--max_tokens", "384", "--eval_every", "0", "--test_size", "2", "--warm_start_steps", "2",
         "--warm_start_batch_size", "2", "--warm_start_direct_steps", "2", "--lr", "1e-4", "--tensorboard", "False"]


def _children(pid: int, name: str) -> list[int]:
    """Pids of the child processes of `pid` whose command line holds `name`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(stat[stat.rfind(")") + 2:].split()[1]) == pid and name in cmdline:
            found.append(int(entry))
    return found


def _rows(run_dir: str, name: str = "metrics.jsonl") -> list[dict]:
    path = os.path.join(run_dir, name)
    if not os.path.exists(path):
        return []
    rows = []
    for line in open(path):
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def _start(args: list, log_path: str) -> subprocess.Popen:
    # Output to a file, not a pipe: a pipe nobody reads fills up with progress bars and blocks the run.
    proc = subprocess.Popen(args, cwd=REPO, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, text=True)
    proc.args_log = log_path
    return proc


def _wait_for(predicate, proc, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the run exited (code {proc.returncode}) before {what}:\n"
                                 f"{open(proc.args_log).read()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s} s")
        time.sleep(0.2)


@pytest.mark.slow
def test_retrieval_killed_then_trainer_killed_mid_checkpoint_and_resumed_loses_and_repeats_nothing(tmp_path):
    run_dir = str(tmp_path / "run")
    small = dict(zip(SMALL[::2], SMALL[1::2]), **{"--batch_size": "1", "--warm_start_worlds": "0"})  # one group a step: faster
    args = [sys.executable, "train_search.py", "--run_dir", run_dir, *[x for kv in small.items() for x in kv],
            "--checkpoint_every", "2"]
    proc = _start(args + ["--max_steps", "20"], str(tmp_path / "first.log"))
    try:
        train = lambda: [r for r in _rows(run_dir) if "rollout/reward" in r]  # noqa: E731
        _wait_for(lambda: len(train()) >= 1, proc, 400, "step 1")
        retrieval = _children(proc.pid, "lib.retrieval")
        assert len(retrieval) == 1
        os.kill(retrieval[0], signal.SIGKILL)
        _wait_for(lambda: any(r["server/restarts"] >= 1 for r in train()), proc, 120, "a logged restart")
        _wait_for(lambda: os.path.exists(os.path.join(run_dir, "checkpoints", "latest"))
                  and len(train()) >= 3, proc, 300, "step 3 after a checkpoint")
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # As if the kill had landed between the two renames of the checkpoint swap: only latest.old is whole.
    ckpt = os.path.join(run_dir, "checkpoints")
    saved_step = __import__("torch").load(os.path.join(ckpt, "latest", "trainer_state.pt"), weights_only=False)["extra"]["step"]
    os.rename(os.path.join(ckpt, "latest"), os.path.join(ckpt, "latest.old"))
    logged_before = max(r["step"] for r in _rows(run_dir) if "rollout/reward" in r)
    assert logged_before > saved_step, "the killed run logged steps after its checkpoint"

    final = saved_step + 2
    out = subprocess.run(args + ["--max_steps", str(final), "--resume", "True"], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resumed from step {saved_step} " in out.stdout
    steps = [r["step"] for r in _rows(run_dir) if "rollout/reward" in r]
    assert steps == list(range(1, final + 1)), "every step once: none lost, none repeated"
    # Same data order as an uninterrupted run: step s draws train item s - 1 (batch_size 1).
    from lib.wiki_data import default_wiki_dir
    from lib.wiki_data import read_qa as read_jsonl

    train_items = read_jsonl(os.path.join(default_wiki_dir(seed=0), "train.jsonl"))
    order = np.random.RandomState(0).permutation(len(train_items))
    traces = {}
    for r in _rows(run_dir, "traces.jsonl"):
        traces.setdefault(r["step"], r["question"])
    assert sorted(traces) == list(range(1, final + 1))
    for s, question in traces.items():
        assert question == train_items[order[s - 1]]["question"], f"step {s} saw another question"


@pytest.mark.slow
def test_a_killed_inference_server_stops_the_run_with_a_clear_error(tmp_path):
    run_dir = str(tmp_path / "run")
    args = [sys.executable, "train_reflect.py", "--run_dir", run_dir, "--batch_size", "2", "--group_size", "2",
            "--max_steps", "50", "--eval_every", "0", "--test_size", "2", "--warm_start_steps", "4",
            "--warm_start_batch_size", "4", "--warm_start_direct_steps", "2", "--warm_start_problems", "200",
            "--max_new_tokens_per_turn", "32", "--checkpoint_every", "0", "--tensorboard", "False"]
    proc = _start(args, str(tmp_path / "run.log"))
    try:
        _wait_for(lambda: any("rollout/reward" in r for r in _rows(run_dir)), proc, 400, "step 1")
        server = _children(proc.pid, "lib.cpu_server")
        assert len(server) == 1
        os.kill(server[0], signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = open(tmp_path / "run.log").read()
    assert proc.returncode != 0
    assert "the inference server at http://127.0.0.1:" in stderr and "exited with code -9" in stderr
    steps = [r["step"] for r in _rows(run_dir) if "rollout/reward" in r]
    assert steps and max(steps) < 50


# --- exactly once across kills (async mode) ---
# Turns that end at a newline as well as at the end of turn: turns of many lengths, as a trained
# model's are, so that a later item's group often finishes before an earlier one's.
ASYNC_SMALL = ["--mode", "async", "--batch_size", "2", "--group_size", "4", "--max_turns", "2",
               "--max_new_tokens_per_turn", "64", "--eval_every", "0", "--test_size", "2", "--warm_start_steps", "40",
               "--warm_start_batch_size", "8", "--warm_start_direct_steps", "0", "--warm_start_problems", "2000",
               "--checkpoint_every", "1", "--trace_every", "1", "--trace_groups", "2", "--tensorboard", "False",
               "--trainer_threads", "1"]
ASYNC_STEPS = 6


def _stop_at_end_of_turn_or_newline() -> list[str]:
    from transformers import AutoTokenizer

    from lib.tiny_model import default_tiny_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_tiny_model_dir())
    [newline] = tokenizer("\n", add_special_tokens=False)["input_ids"]
    return ["--stop_token_ids", json.dumps([tokenizer.eos_token_id, newline])]


def _checkpoint_extra(run_dir: str) -> dict | None:
    import torch

    try:
        return torch.load(os.path.join(run_dir, "checkpoints", "latest", "trainer_state.pt"), weights_only=False)["extra"]
    except (OSError, EOFError, RuntimeError):  # none yet, or swapped while read
        return None


def _trained_items(run_dir: str) -> list[int]:
    """The train item of every group the finished run trained, from its traces (every group is
    traced: trace_groups = batch_size), each group's question read back to its item index."""
    import train_reflect as tr
    from lib.run import item_at

    cfg = tr.Config(warm_start_problems=2000)
    run = SimpleNamespace(train_items=tr.load_splits(cfg)["train"], cfg=SimpleNamespace(seed=0))
    index_of = {}
    for i in range(40 * ASYNC_STEPS):  # the producer is never more than its capacity ahead: far inside this
        index_of.setdefault(item_at(run, i)["question"], []).append(i)
    assert all(len(v) == 1 for v in index_of.values()), "a question twice in the window: its item is ambiguous"
    groups = {(r["step"], r["group"]): r["question"] for r in _rows(run_dir, "traces.jsonl")}
    return sorted(index_of[q][0] for q in groups.values())


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_an_async_run_killed_at_random_points_and_resumed_trains_every_item_once(tmp_path, seed):
    # The producer runs ahead of the trainer, and a step may take a later item's group while an
    # earlier one still runs (most often at a process's first step, when the trainer waits for the
    # first groups). A resume must neither start those again (trained twice) nor skip what was in
    # flight at the kill (lost). Two kills, each a random time after a checkpoint of the process's first steps.
    rng = np.random.default_rng(seed)
    run_dir = str(tmp_path / "run")
    args = [sys.executable, "train_reflect.py", "--run_dir", run_dir, *ASYNC_SMALL, *_stop_at_end_of_turn_or_newline(),
            "--max_steps", str(ASYNC_STEPS)]
    for kill in range(2):
        proc = _start(args + (["--resume", "True"] if kill else []), str(tmp_path / f"killed{kill}.log"))
        try:
            target = (_checkpoint_extra(run_dir) or {"step": 0})["step"] + int(rng.integers(1, 3))
            _wait_for(lambda: (_checkpoint_extra(run_dir) or {"step": 0})["step"] >= target, proc, 300,
                      f"step {target}'s checkpoint")
            time.sleep(float(rng.uniform(0.0, 0.4)))
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
    out = subprocess.run(args + ["--resume", "True"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [r for r in _rows(run_dir) if "rollout/reward" in r]
    assert [r["step"] for r in rows] == list(range(1, ASYNC_STEPS + 1))
    assert all(r["rollout/failed_groups"] == 0 for r in rows)
    trained = _trained_items(run_dir)
    assert len(trained) == len(set(trained)) == 2 * ASYNC_STEPS, f"an item trained twice: {trained}"
    # none lost: every item before the last checkpoint's position was trained; those after it that
    # were trained are the ones its ledger names as consumed
    extra = _checkpoint_extra(run_dir)
    position = extra["data_position"]
    assert set(range(position)) <= set(trained), f"items lost: {sorted(set(range(position)) - set(trained))}"
    assert sorted(set(trained) - set(range(position))) == extra.get("data_consumed_ahead", [])
