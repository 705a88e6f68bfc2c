"""Trace records (lib/traces.py) and the viewer (lib/viewer*.py): records hold every token after the
prompt with both log-probs; the viewer reads growing and old-format trace files, filters, escapes model
output, and renders real runs of every script (sync and async, one with tool failures and truncated
episodes) in a headless chromium when there is one."""
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch
from transformers import AutoTokenizer

from lib.tiny_model import default_tiny_model_dir
from lib.traces import episode_record, trace_records, trainer_logprobs_by_episode, write_traces
from lib.viewer import make_server, render_page
from lib.viewer_data import MetricsIndex, TraceIndex, filter_entries, is_mismatch, sort_entries

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCREENSHOT_DIR = os.environ.get("AGENTRL_SCREENSHOT_DIR", "")  # keep the screenshots there (docs/)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_tiny_model_dir())


def make_episode(tokenizer, pieces: list[tuple[str, int]], reward: float = 1.0, **extra) -> dict:
    """An episode dict as arun_episode returns it, from (text, loss_mask) pieces; the first is the prompt."""
    ids, mask = [], []
    for text, m in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [m] * len(piece)
    logprobs = [-0.5 if m else 0.0 for m in mask]
    versions = [3 if m else -1 for m in mask]
    t = lambda xs, dtype: torch.tensor([xs], dtype=dtype)  # noqa: E731
    return {"input_ids": t(ids, torch.long), "loss_mask": t(mask, torch.long), "logprobs": t(logprobs, torch.float32),
            "versions": t(versions, torch.long), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
            "rewards": torch.tensor([reward]), "num_turns": 2, "finish_reason": "answer", "question": "q?",
            "gold": ["Pem Varo"], "answer": "Pem Varo", **extra}


# --- trace records ---
def test_trainer_logprobs_go_to_the_kept_rows_this_rank_scored():
    keep = torch.tensor([True, True, False, False, True, True])  # group 1 (rows 2, 3) dropped
    rank1_rows = torch.arange(2).float()[:, None].expand(2, 4)  # rank 1 of 2 holds kept rows 1 and 5
    out = trainer_logprobs_by_episode(keep, rank1_rows, rank=1, world_size=2)
    assert [None if r is None else r[0].item() for r in out] == [None, 0.0, None, None, None, 1.0]
    assert trainer_logprobs_by_episode(keep, None) == [None] * 6


def test_a_record_holds_every_token_after_the_prompt_split_into_turns_by_the_loss_mask(tokenizer):
    ep = make_episode(tokenizer, [("Question: who?\n", 0), ("<search> Ostrel </search>", 1),
                                  ("\n\n<information>Doc 1</information>\n\n", 0), ("<answer> Pem Varo </answer>", 1)])
    prompt_len = len(tokenizer("Question: who?\n", add_special_tokens=False)["input_ids"])
    trainer = ep["logprobs"][0] - 0.01 * ep["loss_mask"][0]
    r = episode_record(ep, tokenizer, step=7, group=1, index=2, advantage=0.5, trainer_logprobs=trainer)
    tokens = r["tokens"]
    assert tokens["id"] == ep["input_ids"][0, prompt_len:].tolist()
    assert "".join(tokens["text"]) == tokenizer.decode(tokens["id"])
    assert tokens["mask"] == ep["loss_mask"][0, prompt_len:].tolist()
    assert [t["role"] for t in r["turns"]] == ["model", "tool", "model"]
    assert r["turns"][1]["text"] == "\n\n<information>Doc 1</information>\n\n"
    assert r["turns"][-1]["end"] == len(tokens["id"]) and r["prompt"] == "Question: who?\n"
    gen = [i for i, m in enumerate(tokens["mask"]) if m]
    assert all(tokens["lp"][i] == -0.5 and tokens["tlp"][i] == -0.51 and tokens["ver"][i] == 3 for i in gen)
    assert all(tokens["lp"][i] == tokens["tlp"][i] == 0 and tokens["ver"][i] == -1 for i in range(len(tokens["id"]))
               if i not in gen)  # tool output: not trained on
    assert (r["step"], r["group"], r["index"], r["advantage"], r["reward"]) == (7, 1, 2, 0.5, 1.0)
    assert r["stats"] == {"num_turns": 2}


