"""The ``tiled:`` key of a format-2 worked example: the block size and the numbers a
hand-worker printed for the tiled (FlashAttention) algorithm, step by step.

.. code-block:: yaml

    tiled:
      block_size: 2
      claimed:
        tile_max: {t3: [0.5, 1.5]}       # one number per key block the query visits
        running_max: {t3: [0.5, 1.5]}
        rescale: {t3: [0, 0.3679]}
        running_sum: {t3: [1.6065, 1.5910]}
        accumulator: {t3: [[1.0, 0.6], [0.4, 1.2]]}   # one row (d_v numbers) per key block
        output: {t3: [0.25, 0.75]}       # O / l: d_v numbers
        lse: {t3: 2.0}                   # L = m + ln l: one number

The rows of ``tile_max``, ``running_max``, ``rescale``, ``running_sum`` and ``accumulator``
hold the values after each key block the query's block visits, left to right (tiles whose
keys are all masked are skipped, as the algorithm skips them); a row may stop early.
"""

from __future__ import annotations

import numpy as np
import yaml

from qkv.examples._format2 import _row
from qkv.examples._model import Claimed
from qkv.examples._nodes import NodeReader, join, line_of

__all__ = ["PER_TILE", "TILED_CLAIMABLE", "tiled_of", "visited_blocks"]

PER_TILE = ("tile_max", "running_max", "rescale", "running_sum", "accumulator")
"""The tiled steps claimed once per visited key block."""
TILED_CLAIMABLE = (*PER_TILE, "output", "lse")
"""Every step a tiled example may claim, in the order of computation."""
MAX_BLOCKS = 4096
"""The most tiles a tiled example may have (each is checked with its numbers)."""


def visited_blocks(allowed: np.ndarray, block_size: int) -> list[list[int]]:
    """Per query block, the key blocks it visits: those with at least one allowed key.

    Example:
        >>> visited_blocks(np.tril(np.ones((3, 3), dtype=bool)), 2)
        [[0], [0, 1]]
    """
    lq, lk = allowed.shape
    out: list[list[int]] = []
    for q0 in range(0, lq, block_size):
        rows = allowed[q0 : q0 + block_size]
        out.append(
            [
                j
                for j, k0 in enumerate(range(0, lk, block_size))
                if rows[:, k0 : k0 + block_size].any()
            ]
        )
    return out


def tiled_of(
    r: NodeReader,
    pair: tuple[yaml.Node, yaml.Node],
    *,
    allowed: np.ndarray,
    d_v: int,
    heads: int,
    queries: tuple[str, ...],
) -> tuple[int, dict[str, dict[int, Claimed]]]:
    """The block size and the claimed tiled rows (per-tile rows flattened, tile after tile)."""
    key, node = pair
    pairs = r.mapping(node, "tiled", allowed=("block_size", "claimed"), what="block_size: N")
    if "block_size" not in pairs:
        raise r.error(key, "tiled.block_size", "missing", "write tiled: {block_size: 2}")
    block = r.integer(pairs["block_size"][1], "tiled.block_size", minimum=1)
    if heads != 1:
        raise r.error(key, "tiled", f"the tiled steps are of one head; this example has {heads}")
    if d_v == 0:
        raise r.error(key, "tiled", "the tiled steps need V", "give inputs: {Q, K, V}")
    lq, lk = allowed.shape
    if -(-lq // block) * -(-lk // block) > MAX_BLOCKS:
        raise r.error(
            pairs["block_size"][1],
            "tiled.block_size",
            f"expected at most {MAX_BLOCKS} tiles, got {-(-lq // block) * -(-lk // block)}",
            "use a larger block_size",
        )
    claimed: dict[str, dict[int, Claimed]] = {}
    if "claimed" not in pairs:
        return block, claimed
    visits = visited_blocks(allowed, block)
    steps = r.mapping(
        pairs["claimed"][1],
        "tiled.claimed",
        allowed=TILED_CLAIMABLE,
        what="a mapping of tiled steps (running_max:, ...)",
    )
    for step, (_, rows_node) in steps.items():
        step_field = join("tiled.claimed", step)
        rows = r.mapping(rows_node, step_field, what="a mapping of token: [numbers]")
        by_token: dict[int, Claimed] = {}
        for _, (ref_node, row_node) in rows.items():
            row_field = join(step_field, str(ref_node.value))
            t = r.token(ref_node, row_field, queries)
            if t in by_token:
                raise r.error(ref_node, row_field, f"token {queries[t]} is claimed twice")
            values, texts = _row(
                r,
                row_node,
                row_field,
                masked_ok=step in ("tile_max", "running_max"),
                matrix=step == "accumulator",
            )
            tiles = len(visits[t // block])
            if step in PER_TILE:
                width = d_v if step == "accumulator" else 1
                what = f"{'rows' if width > 1 else 'numbers'}"
                if len(values) % width:
                    raise r.error(
                        row_node,
                        row_field,
                        f"expected rows of {d_v} numbers (d_v), got {len(values)} numbers",
                    )
                if not 1 <= len(values) // width <= tiles:
                    raise r.error(
                        row_node,
                        row_field,
                        f"expected 1 to {tiles} {what} (one per key block its query block "
                        f"visits: {', '.join(map(str, visits[t // block]))}), got "
                        f"{len(values) // width}",
                        "tiles whose keys are all masked are skipped; stop early if you like",
                    )
            else:
                want = d_v if step == "output" else 1
                if len(values) != want:
                    raise r.error(
                        row_node,
                        row_field,
                        f"expected {want} number{'s' if want > 1 else ''} "
                        f"({'d_v' if want > 1 else 'L = m + ln l'}), got {len(values)}",
                    )
            by_token[t] = Claimed(values=values, texts=texts, line=line_of(row_node))
        claimed[step] = by_token
    return block, claimed
