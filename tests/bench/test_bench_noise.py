"""`qkv bench` says what its numbers are worth: a missed target measured while the machine was
busy (its 1-minute load average above its cores) or with repeats that spread beyond the bound
says so beside its "no". Loads, spreads and timings are injected: nothing here is timed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from qkv.bench import _measure, _suite, _tables
from qkv.bench._results import SPREAD_BOUND, Row, Settings, Table

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _backward(
    tiled: float = 1.2, *, load: float | None = None, spreads: tuple[float, float] = (0.0, 0.0)
) -> Table:
    """A forward + backward table: tiled against SDPA at 4096 (goal ≤ 1.05), causal."""
    table = Table("backward", "Forward + backward", "sdpa-flash")
    table.rows = [
        Row("causal", 4096, "sdpa-flash", 1.0, 1e9, spread=spreads[0], load=load),
        Row("causal", 4096, "tiled", tiled, 1e9, spread=spreads[1], load=load),
    ]
    _measure.ratios(table.rows, "sdpa-flash")
    return table


def _met(tables: list[Table], cores: int = 2) -> list[str]:
    targets = _suite.targets_table(tables, cores=cores)
    assert targets is not None
    head, rows = _tables.cells(targets, rate=200.0)
    return [row[head.index("met")] for row in rows]


def test_a_missed_target_under_load_says_the_machine_was_busy() -> None:
    assert _met([_backward(load=3.14)]) == ["no (machine busy: load 3.1 on 2 cores)"]
    assert _met([_backward(load=3.14)], cores=4) == ["no"]  # 3.1 on 4 cores is not busy
    assert _met([_backward(load=2.0)]) == ["no"]  # our own two threads: not above the cores


def test_a_missed_target_with_scattered_repeats_says_it_is_noisy() -> None:
    assert _met([_backward(spreads=(0.0, 0.4))]) == ["no (noisy: spread 40 %)"]
    assert _met([_backward(spreads=(0.25, 0.02))]) == ["no (noisy: spread 25 %)"]  # the worse
    within = SPREAD_BOUND * 0.9
    assert _met([_backward(spreads=(within, within))]) == ["no"]


def test_a_busy_machine_is_named_before_noise_and_a_met_target_says_nothing() -> None:
    assert _met([_backward(load=5.0, spreads=(0.5, 0.5))]) == [
        "no (machine busy: load 5.0 on 2 cores)"
    ]
    assert _met([_backward(1.01, load=5.0, spreads=(0.5, 0.5))]) == ["yes"]


def test_the_page_and_the_terminal_show_the_note_beside_the_no() -> None:
    targets = _suite.targets_table([_backward(load=3.14)], cores=2)
    assert targets is not None
    about = {"cpu": "test", "cores": 2, "threads": 2, "torch": "x"}
    text = _tables.markdown([targets], about, 200.0, Settings())
    assert "| 1.20 | ≤ 1.05 | no (machine busy: load 3.1 on 2 cores) |" in text
    assert "busy" in targets.note and f"{SPREAD_BOUND:.0%}" in targets.note


def _clock(times: list[float]) -> Iterator[float]:
    yield from times


def test_medians_keep_the_spread_of_each_peers_repeats(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call's duration is injected: a first (untimed) call, then the repeats, the
    peers alternating."""
    durations = _clock([0.1, 0.1, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 1.0, 1.0])
    monkeypatch.setattr(_measure, "timed", lambda run: next(durations))
    found = _measure.medians({"steady": lambda: None, "shaky": lambda: None}, 4)
    assert found == {"steady": 1.0, "shaky": 1.0}
    assert found.spreads["steady"] == 0.0
    assert found.spreads["shaky"] == pytest.approx(0.25)  # quartiles 1.0 and 1.25


def test_each_row_of_a_run_carries_the_load_it_was_measured_under(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loads = iter([0.5, 7.25])  # before and after the section: the busier counts
    monkeypatch.setattr(_suite, "load_average", lambda: next(loads))
    monkeypatch.setitem(_suite.SECTIONS, "backward", (lambda s, tick: _backward(), lambda s: 1))
    backward, targets = list(_suite.run_suite(Settings(), ["backward"]))
    assert {row.load for row in backward.rows} == {7.25}
    assert targets.rows[0].load == 7.25
    assert targets.rows[0].caveat.startswith("machine busy: load 7.2")
