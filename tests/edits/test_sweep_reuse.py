"""Sweeps that reuse what they can (issue 39): batched heads, only the layers above run.

``qkv.patching``, ``ablation_sweep`` and ``position_patching`` run one batch row per head and
start from the kept input of the patched layer's block; in a causal language model, from the
first position a batch changes. Each table is compared, cell by cell,
with one forward per edit: the per-head path (``qkv.intervene`` with one edit) on every
Hugging Face family qkv traces (tests/hf/test_hf_tracing.py, left padding) and on a model of
``qkv.nn`` blocks, in float32 (1e-5) and float64 (1e-10); patching by position with a hand
loop of forward pre-hooks on the output projection that writes one head at one token, as
TransformerLens's ``patching.get_act_patch_attn_head_out_by_pos`` does (its ``[layer, pos,
head]`` order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import qkv
from qkv.edits import _batching as batching
from qkv.edits import ablate, ablation_sweep, patch, position_patching, record, scale
from qkv.hf import _adapter as hf_adapter
from qkv.hf import attention_modules
from tests.edits.test_intervene_hf import _cast, _model, _source_inputs
from tests.edits.test_intervene_nn import Tiny
from tests.hf.test_hf_tracing import FAMILIES, PADDING, _family, _inputs

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
IDS = torch.tensor([[1, 5, 9, 2, 7, 3, 8], [4, 4, 6, 1, 0, 2, 5]])
OTHER = torch.tensor([[3, 3, 1, 8, 2, 9, 9], [7, 0, 5, 5, 6, 1, 2]])


def _metric(out: torch.Tensor) -> float:
    """A function of every position and feature (nonlinear), averaged."""
    return float(out.double().sin().mean())


def _run(model: Any, inputs: Any) -> Any:
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return qkv.edits._model.logits_of(out)


def _per_head(model: Any, inputs: Any, edit_of: Callable[[int, int], Any]) -> list[list[float]]:
    """One forward per head: the per-head path."""
    heads = record(model, inputs).contexts
    rows = []
    for layer in range(len(heads)):
        row = []
        for head in range(len(heads[layer])):
            with torch.no_grad(), qkv.intervene(model, edit_of(layer, head)):
                row.append(_metric(_run(model, inputs)))
        rows.append(row)
    return rows


def _close(ours: list[list[float]], theirs: list[list[float]], dtype: torch.dtype) -> None:
    assert [len(r) for r in ours] == [len(r) for r in theirs]
    worst = max(abs(a - b) for ra, rb in zip(ours, theirs) for a, b in zip(ra, rb))  # noqa: B905
    assert worst <= TOLERANCE[dtype]


# float32 on every family; float64 on a decoder with GQA and on T5 (cross-attention and
# position bias passed from block to block), to keep the suite short
CASES = [(family, torch.float32) for family in FAMILIES] + [
    (family, torch.float64) for family in ("llama (GQA)", "t5 (position bias, cross-attention)")
]


@pytest.mark.parametrize(("family", "dtype"), CASES)
def test_patching_equals_one_forward_per_head_on_every_family(
    family: str, dtype: torch.dtype
) -> None:
    model, kind = _model(family, dtype)
    mask = PADDING["left"]
    corrupt = _cast(_inputs(kind, mask), dtype)
    clean = _source_inputs(kind, mask, dtype)
    table = qkv.patching(model, clean, corrupt, _metric)
    source = record(model, clean)
    expected = _per_head(model, corrupt, lambda layer, head: patch(layer, head, source))
    _close(table.values, expected, dtype)
    assert len(table.values) == len(attention_modules(model))
    flat = [v for row in table.values for v in row]
    assert max(abs(v - table.corrupt) for v in flat) > 3 * TOLERANCE[dtype]  # it can fail


def _attention_calls(model: Any) -> tuple[list[tuple[int, int, int]], Callable[[], None]]:
    """(layer, batch, query positions) of every attention module call, and the function
    that stops counting."""
    seen: list[tuple[int, int, int]] = []
    handles = []
    for index, (_, module) in enumerate(attention_modules(model)):

        def hook(_: Any, args: Any, kwargs: Any, index: int = index) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            seen.append((index, int(hidden.shape[0]), int(hidden.shape[1])))

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def stop() -> None:
        for handle in handles:
            handle.remove()

    return seen, stop


def test_only_the_layers_above_run_one_head_per_batch_row() -> None:
    model = _family("llama (GQA)")
    clean, corrupt = {"input_ids": OTHER[:, :6]}, {"input_ids": IDS[:, :6]}
    seen, stop = _attention_calls(model)
    try:
        qkv.patching(model, clean, corrupt, _metric)
    finally:
        stop()
    # the clean run, the corrupt run (batch 2 each); layer 0's 4 heads: layers 0 and 1 on
    # 4 copies of the batch; layer 1's: layer 1 only (layer 0's block is reused)
    assert [call[:2] for call in seen] == [(0, 2), (1, 2), (0, 2), (1, 2), (0, 8), (1, 8), (1, 8)]
    seen, stop = _attention_calls(model)
    try:
        small = qkv.patching(model, clean, corrupt, _metric, batch=3)
    finally:
        stop()
    assert [call[:2] for call in seen[4:]] == [(0, 6), (1, 6), (0, 2), (1, 2), (1, 6), (1, 2)]
    _close(small.values, qkv.patching(model, clean, corrupt, _metric).values, torch.float32)


# clean and corrupt prompts of one template agree on their first tokens; a causal model's
# positions before the first change are the same in every run, so a sweep's batches run
# only the later ones on the first run's cache (a sliding window's cache drops keys, so
# there every position runs)
@pytest.mark.parametrize(
    ("family", "dtype", "later"),
    [
        ("llama (GQA)", torch.float32, True),
        ("gpt2", torch.float64, True),
        ("mistral (sliding window)", torch.float32, False),
        ("bert", torch.float32, False),
    ],
)
def test_a_causal_model_runs_only_the_positions_from_the_first_change(
    family: str, dtype: torch.dtype, later: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _family(family).to(dtype)
    shared, length = 3, int(IDS.shape[1])
    clean = {"input_ids": torch.cat([IDS[:, :shared], OTHER[:, shared:]], dim=1)}
    corrupt = {"input_ids": IDS}
    calls, stop = _attention_calls(model)
    kernels: list[None] = []
    run_call = vars(hf_adapter)["run_call"]

    def counting(*args: Any, **kwargs: Any) -> Any:
        kernels.append(None)
        return run_call(*args, **kwargs)

    monkeypatch.setattr(hf_adapter, "run_call", counting)
    try:
        table = qkv.patching(model, clean, corrupt, _metric)
    finally:
        stop()
    layers = len(attention_modules(model))
    seen = [positions for *_, positions in calls]
    assert seen[: 2 * layers] == [length] * 2 * layers  # the clean and corrupt runs
    assert set(seen[2 * layers :]) == {length - shared if later else length}
    # a batch's own layer sees the corrupt run's inputs, so its attention is that run's,
    # kept (in a decoder): 2 runs of 2 layers, then layer 1 in layer 0's batch (bert: 3)
    assert len(kernels) == 2 * layers + (3 if family == "bert" else 1)
    source = record(model, clean)
    _close(table.values, _per_head(model, corrupt, lambda i, h: patch(i, h, source)), dtype)
    flat = [v for row in table.values for v in row]
    assert max(abs(v - table.corrupt) for v in flat) > 3 * TOLERANCE[dtype]  # it can fail
    if not later:
        return
    # by position: a patch before the first change writes what is there (no run), and each
    # batch of one position runs from it
    calls, stop = _attention_calls(model)
    try:
        by_position = position_patching(model, clean, corrupt, _metric, positions=[1, 3, 6])
    finally:
        stop()
    seen = [positions for *_, positions in calls]
    assert sorted(set(seen[2 * layers :])) == [1, length - shared]
    blocks = model.layers if family != "gpt2" else model.h
    outs = [b.self_attn.o_proj if family != "gpt2" else b.attn.c_proj for b in blocks]
    expected = _by_hand(model, clean, corrupt, outs, 8)
    for ours, theirs in zip(by_position.values, expected, strict=True):
        _close(ours, [theirs[1], theirs[3], theirs[6]], dtype)
        assert ours[0] == [by_position.corrupt] * len(ours[0])


@pytest.mark.parametrize(
    ("family", "dtype"), [("llama (GQA)", torch.float32), ("gpt2", torch.float64)]
)
def test_ablation_and_weights_sweeps_equal_one_forward_per_head(
    family: str, dtype: torch.dtype
) -> None:
    model, kind = _model(family, dtype)
    mask = PADDING["left"]
    corrupt = _cast(_inputs(kind, mask), dtype)
    clean = _source_inputs(kind, mask, dtype)
    zero = ablation_sweep(model, corrupt, _metric, batch=3)
    _close(zero.values, _per_head(model, corrupt, lambda i, h: ablate(i, h)), dtype)
    means = qkv.edits.head_means(model, [clean, corrupt])
    mean = ablation_sweep(model, corrupt, _metric, how="mean", mean=means)
    expected = _per_head(model, corrupt, lambda i, h: ablate(i, h, how="mean", mean=means))
    _close(mean.values, expected, dtype)
    weights = qkv.patching(model, clean, corrupt, _metric, what="weights")
    pattern = record(model, clean, what="weights")
    expected = _per_head(model, corrupt, lambda i, h: patch(i, h, pattern, what="weights"))
    _close(weights.values, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_a_model_of_qkv_nn_blocks_reuses_its_blocks(dtype: torch.dtype) -> None:
    model = Tiny().to(dtype).eval()
    table = qkv.patching(model, OTHER, IDS, _metric, batch=2)
    source = record(model, OTHER)
    _close(table.values, _per_head(model, IDS, lambda i, h: patch(i, h, source)), dtype)
    zero = ablation_sweep(model, IDS, _metric)
    _close(zero.values, _per_head(model, IDS, lambda i, h: ablate(i, h)), dtype)
    assert zero.values != table.values


def _by_hand(model: Any, clean: Any, corrupt: Any, projections: list[Any], width: int) -> Any:
    """Patching by position with hooks: the clean input of each output projection, then one
    forward per (layer, position, head) writing that head's slice at that token."""
    kept: dict[int, torch.Tensor] = {}
    handles = [
        p.register_forward_pre_hook(lambda _, a, i=i: kept.__setitem__(i, a[0].clone()))
        for i, p in enumerate(projections)
    ]
    with torch.no_grad():
        _run(model, clean)
    for handle in handles:
        handle.remove()
    length, heads = kept[0].shape[1], kept[0].shape[2] // width
    table = []
    for i, projection in enumerate(projections):
        layer = []
        for position in range(length):
            row = []
            for head in range(heads):
                part = slice(head * width, (head + 1) * width)

                def write(_: Any, args: Any, i: int = i, p: int = position, s: Any = part) -> Any:
                    edited = args[0].clone()
                    edited[:, p, s] = kept[i][:, p, s]
                    return (edited, *args[1:])

                handle = projection.register_forward_pre_hook(write)
                with torch.no_grad():
                    row.append(_metric(_run(model, corrupt)))
                handle.remove()
            layer.append(row)
        table.append(layer)
    return table


