"""Python values from YAML nodes, one checked field at a time, each error with its line.

:class:`NodeReader` turns the nodes of :func:`qkv.examples._text.compose` into numbers, rows,
matrices, token positions and plain values, and raises :class:`ExampleError` naming the field
path (``embeddings[2]``, ``claimed.scores.love``), the line and a hint.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import yaml

from qkv.examples._errors import ExampleError
from qkv.examples._tokens import TokenRefError, token_index

_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_BOOL = "tag:yaml.org,2002:bool"
_NULL = "tag:yaml.org,2002:null"
# Numbers YAML 1.1 reads as text but JSON and YAML 1.2 read as numbers: 1e-3, 2E5.
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_STR = "tag:yaml.org,2002:str"
_MAP = "tag:yaml.org,2002:map"
_SEQ = "tag:yaml.org,2002:seq"
_PLAIN_TAGS = (_INT, _FLOAT, _BOOL, _NULL, _STR, "tag:yaml.org,2002:timestamp")
"""The scalar tags a plain value (an ``x-`` extra) may carry: YAML's core types and dates."""
_SHOWN = 40  # the longest value shown in a message, in characters
MAX_VALUES = 5_000_000
"""The most values one file may hold: YAML aliases (``*name``) can make a small file huge."""


def line_of(node: yaml.Node) -> int:
    """The 1-based line where ``node`` starts."""
    return int(node.start_mark.line) + 1


def join(field: str, key: str | int) -> str:
    """The path of a child: ``("claimed", "Q")`` → ``claimed.Q``, ``("embeddings", 2)`` →
    ``embeddings[2]``."""
    if isinstance(key, int):
        return f"{field}[{key}]"
    return f"{field}.{key}" if field else key


def shorten(text: str) -> str:
    """A value as written, cut to a length fit for a message (``"1000…0 (401 digits)"``)."""
    if len(text) <= _SHOWN:
        return text
    return f"{text[: _SHOWN - 8]}…{text[-4:]} ({len(text)} characters)"


def tag_name(tag: str) -> str:
    """A YAML tag as written in a file: ``!!python/name:os.system``, ``!custom``."""
    return "!!" + tag.removeprefix("tag:yaml.org,2002:") if tag.startswith("tag:yaml.org") else tag


def describe(node: yaml.Node) -> str:
    """What a node holds, in words: ``"a list"``, ``"the text 'abc'"``, ``"the number 3"``."""
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    if isinstance(node, yaml.MappingNode):
        return "a mapping (key: value pairs)"
    if node.tag in (_INT, _FLOAT):
        return f"the number {shorten(str(node.value))}"
    if node.tag == _BOOL:
        return f"the truth value {shorten(str(node.value))}"
    if node.tag == _NULL:
        return "nothing (an empty value)"
    if node.tag not in _PLAIN_TAGS:
        return f"the value {shorten(str(node.value))!r} tagged {tag_name(node.tag)}"
    return f"the text {shorten(str(node.value))!r}"


def suggest(key: str, allowed: Collection[str], aliases: Mapping[str, str]) -> str:
    """A "did you mean" for an unknown key, then the keys that are allowed."""
    folded = {a.lower().replace("-", "_"): a for a in allowed}
    close = (
        aliases.get(key)
        or aliases.get(key.lower())
        or folded.get(key.lower().replace("-", "_"))
        or next(iter(difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)), None)
    )
    allowed_text = ", ".join(allowed)
    if close is not None:
        return f"did you mean {close!r}? The keys here are: {allowed_text}"
    return f"the keys here are: {allowed_text}"


