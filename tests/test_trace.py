"""The step trace: names, axes, per-head steps, JSON round trip, zero cost when off."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import qkv
import qkv.trace as trace_module


def test_single_head_steps_in_order() -> None:
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(3, 4)), rng.normal(size=(4, 2))
    trace = qkv.Trace()
    qkv.self_attention(x, w, w, w, is_causal=True, trace=trace)
    assert trace.names == [
        "embeddings", "W_q", "W_k", "W_v", "Q", "K", "V",
        "scores", "scaled", "masked", "weights", "context",
    ]  # fmt: skip
    assert trace["weights"].axes == ("query", "key") and trace["weights"].shape == (3, 3)
    assert trace["Q"].formula == "Q = X·W_q"
    assert trace["masked"].value[0, 1] == -np.inf
    assert trace.meta["causal"] and trace.meta["d_k"] == 2 and trace.meta["num_heads"] == 1


def test_multi_head_keeps_per_head_steps_and_concat_output() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, 8))
    W_q, W_kv, W_o = rng.normal(size=(8, 8)), rng.normal(size=(8, 4)), rng.normal(size=(8, 8))
    trace = qkv.Trace()
    out = qkv.multi_head_attention(
        x, W_q, W_kv, W_kv, W_o, num_heads=4, num_kv_heads=2, trace=trace
    )
    assert trace.names[-3:] == ["concat", "W_o", "output"]
    q, k, weights = trace["Q"], trace["K"], trace["weights"]
    assert q.axes == ("head", "query", "dim") and q.shape == (4, 5, 2)
    assert k.axes == ("kv_head", "key", "dim") and k.shape == (2, 5, 2)
    assert weights.shape == (4, 5, 5)
    # head 3 uses key/value head 1 under GQA
    np.testing.assert_array_equal(k.select(head=3, group_size=2), (x @ W_kv)[:, 2:4])
    np.testing.assert_allclose(trace["output"].value, out)
    assert trace.meta["num_heads"] == 4 and trace.meta["num_kv_heads"] == 2


def test_batched_trace_select() -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 3, 4))
    trace = qkv.Trace()
    qkv.multi_head_attention(x, np.eye(4), np.eye(4), np.eye(4), num_heads=2, trace=trace)
    weights = trace["weights"]
    assert weights.axes == ("batch", "head", "query", "key")
    assert weights.select(batch=1, head=0).shape == (3, 3)


def test_tracing_context_records_and_nests() -> None:
    x = np.eye(2)
    with qkv.tracing() as outer:
        qkv.scaled_dot_product_attention(x, x, x)
        with qkv.tracing() as inner:
            qkv.scaled_dot_product_attention(x, x, x)
        assert qkv.current_trace() is outer
    assert qkv.current_trace() is None
    assert outer.names.count("weights") == 1 and inner.names.count("weights") == 1


def test_nothing_is_recorded_or_converted_when_off(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("trace recorded although tracing is off")

    monkeypatch.setattr(trace_module.Trace, "record", forbidden)
    monkeypatch.setattr(trace_module, "to_numpy", forbidden)
    x = torch.randn(2, 3, 4)
    qkv.multi_head_attention(x, torch.eye(4), torch.eye(4), torch.eye(4), num_heads=2)


def test_trace_of_tensors_is_detached_numpy() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    with qkv.tracing() as trace:
        out = qkv.self_attention(x, torch.eye(4), torch.eye(4), torch.eye(4))
    out.sum().backward()  # recording did not break the graph
    assert isinstance(trace["weights"].value, np.ndarray)
    assert x.grad is not None


def test_json_round_trip_keeps_infinities(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 2))
    trace = qkv.Trace(tokens=["a", "b", "c"])
    qkv.self_attention(x, np.eye(2), np.eye(2), np.eye(2), is_causal=True, trace=trace)
    path = tmp_path / "trace.json"
    trace.save(path)
    loaded = qkv.Trace.load(path)
    assert loaded.names == trace.names and loaded.tokens == ["a", "b", "c"]
    assert loaded.meta == trace.meta
    for before, after in zip(trace, loaded, strict=True):
        assert after.axes == before.axes and after.formula == before.formula
        np.testing.assert_array_equal(after.value, before.value)
    assert loaded["masked"].value[0, 2] == -np.inf
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"format": "other"}, r"not a qkv trace"),
        ({"format": "qkv-trace", "version": 99}, r"unsupported trace version 99"),
    ],
)
def test_bad_trace_files(data: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        qkv.Trace.from_dict(data)


def test_unknown_step_name_and_missing_step() -> None:
    trace = qkv.Trace()
    with pytest.raises(ValueError, match=r"unknown step name 'attn'"):
        trace.record("attn", np.ones(1), formula="", description="", axes=("query",))
    with pytest.raises(KeyError, match=r"no step named 'weights'.*recorded: none"):
        trace["weights"]
    assert trace.get("weights") is None
