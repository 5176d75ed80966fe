"""``python -m qkv.data DIR``: write the generated data sets and word-vector files to a folder."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from qkv.data._sentiment import sentiment
from qkv.data._vectors import write_embedding_files

EXAMPLES = """\
Examples:
  python -m qkv.data data/
      writes data/sentiment.csv, data/sentiment.jsonl and the word vectors
  python -m qkv.data data/ --sentences 4000 --seed 1
      a larger set, drawn with another seed
  python -m qkv.data --vectors-only src/qkv/data/files
      regenerates the word-vector files shipped with qkv
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m qkv.data",
        description="Write the sentiment set (CSV and JSON Lines, columns text, label,\n"
        "pair, rule) and word vectors built from its corpus (word2vec text and\n"
        "binary, GloVe, fastText .vec) into a folder. The same seed gives the same\n"
        "files.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("folder", type=Path, help="where to write (created if missing)")
    parser.add_argument("--sentences", type=int, default=2000, help="sentences (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--vectors-only", action="store_true", help="write only the word-vector files"
    )
    args = parser.parse_args(argv)
    try:
        args.folder.mkdir(parents=True, exist_ok=True)
        written = list(write_embedding_files(args.folder, seed=args.seed).values())
        if not args.vectors_only:
            texts = sentiment(args.sentences, seed=args.seed)
            written += [
                texts.to_csv(args.folder / "sentiment.csv"),
                texts.to_jsonl(args.folder / "sentiment.jsonl"),
            ]
    except (OSError, ValueError) as error:
        print(f"python -m qkv.data: error: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
