"""Checkpoints: tensors in safetensors files, everything else in JSON; never pickle.

A run's checkpoint folder holds one sub-folder per save and a pointer to the newest::

    runs/recall-.../checkpoints/
        latest                      "step-000000200"
        step-000000100/
        step-000000200/
            tensors.safetensors     the model's tensors (``tensors=``)
            state.safetensors       the tensors found inside ``state=`` (optimizer moments, RNG)
            checkpoint.json         step, config, state (tensors replaced by references), and
                                    the size and SHA-256 of both safetensors files

Writing is atomic: a save goes to a hidden temporary folder, every file is flushed to disk
(fsync), the folder is renamed into place, and only then is ``latest`` replaced (a temporary
file renamed over it). A crash at any moment leaves the previous checkpoint in place and
``latest`` pointing at a complete checkpoint; the next save removes the leftovers. Loading
checks the recorded sizes and hashes, so a truncated or damaged file is an error that says
so, not a confusing failure deep inside a parser.

One process writes a folder at a time.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import math
import os
import random
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from qkv._extras import require
from qkv._io import write_atomic
from qkv._read import FileLimitError, check_regular, json_value, read_bytes

if TYPE_CHECKING:
    import torch

FORMAT = "qkv-checkpoint"
VERSION = 1
MANIFEST = "checkpoint.json"
TENSORS = "tensors.safetensors"
STATE = "state.safetensors"
LATEST = "latest"
_TMP_PREFIX = ".tmp-"
_NAME = re.compile(r"step-(\d+)(?:\.(\d+))?")
_MARKERS = ("__tensor__", "__ndarray__", "__bytes__", "__tuple__", "__int_keys__", "__float__")
MAX_MANIFEST_BYTES = 1 << 26
"""The largest ``checkpoint.json`` read (64 MiB): it holds settings and references only."""
RUN_TASKS = ("classify", "recall")
"""The tasks of ``qkv train``: a run's checkpoint config names one of them."""
_SIZES = ("vocab_size", "num_classes", "embedding_dim")
"""Model settings that are sizes of stored tensors: each is at most their number of values."""
_DAMAGED = "the file was changed after saving; use another checkpoint of the run"


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read: what, where, and a hint.

    Example:
        >>> str(CheckpointError("no checkpoint here", path="runs/x", hint="train first"))
        'runs/x: no checkpoint here. Hint: train first'
    """

    def __init__(
        self, problem: str, *, path: str | os.PathLike[str] | None = None, hint: str | None = None
    ) -> None:
        self.problem = problem
        self.path = None if path is None else os.fspath(path)
        self.hint = hint
        text = f"{self.path}: {problem}" if self.path else problem
        if hint:
            text = f"{text.rstrip('.')}. Hint: {hint}"
        super().__init__(text)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.problem, self.path, self.hint))


def _rebuild(problem: str, path: str | None, hint: str | None) -> CheckpointError:
    return CheckpointError(problem, path=path, hint=hint)


class CheckpointMismatchError(CheckpointError):
    """A checkpoint that does not fit what the caller expected (config values, tensor shapes)."""


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint.

    Attributes:
        path: the step folder it was read from.
        step: the training step it was saved at.
        tensors: the model's tensors, by name (on the CPU unless ``device=`` said otherwise).
        config: the JSON config saved with it (model and run settings).
        state: the training state (optimizer ``state_dict``, RNG states, ...), with its
            tensors, tuples, bytes and integer dict keys restored as they were saved.
    """

    path: Path
    step: int
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    state: dict[str, Any]


