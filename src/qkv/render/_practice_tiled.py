"""Practice of the tiled (FlashAttention) algorithm: ``qkv explain --tiled --practice``.

The learner types, tile by tile, each query's running maximum m, running sum l and
accumulator O, then the output O / l. The page runs no attention: everything it compares a
typed row with is computed here, and every sentence it shows is what :func:`qkv.check.check`
says about that row (a tiled worked example holding the row, and the rows it follows from):

- the **correct** row and check's sentence on it;
- per **slip** of the row (``flash-max-not-updated``, ``flash-sum-not-rescaled``,
  ``flash-no-rescale``, ``flash-final-divide-missing``): the row that slip gives from correct
  earlier rows, with check's diagnosis and sentence;
- per **consequential** row: the row a correct step gives from earlier rows carrying one
  slip, with the earlier rows it assumes (``inputs``), which the page compares with what the
  learner typed there, and check's sentence.

A row the page cannot reproduce (an arithmetic slip, or one computed from an earlier
arithmetic slip) is called an arithmetic slip with its correct numbers, as ``qkv check`` does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any

import numpy as np

from qkv.attention._tiled_steps import tiled_steps
from qkv.check import DIAGNOSES, Setup, check
from qkv.check._pipeline import correct_values
from qkv.examples import Claimed, Example
from qkv.examples._tiled_format import visited_blocks
from qkv.steps import TILED_WORDS

__all__ = ["MAX_TILED_TOKENS", "tiled_practice_data"]

MAX_TILED_TOKENS = 8
"""The most tokens a tiled practice page takes: every row is typed by hand."""

_TYPED = ("running_max", "running_sum", "accumulator")
"""The rows typed per tile, in the order the algorithm computes them."""
_SYMBOL = {"running_max": "m", "running_sum": "l", "accumulator": "O", "output": "O / l"}

Row = tuple[str, int | None]  # (step, key block); key block None for the output
World = dict[Row, np.ndarray]


def _key(step: str, t: int, k_block: int | None) -> str:
    return f"{step}/{t}" if k_block is None else f"{step}/{t}/{k_block}"


def _chain(
    scores: list[np.ndarray],
    values: list[np.ndarray],
    blocks: list[int],
    slip: tuple[Row, str] | None,
) -> World:
    """One query's typed rows, tile after tile, every step right except ``slip`` (the row
    and the code of the slip made there), the rows after it computed from it."""
    d_v = values[0].shape[1]
    m, total, o = -math.inf, 0.0, np.zeros(d_v)  # the running max, sum and accumulator
    world: World = {}
    for s, v, j in zip(scores, values, blocks, strict=True):
        finite = s[np.isfinite(s)]
        tile_max = float(finite.max()) if finite.size else -math.inf
        m_new = max(m, tile_max)
        if slip == (("running_max", j), "flash-max-not-updated"):
            m_new = m if m_new != m else tile_max
        alpha = 0.0 if math.isinf(m) or math.isinf(m_new) else math.exp(m - m_new)
        p = (
            np.zeros_like(s)
            if math.isinf(m_new)
            else np.where(np.isfinite(s), np.exp(s - m_new), 0)
        )
        l_new = alpha * total + float(p.sum())
        if slip == (("running_sum", j), "flash-sum-not-rescaled"):
            l_new = total + float(p.sum())
        o_new = alpha * o + p @ v
        if slip == (("accumulator", j), "flash-no-rescale"):
            o_new = o + p @ v
        m, total, o = m_new, l_new, o_new
        world["running_max", j] = np.array([m])
        world["running_sum", j] = np.array([total])
        world["accumulator", j] = np.array(o)
    out = o / total if total > 0 else np.zeros(d_v)
    if slip == (("output", None), "flash-final-divide-missing"):
        out = o
    world["output", None] = out
    return world


def _order(blocks: list[int]) -> list[Row]:
    return [(step, j) for j in blocks for step in _TYPED] + [("output", None)]


def _claim(values: np.ndarray, precision: int) -> Claimed:
    return Claimed(
        values=tuple(float(x) for x in values),
        texts=tuple(f"{x:.{precision}f}" if math.isfinite(x) else "-inf" for x in values),
    )


def _says(
    example: Example, t: int, rows: list[Row], world: World, precision: int
) -> tuple[str, str | None, str]:
    """What ``qkv check`` says of the last of ``rows`` when the learner printed ``rows`` as
    ``world`` holds them: (status, diagnosis, message)."""
    claimed: dict[str, dict[int, Claimed]] = {}
    for step in (*_TYPED, "output"):
        mine = [world[row] for row in rows if row[0] == step]
        if mine:
            claimed[step] = {t: _claim(np.concatenate(mine), precision)}
    report = check(dataclasses.replace(example, tiled_claimed=claimed))
    step, k_block = rows[-1]
    finding = next(
        f
        for f in report.findings
        if f.tiled and f.position == t and f.step == step and f.key_block == k_block
    )
    return finding.status, finding.diagnosis, finding.message


def tiled_practice_data(
    example: Example, *, block_size: int = 2, precision: int = 4
) -> dict[str, Any]:
    """What the tiled practice page needs, as plain JSON-able data (see the module).

    Raises:
        ValueError: more than :data:`MAX_TILED_TOKENS` tokens, several heads, an example
            without V or whose queries are not its tokens.

    Example:
        >>> from qkv.examples import builtin
        >>> data = tiled_practice_data(builtin("flash-by-hand"))
        >>> [(t["q_block"], t["k_block"]) for t in data["tiles"]]
        [(0, 0), (0, 1), (1, 0), (1, 1)]
        >>> row = data["tiles"][3]["rows"][1]          # l of "sat" after key block 1
        >>> row["label"], round(row["correct"][0], 4)
        ('l of sat', 1.1179)
        >>> [c["code"] for c in row["candidates"] if c["kind"] == "slip"]
        ['flash-sum-not-rescaled']
    """
    length = len(example.queries_named)
    if length > MAX_TILED_TOKENS:
        raise ValueError(
            f"this example has {length} queries, more than {MAX_TILED_TOKENS}; practice pages "
            "are for examples worked by hand. Hint: pick a smaller example (qkv examples)"
        )
    if example.heads != 1 or example.inputs not in ("embeddings", "qkv"):
        raise ValueError(
            "a tiled practice page needs one head and V (embeddings and weights, or Q, K and "
            "V). Hint: qkv explain --tiled --practice --example flash-by-hand --html FILE"
        )
    if example.query_tokens is not None:
        raise ValueError(
            "a tiled practice page has one query per token. Hint: give Q, K and V for the "
            "same tokens"
        )
    example = dataclasses.replace(
        example,
        claimed={},
        head_claimed=(),
        assumed={},
        queries=None,
        format=2,
        block_size=block_size,
        tiled_claimed={},
    )
    setup = Setup.of(example)
    values = correct_values(example)
    q, k, v = (np.asarray(values[n], dtype=np.float64) for n in ("Q", "K", "V"))
    allowed = setup.allowed()
    steps = tiled_steps(q, k, v, block_size=block_size, scale=setup.factor, allowed=allowed)
    tiles = {(t.q_block, t.k_block): t for t in steps.tiles}
    visits = visited_blocks(allowed, block_size)
    names = [str(x) for x in example.queries_named]
    keys = [str(x) for x in example.tokens]
    rows_of: dict[Row, dict[int, dict[str, Any]]] = {}
    for t in range(length):
        qb, r = divmod(t, block_size)
        blocks = visits[qb]
        if not blocks:
            continue
        scores = [tiles[qb, j].scores[r] for j in blocks]
        vs = [v[tiles[qb, j].cols[0] : tiles[qb, j].cols[1]] for j in blocks]
        right = _chain(scores, vs, blocks, None)
        if not all(np.isfinite(x).all() for x in right.values()):
            raise ValueError(
                f"the query {names[t]} has no allowed key in a tile it visits (its m is −∞ "
                "there), which a practice page does not ask. Hint: practise it without the "
                "mask, or with another --block-size"
            )
        order = _order(blocks)
        for n, row in enumerate(order):
            status, _, says = _says(example, t, order[: n + 1], right, precision)
            rows_of.setdefault(row, {})[t] = {
                "key": _key(row[0], t, row[1]),
                "t": t,
                "step": row[0],
                "k_block": row[1],
                "label": f"{_SYMBOL[row[0]]} of {names[t]}",
                "correct": [float(x) for x in right[row]],
                "says": says,
                "candidates": [],
            }
        for n, row in enumerate(order):
            for code in _slips(row, blocks):
                world = _chain(scores, vs, blocks, (row, code))
                for later in order[n:]:
                    if np.allclose(world[later], right[later], rtol=0, atol=1e-12):
                        continue
                    status, diagnosis, says = _says(
                        example, t, order[: order.index(later) + 1], world, precision
                    )
                    inputs = [
                        [_key(x[0], t, x[1]), [float(y) for y in world[x]]]
                        for x in order[n : order.index(later)]
                        if not np.allclose(world[x], right[x], rtol=0, atol=1e-12)
                    ]
                    rows_of[later][t]["candidates"].append(
                        {
                            "kind": "slip" if later == row else "consequential",
                            "code": diagnosis,
                            "status": status,
                            "values": [float(y) for y in world[later]],
                            "inputs": inputs,
                            "says": says,
                        }
                    )
    tiles_out = []
    for qb, blocks in enumerate(visits):
        queries = list(range(qb * block_size, min((qb + 1) * block_size, length)))
        for j in blocks:
            k0, k1 = tiles[qb, j].cols
            tiles_out.append(
                {
                    "q_block": qb,
                    "k_block": j,
                    "keys": keys[k0:k1],
                    "queries": [names[t] for t in queries],
                    "rows": [
                        rows_of[step, j][t]
                        for t in queries
                        for step in _TYPED
                        if t in rows_of.get((step, j), {})
                    ],
                }
            )
    data: dict[str, Any] = {
        "block_size": block_size,
        "tokens": keys,
        "ask": {step: TILED_WORDS[step].formula for step in (*_TYPED, "output")},
        "tiles": tiles_out,
        "final": [rows_of["output", None][t] for t in sorted(rows_of.get(("output", None), {}))],
        "diagnoses": dict(DIAGNOSES),
        "precision": precision,
    }
    text = json.dumps(data, sort_keys=True, ensure_ascii=True)
    data["id"] = hashlib.sha256(text.encode("ascii")).hexdigest()[:16]
    return data


def _slips(row: Row, blocks: list[int]) -> tuple[str, ...]:
    step, j = row
    if step == "output":
        return ("flash-final-divide-missing",)
    if j is None or j == blocks[0]:  # nothing to rescale before the first tile
        return ()
    return {
        "running_max": ("flash-max-not-updated",),
        "running_sum": ("flash-sum-not-rescaled",),
        "accumulator": ("flash-no-rescale",),
    }[step]
