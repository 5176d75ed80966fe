"""The step trace: every intermediate of attention, with its name, formula and numbers.

A :class:`Trace` holds the :class:`Step` objects of one or more attention calls. Pass
``trace=qkv.Trace()`` to an attention function, or run it inside ``with qkv.tracing() as t:``;
with neither, nothing is recorded and nothing is converted, so tracing costs nothing when it
is off.

Two views of the same steps:

- **flat**, as they ran: ``t.steps``, ``for step in t``, ``len(t)``, ``t.names``,
  ``t["weights"]`` / ``t.get("weights")`` (the last step of that name) and ``t.meta`` (facts
  about the run; those of one call are the last call's);
- **by call**: ``t.calls`` holds one :class:`TraceCall` per attention call, with its
  ``layer`` (the module path in a model, ``"blocks.3.attn"``), its ``meta`` (scale, scale
  mode, causality and alignment, mask, shapes, heads, d_k, the backend that computed it,
  the rows a partial trace holds) and its ``steps``. ``t.layer_names()`` lists the layers;
  ``t.call(layer="blocks.3.attn", index=0)`` gives one call as a trace of its own, which
  every renderer takes (``render.text(t.call(index=-1))``).

A multi-head call's projections (embeddings, W_q …, concat, W_o, output) belong to the call
they surround; a module of a model records one call per forward.

Step names are a public interface (renderers and the JSON file use them):
``embeddings``, ``W_q``, ``W_k``, ``W_v``, ``Q``, ``K``, ``V``, ``scores``, ``scaled``, ``bias``,
``masked``, ``weights``, ``dropout``, ``context``, ``concat``, ``W_o``, ``output``.

Each step names its axes, so a renderer can pick one head or one batch element out of it:
``batch``, ``head`` (query heads), ``kv_head`` (key/value heads, fewer under GQA), ``query``,
``key``, ``token``, ``model`` (d_model features), ``dim`` (per-head features) and ``feature``
(the columns of a projection matrix, all heads side by side).

On a model, ``qkv.tracing(model=model, layers=..., heads=..., queries=...)`` records only the
chosen attention modules (named by their path in the model, e.g. ``"blocks.0.attn"``), heads
and query rows: a step is sliced along its ``head``/``kv_head`` and ``query`` axes before it is
copied to the CPU, so memory holds only what was asked. Values are always detached copies.

Files: :meth:`Trace.save` writes JSON version 2 (the flat steps, each with the position of
its call, and one ``calls`` entry per call); :meth:`Trace.load` reads versions 1 and 2.
Displaying a trace is the render layer's job: ``qkv.render.html(t)`` shows itself in Jupyter.

Example:
    >>> import numpy as np, qkv
    >>> x = np.eye(2)
    >>> with qkv.tracing() as t:
    ...     _ = qkv.self_attention(x, np.eye(2), np.eye(2), np.eye(2))
    >>> [s.name for s in t][:5]
    ['embeddings', 'W_q', 'W_k', 'W_v', 'Q']
    >>> t["weights"].value.round(4)
    array([[0.6698, 0.3302],
           [0.3302, 0.6698]])
    >>> (call,) = t.calls
    >>> call.names[-1], call.meta["backend"], call.meta["scale_mode"]
    ('context', 'reference', 'sqrt_dk')
"""

from __future__ import annotations

from qkv.trace._calls import TraceCall
from qkv.trace._check import MAX_TRACE_BYTES, TRACE_FORMAT, TRACE_VERSION, TraceFileError
from qkv.trace._context import blocks_open, current_trace, resolve, suspended, tracing
from qkv.trace._step import STEP_NAMES, Step
from qkv.trace._trace import Trace

__all__ = [
    "MAX_TRACE_BYTES",
    "STEP_NAMES",
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "Step",
    "Trace",
    "TraceCall",
    "TraceFileError",
    "blocks_open",
    "current_trace",
    "resolve",
    "suspended",
    "tracing",
]
