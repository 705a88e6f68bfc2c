"""lib.launch starts a server in its own process group, waits for a real generation, reports a failed
start with the server's log, and makes sure the server's whole process group dies with the trainer.

A few lines of stdlib HTTP stand in for SGLang here (its /generate answer shape, and a child process
of its own, as SGLang's scheduler is); the real CPU server is launched in tests/test_client.py.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import requests

from lib.launch import ServerProcess, free_port, launch_server_process, wait_for_server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Spawns a grandchild (`sleep`) in the server's process group, logs both pids, serves /generate.
FAKE_SERVER = textwrap.dedent("""
    import http.server, json, subprocess, sys, os
    helper = subprocess.Popen(["sleep", "300"])
    print(f"server pid {os.getpid()} helper pid {helper.pid}", flush=True)
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"text": "", "output_ids": [1, 2], "meta_info": {
                "finish_reason": {"type": "length", "length": 2}}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
""")


def _pids_from_log(log_path: str) -> tuple[int, int]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in open(log_path):
            if line.startswith("server pid"):
                words = line.split()
                return int(words[2]), int(words[5])
        time.sleep(0.05)
    raise AssertionError(f"fake server logged no pids; log:\n{open(log_path).read()}")


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """True once `pid` no longer runs (a zombie left for its parent to reap counts as gone)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def _launch_fake(tmp_path) -> ServerProcess:
    port = free_port()
    return launch_server_process([sys.executable, "-c", FAKE_SERVER, str(port)], host="127.0.0.1", port=port,
                                 log_path=str(tmp_path / "fake.log"), timeout_s=30)


def test_launch_returns_once_the_server_answers_a_generation(tmp_path):
    server = _launch_fake(tmp_path)
    try:
        r = requests.post(server.address + "/generate", json={"input_ids": [1]}, timeout=5)
        assert r.json()["output_ids"] == [1, 2]
    finally:
        server.terminate()


def test_a_server_that_exits_at_start_up_raises_with_its_exit_code_and_log_tail(tmp_path):
    script = "print('loading weights from /nonexistent/model'); print('OSError: no such model'); raise SystemExit(3)"
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        launch_server_process([sys.executable, "-c", script], host="127.0.0.1", port=port,
                              log_path=str(tmp_path / "bad.log"), timeout_s=60, hint="check --model-path")
    message = str(info.value)
    assert "exited with code 3" in message
    assert "OSError: no such model" in message
    assert "check --model-path" in message
    assert time.monotonic() - t0 < 10, "a dead server must be noticed at once, not at the timeout"


def test_wait_for_server_times_out_naming_the_address():
    address = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TimeoutError, match=f"{address} did not answer"):
        wait_for_server(address, timeout_s=1.0)


def test_terminate_kills_the_servers_whole_process_group(tmp_path):
    server = _launch_fake(tmp_path)
    server_pid, helper_pid = _pids_from_log(server.log_path)
    assert not _gone(server_pid, within_s=0) and not _gone(helper_pid, within_s=0)
    server.terminate(timeout_s=5)
    assert _gone(server_pid) and _gone(helper_pid)


TRAINER = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, {repo!r})
    from lib.launch import free_port, launch_server_process
    def launch():
        port = free_port()
        launch_server_process([sys.executable, "-c", {fake!r}, str(port)], host="127.0.0.1", port=port,
                              log_path={log!r}, timeout_s=30)
    if {in_thread!r}:  # as a supervisor's restart does: from a thread that ends before the trainer
        thread = threading.Thread(target=launch)
        thread.start()
        thread.join()
    else:
        launch()
    print("ready", flush=True)
    time.sleep(300)
