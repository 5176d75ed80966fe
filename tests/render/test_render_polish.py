"""What qkv prints and draws, read as a learner reads it (issue 12, items 15 and 17).

Worked lines never contradict themselves at any precision; the header says what a mask is;
the description matches the query shown; messages have their nouns and their grammar; the
example's own comment and the check report give one number for one claim; the README shows
tokens; pictures are sized to their content, with weights on a fixed 0..1 colour scale and a
colour bar whose label fits.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import qkv
from qkv import examples, masks, render
from qkv.check import check
from qkv.cli import main

ROOT = Path(__file__).resolve().parents[2]
NUMBER = r"-?\d+(?:\.\d+)?"


def _decimals(text: str) -> int:
    return len(text.split(".")[1]) if "." in text else 0


def _sum_lines(out: str) -> list[tuple[list[str], str]]:
    """The terms and result of every ``Σ_j A[q, j] = a + b + c = r`` and dot-product line."""
    found = []
    for line in out.splitlines():
        m = re.fullmatch(rf"Σ_j A\[.*?, j\] = ((?:{NUMBER} \+ )*{NUMBER}) = ({NUMBER})", line)
        if m:
            found.append((m.group(1).split(" + "), m.group(2)))
    return found


def _dot_lines(out: str) -> list[tuple[list[tuple[str, str]], str]]:
    found = []
    factor = rf"\(?({NUMBER})\)?"
    for line in out.splitlines():
        m = re.fullmatch(rf"q_\S+·k_\S+ = (.*) = ({NUMBER})", line)
        if m:
            terms = [re.fullmatch(rf"{factor}×{factor}", t) for t in m.group(1).split(" + ")]
            if all(terms):
                found.append(([(t.group(1), t.group(2)) for t in terms if t], m.group(2)))
    return found


def _agrees(by_hand: float, printed: str) -> bool:
    return abs(by_hand - float(printed)) <= 0.5 * 10.0 ** -_decimals(printed) + 1e-12


@pytest.mark.parametrize("precision", [0, 1])
def test_low_precision_worked_lines_add_up(precision: int) -> None:
    out = render.text(examples.run(examples.builtin("i-love-statistics")), precision=precision)
    sums = _sum_lines(out)
    assert sums, "the row sum of the weights is still written out"
    for terms, result in sums:
        assert _agrees(sum(float(t) for t in terms), result), (terms, result)
    assert "Σ_j A[love, j] = 0 + 0 + 0 = 1" not in out
    c_love = next(line for line in out.splitlines() if line.startswith("c_love = "))
    assert not c_love.startswith("c_love = 0·v_I + 0·v_love"), c_love


def test_a_widened_line_says_so() -> None:
    out = render.text(examples.run(examples.builtin("i-love-statistics")), precision=0)
    assert "Σ_j A[love, j] = 0.3 + 0.3 + 0.4 = 1.0" in out
    assert "Worked out with 1 decimal instead of 0" in out


def test_default_precision_lines_are_unchanged() -> None:
    out = render.text(examples.run(examples.builtin("i-love-statistics")))
    assert "Σ_j A[love, j] = 0.3046 + 0.3387 + 0.3567 = 1.0000" in out
    assert "c_love = 0.3046·v_I + 0.3387·v_love + 0.3567·v_statistics = [0.5385, 0.8193]" in out
    assert "instead of 4" not in out


@settings(max_examples=40, deadline=None)
@given(
    x=arrays(np.float64, (3, 3), elements=st.floats(-2, 2)),
    w=arrays(np.float64, (3, 3, 2), elements=st.floats(-2, 2)),
    precision=st.integers(0, 3),
)
def test_every_printed_sum_and_dot_product_reads_true(
    x: np.ndarray, w: np.ndarray, precision: int
) -> None:
    with qkv.tracing() as t:
        qkv.self_attention(x, w[..., 0], w[..., 1], w[..., 0] + w[..., 1])
    out = render.text(t, precision=precision, width=400)
    for terms, result in _sum_lines(out):
        unit = 10.0 ** -_decimals(result)
        by_hand = sum(float(a) for a in terms)
        assert _reads_true(by_hand, result, 0.5 * unit * len(terms)), out
    for products, result in _dot_lines(out):
        unit = 10.0 ** -_decimals(result)
        by_hand = sum(float(a) * float(b) for a, b in products)
        carried = 0.5 * unit * sum(abs(float(a)) + abs(float(b)) + unit for a, b in products)
        # The unrounded factors are unknown here: each may be half a unit smaller than printed.
        shrunk = sum(max(abs(float(a)) - unit / 2, 0) for pair in products for a in pair)
        least = 0.5 * unit * shrunk
        assert _reads_true(by_hand, result, carried, least), out


def _reads_true(by_hand: float, result: str, carried: float, least: float | None = None) -> bool:
    """The printed result is the rounded arithmetic of the printed numbers; or it is off
    only by the rounding those numbers carry (at most ``carried``, at least ``least``), and
    that stays within 5% of the result (so never "0 + 0 + 0 = 1")."""
    half = 0.5 * 10.0 ** -_decimals(result)
    off = abs(by_hand - float(result))
    bound = half + carried
    small = half + (carried if least is None else least) <= 0.05 * abs(float(result))
    return off <= half + 1e-12 or (off <= bound + 1e-12 and small)


# -- the header ---------------------------------------------------------------------------


def _facts(t: qkv.Trace) -> dict[str, str]:
    return {f.label: f.plain for f in render.narrate(t).facts}


def _traced(mask: object) -> qkv.Trace:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 4))
    w_q, w_k, w_v = (rng.normal(size=(4, 4)) for _ in range(3))
    with qkv.tracing() as t:
        qkv.multi_head_attention(x, w_q, w_k, w_v, num_heads=2, mask=mask)
    return t


def test_the_header_says_what_a_boolean_mask_is() -> None:
    padding = np.ones((2, 1, 1, 5), bool)
    padding[0, ..., 3:] = False
    assert _facts(_traced(padding))["mask"] == "key padding (lengths 3, 5 of 5 keys)"
    causal = np.tril(np.ones((5, 5), bool))
    assert _facts(_traced(causal))["mask"].startswith("causal")
    other = np.ones((5, 5), bool)
    other[1, 2] = False
    assert _facts(_traced(other))["mask"] == (
        "a boolean mask: 1 of 25 query-key pairs of batch element 1 blocked"
    )
    for fact in (_facts(_traced(m))["mask"] for m in (padding, causal, other)):
        assert "boolean array" not in fact


def test_the_header_counts_one_token_in_the_singular() -> None:
    with qkv.tracing() as t:
        qkv.scaled_dot_product_attention(np.ones((1, 2)), np.ones((3, 2)), np.ones((3, 2)))
    t.tokens, t.query_tokens = ["a", "b", "c"], ["<pool>"]
    assert _facts(t)["query tokens"] == "<pool> (1 token)"


def test_the_header_words_mask_rules() -> None:
    assert _facts(_traced(masks.key_padding([3, 5])))["mask"] == "key padding (lengths 3, 5)"
    assert _facts(_traced(masks.causal()))["mask"] == "causal (top-left)"


def test_the_description_matches_the_query_shown(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "-q", "I", "--width", "200"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert 'Shown here for the query "I" instead.' in out
    assert main(["explain", "-q", "love", "--width", "200"]) == 0
    assert "Shown here" not in capsys.readouterr().out  # the example's own query


# -- the check report -----------------------------------------------------------------------


def _one_wrong_example(tmp_path: Path, claimed: str) -> Path:
    path = tmp_path / "one.yaml"
    path.write_text(
        "format: 1\nname: one\ntokens: [a, b, c]\n"
        "embeddings: [[0.2, 0.5, 0.7], [0.4, 0.8, 0.6], [0.1, 0.6, 0.9]]\n"
        "weights:\n  W_q: [[0.1, 0.3], [0.2, 0.4], [0.5, 0.6]]\n"
        "  W_k: [[0.6, 0.2], [0.3, 0.5], [0.7, 0.9]]\n"
        "  W_v: [[0.5, 0.8], [0.2, 0.3], [0.4, 0.6]]\n"
        f"claimed:\n{claimed}",
        encoding="utf-8",
    )
    return path


def test_the_summary_has_its_grammar(tmp_path: Path) -> None:
    one = check(str(_one_wrong_example(tmp_path, "  Q: {b: [0.59, 0.78]}\n")))
    assert "\n✗ The claimed row is wrong: 1 mistake" in one.text(width=200)
    three = check(
        str(
            _one_wrong_example(
                tmp_path, "  Q: {a: [0.59, 0.78], b: [0.50, 0.80], c: [0.58, 0.81]}\n"
            )
        )
    )
    assert "✗ 1 of 3 claimed rows is wrong: 1 mistake" in three.text(width=200)


def test_the_example_and_its_check_report_give_one_number_for_one_claim(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["examples", "--show", "i-love-statistics"]) == 0
    shown = capsys.readouterr().out
    comment = " ".join(line for line in shown.splitlines() if line.lstrip().startswith("#"))
    said = re.findall(r"\[(0\.\d{4}(?:, 0\.\d{4})+)\]", comment)
    report = check("i-love-statistics").text(width=200)
    weights = next(f for f in check("i-love-statistics").findings if f.step == "weights")
    from_printed = re.search(r"it would be \[([^\]]+)\]", weights.message)
    assert from_printed is not None
    assert from_printed.group(1) in said, (said, report)


# -- the README ------------------------------------------------------------------------------


def test_the_readme_python_example_shows_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    code = text.split("```python\n")[1].split("```")[0]
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "| love | 0.3046 | 0.3387 | 0.3567 | 1.0000 |" in out
    assert "| t0 |" not in out and "t1" not in out


# -- pictures ---------------------------------------------------------------------------------


def test_weights_use_a_fixed_zero_to_one_scale() -> None:
    fig = render.heatmap(examples.run(examples.builtin("i-love-statistics")))
    image = fig.axes[0].images[0]
    assert image.norm.vmin == 0.0 and image.norm.vmax == 1.0
    colourbar = fig.axes[-1]
    assert "0 to 1" in (colourbar.get_ylabel() + colourbar.get_xlabel())


def test_a_one_row_heatmap_is_sized_to_its_row() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 4))
    with qkv.tracing(queries=[2]) as t:
        qkv.self_attention(x, *(rng.normal(size=(4, 4)) for _ in range(3)))
    fig = render.heatmap(t)
    width, height = fig.get_size_inches()
    assert height < 0.75 * width  # a strip, not a square with white above and below
    fig.canvas.draw()
    panel = fig.axes[0].get_window_extent()
    assert panel.height / (height * fig.dpi) > 0.15  # the row fills its share of the figure


@pytest.mark.parametrize("step", ["weights", "scaled"])
def test_the_colour_bar_label_fits_in_the_figure(step: str) -> None:
    fig = render.heatmap(examples.run(examples.builtin("i-love-statistics")), step=step)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    colourbar = fig.axes[-1]
    label = colourbar.yaxis.label if colourbar.get_ylabel() else colourbar.xaxis.label
    box = label.get_window_extent(renderer)
    figure = fig.bbox
    assert box.y0 >= figure.y0 - 1 and box.y1 <= figure.y1 + 1, (box, figure)
    assert box.x0 >= figure.x0 - 1 and box.x1 <= figure.x1 + 1, (box, figure)
    bar = colourbar.get_window_extent(renderer)
    if colourbar.get_ylabel():  # beside the panels: the label is no taller than the bar
        assert box.height <= bar.height + 1, (box, bar)


def test_plot_messages_name_the_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.png"
    assert main(["explain", "--plot", str(path), "--plot-step", "scaled"]) == 0
    err = capsys.readouterr()
    said = err.out + err.err
    assert "the scaled attention scores, one panel per head" in said
    assert "the scaled," not in said
