"""The renderers: text, Markdown, LaTeX and JSON of a trace, and the narrative they share.

The seed 000 trace ("I love statistics") is built here by hand with NumPy, independently of
qkv's attention code, so these tests pin the numbers a learner reads.
"""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
from rich.console import Console

import qkv
from qkv import render
from qkv.trace import Step, Trace

WEIGHTED_SUM = "0.3046·v_I + 0.3387·v_love + 0.3567·v_statistics = [0.5385, 0.8193]"

SEED_X = np.array([[0.2, 0.5, 0.7], [0.4, 0.8, 0.6], [0.1, 0.6, 0.9]])
SEED_W_Q = np.array([[0.1, 0.3], [0.2, 0.4], [0.5, 0.6]])
SEED_W_K = np.array([[0.6, 0.2], [0.3, 0.5], [0.7, 0.9]])
SEED_W_V = np.array([[0.5, 0.8], [0.2, 0.3], [0.4, 0.6]])


def _softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    out: np.ndarray = e / e.sum(axis=-1, keepdims=True)
    return out


def build_trace(
    x: np.ndarray,
    w_q: np.ndarray,
    w_k: np.ndarray,
    w_v: np.ndarray,
    tokens: list[str] | None,
    *,
    heads: int = 1,
    causal: bool = False,
    w_o: np.ndarray | None = None,
    queries: list[int] | None = None,
    name: str | None = None,
) -> Trace:
    """A trace laid out as qkv.multi_head_attention records it, computed with plain NumPy."""
    length = x.shape[0]
    d_k = w_q.shape[1] // heads
    scale = 1 / np.sqrt(d_k)
    t = Trace(tokens=tokens)

    def rec(step: str, value: np.ndarray, axes: tuple[str, ...], formula: str = "") -> None:
        t.record(step, value, formula=formula, description="", axes=axes)

    def split(m: np.ndarray) -> np.ndarray:  # (L, H·D) → (H, L, D), or (L, D) for one head
        parts = m.reshape(length, heads, -1).transpose(1, 0, 2)
        return parts[0] if heads == 1 else parts

    rec("embeddings", x, ("token", "model"), "X")
    for label, w in (("W_q", w_q), ("W_k", w_k), ("W_v", w_v)):
        rec(label, w, ("model", "feature"), label)
    q, k, v = split(x @ w_q), split(x @ w_k), split(x @ w_v)
    lead = () if heads == 1 else ("head",)
    kv_lead = () if heads == 1 else ("kv_head",)
    rec("Q", q, (*lead, "query", "dim"), "Q = X·W_q")
    rec("K", k, (*kv_lead, "key", "dim"), "K = X·W_k")
    rec("V", v, (*kv_lead, "key", "dim"), "V = X·W_v")
    scores = q @ np.swapaxes(k, -1, -2)
    rec("scores", scores, (*lead, "query", "key"), "S = Q·Kᵀ")
    scaled = scores * scale
    rec("scaled", scaled, (*lead, "query", "key"), f"S' = S / √d_k = S × {scale:.4g}")
    if causal:
        scaled = np.where(np.tril(np.ones((length, length), bool)), scaled, -np.inf)
        rec("masked", scaled, (*lead, "query", "key"), "S' = S' where allowed, −∞ elsewhere")
    weights = _softmax(scaled)
    rec("weights", weights, (*lead, "query", "key"), "A = softmax(S') row by row")
    context = weights @ v
    rec("context", context, (*lead, "query", "dim"), "C = A·V")
    if heads > 1 or w_o is not None:
        concat = context if heads == 1 else context.transpose(1, 0, 2).reshape(length, -1)
        rec("concat", concat, ("query", "feature"), "concat(C_0, …, C_{h−1})")
        if w_o is not None:
            rec("W_o", w_o, ("feature", "model"), "W_o")
            rec("output", concat @ w_o, ("query", "model"), "O = concat·W_o")
    t.meta.update(
        num_heads=heads,
        num_kv_heads=heads,
        d_k=d_k,
        d_v=w_v.shape[1] // heads,
        scale=float(scale),
        scale_mode="sqrt_dk",
        causal=causal,
        mask=None,
        d_model=x.shape[1],
        queries=queries,
    )
    if name:
        t.meta.update(name=name, description=f"The example {name}.")
    return t


