"""``qkv check --function FILE.py:NAME --kind flash``: the student's FlashAttention runs in
the sandboxed process (tests/check/flash_students.py's files), both conventions, the
backward through the runner's ``flash`` request, and the one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qkv.check import FunctionError, check_flash_file
from qkv.cli import main
from tests.check import flash_students as students

pytest.importorskip("torch")


def _write(folder: Path, code: str, text: str | None = None) -> str:
    name, source = students.SUBMISSIONS[code]
    path = folder / f"{code or 'right'}.py"
    path.write_text(source if text is None else text, encoding="utf-8")
    return f"{path}:{name}"


@pytest.mark.parametrize(
    "code", ["", "flash-backward-D", "flash-empty-tile-nan", "flash-raised", "flash-causal-ignored"]
)
def test_a_file_is_checked_as_in_process(tmp_path: Path, code: str) -> None:
    report = check_flash_file(_write(tmp_path, code), timeout=60)
    assert [f.diagnosis for f in report.findings] == ([code] if code else [])
    assert report.isolation in ("bubblewrap", "namespaces")


def test_the_command_names_the_slip_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = _write(tmp_path, "flash-lse-wrong-base")
    assert main(["check", "--function", target, "--kind", "flash", "--format", "json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [f["diagnosis"] for f in data["findings"]] == ["flash-lse-wrong-base"]
    assert data["findings"][0]["step"] == "lse"


def test_the_cs336_contract_passes_a_part_a_submission(tmp_path: Path) -> None:
    target = _write(tmp_path, "flash-causal-ignored")
    argv = ["check", "--function", target, "--kind", "flash"]
    assert main([*argv, "--contract", "cs336"]) == 0
    assert main(argv) == 1


def test_torch_compile_runs_eagerly_in_the_sandbox(tmp_path: Path) -> None:
    text = (
        "import os\nimport torch\n\n\n"
        "def flash(Q, K, V, is_causal=False):\n"
        "    assert os.environ.get('TORCHDYNAMO_DISABLE') == '1'\n"
        "    return torch.compile(torch.nn.functional.scaled_dot_product_attention)("
        "Q, K, V, is_causal=is_causal)\n"
    )
    path = tmp_path / "compiled.py"
    path.write_text(text, encoding="utf-8")
    assert check_flash_file(f"{path}:flash", timeout=60).ok


def test_a_file_that_always_raises_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "todo.py"
    path.write_text("def flash(Q, K, V, is_causal=False):\n    raise ValueError('\\x1b[31m')\n")
    with pytest.raises(FunctionError, match=r"ValueError: \\x1b\[31m on every probe"):
        check_flash_file(f"{path}:flash")
    assert main(["check", "--function", f"{path}:flash", "--kind", "flash"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "\x1b" not in err


def test_options_of_other_kinds_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = _write(tmp_path, "")
    assert main(["check", "--function", target, "--kind", "flash", "--batched"]) == 2
    assert "--batched does not go with --kind flash" in capsys.readouterr().err
    assert main(["check", "--function", target, "--contract", "cs336"]) == 2
    assert "--contract goes with --kind flash" in capsys.readouterr().err


def test_an_output_larger_than_any_probes_is_refused_with_its_shape(tmp_path: Path) -> None:
    path = tmp_path / "huge.py"
    path.write_text(
        "import torch\n\n\ndef flash(Q, K, V, is_causal=False):\n"
        "    return torch.zeros(1000, 1000), torch.zeros(Q.shape[:-1])\n"
    )
    with pytest.raises(FunctionError, match=r"returned an array of shape \(1000, 1000\)"):
        check_flash_file(f"{path}:flash", timeout=60)


def test_module_takes_an_autograd_function_as_function_does(tmp_path: Path) -> None:
    assert main(["check", "--module", _write(tmp_path, ""), "--kind", "flash"]) == 0
    assert main(["check", "--module", _write(tmp_path, "flash-no-rescale"), "--kind", "flash"]) == 1
