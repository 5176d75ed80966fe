"""The worked-example format: read, check every field and shape, build an Example.

Version 1 is read here; a file with ``format: 2`` is built by ``_example2`` (direct inputs,
masks, intermediate steps, per-head claims, inputs printed rounded).

The format (``docs/example-format.md``)::

    format: 1                       # optional
    name: I love statistics         # optional; default: the file name
    description: ...                # optional
    tokens: [I, love, statistics]   # L tokens
    embeddings: [[...], ...]        # (L, d_model)
    weights: {W_q: ..., W_k: ..., W_v: ..., W_o: ...}   # row vectors: Q = X·W_q
    heads: 1                        # optional
    options: {scale: true, causal: false, queries: [love]}   # optional
    claimed: {STEP: {TOKEN: [numbers]}}                   # optional
    x-anything: ...                 # kept in Example.extras
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from qkv.examples._example2 import V2_KEYS, build_v2
from qkv.examples._model import Claimed, Example
from qkv.examples._nodes import NodeReader, describe, join, line_of, shorten
from qkv.examples._shapes import MAX_TOKENS, check_work, heads_of, options_of, weights_of
from qkv.examples._text import Kind, compose, kind_of, read_text

FORMAT_VERSION = 2
TOP_KEYS = (
    "format",
    "name",
    "description",
    "tokens",
    "embeddings",
    "weights",
    "heads",
    "options",
    "claimed",
)
CLAIMABLE = ("Q", "K", "V", "scores", "scaled", "weights", "context", "output")
"""The steps whose rows an example may claim, in the order of computation."""

"""The most tokens an example may have: every step is shown for every pair of tokens, so the
(L, L) matrices of a longer example would not fit the memory (or a screen)."""
_REQUIRED = ("tokens", "embeddings", "weights")
_WHERE = "; every example needs tokens, embeddings and weights (see docs/example-format.md)"
# Keys written in the wrong place or under another name, for "did you mean".
_TOP_ALIASES = {
    "scale": "options",
    "causal": "options",
    "queries": "options",
    "W_q": "weights",
    "W_k": "weights",
    "W_v": "weights",
    "W_o": "weights",
    "embedding": "embeddings",
    "X": "embeddings",
    "words": "tokens",
    "num_heads": "heads",
    "title": "name",
    "version": "format",
}
_CLAIM_ALIASES = {
    "q": "Q",
    "k": "K",
    "v": "V",
    "query": "Q",
    "key": "K",
    "value": "V",
    "queries": "Q",
    "keys": "K",
    "values": "V",
    "logits": "scores",
    "scaled_scores": "scaled",
    "softmax": "weights",
    "attention": "weights",
    "attention_weights": "weights",
    "probabilities": "weights",
    "context_vectors": "context",
    "outputs": "output",
}


def loads(text: str, *, source: str = "<string>") -> Example:
    """Read a worked example from YAML or JSON text.

    Args:
        text: the content of an example file.
        source: the name to give in error messages and ``Example.source``; a name ending in
            ``.json`` or ``.yaml`` also says how to read the text.

    Raises:
        ExampleError: a syntax error or a field that breaks the format, with its line.

    Example:
        >>> ex = loads('''
        ... tokens: [a, b]
        ... embeddings: [[1, 0], [0, 1]]
        ... weights: {W_q: [[1], [0]], W_k: [[1], [1]], W_v: [[1], [2]]}
        ... claimed: {V: {b: [2.0]}}
        ... ''')
        >>> ex.W_q.shape, ex.claimed["V"][1].texts
        ((2, 1), ('2.0',))
    """
    return parse(text, source=source, slug=None)


def parse(text: str, *, source: str, slug: str | None) -> Example:
    """:func:`loads`, with the built-in id to record in ``Example.slug``."""
    return _from_node(compose(text, source, _sniff(source)), source, slug)


def load(path: str | os.PathLike[str]) -> Example:
    """Read a worked example from a ``.yaml``/``.yml`` or ``.json`` file.

    The kind is taken from the extension, else from the content (JSON starts with ``{``).

    Raises:
        ExampleError: the file is missing or unreadable, or breaks the format.
    """
    source = os.fspath(path)
    return _from_node(compose(read_text(path), source, kind_of(path)), source, None)


def _sniff(source: str) -> Kind | None:
    return None if source.startswith("<") else kind_of(source)


def _default_name(source: str) -> str:
    return "worked example" if source.startswith("<") else Path(source).stem


def _from_node(root: yaml.Node, source: str, slug: str | None) -> Example:
    r = NodeReader(source)
    top = r.mapping(
        root,
        "",
        allowed=(*TOP_KEYS, *V2_KEYS),
        aliases=_TOP_ALIASES,
        extras=True,
        what="a mapping of keys (tokens:, embeddings:, weights:, ...)",
    )
    version = _version(r, top)
    if version == 2:
        common = {
            "name": _name(r, top, source),
            "description": _description(r, top),
            "extras": {k: r.plain(v, k) for k, (_, v) in top.items() if k[:2] == "x-"},
        }
        return build_v2(r, root, top, source, slug, common)
    for key in V2_KEYS:
        if key in top:
            raise r.error(
                top[key][0], key, f"{key} is a key of format 2", "write 'format: 2' at the top"
            )
    for key in _REQUIRED:
        if key not in top:
            raise r.error(root, key, "missing", f"add the key '{key}:'{_WHERE}")

    name = _name(r, top, source)
    description = _description(r, top)

    tokens = _tokens(r, top["tokens"][1])
    embeddings = r.matrix(top["embeddings"][1], "embeddings", what="one row per token")
    if embeddings.shape[0] != len(tokens):
        raise r.error(
            top["embeddings"][0],
            "embeddings",
            f"expected {len(tokens)} rows (one per token), got {embeddings.shape[0]}",
            f"tokens has {len(tokens)} entries: {', '.join(tokens)}",
        )
    W_q, W_k, W_v, W_o = weights_of(r, *top["weights"], embeddings.shape[1])
    rows = ("tokens", top["tokens"][1], len(tokens))
    check_work(r, rows, rows, ("weights.W_v", top["weights"][1], W_v.shape[1]))
    heads = 1
    if "heads" in top:
        heads = heads_of(r, top["heads"][1], W_q.shape[1], W_v.shape[1])
    scale: bool | float = True
    causal = False
    queries: tuple[int, ...] | None = None
    if "options" in top:
        scale, causal, queries = options_of(r, top["options"][1], tokens)
    d_out = W_v.shape[1] if W_o is None else W_o.shape[1]
    claimed: dict[str, dict[int, Claimed]] = {}
    if "claimed" in top:
        lengths = {
            "Q": (W_q.shape[1], "d_k, the columns of W_q"),
            "K": (W_k.shape[1], "d_k, the columns of W_k"),
            "V": (W_v.shape[1], "d_v, the columns of W_v"),
            "context": (W_v.shape[1], "d_v, the columns of W_v"),
            "output": (d_out, "the columns of W_o" if W_o is not None else "d_v: no W_o"),
        }
        for step in ("scores", "scaled", "weights"):
            lengths[step] = (len(tokens), "one per token: this query's row over every key")
        claimed = _claimed(r, top["claimed"][1], tokens, lengths, heads)
    extras = {key: r.plain(value, key) for key, (_, value) in top.items() if key[:2] == "x-"}
    return Example(
        name=name,
        description=description,
        tokens=tokens,
        embeddings=embeddings,
        W_q=W_q,
        W_k=W_k,
        W_v=W_v,
        W_o=W_o,
        heads=heads,
        scale=scale,
        causal=causal,
        queries=queries,
        claimed=claimed,
        slug=slug,
        source=source,
        extras=extras,
    )


def _version(r: NodeReader, top: dict[str, tuple[yaml.Node, yaml.Node]]) -> int:
    if "format" not in top:
        return 1
    node = top["format"][1]
    if node.tag == "tag:yaml.org,2002:int" and str(node.value) in ("1", "2"):
        return int(str(node.value))
    raise r.error(
        node,
        "format",
        "unsupported format "
        + (repr(shorten(str(node.value))) if isinstance(node, yaml.ScalarNode) else describe(node)),
        f"this qkv reads formats 1 and {FORMAT_VERSION}; write 'format: 2' or leave it out",
    )


def _description(r: NodeReader, top: dict[str, tuple[yaml.Node, yaml.Node]]) -> str:
    if "description" in top and top["description"][1].tag != "tag:yaml.org,2002:null":
        return r.text(top["description"][1], "description").strip()
    return ""


def _name(r: NodeReader, top: dict[str, tuple[yaml.Node, yaml.Node]], source: str) -> str:
    if "name" not in top:
        return _default_name(source)
    node = top["name"][1]
    name = r.text(node, "name", what="a title").strip()
    if node.tag == "tag:yaml.org,2002:null" or not name:
        raise r.error(
            node, "name", "expected a title, got nothing", "write e.g. 'name: My example'"
        )
    return name


def _tokens(r: NodeReader, node: yaml.Node) -> tuple[str, ...]:
    if not isinstance(node, yaml.SequenceNode) or not node.value:
        got = "an empty list" if isinstance(node, yaml.SequenceNode) else describe(node)
        raise r.error(
            node,
            "tokens",
            f"expected a list of tokens like [I, love, statistics], got {got}",
        )
    if len(node.value) > MAX_TOKENS:
        raise r.error(
            node,
            "tokens",
            f"expected at most {MAX_TOKENS:,} tokens, got {len(node.value):,}",
            "a worked example shows every step for every pair of tokens; for long sequences "
            "use qkv.tracing(queries=[...]) on qkv.scaled_dot_product_attention",
        )
    tokens = []
    for i, item in enumerate(node.value):
        token = r.text(item, join("tokens", i), what="a token (a word)")
        if not token.strip():
            raise r.error(
                item,
                join("tokens", i),
                "expected a token, got an empty text",
                "every token is a non-empty text",
            )
        tokens.append(token)
    return tuple(tokens)


def _claimed(
    r: NodeReader,
    node: yaml.Node,
    tokens: tuple[str, ...],
    lengths: dict[str, tuple[int, str]],
    heads: int,
) -> dict[str, dict[int, Claimed]]:
    steps = r.mapping(
        node,
        "claimed",
        allowed=CLAIMABLE,
        aliases=_CLAIM_ALIASES,
        what="a mapping of steps (Q:, K:, V:, scores:, ...)",
    )
    claimed: dict[str, dict[int, Claimed]] = {}
    for step, (step_key, rows_node) in steps.items():
        field = join("claimed", step)
        if heads > 1 and step in ("scores", "scaled", "weights"):
            raise r.error(
                step_key,
                field,
                f"claimed {step} rows are defined for a single head; this example has {heads}",
                "claim Q, K, V, context or output, whose rows hold all heads side by side",
            )
        rows = r.mapping(rows_node, field, what="a mapping of token: [numbers]")
        length, why = lengths[step]
        by_token: dict[int, Claimed] = {}
        where: dict[int, yaml.Node] = {}
        for ref, (ref_node, row_node) in rows.items():
            row_field = join(field, ref)
            index = r.token(ref_node, row_field, tokens)
            if index in by_token:
                raise r.error(
                    ref_node,
                    row_field,
                    f"names token {index} ({tokens[index]}), already claimed on line "
                    f"{line_of(where[index])}",
                    "claim each token's row once",
                )
            values, texts = r.row(row_node, row_field)
            if len(values) != length:
                raise r.error(
                    row_node,
                    row_field,
                    f"expected {length} numbers ({why}), got {len(values)}",
                )
            by_token[index] = Claimed(values=values, texts=texts, line=line_of(row_node))
            where[index] = ref_node
        claimed[step] = by_token
    return claimed
