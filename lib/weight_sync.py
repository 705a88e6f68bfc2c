"""Trainer → inference server weight sync, the trainer's side.

Three paths, all speaking SGLang's protocol (lib's CPU server implements the same endpoints):
- disk: `sync_weights_from_disk` writes an HF safetensors directory and asks every server to
  reload it (`/update_weights_from_disk`). Simple, works across machines with a shared disk.
- broadcast: `DistributedWeightSync` puts the trainer (rank 0) and every server worker in one
  process group (`/init_weights_update_group`, NCCL on GPUs, gloo on CPUs), then per bucket of
  tensors posts `/update_weights_from_distributed` (names, dtypes, shapes) and broadcasts the
  tensors from rank 0 in that same order. The servers receive one broadcast per name, in order,
  so the HTTP call and the broadcasts must run concurrently: the broadcasts go to a thread.

- tensor (colocated: trainer and server on one GPU or one CPU machine): `sync_weights_from_tensor`
  hands the server handles of the trainer's tensors (CUDA IPC / shared memory, lib/tensor_ipc.py)
  through `/update_weights_from_tensor`; the server copies from the trainer's memory directly.

LoRA (lib/lora.py): `lora_sync="adapter"` sends the adapters alone, as a PEFT directory on disk that
every server loads by name (`/load_lora_adapter`, name `policy-v<version>`; the two newest stay
loaded) and that the client then names in every request; `lora_sync="merged"` sends the full
weights with the adapters folded in, by any of the three paths above, for servers without adapters.
Either way the servers are tested before the first rollout (`ServerWeightSync.verify_adapters`): the
trainer moves its adapters by a known amount, far past the servers' numerical noise, and syncs them;
each server's log-probs on a fixed probe text must move as the trainer's do, else the run stops with
ServerIgnoresAdapter.

None pauses generation: the training loop pauses, syncs, continues (docs/trajectory.md, step order).
Under FSDP every trainer rank calls these (gathering full tensors is collective); only rank 0
talks to the servers and broadcasts.

`ServerWeightSync` bounds every sync (and the group's set-up) by `timeout_s` (`weight_sync_timeout_s`):
past it the run stops with WeightSyncTimeout, naming what the sync was still waiting on: the
trainer's own steps (writing the weights, a broadcast) and the server calls not yet answered.
"""
import asyncio
import os
import shutil
import sys
import time
from typing import Iterable

import torch
import torch.distributed as dist

from lib.deadlines import in_thread
from lib.process_group import destroy_custom_process_group, init_custom_process_group
from lib.ranks import trainer_rank, trainer_world_size


class WeightSyncTimeout(TimeoutError):
    """A weight sync did not finish within its bound; the message says what it was waiting on."""


class ServerIgnoresAdapter(RuntimeError):
    """A server does not serve the trainer's model, or does not move its log-probs with the trainer's LoRA adapters."""


ADAPTER_PREFIX = "policy-v"  # adapter names on the servers: policy-v<version>
KEEP_ADAPTERS = 2  # the newest adapters kept loaded (a request held by an in_place pause keeps its own)
# The adapter test (ServerWeightSync.verify_adapters). Each server's numerical noise n: its mean |log-prob
# gap| a token to the trainer on the probe text, at least the floor of the trainer's dtype (fp32 agrees to
# ~1e-6 on CPU; bf16 kernels differ by ~1e-2 a token, SGLang's from lib's by 0.05 on SmolLM2, 0.35 on Gemma 3).
# The test moves every adapter's B along a fixed random direction, scaled up a step at a time, until the
# trainer's log-probs move by PROBE_TEST_MOVE x n; past PROBE_MAX_BASE_GAP a server serves another model.
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2e-2}
PROBE_TEST_MOVE = 4.0
PROBE_TEST_SCALES = [1e-3 * 4 ** k for k in range(8)]  # 0.001 .. 16
PROBE_MAX_BASE_GAP = 1.0
# the moved adapters' name on the servers, for the test alone: one a process, so that a test adapter left on a
# server that outlives its run (killed between load and unload) never blocks the next run's
TEST_ADAPTER = f"{ADAPTER_PREFIX}test-{os.getpid()}"


