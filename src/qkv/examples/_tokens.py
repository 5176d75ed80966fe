"""Naming a token: by its text, or by its 0-based position when the text appears twice."""

from __future__ import annotations

import difflib
from collections.abc import Sequence


class TokenRefError(Exception):
    """A token reference that names no token, or more than one; callers add where it came from."""

    def __init__(self, problem: str, hint: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.hint = hint


def listing(tokens: Sequence[str]) -> str:
    """``"0 I, 1 love, 2 statistics"``: each token with its position."""
    return ", ".join(f"{i} {token}" for i, token in enumerate(tokens))


def token_index(ref: str | int, tokens: Sequence[str], *, digits_are_indices: bool = True) -> int:
    """The position of the token named by ``ref``.

    Args:
        ref: a token's text, or its 0-based position (an int).
        tokens: the token texts, in order.
        digits_are_indices: read a text of digits that is no token (``"4"``) as a position,
            as JSON keys and command-line arguments are always text.

    Raises:
        TokenRefError: an unknown token, a token that appears more than once, or a position
            out of range.

    Example:
        >>> token_index("sat", ["The", "cat", "sat"]), token_index(0, ["The", "cat", "sat"])
        (2, 0)
    """
    if isinstance(ref, str):
        where = [i for i, token in enumerate(tokens) if token == ref]
        if len(where) == 1:
            return where[0]
        if len(where) > 1:
            positions = ", ".join(map(str, where))
            raise TokenRefError(
                f"token {ref!r} appears {len(where)} times (positions {positions})",
                f"name it by its 0-based position instead, e.g. {where[-1]}",
            )
        # isdecimal, not isdigit: "²" and "①" are digits that int() does not read.
        if not (digits_are_indices and ref.isdecimal()):
            close = (
                difflib.get_close_matches(ref, tokens, n=1, cutoff=0.6)
                or [t for t in tokens if t.lower() == ref.lower()][:1]
            )
            mean = f"did you mean {close[0]!r}? " if close else ""
            raise TokenRefError(
                f"unknown token {ref!r}",
                f"{mean}the tokens are: {listing(tokens)} (a token is named by its text or by "
                "its 0-based position)",
            )
        ref = int(ref)
    if not 0 <= ref < len(tokens):
        shown = str(ref) if len(str(ref)) <= 20 else f"{str(ref)[:12]}… ({len(str(ref))} digits)"
        raise TokenRefError(
            f"token position {shown} is out of range",
            f"there are {len(tokens)} tokens, numbered from 0 to {len(tokens) - 1}: "
            f"{listing(tokens)}",
        )
    return ref
