"""lib.viewer under hostile input: any query string gets a page or a 400 (never a 5xx); a bad record
in a run dir is skipped and counted, never breaks the page; a huge episode shows its first tokens
and pages through the rest; a slow page holds up no other; idle half-sent requests are dropped
after the socket timeout; metric and run names reach Plotly as text; a foreign Host is refused.

Records are written by hand here (no model, no tokenizer), so the module runs in seconds.
"""
import contextlib
import gzip
import html
import http.client
import json
import os
import re
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import lib.viewer
import lib.viewer_data
from lib.viewer import MAX_TOKENS_SHOWN, make_server, render_page


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def record(step=1, group=0, index=0, num_tokens=4, **fields) -> dict:
    """A trace record as lib/traces.py writes it, with `num_tokens` model tokens."""
    n = num_tokens
    return {"step": step, "group": group, "index": index, "question": "q?", "gold": "4", "answer": "4",
            "reward": 1.0, "advantage": 0.5, "finish": "answer", "correct": None, "tool_failures": 0, "stats": {},
            "prompt": "Question: q?\n", "turns": [{"role": "model", "start": 0, "end": n, "text": "tok " * n}],
            "tokens": {"id": list(range(n)), "text": [f"t{i} " for i in range(n)], "mask": [1] * n,
                       "lp": [-0.5] * n, "tlp": [-0.5] * n, "ver": [0] * n}, **fields}


def write_run(run_dir, records=(record(),), metrics=b'{"step": 1, "rollout/reward": 1.0}\n', trace_bytes=b"") -> str:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "traces.jsonl"), "wb") as f:
        f.write(b"".join(json.dumps(r).encode() + b"\n" for r in records) + trace_bytes)
    with open(os.path.join(run_dir, "metrics.jsonl"), "wb") as f:
        f.write(metrics)
    return str(run_dir)


@contextlib.contextmanager
def serving(run_dirs, **kwargs):
    server = make_server(run_dirs, port=0, **kwargs)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def get(server, path: str, host: str | None = None, timeout_s: float = 30) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=timeout_s)
    try:
        conn.putrequest("GET", path, skip_host=True)
        conn.putheader("Host", f"127.0.0.1:{server.server_address[1]}" if host is None else host)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, response.read().decode("utf-8")
    finally:
        conn.close()


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("good") / "run"
    return write_run(run_dir, [record(1, index=0), record(1, index=1, reward=0.0), record(2)],
                     b'{"step": 1, "rollout/reward": 0.5}\n{"step": 2, "rollout/reward": 1.0}\n')


@pytest.fixture(scope="module")
def server(good_run):
    with serving([good_run, good_run]) as server:
        yield server


# --- V1: query strings ---
@pytest.mark.parametrize("query", ["step=nan", "step=inf", "step=-inf", "step=1e309", "step=1.5", "run=nan",
                                   "run=inf", "min_reward=nan", "max_reward=1e309", "tokens_from=nan",
                                   pytest.param("step=" + "9" * 5000, id="step=9...9 (5000 digits)")])
def test_a_step_run_or_reward_that_is_not_a_finite_number_of_its_kind_is_a_400_naming_the_parameter(server, query):
    status, body = get(server, "/?" + query)
    assert status == 400 and query.split("=")[0] in body


QUERY_KEYS = st.sampled_from(["run", "step", "finish", "min_reward", "max_reward", "failures", "mismatch", "colour",
                              "group", "episode", "tokens_from", "x", "sort", "page", "q", "question", "compare"])
QUERY_VALUES = st.one_of(st.text(max_size=30), st.integers().map(str), st.floats().map(str),
                         st.sampled_from(["all", "", "nan", "-inf", "1e309", "0", "1", "2", "-1", "1_0", "٣"]))


@settings(max_examples=150, deadline=None, database=None)
@example("step=nan")  # what the review sent
@example("run=inf")
@given(query=st.one_of(st.lists(st.tuples(QUERY_KEYS, QUERY_VALUES), max_size=6).map(urllib.parse.urlencode),
                       st.text(max_size=60).map(lambda s: urllib.parse.quote(s, safe="=&%+;"))))
