"""Properties that hold for any input, checked with Hypothesis: the retrieval server answers every
body with a 2xx or a 4xx, and the parsers and rewards of train_search.py and train_reflect.py never
raise, return values of the right type and range, and finish in bounded time on adversarial text.

Three bugs these properties found in the scripts (quadratic tag parsing, unbounded exponents in
to_fraction, F1 0 where exact match is 1) are fixed; their tests below keep them fixed.
"""
import contextlib
import json
import re
import signal
import string
from fractions import Fraction

import pytest
import requests
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lib.retrieval import launch_retrieval_server
from train_reflect import extract_answer, last_boxed, reward_fn, to_fraction
from train_search import (compute_reward, exact_match, f1_score, normalize_answer, parse_access, parse_answer,
                          parse_search_query)

# deadline=None: some examples are 100 KB or a server round trip; time bounds are asserted explicitly.
# database=None: nothing written into the checkout (.hypothesis/).
FAST = settings(max_examples=100, deadline=None, database=None)
SERVER = settings(max_examples=100, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
LARGE = settings(max_examples=6, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
REQUEST_TIMEOUT_S = 10  # per request; the tiny corpus answers in milliseconds, a stalled body in 2 s
LARGE_CHARS = 100_000
TIME_BOUND_S = 2.0  # for one call on LARGE_CHARS of text; they take 1-250 ms here


@contextlib.contextmanager
def time_limit(seconds: float):
    """TimeoutError when the block runs past `seconds`. SIGALRM: Python code and regex matching are
    interrupted; a single C call that never checks for signals (a huge int power) is not."""
    def expire(signum, frame):
        raise TimeoutError(f"did not finish within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# --- strategies ---
# Any code point, lone surrogates included (JSON can carry them as "\ud800").
odd_text = st.text(st.characters(exclude_categories=()), max_size=20)
long_text = st.builds(lambda unit, n: unit * n, st.text(min_size=1, max_size=4), st.integers(500, 3000))
big_ints = st.integers(-10**4000, 10**4000)  # json.dumps writes at most 4300 digits; longer ones are raw bodies
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), big_ints, st.floats(), odd_text, long_text)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=5)
                           | st.dictionaries(odd_text, inner, max_size=5), max_leaves=20)
urls = st.builds("{}://{}/{}".format, st.sampled_from(["wiki", "http", "https", ""]),
                 st.one_of(odd_text, st.sampled_from(["[", "[::1", "[Title]", "]", "en.wikipedia.org"])), odd_text)
field_values = st.one_of(
    json_values, urls,
    st.lists(st.one_of(odd_text, long_text, urls, json_values), max_size=8),
    st.builds(lambda item, n: [item] * n, st.one_of(odd_text, urls), st.integers(0, 600)),  # around --max-batch
)
FIELDS = ["queries", "topk", "return_scores", "title", "url", "urls", "id"]
field_soup = st.dictionaries(st.one_of(st.sampled_from(FIELDS), odd_text), field_values, max_size=4)
# Nearly valid bodies, so that generated values also reach the checks past the first field, and searches.
valid_queries = st.lists(st.one_of(odd_text, long_text, st.sampled_from(["born", "Relrel city", "Zoë"])),
                         min_size=1, max_size=5)
queries = st.integers(0, 3).flatmap(lambda k: valid_queries if k else field_values)  # 3 in 4 valid
retrieve_bodies = st.fixed_dictionaries({"queries": queries}, optional={
    "topk": st.one_of(st.integers(-3, 60), json_values), "return_scores": st.one_of(st.booleans(), json_values)})
access_bodies = st.one_of(
    st.fixed_dictionaries({"title": st.one_of(odd_text, st.sampled_from(["neka dennorlo", "Zoë [Quill]"]))}),
    st.fixed_dictionaries({"url": st.one_of(urls, st.sampled_from(["wiki://Relrel", "wiki://Zo%C3%AB_%5BQuill%5D"]))}),
    st.fixed_dictionaries({"id": st.one_of(st.integers(), big_ints, odd_text, st.sampled_from(["1", "4"]))}),
    st.fixed_dictionaries({"urls": st.one_of(st.lists(st.one_of(urls, st.just("wiki://Relrel")), max_size=10),
                                             field_values)}),
)
BODIES = {"/retrieve": st.one_of(json_values, field_soup, retrieve_bodies),
          "/access": st.one_of(json_values, field_soup, access_bodies)}
raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.one_of(*BODIES.values()).map(lambda body: json.dumps(body).encode()).flatmap(
        lambda raw: st.integers(0, len(raw)).map(lambda cut: raw[:cut])),  # cut short
    st.builds(lambda depth: b"[" * depth + b"]" * depth, st.integers(1, 3000)),
    st.builds(lambda depth: b'{"queries": ["q"], "topk": ' + b"[" * depth + b"]" * depth + b"}", st.integers(1, 3000)),
    st.builds(lambda digits: b'{"queries": ["q"], "topk": ' + b"9" * digits + b"}", st.integers(4000, 20_000)),
    st.builds(lambda digits: b'{"id": -' + b"1" * digits + b"}", st.integers(4000, 20_000)),
)

# Pieces of the shapes that break parsers: tags, markers, braces, digit runs, odd unicode.
PIECES = ["<search>", "</search>", "<answer>", "</answer", "</ANSWER>", "<access>", "</access>", "####", "#",
          "\\boxed{", "\\boxed", "{", "}", "\\frac{", "\\dfrac{1}{", "1", "9" * 70, "1,000", ",", ".", "-", "/",
          " ", "\n", "$", "%", "the", "a", "An", "İ", "ß", "ſ", "\u0301", "\ud800", "٣", "½", "𝟙", "\x00"]
adversarial_text = st.one_of(st.text(), st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=5)),
                                                 max_size=40).map("".join))
