"""YAML config with command-line overrides."""
from dataclasses import dataclass, field

import os

import pytest

from lib.config import load_config


@dataclass
class Cfg:
    max_turns: int = 4
    lr: float = 1e-6
    name: str = "x"
    wandb_project: str | None = None
    addrs: list = field(default_factory=list)


def test_yaml_then_command_line_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_turns: 8\nlr: 1\naddrs: [a, b]\n")
    cfg = load_config(Cfg, str(path), {"max_turns": 32})
    assert cfg.max_turns == 32 and cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.addrs == ["a", "b"]


def test_unknown_key_names_the_valid_ones():
    with pytest.raises(ValueError, match="max_turn.*valid keys: addrs, lr, max_turns"):
        load_config(Cfg, None, {"max_turn": 3})


def test_a_mistyped_flag_is_blamed_on_the_command_line_with_a_suggestion_not_on_the_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_turns: 8\n")
    with pytest.raises(ValueError, match=r"'max_turn' \(did you mean 'max_turns'\?\) on the command line"):
        load_config(Cfg, str(path), {"max_turn": 3})
    path.write_text("lrr: 1\n")
    with pytest.raises(ValueError, match=f"'lrr' \\(did you mean 'lr'\\?\\) in {path}"):
        load_config(Cfg, str(path), {})


def test_a_missing_config_file_says_how_to_run_without_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="--config None"):
        load_config(Cfg, str(tmp_path / "nope.yaml"), {})
    assert load_config(Cfg, None, {}).max_turns == 4


def test_wrong_type_is_rejected_with_the_field_name():
    with pytest.raises(TypeError, match="max_turns"):
        load_config(Cfg, None, {"max_turns": "many"})


def test_none_string_becomes_none_for_optional_fields():
    assert load_config(Cfg, None, {"wandb_project": "None"}).wandb_project is None


@pytest.mark.parametrize("script", ["train_calc", "train_tir", "train_search", "train_reflect", "train_agent"])
def test_help_lists_every_config_field_with_its_type_default_and_meaning(script):
    import dataclasses
    import importlib

    from lib.config import config_help

    cls = importlib.import_module(script).Config
    text = config_help(cls)
    for f in dataclasses.fields(cls):
        assert f"  --{f.name} " in text, f.name
    assert "  --lr float  (default: " in text and "\nrun:\n" in text  # grouped by the Config's sections
    assert text.startswith(importlib.import_module(script).__doc__.strip()[:40])  # the script's usage first


def test_help_on_the_command_line_prints_and_exits_0():
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "train_calc.py", "--help"], cwd=repo, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--warm_start_steps int | None  (default: None)" in done.stdout and "Traceback" not in done.stderr


@pytest.mark.parametrize("script, config", [("train_calc", "calc_tiny"), ("train_tir", "tir_tiny"),
                                            ("train_search", "search_tiny"), ("train_reflect", "reflect_tiny")])
def test_a_pretrained_model_given_with_a_tiny_config_gets_no_warm_start_unless_asked(script, config):
    """The tiny configs' warm start is the embedded model's (lr 2e-3 would wreck a pretrained one):
    `--model_path Qwen/...` with the default config trains the model as released."""
    import importlib

    from lib.warm_start import steps_and_lr

    cfg = load_config(importlib.import_module(script).Config, f"configs/{config}.yaml", {"model_path": "Qwen/Qwen2.5-1.5B"})
    assert steps_and_lr(cfg.warm_start_steps, cfg.warm_start_lr, False, 300)[0] == 0
    assert steps_and_lr(cfg.warm_start_steps, cfg.warm_start_lr, True, 300) == (300, 2e-3)
    asked = load_config(importlib.import_module(script).Config, f"configs/{config}.yaml", {"warm_start_steps": 50})
    assert steps_and_lr(asked.warm_start_steps, asked.warm_start_lr, False, 300) == (50, 5e-5)


SCRIPT_OF_CONFIG = {"calc": "train_calc", "tir": "train_tir", "search": "train_search", "reflect": "train_reflect",
                    "agent": "train_agent"}


CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


@pytest.mark.parametrize("config", sorted(f for f in os.listdir(CONFIGS) if f.endswith(".yaml")
                                          and f.split("_")[0] in SCRIPT_OF_CONFIG))
def test_every_shipped_config_loads_into_its_scripts_config(config):
    """A typo'd key or a wrong type in a shipped config fails here, not an hour into a GPU lease."""
    import importlib

    cls = importlib.import_module(SCRIPT_OF_CONFIG[config.split("_")[0]]).Config
    cfg = load_config(cls, os.path.join(CONFIGS, config), {})
    assert isinstance(cfg, cls)


def test_the_smollm2_recipes_warm_start_then_test_before_and_after():
    import importlib

    for name in ("calc", "tir", "search"):
        cfg = load_config(importlib.import_module(SCRIPT_OF_CONFIG[name]).Config,
                          os.path.join(CONFIGS, f"{name}_smollm2.yaml"), {})
        assert cfg.model_path == "smollm2-135m-instruct" and cfg.warm_start_steps > 0 and cfg.test_at_start
