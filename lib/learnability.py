"""The learnability probe: before the first GRPO step, does the model leave GRPO anything to learn from?

GRPO learns only from groups whose rewards differ: a group all right or all wrong has advantage 0
for every episode. A warm start that is too strong (every sample right) or too weak (every sample
wrong) leaves most groups equal and the run flat, and nothing in the training curve says why. The
probe samples `group_size` episodes of each dev question at the training temperature, as a step
does, and reports pass@1, pass@k (k = group size), the share of questions whose samples disagree,
and a one-line verdict.
"""
import torch


def learnability(group_rewards: list[list[float]], solved: float = 1.0) -> dict:
    """`group_rewards`: one list of rewards per question. A sample is solved at reward >= `solved`."""
    groups = [g for g in group_rewards if g]
    if not groups:
        return {"questions": 0}
    share = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "questions": len(groups),
        "k": min(len(g) for g in groups),
        "mean_reward": share([share(g) for g in groups]),
        "pass_at_1": share([share([r >= solved for r in g]) for g in groups]),
        "pass_at_k": share([max(g) >= solved for g in groups]),
        "groups_with_signal": share([max(g) != min(g) for g in groups]),
    }


def verdict(probe: dict) -> str:
    if not probe.get("questions"):
        return "no dev question to probe"
    signal, mean = probe["groups_with_signal"], probe["mean_reward"]
    head = (f"pass@1 {probe['pass_at_1']:.3f}, pass@{probe['k']} {probe['pass_at_k']:.3f}, "
            f"{signal:.0%} of {probe['questions']} groups have rewards that differ")
    if signal >= 0.25:
        return f"{head}: GRPO has signal to learn from"
    if mean >= 0.5:
        return (f"{head}: most groups are all right, so GRPO has little to learn (expect a flat test): "
                f"a harder task, or a lighter warm start")
    return (f"{head}: most groups are all wrong, so GRPO has little signal: a longer warm start, "
            f"larger groups, or a higher temperature")


def learnability_report(groups: list[list[dict]]) -> dict:
    """Probe the groups of a rollout (episodes with `rewards [1]`): print the verdict, return the
    metrics to log under `probe/`."""
    probe = learnability([[float(torch.as_tensor(e["rewards"]).reshape(-1)[0]) for e in g] for g in groups])
    print(f"learnability probe: {verdict(probe)}", flush=True)
    return {f"probe/{k}": v for k, v in probe.items()}