def test_trace_records_keep_whole_groups_with_their_advantages(tokenizer):
    episodes = [make_episode(tokenizer, [("Q\n", 0), (f"<answer> {i} </answer>", 1)], reward=float(i)) for i in range(6)]
    adv = torch.tensor([-1.0, 1.0, -1.0, 1.0, 0.0, 0.0])
    records = trace_records(3, episodes, adv, [None] * 6, tokenizer, group_size=2, trace_groups=2,
                            correct=lambda e: e["rewards"].item() > 2, tool_failures=lambda e: 0)
    assert [(r["group"], r["index"], r["advantage"]) for r in records] == [(0, 0, -1.0), (0, 1, 1.0), (1, 0, -1.0), (1, 1, 1.0)]
    assert [r["correct"] for r in records] == [0.0, 0.0, 0.0, 1.0] and records[0]["tokens"]["tlp"] is None


# --- reading and filtering ---
def test_the_trace_index_reads_appended_lines_skips_a_half_written_one_and_restarts_on_a_cut_file(tmp_path):
    path = tmp_path / "traces.jsonl"
    path.write_text(json.dumps({"step": 1, "group": 0, "index": 0, "reward": 1.0}) + "\n")
    index = TraceIndex(str(path)).refresh()
    assert index.steps() == [1]
    with open(path, "a") as f:
        f.write(json.dumps({"step": 2, "group": 0, "index": 0}) + "\n" + '{"step": 3, "gro')
    assert index.refresh().steps() == [1, 2]
    with open(path, "a") as f:
        f.write('up": 0}\n')
    assert index.refresh().steps() == [1, 2, 3]
    path.write_text(json.dumps({"step": 1, "group": 0, "index": 0}) + "\n")  # a resume cut it back
    assert index.refresh().steps() == [1]
    assert index.load(index.entries)[0]["step"] == 1


def test_filters_select_by_finish_reward_tool_failures_and_verdict_reward_mismatch():
    entries = [{"step": 1, "finish": "answer", "reward": 0.0, "correct": 1.0, "tool_failures": 0},
               {"step": 1, "finish": "max_tokens", "reward": 0.0, "correct": 0.0, "tool_failures": 2},
               {"step": 2, "finish": "answer", "reward": 0.4, "correct": 0.0, "tool_failures": 0},
               {"step": 2, "finish": "answer", "reward": 1.0, "correct": None, "tool_failures": 0}]
    pick = lambda **kw: [entries.index(e) for e in filter_entries(entries, **kw)]  # noqa: E731
    assert pick(finish="max_tokens") == [1]
    assert pick(tool_failures=True) == [1]
    assert pick(mismatch=True) == [0, 2]  # correct with reward 0; wrong with partial credit
    assert pick(min_reward=0.3) == [2, 3] and pick(max_reward=0.0, step=1) == [0, 1]
    assert not is_mismatch(entries[3])


def test_an_episode_with_a_nan_reward_passes_no_reward_filter():
    entries = [{"step": 1, "finish": "answer", "reward": float("nan"), "correct": None, "tool_failures": 0},
               {"step": 1, "finish": "answer", "reward": 0.5, "correct": None, "tool_failures": 0}]
    for bounds in ({"min_reward": -1e9}, {"max_reward": 1e9}, {"min_reward": 0.0, "max_reward": 1.0}):
        assert filter_entries(entries, **bounds) == [entries[1]], bounds
    assert len(filter_entries(entries)) == 2  # no bound set: every episode, the NaN one too


