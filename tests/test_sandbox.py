"""lib.sandbox: model-written code runs bounded, and the test process (the caller) is unharmed.

Hostile code gets short limits (timeout_s=1) so that the file stays fast; each test states one
behaviour. Tests that need root (namespaces, an own uid) say so and are skipped elsewhere; the
non-root path is tested by running the caller itself as `nobody` where this machine allows it."""
import asyncio
import json
import os
import pwd
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from lib.sandbox import SANDBOX_UID_BASE, arun_python, run_python

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="an own uid per run needs root")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def isolation() -> str:
    return run_python("pass").isolation


def require_namespaces(isolation: str):
    """Skips where the machine gives no namespaces: docs/sandbox.md says what is not prevented then."""
    if not isolation.startswith("namespaces"):
        pytest.skip(f"isolation here is {isolation!r}: without namespaces this is not prevented (docs/sandbox.md)")


def processes_with_arg(arg: str) -> list[int]:
    """Host pids whose command line has `arg` as one of its words (the sandbox's processes included)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    words = f.read().split(b"\0")
            except OSError:
                continue
            if arg.encode() in words:
                found.append(int(name))
    return found


def unique_sleep_arg() -> str:
    return f"{random.randrange(10**6, 10**7)}.25"  # `sleep` takes it; nothing else has it in argv


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# --- ordinary code ---

def test_stdout_and_exit_code_of_ordinary_code():
    r = run_python("print(1 + 1)\nprint('é')")
    assert (r.stdout, r.stderr, r.returncode, r.timed_out, r.output_truncated, r.error) == ("2\né\n", "", 0, False, False, None)
    assert 0 < r.wall_s < 5


def test_stderr_and_sys_exit_code():
    r = run_python("import sys\nprint('to err', file=sys.stderr)\nsys.exit(3)")
    assert (r.stdout, r.stderr, r.returncode, r.error) == ("", "to err\n", 3, None)
    assert run_python("import sys; sys.exit('bye')").stderr == "bye\n"


def test_syntax_error_is_reported_in_stderr():
    r = run_python("def f(:\n    pass")
    assert r.returncode == 1 and "SyntaxError" in r.stderr and r.error is None


def test_exception_traceback_shows_the_codes_frames_only():
    r = run_python("def f():\n    raise ValueError('bad')\nf()")
    assert r.returncode == 1
    assert r.stderr.startswith("Traceback (most recent call last):\n  File \"<string>\", line 3, in <module>")
    assert r.stderr.endswith("ValueError: bad\n") and "sandbox.py" not in r.stderr


def test_threads_and_atexit_run_before_the_exit_as_in_python():
    code = ("import atexit, threading, time\natexit.register(lambda: print('atexit'))\n"
            "threading.Thread(target=lambda: (time.sleep(0.1), print('thread'))).start()\nprint('main')")
    assert run_python(code).stdout == "main\nthread\natexit\n"


def test_working_dir_is_fresh_per_run_and_removed_afterwards(monkeypatch):
    made = []
    real_mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(real_mkdtemp(*a, **k)) or made[-1])
    first = run_python("import os\nopen('mine.txt', 'w').write('x')\nprint(sorted(os.listdir('.')))")
    second = run_python("import os\nprint(sorted(os.listdir('.')))")
    assert (first.stdout, second.stdout) == ("['mine.txt']\n", "[]\n")
    assert len(made) == 2 and not any(os.path.exists(path) for path in made)


def test_stdin_is_at_eof():
    r = run_python("import sys\nprint(repr(sys.stdin.read()))\ninput()")
    assert r.stdout == "''\n" and r.stderr.endswith("EOFError: EOF when reading a line\n")


def test_non_utf8_bytes_are_replaced():
    r = run_python("import sys\nsys.stdout.buffer.write(b'a\\xff\\xfeb\\n')")
    assert r.stdout == "a\ufffd\ufffdb\n" and r.returncode == 0


def test_odd_code_is_reported_not_raised():
    r = run_python("print(1)\x00")  # SyntaxError or ValueError, by Python version
    assert r.returncode == 1 and r.stderr.endswith("Error: source code string cannot contain null bytes\n")
    r = run_python("print('\ud800')")  # a lone surrogate, as a model's broken output may hold
    assert r.returncode == 1 and "surrogates not allowed" in r.stderr


def test_the_limits_are_set_as_asked():
    code = ("import resource as r\nfor n in ('CPU', 'AS', 'FSIZE', 'NPROC', 'NOFILE', 'CORE'):\n"
            "    print(n, *r.getrlimit(getattr(r, 'RLIMIT_' + n)))")
    r = run_python(code, timeout_s=2.5, memory_mb=300, max_file_mb=3, max_processes=5)
    limits = {line.split()[0]: tuple(map(int, line.split()[1:])) for line in r.stdout.splitlines()}
    assert limits["CPU"] == (4, 5)  # ceil(2.5) + 1 s, then SIGKILL a second later
    assert limits["AS"] == (300 << 20,) * 2 and limits["FSIZE"] == (3 << 20,) * 2
    assert limits["NOFILE"] == (256, 256) and limits["CORE"] == (0, 0)
    assert limits["NPROC"][0] >= 5  # not as root without namespaces, the caller's tasks are added


def test_bad_arguments_raise_errors_that_name_them():
    for kwargs, name in [({"timeout_s": -1}, "timeout_s"), ({"timeout_s": float("nan")}, "timeout_s"),
                         ({"memory_mb": 0}, "memory_mb"), ({"max_output_bytes": "64k"}, "max_output_bytes"),
                         ({"max_processes": True}, "max_processes")]:
        with pytest.raises(ValueError, match=name):
            run_python("print(1)", **kwargs)
    with pytest.raises(TypeError, match="code must be a str"):
        run_python(b"print(1)")
    with pytest.raises(ValueError, match="code is longer than"):
        run_python("#" * (2 << 20))


def test_installed_packages_are_importable_only_with_site_packages():
    code = "import pluggy\nprint('imported')"  # a dependency of pytest, so installed wherever this runs
    assert "ModuleNotFoundError: No module named 'pluggy'" in run_python(code).stderr
    assert run_python(code, site_packages=True).stdout == "imported\n"


def test_run_python_from_several_threads_at_once():
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run_python(f"print({i} * 2)"), range(8)))
    assert [r.stdout for r in results] == [f"{i * 2}\n" for i in range(8)]


# --- hostile code: each bounded, reported, and the caller unharmed ---

def test_infinite_loop_is_killed_at_the_wall_clock():
    r = run_python("while True:\n    pass", timeout_s=1)
    assert r.timed_out and r.returncode is None and r.error == "timed out after 1 s"
    assert 1 <= r.wall_s < 3


def test_sleep_is_killed_at_the_wall_clock():
    r = run_python("import time\nprint('before', flush=True)\ntime.sleep(100)", timeout_s=1)
    assert r.timed_out and r.stdout == "before\n" and r.wall_s < 3


def test_closing_its_pipes_then_sleeping_is_still_killed():
    r = run_python("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(100)", timeout_s=1)
    assert r.timed_out and r.wall_s < 3


def test_stopping_itself_with_sigstop_is_killed_at_the_wall_clock():
    r = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)", timeout_s=1)
    assert r.timed_out and r.wall_s < 3


def test_8_gb_allocation_hits_the_memory_limit():
    r = run_python("x = bytearray(8 * 1024 ** 3)", memory_mb=256)
    assert r.returncode == 1 and r.error == "memory limit 256 MB exceeded" and "MemoryError" in r.stderr


def test_50_mb_of_output_is_cut_and_the_run_ends():
    r = run_python("import sys\nfor _ in range(50):\n    print('x' * (1 << 20))\nimport time; time.sleep(100)",
                   max_output_bytes=65536, timeout_s=10)
    assert r.output_truncated and not r.timed_out and r.error == "output cut at 65536 bytes"
    assert r.stdout == "x" * 65536 and r.wall_s < 5


def test_a_huge_line_without_newline_is_cut():
    r = run_python("import sys\nsys.stdout.write('y' * 10 ** 7)", max_output_bytes=1000)
    assert r.output_truncated and r.stdout == "y" * 1000


def test_stderr_is_cut_on_its_own():
    r = run_python("import sys\nsys.stderr.write('e' * 5000)\nprint('ok')", max_output_bytes=100)
    assert r.output_truncated and r.stderr == "e" * 100


def test_fork_bomb_hits_the_process_limit():
    r = run_python("import os\nwhile True:\n    os.fork()", max_processes=8, timeout_s=5)
    assert not r.timed_out and r.error == "process limit 8 reached" and "BlockingIOError" in r.stderr


def test_subprocess_loop_hits_the_process_limit_and_leaves_nothing_behind():
    arg = unique_sleep_arg()
    r = run_python(f"import subprocess\nwhile True:\n    subprocess.Popen(['sleep', '{arg}'])", max_processes=8, timeout_s=5)
    assert r.error == "process limit 8 reached"
    assert wait_until(lambda: not processes_with_arg(arg), 2.0)


def test_background_processes_are_killed_when_the_run_ends(isolation):
    require_namespaces(isolation)  # without a PID namespace a setsid() child escapes
    arg = unique_sleep_arg()
    code = ("import os, subprocess\nsubprocess.Popen(['sleep', '{0}'])\n"
            "if os.fork() == 0:\n    os.setsid()\n    os.execvp('sleep', ['sleep', '{0}'])\nprint('left them')").format(arg)
    r = run_python(code)
    assert r.stdout == "left them\n" and r.returncode == 0
    assert wait_until(lambda: not processes_with_arg(arg), 2.0)


def test_socket_connect_to_a_local_listener_fails():
    if not run_python("pass").network_isolated:
        pytest.skip("no network namespace on this machine: the network is open (network_isolated=False)")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        r = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')")
        assert r.returncode == 1 and "connected" not in r.stdout and "OSError" in r.stderr
        listener.settimeout(0.1)
        with pytest.raises(socket.timeout):
            listener.accept()
    assert r.network_isolated


def test_network_true_leaves_the_network_on():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        r = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')",
                       network=True)
    assert r.stdout == "connected\n" and not r.network_isolated


def test_writes_outside_its_directory_fail(tmp_path, isolation):
    if not ROOT:
        require_namespaces(isolation)  # without them the code runs as the caller, with its rights
    target = tmp_path / "callers_file.txt"
    target.write_text("original")
    os.chmod(target, 0o666)  # even a world-writable file of the caller's is out of reach
    r = run_python(f"open({str(target)!r}, 'w').write('changed')")
    assert r.returncode == 1 and ("PermissionError" in r.stderr or "FileNotFoundError" in r.stderr)
    assert target.read_text() == "original"


@needs_root
def test_as_root_the_code_runs_as_an_unprivileged_uid_and_cannot_write_system_files():
    r = run_python("import os\nprint(os.getuid(), os.getgid())\nopen('/etc/agentrl_sandbox_probe', 'w')")
    uid, gid = map(int, r.stdout.split())
    assert uid == gid and uid >= SANDBOX_UID_BASE and r.isolation.endswith("+uid")
    assert r.stderr.endswith(("Read-only file system: '/etc/agentrl_sandbox_probe'\n",
                              "Permission denied: '/etc/agentrl_sandbox_probe'\n"))
    assert not os.path.exists("/etc/agentrl_sandbox_probe")


def test_world_writable_host_directories_are_read_only(isolation):
    require_namespaces(isolation)
    shared = [d for d in ("/run/lock", "/var/lock", "/var/tmp", "/dev/shm") if os.path.isdir(d)
              and os.stat(d).st_mode & 0o002]
    if not shared:
        pytest.skip("no world-writable directory outside /tmp on this machine")
    name = f"agentrl_sandbox_probe_{random.randrange(10**9)}"
    r = run_python(f"for d in {shared!r}:\n    try:\n        open(d + '/{name}', 'w')\n        print(d)\n"
                   "    except OSError:\n        pass")
    assert r.stdout == "" and r.returncode == 0
    assert not any(os.path.exists(f"{d}/{name}") for d in shared)


@needs_root
def test_as_root_the_callers_home_and_tmp_are_hidden(tmp_path, isolation):
    require_namespaces(isolation)
    (tmp_path / "secret.txt").write_text("s")
    r = run_python(f"import os\nprint(os.path.exists({str(tmp_path)!r}), os.path.expanduser('~root'))\n"
                   "print([n for n in os.listdir(os.path.expanduser('~root')) if not n.startswith('.pyenv')])")
    assert r.stdout.splitlines()[0] == f"False {os.path.expanduser('~root')}"
    assert r.stdout.splitlines()[1] in ("[]", "") or "PermissionError" in r.stderr


def test_concurrent_runs_do_not_see_each_others_files_or_the_callers_processes(isolation):
    require_namespaces(isolation)

    async def main():
        writer = arun_python("open('/tmp/secret', 'w').write('s')\nimport time\ntime.sleep(0.5)")
        reader = arun_python(f"import os, time\ntime.sleep(0.2)\nprint(os.listdir('/tmp'), "
                             f"os.path.exists('/proc/{os.getpid()}'), sorted(int(p) for p in os.listdir('/proc') "
                             "if p.isdigit()))")
        return await asyncio.gather(writer, reader)
    _, r = asyncio.run(main())
    assert r.stdout == "[] False [1, 2]\n"  # its own /tmp; in /proc only its init and itself


@needs_root
def test_concurrent_runs_get_different_uids():
    async def main():
        return await asyncio.gather(*[arun_python("import os, time\ntime.sleep(0.2)\nprint(os.getuid())")
                                      for _ in range(4)])
    uids = [int(r.stdout) for r in asyncio.run(main())]
    assert len(set(uids)) == 4


@pytest.fixture
def only_uid_held(monkeypatch, tmp_path):
    """As root: the sandbox with one uid (a lock directory of its own), held as a run elsewhere holds
    it; the fixture's value releases it."""
    import fcntl

    import lib.sandbox
    lock_dir = tmp_path / "uids"
    os.makedirs(lock_dir, mode=0o700)
    monkeypatch.setattr(lib.sandbox, "UID_LOCK_DIR", str(lock_dir))
    monkeypatch.setattr(lib.sandbox, "NUM_UID_SLOTS", 1)
    fd = os.open(lock_dir / "0.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    release = lambda: fcntl.flock(fd, fcntl.LOCK_UN)  # noqa: E731
    yield release
    os.close(fd)


@needs_root
@pytest.mark.parametrize("api", ["run_python", "arun_python"])
def test_as_root_a_run_waits_for_a_uid_to_be_free_then_runs(only_uid_held, api):
    threading.Timer(0.5, only_uid_held).start()  # the other run ends
    r = run_python("print(6 * 7)") if api == "run_python" else asyncio.run(arun_python("print(6 * 7)"))
    assert r.stdout == "42\n" and r.error is None


@needs_root
@pytest.mark.parametrize("api", ["run_python", "arun_python"])
def test_as_root_a_run_that_finds_no_free_uid_within_the_wait_is_a_failed_result_naming_the_cause(
        only_uid_held, monkeypatch, api):
    import lib.sandbox
    monkeypatch.setattr(lib.sandbox, "UID_WAIT_S", 0.3)
    r = run_python("print(1)") if api == "run_python" else asyncio.run(arun_python("print(1)"))
    assert r.returncode is None and not r.timed_out and r.stdout == ""
    assert "not run" in r.error and "all 1 sandbox uids" in r.error


def test_killing_its_parent_and_group_leaves_the_caller_alive(isolation):
    require_namespaces(isolation)  # without them, as the caller's uid, kill(-1) would reach the caller
    codes = ["import os\nos.kill(os.getppid(), 9)\nprint('after')", "import os, signal\nos.killpg(0, signal.SIGKILL)",
             "import os\nos.kill(-1, 9)"]
    for code in codes:
        r = run_python(code)
        assert r.error is None or r.error.startswith("killed by signal")
    assert run_python("print('still here')").stdout == "still here\n"


def test_deep_recursion_is_a_recursion_error():
    r = run_python("def f(n):\n    return f(n + 1)\nf(0)")
    assert r.returncode == 1 and r.stderr.endswith("RecursionError: maximum recursion depth exceeded\n")


def test_writing_a_big_file_hits_the_file_size_limit():
    r = run_python("with open('big', 'wb') as f:\n    f.write(b'x' * (3 << 20))", max_file_mb=2)
    assert r.returncode == 1 and r.error == "file size limit 2 MB exceeded"


def test_many_files_hit_the_working_directory_limit(isolation):
    require_namespaces(isolation)
    r = run_python("for i in range(10):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))", max_dir_mb=4)
    assert r.returncode == 1 and r.error == "working directory limit 4 MB exceeded"


# --- asyncio ---

def test_16_concurrent_arun_python_calls_all_finish_with_their_own_output():
    async def main():
        t0 = time.monotonic()
        results = await asyncio.gather(*[arun_python(f"import time\ntime.sleep(0.3)\nprint({i})", timeout_s=20)
                                         for i in range(16)])
        return results, time.monotonic() - t0
    results, wall_s = asyncio.run(main())
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(16)]
    assert wall_s < 16 * 0.3  # they overlapped


