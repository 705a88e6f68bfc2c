"""Look inside runs in the browser: plots over steps (several runs overlaid) and a trajectory browser.

    python -m lib.viewer runs/search_tiny [runs/other ...]      # then open http://127.0.0.1:8765
    python -m lib.viewer runs/search_tiny --out page.html       # or one self-contained file

A page served on 127.0.0.1: every request reads the run dirs again (only what was appended), so a
refresh shows a live run's new steps, and only the steps on screen are rendered however long the
run. Plots are Plotly (its JS comes from the pip package: no CDN, works offline); HTML is a Jinja2
template with autoescaping, because model output is untrusted. Everything it needs is in the run
dir (metrics.jsonl, traces.jsonl), so a run copied from another machine is shown the same way.
"""
import argparse
import functools
import html
import math
import os
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jinja2

from lib.viewer_data import PANELS, TraceIndex, filter_entries, is_mismatch, metric_series, read_jsonl_rows

RUN_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
DASHES = ["solid", "dash", "dot", "dashdot", "longdash"]
MAX_EPISODES_SHOWN = 64  # a filter over every step can match thousands


@functools.cache
def plotly_js() -> str:
    import plotly

    with open(os.path.join(os.path.dirname(plotly.__file__), "package_data", "plotly.min.js"), encoding="utf-8") as f:
        return f.read()


@functools.cache
def template() -> jinja2.Template:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(os.path.dirname(__file__)), autoescape=True,
                             undefined=jinja2.StrictUndefined)
    return env.get_template("viewer_page.html")


# --- plots ---
def figures(runs: list[dict]) -> list[dict]:
    """Plotly figures (plain dicts for Plotly.newPlot): one per panel that any run has data for; a
    run is a colour, a metric of the panel a dash style. Metrics no panel names go to `extra`."""
    named = {k for _, keys in PANELS for k in keys}
    panels = list(PANELS)
    extra_keys = sorted({k for run in runs for k in run["series"]
                         if k not in named and not k.startswith(("test/", "time/"))})
    panels += [(k, [k]) for k in extra_keys]
    out = []
    max_step = max((s for run in runs for steps, _ in run["series"].values() for s in steps), default=0)
    for title, keys in panels:
        data, named_keys = [], set()
        for i, run in enumerate(runs):
            present = [k for k in keys if k in run["series"]]
            for key in present:
                steps, values = run["series"][key]
                # the legend names each metric once (its dash style); the page header names the run colours
                data.append({"type": "scatter", "mode": "lines+markers" if len(steps) < 30 else "lines",
                             "x": steps, "y": [v if math.isfinite(v) else None for v in values],
                             "name": key, "legendgroup": key, "showlegend": key not in named_keys,
                             "hovertemplate": f"{run['name']}<br>{key}<br>step %{{x}}: %{{y}}<extra></extra>",
                             "line": {"color": RUN_COLOURS[i % len(RUN_COLOURS)],
                                      "dash": DASHES[keys.index(key) % len(DASHES)]},
                             "marker": {"size": 4}})
                named_keys.add(key)
        if data:
            out.append({"id": f"plot{len(out)}", "title": title, "extra": title in extra_keys, "data": data,
                        "layout": {"title": {"text": title, "font": {"size": 13}}, "height": 230,
                                   "margin": {"l": 45, "r": 10, "t": 28, "b": 20}, "showlegend": True,
                                   "xaxis": {"dtick": 1} if max_step <= 10 else {},
                                   "legend": {"font": {"size": 9}, "orientation": "h", "y": -0.15}}})
    return out


# --- token colours ---
def _mix(white_to: tuple, t: float) -> str:
    t = max(0.0, min(1.0, t))
    r, g, b = (round(255 + (c - 255) * t) for c in white_to)
    return f"#{r:02x}{g:02x}{b:02x}"


def token_colour(mode: str, lp: float, tlp: float | None, masked: bool) -> str:
    """Background of one token: by probability (white = sure, red = unlikely) or by the server-trainer
    gap |Δ log-prob| (white = 0, purple = 0.5 nats or more). Masked tokens have no colour (grey)."""
    if masked:
        return "#e8e8e8"
    if mode == "gap":
        return _mix((150, 60, 200), abs(tlp - lp) / 0.5) if tlp is not None else "#ffffff"
    return _mix((230, 60, 60), 1.0 - math.exp(lp))


