"""One GRPO step, phase by phase (lib/run.py's rollout_step, train_step, sync_weights), without
servers: the rollouts are scripted groups of rewards, the actor records its updates. Every script
runs these phases; each script's own pieces (its episode metrics) are checked with them."""
import time
from types import SimpleNamespace

import pytest
import torch

import lib.run
import train_calc
import train_reflect
import train_search
import train_tir
from lib.async_rollout import BackgroundLoop

SCRIPTS = [train_search, train_reflect, train_calc, train_tir]


def fake_episode(reward: float, version: int = 0, gen_tokens: int = 3) -> dict:
    """A trajectory (docs/trajectory.md) of a 2-token prompt and `gen_tokens` sampled ones, with the
    stats every script's metrics read."""
    ids = list(range(2 + gen_tokens))
    t = lambda xs, dtype: torch.tensor([xs], dtype=dtype)  # noqa: E731
    return {"input_ids": t(ids, torch.long), "loss_mask": t([0, 0] + [1] * gen_tokens, torch.long),
            "logprobs": t([0.0, 0.0] + [-1.0] * gen_tokens, torch.float32),
            "versions": t([-1, -1] + [version] * gen_tokens, torch.long),
            "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
            "rewards": torch.tensor([reward], dtype=torch.float32),
            "num_turns": 1, "num_tool_calls": 1, "num_tool_failures": 0, "finish_reason": "answer",
            "exact_match": reward, "void_turn": False, "correct_turn": int(reward), "shows_work": True,
            "answer_in_evidence": bool(reward)}


class CountingPool:  # the reward pool's counters, read by rollout_step
    num_timeouts = num_failures = 0


class RecordingActor:
    device = torch.device("cpu")

    def __init__(self):
        self.updates = []  # rows per optimizer step

    def compute_logprobs(self, batch):
        return batch["logprobs"].clone()

    def update(self, batch, step=None):
        self.updates.append(batch["input_ids"].shape[0])
        return {"loss": 1.0, "num_tokens": int(batch["loss_mask"].sum())}


class Scripted:
    """lib.run.rollout_groups' stand-in: each call returns the next entry of `rewards` (one list of
    rewards a group), sampled under policy version `version`."""

    def __init__(self):
        self.rewards, self.version, self.calls = [], 0, []

    async def __call__(self, run, items):
        rewards = self.rewards[len(self.calls)]
        self.calls.append(len(items))
        assert len(rewards) == len(items) and all(len(g) == run.cfg.group_size for g in rewards)
        return [[fake_episode(r, version=self.version) for r in g] for g in rewards], 0


@pytest.fixture(params=SCRIPTS, ids=lambda m: m.__name__)
def script(request, monkeypatch):
    """`m`: lib.run; `metrics`: the script's episode_metrics; `new_run(**config)`: a Run of the
    script's Config with a background loop and a recording actor, its rollouts scripted by
    `scripted`, and no servers."""
    module, scripted, loops = request.param, Scripted(), []
    monkeypatch.setattr(lib.run, "rollout_groups", scripted)

    def new_run(**config):
        loops.append(BackgroundLoop())
        return lib.run.Run(cfg=module.Config(batch_size=2, group_size=2, **config), bg=loops[-1],
                           actor=RecordingActor(), reward_pool=CountingPool(),
                           train_items=[{"question": str(i), "answer": ["1"]} for i in range(10)])
    m = SimpleNamespace(rollout_step=lambda run: lib.run.rollout_step(run, module.episode_metrics),
                        train_step=lib.run.train_step, sync_weights=lib.run.sync_weights, out_of_time=lib.run.out_of_time)
    yield SimpleNamespace(m=m, scripted=scripted, new_run=new_run)
    for loop in loops:
        loop.close()


def keep_of(episodes):
    return torch.cat([e["keep"] for e in episodes]).tolist()


def test_dynamic_sampling_refills_the_batch_until_it_has_batch_size_groups_with_a_learning_signal(script):
    run = script.new_run(drop_equal_groups=True, refill_rounds=2)
    script.scripted.rewards = [[[1.0, 1.0], [0.0, 1.0]], [[1.0, 0.0]]]  # one equal group, then the one missing
    batch, episodes, metrics = script.m.rollout_step(run)
    assert script.scripted.calls == [2, 1] and run.data_position == 3 and len(episodes) == 6
    assert keep_of(episodes) == [False, False, True, True, True, True] and len(batch["rewards"]) == 4
    assert metrics["rollout/kept_groups"] == 2 and metrics["rollout/equal_reward_groups"] == 1
    assert metrics["rollout/wasted_tokens"] == 6  # the equal group's sampled tokens, not trained on