def test_sorting_puts_episodes_without_the_value_last_whichever_the_direction():
    entries = [{"step": s, "group": 0, "index": i, "reward": r, "max_gap": g}
               for s, i, r, g in [(1, 0, 0.5, None), (2, 0, float("nan"), 0.3), (3, 0, 1.0, 0.1), (3, 1, None, 0.2)]]
    order = lambda sort: [(e["step"], e["index"]) for e in sort_entries(entries, sort)]  # noqa: E731
    assert order("reward_desc") == [(3, 0), (1, 0), (2, 0), (3, 1)]
    assert order("reward_asc") == [(1, 0), (3, 0), (2, 0), (3, 1)]
    assert order("gap_desc") == [(2, 0), (3, 1), (3, 0), (1, 0)]
    assert order("newest") == [(3, 0), (3, 1), (2, 0), (1, 0)] and order("oldest")[0] == (1, 0)


def test_the_metrics_index_reads_only_appended_bytes_and_starts_over_on_a_cut_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "rollout/reward": 0.5}\n{"step": 2, "rollout/reward": 0.7, "test/acc": 0.9}\n{"st')
    index = MetricsIndex(str(path)).refresh()
    assert [r["step"] for r in index.rows] == [1, 2] and index.last_step == 2 and index.tests == {"acc": 0.9}
    with open(path, "a") as f:
        f.write('ep": 3, "rollout/reward": 0.1}\n')
    rows_before = index.rows
    assert [r["step"] for r in index.refresh().rows] == [1, 2, 3] and index.rows[:2] == rows_before
    assert index._read_to == path.stat().st_size and index.generation == 0
    path.write_text('{"step": 1, "rollout/reward": 0.2}\n')  # a resume cut it back
    assert [r["step"] for r in index.refresh().rows] == [1] and index.generation == 1 and index.last_step == 1


def test_model_output_is_escaped_everywhere_it_is_shown(tmp_path, tokenizer):
    evil = '<script>document.title="pwned"</script><img src=x onerror="document.title=\'pwned\'">'
    ep = make_episode(tokenizer, [("Question: " + evil + "\n", 0), (evil, 1), (evil, 0)], answer=evil, question=evil)
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "traces.jsonl", "w") as f:
        write_traces(f, [episode_record(ep, tokenizer, step=1, group=0, index=0, advantage=0.0, trainer_logprobs=None)])
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/reward": 1.0}) + "\n")
    page = render_page([str(run)], {}, {})
    assert "<script>document" not in page and "<img src=x" not in page and "&lt;script&gt;document" in page
    assert page.count("<script") == 3  # plotly.min.js, the figures' JSON, the plotting code: nothing else


def test_a_refresh_of_the_served_page_shows_a_live_runs_new_step_and_plotly_comes_from_the_server(tmp_path, tokenizer):
    run = tmp_path / "live"
    run.mkdir()
    ep = make_episode(tokenizer, [("Question: q\n", 0), ("<answer> Pem Varo </answer>", 1)])
    server = make_server([str(run)], port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    get = lambda path: urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}{path}", timeout=30).read()  # noqa: E731
    try:
        assert b"traces.jsonl is empty or missing" in get("/")  # a run that has not traced a step yet
        for step in (1, 2):  # the trainer appends a step between two refreshes
            with open(run / "traces.jsonl", "a") as f:
                write_traces(f, [episode_record(ep, tokenizer, step=step, group=0, index=0, advantage=0.0,
                                                trainer_logprobs=None)])
            with open(run / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "rollout/reward": 0.5}) + "\n")
            page = get("/").decode()
            assert f'class="group" data-step="{step}"' in page and f"last step {step}" in page
        assert b"plotly" in get("/plotly.min.js")[:2000].lower()
    finally:
        server.shutdown()
        server.server_close()


