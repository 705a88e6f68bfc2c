"""The warm start for any model: keyed on what it trains on, closed with the model's own end-of-turn,
built atomically (a run killed mid-build leaves nothing that the next run loads)."""
import os
import signal
import subprocess
import sys
import textwrap
import time

from transformers import AutoTokenizer

from lib.tiny_model import default_tiny_model_dir
from lib.warm_start import end_of_turn_ids, examples_digest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_digest_changes_with_any_token_or_mask_and_only_with_them():
    demos = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": [4, 5], "loss_mask": [0, 1]}]
    assert examples_digest(demos) == examples_digest([dict(d) for d in demos])
    assert examples_digest(demos) != examples_digest([demos[0], {"input_ids": [4, 6], "loss_mask": [0, 1]}])
    assert examples_digest(demos) != examples_digest([demos[0], {"input_ids": [4, 5], "loss_mask": [1, 1]}])
    assert examples_digest(demos) != examples_digest(demos[::-1])  # the order is what the SFT samples from
    assert examples_digest(demos) != examples_digest([{"input_ids": [1, 2], "loss_mask": [0, 1]},
                                                      {"input_ids": [3, 4, 5], "loss_mask": [1, 0, 1]}])


def test_end_of_turn_is_what_the_chat_template_closes_an_assistant_message_with():
    tokenizer = AutoTokenizer.from_pretrained(default_tiny_model_dir())
    assert tokenizer.convert_ids_to_tokens(end_of_turn_ids(tokenizer)) == ["<|im_end|>"]
    # a template that closes turns with another special token than the tokenizer's EOS
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
    assert tokenizer.convert_ids_to_tokens(end_of_turn_ids(tokenizer)) == ["<|endoftext|>"]
    tokenizer.chat_template = None  # no template: the EOS
    assert end_of_turn_ids(tokenizer) == [tokenizer.eos_token_id]


BUILD = textwrap.dedent("""
    import os, sys, time
    import lib.warm_start as ws
    from lib.tiny_model import default_tiny_model_dir

    train = ws._train
    def slow_train(base, examples, out_dir, **kw):
        open(os.path.join(out_dir, "model.safetensors"), "w").write("half")  # a half-written model
        print("TRAINING", flush=True)
        if os.environ.get("SLOW"):
            time.sleep(600)
        return train(base, examples, out_dir, **kw)
    ws._train = slow_train
    ids = lambda tokenizer: tokenizer("3 + 4 = 7", add_special_tokens=False)["input_ids"] + [2]
    demos = lambda tokenizer: [{"input_ids": ids(tokenizer), "loss_mask": [1] * len(ids(tokenizer))}] * 4
    out = ws.warm_start("test-warm-start", default_tiny_model_dir(), demos, steps=2, lr=1e-3, batch_size=2,
                        warmup_steps=1)
    print("OUT", out, flush=True)
""")


