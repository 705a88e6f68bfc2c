"""The cache of things built on first use (data sets, the tiny model, warm starts): where it lives
and how a directory in it is written so that a killed or concurrent build never leaves half of one."""
import contextlib
import fcntl
import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Callable


def cache_root() -> str:
    """$AGENTRL_CACHE, or ~/.cache/agentrl when it is unset or empty (an empty one would mean the
    current directory: the builds would land in whatever folder the script runs from)."""
    return os.environ.get("AGENTRL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "agentrl")


@contextmanager
def atomic_dir(out_dir: str):
    """Yield a temporary sibling of `out_dir` to fill; on success it is renamed to `out_dir`. If
    another process finished the same directory first, its copy is kept."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".tmp-{os.path.basename(out_dir)}-")
    try:
        yield tmp
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not os.path.isdir(out_dir):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def build_lock(out_dir: str):
    """Held while `out_dir` is built: a second process building the same directory (parallel test
    workers, ranks) waits here, then finds it built instead of building it again."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    lock_path = os.path.join(parent, f".{os.path.basename(out_dir)}.lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:  # built or failed, the cache keeps no lock file (a builder checks for the directory again)
            with contextlib.suppress(OSError):
                os.unlink(lock_path)


def build_once(out_dir: str, build: Callable[[str], object]) -> str:
    """`out_dir`, made by `build(tmp_dir)` unless it already exists. Processes that ask for the same
    directory at once (parallel test workers, ranks) wait for the first one's build instead of
    repeating it."""
    if os.path.isdir(out_dir):
        return out_dir
    with build_lock(out_dir):
        if not os.path.isdir(out_dir):
            with atomic_dir(out_dir) as tmp:
                build(tmp)
    return out_dir
