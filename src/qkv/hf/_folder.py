"""A model folder, checked before transformers reads it: no code of its own, sane sizes,
weights in files that hold only numbers, and a model that fits in memory.

A model folder is a file from outside like any other (docs/hf.md): ``qkv explain --hf``
runs none of its code and refuses, in one line and before anything is built, what would
run code, hang or fill the memory:

- :func:`code_needed`: a ``config.json`` or ``tokenizer_config.json`` whose ``auto_map``
  supplies a class transformers does not have itself (``modeling_*.py``,
  ``tokenization_*.py``). Every ``from_pretrained`` is also called with
  ``trust_remote_code=False``, so transformers never asks "Do you wish to run the custom
  code?" and refuses by itself what this check would miss.
- :func:`check_sizes`: layers, heads and widths that are not whole numbers, are absurd
  (``num_hidden_layers: 1000000``), or heads that are 0 or do not divide the width.
- :func:`check_weights`: ``*.safetensors`` files whose header is larger than the format
  allows or than the file, or whose tensors reach past the end (a truncated file).
- :func:`check_fits`: the parameters and buffers the config describes, counted exactly on
  PyTorch's ``meta`` device (which allocates nothing), against :func:`qkv._memory.available_memory`.

A PyTorch ``.bin`` file is loaded with ``weights_only=True`` (numbers, no pickled objects).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from qkv._format import visible
from qkv._memory import available_memory
from qkv._read import FileLimitError, json_value, read_bytes, size_text

__all__ = [
    "MAX_LAYERS",
    "check_fits",
    "check_sizes",
    "check_weights",
    "code_needed",
    "model_class",
    "not_a_folder",
    "problem",
    "read_json",
]

MAX_LAYERS = 1024
"""The most layers a stack of a model may have (the largest published models have under
200): more is refused before anything is built, as a config with a million would hang."""

MAX_SIZE = 2**31 - 1
"""The largest width, vocabulary, head count or number of positions a config may give."""

MAX_CONFIG_BYTES = 32 << 20
"""The largest ``config.json`` or ``tokenizer_config.json`` read (32 MiB)."""

SAFETENSORS_HEADER = 100_000_000
"""The largest header the safetensors format allows (its own library's limit, in bytes)."""

_LAYERS = (
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "num_decoder_layers",
    "encoder_layers",
    "decoder_layers",
)
_HEADS = (
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
)
_KV_HEADS = ("num_key_value_heads", "num_kv_heads")
_WIDTHS = ("hidden_size", "n_embd", "d_model")
_HEAD_SIZES = ("head_dim", "d_kv", "kv_channels", "attention_head_size")
_OTHER_SIZES = (
    "intermediate_size",
    "n_inner",
    "d_ff",
    "ffn_dim",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "vocab_size",
    "max_position_embeddings",
    "n_positions",
    "n_ctx",
)
_HINT_CONFIG = "the folder's config.json was edited or damaged; save the model again"


def problem(name: str, what: str, hint: str) -> ValueError:
    """The one-line error of ``--hf NAME``: ``NAME: what. Hint: hint``, with any control
    character from the folder's name or files escaped."""
    return ValueError(visible(f"{name}: {what}. Hint: {hint}"))


def not_a_folder(name: str, path: Path) -> ValueError:
    """The one-line error of ``--hf NAME`` where ``NAME`` is a file, not a model's folder:
    what it is, and the folder to give instead when the file is one of a saved model's
    (its ``config.json``, a weights file: the folder beside it holds a ``config.json``)."""
    parent = path.parent
    if (parent / "config.json").is_file():
        hint = f"give the folder that holds it: --hf {parent}"
    else:
        hint = "give the folder written by save_pretrained (it holds config.json)"
    what = "a file" if path.is_file() else "something other than a folder"
    return problem(name, f"this is {what}, not a model's folder", hint)


def read_json(folder: Path, file: str, name: str) -> dict[str, Any] | None:
    """The JSON object of ``folder/file``, read with a size bound; None when absent.

    Raises:
        ValueError: not a regular file, larger than :data:`MAX_CONFIG_BYTES`, not UTF-8,
            not JSON, or not an object.
    """
    path = folder / file
    if not path.exists():
        return None
    try:
        data = json_value(read_bytes(path, limit=MAX_CONFIG_BYTES, what=file).decode("utf-8"))
    except FileLimitError as error:
        raise problem(name, f"{file} {error.problem}", error.hint) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise problem(name, f"{file} cannot be read ({error})", _HINT_CONFIG) from None
    if not isinstance(data, dict):
        raise problem(
            name, f"{file}: expected a JSON object, got {type(data).__name__}", _HINT_CONFIG
        )
    return data


# -- code the folder would run ---------------------------------------------------------


def code_needed(
    config: Mapping[str, Any], tokenizer_config: Mapping[str, Any] | None, model: Any
) -> str | None:
    """Which of the folder's own files loading it would run, in words (``"config.json's
    auto_map names modeling_evil.py"``); None when transformers' own classes load it.

    A class named in ``auto_map`` is the folder's own code. It is needed when transformers
    has no class of that name itself: the config's ``model_type``, the model's
    ``architectures`` (``model``: the class :func:`model_class` found, or None), the
    tokenizer's ``tokenizer_class``.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    mapped = _auto_map(config)
    known_type = config.get("model_type") in CONFIG_MAPPING
    if "AutoConfig" in mapped and not known_type:
        return _names_code("config.json", mapped["AutoConfig"])
    model_refs = [ref for key, ref in mapped.items() if key.startswith("AutoModel")]
    if model_refs and (model is None or not known_type):
        return _names_code("config.json", model_refs[0])
    tokenizer_map = _auto_map(tokenizer_config or {})
    tokenizer_ref = tokenizer_map.get("AutoTokenizer") or mapped.get("AutoTokenizer")
    if tokenizer_ref is not None:
        wanted = (tokenizer_config or {}).get("tokenizer_class")
        native = isinstance(wanted, str) and any(
            tokenizer_class_from_name(n) is not None for n in (wanted, wanted.removesuffix("Fast"))
        )
        if not native:
            where = "tokenizer_config.json" if "AutoTokenizer" in tokenizer_map else "config.json"
            return _names_code(where, tokenizer_ref)
    return None


def _auto_map(data: Mapping[str, Any]) -> dict[str, Any]:
    found = data.get("auto_map")
    return dict(found) if isinstance(found, Mapping) else {}


def _names_code(file: str, ref: Any) -> str:
    """``"config.json's auto_map names modeling_evil.py"`` for ``"modeling_evil.EvilModel"``
    (or a [slow, fast] pair of them; ``repo--module.Class`` names another repository)."""
    refs = [r for r in (ref if isinstance(ref, list | tuple) else [ref]) if isinstance(r, str)]
    if not refs:
        return f"{file}'s auto_map names code of its own"
    module = refs[-1].split("--")[-1].rsplit(".", 1)[0]
    return f"{file}'s auto_map names {module}.py"


def model_class(transformers: Any, config: Mapping[str, Any], name: str) -> Any:
    """The transformers model class the folder was saved from (its ``architectures``), or
    None when transformers has none of them.

    Raises:
        ValueError: ``architectures`` is not a list of texts, or names a class of
            transformers that is not a model (``Trainer``, ``AutoTokenizer``).
    """
    names = config.get("architectures")
    if names is None:
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise problem(
            name,
            f"config.json: architectures: expected a list of model class names, got "
            f"{_shown(names)}",
            _HINT_CONFIG,
        )
    for architecture in names:
        found = getattr(transformers, architecture, None) if architecture.isidentifier() else None
        if found is None:
            continue
        if not (isinstance(found, type) and issubclass(found, transformers.PreTrainedModel)):
            raise problem(
                name,
                f"config.json: architectures names {_shown(architecture)}, which is not a "
                "model class of transformers",
                "give the class the model was saved from, e.g. LlamaForCausalLM; " + _HINT_CONFIG,
            )
        return found
    return None


# -- sizes ---------------------------------------------------------------------------------


def check_sizes(config: Mapping[str, Any], name: str) -> None:
    """Refuse a config whose sizes are not whole numbers, are absurd, or do not fit together.

    Every object in ``config.json`` is checked (a model with a text and a vision part has
    one in ``text_config``): layers from 0 to :data:`MAX_LAYERS`, heads and sizes from 1 to
    :data:`MAX_SIZE`, the heads dividing the width unless a head size is given, the
    key/value heads dividing the heads.

    Raises:
        ValueError: naming the field, what was expected and what came.
    """
    for where, part in _objects(config, "", depth=0):
        for key, low, high, what in (
            *((k, 0, MAX_LAYERS, "layers") for k in _LAYERS),
            *((k, 1, MAX_SIZE, "heads") for k in (*_HEADS, *_KV_HEADS)),
            *((k, 1, MAX_SIZE, "") for k in (*_WIDTHS, *_HEAD_SIZES, *_OTHER_SIZES)),
        ):
            value = part.get(key)
            for item in value if isinstance(value, list) else [value]:  # a list: per layer
                if item is None:
                    continue
                if isinstance(item, bool) or not isinstance(item, int):
                    raise _size_error(name, where + key, "a whole number", item)
                if not low <= item <= high:
                    bounds = f"from {low} to {high:,} {what}".rstrip()
                    raise _size_error(name, where + key, bounds, item)
        _check_heads(part, where, name)


def _objects(
    data: Mapping[str, Any], where: str, depth: int
) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """``data`` and the objects inside it (sub-configs), with their paths."""
    yield where, data
    if depth < 4:
        for key, value in data.items():
            if isinstance(value, Mapping):
                yield from _objects(value, f"{where}{key}.", depth + 1)


def _first(part: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str, int] | None:
    for key in keys:
        value = part.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return key, value
    return None


def _check_heads(part: Mapping[str, Any], where: str, name: str) -> None:
    heads, width = _first(part, _HEADS), _first(part, _WIDTHS)
    if heads is None:
        return
    if width is not None and _first(part, _HEAD_SIZES) is None and width[1] % heads[1]:
        raise problem(
            name,
            f"config.json: {where}{heads[0]}: expected a number of heads that divides "
            f"{where}{width[0]} ({width[1]}), got {heads[1]}",
            "each head takes an equal share of the width; " + _HINT_CONFIG,
        )
    kv = _first(part, _KV_HEADS)
    if kv is not None and heads[1] % kv[1]:
        raise problem(
            name,
            f"config.json: {where}{kv[0]}: expected a number that divides {where}{heads[0]} "
            f"({heads[1]}), got {kv[1]}",
            "query heads share key/value heads in equal groups; " + _HINT_CONFIG,
        )


def _size_error(name: str, field: str, expected: str, got: Any) -> ValueError:
    return problem(
        name, f"config.json: {field}: expected {expected}, got {_shown(got)}", _HINT_CONFIG
    )


def _shown(value: Any) -> str:
    """A value from the folder for a message, at most about 40 characters."""
    text = f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else repr(value)
    return text if len(text) <= 40 else text[:36] + "…"


# -- weights -------------------------------------------------------------------------------


def check_weights(folder: Path, name: str) -> None:
    """Refuse ``*.safetensors`` files that are damaged: a header length larger than the
    format allows or than the file, a header that is not a JSON object of tensors, or
    tensors that reach past the end of the file (truncated) or leave part of it unused.

    Only the 8-byte length and the header are read.

    Raises:
        ValueError: naming the file and what is wrong.
    """
    for path in sorted(folder.glob("*.safetensors")):
        found = _safetensors_problem(path)
        if found is not None:
            raise problem(
                name,
                f"{path.name} is no valid safetensors file: {found}",
                "the file is damaged or truncated; save or download the model again",
            )


def _safetensors_problem(path: Path) -> str | None:
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            start = handle.read(8)
            if len(start) < 8:
                return f"it holds {size} bytes, fewer than the 8 of the header's length"
            (length,) = struct.unpack("<Q", start)
            if length > min(SAFETENSORS_HEADER, size - 8):
                most = "the format allows" if length > SAFETENSORS_HEADER else "the file holds"
                return f"its header claims {length:,} bytes, more than {most}"
            header = json_value(handle.read(length).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, FileLimitError) as error:
        return f"its header cannot be read ({type(error).__name__})"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    data = size - 8 - length
    end = 0
    for tensor, entry in header.items():
        if tensor == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            return f"the tensor {tensor[:40]!r} has no valid data_offsets"
        end = max(end, offsets[1])
    if end > data:
        return (
            f"its tensors need {size_text(end)} of data, the file holds {size_text(data)} "
            "(truncated)"
        )
    if end < data:
        return f"{size_text(data - end)} of the file belong to no tensor"
    return None


# -- memory --------------------------------------------------------------------------------


def check_fits(transformers: Any, cls: Any, config: Any, name: str, family: str) -> None:
    """Count the parameters and buffers the config describes by building the model on
    PyTorch's ``meta`` device (no memory), and refuse a model that does not fit.

    Raises:
        ValueError: transformers cannot build the model from the config, or its float32
            parameters need more memory than :func:`qkv._memory.available_memory`
            (both numbers in the message).
    """
    import torch

    try:
        with torch.device("meta"):
            if issubclass(cls, transformers.PreTrainedModel):
                model = cls(config)
            else:  # AutoModel: the class transformers maps the config to
                model = cls.from_config(config, trust_remote_code=False)
    except Exception as error:  # transformers' own checks of a hostile config: any type
        raise problem(
            name,
            f"transformers cannot build a {family} model from its config.json "
            f"({first_line(error)})",
            _HINT_CONFIG,
        ) from None
    values = sum(p.numel() for p in model.parameters())
    needed = 4 * values + sum(b.numel() * b.element_size() for b in model.buffers())
    free = available_memory()
    if free is not None and needed > free:
        raise problem(
            name,
            f"the {family} model needs about {size_text(needed)} of memory for its "
            f"{values:,} parameters in float32 (counted from config.json), more than the "
            f"{size_text(free)} available",
            "choose a smaller model, or free memory",
        )


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its type's name if it has none)."""
    text = str(error).strip().splitlines()
    return text[0].rstrip(".") if text else type(error).__name__
