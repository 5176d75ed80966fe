"""Check a hand-worked attention example: claimed vs computed, and the name of the mistake.

Tutorials, lecture notes and homework often print attention numbers that are wrong. A worked
example file (``docs/example-format.md``) can carry the numbers a text printed under
``claimed``; :func:`check` compares every claimed row with the correct one in the order of
computation (Q, K, V, scores, scaled, exp, exp_sum, weights, products, context, output)
and says, for each:

- ``ok``: it matches within its printed precision (half a unit of the last printed digit,
  widened by the rounding carried from the claimed numbers before it);
- ``mismatch``: a mistake made in this step, with a diagnosis (:data:`DIAGNOSES`): the common
  slip that reproduces the printed numbers, or ``arithmetic``;
- ``consequential``: the step was done right on wrong numbers printed before it;
- ``note``: off only beyond the printed digits (``rounding``), not counted as an error.

Every message says, in plain words, what the step should have been and gives the correct
numbers. Every file is judged with the precision policy of docs/check.md (exact numbers
carry no rounding; in format 2, inputs declared rounded widen every allowance by their true
effect) and every code (``sum-normalised``, ``mask-ignored``, ``digit-slip``, ...), except
``not-softmax``, which only a ``format: 2`` file gets.
``qkv check`` is the command-line form (docs/check.md).

Tools that make the slips themselves (the page's practice mode) use :class:`Setup` (an
example's numbers and options), :func:`slips_for` (the slips that can change a row),
:class:`Slip` and :func:`forward` (every step's values, with one slip made on purpose).

Example:
    >>> from qkv.check import check
    >>> report = check("i-love-statistics")          # seed 000, with its printed numbers
    >>> report.ok
    False
    >>> first = report.first_wrong
    >>> first.step, first.token, first.printed, first.diagnosis
    ('Q', 'love', ('0.59', '0.78'), 'arithmetic')
    >>> [round(x, 2) for x in first.expected]
    [0.5, 0.8]
    >>> report.findings[-1].diagnosis
    'context-not-summed'
    >>> sorted(report.to_dict())
    ['findings', 'ok']
"""

from qkv.check._diagnose import slips_for
from qkv.check._engine import check
from qkv.check._flash import check_flash, check_flash_file
from qkv.check._function import (
    FUNCTION_DIAGNOSES,
    ISOLATIONS,
    FunctionError,
    FunctionReport,
    check_function,
    check_function_file,
    check_module,
    check_module_file,
)
from qkv.check._pipeline import ROW_STEPS, Setup, Slip, Values, forward
from qkv.check._report import DIAGNOSES, FORMATS, STATUSES, Finding, Report

__all__ = [
    "DIAGNOSES",
    "FORMATS",
    "FUNCTION_DIAGNOSES",
    "ISOLATIONS",
    "ROW_STEPS",
    "STATUSES",
    "Finding",
    "FunctionError",
    "FunctionReport",
    "Report",
    "Setup",
    "Slip",
    "Values",
    "check",
    "check_flash",
    "check_flash_file",
    "check_function",
    "check_function_file",
    "check_module",
    "check_module_file",
    "forward",
    "slips_for",
]
