"""lib.cpu_server speaks SGLang's /generate and weight-update API, batches concurrent requests
with a KV cache, and reports log-probs that match a plain fp32 forward of the same model.

One server process (a tiny random Qwen2 model) serves the whole module; tests that change its
weights put the original weights back before they return.
"""
import concurrent.futures
import os
import socket
import subprocess
import sys
import time

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lib.process_group import destroy_custom_process_group, init_custom_process_group
from lib.tiny_model import build_tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = [f"Ilvan Moresk was born in Tarqua in {1800 + i}. Pem Varo founded the Ostrel Guild. "
         f"<answer> {i} </answer>" for i in range(300)]
ARCH = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2)
CONTEXT_LENGTH = 256
TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("cpu_server") / "model"), TEXTS, seed=0, **ARCH)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("cpu_server_log") / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lib.cpu_server", "--model-path", model_dir, "--port", str(port),
             "--context-length", str(CONTEXT_LENGTH), "--num-threads", "1", "--max-body-mb", "1",
             "--log-level", "warning"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"cpu_server did not come up; log:\n{open(log_path).read()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def reference_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def generate(url, input_ids, **sampling):
    body = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True}
    r = requests.post(url + "/generate", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def seeded(url, input_ids, n=16, **extra):
    """Sampled at temperature 1 with a per-request seed: repeatable, and varied text (a random
    model's greedy output tends to repeat one token)."""
    return generate(url, input_ids, max_new_tokens=n, temperature=1.0, sampling_seed=11, **extra)


def greedy(url, input_ids, n=12):
    return generate(url, input_ids, max_new_tokens=n, temperature=0.0, ignore_eos=True)


def prompt(tokenizer, text="Ilvan Moresk was born in"):
    return tokenizer(text)["input_ids"]


def reference_logprobs(model, input_ids, output_ids):
    """log_softmax of one fp32 forward over prompt + output, read at each output token."""
    with torch.no_grad():
        logits = model(torch.tensor([input_ids + output_ids])).logits.float()[0]
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[len(input_ids) - 1 + i, t].item() for i, t in enumerate(output_ids)]


def post(url, path, body=None, **kw):
    return requests.post(url + path, json=body if body is not None else {}, timeout=kw.pop("timeout", TIMEOUT_S), **kw)


# --- /generate ---

def test_response_has_sglang_shape(server, tokenizer):
    ids = prompt(tokenizer)
    out = generate(server, ids, max_new_tokens=5, ignore_eos=True)
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 5
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 5
    assert meta["cached_tokens"] == 0 and meta["weight_version"] == "default"
    assert [row[1] for row in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(row[2] is None and row[0] <= 0 for row in meta["output_token_logprobs"])
    assert meta["input_token_logprobs"] == [] and isinstance(meta["id"], str)


def test_batch_input_answers_a_list_in_order(server, tokenizer):
    a, b = prompt(tokenizer, "Pem Varo"), prompt(tokenizer, "founded the Ostrel Guild in Tarqua")
    out = requests.post(server + "/generate", json={
        "input_ids": [a, b], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}},
        timeout=TIMEOUT_S).json()
    assert isinstance(out, list) and len(out) == 2
    assert out[0]["output_ids"] == greedy(server, a, 4)["output_ids"]
    assert out[1]["output_ids"] == greedy(server, b, 4)["output_ids"]


def test_sampled_logprobs_equal_a_fresh_fp32_forward(server, tokenizer, reference_model):
    prompts = [prompt(tokenizer, t) for t in ("Ilvan", "Pem Varo founded the", "born in Tarqua in 1803. Pem")]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # concurrent, so rows are left-padded together
        outs = list(pool.map(lambda p: generate(server, p, max_new_tokens=16, temperature=1.0, ignore_eos=True), prompts))
    for ids, out in zip(prompts, outs):
        served = [row[0] for row in out["meta_info"]["output_token_logprobs"]]
        ref = reference_logprobs(reference_model, ids, out["output_ids"])
        assert max(abs(a - b) for a, b in zip(served, ref)) < 1e-4


