"""Per-question evaluation records and the paired comparison of a test before and after training."""
import json
import os

import pytest
import torch

from lib.eval_records import paired_difference, read_records, record_evaluation


def episode(question, reward, answer="1"):
    return {"question": question, "gold": "#### 1", "answer": answer, "rewards": torch.tensor([float(reward)]),
            "num_tool_calls": 1, "num_turns": 2, "finish_reason": "answer"}


def test_each_question_is_recorded_with_its_answer_and_reward(tmp_path):
    record_evaluation(str(tmp_path), "test", 0, [episode("a", 1), episode("b", 0, answer=None)])
    rows = read_records(os.path.join(tmp_path, "evals", "test_step0.jsonl"))
    assert [(r["question"], r["reward"], r["answer"], r["tool_calls"]) for r in rows] == [("a", 1.0, "1", 1),
                                                                                          ("b", 0.0, None, 1)]


def test_the_final_test_is_paired_with_the_test_before_training(tmp_path, capsys):
    before = [episode(f"q{i}", i < 3) for i in range(10)]  # 3 of 10 right
    after = [episode(f"q{i}", i < 3 or i in (5, 6, 7)) for i in reversed(range(10))]  # 3 more right, other order
    assert record_evaluation(str(tmp_path), "test", 0, before) == {}
    paired = record_evaluation(str(tmp_path), "test", 40, after)
    assert paired["paired_diff"] == pytest.approx(0.3) and paired["paired_up"] == 3 and paired["paired_down"] == 0
    assert paired["paired_ci95_low"] < 0.3 < paired["paired_ci95_high"]
    assert "0.300 -> 0.600 on the same 10 questions: +0.300" in capsys.readouterr().out
    assert record_evaluation(str(tmp_path), "eval", 40, after) == {}  # dev evaluations are recorded, not compared


def test_pairing_matches_questions_and_unchanged_answers_give_a_zero_width_interval():
    before = [{"question": q, "reward": r} for q, r in [("a", 1.0), ("b", 0.0), ("c", 1.0)]]
    after = [{"question": q, "reward": r} for q, r in [("c", 1.0), ("a", 1.0), ("d", 1.0)]]  # d was never asked before
    paired = paired_difference(before, after)
    assert paired["n"] == 2 and paired["diff"] == 0.0 and paired["ci95_low"] == paired["ci95_high"] == 0.0
    assert paired_difference(before, [])["n"] == 0


def test_a_wider_spread_of_changes_gives_a_wider_interval():
    same = [{"question": str(i), "reward": 0.0} for i in range(100)]
    few = [{"question": str(i), "reward": float(i < 10)} for i in range(100)]
    many = [{"question": str(i), "reward": float(i < 55) - 0.0} for i in range(100)]
    narrow, wide = paired_difference(same, few), paired_difference(same, many)
    assert narrow["ci95_high"] - narrow["ci95_low"] < wide["ci95_high"] - wide["ci95_low"]
    assert json.dumps(wide)  # plain numbers: it goes into metrics.jsonl


def test_items_with_a_category_are_also_compared_within_each(tmp_path, capsys):
    def ep(question, reward, category):
        return {**episode(question, reward), "category": category}
    before = [ep("a", 0, "easy"), ep("b", 0, "easy"), ep("c", 1, "hard"), ep("d", 1, "hard")]
    after = [ep("a", 1, "easy"), ep("b", 1, "easy"), ep("c", 0, "hard"), ep("d", 1, "hard")]
    record_evaluation(str(tmp_path), "test", 0, before)
    assert record_evaluation(str(tmp_path), "test", 5, after)["paired_diff"] == pytest.approx(0.25)
    out = capsys.readouterr().out
    assert "  easy: 0.000 -> 1.000 on the same 2 questions: +1.000" in out
    assert "  hard: 1.000 -> 0.500 on the same 2 questions: -0.500" in out
