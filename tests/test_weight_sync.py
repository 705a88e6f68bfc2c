"""Weight sync against lib's CPU server: after a sync the server generates with the trainer's
weights, by the disk path, the gloo broadcast path and the tensor-handle path alike; hostile
tensor payloads are refused with nothing changed; a released server generates nothing until resumed."""
import asyncio

import pytest
import torch

from lib.actor import Actor
from lib.client import InferenceClient, InferenceServerError
from lib.launch import free_port, launch_cpu_server
from lib.tiny_model import build_tiny_model
from lib.weight_sync import DistributedWeightSync, sync_weights_from_disk, sync_weights_from_tensor

TEXTS = [f"Ilvan Moresk was born in {c}. <search> {c} </search> <answer> {i} </answer>"
         for i, c in enumerate(["Tarsk", "Velmoor", "Quenby", "Ostrava", "Lindel"] * 40)]
ARCH = dict(vocab_size=384, hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2)
PROMPT = [5, 17, 42, 99, 7]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("weight_sync") / "model"), TEXTS, seed=0, **ARCH)


@pytest.fixture(scope="module")
def server(model_dir):
    server = launch_cpu_server(model_dir, num_threads=1, random_seed=0, timeout_s=120)
    yield server.address
    server.terminate()


@pytest.fixture(scope="module")
def trained_actor(model_dir):
    """An actor whose weights differ clearly from the server's initial ones."""
    torch.manual_seed(0)
    actor = Actor(model_dir, lr=0.05, grad_clip=1e3)
    ids = torch.randint(0, 300, (4, 12))
    mask = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask, "advantages": torch.tensor([1.0, -1, 1, -1])}
    batch["logprobs"] = actor.compute_logprobs(batch)
    actor.update(batch)
    return actor


async def greedy(client, n=8):
    generation = await client.generate(PROMPT, max_new_tokens=n, temperature=0.0,
                                       extra_sampling_params={"ignore_eos": True})
    return generation


