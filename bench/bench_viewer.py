"""The viewer's load at 2 runs × 2,000 steps: bytes and seconds of the first page, of its series
(/api/series) and of a refresh after one more step, served and in headless Chromium.

    python bench/bench_viewer.py                 # builds two synthetic runs in a temp dir, prints a table
    python bench/bench_viewer.py --steps 500     # smaller

The runs are synthetic (written here, no model): per step one metrics row of ~45 numbers (the names
the scripts log, plus a fork's `tool/*`), one traced group of 4 episodes of ~120 tokens.
"""
import argparse
import gzip
import json
import math
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lib.viewer import make_server  # noqa: E402
from lib.viewer_data import PANELS  # noqa: E402

METRIC_NAMES = [k for _, keys in PANELS for k in keys] + [
    "loss/pg", "loss/entropy", "loss/clip_fraction", "loss/grad_norm", "tool/calls", "tool/failures"]


def write_run(run_dir: str, steps: int, seed: int):
    rng = random.Random(seed)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for step in range(1, steps + 1):
            row = {"step": step, "time/wall_s": round(step * 2.5 + rng.random(), 2)}
            row.update({k: round(rng.random() * (1 + step / steps), 4) for k in METRIC_NAMES})
            f.write(json.dumps(row) + "\n")
    with open(os.path.join(run_dir, "traces.jsonl"), "w") as f:
        for step in range(1, steps + 1):
            for index in range(4):
                n = 70
                text = [f" w{rng.randrange(500)}" for _ in range(n)]
                mask = [1 if i % 30 < 20 else 0 for i in range(n)]
                lp = [round(-rng.random(), 4) if m else 0 for m in mask]
                f.write(json.dumps({
                    "step": step, "group": 0, "index": index, "question": f"question {step % 50}", "gold": "42",
                    "answer": "42", "reward": float(index % 2), "advantage": index % 2 - 0.5, "finish": "answer",
                    "correct": None, "tool_failures": 0, "stats": {}, "prompt": "Question: ...\n",
                    "turns": [{"role": "model", "start": 0, "end": n, "text": "".join(text)}],
                    "tokens": {"id": list(range(n)), "text": text, "mask": mask, "lp": lp, "tlp": lp,
                               "ver": [step - 1 if m else -1 for m in mask]}}) + "\n")


def timed_get(url: str, gzipped: bool = False) -> tuple[float, int, bytes]:
    """Seconds, bytes on the wire and the body; `gzipped`: ask for gzip, as a browser does."""
    start = time.perf_counter()
    request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"} if gzipped else {})
    with urllib.request.urlopen(request, timeout=120) as response:
        body = response.read()
        sent = len(body)
        if response.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
    return time.perf_counter() - start, sent, body


def browser_load(url: str) -> dict | None:
    """Headless Chromium (Playwright) on `url`, twice (the second with Plotly's script cached, as on
    every visit after the first): seconds from navigation to the first paint, to Plotly's script run
    and to every panel in view drawn, and the longest task (the page frozen) on the way; None without
    playwright or chromium."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        return None
    out = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.add_init_script("window.longest_task_ms = 0; new PerformanceObserver(list => { for (const e of "
                             "list.getEntries()) window.longest_task_ms = Math.max(window.longest_task_ms, e.duration); "
                             "}).observe({type: 'longtask', buffered: true});")
        for visit in ("first", "cached"):
            page.goto("about:blank")
            page.goto(url)
            page.wait_for_function("performance.getEntriesByName('viewer:panels-drawn').length > 0", timeout=60_000)
            out[visit] = page.evaluate("""() => ({
                paint_s: performance.getEntriesByName('first-contentful-paint')[0].startTime / 1000,
                plotly_s: performance.getEntriesByName('viewer:plotly-ready')[0].startTime / 1000,
                drawn_s: performance.getEntriesByName('viewer:panels-drawn')[0].startTime / 1000,
                panels: document.querySelectorAll('.plot .main-svg').length / 2,
                longest_task_s: window.longest_task_ms / 1000})""")
        browser.close()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench_viewer_")
    dirs = [os.path.join(root, name) for name in ("run_a", "run_b")]
    for i, d in enumerate(dirs):
        write_run(d, args.steps, seed=i)
    sizes = [os.path.getsize(os.path.join(d, name)) for d in dirs for name in ("metrics.jsonl", "traces.jsonl")]
    server = make_server(dirs, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    rows = []
    try:
        s, n, _ = timed_get(base + "/")
        rows.append(("first page (HTML, latest step's episodes), cold: indexes both files", s, n))
        s, n, _ = timed_get(base + "/")
        rows.append(("page again (nothing appended)", s, n))
        s, n, _ = timed_get(base + "/", gzipped=True)
        rows.append(("page again, gzipped", s, n))
        series = []
        total_s = total_n = 0
        for i in range(len(dirs)):
            s, n, body = timed_get(f"{base}/api/series?run={i}")
            series.append(json.loads(body))
            total_s, total_n = total_s + s, total_n + n
        rows.append(("series of both runs (/api/series, every step)", total_s, total_n))
        total_s = total_n = 0
        for i in range(len(dirs)):
            s, n, _ = timed_get(f"{base}/api/series?run={i}", gzipped=True)
            total_s, total_n = total_s + s, total_n + n
        rows.append(("the same, gzipped (a browser asks for it)", total_s, total_n))
        with open(os.path.join(dirs[0], "metrics.jsonl"), "a") as f:  # the trainer writes one more step
            f.write(json.dumps({"step": args.steps + 1, "rollout/reward": 0.5, "time/wall_s": 1e4}) + "\n")
        total_s = total_n = 0
        for i, payload in enumerate(series):
            s, n, _ = timed_get(f"{base}/api/series?run={i}&since={payload['rows']}&generation={payload['generation']}")
            total_s, total_n = total_s + s, total_n + n
        rows.append(("refresh of the series after one more step (since=rows)", total_s, total_n))
        s, n, _ = timed_get(base + "/?step=all")
        rows.append(("page of every step's episodes (64 newest shown)", s, n))
        s, n, _ = timed_get(base + "/?step=all&q=w499")
        rows.append(("text search over every step's episodes", s, n))
        load = browser_load(base + "/")
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(root)
    print(f"2 runs × {args.steps} steps: metrics.jsonl {sizes[0] / 1e6:.2f} MB, traces.jsonl {sizes[1] / 1e6:.1f} MB each")
    print("| request | seconds | bytes |\n| --- | --- | --- |")
    for what, s, n in rows:
        print(f"| {what} | {s:.3f} | {n:,} |")
    for visit, m in (load or {}).items():
        print(f"| headless Chromium, {visit} visit: first paint (header, episodes) | {m['paint_s']:.2f} | |")
        print(f"| headless Chromium, {visit} visit: Plotly's script run | {m['plotly_s']:.2f} | |")
        print(f"| headless Chromium, {visit} visit: the {m['panels']:.0f} panels in view drawn | {m['drawn_s']:.2f} | |")
        print(f"| headless Chromium, {visit} visit: longest task (page frozen) | {m['longest_task_s']:.2f} | |")
    if load is None:
        print("| headless Chromium | n/a (no playwright or chromium) | |")
    assert all(math.isfinite(s) for _, s, _ in rows)


if __name__ == "__main__":
    main()
