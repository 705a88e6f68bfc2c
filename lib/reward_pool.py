"""Reward computations in worker processes, each bounded in time: model output is untrusted input,
and a reward function fed a pathological completion (a regex that backtracks, a huge number to
parse) must cost its episode a 0, never the training run.

    pool = RewardPool(num_workers=2, timeout_s=5.0, preload=reward_fn)
    score = await pool.score(reward_fn, completion, gold)   # 0.0 on timeout or a dead worker (counted)

`reward_fn` must be importable by name (a module-level function of your script or of lib), since
the workers are spawned, not forked. The pool never evaluates anything itself.
"""
import asyncio
import concurrent.futures
import multiprocessing
import os
import threading
import time


def _ready(preload=None) -> bool:
    return True  # unpickling `preload` imported its module in this worker


def _exit_with_parent(parent_pid: int):
    """Each worker's initializer: end this worker once the trainer is gone. A trainer killed with
    SIGKILL (or the OOM killer) never shuts its pool down, and a worker waiting on the pool's call
    queue holds that queue's write end itself, so it would wait for ever (and keep its memory)."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


class RewardPool:
    """Runs reward calls in worker processes, each bounded by `timeout_s`. A call that times out or
    whose worker dies scores 0 and is counted; the pool is then replaced, since a hung worker
    cannot be interrupted any other way."""

    def __init__(self, num_workers: int, timeout_s: float, startup_timeout_s: float = 120.0, preload=None):
        self.num_workers, self.timeout_s, self.startup_timeout_s = num_workers, timeout_s, startup_timeout_s
        self.preload = preload
        self.num_timeouts = 0
        self.num_failures = 0
        self._pool, self._warm = None, None
        self._new_pool()

    def _new_pool(self):
        # spawn, not fork: the trainer has threads (rollout loop, torch) and forking those can deadlock.
        self._pool = concurrent.futures.ProcessPoolExecutor(self.num_workers, mp_context=multiprocessing.get_context("spawn"),
                                                            initializer=_exit_with_parent, initargs=(os.getpid(),))
        # Start the workers now, and import the reward function's module in them (`preload`, pickled
        # by reference): their start-up must not count against a call's time bound.
        self._warm = [self._pool.submit(_ready, self.preload) for _ in range(self.num_workers)]

    def _replace(self, pool):
        if pool is not self._pool:
            return  # a concurrent call already replaced it
        self._new_pool()
        for process in list(getattr(pool, "_processes", {}).values()):  # the public API cannot stop a hung worker
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    async def score(self, fn, *args) -> float:
        for _ in range(2):  # a second try only when another call's timeout killed our worker
            pool, warm = self._pool, self._warm
            try:
                await asyncio.wait_for(asyncio.gather(*[asyncio.wrap_future(f) for f in warm]), self.startup_timeout_s)
            except (concurrent.futures.process.BrokenProcessPool, asyncio.TimeoutError) as e:
                if pool is not self._pool:
                    continue
                # Scoring every episode 0 would look like a policy that never learns: fail loudly.
                module = getattr(self.preload, "__module__", "your task script")
                raise RuntimeError(f"reward worker processes did not start; run `python -c 'import {module}'` "
                                   "to see the import error") from e
            try:
                return await asyncio.wait_for(asyncio.wrap_future(pool.submit(fn, *args)), self.timeout_s)
            except asyncio.TimeoutError:
                self.num_timeouts += 1
                self._replace(pool)
                return 0.0
            except concurrent.futures.process.BrokenProcessPool:
                if pool is self._pool:
                    self.num_failures += 1
                    self._replace(pool)
                    return 0.0
        self.num_failures += 1
        return 0.0

    def close(self):
        for process in list(getattr(self._pool, "_processes", {}).values()):
            process.kill()
        self._pool.shutdown(wait=False, cancel_futures=True)
