"""Threads for the suite's processes under pytest-xdist (`-n 3`, the README's command).

Each end-to-end test runs a trainer and a server at once, and each test worker runs such a test: with
torch's default of one thread per core, two workers on two cores put eight threads on two cores, which spin
against each other. Under xdist each process (the workers and every process they start, which inherit the
environment) gets the cores divided by the workers and by the two busy processes of a test, at least one.
Measured on 2 cores (docs/benchmarks.md, "The test suite"): the search and fault tests 172 -> 162 s, their
CPU time -18%; the whole suite with three workers 619 -> 554 s. Set before torch is imported; an
OMP_NUM_THREADS of your own is kept.
"""
import os

if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // workers // 2))
