"""lib.cpu_server under hostile input: every malformed, out-of-range or stalled request is refused
with a 4xx (never a 5xx, never a hang), refused before it can change anything, and it fails alone:
other clients' requests, /health and the weights carry on as if it had never come.

One server (the tiny random Qwen2 of test_cpu_server, a 4096-token context so that a request can
run for seconds, and short body and weight-sync timeouts) serves the whole module.
"""
import contextlib
import gzip
import json
import os
import socket
import time
import uuid

import pytest
import requests
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from lib.cpu_engine import Request, Runner, SamplingParams
from lib.cpu_server import parse_args
from lib.launch import free_port, launch_cpu_server
from lib.process_group import destroy_custom_process_group, init_custom_process_group
from lib.tiny_model import build_tiny_model
from tests.test_cpu_server import ARCH, TEXTS, _in_background

CONTEXT_LENGTH = 4096
BODY_TIMEOUT_S = 2
TIMEOUT_S = 30  # any answer, refusal or not, comes well within this
GROUP = "hostile_sync"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("hostile") / "model"), TEXTS, seed=0, **ARCH)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    server = launch_cpu_server(
        model_dir, context_length=CONTEXT_LENGTH, num_threads=1, timeout_s=120,
        log_path=str(tmp_path_factory.mktemp("hostile_log") / "cpu_server.log"),
        extra_args=["--max-body-mb", "32", "--body-timeout-s", BODY_TIMEOUT_S, "--weight-sync-timeout-s", 5,
                    "--log-level", "warning"])
    yield server.address
    server.terminate()


@pytest.fixture(scope="module")
def baseline(server):
    """The server's fingerprint (below) as launched; every test leaves the weights as they were."""
    return fingerprint(server)


@pytest.fixture(scope="module")
def vocab_size(model_dir):
    return json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]


@pytest.fixture(scope="module")
def weights(model_dir):
    return load_file(os.path.join(model_dir, "model.safetensors"))


@pytest.fixture(scope="module")
def param_shapes(weights):
    return [(name, list(t.shape)) for name, t in sorted(weights.items())]


@pytest.fixture(scope="module")
def weight_group(server):
    """The server joined to a gloo group whose rank 0 (the trainer) is this test process."""
    port = free_port()
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": GROUP, "backend": "gloo"}
    joined = _in_background(post, server, "/init_weights_update_group", body)
    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, GROUP, timeout_s=30)
    assert joined.result(timeout=TIMEOUT_S).json()["success"]
    yield pg
    destroyed = _in_background(post, server, "/destroy_weights_update_group", {"group_name": GROUP})
    destroy_custom_process_group(pg)
    destroyed.result(timeout=TIMEOUT_S)


def post(url, path, body, **kw):
    return requests.post(url + path, json=body, timeout=kw.pop("timeout", TIMEOUT_S), **kw)


def post_raw(url, path, data: bytes, headers=None):
    return requests.post(url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})},
                         timeout=TIMEOUT_S)


def message(response) -> str:
    """The error message of either shape the server answers with ({"error": {...}} or success false)."""
    body = response.json()
    return body["error"]["message"] if "error" in body else body["message"]


