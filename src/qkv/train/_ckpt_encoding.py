"""Checkpoint encoding: a training state as safetensors plus JSON, and back; never pickle.

The model's tensors go to ``tensors.safetensors`` as they are. The training state (an
optimizer's ``state_dict``, RNG states, loop counters) becomes tagged JSON: each tensor or
NumPy array moves to ``state.safetensors`` under its path in the state (e.g.
``state['optimizer']['state'][0]['exp_avg']``) and leaves a reference behind; tuples, bytes,
integer dict keys and non-finite floats are kept as one-key objects (the markers below), so
that :func:`decode` gives back what :func:`encode` was given.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from qkv.train._ckpt_format import DAMAGED, FORMAT, MANIFEST, STATE, CheckpointError

__all__ = [
    "MARKERS",
    "Tensors",
    "decode",
    "decode_state",
    "encode",
    "plain_json",
    "portable",
    "read_safetensors",
    "tensor_dict",
    "to_safetensors",
]

MARKERS = ("__tensor__", "__ndarray__", "__bytes__", "__tuple__", "__int_keys__", "__float__")
"""The keys of the one-key objects that stand for values JSON lacks."""


# -- the model's tensors and the config -----------------------------------------------------


def tensor_dict(tensors: Mapping[str, Any], torch_: Any) -> dict[str, Any]:
    """The model's tensors ready for safetensors (see :func:`portable`), or an error naming
    the entry that is not a named tensor."""
    if not isinstance(tensors, Mapping):
        raise CheckpointError(
            f"tensors must be a mapping of names to tensors, got {type(tensors).__name__}. "
            "Hint: model.state_dict()."
        )
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        if not isinstance(name, str):
            raise CheckpointError(f"tensor names must be strings, got {name!r}.")
        if not isinstance(tensor, torch_.Tensor):
            raise CheckpointError(
                f"tensors[{name!r}] must be a torch.Tensor, got {type(tensor).__name__}. "
                "Hint: put other values in state= or config=."
            )
        out[name] = portable(tensor, seen)
    return out


def portable(tensor: Any, seen: set[int]) -> Any:
    """A CPU, contiguous tensor sharing memory with no other saved tensor (safetensors
    refuses shared memory, e.g. tied weights)."""
    cpu = tensor.detach().to("cpu").contiguous()
    if cpu.numel():
        pointer = cpu.untyped_storage().data_ptr()
        if pointer in seen:
            cpu = cpu.clone()
            pointer = cpu.untyped_storage().data_ptr()
        seen.add(pointer)
    return cpu


def plain_json(value: Any, where: str) -> Any:
    """``value`` as plain JSON data (tuples become lists), or an error naming the bad part."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        if not math.isfinite(value):
            raise CheckpointError(f"{where} is {value}; JSON config values must be finite.")
        return float(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise CheckpointError(f"{where} has the key {key!r}; config keys must be strings.")
            out[key] = plain_json(item, f"{where}[{key!r}]")
        return out
    if isinstance(value, list | tuple):
        return [plain_json(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise CheckpointError(
        f"{where} is a {type(value).__name__}, which a JSON config cannot hold. Hint: use "
        "numbers, strings, lists and dicts; tensors go in tensors= or state=."
    )


# -- the training state ---------------------------------------------------------------------


class Tensors:
    """The tensors found while encoding ``state``, by path, and the memory they use."""

    def __init__(self, torch_: Any) -> None:
        self.torch = torch_
        self.found: dict[str, Any] = {}
        self.seen: set[int] = set()


def encode(value: Any, where: str, tensors: Tensors) -> Any:
    """JSON for ``value``; its tensors and arrays move to ``tensors`` under their path."""
    torch_ = tensors.torch
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else {"__float__": repr(float(value))}
    if isinstance(value, torch_.Tensor):
        tensors.found[where] = portable(value, tensors.seen)
        return {"__tensor__": where}
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise CheckpointError(f"{where} is a NumPy array of Python objects; not storable.")
        tensors.found[where] = torch_.from_numpy(np.array(value, copy=True, order="C"))
        return {"__ndarray__": where}
    if isinstance(value, bytes | bytearray):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        keys = list(value)
        if all(isinstance(k, str) for k in keys) and not set(keys) & set(MARKERS):
            return {k: encode(v, f"{where}[{k!r}]", tensors) for k, v in value.items()}
        if all(isinstance(k, int) and not isinstance(k, bool) for k in keys):
            return {
                "__int_keys__": [[k, encode(v, f"{where}[{k}]", tensors)] for k, v in value.items()]
            }
        bad = next(k for k in keys if not isinstance(k, str) or k in MARKERS)
        raise CheckpointError(
            f"{where} has the key {bad!r}: state dicts need all-string or all-integer keys "
            f"(and not {', '.join(MARKERS)})."
        )
    raise CheckpointError(
        f"{where} is a {type(value).__name__}, which a checkpoint cannot store without pickle. "
        "Hint: store tensors, arrays, numbers, strings, bytes, lists, tuples and dicts."
    )


def decode(value: Any, tensors: Mapping[str, Any], folder: Path) -> Any:
    """The value :func:`encode` was given, from its JSON and the tensors of ``state.safetensors``.

    Raises:
        CheckpointError: a reference to a tensor the file lacks. Other damage raises
            TypeError, ValueError or AttributeError; :func:`decode_state` words them.
    """
    if isinstance(value, list):
        return [decode(v, tensors, folder) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((marker, content),) = value.items()
        if marker in ("__tensor__", "__ndarray__"):
            if content not in tensors:
                raise CheckpointError(f"{STATE} lacks the tensor {content!r}", path=folder)
            tensor = tensors[content]
            return tensor.cpu().numpy() if marker == "__ndarray__" else tensor
        if marker == "__bytes__":
            return base64.b64decode(content)
        if marker == "__tuple__":
            return tuple(decode(v, tensors, folder) for v in content)
        if marker == "__int_keys__":
            return {int(k): decode(v, tensors, folder) for k, v in content}
        if marker == "__float__":
            return float(content)
    return {k: decode(v, tensors, folder) for k, v in value.items()}


def decode_state(value: Any, tensors: Mapping[str, Any], folder: Path) -> Any:
    """:func:`decode` of the manifest's ``state``; damage is a :class:`CheckpointError`."""
    try:
        return decode(value, tensors, folder)
    except (TypeError, ValueError, AttributeError) as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(
            f"{MANIFEST}: state: a saved value cannot be read back ({error})",
            path=folder,
            hint=DAMAGED,
        ) from None


# -- safetensors files ----------------------------------------------------------------------


def to_safetensors(st: Any, tensors: Mapping[str, Any]) -> bytes:
    """The bytes of a safetensors file holding ``tensors`` (``st`` is ``safetensors.torch``)."""
    data: bytes = st.save(tensors, metadata={"format": FORMAT})
    return data


def read_safetensors(
    st: Any, files: Mapping[str, bytes], folder: Path, device: Any
) -> dict[str, dict[str, Any]]:
    """The tensors of each safetensors file (name → bytes already verified), on ``device``.

    Raises:
        CheckpointError: a file that safetensors cannot parse, named.
    """
    loaded = {}
    for file, raw in files.items():
        try:
            loaded[file] = st.load(raw)
        except Exception as error:  # safetensors raises its own error types
            raise CheckpointError(
                f"{file} is not a valid safetensors file ({error})",
                path=folder,
                hint="the file was changed after saving; use another checkpoint",
            ) from None
    return {file: {k: v.to(device) for k, v in tensors.items()} for file, tensors in loaded.items()}
