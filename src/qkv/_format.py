"""Formatting shared by everything that prints: numbers, escaping, line wrapping.

It sits below both :mod:`qkv.render` (which explains traces) and :mod:`qkv.check` (which
reports on worked examples), so that a number or an escaped token reads the same in both,
and neither has to import the other. It imports nothing from qkv.
"""

from __future__ import annotations

import math
import re

__all__ = [
    "json_safe",
    "latex_escape",
    "latex_number",
    "latex_visible",
    "markdown_escape",
    "number",
    "visible",
    "wrap_equation",
]

MINUS_INFINITY = "−∞"
"""How a masked score is written in text and Markdown (U+2212 MINUS SIGN, U+221E)."""


def number(value: float, precision: int) -> str:
    """A number with ``precision`` decimals; −∞ for masked scores; never ``-0.0000``.

    Example:
        >>> number(0.30457, 4), number(-1e-9, 4), number(float("-inf"), 4)
        ('0.3046', '0.0000', '−∞')
    """
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return MINUS_INFINITY if value < 0 else "∞"
    text = f"{value:.{precision}f}"
    if text.startswith("-") and float(text) == 0.0:
        text = text[1:]
    return text


def latex_number(value: float, precision: int) -> str:
    """A number for LaTeX math mode: ``-\\infty`` for masked scores.

    Example:
        >>> latex_number(float("-inf"), 4), latex_number(0.5, 2)
        ('-\\\\infty', '0.50')
    """
    if math.isinf(value):
        return r"-\infty" if value < 0 else r"\infty"
    if math.isnan(value):
        return r"\mathrm{NaN}"
    return number(value, precision)


_LATEX_SPECIALS = {
    "\\": r"\textbackslash{}",
    "{": r"\{",
    "}": r"\}",
    "_": r"\_",
    "&": r"\&",
    "%": r"\%",
    "#": r"\#",
    "$": r"\$",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    # Unicode that pdfLaTeX cannot typeset in text mode but the step texts use.
    "√": r"\ensuremath{\surd}",
    "·": r"\ensuremath{\cdot}",
    "×": r"\ensuremath{\times}",
    "−": r"\ensuremath{-}",
    "∞": r"\ensuremath{\infty}",
    "ᵀ": r"\ensuremath{^{\top}}",
    "…": r"\ldots{}",
    "→": r"\ensuremath{\rightarrow}",
    "≤": r"\ensuremath{\leq}",
    "≥": r"\ensuremath{\geq}",
}
_LATEX_PATTERN = re.compile("|".join(re.escape(c) for c in _LATEX_SPECIALS))


def latex_escape(text: str) -> str:
    """Escape text for LaTeX text mode (also inside ``\\text{...}`` in math), in one pass.

    Example:
        >>> print(latex_escape("a_b&c%"))
        a\\_b\\&c\\%
        >>> print(latex_escape("{x}~^\\\\"))
        \\{x\\}\\textasciitilde{}\\textasciicircum{}\\textbackslash{}
    """
    return _LATEX_PATTERN.sub(lambda m: _LATEX_SPECIALS[m.group(0)], text)


_MARKDOWN_PATTERN = re.compile(r"([\\`*\[\]<>|$~&]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")


def markdown_escape(text: str) -> str:
    """Escape text for a Markdown paragraph or table cell (GitHub flavour).

    ``|`` would end a table cell, ``$`` would start a formula, ``*``/``_`` emphasis, ``<`` HTML,
    ``&`` an entity (``&lt;`` would show as ``<``).
    An underscore inside a word (``d_model``) cannot start emphasis and is left alone.

    Example:
        >>> print(markdown_escape("a|b *c* d_model _x_"))
        a\\|b \\*c\\* d_model \\_x\\_
    """
    escaped = _MARKDOWN_PATTERN.sub(r"\\\1", text)
    if escaped.startswith("#"):
        escaped = "\\" + escaped
    return escaped