def test_greedy_picks_argmax_and_reports_untempered_logprobs(server, tokenizer, reference_model):
    ids = prompt(tokenizer)
    out = greedy(server, ids, 8)
    with torch.no_grad():
        logits = reference_model(torch.tensor([ids + out["output_ids"]])).logits.float()[0]
    argmax = logits[len(ids) - 1:-1].argmax(-1).tolist()
    assert out["output_ids"] == argmax
    served = [row[0] for row in out["meta_info"]["output_token_logprobs"]]
    ref = reference_logprobs(reference_model, ids, out["output_ids"])
    assert max(abs(a - b) for a, b in zip(served, ref)) < 1e-4


def test_prompt_logprobs_and_their_top_tokens_equal_a_fresh_fp32_forward(server, tokenizer, reference_model):
    ids = prompt(tokenizer)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 3}
    meta = requests.post(server + "/generate", json=body, timeout=TIMEOUT_S).json()["meta_info"]
    with torch.no_grad():
        logprobs = torch.log_softmax(reference_model(torch.tensor([ids])).logits.float()[0], dim=-1)
    assert [row[1] for row in meta["input_token_logprobs"]] == ids and meta["input_token_logprobs"][0][0] is None
    tops = meta["input_top_logprobs"]
    assert len(tops) == len(ids) and tops[0] is None  # the first prompt token has no log-prob
    for t in range(1, len(ids)):
        values, top_ids = logprobs[t - 1].topk(3)
        assert [row[1] for row in tops[t]] == top_ids.tolist()
        assert [row[0] for row in tops[t]] == pytest.approx(values.tolist(), abs=1e-4)
        assert meta["input_token_logprobs"][t][0] == pytest.approx(logprobs[t - 1, ids[t]].item(), abs=1e-4)
    # from a later start: only the positions from there
    body["logprob_start_len"] = 2
    meta = requests.post(server + "/generate", json=body, timeout=TIMEOUT_S).json()["meta_info"]
    assert len(meta["input_top_logprobs"]) == len(ids) - 2 and [r[1] for r in meta["input_top_logprobs"][0]] == \
        logprobs[1].topk(3).indices.tolist()


