"""What ``qkv bench`` measures and what it finds: its settings, and the tables of rows it fills.

Plain data, without PyTorch: the CLI reads the settings and formats the tables (``_tables``)
without measuring anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Row", "Settings", "Table"]


@dataclass(frozen=True)
class Settings:
    """What to measure: lengths and repeats (``quick`` for a run under a minute)."""

    lengths: tuple[int, ...] = (1024, 4096, 16384)
    mask_length: int = 16384
    long_length: int = 32768
    decode_length: int = 32768
    trace_length: int = 4096
    repeats: int = 3
    threads: int = 0  # 0: PyTorch's default
    quick: bool = False

    @classmethod
    def quick_run(cls) -> Settings:
        return cls((512, 1024, 2048), 4096, 4096, 4096, 2048, 2, quick=True)


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


@dataclass
class Table:
    """The rows of one section, with its title and what the ratios compare to."""

    key: str
    title: str
    reference: str
    rows: list[Row] = field(default_factory=list)
    note: str = ""
