"""AdamW with its state off the GPU: the fp32 master weights and both moments live in (pinned) CPU
memory and visit the GPU one bucket at a time for the step itself.

Why: with master weights a bf16 model costs 2 (bf16) + 4 (fp32 master) + 8 (two fp32 moments) = 14
bytes per parameter on the GPU, all the time. Offloaded, the GPU holds 2 bytes per parameter between
updates (plus the bf16 gradients during one), so a server sharing the GPU gets the rest while it
generates, and a 7B model (98 GB of weights and state) trains on one 80 GB GPU. The price is the
copies: the master and the moments cross PCIe twice per step (12 bytes per parameter each way).

The step is torch's own AdamW kernel (fused on CUDA) on the bucket's copies, and the state is kept
under the optimizer's own keys (`step`, `exp_avg`, `exp_avg_sq`), so checkpoints are the same as
without offloading and a run may resume with it on or off.
"""
import contextlib
import math

import torch
from torch.optim.adamw import adamw


class HostBuffer:
    """One flat CPU buffer (fp32 unless `dtype`), page-locked in place (cudaHostRegister) while this object lives, when
    `page_locked` and a GPU is there (asynchronous copies need page-locked memory). Not torch's pinned allocator
    (`pin_memory()`): it rounds every block up to a power of two, which at 7B shapes turns the 84 GB
    of master weights and moments into ~165 GB, more than the machine holds. Keep this object
    alive as long as the views `views()` hands out are used."""

    def __init__(self, numel: int, page_locked: bool = True, dtype: torch.dtype = torch.float32):
        self.tensor = torch.zeros(numel, dtype=dtype)
        self._registered = None
        if page_locked and torch.cuda.is_available() and numel:
            nbytes = numel * self.tensor.element_size()
            # flag 1 = cudaHostRegisterPortable: page-locked for every GPU of the process, not only the current one
            err = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 1))
            if err:
                raise RuntimeError(f"cudaHostRegister of {nbytes / 1e9:.1f} GB of CPU memory failed (CUDA error "
                                   f"{err}); is the machine short of memory? offload_optimizer needs 12 bytes "
                                   f"per parameter of CPU memory")
            self._registered = self.tensor.data_ptr()

    def views(self, shapes: list[torch.Size]) -> list[torch.Tensor]:
        """Consecutive tensors of `shapes` inside the buffer."""
        out, offset = [], 0
        for shape in shapes:
            n = math.prod(shape)
            out.append(self.tensor[offset:offset + n].view(shape))
            offset += n
        return out

    def __del__(self):
        if self._registered is not None:
            try:
                torch.cuda.cudart().cudaHostUnregister(self._registered)
            except Exception:  # at interpreter exit the CUDA runtime may be gone first; the OS frees it all
                pass
            self._registered = None


def into_host_buffers(optimizer: torch.optim.AdamW, buffers: list[HostBuffer] | None = None,
                      page_locked: bool = True) -> list[HostBuffer]:
    """Puts `optimizer`'s parameters (fp32 masters on the CPU) and its AdamW state into three
    HostBuffers, so that every copy of the offloaded step is from page-locked memory: the masters
    move into the first (their old storage is freed as they go), the moments of those that train
    into the other two; a parameter with no state yet gets what AdamW's first step would make (zero
    moments, step 0). Made here unless `buffers` are given: call it again with them after loading a
    state dict, which leaves tensors of its own. Keep the buffers alive with the optimizer."""
    masters = optimizer.param_groups[0]["params"]
    trained = [m for m in masters if m.requires_grad]
    if buffers is None:  # the moments' buffers after the masters moved: the CPU never holds both copies and them
        buffers = [HostBuffer(sum(m.numel() for m in masters), page_locked)]
    with torch.no_grad():
        for master, view in zip(masters, buffers[0].views([m.shape for m in masters])):
            if master.data_ptr() != view.data_ptr():
                view.copy_(master)
                master.data = view
        if len(buffers) == 1:
            buffers += [HostBuffer(sum(m.numel() for m in trained), page_locked) for _ in range(2)]
        shapes = [m.shape for m in trained]
        for master, exp_avg, exp_avg_sq in zip(trained, buffers[1].views(shapes), buffers[2].views(shapes)):
            state = optimizer.state[master]
            if not state:
                state.update(step=torch.tensor(0.0), exp_avg=exp_avg.zero_(), exp_avg_sq=exp_avg_sq.zero_())
            for key, view in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                if state[key] is not view:
                    view.copy_(state[key])
                    state[key] = view
    return buffers


