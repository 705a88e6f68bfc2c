"""The trainer's policy: token log-probs, GRPO advantages, the decoupled PPO-clip loss, and the
`Actor` that owns model + optimizer + schedule (one process, or FSDP2 under torchrun).

Conventions (docs/trajectory.md): tensors are right padded `[B, T]`; `logprobs[:, t]` is the log-prob
of token t given tokens < t (0 at position 0 and on padding), the same layout the server's
behaviour log-probs use in a trajectory; `loss_mask` is 1 on generated tokens.
"""
import contextlib
import copy
import functools
import math
import os
import shutil
import warnings
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from lib.attention import VARLEN, packed_kwargs, register_varlen_attention
from lib.offload_adamw import into_host_buffers, offloaded_adamw_step
from lib.padding import pack_sequences, sequence_lengths, split_by_token_budget, unpack_sequences

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
CAP_MODES = ("truncate", "mask")


# --- log-probs ---

class PolicyForward(nn.Module):
    """A causal LM whose forward returns token log-probs instead of logits.

    It exists so that FSDP2 can shard it as the root module: its pre-forward hook then gathers the
    embedding, final norm and LM head, which `token_logprobs` uses outside the HF forward (it
    applies the head in chunks so a [N, vocab] fp32 tensor is never built at once)."""

    def __init__(self, causal_lm: nn.Module, logits_chunk_tokens: int = 2048, fused_head: bool = False,
                 packed_min_tokens: int = 0, packed_multiple: int = 1):
        super().__init__()
        self.lm = causal_lm
        self.logits_chunk_tokens = logits_chunk_tokens
        self.fused_head = fused_head
        # compute_logprobs pads a packed row to at least `packed_min_tokens`, a multiple of
        # `packed_multiple`, with a filler sequence of its own (see Actor: compiled layers).
        self.packed_min_tokens, self.packed_multiple = packed_min_tokens, packed_multiple

    def forward(self, input_ids, position_ids=None, attention_mask=None, temperature=1.0, return_entropy=False):
        return token_logprobs(self.lm, input_ids, position_ids, attention_mask, temperature, return_entropy,
                              self.logits_chunk_tokens, self.fused_head)


def token_logprobs(causal_lm: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                   attention_mask: torch.Tensor | None = None, temperature: float = 1.0,
                   return_entropy: bool = False, logits_chunk_tokens: int = 2048, fused_head: bool = False):
    """logprobs [R, L] (and entropy [R, L] or None) for `input_ids [R, L]`, one forward pass.

    Position 0 of each row, and every position whose `position_ids` is 0 (a packed sequence's
    start), gets 0. Padding positions are not zeroed here (callers mask them).
    """
    # use_cache=False matters: with a cache object present, transformers skips the detection of
    # packed sequences from position_ids and lets packed sequences attend to each other.
    # Packed rows: the sequence boundaries, found once here rather than in every layer's attention.
    boundaries = packed_kwargs(position_ids) if position_ids is not None and input_ids.shape[0] == 1 else {}
    hidden = causal_lm.get_decoder()(input_ids=input_ids, position_ids=position_ids,
                                     attention_mask=attention_mask, use_cache=False, **boundaries).last_hidden_state
    rows, length = input_ids.shape
    head = causal_lm.get_output_embeddings()
    hidden_prev = hidden[:, :-1].reshape(-1, hidden.shape[-1])  # predicts the next token
    targets = input_ids[:, 1:].reshape(-1)
    # Under autocast (fp32 parameters) the head's matmul runs in the autocast dtype, as nn.Linear would.
    matmul_dtype = (torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type)
                    else head.weight.dtype)
    lp, ent = HeadLogprobs.apply(hidden_prev, head.weight, targets, temperature, logits_chunk_tokens,
                                 return_entropy, matmul_dtype, fused_head)
    zero_col = hidden.new_zeros(rows, 1, dtype=torch.float32)
    logprobs = torch.cat([zero_col, lp.view(rows, length - 1)], dim=1)
    entropy = torch.cat([zero_col, ent.view(rows, length - 1)], dim=1) if return_entropy else None
    if position_ids is not None:
        starts = position_ids.expand(rows, -1) == 0
        logprobs = logprobs.masked_fill(starts, 0.0)
        entropy = entropy.masked_fill(starts, 0.0) if entropy is not None else None
    return logprobs, entropy


