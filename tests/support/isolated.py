"""Run ``qkv`` (its CLI or Python code) on hostile input in a child process with a memory
and a time limit.

What hung or filled the memory before a fix must fail a test, not take the test run (or the
machine) down: each run is ``qkv.cli.main(argv)`` in one child with ``RLIMIT_AS`` set, all
the runs of a test in the same child so that PyTorch is imported once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

MEMORY = 2 << 30
"""The address space the child may map (2 GiB: PyTorch and transformers fit)."""


def run_cli_isolated(
    runs: list[list[str]],
    *,
    seconds: float = 300,
    memory: int = MEMORY,
    stdin: str = "",
    cwd: Path | None = None,
) -> list[tuple[int, str]]:
    """``qkv ARGV`` for each of ``runs``, in one child; (exit status, stderr) of each.

    The child fails the test (with its stderr) when it crashes, hits the memory limit or
    prints a traceback; ``stdin`` is what the child reads (e.g. ``"y\\n"`` to a prompt).
    """
    code = (
        "import contextlib, io, json, resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))\n"
        "from qkv.cli import main\n"
        "results = []\n"
        f"for argv in {runs!r}:\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):\n"
        "        results.append((main(argv), err.getvalue()))\n"
        "print(json.dumps(results))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=seconds,
        cwd=cwd,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return [(int(c), str(e)) for c, e in json.loads(done.stdout.splitlines()[-1])]


def run_code_isolated(code: str, *, seconds: float = 120, memory: int = 3 << 30) -> dict[str, Any]:
    """Run Python ``code``, which sets ``result`` (a dict that JSON takes), in a child with
    ``memory`` bytes of address space and a time limit; ``result``, or the exception the
    code raised as ``{"error": its class name, "message": its text}``."""
    program = (
        "import json, resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))\n"
        "try:\n"
        + "".join(f"    {line}\n" for line in code.strip().splitlines())
        + "except BaseException as error:\n"
        "    result = {'error': type(error).__name__, 'message': str(error)}\n"
        "print(json.dumps(result))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=seconds
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return found
