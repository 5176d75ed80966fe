"""The transformers adapter: qkv's attention and mask functions, and the tracing block.

transformers calls an attention function as ``f(module, query, key, value, attention_mask,
dropout=..., scaling=..., is_causal=..., **kwargs)`` with query (B, H, Lq, D) after RoPE and
key/value (B, Hkv, Lk, D) not repeated, and expects ``(output (B, Lq, H, D), weights or
None)``. The mask it hands over comes from the mask function registered under the same
name; without one transformers would pass no mask at all, so both are registered together
and a causal call that arrives without a mask is an error, never run unmasked.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from qkv._edit_point import EditSite, active_editor, known_context
from qkv._extras import require
from qkv.attention._dispatch import make_call, run_call, weight_rows
from qkv.masks import softcap as softcap_mod
from qkv.steps import projection_formula
from qkv.trace import Trace, current_trace, suspended
from qkv.trace._context import register_model_adapter

__all__ = [
    "IMPLEMENTATION",
    "attention_modules",
    "call_options",
    "qkv_attention_forward",
    "qkv_mask",
    "routed",
]

IMPLEMENTATION = "qkv"
"""The name under which qkv's attention and mask functions are registered in transformers."""

_HANDLED = frozenset({"softcap", "s_aux", "sliding_window", "position_bias"})
"""Keyword arguments that change the maths and that qkv computes exactly."""

_HARMLESS = frozenset(
    {
        "position_ids",
        "cache_position",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "num_items_in_batch",
        "use_cache",
        "past_key_values",
        "past_key_value",
        "position_embeddings",
        "token_type_ids",
        "return_dict",
    }
)
"""Keyword arguments transformers passes along that do not change the attention's result.
The packed-sequence arguments of the flash kernels (``cu_seq_lens_q``, ...) are refused."""

_calls: ContextVar[list[int] | None] = ContextVar("qkv_hf_calls", default=None)
"""The number of attention calls inside the current tracing block of a transformers model."""

_projections: ContextVar[dict[int, dict[str, dict[str, Any]]] | None] = ContextVar(
    "qkv_hf_projections", default=None
)
"""How each attention module of the traced model makes Q, K and V (by ``id(module)``): the
arguments of :func:`qkv.steps.projection_formula` for each letter it is understood for."""

_PROJECTIONS = {
    "Q": ("q_proj", "query", "q"),
    "K": ("k_proj", "key", "k"),
    "V": ("v_proj", "value", "v"),
}
"""The names transformers gives the query, key and value projections of an attention module."""
_FUSED = ("c_attn", "qkv_proj", "query_key_value", "Wqkv")
"""The names of one projection that makes Q, K and V together (GPT-2's ``c_attn``)."""
_NORMS = {"Q": ("q_norm",), "K": ("k_norm",)}
"""Normalisations applied to Q and K after their projection (Qwen3, OLMo 2)."""
_CROSS = ("cross", "encdec", "encoder_attn")
"""Words in the module path of a cross-attention layer (its K and V come from the encoder)."""


def rotates_positions(model: Any) -> bool:
    """Whether the model rotates Q and K by their positions (RoPE) before attention."""
    return any("rotary" in type(module).__name__.lower() for module in model.modules())


def _projection_facts(path: str, module: Any, *, rope: bool) -> dict[str, dict[str, Any]]:
    """How ``module`` makes each of Q, K and V (the arguments of
    :func:`~qkv.steps.projection_formula`), for those whose projection it has under a name
    transformers uses; none when a part of the module is not understood (a normalisation
    other than ``q_norm``/``k_norm``), so that a trace never claims a formula the model did
    not compute."""
    children = dict(module.named_children())
    known = {*(n for names in _PROJECTIONS.values() for n in names), *_FUSED}
    known |= {n for names in _NORMS.values() for n in names}
    if any(
        "norm" in type(child).__name__.lower() and name not in known
        for name, child in children.items()
    ):
        return {}
    fused = next((children[name] for name in _FUSED if name in children), None)
    cross = any(word in path.lower() for word in _CROSS)
    facts = {}
    for letter, names in _PROJECTIONS.items():
        projection = next((children[name] for name in names if name in children), fused)
        if projection is None or getattr(projection, "weight", None) is None:
            continue
        facts[letter] = {
            "source": "Y" if cross and letter != "Q" else "X",
            "bias": getattr(projection, "bias", None) is not None,
            "norm": any(children.get(name) is not None for name in _NORMS.get(letter, ())),
            "rope": rope and letter != "V",
        }
    return facts


