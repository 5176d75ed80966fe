"""The rubric: points per part of the mechanism, and the points each slip code costs.

The default gives every part of a submission 1 point, and a slip costs its part's points
(a note, ``masked-row-nan`` or ``rounding``, costs nothing). A rubric file changes either::

    points:              # per part (docs/grading.md lists them)
      scores: 2
      softmax: 3
      batched: 0         # a part worth 0 is left out
    penalties:           # points a slip costs; at most its part's points
      digit-slip: 0.5
      masked-row-nan: 0.5

A rubric file is outside input: read with a size bound, plain YAML only (no tags, no aliases,
no key twice), every field checked; a mistake is one :class:`RubricError` line with the file,
the line, the field, what was expected, what came, and a hint.

Example:
    >>> rubric = parse_rubric("points: {softmax: 3}\\npenalties: {digit-slip: 0.5}\\n")
    >>> rubric.points_of("softmax"), rubric.points_of("scores")
    (3.0, 1.0)
    >>> rubric.penalty("digit-slip", 2.0), rubric.penalty("unscaled", 2.0)
    (0.5, 2.0)
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from qkv._format import visible
from qkv._read import FileLimitError, read_bytes
from qkv.check import DIAGNOSES, FUNCTION_DIAGNOSES
from qkv.grade._parts import PARTS

__all__ = ["DEFAULT_POINTS", "NOTES", "Rubric", "RubricError", "load_rubric", "parse_rubric"]

DEFAULT_POINTS = 1.0
"""The points of a part the rubric does not name."""
NOTES = ("masked-row-nan", "rounding")
"""Codes that are notes, not mistakes: they cost nothing unless the rubric says so."""
_LIMIT = 64 << 10
_MOST = 1000.0
_CODES = tuple(dict.fromkeys([*FUNCTION_DIAGNOSES, *DIAGNOSES]))
_Fail = Callable[["yaml.Node | None", str, str, str], "RubricError"]


class RubricError(ValueError):
    """A rubric file that cannot be used: one line saying where and why."""


@dataclass(frozen=True)
class Rubric:
    """Points per part and the points each slip code costs.

    Attributes:
        points: part → points, for the parts it changes (others get :data:`DEFAULT_POINTS`).
        penalties: slip code → points it costs (others cost their part's points; notes 0).
        source: the file it came from, or None for the default.
    """

    points: Mapping[str, float] = field(default_factory=dict)
    penalties: Mapping[str, float] = field(default_factory=dict)
    source: str | None = None

    def points_of(self, part: str) -> float:
        """The points ``part`` is worth."""
        return float(self.points.get(part, DEFAULT_POINTS))

    def names(self, part: str) -> bool:
        """Whether the rubric gives ``part`` points of its own (it belongs to the assignment)."""
        return self.points.get(part, 0.0) > 0

    def total(self, parts: tuple[str, ...]) -> float:
        """The points of ``parts`` together."""
        return sum(self.points_of(p) for p in parts)

    def penalty(self, code: str, part_points: float) -> float:
        """The points ``code`` costs, at most ``part_points``."""
        default = 0.0 if code in NOTES else part_points
        return min(float(self.penalties.get(code, default)), part_points)


def read_yaml_text(path: str | os.PathLike[str], option: str, what: str) -> str:
    """The text of the YAML file ``option`` names (a rubric, a feedback file), read with a
    size bound.

    Raises:
        RubricError: the file is missing, too large or not UTF-8, in one line naming it.
    """
    source = visible(os.fspath(path))
    try:
        return read_bytes(path, limit=_LIMIT, what=what).decode("utf-8")
    except FileLimitError as error:
        raise RubricError(f"{option} {source}: {error}") from None
    except UnicodeDecodeError:
        raise RubricError(
            f"{option} {source}: not UTF-8 text. Hint: save it as a UTF-8 YAML file"
        ) from None
    except OSError as error:
        raise RubricError(
            f"{option} {source}: {error.strerror or error}. Hint: check the path"
        ) from None


def load_rubric(path: str | os.PathLike[str]) -> Rubric:
    """Read and check a rubric file.

    Raises:
        RubricError: the file is missing, too large, not YAML, or a field is wrong.
    """
    source = os.fspath(path)
    text = read_yaml_text(path, "--rubric", "a rubric")
    return parse_rubric(text, source=source)


def parse_rubric(text: str, *, source: str = "<rubric>") -> Rubric:
    """Check a rubric's YAML text (see the module's docstring).

    Raises:
        RubricError: not YAML, a tag or an alias, a key given twice, an unknown key, part or
            code, or a number that is not finite, negative or above 1000.
    """

    root, fail = compose_yaml(
        text,
        f"--rubric {source}",
        "a rubric",
        alias="a rubric holds plain numbers; write each value out",
        deep="a rubric is two levels deep, e.g. 'points:' then '  softmax: 2'",
        invalid="check the indentation near this line, e.g. 'points:' then '  softmax: 2'",
    )
    if root is None:
        return Rubric(source=source)
    top = _mapping(root, "", fail, "a mapping with 'points' and 'penalties'")
    unknown = [k for k in top if k not in ("points", "penalties")]
    if unknown:
        key = unknown[0]
        raise fail(
            top[key][0], key, f"unknown key {key!r}", _did_you_mean(key, ("points", "penalties"))
        )
    points: dict[str, float] = {}
    penalties: dict[str, float] = {}
    for name, target, allowed, what in (
        ("points", points, PARTS, "part"),
        ("penalties", penalties, _CODES, "slip code"),
    ):
        if name not in top:
            continue
        entries = _mapping(top[name][1], name, fail, f"a mapping of {what} to points")
        for key, (key_node, value_node) in entries.items():
            where = f"{name}.{key}"
            if key not in allowed:
                raise fail(key_node, where, f"unknown {what} {key!r}", _did_you_mean(key, allowed))
            target[key] = _points(value_node, where, fail)
    if points and all(points.get(p, DEFAULT_POINTS) == 0 for p in PARTS):
        raise fail(
            top["points"][1],
            "points",
            "every part is worth 0, so every submission would be graded 0 / 0",
            "give at least one part points, e.g. 'softmax: 1'",
        )
    return Rubric(points=points, penalties=penalties, source=source)


def compose_yaml(
    text: str, file: str, what: str, *, alias: str, deep: str, invalid: str
) -> tuple[yaml.Node | None, _Fail]:
    """The node tree of a rubric's or feedback file's YAML text (None: empty), and the
    function that words a mistake in it: ``{file}, line N: where: problem. Hint: hint``.

    ``file`` is the option and the path (``--rubric rubric.yaml``), ``what`` the kind of
    file (``"a rubric"``); ``alias``, ``deep`` and ``invalid`` are the hints for an alias,
    for nesting too deep and for text that is not YAML.

    Raises:
        RubricError: an alias, nesting too deep for the parser, or text that is not YAML.
    """

    def at(mark: Any) -> str:
        return f", line {mark.line + 1}" if mark is not None else ""

    def fail(
        node: yaml.Node | yaml.Event | None, where: str, problem: str, hint: str
    ) -> RubricError:
        field_ = f" {where}:" if where else ""
        line = at(None if node is None else node.start_mark)
        return RubricError(visible(f"{file}{line}:{field_} {problem}. Hint: {hint}"))

    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
                raise fail(event, "", "an alias (*name)", alias)
        return yaml.compose(text, Loader=yaml.SafeLoader), fail
    except RecursionError:
        raise fail(None, "", f"nested too deeply to be {what}", deep) from None
    except yaml.YAMLError as error:
        line = at(getattr(error, "problem_mark", None))
        problem = getattr(error, "problem", None) or "not valid YAML"
        raise RubricError(
            visible(f"{file}{line}: not valid YAML ({problem}). Hint: {invalid}")
        ) from None


def _did_you_mean(key: str, allowed: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    guess = f"did you mean {close[0]!r}? " if close else ""
    return f"{guess}the keys here are: {', '.join(allowed)}"


def _mapping(
    node: yaml.Node, where: str, fail: _Fail, expected: str
) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    if not isinstance(node, yaml.MappingNode):
        raise fail(
            node, where, f"expected {expected}, got {_describe(node)}", "see docs/grading.md"
        )
    pairs: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
            raise fail(
                key_node,
                where,
                f"a key must be a name, got {_describe(key_node)}",
                "e.g. softmax: 2",
            )
        key = str(key_node.value)
        if key in pairs:
            first = pairs[key][0].start_mark.line + 1
            raise fail(
                key_node,
                f"{where}.{key}" if where else key,
                f"duplicate key {key!r} (it is already given on line {first})",
                "each key may appear only once; keep one of the two",
            )
        pairs[key] = (key_node, value_node)
    return pairs


def _points(node: yaml.Node, where: str, fail: _Fail) -> float:
    ok_tags = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
    if not isinstance(node, yaml.ScalarNode) or node.tag not in ok_tags:
        raise fail(
            node, where, f"expected a number of points, got {_describe(node)}", "e.g. 2 or 0.5"
        )
    try:
        value = float(yaml.safe_load(node.value) if node.tag.endswith("int") else float(node.value))
    except (ValueError, OverflowError, yaml.YAMLError):
        value = math.nan
    if not (math.isfinite(value) and 0 <= value <= _MOST):
        raise fail(
            node,
            where,
            f"expected a number of points from 0 to {_MOST:g}, got {node.value!r}",
            "e.g. 2 or 0.5",
        )
    return value


def _describe(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    value = str(node.value)
    shown = value if len(value) <= 40 else value[:37] + "..."
    if node.tag == "tag:yaml.org,2002:str":
        return f"the text {shown!r}"
    core = node.tag.removeprefix("tag:yaml.org,2002:")
    if core in ("int", "float", "bool", "null"):
        return f"{core} {shown!r}"
    return f"a value tagged {visible(core if core != node.tag else node.tag)!r}"
