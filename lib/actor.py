"""The `Actor`: the policy's model, optimizer and LR schedule, one process or FSDP2 under torchrun.
It builds the model (master weights, compiled layers, optimizer offload), computes log-probs and
takes the PPO update step, and hands the weights out (HF export, weight sync, checkpoints).

The kernels it runs live in lib/logprobs.py (token log-probs) and lib/grpo.py (the loss).
"""
import contextlib
import copy
import math
import os
import sys
import warnings
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from lib.attention import register_varlen_attention
from lib.checkpoint import fresh_tmp, load_checkpoint, save_checkpoint, swap_in
from lib.grpo import CAP_MODES, LOSS_AGGS, merge_stats, ppo_loss
from lib.logprobs import PolicyForward, compute_logprobs
from lib.lora import (DEFAULT_TARGET_MODULES, add_lora, adapters_disabled, check_lora_settings,
                      merged_named_parameters, save_adapter)
from lib.offload_adamw import HostBuffer, into_host_buffers, offloaded_adamw_step
from lib.padding import sequence_lengths, split_by_token_budget
from lib.ranks import trainer_rank, trainer_world_size


def _lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _is_dropout_name(name: str) -> bool:
    return "dropout" in name or name.endswith("pdrop")  # attention_dropout, hidden_dropout_prob; GPT-2's attn_pdrop


def turn_dropout_off(model: nn.Module) -> list[str]:
    """Sets every dropout probability of `model` to 0: its config's fields (read by some models at
    each forward), its modules' float attributes copied from them at build (Qwen2's attention reads
    `self.attention_dropout`) and its `nn.Dropout` modules. Returns the config fields it changed,
    as `name=old value`.

    Why: the proximal log-probs are computed in eval mode and the update's forward runs in train
    mode (gradient checkpointing needs it); with dropout on, the first mini-batch would start
    off-ratio and the clip would bite on noise. The server samples without dropout, so the trained
    policy is the one without it."""
    changed = []
    configs = [model.config] + [v for v in vars(model.config).values() if hasattr(v, "to_dict")]  # text_config, ...
    for config in configs:
        for name, value in list(vars(config).items()):
            if _is_dropout_name(name) and isinstance(value, (int, float)) and not isinstance(value, bool) and value:
                changed.append(f"{name}={value}")
                setattr(config, name, 0.0)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if _is_dropout_name(name) and isinstance(value, float):
                setattr(module, name, 0.0)
    return changed


