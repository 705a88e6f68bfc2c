"""Training reward against wall-clock: TRL's GRPOTrainer beside agentrl's train_reflect.py on the same
single-turn math task, and whether agentrl reaches TRL's final reward in at most a third of TRL's
wall-clock.

    # ours (one GPU: SGLang beside the trainer, asleep while it trains), first attempt only:
    python train_reflect.py --model_path smollm2-135m-instruct --max_turns 1 --batch_size 8 --group_size 8 \
        --max_new_tokens_per_turn 256 --max_tokens 512 --lr 5e-6 --max_steps 100 --seed 0 --test_size 200 \
        --server sglang --base_gpu_id 0 --mode sync --weight_sync tensor --colocate_sleep True \
        --mem_fraction_static 0.5 --trainer_dtype bfloat16 --trainer_threads 0 \
        --eval_every 0 --checkpoint_every 0 --run_dir runs/reflect_135m_1turn
    # TRL on the same GPU (transformers' generate on it; --trl-vllm: vLLM's colocate mode), same settings:
    python bench/bench_trl_reward.py --model-path smollm2-135m-instruct --batch-size 8 --group-size 8 \
        --max-new-tokens 256 --max-tokens 512 --lr 5e-6 --steps 100 --seed 0 --test-size 200 \
        --trl-jsonl runs/trl_135m.jsonl
    # report only: the table, and the plot
    python bench/bench_trl_reward.py --trl-jsonl runs/trl_135m.jsonl --ours runs/reflect_135m_1turn --plot reward.png

Both commands start from train_reflect's default config (configs/reflect_tiny.yaml) and override the
same fields; `--model-path` and `--ours` together run TRL and then report. On a machine without
the package index pass the model's directory instead of its name (lib/model_names.py).

The task is train_reflect.py's with `--max_turns 1`: the prompt is its PROMPT_TEMPLATE as one user
message in the tokenizer's chat template (`build_prompt_ids`; the script checks that TRL's
tokenization of the first prompts is the same ids), the reward is its `reward_fn` of the completion's
text (1 when the `#### N` answer is the gold number). The data is `load_splits(cfg)` and its train
questions come in the order of train_reflect's `item_at` for the same seed (a permutation of the
train split per epoch, `RandomState(seed + epoch)`), so step k of both runs sees the same questions.
Settings not given here come from train_reflect's `--config` (its default, configs/reflect_tiny.yaml,
unless another is named), so one Config describes both runs: prompts x group size per optimizer
step, completion length (max_new_tokens_per_turn), temperature 1 with no top-k / top-p, AdamW at
the same lr, weight decay and schedule, clip eps low / high, token-mean loss (TRL "dapo"), no KL
(kl_coef 0 = TRL beta 0), grad clip, advantages scaled by the group std or not, fp32 master weights
with bf16 compute on CUDA, one optimizer step per generation batch (num_iterations 1).

Clocks. TRL: seconds from `on_train_begin` to each `on_step_end` (model load left out). Ours:
`time/wall_s` of metrics.jsonl counted from the start of the first step (the wall time of step 1
minus its perf/step_s), so server start-up, model load and the step-0 evaluation are left out and
everything inside the loop (evaluations every eval_every steps, checkpoints, traces) is in: run ours
with `--eval_every 0 --checkpoint_every 0` to time the training alone, or pass `--ours-clock steps`
for the sum of perf/step_s (which leaves evaluations and checkpoints out). The report says which.

"Final reward" is the mean training reward of the last `--smooth` steps; a curve's smoothed value at
a step is the mean of the `--smooth` steps up to it (counted once a full window exists). The crossing
is the first step at which ours' smoothed reward reaches TRL's final reward.
"""
import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


