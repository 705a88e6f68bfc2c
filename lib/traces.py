"""Trace records: a step's traced episodes as JSON lines, token by token, for `python -m lib.viewer`.

One record per episode (docs/traces.md): its turns (model text, tool output, reflection prompts),
finish reason, reward, advantage, group, and per token after the prompt its id, text, server
log-prob, trainer log-prob (both 0 where the loss mask is 0), policy version and loss mask. Records are built after the trainer's
log-prob pass, the first point of a step at which all of that exists.
"""
import json

import torch

# Rounding keeps a record small; 1e-4 nats is below any gap worth looking at (sync-mode CPU runs
# agree to ~1e-6, a real mismatch is > 1e-2).
LOGPROB_DECIMALS = 4


def trainer_logprobs_by_episode(keep: torch.Tensor, proximal_logprobs: torch.Tensor | None, rank: int = 0,
                                world_size: int = 1) -> list:
    """Per row of the step's full batch, its row of `proximal_logprobs` (this rank's rows of the kept
    batch, `batch[rank::world_size]`), or None for a row this rank did not score (a dropped group,
    another rank's row, or a step with nothing to train on)."""
    out = [None] * len(keep)
    if proximal_logprobs is None:
        return out
    kept = keep.nonzero().flatten().tolist()
    for row, index in enumerate(kept[rank::world_size]):
        out[index] = proximal_logprobs[row]
    return out


def _logprobs(xs, mask: list) -> list:
    # Masked tokens (prompt pieces, tool output) are not trained on: 0 there, as the trajectory's
    # `logprobs` has it, keeps tool-heavy records about a third smaller.
    return [round(float(x), LOGPROB_DECIMALS) if m else 0 for x, m in zip(xs, mask)]


def episode_record(episode: dict, tokenizer, *, step: int, group: int, index: int, advantage: float,
                   trainer_logprobs: torch.Tensor | None, context_role: str = "tool",
                   correct: float | None = None, tool_failures: int | None = None) -> dict:
    """One episode as a trace record. `context_role` names the tokens the task appends between model
    turns (loss_mask 0): "tool" output, or a "reflection" prompt. `correct` is the task's own
    verdict on the answer (e.g. exact match) when it differs from the reward; None when it does not."""
    ids = episode["input_ids"][0].tolist()
    mask = episode["loss_mask"][0].tolist()
    prompt_len = mask.index(1) if 1 in mask else len(ids)
    gen = slice(prompt_len, len(ids))
    token_texts = tokenizer.batch_decode([[i] for i in ids[gen]], skip_special_tokens=False)
    turns, start = [], 0
    for end in range(1, len(ids) - prompt_len + 1):  # runs of equal loss mask are the turns
        if end == len(ids) - prompt_len or mask[prompt_len + end] != mask[prompt_len + start]:
            turns.append({"role": "model" if mask[prompt_len + start] else context_role, "start": start, "end": end,
                          "text": tokenizer.decode(ids[prompt_len + start:prompt_len + end], skip_special_tokens=False)})
            start = end
    stats = {k: v for k, v in episode.items() if isinstance(v, (bool, int, float))}  # num_turns, num_tool_calls, ...
    return {
        "step": step, "group": group, "index": index,
        "question": episode.get("question"), "gold": episode.get("gold"), "answer": episode.get("answer"),
        "reward": round(episode["rewards"].item(), 6), "advantage": round(float(advantage), 6),
        "finish": episode.get("finish_reason"), "correct": correct, "tool_failures": tool_failures,
        "stats": stats,
        "prompt": tokenizer.decode(ids[:prompt_len], skip_special_tokens=False),
        "turns": turns,
        "tokens": {
            "id": ids[gen], "text": token_texts, "mask": mask[gen],
            "lp": _logprobs(episode["logprobs"][0, gen].tolist(), mask[gen]),
            "tlp": _logprobs(trainer_logprobs[gen].tolist(), mask[gen]) if trainer_logprobs is not None else None,
            "ver": episode["versions"][0, gen].tolist(),
        },
    }


def trace_records(step: int, episodes: list[dict], advantages: torch.Tensor, trainer_logprobs: list, tokenizer,
                  group_size: int, trace_groups: int, *, context_role: str = "tool", correct=None,
                  tool_failures=None) -> list[dict]:
    """Records of the step's first `trace_groups` groups (whole groups, so the viewer can show a
    group's episodes side by side with their advantages). `episodes` are the step's episodes in batch
    order, `advantages [B]` and `trainer_logprobs` (from `trainer_logprobs_by_episode`) their rows;
    `correct(episode)` and `tool_failures(episode)` give the task's answer verdict and failed tool
    calls, when it has them."""
    records = []
    for i, episode in enumerate(episodes[: trace_groups * group_size]):
        records.append(episode_record(
            episode, tokenizer, step=step, group=i // group_size, index=i % group_size,
            advantage=advantages[i].item(), trainer_logprobs=trainer_logprobs[i], context_role=context_role,
            correct=float(correct(episode)) if correct else None,
            tool_failures=int(tool_failures(episode)) if tool_failures else None))
    return records


def write_traces(trace_file, records: list[dict]):
    for record in records:
        trace_file.write(json.dumps(record, separators=(",", ":")) + "\n")
    trace_file.flush()
