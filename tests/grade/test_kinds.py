"""The other kinds of a class: causal, multi-head and batched functions, and worked examples
on the inputs everyone had to use (``--inputs``); every row of grades.csv asserted, and the
codes these classes cover together with the attention class (test_class.py): every slip code
of ``qkv check --function``."""

from __future__ import annotations

import csv
import textwrap
from pathlib import Path

import numpy as np
import pytest

from qkv.check import FUNCTION_DIAGNOSES
from qkv.cli import main
from tests.check.test_function_codes import NEW_SLIPS
from tests.grade.class_maker import attention_rows
from tests.grade.test_real_class import GRADED_CODES


def _grade(tmp_path: Path, files: dict[str, str], *options: str) -> dict[str, list[str]]:
    folder = tmp_path / "submissions"
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(textwrap.dedent(text), encoding="utf-8")
    out = tmp_path / "out"
    assert main(["grade", str(folder), "-o", str(out), "--jobs", "2", *options]) == 0
    with (out / "grades.csv").open(newline="", encoding="utf-8") as handle:
        return {r[0]: r[1:] for r in list(csv.reader(handle))[1:]}


_SOFTMAX = """
import numpy as np
def softmax(s, axis=-1):
    e = np.exp(s - s.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)
"""

CAUSAL = {
    "right.py": _SOFTMAX
    + """
def attention(Q, K, V):
    s = Q @ K.T / np.sqrt(Q.shape[-1])
    allow = np.tril(np.ones(s.shape, dtype=bool))
    return softmax(np.where(allow, s, -np.inf)) @ V
""",
    "misaligned.py": _SOFTMAX
    + """
def attention(Q, K, V):
    s = Q @ K.T / np.sqrt(Q.shape[-1])
    allow = np.tril(np.ones(s.shape, dtype=bool), k=s.shape[1] - s.shape[0])
    return softmax(np.where(allow, s, -np.inf)) @ V
""",
    "no_rule.py": _SOFTMAX
    + """
def attention(Q, K, V):
    return softmax(Q @ K.T / np.sqrt(Q.shape[-1])) @ V
""",
    "unscaled.py": _SOFTMAX
    + """
def attention(Q, K, V):
    s = Q @ K.T
    return softmax(np.where(np.tril(np.ones(s.shape, dtype=bool)), s, -np.inf)) @ V
""",
}

MULTI_HEAD = {
    "right.py": _SOFTMAX
    + """
def attention(X, W_q, W_k, W_v, W_o, num_heads):
    q, k, v = X @ W_q, X @ W_k, X @ W_v
    d = q.shape[1] // num_heads
    heads = [softmax(q[:, i*d:(i+1)*d] @ k[:, i*d:(i+1)*d].T / np.sqrt(d)) @ v[:, i*d:(i+1)*d]
             for i in range(num_heads)]
    return np.concatenate(heads, axis=-1) @ W_o
""",
    "by_dmodel.py": _SOFTMAX
    + """
def attention(X, W_q, W_k, W_v, W_o, num_heads):
    q, k, v = X @ W_q, X @ W_k, X @ W_v
    d = q.shape[1] // num_heads
    heads = [softmax(q[:, i*d:(i+1)*d] @ k[:, i*d:(i+1)*d].T / np.sqrt(X.shape[1]))
             @ v[:, i*d:(i+1)*d] for i in range(num_heads)]
    return np.concatenate(heads, axis=-1) @ W_o
""",
    "averaged.py": _SOFTMAX
    + """
def attention(X, W_q, W_k, W_v, W_o, num_heads):
    q, k, v = X @ W_q, X @ W_k, X @ W_v
    d = q.shape[1] // num_heads
    w = sum(softmax(q[:, i*d:(i+1)*d] @ k[:, i*d:(i+1)*d].T / np.sqrt(d))
            for i in range(num_heads)) / num_heads
    return (w @ v) @ W_o
""",
    "transposed.py": _SOFTMAX
    + """
def attention(X, W_q, W_k, W_v, W_o, num_heads):
    q, k, v = X @ W_q.T, X @ W_k.T, X @ W_v.T
    d = q.shape[1] // num_heads
    heads = [softmax(q[:, i*d:(i+1)*d] @ k[:, i*d:(i+1)*d].T / np.sqrt(d)) @ v[:, i*d:(i+1)*d]
             for i in range(num_heads)]
    return np.concatenate(heads, axis=-1) @ W_o.T
""",
}

