"""Format 2 of the worked-example file: direct inputs, masks, intermediates, heads, precision.

The documented examples of docs/example-format.md (section "Format 2") are loaded and checked
here: each must load and get no finding from ``qkv check``.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from qkv.check import check
from qkv.examples import ExampleError, loads, run

DOC = Path(__file__).resolve().parents[2] / "docs" / "example-format.md"


def _format2_blocks() -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## Format 2") :]
    return re.findall(r"```yaml\n(.*?)```", section, re.S)


def test_the_doc_has_an_example_of_each_feature() -> None:
    blocks = "\n".join(_format2_blocks())
    for feature in (
        "inputs:",
        "query_tokens:",
        "causal: true",
        "key_length:",
        "mask:",
        "-inf",
        "−∞",
        "-1e9",
        "exp:",
        "exp_sum:",
        "products:",
        "per_head:",
        "assumed:",
        "precision:",
        "dtype: float32",
        "tiled:",
    ):
        assert feature in blocks, feature


@pytest.mark.parametrize("k", range(10))
def test_documented_format2_examples_load_and_check_clean(k: int) -> None:
    blocks = _format2_blocks()
    assert len(blocks) == 10
    example = loads(blocks[k])
    assert example.format == 2
    report = check(example)
    assert report.findings and report.ok
    assert all(f.status == "ok" for f in report.findings), report.text()


def test_direct_inputs() -> None:
    ex = loads("format: 2\ninputs: {Q: [[1, 0]], K: [[1, 0], [0, 1]], V: [[1], [2]]}")
    assert ex.inputs == "qkv" and ex.tokens == ("t1", "t2") and ex.query_tokens == ("q1",)
    np.testing.assert_array_equal(ex.given["K"], [[1, 0], [0, 1]])
    assert loads("format: 2\ninputs: {Q: [[1]], K: [[1]]}").inputs == "qk"
    scores = loads("format: 2\ninputs: {scores: [[1, 2]]}\noptions: {d_k: 4}")
    assert scores.inputs == "scores" and scores.d_k == 4


def test_version_1_files_load_as_before() -> None:
    ex = loads("tokens: [a]\nembeddings: [[1]]\nweights: {W_q: [[1]], W_k: [[1]], W_v: [[1]]}")
    assert ex.format == 1 and ex.inputs == "embeddings" and not ex.given


def test_run_refuses_direct_inputs_with_a_clear_message() -> None:
    ex = loads("format: 2\ninputs: {Q: [[1]], K: [[1]]}")
    with pytest.raises(ValueError, match="gives Q and K directly, without V"):
        run(ex)


def test_masks_combine() -> None:
    ex = loads(
        "format: 2\ninputs: {Q: [[1], [1]], K: [[1], [1], [1]]}\n"
        "options: {causal: bottom-right, key_length: 2, mask: [[1, 1, 1], [0, 1, 1]]}"
    )
    assert ex.alignment == "bottom-right" and ex.key_length == 2
    from qkv.check._pipeline import Setup

    np.testing.assert_array_equal(
        Setup.of(ex).allowed(), [[True, True, False], [False, True, False]]
    )


def test_masked_scores_in_every_spelling() -> None:
    ex = loads(
        "format: 2\ninputs: {Q: [[1]], K: [[1], [1], [1], [1], [1]]}\n"
        "claimed: {scores: {q1: [1, -inf, -.inf, −∞, -1e9]}}"
    )
    values = ex.claimed["scores"][0].values
    assert values[:4] == (1.0, -np.inf, -np.inf, -np.inf) and values[4] == -1e9
    assert ex.claimed["scores"][0].texts == ("1", "-inf", "-.inf", "−∞", "-1e9")


# Each mistake names the line, the field and a fix.
BAD = [
    ("format: 2\ninputs: {Q: [[1]], V: [[1]]}", "inputs", "expected Q, K and V"),
    ("format: 2\ninputs: {Q: [[1, 2]], K: [[1]]}", "inputs.K", "expected 2 columns"),
    ("format: 2\ninputs: {Q: [[1]], K: [[1]], V: [[1], [2]]}", "inputs.V", "expected 1 rows"),
    (
        "format: 2\ninputs: {Q: [[1]], K: [[1]]}\nembeddings: [[1]]",
        "embeddings",
        "cannot be given together",
    ),
    ("format: 2\ninputs: {scores: [[1]]}", "options.d_k", "no d_k"),
    ("format: 2\ninputs: {Q: [[1]], K: [[1]]}\ntokens: [a, b]", "tokens", "expected 1 tokens"),
    (
        "format: 2\ninputs: {Q: [[1]], K: [[1]]}\noptions: {causal: sideways}",
        "options.causal",
        "top-left or bottom-right",
    ),
    (
        "format: 2\ninputs: {Q: [[1]], K: [[1]]}\noptions: {mask: [[2]]}",
        "options.mask",
        "only 0 and 1",
    ),
    (
        "format: 2\ninputs: {Q: [[1]], K: [[1]]}\noptions: {key_length: 2}",
        "options.key_length",
        "at most 1",
    ),
    (
        "format: 2\ninputs: {Q: [[1]], K: [[1]]}\nclaimed: {context: {q1: [1]}}",
        "claimed.context",
        "no value vectors",
    ),
    (
        "format: 2\ninputs: {Q: [[1, 1]], K: [[1, 1]], V: [[1, 1]]}\nheads: 2\n"
        "claimed: {weights: {t1: [1]}}",
        "claimed.weights",
        "per_head",
    ),
    (
        "format: 2\ninputs: {Q: [[1, 1]], K: [[1, 1]], V: [[1, 1]]}\nheads: 2\n"
        "claimed: {per_head: [{}, {}, {}]}",
        "claimed.per_head",
        "expected 2 mappings, one per head",
    ),
    (
        "format: 2\ninputs: {Q: [[1]], K: [[1]]}\nclaimed: {weights: {t1: [-inf]}}",
        "claimed.weights.t1[0]",
        "expected a number",
    ),
    (
        "format: 2\ninputs: {Q: [[1]], K: [[1]]}\nprecision: {embeddings: 2}",
        "precision.embeddings",
        "has no embeddings",
    ),
    ("inputs: {Q: [[1]], K: [[1]]}", "inputs", "format 2"),
]


@pytest.mark.parametrize(("text", "field", "problem"), BAD)
def test_format2_errors_name_the_field(text: str, field: str, problem: str) -> None:
    with pytest.raises(ExampleError) as caught:
        loads(text)
    assert caught.value.field == field
    assert problem in str(caught.value)
    assert caught.value.line is not None


def test_masks_of_an_embeddings_example_reach_the_reference_core() -> None:
    """qkv explain (examples.run) and qkv check compute the same masked weights."""
    from qkv.check._pipeline import Setup, forward

    ex = loads(
        "format: 2\ntokens: [a, b, c]\nembeddings: [[1, 0], [0, 1], [1, 1]]\n"
        "weights: {W_q: [[1, 0], [0, 1]], W_k: [[1, 0], [0, 1]], W_v: [[1, 0], [0, 1]]}\n"
        "options: {causal: true, key_length: 2, mask: [[1, 1, 1], [0, 1, 1], [1, 1, 1]]}"
    )
    core = run(ex)["weights"].select()
    np.testing.assert_allclose(forward(Setup.of(ex))["weights"][0], core, atol=1e-12)
    np.testing.assert_array_equal(core[1], [0.0, 1.0, 0.0])


def test_unnamed_tokens_of_an_embeddings_example() -> None:
    ex = loads(
        "format: 2\nembeddings: [[1, 0], [0, 1]]\n"
        "weights: {W_q: [[1], [0]], W_k: [[1], [1]], W_v: [[1], [2]]}\n"
        "claimed: {V: {t2: [2]}, weights: {0: [0.5, 0.5]}}"
    )
    assert ex.tokens == ("t1", "t2") and ex.query_tokens is None
    assert check(ex).ok
