"""LoRA adapters on the trainer's model, built on peft, and the adapter directories a server loads.

`add_lora` injects peft's LoRA layers into a Hugging Face causal LM in place (the model keeps its
class, its names and `get_decoder()`, so lib/logprobs.py runs it unchanged): the base weights are
frozen, in whatever dtype they were loaded (bf16 on GPUs), and the adapters are float32, the master
weights AdamW steps. Weights out of the trainer, for a server:
- `save_adapter`: PEFT's own layout (adapter_config.json + adapter_model.safetensors, tensor names
  `base_model.model.<module>.lora_A.weight`), what `PeftModel.save_pretrained` writes and what
  SGLang's `/load_lora_adapter` and lib's CPU server read (lib/lora_serving.py);
- `merged_named_parameters`: the full weights with every adapter folded in (W + scale * B @ A),
  under the base model's Hugging Face names, for a server that takes full weights only.
Both are collective under FSDP2 (each tensor is all-gathered): every rank calls them.

Dropout must be 0: the proximal and the updating forward of one PPO step must give the same
log-probs for the same weights, and peft's LoRA dropout would make them differ at random.
"""
import contextlib
import json
import os
from typing import Iterator

import torch
from torch import nn

# The attention and MLP projections of Llama/Qwen2/SmolLM2/Mistral-style decoders: LoRA Without
# Regret found LoRA on every linear layer (the MLP above all) needed to match full fine-tuning.
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_NAME = "default"  # peft's name for the one adapter the trainer holds
SAVED_PREFIX = "base_model.model."  # PEFT's prefix of saved tensor names (PeftModel wraps the HF model)


