"""An independent float64 verdict for each published example of ``tests/data/corpus``.

This script never imports qkv: ``corpus_model`` reads the example files with PyYAML's node
API (every printed number keeps its digits) and recomputes attention in NumPy float64; this
module decides, for every claimed row, whether it is right, follows from an earlier wrong
row, or is a mistake of its own, and names the slip of the first mistake. ``test_corpus.py``
compares this verdict with ``qkv check`` and with the ``x-expect`` block of each file.

Rules, written down once and applied to every file:

- A number printed with n decimals is right within half a unit of its last digit of a
  reference; up to one unit beyond that is a rounding note, not a mistake.
- The references of a row are the exact value (from the exact inputs) and the step redone
  from the numbers the text printed just before it (its own Q, K, V, scores, exponentials,
  weights, products); anything between the two is accepted. A row that matches only when
  redone from a wrong earlier row is consequential, not a mistake of its own.
- Inputs declared printed rounded (``precision:``) widen every reference by the first-order
  effect of that rounding (half a unit on each input number, the effects added up).
- Minus infinity, or a number ≤ −10⁴, is the printed form of a masked score.
- Numbers printed by float32 code: the step is also recomputed in NumPy float32 (from the
  inputs rounded to float32), and a number within the references widened by
  :data:`FLOAT_ULPS` float32 units in its last place of them is float32 rounding. A file that
  says ``dtype: float32`` (or float16) is right there; a file that says nothing gets a
  rounding note; ``dtype: float64`` holds every printed digit (no such widening).
- A mistake is named by the first slip, in the order of :data:`SLIPS`, that reproduces every
  number of the row within its allowance plus one unit; ``arithmetic`` when none does.

``python tests/check/corpus_verdicts.py`` prints every file's verdict.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make ``tests`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.check.corpus_model import Example, Num, load, softmax_rows

__all__ = ["CORPUS", "SLIPS", "Verdict", "verdict"]

CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus"
ORDER = (
    "Q",
    "K",
    "V",
    "scores",
    "scaled",
    "exp",
    "exp_sum",
    "weights",
    "products",
    "context",
    "output",
)
SLIPS = (
    "unscaled",
    "scaled-by-dk",
    "scaled-by-dmodel",
    "transposed-weights",
    "softmax-wrong-axis",
    "query-key-swapped",
    "context-not-summed",
    "wrong-query",
    "sum-normalised",
    "mask-ignored",
    "mask-inverted",
    "causal-misaligned",
    "other-weights",
    "heads-averaged",
    "digit-slip",
    "not-softmax",
    "arithmetic",
)
MASKED = -1e4
FLOAT_ULPS = 4
"""Units in the last place of the float format that other libraries' order of operations
may move a number by, beyond NumPy's own float32 computation."""


