"""A notebook exported to a Python file (issue 26, item 4): several functions and top-level
code around them. The check runs the chosen function and reports the file's own errors as
one line; a file that is no Python at all is one line, exit status 2.

The exported file below is written here the way ``jupyter nbconvert --to script`` writes a
notebook (``# In[3]:`` cells, ``get_ipython()`` for magics), with the usual top-level code
of a course notebook: a test that prints, a call that fails, a plot.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from qkv.cli import main
from qkv.testing import check_attention

EXPORTED = """
    #!/usr/bin/env python
    # coding: utf-8

    # In[1]:

    import numpy as np
    get_ipython().run_line_magic('matplotlib', 'inline')


    # In[2]:

    def softmax(x):
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)


    # In[3]:

    def attention(Q, K, V):
        return softmax(Q @ K.T / np.sqrt(Q.shape[-1]{slip})) @ V


    # In[4]:

    print(attention(np.eye(2), np.eye(2), np.eye(2)))
    attention(np.eye(2), np.eye(3), np.eye(3))   # the cell that failed in class


    # In[5]:

    def causal_attention(Q, K, V):
        mask = np.tril(np.ones((Q.shape[0], K.shape[0]), dtype=bool))
        return softmax(np.where(mask, Q @ K.T / np.sqrt(Q.shape[-1]), -np.inf)) @ V
"""


def write(tmp_path: Path, slip: str = "", shell: str = "") -> Path:
    path = tmp_path / "notebook.py"
    text = textwrap.dedent(EXPORTED.format(slip=slip)) + shell
    path.write_text(text, encoding="utf-8")
    return path


def test_the_chosen_function_is_checked_and_the_file_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path)
    assert main(["check", "--function", f"{path}:attention", "-f", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True
    error = data["file_error"]
    assert error.startswith("line 8: NameError: name 'get_ipython' is not defined")
    assert "1 more top-level statement(s) failed" in error and "\n" not in error
    assert main(["check", "--function", f"{path}:causal_attention", "--kind", "causal"]) == 0
    out = capsys.readouterr().out
    assert "! The file's own errors: line 8: NameError" in out


def test_a_slip_in_an_exported_notebook_is_still_named(tmp_path: Path) -> None:
    path = write(tmp_path, slip=" * Q.shape[-1]")  # d_k·√d_k: no common slip
    report = check_attention(f"{path}:attention")
    assert report.file_error and not report.ok
    path = write(tmp_path, slip=") / np.sqrt(Q.shape[-1]")  # divided by d_k
    report = check_attention(f"{path}:attention")
    assert [f.diagnosis for f in report.findings] == ["scaled-by-dk"]


def test_ipython_lines_are_skipped_and_noted(tmp_path: Path) -> None:
    path = write(
        tmp_path, shell="\n!pip install numpy\n%timeit attention(np.eye(2), np.eye(2), np.eye(2))\n"
    )
    report = check_attention(f"{path}:attention")
    assert report.ok
    assert report.file_error is not None and "2 IPython lines (! or %) skipped" in report.file_error


def test_a_file_that_is_no_python_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "broken.py"
    path.write_text("def attention(Q, K, V)\n    return V\n", encoding="utf-8")
    assert main(["check", "--function", f"{path}:attention"]) == 2
    err = capsys.readouterr().err
    assert "line 1: SyntaxError" in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_file_too_large_for_an_exercise_is_refused_before_it_runs(tmp_path: Path) -> None:
    from qkv.check._student_file import MAX_SOURCE_BYTES, StudentFileError, run_student_file

    path = tmp_path / "huge.py"
    path.write_bytes(b"#" * (MAX_SOURCE_BYTES + 1))
    with pytest.raises(StudentFileError, match=r"bytes, more than .* for a Python file"):
        run_student_file(path)
