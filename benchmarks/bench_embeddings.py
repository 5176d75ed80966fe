"""qkv.embeddings.load against gensim's KeyedVectors.load_word2vec_format, in one run.

The script writes a file of random word vectors (default 400,000 words × 300, the size of
GloVe 6B's vocabulary) in word2vec text (6 significant digits), word2vec binary and GloVe
(no header) formats, then loads each with both readers, each load in a fresh Python process,
and prints the time of the load alone (imports excluded), the peak memory of the process
(imports included) and the ratio qkv / gensim (below 1: qkv is faster). It also checks that
both readers return the same words and the same float32 numbers.

Cases:

- full: the whole file;
- limit: the first 50,000 vectors (``limit=`` in both);
- vocabulary: 1,000 words spread over the file; qkv streams with ``vocabulary=``, gensim has
  no such option, so it loads the whole file and the words are picked afterwards.

Timings on a shared machine are indicative: look at the ratios, not the seconds.

Usage:
    python benchmarks/bench_embeddings.py                        # 400,000 × 300
    python benchmarks/bench_embeddings.py --words 50000 --dim 100 --folder /tmp/vectors
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from qkv.embeddings import Embeddings, save

# Runs in a fresh process: import, then time the load alone; print a JSON line.
PROBE = """
import hashlib, json, resource, sys, time
import numpy as np
reader, path, fmt, option = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
if reader == "qkv":
    from qkv.embeddings import load
    start = time.perf_counter()
    e = load(path, fmt, **option)
    seconds = time.perf_counter() - start
    words, vectors = list(e.words), e.vectors
else:
    from gensim.models import KeyedVectors
    wanted = option.pop("vocabulary", None)
    start = time.perf_counter()
    kv = KeyedVectors.load_word2vec_format(
        path, binary=fmt == "word2vec-binary", no_header=fmt == "glove", **option
    )
    if wanted is not None:
        keep = set(wanted)
        rows = [i for i, w in enumerate(kv.index_to_key) if w in keep]
        words, vectors = [kv.index_to_key[i] for i in rows], kv.vectors[rows]
    else:
        words, vectors = kv.index_to_key, kv.vectors
    seconds = time.perf_counter() - start
digest = hashlib.sha256(np.ascontiguousarray(vectors, dtype=np.float32).tobytes())
digest.update("\\n".join(words).encode())
try:  # this process's own peak (ru_maxrss would include the parent's before exec)
    status = open("/proc/self/status").read()
    peak = int(status.split("VmHWM:")[1].split()[0]) / 1024
except (OSError, IndexError):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"seconds": seconds, "peak_mb": peak, "digest": digest.hexdigest()}))
"""


@dataclass
class Result:
    seconds: float
    peak_mb: float
    digest: str


def measure(reader: str, path: Path, fmt: str, option: dict[str, object]) -> Result:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, reader, str(path), fmt, json.dumps(option)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{reader} failed on {path}:\n{done.stderr}")
    return Result(**json.loads(done.stdout.strip().splitlines()[-1]))


def write_files(folder: Path, words: int, dim: int, console: Console) -> dict[str, Path]:
    paths = {
        "word2vec": folder / f"random-{words}x{dim}.txt",
        "word2vec-binary": folder / f"random-{words}x{dim}.bin",
        "glove": folder / f"random-{words}x{dim}.glove.txt",
    }
    if all(p.exists() for p in paths.values()):
        return paths
    rng = np.random.default_rng(0)
    vectors = (rng.standard_normal((words, dim)) * 0.4).astype(np.float32)
    e = Embeddings([f"word{i}" for i in range(words)], vectors)
    for fmt, path in paths.items():
        with console.status(f"writing {path.name}"):
            save(path, e, fmt, precision=6)
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--words", type=int, default=400_000)
    parser.add_argument("--dim", type=int, default=300)
    parser.add_argument("--folder", type=Path, help="keep the generated files here")
    args = parser.parse_args()
    console = Console(width=80)
    folder = args.folder or Path(tempfile.mkdtemp(prefix="qkv-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        paths = write_files(folder, args.words, args.dim, console)
        step = max(1, args.words // 1000)
        wanted = [f"word{i}" for i in range(0, args.words, step)][:1000]
        cases: list[tuple[str, str, dict[str, object]]] = [
            ("text, full", "word2vec", {}),
            ("binary, full", "word2vec-binary", {}),
            ("GloVe, full", "glove", {}),
            ("text, limit 50k", "word2vec", {"limit": 50_000}),
            ("binary, limit 50k", "word2vec-binary", {"limit": 50_000}),
            ("text, 1k words", "word2vec", {"vocabulary": wanted}),
            ("binary, 1k words", "word2vec-binary", {"vocabulary": wanted}),
        ]
        size = {fmt: paths[fmt].stat().st_size / 2**20 for fmt in paths}
        console.print(
            f"{args.words:,} words × {args.dim}: text {size['word2vec']:,.0f} MiB, "
            f"binary {size['word2vec-binary']:,.0f} MiB"
        )
        table = Table(title="load time (s) and peak memory (MiB); ratio = qkv / gensim")
        for column in ("case", "qkv s", "gensim s", "ratio", "qkv MiB", "gensim MiB", "same"):
            table.add_column(column, justify="left" if column == "case" else "right")
        for name, fmt, option in cases:
            with console.status(name):
                ours = measure("qkv", paths[fmt], fmt, option)
                theirs = measure("gensim", paths[fmt], fmt, option)
            table.add_row(
                name,
                f"{ours.seconds:.2f}",
                f"{theirs.seconds:.2f}",
                f"{ours.seconds / theirs.seconds:.2f}",
                f"{ours.peak_mb:,.0f}",
                f"{theirs.peak_mb:,.0f}",
                "yes" if ours.digest == theirs.digest else "NO",
            )
        console.print(table)
    finally:
        if args.folder is None:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