def _formulas(module: Any, scaling: float | None, d_k: int) -> dict[str, str] | None:
    """The formulas of this call's Q, K and V (None: the module is not understood). A module
    that keeps its own ``scaling`` but passes ``scaling=1.0`` has scaled Q itself (Whisper,
    OPT: ``q_proj(x) * self.scaling``), and Q's formula says so."""
    facts = (_projections.get() or {}).get(id(module))
    if not facts:
        return None
    own = getattr(module, "scaling", None)
    prescaled = scaling == 1.0 and isinstance(own, float) and own != 1.0
    return {
        letter: projection_formula(
            letter, **kwargs, scale=own if prescaled and letter == "Q" else None, d_k=d_k
        )
        for letter, kwargs in facts.items()
    }


def _family(module: object) -> str:
    """The model family of an attention module (``config.model_type``), or its class name."""
    config = getattr(module, "config", None)
    return str(getattr(config, "model_type", None) or type(module).__name__)


def _refuse(family: str, what: str, hint: str) -> ValueError:
    return ValueError(f"qkv attention for {family}: {what}. Hint: {hint}")


def _wants_weights() -> bool:
    """Whether transformers is collecting attention weights (``output_attentions=True``)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - another transformers layout: always return them
        return True
    collected = _active_collector.get()  # type: ignore[no-untyped-call]
    return bool(collected) and any("attentions" in key for key in collected)


def _check_kwargs(family: str, kwargs: dict[str, Any], *, training: bool, dropout: float) -> None:
    """Refuse every keyword argument whose effect on the result qkv does not reproduce."""
    for name, value in kwargs.items():
        if name in _HANDLED or name in _HARMLESS or value is None:
            continue
        raise _refuse(
            family,
            f"keyword argument {name!r} changes the attention and is not supported yet",
            "run this model without qkv.tracing, or with attn_implementation='eager'",
        )
    if training and dropout:
        raise _refuse(
            family,
            f"attention dropout {dropout} while training is not reproduced",
            "call model.eval() inside qkv.tracing, or set the config's attention dropout to 0",
        )


def qkv_attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """transformers' attention function for ``attn_implementation="qkv"``.

    Computes softmax(Q·Kᵀ·scaling [+ position bias] [softcapped], masked [, sink]) · V with
    :func:`qkv.scaled_dot_product_attention` (GQA without repeating K and V), records the
    call when a :func:`qkv.tracing` block selects its layer, and returns the weights when
    transformers collects them (``output_attentions=True``).

    Raises:
        ValueError: a keyword argument that changes the maths and is not reproduced
            (dropout while training, packed sequences, ...), a sliding window or causal
            call without a mask, or a mask of another implementation combined with softcap.
    """
    family = _family(module)
    _check_kwargs(
        family, kwargs, training=bool(getattr(module, "training", False)), dropout=dropout
    )
    causal = is_causal if is_causal is not None else bool(getattr(module, "is_causal", False))
    if attention_mask is None and kwargs.get("sliding_window") is not None:
        raise _refuse(
            family,
            f"sliding_window={kwargs['sliding_window']} came without a mask to carry it",
            "build the model with attn_implementation='qkv' masks (qkv.tracing does)",
        )
    if attention_mask is None and causal and query.shape[2] > 1:
        raise _refuse(
            family,
            f"a causal attention call of {query.shape[2]} queries came without a mask, so it "
            "would run unmasked",
            "register qkv.hf.qkv_mask with AttentionMaskInterface next to the attention "
            "function (importing qkv.hf does)",
        )
    result = _run(
        module,
        query,
        key,
        value,
        causal=causal,
        **call_options(module, query, key, attention_mask, scaling, kwargs),
        position_ids=None if kwargs.get("sliding_window") is None else kwargs.get("position_ids"),
    )
    output, weights = result if isinstance(result, tuple) else (result, None)
    return output.transpose(1, 2).contiguous(), weights


def call_options(
    module: Any,
    query: Any,
    key: Any,
    attention_mask: Any,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> dict[str, Any]:
    """The options of :func:`qkv.scaled_dot_product_attention` for one transformers
    attention call: its mask (a boolean one as a mask, dropped when it allows every key, or
    ``is_causal`` when it is exactly causal; an additive one as a bias), T5's
    ``position_bias`` (a bias), ``softcap`` (a score_mod), the ``scaling`` and gpt-oss's
    sinks (``s_aux``). query (B, H, Lq, D), key (B, Hkv, Lk, D), ``kwargs`` the call's
    keyword arguments. The keys ``bias``, ``score_mod``, ``scale`` and ``sinks`` are always
    there (None when the call has none).

    Raises:
        ValueError: softcap with a position bias or with an additive mask.

    Example:
        >>> import torch
        >>> attn = torch.nn.Module()
        >>> q = torch.zeros(1, 2, 3, 4)
        >>> causal = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
        >>> options = call_options(attn, q, q, causal, 0.5, {})
        >>> options["is_causal"], options["causal_alignment"], options["scale"], options["bias"]
        (True, 'top-left', 0.5, None)
    """
    family = _family(module)
    softcap = kwargs.get("softcap")
    bias = kwargs.get("position_bias")  # T5's relative position bias
    if softcap is not None and bias is not None:
        raise _refuse(
            family,
            f"softcap={softcap} together with a position_bias",
            "no transformers family combines them; trace such a model with the eager path",
        )
    layout: dict[str, Any] = {}
    if attention_mask is not None:
        if attention_mask.dtype == require("torch", feature="qkv.hf").bool:
            layout = _boolean_mask(attention_mask, int(query.shape[2]), int(key.shape[2]))
        elif softcap is None:  # an additive mask, added as eager adds it
            bias = attention_mask if bias is None else bias + attention_mask
        else:
            raise _refuse(
                family,
                f"an additive {attention_mask.dtype} mask with softcap={softcap}",
                "use qkv.tracing(model=...), whose boolean masks qkv applies after the softcap",
            )
    return {
        **layout,
        "bias": bias,
        "score_mod": None if softcap is None else softcap_mod(float(softcap)),
        "scale": scaling,
        "sinks": kwargs.get("s_aux"),
    }


_MASK_KINDS: list[tuple[weakref.ref[Any], int, str]] = []
"""The kind of the last few boolean masks seen (transformers hands the same mask to every
layer of a forward pass): a weak reference, the tensor's version, its kind."""


