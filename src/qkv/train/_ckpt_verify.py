"""Checkpoint verification: every check of a checkpoint that was read back.

In the order a load meets them: the manifest's fields (:func:`read_manifest`), each
safetensors file's size and SHA-256 against the ones recorded when it was saved
(:func:`fingerprint` records them, :func:`read_checked` checks them), then what the caller
expected (:func:`check_config`, :func:`check_shapes`). :func:`check_run_config` and
:func:`check_resume_state` check a ``qkv train`` run's config and training state before a
model is built from them or a run resumes. Every failure is one :class:`CheckpointError` line
naming the file or field, what was expected, what came, and a hint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkv._extras import require
from qkv._read import FileLimitError, check_regular, json_value, read_bytes
from qkv._train_settings import TrainSettings
from qkv.train._ckpt_encoding import plain_json
from qkv.train._ckpt_format import (
    DAMAGED,
    FORMAT,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    STATE,
    TENSORS,
    VERSION,
    Checkpoint,
    CheckpointError,
    CheckpointMismatchError,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "RUN_TASKS",
    "check_config",
    "check_resume_state",
    "check_run_config",
    "check_shapes",
    "fingerprint",
    "read_checked",
    "read_manifest",
]

RUN_TASKS = ("classify", "recall")
"""The tasks of ``qkv train``: a run's checkpoint config names one of them."""
_SIZES = ("vocab_size", "num_classes", "embedding_dim")
"""Model settings that are sizes of stored tensors: each is at most their number of values."""

_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "count": (lambda v: _whole(v) and v >= 1, "a whole number ≥ 1"),
    "count or null": (lambda v: v is None or (_whole(v) and v >= 1), "a whole number ≥ 1"),
    "seed": (lambda v: _whole(v) and 0 <= v < 2**64, "a whole number from 0 to 2**64 - 1"),
    "flag": (lambda v: isinstance(v, bool), "true or false"),
    "share": (lambda v: _number(v) and 0 < v < 1, "a number between 0 and 1"),
    "text": (lambda v: isinstance(v, str), "a text"),
    "text or null": (lambda v: v is None or isinstance(v, str), "a text or null"),
}
"""What each setting of a run's config may hold, and how the message says it."""

_RUN_FIELDS: dict[str, dict[str, str]] = {
    "": {"seed": "seed", "batch_size": "count"},
    "classify": {
        "source": "text",
        "sentences": "count or null",
        "text_column": "text",
        "label_column": "text",
        "group_column": "text or null",
        "validation": "share",
        "lowercase": "flag",
        "max_length": "count",
        "min_count": "count",
    },
    "recall": {"pairs": "count", "keys": "count", "values": "count", "validation_size": "count"},
}
"""The settings of a run that are read back (``""``: the config's own, else its ``data``'s)."""


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# -- the files: manifest, sizes and hashes --------------------------------------------------


