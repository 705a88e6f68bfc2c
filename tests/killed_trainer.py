"""A trainer killed with SIGKILL never closes what it started: `after_sigkill(program)` runs `program`
(Python source, from the repository root) until it prints its workers' pids on one line, kills it with
SIGKILL, and returns (those pids, the ones still running `timeout_s` later)."""
import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has exited; only its parent's wait is missing
    except FileNotFoundError:
        return False


def after_sigkill(program: str, timeout_s: float = 20) -> tuple[list[int], list[int]]:
    trainer = subprocess.Popen([sys.executable, "-c", program], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in trainer.stdout.readline().split()]
        assert pids and all(running(pid) for pid in pids), pids
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    deadline = time.monotonic() + timeout_s
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids, [pid for pid in pids if running(pid)]
