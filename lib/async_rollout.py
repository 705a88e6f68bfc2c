"""Rollouts on an asyncio loop in a background thread, and the async-mode producer.

`BackgroundLoop` owns the event loop every inference-client call runs on, so the trainer thread
can block in `run(coro)` (sync mode) or keep training while episodes run (async mode).

`RolloutProducer` (async mode) keeps up to `capacity` groups started but not yet handed to the
trainer, so generation continues while the trainer computes log-probs and updates. Each token
carries the policy version that generated it (`versions [1, T]`, -1 on tokens the model did not
sample); a group whose oldest token is more than `max_staleness` versions behind the trainer's
current version when the trainer asks for it is dropped and counted. Capacity bounds staleness
from the other side: the trainer consumes `batch_groups` per step, so a group started now is at
most about `capacity / batch_groups` updates old when it is consumed.
"""
import asyncio
import collections
import threading
import time
import traceback
from typing import Awaitable, Callable


class BackgroundLoop:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollout-loop", daemon=True)
        self._thread.start()

    def run(self, coro, timeout_s: float | None = None):
        """Run `coro` on the background loop and block until it finishes; returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def submit(self, coro) -> "asyncio.Future":
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self):
        if self.loop.is_closed():
            return

        async def cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.run(cancel_all(), timeout_s=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
            self.loop.close()


async def gather_groups(group_coroutines) -> tuple[list, int]:
    """Run the groups of one step concurrently: (the groups that finished, how many failed).

    A group fails when one of its episodes raises: a server that refused or aborted a request
    (`lib.client.GenerationAborted`), a timeout, a bug. Its episodes are not training data (an
    aborted turn is not what the policy would have written; the rest of the group alone would give
    wrong advantages), so the whole group is dropped, its traceback printed and counted. If every
    group of the step fails, the first error is raised: something is broken, not unlucky."""
    results = await asyncio.gather(*group_coroutines, return_exceptions=True)
    groups, errors = [], []
    for result in results:
        if isinstance(result, BaseException):
            if not isinstance(result, Exception):
                raise result  # cancellation, KeyboardInterrupt
            traceback.print_exception(result)
            errors.append(result)
        else:
            groups.append(result)
    if errors and not groups:
        raise RuntimeError(f"all {len(errors)} groups of the step failed; the first error is the cause") from errors[0]
    return groups, len(errors)


def oldest_version(group: list[dict]) -> int:
    """The smallest policy version over the model-sampled tokens of a group; -1 if it has none."""
    versions = [int(v) for ep in group for v in ep["versions"].flatten().tolist() if v >= 0]
    return min(versions) if versions else -1


def is_stale(group: list[dict], current_version: int, max_staleness: int) -> bool:
    oldest = oldest_version(group)
    return oldest >= 0 and current_version - oldest > max_staleness


class RolloutProducer:
    """Runs `rollout_group(item) -> list[episode]` for item_at(start_index), item_at(start_index+1),
    ... on `bg_loop`, keeping up to `capacity` groups started and not yet consumed."""

    def __init__(self, bg_loop: BackgroundLoop, rollout_group: Callable[[dict], Awaitable[list[dict]]],
                 item_at: Callable[[int], dict], *, capacity: int, max_staleness: int, start_index: int = 0,
                 version: int = 0):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 group, got {capacity}")
        self.bg_loop = bg_loop
        self.rollout_group = rollout_group
        self.item_at = item_at
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.version = version
        self.num_dropped_stale = 0
        self.num_failed = 0
        self._failed_in_a_row = 0
        self._next_index = start_index
        self._started: set[int] = set()  # indices running or finished and waiting to be consumed
        self._ready: collections.deque = collections.deque()  # (index, group)
        self._cond = threading.Condition()
        self._stopped = False
        self._wakeup: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._main = None

    # --- trainer side (any thread but the loop's) ---
    def start(self):
        self._main = self.bg_loop.submit(self._produce())
        return self

    def set_version(self, version: int):
        with self._cond:
            self.version = version

    def get_groups(self, num_groups: int, timeout_s: float | None = None) -> list[list[dict]]:
        """Block until `num_groups` fresh groups are ready; stale ones are dropped on the way."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        out = []
        with self._cond:
            while len(out) < num_groups:
                while not self._ready and self._error is None:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"rollout producer gave {len(out)} of {num_groups} groups in {timeout_s} s")
                    self._cond.wait(remaining if remaining is not None else 1.0)
                if self._error is not None:
                    raise RuntimeError("the rollout producer failed") from self._error
                index, group = self._ready.popleft()
                self._started.discard(index)
                self.bg_loop.loop.call_soon_threadsafe(self._wake)  # a slot is free: start the next group
                if is_stale(group, self.version, self.max_staleness):
                    self.num_dropped_stale += 1
                else:
                    out.append(group)
        return out

    def data_position(self) -> int:
        """The first item index not yet consumed: resuming from it loses no item (items after it
        that were already consumed are seen again)."""
        with self._cond:
            return min(self._started) if self._started else self._next_index

    def num_in_flight(self) -> int:
        with self._cond:
            return len(self._started) - len(self._ready)

    def stop(self):
        self._stopped = True
        if self._main is not None:
            self.bg_loop.loop.call_soon_threadsafe(self._wake)
            try:
                self._main.result(timeout=60)
            except Exception:
                pass

    # --- loop side ---
    def _wake(self):
        if self._wakeup is not None:
            self._wakeup.set()

    async def _produce(self):
        self._wakeup = asyncio.Event()
        tasks = set()
        try:
            while not self._stopped:
                with self._cond:
                    free = self.capacity - len(self._started)
                    new = list(range(self._next_index, self._next_index + max(free, 0)))
                    self._started.update(new)
                    self._next_index += len(new)
                for index in new:
                    task = asyncio.ensure_future(self._run_one(index))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                self._wakeup.clear()
                await self._wakeup.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_one(self, index: int):
        try:
            group = await self.rollout_group(self.item_at(index))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an episode must never crash training, but a bug must not loop silently
            traceback.print_exc()
            with self._cond:
                self.num_failed += 1
                self._failed_in_a_row += 1
                self._started.discard(index)
                if self._failed_in_a_row >= 10:
                    self._error = e
                self._cond.notify_all()
            self._wake()
            return
        with self._cond:
            self._failed_in_a_row = 0
            self._ready.append((index, group))
            self._cond.notify_all()
