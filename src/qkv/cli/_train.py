"""``qkv train recall`` and ``qkv train classify``: train attention, watch it learn.

Also :func:`model_trace`, the part of ``qkv explain --model RUN --text "..."`` that loads a
trained model and records its attention on the text.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkv._format import visible
from qkv._train_settings import (
    CLASSIFY_TRAINING,
    RECALL_TRAINING,
    ClassifySettings,
    RecallSettings,
    TrainSettings,
)
from qkv.cli._common import (
    MAX_THREADS,
    Command,
    CommandError,
    Option,
    add_options,
    examples_block,
    int_in_range,
    refuse_options,
)

GENERATED = "generated"  # qkv.train._text.GENERATED, without importing torch for --help
MAX_SEED = 2**64 - 1  # what torch.manual_seed takes


def fraction(low: float, high: float, *, open_low: bool = True) -> Callable[[str], float]:
    """An argparse ``type``: a number in (low, high] (or [low, high])."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        too_low = value <= low if open_low else value < low
        if too_low or value > high or value != value:
            side = "(" if open_low else "["
            raise argparse.ArgumentTypeError(
                f"expected a number in {side}{low}, {high}], got {text}"
            )
        return value

    parse.__name__ = "number"
    return parse


def shown(value: object) -> str:
    """A default as the help shows it: ``3e-3``, ``0.01``, ``64``, ``text``."""
    if isinstance(value, float) and value and abs(value) < 0.01:
        mantissa, exponent = f"{value:e}".split("e")
        return f"{float(mantissa):g}e{int(exponent)}"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _common(
    parser: argparse.ArgumentParser,
    task: str,
    defaults: RecallSettings | ClassifySettings,
    train: TrainSettings,
) -> None:
    """The options of the run and of the training, with the task's defaults."""
    run = parser.add_argument_group("the run")
    run.add_argument(
        "--out",
        "-o",
        metavar="DIR",
        help=f"where the run writes its metrics, plot and checkpoints (default: "
        f"runs/{task}-DATE-TIME; needed with --resume)",
    )
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its last checkpoint, exactly as it would have "
        "gone on (its model, data and seed are kept)",
    )
    seed = f"random seed, from 0 to 2**64 - 1 (default {defaults.seed})"
    threads = "CPU threads for PyTorch (default: PyTorch's; results repeat for the same N)"
    add_options(
        run,
        [
            ("--seed", int_in_range(0, MAX_SEED), "N", seed),
            ("--threads", int_in_range(1, MAX_THREADS), "N", threads),
        ],
    )
    run.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    training = parser.add_argument_group(
        f"training (default: {train.steps} steps, eval every {train.eval_every})"
    )
    decay = f"AdamW's weight decay on the linear layers' weights ({shown(train.weight_decay)})"
    patience = (
        "stop after N evaluations without a better validation accuracy "
        f"({train.patience or 0}; 0: never)"
    )
    add_options(
        training,
        [
            ("--steps", int_in_range(1), "N", "optimizer steps"),
            ("--lr", fraction(0.0, 10.0), "LR", f"AdamW's learning rate ({shown(train.lr)})"),
            ("--weight-decay", fraction(0.0, 10.0, open_low=False), "WD", decay),
            ("--warmup", int_in_range(0), "N", f"steps of learning-rate warm-up ({train.warmup})"),
            ("--batch-size", int_in_range(1), "B", f"batch size ({defaults.batch_size})"),
            (
                "--eval-every",
                int_in_range(1),
                "N",
                "evaluate on the validation set and save a checkpoint every N steps",
            ),
            ("--patience", int_in_range(0), "N", patience),
            (
                "--target-accuracy",
                fraction(0.0, 1.0),
                "A",
                "stop as soon as the validation accuracy reaches A, e.g. 0.99",
            ),
        ],
    )


def _configure_recall(parser: argparse.ArgumentParser) -> None:
    d = RecallSettings()
    keys = f"key tokens ({d.keys}: a..{chr(ord('a') + d.keys - 1)})"
    held_out = f"held-out sequences to measure accuracy on ({d.validation_size})"
    add_options(
        parser.add_argument_group("the sequences"),
        [
            ("--pairs", int_in_range(1), "P", f"key-value pairs ({d.pairs})"),
            ("--keys", int_in_range(1), "K", keys),
            ("--values", int_in_range(2), "V", f"value tokens ({d.values}: 0..{d.values - 1})"),
            ("--validation-size", int_in_range(1), "N", held_out),
        ],
    )
    model = parser.add_argument_group("the model")
    add_options(
        model,
        [
            ("--d-model", int_in_range(2), "E", f"model width ({d.d_model})"),
            ("--heads", int_in_range(1), "H", f"attention heads ({d.num_heads})"),
            ("--layers", int_in_range(1), "N", f"transformer blocks ({d.layers})"),
        ],
    )
    model.add_argument(
        "--no-next-token",
        action="store_const",
        const=False,
        dest="next_token",
        help="leave out the next-token embedding: attention alone must carry each value to "
        "its key (use --layers 2; it sits on a long plateau: see docs/training.md)",
    )
    add_options(model, [_dropout(d.dropout)])
    _common(parser, "recall", d, RECALL_TRAINING)