def _to(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    # Always a copy (even on the same device): the step works on it, the original is written back.
    return torch.empty_like(tensor, device=device, dtype=dtype).copy_(tensor, non_blocking=True)


def buckets(sizes: list[int], bucket_numel: int) -> list[list[int]]:
    """Consecutive index runs whose sizes add up to at most `bucket_numel` (one larger tensor is a
    bucket of its own)."""
    out, current, total = [], [], 0
    for i, size in enumerate(sizes):
        if current and total + size > bucket_numel:
            out.append(current)
            current, total = [], 0
        current.append(i)
        total += size
    if current:
        out.append(current)
    return out


@torch.no_grad()
def offloaded_adamw_step(optimizer: torch.optim.AdamW, masters: list[torch.Tensor], grads: list[torch.Tensor],
                         models: list[torch.Tensor], *, device: torch.device, grad_scale: float | torch.Tensor = 1.0,
                         bucket_numel: int = 128 * 2**20, overlap: bool = True) -> None:
    """One AdamW step of the CPU-resident `masters` (parameters of `optimizer`'s single group; their
    state, where it exists, is stepped in place: keep it in a HostBuffer for fast copies) with
    `grads` (on `device`, any float dtype; multiplied by `grad_scale`, e.g. a clip coefficient),
    run on `device` bucket by bucket. The new masters are written back to the CPU and, cast, into
    `models` (the parameters the forward uses, on `device`). Returns when all copies are done.

    On CUDA with `overlap`, the next bucket's copy in and the last one's copy out run on streams of
    their own while a bucket steps (PCIe carries both directions at once); `overlap=False` runs
    everything on the current stream, one after the other (for comparison)."""
    group = optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    streams = device.type == "cuda" and overlap
    compute = torch.cuda.current_stream(device) if streams else None
    copy_in = torch.cuda.Stream(device) if streams else None
    copy_out = torch.cuda.Stream(device) if streams else None

    def load(bucket: list[int]):  # the bucket's masters and moments on the device, and when they are there
        for i in bucket:
            state = optimizer.state[masters[i]]
            if not state:  # what AdamW creates at a parameter's first step
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(masters[i], memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(masters[i], memory_format=torch.preserve_format)
        with torch.cuda.stream(copy_in) if streams else contextlib.nullcontext():
            loaded = [[_to(masters[i], device) for i in bucket],
                      [_to(optimizer.state[masters[i]]["exp_avg"], device) for i in bucket],
                      [_to(optimizer.state[masters[i]]["exp_avg_sq"], device) for i in bucket]]
        return loaded, copy_in.record_event() if streams else None

    plan = buckets([m.numel() for m in masters], bucket_numel)
    upcoming = load(plan[0]) if plan else None
    for k, bucket in enumerate(plan):
        (params, exp_avgs, exp_avg_sqs), ready = upcoming
        if k + 1 < len(plan):
            upcoming = load(plan[k + 1])
        if streams:
            compute.wait_event(ready)
        # made on the device from the CPU count (no copy, no wait); counted again on the CPU below
        steps = [torch.full((), float(optimizer.state[masters[i]]["step"]), dtype=torch.float32, device=device)
                 for i in bucket]
        # the same arithmetic as casting the gradient to fp32 and clipping it in place (a copy: the
        # caller's gradients stay as they were)
        bucket_grads = [grads[i].to(torch.float32, copy=True).mul_(grad_scale) for i in bucket]
        adamw(params, bucket_grads, exp_avgs, exp_avg_sqs, [], steps, fused=device.type == "cuda" or None,
              amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
              eps=group["eps"], maximize=False)
        for j, i in enumerate(bucket):
            models[i].copy_(params[j])
            optimizer.state[masters[i]]["step"] += 1  # what the kernel did to its copy
        if streams:
            copy_out.wait_stream(compute)
        with torch.cuda.stream(copy_out) if streams else contextlib.nullcontext():
            for j, i in enumerate(bucket):
                state = optimizer.state[masters[i]]
                masters[i].copy_(params[j], non_blocking=True)
                state["exp_avg"].copy_(exp_avgs[j], non_blocking=True)
                state["exp_avg_sq"].copy_(exp_avg_sqs[j], non_blocking=True)
        if streams:  # made on copy_in, used on the other two: not reused before they are done
            for t in params + exp_avgs + exp_avg_sqs:
                t.record_stream(compute)
                t.record_stream(copy_out)
    if device.type == "cuda":  # the CPU copies are asynchronous: done before anyone reads them
        torch.cuda.synchronize(device)