class Actor:
    """Model + optimizer + LR schedule of the policy being trained.

    One process: a plain module on `device` (default: cuda if available). Under torchrun
    (`torch.distributed` initialised, world size > 1): FSDP2, each decoder layer and then the root
    sharded over all ranks. The optimizer always steps float32 weights (master weights).
    `dtype="bfloat16"` makes the forward/backward compute in bf16: on one process the model that
    runs holds bf16 parameters and an fp32 copy of them (`master_model`) is what AdamW steps (its
    gradients are the bf16 ones cast up, the new weights are cast down after each step); with
    `master_weights=False` instead the fp32 model runs under autocast, which casts every weight in
    every forward and backward (slower: the casts, and elementwise work in fp32; figures in
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

    `lora_rank` > 0 (lib/lora.py, docs/lora.md): peft's LoRA adapters of that rank (scale
    lora_alpha / rank) on `lora_target_modules`; the base is loaded in the compute dtype and frozen, the
    adapters are float32 and are the master weights (no fp32 copy of the base, no autocast: peft runs
    each adapter in fp32 beside the bf16 base layer). AdamW holds the adapters alone, checkpoints too.
    The KL reference (kl_coef) is the base itself with the adapters switched off: no second model.
    Under FSDP2 the adapters are injected before sharding, so each layer's shard holds its adapters.

    Under FSDP every rank calls every method (they hold collectives), each with its own shard of
    the batch (or all with the same batch: the result is the same either way).

    Dropout is turned off when the model is loaded (`turn_dropout_off`, named in a warning), so the
    proximal log-probs (eval mode) and the update's forward (train mode) see the same policy.
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
                 offload_optimizer: bool = False, loss_norm_tokens: int | None = None, lora_rank: int = 0,
                 lora_alpha: float = 32.0, lora_target_modules=DEFAULT_TARGET_MODULES, lora_dropout: float = 0.0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule must be 'constant' or 'cosine', got {lr_schedule!r}")
        if loss_agg not in LOSS_AGGS:
            raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
        if loss_agg == "seq-mean-token-sum-norm" and not loss_norm_tokens:
            raise ValueError("loss_agg 'seq-mean-token-sum-norm' (Dr. GRPO) divides by a constant: pass "
                             "loss_norm_tokens, e.g. the episode's context budget (the scripts pass max_tokens)")
        self.loss_norm_tokens = loss_norm_tokens
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a finite number above 0, got {temperature}: the trainer's log-probs "
                             f"are of logits / temperature, and a greedy policy (0) has none to train on "
                             f"(evaluations are greedy on their own)")
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        self.compute_dtype = getattr(torch, dtype)
        self.grad_clip, self.temperature, self.max_tokens_per_mb = grad_clip, temperature, max_tokens_per_mb
        self.kl_coef, self.eps_clip_low, self.eps_clip_high = kl_coef, eps_clip_low, eps_clip_high
        if behaviour_cap_mode not in CAP_MODES:
            raise ValueError(f"behaviour_cap_mode must be one of {CAP_MODES}, got {behaviour_cap_mode!r}")
        self.loss_agg, self.behaviour_weight_cap, self.behaviour_cap_mode = loss_agg, behaviour_weight_cap, behaviour_cap_mode
        self.world_size, self.rank = trainer_world_size(), trainer_rank()
        if offload_optimizer and (self.world_size > 1 or dtype != "bfloat16" or not master_weights):
            raise ValueError("offload_optimizer keeps the fp32 master weights and AdamW's moments in CPU memory: it "
                             "needs dtype='bfloat16' with master_weights=True on one process (under torchrun "
                             "the optimizer state is sharded over the ranks instead)")
        self.offload_optimizer = offload_optimizer
        check_lora_settings(lora_rank, lora_alpha, lora_target_modules, lora_dropout)
        self.lora = lora_rank > 0
        if self.lora and offload_optimizer:
            raise ValueError("offload_optimizer is for full fine-tuning: with LoRA the optimizer holds only the "
                             "adapters, which fit beside the model; leave it off")
        self.model_path = model_path
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
        # LoRA: the frozen base runs as loaded, in the compute dtype; the adapters are the fp32 masters.
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=self.compute_dtype if self.lora else torch.float32, **load_kwargs)
        self.model.config.use_cache = False
        dropout_fields = turn_dropout_off(self.model)
        if dropout_fields and self.rank == 0:
            print(f"warning: the model's dropout is turned off for training ({', '.join(dropout_fields)} -> 0): "
                  f"PPO's ratio compares the update's forward with log-probs computed without dropout, and "
                  f"the inference server samples without it; the exported config says 0 too",
                  file=sys.stderr, flush=True)
        if self.lora:
            add_lora(self.model, lora_rank, lora_alpha, lora_target_modules)
        if freeze_embeddings:  # the input embeddings, and the LM head with them when the two are tied
            self.model.get_input_embeddings().weight.requires_grad_(False)
        # bf16 parameters run; an fp32 copy is what the optimizer steps (one process only: under
        # FSDP2 the sharded fp32 parameters are the master weights and the policy casts them).
        self.master_model = self.model
        if master_weights and self.compute_dtype != torch.float32 and self.world_size == 1 and not self.lora:
            self.master_model = copy.deepcopy(self.model).to("cpu" if offload_optimizer else self.device)
            self.master_model.requires_grad_(False)
            for master, param in zip(self.master_model.parameters(), self.model.parameters()):
                master.requires_grad_(param.requires_grad)
            self.model.to(self.compute_dtype)
        if gradient_checkpointing:
            # newer transformers name it activation_checkpointing_enable; SGLang's pinned 5.12 has only the old name.
            if hasattr(self.model, "activation_checkpointing_enable"):
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # transformers 5 makes an empty tokenizer for a weights-only directory: look before loading.
        has_tokenizer = not os.path.isdir(model_path) or any(
            os.path.exists(os.path.join(model_path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
        self.tokenizer = AutoTokenizer.from_pretrained(model_path) if has_tokenizer else None
        if compile_layers is None:  # default: on one GPU, where it raises MFU and lowers memory (docs/benchmarks.md)
            compile_layers = self.device.type == "cuda" and self.world_size == 1
        self.compile_layers = compile_layers  # also fuses the LM head's log-prob kernels (HeadLogprobs)
        if compile_layers:  # fuses each layer's elementwise work (norms, rotary, SiLU); dynamic lengths
            for layer in self.model.get_decoder().layers:
                layer.compile(dynamic=True)
        self.policy = self._wrap(self.model, logits_chunk_tokens)
        self.ref_policy = None
        if ref_model_path is not None and not self.lora:  # LoRA's reference is its own base, adapters off
            # Frozen: no master weights needed, so it is held in the compute dtype.
            ref = AutoModelForCausalLM.from_pretrained(ref_model_path, dtype=self.compute_dtype, **load_kwargs)
            ref.requires_grad_(False)
            self.ref_policy = self._wrap(ref, logits_chunk_tokens).eval()

        # fused: one kernel for the whole step on one GPU (FSDP's sharded parameters keep foreach).
        # Offloaded, this optimizer holds the state (on the CPU) and lib/offload_adamw.py steps it.
        trained = ([p for p in self.master_model.parameters() if p.requires_grad] if self.lora
                   else self.master_model.parameters())
        self.optimizer = torch.optim.AdamW(trained, lr=lr, betas=tuple(betas),
                                           eps=adam_eps, weight_decay=weight_decay,
                                           fused=self.device.type == "cuda" and self.world_size == 1
                                           and not offload_optimizer)
        if offload_optimizer:  # masters and AdamW's state (made up front) in page-locked CPU buffers
            self._host_buffers = into_host_buffers(self.optimizer, page_locked=self.device.type == "cuda")
        # The schedule counts training steps when update() is given `step` (a script's step: skipped
        # updates and steps with several mini-batches or none count once each), else update() calls.
        self._schedule_step: int | None = None
        self._parked: list | None = None  # park_base(): the frozen base's parameters, now in host memory
        self._host_base: list | None = None  # their copies in host memory (views of _base_buffers), made once
        self._base_buffers: list = []
        self.num_nonfinite_grad_steps = 0  # updates skipped for a non-finite gradient norm, in this process
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda n: _lr_factor(n if self._schedule_step is None else self._schedule_step,
                                                 warmup_steps, total_steps, lr_schedule))

    def _wrap(self, causal_lm: nn.Module, logits_chunk_tokens: int) -> PolicyForward:
        # Compiled layers: the first compile guards on the micro-batch's length N (torch 2.11's
        # inductor: N >= 4096 after a first micro-batch of 10k tokens), so a shorter one, e.g. a
        # step's last, would recompile every layer: a step as slow as the first. A last log-prob
        # chunk of one row would recompile the head (size-1 dims are specialised). Packed rows of
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
        enabled = (self.world_size == 1 and self.compute_dtype != torch.float32 and self.master_model is self.model
                   and not self.lora)  # LoRA: the base is in the compute dtype already, the adapters run in fp32
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

    # --- LoRA on one GPU: the frozen base out of the GPU while a server beside it generates ---

    @torch.no_grad()
    def park_base(self) -> None:
        """LoRA, one process: the frozen base's weights go to host memory (page-locked on GPUs), the
        adapters and their optimizer stay. The next call that runs the model (log-probs, update,
        probe) brings them back first; exports and merged syncs merge tensor by tensor from there. For a
        server that shares the GPU and works in between (colocate_sleep): a 32B base is 64 GB that
        its weights and cache get instead. The base never changes, so it is copied out once, at the
        first park; each later park drops the GPU copy and each return copies it in (one copy a step)."""
        if not self.lora or self.world_size > 1:
            raise ValueError("park_base moves LoRA's frozen base to host memory: it needs lora_rank > 0 on one "
                             "process (full fine-tuning trains every weight; under FSDP each rank holds a shard)")
        if self._parked is not None:
            return
        frozen = [p for p in self.model.parameters() if not p.requires_grad]
        if self._host_base is None:  # one flat buffer a dtype, not a pinned block each: pin_memory() rounds
            self._host_base = [None] * len(frozen)  # every block up to a power of two (lib/offload_adamw.py)
            for dtype in dict.fromkeys(p.dtype for p in frozen):
                index = [i for i, p in enumerate(frozen) if p.dtype == dtype]
                buffer = HostBuffer(sum(frozen[i].numel() for i in index), self.device.type == "cuda", dtype)
                self._base_buffers.append(buffer)
                for i, view in zip(index, buffer.views([frozen[i].shape for i in index])):
                    view.copy_(frozen[i].data, non_blocking=True)
                    self._host_base[i] = view
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        for param, host in zip(frozen, self._host_base):
            param.data = host  # the same Parameter objects (ties, peft and compiled layers see them)
        self._parked = frozen
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # back to the driver, for the server

    @torch.no_grad()
    def _unpark_base(self) -> None:
        if self._parked is None:
            return
        for param in self._parked:
            param.data = param.data.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._parked = None

    @property
    def base_parked(self) -> bool:
        return self._parked is not None

    @torch.no_grad()
    def compute_logprobs(self, batch: dict, policy: PolicyForward | None = None) -> torch.Tensor:
        """logprobs [B, T] of `batch["input_ids"]` under the current weights (no grad), micro-batched
        by token budget and packed; returned on the batch's device."""
        self._unpark_base()
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
        i.e. plain PPO), ref_logprobs (default: computed when kl_coef > 0 and a reference model
        is loaded) and row_weights ([B], positive; each row's weight in the per-sequence loss_aggs,
        lib.grpo.ppo_loss). Gradients accumulate over token-budget micro-batches, then clip, AdamW, LR step.

        Returns floats: loss (global), grad_norm, lr (the one this step used), num_micro_batches,
        and the token-weighted `ppo_loss` stats (clip_fraction, approx_kl, entropy, behaviour
        weights, ...; those are local to this rank under FSDP). A non-finite grad norm skips the step
        (`skipped` = 1, `nonfinite_grad_steps` = 1: a count that `merge_stats` adds up) with a warning
        on stderr that names it and the count of updates skipped so far.
        `step` (0-based training step): the learning rate is the schedule's at that step, so the
        schedule ends where the run does, whatever updates were skipped or split into mini-batches.
        """
        self._unpark_base()
        if step is not None:
            self._schedule_step = int(step)
            for group, base_lr, factor in zip(self.optimizer.param_groups, self.scheduler.base_lrs,
                                              self.scheduler.lr_lambdas):
                group["lr"] = base_lr * factor(0)
        batch = dict(batch)
        batch.setdefault("proximal_logprobs", batch["logprobs"])
        if self.kl_coef and self.ref_policy is not None and "ref_logprobs" not in batch:
            batch["ref_logprobs"] = self.compute_logprobs(batch, policy=self.ref_policy)
        elif self.kl_coef and self.lora and "ref_logprobs" not in batch:
            with adapters_disabled(self.model):
                batch["ref_logprobs"] = self.compute_logprobs(batch)
        if batch["advantages"].dim() == 1:
            batch["advantages"] = batch["advantages"][:, None].expand_as(batch["loss_mask"])
        loss_mask = batch["loss_mask"]
        seqs = loss_mask.sum(dim=1) > 0  # the per-sequence losses count rows with loss tokens, each by its weight
        if batch.get("row_weights") is not None:
            weights = batch["row_weights"].double()
            if weights.shape != seqs.shape or not (torch.isfinite(weights) & (weights > 0)).all():
                raise ValueError(f"row_weights must be one finite positive weight per row, got {batch['row_weights']}")
            seqs = weights * seqs
        counts = torch.tensor([float(loss_mask.sum()), float(seqs.sum())], device=self.device)
        if self.world_size > 1:
            dist.all_reduce(counts)
        total_tokens, total_seqs = counts.tolist()
        lr = self.optimizer.param_groups[0]["lr"]
        keys = ("input_ids", "attention_mask", "loss_mask", "logprobs", "proximal_logprobs", "advantages",
                "ref_logprobs", "row_weights")

        self.policy.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, per_mb = 0.0, []
        groups = self._micro_batches(batch["attention_mask"])
        # bf16 parameters with fp32 masters: each micro-batch's bf16 gradients are added into fp32 sums
        # and freed, so the gradient does not depend on the micro-batch split (a bf16 sum's error grows
        # with the number of micro-batches). FSDP2 and the fp32 paths already sum in fp32.
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
                norm_tokens=self.loss_norm_tokens, row_weights=mb.get("row_weights"))
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
        if skipped:  # the norm is global: every rank skips, rank 0 says so
            self.num_nonfinite_grad_steps += 1
        if skipped and self.rank == 0:
            print(f"warning: update skipped: the gradient norm is {grad_norm} (not finite), the weights are "
                  f"unchanged; {self.num_nonfinite_grad_steps} updates skipped so far. Look for non-finite "
                  f"advantages or log-probs in the batch, or weights gone non-finite (a learning rate too high)",
                  file=sys.stderr, flush=True)
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            # torch checks once that optimizer.step() ran first; an offloaded or skipped step does
            # not call it, and the schedule counts scheduler steps only, so the warning is wrong here.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
        return {"loss": loss_sum, "grad_norm": grad_norm, "lr": lr, "num_micro_batches": len(groups),
                "skipped": float(skipped), "nonfinite_grad_steps": float(skipped), **merge_stats(per_mb)}

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
        if self.lora:  # the adapters folded into the base: what a server without adapters serves
            yield from merged_named_parameters(self.model, dtype, device=self.device)  # parked: a tensor at a time
            return
        # With master weights the bf16 parameters are the master's cast: hand them out uncopied.
        source = self.model if next(self.model.parameters()).dtype == dtype else self.master_model
        for name, param in source.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            yield name, full.detach().to(dtype)

    def _full_state_dict(self, dtype: torch.dtype) -> dict:
        if self.lora:  # every rank gathers (collective); rank 0 writes
            merged = {k: v.cpu() for k, v in merged_named_parameters(self.model, dtype, device=self.device)}
            return merged if self.rank == 0 else {}
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
            tmp = fresh_tmp(path)
            config_dtype = self.model.config.dtype
            self.model.config.dtype = dtype
            try:
                self.model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            finally:
                self.model.config.dtype = config_dtype
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp)
            swap_in(tmp, path)
        if self.world_size > 1:
            dist.barrier()

    def save_adapter(self, path: str, dtype: torch.dtype = torch.float32) -> None:
        """LoRA: the adapters as a PEFT directory at `path` (lib.lora.save_adapter), tensors in `dtype`;
        every rank calls it."""
        save_adapter(self.model, path, self.model_path, write=self.rank == 0, dtype=dtype)

    @torch.no_grad()
    def probe_logprobs(self, input_ids: list[int], adapters: bool = True) -> torch.Tensor:
        """logprobs [T - 1] of tokens 1.. of `input_ids` at temperature 1 (what a server reports as its
        prompt log-probs), under the current weights, or with `adapters=False` the LoRA base alone."""
        self._unpark_base()
        ids = torch.tensor([input_ids], device=self.device)
        self.policy.eval()
        with adapters_disabled(self.model) if not adapters else contextlib.nullcontext(), self._autocast():
            lp = compute_logprobs(self.policy, ids, torch.ones_like(ids), 1.0, packed=self.packed)
        return lp[0, 1:].float().cpu()

    def save_checkpoint(self, path: str, extra: dict | None = None) -> None:
        """Model, optimizer and scheduler state to directory `path`, plus `extra` (data position, RNG,
        step, ...: anything torch.save handles); atomic (lib/checkpoint.py). LoRA: the adapters alone
        of the model (the frozen base is the run's starting model, rebuilt on resume)."""
        save_checkpoint(path, self.master_model, self.optimizer, self.scheduler, extra, rank=self.rank,
                        world_size=self.world_size, trainable_only=self.lora)

    def load_checkpoint(self, path: str) -> dict:
        """Restore what `save_checkpoint(path, extra)` wrote; returns `extra`."""
        extra = load_checkpoint(path, self.master_model, self.optimizer, self.scheduler, world_size=self.world_size,
                                trainable_only=self.lora)
        if self.offload_optimizer:  # the loaded state back into the page-locked buffers
            into_host_buffers(self.optimizer, self._host_buffers)
        self._copy_master_to_model()
        return extra
