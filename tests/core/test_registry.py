"""Every extension point is one registry, and every list in tests and docs comes from it
(issue 27 §4, issue 36 §2): a backend added to ``qkv.attention.BACKENDS`` is accepted by
name, listed in every report, tried by auto in the registry's order and run by the tests'
parametrisations, with no other edit; the mask rules (``RULES``), the edits (``EDITS``),
the slip codes (each declaring the part of the mechanism it costs) and the grading kinds
(``KINDS``) have their cases, tables and lists derived or checked here."""

from __future__ import annotations

import ast
import importlib
import inspect
import random
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import qkv
from qkv import masks
from qkv.attention import BACKENDS
from qkv.attention._backend import Backend, four, three
from qkv.attention._options import Call
from qkv.attention._plans import fast_order
from qkv.check._findings import DIAGNOSED, Diagnosis
from qkv.check._flash_codes import FLASH_CODES, PLAIN_IN_FLASH
from qkv.check._function_codes import CODES
from qkv.check._probes import KINDS as CHECK_KINDS
from qkv.cli import _grade
from qkv.cli import main as cli
from qkv.edits import EDITS
from qkv.grade import KINDS, PARTS, Settings
from qkv.grade._kinds import grade_one
from qkv.grade._parts import CODE_PARTS, FLASH_PARTS, part_of
from qkv.grade._submissions import Submission
from tests.support import flex_cases
from tests.support.backends import backend_names
from tests.support.edit_cases import CASES
from tests.support.mask_cases import RULE_CASES, draw_rule


def _run_echo(call: Call) -> tuple[torch.Tensor, None]:
    """A stand-in backend: the values' mean over the keys (not attention; only its name is
    under test)."""
    v = four(call.value, call.lead)
    return three(
        v.mean(dim=-2, keepdim=True).expand(-1, -1, call.query.shape[-2], -1), call.lead
    ), None


@pytest.fixture
def echo() -> Iterator[str]:
    """One more backend, registered by one entry in the registry, first for causal calls."""
    backend = Backend(
        "echo",
        "a stand-in",
        lambda call, auto: None if call.torch else "needs tensors",
        _run_echo,
        why=lambda call: "the stand-in runs causal calls",
        first=lambda call: call.options.is_causal,
    )
    BACKENDS["echo"] = backend
    try:
        yield "echo"
    finally:
        del BACKENDS["echo"]


def test_a_backend_added_to_the_registry_is_everywhere(echo: str) -> None:
    q = torch.ones(1, 2, 8, 4)
    # accepted by name, run, and listed in the report (last: the registry's order)
    out = qkv.scaled_dot_product_attention(q, q, 2 * q, backend=echo)
    assert torch.equal(out, 2 * q)
    report = qkv.explain_dispatch(q, q, q, backend=echo)
    assert report.backend == echo and [n for n, _ in report.reasons] == [*BACKENDS]
    # auto tries it in the registry's order, first where its rule says so, with its reason
    causal = qkv.explain_dispatch(q, q, q, is_causal=True)
    assert causal.backend == echo
    assert dict(causal.reasons)[echo] == "the stand-in runs causal calls"
    assert qkv.explain_dispatch(q, q, q).backend == "sdpa"
    assert "sdpa comes first" in dict(qkv.explain_dispatch(q, q, q).reasons)[echo]
    # and the tests' parametrisations take it
    assert echo in backend_names() and echo in backend_names(reference=False, auto=True)


def test_the_error_for_an_unknown_backend_lists_the_registry(echo: str) -> None:
    q = torch.ones(2, 4)
    with pytest.raises(ValueError, match=re.escape(f"one of {sorted(BACKENDS)}")) as error:
        qkv.scaled_dot_product_attention(q, q, q, backend="flash")
    assert repr(echo) in str(error.value)


@pytest.fixture
def wide() -> Iterator[str]:
    """A float64 backend with a long name (the reference in float64, cast back), as a
    newcomer adds one: its facts are fields, read by the reports."""

    def run(call: Call) -> tuple[torch.Tensor, None]:
        up = replace(call, **{n: getattr(call, n).double() for n in ("query", "key", "value")})
        context, _ = BACKENDS["reference"].run(up)
        return context.to(call.query.dtype), None

    BACKENDS["reference-in-float64"] = Backend(
        "reference-in-float64",
        "the reference in float64",
        lambda call, auto: "auto leaves it to others" if auto else None,
        run,
        fast=False,
        half_in="float64",
    )
    try:
        yield "reference-in-float64"
    finally:
        del BACKENDS["reference-in-float64"]


