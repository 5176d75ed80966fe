"""How many cells of a sweep run at once (checked against the memory the process may still
take), and the progress bar of a long sweep."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from qkv._memory import available_memory
from qkv._read import size_text

__all__ = ["DEFAULT_ROWS", "bar", "check_batch"]

DEFAULT_ROWS = 64
"""The most batch rows a sweep runs at once when ``batch`` is not given (fewer when memory
is short)."""


def check_batch(batch: object, rows: int, row_bytes: int, where: str) -> int:
    """The batch rows a sweep runs at once: ``batch`` if given (checked against the memory
    this process may still take), else up to :data:`DEFAULT_ROWS` that fit in half of it;
    at most ``rows``.

    Raises:
        TypeError: ``batch`` is not a positive integer.
        ValueError: the batch (or one row) needs more memory than the process may take.
    """
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise TypeError(
            f"{where}: batch must be a positive integer (heads run at once), got {batch!r}. "
            "Hint: batch=8; the default fits the memory."
        )
    free = available_memory()
    fit = rows if free is None else max(free // max(row_bytes, 1), 0)
    if batch is None:
        if fit < 1:
            batch = 1  # refused just below, with the numbers
        else:
            half = rows if free is None else max(1, free // 2 // max(row_bytes, 1))
            return max(1, min(rows, DEFAULT_ROWS, half))
    batch = min(batch, max(rows, 1))
    if free is not None and batch * row_bytes > free:
        hint = f"batch={fit}" if fit >= 1 else "fewer tokens, or a smaller model"
        raise ValueError(
            f"{where}: a batch of {batch} rows needs about {size_text(batch * row_bytes)} "
            f"({size_text(row_bytes)} a row: logits, activations, scores and cache), more "
            f"than the {size_text(free)} this process may still take. Hint: {hint}."
        )
    return batch


@contextmanager
def bar(enabled: bool, total: int, title: str) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr (rich, gone when done; none when stderr is not a
    terminal): yields ``advance(n)``."""
    from rich.console import Console

    console = Console(stderr=True)
    if not enabled or not console.is_terminal:
        yield lambda n: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(title, total=total)
        yield lambda n: progress.update(task, advance=n)
