"""Interventions on a model's attention heads, exact and on the fast path.

``with qkv.intervene(model, *edits):`` runs a Hugging Face model (of a family qkv traces) or
a model of ``qkv.nn`` modules with some heads changed. Each edit names a layer (0-based, as
``qkv.tracing`` counts attention layers, or its module path) and a query head:

- :func:`ablate` ``(layer, head, how="zero"|"mean", mean=None)``: the head's context, its
  slice of the input to the output projection, becomes zeros or its mean
  (:func:`head_means` over some prompts);
- :func:`patch` ``(layer, head, source, what="context"|"weights")``: the context (or the
  attention pattern, with this run's values) recorded in another run by :func:`record`;
- :func:`scale` ``(layer, head, factor)``;
- :func:`set_weights` ``(layer, head, query, weights)``: one row of the pattern.

:data:`EDITS` is the registry of these kinds (each one class, which applies itself).

Only the edited heads' slices change: the other heads keep the fast kernel's output, and a
weight edit computes only its rows. Under grouped-query attention an edit of one query head
never changes the others that share its key/value head.

:func:`patching` sweeps a patch over every layer and head (a (layers x heads) table of a
metric such as :func:`logit_diff` or :func:`prob`), each layer's heads as one batch that
runs only the layers above; :func:`ablation_sweep` does the same with ablations,
:func:`position_patching` one head at one position at a time, and :func:`path_patching` a
head's effect through one later head's queries, keys or values; :func:`head_stats` measures
what each head attends to (entropy, sink mass, previous-token, induction and diagonal
scores). :func:`logit_attribution` gives each head's
direct effect on an answer's logit (its output through the final norm, folded as
TransformerLens folds it); :func:`score_terms` splits one head's score of one query into the
terms of its query and key coordinates.

Example:
    >>> import torch, qkv
    >>> from qkv.edits import ablate, scale
    >>> attn = qkv.nn.MultiHeadAttention(8, num_heads=2)
    >>> x = torch.randn(1, 3, 8)
    >>> with qkv.intervene(attn, scale(0, 1, 0.0)):
    ...     scaled = attn(x)
    >>> with qkv.intervene(attn, ablate(0, 1)):
    ...     zeroed = attn(x)
    >>> torch.equal(scaled, zeroed)
    True
"""

from qkv.edits._attribution import FAMILIES, HeadAttribution, logit_attribution
from qkv.edits._intervene import intervene
from qkv.edits._patching import (
    Metric,
    PatchingResult,
    PositionPatchingResult,
    ablation_sweep,
    logit_diff,
    patching,
    path_patching,
    position_patching,
    prob,
)
from qkv.edits._record import head_means, record
from qkv.edits._score_terms import ScoreTerms, score_terms
from qkv.edits._specs import (
    EDITS,
    Ablate,
    Edit,
    HeadMeans,
    Patch,
    Recording,
    Scale,
    SetWeights,
    ablate,
    patch,
    scale,
    set_weights,
)
from qkv.edits._stats import STATISTICS, HeadStats, head_stats

__all__ = [
    "EDITS",
    "FAMILIES",
    "STATISTICS",
    "Ablate",
    "Edit",
    "HeadAttribution",
    "HeadMeans",
    "HeadStats",
    "Metric",
    "Patch",
    "PatchingResult",
    "PositionPatchingResult",
    "Recording",
    "Scale",
    "ScoreTerms",
    "SetWeights",
    "ablate",
    "ablation_sweep",
    "head_means",
    "head_stats",
    "intervene",
    "logit_attribution",
    "logit_diff",
    "patch",
    "patching",
    "path_patching",
    "position_patching",
    "prob",
    "record",
    "scale",
    "score_terms",
    "set_weights",
]
