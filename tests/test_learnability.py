"""The learnability probe: pass@k, the share of groups with signal, and the verdict it prints."""
import pytest
import torch

from lib.learnability import learnability, learnability_report, verdict


def test_pass_at_k_and_the_groups_that_carry_signal():
    probe = learnability([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 1]])
    assert probe["questions"] == 4 and probe["k"] == 4
    assert probe["pass_at_1"] == pytest.approx((0.25 + 0 + 1 + 0.5) / 4)
    assert probe["pass_at_k"] == 0.75 and probe["groups_with_signal"] == 0.5


def test_partial_rewards_are_not_solved_but_do_carry_signal():
    probe = learnability([[0.5, 0.0], [0.5, 0.5]])  # F1-like rewards
    assert probe["pass_at_k"] == 0.0 and probe["groups_with_signal"] == 0.5


@pytest.mark.parametrize("groups, says", [
    ([[1, 1, 1, 1]] * 9 + [[1, 0, 1, 1]], "all right"),
    ([[0, 0, 0, 0]] * 9 + [[1, 0, 0, 0]], "all wrong"),
    ([[1, 0, 0, 1]] * 5 + [[0, 0, 0, 0]] * 5, "has signal"),
])
def test_the_verdict_names_what_limits_the_signal(groups, says):
    assert says in verdict(learnability(groups))


def test_the_report_reads_episode_rewards_and_prints_its_verdict(capsys):
    episode = lambda r: {"rewards": torch.tensor([float(r)])}  # noqa: E731
    metrics = learnability_report([[episode(1), episode(0)], [episode(0), episode(0)]])
    assert metrics["probe/groups_with_signal"] == 0.5 and metrics["probe/pass_at_k"] == 0.5
    assert "learnability probe: pass@1 0.250, pass@2 0.500" in capsys.readouterr().out
