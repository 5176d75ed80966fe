"""``qkv check --function``: which slip an attention function makes, as a report.

:func:`check_function` probes a function object in this process; :func:`check_function_file`
runs a student's ``FILE.py:NAME`` sandboxed, with a time limit (loading a file runs its
code: :mod:`~qkv.check._function_file`), and :func:`check_module` and
:func:`check_module_file` do the same for an attention class. The calling lives in
:mod:`~qkv.check._function_run`, the diagnosis in
:mod:`~qkv.check._function_diagnose`; this module turns their findings into a
:class:`FunctionReport`, in the JSON schema of ``qkv check``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from qkv._format import markdown_escape, number, visible
from qkv.check._findings import ReportData
from qkv.check._function_codes import FUNCTION_DIAGNOSES
from qkv.check._function_diagnose import diagnose
from qkv.check._function_file import run_file
from qkv.check._function_run import (
    ARRAYS,
    FunctionError,
    run_module_probes,
    run_probes,
    student_text,
    takes_mask,
    validate,
)
from qkv.check._module_adapt import ModuleError, ModuleFunction, adapt_class
from qkv.check._probes import HEAD, KV_HEADS, Spec
from qkv.check._sandbox import ISOLATIONS

__all__ = [
    "ARRAYS",
    "FUNCTION_DIAGNOSES",
    "ISOLATIONS",
    "FunctionError",
    "FunctionReport",
    "check_function",
    "check_function_file",
    "check_module",
    "check_module_file",
]


@dataclass(frozen=True)
class FunctionReport(ReportData):
    """The check of an attention function: a finding per mistake (none when it is right).

    Attributes (besides :class:`~qkv.check._findings.ReportData`'s):
        kind: ``attention``, ``causal``, ``multi-head`` or ``gqa``.
        array: the array library it was probed with (``numpy`` or ``torch``).
        about: a class (``--module``): how it was driven (its forward and projections).
        file_error: a file's own errors (a top-level statement that failed), one line.
        isolation: for a ``FILE.py:NAME``, the isolation its code ran in (``bubblewrap``,
            or ``namespaces``: docs/isolation.md); None for a function
            checked in this process.
        untaken: kind ``flash``: what it gave nothing to check of, ``lse`` (no log-sum-exp
            returned or saved) and ``backward`` (no backward of its own).
        with_mask: whether the function took a mask (kind attention with a fourth argument),
            so that its probes included masked keys (not part of the JSON).

    Its JSON (:meth:`to_dict`, :meth:`to_json`) is that of ``qkv check``: a number that is not
    finite (NaN, inf, as a function may return) is ``null``.
    """

    kind: str = "attention"
    array: str = "numpy"
    about: str = ""
    file_error: str | None = None
    isolation: str | None = None
    with_mask: bool = False
    untaken: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """``{"ok": bool, "findings": [...]}``, with ``"isolation"`` for a file, and
        ``"file_error"`` (the file's own errors, one line) when the file had some."""
        data = super().to_dict()
        if self.isolation is not None:
            data["isolation"] = self.isolation
        if self.file_error:
            data["file_error"] = self.file_error
        return data

    def _command(self) -> str:
        return "qkv check --module" if self.kind.startswith("module") else "qkv check --function"

    def _header(self, report: FunctionReport) -> list[str]:
        lines = []
        if self.about:
            lines.append(f"Driven as: {visible(self.about)}.")
        if self.file_error:
            lines.append(f"! The file's own errors: {visible(self.file_error)} (the rest ran).")
        return lines

    def to_json(self, *, indent: int | None = 2) -> str:
        """The report as JSON (ending with a newline)."""
        from qkv._format import json_safe

        return json_safe(json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)) + "\n"

    def text(self, *, width: int = 80) -> str:
        """The report as plain text (messages wrapped to ``width``)."""
        import textwrap

        report = self.visible()

        def wrap(text: str, first: str = "", rest: str = "  ") -> list[str]:
            return textwrap.wrap(
                text, width, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False
            )

        title = f"{self._command()}: {report.name} (kind {self.kind}, {self.array} probes)"
        lines = wrap(title)
        if self.isolation is not None:
            lines.append(f"isolation: {self.isolation}")
        for line in self._header(report):
            lines += wrap(line)
        if report.ok and not report.findings:
            lines.append("✓ No mistake found: every probe gives attention's numbers.")
        for f in report.findings:
            mark = "✗" if f.wrong else "~"
            lines += wrap(f"{mark} {f.status}: {f.diagnosis} · probe {f.token!r}, row {f.position}")
            numbers = " " * 14
            if f.printed:
                lines += wrap(", ".join(f.printed), "    returned: ", numbers)
            if f.expected:
                lines += wrap(
                    ", ".join(number(x, 4) for x in f.expected), "    correct:  ", numbers
                )
            lines += wrap(f.message, "  ")
        return "\n".join(lines) + "\n"

    def markdown(self) -> str:
        """The report as GitHub-flavoured Markdown."""
        report = self.visible()
        out = [f"# {self._command()}: {markdown_escape(report.name)}", ""]
        ran = f", run in isolation `{self.isolation}`" if self.isolation is not None else ""
        out += [f"Kind `{self.kind}`, probed with {self.array} arrays{ran}.", ""]
        out += [line for h in self._header(report) for line in (markdown_escape(h), "")]
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
    ``mask_means``: what the mask means (``allow``: True = may attend, ``ignore``, or
    ``additive``), or ``auto``: the convention the function reads, found by probing
    (booleans either way, 0/1, or 0/−inf added; a function that attends exactly the masked
    keys is then taken to mean True = masked).
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
    num_kv_heads: int | None = None,
    isolation: str = "auto",
) -> FunctionReport:
    """Check the function ``FILE.py:NAME`` in a sandboxed process with a time limit.

    Loading the file runs its code, as ``python FILE.py`` would: it runs in a fresh
    temporary folder, with a scrubbed environment and resource limits, and nothing it starts
    outlives the check; ``isolation`` (``auto``: the strongest available, or
    ``bubblewrap``, ``namespaces``) says how far it is kept from the rest of
    the machine (docs/check-function.md). A top-level statement that fails (a notebook
    exported to a file) is noted in ``file_error`` and the rest runs. ``batched`` and
    ``num_kv_heads`` as in :func:`check_function`.

    Raises:
        FunctionError: the file or function cannot be loaded or called, the process crashed,
            hit a limit, or did not finish within ``timeout`` seconds.
        ValueError: an unknown kind, mask meaning, array library, alignment or isolation, a
            level of isolation not available here, a timeout that is not a positive finite
            number, or a ``num_kv_heads`` that does not fit.
    """
    validate(kind, mask_means, array, alignment)
    spec_of(kind, with_mask=False, alignment=alignment, num_kv_heads=num_kv_heads)
    run = run_file(
        target,
        kind,
        mask_means=mask_means,
        array=array,
        timeout=timeout,
        batched=batched,
        num_kv_heads=num_kv_heads,
        isolation=isolation,
    )
    spec = spec_of(kind, with_mask=run.with_mask, alignment=alignment, num_kv_heads=num_kv_heads)
    findings = diagnose(spec, run.outcomes, lifted=lifted(run.array), batched=batched)
    return FunctionReport(
        name=f"{run.name} in {run.path}",
        source=str(run.path),
        tokens=(),
        findings=tuple(findings),
        kind=kind,
        array=run.array,
        file_error=run.file_error,
        isolation=run.isolation,
        with_mask=run.with_mask,
    )


