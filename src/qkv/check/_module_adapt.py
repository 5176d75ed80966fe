"""An attention class (a PyTorch ``nn.Module``) driven as an attention function.

``qkv check --module FILE.py:ClassName`` checks the classes courses ask for: CS231n's
``MultiHeadAttention(embed_dim, num_heads)`` with ``forward(query, key, value,
attn_mask=None)``, CS224n's ``CausalSelfAttention(config)``, the Annotated Transformer's
``MultiHeadedAttention(h, d_model)``, *LLMs from Scratch*'s ``MultiHeadAttention(d_in, d_out,
context_length, dropout, num_heads)``, nanoGPT's fused ``c_attn``, a cross-attention class
``forward(x, y, mask)``, and a single head without an output projection (Karpathy's
``Head(head_size)``). :func:`adapt_class` builds the class, finds its projections **by their
use**, and returns a function

    ``fn(X, W_q, W_k, W_v, W_o, num_heads, num_kv_heads=None, X_kv=None, mask=None)``

that builds the class for ``num_heads`` heads of the width of X, sets the projections from
the matrices (``nn.Linear`` holds Wᵀ; biases 0), calls ``forward`` on X as a batch of one
(X_kv for the keys and values when forward takes them apart, ``mask`` given to its mask
parameter as a tensor, as it comes), in float64, in eval mode, and returns the output.
Which probes, which mask convention and which calls is decided by whoever calls ``fn``
(``qkv.check._function_run``): this module decides nothing about attention.

What is understood (``docs/check-function.md``):

- **The constructor**, by parameter name: the width (``embed_dim``, ``d_model``, ``d_in``,
  ``d_out``, ``dim_in``, ``dim_out``, ``n_embd``, ``dim``, ``hidden_size``, ...), the heads
  (``num_heads``, ``h``, ``n_head``, ...), the size of a head (``head_size``, ``head_dim``,
  ...), key/value heads, the context length (16), the dropout (0.1, so that dropout left on
  shows), or one ``config`` object with those names as attributes; other parameters keep
  their defaults, and up to two required ones of other names are given the width and the
  heads, in the order that builds.
- **The projections, by their use**: forward runs once with a hook on every ``nn.Linear``;
  the layers applied to the inputs are Q, K and V (by the input they read when forward takes
  the queries apart from the keys and values, else by their names, and the value projection
  as the one whose zeroing zeroes the output), fused ones included (Q|K|V or K|V, side by
  side or per head), and the layer applied to something else whose output is forward's is
  the output projection, whatever their names. A class with no such layer is a single head.
- **forward**: ``forward(x)``, ``forward(query, key, value, mask=None)``, ``forward(x, y,
  mask=None)``; the mask parameter by its name (``mask``, ``attn_mask``, ...).
- **Causal**: a class whose name says causal, or that keeps a triangular 0/1 buffer.

This module imports nothing of qkv (it runs in the student's process, where qkv cannot be
imported): the standard library, NumPy, and torch inside the functions. Its texts are raw;
whoever shows them escapes them. A class that cannot be driven is a :class:`ModuleError`
with one line that says why.
"""

from __future__ import annotations

import inspect
import re
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["ModuleError", "ModuleFunction", "adapt_class"]

Array = NDArray[np.float64]

_WIDTH = (
    "embed_dim", "d_model", "d_in", "d_out", "dim_in", "dim_out", "in_dim", "out_dim",
    "n_embd", "embed_size", "emb_dim", "embedding_dim", "hidden_size", "hidden_dim", "dim",
    "model_dim", "d_embed", "input_dim", "n_embed", "d_hidden", "emb", "embed", "d",
    "embedding_size", "dim_model", "model_size", "in_features", "out_features", "n_embed_dim",
    "query_dim", "input_size", "output_dim", "output_size", "features", "channels",
)  # fmt: skip
_HEADS = (
    "num_heads", "n_heads", "n_head", "h", "heads", "nhead", "num_head", "head_count",
    "num_attention_heads", "nheads", "head_num", "n_attn_heads",
)  # fmt: skip
_HEAD_SIZE = ("head_size", "head_dim", "d_head", "d_k", "dim_head", "head_dimension", "d_v")
_KV_HEADS = (
    "num_kv_heads", "n_kv_heads", "num_kv_groups", "num_key_value_heads", "kv_heads",
    "n_kv_head", "num_groups",
)  # fmt: skip
_CONTEXT = (
    "context_length", "block_size", "max_len", "max_seq_len", "seq_len", "n_ctx",
    "max_length", "max_seq_length", "context_size", "max_position_embeddings", "cxt_len",
)  # fmt: skip
_DROPOUT = ("dropout", "attn_pdrop", "dropout_rate", "p_drop", "attn_dropout", "drop_prob",
            "dropout_p", "attention_dropout", "resid_pdrop", "p", "dr")  # fmt: skip