def save_checkpoint(
    directory: str | os.PathLike[str],
    *,
    step: int,
    tensors: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    state: Mapping[str, Any] | None = None,
    keep: int | None = 3,
) -> Path:
    """Save a checkpoint atomically into ``directory`` (created if missing).

    Args:
        directory: the run's checkpoint folder.
        step: the training step (a whole number ≥ 0); names the sub-folder
            ``step-000000123`` (``step-000000123.1`` when that exists already).
        tensors: the model's tensors, e.g. ``model.state_dict()``; saved on the CPU,
            contiguous; tensors that share memory (tied weights) are saved as copies.
        config: JSON data (str keys; str, numbers, bool, None, lists, dicts) describing the
            model and the run; compared on load with ``expected_config``.
        state: anything else to restore: may hold tensors, NumPy arrays, tuples, bytes, dicts
            with integer keys (an optimizer's ``state_dict()``), and :func:`rng_states`.
        keep: how many checkpoints to keep in ``directory`` (the newest; None keeps all).

    Returns:
        The new checkpoint's folder.

    Raises:
        CheckpointError: a value that cannot be stored (named by its path, e.g.
            ``state['optimizer']['param_groups'][0]['lr']``), or bad arguments.
        OSError: the disk refused; the previous checkpoint is untouched.

    Example:
        >>> import tempfile, torch
        >>> folder = tempfile.mkdtemp()
        >>> path = save_checkpoint(folder, step=7, tensors={"w": torch.ones(2, 3)},
        ...                        config={"dim": 3}, state={"betas": (0.9, 0.999)})
        >>> path.name
        'step-000000007'
        >>> ckpt = load_checkpoint(folder, expected_config={"dim": 3})
        >>> ckpt.step, ckpt.tensors["w"].shape, ckpt.state["betas"]
        (7, torch.Size([2, 3]), (0.9, 0.999))
    """
    torch_ = require("torch", feature="qkv checkpoints")
    st = require("safetensors.torch", feature="qkv checkpoints", extra="torch")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a whole number >= 0, got {step!r}.")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise CheckpointError(f"keep must be a whole number >= 1 or None, got {keep!r}.")
    model = _tensor_dict(tensors, torch_)
    config_json = _plain_json(config, "config")
    state_tensors = _Tensors(torch_)
    state_json = _encode(dict(state or {}), "state", state_tensors)
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(folder)
    name = _free_name(folder, step)
    tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=folder))
    try:
        files = {
            TENSORS: st.save(model, metadata={"format": FORMAT}),
            STATE: st.save(state_tensors.found, metadata={"format": FORMAT}),
        }
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "sequence": _next_sequence(folder),
            "config": config_json,
            "state": state_json,
            "files": {
                file: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                for file, data in files.items()
            },
        }
        for file, data in files.items():
            _write_file(tmp / file, data)
        _write_file(tmp / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode("utf-8"))
        _fsync_dir(tmp)
        os.rename(tmp, folder / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(folder)
    _write_pointer(folder, name)
    if keep is not None:
        _prune(folder, keep, newest=name)
    return folder / name


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    expected_config: Mapping[str, Any] | None = None,
    expected_shapes: Mapping[str, Sequence[int] | torch.Tensor] | None = None,
    device: str | torch.device = "cpu",
) -> Checkpoint:
    """Load a checkpoint: a run's checkpoint folder (its newest) or one step folder.

    Args:
        path: the folder given to :func:`save_checkpoint`, or one of its ``step-*`` folders.
        expected_config: values the checkpoint's config must have (e.g. ``{"embedding_dim":
            300}``); every difference is listed in the error.
        expected_shapes: name → shape (or a tensor, e.g. ``model.state_dict()``): the tensors
            the checkpoint must have, with these shapes.
        device: where to put the tensors.

    Raises:
        CheckpointError: no checkpoint there; a file missing, truncated or damaged (checked
            against the sizes and SHA-256 recorded when it was saved).
        CheckpointMismatchError: the config or the tensor shapes differ from the expected.
    """
    torch_ = require("torch", feature="qkv checkpoints")
    st = require("safetensors.torch", feature="qkv checkpoints", extra="torch")
    folder = _resolve(Path(path))
    manifest = _read_manifest(folder)
    data = {file: _read_checked(folder, file, manifest) for file in (TENSORS, STATE)}
    loaded = {}
    for file, raw in data.items():
        try:
            loaded[file] = st.load(raw)
        except Exception as error:  # safetensors raises its own error types
            raise CheckpointError(
                f"{file} is not a valid safetensors file ({error})",
                path=folder,
                hint="the file was changed after saving; use another checkpoint",
            ) from None
    tensors = {k: v.to(device) for k, v in loaded[TENSORS].items()}
    state_tensors = {k: v.to(device) for k, v in loaded[STATE].items()}
    try:
        state = _decode(manifest["state"], state_tensors, folder)
    except (TypeError, ValueError, AttributeError) as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(
            f"{MANIFEST}: state: a saved value cannot be read back ({error})",
            path=folder,
            hint=_DAMAGED,
        ) from None
    checkpoint = Checkpoint(
        path=folder,
        step=int(manifest["step"]),
        tensors=tensors,
        config=manifest["config"],
        state=state,
    )
    if expected_config is not None:
        _check_config(checkpoint, expected_config)
    if expected_shapes is not None:
        _check_shapes(checkpoint, expected_shapes, torch_)
    return checkpoint


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint folder in ``directory``, or None if it has none."""
    folder = Path(directory)
    if not folder.is_dir():
        return None
    if (folder / MANIFEST).is_file():
        return folder
    with contextlib.suppress(OSError, UnicodeDecodeError):
        name = (folder / LATEST).read_text(encoding="utf-8").strip()
        if _NAME.fullmatch(name) and (folder / name / MANIFEST).is_file():
            return folder / name
    complete = list(_complete(folder))
    return max(complete, key=lambda item: item[0])[1] if complete else None


def rng_states() -> dict[str, Any]:
    """The states of Python's, NumPy's (legacy global) and PyTorch's random generators, for
    ``state=`` of :func:`save_checkpoint`; :func:`restore_rng_states` puts them back."""
    torch_ = require("torch", feature="qkv checkpoints")
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch_.get_rng_state(),
    }
    if torch_.cuda.is_available() and torch_.cuda.is_initialized():
        states["cuda"] = torch_.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: Mapping[str, Any]) -> None:
    """Set the random generators to states from :func:`rng_states` (after a load)."""
    torch_ = require("torch", feature="qkv checkpoints")
    try:
        if "python" in states:
            version, internal, gauss = states["python"]
            random.setstate((version, tuple(internal), gauss))
        if "numpy" in states:
            np.random.set_state(tuple(states["numpy"]))
        if "torch" in states:
            torch_.set_rng_state(states["torch"].cpu())
        if "cuda" in states and torch_.cuda.is_available():
            torch_.cuda.set_rng_state_all([s.cpu() for s in states["cuda"]])
    except (TypeError, ValueError, AttributeError, RuntimeError) as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(
            f"the saved random generator states cannot be restored ({error})",
            hint="the checkpoint was changed after saving; use another checkpoint of the run",
        ) from None


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


# -- writing --------------------------------------------------------------------------------


def _write_file(path: Path, data: bytes) -> None:
    with path.open("xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(folder: Path) -> None:
    if os.name != "posix":  # pragma: no cover - Windows cannot open folders
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_pointer(folder: Path, name: str) -> None:
    write_atomic(folder / LATEST, f"{name}\n")
    _fsync_dir(folder)


def _remove_leftovers(folder: Path) -> None:
    """Temporary files and folders of saves that crashed."""
    for entry in folder.iterdir():
        pointer_tmp = entry.name.startswith(f".{LATEST}.") and entry.name.endswith(".tmp")
        if entry.name.startswith(_TMP_PREFIX) or pointer_tmp:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    entry.unlink()


def _free_name(folder: Path, step: int) -> str:
    name = f"step-{step:09d}"
    suffix = 0
    while (folder / name).exists():
        suffix += 1
        name = f"step-{step:09d}.{suffix}"
    return name


def _complete(folder: Path) -> Iterator[tuple[int, Path]]:
    """(sequence, folder) of every complete checkpoint in ``folder``."""
    for entry in folder.iterdir():
        if not _NAME.fullmatch(entry.name):
            continue
        try:
            text = read_bytes(entry / MANIFEST, limit=MAX_MANIFEST_BYTES, what=MANIFEST)
            manifest = json_value(text.decode("utf-8"))
            yield int(manifest["sequence"]), entry
        except (OSError, ValueError, KeyError, TypeError):
            continue


def _next_sequence(folder: Path) -> int:
    return max((seq for seq, _ in _complete(folder)), default=0) + 1


def _prune(folder: Path, keep: int, *, newest: str) -> None:
    ordered = sorted(_complete(folder), key=lambda item: item[0], reverse=True)
    for _, entry in ordered[keep:]:
        if entry.name != newest:
            shutil.rmtree(entry, ignore_errors=True)


# -- reading --------------------------------------------------------------------------------


def _resolve(path: Path) -> Path:
    if not path.exists():
        raise CheckpointError(
            "no checkpoint here: the path does not exist",
            path=path,
            hint="give the --out folder of a training run, or one of its checkpoints",
        )
    if path.is_file() and path.name in (MANIFEST, TENSORS, STATE):
        path = path.parent
    if (path / MANIFEST).is_file():
        return path
    if path.is_dir() and _NAME.fullmatch(path.name):
        raise CheckpointError(
            f"the checkpoint is incomplete: {MANIFEST} is missing",
            path=path,
            hint="a save was interrupted or files were deleted; load the folder above it "
            "to get its newest complete checkpoint",
        )
    found = latest_checkpoint(path)
    if found is None:
        raise CheckpointError(
            "no checkpoint here (no step-* folder with a checkpoint.json)",
            path=path,
            hint="give the --out folder of a training run, or one of its checkpoints",
        )
    return found


def _read_manifest(folder: Path) -> dict[str, Any]:
    try:
        text = read_bytes(folder / MANIFEST, limit=MAX_MANIFEST_BYTES, what=MANIFEST)
        manifest = json_value(text.decode("utf-8"))
    except FileLimitError as error:
        raise CheckpointError(f"{MANIFEST}: {error.problem}", path=folder, hint=_DAMAGED) from None
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


def _field_error(folder: Path, field: str, expected: str, got: Any) -> CheckpointError:
    shown = "nothing" if got is None else f"{type(got).__name__} {_short(got)}"
    return CheckpointError(
        f"{MANIFEST}: {field}: expected {expected}, got {shown}", path=folder, hint=_DAMAGED
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:36] + "…" + text[-3:]


def _read_checked(folder: Path, file: str, manifest: Mapping[str, Any]) -> bytes:
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
        raise CheckpointError(f"{file} {error.problem}", path=folder, hint=_DAMAGED) from None
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


def _check_config(checkpoint: Checkpoint, expected: Mapping[str, Any]) -> None:
    wanted = _plain_json(expected, "expected_config")
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


def _check_shapes(checkpoint: Checkpoint, expected: Mapping[str, Any], torch_: Any) -> None:
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


# -- what goes into the files ---------------------------------------------------------------


def _tensor_dict(tensors: Mapping[str, Any], torch_: Any) -> dict[str, Any]:
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
        out[name] = _portable(tensor, seen)
    return out


def _portable(tensor: Any, seen: set[int]) -> Any:
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


def _plain_json(value: Any, where: str) -> Any:
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
            out[key] = _plain_json(item, f"{where}[{key!r}]")
        return out
    if isinstance(value, list | tuple):
        return [_plain_json(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise CheckpointError(
        f"{where} is a {type(value).__name__}, which a JSON config cannot hold. Hint: use "
        "numbers, strings, lists and dicts; tensors go in tensors= or state=."
    )


class _Tensors:
    """The tensors found while encoding ``state``, by path, and the memory they use."""

    def __init__(self, torch_: Any) -> None:
        self.torch = torch_
        self.found: dict[str, Any] = {}
        self.seen: set[int] = set()


def _encode(value: Any, where: str, tensors: _Tensors) -> Any:
    """JSON for ``value``; its tensors and arrays move to ``tensors`` under their path."""
    torch_ = tensors.torch
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else {"__float__": repr(float(value))}
    if isinstance(value, torch_.Tensor):
        tensors.found[where] = _portable(value, tensors.seen)
        return {"__tensor__": where}
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise CheckpointError(f"{where} is a NumPy array of Python objects; not storable.")
        tensors.found[where] = torch_.from_numpy(np.array(value, copy=True, order="C"))
        return {"__ndarray__": where}
    if isinstance(value, bytes | bytearray):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        keys = list(value)
        if all(isinstance(k, str) for k in keys) and not set(keys) & set(_MARKERS):
            return {k: _encode(v, f"{where}[{k!r}]", tensors) for k, v in value.items()}
        if all(isinstance(k, int) and not isinstance(k, bool) for k in keys):
            return {
                "__int_keys__": [
                    [k, _encode(v, f"{where}[{k}]", tensors)] for k, v in value.items()
                ]
            }
        bad = next(k for k in keys if not isinstance(k, str) or k in _MARKERS)
        raise CheckpointError(
            f"{where} has the key {bad!r}: state dicts need all-string or all-integer keys "
            f"(and not {', '.join(_MARKERS)})."
        )
    raise CheckpointError(
        f"{where} is a {type(value).__name__}, which a checkpoint cannot store without pickle. "
        "Hint: store tensors, arrays, numbers, strings, bytes, lists, tuples and dicts."
    )


def _decode(value: Any, tensors: Mapping[str, Any], folder: Path) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, folder) for v in value]
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
            return tuple(_decode(v, tensors, folder) for v in content)
        if marker == "__int_keys__":
            return {int(k): _decode(v, tensors, folder) for k, v in content}
        if marker == "__float__":
            return float(content)
    return {k: _decode(v, tensors, folder) for k, v in value.items()}