_CAUSAL = {None: "module", True: "module-causal", False: "module-not-causal"}


def _module_kind(kind: str, causal: bool) -> str:
    shown = "attention, one head" if kind == HEAD else kind
    return f"module: {shown}{', causal' if causal else ''}"


def check_module(
    cls: type, *, causal: bool | None = None, name: str | None = None, kind: str | None = None
) -> FunctionReport:
    """Check an attention class (an ``nn.Module``) in this process: which slip it makes.

    The class is built with d_model 16 and 4 or 2 heads, its projections (found by their
    use) are set from the multi-head probes, and ``forward`` runs in float64 in eval mode
    (:mod:`~qkv.check._module_adapt` says which constructors, projections and forward
    signatures it understands). A forward that takes a mask gets masked probes, in the
    convention it reads (found by probing); one that takes the queries apart from the keys
    and values gets cross-attention probes too. A single head without an output projection
    is checked as one head (``kind="attention"`` asks for that; None: as the class is).
    ``causal``: check it as causal attention; None: as the class says (its name, or a
    triangular mask buffer).

    Example:
        >>> import torch
        >>> class Head(torch.nn.Module):
        ...     def __init__(self, n_embd, head_size):
        ...         super().__init__()
        ...         self.key = torch.nn.Linear(n_embd, head_size, bias=False)
        ...         self.query = torch.nn.Linear(n_embd, head_size, bias=False)
        ...         self.value = torch.nn.Linear(n_embd, head_size, bias=False)
        ...     def forward(self, x):
        ...         k, q, v = self.key(x), self.query(x), self.value(x)
        ...         wei = q @ k.transpose(-2, -1) * x.shape[-1] ** -0.5  # C, not head_size
        ...         return torch.softmax(wei, dim=-1) @ v
        >>> [f.diagnosis for f in check_module(Head).findings]
        ['head-scaled-by-width']

    Raises:
        FunctionError: the class cannot be built, its projections found, or forward called,
            or it is not of ``kind``.
    """
    try:
        driven = adapt_class(cls, causal=causal)
    except ModuleError as exc:  # the class's own names and texts: escaped
        raise FunctionError(student_text(str(exc), 1000)) from None
    if kind is not None and (kind == "attention") != (driven.kind == HEAD):
        raise FunctionError(_kind_mismatch(kind, driven.kind))
    spec = module_spec(_fields(driven))
    try:
        how, outcomes = run_module_probes(driven.fn, spec)
    except FunctionError as exc:
        raise FunctionError(student_text(str(exc), 1000)) from None
    findings = diagnose(spec, outcomes)
    about = driven.about + (f"; {how}" if how else "")
    return FunctionReport(
        name=name or str(getattr(cls, "__qualname__", repr(cls))),
        source=None,
        tokens=(),
        findings=tuple(findings),
        kind=_module_kind(driven.kind, driven.causal),
        array="torch float64",
        about=student_text(about, 1000),
        with_mask=spec.masked,
    )


