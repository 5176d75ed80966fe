"""``--kind flash``: which slip a FlashAttention forward (and backward) makes, as a report.

The entry point is either a function ``NAME(Q, K, V, is_causal)`` returning ``(O, L)`` or
``O``, or a ``torch.autograd.Function`` in CS336's convention: ``NAME.apply(Q, K, V,
is_causal)`` returns O and saves L, of shape (batch, n_queries) in natural log, among its
saved tensors; when it has a backward, dQ, dK and dV are checked too.

The probes (:func:`flash_probes`) are float32 tensors of shape (batch, n, d) or (batch,
heads, n, d): lengths that are and are not multiples of the block, n_q ≠ n_k, a last block of
one row, causal at n > 64 with fully masked blocks, scores that jump by 1000 (a missing
rescale shows), d = 16 and 64. Each slip is made in float64
(:mod:`~qkv.check._flash_slips`) with every block size of 16 to 128, and the one that gives
the student's numbers is named (:data:`~qkv.check._flash_codes.FLASH_DIAGNOSES`).

Example:
    >>> import torch
    >>> def flash(Q, K, V, is_causal=False):        # the plain softmax: right
    ...     s = Q @ K.transpose(-1, -2) / Q.shape[-1] ** 0.5
    ...     if is_causal:
    ...         n = s.shape[-1]
    ...         s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    ...     return torch.softmax(s, -1) @ V, torch.logsumexp(s, -1)
    >>> check_flash(flash).ok
    True
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from qkv._format import number
from qkv.check._findings import Finding
from qkv.check._flash_codes import FLASH_DIAGNOSES
from qkv.check._flash_probes import (
    CONTRACTS,
    FlashProbe,
    Got,
    call_probe,
    flash_probes,
    has_backward,
    is_autograd,
    remote,
)
from qkv.check._flash_slips import FlashSlip, backward, tiled
from qkv.check._function import FunctionReport
from qkv.check._function_file import (
    FlashCall,
    run_file,
    split_target,
)
from qkv.check._function_run import FunctionError, student_text

__all__ = ["CONTRACTS", "FlashProbe", "check_flash", "check_flash_file", "flash_probes"]

Array = NDArray[np.float64]


_BLOCKS = (16, 32, 64, 128)
_ONE = 1 << 20  # one block holds everything: a slip the block size does not change
_O_TOL = (2e-3, 2e-3)  # (atol, rtol) of a float32 kernel against the float64 oracle
_L_TOL = (2e-3, 1e-5)


def _close(got: Array | None, want: Array, tol: tuple[float, float]) -> bool:
    if got is None or got.shape != want.shape:
        return False
    bad_got, bad_want = ~np.isfinite(got), ~np.isfinite(want)
    if not np.array_equal(bad_got, bad_want):
        return False
    with np.errstate(invalid="ignore"):
        return bool(np.allclose(got[~bad_got], want[~bad_want], atol=tol[0], rtol=tol[1]))


def _grad_tol(want: Array) -> tuple[float, float]:
    """A gradient's tolerance: float32's error grows with its largest entry."""
    with np.errstate(invalid="ignore"):
        top = float(np.nanmax(np.abs(want))) if want.size else 0.0
    return (_O_TOL[0] * (1.0 + top), _O_TOL[1])


_Candidate = tuple[str, FlashSlip, bool]  # code, slip, whether the block sizes matter

_FORWARD: tuple[_Candidate, ...] = (
    ("unscaled", FlashSlip(scale="none"), False),
    ("scaled-by-dk", FlashSlip(scale="dk"), False),
    ("flash-final-divide-missing", FlashSlip(divide=False), False),
    ("flash-no-rescale", FlashSlip(rescale_acc=False), True),
    ("flash-sum-not-rescaled", FlashSlip(rescale_sum=False), True),
    ("flash-max-not-updated", FlashSlip(max_rule="first"), True),
    ("flash-last-tile-dropped", FlashSlip(drop_q=True), True),
    ("flash-last-tile-dropped", FlashSlip(drop_k=True), True),
    ("flash-last-tile-dropped", FlashSlip(drop_q=True, drop_k=True), True),
    ("flash-kv-tiles-from-q", FlashSlip(kv_from_q=True), True),
)
_CAUSAL: tuple[tuple[str, dict[str, Any], bool], ...] = (
    ("flash-causal-ignored", {"causal": "ignored"}, False),
    ("causal-off-by-one", {"causal": "strict"}, False),
    ("flash-empty-tile-nan", {"causal": "all-blocks", "local_max": True}, True),
    ("flash-causal-diagonal", {"causal": "diag-full"}, True),
    ("flash-causal-diagonal", {"causal": "diag-skip"}, True),
    ("flash-causal-offset", {"causal": "local"}, True),
    ("flash-causal-offset", {"causal": "local-skip"}, True),
)
_LSE: tuple[tuple[str, str], ...] = (
    ("flash-lse-wrong-base", "log2"),
    ("flash-lse-wrong-base", "log2-l"),
    ("flash-lse-without-max", "no-max"),
)
_BACKWARD: tuple[tuple[str, str], ...] = (
    ("flash-backward-D", "D-zero"),
    ("flash-backward-D", "D-dO"),
    ("flash-backward-scale", "unscaled"),
    ("flash-backward-scale", "scale-twice"),
)


class _Judge:
    """The probes with the student's results, and the slips made on them (cached)."""

    def __init__(self, probes: Sequence[FlashProbe], got: Sequence[Got]) -> None:
        self.probes = probes
        self.got = got
        self._made: dict[tuple[int, FlashSlip, int, int], tuple[Array, Array]] = {}

    def made(self, index: int, slip: FlashSlip, bq: int, bk: int) -> tuple[Array, Array]:
        key = (index, slip, bq, bk)
        if key not in self._made:
            p = self.probes[index]
            self._made[key] = tiled(p.q, p.k, p.v, p.causal, slip, bq, bk)
        return self._made[key]

    def ran(self, causal: bool | None = None) -> list[int]:
        return [
            i
            for i, (p, g) in enumerate(zip(self.probes, self.got, strict=True))
            if g.out is not None and (causal is None or p.causal == causal)
        ]

    def gives(
        self, slip: FlashSlip, blocks: tuple[int, int], where: Iterable[int], lse: bool = False
    ) -> bool:
        for i in where:
            o, lse_made = self.made(i, slip, *blocks)
            if lse:
                if not _close(self.got[i].lse, lse_made, _L_TOL):
                    return False
            elif not _close(self.got[i].out, o, _O_TOL):
                return False
        return True

    def search(
        self,
        candidates: Iterable[tuple[str, FlashSlip, bool]],
        where: list[int],
        blocks: tuple[int, int] | None,
    ) -> tuple[str, FlashSlip, tuple[int, int]] | None:
        """The first candidate that gives the student's outputs on ``where`` (with the
        block sizes found before, when a slip already fixed them)."""
        for code, slip, tiles in candidates:
            sizes: Iterable[tuple[int, int]]
            if not tiles:
                sizes = [blocks or (_ONE, _ONE)]
            elif blocks is not None and blocks != (_ONE, _ONE):
                sizes = [blocks]
            else:
                sizes = itertools.product(_BLOCKS, _BLOCKS)
            for size in sizes:
                if self.gives(slip, size, where):
                    return code, slip, size
        return None


