"""Reading run directories for the viewer: metrics.jsonl as series over steps, traces.jsonl as an
index of episodes (read again as the files grow, so a live run shows its new steps) and the filters
of the trajectory browser."""
import hashlib
import json
import math
import operator
import os
import stat
import sys
import threading
from itertools import compress
from typing import Iterator

# Plots, in the order a researcher looks: (title, metric names); a panel shows the names a run has.
PANELS = [
    ("reward", ["rollout/reward"]),
    ("eval", ["eval/exact_match", "eval/f1", "eval/acc_final", "eval/acc_turn1", "eval/accuracy"]),
    ("turns", ["rollout/turns", "eval/turns"]),
    ("tool calls", ["rollout/tool_calls", "rollout/calc_calls", "rollout/searches", "eval/searches"]),
    ("tool failures", ["rollout/tool_failures", "rollout/calc_errors", "rollout/tool_call_parse_failures",
                       "server/restarts"]),
    ("answered / correct", ["rollout/answered", "rollout/exact_match", "rollout/acc_final", "rollout/acc_turn1",
                            "rollout/max_tokens_hit", "eval/answered"]),
    ("staleness (versions)", ["rollout/staleness_mean", "rollout/staleness_max"]),
    ("dropped groups", ["rollout/dropped_stale_groups", "rollout/failed_groups", "rollout/equal_reward_groups"]),
    ("server-trainer |Δ log-prob|", ["logprob/server_trainer_abs_diff_mean", "logprob/server_trainer_abs_diff_max"]),
    ("behaviour weight", ["logprob/behaviour_weight_mean", "logprob/behaviour_weight_max"]),
    ("behaviour weight capped / k3 KL", ["logprob/behaviour_capped_fraction", "logprob/mismatch_kl_k3"]),
    ("step time (s)", ["perf/rollout_s", "perf/logp_s", "perf/update_s", "perf/sync_s", "perf/step_s"]),
]


def decode_line(line: bytes):
    """One JSON line, or None. errors="replace": a byte that is not UTF-8 becomes U+FFFD and costs
    nothing else; RecursionError: a line nested thousands deep is not a record either."""
    try:
        return json.loads(line.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):
        return None


MAX_FLOAT_INT = int(sys.float_info.max)


def is_number(value) -> bool:
    """A JSON number that converts to a float (an integer literal can have any number of digits)."""
    return type(value) is float or (type(value) in (int, bool) and -MAX_FLOAT_INT <= value <= MAX_FLOAT_INT)


def _metric_row(line: bytes, number: int, bad: list[str]) -> dict | None:
    """One line of metrics.jsonl as a row (a JSON object with an integer step), or None with the reason
    appended to `bad`."""
    if not line.strip():
        return None
    row = decode_line(line)
    if not isinstance(row, dict):
        bad.append(f"metrics.jsonl line {number}: not a JSON object")
    elif type(row.get("step")) is not int:
        bad.append(f"metrics.jsonl line {number}: step is not an integer")
    else:
        return row
    return None


def metric_series(rows: list[dict]) -> dict[str, tuple[list, list]]:
    """{metric name: (steps, values)} over the rows of metrics.jsonl (numbers only; `test/*` rows too).
    A value that is not a finite float (NaN, inf, an integer past float's range) is a gap (None)."""
    series = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and type(value) in (int, float):
                steps, values = series.setdefault(key, ([], []))
                steps.append(row["step"])
                values.append(float(value) if is_number(value) and math.isfinite(value) else None)
    return series


# A run file is read up to this many bytes; past it the page says so. Traces of 200 steps of the
# largest recipe are ~600 MB (docs/traces.md); a file of zeros without a newline is not read without end.
MAX_RUN_FILE_BYTES = 1 << 30


def run_file_problem(path: str, st: os.stat_result) -> str | None:
    """Why the run file `path`, whose os.stat (symlinks followed) is `st`, is not read or not all of
    it (shown on the page with the bad records), or None."""
    name = os.path.basename(path)
    if not stat.S_ISREG(st.st_mode):
        return f"{name} is not a regular file (a FIFO, a device or a directory, maybe behind a symlink): not read"
    if st.st_size > MAX_RUN_FILE_BYTES:
        return f"{name} is {st.st_size} bytes: only its first {MAX_RUN_FILE_BYTES} are read (MAX_RUN_FILE_BYTES)"
    return None


