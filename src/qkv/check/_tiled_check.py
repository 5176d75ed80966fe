"""The check of a hand-worked tiled (FlashAttention) example: every claimed m, l, O of
``tiled.claimed`` against the tiled pass of :func:`qkv.attention._tiled_steps.tiled_steps`,
with follow-through and the slips a hand-worker makes named.

Each query row is its own chain: tile after tile, m, l and O are computed from the values
printed for the tile before (the correct ones where nothing is printed). A claimed number is

- ``ok`` within half a unit of its last printed digit of the correct value (or of the value
  that follows from the numbers printed before it, when those are right up to rounding);
- ``note`` (``rounding``) within one unit;
- ``consequential`` when it is what the step gives on the wrong numbers printed before it;
- ``mismatch`` otherwise, named by the slip that reproduces it (:data:`TILED_SLIPS`) or
  ``arithmetic``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from qkv._format import number
from qkv.attention._tiled_steps import ForwardTile, TiledSteps, tiled_steps
from qkv.check._findings import Finding
from qkv.check._pipeline import Setup, Values
from qkv.examples import Example
from qkv.examples._model import Claimed, decimals_of
from qkv.examples._tiled_format import TILED_CLAIMABLE, visited_blocks
from qkv.steps import TILED_WORDS

__all__ = ["TILED_SLIPS", "check_tiled"]

NO_RESCALE = "flash-no-rescale"
SUM_NOT_RESCALED = "flash-sum-not-rescaled"
MAX_NOT_UPDATED = "flash-max-not-updated"
FINAL_DIVIDE_MISSING = "flash-final-divide-missing"
LSE_WRONG_BASE = "flash-lse-wrong-base"
LSE_WITHOUT_MAX = "flash-lse-without-max"
UNSCALED = "unscaled"

TILED_SLIPS = {
    "tile_max": (UNSCALED,),
    "running_max": (MAX_NOT_UPDATED,),
    "rescale": (),
    "running_sum": (SUM_NOT_RESCALED,),
    "accumulator": (NO_RESCALE,),
    "output": (FINAL_DIVIDE_MISSING,),
    "lse": (LSE_WRONG_BASE, LSE_WITHOUT_MAX),
}
"""The slips tried on each tiled step, in order (``arithmetic`` when none reproduces it)."""

_LN2 = math.log(2.0)


@dataclass
class _State:
    """One query row's running values: m, l, O."""

    m: float = -math.inf
    l: float = 0.0  # noqa: E741 (the running sum's name in every FlashAttention paper)
    o: np.ndarray = field(default_factory=lambda: np.zeros(0))


@dataclass
class _Judged:
    step: str
    t: int
    key_block: int | None
    claimed: Claimed
    values: np.ndarray
    texts: tuple[str, ...]
    correct: np.ndarray
    status: str = ""
    diagnosis: str | None = None
    message: str = ""
    marks: tuple[str, ...] = ()
    cause: tuple[str, int] | None = None


def _exp(x: np.ndarray, m: float) -> np.ndarray:
    """exp(x − m), 0 where x is −∞ and everywhere when m is −∞ (no NaN)."""
    if math.isinf(m) and m < 0:
        return np.zeros_like(x)
    out: np.ndarray = np.where(np.isneginf(x), 0.0, np.exp(np.where(np.isneginf(x), 0.0, x) - m))
    return out


def _half(texts: tuple[str, ...], row: tuple[str, ...]) -> np.ndarray:
    """Half a unit of each number's last printed digit; a whole number (``1``, ``0``) is
    taken as exact to the finest digits of its claimed row (4 decimals if none has any):
    hand-workers write ``0`` and ``1`` for values that are exactly that."""
    finest = max((decimals_of(t) for t in row), default=0) or 4
    places = [decimals_of(t) or finest for t in texts]
    return 0.5 * 10.0 ** -np.array(places, dtype=np.float64)


