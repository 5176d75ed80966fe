"""``qkv train``, ``qkv evaluate`` and ``qkv explain --model``: results, errors, the guide."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from qkv import data, embeddings
from qkv.cli import main
from qkv.data.__main__ import main as data_main

ROOT = Path(__file__).resolve().parents[2]
TINY_CLASSIFY = ["--sentences", "80", "--steps", "6", "--eval-every", "3", "--quiet"]
TINY_RECALL = ["--pairs", "3", "--d-model", "16", "--heads", "2", "--validation-size", "64",
               "--steps", "6", "--eval-every", "3", "--quiet"]  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("qkv: error: ") and "Hint:" in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "classify"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    code = main(["train", "classify", "--out", str(out), "--embedding-dim", "8", *TINY_CLASSIFY])
    torch.set_num_threads(threads)
    assert code == 0
    return out


def test_train_without_a_task_prints_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "train")
    assert code == 0 and "recall" in out and "classify" in out
    code, out, _ = run(capsys, "train", "classify", "--help")
    assert code == 0 and "--fine-tune-embeddings" in out and "Examples:" in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_train_recall_evaluate_and_explain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "train", "recall", "--out", tmp_path, *TINY_RECALL)
    assert code == 0
    assert "Best validation accuracy: " in out and f"qkv evaluate {tmp_path}\n" in out
    assert {p.name for p in tmp_path.iterdir()} >= {"metrics.jsonl", "metrics.png", "best"}
    code, out, _ = run(capsys, "evaluate", tmp_path, "--samples", "50", "--json")
    report = json.loads(out)
    assert code == 0 and report["examples"] == 50 and report["task"] == "recall"
    assert sum(row["examples"] for row in report["per_class"]) == 50
    assert report["labels"] == [str(i) for i in range(10)]
    code, out, _ = run(capsys, "explain", "--model", tmp_path, "--text", "a 3 c 5 b 1 c",
                       "--format", "json")  # fmt: skip
    trace = json.loads(out)
    assert code == 0 and trace["tokens"] == ["a", "3", "c", "5", "b", "1", "c"]
    weights = next(s for s in trace["steps"] if s["name"] == "weights")
    assert weights["shape"] == [1, 2, 1, 7]  # (B, H, the query row, Lk)
    assert trace["query_tokens"] == ["c"]


def test_explain_a_trained_classifier_shows_the_words(
    classifier: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sentence = "the food was great , not awful"
    code, out, _ = run(capsys, "explain", "--model", classifier, "--text", sentence)
    assert code == 0
    assert "Trained classifier" in out and "The model predicts" in out
    header = next(line for line in out.splitlines() if line.startswith("query \\ key"))
    assert header.split()[3:6] == ["the", "food", "was"]
    code, out, _ = run(capsys, "explain", "--model", classifier, "--text", sentence,
                       "--layer", "pool", "--format", "markdown")  # fmt: skip
    assert code == 0 and "\\<pool\\>" in out and "awful" in out  # escaped: not an HTML tag
    png = tmp_path / "weights.png"
    code, _, err = run(capsys, "explain", "--model", classifier, "--text", sentence,
                       "--plot", png, "--query", "awful")  # fmt: skip
    assert code == 0 and png.read_bytes()[:4] == b"\x89PNG" and "predicts" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--text", "hello"], "needs --model RUN and --text TEXT; --model is missing"),
        (["--model", "X"], "needs --model RUN and --text TEXT; --text is missing"),
        (["--layer", "pool"], "--model and --text are missing"),
        (["--model", "X", "--text", "hi", "--example", "two-heads"], "--example cannot be"),
        (["--model", "RUN", "--text", "the food", "--layer", "nope"], "--layer 'nope' is not"),
        (["--model", "RUN", "--text", "the food", "--query", "emu"], "--query 'emu' is not"),
    ],
)
def test_explain_model_errors(
    classifier: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    argv = [str(classifier) if a == "RUN" else a for a in argv]
    code, _, err = run(capsys, "explain", *argv)
    assert code == 2 and message in one_error_line(err)


def test_explain_a_bag_of_words_says_it_has_no_attention(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, _ = run(capsys, "train", "classify", "--model", "bag-of-words", "--out", tmp_path,
                     *TINY_CLASSIFY)  # fmt: skip
    assert code == 0
    code, _, err = run(capsys, "explain", "--model", tmp_path, "--text", "the food was good")
    assert code == 2 and "has no attention to explain" in one_error_line(err)


def test_evaluate_a_classifier_per_class(
    classifier: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "evaluate", classifier, "--data", "generated")
    assert code == 0 and "held-out validation sentences (16, generated)" in out
    assert re.search(r"^negative\s+\d+\s+\d+\s+\d+\s+[\d.]+$", out, re.MULTILINE)
    path = data.sentiment(20, seed=5).to_csv(tmp_path / "test.csv")
    code, out, _ = run(capsys, "evaluate", classifier, "--data", path, "--json")
    report = json.loads(out)
    assert report["examples"] == 20 and sum(sum(r) for r in report["confusion"]) == 20


def test_evaluate_unknown_label_is_an_error(
    classifier: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "test.csv"
    path.write_text("text,label\nthe food was good,positive\nthe food was ok,neutral\n")
    code, out, err = run(capsys, "evaluate", classifier, "--data", path)
    line = one_error_line(err)
    assert code == 2 and out == ""
    assert "test.csv, line 3: the label 'neutral' is not one the model knows" in line


def test_bad_training_data_gets_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.csv"
    missing.write_text("review,label\ngood,pos\nbad,neg\n")
    code, _, err = run(capsys, "train", "classify", "--data", missing, "--out", tmp_path / "a",
                       "--quiet")  # fmt: skip
    assert code == 2 and "no column 'text'" in one_error_line(err)
    assert not (tmp_path / "a" / "checkpoints").exists()
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": "good", "label": "pos"}\n{"text": "", "label": "neg"}\n')
    code, _, err = run(capsys, "train", "classify", "--data", empty, "--quiet")
    assert code == 2 and "empty.jsonl, line 2: the text ('text') is empty" in one_error_line(err)
    code, _, err = run(capsys, "train", "recall", "--resume", "--quiet")
    assert code == 2 and "--resume needs --out DIR" in one_error_line(err)
    code, _, err = run(capsys, "train", "classify", "--freeze-embeddings", "--quiet",
                       "--out", tmp_path / "b")  # fmt: skip
    assert code == 2 and "--freeze-embeddings needs --embeddings FILE" in one_error_line(err)


def test_embedding_dimension_that_disagrees_with_the_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    vectors = embeddings.load(data.embedding_file("word2vec"))
    four = embeddings.Embeddings(vectors.words, vectors.vectors[:, :4])
    small = embeddings.save(tmp_path / "small.vec", four, "fasttext")
    out = tmp_path / "run"
    code, stdout, _ = run(capsys, "train", "classify", "--out", out, "--embeddings",
                          data.embedding_file("word2vec"), "--fine-tune-embeddings",
                          *TINY_CLASSIFY)  # fmt: skip
    assert code == 0 and "Embeddings: fine-tuned" in stdout and "Moved most:" in stdout
    report = "Embeddings:" + stdout.split("Embeddings:")[1].split("(every word")[0]
    assert max(len(line) for line in report.splitlines()) <= 80
    code, _, err = run(capsys, "train", "classify", "--out", out, "--resume", "--embeddings",
                       small, "--steps", "9", "--quiet")  # fmt: skip
    line = one_error_line(err)
    assert code == 2 and "has vectors of 4 numbers, but the checkpoint's embeddings have 16" in line


def test_truncated_checkpoint_is_a_clear_error(
    classifier: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(classifier, copy)
    (tensors,) = (copy / "best").glob("step-*/tensors.safetensors")
    tensors.write_bytes(tensors.read_bytes()[:100])
    for argv in (["evaluate", copy, "--data", "generated"],
                 ["explain", "--model", copy, "--text", "good"]):  # fmt: skip
        code, out, err = run(capsys, *argv)
        assert code == 2 and out == ""
        assert "tensors.safetensors is truncated: 100 bytes" in one_error_line(err)


def test_ctrl_c_in_the_cli_saves_and_resume_finishes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from qkv.train import _tasks

    real = _tasks.RecallTask.train_batch

    def interrupted(self: Any, step: int) -> Any:
        if step == 4:  # after 4 steps, as if Ctrl-C came while the 5th batch was drawn
            raise KeyboardInterrupt
        return real(self, step)

    monkeypatch.setattr(_tasks.RecallTask, "train_batch", interrupted)
    code, _, err = run(capsys, "train", "recall", "--out", tmp_path, *TINY_RECALL)
    assert code == 130
    assert "interrupted at step 4: saved" in err and f"--out {tmp_path} --resume" in err
    monkeypatch.undo()
    code, out, _ = run(capsys, "train", "recall", "--out", tmp_path, "--resume", "--quiet")
    assert code == 0 and "Stopped at step 6 (the last step)" in out
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [3, 6]


def _guide_commands() -> list[list[str]]:
    """The shell commands of docs/training.md's walk-through (```sh blocks), one per line."""
    text = (ROOT / "docs" / "training.md").read_text("utf-8")
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.DOTALL):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith(("qkv ", "python -m qkv.data")):
                commands.append(shlex.split(line))
    return commands


