"""The files of a graded class: ``grades.csv``, and per student ``STUDENT.json`` (Gradescope's
``results.json`` schema) and ``STUDENT.md`` (the feedback a student reads); and, for one
submission, PrairieLearn's external grader ``results.json`` (:func:`prairielearn`).

The student's words are ``qkv check``'s: which step, what they computed, what it should have
been. A finding on a hidden probe says only that a hidden probe failed at that step: no code,
no inputs, no numbers. Text of the student's (their file's name, their exception) is escaped
for the format it goes into: a CSV cell that a spreadsheet would run as a formula starts with
``'``, Markdown is escaped, JSON holds no control character, and Gradescope is told that
every output is plain text (``output_format``: ``text``), so that none is read as HTML.

Example:
    >>> from qkv.grade._credit import Grade, PartResult
    >>> grade = Grade("ada", "ok", (PartResult("scores", 1.0, 1.0),), title="attention in ada.py")
    >>> print(grades_csv([grade]), end="")
    student,score,max_score,status,first_slip,slips
    ada,1,1,ok,,
    >>> gradescope(grade)["tests"][0]["name"]
    'scores: Q·Kᵀ'
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from typing import Any

from qkv._format import json_safe, markdown_escape, number, visible
from qkv.check import Finding
from qkv.grade._credit import HIDDEN_NOTE, Grade, part_text, seen

__all__ = [
    "CSV_COLUMNS",
    "feedback",
    "grades_csv",
    "gradescope",
    "gradescope_json",
    "points",
    "prairielearn",
    "prairielearn_json",
]

CSV_COLUMNS = ("student", "score", "max_score", "status", "first_slip", "slips")
"""The columns of ``grades.csv``, in order; ``id`` follows when the submissions carry the
course platform's ids of the students (Gradescope, Canvas and Moodle exports)."""


def points(value: float) -> str:
    """Points as the files show them: ``4``, ``3.5``, ``0.25``.

    Example:
        >>> points(4.0), points(3.5), points(1 / 3)
        ('4', '3.5', '0.33')
    """
    return f"{round(value, 2):g}"


def _cell(text: str) -> str:
    """A CSV cell a spreadsheet shows as text: never a formula (``=``, ``+``, ``-``, ``@``)."""
    text = visible(text)
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def grades_csv(grades: Sequence[Grade]) -> str:
    """``grades.csv``: one row per student, :data:`CSV_COLUMNS` (and ``id``, when a
    submission carries one); slips ``;``-separated."""
    ids = any(g.student_id for g in grades)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([*CSV_COLUMNS, *(("id",) if ids else ())])
    for g in grades:
        writer.writerow(
            [
                _cell(g.student),
                points(g.score),
                points(g.max_score),
                g.status,
                g.first_slip,
                ";".join(g.slips),
                *((_cell(g.student_id),) if ids else ()),
            ]
        )
    return buffer.getvalue()


def gradescope(grade: Grade) -> dict[str, Any]:
    """The grade in the schema of Gradescope's ``results.json``: a test per part.

    Top level: ``score``, ``output`` and ``output_format`` (``text``: Gradescope shows it
    as it is, never as HTML), ``test_output_format`` (``text``), ``visibility``,
    ``stdout_visibility``, ``tests`` (each: ``name``, ``score``, ``max_score``, ``status``,
    ``output``, ``output_format``, ``visibility``) and ``extra_data`` (qkv's status, the
    slip codes and the maximum score). Every part of the assignment is a test, also when
    the submission could not be checked (0 points each, with the reason).
    """
    tests = [
        {
            "name": part.title,
            "score": part.score,
            "max_score": part.max_score,
            "status": "passed" if part.score >= part.max_score else "failed",
            "output": part_text(grade, part),
            "output_format": "text",
            "visibility": "visible",
        }
        for part in grade.parts
    ]
    return {
        "score": grade.score,
        "output": _summary(grade),
        "output_format": "text",
        "test_output_format": "text",
        "visibility": "visible",
        "stdout_visibility": "hidden",
        "tests": tests,
        "extra_data": {
            "qkv": {
                "status": grade.status,
                "max_score": grade.max_score,
                "first_slip": grade.first_slip if not _hidden_first(grade) else "",
                "slips": [c for c in grade.slips if _code_seen(grade, c)],
            }
        },
    }


def _summary(grade: Grade) -> str:
    """One line: what was checked, the points, and the first slip or why it was not graded."""
    summary = f"{visible(grade.title)}: {points(grade.score)} / {points(grade.max_score)}"
    if grade.status in ("error", "timeout"):
        summary += f" (not graded: {visible(grade.reason)})"
    elif grade.first_slip and not _hidden_first(grade):
        summary += f" (first slip: {grade.first_slip})"
    return summary


