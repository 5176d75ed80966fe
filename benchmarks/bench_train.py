"""Training benchmark, in one run: associative recall, then classification against a baseline.

1. **Recall**: ``qkv.train.train_recall`` (8 key–value pairs, keys a..z, values 0..9, one
   qkv transformer block, E = 64, AdamW at 3e-3, batches of 64 fresh sequences) until the
   accuracy on 2000 held-out validation sequences reaches 99.8%, then the accuracy on 10,000
   new test sequences. The goal: ≥ 99% within 2 minutes on 2 CPU cores.
2. **Classification** on the generated sentiment set (2000 sentences, every one with a twin
   of the same words and the opposite label, so a bag of words cannot beat 50%): the
   attention classifier and the bag-of-words baseline, trained the same way (same data,
   split, seed, optimizer, steps, early stopping), with learned embeddings and with the
   shipped word vectors frozen or fine-tuned.

Both use a fixed seed; the times are wall-clock on this machine (indicative only on a shared
one: the steps are the reproducible figure).

Usage:
    python benchmarks/bench_train.py                 # 1 PyTorch thread
    python benchmarks/bench_train.py --threads 2 --seed 3
    python benchmarks/bench_train.py --quick         # tiny settings (the test suite)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from qkv import data
from qkv.train import evaluate_trained, load_trained, train_classifier, train_recall

RECALL_BUDGET = 120.0  # seconds
RECALL_TARGET = 0.99
STOP_AT = 0.998  # validation accuracy that ends the recall run (held-out test: >= 0.99)


@dataclass
class Recall:
    steps: int
    seconds: float
    val_accuracy: float
    test_accuracy: float
    test_examples: int


def recall(folder: Path, *, seed: int, quick: bool) -> Recall:
    """Train recall to 99% on validation; measure on new held-out sequences."""
    start = time.perf_counter()
    result = train_recall(
        folder / "recall",
        pairs=8,
        d_model=16 if quick else 64,
        num_heads=2 if quick else 4,
        validation_size=64 if quick else 2000,
        seed=seed,
        training={"steps": 4 if quick else 3000, "eval_every": 2 if quick else 25,
                  "patience": None, "target_accuracy": STOP_AT},
        progress=False,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    test = evaluate_trained(load_trained(folder / "recall"), samples=200 if quick else 10_000)
    return Recall(result.step, seconds, result.best_accuracy or 0.0, test.accuracy, test.count)


def classification(folder: Path, *, seed: int, quick: bool) -> list[dict[str, object]]:
    """Attention and bag of words on the generated set, trained the same way."""
    vectors = data.embedding_file("word2vec")
    runs = [
        ("bag-of-words", "learned", {}),
        ("attention", "learned", {}),
        ("bag-of-words", "frozen vectors", {"embeddings": vectors, "freeze": True}),
        ("attention", "frozen vectors", {"embeddings": vectors, "freeze": True}),
        ("attention", "fine-tuned vectors", {"embeddings": vectors, "freeze": False}),
    ]
    training = {"steps": 6 if quick else 1500, "eval_every": 3 if quick else 50, "patience": 5}
    rows = []
    for number, (model, embeddings, extra) in enumerate(runs):
        start = time.perf_counter()
        result = train_classifier(
            folder / f"classify-{number}",
            "generated",
            sentences=200 if quick else 2000,
            model=model,
            embedding_dim=16,
            seed=seed,
            training=training,
            progress=False,
            **extra,  # type: ignore[arg-type]
        )
        rows.append(
            {
                "model": model,
                "embeddings": embeddings,
                "val_accuracy": result.fit.best_accuracy or 0.0,
                "best_step": result.fit.best_step,
                "to_99": next(
                    (r["step"] for r in result.fit.rows if r["val_accuracy"] >= 0.99), None
                ),
                "steps": result.fit.step,
                "seconds": time.perf_counter() - start,
                "moved": None if result.drift is None else result.drift["mean_l2"],
            }
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="PyTorch CPU threads (1)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (0)")
    parser.add_argument("--quick", action="store_true", help="tiny settings (for tests)")
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temp folder)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as temporary:
        folder = args.out or Path(temporary)
        print(f"qkv training benchmark: torch {torch.__version__}, {args.threads} thread(s), "
              f"seed {args.seed}", flush=True)  # fmt: skip
        got = recall(folder, seed=args.seed, quick=args.quick)
        ok = got.test_accuracy >= RECALL_TARGET and got.seconds <= RECALL_BUDGET
        print("\n### Associative recall (8 pairs, 1 block, E = 64)\n")
        print("| steps | time (s) | val accuracy | test accuracy (new sequences) | goal |")
        print("|---:|---:|---:|---:|---|")
        print(
            f"| {got.steps} | {got.seconds:.1f} | {got.val_accuracy:.4f} "
            f"| {got.test_accuracy:.4f} ({got.test_examples}) | "
            f"{'met' if ok else 'NOT met'}: ≥ {RECALL_TARGET:.0%} within {RECALL_BUDGET:.0f} s |",
            flush=True,
        )
        rows = classification(folder, seed=args.seed, quick=args.quick)
        print("\n### Generated sentiment set (twins: a bag of words is capped at 50%)\n")
        print(
            "| model | embeddings | val accuracy | step reaching 99% | best step | steps "
            "| time (s) | moved |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for row in rows:
            moved = "-" if row["moved"] is None else f"{row['moved']:.4f}"
            print(
                f"| {row['model']} | {row['embeddings']} | {row['val_accuracy']:.4f} | "
                f"{row['to_99'] or 'never'} | {row['best_step']} | {row['steps']} | "
                f"{row['seconds']:.1f} | {moved} |"
            )
        best = {
            model: max(float(r["val_accuracy"]) for r in rows if r["model"] == model)  # type: ignore[arg-type]
            for model in ("attention", "bag-of-words")
        }
        beats = best["attention"] > best["bag-of-words"]
        print(
            f"\nattention {best['attention']:.4f} vs bag of words {best['bag-of-words']:.4f}: "
            f"{'attention wins' if beats else 'attention does NOT win'}"
        )
        print("('moved': the mean L2 distance of the word vectors from the file's, at the end)")
    return 0 if args.quick or (ok and beats) else 1


if __name__ == "__main__":
    sys.exit(main())
