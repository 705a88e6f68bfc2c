"""Agent episodes in worker processes, each with its own event loop.

An agent written with the openai SDK (or LangChain, or the Agents SDK) spends milliseconds of CPU
per model call building the request, speaking HTTP and parsing the reply. On the trainer's event
loop, beside the proxy and the inference client, that CPU is spent one call after another while
the GPU waits for the next request (docs/openai_proxy.md). Here each worker runs its share of the
episodes concurrently on its own loop, and the trainer's process only serves the proxy.

    workers = AgentWorkers(run_agent, num_workers=8, init=start_agent, init_args=(cfg,), close=close_agent)
    result = await workers.run(base_url, api_key, item, temperature)   # run_agent's result, run in a worker
    await workers.close()

`run_agent`, `init` and `close` must be importable by name, module-level functions of your script
or a module: the workers are spawned, not forked (the trainer has threads and CUDA), and import
them. `init(*init_args)` runs once in each worker before its first episode (what `run_agent` reads
besides its arguments: settings, a tool server's address). Arguments and results go through pickle. An episode cancelled here (its deadline) is cancelled in
its worker; an exception in the agent is raised here as AgentFailed with the worker's traceback;
a worker that dies fails its episodes and is replaced. A worker whose cancelled episode has not
ended `cancel_grace_s` later (an agent that blocks its worker's event loop, swallows the
cancellation, or a stopped process) is killed, failing its other episodes, and replaced; no episode
is sent to a worker while one of its cancellations is pending. `close()` takes at most about
`close_timeout_s`. Worker processes are waited for in threads, never on the event loop.
"""
import asyncio
import itertools
import multiprocessing
import multiprocessing.util
import os
import pickle
import queue
import signal
import threading
import traceback