def test_temperature_scales_the_reported_logprob(server, tokenizer, reference_model):
    ids = prompt(tokenizer)
    out = generate(server, ids, max_new_tokens=6, temperature=0.5, top_k=5, ignore_eos=True)
    with torch.no_grad():
        logits = reference_model(torch.tensor([ids + out["output_ids"]])).logits.float()[0]
    logprobs = torch.log_softmax(logits / 0.5, dim=-1)
    ref = [logprobs[len(ids) - 1 + i, t].item() for i, t in enumerate(out["output_ids"])]
    served = [row[0] for row in out["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(served, ref)) < 1e-4
    top5 = logits[len(ids) - 1:-1].topk(5, dim=-1).indices
    assert all(t in top5[i].tolist() for i, t in enumerate(out["output_ids"]))


def test_stop_string_spanning_tokens_ends_generation_and_is_trimmed_from_text(server, tokenizer):
    ids = prompt(tokenizer)
    free = seeded(server, ids, ignore_eos=True)["output_ids"]
    # A stop string made of the last character of token k-1 and the first of token k completes
    # only at token k (provided it does not occur earlier).
    for k in range(2, 16):
        before, piece = tokenizer.decode(free[:k]), tokenizer.decode(free[k:k + 1])
        stop = before[-1:] + piece[:1]
        if len(stop) == 2 and stop not in before:
            break
    else:
        pytest.fail(f"no usable stop string in the greedy output {tokenizer.decode(free)!r}")
    out = seeded(server, ids, stop=[stop, "zzzz"], ignore_eos=True)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == free[:k + 1]
    assert len(out["meta_info"]["output_token_logprobs"]) == k + 1
    full_text = tokenizer.decode(free[:k + 1])
    assert out["text"] == full_text[:full_text.find(stop)]
    kept = seeded(server, ids, stop=stop, no_stop_trim=True, ignore_eos=True)
    assert kept["text"] == full_text and kept["output_ids"] == free[:k + 1]


def test_stop_token_id_ends_generation_and_stays_in_output_ids(server, tokenizer):
    ids = prompt(tokenizer)
    free = seeded(server, ids, ignore_eos=True)["output_ids"]
    stop_id = free[5]
    first = free.index(stop_id)
    out = seeded(server, ids, stop_token_ids=[stop_id])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["output_ids"] == free[:first + 1]
    assert out["text"] == tokenizer.decode(free[:first], skip_special_tokens=True)
    ignored = seeded(server, ids, stop_token_ids=[stop_id], ignore_eos=True)
    assert ignored["meta_info"]["finish_reason"]["type"] == "length"


def test_prompt_plus_max_new_tokens_beyond_the_context_is_a_400_as_in_sglang(server):
    ok = generate(server, [5] * (CONTEXT_LENGTH - 4), max_new_tokens=4, temperature=0, ignore_eos=True)
    assert ok["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    r = requests.post(server + "/generate", json={"input_ids": [5] * (CONTEXT_LENGTH - 4),
                                                 "sampling_params": {"max_new_tokens": 5}}, timeout=TIMEOUT_S)
    assert r.status_code == 400
    assert "exceeds the model's maximum context length of 256 tokens" in r.json()["error"]["message"]
    # Without an explicit max_new_tokens the default (128) is capped to fit instead.
    out = requests.post(server + "/generate", json={"input_ids": [5] * (CONTEXT_LENGTH - 4),
                                                   "sampling_params": {"ignore_eos": True}}, timeout=TIMEOUT_S).json()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_n_samples_per_prompt_answer_a_prompt_major_list(server, tokenizer):
    a, b = prompt(tokenizer, "Pem Varo"), prompt(tokenizer, "Ilvan")
    out = requests.post(server + "/generate", json={
        "input_ids": [a, b], "sampling_params": {"max_new_tokens": 5, "n": 3, "ignore_eos": True}},
        timeout=TIMEOUT_S).json()
    assert len(out) == 6 and [o["meta_info"]["prompt_tokens"] for o in out] == [len(a)] * 3 + [len(b)] * 3
    assert len({o["meta_info"]["id"] for o in out}) == 6


def test_same_sampling_seed_gives_same_tokens(server, tokenizer):
    ids = prompt(tokenizer)
    a = generate(server, ids, max_new_tokens=10, temperature=1.0, ignore_eos=True, sampling_seed=7)
    b = generate(server, ids, max_new_tokens=10, temperature=1.0, ignore_eos=True, sampling_seed=7)
    assert a["output_ids"] == b["output_ids"]


@pytest.mark.slow
def test_32_concurrent_requests_are_batched_and_each_matches_its_solo_answer(server, tokenizer):
    prompts = [prompt(tokenizer, f"Ilvan Moresk was born in Tarqua in {1800 + 7 * i}.")[: 4 + i % 9] for i in range(32)]
    before = requests.get(server + "/get_server_info", timeout=TIMEOUT_S).json()
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(lambda p: greedy(server, p, 10 + p[-1] % 7), prompts))
    after = requests.get(server + "/get_server_info", timeout=TIMEOUT_S).json()
    assert after["max_batch_size_seen"] > 1
    decode_steps = after["num_decode_batches"] - before["num_decode_batches"]
    assert decode_steps < sum(len(o["output_ids"]) for o in outs) / 2  # rows shared decode forwards
    for p in prompts[:4] + prompts[-4:]:  # batching must not change a greedy answer
        solo = greedy(server, p, 10 + p[-1] % 7)
        match = outs[prompts.index(p)]
        assert match["output_ids"] == solo["output_ids"]


# --- control endpoints ---

