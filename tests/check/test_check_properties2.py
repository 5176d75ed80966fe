"""Properties of format 2: correct examples give no finding at any printed precision, and the
precision policy never hides a whole-number slip.

The "author" is NumPy, independent of the checker: it computes every step from Q, K and V
given directly (whole numbers, or real numbers), with a mask (causal top-left or
bottom-right, key padding, an explicit matrix) and Lq ≠ Lk, prints the claimed rows
(whole values as whole numbers, others at 2 to 4 decimals, masked scores as -inf or -1e9)
and, in the "carried" mode, computes each later step from the numbers it printed.
"""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from qkv.check import check
from qkv.examples import loads
from tests.check.test_check_properties import Worked, worked_examples

STEPS = ("scores", "scaled", "exp", "exp_sum", "weights", "products", "context")


def masked_softmax(s: np.ndarray) -> np.ndarray:
    out = np.zeros_like(s)
    for i, row in enumerate(s):
        keep = np.isfinite(row)
        if keep.any():
            e = np.exp(row[keep] - row[keep].max())
            out[i, keep] = e / e.sum()
    return out


def text_of(value: float, decimals: int, whole: bool) -> str:
    if whole and float(value).is_integer():
        return str(int(value))
    return f"{value:.{decimals}f}"


@st.composite
def direct_examples(draw: st.DrawFn) -> str:
    lq, lk = draw(st.integers(1, 4)), draw(st.integers(2, 4))
    d_k, d_v = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    whole = draw(st.booleans())

    def matrix(*shape: int) -> np.ndarray:
        if whole:
            return rng.integers(-2, 3, shape).astype(float)
        return np.round(rng.normal(size=shape), 3)

    q, k, v = matrix(lq, d_k), matrix(lk, d_k), matrix(lk, d_v)
    scale = draw(st.sampled_from(["true", "false"]))
    factor = 1 / np.sqrt(d_k) if scale == "true" else 1.0
    allowed = np.ones((lq, lk), dtype=bool)
    options = [f"scale: {scale}"]
    causal = draw(st.sampled_from(["none", "top-left", "bottom-right"]))
    if causal != "none":
        shift = lk - lq if causal == "bottom-right" else 0
        allowed &= np.arange(lk)[None, :] <= np.arange(lq)[:, None] + shift
        options.append(f"causal: {causal}")
    if draw(st.booleans()):
        length = draw(st.integers(1, lk))
        allowed[:, length:] = False
        options.append(f"key_length: {length}")
    if draw(st.booleans()):
        extra = rng.random((lq, lk)) > 0.3
        allowed &= extra
        options.append(f"mask: {extra.astype(int).tolist()}")
    carried = draw(st.booleans())
    steps = draw(st.lists(st.sampled_from(STEPS), unique=True, min_size=1))
    claims = {s: draw(st.lists(st.integers(0, lq - 1), unique=True, min_size=1)) for s in steps}
    precisions = draw(st.lists(st.integers(2, 4), min_size=32, max_size=32))
    minus_inf = draw(st.sampled_from(["-inf", "-.inf", "−∞", "-1e9"]))
    counter = iter(range(10**6))
    printed: dict[str, dict[int, list[str]]] = {}

    def show(step: str, values: np.ndarray, masked: np.ndarray | None = None) -> np.ndarray:
        values = values.copy()
        for t in claims.get(step, []):
            decimals = precisions[next(counter) % 32]
            texts = []
            for j, x in enumerate(np.atleast_1d(values[t])):
                if masked is not None and not masked[t, j]:
                    texts.append(minus_inf)
                else:
                    texts.append(text_of(float(x), decimals, whole))
            printed.setdefault(step, {})[t] = texts
            if carried:
                numbers = [-np.inf if text == minus_inf else float(text) for text in texts]
                values[t] = np.array(numbers).reshape(np.shape(values[t]))
        return values

    scores = show("scores", q @ k.T, allowed)
    scaled = show("scaled", scores * factor, allowed)
    scaled = np.where(allowed, scaled, -np.inf)
    with np.errstate(over="ignore"):
        exp = np.where(allowed, np.exp(np.where(allowed, scaled, 0.0)), 0.0)
    exp = show("exp", exp)
    exp_sum = show("exp_sum", exp.sum(axis=1, keepdims=True))
    # Carried exponentials that all round to 0 leave a sum of 0 and weights of 0 / 0: not a
    # correct worked example, whatever its author writes next.
    assume(not ((exp_sum[:, 0] == 0) & allowed.any(axis=1)).any())
    if "exp" in claims or "exp_sum" in claims:
        weights = np.divide(exp, exp_sum, out=np.zeros_like(exp), where=exp_sum > 0)
        rest = [t for t in range(lq) if t not in claims.get("exp", []) + claims.get("exp_sum", [])]
        weights[rest] = masked_softmax(scaled)[rest]
    else:
        weights = masked_softmax(scaled)
    weights = show("weights", weights)
    products = show("products", (weights[:, :, None] * v[None]).reshape(lq, -1))
    show("context", products.reshape(lq, lk, d_v).sum(axis=1))

    lines = [
        "format: 2",
        f"inputs: {{Q: {q.tolist()}, K: {k.tolist()}, V: {v.tolist()}}}",
        f"options: {{{', '.join(options)}}}",
        "claimed:",
    ]
    names = [f"t{i + 1}" for i in range(lq)] if lq == lk else [f"q{i + 1}" for i in range(lq)]
    for step, rows in printed.items():
        lines.append(f"  {step}:")
        for t, texts in rows.items():
            if step == "products":
                lines.append(f"    {names[t]}: {_matrix(texts, d_v)}")
            else:
                lines.append(f"    {names[t]}: [{', '.join(texts)}]")
    return "\n".join(lines) + "\n"