def test_arun_python_does_not_block_the_event_loop():
    async def main():
        ticks = [time.monotonic()]
        run = asyncio.create_task(arun_python("import time\ntime.sleep(0.5)"))
        while not run.done():
            await asyncio.sleep(0.01)
            ticks.append(time.monotonic())
        return ticks, await run
    ticks, r = asyncio.run(main())
    gaps_s = [b - a for a, b in zip(ticks, ticks[1:])]
    assert r.returncode == 0 and ticks[-1] - ticks[0] >= 0.5
    assert max(gaps_s) < 0.25  # the loop kept turning while the code ran (10 ms ticks; slack for a busy box)


def test_cancelling_arun_python_kills_the_child():
    arg = unique_sleep_arg()

    async def main():
        run = asyncio.create_task(arun_python(f"import os\nos.execvp('sleep', ['sleep', '{arg}'])", timeout_s=60))
        started = await asyncio.to_thread(wait_until, lambda: processes_with_arg(arg), 5.0)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        return started
    assert asyncio.run(main())
    assert wait_until(lambda: not processes_with_arg(arg), 2.0)


def test_arun_python_times_out_like_run_python():
    r = asyncio.run(arun_python("while True:\n    pass", timeout_s=1))
    assert r.timed_out and r.error == "timed out after 1 s" and r.wall_s < 3