def test_info_endpoints(server, model_dir):
    assert requests.get(server + "/health", timeout=TIMEOUT_S).status_code == 200
    assert requests.get(server + "/health_generate", timeout=TIMEOUT_S).status_code == 200
    info = requests.get(server + "/get_model_info", timeout=TIMEOUT_S).json()
    assert info["model_path"] == model_dir and info["tokenizer_path"] == model_dir and info["is_generation"] is True
    server_info = requests.get(server + "/get_server_info", timeout=TIMEOUT_S).json()
    assert server_info["context_length"] == CONTEXT_LENGTH and "weight_version" in server_info
    assert post(server, "/flush_cache").status_code == 200


def _in_background(fn, *args):
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return future


def test_request_sent_while_paused_completes_only_after_continue(server, tokenizer):
    assert post(server, "/pause_generation", {"mode": "in_place"}).json()["status"] == "ok"
    try:
        pending = _in_background(greedy, server, prompt(tokenizer), 4)
        time.sleep(1.0)
        assert not pending.done()
        assert requests.get(server + "/health", timeout=5).status_code == 200  # still answering
    finally:
        assert post(server, "/continue_generation").json()["status"] == "ok"
    assert pending.result(timeout=TIMEOUT_S)["meta_info"]["finish_reason"]["type"] == "length"


def _wait_until_running(server):
    deadline = time.monotonic() + 20
    while requests.get(server + "/get_server_info", timeout=5).json()["num_running_requests"] == 0:
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.02)
    time.sleep(0.1)


def test_pause_in_abort_mode_ends_running_requests_with_their_tokens_so_far(server, tokenizer):
    ids = prompt(tokenizer)
    running = _in_background(greedy, server, ids, CONTEXT_LENGTH - len(ids) - 1)
    _wait_until_running(server)
    try:
        assert post(server, "/pause_generation", {}).json()["status"] == "ok"  # SGLang's default mode: abort
        out = running.result(timeout=TIMEOUT_S)
    finally:
        post(server, "/continue_generation")
    assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None,
                                                 "err_type": None}
    n = len(out["output_ids"])
    assert 0 < n < CONTEXT_LENGTH - len(ids) - 1
    assert len(out["meta_info"]["output_token_logprobs"]) == n
    assert out["output_ids"] == greedy(server, ids, n)["output_ids"]


def test_abort_request_by_rid(server, tokenizer):
    ids = prompt(tokenizer)
    body = {"input_ids": ids, "rid": "to-abort", "return_logprob": True,
            "sampling_params": {"max_new_tokens": CONTEXT_LENGTH - len(ids) - 1, "temperature": 0, "ignore_eos": True}}
    running = _in_background(lambda: requests.post(server + "/generate", json=body, timeout=TIMEOUT_S).json())
    _wait_until_running(server)
    assert post(server, "/abort_request", {"rid": "to-abort"}).status_code == 200
    out = running.result(timeout=TIMEOUT_S)
    assert out["meta_info"]["id"] == "to-abort"
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < CONTEXT_LENGTH - len(ids) - 1


# --- weight updates ---

def _perturbed_state_dict(model_dir, seed=1):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    return {name: t + 0.05 * torch.randn(t.shape, generator=g) for name, t in model.state_dict().items()}