def _first_wrong(got: Array, want: Array, tol: tuple[float, float]) -> tuple[int, ...]:
    """The index (leading axes and query) of the first row of ``got`` off from ``want``."""
    rows = got.reshape(-1, got.shape[-1]) if got.ndim == want.ndim else got
    target = want.reshape(-1, want.shape[-1])
    for r in range(target.shape[0]):
        if not _close(rows[r : r + 1], target[r : r + 1], tol):
            return tuple(int(x) for x in np.unravel_index(r, want.shape[:-1]))
    return tuple(0 for _ in want.shape[:-1])


def _finding(
    code: str, probe: FlashProbe, step: str, got: Array | None, want: Array, extra: str = ""
) -> Finding:
    """A mismatch at ``step`` (``output``, ``lse``, ``dQ``, ``dK`` or ``dV``)."""
    sentence = FLASH_DIAGNOSES[code]
    claimed: tuple[float, ...] = ()
    expected: tuple[float, ...] = ()
    where = f"On the probe {probe.label!r}"
    row = 0
    if got is None and extra:
        where, extra = f"{where} it {extra}", ""
    elif got is not None and got.shape != want.shape:
        where += f" it returned shape {tuple(got.shape)}; expected {tuple(want.shape)}"
    elif got is not None and step == "lse":
        index = _first_wrong(got[..., None], want[..., None], _L_TOL)
        lead, row = index[:-1], index[-1]
        claimed = tuple(float(x) for x in got[lead][row : row + 8])
        expected = tuple(float(x) for x in want[lead][row : row + 8])
        where += f", L of queries {row} … {row + len(claimed) - 1} is off"
    elif got is not None:
        index = _first_wrong(got, want, _O_TOL)
        row = index[-1]
        claimed = tuple(float(x) for x in got[index][:8])
        expected = tuple(float(x) for x in want[index][:8])
        at = f"batch {index[0]}" + (f", head {index[1]}" if len(index) > 2 else "")
        noun = {"output": "the output"}.get(step, step)
        where += f", row {row} ({at}) of {noun} is off"
    message = f"{sentence[0].upper()}{sentence[1:]}. {where}."
    if extra:
        message += f" {extra}"
    return Finding(
        step=step,
        token=probe.label,
        position=row,
        claimed=claimed,
        printed=tuple("nan" if math.isnan(x) else number(x, 4) for x in claimed),
        expected=expected,
        status="mismatch",
        diagnosis=code,
        message=message,
        marks=tuple(
            "ok" if abs(c - e) <= _O_TOL[0] + _O_TOL[1] * abs(e) else "wrong"
            for c, e in zip(claimed, expected, strict=False)
        ),
    )


