import asyncio
import threading

import pytest
import torch

from lib.async_rollout import BackgroundLoop, RolloutProducer, is_stale, oldest_version


def episode(versions: list[int]) -> dict:
    return {"versions": torch.tensor([versions]), "rewards": torch.tensor([1.0])}


@pytest.fixture
def bg_loop():
    loop = BackgroundLoop()
    yield loop
    loop.close()


def test_oldest_version_ignores_tokens_the_model_did_not_sample():
    group = [episode([-1, -1, 4, 5, -1, 6]), episode([-1, 3, 3])]
    assert oldest_version(group) == 3
    assert oldest_version([episode([-1, -1])]) == -1


def test_a_group_exactly_max_staleness_behind_is_kept_and_one_more_is_dropped():
    oldest = oldest_version([episode([-1, 2, 3]), episode([-1, 4])])
    assert not is_stale(oldest, current_version=4, max_staleness=2)
    assert is_stale(oldest, current_version=5, max_staleness=2)
    assert not is_stale(oldest_version([episode([-1, -1])]), current_version=100, max_staleness=0)


def test_run_blocks_until_the_coroutine_on_the_background_loop_returns(bg_loop):
    async def where():
        await asyncio.sleep(0.01)
        return threading.current_thread().name

    assert bg_loop.run(where()) == "rollout-loop"


def test_producer_keeps_at_most_capacity_groups_started_and_unconsumed(bg_loop):
    running, peak, release = [0], [0], threading.Event()

    async def rollout_group(item):
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        while not release.is_set():
            await asyncio.sleep(0.005)
        running[0] -= 1
        return [episode([-1, 0])]

    producer = RolloutProducer(bg_loop, rollout_group, lambda i: {"i": i}, capacity=3, max_staleness=0).start()
    try:
        bg_loop.run(asyncio.sleep(0.1))
        assert running[0] == 3
        release.set()
        assert len(producer.get_groups(5, timeout_s=10)) == 5
        assert peak[0] <= 3
    finally:
        producer.stop()


def test_groups_come_in_item_order_when_they_finish_in_order(bg_loop):
    async def rollout_group(item):
        return [dict(episode([-1, 0]), index=item["i"])]

    producer = RolloutProducer(bg_loop, rollout_group, lambda i: {"i": i}, capacity=2, max_staleness=0,
                               start_index=7).start()
    try:
        groups = producer.get_groups(4, timeout_s=10)
        assert [g[0]["index"] for g in groups] == [7, 8, 9, 10]
    finally:
        producer.stop()


def test_stale_groups_are_dropped_counted_and_replaced(bg_loop):
    server_version = [0]  # the version the fake server tags its tokens with

    async def rollout_group(item):
        return [episode([-1, server_version[0]])]

    producer = RolloutProducer(bg_loop, rollout_group, lambda i: {"i": i}, capacity=4, max_staleness=1).start()
    try:
        bg_loop.run(asyncio.sleep(0.1))  # four version-0 groups are now ready
        server_version[0] = 2
        producer.set_version(2)
        groups = producer.get_groups(3, timeout_s=10)
        assert producer.num_dropped_stale == 4
        assert [oldest_version(g) for g in groups] == [2, 2, 2]
    finally:
        producer.stop()


def gated_rollout(gates: dict):
    """A rollout_group whose item i finishes once gates[i] is set."""
    async def rollout_group(item):
        while not gates[item["i"]].is_set():
            await asyncio.sleep(0.005)
        return [dict(episode([-1, 0]), index=item["i"])]
    return rollout_group


def test_the_data_ledger_is_the_first_item_not_yet_consumed_and_those_after_it_consumed(bg_loop):
    gates = {i: threading.Event() for i in range(10)}
    producer = RolloutProducer(bg_loop, gated_rollout(gates), lambda i: {"i": i}, capacity=3, max_staleness=0).start()
    try:
        gates[1].set()
        assert producer.get_groups(1, timeout_s=10)[0][0]["index"] == 1
        assert producer.data_ledger() == (0, [1])  # item 0 is still running: a resume must redo it, not item 1
        gates[0].set()
        producer.get_groups(1, timeout_s=10)
        assert producer.data_ledger() == (2, [])
    finally:
        for g in gates.values():
            g.set()
        producer.stop()


