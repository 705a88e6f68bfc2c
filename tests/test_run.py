"""lib/run.py's own rules: the shared config's checks and what happens at the end of a run. The
phases of a GRPO step are in tests/test_grpo_step.py; a seeded run of each script in
tests/test_seeded_runs.py."""
import os
import types

import pytest

import lib.run
import train_calc
from lib.run import RunConfig, check_config, finish_training, inert_fields


def test_a_field_set_where_it_has_no_effect_is_named_in_a_warning(capsys):
    check_config(RunConfig(mode="sync", max_staleness=3, server="cpu", mem_fraction_static=0.5))
    err = capsys.readouterr().err
    assert "max_staleness=3 has no effect here" in err and "--mode async" in err
    assert "mem_fraction_static=0.5 has no effect here" in err


def test_fields_left_at_their_defaults_or_in_effect_raise_no_warning():
    assert inert_fields(RunConfig()) == []
    assert inert_fields(RunConfig(mode="async", max_staleness=3, server="sglang", mem_fraction_static=0.5)) == []
    assert inert_fields(train_calc.Config()) == []  # a script's own defaults too


@pytest.mark.parametrize("bad, match", [(dict(mode="both"), "mode must be one of"),
                                        (dict(server="external"), "needs server_addrs"),
                                        (dict(colocate_sleep=True, mode="async", server="sglang"), "needs mode sync"),
                                        (dict(temperature=0.0), "temperature must be"),
                                        (dict(temperature=float("nan")), "temperature must be")])
def test_a_config_that_cannot_run_is_refused_naming_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        check_config(RunConfig(**bad))


def test_the_final_weights_are_saved_before_the_test_evaluation(tmp_path, monkeypatch):
    # Under torchrun the save is collective: the other ranks must not wait in it through rank 0's test.
    order = []
    actor = types.SimpleNamespace(save_hf=lambda path: order.append(("save", os.path.basename(path))))
    monkeypatch.setattr(lib.run, "run_evaluation", lambda run, split, items: order.append(("test", split)) or {})
    run = lib.run.Run(RunConfig(run_dir=str(tmp_path)), actor=actor, test_items=[])
    finish_training(run)
    assert order == [("save", "final"), ("test", "test")]


def test_the_warm_start_runs_on_every_core_and_trainer_threads_apply_after_it(tmp_path, monkeypatch):
    # trainer_threads leaves cores to a server beside the trainer; the warm start runs before any server.
    import torch

    from lib.tiny_model import default_tiny_model_dir

    class Stop(Exception):
        pass

    seen = {}

    def build_model(base, embedded):
        seen["threads"] = torch.get_num_threads()
        raise Stop

    cores = torch.get_num_threads()
    cfg = RunConfig(run_dir=str(tmp_path), model_path=default_tiny_model_dir(), trainer_threads=1)
    try:
        with pytest.raises(Stop):
            lib.run.open_run(cfg, build_model, lambda: {})
        assert seen["threads"] == cores
    finally:
        torch.set_num_threads(cores)