def fingerprint(url):
    """What must not change when a request is refused: a greedy answer with its log-probs (which
    depend on every weight) and the reported weight version and model path."""
    out = post(url, "/generate", {"input_ids": [5, 17, 42, 9], "return_logprob": True,
                                  "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
    assert out.status_code == 200, out.text
    info = requests.get(url + "/model_info", timeout=TIMEOUT_S).json()
    return out.json()["output_ids"], out.json()["meta_info"]["output_token_logprobs"], info["weight_version"], info["model_path"]


def server_info(url):
    return requests.get(url + "/get_server_info", timeout=TIMEOUT_S).json()


@contextlib.contextmanager
def a_long_request_running(url):
    """A greedy request of thousands of tokens, running (not waiting) during the block; aborted
    by its rid after the block. Yields its rid."""
    rid = f"long-{uuid.uuid4().hex}"
    body = {"input_ids": [5, 17, 42], "rid": rid,
            "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}}
    running = _in_background(post, url, "/generate", body)
    deadline = time.monotonic() + TIMEOUT_S
    while server_info(url)["num_running_requests"] == 0:
        assert time.monotonic() < deadline and not running.done(), "the long request never started"
        time.sleep(0.02)
    try:
        yield rid
    finally:
        post(url, "/abort_request", {"rid": rid})
        running.result(timeout=TIMEOUT_S)


# --- 1. out-of-range sampling numbers ---

@pytest.mark.parametrize("params, field", [
    pytest.param({"top_k": 2**63}, "top_k", id="top_k=2**63"),
    pytest.param({"top_k": 513}, "top_k", id="top_k=vocab+1"),
    pytest.param({"top_k": 0}, "top_k", id="top_k=0"),
    pytest.param({"sampling_seed": 2**64}, "sampling_seed", id="seed=2**64"),
    pytest.param({"sampling_seed": 2**63}, "sampling_seed", id="seed=2**63"),
    pytest.param({"sampling_seed": -2**63 - 1}, "sampling_seed", id="seed=-2**63-1"),
    pytest.param({"temperature": 101}, "temperature", id="temperature=101"),
    pytest.param({"temperature": 10**400}, "temperature", id="temperature=10**400"),
    pytest.param({"top_p": 1.5}, "top_p", id="top_p=1.5"),
    pytest.param({"min_p": -0.1}, "min_p", id="min_p=-0.1"),
    pytest.param({"max_new_tokens": 2**31}, "max_new_tokens", id="max_new_tokens=2**31"),
    pytest.param({"max_new_tokens": True}, "max_new_tokens", id="max_new_tokens=true"),
    pytest.param({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens", id="min_new_tokens>max_new_tokens"),
    pytest.param({"n": 0}, "n", id="n=0"),
])
def test_an_out_of_range_sampling_number_is_a_400_naming_the_field_and_its_range(server, params, field):
    r = post(server, "/generate", {"input_ids": [1, 2], "sampling_params": params})
    assert r.status_code == 400, r.text
    assert f"sampling_params.{field}" in message(r) and ("must be in" in message(r) or "must be an" in message(r))


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_non_finite_numbers_are_a_400(server, literal):
    r = post_raw(server, "/generate", b'{"input_ids": [1, 2], "sampling_params": {"temperature": ' + literal + b"}}")
    assert r.status_code == 400, r.text


def test_an_overflowing_top_k_is_refused_without_aborting_the_running_batch(server):
    with a_long_request_running(server):
        r = post(server, "/generate", {"input_ids": [1, 2], "sampling_params": {"top_k": 2**63, "max_new_tokens": 4}})
        assert r.status_code == 400 and "top_k" in message(r)
        assert server_info(server)["num_running_requests"] == 1  # the long request goes on


def test_a_row_with_no_token_left_to_sample_ends_alone(server, vocab_size):
    # Every token is a stop token and min_new_tokens bans stop tokens: nothing can be sampled.
    params = {"stop_token_ids": list(range(vocab_size)), "min_new_tokens": 2, "max_new_tokens": 4, "temperature": 1.0}
    with a_long_request_running(server):
        r = post(server, "/generate", {"input_ids": [1, 2], "sampling_params": params})
        assert r.status_code == 200
        reason = r.json()["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "no token can be sampled" in reason["message"]
        assert server_info(server)["num_running_requests"] == 1


def test_a_prefill_that_fails_is_retried_one_request_at_a_time_so_only_the_culprit_fails(model_dir):
    runner = Runner(parse_args(["--model-path", model_dir, "--context-length", "256"]))
    poison = 7
    real_forward = runner._forward

    def forward(input_ids, *args):
        if input_ids.shape[1] > 1 and (input_ids == poison).any():  # a prefill holding the poison token
            raise RuntimeError("poisoned prompt")
        return real_forward(input_ids, *args)
    runner._forward = forward

    def request(ids):
        params = SamplingParams(max_new_tokens=50, top_k=1, ignore_eos=True)  # greedy
        return Request(rid=uuid.uuid4().hex, input_ids=ids, params=params, return_logprob=True, logprob_start_len=-1,
                       return_text_in_logprobs=False, max_new_tokens=50, created_s=0.0, deadline_s=float("inf"),
                       future=None)
    running, good, bad = request([1, 2, 3]), request([4, 5]), request([6, poison, 8])
    runner.step([running], do_decode=False)
    finished = runner.step([good, bad], do_decode=True)
    assert [r.rid for r in finished] == [bad.rid]
    assert bad.finish_reason["type"] == "abort" and "poisoned prompt" in bad.finish_reason["message"]
    assert [r.rid for r in runner.rows] == [running.rid, good.rid]
    assert len(running.output_ids) == 2 and len(good.output_ids) == 2


# --- 2. a client that disconnects ---

def test_a_client_that_disconnects_frees_its_rows(server):
    body = json.dumps({"input_ids": [5, 17, 42], "sampling_params": {"max_new_tokens": 3000, "temperature": 0,
                                                                      "ignore_eos": True}}).encode()
    clients = []
    for _ in range(4):
        s = socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1])))
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        clients.append(s)
    deadline = time.monotonic() + TIMEOUT_S
    while server_info(server)["num_running_requests"] < 4:
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.02)
    for s in clients:
        s.close()
    deadline = time.monotonic() + 10  # 4 x 3000 tokens take far longer than this on any machine
    while (info := server_info(server))["num_running_requests"] > 0:
        assert time.monotonic() < deadline, f"abandoned rows still running: {info['num_running_requests']}"
        time.sleep(0.05)


# --- 3. a weight file that blocks ---

def test_a_fifo_as_weight_file_is_refused_and_the_server_stays_responsive(server, baseline, tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    try:
        r = post(server, "/update_weights_from_disk", {"model_path": str(tmp_path)}, timeout=10)
        assert r.status_code == 400 and r.json()["success"] is False and "not a regular file" in r.json()["message"]
        assert requests.get(server + "/health", timeout=5).status_code == 200
    finally:
        with contextlib.suppress(OSError):  # release a reader blocked on the FIFO (if any) with an EOF
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert fingerprint(server) == baseline


# --- 4. huge text prompts ---

def test_a_20_mb_text_is_refused_before_tokenizing_while_health_keeps_answering(server):
    body = json.dumps({"text": "a " * 10_000_000, "sampling_params": {"max_new_tokens": 1}}).encode()
    refused = _in_background(post_raw, server, "/generate", body)
    slowest_s = 0.0
    while not refused.done():
        t0 = time.monotonic()
        assert requests.get(server + "/health", timeout=10).status_code == 200
        slowest_s = max(slowest_s, time.monotonic() - t0)
        time.sleep(0.05)
    r = refused.result()
    assert r.status_code == 400 and "cannot fit the model's context length" in message(r)
    assert slowest_s < 5


def test_text_prompts_are_still_tokenized_and_generated(server, model_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = ["Ilvan Moresk was born in", "Pem Varo founded"]
    r = post(server, "/generate", {"text": texts, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert r.status_code == 200
    assert [o["meta_info"]["prompt_tokens"] for o in r.json()] == [len(tokenizer(t)["input_ids"]) for t in texts]


# --- 5. corrupt checkpoints and literal paths ---

def _truncated(path, out):
    data = open(path, "rb").read()
    out.write_bytes(data[:len(data) - 1000])


@pytest.mark.parametrize("corrupt", [
    lambda src, out: out.write_bytes(b"\x07not a safetensors file at all"),
    _truncated,  # a valid header whose data runs short
])
def test_a_corrupt_checkpoint_is_a_400_and_the_weights_stay_exactly(server, baseline, model_dir, tmp_path, corrupt):
    corrupt(os.path.join(model_dir, "model.safetensors"), tmp_path / "model.safetensors")
    r = post(server, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "corrupt"})
    assert r.status_code == 400 and r.json()["success"] is False
    assert fingerprint(server) == baseline


def test_glob_characters_in_model_path_are_taken_literally(server, baseline, model_dir, tmp_path, weights):
    names = sorted(weights)
    for part, subset in (("glob_a", names[::2]), ("glob_b", names[1::2])):  # two halves of one checkpoint
        (tmp_path / part).mkdir()
        save_file({n: weights[n] for n in subset}, str(tmp_path / part / "model.safetensors"))
    r = post(server, "/update_weights_from_disk", {"model_path": str(tmp_path / "glob*")})
    assert r.status_code == 400 and r.json()["success"] is False and "not a directory" in r.json()["message"]
    literal = tmp_path / "ckpt[1]"
    literal.mkdir()
    save_file(weights, str(literal / "model.safetensors"))
    r = post(server, "/update_weights_from_disk", {"model_path": str(literal)})
    assert r.status_code == 200 and r.json()["success"], r.text
    post(server, "/update_weights_from_disk", {"model_path": model_dir})
    assert fingerprint(server) == baseline


# --- 6. weight-sync groups ---

@pytest.mark.parametrize("change, field", [
    ({"rank_offset": 0}, "rank_offset"),  # the server would be rank 0, the broadcast source
    ({"rank_offset": 2}, "rank_offset"),  # beyond world_size - 1
    ({"rank_offset": True}, "rank_offset"),
    ({"world_size": 1}, "world_size"),
    ({"master_port": 70000}, "master_port"),
    ({"master_address": ""}, "master_address"),
    ({"backend": "mpi"}, "backend"),
    ({"group_name": ["a"]}, "group_name"),
])
def test_a_bad_init_weights_update_group_is_a_400_naming_the_field(server, change, field):
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
            "group_name": f"never-{uuid.uuid4().hex}", "backend": "gloo", **change}
    r = post(server, "/init_weights_update_group", body, timeout=10)
    assert r.status_code == 400 and field in message(r), r.text


@pytest.mark.parametrize("change, fragment", [
    ({"names": ["model.no_such.weight"]}, "no parameter"),
    ({"shapes": [[64, 65]]}, "shape"),
    ({"shapes": [[64, True]]}, "shapes"),
    ({"dtypes": ["complex64"]}, "dtype"),
    ({"dtypes": ["int32"]}, "dtype"),
    ({"dtypes": ["float32", "float32"]}, "equal length"),
])
def test_a_bad_distributed_update_is_refused_before_anything_is_received(
        server, baseline, weight_group, weights, change, fragment):
    name = "model.layers.0.self_attn.o_proj.weight"
    body = {"names": [name], "dtypes": ["float32"], "shapes": [list(weights[name].shape)], "group_name": GROUP,
            **change}
    r = post(server, "/update_weights_from_distributed", body, timeout=10)  # nothing is broadcast
    assert r.status_code == 400 and fragment in message(r), r.text
    # Nothing was received, so the group is still in step: a real update goes through.
    body = {"names": [name], "dtypes": ["float32"], "shapes": [list(weights[name].shape)], "group_name": GROUP}
    received = _in_background(post, server, "/update_weights_from_distributed", body)
    torch.distributed.broadcast(weights[name].contiguous(), src=0, group=weight_group)
    assert received.result(timeout=TIMEOUT_S).json()["success"]
    assert fingerprint(server) == baseline  # the same values went in


# --- 8. malformed bodies and stalled clients ---

@pytest.mark.parametrize("body, headers", [
    pytest.param(b"[" * 100_000 + b"]" * 100_000, {}, id="nested-100000-deep"),
    pytest.param(b'{"input_ids": [1, ' + b"9" * 5000 + b"]}", {}, id="int-of-5000-digits"),
    pytest.param(b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}', {"Content-Encoding": "gzip"},
                 id="gzip-that-is-not"),
    pytest.param(b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}', {"Content-Encoding": "deflate"},
                 id="deflate-that-is-not"),
    pytest.param(gzip.compress(b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}')[:20],
                 {"Content-Encoding": "gzip"}, id="gzip-cut-short"),
])
def test_a_body_that_cannot_be_read_or_parsed_is_a_400(server, body, headers):
    r = post_raw(server, "/generate", body, headers)
    assert r.status_code == 400, r.text[:300]
    assert requests.get(server + "/health", timeout=5).status_code == 200


def test_a_body_that_stalls_gets_a_408(server):
    with socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1]))) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b'Content-Length: 1000\r\n\r\n{"input_ids": [1')
        s.settimeout(BODY_TIMEOUT_S + 15)
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 408") and b"--body-timeout-s" in head


