"""Reading and computing for the independent corpus verdict (``corpus_verdicts.py``).

The example files are read with PyYAML's node API, so that every printed number keeps its
text (``1.10`` has two decimals, ``6.3379e-02`` six); attention is recomputed from the
example's inputs in NumPy float64, per head, and for printouts of float32 code also in
NumPy float32 (:meth:`Example.forward_in`). Never imports qkv.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

__all__ = ["Example", "Num", "load", "softmax_rows"]

CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus"
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
MINUS_INF_TEXTS = {"-inf", "-.inf", "−∞", "-∞", "-Inf", "-INF"}
STEPS = ("Q", "K", "V", "scores", "scaled", "exp", "exp_sum", "weights", "products")


@dataclass(frozen=True)
class Num:
    """A printed number: its value and the decimals it was printed with."""

    value: float
    text: str

    @property
    def decimals(self) -> int:
        t = self.text.strip().lstrip("+-−")
        if t in ("inf", ".inf", "∞", "Inf", "INF"):
            return 0
        mant, _, exp = t.lower().partition("e")
        dec = len(mant.partition(".")[2])
        return max(dec - int(exp), 0) if exp else dec


# --- reading ------------------------------------------------------------------------------


def _plain(node: yaml.Node) -> Any:
    """Mappings to dicts, sequences to lists, numbers to :class:`Num`, the rest to text."""
    if isinstance(node, yaml.MappingNode):
        return {
            _plain(k) if not isinstance(k, yaml.ScalarNode) else _key(k): _plain(v)
            for k, v in node.value
        }
    if isinstance(node, yaml.SequenceNode):
        return [_plain(v) for v in node.value]
    text = str(node.value)
    if text in MINUS_INF_TEXTS:
        return Num(-math.inf, text)
    if node.tag.endswith((":int", ":float")):
        return Num(float(text.replace("_", "")) if "inf" not in text else -math.inf, text)
    plain = getattr(node, "style", None) is None
    if node.tag.endswith(":str") and plain and _NUMBER.fullmatch(text):
        return Num(float(text), text)  # YAML 1.1 reads 1e9 (no dot) as text; it is a number
    if node.tag.endswith(":bool"):
        return text.lower() in ("true", "yes", "on")
    return text


def _key(node: yaml.ScalarNode) -> Any:
    return int(node.value) if node.tag.endswith(":int") else str(node.value)


def load(path: Path) -> dict[str, Any]:
    node = yaml.compose(path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    assert node is not None, f"{path}: empty file"
    data = _plain(node)
    assert isinstance(data, dict)
    return data


def _arr(rows: Any) -> np.ndarray:
    return np.array([[r.value for r in row] for row in rows], dtype=np.float64)


# --- the example, computed ----------------------------------------------------------------


class Example:
    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        opts = data.get("options", {})
        self.heads = int(data["heads"].value) if "heads" in data else 1
        self.inputs: dict[str, np.ndarray] = {}
        if "inputs" in data:
            for k, v in data["inputs"].items():
                self.inputs[k] = _arr(v)
        else:
            self.inputs["X"] = _arr(data["embeddings"])
            for k in ("W_q", "W_k", "W_v"):
                self.inputs[k] = _arr(data["weights"][k])
        if "W_o" in data.get("weights", {}):
            self.inputs["W_o"] = _arr(data["weights"]["W_o"])
        first = next(self.inputs[k] for k in ("K", "X", "scores") if k in self.inputs)
        n_keys = first.shape[1] if "scores" in self.inputs else first.shape[0]
        self.keys = list(data.get("tokens") or [f"t{i + 1}" for i in range(n_keys)])
        n_q = (
            self.inputs["Q"].shape[0]
            if "Q" in self.inputs
            else (self.inputs["scores"].shape[0] if "scores" in self.inputs else n_keys)
        )
        self.queries = list(
            data.get("query_tokens")
            or (self.keys if n_q == n_keys else [f"q{i + 1}" for i in range(n_q)])
        )
        scale = opts.get("scale", True)
        self.scale_opt = scale
        self.d_k_opt = opts["d_k"].value if "d_k" in opts else None
        self.mask = self._mask(opts, n_q, n_keys)
        self.precision = data.get("precision")
        self.dtype: str | None = data.get("dtype")

    def _mask(self, opts: dict[str, Any], lq: int, lk: int) -> np.ndarray:
        allowed = np.ones((lq, lk), dtype=bool)
        causal = opts.get("causal", False)
        i, j = np.arange(lq)[:, None], np.arange(lk)[None, :]
        if causal is True or causal == "top-left":
            allowed &= j <= i
        elif causal == "bottom-right":
            allowed &= j <= i + lk - lq
        if "key_length" in opts:
            allowed &= j < int(opts["key_length"].value)
        if "mask" in opts:
            allowed &= _arr(opts["mask"]) != 0
        return allowed

    def factor(self, d_head: int) -> float:
        if self.scale_opt is True:
            return 1 / math.sqrt(self.d_k_opt if self.d_k_opt is not None else d_head)
        if self.scale_opt is False:
            return 1.0
        return float(self.scale_opt.value)

    def forward(self, x: dict[str, np.ndarray]) -> Any:
        """Every step, per head, from inputs ``x`` (exact attention, float64)."""
        out: dict[str, Any] = {}
        if "X" in x:
            q_all, k_all, v_all = x["X"] @ x["W_q"], x["X"] @ x["W_k"], x["X"] @ x["W_v"]
        else:
            q_all, k_all, v_all = x.get("Q"), x.get("K"), x.get("V")
        out["Q"], out["K"], out["V"] = q_all, k_all, v_all
        h = self.heads
        per: list[dict[str, np.ndarray]] = []
        for head in range(h):
            r: dict[str, np.ndarray] = {}
            if "scores" in x:
                s, d_head = x["scores"], 0
            else:
                dk = q_all.shape[1] // h
                qh, kh = (
                    q_all[:, head * dk : (head + 1) * dk],
                    k_all[:, head * dk : (head + 1) * dk],
                )
                s, d_head = qh @ kh.T, dk
                r["Q"], r["K"] = qh, kh
            r["scores"] = s
            c = self.factor(d_head)
            r["factor"] = np.array(c)
            r["scaled"] = np.where(self.mask, s * c, -np.inf)
            r["weights"] = softmax_rows(r["scaled"])
            r["exp"] = np.where(self.mask, np.exp(np.where(self.mask, s * c, 0.0)), 0.0)
            r["exp_sum"] = r["exp"].sum(axis=1, keepdims=True)
            if v_all is not None:
                dv = v_all.shape[1] // h
                vh = v_all[:, head * dv : (head + 1) * dv]
                r["V"] = vh
                r["products"] = r["weights"][:, :, None] * vh[None, :, :]
                r["context"] = r["weights"] @ vh
            per.append(r)
        out["per"] = per
        if v_all is not None:
            out["context"] = np.concatenate([r["context"] for r in per], axis=1)
            out["output"] = out["context"] @ x["W_o"] if "W_o" in x else out["context"]
        return out

    def forward_in(self, dtype: str) -> Any:
        """Every step computed in ``dtype`` (float32 or float16) from the inputs rounded to
        it, as NumPy computes in that format: what code in that format prints."""
        kind = {"float32": np.float32, "float16": np.float16}[dtype]
        with np.errstate(over="ignore", invalid="ignore"):  # e^s of a large score: inf
            return self.forward({k: v.astype(kind) for k, v in self.inputs.items()})

    def band(self) -> Any:
        """First-order effect of inputs printed rounded, per step (0 without ``precision``)."""
        base = self.forward(self.inputs)
        acc = _zeros_like(base)
        prec = self.precision
        if prec is None:
            return acc
        for name, arr in self.inputs.items():
            dec = _declared(prec, name)
            if dec is None:
                continue
            half = 0.5 * 10.0 ** (-dec)
            for idx in np.ndindex(arr.shape):
                moved = {k: v.copy() for k, v in self.inputs.items()}
                moved[name][idx] += half
                _accumulate(acc, base, self.forward(moved))
        return acc


def _declared(prec: Any, name: str) -> int | None:
    if isinstance(prec, Num):
        return int(prec.value)
    key = {"X": "embeddings"}.get(name, name)
    if key in prec:
        return int(prec[key].value)
    if name.startswith("W_") and "weights" in prec:
        return int(prec["weights"].value)
    return None


def _zeros_like(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _zeros_like(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_zeros_like(v) for v in tree]
    return None if tree is None else np.zeros_like(np.nan_to_num(tree, neginf=0.0))


def _accumulate(acc: Any, base: Any, moved: Any) -> None:
    for k in acc:
        if isinstance(acc[k], dict):
            _accumulate(acc[k], base[k], moved[k])
        elif isinstance(acc[k], list):
            for a, b, m in zip(acc[k], base[k], moved[k], strict=True):
                _accumulate(a, b, m)
        elif acc[k] is not None:
            diff = np.nan_to_num(moved[k], neginf=0.0) - np.nan_to_num(base[k], neginf=0.0)
            acc[k] += np.abs(diff)


def softmax_rows(s: np.ndarray) -> Any:
    finite = np.isfinite(s)
    m = np.where(
        finite.any(axis=1, keepdims=True),
        np.max(np.where(finite, s, -np.inf), axis=1, keepdims=True),
        0.0,
    )
    e = np.where(finite, np.exp(np.where(finite, s - m, 0.0)), 0.0)
    tot = e.sum(axis=1, keepdims=True)
    return np.divide(e, tot, out=np.zeros_like(e), where=tot > 0)
