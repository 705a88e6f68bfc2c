"""Look inside runs in the browser: plots over steps (several runs overlaid) and a trajectory browser.

    python -m lib.viewer runs/search_tiny [runs/other ...]      # then open http://127.0.0.1:8765
    python -m lib.viewer runs/search_tiny --out page.html       # or one self-contained file
    python -m lib.viewer runs/search_tiny --out page.html --steps 10-20

A page served on 127.0.0.1: every request reads the run dirs again (only what was appended), so a
refresh shows a live run's new steps. The page (a Jinja2 template with autoescaping, because model
output is untrusted) holds the episodes on screen; the plots' series come as JSON from
/api/series (only the rows the page does not have yet) and are drawn in the page by Plotly (its JS
comes from the pip package: no CDN, works offline); /api/episode gives one episode's tokens (the
token diff). Everything it needs is in the run dir (metrics.jsonl, traces.jsonl, config.json), so a
run copied from another machine is shown the same way.
"""
import argparse
import functools
import gzip
import html
import ipaddress
import json
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

from lib.viewer_data import (PANELS, SORTS, MetricsIndex, TraceIndex, decode_line, filter_entries, is_mismatch,
                              is_number, metric_series, open_regular, sort_entries)

RUN_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
MAX_EPISODES_SHOWN = 64  # a page of episodes; a filter over every step can match thousands (paged)
MAX_EPISODES_OUT = 1000  # episodes in one --out file
FOLD_CHARS = 2000  # a turn's text past this many characters is folded
MAX_SEARCH_CHARS = 200
GZIP_MIN_BYTES = 64 << 10  # responses bigger than this go gzipped to a client that accepts it
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


# --- plots: the series as JSON, drawn by the page ---
def series_payload(run_i: int, run: dict, since: int = 0, generation: int | None = None) -> dict:
    """What the page plots of one run: its metric series from row `since` on (all rows when
    `generation` is not the index's current one: the file was replaced or cut), as
    {name: [steps, values]}, values None where not finite. The page asks again with `since` = `rows`
    and appends: a refresh sends only the steps written since the last one."""
    state = run["metrics"]  # one snapshot: its rows are of its generation
    rows = state["rows"]
    reset = generation != state["generation"]
    since = 0 if reset else min(since, len(rows))
    series = {k: [steps, values] for k, (steps, values) in series_from(state, since).items()}
    return {"run": run_i, "name": run["name"], "generation": state["generation"], "reset": reset, "since": since,
            "rows": len(rows), "series": series, "last_step": run["last_step"], "tests": run["tests"],
            "bad": run["bad"][:20], "num_bad": len(run["bad"])}


def series_from(state: dict, since: int) -> dict:
    """metric_series of a metrics state's rows from `since`. From row 0 (every first load of a page)
    it is built once per state and kept in it: a state is replaced, not changed, when the file grows."""
    if since:
        return metric_series(state["rows"][since:])
    if "series" not in state:  # two requests at once may both build it: the same value
        state["series"] = metric_series(state["rows"])
    return state["series"]


def metric_keys(runs: list[dict]) -> list[str]:
    """Every metric name any run has logged, sorted (the page lays out its panels from these)."""
    return sorted(set().union(*(run["metrics"]["keys"] for run in runs)))


# --- token colours ---
NOT_SCORED = "#fff0b3"  # gap colouring, an episode the trainer did not score (tlp null): not "agree" white


def _mix(white_to: tuple, t: float) -> str:
    t = max(0.0, min(1.0, t))
    r, g, b = (round(255 + (c - 255) * t) for c in white_to)
    return f"#{r:02x}{g:02x}{b:02x}"


def token_colour(mode: str, lp: float, tlp: float | None, masked: bool) -> str:
    """Background of one token: by probability (white = sure, red = unlikely) or by the server-trainer
    gap |Δ log-prob| (white = 0, purple = 0.5 nats or more; yellow = not scored by the trainer). Masked
    tokens have no colour (grey)."""
    if masked:
        return "#e8e8e8"
    if mode == "gap":
        return _mix((150, 60, 200), abs(tlp - lp) / 0.5) if tlp is not None else NOT_SCORED
    return _mix((230, 60, 60), 1.0 - math.exp(min(lp, 0.0)))  # a log-prob above 0 (a bad record) overflows exp


