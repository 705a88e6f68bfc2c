"""Start an inference server (SGLang, or lib.cpu_server), wait until it really generates, and make
sure it dies with the trainer. `launch_server_process` does the same for any server process (the
retrieval server's launcher uses it with its own readiness check).

Each server runs in its own process group (its own session), so `terminate()` reaches every process
it spawned (SGLang's scheduler and detokenizer processes too), and Ctrl-C in the terminal reaches
only the trainer, which then tears the servers down itself. Three ways a server is stopped:
`ServerProcess.terminate()`, an atexit hook and SIGTERM/SIGINT handlers (trainer exits or is
interrupted), and PR_SET_PDEATHSIG on Linux (trainer is SIGKILLed or crashes hard).
"""
import atexit
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import requests

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(eq=False)  # identity equality: kept in a set of live servers
class ServerProcess:
    address: str  # "http://HOST:PORT"
    process: subprocess.Popen
    log_path: str

    def terminate(self, timeout_s: float = 10.0):
        """SIGTERM to the server's whole process group, SIGKILL to what is left after `timeout_s`."""
        _live_servers.discard(self)
        pgid = self.process.pid  # start_new_session made the server the leader of its own group
        with contextlib.suppress(ProcessLookupError):  # the group is gone already
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.process.poll()  # reap the leader, or it stays a zombie member of the group
            if not _group_alive(pgid):
                return
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):  # the group is gone already
            os.killpg(pgid, signal.SIGKILL)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def free_port(host: str = "127.0.0.1", below: int = 65536) -> int:
    """A TCP port under `below` that was free a moment ago (another process may still take it before
    the server binds)."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port < below:
            return port
    raise RuntimeError(f"no free port under {below} on {host}")


def wait_for_server(address: str, timeout_s: float = 300.0, *, process: subprocess.Popen | None = None,
                    log_path: str | None = None, input_ids: tuple = (0,)) -> None:
    """Block until `address` answers a real 2-token `/generate`; raise TimeoutError after `timeout_s`.

    A `/health` that answers is not enough: SGLang opens its port before the first forward (kernel
    compilation, CUDA graphs) and a half-started server fails later, in the middle of a rollout.
    With `process` given, fail as soon as it exits, with the tail of `log_path` in the error.
    """
    address = address.rstrip("/")
    body = {"input_ids": list(input_ids), "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    deadline = time.monotonic() + timeout_s
    last_error = "no answer yet"
    with requests.Session() as http:
        http.trust_env = False  # an HTTP(S)_PROXY from the environment must not capture 127.0.0.1
        while True:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"inference server for {address} exited with code {process.returncode} before "
                                   f"it answered a generation; last log lines ({log_path}):\n{log_tail(log_path)}")
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                tail = f"; last log lines ({log_path}):\n{log_tail(log_path)}" if log_path else ""
                raise TimeoutError(f"inference server at {address} did not answer a 2-token /generate within "
                                   f"{timeout_s:.0f} s (last error: {last_error}); check that it is running and "
                                   f"reachable, or raise the timeout{tail}")
            try:
                # Bounded attempts, so a server that hangs (e.g. one of SGLang's subprocesses died) is
                # asked again and its exit noticed; long enough for a first forward that compiles kernels.
                r = http.post(address + "/generate", json=body, timeout=(5, max(1.0, min(remaining_s, 60.0))))
                if r.status_code == 200 and "output_ids" in _json_or_empty(r):
                    return
                if 400 <= r.status_code < 500:
                    raise RuntimeError(f"inference server at {address} refused the start-up probe /generate "
                                       f"{body} with HTTP {r.status_code}: {r.text[:500]}")
                last_error = f"HTTP {r.status_code}: {r.text[:200]}"
            except (requests.ConnectionError, requests.Timeout) as e:
                last_error = f"{type(e).__name__}: {e}"
            time.sleep(0.25)


# SGLang sizes its KV cache as (GPU memory free after loading the weights) - (1 - mem_fraction_static) x
# (free before loading): whatever another process on the GPU allocates while SGLang loads (a second run's
# trainer, a warm start) comes off the cache, and past the static share SGLang stops with this message. The
# other process's memory is then counted as taken at the next start, so a second start usually fits.
SGLANG_POOL_RACE = "leave no GPU memory for the KV cache"


def launch_sglang(model_path: str, *, tokenizer_path: str | None = None, host: str = "127.0.0.1",
                  port: int | None = None, base_gpu_id: int = 0, tp_size: int = 1, dp_size: int = 1,
                  mem_fraction_static: float | None = None, context_length: int | None = None,
                  dtype: str = "auto", random_seed: int | None = None, extra_args=(), log_path: str | None = None,
                  timeout_s: float = 900.0, env: dict | None = None, start_attempts: int = 2,
                  retry_wait_s: float = 20.0) -> ServerProcess:
    """Run `python -m sglang.launch_server` and return once it answers a generation.

    `extra_args` go to SGLang unchanged (e.g. `["--attention-backend", "triton"]`). A start that fails
    because another process on the GPU took memory while SGLang loaded (`SGLANG_POOL_RACE`) is tried
    again, up to `start_attempts` starts in all, `retry_wait_s` apart; any other failure raises at once.
    """
    # Without it the first NCCL weight broadcast fails with "Cuda failure 'invalid argument'"
    # (SGLang 0.5.15, docs/sglang_contract.md §5).
    env = {"NCCL_CUMEM_ENABLE": "0", **(env or {})}
    for attempt in range(1, start_attempts + 1):
        # SGLang 0.5.15 also binds port + 10000 (SGLANG_GRPC_PORT) and refuses to start when that is over 65535.
        this_port = port or free_port(host, below=65536 - 10000)
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host,
               "--port", str(this_port), "--base-gpu-id", str(base_gpu_id), "--tp-size", str(tp_size),
               "--dp-size", str(dp_size), "--dtype", dtype]
        cmd += _flags({"--tokenizer-path": tokenizer_path or None, "--mem-fraction-static": mem_fraction_static,
                       "--context-length": context_length, "--random-seed": random_seed}, extra_args)
        try:
            return launch_server_process(cmd, host=host, port=this_port, log_path=log_path, timeout_s=timeout_s,
                                         env=env, name="sglang", hint="run the command above by hand to see why; "
                                         "is sglang installed (requirements-gpu.txt) and is the GPU free?")
        except RuntimeError as e:
            if attempt == start_attempts or SGLANG_POOL_RACE not in str(e):
                raise
            print(f"warning: SGLang on GPU {base_gpu_id} found no memory left for its KV cache after loading "
                  f"the weights (did another process on that GPU allocate meanwhile?); starting it again in "
                  f"{retry_wait_s:.0f} s (start {attempt + 1} of {start_attempts})", flush=True)
            time.sleep(retry_wait_s)


def launch_cpu_server(model_path: str, *, host: str = "127.0.0.1", port: int | None = None, device: str = "cpu",
                      dtype: str = "float32", max_running_requests: int = 32, context_length: int | None = None,
                      num_threads: int | None = None, random_seed: int | None = None, log_path: str | None = None,
                      timeout_s: float = 300.0, extra_args=()) -> ServerProcess:
    """Run `python -m lib.cpu_server` (SGLang's HTTP API on transformers) and return once it answers."""
    port = port or free_port(host)
    cmd = [sys.executable, "-m", "lib.cpu_server", "--model-path", model_path, "--host", host, "--port", str(port),
           "--device", device, "--dtype", dtype, "--max-running-requests", str(max_running_requests)]
    cmd += _flags({"--context-length": context_length, "--num-threads": num_threads, "--random-seed": random_seed},
                  extra_args)
    return launch_server_process(cmd, host=host, port=port, log_path=log_path, timeout_s=timeout_s,
                                 env=lib_importable_env(), name="cpu_server",
                                 hint="run the command above by hand to see why")


def _flags(optional: dict, extra_args=()) -> list[str]:
    """`--flag value` for each flag of `optional` whose value is not None, then `extra_args`."""
    return [str(a) for flag, value in optional.items() if value is not None for a in (flag, value)] + \
        [str(a) for a in extra_args]


def lib_importable_env() -> dict:
    """The environment a child that runs `python -m lib.…` needs, whatever the trainer's working
    directory is: the repository on PYTHONPATH."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)}


def launch_server_process(cmd: list, *, host: str, port: int, log_path: str | None = None, timeout_s: float = 300.0,
                          env: dict | None = None, name: str = "server", hint: str = "",
                          wait=wait_for_server) -> ServerProcess:
    """Run `cmd` (a server on host:port) in its own process group, appending its output to `log_path`
    (a temporary file if None), and return once `wait(address, timeout_s, process=, log_path=)`
    returns (default: it answers a generation). It dies with this process (module docstring)."""
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"{name}-{port}-", suffix=".log")
        os.close(fd)
    else:
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with open(log_path, "a") as log:  # a restarted server adds to its predecessor's log
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        process = _popen_dying_with_us(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env={**os.environ, **(env or {})}, start_new_session=True)
    server = ServerProcess(address=f"http://{host}:{port}", process=process, log_path=log_path)
    _register(server)
    try:
        wait(server.address, timeout_s, process=process, log_path=log_path)
    except BaseException as e:
        server.terminate()
        if isinstance(e, (RuntimeError, TimeoutError)):
            raise type(e)(f"{e}\ncommand: {' '.join(cmd)}" + (f"\nhint: {hint}" if hint else "")) from None
        raise
    return server


# Looked up in the parent: between fork and exec (where _die_with_parent runs) a dlopen could
# deadlock on a lock another thread of the trainer held at fork time.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def _die_with_parent():
    # Runs in the child between fork and exec: ask the kernel to SIGKILL it when the thread that
    # forked it dies, which covers a trainer killed by SIGKILL or the OOM killer.
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


_spawner: tuple[int, queue.SimpleQueue] | None = None  # (pid of the process it serves, its job queue)
_spawner_lock = threading.Lock()


def _popen_dying_with_us(cmd: list, **kwargs) -> subprocess.Popen:
    """subprocess.Popen(cmd, **kwargs) whose process (on Linux) is SIGKILLed when this one dies.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, not the process: a server
    started by a thread that ends first (a supervisor's restart) would die with it. So every server
    is forked by one daemon thread, which ends only with the process."""
    if _prctl is None:
        return subprocess.Popen(cmd, **kwargs)
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner[0] != os.getpid():  # a forked copy of us has no spawner thread
            _spawner = (os.getpid(), queue.SimpleQueue())
            threading.Thread(target=_spawn_forever, args=(_spawner[1],), name="server-spawner", daemon=True).start()
        jobs = _spawner[1]
    done = concurrent.futures.Future()
    jobs.put((cmd, kwargs, done))
    return done.result()


def _spawn_forever(jobs: queue.SimpleQueue):
    while True:
        cmd, kwargs, done = jobs.get()
        try:
            done.set_result(subprocess.Popen(cmd, preexec_fn=_die_with_parent, **kwargs))
        except BaseException as e:  # handed to the caller, which raises it
            done.set_exception(e)


def _group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` still runs (zombies, which the kernel keeps until their
    parent reaps them, do not count)."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after it
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def log_tail(log_path: str | None, num_lines: int = 40) -> str:
    """The last `num_lines` lines of a server's log, for an error message."""
    if not log_path:
        return "(no log)"
    try:
        with open(log_path, errors="replace") as f:
            return "".join(f.readlines()[-num_lines:])
    except OSError as e:
        return f"(log unreadable: {e})"


def _json_or_empty(r: requests.Response) -> dict:
    try:
        body = r.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


# --- teardown of every server this process started ---
_live_servers: set = set()
_handlers_installed = False
_previous_handlers: dict = {}


def terminate_all(timeout_s: float = 10.0):
    """Terminate every server launched by this process that is still registered."""
    for server in list(_live_servers):
        server.terminate(timeout_s)


def _register(server: ServerProcess):
    global _handlers_installed
    _live_servers.add(server)
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(terminate_all)
    # Signal handlers can only be set from the main thread; elsewhere atexit and PDEATHSIG remain.
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            _previous_handlers[sig] = signal.signal(sig, _on_signal)


def _on_signal(signum, frame):
    terminate_all(timeout_s=5.0)
    previous = _previous_handlers.get(signum)
    if callable(previous):
        return previous(signum, frame)  # e.g. SIGINT's default: raise KeyboardInterrupt
    if previous == signal.SIG_IGN:
        return
    # SIGTERM's default would end the process without running `finally` blocks or atexit hooks.
    raise SystemExit(128 + signum)