def test_a_producer_resumed_from_the_ledger_redoes_what_was_in_flight_and_nothing_it_consumed(bg_loop):
    gates = {i: threading.Event() for i in range(10)}
    first = RolloutProducer(bg_loop, gated_rollout(gates), lambda i: {"i": i}, capacity=4, max_staleness=1,
                            batch_groups=2).start()
    try:
        gates[1].set(), gates[2].set()
        taken = [g[0]["index"] for g in first.get_groups(2, timeout_s=10)]
        ledger = first.data_ledger()
    finally:
        first.stop()  # the kill: item 0 (and 3) were running
    assert taken == [1, 2] and ledger == (0, [1, 2])
    for g in gates.values():
        g.set()
    resumed = RolloutProducer(bg_loop, gated_rollout(gates), lambda i: {"i": i}, capacity=4, max_staleness=1,
                              batch_groups=2, start_index=ledger[0], consumed_ahead=ledger[1]).start()
    try:
        again = [g[0]["index"] for g in resumed.get_groups(2, timeout_s=10)]
        resumed.set_version(1)
        again += [g[0]["index"] for g in resumed.get_groups(2, timeout_s=10)]
    finally:
        resumed.stop()
    assert sorted(again) == [0, 3, 4, 5]  # with the first run's [1, 2]: every item once


def test_a_failing_group_is_counted_in_its_place_and_production_goes_on(bg_loop, capsys):
    async def rollout_group(item):
        if item["i"] == 1:
            raise ValueError("malformed episode")
        return [dict(episode([-1, 0]), index=item["i"])]

    producer = RolloutProducer(bg_loop, rollout_group, lambda i: {"i": i}, capacity=2, max_staleness=0).start()
    try:
        assert [g[0]["index"] for g in producer.get_groups(3, timeout_s=10)] == [0, 2]
        assert producer.num_failed == 1
        assert [g[0]["index"] for g in producer.get_groups(2, timeout_s=10)] == [3, 4]
    finally:
        producer.stop()


def test_admission_starts_only_groups_the_next_max_staleness_plus_one_steps_will_train(bg_loop):
    started = []

    async def rollout_group(item):
        started.append(item["i"])
        return [episode([-1, 0])]

    producer = RolloutProducer(bg_loop, rollout_group, lambda i: {"i": i}, capacity=100, max_staleness=1,
                               batch_groups=2).start()
    try:
        bg_loop.run(asyncio.sleep(0.1))
        assert started == [0, 1, 2, 3]  # (max_staleness + 1) x batch_groups, whatever the capacity
        assert len(producer.get_groups(2, timeout_s=10)) == 2
        bg_loop.run(asyncio.sleep(0.1))
        assert started == [0, 1, 2, 3]  # version 0's batch is taken: one step fewer to fill
        producer.set_version(1)
        bg_loop.run(asyncio.sleep(0.1))
        assert started == [0, 1, 2, 3, 4, 5]
    finally:
        producer.stop()


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_with_admission_no_group_is_dropped_and_every_step_takes_exactly_its_batch_even_with_stragglers(
        bg_loop, max_staleness):
    # A straggler started under an older version is waited for before younger groups that are ready;
    # taking the younger ones first would leave it to be taken later beside a full batch (and the
    # groups started meanwhile with it), so steps would grow past batch_groups.
    version = [0]  # the fake server tags every token with the version current when it is sampled

    async def rollout_group(item):
        await asyncio.sleep(0.002 * (item["i"] % 5) + (0.15 if item["i"] % 7 == 3 else 0))  # stragglers
        first = version[0]
        await asyncio.sleep(0.01)
        return [dict(episode([-1, first, version[0]]), index=item["i"])]

    producer = RolloutProducer(bg_loop, rollout_group, lambda i: {"i": i}, capacity=64,
                               max_staleness=max_staleness, batch_groups=3).start()
    try:
        seen = []
        for v in range(8):
            groups = producer.get_groups(3, timeout_s=10)
            assert len(groups) == 3
            assert all(v - oldest_version(g) <= max_staleness for g in groups)
            seen += [g[0]["index"] for g in groups]
            version[0] = v + 1
            producer.set_version(v + 1)
        assert producer.num_dropped_stale == 0 and producer.num_wasted_tokens == 0
        assert len(seen) == len(set(seen))
    finally:
        producer.stop()