@pytest.fixture
def seed000() -> Trace:
    return build_trace(
        SEED_X,
        SEED_W_Q,
        SEED_W_K,
        SEED_W_V,
        ["I", "love", "statistics"],
        queries=[1],
        name="I love statistics",
    )


def wide_trace(tokens: int = 10, d: int = 12, heads: int = 2, causal: bool = True) -> Trace:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(tokens, 5))
    w_q, w_k, w_v = (rng.normal(size=(5, heads * d)) for _ in range(3))
    w_o = rng.normal(size=(heads * d, 5))
    labels = [f"token{i}" for i in range(tokens)]
    return build_trace(x, w_q, w_k, w_v, labels, heads=heads, causal=causal, w_o=w_o, name="wide")


def assert_fits(text: str, width: int = 80) -> None:
    long = [line for line in text.splitlines() if len(line) > width]
    assert not long, f"{len(long)} lines longer than {width}: {long[:3]}"


# -- text ------------------------------------------------------------------------------------


def test_text_pins_the_numbers_of_seed_000(seed000: Trace) -> None:
    out = render.text(seed000)
    for number in ("1.116", "1.2660", "1.3390", "0.7071", "0.3046", "0.3387", "0.3567"):
        assert number in out
    assert "0.5385" in out and "0.8193" in out
    assert f"c_love = {WEIGHTED_SUM}" in out.splitlines()
    assert "q_love = x_love·W_q = [0.4000, 0.8000, 0.6000]·W_q = [0.5000, 0.8000]" in out
    assert "q_love·k_I = 0.5000×0.7600 + 0.8000×0.9200 = 1.1160" in out
    assert "A[love, I] = e^0.7891 / (e^0.7891 + e^0.8952 + e^0.9468) = 0.3046" in out
    assert "Σ_j A[love, j] = 0.3046 + 0.3387 + 0.3567 = 1.0000" in out


def test_text_header_names_the_example_and_its_sizes(seed000: Trace) -> None:
    head = render.text(seed000).split("Step 1.")[0]
    assert head.startswith("I love statistics\nThe example I love statistics.")
    assert re.search(r"d_model\s+3", head) and re.search(r"d_k\s+2", head)
    assert re.search(r"heads\s+1", head)
    assert "scaled by 1/√d_k = 1/√2 = 0.7071" in head
    assert "love (1 of 3 shown)" in head


def test_text_shows_only_the_query_rows_asked_for(seed000: Trace) -> None:
    out = render.text(seed000)
    q_table = out.split("Step 5. Query vectors")[1].split("Step 6.")[0]
    assert "love" in q_table and "statistics" not in q_table
    k_table = out.split("Step 6. Key vectors")[1].split("Step 7.")[0]
    assert all(token in k_table for token in ("I", "love", "statistics"))


def test_text_every_query_row_when_queries_is_unset(seed000: Trace) -> None:
    seed000.meta["queries"] = None
    out = render.text(seed000)
    assert "c_I = " in out and "c_statistics = " in out


def test_text_step_titles_use_the_seeds_vocabulary(seed000: Trace) -> None:
    out = render.text(seed000)
    titles = [line.split(" ─")[0] for line in out.splitlines() if line.startswith("Step ")]
    assert titles == [
        "Step 1. Token embeddings",
        "Step 2. Query weight matrix W_q",
        "Step 3. Key weight matrix W_k",
        "Step 4. Value weight matrix W_v",
        "Step 5. Query vectors",
        "Step 6. Key vectors",
        "Step 7. Value vectors",
        "Step 8. Attention scores",
        "Step 9. Scaled attention scores",
        "Step 10. Attention weights",
        "Step 11. Context vectors",
    ]


def test_text_weights_rows_show_their_sum(seed000: Trace) -> None:
    out = render.text(seed000)
    weights = out.split("Step 10. Attention weights")[1].split("Step 11.")[0]
    header = next(line for line in weights.splitlines() if "query \\ key" in line)
    assert header.split()[-1] == "sum"
    row = next(line for line in weights.splitlines() if line.startswith("love"))
    assert row.split()[-1] == "1.0000"