def test_the_guide_commands_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every command of the guide runs, on tiny settings appended to the training ones."""
    monkeypatch.chdir(tmp_path)
    commands = _guide_commands()
    assert len(commands) >= 8
    tiny = {"recall": TINY_RECALL, "classify": TINY_CLASSIFY}
    for argv in commands:
        if argv[0] == "python":
            assert data_main([*argv[3:], "--sentences", "80"]) == 0, argv
            continue
        args = argv[1:]
        if args[:1] == ["train"]:
            args += tiny[args[1]]
        code = main(args)
        capsys.readouterr()
        assert code == 0, argv


def test_the_benchmark_runs_quickly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location(
        "bench_train", ROOT / "benchmarks" / "bench_train.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_train"] = bench
    try:
        spec.loader.exec_module(bench)
        assert bench.main(["--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    finally:
        del sys.modules["bench_train"]
    out = capsys.readouterr().out
    assert "## Associative recall" in out and "| bag-of-words | learned |" in out
    assert "attention" in out.splitlines()[-2]


def test_the_guide_python_example_runs() -> None:
    import doctest

    result = doctest.testfile(
        str(ROOT / "docs" / "training.md"),
        module_relative=False,
        optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS,
    )
    assert result.attempted >= 5
    assert result.failed == 0
