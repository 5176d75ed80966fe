"""The worked-example format, version 2: direct inputs, masks, intermediates, heads, precision.

Everything of format 1 stays valid; ``format: 2`` adds (``docs/example-format.md``)::

    inputs: {Q: ..., K: ..., V: ...}     # or {Q, K}, or {scores}: instead of embeddings+weights
    query_tokens: [...]                   # the Lq queries when Lq ≠ Lk (default q1, q2, ...)
    options: {causal: bottom-right, key_length: 2, mask: [[1, 0], ...], d_k: 64}
    precision: {embeddings: 2, weights: 4}   # inputs printed rounded
    dtype: float32                        # computed in float32 (also float64, float16, bfloat16)
    claimed: {exp: ..., exp_sum: ..., products: ..., per_head: [{...}, ...]}
    assumed: {weights: {a: [0.5, 0.5]}}   # given by the text, not checked

``tokens`` may be left out (``t1``, ``t2``, ...). Claimed scores at masked places may be
``-inf``, ``-.inf``, ``−∞`` or a large negative number.
"""

from __future__ import annotations

import math

import numpy as np
import yaml

from qkv.examples._model import Claimed
from qkv.examples._nodes import NodeReader, describe, join, line_of

__all__ = [
    "CLAIMABLE_2",
    "DTYPES",
    "INPUT_SETS",
    "MASKED",
    "PRECISION_KEYS",
    "check_masked_inputs",
    "claimed_rows",
    "direct_inputs",
    "dtype_of",
    "mask_option",
    "names",
    "precision",
]

CLAIMABLE_2 = (
    "Q",
    "K",
    "V",
    "scores",
    "scaled",
    "exp",
    "exp_sum",
    "weights",
    "products",
    "context",
    "output",
)
"""The steps a format-2 example may claim, in the order of computation."""
SCORE_LIKE = ("scores", "scaled", "exp", "exp_sum", "weights", "products")
"""Steps whose rows belong to one head."""
INPUT_SETS = {
    frozenset({"Q", "K", "V"}): "qkv",
    frozenset({"Q", "K"}): "qk",
    frozenset({"scores"}): "scores",
}
PRECISION_KEYS = ("embeddings", "weights", "W_q", "W_k", "W_v", "W_o", "Q", "K", "V", "scores")
MASKED = ("-inf", "-.inf", "-.Inf", "-.INF", "−∞", "-∞", "-Infinity", "−inf")
"""How texts print a masked score (minus infinity); a number ≤ −10⁴ also reads as masked."""
_MAX_DECIMALS = 15
DTYPES = ("float64", "float32", "float16", "bfloat16")
"""How a text computed its numbers (``dtype:``): float64 holds every printed digit; the others
allow their own rounding (docs/check.md, the precision policy)."""


def names(
    r: NodeReader, node: yaml.Node | None, field: str, count: int, prefix: str, what: str
) -> tuple[str, ...]:
    """The token names of ``field`` (``count`` of them), or ``t1``, ``t2``, ... when absent."""
    if node is None:
        return tuple(f"{prefix}{i + 1}" for i in range(count))
    if not isinstance(node, yaml.SequenceNode) or not node.value:
        got = "an empty list" if isinstance(node, yaml.SequenceNode) else describe(node)
        raise r.error(node, field, f"expected a list of {what}, got {got}")
    found = []
    for i, item in enumerate(node.value):
        token = r.text(item, join(field, i), what="a token (a word)")
        if not token.strip():
            raise r.error(item, join(field, i), "expected a token, got an empty text")
        found.append(token)
    if len(found) != count:
        raise r.error(
            node,
            field,
            f"expected {count} {what}, got {len(found)}",
            f"there is one per row of the {'queries' if prefix == 'q' else 'keys'}",
        )
    return tuple(found)


def direct_inputs(
    r: NodeReader, key_node: yaml.Node, node: yaml.Node
) -> tuple[str, dict[str, np.ndarray]]:
    """``inputs:``: the kind (``qkv``, ``qk``, ``scores``) and the matrices."""
    pairs = r.mapping(
        node, "inputs", allowed=("Q", "K", "V", "scores"), what="a mapping with Q, K, V"
    )
    kind = INPUT_SETS.get(frozenset(pairs))
    if kind is None:
        raise r.error(
            key_node,
            "inputs",
            f"expected Q, K and V, or Q and K, or scores; got {', '.join(pairs) or 'nothing'}",
            "give the vectors the text starts from (see docs/example-format.md, Format 2)",
        )
    given = {
        name: _masked_matrix(r, value)
        if name == "scores"
        else r.matrix(value, f"inputs.{name}", what=f"the {name} matrix")
        for name, (_, value) in pairs.items()
    }
    if kind != "scores":
        q, k = given["Q"], given["K"]
        if q.shape[1] != k.shape[1]:
            raise r.error(
                pairs["K"][0],
                "inputs.K",
                f"expected {q.shape[1]} columns, like Q (d_k = {q.shape[1]}), got {k.shape[1]}",
                "the scores Q·Kᵀ pair each query with each key, so both have d_k numbers",
            )
        if "V" in given and given["V"].shape[0] != k.shape[0]:
            raise r.error(
                pairs["V"][0],
                "inputs.V",
                f"expected {k.shape[0]} rows, one per key like K, got {given['V'].shape[0]}",
                "each key has one value vector",
            )
    return kind, given