large_text = st.lists(st.one_of(st.sampled_from(PIECES), st.text(min_size=1, max_size=3)), min_size=1, max_size=4).map(
    lambda pieces: ("".join(pieces) * (LARGE_CHARS // len("".join(pieces)) + 1))[:LARGE_CHARS])
golds = st.one_of(adversarial_text, st.lists(adversarial_text, max_size=4))


# --- retrieval server: request validation ---
CORPUS = [
    {"id": "1", "contents": '"Neka Dennorlo"\nNeka Dennorlo was born in Relrel in 1853.'},
    {"id": "2", "contents": '"Neka Dennorlo"\nNeka Dennorlo founded the Eskhate Order.'},
    {"id": "3", "contents": '"Relrel"\nRelrel is a city in Velmoria.'},
    {"id": "4", "contents": '"Zoë [Quill]"\nZoë Quill wrote The Silent Harbour.'},
]
FIXED_QUERY = {"queries": ["where was Neka Dennorlo born", "Zoë"], "topk": 3, "return_scores": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_corpus")
    with open(folder / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in CORPUS)
    handle = launch_retrieval_server(str(folder / "corpus.jsonl"), timeout_s=60, log_path=str(folder / "server.log"),
                                     extra_args=("--body-timeout-s", "2"))
    yield handle
    handle.terminate()


def _post(server, path, raw, headers=None):
    """POST `raw` on a connection of its own (the server closes some after an error); assert a 2xx or
    a 4xx within the timeout."""
    r = requests.post(server.address + path, data=raw, timeout=REQUEST_TIMEOUT_S,
                      headers={"Content-Type": "application/json", **(headers or {})})
    assert r.status_code < 300 or 400 <= r.status_code < 500, (path, raw[:200], r.status_code, r.text[:300])
    return r


def _fixed_search(server):
    return _post(server, "/retrieve", json.dumps(FIXED_QUERY).encode()).json()


@pytest.mark.parametrize("path", ["/retrieve", "/access"])
def test_any_json_body_gets_a_result_or_a_4xx_error_and_the_same_search_answers_the_same_after(server, path):
    before = _fixed_search(server)
    assert before["result"][0][0]["document"]["id"] == "1"

    @SERVER
    @given(body=BODIES[path])
    def answered(body):
        r = _post(server, path, json.dumps(body).encode())
        if r.status_code < 300:
            assert "result" in r.json()
        else:
            assert isinstance(r.json()["error"], str) and r.json()["error"]

    answered()
    assert _fixed_search(server) == before


def test_any_raw_body_and_content_encoding_gets_a_2xx_or_4xx(server):
    before = _fixed_search(server)

    # No check of the error's JSON here: aiohttp answers a body that fails to decode at its very end
    # (deflate) or an encoding it lacks (br without Brotli) itself, with a text/plain 400.
    @SERVER
    @given(path=st.sampled_from(["/retrieve", "/access"]), raw=raw_bodies,
           encoding=st.sampled_from([None, "gzip", "deflate", "br", "identity"]))
    def answered(path, raw, encoding):
        _post(server, path, raw, {"Content-Encoding": encoding} if encoding else None)

    answered()
    assert _fixed_search(server) == before


# --- train_search.py: parsers ---
TAG_PARSERS = [(parse_search_query, "search"), (parse_access, "access"), (parse_answer, "answer")]


@FAST
@given(text=adversarial_text)
def test_tag_parsers_return_none_or_a_stripped_nonempty_part_of_the_text(text):
    for parse, tag in TAG_PARSERS:
        content = parse(text)
        assert content is None or (isinstance(content, str) and content and content == content.strip()
                                   and content in text and not re.search(f"<{tag}>", content, re.IGNORECASE))


@FAST
@given(prefix=adversarial_text, content=adversarial_text)
def test_tag_parsers_read_back_the_content_of_a_last_closed_tag(prefix, content):
    for parse, tag in TAG_PARSERS:
        assume(content.strip() and not re.search(f"</?{tag}>", content, re.IGNORECASE))
        assert parse(f"{prefix}<{tag}>{content}</{tag}>") == content.strip()


def test_tag_parsers_finish_100kb_of_unclosed_opening_tags_in_time():
    with time_limit(TIME_BOUND_S):
        parse_search_query("<search>" * (LARGE_CHARS // len("<search>")))


# --- train_search.py: rewards ---
@FAST
@given(pred=adversarial_text, golds=golds)
def test_rewards_are_floats_in_0_1_and_compute_reward_picks_the_metric(pred, golds):
    f1, em = f1_score(pred, golds), exact_match(pred, golds)
    assert isinstance(f1, float) and 0.0 <= f1 <= 1.0
    assert em in (0.0, 1.0) and isinstance(em, float)
    assert compute_reward(pred, golds) == f1 and compute_reward(pred, golds, metric="em") == em
    assert compute_reward(None, golds) == 0.0 and compute_reward(None, golds, metric="em") == 0.0


@FAST
@given(a=adversarial_text, b=adversarial_text)
def test_f1_is_symmetric_between_prediction_and_a_single_gold(a, b):
    assert f1_score(a, b) == f1_score(b, a)
    assert f1_score(a, b) == f1_score(a, [b])  # a string gold is a list of one


@FAST
@given(pred=adversarial_text, golds=st.lists(adversarial_text, max_size=4))
def test_scores_against_a_list_are_the_best_over_its_golds(pred, golds):
    assert f1_score(pred, golds) == max([f1_score(pred, g) for g in golds], default=0.0)
    assert exact_match(pred, golds) == max([exact_match(pred, g) for g in golds], default=0.0)


@FAST
@given(pred=adversarial_text, gold=adversarial_text)
def test_exact_match_implies_f1_of_1_when_the_gold_keeps_a_word(pred, gold):
    assume(normalize_answer(gold))
    if exact_match(pred, gold):
        assert f1_score(pred, gold) == 1.0
    assert exact_match(gold, gold) == 1.0 and f1_score(gold, gold) == 1.0


def test_exact_match_implies_f1_of_1_for_a_gold_that_normalises_to_nothing():
    assert exact_match("the", "A") == 1.0  # holds: both normalise to ''
    assert f1_score("A", "A") == 1.0  # fails: 0.0


@FAST
@given(text=adversarial_text)
def test_normalize_answer_is_idempotent_and_leaves_single_spaced_lowercase_words(text):
    norm = normalize_answer(text)
    assert normalize_answer(norm) == norm
    assert norm == " ".join(norm.split()) and norm == norm.lower()
    assert not set(norm) & set(string.punctuation)


@LARGE
@given(text=large_text)
def test_search_rewards_finish_100kb_in_bounded_time(text):
    with time_limit(TIME_BOUND_S):
        normalize_answer(text)
    with time_limit(TIME_BOUND_S):
        assert 0.0 <= f1_score(text, [text[: LARGE_CHARS // 2], "x"]) <= 1.0
    with time_limit(TIME_BOUND_S):
        assert exact_match(text, [text, "x"]) == 1.0
    with time_limit(TIME_BOUND_S):
        assert 0.0 <= compute_reward(text, text[::-1]) <= 1.0


# --- train_reflect.py: answer extraction and reward ---
# Exponent notation ("1e9999999") is left out of the gold and to_fraction inputs here: it is the
# slowdown that test_to_fraction_of_a_short_token_is_a_short_number documents.
no_exponent = adversarial_text.map(lambda t: t.replace("e", "").replace("E", ""))
no_marker = adversarial_text.map(lambda t: t.replace("#", ""))
numbers = st.one_of(st.integers(-10**30, 10**30), st.fractions(max_denominator=10**6).filter(lambda f: abs(f) < 10**12))


@FAST
@given(completion=adversarial_text, gold=no_exponent)
def test_reflect_functions_never_raise_and_return_the_right_types(completion, gold):
    assert isinstance(extract_answer(completion), (Fraction, type(None)))
    boxed = last_boxed(completion)
    assert boxed is None or (isinstance(boxed, str) and len(boxed) < 1000 and boxed in completion)
    assert reward_fn(completion, gold) in (0.0, 1.0)
    assert reward_fn(gold, "#### " + gold) in (0.0, 1.0)


@FAST
@given(token=no_exponent)
def test_to_fraction_returns_a_fraction_or_none(token):
    assert isinstance(to_fraction(token), (Fraction, type(None)))


@FAST
@given(n=numbers, prefix=adversarial_text, suffix=no_marker)
def test_the_number_after_the_last_marker_is_the_answer(n, prefix, suffix):
    written = f"{n.numerator}/{n.denominator}" if isinstance(n, Fraction) else f"{n:,}"
    assert extract_answer(f"{prefix}\n#### {written}\n{suffix}") == n
    assert reward_fn(f"{prefix}\n#### {written}\n{suffix}", f"#### {n}") == 1.0
    assert reward_fn(f"{prefix}\n#### {written}", f"#### {n + 1}") == 0.0


@FAST
@given(n=st.integers(-10**30, 10**30), prefix=no_marker)
def test_without_a_marker_the_number_in_the_last_box_is_the_answer(n, prefix):
    assert extract_answer(f"{prefix}\\boxed{{{n}}}") == n


@FAST
@given(content=st.text(st.characters(exclude_characters="{}\\"), max_size=900))
def test_last_boxed_reads_back_its_content(content):
    assert last_boxed(f"x \\boxed{{{content}}} y") == content
    assert last_boxed(f"\\boxed{{{{{content}}}}}") == "{" + content + "}"


@LARGE
@given(text=large_text)
def test_reflect_functions_finish_100kb_in_bounded_time(text):
    with time_limit(TIME_BOUND_S):
        extract_answer(text)
    with time_limit(TIME_BOUND_S):
        last_boxed(text)
    with time_limit(TIME_BOUND_S):
        assert reward_fn(text, "#### 7") in (0.0, 1.0)
    with time_limit(TIME_BOUND_S):
        assert to_fraction(text) is None  # longer than any number it converts


def test_to_fraction_of_a_short_token_is_a_short_number():
    value = to_fraction("1e99999")
    assert value is None or (abs(value.numerator) < 10**64 and value.denominator < 10**64)