# --- property: no body gets a 5xx or changes anything ---

JSON_KEYS = ["input_ids", "text", "sampling_params", "rid", "return_logprob", "logprob_start_len", "stream",
             "top_logprobs_num", "return_text_in_logprobs", "model_path", "weight_version", "names", "dtypes",
             "shapes", "group_name", "load_format", "master_address", "master_port", "rank_offset", "world_size"]
numbers = st.one_of(st.integers(-2**70, 2**70), st.integers(-10**400, 10**400),
                    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64]))
any_json = st.recursive(
    st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=12)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(st.sampled_from(JSON_KEYS), st.text(max_size=6)), inner, max_size=4)),
    max_leaves=20)
bad_ints = st.one_of(st.integers(-2**70, -2), st.integers(2**31, 2**70), st.floats(), st.text(max_size=3), st.booleans(),
                     st.lists(st.integers(0, 3), max_size=2))
sampling_params = st.fixed_dictionaries(
    {"max_new_tokens": st.one_of(st.integers(0, 3), bad_ints)},
    optional={"top_k": st.one_of(st.integers(-3, 600), bad_ints), "temperature": numbers, "top_p": numbers,
              "min_p": numbers, "sampling_seed": numbers, "min_new_tokens": st.one_of(st.integers(0, 3), bad_ints),
              "n": st.one_of(st.integers(1, 2), bad_ints), "stop_token_ids": st.lists(numbers, max_size=3),
              "stop": st.one_of(st.text(max_size=3), any_json), "ignore_eos": any_json, "frequency_penalty": numbers,
              "max_tokens": any_json})
