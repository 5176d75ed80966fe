"""Issue 12, items 9, 10, 12 and 13: every file qkv reads gives one clear error, never a
traceback, a crash or a hang, and valid JSON Lines with U+2028 is read.

Each test names the file, the field and what was expected in its assertions; each failed
before the fix (a traceback type, an allocation of terabytes, a hang or a refusal).
"""

from __future__ import annotations

import copy
import gzip
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from qkv import data, examples
from qkv.cli import main
from qkv.embeddings import EmbeddingsFileError
from qkv.embeddings import _source as embedding_source
from qkv.embeddings import load as load_embeddings
from qkv.examples import ExampleError
from qkv.trace import Trace, TraceFileError
from qkv.train import CheckpointError, load_trained
from qkv.train._text import DataError, read_labelled

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = """tokens: [a, b]
embeddings: [[1, 0], [0, 1]]
weights: {W_q: [[1], [0]], W_k: [[1], [1]], W_v: [[1], [2]]}
"""
BIG = "1" + "0" * 400  # a 401-digit whole number
TINY_CLASSIFY = ["--sentences", "80", "--steps", "6", "--eval-every", "3", "--quiet"]


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``qkv ARGV``; it must exit 2 with one line ``qkv: error: ...`` on stderr."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("qkv: error: "), err
    return lines[0]


def isolated(code: str, *, seconds: float = 60) -> subprocess.CompletedProcess[str]:
    """Run Python ``code`` in a child with 2 GiB of address space and a time limit: what
    hung or filled the memory before the fix is a failure here, not a stuck test run."""
    prologue = "import resource; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
    return subprocess.run(
        [sys.executable, "-c", prologue + code],
        capture_output=True,
        text=True,
        timeout=seconds,
    )


# -- worked examples (item 9: 8 tracebacks; item 13: fields with odd tags) ------------------


@pytest.mark.parametrize(
    ("text", "field", "problem"),
    [
        (BASE.replace("[[1, 0]", f"[[{BIG}, 0]"), "embeddings[0][0]", "finite number"),
        (BASE + f"options: {{scale: {BIG}}}\n", "options.scale", "finite number"),
        (BASE + f"x-big: {BIG}\n", "x-big", "at most 20 digits"),
        (BASE + "x-loop: &a [*a]\n", "x-loop[0]", "contains itself"),
        (BASE + "x-name: !!python/name:os.system\n", "x-name", "!!python/name:os.system"),
        (BASE + "x-obj: !!python/object/apply:os.system [ls]\n", "x-obj", "unsupported YAML tag"),
        (BASE + "x-custom: !mine value\n", "x-custom", "unsupported YAML tag !mine"),
        (BASE + "x-date: !!timestamp 2001-13-45\n", "x-date", "!!timestamp"),
        (BASE + "heads: !!int 1.5\n", "heads", "!!int"),
        (BASE.replace("[[1, 0]", "[[!!float abc, 0]"), "embeddings[0][0]", "!!float"),
        (BASE + "options: {causal: !!bool maybe}\n", "options.causal", "!!bool"),
    ],
)
def test_example_field_errors_name_the_field(text: str, field: str, problem: str) -> None:
    with pytest.raises(ExampleError) as info:
        examples.loads(text, source="ex.yaml")
    assert info.value.field == field and info.value.line is not None
    assert problem in str(info.value) and str(info.value).startswith("ex.yaml, line ")
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


@pytest.mark.parametrize("kind", ["json", "yaml"])
def test_example_nested_thousands_deep_is_one_error(kind: str) -> None:
    deep = "[" * 20_000 + "]" * 20_000
    text = f'{{"tokens": {deep}}}' if kind == "json" else f"tokens: {deep}\n"
    with pytest.raises(ExampleError, match="nested too deeply"):
        examples.loads(text, source=f"ex.{kind}")


@pytest.mark.parametrize("query", ["²", "①", "³"])
def test_superscript_digit_query_names_the_query(query: str) -> None:
    example = examples.loads(BASE, source="ex.yaml")
    with pytest.raises(ValueError, match=r"^query: unknown token"):
        examples.run(example, query=query)
    with pytest.raises(ExampleError) as info:
        examples.loads(BASE + f"options: {{queries: ['{query}']}}\n", source="ex.yaml")
    assert info.value.field == "options.queries[0]" and "unknown token" in info.value.problem