def test_any_query_string_gets_the_page_or_a_400_never_a_5xx(server, query):
    status, _ = get(server, "/?" + query)
    assert status in (200, 400)


@pytest.mark.parametrize("method", ["POST", "HEAD", "DELETE", "FOO"])
def test_a_method_other_than_get_is_a_405_not_a_501(server, method):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    conn.request(method, "/", headers={"Host": f"127.0.0.1:{server.server_address[1]}"})
    assert conn.getresponse().status == 405
    conn.close()


# --- V2: bad records ---
def with_tokens(**columns) -> dict:
    return record(index=1, tokens={**record()["tokens"], **columns})


METRICS_OK = b'{"step": 1, "rollout/reward": 1.0}\n'
BAD_RECORDS = {  # a run holding one good record and one that the viewer cannot show
    "metrics row with a string step": dict(metrics=METRICS_OK + b'{"step": "2", "rollout/reward": 1.0}\n'),
    "metrics row without a step": dict(metrics=METRICS_OK + b'{"rollout/reward": 1.0}\n'),
    "metrics line that is not JSON": dict(metrics=METRICS_OK + b'{"step": 2, oops\n'),
    "metrics line nested 100,000 deep": dict(metrics=METRICS_OK + b"[" * 100_000 + b"\n"),
    "trace with a string step": dict(records=[record(), record(step="2")]),
    "trace with a string reward": dict(records=[record(), record(index=1, reward="1.0")]),
    "trace with a reward past float range": dict(records=[record(), record(index=1, reward=10 ** 400)]),
    "trace with a list for its group": dict(records=[record(), record(group=[1])]),
    "trace with a turn without a role": dict(records=[record(), record(index=1, turns=[{"text": "x"}])]),
    "trace with a string log-prob": dict(records=[record(), with_tokens(lp=["a"] * 4)]),
    "trace with a log-prob past float range": dict(records=[record(), with_tokens(lp=[-10 ** 400] * 4)]),
    "trace with tokens lists of different lengths": dict(records=[record(), with_tokens(ver=[0])]),
    "trace line that is not JSON": dict(trace_bytes=b'{"step": 1, "group": 0, oops\n'),
    "trace line nested 100,000 deep": dict(trace_bytes=b"[" * 100_000 + b"\n"),
}


@pytest.mark.parametrize("case", list(BAD_RECORDS))
def test_a_bad_record_is_skipped_and_counted_and_every_run_still_renders(tmp_path, good_run, case):
    bad_run = write_run(tmp_path / "bad", **BAD_RECORDS[case])
    with serving([good_run, bad_run]) as server:
        for run in (0, 1):
            status, page = get(server, f"/?run={run}&step=1")
            assert status == 200, page
            assert 'class="group" data-step="1"' in page  # the good record of the run shown
        assert "1 bad record skipped" in page


def page_rendered_in_a_child(run_dir: str, timeout_s: float = 60) -> str:
    """The page of `run_dir` (every step), rendered by a child process with 1 GB of address space: a
    viewer that waits on a run file or reads one without end fails the test (a timeout, a MemoryError)
    instead of hanging the suite or filling the machine's memory."""
    code = ("import sys; from lib.viewer import render_page; "
            "sys.stdout.write(render_page([sys.argv[1]], {'step': ['all']}, {}))")
    child = subprocess.run([sys.executable, "-c", code, run_dir], cwd=REPO, capture_output=True, timeout=timeout_s,
                           preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30)))
    assert child.returncode == 0, child.stderr.decode(errors="replace")[-2000:]
    return child.stdout.decode()