in_range_sampling_params = st.fixed_dictionaries(  # valid, but at the edges of every range
    {"max_new_tokens": st.integers(0, 4)},
    optional={"top_k": st.one_of(st.sampled_from([-1, 1 << 30, 1, 512]), st.integers(1, 512)),
              "temperature": st.one_of(st.sampled_from([0.0, 1e-6, 100.0]), st.floats(0, 100)),
              "top_p": st.floats(0, 1, exclude_min=True), "min_p": st.floats(0, 1),
              "sampling_seed": st.integers(-2**63, 2**63 - 1), "min_new_tokens": st.integers(0, 4),
              "n": st.integers(1, 2), "stop": st.lists(st.text(max_size=3), max_size=2),
              "stop_token_ids": st.one_of(st.lists(st.integers(-5, 600), max_size=4), st.just(list(range(512)))),
              "ignore_eos": st.booleans(), "no_stop_trim": st.booleans(), "skip_special_tokens": st.booleans()})
generate_bodies = st.one_of(
    any_json,
    st.fixed_dictionaries({"input_ids": st.lists(st.integers(0, 511), min_size=1, max_size=6),
                           "sampling_params": in_range_sampling_params},
                          optional={"return_logprob": st.booleans(), "logprob_start_len": st.integers(-2, 8)}),
    st.fixed_dictionaries(
        {"input_ids": st.one_of(st.lists(st.integers(-2, 515), max_size=6), st.lists(st.lists(st.integers(0, 511),
                                max_size=3), max_size=3), any_json),
         "sampling_params": st.one_of(sampling_params, st.lists(sampling_params, max_size=3), any_json)},
        optional={"return_logprob": any_json, "logprob_start_len": numbers, "rid": any_json, "stream": any_json}),
    st.fixed_dictionaries({"text": st.one_of(st.text(max_size=20), st.lists(st.text(max_size=8), max_size=3), any_json),
                           "sampling_params": sampling_params}))