BATCHED = {
    "right.py": _SOFTMAX
    + """
def attention(Q, K, V):
    return softmax(Q @ K.swapaxes(-1, -2) / np.sqrt(Q.shape[-1])) @ V
""",
    "unbatched.py": _SOFTMAX
    + """
def attention(Q, K, V):
    return softmax(Q @ K.T / np.sqrt(Q.shape[-1])) @ V
""",
}


@pytest.mark.slow
def test_causal_multi_head_and_batched_classes(tmp_path: Path) -> None:
    causal = _grade(tmp_path / "causal", CAUSAL, "--kind", "causal")
    assert causal == {
        "right": ["5", "5", "ok", "", ""],
        "misaligned": ["4", "5", "slip", "causal-misaligned", "causal-misaligned"],
        "no_rule": ["4", "5", "slip", "mask-ignored", "mask-ignored"],
        "unscaled": ["4", "5", "slip", "unscaled", "unscaled"],
    }
    heads = _grade(tmp_path / "heads", MULTI_HEAD, "--kind", "multi-head")
    assert heads == {
        "right": ["6", "6", "ok", "", ""],
        "by_dmodel": ["5", "6", "slip", "scaled-by-dmodel", "scaled-by-dmodel"],
        "averaged": ["5", "6", "slip", "heads-averaged", "heads-averaged"],
        "transposed": ["5", "6", "slip", "transposed-weights", "transposed-weights"],
    }
    # an assignment without a mask says so in its rubric (docs/grading.md)
    no_mask = tmp_path / "no-mask.yaml"
    no_mask.write_text("points:\n  mask: 0\n", encoding="utf-8")
    batched = _grade(tmp_path / "batched", BATCHED, "--batched", "--rubric", str(no_mask))
    assert batched == {
        "right": ["5", "5", "ok", "", ""],
        "unbatched": ["4", "5", "slip", "unbatched", "unbatched"],
    }
    covered = {
        code for row in attention_rows(tmp_path / "x").values() for code in row[4].split(";")
    }
    for table in (causal, heads, batched):
        covered |= {code for row in table.values() for code in row[4].split(";")}
    # the codes qkv check gained with issue 26 are graded in test_new_codes.py
    # and those of issue 35 in test_real_class.py
    newer = {code for _, _, code, _ in NEW_SLIPS} | GRADED_CODES
    assert covered - {""} == set(FUNCTION_DIAGNOSES) - (newer - covered)


INPUTS = """\
name: I love statistics
tokens: [I, love, statistics]
embeddings: [[0.2, 0.5, 0.7], [0.4, 0.8, 0.6], [0.1, 0.6, 0.9]]
weights:
  W_q: [[0.1, 0.3], [0.2, 0.4], [0.5, 0.6]]
  W_k: [[0.6, 0.2], [0.3, 0.5], [0.7, 0.9]]
  W_v: [[0.5, 0.8], [0.2, 0.3], [0.4, 0.6]]
options: {queries: [love]}
"""


def _row(values: np.ndarray) -> str:
    return "[" + ", ".join(f"{x:.4f}" for x in values) + "]"


def _swap_digits(x: float) -> str:
    """0.8193 → 0.8913: two neighbouring digits swapped."""
    text = f"{x:.4f}"
    return text[:3] + text[4] + text[3] + text[5:]


