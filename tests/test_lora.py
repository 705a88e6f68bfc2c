"""LoRA (lib/lora.py, lib/lora_serving.py, docs/lora.md): the actor trains fp32 adapters on a frozen
base, its checkpoints hold the adapters alone and resume exactly; lib's CPU server loads adapters by
name (SGLang's /load_lora_adapter, /unload_lora_adapter, `lora_path` per request) and serves the
trainer's log-probs with them; a request naming an adapter the server lacks is refused; a server
that does not apply the trainer's adapter stops the run; and train_calc.py runs LoRA end to end.
"""
import json
import os
import subprocess
import sys

import pytest
import requests
import torch

from lib.actor import Actor
from lib.async_rollout import BackgroundLoop
from lib.client import InferenceClient, InferenceServerError
from lib.lora import DEFAULT_TARGET_MODULES, lora_modules
from lib.run import RunConfig, check_config
from lib.tiny_model import build_tiny_model
from lib.weight_sync import TEST_ADAPTER, ServerIgnoresAdapter, ServerWeightSync
from tests.two_ranks import run_two_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = [f"Ilvan Moresk was born in Tarqua in {1800 + i}. Pem Varo founded the Ostrel Guild. "
         f"<answer> {i} </answer>" for i in range(300)]
ARCH = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2)
LORA = dict(lora_rank=4, lora_alpha=8.0, lora_target_modules=list(DEFAULT_TARGET_MODULES))
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("lora") / "model"), TEXTS, seed=0, **ARCH)


def lora_actor(model_dir, **kw) -> Actor:
    return Actor(model_dir, lr=1e-2, device="cpu", **{**LORA, **kw})


def rows(ids: list[list[int]]) -> dict:
    input_ids = torch.tensor(ids)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "loss_mask": torch.ones_like(input_ids),
            "logprobs": torch.zeros(input_ids.shape), "advantages": torch.tensor([1.0, -1.0])[:len(ids)]}


