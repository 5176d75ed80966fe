"""The training loop shared by every task: AdamW, evaluation, early stopping, checkpoints.

A run writes into one folder::

    OUT/metrics.jsonl       one object per evaluation (step, loss, val_accuracy, ...)
    OUT/metrics.png         loss and accuracy against the step (redrawn every 20 s, and
                            at the end)
    OUT/checkpoints/        the newest checkpoints (every evaluation, the end, Ctrl-C)
    OUT/best/               the checkpoint with the best validation accuracy so far

Everything a step depends on is in a checkpoint: the model, AdamW's moments, the step, the
random generators and the loop's counters; a task's batch at step ``s`` depends only on its
seed and ``s``. So ``resume=True`` continues exactly as the run would have gone on: the
same losses, to the last bit, on the same machine.

Ctrl-C (SIGINT) is noted and acted on between two steps: the loop saves a checkpoint, then
raises ``KeyboardInterrupt``. A second Ctrl-C stops at once (the checkpoint being written is
either complete or absent: saves are atomic).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from qkv._train_settings import TrainSettings
from qkv.train._checkpoint import (
    CheckpointError,
    check_resume_state,
    latest_checkpoint,
    load_checkpoint,
    restore_rng_states,
    rng_states,
    save_checkpoint,
)
from qkv.train._metrics import PLOT, MetricsLog, plot_metrics
from qkv.train._tasks import Batch

__all__ = [
    "BEST",
    "CHECKPOINTS",
    "Evaluation",
    "FitResult",
    "StepInfo",
    "Task",
    "TrainSettings",
    "evaluate",
    "fit",
]

CHECKPOINTS = "checkpoints"
BEST = "best"
PLOT_EVERY = 20.0
"""Seconds between two drawings of ``metrics.png`` while training (it is also drawn at the
end, on Ctrl-C and at the first evaluation after this long)."""


class Task(Protocol):
    """What :func:`fit` needs from a task: a batch per step and the validation batches."""

    name: str
    labels: tuple[str, ...]

    def train_batch(self, step: int) -> Batch: ...

    def validation_batches(self) -> Iterator[Batch]: ...


@dataclass(frozen=True)
class Evaluation:
    """Loss, accuracy and the confusion matrix of a model on some batches.

    Attributes:
        loss: the mean cross-entropy.
        accuracy: the share of examples whose highest-scoring class is the target.
        confusion: (C, C) counts: ``confusion[t, p]`` examples of class t predicted as p.
        labels: the C class names.
    """

    loss: float
    accuracy: float
    confusion: np.ndarray
    labels: tuple[str, ...]

    @property
    def count(self) -> int:
        return int(self.confusion.sum())

    def per_class(self) -> list[dict[str, Any]]:
        """One dict per class: label, examples, correct, predicted (how often it was
        predicted), accuracy (correct / examples, None for a class with no examples)."""
        out = []
        for i, label in enumerate(self.labels):
            examples, correct = int(self.confusion[i].sum()), int(self.confusion[i, i])
            out.append(
                {
                    "label": label,
                    "examples": examples,
                    "correct": correct,
                    "predicted": int(self.confusion[:, i].sum()),
                    "accuracy": correct / examples if examples else None,
                }
            )
        return out


def evaluate(model: nn.Module, batches: Iterable[Batch], labels: Sequence[str]) -> Evaluation:
    """Evaluate ``model`` (in eval mode, without gradients) on ``batches``.

    Raises:
        ValueError: no examples.

    Example:
        >>> from qkv.train import BagOfWords
        >>> from qkv.train._tasks import Batch
        >>> model = BagOfWords(5, 2, embedding_dim=3)
        >>> batch = Batch(torch.tensor([[1, 2], [3, 0]]), torch.tensor([2, 1]),
        ...               torch.tensor([0, 1]))
        >>> result = evaluate(model, [batch], ["no", "yes"])
        >>> result.count, result.confusion.shape
        (2, (2, 2))
    """
    classes = len(labels)
    confusion = np.zeros((classes, classes), dtype=np.int64)
    loss_sum, count = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                logits = model(batch.tokens, batch.lengths)  # (B, C)
                loss_sum += float(
                    nn.functional.cross_entropy(logits, batch.targets, reduction="sum")
                )
                predicted = logits.argmax(dim=-1).numpy()
                np.add.at(confusion, (batch.targets.numpy(), predicted), 1)
                count += len(batch)
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("nothing to evaluate: the data has no examples.")
    accuracy = float(np.trace(confusion)) / count
    return Evaluation(loss_sum / count, accuracy, confusion, tuple(labels))


@dataclass(frozen=True)
class StepInfo:
    """What a callback of :func:`fit` sees after each step."""

    step: int
    loss: float
    accuracy: float
    lr: float


@dataclass
class FitResult:
    """The outcome of :func:`fit`.

    Attributes:
        out: the run's folder.
        step: the steps done in all.
        stopped: why it stopped: ``"steps"``, ``"patience"`` (early stopping) or
            ``"target"`` (the target accuracy was reached).
        best_step, best_accuracy, best_loss: the best validation evaluation.
        rows: every evaluation, as in ``metrics.jsonl``.
        seconds: training time in all (a resumed run adds its time to the earlier one's).
        plot_skipped: why ``metrics.png`` was not drawn (e.g. matplotlib is not installed:
            "needs qkv[viz]"), or None when it was.
    """

    out: Path
    step: int
    stopped: str
    best_step: int | None
    best_accuracy: float | None
    best_loss: float | None
    rows: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    plot_skipped: str | None = None

    @property
    def best(self) -> Path:
        """The folder of the best checkpoint (give it to ``load_trained`` or ``qkv evaluate``)."""
        return self.out / BEST

    @property
    def checkpoints(self) -> Path:
        return self.out / CHECKPOINTS


@dataclass
class _LoopState:
    step: int = 0
    best_accuracy: float | None = None
    best_loss: float | None = None
    best_step: int | None = None
    bad_evaluations: int = 0
    stopped: str | None = None
    seconds: float = 0.0
    loss_sum: float = 0.0  # over the steps since the last evaluation
    correct: int = 0
    seen: int = 0
    steps_since: int = 0

    def improved(self, accuracy: float, loss: float) -> bool:
        if self.best_accuracy is None or self.best_loss is None:
            return True
        return accuracy > self.best_accuracy or (
            accuracy == self.best_accuracy and loss < self.best_loss
        )


def fit(
    model: nn.Module,
    task: Task,
    settings: TrainSettings,
    out: str | os.PathLike[str],
    *,
    config: Mapping[str, Any],
    resume: bool = False,
    extra_state: Mapping[str, Any] | None = None,
    callbacks: Sequence[Callable[[StepInfo], None]] = (),
    progress: bool = True,
    title: str = "",
) -> FitResult:
    """Train ``model`` on ``task`` with AdamW, evaluating and saving every ``eval_every`` steps.

    Seed the random generators (``torch.manual_seed``) before building the model: the
    weights it starts from are then the same for the same seed.

    Args:
        model: the model: ``model(tokens, lengths)`` → logits (B, C). Parameters with
            ``requires_grad=False`` (frozen embeddings) are left out of the optimizer and
            stay bit-identical.
        task: gives the batch of each step and the validation batches.
        settings: steps, learning rate, evaluation, early stopping.
        out: the run's folder (created); see the module docstring for what goes in it.
        config: JSON data saved in every checkpoint (task, model and data settings, the
            vocabulary and labels): what :func:`qkv.train.load_trained` rebuilds the model
            from. ``settings`` is added to it under ``"training"``.
        resume: continue from the newest checkpoint in ``out/checkpoints`` (its model,
            optimizer, random generators and step); ``settings`` may change the number of
            steps, the evaluation and the early stopping.
        extra_state: more to save in each checkpoint (tensors allowed), e.g. the embeddings
            a run started from.
        callbacks: called after each step (and its evaluation, if any) with a
            :class:`StepInfo`; raising ``KeyboardInterrupt`` there acts as Ctrl-C (a
            checkpoint is saved first).
        progress: show a progress bar on stderr (rich).
        title: the title of the plot.

    Returns:
        A :class:`FitResult`.

    Raises:
        CheckpointError: ``resume`` without a checkpoint, a damaged checkpoint, or a new run
            in a folder that holds one already.
        CheckpointMismatchError: the checkpoint's tensors do not fit ``model``.
        KeyboardInterrupt: after Ctrl-C, once the checkpoint is saved.
    """
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    config = {**config, "training": asdict(settings)}
    optimizer = _optimizer(model, settings)
    log = MetricsLog(folder)
    state = _LoopState()
    if resume:
        state = _restore(model, optimizer, folder, log)
    elif latest_checkpoint(folder / CHECKPOINTS) is not None:
        raise CheckpointError(
            "this folder holds a run already (checkpoints/)",
            path=folder,
            hint="pass --resume (resume=True) to continue it, or choose another --out",
        )
    elif log.rows:
        log.truncate(-1)  # a folder with metrics but no checkpoint: start the file again

    def save(where: str) -> Path:
        snapshot = {
            "optimizer": optimizer.state_dict(),
            "rng": rng_states(),
            "loop": asdict(state),
            "extra": dict(extra_state or {}),
        }
        return save_checkpoint(
            folder / where,
            step=state.step,
            tensors=model.state_dict(),
            config=config,
            state=snapshot,
            keep=1 if where == BEST else settings.keep,
        )

    saved_at = state.step if resume else -1
    model.train()
    started = time.perf_counter() - state.seconds
    plotted = time.perf_counter()  # the plot is drawn every PLOT_EVERY seconds and at the end
    bar = _Bar(progress, settings.steps, state.step, task.name)
    try:
        with _DeferredInterrupt() as interrupt, bar:
            while state.step < settings.steps and state.stopped is None:
                info = _train_step(model, optimizer, task, settings, state)
                state.seconds = time.perf_counter() - started
                bar.update(state, info)
                if state.step % settings.eval_every == 0 or state.step == settings.steps:
                    row = _evaluate_now(model, task, settings, state, log)
                    bar.evaluated(row)
                    if row["improved"]:
                        save(BEST)
                    save(CHECKPOINTS)
                    saved_at = state.step
                    if time.perf_counter() - plotted >= PLOT_EVERY:
                        _plot(log, folder, title)
                        plotted = time.perf_counter()
                for callback in callbacks:
                    callback(info)
                interrupt.check()
    except KeyboardInterrupt:
        if state.step != saved_at:
            path = save(CHECKPOINTS)
            bar.note(f"interrupted at step {state.step}: saved {path}")
        _plot(log, folder, title)
        raise
    if state.step != saved_at:  # finished between evaluations (resumed past the last step)
        save(CHECKPOINTS)
    plot_skipped = _plot(log, folder, title)
    return FitResult(
        out=folder,
        step=state.step,
        stopped=state.stopped or "steps",
        best_step=state.best_step,
        best_accuracy=state.best_accuracy,
        best_loss=state.best_loss,
        rows=list(log.rows),
        seconds=state.seconds,
        plot_skipped=plot_skipped,
    )


def _optimizer(model: nn.Module, settings: TrainSettings) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for module in model.modules():
        for name, parameter in module.named_parameters(recurse=False):
            if not parameter.requires_grad:
                continue
            if isinstance(module, nn.Linear) and name == "weight":
                decay.append(parameter)
            else:
                no_decay.append(parameter)
    groups = [
        {"params": decay, "weight_decay": settings.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=settings.lr_at(0), weight_decay=0.0
    )


def _train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    task: Task,
    settings: TrainSettings,
    state: _LoopState,
) -> StepInfo:
    lr = settings.lr_at(state.step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    batch = task.train_batch(state.step)
    logits = model(batch.tokens, batch.lengths)  # (B, C)
    loss = nn.functional.cross_entropy(logits, batch.targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    if settings.clip is not None:
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        nn.utils.clip_grad_norm_(parameters, settings.clip)
    optimizer.step()
    correct = int((logits.detach().argmax(dim=-1) == batch.targets).sum())
    value = float(loss.detach())
    state.step += 1
    state.loss_sum += value * len(batch)
    state.correct += correct
    state.seen += len(batch)
    state.steps_since += 1
    return StepInfo(state.step, value, correct / len(batch), lr)


def _evaluate_now(
    model: nn.Module,
    task: Task,
    settings: TrainSettings,
    state: _LoopState,
    log: MetricsLog,
) -> dict[str, Any]:
    result = evaluate(model, task.validation_batches(), task.labels)
    previous = log.rows[-1] if log.rows else None
    elapsed = state.seconds - (previous["seconds"] if previous else 0.0)
    row: dict[str, Any] = {
        "step": state.step,
        "loss": state.loss_sum / max(state.seen, 1),
        "accuracy": state.correct / max(state.seen, 1),
        "val_loss": result.loss,
        "val_accuracy": result.accuracy,
        "lr": settings.lr_at(state.step - 1),
        "seconds": round(state.seconds, 3),
        "steps_per_second": round(state.steps_since / elapsed, 3) if elapsed > 0 else None,
        "examples_per_second": round(state.seen / elapsed, 1) if elapsed > 0 else None,
    }
    improved = state.improved(result.accuracy, result.loss)
    if improved:
        state.best_accuracy, state.best_loss = result.accuracy, result.loss
        state.best_step, state.bad_evaluations = state.step, 0
    else:
        state.bad_evaluations += 1
    row["best"] = improved
    log.append(row)
    state.loss_sum, state.correct, state.seen, state.steps_since = 0.0, 0, 0, 0
    if settings.target_accuracy is not None and result.accuracy >= settings.target_accuracy:
        state.stopped = "target"
    elif settings.patience is not None and state.bad_evaluations >= settings.patience:
        state.stopped = "patience"
    return {**row, "improved": improved}


def _restore(
    model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, log: MetricsLog
) -> _LoopState:
    where = folder / CHECKPOINTS
    if latest_checkpoint(where) is None:
        raise CheckpointError(
            "nothing to resume: no checkpoint in checkpoints/",
            path=folder,
            hint="give the --out folder of an earlier run, or start without --resume",
        )
    checkpoint = load_checkpoint(where, expected_shapes=model.state_dict())
    check_resume_state(checkpoint, optimizer, [f.name for f in fields(_LoopState)])
    model.load_state_dict(checkpoint.tensors)
    try:
        optimizer.load_state_dict(checkpoint.state["optimizer"])
    except (ValueError, KeyError) as error:
        raise CheckpointError(
            f"the optimizer state does not fit the model ({error})",
            path=checkpoint.path,
            hint="resume with the options the run started with (e.g. the same "
            "--freeze-embeddings / --fine-tune-embeddings)",
        ) from None
    restore_rng_states(checkpoint.state["rng"])
    loop = dict(checkpoint.state["loop"])
    state = _LoopState(**loop)
    state.step = checkpoint.step
    state.stopped = None
    log.truncate(state.step)
    return state


def _plot(log: MetricsLog, folder: Path, title: str) -> str | None:
    """Draw ``metrics.png``; None when drawn, else why not (the metrics are there; the plot
    is only a view of them, so a missing matplotlib does not stop the run)."""
    if not log.rows:
        return "no evaluation yet"
    from qkv._extras import MissingExtraError

    try:
        plot_metrics(log.rows, folder / PLOT, title=title)
    except MissingExtraError:
        return "matplotlib is not installed; needs qkv[viz]"
    return None


class _DeferredInterrupt:
    """Turn Ctrl-C into a flag read between steps (a second Ctrl-C interrupts at once)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> _DeferredInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def check(self) -> None:
        if self.requested:
            raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)


