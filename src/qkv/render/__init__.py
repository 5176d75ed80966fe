"""Show a trace step by step: text for the terminal, Markdown for a blog, LaTeX for a slide.

Every renderer walks one :class:`Narrative`, built by :func:`narrate`: for each step its title
in the seeds' words, its formula, what it means, a table with token labels and, where they
teach something, worked lines (dot products, a softmax, each context vector as the weighted
sum of the value vectors). The core needs NumPy and rich only.

Pictures: :func:`heatmap` draws one panel per head with matplotlib (``qkv[viz]``) to PNG or
SVG; :func:`html` writes one self-contained interactive page (head view, every step, context
vectors as weighted sums) that opens offline in any browser, and returns it as an
:class:`HtmlPage` (a ``str`` that Jupyter shows). Every renderer shows a trace call by call,
as the trace recorded its calls (``trace.calls``), each with its own facts.

Example:
    >>> import numpy as np, qkv
    >>> from qkv import render
    >>> X = np.array([[0.2, 0.5, 0.7], [0.4, 0.8, 0.6], [0.1, 0.6, 0.9]])
    >>> W_q = np.array([[0.1, 0.3], [0.2, 0.4], [0.5, 0.6]])
    >>> W_k = np.array([[0.6, 0.2], [0.3, 0.5], [0.7, 0.9]])
    >>> W_v = np.array([[0.5, 0.8], [0.2, 0.3], [0.4, 0.6]])
    >>> with qkv.tracing() as t:
    ...     _ = qkv.self_attention(X, W_q, W_k, W_v)
    >>> t.tokens = ["I", "love", "statistics"]
    >>> print([line for line in render.text(t).splitlines() if line.startswith("c_love")][0])
    c_love = 0.3046·v_I + 0.3387·v_love + 0.3567·v_statistics = [0.5385, 0.8193]
"""

from __future__ import annotations

from qkv.render._heatmap import MATRIX_STEPS, heatmap
from qkv.render._html import HtmlPage, html
from qkv.render._json import json
from qkv.render._latex import latex
from qkv.render._markdown import markdown
from qkv.render._model import Equation, Fact, Math, Narrative, Section, StepView, Table
from qkv.render._narrative import TITLES, narrate
from qkv.render._text import print_text, text
from qkv.trace import Trace

FORMATS = ("text", "markdown", "latex", "json")
"""The output formats, as ``qkv explain --format`` names them."""

__all__ = [
    "FORMATS",
    "MATRIX_STEPS",
    "TITLES",
    "Equation",
    "Fact",
    "HtmlPage",
    "Math",
    "Narrative",
    "Section",
    "StepView",
    "Table",
    "heatmap",
    "html",
    "json",
    "latex",
    "markdown",
    "narrate",
    "print_text",
    "render",
    "text",
]


def render(trace: Trace, format: str = "text", *, precision: int = 4, width: int = 80) -> str:
    """The trace in one of :data:`FORMATS`, as a string.

    Raises:
        ValueError: an unknown format, naming the ones there are.
    """
    if format == "text":
        return text(trace, precision=precision, width=width)
    if format == "markdown":
        return markdown(trace, precision=precision)
    if format == "latex":
        return latex(trace, precision=precision)
    if format == "json":
        return json(trace)
    raise ValueError(f"unknown format {format!r}; expected one of {', '.join(FORMATS)}.")