def _claims() -> dict[str, str]:
    x = np.array([[0.2, 0.5, 0.7], [0.4, 0.8, 0.6], [0.1, 0.6, 0.9]])
    q = x @ np.array([[0.1, 0.3], [0.2, 0.4], [0.5, 0.6]])
    k = x @ np.array([[0.6, 0.2], [0.3, 0.5], [0.7, 0.9]])
    v = x @ np.array([[0.5, 0.8], [0.2, 0.3], [0.4, 0.6]])

    def softmax(s: np.ndarray) -> np.ndarray:
        e = np.exp(s - s.max())
        return np.asarray(e / e.sum())

    scores = k @ q[1]
    right_w = softmax(scores / np.sqrt(2))
    unscaled_w = softmax(scores)
    wrong_scores = scores + np.array([0.05, 0.1, -0.07])
    wrong_w = softmax(wrong_scores / np.sqrt(2))
    context = right_w @ v
    return {
        "right.yaml": f"""claimed:
  Q: {{love: {_row(q[1])}}}
  scores: {{love: {_row(scores)}}}
  weights: {{love: {_row(right_w)}}}
  context: {{love: {_row(context)}}}
""",
        "unscaled.yaml": f"""claimed:
  scores: {{love: {_row(scores)}}}
  weights: {{love: {_row(unscaled_w)}}}
  context: {{love: {_row(unscaled_w @ v)}}}
""",
        "arithmetic_then_right.yaml": f"""claimed:
  scores: {{love: {_row(wrong_scores)}}}
  weights: {{love: {_row(wrong_w)}}}
  context: {{love: {_row(wrong_w @ v)}}}
""",
        "digit_slip.yaml": f"""claimed:
  weights: {{love: {_row(right_w)}}}
  context: {{love: [{context[0]:.4f}, {_swap_digits(context[1])}]}}
""",
        "not_summed.yaml": "claimed:\n  context: {"
        + ", ".join(
            f"{t}: {_row(right_w[j] * v[j])}" for j, t in enumerate(["I", "love", "statistics"])
        )
        + "}\n",
        "weights_only.yaml": f"claimed:\n  weights: {{love: {_row(right_w)}}}\n",
        "broken_yaml.yaml": "claimed:\n  weights: {love: [0.3, 0.3\n",
        "wrong_key.yaml": "claimed:\n  softmax: {love: [0.3, 0.3, 0.4]}\n",
        "other_inputs.yaml": INPUTS.replace("[0.2, 0.5, 0.7]", "[0.3, 0.5, 0.7]")
        + f"claimed:\n  weights: {{love: {_row(right_w)}}}\n",
        "full_example.yaml": INPUTS + f"claimed:\n  weights: {{love: {_row(right_w)}}}\n"
        f"  context: {{love: {_row(context)}}}\n",
    }


def test_worked_examples_on_the_inputs_everyone_used(tmp_path: Path) -> None:
    inputs = tmp_path / "inputs.yaml"
    inputs.write_text(INPUTS)
    rows = _grade(tmp_path, _claims(), "--kind", "example", "--inputs", str(inputs))
    assert rows == {
        "right": ["5", "5", "ok", "", ""],
        "unscaled": ["4", "5", "slip", "unscaled", "unscaled"],
        "arithmetic_then_right": ["4", "5", "slip", "arithmetic", "arithmetic"],
        "digit_slip": ["4", "5", "slip", "digit-slip", "digit-slip"],
        "not_summed": ["4", "5", "slip", "context-not-summed", "context-not-summed"],
        "weights_only": ["4", "5", "ok", "", ""],
        "broken_yaml": ["0", "5", "error", "", ""],
        "wrong_key": ["0", "5", "error", "", ""],
        "other_inputs": ["0", "5", "error", "", ""],
        "full_example": ["5", "5", "ok", "", ""],
    }
    feedback = (tmp_path / "out" / "wrong_key.md").read_text()
    assert "wrong_key.yaml, line 2: claimed.softmax: unknown key 'softmax'" in feedback
    assert "did you mean 'weights'?" in feedback
    follow = (tmp_path / "out" / "arithmetic_then_right.json").read_text()
    assert "follow-through credit" in follow
    page = (tmp_path / "out" / "class.html").read_text()
    assert "The class's numbers beside the correct ones" in page
    # the weights of "love": the correct row, and what the class wrote, with how many wrote it
    assert "<td>weights</td><td>love</td><td>0.3046, 0.3387, 0.3567</td>" in page
    assert "0.3046, 0.3387, 0.3567 (4)" in page
