"""Shapes of the inputs shared by both format versions: weights, heads, options, queries."""

from __future__ import annotations

import numpy as np
import yaml

from qkv.examples._nodes import NodeReader, describe, join, line_of, shorten

__all__ = [
    "MAX_STEP_VALUES",
    "MAX_TOKENS",
    "OPTION_KEYS",
    "WEIGHT_KEYS",
    "check_rows",
    "check_work",
    "heads_of",
    "options_of",
    "queries_of",
    "weights_of",
]

WEIGHT_KEYS = ("W_q", "W_k", "W_v", "W_o")
MAX_TOKENS = 2048
"""The most tokens (rows of the queries, of the keys) a worked example may have."""
MAX_STEP_VALUES = 1 << 25
"""The most numbers one step may hold: the largest, products, holds Lq × Lk × d_v (2,048
tokens and d_v = 8 fit; a file whose aliases repeat one large matrix does not)."""
OPTION_KEYS = ("scale", "causal", "queries")
_WEIGHT_ALIASES = {k.lower().replace("_", ""): k for k in WEIGHT_KEYS} | {
    "W_Q": "W_q",
    "W_K": "W_k",
    "W_V": "W_v",
    "W_O": "W_o",
    "W_0": "W_o",
}
_OPTION_ALIASES = {"heads": "heads (a top-level key)", "mask": "causal", "query": "queries"}