PROPERTY = settings(max_examples=100, deadline=None, database=None,  # each example's bound: TIMEOUT_S
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def send_json(url, path, body):
    """POST any JSON value, NaN and Infinity included; an answer slower than TIMEOUT_S fails the test."""
    return requests.post(url + path, data=json.dumps(body, allow_nan=True), timeout=TIMEOUT_S,
                         headers={"Content-Type": "application/json"})


@PROPERTY
@given(body=generate_bodies)
def test_any_generate_body_gets_a_2xx_or_4xx_and_a_refusal_changes_nothing(server, baseline, body):
    r = send_json(server, "/generate", body)
    event(f"HTTP {r.status_code}")
    assert r.status_code < 500, r.text[:500]
    if r.status_code >= 400:
        assert fingerprint(server) == baseline
    else:
        if r.headers["Content-Type"].startswith("text/event-stream"):  # stream: true, its last event the answer
            events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
            assert events[-1] == "[DONE]", r.text[-300:]
            answers = [json.loads(events[-2])]
        else:
            answers = r.json() if isinstance(r.json(), list) else [r.json()]
        assert not any("model step failed" in str(a["meta_info"]["finish_reason"]) for a in answers)


def _weight_update_bodies(names_shapes):
    names = st.sampled_from([n for n, _ in names_shapes])
    shape = st.one_of(st.sampled_from([s for _, s in names_shapes]), st.lists(st.integers(-1, 70), max_size=3), any_json)
    model_paths = st.one_of(st.sampled_from(["", "/", "/dev/zero", "/nonexistent", "/tmp/*", "a\x00b", "ckpt[1]"]),
                            st.text(max_size=20), any_json)
    disk = st.fixed_dictionaries({"model_path": model_paths},
                                 optional={"weight_version": any_json, "abort_all_requests": any_json,
                                           "load_format": any_json})
    # Never fully valid: at least one field is out of range, so no join waits for a trainer.
    init_valid = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    init_bad = {"master_address": st.one_of(st.just(""), numbers), "master_port": st.one_of(st.integers(-5, 0),
                st.integers(65536, 2**70), any_json.filter(lambda v: not isinstance(v, int))),
                "rank_offset": st.one_of(st.integers(-3, 0), st.integers(2, 2**64), st.booleans()),
                "world_size": st.one_of(st.integers(-3, 1), st.integers(2**16 + 1, 2**64))}
    init = st.sampled_from(sorted(init_bad)).flatmap(lambda bad: st.builds(
        lambda value, extra: {**init_valid, bad: value, **extra}, init_bad[bad],
        st.dictionaries(st.sampled_from(["group_name", "backend"]), any_json, max_size=2)))
    # Never fully valid either: a name, a shape or a dtype is wrong, or the lists differ in length.
    distributed = st.builds(
        lambda n, dtypes, shapes, group, fmt: {"names": n, "dtypes": dtypes, "shapes": shapes, "group_name": group,
                                               "load_format": fmt},
        st.one_of(st.lists(names, min_size=1, max_size=3), st.lists(st.text(max_size=10), min_size=1, max_size=3), any_json),
        st.one_of(st.lists(st.sampled_from(["complex64", "int32", "bool", "uint8", "torch.complex128", "float8"]),
                           min_size=1, max_size=3), any_json),
        st.one_of(st.lists(shape, max_size=3), any_json),
        st.one_of(st.just(GROUP), any_json), st.one_of(st.none(), st.just("flattened_bucket"), any_json))
    destroy = st.fixed_dictionaries({"group_name": st.one_of(st.text(max_size=8).filter(lambda g: g != GROUP),
                                                             any_json)})
    return st.one_of(st.tuples(st.just("/update_weights_from_disk"), st.one_of(disk, any_json)),
                     st.tuples(st.just("/init_weights_update_group"), st.one_of(init, any_json)),
                     st.tuples(st.just("/update_weights_from_distributed"), st.one_of(distributed, any_json)),
                     st.tuples(st.just("/destroy_weights_update_group"), destroy))


@PROPERTY
@given(data=st.data())
def test_any_weight_update_body_gets_a_2xx_or_4xx_and_leaves_the_weights_as_they_were(
        server, baseline, weight_group, param_shapes, data):
    path, body = data.draw(_weight_update_bodies(param_shapes))
    r = send_json(server, path, body)
    event(f"{path} HTTP {r.status_code}")
    assert r.status_code < 500, r.text[:500]
    assert fingerprint(server) == baseline  # every body is refused, or an update of nothing


# --- 9. round 2: lone surrogates, silent trainers, stop-string floods, 64-bit seeds ---

def _has_lone_surrogate(text: str) -> bool:
    """What the server sees after JSON: adjacent high and low surrogates are one character again."""
    try:
        json.loads(json.dumps(text)).encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


@pytest.mark.parametrize("path, body, field", [
    ("/generate", {"text": "\ud800"}, "text"),
    ("/generate", {"text": ["ok", "a\udfffb"]}, "text[1]"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"stop": "\ud800"}}, "sampling_params.stop"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"stop": ["x", "\udc00"]}}, "sampling_params.stop[1]"),
    ("/generate", {"input_ids": [1, 2], "rid": "r\ud800"}, "rid"),
    ("/update_weight_version", {"new_version": "\ud800"}, "new_version"),
    ("/update_weights_from_disk", {"model_path": "/tmp", "weight_version": "v\ud800"}, "weight_version"),
])
def test_a_lone_surrogate_in_a_string_is_a_400_naming_the_field(server, baseline, path, body, field):
    r = post(server, path, body)
    assert r.status_code == 400 and field in message(r) and "surrogate" in message(r), r.text[:300]
    assert fingerprint(server) == baseline