@pytest.mark.parametrize("kind", ["a FIFO", "a symlink to /dev/zero", "a directory"])
@pytest.mark.parametrize("name", ["traces.jsonl", "metrics.jsonl"])
def test_a_run_file_that_is_not_a_regular_file_is_named_on_the_page_not_read(tmp_path, name, kind):
    run_dir = write_run(tmp_path / "run")
    os.remove(os.path.join(run_dir, name))
    path = os.path.join(run_dir, name)
    if kind == "a FIFO":
        os.mkfifo(path)
    elif kind == "a directory":
        os.mkdir(path)
    else:
        os.symlink("/dev/zero", path)
    page = page_rendered_in_a_child(run_dir)
    assert f"{name} is not a regular file" in html.unescape(page)
    if name == "metrics.jsonl":
        assert 'class="group" data-step="1"' in page  # the traces are read all the same


def test_a_run_file_past_the_size_bound_is_read_to_the_bound_and_named_on_the_page(tmp_path, monkeypatch):
    rows = b"".join(b'{"step": %d, "rollout/reward": 0.5}\n' % step for step in range(10))
    run_dir = write_run(tmp_path / "run", metrics=rows)
    monkeypatch.setattr(lib.viewer_data, "MAX_RUN_FILE_BYTES", len(rows) // 2)
    run = lib.viewer.load_run(run_dir, {})
    assert [r["step"] for r in run["metrics"]["rows"]] == [0, 1, 2, 3, 4]
    assert any(f"metrics.jsonl is {len(rows)} bytes" in problem and "first" in problem for problem in run["bad"])


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10 ** 400, 10 ** 400) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=8)
RECORD_PATHS = ["step", "group", "index", "reward", "advantage", "correct", "finish", "tool_failures", "question",
                "gold", "answer", "prompt", "stats", "turns", "turns.0", "turns.0.role", "turns.0.text", "tokens",
                "tokens.id", "tokens.text", "tokens.mask", "tokens.lp", "tokens.tlp", "tokens.ver", "tokens.id.0",
                "tokens.text.1", "tokens.mask.2", "tokens.lp.3", "tokens.tlp.0", "tokens.ver.1"]


def replaced(rec: dict, path: str, value) -> dict:
    """`rec` with the value at `path` (dotted keys and list indexes) replaced by `value`."""
    rec = json.loads(json.dumps(rec))
    *parents, last = path.split(".")
    parent = rec
    for key in parents:
        parent = parent[int(key)] if isinstance(parent, list) else parent[key]
    parent[int(last) if isinstance(parent, list) else last] = value
    return rec


@settings(max_examples=300, deadline=None, database=None)
@given(path=st.sampled_from(RECORD_PATHS), value=JSON_VALUES, metric_key=st.text(max_size=10), metric_value=JSON_VALUES)
def test_any_value_anywhere_in_a_record_gives_the_page_with_the_record_or_it_counted_as_bad(
        tmp_path_factory, path, value, metric_key, metric_value):
    run = write_run(tmp_path_factory.mktemp("any"), [replaced(record(), path, value)],
                    json.dumps({"step": 1, "rollout/reward": 1.0, metric_key: metric_value}).encode() + b"\n")
    for colour in ("lp", "gap"):
        page = render_page([run], {"step": ["all"], "colour": [colour]}, {})
        # the record is shown, or the bad records' list names it (the metrics row may be bad as well: its
        # key can be "step", e.g. {"step": null})
        assert ('class="group"' in page) != ("traces.jsonl line 1:" in page)


def test_a_log_prob_above_709_or_nan_is_shown_not_a_500(tmp_path, good_run):
    tokens = {**record()["tokens"], "lp": [710.0, float("nan"), -1e308, 0], "tlp": [float("inf"), 0, 0, 0]}
    bad_run = write_run(tmp_path / "bad", [record(tokens=tokens)])
    with serving([good_run, bad_run]) as server:
        status, page = get(server, "/?run=1")
        assert status == 200 and "server 710.0000" in page and "bad record" not in page
        assert get(server, "/?run=1&colour=gap")[0] == 200


def test_a_lone_surrogate_in_a_trace_is_shown_replaced(tmp_path, good_run):
    turns = [{"role": "model", "text": "before \udcff after"}]
    bad_run = write_run(tmp_path / "bad", [record(answer="\ud800 answer", question="\udfff question", turns=turns)])
    with serving([good_run, bad_run]) as server:
        status, page = get(server, "/?run=1")
        assert status == 200 and "before ? after" in page and "? answer" in page and "? question" in page
    out = tmp_path / "page.html"
    lib.viewer.main([bad_run, "--out", str(out)])
    assert "before ? after" in out.read_text(encoding="utf-8")