# --- the matched settings: train_reflect's Config ---
def reflect_config(args):
    """train_reflect's Config from its --config file and this script's flags."""
    import train_reflect as tr
    from lib.config import load_config

    config = args.config
    if config and not os.path.exists(config) and os.path.exists(os.path.join(REPO, config)):
        config = os.path.join(REPO, config)
    overrides = {"model_path": args.model_path, "dataset": args.dataset, "seed": args.seed,
                 "max_steps": args.steps, "batch_size": args.batch_size, "group_size": args.group_size,
                 "max_new_tokens_per_turn": args.max_new_tokens, "max_tokens": args.max_tokens, "lr": args.lr}
    return load_config(tr.Config, None if config in (None, "None") else config,
                       {k: v for k, v in overrides.items() if v is not None})


def train_items_in_order(cfg, num: int) -> list[dict]:
    """The first `num` questions train_reflect trains on for cfg.seed: its `item_at(0 .. num-1)`."""
    import numpy as np

    import train_reflect as tr

    train = tr.load_splits(cfg)["train"]
    out = []
    for index in range(num):
        epoch, offset = divmod(index, len(train))
        if offset == 0:
            order = np.random.RandomState(cfg.seed + epoch).permutation(len(train))
        out.append(train[order[offset]])
    return out