@pytest.mark.parametrize(
    ("family", "dtype"),
    [
        ("llama (GQA)", torch.float32),
        ("gpt2", torch.float64),
        ("qkv.nn", torch.float32),
        ("qkv.nn", torch.float64),
    ],
)
def test_patching_by_position_equals_hooks_one_token_at_a_time(
    family: str, dtype: torch.dtype
) -> None:
    model: Any
    clean: Any
    corrupt: Any
    if family == "qkv.nn":
        model = Tiny().to(dtype).eval()
        clean, corrupt = OTHER[:, :4], IDS[:, :4]
        projections, width = [block.attn.out_proj for block in model.blocks], 4
    else:
        model = _family(family).to(dtype)
        clean, corrupt = {"input_ids": OTHER[:, :4]}, {"input_ids": IDS[:, :4]}
        blocks = model.layers if family != "gpt2" else model.h
        projections = [b.self_attn.o_proj if family != "gpt2" else b.attn.c_proj for b in blocks]
        width = 8
    table = position_patching(model, clean, corrupt, _metric, batch=7)
    expected = _by_hand(model, clean, corrupt, projections, width)
    assert table.positions == tuple(range(len(expected[0])))
    for ours, theirs in zip(table.values, expected, strict=True):
        _close(ours, theirs, dtype)
    last = position_patching(model, clean, corrupt, _metric, positions=[-1])
    assert last.positions == (len(expected[0]) - 1,)
    _close([row[0] for row in last.values], [row[-1] for row in expected], dtype)


