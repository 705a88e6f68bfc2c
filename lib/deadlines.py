"""Deadlines of episodes and rollouts, and what a stuck one reports (docs/reliability.md).

`with_deadline` bounds one episode (`episode_timeout_s` of each script): past it the episode is
cancelled and raises `EpisodeTimeout`, saying which item, where it was stuck (the line of the
script's own code, the turn counters) and its stack, so its group fails and is counted instead of
hanging the step. A rollout (a step's groups, an evaluation, or the wait for the producer's next
group) has a deadline too, `rollout_deadline_s`: its episodes' own plus time to cancel them; past it
lib.async_rollout.BackgroundLoop stops the run with `RolloutTimeout`, naming the episodes still
running (`running_episodes`) and where each is. `in_thread` runs a blocking tool off the event loop.
"""
import asyncio
import collections
import gc
import linecache
import os
import sys
import sysconfig
import threading
import traceback
from typing import Awaitable

CANCEL_GRACE_S = 10.0  # an episode cancelled at its deadline has this long to run its `finally` blocks
ROLLOUT_GRACE_S = 60.0  # a rollout's deadline past its episodes': cancelling them, finishing the groups


class EpisodeTimeout(TimeoutError):
    """An episode ran past its deadline and was cancelled; its group fails (dropped and counted)."""


class RolloutTimeout(RuntimeError):
    """A rollout ran past its deadline although each episode has its own: the event loop is stuck."""


def rollout_deadline_s(episode_timeout_s: float) -> float | None:
    """The deadline of a rollout that starts its episodes at once (None: none, as episode_timeout_s 0)."""
    return episode_timeout_s + CANCEL_GRACE_S + ROLLOUT_GRACE_S if episode_timeout_s else None


running: dict = {}  # asyncio.Task of a running episode -> its item's label (read by BackgroundLoop)


def _label(item) -> str:
    text = item.get("question", item) if isinstance(item, dict) else item
    text = str(text)
    return repr(text if len(text) <= 60 else text[:60] + "...")


def frames_of(coro) -> list:
    """The frames of a suspended coroutine and of what it awaits, outermost first: through the
    coroutines it awaits, into a task it awaits and the first unfinished child of a gather."""
    frames = []
    while coro is not None and len(frames) < 200:
        if isinstance(coro, asyncio.Task):
            coro = coro.get_coro()
        elif isinstance(coro, asyncio.Future):
            coro = next((c for c in getattr(coro, "_children", []) if not c.done()), None)
            continue
        elif type(coro).__name__ in ("FutureIter", "async_generator_asend"):  # `await future`, `async for` (CPython)
            coro = next((r for r in gc.get_referents(coro) if isinstance(r, asyncio.Future) or hasattr(r, "ag_frame")),
                        None)
            continue
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is None:
            break
        frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
    return frames


def where(frames: list) -> str:
    """One line: the innermost line of the episode's own file (the tool, the turn that is waiting)
    and the episode function's counters (turns, calls, ...)."""
    if not frames:
        return "at an unknown place"
    own = [f for f in frames if f.f_code.co_filename == frames[0].f_code.co_filename][-1]
    code = linecache.getline(own.f_code.co_filename, own.f_lineno).strip()
    counters = ", ".join(f"{k}={v!r}" for k, v in frames[0].f_locals.items()
                         if type(v) in (int, float, bool) and not k.startswith("_"))
    state = f" ({frames[0].f_code.co_name}: {counters})" if counters else ""
    return f"at {os.path.basename(own.f_code.co_filename)}:{own.f_lineno} in {own.f_code.co_name}{state}: `{code}`"


_LIBRARIES = (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])


def stack_text(frames: list) -> str:
    """The frames of the project's own code and the last two (where it waits), library frames between elided."""
    shown, elided = [], 0
    for i, f in enumerate(frames):
        if f.f_code.co_filename.startswith(_LIBRARIES) and i < len(frames) - 2:
            elided += 1
            continue
        if elided:
            shown.append(f"  ... {elided} library frames\n")
            elided = 0
        shown += traceback.format_list(traceback.StackSummary.extract([(f, f.f_lineno)]))
    return "".join(shown).rstrip()


async def in_thread(fn, *args):
    """`fn(*args)` in a daemon thread of its own, awaited: a blocking tool off the event loop, so that
    one that never returns stops only its own episode, at the episode's deadline, and does not keep the
    process from exiting (asyncio.to_thread's pool threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(outcome, error):
        if future.done():  # the episode was cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(outcome)

    def work():
        outcome, error = None, None
        try:
            outcome = fn(*args)
        except BaseException as e:  # handed to the awaiting episode
            error = e
        try:
            loop.call_soon_threadsafe(settle, outcome, error)
        except RuntimeError:  # the loop is closed: nobody waits for it any more
            pass
    threading.Thread(target=work, name=f"tool {getattr(fn, '__name__', fn)}", daemon=True).start()
    return await future


async def with_deadline(episode: Awaitable, timeout_s: float, item=None):
    """Await the coroutine `episode` for at most `timeout_s` seconds (0: no deadline). Past it the
    episode is cancelled (its in-flight requests are cancelled with it: their connections close and
    the server drops them; nothing they sampled is returned) and EpisodeTimeout is raised, saying
    which item, at which line and turn it was stuck, and its stack."""
    task = asyncio.ensure_future(episode)
    running[task] = _label(item)
    task.add_done_callback(lambda t: running.pop(t, None))
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s or None)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if done:
        return task.result()
    frames = frames_of(task)
    message = (f"episode of {running.get(task)} ran past its deadline (episode_timeout_s = {timeout_s:g} s) "
               f"{where(frames)}; cancelled, its group is dropped. Where it was (innermost last):\n{stack_text(frames)}")
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # whatever it raises while cancelled
    task.cancel()
    await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
    raise EpisodeTimeout(message)


def report(error: BaseException):
    """Print why a group failed: a timed-out episode's message holds its stack; others, the traceback."""
    if isinstance(error, EpisodeTimeout):
        print(f"EpisodeTimeout: {error}", file=sys.stderr, flush=True)
    else:
        traceback.print_exception(error)


def running_episodes(loop) -> str:
    """The episodes running on `loop` (the loop's own thread): how many of each item, and where."""
    counts = collections.Counter(f"{label} {where(frames_of(task))}" for task, label in list(running.items())
                                 if task.get_loop() is loop and not task.done())
    if not counts:
        return "no episode is running"
    lines = [f"{n} x episode of {what}" if n > 1 else f"episode of {what}" for what, n in counts.most_common(8)]
    more = len(counts) - 8
    return f"{sum(counts.values())} episodes still running:\n  " + "\n  ".join(lines) + (
        f"\n  ... and {more} more places" if more > 0 else "")