def _off(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    with np.errstate(invalid="ignore"):
        diff = np.abs(a - b)
    return np.where(same, 0.0, np.nan_to_num(diff, nan=np.inf, posinf=np.inf))


def _close(a: np.ndarray, b: np.ndarray, half: np.ndarray, units: float) -> bool:
    b = np.asarray(b, dtype=np.float64)
    slack = units * half + 1e-9 * np.maximum(1.0, np.abs(np.nan_to_num(b, posinf=0, neginf=0)))
    return bool(np.all(_off(a, b) <= slack))


def check_tiled(example: Example, setup: Setup, values: Values) -> list[Finding]:
    """The findings of the tiled claims of ``example``: for each step of
    :data:`~qkv.examples._tiled_format.TILED_CLAIMABLE`, each query, each key block.

    ``values`` are the example's correct numbers (Q, K and V are read from them).
    """
    block = example.block_size
    if block is None or not example.tiled_claimed:
        return []
    q, k, v = (np.asarray(values[n], dtype=np.float64) for n in ("Q", "K", "V"))
    allowed = setup.allowed()
    steps = tiled_steps(q, k, v, block_size=block, scale=setup.factor, allowed=allowed)
    tiles = {(t.q_block, t.k_block): t for t in steps.tiles}
    visits = visited_blocks(allowed, block)
    names = example.queries_named
    judged: list[_Judged] = []
    for t in sorted({t for rows in example.tiled_claimed.values() for t in rows}):
        judged += _chain(example, t, block, visits[t // block], tiles, steps, v)
    order = {s: n for n, s in enumerate(TILED_CLAIMABLE)}
    judged.sort(key=lambda j: (order[j.step], j.t, -1 if j.key_block is None else j.key_block))
    return [
        Finding(
            step=j.step,
            token=names[j.t],
            position=j.t,
            claimed=tuple(float(x) for x in j.values),
            printed=j.texts,
            expected=tuple(float(x) for x in j.correct),
            status=j.status,
            diagnosis=j.diagnosis,
            message=j.message,
            marks=j.marks,
            line=j.claimed.line,
            cause=j.cause,
            decimals=min(max(max((decimals_of(x) for x in j.texts), default=0), 2), 8),
            tiled=True,
            key_block=j.key_block,
        )
        for j in judged
    ]


def _piece(claimed: Claimed, n: int, width: int) -> tuple[np.ndarray, tuple[str, ...]] | None:
    start, stop = n * width, (n + 1) * width
    if stop > len(claimed.values):
        return None
    return np.array(claimed.values[start:stop], dtype=np.float64), claimed.texts[start:stop]


def _chain(
    example: Example,
    t: int,
    block: int,
    visited: list[int],
    tiles: dict[tuple[int, int], ForwardTile],
    steps: TiledSteps,
    v: np.ndarray,
) -> list[_Judged]:
    """Judge every claimed number of query ``t``, tile after tile."""
    claims = {s: rows[t] for s, rows in example.tiled_claimed.items() if t in rows}
    d_v = v.shape[1]
    printed = _State(o=np.zeros(d_v))
    judged: list[_Judged] = []
    wrong: list[_Judged] = []  # the wrong rows of this query so far, in order
    qb, r = t // block, t % block
    for n, j in enumerate(visited):
        tile = tiles[qb, j]
        s = tile.scores[r]
        v_tile = v[tile.cols[0] : tile.cols[1]]
        correct = {
            "tile_max": np.array([tile.tile_max[r]]),
            "running_max": np.array([tile.m_new[r]]),
            "rescale": np.array([tile.rescale[r]]),
            "running_sum": np.array([tile.l_new[r]]),
            "accumulator": np.array(tile.o_new[r]),
        }
        got: dict[str, np.ndarray] = {}

        def take(
            step: str,
            from_printed: np.ndarray,
            slips: dict[str, np.ndarray],
            n: int = n,
            j: int = j,
            correct: dict[str, np.ndarray] = correct,
        ) -> np.ndarray:
            """Judge the claimed value of ``step`` on this tile, if any; the value the next
            steps go on from (the printed one, else the one from the printed numbers)."""
            claimed = claims.get(step)
            width = d_v if step == "accumulator" else 1
            piece = None if claimed is None else _piece(claimed, n, width)
            if piece is None or claimed is None:
                return from_printed
            row = _Judged(step, t, j, claimed, piece[0], piece[1], correct[step])
            _judge(row, from_printed, slips, wrong, j)
            judged.append(row)
            if row.status in ("mismatch", "consequential"):
                wrong.append(row)
            return row.values

        unscaled = {}
        if steps.scale != 1.0 and math.isfinite(tile.tile_max[r]):
            unscaled[UNSCALED] = np.array([tile.tile_max[r] / steps.scale])
        tm = float(take("tile_max", correct["tile_max"], unscaled)[0])
        m_old = printed.m
        m_fp = max(m_old, tm)
        not_updated: dict[str, np.ndarray] = {}
        if n > 0 and math.isfinite(m_old) and m_fp != m_old:
            not_updated[MAX_NOT_UPDATED] = np.array([m_old])
        elif n > 0 and math.isfinite(m_old) and m_fp != tm:
            not_updated[MAX_NOT_UPDATED] = np.array([tm])
        m_new = float(take("running_max", np.array([m_fp]), not_updated)[0])
        alpha_fp = 0.0 if math.isinf(m_old) and m_old < 0 else math.exp(m_old - m_new)
        alpha = float(take("rescale", np.array([alpha_fp]), {})[0])
        p = _exp(s, m_new)
        got["running_sum"] = take(
            "running_sum",
            np.array([alpha * printed.l + p.sum()]),
            {SUM_NOT_RESCALED: np.array([printed.l + p.sum()])} if n > 0 else {},
        )
        got["accumulator"] = take(
            "accumulator",
            alpha * printed.o + p @ v_tile,
            {NO_RESCALE: printed.o + p @ v_tile} if n > 0 else {},
        )
        printed = _State(m=m_new, l=float(got["running_sum"][0]), o=got["accumulator"])
    if len(visited) == 0:
        return judged
    finals = {"output": np.array(steps.output[t]), "lse": np.array([steps.lse[t]])}
    for step in ("output", "lse"):
        claimed = claims.get(step)
        if claimed is None:
            continue
        row = _Judged(
            step,
            t,
            None,
            claimed,
            np.array(claimed.values, dtype=np.float64),
            claimed.texts,
            finals[step],
        )
        with np.errstate(divide="ignore", invalid="ignore"):
            if step == "output":
                fp = printed.o / printed.l if printed.l else np.zeros(d_v)
                slips = {FINAL_DIVIDE_MISSING: printed.o}
            else:
                ln = math.log(printed.l) if printed.l > 0 else -math.inf
                fp = np.array([printed.m + ln])
                slips = {}
                if printed.l > 0:
                    slips[LSE_WRONG_BASE] = np.array([printed.m + ln / _LN2])
                    slips[LSE_WRONG_BASE + " "] = np.array([(printed.m + ln) / _LN2])
                    slips[LSE_WITHOUT_MAX] = np.array([ln])
        _judge(row, fp, slips, wrong, None)
        judged.append(row)
    return judged


def _judge(
    row: _Judged,
    from_printed: np.ndarray,
    slips: dict[str, np.ndarray],
    wrong: list[_Judged],
    key_block: int | None,
) -> None:
    half = _half(row.texts, row.claimed.texts)
    off = _off(row.values, row.correct)
    marks = tuple(
        "ok" if o <= h + 1e-9 else "rounding" if o <= 2 * h + 1e-9 else "wrong"
        for o, h in zip(off, half, strict=True)
    )
    feeds = [w for w in wrong if row.step != "tile_max"]
    where = "" if key_block is None else f" after key block {key_block}"
    title = TILED_WORDS[row.step].singular
    right = _vector(row.correct, row.texts)
    if _close(row.values, row.correct, half, 1) or (
        not feeds and _close(row.values, from_printed, half, 1)
    ):
        row.status, row.marks = "ok", tuple("ok" for _ in marks)
        row.message = f"The {title}{where} is right: {right}."
        return
    if _close(row.values, row.correct, half, 2) or (
        not feeds and _close(row.values, from_printed, half, 2)
    ):
        row.status, row.diagnosis, row.marks = "note", "rounding", marks
        row.message = (
            f"Off only in the last printed digit (rounding): the {title}{where} is {right}."
        )
        return
    row.marks = marks
    if feeds and _close(row.values, from_printed, half, 2):
        roots = [w for w in feeds if w.status == "mismatch"] or feeds
        root = roots[0]
        row.status, row.cause = "consequential", (root.step, root.t)
        at = "" if root.key_block is None else f" of key block {root.key_block}"
        row.message = (
            f"Done right on the wrong {TILED_WORDS[root.step].singular}{at} printed before it: "
            f"from the printed numbers it is {_vector(from_printed, row.texts)}. "
            f"With the correct numbers, the {title}{where} is {right}."
        )
        return
    row.status = "mismatch"
    for code, value in slips.items():
        if _close(row.values, value, half, 2):
            row.diagnosis = code.strip()
            row.message = f"{_SAY[code.strip()]} The {title}{where} is {right}: {_RULE[row.step]}."
            return
    row.diagnosis = "arithmetic"
    said = f"A slip of arithmetic in the {title}{where}: {_RULE[row.step]}."
    if not _close(from_printed, row.correct, half, 0):
        said += f" From the numbers printed before it, it is {_vector(from_printed, row.texts)};"
        said += f" the correct value is {right}."
    else:
        said += f" It is {right}."
    row.message = said


def _vector(values: np.ndarray, texts: tuple[str, ...]) -> str:
    places = min(max(max((decimals_of(x) for x in texts), default=0), 2), 8)
    if len(values) == 1:
        return number(float(values[0]), places)
    return "[" + ", ".join(number(float(x), places) for x in values) + "]"


_RULE = {
    "tile_max": "m̃ = the largest scaled score q·k/√d_k of the row among the tile's keys",
    "running_max": "m_new = max(m_old, m̃), the largest score seen so far",
    "rescale": "α = exp(m_old − m_new), 0 on the first tile",
    "running_sum": "l_new = α·l_old + Σ exp(s − m_new) over the tile's keys",
    "accumulator": "O_new = α·O_old + Σ exp(s − m_new)·v over the tile's keys",
    "output": "O / l, the accumulator divided by the running sum after the last tile",
    "lse": "L = m + ln l, in natural log",
}

_SAY = {
    UNSCALED: "The tile maximum is of the scores before scaling by 1/√d_k.",
    MAX_NOT_UPDATED: "The running maximum was not updated: it stays an old maximum (or only "
    "the tile's own) instead of the largest score seen so far.",
    SUM_NOT_RESCALED: "The running sum was not rescaled: l_old was added without multiplying "
    "it by α = exp(m_old − m_new) when the maximum grew.",
    NO_RESCALE: "The accumulator was not rescaled: O_old was added without multiplying it by "
    "α = exp(m_old − m_new) when the maximum grew.",
    FINAL_DIVIDE_MISSING: "The final division is missing: the output is the accumulator O, "
    "not yet divided by the running sum l.",
    LSE_WRONG_BASE: "The log-sum-exp is in base 2 (log2 instead of ln).",
    LSE_WITHOUT_MAX: "The log-sum-exp leaves out the maximum: ln l alone, without adding m.",
}
