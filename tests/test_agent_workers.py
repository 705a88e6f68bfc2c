"""lib/agent_workers.py: agent episodes in spawned worker processes, each with its own event loop."""
import asyncio
import multiprocessing
import os
import signal
import time

import pytest

from lib.agent_workers import AgentFailed, AgentWorkers, num_workers
from tests.killed_trainer import after_sigkill, running

# --- agents, importable by name in the workers ---
_running = 0  # episodes running in this worker now
_most_running = 0


_suffix = ""  # set by init


def set_suffix(suffix):
    global _suffix
    _suffix = suffix


async def echo_agent(base_url, api_key, item, temperature):
    global _running, _most_running
    _running += 1
    _most_running = max(_most_running, _running)
    try:
        await asyncio.sleep(item.get("sleep_s", 0.0))
    finally:
        _running -= 1
    return {"pid": os.getpid(), "echo": (base_url, api_key, item["n"], temperature, _suffix),
            "most_running": _most_running}


async def failing_agent(base_url, api_key, item, temperature):
    raise ValueError(f"the tool broke on item {item['n']}")


async def dying_agent(base_url, api_key, item, temperature):
    if item.get("die"):
        os._exit(3)
    return os.getpid()


async def slow_agent(base_url, api_key, item, temperature):
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        with open(item["cancelled_file"], "w") as f:
            f.write(str(os.getpid()))
        raise


async def unpicklable_agent(base_url, api_key, item, temperature):
    return lambda: None


async def big_agent(base_url, api_key, item, temperature):
    return {"transcript": "r" * (1 << 20), "got": len(item["history"])}


class NeedsTwoArguments(Exception):
    def __init__(self, a, b):  # pickles, but unpickling calls NeedsTwoArguments(a): a TypeError
        super().__init__(a)


async def unreadable_result_agent(base_url, api_key, item, temperature):
    return NeedsTwoArguments("a", "b")


def _linger():
    time.sleep(30)


async def forks_then_dies_agent(base_url, api_key, item, temperature):
    if item.get("die"):
        import multiprocessing

        child = multiprocessing.get_context("fork").Process(target=_linger)  # inherits the worker's pipe
        child.start()
        with open(item["child_pid_file"], "w") as f:
            f.write(str(child.pid))
        os._exit(3)
    return os.getpid()


async def blocking_agent(base_url, api_key, item, temperature):
    """Its worker's pid; or, as item["block"] says, it never ends and never lets a cancellation end it."""
    if item.get("block") == "sleep":
        time.sleep(3600)  # blocks the worker's event loop: the cancellation is never even read
    elif item.get("block") == "swallow":
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass
    elif item.get("block") == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    return os.getpid()


async def write_pid_on_close():
    with open(os.path.join(os.environ["AGENT_WORKERS_CLOSE_DIR"], str(os.getpid())), "w") as f:
        f.write("closed")


def run_with(workers: AgentWorkers, coro_fn):
    async def main():
        try:
            return await coro_fn()
        finally:
            await workers.close()
    return asyncio.run(main())


# --- tests ---
def test_episodes_run_concurrently_in_the_workers_after_init_and_return_the_agents_results():
    workers = AgentWorkers(echo_agent, 2, init=set_suffix, init_args=("!",))
    items = [{"n": n, "sleep_s": 0.5} for n in range(8)]
    results = run_with(workers, lambda: asyncio.gather(*[workers.run(f"url{i['n']}", f"key{i['n']}", i, 0.5)
                                                          for i in items]))
    assert [r["echo"] for r in results] == [(f"url{n}", f"key{n}", n, 0.5, "!") for n in range(8)]
    pids = {r["pid"] for r in results}
    assert len(pids) == 2 and os.getpid() not in pids  # both workers, not this process
    assert max(r["most_running"] for r in results) >= 2  # a worker ran several episodes at once on its loop


def test_an_exception_in_the_agent_is_raised_here_with_the_workers_traceback_and_the_worker_keeps_serving():
    workers = AgentWorkers(failing_agent, 1)

    async def go():
        with pytest.raises(AgentFailed) as failed:
            await workers.run("u", "k", {"n": 7}, 1.0)
        assert "ValueError: the tool broke on item 7" in str(failed.value)
        assert "failing_agent" in str(failed.value)  # the worker's traceback
        with pytest.raises(AgentFailed):
            await workers.run("u", "k", {"n": 8}, 1.0)
    run_with(workers, go)


