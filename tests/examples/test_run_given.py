"""``qkv.examples.run`` on an example that gives Q, K and V directly (format 2, issues 15/18).

Every number is compared with softmax(Q·Kᵀ·scale, masked)·V computed here in float64 NumPy,
head by head; the trace must hold the steps and axes an embeddings example records from Q on,
so ``qkv explain``, ``--html`` and ``--practice`` show such a file as they show any other.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qkv import examples
from qkv.check._pipeline import correct_values
from qkv.cli import main
from qkv.examples import ExampleError, builtin, loads, run
from tests.support.given import QKV_GIVEN


def _file(
    Q: np.ndarray,
    K: np.ndarray,
    V: np.ndarray,
    *,
    heads: int = 1,
    options: dict[str, Any] | None = None,
    W_o: np.ndarray | None = None,
    tokens: list[str] | None = None,
    query_tokens: list[str] | None = None,
) -> str:
    """A format-2 file (JSON is YAML); floats are written with all their digits."""
    data: dict[str, Any] = {
        "format": 2,
        "name": "given",
        "heads": heads,
        "inputs": {"Q": Q.tolist(), "K": K.tolist(), "V": V.tolist()},
    }
    if options:
        data["options"] = options
    if W_o is not None:
        data["weights"] = {"W_o": W_o.tolist()}
    if tokens is not None:
        data["tokens"] = tokens
    if query_tokens is not None:
        data["query_tokens"] = query_tokens
    return json.dumps(data)


def _allowed(lq: int, lk: int, causal: Any, key_length: int | None, mask: Any) -> np.ndarray:
    allowed = np.ones((lq, lk), dtype=bool)
    if causal:
        shift = lk - lq if causal == "bottom-right" else 0
        allowed &= np.arange(lk)[None, :] <= np.arange(lq)[:, None] + shift
    if key_length is not None:
        allowed[:, key_length:] = False
    if mask is not None:
        allowed &= np.asarray(mask, dtype=bool)
    return allowed


def _expected(
    Q: np.ndarray, K: np.ndarray, V: np.ndarray, heads: int, factor: float, allowed: np.ndarray
) -> dict[str, np.ndarray]:
    """Head by head, in float64: scores, scaled, weights (H, Lq, Lk), context (H, Lq, Dv)."""
    found: dict[str, list[np.ndarray]] = {"scores": [], "scaled": [], "weights": [], "context": []}
    d, dv = Q.shape[1] // heads, V.shape[1] // heads
    for h in range(heads):
        q, k, v = Q[:, h * d : (h + 1) * d], K[:, h * d : (h + 1) * d], V[:, h * dv : (h + 1) * dv]
        scores = q @ k.T
        scaled = scores * factor
        masked = np.where(allowed, scaled, -np.inf)
        top = np.max(masked, axis=1, keepdims=True)
        top = np.where(np.isfinite(top), top, 0.0)
        e = np.where(allowed, np.exp(masked - top), 0.0)
        total = e.sum(axis=1, keepdims=True)
        weights = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
        for name, value in zip(found, (scores, scaled, weights, weights @ v), strict=True):
            found[name].append(value)
    return {name: np.stack(values) for name, values in found.items()}


def _heads_first(trace: Any, name: str) -> np.ndarray:
    value = np.asarray(trace[name].value, dtype=np.float64)
    return value[None] if trace[name].axes[0] != "head" else value


def test_one_head_gives_the_numbers_of_docs_example() -> None:
    trace = run(loads(QKV_GIVEN))
    np.testing.assert_allclose(trace["weights"].value[2], [0.2483, 0.2483, 0.5035], atol=5e-5)
    np.testing.assert_allclose(trace["context"].value[2], [3.5105, 4.5105], atol=5e-5)
    assert trace.tokens == ["the", "cat", "sat"] and trace.query_tokens is None
    assert trace.meta["d_k"] == 2 and trace.meta["num_heads"] == 1


def test_steps_and_axes_are_those_of_an_embeddings_example_from_q_on() -> None:
    """The same Q, K, V as the built-in two-heads example (X·W), given directly."""
    ex = builtin("two-heads")
    Q, K, V = (ex.embeddings @ w for w in (ex.W_q, ex.W_k, ex.W_v))
    given = loads(_file(Q, K, V, heads=2, W_o=ex.W_o, tokens=list(ex.tokens)))
    made, mine = run(ex), run(given)
    projections = ("embeddings", "W_q", "W_k", "W_v")
    assert [s.name for s in made.steps if s.name not in projections] == mine.names
    for step in mine.steps:
        assert step.axes == made[step.name].axes, step.name
        np.testing.assert_allclose(step.value, made[step.name].value, rtol=0, atol=1e-14)
    assert mine["Q"].formula == "Q, split into 2 heads"
    for key in ("num_heads", "d_k", "d_v", "scale", "scale_mode", "causal"):
        assert mine.meta[key] == made.meta[key], key


@pytest.mark.parametrize(
    ("heads", "lq", "lk", "options"),
    [
        (1, 4, 4, {}),
        (2, 4, 4, {}),
        (2, 5, 5, {"causal": True}),
        (1, 3, 3, {"scale": False, "key_length": 2}),
        (2, 2, 5, {"causal": "bottom-right"}),
        (2, 3, 5, {"causal": True}),  # top-left with Lq < Lk: PyTorch's is_causal
        (1, 4, 3, {"scale": 0.25, "mask": [[1, 0, 1], [1, 1, 0], [0, 1, 1], [0, 0, 1]]}),
        (3, 2, 4, {"causal": "bottom-right", "key_length": 3}),
    ],
)
def test_numbers_equal_a_float64_numpy_computation_head_by_head(
    heads: int, lq: int, lk: int, options: dict[str, Any]
) -> None:
    rng = np.random.default_rng(heads * 100 + lq * 10 + lk)
    d, dv = 2, 3
    Q = rng.normal(size=(lq, heads * d))
    K = rng.normal(size=(lk, heads * d))
    V = rng.normal(size=(lk, heads * dv))
    W_o = rng.normal(size=(heads * dv, 2))
    trace = run(loads(_file(Q, K, V, heads=heads, options=options, W_o=W_o)))
    scale = options.get("scale", True)
    factor = 1 / math.sqrt(d) if scale is True else 1.0 if scale is False else float(scale)
    allowed = _allowed(
        lq, lk, options.get("causal"), options.get("key_length"), options.get("mask")
    )
    want = _expected(Q, K, V, heads, factor, allowed)
    for name, value in want.items():
        np.testing.assert_allclose(_heads_first(trace, name), value, rtol=1e-12, atol=1e-14)
    concat = np.concatenate(list(want["context"]), axis=1)  # (Lq, H·Dv), head 1 first
    np.testing.assert_allclose(trace["concat"].value, concat, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(trace["output"].value, concat @ W_o, rtol=1e-12, atol=1e-14)
    assert ("masked" in trace) == bool(
        options.get("causal") or "key_length" in options or "mask" in options
    )
    assert trace.meta["causal_alignment"] == (
        "bottom-right" if options.get("causal") == "bottom-right" else "top-left"
    )
    if lq != lk:
        assert trace.tokens == [f"t{i + 1}" for i in range(lk)]
        assert trace.query_tokens == [f"q{i + 1}" for i in range(lq)]


def test_one_head_without_w_o_records_no_concat() -> None:
    trace = run(loads(QKV_GIVEN))
    assert trace.names == ["Q", "K", "V", "scores", "scaled", "weights", "context"]
    assert trace["Q"].axes == ("query", "dim") and trace["K"].axes == ("key", "dim")


def test_two_heads_without_w_o_end_with_the_heads_side_by_side() -> None:
    rng = np.random.default_rng(3)
    Q, K, V = rng.normal(size=(3, 4)), rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    trace = run(loads(_file(Q, K, V, heads=2)))
    assert trace.names[-1] == "concat" and "output" not in trace
    assert trace["K"].axes == ("kv_head", "key", "dim")


def test_the_check_pipeline_computes_the_same_numbers() -> None:
    """qkv check's own float64 forward pass on given Q, K, V is the oracle for run()."""
    rng = np.random.default_rng(7)
    Q, K, V = rng.normal(size=(2, 4)), rng.normal(size=(5, 4)), rng.normal(size=(5, 6))
    example = loads(_file(Q, K, V, heads=2, options={"causal": "bottom-right"}))
    trace, values = run(example), correct_values(example)
    for name in ("scores", "scaled", "weights"):
        np.testing.assert_allclose(trace[name].value, values[name], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(trace["concat"].value, values["context"], rtol=1e-12)


def test_options_of_run_override_the_example() -> None:
    example = loads(QKV_GIVEN)
    Q = K = np.array([[1.0, 0], [0, 1], [1, 1]])
    V = np.array([[1.0, 2], [3, 4], [5, 6]])
    trace = run(example, scale=False, causal=True)
    want = _expected(Q, K, V, 1, 1.0, np.tril(np.ones((3, 3), dtype=bool)))
    np.testing.assert_allclose(trace["weights"].value, want["weights"][0], rtol=1e-12)
    two = run(example, heads=2)  # d_k = 1 per head
    want = _expected(Q, K, V, 2, 1.0, np.ones((3, 3), dtype=bool))
    np.testing.assert_allclose(two["weights"].value, want["weights"], rtol=1e-12)
    with pytest.raises(ValueError, match=r"d_k = 2 \(the columns of Q and K\) .* got 3"):
        run(example, heads=3)


def test_a_query_is_named_among_the_query_tokens() -> None:
    Q, K, V = np.eye(2), np.ones((4, 2)), np.arange(8.0).reshape(4, 2)
    example = loads(_file(Q, K, V, tokens=["a", "b", "c", "d"], query_tokens=["x", "y"]))
    assert run(example, query="y").meta["queries"] == [1]
    assert run(example, query=0).meta["queries"] == [0]
    with pytest.raises(ValueError, match=r"query: unknown token 'c'.*0 x, 1 y"):
        run(example, query="c")
    with pytest.raises(ValueError, match="query: token position 2 is out of range"):
        run(example, query=2)


@pytest.mark.parametrize(
    ("text", "given"),
    [
        ("inputs: {Q: [[1]], K: [[1], [2]]}", "Q and K"),
        ("inputs: {scores: [[1, 2]]}\noptions: {scale: false}", "its scores"),
    ],
)
def test_examples_without_v_are_refused_in_one_line(text: str, given: str) -> None:
    with pytest.raises(ValueError, match="directly") as error:
        run(loads("format: 2\n" + text))
    message = str(error.value)
    assert f"gives {given} directly, without V" in message and "Hint: qkv check" in message
    assert "\n" not in message


# -- the command line ------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _plain_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "given.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_qkv_explain_shows_a_file_given_by_q_k_and_v(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, QKV_GIVEN)
    assert main(["explain", "--example", str(path), "--query", "sat"]) == 0
    out = capsys.readouterr().out
    assert "Q, K and V given directly" in out
    assert "c_sat = 0.2483·v_the + 0.2483·v_cat + 0.5035·v_sat = [3.5105, 4.5105]" in out
    assert max(map(len, out.splitlines())) <= 80
    assert main(["explain", "--example", str(path), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in data["steps"]][:3] == ["Q", "K", "V"]


def test_qkv_explain_html_and_practice_pages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, QKV_GIVEN)
    page, practice = tmp_path / "page.html", tmp_path / "practice.html"
    assert main(["explain", "--example", str(path), "--html", str(page)]) == 0
    assert main(["explain", "-e", str(path), "--html", str(practice), "--practice"]) == 0
    capsys.readouterr()
    for written in (page, practice):
        text = written.read_text(encoding="utf-8")
        assert '"title":"Q, K and V given directly' in text
        assert '"lab":{"kind":"qkv","inputs":{"Q":[[[1.0,0.0],[0.0,1.0],[1.0,1.0]]]' in text
    text = practice.read_text(encoding="utf-8")
    assert '"practice":{' in text and "3.51046953045" in text  # the context of "sat"
    two = _write(tmp_path, QKV_GIVEN.replace("tokens:", "heads: 2\ntokens:"))
    assert main(["explain", "-e", str(two), "--html", str(practice), "--practice"]) == 0
    assert main(["explain", "-e", str(two), "--causal", "--html", str(page)]) == 0


def test_qkv_explain_with_fewer_queries_than_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(
        tmp_path,
        _file(
            np.array([[1.0, 0], [0, 2]]),
            np.array([[1.0, 0], [0, 1], [1, 1], [2, 0]]),
            np.arange(1.0, 9).reshape(4, 2),
            tokens=["k1", "k2", "k3", "k4"],
            query_tokens=["x", "y"],
            options={"causal": "bottom-right", "key_length": 3},
        ),
    )
    assert main(["explain", "-e", str(path), "--query", "-1", "--steps", "weights"]) == 0
    out = capsys.readouterr().out
    assert "y             0.1084   0.4458   0.4458   0.0000   1.0000" in out
    assert main(["explain", "-e", str(path), "--html", str(tmp_path / "p.html")]) == 0
    capsys.readouterr()
    assert main(["explain", "-e", str(path), "--query", "2"]) == 2
    err = capsys.readouterr().err
    assert "from 0 to 1" in err and "the query tokens are 0 x, 1 y" in err
    practice = ["explain", "-e", str(path), "--html", str(tmp_path / "q.html"), "--practice"]
    assert main(practice) == 2
    err = capsys.readouterr().err
    assert "one query per token" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_decode_refuses_a_file_given_by_q_k_and_v(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its q, k, v are not x·W: a decoding step would show made-up projections."""
    path = _write(tmp_path, QKV_GIVEN)
    assert main(["explain", "--decode", "--example", str(path)]) == 2
    err = capsys.readouterr().err
    assert "gives its vectors directly" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ValueError, match="gives its vectors directly"):
        examples.decode_step(loads(QKV_GIVEN))


def test_a_broken_file_is_still_an_example_error() -> None:
    with pytest.raises(ExampleError):
        loads("format: 2\ninputs: {Q: [[1]], K: [[1]], V: [[1, 2], [3, 4]]}")
