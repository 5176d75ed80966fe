"""What ``qkv bench`` measures and what it finds: its settings, and the tables of rows it fills.

Plain data, without PyTorch: the CLI reads the settings and formats the tables (``_tables``)
without measuring anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MOST_REPEATS", "SPREAD_BOUND", "Row", "Settings", "Table", "caveat"]


@dataclass(frozen=True)
class Settings:
    """What to measure: lengths and repeats (``quick`` for a shorter run).

    ``mask_length`` is the longest length of the structured masks; they are also measured
    at 4096 when that is shorter (:attr:`mask_lengths`). ``train_length``: the forward +
    backward against SDPA.
    """

    lengths: tuple[int, ...] = (1024, 4096, 16384)
    mask_length: int = 16384
    long_length: int = 32768
    decode_length: int = 32768
    trace_length: int = 4096
    repeats: int = 3
    threads: int = 0  # 0: PyTorch's default
    quick: bool = False
    train_length: int = 4096

    @classmethod
    def quick_run(cls) -> Settings:
        return cls((512, 1024, 2048), 4096, 4096, 4096, 2048, 2, quick=True, train_length=2048)

    @property
    def mask_lengths(self) -> tuple[int, ...]:
        """The lengths of the structured-mask section: 4096 and ``mask_length``.

        Example:
            >>> Settings().mask_lengths, Settings.quick_run().mask_lengths
            ((4096, 16384), (4096,))
        """
        return tuple(sorted({min(4096, self.mask_length), self.mask_length}))

    def budget(self, section: str) -> float:
        """Seconds of calls each peer of ``section`` is timed for, past its repeats
        (``_measure.medians``): 1 for ``dense``, 3 for ``masks`` (whose targets are finer
        than a median of 3 can tell on a shared machine), 0 otherwise and in a quick run.

        Example:
            >>> Settings().budget("masks"), Settings.quick_run().budget("masks")
            (3.0, 0.0)
        """
        return 0.0 if self.quick else _BUDGETS.get(section, 0.0)


_BUDGETS = {"dense": 1.0, "masks": 3.0}

MOST_REPEATS = 100
"""The most timed calls of one peer that a budget asks for (``_measure.medians``)."""

SPREAD_BOUND = 0.10
"""The most a peer's repeats may spread (their interquartile range over their median,
``_measure.spread``) before a missed target is marked noisy: beyond it, the median itself
may be off by several percent, as much as the goals' margins (1.03, 1.05)."""


def caveat(load: float | None, spread: float | None, cores: int | None) -> str:
    """Why a missed target may be the machine's, not the code's: the 1-minute load average
    above the core count while it was measured, or repeats that spread beyond
    :data:`SPREAD_BOUND`; "" when neither (or nothing is known).

    Example:
        >>> caveat(3.14, 0.02, 2)
        'machine busy: load 3.1 on 2 cores'
        >>> caveat(1.2, 0.4, 2)
        'noisy: spread 40 %'
        >>> caveat(1.2, 0.05, 2)
        ''
    """
    if load is not None and cores and load > cores:
        return f"machine busy: load {load:.1f} on {cores} core{'s' if cores != 1 else ''}"
    if spread is not None and spread > SPREAD_BOUND:
        return f"noisy: spread {100 * spread:.0f} %"
    return ""


@dataclass
class Row:
    """One measured case of one peer."""

    case: str
    length: int
    peer: str
    seconds: float | None
    flops: float = 0.0
    memory: int | None = None
    ratio: float | None = None  # seconds / the table's reference peer's seconds
    memory_ratio: float | None = None
    note: str = ""
    compile_seconds: float | None = None  # torch.compile's first call, apart from the time
    ran: str = ""  # the backend qkv's auto ran (its rows only)
    spread: float | None = None  # of the timed repeats (``_measure.spread``)
    load: float | None = None  # the 1-minute load average when its section was done
    caveat: str = ""  # targets only: why a "no" may be the machine's (:func:`caveat`)


@dataclass
class Table:
    """The rows of one section, with its title and what the ratios compare to."""

    key: str
    title: str
    reference: str
    rows: list[Row] = field(default_factory=list)
    note: str = ""