def weights_of(
    r: NodeReader, key_node: yaml.Node, node: yaml.Node, d_model: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    pairs = r.mapping(
        node,
        "weights",
        allowed=WEIGHT_KEYS,
        aliases=_WEIGHT_ALIASES,
        what="a mapping with W_q, W_k, W_v (and W_o)",
    )
    for key in ("W_q", "W_k", "W_v"):
        if key not in pairs:
            raise r.error(
                key_node,
                f"weights.{key}",
                "missing",
                "an example needs the three projections W_q, W_k and W_v",
            )
    matrices: dict[str, np.ndarray] = {}
    for key in WEIGHT_KEYS:
        if key not in pairs:
            continue
        key_node, value_node = pairs[key]
        field = f"weights.{key}"
        matrix = r.matrix(value_node, field, what=f"the {key} matrix")
        if key == "W_o":
            d_v = matrices["W_v"].shape[1]
            check_rows(r, key_node, field, matrix, d_v, f"d_v = {d_v}, the columns of W_v")
        else:
            check_rows(
                r,
                key_node,
                field,
                matrix,
                d_model,
                f"d_model = {d_model}, one per embedding column",
            )
        matrices[key] = matrix
    d_q, d_k = matrices["W_q"].shape[1], matrices["W_k"].shape[1]
    if d_k != d_q:
        raise r.error(
            pairs["W_k"][0],
            "weights.W_k",
            f"expected {d_q} columns, like W_q (d_k = {d_q}), got {d_k}",
            "the scores Q·Kᵀ pair each query with each key, so both have d_k numbers",
        )
    return matrices["W_q"], matrices["W_k"], matrices["W_v"], matrices.get("W_o")


def check_rows(
    r: NodeReader, node: yaml.Node, field: str, matrix: np.ndarray, rows: int, why: str
) -> None:
    if matrix.shape[0] == rows:
        return
    name = field.split(".")[-1]
    if name == "W_o":
        hint = "the context vectors of all heads, side by side, are multiplied by W_o"
    else:
        hint = f"{name[-1].upper()} = X·{name} multiplies each embedding row by {name}, so it has "
        hint += "one row per embedding column"
    if matrix.shape[1] == rows:
        hint += (
            f"; if this is the column-vector form ({name}·x, {matrix.shape[0]} × {rows}), "
            "write its transpose"
        )
    raise r.error(node, field, f"expected {rows} rows ({why}), got {matrix.shape[0]}", hint)


def heads_of(r: NodeReader, node: yaml.Node, d_k: int, d_v: int) -> int:
    heads = r.integer(node, "heads", minimum=1)
    valid = [h for h in range(1, d_k + 1) if d_k % h == 0 and d_v % h == 0]
    for size, what in (
        (d_k, f"d_k = {d_k} (the columns of W_q and W_k)"),
        (d_v, f"d_v = {d_v} (the columns of W_v)"),
    ):
        if size % heads:
            raise r.error(
                node,
                "heads",
                f"{shorten(str(heads))} heads do not divide {what}",
                "the columns split evenly into heads; here heads can be "
                + ", ".join(map(str, valid)),
            )
    return heads


def options_of(
    r: NodeReader, node: yaml.Node, tokens: tuple[str, ...]
) -> tuple[bool | float, bool, tuple[int, ...] | None]:
    pairs = r.mapping(
        node, "options", allowed=OPTION_KEYS, aliases=_OPTION_ALIASES, what="a mapping of options"
    )
    scale: bool | float = True
    if "scale" in pairs:
        value_node = pairs["scale"][1]
        if value_node.tag == "tag:yaml.org,2002:bool":
            scale = r.boolean(value_node, "options.scale")
        else:
            number = r.number(value_node, "options.scale")[0] if r.is_number(value_node) else 0
            if number <= 0:
                raise r.error(
                    value_node,
                    "options.scale",
                    f"expected true, false or a positive number, got {describe(value_node)}",
                    "true divides the scores by √d_k, false leaves them as they are, a number "
                    "multiplies them",
                )
            scale = number
    causal = r.boolean(pairs["causal"][1], "options.causal") if "causal" in pairs else False
    queries = queries_of(r, pairs["queries"][1], tokens) if "queries" in pairs else None
    return scale, causal, queries


def queries_of(r: NodeReader, node: yaml.Node, tokens: tuple[str, ...]) -> tuple[int, ...]:
    items = node.value if isinstance(node, yaml.SequenceNode) else [node]
    if not items:
        raise r.error(
            node,
            "options.queries",
            "expected at least one token",
            "leave 'queries' out to show every token as a query",
        )
    seen: dict[int, yaml.Node] = {}
    for i, item in enumerate(items):
        field = join("options.queries", i)
        index = r.token(item, field, tokens)
        if index in seen:
            raise r.error(
                item,
                field,
                f"token {index} ({tokens[index]}) is listed twice",
                f"it is already listed on line {line_of(seen[index])}",
            )
        seen[index] = item
    return tuple(seen)


Sized = tuple[str, yaml.Node, int]  # a field, its node (for the line) and a size


def check_work(r: NodeReader, queries: Sized, keys: Sized, values: Sized | None) -> None:
    """Refuse, before any step is computed, an example larger than the documented limits:
    ``queries`` and ``keys`` give their rows, ``values`` the columns of V (d_v, all heads),
    None when there is no V.

    Raises:
        ExampleError: more than :data:`MAX_TOKENS` rows, or a products step (Lq × Lk × d_v)
            of more than :data:`MAX_STEP_VALUES` numbers.
    """
    for field, node, count in (queries, keys):
        if count > MAX_TOKENS:
            raise r.error(
                node,
                field,
                f"expected at most {MAX_TOKENS:,} rows (tokens), got {count:,}",
                "a worked example shows every step for every pair of tokens; for long "
                "sequences use qkv.tracing(queries=[...]) on qkv.scaled_dot_product_attention",
            )
    if values is None:
        return
    field, node, d_v = values
    total = queries[2] * keys[2] * d_v
    if total > MAX_STEP_VALUES:
        raise r.error(
            node,
            field,
            f"the products step would hold {total:,} numbers (Lq {queries[2]:,} × Lk "
            f"{keys[2]:,} × d_v {d_v:,}), more than the {MAX_STEP_VALUES:,} a worked example "
            "may",
            "a worked example is small: fewer tokens, or narrower value vectors",
        )
