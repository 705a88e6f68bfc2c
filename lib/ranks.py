"""Under torchrun: start the trainer's process group, say which rank this is and how many there are
(the one place lib looks them up), and what rank 0 (the one that runs the servers and the rollouts)
shares with the other ranks. With one process every function here is a no-op."""
import os

import torch
import torch.distributed as dist


def init_trainer_ranks():
    """(world_size, rank, cpu_group). Sets this rank's GPU and starts the default group (NCCL on
    GPUs, gloo on CPUs) when WORLD_SIZE > 1; `cpu_group` is a gloo group for Python objects.
    Ranks > 0 wait out rank 0's rollout inside a broadcast: over gloo they wait on the CPU, while
    an NCCL broadcast spins a kernel on their GPU, which slows an SGLang server sharing it."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 1, 0, None
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return world_size, dist.get_rank(), dist.new_group(backend="gloo")


def trainer_world_size() -> int:
    """How many trainer ranks take each step together: the started group's size, else 1."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def trainer_rank() -> int:
    """This trainer rank (0, the one that runs servers and rollouts, on one process)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def broadcast_from_rank0(obj, group):
    """Rank 0's `obj` on every rank (pickled; a step's batch is small next to the model)."""
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def server_seed(seed: int, step: int) -> int:
    """The inference server's sampling seed for a run (re)started at `step`: a resumed run must not
    replay the random stream of the run's first steps."""
    return (seed * 1_000_003 + step) % 2**31
