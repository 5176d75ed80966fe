"""The LaTeX renderer: a fragment of ``align*`` and ``tabular`` blocks, ready for a slide."""

from __future__ import annotations

from qkv._format import latex_escape, latex_number
from qkv.render._model import Equation, Narrative, StepView, Table
from qkv.render._narrative import narrate
from qkv.trace import Trace

__all__ = ["latex"]

_MAX_COLUMNS = 8  # value columns per tabular; wider tables are split

_PREAMBLE = r"""\documentclass{article}
\usepackage[utf8]{inputenc}
\usepackage[T1]{fontenc}
\usepackage{amsmath}
\usepackage{amssymb}
\begin{document}
"""


def latex(trace: Trace, *, precision: int = 4, standalone: bool = False) -> str:
    """Every step of the trace as a LaTeX fragment (needs ``amsmath``).

    Args:
        trace: a recorded :class:`qkv.Trace`.
        precision: decimals of every number.
        standalone: wrap the fragment in a minimal ``article`` document that compiles as is.

    Tokens are escaped (``a_b&c%`` becomes ``a\\_b\\&c\\%``); masked scores are ``-\\infty``.

    Example:
        >>> import numpy as np, qkv
        >>> with qkv.tracing() as t:
        ...     _ = qkv.self_attention(np.eye(2), np.eye(2), np.eye(2), np.eye(2))
        >>> tex = latex(t, precision=2)
        >>> r"c_{\\text{t0}} &= 0.67\\,v_{\\text{t0}} + 0.33\\,v_{\\text{t1}}" in tex
        True
    """
    body = render_latex(narrate(trace, precision=precision))
    return _PREAMBLE + body + "\\end{document}\n" if standalone else body


def render_latex(n: Narrative) -> str:
    """Lay out a narrative as a LaTeX fragment."""
    out = [
        f"% {latex_escape(n.title)}: attention step by step, written by qkv.",
        r"% Needs \usepackage{amsmath} (align*) in the preamble.",
        rf"\section*{{{latex_escape(n.title)}}}",
    ]
    if n.description:
        out.append(latex_escape(n.description))
    if n.facts:
        out.append(r"\begin{itemize}")
        out += [rf"  \item {latex_escape(f.label)}: {f.latex}" for f in n.facts]
        out.append(r"\end{itemize}")
    grouped = any(section.title for section in n.sections)
    for section in n.sections:
        if section.title:
            out += ["", rf"\subsection*{{{latex_escape(section.title)}}}"]
        for step in section.steps:
            out += _step(step, r"\subsubsection*" if grouped else r"\subsection*", n.precision)
    return "\n".join(out) + "\n"


def _step(step: StepView, heading: str, precision: int) -> list[str]:
    out = ["", f"{heading}{{Step {step.number}. {latex_escape(step.title)}}}"]
    out += [r"\[", f"  {step.formula.latex}", r"\]"]
    if step.meaning:
        out.append(latex_escape(step.meaning))
    if step.table is not None:
        out += _tables(step.table, precision)
    if step.equations:
        out.append(r"\begin{align*}")
        lines = [_equation(eq) for eq in step.equations]
        out += [line + r" \\" for line in lines[:-1]] + lines[-1:]
        out.append(r"\end{align*}")
    for note in step.notes:
        out += [rf"\emph{{{latex_escape(note)}}}\par"]
    return out


def _equation(equation: Equation) -> str:
    """``lhs &= a + b = c``; a long sum goes on several lines (``&\\quad + ...``)."""
    lhs, *rest = equation.sides
    lines: list[str] = []
    count = 0  # terms on the current line
    for side in rest:
        terms = [term.latex for term in side]
        chunks = [terms[i : i + 4] for i in range(0, len(terms), 4)]
        first = " + ".join(chunks[0])
        if lines and count + len(chunks[0]) <= 5:
            lines[-1] += " = " + first
            count += len(chunks[0])
        else:
            lines.append("&= " + first)
            count = len(chunks[0])
        for chunk in chunks[1:]:
            lines.append(r"&\quad + " + " + ".join(chunk))
            count = len(chunk)
    left = " + ".join(term.latex for term in lhs)
    return f"  {left} " + " \\\\\n  ".join(lines)


def _tables(table: Table, precision: int) -> list[str]:
    n = len(table.columns)
    chunks = [list(range(i, min(i + _MAX_COLUMNS, n))) for i in range(0, n, _MAX_COLUMNS)]
    out = []
    for k, chunk in enumerate(chunks):
        sums = table.sums is not None and k == len(chunks) - 1
        spec = "l|" + "r" * len(chunk) + ("|r" if sums else "")
        header = [latex_escape(table.corner)] + [latex_escape(table.columns[j]) for j in chunk]
        header += ["sum"] if sums else []
        out += ["", r"\begin{center}", rf"\begin{{tabular}}{{{spec}}}"]
        out += [" & ".join(header) + r" \\", r"\hline"]
        for i, row in enumerate(table.rows):
            cells = [latex_escape(row)]
            cells += [_cell(float(table.values[i, j]), precision) for j in chunk]
            if sums and table.sums is not None:
                cells.append(_cell(float(table.sums[i]), precision))
            out.append(" & ".join(cells) + r" \\")
        out += [r"\end{tabular}", r"\end{center}"]
    return out


def _cell(value: float, precision: int) -> str:
    text = latex_number(value, precision)
    return f"${text}$" if text.startswith("-") or "\\" in text else text
