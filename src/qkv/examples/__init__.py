"""Worked examples: the file format of ``qkv explain`` and ``qkv check``, and the built-ins.

A worked example holds the tokens, their embeddings, the projection weights, options and,
optionally, the numbers a tutorial printed for each step (``claimed``). It is a YAML file (or the
same structure in JSON) described in ``docs/example-format.md``; :func:`load` reads and checks
one, and every mistake in it is an :class:`ExampleError` naming the line, the field and a fix.
:func:`run` computes every step and returns the :class:`~qkv.trace.Trace`; :func:`decode_step`
computes one decoding step with a KV cache (``qkv explain --decode``).

Shapes (row vectors, ``Q = X·W_q``): L tokens, E = d_model, H heads, D = d_k per head,
``embeddings`` (L, E), ``W_q``/``W_k`` (E, H·D), ``W_v`` (E, H·Dv), ``W_o`` (H·Dv, E_out).

Example:
    >>> from qkv import examples
    >>> examples.builtin_names()[:3]
    ['i-love-statistics', 'the-cat-sat-on-the-mat', 'two-heads']
    >>> examples.builtin_names()[3:]  # tiled (FlashAttention) examples worked by hand
    ['flash-by-hand', 'flash-forgot-rescale']
    >>> ex = examples.builtin("i-love-statistics")
    >>> ex.embeddings @ ex.W_q
    array([[0.47, 0.68],
           [0.5 , 0.8 ],
           [0.58, 0.81]])
    >>> ex.claimed["Q"][1].texts  # as seed 000 printed it: not [0.50, 0.80]
    ('0.59', '0.78')
"""

from qkv.examples._builtin import builtin, builtin_names, resolve
from qkv.examples._decode import DecodeStep, decode_step
from qkv.examples._errors import ExampleError
from qkv.examples._format import CLAIMABLE, load, loads
from qkv.examples._model import Claimed, Example
from qkv.examples._run import run

__all__ = [
    "CLAIMABLE",
    "Claimed",
    "DecodeStep",
    "Example",
    "ExampleError",
    "builtin",
    "builtin_names",
    "decode_step",
    "load",
    "loads",
    "resolve",
    "run",
]
