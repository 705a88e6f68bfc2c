import multiprocessing
import os
import time

import pytest

from lib.cache import build_once


def _build_slowly(out_dir: str, log: str):
    def build(tmp):
        with open(log, "a") as f:
            f.write("built\n")
        time.sleep(0.5)
        with open(os.path.join(tmp, "data.txt"), "w") as f:
            f.write("ok")
    build_once(out_dir, build)


def test_processes_asking_for_the_same_directory_at_once_build_it_once(tmp_path):
    # Parallel test workers (and ranks) building the same cached model or warm start: the second
    # waits for the first and reuses its directory instead of training it again.
    out_dir, log = str(tmp_path / "cache" / "thing"), str(tmp_path / "log")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_build_slowly, args=(out_dir, log)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    assert open(log).read() == "built\n"
    assert open(os.path.join(out_dir, "data.txt")).read() == "ok"
    assert os.listdir(tmp_path / "cache") == ["thing"]  # no half-built copy or lock left


@pytest.mark.parametrize("value", [None, ""])
def test_an_unset_or_empty_agentrl_cache_means_the_home_cache_never_the_current_directory(monkeypatch, tmp_path, value):
    from lib.cache import cache_root

    monkeypatch.setenv("HOME", str(tmp_path))
    if value is None:
        monkeypatch.delenv("AGENTRL_CACHE", raising=False)
    else:
        monkeypatch.setenv("AGENTRL_CACHE", value)
    assert cache_root() == str(tmp_path / ".cache" / "agentrl")
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "mine"))
    assert cache_root() == str(tmp_path / "mine")