def test_a_float64_backend_is_not_told_it_computed_in_float32(wide: str) -> None:
    q = torch.randn(1, 2, 8, 16, dtype=torch.float16)
    report = qkv.explain_dispatch(q, q, q, backend=wide)
    notes = " ".join(report.notes)
    assert "float16: computed in float64 and the result rounded to float16" in notes
    assert "float32" not in notes
    sdpa = " ".join(qkv.explain_dispatch(q, q, q, backend="sdpa").notes)
    assert repr(wide) in sdpa and "float64" in sdpa  # the backends that compute wider
    out = qkv.scaled_dot_product_attention(q, q, q, backend=wide)
    assert out.dtype == torch.float16


def test_a_long_name_keeps_every_report_in_columns(wide: str) -> None:
    """The name column is as wide as the registry's longest name: every reason starts in
    one column, and a wrapped line continues under it."""
    q = torch.ones(1, 2, 8, 4)
    report = str(qkv.explain_dispatch(q, q, q, mask=masks.causal()))
    lines = report.splitlines()[1:]
    width = max(len(n) for n in BACKENDS)
    starts, in_note = set(), False
    for line in lines:
        name = line[3:].split(" ")[0]
        in_note = line.startswith("   note: ") or (in_note and name not in BACKENDS)
        if name in BACKENDS:
            starts.add(len(line) - len(line[3 + len(name) :].lstrip(" ")))
        elif not in_note:
            assert line.startswith(" " * (width + 4)) and line[width + 4] != " ", line
    assert starts == {width + 4}, report


def test_auto_order_is_the_registry_order_with_first_backends_moved_ahead() -> None:
    q = torch.ones(1, 2, 8, 4)
    call = qkv.attention._dispatch.make_call(q, q, q, mask=masks.causal())
    fast = [name for name, b in BACKENDS.items() if b.fast]
    assert list(fast_order(call)) == fast  # on CPU nothing asks to go first
    first = replace(BACKENDS["tiled"], first=lambda call: True)
    saved = BACKENDS["tiled"]
    BACKENDS["tiled"] = first
    try:
        assert fast_order(call)[0] == "tiled"
    finally:
        BACKENDS["tiled"] = saved


def test_the_parametrisations_follow_the_registry() -> None:
    compiled = {name for name, b in BACKENDS.items() if b.compiles}
    assert set(backend_names(compiled=True)) == set(BACKENDS)
    assert set(backend_names()) == set(BACKENDS) - compiled
    assert backend_names(reference=False, auto=True)[-1] == "auto"


# -- masks: the registry RULES holds every rule a user makes, and the tests draw from it ----


def _mask_makers() -> set[str]:
    """The public functions of qkv.masks that make a Mask a user passes (the dropout
    pattern is qkv's own, ``with_causal`` combines existing rules)."""
    makers = set()
    for name in masks.__all__:
        made = getattr(masks, name)
        if inspect.isfunction(made) and inspect.signature(made).return_annotation in (
            "Mask",
            masks.Mask,
        ):
            makers.add(name)
    return makers - {"dropout_keep", "with_causal"}


def test_every_rule_qkv_masks_exports_is_in_the_registry() -> None:
    assert set(masks.RULES) == _mask_makers()


def test_every_rule_of_the_registry_has_a_case_the_tests_draw() -> None:
    """tests/support/mask_cases.py is the one list of rule cases: the block structure, the
    tiled kernel and FlexAttention tests draw every rule of RULES from it."""
    missing = sorted(set(masks.RULES) - set(RULE_CASES))
    assert not missing, f"tests/support/mask_cases.py has no case for the rules {missing}"
    assert set(RULE_CASES) == set(masks.RULES)


def test_a_rule_added_to_the_registry_is_drawn_by_the_tests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def every_third(b: int, lq: int, lk: int) -> masks.Mask:
        return masks.from_function(lambda b, h, q, kv: kv % 3 == 0, "every third")

    monkeypatch.setitem(masks.RULES, "every_third", every_third)
    with pytest.raises(KeyError, match=r"no case in tests/support/mask_cases\.py"):
        flex_cases.mask_cases(96, 96)
    monkeypatch.setitem(RULE_CASES, "every_third", lambda rng, b, lq, lk: every_third(b, lq, lk))
    assert "rule every_third" in flex_cases.mask_cases(96, 96)
    drawn = {repr(draw_rule(random.Random(seed), 2, 8, 8)) for seed in range(60)}
    assert "from_function(every third)" in drawn


