"""Issue 24, item 3: nothing from a file reaches the terminal raw.

Every file qkv reads (worked examples of both formats, traces, checkpoints, labelled data,
word vectors, model folders) and the file names themselves carry the characters a terminal
acts on: ESC sequences (``ESC ] 0 ; title BEL`` sets the window title, ``CSI 2 J`` clears
the screen), BEL, CR (the rest of the line overwrites its start), NUL, C1 controls, and the
bidirectional controls of Trojan Source (U+202E, U+2066..U+2069). Each error path that
quotes the file's text must print it escaped (``\\x1b``, ``\\u202e``), through the one
function :func:`qkv._format.visible`. Before the fix a format-2 key ``"\\e]0;PWNED\\a"`` set
the terminal's title, a bidi override reordered the error line, and so on for the other
paths marked below.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from qkv._format import visible
from qkv.cli import main
from tests.support.runs import edit_config, tiny_run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAYLOAD = "\x1b]0;PWNED\x07\r\u202e\u2066\u2067\u2068\u2069\x00\x85\x9b2J"
"""ESC ] 0 ; PWNED BEL (sets the terminal's title), CR, RLO, the four isolates, NUL, NEL
and CSI (the C1 controls), one of each."""

YAML_PAYLOAD = '"\\e]0;PWNED\\a\\r\\u202e\\u2066\\u2067\\u2068\\u2069\\0\\N\\x9b2J"'
"""The same characters, as a YAML double-quoted string."""

RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""What must never be printed: every control character but the line feed, and the
bidirectional controls."""

QKV = "tokens: [a, b]\ninputs: {Q: [[1, 0], [0, 1]], K: [[1, 0], [0, 1]], V: [[1, 0], [0, 1]]}\n"
FORMAT_1 = "tokens: [a, b]\nembeddings: [[1, 0], [0, 1]]\n"
FORMAT_1_WEIGHTS = "weights: {W_q: [[1], [0]], W_k: [[1], [1]], W_v: [[1], [2]]}\n"


def shown(capsys: pytest.CaptureFixture[str], argv: list[str], status: int = 2) -> str:
    """Run ``qkv ARGV``: what it printed, checked to hold no raw control character and the
    payload escaped (so that the path really quoted it)."""
    code = main(argv)
    out, err = capsys.readouterr()
    printed = out + err
    assert code == status, printed
    found = RAW.search(printed)
    assert found is None, f"{found.group(0)!r} reached the terminal: {printed!r}"
    assert "\\u202e\\u2066" in printed, printed
    return printed


def write(folder: Path, name: str, text: str) -> str:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return str(path)


# -- worked examples ---------------------------------------------------------------------

EXAMPLES = {
    # before the fix: raw in the field and in the message of each of these
    "a format-2 key": f"format: 2\n{QKV}{YAML_PAYLOAD}: 1\n",
    "a claimed token": f"format: 2\n{QKV}claimed:\n  weights:\n    {YAML_PAYLOAD}: [0.5, 0.5]\n",
    "an assumed token": f"format: 2\n{QKV}assumed:\n  weights:\n    {YAML_PAYLOAD}: [0.5, 0.5]\n",
    "an options key": f"format: 2\n{QKV}options:\n  {YAML_PAYLOAD}: 1\n",
    "a format-1 weights key": f"{FORMAT_1}weights: {{W_q: [[1], [0]], {YAML_PAYLOAD}: 1}}\n",
    "a format-1 claimed token": f"{FORMAT_1}{FORMAT_1_WEIGHTS}claimed:\n  weights:\n"
    f"    {YAML_PAYLOAD}: [0.5, 0.5]\n",
    "a text for a number": f"{FORMAT_1}{FORMAT_1_WEIGHTS}heads: {YAML_PAYLOAD}\n",
}


@pytest.mark.parametrize("text", EXAMPLES.values(), ids=EXAMPLES.keys())
@pytest.mark.parametrize("command", ["check", "explain"])
def test_example_errors_quote_the_file_escaped(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, command: str
) -> None:
    shown(capsys, [command, "--example", write(tmp_path, "ex.yaml", text)])


def test_query_error_lists_the_files_tokens_escaped(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    text = f"format: 2\ntokens: [a, {YAML_PAYLOAD}]\n" + QKV.split("\n", 1)[1]
    path = write(tmp_path, "ex.yaml", text)
    assert "the tokens are" in shown(capsys, ["explain", "--example", path, "--query", "zz"])


def test_a_file_name_is_escaped(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = write(tmp_path, PAYLOAD.replace("\x00", "") + ".yaml", "tokens: [a\n")
    shown(capsys, ["check", "--example", bad])  # an error of the file's content
    missing = str(tmp_path / (PAYLOAD.replace("\x00", "") + "-missing.yaml"))
    shown(capsys, ["check", "--example", missing])  # no such file: an OSError


# -- traces -------------------------------------------------------------------------------


def _trace(tmp_path: Path) -> dict[str, Any]:
    path = tmp_path / "good.json"
    assert main(["explain", "--format", "json", "-o", str(path)]) == 0
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def _index_key(data: dict[str, Any]) -> None:
    data["steps"][0]["index"] = {PAYLOAD: "x"}


def _step_name(data: dict[str, Any]) -> None:
    data["steps"][0]["name"] = PAYLOAD


@pytest.mark.parametrize("change", [_index_key, _step_name])
def test_trace_errors_quote_the_file_escaped(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, change: Callable[[dict[str, Any]], None]
) -> None:
    data = _trace(tmp_path)
    change(data)
    capsys.readouterr()
    path = write(tmp_path, "trace.json", json.dumps(data))
    shown(capsys, ["explain", "--trace", path])


def test_trace_tokens_reach_the_terminal_escaped(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    data = _trace(tmp_path)
    data["tokens"] = [PAYLOAD, "b", "c"]
    capsys.readouterr()
    path = write(tmp_path, "trace.json", json.dumps(data))
    shown(capsys, ["explain", "--trace", path], status=0)
    shown(capsys, ["explain", "--trace", path, "--query", "zz"])  # the tokens, listed


# -- labelled data and word vectors --------------------------------------------------------


def test_data_file_errors_quote_the_file_escaped(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    csv = write(tmp_path, "data.csv", f"words,{PAYLOAD.replace(chr(13), '')}\nhi,pos\n")
    argv = ["train", "classify", "--out", str(tmp_path / "run"), "--quiet", "--data", csv]
    assert "no column 'text'" in shown(capsys, argv)


def test_word_vector_errors_quote_the_file_escaped(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    word = PAYLOAD.replace("\r", "").replace("\x85", "").replace("\x00", "")
    vectors = write(tmp_path, "v.txt", f"2 3\ncat 1 2 3\n{word} 1 2\n")
    argv = ["train", "classify", "--out", str(tmp_path / "run"), "--quiet"]
    argv += ["--data", "generated", "--embeddings", vectors]
    shown(capsys, argv)


# -- checkpoints ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_run(tmp_path_factory.mktemp("runs") / "classify", "classify")


def test_checkpoint_labels_reach_the_terminal_escaped(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, run_folder: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(run_folder, run)

    def labels(config: dict[str, Any]) -> None:
        config["data"]["labels"] = [PAYLOAD + str(i) for i in range(len(config["data"]["labels"]))]

    edit_config(run, labels)
    capsys.readouterr()
    line = shown(capsys, ["evaluate", str(run), "--data", "generated", "--sentences", "20"])
    assert "is not one the model knows" in line
    html = str(tmp_path / "page.html")
    argv = ["explain", "--model", str(run), "--text", "the food was great", "--html", html]
    assert "the model predicts" in shown(capsys, argv, status=0)


def test_a_data_file_label_the_model_does_not_know_is_escaped(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, run_folder: Path
) -> None:
    rows = [{"text": "the food was great", "label": PAYLOAD}]
    data = write(tmp_path, "data.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    line = shown(capsys, ["evaluate", str(run_folder), "--data", data])
    assert "is not one the model knows" in line


def test_checkpoint_errors_quote_the_file_escaped(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, run_folder: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(run_folder, run)

    def vocabulary(config: dict[str, Any]) -> None:
        config["data"]["vocabulary"] = [PAYLOAD, 3]

    edit_config(run, vocabulary)
    capsys.readouterr()
    shown(capsys, ["evaluate", str(run), "--data", "generated"])


# -- model folders -------------------------------------------------------------------------


def test_model_folder_errors_quote_the_folder_escaped(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    folder = tmp_path / PAYLOAD.replace("\x00", "")
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": PAYLOAD}))
    shown(capsys, ["explain", "--hf", str(folder), "--text", "the cat"])


def test_visible_escapes_every_character_a_terminal_acts_on() -> None:
    text = visible(PAYLOAD + "\ud800")
    assert RAW.search(text) is None and "\ud800" not in text
    assert text == "\\x1b]0;PWNED\\x07\\r\\u202e\\u2066\\u2067\\u2068\\u2069\\x00\\x85\\x9b2J" + (
        "\\ud800"
    )
    assert visible(text) == text  # escaping twice changes nothing
    text.encode("utf-8")  # no lone surrogate left: it can be written to any terminal
