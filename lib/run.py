"""A training run's plumbing, written once for every script.

The config fields every script shares (`RunConfig`: the run, the servers, the trainer, GRPO, async
mode, weight sync, evaluation and logging), the set-up and tear-down of a run (`open_run` /
`close_run`: ranks, seeds, model, data, servers and their supervision, client, actor, weight sync,
resume, logger and traces, the async producer), and the task-independent phases of one GRPO step in
the order a script's `main()` calls them:

    rollout_step   1. rollout (the script's `rollout_group` per item), 2. advantages, the kept rows
    train_step     3. proximal log-probs, 4. the PPO update, in mini-batches
    sync_weights   5. pause, weight sync, continue; version bump
    log_step       6. metrics row, dev evaluation every eval_every steps, traces
    save_checkpoint 7. checkpoint (every rank its shard)

A script owns its task: the prompt, parsers, tools, reward, one episode, the group rollout, its
evaluation metrics and demonstrations. It hands lib two coroutine functions (`Run.rollout_group`,
`Run.evaluate`), bound to whatever the task opened (a retrieval server, a reward pool), and keeps
the loop in its own `main()`. Under torchrun every rank holds a shard of the model (FSDP2,
lib/actor.py); rank 0 alone runs the servers, the rollouts, evaluation and logging.
"""
import dataclasses
import functools
import gc
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from lib.actor import Actor
from lib.async_rollout import BackgroundLoop, RolloutProducer, gather_groups
from lib.deadlines import rollout_deadline_s
from lib.checkpoint import read_checkpoint_extra
from lib.client import InferenceClient, model_eos_ids
from lib.config import to_dict
from lib.eval_records import record_evaluation
from lib.grpo import (equal_reward_groups, grpo_advantages, logprob_mismatch, merge_stats, minibatch_rows,
                      mismatch_warning)
from lib.learnability import learnability_report
from lib.launch import launch_cpu_server, launch_sglang
from lib.lora import DEFAULT_TARGET_MODULES, check_lora_settings
from lib.metrics import MetricsLogger, continue_jsonl
from lib.model_names import resolve_model_path
from lib.padding import concat_padded_tensors
from lib.ranks import broadcast_from_rank0, init_trainer_ranks, server_seed
from lib.supervise import Supervisor
from lib.tiny_model import default_tiny_model_dir
from lib.traces import episode_record, trainer_logprobs_by_episode, write_traces
from lib.weight_sync import ServerWeightSync

TRAJECTORY_KEYS = ("input_ids", "loss_mask", "logprobs", "versions", "attention_mask")  # a training row's tensors
# LoRA: the servers' log-probs on this text's tokens are checked against the trainer's after the first syncs
LORA_PROBE_TEXT = ("Question: Tom has 3 bags with 4 apples in each. He buys 5 more. How many apples does he have? "
                   "Answer: 3 * 4 = 12, 12 + 5 = 17. #### 17. The capital of the country lies on the river.")