def test_text_has_no_colour_codes_and_no_trailing_spaces(seed000: Trace) -> None:
    out = render.text(seed000)
    assert "\x1b" not in out
    assert all(line == line.rstrip() for line in out.splitlines())


def test_text_precision(seed000: Trace) -> None:
    out = render.text(seed000, precision=2)
    assert "c_love = 0.30·v_I + 0.34·v_love + 0.36·v_statistics = [0.54, 0.82]" in out
    with pytest.raises(ValueError, match="precision must be an integer from 0 to 15"):
        render.text(seed000, precision=-1)


def test_text_width_too_small(seed000: Trace) -> None:
    with pytest.raises(ValueError, match="at least 40"):
        render.text(seed000, width=20)


def test_text_masked_scores_are_minus_infinity_and_left_out_of_the_sums() -> None:
    t = build_trace(SEED_X, SEED_W_Q, SEED_W_K, SEED_W_V, ["I", "love", "statistics"], causal=True)
    out = render.text(t)
    masked = out.split("Masked attention scores")[1].split("Step ")[0]
    rows = [line for line in masked.splitlines() if line.startswith(("I ", "love", "stat"))]
    assert sum(row.count("−∞") for row in rows) == 3
    assert "c_I = 1.0000·v_I = [0.4800, 0.7300]" in out
    assert "left out of the weighted sums" in out
    # the softmax is worked out for the query that sees the most keys
    assert "A[statistics, I] = " in out


@pytest.mark.parametrize(("tokens", "d", "heads"), [(6, 3, 1), (10, 12, 2), (12, 8, 1), (3, 40, 1)])
def test_text_fits_80_columns(tokens: int, d: int, heads: int) -> None:
    t = wide_trace(tokens, d, heads)
    out = render.text(t, precision=6)
    assert_fits(out)
    assert "columns 1–" in out  # the wide tables were split, not squeezed
    assert "…" not in out.replace("C_0, …, C_{h−1}", "")  # no number was cut


def test_text_fits_a_narrower_width() -> None:
    out = render.text(wide_trace(8, 4, 2), width=60)
    assert_fits(out, 60)


def test_text_long_and_repeated_tokens_fit() -> None:
    tokens = ["a" * 50, "the", "the", "b|c"]
    rng = np.random.default_rng(3)
    w_q, w_k, w_v = (rng.normal(size=(3, 2)) for _ in range(3))
    t = build_trace(rng.normal(size=(4, 3)), w_q, w_k, w_v, tokens)
    out = render.text(t)
    assert_fits(out)
    assert "the#1" in out and "the#2" in out  # repeated tokens told apart by position


def test_text_of_every_builtin_fits_80_columns() -> None:
    examples = pytest.importorskip("qkv.examples")
    for name in examples.builtin_names():
        example = examples.builtin(name)
        for options in ({}, {"causal": True}, {"scale": False}):
            trace = examples.run(example, **options)
            assert_fits(render.text(trace))
            assert_fits(render.text(trace, precision=10))


def test_print_text_uses_the_console(seed000: Trace) -> None:
    console = Console(file=io.StringIO(), width=100, force_terminal=True, color_system="standard")
    render.print_text(seed000, console)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "\x1b[" in out  # colour on a terminal
    assert "0.3046" in out


# -- multi-head --------------------------------------------------------------------------------


def test_multi_head_has_a_section_per_head_then_the_combination() -> None:
    t = wide_trace(4, 2, 2, causal=False)
    out = render.text(t)
    sections = [line.strip("═ ") for line in out.splitlines() if line.startswith("═")]
    assert sections == ["Inputs", "Head 0 of 2 heads", "Head 1 of 2 heads", "Combining the heads"]
    head2 = out.split("Head 1 of 2 heads")[1].split("Combining the heads")[0]
    context = t["context"].value[1]  # head 1, shown with head 1's own numbers
    assert f"{context[0, 0]:.4f}" in head2
    assert "Step 12. Concatenated context vectors" in out
    assert "h1.d1" in out  # the heads' columns are labelled in W_q and concat


