"""``qkv check`` on published worked examples: it agrees with an independent verdict.

``tests/data/corpus`` holds hand-worked attention examples from tutorials, books, course
notebooks and practice sites (each file cites its source; ``README.md`` lists them), with
their numbers transcribed as printed. ``corpus_verdicts.py`` decides each one's truth in
float64 without importing qkv, and each file stores that verdict under ``x-expect``. Here:

- the independent verdict equals the stored one (so a change in either is seen);
- ``qkv check`` gives the same verdict on every file: right or wrong, and for a wrong one
  the same first mistake (step, token, code), with no false alarm on a correct example;
- the independent script itself can fail: slips made on purpose in a correct file are named.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.check.corpus_verdicts import CORPUS, verdict

FILES = sorted(CORPUS.glob("*.yaml"))


def stored(path: Path) -> dict[str, Any]:
    expect = yaml.safe_load(path.read_text(encoding="utf-8"))["x-expect"]
    assert isinstance(expect, dict)
    return expect


def qkv_verdict(path: Path) -> dict[str, Any]:
    from qkv.check import check

    report = check(path)
    first = report.first_wrong
    if report.ok:
        return {"ok": True}
    if first is None:  # only consequential rows: cannot happen for a report that is not ok
        return {"ok": False, "step": None, "token": None, "code": None}
    return {"ok": False, "step": first.step, "token": first.token, "code": first.diagnosis}


def test_the_corpus_is_large_and_cited() -> None:
    assert len(FILES) >= 15
    readme = (CORPUS / "README.md").read_text(encoding="utf-8")
    for path in FILES:
        head = path.read_text(encoding="utf-8").split("format:")[0]
        assert head.startswith("# Source:"), path.name
        assert re.search(r"https?://", head), path.name
        assert path.name in readme, path.name
    mistakes = [p for p in FILES if not stored(p)["ok"]]
    assert len(mistakes) >= 5 and len(FILES) - len(mistakes) >= 5


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_the_independent_verdict_is_the_stored_one(path: Path) -> None:
    assert verdict(path).summary() == stored(path)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_qkv_check_agrees_with_the_independent_verdict(path: Path) -> None:
    assert qkv_verdict(path) == verdict(path).summary()


@pytest.mark.parametrize("path", [p for p in FILES if stored(p)["ok"]], ids=lambda p: p.stem)
def test_no_false_alarm_on_a_correct_published_example(path: Path) -> None:
    from qkv.check import check

    report = check(path)
    assert report.ok
    assert all(f.status in ("ok", "note") for f in report.findings)


def _edited(tmp_path: Path, name: str, old: str, new: str) -> Path:
    text = (CORPUS / name).read_text(encoding="utf-8")
    assert old in text
    out = tmp_path / name
    out.write_text(text.replace(old, new, 1).replace("x-expect:", "x-was:"), encoding="utf-8")
    return out


@pytest.mark.parametrize(
    ("name", "old", "new", "expected"),
    [
        # one digit of a weight changed: 0.2379 -> 0.2879
        (
            "raschka-ch03-simplified.yaml",
            "journey: [0.1385, 0.2379",
            "journey: [0.1385, 0.2879",
            {"ok": False, "step": "weights", "token": "journey", "code": "digit-slip"},
        ),
        # the softmax of the unscaled scores, printed where the scaled one belongs
        (
            "vukrosic-the-cat-sat.yaml",
            "weights: {The: [0.39, 0.39, 0.22]}",
            "weights: {The: [0.42, 0.42, 0.16]}",
            {"ok": False, "step": "weights", "token": "The", "code": "unscaled"},
        ),
        # the exponentials right, the weights summed wrong
        (
            "vukrosic-the-cat-sat.yaml",
            "weights: {The: [0.39, 0.39, 0.22]}",
            "weights: {The: [0.45, 0.45, 0.10]}",
            {"ok": False, "step": "weights", "token": "The", "code": "arithmetic"},
        ),
        # a causal row attending to the future: the mask ignored
        (
            "raschka-ch03-causal.yaml",
            "journey: [0.5517, 0.4483, 0.0000",
            "journey: [0.2, 0.2, 0.2",
            {"ok": False, "step": "weights", "token": "journey", "code": "arithmetic"},
        ),
        # the row of another query printed in place of "am"
        (
            "prakash-i-am-studying.yaml",
            "am: [1.06, 1.70, 1.12]",
            "am: [3.50, 1.06, 3.61]",
            {"ok": False, "step": "scores", "token": "am", "code": "wrong-query"},
        ),
        # one product w_j·v_j of the query "The" printed as the context of "cat"
        (
            "vukrosic-the-cat-sat.yaml",
            "context: {The: [0.61, 0.61, 0.78]}",
            "context: {The: [0.61, 0.61, 0.78], cat: [0.39, 0, 0.39]}",
            {"ok": False, "step": "context", "token": "cat", "code": "context-not-summed"},
        ),
        # float32 printouts keep their slips: one digit of a float32 weight changed
        (
            "aliusman-tf-float32.yaml",
            "t2: [7.7575515e-03, 8.3941586e-02, 9.0830088e-01]",
            "t2: [7.7575515e-03, 8.3941586e-02, 9.0880088e-01]",
            {"ok": False, "step": "weights", "token": "t2", "code": "not-softmax"},
        ),
    ],
    ids=[
        "digit-slip",
        "unscaled",
        "arithmetic",
        "mask-broken",
        "wrong-query",
        "not-summed",
        "float32-digit-slip",
    ],
)
def test_the_independent_script_can_fail(
    tmp_path: Path, name: str, old: str, new: str, expected: dict[str, Any]
) -> None:
    assert verdict(_edited(tmp_path, name, old, new)).summary() == expected


# float32 printouts (issue 26): right to float32 accuracy is right, a slip is still a slip,
# and the strict verdict of dtype: float64 stays available

FLOAT32 = [
    "coursera-dls-c5w4-unmasked.yaml",
    "coursera-dls-c5w4-masked.yaml",
    "aliusman-tf-float32.yaml",
]


@pytest.mark.parametrize("name", FLOAT32)
def test_a_float32_printout_is_right_unless_the_file_asks_for_float64(
    tmp_path: Path, name: str
) -> None:
    path = CORPUS / name
    assert qkv_verdict(path) == verdict(path).summary() == {"ok": True}
    text = path.read_text(encoding="utf-8").replace("dtype: float32\n", "")
    strict = tmp_path / name
    strict.write_text(text.replace("format: 2\n", "format: 2\ndtype: float64\n"), encoding="utf-8")
    assert qkv_verdict(strict)["ok"] is False
    assert verdict(strict).summary()["ok"] is False


def test_without_dtype_float32_rounding_is_a_note_that_says_so() -> None:
    from qkv.check import check

    report = check(CORPUS / "coursera-dls-c5w4-unmasked.yaml")
    notes = [f for f in report.findings if f.status == "note"]
    assert report.ok and notes
    assert all(f.diagnosis == "rounding" and "float32" in f.message for f in notes)
    declared = check(CORPUS / "coursera-dls-c5w4-masked.yaml")
    assert declared.ok and all(f.status == "ok" for f in declared.findings)


def test_the_float32_slip_is_named_by_qkv_too(tmp_path: Path) -> None:
    path = _edited(
        tmp_path,
        "aliusman-tf-float32.yaml",
        "t2: [7.7575515e-03, 8.3941586e-02, 9.0830088e-01]",
        "t2: [7.7575515e-03, 8.3941586e-02, 9.0880088e-01]",
    )
    assert qkv_verdict(path) == verdict(path).summary()