def trainer_logprobs(actor, generation) -> list[float]:
    ids = torch.tensor([PROMPT + generation.output_ids])
    lp = actor.compute_logprobs({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return lp[0, len(PROMPT):].tolist()


async def reset(client, model_dir):
    await client.update_weights_from_disk(model_dir, weight_version="default")


def test_disk_sync_makes_the_server_compute_the_trainers_logprobs(server, model_dir, trained_actor, tmp_path):
    async def main():
        client = InferenceClient([server])
        try:
            before = await greedy(client)
            seconds = await sync_weights_from_disk(trained_actor, client, str(tmp_path / "weights"), 3)
            after = await greedy(client)
            await reset(client, model_dir)
            return before, after, seconds
        finally:
            await client.close()

    before, after, seconds = asyncio.run(main())
    assert seconds > 0
    assert after.weight_version == "3"
    assert after.logprobs != before.logprobs
    assert after.logprobs == pytest.approx(trainer_logprobs(trained_actor, after), abs=1e-4)


@pytest.mark.parametrize("flattened", [False, True])
def test_gloo_broadcast_sync_gives_the_same_server_outputs_as_disk_sync(server, model_dir, trained_actor, tmp_path,
                                                                        flattened):
    async def main():
        client = InferenceClient([server])
        try:
            await sync_weights_from_disk(trained_actor, client, str(tmp_path / "weights"), 1)
            via_disk = await greedy(client)
            await reset(client, model_dir)
            sync = DistributedWeightSync(client, master_port=free_port("127.0.0.1"), world_size=2, rank_offsets=[1],
                                         backend="gloo", group_name=f"test_sync_{flattened}", timeout_s=60)
            await sync.init()
            try:
                # 16 KB buckets: the tiny model's tensors span several HTTP calls.
                await sync.update(trained_actor.named_full_parameters(), version=2, bucket_mb=1 / 64,
                                  flattened=flattened)
                via_broadcast = await greedy(client)
            finally:
                await sync.close()
                await reset(client, model_dir)
            return via_disk, via_broadcast
        finally:
            await client.close()

    via_disk, via_broadcast = asyncio.run(main())
    assert via_broadcast.weight_version == "2"
    assert via_broadcast.output_ids == via_disk.output_ids
    assert via_broadcast.logprobs == via_disk.logprobs


# --- colocated: tensors handed over by handle (/update_weights_from_tensor) ---

def test_tensor_sync_gives_the_same_server_outputs_as_disk_sync(server, model_dir, trained_actor, tmp_path):
    async def main():
        client = InferenceClient([server])
        try:
            await sync_weights_from_disk(trained_actor, client, str(tmp_path / "weights"), 1)
            via_disk = await greedy(client)
            await reset(client, model_dir)
            seconds = await sync_weights_from_tensor(trained_actor, client, 4)
            via_tensor = await greedy(client)
            await reset(client, model_dir)
            return via_disk, via_tensor, seconds
        finally:
            await client.close()

    via_disk, via_tensor, seconds = asyncio.run(main())
    assert seconds > 0
    assert via_tensor.weight_version == "4"
    assert via_tensor.output_ids == via_disk.output_ids
    assert via_tensor.logprobs == via_disk.logprobs


def _post(address, path, body):
    import requests

    return requests.post(address + path, json=body, timeout=30)


class _Shell:  # pickles as a call of os.system: what a hostile payload would carry
    def __reduce__(self):
        import os

        return os.system, ("touch /tmp/agentrl_pwned",)


def _hostile_payloads(model_dir):
    import base64
    import pickle

    from lib.tensor_ipc import serialize_named_tensors

    good_name = "model.norm.weight"
    return {
        "a foreign class": base64.b64encode(pickle.dumps([("x", _Shell())])).decode(),
        "not base64": "%%% not base64 %%%",
        "a truncated pickle": serialize_named_tensors([(good_name, torch.ones(32))])[:40],
        "a name the model lacks": serialize_named_tensors([("no.such.weight", torch.ones(32))]),
        "a wrong shape": serialize_named_tensors([(good_name, torch.ones(31))]),
        "integer weights": serialize_named_tensors([(good_name, torch.ones(32, dtype=torch.int64))]),
        "a dict instead of pairs": base64.b64encode(pickle.dumps({"x": 1})).decode(),
    }


def test_tensor_sync_refuses_hostile_payloads_with_400_and_keeps_the_weights(server, model_dir):
    import os

    async def outputs():
        client = InferenceClient([server])
        try:
            return await greedy(client)
        finally:
            await client.close()

    before = asyncio.run(outputs())
    for what, payload in _hostile_payloads(model_dir).items():
        r = _post(server, "/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
        assert r.status_code == 400, (what, r.status_code, r.text)
        assert r.json()["success"] is False, what
    for body in ({}, {"serialized_named_tensors": []}, {"serialized_named_tensors": "abc"},
                 {"serialized_named_tensors": [1]}, {"serialized_named_tensors": ["x"], "load_format": "direct"}):
        assert _post(server, "/update_weights_from_tensor", body).status_code == 400, body
    assert not os.path.exists("/tmp/agentrl_pwned")
    after = asyncio.run(outputs())
    assert (after.output_ids, after.logprobs, after.weight_version) == (before.output_ids, before.logprobs,
                                                                        before.weight_version)


def test_released_server_refuses_generation_until_resumed(server):
    async def main():
        client = InferenceClient([server])
        try:
            await client.release_memory_occupation(["kv_cache"])
            with pytest.raises(InferenceServerError) as refused:
                await greedy(client)
            await client.resume_memory_occupation()
            return refused.value, await greedy(client)
        finally:
            await client.close()

    refused, generation = asyncio.run(main())
    assert refused.status == 400 and "resume_memory_occupation" in str(refused)
    assert len(generation.output_ids) == 8
    assert _post(server, "/release_memory_occupation", {"tags": ["gpu"]}).status_code == 400


def test_closing_the_broadcast_group_after_the_server_died_warns_instead_of_raising(model_dir, trained_actor,
                                                                                   tmp_path, capfd):
    # A run that ends because something failed (a checkpoint write, a dead server) closes the group in
    # its `finally`: that must not replace the real error by a "cannot connect".
    from lib.async_rollout import BackgroundLoop
    from lib.weight_sync import ServerWeightSync

    own_server = launch_cpu_server(model_dir, num_threads=1, random_seed=0, timeout_s=120)
    bg = BackgroundLoop()
    client = InferenceClient([own_server.address], max_retries=0)
    try:
        sync = ServerWeightSync("nccl", trained_actor, client, bg.run, num_servers=1, disk_dir=str(tmp_path))
        assert sync.sync(1) >= 0
        own_server.terminate()
        sync.close()  # returns
        assert "could not close the weight-update group" in capfd.readouterr().err
    finally:
        own_server.terminate()
        bg.run(client.close(), timeout_s=30)
        bg.close()


def test_a_server_that_never_answers_the_disk_update_fails_the_sync_within_its_bound_naming_server_and_call(tmp_path):
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    from lib.async_rollout import BackgroundLoop
    from lib.weight_sync import ServerWeightSync, WeightSyncTimeout

    never = threading.Event()

    class NeverAnswers(BaseHTTPRequestHandler):
        def do_POST(self):
            never.wait()

    stub = ThreadingHTTPServer(("127.0.0.1", 0), NeverAnswers)
    stub.daemon_threads = True
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    address = f"http://127.0.0.1:{stub.server_port}"
    actor = SimpleNamespace(device=torch.device("cpu"), world_size=1, compute_dtype=torch.float32,
                            save_hf=lambda path: None)
    bg = BackgroundLoop()
    client = InferenceClient([address], max_retries=0)
    try:
        sync = ServerWeightSync("disk", actor, client, bg.run, num_servers=1, disk_dir=str(tmp_path), timeout_s=1.0)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncTimeout) as error:
            sync.sync(3)
        assert time.monotonic() - t0 < 1.0 + 10
    finally:
        never.set()
        stub.shutdown()
        bg.run(client.close(), timeout_s=30)
        bg.close()
    assert f"POST {address}/update_weights_from_disk" in str(error.value)
    assert "weight_sync_timeout_s" in str(error.value)
