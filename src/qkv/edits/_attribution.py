"""What each head writes straight into an answer's logit: direct logit attribution.

:func:`logit_attribution` is direct logit attribution as TransformerLens computes it
(``cache.stack_head_results`` then ``cache.logit_attrs``): head ``h`` of layer ``l`` writes
``o = c_h · W_O[h]`` into the residual stream at the answer's position (``c_h``: its (D,)
context, ``W_O[h]``: its D rows of the output projection, the bias left out). Its direct
effect on the logit of token ``t`` is that vector through the final norm, with the norm's
scale *frozen* at the one the full residual ``x`` got (``apply_ln_to_stack``: the norm made
linear), and the unembedding:

    LayerNorm   ((o − mean(o)) / s) · (γ ⊙ W_U[t]),   s = √(var(x) + ε)
    RMSNorm     (o / s) · (γ ⊙ W_U[t]),                s = √(mean(x²) + ε)

With ``wrong``, ``W_U[t]`` becomes ``W_U[t] − W_U[wrong]`` (a logit difference). The norm's
β, the output projections' biases and the unembedding's bias belong to no head: with the
embeddings and the MLPs they make the rest of the logit (:attr:`HeadAttribution.rest`).

The heads' contexts come from the editor hook while the model runs on its fast path
(``docs/architecture.md``, "Inside qkv.intervene"); inside a ``qkv.intervene`` block they
are the edited ones. Everything after is computed in float64 at one position, and checked
as it is read: the output projection's input is the heads' contexts, the norm computes what
is folded, the unembedding is linear and reads the norm's output.

A score split into its query and key coordinates' terms is :mod:`qkv.edits._score_terms`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from qkv._edit_point import Editor, EditSite, active_editor, editing
from qkv._extras import require
from qkv.edits._model import Layers, layers_of, routed_model, run_model

__all__ = ["FAMILIES", "HeadAttribution", "logit_attribution"]

FAMILIES = {
    "gpt2": "ln_f",
    "llama": "norm",
    "mistral": "norm",
    "qwen2": "norm",
    "qwen3": "norm",
    "gpt_oss": "norm",
}
"""The Hugging Face families whose heads' outputs join the residual stream unchanged (no
norm after attention, as Gemma 2 has), by ``model_type``: the name of the final norm in
their base model."""

_PROJECTIONS = ("o_proj", "out_proj", "c_proj", "dense", "o")
"""The names of an attention module's output projection, in the order looked for."""


