"""The Markdown renderer: GitHub tables and ``$…$`` formulas, ready to paste into a blog post."""

from __future__ import annotations

import re

from qkv._format import markdown_escape, number
from qkv.render._model import Equation, Narrative, StepView, Table
from qkv.render._narrative import narrate
from qkv.trace import Trace

__all__ = ["markdown"]


def markdown(trace: Trace, *, precision: int = 4) -> str:
    """Every step of the trace as GitHub-flavoured Markdown.

    Formulas and worked lines are LaTeX between ``$…$`` / ``$$…$$`` (GitHub, MkDocs with
    arithmatex, Jupyter and most blog engines render them); tables are GitHub tables with
    right-aligned numbers; tokens are escaped (``|`` becomes ``\\|``, ``<`` becomes ``\\<``),
    also inside formulas (``<`` becomes ``\\lt``), so no token can become HTML or a link.

    Example:
        >>> import numpy as np, qkv
        >>> with qkv.tracing() as t:
        ...     _ = qkv.self_attention(np.eye(2), np.eye(2), np.eye(2), np.eye(2))
        >>> md = markdown(t, precision=2)
        >>> print(md.split("## Step 10. Attention weights")[1].splitlines()[8])
        | t0 | 0.67 | 0.33 | 1.00 |
    """
    return render_markdown(narrate(trace, precision=precision))


def render_markdown(n: Narrative) -> str:
    """Lay out a narrative as Markdown."""
    out = [f"# {markdown_escape(n.title)}", ""]
    if n.description:
        out += [markdown_escape(n.description), ""]
    for fact in n.facts:
        out.append(f"- **{markdown_escape(fact.label)}**: {markdown_escape(fact.plain)}")
    if n.facts:
        out.append("")
    grouped = any(section.title for section in n.sections)
    for section in n.sections:
        if section.title:
            out += [f"## {markdown_escape(section.title)}", ""]
        for step in section.steps:
            out += _step(step, "###" if grouped else "##", n.precision)
    return "\n".join(out).rstrip("\n") + "\n"


def _step(step: StepView, heading: str, precision: int) -> list[str]:
    out = [f"{heading} Step {step.number}. {markdown_escape(step.title)}", ""]
    out += [f"${math(step.formula.latex)}$", ""]
    if step.meaning:
        out += [markdown_escape(step.meaning), ""]
    if step.table is not None:
        out += [*_table(step.table, precision), ""]
    for equation in step.equations:
        out += [f"$${math(_latex_line(equation))}$$", ""]
    for note in step.notes:
        out += [f"*{markdown_escape(note)}*", ""]
    return out


_TEXT = re.compile(r"\\text\{((?:\\[A-Za-z]+\{\}|\\.|[^{}\\])*)\}")
_MATH_SYMBOLS = {"<": r"\lt", ">": r"\gt", "[": r"\lbrack", "]": r"\rbrack"}
_HTML_OUTSIDE = re.compile(r"[<>]")
_IN_TEXT = re.compile(r"[<>\[\]]")


def math(latex: str) -> str:
    r"""A LaTeX formula made safe for Markdown: a renderer without math support shows it as
    text, where ``<img ...>`` in a token would be HTML and ``[a](b)`` a link. Inside
    ``\text{...}`` (where every token goes) those characters become math symbols between
    text pieces; elsewhere ``<`` and ``>`` become ``\lt`` and ``\gt`` (MathJax and KaTeX).

    Example:
        >>> print(math(r"q_{\text{<b>}} = [0.5]"))
        q_{\text{}\lt\text{b}\gt\text{}} = [0.5]
    """
    pieces = _TEXT.split(latex)  # even: outside \\text{}, odd: the inside of one
    out = []
    for k, piece in enumerate(pieces):
        if k % 2:
            inside = _IN_TEXT.sub(lambda m: "}" + _MATH_SYMBOLS[m.group(0)] + r"\text{", piece)
            out.append(r"\text{" + inside + "}")
        else:
            out.append(_HTML_OUTSIDE.sub(lambda m: "{" + _MATH_SYMBOLS[m.group(0)] + "}", piece))
    return "".join(out)


def _latex_line(equation: Equation) -> str:
    return " = ".join(" + ".join(term.latex for term in side) for side in equation.sides)


def _table(table: Table, precision: int) -> list[str]:
    header = [table.corner, *table.columns] + (["sum"] if table.sums is not None else [])
    lines = [
        "| " + " | ".join(markdown_escape(h) for h in header) + " |",
        "|:--" + "|--:" * (len(header) - 1) + "|",
    ]
    for i, row in enumerate(table.rows):
        cells = [markdown_escape(row)]
        cells += [number(float(v), precision) for v in table.values[i]]
        if table.sums is not None:
            cells.append(number(float(table.sums[i]), precision))
        lines.append("| " + " | ".join(cells) + " |")
    return lines