def test_a_byte_that_is_not_utf8_loses_only_itself(tmp_path, good_run):
    episode = json.dumps(record(index=1, question="Q-mark")).encode().replace(b"Q-mark", b"\xffQ-mark")
    metrics = b'{"step": 1, "rollout/reward": 1.0}\n{"step": 2, "rollout/reward": 0.25, "note": "\xfe"}\n'
    bad_run = write_run(tmp_path / "bad", [record()], metrics, trace_bytes=episode + b"\n")
    with serving([good_run, bad_run]) as server:
        status, page = get(server, "/?run=1")
    assert status == 200 and "2 episodes match" in page and "\ufffdQ-mark" not in page  # group question: the first's
    assert "last step 2" in page and "bad record" not in page
    assert "\ufffdQ-mark" in render_page([bad_run], {"step": ["1"], "episode": ["1"]}, {})


# --- V3: huge episodes, and no page waits for another ---
def test_a_huge_episode_shows_its_first_tokens_and_a_link_to_the_next_ones(tmp_path):
    num_tokens = 50_000
    run = write_run(tmp_path / "run", [record(num_tokens=num_tokens)])
    start = time.perf_counter()
    page = render_page([run], {}, {})
    assert time.perf_counter() - start < 5 and len(page) < 2_000_000
    assert f"#{MAX_TOKENS_SHOWN - 1} id" in page and f"#{MAX_TOKENS_SHOWN} id" not in page
    assert f"{num_tokens - MAX_TOKENS_SHOWN:,} more tokens" in page
    link = re.search(r'href="(\?[^"]*tokens_from=%d[^"]*)"' % MAX_TOKENS_SHOWN, page).group(1)
    query = urllib.parse.parse_qs(link[1:].replace("&amp;", "&"))
    assert query["step"] == ["1"] and query["group"] == ["0"] and query["episode"] == ["0"]
    page = render_page([run], query, {})
    assert f"#{MAX_TOKENS_SHOWN} id" in page and f"#{2 * MAX_TOKENS_SHOWN} id" not in page
    assert f"{num_tokens - 2 * MAX_TOKENS_SHOWN:,} more tokens" in page
    assert "50000 generated tokens" in page  # the episode's numbers are over all its tokens


def test_a_page_that_takes_long_to_render_does_not_hold_up_another(tmp_path, monkeypatch):
    slow_run = write_run(tmp_path / "slow", [record(question="slow")])
    fast_run = write_run(tmp_path / "fast", [record(question="fast")])
    release, slow_started = threading.Event(), threading.Event()
    episode_view = lib.viewer.episode_view

    def blocking_episode_view(rec, *args, **kwargs):
        if rec.get("question") == "slow":
            slow_started.set()
            release.wait(30)
        return episode_view(rec, *args, **kwargs)

    monkeypatch.setattr(lib.viewer, "episode_view", blocking_episode_view)
    with serving([slow_run, fast_run]) as server:
        slow = threading.Thread(target=get, args=(server, "/?run=0"))
        slow.start()
        try:
            assert slow_started.wait(10)
            status, page = get(server, "/?run=1", timeout_s=5)
            assert status == 200 and "fast" in page
        finally:
            release.set()
            slow.join()