def test_cli_superscript_query_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line_error(capsys, ["explain", "--query", "²"])
    assert "--query" in line and "unknown token '²'" in line


def test_example_that_is_no_regular_file_or_too_large(tmp_path: Path) -> None:
    with pytest.raises(ExampleError, match="not a regular file"):
        examples.load("/dev/null")
    big = tmp_path / "big.yaml"
    big.write_text(BASE + "x-pad: " + "a" * (2 << 20) + "\n")
    with pytest.raises(ExampleError, match=r"more than the 1\.0 MB a worked example"):
        examples.load(big)


def test_example_from_dev_zero_is_refused_at_once() -> None:
    done = isolated("from qkv import examples\nexamples.load('/dev/zero')", seconds=30)
    assert "ExampleError" in done.stderr and "not a regular file" in done.stderr


# -- saved traces (item 9: 7 tracebacks) ---------------------------------------------------


def _good_trace() -> dict[str, Any]:
    trace: dict[str, Any] = examples.run(examples.resolve("i-love-statistics")).to_dict()
    return trace


def _with(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    trace = copy.deepcopy(_good_trace())
    change(trace)
    return trace


@pytest.mark.parametrize(
    ("data", "field", "expected"),
    [
        ([1, 2], None, "expected a JSON object"),
        ("text", None, "expected a JSON object"),
        (_with(lambda t: t.update(steps={"Q": 1})), "steps", "expected a list of steps"),
        (_with(lambda t: t["steps"].__setitem__(0, 7)), "steps[0]", "expected an object"),
        (
            _with(lambda t: t["steps"][0].update(dtype="int8", value=[1000] * 9)),
            "steps[0].value[0]",
            "from -128 to 127",
        ),
        (_with(lambda t: t.update(tokens=[1, None, {}])), "tokens[0]", "expected a text"),
        (_with(lambda t: t["steps"][0].update(shape=[10**12, 10**12])), "steps[0].value", "got 9"),
        (_with(lambda t: t["steps"][0].update(dtype="object")), "steps[0].dtype", "dtype"),
        (_with(lambda t: t["steps"][0].update(axes=["x"])), "steps[0].axes", "1 axis names"),
        (_with(lambda t: t["steps"][0].update(name="nope")), "steps[0].name", "unknown step"),
        (_with(lambda t: t["steps"][0].update(value="x")), "steps[0].value", "got 1"),
        (_with(lambda t: t["meta"].update(num_heads="2")), "meta.num_heads", "whole number"),
        (_with(lambda t: t.pop("steps")), None, "'steps' is missing"),
    ],
)
def test_invalid_trace_names_the_field(data: Any, field: str | None, expected: str) -> None:
    with pytest.raises(TraceFileError) as info:
        Trace.from_json(json.dumps(data))
    assert info.value.field == field and expected in str(info.value)


def test_trace_nested_thousands_deep_and_not_json(tmp_path: Path) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(TraceFileError, match=r"deep\.json: the JSON is nested too deeply"):
        Trace.load(path)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(TraceFileError, match="not UTF-8"):
        Trace.load(path)


def test_saved_trace_still_round_trips(tmp_path: Path) -> None:
    trace = examples.run(examples.resolve("two-heads"))
    trace.save(tmp_path / "t.json")
    again = Trace.load(tmp_path / "t.json")
    assert again.names == trace.names and again.tokens == trace.tokens
    for a, b in zip(again, trace, strict=True):
        np.testing.assert_array_equal(a.value, b.value)
        assert a.value.dtype == b.value.dtype and a.axes == b.axes


@pytest.mark.parametrize(
    "content", ["[1, 2]", '"text"', json.dumps(_with(lambda t: t.update(tokens=[1, 2, 3])))]
)
def test_cli_bad_trace_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str
) -> None:
    path = tmp_path / "trace.json"
    path.write_text(content)
    assert "trace.json" in one_line_error(capsys, ["explain", "--trace", str(path)])


def test_trace_from_dev_zero_is_refused_at_once() -> None:
    done = isolated("from qkv.trace import Trace\nTrace.load('/dev/zero')", seconds=30)
    assert "TraceFileError" in done.stderr and "not a regular file" in done.stderr


# -- word vectors (item 9: truncated .gz; item 10: claimed sizes, gzip bombs) --------------


