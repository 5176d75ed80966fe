"""The benchmarks behind ``qkv bench``: the suite, memory measurement, tables and plots.

A layer of its own above the kernels, the attention entry and ``qkv.nn`` (whose modules it
measures); nothing below imports it. The command ``qkv bench`` (``qkv.cli._bench``) and
``benchmarks/bench_attention.py`` are thin layers over it.

- ``_results``: what to measure (:class:`Settings`) and what was found (:class:`Table` of
  :class:`Row`), plain data;
- ``_measure``: the machine, the peers (tiled kernel, torch SDPA, naive, FlexAttention) and
  the timing (medians of alternating repeats, ratios to a peer of the same run); needs PyTorch;
- ``_memory``: the peak memory a call adds, measured by the operating system
  (:func:`peak_memory`);
- ``_suite``: the sections (dense, masks, long, trace, decode), each a table, and
  ``run_suite``; needs PyTorch;
- ``_tables`` and ``_plots``: the tables for the terminal and docs/benchmarks.md, and their
  plots (matplotlib).

Importing this package does not import PyTorch: the CLI lists the sections and formats tables
without it.

Example:
    >>> from qkv.bench import Settings
    >>> Settings.quick_run().lengths
    (512, 1024, 2048)
"""

from qkv.bench._memory import peak_memory, resident
from qkv.bench._results import Row, Settings, Table

__all__ = ["Row", "Settings", "Table", "peak_memory", "resident"]
