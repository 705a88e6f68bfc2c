"""Token log-probs of a causal LM: `compute_logprobs` (padded or packed rows), the chunked LM head
that never builds a [N, vocab] tensor (`HeadLogprobs`), and `PolicyForward`, the module FSDP2
shards as its root.

Conventions (docs/trajectory.md): tensors are right padded `[B, T]`; `logprobs[:, t]` is the log-prob
of token t given tokens < t (0 at position 0 and on padding), the same layout the server's
behaviour log-probs use in a trajectory.
"""
import functools

import torch
from torch import nn

from lib.attention import packed_kwargs
from lib.padding import pack_sequences, sequence_lengths, unpack_sequences


def check_plain_head(causal_lm: nn.Module) -> None:
    """The chunked head computes `hidden @ weight.T`: a model whose logits are more than that (a head
    with a bias, Gemma 2's final logit soft-capping) would get log-probs of another model, silently.
    Raise instead, naming what is missing."""
    head = causal_lm.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(causal_lm).__name__}'s LM head has a bias, which lib's chunked log-probs "
                         "(lib/logprobs.py, HeadLogprobs) do not add")
    softcap = getattr(causal_lm.config, "final_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(f"{type(causal_lm).__name__} soft-caps its logits (final_logit_softcapping={softcap}), "
                         "which lib's chunked log-probs (lib/logprobs.py, HeadLogprobs) do not")


class PolicyForward(nn.Module):
    """A causal LM whose forward returns token log-probs instead of logits.

    It exists so that FSDP2 can shard it as the root module: its pre-forward hook then gathers the
    embedding, final norm and LM head, which `token_logprobs` uses outside the HF forward (it
    applies the head in chunks so a [N, vocab] fp32 tensor is never built at once)."""

    def __init__(self, causal_lm: nn.Module, logits_chunk_tokens: int = 2048, fused_head: bool = False,
                 packed_min_tokens: int = 0, packed_multiple: int = 1):
        super().__init__()
        check_plain_head(causal_lm)
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
    lp, ent = head_logprobs(head, hidden_prev, targets, temperature, logits_chunk_tokens, return_entropy, fused_head)
    zero_col = hidden.new_zeros(rows, 1, dtype=torch.float32)
    logprobs = torch.cat([zero_col, lp.view(rows, length - 1)], dim=1)
    entropy = torch.cat([zero_col, ent.view(rows, length - 1)], dim=1) if return_entropy else None
    if position_ids is not None:
        starts = position_ids.expand(rows, -1) == 0
        logprobs = logprobs.masked_fill(starts, 0.0)
        entropy = entropy.masked_fill(starts, 0.0) if entropy is not None else None
    return logprobs, entropy


def head_logprobs(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                  chunk: int = 2048, return_entropy: bool = False, fused: bool = False):
    """`HeadLogprobs` of `hidden [N, H]` through the LM head `head` (its weight). Under autocast (fp32
    parameters) the head's matmul runs in the autocast dtype, as nn.Linear would."""
    device = hidden.device.type
    matmul_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
    return HeadLogprobs.apply(hidden, head.weight, targets, temperature, chunk, return_entropy, matmul_dtype, fused)


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
    (at 1.5B that work is a large share of an update's GPU time)."""

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
