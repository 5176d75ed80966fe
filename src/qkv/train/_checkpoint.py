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

This module is the public face; the work is done by three modules with one idea each, which
this one calls in order::

    _ckpt_format     the names of the format, the Checkpoint record, the errors
    _ckpt_storage    the folder layout: step folders, ``latest``, atomic writes, pruning
    _ckpt_encoding   a training state as safetensors + JSON, and back
    _ckpt_verify     the manifest's fields, sizes and hashes, expected config and shapes
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from qkv._extras import require
from qkv.train import _ckpt_encoding as encoding
from qkv.train import _ckpt_storage as storage
from qkv.train import _ckpt_verify as verify
from qkv.train._ckpt_format import (
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
from qkv.train._ckpt_storage import LATEST, latest_checkpoint
from qkv.train._ckpt_verify import RUN_TASKS, check_resume_state, check_run_config

if TYPE_CHECKING:
    import torch

__all__ = [
    "FORMAT",
    "LATEST",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "RUN_TASKS",
    "STATE",
    "TENSORS",
    "VERSION",
    "Checkpoint",
    "CheckpointError",
    "CheckpointMismatchError",
    "check_resume_state",
    "check_run_config",
    "latest_checkpoint",
    "load_checkpoint",
    "restore_rng_states",
    "rng_states",
    "save_checkpoint",
]

_write_file = storage.write_file
"""How :func:`save_checkpoint` writes each file of a step folder; looked up at every save, so
that a test can put a failing writer here to simulate a crash in the middle of a save."""


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
    # encoding: everything is checked and turned into JSON before the disk is touched
    model = encoding.tensor_dict(tensors, torch_)
    config_json = encoding.plain_json(config, "config")
    state_tensors = encoding.Tensors(torch_)
    state_json = encoding.encode(dict(state or {}), "state", state_tensors)
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    storage.remove_leftovers(folder)
    name = storage.free_name(folder, step)
    files = {
        TENSORS: encoding.to_safetensors(st, model),
        STATE: encoding.to_safetensors(st, state_tensors.found),
    }
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "sequence": storage.next_sequence(folder),
        "config": config_json,
        "state": state_json,
        "files": {file: verify.fingerprint(data) for file, data in files.items()},
    }
    files[MANIFEST] = (json.dumps(manifest, indent=1) + "\n").encode("utf-8")  # written last
    storage.write_step(folder, name, files, write=_write_file)
    storage.write_pointer(folder, name)
    if keep is not None:
        storage.prune(folder, keep, newest=name)
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
    folder = storage.resolve(Path(path))
    manifest = verify.read_manifest(folder)
    data = {file: verify.read_checked(folder, file, manifest) for file in (TENSORS, STATE)}
    loaded = encoding.read_safetensors(st, data, folder, device)
    checkpoint = Checkpoint(
        path=folder,
        step=int(manifest["step"]),
        tensors=loaded[TENSORS],
        config=manifest["config"],
        state=encoding.decode_state(manifest["state"], loaded[STATE], folder),
    )
    if expected_config is not None:
        verify.check_config(checkpoint, expected_config)
    if expected_shapes is not None:
        verify.check_shapes(checkpoint, expected_shapes, torch_)
    return checkpoint


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