def _matrix(texts: list[str], width: int) -> str:
    rows = [texts[i : i + width] for i in range(0, len(texts), width)]
    return "[" + ", ".join("[" + ", ".join(r) + "]" for r in rows) + "]"


@settings(max_examples=150, deadline=None)
@given(direct_examples())
def test_correct_format2_examples_give_no_finding(text: str) -> None:
    report = check(loads(text))
    problems = [
        (f.step, f.token, f.printed, f.expected) for f in report.findings if f.status != "ok"
    ]
    assert not problems, text + report.text()


@settings(max_examples=80, deadline=None)
@given(worked_examples())
def test_format1_style_examples_as_format2_give_no_finding(worked: Worked) -> None:
    """The examples of the format-1 property, checked with format 2's policy and codes."""
    report = check(loads("format: 2\n" + worked.yaml))
    problems = [(f.step, f.token, f.printed) for f in report.findings if f.status != "ok"]
    assert not problems, worked.yaml


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3))
def test_a_whole_score_off_by_one_is_a_mistake(seed: int, off: int) -> None:
    """Exact inputs give exact whole scores: printing 3 for 2 is never a rounding."""
    rng = np.random.default_rng(seed)
    q, k = rng.integers(-2, 3, (2, 2)), rng.integers(-2, 3, (3, 2))
    scores = (q @ k.T).astype(int)
    wrong = scores[0].copy()
    wrong[rng.integers(0, 3)] += off
    text = (
        f"format: 2\ninputs: {{Q: {q.tolist()}, K: {k.tolist()}}}\n"
        f"claimed: {{scores: {{q1: {wrong.tolist()}}}}}\n"
    )
    assert not check(loads(text)).ok


@st.composite
def two_head_examples(draw: st.DrawFn) -> str:
    """Two heads, rows claimed per head (scores, scaled, weights, context) and all heads'
    context and output, at 2 to 4 decimals, carried or not."""
    length = draw(st.integers(2, 4))
    d_k, d_v = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, k = rng.normal(size=(length, 2 * d_k)), rng.normal(size=(length, 2 * d_k))
    v = rng.normal(size=(length, 2 * d_v))
    q, k, v = (np.round(a, 2) for a in (q, k, v))
    causal = draw(st.booleans())
    allowed = np.tril(np.ones((length, length), dtype=bool)) if causal else None
    carried = draw(st.booleans())
    decimals = draw(st.integers(2, 4))
    steps = draw(st.lists(st.sampled_from(["scores", "scaled", "weights", "context"]), unique=True))
    rows = draw(st.lists(st.integers(0, length - 1), unique=True, min_size=1))

    def show(values: np.ndarray) -> tuple[np.ndarray, list[list[str]]]:
        texts = [[f"{x:.{decimals}f}" for x in values[t]] for t in rows]
        if carried:
            values = values.copy()
            for t, row in zip(rows, texts, strict=True):
                values[t] = [float(x) for x in row]
        return values, texts

    per_head: list[dict[str, list[list[str]]]] = []
    contexts = []
    for h in range(2):
        claims: dict[str, list[list[str]]] = {}
        s = q[:, h * d_k : (h + 1) * d_k] @ k[:, h * d_k : (h + 1) * d_k].T
        if "scores" in steps:
            s, claims["scores"] = show(s)
        s = s / np.sqrt(d_k)
        if "scaled" in steps:
            s, claims["scaled"] = show(s)
        if allowed is not None:
            s = np.where(allowed, s, -np.inf)
        w = masked_softmax(s)
        if "weights" in steps:
            w, claims["weights"] = show(w)
        c = w @ v[:, h * d_v : (h + 1) * d_v]
        if "context" in steps:
            c, claims["context"] = show(c)
        per_head.append(claims)
        contexts.append(c)
    _, all_context = show(np.concatenate(contexts, axis=1))
    lines = [
        "format: 2",
        f"inputs: {{Q: {q.tolist()}, K: {k.tolist()}, V: {v.tolist()}}}",
        "heads: 2",
        f"options: {{causal: {str(causal).lower()}}}",
        "claimed:",
        f"  context: {{{_rows(rows, all_context)}}}",
        "  per_head:",
    ]
    for claims in per_head:
        if not claims:
            lines.append("    - {}")
            continue
        first = True
        for step, texts in claims.items():
            lines.append(f"    {'- ' if first else '  '}{step}: {{{_rows(rows, texts)}}}")
            first = False
    return "\n".join(lines) + "\n"


def _rows(rows: list[int], texts: list[list[str]]) -> str:
    return ", ".join(f"{t}: [{', '.join(r)}]" for t, r in zip(rows, texts, strict=True))


@settings(max_examples=80, deadline=None)
@given(two_head_examples())
def test_correct_two_head_examples_give_no_finding(text: str) -> None:
    report = check(loads(text))
    problems = [(f.step, f.head, f.token, f.printed) for f in report.findings if f.status != "ok"]
    assert not problems, text + report.text()
