"""The student's process imports torch before the student's time starts only for code that
uses it (a NumPy file starts in a fifth of a second instead of 1.7 s): the file names torch,
the probes are tensors, or the kind is a class or FlashAttention.

Each file asserts at import what it finds in ``sys.modules``; a wrong guess fails its load,
and the check then reports the file's error instead of a verdict.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from qkv.check import check_function_file
from qkv.check._function_file import _mentions_torch

NUMPY_ONLY = """
import sys
LIBRARY = "tor" + "ch"  # the file's text must not name it
assert LIBRARY not in sys.modules, "the runner imported it for a NumPy file"
import numpy as np


def attention(Q, K, V):
    s = Q @ K.T / np.sqrt(Q.shape[-1])
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ V
"""

NAMES_TORCH = """
import sys
assert "torch" in sys.modules, "the runner did not import torch for a file that names it"
import torch


def attention(Q, K, V):
    return torch.softmax(Q @ K.transpose(-2, -1) / Q.shape[-1] ** 0.5, dim=-1) @ V
"""


@pytest.mark.parametrize(("source", "array"), [(NUMPY_ONLY, "numpy"), (NAMES_TORCH, "torch")])
def test_torch_is_imported_for_the_student_only_when_the_code_uses_it(
    tmp_path: Path, source: str, array: str
) -> None:
    path = tmp_path / "student.py"
    path.write_text(source)
    report = check_function_file(f"{path}:attention", array=array, timeout=30)
    assert not report.file_error, report.file_error
    assert report.ok, report.to_json()


def test_a_file_names_torch_by_its_text(tmp_path: Path) -> None:
    plain, named = tmp_path / "plain.py", tmp_path / "named.py"
    plain.write_text("import numpy as np\n")
    named.write_text("import numpy as np  # torch.softmax would do too\n")
    assert not _mentions_torch(plain) and _mentions_torch(named)
    assert _mentions_torch(tmp_path / "missing.py")  # unreadable: assume it does


def test_a_fifo_in_the_file_s_place_does_not_hold_the_judge(tmp_path: Path) -> None:
    """Reading a FIFO blocks until someone writes: the look for torch must not."""
    fifo = tmp_path / "student.py"
    os.mkfifo(fifo)
    answers: list[bool] = []
    looker = threading.Thread(target=lambda: answers.append(_mentions_torch(fifo)), daemon=True)
    looker.start()
    looker.join(5)
    assert answers == [True]  # not a regular file: the runner's load says what is wrong