@dataclass
class RunConfig:
    # == run ==
    run_dir: str = "runs/run"  # metrics.jsonl, traces.jsonl, evals/, checkpoints/, final/
    seed: int = 0  # data order, initial sampling and the trainer's RNGs
    max_steps: int = 100  # GRPO steps
    time_budget_s: float = 0.0  # stop training after this many seconds (then test); 0 = no limit
    mode: str = "sync"  # "sync": rollout, then update; "async": rollouts keep running during the update
    resume: bool = False  # continue from the latest checkpoint in run_dir
    checkpoint_every: int = 10  # steps; 0 = never
    save_final: bool = True  # write run_dir/final (the whole model as an HF folder; LoRA: merged) after the last step
    # == model and inference servers ==
    model_path: str = ""  # a known name (smollm2-135m-instruct), HF dir or hub id; "" = the embedded tiny model
    server: str = "cpu"  # "cpu" (lib/cpu_server), "sglang", or "external" (server_addrs)
    server_addrs: list = field(default_factory=list)  # external servers, ["http://host:port", ...]
    server_device: str = "cpu"  # device of the CPU-capable server ("cuda" works too)
    server_threads: int = 1  # torch threads of the CPU server (the trainer keeps the rest)
    base_gpu_id: int = 1  # first GPU of the SGLang servers (the trainer uses GPU 0)
    tp_size: int = 1  # SGLang tensor parallelism
    dp_size: int = 1  # SGLang data parallelism inside one server (its own router)
    num_servers: int = 1  # SGLang servers, each on its own tp_size x dp_size GPUs; the client spreads trajectories
    mem_fraction_static: float | None = None  # SGLang's share of GPU memory (weights + KV cache); None = its default
    # passed to every SGLang server as they are
    sglang_extra_args: str = "--attention-backend triton --sampling-backend pytorch --grammar-backend none"
    max_concurrent_requests: int = 256  # the client's in-flight requests per server
    seeded_sampling: bool = False  # each request's sampling seed from (seed, trajectory, position): runs repeat
    # == episode ==
    max_turns: int = 6  # model turns per episode
    max_tokens: int = 512  # context budget of one episode: prompt + all turns + what the task appends
    max_new_tokens_per_turn: int = 64  # tokens per generation request; a turn cut by it goes on while the budget lasts
    stop_token_ids: list = field(default_factory=list)  # ids that end a turn; [] = the model's EOS set (tokenizer + generation_config)
    temperature: float = 1.0  # training samples' temperature (evaluations are greedy)
    apply_chat_template: bool = True  # wrap the prompt in the tokenizer's chat template
    # One episode's deadline, from its start (which includes waiting for the server behind every other
    # episode started with it): past it the episode is cancelled and its group fails, counted in
    # rollout/failed_groups, instead of hanging the run; 0 = none. The longest wait of the embedded default
    # is the test evaluation's, 500 episodes at once: 137 s on 2 busy CPU cores with every episode at its
    # 256-token budget (the untrained model). Raise it for big evaluations on a slow server.
    episode_timeout_s: float = 600.0
    # == GRPO ==
    batch_size: int = 8  # questions per step
    group_size: int = 4  # episodes per question
    lr: float = 1e-6  # AdamW learning rate of the trainer
    lr_schedule: str = "constant"  # "constant" or "cosine" (after warmup_steps of linear warm-up)
    warmup_steps: int = 0  # steps of linear warm-up of the learning rate
    weight_decay: float = 0.0  # AdamW's
    adam_betas: tuple = (0.9, 0.999)  # AdamW's
    adam_eps: float = 1e-8  # larger = tiny, noisy per-parameter gradients take smaller steps
    grad_clip: float = 1.0  # max gradient norm per optimizer step
    freeze_embeddings: bool = False  # keep the input and output embeddings as they are
    kl_coef: float = 0.0  # k3 KL to the starting model (a frozen copy on the trainer); 0 = none
    eps_clip_low: float = 0.2  # PPO clip below: ratio >= 1 - eps_clip_low
    eps_clip_high: float = 0.28  # PPO clip above (DAPO's clip-higher): ratio <= 1 + eps_clip_high
    scale_adv_by_std: bool = True  # divide by the group's reward std; Dr. GRPO: False, with loss_agg seq-mean-token-sum-norm
    drop_equal_groups: bool = False  # dynamic sampling (DAPO): drop groups whose rewards are all equal, refill the batch
    refill_rounds: int = 2  # dynamic sampling: at most this many more rollouts per step to refill the batch
    neg_adv_scale: float = 1.0  # weight of below-average episodes; 0 = learn from the better ones only
    ppo_minibatches: int = 1  # optimizer steps per batch, each on a random 1/N of the rows (PPO clipping then acts)
    loss_agg: str = "token-mean"  # DAPO's; "seq-mean-token-mean" (GRPO), "seq-mean-token-sum-norm" (Dr. GRPO)
    behav_imp_weight_cap: float = 2.0  # cap of the server->trainer importance weight per token; 0 = no cap
    behav_imp_weight_mode: str = "truncate"  # above the cap: "truncate" to it (TIS) or "mask" the token out (AReaL)
    # == trainer ==
    trainer_dtype: str = "float32"  # "bfloat16" on GPUs
    trainer_threads: int = 0  # torch threads of the trainer; 0 = torch's default
    max_tokens_per_mb: int = 16384  # micro-batch token budget of the trainer
    pack_sequences: bool | None = None  # padding-free rows (varlen attention); None: on GPUs only (padded rows are faster on CPU)
    attn_implementation: str | None = None  # trainer attention: None = lib's varlen when packed, else sdpa
    trainer_gradient_checkpointing: bool = False  # recompute activations in backward: ~half the memory, ~20% slower
    trainer_compile: bool | None = None  # torch.compile the decoder layers; None = on with one GPU
    trainer_offload_optimizer: bool = False  # bf16, one GPU: fp32 master + AdamW state in CPU memory between updates
    # == LoRA (docs/lora.md) ==
    lora_rank: int = 0  # 0 = full fine-tuning; > 0: LoRA adapters of this rank on the frozen base (raise lr ~10x)
    lora_alpha: float = 32.0  # adapter scale alpha / rank (LoRA Without Regret's 32: the best lr hardly moves with rank)
    lora_target_modules: list = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))  # linear modules adapted
    lora_dropout: float = 0.0  # must be 0: proximal and update log-probs of one step must agree
    lora_sync: str = "adapter"  # "adapter": the adapters alone, loaded by name; "merged": full weights (servers without LoRA)
    # == weight sync ==
    weight_sync: str = "disk"  # "disk" (safetensors), "nccl" (broadcast; gloo on CPUs) or "tensor" (colocated, same GPU)
    weight_sync_bucket_mb: float = 512  # nccl: tensors per update call, one flattened broadcast each
    weight_sync_master_address: str = "127.0.0.1"  # nccl: the trainer's address as the servers reach it
    weight_sync_timeout_s: float = 600.0  # a sync (or the group's set-up) past this stops the run, naming what it waited on
    colocate_sleep: bool = False  # sync mode, SGLang on the trainer's GPU: the server lends its memory during the update
    # LoRA with colocate_sleep: the frozen base waits in host memory while the server generates (a 32B base on one GPU)
    trainer_offload_base: bool = False
    # == async mode ==
    # a group starts only if a step within max_staleness versions will train it (nothing generated
    # is dropped as stale), and the trainer takes the oldest groups first (lib/async_rollout.py)
    max_staleness: int = 1  # every token is trained at most this many versions after its weights'
    async_capacity: int = 0  # groups started and not yet trained on; 0 = (max_staleness + 1) x batch_size
    # how the weight sync pauses the server: "in_place" holds in-flight requests (their KV stays) and
    # they go on under the new weights, "abort" cuts them (the client re-sends prompt + output) and
    # flushes the prefix cache (docs/client.md)
    pause_mode: str = "in_place"
    # each request names its policy version as SGLang's prefix-cache namespace (`extra_key`), so no
    # prefix cached under other weights is reused; False: old prefixes are reused (servers without extra_key)
    prefix_cache_per_version: bool = True
    # == warm start (SFT on the task's demonstrations before GRPO; any model) ==
    warm_start_steps: int | None = None  # 0 = no warm start; None = the script's default for the embedded tiny model, 0 for a pretrained one
    warm_start_lr: float | None = None  # None = 2e-3 for the embedded tiny model, 5e-5 for a pretrained one
    warm_start_batch_size: int = 16  # demonstrations per SFT step
    # == evaluation and logging ==
    eval_every: int = 10  # steps; 0 = only at the end
    eval_size: int = 200  # dev questions per evaluation
    test_size: int = 500  # test questions at the end
    test_at_start: bool = False  # also the test split before the first step (a learning curve's starting point)
    # before the first step, group_size samples of each dev question at the training temperature: pass@k,
    # the share of groups whose rewards differ (GRPO's signal) and a verdict (lib/learnability.py)
    learnability_probe: bool = False
    trace_every: int = 1  # write trajectories (traces.jsonl, token by token) every N steps; 0 = never
    trace_groups: int = 1  # groups traced per traced step (group_size episodes each)
    trace_backend: str = "jsonl"  # "jsonl", or "mlflow": metrics and traces also go to MLflow (run_dir/mlflow.db)
    tensorboard: bool = True  # also write run_dir/tb (when tensorboard is installed)
    wandb_project: str | None = None  # also log to this W&B project (when wandb is installed)


CHOICES = {"trace_backend": ("jsonl", "mlflow"), "mode": ("sync", "async"), "pause_mode": ("in_place", "abort", "retract"),
           "weight_sync": ("disk", "nccl", "tensor"), "server": ("cpu", "sglang", "external"),
           "behav_imp_weight_mode": ("truncate", "mask"), "lr_schedule": ("constant", "cosine"),
           "lora_sync": ("adapter", "merged")}


