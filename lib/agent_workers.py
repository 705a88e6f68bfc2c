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
a worker that dies fails its episodes and is replaced.
"""
import asyncio
import itertools
import multiprocessing
import multiprocessing.util
import os
import signal
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
    tasks: dict[int, asyncio.Task] = {}
    stop = loop.create_future()

    async def episode(job: int, args: tuple):
        try:
            reply = ("done", job, await agent(*args))
        except asyncio.CancelledError:
            return  # the trainer cancelled it and expects nothing
        except BaseException as e:  # noqa: BLE001 - every failure of the agent goes back to its episode
            reply = ("error", job, _describe(e))
        finally:
            tasks.pop(job, None)
        try:
            conn.send(reply)
        except OSError:
            pass  # the trainer is gone
        except Exception as e:  # noqa: BLE001 - a result pickle cannot take
            _send(conn, ("error", job, f"the agent's result cannot be sent to the trainer: {_describe(e)}"))

    def on_message():
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message = ("stop",)
        if message[0] == "run":
            tasks[message[1]] = loop.create_task(episode(message[1], message[2]))
        elif message[0] == "cancel" and message[1] in tasks:
            tasks[message[1]].cancel()
        elif message[0] == "stop" and not stop.done():
            loop.remove_reader(conn.fileno())
            stop.set_result(None)

    loop.add_reader(conn.fileno(), on_message)
    conn.send(("ready",))
    await stop
    for task in list(tasks.values()):
        task.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    if close is not None:
        await close()


def _describe(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip()


# --- the trainer's side ---
class _Worker:
    def __init__(self, process, conn, ready):
        self.process, self.conn, self.ready = process, conn, ready
        self.jobs: dict[int, asyncio.Future] = {}  # episodes sent and not answered
        self.alive = True
        self.failure = ""  # why it ended, once it has


class AgentWorkers:
    def __init__(self, agent, num_workers: int, *, init=None, init_args: tuple = (), close=None,
                 startup_timeout_s: float = 300.0):
        """`agent(*args)`: an async function importable by name, run by `run(*args)`; `init(*init_args)`:
        a function each worker calls once at its start; `close()`: an async function each worker
        awaits once at its end (to close what the agent keeps open: SDK clients). Use from one
        event loop; the workers start at the first `run`."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self.agent, self.init, self.init_args, self.close_fn = agent, init, tuple(init_args), close
        self.num_workers, self.startup_timeout_s = num_workers, startup_timeout_s
        self._context = multiprocessing.get_context("spawn")
        self._job_ids = itertools.count()
        self._loop = None
        self._workers: list[_Worker] = []
        self._closed = False
        # At interpreter exit without close(), before multiprocessing joins its children (which would
        # wait for ever on workers that wait for the trainer), stop them.
        self._finalizer = multiprocessing.util.Finalize(self, _stop_processes, args=(self._workers,), exitpriority=10)

    async def run(self, *args):
        """`agent(*args)` in the worker with the fewest episodes running; its result."""
        if self._closed:
            raise RuntimeError("AgentWorkers is closed")
        self._bind_loop()
        alive = [w for w in self._workers if w.alive]
        if not alive:  # workers that fail to start are not replaced: each would fail the same way
            raise AgentFailed(self._workers[-1].failure)
        worker = min(alive, key=lambda w: len(w.jobs))
        job = next(self._job_ids)
        future = self._loop.create_future()
        worker.jobs[job] = future  # counted now, so the episodes started while workers start spread over them
        try:
            try:
                await asyncio.wait_for(asyncio.shield(worker.ready), self.startup_timeout_s)
            except asyncio.TimeoutError:
                raise AgentFailed(f"an agent worker did not start within {self.startup_timeout_s:.0f} s: see how "
                                  f"long `python -c 'import {self.agent.__module__}'` takes") from None
            worker.conn.send(("run", job, args))
            return await future
        except asyncio.CancelledError:
            if worker.jobs.pop(job, None) is not None and worker.alive and worker.ready.done():
                _send(worker.conn, ("cancel", job))
            raise
        finally:
            worker.jobs.pop(job, None)

    async def close(self):
        """Stop the workers: episodes still running are cancelled, then each worker awaits `close`."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            if worker.alive:
                _send(worker.conn, ("stop",))
        deadline = self._loop.time() + 30.0 if self._loop is not None else None
        for worker in self._workers:
            while worker.process.is_alive() and deadline is not None and self._loop.time() < deadline:
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
        process = self._context.Process(target=_serve, args=(child_conn, self.agent, self.init, self.init_args, self.close_fn),
                                        name="agent-worker", daemon=False)  # not daemonic: an agent may start processes
        process.start()
        child_conn.close()
        worker = _Worker(process, conn, self._loop.create_future())
        self._workers.append(worker)
        self._loop.add_reader(conn.fileno(), self._on_message, worker)

    def _on_message(self, worker: _Worker):
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):  # the worker died (or failed to start)
            worker.process.join(5.0)
            started = worker.ready.done()
            what = "died" if started else "failed to start"
            self._forget(worker, AgentFailed(
                f"an agent worker (pid {worker.process.pid}) {what}, exit code {worker.process.exitcode}; its output "
                "above says why" + ("" if started else " (the agent, init and close must be importable by name in a "
                                    "new process: module-level functions of a script or a module)")))
            if started and not self._closed:
                self._start_worker()  # its replacement, for the episodes to come
            return
        if message[0] == "ready":
            if not worker.ready.done():
                worker.ready.set_result(None)
            return
        future = worker.jobs.pop(message[1], None)
        if future is None or future.done():
            return  # cancelled here meanwhile
        if message[0] == "done":
            future.set_result(message[2])
        else:
            future.set_exception(AgentFailed(f"run_agent raised in its worker process:\n{message[2]}"))

    def _forget(self, worker: _Worker, error: Exception):
        if not worker.alive:
            return
        worker.alive, worker.failure = False, str(error)
        self._loop.remove_reader(worker.conn.fileno())
        worker.conn.close()
        for future in [*worker.jobs.values(), worker.ready]:
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: a worker that failed with no episode waiting is not an "unretrieved" error
        worker.jobs.clear()
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(5.0)


def _send(conn, message):
    try:
        conn.send(message)
    except (OSError, ValueError):
        pass  # the worker is gone; its end-of-pipe tells the loop


def _stop_processes(workers: list):
    for worker in workers:
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join(5.0)
