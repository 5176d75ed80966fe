"""What a newcomer meets on the command line (issue 12, items 14 to 17): a missing extra is one
line, options that say what they did, outputs checked before minutes of work, and
``qkv bench --quick`` that leaves the tracked docs alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qkv.bench import _suite
from qkv.cli import main

TINY = _suite.Settings(
    lengths=(64,),
    mask_length=512,
    long_length=512,
    decode_length=256,
    trace_length=128,
    repeats=1,
    quick=True,
)
TINY_RECALL = ["--pairs", "3", "--d-model", "16", "--heads", "2", "--validation-size", "32",
               "--steps", "4", "--eval-every", "2", "--quiet"]  # fmt: skip

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def _plain_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("qkv: error: ") and "Hint:" in lines[0], lines[0]
    assert "Traceback" not in err
    return lines[0]


def run_without(
    tmp_path: Path, modules: tuple[str, ...], *argv: str
) -> subprocess.CompletedProcess[str]:
    """Run ``qkv ARGV`` in a fresh Python where importing ``modules`` fails, as when the
    extra that installs them is absent (a ``sitecustomize`` puts None in sys.modules)."""
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules),
        encoding="utf-8",
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), *sys.path])}
    for name in ("COLUMNS", "FORCE_COLOR"):
        env.pop(name, None)
    code = f"import sys; from qkv.cli import main; sys.exit(main({list(argv)!r}))"
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )


# -- 14: without PyTorch ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [["train", "recall", "--steps", "1"], ["bench", "--quick", "--no-write"]],
    ids=["train", "bench"],
)
def test_train_and_bench_without_torch_say_so_in_one_line(tmp_path: Path, argv: list[str]) -> None:
    result = run_without(tmp_path, ("torch",), *argv)
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert "needs torch" in line and "qkv[torch]" in line


def test_a_plot_without_matplotlib_names_the_option_and_the_extra(tmp_path: Path) -> None:
    result = run_without(tmp_path, ("matplotlib",), "explain", "--plot", "w.png")
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert line.startswith("qkv: error: --plot") and "qkv[viz]" in line
    assert list(tmp_path.glob("*.png")) == []


# -- 15: say what was written ----------------------------------------------------------------


def test_train_without_matplotlib_does_not_claim_the_plot(tmp_path: Path) -> None:
    result = run_without(tmp_path, ("matplotlib",), "train", "recall", "--out", "run", *TINY_RECALL)
    assert result.returncode == 0, result.stderr
    assert "metrics.png" not in result.stdout.split("Wrote")[1].splitlines()[0]
    assert "Skipped metrics.png: matplotlib is not installed; needs qkv[viz]." in result.stdout
    assert not (tmp_path / "run" / "metrics.png").exists()
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_bench_without_matplotlib_writes_the_tables_and_says_the_plots_are_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_suite.Settings, "quick_run", classmethod(lambda cls: TINY))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    page = tmp_path / "bench.md"
    assert main(["bench", "--quick", "--only", "dense", "-o", str(page)]) == 0
    err = capsys.readouterr().err
    assert "plots skipped: matplotlib is not installed; needs qkv[viz]" in err
    text = page.read_text(encoding="utf-8")
    assert "| 64 | dense |" in text and "img/bench-dense.png" not in text
    assert not (tmp_path / "img" / "bench-dense.png").exists()


def test_the_progress_bar_shows_the_last_evaluation() -> None:
    from qkv.train._loop import _Bar

    with _Bar(True, 10, 0, "recall") as bar:
        bar.evaluated({"val_accuracy": 0.5})
        assert bar.progress.tasks[0].fields["val"] == "0.5000"


def _saved_trace(tmp_path: Path) -> Path:
    import qkv

    trace = qkv.examples.run(qkv.examples.resolve("i-love-statistics"))
    path = tmp_path / "trace.json"
    trace.save(path)
    return path


@pytest.mark.parametrize("query", ["7", "-4", "nobody"])
def test_a_query_the_trace_did_not_record_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], query: str
) -> None:
    assert main(["explain", "--trace", str(_saved_trace(tmp_path)), "--query", query]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"--query {query}" in line and "0 I, 1 love, 2 statistics" in line


def test_a_recorded_query_of_a_trace_is_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["explain", "--trace", str(_saved_trace(tmp_path)), "--query", "-1"]) == 0
    assert 'query "statistics"' in capsys.readouterr().out


# -- 16: friction ----------------------------------------------------------------------------


def test_bench_checks_its_output_before_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def measured(*args: object, **kwargs: object) -> None:
        pytest.fail("measured before the output was checked")

    monkeypatch.setattr(_suite, "run_suite", measured)
    monkeypatch.setattr(_suite, "gemm_rate", measured)
    real_access = os.access
    monkeypatch.setattr(  # a read-only folder (chmod does not stop root)
        os,
        "access",
        lambda path, mode: False if Path(path) == tmp_path else real_access(path, mode),
    )
    assert main(["bench", "--quick", "-o", str(tmp_path / "bench.md")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--output" in line and "bench.md" in line and "not writable" in line


def test_bench_quick_leaves_the_tracked_page_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_suite.Settings, "quick_run", classmethod(lambda cls: TINY))
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "benchmarks.md"
    page.write_text("# Benchmarks\n\nthe full run's numbers\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--quick", "--only", "trace"]) == 0
    err = capsys.readouterr().err
    assert page.read_text(encoding="utf-8") == "# Benchmarks\n\nthe full run's numbers\n"
    assert not (tmp_path / "docs" / "img").exists()
    assert "not written" in err and "--output" in err


def test_plot_step_masked_without_a_mask_says_how_to_get_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    picture = tmp_path / "never.png"
    assert main(["explain", "--plot", str(picture), "--plot-step", "masked"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("qkv: error: --plot-step masked") and "--causal" in line
    assert not picture.exists()


def test_steps_keeps_only_the_steps_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--steps", "weights,context"]) == 0
    short = capsys.readouterr().out
    assert main(["explain"]) == 0
    full = capsys.readouterr().out
    assert "Attention weights" in short and "Context vectors" in short
    assert "Query vectors" not in short and "Query vectors" in full
    assert len(short.splitlines()) < len(full.splitlines()) / 2


def test_steps_names_an_unknown_step(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--steps", "weights,wieghts"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--steps" in line and "'wieghts'" in line and "context" in line


def test_a_trained_model_explained_with_a_step_filter(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "recall"
    assert main(["train", "recall", "--out", str(run), *TINY_RECALL]) == 0
    capsys.readouterr()
    argv = ["explain", "--model", str(run), "--text", "a 3 c 5 b 1 c", "--steps", "weights"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Attention weights" in out and "Token embeddings" not in out
    assert len(out.splitlines()) < 120
    assert main([*argv[:5], "--query", "99"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("qkv: error: --query 99") and "0 to 6" in line


# -- 17: polish ------------------------------------------------------------------------------


def test_a_negative_query_counts_from_the_end(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--query", "-1"]) == 0
    assert 'for the query "statistics"' in capsys.readouterr().out
    assert main(["explain", "--query", "-4"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("qkv: error: --query -4") and "from -3 to -1" in line


def test_a_query_error_names_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--query", "nobody"]) == 2
    assert one_error_line(capsys.readouterr().err).startswith("qkv: error: --query")
