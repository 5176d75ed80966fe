"""The rubric: points per part, the price of each slip, and a hostile rubric file refused in
one line that names the file, the line and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from qkv.check import check
from qkv.examples import builtin
from qkv.grade import Rubric, RubricError, load_rubric, parse_rubric
from qkv.grade._credit import credit_example
from tests.support.isolated import run_cli_isolated


def test_points_and_penalties_change_the_grade_and_follow_through_keeps_later_points() -> None:
    report, example = check("i-love-statistics"), builtin("i-love-statistics")
    default = credit_example("seed", report, example, Rubric())
    assert [(p.part, p.score, p.max_score) for p in default.parts] == [
        ("projections", 0.0, 1.0),
        ("scores", 0.0, 1.0),
        ("scaling", 1.0, 1.0),
        ("softmax", 0.0, 1.0),
        ("weighted-sum", 0.0, 1.0),
    ]
    rubric = parse_rubric(
        "points: {projections: 4, weighted-sum: 3}\npenalties: {arithmetic: 1, "
        "context-not-summed: 2}\n"
    )
    priced = credit_example("seed", report, example, rubric)
    assert [(p.part, p.score, p.max_score) for p in priced.parts] == [
        ("projections", 3.0, 4.0),
        ("scores", 0.0, 1.0),
        ("scaling", 1.0, 1.0),
        ("softmax", 0.0, 1.0),
        ("weighted-sum", 1.0, 3.0),
    ]
    assert (priced.score, priced.max_score) == (5.0, 10.0)


def test_a_part_worth_nothing_is_left_out_and_a_note_can_cost() -> None:
    rubric = parse_rubric("points: {projections: 0}\npenalties: {masked-row-nan: 0.5}\n")
    grade = credit_example("seed", check("i-love-statistics"), builtin("i-love-statistics"), rubric)
    assert "projections" not in [p.part for p in grade.parts]
    assert rubric.penalty("masked-row-nan", 1.0) == 0.5
    assert Rubric().penalty("masked-row-nan", 1.0) == 0.0
    assert rubric.penalty("unscaled", 2.0) == 2.0
    assert parse_rubric("penalties: {digit-slip: 9}\n").penalty("digit-slip", 2.0) == 2.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "points: {softmaxx: 2}\n",
            r"rubric.yaml, line 1: points.softmaxx: unknown part "
            r"'softmaxx'. Hint: did you mean 'softmax'\?",
        ),
        (
            "penalties: {unscaledd: 1}\n",
            r"line 1: penalties.unscaledd: unknown slip code "
            r"'unscaledd'. Hint: did you mean 'unscaled'\?",
        ),
        (
            "points:\n  scores: two\n",
            r"line 2: points.scores: expected a number of points, got "
            r"the text 'two'",
        ),
        (
            "points: {scores: -1}\n",
            r"points.scores: expected a number of points from 0 to "
            r"1000, got '-1'",
        ),
        ("points: {scores: .nan}\n", r"points.scores: expected a number of points from 0 to 1000"),
        ("points: {scores: 1.0e+400}\n", r"points.scores: expected a number of points from 0 to"),
        (
            "points: {scores: 1, scores: 2}\n",
            r"points.scores: duplicate key 'scores' \(it is "
            r"already given on line 1\)",
        ),
        ("points: [1, 2]\n", r"line 1: points: expected a mapping of part to points, got a list"),
        ("marks: {scores: 1}\n", r"line 1: marks: unknown key 'marks'"),
        (
            "points: {scores: !!python/object:os.system 1}\n",
            r"expected a number of points, got "
            r"a value tagged",
        ),
        ("a: &x [1]\nb: *x\n", r"line 2: an alias"),
        ("points: {scores: [1\n", r"not valid YAML"),
        ("- 1\n", r"line 1: expected a mapping with 'points' and 'penalties', got a list"),
    ],
)
def test_a_bad_rubric_is_one_line_naming_file_line_and_field(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "rubric.yaml"
    path.write_text(text)
    with pytest.raises(RubricError, match=message) as error:
        load_rubric(path)
    assert "\n" not in str(error.value)


def test_a_hostile_rubric_file_is_refused_before_it_is_read_whole(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("points: {scores: 1}\n" + "# padding\n" * 100_000)
    with pytest.raises(RubricError, match=r"--rubric .*big.yaml: the file holds"):
        load_rubric(big)
    with pytest.raises(RubricError, match=r"is not a regular file"):
        load_rubric("/dev/zero")
    with pytest.raises(RubricError, match=r"no-such.yaml: No such file"):
        load_rubric(tmp_path / "no-such.yaml")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00points")
    with pytest.raises(RubricError, match=r"not UTF-8 text"):
        load_rubric(binary)


def test_a_billion_laughs_rubric_stops_at_the_first_alias(tmp_path: Path) -> None:
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 12)]
    rubric = tmp_path / "laughs.yaml"
    rubric.write_text("\n".join(lines) + "\n")
    (tmp_path / "class").mkdir()
    ((status, err),) = run_cli_isolated(
        [["grade", str(tmp_path / "class"), "-o", str(tmp_path / "out"), "--rubric", str(rubric)]],
        memory=1 << 30,
        seconds=120,
    )
    assert status == 2
    assert "laughs.yaml, line 2: an alias" in err
