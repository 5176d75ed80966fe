"""A format-2 example that gives Q, K and V directly: the one of docs/example-format.md
("Inputs"), without its claims. Shared by the tests of running, practising and the page."""

from __future__ import annotations

QKV_GIVEN = """\
format: 2
name: Q, K and V given directly
tokens: [the, cat, sat]
inputs:
  Q: [[1, 0], [0, 1], [1, 1]]
  K: [[1, 0], [0, 1], [1, 1]]
  V: [[1, 2], [3, 4], [5, 6]]
"""
