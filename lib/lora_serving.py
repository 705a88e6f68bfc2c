"""LoRA adapters served by lib's CPU server (lib/cpu_engine.py), as SGLang serves them: loaded and
unloaded by name at run time (`/load_lora_adapter`, `/unload_lora_adapter`), each request naming
the one it is generated with (`lora_path` in `/generate`), requests of different adapters (or none)
in one batch.

An adapter is a PEFT directory (adapter_config.json + adapter_model.safetensors, what
`PeftModel.save_pretrained` and lib.lora.save_adapter write). It is applied by a forward hook on each
adapted linear module: output += scale * (x @ A^T) @ B^T for the batch rows that use it, the same
sum in the same order as peft's LoRA layer computes on the trainer, so the served log-probs are the
trainer's. The base weights are never touched (a full weight update still applies under the adapters).
A request holds its adapter itself, so unloading a name refuses new requests for it at once while
requests already running finish with the adapter they started with.
"""
import contextlib
import json
import math
import os

import torch
from torch import nn

from lib.http_body import BadRequest

SAVED_PREFIX = "base_model.model."  # PEFT's prefix of saved tensor names
MAX_ADAPTER_RANK = 4096


class Adapter:
    """One loaded adapter: `weights[module name] = (A [r, in], B [out, r])` and its `scale`."""

    def __init__(self, name: str, path: str, scale: float, weights: dict):
        self.name, self.path, self.scale, self.weights = name, path, scale, weights