def _masked_matrix(r: NodeReader, node: yaml.Node) -> np.ndarray:
    """``inputs.scores``: a matrix whose masked places may be printed as −inf."""
    field = "inputs.scores"
    if not isinstance(node, yaml.SequenceNode) or not node.value:
        raise r.error(
            node, field, f"expected a list of rows like [[1, 2], ...], got {describe(node)}"
        )
    rows: list[tuple[float, ...]] = []
    for i, item in enumerate(node.value):
        values, _ = _row(r, item, join(field, i), masked_ok=True, matrix=False)
        if rows and len(values) != len(rows[0]):
            raise r.error(
                item,
                join(field, i),
                f"expected {len(rows[0])} numbers, like the rows before it, got {len(values)}",
                "every row of a matrix has the same number of columns",
            )
        rows.append(values)
    return np.array(rows, dtype=np.float64)


def check_masked_inputs(
    r: NodeReader, node: yaml.Node, scores: np.ndarray, allowed: np.ndarray
) -> None:
    """Refuse −inf in ``inputs.scores`` at a place the mask options allow."""
    bad = np.argwhere(~np.isfinite(scores) & allowed)
    if bad.size:
        i, j = (int(x) for x in bad[0])
        raise r.error(
            node,
            f"inputs.scores[{i}][{j}]",
            f"−inf at a place the mask allows (query {i}, key {j})",
            "−inf stands for a masked score: say which keys are masked with options "
            "causal, key_length or mask, or write the score",
        )


def mask_option(r: NodeReader, node: yaml.Node, lq: int, lk: int) -> np.ndarray:
    """``options.mask``: Lq rows of Lk numbers 0 or 1, as a boolean matrix (True = may attend)."""
    matrix = r.matrix(node, "options.mask", what="a 0/1 matrix, one row per query")
    if matrix.shape != (lq, lk):
        raise r.error(
            node,
            "options.mask",
            f"expected {lq} rows of {lk} numbers (queries × keys), got {matrix.shape[0]} rows "
            f"of {matrix.shape[1]}",
        )
    if not np.all((matrix == 0) | (matrix == 1)):
        raise r.error(
            node,
            "options.mask",
            "expected only 0 and 1",
            "1 = the query may attend the key, 0 = masked",
        )
    allowed: np.ndarray = matrix == 1
    allowed.setflags(write=False)
    return allowed


def precision(r: NodeReader, node: yaml.Node, present: tuple[str, ...]) -> dict[str, int]:
    """``precision:``: input name → decimals; a bare number applies to every input."""
    if isinstance(node, yaml.ScalarNode):
        digits = r.integer(node, "precision", minimum=0)
        _digits(r, node, "precision", digits)
        return dict.fromkeys(present, digits)
    pairs = r.mapping(node, "precision", allowed=PRECISION_KEYS, what="input: decimals")
    found: dict[str, int] = {}
    for key, (key_node, value) in pairs.items():
        field = join("precision", key)
        digits = r.integer(value, field, minimum=0)
        _digits(r, value, field, digits)
        names_ = ("W_q", "W_k", "W_v", "W_o") if key == "weights" else (key,)
        if not any(n in present for n in names_):
            raise r.error(
                key_node,
                field,
                f"this example has no {key}",
                "its inputs are: " + ", ".join(present),
            )
        for name in names_:
            if name in present:
                found[name] = digits
    return found


def _digits(r: NodeReader, node: yaml.Node, field: str, digits: int) -> None:
    if digits > _MAX_DECIMALS:
        raise r.error(node, field, f"expected at most {_MAX_DECIMALS} decimals, got {digits}")


def _masked(node: yaml.Node) -> bool:
    if not isinstance(node, yaml.ScalarNode):
        return False
    text = str(node.value).strip()
    return text in MASKED or (node.tag == "tag:yaml.org,2002:float" and text.lower() == "-.inf")