# Fields that act only in some settings: (field, when it acts, what to do instead). Set to anything but
# its default where it does not act, a field is named in a warning rather than ignored in silence.
ONLY_WHEN = [
    ("max_staleness", lambda c: c.mode == "async", "it bounds async mode: add --mode async"),
    ("async_capacity", lambda c: c.mode == "async", "it sizes async mode's producer: add --mode async"),
    ("pause_mode", lambda c: c.mode == "async", "sync mode has nothing in flight at a weight sync"),
    ("server_addrs", lambda c: c.server == "external", "they are used with --server external"),
    ("server_device", lambda c: c.server == "cpu", "it is the CPU server's"),
    ("server_threads", lambda c: c.server == "cpu", "it is the CPU server's"),
    ("base_gpu_id", lambda c: c.server == "sglang", "it places the SGLang servers"),
    ("tp_size", lambda c: c.server in ("sglang", "external"), "it is SGLang's tensor parallelism"),
    ("dp_size", lambda c: c.server == "sglang", "it is SGLang's data parallelism"),
    ("num_servers", lambda c: c.server == "sglang", "it counts the SGLang servers launched"),
    ("mem_fraction_static", lambda c: c.server == "sglang", "it is SGLang's"),
    ("sglang_extra_args", lambda c: c.server == "sglang", "they go to SGLang"),
    ("colocate_sleep", lambda c: c.server == "sglang", "only SGLang lends its memory"),
    ("weight_sync_bucket_mb", lambda c: c.weight_sync in ("nccl", "tensor"), "it sizes nccl/tensor syncs"),
    ("weight_sync_master_address", lambda c: c.weight_sync == "nccl", "it is for --weight_sync nccl"),
    ("refill_rounds", lambda c: c.drop_equal_groups, "it bounds dynamic sampling: add --drop_equal_groups True"),
    ("lora_alpha", lambda c: c.lora_rank > 0, "it scales LoRA adapters: add --lora_rank"),
    ("lora_target_modules", lambda c: c.lora_rank > 0, "it places LoRA adapters: add --lora_rank"),
    ("lora_sync", lambda c: c.lora_rank > 0, "it says how LoRA adapters reach the servers: add --lora_rank"),
]


def inert_fields(cfg: RunConfig) -> list[str]:
    """One line per field set away from its default where it has no effect."""
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(RunConfig)}
    return [f"{name}={getattr(cfg, name)!r} has no effect here: {why}"
            for name, acts, why in ONLY_WHEN if getattr(cfg, name) != defaults[name] and not acts(cfg)]


def check_config(cfg: RunConfig):
    for line in inert_fields(cfg):
        print(f"config warning: {line}", file=sys.stderr)
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {getattr(cfg, name)!r}")
    if not (math.isfinite(cfg.temperature) and cfg.temperature > 0):  # before any server starts (the Actor checks too)
        raise ValueError(f"temperature must be a finite number above 0, got {cfg.temperature}: training episodes are "
                         f"sampled at it and the trainer's log-probs are of logits / temperature (evaluations are "
                         f"greedy on their own)")
    if cfg.server == "external" and not cfg.server_addrs:
        raise ValueError("server 'external' needs server_addrs: --server_addrs '[\"http://host:port\"]'")
    if cfg.colocate_sleep and cfg.mode != "sync":
        raise ValueError("colocate_sleep needs mode sync: in async mode the server generates while the trainer works")
    if cfg.trainer_offload_base and not (cfg.lora_rank > 0 and cfg.colocate_sleep):
        raise ValueError("trainer_offload_base parks LoRA's frozen base in host memory while a server on the trainer's "
                         "GPU generates: it needs --lora_rank > 0 and --colocate_sleep True (without sleep mode the "
                         "server's memory is fixed at start-up and gains nothing from it)")
    if cfg.weight_sync == "nccl" and cfg.dp_size > 1:
        raise ValueError("weight_sync nccl sends to each server's TP ranks: use num_servers instead of dp_size")
    check_lora_settings(cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules, cfg.lora_dropout)


@dataclass
class Run:
    """What the loop touches: built by open_run(), closed by close_run(). Rank 0 alone holds the
    servers, the client, the rollouts, the logger and the trace file (None on the other ranks);
    every rank holds its shard of the actor."""
    cfg: RunConfig
    rank: int = 0
    world_size: int = 1
    cpu_group: object = None  # gloo group for Python objects under torchrun
    model_path: str = ""  # the model the run starts from (after its warm start)
    tokenizer: object = None
    train_items: list = None
    dev_items: list = None
    test_items: list = None
    supervisors: list = field(default_factory=list)  # of the servers launched here
    bg: BackgroundLoop = None  # the event loop of every client call and episode
    client: InferenceClient = None
    reward_pool: object = None  # the task's RewardPool, where it has one (its counts are logged)
    actor: Actor = None
    weight_sync: ServerWeightSync = None
    producer: RolloutProducer = None  # async mode
    logger: MetricsLogger = None
    trace_file: object = None
    ckpt_dir: str = ""
    resumed: bool = False
    lora_test: dict = field(default_factory=dict)  # LoRA: the start-up test of the servers' adapters
    step: int = 0
    version: int = 0  # policy version: weight syncs so far
    data_position: int = 0  # index of the first train item not yet consumed
    data_consumed_ahead: list = field(default_factory=list)  # items after it consumed already (async mode)
    reward_counts: tuple = (0, 0)  # the reward pool's (timeouts, failures) when this step's rollout began
    # The task's, set by the script (rank 0): coroutine functions over the task's resources.
    rollout_group: Callable = None  # (item, temperature, group_size) -> list of episodes
    evaluate: Callable = None  # (items) -> (episodes, metrics)
    closers: list = field(default_factory=list)  # the script's own resources: callables, closed first, last first
    task: dict = field(default_factory=dict)  # what else the task keeps for the run (a tool server's address, ...)
    started_s: float = field(default_factory=time.time)  # when open_run began: start-up lines say how long since

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def say(self, what: str, since_s: float | None = None):
        """A start-up line (rank 0): what is happening or done, and the time since the run began, so a
        first run's wait (data, model, warm start, servers) names each of its phases."""
        if self.is_main:
            took = f" in {time.time() - since_s:.1f} s" if since_s is not None else ""
            print(f"[start-up {time.time() - self.started_s:6.1f} s] {what}{took}", flush=True)