def test_heads_count_from_the_end_and_a_block_names_its_layer() -> None:
    model = _family("llama (GQA)")
    ids = IDS[:, :6]

    def out(*edits: Any) -> torch.Tensor:
        with torch.no_grad(), qkv.intervene(model, *edits):
            result: torch.Tensor = model(ids).last_hidden_state
        return result

    assert torch.equal(out(ablate(0, -1)), out(ablate(0, 3)))
    assert not torch.equal(out(ablate(0, -1)), out(ablate(0, 2)))
    assert torch.equal(out(scale("layers.1", -4, 0.5)), out(scale(1, 0, 0.5)))
    assert torch.equal(out(ablate("layers.1", 2)), out(ablate(-1, 2)))
    with pytest.raises(ValueError, match=r"'layers\.\*' holds 2 attention layers"):
        out(ablate("layers.*", 0))
    with pytest.raises(ValueError, match=r"has 4 query heads\. Hint: .*negative from the end"):
        out(ablate(0, -5))
    t5 = _family("t5 (position bias, cross-attention)")
    blocked = r"'decoder.block.0' holds 2 attention layers \("
    with pytest.raises(ValueError, match=blocked), qkv.intervene(t5, ablate("decoder.block.0", 0)):
        pass


def test_batch_and_memory_are_checked_before_the_sweep_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = Tiny().eval()
    with pytest.raises(TypeError, match=r"batch must be a positive integer .* got 0\. Hint"):
        qkv.patching(model, OTHER, IDS, _metric, batch=0)
    monkeypatch.setattr(batching, "available_memory", lambda: 60_000)
    message = (
        r"^patching\(model, clean, corrupt, metric\): a batch of 4 rows needs about "
        r"[\d.]+ kB \([\d.]+ kB a row: logits, activations, scores and cache\), more than "
        r"the 60\.0 kB this process may still take\. Hint: batch=\d\.$"
    )
    with pytest.raises(ValueError, match=message):
        qkv.patching(model, OTHER, IDS, _metric, batch=8)
    monkeypatch.setattr(batching, "available_memory", lambda: 100)
    with pytest.raises(ValueError, match="Hint: fewer tokens, or a smaller model"):
        ablation_sweep(model, IDS, _metric)


