"""Build an :class:`Example` from a format-2 file (``format: 2``); format 1 is ``_format``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import yaml

from qkv.examples._format2 import (
    CLAIMABLE_2,
    check_masked_inputs,
    claimed_rows,
    direct_inputs,
    dtype_of,
    mask_option,
    names,
    precision,
)
from qkv.examples._model import Claimed, Example
from qkv.examples._nodes import NodeReader, describe, join
from qkv.examples._shapes import OPTION_KEYS, check_work, heads_of, queries_of, weights_of
from qkv.examples._tiled_format import tiled_of

__all__ = ["V2_KEYS", "build_v2"]

V2_KEYS = ("inputs", "query_tokens", "precision", "assumed", "dtype", "tiled")
"""Top-level keys that only format 2 has."""
V2_OPTIONS = (*OPTION_KEYS, "key_length", "mask", "d_k")
_ALIGNMENTS = {"top-left": "top-left", "bottom-right": "bottom-right"}

Pairs = dict[str, tuple[yaml.Node, yaml.Node]]


def _empty(rows: int, cols: int) -> np.ndarray:
    array = np.zeros((rows, cols))
    array.setflags(write=False)
    return array


def build_v2(
    r: NodeReader, root: yaml.Node, top: Pairs, source: str, slug: str | None, common: Any
) -> Example:
    """The example of a format-2 file; ``common`` holds name, description and extras."""
    inputs = "embeddings"
    given: dict[str, np.ndarray] = {}
    W_o: np.ndarray | None = None
    if "inputs" in top:
        for key in ("embeddings",):
            if key in top:
                raise r.error(
                    top[key][0],
                    key,
                    "embeddings and weights cannot be given together with inputs",
                    "keep either inputs (Q, K, V) or embeddings and weights",
                )
        inputs, given = direct_inputs(r, *top["inputs"])
        if "weights" in top:
            W_o = _w_o_only(r, top["weights"], given)
        if "scores" in given:
            lq, lk = given["scores"].shape
            d_k_all = d_v_all = 0
        else:
            lq, lk = given["Q"].shape[0], given["K"].shape[0]
            d_k_all = given["Q"].shape[1]
            d_v_all = given["V"].shape[1] if "V" in given else 0
        embeddings = _empty(lk, 0)
        W_q, W_k, W_v = _empty(0, d_k_all), _empty(0, d_k_all), _empty(0, d_v_all)
    else:
        for key in ("embeddings", "weights"):
            if key not in top:
                raise r.error(
                    root,
                    key,
                    "missing",
                    f"add the key '{key}:', or give inputs: {{Q, K, V}} (format 2)",
                )
        embeddings = r.matrix(top["embeddings"][1], "embeddings", what="one row per token")
        W_q, W_k, W_v, W_o = weights_of(r, *top["weights"], embeddings.shape[1])
        lq = lk = embeddings.shape[0]
        d_k_all, d_v_all = W_q.shape[1], W_v.shape[1]

    if inputs == "embeddings":  # before any step is computed
        rows = ("embeddings", top["embeddings"][1], lk)
        check_work(r, rows, rows, ("weights.W_v", top["weights"][1], d_v_all))
    else:
        node = top["inputs"][1]
        first = "inputs.scores" if "scores" in given else "inputs.Q"
        values = ("inputs.V", node, d_v_all) if "V" in given else None
        check_work(r, (first, node, lq), ("inputs.K", node, lk), values)
    tokens = names(r, _node(top, "tokens"), "tokens", lk, "t", "tokens (one per key)")
    query_node = _node(top, "query_tokens")
    query_tokens: tuple[str, ...] | None = None
    if query_node is not None or lq != lk:
        query_tokens = names(r, query_node, "query_tokens", lq, "q", "query tokens")
    queries_named = tokens if query_tokens is None else query_tokens

    heads = 1
    if "heads" in top:
        if inputs == "scores":
            raise r.error(top["heads"][1], "heads", "an example given by its scores has one head")
        heads = heads_of(r, top["heads"][1], d_k_all, d_v_all if d_v_all else d_k_all)
    options = _options(r, top.get("options"), queries_named, lq, lk, inputs, root)
    if "scores" in given and not np.all(np.isfinite(given["scores"])):
        check_masked_inputs(r, top["inputs"][1], given["scores"], _allowed(options, lq, lk))
    present = ("embeddings", "W_q", "W_k", "W_v") if inputs == "embeddings" else tuple(given)
    if W_o is not None:
        present = (*present, "W_o")
    digits: dict[str, int] = {}
    if "precision" in top:
        digits = precision(r, top["precision"][1], present)
    dtype = dtype_of(r, top["dtype"][1]) if "dtype" in top else None

    has_v = inputs in ("embeddings", "qkv")
    d_out = d_v_all if W_o is None else W_o.shape[1]
    lengths = _lengths(inputs, heads, lk, d_k_all, d_v_all, d_out, has_v, per_head=False)
    claimed: dict[str, dict[int, Claimed]] = {}
    head_claimed: tuple[dict[str, dict[int, Claimed]], ...] = ()
    if "claimed" in top:
        node = top["claimed"][1]
        pairs = r.mapping(
            node, "claimed", allowed=(*CLAIMABLE_2, "per_head"), what="a mapping of steps"
        )
        if "per_head" in pairs:
            head_claimed = _per_head(
                r,
                pairs["per_head"],
                heads,
                _lengths(inputs, heads, lk, d_k_all, d_v_all, d_out, has_v, per_head=True),
                tokens,
                queries_named,
            )
            node = yaml.MappingNode(
                node.tag, [(k, v) for k, v in node.value if str(k.value) != "per_head"]
            )
        claimed = claimed_rows(
            r,
            node,
            "claimed",
            steps=CLAIMABLE_2,
            lengths=lengths,
            keys=tokens,
            queries=queries_named,
        )
    assumed: dict[str, dict[int, Claimed]] = {}
    if "assumed" in top:
        assumed = claimed_rows(
            r,
            top["assumed"][1],
            "assumed",
            steps=CLAIMABLE_2,
            lengths=lengths,
            keys=tokens,
            queries=queries_named,
        )
    block_size: int | None = None
    tiled_claimed: dict[str, dict[int, Claimed]] = {}
    if "tiled" in top:
        block_size, tiled_claimed = tiled_of(
            r,
            top["tiled"],
            allowed=_allowed(options, lq, lk),
            d_v=d_v_all if has_v else 0,
            heads=heads,
            queries=queries_named,
        )
    for array in given.values():
        array.setflags(write=False)
    return Example(
        name=common["name"],
        description=common["description"],
        tokens=tokens,
        embeddings=embeddings,
        W_q=W_q,
        W_k=W_k,
        W_v=W_v,
        W_o=W_o,
        heads=heads,
        scale=options["scale"],
        causal=options["causal"],
        queries=options["queries"],
        claimed=claimed,
        slug=slug,
        source=source,
        extras=common["extras"],
        format=2,
        inputs=inputs,
        given=given,
        query_tokens=query_tokens,
        alignment=options["alignment"],
        key_length=options["key_length"],
        mask=options["mask"],
        d_k=options["d_k"],
        precision=digits,
        dtype=dtype,
        head_claimed=head_claimed,
        assumed=assumed,
        block_size=block_size,
        tiled_claimed=tiled_claimed,
    )


def _allowed(options: Mapping[str, Any], lq: int, lk: int) -> np.ndarray:
    """The keys each query may attend by the mask options (True = may attend)."""
    allowed = np.ones((lq, lk), dtype=bool)
    if options["causal"]:
        shift = lk - lq if options["alignment"] == "bottom-right" else 0
        allowed &= np.arange(lk)[None, :] <= np.arange(lq)[:, None] + shift
    if options["key_length"] is not None:
        allowed[:, options["key_length"] :] = False
    if options["mask"] is not None:
        allowed &= options["mask"]
    return allowed


def _node(top: Pairs, key: str) -> yaml.Node | None:
    return top[key][1] if key in top else None


def _w_o_only(
    r: NodeReader, pair: tuple[yaml.Node, yaml.Node], given: Mapping[str, np.ndarray]
) -> np.ndarray:
    pairs = r.mapping(pair[1], "weights", allowed=("W_o",), what="a mapping with W_o")
    if "W_o" not in pairs:
        raise r.error(pair[0], "weights.W_o", "missing", "with inputs, weights holds only W_o")
    if "V" not in given:
        raise r.error(pair[0], "weights.W_o", "W_o needs inputs.V", "the output is context·W_o")
    w_o = r.matrix(pairs["W_o"][1], "weights.W_o", what="the W_o matrix")
    d_v = given["V"].shape[1]
    if w_o.shape[0] != d_v:
        raise r.error(
            pairs["W_o"][0],
            "weights.W_o",
            f"expected {d_v} rows (d_v = {d_v}, the columns of V), got {w_o.shape[0]}",
            "the context vectors of all heads, side by side, are multiplied by W_o",
        )
    return w_o


def _options(
    r: NodeReader,
    pair: tuple[yaml.Node, yaml.Node] | None,
    queries_named: tuple[str, ...],
    lq: int,
    lk: int,
    inputs: str,
    root: yaml.Node,
) -> dict[str, Any]:
    found: dict[str, Any] = {
        "scale": True,
        "causal": False,
        "alignment": "top-left",
        "queries": None,
        "key_length": None,
        "mask": None,
        "d_k": None,
    }
    pairs: Pairs = {}
    if pair is not None:
        pairs = r.mapping(pair[1], "options", allowed=V2_OPTIONS, what="a mapping of options")
    if "scale" in pairs:
        node = pairs["scale"][1]
        if node.tag == "tag:yaml.org,2002:bool":
            found["scale"] = r.boolean(node, "options.scale")
        else:
            number = r.number(node, "options.scale")[0] if r.is_number(node) else 0.0
            if number <= 0:
                raise r.error(
                    node,
                    "options.scale",
                    f"expected true, false or a positive number, got {describe(node)}",
                    "true divides the scores by √d_k, false leaves them as they are, a number "
                    "multiplies them",
                )
            found["scale"] = number
    if "causal" in pairs:
        node = pairs["causal"][1]
        if node.tag == "tag:yaml.org,2002:bool":
            found["causal"] = r.boolean(node, "options.causal")
        elif isinstance(node, yaml.ScalarNode) and str(node.value) in _ALIGNMENTS:
            found["causal"] = True
            found["alignment"] = _ALIGNMENTS[str(node.value)]
        else:
            raise r.error(
                node,
                "options.causal",
                f"expected true, false, top-left or bottom-right, got {describe(node)}",
                "bottom-right: the last query sees every key (decoding with a cache)",
            )
    if "queries" in pairs:
        found["queries"] = queries_of(r, pairs["queries"][1], queries_named)
    if "key_length" in pairs:
        node = pairs["key_length"][1]
        length = r.integer(node, "options.key_length", minimum=1)
        if length > lk:
            raise r.error(
                node,
                "options.key_length",
                f"expected at most {lk} (the number of keys), got {length}",
                "keys key_length … Lk − 1 are padding",
            )
        found["key_length"] = length
    if "mask" in pairs:
        found["mask"] = mask_option(r, pairs["mask"][1], lq, lk)
    if "d_k" in pairs:
        node = pairs["d_k"][1]
        if inputs != "scores":
            raise r.error(
                node,
                "options.d_k",
                "d_k is given only for an example given by its scores",
                "here d_k is the number of columns of Q and K",
            )
        found["d_k"] = r.integer(node, "options.d_k", minimum=1)
    if inputs == "scores" and found["scale"] is True and found["d_k"] is None:
        raise r.error(
            pair[0] if pair is not None else root,
            "options.d_k",
            "scale: true divides the scores by √d_k, but an example given by its scores has no d_k",
            "write options: {d_k: N}, or options: {scale: false} if the scores go into the "
            "softmax as they are",
        )
    return found


def _lengths(
    inputs: str,
    heads: int,
    lk: int,
    d_k_all: int,
    d_v_all: int,
    d_out: int,
    has_v: bool,
    *,
    per_head: bool,
) -> dict[str, tuple[int, str]]:
    """Step → (numbers in a claimed row, why); steps the example cannot claim are left out."""
    lengths: dict[str, tuple[int, str]] = {}
    n = heads if per_head else 1
    what = "this head's columns" if per_head else "all heads side by side"
    if inputs != "scores":
        lengths["Q"] = (d_k_all // n, f"d_k: {what}")
        lengths["K"] = (d_k_all // n, f"d_k: {what}")
    if has_v:
        lengths["V"] = (d_v_all // n, f"d_v: {what}")
        lengths["context"] = (d_v_all // n, f"d_v: {what}")
    if heads == 1 or per_head:
        for step in ("scores", "scaled", "exp", "weights"):
            lengths[step] = (lk, "one per key")
        lengths["exp_sum"] = (1, "one number, the sum of the row's exponentials")
        if has_v:
            lengths["products"] = (lk * (d_v_all // n), f"{lk} rows (one per key) of d_v")
    if has_v and not per_head:
        lengths["output"] = (d_out, "the columns of W_o, or d_v without W_o")
    return lengths


def _per_head(
    r: NodeReader,
    pair: tuple[yaml.Node, yaml.Node],
    heads: int,
    lengths: dict[str, tuple[int, str]],
    tokens: tuple[str, ...],
    queries: tuple[str, ...],
) -> tuple[dict[str, dict[int, Claimed]], ...]:
    key_node, node = pair
    if not isinstance(node, yaml.SequenceNode):
        raise r.error(
            node,
            "claimed.per_head",
            f"expected a list of mappings, one per head, got {describe(node)}",
            "- weights: {...}   # head 1, then the next head on a new '- ' line",
        )
    if len(node.value) != heads:
        raise r.error(
            key_node,
            "claimed.per_head",
            f"expected {heads} mappings, one per head (heads: {heads}), got {len(node.value)}",
            "one mapping per head, head 1 first, {} for a head with no claims; set heads: "
            "to the number of heads",
        )
    found = []
    for h, item in enumerate(node.value):
        steps = tuple(s for s in CLAIMABLE_2 if s != "output")
        rows = claimed_rows(
            r,
            item,
            join("claimed.per_head", h),
            steps=steps,
            lengths=lengths,
            keys=tokens,
            queries=queries,
        )
        found.append(rows)
    return tuple(found)