# --- set-up and tear-down ---
def open_run(cfg: RunConfig, build_model: Callable[[str, bool], str], load_splits: Callable[[], dict],
             tokenizer_texts: Callable[[], list[str]] | None = None) -> Run:
    """Ranks, seeds, the model (`build_model(base, embedded)`: the base after the script's warm start),
    data (`load_splits()`: {"train", "dev", "test"} item lists), servers, client, actor, weight sync,
    the resumed checkpoint, the logger and trace file. If any of it fails, what was opened is closed.
    `tokenizer_texts()`: a fork's own texts, learned by the embedded tiny model's tokenizer beside the
    bundled data (lib.tiny_model.default_tiny_model_dir); unused with a model by name or path."""
    check_config(cfg)
    world_size, rank, cpu_group = init_trainer_ranks()
    if cfg.trainer_offload_base and world_size > 1:  # before any server starts (the actor would refuse it later)
        raise ValueError("trainer_offload_base is for one trainer process: under torchrun each rank holds a shard of "
                         "the base already")
    run = Run(cfg, rank=rank, world_size=world_size, cpu_group=cpu_group)
    try:
        _open(run, build_model, load_splits, tokenizer_texts)
    except BaseException:
        close_run(run)
        raise
    return run


def _open(run: Run, build_model, load_splits, tokenizer_texts):
    cfg, is_main = run.cfg, run.is_main
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.run_dir, exist_ok=True)
    from transformers import AutoTokenizer

    if not is_main:
        dist.barrier()  # rank 0 builds the cache first; the others then find it there
    # a known name is built once and cached; then the warm start (cached too), if the run has one
    t0 = time.time()
    run.say(f"model: {cfg.model_path or 'the embedded tiny model (its data, tokenizer and weights are built once, cached)'}")
    base = resolve_model_path(cfg.model_path) or default_tiny_model_dir(
        extra_texts=tokenizer_texts() if tokenizer_texts else None)
    run.say(f"model ready: {base}", t0)
    t0 = time.time()
    # rank 0 builds the warm start (a script's checks may decide which build it ends at: train_search.py's);
    # the other ranks take its path below, or build their own where they cannot read it (another node's cache)
    run.model_path = build_model(base, not cfg.model_path) if is_main else None
    if is_main and run.model_path != base:
        run.say(f"warm start ready: {run.model_path}", t0)
    # Only now: the warm start runs before any server shares the machine, on every core (on 2 cores
    # with trainer_threads 1 it took 1.7x as long)
    if cfg.trainer_threads:
        torch.set_num_threads(cfg.trainer_threads)
    if is_main and run.world_size > 1:
        dist.barrier()
    run.model_path = broadcast_from_rank0(run.model_path, run.cpu_group)
    if not os.path.isdir(run.model_path):  # a rank on a node whose cache rank 0's path is not in
        run.model_path = build_model(base, not cfg.model_path)
    run.tokenizer = AutoTokenizer.from_pretrained(run.model_path)
    if not cfg.stop_token_ids:  # a turn ends on any of the model's EOS ids (Qwen2.5: <|im_end|> and <|endoftext|>)
        cfg = run.cfg = dataclasses.replace(cfg, stop_token_ids=model_eos_ids(run.model_path, run.tokenizer))
    splits = load_splits()
    run.train_items, run.dev_items, run.test_items = (splits["train"], splits["dev"][: cfg.eval_size],
                                                      splits["test"][: cfg.test_size])

    # Servers (rank 0): started here and killed with this process, or given by the user. A resumed run
    # seeds the server's sampling by its step, so it does not replay the start of the run. A launched
    # server is supervised (lib/supervise.py): if it dies, the run stops with its log.
    run.ckpt_dir = os.path.join(cfg.run_dir, "checkpoints")
    resume_extra = read_checkpoint_extra(os.path.join(run.ckpt_dir, "latest")) if cfg.resume else None
    if resume_extra is not None:  # LoRA's shape and scale must be the checkpoint's (older ones saved the rank only)
        ours = lora_settings(cfg)
        saved = {"lora_rank": resume_extra.get("lora_rank", 0)}
        if cfg.lora_rank and saved["lora_rank"]:
            saved.update({k: resume_extra[k] for k in ("lora_alpha", "lora_target_modules") if k in resume_extra})
        for key, value in saved.items():
            if value != ours[key]:
                raise ValueError(f"the checkpoint in {run.ckpt_dir} was trained with {key} {value!r}, this run has "
                                 f"{key} {ours[key]!r}: resume with --{key} {value!r}, or start a new run_dir")
    sampling_seed = server_seed(cfg.seed, resume_extra["step"] if resume_extra else 0)
    addrs = []
    t0 = time.time()
    if is_main and cfg.server != "external":
        run.say(f"inference server: starting {'SGLang' if cfg.server == 'sglang' else 'the CPU server'}")
    if is_main and cfg.server == "external":
        addrs = list(cfg.server_addrs)
    elif is_main and cfg.server == "sglang":
        for i in range(cfg.num_servers):
            server = launch_sglang(run.model_path, base_gpu_id=cfg.base_gpu_id + i * cfg.tp_size * cfg.dp_size,
                                   tp_size=cfg.tp_size, dp_size=cfg.dp_size,
                                   mem_fraction_static=cfg.mem_fraction_static, random_seed=sampling_seed,
                                   extra_args=cfg.sglang_extra_args.split()
                                   + (["--enable-memory-saver"] if cfg.colocate_sleep else [])
                                   + (["--enable-lora", "--max-lora-rank", str(cfg.lora_rank), "--lora-target-modules",
                                       *cfg.lora_target_modules] if cfg.lora_rank and cfg.lora_sync == "adapter" else [])
                                   # a server that lends its memory drops its weights; with adapter-only syncs
                                   # nothing sends the base back, so SGLang keeps a copy in CPU memory
                                   + (["--enable-weights-cpu-backup"] if cfg.colocate_sleep and cfg.lora_rank
                                      and cfg.lora_sync == "adapter" else []),
                                   log_path=os.path.join(cfg.run_dir, "sglang.log" if i == 0 else f"sglang{i}.log"))
            run.supervisors.append(Supervisor("inference server", server))
            addrs.append(server.address)
    elif is_main:
        server = launch_cpu_server(run.model_path, device=cfg.server_device, num_threads=cfg.server_threads,
                                   random_seed=sampling_seed, log_path=os.path.join(cfg.run_dir, "cpu_server.log"))
        run.supervisors.append(Supervisor("inference server", server))
        addrs = [server.address]
    if is_main and cfg.server != "external":
        run.say(f"inference server ready at {', '.join(addrs)}", t0)

    # Every client call runs on one event loop in a background thread, so in async mode the
    # trainer (this thread) can update while episodes run.
    run.bg = BackgroundLoop()
    if is_main:
        run.client = InferenceClient(addrs, max_concurrent_requests=cfg.max_concurrent_requests,
                                     version_cache_key=cfg.prefix_cache_per_version,
                                     sampling_seed=cfg.seed if cfg.seeded_sampling else None)
    run.actor = Actor(run.model_path, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=tuple(cfg.adam_betas),
                      adam_eps=cfg.adam_eps, warmup_steps=cfg.warmup_steps, total_steps=cfg.max_steps,
                      lr_schedule=cfg.lr_schedule, grad_clip=cfg.grad_clip,
                      temperature=cfg.temperature, max_tokens_per_mb=cfg.max_tokens_per_mb, dtype=cfg.trainer_dtype,
                      kl_coef=cfg.kl_coef, ref_model_path=run.model_path if cfg.kl_coef > 0 else None,
                      eps_clip_low=cfg.eps_clip_low, eps_clip_high=cfg.eps_clip_high, loss_agg=cfg.loss_agg,
                      loss_norm_tokens=cfg.max_tokens, freeze_embeddings=cfg.freeze_embeddings,
                      packed=cfg.pack_sequences, attn_implementation=cfg.attn_implementation,
                      gradient_checkpointing=cfg.trainer_gradient_checkpointing, compile_layers=cfg.trainer_compile,
                      offload_optimizer=cfg.trainer_offload_optimizer,
                      behaviour_weight_cap=cfg.behav_imp_weight_cap or None,
                      behaviour_cap_mode=cfg.behav_imp_weight_mode, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                      lora_target_modules=cfg.lora_target_modules, lora_dropout=cfg.lora_dropout)

    # Weight sync (lib/weight_sync.py): "disk" = safetensors + /update_weights_from_disk; "nccl" = the
    # trainer and every server's TP workers join one process group once, then each step broadcasts the
    # new weights (NCCL on GPUs, gloo on CPUs); "tensor" = colocated, the server reads the trainer's GPU memory.
    # LoRA (lora_sync "adapter"): the adapters alone, loaded by name; "merged": the full weights, by weight_sync.
    run.weight_sync = ServerWeightSync(cfg.weight_sync, run.actor, run.client, run.bg.run, num_servers=len(addrs),
                                       tp_size=cfg.tp_size, disk_dir=os.path.join(cfg.run_dir, "weights"),
                                       bucket_mb=cfg.weight_sync_bucket_mb,
                                       master_address=cfg.weight_sync_master_address,
                                       timeout_s=cfg.weight_sync_timeout_s, lora_sync=cfg.lora_sync,
                                       probe_ids=run.tokenizer(LORA_PROBE_TEXT)["input_ids"][:64])

    if cfg.resume and resume_extra is None:
        print(f"--resume True: no checkpoint in {run.ckpt_dir}; starting from step 0")
    if resume_extra is not None:
        extra = run.actor.load_checkpoint(os.path.join(run.ckpt_dir, "latest"))
        run.step, run.version = extra["step"], extra["version"]
        run.data_position = extra.get("data_position", run.step * cfg.batch_size)
        run.data_consumed_ahead = list(extra.get("data_consumed_ahead", []))
        random.setstate(extra["python_rng"])
        if "numpy_rng" in extra:  # checkpoints written before it was saved lack it
            np.random.set_state(extra["numpy_rng"])
        torch.set_rng_state(extra["torch_rng"])
        # The server still holds the initial weights: give it the resumed policy (a merged sync streams the
        # parked base from host memory: beside an awake SGLang a 32B base leaves no room for merged copies)
        if cfg.trainer_offload_base:
            run.actor.park_base()
        run.weight_sync.sync(run.version)
        run.resumed = True
        if is_main:
            print(f"resumed from step {run.step} (policy version {run.version}, data position "
                  f"{run.data_position}); server sampling seed {sampling_seed}")
    # LoRA: a test before the first rollout: adapters moved by a known amount and synced must move the servers'
    # log-probs on a probe text as they move the trainer's (a server that ignores them stops the run here)
    run.lora_test = run.weight_sync.verify_adapters(run.version, park_base=cfg.trainer_offload_base,
                                                     lend_memory=cfg.colocate_sleep)
    if cfg.trainer_offload_base:  # the server generates next (evaluations, the first rollout): the base waits on the host
        run.actor.park_base()
    if is_main:
        run.client.set_version(run.version)
        # One run per file: a fresh start moves an earlier run's rows aside, a resume drops the rows of
        # steps after its checkpoint (they are about to be run again).
        resume_step = run.step if run.resumed else None
        run.logger = MetricsLogger(cfg.run_dir, to_dict(cfg), tensorboard=cfg.tensorboard,
                                   wandb_project=cfg.wandb_project, resume_step=resume_step,
                                   mlflow=cfg.trace_backend == "mlflow")
        run.trace_file = open(continue_jsonl(os.path.join(cfg.run_dir, "traces.jsonl"), resume_step), "a")