# --- TRL run ---
def run_trl(args):
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import train_reflect as tr
    from lib.client import model_eos_ids
    from lib.model_names import resolve_model_path

    cfg = reflect_config(args)
    if not cfg.model_path:
        sys.exit("--model-path is needed to run TRL: the model dir train_reflect trained (the embedded default's "
                 "is its warm start, ~/.cache/agentrl/reflect-warm-start-direct-*), or a known name")
    model_path = resolve_model_path(cfg.model_path)
    if cfg.kl_coef != 0 or cfg.drop_equal_groups:
        print(f"warning: kl_coef={cfg.kl_coef}, drop_equal_groups={cfg.drop_equal_groups} in the config; the TRL run "
              "uses beta 0 and keeps every group (bench compares the single-turn recipe without them)")
    if args.trl_vllm:
        try:
            import vllm  # noqa: F401
        except ImportError:
            sys.exit("--trl-vllm: vllm is not importable on this machine (pip install vllm, a version TRL 1.16 "
                     "supports); without --trl-vllm TRL generates with transformers' generate")
    cuda = torch.cuda.is_available()
    episodes = cfg.batch_size * cfg.group_size
    micro_batch = args.micro_batch or min(16, episodes)
    if episodes % micro_batch:
        sys.exit(f"--micro-batch {micro_batch} must divide batch_size x group_size = {episodes}")

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    items = train_items_in_order(cfg, cfg.batch_size * (cfg.max_steps + 1))
    chat = cfg.apply_chat_template and bool(tokenizer.chat_template)
    prompt = lambda q: ([{"role": "user", "content": tr.PROMPT_TEMPLATE.format(question=q)}]  # noqa: E731
                        if chat else tr.PROMPT_TEMPLATE.format(question=q))
    dataset = Dataset.from_list([{"prompt": prompt(it["question"]), "answer": it["answer"]} for it in items])
    check_prompt_ids(tokenizer, cfg, items)

    def reflect_reward(completions, answer, **kwargs):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [tr.reward_fn(text, gold) for text, gold in zip(texts, answer)]

    os.makedirs(os.path.dirname(os.path.abspath(args.trl_jsonl)), exist_ok=True)
    out = open(args.trl_jsonl, "w")
    stop_ids = cfg.stop_token_ids or model_eos_ids(model_path, tokenizer)
    settings = {"model_path": model_path, "seed": cfg.seed, "steps": cfg.max_steps, "batch_size": cfg.batch_size,
                "group_size": cfg.group_size, "max_new_tokens": cfg.max_new_tokens_per_turn, "lr": cfg.lr,
                "eps_clip": [cfg.eps_clip_low, cfg.eps_clip_high], "grad_clip": cfg.grad_clip,
                "loss": cfg.loss_agg, "scale_adv_by_std": cfg.scale_adv_by_std, "temperature": cfg.temperature,
                "chat_template": chat, "agentrl_stop_ids": stop_ids, "micro_batch": micro_batch,
                "generation": "vllm colocate" if args.trl_vllm else "transformers generate",
                "device": torch.cuda.get_device_name() if cuda else "cpu", "trl": __import__("trl").__version__}
    print("TRL run, matched to train_reflect:", json.dumps(settings))
    out.write(json.dumps({"settings": settings}) + "\n")

    class RewardClock(TrainerCallback):
        """One JSONL row per optimizer step: wall-clock since train start, the step's mean reward."""

        def on_train_begin(self, *a, **kw):
            self.start = self.last = time.perf_counter()

        def on_step_end(self, *a, **kw):
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            self.wall_s, self.step_s, self.last = now - self.start, now - self.last, now

        def on_log(self, args_, state, control, logs=None, **kw):
            if not logs or "reward" not in logs:
                return
            row = {"step": state.global_step, "wall_s": round(self.wall_s, 3), "step_s": round(self.step_s, 3),
                   "reward": logs["reward"], "reward_std": logs.get("reward_std"),
                   "completion_len": logs.get("completions/mean_length"),
                   "clipped_ratio": logs.get("completions/clipped_ratio"), "grad_norm": logs.get("grad_norm")}
            print(f"TRL step {row['step']}: reward {row['reward']:.3f}, {row['step_s']:.2f} s, "
                  f"wall {row['wall_s']:.1f} s", flush=True)
            out.write(json.dumps(row) + "\n")
            out.flush()

    schedule = {"constant": "constant_with_warmup" if cfg.warmup_steps else "constant", "cosine": "cosine"}
    config = GRPOConfig(
        output_dir=args.out_dir, max_steps=cfg.max_steps, per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=episodes // micro_batch, num_generations=cfg.group_size, num_iterations=1,
        max_completion_length=cfg.max_new_tokens_per_turn, temperature=cfg.temperature, top_p=1.0, top_k=0,
        learning_rate=cfg.lr, weight_decay=cfg.weight_decay, lr_scheduler_type=schedule[cfg.lr_schedule],
        warmup_steps=cfg.warmup_steps, beta=0.0, epsilon=cfg.eps_clip_low, epsilon_high=cfg.eps_clip_high,
        loss_type={"token-mean": "dapo", "seq-mean-token-mean": "grpo"}[cfg.loss_agg],
        scale_rewards="group" if cfg.scale_adv_by_std else "none", max_grad_norm=cfg.grad_clip,
        bf16=cuda, model_init_kwargs={"dtype": "float32"}, gradient_checkpointing=cfg.trainer_gradient_checkpointing,
        shuffle_dataset=False, logging_steps=1, save_strategy="no", report_to="none", seed=cfg.seed,
        disable_dropout=True, use_cpu=not cuda,
        **(dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=args.vllm_mem,
                # ours caps the server->trainer importance weight per token (behav_imp_weight_cap, mode)
                vllm_importance_sampling_correction=bool(cfg.behav_imp_weight_cap),
                vllm_importance_sampling_mode=f"token_{cfg.behav_imp_weight_mode}",
                vllm_importance_sampling_clip_max=cfg.behav_imp_weight_cap or 3.0) if args.trl_vllm else {}))
    trainer = GRPOTrainer(model=model_path, reward_funcs=reflect_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[RewardClock()])
    if set(trainer.eos_token_ids) != set(stop_ids):
        print(f"warning: TRL ends a completion on {trainer.eos_token_ids}, train_reflect's turn on {stop_ids}")
    trainer.train()
    if args.test_size:
        acc = greedy_accuracy(trainer.model, tokenizer, cfg, stop_ids, args.test_size)
        print(f"TRL test acc (greedy, first {args.test_size} test questions): {acc:.3f}")
        out.write(json.dumps({"step": trainer.state.global_step, "test/acc_turn1": acc}) + "\n")
    out.close()


