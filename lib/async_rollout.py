"""Rollouts on an asyncio loop in a background thread, and the async-mode producer.

`BackgroundLoop` owns the event loop every inference-client call runs on, so the trainer thread
can block in `run(coro)` (sync mode) or keep training while episodes run (async mode).

`RolloutProducer` (async mode) keeps up to `capacity` groups started but not yet handed to the
trainer, so generation continues while the trainer computes log-probs and updates. Each token
carries the policy version that generated it (`versions [1, T]`, -1 on tokens the model did not
sample); a group whose oldest token is more than `max_staleness` versions behind the trainer's
current version when the trainer asks for it would be off-policy beyond the bound.

Nothing generated is thrown away for that (given `batch_groups`, the groups a training step takes):
- admission: a group starts only if the steps still to come within its staleness bound have room
  for it: at most what the current step still takes plus max_staleness x batch_groups groups
  started and not yet trained on (AReaL's rule, counted in groups);
- the trainer takes groups in the order they started (a ready group waits while an older one
  still runs), and waits for every group that would be too stale at the next version. Taken in
  that order, those are never more than `batch_groups`: every step trains exactly its batch.
So every group is trained on within `max_staleness` versions of its start, and with max_staleness 0
the producer runs exactly sync mode's schedule: a step's groups start after the previous update.
A group found stale anyway (without `batch_groups`, or a resumed run) is dropped and counted.

As in sync mode (`gather_groups`), the groups the trainer takes come back in item order, whatever
order they finished in (which rows each PPO mini-batch trains depends on it), and a group that fails
keeps its place: it is taken like a finished one, dropped and counted (`num_failed`), not replaced
by the next item, so a step trains the same items in both modes; if every group it takes failed,
the first error is raised. So async mode at max_staleness 0 trains exactly what sync mode does.

Exactly once across a kill: the trainer may take a later item's group while an earlier one still
runs, so a checkpoint records `data_ledger()`: the first item not yet consumed and the items after
it consumed already. A producer resumed from both starts the first again and skips the others.

Deadlines (lib/deadlines.py): every episode has one, and so has every rollout: a stuck event loop
stops the run with `RolloutTimeout`, naming the episodes still running and where each is.
"""
import asyncio
import collections
import sys
import threading
import time
from typing import Awaitable, Callable

import torch

from lib.deadlines import RolloutTimeout, report, running, running_episodes, stack_text, where


