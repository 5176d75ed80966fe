"""Hostile tokens in every output form (issue 12, item 11).

A token, a name or a layer comes from a file anyone may write. In Markdown it must stay text
(no HTML, no link) in paragraphs, tables and formulas alike; on a terminal no control
character may act (ESC sequences, C1 controls, bidirectional overrides): they are shown as
``\\x1b``; LaTeX specials are escaped; JSON keeps the strings but writes control characters as
``\\uXXXX``.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

import qkv
from qkv import render
from qkv.check import check
from qkv.cli import main

SCRIPT = "<script>alert(1)</script>"
IMG = "<img src=x onerror=alert(2)>"
TITLE = "</title><b>x</b>"
LINK = "[click](javascript:alert(3))"
ESC = "red\x1b[31mRED\x1b]0;owned\x07"
BIDI = "abc\u202edcba"
C1 = "c1\x9b31m"
HOSTILE = [SCRIPT, IMG, TITLE, LINK, ESC, BIDI, C1]
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u200e\u200f]")


def hostile_trace(tokens: list[str] = HOSTILE) -> qkv.Trace:
    rng = np.random.default_rng(0)
    n = len(tokens)
    x = rng.uniform(0.1, 0.9, size=(n, 3))
    w = [rng.uniform(0.1, 0.9, size=(3, 2)) for _ in range(3)]
    with qkv.tracing() as t:
        qkv.self_attention(x, *w)
    t.tokens = list(tokens)
    t.meta["name"] = TITLE
    t.meta["description"] = f"About {SCRIPT} and {ESC}"
    return t


def html_elements(markdown: str) -> list[str]:
    """Raw HTML a CommonMark renderer would pass through: ``<`` not escaped by a backslash,
    followed by a tag name or ``/``."""
    return re.findall(r"(?<!\\)<[/A-Za-z!]", markdown)


def test_markdown_has_no_raw_html_in_text_tables_or_formulas() -> None:
    md = render.markdown(hostile_trace())
    assert html_elements(md) == []
    # the formulas (worked lines, $$...$$) hold the tokens too: no raw < or [ inside \text{}
    formulas = re.findall(r"\$\$(.*?)\$\$", md, re.S)
    assert formulas, "the worked lines are in the Markdown"
    for formula in formulas:
        assert "<" not in formula and ">" not in formula
        assert "](" not in formula  # no link
    assert r"\lt" in md  # the < of a token, as a math symbol


def test_markdown_links_and_pipes_in_tokens_stay_text() -> None:
    md = render.markdown(hostile_trace())
    assert "[click](javascript" not in md
    table_rows = [line for line in md.splitlines() if line.startswith("| ")]
    weights = [row for row in table_rows if row.startswith("| \\[click\\]")]
    assert weights, "the token is a row label, its brackets escaped"
    # every row of a table has as many cells as its header
    for block in re.findall(r"((?:^\|.*\n)+)", md, re.M):
        lines = block.splitlines()
        cells = {len(re.split(r"(?<!\\)\|", line)) for line in lines}
        assert len(cells) == 1, lines


def test_markdown_escapes_ampersands_so_entities_stay_text() -> None:
    t = hostile_trace(["&lt;script&gt;", "b", "c"])
    md = render.markdown(t)
    assert "&lt;script" not in md.replace("\\&lt;script", "")
    assert "\\&lt;script\\&gt;" in md


@pytest.mark.parametrize("fmt", ["text", "markdown", "latex"])
def test_no_control_character_reaches_the_output(fmt: str) -> None:
    out = render.render(hostile_trace(), fmt)
    assert not CONTROL.search(out), repr(CONTROL.search(out))
    if fmt == "latex":
        assert r"\textbackslash{}x1b" in out
    elif fmt == "markdown":  # the backslash and bracket escaped for Markdown: shows \x1b[31m
        assert r"red\\x1b\[31mRED" in out and r"abc\\u202edcba" in out
    else:
        assert "\\x1b[31mRED" in out and "abc\\u202edcba" in out and "c1\\x9b31m" in out


def test_print_text_on_a_terminal_shows_escapes() -> None:
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=100, color_system=None)
    render.print_text(hostile_trace(), console)
    out = buffer.getvalue()
    assert "\x1b]0;owned" not in out and "\u202e" not in out and "\x9b" not in out
    assert "\\x1b]0;owned\\x07" in out


def test_json_keeps_the_tokens_but_escapes_control_characters() -> None:
    t = hostile_trace()
    out = render.json(t)
    assert not CONTROL.search(out)
    assert qkv.Trace.from_json(out).tokens == HOSTILE


def test_latex_escapes_specials_in_tokens() -> None:
    t = hostile_trace([r"\input{/etc/passwd}", "50%_$#&~^", "b"])
    tex = render.latex(t)
    assert r"\input{" not in tex
    assert r"\textbackslash{}input\{/etc/passwd\}" in tex
    assert r"50\%\_\$\#\&\textasciitilde{}\textasciicircum{}" in tex


def test_the_heatmap_labels_show_escapes() -> None:
    fig = render.heatmap(hostile_trace(), None)
    labels = [label.get_text() for label in fig.axes[0].get_xticklabels()]
    assert "red\\x1b[31mRED\\x1b]0;owned\\x07" in labels


def _hostile_example(tmp_path: Path) -> Path:
    """Seed 000 with hostile tokens (written as JSON strings, which YAML reads as they are)."""
    a, b, c = (json.dumps(token) for token in (SCRIPT, ESC, IMG))
    text = f"""format: 1