_MODULE_KINDS = ("multi-head", "gqa", HEAD)
_LARGEST = 1024  # the widest input and head a class is probed with


def module_spec(fields: Mapping[str, Any]) -> Spec:
    """What an attention class is checked as, from the scalar fields of
    :func:`~qkv.check._module_adapt.adapt_class`'s answer (``kind``, ``causal``,
    ``takes_mask``, ``cross``, ``width``, ``head_size``), which may come from the student's
    process: each is checked (type, range) before it is used.

    Raises:
        FunctionError: a field that is not what the adapter sends.
    """

    def flag(name: str) -> bool:
        value = fields.get(name, False)
        if not isinstance(value, bool):
            raise FunctionError(f"the class adapter's {name} is not true or false")
        return value

    def size(name: str, default: int) -> int:
        value = fields.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _LARGEST:
            raise FunctionError(f"the class adapter's {name} is not a size up to {_LARGEST}")
        return value or default

    kind = fields.get("kind")
    if kind not in _MODULE_KINDS:
        raise FunctionError("the class adapter's kind is not one it gives")
    return Spec(
        str(kind),
        with_mask=flag("takes_mask"),
        causal=flag("causal"),
        cross=flag("cross"),
        width=size("width", 16),
        head_size=size("head_size", 8),
    )


def _fields(driven: ModuleFunction) -> dict[str, Any]:
    return {f.name: getattr(driven, f.name) for f in dataclasses.fields(driven) if f.name != "fn"}


def _probe_class(proxy: Callable[..., Any], fields: dict[str, Any]) -> tuple[str, list[Any]]:
    """The probes of a class run in the student's process (``run_file``'s module_probes)."""
    return run_module_probes(proxy, module_spec(fields))


def _kind_mismatch(kind: str, driven: str) -> str:
    if driven == HEAD:
        return (
            "the class is a single head without an output projection, not multi-head "
            "attention. Hint: check it with kind attention (--kind attention)"
        )
    return (
        "kind attention is a single head without an output projection, and the class has "
        "one. Hint: leave the kind out, or give multi-head (--kind multi-head)"
    )


def check_module_file(
    target: str,
    *,
    causal: bool | None = None,
    timeout: float = 20.0,
    isolation: str = "auto",
    kind: str | None = None,
) -> FunctionReport:
    """Check the attention class ``FILE.py:ClassName`` in a sandboxed process with a time
    limit (as :func:`check_module`; loading the file runs its code, kept as in
    :func:`check_function_file`). ``kind="attention"``: it must be a single head without
    an output projection; ``"multi-head"``: it must have one.

    Raises:
        FunctionError: the file cannot be run, the class built or driven, the process
            crashed, hit a limit, or did not finish within ``timeout`` seconds; or the
            class is not of ``kind``.
        ValueError: an unknown or unavailable isolation, or a timeout that is not a
            positive finite number.
    """
    run = run_file(
        target,
        "multi-head",
        mask_means="allow",
        array="numpy",
        timeout=timeout,
        adapt=_CAUSAL[causal],
        isolation=isolation,
        module_probes=_probe_class,
    )
    if kind is not None and (kind == "attention") != (run.kind == HEAD):
        raise FunctionError(_kind_mismatch(kind, run.kind))
    spec = module_spec(run.adapter)
    findings = diagnose(spec, run.outcomes)
    how = f"; {run.array}" if run.array else ""
    return FunctionReport(
        name=f"{run.name} in {run.path}",
        source=str(run.path),
        tokens=(),
        findings=tuple(findings),
        kind=_module_kind(run.kind, run.causal),
        array="torch float64",
        about=run.about + student_text(how, 1000),
        file_error=run.file_error,
        isolation=run.isolation,
        with_mask=spec.masked,
    )