def test_an_episode_cancelled_here_is_cancelled_in_its_worker(tmp_path):
    workers = AgentWorkers(slow_agent, 1)
    marker = tmp_path / "cancelled"

    async def go():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(workers.run("u", "k", {"cancelled_file": str(marker)}, 1.0), 3.0)
        deadline = time.monotonic() + 10
        while not marker.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert marker.exists()
    run_with(workers, go)


def test_a_worker_that_dies_fails_its_episodes_and_is_replaced():
    workers = AgentWorkers(dying_agent, 1)

    async def go():
        first = await workers.run("u", "k", {}, 1.0)
        with pytest.raises(AgentFailed, match="died, exit code 3"):
            await workers.run("u", "k", {"die": True}, 1.0)
        second = await workers.run("u", "k", {}, 1.0)
        assert first != second  # a new worker process
    run_with(workers, go)


@pytest.mark.parametrize("agent,error", [
    (unpicklable_agent, "cannot be sent to the trainer"),  # pickle refuses it in the worker
    (unreadable_result_agent, "cannot be read here"),  # pickled in the worker, unpickling fails here
])
def test_a_result_that_cannot_cross_the_pipe_fails_its_episode_with_a_clear_error(agent, error):
    workers = AgentWorkers(agent, 1)

    async def go():
        with pytest.raises(AgentFailed, match=error):
            await asyncio.wait_for(workers.run("u", "k", {}, 1.0), 60)
    run_with(workers, go)