def test_refill_stops_after_refill_rounds(script):
    run = script.new_run(drop_equal_groups=True, refill_rounds=1)
    script.scripted.rewards = [[[1.0, 1.0], [0.0, 0.0]], [[1.0, 1.0], [0.0, 0.0]]]
    batch, episodes, metrics = script.m.rollout_step(run)
    assert script.scripted.calls == [2, 2] and not any(keep_of(episodes)) and metrics["rollout/kept_groups"] == 0
    assert batch == {}  # nothing to train


def test_neg_adv_scale_weights_the_below_average_episodes(script):
    script.scripted.rewards = [[[0.0, 1.0], [1.0, 0.0]]] * 2
    full = script.m.rollout_step(script.new_run())[0]["advantages"]
    batch, episodes, _ = script.m.rollout_step(script.new_run(neg_adv_scale=0.5))
    assert (full < 0).sum() == 2 and torch.equal(batch["advantages"], torch.where(full < 0, full * 0.5, full))
    assert torch.equal(torch.cat([e["advantages"] for e in episodes]), batch["advantages"])  # for the traces


def test_staleness_is_the_trained_version_minus_the_sampled_one(script):
    run = script.new_run()
    run.version, script.scripted.version = 3, 2
    script.scripted.rewards = [[[0.0, 1.0], [1.0, 0.0]]]
    metrics = script.m.rollout_step(run)[2]
    assert metrics["rollout/staleness_mean"] == 1.0 and metrics["rollout/staleness_max"] == 1.0


@pytest.mark.parametrize("ppo_minibatches, updates", [(1, [4]), (2, [2, 2]), (3, [2, 1, 1]), (9, [1, 1, 1, 1])])
def test_ppo_minibatches_split_the_kept_rows_into_that_many_optimizer_steps(script, ppo_minibatches, updates):
    run = script.new_run(ppo_minibatches=ppo_minibatches)
    script.scripted.rewards = [[[0.0, 1.0], [1.0, 0.0]]]
    batch = script.m.rollout_step(run)[0]
    metrics = script.m.train_step(run, batch)
    assert run.actor.updates == updates and metrics["loss/minibatches"] == len(updates)
    assert metrics["loss/num_tokens"] == 12  # every generated token once
    assert batch["rank_proximal_logprobs"].shape == batch["logprobs"].shape  # for the traces


def test_a_step_with_nothing_to_train_keeps_the_weights_and_the_version(script):
    run = script.new_run(drop_equal_groups=True, refill_rounds=0)
    script.scripted.rewards = [[[1.0, 1.0], [0.0, 0.0]]]
    batch = script.m.rollout_step(run)[0]
    metrics = script.m.train_step(run, batch)
    assert batch == {} and run.actor.updates == [] and "loss/minibatches" not in metrics
    script.m.sync_weights(run, trained=bool(batch))  # no client: a pause or a sync would fail here
    assert run.version == 0


def test_the_time_budget_ends_the_loop_once_spent(script):
    start = time.time()
    run = script.new_run(time_budget_s=0.5)
    assert not script.m.out_of_time(run, start) and script.m.out_of_time(run, start - 1.0)
    assert not script.m.out_of_time(script.new_run(), start - 1e6)  # 0: no budget


def test_a_task_can_leave_episodes_out_of_the_loss_after_their_rewards_count(script):
    run = script.new_run()
    script.scripted.rewards = [[[0.0, 1.0], [1.0, 0.0]]]
    batch, episodes, metrics = lib.run.rollout_step(run, lambda episodes: {},
                                                    leave_out=lambda episodes: torch.tensor([False, True, False, False]))
    assert keep_of(episodes) == [True, False, True, True] and metrics["rollout/left_out"] == 1
    assert len(batch["rewards"]) == 3 and batch["advantages"].abs().sum() > 0  # the others' advantages as computed
    assert metrics["rollout/wasted_tokens"] == 3  # the left-out episode's sampled tokens