_CONFIG = ("config", "cfg", "args", "params", "hparams", "conf")
_MASKS = (
    "mask", "attn_mask", "attention_mask", "src_mask", "tgt_mask", "look_ahead_mask",
    "causal_mask", "self_attn_mask", "m",
)  # fmt: skip
_CONTEXT_LENGTH = 16  # at least the probes' tokens
_DROPOUT_P = 0.1  # not 0: dropout left on at inference must show
_TRIAL_WIDTH, _TRIAL_HEADS = 16, 4

_ROLE = {
    "q": re.compile(r"(w_?)?q(uer(y|ies))?(_?(proj|linear|layer|lin|dense|fc|w|weight))?|"
                    r"(to|proj|linear|lin|fc)_?q(uer(y|ies))?|wq|query_key_value_q"),
    "k": re.compile(r"(w_?)?k(eys?)?(_?(proj|linear|layer|lin|dense|fc|w|weight))?|"
                    r"(to|proj|linear|lin|fc)_?k(eys?)?|wk"),
    "v": re.compile(r"(w_?)?v(alues?)?(_?(proj|linear|layer|lin|dense|fc|w|weight))?|"
                    r"(to|proj|linear|lin|fc)_?v(alues?)?|wv"),
}  # fmt: skip


class ModuleError(ValueError):
    """An attention class qkv cannot build or drive: one line that says why and what it
    understands (raw: the class's own names are not escaped here)."""


@dataclass(frozen=True)
class ModuleFunction:
    """A class driven as an attention function. Every field but ``fn`` is a JSON scalar.

    Attributes:
        fn: ``fn(X, W_q, W_k, W_v, W_o, num_heads, num_kv_heads=None, X_kv=None,
            mask=None)`` → the output, (Lq, E) (kind head: (Lq, head_size); W_o unused).
        kind: ``multi-head``; ``gqa`` for a class with key/value heads of its own; ``head``
            for a single head without an output projection.
        causal: whether the class is causal attention (by its name or a triangular buffer).
        about: how it was driven, for the report.
        takes_mask: forward has a mask parameter, which ``fn``'s ``mask`` reaches.
        cross: forward takes the queries apart from the keys and values: ``fn``'s X_kv
            reaches the keys' and values' projections.
        width: the width of the input the class was built for (kind head: the class's own
            model width when the file fixes it).
        head_size: kind head: the head's size to probe with: the one ``fn`` builds the class
            with (that of W_q's columns) when its constructor takes one, else the class's
            own; 0 for other kinds.
    """

    fn: Callable[..., Array]
    kind: str
    causal: bool
    about: str
    takes_mask: bool = False
    cross: bool = False
    width: int = _TRIAL_WIDTH
    head_size: int = 0


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ModuleError(
            "qkv check --module needs PyTorch, which is not installed. Hint: pip install torch"
        ) from None
    return torch


def _raised(exc: BaseException) -> str:
    """``"TypeError: the message"`` of the student's exception, raw (the caller escapes)."""
    try:
        text = str(exc)
    except Exception:  # a __str__ of the student's own that raises
        text = ""
    name = type(exc).__name__
    text = " ".join(text.split())[:300]
    return f"{name}: {text}" if text else name


def _config(values: dict[str, Any]) -> types.SimpleNamespace:
    """A config object with every name the courses' configs use."""
    names = dict.fromkeys(_WIDTH, values["width"])
    names.update(dict.fromkeys(_HEADS, values["heads"]))
    names.update(dict.fromkeys(_HEAD_SIZE, values["head_size"]))
    names.update(dict.fromkeys(_KV_HEADS, values["kv_heads"]))
    names.update(dict.fromkeys(_CONTEXT, _CONTEXT_LENGTH))
    names.update(dict.fromkeys(_DROPOUT, _DROPOUT_P))
    names.update(bias=False, vocab_size=32, n_layer=1, flash=False, causal=values["causal"])
    return types.SimpleNamespace(**names)


def _parameters(cls: type) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        raise ModuleError(f"cannot read the constructor of {cls.__name__}") from None