def _unmatched(
    judge: _Judge, where: list[int], slip: FlashSlip, blocks: tuple[int, int], step: str
) -> Finding | None:
    """``flash-unrecognised`` at the first probe of ``where`` whose numbers no slip gives."""
    lse = step == "lse"
    for i in where:
        o, lse_made = judge.made(i, slip, *blocks)
        got = judge.got[i].lse if lse else judge.got[i].out
        want = lse_made if lse else o
        if not _close(got, want, _L_TOL if lse else _O_TOL):
            if got is None:
                return None
            return _finding("flash-unrecognised", judge.probes[i], step, got, want)
    return None


def _nan_rows(
    judge: _Judge, where: list[int], slip: FlashSlip, blocks: tuple[int, int] | None
) -> tuple[str, FlashSlip, tuple[int, int]] | None:
    """``flash-empty-tile-nan`` for causal outputs that are right but for rows of NaN where
    the oracle has numbers, whatever the tiles or splits were (a split-KV or ring merge of a
    block with no allowed key, cut where the student cut it)."""
    size = blocks or (_ONE, _ONE)
    seen = False
    for i in where:
        got, want = judge.got[i].out, judge.made(i, slip, *size)[0]
        if got is None or got.shape != want.shape:
            return None
        rows = np.isnan(got).any(axis=-1) & np.isfinite(want).all(axis=-1)
        if not _close(got[~rows], want[~rows], _O_TOL):
            return None
        seen = seen or bool(rows.any())
    return ("flash-empty-tile-nan", slip, size) if seen else None


