"""The teacher's own words per slip code (``qkv grade --feedback FILE.yaml``).

A feedback file maps slip codes to the text every student with that slip reads, under
qkv's sentence (the same feedback for the same mistake)::

    unscaled: |
      We divide by √d_k so that the softmax does not saturate: see lecture 4, slide 12.
    mask-ignored: Read the mask's docstring again, then the second worked example.

It is outside input, read as a rubric is: a size bound, plain YAML only (no tags, no
aliases, no key twice), every key a known slip code, every value a text of at most
:data:`MAX_WORDS` characters; a mistake is one :class:`~qkv.grade.RubricError` line with the
file, the line, what was expected, what came, and a hint.

Example:
    >>> words = parse_feedback("unscaled: Divide by the square root of d_k.\\n")
    >>> words["unscaled"]
    'Divide by the square root of d_k.'
    >>> from qkv.grade import RubricError
    >>> try:
    ...     parse_feedback("unscalled: x\\n", source="words.yaml")
    ... except RubricError as error:
    ...     print(str(error)[:72])
    --feedback words.yaml, line 1: unscalled: unknown slip code 'unscalled'.
"""

from __future__ import annotations

import os

import yaml

from qkv.grade._rubric import _CODES, _did_you_mean, _mapping, compose_yaml, read_yaml_text

__all__ = ["MAX_WORDS", "load_feedback", "parse_feedback"]

MAX_WORDS = 2000
"""The most characters of the teacher's words for one code."""


def load_feedback(path: str | os.PathLike[str]) -> dict[str, str]:
    """Read and check a feedback file.

    Raises:
        RubricError: the file is missing, too large, not UTF-8 YAML, or an entry is wrong.
    """
    source = os.fspath(path)
    text = read_yaml_text(path, "--feedback", "a feedback file")
    return parse_feedback(text, source=source)


def parse_feedback(text: str, *, source: str = "<feedback>") -> dict[str, str]:
    """Check a feedback file's YAML text: slip code → the teacher's words.

    Raises:
        RubricError: not YAML, a tag or an alias, a key twice, an unknown code, a value
            that is not a text, or a text longer than :data:`MAX_WORDS`.
    """

    root, fail = compose_yaml(
        text,
        f"--feedback {source}",
        "a feedback file",
        alias="write each text out; a feedback file is plain",
        deep="a feedback file is one level: 'unscaled: text'",
        invalid="one line per slip code, e.g. 'unscaled: Divide by the square root of d_k.'",
    )
    if root is None:
        return {}
    words: dict[str, str] = {}
    for code, (key_node, value_node) in _mapping(
        root, "", fail, "a mapping of slip codes to texts"
    ).items():
        if code not in _CODES:
            raise fail(key_node, code, f"unknown slip code {code!r}", _did_you_mean(code, _CODES))
        if not isinstance(value_node, yaml.ScalarNode) or value_node.tag != (
            "tag:yaml.org,2002:str"
        ):
            raise fail(
                value_node,
                code,
                "expected the text the students with this slip read",
                f"e.g. {code}: 'See lecture 4.'",
            )
        value = " ".join(str(value_node.value).split())
        if not value or len(value) > MAX_WORDS:
            raise fail(
                value_node,
                code,
                f"expected a text of 1 to {MAX_WORDS} characters, got {len(value)}",
                "a few sentences, or a link to your notes",
            )
        words[code] = value
    return words
