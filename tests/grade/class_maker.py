"""A generated class, as a teacher receives one: every slip code, correct code in unusual
styles, and hostile or broken submissions; with the row of grades.csv each must get.

:func:`make_attention_class` writes the class of kind ``attention`` (functions that take a
mask: 5 parts, 1 point each); the smaller classes cover the codes of the other kinds
(``causal``, ``multi-head``, ``--batched``) and of worked examples.
"""

from __future__ import annotations

import os
from pathlib import Path

# A correct masked attention, built from pieces a slip replaces.
_PIECES = {
    "scores": "Q @ K.T",
    "scale": " / np.sqrt(Q.shape[-1])",
    "mask": "np.where(mask, s, -1e9)",
    "softmax": "w = np.exp(s - s.max(axis=-1, keepdims=True))\n"
    "    w = w / w.sum(axis=-1, keepdims=True)",
}


def _attention(**change: str) -> str:
    p = {**_PIECES, **change}
    return f"""import numpy as np


def attention(Q, K, V, mask=None):
    s = ({p["scores"]}){p["scale"]}
    if mask is not None:
        s = {p["mask"]}
    {p["softmax"]}
    return w @ V, w
"""


RIGHT = _attention()

# student: (source, score, status, first_slip, slips); max_score is 5 for every row
Row = tuple[str, float, str, str, str]