def _diagnose(judge: _Judge) -> list[Finding]:
    findings: list[Finding] = []
    probes = judge.probes
    for p, g in zip(probes, judge.got, strict=True):
        if g.error is not None:
            findings.append(_finding("flash-raised", p, "output", None, np.zeros(0), g.error))
    right = FlashSlip()
    blocks: tuple[int, int] | None = None
    plain = judge.ran(causal=False)
    current = right
    if not judge.gives(right, (_ONE, _ONE), plain):
        found = judge.search(_FORWARD, plain, None)
        if found is None:
            unknown = _unmatched(judge, plain, right, (_ONE, _ONE), "output")
            findings.extend([unknown] if unknown else [])
            return findings
        code, current, blocks = found
        findings.append(_first_off(judge, code, plain))
    causal = judge.ran(causal=True)
    if not judge.gives(current, blocks or (_ONE, _ONE), causal):
        options = [
            (code, dataclasses.replace(current, **change), tiles) for code, change, tiles in _CAUSAL
        ]
        found = judge.search(options, causal, blocks) or _nan_rows(judge, causal, current, blocks)
        if found is None:
            unknown = _unmatched(judge, causal, current, blocks or (_ONE, _ONE), "output")
            findings.extend([unknown] if unknown else [])
            return findings
        code, current, blocks = found
        findings.append(_first_off(judge, code, causal))
    size = blocks or (_ONE, _ONE)
    with_lse = [i for i in judge.ran() if judge.got[i].lse is not None]
    lse_right = judge.gives(right, (_ONE, _ONE), with_lse, lse=True)
    if not lse_right and not judge.gives(current, size, with_lse, lse=True):
        for code, base in _LSE:
            slip = dataclasses.replace(current, lse=base)
            if judge.gives(slip, size, with_lse, lse=True):
                i = next(
                    (i for i in with_lse if not judge.gives(right, (_ONE, _ONE), [i], lse=True)),
                    with_lse[0],
                )
                want = judge.made(i, right, _ONE, _ONE)[1]
                findings.append(_finding(code, probes[i], "lse", judge.got[i].lse, want))
                break
        else:
            unknown = _unmatched(judge, with_lse, current, size, "lse")
            findings.extend([unknown] if unknown else [])
    if not findings:
        findings.extend(_backward_findings(judge))
    return findings


def _first_off(judge: _Judge, code: str, ran: list[int]) -> Finding:
    """The finding ``code`` on the first of the probes ``ran`` whose output is off."""
    right = FlashSlip()
    i = next((i for i in ran if not judge.gives(right, (_ONE, _ONE), [i])), ran[0])
    want = judge.made(i, right, _ONE, _ONE)[0]
    return _finding(code, judge.probes[i], "output", judge.got[i].out, want)


def _backward_findings(judge: _Judge) -> list[Finding]:
    findings: list[Finding] = []
    for p, g in zip(judge.probes, judge.got, strict=True):
        if g.backward_error is not None:
            error = g.backward_error
            findings.append(_finding("flash-raised", p, "dQ", None, np.zeros(0), error))
    with_grads = [i for i, g in enumerate(judge.got) if g.grads is not None]

    def grads(i: int, slip: str) -> tuple[Array, Array, Array]:
        p = judge.probes[i]
        return backward(p.q, p.k, p.v, p.d_out, causal=p.causal, slip=slip)

    def agrees(slip: str) -> bool:
        for i in with_grads:
            got = judge.got[i].grads
            assert got is not None
            if not all(
                _close(a, b, _grad_tol(b)) for a, b in zip(got, grads(i, slip), strict=True)
            ):
                return False
        return True

    if agrees(""):
        return findings
    code = next((code for code, slip in _BACKWARD if agrees(slip)), "flash-unrecognised")
    for i in with_grads:
        got = judge.got[i].grads
        assert got is not None
        want = grads(i, "")
        for name, a, b in zip(("dQ", "dK", "dV"), got, want, strict=True):
            if not _close(a, b, _grad_tol(b)):
                findings.append(_finding(code, judge.probes[i], name, a, b))
                return findings
    return findings


def _judged(
    probes: Sequence[FlashProbe], got: Sequence[Got], name: str, hint: str
) -> tuple[Finding, ...]:
    if all(g.error is not None for g in got):
        raise FunctionError(
            f"{name} {got[0].error} on every probe, e.g. {probes[0].label}. Hint: it is called "
            f"as {hint} with float32 tensors of shape (batch, n, d) or (batch, heads, n, d)"
        )
    return tuple(_diagnose(_Judge(probes, got)))


_UNTAKEN = {
    "lse": "no log-sum-exp returned or saved (L, natural log, (batch[, heads], n_q)): L not "
    "checked",
    "backward": "no backward of its own: dQ, dK and dV not checked",
}


