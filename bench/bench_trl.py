"""TRL's GRPOTrainer on the same model, prompts, group size and lengths as a train_search.py run, and
the two step times side by side.

    # ours (trainer GPU 0, SGLang GPU 1), single turn so that both sides do the same work:
    python train_search.py --model_path M --data_dir D --max_turns 1 --max_new_tokens_per_turn 512 \
        --batch_size 8 --group_size 8 --run_dir runs/ours ...
    # TRL (one GPU: generation by transformers' generate on the trainer's GPU, the machine has no vLLM):
    CUDA_VISIBLE_DEVICES=2 python bench/bench_trl.py --model-path M --data-dir D --batch-size 8 --group-size 8 \
        --max-new-tokens 512 --steps 4 --ours runs/ours --json trl.json
    # the table again, from the JSON of a TRL run (e.g. when TRL ran before ours finished):
    python bench/bench_trl.py --model-path M --data-dir D --trl-json trl.json --ours runs/ours

What is the same: the model directory (weights and tokenizer), the prompts (train_search's prompt
template in the tokenizer's chat template, the first questions of D/train.jsonl), prompts x group
size per optimizer step, completion length (max_new_tokens; a random-weight model never stops
early), temperature 1 with no top-k/top-p, fp32 master weights with bf16 compute, AdamW at the same
lr, clip 0.2/0.28, token-mean loss (TRL "dapo"), no KL, the F1 reward. What differs: TRL generates
with `model.generate` on the training GPU; ours with SGLang on a second GPU and also recomputes the
proximal log-probs and syncs the weights to the server each step (both inside our step time).
Step time = wall time between consecutive optimizer steps (TRL: `on_step_end`; ours: perf/step_s),
median after the first `--skip` steps.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_trl(args) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import train_search as ts
    from lib.wiki_data import read_qa

    questions = read_qa(os.path.join(args.data_dir, "train.jsonl"))[: args.batch_size * (args.steps + 1)]
    dataset = Dataset.from_list([
        {"prompt": [{"role": "user", "content": ts.PROMPT_TEMPLATE.format(question=q["question"])}],
         "gold": q["answer"]} for q in questions])

    def f1_reward(completions, gold, **kwargs):
        return [ts.compute_reward(ts.parse_answer(c[0]["content"]), g) for c, g in zip(completions, gold)]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_train_begin(self, *a, **kw):
            self.times.append(time.perf_counter())

        def on_step_end(self, *a, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            print(f"TRL step {len(self.times) - 1}: {self.times[-1] - self.times[-2]:.2f} s", flush=True)

    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    episodes = args.batch_size * args.group_size
    cuda = torch.cuda.is_available()
    config = GRPOConfig(
        output_dir=args.out_dir, max_steps=args.steps, per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=episodes // args.micro_batch, num_generations=args.group_size,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=args.lr, beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", max_grad_norm=1.0,
        bf16=cuda, model_init_kwargs={"dtype": "float32"}, gradient_checkpointing=False, shuffle_dataset=False,
        logging_steps=1, save_strategy="no", report_to="none", seed=0, disable_dropout=True, use_cpu=not cuda)
    timer = StepTimer()
    trainer = GRPOTrainer(model=args.model_path, reward_funcs=f1_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    return [b - a for a, b in zip(timer.times, timer.times[1:])]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--batch-size", type=int, default=8, help="prompts per optimizer step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=16, help="TRL per_device_train_batch_size")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--skip", type=int, default=1, help="leading steps left out of the median")
    p.add_argument("--out-dir", default="/tmp/bench_trl")
    p.add_argument("--ours", default=None, help="run_dir of the matching train_search.py run")
    p.add_argument("--json", default=None)
    p.add_argument("--trl-json", default=None, help="report only: TRL step times from an earlier run's --json")
    args = p.parse_args()

    trl_steps = json.load(open(args.trl_json))["trl_step_s"] if args.trl_json else run_trl(args)
    result = {"trl_step_s": trl_steps, "args": vars(args)}
    rows = [("TRL GRPOTrainer", trl_steps)]
    if args.ours:
        ours = [json.loads(line) for line in open(os.path.join(args.ours, "metrics.jsonl")) if line.strip()]
        result["ours_step_s"] = [r["perf/step_s"] for r in ours if "perf/step_s" in r]
        rows.insert(0, ("agentrl train_search.py", result["ours_step_s"]))
    print(f"\n{args.batch_size} prompts x {args.group_size} completions of {args.max_new_tokens} tokens per step; "
          f"median of steps after the first {args.skip}\n")
    print("| trainer | steps timed | step s (median) | steps/s | all steps s |")
    print("| --- | ---: | ---: | ---: | --- |")
    medians = {}
    for name, times in rows:
        timed = times[args.skip:] or times
        medians[name] = statistics.median(timed)
        print(f"| {name} | {len(timed)} | {medians[name]:.2f} | {1 / medians[name]:.3f} | "
              f"{', '.join(f'{t:.2f}' for t in times)} |")
    if args.ours:
        ratio = medians[rows[1][0]] / medians[rows[0][0]]
        result["ours_over_trl_steps_per_s"] = ratio
        print(f"\nsteps/s ratio, ours / TRL: {ratio:.2f}x")
    if args.json:
        json.dump(result, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