# --- a fresh interpreter per run (warm=False) keeps the same behaviour ---

def test_a_fresh_interpreter_per_run_behaves_the_same():
    assert run_python("print(1 + 1)", warm=False).stdout == "2\n"
    r = run_python("import time\ntime.sleep(100)", timeout_s=1, warm=False)
    assert r.timed_out and r.wall_s < 3
    r = run_python("import os\nwhile True:\n    os.fork()", max_processes=8, timeout_s=5, warm=False)
    assert r.error == "process limit 8 reached"


def test_the_warm_interpreter_is_restarted_if_it_dies():
    from lib import sandbox
    assert run_python("print(1)").stdout == "1\n"
    sandbox._server["process"].kill()
    sandbox._server["process"].wait()
    assert run_python("print(2)").stdout == "2\n"


def test_the_warm_interpreter_outlives_the_thread_that_started_it():
    """It is the caller process's, not a thread's: a run_python from a worker thread that then ends
    (a thread pool's, asyncio.to_thread's) must not take it down with that thread."""
    import threading
    from lib import sandbox
    sandbox._server_socket()
    sandbox._server["process"].kill()  # so that the thread below starts the next one
    sandbox._server["process"].wait()
    results = []
    worker = threading.Thread(target=lambda: results.append(run_python("print(1)")))
    worker.start()
    worker.join()
    server = sandbox._server["process"]
    time.sleep(0.3)  # a signal sent when the thread ended would have landed by now
    assert results[0].stdout == "1\n" and server.poll() is None
    assert run_python("print(2)").stdout == "2\n" and sandbox._server["process"] is server


