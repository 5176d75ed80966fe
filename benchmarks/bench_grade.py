"""``qkv grade`` on a class of N function submissions: the wall time and the time per submission.

Each submission runs in its own sandboxed Python process (docs/isolation.md): a child that
imports NumPy (and torch), loads the student's file and answers qkv's calls on the probes. So
the cost is one process start per submission, ``--jobs`` of them at once. The class is a mix
of right functions and the common slips (unscaled, mask ignored, softmax over the wrong axis).

On a machine shared with other work the wall time measures the others too: the load
average is printed beside it.

Usage:
    python benchmarks/bench_grade.py                      # 200 submissions, 2 jobs
    python benchmarks/bench_grade.py --students 60 --jobs 4 --isolation namespaces
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from qkv.grade import Settings, grade_class

_SLIPS = {  # slip: (a line added after the scores, the softmax's axis)
    "right": ("", -1),
    "unscaled": ("    s = Q @ K.T\n", -1),
    "mask-ignored": ("    mask = None\n", -1),
    "softmax-wrong-axis": ("", 0),
}

_TEMPLATE = """import numpy as np
def attention(Q, K, V, mask=None):
    s = Q @ K.T / np.sqrt(Q.shape[-1])
{line}    if mask is not None:
        s = np.where(mask, s, -1e9)
    w = np.exp(s - s.max(axis={axis}, keepdims=True))
    return (w / w.sum(axis={axis}, keepdims=True)) @ V
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--students", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--isolation", default="auto")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp, "class")
        folder.mkdir()
        names = list(_SLIPS)
        for i in range(args.students):
            line, axis = _SLIPS[names[i % len(names)]]
            (folder / f"student_{i:03d}.py").write_text(_TEMPLATE.format(line=line, axis=axis))
        start = time.perf_counter()
        grades = grade_class(folder, Settings(isolation=args.isolation), jobs=args.jobs)
        wall = time.perf_counter() - start
    statuses = {s: sum(g.status == s for g in grades) for s in ("ok", "slip", "error", "timeout")}
    load = os.getloadavg()[0]
    print(f"{len(grades)} submissions, {args.jobs} jobs, isolation {args.isolation}: {statuses}")
    print(f"wall {wall:.1f} s, {wall / len(grades) * 1000:.0f} ms per submission")
    print(f"per submission and job: {wall * args.jobs / len(grades) * 1000:.0f} ms")

    print(f"load average (1 min) at the end: {load:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
