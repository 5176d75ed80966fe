"""Properties of ``qkv check``: correct examples printed at 2 to 4 decimals give no finding,
and a number a few units off in its last digit is always caught.

The "author" here is written with NumPy, independently of the checker: it computes every step,
prints the claimed rows at random precisions, and (in the "carried" mode) computes each later
step from the numbers it printed, as a person working by hand does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.check import check
from qkv.examples import loads

STEPS = ("Q", "K", "V", "scores", "scaled", "weights", "context", "output")


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    out: np.ndarray = e / e.sum(axis=-1, keepdims=True)
    return out


@dataclass
class Worked:
    yaml: str
    printed: dict[str, dict[int, list[str]]]


@st.composite
def worked_examples(draw: st.DrawFn) -> Worked:
    """A correct single-head example with some rows claimed at 2 to 4 decimals."""
    length = draw(st.integers(2, 5))
    d_model, d_k, d_v = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    one_decimal = draw(st.booleans())  # tutorial-style inputs like 0.4, or any real numbers

    def matrix(*shape: int) -> np.ndarray:
        if one_decimal:
            return np.round(rng.uniform(-1, 1, shape), 1)
        return rng.normal(size=shape)

    x = matrix(length, d_model)
    w_q, w_k, w_v = matrix(d_model, d_k), matrix(d_model, d_k), matrix(d_model, d_v)
    w_o = matrix(d_v, draw(st.integers(1, 3))) if draw(st.booleans()) else None
    scale = draw(st.sampled_from(["true", "false", "0.5"]))
    factor = {"true": 1 / np.sqrt(d_k), "false": 1.0, "0.5": 0.5}[scale]
    causal = draw(st.booleans())
    carried = draw(st.booleans())
    steps = draw(st.lists(st.sampled_from(STEPS), unique=True, min_size=1))
    claims = {
        step: draw(st.lists(st.integers(0, length - 1), unique=True, min_size=1)) for step in steps
    }
    per_number = draw(st.booleans())
    precisions = draw(st.lists(st.integers(2, 4), min_size=64, max_size=64))
    printed: dict[str, dict[int, list[str]]] = {}
    counter = iter(range(10**6))

    def show(step: str, values: np.ndarray) -> np.ndarray:
        values = values.copy()
        for t in claims.get(step, []):
            row_decimals = precisions[next(counter) % 64]
            texts = []
            for v in values[t]:
                decimals = precisions[next(counter) % 64] if per_number else row_decimals
                texts.append(f"{v:.{decimals}f}")
            printed.setdefault(step, {})[t] = texts
            if carried:
                values[t] = [float(text) for text in texts]
        return values

    q, k, v = show("Q", x @ w_q), show("K", x @ w_k), show("V", x @ w_v)
    scores = show("scores", q @ k.T)
    scaled = show("scaled", scores * factor)
    if causal:
        scaled = np.where(np.tril(np.ones((length, length), dtype=bool)), scaled, -np.inf)
    weights = show("weights", softmax(scaled))
    context = show("context", weights @ v)
    show("output", context @ w_o if w_o is not None else context)

    lines = [
        f"tokens: [{', '.join(f't{i}' for i in range(length))}]",
        f"embeddings: {x.tolist()}",
        f"weights: {{W_q: {w_q.tolist()}, W_k: {w_k.tolist()}, W_v: {w_v.tolist()}"
        + (f", W_o: {w_o.tolist()}}}" if w_o is not None else "}"),
        f"options: {{scale: {scale}, causal: {str(causal).lower()}}}",
        "claimed:",
    ]
    for step, rows in printed.items():
        lines.append(f"  {step}:")
        lines += [f"    {t}: [{', '.join(texts)}]" for t, texts in rows.items()]
    return Worked("\n".join(lines) + "\n", printed)


@settings(max_examples=120)
@given(worked_examples())
def test_correct_examples_at_mixed_precision_give_no_finding(worked: Worked) -> None:
    report = check(loads(worked.yaml))
    assert report.ok
    problems = [
        (f.step, f.token, f.printed, f.expected) for f in report.findings if f.status != "ok"
    ]
    assert not problems, worked.yaml


@settings(max_examples=60)
@given(worked_examples(), st.integers(3, 9), st.booleans(), st.data())
def test_a_number_off_by_a_few_units_is_caught(
    worked: Worked, units: int, up: bool, data: st.DataObject
) -> None:
    """In the first claimed step nothing is carried: 3 units of the last digit is a mistake."""
    step = next(s for s in STEPS if s in worked.printed)
    t = data.draw(st.sampled_from(sorted(worked.printed[step])))
    i = data.draw(st.integers(0, len(worked.printed[step][t]) - 1))
    old = worked.printed[step][t][i]
    decimals = len(old.split(".")[1])
    new = f"{float(old) + (1 if up else -1) * units * 10.0**-decimals:.{decimals}f}"
    row = f"    {t}: [{', '.join(worked.printed[step][t])}]"
    changed = list(worked.printed[step][t])
    changed[i] = new
    header = f"  {step}:\n"
    start = worked.yaml.index(header)
    at = worked.yaml.index(row, start)
    text = worked.yaml[:at] + f"    {t}: [{', '.join(changed)}]" + worked.yaml[at + len(row) :]
    report = check(loads(text))
    assert not report.ok
    finding = next(f for f in report.findings if (f.step, f.position) == (step, t))
    assert finding.status == "mismatch"
    assert finding.marks[i] == "wrong"
