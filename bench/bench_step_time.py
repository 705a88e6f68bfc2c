"""Step-time breakdown (rollout / logp / update / sync) of train_search.py (or train_reflect.py) runs, from their metrics.jsonl,
as a markdown table; one row per run. The first `--skip` steps (start-up: CUDA graphs, allocator, NCCL
communicators) are left out; the rest are summarised by their median.

    python bench/bench_step_time.py "sync, 1 s tool latency=runs/a" "async=runs/b" [--skip 1]

Columns: steps timed; median seconds of the whole step and of each phase (in async mode "rollout" is
the wait for ready groups, the rest of the rollout overlaps the update); steps/s and trained
episodes/s (1 / median step x episodes per step); generated tokens per step; token staleness max;
groups dropped as stale (whole run); on GPUs the trainer's peak memory, what it holds between updates
(while the server generates) and the GPU's least free memory. `--per-step` then lists every step of each run (a slow step after
the first is a recompile or a stall the median hides).
"""
import argparse
import json
import os
import statistics


def read_steps(run_dir: str) -> list[dict]:
    """The per-step rows of a run's metrics.jsonl (evaluation rows left out)."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    return [r for r in rows if "perf/step_s" in r]


def summarize(steps: list[dict], skip: int) -> dict:
    timed = steps[skip:] or steps
    # train_reflect.py logs no episodes / tool calls: those columns read nan for its runs
    med = lambda key: statistics.median(r.get(key, float("nan")) for r in timed)  # noqa: E731
    episodes = med("rollout/episodes")
    return {
        "steps": len(timed), "step_s": med("perf/step_s"), "rollout_s": med("perf/rollout_s"),
        "logp_s": med("perf/logp_s"), "update_s": med("perf/update_s"), "sync_s": med("perf/sync_s"),
        "steps_per_s": 1 / med("perf/step_s"), "episodes_per_s": episodes / med("perf/step_s"),
        "gen_tokens": med("rollout/gen_tokens"), "tool_calls": med("rollout/tool_calls"),
        "staleness_max": max(r.get("rollout/staleness_max", 0) for r in timed),
        "dropped_stale": steps[-1].get("rollout/dropped_stale_groups", 0) if steps else 0,
        "wasted_tokens": sum(r.get("rollout/wasted_tokens", 0) for r in steps),
        # async step times swing (a step may find its groups ready or wait for them): the sum is fairer
        "timed_total_s": sum(r.get("perf/step_s", float("nan")) for r in timed),
        "episodes_per_step": episodes, "trained_tokens_per_s": med("perf/trained_tokens_per_s"),
        # GPU runs: the trainer's high-water mark (max over timed steps) and the GPU's least free memory
        "trainer_peak_gb": max(r.get("perf/trainer_peak_mem_gb", float("nan")) for r in timed),
        "gpu_free_gb": min(r.get("perf/gpu_free_gb", float("nan")) for r in timed),
        "trainer_between_gb": max(r.get("perf/trainer_mem_gb", float("nan")) for r in timed),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="LABEL=RUN_DIR (or RUN_DIR)")
    p.add_argument("--skip", type=int, default=1, help="leading steps left out of the medians")
    p.add_argument("--json", default=None, help="also write the summaries here")
    p.add_argument("--per-step", action="store_true", help="also list every step of each run")
    args = p.parse_args()
    out = {}
    print("| run | steps timed | timed steps total s | step s | rollout s | logp s | update s | sync s | steps/s | episodes/s | "
          "gen tokens/step | trained tokens/s | tool calls/episode | staleness max | dropped stale groups | wasted tokens | "
          "trainer peak GB | trainer GB between updates | GPU free GB (least) |")
    print("| --- |" + " ---: |" * 18)
    steps_of = {}
    for spec in args.runs:
        label, _, run_dir = spec.rpartition("=")
        label = label or run_dir
        try:
            steps_of[label] = read_steps(run_dir)
            s = summarize(steps_of[label], args.skip)
        except (OSError, KeyError, ValueError, statistics.StatisticsError) as e:
            print(f"| {label} | no steps ({type(e).__name__}: {e}) |")
            continue
        out[label] = s
        print(f"| {label} | {s['steps']} | {s['timed_total_s']:.1f} | {s['step_s']:.2f} | {s['rollout_s']:.2f} | {s['logp_s']:.2f} | "
              f"{s['update_s']:.2f} | {s['sync_s']:.3f} | {s['steps_per_s']:.3f} | {s['episodes_per_s']:.1f} | "
              f"{s['gen_tokens']:.0f} | {s['trained_tokens_per_s']:.0f} | {s['tool_calls']:.2f} | "
              f"{s['staleness_max']:.0f} | {s['dropped_stale']} | {s['wasted_tokens']:.0f} | {s['trainer_peak_gb']:.1f} | {s['trainer_between_gb']:.1f} | {s['gpu_free_gb']:.1f} |")
    if args.per_step:
        for label, steps in steps_of.items():
            print_steps(label, steps)
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


def print_steps(label: str, steps: list[dict]) -> None:
    print(f"\n{label}: step | step s | rollout s | logp s | update s | sync s | trainer peak GB | tokens/episode | "
          f"micro-batches | log-prob gap mean")
    for r in steps:
        print(f"  {r['step']} | {r['perf/step_s']:.1f} | {r['perf/rollout_s']:.1f} | {r['perf/logp_s']:.1f} | "
              f"{r['perf/update_s']:.1f} | {r['perf/sync_s']:.2f} | "
              f"{r.get('perf/trainer_peak_mem_gb', float('nan')):.1f} | {r.get('rollout/seq_len', float('nan')):.0f} | "
              f"{r.get('loss/num_micro_batches', float('nan')):.0f} | "
              f"{r.get('logprob/server_trainer_abs_diff_mean', float('nan')):.3f}")


if __name__ == "__main__":
    main()
