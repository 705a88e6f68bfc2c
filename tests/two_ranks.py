"""Two trainer ranks in child processes for the FSDP2 tests: `run_two_ranks(fn, *args)` calls
`fn(rank, port, *args)` in each (port: a free one for their rendezvous) and waits for both, failing
the test if either raises or they hang past `timeout_s` (a collective waiting for the other rank)."""
import socket
import time
import warnings

import pytest
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _finished(fn, args, start_method: str, timeout_s: float) -> bool:
    """Both ranks ran `fn` to the end (a rank's error is raised); False if they hung and were killed."""
    ranks = mp.start_processes(fn, args=(_free_port(), *args), nprocs=2, start_method=start_method, join=False)
    deadline = time.monotonic() + timeout_s
    while not ranks.join(timeout=1):  # raises if a rank failed
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            return False
    return True


def run_two_ranks(fn, *args, start_method: str = "fork", timeout_s: float = 180):
    # fork on CPU: the children start with torch and transformers already imported (spawn re-imports
    # them, ~15 s on 2 cores). CUDA cannot be forked: "spawn" there. A forked child can deadlock on a
    # lock that another thread of the test worker held at the fork (seen once in 2026-11-29's suite):
    # two ranks that hang under fork run again under spawn, and hanging there too fails the test.
    if _finished(fn, args, start_method, timeout_s):
        return
    if start_method == "fork":
        warnings.warn(f"the two forked ranks did not finish within {timeout_s:.0f} s: running them again, spawned")
        if _finished(fn, args, "spawn", timeout_s + 60):
            return
    pytest.fail(f"the two ranks did not finish within {timeout_s:.0f} s (a collective hung?)")
