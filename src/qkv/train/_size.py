"""How much memory a training run needs, estimated before anything is allocated.

``qkv train recall --d-model 1000000000`` must be one line, not PyTorch's allocator
traceback. :func:`check_recall` and :func:`check_classify` estimate the bytes of the model
(its parameters, their gradients and AdamW's two moments, float32) and of one step on a
batch (activations kept for the backward pass, the attention weights of every head, the
generated batch), and raise :class:`SizeError` naming the setting that makes it large when
the estimate passes the machine's memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict

from qkv._memory import physical_memory
from qkv._read import size_text
from qkv._train_settings import ClassifySettings, RecallSettings

__all__ = ["SizeError", "check_classify", "check_recall"]

_FLOAT = 4  # bytes of a float32
_PER_PARAMETER = 4 * _FLOAT  # the weight, its gradient, AdamW's two moments
_PER_TOKEN_LAYER = 24  # floats a pre-norm block keeps per token and width for backward (≥ 4·E MLP)


class SizeError(ValueError):
    """A setting makes the run larger than this machine's memory.

    Attributes:
        field: the setting (``"d_model"``); the command-line option is ``--d-model``.
        value: its value. estimate: the bytes needed. available: the machine's memory.
    """

    def __init__(self, field: str, value: int, default: int, estimate: int, available: int) -> None:
        self.field, self.value, self.default = field, value, default
        self.estimate, self.available = estimate, available
        super().__init__(self.message(f"{field}={value}", field))

    def message(self, named: str, option: str) -> str:
        """The one line, with the setting written as ``named`` (``--d-model 1000000000``) and
        as ``option`` in the hint."""
        return (
            f"{named} makes the run need about {size_text(self.estimate)} of memory (the model, "
            f"its gradients and optimizer state, and one step's activations), more than the "
            f"{size_text(self.available)} of this machine. Hint: a smaller {option} "
            f"(default: {self.default})"
        )


def _block_parameters(width: int) -> int:
    """A transformer block: W_q, W_k, W_v, W_o and an MLP of 4·E, with norms and biases."""
    return 12 * width * width + 13 * width


def _step_bytes(batch: int, length: int, width: int, heads: int, layers: int) -> int:
    activations = batch * length * width * _PER_TOKEN_LAYER * layers
    weights = 2 * batch * heads * length * length * layers  # the weights and their gradient
    return _FLOAT * (activations + weights)


def recall_bytes(options: RecallSettings) -> int:
    """The estimate for an associative-recall run (:func:`qkv.train.train_recall`)."""
    vocabulary = options.keys + options.values + 4
    length = 2 * options.pairs + 2
    parameters = (
        vocabulary * options.d_model
        + options.d_model * options.d_model
        + options.layers * _block_parameters(options.d_model)
        + options.d_model * (options.values + 2)
    )
    batch = max(options.batch_size, min(options.validation_size, 4096))
    data = 16 * (options.batch_size + options.validation_size) * length  # token ids, labels
    step = _step_bytes(batch, length, options.d_model, options.num_heads, options.layers)
    return parameters * _PER_PARAMETER + step + data


def classify_bytes(options: ClassifySettings) -> int:
    """The estimate for a text-classification run before its vocabulary is known (the
    embedding table, one row per word, comes on top)."""
    width = options.embedding_dim
    parameters = _block_parameters(width) + 3 * width * width
    step = _step_bytes(options.batch_size, options.max_length, width, options.num_heads, 1)
    return parameters * _PER_PARAMETER + step


def check_recall(options: RecallSettings, available: int | None = None) -> None:
    """Raise :class:`SizeError` when the run needs more than ``available`` bytes (default:
    the machine's memory); it names the size setting furthest above its default."""
    sizes = ("d_model", "layers", "batch_size", "validation_size", "pairs", "num_heads")
    _check(recall_bytes(options), asdict(options), asdict(RecallSettings()), sizes, available)


def check_classify(options: ClassifySettings, available: int | None = None) -> None:
    """:func:`check_recall` for a text-classification run."""
    sizes = ("embedding_dim", "batch_size", "max_length", "num_heads")
    _check(classify_bytes(options), asdict(options), asdict(ClassifySettings()), sizes, available)


def _check(
    estimate: int,
    values: Mapping[str, object],
    defaults: Mapping[str, object],
    sizes: tuple[str, ...],
    available: int | None,
) -> None:
    limit = physical_memory() if available is None else available
    if estimate <= limit:
        return

    def ratio(field: str) -> float:
        value, default = values[field], defaults[field]
        assert isinstance(value, int) and isinstance(default, int)
        return value / max(default, 1)

    field = max(sizes, key=ratio)
    value, default = values[field], defaults[field]
    assert isinstance(value, int) and isinstance(default, int)
    raise SizeError(field, value, default, estimate, limit)
