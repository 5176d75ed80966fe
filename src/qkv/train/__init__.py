"""Training: checkpoints (safetensors and JSON, written atomically; never pickle).

Also the training of attention on real tasks (``qkv train``, docs/training.md):
:func:`train_recall` (associative recall), :func:`train_classifier` (text classification
with pretrained word vectors frozen or fine-tuned), the shared loop :func:`fit`, the models
(:class:`RecallModel`, :class:`AttentionClassifier`, :class:`BagOfWords`),
:func:`load_trained`, :func:`evaluate_trained`, :func:`explain_text` and
:func:`embedding_drift`. The settings and their defaults are declared once, as frozen
dataclasses: :class:`TrainSettings` (how to train), :class:`RecallSettings` and
:class:`ClassifySettings`.

Needs PyTorch and safetensors: ``pip install 'qkv[torch]'``.

Example:
    >>> import tempfile, torch
    >>> from qkv.train import load_checkpoint, save_checkpoint
    >>> folder = tempfile.mkdtemp()
    >>> _ = save_checkpoint(folder, step=1, tensors={"W_q": torch.eye(2)}, config={"d_k": 2})
    >>> load_checkpoint(folder).tensors["W_q"]
    tensor([[1., 0.],
            [0., 1.]])
"""

from qkv._extras import require

require("torch", feature="qkv.train")
require("safetensors", feature="qkv.train", extra="torch")

from qkv._train_settings import ClassifySettings, RecallSettings, TrainSettings  # noqa: E402
from qkv.train._checkpoint import (  # noqa: E402
    Checkpoint,
    CheckpointError,
    CheckpointMismatchError,
    latest_checkpoint,
    load_checkpoint,
    restore_rng_states,
    rng_states,
    save_checkpoint,
)
from qkv.train._drift import embedding_drift  # noqa: E402
from qkv.train._loop import Evaluation, FitResult, StepInfo, evaluate, fit  # noqa: E402
from qkv.train._models import (  # noqa: E402
    AttentionClassifier,
    BagOfWords,
    RecallModel,
    build_model,
)
from qkv.train._runs import ClassifyResult, train_classifier, train_recall  # noqa: E402
from qkv.train._tasks import ClassifyTask, RecallTask  # noqa: E402
from qkv.train._text import DataError, LabelledTexts, read_labelled, tokenize  # noqa: E402
from qkv.train._trained import (  # noqa: E402
    Prediction,
    Trained,
    evaluate_trained,
    explain_text,
    load_trained,
)

__all__ = [
    "AttentionClassifier",
    "BagOfWords",
    "Checkpoint",
    "CheckpointError",
    "CheckpointMismatchError",
    "ClassifyResult",
    "ClassifySettings",
    "ClassifyTask",
    "DataError",
    "Evaluation",
    "FitResult",
    "LabelledTexts",
    "Prediction",
    "RecallModel",
    "RecallSettings",
    "RecallTask",
    "StepInfo",
    "TrainSettings",
    "Trained",
    "build_model",
    "embedding_drift",
    "evaluate",
    "evaluate_trained",
    "explain_text",
    "fit",
    "latest_checkpoint",
    "load_checkpoint",
    "load_trained",
    "read_labelled",
    "restore_rng_states",
    "rng_states",
    "save_checkpoint",
    "tokenize",
    "train_classifier",
    "train_recall",
]