def episode_view(record: dict, colour_by: str) -> dict:
    """What the template shows of one trace record: its turns and, per token, text, colour and a
    tooltip. Handles records written before per-token traces (turns only)."""
    tokens = record.get("tokens")
    toks = []
    if tokens:
        tlps = tokens.get("tlp") or [None] * len(tokens["id"])
        for i, (tid, text, m, lp, tlp, ver) in enumerate(zip(tokens["id"], tokens["text"], tokens["mask"],
                                                            tokens["lp"], tlps, tokens["ver"])):
            tip = f"#{i} id {tid} · " + (f"server {lp:.4f} · trainer {tlp:.4f} · Δ {tlp - lp:+.4f} · v{ver}"
                                         if m and tlp is not None else
                                         f"server {lp:.4f} · v{ver}" if m else "loss mask 0 (not trained)")
            toks.append({"text": text, "masked": not m, "bg": token_colour(colour_by, lp, tlp, not m), "tip": tip})
    turns = []
    for turn in record.get("turns", []):
        if isinstance(turn, dict):
            turns.append({"role": turn["role"], "text": turn["text"]})
        elif isinstance(turn, (list, tuple)):  # earlier format: [role, text]
            turns.append({"role": turn[0], "text": turn[1]})
        else:  # earlier format of the reflect task: model texts only
            turns.append({"role": "model", "text": str(turn)})
    gen = [lp for lp, m in zip(tokens["lp"], tokens["mask"]) if m] if tokens else []
    gaps = ([abs(t - lp) for t, lp, m in zip(tokens["tlp"], tokens["lp"], tokens["mask"]) if m]
            if tokens and tokens.get("tlp") else [])
    versions = sorted({v for v, m in zip(tokens["ver"], tokens["mask"]) if m}) if tokens else []
    return {
        "index": record.get("index", 0), "reward": record.get("reward"), "advantage": record.get("advantage"),
        "finish": record.get("finish"), "answer": record.get("answer"), "gold": record.get("gold"),
        "correct": record.get("correct"), "tool_failures": record.get("tool_failures") or 0,
        "mismatch": is_mismatch(record), "stats": record.get("stats", {}),
        "prompt": record.get("prompt", ""), "turns": turns, "tokens": toks,
        "gen_tokens": len(gen), "mean_lp": sum(gen) / len(gen) if gen else None,
        "max_gap": max(gaps) if gaps else None, "versions": versions,
    }


# --- the page ---
def load_run(run_dir: str, indexes: dict) -> dict:
    index = indexes.setdefault(run_dir, TraceIndex(os.path.join(run_dir, "traces.jsonl")))
    index.refresh()
    rows = read_jsonl_rows(os.path.join(run_dir, "metrics.jsonl"))
    series = metric_series(rows)
    last_step = max((r["step"] for r in rows if "rollout/reward" in r), default=None)
    tests = {k[len("test/"):]: v for r in rows for k, v in r.items() if k.startswith("test/")}
    return {"dir": run_dir, "name": os.path.basename(os.path.abspath(run_dir)), "series": series, "index": index,
            "last_step": last_step, "tests": tests}


def _number(value: str):
    try:
        return float(value) if value not in ("", None) else None
    except ValueError:
        return None