def num_workers(requested: int, beside_cpu_server: bool) -> int:
    """A script's `agent_workers` setting with -1 (auto) resolved: none beside lib's CPU server
    (on a small CPU machine the cores are the server's), else half the cores, at most 8 (8 was the
    fastest of 4, 8 and 14 on a 16-core GPU box: docs/benchmarks.md)."""
    if requested < -1:
        raise ValueError(f"agent_workers must be -1 (auto), 0 (the trainer's event loop) or a number of processes, "
                         f"got {requested}")
    if requested >= 0:
        return requested
    return 0 if beside_cpu_server else min(8, max(1, (os.cpu_count() or 2) // 2))


class AgentFailed(RuntimeError):
    """The agent raised in its worker process (the message holds the worker's traceback), or the worker died."""


# --- the pipe: both sides read on their event loop and send from a thread of their own ---
# A blocking send on an event loop could wait for the other side, which may itself be blocked
# sending (two large messages at once): neither would read again. Each message is
# (kind, job, payload), the payload pickled apart, so one that cannot be read fails its own job.
class _Sender:
    def __init__(self, conn):
        self.conn, self.queue = conn, queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name="agent-workers-send").start()

    def send(self, kind: str, job=None, payload=None):
        """Pickles here (a payload that cannot be pickled raises in the caller); sends in the thread."""
        self.queue.put(pickle.dumps((kind, job, pickle.dumps(payload))))

    def close(self):
        self.queue.put(None)

    def _run(self):
        while (data := self.queue.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except (OSError, ValueError):
                return  # the other side is gone; its end of the pipe tells the reader


def _receive(conn) -> tuple:
    """(kind, job, payload bytes) of the next message; EOFError/OSError once the other side is gone."""
    return pickle.loads(conn.recv_bytes())


# --- the worker process ---
def _serve(conn, agent, init, init_args: tuple, close):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle: it closes the workers
    if init is not None:
        init(*init_args)
    asyncio.run(_serve_episodes(conn, agent, close))


async def _serve_episodes(conn, agent, close):
    """Run every episode the trainer sends as a task of this loop, and send back its result, until
    the trainer says stop or goes away (its end of the pipe closes, also when it is killed)."""
    loop = asyncio.get_running_loop()
    sender = _Sender(conn)
    tasks: dict[int, asyncio.Task] = {}
    stop = loop.create_future()

    async def episode(job: int, payload: bytes):
        try:
            reply = ("done", await agent(*pickle.loads(payload)))
        except asyncio.CancelledError:
            reply = ("cancelled", None)  # the trainer waits for this, or kills the worker
        except BaseException as e:  # noqa: BLE001 - every failure of the agent goes back to its episode
            reply = ("error", _describe(e))
        finally:
            tasks.pop(job, None)
        try:
            sender.send(reply[0], job, reply[1])
        except Exception as e:  # noqa: BLE001 - a result pickle cannot take
            sender.send("error", job, f"the agent's result cannot be sent to the trainer: {_describe(e)}")

    def on_message():
        try:
            kind, job, payload = _receive(conn)
        except (EOFError, OSError):
            kind, job, payload = "stop", None, None
        if kind == "run":
            tasks[job] = loop.create_task(episode(job, payload))
        elif kind == "cancel" and job in tasks:
            tasks[job].cancel()
        elif kind == "stop" and not stop.done():
            loop.remove_reader(conn.fileno())
            stop.set_result(None)

    loop.add_reader(conn.fileno(), on_message)
    sender.send("ready")
    await stop
    for task in list(tasks.values()):
        task.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    if close is not None:
        await close()
    sender.close()


def _describe(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip()


# --- the trainer's side ---
class _Worker:
    def __init__(self, process, conn, ready):
        self.process, self.conn, self.ready = process, conn, ready
        self.sender = _Sender(conn)
        self.jobs: dict[int, asyncio.Future] = {}  # episodes sent and not answered
        self.cancelling: dict[int, asyncio.TimerHandle] = {}  # episodes cancelled, not yet ended there -> its kill
        self.exit_fd = None  # readable once the process has exited
        self.alive = True


class AgentWorkers:
    def __init__(self, agent, num_workers: int, *, init=None, init_args: tuple = (), close=None,
                 startup_timeout_s: float = 300.0, cancel_grace_s: float = 10.0, close_timeout_s: float = 5.0):
        """`agent(*args)`: an async function importable by name, run by `run(*args)`; `init(*init_args)`:
        a function each worker calls once at its start; `close()`: an async function each worker
        awaits once at its end (to close what the agent keeps open: SDK clients). Use from one
        event loop; the workers start at the first `run`. A worker whose cancelled episode has not
        ended `cancel_grace_s` later is killed and replaced; `close()` kills the workers that have
        not exited `close_timeout_s` after it asked them to stop."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        try:  # what each worker is started with: refused here rather than at the first episode
            pickle.dumps((agent, init, tuple(init_args), close))
        except Exception as e:
            raise ValueError(f"the agent, init, init_args and close must pickle (module-level functions): {e}") from e
        self.agent, self.init, self.init_args, self.close_fn = agent, init, tuple(init_args), close
        self.num_workers, self.startup_timeout_s = num_workers, startup_timeout_s
        self.cancel_grace_s, self.close_timeout_s = cancel_grace_s, close_timeout_s
        self._context = multiprocessing.get_context("spawn")
        self._job_ids = itertools.count()
        self._loop = None
        self._workers: list[_Worker] = []  # the live ones
        self._failure = ""  # why the last worker that failed to start did
        self._closed = False
        # At interpreter exit without close(), before multiprocessing joins its children (which would
        # wait for ever on workers that wait for the trainer), stop them.
        self._finalizer = multiprocessing.util.Finalize(self, _stop_processes, args=(self._workers,), exitpriority=10)

    async def run(self, *args):
        """`agent(*args)` in the worker with the fewest episodes running; its result."""
        if self._closed:
            raise RuntimeError("AgentWorkers is closed")
        self._bind_loop()
        # not to a worker with a cancelled episode still running: it may be about to be killed for it
        while self._workers and all(w.cancelling for w in self._workers):
            await asyncio.sleep(0.05)
        if self._closed:
            raise AgentFailed("AgentWorkers closed")
        if not self._workers:  # workers that fail to start are not replaced: each would fail the same way
            raise AgentFailed(self._failure)
        worker = min((w for w in self._workers if not w.cancelling), key=lambda w: len(w.jobs))
        job = next(self._job_ids)
        future = self._loop.create_future()
        worker.jobs[job] = future  # counted now, so the episodes started while workers start spread over them
        try:
            try:
                await asyncio.wait_for(asyncio.shield(worker.ready), self.startup_timeout_s)
            except asyncio.TimeoutError:
                raise AgentFailed(f"an agent worker did not start within {self.startup_timeout_s:.0f} s: see how "
                                  f"long `python -c 'import {self.agent.__module__}'` takes") from None
            worker.sender.send("run", job, args)
            return await future
        except asyncio.CancelledError:
            if worker.jobs.pop(job, None) is not None and worker.alive and worker.ready.done():
                worker.sender.send("cancel", job)
                worker.cancelling[job] = self._loop.call_later(self.cancel_grace_s, self._kill_stuck, worker)
            raise
        finally:
            worker.jobs.pop(job, None)

    async def close(self):
        """Stop the workers: episodes still running are cancelled, then each worker awaits `close`."""
        if self._closed:
            return
        self._closed = True
        workers = list(self._workers)
        for worker in workers:
            worker.sender.send("stop")
        deadline = self._loop.time() + self.close_timeout_s if self._loop is not None else None
        for worker in workers:
            while worker.alive and worker.process.is_alive() and deadline is not None and self._loop.time() < deadline:
                await asyncio.sleep(0.05)
            self._forget(worker, AgentFailed("AgentWorkers closed"))
        self._finalizer()

    # --- internals ---
    def _bind_loop(self):
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            for _ in range(self.num_workers):
                self._start_worker()
        elif loop is not self._loop:
            raise RuntimeError("AgentWorkers is used from one event loop only")

    def _start_worker(self):
        conn, child_conn = self._context.Pipe()
        process = self._context.Process(target=_serve, args=(child_conn, self.agent, self.init, self.init_args,
                                                             self.close_fn),
                                        name="agent-worker", daemon=False)  # not daemonic: an agent may start processes
        try:
            process.start()
        finally:
            child_conn.close()
        worker = _Worker(process, conn, self._loop.create_future())
        self._workers.append(worker)
        self._loop.add_reader(conn.fileno(), self._on_message, worker)
        # Its exit, seen also when a process it forked keeps the pipe open (no end-of-pipe then): a pidfd
        # (Linux) is readable once the worker itself exits; the sentinel, a pipe too, elsewhere.
        worker.exit_fd = os.pidfd_open(process.pid) if hasattr(os, "pidfd_open") else None
        self._loop.add_reader(worker.exit_fd if worker.exit_fd is not None else process.sentinel, self._on_exit, worker)

    def _on_message(self, worker: _Worker):
        try:
            kind, job, payload = _receive(worker.conn)
        except (EOFError, OSError):  # the worker is exiting (or failed to start): _on_exit follows at its exit
            self._loop.remove_reader(worker.conn.fileno())
            return
        if kind == "ready":
            if not worker.ready.done():
                worker.ready.set_result(None)
            return
        if (kill := worker.cancelling.pop(job, None)) is not None:  # a cancelled episode ended (or ended first)
            kill.cancel()
        future = worker.jobs.pop(job, None)
        if future is None or future.done():
            return  # cancelled here meanwhile
        try:
            result = pickle.loads(payload)
        except Exception as e:  # noqa: BLE001 - pickled there, unreadable here
            future.set_exception(AgentFailed(f"the agent's result cannot be read here: {_describe(e)}"))
            return
        if kind == "done":
            future.set_result(result)
        else:
            future.set_exception(AgentFailed(f"run_agent raised in its worker process:\n{result}"))

    def _kill_stuck(self, worker: _Worker):
        """A cancelled episode of `worker` did not end within cancel_grace_s: kill the worker, replace it."""
        if not worker.alive or self._closed:
            return
        self._forget(worker, AgentFailed(
            f"an agent worker (pid {worker.process.pid}) was killed: an episode cancelled {self.cancel_grace_s:g} s "
            "ago (its deadline) had not ended in it. The agent blocks its worker's event loop (time.sleep, a "
            "blocking call: run it in a thread, `await asyncio.to_thread(...)`), swallows asyncio.CancelledError "
            "(re-raise it), or the process was stopped; the worker's other episodes fail with it"))
        self._start_worker()

    def _on_exit(self, worker: _Worker):
        if not worker.alive:
            return
        if self._closed:
            self._forget(worker, AgentFailed("AgentWorkers closed"))
            return
        started = worker.ready.done()
        what = "died" if started else "failed to start"
        self._forget(worker, AgentFailed(
            f"an agent worker (pid {worker.process.pid}) {what}, exit code {worker.process.exitcode}; its output "
            "above says why" + ("" if started else " (the agent, init and close must be importable by name in a "
                                "new process: module-level functions of a script or a module)")))
        if started:
            self._start_worker()  # its replacement, for the episodes to come

    def _forget(self, worker: _Worker, error: Exception):
        if not worker.alive:
            return
        worker.alive = False
        if worker in self._workers:
            self._workers.remove(worker)
        if not worker.ready.done():
            self._failure = str(error)
        self._loop.remove_reader(worker.conn.fileno())
        self._loop.remove_reader(worker.exit_fd if worker.exit_fd is not None else worker.process.sentinel)
        if worker.exit_fd is not None:
            os.close(worker.exit_fd)
        worker.sender.close()
        for future in [*worker.jobs.values(), worker.ready]:
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: a worker that failed with no episode waiting is not an "unretrieved" error
        worker.jobs.clear()
        for kill in worker.cancelling.values():
            kill.cancel()
        worker.cancelling.clear()
        if worker.process.is_alive():
            worker.process.kill()
        # waiting for it (milliseconds, or seconds for a process the kernel is slow to tear down) is a
        # blocking call: not on this event loop, which serves the proxy and every other episode
        threading.Thread(target=_reap, args=(worker.process, worker.conn), daemon=True,
                         name="agent-worker-reap").start()


def _reap(process, conn):
    process.join(5.0)
    conn.close()
    if process.exitcode is not None:
        process.close()  # its start-up pipes go with it


def _stop_processes(workers: list):
    for worker in workers:
        try:
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(5.0)
        except ValueError:
            pass  # closed already
