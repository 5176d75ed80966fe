"""``qkv check --function``: which slip an attention function makes.

The function is called on the probes of :mod:`~qkv.check._probes`; what it returns is compared
with the correct attention and with each slip of :data:`~qkv.check._probes.SLIPS`, computed here
in NumPy float64. The first slip that reproduces every main probe names the mistake; the probe
with large scores catches a softmax without max-subtraction, the probe with a fully masked row
a NaN (a note).

Loading a student's file runs their code: :func:`check_function_file` does it in a separate
Python process with a time limit, so that an infinite loop or a crash is a one-line
:class:`FunctionError`, not a hang.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from qkv._format import markdown_escape, number
from qkv.check._findings import Finding, ReportData
from qkv.check._probes import KINDS, MASK_MEANINGS, SLIPS, Probe, probes

__all__ = [
    "ARRAYS",
    "FUNCTION_DIAGNOSES",
    "FunctionError",
    "FunctionReport",
    "check_function",
    "check_function_file",
]

Array = NDArray[np.float64]
ARRAYS: tuple[str, ...] = ("auto", "numpy", "torch")
"""The array library of the probes: ``auto`` tries NumPy, then torch tensors."""
ALIGNMENTS: tuple[str, ...] = ("top-left", "bottom-right")

FUNCTION_DIAGNOSES = {
    "unscaled": "the scores are not divided by √d_k before the softmax; attention is "
    "softmax(Q·Kᵀ/√d_k)·V",
    "scaled-by-dk": "the scores are divided by d_k instead of √d_k",
    "scaled-by-dmodel": "each head's scores are divided by √d_model instead of √d_head "
    "(d_head = d_model / num_heads)",
    "transposed-weights": "X·Wᵀ instead of X·W: with row vectors, Q = X·W_q (the same for K, "
    "V and the output W_o)",
    "softmax-wrong-axis": "softmax over the queries (axis -2) instead of over the keys: each "
    "row of weights, one per query, must sum to 1 (softmax over the last axis)",
    "query-key-swapped": "K·Qᵀ instead of Q·Kᵀ: row i of the scores must hold query i's "
    "scores against every key",
    "sum-normalised": "the scores are divided by their row sum instead of going through "
    "softmax (exponentiate, then divide by the sum of the exponentials)",
    "mask-ignored": "the mask (or the causal rule) is not applied: a masked key must get "
    "weight 0 (set its score to −inf before the softmax)",
    "mask-inverted": "the mask is applied the wrong way round: each query attends exactly the "
    "keys it must not",
    "causal-misaligned": "the causal rule is aligned at the wrong corner when Lq ≠ Lk",
    "heads-averaged": "the heads' attention is averaged instead of each head's context being "
    "computed on its own slice of V and the heads concatenated before W_o",
    "no-max-subtraction": "softmax overflows to inf or NaN at large scores: subtract each "
    "row's maximum score before exp (softmax does not change)",
    "masked-row-nan": "a fully masked row gives NaN; qkv's policy gives it zero weights and a "
    "zero context (a note, not an error)",
    "unrecognised": "the outputs are not attention's and match none of the known slips",
}
"""Each code ``--function`` can report, with its sentence: what is wrong and what it should be."""

_RTOL = 1e-4
_ATOL = 1e-6
_LARGE_RTOL = 1e-2  # scores near 3000 leave float32 only ~4 significant digits of softmax


class FunctionError(ValueError):
    """The function cannot be loaded or called: one line that says why (exit status 2)."""


@dataclass(frozen=True)
class Outcome:
    """What the function returned on one probe: its context and weights, or the error."""

    context: Array | None = None
    weights: Array | None = None
    error: str | None = None


@dataclass(frozen=True)
class FunctionReport(ReportData):
    """The check of an attention function: a finding per mistake (none when it is right).

    Attributes (besides :class:`~qkv.check._findings.ReportData`'s):
        kind: ``attention``, ``causal`` or ``multi-head``.
        array: the array library it was probed with (``numpy`` or ``torch``).
    """

    kind: str = "attention"
    array: str = "numpy"

    def to_dict(self) -> dict[str, Any]:
        """``{"ok": bool, "findings": [...]}``, the schema of ``qkv check``; a number that is
        not finite (inf, NaN) is ``null``."""
        data = super().to_dict()
        for f in data["findings"]:
            f["claimed"] = [x if np.isfinite(x) else None for x in f["claimed"]]
            f["expected"] = [x if np.isfinite(x) else None for x in f["expected"]]
        return data

    def to_json(self, *, indent: int | None = 2) -> str:
        """The report as JSON (ending with a newline)."""
        from qkv._format import json_safe

        return json_safe(json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)) + "\n"

    def text(self, *, width: int = 80) -> str:
        """The report as plain text (messages wrapped to ``width``)."""
        import textwrap

        report = self.visible()
        lines = [f"qkv check --function: {report.name} (kind {self.kind}, {self.array} probes)"]
        if report.ok and not report.findings:
            lines.append("✓ No mistake found: every probe gives attention's numbers.")
        for f in report.findings:
            mark = "✗" if f.wrong else "~"
            lines.append(f"{mark} {f.status}: {f.diagnosis} · probe {f.token!r}, row {f.position}")
            if f.printed:
                lines.append("    returned: " + ", ".join(f.printed))
                lines.append("    correct:  " + ", ".join(number(x, 4) for x in f.expected))
            lines += textwrap.wrap(f.message, width, initial_indent="  ", subsequent_indent="  ")
        return "\n".join(lines) + "\n"

    def markdown(self) -> str:
        """The report as GitHub-flavoured Markdown."""
        report = self.visible()
        out = [f"# qkv check --function: {markdown_escape(report.name)}", ""]
        out += [f"Kind `{self.kind}`, probed with {self.array} arrays.", ""]
        if not report.findings:
            out += ["✓ No mistake found: every probe gives attention's numbers.", ""]
        for f in report.findings:
            mark = "✗" if f.wrong else "~"
            out += [f"## {mark} {f.status}: `{f.diagnosis}`", ""]
            out += [f"Probe {markdown_escape(f.token)}, row {f.position}.", ""]
            if f.printed:
                out += [
                    "| | " + " | ".join(f"d{i + 1}" for i in range(len(f.printed))) + " |",
                    "|:--" + "|--:" * len(f.printed) + "|",
                    "| returned | " + " | ".join(f.printed) + " |",
                    "| correct | " + " | ".join(number(x, 4) for x in f.expected) + " |",
                    "",
                ]
            out += [markdown_escape(f.message), ""]
        return "\n".join(out).rstrip("\n") + "\n"

    def render(self, format: str = "text", *, width: int = 80) -> str:
        """The report as ``text``, ``markdown`` or ``json``.

        Raises:
            ValueError: an unknown format.
        """
        if format == "text":
            return self.text(width=width)
        if format == "markdown":
            return self.markdown()
        if format == "json":
            return self.to_json()
        raise ValueError(f"unknown format {format!r}; expected one of text, markdown, json")

    def print(self, console: Any = None) -> None:
        """Print the text report."""
        sys.stdout.write(self.text(width=getattr(console, "width", None) or 80))


# ---------------------------------------------------------------- calling the function


def _validate(kind: str, mask_means: str, array: str, alignment: str) -> None:
    for name, value, allowed in (
        ("kind", kind, KINDS),
        ("mask_means", mask_means, MASK_MEANINGS),
        ("array", array, ARRAYS),
        ("alignment", alignment, ALIGNMENTS),
    ):
        if value not in allowed:
            raise ValueError(
                f"{name} must be one of {', '.join(allowed)}, got {value!r}. "
                f"Hint: {name}={allowed[0]!r}"
            )


def _takes_mask(fn: Callable[..., Any], kind: str) -> bool:
    """Whether an ``attention`` function takes a fourth argument, the mask."""
    if kind != "attention":
        return False
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return True
    return len(positional) >= 4


def _arguments(probe: Probe, kind: str, with_mask: bool, mask_means: str) -> list[Any]:
    args: list[Any] = list(probe.arrays)
    if kind == "multi-head":
        args.append(probe.num_heads)
    elif with_mask and probe.allow is not None:
        if mask_means == "allow":
            args.append(probe.allow.copy())
        elif mask_means == "ignore":
            args.append(~probe.allow)
        else:
            args.append(np.where(probe.allow, 0.0, -np.inf))
    return args


def _to_torch(args: list[Any]) -> list[Any]:
    from qkv._extras import require

    torch = require("torch", feature="qkv check --function with torch tensors")

    return [torch.from_numpy(np.array(a)) if isinstance(a, np.ndarray) else a for a in args]


def _as_array(value: Any) -> Array:
    if hasattr(value, "detach"):
        value = value.detach().cpu().double().numpy()
    out: Array = np.asarray(value, dtype=np.float64)
    if out.ndim == 0:
        raise TypeError("a single number is not attention's output")
    return out


def _call(fn: Callable[..., Any], args: list[Any]) -> Outcome:
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            result = fn(*args)
    except Exception as exc:  # the student's code may raise anything: it is a finding
        text = " ".join(str(exc).split())[:200]
        return Outcome(error=f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
    try:
        if isinstance(result, (tuple, list)) and len(result) == 2:
            return Outcome(_as_array(result[0]), _as_array(result[1]))
        return Outcome(_as_array(result))
    except (TypeError, ValueError):
        return Outcome(error=f"returned {type(result).__name__}, not an array of numbers")


def run_probes(
    fn: Callable[..., Any], kind: str, *, mask_means: str = "allow", array: str = "auto"
) -> tuple[str, list[Outcome]]:
    """Call ``fn`` on every probe of ``kind``: the array library used and the outcomes.

    Raises:
        FunctionError: the function fails on the first probe, with NumPy arrays and with
            torch tensors.
    """
    with_mask = _takes_mask(fn, kind)
    all_probes = probes(kind, with_mask=with_mask)
    first = _arguments(all_probes[0], kind, with_mask, mask_means)
    used = "torch" if array == "torch" else "numpy"
    outcome = _call(fn, _to_torch(first) if used == "torch" else first)
    if outcome.error is not None and array == "auto":
        try:
            retry = _call(fn, _to_torch(first))
        except ImportError:  # qkv._extras.MissingExtraError: no torch to try
            retry = outcome
        if retry.error is None:
            used, outcome = "torch", retry
        else:
            outcome = dataclasses.replace(
                outcome, error=f"{outcome.error} (with torch tensors: {retry.error})"
            )
    if outcome.error is not None:
        raise FunctionError(
            f"on the first probe the function {_verb(outcome.error)}. Hint: kind "
            f"{kind} expects {_SIGNATURES[kind]}"
        )
    outcomes = [outcome]
    for probe in all_probes[1:]:
        args = _arguments(probe, kind, with_mask, mask_means)
        outcomes.append(_call(fn, _to_torch(args) if used == "torch" else args))
    return used, outcomes


def _verb(error: str) -> str:
    return error if error.startswith("returned ") else f"raised {error}"


_SIGNATURES = {
    "attention": "NAME(Q, K, V) or NAME(Q, K, V, mask) returning the context or (context, weights)",
    "causal": "NAME(Q, K, V), causal attention, returning the context or (context, weights)",
    "multi-head": "NAME(X, W_q, W_k, W_v, W_o, num_heads) returning the output or "
    "(output, weights)",
}


# ---------------------------------------------------------------- diagnosis


def _agrees(
    got: Outcome,
    expected: tuple[Array, Array] | None,
    *,
    weights: bool = False,
    rtol: float = _RTOL,
) -> bool:
    """Whether the function's outcome is the slip's: both raise, or the numbers agree where
    the slip's are finite."""
    if expected is None:
        return got.error is not None
    value = got.weights if weights else got.context
    if got.error is not None or value is None:
        return False
    want = expected[1] if weights else expected[0]
    if value.shape != want.shape:
        return False
    finite = np.isfinite(want)
    scale = float(np.abs(want[finite]).max()) if finite.any() else 1.0
    with np.errstate(invalid="ignore"):
        return bool(
            np.allclose(value[finite], want[finite], rtol=rtol, atol=rtol * 0.01 * max(scale, 1.0))
        )


def _slipped(slip: Callable[[Probe], tuple[Array, Array]], p: Probe) -> tuple[Array, Array] | None:
    try:
        return slip(p)
    except ValueError:
        return None


def _first_wrong_row(got: Array, want: Array) -> int:
    for i in range(min(len(got), len(want))):
        g, w = np.atleast_1d(got[i]), np.atleast_1d(want[i])
        finite = np.isfinite(w)
        if g.shape != w.shape or not np.allclose(g[finite], w[finite], rtol=_RTOL, atol=_ATOL):
            return i
    return 0


def _noun(probe: Probe, step: str) -> str:
    return "weights" if step == "weights" else "output" if probe.num_heads > 1 else "context"


def _finding(
    code: str,
    probe: Probe,
    got: Outcome,
    want: tuple[Array, Array] | None,
    *,
    status: str = "mismatch",
    step: str = "context",
    row: int | None = None,
    extra: str = "",
) -> Finding:
    claimed: tuple[float, ...] = ()
    expected: tuple[float, ...] = ()
    value = got.weights if step == "weights" else got.context
    if want is not None and value is not None:
        target = want[1] if step == "weights" else want[0]
        if value.ndim == target.ndim and value.ndim >= 1:
            r = _first_wrong_row(value, target) if row is None else row
            if value.ndim == 2 and value.shape == target.shape:
                claimed = tuple(float(x) for x in value[r])
                expected = tuple(float(x) for x in target[r])
            row = r
    what = f"On the probe {probe.name!r}"
    if want is None and value is not None:
        what += f", row {row} of the {_noun(probe, step)} is not a number (NaN or inf)"
    elif got.error is not None:
        what += f" it raised {got.error}"
    elif value is not None and want is not None:
        target = want[1] if step == "weights" else want[0]
        if value.shape != target.shape:
            what += f" it returned shape {value.shape}; expected {target.shape}"
        else:
            what += f", row {row} of the {_noun(probe, step)} is off"
    message = f"{FUNCTION_DIAGNOSES[code][0].upper()}{FUNCTION_DIAGNOSES[code][1:]}. {what}."
    if extra:
        message += f" {extra}"
    return Finding(
        step=step,
        token=probe.name,
        position=row or 0,
        claimed=claimed,
        printed=tuple("nan" if np.isnan(x) else number(x, 4) for x in claimed),
        expected=expected,
        status=status,
        diagnosis=code,
        message=message,
        marks=tuple(
            "ok" if np.isclose(c, e, rtol=_RTOL, atol=_ATOL) else "wrong"
            for c, e in zip(claimed, expected, strict=True)
        ),
    )


def _weights_findings(
    all_probes: Sequence[Probe],
    outcomes: Sequence[Outcome],
    main: Sequence[int],
    slips: Sequence[tuple[str | None, Callable[[Probe], tuple[Array, Array]]]],
    expected: dict[str | None, list[tuple[Array, Array] | None]],
) -> list[Finding]:
    """A finding when the context is right but the returned weights are not."""
    for j, i in enumerate(main):
        got, want = outcomes[i], expected[None][j]
        if got.weights is None or want is None or _agrees(got, want, weights=True):
            continue
        code = next(
            (c for c, _ in slips if c and _agrees(got, expected[c][j], weights=True)),
            "unrecognised",
        )
        return [_finding(code, all_probes[i], got, want, step="weights")]
    return []


def diagnose(
    kind: str, outcomes: Sequence[Outcome], *, with_mask: bool, alignment: str = "top-left"
) -> list[Finding]:
    """The findings about a function from its outcomes on the probes of ``kind``."""
    all_probes = probes(kind, with_mask=with_mask)
    slips = [(code, make(alignment)) for code, make in SLIPS[kind]]
    correct = slips[0][1]
    main = [i for i, p in enumerate(all_probes) if p.role == "main"]
    findings: list[Finding] = []
    expected = {code: [_slipped(s, all_probes[i]) for i in main] for code, s in slips}
    fits = [
        code
        for code, _ in slips
        if all(_agrees(outcomes[i], expected[code][j]) for j, i in enumerate(main))
    ]
    right = None in fits
    by_code = dict(slips)
    slip = correct
    if not right:
        code = next((c for c in fits if c is not None), "unrecognised")
        slip = by_code.get(code, correct)
        j, i = next(
            (j, i) for j, i in enumerate(main) if not _agrees(outcomes[i], expected[None][j])
        )
        findings.append(_finding(code, all_probes[i], outcomes[i], expected[None][j]))
    elif kind != "multi-head":
        findings += _weights_findings(all_probes, outcomes, main, slips, expected)
    for i, probe in enumerate(all_probes):
        got = outcomes[i]
        if probe.role == "large":
            want = _slipped(slip, probe)
            if want is not None and got.error is not None:
                findings.append(_finding("unrecognised", probe, got, want))
                continue
            if want is None or got.context is None:
                continue
            if got.context.shape != want[0].shape:
                continue
            bad = ~np.isfinite(got.context) & np.isfinite(want[0])
            if bad.any():
                row = int(np.argwhere(bad)[0][0])
                findings.append(_finding("no-max-subtraction", probe, got, want, row=row))
            elif right and not _agrees(got, want, rtol=_LARGE_RTOL):
                findings.append(_finding("unrecognised", probe, got, want))
        elif probe.role == "masked-row" and right:
            want = _slipped(correct, probe)
            if got.error is not None:
                findings.append(_finding("unrecognised", probe, got, want))
                continue
            if not _agrees(got, want):
                findings.append(_finding("unrecognised", probe, got, want))
                continue
            assert probe.allow is not None and got.context is not None
            empty = ~probe.allow.any(axis=-1)
            if got.context.ndim == 2 and not np.isfinite(got.context[empty]).all():
                row = int(np.flatnonzero(empty)[0])
                findings.append(
                    _finding(
                        "masked-row-nan",
                        probe,
                        got,
                        None,
                        status="note",
                        row=row,
                        extra="Fine if your course allows it; to follow qkv, give such a row "
                        "zero weights (e.g. torch.nan_to_num on the weights).",
                    )
                )
    return findings


def check_function(
    fn: Callable[..., Any],
    kind: str = "attention",
    *,
    mask_means: str = "allow",
    array: str = "auto",
    alignment: str = "top-left",
    name: str | None = None,
) -> FunctionReport:
    """Check an attention function in this process (no time limit): which slip it makes.

    Raises:
        FunctionError: it cannot be called on the first probe.
        ValueError: an unknown kind, mask meaning, array library or alignment.
    """
    _validate(kind, mask_means, array, alignment)
    used, outcomes = run_probes(fn, kind, mask_means=mask_means, array=array)
    findings = diagnose(kind, outcomes, with_mask=_takes_mask(fn, kind), alignment=alignment)
    title = name or getattr(fn, "__qualname__", None) or repr(fn)
    return FunctionReport(
        name=title, source=None, tokens=(), findings=tuple(findings), kind=kind, array=used
    )


# ---------------------------------------------------------------- a student's file


def split_target(target: str) -> tuple[Path, str]:
    """``FILE.py:NAME`` as (path, name).

    Raises:
        FunctionError: no ``:NAME``, or no such file.
    """
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise FunctionError(
            f"--function must be FILE.py:NAME, got {target!r}. Hint: "
            "'qkv check --function student.py:attention --kind attention'"
        )
    if not Path(path).is_file():
        raise FunctionError(f"--function: no such file {path!r}. Hint: check the path")
    return Path(path), name


def load_function(path: Path, name: str) -> Callable[..., Any]:
    """Import ``path`` (this runs its code) and return its function ``name``.

    Raises:
        FunctionError: the file cannot be imported or has no callable ``name``.
    """
    sys.path.insert(0, str(path.resolve().parent))
    spec = importlib.util.spec_from_file_location("_qkv_student_module", path)
    if spec is None or spec.loader is None:
        raise FunctionError(f"{path}: not a Python file. Hint: give a .py file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        text = " ".join(str(exc).split())[:200]
        raise FunctionError(
            f"{path}: importing it raised {type(exc).__name__}: {text}. Hint: run "
            f"'python {path}' to see the whole error"
        ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise FunctionError(
            f"{path}: no function named {name!r}. Hint: give FILE.py:NAME with the name of "
            "the function after the colon"
        )
    return fn  # type: ignore[no-any-return]


def _child_main() -> None:
    """The separate process: load the file, call the function on the probes, write JSON."""
    path, name, kind, mask_means, array, out = sys.argv[1:7]
    try:
        fn = load_function(Path(path), name)
        used, outcomes = run_probes(fn, kind, mask_means=mask_means, array=array)
        data: dict[str, Any] = {
            "array": used,
            "with_mask": _takes_mask(fn, kind),
            "outcomes": [
                {
                    "context": None if o.context is None else o.context.tolist(),
                    "weights": None if o.weights is None else o.weights.tolist(),
                    "error": o.error,
                }
                for o in outcomes
            ],
        }
    except FunctionError as exc:
        data = {"error": str(exc)}
    Path(out).write_text(json.dumps(data), encoding="utf-8")
    os._exit(0)  # the student's threads or atexit hooks must not keep the process alive


def check_function_file(
    target: str,
    kind: str = "attention",
    *,
    mask_means: str = "allow",
    array: str = "auto",
    alignment: str = "top-left",
    timeout: float = 20.0,
) -> FunctionReport:
    """Check the function ``FILE.py:NAME`` in a separate process with a time limit.

    Loading the file runs its code, as ``python FILE.py`` would.

    Raises:
        FunctionError: the file or function cannot be loaded or called, the process crashed,
            or it did not finish within ``timeout`` seconds.
        ValueError: an unknown kind, mask meaning, array library or alignment.
    """
    _validate(kind, mask_means, array, alignment)
    path, name = split_target(target)
    with tempfile.TemporaryDirectory(prefix="qkv-function-") as tmp:
        out = Path(tmp) / "outcomes.json"
        command = [
            sys.executable,
            "-c",
            "from qkv.check._function import _child_main; _child_main()",
            str(path), name, kind, mask_means, array, str(out),
        ]  # fmt: skip
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            raise FunctionError(
                f"{target}: the function did not finish within {timeout:g} s (an infinite "
                "loop?). Hint: run it by hand on small inputs, or give a longer time limit"
            ) from None
        if not out.is_file():
            last = (done.stderr.strip().splitlines() or ["no message"])[-1][:200]
            raise FunctionError(
                f"{target}: the process running it ended with status {done.returncode} "
                f"before returning ({last}). Hint: run 'python {path}' to see the crash"
            )
        data = json.loads(out.read_text(encoding="utf-8"))
    if "error" in data:
        raise FunctionError(str(data["error"]))
    outcomes = [
        Outcome(
            None if o["context"] is None else np.asarray(o["context"], dtype=np.float64),
            None if o["weights"] is None else np.asarray(o["weights"], dtype=np.float64),
            o["error"],
        )
        for o in data["outcomes"]
    ]
    findings = diagnose(kind, outcomes, with_mask=data["with_mask"], alignment=alignment)
    return FunctionReport(
        name=f"{name} in {path}",
        source=str(path),
        tokens=(),
        findings=tuple(findings),
        kind=kind,
        array=data["array"],
    )