def fold_text(text: str) -> dict:
    """A turn's text as {head, rest}: past FOLD_CHARS the rest is folded (a 200 kB tool output would
    otherwise push every other episode off screen)."""
    if len(text) <= FOLD_CHARS:
        return {"head": text, "rest": ""}
    return {"head": text[:FOLD_CHARS], "rest": text[FOLD_CHARS:]}


def episode_view(record: dict, colour_by: str, tokens_from: int = 0) -> dict:
    """What the template shows of one trace record (one that passed `trace_problem`): its turns and,
    per token of `MAX_TOKENS_SHOWN` from `tokens_from`, text, colour and a tooltip. Handles records
    written before per-token traces (turns only)."""
    tokens = record.get("tokens")
    toks = []
    num_tokens = len(tokens["id"]) if tokens else 0
    shown = range(min(tokens_from, num_tokens), min(tokens_from + MAX_TOKENS_SHOWN, num_tokens))
    scored = bool(tokens and tokens.get("tlp") is not None)
    if tokens:
        tlps = tokens.get("tlp") or [None] * num_tokens
        for i in shown:
            tid, text, m, lp, tlp, ver = (tokens["id"][i], tokens["text"][i], tokens["mask"][i], tokens["lp"][i],
                                          tlps[i], tokens["ver"][i])
            tip = f"#{i} id {tid} · " + (f"server {lp:.4f} · trainer {tlp:.4f} · Δ {tlp - lp:+.4f} · v{ver}"
                                         if m and tlp is not None else
                                         f"server {lp:.4f} · not scored by the trainer · v{ver}" if m else
                                         "loss mask 0 (not trained)")
            toks.append({"text": text, "masked": not m, "bg": token_colour(colour_by, lp, tlp, not m), "tip": tip})
    turns = []
    for turn in record.get("turns", []):
        if isinstance(turn, dict):
            role, text = turn["role"], turn["text"]
        elif isinstance(turn, (list, tuple)):  # earlier format: [role, text]
            role, text = turn[0], turn[1]
        else:  # earlier format of the reflect task: model texts only
            role, text = "model", str(turn)
        turns.append({"role": role, **fold_text(text if isinstance(text, str) else str(text))})
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
        "tokens_from": shown.start, "tokens_after": num_tokens - shown.stop, "scored": scored,
        "gen_tokens": len(gen), "mean_lp": sum(gen) / len(gen) if gen else None,
        "max_gap": max(gaps) if gaps else None, "versions": versions,
    }


# --- the page ---
def read_config(run_dir: str) -> dict | None:
    """The run's config (config.json, else config.yaml, in the run dir) flattened to {key: text}, or None."""
    for name in ("config.json", "config.yaml"):
        path = os.path.join(run_dir, name)
        if not os.path.isfile(path) or os.path.getsize(path) > 1_000_000:
            continue
        try:
            f = open_regular(path)  # a FIFO put in its place since the check is refused, not waited on
            if f is None:
                continue
            with f:
                raw = f.read(1_000_000).decode("utf-8", errors="replace")
            if name.endswith(".json"):
                config = json.loads(raw)
            else:
                import yaml

                config = yaml.safe_load(raw)
        except Exception as e:  # a hand-edited file: say so in the table, show the rest of the page
            return {"(unreadable)": f"{name}: {type(e).__name__}"}
        if not isinstance(config, dict):
            return {"(unreadable)": f"{name} is not a mapping"}
        flat = {}

        def walk(prefix, value, depth=0):
            if isinstance(value, dict) and depth < 4:
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), v, depth + 1)
            else:
                text = value if isinstance(value, str) else json.dumps(value, default=str)
                flat[prefix] = text[:200]

        walk("", config)
        return dict(list(flat.items())[:500])
    return None


