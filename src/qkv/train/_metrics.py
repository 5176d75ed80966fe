"""What a run records: ``metrics.jsonl`` (one object per evaluation) and its plot (PNG).

Each line of ``metrics.jsonl`` is one evaluation::

    {"step": 200, "loss": 0.41, "accuracy": 0.83, "val_loss": 0.38, "val_accuracy": 0.86,
     "lr": 0.003, "seconds": 12.5, "steps_per_second": 16.0, "examples_per_second": 1024.0}

``loss`` and ``accuracy`` are the training averages over the steps since the previous
evaluation; ``val_*`` are measured on the whole validation set. The file is rewritten
atomically at every evaluation, so it is never half-written.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qkv._extras import require
from qkv._io import write_atomic
from qkv._read import FileLimitError, json_lines, json_value

__all__ = ["METRICS", "PLOT", "MetricsLog", "plot_metrics"]

METRICS = "metrics.jsonl"
PLOT = "metrics.png"
REQUIRED = ("step", "loss", "val_accuracy")


class MetricsLog:
    """The evaluations of a run, kept in ``folder/metrics.jsonl``.

    Example:
        >>> import tempfile
        >>> log = MetricsLog(tempfile.mkdtemp())
        >>> log.append({"step": 10, "loss": 0.5, "val_accuracy": 0.75})
        >>> [row["step"] for row in MetricsLog(log.folder).rows]
        [10]
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self.path = self.folder / METRICS
        self.rows: list[dict[str, Any]] = []
        if self.path.is_file():
            for number, line in json_lines(self.path.read_text(encoding="utf-8")):
                if not line.strip():
                    continue
                try:
                    row = json_value(line)
                except (json.JSONDecodeError, FileLimitError):
                    row = None
                if not (isinstance(row, dict) and isinstance(row.get("step"), int)):
                    raise ValueError(
                        f"{self.path}, line {number}: expected a JSON object with a whole-number "
                        '"step". Hint: the file was edited by hand; remove the line or the file.'
                    )
                self.rows.append(row)

    def truncate(self, step: int) -> None:
        """Forget the evaluations after ``step`` (a run resumed from a checkpoint there)."""
        kept = [row for row in self.rows if int(row.get("step", 0)) <= step]
        if len(kept) != len(self.rows):
            self.rows = kept
            self._write()

    def append(self, row: dict[str, Any]) -> None:
        """Add one evaluation (it must have ``step``, ``loss`` and ``val_accuracy``)."""
        missing = [key for key in REQUIRED if key not in row]
        if missing:
            raise ValueError(f"a metrics row needs {', '.join(missing)}; got {sorted(row)}.")
        self.rows.append(dict(row))
        self._write()

    def _write(self) -> None:
        text = "".join(json.dumps(row, allow_nan=False) + "\n" for row in self.rows)
        write_atomic(self.path, text)


def plot_metrics(
    rows: Sequence[dict[str, Any]], path: str | os.PathLike[str], *, title: str = ""
) -> Path:
    """Draw the loss and the accuracy against the step, training and validation, to a PNG.

    Needs matplotlib (``qkv[viz]``); it draws off screen and writes atomically.

    Raises:
        MissingExtraError: matplotlib is not installed.

    Example:
        >>> import tempfile, os
        >>> rows = [{"step": s, "loss": 1 / s, "val_accuracy": 1 - 1 / s} for s in (1, 2, 4)]
        >>> out = plot_metrics(rows, os.path.join(tempfile.mkdtemp(), "metrics.png"))
        >>> out.read_bytes()[:4]
        b'\\x89PNG'
    """
    require("matplotlib", feature="the training plot", extra="viz")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9.0, 3.6), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    loss_ax, accuracy_ax = figure.subplots(1, 2)
    for ax, keys, label, corner in (
        (
            loss_ax,
            (("loss", "training"), ("val_loss", "validation")),
            "loss (cross-entropy)",
            "upper right",
        ),
        (
            accuracy_ax,
            (("accuracy", "training"), ("val_accuracy", "validation")),
            "accuracy",
            "lower right",
        ),
    ):
        for key, name in keys:
            points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, marker="o" if len(points) < 30 else None, label=name)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc=corner)
    accuracy_ax.set_ylim(-0.02, 1.02)
    if title:
        figure.suptitle(title)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    target = Path(path)
    write_atomic(target, buffer.getvalue())
    return target