def _untaken(got: Sequence[Got]) -> tuple[str, ...]:
    """What no probe gave to check: the log-sum-exp, the gradients."""
    ran = [g for g in got if g.out is not None]
    return tuple(
        what
        for what, given in (
            ("lse", any(g.lse is not None for g in ran)),
            ("backward", any(g.grads is not None or g.backward_error for g in ran)),
        )
        if ran and not given
    )


def _about(untaken: Sequence[str]) -> str:
    return "; ".join(_UNTAKEN[what] for what in untaken)


def _contract_probes(contract: str) -> tuple[FlashProbe, ...]:
    if contract not in CONTRACTS:
        raise ValueError(
            f"contract must be one of {', '.join(CONTRACTS)}, got {contract!r}. "
            "Hint: contract='cs336' for CS336's part (a)"
        )
    return tuple(p for p in flash_probes() if p.in_contract(contract))


def check_flash_file(
    target: str, *, contract: str = "full", timeout: float = 60.0, isolation: str = "auto"
) -> FunctionReport:
    """Check the FlashAttention ``NAME`` of ``FILE.py`` (a function or an autograd Function,
    as :func:`check_flash` takes them), run sandboxed with a time limit of ``timeout``
    seconds for the student's code; the report of ``qkv check --function FILE.py:NAME
    --kind flash``.

    Raises:
        FunctionError: the file or NAME cannot be loaded, every probe raises, or the code
            did not finish in time (one line).
        ValueError: an unknown contract.
    """
    probes = _contract_probes(contract)
    path, name = split_target(target)
    shown = student_text(target)

    untaken: list[str] = []

    def probe_all(call: FlashCall) -> tuple[Finding, ...]:
        run = remote(call)
        got = [run(p) for p in probes]
        untaken.extend(_untaken(got))
        return _judged(probes, got, shown, f"{student_text(name)}(Q, K, V, is_causal)")

    done = run_file(
        target,
        "flash",
        mask_means="allow",
        array="torch",
        timeout=timeout,
        isolation=isolation,
        flash_probes=probe_all,
    )
    return FunctionReport(
        name=f"{student_text(name)} in {student_text(path.name)}",
        source=str(path),
        tokens=(),
        findings=done.flash,
        kind="flash",
        array="torch",
        file_error=done.file_error,
        isolation=done.isolation,
        about=_about(untaken),
        untaken=tuple(untaken),
    )


def _name(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn))


def check_flash(
    fn: Callable[..., Any] | type, *, contract: str = "full", name: str | None = None
) -> FunctionReport:
    """Check a FlashAttention forward (and its backward, for an autograd Function) in this
    process: the report of ``qkv check --function FILE.py:NAME --kind flash``.

    Args:
        fn: a function ``fn(Q, K, V, is_causal)`` returning ``(O, L)`` or ``O``, or a
            ``torch.autograd.Function`` subclass (``fn.apply(Q, K, V, is_causal)`` returns
            O; L is among its saved tensors).
        contract: ``"full"`` (every probe) or ``"cs336"`` (CS336's part (a): ``is_causal``
            may be ignored, (batch, n, d) with power-of-2 lengths ≥ 16).
        name: the name the report gives it (default: its own).

    Raises:
        ValueError: an unknown contract.
        FunctionError: it raises on every probe (nothing to judge).
    """
    probes = _contract_probes(contract)
    from qkv._extras import require

    require("torch", feature="qkv check --kind flash")
    autograd = is_autograd(fn)
    grads = autograd and has_backward(fn)
    got = [call_probe(fn, p, autograd, grads) for p in probes]
    hint = "NAME.apply(Q, K, V, is_causal)" if autograd else "NAME(Q, K, V, is_causal)"
    return FunctionReport(
        name=name or _name(fn),
        source=None,
        tokens=(),
        findings=_judged(probes, got, _name(fn), hint),
        kind="flash",
        array="torch",
        about=_about(_untaken(got)),
        untaken=_untaken(got),
    )
