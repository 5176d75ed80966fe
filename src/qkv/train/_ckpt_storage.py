"""Checkpoint storage: the folder layout, atomic writes and finding the newest checkpoint.

A run's checkpoint folder holds one sub-folder per save and a pointer to the newest::

    checkpoints/
        latest                      "step-000000200"
        step-000000100/
        step-000000200/             tensors.safetensors, state.safetensors, checkpoint.json

A save goes to a hidden temporary folder (``.tmp-*``), every file is flushed to disk (fsync),
the folder is renamed into place, and only then is ``latest`` replaced (a temporary file
renamed over it). A crash at any moment leaves ``latest`` pointing at a complete checkpoint;
the next save removes the leftovers. This module knows bytes and names only: what the files
hold is ``_ckpt_encoding``'s business, whether they are intact ``_ckpt_verify``'s.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from qkv._io import write_atomic
from qkv._read import json_value, read_bytes
from qkv.train._ckpt_format import MANIFEST, MAX_MANIFEST_BYTES, STATE, TENSORS, CheckpointError

__all__ = [
    "LATEST",
    "STEP_NAME",
    "TMP_PREFIX",
    "WriteFile",
    "complete",
    "free_name",
    "fsync_dir",
    "latest_checkpoint",
    "next_sequence",
    "prune",
    "remove_leftovers",
    "resolve",
    "write_file",
    "write_pointer",
    "write_step",
]

LATEST = "latest"
TMP_PREFIX = ".tmp-"
STEP_NAME = re.compile(r"step-(\d+)(?:\.(\d+))?")
"""A step folder's name: ``step-000000123``, or ``step-000000123.1`` for a repeated step."""

WriteFile = Callable[[Path, bytes], None]
"""How one file of a step folder is written: :func:`write_file`, or a test's stand-in."""


# -- writing --------------------------------------------------------------------------------


def write_file(path: Path, data: bytes) -> None:
    """Create ``path`` (it must not exist) with ``data``, flushed to disk."""
    with path.open("xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def fsync_dir(folder: Path) -> None:
    """Flush a folder's entries (new and renamed names) to disk."""
    if os.name != "posix":  # pragma: no cover - Windows cannot open folders
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_step(
    folder: Path, name: str, files: Mapping[str, bytes], *, write: WriteFile = write_file
) -> Path:
    """Write ``files`` (name → bytes, in order) as the step folder ``folder / name``.

    The files go into a hidden temporary folder that is renamed into place once all of them
    are on disk; on any failure the temporary folder is removed and the error goes on.
    """
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=folder))
    try:
        for file, data in files.items():
            write(tmp / file, data)
        fsync_dir(tmp)
        os.rename(tmp, folder / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(folder)
    return folder / name


def write_pointer(folder: Path, name: str) -> None:
    """Point ``latest`` at the step folder ``name`` (replaced atomically)."""
    write_atomic(folder / LATEST, f"{name}\n")
    fsync_dir(folder)


def remove_leftovers(folder: Path) -> None:
    """Temporary files and folders of saves that crashed."""
    for entry in folder.iterdir():
        pointer_tmp = entry.name.startswith(f".{LATEST}.") and entry.name.endswith(".tmp")
        if entry.name.startswith(TMP_PREFIX) or pointer_tmp:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    entry.unlink()


def free_name(folder: Path, step: int) -> str:
    """``step-000000123``, or ``step-000000123.1`` (``.2``, ...) when that exists already."""
    name = f"step-{step:09d}"
    suffix = 0
    while (folder / name).exists():
        suffix += 1
        name = f"step-{step:09d}.{suffix}"
    return name


def complete(folder: Path) -> Iterator[tuple[int, Path]]:
    """(sequence, folder) of every complete checkpoint in ``folder``."""
    for entry in folder.iterdir():
        if not STEP_NAME.fullmatch(entry.name):
            continue
        try:
            text = read_bytes(entry / MANIFEST, limit=MAX_MANIFEST_BYTES, what=MANIFEST)
            manifest = json_value(text.decode("utf-8"))
            yield int(manifest["sequence"]), entry
        except (OSError, ValueError, KeyError, TypeError):
            continue


def next_sequence(folder: Path) -> int:
    """The save number of the next checkpoint in ``folder``: one more than the highest."""
    return max((seq for seq, _ in complete(folder)), default=0) + 1


def prune(folder: Path, keep: int, *, newest: str) -> None:
    """Remove all but the ``keep`` newest complete checkpoints (never ``newest``)."""
    ordered = sorted(complete(folder), key=lambda item: item[0], reverse=True)
    for _, entry in ordered[keep:]:
        if entry.name != newest:
            shutil.rmtree(entry, ignore_errors=True)


# -- finding --------------------------------------------------------------------------------


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint folder in ``directory``, or None if it has none."""
    folder = Path(directory)
    if not folder.is_dir():
        return None
    if (folder / MANIFEST).is_file():
        return folder
    with contextlib.suppress(OSError, UnicodeDecodeError):
        name = (folder / LATEST).read_text(encoding="utf-8").strip()
        if STEP_NAME.fullmatch(name) and (folder / name / MANIFEST).is_file():
            return folder / name
    found = list(complete(folder))
    return max(found, key=lambda item: item[0])[1] if found else None


def resolve(path: Path) -> Path:
    """The step folder to load for ``path``: a run's checkpoint folder, a step folder or one
    of its files.

    Raises:
        CheckpointError: nothing there, an incomplete step folder, or no checkpoint inside.
    """
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
    if path.is_dir() and STEP_NAME.fullmatch(path.name):
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