def test_out_writes_one_self_contained_page(tmp_path, tokenizer):
    from lib.viewer import main

    run = tmp_path / "run"
    run.mkdir()
    ep = make_episode(tokenizer, [("Question: q\n", 0), ("<answer> Pem Varo </answer>", 1)])
    with open(run / "traces.jsonl", "w") as f:
        write_traces(f, [episode_record(ep, tokenizer, step=1, group=0, index=0, advantage=0.0, trainer_logprobs=None)])
    main([str(run), "--out", str(tmp_path / "page.html")])
    page = (tmp_path / "page.html").read_text()
    assert 'src="/plotly.min.js"' not in page and "Plotly.react" in page and len(page) > 1_000_000  # plotly inlined
    assert 'class="group" data-step="1"' in page


def test_traces_written_before_per_token_records_still_render(tmp_path):
    run = tmp_path / "old"
    run.mkdir()
    rows = [{"step": 1, "question": "q", "gold": "4", "reward": 1.0, "finish": "correct", "turns": ["#### 4"]},
            {"step": 1, "question": "q", "gold": "4", "reward": 0.0, "finish": "answer",
             "turns": [["model", "<calc> 2 + 2 </calc>"], ["tool", "4"]]}]
    (run / "traces.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = render_page([str(run)], {"step": ["1"]}, {})
    assert "#### 4" in page and "&lt;calc&gt; 2 + 2 &lt;/calc&gt;" in page and "2 episodes match" in page


# --- real runs of every script, rendered in a browser ---
TINY = ["--max_steps", "2", "--batch_size", "2", "--trace_groups", "2", "--eval_every", "0", "--checkpoint_every", "0",
        "--tensorboard", "False", "--lr", "1e-4"]
SEARCH = ["--group_size", "4", "--max_turns", "2", "--max_new_tokens_per_turn", "16", "--max_tokens", "384",
          "--test_size", "2", "--warm_start_steps", "2", "--warm_start_batch_size", "2", "--warm_start_direct_steps", "2",
          "--warm_start_worlds", "0"]
REFLECT = ["--group_size", "2", "--max_turns", "2", "--max_new_tokens_per_turn", "24", "--eval_size", "4", "--test_size", "4",
           "--warm_start_steps", "4", "--warm_start_batch_size", "4", "--warm_start_direct_steps", "2",
           "--trainer_threads", "1", "--warm_start_problems", "2000"]
CALC = ["--group_size", "2", "--max_turns", "3", "--max_new_tokens_per_turn", "16", "--max_tokens", "128",
        "--test_size", "2", "--warm_start_steps", "2", "--warm_start_batch_size", "2"]


def scripted_search_agent(tokenizer):
    """Model output for train_search.py, by the conversation so far: first turns cycle through a
    search (the retrieval server is down: a tool failure), text that never stops (cut at max_tokens),
    the gold answer, and a half-right answer (F1 > 0, exact match 0: a verdict/reward mismatch)."""
    from lib.scripted_server import Reply, continuing
    from lib.wiki_data import default_wiki_dir
    from lib.wiki_data import read_qa as read_jsonl

    golds = {}
    for split in ("train", "test"):
        golds.update({r["question"]: r["answer"][0] for r in read_jsonl(os.path.join(default_wiki_dir(seed=0), f"{split}.jsonl"))})
    first_turns = [0]

    def reply(body):
        text = tokenizer.decode(body["input_ids"])
        question = re.search(r"Question: (.*?)\n", text).group(1)
        gold = golds.get(question, "Pem Varo")
        search = f"<think> look it up </think>\n<search> {question} </search>"
        so_far = text.rsplit("<|im_start|>assistant\n", 1)[-1]
        turn = so_far.rsplit("</information>\n\n", 1)[-1]  # this turn's text so far (the client fetches it in pieces)
        if "lorem" in turn:
            return Reply("lorem ipsum " * 40)
        if turn:
            return continuing(search, tokenizer)(body)
        if "<information>" in so_far:
            return Reply(f"<answer> {gold} </answer>", eos=True)
        first_turns[0] += 1
        return [continuing(search, tokenizer)(body), Reply("lorem ipsum " * 40),
                Reply(f"<answer> {gold} </answer>", eos=True),
                Reply(f"<answer> {gold.split()[0]} Zzyzx </answer>", eos=True)][first_turns[0] % 4]
    return [reply]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer):
    """Two-step runs of each script at once: search async against a scripted model with its retrieval
    server down, reflect sync and async, calc sync (the tiny model on the CPU server)."""
    from lib.scripted_server import ScriptedServer

    root = tmp_path_factory.mktemp("viewer_runs")
    dirs = {name: str(root / name) for name in ("search_async", "reflect_sync", "reflect_async", "calc_sync")}
    with ScriptedServer(tokenizer, scripted_search_agent(tokenizer)) as scripted:
        commands = {
            "search_async": ["train_search.py", "--mode", "async", "--server", "external", "--server_addrs",
                             json.dumps([scripted.address]), "--retrieval_addr", "http://127.0.0.1:9",
                             "--tool_retries", "1", *SEARCH],
            "reflect_sync": ["train_reflect.py", "--config", "configs/reflect_tiny.yaml", *REFLECT],
            "reflect_async": ["train_reflect.py", "--config", "configs/reflect_tiny.yaml", "--mode", "async", *REFLECT],
            "calc_sync": ["train_calc.py", *CALC],
        }
        procs = {name: subprocess.Popen([sys.executable, *cmd, "--run_dir", dirs[name], *TINY], cwd=REPO,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for name, cmd in commands.items()}
        try:
            for name, proc in procs.items():
                out, _ = proc.communicate(timeout=600)
                assert proc.returncode == 0, f"{name}: {out[-3000:]}"
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
    return dirs


def trace_rows(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "traces.jsonl"))]


