"""A text through a Hugging Face model, traced: its tokens, the attention layers that read
it, and the trace of the layers, heads and query rows asked for.

The trace is labelled with the tokenizer's own tokens (``Ġcat``, ``▁cat``, ``##s``, special
tokens included: what the model reads) and says that Q and K are the model's own, after
RoPE where the family rotates them. An encoder–decoder model (T5, BART) reads the text with
its encoder, whose self-attention is traced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from qkv._extras import require
from qkv.hf._adapter import attention_modules, rotates_positions
from qkv.hf._load import LoadedModel
from qkv.trace import Trace, tracing

__all__ = ["rotates_positions", "text_layers", "tokenize", "trace_text"]

_FEATURE = "qkv explain --hf"


def tokenize(loaded: LoadedModel, text: str) -> tuple[Any, list[str]]:
    """The token ids of ``text`` (a tensor (1, N)) and the tokenizer's tokens.

    Raises:
        ValueError: the text has no token, or more than the model's positions.
    """
    encoded = loaded.tokenizer(text, return_tensors="pt")
    ids = encoded["input_ids"]
    tokens = [str(t) for t in loaded.tokenizer.convert_ids_to_tokens(ids[0].tolist())]
    if not tokens:
        raise ValueError(
            f"text {text!r}: the tokenizer makes no token of it. Hint: give a sentence"
        )
    limit = _max_positions(loaded.model.config)
    if limit is not None and len(tokens) > limit:
        raise ValueError(
            f"text: {len(tokens)} tokens, more than the {limit} positions the model takes. "
            "Hint: give a shorter text"
        )
    return ids, tokens


def _max_positions(config: Any) -> int | None:
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def text_layers(loaded: LoadedModel) -> list[str]:
    """The module paths of the attention layers that read the text, in the model's order:
    every attention module, or those of the encoder of an encoder–decoder model."""
    found = attention_modules(loaded.model)
    if loaded.encoder_only:
        encoder = loaded.model.get_encoder()
        prefix = next(
            (path for path, module in loaded.model.named_modules() if module is encoder), ""
        )
        found = [(path, m) for path, m in found if path.startswith(prefix + ".")]
    return [path for path, _ in found]


def trace_text(
    loaded: LoadedModel,
    text: str,
    *,
    layers: Sequence[str | int] | None = None,
    heads: Sequence[int] | None = None,
    queries: Sequence[int] | None = None,
    steps: Sequence[str] | None = None,
    steps_of_layer: Callable[[str], Sequence[str] | None] | None = None,
) -> Trace:
    """Run the model on ``text`` inside :func:`qkv.tracing` and return the trace.

    Args:
        loaded: the model and tokenizer (:func:`~qkv.hf._load.load_model`).
        text: the text; its tokens label the rows and columns.
        layers, heads, queries, steps: what to record, as for :func:`qkv.tracing`
            (default: everything).
        steps_of_layer: the steps to record in each layer (by module path; None: every
            step), overriding ``steps`` layer by layer: e.g. every step of one layer and
            only the weights of the others.

    Returns:
        A :class:`~qkv.Trace` labelled with the tokenizer's tokens, titled after the model,
        whose description says where Q and K come from.

    Raises:
        ValueError: a selection that does not fit the model (a head or layer it does not
            have), or a text it cannot read.
    """
    torch = require("torch", feature=_FEATURE, extra="hf")
    ids, tokens = tokenize(loaded, text)
    model = loaded.model
    # the base model: its attention is all there is to see, and no vocabulary projection
    run = model.get_encoder() if loaded.encoder_only else model.base_model
    trace = Trace(tokens=tokens)
    hooks = []
    if steps_of_layer is not None:
        for path, module in attention_modules(model):
            hooks.append(module.register_forward_pre_hook(_switch(trace, steps_of_layer(path))))
    try:
        with (
            torch.no_grad(),
            tracing(trace, model=model, layers=layers, heads=heads, queries=queries, steps=steps),
        ):
            run(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        for hook in hooks:
            hook.remove()
    _describe(trace, loaded)
    return trace


def _switch(trace: Trace, steps: Sequence[str] | None) -> Callable[..., None]:
    chosen = None if steps is None else tuple(steps)

    def before(*_: Any) -> None:
        trace.record_steps = chosen

    return before


def _describe(trace: Trace, loaded: LoadedModel) -> None:
    """Title the trace after the model, and say what Q, K and the tokens are."""
    model = loaded.model
    label = Path(loaded.name).name if Path(loaded.name).is_dir() else loaded.name
    recorded = trace.layer_names()
    where = recorded[0] if len(recorded) == 1 else f"{len(recorded)} layers"
    trace.meta["name"] = f"Attention in {label} ({loaded.family}), {where}"
    trace.meta["model"] = {"name": loaded.name, "family": loaded.family}
    if rotates_positions(model):
        qk = (
            "Q and K are the model's own, after RoPE (each rotated by its position), as its "
            "attention uses them"
        )
    else:
        qk = "Q and K are the model's own projections, as its attention uses them"
    reads = "its encoder reads the text; " if loaded.encoder_only else ""
    recorded_text = str(trace.meta.get("description") or "").removeprefix(
        "Recorded with qkv.tracing; "
    )
    if len(recorded) > 3:  # not every path: the first and the last
        recorded_text = recorded_text.replace(
            ", ".join(recorded), f"{len(recorded)}, {recorded[0]} to {recorded[-1]}"
        )
    trace.meta["description"] = (
        f"{qk}; {reads}the tokens are the tokenizer's. {recorded_text[:1].upper()}"
        f"{recorded_text[1:]}"
    ).strip()
