"""``qkv explain --decode`` (issue 14, item 5): one decoding step with a KV cache on a worked
example, equal to the last row of the full causal pass, in text, Markdown and JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from qkv import examples
from qkv.cli import main

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(autouse=True)
def _plain_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """rich reads the width and colour from the environment: make both the defaults."""
    for name in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def _expected(example: examples.Example, position: int) -> tuple[np.ndarray, np.ndarray]:
    """The last row of the full causal pass over tokens 0..position, in float64, by hand:
    (H, position + 1) weights and (H, Dv) context vectors."""
    x = example.embeddings[: position + 1].astype(np.float64)
    heads = example.heads
    q, k, v = (
        (x @ w).reshape(position + 1, heads, -1).transpose(1, 0, 2)
        for w in (example.W_q, example.W_k, example.W_v)
    )
    scores = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1])  # (H, p+1, p+1)
    scores = np.where(np.tril(np.ones((position + 1, position + 1), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return weights[:, -1], (weights @ v)[:, -1]


@pytest.mark.parametrize("name", examples.builtin_names())
def test_json_step_equals_the_last_row_of_the_full_causal_pass(
    capsys: pytest.CaptureFixture[str], name: str
) -> None:
    example = examples.builtin(name)
    for position in range(len(example.tokens)):
        status, out, err = run_main(
            capsys, "explain", "--decode", "-e", name, "-q", str(position), "-f", "json"
        )
        assert status == 0, err
        data = json.loads(out)
        assert data["alignment"] == "bottom-right"
        assert data["tokens"] == list(example.tokens[: position + 1])
        weights, context = _expected(example, position)
        for h, head in enumerate(data["heads"]):
            assert len(head["keys"]) == len(head["values"]) == position + 1  # cache + new row
            np.testing.assert_allclose(head["weights"], weights[h], rtol=0, atol=1e-12)
            np.testing.assert_allclose(head["context"], context[h], rtol=0, atol=1e-12)
            np.testing.assert_allclose(head["full_pass_weights"], weights[h], atol=1e-12)
        assert data["max_difference"]["weights"] < 1e-12


def test_step_equals_what_plain_explain_causal_computes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The decoding step's weights are the last row of `qkv explain --causal`'s weights."""
    status, out, _ = run_main(
        capsys, "explain", "--decode", "-e", "the-cat-sat-on-the-mat", "-f", "json"
    )
    assert status == 0
    step = json.loads(out)["heads"][0]
    status, out, _ = run_main(
        capsys, "explain", "--causal", "-e", "the-cat-sat-on-the-mat", "-f", "json"
    )
    assert status == 0
    trace = json.loads(out)
    (weights,) = [s for s in trace["steps"] if s["name"] == "weights"]
    full = np.reshape(weights["value"], weights["shape"])  # (L, L), flat in the file
    np.testing.assert_allclose(step["weights"], full[-1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", examples.builtin_names())
@pytest.mark.parametrize("fmt", ["text", "markdown"])
def test_text_and_markdown_fit_80_columns_and_show_the_cache(
    capsys: pytest.CaptureFixture[str], name: str, fmt: str
) -> None:
    status, out, err = run_main(capsys, "explain", "--decode", "-e", name, "-f", fmt)
    assert status == 0, err
    assert max(len(line) for line in out.splitlines()) <= 80, out
    example = examples.builtin(name)
    new = example.tokens[-1]
    assert "KV cache" in out and "Bottom-right alignment" in out
    assert f"{len(example.tokens) - 1} (new)" in out  # the new token's row of the cache
    assert f"c_{new} = " in out and "decoding step − full pass" in out


def test_docs_show_the_real_output(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/explain.md shows `qkv explain --decode` and exactly what it prints."""
    page = (DOCS / "explain.md").read_text(encoding="utf-8")
    assert "```sh\nqkv explain --decode\n```" in page
    status, out, _ = run_main(capsys, "explain", "--decode")
    assert status == 0
    assert f"```text\n{out.rstrip()}\n```" in page


def test_help_has_a_decode_example(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_main(capsys, "explain", "--help")
    assert status == 0
    assert "  qkv explain --decode\n" in out and "--decode " in out


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--format", "latex"], ["--format latex", "text, markdown, json", "Hint:"]),
        (["--causal"], ["--causal cannot be used with --decode", "Hint:"]),
        (["--trace", "t.json"], ["--trace cannot be used with --decode"]),
        (["--query", "5"], ["--query 5", "from 0 to 2", "Hint:"]),
        (["--query", "cat"], ["--query", "cat", "Hint:"]),
        (["-e", "two-heads", "--heads", "3"], ["--heads", "3 heads must divide", "Hint:"]),
    ],
)
def test_user_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], fragments: list[str]
) -> None:
    status, out, err = run_main(capsys, "explain", "--decode", *argv)
    assert status == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("qkv: error: "), err
    for fragment in fragments:
        assert fragment in lines[0]


def test_output_file_and_no_scale(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "step.md"
    status, _, err = run_main(
        capsys, "explain", "--decode", "--no-scale", "-f", "markdown", "-o", str(path)
    )
    assert status == 0, err
    text = path.read_text(encoding="utf-8")
    assert text.startswith("## One decoding step with a KV cache: I love statistics")
    assert "scores times 1.0000" in text
