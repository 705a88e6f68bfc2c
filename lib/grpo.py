"""The GRPO learning signal: group advantages, the decoupled PPO-clip loss and its aggregation modes,
the server/trainer log-prob mismatch metrics and their warning, mini-batch rows, and the merge of
per-micro-batch loss stats.

Token tensors are right padded `[B, T]`; `loss_mask` is 1 on generated tokens (docs/trajectory.md).
"""
import torch
import torch.distributed as dist

from lib.ranks import trainer_world_size

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
CAP_MODES = ("truncate", "mask")


# --- advantages ---

def grpo_advantages(rewards: torch.Tensor, group_size: int, *, scale_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """advantages [B] (float32) = (r − group mean) / (group std + eps) for consecutive groups of
    `group_size` rows; without `scale_by_std` just r − group mean (Dr. GRPO).

    std is the sample std (Bessel-corrected), as TRL and verl compute it; a group of one has
    advantage 0. A group whose rewards are all equal (`equal_reward_groups`) gets exactly 0: in
    float32, eight rewards of 0.9 have a mean that differs from 0.9 by ~6e-8 and a std of ~6e-8,
    and dividing one by the other would give every row of such a group about ±0.06, all of one sign.

    Computed in float64 on each group's rewards divided by their largest magnitude where it is above
    1 (exact below), so any finite rewards give finite advantages: the sum or the squares of rewards
    near float64's range overflow otherwise. A NaN or infinite reward is a ValueError naming its
    group (the update would skip the step on NaN gradients); so is, without `scale_by_std`, an
    advantage past float32's range.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.double().view(-1, group_size)
    _check_groups(torch.isfinite(grouped), grouped, group_size,
                  "has a reward that is not a finite number (a reward past float32's range, about 3.4e38, is "
                  "inf in a float32 tensor); make the reward function return finite rewards of a sane size")
    scale = grouped.abs().amax(dim=1, keepdim=True).clamp(min=1.0)
    scaled = grouped / scale
    centred = scaled - scaled.mean(dim=1, keepdim=True)
    if scale_by_std:
        std = scaled.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centred[:, :1])
        centred = centred / (std + eps / scale)
    else:
        centred = centred * scale
    centred = centred.masked_fill(equal_reward_groups(rewards, group_size).view(-1, group_size), 0.0)
    advantages = centred.float()
    _check_groups(torch.isfinite(advantages), grouped, group_size,
                  "has advantages (reward minus the group's mean) past float32's range; scale the rewards "
                  "down, or scale the advantages by the group's std (scale_adv_by_std)")
    return advantages.reshape(-1)


def _check_groups(ok: torch.Tensor, grouped: torch.Tensor, group_size: int, problem: str):
    """ValueError naming the first group with a row not `ok` ([groups, group_size]) and its rewards."""
    bad = (~ok).any(dim=1).nonzero()
    if len(bad):
        g = int(bad[0])
        raise ValueError(f"group {g} (rows {g * group_size}-{(g + 1) * group_size - 1}) {problem}: "
                         f"rewards {grouped[g].tolist()}")


def equal_reward_groups(rewards: torch.Tensor, group_size: int, rel_tol: float = 1e-6) -> torch.Tensor:
    """bool [B], True on every row of a group whose rewards are all equal (no learning signal):
    equal up to `rel_tol` of their size, so that 0.1 + 0.2 and 0.3 are one reward. Dynamic
    sampling keeps `~equal_reward_groups(...)`."""
    grouped = rewards.double().view(-1, group_size)
    first = grouped[:, :1]
    tol = rel_tol * torch.clamp(first.abs(), min=1.0)
    equal = ((grouped - first).abs() <= tol).all(dim=1)
    return equal.repeat_interleave(group_size)


def logprob_mismatch(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                     behaviour_weight_cap: float | None = None) -> dict:
    """How far the trainer's log-probs (`proximal`) are from the server's (`behaviour`) on the
    generated tokens, over every rank's rows under torchrun: mean and max |Δ|, the behaviour
    importance weight exp(proximal − behaviour) (mean, max, fraction above the cap), and the k3
    estimate of KL(behaviour ‖ proximal) from the server's samples. In sync mode the two are the
    same policy, so everything here beyond bf16 noise is a mismatch between the two engines."""
    delta = (proximal_logprobs - behaviour_logprobs)[loss_mask.bool()].double()
    weight = torch.exp(delta)
    capped = weight > behaviour_weight_cap if behaviour_weight_cap is not None else torch.zeros_like(delta).bool()
    sums = torch.tensor([delta.numel(), delta.abs().sum().item(), weight.sum().item(), capped.sum().item(),
                         (weight - 1.0 - delta).sum().item()], dtype=torch.float64)
    maxes = torch.tensor([delta.abs().max().item() if delta.numel() else 0.0,
                          weight.max().item() if delta.numel() else 0.0], dtype=torch.float64)
    if trainer_world_size() > 1:
        device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
        sums, maxes = sums.to(device), maxes.to(device)
        dist.all_reduce(sums)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    count, abs_sum, weight_sum, capped_sum, k3_sum = sums.tolist()
    n = max(count, 1.0)
    return {"server_trainer_abs_diff_mean": abs_sum / n, "server_trainer_abs_diff_max": maxes[0].item(),
            "behaviour_weight_mean": weight_sum / n, "behaviour_weight_max": maxes[1].item(),
            "behaviour_capped_fraction": capped_sum / n, "mismatch_kl_k3": k3_sum / n}


# Past these the server and the trainer disagree beyond what two bf16 engines do on the same weights
# (SGLang vs the trainer on SmolLM2-135M: k3 KL 0.0018, capped fraction <= 0.0002; fp32 on CPU: ~1e-10).
MISMATCH_KL_WARN = 0.01
MISMATCH_CAPPED_WARN = 0.01


def mismatch_warning(mismatch: dict) -> str | None:
    """A one-line warning when `logprob_mismatch`'s k3 KL or capped fraction crosses the thresholds
    above (docs/trajectory.md), else None."""
    kl, capped = mismatch.get("mismatch_kl_k3", 0.0), mismatch.get("behaviour_capped_fraction", 0.0)
    if not (kl > MISMATCH_KL_WARN or capped > MISMATCH_CAPPED_WARN):
        return None
    return (f"warning: server and trainer log-probs disagree: k3 KL {kl:.4f} (warn > {MISMATCH_KL_WARN}), "
            f"{capped:.2%} of tokens past the behaviour-weight cap (warn > {MISMATCH_CAPPED_WARN:.0%}). In sync "
            f"mode this is a mismatch of the two engines (dtype, attention kernel, weights not synced, another "
            f"temperature or top-p), not noise; in async mode it also holds the policy's change over the staleness.")


def minibatch_rows(num_rows: int, num_minibatches: int, seed: int) -> list[torch.Tensor]:
    """Exactly `num_minibatches` non-empty, disjoint sets of row indices covering range(num_rows),
    in a random order from `seed` (`torch.chunk` may return fewer parts than asked, and under
    torchrun every rank must run the same number of optimizer steps). Needs
    1 <= num_minibatches <= num_rows."""
    if not 1 <= num_minibatches <= num_rows:
        raise ValueError(f"cannot split {num_rows} rows into {num_minibatches} non-empty mini-batches")
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed))
    return list(torch.tensor_split(order, num_minibatches))


# --- loss ---

def ppo_loss(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
             advantages: torch.Tensor, loss_mask: torch.Tensor, *, eps_clip_low: float = 0.2,
             eps_clip_high: float = 0.28, agg: str = "token-mean", behaviour_weight_cap: float | None = None,
             behaviour_cap_mode: str = "truncate", ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0, entropy: torch.Tensor | None = None,
             total_loss_tokens: float | None = None, total_loss_seqs: float | None = None,
             norm_tokens: float | None = None, row_weights: torch.Tensor | None = None):
    """Decoupled PPO-clip loss (AReaL's form): returns `(loss scalar, stats dict of floats)`.

    All token tensors are `[B, T]`; `advantages` is `[B]` (one per sequence) or `[B, T]`.
    Per token: ratio = exp(logprobs − proximal); objective max(−A·ratio, −A·clip(ratio, 1−ε_low,
    1+ε_high)) times the behaviour importance weight exp(proximal − behaviour) (no gradient), which
    corrects for the server's policy being older than the proximal one, and for the server and the
    trainer computing the same policy a little differently (bf16 kernels vs the trainer's). Above
    `behaviour_weight_cap` the weight is truncated to the cap (`behaviour_cap_mode="truncate"`,
    truncated importance sampling as TRL and verl apply it) or the token contributes 0 ("mask", as
    AReaL does; masked tokens stay in the denominator, so the loss scale does not depend on how many
    were masked). When proximal == behaviour this is plain PPO. With
    `ref_logprobs` and `kl_coef`, adds kl_coef · k3(current ‖ ref) per token.

    Aggregation, by the names the literature uses: "token-mean" (DAPO) = Σ over tokens /
    `total_loss_tokens`; "seq-mean-token-mean" (the original GRPO) = Σ over sequences of (that
    sequence's token mean) / `total_loss_seqs`; "seq-mean-token-sum-norm" (Dr. GRPO) = Σ over tokens /
    (`total_loss_seqs` × `norm_tokens`), a constant per sequence (the context budget), so that neither
    a sequence's length nor the batch's token count scales its tokens' gradient. The denominators
    default to this batch's; pass the whole batch's counts when it is split into micro-batches so that
    the accumulated gradient equals the one-big-batch gradient exactly.

    `row_weights` `[B]` (default 1 each), for the per-sequence aggregations: each row's term is
    multiplied by its weight and the sequence count is the sum of the weights of the rows that have
    loss tokens (`total_loss_seqs` then is that sum over the whole batch). An agent's episode of k
    rows (segments) weighing 1/k each then counts once, as an episode of one row does
    (lib/agent_episode.py). "token-mean" weighs every token alike and ignores them: there an
    episode's weight is its token count, however its tokens are split into rows.
    """
    if agg not in LOSS_AGGS:
        raise ValueError(f"agg must be one of {LOSS_AGGS}, got {agg!r}")
    if behaviour_cap_mode not in CAP_MODES:
        raise ValueError(f"behaviour_cap_mode must be one of {CAP_MODES}, got {behaviour_cap_mode!r}")
    mask = loss_mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.to(logprobs.dtype)
    # Masked before exp: prompt/padding positions may hold arbitrary values, and inf * 0 is nan.
    log_ratio = (logprobs - proximal_logprobs) * mask
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_clip_low, 1.0 + eps_clip_high)
    per_token = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        behaviour_weight = torch.exp((proximal_logprobs - behaviour_logprobs) * mask)
        kept = torch.ones_like(mask, dtype=torch.bool)
        applied = behaviour_weight
        if behaviour_weight_cap is not None:
            kept = behaviour_weight <= behaviour_weight_cap
            capped_value = 0.0 if behaviour_cap_mode == "mask" else behaviour_weight_cap
            applied = torch.where(kept, behaviour_weight, capped_value)
    per_token = per_token * applied
    kl_ref = None
    if ref_logprobs is not None and kl_coef:
        ref_log_ratio = (ref_logprobs - logprobs) * mask
        kl_ref = torch.exp(ref_log_ratio) - ref_log_ratio - 1.0  # k3: unbiased, always >= 0
        # A token masked out for its behaviour weight is out of the KL term too: it is not trained on.
        per_token = per_token + kl_coef * (kl_ref * kept if behaviour_cap_mode == "mask" else kl_ref)

    if agg == "token-mean":
        denom = mask.sum() if total_loss_tokens is None else total_loss_tokens
        loss = (per_token * mask).sum() / max(float(denom), 1.0)
    else:
        tokens_per_seq = mask.sum(dim=1)
        weights = torch.ones_like(tokens_per_seq) if row_weights is None else row_weights.to(mask.dtype)
        seqs = (weights * (tokens_per_seq > 0)).sum() if total_loss_seqs is None else total_loss_seqs
        seqs = float(seqs) if float(seqs) > 0 else 1.0  # weighted: a sum below 1 is a real count, not a guard
        if agg == "seq-mean-token-mean":
            seq_means = (per_token * mask).sum(dim=1) / tokens_per_seq.clamp(min=1.0)
            loss = (seq_means * weights).sum() / seqs
        else:
            if not norm_tokens:
                raise ValueError("seq-mean-token-sum-norm needs norm_tokens, the constant token count per sequence "
                                 "(e.g. the episode's context budget, max_tokens)")
            loss = ((per_token * mask).sum(dim=1) * weights).sum() / (seqs * float(norm_tokens))

    with torch.no_grad():
        on = mask.bool()
        n = int(on.sum())
        stats = {"num_tokens": n}
        if n:
            stats["clip_fraction"] = (clipped > unclipped)[on].float().mean().item()
            stats["approx_kl"] = (ratio - 1.0 - log_ratio)[on].mean().item()  # k3(proximal ‖ current)
            stats["behaviour_weight_mean"] = behaviour_weight[on].mean().item()
            stats["behaviour_weight_max"] = behaviour_weight[on].max().item()
            stats["behaviour_capped_fraction"] = (~kept)[on].float().mean().item()
            if entropy is not None:
                stats["entropy"] = entropy[on].mean().item()
            if kl_ref is not None:
                stats["kl_ref"] = kl_ref[on].mean().item()
    return loss, stats


COUNT_STATS = ("num_tokens", "nonfinite_grad_steps")


def merge_stats(per_mb: list[dict]) -> dict:
    """Token-weighted means across micro-batches; `*_max` keys take the max; counts (COUNT_STATS) add up."""
    total = sum(s["num_tokens"] for s in per_mb)
    merged = {"num_tokens": total}
    for key in {k for s in per_mb for k in s} - {"num_tokens"}:
        values = [(s[key], s["num_tokens"]) for s in per_mb if key in s]
        if key in COUNT_STATS:
            merged[key] = sum(v for v, _ in values)
        elif key.endswith("_max"):
            merged[key] = max(v for v, _ in values)
        else:
            merged[key] = sum(v * n for v, n in values) / max(1, sum(n for _, n in values))
    return merged
