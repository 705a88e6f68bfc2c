"""lib.wiki_data builds a deterministic fictional encyclopedia (Search-R1 corpus format) and
multi-hop questions whose hop fields describe a successful search, in disjoint splits."""
import difflib
import json
import os
import re
import time
from collections import Counter

import pytest

from lib.wiki_data import SYLLABLES, build_wiki_data, default_wiki_dir, iter_wiki_texts, parse_hops, read_jsonl, split_sizes

SMALL = dict(num_passages=2000, num_questions=1000)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return build_wiki_data(str(tmp_path_factory.mktemp("wiki")), seed=0, **SMALL)


@pytest.fixture(scope="module")
def corpus(small):
    return {row["id"]: row["contents"] for row in read_jsonl(small["corpus"])}


@pytest.fixture(scope="module")
def questions(small):
    return {split: read_jsonl(small[split]) for split in ("warmstart", "train", "dev", "test")}


def _title(contents: str) -> str:
    return contents.split("\n", 1)[0].strip('"')


def _text(contents: str) -> str:
    return contents.split("\n", 1)[1]


def test_same_seed_gives_byte_identical_files(tmp_path, small):
    again = build_wiki_data(str(tmp_path), seed=0, **SMALL)
    for name, path in small.items():
        with open(path, "rb") as a, open(again[name], "rb") as b:
            assert a.read() == b.read(), name


def test_another_seed_gives_another_world(tmp_path, small):
    other = build_wiki_data(str(tmp_path), seed=1, **SMALL)
    with open(small["corpus"], "rb") as a, open(other["corpus"], "rb") as b:
        assert a.read() != b.read()


def test_counterfactual_world_has_the_same_names_and_other_facts(tmp_path, small, corpus):
    cf = build_wiki_data(str(tmp_path), seed=1, names_seed=0, **SMALL)
    cf_corpus = {row["id"]: row["contents"] for row in read_jsonl(cf["corpus"])}
    assert {_title(c) for c in cf_corpus.values()} == {_title(c) for c in corpus.values()}
    # Facts are redrawn: the fact sentences of one name mostly differ between the two worlds.
    facts = lambda cor: {(_title(c), _text(c)) for c in cor.values() if " in the country of " in c}
    base, other = facts(corpus), facts(cf_corpus)
    assert len(base) > 20 and len(base & other) < 0.3 * len(base)
    # The same question often exists in both worlds, with another answer: it cannot be memorised.
    real = {q["question"]: q["answer"] for q in read_jsonl(small["train"]) + read_jsonl(small["dev"])}
    shared = [q for q in read_jsonl(cf["train"]) if q["question"] in real]
    assert len(shared) > 20
    assert sum(q["answer"] == real[q["question"]] for q in shared) < 0.2 * len(shared)
    again = build_wiki_data(str(tmp_path / "again"), seed=1, names_seed=0, **SMALL)
    with open(cf["corpus"], "rb") as a, open(again["corpus"], "rb") as b:
        assert a.read() == b.read()


def test_corpus_has_exactly_num_passages_in_search_r1_format(small):
    rows = read_jsonl(small["corpus"])
    assert len(rows) == SMALL["num_passages"]
    assert [row["id"] for row in rows] == [str(i) for i in range(len(rows))]
    for row in rows:
        assert set(row) == {"id", "contents"}
        assert re.fullmatch(r'"[^"\n]+"\n[^\n]+', row["contents"]), row


def test_passages_are_one_short_sentence_that_names_their_entity(corpus):
    for contents in corpus.values():
        title, text = _title(contents), _text(contents)
        assert len(text.split()) <= 40
        assert text.endswith(".") and text.count(". ") == 0
        assert title in text


def test_passages_of_one_entity_are_consecutive(small):
    titles = [_title(row["contents"]) for row in read_jsonl(small["corpus"])]
    runs = [t for i, t in enumerate(titles) if i == 0 or titles[i - 1] != t]
    assert len(runs) == len(set(titles))


def test_names_are_built_from_the_syllable_list(corpus):
    syllables = "|".join(sorted(SYLLABLES, key=len, reverse=True))
    english = {"The", "Guild", "Society", "Company", "Academy", "Order", "League", "Club", "Circle", "Song", "Tale",
               "Chronicle", "Letters", "Garden", "Voyage", "Mirror", "River", "Lantern", "Winter"}
    for title in {_title(c) for c in corpus.values()}:
        for word in title.split():
            if word not in english:
                assert re.fullmatch(f"(?:{syllables})+(?:ia|land|mark)?", word.lower()), (title, word)


def test_a_fifth_of_the_entities_have_a_twin_with_a_similar_name(corpus):
    titles = sorted({_title(c) for c in corpus.values()})
    by_rest = {}
    for title in titles:
        words = title.split()
        for i in range(len(words)):
            by_rest.setdefault((len(words), i, tuple(words[:i] + words[i + 1:])), []).append(words[i])
    twins = set()
    for (_, _, rest), words in by_rest.items():
        for a in words:
            for b in words:
                if a < b and difflib.SequenceMatcher(None, a, b).ratio() >= 0.6:
                    twins.update({a, b})
    with_twin = sum(any(w in twins for w in t.split()) for t in titles)
    assert with_twin / len(titles) >= 0.2


def test_split_sizes_come_from_one_question_budget():
    assert split_sizes(10000) == {"warmstart": 1000, "dev": 300, "test": 500, "train": 8200}
    assert sum(split_sizes(777).values()) == 777