def test_the_warm_interpreter_ends_with_the_caller_even_while_a_fork_of_it_lives():
    """Killed with SIGKILL (no atexit runs) while a child it forked still holds a copy of its fds:
    the warm interpreter must not outlive the caller."""
    script = (f"import os, sys, time\nsys.path.insert(0, {REPO!r})\nfrom lib import sandbox\n"
              "sandbox.run_python('pass')\nif os.fork() == 0:\n    time.sleep(30)\n    os._exit(0)\n"
              "print(sandbox._server['process'].pid, flush=True)\ntime.sleep(30)\n")
    caller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, start_new_session=True)
    server_pid = None

    def running(pid):  # a zombie (left to an init that does not reap) has ended
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
        except OSError:
            return False
    try:
        server_pid = int(caller.stdout.readline())
        assert running(server_pid)
        caller.kill()
        caller.wait()
        assert wait_until(lambda: not running(server_pid), 3.0)
    finally:
        try:
            os.killpg(caller.pid, 9)  # the fork, still sleeping
        except ProcessLookupError:
            pass
        caller.stdout.close()
        if server_pid is not None and running(server_pid):
            os.kill(server_pid, 9)


def test_each_run_under_its_own_event_loop_reports_its_exit_status():
    """asyncio.run per call: the first call starts the warm interpreter in the loop's worker thread,
    which ends with that loop; every later run must still reach a living interpreter."""
    from lib import sandbox
    sandbox._server_socket()
    sandbox._server["process"].kill()  # so that the first call below starts it in asyncio.to_thread
    sandbox._server["process"].wait()
    codes = ["print(7)", "print(" * 2, "x = 'a' * 10**10"]
    results, servers = [], []
    for i in range(48):
        results.append(asyncio.run(arun_python(codes[i % 3], timeout_s=5)))
        servers.append(sandbox._server["process"].pid)
    expected = [(0, None), (1, None), (1, "memory limit 512 MB exceeded")] * 16
    assert [(r.returncode, r.error) for r in results] == expected
    assert all(r.stdout == "7\n" for r in results[::3]) and "SyntaxError" in results[1].stderr
    assert len(set(servers)) == 1  # started once, never killed in between


