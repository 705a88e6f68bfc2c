"""Each tool's worth on a real model, from the runs of `bench/gpu_smollm2.sh tools`: per run, the test
before GRPO (the warm start alone) and after, paired on the same questions (95% interval), the share
of test episodes that call the tool, tool calls per episode, and for search the share of answers
whose words appear in a result the agent read. Prints a markdown table; --plot draws the dev curves.

    python bench/tool_worth.py RUNS_DIR [--plot docs/smollm2_tools.png]
RUNS_DIR holds one folder per run (metrics.jsonl, evals/test_step*.jsonl), named TASK[_VARIANT]_sSEED.
"""
import argparse
import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lib.eval_records import paired_difference, read_records  # noqa: E402


def summarize(run_dir: str) -> dict | None:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    tests = sorted(glob.glob(os.path.join(run_dir, "evals", "test_step*.jsonl")),
                   key=lambda p: int(re.search(r"step(\d+)", p).group(1)))
    if len(tests) < 2:
        return None
    before, after = read_records(tests[0]), read_records(tests[-1])
    last_test = [r for r in rows if any(k.startswith("test/") for k in r)][-1]
    first_test = [r for r in rows if any(k.startswith("test/") for k in r)][0]
    share = lambda records: sum(r["tool_calls"] > 0 for r in records) / len(records)  # noqa: E731
    calls = lambda records: sum(r["tool_calls"] for r in records) / len(records)  # noqa: E731
    dev_key = "eval/accuracy" if any("eval/accuracy" in r for r in rows) else "eval/exact_match"
    return {"run": os.path.basename(run_dir.rstrip("/")), "paired": paired_difference(before, after),
            "share_before": share(before), "share_after": share(after),
            "calls_before": calls(before), "calls_after": calls(after),
            "evidence_before": first_test.get("test/answer_in_evidence"),
            "evidence_after": last_test.get("test/answer_in_evidence"),
            "dev": [(r["step"], r[dev_key]) for r in rows if dev_key in r]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("runs_dir")
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    results = [s for d in sorted(glob.glob(os.path.join(args.runs_dir, "*/"))) if os.path.exists(
        os.path.join(d, "metrics.jsonl")) and (s := summarize(d))]
    print("| run | test before GRPO (warm start alone) → after | paired difference (95% interval), questions up/down "
          "| episodes calling the tool, before → after | tool calls per episode | answers with evidence |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for s in results:
        q = s["paired"]
        evidence = (f"{s['evidence_before']:.3f} → {s['evidence_after']:.3f}" if s["evidence_before"] is not None
                    else "–")
        print(f"| {s['run']} | {q['before']:.3f} → **{q['after']:.3f}** | {q['diff']:+.3f} ({q['ci95_low']:+.3f} .. "
              f"{q['ci95_high']:+.3f}), {q['up']}/{q['down']} | {s['share_before']:.2f} → {s['share_after']:.2f} | "
              f"{s['calls_before']:.2f} → {s['calls_after']:.2f} | {evidence} |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        tasks = sorted({s["run"].split("_")[0] for s in results})
        fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.6), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            for s in (s for s in results if s["run"].split("_")[0] == task):
                steps, values = zip(*s["dev"])
                style = "--" if "notool" in s["run"] else (":" if "_ws" in s["run"] else "-")
                ax.plot(steps, values, style, marker="o", markersize=3, label=s["run"])
            ax.set_title(task)
            ax.set_xlabel("GRPO step")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        axes[0][0].set_ylabel("dev accuracy / EM (greedy)")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=90)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