# -- edits: the registry EDITS, and a case of each kind for the oracle tests ---------------


def test_every_kind_of_edit_has_a_case_the_oracle_tests_run() -> None:
    """tests/support/edit_cases.py is the one list of edit cases: the qkv.nn and the
    Hugging Face oracle tests run every case."""
    covered = {case.kind for case in CASES.values()}
    missing = sorted(set(EDITS) - covered)
    assert not missing, f"tests/support/edit_cases.py has no case of the edits {missing}"
    assert covered == set(EDITS)
    for kind, made in EDITS.items():  # the kind is its function's name in qkv.edits
        returns = inspect.signature(getattr(qkv.edits, kind)).return_annotation
        assert returns in (made, made.__name__), (kind, returns)
        assert made.__name__ in qkv.edits.__all__ and kind in qkv.edits.__all__


def test_each_edit_applies_itself() -> None:
    """No isinstance chain: applying an edit is its own method."""
    source = inspect.getsource(importlib.import_module("qkv.edits._apply"))
    assert "isinstance(edit," not in source
    for made in EDITS.values():
        assert "apply" in vars(made), made


# -- the docs: the registries' tables list every entry ------------------------------------

_ROOT = Path(__file__).parents[2]


def _tables(page: str, header: str) -> list[list[list[str]]]:
    """The rows (cells) of each table of ``docs/page`` whose header starts with ``header``."""
    lines = (_ROOT / "docs" / page).read_text(encoding="utf-8").splitlines()
    tables = []
    for start in (i for i, line in enumerate(lines) if line.startswith(header)):
        rows = []
        for line in lines[start + 2 :]:
            if not line.startswith("|"):
                break
            cells = re.split(r"(?<!\\)\|", line.strip().removeprefix("|").removesuffix("|"))
            rows.append([cell.strip() for cell in cells])  # a \| is within its cell
        tables.append(rows)
    return tables


def _table(page: str, header: str) -> list[list[str]]:
    """The rows (cells) of the first table of ``docs/page`` whose header starts with
    ``header``."""
    return _tables(page, header)[0]


def _named(cell: str) -> str:
    """The identifier a first cell names: `causal(alignment)` → causal."""
    return re.sub(r"\(.*", "", cell.strip("`"))


def test_the_kernels_page_lists_every_backend_with_its_facts() -> None:
    """Its row, its ``runs``, and what it does with half inputs (``half_in``)."""
    header = "| backend | what it is | memory | float16 / bfloat16 inputs"
    rows = _table("kernels.md", header)
    assert [_named(row[0]) for row in rows] == list(BACKENDS)
    for row in rows:
        backend = BACKENDS[_named(row[0])]
        assert row[4] == backend.runs, row
        half = f"computed in {backend.half_in}" if backend.half_in else "handed to"
        assert row[3].startswith(half), row


def test_the_kernels_page_lists_every_rule() -> None:
    rows = _table("kernels.md", "| rule | allows |")
    assert sorted({_named(row[0]) for row in rows}) == sorted(masks.RULES)


def test_the_interventions_page_lists_every_kind_of_edit() -> None:
    rows = _table("interventions.md", "| edit | what the head's context becomes |")
    assert sorted({_named(row[0]) for row in rows}) == sorted(EDITS)


def _registries() -> dict[str, set[str]]:
    """The registries whose lists the guard reads (``qkv check``'s kinds are ``qkv grade``'s
    code kinds; slip codes are named a few at a time by design, and their tables are checked
    whole below)."""
    return {
        "BACKENDS": set(BACKENDS),
        "RULES": set(masks.RULES),
        "EDITS": set(EDITS),
        "KINDS": set(KINDS),
        "CHECK_KINDS": {*CHECK_KINDS, "flash"},
    }


def _partial(listed: set[object], names: set[str]) -> bool:
    """Whether ``listed`` names part of the registry ``names``: two or more of its entries,
    not all, and not exactly the entries of another registry (the kinds of ``qkv check``
    are a part of ``qkv grade``'s, and listed whole)."""
    whole = any(listed == other for other in _registries().values())
    return len(listed) >= 2 and listed <= names and listed != names and not whole