# --- V4: idle and half-sent requests ---
def half_sent_requests(server, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.create_connection(server.server_address[:2], timeout=10)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1")  # and then nothing
        socks.append(sock)
    return socks


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_half_sent_requests_are_dropped_after_the_socket_timeout_and_pages_still_answer(good_run):
    with serving([good_run], timeout_s=0.5) as server:
        socks = half_sent_requests(server, 20)
        try:
            assert get(server, "/", timeout_s=10)[0] == 200
            for sock in socks:
                sock.settimeout(3)
                assert closed_by_server(sock)
        finally:
            for sock in socks:
                sock.close()


def test_connections_past_the_bound_wait_for_a_thread_instead_of_each_taking_one(good_run):
    with serving([good_run], timeout_s=0.5, max_connections=4) as server:
        threads_before = threading.active_count()
        socks = half_sent_requests(server, 12)
        try:
            time.sleep(0.2)
            assert threading.active_count() - threads_before <= 4
            start = time.perf_counter()
            assert get(server, "/", timeout_s=10)[0] == 200  # once the half-sent ones ahead of it time out
            assert time.perf_counter() - start < 5
        finally:
            for sock in socks:
                sock.close()


# --- V5: names that reach Plotly, and the Host header ---
def test_metric_and_run_names_reach_the_page_as_json_data_that_cannot_end_its_script(tmp_path):
    evil = '</script><script>document.title="pwned"</script><span style="x">m</span>&amp;'
    metrics = json.dumps({"step": 1, "rollout/reward": 1.0, evil: 2.0, "loss/" + evil: 3.0}).encode() + b"\n"
    run = write_run(tmp_path / "<b>run", [record()], metrics)
    page = render_page([run], {}, {}, plotly_inline=True)  # a saved page holds the series inline
    data = re.search(r'<script type="application/json" id="viewer-data">(.*?)</script>', page, re.S).group(1)
    assert "</script>" not in data and "<span" not in data and "<b>" not in data  # \u003c in the JSON
    parsed = json.loads(data)
    assert evil in parsed["keys"] and evil in parsed["series"][0]["series"] and parsed["runs"] == ["<b>run"]
    assert page.count("<script") == 3  # plotly.min.js, the data, the code: nothing injected
    # The page draws them into Plotly's HTML-capable labels through esc(): the browser test checks it
    # (tests/test_viewer_browser.py), here that esc() is what names go through.
    assert "name: esc(t.key)" in page and "title: {text: esc(title)" in page


@pytest.mark.parametrize("config", [b"{oops", b"[1, 2]", b"[" * 100_000, b'{"lr": "<script>alert(1)</script>"}',
                                    b'{"a": ' * 50 + b"1" + b"}" * 50, b"\xff\xfe"])
def test_a_config_file_that_is_not_a_mapping_or_holds_markup_is_named_or_escaped_and_the_page_renders(tmp_path, config):
    run = write_run(tmp_path / "run", [record()])
    with open(os.path.join(run, "config.json"), "wb") as f:
        f.write(config)
    page = render_page([run], {}, {})
    assert 'class="group"' in page and "<script>alert" not in page
    assert "(unreadable)" in page or "&lt;script&gt;alert(1)" in page or "a.a.a.a" in page


# --- the JSON endpoints ---
@pytest.mark.parametrize("path, param", [
    ("/api/series?run=nan", "run"), ("/api/series?run=5", "run"), ("/api/series?run=-1", "run"),
    ("/api/series?since=-1", "since"), ("/api/series?since=1.5", "since"), ("/api/series?generation=x", "generation"),
    ("/api/episode?step=1&group=0", "episode"), ("/api/episode?step=1&group=0&episode=0&run=9", "run"),
    ("/api/episode?step=x&group=0&episode=0", "step"), ("/?sort=evil", "sort"), ("/?question=<b>", "question"),
    ("/?q=" + "x" * 201, "q"), ("/?page=-1", "page"), ("/?page=nan", "page")])
def test_a_bad_parameter_of_a_json_endpoint_or_a_new_page_parameter_is_a_400_naming_it(server, path, param):
    status, body = get(server, path)
    assert status == 400 and param in body
    if path.startswith("/api/"):
        assert param in json.loads(body)["error"]


def test_series_of_non_finite_metrics_are_valid_json_with_nulls_and_a_refresh_sends_only_new_rows(tmp_path):
    run = write_run(tmp_path / "run", [record()], b'{"step": 1, "a": NaN, "b": Infinity, "c": 1e999, "d": 1}\n')
    with serving([run]) as server:
        status, body = get(server, "/api/series?run=0")
        payload = json.loads(body)  # strict JSON: a NaN would not parse in a browser
        assert status == 200 and "NaN" not in body and "Infinity" not in body
        assert payload["series"]["a"] == [[1], [None]] and payload["series"]["d"] == [[1], [1.0]]
        with open(os.path.join(run, "metrics.jsonl"), "ab") as f:
            f.write(b'{"step": 2, "d": 2}\n')
        again = json.loads(get(server, f"/api/series?run=0&since={payload['rows']}&generation={payload['generation']}")[1])
        assert again["series"] == {"d": [[2], [2.0]]} and not again["reset"] and again["rows"] == 2
        with open(os.path.join(run, "metrics.jsonl"), "wb") as f:  # a resume cut the file back
            f.write(b'{"step": 1, "d": 5}\n')
        cut = json.loads(get(server, f"/api/series?run=0&since={again['rows']}&generation={again['generation']}")[1])
        assert cut["reset"] and cut["series"] == {"d": [[1], [5.0]]}


def test_big_responses_go_gzipped_to_a_client_that_asks_and_plain_to_one_that_does_not(tmp_path):
    rows = b"".join(json.dumps({"step": s, "rollout/reward": s / 3}).encode() + b"\n" for s in range(5000))
    run = write_run(tmp_path / "run", [record()], rows)
    with serving([run]) as server:
        for accept in ("gzip, deflate", None):
            conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
            headers = {"Host": f"127.0.0.1:{server.server_address[1]}", **({"Accept-Encoding": accept} if accept else {})}
            conn.request("GET", "/api/series?run=0", headers=headers)
            response = conn.getresponse()
            body = response.read()
            conn.close()
            if accept:
                assert response.getheader("Content-Encoding") == "gzip" and len(body) == int(response.getheader("Content-Length"))
                body = gzip.decompress(body)
            else:
                assert response.getheader("Content-Encoding") is None
            assert json.loads(body)["series"]["rollout/reward"][0][-1] == 4999


API_QUERY_KEYS = st.sampled_from(["run", "since", "generation", "step", "group", "episode", "tokens_from", "colour", "x"])


@settings(max_examples=100, deadline=None, database=None)
@given(path=st.sampled_from(["/api/series", "/api/episode"]),
       query=st.one_of(st.lists(st.tuples(API_QUERY_KEYS, QUERY_VALUES), max_size=5).map(urllib.parse.urlencode),
                       st.text(max_size=60).map(lambda s: urllib.parse.quote(s, safe="=&%+;"))))
def test_any_query_string_of_a_json_endpoint_gets_json_with_a_200_or_a_400(server, path, query):
    status, body = get(server, path + "?" + query)
    assert status in (200, 400) and isinstance(json.loads(body), dict)


def test_an_episode_as_json_holds_its_token_texts_escaped_only_by_json(tmp_path):
    evil = "<script>x</script>"
    run = write_run(tmp_path / "run", [record(tokens={**record()["tokens"], "text": [evil, "b", "c", "d"]})])
    with serving([run]) as server:
        status, body = get(server, "/api/episode?run=0&step=1&group=0&episode=0")
        assert status == 200 and json.loads(body)["tokens"][0]["text"] == evil
        assert json.loads(get(server, "/api/episode?run=0&step=9&group=0&episode=0")[1]) == {"found": False}


@pytest.mark.parametrize("host, status", [
    ("127.0.0.1:{port}", 200), ("localhost:{port}", 200), ("LOCALHOST:{port}", 200), ("[::1]:{port}", 200),
    ("evil.example:{port}", 421), ("evil.example", 421), ("127.0.0.1:{other}", 421), ("localhost", 421),
    ("127.0.0.1:x", 421), ("", 421)])
def test_a_request_for_another_host_name_is_refused_against_dns_rebinding(server, host, status):
    port = server.server_address[1]
    assert get(server, "/", host=host.format(port=port, other=port + 1))[0] == status
    assert get(server, "/plotly.min.js", host=host.format(port=port, other=port + 1))[0] == status
    assert get(server, "/api/series", host=host.format(port=port, other=port + 1))[0] == status