def close_run(run: Run):
    """Everything open_run() and the script opened, in reverse order; also after an error, when some
    of it may be missing."""
    try:
        if run.producer is not None:
            run.producer.stop()
        for close in reversed(run.closers):
            close()
        for opened in (run.trace_file, run.logger, run.reward_pool):
            if opened is not None:
                opened.close()
        if run.weight_sync is not None:
            run.weight_sync.close()
        if run.client is not None:
            run.bg.run(run.client.close(), timeout_s=30)
    finally:
        if run.bg is not None:
            run.bg.close()
        for s in run.supervisors:
            s.stop()
        if run.world_size > 1:
            dist.destroy_process_group()


def start_training(run: Run):
    """Before the first step (rank 0, not on resume): the dev evaluation, the test before training
    (`test_at_start`) and the learnability probe; then async mode's producer starts generating.
    What is built by now (model, tokenizer, libraries) lives as long as the run; frozen, it is left
    out of garbage collections, whose full passes would otherwise scan all of it on the event loop in
    the middle of a rollout (0.1-0.3 s each)."""
    cfg = run.cfg
    gc.freeze()
    run.say("set up: the GRPO loop starts" + (" (after the step-0 evaluation)" if run.step == 0 and cfg.eval_every else ""))
    if run.is_main and run.step == 0 and cfg.eval_every:
        print(f"step 0 dev: {run_evaluation(run, 'eval', run.dev_items)}")
    if run.is_main and run.step == 0 and cfg.test_at_start:
        print(f"test before training: {run_evaluation(run, 'test', run.test_items)}")
    if run.is_main and run.step == 0 and cfg.learnability_probe:  # does the model leave GRPO anything to learn?
        groups, _ = run_rollout(run, rollout_groups(run, run.dev_items), "the learnability probe")
        run.logger.log(run.step, learnability_report(groups))
    if run.is_main and cfg.mode == "async":
        run.producer = RolloutProducer(
            run.bg, lambda item: run.rollout_group(item, cfg.temperature, cfg.group_size), lambda i: item_at(run, i),
            capacity=cfg.async_capacity or (cfg.max_staleness + 1) * cfg.batch_size, max_staleness=cfg.max_staleness,
            batch_groups=cfg.batch_size, start_index=run.data_position, consumed_ahead=run.data_consumed_ahead,
            version=run.version)
        run.producer.start()


