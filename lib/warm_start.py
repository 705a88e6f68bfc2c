"""SFT warm start on successful trajectories, for the embedded tiny model and for any model by name
or folder.

A model that never writes the task's tool call or answer format gives GRPO all-equal rewards: the
embedded tiny model (random weights) never does, and a small pretrained model such as
SmolLM2-135M-Instruct never calls its tool. Each training script builds demonstrations for its own
task (token ids + a loss mask that is 1 on the tokens the model should produce), rendered with the
model's own chat template, and calls `warm_start`; the result is cached under a key of what it
trains on (a hash of the demonstrations themselves), the base model and the SFT settings.
"""
import hashlib
import json
import math
import os
import random
import time

import torch
from tqdm import tqdm

from lib.cache import build_once, cache_root
from lib.logprobs import check_plain_head, head_logprobs

# The SFT loss of a micro-batch: through HF's forward while its full fp32 logits take at most this many
# bytes, else through lib's chunked head on the trained positions only. HF's full logits, with their
# log-softmax and gradients, took 130 GB of an H200 at Gemma 3's 262k vocabulary (docs/benchmarks.md,
# bench/bench_sft_memory.py). Small ones keep HF's path for a measured reason: the embedded tiny model
# learns to copy answers out of results as a phase change near its 1,200 SFT steps, and the chunked
# head's other float summation (the same loss to 1e-7, gradients to 1e-4) sent one quick-start build past it without
# copying (test EM 0.367 -> 0.003 after stage 1, then 0.017 instead of 0.343 after GRPO).
FULL_LOGITS_MAX_BYTES = 1 << 30
HEAD_CHUNK_TOKENS = 1024  # trained positions a chunk of the chunked head: [1024, vocab] fp32 logits