def attention_rows(canary: Path) -> dict[str, Row]:
    """The attention class: name → (source, expected score, status, first slip, slips)."""
    rows: dict[str, Row] = {
        # correct, in unusual styles
        "right_plain": (RIGHT, 5, "ok", "", ""),
        "right_einsum": (
            """import numpy as np
def attention(Q, K, V, mask=None):
    s = np.einsum("qd,kd->qk", Q, K) / Q.shape[-1] ** 0.5
    if mask is not None:
        s = np.where(mask, s, np.finfo(s.dtype).min)
    s = s - s.max(-1, keepdims=True)
    w = np.exp(s)
    w /= w.sum(-1, keepdims=True)
    return np.einsum("qk,kv->qv", w, V), w
""",
            5,
            "ok",
            "",
            "",
        ),
        "right_loops": (
            """import math
def attention(Q, K, V, mask=None):
    Q, K, V = Q.tolist(), K.tolist(), V.tolist()
    d = len(Q[0])
    out = []
    for i, q in enumerate(Q):
        s = [sum(a * b for a, b in zip(q, k)) / math.sqrt(d) for k in K]
        if mask is not None:
            s = [x if mask[i][j] else -math.inf for j, x in enumerate(s)]
        top = max(s)
        if top == -math.inf:
            out.append([0.0] * len(V[0]))
            continue
        e = [math.exp(x - top) for x in s]
        t = sum(e)
        out.append([sum(e[j] / t * V[j][c] for j in range(len(V))) for c in range(len(V[0]))])
    import numpy as np
    return np.array(out)
""",
            5,
            "ok",
            "",
            "",
        ),
        "right_logsumexp": (
            """import numpy as np
def attention(Q, K, V, mask=None):
    s = Q @ K.swapaxes(-1, -2) / np.sqrt(K.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -1e30)
    m = s.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True))
    return np.exp(s - lse) @ V
""",
            5,
            "ok",
            "",
            "",
        ),
        "right_callable_object": (
            """import numpy as np
class Attention:
    def __call__(self, Q, K, V, mask=None):
        s = Q @ K.T * (1.0 / np.sqrt(Q.shape[1]))
        if mask is not None:
            s[~mask] = -1e9
        w = np.exp(s - s.max(1)[:, None])
        return (w / w.sum(1)[:, None]) @ V
attention = Attention()
""",
            5,
            "ok",
            "",
            "",
        ),
        "right_lambda": (
            """import numpy as np
sm = lambda s: (lambda e: e / e.sum(-1, keepdims=True))(np.exp(s - s.max(-1, keepdims=True)))
attention = lambda Q, K, V, mask=None: sm(
    np.where(True if mask is None else mask, Q @ K.T / np.sqrt(len(Q[0])), -1e9)) @ V
""",
            5,
            "ok",
            "",
            "",
        ),
        "right_torch": (
            """import torch
def attention(Q, K, V, mask=None):
    q, k, v = (torch.as_tensor(x) for x in (Q, K, V))
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if mask is not None:
        s = s.masked_fill(~torch.as_tensor(mask), float("-inf"))
    w = torch.nan_to_num(torch.softmax(s, dim=-1))
    return (w @ v).numpy(), w.numpy()
""",
            5,
            "ok",
            "",
            "",
        ),
        "right_nan_row": (
            _attention(mask="np.where(mask, s, -np.inf)"),
            5,
            "ok",
            "",
            "masked-row-nan",
        ),
        "Zoë Ånström": (RIGHT, 5, "ok", "", ""),
        # one slip each (the part it names loses its point; the rest follows through)
        "slip_unscaled": (_attention(scale=""), 4, "slip", "unscaled", "unscaled"),
        "slip_scaled_by_dk": (
            _attention(scale=" / Q.shape[-1]"),
            4,
            "slip",
            "scaled-by-dk",
            "scaled-by-dk",
        ),
        "slip_wrong_axis": (
            _attention(
                softmax="w = np.exp(s - s.max(axis=0, keepdims=True))\n"
                "    w = w / w.sum(axis=0, keepdims=True)"
            ),
            4,
            "slip",
            "softmax-wrong-axis",
            "softmax-wrong-axis",
        ),
        "slip_swapped": (
            _attention(scores="K @ Q.T", mask="np.where(mask.T, s, -1e9)"),
            4,
            "slip",
            "query-key-swapped",
            "query-key-swapped",
        ),
        "slip_sum_normalised": (
            _attention(
                mask="s",
                softmax="s = np.where(mask, s, 0.0) if mask is not None else s\n"
                "    w = s / s.sum(axis=-1, keepdims=True)",
            ),
            4,
            "slip",
            "sum-normalised",
            "sum-normalised",
        ),
        "slip_not_softmax": (
            _attention(
                mask="s",
                softmax="w = (s - s.min(axis=-1, keepdims=True)) ** 2\n"
                "    w = np.where(mask, w, 0.0) if mask is not None else w\n"
                "    w = w / w.sum(axis=-1, keepdims=True)",
            ),
            4,
            "slip",
            "not-softmax",
            "not-softmax",
        ),
        "slip_mask_ignored": (_attention(mask="s"), 4, "slip", "mask-ignored", "mask-ignored"),
        "slip_mask_inverted": (
            _attention(mask="np.where(mask, -1e9, s)"),
            4,
            "slip",
            "mask-inverted",
            "mask-inverted",
        ),
        "slip_no_max_subtraction": (
            _attention(softmax="w = np.exp(s)\n    w = w / w.sum(axis=-1, keepdims=True)"),
            4,
            "slip",
            "no-max-subtraction",
            "no-max-subtraction;masked-row-nan",
        ),
        "slip_unscaled_and_overflow": (
            _attention(
                scale="", softmax="w = np.exp(s)\n    w = w / w.sum(axis=-1, keepdims=True)"
            ),
            3,
            "slip",
            "unscaled",
            "unscaled;no-max-subtraction",
        ),
        "slip_uniform_weights": (
            _attention(softmax="w = np.ones_like(s) / s.shape[-1]"),
            4,
            "slip",
            "not-softmax",
            "not-softmax",
        ),
        "slip_unrecognised": (
            RIGHT.replace("return w @ V, w", "return w @ V + 0.1, w"),
            0,
            "slip",
            "unrecognised",
            "unrecognised",
        ),
        # broken and hostile: a graded row each, never a stop
        "broken_syntax": ("def attention(Q, K, V:\n    return Q\n", 0, "error", "", ""),
        "broken_missing_function": ("def attend(Q, K, V):\n    return V\n", 0, "error", "", ""),
        "broken_empty": ("", 0, "error", "", ""),
        "broken_raises": (
            "def attention(Q, K, V, mask=None):\n"
            "    raise ValueError('<b>bold</b> \\x1b[31mred')\n",
            0,
            "error",
            "",
            "",
        ),
        "broken_crash_on_import": ("import os\nos._exit(3)\n", 0, "error", "", ""),
        "broken_infinite_loop": (
            "def attention(Q, K, V, mask=None):\n    while True:\n        pass\n",
            0,
            "timeout",
            "",
            "",
        ),
        "broken_sleeps_at_import": ("import time\ntime.sleep(1000)\n", 0, "timeout", "", ""),
        "broken_memory": (
            "import numpy as np\ndef attention(Q, K, V, mask=None):\n"
            "    return np.ones((1 << 40,))\n",
            0,
            "error",
            "",
            "",
        ),
        "broken_returns_none": (
            "def attention(Q, K, V, mask=None):\n    return None\n",
            0,
            "error",
            "",
            "",
        ),
        "hostile_writes_outside": (
            f"""try:
    open({str(canary)!r}, "w").write("changed by a student")
except OSError:
    pass
try:
    import os
    os.remove({str(canary)!r})
except OSError:
    pass
"""
            + RIGHT,
            5,
            "ok",
            "",
            "",
        ),
        "hostile_huge_output": (
            "import sys\nfor _ in range(200):\n    sys.stdout.write('x' * 1_000_000)\n" + RIGHT,
            5,
            "ok",
            "",
            "",
        ),
        "hostile_reads_environment": (
            "import os\nassert 'QKV_TEACHER_SECRET' not in os.environ\n" + RIGHT,
            5,
            "ok",
            "",
            "",
        ),
        "=HYPERLINK(evil)": (RIGHT, 5, "ok", "", ""),
        "<script>alert(1)</script>": (_attention(scale=""), 4, "slip", "unscaled", "unscaled"),
    }
    # More correct and slipped students, as a class has: the same file and the same slip
    # several times (the class page counts each slip's students). Each student is a
    # sandboxed process, about a second apiece: more copies add time, not code paths.
    for i in range(2):
        rows[f"student_{i:02d}"] = (RIGHT, 5, "ok", "", "")
    for i, (code, change) in enumerate(
        [("unscaled", {"scale": ""}), ("mask-ignored", {"mask": "s"})]
    ):
        rows[f"student_{2 + i:02d}"] = (_attention(**change), 4, "slip", code, code)
    return rows