def _dropout(default: float) -> Option:
    return ("--dropout", fraction(0.0, 0.99, open_low=False), "P", f"dropout ({shown(default)})")


def _configure_classify(parser: argparse.ArgumentParser) -> None:
    d = ClassifySettings()
    data = parser.add_argument_group("the data")
    data.add_argument(
        "--data",
        "-d",
        metavar="FILE",
        help="a .csv, .tsv or .jsonl file of labelled texts, or 'generated': the sentiment "
        "set qkv makes, whose labels depend on word order (the default)",
    )
    groups = "rows with the same value here stay on one side of the validation split"
    held_out = f"the share of rows held out for validation ({shown(d.validation)})"
    add_options(
        data,
        [
            ("--text-column", None, "C", f"the column of the texts ({d.text_column})"),
            ("--label-column", None, "C", f"the column of the labels ({d.label_column})"),
            ("--group-column", None, "C", groups),
            (
                "--sentences",
                int_in_range(2),
                "N",
                f"with --data generated: how many sentences ({d.sentences})",
            ),
            ("--validation", fraction(0.0, 0.99), "F", held_out),
            ("--max-length", int_in_range(1), "N", f"tokens kept per text ({d.max_length})"),
        ],
    )
    data.add_argument(
        "--keep-case",
        action="store_const",
        const=False,
        dest="lowercase",
        help="do not lower-case the texts (for word vectors with capitals)",
    )
    rare = f"words seen fewer times in training become <unk> ({d.min_count})"
    add_options(data, [("--min-count", int_in_range(1), "N", rare)])
    model = parser.add_argument_group("the model")
    model.add_argument(
        "--model",
        choices=("attention", "bag-of-words"),
        help="attention (self-attention + attention pooling) or bag-of-words (the mean of "
        f"the embeddings: the baseline that ignores order); default: {d.model}",
    )
    model.add_argument(
        "--embeddings",
        "-e",
        metavar="FILE",
        help="start the embeddings from word vectors (word2vec text or binary, GloVe, "
        "fastText .vec); words without a vector start random",
    )
    frozen = model.add_mutually_exclusive_group()
    frozen.add_argument(
        "--freeze-embeddings",
        action="store_const",
        const=True,
        dest="freeze",
        help="keep the word vectors fixed (the default with --embeddings)",
    )
    frozen.add_argument(
        "--fine-tune-embeddings",
        action="store_const",
        const=False,
        dest="freeze",
        help="train the word vectors too; a report says how far each moved",
    )
    width = f"embedding width without --embeddings ({d.embedding_dim})"
    add_options(
        model,
        [
            ("--embedding-dim", int_in_range(2), "E", width),
            ("--heads", int_in_range(1), "H", f"attention heads ({d.num_heads})"),
            _dropout(d.dropout),
        ],
    )
    _common(parser, "classify", d, CLASSIFY_TRAINING)


_RECALL_EXAMPLES = (
    ("qkv train recall", "8 pairs, one attention layer: ~100 steps to 99%"),
    ("qkv train recall --target-accuracy 0.99 --out runs/recall", "stop at 99% accuracy"),
    ("qkv train recall --out runs/recall --resume --steps 4000", "continue a run"),
    ("qkv explain --model runs/recall --text 'a 3 c 5 b 1 c'", "the query attends to its key"),
)
_CLASSIFY_EXAMPLES = (
    ("qkv train classify", "the generated sentiment set, attention model"),
    ("qkv train classify --model bag-of-words", "the baseline that ignores word order"),
    (
        "qkv train classify --data reviews.csv --text-column review --label-column y",
        "your own data",
    ),
    (
        "qkv train classify --embeddings vectors.vec --fine-tune-embeddings",
        "start from word vectors and train them",
    ),
    (
        "qkv explain --model runs/classify --text 'the food was great , not awful'",
        "the trained attention on a new sentence",
    ),
)


