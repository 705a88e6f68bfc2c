"""Attention over packed sequences for transformers models, without an [N, N] mask.

The trainer packs a micro-batch into one padding-free row whose `position_ids` restart at 0 per
sequence (lib/padding.py). transformers' default attention (sdpa) turns that row into an [N, N]
block-diagonal mask: quadratic in the micro-batch's tokens, not in a sequence's, which both wastes
the work and runs a 32k-token micro-batch out of memory. `VARLEN` ("agentrl_varlen") is an
attention implementation that runs each sequence on its own instead:

- on CUDA, torch's variable-length FlashAttention kernel (`torch.nn.attention.varlen.varlen_attn`,
  shipped with torch ≥ 2.10; no flash-attn package needed);
- elsewhere (CPU, or float32 which the kernel does not take), causal sdpa sequence by sequence
  (slower than one kernel, but exact and linear in the number of sequences).

Sequence boundaries come from `cu_seq_lens_q` / `max_length_q` when the caller passes them
(`packed_kwargs`, computed once per forward instead of once per layer), else from `position_ids`.

Local-attention layers (Gemma 3's five of six, Mistral's) pass `sliding_window` W: a token sees
itself and the W - 1 before it, as transformers' masks have it. Ignoring it trains another model than
the one served: on gemma-3-270m, SGLang and the trainer then disagreed by 5.8 nats a sampled token
on search episodes longer than its 512-token window (docs/benchmarks.md). Sequences no longer than W
take the paths above; longer ones the kernel's `window_size` where torch has it, else sdpa with a
banded mask. Attention logit soft-capping (Gemma 2) is not implemented: an error, not another model.
"""
import inspect

import torch
import torch.nn.functional as F

VARLEN = "agentrl_varlen"


def register_varlen_attention() -> str:
    """Make `attn_implementation=VARLEN` known to transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention)
    # No mask: the sequences are told apart by their boundaries, and causality by the kernel.
    AttentionMaskInterface.register(VARLEN, _no_mask)
    return VARLEN


def _no_mask(*args, **kwargs):
    return None


def packed_kwargs(position_ids: torch.Tensor) -> dict:
    """cu_seq_lens_q/k [S + 1] (int32) and max_length_q/k of the sequences of one packed row
    `position_ids [1, N]` (each sequence starts at position 0), named as transformers passes
    them through a model's forward to its attention function."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    cu = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature: query [1, H, N, D], key/value [1, H_kv, N, D]
    of one packed row; returns ([1, N, H, D], None). Causal within each sequence only."""
    batch, heads = query.shape[:2]
    if batch != 1:
        raise ValueError(f"{VARLEN} attention takes one packed row (batch 1), got batch {batch}; "
                         f"pack the micro-batch (lib.padding.pack_sequences) or use sdpa for padded rows")
    if dropout:
        raise ValueError(f"{VARLEN} attention has no dropout; got dropout={dropout}")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{VARLEN} attention has no logit soft-capping (softcap={kwargs['softcap']}); "
                         f"train this model with packed=False (sdpa/eager)")
    window = kwargs.get("sliding_window")
    cu = kwargs.get("cu_seq_lens_q")
    max_len = kwargs.get("max_length_q")
    if cu is None:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise ValueError(f"{VARLEN} attention needs position_ids (restarting at 0 per sequence) "
                             f"or cu_seq_lens_q to find the packed sequences")
        found = packed_kwargs(position_ids)
        cu, max_len = found["cu_seq_lens_q"], found["max_length_q"]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [N, H, D]
    if window is not None and int(max_len) <= window:
        window = None  # no sequence is longer than the window: plain causal attention is the same
    # The kernel wants one 16-bit dtype; under autocast q/k/v may differ (rotary runs in float32).
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else query.dtype
    from_kernel = query.is_cuda and dtype in (torch.bfloat16, torch.float16)
    if from_kernel:
        from torch.nn.attention.varlen import varlen_attn
        # torch 2.10/2.11 spell causality `is_causal`, later releases `window_size` (keys left, right of
        # the query), which also takes a sliding window; grouped-query heads are native only later.
        params = inspect.signature(varlen_attn).parameters
        from_kernel = window is None or "window_size" in params
    if from_kernel:
        q, k, v = (x.to(dtype).contiguous() for x in (q, k, v))
        options = {"scale": scaling}
        if "window_size" in params:
            options["window_size"] = (-1 if window is None else window - 1, 0)
        else:
            options["is_causal"] = True
        if k.shape[1] != heads:
            if "enable_gqa" in params:
                options["enable_gqa"] = True
            else:
                k, v = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (k, v))
        out = varlen_attn(q, k, v, cu.to(q.device), cu.to(q.device), int(max_len), int(max_len), **options)
    else:
        out = _per_sequence_sdpa(q, k, v, cu.tolist(), scaling, window)
    return out.unsqueeze(0), None


def _per_sequence_sdpa(q, k, v, cu: list[int], scaling, window: int | None = None):
    """[N, H, D] causal attention of each sequence cu[i]:cu[i+1] on its own; with `window`, each
    query sees only the `window` keys ending at its own."""
    gqa = k.shape[1] != q.shape[1]
    parts = []
    for start, end in zip(cu[:-1], cu[1:]):
        qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [H, L, D]
        if window is not None and end - start > window:
            pos = torch.arange(end - start, device=q.device)
            offset = pos[:, None] - pos[None, :]  # query minus key position
            band = (offset >= 0) & (offset < window)
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=band, scale=scaling, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling, enable_gqa=gqa)
        parts.append(out.transpose(0, 1))
    return torch.cat(parts)