def test_truncated_gzip_is_one_error(tmp_path: Path) -> None:
    raw = gzip.compress(data.embedding_file("word2vec").read_bytes())
    path = tmp_path / "vectors.txt.gz"
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(EmbeddingsFileError, match="gzip data is truncated or damaged"):
        load_embeddings(path)


@pytest.mark.parametrize(
    "content",
    [
        b"1000000000000 3\nword 1 2 3\n",
        b"1000000000000 3\nword " + struct.pack("<3f", 1, 2, 3),
    ],
)
@pytest.mark.parametrize("packed", [False, True])
def test_header_claiming_a_trillion_rows_allocates_nothing(
    tmp_path: Path, content: bytes, packed: bool
) -> None:
    path = tmp_path / ("v.gz" if packed else "v.bin")
    path.write_bytes(gzip.compress(content) if packed else content)
    with pytest.raises(EmbeddingsFileError, match="the file ends after 1 vectors"):
        load_embeddings(path)


def test_header_claiming_a_billion_dimensions_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "v.txt"
    path.write_bytes(b"1 1000000000\nword 1 2 3\n")
    with pytest.raises(EmbeddingsFileError, match=r"DIM = 1,000,000,000 numbers; qkv reads"):
        load_embeddings(path)


def test_gzip_bomb_stops_with_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedding_source, "GZIP_FLOOR", 1 << 20)
    path = tmp_path / "bomb.gz"
    path.write_bytes(gzip.compress(b"3 2\n" + b"\n" * (8 << 20)))
    with pytest.raises(EmbeddingsFileError, match="unpacks to more than"):
        load_embeddings(path)


def test_embeddings_from_a_device_are_refused() -> None:
    with pytest.raises(EmbeddingsFileError, match="not a regular file"):
        load_embeddings("/dev/zero")


# -- data files (item 9: deep JSONL; item 10: /dev/zero; item 12: U+2028) ------------------


def test_json_lines_with_line_separators_inside_strings(tmp_path: Path) -> None:
    path = tmp_path / "reviews.jsonl"
    rows = [
        {"text": "good\u2028film", "label": "pos"},
        {"text": "dull\u2029film", "label": "neg"},
        {"text": "fine\x85\x1cfilm", "label": "pos"},
    ]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    read = read_labelled(path)
    assert read.texts == tuple(r["text"] for r in rows) and read.lines == (1, 2, 3)


def test_deep_json_lines_is_one_error(tmp_path: Path) -> None:
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": "fine", "label": "pos"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(DataError, match=r"deep\.jsonl, line 2: the JSON is nested too deeply"):
        read_labelled(path)


def test_data_file_from_dev_zero_is_refused_at_once(tmp_path: Path) -> None:
    link = tmp_path / "zero.csv"
    link.symlink_to("/dev/zero")
    code = f"from qkv.train._text import read_labelled\nread_labelled({str(link)!r})"
    done = isolated(code, seconds=30)
    assert "DataError" in done.stderr and "not a regular file" in done.stderr


# -- checkpoints (item 9: 15 tracebacks; item 10: a vocabulary of 10¹²) --------------------


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "classify"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    code = main(["train", "classify", "--out", str(out), "--embedding-dim", "8", *TINY_CLASSIFY])
    torch.set_num_threads(threads)
    assert code == 0
    return out