def _arguments(cls: type, values: dict[str, Any], order: tuple[str, ...]) -> dict[str, Any]:
    """The constructor's arguments, by parameter name; required parameters of other names
    take the values named in ``order`` (width, heads), one each, in turn."""
    kwargs: dict[str, Any] = {}
    unknown: list[str] = []
    for p in _parameters(cls):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        name = p.name.lower()
        if name in _WIDTH:
            kwargs[p.name] = values["width"]
        elif name in _HEADS:
            kwargs[p.name] = values["heads"]
        elif name in _HEAD_SIZE:
            kwargs[p.name] = values["head_size"]
        elif name in _KV_HEADS:
            if values["kv_heads"] is None:
                continue
            kwargs[p.name] = values["kv_heads"]
        elif name in _CONTEXT:
            kwargs[p.name] = _CONTEXT_LENGTH
        elif name in _DROPOUT:
            kwargs[p.name] = _DROPOUT_P
        elif name in _CONFIG:
            kwargs[p.name] = _config(values)
        elif p.default is inspect.Parameter.empty:
            unknown.append(p.name)
    if len(unknown) > len(order):
        raise ModuleError(
            f"cannot build {cls.__name__}: its constructor takes {unknown[len(order)]!r}, "
            "which qkv does not know. Hint: qkv passes the width (embed_dim, d_model, d_in, "
            "dim_in, n_embd, ...), the heads (num_heads, h, n_head, ...), head_size, "
            "context_length, dropout, or one config object; give the other parameters "
            "defaults"
        )
    for name, what in zip(unknown, order, strict=False):
        kwargs[name] = values[what]
    return kwargs


def _takes_kv_heads(cls: type) -> bool:
    return bool({p.name.lower() for p in _parameters(cls)} & set(_KV_HEADS))


def _orders(cls: type) -> list[tuple[str, ...]]:
    """The ways to give required parameters of unknown names the width and the heads."""
    known = set(_WIDTH + _HEADS + _HEAD_SIZE + _KV_HEADS + _CONTEXT + _DROPOUT + _CONFIG)
    unknown = [
        p
        for p in _parameters(cls)
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and p.name.lower() not in known
        and p.default is inspect.Parameter.empty
    ]
    names = {p.name.lower() for p in _parameters(cls)}
    if not unknown or names & set(_WIDTH + _CONFIG):  # only a constructor without a width
        return [()]
    if len(unknown) == 1:
        return [("width",), ("heads",)]
    return [("width", "heads"), ("heads", "width")]


def _build(cls: type, values: dict[str, Any], order: tuple[str, ...]) -> Any:
    kwargs = _arguments(cls, values, order)
    try:
        module = cls(**kwargs)
    except Exception as exc:  # the student's constructor may raise anything
        shown = ", ".join(
            f"{k}=config" if isinstance(v, types.SimpleNamespace) else f"{k}={v!r}"
            for k, v in kwargs.items()
        )
        raise ModuleError(f"building {cls.__name__}({shown}) raised {_raised(exc)}") from None
    return module.double().eval()


def _values(
    width: int, heads: int, head_size: int, kv_heads: int | None, causal: bool
) -> dict[str, Any]:
    return {
        "width": width,
        "heads": heads,
        "head_size": head_size,
        "kv_heads": kv_heads,
        "causal": causal,
    }


def _linears(module: Any) -> dict[str, Any]:
    torch = _torch()
    return {n: m for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)}


# ----------------------------------------------------------------------------- forward


@dataclass(frozen=True)
class _Plan:
    """How forward is called: its input parameters (names, in order), and its mask
    parameter (name and position), or None."""

    inputs: tuple[str, ...]
    mask: str | None
    order: tuple[str, ...]  # every positional parameter up to the last one given

    @property
    def cross(self) -> bool:
        return len(self.inputs) > 1


def _plan(module: Any) -> _Plan:
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        raise ModuleError(f"cannot read the forward of {type(module).__name__}") from None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    mask = next((p.name for p in positional if p.name.lower() in _MASKS), None)
    required = [
        p.name for p in positional if p.default is inspect.Parameter.empty and p.name != mask
    ]
    if len(required) == 1:  # forward(query, key=None, value=None): given apart, as meant
        names = [p.name.lower() for p in positional]
        later = [p.name for p in positional[1:] if p.name != mask]
        if len(later) >= 2 and names[1].startswith("k") and names[2].startswith("v"):
            required += later[:2]
    three = [n.lower() for n in required]
    named = len(required) != 3 or all(n.startswith(c) for n, c in zip(three, "qkv", strict=True))
    if not 1 <= len(required) <= 3 or not named:
        shown = ", ".join(p.name for p in params)
        raise ModuleError(
            f"cannot call {type(module).__name__}.forward({shown}): qkv calls forward(x), "
            "forward(x, y, mask=None) or forward(query, key, value, mask=None). Hint: give "
            "the other parameters defaults"
        )
    used = set(required) | ({mask} if mask else set())
    last = max(i for i, p in enumerate(positional) if p.name in used)
    return _Plan(tuple(required), mask, tuple(p.name for p in positional[: last + 1]))