# --- without namespaces (namespaces=False, as on machines that refuse them): the rlimits still hold ---

def test_without_namespaces_the_limits_still_hold(monkeypatch):
    made = []
    real_mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(real_mkdtemp(*a, **k)) or made[-1])
    r = run_python("import os\nprint(os.getcwd())", namespaces=False)
    assert r.isolation == ("rlimits+uid" if ROOT else "rlimits") and r.stdout == made[0] + "\n"
    assert not os.path.exists(made[0])
    assert run_python("import time\ntime.sleep(100)", timeout_s=1, namespaces=False).timed_out
    assert run_python("x = bytearray(8 << 30)", memory_mb=256, namespaces=False).error == "memory limit 256 MB exceeded"
    r = run_python("import os\nwhile True:\n    os.fork()", max_processes=8, timeout_s=5, namespaces=False)
    assert r.error == "process limit 8 reached"
    assert run_python("print('x' * 10000)", max_output_bytes=10, namespaces=False).stdout == "x" * 10


# --- not as root ---

NOBODY_SCRIPT = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
sb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sb)
out = {}
for name, code, kwargs in [("print", "print(1 + 1)", {}), ("sleep", "import time; time.sleep(100)", {"timeout_s": 1}),
                           ("alloc", "x = bytearray(8 << 30)", {"memory_mb": 256}),
                           ("fork", "import os\\nwhile True: os.fork()", {"max_processes": 8, "timeout_s": 5}),
                           ("cut", "print('x' * 100000)", {"max_output_bytes": 100}),
                           ("write", f"open({sys.argv[2]!r}, 'w').write('changed')", {}),
                           ("kill_all", "import os; os.kill(-1, 9)", {}),  # only with namespaces: see the test
                           ("after_kill_all", "print('alive')", {})]:
    if name == "kill_all" and out["print"]["isolation"] != "namespaces":
        continue
    r = sb.run_python(code, **kwargs)
    out[name] = {"stdout": r.stdout, "stderr": r.stderr, "timed_out": r.timed_out, "error": r.error,
                 "isolation": r.isolation, "network_isolated": r.network_isolated}
