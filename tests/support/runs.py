"""Tiny ``qkv train`` runs to read back, and edits of their checkpoints' config."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkv.cli import main

_TINY = {
    "classify": ["--embedding-dim", "8", "--sentences", "80"],
    "recall": ["--d-model", "16", "--heads", "2", "--validation-size", "16"],
}


def tiny_run(out: Path, task: str) -> Path:
    """Train a tiny ``task`` run (4 steps, a checkpoint at 2 and 4) into ``out``."""
    argv = ["train", task, "--out", str(out), *_TINY[task]]
    assert main([*argv, "--steps", "4", "--eval-every", "2", "--quiet"]) == 0
    return out


def edit_config(run: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``change`` to the config in every ``checkpoint.json`` of ``run`` (the config is
    not covered by the files' SHA-256, so the checkpoint still loads)."""
    for manifest in run.rglob("checkpoint.json"):
        saved = json.loads(manifest.read_text(encoding="utf-8"))
        change(saved["config"])
        manifest.write_text(json.dumps(saved), encoding="utf-8")