@dataclass(frozen=True)
class HeadAttribution:
    """Each head's direct effect on a logit (or a logit difference) at one position.

    Attributes:
        values: (layers, heads) float64, the mean over the batch (NaN past a layer's
            heads, when layers differ).
        by_prompt: (B, layers, heads) float64, per prompt.
        logit: (B,) float64, the unembedding's output there: the logit of ``answer``
            (minus that of ``wrong``), which the heads' values and :attr:`rest` add up to.
        answer, wrong: the token ids, one per prompt (``wrong``: None without one).
        position: the position read (as given: -1 is the last).
        layers: the attention layers' module paths (the rows).
        folding: how the final norm was folded, in words.
    """

    values: Any
    by_prompt: Any
    logit: Any
    answer: tuple[int, ...]
    wrong: tuple[int, ...] | None
    position: int
    layers: tuple[str, ...]
    folding: str

    @property
    def rest(self) -> Any:
        """(B,): the part of :attr:`logit` no head writes directly (embeddings, MLPs,
        biases, the norm's β)."""
        return self.logit - self.by_prompt.nan_to_num().sum(dim=(1, 2))

    def top(self, count: int = 5) -> list[tuple[int, int, float]]:
        """The ``count`` heads of largest effect (by absolute value): (layer, head, value)."""
        flat = self.values.nan_to_num(nan=0.0).flatten()
        order = flat.abs().argsort(descending=True)[:count].tolist()
        heads = int(self.values.shape[1])
        return [(i // heads, i % heads, float(flat[i])) for i in order]


class _Reader:
    """An editor that edits nothing: each layer's (B, H, D) contexts at one position (after
    the edits of an enclosing ``qkv.intervene`` block)."""

    def __init__(self, layers: Layers, position: int, outer: Editor | None) -> None:
        self.layers, self.position, self.outer = layers, position, outer
        self._index = {id(m): i for i, m in enumerate(layers.modules)}
        self.contexts: dict[int, Any] = {}
        self.problem: str | None = None

    def __call__(self, site: EditSite) -> tuple[Any, Any]:
        context, weights = (site.context, site.weights) if self.outer is None else self.outer(site)
        layer = self._index.get(id(site.module))
        if layer is None:
            return context, weights
        q_len = int(context.shape[2])
        if layer in self.contexts:
            self.problem = f"layer {self.layers.paths[layer]!r} ran twice in one forward"
        elif not -q_len <= self.position < q_len:
            self.problem = f"position {self.position} is not among the {q_len} tokens"
        else:
            self.contexts[layer] = context[:, :, self.position].detach()  # (B, H, D)
        return context, weights


@contextmanager
def _kept(module: Any, store: dict[str, Any], name: str) -> Iterator[None]:
    """Keep ``module``'s first input and its output (detached) while the block runs."""

    def hook(_: Any, args: tuple[Any, ...], output: Any) -> None:
        store[name] = (args[0].detach(), output.detach())

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _token_ids(value: object, name: str, batch: int | None, where: str) -> tuple[int, ...]:
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    bad = [v for v in items if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if not items or bad:
        raise TypeError(
            f"{where}: {name} must be a token id (an integer from 0) or one per prompt, got "
            f"{value!r}. Hint: tokenizer.convert_tokens_to_ids('Ġmat')."
        )
    if batch is not None and len(items) not in (1, batch):
        raise ValueError(
            f"{where}: {name} gives {len(items)} token ids for a batch of {batch}. Hint: one "
            "id for every prompt, or one per prompt."
        )
    return tuple(v for v in items if isinstance(v, int))


def _batch_of(inputs: Any) -> int | None:
    ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else inputs
    if isinstance(inputs, tuple) and inputs:
        ids = inputs[0]
    shape = getattr(ids, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) >= 2 else None


def _output_head(model: Any, layers: Layers, norm: Any, unembed: Any, where: str) -> Any:
    """The final norm and the unembedding: given, or found in a family of :data:`FAMILIES`."""
    torch = require("torch", feature="qkv.edits.logit_attribution", extra="torch")
    if layers.hf:
        kind = getattr(getattr(model, "config", None), "model_type", None)
        if kind not in FAMILIES:
            known = ", ".join(FAMILIES)
            raise ValueError(
                f"{where}: a {kind} model; qkv folds the final norm of the families whose "
                f"heads write straight into the residual stream: {known}. Hint: one of those "
                "(a model of another family may put a norm after attention)."
            )
        norm = getattr(model.base_model, FAMILIES[kind]) if norm is None else norm
        unembed = model.get_output_embeddings() if unembed is None else unembed
    for name, module in (("norm", norm), ("unembed", unembed)):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"{where}: {name} must be the model's {_ROLE[name]} (a torch.nn.Module), got "
                f"{type(module).__name__}. Hint: norm=model.ln_f (torch.nn.Identity() when "
                "there is none), unembed=model.lm_head; a Hugging Face ...ForCausalLM "
                "model needs neither."
            )
    return norm, unembed


_ROLE = {"norm": "final norm", "unembed": "unembedding (the Linear that makes the logits)"}


def _projection(module: Any, path: str, where: str) -> Any:
    """(H·D, E): the rows of an attention module's output projection, as ``x @ W``."""
    torch = require("torch", feature="qkv.edits.logit_attribution", extra="torch")
    for name in _PROJECTIONS:
        found = getattr(module, name, None)
        weight = getattr(found, "weight", None)
        if isinstance(found, torch.nn.Linear) and weight is not None:
            return found, weight.detach().T
        if type(found).__name__ == "Conv1D" and weight is not None and weight.ndim == 2:
            return found, weight.detach()  # transformers' Conv1D: x @ weight + bias
    raise ValueError(
        f"{where}: the attention layer {path!r} has no output projection qkv knows "
        f"({', '.join(_PROJECTIONS)}). Hint: a qkv.nn.MultiHeadAttention or a model of "
        "qkv.edits.FAMILIES."
    )


def _norm_form(norm: Any, where: str) -> tuple[str, Any, Any, float]:
    """(kind, γ, β, ε) of the final norm: ``"none"``, ``"layer"`` or ``"rms"``."""
    torch = require("torch", feature="qkv.edits.logit_attribution", extra="torch")
    if isinstance(norm, torch.nn.Identity):
        return "none", None, None, 0.0
    weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
    if isinstance(norm, torch.nn.LayerNorm):
        return "layer", weight, bias, float(norm.eps)
    name = type(norm).__name__
    if isinstance(norm, torch.nn.RMSNorm) or name.endswith("RMSNorm"):
        eps = getattr(norm, "eps", None)
        eps = getattr(norm, "variance_epsilon", None) if eps is None else eps
        if eps is None and isinstance(norm, torch.nn.RMSNorm):
            eps = torch.finfo(weight.dtype if weight is not None else torch.float32).eps
        if isinstance(eps, (int, float)):
            return "rms", weight, None, float(eps)
    raise ValueError(
        f"{where}: the final norm is a {name}, which qkv does not fold. Hint: a "
        "torch.nn.LayerNorm, an RMSNorm (weight · x / rms(x)), or torch.nn.Identity()."
    )


def _close(found: Any, wanted: Any) -> bool:
    """Equal to the rounding of float32 (or of the inputs' dtype, if coarser)."""
    torch = require("torch", feature="qkv.edits.logit_attribution", extra="torch")
    eps = max(torch.finfo(found.dtype).eps, torch.finfo(torch.float32).eps)
    size = max(1.0, float(wanted.abs().max())) if wanted.numel() else 1.0
    return bool((found - wanted).abs().max() <= 1e3 * eps * size) if found.numel() else True


def _folded(form: tuple[str, Any, Any, float], x: Any) -> tuple[Any, Any, Any]:
    """(scale s (B, 1), γ (E,) or None, the norm's output recomputed (B, E)), float64."""
    kind, gamma, beta, eps = form
    if kind == "none":
        return x.new_ones((x.shape[0], 1)), None, x
    centered = x - x.mean(-1, keepdim=True) if kind == "layer" else x
    s = (centered.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    y = centered / s
    g = None if gamma is None else gamma.detach().double()
    y = y if g is None else y * g
    return s, g, y if beta is None else y + beta.detach().double()


def logit_attribution(
    model: Any,
    inputs: Any,
    answer: int | Sequence[int],
    *,
    wrong: int | Sequence[int] | None = None,
    position: int = -1,
    norm: Any = None,
    unembed: Any = None,
) -> HeadAttribution:
    """Each head's direct effect on the logit of ``answer`` at ``position`` (see the module
    docstring for the folding, TransformerLens's ``logit_attrs``).

    Args:
        model: a Hugging Face ...ForCausalLM of :data:`FAMILIES`, or a model of ``qkv.nn``
            modules whose attention outputs are added to its residual stream (then give
            ``norm`` and ``unembed``).
        inputs: what the model takes (a tokenizer's output, a tuple or a tensor), one
            forward over whole sequences (no cache).
        answer: a token id, or one per prompt.
        wrong: with it, the effect on ``logit[answer] − logit[wrong]``.
        position: the position whose logit is read (-1: the last; it must be a real token
            in every prompt: pad on the left).
        norm, unembed: the final norm (``torch.nn.Identity()`` if there is none) and the
            module that makes the logits, ``x @ weight.T + bias`` with weight (V, E).

    Returns:
        A :class:`HeadAttribution`; ``values`` (layers, heads).

    Raises:
        ValueError, TypeError: a family or norm qkv does not fold, a position that is
            padding, token ids out of the vocabulary, or a model whose run does not match
            the folding (the check names what differs).

    Example:
        >>> import torch, qkv
        >>> from torch import nn
        >>> class Tiny(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.embed = nn.Embedding(10, 8)
        ...         self.attn = qkv.nn.MultiHeadAttention(8, num_heads=2)
        ...         self.ln, self.head = nn.LayerNorm(8), nn.Linear(8, 10)
        ...     def forward(self, ids):
        ...         x = self.embed(ids)
        ...         return self.head(self.ln(x + self.attn(x, is_causal=True)))
        >>> tiny = Tiny()
        >>> found = logit_attribution(tiny, torch.tensor([[1, 2, 3]]), 4,
        ...                           norm=tiny.ln, unembed=tiny.head)
        >>> found.values.shape                                  # (layers, heads)
        torch.Size([1, 2])
    """
    where = "logit_attribution(model, inputs, answer)"
    torch = require("torch", feature="qkv.edits.logit_attribution", extra="torch")
    if isinstance(position, bool) or not isinstance(position, int):
        raise TypeError(
            f"{where}: position must be a token position (an integer), got {position!r}. "
            "Hint: position=-1 is the last token."
        )
    batch = _batch_of(inputs)
    answers = _token_ids(answer, "answer", batch, where)
    wrongs = None if wrong is None else _token_ids(wrong, "wrong", batch, where)
    layers = layers_of(model, where)
    if not layers.hf and (norm is None or unembed is None):
        raise ValueError(
            f"{where}: a {type(model).__name__} of qkv.nn modules: give its norm= and "
            "unembed=. Hint: norm=model.ln_f (torch.nn.Identity() when there is none), "
            "unembed=model.lm_head."
        )
    norm, unembed = _output_head(model, layers, norm, unembed, where)
    form = _norm_form(norm, where)
    projections = [
        _projection(m, p, where) for p, m in zip(layers.paths, layers.modules, strict=True)
    ]
    _check_padding(inputs, position, where)
    reader = _Reader(layers, position, active_editor())
    kept: dict[str, Any] = {}
    with ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(routed_model(model, layers, where))
        stack.enter_context(editing(reader))
        stack.enter_context(_kept(norm, kept, "norm"))
        stack.enter_context(_kept(unembed, kept, "unembed"))
        for i, (module, _) in enumerate(projections):
            stack.enter_context(_kept(module, kept, f"projection {i}"))
        run_model(model, inputs)
    if reader.problem is not None or len(reader.contexts) != len(layers.paths):
        missing = reader.problem or "some attention layers did not run"
        raise ValueError(f"{where}: {missing}. Hint: one forward over whole sequences.")
    x, u = _residual(kept, form, unembed, position, answers, wrongs, where)
    s, gamma, _ = _folded(form, x)
    direction = u if gamma is None else u * gamma  # (B, E): γ ⊙ (W_U[t] − W_U[w])
    rows = []
    for i, (_, weight) in enumerate(projections):
        context = reader.contexts[i]  # (B, H, D)
        _check_projection(kept[f"projection {i}"][0], context, position, layers.paths[i], where)
        heads, width = int(context.shape[1]), int(context.shape[2])
        w = weight.double().reshape(heads, width, -1)  # (H, D, E)
        out = torch.einsum("bhd,hde->bhe", context.double(), w)  # each head's output
        if form[0] == "layer":
            out = out - out.mean(-1, keepdim=True)
        rows.append(torch.einsum("bhe,be->bh", out, direction) / s)
    most = max(int(r.shape[1]) for r in rows)
    nan = torch.full((rows[0].shape[0], most), float("nan"), dtype=torch.float64)
    by_prompt = torch.stack(
        [torch.cat((r.cpu(), nan[:, int(r.shape[1]) :]), dim=1) for r in rows], dim=1
    )
    logits = kept["unembed"][1][:, position].double()  # (B, V)
    index = torch.tensor(answers).expand(logits.shape[0])
    logit = logits.gather(1, index[:, None].to(logits.device))[:, 0]
    if wrongs is not None:
        other = torch.tensor(wrongs).expand(logits.shape[0])[:, None].to(logits.device)
        logit = logit - logits.gather(1, other)[:, 0]
    return HeadAttribution(
        values=by_prompt.mean(0),
        by_prompt=by_prompt,
        logit=logit.cpu(),
        answer=answers,
        wrong=wrongs,
        position=position,
        layers=layers.paths,
        folding=_words(form, norm, unembed, wrongs is not None),
    )


def _check_padding(inputs: Any, position: int, where: str) -> None:
    mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
    if mask is None or not -int(mask.shape[-1]) <= position < int(mask.shape[-1]):
        return
    padded = (mask[..., position] == 0).reshape(-1).nonzero().reshape(-1).tolist()
    if padded:
        raise ValueError(
            f"{where}: position {position} is padding in prompt {padded[0]}. Hint: pad on "
            "the left (tokenizer.padding_side = 'left'), so that -1 is every prompt's last "
            "token."
        )


def _residual(
    kept: dict[str, Any],
    form: tuple[str, Any, Any, float],
    unembed: Any,
    position: int,
    answers: tuple[int, ...],
    wrongs: tuple[int, ...] | None,
    where: str,
) -> tuple[Any, Any]:
    """The final residual x (B, E) at ``position`` and the unembedding's direction u (B, E),
    float64, after checking that the norm and the unembedding compute what is folded."""
    torch = require("torch", feature="qkv.edits.logit_attribution", extra="torch")
    if "norm" not in kept or "unembed" not in kept:
        raise ValueError(
            f"{where}: the {'final norm' if 'norm' not in kept else 'unembedding'} did not "
            "run. Hint: give the norm and unembed modules the model's forward calls."
        )
    (x, y), (read, logits) = kept["norm"], kept["unembed"]
    length = int(x.shape[1])
    if not -length <= position < length or int(read.shape[1]) != length:
        raise ValueError(
            f"{where}: position {position}: the norm saw {length} positions and the "
            f"unembedding {int(read.shape[1])}. Hint: a position from {-length} to "
            f"{length - 1}, with logits at every position."
        )
    x, y, read = x[:, position].double(), y[:, position].double(), read[:, position].double()
    if not _close(_folded(form, x)[2], y):
        raise ValueError(
            f"{where}: the final norm does not compute what qkv folds for a "
            f"{_NORM_WORDS[form[0]]}. Hint: a torch.nn.LayerNorm, an RMSNorm "
            "(weight · x / rms(x)), or torch.nn.Identity()."
        )
    if not _close(read, y):
        raise ValueError(
            f"{where}: the unembedding does not read the final norm's output. Hint: give "
            "the norm whose output the unembedding reads."
        )
    weight = getattr(unembed, "weight", None)
    vocab = int(logits.shape[-1])
    if weight is None or tuple(weight.shape) != (vocab, int(read.shape[-1])):
        raise ValueError(
            f"{where}: the unembedding has no (V, E) weight for its {vocab} logits. Hint: a "
            "torch.nn.Linear(E, V)."
        )
    for token in (*answers, *(wrongs or ())):
        if token >= vocab:
            raise ValueError(
                f"{where}: token id {token} is not in the vocabulary of {vocab}. Hint: a "
                f"token id from 0 to {vocab - 1}."
            )
    w = weight.detach().double()
    bias = getattr(unembed, "bias", None)
    again = read @ w.T + (0 if bias is None else bias.detach().double())
    if not _close(again, logits[:, position].double()):
        raise ValueError(
            f"{where}: the unembedding is not x @ weight.T + bias. Hint: a torch.nn.Linear."
        )
    batch = int(x.shape[0])
    for name, ids in (("answer", answers), ("wrong", wrongs or ())):
        if len(ids) not in (0, 1, batch):
            raise ValueError(
                f"{where}: {name} gives {len(ids)} token ids for a batch of {batch}. Hint: "
                "one id for every prompt, or one per prompt."
            )
    u = w[torch.tensor(answers).expand(batch)]
    if wrongs is not None:
        u = u - w[torch.tensor(wrongs).expand(batch)]
    return x, u.to(x.device)


_NORM_WORDS = {"none": "none", "layer": "LayerNorm", "rms": "RMSNorm"}


def _check_projection(read: Any, context: Any, position: int, path: str, where: str) -> None:
    """The output projection's input at ``position`` is the heads' contexts side by side."""
    found = read[:, position]
    if found.shape[-1] != context.shape[1] * context.shape[2] or not _close(
        found.double(), context.reshape(context.shape[0], -1).double()
    ):
        raise ValueError(
            f"{where}: the output projection of {path!r} does not read the heads' contexts "
            "side by side. Hint: a qkv.nn.MultiHeadAttention or a model of qkv.edits.FAMILIES."
        )


def _words(form: tuple[str, Any, Any, float], norm: Any, unembed: Any, diff: bool) -> str:
    kind = form[0]
    target = "(W_U[answer] − W_U[wrong])" if diff else "W_U[answer]"
    if kind == "none":
        through = f"times {target} (no final norm)"
    else:
        centered = "centered, " if kind == "layer" else ""
        through = (
            f"{centered}divided by the final {_NORM_WORDS[kind]}'s scale of the full residual "
            f"at that position ({type(norm).__name__}, frozen: TransformerLens's "
            f"apply_ln_to_stack), times γ ⊙ {target}"
        )
    return (
        f"direct effect: each head's output c_h · W_O[h] (no bias), {through}, through "
        f"{type(unembed).__name__}; biases, β, embeddings and MLPs are the rest"
    )
