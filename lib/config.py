"""Config: a script's dataclass, filled from a YAML file and then from command-line overrides.

`python train_search.py --config configs/search_qwen2.5_3b.yaml --max_turns 32` reads the YAML, then
applies `max_turns=32` (fire has already parsed the command line into Python values).
"""
import dataclasses
import difflib
import os
import typing

import yaml


def load_config(cls, config_path: str | None, overrides: dict):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    if config_path:
        if not os.path.exists(config_path):
            raise FileNotFoundError(f"config file {config_path} not found; pass --config PATH, or --config None to "
                                    f"start from the defaults of {cls.__name__} in the script")
        with open(config_path) as f:
            from_file = yaml.safe_load(f) or {}
        _reject_unknown(from_file, fields, f"in {config_path}")
        values.update(from_file)
    _reject_unknown(overrides, fields, "on the command line")
    values.update(overrides)
    hints = typing.get_type_hints(cls)
    return cls(**{k: _coerce(k, v, hints[k]) for k, v in values.items()})


def _reject_unknown(values: dict, fields: dict, where: str):
    unknown = sorted(set(values) - set(fields))
    if unknown:
        hints = [f"{k!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(k, fields, n=1)) else repr(k)
                 for k in unknown]
        raise ValueError(f"unknown config key {', '.join(hints)} {where}; valid keys: {', '.join(sorted(fields))}")


def _coerce(name, value, hint):
    """YAML and fire give ints for floats (`lr: 1` ) and strings for None-able fields; fix the easy
    cases and reject the rest with a message naming the field."""
    origin = typing.get_origin(hint)
    allowed = typing.get_args(hint) if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) else (hint,)
    if value is None and type(None) in allowed:
        return None
    if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in allowed:
        return None
    for t in allowed:
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is bool and isinstance(value, bool):
            return value
        if t is str and isinstance(value, str):
            return value
        if (t in (list, tuple) or typing.get_origin(t) in (list, tuple)) and isinstance(value, (list, tuple)):
            return list(value)
    if str in allowed:
        return str(value)
    raise TypeError(f"config key {name!r} expects {hint}, got {value!r} ({type(value).__name__})")


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