@pytest.mark.slow
def test_every_script_traces_both_log_probs_of_every_generated_token_after_its_log_prob_pass(runs):
    for name, run_dir in runs.items():
        rows = trace_rows(run_dir)
        group_size = 4 if name.startswith("search") else 2
        assert sorted({r["step"] for r in rows}) == [1, 2], name
        assert len(rows) == 2 * 2 * group_size, name  # trace_groups 2 of batch_size 2, every step
        current_policy_gaps = []
        for r in rows:
            tokens = r["tokens"]
            n = len(tokens["id"])
            assert n and all(len(tokens[k]) == n for k in ("text", "mask", "lp", "tlp", "ver")), name
            assert any(tokens["mask"]) and r["turns"][0]["role"] == "model", name
            assert all(v >= 0 for v, m in zip(tokens["ver"], tokens["mask"]) if m), name
            # tokens sampled by the policy the trainer held at the log-prob pass (version step - 1; async
            # runs also train on older ones)
            current_policy_gaps += [abs(t - s) for t, s, m, v in zip(tokens["tlp"], tokens["lp"], tokens["mask"],
                                                                     tokens["ver"]) if m and v == r["step"] - 1]
        if not name.startswith("search"):  # the tiny model on the CPU server: trainer and server agree there
            assert current_policy_gaps and max(current_policy_gaps) < 1e-3, name
        rewards = {}
        for r in rows:
            rewards.setdefault((r["step"], r["group"]), []).append((r["reward"], r["advantage"]))
        for group in rewards.values():  # advantages are the group's rewards, centred
            (r0, a0), *rest = group
            assert all((r > r0) == (a > a0) for r, a in rest)
    reflect = trace_rows(runs["reflect_sync"])
    assert {t["role"] for r in reflect for t in r["turns"]} <= {"model", "reflection"}


@pytest.mark.slow
def test_the_search_run_traces_tool_failures_truncations_and_mismatches(runs):
    rows = trace_rows(runs["search_async"])
    assert any(r["tool_failures"] and any("search tool failed" in t["text"] for t in r["turns"] if t["role"] == "tool")
               for r in rows)
    assert any(r["finish"] == "max_tokens" for r in rows) and any(r["finish"] == "answer" for r in rows)
    assert any(is_mismatch(r) for r in rows)
    assert any(r["tokens"]["tlp"] is not None and r["advantage"] != 0 for r in rows)


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def playwright_missing() -> bool:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return True
    return False


