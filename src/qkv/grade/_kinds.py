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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qkv import examples
from qkv._read import read_bytes
from qkv.check import FunctionError, check, check_function_file, check_module_file
from qkv.examples import Example, ExampleError
from qkv.grade._credit import (
    Grade,
    credit_example,
    credit_function,
    example_parts,
    failed,
    function_parts,
)
from qkv.grade._rubric import Rubric
from qkv.grade._submissions import Submission

__all__ = ["KINDS", "Kind", "Settings", "grade_one"]


@dataclass(frozen=True)
class Settings:
    """How every submission of one run is graded: built once, from the options.

    Attributes:
        kind: the name of a :data:`KINDS` entry.
        function: the name of the function a code submission defines.
        class_name: the name of the class a ``module`` submission defines.
        rubric: points per part and per slip.
        hidden: hide every probe but the first from the students' feedback.
        inputs: the worked example every submission had to use (claims only), or None.
        inputs_text: the text of that example's file (a claims-only submission is read with
            it appended).
        mask_means, array, alignment, batched, timeout, isolation: as ``qkv check
            --function``.
    """

    kind: str = "attention"
    function: str = "attention"
    class_name: str = "MultiHeadAttention"
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
            student, report, settings.rubric, batched=settings.batched, hidden=settings.hidden
        )

    def parts(settings: Settings) -> tuple[str, ...]:
        with_mask = name == "attention" and settings.mask_means != "allow"
        return function_parts(name, with_mask=with_mask, batched=settings.batched)

    return Kind(name, summary, True, grade, parts)


def _grade_module(path: Path, student: str, settings: Settings) -> Grade:
    """An attention class, driven as a multi-head function (``qkv check --module``)."""
    report = check_module_file(
        f"{path}:{settings.class_name}", timeout=settings.timeout, isolation=settings.isolation
    )
    # credited as the multi-head function it was driven as (with the mask part when it was
    # driven as causal); the class's name for the student
    report = dataclasses.replace(
        report,
        name=f"{settings.class_name} in {path.name}",
        kind="multi-head",
        with_mask="causal" in report.kind,
    )
    return credit_function(student, report, settings.rubric, batched=False, hidden=settings.hidden)


def _no_code(path: Path, student: str, settings: Settings) -> Grade:
    raise FunctionError(
        f"{path.name}: code, but --kind example grades worked examples. Hint: hand in a "
        ".yaml worked example, or grade code with --kind attention"
    )


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
        lambda settings: function_parts("multi-head", with_mask=False, batched=False),
    ),
    "example": Kind(
        "example",
        "a worked example with its claimed numbers (.yaml or .json)",
        False,
        _no_code,
        lambda settings: ("scores", "scaling", "softmax", "weighted-sum"),
    ),
}
"""The kinds ``--kind`` accepts, by name."""


def _timed_out(error: FunctionError) -> bool:
    """Whether ``qkv check --function`` stopped the code for time (its two messages)."""
    text = str(error)
    return "did not finish within" in text or "s of CPU time" in text


def grade_one(submission: Submission, settings: Settings) -> Grade:
    """The grade of one submission; never raises for a broken one."""
    kind = KINDS[settings.kind]
    parts = kind.parts(settings)
    student = submission.student
    if submission.form == "problem" or submission.path is None:
        return failed(
            student,
            "error",
            submission.problem,
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
            reason,
            parts,
            settings.rubric,
            kind=kind.name,
            title=f"{_defined(kind.name, settings)} in {submission.entry}",
        )


def _defined(kind: str, settings: Settings) -> str:
    """What a code submission of ``kind`` defines: its class or its function."""
    return settings.class_name if kind == "module" else settings.function


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
            ("scores", "scaling", "softmax", "weighted-sum"),
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
        claims = examples.loads(merged, source=path.name)
        return dataclasses.replace(claims, name=settings.inputs.name, source=str(path))
    if not same_inputs(example, settings.inputs):
        raise ExampleError(
            "its tokens, embeddings, weights or options are not those of --inputs",
            source=path.name,
            hint="compute the steps on the inputs the assignment gave",
        )
    return example


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
