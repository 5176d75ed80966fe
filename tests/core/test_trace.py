"""The step trace: names, axes, per-head steps, JSON round trip, zero cost when off."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import qkv
import qkv.trace as trace_module
import qkv.trace._trace as recording
from qkv import render
from tests.support.backends import backend_names


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
    monkeypatch.setattr(recording, "to_numpy", forbidden)
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


# -- traces made of calls; files of version 1 and 2 (issue 13) -----------------------------

DATA = Path(__file__).resolve().parents[1] / "data"
V1_FILES = sorted(p.stem for p in DATA.glob("trace_v1_*.json"))


@pytest.mark.parametrize("name", V1_FILES)
def test_version_1_files_load_and_render_as_before(name: str, tmp_path: Path) -> None:
    """Files written by qkv before traces had calls (see tests/data/README.md) still load,
    render exactly as they did, and survive a round trip through version 2."""
    old = qkv.Trace.load(DATA / f"{name}.json")
    text, markdown = (DATA / f"{name}.txt").read_text(), (DATA / f"{name}.md").read_text()
    assert render.text(old) == text and render.markdown(old) == markdown
    assert render.html(old).startswith("<!DOCTYPE html>")
    old.save(tmp_path / "again.json")
    saved = json.loads((tmp_path / "again.json").read_text())
    assert saved["version"] == 2 and len(saved["calls"]) == len(old.calls)
    again = qkv.Trace.load(tmp_path / "again.json")
    assert again.names == old.names and again.meta == old.meta
    assert [c.meta for c in again.calls] == [c.meta for c in old.calls]
    assert render.text(again) == text and render.markdown(again) == markdown


def test_version_1_model_file_has_one_call_per_layer() -> None:
    old = qkv.Trace.load(DATA / "trace_v1_model.json")
    assert old.layer_names() == ["blocks.0.attn", "blocks.1.attn"]
    first, second = old.calls
    assert (first.layer, len(first), first.names[-1]) == ("blocks.0.attn", 11, "output")
    assert first.meta["num_heads"] == 4 and second.meta["scale"] == 0.5


def test_a_trace_holds_one_record_per_attention_call() -> None:
    rng = np.random.default_rng(4)
    x = rng.normal(size=(3, 4))
    w = rng.normal(size=(4, 4))
    with qkv.tracing() as t:
        qkv.multi_head_attention(x, w, w, w, w, num_heads=2, is_causal=True)
        qkv.scaled_dot_product_attention(x, x, x, scale=1.0)
        qkv.scaled_dot_product_attention(x[:2], x, x, is_causal=True,
                                         causal_alignment="bottom-right")  # fmt: skip
    first, second, third = t.calls
    # the flat view is unchanged: every step once, in the order it ran
    assert [s for c in t.calls for s in c] == t.steps
    assert first.names[0] == "embeddings" and first.names[-3:] == ["concat", "W_o", "output"]
    assert first.meta["num_heads"] == 2 and first.meta["causal"] is True
    assert first.meta["scale_mode"] == "sqrt_dk" and first.meta["backend"] == "reference"
    assert second.names == ["Q", "K", "V", "scores", "scaled", "weights", "context"]
    assert second.meta["scale"] == 1.0 and second.meta["scale_mode"] == "none"
    assert second.meta["shapes"] == {"query": [3, 4], "key": [3, 4], "value": [3, 4]}
    assert third.meta["causal_alignment"] == "bottom-right"
    assert t.meta["scale_mode"] == "sqrt_dk"  # the flat meta: the last call's, as before
    one = t.call(index=1)
    assert one.names == second.names and one.meta["scale"] == 1.0
    np.testing.assert_array_equal(one["weights"].value, second["weights"].value)
    assert "S' = S (no scaling)" in render.text(one)  # a renderer takes one call as a trace
    with pytest.raises(ValueError, match=r"call\(index=3\): the trace has 3 call\(s\)\. Hint"):
        t.call(index=3)
    with pytest.raises(ValueError, match=r"no call of that layer in this trace\. Hint: its "):
        t.call(layer="blocks.0.attn")


def test_a_trace_of_selected_rows_records_its_call(recwarn: pytest.WarningsRecorder) -> None:
    q = torch.randn(1, 2, 64, 4, generator=torch.Generator().manual_seed(3))
    with qkv.tracing(heads=[1], queries=[0, 63]) as t:
        qkv.scaled_dot_product_attention(q, q, q, is_causal=True, backend="tiled")
    (call,) = t.calls
    assert call.meta["backend"] == "tiled"
    assert call.meta["rows"] == {"heads": [1], "queries": [0, 63], "q_len": 64}
    assert call.names == ["Q", "K", "V", "scores", "scaled", "masked", "weights", "context"]
    assert call["weights"].index == {"query": [0, 63], "head": [1]}


@pytest.mark.parametrize(
    ("change", "field", "expected"),
    [
        (lambda d: d.update(calls={"a": 1}), "calls", "expected a list of calls"),
        (lambda d: d["calls"].__setitem__(0, 3), "calls[0]", "expected an object"),
        (lambda d: d["calls"][0].update(meta={"scale": "big"}), "calls[0].meta.scale", "number"),
        (lambda d: d["steps"][2].update(call=5), "steps[2].call", "0 to 0, got 5"),
        (lambda d: d["steps"][2].update(call="x"), "steps[2].call", "a whole number"),
        (lambda d: d.pop("calls"), None, "'calls' is missing"),
    ],
)
def test_version_2_call_fields_are_checked(change: Any, field: str | None, expected: str) -> None:
    with qkv.tracing() as t:
        qkv.scaled_dot_product_attention(np.eye(2), np.eye(2), np.eye(2))
    data = t.to_dict()
    change(data)
    with pytest.raises(trace_module.TraceFileError) as info:
        qkv.Trace.from_json(json.dumps(data))
    assert info.value.field == field and expected in str(info.value)
    assert "\n" not in str(info.value)


GQA_SELECTIONS = [
    {"queries": [2]},
    {"heads": [3]},
    {"heads": [1, 2], "queries": [0, -1]},
]


@pytest.mark.parametrize("backend", backend_names(reference=False))
@pytest.mark.parametrize("selection", GQA_SELECTIONS)
def test_selected_rows_of_a_fast_backend_keep_the_call_head_counts(
    backend: str, selection: dict[str, list[int]]
) -> None:
    """A fast backend's traced rows are recomputed for the selected heads only; the call's
    facts still say its own num_heads and num_kv_heads, as the reference's trace does, and
    each selected head's K and V are those of key/value head h // 2."""
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 5, 3, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 5, 3, generator=generator, dtype=torch.float64) for _ in "kv")
    with qkv.tracing() as whole:
        qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend="reference")
    with qkv.tracing(heads=selection.get("heads"), queries=selection.get("queries")) as part:
        qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend=backend)
    (call,) = part.calls
    assert (call.meta["num_heads"], call.meta["num_kv_heads"]) == (4, 2)
    assert (part.meta["num_heads"], part.meta["num_kv_heads"]) == (4, 2)
    heads = [h % 4 for h in selection.get("heads", range(4))]
    rows = [r % 5 for r in selection.get("queries", range(5))]
    np.testing.assert_allclose(
        call["weights"].value, whole["weights"].value[:, heads][:, :, rows], atol=1e-12
    )
    narrative = render.narrate(part)
    for h in heads:
        title = f"Head {h} of 4 heads (key/value head {h // 2} of 2)"
        (section,) = [s for s in narrative.sections if s.title == title]
        views = {view.name: view for view in section.steps}
        for name in ("K", "V"):
            table = views[name].table
            assert table is not None
            np.testing.assert_allclose(table.values, whole[name].value[0, h // 2])
        assert views["scores"].equations and views["context"].equations


@pytest.mark.parametrize(("name", "heads"), [("rows", [0, 1, 2, 3]), ("heads", [0, 1])])
def test_files_of_selected_rows_written_before_the_counts_were_kept_load_with_them(
    name: str, heads: list[int]
) -> None:
    """Trace files of qkv before this fix (tests/data/README.md) gave a call of selected rows
    the counts of the heads recomputed (num_kv_heads 4 for 2, num_heads 2 for 4); they load
    with the model's, read from the call's recorded input shapes, and each head is shown
    with the key/value head it used."""
    raw = json.loads((DATA / f"trace_v2_gqa_{name}.json").read_text())
    old_counts = (raw["calls"][0]["meta"]["num_heads"], raw["calls"][0]["meta"]["num_kv_heads"])
    assert old_counts != (4, 2)  # what the file says
    trace = qkv.Trace.load(DATA / f"trace_v2_gqa_{name}.json")
    (call,) = trace.calls
    assert (call.meta["num_heads"], call.meta["num_kv_heads"]) == (4, 2)
    assert (trace.meta["num_heads"], trace.meta["num_kv_heads"]) == (4, 2)
    keys = call["K"].value[0]  # (kept key/value heads, keys, d)
    kv_index = (call["K"].index or {}).get("kv_head")
    narrative = render.narrate(trace)
    titled = [s for s in narrative.sections if s.title and s.title.startswith("Head")]
    assert [s.title for s in titled] == [
        f"Head {h} of 4 heads (key/value head {h // 2} of 2)" for h in heads
    ]
    for position, (h, section) in enumerate(zip(heads, titled, strict=True)):
        views = {view.name: view for view in section.steps}
        table = views["K"].table
        assert table is not None
        want = keys[position] if kv_index is not None else keys[h // 2]
        np.testing.assert_allclose(table.values, want)
        assert views["scores"].equations, section.title  # q·k from the K shown: true


@pytest.mark.parametrize(
    "shapes",
    [
        {"query": [1, 4, 1, 4], "key": [1, 3, 4, 4]},  # 3 does not divide 4
        {"query": [1, 4, 1, 4], "key": [1, 0, 4, 4]},
        {"query": "x", "key": [1, 2, 4, 4]},
        {"query": [1, 4, 1, 4], "key": [4, 4]},
        {"query": [1, True, 1, 4], "key": [1, 2, 4, 4]},
        "shapes",
    ],
)
def test_a_file_whose_shapes_do_not_give_counts_keeps_its_own(shapes: Any) -> None:
    raw = json.loads((DATA / "trace_v2_gqa_rows.json").read_text())
    raw["calls"][0]["meta"]["shapes"] = shapes
    if not isinstance(shapes, dict):
        with pytest.raises(trace_module.TraceFileError, match="shapes: expected an object"):
            qkv.Trace.from_dict(raw)
        return
    trace = qkv.Trace.from_dict(raw)
    assert trace.calls[0].meta["num_kv_heads"] == 4  # as written: nothing to read it from
    assert "Head 3 of 4 heads" in render.text(trace)