def check_lora_settings(rank: int, alpha: float | None, target_modules, dropout: float) -> None:
    """A ValueError naming the setting and the fix, for settings a LoRA run cannot train with."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"lora_rank must be an integer >= 0 (0 = full fine-tuning), got {rank!r}")
    if dropout != 0:
        raise ValueError(f"lora_dropout must be 0, got {dropout}: the proximal log-probs and the update's log-probs "
                         f"of one PPO step must agree for the same weights, and dropout would make them differ at "
                         f"random (peft applies it in train mode)")
    if rank and alpha is not None and not alpha > 0:
        raise ValueError(f"lora_alpha must be > 0, got {alpha}")
    if rank and (isinstance(target_modules, str) or not target_modules
                 or not all(isinstance(m, str) and m for m in target_modules)):
        raise ValueError(f"lora_target_modules must be a non-empty list of module names (e.g. "
                         f"{list(DEFAULT_TARGET_MODULES)}), got {target_modules!r}")


def add_lora(model: nn.Module, rank: int, alpha: float, target_modules) -> nn.Module:
    """Inject LoRA adapters of `rank` (scale alpha / rank) into every linear module whose name ends in
    one of `target_modules`; the base is frozen, the adapters float32 (B = 0: the model is unchanged)."""
    from peft import LoraConfig, inject_adapter_in_model

    check_lora_settings(rank, alpha, target_modules, 0.0)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM")
    try:
        model = inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    except ValueError as e:  # peft: no module matched
        raise ValueError(f"lora_target_modules {list(target_modules)} match no linear module of this model "
                         f"({type(model).__name__}): {e}") from None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, module in lora_modules(model):  # what lib cannot train, export or serve: refused, not skipped
        base = module.get_base_layer()
        if module is head or not isinstance(base, nn.Linear):
            raise ValueError(f"lora_target_modules {list(target_modules)} adapt {name!r} ({type(base).__name__}): "
                             f"LoRA here adapts the decoder's linear layers only (the log-prob head reads the output "
                             f"embedding's weight itself, so an adapter on it would train nothing; embedding adapters "
                             f"are neither merged nor served); leave {name!r} out")
    for name, param in model.named_parameters():
        is_adapter = ".lora_" in name
        param.requires_grad_(is_adapter)
        if is_adapter:
            param.data = param.data.float()  # master weights in fp32 whatever the base's dtype
    return model


def is_lora(model: nn.Module) -> bool:
    return any(".lora_A." in name for name, _ in model.named_parameters())


def lora_config(model: nn.Module):
    return model.peft_config[ADAPTER_NAME]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def lora_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(module name, peft LoRA layer) for every adapted module, in model order."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


@torch.no_grad()
def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """{PEFT saved name: full float32 tensor} of the adapters (`base_model.model.<module>.lora_A.weight`)."""
    out = {}
    for name, module in lora_modules(model):
        out[f"{SAVED_PREFIX}{name}.lora_A.weight"] = _full(module.lora_A[ADAPTER_NAME].weight).detach().float().cpu()
        out[f"{SAVED_PREFIX}{name}.lora_B.weight"] = _full(module.lora_B[ADAPTER_NAME].weight).detach().float().cpu()
    return out


def save_adapter(model: nn.Module, path: str, base_model_path: str, write: bool = True,
                 dtype: torch.dtype = torch.float32) -> None:
    """Write the adapters as a PEFT directory at `path` (whole, or not at all: written aside and swapped
    in), their tensors in `dtype`. Every rank calls it under FSDP (the tensors are gathered); `write`
    is False on ranks > 0."""
    from safetensors.torch import save_file

    from lib.checkpoint import fresh_tmp, swap_in

    tensors = {name: t.to(dtype) for name, t in adapter_tensors(model).items()}
    if not write:
        return
    config = lora_config(model).to_dict()
    config.update(base_model_name_or_path=base_model_path, inference_mode=True)
    config["target_modules"] = sorted(config["target_modules"])
    tmp = fresh_tmp(path)
    save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2, default=str)
    swap_in(tmp, path)


@torch.no_grad()
def merged_named_parameters(model: nn.Module, dtype: torch.dtype,
                            device: torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor in `dtype`) of every base parameter, each adapted weight with its
    adapter folded in (W + scale * B @ A, in float32), on `device` (default: where each lives; a base
    parked in host memory comes over a tensor at a time). Tied weights appear once, as named_parameters."""
    adapted = dict(lora_modules(model))
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        tensor = _full(param).detach()
        tensor = tensor.to(device) if device is not None else tensor
        module_name, _, leaf = name.rpartition(".base_layer.")
        if module_name in adapted and leaf == "weight":
            module = adapted[module_name]
            a = _full(module.lora_A[ADAPTER_NAME].weight).float()
            b = _full(module.lora_B[ADAPTER_NAME].weight).float()
            tensor = tensor.float() + (b @ a) * module.scaling[ADAPTER_NAME]
        yield (f"{module_name}.{leaf}" if module_name else name), tensor.to(dtype)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The base model alone inside the block (the probe's reference: lib.weight_sync)."""
    layers = [module for _, module in lora_modules(model)]
    for module in layers:
        module.enable_adapters(False)
    try:
        yield
    finally:
        for module in layers:
            module.enable_adapters(True)


@contextlib.contextmanager
def moved_adapters(model: nn.Module, scale: float, seed: int = 0):
    """Inside the block every adapter's B is moved by `scale` times a fixed random direction (its own
    generator: the run's random state is untouched); after it, exactly as before. The adapter test's
    known move (lib.weight_sync.ServerWeightSync.verify_adapters). Under FSDP each rank moves its shard."""
    generator = torch.Generator().manual_seed(seed)
    saved = []
    try:
        with torch.no_grad():
            for _, module in lora_modules(model):
                weight = module.lora_B[ADAPTER_NAME].weight
                local = weight.to_local() if hasattr(weight, "to_local") else weight.data
                saved.append((local, local.clone()))
                local.add_(torch.randn(local.shape, generator=generator).to(local) * scale)
        yield
    finally:  # also when moving them failed half way
        with torch.no_grad():
            for local, before in saved:
                local.copy_(before)
