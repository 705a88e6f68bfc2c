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
import ipaddress
import math
import operator
import os
import re
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import compress

import jinja2

from lib.viewer_data import (PANELS, TraceIndex, filter_entries, is_mismatch, is_number, metric_series,
                              read_metrics)

RUN_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
DASHES = ["solid", "dash", "dot", "dashdot", "longdash"]
MAX_EPISODES_SHOWN = 64  # a filter over every step can match thousands
# A token is ~130 bytes of HTML: 2,000 tokens × 64 episodes keeps the worst page near 18 MB; the
# rest of an episode is a link away (?tokens_from=N pages through it).
MAX_TOKENS_SHOWN = 2000
# A browser sends its request at once, even through ssh -L: a connection silent this long (idle,
# or a half-sent request) is closed. Writes are 64 KiB pieces, each within it.
SOCKET_TIMEOUT_S = 5
# Served at once, a thread and a file descriptor each (macOS allows a process 256 by default); more
# wait in the listen queue, at most SOCKET_TIMEOUT_S per round of silent ones ahead of them.
MAX_CONNECTIONS = 128


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
def plotly_text(text: str) -> str:
    """Plotly draws titles, legend names and hover text as a subset of HTML (<b>, <span style>,
    <a href>): metric names and run dir names are anyone's, so they go in as text."""
    return html.escape(text, quote=False)


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
                             "x": steps, "y": values,  # None (a gap) where not finite
                             "name": plotly_text(key), "legendgroup": key, "showlegend": key not in named_keys,
                             "hovertemplate": f"{plotly_text(run['name'])}<br>{plotly_text(key)}<br>"
                                              "step %{x}: %{y}<extra></extra>",
                             "line": {"color": RUN_COLOURS[i % len(RUN_COLOURS)],
                                      "dash": DASHES[keys.index(key) % len(DASHES)]},
                             "marker": {"size": 4}})
                named_keys.add(key)
        if data:
            out.append({"id": f"plot{len(out)}", "title": title, "extra": title in extra_keys, "data": data,
                        "layout": {"title": {"text": plotly_text(title), "font": {"size": 13}}, "height": 230,
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
    return _mix((230, 60, 60), 1.0 - math.exp(min(lp, 0.0)))  # a log-prob above 0 (a bad record) overflows exp


def episode_view(record: dict, colour_by: str, tokens_from: int = 0) -> dict:
    """What the template shows of one trace record (one that passed `trace_problem`): its turns and,
    per token of `MAX_TOKENS_SHOWN` from `tokens_from`, text, colour and a tooltip. Handles records
    written before per-token traces (turns only)."""
    tokens = record.get("tokens")
    toks = []
    num_tokens = len(tokens["id"]) if tokens else 0
    shown = range(min(tokens_from, num_tokens), min(tokens_from + MAX_TOKENS_SHOWN, num_tokens))
    if tokens:
        tlps = tokens.get("tlp") or [None] * num_tokens
        for i in shown:
            tid, text, m, lp, tlp, ver = (tokens["id"][i], tokens["text"][i], tokens["mask"][i], tokens["lp"][i],
                                          tlps[i], tokens["ver"][i])
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
    # Over every token, not only those shown; compress/map keep a 1M-token episode at C speed.
    gen = list(compress(tokens["lp"], tokens["mask"])) if tokens else []
    gaps = (list(map(abs, map(operator.sub, compress(tokens["tlp"], tokens["mask"]), gen)))
            if tokens and tokens.get("tlp") else [])
    versions = sorted(set(compress(tokens["ver"], tokens["mask"]))) if tokens else []
    return {
        "index": record.get("index", 0), "reward": record.get("reward"), "advantage": record.get("advantage"),
        "finish": record.get("finish"), "answer": record.get("answer"), "gold": record.get("gold"),
        "correct": record.get("correct"), "tool_failures": record.get("tool_failures") or 0,
        "mismatch": is_mismatch(record), "stats": record.get("stats", {}),
        "prompt": record.get("prompt", ""), "turns": turns, "tokens": toks, "num_tokens": num_tokens,
        "tokens_from": shown.start, "tokens_after": num_tokens - shown.stop,
        "gen_tokens": len(gen), "mean_lp": sum(gen) / len(gen) if gen else None,
        "max_gap": max(gaps) if gaps else None, "versions": versions,
    }


# --- the page ---
def load_run(run_dir: str, indexes: dict) -> dict:
    # setdefault is atomic: two first requests for a run share one index
    index = indexes.setdefault(run_dir, TraceIndex(os.path.join(run_dir, "traces.jsonl"))).refresh()
    rows, bad_rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    series = metric_series(rows)
    last_step = max((r["step"] for r in rows if "rollout/reward" in r), default=None)
    tests = {k[len("test/"):]: v for r in rows for k, v in r.items() if k.startswith("test/")}
    return {"dir": run_dir, "name": os.path.basename(os.path.abspath(run_dir)), "series": series, "index": index,
            "entries": index.entries, "bad": bad_rows + index.bad, "last_step": last_step,
            "tests": {k: v if is_number(v) or isinstance(v, str) else str(v) for k, v in tests.items()}}


class BadQuery(ValueError):
    """A URL parameter the page cannot use; the server answers 400 with this message."""


def parse_query(query: dict) -> dict:
    """The page's URL parameters (from parse_qs), checked: integers where an integer is meant,
    finite numbers for the reward bounds; a BadQuery names the parameter otherwise."""
    q = lambda k: query.get(k, [""])[0]  # noqa: E731

    def integer(key: str, default=None):
        try:
            return int(q(key)) if q(key) != "" else default
        except ValueError:  # also "nan", "1e309", "1.5" and past 4,300 digits
            raise BadQuery(f"{key} must be an integer, got {q(key)[:40]!r}") from None

    def number(key: str):
        try:
            value = float(q(key)) if q(key) != "" else None
        except ValueError:
            raise BadQuery(f"{key} must be a number, got {q(key)[:40]!r}") from None
        if value is not None and not math.isfinite(value):
            raise BadQuery(f"{key} must be a finite number, got {q(key)[:40]!r}")
        return value

    tokens_from = integer("tokens_from", 0)
    if tokens_from < 0:
        raise BadQuery(f"tokens_from must be 0 or more, got {tokens_from}")
    return {"run": integer("run", 0), "step": "all" if q("step") == "all" else integer("step"),
            "group": integer("group"), "episode": integer("episode"), "tokens_from": tokens_from,
            "finish": q("finish"), "min_reward": number("min_reward"), "max_reward": number("max_reward"),
            "tool_failures": q("failures") == "1", "mismatch": q("mismatch") == "1",
            "colour": "gap" if q("colour") == "gap" else "lp"}


def render_page(run_dirs: list[str], query: dict, indexes: dict, plotly_inline: bool = False) -> str:
    """The whole page for `query` (the URL's parameters: run, step, group, episode, tokens_from, finish,
    min_reward, max_reward, failures, mismatch, colour). BadQuery for a parameter it cannot use."""
    params = parse_query(query)
    runs = [load_run(d, indexes) for d in run_dirs]
    run_i = min(max(params["run"], 0), len(runs) - 1)
    run = runs[run_i]
    steps = sorted({e["step"] for e in run["entries"]})
    step = None if params["step"] == "all" else params["step"] if params["step"] is not None else (
        steps[-1] if steps else None)
    filters = {k: params[k] for k in ("finish", "min_reward", "max_reward", "tool_failures", "mismatch")}
    colour_by = params["colour"]
    matching = filter_entries(run["entries"], step=step, group=params["group"], index=params["episode"], **filters)
    shown = matching[:MAX_EPISODES_SHOWN]
    groups = {}
    for entry, record in zip(shown, run["index"].load(shown)):
        if record is None:  # the file was replaced since it was indexed
            run["bad"].append(f"traces.jsonl: the episode at byte {entry['offset']} changed while it was read")
            continue
        key = (entry["step"], entry["group"])
        if key not in groups:
            groups[key] = {"step": entry["step"], "group": entry["group"], "question": record.get("question"),
                           "gold": record.get("gold"), "episodes": []}
        view = episode_view(record, colour_by, params["tokens_from"])
        link = {"run": run_i, "step": entry["step"], "group": entry["group"], "episode": entry["index"],
                "colour": colour_by}
        href = lambda start: "?" + urllib.parse.urlencode({**link, "tokens_from": start})  # noqa: E731
        view["earlier_href"] = href(max(view["tokens_from"] - MAX_TOKENS_SHOWN, 0))
        view["more_href"] = href(view["tokens_from"] + MAX_TOKENS_SHOWN)
        groups[key]["episodes"].append(view)
    for g in groups.values():
        rewards = [e["reward"] for e in g["episodes"] if e["reward"] is not None]
        g["mean_reward"] = sum(rewards) / len(rewards) if rewards else None
    finishes = sorted({e["finish"] for e in run["entries"] if e["finish"]})
    return template().render(
        runs=[{"name": r["name"], "dir": r["dir"], "colour": RUN_COLOURS[i % len(RUN_COLOURS)],
               "last_step": r["last_step"], "traced": len({e["step"] for e in r["entries"]}), "tests": r["tests"],
               "bad": r["bad"]}
              for i, r in enumerate(runs)],
        figures=figures(runs), run_i=run_i, steps=steps, step="all" if params["step"] == "all" else step,
        finishes=finishes, filters=filters, colour_by=colour_by, groups=list(groups.values()),
        test_keys=sorted({k for r in runs for k in r["tests"]}), num_matching=len(matching), num_shown=len(shown),
        max_tokens_shown=MAX_TOKENS_SHOWN, generated=time.strftime("%Y-%m-%d %H:%M:%S"),
        plotly_js=plotly_js() if plotly_inline else None)


# --- the server ---
HOST_HEADER = re.compile(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+)(?::([0-9]{1,5}))?")


def host_allowed(host_header: str | None, bound_host: str, port: int) -> bool:
    """Against DNS rebinding (a page of another site whose name it made resolve to 127.0.0.1 reads
    ours under that name): the Host must be an IP address, localhost or the --host name, with our port.
    An IP address cannot be rebound, so any is fine."""
    match = HOST_HEADER.fullmatch(host_header or "")
    if not match or int(match.group(2) or 80) != port:
        return False
    name = match.group(1).lower()
    if name in ("localhost", bound_host.lower()):
        return True
    try:
        ipaddress.ip_address(name.strip("[]"))
        return True
    except ValueError:
        return False


class BoundedThreadingHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most `max_connections` at once: past that, accepting waits for a
    thread to finish (each is bounded by the handler's socket timeout), so a flood of idle
    connections costs queue slots, not threads."""
    request_queue_size = 256  # waiting connections queue here (the default 5 drops SYNs: 1 s retries)

    def __init__(self, address, handler, max_connections: int):
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request, client_address):
        self.slots.acquire()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def make_server(run_dirs: list[str], host: str = "127.0.0.1", port: int = 8765, timeout_s: float = SOCKET_TIMEOUT_S,
                max_connections: int = MAX_CONNECTIONS) -> ThreadingHTTPServer:
    indexes = {}  # run dir -> TraceIndex; each refreshes under its own lock, pages render in parallel

    class Handler(BaseHTTPRequestHandler):
        timeout = timeout_s  # set on the socket: a client silent this long is dropped (http.server closes it)

        def do_GET(self):
            bound_port = self.server.server_address[1]
            if not host_allowed(self.headers.get("Host"), host, bound_port):
                message = (f"Host {self.headers.get('Host', '')[:100]!r} is not this viewer's: open "
                           f"http://127.0.0.1:{bound_port}/ (other names are refused against DNS rebinding)")
                return self._send(421, message.encode(), "text/plain; charset=utf-8")
            url = urllib.parse.urlparse(self.path)
            if url.path == "/plotly.min.js":
                self._send(200, plotly_js().encode(), "application/javascript", cache=True)
            elif url.path == "/":
                try:
                    page = render_page(run_dirs, urllib.parse.parse_qs(url.query), indexes)
                    # errors="replace": a lone surrogate in a record (valid JSON) is a "?", not a 500
                    self._send(200, page.encode("utf-8", errors="replace"), "text/html; charset=utf-8")
                except BadQuery as e:
                    self._send(400, f"<pre>bad query: {html.escape(str(e))}</pre>".encode(), "text/html; charset=utf-8")
                except Exception as e:  # a bug: say so on the page, keep serving
                    self._send(500, f"<pre>viewer error: {html.escape(repr(e))}</pre>".encode(), "text/html")
            else:
                self._send(404, b"not found", "text/plain")

        def _send(self, status: int, body: bytes, content_type: str, cache: bool = False):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "max-age=86400" if cache else "no-store")
            self.end_headers()
            # In pieces: the socket timeout bounds one sendall as a whole, and a big page through a
            # slow ssh -L tunnel must not be cut for taking longer than that.
            for start in range(0, len(body), 1 << 16):
                self.wfile.write(body[start:start + (1 << 16)])

        def send_error(self, code, message=None, explain=None):
            # http.server answers a method it has no do_X for with 501: here it is a client's error
            code, message = (405, f"only GET is served, not {self.command[:20]!r}") if code == 501 else (code, message)
            super().send_error(code, message, explain)

        def log_message(self, format, *args):  # quiet: one line per request (or per timeout) is noise here
            pass

    return BoundedThreadingHTTPServer((host, port), Handler, max_connections)


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
        with open(args.out, "w", encoding="utf-8", errors="replace") as f:  # a lone surrogate: "?"
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
