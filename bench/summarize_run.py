"""Print a training run's curve from its metrics.jsonl as a markdown table: step, wall time,
rollout reward, and the evaluation rows (dev at eval steps, test at the end).

    python bench/summarize_run.py runs/search_tiny/metrics.jsonl
"""
import json
import sys


def main(path: str):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    eval_keys = sorted({k for r in rows for k in r if k.startswith(("eval/", "test/"))})
    split = lambda k: k.split("/", 1)  # noqa: E731
    metrics = sorted({split(k)[1] for k in eval_keys})
    print("| step | wall s | split | rollout reward (mean of steps since last eval) | " + " | ".join(metrics) + " |")
    print("| ---: | ---: | --- | ---: | " + " | ".join("---:" for _ in metrics) + " |")
    rewards = []
    for r in rows:
        if "rollout/reward" in r:
            rewards.append(r["rollout/reward"])
        for prefix in ("eval", "test"):
            if any(k.startswith(prefix + "/") for k in r):
                mean_reward = f"{sum(rewards) / len(rewards):.3f}" if rewards else "-"
                vals = " | ".join(f"{r.get(f'{prefix}/{m}', float('nan')):.3f}" for m in metrics)
                print(f"| {r['step']} | {r['time/wall_s']:.0f} | {'dev' if prefix == 'eval' else 'test'} | {mean_reward} | {vals} |")
                rewards = []
    steps = [r for r in rows if "perf/step_s" in r]
    if steps:
        mean = lambda k: sum(r[k] for r in steps) / len(steps)  # noqa: E731
        print(f"\n{len(steps)} steps; mean step {mean('perf/step_s'):.1f} s (rollout {mean('perf/rollout_s'):.1f}, "
              f"logp {mean('perf/logp_s'):.1f}, update {mean('perf/update_s'):.1f}, sync {mean('perf/sync_s'):.2f}); "
              f"server/trainer log-prob |diff| max over run {max(r['logprob/server_trainer_abs_diff_max'] for r in steps):.2e}")


if __name__ == "__main__":
    main(sys.argv[1])