class HeadLogprobs(torch.autograd.Function):
    """logprobs [N] = log_softmax(hidden [N, H] @ weight [V, H]^T / temperature)[targets], and the
    entropy [N] of each row's distribution (for logging: no gradient), in chunks of `chunk` rows so
    that no [N, V] tensor is ever built. Backward recomputes each chunk's logits once (from the
    saved log-normaliser) instead of keeping [N, V] activations alive from forward to backward.

    Logits are float32 before the softmax: bf16 log-probs are off by ~1e-2, far above the
    server/trainer agreement we check. Temperature-scaled logits, as SGLang reports its sampled
    log-probs. The weight's gradient is summed over chunks in float32. With `fused`, the
    vocabulary-wide elementwise work of a chunk (cast, scale, log-sum-exp, entropy; softmax
    gradient) runs as torch.compile'd kernels that read the logits once instead of ~10 passes
    (measured: that work was a third of a 1.5B update's GPU time)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, return_entropy, matmul_dtype, fused=False):
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        log_z = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_zeros(n, dtype=torch.float32)
        w = weight.to(matmul_dtype)
        chunk_stats = _compiled(_chunk_stats) if fused else _chunk_stats
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            logits = hidden[start:end].to(matmul_dtype) @ w.T
            lp, lz, ent = chunk_stats(logits, targets[start:end], temperature, return_entropy)
            logprobs[start:end], log_z[start:end], entropy[start:end] = lp, lz, ent
        ctx.save_for_backward(hidden, weight, targets, log_z)
        ctx.temperature, ctx.chunk, ctx.matmul_dtype, ctx.fused = temperature, chunk, matmul_dtype, fused
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, log_z = ctx.saved_tensors
        w = weight.to(ctx.matmul_dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        chunk_grad = _compiled(_chunk_logits_grad) if ctx.fused else _chunk_logits_grad
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            h = hidden[start:end].to(ctx.matmul_dtype)
            grad_logits = chunk_grad(h @ w.T, log_z[start:end], targets[start:end], grad_logprobs[start:end],
                                     ctx.temperature)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits @ w
            if grad_weight is not None:
                grad_weight += grad_logits.T @ h
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _chunk_stats(logits, targets, temperature: float, return_entropy: bool):
    """logprobs [c], log-normaliser [c] and entropy [c] (0 without return_entropy) of one chunk's
    raw logits [c, V]."""
    logits = logits.float() / temperature
    log_z = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - log_z
    if return_entropy:
        entropy = log_z - (torch.exp(logits - log_z[:, None]) * logits).sum(-1)
    else:
        entropy = torch.zeros_like(log_z)
    return logprobs, log_z, entropy


def _chunk_logits_grad(logits, log_z, targets, grad_logprobs, temperature: float):
    """d(sum grad_logprobs * logprobs) / d logits [c, V], in the logits' dtype:
    (onehot(target) - softmax) * grad / temperature."""
    probs = torch.exp(logits.float() / temperature - log_z[:, None])
    onehot = torch.arange(logits.shape[-1], device=logits.device)[None] == targets[:, None]
    return ((onehot.float() - probs) * (grad_logprobs.float()[:, None] / temperature)).to(logits.dtype)


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


def compute_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     temperature: float = 1.0, packed: bool = True, return_entropy: bool = False):
    """logprobs [B, T] with `logprobs[:, t] = log p(input_ids[:, t] | input_ids[:, :t])`, from
    float32 `log_softmax(logits / temperature)`; 0 at position 0 and on padding.

    `model`: an HF causal LM or a `PolicyForward`. `packed`: run the rows as one padding-free row
    with position_ids restarting per sequence (transformers isolates the sequences from those);
    otherwise a padded [B, T] forward with the attention mask. With `return_entropy` returns
    `(logprobs, entropy [B, T])` (detached entropy of the next-token distribution at each position).
    Gradients flow when called with grad enabled.
    """
    forward = model if isinstance(model, PolicyForward) else PolicyForward(model)
    if packed:
        packed_batch = pack_sequences({"input_ids": input_ids, "attention_mask": attention_mask})
        ids, positions = packed_batch["input_ids"], packed_batch["position_ids"]
        n = ids.shape[1]
        filler = max(forward.packed_min_tokens, -(-n // forward.packed_multiple) * forward.packed_multiple) - n
        if filler:  # one more sequence, of token 0: its positions restart at 0, so no real token sees it
            ids = torch.cat([ids, ids.new_zeros(1, filler)], dim=1)
            positions = torch.cat([positions, torch.arange(filler, device=positions.device)[None]], dim=1)
        lp, ent = forward(ids, position_ids=positions, temperature=temperature, return_entropy=return_entropy)
        lp, ent = lp[:, :n], (ent[:, :n] if return_entropy else None)
        cu = packed_batch["cu_seqlens"]
        logprobs = unpack_sequences(lp, cu, tuple(input_ids.shape))
        entropy = unpack_sequences(ent, cu, tuple(input_ids.shape)) if return_entropy else None
    else:
        sequence_lengths(attention_mask)  # right padding, or the zeroing below would be wrong
        lp, ent = forward(input_ids, attention_mask=attention_mask, temperature=temperature,
                          return_entropy=return_entropy)
        logprobs = lp * attention_mask
        entropy = ent * attention_mask if return_entropy else None
    return (logprobs, entropy) if return_entropy else logprobs


# --- advantages ---

def grpo_advantages(rewards: torch.Tensor, group_size: int, *, scale_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """advantages [B] = (r − group mean) / (group std + eps) for consecutive groups of
    `group_size` rows; without `scale_by_std` just r − group mean (Dr. GRPO).

    std is the sample std (Bessel-corrected), as TRL and verl compute it; a group of one has
    advantage 0. A group whose rewards are all equal (`equal_reward_groups`) gets exactly 0: in
    float32, eight rewards of 0.9 have a mean that differs from 0.9 by ~6e-8 and a std of ~6e-8,
    and dividing one by the other gave every row of such a group about ±0.06, all of one sign.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.double().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centred[:, :1])
        centred = centred / (std + eps)
    centred = centred.masked_fill(equal_reward_groups(rewards, group_size).view(-1, group_size), 0.0)
    return centred.reshape(-1).float()


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
    if dist.is_available() and dist.is_initialized():
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
             norm_tokens: float | None = None):
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
    elif agg == "seq-mean-token-mean":
        tokens_per_seq = mask.sum(dim=1)
        seq_means = (per_token * mask).sum(dim=1) / tokens_per_seq.clamp(min=1.0)
        denom = (tokens_per_seq > 0).sum() if total_loss_seqs is None else total_loss_seqs
        loss = seq_means.sum() / max(float(denom), 1.0)
    else:
        if not norm_tokens:
            raise ValueError("seq-mean-token-sum-norm needs norm_tokens, the constant token count per sequence "
                             "(e.g. the episode's context budget, max_tokens)")
        seqs = (mask.sum(dim=1) > 0).sum() if total_loss_seqs is None else total_loss_seqs
        loss = (per_token * mask).sum() / (max(float(seqs), 1.0) * float(norm_tokens))

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


