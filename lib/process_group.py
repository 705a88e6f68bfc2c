"""A torch.distributed process group for weight sync, built the way SGLang builds its own.

SGLang's `/init_weights_update_group` makes each server rank call
`sglang.srt.utils.common.init_custom_process_group(backend, init_method="tcp://addr:port",
world_size, rank=rank_offset + tp_rank, group_name)`, which does:

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                      group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}

The trainer (rank 0, which hosts the TCPStore) must build its side with the same store prefixes or
the two sides wait on different keys forever; this module is that trainer side, and the CPU server
uses it too, so one trainer code path talks to SGLang and to lib's CPU server alike.

No default process group is needed: `_new_process_group_helper` with an empty rank list builds a
group "like the default one" (every rank of the store is a member), and the explicit
`pg_group_ranks` entry lets `broadcast(src=0, group=pg)` map rank 0 without consulting the default
group. So a plain single-process trainer can call this, and so can a torchrun rank that already has
a default group (the new group is separate from it).
"""
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous


def init_custom_process_group(
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float = 300.0,
    device_id: torch.device | None = None,
) -> dist.ProcessGroup:
    """Join (rank > 0) or host (rank 0) the process group `group_name` at `init_method`
    (`tcp://host:port`). Blocks until all `world_size` ranks have joined or `timeout_s` passes.

    `backend`: "gloo" (CPU tensors) or "nccl" (CUDA tensors). `device_id` binds an NCCL group to one
    GPU and creates its communicator eagerly; leave it None to match SGLang's lazy creation.
    """
    if not group_name:
        raise ValueError("group_name must be non-empty: it prefixes every store key of the group")
    if not init_method.startswith(("tcp://", "env://", "file://")):
        raise ValueError(f"init_method must look like tcp://host:port, got {init_method!r}")
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
        device_id=device_id,
    )
    # Identity map from "global" to group rank: broadcast(src=0, group=pg) looks the source up here.
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_custom_process_group(pg: dist.ProcessGroup) -> None:
    """Tear down a group made by `init_custom_process_group` (the default group, if any, stays)."""
    dist.destroy_process_group(pg)