def test_multi_head_numbers_come_from_each_head() -> None:
    t = wide_trace(4, 2, 2, causal=False)
    narrative = render.narrate(t)
    heads = [s for s in narrative.sections if s.title and s.title.startswith("Head")]
    for h, section in enumerate(heads):
        weights = next(step for step in section.steps if step.name == "weights")
        assert weights.table is not None
        np.testing.assert_allclose(weights.table.values, t["weights"].value[h])


def test_grouped_query_attention_uses_the_shared_key_value_head() -> None:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(3, 4))
    with qkv.tracing() as t:
        qkv.multi_head_attention(
            x, rng.normal(size=(4, 4)), rng.normal(size=(4, 2)), rng.normal(size=(4, 2)),
            num_heads=2, num_kv_heads=1,
        )  # fmt: skip
    n = render.narrate(t)
    titles = [s.title for s in n.sections]
    assert "Head 1 of 2 heads (key/value head 0 of 1)" in titles
    out = render.text(t)
    assert "multi-query attention" in out
    assert out.count("c_t0 = ") == 2  # the weighted sums are true in both heads


def test_real_attention_trace_matches_the_hand_built_one(seed000: Trace) -> None:
    with qkv.tracing() as t:
        qkv.self_attention(SEED_X, SEED_W_Q, SEED_W_K, SEED_W_V)
    t.tokens = ["I", "love", "statistics"]
    t.meta["queries"] = [1]
    assert f"c_love = {WEIGHTED_SUM}" in render.text(t)


def test_worked_lines_are_only_shown_when_true(seed000: Trace) -> None:
    k = next(step for step in seed000.steps if step.name == "K")
    k.value = k.value + 1.0  # as if K had been changed after recording (e.g. rotary)
    out = render.text(seed000)
    assert "q_love·k_I" not in out
    assert f"c_love = {WEIGHTED_SUM}" in out


def test_a_trace_of_several_calls_gets_a_section_per_call() -> None:
    rng = np.random.default_rng(2)
    q = rng.normal(size=(2, 3, 4))
    with qkv.tracing() as t:
        qkv.scaled_dot_product_attention(q, q, q)
        qkv.scaled_dot_product_attention(q[0], q[0], q[0], scale=0.5)
    out = render.text(t)
    assert "Call 0 of 2 calls, batch element 0 of 2" in out and "Call 1 of 2 calls" in out
    assert "S'[t0, t0] = " in out  # the custom scale of call 1, worked out
    assert_fits(out)


def test_narrate_rejects_an_empty_trace() -> None:
    with pytest.raises(ValueError, match="no steps"):
        render.narrate(Trace())


def test_a_scalar_and_a_vector_step_render() -> None:
    t = Trace(tokens=["a", "b"])
    t.steps.append(Step("bias", np.array(0.5), "b", "a bias", ()))
    t.steps.append(Step("weights", np.array([0.25, 0.75]), "A", "weights", ("key",)))
    out = render.text(t)
    assert "0.5000" in out and "0.7500" in out


# -- Markdown ----------------------------------------------------------------------------------


