"""Per-question evaluation records, and the paired comparison of two evaluations of the same questions.

An evaluation's mean alone cannot tell a gain from noise on a few hundred questions: one standard
error of the difference of two independent means is ~0.04 at 300 questions and accuracy 0.3. The
same questions before and after training are paired, and the paired difference is much tighter when
most answers do not change. Each run writes `evals/{split}_step{N}.jsonl` (one row per question:
question, gold, the parsed answer, reward, tool calls, turns, finish) and, after the final test,
prints the paired difference against the test before the first step with a 95% interval, and the
same within each category when the items carry a `category` field.
"""
import json
import math
import os


def write_records(path: str, episodes: list[dict]) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        for e in episodes:
            f.write(json.dumps({
                "question": e.get("question"), "gold": e.get("gold"), "answer": e.get("answer"),
                "reward": float(e["rewards"].item()), "tool_calls": e.get("num_tool_calls", 0),
                "tool_failures": e.get("num_tool_failures", 0), "turns": e.get("num_turns", 0),
                "finish_reason": e.get("finish_reason"), "category": e.get("category"),
            }, default=str) + "\n")
    os.replace(tmp, path)
    return path


def record_evaluation(run_dir: str, split: str, step: int, episodes: list[dict]) -> dict:
    """Write this evaluation's records; a test after the first step is compared, paired, with the
    test before it (when the run made one: test_at_start), printed, and returned as metrics."""
    path = write_records(os.path.join(run_dir, "evals", f"{split}_step{step}.jsonl"), episodes)
    start = os.path.join(run_dir, "evals", f"{split}_step0.jsonl")
    if split != "test" or step == 0 or not os.path.exists(start):
        return {}
    before, after = read_records(start), read_records(path)
    paired = paired_difference(before, after)
    print(f"{split} after {step} steps, paired with the {split} before the first step: {describe(paired)}", flush=True)
    categories = sorted({str(r["category"]) for r in after if r.get("category") is not None})
    for category in categories:  # items that name a category: the same comparison within each
        inside = lambda records: [r for r in records if str(r.get("category")) == category]  # noqa: E731
        print(f"  {category}: {describe(paired_difference(inside(before), inside(after)))}", flush=True)
    return {f"paired_{k}": paired[k] for k in ("diff", "ci95_low", "ci95_high", "up", "down") if k in paired}


def read_records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def paired_difference(before: list[dict], after: list[dict]) -> dict:
    """Mean reward after minus before over the questions both evaluated (matched by question text,
    each question once), with a 95% normal interval of the paired mean difference, and how many
    questions went up and down."""
    first = {}
    for r in before:
        first.setdefault(r["question"], r["reward"])
    pairs, seen = [], set()
    for r in after:
        if r["question"] in first and r["question"] not in seen:
            seen.add(r["question"])
            pairs.append((first[r["question"]], r["reward"]))
    n = len(pairs)
    if n == 0:
        return {"n": 0}
    diffs = [a - b for b, a in pairs]
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    half = 1.96 * math.sqrt(var / n)
    return {"n": n, "before": sum(b for b, _ in pairs) / n, "after": sum(a for _, a in pairs) / n,
            "diff": mean, "ci95_low": mean - half, "ci95_high": mean + half,
            "up": sum(d > 0 for d in diffs), "down": sum(d < 0 for d in diffs)}


def describe(paired: dict) -> str:
    if not paired.get("n"):
        return "no question in common"
    return (f"{paired['before']:.3f} -> {paired['after']:.3f} on the same {paired['n']} questions: "
            f"{paired['diff']:+.3f} (95% interval {paired['ci95_low']:+.3f} .. {paired['ci95_high']:+.3f}); "
            f"{paired['up']} up, {paired['down']} down")