def _call(module: Any, plan: _Plan, tensors: dict[str, Any], mask: Any) -> Any:
    """forward with every input given by position (a parameter not given: its default)."""
    args = []
    for name in plan.order:
        if name in tensors:
            args.append(tensors[name])
        elif name == plan.mask:
            args.append(mask)
        else:
            default = inspect.signature(module.forward).parameters[name].default
            args.append(default)
    return module(*args)


def _output(result: Any) -> Array:
    if isinstance(result, (tuple, list)) and result:
        result = result[0]
    if not hasattr(result, "detach"):
        raise ModuleError(f"forward returned {type(result).__name__}, not a tensor")
    out: Array = result.detach().cpu().double().numpy()
    if out.ndim == 3 and out.shape[0] == 1:
        out = out[0]
    return out


# ------------------------------------------------------------------------- projections


@dataclass(frozen=True)
class _Projections:
    """Where the projections are, by layer name: per role (q, k, v, o) the layers whose
    output columns make it (one per head for a list of heads), and fused layers."""

    layers: dict[str, list[str]]
    fused: str | None = None  # Q|K|V in one layer
    fused_kv: str | None = None  # K|V in one layer
    inputs: dict[str, str] = field(default_factory=dict)  # forward's input → "q" or "kv"

    @property
    def names(self) -> tuple[str, ...]:
        found = [n for r in "qkv" for n in self.layers.get(r, [])]
        found += [n for n in (self.fused, self.fused_kv) if n]
        return (*found, *self.layers.get("o", []))


def _role(name: str) -> str | None:
    last = name.split(".")[-1].lower()
    for role in ("q", "k", "v"):
        if _ROLE[role].fullmatch(last):
            return role
    return None


def _trace(module: Any, plan: _Plan, tensors: dict[str, Any]) -> tuple[list[tuple[str, str]], Any]:
    """Run forward once with a hook on every nn.Linear: per layer called, in order, its name
    and the forward input it read ('' when it read something else); and the result."""
    torch = _torch()
    seen: list[tuple[str, str]] = []
    handles = []

    def hook(name: str) -> Callable[..., None]:
        def record(layer: Any, inputs: tuple[Any, ...], output: Any) -> None:
            given = inputs[0] if inputs else None
            which = next(
                (
                    key
                    for key, t in tensors.items()
                    if isinstance(given, torch.Tensor)
                    and given.shape == t.shape
                    and bool(torch.equal(given, t))
                ),
                "",
            )
            if all(n != name for n, _ in seen):
                seen.append((name, which))

        return record

    for name, layer in _linears(module).items():
        handles.append(layer.register_forward_hook(hook(name)))
    try:
        result = _once(module, plan, tensors)
    finally:
        for handle in handles:
            handle.remove()
    return seen, result


def _nothing_masked(plan: _Plan, tensors: dict[str, Any]) -> list[Any]:
    """Masks that mask nothing, in each convention a forward may read (to run it once)."""
    torch = _torch()
    if plan.mask is None:
        return [None]
    lengths = [t.shape[1] for t in tensors.values()]
    shape = (lengths[0], lengths[-1])
    return [
        None,
        torch.zeros(shape, dtype=torch.float64),  # added to the scores
        torch.ones(shape, dtype=torch.bool),  # True = may attend
        torch.zeros(shape, dtype=torch.bool),  # True = masked
    ]


def _once(module: Any, plan: _Plan, tensors: dict[str, Any]) -> Any:
    """forward once, without a mask or, if it needs one, with one that masks nothing."""
    torch = _torch()
    first: BaseException | None = None
    for mask in _nothing_masked(plan, tensors):
        try:
            with torch.no_grad():
                result = _call(module, plan, tensors, mask)
            if np.isfinite(_output(result)).all():
                return result
        except ModuleError:
            raise
        except Exception as exc:  # the student's forward may raise anything
            first = first or exc
    if first is None:
        return result
    raise ModuleError(f"calling {type(module).__name__}.forward raised {_raised(first)}")