def _markdown_tables(md: str) -> list[list[str]]:
    tables: list[list[str]] = []
    current: list[str] = []
    for line in [*md.splitlines(), ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables


def _cells(row: str) -> int:
    return len(re.findall(r"(?<!\\)\|", row)) - 1


def test_markdown_tables_are_well_formed(seed000: Trace) -> None:
    md = render.markdown(seed000)
    tables = _markdown_tables(md)
    assert len(tables) == 11
    for table in tables:
        assert re.fullmatch(r"\|:--(\|--:)+\|", table[1])
        assert len({_cells(row) for row in table}) == 1
    weights = tables[9]
    assert weights[0] == "| query \\\\ key | I | love | statistics | sum |"
    assert weights[2] == "| love | 0.3046 | 0.3387 | 0.3567 | 1.0000 |"


def test_markdown_headings_formulas_and_weighted_sum(seed000: Trace) -> None:
    md = render.markdown(seed000)
    assert md.startswith("# I love statistics\n")
    assert "## Step 10. Attention weights" in md
    assert r"$A = \operatorname{softmax}(S') \text{ row by row}$" in md
    assert (
        r"$$c_{\text{love}} = 0.3046\,v_{\text{I}} + 0.3387\,v_{\text{love}} + "
        r"0.3567\,v_{\text{statistics}} = [0.5385,\ 0.8193]$$"
    ) in md
    assert "- **scale**: scaled by 1/√d_k = 1/√2 = 0.7071" in md


def test_markdown_escapes_tokens() -> None:
    rng = np.random.default_rng(4)
    w_q, w_k, w_v = (rng.normal(size=(3, 2)) for _ in range(3))
    t = build_trace(rng.normal(size=(2, 3)), w_q, w_k, w_v, ["a|b", "*x*"])
    md = render.markdown(t)
    assert "| a\\|b |" in md and "\\*x\\*" in md
    for table in _markdown_tables(md):
        assert len({_cells(row) for row in table}) == 1


def test_markdown_masked_scores_and_heads() -> None:
    md = render.markdown(wide_trace(3, 2, 2))
    assert "−∞" in md
    assert "## Head 0 of 2 heads" in md and "### Step 8. Attention scores" in md


# -- LaTeX -------------------------------------------------------------------------------------


def test_latex_fragment(seed000: Trace) -> None:
    tex = render.latex(seed000)
    assert r"\section*{I love statistics}" in tex
    assert r"\begin{tabular}{l|rrr|r}" in tex
    assert "love & 0.3046 & 0.3387 & 0.3567 & 1.0000 \\\\" in tex
    assert (
        r"c_{\text{love}} &= 0.3046\,v_{\text{I}} + 0.3387\,v_{\text{love}} + "
        r"0.3567\,v_{\text{statistics}} = [0.5385,\ 0.8193]"
    ) in tex
    assert r"\documentclass" not in tex
    assert tex.count(r"\begin{align*}") == tex.count(r"\end{align*}")
    assert tex.count(r"\begin{tabular}") == tex.count(r"\end{tabular}")


def test_latex_standalone_document(seed000: Trace) -> None:
    tex = render.latex(seed000, standalone=True)
    assert tex.startswith(r"\documentclass{article}")
    assert r"\usepackage{amsmath}" in tex and tex.rstrip().endswith(r"\end{document}")


def test_latex_escapes_special_characters_in_tokens() -> None:
    rng = np.random.default_rng(4)
    w_q, w_k, w_v = (rng.normal(size=(3, 2)) for _ in range(3))
    t = build_trace(rng.normal(size=(2, 3)), w_q, w_k, w_v, ["a_b&c%", "#{x}~^\\$"])
    tex = render.latex(t)
    assert r"a\_b\&c\%" in tex
    assert r"\#\{x\}\textasciitilde{}\textasciicircum{}\textbackslash{}\$" in tex
    assert "a_b&c%" not in tex
    assert r"v_{\text{a\_b\&c\%}}" in tex


def test_latex_masked_scores_are_minus_infinity() -> None:
    t = build_trace(SEED_X, SEED_W_Q, SEED_W_K, SEED_W_V, ["I", "love", "statistics"], causal=True)
    tex = render.latex(t)
    assert r"$-\infty$" in tex
    assert "−∞" not in tex.split(r"\begin{center}", 1)[1]  # never the Unicode form in tables


# -- JSON and the format switch ----------------------------------------------------------------


def test_json_round_trip(seed000: Trace) -> None:
    text = render.json(seed000)
    again = Trace.from_json(text)
    assert again.names == seed000.names
    assert again.tokens == seed000.tokens
    np.testing.assert_allclose(again["weights"].value, seed000["weights"].value)
    assert json.loads(text)["meta"]["queries"] == [1]


def test_json_of_masked_scores_is_strict_json() -> None:
    t = build_trace(SEED_X, SEED_W_Q, SEED_W_K, SEED_W_V, ["I", "love", "statistics"], causal=True)
    text = render.json(t)
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    assert np.isneginf(Trace.from_json(text)["masked"].value).sum() == 3


def test_render_by_format_name(seed000: Trace) -> None:
    assert render.render(seed000, "text") == render.text(seed000)
    assert render.render(seed000, "markdown") == render.markdown(seed000)
    assert render.render(seed000, "latex") == render.latex(seed000)
    assert render.render(seed000, "json") == render.json(seed000)
    with pytest.raises(ValueError, match="unknown format 'html'; expected one of text"):
        render.render(seed000, "html")
