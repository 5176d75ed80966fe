"""``class.html``: the teacher's page of a graded class, one self-contained offline file.

What the class gets wrong, at a glance: the distribution of the scores, how often each slip
occurred (and in which part), the part at which each student first lost points, every
student's feedback one click away (a ``<details>`` per student, opened from a link too), and,
for worked examples, the numbers the class wrote beside the correct ones, row by row.

The page is built here, in Python; every piece of text from a submission is HTML-escaped
(file names, tokens, numbers as printed, exception messages). It needs no network: a
Content-Security-Policy allows only its own inline style and one small script, identified by
their hashes. Bars are ``<meter>`` elements, so the page works without the script too.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import hashlib
from collections.abc import Sequence
from html import escape

from qkv._format import number, visible
from qkv.check import DIAGNOSES, FUNCTION_DIAGNOSES
from qkv.grade._credit import Grade, PartResult, part_text
from qkv.grade._outputs import points
from qkv.grade._parts import PART_TITLES, PARTS

__all__ = ["class_page"]

_STYLE = """
body{font:15px/1.45 system-ui,sans-serif;margin:0 auto;max-width:60rem;padding:1rem;color:#1b1b1b}
h1{font-size:1.5rem}h2{font-size:1.2rem;margin-top:2rem;border-bottom:1px solid #ccc}
table{border-collapse:collapse;margin:.5rem 0}td,th{padding:.2rem .6rem;text-align:left;
vertical-align:top;border-bottom:1px solid #eee}
td.n{text-align:right;font-variant-numeric:tabular-nums}
meter{width:14rem}summary{cursor:pointer;padding:.3rem 0}summary:focus-visible,a:focus-visible
{outline:3px solid #1a5fb4;outline-offset:2px}details{border-bottom:1px solid #eee}
.part{white-space:pre-wrap;margin:.2rem 0 .6rem 1rem}.bad{color:#a51d2d}.good{color:#26703a}
code{background:#f3f3f3;padding:0 .2rem}.wrong{color:#a51d2d}
@media (prefers-color-scheme:dark){body{background:#1b1b1b;color:#eee}code{background:#333}
.bad,.wrong{color:#ff7b72}.good{color:#7ee787}}
"""

_SCRIPT = """
(function(){
  function openTarget(){
    var id=decodeURIComponent(location.hash.slice(1));
    var el=id&&document.getElementById(id);
    if(el&&el.tagName==='DETAILS'){el.open=true;var s=el.querySelector('summary');if(s){s.focus();}}
  }
  window.addEventListener('hashchange',openTarget);
  openTarget();
})();
"""


def _sha256(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


def _t(text: object) -> str:
    """Text of a submission (or of qkv) for HTML: control characters shown, then escaped."""
    return escape(visible(str(text)), quote=True)


def _lines(text: str) -> str:
    """Text of several lines for a ``white-space: pre-wrap`` block: each line escaped, the
    line breaks kept (not written out as ``\\n``)."""
    return "\n".join(_t(line) for line in text.split("\n"))


def _anchor(student: str) -> str:
    return f"student-{student}"


def class_page(grades: Sequence[Grade], *, title: str = "qkv grade") -> str:
    """The teacher's page for ``grades`` (see the module's docstring)."""
    body = [f"<h1>{_t(title)}</h1>", _summary(grades), _distribution(grades), _slips(grades)]
    body += [_first_wrong(grades), _examples(grades), _students(grades)]
    policy = (
        f"default-src 'none'; style-src 'sha256-{_sha256(_STYLE)}'; "
        f"script-src 'sha256-{_sha256(_SCRIPT)}'; base-uri 'none'; form-action 'none'"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{policy}">\n'
        '<meta name="generator" content="qkv grade">\n'
        f"<title>{_t(title)} · qkv grade</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n"
        "<main>\n" + "\n".join(b for b in body if b) + "\n</main>\n"
        f"<script>{_SCRIPT}</script>\n</body>\n</html>\n"
    )


def _summary(grades: Sequence[Grade]) -> str:
    counts = collections.Counter(g.status for g in grades)
    graded = [g for g in grades if g.max_score > 0]
    mean = sum(g.score / g.max_score for g in graded) / len(graded) if graded else 0.0
    parts = ", ".join(f"{counts[s]} {s}" for s in ("ok", "slip", "error", "timeout") if counts[s])
    return (
        f'<p id="summary">{len(grades)} submission{"" if len(grades) == 1 else "s"}: '
        f"{_t(parts or 'none')}. "
        f"Mean score: {round(100 * mean)} % of the points.</p>"
    )


def _distribution(grades: Sequence[Grade]) -> str:
    if not grades:
        return ""
    bins = collections.Counter((points(g.score), points(g.max_score)) for g in grades)
    most = max(bins.values())
    rows = []
    for (score, top), n in sorted(bins.items(), key=lambda kv: (float(kv[0][1]), float(kv[0][0]))):
        rows.append(
            f"<tr><td class=n>{_t(score)} / {_t(top)}</td><td class=n>{n}</td>"
            f'<td><meter min="0" max="{most}" value="{n}" '
            f'aria-label="{n} students scored {_t(score)} of {_t(top)}"></meter></td></tr>'
        )
    return (
        '<h2 id="distribution">Scores</h2>\n<table><thead><tr><th>score</th><th>students</th>'
        "<th></th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>"
    )


def _sentence(code: str) -> str:
    text = FUNCTION_DIAGNOSES.get(code) or DIAGNOSES.get(code) or ""
    return text[:1].upper() + text[1:]


def _slips(grades: Sequence[Grade]) -> str:
    who: dict[str, list[str]] = collections.defaultdict(list)
    for g in grades:
        for code in g.slips:
            who[code].append(g.student)
    if not who:
        return '<h2 id="slips">Slips</h2>\n<p>No slip in the class.</p>'
    rows = []
    for code, students in sorted(who.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        links = ", ".join(f'<a href="#{_t(_anchor(s))}">{_t(s)}</a>' for s in students)
        rows.append(
            f"<tr><td><code>{_t(code)}</code></td><td class=n>{len(students)}</td>"
            f"<td>{_t(_sentence(code))}<details><summary>who</summary>{links}</details></td></tr>"
        )
    return (
        '<h2 id="slips">Slips</h2>\n<table><thead><tr><th>code</th><th>students</th>'
        "<th>the slip</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>"
    )


def _first_wrong(grades: Sequence[Grade]) -> str:
    first = collections.Counter(
        g.first_wrong_part for g in grades if g.status in ("ok", "slip") and g.first_wrong_part
    )
    if not first:
        return ""
    rows = [
        f"<tr><td>{_t(PART_TITLES[part])}</td><td class=n>{first[part]}</td></tr>"
        for part in PARTS
        if first[part]
    ]
    return (
        '<h2 id="first-wrong">Where the class first goes wrong</h2>\n<p>The first part at '
        "which each student lost points (the parts after it may be right on wrong numbers: "
        "they keep their points).</p><table><thead><tr><th>part</th><th>students</th></tr>"
        "</thead><tbody>" + "".join(rows) + "</tbody></table>"
    )


def _examples(grades: Sequence[Grade]) -> str:
    rows: dict[tuple[str, str], tuple[tuple[float, ...], collections.Counter[tuple[str, ...]]]]
    rows = {}
    for g in grades:
        for key, (printed, expected) in g.example.items():
            rows.setdefault(key, (expected, collections.Counter()))[1][printed] += 1
    if not rows:
        return ""
    out = [
        '<h2 id="numbers">The class\'s numbers beside the correct ones</h2>\n<table><thead><tr>'
        "<th>step</th><th>row</th><th>correct</th><th>the class wrote (students)</th></tr>"
        "</thead><tbody>"
    ]
    for (step, token), (expected, written) in rows.items():
        correct = ", ".join(number(x, 4) for x in expected)
        seen = "<br>".join(f"{_t(', '.join(p))} ({n})" for p, n in written.most_common())
        out.append(
            f"<tr><td>{_t(step)}</td><td>{_t(token)}</td><td>{_t(correct)}</td><td>{seen}</td></tr>"
        )
    return "".join(out) + "</tbody></table>"


def _students(grades: Sequence[Grade]) -> str:
    out = ['<h2 id="students">Every student\'s feedback</h2>']
    for g in grades:
        state = "good" if g.status == "ok" else "bad"
        slip = f" · first slip <code>{_t(g.first_slip)}</code>" if g.first_slip else ""
        out.append(
            f'<details id="{_t(_anchor(g.student))}"><summary><strong>{_t(g.student)}</strong>'
            f" · {_t(points(g.score))} / {_t(points(g.max_score))} · "
            f'<span class="{state}">{_t(g.status)}</span>{slip}</summary>'
        )
        who = f" (id {_t(g.student_id)})" if g.student_id else ""
        out.append(f"<p>{_t(g.title)}{who}</p>")
        if g.status in ("error", "timeout"):
            out.append(f'<p class="part">{_t(g.reason)}</p>')
        for part in g.parts:
            mark = "✓" if part.score >= part.max_score else "✗"
            out.append(
                f"<p><strong>{mark} {_t(part.title)}</strong>: {_t(points(part.score))} / "
                f"{_t(points(part.max_score))}</p>"
            )
            if g.status not in ("error", "timeout"):
                out.append(f'<p class="part">{_lines(_teacher_text(g, part))}</p>')
        out.append("</details>")
    return "\n".join(out)


def _teacher_text(grade: Grade, part: PartResult) -> str:
    """What the student reads about a part, hidden probes shown: the page is the teacher's."""
    return part_text(dataclasses.replace(grade, hidden=frozenset()), part)
