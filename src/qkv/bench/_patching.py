"""The patching section of ``qkv bench``: a sweep over every head of a 12-layer, 12-head
model, qkv's against a forward per head, eager attention with hooks, TransformerLens and
nnsight (when installed: ``qkv[interp]``), measured in the same run.

The sweeps are :mod:`qkv.edits._timing`'s (those of ``benchmarks/bench_patching.py``), run
in a fresh Python process per length (``python -m qkv.edits._timing SPEC``): ``qkv.edits``
sits above this layer, and a fresh process also keeps one sweep's memory from the next's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from qkv.bench._measure import in_fresh_process
from qkv.bench._results import Row, Settings, Table

__all__ = ["LENGTHS", "QUICK_LENGTHS", "REFERENCE", "patching_section", "patching_ticks"]

LENGTHS = (128, 512, 1024)
QUICK_LENGTHS = (128,)
REFERENCE = "qkv.patching"
_WORKER = "qkv.edits._timing"


def _lengths(settings: Settings) -> tuple[int, ...]:
    return QUICK_LENGTHS if settings.quick else LENGTHS


def patching_ticks(settings: Settings) -> int:
    """The progress ticks of the section: one per length."""
    return len(_lengths(settings))


def _measured(spec: dict[str, Any]) -> dict[str, Any]:
    """The worker's answer for ``spec``, from a fresh process."""
    return in_fresh_process(_WORKER, [json.dumps(spec)], "the patching benchmark")


def patching_section(settings: Settings, tick: Callable[[], None]) -> Table:
    """Time the sweeps at each length (module docstring); ratios to qkv's sweep."""
    table = Table(
        "patching",
        "Activation patching of every head: GPT-2, 12 layers x 12 heads, hidden 96, B=1",
        REFERENCE,
        note=(
            "ratio: time / qkv.patching's (above 1: slower than qkv). qkv runs each layer's "
            "heads as one batch from that layer's kept input and the first position the "
            "prompts differ at (the middle); the others run the whole model once per head. "
            "Every table is checked against qkv's (1e-4) before it counts."
        ),
    )
    for length in _lengths(settings):
        spec = {"length": length, "repeats": settings.repeats, "threads": settings.threads}
        answer = _measured(spec)
        seconds: dict[str, float] = answer["seconds"]
        base = seconds[REFERENCE]
        for peer, value in seconds.items():
            note = f"model runs: {answer['forwards'][peer]}"
            table.rows.append(Row("sweep", length, peer, value, ratio=value / base, note=note))
        tick()
    return table
