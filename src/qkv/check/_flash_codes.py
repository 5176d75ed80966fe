"""Every code ``--kind flash`` reports (a FlashAttention forward, its log-sum-exp and its
backward), declared once with the part it costs in ``qkv grade`` and its sentence: what is
wrong and what it should be.

The slips that give them are made on purpose, in float64, by :mod:`~qkv.check._flash_slips`;
plain attention codes that apply to a tiled kernel (``unscaled``, ``scaled-by-dk``,
``causal-off-by-one``) keep the sentences of :data:`~qkv.check._function_codes.FUNCTION_DIAGNOSES`.

Example:
    >>> FLASH_DIAGNOSES["flash-lse-wrong-base"][:40]
    'the log-sum-exp is in base 2 (log2 or ex'
"""

from __future__ import annotations

from qkv.check._findings import Diagnosis
from qkv.check._function_codes import FUNCTION_DIAGNOSES

__all__ = ["FLASH_CODES", "FLASH_DIAGNOSES", "PLAIN_IN_FLASH"]

PLAIN_IN_FLASH: dict[str, str | None] = {
    "unscaled": "flash-output",
    "scaled-by-dk": "flash-output",
    "causal-off-by-one": None,
}
"""The plain attention codes a FlashAttention kernel can make (``--function`` words them),
each with the part it costs in a FlashAttention assignment; None: the probe's (the causal
part on a causal probe, else the forward output)."""

FLASH_CODES: tuple[Diagnosis, ...] = (
    Diagnosis(
        "flash-no-rescale",
        "flash-output",
        (
            "the accumulator O is not rescaled by exp(m_old − m_new) when the running maximum "
            "grows, so the key blocks seen before keep weights computed against an old maximum: "
            "O = exp(m_old − m_new)·O + P̃·V_j (diag(exp(m_old − m_new)) in the paper)"
        ),
    ),
    Diagnosis(
        "flash-sum-not-rescaled",
        "flash-output",
        (
            "the running sum l is not rescaled by exp(m_old − m_new) when the running maximum "
            "grows: l = exp(m_old − m_new)·l + rowsum(P̃)"
        ),
    ),
    Diagnosis(
        "flash-max-not-updated",
        "flash-output",
        (
            "the running maximum m is not updated to max(m_old, rowmax(S_j)), so exp(S_j − m) "
            "overflows to inf once a later block holds a larger score; NaN follows"
        ),
    ),
    Diagnosis(
        "flash-final-divide-missing",
        "flash-output",
        (
            "the output is not divided by the running sum l after the last key block: O = O / l "
            "(diag(l)⁻¹·O)"
        ),
    ),
    Diagnosis(
        "flash-lse-wrong-base",
        "flash-lse",
        (
            "the log-sum-exp is in base 2 (log2 or exp2 without the matching scale by ln 2): "
            "L = m + ln(l), in natural log, is what the backward recomputes P from"
        ),
    ),
    Diagnosis(
        "flash-lse-without-max",
        "flash-lse",
        (
            "the log-sum-exp leaves out the running maximum: L = m + log(l), not log(l) (l was "
            "summed after subtracting m)"
        ),
    ),
    Diagnosis(
        "flash-empty-tile-nan",
        "flash-causal",
        (
            "a fully masked key block gives NaN: its row maximum is −inf and exp(−inf − (−inf)) "
            "is NaN; skip the block, or take the maximum with the running one before "
            "subtracting (and treat an all −inf row as 0)"
        ),
    ),
    Diagnosis(
        "flash-causal-diagonal",
        "flash-causal",
        (
            "the block on the causal diagonal is masked wrong or skipped: in the diagonal block "
            "query i must see keys 0 … i, itself included, and nothing after it"
        ),
    ),
    Diagnosis(
        "flash-causal-offset",
        "flash-causal",
        (
            "the causal mask is built from indices local to the block (0 … B − 1) instead of the "
            "global positions: compare i_block·B_q + r with j_block·B_k + c"
        ),
    ),
    Diagnosis(
        "flash-causal-ignored",
        "flash-causal",
        ("is_causal is ignored: with is_causal=True query i must see only the keys 0 … i"),
    ),
    Diagnosis(
        "flash-last-tile-dropped",
        "flash-output",
        (
            "the last block is dropped when the length is not a multiple of the block size "
            "(range(n // B)): count the blocks as ceil(n / B) and let the last one be shorter"
        ),
    ),
    Diagnosis(
        "flash-kv-tiles-from-q",
        "flash-output",
        (
            "the number of key blocks is counted from the query length, which loses keys when "
            "n_k > n_q: count the key blocks from K's length"
        ),
    ),
    Diagnosis(
        "flash-raised",
        "flash-output",
        (
            "the code raised on some inputs where FlashAttention is defined (the others ran): "
            "lengths that are not a multiple of the block, a last block of one row, several "
            "heads, causal"
        ),
    ),
    Diagnosis(
        "flash-backward-D",
        "flash-backward",
        (
            "D is wrong in the backward: D = rowsum(dO ∘ O) (one number per query), and "
            "dS = P ∘ (dP − D)"
        ),
    ),
    Diagnosis(
        "flash-backward-scale",
        "flash-backward",
        (
            "the backward's scale is wrong: dQ = dS·K/√d and dK = dSᵀ·Q/√d, the same 1/√d as "
            "the forward, once"
        ),
    ),
    Diagnosis(
        "flash-unrecognised",
        "flash-output",
        ("the numbers are not FlashAttention's, and no common slip reproduces them"),
    ),
)
"""The codes of the tiled algorithm, each with its part (one of
:data:`qkv.grade._parts.FLASH_PARTS`) and its sentence."""

FLASH_DIAGNOSES: dict[str, str] = {
    **{code: FUNCTION_DIAGNOSES[code] for code in PLAIN_IN_FLASH},
    **{d.code: d.sentence for d in FLASH_CODES},
}
"""Every code ``--kind flash`` can report, with its sentence."""
