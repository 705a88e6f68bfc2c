"""Named tensors passed between processes of one machine as handles, not bytes: the payload of
SGLang's `POST /update_weights_from_tensor` (colocated weight sync).

The payload is `base64(pickle([(name, tensor), ...]))` written with torch's multiprocessing
reductions: a CUDA tensor pickles as a CUDA IPC handle of its memory block (the receiver maps the
trainer's memory; no copy, no disk), a CPU tensor as the name of a shared-memory file (its storage
is moved into shared memory once; later sends of the same tensor cost nothing). SGLang's
scheduler unpickles it (one entry of `serialized_named_tensors` per TP rank) and loads the
tensors with the model's own loader. The sender must keep the tensors alive until the server has
answered.

`load_named_tensors` is the receiving side for lib's CPU server. Unpickling runs code named in
the payload, so it admits only the handful of torch functions that rebuild shared tensors and
refuses everything else (a payload naming `os.system` is a 400, not a shell).
"""
import base64
import binascii
import io
import pickle
from multiprocessing.reduction import ForkingPickler  # torch.multiprocessing registers its reductions here

import torch
import torch.multiprocessing


def serialize_named_tensors(named_tensors) -> str:
    """base64 text of `[(name, tensor)]` with each tensor as a handle (see the module doc)."""
    named = [(str(name), tensor.detach()) for name, tensor in named_tensors]
    previous = torch.multiprocessing.get_sharing_strategy()
    # "file_system": CPU storages travel as shared-memory file names, which an unrelated process
    # can open (the default passes file descriptors over a socket only a child can reach).
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        buffer = io.BytesIO()
        ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(named)
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


# What a payload of shared tensors refers to, and nothing else.
_ALLOWED = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_parameter"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch", "UntypedStorage"),
    ("collections", "OrderedDict"),
    ("builtins", "slice"),
} | {("torch", name) for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8",
                                   "bool", "float8_e4m3fn", "float8_e5m2")}


class PayloadError(ValueError):
    """The payload is not base64 of a pickle of named shared tensors."""


class _TensorsOnly(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _ALLOWED:
            raise PayloadError(f"the payload refers to {module}.{name}, which is not part of a tensor handle")
        return super().find_class(module, name)


def load_named_tensors(payload: str, max_bytes: int) -> list[tuple[str, torch.Tensor]]:
    """The `[(name, tensor)]` of `serialize_named_tensors`' text; PayloadError for anything else
    (bad base64, a foreign class, a handle that does not open, not a list of (str, tensor))."""
    if not isinstance(payload, str):
        raise PayloadError(f"a serialized entry must be a base64 string, got {type(payload).__name__}")
    if len(payload) > max_bytes:
        raise PayloadError(f"the serialized entry has {len(payload)} characters, more than {max_bytes}")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise PayloadError(f"the serialized entry is not base64: {e}") from None
    try:
        named = _TensorsOnly(io.BytesIO(raw)).load()
    except PayloadError:
        raise
    except Exception as e:  # a truncated pickle, a shared-memory file that is gone, an IPC handle that fails
        raise PayloadError(f"the serialized entry does not unpickle to shared tensors: {type(e).__name__}: {e}") from None
    if not (isinstance(named, list) and all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                                            and isinstance(item[1], torch.Tensor) for item in named)):
        raise PayloadError("the serialized entry must be a list of (name, tensor) pairs")
    return named