def _partial_runs(text: str) -> Iterator[tuple[str, list[str]]]:
    """Lists of a registry's names in a page that name two or more entries but not all:
    the first column of a table, the alternatives of a value (``"a" | "b"``, or
    ``--kind a\\|b`` in a table's cell) and a Python list (``['a', 'b']``). Prose about some
    backends (`sdpa` and `tiled` take ...) is no list."""
    for registry, names in _registries().items():
        quoted = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
        item = rf"[`\"']({quoted})[`\"']"
        lists = (
            (rf"{item}(?:\s*\|\s*{item})+", item),  # "a" | "b"
            (rf"\[{item}(?:,\s*{item})+\]", item),  # ['a', 'b']
            (rf"(?<![\w|\\-])(?:{quoted})(?:\\?\|(?:{quoted}))+(?![\w-]|\\?\|\w)", r"\\?\|"),
        )  # the last: a\|b, bare names in a table's cell
        for pattern, each in lists:
            for found in re.finditer(pattern, text):
                run = found.group(0)
                listed = re.findall(each, run) if each == item else re.split(each, run)
                if _partial(set(listed), names):
                    yield registry, listed
        column = re.findall(rf"^\| {item}", text, flags=re.MULTILINE)
        if _partial(set(column), names):
            yield registry, column


HAND_WRITTEN_SUBSETS = {
    "tests/core/test_registry.py": "the guards' own examples",
    "tests/nn/test_compile.py": "the layout test of the backends that have an in_graph form",
    "tests/check/test_function_probes.py": "the probe of known score order, of single heads",
}
"""Files whose lists may name part of a registry, each with why."""


def test_no_hand_written_list_in_docs_or_tests_names_part_of_a_registry() -> None:
    """A list in docs/ (decisions.md records past decisions) or a literal list in tests/
    that names some entries of a registry misses the next one: derive it, or list all."""
    found = []
    for page in sorted((_ROOT / "docs").glob("*.md")):
        if page.name != "decisions.md":
            for registry, listed in _partial_runs(page.read_text(encoding="utf-8")):
                found.append(f"docs/{page.name}: {listed} of {registry}")
    for path in sorted((_ROOT / "tests").rglob("*.py")):
        where = path.relative_to(_ROOT).as_posix()
        if where in HAND_WRITTEN_SUBSETS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.Tuple, ast.List, ast.Set)) or len(node.elts) < 2:
                continue
            values = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if len(values) != len(node.elts):
                continue
            for registry, names in _registries().items():
                if _partial(set(values), names):
                    found.append(f"{where}:{node.lineno}: {values} of {registry}")
    assert not found, "hand-written lists naming part of a registry: " + "; ".join(found)


def test_the_guard_sees_a_partial_list() -> None:
    assert list(_partial_runs('`backend="reference" | "sdpa"`')) == [
        ("BACKENDS", ["reference", "sdpa"])
    ]
    assert not list(_partial_runs("`sdpa` alone"))
    assert list(_partial_runs("| `--kind attention\\|causal\\|example` | what it holds |")) == [
        ("KINDS", ["attention", "causal", "example"])
    ]
    every = "|".join(KINDS)
    assert not list(_partial_runs(f"`--kind {every}`, and `qkv check --kind` the same"))


# -- a backend's facts are its fields: no code compares its name -------------------------

_SRC = Path(qkv.__file__).parent

_CHOICE = re.compile(r"backend|chosen|requested|^fast$")
"""The names code keeps a backend's name in (``backend``, ``chosen``, ``requested``, ...)."""


def _identifier(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _compared_names(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, name) of each comparison of a backend's name held in a variable (``backend``,
    ``chosen``, ...) with a literal one, and of each lookup ``BACKENDS["..."]``."""
    names = set(BACKENDS)

    def literals(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Constant) and node.value in names:
            return {node.value}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return {e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names}
        return set()

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = (node.left, *node.comparators)
            if any(_CHOICE.search(_identifier(side)) for side in sides):
                for side in sides:
                    for name in literals(side):
                        yield node.lineno, name
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id == "BACKENDS"
        ):
            for name in literals(node.slice):
                yield node.lineno, name


def test_no_code_compares_a_backend_name() -> None:
    """A backend's facts (records steps, output check, compiles, half precision, plans,
    notes) are fields of its Backend; comparing its name hid them from a new backend.
    ``bench/`` names its own measured peers (labels, not backends)."""
    found = []
    for path in sorted(_SRC.rglob("*.py")):
        where = path.relative_to(_SRC).as_posix()
        if where.startswith("bench/"):
            continue
        for line, name in _compared_names(ast.parse(path.read_text(encoding="utf-8"))):
            found.append(f"{where}:{line}: {name!r}")
    assert not found, "compares a backend's name instead of reading its fields: " + ", ".join(found)


def test_the_guard_sees_a_comparison() -> None:
    tree = ast.parse('if chosen == "sdpa" or BACKENDS["reference"].fast or "tiled" in top: pass')
    assert [name for _, name in _compared_names(tree)] == ["sdpa", "reference"]


# -- slip codes: each declares the part it costs where it is declared ---------------------

_DECLARED: dict[str, tuple[Diagnosis, ...]] = {
    "DIAGNOSED": DIAGNOSED,
    "CODES": CODES,
    "FLASH_CODES": FLASH_CODES,
}
"""Where codes are declared: a worked example's (``qkv check FILE``), attention code's
(``--function``, ``--module``) and FlashAttention code's (``--kind flash``)."""