def _row(
    r: NodeReader, node: yaml.Node, field: str, *, masked_ok: bool, matrix: bool
) -> tuple[tuple[float, ...], tuple[str, ...]]:
    """A claimed row: a list of numbers (``-inf`` allowed in scores), a number for exp_sum,
    or a matrix for products (flattened)."""
    if matrix:
        if not isinstance(node, yaml.SequenceNode) or not node.value:
            raise r.error(
                node,
                field,
                f"expected one row per key, like [[0.1, 0.2], ...], got {describe(node)}",
            )
        values: list[float] = []
        texts: list[str] = []
        width = -1
        for i, item in enumerate(node.value):
            row_values, row_texts = _row(r, item, join(field, i), masked_ok=False, matrix=False)
            if width >= 0 and len(row_values) != width:
                raise r.error(
                    item,
                    join(field, i),
                    f"expected {width} numbers, like the rows before it, got {len(row_values)}",
                )
            width = len(row_values)
            values += row_values
            texts += row_texts
        return tuple(values), tuple(texts)
    if isinstance(node, yaml.ScalarNode) and not masked_ok:
        value, text = r.number(node, field)
        return (value,), (text,)
    if not isinstance(node, yaml.SequenceNode) or not node.value:
        return r.row(node, field)
    numbers: list[float] = []
    written: list[str] = []
    for i, item in enumerate(node.value):
        if masked_ok and _masked(item):
            numbers.append(-math.inf)
            written.append(str(item.value).strip())
        else:
            number, text = r.number(item, join(field, i))
            numbers.append(number)
            written.append(text)
    return tuple(numbers), tuple(written)


def claimed_rows(
    r: NodeReader,
    node: yaml.Node,
    field: str,
    *,
    steps: tuple[str, ...],
    lengths: dict[str, tuple[int, str]],
    keys: tuple[str, ...],
    queries: tuple[str, ...],
) -> dict[str, dict[int, Claimed]]:
    """The rows of ``claimed`` (or ``assumed``, or one head of ``per_head``)."""
    pairs = r.mapping(node, field, allowed=(*steps,), what="a mapping of steps (scores:, ...)")
    found: dict[str, dict[int, Claimed]] = {}
    for step, (step_key, rows_node) in pairs.items():
        step_field = join(field, step)
        if step not in lengths:
            raise r.error(step_key, step_field, *_why_not(step))
        rows = r.mapping(rows_node, step_field, what="a mapping of token: [numbers]")
        length, why = lengths[step]
        names_ = keys if step in ("K", "V") else queries
        by_token: dict[int, Claimed] = {}
        where: dict[int, yaml.Node] = {}
        for _, (ref_node, row_node) in rows.items():
            row_field = join(step_field, str(ref_node.value))
            index = r.token(ref_node, row_field, names_)
            if index in by_token:
                raise r.error(
                    ref_node,
                    row_field,
                    f"names token {index} ({names_[index]}), already claimed on line "
                    f"{line_of(where[index])}",
                    "claim each token's row once",
                )
            values, texts = _row(
                r,
                row_node,
                row_field,
                masked_ok=step in ("scores", "scaled"),
                matrix=step == "products",
            )
            if len(values) != length:
                raise r.error(
                    row_node, row_field, f"expected {length} numbers ({why}), got {len(values)}"
                )
            by_token[index] = Claimed(values=values, texts=texts, line=line_of(row_node))
            where[index] = ref_node
        found[step] = by_token
    return found


def _why_not(step: str) -> tuple[str, str]:
    if step in ("Q", "K"):
        return (
            f"this example gives its scores, so it has no {step} rows to claim",
            "give inputs.Q and inputs.K to claim them",
        )
    if step == "output":
        return ("this example has no output", "an output needs V (and W_o)")
    if step in SCORE_LIKE:
        return (
            f"claimed {step} rows belong to one head; this example has several",
            "claim them under per_head: one mapping per head, head 1 first",
        )
    return (
        f"this example has no value vectors, so no {step} rows",
        "give inputs.V (or embeddings and weights) to claim them",
    )


def dtype_of(r: NodeReader, node: yaml.Node) -> str:
    """``dtype:``: the floating-point format the text computed in, one of :data:`DTYPES`."""
    text = r.text(node, "dtype", what="a floating-point format")
    if text not in DTYPES:
        raise r.error(
            node,
            "dtype",
            f"expected one of {', '.join(DTYPES)}, got {text!r}",
            "float32 for numbers printed by PyTorch, TensorFlow or JAX code; float64 to hold "
            "every printed digit (a hand-worked exercise)",
        )
    return text
