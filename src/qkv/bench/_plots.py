"""The plots of ``qkv bench``: time against length for the dense section, time and peak
memory per peer for the structured masks at each length (PNG, with matplotlib)."""

from __future__ import annotations

import io
from pathlib import Path

from qkv._extras import require
from qkv._io import write_atomic
from qkv.bench._results import Table

__all__ = ["plot"]


def plot(table: Table, path: Path) -> None:
    """Draw the plot of a ``dense`` or ``masks`` table into the PNG file ``path`` (atomically).

    Raises:
        MissingExtraError: matplotlib is not installed (``pip install 'qkv[viz]'``).
    """
    require("matplotlib", feature="qkv bench plots")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if table.key == "dense":
        cases = ["dense", "causal"]
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
        for ax, case in zip(axes, cases, strict=True):
            peers = dict.fromkeys(r.peer for r in table.rows)
            for peer in peers:
                points = [
                    (r.length, r.seconds * 1e3)
                    for r in table.rows
                    if r.case == case and r.peer == peer and r.seconds
                ]
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, marker="o", label=peer, linewidth=2 if peer == "tiled" else 1)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{case} forward")
            ax.set_xlabel("sequence length N")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("time (ms)")
        drawn = [ax for ax in axes if ax.get_legend_handles_labels()[0]]
        if drawn:
            drawn[-1].legend(fontsize=8)
    else:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
        kinds = list(dict.fromkeys((r.case, r.length) for r in table.rows))
        names = list(dict.fromkeys(r.peer for r in table.rows))
        width = 0.8 / len(names)

        def value(case: tuple[str, int], peer: str, memory: bool) -> float:
            for r in table.rows:
                if (r.case, r.length) == case and r.peer == peer:
                    return float((r.memory or 0) / 2**20 if memory else (r.seconds or 0.0) * 1e3)
            return 0.0  # a peer that does not run this case (SDPA's causal kernel)

        for i, peer in enumerate(names):
            positions = [c + i * width for c in range(len(kinds))]
            axes[0].bar(positions, [value(c, peer, False) for c in kinds], width, label=peer)
            axes[1].bar(positions, [value(c, peer, True) for c in kinds], width, label=peer)
        labels = [f"{case}\n{length}" for case, length in kinds]
        for ax, label in zip(axes, ("time (ms)", "peak memory added (MiB)"), strict=True):
            ax.set_xticks([c + 0.4 - width / 2 for c in range(len(kinds))], labels, fontsize=7)
            ax.set_yscale("log")
            ax.set_ylabel(label)
            ax.grid(True, axis="y", which="both", alpha=0.3)
        axes[0].legend(fontsize=8)
    fig.suptitle(table.title, fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=110)
    finally:
        plt.close(fig)
    write_atomic(path, buffer.getvalue())