def open_regular(path: str):
    """`path` opened for binary reading if it is a regular file, else None. O_NONBLOCK: a FIFO put in
    its place since it was checked opens at once, without waiting for a writer, and is refused."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return open(fd, "rb")


def appended_lines(path: str, start: int, end: int):
    """(byte offset, line) of each whole line of `path` between bytes `start` and `end`; a last line
    without its newline is being written and is left for the next read. Nothing if `path` is no
    longer a regular file."""
    f = open_regular(path)
    if f is None:
        return
    with f:
        f.seek(start)
        offset = start
        while offset < end:
            line = f.readline(end - offset)
            if not line.endswith(b"\n"):
                return
            yield offset, line
            offset += len(line)


class MetricsIndex:
    """metrics.jsonl read as it grows: `refresh()` parses only the bytes appended since the last call
    (a running trainer appends a row a step) and starts over when the file was replaced or cut (a
    resumed run). `generation` changes on every start-over, so a client holding rows [0, n) of one
    generation asks for the rest with `since=n` and gets everything again after a resume. What a
    reader sees is `state`, one dict replaced whole (its rows never changed in place): a page reads it
    without a lock, and its rows always belong to its generation."""

    def __init__(self, path: str):
        self.path = path
        # rows; why lines were skipped; every metric name; test/* values (the last of each); the step of
        # the last row with a rollout/reward; why the file is not read, or not all of it (run_file_problem)
        self.state = {"generation": 0, "rows": [], "bad": [], "keys": set(), "tests": {}, "last_step": None,
                      "problem": None}
        self._read_to = self._lines = 0
        self._inode = None
        self._lock = threading.Lock()

    rows = property(lambda self: self.state["rows"])
    bad = property(lambda self: self.state["bad"])
    keys = property(lambda self: self.state["keys"])
    tests = property(lambda self: self.state["tests"])
    last_step = property(lambda self: self.state["last_step"])
    generation = property(lambda self: self.state["generation"])

    def refresh(self):
        with self._lock:
            old = self.state
            st = os.stat(self.path) if os.path.exists(self.path) else None
            problem = run_file_problem(self.path, st) if st else None
            readable = st is not None and stat.S_ISREG(st.st_mode)  # never a FIFO, /dev/zero, a directory
            if not readable or st.st_ino != self._inode or st.st_size < self._read_to:  # start over
                started = self._inode is not None or old["rows"] or old["bad"]
                old = {"generation": old["generation"] + bool(started), "rows": [], "bad": [], "keys": set(),
                       "tests": {}, "last_step": None, "problem": None}
                self._read_to, self._lines, self._inode = 0, 0, st.st_ino if readable else None
            end = min(st.st_size, MAX_RUN_FILE_BYTES) if readable else 0
            if end == self._read_to:
                self.state = old if old["problem"] == problem else dict(old, problem=problem)
                return self
            rows, bad = list(old["rows"]), list(old["bad"])
            offset = self._read_to
            for start, line in appended_lines(self.path, self._read_to, end):
                self._lines += 1
                row = _metric_row(line, self._lines, bad)
                if row is not None:
                    rows.append(row)
                offset = start + len(line)
            # what every page shows of the run, kept up to date here so a page does not walk every row
            keys, tests, last_step = set(old["keys"]), dict(old["tests"]), old["last_step"]
            for row in rows[len(old["rows"]):]:
                keys.update(row)
                tests.update((k[len("test/"):], v) for k, v in row.items() if k.startswith("test/"))
                if "rollout/reward" in row and (last_step is None or row["step"] > last_step):
                    last_step = row["step"]
            keys.discard("step")
            self._read_to = offset
            self.state = {"generation": old["generation"], "rows": rows, "bad": bad, "keys": keys, "tests": tests,
                          "last_step": last_step, "problem": problem}
        return self


NUMBER, INT, STR = {int, float, bool}, {int, bool}, {str}
TOKEN_COLUMNS = {"id": INT, "text": STR, "mask": INT, "lp": NUMBER, "ver": INT}  # and tlp: NUMBER, or null


def _column_ok(values: list, types: set) -> bool:
    # map and set run at C speed: a 1M-token column is checked in tens of ms (a loop: seconds)
    if not set(map(type, values)) <= types:
        return False
    if types is NUMBER:
        try:
            list(map(float, values))  # an integer past float's range would break the arithmetic
        except OverflowError:
            return False
    return True


def _is_turn(turn) -> bool:  # {role, text}; or earlier formats: [role, text], a model text
    return (isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("text"), str)) or (
        isinstance(turn, list) and len(turn) == 2 and isinstance(turn[0], str)) or isinstance(turn, str)


def trace_problem(record) -> str | None:
    """Why the viewer cannot show a trace record, or None: every field it reads must have the type
    docs/traces.md gives it. Records written before per-token traces (turns only) are fine."""
    if not isinstance(record, dict):
        return "not a JSON object"
    for key in ("step", "group", "index", "tool_failures"):
        if (key == "step" or record.get(key) is not None) and type(record.get(key)) is not int:
            return f"{key} is not an integer"
    for key in ("reward", "advantage", "correct"):
        if record.get(key) is not None and not is_number(record[key]):
            return f"{key} is not a number"
    if not isinstance(record.get("finish") or "", str):
        return "finish is not a string"
    turns = record.get("turns", [])
    if not isinstance(turns, list) or not all(map(_is_turn, turns)):
        return "a turn is not {role, text}"
    tokens = record.get("tokens")
    if tokens:
        if not isinstance(tokens, dict):
            return "tokens is not an object"
        columns = dict(TOKEN_COLUMNS, **({"tlp": NUMBER} if tokens.get("tlp") is not None else {}))
        if not all(isinstance(tokens.get(k), list) for k in columns) or len({len(tokens[k]) for k in columns}) > 1:
            return "tokens: " + "/".join(columns) + " are not lists of one length"
        for key, types in columns.items():
            if not _column_ok(tokens[key], types):
                return f"tokens.{key} holds a value of another type than docs/traces.md gives"
    return None


class TraceIndex:
    """Where each episode of a traces.jsonl is (byte offset and length) with the few fields the
    filters need, and why each line that is not a record the viewer can show was skipped. `refresh()`
    reads only what was appended since the last call, and starts over when the file was replaced or
    cut (a resumed run drops the steps after its checkpoint). `entries` and `bad` are replaced, never
    changed in place, so a page reads them without a lock while another request refreshes."""

    def __init__(self, path: str):
        self.path = path
        self.entries: list[dict] = []
        self.bad: list[str] = []
        self.problem: str | None = None  # why the file is not read, or not all of it (run_file_problem)
        self._read_to = self._lines = 0
        self._inode = None
        self._lock = threading.Lock()  # one refresh at a time

    def refresh(self):
        with self._lock:
            st = os.stat(self.path) if os.path.exists(self.path) else None
            self.problem = run_file_problem(self.path, st) if st else None
            if st is None or not stat.S_ISREG(st.st_mode):  # never a FIFO, /dev/zero, a directory
                self.entries, self.bad, self._read_to, self._lines, self._inode = [], [], 0, 0, None
                return self
            if st.st_ino != self._inode or st.st_size < self._read_to:
                self.entries, self.bad, self._read_to, self._lines, self._inode = [], [], 0, 0, st.st_ino
            entries, bad = list(self.entries), list(self.bad)
            offset = self._read_to
            for start, line in appended_lines(self.path, self._read_to, min(st.st_size, MAX_RUN_FILE_BYTES)):
                self._lines += 1
                record = decode_line(line)
                problem = trace_problem(record) if line.strip() else None
                if problem:
                    bad.append(f"traces.jsonl line {self._lines}: {problem}")
                elif line.strip():
                    entries.append(_summary(record, start, len(line), entries))
                offset = start + len(line)
            self.entries, self.bad, self._read_to = entries, bad, offset
        return self

    def steps(self) -> list[int]:
        return sorted({e["step"] for e in self.entries})

    def load(self, entries: list[dict]) -> list[dict | None]:
        """The full records of `entries` (from `self.entries`); None for one that is no longer there
        as indexed (the file was replaced since)."""
        records = []
        for e, line in self.lines(entries):
            record = decode_line(line)
            records.append(None if trace_problem(record) or record["step"] != e["step"] else record)
        return records

    def lines(self, entries: list[dict]) -> Iterator[tuple[dict, bytes]]:
        """(entry, its raw line as indexed) for each of `entries`; the file is opened only when there are any."""
        if not entries:
            return
        f = open_regular(self.path)
        if f is None:  # replaced by what is not a regular file since it was indexed
            yield from ((e, b"") for e in entries)
            return
        with f:
            for e in entries:
                f.seek(e["offset"])
                yield e, f.read(e["length"])


def _summary(record: dict, offset: int, length: int, earlier: list[dict]) -> dict:
    if "group" in record:
        group, index = record["group"], record.get("index", 0)
    else:  # traces written before per-token records: one group per step, in order
        index = sum(1 for e in earlier if e["step"] == record["step"])
        group = 0
    tokens = record.get("tokens") or {}
    mask = tokens.get("mask") or []
    gaps = (list(map(abs, map(operator.sub, compress(tokens["tlp"], mask), compress(tokens["lp"], mask))))
            if tokens.get("tlp") else [])
    gaps = [g for g in gaps if math.isfinite(g)]
    question = record.get("question")
    return {"step": record["step"], "group": group, "index": index, "offset": offset, "length": length,
            "reward": record.get("reward"), "advantage": record.get("advantage"),
            "finish": record.get("finish"), "correct": record.get("correct"),
            "tool_failures": record.get("tool_failures") or 0,
            # for sorting: generated tokens (turn text length for records without tokens) and the largest gap
            "gen_tokens": sum(mask) if mask else sum(len(t.get("text", "")) if isinstance(t, dict) else len(str(t))
                                                     for t in record.get("turns", [])),
            "max_gap": max(gaps) if gaps else None,
            "question_id": question_id(question)}


def question_id(question) -> str:
    """A short stable id of a question's text: the same question across steps and runs has one id."""
    text = question if isinstance(question, str) else json.dumps(question, sort_keys=True)
    return hashlib.sha1(text.encode("utf-8", errors="replace")).hexdigest()[:12]