def _from_rank0(*values) -> list:
    """Rank 0's `values` on every trainer rank (the ranks must decide alike: their forwards are collective)."""
    values = list(values)
    if trainer_world_size() > 1:
        dist.broadcast_object_list(values, src=0)
    return values


_waiting: dict[int, str] = {}  # what the trainer's side of a sync is waiting on now (id of its wait -> what)


async def _waiting_on(what: str, awaitable):
    """Await `awaitable`, named `what` meanwhile in a timed-out sync's error."""
    key = id(awaitable)
    _waiting[key] = what
    try:
        return await awaitable
    finally:
        _waiting.pop(key, None)


async def _to_thread_on(device: torch.device, fn, *args, **kwargs):
    """`fn` in a thread with the CUDA current device of `device` (a new thread starts on GPU 0,
    where a rank on another GPU would allocate and build NCCL communicators). A daemon thread: one
    stuck in a collective does not keep the process from exiting once its sync has timed out."""
    def run():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return fn(*args, **kwargs)
    return await in_thread(run)


async def sync_weights_from_disk(actor, client, path: str, version, flush_cache: bool = True) -> float:
    """Save the actor's weights as an HF directory at `path` (rank 0 writes), then have every
    server load it, tagged `weight_version=str(version)`. Returns the seconds taken.
    `client` may be None on ranks > 0. `flush_cache=False` keeps the servers' prefix caches: needed
    when requests are held by an `in_place` pause (SGLang can only flush an idle server)."""
    start = time.perf_counter()
    # In a thread: writing a large model takes seconds and the event loop may be serving rollouts.
    await _waiting_on(f"the trainer writing the weights to {os.path.abspath(path)}",
                      _to_thread_on(actor.device, actor.save_hf, os.path.abspath(path)))
    if trainer_rank() == 0:
        await client.update_weights_from_disk(os.path.abspath(path), weight_version=str(version),
                                              flush_cache=flush_cache)
    return time.perf_counter() - start


async def sync_adapter(actor, client, directory: str, version, loaded: list[str]) -> float:
    """LoRA: write the actor's adapters to `directory/adapter-v<version>` (a PEFT directory, in the
    trainer's compute dtype, as full weights travel: bf16 on GPUs halves the bytes of the fp32 masters,
    and SGLang serves them in bf16 anyway), have every server load it as `policy-v<version>` and the
    client name it in every request from now on; then unload (and delete) all but the KEEP_ADAPTERS
    newest of `loaded`, the names this run loaded, oldest first (kept up to date here): adapters that
    another run left on a server that outlived it are not this run's to drop, and one of them under the
    same name is replaced. Returns the seconds taken."""
    from lib.client import InferenceServerError

    start = time.perf_counter()
    path = os.path.join(os.path.abspath(directory), f"adapter-v{version}")
    await _waiting_on(f"the trainer writing the LoRA adapter to {path}",
                      _to_thread_on(actor.device, actor.save_adapter, path, actor.compute_dtype))
    if trainer_rank() != 0:
        return time.perf_counter() - start
    name = f"{ADAPTER_PREFIX}{version}"
    if name in loaded:  # the same version again (a server that lent its memory): reload it
        await client.unload_lora_adapter(name)
        loaded.remove(name)
    try:
        await client.load_lora_adapter(name, path)
    except InferenceServerError as refused:
        try:  # another run's adapter of this name? (if none is loaded, the load's own error is the one to see)
            await client.unload_lora_adapter(name)
        except InferenceServerError:
            raise refused from None
        await client.load_lora_adapter(name, path)
    loaded.append(name)
    client.set_lora_adapter(name)
    while len(loaded) > KEEP_ADAPTERS:
        old = loaded.pop(0)
        await client.unload_lora_adapter(old)
        shutil.rmtree(os.path.join(os.path.abspath(directory), f"adapter-v{old.removeprefix(ADAPTER_PREFIX)}"),
                      ignore_errors=True)
    return time.perf_counter() - start


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], limit_bytes: float):
    """`named_tensors` in lists of at most `limit_bytes` (a larger tensor alone), each list with
    whether it is the last: the weights go out a bucket at a time, and the last call of a sync
    sets the servers' version and flushes their cache."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit_bytes:
            yield bucket, False
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket, True


async def sync_weights_from_tensor(actor, client, version, tp_size: int = 1, flush_cache: bool = True,
                                   bucket_mb: float = 512) -> float:
    """Hand every server (colocated with the trainer) handles of the actor's full tensors in the
    compute dtype, tagged `weight_version=str(version)`. With bf16 master weights those are the
    running parameters themselves, handed over at once: nothing is copied on the trainer's side.
    LoRA's merged weights are copies: they go `bucket_mb` at a time, so that the copies never hold
    a whole model's worth of the GPU beside the server's own weights (a 32B model is 61 GiB).
    Returns the seconds taken. `flush_cache` as in `sync_weights_from_disk`."""
    from lib.tensor_ipc import serialize_named_tensors

    start = time.perf_counter()
    limit = bucket_mb * 2**20 if getattr(actor, "lora", False) else float("inf")
    for named, last in buckets(actor.named_full_parameters(), limit):  # each bucket alive until answered
        payload = serialize_named_tensors(named)
        if trainer_rank() == 0:
            if actor.device.type == "cuda":
                torch.cuda.synchronize(actor.device)  # the last optimizer step's copies are in the memory we share
            await client.update_weights_from_tensor(payload, tp_size=tp_size,
                                                    weight_version=str(version) if last else None,
                                                    flush_cache=flush_cache and last)
        del named, payload
    return time.perf_counter() - start


async def _first_error_or_all(*aws):
    """Await all; if one fails, raise at once instead of waiting for the others (a server that
    refused to join leaves our side of a collective blocked until its timeout)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for task in done:
        if task.exception() is not None:
            for p in pending:
                p.cancel()  # a thread already in a collective cannot be cancelled; its group is unusable now
            raise task.exception()
    return [t.result() for t in tasks]