@dataclass
class Verdict:
    """``ok`` and the first mistake (step, token, head, code); every row's status."""

    ok: bool
    step: str | None = None
    token: str | None = None
    head: int | None = None
    code: str | None = None
    rows: list[tuple[str, int | None, str, str]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        if self.ok:
            return {"ok": True}
        return {"ok": False, "step": self.step, "token": self.token, "code": self.code}


@dataclass
class Row:
    step: str
    head: int | None  # None: a top-level row (all heads side by side)
    index: int
    token: str
    nums: list[Num]

    @property
    def values(self) -> np.ndarray:
        return np.array([n.value for n in self.nums])


class Judge:
    def __init__(self, ex: Example) -> None:
        self.ex = ex
        self.exact = ex.forward(ex.inputs)
        self.band = ex.band()
        self.status: dict[tuple[str, int | None, int], str] = {}
        self.claimed = ex.data.get("claimed", {})
        self.assumed = ex.data.get("assumed", {})
        # float32 rounding: allowed where the file says so, a note where it says nothing
        self.float_kind = ex.dtype or "float32"
        self.low = None if ex.dtype == "float64" else ex.forward_in(self.float_kind)
        self.float_ok = ex.dtype is not None

    # -- which rows, in which order --------------------------------------------------
    def rows(self) -> Iterator[Row]:
        per = self.claimed.get("per_head", [])
        for step in ORDER:
            blocks: list[tuple[int | None, dict[str, Any]]] = []
            single = self.ex.heads == 1
            top_is_head = single or step not in ("Q", "K", "V", "context", "output")
            if step in ("context",):
                blocks += [(h, b) for h, b in enumerate(per)]
                blocks.append((0 if single else None, self.claimed))
            else:
                blocks.append((0 if top_is_head else None, self.claimed))
                blocks += [(h, b) for h, b in enumerate(per)]
            for head, block in blocks:
                for name, nums in (block.get(step) or {}).items():
                    index = self._index(name, step)
                    flat = nums if isinstance(nums, list) else [nums]
                    if step == "products":
                        flat = [x for r in flat for x in r]
                    yield Row(step, head, index, self._name(index, step), flat)

    def _tokens(self, step: str) -> list[str]:
        return self.ex.keys if step in ("K", "V") else self.ex.queries

    def _index(self, name: Any, step: str) -> int:
        return name if isinstance(name, int) else self._tokens(step).index(str(name))

    def _name(self, index: int, step: str) -> str:
        return self._tokens(step)[index]

    # -- exact rows and the numbers printed before -------------------------------------
    def exact_row(self, step: str, head: int | None, i: int) -> np.ndarray:
        src = self.exact if head is None or step in ("output",) else self.exact["per"][head]
        if head is not None and step in ("Q", "K", "V") and self.ex.heads == 1:
            src = self.exact
        return np.asarray(src[step][i], dtype=np.float64).ravel()

    def low_row(self, step: str, head: int | None, i: int) -> np.ndarray | None:
        """The row as NumPy computes it in the file's float format (None: float64)."""
        if self.low is None:
            return None
        src = self.low if head is None or step in ("output",) else self.low["per"][head]
        if head is not None and step in ("Q", "K", "V") and self.ex.heads == 1:
            src = self.low
        return np.asarray(src[step][i], dtype=np.float64).ravel()

    def band_row(self, step: str, head: int | None, i: int) -> np.ndarray:
        src = self.band if head is None or step == "output" else self.band["per"][head]
        if head is not None and step in ("Q", "K", "V") and self.ex.heads == 1:
            src = self.band
        return np.asarray(src[step][i], dtype=np.float64).ravel()

    def printed(self, step: str, head: int | None, i: int) -> tuple[np.ndarray, bool] | None:
        """The row as the text printed (or assumed) it, and whether it is wrong."""
        for block, h in self._blocks(head):
            for source in (block, self.assumed if h == head else {}):
                rows = source.get(step) or {}
                for name, nums in rows.items():
                    if self._index(name, step) == i:
                        flat = nums if isinstance(nums, list) else [nums]
                        if step == "products":
                            flat = [x for r in flat for x in r]
                        arr = np.array([n.value for n in flat])
                        if h is None and head is not None and step in ("Q", "K", "V"):
                            width = arr.size // self.ex.heads
                            arr = arr[head * width : (head + 1) * width]
                        wrong = self.status.get((step, h, i)) in ("wrong", "conseq")
                        return arr, wrong
        return None

    def _blocks(self, head: int | None) -> list[tuple[dict[str, Any], int | None]]:
        per = self.claimed.get("per_head", [])
        if self.ex.heads == 1:
            return [(self.claimed, 0)] + [(b, h) for h, b in enumerate(per)]
        out: list[tuple[dict[str, Any], int | None]] = []
        if head is not None and head < len(per):
            out.append((per[head], head))
        out.append((self.claimed, None))
        return out

    # -- references ------------------------------------------------------------------
    def candidates(self, step: str, head: int | None, i: int) -> list[tuple[np.ndarray, bool]]:
        """The step redone from the printed numbers before it: (row, uses a wrong row)."""
        ex, h = self.ex, head if head is not None else 0
        per: dict[str, Any] = self.exact["per"][min(h, ex.heads - 1)]
        out: list[tuple[np.ndarray, bool]] = []
        c = float(per["factor"])
        mask: np.ndarray = ex.mask[min(i, ex.mask.shape[0] - 1)]
        if step == "scores" and "scores" not in ex.inputs:
            q = self.printed("Q", head, i)
            qv, bad = (q[0], q[1]) if q else (per["Q"][i], False)
            ks = []
            for j in range(len(ex.keys)):
                k = self.printed("K", head, j)
                ks.append(k[0] if k else per["K"][j])
                bad |= bool(k and k[1])
            out.append((np.array(ks) @ qv, bad))
        if step in ("scaled", "exp", "exp_sum", "weights"):
            srcs = []
            s = self.printed("scores", head, i)
            if s:
                srcs.append((np.where(s[0] <= MASKED, 0.0, s[0]) * c, s[1]))
            if step != "scaled":
                t = self.printed("scaled", head, i)
                if t:
                    srcs.append((np.where(t[0] <= MASKED, 0.0, t[0]), t[1]))
            for z, bad in srcs:
                z = np.where(mask, z, -np.inf)
                if step == "scaled":
                    out.append((z, bad))
                e = np.where(mask, np.exp(np.where(mask, z, 0.0)), 0.0)
                if step == "exp":
                    out += [(e, bad), (_stable_exp(z, mask), bad)]
                if step == "exp_sum":
                    stable = _stable_exp(z, mask).sum()
                    out += [(np.array([e.sum()]), bad), (np.array([stable]), bad)]
                if step == "weights":
                    out.append((softmax_rows(z[None, :])[0], bad))
        if step == "exp_sum":
            ep = self.printed("exp", head, i)
            if ep:
                out.append((np.array([ep[0].sum()]), ep[1]))
            out.append((np.array([_stable_exp(per["scaled"][i], ex.mask[i]).sum()]), False))
        if step == "exp":
            out.append((_stable_exp(per["scaled"][i], ex.mask[i]), False))
        if step == "weights":
            ep, tot = self.printed("exp", head, i), self.printed("exp_sum", head, i)
            if ep and tot:
                out.append((ep[0] / tot[0][0], ep[1] or tot[1]))
            if ep:
                out.append((ep[0] / ep[0].sum(), ep[1]))
        if step in ("products", "context") and head is not None:
            w = self.printed("weights", head, i)
            vs, bad = self._values(head)
            if w:
                prods = w[0][:, None] * vs
                out.append((prods.ravel() if step == "products" else prods.sum(0), w[1] or bad))
            elif bad:
                out.append(
                    (
                        (per["weights"][i] @ vs)
                        if step == "context"
                        else (per["weights"][i][:, None] * vs).ravel(),
                        True,
                    )
                )
            if step == "context":
                p = self.printed("products", head, i)
                if p:
                    out.append((p[0].reshape(len(ex.keys), -1).sum(0), p[1]))
        if step == "context" and head is None:
            parts, bad = [], False
            for hh in range(ex.heads):
                got = self.printed("context", hh, i) if self.claimed.get("per_head") else None
                if got:
                    parts.append(got[0])
                    bad |= got[1]
                else:
                    cands = self.candidates("context", hh, i)
                    parts.append(cands[0][0] if cands else self.exact["per"][hh]["context"][i])
                    bad |= bool(cands and cands[0][1])
            out.append((np.concatenate(parts), bad))
        if step == "output" and "W_o" in ex.inputs:
            ctx = self.printed("context", None if ex.heads > 1 else 0, i)
            if ctx:
                out.append((ctx[0] @ ex.inputs["W_o"], ctx[1]))
        return out

    def _values(self, head: int) -> tuple[np.ndarray, bool]:
        per, rows, bad = self.exact["per"][head], [], False
        for j in range(len(self.ex.keys)):
            v = self.printed("V", head, j)
            rows.append(v[0] if v else per["V"][j])
            bad |= bool(v and v[1])
        return np.array(rows), bad

    # -- judging ---------------------------------------------------------------------
    def fits(self, row: Row, refs: list[np.ndarray], extra: float, ulps: float = 0.0) -> bool:
        """Every number within tolerance (+ ``extra`` units of its last digit, + ``ulps``
        units in the last place of the float format) of the envelope of ``refs``."""
        size = len(row.nums)
        refs = [np.asarray(r, dtype=np.float64).ravel() for r in refs]
        refs = [r for r in refs if r.size == size]
        if not refs:
            return False
        return all(self.fits_at(row, k, [r[k] for r in refs], extra, ulps) for k in range(size))

    def fits_at(self, row: Row, k: int, vals: list[float], extra: float, ulps: float = 0.0) -> bool:
        """Number ``k`` of the row within tolerance of the envelope of ``vals``."""
        num = row.nums[k]
        c, unit = num.value, 10.0 ** (-num.decimals)
        if c <= MASKED and any(v == -np.inf for v in vals):
            return True
        finite = [v for v in vals if np.isfinite(v)]
        if not finite:
            if row.step not in ("scores", "scaled"):
                return False
            finite = [self._unmasked(row, k)]
        band = float(self.band_row(row.step, row.head, row.index)[k])
        tol = 0.5 * unit + extra * unit + band + 1e-9 * max(1.0, abs(c))
        if ulps:
            kind = np.dtype(self.float_kind)
            tol += ulps * float(np.spacing(np.array(max(abs(v) for v in finite), dtype=kind)))
        return min(finite) - tol <= c <= max(finite) + tol

    def _unmasked(self, row: Row, k: int) -> float:
        per = self.exact["per"][row.head or 0]
        s = float(per["scores"][row.index][k])
        return s if row.step == "scores" else s * float(per["factor"])

    def judge(self, row: Row) -> str:
        exact = self.exact_row(row.step, row.head, row.index)
        cands = self.candidates(row.step, row.head, row.index)
        clean = [exact] + [c for c, bad in cands if not bad]
        if self.fits(row, clean, 0.0):
            return "ok"
        low = self.low_row(row.step, row.head, row.index)
        if low is not None and self.fits(row, [*clean, low], 0.0, FLOAT_ULPS):
            return "ok" if self.float_ok else "note"
        if self.fits(row, clean, 1.0):
            return "note"
        if any(bad for _, bad in cands) and self.fits(row, clean + [c for c, _ in cands], 1.0):
            return "conseq"
        return "wrong"

    def run(self) -> Verdict:
        from tests.check.corpus_slips import name_slip

        v = Verdict(ok=True)
        for row in self.rows():
            st = self.judge(row)
            self.status[(row.step, row.head, row.index)] = st
            v.rows.append((row.step, row.head, row.token, st))
            if st in ("wrong", "conseq"):
                v.ok = False
            if st == "wrong" and v.step is None:
                v.step, v.token, v.head = row.step, row.token, row.head
                v.code = name_slip(self, row)
        return v


def _stable_exp(z: np.ndarray, mask: np.ndarray) -> np.ndarray:
    finite = mask & np.isfinite(z)
    m = np.max(np.where(finite, z, -np.inf)) if finite.any() else 0.0
    return np.where(finite, np.exp(np.where(finite, z - m, 0.0)), 0.0)


def verdict(path: Path) -> Verdict:
    """The independent verdict of one example file."""
    return Judge(Example(load(path))).run()


def each(folder: Path = CORPUS) -> Iterator[tuple[Path, Verdict]]:
    for path in sorted(folder.glob("*.yaml")):
        yield path, verdict(path)


if __name__ == "__main__":
    for path, v in each():
        print(f"{path.stem:34s} {v.summary()}")
        if "-v" in sys.argv:
            for step, head, token, st in v.rows:
                print(f"    {step:9s} head {head} {token:10s} {st}")
