"""A student attacks the sandbox of ``qkv check --function`` and ``qkv grade`` (issue 35,
item 1 and "Test it"), at every level of isolation this machine allows: forging a result,
importing qkv's reference, patching the runner, rewriting another student's copy and
result, reaching a unix socket of the host, reading the environment of a process outside.

Each attack fails since the student's process holds nothing of qkv (its runner is
``_student_main.py`` with ``_student_file.py`` and ``_module_adapt.py``, and the judge, qkv's
own process, calls the probes through a channel and decides). Run on the previous code
(runner = ``qkv.check._function_file.child_main`` in the student's process, from
``git archive HEAD src``), these tests failed: forging, importing qkv, finding qkv on the
path and patching the runner at every level; rewriting a classmate's copy and the unix
socket under ``namespaces``; and, at the level ``process`` that qkv no longer offers, every
attack, ``/proc/*/environ`` included (the previous ``namespaces`` already kept another
user namespace's ``environ`` out of reach).

The attacks are written in the way a student writes them, a file with ``attention`` in it;
each run is ``qkv`` in a child process with a memory and a time limit
(``tests/support/sandboxed.py``).
"""

from __future__ import annotations

import ast
import csv
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import qkv
from tests.support.sandboxed import LEVELS, run_qkv

# a right softmax attention, the student's own, and the slip the attacks hand in instead
RIGHT = """
import numpy as np


def _right(Q, K, V, mask=None):
    s = np.asarray(Q) @ np.asarray(K).T / np.sqrt(np.asarray(Q).shape[-1])
    if mask is not None:
        s = np.where(np.asarray(mask), s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ np.asarray(V)
"""
WRONG = """

def attention(Q, K, V):
    return V  # no attention at all: a wrong answer that only an attack can make right
"""
HONEST = RIGHT + "\n\ndef attention(Q, K, V, mask=None):\n    return _right(Q, K, V, mask)\n"
_SOURCE = str(Path(qkv.__file__).resolve().parents[1])  # the folder that holds qkv