@PROPERTY
@given(field=st.sampled_from(["text", "text[1]", "sampling_params.stop", "sampling_params.stop[1]", "rid"]),
       text=st.text(st.one_of(st.characters(categories=["Cs"]), st.characters(max_codepoint=0x1F600)), max_size=6))
def test_any_string_with_a_lone_surrogate_is_a_400_naming_its_field_and_any_other_is_generated(server, field, text):
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    if field.startswith("text"):
        body = {"text": text if field == "text" else ["ok", text], "sampling_params": body["sampling_params"]}
    elif field.startswith("sampling_params.stop"):
        body["sampling_params"]["stop"] = text if field == "sampling_params.stop" else ["x", text]
    else:
        body["rid"] = text
    r = send_json(server, "/generate", body)
    if _has_lone_surrogate(text):
        assert r.status_code == 400 and field in message(r), r.text[:300]
    else:  # an empty text has no token to start from
        assert r.status_code == 200 or (r.status_code == 400 and "input_ids is empty" in message(r)), r.text[:300]


def test_joins_to_a_trainer_that_never_answers_go_one_at_a_time_and_a_weight_update_still_answers(server, model_dir):
    # More joins than the default executor has threads on any machine (at most 32); each would wait
    # for the trainer until --weight-sync-timeout-s (5 s here).
    with socket.create_server(("127.0.0.1", 0), backlog=64) as silent:  # the kernel accepts; nobody answers
        body = {"master_address": "127.0.0.1", "master_port": silent.getsockname()[1], "rank_offset": 1,
                "world_size": 2, "backend": "gloo"}
        joins = [_in_background(post, server, "/init_weights_update_group", {**body, "group_name": f"silent-{i}"})
                 for i in range(40)]
        deadline = time.monotonic() + 2
        while sum(j.done() for j in joins) < len(joins) - 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        t0 = time.monotonic()
        r = post(server, "/update_weights_from_disk", {"model_path": model_dir}, timeout=3)
        assert r.status_code == 200 and r.json()["success"] and time.monotonic() - t0 < 3
        answers = [j.result(timeout=TIMEOUT_S) for j in joins]  # the one that waited gives up after 5 s
    refused = [r for r in answers if r.status_code == 409]
    assert len(refused) == 39 and all("already joining group 'silent-" in message(r) for r in refused)
    assert [r.json()["success"] for r in answers if r.status_code != 409] == [False]