# --- the actor ---

def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def merge_stats(per_mb: list[dict]) -> dict:
    """Token-weighted means across micro-batches; `*_max` keys take the max; counts add up."""
    total = sum(s["num_tokens"] for s in per_mb)
    merged = {"num_tokens": total}
    for key in {k for s in per_mb for k in s} - {"num_tokens"}:
        values = [(s[key], s["num_tokens"]) for s in per_mb if key in s]
        if key.endswith("_max"):
            merged[key] = max(v for v, _ in values)
        else:
            merged[key] = sum(v * n for v, n in values) / max(1, sum(n for _, n in values))
    return merged


class Actor:
    """Model + optimizer + LR schedule of the policy being trained.

    One process: a plain module on `device` (default: cuda if available). Under torchrun
    (`torch.distributed` initialised, world size > 1): FSDP2, each decoder layer and then the root
    sharded over all ranks. The optimizer always steps float32 weights (master weights).
    `dtype="bfloat16"` makes the forward/backward compute in bf16: on one process the model that
    runs holds bf16 parameters and an fp32 copy of them (`master_model`) is what AdamW steps (its
    gradients are the bf16 ones cast up, the new weights are cast down after each step); with
    `master_weights=False` instead the fp32 model runs under autocast, which casts every weight in
    every forward and backward (slower: ~casts and fp32 elementwise work, measured in
    docs/benchmarks.md). Under FSDP2: `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`.

    `compile_layers` (default: on one GPU) compiles each decoder layer with torch.compile (dynamic
    shapes: one compile for all micro-batch lengths, ~10 s at 1.5B on the first step).

    Attention: `attn_implementation=None` runs packed micro-batches with lib's varlen attention
    (lib/attention.py: FlashAttention varlen kernel on CUDA, sequence by sequence elsewhere) and
    padded ones with transformers' default (sdpa).

    `offload_optimizer` (bf16, one process): the fp32 master weights and AdamW's moments live in
    pinned CPU memory and are stepped on the GPU a bucket at a time (lib/offload_adamw.py). Between
    updates the GPU then holds only the bf16 weights: 2 bytes a parameter instead of 14, for a
    server that shares the GPU (sleep mode) or a model whose state does not fit beside it.

    Under FSDP every rank calls every method (they hold collectives), each with its own shard of
    the batch (or all with the same batch: the result is the same either way).
    """

    def __init__(self, model_path: str, *, lr: float = 1e-6, weight_decay: float = 0.0,
                 betas: tuple = (0.9, 0.999), adam_eps: float = 1e-8, warmup_steps: int = 0, total_steps: int = 1000,
                 lr_schedule: str = "constant", grad_clip: float = 1.0, temperature: float = 1.0,
                 max_tokens_per_mb: int = 16384, dtype: str = "float32", device: str | None = None,
                 gradient_checkpointing: bool = False, freeze_embeddings: bool = False,
                 ref_model_path: str | None = None, kl_coef: float = 0.0,
                 eps_clip_low: float = 0.2, eps_clip_high: float = 0.28, loss_agg: str = "token-mean",
                 behaviour_weight_cap: float | None = None, behaviour_cap_mode: str = "truncate",
                 logits_chunk_tokens: int = 2048, master_weights: bool = True, compile_layers: bool | None = None,
                 attn_implementation: str | None = None, packed: bool | None = None,
                 offload_optimizer: bool = False, loss_norm_tokens: int | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule must be 'constant' or 'cosine', got {lr_schedule!r}")
        if loss_agg not in LOSS_AGGS:
            raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
        if loss_agg == "seq-mean-token-sum-norm" and not loss_norm_tokens:
            raise ValueError("loss_agg 'seq-mean-token-sum-norm' (Dr. GRPO) divides by a constant: pass "
                             "loss_norm_tokens, e.g. the episode's context budget (the scripts pass max_tokens)")
        self.loss_norm_tokens = loss_norm_tokens
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        self.compute_dtype = getattr(torch, dtype)
        self.grad_clip, self.temperature, self.max_tokens_per_mb = grad_clip, temperature, max_tokens_per_mb
        self.kl_coef, self.eps_clip_low, self.eps_clip_high = kl_coef, eps_clip_low, eps_clip_high
        if behaviour_cap_mode not in CAP_MODES:
            raise ValueError(f"behaviour_cap_mode must be one of {CAP_MODES}, got {behaviour_cap_mode!r}")
        self.loss_agg, self.behaviour_weight_cap, self.behaviour_cap_mode = loss_agg, behaviour_weight_cap, behaviour_cap_mode
        self.world_size = _world_size()
        self.rank = dist.get_rank() if self.world_size > 1 else 0
        if offload_optimizer and (self.world_size > 1 or dtype != "bfloat16" or not master_weights):
            raise ValueError("offload_optimizer keeps the fp32 master weights and AdamW's moments in CPU memory: it "
                             "needs dtype='bfloat16' with master_weights=True on one process (under torchrun "
                             "the optimizer state is sharded over the ranks instead)")
        self.offload_optimizer = offload_optimizer
        if device is None:
            if torch.cuda.is_available():
                device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            else:
                device = "cpu"
        self.device = torch.device(device)
        # Packing pays off with varlen attention (on GPUs: no padding, one kernel); on CPU the
        # sequence-by-sequence attention makes it slower than padded rows on the tiny model, so the
        # default (None) packs on GPUs only.
        self.packed = packed if packed is not None else self.device.type == "cuda"

        # attn_implementation None/"varlen": lib's varlen attention for packed rows (transformers'
        # sdpa would build an [N, N] block-diagonal mask for them); sdpa for padded rows.
        if attn_implementation in (None, "varlen"):
            attn_implementation = register_varlen_attention() if self.packed else None
        load_kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, **load_kwargs)
        self.model.config.use_cache = False
        if freeze_embeddings:  # the input embeddings, and the LM head with them when the two are tied
            self.model.get_input_embeddings().weight.requires_grad_(False)
        # bf16 parameters run; an fp32 copy is what the optimizer steps (one process only: under
        # FSDP2 the sharded fp32 parameters are the master weights and the policy casts them).
        self.master_model = self.model
        if master_weights and self.compute_dtype != torch.float32 and self.world_size == 1:
            self.master_model = copy.deepcopy(self.model).to("cpu" if offload_optimizer else self.device)
            self.master_model.requires_grad_(False)
            for master, param in zip(self.master_model.parameters(), self.model.parameters()):
                master.requires_grad_(param.requires_grad)
            self.model.to(self.compute_dtype)
        if gradient_checkpointing:
            # transformers 5.2x renamed gradient_checkpointing_enable; SGLang's pinned 5.12 has only the old name.
            if hasattr(self.model, "activation_checkpointing_enable"):
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # transformers 5 makes an empty tokenizer for a weights-only directory: look before loading.
        has_tokenizer = not os.path.isdir(model_path) or any(
            os.path.exists(os.path.join(model_path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
        self.tokenizer = AutoTokenizer.from_pretrained(model_path) if has_tokenizer else None
        if compile_layers is None:  # default: on one GPU (measured: 24% -> 33% MFU at 1.5B, and less memory)
            compile_layers = self.device.type == "cuda" and self.world_size == 1
        self.compile_layers = compile_layers  # also fuses the LM head's log-prob kernels (HeadLogprobs)
        if compile_layers:  # fuses each layer's elementwise work (norms, rotary, SiLU); dynamic lengths
            for layer in self.model.get_decoder().layers:
                layer.compile(dynamic=True)
        self.policy = self._wrap(self.model, logits_chunk_tokens)
        self.ref_policy = None
        if ref_model_path is not None:
            # Frozen: no master weights needed, so it is held in the compute dtype.
            ref = AutoModelForCausalLM.from_pretrained(ref_model_path, dtype=self.compute_dtype, **load_kwargs)
            ref.requires_grad_(False)
            self.ref_policy = self._wrap(ref, logits_chunk_tokens).eval()

        # fused: one kernel for the whole step on one GPU (FSDP's sharded parameters keep foreach).
        # Offloaded, this optimizer holds the state (on the CPU) and lib/offload_adamw.py steps it.
        self.optimizer = torch.optim.AdamW(self.master_model.parameters(), lr=lr, betas=tuple(betas),
                                           eps=adam_eps, weight_decay=weight_decay,
                                           fused=self.device.type == "cuda" and self.world_size == 1
                                           and not offload_optimizer)
        if offload_optimizer:  # masters and AdamW's state (made up front) in page-locked CPU buffers
            self._host_buffers = into_host_buffers(self.optimizer, page_locked=self.device.type == "cuda")
        # The schedule counts training steps when update() is given `step` (a script's step: skipped
        # updates and steps with several mini-batches or none count once each), else update() calls.
        self._schedule_step: int | None = None
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda n: _lr_factor(n if self._schedule_step is None else self._schedule_step,
                                                 warmup_steps, total_steps, lr_schedule))

    def _wrap(self, causal_lm: nn.Module, logits_chunk_tokens: int) -> PolicyForward:
        # Compiled layers: the first compile guards on the micro-batch's length N (torch 2.11's
        # inductor: N >= 4096 after a first micro-batch of 10k tokens), so a shorter one, e.g. a
        # step's last, recompiled every layer: one step as slow as the first (~20 s at 1.5B). A last
        # log-prob chunk of one row recompiled the head (size-1 dims are specialised). Packed rows of
        # at least 4096 tokens, a multiple of 64 (N - 1 never leaves one row over), compile once
        # (bench/check_recompiles.py; the filler costs < 64 tokens once N >= 4096).
        policy = PolicyForward(causal_lm, logits_chunk_tokens, fused_head=self.compile_layers,
                               packed_min_tokens=4096 if self.compile_layers else 0,
                               packed_multiple=64 if self.compile_layers else 1)
        if self.world_size == 1:
            return policy.to(self.device)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        for layer in causal_lm.get_decoder().layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(policy, mesh=mesh, mp_policy=mp)  # root: embedding, final norm, LM head
        return policy

    def _autocast(self):
        # Under FSDP2 the mixed-precision policy casts; with master weights the parameters are bf16
        # already; otherwise (master_weights=False, one process) autocast does.
        enabled = self.world_size == 1 and self.compute_dtype != torch.float32 and self.master_model is self.model
        return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=enabled)

    def _micro_batches(self, attention_mask: torch.Tensor) -> list[list[int]]:
        groups = split_by_token_budget(sequence_lengths(attention_mask).tolist(), self.max_tokens_per_mb)
        if self.world_size > 1:
            # Every forward/backward is a collective: all ranks must run the same number. Ranks with
            # fewer run extra micro-batches that contribute nothing (marked by None).
            count = torch.tensor(len(groups), device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            groups = groups + [None] * (int(count) - len(groups))
        return groups

    def _rows(self, batch: dict, rows: list[int] | None, keys: tuple) -> dict:
        """The micro-batch `rows` of `batch` on the device, trimmed to its longest row."""
        idx = torch.tensor(rows if rows is not None else [0])
        mask = batch["attention_mask"][idx]
        length = max(1, int(mask.sum(dim=1).max()))
        return {k: batch[k][idx][:, :length].to(self.device) if batch[k].dim() > 1 else batch[k][idx].to(self.device)
                for k in keys if k in batch}

    @torch.no_grad()
    def compute_logprobs(self, batch: dict, policy: PolicyForward | None = None) -> torch.Tensor:
        """logprobs [B, T] of `batch["input_ids"]` under the current weights (no grad), micro-batched
        by token budget and packed; returned on the batch's device."""
        policy = policy or self.policy
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
        out = torch.zeros(input_ids.shape, dtype=torch.float32)
        policy.eval()
        for rows in self._micro_batches(attention_mask):
            mb = self._rows(batch, rows, ("input_ids", "attention_mask"))
            with self._autocast():
                lp = compute_logprobs(policy, mb["input_ids"], mb["attention_mask"], self.temperature,
                                      packed=self.packed)
            if rows is not None:
                out[rows, :lp.shape[1]] = lp.float().cpu()
        return out.to(input_ids.device)

    def update(self, batch: dict, step: int | None = None) -> dict:
        """One optimizer step on `batch`: input_ids, attention_mask, loss_mask, logprobs (behaviour),
        advantages ([B] or [B, T]), and optionally proximal_logprobs (default: the behaviour ones,
        i.e. plain PPO) and ref_logprobs (default: computed when kl_coef > 0 and a reference model
        is loaded). Gradients accumulate over token-budget micro-batches, then clip, AdamW, LR step.

        Returns floats: loss (global), grad_norm, lr (the one this step used), num_micro_batches,
        and the token-weighted `ppo_loss` stats (clip_fraction, approx_kl, entropy, behaviour
        weights, ...; those are local to this rank under FSDP). A non-finite grad norm skips the step (`skipped` = 1).
        `step` (0-based training step): the learning rate is the schedule's at that step, so the
        schedule ends where the run does, whatever updates were skipped or split into mini-batches.
        """
        if step is not None:
            self._schedule_step = int(step)
            for group, base_lr, factor in zip(self.optimizer.param_groups, self.scheduler.base_lrs,
                                              self.scheduler.lr_lambdas):
                group["lr"] = base_lr * factor(0)
        batch = dict(batch)
        batch.setdefault("proximal_logprobs", batch["logprobs"])
        if self.kl_coef and self.ref_policy is not None and "ref_logprobs" not in batch:
            batch["ref_logprobs"] = self.compute_logprobs(batch, policy=self.ref_policy)
        if batch["advantages"].dim() == 1:
            batch["advantages"] = batch["advantages"][:, None].expand_as(batch["loss_mask"])
        loss_mask = batch["loss_mask"]
        counts = torch.tensor([float(loss_mask.sum()), float((loss_mask.sum(dim=1) > 0).sum())], device=self.device)
        if self.world_size > 1:
            dist.all_reduce(counts)
        total_tokens, total_seqs = counts.tolist()
        lr = self.optimizer.param_groups[0]["lr"]
        keys = ("input_ids", "attention_mask", "loss_mask", "logprobs", "proximal_logprobs", "advantages",
                "ref_logprobs")

        self.policy.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, per_mb = 0.0, []
        groups = self._micro_batches(batch["attention_mask"])
        # bf16 parameters with fp32 masters: each micro-batch's bf16 gradients are added into fp32 sums
        # and freed, so the gradient does not depend on the micro-batch split (summed in bf16 it did:
        # 1.2e-2 error against fp32 with 128 micro-batches, 6.5e-3 with one). FSDP2 and the fp32 paths
        # already sum in fp32.
        grad_sums = [None] * len(list(self.model.parameters())) if self.master_model is not self.model else None
        for rows in groups:
            mb = self._rows(batch, rows, keys)
            with self._autocast():
                logprobs, entropy = compute_logprobs(self.policy, mb["input_ids"], mb["attention_mask"],
                                                     self.temperature, packed=self.packed, return_entropy=True)
            loss, stats = ppo_loss(
                logprobs, mb["proximal_logprobs"].float(), mb["logprobs"].float(), mb["advantages"].float(),
                mb["loss_mask"], eps_clip_low=self.eps_clip_low, eps_clip_high=self.eps_clip_high,
                agg=self.loss_agg, behaviour_weight_cap=self.behaviour_weight_cap,
                behaviour_cap_mode=self.behaviour_cap_mode,
                ref_logprobs=mb["ref_logprobs"].float() if "ref_logprobs" in mb else None, kl_coef=self.kl_coef,
                entropy=entropy, total_loss_tokens=total_tokens, total_loss_seqs=total_seqs,
                norm_tokens=self.loss_norm_tokens)
            if rows is None:  # a padding micro-batch under FSDP: run the collectives, add nothing
                loss = loss * 0.0
            else:
                per_mb.append(stats)
                loss_sum += loss.item()
            # FSDP averages gradients over ranks; the loss is already normalised by the global token
            # count, so scale back up to get the sum.
            (loss * self.world_size).backward()
            if grad_sums is not None:
                self._add_grads_into(grad_sums)

        if self.world_size > 1:  # each rank's part is already over the global count: the sum is the loss
            loss_total = torch.tensor(loss_sum, device=self.device)
            dist.all_reduce(loss_total)
            loss_sum = loss_total.item()
        if self.offload_optimizer:
            grad_norm, skipped = self._offloaded_step(grad_sums)
        else:
            if grad_sums is not None:  # the sums become the fp32 masters' gradients
                for master, grad in zip(self.master_model.parameters(), grad_sums):
                    master.grad = None if grad is None else grad.float()
                grad_sums.clear()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.master_model.parameters(), self.grad_clip)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            grad_norm = float(grad_norm)
            skipped = not math.isfinite(grad_norm)
            if not skipped:
                self.optimizer.step()
                self._copy_master_to_model()
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            # torch checks once that optimizer.step() ran first; an offloaded or skipped step does
            # not call it, and the schedule counts scheduler steps only, so the warning is wrong here.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
        return {"loss": loss_sum, "grad_norm": grad_norm, "lr": lr, "num_micro_batches": len(groups),
                "skipped": float(skipped), **merge_stats(per_mb)}

    @torch.no_grad()
    def _add_grads_into(self, sums: list) -> None:
        """Move each parameter's bf16 .grad into `sums` (one slot a parameter, on its device): the first
        micro-batch's gradient is kept as it is, so one micro-batch costs nothing more; from the second
        on the slot is an fp32 sum (4 bytes a parameter while the update runs)."""
        for i, param in enumerate(self.model.parameters()):
            if param.grad is None:
                continue
            total = sums[i]
            sums[i] = param.grad if total is None else total.float().add_(param.grad)
            param.grad = None

    @torch.no_grad()
    def _offloaded_step(self, grad_sums: list) -> tuple[float, bool]:
        # The gradient sums (bf16 after one micro-batch, fp32 after more) stay on the GPU; the clip is
        # torch's clip_grad_norm_ arithmetic on their fp32 values, one tensor at a time (its kernels:
        # _foreach_norm on CUDA, vector_norm on CPU, so the norm is the in-memory path's to the bit),
        # coefficient min(1, clip / (norm + 1e-6)), applied as each bucket goes up.
        pairs = [(m, p, g) for m, p, g in zip(self.master_model.parameters(), self.model.parameters(), grad_sums)
                 if g is not None]
        grads = [g for _, _, g in pairs]
        per_tensor = [torch._foreach_norm([g.float()])[0] if g.is_cuda else torch.linalg.vector_norm(g.float())
                      for g in grads]
        norm = torch.linalg.vector_norm(torch.stack(per_tensor)) if grads else torch.zeros(())
        grad_norm = float(norm)
        skipped = not math.isfinite(grad_norm)
        if grads and not skipped:
            coef = torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0)
            offloaded_adamw_step(self.optimizer, [m for m, _, _ in pairs], grads, [p for _, p, _ in pairs],
                                 device=self.device, grad_scale=coef)
        grad_sums.clear()
        return grad_norm, skipped

    @torch.no_grad()
    def _copy_master_to_model(self) -> None:
        if self.offload_optimizer:  # CPU masters into the GPU's bf16 weights
            for param, master in zip(self.model.parameters(), self.master_model.parameters()):
                param.copy_(master)
        elif self.master_model is not self.model:
            torch._foreach_copy_(list(self.model.parameters()), list(self.master_model.parameters()))

    # --- weights out: HF export, weight sync, checkpoints ---

    @torch.no_grad()
    def named_full_parameters(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for every parameter, cast to `dtype` (default: the compute dtype),
        on the trainer's device. Under FSDP each tensor is all-gathered, so every rank must drain the
        iterator in step; all ranks get the full tensors. Tied weights appear once."""
        dtype = dtype or self.compute_dtype
        # With master weights the bf16 parameters are the master's cast: hand them out uncopied.
        source = self.model if next(self.model.parameters()).dtype == dtype else self.master_model
        for name, param in source.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            yield name, full.detach().to(dtype)

    def _full_state_dict(self, dtype: torch.dtype) -> dict:
        if self.world_size == 1:
            return {k: v.detach().to(dtype) for k, v in self.master_model.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: v.to(dtype) for k, v in full.items()}  # empty on ranks > 0

    def save_hf(self, path: str, dtype: torch.dtype | None = None) -> None:
        """Write an HF model directory (config + safetensors + tokenizer if one was loaded) that
        transformers, SGLang and vLLM load. Weights in `dtype` (default: the compute dtype).
        Written to a temporary directory and swapped in, so a reader never sees half a model."""
        dtype = dtype or self.compute_dtype
        state_dict = self._full_state_dict(dtype)
        if self.rank == 0:
            tmp = _fresh_tmp(path)
            config_dtype = self.model.config.dtype
            self.model.config.dtype = dtype
            try:
                self.model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            finally:
                self.model.config.dtype = config_dtype
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp)
            _swap_in(tmp, path)
        if self.world_size > 1:
            dist.barrier()

    def save_checkpoint(self, path: str, extra: dict | None = None) -> None:
        """Model, optimizer and scheduler state to directory `path` (torch.distributed.checkpoint:
        sharded files under FSDP, resharding-capable), plus `extra` (data position, RNG, step, ...:
        anything torch.save handles). Atomic: written beside `path`, then swapped in."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        tmp = _fresh_tmp(path) if self.rank == 0 else path + ".tmp"
        if self.world_size > 1:
            dist.barrier()
        fresh = not self.optimizer.state
        model_state, optim_state = get_state_dict(self.master_model, self.optimizer)
        if fresh:  # get_state_dict made the state by a zero-gradient step: count it back to 0, or the first
            for state in self.optimizer.state.values():  # real update's bias correction would be step 2's
                state["step"].zero_()
        _check_free_space(tmp, {"model": model_state, "optimizer": optim_state})
        with _single_process_dcp_quiet():
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp, no_dist=self.world_size == 1)
        if self.rank == 0:
            torch.save({"scheduler": self.scheduler.state_dict(), "extra": extra or {}},
                       os.path.join(tmp, "trainer_state.pt"))
        if self.world_size > 1:
            dist.barrier()
        if self.rank == 0:
            _swap_in(tmp, path)
        if self.world_size > 1:
            dist.barrier()

    def load_checkpoint(self, path: str) -> dict:
        """Restore what `save_checkpoint(path, extra)` wrote; returns `extra`."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        path = _whole_checkpoint(path)
        if not os.path.exists(os.path.join(path, "trainer_state.pt")):
            raise FileNotFoundError(f"no checkpoint at {path} (trainer_state.pt missing); "
                                    f"start without --resume or point at a directory save_checkpoint wrote")
        model_state, optim_state = get_state_dict(self.master_model, self.optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        with _single_process_dcp_quiet():
            dcp.load(state, checkpoint_id=path, no_dist=self.world_size == 1)
        set_state_dict(self.master_model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        if self.offload_optimizer:  # the loaded state back into the page-locked buffers
            into_host_buffers(self.optimizer, self._host_buffers)
        self._copy_master_to_model()
        # Holds the caller's extra (RNG states, tuples): not a weights-only file.
        trainer_state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
        self.scheduler.load_state_dict(trainer_state["scheduler"])
        return trainer_state["extra"]


def _whole_checkpoint(path: str) -> str:
    if not os.path.exists(path) and os.path.exists(os.path.join(path.rstrip("/") + ".old", "trainer_state.pt")):
        return path.rstrip("/") + ".old"  # killed in the middle of _swap_in: the previous one is whole
    return path


def read_checkpoint_extra(path: str) -> dict | None:
    """The `extra` dict of the checkpoint at `path` (step, version, ...) without loading weights;
    None if there is none. For what must be known before the model is built (e.g. a server's seed)."""
    state_file = os.path.join(_whole_checkpoint(path), "trainer_state.pt")
    if not os.path.exists(state_file):
        return None
    return torch.load(state_file, weights_only=False)["extra"]


@contextlib.contextmanager
def _single_process_dcp_quiet():
    # dcp warns on every single-process save/load that it assumes a single process, which it is.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _check_free_space(directory: str, state) -> None:
    """Refuse to start a checkpoint the disk cannot hold: a full disk mid-write fails deep inside
    torch.save with "unexpected pos" (or worse, silently). Every rank writes its own shard, so this
    machine's disk takes its ranks' shards (LOCAL_WORLD_SIZE, set by torchrun)."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    needed = sum(getattr(t, "_local_tensor", t).numel() * t.element_size()
                 for t in _tensors_in(state)) * local_ranks
    existing = os.path.abspath(directory)
    while not os.path.exists(existing):  # another machine's rank: rank 0 made the folder on its disk
        existing = os.path.dirname(existing)
    free = shutil.disk_usage(existing).free
    if free < needed * 1.05 + (64 << 20):
        raise OSError(f"checkpoint needs about {needed / 1e9:.1f} GB at {directory}, the disk has "
                      f"{free / 1e9:.1f} GB free (the previous checkpoint is kept until the new one is whole): "
                      f"free space, move run_dir, or raise checkpoint_every")


def _tensors_in(state):
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from _tensors_in(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _tensors_in(value)


def _fresh_tmp(path: str) -> str:
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def _swap_in(tmp: str, path: str) -> None:
    """Replace directory `path` by `tmp`: at every moment one complete version exists on disk."""
    path = path.rstrip("/")
    old = path + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
