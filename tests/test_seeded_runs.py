"""A seeded run of each training script repeats: the same rollouts, losses and final weights as the
run recorded in tests/seeded_runs.json, so a change to the shared plumbing (lib/run.py) or to a
script that should not change what it trains shows up here.

The record is only meaningful on the platform it was made on (CPU numerics differ between torch
builds and CPU kinds): on another one the test skips, naming both. Re-record after a change that
is meant to change what a run trains: `python tests/test_seeded_runs.py --record`.
"""
import importlib
import json
import os
import platform
import sys

import pytest

RECORD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seeded_runs.json")
COMMON = dict(max_steps=3, batch_size=2, group_size=2, eval_every=0, eval_size=4, test_size=4, checkpoint_every=0,
              tensorboard=False, warm_start_steps=4, warm_start_batch_size=4, ppo_minibatches=2, trainer_threads=1,
              server_threads=1, seeded_sampling=True)
SCRIPTS = {"train_calc": {}, "train_tir": {}, "train_search": dict(max_turns=3, warm_start_direct_steps=2, warm_start_worlds=0),
           "train_reflect": dict(max_turns=2, warm_start_direct_steps=2, warm_start_problems=2000)}
KEYS = ("step", "rollout/reward", "rollout/gen_tokens", "loss/loss", "loss/grad_norm")


def platform_id() -> str:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return f"torch {torch.__version__}, {platform.machine()}, {cpu}"


def seeded_run(name: str, run_dir: str) -> dict:
    """Three sync GRPO steps of `name` on its tiny config, seeded: per-step metrics and the final
    weights' sum of absolute values."""
    import safetensors.torch

    script = importlib.import_module(name)
    script.main(config=f"configs/{name.split('_')[1]}_tiny.yaml", run_dir=run_dir, **COMMON, **SCRIPTS[name])
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    weights = safetensors.torch.load_file(os.path.join(run_dir, "final", "model.safetensors"))
    return {"steps": [{k: r[k] for k in KEYS if k in r} for r in rows if "rollout/reward" in r],
            "weights_abs_sum": sum(float(w.double().abs().sum()) for w in weights.values())}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_a_seeded_run_repeats_the_recorded_rollouts_losses_and_weights(name, tmp_path):
    record = json.load(open(RECORD))
    if record["platform"] != platform_id():
        pytest.skip(f"recorded on {record['platform']}, this is {platform_id()}")
    got, want = seeded_run(name, str(tmp_path / name)), record["runs"][name]
    assert [s["rollout/gen_tokens"] for s in got["steps"]] == [s["rollout/gen_tokens"] for s in want["steps"]]
    for g, w in zip(got["steps"], want["steps"]):
        assert g.keys() == w.keys() and g["rollout/reward"] == w["rollout/reward"]
        for k in ("loss/loss", "loss/grad_norm"):
            if k in w:
                assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-7), (g["step"], k)
    assert got["weights_abs_sum"] == pytest.approx(want["weights_abs_sum"], rel=1e-9)


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    import tempfile

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: seeded_run(name, os.path.join(tmp, name)) for name in SCRIPTS}
    with open(RECORD, "w") as f:
        json.dump({"platform": platform_id(), "runs": runs}, f, indent=1)
    print(json.dumps(runs, indent=1))