@pytest.mark.parametrize("stop, fragment", [
    pytest.param([f"s{i}" for i in range(65)], "65 stop strings", id="65-strings"),
    pytest.param(["x" * 1025], "1025 characters", id="1025-characters"),
    pytest.param(["x" * 600, "y" * 425], "1025 characters", id="1025-characters-in-two"),
])
def test_stop_strings_past_the_count_or_length_limit_are_a_400_naming_the_limit(server, stop, fragment):
    r = post(server, "/generate", {"input_ids": [1, 2], "sampling_params": {"stop": stop, "max_new_tokens": 2}})
    assert r.status_code == 400 and "sampling_params.stop" in message(r) and fragment in message(r), r.text[:300]


@PROPERTY
@given(stop=st.one_of(st.integers(60, 70).flatmap(lambda n: st.lists(st.text(max_size=4), min_size=n, max_size=n)),
                      st.lists(st.text(min_size=200, max_size=600), min_size=1, max_size=4),
                      st.lists(st.text(max_size=40), max_size=80)))
def test_stop_strings_within_64_and_1024_characters_are_taken_and_more_are_a_400(server, stop):
    r = send_json(server, "/generate", {"input_ids": [1, 2], "sampling_params": {"stop": stop, "max_new_tokens": 1}})
    within = len(stop) <= 64 and sum(map(len, stop)) <= 1024
    assert r.status_code == (200 if within else 400), r.text[:300]


