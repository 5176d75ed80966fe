"""``qkv evaluate RUN --data FILE``: accuracy, loss and per-class counts of a trained model."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from qkv._format import visible
from qkv.cli._common import Command, CommandError, int_in_range, write_atomic

GENERATED = "generated"


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint",
        metavar="RUN",
        help="a 'qkv train' --out folder (its best checkpoint), a checkpoints/ folder or one "
        "step-* folder",
    )
    parser.add_argument(
        "--data",
        "-d",
        metavar="FILE",
        help="labelled texts (.csv, .tsv, .jsonl) in the columns the model was trained with, "
        "or 'generated': for a classifier trained on the generated sentiment set, its "
        "held-out validation sentences; for a recall model, new held-out sequences (the "
        "default)",
    )
    parser.add_argument("--text-column", metavar="C", help="the column of the texts")
    parser.add_argument("--label-column", metavar="C", help="the column of the labels")
    parser.add_argument(
        "--sentences",
        type=int_in_range(2),
        default=2000,
        metavar="N",
        help="with --data generated, a classifier not trained on it: sentences (2000)",
    )
    parser.add_argument(
        "--samples",
        type=int_in_range(1),
        default=2000,
        metavar="N",
        help="a recall model: new held-out sequences to draw (2000)",
    )
    parser.add_argument(
        "--seed",
        type=int_in_range(0),
        default=0,
        metavar="N",
        help="a recall model: the seed of the sequences (0)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the result as JSON (for programs)"
    )
    parser.add_argument(
        "--output", "-o", metavar="FILE", help="write the result to FILE (atomically)"
    )


def _run(args: argparse.Namespace) -> int:
    from qkv._extras import MissingExtraError

    try:
        from qkv import train
        from qkv.train._text import generated_texts
    except MissingExtraError as error:
        raise CommandError(str(error)) from None
    trained = train.load_trained(args.checkpoint)
    data_config = trained.config["data"]
    data = None
    source = "new held-out sequences"
    if trained.task == "classify" and args.data is None:
        raise CommandError(
            "evaluating a classifier needs --data FILE (labelled texts). Hint: --data "
            "generated evaluates on the sentiment set qkv makes"
        )
    if args.data is not None and args.data != GENERATED:
        try:
            data = train.read_labelled(
                args.data,
                text_column=args.text_column or data_config.get("text_column", "text"),
                label_column=args.label_column or data_config.get("label_column", "label"),
            )
        except OSError as error:
            raise CommandError(
                f"--data {args.data!r}: cannot read it ({error.strerror or error}). Hint: give "
                "a .csv, .tsv or .jsonl file"
            ) from None
        source = f"{args.data} ({len(data)} rows)"
    elif args.data == GENERATED and trained.task == "classify":
        data, source = _generated(trained, args.sentences, generated_texts)
    result = train.evaluate_trained(trained, data, samples=args.samples, seed=args.seed)
    report = {
        "checkpoint": str(trained.path),
        "step": trained.step,
        "task": trained.task,
        "model": trained.config["model"]["kind"],
        "data": source,
        "examples": result.count,
        "accuracy": result.accuracy,
        "loss": result.loss,
        "per_class": result.per_class(),
        "confusion": result.confusion.tolist(),
        "labels": list(result.labels),
    }
    # the labels come from the checkpoint, the data's name from the command line: escaped
    text = (
        json.dumps(report, indent=1) + "\n" if args.json else visible(_text(report), newlines=True)
    )
    if args.output is not None:
        write_atomic(args.output, text)
        print(f"qkv: wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _generated(trained: Any, sentences: int, make: Any) -> tuple[Any, str]:
    """The generated set: the run's own validation rows (held out) when it trained on it."""
    from qkv.train import LabelledTexts
    from qkv.train._text import split_rows

    config = trained.config["data"]
    if config.get("source") != GENERATED:
        data = make(sentences)
        return data, f"the generated sentiment set ({len(data)} sentences)"
    whole = make(config["sentences"])
    _, rows = split_rows(
        len(whole), config["validation"], seed=trained.config["seed"], groups=whole.groups
    )
    data = LabelledTexts(
        texts=tuple(whole.texts[i] for i in rows),
        labels=tuple(whole.labels[i] for i in rows),
        lines=tuple(whole.lines[i] for i in rows),
        source=whole.source,
    )
    return data, f"the run's held-out validation sentences ({len(rows)}, generated)"


def _text(report: dict[str, Any]) -> str:
    correct = sum(row["correct"] for row in report["per_class"])
    lines = [
        f"Checkpoint {report['checkpoint']} (step {report['step']}): {report['task']}, "
        f"{report['model']} model",
        f"Data: {report['data']}",
        f"Accuracy {report['accuracy']:.4f} ({correct} of {report['examples']}), "
        f"loss {report['loss']:.4f}",
        "",
    ]
    width = max(5, *(len(row["label"]) for row in report["per_class"]))
    lines.append(f"{'label':<{width}}  {'examples':>8}  {'correct':>7}  {'predicted':>9}  accuracy")
    for row in report["per_class"]:
        accuracy = "-" if row["accuracy"] is None else f"{row['accuracy']:.4f}"
        lines.append(
            f"{row['label']:<{width}}  {row['examples']:>8}  {row['correct']:>7}  "
            f"{row['predicted']:>9}  {accuracy:>8}"
        )
    return "\n".join(lines) + "\n"


COMMAND = Command(
    name="evaluate",
    summary="accuracy, loss and per-class counts of a trained model",
    description=(
        "Evaluate a trained model on labelled data: accuracy, mean cross-entropy loss,\n"
        "and for each class how many examples it has, how many were right and how often\n"
        "it was predicted. A label the model was not trained on is an error that names\n"
        "its line."
    ),
    examples=(
        ("qkv evaluate runs/recall-...", "a recall model on 2000 new held-out sequences"),
        ("qkv evaluate runs/classify-... --data test.csv", "a classifier on your test set"),
        ("qkv evaluate runs/classify-... --data generated", "on the generated sentiment set"),
        ("qkv evaluate runs/classify-... --data test.csv --json", "for programs"),
    ),
    configure=_configure,
    run=_run,
)