def write_attention_class(folder: Path, canary: Path) -> dict[str, Row]:
    """Write the attention class into ``folder``; the rows each student must get, by the
    student's name in grades.csv."""
    folder.mkdir()
    rows = attention_rows(canary)
    expected: dict[str, Row] = {}
    for name, row in rows.items():
        path = folder / f"{name.replace('/', '_')}.py"
        path.write_text(row[0], encoding="utf-8")
        expected[name] = row
    # a student's folder: the function and a helper module next to it
    pkg = folder / "folder_with_helper"
    (pkg / "helpers").mkdir(parents=True)
    (pkg / "helpers" / "__init__.py").write_text(
        "import numpy as np\ndef softmax(s):\n    e = np.exp(s - s.max(-1, keepdims=True))\n"
        "    return e / e.sum(-1, keepdims=True)\n"
    )
    (pkg / "attention.py").write_text(
        "import numpy as np\nfrom helpers import softmax\n"
        "def attention(Q, K, V, mask=None):\n    s = Q @ K.T / np.sqrt(Q.shape[-1])\n"
        "    return softmax(s if mask is None else np.where(mask, s, -1e9)) @ V\n"
    )
    expected["folder_with_helper"] = ("", 5, "ok", "", "")
    # a folder with two files and no way to tell which; a folder with nothing to grade
    two = folder / "two_files"
    two.mkdir()
    (two / "a.py").write_text(RIGHT)
    (two / "b.py").write_text(RIGHT)
    expected["two_files"] = ("", 0, "error", "", "")
    (folder / "empty_folder").mkdir()
    expected["empty_folder"] = ("", 0, "error", "", "")
    # not code: a PDF, a file that is not UTF-8, a link to the teacher's file
    (folder / "report.pdf").write_bytes(b"%PDF-1.4 ...")
    expected["report.pdf"] = ("", 0, "error", "", "")
    (folder / "latin1.py").write_bytes(b"# caf\xe9\ndef attention(Q, K, V): return V\n")
    expected["latin1"] = ("", 0, "slip", "unrecognised", "unrecognised")  # returns V
    os.symlink(canary, folder / "link_to_teacher.py")
    expected["link_to_teacher"] = ("", 0, "error", "", "")
    return expected