def prairielearn(grade: Grade) -> dict[str, Any]:
    """The grade in the schema of PrairieLearn's external grader ``results.json``.

    ``gradable`` (False for a submission that could not be checked: a syntax error, no
    function of that name; PrairieLearn then takes no attempt and gives no points, and shows
    ``format_errors``), ``score`` (0 to 1), ``message`` (one line), ``tests`` (a test per
    part: ``name``, ``description``, ``points``, ``max_points``, ``message``, ``output``),
    and ``partial_scores`` (per part: ``score`` 0 to 1, ``weight``, ``feedback``, as a
    question's ``data["partial_scores"]``) with qkv's status and slip codes in ``qkv``.

    Example:
        >>> from qkv.grade._credit import Grade, PartResult
        >>> grade = Grade("ada", "slip", (PartResult("scores", 1.0, 1.0),
        ...                                PartResult("scaling", 0.0, 1.0)), title="attention")
        >>> data = prairielearn(grade)
        >>> data["score"], data["partial_scores"]["scaling"]["score"]
        (0.5, 0.0)
    """
    total = grade.max_score
    tests = [
        {
            "name": part.title,
            "description": f"{points(part.max_score)} of the {points(total)} points",
            "points": part.score,
            "max_points": part.max_score,
            "message": "Right." if part.full and not part.codes else part_text(grade, part),
            "output": part_text(grade, part),
        }
        for part in grade.parts
    ]
    data: dict[str, Any] = {
        "gradable": grade.status != "error",
        "score": round(grade.score / total, 6) if total > 0 else 0.0,
        "message": _summary(grade),
        "output": "",
        "tests": tests,
        "partial_scores": {
            part.part: {
                "score": round(part.score / part.max_score, 6) if part.max_score else 0.0,
                "weight": part.max_score,
                "feedback": part_text(grade, part),
            }
            for part in grade.parts
        },
        "qkv": {
            "status": grade.status,
            "points": grade.score,
            "max_points": total,
            "first_slip": grade.first_slip if not _hidden_first(grade) else "",
            "slips": [c for c in grade.slips if _code_seen(grade, c)],
        },
    }
    if grade.status == "error":
        data["format_errors"] = [visible(grade.reason)]
    return data


def prairielearn_json(grade: Grade) -> str:
    """:func:`prairielearn` as the text of ``/grade/results/results.json``."""
    return json_safe(json.dumps(prairielearn(grade), indent=2, ensure_ascii=False)) + "\n"


def _hidden_first(grade: Grade) -> bool:
    first = next((f for f in grade.findings if f.status == "mismatch"), None)
    return first is not None and not seen(grade, first)


def _code_seen(grade: Grade, code: str) -> bool:
    return any(f.diagnosis == code and seen(grade, f) for f in grade.findings)


def gradescope_json(grade: Grade) -> str:
    """:func:`gradescope` as the text of ``results.json``."""
    return json_safe(json.dumps(gradescope(grade), indent=2, ensure_ascii=False)) + "\n"


def feedback(grade: Grade) -> str:
    """``STUDENT.md``: the score, a table of the parts, then what went wrong in each."""
    title = markdown_escape(visible(grade.title or grade.student))
    out = [f"# Feedback: {title}", ""]
    out += [f"Score: **{points(grade.score)} / {points(grade.max_score)}**", ""]
    if grade.status in ("error", "timeout"):
        why = "did not finish in time" if grade.status == "timeout" else "could not be checked"
        out += [f"Your submission {why}, so no part earned points:", ""]
        out += [f"> {markdown_escape(grade.reason)}", ""]
        return "\n".join(out)
    out += ["| part | points |", "|:--|--:|"]
    for part in grade.parts:
        mark = "✓" if part.score >= part.max_score else "✗"
        out.append(
            f"| {mark} {markdown_escape(part.title)} | "
            f"{points(part.score)} / {points(part.max_score)} |"
        )
    out.append("")
    for part in grade.parts:
        if not part.codes and part.shown:
            continue
        out += [f"## {markdown_escape(part.title)}", ""]
        for code in part.codes:
            finding = next(f for f in part.findings if (f.diagnosis or "unrecognised") == code)
            out += _finding_markdown(grade, code, finding)
        if not part.shown:
            out += [markdown_escape(part_text(grade, part)), ""]
    if all(p.score >= p.max_score for p in grade.parts) and not any(p.codes for p in grade.parts):
        out += ["Every part is right.", ""]
    return "\n".join(out).rstrip("\n") + "\n"


def _finding_markdown(grade: Grade, code: str, finding: Finding) -> list[str]:
    if not seen(grade, finding):
        return [HIDDEN_NOTE, ""]
    kind = "Note" if finding.status == "note" else "Slip"
    where = f"{finding.step}, {markdown_escape(visible(finding.token))}"
    out = [f"**{kind} `{code}`** ({where}): {markdown_escape(visible(finding.message))}", ""]
    if code in grade.teacher:
        words = visible(" ".join(grade.teacher[code].split()))
        out += [f"> From your teacher: {markdown_escape(words)}", ""]
    if finding.printed:
        n = len(finding.printed)
        out += [
            "| | " + " | ".join(f"d{i + 1}" for i in range(n)) + " |",
            "|:--" + "|--:" * n + "|",
            "| you computed | "
            + " | ".join(markdown_escape(visible(p)) for p in finding.printed)
            + " |",
            "| correct | " + " | ".join(number(x, 4) for x in finding.expected) + " |",
            "",
        ]
    return out