def examples_digest(examples: list[dict]) -> str:
    """A hash of what an SFT trains on: every example's token ids and loss mask, in order. Anything that
    changes the demonstrations (a prompt, a tool's answer, a helper or constant a fork edits)
    changes it; a comment or docstring edit does not."""
    h = hashlib.sha1()
    for ex in examples:
        h.update(json.dumps([ex["input_ids"], ex["loss_mask"]], separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def end_of_turn_ids(tokenizer) -> list[int]:
    """The token(s) that the model's chat template closes an assistant message with (ChatML's
    `<|im_end|>`, Llama 3's `<|eot_id|>`, Gemma's `<end_of_turn>`): what a demonstration's turn must
    end with so that the model learns to stop where the server's stop ids stop it. Found by templating
    one assistant message and reading the first special token after its text; without a chat
    template (or none after the text), the tokenizer's EOS."""
    fallback = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if not getattr(tokenizer, "chat_template", None):
        return fallback
    marker = "MARKER_4b1d"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
                                             tokenize=False)
    except Exception:  # a template that needs other roles or fields: the EOS is the safe answer
        return fallback
    after = text[text.rfind(marker) + len(marker):]
    special = set(tokenizer.all_special_ids) | {i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special}
    for token_id in tokenizer(after, add_special_tokens=False)["input_ids"]:
        if token_id in special:
            return [token_id]
    return fallback


def steps_and_lr(steps: int | None, lr: float | None, embedded: bool, embedded_steps: int) -> tuple[int, float]:
    """A script's warm-start settings with their defaults filled in: None steps means `embedded_steps`
    for the embedded tiny model (random weights: it needs one) and none for a pretrained model (it
    warm-starts only when asked); None lr means 2e-3 for the tiny model, 5e-5 for a pretrained one."""
    return (steps if steps is not None else (embedded_steps if embedded else 0),
            lr if lr is not None else (2e-3 if embedded else 5e-5))


def warm_start(name: str, base_model_dir: str, build_examples, *, steps: int, lr: float, batch_size: int,
               seed: int = 0, warmup_steps: int = 20, what: str = "warm start") -> str:
    """`base_model_dir` after `steps` SFT steps on `build_examples(tokenizer)` (built with the base
    model's own tokenizer and chat template), or `base_model_dir` itself when `steps` is 0. Cached under
    `name`, keyed on the base, the SFT settings and a hash of the examples: a fork that edits its
    demonstrations gets a new warm start, never the old one. Built atomically, under a lock: a run
    killed mid-build leaves nothing that a later run loads, and the next run builds it again."""
    from transformers import AutoTokenizer

    if steps <= 0:
        return base_model_dir
    t0 = time.time()
    print(f"{what}: building the demonstrations with {base_model_dir}'s tokenizer", flush=True)
    examples = build_examples(AutoTokenizer.from_pretrained(base_model_dir))
    key = {"base": base_model_dir, "steps": steps, "lr": lr, "batch": batch_size, "seed": seed,
           "warmup": warmup_steps, "examples": examples_digest(examples)}
    out = warm_start_dir(name, key)
    if os.path.isdir(out):
        print(f"{what}: {out} (cached)", flush=True)
        return out
    tokens = sum(sum(ex["loss_mask"]) for ex in examples)
    print(f"{what}: {len(examples)} demonstrations ({tokens} trained tokens), {steps} SFT steps, lr {lr:g}, "
          f"batch {batch_size}", flush=True)
    sft_warm_start(base_model_dir, examples, out, steps=steps, lr=lr, batch_size=batch_size,
                   warmup_steps=warmup_steps, seed=seed, what=what)
    print(f"{what} built in {time.time() - t0:.0f} s: {out}", flush=True)
    return out


def warm_start_stages(name: str, base_model_dir: str, build_examples, *, steps: int, lr: float, batch_size: int,
                      seed: int, direct_steps: int, direct_lr: float, direct_frac: float, what_direct: str,
                      stage1_ok=None, more_rounds: int = 3) -> str:
    """A warm start in two stages: `steps` on `build_examples(tokenizer)`, then (when both step counts
    are above 0) `direct_steps` from there on `build_examples(tokenizer, direct_frac)`, whose fraction
    of demonstrations skip the work (answer from memory, no worked steps), cached as `{name}-direct`.
    The first stage's behaviour is learned first and kept: mixed in from the start, the direct
    demonstrations kept it from forming (docs/benchmarks.md). `stage1_ok(model_dir) -> bool`, if given,
    checks stage 1's model: one that fails it trains on from where it stopped, in rounds of half as many
    steps (each a new warm-up and schedule and another data order, cached as `{name}-more`), until it
    passes or `more_rounds` rounds are done; stage 2 goes on from the last (said). Stage-1 builds of the
    tiny search model that had missed copying passed after one round in two tries of three; a new build
    from another seed missed it too (docs/benchmarks.md)."""
    two = steps > 0 and direct_steps > 0
    what = "warm start, stage 1 of 2" if two else "warm start"
    out = warm_start(name, base_model_dir, build_examples, steps=steps, lr=lr, batch_size=batch_size, seed=seed,
                     what=what)
    more, rounds = max(1, steps // 2), 0
    while stage1_ok is not None and steps > 0 and not stage1_ok(out):
        if rounds == more_rounds:
            print(f"{what}: after {rounds} rounds of {more} steps more it fails the check still; going on from it",
                  flush=True)
            break
        rounds += 1
        print(f"{what}: its model failed the check above: training it {more} steps more (round {rounds} of "
              f"at most {more_rounds})", flush=True)
        out = warm_start(f"{name}-more", out, build_examples, steps=more, lr=lr, batch_size=batch_size,
                         seed=seed + 1000 * rounds, what=f"{what}, {more} steps more")
    if not two:
        return out
    return warm_start(f"{name}-direct", out, lambda tokenizer: build_examples(tokenizer, direct_frac),
                      steps=direct_steps, lr=direct_lr, batch_size=batch_size, warmup_steps=min(20, direct_steps // 10),
                      seed=seed + 1, what=what_direct)


def reproduced(model_dir: str, examples: list[dict], spans_key: str, *, limit: int = 150, seed: int = 0,
               device: str | None = None) -> tuple[int, int]:
    """A warm start's check, teacher-forced: of up to `limit` of the `examples` that carry spans
    `ex[spans_key] = [(start, end), ...]` (drawn with `seed`), how many the model at `model_dir` reproduces
    there, every token of input_ids[start:end] its greedy choice given the true tokens before it. A final
    SFT loss does not tell whether a small skill formed (the tiny search model's copying: docs/benchmarks.md);
    this tells it in seconds."""
    from transformers import AutoModelForCausalLM

    pool = [ex for ex in examples if ex.get(spans_key)]
    if not pool:
        return 0, 0
    sample = random.Random(seed).sample(pool, min(limit, len(pool)))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    right = 0
    with torch.no_grad():
        for ex in sample:
            # the logits of the positions that predict the spans' tokens only (a large vocabulary's logits of
            # every position would be [length, vocab] fp32)
            targets = torch.tensor([i for start, end in ex[spans_key] for i in range(start, end)], device=device)
            ids = torch.tensor([ex["input_ids"][:int(targets.max()) + 1]], device=device)
            logits = model(input_ids=ids, logits_to_keep=targets - 1).logits[0]
            right += bool(torch.equal(logits.argmax(-1), ids[0, targets]))
    del model
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()  # the inference server started next on this GPU finds the memory free
    return right, len(sample)


def warm_start_dir(name: str, settings: dict) -> str:
    """The cache directory of a warm start shaped by `settings`. Paths inside the cache (the base
    model, the data, stage 1) enter the key relative to it: their names already say what they hold,
    so a cache that was moved or built on another machine and copied here is found, not rebuilt."""
    root = cache_root().rstrip("/") + "/"
    portable = {k: "<cache>/" + v[len(root):] if isinstance(v, str) and v.startswith(root) else v
                for k, v in settings.items()}
    key = hashlib.sha1(json.dumps(portable, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return os.path.join(cache_root(), f"{name}-{key}")


def sft_warm_start(
    base_model_dir: str,
    examples: list[dict],
    out_dir: str,
    *,
    steps: int = 300,
    lr: float = 2e-3,
    batch_size: int = 16,
    warmup_steps: int = 20,
    seed: int = 0,
    num_threads: int | None = None,
    device: str | None = None,
    callback=None,
    callback_every: int = 0,
    what: str = "warm start (SFT)",
) -> str:
    """Train `base_model_dir` on `examples` ({"input_ids": [...], "loss_mask": [...]}) and save the
    result (model + tokenizer, HF format) to `out_dir`. Returns `out_dir`; reuses it if present.
    `callback(step, model, tokenizer)` runs every `callback_every` steps (learning curves in bench/).
    `device`: None = cuda when there is one (a GPU box builds the embedded default in about a minute).
    `what` names the progress bar."""
    # built once, like every cached directory: a second process asking for it waits, then reuses it
    return build_once(out_dir, lambda tmp: _train(
        base_model_dir, examples, tmp, steps=steps, lr=lr, batch_size=batch_size, warmup_steps=warmup_steps,
        seed=seed, num_threads=num_threads, device=device, callback=callback, callback_every=callback_every,
        what=what))


def _micro_batches(rows: list[dict], max_tokens: int) -> list[list[dict]]:
    """Consecutive groups of rows whose padded size (rows x longest) stays within `max_tokens` (at least one row)."""
    groups, current = [], []
    for row in rows:
        longest = max([len(r["input_ids"]) for r in current] + [len(row["input_ids"])])
        if current and longest * (len(current) + 1) > max_tokens:
            groups, current = groups + [current], []
        current.append(row)
    return groups + [current]


def accumulate_gradients(model, batch: list[dict], pad_id: int, device, tokens_per_mb: int,
                         group_by_length: bool = True) -> float:
    """Backward of the SFT loss of `batch` (mean NLL over its trained tokens), in micro-batches of at
    most `tokens_per_mb` padded tokens whose gradients add up to the one-pass gradient. Returns the loss.
    Rows are grouped by length first: the sum is the same, and rows of like length pad less
    (bench/bench_warm_start.py)."""
    num_targets = max(1, sum(sum(ex["loss_mask"][1:]) for ex in batch))
    loss = 0.0
    if group_by_length:
        batch = sorted(batch, key=lambda ex: len(ex["input_ids"]))
    vocab = model.get_output_embeddings().weight.shape[0]
    for rows in _micro_batches(batch, tokens_per_mb):
        max_len = max(len(ex["input_ids"]) for ex in rows)
        input_ids = torch.full((len(rows), max_len), pad_id, dtype=torch.long)
        loss_mask = torch.zeros((len(rows), max_len), dtype=torch.float32)
        attention_mask = torch.zeros((len(rows), max_len), dtype=torch.long)
        for i, ex in enumerate(rows):
            n = len(ex["input_ids"])
            input_ids[i, :n] = torch.tensor(ex["input_ids"])
            loss_mask[i, :n] = torch.tensor(ex["loss_mask"], dtype=torch.float32)
            attention_mask[i, :n] = 1
        input_ids, loss_mask, attention_mask = input_ids.to(device), loss_mask.to(device), attention_mask.to(device)
        if input_ids.numel() * vocab * 4 <= FULL_LOGITS_MAX_BYTES:
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), input_ids[:, 1:].reshape(-1), reduction="none"
            ).view(len(rows), max_len - 1)
            part = (nll * loss_mask[:, 1:]).sum() / num_targets
        else:
            part = _chunked_head_loss(model, input_ids, attention_mask, loss_mask[:, 1:]) / num_targets
        part.backward()
        loss += part.item()
    return loss


def _chunked_head_loss(model, input_ids, attention_mask, weights):
    """The summed NLL of the trained positions (`weights` [rows, length - 1], nonzero where trained),
    their hidden states put through lib's chunked LM head (lib.logprobs.head_logprobs), HEAD_CHUNK_TOKENS
    at a time: no [rows, length, vocab] tensor is built."""
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                 use_cache=False).last_hidden_state
    trained = weights != 0
    logprobs, _ = head_logprobs(model.get_output_embeddings(), hidden[:, :-1][trained], input_ids[:, 1:][trained],
                                chunk=HEAD_CHUNK_TOKENS)
    return -(logprobs * weights[trained]).sum()


def _train(base_model_dir, examples, out_dir, *, steps, lr, batch_size, warmup_steps, seed, num_threads, device,
           callback, callback_every, max_tokens_per_mb=None, what="warm start (SFT)"):
    """The SFT itself; the model, tokenizer and warm_start.json are written into `out_dir`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not examples:
        raise ValueError("sft_warm_start got no examples; build demonstrations from the warm-start split first")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if num_threads:
        torch.set_num_threads(num_threads)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    # trained in fp32, saved in the base's own dtype (a bf16 release stays bf16 for the server and trainer)
    config = AutoConfig.from_pretrained(base_model_dir)
    base_dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)).replace("torch.", "")
    save_dtype = getattr(torch, base_dtype) if base_dtype in ("bfloat16", "float16") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32).to(device)
    tokenizer = AutoTokenizer.from_pretrained(base_model_dir)
    check_plain_head(model)  # past FULL_LOGITS_MAX_BYTES the loss goes through lib's chunked head
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))

    def lr_at(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    # Rows go through the model in micro-batches of at most this many (padded) tokens, their gradients
    # summed: the activations of 16 rows of 700 tokens of a 135M model take over 20 GB in fp32, more
    # than a laptop has. The loss is normalised by the whole batch's trained tokens, as in one pass.
    # On a CPU small ones are also faster (their activations stay in cache; bench/bench_warm_start.py).
    # On a GPU: 16,384 tokens at SmolLM2's 49k vocabulary, fewer at a larger one (6,144 at Qwen's 152k,
    # 4,096 at Gemma 3's 262k), sizes set when HF's full fp32 logits bounded them. Each of these is past
    # FULL_LOGITS_MAX_BYTES of logits (but the tiny model's), so its head is chunked now and the decoder's
    # activations bound them; the sizes are kept as measured.
    vocab = model.get_output_embeddings().weight.shape[0]
    gpu_tokens = max(1024, min(16384, (1 << 32) // (4 * vocab) // 1024 * 1024))
    tokens_per_mb = max_tokens_per_mb or (gpu_tokens if str(device).startswith("cuda") else 1024)
    progress = tqdm(range(steps), desc=what, mininterval=5)
    for step in progress:
        batch = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        optimizer.zero_grad(set_to_none=True)
        loss = accumulate_gradients(model, batch, pad_id, device, tokens_per_mb)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        progress.set_postfix(loss=f"{loss:.3f}", refresh=False)
        if callback is not None and callback_every and (step + 1) % callback_every == 0:
            model.eval()
            callback(step + 1, model, tokenizer)
            model.train()

    model.to("cpu", dtype=save_dtype).save_pretrained(out_dir, safe_serialization=True)
    del optimizer
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()  # an inference server started next on this GPU finds the memory free
    tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "warm_start.json"), "w") as f:
        json.dump({"base": base_model_dir, "steps": steps, "lr": lr, "batch_size": batch_size, "final_loss": loss,
                   "num_examples": len(examples)}, f)
