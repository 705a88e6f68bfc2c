"""The embedded tiny model loads like a hub model and is built deterministically."""
import hashlib
import os

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from lib.tiny_model import build_tiny_model

TEXTS = [f"Ilvan Moresk was born in Tarqua in {1800 + i}. Pem Varo founded the Ostrel Guild." for i in range(300)]
SMALL = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, intermediate_size=128)


def _digest(path):
    return {f: hashlib.sha256(open(os.path.join(path, f), "rb").read()).hexdigest() for f in sorted(os.listdir(path))}


def test_same_seed_gives_byte_identical_files(tmp_path):
    a = build_tiny_model(str(tmp_path / "a"), TEXTS, seed=3, **SMALL)
    b = build_tiny_model(str(tmp_path / "b"), TEXTS, seed=3, **SMALL)
    assert _digest(a) == _digest(b)


def test_loads_through_auto_classes_with_chatml_template(tmp_path):
    path = build_tiny_model(str(tmp_path / "m"), TEXTS, seed=0, **SMALL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen2"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id in model.generation_config.eos_token_id
    assert model.config.vocab_size >= len(tokenizer) and model.config.vocab_size % 64 == 0


def test_byte_level_tokenizer_round_trips_unseen_text(tmp_path):
    path = build_tiny_model(str(tmp_path / "m"), TEXTS, seed=0, **SMALL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = "Ünïcode ✓ and <search> zebra </search>\n\ttabs"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


@pytest.mark.slow
def test_a_forks_own_texts_give_a_tokenizer_that_knows_them_cached_apart(monkeypatch, tmp_path):
    from transformers import AutoTokenizer

    from lib import tiny_model

    monkeypatch.setattr(tiny_model, "default_texts", lambda seed=0: list(TEXTS))  # the bundled data, small
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    sql = ["SELECT name FROM employees WHERE salary > 100 ORDER BY name"] * 200
    plain, forked = tiny_model.default_tiny_model_dir(**SMALL), tiny_model.default_tiny_model_dir(extra_texts=sql, **SMALL)
    assert plain != forked and tiny_model.default_tiny_model_dir(extra_texts=sql, **SMALL) == forked  # cached under them
    query = "SELECT name FROM employees"
    pieces = lambda path: len(AutoTokenizer.from_pretrained(path)(query)["input_ids"])  # noqa: E731
    assert pieces(forked) < pieces(plain) / 2
