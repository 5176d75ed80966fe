"""``qkv check --function``: which slip an attention function makes, as a report.

:func:`check_function` probes a function object in this process; :func:`check_function_file`
loads a student's ``FILE.py:NAME`` in a separate process with a time limit (loading a file
runs its code). The calling lives in :mod:`~qkv.check._function_run`, the diagnosis in
:mod:`~qkv.check._function_diagnose`; this module turns their findings into a
:class:`FunctionReport`, in the JSON schema of ``qkv check``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qkv._format import markdown_escape, number
from qkv.check._findings import ReportData
from qkv.check._function_diagnose import diagnose
from qkv.check._function_run import (
    ARRAYS,
    FunctionError,
    run_file,
    run_probes,
    takes_mask,
    validate,
)
from qkv.check._function_slips import FUNCTION_DIAGNOSES
from qkv.check._probes import KV_HEADS, Spec

__all__ = [
    "ARRAYS",
    "FUNCTION_DIAGNOSES",
    "FunctionError",
    "FunctionReport",
    "check_function",
    "check_function_file",
]


@dataclass(frozen=True)
class FunctionReport(ReportData):
    """The check of an attention function: a finding per mistake (none when it is right).

    Attributes (besides :class:`~qkv.check._findings.ReportData`'s):
        kind: ``attention``, ``causal``, ``multi-head`` or ``gqa``.
        array: the array library it was probed with (``numpy`` or ``torch``).

    Its JSON (:meth:`to_dict`, :meth:`to_json`) is that of ``qkv check``: a number that is not
    finite (NaN, inf, as a function may return) is ``null``.
    """

    kind: str = "attention"
    array: str = "numpy"

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
            if f.expected:
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
            if f.expected:
                rows = [("returned", f.printed)] if f.printed else []
                rows.append(("correct", tuple(number(x, 4) for x in f.expected)))
                out += [
                    "| | " + " | ".join(f"d{i + 1}" for i in range(len(f.expected))) + " |",
                    "|:--" + "|--:" * len(f.expected) + "|",
                    *(f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows),
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


def spec_of(
    kind: str, *, with_mask: bool, alignment: str, num_kv_heads: int | None, causal: bool = False
) -> Spec:
    """What a function is checked as (``causal``: a causal attention class).

    Raises:
        ValueError: ``num_kv_heads`` with a kind other than multi-head, or not one of 1, 2, 4, 8.
    """
    if num_kv_heads is not None:
        if kind != "multi-head":
            raise ValueError(
                f"num_kv_heads goes with kind multi-head, got kind {kind!r}. Hint: kind 'gqa' "
                "passes num_kv_heads to the function itself"
            )
        if num_kv_heads not in KV_HEADS:
            raise ValueError(
                f"num_kv_heads must be one of {', '.join(map(str, KV_HEADS))} (the probes have "
                f"d_model 16), got {num_kv_heads!r}. Hint: num_kv_heads=2"
            )
    return Spec(
        kind,
        with_mask=with_mask,
        causal=causal or kind == "causal",
        alignment=alignment,
        num_kv_heads=num_kv_heads,
    )


def lifted(used: str) -> bool:
    """Whether the probes were given as (1, 1, L, d) (``run_probes`` says so in ``used``)."""
    return used.endswith("(1, 1, L, d)")


def check_function(
    fn: Callable[..., Any],
    kind: str = "attention",
    *,
    mask_means: str = "allow",
    array: str = "auto",
    alignment: str = "top-left",
    name: str | None = None,
    batched: bool = False,
    num_kv_heads: int | None = None,
) -> FunctionReport:
    """Check an attention function in this process (no time limit): which slip it makes.

    ``batched`` adds a probe with leading (B, H) axes: a function right on (L, d) inputs but
    not on (B, H, L, d) ones is then a mistake, ``unbatched`` (kinds attention and causal).
    ``num_kv_heads`` (kind multi-head): grouped-query attention with the multi-head
    signature, W_k and W_v for that many key/value heads.

    Raises:
        FunctionError: it cannot be called on the first probe.
        ValueError: an unknown kind, mask meaning, array library or alignment, or a
            ``num_kv_heads`` that does not fit.
    """
    validate(kind, mask_means, array, alignment)
    spec = spec_of(
        kind, with_mask=takes_mask(fn, kind), alignment=alignment, num_kv_heads=num_kv_heads
    )
    used, outcomes = run_probes(
        fn, kind, mask_means=mask_means, array=array, batched=batched, num_kv_heads=num_kv_heads
    )
    findings = diagnose(spec, outcomes, lifted=lifted(used), batched=batched)
    title = name or getattr(fn, "__qualname__", None) or repr(fn)
    return FunctionReport(
        name=title, source=None, tokens=(), findings=tuple(findings), kind=kind, array=used
    )


def check_function_file(
    target: str,
    kind: str = "attention",
    *,
    mask_means: str = "allow",
    array: str = "auto",
    alignment: str = "top-left",
    timeout: float = 20.0,
    batched: bool = False,
    num_kv_heads: int | None = None,
) -> FunctionReport:
    """Check the function ``FILE.py:NAME`` in a separate process with a time limit.

    Loading the file runs its code, as ``python FILE.py`` would. ``batched`` and
    ``num_kv_heads`` as in :func:`check_function`.

    Raises:
        FunctionError: the file or function cannot be loaded or called, the process crashed,
            or it did not finish within ``timeout`` seconds.
        ValueError: an unknown kind, mask meaning, array library or alignment.
    """
    validate(kind, mask_means, array, alignment)
    spec_of(kind, with_mask=False, alignment=alignment, num_kv_heads=num_kv_heads)
    path, name, used, with_mask, outcomes = run_file(
        target,
        kind,
        mask_means=mask_means,
        array=array,
        timeout=timeout,
        batched=batched,
        num_kv_heads=num_kv_heads,
    )
    spec = spec_of(kind, with_mask=with_mask, alignment=alignment, num_kv_heads=num_kv_heads)
    findings = diagnose(spec, outcomes, lifted=lifted(used), batched=batched)
    return FunctionReport(
        name=f"{name} in {path}",
        source=str(path),
        tokens=(),
        findings=tuple(findings),
        kind=kind,
        array=used,
    )