def test_progress_shows_a_bar_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Tiny().eval()
    plain = qkv.patching(model, OTHER, IDS, _metric, batch=3)
    bars: list[tuple[bool, int, str]] = []
    steps: list[int] = []
    original = batching.bar

    @contextmanager
    def counted(enabled: bool, total: int, title: str) -> Iterator[Callable[[int], None]]:
        bars.append((enabled, total, title))
        with original(enabled, total, title) as advance:

            def step(n: int) -> None:
                steps.append(n)
                advance(n)

            yield step

    monkeypatch.setattr("qkv.edits._patching.bar", counted)
    table = qkv.patching(model, OTHER, IDS, _metric, progress=True, batch=3)
    assert table.values == plain.values
    assert bars == [(True, 8, "patching")]
    assert steps == [3, 1, 3, 1]  # each layer's 4 heads in batches of 3


class _Stop(Exception):  # noqa: N818
    pass


def _path_by_hand(
    model: Any, clean: Any, corrupt: Any, parts: dict[str, Any], receiver: tuple[int, int]
) -> list[list[float]]:
    """Path patching written out with hooks (Wang et al., 2022): for each sender, (1) the
    corrupt run with the sender's slice of its output projection's input from the clean run
    and every head of the layers between frozen to the corrupt run's, stopped at the
    receiver's projection, whose input is kept; (2) the corrupt run with the receiver's
    columns of that projection computed from the kept input, and the other heads of its
    layer frozen."""
    outs, target, columns, width = parts["o"], parts["target"], parts["columns"], parts["width"]
    runs = {}
    for name, inputs in (("clean", clean), ("corrupt", corrupt)):
        kept: dict[int, torch.Tensor] = {}
        handles = [
            p.register_forward_pre_hook(lambda _, a, i=i, k=kept: k.__setitem__(i, a[0].clone()))
            for i, p in enumerate(outs)
        ]
        with torch.no_grad():
            _run(model, inputs)
        for handle in handles:
            handle.remove()
        runs[name] = kept
    layer_r, head_r = receiver
    heads = runs["clean"][0].shape[-1] // width
    table = []
    for layer_s in range(layer_r):
        row = []
        for head_s in range(heads):
            part = slice(head_s * width, (head_s + 1) * width)
            seen: dict[str, torch.Tensor] = {}

            def send(_: Any, a: Any, s: Any = part, i: int = layer_s) -> Any:
                edited = a[0].clone()
                edited[..., s] = runs["clean"][i][..., s]
                return (edited,)

            def freeze(_: Any, a: Any, i: int) -> Any:
                return (runs["corrupt"][i],)

            def stop(_: Any, a: Any, seen: dict[str, Any] = seen) -> None:
                seen["out"] = target.forward(a[0])[..., columns]
                raise _Stop

            handles = [outs[layer_s].register_forward_pre_hook(send)]
            handles += [
                outs[i].register_forward_pre_hook(lambda m, a, i=i: freeze(m, a, i))
                for i in range(layer_s + 1, layer_r)
            ]
            handles.append(target.register_forward_pre_hook(stop))
            with torch.no_grad(), pytest.raises(_Stop):
                _run(model, corrupt)
            for handle in handles:
                handle.remove()

            def swap(_: Any, __: Any, out: Any, seen: dict[str, Any] = seen) -> Any:
                out = out.clone()
                out[..., columns] = seen["out"]
                return out

            def others(_: Any, a: Any) -> Any:
                edited = runs["corrupt"][layer_r].clone()
                keep = slice(head_r * width, (head_r + 1) * width)
                edited[..., keep] = a[0][..., keep]
                return (edited,)

            handles = [target.register_forward_hook(swap)]
            handles.append(outs[layer_r].register_forward_pre_hook(others))
            with torch.no_grad():
                row.append(_metric(_run(model, corrupt)))
            for handle in handles:
                handle.remove()
        table.append(row)
    return table