def check_prompt_ids(tokenizer, cfg, items, n: int = 4):
    """TRL tokenizes the prompt itself: warn when its ids are not train_reflect's `build_prompt_ids`,
    and when a prompt plus a full completion exceeds train_reflect's context budget (max_tokens, where
    ours would cut the completion short)."""
    import train_reflect as tr

    for it in items[:n]:
        ours = tr.build_prompt_ids(tokenizer, it["question"], cfg.apply_chat_template)
        text = tr.PROMPT_TEMPLATE.format(question=it["question"])
        if cfg.apply_chat_template and tokenizer.chat_template:
            trl_ids = tokenizer.apply_chat_template([[{"role": "user", "content": text}]], add_generation_prompt=True,
                                                    tokenize=True, return_dict=True)["input_ids"][0]
        else:
            trl_ids = tokenizer(text)["input_ids"]
        if list(trl_ids) != list(ours):
            print(f"warning: TRL's prompt ids differ from train_reflect's ({len(trl_ids)} vs {len(ours)} tokens) "
                  f"for {it['question'][:60]!r}")
    too_long = sum(len(tr.build_prompt_ids(tokenizer, it["question"], cfg.apply_chat_template))
                   + cfg.max_new_tokens_per_turn > cfg.max_tokens for it in items)
    if too_long:
        print(f"warning: {too_long} of {len(items)} prompts + max_new_tokens_per_turn exceed max_tokens "
              f"{cfg.max_tokens}: train_reflect gives those fewer new tokens, TRL does not")


def greedy_accuracy(model, tokenizer, cfg, stop_ids, size: int, batch: int = 64) -> float:
    """train_reflect's end-of-run test evaluation at max_turns 1 (greedy, first attempt, reward_fn, the
    first `size` test questions), with transformers' generate."""
    import torch

    import train_reflect as tr

    test = tr.load_splits(cfg)["test"][:size]
    model.eval()
    device = next(model.parameters()).device
    correct = 0
    for i in range(0, len(test), batch):
        chunk = test[i:i + batch]
        ids = [tr.build_prompt_ids(tokenizer, it["question"], cfg.apply_chat_template) for it in chunk]
        width = max(map(len, ids))
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(x)) + x for x in ids], device=device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
        with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            gen = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, top_p=None, top_k=None,
                                 temperature=None, max_new_tokens=cfg.max_new_tokens_per_turn, eos_token_id=stop_ids,
                                 pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(gen[:, width:], skip_special_tokens=True)
        correct += sum(tr.reward_fn(t, it["answer"]) > 0 for t, it in zip(texts, chunk))
    return correct / len(test)


# --- reading the two runs ---
def read_trl(path: str) -> dict:
    """{"step", "wall_s", "reward"} lists of a --trl-jsonl file, its settings and test accuracy."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    steps = [r for r in rows if "reward" in r]
    tests = [r["test/acc_turn1"] for r in rows if "test/acc_turn1" in r]
    return {"step": [r["step"] for r in steps], "wall_s": [r["wall_s"] for r in steps],
            "reward": [r["reward"] for r in steps], "settings": next((r["settings"] for r in rows if "settings" in r), {}),
            "test_acc": tests[-1] if tests else None}


def read_ours(run_dir: str, clock: str = "wall") -> dict:
    """The same lists for a train_reflect run dir's metrics.jsonl (see the module docstring for `clock`)."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    steps = [r for r in rows if "rollout/reward" in r]
    if not steps:
        sys.exit(f"{run_dir}/metrics.jsonl has no training steps (rollout/reward)")
    if clock == "wall":
        start = steps[0]["time/wall_s"] - steps[0]["perf/step_s"]
        wall = [r["time/wall_s"] - start for r in steps]
    else:
        wall, total = [], 0.0
        for r in steps:
            total += r["perf/step_s"]
            wall.append(total)
    tests = [r["test/acc_turn1"] for r in rows if "test/acc_turn1" in r and r["step"] > 0]  # not --test_at_start's
    return {"step": [r["step"] for r in steps], "wall_s": wall, "reward": [r["rollout/reward"] for r in steps],
            "test_acc": tests[-1] if tests else None,
            "evals_in_loop": sum(1 for r in steps if "eval/acc_turn1" in r)}