def _sixteen_greedy_tokens_s(url) -> float:
    t0 = time.monotonic()
    r = post(url, "/generate", {"input_ids": [5, 17, 42], "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                                              "ignore_eos": True}})
    assert r.status_code == 200
    return time.monotonic() - t0


def test_a_flood_of_stop_strings_is_refused_and_its_batch_mate_is_not_slowed(server):
    alone_s = min(_sixteen_greedy_tokens_s(server) for _ in range(3))
    params = {"stop": [f"s{i}" for i in range(300_000)], "max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
    flood = json.dumps({"input_ids": [5, 17, 42], "sampling_params": params}).encode()
    hostile = _in_background(post_raw, server, "/generate", flood)
    time.sleep(0.5)
    beside_s = _sixteen_greedy_tokens_s(server)
    print(f"16 greedy tokens: alone {alone_s:.3f} s, beside 300,000 stop strings {beside_s:.3f} s")
    assert beside_s < 3 * alone_s + 0.2, (alone_s, beside_s)
    assert hostile.result().status_code == 400


def _sampled(url, seed: int) -> list:
    r = post(url, "/generate", {"input_ids": [5, 17, 42], "sampling_params": {
        "max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True, "sampling_seed": seed}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_seeds_that_share_their_low_32_bits_sample_differently(server):
    samples = [_sampled(server, seed) for seed in (1, 2**32 + 1, -2**63 + 1)]
    assert len({tuple(s) for s in samples}) == 3, samples
    assert _sampled(server, 2**32 + 1) == samples[1]  # and a seed still reproduces its sample


@settings(parent=PROPERTY, max_examples=25)
@given(low=st.integers(0, 2**32 - 1),
       highs=st.lists(st.integers(-2**31, 2**31 - 1), min_size=2, max_size=2, unique=True))
def test_any_two_int64_seeds_with_equal_low_32_bits_sample_differently(server, low, highs):
    a, b = (high * 2**32 + low for high in highs)
    assert _sampled(server, a) != _sampled(server, b)
