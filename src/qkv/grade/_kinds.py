"""What a submission holds (``--kind``), and how each kind is checked and credited.

A kind is one entry of :data:`KINDS`: its name, a sentence for ``--help``, and the function
that grades one submission of it. The function kinds (``attention``, ``causal``,
``multi-head``, ``gqa``) and ``module`` (an attention class, as ``qkv check --module``) run
the student's file in ``qkv check --function``'s sandbox; ``example`` checks a worked example
in this process (the loader reads it as hostile input). A new kind of ``qkv check`` is one
more entry.

A submission that cannot be checked is a grade too: ``error`` with its one line (a syntax
error, a missing function, a crash, a file too large), or ``timeout``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qkv import examples
from qkv._read import read_bytes
from qkv.check import Finding, FunctionError, check, check_function_file, check_module_file
from qkv.examples import Example, ExampleError
from qkv.grade._credit import (
    Grade,
    PartResult,
    _part,
    credit_example,
    credit_function,
    example_parts,
    failed,
    function_parts,
)
from qkv.grade._parts import FLASH_PARTS, flash_part
from qkv.grade._rubric import Rubric
from qkv.grade._submissions import Submission

__all__ = ["KINDS", "Kind", "Settings", "defined", "for_student", "grade_one"]


@dataclass(frozen=True)
class Settings:
    """How every submission of one run is graded: built once, from the options.

    Attributes:
        kind: the name of a :data:`KINDS` entry.
        function: the name of the function a code submission defines.
        class_name: the name of the class a ``module`` submission defines (with kind
            ``attention`` and ``class_given``: a single head without an output projection).
        class_given: kind ``attention`` grades the class ``class_name`` (``--class``), not
            the function.
        rubric: points per part and per slip.
        hidden: hide every probe but the first from the students' feedback.
        inputs: the worked example every submission had to use (claims only), or None.
        inputs_text: the text of that example's file (a claims-only submission is read with
            it appended).
        mask_means, array, alignment, batched, timeout, isolation: as ``qkv check
            --function``.
        feedback: the teacher's own words per slip code (``--feedback``).
        contract: kind ``flash``: the assignment's contract (``full`` or ``cs336``).
    """

    kind: str = "attention"
    function: str = "attention"
    class_name: str = "MultiHeadAttention"
    class_given: bool = False
    rubric: Rubric = dataclasses.field(default_factory=Rubric)
    hidden: bool = False
    inputs: Example | None = None
    inputs_text: str = ""
    mask_means: str = "allow"
    array: str = "auto"
    alignment: str = "top-left"
    batched: bool = False
    timeout: float = 20.0
    isolation: str = "auto"
    feedback: dict[str, str] = dataclasses.field(default_factory=dict)
    contract: str = "full"


@dataclass(frozen=True)
class Kind:
    """One kind of submission.

    Attributes:
        name: the value of ``--kind``.
        summary: what a submission of this kind holds, for ``--help``.
        code: whether its submissions are code (run sandboxed) rather than worked examples.
        grade: grades one code submission (the file, the student, the settings).
        parts: the parts a submission that cannot be checked is graded on.
    """

    name: str
    summary: str
    code: bool
    grade: Callable[[Path, str, Settings], Grade]
    parts: Callable[[Settings], tuple[str, ...]]


def _function_kind(name: str, summary: str) -> Kind:
    def grade(path: Path, student: str, settings: Settings) -> Grade:
        if name == "attention" and settings.class_given:
            return _grade_class(path, student, settings, single=True)
        report = check_function_file(
            f"{path}:{settings.function}",
            name,
            mask_means=settings.mask_means,
            array=settings.array,
            alignment=settings.alignment,
            timeout=settings.timeout,
            batched=settings.batched,
            isolation=settings.isolation,
        )
        report = dataclasses.replace(report, name=f"{settings.function} in {path.name}")
        return credit_function(
            student,
            report,
            settings.rubric,
            batched=settings.batched,
            hidden=settings.hidden,
            assignment=parts(settings),
        )

    def parts(settings: Settings) -> tuple[str, ...]:
        # the assignment's parts: attention(Q, K, V, mask) has a mask part unless the rubric
        # gives it 0 points; multi-head and gqa functions take no mask unless the rubric
        # gives the mask points
        with_mask = name == "attention" or settings.rubric.names("mask")
        return function_parts(name, with_mask=with_mask, batched=settings.batched)

    return Kind(name, summary, True, grade, parts)


def _grade_module(path: Path, student: str, settings: Settings) -> Grade:
    """An attention class, driven as ``qkv check --module`` drives it."""
    return _grade_class(path, student, settings, single=False)


def _grade_class(path: Path, student: str, settings: Settings, *, single: bool) -> Grade:
    """An attention class (``qkv check --module``): with ``single``, a single head without
    an output projection (kind ``attention``); else any, credited on the assignment's
    parts (a single head handed in for multi-head attention lacks its projections and
    heads)."""
    report = check_module_file(
        f"{path}:{settings.class_name}",
        timeout=settings.timeout,
        isolation=settings.isolation,
        kind="attention" if single else None,
    )
    # credited as the function it was driven as: a single head, or multi-head attention
    # (with the mask part when its forward took a mask or was causal); the class's name
    # for the student
    one_head = single or "one head" in report.kind
    report = dataclasses.replace(
        report,
        name=f"{settings.class_name} in {path.name}",
        kind="attention" if one_head else "multi-head",
    )
    assignment = KINDS[settings.kind].parts(settings)
    return credit_function(
        student,
        report,
        settings.rubric,
        batched=False,
        hidden=settings.hidden,
        assignment=assignment,
    )


def _grade_flash(path: Path, student: str, settings: Settings) -> Grade:
    """A FlashAttention forward (and backward), as ``qkv check --kind flash`` checks it:
    each finding costs its part (forward output, log-sum-exp, causal, backward)."""
    from qkv.check import check_flash_file
    from qkv.check._flash import flash_probes

    report = check_flash_file(
        f"{path}:{settings.function}",
        contract=settings.contract,
        timeout=settings.timeout,
        isolation=settings.isolation,
    )
    report = dataclasses.replace(report, name=f"{settings.function} in {path.name}")
    causal = {p.label: p.causal for p in flash_probes()}
    parts = _flash_parts(settings)
    costs: dict[str, list[Finding]] = {p: [] for p in parts}
    for f in report.findings:
        if f.status in ("mismatch", "note"):
            part = flash_part(f.diagnosis, f.step, causal.get(f.token, False))
            costs.setdefault(part if part in costs else parts[0], []).append(f)
    untaken = {f"flash-{what}": what for what in report.untaken}
    results: tuple[PartResult, ...] = tuple(
        PartResult(p, 0.0, settings.rubric.points_of(p), shown=False, why=_FLASH_UNTAKEN[p])
        if p in untaken
        else _part(p, costs[p], settings.rubric)
        for p in parts
        if settings.rubric.points_of(p)
    )
    return Grade(
        student,
        "ok" if report.ok else "slip",
        results,
        kind="flash",
        title=report.name,
        findings=report.findings,
        isolation=report.isolation,
    )


_FLASH_UNTAKEN = {
    "flash-lse": "Not graded: the submission returned no log-sum-exp L (return (O, L), or "
    "save L, shape (batch, n_queries), natural log, with ctx.save_for_backward), so this "
    "part earns nothing.",
    "flash-backward": "Not graded: the submission has no backward of its own (a "
    "torch.autograd.Function with backward(ctx, dO)), so this part earns nothing.",
}


def _flash_parts(settings: Settings) -> tuple[str, ...]:
    """A FlashAttention assignment's parts: forward output, log-sum-exp, causal, backward
    (CS336's part (a) lets ``is_causal`` be ignored and the backward wait)."""
    if settings.contract == "cs336":
        return tuple(p for p in FLASH_PARTS if p not in ("flash-causal", "flash-backward"))
    return FLASH_PARTS


def _module_parts(settings: Settings) -> tuple[str, ...]:
    """A class's parts: those of multi-head attention with the mask (its forward takes a
    mask, as CS231n's does, or it is causal); a rubric that gives the mask 0 points leaves
    it out."""
    return function_parts("multi-head", with_mask=True, batched=False)


def _no_code(path: Path, student: str, settings: Settings) -> Grade:
    raise FunctionError(
        f"{path.name}: code, but this assignment grades worked examples. Hint: hand in a "
        ".yaml worked example (the practice page's Hand in)"
    )


def _example_parts(settings: Settings) -> tuple[str, ...]:
    """The parts of a worked example that cannot be read: those of the inputs everyone
    used (``--inputs``), else the steps every worked example has."""
    if settings.inputs is not None:
        return example_parts(settings.inputs)
    return ("scores", "scaling", "softmax", "weighted-sum")


KINDS: dict[str, Kind] = {
    "attention": _function_kind("attention", "FUNCTION(Q, K, V) or FUNCTION(Q, K, V, mask)"),
    "causal": _function_kind("causal", "FUNCTION(Q, K, V), causal attention"),
    "multi-head": _function_kind(
        "multi-head", "FUNCTION(X, W_q, W_k, W_v, W_o, num_heads), row vectors"
    ),
    "gqa": _function_kind(
        "gqa", "FUNCTION(X, W_q, W_k, W_v, W_o, num_heads, num_kv_heads), grouped-query"
    ),
    "module": Kind(
        "module",
        "an attention class (nn.Module), as 'qkv check --module' drives it",
        True,
        _grade_module,
        _module_parts,
    ),
    "flash": Kind(
        "flash",
        "a FlashAttention FUNCTION(Q, K, V, is_causal) returning (O, L) or O, or a "
        "torch.autograd.Function (FUNCTION.apply(...), L saved; its backward checked)",
        True,
        _grade_flash,
        _flash_parts,
    ),
    "example": Kind(
        "example",
        "a worked example with its claimed numbers (.yaml or .json)",
        False,
        _no_code,
        lambda settings: _example_parts(settings),
    ),
}
"""The kinds ``--kind`` accepts, by name."""


def _timed_out(error: FunctionError) -> bool:
    """Whether ``qkv check --function`` stopped the code for time (its messages)."""
    text = str(error)
    return any(
        said in text
        for said in ("did not finish within", "s of CPU time", "ran past", "an infinite loop")
    )


def grade_one(submission: Submission, settings: Settings) -> Grade:
    """The grade of one submission; never raises for a broken one. It carries the
    student's id and the teacher's words for the slips it made."""
    grade = _grade_one(submission, settings)
    words = {c: settings.feedback[c] for c in grade.slips if c in settings.feedback}
    return dataclasses.replace(grade, teacher=words, student_id=submission.student_id)


def _grade_one(submission: Submission, settings: Settings) -> Grade:
    kind = KINDS[settings.kind]
    parts = kind.parts(settings)
    student = submission.student
    if submission.form == "problem" or submission.path is None:
        return failed(
            student,
            "error",
            for_student(submission.problem),
            parts,
            settings.rubric,
            kind=kind.name,
            title=submission.entry,
        )
    if submission.form == "example":
        return _grade_example(submission, submission.path, settings)
    try:
        return kind.grade(submission.path, student, settings)
    except FunctionError as error:
        status = "timeout" if _timed_out(error) else "error"
        reason = " ".join(str(error).replace(str(submission.path.parent) + "/", "").split())
        return failed(
            student,
            status,
            for_student(reason),
            parts,
            settings.rubric,
            kind=kind.name,
            title=f"{_defined(kind.name, settings)} in {submission.entry}",
        )


_FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")


def for_student(reason: str) -> str:
    """A reason as the student reads it: a hint that names an option of qkv's command line
    (meant for the teacher) is left out, and an option in the text itself is named as a
    setting of the assignment.

    Example:
        >>> for_student("ada: 2 .py files (a.py, b.py). Hint: give --file NAME.py")
        'ada: 2 .py files (a.py, b.py).'
        >>> for_student("x.py: code, but --kind example grades examples")
        'x.py: code, but the assignment grades examples'
    """
    text, sep, hint = reason.partition(" Hint: ")
    if sep and not _FLAG.search(hint):
        text = f"{text}{sep}{hint}"
    elif sep:
        text = text if text.endswith(".") else text + "."
    return _FLAG.sub("the assignment", re.sub(r"--kind \w+", "--kind", text)).replace(
        "the assignment the assignment", "the assignment"
    )


def _defined(kind: str, settings: Settings) -> str:
    """What a code submission of ``kind`` defines: its class or its function."""
    return defined(settings) or kind


def defined(settings: Settings) -> str | None:
    """The name each code submission defines (its class or its function), or None for
    worked examples."""
    if not KINDS[settings.kind].code:
        return None
    if settings.kind == "module" or (settings.kind == "attention" and settings.class_given):
        return settings.class_name
    return settings.function


def _grade_example(submission: Submission, path: Path, settings: Settings) -> Grade:
    student = submission.student
    rubric = settings.rubric
    try:
        example = _load_example(path, settings)
    except ExampleError as error:
        reason = " ".join(str(error).replace(str(path.parent) + "/", "").split())
        return failed(
            student,
            "error",
            reason,
            _example_parts(settings),
            rubric,
            kind="example",
            title=submission.entry,
        )
    if not example.claimed and not example.head_claimed:
        return failed(
            student,
            "error",
            f"{submission.entry}: claims no numbers. Hint: write "
            "the rows you computed under 'claimed:'",
            example_parts(example),
            rubric,
            kind="example",
            title=submission.entry,
        )
    return credit_example(student, check(example), example, rubric)


def _load_example(path: Path, settings: Settings) -> Example:
    """The worked example of ``path``: on its own, or its claims on ``--inputs``' inputs.

    Raises:
        ExampleError: the file breaks the format, or uses other inputs than ``--inputs``.
    """
    if settings.inputs is None:
        return examples.load(path)
    try:
        example = examples.load(path)
    except ExampleError as error:
        if (error.field, error.problem) != ("tokens", "missing"):
            raise
        # claims only: read them with the inputs' keys after them, so that the line numbers
        # of a mistake in the claims are the file's own
        text = read_bytes(path, limit=1 << 20, what="a worked example").decode("utf-8", "replace")
        merged = text.rstrip("\n") + "\n" + settings.inputs_text
        try:
            claims = examples.loads(merged, source=path.name)
        except ExampleError as merged_error:
            raise _own_lines(merged_error, text, path.name) from None
        return dataclasses.replace(claims, name=settings.inputs.name, source=str(path))
    if not same_inputs(example, settings.inputs):
        raise ExampleError(
            "its tokens, embeddings, weights or options are not those of --inputs",
            source=path.name,
            hint="compute the steps on the inputs the assignment gave",
        )
    return example


def _own_lines(error: ExampleError, text: str, source: str) -> ExampleError:
    """An error of a hand-in read with the inputs after it, on the hand-in's own lines: one
    found in the inputs' lines comes from a key the hand-in gives too (``options:``)."""
    lines = text.rstrip("\n").split("\n")
    if error.line is None or error.line <= len(lines):
        return error
    key = (error.field or "").split(".")[0].split("[")[0]
    own = next((i + 1 for i, line in enumerate(lines) if key and line.startswith(f"{key}:")), None)
    if own is None:
        return ExampleError(
            "it does not fit the inputs of the assignment",
            source=source,
            hint="a hand-in holds only 'claimed:', with the rows you computed",
        )
    return ExampleError(
        f"the inputs of the assignment give {key!r}; a hand-in claims numbers only",
        source=source,
        line=own,
        field=key,
        hint=f"remove '{key}:' from your file and keep 'claimed:'",
    )


def same_inputs(a: Example, b: Example) -> bool:
    """Whether two worked examples start from the same numbers and options."""
    arrays = ("embeddings", "W_q", "W_k", "W_v", "W_o", "mask")
    for name in arrays:
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None) or (x is not None and not np.array_equal(x, y)):
            return False
    if set(a.given) != set(b.given) or any(
        not np.array_equal(a.given[k], b.given[k]) for k in a.given
    ):
        return False
    fields = ("tokens", "heads", "scale", "causal", "query_tokens", "alignment", "key_length")
    return all(getattr(a, f) == getattr(b, f) for f in fields)
