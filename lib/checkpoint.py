"""Training checkpoints on disk: model, optimizer and scheduler state plus the caller's `extra`
(data position, RNG, step, policy version), written atomically, and read back.

A checkpoint is a directory: torch.distributed.checkpoint files (one shard a rank under FSDP,
resharding-capable) and `trainer_state.pt` (scheduler + extra). It is written beside its path and
swapped in (`fresh_tmp`, `swap_in`), so one whole checkpoint exists on disk at every moment.
"""
import contextlib
import os
import shutil
import warnings

import torch
import torch.distributed as dist


def save_checkpoint(path: str, model, optimizer, scheduler, extra: dict | None = None, *, rank: int = 0,
                    world_size: int = 1, trainable_only: bool = False) -> None:
    """`model`'s and `optimizer`'s state (the fp32 masters: what resumes training) and `scheduler`'s
    to directory `path`, plus `extra` (anything torch.save handles). Every rank calls it.
    `trainable_only`: the model's parameters that require grad alone (LoRA: the adapters, a few MB)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    tmp = fresh_tmp(path) if rank == 0 else path + ".tmp"
    if world_size > 1:
        dist.barrier()
    fresh = not optimizer.state
    model_state, optim_state = get_state_dict(model, optimizer,
                                              options=StateDictOptions(ignore_frozen_params=trainable_only))
    model_state = _trainable(model, model_state) if trainable_only else model_state
    if fresh:  # get_state_dict made the state by a zero-gradient step: count it back to 0, or the first
        for state in optimizer.state.values():  # real update's bias correction would be step 2's
            state["step"].zero_()
    _check_free_space(tmp, {"model": model_state, "optimizer": optim_state})
    with _single_process_dcp_quiet():
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp, no_dist=world_size == 1)
    if rank == 0:
        torch.save({"scheduler": scheduler.state_dict(), "extra": extra or {}}, os.path.join(tmp, "trainer_state.pt"))
    if world_size > 1:
        dist.barrier()
    if rank == 0:
        swap_in(tmp, path)
    if world_size > 1:
        dist.barrier()


def load_checkpoint(path: str, model, optimizer, scheduler, *, world_size: int = 1, trainable_only: bool = False) -> dict:
    """Restore into `model`, `optimizer` and `scheduler` what `save_checkpoint(path, ...)` wrote;
    returns its `extra`. `trainable_only` as the save's: the frozen parameters stay as they are."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    path = _whole_checkpoint(path)
    if not os.path.exists(os.path.join(path, "trainer_state.pt")):
        raise FileNotFoundError(f"no checkpoint at {path} (trainer_state.pt missing); "
                                f"start without --resume or point at a directory save_checkpoint wrote")
    options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": _trainable(model, model_state) if trainable_only else model_state, "optimizer": optim_state}
    with _single_process_dcp_quiet():
        dcp.load(state, checkpoint_id=path, no_dist=world_size == 1)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=options)
    # Holds the caller's extra (RNG states, tuples): not a weights-only file.
    trainer_state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    scheduler.load_state_dict(trainer_state["scheduler"])
    return trainer_state["extra"]


def _trainable(model, model_state: dict) -> dict:
    # ignore_frozen_params keeps a tied weight's second name (lm_head.weight): the parameters alone
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model_state.items() if k in trained}


def _whole_checkpoint(path: str) -> str:
    if not os.path.exists(path) and os.path.exists(os.path.join(path.rstrip("/") + ".old", "trainer_state.pt")):
        return path.rstrip("/") + ".old"  # killed in the middle of swap_in: the previous one is whole
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


def fresh_tmp(path: str) -> str:
    """An empty directory beside `path` to write into, then `swap_in`."""
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def swap_in(tmp: str, path: str) -> None:
    """Replace directory `path` by `tmp`: at every moment one complete version exists on disk."""
    path = path.rstrip("/")
    old = path + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