class DistributedWeightSync:
    """The weight-update process group between this trainer and the servers behind `client`.

    `world_size` = 1 (the trainer) + every server's TP size; `rank_offsets` = each server's first
    rank (one server with TP 1: `[1]`; two with TP 2: `[1, 3]`). `backend`: "nccl" (CUDA tensors)
    or "gloo" (CPU tensors; what lib's CPU server uses). `master_address`/`master_port`: where this
    trainer hosts the group's TCP store; the servers must be able to reach it.
    """

    def __init__(self, client, *, master_address: str = "127.0.0.1", master_port: int, world_size: int,
                 rank_offsets: list[int], backend: str = "nccl", group_name: str = "weight_update_group",
                 timeout_s: float = 300.0):
        self.client = client
        self.master_address, self.master_port = master_address, int(master_port)
        self.world_size, self.rank_offsets = int(world_size), list(rank_offsets)
        self.backend, self.group_name, self.timeout_s = backend, group_name, timeout_s
        self.group = None
        self.is_sender = trainer_rank() == 0
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    async def init(self) -> None:
        """Create the group: the servers' join (which blocks until the trainer joins) and ours run
        concurrently. A no-op on trainer ranks > 0."""
        if not self.is_sender:
            return
        # Under torchrun this makes every rank a client of torchrun's store, so rank 0 would not
        # host the group's store and both sides would wait forever (see docs/sglang_contract.md §5).
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        servers_join = self.client.init_weights_update_group(
            self.master_address, self.master_port, self.rank_offsets, self.world_size, self.group_name, self.backend)
        trainer_joins = _waiting_on(
            f"the trainer joining the {self.backend} group {self.group_name!r} at {self.master_address}:"
            f"{self.master_port} with the servers' ranks {self.rank_offsets} (world size {self.world_size})",
            _to_thread_on(self.device, init_custom_process_group, self.backend,
                          f"tcp://{self.master_address}:{self.master_port}", self.world_size, 0, self.group_name,
                          timeout_s=self.timeout_s))
        _, self.group = await _first_error_or_all(servers_join, trainer_joins)

    async def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version, bucket_mb: float = 512,
                     flattened: bool = False, flush_cache: bool = True) -> float:
        """Send every `(name, full tensor)` to the servers, `bucket_mb` of tensors per HTTP call;
        the last call sets the servers' `weight_version` to str(version) and, with `flush_cache`,
        flushes their prefix cache (leave it False while an `in_place` pause holds requests).
        `flattened`: one uint8 broadcast per bucket (SGLang's `load_format="flattened_bucket"`)
        instead of one per tensor: far fewer collectives for models with many small tensors.
        Tensors are sent in their own dtype (the server casts into its parameters').

        On trainer ranks > 0 this only drains `named_tensors` (its all-gathers are collective).
        Returns the seconds taken."""
        start = time.perf_counter()
        if not self.is_sender:
            for _ in named_tensors:
                pass
            return time.perf_counter() - start
        if self.group is None:
            raise RuntimeError("DistributedWeightSync.update before init(): await sync.init() once first")
        for bucket, last in buckets(named_tensors, bucket_mb * 2**20):
            bucket = [(name, tensor.detach().to(self.device).contiguous()) for name, tensor in bucket]
            await self._send(bucket, version if last else None, flattened, flush_cache and last)
        return time.perf_counter() - start

    async def _send(self, bucket: list, version, flattened: bool, flush_cache: bool) -> None:
        last = version is not None
        names = [name for name, _ in bucket]
        tensors = [t for _, t in bucket]
        post = self.client.update_weights_from_distributed(
            names, [str(t.dtype).removeprefix("torch.") for t in tensors], [list(t.shape) for t in tensors],
            group_name=self.group_name, flush_cache=flush_cache, weight_version=str(version) if last else None,
            load_format="flattened_bucket" if flattened else None)
        megabytes = sum(t.numel() * t.element_size() for t in tensors) / 2**20
        broadcast = _waiting_on(
            f"the trainer's {self.backend} broadcast of {len(tensors)} tensors ({megabytes:.1f} MB, {names[0]} ...) "
            f"in group {self.group_name!r} to the servers' ranks",
            _to_thread_on(self.device, self._broadcast, tensors, flattened))
        await _first_error_or_all(post, broadcast)

    def _broadcast(self, tensors: list[torch.Tensor], flattened: bool) -> None:
        if flattened:  # SGLang's FlattenedTensorBucket layout: each tensor's bytes, in order
            tensors = [torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])]
        handles = [dist.broadcast(t, src=0, group=self.group, async_op=True) for t in tensors]
        for handle in handles:
            handle.wait()

    async def close(self) -> None:
        """Destroy the group on the servers and here."""
        if not self.is_sender or self.group is None:
            return
        group, self.group = self.group, None
        await _first_error_or_all(self.client.destroy_weights_update_group(self.group_name),
                                  _to_thread_on(self.device, destroy_custom_process_group, group))