def randomise_adapters(actor: Actor, seed: int):
    """Adapters far from their B = 0 start, so that the adapted model differs from the base."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, module in lora_modules(actor.model):
            for weight in (module.lora_A["default"].weight, module.lora_B["default"].weight):
                weight.copy_(torch.randn(weight.shape, generator=g) * 0.3)


BATCH = [[5, 17, 42, 8, 99, 3, 250, 7, 64, 11], [300, 2, 18, 77, 5, 41, 9, 120, 33, 6]]


# --- the trainer ---

def test_only_the_adapters_require_grad_and_they_are_fp32_over_a_bf16_base(model_dir):
    actor = lora_actor(model_dir, dtype="bfloat16")
    params = dict(actor.model.named_parameters())
    adapters = {n: p for n, p in params.items() if ".lora_" in n}
    assert len(adapters) == 2 * ARCH["num_hidden_layers"] * len(DEFAULT_TARGET_MODULES)  # A and B per module
    assert all(p.requires_grad and p.dtype == torch.float32 for p in adapters.values())
    assert all(not p.requires_grad and p.dtype == torch.bfloat16 for n, p in params.items() if n not in adapters)
    assert actor.master_model is actor.model  # no fp32 copy of the base: the adapters are the masters
    in_optimizer = {id(p) for group in actor.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in adapters.values()}
    before = {n: p.detach().clone() for n, p in params.items()}
    stats = actor.update(rows(BATCH))  # B = 0 at the start: only B gets a gradient
    assert stats["grad_norm"] > 0 and stats["skipped"] == 0
    changed = {n for n, p in params.items() if not torch.equal(p.detach(), before[n])}
    assert changed and all(".lora_B." in n for n in changed)


def test_lora_dropout_above_zero_is_refused(model_dir):
    with pytest.raises(ValueError, match="lora_dropout must be 0"):
        lora_actor(model_dir, lora_dropout=0.1)
    with pytest.raises(ValueError, match="lora_dropout must be 0"):
        check_config(RunConfig(lora_rank=8, lora_dropout=0.05))
    check_config(RunConfig(lora_rank=8))


def test_target_modules_that_match_nothing_or_the_head_or_embeddings_are_refused(model_dir):
    with pytest.raises(ValueError, match="match no linear module"):
        lora_actor(model_dir, lora_target_modules=["not_a_module"])
    # the log-prob head reads lm_head's weight itself: an adapter there would train nothing, silently
    with pytest.raises(ValueError, match="adapt 'lm_head'"):
        lora_actor(model_dir, lora_target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="adapt 'model.embed_tokens' \\(Embedding\\)"):
        lora_actor(model_dir, lora_target_modules=["q_proj", "embed_tokens"])


def test_the_merged_weights_give_the_adapted_models_logprobs(model_dir):
    from transformers import AutoModelForCausalLM

    from lib.logprobs import PolicyForward, compute_logprobs

    actor = lora_actor(model_dir)
    randomise_adapters(actor, seed=1)
    merged = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    missing, unexpected = merged.load_state_dict(dict(actor.named_full_parameters()), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    batch = rows(BATCH)
    with torch.no_grad():
        lp_merged = compute_logprobs(PolicyForward(merged), batch["input_ids"], batch["attention_mask"], 1.0)
    lp_lora = actor.compute_logprobs(batch)
    base = actor.probe_logprobs(BATCH[0], adapters=False)
    assert (lp_lora[0, 1:] - base).abs().mean() > 0.05  # the adapters matter
    assert torch.allclose(lp_merged, lp_lora, atol=1e-4)


def test_packed_rows_and_gradient_checkpointing_train_the_adapters_as_padded_rows_do(model_dir):
    padded, packed = lora_actor(model_dir), lora_actor(model_dir, packed=True, gradient_checkpointing=True)
    for actor in (padded, packed):
        randomise_adapters(actor, seed=3)
    batch = rows([BATCH[0], BATCH[1][:6] + [0] * 4])
    batch["attention_mask"][1, 6:] = 0
    batch["loss_mask"] = batch["attention_mask"].clone()
    assert torch.allclose(padded.compute_logprobs(batch), packed.compute_logprobs(batch), atol=1e-5)
    stats = [actor.update(batch) for actor in (padded, packed)]
    assert stats[0]["grad_norm"] > 0 and abs(stats[0]["grad_norm"] - stats[1]["grad_norm"]) < 1e-4 * stats[0]["grad_norm"]
    assert torch.allclose(padded.compute_logprobs(batch), packed.compute_logprobs(batch), atol=1e-4)


def test_the_kl_reference_of_lora_is_its_own_base_with_no_second_model(model_dir):
    actor = lora_actor(model_dir, kl_coef=0.5, ref_model_path=model_dir)
    assert actor.ref_policy is None
    batch = rows(BATCH)
    assert actor.update(dict(batch))["kl_ref"] == 0.0  # B = 0: the policy is its base
    randomise_adapters(actor, seed=4)
    base = actor.probe_logprobs(BATCH[0], adapters=False)
    assert actor.update(dict(batch))["kl_ref"] > 0
    assert torch.equal(actor.probe_logprobs(BATCH[0], adapters=False), base)  # the base never moves


def test_a_lora_checkpoint_holds_the_adapters_alone_and_resumes_exactly(model_dir, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    actor = lora_actor(model_dir)
    batch = rows(BATCH)
    actor.update(batch)
    actor.save_checkpoint(str(tmp_path / "ckpt"), extra={"step": 1})
    saved = {k for k in FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
             if k.startswith("model.")}
    assert saved == {"model." + n for n, p in actor.model.named_parameters() if p.requires_grad}
    resumed = lora_actor(model_dir)
    assert resumed.load_checkpoint(str(tmp_path / "ckpt")) == {"step": 1}
    for a in (actor, resumed):  # the same next step: adapters, AdamW moments and step count all came back
        a.update(batch)
    assert torch.equal(actor.compute_logprobs(batch), resumed.compute_logprobs(batch))


def test_a_parked_base_waits_in_host_buffers_and_comes_back_for_every_use_unchanged(model_dir, tmp_path):
    # trainer_offload_base: between updates the frozen base lives in (on GPUs page-locked) host buffers; the next
    # log-probs, update, probe or export bring it back. On CPU the move is a copy: what is checked here is that
    # the parameters really sit in the buffers and that every use after a park is the unparked actor's.
    plain, parked = lora_actor(model_dir), lora_actor(model_dir)
    for actor in (plain, parked):
        randomise_adapters(actor, seed=5)
    batch = rows(BATCH)
    frozen = [p for p in parked.model.parameters() if not p.requires_grad]
    parked.park_base()
    assert parked.base_parked and len(parked._host_base) == len(frozen) > 0
    assert all(p.data_ptr() == h.data_ptr() for p, h in zip(frozen, parked._host_base))
    assert torch.equal(parked.compute_logprobs(batch), plain.compute_logprobs(batch)) and not parked.base_parked
    for step in range(2):
        parked.park_base()
        stats = [actor.update(dict(batch), step=step) for actor in (plain, parked)]
        assert stats[1]["grad_norm"] == stats[0]["grad_norm"] > 0
    parked.park_base()
    assert torch.equal(parked.probe_logprobs(BATCH[0]), plain.probe_logprobs(BATCH[0]))
    parked.park_base()
    merged = dict(parked.named_full_parameters(torch.float32))
    for name, tensor in plain.named_full_parameters(torch.float32):
        assert torch.equal(merged[name], tensor), name
    with pytest.raises(ValueError, match="lora_rank > 0"):
        Actor(model_dir, device="cpu").park_base()
    with pytest.raises(ValueError, match="colocate_sleep"):
        check_config(RunConfig(lora_rank=4, trainer_offload_base=True))


# --- the CPU server ---

@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    from lib.launch import launch_cpu_server

    log_path = tmp_path_factory.mktemp("lora_server_log") / "server.log"
    server = launch_cpu_server(model_dir, context_length=256, num_threads=1, log_path=str(log_path), timeout_s=120)
    try:
        yield server.address
    finally:
        server.terminate()


@pytest.fixture(scope="module")
def trained(model_dir, tmp_path_factory):
    """A trainer whose adapters are far from zero, and its adapter directory."""
    actor = lora_actor(model_dir)
    randomise_adapters(actor, seed=2)
    path = str(tmp_path_factory.mktemp("adapters") / "trained")
    actor.save_adapter(path)
    return actor, path


def post(url, path, body):
    return requests.post(url + path, json=body, timeout=TIMEOUT_S)


def prompt_logprobs(url, input_ids, lora_path=None) -> torch.Tensor:
    body = {"input_ids": input_ids, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    if lora_path is not None:
        body["lora_path"] = lora_path
    r = post(url, "/generate", body)
    assert r.status_code == 200, r.text
    return torch.tensor([row[0] for row in r.json()["meta_info"]["input_token_logprobs"][1:]])


def test_a_loaded_adapter_serves_the_trainers_logprobs_and_unloads(server, trained):
    actor, path = trained
    r = post(server, "/load_lora_adapter", {"lora_name": "a", "lora_path": path})
    assert r.status_code == 200 and r.json() == {"success": True, "error_message": "", "loaded_adapters": {"a": path}}
    try:
        served = prompt_logprobs(server, BATCH[0], "a")
        assert (served - actor.probe_logprobs(BATCH[0])).abs().max() < 1e-4
        base = prompt_logprobs(server, BATCH[0])  # no lora_path: the base model
        assert (base - actor.probe_logprobs(BATCH[0], adapters=False)).abs().max() < 1e-4
        assert (served - base).abs().mean() > 0.05
        # one batch, one row with the adapter and one without: each row gets its own
        body = {"input_ids": BATCH, "lora_path": ["a", None], "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        both = post(server, "/generate", body).json()
        row = [torch.tensor([x[0] for x in b["meta_info"]["input_token_logprobs"][1:]]) for b in both]
        assert (row[0] - actor.probe_logprobs(BATCH[0])).abs().max() < 1e-4
        assert (row[1] - actor.probe_logprobs(BATCH[1], adapters=False)).abs().max() < 1e-4
        again = post(server, "/load_lora_adapter", {"lora_name": "a", "lora_path": path})
        assert again.status_code == 400 and "already loaded" in again.json()["error_message"]
    finally:
        r = post(server, "/unload_lora_adapter", {"lora_name": "a"})
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {}
    gone = post(server, "/generate", {"input_ids": BATCH[0], "lora_path": "a", "sampling_params": {"max_new_tokens": 1}})
    assert gone.status_code == 400 and "not loaded" in gone.json()["error"]["message"]
    assert post(server, "/unload_lora_adapter", {"lora_name": "a"}).status_code == 400


def test_a_generate_request_naming_an_unknown_adapter_gets_a_400(server):
    r = post(server, "/generate", {"input_ids": BATCH[0], "lora_path": "policy-v99", "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "policy-v99" in r.json()["error"]["message"]
    r = post(server, "/generate", {"input_ids": BATCH, "lora_path": ["x"], "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400  # one name per input, or one for all


def test_an_adapter_that_does_not_fit_the_model_is_refused_and_nothing_is_loaded(server, trained, tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = trained
    assert post(server, "/load_lora_adapter", {"lora_name": "b", "lora_path": str(tmp_path)}).status_code == 400
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(open(os.path.join(path, "adapter_config.json")).read())
    save_file({k: torch.cat([v, v]) if ".lora_B." in k else v for k, v in tensors.items()},
              str(bad / "adapter_model.safetensors"))
    r = post(server, "/load_lora_adapter", {"lora_name": "b", "lora_path": str(bad)})
    assert r.status_code == 400 and r.json()["success"] is False and "b" not in r.json()["loaded_adapters"]
    assert "the served model needs" in r.json()["error_message"]
    config = json.loads(open(os.path.join(path, "adapter_config.json")).read())
    # configs asking for other math than plain LoRA on this base: refused, never served as plain LoRA
    for key, value in [("use_dora", True), ("alora_invocation_tokens", [5, 6]), ("init_lora_weights", "pissa_niter_4"),
                       ("init_lora_weights", "olora"), ("init_lora_weights", "loftq"), ("use_rslora", "false")]:
        (bad / "adapter_config.json").write_text(json.dumps({**config, key: value}))
        r = post(server, "/load_lora_adapter", {"lora_name": "b", "lora_path": str(bad)})
        assert r.status_code == 400 and key in r.json()["error_message"], (key, value)
    (bad / "adapter_config.json").write_text(json.dumps(config))
    # a file that lacks modules its config targets (a partial write): refused, not served in part
    save_file({k: v for k, v in tensors.items() if ".layers.0.self_attn.q_proj." not in k},
              str(bad / "adapter_model.safetensors"))
    r = post(server, "/load_lora_adapter", {"lora_name": "b", "lora_path": str(bad)})
    assert r.status_code == 400 and "holds no weights for" in r.json()["error_message"]
    assert "model.layers.0.self_attn.q_proj" in r.json()["error_message"]
    # weights that are not finite, and files that are not safetensors: a 400 each
    save_file({k: v.clone().fill_(float("nan")) if ".lora_B." in k else v for k, v in tensors.items()},
              str(bad / "adapter_model.safetensors"))
    r = post(server, "/load_lora_adapter", {"lora_name": "b", "lora_path": str(bad)})
    assert r.status_code == 400 and "NaN or infinite" in r.json()["error_message"]
    whole = open(os.path.join(path, "adapter_model.safetensors"), "rb").read()
    for content in (whole[:len(whole) // 2], b"\x07not a safetensors file"):
        (bad / "adapter_model.safetensors").write_bytes(content)
        r = post(server, "/load_lora_adapter", {"lora_name": "b", "lora_path": str(bad)})
        assert r.status_code == 400 and "not a readable safetensors file" in r.json()["error_message"]
    assert requests.get(server + "/server_info", timeout=TIMEOUT_S).json()["loaded_lora_adapters"] == {}


def disk_sync(actor, server, directory, **kw):
    """A weight sync by disk from `actor` to the module's CPU server, on an event loop of its own: (the loop,
    the client, the sync)."""
    bg = BackgroundLoop()
    client = InferenceClient([server])
    return bg, client, ServerWeightSync("disk", actor, client, bg.run, num_servers=1, disk_dir=str(directory), **kw)


# --- weight sync: adapters by name, requests naming them, the probe ---

def test_adapter_sync_names_the_adapter_in_every_request_and_the_probe_catches_a_server_that_ignores_it(
        server, model_dir, tmp_path):
    actor = lora_actor(model_dir)
    bg, client, sync = disk_sync(actor, server, tmp_path, probe_ids=BATCH[0])
    try:
        for version in (1, 2, 3):
            randomise_adapters(actor, seed=10 + version)
            sync.sync(version)
            assert client.lora_adapter == f"policy-v{version}"
        info = bg.run(client.get_server_info())[0]["loaded_lora_adapters"]
        assert sorted(info) == ["policy-v2", "policy-v3"]  # the two newest stay loaded
        assert sorted(os.listdir(tmp_path)) == ["adapter-v2", "adapter-v3"]
        before = {n: m.lora_B["default"].weight.clone() for n, m in lora_modules(actor.model)}
        rng = torch.get_rng_state()
        metrics = sync.verify_adapters(3)  # adapters moved by a known amount: the server's move is the trainer's
        assert metrics["lora/probe_test_move"] >= 4 * metrics["lora/probe_base_gap"]
        assert metrics["lora/probe_test_miss"] < 1e-4 and metrics["lora/probe_base_gap"] == 1e-3  # fp32: the floor
        assert all(torch.equal(m.lora_B["default"].weight, before[n]) for n, m in lora_modules(actor.model))
        assert torch.equal(torch.get_rng_state(), rng)  # the test draws nothing of the run's
        assert client.lora_adapter == "policy-v3" and sorted(os.listdir(tmp_path)) == ["adapter-v2", "adapter-v3"]
        info = bg.run(client.get_server_info())[0]["loaded_lora_adapters"]
        assert sorted(info) == ["policy-v2", "policy-v3"]  # the test adapter is gone again
        # every request names the adapter: one the server lacks is refused, never served by another
        out = bg.run(client.generate(BATCH[0], max_new_tokens=2, temperature=1.0))
        assert len(out.output_ids) == 2
        client.set_lora_adapter("policy-v4")
        with pytest.raises(InferenceServerError, match="not loaded"):
            bg.run(client.generate(BATCH[0], max_new_tokens=2, temperature=1.0))
        # a server that loads adapters but answers with its base weights: the test stops the run
        client.set_lora_adapter("policy-v3")
        ask = client.prompt_logprobs

        async def ignoring(ids, lora_path=None):
            return await ask(ids, None)
        client.prompt_logprobs = ignoring
        with pytest.raises(ServerIgnoresAdapter, match="does not apply the LoRA adapters it loads"):
            sync.verify_adapters(3)
    finally:
        for name in ("policy-v2", "policy-v3"):
            post(server, "/unload_lora_adapter", {"lora_name": name})
        bg.run(client.close())
        bg.close()


def test_adapters_another_run_left_on_the_server_are_replaced_by_name_and_otherwise_left_alone(
        server, model_dir, trained, tmp_path):
    _, earlier = trained
    for name in ("policy-v0", "policy-v7", "policy-v8"):  # a server that outlived an earlier run
        assert post(server, "/load_lora_adapter", {"lora_name": name, "lora_path": earlier}).status_code == 200
    actor = lora_actor(model_dir)
    bg, client, sync = disk_sync(actor, server, tmp_path, probe_ids=BATCH[0])
    try:
        for version in (0, 1, 2):
            randomise_adapters(actor, seed=20 + version)
            sync.sync(version)
        info = bg.run(client.get_server_info())[0]["loaded_lora_adapters"]
        assert sorted(info) == ["policy-v1", "policy-v2", "policy-v7", "policy-v8"]  # ours: the two newest
        assert sync.adapters_loaded == ["policy-v1", "policy-v2"]
        served = prompt_logprobs(server, BATCH[0], "policy-v2")
        assert (served - actor.probe_logprobs(BATCH[0])).abs().max() < 1e-4
    finally:
        for name in ("policy-v1", "policy-v2", "policy-v7", "policy-v8"):
            post(server, "/unload_lora_adapter", {"lora_name": name})
        bg.run(client.close())
        bg.close()


def test_adapters_travel_in_the_trainers_compute_dtype(server, model_dir, tmp_path):
    from safetensors.torch import load_file

    actor = lora_actor(model_dir, dtype="bfloat16")  # a GPU trainer's dtype: bf16 adapters, half the bytes
    randomise_adapters(actor, seed=7)
    bg, client, sync = disk_sync(actor, server, tmp_path)
    try:
        sync.sync(1)
        tensors = load_file(str(tmp_path / "adapter-v1" / "adapter_model.safetensors"))
        assert tensors and all(t.dtype == torch.bfloat16 for t in tensors.values())
        masters = {f"base_model.model.{n}.lora_A.weight": m.lora_A["default"].weight for n, m in lora_modules(actor.model)}
        assert all(torch.equal(tensors[k], w.detach().to(torch.bfloat16)) for k, w in masters.items())
        out = bg.run(client.generate(BATCH[0], max_new_tokens=2, temperature=1.0))  # the fp32 server serves it
        assert len(out.output_ids) == 2 and client.lora_adapter == "policy-v1"
    finally:
        post(server, "/unload_lora_adapter", {"lora_name": "policy-v1"})
        bg.run(client.close())
        bg.close()


PROBE = [(7 + 37 * i) % 500 + 3 for i in range(64)]  # the probe's length in a run (64 tokens)


class NoisyServer:
    """A client whose one server serves the trainer's log-probs plus a fixed per-token error (the numerical
    noise of bf16 kernels unlike the trainer's), with the trainer's adapters applied `scale` times (1: it
    follows them; 0: it ignores them, serving the base model), `path_noise` more whenever a request names an
    adapter (its LoRA kernels round otherwise than its base path), and `fresh_noise` drawn anew for every
    adapter it loads (SGLang's kind: rounding that changes with the weights, which a move does not cancel)."""
    addresses = ["noisy"]

    def __init__(self, actor, noise: float, scale: float = 1.0, path_noise: float = 0.0, fresh_noise: float = 0.0):
        self.actor, self.scale, self.lora_adapter, self.loaded, self.unloaded = actor, scale, None, [], []
        self.noise = noise * torch.randn(len(PROBE) - 1, generator=torch.Generator().manual_seed(0))
        self.path_noise = path_noise * torch.randn(len(PROBE) - 1, generator=torch.Generator().manual_seed(1))
        self.fresh_noise = fresh_noise

    async def load_lora_adapter(self, name, path):
        self.loaded.append(name)
        return [{"loaded_adapters": {name: path}}]

    async def unload_lora_adapter(self, name):
        self.unloaded.append(name)
        return [{}]

    def set_lora_adapter(self, name):
        self.lora_adapter = name

    async def prompt_logprobs(self, ids, lora_path=None):
        base = self.actor.probe_logprobs(ids, adapters=False)
        move = self.actor.probe_logprobs(ids) - base if lora_path is not None else 0.0
        path = self.path_noise if lora_path is not None else 0.0
        seed = 2 + self.loaded.index(lora_path) if lora_path is not None else 99
        fresh = self.fresh_noise * torch.randn(len(ids) - 1, generator=torch.Generator().manual_seed(seed))
        return [(base + self.scale * move + self.noise + path + fresh).tolist()]


def test_the_adapter_test_moves_past_the_servers_noise_and_tells_a_follower_from_one_that_ignores_or_doubles(
        model_dir, tmp_path):
    actor = lora_actor(model_dir)
    bg = BackgroundLoop()
    try:
        def verify(scale: float, noise: float = 0.02, path_noise: float = 0.0, fresh_noise: float = 0.0):
            server = NoisyServer(actor, noise=noise, scale=scale, path_noise=path_noise, fresh_noise=fresh_noise)
            sync = ServerWeightSync("disk", actor, server, bg.run, num_servers=1, disk_dir=str(tmp_path / "adapters"),
                                    probe_ids=PROBE)
            metrics = sync.verify_adapters(0)
            assert server.lora_adapter == "policy-v0" and server.loaded == ["policy-v0", TEST_ADAPTER]
            assert server.unloaded == [TEST_ADAPTER]
            return metrics

        for adapters in ("at their start (B = 0)", "trained (a resumed run)"):
            if adapters.startswith("trained"):
                randomise_adapters(actor, seed=3)
            # a follower with SGLang's kinds of noise (this random model's log-probs move little: a third of
            # SmolLM2's sizes): 0.02 a token off the trainer, 0.05 more on its LoRA path, 0.015 drawn anew for
            # each adapter; the test's move is 4x past the noise, and matched
            metrics = verify(1.0, path_noise=0.05, fresh_noise=0.015)
            noise = metrics["lora/probe_base_gap"]
            assert noise > 0.015 and metrics["lora/probe_test_move"] >= 4 * noise, adapters
            assert 0.01 < metrics["lora/probe_test_miss"] < 0.5 * (metrics["lora/probe_test_move"] + noise), adapters
            with pytest.raises(ServerIgnoresAdapter, match="does not apply the LoRA adapters it loads"):
                verify(0.0, fresh_noise=0.015)
            with pytest.raises(ServerIgnoresAdapter, match="does not move its log-probs"):
                verify(2.0, fresh_noise=0.015)  # the adapters applied at twice their scale (a lora_alpha mismatch)
        # a server a whole nat a token off the trainer serves another model: stopped before the move
        with pytest.raises(ServerIgnoresAdapter, match="does not serve the trainer's model"):
            verify(1.0, noise=2.0)
        # a server that fails under the test adapter: its error stops the run, and the adapter is unloaded
        failing = NoisyServer(actor, noise=0.02)
        answer = failing.prompt_logprobs

        async def fails_on_the_test(ids, lora_path=None):
            if lora_path == TEST_ADAPTER:
                raise InferenceServerError("the server broke", address="noisy")
            return await answer(ids, lora_path)
        failing.prompt_logprobs = fails_on_the_test
        sync = ServerWeightSync("disk", actor, failing, bg.run, num_servers=1, disk_dir=str(tmp_path / "adapters"),
                                probe_ids=PROBE)
        before = {n: m.lora_B["default"].weight.clone() for n, m in lora_modules(actor.model)}
        with pytest.raises(InferenceServerError, match="the server broke"):
            sync.verify_adapters(0)
        assert failing.unloaded == [TEST_ADAPTER] and not os.path.exists(tmp_path / "adapters" / "adapter-test")
        assert all(torch.equal(m.lora_B["default"].weight, before[n]) for n, m in lora_modules(actor.model))
    finally:
        bg.close()


def test_merged_sync_gives_a_server_without_adapters_the_adapted_weights(server, model_dir, tmp_path, monkeypatch):
    actor = lora_actor(model_dir)
    randomise_adapters(actor, seed=5)
    bg, client, sync = disk_sync(actor, server, tmp_path / "weights", lora_sync="merged", probe_ids=BATCH[0])
    try:
        sync.sync(1)
        assert client.lora_adapter is None  # full weights: requests name no adapter
        assert "model.safetensors" in os.listdir(tmp_path / "weights")  # the merged full model, by weight_sync disk
        # sleep mode: the trainer's forwards run while the server has lent its memory (asked while released,
        # the CPU server refuses), the server takes it back before the test's syncs
        events, forward = [], actor.probe_logprobs
        for name in ("release_memory_occupation", "resume_memory_occupation", "update_weights_from_disk"):
            async def logged(*a, _call=getattr(client, name), _name=name, **kw):
                events.append(_name)
                return await _call(*a, **kw)
            monkeypatch.setattr(client, name, logged)
        monkeypatch.setattr(actor, "probe_logprobs", lambda *a, **kw: events.append("forward") or forward(*a, **kw))
        # the moved weights, then the real ones again, each
        metrics = sync.verify_adapters(1, park_base=True, lend_memory=True)
        assert events[0] == "release_memory_occupation" and events[-3:] == ["resume_memory_occupation"] + [
            "update_weights_from_disk"] * 2 and set(events[1:-3]) == {"forward"}
        # no move big enough to test: no test sync, but the server, whose released weights SGLang leaves
        # undefined, still gets the real ones back
        events.clear()
        with monkeypatch.context() as m:
            m.setattr("lib.weight_sync.PROBE_TEST_MOVE", 1e9)
            assert "lora/probe_test_move" not in sync.verify_adapters(1, park_base=True, lend_memory=True)
        assert events[0] == "release_memory_occupation" and events[-2:] == ["resume_memory_occupation",
                                                                            "update_weights_from_disk"]
        # the test stopping the run while the server has lent its memory: the server takes it back, the
        # test's own error is the one raised
        events.clear()
        with monkeypatch.context() as m:
            m.setattr("lib.weight_sync.PROBE_MAX_BASE_GAP", -1.0)
            with pytest.raises(ServerIgnoresAdapter, match="does not serve the trainer's model"):
                sync.verify_adapters(1, park_base=True, lend_memory=True)
        assert events[0] == "release_memory_occupation" and events[-1] == "resume_memory_occupation"
        monkeypatch.undo()
        assert actor.base_parked  # merged from the base in host memory, as a sleep-mode run's syncs are
        assert metrics["lora/probe_test_miss"] < 1e-4 and metrics["lora/probe_test_move"] >= 4e-3
        assert (prompt_logprobs(server, BATCH[0]) - actor.probe_logprobs(BATCH[0])).abs().max() < 1e-4
        # a server that answers every weight update and keeps its old weights: stopped by the test
        update, calls = client.update_weights_from_disk, []

        async def kept(path, **kw):
            return [{"success": True, "message": "kept"}]
        client.update_weights_from_disk = kept
        with pytest.raises(ServerIgnoresAdapter, match="does not hold the merged weights"):
            sync.verify_adapters(1)

        async def keeps_the_test_weights(path, **kw):  # loads the test's weights, then not the real ones again
            calls.append(path)
            return await update(path, **kw) if len(calls) == 1 else [{"success": True, "message": "kept"}]
        client.update_weights_from_disk = keeps_the_test_weights
        with pytest.raises(ServerIgnoresAdapter, match="did not come back to the trainer's weights"):
            sync.verify_adapters(1)
        assert len(calls) == 2
        client.update_weights_from_disk = update
        sync.sync(1)
        # colocated (tensor): the merged weights are copies, handed over a bucket at a time; only the last
        # call names the version
        bg.run(client.update_weights_from_disk(model_dir))
        calls, send = [], client.update_weights_from_tensor

        async def counted(payload, **kw):
            calls.append(kw["weight_version"])
            assert kw["flush_cache"] == (kw["weight_version"] is not None)  # the last call flushes, only it
            return await send(payload, **kw)
        client.update_weights_from_tensor = counted
        by_tensor = ServerWeightSync("tensor", actor, client, bg.run, num_servers=1, disk_dir=str(tmp_path / "w2"),
                                     lora_sync="merged", bucket_mb=0.05)
        by_tensor.sync(2)
        assert len(calls) > 5 and calls[-1] == "2" and set(calls[:-1]) == {None}
        assert (prompt_logprobs(server, BATCH[0]) - actor.probe_logprobs(BATCH[0])).abs().max() < 1e-4
    finally:
        bg.run(client.update_weights_from_disk(model_dir))  # the module's server back on its base weights
        bg.run(client.close())
        bg.close()
    assert (prompt_logprobs(server, BATCH[0]) - actor.probe_logprobs(BATCH[0], adapters=False)).abs().max() < 1e-4


# --- end to end ---
SMALL = ["--batch_size", "4", "--group_size", "4", "--max_turns", "3", "--max_new_tokens_per_turn", "16",
         "--max_tokens", "128", "--eval_every", "0", "--test_size", "2", "--tensorboard", "False"]


def _fsdp_lora_rank(rank: int, port: int, model_dir: str, out_dir: str):
    import torch.distributed as dist

    from lib.lora import adapter_tensors

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        actor = lora_actor(model_dir, max_tokens_per_mb=12 if rank == 0 else 100)  # unequal micro-batches
        actor.load_checkpoint(os.path.join(out_dir, "start"))
        stats = actor.update(rows(BATCH))
        adapters = adapter_tensors(actor.model)  # collective: every rank gathers
        if rank == 0:
            torch.save({"stats": stats, "adapters": adapters}, os.path.join(out_dir, "rank0.pt"))
    finally:
        dist.destroy_process_group()


def test_fsdp2_lora_update_on_two_processes_equals_the_single_process_update(model_dir, tmp_path):
    """Adapters far from B = 0 (both A and B get gradients), sharded by FSDP2 over two gloo ranks: the
    update is the single process's, to float32 rounding."""
    from lib.lora import adapter_tensors

    start = lora_actor(model_dir)
    randomise_adapters(start, seed=21)
    start.save_checkpoint(str(tmp_path / "start"))
    run_two_ranks(_fsdp_lora_rank, model_dir, str(tmp_path), timeout_s=60)
    fsdp = torch.load(tmp_path / "rank0.pt", weights_only=False)
    single = lora_actor(model_dir)
    single.load_checkpoint(str(tmp_path / "start"))
    before = {name: t.clone() for name, t in adapter_tensors(single.model).items()}
    stats = single.update(rows(BATCH))
    after = adapter_tensors(single.model)
    assert fsdp["stats"]["loss"] == pytest.approx(stats["loss"], abs=1e-6)
    assert fsdp["stats"]["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-5)
    moved_a = [k for k in after if ".lora_A." in k and not torch.equal(after[k], before[k])]
    assert len(moved_a) == len(after) // 2  # every A moved too, not only B
    for name, tensor in after.items():
        assert torch.allclose(fsdp["adapters"][name], tensor, atol=1e-6), name


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])  # 2: torchrun, FSDP2 over gloo on CPU
def test_two_lora_grpo_steps_of_train_calc_then_a_resume_with_trained_adapters(tmp_path, ranks):
    run_dir = str(tmp_path / "run")
    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--nproc_per_node", "2"] if ranks > 1 else [])
    # one process: also sleep mode with the frozen base parked in host memory while the server works (the CPU
    # server's release and resume mark it released; the run's order of park, sync and resume is the GPU's)
    shape = (["--batch_size", "3", "--group_size", "3", "--ppo_minibatches", "2"] if ranks > 1
             else ["--colocate_sleep", "True", "--trainer_offload_base", "True"])
    args = [*launcher, "train_calc.py", "--run_dir", run_dir, *SMALL, *shape, "--warm_start_steps", "2",
            "--warm_start_batch_size", "2", "--lr", "1e-3", "--checkpoint_every", "1", "--lora_rank", "8"]
    first = subprocess.run(args + ["--max_steps", "2"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "rollout/reward" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # the adapter of each version served, the server's log-probs the trainer's (as full fine-tuning's)
        assert r["logprob/server_trainer_abs_diff_max"] < 1e-3 and r["rollout/failed_groups"] == 0
        assert ("perf/park_base_s" in r) == (ranks == 1)
    adapter_dir = os.path.join(run_dir, "weights", "adapter-v2")
    assert sorted(os.listdir(adapter_dir)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert os.path.exists(os.path.join(run_dir, "final", "model.safetensors"))  # the merged model, for any server
    checkpoint = os.path.join(run_dir, "checkpoints", "latest")
    if ranks == 1:  # a resume with another LoRA scale or placement is refused at once, naming the setting
        for other, key in ((["--lora_alpha", "16"], "lora_alpha"), (["--lora_target_modules", '["q_proj"]'],
                                                                    "lora_target_modules")):
            refused = subprocess.run(args + ["--max_steps", "3", "--resume", "True", *other], cwd=REPO,
                                     capture_output=True, text=True, timeout=600)
            assert refused.returncode != 0 and f"was trained with {key}" in refused.stderr, refused.stderr[-2000:]
    assert sum(os.path.getsize(os.path.join(checkpoint, f)) for f in os.listdir(checkpoint)) < 4e6  # the model is 17 MB

    # A 2-step run on a barely warm-started model has all-equal rewards, so its adapters stay at B = 0. Give the
    # checkpoint adapters far from zero, so that the resumed run's server must apply them to agree with the trainer.
    base = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))["base_model_name_or_path"]
    actor = Actor(base, device="cpu", lora_rank=8, lora_alpha=32.0, lora_target_modules=list(DEFAULT_TARGET_MODULES))
    extra = actor.load_checkpoint(checkpoint)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, module in lora_modules(actor.model):
            module.lora_B["default"].weight.copy_(torch.randn(module.lora_B["default"].weight.shape, generator=g) * 0.02)
    actor.save_checkpoint(checkpoint, extra=extra)
    moved = (actor.probe_logprobs(BATCH[0]) - actor.probe_logprobs(BATCH[0], adapters=False)).abs().mean()
    assert moved > 0.05

    second = subprocess.run(args + ["--max_steps", "3", "--resume", "True"], cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 2 (policy version 2" in second.stdout
    assert "LoRA: the servers follow the trainer's adapters (a test move of" in second.stdout
    tests = [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "lora/probe_test_miss" in r]
    assert [r["step"] for r in tests] == [1, 3]  # the start-up test of each run, in its first step's row
    assert all(r["lora/probe_test_miss"] < 1e-4 for r in tests)
    rows = [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "rollout/reward" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["logprob/server_trainer_abs_diff_max"] < 1e-3  # sampled under the resumed, non-zero adapters