def _save(model_dir, state_dict, out_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(state_dict)
    model.save_pretrained(out_dir, safe_serialization=True)
    return str(out_dir)


def _update_from_disk(server, path, **extra):
    r = post(server, "/update_weights_from_disk", {"model_path": path, **extra})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert r.json()["num_paused_requests"] == 0


def test_update_weights_from_disk_changes_outputs(server, tokenizer, model_dir, tmp_path):
    ids = prompt(tokenizer)
    before = greedy(server, ids)
    perturbed = _save(model_dir, _perturbed_state_dict(model_dir), tmp_path / "perturbed")
    try:
        _update_from_disk(server, perturbed, weight_version="v1")
        after = greedy(server, ids)
        assert after["meta_info"]["weight_version"] == "v1"
        assert after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
    finally:
        _update_from_disk(server, model_dir, weight_version="default")
    assert greedy(server, ids) ["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]


@pytest.mark.slow
def test_update_without_pause_waits_for_in_flight_requests_and_holds_new_ones(server, tokenizer, model_dir, tmp_path):
    ids = prompt(tokenizer)
    n = CONTEXT_LENGTH - len(ids) - 1
    expected = greedy(server, ids, n)
    perturbed = _save(model_dir, _perturbed_state_dict(model_dir, seed=3), tmp_path / "perturbed")
    running = _in_background(greedy, server, ids, n)
    _wait_until_running(server)
    try:
        _update_from_disk(server, perturbed, weight_version="v3")
        update_done_ts = time.time()
        out = running.result(timeout=TIMEOUT_S)
        assert out["meta_info"]["response_sent_to_client_ts"] < update_done_ts
        assert out["meta_info"]["weight_version"] == "default"
        assert out["meta_info"]["output_token_logprobs"] == expected["meta_info"]["output_token_logprobs"]
        assert greedy(server, ids, 4)["meta_info"]["weight_version"] == "v3"
    finally:
        _update_from_disk(server, model_dir, weight_version="default")


def test_update_weights_from_disk_with_a_bad_path_is_a_400_and_keeps_weights(server, tokenizer, tmp_path):
    ids = prompt(tokenizer)
    before = greedy(server, ids)
    r = post(server, "/update_weights_from_disk", {"model_path": str(tmp_path / "nothing")})
    assert r.status_code == 400 and r.json()["success"] is False and "safetensors" in r.json()["message"]
    assert greedy(server, ids)["output_ids"] == before["output_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_distributed_update_over_gloo_gives_the_same_weights_as_the_disk_update(
        server, tokenizer, model_dir, tmp_path, load_format):
    ids = prompt(tokenizer)
    state_dict = _perturbed_state_dict(model_dir, seed=2)
    names = list(state_dict)
    port = _free_port()
    group = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
             "group_name": "test_sync", "backend": "gloo"}
    server_joined = _in_background(post, server, "/init_weights_update_group", group)
    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "test_sync", timeout_s=30)
    try:
        assert server_joined.result(timeout=TIMEOUT_S).json()["success"]
        # Half the tensors go as bfloat16, so the update must convert dtypes (and, bucketed, mix them).
        sent = {n: t.to(torch.bfloat16) if i % 2 else t for i, (n, t) in enumerate(state_dict.items())}
        state_dict = {n: t.float() for n, t in sent.items()}
        update = {"names": names, "dtypes": [str(sent[n].dtype).removeprefix("torch.") for n in names],
                  "shapes": [list(sent[n].shape) for n in names], "group_name": "test_sync",
                  "flush_cache": True, "weight_version": "v2", "load_format": load_format}
        server_received = _in_background(post, server, "/update_weights_from_distributed", update)
        if load_format == "flattened_bucket":  # SGLang's bucket: every tensor's bytes, concatenated
            bucket = torch.cat([sent[n].contiguous().flatten().view(torch.uint8) for n in names])
            torch.distributed.broadcast(bucket, src=0, group=pg)
        else:
            for name in names:  # same order as the names list: the server receives them in that order
                torch.distributed.broadcast(sent[name].contiguous(), src=0, group=pg)
        assert server_received.result(timeout=TIMEOUT_S).json()["success"]
        via_broadcast = greedy(server, ids)
        assert via_broadcast["meta_info"]["weight_version"] == "v2"
        _update_from_disk(server, _save(model_dir, state_dict, tmp_path / "perturbed"))
        via_disk = greedy(server, ids)
        assert via_broadcast["output_ids"] == via_disk["output_ids"]
        assert via_broadcast["meta_info"]["output_token_logprobs"] == via_disk["meta_info"]["output_token_logprobs"]
    finally:
        destroyed = _in_background(post, server, "/destroy_weights_update_group", {"group_name": "test_sync"})
        destroy_custom_process_group(pg)
        assert destroyed.result(timeout=TIMEOUT_S).json()["success"]
        _update_from_disk(server, model_dir, weight_version="default")