# the corrupt prompt's first two tokens, then others: the senders' batches start at 2
_SHARING = torch.cat([IDS[:, :2] + 20, OTHER[:, 2:]], dim=1)


def _three_layers(family: str, dtype: torch.dtype) -> tuple[Any, Any, Any, Callable[..., Any]]:
    """A three-layer model, its clean and corrupt inputs, and ``parts(through, head)``: its
    output projections, the receiver's projection of ``through`` and head's columns there."""
    import transformers as tf

    torch.manual_seed(0)
    config: Any
    clean: Any
    corrupt: Any
    if family == "qkv.nn":
        model: Any = Tiny(layers=3, seed=1)
        attns = [b.attn for b in model.blocks]
        outs, names, fused = [a.out_proj for a in attns], ("q_proj", "k_proj", "v_proj"), False
        clean, corrupt, width, group = OTHER[:, :5], IDS[:, :5], 4, 2
    elif family == "llama (GQA)":
        config = tf.LlamaConfig(
            vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2,
        )  # fmt: skip
        model = tf.LlamaModel(config)
        attns = [b.self_attn for b in model.layers]
        outs, names, fused = [a.o_proj for a in attns], ("q_proj", "k_proj", "v_proj"), False
        clean, corrupt = {"input_ids": _SHARING[:, :5]}, {"input_ids": IDS[:, :5] + 20}
        width, group = 8, 2
    else:
        config = tf.GPT2Config(vocab_size=60, n_embd=32, n_layer=3, n_head=4, n_positions=16)
        model = tf.GPT2Model(config)
        attns = [b.attn for b in model.h]
        outs, names, fused = [a.c_proj for a in attns], ("c_attn",) * 3, True
        clean, corrupt = {"input_ids": _SHARING[:, :5]}, {"input_ids": IDS[:, :5] + 20}
        width, group = 8, 1
    if family != "qkv.nn":  # weights of std 0.02 hide a path's effect in rounding
        generator = torch.Generator().manual_seed(2)
        for weight in model.parameters():
            if weight.ndim == 2:
                weight.data.copy_(torch.randn(weight.shape, generator=generator) * 0.3)
    model = model.to(dtype).eval()

    def parts(through: str, head: int) -> dict[str, Any]:
        index = ("queries", "keys", "values").index(through)
        start = (head if index == 0 else head // group) * width
        if fused:
            start += index * 4 * width
        target = getattr(attns[2], names[index])
        return {"o": outs, "target": target, "columns": slice(start, start + width),
                "width": width}  # fmt: skip

    return model, clean, corrupt, parts


@pytest.mark.parametrize(
    ("family", "through", "dtype"),
    [
        ("llama (GQA)", "queries", torch.float32),
        ("llama (GQA)", "keys", torch.float64),
        ("gpt2", "values", torch.float64),
        ("qkv.nn", "queries", torch.float64),
        ("qkv.nn", "keys", torch.float32),
    ],
)
def test_path_patching_equals_hooks_one_path_at_a_time(
    family: str, through: str, dtype: torch.dtype
) -> None:
    model, clean, corrupt, parts = _three_layers(family, dtype)
    table = qkv.edits.path_patching(
        model, clean, corrupt, _metric, receiver=(2, -3), through=through, batch=3
    )
    expected = _path_by_hand(model, clean, corrupt, parts(through, 1), (2, 1))
    assert table.what == through and len(table.layers) == 2
    _close(table.values, expected, dtype)
    assert max(abs(v - table.corrupt) for row in table.values for v in row) > 3e-5


def test_path_patching_arguments_are_checked() -> None:
    model, clean, corrupt, _ = _three_layers("llama (GQA)", torch.float32)
    path = qkv.edits.path_patching
    with pytest.raises(ValueError, match="through must be 'queries', 'keys' or 'values'"):
        path(model, clean, corrupt, _metric, receiver=(2, 0), through="k")
    with pytest.raises(ValueError, match="layer 0 has no earlier heads to send to it"):
        path(model, clean, corrupt, _metric, receiver=(0, 0))
    with pytest.raises(ValueError, match=r"has 4 query heads\. Hint"):
        path(model, clean, corrupt, _metric, receiver=("layers.2", 4))
    with pytest.raises(TypeError, match=r"receiver must be a \(layer, head\) pair"):
        path(model, clean, corrupt, _metric, receiver=2)  # type: ignore[arg-type]