def _configure(parser: argparse.ArgumentParser) -> None:
    tasks = parser.add_subparsers(dest="train_task", metavar="TASK", title="tasks")
    for name, summary, description, examples, configure in (
        (
            "recall",
            "associative recall: 'a 3 c 5 b 1 c' → 5",
            "Train a small qkv transformer on associative recall: key-value pairs, then a\n"
            "query key; the answer is the value that followed that key. Fresh random\n"
            "sequences every step; accuracy on held-out sequences.",
            _RECALL_EXAMPLES,
            _configure_recall,
        ),
        (
            "classify",
            "text classification with self-attention and attention pooling",
            "Train a text classifier: word embeddings (learned, or pretrained word vectors\n"
            "frozen or fine-tuned), a qkv self-attention block, attention pooling over the\n"
            "words and a linear layer. Without --data, the sentiment set qkv generates:\n"
            "every sentence has a twin with the same words and the opposite label, so a\n"
            "bag of words cannot beat 50%.",
            _CLASSIFY_EXAMPLES,
            _configure_classify,
        ),
    ):
        sub = tasks.add_parser(
            name,
            help=summary,
            description=description,
            epilog=examples_block(examples) + "\n\nSee docs/training.md.",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        configure(sub)
    parser.set_defaults(train_parser=parser)


def _run(args: argparse.Namespace) -> int:
    if args.train_task is None:
        args.train_parser.print_help()
        return 0
    from qkv._extras import MissingExtraError, require

    try:
        torch = require("torch", feature="qkv train")
        from qkv import train
        from qkv.train._size import SizeError
    except MissingExtraError as error:
        raise CommandError(str(error)) from None
    if args.resume and args.out is None:
        raise CommandError(
            "--resume needs --out DIR: the folder of the run to continue. Hint: "
            f"qkv train {args.train_task} --out runs/{args.train_task}-... --resume"
        )
    out = Path(args.out or f"runs/{args.train_task}-{time.strftime('%Y%m%d-%H%M%S')}")
    if out.exists() and not out.is_dir():
        raise CommandError(f"--out {str(out)!r} is a file; give a folder")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    options = ("steps", "lr", "weight_decay", "warmup", "eval_every", "target_accuracy")
    training = {k: getattr(args, k) for k in options if getattr(args, k) is not None}
    if args.patience is not None:
        training["patience"] = args.patience or None  # 0: never stop early
    common: dict[str, Any] = {
        "training": training,
        "resume": args.resume,
        "progress": not args.quiet,
        "seed": args.seed,
        "batch_size": args.batch_size,
        "dropout": args.dropout,
        "num_heads": args.heads,
    }
    try:
        if args.train_task == "recall":
            recall = ("pairs", "keys", "values", "validation_size", "d_model", "layers")
            given = {name: getattr(args, name) for name in (*recall, "next_token")}
            result = train.train_recall(out, **given, **common)
            _summary(result, out, "", "a 3 c 5 b 1 d 7 c")
        else:
            data = args.data  # None: the generated set (or, resuming, the run's data)
            columns = ("text_column", "label_column", "group_column", "model", "embeddings")
            data_options = ("validation", "max_length", "lowercase", "min_count", "sentences")
            classify = (*columns, "freeze", "embedding_dim", *data_options)
            given = {name: getattr(args, name) for name in classify}
            outcome = train.train_classifier(out, data, **given, **common)
            data_option = f" --data {data if data is not None else outcome.source}"
            _summary(outcome.fit, out, data_option, "the food was great , not awful")
            if outcome.drift is not None:
                from qkv.train._drift import format_drift
                from qkv.train._runs import DRIFT

                print(format_drift(outcome.drift, frozen=outcome.frozen))
                print(f"(every word: {out / DRIFT})")
    except SizeError as error:
        option = "--" + error.field.replace("_", "-")
        raise CommandError(error.message(f"{option} {error.value}", option)) from None
    except (MemoryError, RuntimeError) as error:  # a backstop: the estimate is rough
        if not isinstance(error, MemoryError) and "can't allocate memory" not in str(error):
            raise
        raise CommandError(
            "the run ran out of memory. Hint: a smaller --d-model, --embedding-dim, "
            "--batch-size or --layers"
        ) from None
    except KeyboardInterrupt:
        print(
            f"qkv: interrupted; continue with: qkv train {args.train_task} --out {out} --resume",
            file=sys.stderr,
        )
        raise
    except MissingExtraError as error:
        raise CommandError(str(error)) from None
    except train.DataError as error:  # the data file's own error, in the words of the option
        raise CommandError(f"--data {error}") from None
    return 0


def _summary(result: Any, out: Path, evaluate: str, text: str) -> None:
    reasons = {
        "steps": "the last step",
        "patience": "early stopping: no better validation accuracy",
        "target": "the target accuracy was reached",
    }
    best = "-" if result.best_accuracy is None else f"{result.best_accuracy:.2%}"
    print(f"Best validation accuracy: {best} at step {result.best_step}.")
    print(
        f"Stopped at step {result.step} ({reasons.get(result.stopped, result.stopped)}) "
        f"after {result.seconds:.1f} s."
    )
    skipped = getattr(result, "plot_skipped", None)
    if skipped is None:
        print(f"Wrote {out}/: metrics.jsonl, metrics.png, checkpoints/, best/.")
    else:
        print(f"Wrote {out}/: metrics.jsonl, checkpoints/, best/.")
        print(f"Skipped metrics.png: {skipped}.")
    print("Next:")
    print(f"  qkv evaluate {out}{evaluate}")
    print(f"  qkv explain --model {out} --text '{text}'")


def model_trace(args: argparse.Namespace) -> Any:
    """The trace of ``qkv explain --model RUN --text TEXT`` (with ``--layer``, ``--query``).

    Returns a :class:`qkv.Trace` labelled with the text's tokens.
    """
    if args.model is None or args.text is None:
        missing = [name for name, v in (("--model", args.model), ("--text", args.text)) if not v]
        raise CommandError(
            f"explaining a trained model needs --model RUN and --text TEXT; "
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing. Hint: "
            "qkv explain --model runs/classify --text 'the food was great , not awful'"
        )
    refuse_options(
        {
            "--example": args.example,
            "--trace": args.trace,
            "--no-scale": args.no_scale,
            "--causal": args.causal,
            "--heads": args.heads,
        },
        alongside="--model",
        reason="the trained model's attention is shown as it computes it. Hint: leave it out",
    )
    from qkv._extras import MissingExtraError

    try:
        from qkv.train import explain_text, load_trained
    except MissingExtraError as error:
        raise CommandError(str(error)) from None
    trained = load_trained(args.model)
    query = args.query
    queries = None
    if query is not None:
        queries = (
            int(query) if re.fullmatch(r"-?[0-9]+", query) else _position(trained, args.text, query)
        )
    try:
        trace, prediction = explain_text(
            trained, args.text, layer=args.layer, queries=queries, steps=args.steps
        )
    except ValueError as error:
        text = str(error)
        if queries is not None and text.startswith("tracing queries="):
            raise CommandError(f"--query {query}: {text.split(': ', 1)[-1]}") from None
        raise
    if args.plot is not None or args.html is not None or args.output is not None:
        share = prediction.probabilities[prediction.label]
        label = visible(prediction.label)  # a class name from the checkpoint
        print(f"qkv: the model predicts {label} ({share:.1%})", file=sys.stderr)
    return trace


def _position(trained: Any, text: str, token: str) -> int:
    from qkv.train._text import tokenize

    if trained.task == "recall":
        words = text.split()
    else:
        words = tokenize(text, lowercase=trained.config["data"]["lowercase"])
        token = token.lower() if trained.config["data"]["lowercase"] else token
    if token not in words:
        raise CommandError(
            f"--query {token!r} is not a token of --text (its tokens: {' '.join(words)}). "
            "Hint: give a token or its 0-based position"
        )
    return words.index(token)


COMMAND = Command(
    name="train",
    summary="train attention: associative recall, or text classification",
    description=(
        "Train the projections W_q, W_k, W_v (and the rest of a small model) on a task,\n"
        "with AdamW, a progress bar, evaluation on held-out data, early stopping and\n"
        "checkpoints (safetensors + JSON). A run writes metrics.jsonl, metrics.png,\n"
        "checkpoints/ and best/ into --out; Ctrl-C saves a checkpoint, --resume\n"
        "continues exactly. See docs/training.md."
    ),
    examples=(
        ("qkv train recall", "associative recall, the task only attention solves"),
        ("qkv train classify", "sentiment where word order decides (generated data)"),
        ("qkv train classify --data reviews.csv --embeddings glove.txt", "your data and vectors"),
        ("qkv evaluate runs/recall-...", "accuracy on new held-out data"),
        ("qkv explain --model runs/classify-... --text 'not bad at all'", "the attention"),
    ),
    configure=_configure,
    run=_run,
)
