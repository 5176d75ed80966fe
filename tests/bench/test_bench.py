"""`qkv bench`: its tables, the section it writes into docs/benchmarks.md, its errors; the
kernels page runs as documented."""

from __future__ import annotations

import doctest
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qkv.bench import _measure, _suite, _tables
from qkv.bench._results import MOST_REPEATS
from qkv.cli import _bench, main

ROOT = Path(__file__).resolve().parents[2]

TINY = _suite.Settings(
    lengths=(64, 128),
    mask_length=512,
    long_length=512,
    decode_length=256,
    trace_length=128,
    repeats=1,
    quick=True,
    train_length=128,
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_kernels_page_runs_as_written() -> None:
    result = doctest.testfile(
        str(ROOT / "docs" / "kernels.md"),
        module_relative=False,
        optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS,
    )
    assert result.attempted > 15
    assert result.failed == 0


def _table() -> _suite.Table:
    table = _suite.Table("dense", "Dense", "sdpa-flash")
    table.rows = [
        _suite.Row("dense", 1024, "sdpa-flash", 0.010, 2.0e9),
        _suite.Row("dense", 1024, "tiled", 0.012, 2.0e9),
    ]
    _measure.ratios(table.rows, "sdpa-flash")
    return table


def test_cells_give_ratios_and_the_share_of_the_gemm_rate() -> None:
    head, rows = _tables.cells(_table(), rate=200.0)
    assert head == ["N", "mask", "peer", "ms", "ratio", "GFLOP/s", "% GEMM"]
    assert rows[1] == ["1024", "dense", "tiled", "12.0", "1.20", "167", "83.3"]


def test_the_section_is_rewritten_between_its_markers_and_nothing_else(tmp_path: Path) -> None:
    page = tmp_path / "benchmarks.md"
    page.write_text(
        "# Benchmarks\n\nintro\n\n## qkv.nn vs torch.nn.MultiheadAttention\n\nkeep me\n",
        encoding="utf-8",
    )
    about = {"cpu": "test cpu", "cores": 2, "threads": 2, "torch": "x", "memory_gib": 4}
    _bench._write(page, [_table()], about, 200.0, TINY)
    first = page.read_text(encoding="utf-8")
    assert "keep me" in first and first.count(_tables.START) == 1
    assert "| 1024 | dense | tiled | 12.0 | 1.20 | 167 | 83.3 |" in first
    assert "test cpu" in first and (tmp_path / "img" / "bench-dense.png").stat().st_size > 0
    table = _table()
    table.rows[1].seconds = 0.008
    _measure.ratios(table.rows, "sdpa-flash")
    _bench._write(page, [table], about, 200.0, TINY)
    second = page.read_text(encoding="utf-8")
    assert second.count(_tables.START) == 1 and "keep me" in second
    assert "| 0.80 |" in second and "| 1.20 |" not in second
    assert second.startswith("# Benchmarks\n\nintro\n")
    long = _suite.Table("long", "Long", "tiled")
    long.rows = [_suite.Row("fwd+bwd", 65536, "tiled", 265.0, 1.5e13, 201 * 2**20)]
    _bench._write(page, [long], about, 200.0, TINY)  # one table alone: the others stay
    third = page.read_text(encoding="utf-8")
    assert "| 0.80 |" in third and "| 65536 | fwd+bwd | 265.0 |" in third
    assert third.index("### Dense") < third.index("### Long") and "keep me" in third


def test_bench_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--output", str(tmp_path / "missing" / "b.md")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["bench", "--only", "nothing"]) == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.slow
def test_a_full_small_run_prints_80_columns_and_writes_the_page_and_plots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every default section at tiny sizes, in one run: what it prints (80 columns, the
    backend auto ran, the training step's peers) and the page and plots it writes. (One
    run for both: a second, of some sections only, added ten seconds and no code path.)"""
    monkeypatch.setattr(_suite.Settings, "quick_run", classmethod(lambda cls: TINY))
    # One structured mask: each case starts five processes (one times its peers, one
    # measures each peer's memory), seconds apiece; the others add time, not coverage.
    monkeypatch.setattr(_suite, "MASK_KINDS", ("window",))
    page = tmp_path / "benchmarks.md"
    assert main(["bench", "--quick", "--output", str(page)]) == 0
    printed = capsys.readouterr()
    out = printed.out
    assert "Dense and causal forward" in out and "sdpa-flash" in out and "decode" in out
    assert "qkv-auto (" in out and "naive-torch" in out  # which backend auto ran
    assert "Training step" in out and "torch-mha-mask" in out and "qkv-padded" in out
    assert max(len(line) for line in out.splitlines()) <= 80
    text = page.read_text(encoding="utf-8")
    for title in ("Structured masks", "Forward + backward", "One decoding step", "Targets"):
        assert title in text
    assert "flex-compiled" in text and "compile s" in text
    assert (tmp_path / "img" / "bench-masks.png").exists()
    assert "wrote" in printed.err


def test_peak_memory_sees_a_tensor_allocated_and_freed() -> None:
    # A fresh process, as `qkv bench` uses: in a long-lived one the allocator may reuse memory
    # that earlier tests left resident, and nothing new is counted.
    code = (
        "import torch\n"
        "from qkv.bench import peak_memory\n"
        "added, total = peak_memory(lambda: torch.ones(16_000_000).sum().item())  # 64 MB\n"
        "print(added, int(total))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    added, total = map(int, result.stdout.split())
    assert total == 16_000_000
    assert 50_000_000 < added < 200_000_000


# -- honest peers: compiled FlexAttention, fwd+bwd against SDPA, the targets (issue 14) --------


@pytest.mark.parametrize("kind", _suite.MASK_KINDS)
def test_the_block_mask_given_to_compiled_flex_allows_the_pairs_of_qkvs_mask(kind: str) -> None:
    """The BlockMask built from qkv's block structure has the blocks create_block_mask finds,
    and its mask_mod allows the pairs of qkv's rule: the two peers compute the same thing."""
    import array_api_compat.torch as torch_xp
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    length = 700
    rule, allowed = _suite._structured(kind, length)
    mask_mod = _suite.torch_mask_mod(kind, length)
    ours = _measure.flex_block_mask(rule, mask_mod, length)
    theirs = create_block_mask(mask_mod, None, None, length, length, device="cpu")
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    dense = rule.dense(length, length, xp=torch_xp)
    assert torch.equal(create_mask(mask_mod, 1, 1, length, length, device="cpu"), dense)
    assert abs(int(dense.sum()) / length**2 - allowed) < 1e-12


def _rows(key: str, case: str, tiled: float, peer: str, seconds: float) -> _suite.Table:
    table = _suite.Table(key, key, peer)
    table.rows = [
        _suite.Row(case, 4096, peer, seconds, 1e9),
        _suite.Row(case, 4096, "tiled", tiled, 1e9),
    ]
    _measure.ratios(table.rows, peer)
    return table


def test_targets_are_read_from_the_ratios_of_the_same_run() -> None:
    masks = _rows("masks", "window", 0.9, "flex-compiled", 1.0)
    masks.rows.append(_suite.Row("window", 4096, "qkv-auto", 0.8, 1e9))
    backward = _rows("backward", "causal", 1.2, "sdpa-flash", 1.0)
    targets = _suite.targets_table([masks, backward])
    assert targets is not None
    head, rows = _tables.cells(targets, rate=200.0)
    assert head == ["target", "N", "ratio", "goal", "met"]
    assert rows == [
        ["window: auto ÷ flex-compiled", "4096", "0.80", "≤ 1.00", "yes"],
        ["causal fwd+bwd: tiled ÷ sdpa-flash", "4096", "1.20", "≤ 1.05", "no"],
    ]
    dense = _table()  # the forward at N = 1024: tiled against SDPA, auto against the faster
    dense.rows.append(_suite.Row("dense", 1024, "qkv-auto", 0.0104, 2.0e9))
    table = _suite.targets_table([dense])
    assert table is not None and _tables.cells(table, 200.0)[1] == [
        ["dense forward: tiled ÷ sdpa-flash", "1024", "1.20", "≤ 1.20", "yes"],
        ["dense forward: auto ÷ best of sdpa, tiled", "1024", "1.04", "≤ 1.03", "no"],
    ]
    assert _suite.targets_table([_rows("decode", "decode", 1.0, "recompute", 1.0)]) is None


def test_the_peer_column_names_the_backend_auto_ran() -> None:
    table = _rows("masks-bwd", "documents", 0.5, "sdpa-dense-mask", 1.0)
    auto = _suite.Row("documents", 4096, "qkv-auto", 0.4, 1e9, ran="flex")
    auto.compile_seconds = 7.0
    table.rows.append(auto)
    head, rows = _tables.cells(table, rate=200.0)
    assert head[2] == "peer" and head[-1] == "compile s"
    assert [r[2] for r in rows] == ["sdpa-dense-mask", "tiled", "qkv-auto (flex)"]
    assert rows[-1][-1] == "7.0" and rows[0][-1] == ""


def test_masks_table_shows_compile_time_apart() -> None:
    table = _rows("masks", "documents", 0.5, "flex-compiled", 0.4)
    table.rows[0].compile_seconds = 9.25
    head, rows = _tables.cells(table, rate=200.0)
    assert head[-1] == "compile s" and head[4] == "ratio"
    assert rows[0][-1] == "9.2" and rows[1][-1] == ""  # compiled flex's first call, apart
    assert rows[1][4] == "1.25"


def test_settings_measure_masks_at_4096_and_the_longest() -> None:
    assert _suite.Settings().mask_lengths == (4096, 16384)
    assert _suite.Settings.quick_run().mask_lengths == (4096,)
    assert TINY.mask_lengths == (512,)


def test_a_budget_times_a_short_call_many_times_and_a_long_one_as_asked() -> None:
    """`medians(..., budget=)`: a call far under the budget is timed MOST_REPEATS times (its
    median is then one of many), a call over it `repeats` times; with no budget, `repeats`
    (each after one untimed first call)."""
    calls = {"short": 0, "long": 0}

    def short() -> None:
        calls["short"] += 1

    def long() -> None:
        calls["long"] += 1
        time.sleep(0.02)

    _measure.medians({"short": short}, 3, budget=1.0)
    _measure.medians({"long": long}, 3, budget=0.01)
    assert calls == {"short": 1 + MOST_REPEATS, "long": 1 + 3}
    calls.update(short=0, long=0)
    _measure.medians({"short": short, "long": long}, 3)
    assert calls == {"short": 4, "long": 4}
