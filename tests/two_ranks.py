"""Two trainer ranks in child processes for the FSDP2 tests: `run_two_ranks(fn, *args)` calls
`fn(rank, port, *args)` in each (port: a free one for their rendezvous) and waits for both, failing
the test if either raises or they hang past `timeout_s` (a collective waiting for the other rank)."""
import socket
import time

import pytest
import torch.multiprocessing as mp


def run_two_ranks(fn, *args, start_method: str = "fork", timeout_s: float = 180):
    # fork on CPU: the children start with torch and transformers already imported (spawn re-imports
    # them, ~15 s on 2 cores). CUDA cannot be forked: "spawn" there.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ranks = mp.start_processes(fn, args=(port, *args), nprocs=2, start_method=start_method, join=False)
    deadline = time.monotonic() + timeout_s
    while not ranks.join(timeout=1):  # raises if a rank failed
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the two ranks did not finish within {timeout_s:.0f} s (a collective hung?)")
