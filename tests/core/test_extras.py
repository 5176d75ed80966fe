"""The core runs without the extras; a missing extra is named in the error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qkv._extras import MissingExtraError, require

NO_EXTRAS = "import sys; sys.modules['torch'] = None; sys.modules['matplotlib'] = None; "


def test_missing_extra_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(MissingExtraError, match=r"qkv.nn needs torch.*pip install 'qkv\[torch\]'"):
        require("torch", feature="qkv.nn")


def test_core_api_without_torch_or_matplotlib() -> None:
    code = NO_EXTRAS + (
        "import numpy as np, qkv; from qkv import examples; "
        "t = examples.run(examples.builtin('two-heads')); "
        "out = qkv.scaled_dot_product_attention(np.eye(2), np.eye(2), np.eye(2), "
        "mask=qkv.masks.causal()); "
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]; "
        "print(round(float(out[1, 0]), 4), t.names[-1])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0.3302", "output"]