def test_close_stops_every_worker_after_running_its_close_hook(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_WORKERS_CLOSE_DIR", str(tmp_path))
    workers = AgentWorkers(echo_agent, 2, close=write_pid_on_close)
    results = run_with(workers, lambda: asyncio.gather(*[workers.run("u", "k", {"n": n, "sleep_s": 0.2}, 1.0)
                                                          for n in range(4)]))
    assert sorted(os.listdir(tmp_path)) == sorted({str(r["pid"]) for r in results})
    assert not any(w.process.is_alive() for w in workers._workers)
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(workers.run("u", "k", {"n": 0}, 1.0))


def test_workers_whose_agent_cannot_be_imported_fail_every_episode_with_the_cause(tmp_path, monkeypatch):
    module = tmp_path / "agent_breaks_in_workers.py"
    module.write_text("import os\nif os.environ.get('BREAK_AGENT_IMPORT'):\n    raise ImportError('no such tool')\n"
                      "async def agent(*args):\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import agent_breaks_in_workers

    monkeypatch.setenv("BREAK_AGENT_IMPORT", "1")  # set after the import here: only the workers' import fails
    workers = AgentWorkers(agent_breaks_in_workers.agent, 2)

    async def go():
        for _ in range(3):  # not replaced: every later episode fails at once too
            with pytest.raises(AgentFailed, match="failed to start"):
                await asyncio.wait_for(workers.run("u", "k", {}, 1.0), 60)
    run_with(workers, go)


def test_num_workers_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        AgentWorkers(echo_agent, 0)


def test_workers_exit_when_the_trainer_is_killed():
    pids, left = after_sigkill("""
import asyncio, sys, time
from lib.agent_workers import AgentWorkers
from tests.test_agent_workers import echo_agent
async def main():
    workers = AgentWorkers(echo_agent, 2)
    results = await asyncio.gather(*[workers.run("u", "k", {"n": n, "sleep_s": 0.2}, 1.0) for n in range(4)])
    print(*sorted({r["pid"] for r in results}), flush=True)
    time.sleep(600)
asyncio.run(main())
""")
    assert len(pids) == 2 and not left


@pytest.mark.parametrize("requested,beside_cpu_server,cores,expected", [
    (-1, True, 16, 0),  # the CPU server's cores are its own
    (-1, False, 16, 8), (-1, False, 64, 8), (-1, False, 2, 1), (-1, False, 6, 3),
    (0, False, 16, 0), (3, True, 2, 3),  # as asked
])
def test_auto_is_half_the_cores_up_to_8_and_none_beside_the_cpu_server(monkeypatch, requested, beside_cpu_server,
                                                                         cores, expected):
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    assert num_workers(requested, beside_cpu_server) == expected


def test_a_setting_below_minus_one_is_refused():
    with pytest.raises(ValueError, match="agent_workers must be -1"):
        num_workers(-2, False)


def test_megabytes_each_way_for_many_episodes_at_once_never_block_either_side():
    # both sides send from a thread: a large send waiting on the other side never stops a loop from reading
    workers = AgentWorkers(big_agent, 1)
    results = run_with(workers, lambda: asyncio.wait_for(asyncio.gather(*[
        workers.run("u", "k", {"history": "h" * (1 << 20)}, 1.0) for _ in range(12)]), 120))
    assert [r["got"] for r in results] == [1 << 20] * 12 and all(len(r["transcript"]) == 1 << 20 for r in results)


def test_a_worker_that_dies_leaving_a_forked_child_holding_its_pipe_is_still_seen_dead(tmp_path):
    workers = AgentWorkers(forks_then_dies_agent, 1)
    pid_file = tmp_path / "child"

    async def go():
        first = await workers.run("u", "k", {}, 1.0)
        try:
            with pytest.raises(AgentFailed, match="died, exit code 3"):
                await asyncio.wait_for(workers.run("u", "k", {"die": True, "child_pid_file": str(pid_file)}, 1.0), 30)
            assert await asyncio.wait_for(workers.run("u", "k", {}, 1.0), 60) != first  # its replacement serves
        finally:
            if pid_file.exists():
                os.kill(int(pid_file.read_text()), 9)
    run_with(workers, go)


@pytest.mark.parametrize("block", ["sleep", "swallow", "sigstop"])
def test_a_worker_whose_cancelled_episode_does_not_end_is_killed_and_the_next_episode_runs_in_its_replacement(block):
    workers = AgentWorkers(blocking_agent, 1, cancel_grace_s=1.0)

    async def go():
        first = await asyncio.wait_for(workers.run("u", "k", {}, 1.0), 60)
        with pytest.raises(asyncio.TimeoutError):  # its deadline
            await asyncio.wait_for(workers.run("u", "k", {"block": block}, 1.0), 1.0)
        second = await asyncio.wait_for(workers.run("u", "k", {}, 1.0), 60)
        assert second != first
        deadline = time.monotonic() + 10
        while running(first) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not running(first)
    run_with(workers, go)


def test_close_takes_seconds_not_minutes_when_a_worker_is_blocked():
    workers = AgentWorkers(blocking_agent, 1)

    async def go():
        await asyncio.wait_for(workers.run("u", "k", {}, 1.0), 60)  # started
        episode = asyncio.ensure_future(workers.run("u", "k", {"block": "sleep"}, 1.0))
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        await workers.close()
        assert time.monotonic() - t0 < 15
        with pytest.raises(AgentFailed, match="closed"):
            await episode
    run_with(workers, go)


def test_no_worker_process_is_waited_for_on_the_event_loop_and_every_one_is_reaped(monkeypatch):
    # join() blocks its thread: on the trainer's event loop it would stop every episode and the proxy
    joined_on_loop, join = [], multiprocessing.process.BaseProcess.join

    def recording_join(self, timeout=None):
        try:
            asyncio.get_running_loop()
            joined_on_loop.append(self.pid)
        except RuntimeError:
            pass
        return join(self, timeout)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "join", recording_join)
    workers = AgentWorkers(dying_agent, 1)

    async def go():
        pids = [await asyncio.wait_for(workers.run("u", "k", {}, 1.0), 60)]
        with pytest.raises(AgentFailed, match="died"):
            await asyncio.wait_for(workers.run("u", "k", {"die": True}, 1.0), 60)
        pids.append(await asyncio.wait_for(workers.run("u", "k", {}, 1.0), 60))  # its replacement
        return pids
    pids = run_with(workers, go)
    assert joined_on_loop == []
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)  # not left as zombies
