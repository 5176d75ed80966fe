"""The performance targets of the issues, read from the ratios of one ``qkv bench`` run.

Each target holds one peer's time to the fastest of others at one case and length. A missed
target says when the machine may have missed it rather than the code: the load while its
rows were measured, or repeats that spread (:func:`qkv.bench._results.caveat`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from qkv.bench._results import SPREAD_BOUND, Row, Table, caveat

__all__ = ["TARGETS", "targets_table", "worst"]

TARGETS: tuple[tuple[str, str, str, str, tuple[str, ...], str, float], ...] = (
    # (table, case, what it says, peer, the peers it is held to, which lengths, goal): the
    # peer's time over the fastest of the others, at the same case and length
    ("masks", "window", "window: auto ÷ flex-compiled", "qkv-auto", ("flex-compiled",), "", 1.0),
    (
        "masks",
        "documents",
        "documents: auto ÷ flex-compiled",
        "qkv-auto",
        ("flex-compiled",),
        "",
        1.0,
    ),
    ("masks", "causal", "causal: auto ÷ flex-compiled", "qkv-auto", ("flex-compiled",), "", 1.0),
    (
        "masks-bwd",
        "window",
        "window fwd+bwd: auto ÷ best torch",
        "qkv-auto",
        ("sdpa-dense-mask", "naive-torch"),
        "",
        1.0,
    ),
    (
        "masks-bwd",
        "documents",
        "documents fwd+bwd: auto ÷ best torch",
        "qkv-auto",
        ("sdpa-dense-mask", "naive-torch"),
        "",
        1.0,
    ),
    ("backward", "dense", "dense fwd+bwd: tiled ÷ sdpa-flash", "tiled", ("sdpa-flash",), "", 1.05),
    (
        "backward",
        "causal",
        "causal fwd+bwd: tiled ÷ sdpa-flash",
        "tiled",
        ("sdpa-flash",),
        "",
        1.05,
    ),
    ("dense", "dense", "dense forward: tiled ÷ sdpa-flash", "tiled", ("sdpa-flash",), "1024", 1.2),
    (
        "dense",
        "causal",
        "causal forward: tiled ÷ sdpa-flash",
        "tiled",
        ("sdpa-flash",),
        "1024",
        1.2,
    ),
    (
        "dense",
        "dense",
        "dense forward: auto ÷ best of sdpa, tiled",
        "qkv-auto",
        ("sdpa-flash", "tiled"),
        "1024",
        1.03,
    ),
    (
        "dense",
        "causal",
        "causal forward: auto ÷ best of sdpa, tiled",
        "qkv-auto",
        ("sdpa-flash", "tiled"),
        "1024",
        1.03,
    ),
    (
        "train",
        "documents",
        "train step: packed ÷ best other",
        "qkv-packed",
        ("torch-mha-mask", "qkv-padded"),
        "",
        1.0,
    ),
    ("decode", "gqa", "decode: split-kv ÷ cache read", "split-kv", ("cache-read",), "", 1.3),
    ("decode", "gqa", "decode: split-kv ÷ sdpa", "split-kv", ("sdpa",), "", 1.0),
    (
        "decode",
        "gqa",
        "paged decode: split-kv ÷ flex-compiled",
        "split-kv-paged",
        ("flex-compiled-paged",),
        "",
        1.0,
    ),
)


def targets_table(tables: Sequence[Table], cores: int | None = None) -> Table | None:
    """The issues' performance targets, read from the times of this run's tables (None
    when no table of this run has one). Each target says when the machine may have missed
    it (:func:`qkv.bench._results.caveat`: the load while its rows were measured against
    ``cores``, default this machine's, and the spread of their repeats)."""
    by_key = {t.key: t for t in tables}
    table = Table(
        "targets",
        "Targets: time ratios in this run",
        "",
        note=(
            "ratio: the first peer's time over the fastest of the others named, same case "
            'and length, same run. met: the ratio is at most the goal. A "no" names a busy '
            "machine (its 1-minute load average above its cores) or noisy repeats (their "
            f"interquartile range over {SPREAD_BOUND:.0%} of their median) where there was "
            "one: then a rerun on a quiet machine decides."
        ),
    )
    for key, case, what, peer, others, length, goal in TARGETS:
        if key not in by_key:
            continue
        rows = [r for r in by_key[key].rows if r.case == case and r.seconds is not None]
        for row in rows:
            if row.peer != peer or (length and str(row.length) != length):
                continue
            held = [r for r in rows if r.peer in others and r.length == row.length]
            if not held or row.seconds is None:
                continue
            best = min(held, key=lambda r: r.seconds or 0.0)
            assert best.seconds is not None
            target = Row(what, row.length, peer, row.seconds, ratio=row.seconds / best.seconds)
            target.note = f"{goal:.2f}"
            target.spread = worst(row.spread, best.spread)
            target.load = worst(row.load, best.load)
            target.caveat = caveat(target.load, target.spread, cores or os.cpu_count())
            table.rows.append(target)
    return table if table.rows else None


def worst(a: float | None, b: float | None) -> float | None:
    """The larger of two figures, either of which may be unknown."""
    known = [x for x in (a, b) if x is not None]
    return max(known) if known else None