def fingerprint(data: bytes) -> dict[str, Any]:
    """What the manifest records of a file, for :func:`read_checked`: its size and SHA-256."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def read_manifest(folder: Path) -> dict[str, Any]:
    """``folder``'s ``checkpoint.json``, with its format, version and fields checked."""
    try:
        text = read_bytes(folder / MANIFEST, limit=MAX_MANIFEST_BYTES, what=MANIFEST)
        manifest = json_value(text.decode("utf-8"))
    except FileLimitError as error:
        raise CheckpointError(f"{MANIFEST}: {error.problem}", path=folder, hint=DAMAGED) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        where = (
            f" (line {error.lineno}, column {error.colno})"
            if isinstance(error, json.JSONDecodeError)
            else ""
        )
        raise CheckpointError(
            f"{MANIFEST} is not valid JSON{where}: it is damaged or truncated",
            path=folder,
            hint="use another checkpoint of the run",
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(
            f'{MANIFEST} is not a qkv checkpoint (no "format": "{FORMAT}")',
            path=folder,
        )
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint format version {manifest.get('version')!r}; this qkv reads {VERSION}",
            path=folder,
            hint="load it with the qkv version that saved it",
        )
    missing = [k for k in ("step", "config", "state", "files") if k not in manifest]
    if missing:
        raise CheckpointError(f"{MANIFEST} lacks {', '.join(missing)}", path=folder)
    step = manifest["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise _field_error(folder, "step", "a whole number ≥ 0", step)
    for key in ("config", "state", "files"):
        if not isinstance(manifest[key], dict):
            raise _field_error(folder, key, "an object", manifest[key])
    for file in (TENSORS, STATE):
        entry = manifest["files"].get(file)
        if not isinstance(entry, dict):
            raise _field_error(folder, f"files.{file}", "an object with bytes and sha256", entry)
        size, digest = entry.get("bytes"), entry.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise _field_error(folder, f"files.{file}.bytes", "a whole number ≥ 0", size)
        if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
            raise _field_error(folder, f"files.{file}.sha256", "64 hexadecimal digits", digest)
    return manifest


def read_checked(folder: Path, file: str, manifest: Mapping[str, Any]) -> bytes:
    """The bytes of ``folder / file``, if they have the size and SHA-256 the manifest records.

    The size is checked before reading, so a huge file is not read.
    """
    expected = manifest["files"][file]
    saved: int = expected["bytes"]
    try:
        size = check_regular(folder / file, what=f"a {file} file")
        if size == saved:  # the size is checked before reading: a huge file is not read
            data = read_bytes(folder / file, limit=saved, what=f"this {file}")
            size = len(data)
    except FileNotFoundError:
        raise CheckpointError(
            f"{file} is missing", path=folder, hint="use another checkpoint of the run"
        ) from None
    except FileLimitError as error:
        raise CheckpointError(f"{file} {error.problem}", path=folder, hint=DAMAGED) from None
    if size != saved:
        problem = "truncated" if size < saved else "longer than saved"
        raise CheckpointError(
            f"{file} is {problem}: {size:,} bytes, but {saved:,} were saved",
            path=folder,
            hint="the file was cut short (a full disk, an interrupted copy); use another "
            "checkpoint of the run",
        )
    if hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise CheckpointError(
            f"{file} is damaged: its SHA-256 differs from the one recorded when it was saved",
            path=folder,
            hint="use another checkpoint of the run",
        )
    return data


def _field_error(folder: Path, field: str, expected: str, got: Any) -> CheckpointError:
    shown = "nothing" if got is None else f"{type(got).__name__} {_short(got)}"
    return CheckpointError(
        f"{MANIFEST}: {field}: expected {expected}, got {shown}", path=folder, hint=DAMAGED
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:36] + "…" + text[-3:]


# -- what the caller expected ---------------------------------------------------------------


def check_config(checkpoint: Checkpoint, expected: Mapping[str, Any]) -> None:
    """Every value of ``expected`` (nested) must be in the checkpoint's config.

    Raises:
        CheckpointMismatchError: listing every difference.
    """
    wanted = plain_json(expected, "expected_config")
    differences = list(_differences(checkpoint.config, wanted, "config"))
    if differences:
        raise CheckpointMismatchError(
            "the checkpoint does not match: " + "; ".join(differences),
            path=checkpoint.path,
            hint="use the settings it was trained with, or train a new model",
        )


def _differences(saved: Any, wanted: Any, where: str) -> Iterator[str]:
    if isinstance(wanted, dict) and isinstance(saved, dict):
        for key, value in wanted.items():
            if key not in saved:
                yield f"{where}[{key!r}] is missing (expected {value!r})"
            else:
                yield from _differences(saved[key], value, f"{where}[{key!r}]")
    elif saved != wanted or isinstance(saved, bool) != isinstance(wanted, bool):
        yield f"{where} is {saved!r} in the checkpoint, expected {wanted!r}"


def check_shapes(checkpoint: Checkpoint, expected: Mapping[str, Any], torch_: Any) -> None:
    """The checkpoint must hold exactly the tensors of ``expected`` (name → shape or tensor).

    Raises:
        CheckpointMismatchError: listing every missing, extra or differently shaped tensor.
    """
    problems = []
    for name, shape in expected.items():
        want = tuple(shape.shape) if isinstance(shape, torch_.Tensor) else tuple(shape)
        if name not in checkpoint.tensors:
            problems.append(f"{name!r} is missing")
        elif tuple(checkpoint.tensors[name].shape) != want:
            problems.append(
                f"{name!r} has shape {tuple(checkpoint.tensors[name].shape)}, expected {want}"
            )
    problems += [
        f"{name!r} is not in the model" for name in checkpoint.tensors if name not in expected
    ]
    if problems:
        raise CheckpointMismatchError(
            "the checkpoint's tensors do not fit: " + "; ".join(problems),
            path=checkpoint.path,
            hint="the model was built with other sizes (e.g. another embedding dimension); "
            "use the settings it was trained with",
        )


# -- a qkv train run's config and training state --------------------------------------------


def check_run_config(checkpoint: Checkpoint) -> None:
    """Check that a checkpoint's config describes a ``qkv train`` run that fits its tensors.

    Called before a model is built from the config, so a damaged or edited config (an
    unknown task, a missing key, a negative size, a vocabulary of 10¹² words) is one clear
    error instead of a crash or an allocation of terabytes.

    Raises:
        CheckpointError: the config names the field that is wrong and what was expected.
    """
    config, folder = checkpoint.config, checkpoint.path
    for key in ("task", "model", "data"):
        if key not in config:
            raise CheckpointError(
                f"config: the key {key!r} is missing (a 'qkv train' run's config has task, "
                "model and data)",
                path=folder,
                hint="the checkpoint's config was changed after saving, or it is not from "
                "'qkv train'; use another checkpoint of the run",
            )
    if config["task"] not in RUN_TASKS:
        raise _config_error(folder, "task", " or ".join(map(repr, RUN_TASKS)), config["task"])
    model, data = config["model"], config["data"]
    if not isinstance(model, dict) or not isinstance(model.get("kind"), str):
        raise _config_error(folder, "model", "an object with the model's kind", model)
    values = sum(math.prod(t.shape) for t in checkpoint.tensors.values())
    for key, value in model.items():
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        least = 1 if key in _SIZES else 0
        if value < least:
            raise _config_error(folder, f"model.{key}", f"a whole number ≥ {least}", value)
        if key in _SIZES and value > values:
            raise _config_error(
                folder,
                f"model.{key}",
                f"at most {values:,}, the number of values the checkpoint's tensors hold",
                value,
            )
    for key in ("vocab_size", "num_classes"):
        if not isinstance(model.get(key), int) or isinstance(model.get(key), bool):
            raise _config_error(folder, f"model.{key}", "a whole number ≥ 1", model.get(key))
    if not isinstance(data, dict):
        raise _config_error(folder, "data", "an object", data)
    for key in ("vocabulary", "labels"):
        items = data.get(key)
        if not (isinstance(items, list) and all(isinstance(i, str) for i in items)):
            raise _config_error(folder, f"data.{key}", "a list of texts", items)
    if len(data["vocabulary"]) != model["vocab_size"]:
        raise _config_error(
            folder,
            "data.vocabulary",
            f"{model['vocab_size']} words (model.vocab_size)",
            f"{len(data['vocabulary'])} words",
        )
    _check_settings(config, folder)


def _check_settings(config: Mapping[str, Any], folder: Path) -> None:
    """Every setting a run's config is read back for (evaluating, explaining, resuming):
    its type and range, and for a recall run that its counts make its vocabulary."""
    data = config["data"]
    for section, fields in (("", _RUN_FIELDS[""]), ("data.", _RUN_FIELDS[config["task"]])):
        values = config if not section else data
        for key, kind in fields.items():
            fits, expected = _KINDS[kind]
            if key not in values and kind.endswith("or null"):
                continue
            if not fits(values.get(key)):
                raise _config_error(folder, section + key, expected, values.get(key))
    if config["task"] == "recall":
        keys, values, pairs = data["keys"], data["values"], data["pairs"]
        if keys + values != len(data["vocabulary"]) or values != len(data["labels"]):
            raise _config_error(
                folder,
                "data.keys",
                f"keys + values = {len(data['vocabulary'])} tokens (data.vocabulary), of "
                f"which {len(data['labels'])} values (data.labels)",
                f"{keys} keys and {values} values",
            )
        if pairs > keys:
            raise _config_error(folder, "data.pairs", f"at most data.keys ({keys})", pairs)
    if config.get("embeddings") is not None and not isinstance(config["embeddings"], dict):
        raise _config_error(folder, "embeddings", "an object or null", config["embeddings"])
    training = config.get("training", {})
    if not isinstance(training, dict):
        raise _config_error(folder, "training", "an object", training)
    known = {f.name for f in dataclasses.fields(TrainSettings)}
    try:
        TrainSettings(**{k: v for k, v in training.items() if k in known})
    except (TypeError, ValueError) as error:
        raise CheckpointError(
            f"config.training: {str(error).rstrip('.')}",
            path=folder,
            hint="the checkpoint's config was changed after saving, or it is not from "
            "'qkv train'; use another checkpoint of the run",
        ) from None


def check_resume_state(
    checkpoint: Checkpoint, optimizer: torch.optim.Optimizer, loop_keys: Sequence[str]
) -> None:
    """Check the training state saved for ``--resume`` before it is put back.

    ``loop_keys`` are the keys the loop state must have (no more, no fewer). The optimizer's
    moments must have the shapes of the parameters they belong to.

    Raises:
        CheckpointError: naming the key or the tensor that is wrong.
    """
    torch_ = require("torch", feature="qkv checkpoints")
    state, folder = checkpoint.state, checkpoint.path
    for key in ("optimizer", "rng", "loop"):
        if not isinstance(state.get(key), dict):
            raise _state_error(folder, key, "an object", state.get(key))
    loop = state["loop"]
    unknown = sorted(set(loop) - set(loop_keys))
    missing = sorted(set(loop_keys) - set(loop))
    if unknown or missing:
        parts = ([f"unknown {', '.join(map(repr, unknown))}"] if unknown else []) + (
            [f"missing {', '.join(map(repr, missing))}"] if missing else []
        )
        raise _state_error(folder, "loop", f"the keys {', '.join(loop_keys)}", "; ".join(parts))
    saved = state["optimizer"]
    if not isinstance(saved.get("state"), dict) or not isinstance(saved.get("param_groups"), list):
        raise _state_error(folder, "optimizer", "an optimizer state_dict", saved)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, moments in saved["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(params):
            raise _state_error(
                folder, "optimizer.state", f"parameter numbers 0 to {len(params) - 1}", index
            )
        if not isinstance(moments, dict):
            raise _state_error(folder, f"optimizer.state[{index}]", "an object", moments)
        for name, value in moments.items():
            shaped = isinstance(value, torch_.Tensor) and value.ndim > 0
            if shaped and tuple(value.shape) != tuple(params[index].shape):
                raise _state_error(
                    folder,
                    f"optimizer.state[{index}].{name}",
                    f"shape {tuple(params[index].shape)}, the shape of its parameter",
                    f"shape {tuple(value.shape)}",
                )


def _config_error(folder: Path, field: str, expected: str, got: Any) -> CheckpointError:
    shown = got if isinstance(got, str) and got.endswith("words") else _short(got)
    return CheckpointError(
        f"config.{field}: expected {expected}, got {'nothing' if got is None else shown}",
        path=folder,
        hint="the checkpoint's config was changed after saving, or it is not from 'qkv train'; "
        "use another checkpoint of the run",
    )


def _state_error(folder: Path, field: str, expected: str, got: Any) -> CheckpointError:
    shown = got if isinstance(got, str) else _short(got)
    return CheckpointError(
        f"the saved training state: {field}: expected {expected}, got {shown}",
        path=folder,
        hint="resume with the options the run started with, or use another checkpoint",
    )
