"""Config: a script's dataclass, filled from a YAML file and then from command-line overrides.

`python train_search.py --config configs/search_qwen2.5_3b.yaml --max_turns 32` reads the YAML, then
applies `max_turns=32` (fire has already parsed the command line into Python values).
"""
import dataclasses
import difflib
import inspect
import os
import re
import sys
import typing

import yaml


def load_config(cls, config_path: str | None, overrides: dict):
    if overrides.get("help") is True or overrides.get("h") is True:  # `--help` / `-h`, as fire passes them
        print(config_help(cls))
        sys.exit(0)
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


_FIELD = re.compile(r"^    (\w+): ([^=]+?)(?: = (.*?))?(?:  # (.*))?$")
_SECTION = re.compile(r"^    # (?:==|---) (.*?) (?:==|---)$")


def config_help(cls) -> str:
    """The script's usage (its module docstring), then every field of `cls` with its type, default and
    the comment written beside it (and above it), grouped under the Config's section markers
    (`# == name ==`): the script's own fields first, then those it shares from lib (its base class)."""
    doc = (sys.modules[cls.__module__].__doc__ or "").strip()
    out = [doc, "", "Options (--name value; --config FILE.yaml first, the command line over it):"] if doc else []
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else
                (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
                for f in dataclasses.fields(cls)}
    printed = set()
    for klass in [k for k in cls.__mro__ if dataclasses.is_dataclass(k)]:  # the script's fields, then lib's shared ones
        notes = []
        for line in inspect.getsource(klass).splitlines()[1:]:
            if (section := _SECTION.match(line)):
                out += ["", f"{section.group(1)}:"]
                notes = []
            elif line.strip().startswith("#"):
                notes.append(line.strip().lstrip("#").strip())
            elif (found := _FIELD.match(line)) and found.group(1) in defaults and found.group(1) not in printed:
                name, hint, _, comment = found.groups()
                printed.add(name)
                out.append(f"  --{name} {hint.strip()}  (default: {defaults[name]!r})")
                out += [f"      {text}" for text in notes + ([comment] if comment else [])]
                notes = []
            elif found:
                notes = []
    return "\n".join(out)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
