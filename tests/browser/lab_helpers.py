"""Shared by the browser tests of the page's edit mode, panels and decode view: Python's
numbers for an example under the options a learner can pick, and the page's numbers read back
from the browser."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np

import qkv
from qkv import examples
from qkv.render._narrative import trace_calls
from tests.support.browser import Tab

STEPS = (
    "Q", "K", "V", "scores", "scaled", "masked", "weights", "context", "concat", "output"
)  # fmt: skip

READ_STEPS = """(() => {
  const out = [];
  for (const section of qkvPage.call().sections) {
    for (const step of section.steps) {
      if (!step.data) continue;
      const values = Array.from(qkvPage.values(step), (x) => (Number.isFinite(x) ? x : String(x)));
      out.push([step.name, section.head, step.shape, values]);
    }
  }
  return out;
})()"""


def factor(name: str, d_k: int) -> float:
    """The scale of the page's choice ``name`` (sqrt_dk, none, d_k)."""
    return {"sqrt_dk": 1 / math.sqrt(d_k), "none": 1.0, "d_k": 1 / d_k}[name]


def python_steps(
    example: examples.Example, *, heads: int, scale: str, causal: bool
) -> dict[tuple[str, int], np.ndarray]:
    """Every step of the example by qkv's reference in float64: (name, head) → matrix."""
    d_k = example.W_q.shape[1] // heads
    with qkv.tracing() as trace:
        qkv.multi_head_attention(
            example.embeddings, example.W_q, example.W_k, example.W_v, example.W_o,
            num_heads=heads, is_causal=causal, scale=factor(scale, d_k), backend="reference",
        )  # fmt: skip
    (call,) = trace_calls(trace)
    out = {}
    for step in call:
        per_head = "head" in step.axes or "kv_head" in step.axes
        for head in range(heads if per_head else 1):
            out[(step.name, head)] = np.asarray(step.select(head=head), dtype=np.float64)
    return out


def page_steps(tab: Tab) -> dict[tuple[str, int], np.ndarray]:
    """The steps the page shows now (every section, every head), as float64 matrices."""
    out = {}
    for name, head, shape, values in tab.js(READ_STEPS):
        numbers = [float(v) if isinstance(v, str) else v for v in values]
        out[(name, head or 0)] = np.array(numbers, dtype=np.float64).reshape(shape)
    return out


def assert_same(page: dict[Any, np.ndarray], python: dict[Any, np.ndarray], tol: float) -> int:
    """Every step of ``python`` that the page computes is on the page, equal to ``tol``;
    returns the number of matrices compared."""
    compared = 0
    for key, expected in python.items():
        if key[0] not in STEPS and key[0] not in ("embeddings", "W_q", "W_k", "W_v", "W_o"):
            continue
        assert key in page, f"the page lacks step {key}; it has {sorted(page)}"
        got = page[key]
        assert got.shape == expected.shape, (key, got.shape, expected.shape)
        finite = np.isfinite(expected)
        assert np.array_equal(finite, np.isfinite(got)), key
        assert np.array_equal(expected[~finite], got[~finite]), key
        difference = float(np.max(np.abs(got[finite] - expected[finite]), initial=0.0))
        assert difference <= tol, f"{key}: differs by {difference:.3g}"
        compared += 1
    return compared


def edited(example: examples.Example, name: str, i: int, j: int, value: float) -> Any:
    """The example with one input number changed."""
    array = np.array(getattr(example, name), dtype=np.float64)
    array[i, j] = value
    array.setflags(write=False)
    changes: dict[str, Any] = {name: array}
    return dataclasses.replace(example, **changes)


def set_options(tab: Tab, **options: Any) -> None:
    tab.js(f"qkvPage.lab.setOptions({json.dumps(options)})")