# --- the comparison ---
def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` values (fewer at the start)."""
    return [statistics.fmean(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]


def first_reach(curve: dict, target: float, window: int):
    """(step, wall_s, smoothed reward) where the curve's smoothed reward first reaches `target`,
    counting only steps with a full window behind them (all of a run shorter than the window); None
    if it never does."""
    smooth = smoothed(curve["reward"], window)
    for i in range(min(window, len(smooth)) - 1, len(smooth)):
        if smooth[i] >= target - 1e-12:
            return curve["step"][i], curve["wall_s"][i], smooth[i]
    return None


def compare(ours: dict, trl: dict, window: int = 5) -> dict:
    """The numbers of the report: each run's steps, total wall, first and final reward; ours' crossing."""
    summary = {}
    for name, c in (("ours", ours), ("trl", trl)):
        summary[name] = {"steps": len(c["reward"]), "wall_s": c["wall_s"][-1],
                         "step_s": statistics.median(b - a for a, b in zip([0.0] + c["wall_s"], c["wall_s"])),
                         "first_reward": statistics.fmean(c["reward"][:window]),
                         "final_reward": statistics.fmean(c["reward"][-window:]), "test_acc": c.get("test_acc")}
    hit = first_reach(ours, summary["trl"]["final_reward"], window)
    summary["crossing"] = None if hit is None else {
        "step": hit[0], "wall_s": hit[1], "smoothed_reward": hit[2], "ratio_to_trl_wall": hit[1] / summary["trl"]["wall_s"]}
    summary["third_or_less"] = hit is not None and hit[1] <= summary["trl"]["wall_s"] / 3
    return summary


def markdown(summary: dict, window: int, clock: str) -> str:
    test = all(summary[k]["test_acc"] is not None for k in ("ours", "trl"))
    head = ("| run | steps | total wall s | s/step (median) | first reward | final reward |"
            + (" test acc (greedy, after training) |" if test else ""))
    lines = [head, "|" + " --- |" + " ---: |" * (5 + test)]
    for key, name in (("ours", "agentrl train_reflect.py"), ("trl", "TRL GRPOTrainer")):
        s = summary[key]
        lines.append(f"| {name} | {s['steps']} | {s['wall_s']:.1f} | {s['step_s']:.2f} | {s['first_reward']:.3f} | "
                     f"{s['final_reward']:.3f} |" + (f" {s['test_acc']:.3f} |" if test else ""))
    trl = summary["trl"]
    cross = summary["crossing"]
    lines.append("")
    lines.append(f"First / final reward: mean training reward of the first / last {window} steps. "
                 f"agentrl clock: {'time/wall_s from the start of step 1' if clock == 'wall' else 'sum of perf/step_s'}; "
                 "TRL clock: on_train_begin to on_step_end.")
    if cross is None:
        lines.append(f"agentrl never reaches TRL's final reward {trl['final_reward']:.3f} "
                     f"(smoothed over {window} steps) within its {summary['ours']['steps']} steps.")
    else:
        lines.append(f"agentrl first reaches TRL's final reward {trl['final_reward']:.3f} (smoothed over {window} "
                     f"steps) at step {cross['step']}, {cross['wall_s']:.1f} s: {cross['ratio_to_trl_wall']:.3f} x "
                     f"TRL's total {trl['wall_s']:.1f} s.")
    lines.append(f"Within a third of TRL's wall-clock: {'yes' if summary['third_or_less'] else 'no'}.")
    return "\n".join(lines)


def plot(path: str, ours: dict, trl: dict, summary: dict, window: int):
    try:
        import matplotlib
    except ImportError:
        sys.exit("--plot needs matplotlib: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for curve, name, color in ((ours, "agentrl train_reflect.py", "tab:blue"), (trl, "TRL GRPOTrainer", "tab:orange")):
        ax.plot(curve["wall_s"], curve["reward"], color=color, alpha=0.25, linewidth=1)
        ax.plot(curve["wall_s"], smoothed(curve["reward"], window), color=color, linewidth=2,
                label=f"{name} (mean of {window} steps)")
    trl_s = summary["trl"]
    ax.axhline(trl_s["final_reward"], color="tab:orange", linestyle="--", linewidth=1,
               label=f"TRL final reward {trl_s['final_reward']:.3f}")
    ax.axvline(trl_s["wall_s"] / 3, color="grey", linestyle=":", linewidth=1, label="1/3 of TRL's wall-clock")
    if summary["crossing"]:
        c = summary["crossing"]
        ax.plot([c["wall_s"]], [c["smoothed_reward"]], "o", color="tab:blue",
                label=f"agentrl reaches it: {c['wall_s']:.0f} s ({c['ratio_to_trl_wall']:.2f} x TRL)")
    ax.set_xlim(left=0)
    ax.set_xlabel("wall-clock since train start (s)")
    ax.set_ylabel("training reward (mean over the step's completions)")
    ax.set_title("Single-turn GSM8K-format GRPO: reward against wall-clock")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/reflect_tiny.yaml",
                   help="train_reflect's config: every setting not given below (its default, as train_reflect's)")
    p.add_argument("--model-path", default=None, help="model_path (HF dir or a known name)")
    p.add_argument("--dataset", default=None, help="dataset ('' = the bundled problems)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="max_steps")
    p.add_argument("--batch-size", type=int, default=None, help="batch_size: prompts per optimizer step")
    p.add_argument("--group-size", type=int, default=None, help="group_size: completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=None, help="max_new_tokens_per_turn")
    p.add_argument("--max-tokens", type=int, default=None, help="max_tokens (only checked: prompt + completion)")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--micro-batch", type=int, default=None, help="TRL per_device_train_batch_size (default min(16, episodes))")
    p.add_argument("--trl-vllm", action="store_true", help="TRL generates with vLLM in colocate mode (needs vllm)")
    p.add_argument("--vllm-mem", type=float, default=0.3, help="--trl-vllm: vllm_gpu_memory_utilization")
    p.add_argument("--test-size", type=int, default=0,
                   help="after TRL's training: greedy accuracy on the first N test questions (ours: --test_size N)")
    p.add_argument("--out-dir", default="/tmp/bench_trl_reward", help="TRL's output_dir (nothing is saved)")
    p.add_argument("--trl-jsonl", default="trl_reward.jsonl", help="TRL's per-step rows: written by a TRL run, "
                   "read by the report")
    p.add_argument("--ours", default=None, help="report: run_dir of the matching train_reflect.py run")
    p.add_argument("--ours-clock", choices=("wall", "steps"), default="wall")
    p.add_argument("--smooth", type=int, default=5, help="steps in the smoothing window / the final reward")
    p.add_argument("--plot", default=None, help="report: the PNG of reward against wall-clock")
    p.add_argument("--json", default=None, help="report: also write the summary here")
    args = p.parse_args()

    if not (args.model_path or args.ours):
        p.error("give --model-path (and the TRL settings) to run TRL, and/or --ours RUN_DIR to report")
    if args.model_path:
        run_trl(args)
    if not args.ours:
        return
    if not os.path.exists(args.trl_jsonl):
        p.error(f"--trl-jsonl {args.trl_jsonl} does not exist: run TRL first (--model-path ...)")
    ours, trl = read_ours(args.ours, args.ours_clock), read_trl(args.trl_jsonl)
    if not trl["reward"]:
        sys.exit(f"{args.trl_jsonl} has no step rows")
    if trl["settings"]:
        print("TRL settings:", json.dumps(trl["settings"]))
    if ours["evals_in_loop"] and args.ours_clock == "wall":
        print(f"note: {ours['evals_in_loop']} evaluations ran inside ours' training loop and count in its wall-clock "
              "(--ours-clock steps leaves them out)")
    summary = compare(ours, trl, args.smooth)
    print()
    print(markdown(summary, args.smooth, args.ours_clock))
    if args.plot:
        plot(args.plot, ours, trl, summary, args.smooth)
    if args.json:
        json.dump(summary, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