class ServerWeightSync:
    """What a training script calls after each update: `sync(version)` sends the actor's weights to
    every server and returns the seconds taken. `method` "disk": `sync_weights_from_disk` into
    `disk_dir`; "tensor": `sync_weights_from_tensor` (servers on the trainer's machine, one trainer
    process); "nccl": a `DistributedWeightSync` group with every server's `tp_size` workers, built
    here once (gloo when the actor is on CPUs), rooted at `master_address` (this machine's address
    as the servers reach it: 127.0.0.1 unless they run on other machines). `run` runs a coroutine on the event loop that owns
    `client` (`lib.async_rollout.BackgroundLoop.run`). Every trainer rank makes every call; ranks > 0
    pass `client=None` and `num_servers=0`. A sync, or the group's set-up, that takes longer than
    `timeout_s` raises WeightSyncTimeout, naming what it was still waiting on."""

    def __init__(self, method: str, actor, client, run, *, num_servers: int, tp_size: int = 1,
                 disk_dir: str, bucket_mb: float = 512, master_address: str = "127.0.0.1", timeout_s: float = 600.0,
                 lora_sync: str = "adapter", probe_ids: list[int] | None = None):
        if method not in ("disk", "nccl", "tensor"):
            raise ValueError(f"weight sync method must be 'disk', 'nccl' or 'tensor', got {method!r}")
        if lora_sync not in ("adapter", "merged"):
            raise ValueError(f"lora_sync must be 'adapter' or 'merged', got {lora_sync!r}")
        # LoRA: adapters alone (by disk, whatever `method`), or the merged full weights by `method`
        self.adapters_only = bool(getattr(actor, "lora", False)) and lora_sync == "adapter"
        # LoRA: the servers' log-probs on `probe_ids` test whether they follow the adapters (verify_adapters)
        self.probe_ids = list(probe_ids) if probe_ids and getattr(actor, "lora", False) else None
        self.synced = False  # a sync has run: with adapter sync, the servers hold a version of the adapters
        self.adapters_loaded: list[str] = []  # adapter sync: the names this run loaded on the servers, oldest first
        if method == "tensor" and actor.world_size > 1:
            raise ValueError("weight sync 'tensor' hands over one process's tensors: use 'nccl' under torchrun")
        from lib.launch import free_port

        self.method, self.tp_size = method, tp_size
        self.actor, self.client, self.run, self.disk_dir, self.bucket_mb = actor, client, run, disk_dir, bucket_mb
        self.timeout_s = timeout_s
        self.broadcaster = None
        if method == "nccl" and not self.adapters_only:
            self.broadcaster = DistributedWeightSync(
                client, master_address=master_address, master_port=free_port() if trainer_rank() == 0 else 0,
                world_size=1 + num_servers * tp_size,
                rank_offsets=[1 + i * tp_size for i in range(num_servers)],
                backend="nccl" if actor.device.type == "cuda" else "gloo", timeout_s=timeout_s)
            self._bounded(self.broadcaster.init(), "setting up the weight-update group")

    def sync(self, version, flush_cache: bool = True) -> float:
        """Push the actor's weights as `version`. `flush_cache=False` while an `in_place` pause
        holds requests on the servers (SGLang can flush only an idle server's prefix cache)."""
        what = f"the weight sync of version {version} ({'LoRA adapter' if self.adapters_only else self.method})"
        self.synced = True
        if self.adapters_only:
            return self._bounded(sync_adapter(self.actor, self.client, self.disk_dir, version, self.adapters_loaded),
                                 what)
        return self._sync_full(version, what, flush_cache)

    def verify_adapters(self, version, park_base: bool = False, lend_memory: bool = False) -> dict:
        """LoRA, before the first rollout (after a resume's sync): do the servers serve the trainer's model,
        and do they apply its adapters at the trainer's scale? A test, not a watch over training: GRPO's
        early moves of any fixed text stay within the servers' bf16 noise (SGLang, SmolLM2 at lr 1e-4: 0.07-0.11
        a token after 20 steps against noise 0.05), where no verdict is possible, so the test makes its own.

        1. The servers' log-probs on the probe and the trainer's, as they are (with adapter sync the servers
           serve version `version` of the adapters: loaded here on a fresh run). The servers' noise n: their
           mean gap to the trainer on the base model (adapter sync; merged: on the weights they hold), at least
           the dtype's floor; past PROBE_MAX_BASE_GAP a server serves another model.
        2. The trainer moves every adapter's B along a fixed random direction (lib.lora.moved_adapters), the
           scale stepped up until its own log-probs move by PROBE_TEST_MOVE x n on average, and syncs that:
           adapter sync loads it under its own name (TEST_ADAPTER) and asks for it; merged sync sends the
           moved weights and then, whatever happened, the real ones again (checked: each server back where it
           was; `park_base`: the trainer's frozen base waits in host memory meanwhile, as in the run's syncs).
           `lend_memory` (sleep mode): the servers release their memory while the trainer's forwards run, as
           in a step's update, and take all of it back before the test's syncs (at 32B on one H200 the trainer's
           forwards beside an awake server ran out of GPU memory); merged sync: the real weights go back even
           where the test makes no move (released weights come back undefined).
        3. Each server's move (its answer now minus in 1) must match the trainer's to within half of
           (move + n), else ServerIgnoresAdapter: a server that ignores the adapters misses by the whole
           move, one that applies them at twice their scale (a lora_alpha mismatch) by the move again, while
           a server that follows misses by about its noise (SGLang: 1.2-1.8 n, whatever the move,
           bench/check_lora_probe.py). The adapters are back as they were; nothing random of the run is drawn.
        Every rank calls it (the trainer's forwards, exports and syncs are collective under FSDP); rank 0 asks
        the servers and every rank gets the answers, so all decide alike. Returns the test's numbers (logged
        under lora/)."""
        if self.probe_ids is None:
            return {}
        from lib.lora import moved_adapters

        if self.adapters_only and not self.synced:  # requests name an adapter from the first one on
            self.sync(version)
        addresses, served, served_base = self._on_rank0(lambda: (  # first, while the servers hold their memory
            list(self.client.addresses),
            *((self._ask(self.client.lora_adapter), self._ask(None)) if self.adapters_only else (self._ask(None),) * 2)))
        if lend_memory:  # sleep mode: the servers lend their memory for the trainer's forwards
            self._on_rank0(lambda: self._bounded(self.client.release_memory_occupation(),
                                                 "the servers' release of their memory for the LoRA adapter test"))
        try:
            trainer, noise, scale, moved, trainer_move = self._test_move(served, served_base)
        except BaseException:
            self._after_test_move(park_base, lend_memory, best_effort=True)  # the error above is the one to see
            raise
        self._after_test_move(park_base, lend_memory)

        def real_weights_back():
            self._sync_full(version, f"the weight sync of version {version} after the LoRA adapter test",
                            flush_cache=True)
        if scale is None:
            if lend_memory and not self.adapters_only:  # servers that dropped their weights get them back
                real_weights_back()
            if trainer_rank() == 0:
                print(f"warning: LoRA: moving the adapters (B up to {PROBE_TEST_SCALES[-1]:g} x a random direction) "
                      f"moved the probe's log-probs by only {moved:.3g}, under {PROBE_TEST_MOVE:g} x the servers' noise "
                      f"{noise:.3g}: whether the servers apply the adapters was not tested", file=sys.stderr)
            return {"lora/probe_base_gap": noise}
        try:
            with moved_adapters(self.actor.model, scale):
                moved_served = self._sync_test(version)
        finally:
            if not self.adapters_only:  # the servers get the real weights again, whatever happened
                real_weights_back()
        back = self._on_rank0(lambda: self._ask(None)) if not self.adapters_only else served
        allowed = 0.5 * (moved + noise)
        what = ("does not apply the LoRA adapters it loads" if self.adapters_only
                else "does not hold the merged weights it is sent")
        misses = []
        for address, lp, lp_back, base in zip(addresses, moved_served, back, served):
            if len(lp) != len(trainer) or len(lp_back) != len(trainer):
                raise ServerIgnoresAdapter(f"the server at {address} answered the LoRA probe with a different "
                                           f"number of log-probs after the adapter test's sync")
            miss = ((lp - base) - trainer_move).abs().mean().item()
            misses.append(miss)
            if miss > allowed:
                raise ServerIgnoresAdapter(
                    f"the server at {address} does not move its log-probs on the probe with the trainer's: adapters "
                    f"moved by a known amount moved the trainer's by {moved:.4g} a token, the server's move misses "
                    f"that by {miss:.4g} (allowed: {allowed:.4g}, its noise {noise:.3g}); the server {what}. Check "
                    f"that it serves adapters (SGLang: --enable-lora, --max-lora-rank >= lora_rank, "
                    f"--lora-target-modules covering lora_target_modules, the adapter's lora_alpha), or use "
                    f"--lora_sync merged")
            if (lp_back - base).abs().mean().item() > noise:
                raise ServerIgnoresAdapter(
                    f"after the adapter test the server at {address} did not come back to the trainer's weights (its "
                    f"log-probs on the probe are {(lp_back - base).abs().mean().item():.3g} a token from before the "
                    f"test): it {what}")
        if trainer_rank() == 0:
            print(f"LoRA: the servers follow the trainer's adapters (a test move of {moved:.3g} a token on the probe, "
                  f"{moved / noise:.1f} x the servers' noise {noise:.2g}, matched to {max(misses):.2g})", flush=True)
        return {"lora/probe_base_gap": noise, "lora/probe_test_move": moved, "lora/probe_test_miss": max(misses)}

    def _after_test_move(self, park_base: bool, lend_memory: bool, best_effort: bool = False) -> None:
        """After the trainer's forwards: the base to host memory (`park_base`: the test's merged syncs stream it
        from there, as the run's do), then the servers take back every memory tag at once (`lend_memory`; the
        test asks them right after its sync, so their cache must be back; a merged sync's copies go a bucket at
        a time beside it). `best_effort` (an error is on its way): each part tried, its failure only printed."""
        def resume():
            torch.cuda.empty_cache()
            self._on_rank0(lambda: self._bounded(self.client.resume_memory_occupation(),
                                                 "the servers' taking back their memory after the LoRA test's forwards"))
        for needed, part in ((park_base, self.actor.park_base), (lend_memory, resume)):
            if not needed:
                continue
            try:
                part()
            except Exception as e:  # noqa: BLE001 - raised unless another error is already on its way
                if not best_effort:
                    raise
                print(f"warning: LoRA adapter test, cleaning up after an error: {type(e).__name__}: {e}",
                      file=sys.stderr)

    def _test_move(self, served, served_base):
        """The trainer's side of the test: its log-probs on the probe, the servers' noise, and the smallest
        scale of the adapters' test move (lib.lora.moved_adapters) that moves its log-probs by PROBE_TEST_MOVE x
        the noise: (trainer's log-probs, noise, scale or None where even the largest falls short, move, the
        trainer's move per token)."""
        from lib.lora import moved_adapters

        trainer = self.actor.probe_logprobs(self.probe_ids)
        # the noise: on the base model where the servers serve it beside the adapters (a resumed adapter that
        # a server ignores would count as noise in its gap), else on the weights they hold
        trainer_base = self.actor.probe_logprobs(self.probe_ids, adapters=False) if self.adapters_only else trainer
        if any(len(lp) != len(trainer) for lp in served + served_base):
            raise ServerIgnoresAdapter(f"a server answered the LoRA probe ({len(trainer)} tokens) with a different "
                                       f"number of log-probs: it does not serve this model's tokens")
        noise = max((lp - trainer_base).abs().mean().item() for lp in served_base)
        if noise > PROBE_MAX_BASE_GAP:
            raise ServerIgnoresAdapter(
                f"a server's log-probs on the LoRA probe are {noise:.3g} a token from the trainer's (numerical noise "
                f"on SGLang measured 0.05 for SmolLM2, 0.35 for Gemma 3; above {PROBE_MAX_BASE_GAP}): it does not "
                f"serve the trainer's model ({self.actor.model_path})")
        noise = max(noise, PROBE_TOLERANCE.get(self.actor.compute_dtype, 2e-2))
        for scale in PROBE_TEST_SCALES:  # the smallest step whose move is far past the noise
            with moved_adapters(self.actor.model, scale):
                trainer_move = self.actor.probe_logprobs(self.probe_ids) - trainer
            moved = _from_rank0(trainer_move.abs().mean().item())[0]  # every rank stops at the same step
            if moved >= PROBE_TEST_MOVE * noise:
                return trainer, noise, scale, moved, trainer_move
        return trainer, noise, None, moved, trainer_move

    def _on_rank0(self, ask):
        """`ask()` on rank 0 (it talks to the servers), its answer on every rank; if it fails, every rank
        raises (rank 0 its own error, the others its message): none is left waiting in a collective."""
        answer, failure, error = None, None, None
        if trainer_rank() == 0:
            try:
                answer = ask()
            except Exception as e:  # noqa: BLE001 - raised below, on every rank
                error, failure = e, f"{type(e).__name__}: {e}"
        answer, failure = _from_rank0(answer, failure)
        if error is not None:
            raise error
        if failure is not None:
            raise RuntimeError(f"trainer rank 0 failed in the LoRA adapter test: {failure}")
        return answer

    def _ask(self, adapter) -> list[torch.Tensor]:
        """Each server's log-probs on the probe under `adapter` (None: the weights it holds); rank 0."""
        return [torch.tensor(lp) for lp in self.run(self.client.prompt_logprobs(self.probe_ids, adapter),
                                                    timeout_s=self.timeout_s)]

    def _sync_test(self, version) -> list[torch.Tensor]:
        """The servers' answers under the trainer's adapters as they are now (moved), on every rank: adapter
        sync loads them as TEST_ADAPTER and drops them after the question; merged sync sends the full weights."""
        if not self.adapters_only:
            self._sync_full(version, "the LoRA adapter test's merged weight sync", flush_cache=True)
            return self._on_rank0(lambda: self._ask(None))
        path = os.path.join(os.path.abspath(self.disk_dir), "adapter-test")
        self.actor.save_adapter(path, self.actor.compute_dtype)

        def ask():
            try:
                self._bounded(self.client.load_lora_adapter(TEST_ADAPTER, path), "loading the LoRA test adapter")
                return self._ask(TEST_ADAPTER)
            finally:  # best effort: a failed load leaves nothing to unload, and its error is the one to see
                try:
                    self._bounded(self.client.unload_lora_adapter(TEST_ADAPTER), "unloading the LoRA test adapter")
                except Exception as e:  # noqa: BLE001
                    print(f"warning: LoRA: unloading the test adapter {TEST_ADAPTER!r}: {e}", file=sys.stderr)
                shutil.rmtree(path, ignore_errors=True)
        return self._on_rank0(ask)

    def _sync_full(self, version, what: str, flush_cache: bool) -> float:
        if self.method == "tensor":
            return self._bounded(sync_weights_from_tensor(self.actor, self.client, version, self.tp_size, flush_cache,
                                                         self.bucket_mb),
                                 what)
        if self.broadcaster is None:
            return self._bounded(sync_weights_from_disk(self.actor, self.client, self.disk_dir, version, flush_cache),
                                 what)
        named = self.actor.named_full_parameters()  # under FSDP each tensor is gathered: every rank takes part
        if trainer_world_size() > 1:
            named = list(named)  # gather here, on the thread that owns this rank's GPU
        return self._bounded(self.broadcaster.update(named, version, bucket_mb=self.bucket_mb, flattened=True,
                                                     flush_cache=flush_cache), what)

    def _bounded(self, coro, what: str):
        """Run `coro` on the client's loop; past timeout_s, WeightSyncTimeout naming what it waits on."""
        async def bounded():
            task = asyncio.ensure_future(coro)
            done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
            if done:
                return task.result()
            calls = sorted(self.client.calls_in_flight.elements()) if self.client is not None else []
            waits = [*_waiting.values(), *(f"{call} (no answer yet)" for call in calls)]
            task.cancel()
            raise WeightSyncTimeout(
                f"{what} did not finish within {self.timeout_s:g} s (weight_sync_timeout_s); still waiting on: "
                f"{'; '.join(waits) or 'nothing known (the event loop may be blocked)'}. A server call with no "
                f"answer: that server is stuck or dead (see its log); a broadcast or join that does not end: a "
                f"rank of the group is not taking part (a server restarted or left it). If the model is just slow "
                f"to write and load, raise weight_sync_timeout_s.")
        # the loop-side bound fires first; this one only if the loop itself is blocked
        return self.run(bounded(), timeout_s=self.timeout_s + 60)

    def close(self) -> None:
        """Leave the NCCL group (a server that outlives this run can join a new one). Best effort: it
        runs while a run ends, often because something failed, and a server that is already gone
        must not hide that failure behind its own error."""
        if self.broadcaster is None:
            return
        try:
            self.run(self.broadcaster.close(), timeout_s=60)
        except Exception as e:  # noqa: BLE001 - reported, not raised: the run is over either way
            print(f"weight sync: could not close the weight-update group on the servers ({type(e).__name__}: "
                  f"{str(e)[:300]}); a server that outlives this run needs a restart before a new group",
                  file=sys.stderr, flush=True)