@pytest.mark.slow
@pytest.mark.skipif(chromium() is None, reason="no chromium (apt-get install chromium)")
@pytest.mark.skipif(playwright_missing(), reason="no playwright (pip install playwright)")
def test_the_page_renders_plots_and_trajectories_of_every_run_in_a_headless_browser(runs, tmp_path):
    from playwright.sync_api import sync_playwright

    server = make_server(list(runs.values()), port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        start = time.time()
        urllib.request.urlopen(base, timeout=60).read()
        served_s = time.time() - start
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 2200})

            def dom(url: str) -> str:
                page.goto(url)
                page.wait_for_function("document.querySelectorAll('.plot .main-svg').length >= 10", timeout=30_000)
                return page.content()

            for i, name in enumerate(runs):  # the latest step of each run
                html = dom(f"{base}?run={i}&step=all" if name.startswith(("search", "reflect_sync")) else f"{base}?run={i}")
                assert html.count('class="main-svg"') >= 10, name  # Plotly drew the panels (two svgs per plot)
                assert 'data-title="reward"' in html and 'data-title="step time (s)"' in html
                assert re.search(r'class="group" data-step="2"', html), name
                assert 'class="turn model"' in html and 'class="tok"' in html, name
                if name.startswith("search"):  # every episode of both steps; tool output has loss mask 0
                    assert html.count('class="episode"') == 16 and 'class="turn tool"' in html
                    assert 'class="tok masked"' in html and "search tool failed" in html
                    assert "tool failure" in html and "max_tokens" in html
                elif name.startswith("reflect_sync"):
                    assert html.count('class="episode"') == 8 and 'class="turn reflection"' in html
                else:
                    assert html.count('class="episode"') == 4 and 'class="group" data-step="1"' not in html
            truncated = dom(f"{base}?run=0&step=all&finish=max_tokens&failures=&colour=gap")
            assert 'data-finish="max_tokens"' in truncated and 'data-finish="answer"' not in truncated
            shots = SCREENSHOT_DIR or str(tmp_path)
            path = os.path.join(shots, "viewer.png")
            dom(base + "?run=0&step=2")
            page.screenshot(path=path)
            browser.close()
        assert os.path.getsize(path) > 20_000, "a blank screenshot"
        print(f"page served in {served_s:.2f} s; screenshots in {shots}")
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_mlflow_backend_logs_metrics_and_one_trace_per_episode(runs, tmp_path):
    mlflow = pytest.importorskip("mlflow")
    from lib.metrics import MetricsLogger

    records = trace_rows(runs["calc_sync"])[:4]
    logger = MetricsLogger(str(tmp_path), {"lr": 1e-4}, tensorboard=False, mlflow=True)
    logger.log(1, {"rollout/reward": 0.5})
    logger.log_traces(1, records)
    run_id = mlflow.active_run().info.run_id
    logger.close()
    client = mlflow.MlflowClient()
    assert [m.value for m in client.get_metric_history(run_id, "rollout/reward")] == [0.5]
    traces = mlflow.search_traces(locations=[client.get_run(run_id).info.experiment_id], return_type="list")
    assert len(traces) == 4
    for trace in traces:  # an episode span, then one span per turn
        spans = [s.name for s in trace.data.spans]
        assert re.fullmatch(r"step 1 group [01] episode [01]", spans[0]) and "model" in spans[1:]
    assert "traces/step_000001.json" in [a.path for a in client.list_artifacts(run_id, "traces")]
    assert os.path.exists(tmp_path / "mlflow.db") and os.path.isdir(tmp_path / "mlflow-artifacts")  # all in the run dir