def test_a_warm_start_killed_mid_build_is_rebuilt_by_the_next_run_never_loaded(tmp_path):
    env = {**os.environ, "AGENTRL_CACHE": str(tmp_path), "SLOW": "1", "PYTHONPATH": REPO}
    killed = subprocess.Popen([sys.executable, "-c", BUILD], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and "TRAINING" not in killed.stdout.readline():
            pass
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
    assert not [d for d in os.listdir(tmp_path) if d.startswith("test-warm-start")]  # only a temporary sibling
    env.pop("SLOW")
    done = subprocess.run([sys.executable, "-c", BUILD], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "TRAINING" in done.stdout  # built again, not loaded
    out = done.stdout.split("OUT ")[-1].strip()
    assert os.path.getsize(os.path.join(out, "model.safetensors")) > 1000 and os.path.isfile(
        os.path.join(out, "warm_start.json"))
    again = subprocess.run([sys.executable, "-c", BUILD], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert "TRAINING" not in again.stdout and f"OUT {out}" in again.stdout  # then reused


def test_micro_batches_give_the_gradient_of_one_pass():
    """Rows split across micro-batches (a laptop's memory) train as one pass would: the loss is
    normalised by the whole batch's trained tokens, the gradients summed."""
    import torch
    from transformers import AutoModelForCausalLM

    from lib.warm_start import _micro_batches, accumulate_gradients

    base = default_tiny_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(base)
    texts = ["3 + 4 = 7", "12 apples and 30 pears make 42 fruit", "#### 5", "a longer line of text " * 6]
    batch = [{"input_ids": ids, "loss_mask": [0] * 2 + [1] * (len(ids) - 2)}
             for ids in (tokenizer(t, add_special_tokens=False)["input_ids"] + [2] for t in texts)]
    assert len(_micro_batches(batch, 40)) > 1  # the small budget does split them
    grads, losses = [], []
    for budget in (100_000, 40):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        losses.append(accumulate_gradients(model, batch, tokenizer.pad_token_id, "cpu", budget))
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert abs(losses[0] - losses[1]) < 1e-5 and grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][name], rtol=1e-4, atol=1e-7), name


def _tiny_batch(tokenizer):
    texts = ["3 + 4 = 7", "12 apples and 30 pears make 42 fruit", "#### 5", "a longer line of text " * 6, "1 2"]
    return [{"input_ids": ids, "loss_mask": [0] * 2 + [1] * (len(ids) - 2)}
            for ids in (tokenizer(t, add_special_tokens=False)["input_ids"] + [2] for t in texts)]


def test_rows_grouped_by_length_give_the_gradient_of_rows_in_the_order_drawn():
    """Grouping rows of like length into micro-batches pads less; the summed gradient is the same."""
    import torch
    from transformers import AutoModelForCausalLM

    from lib.warm_start import accumulate_gradients

    base = default_tiny_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(base)
    batch = _tiny_batch(tokenizer)
    grads, losses = [], []
    for grouped in (False, True):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        losses.append(accumulate_gradients(model, batch, tokenizer.pad_token_id, "cpu", 40, group_by_length=grouped))
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert abs(losses[0] - losses[1]) < 1e-5 and grads[0]
    for name, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][name], rtol=1e-4, atol=1e-7), name


def test_the_loss_through_the_chunked_head_is_the_loss_through_hfs_logits():
    """Past FULL_LOGITS_MAX_BYTES of logits the SFT loss goes through lib's chunked LM head on the trained
    positions only; its loss and every gradient are those of HF's full logits with a masked cross-entropy
    (bench/bench_sft_memory.py: the memory it saves). A weighted mask (0.5) counts as a weight, as the
    full-logit loss counts it. Below the limit the loss is HF's own, bit for bit."""
    import torch
    from transformers import AutoModelForCausalLM

    import lib.warm_start as ws

    base = default_tiny_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(base)
    batch = _tiny_batch(tokenizer)
    batch[0] = dict(batch[0], loss_mask=[0, 0] + [0.5] * (len(batch[0]["input_ids"]) - 2))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    reference = 0.0
    num_targets = sum(sum(ex["loss_mask"][1:]) for ex in batch)
    for ex in batch:
        ids = torch.tensor([ex["input_ids"]])
        logits = model(input_ids=ids).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
        part = (nll * torch.tensor(ex["loss_mask"][1:], dtype=torch.float32)).sum() / num_targets
        part.backward()
        reference += part.item()
    reference_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    old = ws.FULL_LOGITS_MAX_BYTES, ws.HEAD_CHUNK_TOKENS
    for limit, chunk in ((0, 7), (old[0], old[1])):  # the chunked head (several chunks even on these rows), HF's
        ws.FULL_LOGITS_MAX_BYTES, ws.HEAD_CHUNK_TOKENS = limit, chunk
        model.zero_grad(set_to_none=True)
        try:
            loss = ws.accumulate_gradients(model, batch, tokenizer.pad_token_id, "cpu", 40)
        finally:
            ws.FULL_LOGITS_MAX_BYTES, ws.HEAD_CHUNK_TOKENS = old
        assert abs(loss - reference) < 1e-5, limit
        for name, param in model.named_parameters():
            assert torch.allclose(param.grad, reference_grads[name], rtol=1e-4, atol=1e-7), (limit, name)


def test_a_model_whose_logits_are_more_than_the_head_is_refused_not_trained_on_other_log_probs():
    """Gemma 2 soft-caps its final logits and some heads carry a bias: lib's chunked head computes
    neither, so the warm start and the actor (PolicyForward) say so instead of training another model."""
    import pytest
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from lib.logprobs import PolicyForward, check_plain_head

    gemma2 = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    with pytest.raises(ValueError, match="final_logit_softcapping=30"):
        check_plain_head(gemma2)
    with pytest.raises(ValueError, match="soft-caps its logits"):
        PolicyForward(gemma2)
    gemma2.config.final_logit_softcapping = None
    check_plain_head(gemma2)  # without it the head is plain
    gemma2.lm_head.bias = torch.nn.Parameter(torch.zeros(64))
    with pytest.raises(ValueError, match="has a bias"):
        check_plain_head(gemma2)