def _inputs(plan: _Plan, length: int, width: int) -> dict[str, Any]:
    torch = _torch()
    generator = torch.Generator().manual_seed(11)
    return {
        name: torch.randn(1, length, width, generator=generator, dtype=torch.float64)
        for name in plan.inputs
    }


def _find(module: Any, plan: _Plan, width: int) -> _Projections:
    """The projections of a built class, by their use (raises ModuleError when they cannot
    be told)."""
    layers = _linears(module)
    if not layers:
        raise ModuleError(
            f"{type(module).__name__} has no nn.Linear layer: qkv sets Q, K, V and the output "
            "projection through nn.Linear layers. Hint: make W_q, W_k, W_v (and W_o) "
            "nn.Linear layers, or check a function with --function"
        )
    # 4 tokens, as many as a trial head's size: Q·K without the transpose runs too
    tensors = _inputs(plan, _TRIAL_WIDTH // _TRIAL_HEADS, width)
    try:
        seen, result = _trace(module, plan, tensors)
    except ModuleError:
        tensors = _inputs(plan, 5, width)
        seen, result = _trace(module, plan, tensors)
    out = _output(result)
    applied = [(n, which) for n, which in seen if which]
    after = [n for n, which in seen if not which]
    unread = [name for name in plan.inputs if all(which != name for _, which in applied)]
    if unread:
        raise ModuleError(
            f"cannot call {type(module).__name__}.forward({', '.join(plan.order)}): no "
            f"nn.Linear reads {unread[0]!r}, and qkv calls forward(x), forward(x, y, "
            "mask=None) or forward(query, key, value, mask=None) with the inputs the "
            "projections read. Hint: give the other parameters defaults"
        )
    output = _output_layer(module, plan, tensors, after, out)
    # which input holds the queries, which the keys and values
    roles_of_input = _input_roles(plan, applied, layers)
    by_role: dict[str, list[str]] = {}
    fused = fused_kv = None
    for name, which in applied:
        role = roles_of_input[which]
        if role == "qkv":
            fused = name
        elif role == "kv":
            fused_kv = name
        elif role in ("q", "k", "v"):
            by_role.setdefault(role, []).append(name)
        else:  # self-attention ("x"), or the keys' and values' input ("?kv"): by use
            by_role.setdefault("?", []).append(name)
    unnamed = by_role.pop("?", [])
    kv_input = "?kv" in roles_of_input.values()
    if unnamed:
        if len(unnamed) == 1 and not kv_input:
            fused = unnamed[0]
        else:
            _split_roles(module, plan, tensors, unnamed, by_role, kv_only=kv_input)
    found = _Projections(
        {r: by_role[r] for r in "qkv" if r in by_role} | ({"o": [output]} if output else {}),
        fused=fused,
        fused_kv=fused_kv,
        inputs={w: "q" if roles_of_input[w] == "q" else "kv" for w in plan.inputs},
    )
    if fused is None and not all(r in found.layers or (r in "kv" and fused_kv) for r in "qkv"):
        missing = [r for r in "qkv" if r not in found.layers and not (r in "kv" and fused_kv)]
        what = {"q": "W_q", "k": "W_k", "v": "W_v"}
        raise ModuleError(
            f"cannot tell which nn.Linear of {type(module).__name__} is "
            f"{', '.join(what[r] for r in missing)} (the layers forward applied to its input: "
            f"{', '.join(n for n, _ in applied) or 'none'}). Hint: name them query, key and "
            "value (or W_query, q_proj, ...), or project each input with its own nn.Linear"
        )
    return found


def _output_layer(
    module: Any, plan: _Plan, tensors: dict[str, Any], after: list[str], out: Array
) -> str | None:
    """The layer applied to the merged heads: of the layers applied to something other than
    forward's inputs, the one whose output is forward's; else the last of them."""
    if not after:
        return None
    layers = _linears(module)
    outputs: dict[str, Any] = {}

    def keep(name: str) -> Callable[..., None]:
        def record(layer: Any, inputs: Any, output: Any) -> None:  # returns None: output kept
            outputs.setdefault(name, output.detach().cpu().double().numpy())

        return record

    handles = [layers[n].register_forward_hook(keep(n)) for n in after]
    try:
        _once(module, plan, tensors)
    finally:
        for handle in handles:
            handle.remove()
    for name in reversed(after):
        got = outputs.get(name)
        if got is not None and got.size == out.size and np.array_equal(got.reshape(out.shape), out):
            return name
    return after[-1]


def _input_roles(
    plan: _Plan, applied: list[tuple[str, str]], layers: dict[str, Any]
) -> dict[str, str]:
    """What each of forward's inputs holds: ``x`` (self-attention: everything), or ``q``,
    ``k``, ``v``, ``kv`` (keys and values), ``qkv``; a fused layer reads one input."""
    if len(plan.inputs) == 1:
        name = plan.inputs[0]
        used = [n for n, w in applied if w == name]
        if len(used) == 1:
            return {name: "qkv"}
        return {name: "x"}
    if len(plan.inputs) == 3:  # forward(query, key, value), in that order
        return dict(zip(plan.inputs, ("q", "k", "v"), strict=True))
    # two inputs: the one read by one layer as wide as the width is the queries'
    first, second = plan.inputs
    count = {w: [n for n, x in applied if x == w] for w in plan.inputs}
    widths = {w: sum(layers[n].out_features for n in count[w]) for w in plan.inputs}
    if len(count[first]) == 1 and widths[second] == 2 * widths[first]:
        query = first
    elif len(count[second]) == 1 and widths[first] == 2 * widths[second]:
        query = second
    else:
        names = [n.lower() for n in plan.inputs]
        query = second if names[0] in ("x", "memory", "context", "enc", "encoder_out") else first
        query = first if names[0].startswith("q") else query
    kv = second if query == first else first
    return {query: "q", kv: "kv" if len(count[kv]) == 1 else "?kv"}


def _split_roles(
    module: Any,
    plan: _Plan,
    tensors: dict[str, Any],
    names: list[str],
    by_role: dict[str, list[str]],
    *,
    kv_only: bool,
) -> None:
    """Tell Q, K and V apart among layers applied to one input: by their names, else the
    value projection by use (zeroing it zeroes the output), then Q before K in call order."""
    named: dict[str, list[str]] = {}
    for name in names:
        role = _role(name)
        if role is not None and not (kv_only and role == "q"):
            named.setdefault(role, []).append(name)
    wanted = "kv" if kv_only else "qkv"
    groups = len(names) // len(wanted)
    if all(len(named.get(r, [])) == groups for r in wanted) and groups * len(wanted) == len(names):
        for r in wanted:
            by_role[r] = named[r]
        return
    if len(names) != len(wanted):
        raise ModuleError(
            f"cannot tell which nn.Linear of {type(module).__name__} is which of "
            f"{', '.join('W_' + r for r in wanted)} among {', '.join(names)}. Hint: name them "
            "query, key and value"
        )
    values = [n for n in names if _zeroes_output(module, plan, tensors, n)]
    if len(values) != 1:
        raise ModuleError(
            f"cannot tell which nn.Linear of {type(module).__name__} is W_v among "
            f"{', '.join(names)}. Hint: name them query, key and value"
        )
    rest = [n for n in names if n != values[0]]
    by_role["v"] = values
    if kv_only:
        by_role["k"] = rest
    else:
        q = [n for n in rest if _role(n) == "q"] or [n for n in rest if _role(n) != "k"][:1]
        q = q or rest[:1]
        by_role["q"], by_role["k"] = q, [n for n in rest if n != q[0]]


def _zeroes_output(module: Any, plan: _Plan, tensors: dict[str, Any], name: str) -> bool:
    """Whether forward's output is all zeros with this layer's weights (and every bias)
    zero: the value projection's."""
    torch = _torch()
    saved = {n: copy_of(m) for n, m in _linears(module).items()}
    layers = _linears(module)
    with torch.no_grad():
        layers[name].weight.zero_()
        for layer in layers.values():
            if layer.bias is not None:
                layer.bias.zero_()
        try:
            out = _output(_once(module, plan, tensors))
        except Exception:  # the student's forward may raise anything: not the value then
            out = np.ones(1)
        for n, (weight, bias) in saved.items():
            layers[n].weight.copy_(weight)
            if bias is not None:
                layers[n].bias.copy_(bias)
    return bool(np.all(out == 0.0))


def copy_of(layer: Any) -> tuple[Any, Any]:
    """An nn.Linear's weight and bias (or None), copied."""
    bias = None if layer.bias is None else layer.bias.detach().clone()
    return layer.weight.detach().clone(), bias


def _set(layer: Any, w: Array) -> None:
    """Give an nn.Linear the row-vector matrix ``w`` (E_in, E_out): its weight is wᵀ."""
    torch = _torch()
    weight = torch.from_numpy(np.ascontiguousarray(w.T))
    if tuple(layer.weight.shape) != tuple(weight.shape):
        raise ModuleError(
            f"an nn.Linear of shape {tuple(layer.weight.shape)[::-1]} cannot hold a "
            f"{w.shape[0]}×{w.shape[1]} projection"
        )
    with torch.no_grad():
        layer.weight.copy_(weight)
        if layer.bias is not None:
            layer.bias.zero_()


def _interleave(parts: list[Array], heads: int) -> Array:
    """Each head's columns of every part side by side: q_h | k_h | v_h per head."""
    d = parts[0].shape[1] // heads
    return np.concatenate([p[:, h * d : (h + 1) * d] for h in range(heads) for p in parts], axis=1)


def _set_all(
    module: Any, found: _Projections, w: dict[str, Array], heads: int, kv_heads: int, layout: str
) -> None:
    """Put W_q, W_k, W_v (and W_o) into the class's layers."""
    layers = _linears(module)
    if found.fused is not None:
        parts = [w["q"], w["k"], w["v"]]
        whole = np.concatenate(parts, axis=1) if layout == "blocks" else _interleave(parts, heads)
        _set(layers[found.fused], whole)
    if found.fused_kv is not None:
        parts = [w["k"], w["v"]]
        whole = (
            np.concatenate(parts, axis=1) if layout == "blocks" else _interleave(parts, kv_heads)
        )
        _set(layers[found.fused_kv], whole)
    for role in ("q", "k", "v", "o"):
        names = found.layers.get(role, [])
        if len(names) == 1:
            _set(layers[names[0]], w[role])
        elif names:  # one layer per head: its columns of W
            count = kv_heads if role in "kv" else heads
            d = w[role].shape[1] // count
            for h, name in enumerate(names):
                _set(layers[name], w[role][:, h * d : (h + 1) * d])


def _causal(module: Any, cls: type) -> bool:
    torch = _torch()
    if "causal" in cls.__name__.lower():
        return True
    tensors = list(module.buffers()) + [
        t for t in vars(module).values() if isinstance(t, torch.Tensor)
    ]
    for buffer in tensors:
        b = buffer.detach()
        if b.ndim >= 2 and b.shape[-1] == b.shape[-2] and b.shape[-1] > 1:
            square = b.reshape(-1, b.shape[-2], b.shape[-1])[0].double()
            if not bool(((square == 0) | (square == 1)).all()):
                continue
            ones = torch.ones_like(square)
            for offset in (-1, 0, 1):  # off by one is still a causal mask, meant as one
                if bool(torch.equal(square, torch.tril(ones, diagonal=offset))):
                    return True
                if bool(torch.equal(square, torch.triu(ones, diagonal=offset))):
                    return True
    return False


# ---------------------------------------------------------------------------- the class


def adapt_class(cls: Any, *, causal: bool | None = None) -> ModuleFunction:
    """Drive the attention class ``cls`` as an attention function (see the module's help).

    Args:
        cls: the class (an ``nn.Module`` subclass).
        causal: check it as causal attention; None: as the class says (its name, or a
            triangular buffer).

    Raises:
        ModuleError: not an nn.Module class, or one qkv cannot build, find the projections
            of, or call.
    """
    torch = _torch()
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise ModuleError(
            f"{getattr(cls, '__name__', cls)!r} is not an nn.Module class. Hint: --module takes "
            "FILE.py:ClassName of a torch.nn.Module; --function takes a function"
        )
    grouped = _takes_kv_heads(cls)
    kv_trial = 2 if grouped else None
    trial, error = None, None
    order: tuple[str, ...] = ()
    for order in _orders(cls):
        values = _values(_TRIAL_WIDTH, _TRIAL_HEADS, _TRIAL_WIDTH // _TRIAL_HEADS, kv_trial, False)
        try:
            trial = _build(cls, values, order)
            break
        except ModuleError as exc:
            error = error or exc
    if trial is None:
        assert error is not None
        raise error
    is_causal = _causal(trial, cls) if causal is None else causal
    plan = _plan(trial)
    found, width, failed = None, _TRIAL_WIDTH, None
    for width in _widths(trial):  # the width built for, else one the file fixes
        try:
            found = _find(trial, plan, width)
            break
        except ModuleError as exc:
            failed = failed or exc
    if found is None:
        assert failed is not None
        raise failed
    single = "o" not in found.layers
    kind = "head" if single else "gqa" if grouped else "multi-head"
    if single and width != _TRIAL_WIDTH and _fixed_width(cls, order):
        pass  # the file fixes the width (a global n_embd): the probes take it
    elif width != _TRIAL_WIDTH:
        raise ModuleError(
            f"{cls.__name__} built for width {_TRIAL_WIDTH} reads inputs of width {width}. "
            "Hint: give its constructor the model's width (embed_dim, d_model, n_embd, ...)"
        )
    head_size = _head_size(trial, found) if single else 0
    layout = ["blocks"]
    if found.fused is not None or found.fused_kv is not None:
        size = head_size if single else width
        layout = [_fused_layout(cls, order, found, plan, size, 1 if single else 4, kv_trial, width)]

    def attention(
        X: Array, W_q: Array, W_k: Array, W_v: Array, W_o: Array | None, num_heads: int,
        num_kv_heads: int | None = None, X_kv: Array | None = None, mask: Any = None,
    ) -> Array:  # fmt: skip
        d = W_q.shape[1] // num_heads
        values = _values(X.shape[1], num_heads, d, num_kv_heads, is_causal)
        module = _build(cls, values, order)
        w = {"q": W_q, "k": W_k, "v": W_v, "o": W_o if W_o is not None else np.eye(W_q.shape[1])}
        _set_all(module, found, w, num_heads, num_kv_heads or num_heads, layout[0])
        return _run(module, plan, found, X, X_kv, mask)

    how = "forward(" + ", ".join(plan.inputs) + (f", {plan.mask}" if plan.mask else "") + ")"
    about = f"{how}; projections {', '.join(found.names)}"
    if single:
        about += " (one head, no output projection)"
    return ModuleFunction(
        attention,
        kind,
        is_causal,
        about,
        takes_mask=plan.mask is not None,
        cross=plan.cross,
        width=width,
        head_size=head_size,
    )


def _widths(module: Any) -> list[int]:
    """The input widths to try: the one the class was built for, then its layers' others."""
    others = {int(layer.in_features) for layer in _linears(module).values()} - {_TRIAL_WIDTH}
    return [_TRIAL_WIDTH, *sorted(others)]


def _fixed_width(cls: type, order: tuple[str, ...]) -> bool:
    names = {p.name.lower() for p in _parameters(cls)}
    return not names & set(_WIDTH + _CONFIG) and "width" not in order


_HEAD = 8  # the size of a single head whose size the constructor takes (≠ the width 16)


def _head_size(module: Any, found: _Projections) -> int:
    """A single head's size: :data:`_HEAD` when the constructor takes it, else its own."""
    if {p.name.lower() for p in _parameters(type(module))} & set(_HEAD_SIZE):
        return _HEAD
    layers = _linears(module)
    if "q" in found.layers:
        return int(layers[found.layers["q"][0]].out_features)
    name = found.fused or found.fused_kv
    return int(layers[name].out_features) // 3 if name else _HEAD


def _run(
    module: Any, plan: _Plan, found: _Projections, x: Array, x_kv: Array | None, mask: Any
) -> Array:
    torch = _torch()

    def tensor(a: Array) -> Any:
        return torch.from_numpy(np.array(a, dtype=np.float64))[None]  # (1, L, E)

    q = tensor(x)
    kv = q if x_kv is None else tensor(x_kv)
    if len(plan.inputs) == 1:
        tensors = {plan.inputs[0]: q}
    elif len(plan.inputs) == 3:
        tensors = dict(zip(plan.inputs, (q, kv, kv), strict=True))
    else:
        tensors = {name: q if role == "q" else kv for name, role in found.inputs.items()}
    given = None if mask is None else torch.from_numpy(np.array(mask))
    with torch.no_grad():
        result = _call(module, plan, tensors, given)
    return _output(result)


def _fused_layout(
    cls: type,
    order: tuple[str, ...],
    found: _Projections,
    plan: _Plan,
    d: int,
    heads: int,
    kv_heads: int | None,
    width: int,
) -> str:
    """Whether a fused layer holds its blocks side by side (nanoGPT: Q | K | V) or each
    head's q, k, v together (UvA's tutorial). One token attends only itself, whatever the
    scale, mask or softmax: its output is x·W_v·W_o, in the layout the class reads."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(1, width))
    w_q, w_k, w_v = (rng.normal(size=(width, d)) for _ in range(3))
    for layout in ("blocks", "heads"):
        values = _values(width, heads, d // heads, kv_heads, False)
        module = _build(cls, values, order)
        w = {"q": w_q, "k": w_k, "v": w_v, "o": np.eye(d)}
        try:
            _set_all(module, found, w, heads, kv_heads or heads, layout)
            out = _run(module, plan, found, x, None, None)
        except Exception:  # the student's forward may raise anything: the probes will say
            continue
        if out.shape == (1, d) and np.allclose(out, x @ w_v, atol=1e-9):
            return layout
    return "blocks"