def test_at_max_staleness_0_the_producer_runs_sync_modes_schedule(bg_loop):
    # Sync mode: step v trains items [v*B, (v+1)*B), all sampled by version v's weights, started
    # after update v-1. With max_staleness 0 the producer must do the same.
    version, starts = [0], []

    async def rollout_group(item):
        starts.append((item["i"], version[0]))
        await asyncio.sleep(0.001 * (7 - item["i"] % 7))  # finishing out of order
        return [dict(episode([-1, version[0], version[0]]), index=item["i"])]

    producer = RolloutProducer(bg_loop, rollout_group, lambda i: {"i": i}, capacity=8, max_staleness=0,
                               batch_groups=4).start()
    try:
        for v in range(4):
            groups = producer.get_groups(4, timeout_s=10)
            assert sorted(g[0]["index"] for g in groups) == list(range(4 * v, 4 * v + 4))
            assert all(oldest_version(g) == v for g in groups)
            bg_loop.run(asyncio.sleep(0.05))  # the "update": nothing may start meanwhile
            assert all(i < 4 * v + 4 for i, _ in starts)
            version[0] = v + 1
            producer.set_version(v + 1)
        assert all(i // 4 == started_at for i, started_at in starts)
    finally:
        producer.stop()


def settle(bg_loop):
    """Lets the loop run every callback already scheduled on it (the producer's wake-ups) and what
    those schedule in turn, so that the producer has acted on everything the trainer did so far."""
    async def spin():
        for _ in range(20):
            await asyncio.sleep(0)
    bg_loop.run(spin())


def test_at_max_staleness_0_a_refill_in_the_same_step_starts_the_groups_it_asks_for(bg_loop):
    # Dynamic sampling (DAPO): a step whose batch has too few groups with a learning signal asks the
    # producer for more at the same version. The order is forced: the batch is taken, the producer
    # settles with nothing to start (at max_staleness 0 the step's batch is all it may start), then
    # the refill asks.
    started = []

    async def rollout_group(item):
        started.append(item["i"])
        return [dict(episode([-1, 0]), index=item["i"])]

    producer = RolloutProducer(bg_loop, rollout_group, lambda i: {"i": i}, capacity=8, max_staleness=0,
                               batch_groups=2).start()
    try:
        assert [g[0]["index"] for g in producer.get_groups(2, timeout_s=10)] == [0, 1]
        settle(bg_loop)
        assert started == [0, 1]
        assert [g[0]["index"] for g in producer.get_groups(1, timeout_s=10)] == [2]
    finally:
        producer.stop()


@pytest.mark.parametrize("name,value", [("max_staleness", -1), ("capacity", -1), ("capacity", 0)])
def test_a_negative_max_staleness_or_a_capacity_below_one_is_a_value_error_naming_it(bg_loop, name, value):
    with pytest.raises(ValueError, match=name):
        RolloutProducer(bg_loop, lambda item: None, lambda i: {"i": i}, **{"capacity": 4, "max_staleness": 0,
                                                                            name: value})


class WatchedVersions(torch.Tensor):
    """A versions tensor that records the thread of every operation on it."""
    threads: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.threads.append(threading.current_thread().name)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_groups_oldest_version_is_found_when_it_completes_on_the_loop_not_by_the_trainer(bg_loop):
    # The trainer takes groups under the producer's lock, which the loop's tasks need too: it must
    # not walk tokens there. The oldest version is found once, as the group completes.
    async def rollout_group(item):
        versions = torch.tensor([[-1, 0, 0]]).as_subclass(WatchedVersions)
        return [{"versions": versions, "rewards": torch.tensor([1.0])}]

    WatchedVersions.threads = []
    producer = RolloutProducer(bg_loop, rollout_group, lambda i: {"i": i}, capacity=2, max_staleness=0).start()
    try:
        assert len(producer.get_groups(2, timeout_s=10)) == 2
    finally:
        producer.stop()
    assert WatchedVersions.threads and set(WatchedVersions.threads) == {"rollout-loop"}


def test_a_taken_group_is_judged_by_its_oldest_sampled_token_wherever_it_is_in_the_group(bg_loop):
    async def rollout_group(item):
        oldest = 3 if item["i"] < 2 else 6  # 3: mid-way through the second episode
        return [dict(episode([-1, 6, 6]), index=item["i"]), episode([-1, 7, oldest, 8, -1])]

    producer = RolloutProducer(bg_loop, rollout_group, lambda i: {"i": i}, capacity=1, max_staleness=2,
                               version=5).start()
    try:
        assert [g[0]["index"] for g in producer.get_groups(1, timeout_s=10)] == [0]  # 5 - 3 = 2: kept
        producer.set_version(6)
        assert [g[0]["index"] for g in producer.get_groups(1, timeout_s=10)] == [2]  # 6 - 3 = 3: item 1 dropped
        assert producer.num_dropped_stale == 1 and producer.num_wasted_tokens == 5
    finally:
        producer.stop()


def test_at_max_staleness_0_a_steps_groups_come_in_item_order_when_they_finish_in_reverse(bg_loop):
    # Sync mode's order (the rows each PPO mini-batch gets depend on it), not the order they finish.
    version = [0]

    async def rollout_group(item):
        await asyncio.sleep(0.05 * (3 - item["i"] % 4))  # in each step, item 3 first, item 0 last
        return [dict(episode([-1, version[0]]), index=item["i"])]

    producer = RolloutProducer(bg_loop, rollout_group, lambda i: {"i": i}, capacity=4, max_staleness=0,
                               batch_groups=4).start()
    try:
        assert [g[0]["index"] for g in producer.get_groups(4, timeout_s=10)] == [0, 1, 2, 3]
        version[0] = 1
        producer.set_version(1)
        assert [g[0]["index"] for g in producer.get_groups(4, timeout_s=10)] == [4, 5, 6, 7]
    finally:
        producer.stop()


def test_at_max_staleness_0_a_failed_group_is_dropped_and_counted_not_replaced_as_in_sync_mode(bg_loop):
    started, version = [], [0]

    async def rollout_group(item):
        started.append(item["i"])
        if item["i"] == 1:
            raise ValueError("malformed episode")
        return [dict(episode([-1, version[0]]), index=item["i"])]

    producer = RolloutProducer(bg_loop, rollout_group, lambda i: {"i": i}, capacity=4, max_staleness=0,
                               batch_groups=3).start()
    try:
        assert [g[0]["index"] for g in producer.get_groups(3, timeout_s=10)] == [0, 2]
        assert producer.num_failed == 1
        settle(bg_loop)
        assert started == [0, 1, 2]  # item 3 is the next step's, not item 1's stand-in
        version[0] = 1
        producer.set_version(1)
        assert [g[0]["index"] for g in producer.get_groups(3, timeout_s=10)] == [3, 4, 5]
    finally:
        producer.stop()


def test_when_every_group_the_trainer_takes_failed_the_first_error_is_raised_as_in_sync_mode(bg_loop):
    async def rollout_group(item):
        raise ValueError(f"broken episode {item['i']}")

    producer = RolloutProducer(bg_loop, rollout_group, lambda i: {"i": i}, capacity=2, max_staleness=0,
                               batch_groups=2).start()
    try:
        with pytest.raises(RuntimeError, match="all 2 groups") as error:
            producer.get_groups(2, timeout_s=10)
        assert isinstance(error.value.__cause__, ValueError) and "broken episode 0" in str(error.value.__cause__)
        assert producer.num_failed == 2
    finally:
        producer.stop()
