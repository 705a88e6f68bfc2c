"""Parsers and reward of train_search.py: pure functions, specified case by case."""
import pytest

from train_search import exact_match, f1_score, compute_reward, normalize_answer, parse_access, parse_answer, parse_search_query


def test_parser_returns_last_complete_tag():
    assert parse_search_query("<search> first </search> then <search> second </search>") == "second"


def test_parser_strips_white_space_and_ignores_case_of_tag():
    assert parse_answer("<ANSWER>\n  Paris \n</Answer>") == "Paris"


def test_unclosed_tag_is_not_parsed():
    assert parse_answer("<answer> Paris") is None
    assert parse_search_query("<search> who wrote </search") is None


def test_empty_tag_is_none_and_earlier_nonempty_tag_wins():
    assert parse_answer("<answer>   </answer>") is None
    assert parse_answer("<answer> Rome </answer><answer></answer>") == "Rome"


def test_nested_opening_tag_keeps_innermost_content():
    assert parse_search_query("<search> a <search> b </search>") == "b"


def test_interleaved_tags_are_parsed_independently():
    text = "<search> x <answer> y </search> z </answer>"
    assert parse_search_query(text) == "x <answer> y"
    assert parse_answer(text) == "y </search> z"


def test_access_parser():
    assert parse_access("<think>open it</think><access> Ilvan Moresk </access>") == "Ilvan Moresk"
    assert parse_access("no tags at all") is None


def test_normalisation_folds_case_punctuation_articles_and_space():
    assert normalize_answer("  The  Eiffel-Tower, in PARIS! ") == "eiffeltower in paris"
    assert normalize_answer("an apple a day") == "apple day"


def test_exact_match_takes_any_gold_alias():
    assert exact_match("the city of Tarqua", ["Tarqua", "City of Tarqua"]) == 1.0
    assert exact_match("Tarqua city", ["Tarqua"]) == 0.0


def test_f1_is_token_multiset_overlap():
    # pred tokens: [tarqua, city]; gold: [tarqua]; precision 1/2, recall 1 -> F1 2/3
    assert f1_score("Tarqua city", ["Tarqua"]) == pytest.approx(2 / 3)
    # repeated tokens count once per occurrence in both
    assert f1_score("moresk moresk", ["moresk"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert f1_score("nothing shared", ["Tarqua"]) == 0.0


def test_f1_takes_the_best_gold_answer():
    assert f1_score("Pem Varo", ["Varo", "Pem Varo"]) == 1.0


def test_no_answer_scores_zero():
    assert compute_reward(None, ["Tarqua"]) == 0.0
    assert compute_reward("Tarqua", ["Tarqua"]) == 1.0
    assert compute_reward(None, ["Tarqua"], "em") == 0.0


def test_exact_match_reward_gives_no_partial_credit():
    golds = ["Zeltartar", "Zeltartar City", "City of Zeltartar"]
    # What a tiny policy learned to farm under F1: a wrong answer sharing "of" with a gold alias.
    assert round(compute_reward("capital of Lunranmark", golds, "f1"), 2) == 0.33
    assert compute_reward("capital of Lunranmark", golds, "em") == 0.0
    assert compute_reward("the zeltartar city.", golds, "em") == 1.0


def test_a_gold_answer_given_as_one_string_is_one_answer_not_its_characters():
    assert f1_score("James Bond", "James Bond") == 1.0
    assert exact_match("James Bond", "James Bond") == 1.0
    assert compute_reward("James Bond", "James Bond", "em") == 1.0
    assert f1_score("J", "James Bond") == 0.0 and exact_match("J", "J B") == 0.0


def test_one_phrase_for_every_question_farms_f1_and_shows_as_the_top_answer_share():
    """What gemma-3-270m learned on seed 0 (docs/benchmarks.md): `member of` for most questions scores
    F1 0.4 against a gold alias with `of` in it, never exact match; `top_answer_share` names it."""
    from train_search import top_answer_share

    golds = ["Zelga", "Zelga City", "City of Zelga"]
    assert f1_score("member of", golds) == pytest.approx(0.4) and exact_match("member of", golds) == 0.0
    farmed = [{"answer": a} for a in ["member of", "Member of.", "member  of", "Vanzel", None]]
    assert top_answer_share(farmed) == pytest.approx(3 / 5)  # normalised alike; an episode with no answer counts in the total
    assert top_answer_share([{"answer": a} for a in ["Zelga", "Vanzel", "Dorfaul", "Cilun"]]) == pytest.approx(1 / 4)
    assert top_answer_share([{"answer": None}] * 3) == 0.0