def _mask_kind(mask: Any, q_len: int, kv_len: int) -> str:
    """``"all"`` (every key allowed), ``"causal"`` (exactly key j ≤ i + Lk − Lq, on every
    batch element) or ``"dense"`` (padding, a window, anything else) for a boolean mask
    (B or 1, H or 1, Lq, Lk); remembered per tensor, so a forward pass checks it once."""
    try:
        version = int(mask._version)
    except RuntimeError:  # an inference-mode tensor keeps no version: check it every time
        version = -1
    for ref, seen, kind in _MASK_KINDS:
        if ref() is mask and seen == version >= 0:
            return kind
    torch = require("torch", feature="qkv.hf")
    if bool(mask.all()):
        kind = "all"
    elif q_len <= kv_len and tuple(mask.shape[-2:]) == (q_len, kv_len):
        causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=mask.device)
        causal = causal.tril(kv_len - q_len)
        kind = "causal" if torch.equal(mask, causal.expand_as(mask)) else "dense"
    else:
        kind = "dense"
    if version >= 0:
        _MASK_KINDS[:] = [*_MASK_KINDS[-3:], (weakref.ref(mask), version, kind)]
    return kind


def _boolean_mask(mask: Any, q_len: int, kv_len: int) -> dict[str, Any]:
    """The qkv options of a boolean transformers mask (True = may attend).

    A mask that allows every key is dropped and one that is exactly causal becomes
    ``is_causal`` (bottom-right when Lq < Lk, as in decoding with a cache), as transformers'
    own SDPA path does, so that torch's fused kernel skips the blocks above the diagonal;
    the result is the same. Any other mask (padding, a window) is passed as it is.
    """
    kind = _mask_kind(mask, q_len, kv_len)
    if kind == "all":
        return {}
    if kind == "causal":
        alignment = "top-left" if q_len == kv_len else "bottom-right"
        return {"is_causal": True, "causal_alignment": alignment}
    return {"mask": mask}