def finish_training(run: Run) -> dict | None:
    """After the last step: the final weights (`run_dir/final`, an HF folder), then the test
    evaluation (rank 0, the server to itself). Saved first: under torchrun the save is collective,
    and ranks waiting in it through a long evaluation would pass NCCL's watchdog and lose final/."""
    if run.producer is not None:  # the test evaluation alone uses the server
        run.producer.stop()
        run.producer = None
    if run.cfg.save_final:
        run.actor.save_hf(os.path.join(run.cfg.run_dir, "final"))
    test_metrics = None
    if run.is_main:
        test_metrics = run_evaluation(run, "test", run.test_items)
        print(f"test after {run.step} steps: {test_metrics}")
    return test_metrics


# --- data order and rollouts ---
@functools.lru_cache(maxsize=2)
def epoch_order(seed: int, num_items: int) -> np.ndarray:
    return np.random.RandomState(seed).permutation(num_items)


def item_at(run: Run, index: int) -> dict:
    # The data order is a function of (seed, index), so a resumed run sees the same questions.
    epoch, offset = divmod(index, len(run.train_items))
    return {**run.train_items[epoch_order(run.cfg.seed + epoch, len(run.train_items))[offset]], "index": index}


async def rollout_groups(run: Run, items: list[dict]) -> tuple[list, int]:
    """(groups, how many failed): a group of group_size episodes per item, all at once."""
    return await gather_groups([run.rollout_group(item, run.cfg.temperature, run.cfg.group_size) for item in items])


def run_rollout(run: Run, rollout, what: str):
    # A rollout starts all its episodes at once, so it ends by their deadline; if not, the event
    # loop is stuck: the run stops, naming the episodes still running and where each is.
    return run.bg.run(rollout, timeout_s=rollout_deadline_s(run.cfg.episode_timeout_s), what=what)


def take_groups(run: Run, num_groups: int, what: str) -> tuple[list, int]:
    """(groups, how many failed), in item order: sync mode rolls out the next items now; async mode
    takes the oldest groups the producer has been generating. Either way a failed group is dropped
    and counted, not replaced, and if all of them failed the first error is raised."""
    try:
        if run.producer is not None:
            failed_before = run.producer.num_failed
            groups = run.producer.get_groups(num_groups, timeout_s=rollout_deadline_s(run.cfg.episode_timeout_s))
            run.data_position, run.data_consumed_ahead = run.producer.data_ledger()
            return groups, run.producer.num_failed - failed_before
        indices = next_indices(run.data_position, run.data_consumed_ahead, num_groups)
        groups, failed = run_rollout(run, rollout_groups(run, [item_at(run, i) for i in indices]), what)
    except RuntimeError:
        for s in run.supervisors:
            s.check()  # a dead server is the clearer cause
        raise
    run.data_position = indices[-1] + 1
    run.data_consumed_ahead = [i for i in run.data_consumed_ahead if i > indices[-1]]
    return groups, failed


def next_indices(position: int, consumed_ahead: list, count: int) -> list[int]:
    """The next `count` item indices from `position` that were not consumed already (an async run's
    checkpoint may name some ahead of its position; sync mode resumed from it skips them too)."""
    skip, out = set(consumed_ahead), []
    while len(out) < count:
        if position not in skip:
            out.append(position)
        position += 1
    return out


def rewards_all_equal(group: list[dict]) -> bool:
    """No learning signal in this group: GRPO gives every episode advantage 0."""
    return bool(equal_reward_groups(torch.cat([e["rewards"] for e in group]), len(group)).all())


def episode_rows(episodes: list[dict]) -> list[tuple[int, dict]]:
    """(episode index, trajectory) per training row, in batch order: the episode itself, or each
    segment an agent's session recorded (`segments`; none if it sampled nothing)."""
    return [(i, row) for i, e in enumerate(episodes) for row in e.get("segments", [e])]


