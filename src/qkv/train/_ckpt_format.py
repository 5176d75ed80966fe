"""What a checkpoint is: the format's names, the loaded record and the errors.

The nouns that storage (``_ckpt_storage``), encoding (``_ckpt_encoding``) and verification
(``_ckpt_verify``) share; it imports none of them, so the three never import each other in a
circle. ``qkv.train._checkpoint`` re-exports the public ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkv._format import visible

if TYPE_CHECKING:
    import torch

__all__ = [
    "DAMAGED",
    "FORMAT",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "STATE",
    "TENSORS",
    "VERSION",
    "Checkpoint",
    "CheckpointError",
    "CheckpointMismatchError",
]

FORMAT = "qkv-checkpoint"
VERSION = 1
MANIFEST = "checkpoint.json"
TENSORS = "tensors.safetensors"
STATE = "state.safetensors"
MAX_MANIFEST_BYTES = 1 << 26
"""The largest ``checkpoint.json`` read (64 MiB): it holds settings and references only."""
DAMAGED = "the file was changed after saving; use another checkpoint of the run"
"""The hint of every error about a file that no longer holds what was saved."""


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
        super().__init__(visible(text))  # the config's words and labels may hold anything

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