class _Bar:
    """The progress bar: step, loss, accuracy, validation accuracy, speed (rich, stderr)."""

    def __init__(self, enabled: bool, total: int, done: int, title: str) -> None:
        self.enabled = enabled
        self.total, self.done, self.title = total, done, title
        self.val = "  -   "
        self._last = (time.perf_counter(), done)
        self.speed = 0.0
        self.progress: Any = None

    def __enter__(self) -> _Bar:
        if not self.enabled:
            return self
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=10),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("acc {task.fields[acc]}"),
            TextColumn("val {task.fields[val]}"),
            TextColumn("{task.fields[speed]} it/s"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
        )
        self.progress.start()
        self.task = self.progress.add_task(
            self.title,
            total=self.total,
            completed=self.done,
            loss="  -   ",
            acc="  -  ",
            val=self.val,
            speed="  -",
        )
        return self

    def update(self, state: _LoopState, info: StepInfo) -> None:
        if self.progress is None:
            return
        now = time.perf_counter()
        if now - self._last[0] >= 0.5:
            self.speed = (state.step - self._last[1]) / (now - self._last[0])
            self._last = (now, state.step)
        self.progress.update(
            self.task,
            completed=state.step,
            loss=f"{state.loss_sum / max(state.seen, 1):.4f}",
            acc=f"{state.correct / max(state.seen, 1):.3f}",
            val=self.val,
            speed=f"{self.speed:5.1f}",
        )

    def evaluated(self, row: Mapping[str, Any]) -> None:
        """Show the evaluation just made (the bar's last line must not lag one behind)."""
        self.val = f"{row['val_accuracy']:.4f}"
        if self.progress is not None:
            self.progress.update(self.task, val=self.val)

    def note(self, text: str) -> None:
        print(f"qkv: {text}", file=sys.stderr)

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()