class NodeReader:
    """Reads checked values out of nodes; every error names ``source``, the line and the field."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._constructor = yaml.constructor.SafeConstructor()
        self._visited = 0

    def error(
        self, node: yaml.Node | None, field: str, problem: str, hint: str | None = None
    ) -> ExampleError:
        return ExampleError(
            problem,
            source=self.source,
            line=None if node is None else line_of(node),
            field=field or None,
            hint=hint,
        )

    # -- mappings ----------------------------------------------------------------------------

    def mapping(
        self,
        node: yaml.Node,
        field: str,
        *,
        allowed: Sequence[str] | None = None,
        aliases: Mapping[str, str] | None = None,
        extras: bool = False,
        what: str = "key: value pairs",
    ) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        """The pairs of a mapping by key text, refusing duplicates and keys not in ``allowed``.

        ``extras`` lets ``x-*`` keys through.
        """
        if not isinstance(node, yaml.MappingNode):
            raise self.error(node, field, f"expected {what}, got {describe(node)}")
        pairs: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for key_node, value_node in node.value:
            self._count()
            if not isinstance(key_node, yaml.ScalarNode):
                raise self.error(key_node, field, f"a key must be a name, got {describe(key_node)}")
            key = str(key_node.value)
            if key in pairs:
                first = line_of(pairs[key][0])
                raise self.error(
                    key_node,
                    join(field, key),
                    f"duplicate key {key!r} (it is already given on line {first})",
                    "each key may appear only once in a mapping; keep one of the two",
                )
            if allowed is not None and key not in allowed and not (extras and key[:2] == "x-"):
                hint = suggest(key, allowed, aliases or {})
                if extras:
                    hint += "; your own keys must start with 'x-'"
                raise self.error(key_node, join(field, key), f"unknown key {key!r}", hint)
            pairs[key] = (key_node, value_node)
        return pairs

    # -- scalars -----------------------------------------------------------------------------

    def text(self, node: yaml.Node, field: str, *, what: str = "a text") -> str:
        """The text of a scalar exactly as written (``on`` stays ``"on"``, not True)."""
        if not isinstance(node, yaml.ScalarNode):
            raise self.error(node, field, f"expected {what}, got {describe(node)}")
        return str(node.value)

    def integer(self, node: yaml.Node, field: str, *, minimum: int) -> int:
        if not (isinstance(node, yaml.ScalarNode) and node.tag == _INT):
            raise self.error(node, field, f"expected a whole number, got {describe(node)}")
        value = int(self._construct(node, field))
        if value < minimum:
            raise self.error(node, field, f"expected a whole number ≥ {minimum}, got {value}")
        return value

    def boolean(self, node: yaml.Node, field: str) -> bool:
        if not (isinstance(node, yaml.ScalarNode) and node.tag == _BOOL):
            raise self.error(node, field, f"expected true or false, got {describe(node)}")
        return bool(self._construct(node, field))

    @staticmethod
    def is_number(node: yaml.Node) -> bool:
        """Whether ``node`` is written as a number (quoted numbers are text)."""
        return isinstance(node, yaml.ScalarNode) and (
            node.tag in (_INT, _FLOAT)
            or (node.style is None and _PLAIN_NUMBER.fullmatch(str(node.value)) is not None)
        )

    def number(self, node: yaml.Node, field: str) -> tuple[float, str]:
        """A finite number and its text as written (``"1.10"``)."""
        self._count()
        if not isinstance(node, yaml.ScalarNode):
            raise self.error(node, field, f"expected a number, got {describe(node)}")
        text = str(node.value)
        if node.tag in (_INT, _FLOAT):
            try:
                value = float(self._construct(node, field))
            except OverflowError:
                value = math.inf  # a whole number too large for a float: reported below
        elif node.tag == "tag:yaml.org,2002:str" and _PLAIN_NUMBER.fullmatch(text):
            if node.style is not None:
                raise self.error(
                    node,
                    field,
                    f"expected a number, got the text {text!r} (in quotes)",
                    "remove the quotes",
                )
            value = float(text)
        else:
            hint = "true and false are not numbers" if node.tag == _BOOL else None
            raise self.error(node, field, f"expected a number, got {describe(node)}", hint)
        if not math.isfinite(value):
            raise self.error(
                node,
                field,
                f"expected a finite number, got {shorten(text)}",
                "embeddings, weights and claimed numbers are finite",
            )
        return value, text

    # -- rows and matrices -------------------------------------------------------------------

    def row(self, node: yaml.Node, field: str) -> tuple[tuple[float, ...], tuple[str, ...]]:
        """A non-empty list of numbers: their values and their texts."""
        if not isinstance(node, yaml.SequenceNode):
            raise self.error(
                node,
                field,
                f"expected a row of numbers like [0.1, 0.2], got {describe(node)}",
            )
        if not node.value:
            raise self.error(node, field, "expected a row of numbers, got an empty list")
        pairs = [self.number(item, join(field, i)) for i, item in enumerate(node.value)]
        return tuple(v for v, _ in pairs), tuple(t for _, t in pairs)

    def matrix(self, node: yaml.Node, field: str, *, what: str) -> np.ndarray:
        """A rectangular list of rows as a read-only float64 array of shape (rows, columns)."""
        if not isinstance(node, yaml.SequenceNode) or not node.value:
            got = "an empty list" if isinstance(node, yaml.SequenceNode) else describe(node)
            raise self.error(
                node, field, f"expected {what}, a list of rows like [[0.1, 0.2], ...], got {got}"
            )
        rows: list[tuple[float, ...]] = []
        for i, item in enumerate(node.value):
            if not isinstance(item, yaml.SequenceNode):
                raise self.error(
                    item,
                    join(field, i),
                    f"expected a row (a list of numbers), got {describe(item)}",
                    "write a matrix as a list of rows: [[0.1, 0.3], [0.2, 0.4]]",
                )
            values, _ = self.row(item, join(field, i))
            if rows and len(values) != len(rows[0]):
                raise self.error(
                    item,
                    join(field, i),
                    f"expected {len(rows[0])} numbers, like the rows before it, got {len(values)}",
                    "every row of a matrix has the same number of columns",
                )
            rows.append(values)
        array = np.array(rows, dtype=np.float64)
        array.setflags(write=False)
        return array

    # -- tokens and plain values -------------------------------------------------------------

    def token(self, node: yaml.Node, field: str, tokens: Sequence[str]) -> int:
        """The position of the token that ``node`` names (its text, or a plain number)."""
        if not isinstance(node, yaml.ScalarNode):
            raise self.error(node, field, f"expected a token, got {describe(node)}")
        ref: str | int = str(node.value)
        if node.tag == _INT and node.style is None:
            ref = int(self._construct(node, field))
        try:
            return token_index(ref, tokens)
        except TokenRefError as error:
            raise self.error(node, field, error.problem, error.hint) from None

    def plain(self, node: yaml.Node, field: str, _open: frozenset[int] = frozenset()) -> Any:
        """Any value as plain Python (dict, list, str, int, float, bool, None, a date).

        Tags beyond YAML's core types (``!!python/name:...``, ``!!set``, ``!custom``) and data
        that contains itself (``&a [*a]``) are refused, naming the field.
        """
        self._count()
        if isinstance(node, yaml.MappingNode | yaml.SequenceNode):
            if node.tag not in (_MAP, _SEQ):
                raise self._odd_tag(node, field)
            if id(node) in _open:
                raise self.error(
                    node,
                    field,
                    "the value contains itself (an alias *name inside its own &name)",
                    "write the value out; an extra holds plain data",
                )
            inner = _open | {id(node)}
            if isinstance(node, yaml.MappingNode):
                pairs = self.mapping(node, field)
                return {
                    key: self.plain(value, join(field, key), inner)
                    for key, (_, value) in pairs.items()
                }
            return [self.plain(item, join(field, i), inner) for i, item in enumerate(node.value)]
        if node.tag not in _PLAIN_TAGS:
            raise self._odd_tag(node, field)
        value = self._construct(node, field)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 1 << 64:
            raise self.error(
                node,
                field,
                f"expected a number of at most 20 digits, got {shorten(str(node.value))}",
                "write a very large number as a float (1e400) or in quotes",
            )
        return value

    def _odd_tag(self, node: yaml.Node, field: str) -> ExampleError:
        return self.error(
            node,
            field,
            f"unsupported YAML tag {tag_name(node.tag)}",
            "an example holds plain values: text, numbers, true/false, lists and mappings; "
            "remove the tag",
        )

    def _construct(self, node: yaml.Node, field: str) -> Any:
        """The Python value of a scalar, or an error naming the field (``!!int 1.5``)."""
        try:
            return self._constructor.construct_object(node)
        except (yaml.YAMLError, ValueError, KeyError, TypeError) as error:
            problem = getattr(error, "problem", None) or str(error) or type(error).__name__
            raise self.error(
                node,
                field,
                f"cannot read {shorten(str(node.value))!r} as {tag_name(node.tag)} ({problem})",
                "remove the tag or fix the value",
            ) from None

    def _count(self) -> None:
        self._visited += 1
        if self._visited > MAX_VALUES:
            raise self.error(
                None,
                "",
                f"the file expands to more than {MAX_VALUES:,} values",
                "aliases (*name) that repeat large parts make the data huge; write it out",
            )