NO_STEP = {"digit-slip", "arithmetic", "rounding", "unrecognised"}
"""The codes that name no step: they cost the part of the step (or probe) they were found
at, so they declare none."""


def test_every_slip_code_declares_a_part_of_the_rubric() -> None:
    wrong = [
        f"{where}: {c.code} costs {c.part!r}"
        for where, declared in _DECLARED.items()
        for c in declared
        if (c.part is None) != (c.code in NO_STEP) or (c.part is not None and c.part not in PARTS)
    ]
    assert not wrong, f"declare a part of {PARTS}: " + "; ".join(wrong)
    assert {c.part for c in FLASH_CODES} <= set(FLASH_PARTS)
    # the plain codes a FlashAttention kernel makes: a flash part, or the probe's (None)
    assert set(PLAIN_IN_FLASH) <= {c.code for c in CODES}
    assert set(PLAIN_IN_FLASH.values()) <= {*FLASH_PARTS, None}


def test_a_code_declared_in_two_places_costs_one_part() -> None:
    """``unscaled`` is a worked example's code and attention code's: one part."""
    parts: dict[str, set[str | None]] = defaultdict(set)
    for declared in _DECLARED.values():
        for c in declared:
            parts[c.code].add(c.part)
    assert {code: found for code, found in parts.items() if len(found) > 1} == {}


def test_grading_credits_each_code_to_the_part_it_declares() -> None:
    for declared in _DECLARED.values():
        for c in declared:
            if c.part is not None:
                assert part_of(c.code, "context") == c.part == CODE_PARTS[c.code]
    assert part_of("arithmetic", "scores") == "scores"  # a code of no step: its step's


def _codes_tables() -> tuple[list[list[str]], list[list[str]]]:
    """docs/check-function.md's tables of codes: attention code's, FlashAttention's."""
    function, flash = _tables("check-function.md", "| code | part | the slip |")
    return function, flash


def test_the_codes_tables_list_every_code_with_its_part() -> None:
    function, flash = _codes_tables()
    for rows, declared in ((function, CODES), (flash, FLASH_CODES)):
        assert sorted(_named(row[0]) for row in rows) == sorted(c.code for c in declared)
        part = {c.code: c.part for c in declared}
        for row in rows:
            code = _named(row[0])
            if part[code] is not None:
                assert row[1].startswith(f"`{part[code]}`"), row
            else:
                assert row[1] == "every part (above)", row


# -- grading kinds: KINDS is the one list of --kind -----------------------------------------


def test_every_grading_kind_is_offered_and_documented(capsys: pytest.CaptureFixture[str]) -> None:
    """``qkv grade --kind`` accepts each kind (its list is a copy, kept for a fast start),
    its help says what a submission of each holds, and docs/grading.md's option row names
    them all."""
    assert tuple(KINDS) == _grade._KINDS
    assert cli(["grade", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    for name in KINDS:
        assert f" {name}: " in help_text, name
    [row] = [r for r in _table("grading.md", "| option | what it does |") if "--kind" in r[0]]
    assert row[0] == "`--kind " + "\\|".join(KINDS) + "`"


@pytest.mark.parametrize("name", KINDS)
def test_every_grading_kind_grades_on_parts_of_the_rubric(name: str) -> None:
    """A kind's parts are parts of the rubric, and a hand-in it cannot read is a grade:
    ``error`` on each of them, 0 points, with the reason."""
    kind = KINDS[name]
    assert kind.name == name and kind.summary
    settings = Settings(kind=name)
    parts = kind.parts(settings)
    assert parts and set(parts) <= set(PARTS), parts
    broken = Submission("ada", "ada.zip", "problem", problem="ada.zip: not a zip file")
    grade = grade_one(broken, settings)
    assert (grade.status, grade.kind, grade.score) == ("error", name, 0.0)
    assert [p.part for p in grade.parts] == list(parts)
    assert all(p.why == "ada.zip: not a zip file" for p in grade.parts)
