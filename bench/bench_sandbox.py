"""Time of one trivial sandboxed run (`print(1+1)`): a warm interpreter that forks per run (what
lib.sandbox ships) against a fresh interpreter per run (`warm=False`), with the same guarantees.

    python bench/bench_sandbox.py [--runs 50] [--concurrency 16]

Rows: bare `python -I -S -c` with no sandbox (the floor of a fresh process), run_python warm and
fresh, arun_python warm back to back on one event loop; then `--concurrency` arun_python calls at
once (runs/s). The modes take turns, run by run, so that a machine whose load changes (a shared
box) weighs on each alike; one warm-up call of each is excluded. Prints a markdown table.
"""
import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from lib.sandbox import SANDBOX_ENV, arun_python, run_python  # noqa: E402

CODE = "print(1+1)"


def times_ms(modes: dict, runs: int) -> dict[str, list[float]]:
    for fn in modes.values():
        fn()  # warm-up: starts the warm interpreter, fills the page cache
    out = {name: [] for name in modes}
    for _ in range(runs):
        for name, fn in modes.items():
            start_s = time.perf_counter()
            fn()
            out[name].append((time.perf_counter() - start_s) * 1000)
    return out


def row(name: str, ms: list[float]) -> str:
    p90 = statistics.quantiles(ms, n=10)[-1]
    return f"| {name} | {statistics.median(ms):.1f} | {p90:.1f} | {len(ms)} |"


def check(result):
    assert result.stdout == "2\n" and result.returncode == 0, result
    return result


async def concurrent_runs_per_s(concurrency: int, rounds: int) -> float:
    await arun_python(CODE)
    start_s = time.perf_counter()
    for _ in range(rounds):
        for r in await asyncio.gather(*[arun_python(CODE, timeout_s=30) for _ in range(concurrency)]):
            check(r)
    return concurrency * rounds / (time.perf_counter() - start_s)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--concurrency", type=int, default=16)
    args = p.parse_args()
    bare = [sys.executable, "-I", "-S", "-c", CODE]
    loop = asyncio.new_event_loop()
    modes = {
        "bare `python -I -S -c` (no sandbox)": lambda: subprocess.run(bare, capture_output=True, env=SANDBOX_ENV,
                                                                      check=True),
        "run_python, warm interpreter forks per run (shipped)": lambda: check(run_python(CODE)),
        "run_python(warm=False), fresh interpreter per run": lambda: check(run_python(CODE, warm=False)),
        "arun_python, warm, back to back on one loop": lambda: check(loop.run_until_complete(arun_python(CODE))),
    }
    rows = [row(name, ms) for name, ms in times_ms(modes, args.runs).items()]
    print(f"trivial run `{CODE}`, {os.cpu_count()} CPUs, isolation: {run_python(CODE).isolation}\n")
    print("| mode | median ms | p90 ms | runs |\n| --- | --- | --- | --- |")
    print("\n".join(rows))
    per_s = asyncio.run(concurrent_runs_per_s(args.concurrency, rounds=3))
    print(f"\n{args.concurrency} concurrent arun_python (warm): {per_s:.0f} runs/s")


if __name__ == "__main__":
    main()
