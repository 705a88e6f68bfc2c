"""Reading run directories for the viewer: metrics.jsonl as series over steps, traces.jsonl as an
index of episodes (read again as the files grow, so a live run shows its new steps) and the filters
of the trajectory browser."""
import json
import os

# Plots, in the order a researcher looks: (title, metric names); a panel shows the names a run has.
PANELS = [
    ("reward", ["rollout/reward"]),
    ("eval", ["eval/exact_match", "eval/f1", "eval/acc_final", "eval/acc_turn1", "eval/accuracy"]),
    ("turns", ["rollout/turns", "eval/turns"]),
    ("tool calls", ["rollout/tool_calls", "rollout/calc_calls", "rollout/searches", "eval/searches"]),
    ("tool failures", ["rollout/tool_failures", "rollout/calc_errors", "rollout/tool_call_parse_failures",
                       "tools/server_restarts"]),
    ("answered / correct", ["rollout/answered", "rollout/exact_match", "rollout/acc_final", "rollout/acc_turn1",
                            "rollout/max_tokens_hit", "eval/answered"]),
    ("staleness (versions)", ["rollout/staleness_mean", "rollout/staleness_max"]),
    ("dropped groups", ["rollout/dropped_stale_groups", "rollout/failed_groups", "rollout/equal_reward_groups"]),
    ("server-trainer |Δ log-prob|", ["logprob/server_trainer_abs_diff_mean", "logprob/server_trainer_abs_diff_max"]),
    ("behaviour weight", ["logprob/behaviour_weight_mean", "logprob/behaviour_weight_max"]),
    ("behaviour weight capped / k3 KL", ["logprob/behaviour_capped_fraction", "logprob/mismatch_kl_k3"]),
    ("step time (s)", ["perf/rollout_s", "perf/logp_s", "perf/update_s", "perf/sync_s", "perf/step_s"]),
]


def read_jsonl_rows(path: str) -> list[dict]:
    """Rows of a JSONL file; a last line cut mid-write by a running trainer is skipped."""
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue
    return rows


def metric_series(rows: list[dict]) -> dict[str, tuple[list, list]]:
    """{metric name: (steps, values)} over the rows of metrics.jsonl (numbers only; `test/*` rows too)."""
    series = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                steps, values = series.setdefault(key, ([], []))
                steps.append(row["step"])
                values.append(value)
    return series


class TraceIndex:
    """Where each episode of a traces.jsonl is (byte offset and length) with the few fields the
    filters need. `refresh()` reads only what was appended since the last call, and starts over when
    the file was replaced or cut (a resumed run drops the steps after its checkpoint)."""

    def __init__(self, path: str):
        self.path = path
        self.entries: list[dict] = []
        self._read_to = 0
        self._inode = None

    def refresh(self):
        if not os.path.exists(self.path):
            self.entries, self._read_to, self._inode = [], 0, None
            return self
        st = os.stat(self.path)
        if st.st_ino != self._inode or st.st_size < self._read_to:
            self.entries, self._read_to, self._inode = [], 0, st.st_ino
        with open(self.path, "rb") as f:
            f.seek(self._read_to)
            offset = self._read_to
            for line in f:
                if not line.endswith(b"\n"):  # being written: read it next time
                    break
                try:
                    record = json.loads(line)
                except ValueError:
                    record = None
                if isinstance(record, dict) and "step" in record:
                    self.entries.append(_summary(record, offset, len(line), self.entries))
                offset += len(line)
            self._read_to = offset
        return self

    def steps(self) -> list[int]:
        return sorted({e["step"] for e in self.entries})

    def load(self, entries: list[dict]) -> list[dict]:
        """The full records of `entries` (from `self.entries`)."""
        records = []
        if not entries:
            return records
        with open(self.path, "rb") as f:
            for e in entries:
                f.seek(e["offset"])
                records.append(json.loads(f.read(e["length"])))
        return records


def _summary(record: dict, offset: int, length: int, earlier: list[dict]) -> dict:
    if "group" in record:
        group, index = record["group"], record.get("index", 0)
    else:  # traces written before per-token records: one group per step, in order
        index = sum(1 for e in earlier if e["step"] == record["step"])
        group = 0
    return {"step": record["step"], "group": group, "index": index, "offset": offset, "length": length,
            "reward": record.get("reward"), "advantage": record.get("advantage"),
            "finish": record.get("finish"), "correct": record.get("correct"),
            "tool_failures": record.get("tool_failures") or 0}


def is_mismatch(entry: dict) -> bool:
    """Answer judged correct with reward 0, or judged wrong with a reward above 0 (partial credit a
    policy can farm, or a reward bug)."""
    correct, reward = entry.get("correct"), entry.get("reward")
    if correct is None or reward is None:
        return False
    return (correct > 0 and reward <= 0) or (correct <= 0 and reward > 0)


def filter_entries(entries: list[dict], *, step=None, finish: str = "", min_reward=None, max_reward=None,
                   tool_failures: bool = False, mismatch: bool = False) -> list[dict]:
    """The entries that pass every filter that is set; `step` None = every step."""
    out = []
    for e in entries:
        if step is not None and e["step"] != step:
            continue
        if finish and e["finish"] != finish:
            continue
        if min_reward is not None and (e["reward"] is None or e["reward"] < min_reward):
            continue
        if max_reward is not None and (e["reward"] is None or e["reward"] > max_reward):
            continue
        if tool_failures and not e["tool_failures"]:
            continue
        if mismatch and not is_mismatch(e):
            continue
        out.append(e)
    return out