# --- one GRPO step ---
def advantages_and_keep(cfg: RunConfig, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GRPO advantages [B] (below-average ones weighted by neg_adv_scale), whether each row's group
    has all-equal rewards [B], and the rows to train [B] (dynamic sampling drops those groups)."""
    adv = grpo_advantages(rewards, cfg.group_size, scale_by_std=cfg.scale_adv_by_std)
    equal = equal_reward_groups(rewards, cfg.group_size)
    keep = ~equal if cfg.drop_equal_groups else torch.ones_like(equal)
    return torch.where(adv < 0, adv * cfg.neg_adv_scale, adv), equal, keep


def rollout_step(run: Run, episode_metrics: Callable[[list], dict],
                 leave_out: Callable[[list], torch.Tensor] | None = None) -> tuple[dict, list[dict], dict]:
    """1. rollout and 2. advantages, on rank 0; then every rank gets the rows to train. Returns
    (batch: the kept rows, on every rank, {} when there are fewer than ranks: nothing to train;
    episodes: rank 0's, each with its `advantages [1]` and `keep [1]`; the rollout's metrics, with
    the task's `episode_metrics(episodes)` under rollout/). `leave_out(episodes)`, where the task has
    one, marks episodes [B] to keep out of the loss after their rewards counted in the advantages."""
    cfg, batch, episodes, metrics = run.cfg, None, [], {}
    if run.is_main:
        for s in run.supervisors:
            s.check()
        if run.reward_pool is not None:
            run.reward_counts = (run.reward_pool.num_timeouts, run.reward_pool.num_failures)
        # 1. rollout: sync mode runs this step's groups now; async mode takes groups that have been
        # generating in the background. A group with a failed episode (server error, abort, past
        # episode_timeout_s) is dropped and counted, never trained on.
        wasted_before = run.producer.num_wasted_tokens if run.producer else 0
        groups, failed_groups = take_groups(run, cfg.batch_size, f"step {run.step + 1}'s rollout")
        # dynamic sampling (DAPO): a group whose rewards are all equal has no learning signal;
        # more groups are rolled out (at most `refill_rounds` times) until batch_size have some
        for _ in range(cfg.refill_rounds if cfg.drop_equal_groups else 0):
            missing = cfg.batch_size - sum(not rewards_all_equal(g) for g in groups)
            if missing <= 0:
                break
            more, failed = take_groups(run, missing, f"step {run.step + 1}'s refill")
            groups, failed_groups = groups + more, failed_groups + failed
        episodes = [e for g in groups for e in g]
        rewards = torch.cat([e["rewards"] for e in episodes])

        # 2. advantages per episode over its group; a group whose rewards are all equal has advantage
        # exactly 0, and dynamic sampling drops it. Each training row (an episode, or each segment
        # of one) has its episode's reward and advantage, broadcast over its tokens by the loss.
        advantages, equal, keep = advantages_and_keep(cfg, rewards)
        if equal.all():
            tqdm.write(f"step {run.step + 1}: every group's rewards are equal: no learning signal this step")
        left_out = keep & leave_out(episodes) if leave_out is not None else torch.zeros_like(keep)
        keep = keep & ~left_out
        rows = episode_rows(episodes)
        row_episode = torch.tensor([i for i, _ in rows], dtype=torch.long)
        full = concat_padded_tensors([{k: row[k] for k in TRAJECTORY_KEYS} for _, row in rows])
        full["rewards"], full["advantages"], row_keep = rewards[row_episode], advantages[row_episode], keep[row_episode]
        # Each row's weight in the per-sequence loss_aggs (lib.grpo.ppo_loss): an agent's episode of k
        # segments gives each 1/k by default, so that it counts once (lib/agent_episode.py); 1 otherwise.
        full["row_weights"] = torch.tensor([float(row.get("row_weight", 1.0)) for _, row in rows])
        batch = {k: v[row_keep] for k, v in full.items()} if rows else {}
        # a token's staleness: the version this step trains at minus the version that sampled it
        token_staleness = (run.version - full["versions"])[full["loss_mask"].bool()].float() if rows else torch.zeros(0)
        for i, e in enumerate(episodes):  # for the traces (tensors: out of a trace record's stats)
            e["advantages"], e["keep"] = advantages[i:i + 1], keep[i:i + 1]
        metrics = {
            "rollout/reward": rewards.mean().item(),
            "rollout/episodes": len(episodes),
            **{f"rollout/{k}": v for k, v in episode_metrics(episodes).items()},
            "rollout/turns": float(np.mean([e["num_turns"] for e in episodes])),
            "rollout/max_tokens_hit": float(np.mean([e["finish_reason"] == "max_tokens" for e in episodes])),
            "rollout/seq_len": full["attention_mask"].sum(1).float().mean().item() if rows else 0.0,
            "rollout/gen_tokens": int(full["loss_mask"].sum()) if rows else 0,
            "rollout/kept_groups": int(keep.sum()) // cfg.group_size,
            "rollout/equal_reward_groups": int(equal.sum()) // cfg.group_size,
            "rollout/staleness_mean": token_staleness.mean().item() if token_staleness.numel() else 0.0,
            "rollout/staleness_max": token_staleness.max().item() if token_staleness.numel() else 0.0,
            # sampled tokens not trained on: of groups dropped as stale or by dynamic sampling, left out
            "rollout/wasted_tokens": (run.producer.num_wasted_tokens if run.producer else 0) - wasted_before
                                     + (int(full["loss_mask"][~row_keep].sum()) if rows else 0),
            "rollout/failed_groups": failed_groups,
        }
        metrics["rollout/left_out"] = int(left_out.sum())  # episodes kept out of the loss by the task's leave_out
    if cfg.colocate_sleep and run.is_main:  # the server is idle until the sync: lend its memory to the trainer
        run.bg.run(run.client.release_memory_occupation())
    batch = broadcast_from_rank0(batch, run.cpu_group)
    return (batch if len(batch.get("rewards", ())) >= run.world_size else {}), episodes, metrics  # a row for every rank


def train_step(run: Run, batch: dict) -> dict:
    """3. proximal log-probs and 4. the PPO update, on this rank's rows of `batch` (none: nothing
    to train). This rank's proximal log-probs go to `batch["rank_proximal_logprobs"]` for the traces."""
    cfg, metrics = run.cfg, {}
    rows = {k: v[run.rank::run.world_size] for k, v in batch.items()}  # this rank's share of the batch
    # 3. proximal log-probs, recomputed by the trainer (decoupled PPO: `logprobs` stays the
    # behaviour policy's, as the server reported them). In sync mode the two policies are
    # the same, so their gap is a bug detector.
    t1 = time.time()
    if batch:
        rows["proximal_logprobs"] = batch["rank_proximal_logprobs"] = run.actor.compute_logprobs(rows)
        mismatch = logprob_mismatch(rows["proximal_logprobs"], rows["logprobs"], rows["loss_mask"],
                                    cfg.behav_imp_weight_cap or None)
        if (warning := mismatch_warning(mismatch)):
            tqdm.write(warning)
        metrics.update({f"logprob/{k}": v for k, v in mismatch.items()})  # server vs trainer, all ranks
    metrics["perf/logp_s"] = time.time() - t1

    # 4. PPO update: one optimizer step per mini-batch; after the first, the policy has moved
    # away from the proximal one and the clip bounds it. Every rank runs the same number of
    # steps (its collectives must pair up): the count fits the rank with the fewest rows.
    t2 = time.time()
    if batch:
        num_mb = max(1, min(cfg.ppo_minibatches, len(batch["rewards"]) // run.world_size))
        # one mini-batch: every row in rollout order (the loss sums in the same order as ever)
        parts = minibatch_rows(len(rows["rewards"]), num_mb, seed=cfg.seed + run.step) if num_mb > 1 else [slice(None)]
        stats = merge_stats([run.actor.update({k: v[part] for k, v in rows.items()}, step=run.step)
                             for part in parts])
        stats["minibatches"] = len(parts)
        metrics.update({f"loss/{k}": v for k, v in stats.items()})  # rank 0's rows under FSDP
    metrics["perf/update_s"] = time.time() - t2
    return metrics


def sync_weights(run: Run, trained: bool) -> dict:
    """5. weight sync: pause generation, push the new weights, continue; bump the version. A step
    with nothing trained leaves the weights and the version as they are (a server that lent its
    memory, colocate_sleep, gets the same weights back)."""
    cfg, t3, park_s = run.cfg, time.time(), None
    if trained or cfg.colocate_sleep:
        run.version += int(trained)
        # sync mode has nothing in flight: "abort" leaves SGLang in a state it can always flush
        pause_mode = cfg.pause_mode if run.producer is not None else "abort"
        if run.is_main:
            run.bg.run(run.client.pause_generation(pause_mode))
        if cfg.colocate_sleep:  # the server takes its memory back: weights first (the sync fills them), then its cache
            if cfg.trainer_offload_base:  # the trainer's base leaves first
                t_park = time.time()
                run.actor.park_base()  # host memory until the next step's log-probs (a merged sync streams from it)
                park_s = time.time() - t_park
            torch.cuda.empty_cache()  # what the update freed goes back to the driver, for the server
            if run.is_main:
                run.bg.run(run.client.resume_memory_occupation(["weights"]))
        # a held request keeps its KV (and SGLang can flush only an idle server: its scheduler
        # dies on a failed flush), so the prefix cache is flushed only where nothing is held
        run.weight_sync.sync(run.version, flush_cache=pause_mode == "abort")
        if cfg.colocate_sleep:
            torch.cuda.empty_cache()  # what the sync's copies (merged LoRA weights) held, for the server's cache
            if run.is_main:
                run.bg.run(run.client.resume_memory_occupation(["kv_cache", "cuda_graph"]))
        if run.is_main:
            if run.producer is not None:
                run.producer.set_version(run.version)
            run.bg.run(run.client.continue_generation(run.version))  # requests cut or held by the pause go on
    metrics = {"perf/sync_s": time.time() - t3}
    if park_s is not None:
        metrics["perf/park_base_s"] = park_s  # in sync_s; the way back is in the next step's logp_s
    return metrics


def log_step(run: Run, metrics: dict, episodes: list[dict], batch: dict, *, context_role: str = "tool",
             correct: Callable | None = None, tool_failures: Callable | None = None):
    """6. log (rank 0): the step's metrics row, with the dev evaluation every eval_every steps, and
    its traces (after step 3: trainer log-probs exist). A trace names the tokens the task appends
    between model turns by `context_role` ("tool" output, a "reflection" prompt); `correct(episode)`
    and `tool_failures(episode)` give the task's answer verdict and failed tool calls, where it has them."""
    if not run.is_main:
        return
    cfg = run.cfg
    metrics.update({
        "policy/version": run.version,
        "rollout/dropped_stale_groups": run.producer.num_dropped_stale if run.producer else 0,
        "perf/gen_tokens_per_s": metrics["rollout/gen_tokens"] / max(metrics["perf/rollout_s"], 1e-6),
        "perf/trained_tokens_per_s": metrics["rollout/gen_tokens"] / max(metrics["perf/step_s"], 1e-6),
        "server/restarts": sum(s.restarts for s in run.supervisors),
    })
    metrics.update(run.lora_test)  # LoRA: the start-up test of the servers' adapters, in this process's first row
    run.lora_test = {}
    if run.reward_pool is not None:
        metrics["reward/timeouts"] = run.reward_pool.num_timeouts - run.reward_counts[0]
        metrics["reward/worker_failures"] = run.reward_pool.num_failures - run.reward_counts[1]
    if run.actor.device.type == "cuda":  # the trainer's high-water mark this step and what it holds now
        # (while the server generates), and the GPU's free memory now
        metrics["perf/trainer_peak_mem_gb"] = torch.cuda.max_memory_allocated(run.actor.device) / 1e9
        metrics["perf/trainer_mem_gb"] = torch.cuda.memory_allocated(run.actor.device) / 1e9
        metrics["perf/gpu_free_gb"] = torch.cuda.mem_get_info(run.actor.device)[0] / 1e9
        torch.cuda.reset_peak_memory_stats(run.actor.device)
    if cfg.eval_every and run.step % cfg.eval_every == 0:
        metrics.update({f"eval/{k}": v for k, v in run_evaluation(run, "eval", run.dev_items, log=False).items()})
    run.logger.log(run.step, metrics)
    if cfg.trace_every and run.step % cfg.trace_every == 0:  # a record per training row of the first groups
        rows = episode_rows(episodes)
        row_keep = torch.cat([episodes[i]["keep"] for i, _ in rows]) if rows else torch.zeros(0, dtype=torch.bool)
        trainer_lp = trainer_logprobs_by_episode(row_keep, batch.get("rank_proximal_logprobs"), run.rank,
                                                 run.world_size)
        records = [episode_record({**episodes[i], **row}, run.tokenizer, step=run.step, group=i // cfg.group_size,
                                  index=i % cfg.group_size, advantage=episodes[i]["advantages"].item(),
                                  trainer_logprobs=trainer_lp[r], context_role=context_role,
                                  correct=float(correct(episodes[i])) if correct else None,
                                  tool_failures=int(tool_failures(episodes[i])) if tool_failures else None)
                   for r, (i, row) in enumerate(rows) if i < cfg.trace_groups * cfg.group_size]
        write_traces(run.trace_file, records)
        run.logger.log_traces(run.step, records)


def lora_settings(cfg: RunConfig) -> dict:
    """What a checkpoint's adapters were made with; a resume must match it (target modules as a list, as JSON
    and torch.save round-trip them)."""
    return {"lora_rank": cfg.lora_rank, "lora_alpha": cfg.lora_alpha,
            "lora_target_modules": list(cfg.lora_target_modules)}


def save_checkpoint(run: Run):
    """7. checkpoint: model, optimizer, scheduler (every rank writes its shard), the counters and the RNGs."""
    run.actor.save_checkpoint(os.path.join(run.ckpt_dir, "latest"), extra={
        "step": run.step, "version": run.version, "data_position": run.data_position,
        "data_consumed_ahead": run.data_consumed_ahead, **lora_settings(run.cfg),
        "python_rng": random.getstate(), "numpy_rng": np.random.get_state(), "torch_rng": torch.get_rng_state()})


def checkpoint_due(run: Run, stopping: bool) -> bool:
    every = run.cfg.checkpoint_every
    return bool(every) and (run.step % every == 0 or run.step == run.cfg.max_steps or stopping)


def run_evaluation(run: Run, split: str, items: list[dict], log: bool = True) -> dict:
    """Greedy episodes on `items` (rank 0): their metrics, also logged under `{split}/...` at this
    step unless `log` is False (log_step adds the dev evaluation to the step's row). Each question's
    record goes to evals/, and the final test is compared, paired, with the test before training."""
    what = "the test evaluation" if split == "test" else f"step {run.step}'s evaluation"
    episodes, metrics = run_rollout(run, run.evaluate(items), what)
    metrics.update(record_evaluation(run.cfg.run_dir, split, run.step, episodes))
    if log:
        run.logger.log(run.step, {f"{split}/{k}": v for k, v in metrics.items()})
    return metrics


def out_of_time(run: Run, start: float) -> bool:
    # Under torchrun rank 0's clock decides for every rank, so all ranks leave the loop together.
    budget = run.cfg.time_budget_s
    return broadcast_from_rank0(bool(budget) and time.time() - start > budget, run.cpu_group)