class BackgroundLoop:
    answer_timeout_s = 3.0  # a loop that does not run a no-op within this long is taken to be blocked

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollout-loop", daemon=True)
        self._thread.start()
        self.blocked_at: str | None = None  # where the loop was found blocked by a deadline

    def run(self, coro, timeout_s: float | None = None, what: str | None = None):
        """Run `coro` on the background loop and block until it finishes; returns its result. Past
        `timeout_s` it is cancelled and TimeoutError raised; with `what` (a rollout: "step 3's
        rollout"), RolloutTimeout, naming the episodes still running or the line blocking the loop."""
        if self.blocked_at is not None and not self._answers():
            coro.close()
            raise RuntimeError(f"the rollout loop is still blocked {self.blocked_at} (see the error above)")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            running = self.describe_running() if what else ""
            future.cancel()
            if not what:
                raise
            raise RolloutTimeout(f"{what} did not finish within {timeout_s:g} s (its episodes' deadline, "
                                 f"episode_timeout_s, and time to cancel them): {running}") from None

    def submit(self, coro) -> "asyncio.Future":
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def _answers(self) -> bool:
        try:
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.loop).result(self.answer_timeout_s)
        except TimeoutError:
            return False
        self.blocked_at = None
        return True

    def describe_running(self) -> str:
        """For a deadline's error: the episodes running on the loop, each with its item and where it
        is; or, if the loop does not answer, the line that blocks it and the episode it is in."""
        async def describe():
            return running_episodes(self.loop)
        try:
            return asyncio.run_coroutine_threadsafe(describe(), self.loop).result(self.answer_timeout_s)
        except TimeoutError:
            pass
        frame = sys._current_frames().get(self._thread.ident)
        stack = []
        while frame is not None:
            stack.append(frame)
            frame = frame.f_back
        stack.reverse()
        coro_frames = {getattr(t.get_coro(), "cr_frame", None): (t, label) for t, label in list(running.items())}
        start = next((i for i, f in enumerate(stack) if f in coro_frames), None)
        if start is None:  # not inside an episode: the last frames are where it is
            frames, episode = stack[-8:], "outside any episode"
        else:
            frames, episode = stack[start:], f"in an episode of {coro_frames[stack[start]][1]}"
        self.blocked_at = where(frames)
        return (f"the event loop is blocked {episode} {self.blocked_at}: code that never yields to the loop "
                f"(a synchronous tool, a blocking call) stops every episode and no deadline can cancel it; run "
                f"it off the loop, `await in_thread(tool, ...)` (lib/deadlines.py; train_calc.py runs its "
                f"calculator so): then its episode's deadline applies. "
                f"Where it is (innermost last):\n{stack_text(frames)}")

    def close(self):
        if self.loop.is_closed():
            return
        if self.blocked_at is not None and not self._answers():
            return  # a loop blocked in a tool cannot be stopped; its thread is a daemon and ends with the process

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
    (`lib.client.GenerationAborted`), its deadline (`EpisodeTimeout`), a bug. Its episodes are not
    training data (an aborted turn is not what the policy would have written; the rest of the group
    alone would give wrong advantages), so the whole group is dropped, its traceback printed and counted. If every
    group of the step fails, the first error is raised: something is broken, not unlucky."""
    results = await asyncio.gather(*group_coroutines, return_exceptions=True)
    groups, errors = [], []
    for result in results:
        if isinstance(result, BaseException):
            if not isinstance(result, Exception):
                raise result  # cancellation, KeyboardInterrupt
            report(result)
            errors.append(result)
        else:
            groups.append(result)
    if errors and not groups:
        raise RuntimeError(f"all {len(errors)} groups of the step failed; the first error is the cause") from errors[0]
    return groups, len(errors)


def oldest_version(group: list[dict]) -> int:
    """The smallest policy version over the model-sampled tokens of a group; -1 if it has none."""
    versions = torch.cat([ep["versions"].flatten() for ep in group])
    sampled = versions[versions >= 0]
    return int(sampled.min()) if sampled.numel() else -1


def is_stale(oldest: int, current_version: int, max_staleness: int) -> bool:
    """Whether a group whose oldest sampled token is of version `oldest` (-1: none) is more than
    `max_staleness` versions behind `current_version`."""
    return oldest >= 0 and current_version - oldest > max_staleness


class RolloutProducer:
    """Runs `rollout_group(item) -> list[episode]` for item_at(start_index), item_at(start_index+1),
    ... on `bg_loop`, keeping up to `capacity` groups started and not yet consumed."""

    def __init__(self, bg_loop: BackgroundLoop, rollout_group: Callable[[dict], Awaitable[list[dict]]],
                 item_at: Callable[[int], dict], *, capacity: int, max_staleness: int, start_index: int = 0,
                 consumed_ahead=(), version: int = 0, batch_groups: int | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 group, got {capacity} (a script's async_capacity: "
                             f"0 = (max_staleness + 1) x batch_size, else a positive number of groups)")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be 0 or more versions, got {max_staleness} (0 = sync mode's "
                             f"schedule; a negative bound would let no group start, and the trainer wait forever)")
        if batch_groups is not None and batch_groups < 1:
            raise ValueError(f"batch_groups must be at least 1 group, got {batch_groups}")
        self.bg_loop = bg_loop
        self.rollout_group = rollout_group
        self.item_at = item_at
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.batch_groups = batch_groups  # None: no admission bound, groups taken as they finish
        self.version = version
        # groups the trainer has taken at the current version, and how many it asks for in all (its
        # batch, or more when it refills a batch: dynamic sampling)
        self._taken_now, self._wanted_now = 0, batch_groups or 0
        self.num_dropped_stale = 0
        self.num_wasted_tokens = 0  # sampled tokens of groups dropped as stale
        self.num_failed = 0  # failed groups the trainer has taken
        self._num_ended = 0  # groups finished or failed: the progress a get_groups deadline waits for
        self._next_index = start_index
        # Items after the first one not yet consumed that the trainer took already (it takes a later
        # item's group while an earlier one still runs): a resume (`consumed_ahead`, from data_ledger)
        # starts them no more, or they would be trained twice.
        self._consumed = {int(i) for i in consumed_ahead if int(i) >= start_index}
        self._started: dict[int, int] = {}  # index running or ended, not taken -> version at its start
        # (index, group, its oldest_version), or (index, the exception, -1) for a group that failed
        self._ready: collections.deque = collections.deque()
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
            self._taken_now, self._wanted_now = 0, self.batch_groups or 0
        self.bg_loop.loop.call_soon_threadsafe(self._wake)  # a new version opens admission

    def _room(self) -> int:
        """How many groups may be started and not yet trained on now (lock held)."""
        if self.batch_groups is None:
            return self.capacity
        this_step = max(self._wanted_now - self._taken_now, 0)
        return min(self.capacity, this_step + self.max_staleness * self.batch_groups)

    def _must_take(self) -> set[int]:
        """Groups that would be too stale at the next version: this step trains them (lock held)."""
        if self.batch_groups is None:
            return set()
        return {i for i, start in self._started.items() if self.version + 1 - start > self.max_staleness}

    def get_groups(self, num_groups: int, timeout_s: float | None = None) -> list[list[dict]]:
        """Block until `num_groups` groups have ended, taken in the order they started (the oldest
        start version, then the lowest item), and every group that would be too stale at the next
        version is among them (more are taken only without admission control); return those that
        did not fail, in item order. A failed group is counted in `num_failed` (if every group taken
        failed: RuntimeError from the first error); one already too stale is dropped, counted and
        replaced. With `timeout_s` (`rollout_deadline_s`): RolloutTimeout, naming what is running,
        when no group finished or failed for that long (each episode has its own deadline: the loop
        is stuck)."""
        out, failed, stuck = [], [], False
        with self._cond:
            ended, since = self._num_ended, time.monotonic()
            must_take = self._must_take()
            if self._taken_now + num_groups > self._wanted_now:
                # a refill (dynamic sampling) asks for more at this version: room for groups to start now, and
                # the producer, which found none once the batch was taken, sleeps until it is woken
                self._wanted_now = self._taken_now + num_groups
                self.bg_loop.loop.call_soon_threadsafe(self._wake)
            while len(out) + len(failed) < num_groups or must_take & self._started.keys():
                if self._error is not None:
                    raise RuntimeError("the rollout producer failed") from self._error
                # the oldest ready group (by its start version, then its item), but never one younger
                # than a group still running: the trainer takes groups in the order they started
                oldest_start = min(self._started.values(), default=0)
                pos = min(range(len(self._ready)), key=lambda k: (self._started[self._ready[k][0]], self._ready[k][0]),
                          default=None)
                if pos is None or self._started[self._ready[pos][0]] > oldest_start:
                    if self._num_ended != ended:
                        ended, since = self._num_ended, time.monotonic()
                    remaining = None if timeout_s is None else since + timeout_s - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        stuck = True
                        break
                    self._cond.wait(min(remaining, 1.0) if remaining is not None else 1.0)
                    continue
                index, group, oldest = self._ready[pos]
                del self._ready[pos]
                del self._started[index]
                self._consumed.add(index)
                self._taken_now += 1
                self.bg_loop.loop.call_soon_threadsafe(self._wake)  # a slot is free: start the next group
                if isinstance(group, Exception):  # its place in the batch stays empty, as in sync mode
                    self.num_failed += 1
                    failed.append(group)
                # With batch_groups, admission and the order of taking make this never true (the module's
                # docstring); without them, or after a resume, it may be. A comparison of two ints either way.
                elif is_stale(oldest, self.version, self.max_staleness):
                    self.num_dropped_stale += 1
                    self.num_wasted_tokens += sum(int((ep["versions"] >= 0).sum()) for ep in group)
                else:
                    out.append((index, group))
            in_flight = sorted(self._started.keys() - {index for index, _, _ in self._ready})
        if stuck:  # described outside the lock: the loop's tasks take it
            raise RolloutTimeout(
                f"the rollout producer gave {len(out)} of {num_groups} groups and no group finished or failed "
                f"for {timeout_s:g} s (its episodes' deadline, episode_timeout_s, and time to cancel them); items "
                f"in flight: {in_flight[:16]}; {self.bg_loop.describe_running()}")
        if failed and not out:
            raise RuntimeError(f"all {len(failed)} groups of the step failed; the first error is the cause") \
                from failed[0]
        return [group for _, group in sorted(out, key=lambda taken: taken[0])]

    def data_ledger(self) -> tuple[int, list[int]]:
        """(the first item index not yet consumed, the indices after it already consumed): a producer
        resumed from both (`start_index`, `consumed_ahead`) loses no item and starts none twice."""
        with self._cond:
            position = min(self._started) if self._started else self._next_index
            self._consumed = {i for i in self._consumed if i >= position}
            return position, sorted(self._consumed)

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
                    free, new = self._room() - len(self._started), []
                    while len(new) < free:
                        if self._next_index not in self._consumed:  # taken before a resume: not again
                            new.append(self._next_index)
                        self._next_index += 1
                    self._started.update({index: self.version for index in new})
                for index in new:
                    task = asyncio.ensure_future(self._run_one(index))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                self._wakeup.clear()
                await self._wakeup.wait()
        except Exception as e:  # a bug here must reach the trainer, not leave it waiting for groups
            with self._cond:
                self._error = e
                self._cond.notify_all()
            raise
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_one(self, index: int):
        try:
            group = await self.rollout_group(self.item_at(index))
            oldest = oldest_version(group)  # once, here: the trainer takes groups under the lock the loop needs
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an episode must never crash training: the trainer takes it as a failed group
            report(e)
            group, oldest = e, -1
        with self._cond:
            self._num_ended += 1
            self._ready.append((index, group, oldest))
            self._cond.notify_all()