""")


def _start_trainer(tmp_path, in_thread: bool = False) -> tuple[subprocess.Popen, str]:
    log = str(tmp_path / "fake.log")
    script = TRAINER.format(repo=REPO, fake=FAKE_SERVER, log=log, in_thread=in_thread)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert trainer.stdout.readline().strip() == "ready"
    return trainer, log


def _kill_group(trainer: subprocess.Popen, pgid: int):
    trainer.kill()
    trainer.wait()
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_sigterm_to_the_trainer_terminates_its_servers(tmp_path):
    trainer, log = _start_trainer(tmp_path)
    server_pid, helper_pid = _pids_from_log(log)
    try:
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(timeout=20) == 128 + signal.SIGTERM
        assert _gone(server_pid) and _gone(helper_pid)
    finally:
        _kill_group(trainer, server_pid)


def test_a_sigkilled_trainer_takes_its_server_with_it(tmp_path):
    trainer, log = _start_trainer(tmp_path)
    server_pid, _ = _pids_from_log(log)
    try:
        trainer.kill()
        trainer.wait(timeout=10)
        # PR_SET_PDEATHSIG reaches the server itself; SGLang's own children follow their parent the
        # same way (the fake's `sleep` does not, and is cleaned up below).
        assert _gone(server_pid)
    finally:
        _kill_group(trainer, server_pid)


def test_a_server_launched_from_a_thread_outlives_the_thread_and_dies_with_the_sigkilled_trainer(tmp_path):
    trainer, log = _start_trainer(tmp_path, in_thread=True)
    server_pid, _ = _pids_from_log(log)
    try:
        assert not _gone(server_pid, within_s=1.0)  # the launching thread has ended, the server runs on
        trainer.kill()
        trainer.wait(timeout=10)
        assert _gone(server_pid)
    finally:
        _kill_group(trainer, server_pid)


def test_free_port_can_stay_below_a_bound():
    # SGLang 0.5.15 refuses to start when its port + 10000 (its gRPC port) is over 65535.
    assert all(free_port(below=55536) < 55536 for _ in range(50))


# Stands in for `python -m sglang.launch_server`: the first `fail_starts` starts print SGLang 0.5.15's message
# for a KV cache that the GPU's memory no longer holds (or another error) and exit 1; later starts serve.
FAKE_SGLANG = textwrap.dedent("""
    import os, sys
    args = sys.argv[1:]
    port = args[args.index("--port") + 1]
    count = os.path.join(os.environ["FAKE_SGLANG_DIR"], "starts")
    starts = int(open(count).read()) + 1 if os.path.exists(count) else 1
    open(count, "w").write(str(starts))
    if starts <= int(os.environ["FAKE_SGLANG_FAIL_STARTS"]):
        print("Traceback (most recent call last):")
        print(os.environ["FAKE_SGLANG_ERROR"], flush=True)
        raise SystemExit(1)
    sys.argv = ["fake", port]
    exec(open(os.path.join(os.environ["FAKE_SGLANG_DIR"], "server.py")).read())
""")


def _fake_sglang_env(tmp_path, fail_starts: int, error: str) -> dict:
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (tmp_path / "sglang" / "launch_server.py").write_text(FAKE_SGLANG)
    (tmp_path / "server.py").write_text(FAKE_SERVER)
    return {"PYTHONPATH": str(tmp_path), "FAKE_SGLANG_DIR": str(tmp_path), "FAKE_SGLANG_FAIL_STARTS": str(fail_starts),
            "FAKE_SGLANG_ERROR": error}


POOL_ERROR = ("ValueError: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=0.15. "
              "Raise --mem-fraction-static above 0.172 (minimum viable = 1 - available/pre = 0.1720).")


def test_sglang_that_lost_its_kv_cache_memory_to_a_neighbour_is_started_again(tmp_path, capsys):
    from lib.launch import launch_sglang
    env = _fake_sglang_env(tmp_path, fail_starts=1, error=POOL_ERROR)
    server = launch_sglang("/no/model", mem_fraction_static=0.15, env=env, log_path=str(tmp_path / "sglang.log"),
                           timeout_s=30, retry_wait_s=0.1)
    try:
        answer = requests.post(server.address + "/generate", json={"input_ids": [1]}, timeout=5).json()
        assert answer["output_ids"] == [1, 2]
    finally:
        server.terminate()
    assert (tmp_path / "starts").read_text() == "2"
    assert "found no memory left for its KV cache" in capsys.readouterr().out
    assert POOL_ERROR in (tmp_path / "sglang.log").read_text()  # the first start's error stays in the log


def test_sglang_failing_for_another_reason_or_every_time_raises_without_more_starts(tmp_path):
    from lib.launch import launch_sglang
    env = _fake_sglang_env(tmp_path, fail_starts=5, error="OSError: /no/model does not appear to have a config.json")
    with pytest.raises(RuntimeError, match="config.json"):
        launch_sglang("/no/model", env=env, log_path=str(tmp_path / "a.log"), timeout_s=30, retry_wait_s=0.1)
    assert (tmp_path / "starts").read_text() == "1"  # not the memory race: no second start
    (tmp_path / "starts").unlink()
    env["FAKE_SGLANG_ERROR"] = POOL_ERROR
    with pytest.raises(RuntimeError, match="no GPU memory for the KV cache"):
        launch_sglang("/no/model", env=env, log_path=str(tmp_path / "b.log"), timeout_s=30, retry_wait_s=0.1,
                      start_attempts=3)
    assert (tmp_path / "starts").read_text() == "3"  # the race every time: three starts, then the error
