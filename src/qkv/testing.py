"""Grade attention code: which slip a student's ``attention()`` makes.

:func:`check_attention` calls a function on probes designed so that each common slip gives
different numbers, and names the slip (``unscaled``, ``softmax-wrong-axis``, ``mask-ignored``,
...; docs/check-function.md). :func:`assert_attention` is the same as a pytest-friendly
assertion for an autograder.

Give the function itself (it runs in this process, with no time limit), or ``"FILE.py:NAME"``:
then the file is loaded in a sandboxed Python process with a time limit (a fresh temporary
folder, a scrubbed environment, resource limits, nothing outliving the check; under
bubblewrap, where installed, a read-only system and no network: docs/check-function.md).
Loading a file runs its code, as ``python FILE.py`` would.

:func:`check_flash` checks a FlashAttention (a student's tiled forward and backward, a
kernel returning (O, L), a split-KV merge) against the float64 oracle and names the slip
(``flash-no-rescale``, ``flash-lse-wrong-base``, ...).

:func:`grade_attention` gives the same check as credit per step (the parts of ``qkv grade``:
scores, scaling, mask, softmax, weighted sum, heads), for a notebook cell or an autograder
that reports points (docs/grading.md).

Example:
    >>> import numpy as np
    >>> def attention(Q, K, V):
    ...     s = Q @ K.T                     # forgot to divide by sqrt(d_k)
    ...     w = np.exp(s - s.max(axis=-1, keepdims=True))
    ...     return (w / w.sum(axis=-1, keepdims=True)) @ V
    >>> report = check_attention(attention, kind="attention")
    >>> report.ok, [f.diagnosis for f in report.findings]
    (False, ['unscaled'])
    >>> grade = grade_attention(attention)       # takes no mask: the mask part earns 0
    >>> grade.score, grade.max_score, [(p.part, p.score) for p in grade.parts][:3]
    (3.0, 5.0, [('scores', 1.0), ('scaling', 0.0), ('mask', 0.0)])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qkv.check import FUNCTION_DIAGNOSES, FunctionError, FunctionReport
from qkv.check import check_function as _check_function
from qkv.check import check_function_file as _check_function_file
from qkv.check._flash import check_flash as _check_flash
from qkv.grade import KINDS, Grade, PartResult, Rubric, Settings, load_rubric
from qkv.grade._credit import credit_function

__all__ = [
    "FUNCTION_DIAGNOSES",
    "FunctionError",
    "FunctionReport",
    "Grade",
    "PartResult",
    "assert_attention",
    "check_attention",
    "check_flash",
    "grade_attention",
]


def check_attention(
    fn: Callable[..., Any] | str,
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
    """Check an attention function; the report ``qkv check --function`` prints.

    Args:
        fn: the function, or ``"FILE.py:NAME"`` (loaded in a sandboxed process).
        kind: ``"attention"`` (``fn(Q, K, V)`` or ``fn(Q, K, V, mask)``), ``"causal"``
            (``fn(Q, K, V)``, causal), ``"multi-head"``
            (``fn(X, W_q, W_k, W_v, W_o, num_heads)``, row vectors) or ``"gqa"``
            (``fn(X, W_q, W_k, W_v, W_o, num_heads, num_kv_heads)``, grouped-query).
        mask_means: ``"allow"`` (True = may attend), ``"ignore"`` (True = masked out) or
            ``"additive"`` (0 or −inf, added to the scores).
        array: ``"auto"`` (NumPy, else torch tensors), ``"numpy"`` or ``"torch"``.
        alignment: the causal rule meant when Lq ≠ Lk: ``"top-left"`` (query i sees keys
            0 … i, PyTorch's ``is_causal``) or ``"bottom-right"``.
        timeout: seconds allowed to a ``"FILE.py:NAME"``, a positive finite number
            (ignored for a function).
        batched: also require batched inputs (B, H, L, d) to work (kinds attention and
            causal); a function that fails them is ``unbatched``. Without it, the probes are
            (L, d), and a function that only takes (B, H, L, d) is probed with B = H = 1.
        num_kv_heads: kind multi-head only: grouped-query attention with the multi-head
            signature; W_k and W_v hold this many key/value heads (1, 2, 4 or 8).
        isolation: how a ``"FILE.py:NAME"`` is kept from the machine: ``"auto"`` (the
            strongest level available), ``"bubblewrap"`` or ``"namespaces"`` (ignored for
            a function; docs/isolation.md). The report's ``isolation`` says which ran.

    Raises:
        FunctionError: the function cannot be loaded or called, crashed, hit a limit or
            timed out.
        ValueError: an unknown kind, mask meaning, array library, alignment or isolation, an
            isolation not available here, or a timeout that is not a positive number.
    """
    if isinstance(fn, str):
        return _check_function_file(
            fn,
            kind,
            mask_means=mask_means,
            array=array,
            alignment=alignment,
            timeout=timeout,
            batched=batched,
            num_kv_heads=num_kv_heads,
            isolation=isolation,
        )
    return _check_function(
        fn,
        kind,
        mask_means=mask_means,
        array=array,
        alignment=alignment,
        batched=batched,
        num_kv_heads=num_kv_heads,
    )


def check_flash(
    fn: Callable[..., Any] | type,
    *,
    contract: str = "full",
) -> FunctionReport:
    """Check a FlashAttention forward (and backward) against the float64 oracle, naming the
    slip (``flash-no-rescale``, ``flash-lse-wrong-base``, ``flash-causal-offset``, ...:
    docs/check-function.md); the report of ``qkv check --function FILE.py:NAME --kind
    flash``, in this process.

    Args:
        fn: ``fn(Q, K, V, is_causal)`` returning ``(O, L)`` or ``O`` (a kernel, a split-KV
            merge, a ring attention step), or a ``torch.autograd.Function`` subclass in
            CS336's convention (``fn.apply(Q, K, V, is_causal)`` returns O and saves L of
            shape (batch, n_queries), natural log; its backward's dQ, dK, dV are checked).
        contract: ``"full"`` (every probe) or ``"cs336"`` (CS336's part (a):
            ``is_causal`` may be ignored, power-of-2 lengths ≥ 16).

    Raises:
        FunctionError: it raises on every probe.

    Example:
        >>> import torch
        >>> def kernel(Q, K, V, is_causal=False):      # the log-sum-exp in base 2
        ...     s = Q @ K.transpose(-1, -2) / Q.shape[-1] ** 0.5
        ...     if is_causal:
        ...         n = s.shape[-1]
        ...         s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf)
        ...     lse = torch.logsumexp(s, -1)
        ...     return torch.softmax(s, -1) @ V, lse / torch.log(torch.tensor(2.0))
        >>> [f.diagnosis for f in check_flash(kernel).findings]
        ['flash-lse-wrong-base']
    """
    return _check_flash(fn, contract=contract)


def assert_attention(
    fn: Callable[..., Any] | str,
    kind: str = "attention",
    *,
    mask_means: str = "allow",
    array: str = "auto",
    alignment: str = "top-left",
    timeout: float = 20.0,
    batched: bool = False,
    num_kv_heads: int | None = None,
    isolation: str = "auto",
) -> None:
    """Assert that ``fn`` computes attention; the failure message names each slip and says
    what the step should have been (the arguments of :func:`check_attention`).

    Raises:
        AssertionError: the function makes a mistake (rounding notes do not fail).
        FunctionError: the function cannot be loaded or called.
    """
    __tracebackhide__ = True  # pytest shows the student's test, not qkv's lines
    report = check_attention(
        fn,
        kind,
        mask_means=mask_means,
        array=array,
        alignment=alignment,
        timeout=timeout,
        batched=batched,
        num_kv_heads=num_kv_heads,
        isolation=isolation,
    )
    if not report.ok:
        wrong = [f for f in report.findings if f.wrong]
        lines = [f"{report.name} is not right (kind {kind}):"]
        for f in wrong:
            lines.append(f"- {f.diagnosis}: {f.message}")
            if f.printed:
                lines.append(f"  returned: {', '.join(f.printed)}")
                lines.append(f"  correct:  {', '.join(f'{x:.4f}' for x in f.expected)}")
        raise AssertionError("\n".join(lines))


def grade_attention(
    fn: Callable[..., Any] | str,
    kind: str = "attention",
    *,
    rubric: Rubric | str | None = None,
    hidden: bool = False,
    student: str = "student",
    mask_means: str = "allow",
    array: str = "auto",
    alignment: str = "top-left",
    timeout: float = 20.0,
    batched: bool = False,
    isolation: str = "auto",
) -> Grade:
    """Grade an attention function per step: the credit ``qkv grade`` gives it.

    The check is :func:`check_attention`'s (the same arguments); each part of the
    assignment (``grade.parts``: those ``qkv grade --kind KIND`` grades, with the rubric:
    scores, scaling, mask, softmax, weighted sum, heads) earns its points unless a slip
    found in it costs them; a part computed right on an earlier slip keeps its points
    (follow-through). A part the function cannot take (the mask, without a mask argument)
    earns nothing; give it 0 points in the rubric if the assignment has none.

    What it trusts: ``"FILE.py:NAME"`` runs in a sandboxed process that holds nothing of
    qkv, and nothing that code does can change the verdict (docs/isolation.md). A function
    object runs in *your* process: its code could change anything there, so grade only
    trusted code this way (an autograder's own notebook, your tests). Even then, the
    judging keeps its own references to the NumPy functions it compares with, bound when
    qkv is imported, so a function that replaces ``np.allclose`` or ``np.isclose`` while it
    runs does not change its grade.

    Args:
        rubric: a :class:`~qkv.grade.Rubric`, the path of a rubric file, or None (1 point
            per part, a slip costs its part's points).
        hidden: hide every probe but the first from the feedback (``qkv grade --hidden``).
        student: the name the grade carries.

    Returns:
        The :class:`~qkv.grade.Grade`: ``score``, ``max_score``, ``status`` (``ok`` or
        ``slip``), ``first_slip``, ``slips``, and ``parts``, each with its ``part``,
        ``score``, ``max_score``, ``codes`` and ``findings``.

    Raises:
        FunctionError: the function cannot be loaded or called (as :func:`check_attention`).
        ValueError: an unknown option, or a rubric file that cannot be used (``RubricError``).
    """
    report = check_attention(
        fn,
        kind,
        mask_means=mask_means,
        array=array,
        alignment=alignment,
        timeout=timeout,
        batched=batched,
        isolation=isolation,
    )
    if rubric is None:
        rubric = Rubric()
    elif isinstance(rubric, str):
        rubric = load_rubric(rubric)
    assignment = KINDS[kind].parts(Settings(kind=kind, rubric=rubric, batched=batched))
    return credit_function(
        student, report, rubric, batched=batched, hidden=hidden, assignment=assignment
    )