def load_run(run_dir: str, indexes: dict) -> dict:
    # setdefault is atomic: two first requests for a run share one index
    index = indexes.setdefault(("traces", run_dir), TraceIndex(os.path.join(run_dir, "traces.jsonl"))).refresh()
    metrics = indexes.setdefault(("metrics", run_dir), MetricsIndex(os.path.join(run_dir, "metrics.jsonl"))).refresh()
    state = metrics.state  # read once: a refresh by another request replaces it
    tests = state["tests"]
    return {"dir": run_dir, "name": os.path.basename(os.path.abspath(run_dir)), "metrics": state, "index": index,
            "entries": index.entries, "last_step": state["last_step"],
            "bad": [p for p in (state["problem"], index.problem) if p] + state["bad"] + index.bad,
            "tests": {k: v if (is_number(v) and math.isfinite(v)) or isinstance(v, str) else str(v)
                      for k, v in tests.items()}}


class BadQuery(ValueError):
    """A URL parameter the page cannot use; the server answers 400 with this message."""


def parse_query(query: dict) -> dict:
    """The page's URL parameters (from parse_qs), checked: integers where an integer is meant,
    finite numbers for the reward bounds; a BadQuery names the parameter otherwise."""
    q = lambda k: query.get(k, [""])[0]  # noqa: E731

    def integer(key: str, default=None, minimum=None):
        try:
            value = int(q(key)) if q(key) != "" else default
        except ValueError:  # also "nan", "1e309", "1.5" and past 4,300 digits
            raise BadQuery(f"{key} must be an integer, got {q(key)[:40]!r}") from None
        if minimum is not None and value is not None and value < minimum:
            raise BadQuery(f"{key} must be {minimum} or more, got {value}")
        return value

    def number(key: str):
        try:
            value = float(q(key)) if q(key) != "" else None
        except ValueError:
            raise BadQuery(f"{key} must be a number, got {q(key)[:40]!r}") from None
        if value is not None and not math.isfinite(value):
            raise BadQuery(f"{key} must be a finite number, got {q(key)[:40]!r}")
        return value

    sort = q("sort") or "newest"
    if sort not in SORTS:
        raise BadQuery(f"sort must be one of {', '.join(SORTS)}, got {sort[:40]!r}")
    question = q("question")
    if question and not re.fullmatch(r"[0-9a-f]{12}", question):
        raise BadQuery(f"question must be a question id (12 hex digits, from a 'same question' link), got {question[:40]!r}")
    search = q("q")
    if len(search) > MAX_SEARCH_CHARS:
        raise BadQuery(f"q (the text search) is at most {MAX_SEARCH_CHARS} characters, got {len(search)}")
    return {"run": integer("run", 0), "step": "all" if q("step") == "all" else integer("step"),
            "group": integer("group"), "episode": integer("episode"), "tokens_from": integer("tokens_from", 0, 0),
            "page": integer("page", 0, 0), "sort": sort, "question": question, "search": search,
            "compare": q("compare") == "1",
            "finish": q("finish"), "min_reward": number("min_reward"), "max_reward": number("max_reward"),
            "tool_failures": q("failures") == "1", "mismatch": q("mismatch") == "1",
            "colour": "gap" if q("colour") == "gap" else "lp"}


def search_entries(index: TraceIndex, entries: list[dict], text: str) -> list[dict]:
    """The entries whose model or tool text (turns, answer) holds `text`, case-insensitive. A bytes
    check on the raw line first (most lines fail it without being parsed), then the parsed turns."""
    needle = text.casefold()
    raw = json.dumps(text)[1:-1].lower().encode() if text.isascii() else None
    out = []
    for e, line in index.lines(entries):
        if raw is not None and raw not in line.lower():
            continue
        record = decode_line(line)
        if not isinstance(record, dict) or record.get("step") != e["step"]:
            continue
        texts = [t["text"] if isinstance(t, dict) else t[1] if isinstance(t, list) else str(t)
                 for t in record.get("turns", [])] + [str(record.get("answer") or "")]
        if any(needle in str(t).casefold() for t in texts):
            out.append(e)
    return out