def _edit_run(
    run: Path,
    manifest: Callable[[dict[str, Any]], None] | None = None,
    tensors: Callable[[dict[str, torch.Tensor]], None] | None = None,
    state: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> None:
    """Change every checkpoint of ``run``; tensor files get their new size and SHA-256."""
    for step in (p.parent for p in run.rglob("checkpoint.json")):
        saved = json.loads((step / "checkpoint.json").read_text())
        for file, change in (("tensors.safetensors", tensors), ("state.safetensors", state)):
            if change is not None:
                values = load_safetensors((step / file).read_bytes())
                change(values)
                raw = save_safetensors(values)
                (step / file).write_bytes(raw)
                saved["files"][file] = {
                    "bytes": len(raw),
                    "sha256": hashlib.sha256(raw).hexdigest(),
                }
        if manifest is not None:
            manifest(saved)
        (step / "checkpoint.json").write_text(json.dumps(saved))


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(manifest: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        node = manifest
        for key in parents:
            node = node[key]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value

    return change


_DELETE = object()


def _wrong_moment(values: dict[str, torch.Tensor]) -> None:
    name = next(n for n in values if "exp_avg" in n)
    values[name] = torch.zeros(values[name].numel() + 1)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"manifest": _set("files", [])}, "files: expected an object"),
        ({"manifest": _set("files/tensors.safetensors/bytes", _DELETE)}, "bytes: expected"),
        ({"manifest": _set("files/tensors.safetensors/bytes", "12")}, "bytes: expected"),
        ({"manifest": _set("files/state.safetensors/sha256", 5)}, "sha256: expected"),
        ({"manifest": _set("step", "six")}, "step: expected a whole number"),
        ({"manifest": _set("config/model/embedding_dim", -8)}, "embedding_dim: expected"),
        ({"manifest": _set("config/task", "dance")}, "config.task: expected 'classify'"),
        ({"manifest": _set("config/model", _DELETE)}, "the key 'model' is missing"),
        ({"manifest": _set("config/data/labels", "pos")}, "data.labels: expected a list"),
        ({"manifest": _set("config/model/vocab_size", 10**12)}, "vocab_size: expected at most"),
        (
            {"manifest": _set("state/optimizer/state", {"__int_keys__": [["x", {}]]})},
            "state: a saved value cannot be read back",
        ),
        ({"tensors": lambda t: t.update(extra=torch.zeros(3))}, "extra"),
    ],
)
@pytest.mark.parametrize("command", ["evaluate", "resume"])
def test_damaged_checkpoint_is_one_line(
    run_folder: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    change: dict[str, Any],
    expected: str,
    command: str,
) -> None:
    run = tmp_path / "run"
    shutil.copytree(run_folder, run)
    _edit_run(run, **change)
    argv = (
        ["evaluate", str(run), "--data", "generated"]
        if command == "evaluate"
        else ["train", "classify", "--out", str(run), "--resume", "--steps", "9", "--quiet"]
    )
    line = one_line_error(capsys, argv)
    assert expected in line and str(run) in line and "Hint:" in line


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"manifest": _set("state/loop/bogus", 1)}, "unknown 'bogus'"),
        ({"manifest": _set("state/loop/seen", _DELETE)}, "missing 'seen'"),
        ({"manifest": _set("state/rng", _DELETE)}, "rng: expected an object"),
        ({"manifest": _set("state/rng/python", [1])}, "random generator states"),
        ({"state": _wrong_moment}, "the shape of its parameter"),
    ],
)
def test_damaged_resume_state_is_one_line(
    run_folder: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    change: dict[str, Any],
    expected: str,
) -> None:
    run = tmp_path / "run"
    shutil.copytree(run_folder, run)
    _edit_run(run, **change)
    argv = ["train", "classify", "--out", str(run), "--resume", "--steps", "9", "--quiet"]
    assert expected in one_line_error(capsys, argv)


def test_huge_vocabulary_allocates_nothing(run_folder: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(run_folder, run)
    _edit_run(run, manifest=_set("config/model/vocab_size", 10**12))
    with pytest.raises(CheckpointError, match=r"config\.model\.vocab_size"):
        load_trained(run)


def test_checkpoint_file_size_is_checked_before_reading(run_folder: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(run_folder, run)
    for tensors in run.rglob("tensors.safetensors"):
        with tensors.open("ab") as handle:
            handle.truncate(64 << 30)  # a sparse 64 GiB file: reading it would fill the memory
    with pytest.raises(CheckpointError, match="longer than saved"):
        load_trained(run)
    assert os.path.getsize(next(run.rglob("tensors.safetensors"))) == 64 << 30


def test_example_with_too_many_tokens_is_one_error() -> None:
    count = 20_000  # the (L, L) steps would need 3.2 GB each, and the explanation is endless
    text = "tokens: [" + ", ".join(["a"] * count) + "]\nembeddings: [" + "[1], " * count
    text += "]\nweights: {W_q: [[1]], W_k: [[1]], W_v: [[1]]}\n"
    with pytest.raises(ExampleError, match=r"tokens: expected at most 2,048 tokens, got 20,000"):
        examples.loads(text, source="long.yaml")


def test_damaged_metrics_log_is_one_line(
    run_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(run_folder, run)
    with (run / "metrics.jsonl").open("a") as handle:
        handle.write("[1, 2]\n")
    argv = ["train", "classify", "--out", str(run), "--resume", "--steps", "9", "--quiet"]
    line = one_line_error(capsys, argv)
    assert "metrics.jsonl, line 3: expected a JSON object" in line
