"""Each setting of a run: the value given, else the resumed run's, else the default.

A resumed run keeps its model, data and seed: a value that differs from the run's is an
error that names the option. Its training settings (steps, learning rate, evaluation, early
stopping) may change. The defaults are the dataclasses of :mod:`qkv._train_settings`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, fields
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from qkv._train_settings import TrainSettings
from qkv.train._checkpoint import (
    CheckpointError,
    check_run_config,
    latest_checkpoint,
    load_checkpoint,
)
from qkv.train._loop import CHECKPOINTS

__all__ = [
    "option_name",
    "qkv_version",
    "resolve",
    "saved_config",
    "saved_start",
    "training_settings",
]

_OPTION_NAMES = {
    "d_model": "--d-model",
    "num_heads": "--heads",
    "validation_size": "--validation-size",
    "next_token": "--no-next-token",
    "batch_size": "--batch-size",
    "embedding_dim": "--embedding-dim",
    "max_length": "--max-length",
    "lowercase": "--keep-case",
    "min_count": "--min-count",
    "text_column": "--text-column",
    "label_column": "--label-column",
    "group_column": "--group-column",
}


def option_name(key: str) -> str:
    """The command-line option of a setting (``d_model`` → ``--d-model``)."""
    return _OPTION_NAMES.get(key, "--" + key.replace("_", "-"))


def qkv_version() -> str:
    """The installed qkv's version, recorded in every run's config."""
    try:
        return version("qkv")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0.0.0"


def resolve(
    given: Mapping[str, Any],
    saved: Mapping[str, Any] | None,
    defaults: Mapping[str, Any],
    *,
    new_values_allowed: bool = False,
) -> dict[str, Any]:
    """Each key of ``given``: its value, else the saved run's, else the default.

    Raises:
        ValueError: a given value that differs from the saved run's (unless
            ``new_values_allowed``), naming the option.
    """
    out = {}
    for key, value in given.items():
        if saved is not None and key in saved:
            if value is not None and value != saved[key] and not new_values_allowed:
                raise ValueError(
                    f"{option_name(key)} {value!r} differs from the run being resumed, which "
                    f"has {saved[key]!r}. Hint: leave {option_name(key)} out to keep the run's, "
                    "or start a new run with another --out."
                )
            out[key] = saved[key] if value is None else value
        else:
            out[key] = defaults[key] if value is None else value
    return out


def training_settings(
    training: Mapping[str, Any] | None,
    saved: Mapping[str, Any] | None,
    defaults: TrainSettings,
) -> TrainSettings:
    """The task's training defaults, then the resumed run's, then ``training``'s fields.

    Raises:
        ValueError: a key of ``training`` that is not a field of :class:`TrainSettings`, or a
            bad value.
    """
    names = {f.name for f in fields(TrainSettings)}
    given = dict(training or {})
    unknown = sorted(set(given) - names)
    if unknown:
        raise ValueError(f"unknown training settings {unknown}; expected some of {sorted(names)}.")
    base = {**asdict(defaults), **(saved or {}).get("training", {})}
    merged = {k: v for k, v in base.items() if k in names}
    merged.update(given)
    return TrainSettings(**merged)


def saved_config(out: str | os.PathLike[str]) -> dict[str, Any]:
    """The config of the newest checkpoint of the run in ``out`` (checked).

    Raises:
        CheckpointError: no checkpoint to resume, or a damaged one.
    """
    where = Path(out) / CHECKPOINTS
    if latest_checkpoint(where) is None:
        raise CheckpointError(
            "nothing to resume: no checkpoint in checkpoints/",
            path=out,
            hint="give the --out folder of an earlier run, or start without --resume",
        )
    checkpoint = load_checkpoint(where)
    check_run_config(checkpoint)  # before a model is built from it
    return checkpoint.config


def saved_start(out: str | os.PathLike[str]) -> torch.Tensor:
    """The embeddings a resumed run started from (kept in its checkpoint's state)."""
    state = load_checkpoint(Path(out) / CHECKPOINTS).state
    start: torch.Tensor = state["extra"]["embedding_start"]
    return start