def nearest_step(steps: list[int], wanted: int) -> int:
    """The traced step closest to `wanted` (the earlier one on a tie)."""
    return min(steps, key=lambda s: (abs(s - wanted), s))


def render_page(run_dirs: list[str], query: dict, indexes: dict, plotly_inline: bool = False,
                steps_range: tuple | None = None) -> str:
    """The whole page for `query` (the URL's parameters: run, step, group, episode, tokens_from, finish,
    min_reward, max_reward, failures, mismatch, colour, sort, page, q, question, compare). BadQuery
    for a parameter it cannot use. `plotly_inline`: a self-contained file (Plotly and the series
    inlined; `steps_range` (first, last) picks its episodes)."""
    params = parse_query(query)
    runs = [load_run(d, indexes) for d in run_dirs]
    run_i = min(max(params["run"], 0), len(runs) - 1)
    run = runs[run_i]
    steps = sorted({e["step"] for e in run["entries"]})
    notice = None
    if params["step"] == "all" or steps_range is not None:
        step = None
    elif params["step"] is None:
        step = steps[-1] if steps else None
    elif params["step"] in steps:
        step = params["step"]
    elif steps:  # a step this run has not traced (another run's step, a typo): say so, show the nearest
        step = nearest_step(steps, params["step"])
        notice = (f"step {params['step']} is not traced in {run['name']} (traced: {steps[0]}–{steps[-1]}, "
                  f"{len(steps)} steps); showing step {step}")
    else:
        step = None
    filters = {k: params[k] for k in ("finish", "min_reward", "max_reward", "tool_failures", "mismatch")}
    colour_by = params["colour"]
    # "same question in every run": the question's episodes of each run, a run a row
    compare_runs = list(range(len(runs))) if params["compare"] and params["question"] else [run_i]
    matching = []
    for r_i in compare_runs:
        picked = filter_entries(runs[r_i]["entries"], step=step if not params["question"] else None,
                                group=params["group"], index=params["episode"], question_id=params["question"],
                                steps=steps_range, **filters)
        if params["search"]:
            picked = search_entries(runs[r_i]["index"], picked, params["search"])
        matching += [(r_i, e) for e in sort_entries(picked, params["sort"])]
    per_page = MAX_EPISODES_OUT if plotly_inline else MAX_EPISODES_SHOWN
    num_pages = max(1, -(-len(matching) // per_page))
    page = min(params["page"], num_pages - 1)
    shown = matching[page * per_page:(page + 1) * per_page]
    groups = []
    by_run = {}
    for r_i, entry in shown:
        by_run.setdefault(r_i, []).append(entry)
    records = {(r_i, id(e)): rec for r_i, es in by_run.items() for e, rec in zip(es, runs[r_i]["index"].load(es))}
    for r_i, entry in shown:
        record = records[(r_i, id(entry))]
        if record is None:  # the file was replaced since it was indexed
            runs[r_i]["bad"].append(f"traces.jsonl: the episode at byte {entry['offset']} changed while it was read")
            continue
        # a box per run of consecutive episodes of one group: sorted by reward, a group's episodes can be apart
        key = (r_i, entry["step"], entry["group"])
        if not groups or groups[-1]["key"] != key:
            groups.append({"key": key, "run": r_i, "run_name": runs[r_i]["name"], "step": entry["step"],
                           "group": entry["group"], "question": record.get("question"),
                           "question_id": entry["question_id"], "gold": record.get("gold"), "episodes": []})
        view = episode_view(record, colour_by, params["tokens_from"])
        link = {"run": r_i, "step": entry["step"], "group": entry["group"], "episode": entry["index"],
                "colour": colour_by}
        href = lambda start: "?" + urllib.parse.urlencode({**link, "tokens_from": start})  # noqa: E731
        view["earlier_href"] = href(max(view["tokens_from"] - MAX_TOKENS_SHOWN, 0))
        view["more_href"] = href(view["tokens_from"] + MAX_TOKENS_SHOWN)
        view["permalink"] = "?" + urllib.parse.urlencode(link)
        view["anchor"] = f"ep-{r_i}-{entry['step']}-{entry['group']}-{entry['index']}"
        view["api"] = "/api/episode?" + urllib.parse.urlencode({k: v for k, v in link.items() if k != "colour"})
        groups[-1]["episodes"].append(view)
    for g in groups:
        rewards = [e["reward"] for e in g["episodes"] if e["reward"] is not None]
        g["mean_reward"] = sum(rewards) / len(rewards) if rewards else None
    finishes = sorted({e["finish"] for e in run["entries"] if e["finish"]})
    # links that keep every other parameter: another page of results, the previous / next traced step
    kept = {k: v[0] for k, v in query.items() if v and k not in ("page", "tokens_from")}
    link_to = lambda **changes: "?" + urllib.parse.urlencode({**kept, **changes})  # noqa: E731
    pos = steps.index(step) if step in steps else None
    nav = {"prev": link_to(step=steps[pos - 1]) if pos else None,
           "next": link_to(step=steps[pos + 1]) if pos is not None and pos + 1 < len(steps) else None,
           "earlier_page": link_to(page=page - 1) if page > 0 else None,
           "later_page": link_to(page=page + 1) if page + 1 < num_pages else None}
    runs_meta = [{"name": r["name"], "dir": r["dir"], "colour": RUN_COLOURS[i % len(RUN_COLOURS)],
                  "last_step": r["last_step"], "traced": len({e["step"] for e in r["entries"]}), "tests": r["tests"],
                  "bad": r["bad"], "config": read_config(r["dir"])} for i, r in enumerate(runs)]
    config_keys = sorted({k for r in runs_meta if r["config"] for k in r["config"]})
    # the config rows that differ between runs first: what a researcher compares
    differs = lambda k: len({(r["config"] or {}).get(k) for r in runs_meta}) > 1  # noqa: E731
    config_keys.sort(key=lambda k: not differs(k))
    return template().render(
        runs=runs_meta, run_i=run_i, steps=steps, step="all" if step is None and steps_range is None else step,
        finishes=finishes, filters=filters, colour_by=colour_by, groups=groups, notice=notice,
        test_keys=sorted({k for r in runs for k in r["tests"]}), num_matching=len(matching),
        first_shown=page * per_page + 1, last_shown=page * per_page + len(shown), page=page, num_pages=num_pages,
        nav=nav, sorts={k: v[0] for k, v in SORTS.items()}, sort=params["sort"], search=params["search"],
        question=params["question"], compare=params["compare"], config_keys=config_keys,
        config_differs={k: differs(k) for k in config_keys},
        max_tokens_shown=MAX_TOKENS_SHOWN, generated=time.strftime("%Y-%m-%d %H:%M:%S"),
        panels=PANELS, metric_keys=metric_keys(runs), not_scored=NOT_SCORED,
        series=[series_payload(i, r) for i, r in enumerate(runs)] if plotly_inline else None,
        steps_range=steps_range, plotly_js=plotly_js() if plotly_inline else None)


def episode_payload(run_dirs: list[str], query: dict, indexes: dict) -> dict:
    """One episode as JSON (the page's token diff fetches two): its view with every token text shown."""
    params = parse_query(query)
    for key in ("step", "group", "episode"):
        if not isinstance(params[key], int):
            raise BadQuery(f"{key} must be an integer: /api/episode?run=R&step=S&group=G&episode=I")
    if not 0 <= params["run"] < len(run_dirs):
        raise BadQuery(f"run must be 0–{len(run_dirs) - 1}, got {params['run']}")
    run = load_run(run_dirs[params["run"]], indexes)
    found = filter_entries(run["entries"], step=params["step"], group=params["group"], index=params["episode"])
    record = run["index"].load(found[:1])[0] if found else None
    if record is None:
        return {"found": False}
    view = episode_view(record, params["colour"], params["tokens_from"])
    return {"found": True, "run": params["run"], "run_name": run["name"], "step": params["step"],
            "group": params["group"], "episode": params["episode"], "reward": view["reward"],
            "tokens": [{"text": t["text"], "masked": t["masked"]} for t in view["tokens"]],
            "num_tokens": view["num_tokens"]}


def series_query(run_dirs: list[str], query: dict, indexes: dict) -> dict:
    """/api/series?run=R&since=N&generation=G: `series_payload` of run R, rows from N on."""
    q = lambda k: query.get(k, [""])[0]  # noqa: E731
    values = {}
    for key in ("run", "since", "generation"):
        try:
            values[key] = int(q(key)) if q(key) != "" else None
        except ValueError:
            raise BadQuery(f"{key} must be an integer, got {q(key)[:40]!r}") from None
    run_i = values["run"] if values["run"] is not None else 0
    if not 0 <= run_i < len(run_dirs):
        raise BadQuery(f"run must be 0–{len(run_dirs) - 1}, got {run_i}")
    since = values["since"] or 0
    if since < 0:
        raise BadQuery(f"since must be 0 or more, got {since}")
    return series_payload(run_i, load_run(run_dirs[run_i], indexes), since, values["generation"])


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
            elif url.path in ("/api/series", "/api/episode"):
                try:
                    query = urllib.parse.parse_qs(url.query)
                    payload = (series_query(run_dirs, query, indexes) if url.path == "/api/series" else
                               episode_payload(run_dirs, query, indexes))
                    self._send_json(200, payload)
                except BadQuery as e:
                    self._send_json(400, {"error": str(e)})
                except Exception as e:  # a bug: say so, keep serving
                    self._send_json(500, {"error": f"viewer error: {e!r}"})
            else:
                self._send(404, b"not found", "text/plain")

        def _send_json(self, status: int, payload: dict):
            # errors="replace": a lone surrogate (valid JSON in a record) is a "?"; allow_nan=False: the
            # payload holds None where a value is not finite, and a NaN that slipped through is a bug
            body = json.dumps(payload, allow_nan=False, separators=(",", ":")).encode("utf-8", errors="replace")
            self._send(status, body, "application/json; charset=utf-8")

        def _send(self, status: int, body: bytes, content_type: str, cache: bool = False):
            # gzip what is big and text (a run's series: 1 MB of JSON at 2,000 steps, ~5x smaller), for a
            # browser that asks for it; level 1: a few ms a MB
            encoding = None
            if len(body) > GZIP_MIN_BYTES and "gzip" in self.headers.get("Accept-Encoding", "")[:200]:
                body, encoding = gzip.compress(body, compresslevel=1), "gzip"
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            if encoding:
                self.send_header("Content-Encoding", encoding)
                self.send_header("Vary", "Accept-Encoding")
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
    parser.add_argument("--out", help="write one self-contained HTML file instead of serving (the latest step's "
                                          "episodes, or those of --steps)")
    parser.add_argument("--steps", help="with --out: the steps whose episodes it holds, FIRST-LAST (e.g. 10-20), one "
                                        "step, or all (at most %d episodes)" % MAX_EPISODES_OUT)
    args = parser.parse_args(argv)
    for d in args.run_dirs:
        if os.path.exists(d) and not os.path.isdir(d):
            parser.error(f"{d} is not a directory: pass run dirs, e.g. runs/search_tiny")
        if not os.path.exists(d):  # a run about to start: shown once it writes there
            print(f"{d} does not exist yet; it is shown once a run writes metrics.jsonl or traces.jsonl there")
    steps_range = None
    if args.steps:
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", args.steps)
        if args.steps.strip() == "all":
            steps_range = (-(1 << 62), 1 << 62)
        elif match:
            steps_range = (int(match.group(1)), int(match.group(2) or match.group(1)))
        else:
            parser.error(f"--steps {args.steps!r}: give FIRST-LAST (10-20), one step (7) or all")
        if not args.out:
            parser.error("--steps picks the episodes of an --out file; the server pages through every step")
    if args.out:
        with open(args.out, "w", encoding="utf-8", errors="replace") as f:  # a lone surrogate: "?"
            f.write(render_page(args.run_dirs, {}, {}, plotly_inline=True, steps_range=steps_range))
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