def test_splits_have_their_sizes_and_no_question_is_in_two_splits(questions):
    assert {s: len(q) for s, q in questions.items()} == split_sizes(SMALL["num_questions"])
    texts = [q["question"] for qs in questions.values() for q in qs]
    assert len(texts) == len(set(texts))


def test_warmstart_entities_are_disjoint_from_the_other_splits(questions, corpus):
    titles = {_title(c) for c in corpus.values()}

    def entities(split):
        out = set()
        for q in questions[split]:
            out.update(_title(corpus[pid]) for pid in q["support"])
            out.update({q["hop_answers"][-1]} & titles)  # the answer, unless a year or an occupation
        return out

    others = entities("train") | entities("dev") | entities("test")
    assert not entities("warmstart") & others


def test_hop_mix_is_mostly_one_and_two_hops(questions):
    hops = Counter(q["hops"] for qs in questions.values() for q in qs)
    total = sum(hops.values())
    assert set(hops) == {1, 2, 3, 4}
    assert abs(hops[1] / total - 0.50) < 0.05
    assert abs(hops[2] / total - 0.35) < 0.05
    assert abs((hops[3] + hops[4]) / total - 0.15) < 0.04


def test_hops_option_draws_only_those_chain_lengths_over_the_same_corpus(tmp_path, small):
    paths = build_wiki_data(str(tmp_path), seed=0, hops=(2, 3, 4), **SMALL)
    hops = Counter(q["hops"] for s in ("warmstart", "train", "dev", "test") for q in read_jsonl(paths[s]))
    assert set(hops) == {2, 3, 4}
    assert min(hops.values()) / max(hops.values()) > 0.8  # uniform over the three
    assert open(paths["corpus"]).read() == open(small["corpus"]).read()  # only the questions change


def test_hops_option_is_cached_apart_and_bad_counts_are_refused(tmp_path):
    mix = default_wiki_dir(seed=3, cache_dir=str(tmp_path), num_passages=500, num_questions=100)
    hard = default_wiki_dir(seed=3, cache_dir=str(tmp_path), num_passages=500, num_questions=100, hops=(3, 4))
    assert hard != mix and hard.endswith("-hops34")
    assert {q["hops"] for q in read_jsonl(os.path.join(hard, "test.jsonl"))} <= {3, 4}
    with pytest.raises(ValueError, match="hop counts must be among"):
        default_wiki_dir(seed=3, cache_dir=str(tmp_path), hops=(5,))
    assert parse_hops("2,3,4") == parse_hops((2, 3, 4)) == parse_hops("(2, 3, 4)") == (2, 3, 4)  # fire makes tuples
    assert parse_hops("") == ()
    with pytest.raises(ValueError, match="comma-separated"):
        parse_hops("two")


def test_question_records_carry_answers_and_per_hop_fields(questions):
    for q in questions["train"]:
        assert set(q) == {"id", "question", "answer", "golden_answers", "hops", "support", "hop_queries", "hop_answers"}
        assert q["answer"] == q["golden_answers"] and q["answer"][0] == q["hop_answers"][-1]
        assert len(q["support"]) == len(q["hop_queries"]) == len(q["hop_answers"]) == q["hops"]
        assert q["question"].endswith("?") and len(q["question"].split()) <= 40


def test_each_support_passage_states_its_hop_and_the_hops_chain(questions, corpus):
    for q in questions["train"] + questions["warmstart"]:
        for i, (pid, query, answer) in enumerate(zip(q["support"], q["hop_queries"], q["hop_answers"])):
            title, text = _title(corpus[pid]), _text(corpus[pid])
            assert answer in text, (q, text)
            assert title in query  # the hop's query names the entity whose page holds the fact
            if i > 0:
                assert title == q["hop_answers"][i - 1]  # hop i is about hop i-1's answer
        assert q["hop_answers"][-1] not in q["question"]


def test_default_wiki_dir_builds_once_under_the_cache(tmp_path):
    out = default_wiki_dir(seed=3, cache_dir=str(tmp_path), num_passages=500, num_questions=100)
    assert "seed3" in out and "p500" in out and "q100" in out
    stamp = os.path.getmtime(os.path.join(out, "corpus.jsonl"))
    assert default_wiki_dir(seed=3, cache_dir=str(tmp_path), num_passages=500, num_questions=100) == out
    assert os.path.getmtime(os.path.join(out, "corpus.jsonl")) == stamp
    assert os.listdir(tmp_path) == [os.path.basename(out)]  # no temporary build folder left


def test_default_cache_root_is_the_agentrl_cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    out = default_wiki_dir(seed=5, num_passages=300, num_questions=50)
    assert os.path.dirname(out) == str(tmp_path)


def test_default_size_builds_in_seconds(tmp_path):
    start_s = time.perf_counter()
    paths = build_wiki_data(str(tmp_path))
    assert time.perf_counter() - start_s < 10
    assert sum(1 for _ in open(paths["corpus"])) == 20000
    assert sum(len(read_jsonl(paths[s])) for s in ("warmstart", "train", "dev", "test")) == 10000


def test_tokenizer_texts_cover_passages_but_not_held_out_questions(small, questions):
    texts = list(iter_wiki_texts(os.path.dirname(small["corpus"])))
    assert texts[0] == json.loads(open(small["corpus"]).readline())["contents"]
    assert questions["train"][0]["question"] in texts
    assert questions["dev"][0]["question"] not in texts and questions["test"][0]["question"] not in texts