def _config(path: str) -> dict:
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise BadRequest(f"lora_path {path!r} has no adapter_config.json; give a directory that PEFT's "
                         f"save_pretrained (or lib.lora.save_adapter) wrote")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise BadRequest(f"{config_file} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise BadRequest(f"{config_file} must hold a JSON object")
    # What this server does not apply is refused, never silently served as something else.
    # An adapter made to sit on a changed base (PiSSA, OLoRA, CorDA and LoftQ initialisations, until converted)
    # or applied to some tokens only (aLoRA's invocation tokens) would be served wrong on the plain base.
    unsupported = {"peft_type": lambda v: v not in (None, "LORA"), "use_dora": bool, "fan_in_fan_out": bool,
                   "bias": lambda v: v not in (None, "none"), "modules_to_save": bool, "rank_pattern": bool,
                   "alpha_pattern": bool, "layer_replication": bool, "alora_invocation_tokens": bool,
                   "init_lora_weights": lambda v: isinstance(v, str) and v.lower().startswith(
                       ("pissa", "olora", "corda", "loftq")),
                   "use_rslora": lambda v: v is not None and not isinstance(v, bool)}
    for key, bad in unsupported.items():
        if bad(config.get(key)):
            raise BadRequest(f"adapter {path!r}: {key}={config[key]!r} is not supported by lib.cpu_server "
                             f"(plain LoRA on linear modules of the served base only; use_rslora true or false)")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_ADAPTER_RANK:
        raise BadRequest(f"adapter {path!r}: r must be an integer in [1, {MAX_ADAPTER_RANK}], got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise BadRequest(f"adapter {path!r}: lora_alpha must be a positive number, got {alpha!r}")
    return config


def read_adapter(name: str, path: str, model: nn.Module, max_bytes: int) -> Adapter:
    """The adapter at directory `path`, checked against `model` (every tensor names a linear module of
    it, with that module's shapes), its tensors in the module's dtype and device. Reads files and
    touches no weight: runs on any thread, and a bad adapter raises BadRequest before anything changes."""
    from safetensors.torch import load

    from lib.cpu_engine import _read_regular_file

    if not isinstance(path, str) or not os.path.isdir(path):
        raise BadRequest(f"lora_path {path!r} is not a directory; give the directory that PEFT's save_pretrained "
                         f"(or lib.lora.save_adapter) wrote")
    config = _config(path)
    weights_file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_file):
        raise BadRequest(f"lora_path {path!r} has no adapter_model.safetensors")
    if os.stat(weights_file).st_size > max_bytes:
        raise BadRequest(f"{weights_file} holds more than {max_bytes} bytes, more than any adapter of the served "
                         f"model could; wrong file?")
    try:
        tensors = load(_read_regular_file(weights_file))
    except BadRequest:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated, garbled or unreadable file: the caller's to fix
        raise BadRequest(f"{weights_file} is not a readable safetensors file: {type(e).__name__}: {e}") from None
    modules = dict(model.named_modules())
    parts: dict = {}
    for key, tensor in tensors.items():
        inner = key.removeprefix(SAVED_PREFIX)
        module_name, dot, kind = inner.rpartition(".lora_")
        if not dot or kind not in ("A.weight", "B.weight"):
            raise BadRequest(f"adapter {path!r}: tensor {key!r} is not a LoRA A or B weight "
                             f"(expected '{SAVED_PREFIX}<module>.lora_A.weight')")
        module = modules.get(module_name)
        if not isinstance(module, nn.Linear):
            raise BadRequest(f"adapter {path!r}: {key!r} names {module_name!r}, which is not a linear module of the "
                             f"served model; is it an adapter of this base model?")
        parts.setdefault(module_name, {})[kind[0]] = tensor
    rank = config["r"]
    scale = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    weights = {}
    for module_name, ab in parts.items():
        module = modules[module_name]
        if set(ab) != {"A", "B"}:
            raise BadRequest(f"adapter {path!r}: {module_name!r} has lora_{'A' if 'A' in ab else 'B'} only")
        a, b = ab["A"], ab["B"]
        if list(a.shape) != [rank, module.in_features] or list(b.shape) != [module.out_features, rank]:
            raise BadRequest(f"adapter {path!r}: {module_name!r} has A {list(a.shape)} and B {list(b.shape)}; with "
                             f"r={rank} the served model needs A [{rank}, {module.in_features}] and B "
                             f"[{module.out_features}, {rank}]")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise BadRequest(f"adapter {path!r}: {module_name!r} weights must be floating point")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise BadRequest(f"adapter {path!r}: {module_name!r} has NaN or infinite weights")
        weights[module_name] = tuple(t.to(device=module.weight.device, dtype=module.weight.dtype) for t in (a, b))
    if not weights:
        raise BadRequest(f"adapter {path!r} holds no LoRA weights")
    missing = sorted(_targeted(config, path, modules) - set(weights))
    if missing:
        raise BadRequest(f"adapter {path!r}: its config targets {len(missing)} modules of the served model that it "
                         f"holds no weights for (e.g. {missing[:3]}); a partly written or mixed-up file?")
    return Adapter(name, path, scale, weights)


def _targeted(config: dict, path: str, modules: dict) -> set:
    """The linear modules of the served model that the config's `target_modules` (a list of names) adapts, as
    peft matches them (the name itself or its last parts). Not worked out (empty) where peft's other rules
    narrow it (excluded modules, chosen layers), for "all-linear", or for a regex (a user's regex is not run
    on a server: it could take unbounded time)."""
    targets = config.get("target_modules")
    if (not targets or isinstance(targets, str)
            or any(config.get(k) for k in ("exclude_modules", "layers_to_transform", "layers_pattern"))):
        return set()
    if not isinstance(targets, list) or not all(isinstance(t, str) and t for t in targets):
        raise BadRequest(f"adapter {path!r}: target_modules must be a list of module names, got {targets!r}")
    return {n for n, m in modules.items() if isinstance(m, nn.Linear)
            and (n in targets or any(n.endswith("." + t) for t in targets))}


class ServedAdapters:
    """The adapters a model serves by name, and the forward hooks that apply them per batch row.
    `load`, `unload` and every forward run on the model's one worker thread (lib/cpu_engine.py)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.loaded: dict[str, Adapter] = {}
        self._hooked: set = set()
        self._rows: list | None = None  # each row's Adapter (or None) during a forward

    def lookup(self, name) -> Adapter | None:
        """The adapter a request names (None: the base model); an unknown name is a 400, as SGLang's."""
        if name is None:
            return None
        if not isinstance(name, str):
            raise BadRequest(f"lora_path must be the name of a loaded adapter (a string) or null, got {name!r}")
        if name not in self.loaded:
            raise BadRequest(f"The following requested LoRA adapters are not loaded: {name}\n"
                             f"Loaded adapters: {sorted(self.loaded)}")
        return self.loaded[name]

    def load(self, adapter: Adapter) -> None:
        if adapter.name in self.loaded:
            raise BadRequest(f"LoRA adapter {adapter.name!r} is already loaded; unload it first or load it under "
                             f"another name")
        modules = dict(self.model.named_modules())
        for module_name in adapter.weights:
            if module_name not in self._hooked:
                modules[module_name].register_forward_hook(self._hook(module_name))
                self._hooked.add(module_name)
        self.loaded[adapter.name] = adapter

    def unload(self, name: str) -> None:
        if name not in self.loaded:
            raise BadRequest(f"LoRA adapter {name!r} is not loaded; loaded: {sorted(self.loaded)}")
        del self.loaded[name]

    def paths(self) -> dict:
        return {name: a.path for name, a in self.loaded.items()}

    @contextlib.contextmanager
    def applied(self, row_adapters: list):
        """Inside the block, forwards apply row i's adapter (or none) to row i of the batch."""
        self._rows = row_adapters if any(a is not None for a in row_adapters) else None
        try:
            yield
        finally:
            self._rows = None

    def _hook(self, module_name: str):
        def apply(module, inputs, output):
            rows = self._rows
            if rows is None:
                return None
            x = inputs[0]
            for adapter in {id(a): a for a in rows if a is not None and module_name in a.weights}.values():
                a, b = adapter.weights[module_name]
                index = torch.tensor([i for i, r in enumerate(rows) if r is adapter], device=x.device)
                delta = ((x[index] @ a.T) @ b.T) * adapter.scale
                output = output.index_add(0, index, delta.to(output.dtype))
            return output
        return apply