print(json.dumps(out))
"""


def nobody_gid() -> int | None:
    try:
        return pwd.getpwnam("nobody").pw_gid
    except KeyError:
        return None


def python_for_nobody() -> str | None:
    """An interpreter (3.10+) that the user nobody can run here, or None."""
    for candidate in (sys.executable, shutil.which("python3") or "", "/usr/bin/python3"):
        if not candidate:
            continue
        try:
            ok = subprocess.run([candidate, "-I", "-S", "-c", "import sys; assert sys.version_info >= (3, 10)"],
                                user="nobody", group=nobody_gid(), extra_groups=[], capture_output=True, timeout=20,
                                cwd="/")
        except (OSError, subprocess.SubprocessError):
            continue
        if ok.returncode == 0:
            return candidate
    return None


@pytest.mark.slow
@needs_root
def test_as_another_user_the_limits_still_hold():
    python = python_for_nobody()
    if python is None:
        pytest.skip("no Python 3.10+ interpreter that the user nobody can run on this machine")
    victim_dir = tempfile.mkdtemp()
    victim = os.path.join(victim_dir, "callers_file.txt")
    with open(victim, "w") as f:
        f.write("original")
    for path in (victim_dir, victim):
        os.chown(path, pwd.getpwnam("nobody").pw_uid, nobody_gid())
    done = subprocess.run([python, "-I", "-S", "-c", NOBODY_SCRIPT, os.path.join(REPO, "lib", "sandbox.py"), victim],
                          user="nobody", group=nobody_gid(), extra_groups=[], capture_output=True, text=True,
                          timeout=60, cwd="/",
                          env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["print"]["stdout"] == "2\n" and out["print"]["isolation"] in ("namespaces", "rlimits")
    assert out["sleep"]["timed_out"]
    assert out["alloc"]["error"] == "memory limit 256 MB exceeded"
    assert out["fork"]["error"] == "process limit 8 reached"
    assert out["cut"]["error"] == "output cut at 100 bytes"
    with open(victim) as f:
        written = f.read()
    shutil.rmtree(victim_dir)
    if out["print"]["isolation"] == "namespaces":  # without them, the code may write the caller's files
        assert written == "original" and "Error" in out["write"]["stderr"]
        assert out["kill_all"]["stdout"] == "" and out["after_kill_all"]["stdout"] == "alive\n"