def write(folder: Path, code: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "attention.py"
    path.write_text(textwrap.dedent(code), encoding="utf-8")
    return path


def check(path: Path, level: str, *options: str) -> tuple[int, dict[str, object] | None, str]:
    """``qkv check --function PATH:attention`` at ``level``: status, JSON report, stderr."""
    argv = ["check", "--function", f"{path}:attention", "--isolation", level]
    status, out, err = run_qkv([*argv, "--timeout", "60", "-f", "json", *options])
    return status, (json.loads(out) if out.strip() else None), err


def assert_not_full_marks(status: int, report: dict[str, object] | None, err: str) -> None:
    """A wrong function stays wrong: findings (status 1) or one error line (status 2)."""
    assert status in (1, 2), (status, report, err)
    if status == 1:
        assert report is not None and report["ok"] is False and report["findings"]
    else:
        assert report is None and err.startswith("qkv: error: ") and err.count("\n") == 1


# the previous runner's result file, or any descriptor the process holds: a forged verdict
FORGE = (
    RIGHT
    + WRONG
    + """
import json, os
forged = {"array": "numpy", "with_mask": False, "kind": "attention", "causal": False,
          "about": "", "file_error": None, "outcomes": []}
try:  # the previous runner held qkv: the probes and a verdict of full marks
    from qkv.check._function_run import run_probes
    used, outcomes = run_probes(lambda Q, K, V: _right(Q, K, V), "attention", array="numpy")
    forged["outcomes"] = [
        {"context": o.context.tolist(), "weights": None, "error": None} for o in outcomes
    ]
except ImportError:
    pass
data = json.dumps(forged).encode()
for fd in range(3, 64):
    try:
        os.write(fd, data + b"\\n")
    except OSError:
        pass
os._exit(0)
"""
)


@pytest.mark.parametrize("level", LEVELS)
def test_a_forged_result_gives_no_marks(tmp_path: Path, level: str) -> None:
    """Written to every descriptor the process holds, then the process ends."""
    path = write(tmp_path / "mallory", FORGE)
    assert_not_full_marks(*check(path, level))


IMPORT_QKV = f"""
import sys
sys.path.insert(0, {_SOURCE!r})  # where qkv's source lies on the teacher's machine
import qkv


def attention(Q, K, V):
    return qkv.scaled_dot_product_attention(Q, K, V)
"""


@pytest.mark.parametrize("level", LEVELS)
def test_the_student_cannot_import_qkv(tmp_path: Path, level: str) -> None:
    path = write(tmp_path / "mallory", IMPORT_QKV)
    status, report, err = check(path, level)
    assert_not_full_marks(status, report, err)
    assert "NameError: name 'qkv' is not defined" in err


# what the student's process may find of qkv: on its import path (an installed qkv is masked:
# an empty folder or file at most), beside its runner (only the runner's three files)
LOOK_FOR_QKV = (
    RIGHT
    + """
import glob, importlib.util, os, sys
found = [p for p in sys.path if os.path.exists(os.path.join(p, "qkv", "__init__.py"))]
for entry in sys.path:
    for path in glob.glob(os.path.join(entry, "*qkv*")):
        if os.listdir(path) if os.path.isdir(path) else os.path.getsize(path):
            found.append(path)
if importlib.util.find_spec("qkv") is not None:
    found.append("importable")
runner = sorted(os.listdir(os.path.dirname(os.path.abspath(sys.argv[0]))))
if runner != ["_module_adapt.py", "_student_file.py", "_student_main.py"]:
    found.append(f"beside the runner: {runner}")


def attention(Q, K, V):
    if found:
        raise RuntimeError(f"found {found}")
    return _right(Q, K, V)
"""
)


@pytest.mark.parametrize("level", LEVELS)
def test_nothing_of_qkv_is_on_the_student_s_path(tmp_path: Path, level: str) -> None:
    path = write(tmp_path / "student", LOOK_FOR_QKV)
    status, report, err = check(path, level)
    assert (status, err) == (0, "") and report is not None and report["ok"] is True


# wrap every function of the runner (qkv's modules, the script): the student's function is
# swapped for qkv's reference, numpy's comparisons always agree
PATCH = (
    RIGHT
    + WRONG
    + """
import functools, sys, types
import numpy as np

try:
    import qkv
    reference = lambda Q, K, V: qkv.scaled_dot_product_attention(Q, K, V)
except ImportError:
    reference = None


def swapped(function):
    @functools.wraps(function)
    def call(*args, **kwargs):
        if reference is not None:
            args = [reference if getattr(a, "__name__", "") == "attention" else a for a in args]
        return function(*args, **kwargs)
    return call


for name, module in list(sys.modules.items()):
    if not name.startswith(("qkv", "_student", "_module_adapt", "__main__")):
        continue
    for attr, value in list(vars(module).items()):
        if isinstance(value, types.FunctionType) and value.__module__ == module.__name__:
            setattr(module, attr, swapped(value))
np.allclose = lambda *args, **kwargs: True
np.isclose = lambda a, b, *args, **kwargs: np.ones(np.broadcast(a, b).shape, bool)
"""
)


@pytest.mark.parametrize("level", LEVELS)
def test_patching_the_runner_gives_no_marks(tmp_path: Path, level: str) -> None:
    path = write(tmp_path / "mallory", PATCH)
    assert_not_full_marks(*check(path, level))


# rewrite every other attention.py and every file of qkv's sandboxes it can reach, for a
# while: in the temporary folder of the grading run (TMPDIR, four folders above its copy)
VANDAL = (
    RIGHT
    + """
import os, time
mine = os.path.realpath(__file__)
root = mine
for _ in range(4):
    root = os.path.dirname(root)
BAD = "def attention(Q, K, V):\\n    return V * 0\\n"
end = time.monotonic() + 12
while time.monotonic() < end:
    for folder, dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if os.path.realpath(path) == mine:
                continue
            try:
                if name == "attention.py":
                    with open(path, "w") as f:
                        f.write(BAD)
                elif name in ("result", "stdout", "stderr") or name.startswith("_student"):
                    with open(path, "wb") as f:
                        f.write(b'{"error": "vandalised"}')
            except OSError:
                pass
    time.sleep(0.05)


def attention(Q, K, V):
    return _right(Q, K, V)
"""
)


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_a_student_cannot_touch_a_classmate_s_grade(tmp_path: Path, level: str) -> None:
    """Two students graded at once (``--jobs 2``): the vandal rewrites every file it can
    find; the honest student's copy, sandbox and result are out of its reach."""
    submissions = tmp_path / "class"
    honest = write(submissions / "alice", HONEST)
    write(submissions / "mallory", VANDAL)
    out = tmp_path / "grades"
    argv = ["grade", str(submissions), "-o", str(out), "--jobs", "2", "--kind", "attention"]
    tmp = tmp_path / "tmp"  # the run's TMPDIR: the vandal reaches nothing outside the test
    tmp.mkdir()
    options = ["--isolation", level, "--timeout", "60"]
    status, _, err = run_qkv([*argv, *options], env={"TMPDIR": str(tmp)})
    assert status == 0, err
    with (out / "grades.csv").open(newline="", encoding="utf-8") as handle:
        rows = {row["student"]: row for row in csv.DictReader(handle)}
    assert (rows["alice"]["status"], rows["alice"]["score"]) == ("ok", rows["alice"]["max_score"])
    assert rows["mallory"]["status"] == "ok"  # its own function is right
    assert honest.read_text(encoding="utf-8") == textwrap.dedent(HONEST)


SOCKET = (
    RIGHT
    + """
import socket
reached = []
for address in ({path!r}, "\\0" + {abstract!r}):
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(2)
            s.connect(address)
            s.sendall(b"pwned")
            reached.append(address)
    except OSError:
        pass


def attention(Q, K, V):
    return V if reached else _right(Q, K, V)
"""
)


@pytest.mark.parametrize("level", LEVELS)
def test_a_unix_socket_of_the_host_is_out_of_reach(tmp_path: Path, level: str) -> None:
    """A socket the test listens on, by path and in the abstract namespace: no connection."""
    abstract = f"qkv-attack-{os.getpid()}"
    servers = []
    for address in (str(tmp_path / "s"), "\0" + abstract):
        server = socket.socket(socket.AF_UNIX)
        server.bind(address)
        server.listen(4)
        server.settimeout(0.2)
        servers.append(server)
    heard: list[bytes] = []
    stop = threading.Event()

    def listen() -> None:
        while not stop.is_set():
            for server in servers:
                try:
                    connection, _ = server.accept()
                except OSError:
                    continue
                with connection:
                    connection.settimeout(1)
                    try:
                        heard.append(connection.recv(16) or b"connected")
                    except OSError:
                        heard.append(b"connected")

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    try:
        code = SOCKET.format(path=str(tmp_path / "s"), abstract=abstract)
        status, report, err = check(write(tmp_path / "mallory", code), level)
    finally:
        stop.set()
        thread.join()
        for server in servers:
            server.close()
    assert heard == []
    assert (status, err) == (0, "") and report is not None and report["ok"] is True


ENVIRON = (
    RIGHT
    + """
import os
seen = []
for name in os.listdir("/proc"):
    if name.isdigit():
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if b"hunter3" in f.read():
                    seen.append(name)
        except OSError:
            pass


def attention(Q, K, V):
    if seen:
        raise RuntimeError(f"read the secret of {seen}")
    return _right(Q, K, V)
"""
)


@pytest.mark.parametrize("level", LEVELS)
def test_another_process_s_environment_is_out_of_reach(tmp_path: Path, level: str) -> None:
    """A process of the same user outside the check holds a secret in its environment."""
    outside = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)"],
        env={"PATH": "/usr/bin:/bin", "QKV_ATTACK_SECRET": "hunter3"},
    )
    try:
        status, report, err = check(write(tmp_path / "mallory", ENVIRON), level)
    finally:
        outside.kill()
        outside.wait()
    assert (status, err) == (0, ""), err
    assert report is not None and report["ok"] is True


RUNNER_FILES = ("_student_main.py", "_student_file.py", "_module_adapt.py")


@pytest.mark.parametrize("name", RUNNER_FILES)
def test_the_student_s_process_runs_no_code_of_qkv(name: str) -> None:
    """The three files copied into the student's process import nothing of qkv, by statement
    or by name (``importlib.import_module``, ``__import__``), and nothing relative."""
    path = Path(qkv.__file__).parent / "check" / name
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "qkv"]
        elif isinstance(node, ast.ImportFrom):
            if node.level or (node.module or "").split(".")[0] == "qkv":
                found.append(f"from {'.' * node.level}{node.module or ''}")
        elif isinstance(node, ast.Call) and node.args:
            first = node.args[0]
            text = first.value if isinstance(first, ast.Constant) else None
            if isinstance(text, str) and text.split(".")[0] == "qkv":
                found.append(f"a call with {text!r}")
    assert found == [], f"{name} imports {found}"
