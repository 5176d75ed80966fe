"""The examples of docs/nn.md run and print what the page says; the benchmark script runs."""

from __future__ import annotations

import doctest
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_nn_page_examples_run() -> None:
    result = doctest.testfile(
        str(ROOT / "docs" / "nn.md"),
        module_relative=False,
        optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS,
    )
    assert result.attempted > 20
    assert result.failed == 0


def test_readme_pytorch_example_runs() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (code,) = [
        block.split("```")[0]
        for block in readme.split("```python\n")[1:]
        if "qkv.nn" in block or "from qkv.nn" in block
    ]
    namespace: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["y"].shape == (2, 100, 512)  # type: ignore[attr-defined]
    assert namespace["t"]["weights"].shape == (2, 1, 1, 100)  # type: ignore[index]


def test_benchmark_script_runs_and_prints_ratios(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location("bench_mha", ROOT / "benchmarks" / "bench_mha.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_mha", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    assert bench.main(["--lengths", "8", "16", "--repeats", "1", "--embed-dim", "16",
                       "--heads", "2", "--causal"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| L | forward torch (ms)") and len(lines) == 4
    assert lines[2].startswith("| 8 |") and lines[3].startswith("| 16 |")


def test_benchmark_script_compares_compiled_models(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--compile``: qkv's and torch's models, eager and compiled (fullgraph), in one run
    (aot_eager here: inductor's C++ compilation takes minutes on a test machine)."""
    spec = importlib.util.spec_from_file_location("bench_mha", ROOT / "benchmarks" / "bench_mha.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_mha", bench)
    spec.loader.exec_module(bench)
    assert bench.main(["--compile", "--lengths", "8", "--repeats", "1", "--embed-dim", "16",
                       "--heads", "2", "--backend", "aot_eager"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| L | mode | torch (ms) | torch compiled (ms) | qkv (ms)")
    assert [line.split("|")[1:3] for line in lines[2:]] == [
        [" 8 ", " forward "],
        [" 8 ", " fwd+bwd "],
    ]
