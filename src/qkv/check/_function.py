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

import numpy as np

from qkv._format import markdown_escape, number
from qkv.check._findings import ReportData
from qkv.check._function_diagnose import FUNCTION_DIAGNOSES, diagnose
from qkv.check._function_file import run_file
from qkv.check._function_run import ARRAYS, FunctionError, run_probes, takes_mask, validate
from qkv.check._sandbox import ISOLATIONS

__all__ = [
    "ARRAYS",
    "FUNCTION_DIAGNOSES",
    "ISOLATIONS",
    "FunctionError",
    "FunctionReport",
    "check_function",
    "check_function_file",
]


@dataclass(frozen=True)
class FunctionReport(ReportData):
    """The check of an attention function: a finding per mistake (none when it is right).

    Attributes (besides :class:`~qkv.check._findings.ReportData`'s):
        kind: ``attention``, ``causal`` or ``multi-head``.
        array: the array library it was probed with (``numpy`` or ``torch``).
        isolation: for a ``FILE.py:NAME``, the isolation its code ran in (``bubblewrap``,
            ``namespaces`` or ``process``: docs/check-function.md); None for a function
            checked in this process.
        with_mask: whether the function took a mask (kind attention with a fourth argument),
            so that its probes included masked keys (not part of the JSON).
    """

    kind: str = "attention"
    array: str = "numpy"
    isolation: str | None = None
    with_mask: bool = False

    def to_dict(self) -> dict[str, Any]:
        """``{"ok": bool, "findings": [...]}``, the schema of ``qkv check``; a number that is
        not finite (inf, NaN) is ``null``."""
        data = super().to_dict()
        if self.isolation is not None:
            data["isolation"] = self.isolation
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
        if self.isolation is not None:
            lines.append(f"isolation: {self.isolation}")
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
        ran = f", run in isolation `{self.isolation}`" if self.isolation is not None else ""
        out += [f"Kind `{self.kind}`, probed with {self.array} arrays{ran}.", ""]
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


def check_function(
    fn: Callable[..., Any],
    kind: str = "attention",
    *,
    mask_means: str = "allow",
    array: str = "auto",
    alignment: str = "top-left",
    name: str | None = None,
    batched: bool = False,
) -> FunctionReport:
    """Check an attention function in this process (no time limit): which slip it makes.

    ``batched`` adds a probe with leading (B, H) axes: a function right on (L, d) inputs but
    not on (B, H, L, d) ones is then a mistake, ``unbatched`` (kinds attention and causal).

    Raises:
        FunctionError: it cannot be called on the first probe.
        ValueError: an unknown kind, mask meaning, array library or alignment.
    """
    validate(kind, mask_means, array, alignment)
    used, outcomes = run_probes(fn, kind, mask_means=mask_means, array=array, batched=batched)
    findings = diagnose(
        kind, outcomes, with_mask=takes_mask(fn, kind), alignment=alignment, batched=batched
    )
    title = name or getattr(fn, "__qualname__", None) or repr(fn)
    return FunctionReport(
        name=title,
        source=None,
        tokens=(),
        findings=tuple(findings),
        kind=kind,
        array=used,
        with_mask=takes_mask(fn, kind),
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
    isolation: str = "auto",
) -> FunctionReport:
    """Check the function ``FILE.py:NAME`` in a sandboxed process with a time limit.

    Loading the file runs its code: it runs in a fresh temporary folder, with a scrubbed
    environment and resource limits, and nothing it starts outlives the check;
    ``isolation`` (``auto``: the strongest available, or ``bubblewrap``, ``namespaces``,
    ``process``) says how far it is kept from the rest of the machine
    (docs/check-function.md). ``batched`` as in :func:`check_function`.

    Raises:
        FunctionError: the file or function cannot be loaded or called, the process crashed,
            hit a limit, or did not finish within ``timeout`` seconds.
        ValueError: an unknown kind, mask meaning, array library, alignment or isolation, a
            level of isolation not available here, or a timeout that is not a positive
            finite number.
    """
    validate(kind, mask_means, array, alignment)
    done = run_file(
        target,
        kind,
        mask_means=mask_means,
        array=array,
        timeout=timeout,
        batched=batched,
        isolation=isolation,
    )
    findings = diagnose(
        kind, done.outcomes, with_mask=done.with_mask, alignment=alignment, batched=batched
    )
    return FunctionReport(
        name=f"{done.name} in {done.path}",
        source=str(done.path),
        tokens=(),
        findings=tuple(findings),
        kind=kind,
        array=done.array,
        isolation=done.isolation,
        with_mask=done.with_mask,
    )
