"""``qkv grade``: grade a class's attention functions or worked examples (docs/grading.md).

Exit status: 0 when every submission has a grade (whatever the grades), 2 for a teacher's
mistake (a missing folder, a bad rubric, a zip that cannot be unpacked safely), with one line.
A student's broken submission is a graded row (``error`` or ``timeout``), never a stop.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from qkv._format import visible
from qkv.cli._check import _ALIGNMENTS, _ARRAYS, _ISOLATIONS, _MASK_MEANINGS, _seconds
from qkv.cli._common import Command, CommandError, int_in_range

# qkv.grade.KINDS, for a fast --help
_KINDS = ("attention", "causal", "multi-head", "gqa", "module", "flash", "example")
_FORMATS = ("files", "gradescope", "prairielearn")


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "submissions",
        nargs="?",
        metavar="SUBMISSIONS",
        help="a folder with one entry per student (a .py file, a folder, or a .yaml worked "
        "example), or the zip your course platform exported; RUNS the students' code, "
        "sandboxed",
    )
    parser.add_argument(
        "--output",
        "-o",
        metavar="OUT",
        help="the folder to write the grades into (made if missing; it must be empty, or "
        "hold an earlier run's grades with --overwrite)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the grades an earlier run wrote into OUT; its files this run does not "
        "write again (a student no longer in the class) are removed",
    )
    parser.add_argument(
        "--kind",
        choices=_KINDS,
        default="attention",
        help="what each submission holds: attention: FUNCTION(Q, K, V[, mask]); causal: the "
        "same, causal; "
        "multi-head: FUNCTION(X, W_q, W_k, W_v, W_o, num_heads); gqa: the same with "
        "num_kv_heads; module: an attention class (--class); flash: a FlashAttention "
        "FUNCTION(Q, K, V, is_causal) or torch.autograd.Function; example: a worked example "
        "(.yaml files are worked examples with any kind) (default: attention)",
    )
    parser.add_argument(
        "--contract",
        choices=("full", "cs336"),
        default="full",
        help="with --kind flash: what the assignment promises; cs336 = CS336's part (a): "
        "is_causal may be ignored, power-of-2 lengths (default: full, every probe)",
    )
    parser.add_argument(
        "--function",
        metavar="NAME",
        default="attention",
        help="the function each .py file defines (default: attention)",
    )
    parser.add_argument(
        "--class",
        dest="class_name",
        metavar="NAME",
        help="with --kind module: the class each .py file defines, as 'qkv check --module' "
        "drives it (default: MultiHeadAttention); with --kind attention: a single-head "
        "class without an output projection, graded instead of --function",
    )
    parser.add_argument(
        "--file",
        metavar="NAME.py",
        help="in a student's folder, the file with the function (default: its only .py "
        "file, or the one that defines --function or --class; the others are its helpers)",
    )
    parser.add_argument(
        "--inputs",
        metavar="FILE.yaml",
        help="a worked example without claims: the inputs "
        "everyone had to use; each submission then only claims numbers",
    )
    parser.add_argument(
        "--rubric",
        metavar="FILE.yaml",
        help="points per part and per slip code (default: 1 point per part; docs/grading.md)",
    )
    parser.add_argument(
        "--feedback",
        metavar="FILE.yaml",
        help="your own words per slip code ('unscaled: See lecture 4.'), given to every "
        "student with that slip",
    )
    parser.add_argument(
        "--hidden",
        action="store_true",
        help="hide every probe but the first from the students: "
        "their feedback says a hidden probe failed, without its inputs",
    )
    parser.add_argument(
        "--jobs",
        "-j",
        type=int_in_range(1, 256),
        default=os.cpu_count() or 1,
        metavar="N",
        help="submissions checked at once (default: the number of CPUs)",
    )
    parser.add_argument(
        "--format",
        choices=_FORMATS,
        default="files",
        help="files: grades.csv, STUDENT.json, "
        "STUDENT.md and class.html; gradescope, prairielearn: SUBMISSIONS is one student's "
        "submission, and OUT gets the results.json that Gradescope or PrairieLearn's "
        "external grader reads (default: files)",
    )
    parser.add_argument("--title", metavar="TEXT", help="the class page's title")
    group = parser.add_argument_group("as 'qkv check --function'")
    group.add_argument(
        "--mask-means",
        choices=_MASK_MEANINGS,
        default="allow",
        help="the mask given to FUNCTION(Q, K, V, mask) (default: allow)",
    )
    group.add_argument(
        "--array",
        choices=_ARRAYS,
        default="auto",
        help="probe with NumPy arrays or torch tensors (default: auto)",
    )
    group.add_argument(
        "--causal-alignment",
        choices=_ALIGNMENTS,
        default="top-left",
        help="the causal rule meant when Lq != Lk (default: top-left)",
    )
    group.add_argument(
        "--batched",
        action="store_true",
        help="also require batched (B, H, L, d) inputs (a part of its own)",
    )
    group.add_argument(
        "--timeout",
        type=_seconds,
        default=20.0,
        metavar="SECONDS",
        help="stop a submission after SECONDS of its own code: loading its file and "
        "the calls on the probes (default: 20)",
    )
    group.add_argument(
        "--isolation",
        choices=_ISOLATIONS,
        default="auto",
        help="how the students' code is kept from this machine (default: auto, "
        "the strongest available; docs/isolation.md)",
    )


def _settings(args: argparse.Namespace) -> Any:
    from qkv import examples
    from qkv._read import read_bytes
    from qkv.grade import KINDS, Settings, load_feedback, load_rubric

    rubric = load_rubric(args.rubric) if args.rubric else None
    words = load_feedback(args.feedback) if args.feedback else {}
    inputs, inputs_text = None, ""
    if args.inputs:
        if Path(args.inputs).suffix.lower() not in (".yaml", ".yml"):
            raise CommandError(
                f"--inputs {visible(args.inputs)!r} must be a .yaml worked example. Hint: "
                "'qkv examples --show i-love-statistics > inputs.yaml', then remove 'claimed:'"
            )
        inputs = examples.load(args.inputs)
        if inputs.claimed or inputs.head_claimed:
            raise CommandError(
                f"--inputs {visible(args.inputs)!r} claims numbers; it must hold only the "
                "inputs everyone uses. Hint: remove its 'claimed:' section"
            )
        inputs_text = read_bytes(args.inputs, limit=1 << 20, what="a worked example").decode()
    if args.hidden and args.kind == "example":
        raise CommandError(
            "--hidden hides probes of code (every --kind but example); a worked "
            "example has none. Hint: leave out --hidden"
        )
    if args.contract != "full" and args.kind != "flash":
        raise CommandError(
            "--contract goes with --kind flash. Hint: 'qkv grade submissions/ --kind flash "
            "--function FlashAttention --contract cs336'"
        )
    base = {} if rubric is None else {"rubric": rubric}
    settings = Settings(
        kind=args.kind,
        function=args.function,
        class_name=args.class_name or "MultiHeadAttention",
        class_given=args.class_name is not None and args.kind == "attention",
        hidden=args.hidden,
        inputs=inputs,
        inputs_text=inputs_text,
        mask_means=args.mask_means,
        array=args.array,
        alignment=args.causal_alignment,
        batched=args.batched,
        timeout=args.timeout,
        isolation=args.isolation,
        feedback=words,
        contract=args.contract,
        **base,
    )
    parts = KINDS[args.kind].parts(settings)
    if rubric is not None and settings.rubric.total(parts) == 0:
        raise CommandError(
            f"--rubric {visible(args.rubric)}: the parts of --kind {args.kind} "
            f"({', '.join(parts)}) are all worth 0, so every submission would be graded "
            "0 / 0. Hint: give one of them points, e.g. 'points: {softmax: 1}'"
        )
    return settings


def _run(args: argparse.Namespace) -> int:
    if args.submissions is None or args.output is None:
        raise CommandError(
            "give SUBMISSIONS and -o OUT. Hint: 'qkv grade submissions/ -o grades/ --kind "
            "attention' (see 'qkv grade --help')"
        )
    if args.class_name is not None and args.kind not in ("module", "attention"):
        raise CommandError(
            f"--class goes with --kind module or attention, not --kind {args.kind}. Hint: "
            "--kind module --class MultiHeadAttention, or --kind attention --class Head (a "
            "single head)"
        )
    if args.class_name is not None and not args.class_name.isidentifier():
        raise CommandError(
            f"--class must be a Python name, got {visible(args.class_name)!r}. Hint: "
            "--class MultiHeadAttention"
        )
    if not args.function.isidentifier():
        raise CommandError(
            f"--function must be a Python name, got {visible(args.function)!r}. Hint: "
            "--function attention"
        )
    source = Path(args.submissions)
    if not source.exists():
        raise CommandError(
            f"SUBMISSIONS {visible(args.submissions)!r}: no such file or folder. Hint: "
            "check the path"
        )
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise CommandError(
            f"--output {visible(args.output)!r} is a file; it must be a folder. Hint: -o grades/"
        )
    if not out.parent.is_dir():
        raise CommandError(
            f"--output {visible(args.output)!r}: the folder {visible(str(out.parent))!r} "
            "does not exist. Hint: create it first"
        )
    settings = _settings(args)
    from qkv import grade

    single = args.format != "files"
    if not single:
        grade.check_output(out, overwrite=args.overwrite)  # before any grading
    skipped: list[str] = []
    grades = _with_progress(args, source, settings, single, skipped)
    for line in skipped:
        print(f"qkv: skipped {line}", file=sys.stderr)
    if single:
        from qkv import _io

        out.mkdir(exist_ok=True)
        write, platform = (
            (grade.gradescope_json, "Gradescope")
            if args.format == "gradescope"
            else (grade.prairielearn_json, "PrairieLearn")
        )
        _io.write_atomic(out / "results.json", write(grades[0]))
        print(f"qkv: wrote {visible(str(out / 'results.json'))} ({platform})", file=sys.stderr)
        return 0
    title = args.title or f"{source.stem or source.name} · {args.kind}"
    grade.write_class(out, grades, title=title, overwrite=args.overwrite)
    counts = ", ".join(
        f"{n} {s}" for s in grade.STATUSES if (n := sum(g.status == s for g in grades))
    )
    levels = sorted({g.isolation for g in grades if g.isolation})
    ran = f", code run under {', '.join(levels)}" if levels else ""
    plural = "submission" if len(grades) == 1 else "submissions"
    print(
        f"qkv: graded {len(grades)} {plural} ({counts}{ran}); wrote grades.csv, "
        f"class.html and each student's .json and .md into {visible(str(out))}",
        file=sys.stderr,
    )
    return 0


def _with_progress(
    args: argparse.Namespace, source: Path, settings: Any, single: bool, skipped: list[str]
) -> list[Any]:
    """Grade with a progress bar on a terminal (nothing elsewhere)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from qkv.grade import grade_class

    console = Console(stderr=True, highlight=False, emoji=False, markup=False)
    columns = (TextColumn("grading"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(
        *columns, console=console, transient=True, disable=not console.is_terminal
    ) as bar:
        task = bar.add_task("grading", total=None)

        def tick(total: int, graded: Any) -> None:
            bar.update(task, total=total, advance=0 if graded is None else 1)

        return grade_class(
            source,
            settings,
            jobs=args.jobs,
            code_file=args.file,
            single=single,
            skip=args.output,
            progress=tick,
            skipped=skipped,
        )


COMMAND = Command(
    name="grade",
    summary="grade a class: name each student's slip, give credit per step",
    description=(
        "Grade every submission in SUBMISSIONS (a folder with one .py file, folder or\n"
        ".yaml worked example per student, or an exported zip) as 'qkv check' does:\n"
        "each student's code runs sandboxed, in parallel (--jobs), with a time limit.\n"
        "Each part of attention (scores, scaling, mask, softmax, weighted sum, heads)\n"
        "earns points (--rubric); a step done right on an earlier slip keeps its points.\n\n"
        "Writes into OUT: grades.csv (student, score, max_score, status, first_slip,\n"
        "slips), STUDENT.json (Gradescope's results.json schema), STUDENT.md (the\n"
        "feedback a student reads) and class.html (the teacher's page). A broken\n"
        "submission is a row with status error or timeout, never a stop.\n\n"
        "WARNING: this runs the students' code (sandboxed: docs/check-function.md).\n"
        "See docs/grading.md."
    ),
    examples=(
        ("qkv grade submissions/ -o grades/", "attention(Q, K, V[, mask]) in each .py file"),
        ("qkv grade class.zip -o grades/ --kind causal", "a zip from Gradescope, Canvas, Moodle"),
        (
            "qkv grade handins/ -o grades/ --kind example --inputs inputs.yaml",
            "worked examples (the practice page's hand-ins) on the inputs everyone used",
        ),
        ("qkv grade submissions/ -o grades/ --rubric rubric.yaml --hidden", "your points"),
        (
            "qkv grade /autograder/submission --format gradescope -o /autograder/results",
            "inside Gradescope's run_autograder: results.json",
        ),
        (
            "qkv grade /grade/student --format prairielearn -o /grade/results",
            "inside PrairieLearn's external grader: results.json",
        ),
    ),
    configure=_configure,
    run=_run,
)