def is_mismatch(entry: dict) -> bool:
    """Answer judged correct with reward 0, or judged wrong with a reward above 0 (partial credit a
    policy can farm, or a reward bug)."""
    correct, reward = entry.get("correct"), entry.get("reward")
    if correct is None or reward is None:
        return False
    return (correct > 0 and reward <= 0) or (correct <= 0 and reward > 0)


def filter_entries(entries: list[dict], *, step=None, group=None, index=None, finish: str = "", min_reward=None,
                   max_reward=None, tool_failures: bool = False, mismatch: bool = False, question_id: str = "",
                   steps: tuple | None = None) -> list[dict]:
    """The entries that pass every filter that is set; `step` None = every step; `steps` (first, last)
    an inclusive range of steps."""
    out = []
    for e in entries:
        if (step is not None and e["step"] != step) or (group is not None and e["group"] != group) or (
                index is not None and e["index"] != index):
            continue
        if (question_id and e["question_id"] != question_id) or (steps and not steps[0] <= e["step"] <= steps[1]):
            continue
        if finish and e["finish"] != finish:
            continue
        # NaN compares False with everything: without the isfinite check it would pass every bound
        if (min_reward is not None or max_reward is not None) and (
                e["reward"] is None or not math.isfinite(e["reward"])):
            continue
        if (min_reward is not None and e["reward"] < min_reward) or (max_reward is not None and e["reward"] > max_reward):
            continue
        if tool_failures and not e["tool_failures"]:
            continue
        if mismatch and not is_mismatch(e):
            continue
        out.append(e)
    return out


