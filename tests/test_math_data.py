import filecmp
import json
import re

from lib import math_data

SMALL = dict(num_train=300, num_dev=40, num_test=50, num_warmstart=60)


def test_same_seed_builds_byte_identical_files(tmp_path):
    a = math_data.build_math_data(str(tmp_path / "a"), seed=3, **SMALL)
    b = math_data.build_math_data(str(tmp_path / "b"), seed=3, **SMALL)
    for split in math_data.SPLITS:
        assert filecmp.cmp(a[split], b[split], shallow=False)


def test_different_seeds_give_different_problems(tmp_path):
    a = math_data.build_math_data(str(tmp_path / "a"), seed=0, **SMALL)
    b = math_data.build_math_data(str(tmp_path / "b"), seed=1, **SMALL)
    assert open(a["train"]).read() != open(b["train"]).read()


def test_splits_have_requested_sizes_and_no_shared_questions(tmp_path):
    paths = math_data.build_math_data(str(tmp_path), seed=0, **SMALL)
    questions = {}
    for split, path in paths.items():
        records = [json.loads(line) for line in open(path)]
        assert len(records) == SMALL[f"num_{split}"]
        questions[split] = {r["question"] for r in records}
    splits = list(questions)
    for i, s in enumerate(splits):
        for t in splits[i + 1:]:
            assert not questions[s] & questions[t], (s, t)


def test_test_split_does_not_depend_on_train_size(tmp_path):
    a = math_data.build_math_data(str(tmp_path / "a"), seed=0, **SMALL)
    b = math_data.build_math_data(str(tmp_path / "b"), seed=0, **{**SMALL, "num_train": 10})
    assert filecmp.cmp(a["test"], b["test"], shallow=False)


def test_worked_steps_are_correct_arithmetic_ending_in_the_gsm8k_answer_line(tmp_path):
    paths = math_data.build_math_data(str(tmp_path), seed=0, **SMALL)
    for line in open(paths["train"]):
        answer = json.loads(line)["answer"]
        *steps, final = answer.split("\n")
        assert re.fullmatch(r"#### \d+", final)
        last = None
        for step in steps:
            a, op, b, result = re.search(r"(\d+) ([-+*]) (\d+) = (\d+)", step).groups()
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(result)
            last = int(result)
        assert last == int(final[5:])
        assert 1 <= len(steps) <= 3 and 0 <= last < 1000


def test_default_dir_is_built_once_under_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    first = math_data.default_math_dir(seed=5)
    assert first.startswith(str(tmp_path))
    stamp = (tmp_path / first / "train.jsonl").stat().st_mtime_ns
    assert math_data.default_math_dir(seed=5) == first
    assert (tmp_path / first / "train.jsonl").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []


def test_texts_for_the_tokenizer_leave_out_held_out_splits(tmp_path):
    paths = math_data.build_math_data(str(tmp_path), seed=0, **SMALL)
    texts = set(math_data.iter_math_texts(str(tmp_path)))
    test_questions = {json.loads(line)["question"] for line in open(paths["test"])}
    assert len(texts) > 0 and not texts & test_questions


def test_large_numbers_take_two_to_four_correct_steps_over_three_and_four_digit_numbers(tmp_path):
    paths = math_data.build_math_data(str(tmp_path), seed=0, numbers="large", **SMALL)
    operands = []
    for line in open(paths["train"]):
        *steps, final = json.loads(line)["answer"].split("\n")
        assert 2 <= len(steps) <= 4
        last = None
        for step in steps:
            a, op, b, result = re.search(r"(\d+) ([-+*]) (\d+) = (\d+)", step).groups()
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(result)
            operands += [int(a), int(b)]
            last = int(result)
        assert last == int(final[5:]) and last >= 0
    # Mostly numbers a model cannot add or multiply in its head: three digits or more.
    assert sum(x >= 100 for x in operands) / len(operands) > 0.6


def test_large_numbers_are_cached_apart_from_the_small_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    small, large = math_data.default_math_dir(seed=5), math_data.default_math_dir(seed=5, numbers="large")
    assert small != large
    assert open(f"{small}/test.jsonl").read() != open(f"{large}/test.jsonl").read()


def test_an_unknown_number_size_is_refused_with_the_choices(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="small"):
        math_data.build_math_data(str(tmp_path), numbers="huge", **SMALL)