def test_reproduced_counts_the_examples_whose_every_span_token_is_the_models_greedy_choice(tmp_path):
    """The warm start's check: an example counts when the model's argmax, given the true tokens before,
    is each token of every span; one wrong token in a span, and it does not; examples without spans are
    not drawn. The model is taught a few sequences first (a random one only repeats a token, and a check
    reading the logits one position off would pass on its repeats)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lib.warm_start import reproduced, sft_warm_start

    base = default_tiny_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(base)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    taught = [encode(t) for t in ["one two three four five six seven", "red green blue black white", "1 2 3 4 5 6 7"]]
    model_dir = sft_warm_start(base, [{"input_ids": ids, "loss_mask": [1] * len(ids)} for ids in taught],
                               str(tmp_path / "taught"), steps=60, lr=3e-3, batch_size=3, warmup_steps=5)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def argmax_after(ids):
        with torch.no_grad():
            return int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())

    examples = []
    for ids in taught:  # spans: token 2 and the last two, each the taught model's greedy choice
        assert all(argmax_after(ids[:i]) == ids[i] for i in (2, len(ids) - 2, len(ids) - 1))
        examples.append({"input_ids": ids, "loss_mask": [1] * len(ids), "spans": [(2, 3), (len(ids) - 2, len(ids))]})
        assert all(a != b for a, b in zip(ids, ids[1:]))  # no repeats: reading one position off sees other tokens
    wrong = [dict(examples[0], input_ids=list(examples[0]["input_ids"])) for _ in range(2)]
    wrong[0]["input_ids"][2] = taught[1][2]  # a one-token span's token, another word
    wrong[1]["input_ids"][-1] = taught[1][-1]  # a span's last token
    plain = {"input_ids": taught[1], "loss_mask": [1] * len(taught[1])}  # no spans: not drawn
    assert reproduced(model_dir, examples + wrong + [plain], "spans", device="cpu") == (3, 5)
    assert reproduced(model_dir, examples + wrong, "spans", limit=2, device="cpu")[1] == 2
    assert reproduced(model_dir, [plain], "spans", device="cpu") == (0, 0)


def test_a_stage_1_that_fails_its_check_trains_on_and_stage_2_goes_on_from_there(
        tmp_path, monkeypatch, capsys):
    import json

    from lib.warm_start import warm_start_stages

    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    ids = lambda tokenizer: tokenizer("3 + 4 = 7", add_special_tokens=False)["input_ids"] + [2]  # noqa: E731
    demos = lambda tokenizer, direct_frac=0.0: [{"input_ids": ids(tokenizer), "loss_mask": [1] * len(ids(tokenizer))}] * 4  # noqa: E731,E501
    for verdicts in ([False, False, True], [False] * 3, [True]):
        checked = []

        def check(model_dir):
            checked.append(model_dir)
            return verdicts[len(checked) - 1]
        out = warm_start_stages(f"stages-{len(verdicts)}-{verdicts[-1]}", default_tiny_model_dir(), demos, steps=2,
                                lr=1e-3, batch_size=2, seed=0, direct_steps=2, direct_lr=1e-3, direct_frac=0.5,
                                what_direct="stage 2", stage1_ok=check, more_rounds=2)
        assert len(checked) == len(verdicts) and len(set(checked)) == len(checked)  # a new build each time
        settings = [json.load(open(os.path.join(d, "warm_start.json"))) for d in checked]
        assert settings[0]["base"] == default_tiny_model_dir() and settings[0]["steps"] == 2
        for before, after in zip(settings, settings[1:]):  # each failed build trained on, half the steps, from
            assert after["base"] == checked[settings.index(before)] and after["steps"] == 1  # where it stopped
        assert json.load(open(os.path.join(out, "warm_start.json")))["base"] == checked[-1]  # stage 2 from the last
        said = capsys.readouterr().out
        assert said.count("failed the check above: training it 1 steps more") == len(verdicts) - 1
        assert ("after 2 rounds of 1 steps more it fails the check still; going on from it" in said) == (
            verdicts == [False] * 3)