# How the trajectory browser can order episodes: (label, key of an entry, descending). Episodes without
# the value (no trainer log-probs for the gap, no reward) go last whatever the direction.
SORTS = {
    "newest": ("newest step first", "step", True), "oldest": ("oldest step first", "step", False),
    "reward_desc": ("reward, highest first", "reward", True), "reward_asc": ("reward, lowest first", "reward", False),
    "advantage_desc": ("advantage, highest first", "advantage", True),
    "advantage_asc": ("advantage, lowest first", "advantage", False),
    "gap_desc": ("server-trainer gap, largest first", "max_gap", True),
    "length_desc": ("generated tokens, most first", "gen_tokens", True),
    "length_asc": ("generated tokens, fewest first", "gen_tokens", False),
}


def sort_entries(entries: list[dict], sort: str) -> list[dict]:
    """`entries` in the order SORTS[sort] names; ties keep step, group, episode order (newest step
    first for "newest"), so a group's episodes stay together when sorting by step."""
    _, key, descending = SORTS[sort]
    if key == "step":
        return sorted(entries, key=lambda e: (-e["step"] if descending else e["step"], e["group"], e["index"]))

    def value(e):
        v = e.get(key)
        return float(v) if v is not None and is_number(v) and math.isfinite(v) else None

    known = [e for e in entries if value(e) is not None]
    unknown = [e for e in entries if value(e) is None]
    known.sort(key=lambda e: (-value(e) if descending else value(e), -e["step"], e["group"], e["index"]))
    return known + unknown