def _run(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    *,
    causal: bool,
    position_ids: Any = None,
    **options: Any,
) -> Any:
    """Run qkv's attention, inside the module's layer when the enclosing trace selects it.

    A layer that is not recorded runs on the fast path (``auto``: torch's SDPA, or the tiled
    kernel for softcap and sinks). A recorded layer runs the same fast path for its output
    and recomputes only the selected heads and query rows on the reference (O(rows · N)
    memory); only when transformers collects the weights (``output_attentions=True``) does
    the reference form them all. Inside a ``qkv.intervene`` block the result goes through
    its editor (``causal``: the queries are the last positions of the keys; the
    ``position_ids`` of a sliding-window layer tell where its keys start, once its cache has
    let early tokens go).
    """
    counter = _calls.get()
    if counter is not None:
        counter[0] += 1
    weights = _wants_weights()
    trace = current_trace()
    known = None if weights or trace is not None else known_context(module)

    def attend(formulas: dict[str, str] | None = None) -> Any:
        if known is not None:  # the editor holds this call's result: no kernel
            context, formed = known, None
        else:
            call = make_call(
                query,
                key,
                value,
                enable_gqa=query.shape[1] != key.shape[1],
                return_weights=weights,
                formulas=formulas,
                **options,
            )
            context, formed = run_call(call, rows_only=True)
        editor = active_editor()
        if editor is not None:
            gqa = query.shape[1] != key.shape[1]

            def rows_of(heads: list[int], rows: list[int]) -> Any:
                found = weight_rows(query, key, value, heads, rows, enable_gqa=gqa, **options)
                return require("torch", feature="qkv.hf").from_numpy(found).to(query.device)

            first = _first_key(position_ids, query, key) if causal else 0
            site = EditSite(module, query, key, value, context, formed, causal, rows_of, first)
            context, formed = editor(site)
        return (context, formed) if weights else context

    if trace is None:
        return attend()
    name = trace.layer_name(module)
    if not trace.records_layer(name):
        with suspended():
            return attend()
    facts = {
        "num_heads": int(query.shape[1]),
        "num_kv_heads": int(key.shape[1]),
        "head_dim": int(query.shape[-1]),
        "family": _family(module),
    }
    with trace.in_layer(name, **facts):
        return attend(_formulas(module, options.get("scale"), int(query.shape[-1])))


def _first_key(position_ids: Any, query: Any, key: Any) -> int:
    """The sequence position of a causal call's first key: one past its last query's
    position (the largest over the batch: left padding lowers the others) less its keys.
    0 without (B, Lq) position ids, and for a cache that holds every token."""
    if getattr(position_ids, "ndim", 0) != 2 or position_ids.shape[-1] != query.shape[2]:
        return 0
    last = int(position_ids[:, -1].max())
    return max(0, last + 1 - int(key.shape[2]))


