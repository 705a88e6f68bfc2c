"""bench/bench_trl_reward.py's report mode on synthetic runs: the clocks, the final reward, the crossing."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "bench_trl_reward.py")

TRL_REWARDS = [0.0, 0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.5, 0.6, 0.6]  # final (last 5) = 0.52; 10 s a step
# A lucky first step (0.9) must not count: no full window behind it. The smoothed reward first
# reaches 0.52 at step 8 ((0.2 + 4 x 0.7) / 5 = 0.6), at 8 x 3 s = 24 s: 0.24 x TRL's 100 s.
OURS_REWARDS = [0.9, 0.2, 0.2, 0.2, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_trl_reward", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_runs(tmp_path, ours_rewards):
    trl = tmp_path / "trl.jsonl"
    rows = [{"settings": {"batch_size": 8}}]
    rows += [{"step": i + 1, "wall_s": 10.0 * (i + 1), "step_s": 10.0, "reward": r} for i, r in enumerate(TRL_REWARDS)]
    rows.append({"step": 10, "test/acc_turn1": 0.3})
    trl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "ours"
    run.mkdir()
    # 40 s of start-up and step-0 evaluation before the first step, then 3 s a step; a test row at the end
    rows = [{"step": 0, "time/wall_s": 40.0, "eval/acc_turn1": 0.1}]
    rows += [{"step": i + 1, "time/wall_s": 40.0 + 3.0 * (i + 1), "perf/step_s": 3.0, "rollout/reward": r}
             for i, r in enumerate(ours_rewards)]
    rows.append({"step": 10, "time/wall_s": 99.0, "test/acc_turn1": 0.4})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(trl), str(run)


def test_ours_clock_starts_at_the_first_step_and_skips_eval_rows(tmp_path):
    bench = load_bench()
    _, run = write_runs(tmp_path, OURS_REWARDS)
    for clock in ("wall", "steps"):
        ours = bench.read_ours(run, clock)
        assert ours["wall_s"] == pytest.approx([3.0 * (i + 1) for i in range(10)])
        assert ours["reward"] == OURS_REWARDS and ours["test_acc"] == 0.4


def test_crossing_is_the_first_full_window_that_reaches_trl_final_reward(tmp_path):
    bench = load_bench()
    trl_path, run = write_runs(tmp_path, OURS_REWARDS)
    summary = bench.compare(bench.read_ours(run), bench.read_trl(trl_path), window=5)
    assert summary["trl"]["final_reward"] == pytest.approx(0.52)
    assert summary["trl"]["wall_s"] == 100.0 and summary["ours"]["wall_s"] == pytest.approx(30.0)
    assert summary["crossing"]["step"] == 8
    assert summary["crossing"]["wall_s"] == pytest.approx(24.0)
    assert summary["crossing"]["ratio_to_trl_wall"] == pytest.approx(0.24)
    assert summary["third_or_less"]


def test_a_run_that_never_reaches_trl_final_reward_has_no_crossing(tmp_path):
    bench = load_bench()
    trl_path, run = write_runs(tmp_path, [0.1] * 10)
    summary = bench.compare(bench.read_ours(run), bench.read_trl(trl_path), window=5)
    assert summary["crossing"] is None and not summary["third_or_less"]
    assert "never reaches" in bench.markdown(summary, 5, "wall")


def test_report_mode_prints_the_table_and_writes_the_summary(tmp_path):
    trl_path, run = write_runs(tmp_path, OURS_REWARDS)
    out = tmp_path / "summary.json"
    cmd = [sys.executable, SCRIPT, "--trl-jsonl", trl_path, "--ours", run, "--json", str(out)]
    plotting = importlib.util.find_spec("matplotlib") is not None
    if plotting:
        cmd += ["--plot", str(tmp_path / "reward.png")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "| agentrl train_reflect.py | 10 | 30.0 | 3.00 | 0.440 | 0.700 | 0.400 |" in result.stdout
    assert "| TRL GRPOTrainer | 10 | 100.0 | 10.00 | 0.120 | 0.520 | 0.300 |" in result.stdout
    assert "Within a third of TRL's wall-clock: yes." in result.stdout
    assert json.loads(out.read_text())["crossing"]["step"] == 8
    if plotting:
        assert (tmp_path / "reward.png").stat().st_size > 10_000