# Characters a terminal acts on instead of showing (C0 and C1 controls, DEL), the
# bidirectional controls that reorder what follows them (Trojan Source), and lone surrogates
# (no terminal can be sent one: writing it raises UnicodeEncodeError).
_INVISIBLE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)
_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escaped(match: re.Match[str]) -> str:
    char = match.group(0)
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: str, *, newlines: bool = False) -> str:
    """``text`` with every control character written out visibly (``\\x1b``, ``\\u202e``).

    The one escape of qkv for text from outside: tokens, keys, names, file names, students'
    exception text and output. Every error message of a file qkv reads passes through it
    (the error classes and the CLI's ``qkv: error:`` line), and so does every renderer.
    Such text comes from files anyone may write: an ESC sequence would recolour or rewrite
    the terminal (``\\x1b]0;TITLE\\x07`` sets its title), a bidirectional override would
    reorder the line around it, a carriage return would let the rest of a line overwrite
    its start. They are shown as Python writes them in a string; everything else (accents,
    CJK, emoji) is kept. Applying it twice changes nothing more. ``newlines=True`` keeps
    line breaks (for a description of several lines).

    Example:
        >>> print(visible("a\\x1b[31mb\\u202ec\\td"))
        a\\x1b[31mb\\u202ec\\td
        >>> visible("naïve café 東京")
        'naïve café 東京'
    """
    if newlines:
        return "\n".join(_INVISIBLE.sub(_escaped, line) for line in text.split("\n"))
    return _INVISIBLE.sub(_escaped, text)


def latex_visible(text: str) -> str:
    """LaTeX with any control character in it written out as escaped text
    (``\\textbackslash{}x1b``); user text reaches LaTeX only in text mode or ``\\text{...}``.

    Example:
        >>> print(latex_visible(r"\\text{a\x1bb}"))
        \\text{a\\textbackslash{}x1bb}
    """
    return _INVISIBLE.sub(lambda m: latex_escape(visible(m.group(0))), text)


def json_safe(text: str) -> str:
    """JSON text with the characters :func:`visible` escapes written as ``\\uXXXX``.

    ``json.dumps(..., ensure_ascii=False)`` leaves C1 controls and bidirectional overrides
    as they are; the escaped form reads back to the same strings and cannot act on a terminal.
    Line breaks and tabs are left alone: outside strings they are JSON's own whitespace.

    Example:
        >>> json_safe('["a\\u202eb"]')
        '["a\\\\u202eb"]'
    """
    # JSON's own line breaks and indentation stay; inside strings json.dumps escapes C0 already
    return _INVISIBLE.sub(
        lambda m: m.group(0) if m.group(0) in _NAMED else f"\\u{ord(m.group(0)):04x}", text
    )


_BREAKS = re.compile(r"(?= \+ | = )")


def wrap_equation(line: str, width: int, indent: int = 4) -> list[str]:
    """Wrap a long equation before ``" + "`` and ``" = "``, then after ``", "`` if needed.

    Continuation lines are indented by ``indent`` spaces; no line is longer than ``width``
    unless a single unbreakable word is.

    Example:
        >>> wrap_equation("c = 0.1·v_a + 0.2·v_b = [0.5]", 16)
        ['c = 0.1·v_a', '    + 0.2·v_b', '    = [0.5]']
    """
    if len(line) <= width:
        return [line]
    pieces: list[str] = []
    for piece in _BREAKS.split(line):
        if len(piece) + indent > width:
            pieces.extend(p for p in re.split(r"(?<=, )", piece) if p)
        else:
            pieces.append(piece)
    lines: list[str] = []
    current = ""
    for piece in pieces:
        if current and len(current) + len(piece) > width:
            lines.append(current.rstrip())
            current = " " * indent + piece.lstrip()
        else:
            current += piece
    lines.append(current.rstrip())
    return lines