def qkv_mask(**kwargs: Any) -> Any:
    """transformers' mask function for ``attn_implementation="qkv"``: the boolean mask
    (True = may attend) of ``sdpa_mask``, always built for causal and sliding-window
    attention (never left to an ``is_causal`` flag), None only for full attention without
    padding."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(**kwargs)


def attention_modules(model: Any) -> list[tuple[str, Any]]:
    """The attention modules of a transformers model, by module path: the innermost modules
    whose class name ends in ``Attention`` (``model.layers.0.self_attn``)."""
    found = [
        (path, module)
        for path, module in model.named_modules()
        if type(module).__name__.endswith("Attention")
    ]
    return [
        (path, module)
        for path, module in found
        if not any(other.startswith(path + ".") for other, _ in found if path)
    ]


def _uses_interface(model: Any) -> bool:
    """Whether the model's family dispatches its attention through transformers'
    ``AttentionInterface`` (its modeling module looks functions up in
    ``ALL_ATTENTION_FUNCTIONS``; Bloom, GPT-J and Falcon do not)."""
    for cls in type(model).__mro__:
        module = sys.modules.get(cls.__module__)
        if module is not None and ".models." in cls.__module__:
            return "ALL_ATTENTION_FUNCTIONS" in vars(module)
    return bool(getattr(model, "_supports_attention_backend", False))


@contextmanager
def routed(model: Any, *, caller: str = "tracing(model=...)") -> Iterator[list[tuple[str, Any]]]:
    """Inside the block, ``model`` runs its attention through qkv (``attn_implementation``
    ``"qkv"``); the previous implementation comes back afterwards, also on an error. Yields
    the model's attention modules, by module path.

    Raises:
        ValueError: the model's family does not call transformers' ``AttentionInterface``,
            has no attention module qkv can name, or rejects the implementation; ``caller``
            starts the message.
    """
    config = getattr(model, "config", None)
    family = str(getattr(config, "model_type", None) or type(model).__name__)
    if config is None or not _uses_interface(model):
        raise ValueError(
            f"{caller}: the {family} family ({type(model).__name__}) does not call "
            "transformers' AttentionInterface, so qkv cannot see its attention. Hint: Llama, "
            "Mistral, Qwen2, Gemma2, gpt-oss, GPT-2, BERT, T5, BART, Whisper and ViT do (see "
            "docs/hf.md)."
        )
    modules = attention_modules(model)
    if not modules:
        raise ValueError(
            f"{caller}: the {family} model ({type(model).__name__}) has no module "
            "whose class name ends in 'Attention', so qkv cannot name its attention layers. "
            "Hint: see docs/hf.md for the families qkv.tracing supports."
        )
    previous = config._attn_implementation
    try:
        model.set_attn_implementation(IMPLEMENTATION)
    except (ValueError, ImportError) as error:
        raise ValueError(
            f"{caller}: the {family} model rejects attn_implementation="
            f"{IMPLEMENTATION!r} ({str(error).splitlines()[0]}). Hint: see docs/hf.md for the "
            "families qkv.tracing supports."
        ) from error
    try:
        yield modules
    finally:
        model.set_attn_implementation(previous)


@contextmanager
def _adapt(model: Any, trace: Trace) -> Iterator[None]:
    """Inside the block, ``model`` runs its attention through qkv and ``trace`` names its
    attention modules; the previous implementation comes back afterwards."""
    with routed(model) as modules:
        family = str(getattr(model.config, "model_type", None) or type(model).__name__)
        trace._use_model(model, modules)
        with _counted(model, trace, family, modules):
            yield


@contextmanager
def _counted(
    model: Any, trace: Trace, family: str, modules: list[tuple[str, Any]]
) -> Iterator[None]:
    """Count the attention calls of the block into ``trace.meta["hf_calls"]``; a model that
    ran but never called qkv's attention is an error."""
    counter = [0]
    runs = [0]
    rope = rotates_positions(model)
    projections = {id(m): _projection_facts(path, m, rope=rope) for path, m in modules}

    def count_run(*_: Any) -> None:
        runs[0] += 1

    handle = model.register_forward_pre_hook(count_run)
    token = _calls.set(counter)
    projections_token = _projections.set(projections)
    try:
        yield
        if runs[0] and not counter[0]:
            raise ValueError(
                f"tracing(model=...): the {family} model ran {runs[0]} time(s) but never "
                "called qkv's attention function, so nothing was recorded. Hint: this family "
                "does not use transformers' AttentionInterface; see docs/hf.md for those that do."
            )
        trace.meta.setdefault("hf_calls", 0)
        trace.meta["hf_calls"] += counter[0]
    finally:
        _projections.reset(projections_token)
        _calls.reset(token)
        handle.remove()


def _register() -> None:
    """Register the attention and mask functions (both, always together) and the adapter."""
    transformers = require("transformers", feature="qkv.hf", extra="hf")
    from transformers.masking_utils import AttentionMaskInterface

    register: Callable[..., None] = transformers.AttentionInterface.register
    register(IMPLEMENTATION, qkv_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, qkv_mask)
    register_model_adapter("transformers", _adapt)


_register()