name: {json.dumps(TITLE)}
tokens: [{a}, {b}, {c}]
embeddings: [[0.2, 0.5, 0.7], [0.4, 0.8, 0.6], [0.1, 0.6, 0.9]]
weights:
  W_q: [[0.1, 0.3], [0.2, 0.4], [0.5, 0.6]]
  W_k: [[0.6, 0.2], [0.3, 0.5], [0.7, 0.9]]
  W_v: [[0.5, 0.8], [0.2, 0.3], [0.4, 0.6]]
options:
  queries: [{b}]
claimed:
  Q: {{{b}: [0.59, 0.78]}}
  K: {{{a}: [0.48, 0.54], {b}: [0.68, 0.82], {c}: [0.77, 1.12]}}
"""
    path = tmp_path / "hostile.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_check_reports_escape_tokens(tmp_path: Path) -> None:
    path = _hostile_example(tmp_path)
    report = check(str(path))
    assert SCRIPT in report.tokens and ESC in report.tokens  # the example was read as meant
    md = report.markdown()
    assert html_elements(md) == []
    assert not CONTROL.search(md)
    text = report.text(width=80)
    assert not CONTROL.search(text) and "\\x1b[31mRED" in text
    raw = report.to_json()
    assert not CONTROL.search(raw)
    assert {f["token"] for f in json.loads(raw)["findings"]} >= {ESC}


def test_check_on_a_terminal_shows_escapes(tmp_path: Path) -> None:
    report = check(str(_hostile_example(tmp_path)))
    buffer = io.StringIO()
    report.print(Console(file=buffer, force_terminal=True, width=100, color_system=None))
    assert "\x1b]0;owned" not in buffer.getvalue()
    assert "\\x1b]0;owned" in buffer.getvalue()


def test_cli_markdown_and_text_are_inert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _hostile_example(tmp_path)
    for args in (["explain", "-e", str(path), "-f", "markdown"], ["explain", "-e", str(path)]):
        assert main(args) == 0
        out = capsys.readouterr().out
        assert not CONTROL.search(out)
        if "markdown" in args:
            assert html_elements(out) == []
    main(["check", str(path), "-f", "markdown"])
    out = capsys.readouterr().out
    assert html_elements(out) == [] and not CONTROL.search(out)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=6), min_size=2, max_size=3))
def test_any_token_is_inert_in_markdown_and_text(tokens: list[str]) -> None:
    t = hostile_trace(tokens)
    md = render.markdown(t)
    assert html_elements(md) == [] and not CONTROL.search(md)
    assert not CONTROL.search(render.text(t))


def test_visible_writes_out_controls_only() -> None:
    from qkv._format import visible

    assert visible("a\x1bb\tc\u202ed\x9b") == "a\\x1bb\\tc\\u202ed\\x9b"
    assert visible("naïve 東京 🙂 d_k") == "naïve 東京 🙂 d_k"
    assert visible(visible("\x1b")) == "\\x1b"