def render_page(run_dirs: list[str], query: dict, indexes: dict, plotly_inline: bool = False) -> str:
    """The whole page for `query` (the URL's parameters: run, step, finish, min_reward, max_reward,
    failures, mismatch, colour)."""
    runs = [load_run(d, indexes) for d in run_dirs]
    q = lambda k, default="": query.get(k, [default])[0]  # noqa: E731
    run_i = min(max(int(_number(q("run", "0")) or 0), 0), len(runs) - 1)
    run = runs[run_i]
    steps = run["index"].steps()
    step_arg = q("step", "")
    step = None if step_arg == "all" else int(_number(step_arg)) if _number(step_arg) is not None else (
        steps[-1] if steps else None)
    filters = {"finish": q("finish"), "min_reward": _number(q("min_reward")), "max_reward": _number(q("max_reward")),
               "tool_failures": q("failures") == "1", "mismatch": q("mismatch") == "1"}
    colour_by = "gap" if q("colour") == "gap" else "lp"
    matching = filter_entries(run["index"].entries, step=step, **filters)
    shown = matching[:MAX_EPISODES_SHOWN]
    groups = {}
    for entry, record in zip(shown, run["index"].load(shown)):
        key = (entry["step"], entry["group"])
        if key not in groups:
            groups[key] = {"step": entry["step"], "group": entry["group"], "question": record.get("question"),
                           "gold": record.get("gold"), "episodes": []}
        groups[key]["episodes"].append(episode_view(record, colour_by))
    for g in groups.values():
        rewards = [e["reward"] for e in g["episodes"] if e["reward"] is not None]
        g["mean_reward"] = sum(rewards) / len(rewards) if rewards else None
    finishes = sorted({e["finish"] for e in run["index"].entries if e["finish"]})
    return template().render(
        runs=[{"name": r["name"], "dir": r["dir"], "colour": RUN_COLOURS[i % len(RUN_COLOURS)],
               "last_step": r["last_step"], "traced": len(r["index"].steps()), "tests": r["tests"]}
              for i, r in enumerate(runs)],
        figures=figures(runs), run_i=run_i, steps=steps, step=step_arg if step_arg == "all" else step,
        finishes=finishes, filters=filters, colour_by=colour_by, groups=list(groups.values()),
        test_keys=sorted({k for r in runs for k in r["tests"]}), num_matching=len(matching), num_shown=len(shown), generated=time.strftime("%Y-%m-%d %H:%M:%S"),
        plotly_js=plotly_js() if plotly_inline else None)


# --- the server ---
def make_server(run_dirs: list[str], host: str = "127.0.0.1", port: int = 8765) -> ThreadingHTTPServer:
    indexes, lock = {}, threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            url = urllib.parse.urlparse(self.path)
            if url.path == "/plotly.min.js":
                self._send(200, plotly_js().encode(), "application/javascript", cache=True)
            elif url.path == "/":
                try:
                    with lock:  # the trace indexes are shared between requests
                        page = render_page(run_dirs, urllib.parse.parse_qs(url.query), indexes)
                    self._send(200, page.encode(), "text/html; charset=utf-8")
                except Exception as e:  # a bad file or query: say so on the page, keep serving
                    self._send(500, f"<pre>viewer error: {html.escape(repr(e))}</pre>".encode(), "text/html")
            else:
                self._send(404, b"not found", "text/plain")

        def _send(self, status: int, body: bytes, content_type: str, cache: bool = False):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "max-age=86400" if cache else "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # quiet: one line per request is noise here
            pass

    return ThreadingHTTPServer((host, port), Handler)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m lib.viewer", description=__doc__.split("\n")[0])
    parser.add_argument("run_dirs", nargs="+", help="run directories (metrics.jsonl, traces.jsonl)")
    parser.add_argument("--port", type=int, default=8765, help="0 = any free port")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind; keep 127.0.0.1 and use ssh -L to reach it")
    parser.add_argument("--out", help="write one self-contained HTML file (latest step) instead of serving")
    args = parser.parse_args(argv)
    for d in args.run_dirs:
        if os.path.exists(d) and not os.path.isdir(d):
            parser.error(f"{d} is not a directory: pass run dirs, e.g. runs/search_tiny")
        if not os.path.exists(d):  # a run about to start: shown once it writes there
            print(f"{d} does not exist yet; it is shown once a run writes metrics.jsonl or traces.jsonl there")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(render_page(args.run_dirs, {}, {}, plotly_inline=True))
        print(f"wrote {args.out}")
        return
    server = make_server(args.run_dirs, args.host, args.port)
    print(f"viewer on http://{args.host}:{server.server_address[1]}/ (Ctrl-C stops it); refresh to see new steps",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