def test_distributed_update_on_an_unknown_group_is_a_400(server):
    r = post(server, "/update_weights_from_distributed",
             {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"})
    assert r.status_code == 400 and r.json()["success"] is False and "init_weights_update_group" in r.json()["message"]


# --- malformed input ---

@pytest.mark.parametrize("body, fragment", [
    (b"{not json", "not valid JSON"),
    (b"", "empty body"),
    (b"[1, 2]", "JSON object"),
    (b'{"input_ids": []}', "empty"),
    (b'{"input_ids": "hello"}', "list of integers"),
    (b'{"input_ids": [1, "2"]}', "list of integers"),
    (b'{"input_ids": [1, 99999]}', "outside"),
    (b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "8"}}', "max_new_tokens"),
    (b'{"input_ids": [1, 2], "sampling_params": {"temperature": -1}}', "temperature"),
    (b'{"input_ids": [1, 2], "sampling_params": {"top_p": 0}}', "top_p"),
    (b'{"input_ids": [1, 2], "sampling_params": {"max_tokens": 8}}', "unknown sampling parameter 'max_tokens'"),
    (b'{"input_ids": [1, 2], "sampling_params": {"repetition_penalty": 1.3}}', "not supported"),
    (b'{"input_ids": [1, 2], "sampling_params": [{}, {}]}', "list of 2"),
    (b'{"input_ids": [1, 2], "return_logprob": "yes"}', "return_logprob"),
    (b'{"input_ids": [[1, 2], [3]], "stream": true}', "stream"),
    (b'{"input_ids": [1, 2], "return_logprob": true, "top_logprobs_num": 101}', "top_logprobs_num"),
    (b'{"input_ids": [1, 2], "sampling_params": {"n": 100000}}', "at most"),
    (b'{"input_ids": [[1, 2], [3]], "rid": ["a", "a"]}', "unique"),
    (b'{"input_ids": [' + b"1, " * CONTEXT_LENGTH + b'1]}', "context length"),
])
def test_malformed_generate_gets_a_400_json_error_and_the_server_keeps_serving(server, body, fragment):
    r = requests.post(server + "/generate", data=body, headers={"Content-Type": "application/json"}, timeout=TIMEOUT_S)
    assert r.status_code == 400
    assert fragment in r.json()["error"]["message"]
    assert generate(server, [1, 2, 3], max_new_tokens=1)["meta_info"]["completion_tokens"] == 1


def test_oversized_body_gets_a_413_json_error_and_the_server_keeps_serving(server):
    body = b'{"input_ids": [' + b"1, " * (2**20 // 3 + 10) + b"1]}"  # > the test server's 1 MB limit
    r = requests.post(server + "/generate", data=body, headers={"Content-Type": "application/json"}, timeout=TIMEOUT_S)
    assert r.status_code == 413 and "--max-body-mb" in r.json()["error"]["message"]
    assert generate(server, [1, 2, 3], max_new_tokens=1)["meta_info"]["completion_tokens"] == 1


def test_unknown_path_and_bad_control_bodies_get_4xx_json(server):
    r = requests.get(server + "/nope", timeout=TIMEOUT_S)
    assert r.status_code == 404 and "message" in r.json()["error"]
    r = post(server, "/pause_generation", {"mode": "sideways"})
    assert r.status_code == 400 and "mode" in r.json()["error"]["message"]
    r = post(server, "/init_weights_update_group", {"master_address": "127.0.0.1"})
    assert r.status_code == 400 and "master_port" in r.json()["error"]["message"]
    r = requests.post(server + "/generate", json={"input_ids": [1, 2]}, timeout=TIMEOUT_S)
    assert r.status_code == 200  # default sampling params are fine
