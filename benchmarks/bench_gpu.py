"""qkv on a CUDA GPU against its peers, every figure measured in one run (issue 19).

Sections, each printed as a Markdown table that names the device:

- attention: bfloat16, forward and forward + backward, for dense, causal, sliding-window and
  packed-document masks at several (B, H, D, N); peers: SDPA held to its flash kernel
  (dense and causal; SDPA with a boolean mask array for the others, where it fits),
  compiled FlexAttention called directly (its BlockMask built once, outside the timing),
  and qkv's ``auto``. Each row gives the time, the attained TFLOP/s and its share of the
  device's measured bfloat16 matrix-product rate, the share of visible (query, key) pairs
  and the time against the dense case (time in proportion to the visible blocks), and
  qkv / faster peer (throughput: the target is ≥ 0.95).
- mha: a training step of a small transformer (pre-norm blocks) with
  ``qkv.nn.MultiHeadAttention`` against the same model with ``torch.nn.MultiheadAttention``.
- dispatch: what ``auto`` adds to a call, at sizes where the kernel takes microseconds:
  qkv's ``auto`` (and ``explain_dispatch`` alone) against calling SDPA directly, many
  calls in a row, one synchronisation at the end.
- trace: one head and one query row of one layer traced (``qkv.tracing(model=...)``)
  against the untraced forward.
- hf: a Llama-like Hugging Face model (12 layers, 12 heads, 4 key/value heads, float32,
  random weights from its config) traced at one head and one row of its last layer, against
  its own SDPA and eager implementations; the traced output and row are compared with
  eager's (max |difference|).
- decode: one token at a time with ``qkv.nn.KVCache`` against recomputing the causal pass.

``--smoke`` runs tiny sizes on the CPU (compiled FlexAttention forward included) in
seconds: it checks that the script works, and measures nothing worth reading.

Usage:
    python benchmarks/bench_gpu.py                          # the full run, on cuda
    python benchmarks/bench_gpu.py --only attention --repeats 20
    python benchmarks/bench_gpu.py --out gpu.md             # also write the tables
    python benchmarks/bench_gpu.py --smoke                  # CPU, tiny, seconds
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

import qkv
from qkv import masks
from qkv.kernels._flex_masks import raise_recompile_limits
from qkv.nn import KVCache, MultiHeadAttention

T = TypeVar("T")
SECTIONS = ("attention", "dispatch", "mha", "trace", "hf", "decode")
MASK_KINDS = ("dense", "causal", "window", "documents")
WINDOW = 1024  # keys before each query (a causal window of 1025)
DOCUMENT = 2048  # mean document length (packed, causal within each)


@dataclass(frozen=True)
class Shape:
    """One attention problem: B, H, D, N (Lq = Lk = N)."""

    batch: int
    heads: int
    dim: int
    length: int

    def __str__(self) -> str:
        return f"B={self.batch} H={self.heads} D={self.dim} N={self.length}"


FULL_SHAPES = (
    Shape(8, 16, 64, 4096),
    Shape(8, 16, 128, 4096),
    Shape(4, 32, 128, 8192),
    Shape(2, 16, 64, 16384),
    Shape(1, 32, 128, 32768),
    Shape(1, 16, 128, 65536),
)
SMOKE_SHAPES = (Shape(1, 2, 16, 256),)


@dataclass
class Settings:
    device: torch.device
    dtype: torch.dtype
    repeats: int
    shapes: tuple[Shape, ...]
    smoke: bool
    window: int = WINDOW
    masks: tuple[str, ...] = MASK_KINDS
    document: int = DOCUMENT
    out: Path | None = None

    def emit(self, text: str = "") -> None:
        """Print a line, and append it to ``out`` at once (a run stopped at its time limit
        keeps every table it finished)."""
        print(text, flush=True)
        if self.out is not None:
            with self.out.open("a", encoding="utf-8") as file:
                file.write(text + "\n")


# -- timing --------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_call(run: Callable[[], object], device: torch.device, calls: int) -> float:
    """Seconds per call of ``run`` over ``calls`` calls in a row with one synchronisation at
    the end (what a model's forward sees), the median of 5 such runs after a warm-up."""
    run()
    _sync(device)
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        _sync(device)
        runs.append((time.perf_counter() - start) / calls)
    return statistics.median(runs)


def timed(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``run`` over ``repeats`` calls, after one warm-up call (which
    compiles what needs compiling)."""
    run()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attempt(run: Callable[[], T]) -> T | str:
    """A measurement (or any value), or a short reason it could not be taken (out of
    memory, an error)."""
    try:
        return run()
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return "OOM"
    except Exception as error:  # a peer that cannot run this case: say why, keep going
        text = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"{type(error).__name__}: {text[:60]}"


def matmul_rate(settings: Settings) -> float:
    """The device's bfloat16 (float32 on CPU) matrix-product rate, FLOP/s: the best of a few
    n × n × n products (n = 8192 on a GPU)."""
    n = 256 if settings.smoke else 8192
    dtype = settings.dtype if settings.device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=settings.device, dtype=dtype)
    b = torch.randn(n, n, device=settings.device, dtype=dtype)
    best = min(timed(lambda: a @ b, settings.device, 1) for _ in range(max(3, settings.repeats)))
    return 2.0 * n**3 / best


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


# -- attention -----------------------------------------------------------------------------------


def _documents(length: int, mean: int) -> torch.Tensor:
    """Document ids of packed documents of random lengths around ``mean`` (fixed seed)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.empty(length, dtype=torch.long)
    start, doc = 0, 0
    while start < length:
        size = int(torch.randint(mean // 2, mean * 3 // 2 + 1, (1,), generator=generator))
        ids[start : start + size] = doc
        start, doc = start + size, doc + 1
    return ids


def qkv_mask(kind: str, shape: Shape, settings: Settings) -> dict[str, Any]:
    """qkv's options for a mask kind."""
    if kind == "causal":
        return {"is_causal": True}
    if kind == "window":
        return {"mask": masks.sliding_window(settings.window)}
    if kind == "documents":
        ids = _documents(shape.length, settings.document)
        return {"mask": masks.document(ids) & masks.causal()}
    return {}


def torch_mask_mod(kind: str, shape: Shape, settings: Settings) -> Callable[..., Any] | None:
    """The same mask written for FlexAttention by hand, as its users write it."""
    window = settings.window
    if kind == "causal":
        return lambda b, h, q, kv: q >= kv
    if kind == "window":
        return lambda b, h, q, kv: (q >= kv) & (q - kv <= window)
    if kind == "documents":
        ids = _documents(shape.length, settings.document).to(settings.device)
        return lambda b, h, q, kv: (ids[q] == ids[kv]) & (q >= kv)
    return None


def visible_share(kind: str, shape: Shape, settings: Settings) -> float:
    """The share of (query, key) pairs the mask allows (counted row by row, in O(N))."""
    n = shape.length
    rows = torch.arange(n, dtype=torch.float64)
    if kind == "dense":
        return 1.0
    if kind == "causal":
        return float((rows + 1).sum()) / n**2
    if kind == "window":
        return float(torch.clamp(rows + 1, max=settings.window + 1).sum()) / n**2
    ids = _documents(n, settings.document)
    starts = torch.searchsorted(ids, ids, right=False).to(torch.float64)  # first of each doc
    return float((rows - starts + 1).sum()) / n**2


@dataclass
class Cell:
    forward: float | str
    training: float | str


def _peers(kind: str, shape: Shape, settings: Settings) -> dict[str, Callable[..., Any]]:
    """name → function(q, k, v) for this case."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    options = qkv_mask(kind, shape, settings)
    mask_mod = torch_mask_mod(kind, shape, settings)
    n = shape.length
    peers: dict[str, Callable[..., Any]] = {}
    if kind in ("dense", "causal"):
        causal = kind == "causal"
        flash = SDPBackend.FLASH_ATTENTION if settings.device.type == "cuda" else SDPBackend.MATH

        def sdpa(q: Any, k: Any, v: Any) -> Any:
            with sdpa_kernel(flash):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        peers["sdpa-flash"] = sdpa

        def sdpa_default(q: Any, k: Any, v: Any) -> Any:  # SDPA's own choice (cuDNN on Hopper)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        peers["sdpa-default"] = sdpa_default
    elif n * n <= 1 << 28:  # a boolean (N, N) mask array of at most 256 MiB
        rule = options["mask"]
        dense = rule.dense(n, n, xp=_torch_xp(), device=settings.device)

        def sdpa_masked(q: Any, k: Any, v: Any) -> Any:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)

        peers["sdpa-mask"] = sdpa_masked
    # as FlexAttention's own benchmarks do: room for one compilation per case (torch's
    # default of 8 would send later cases to uncompiled flex_attention)
    raise_recompile_limits()
    compiled = torch.compile(flex_attention)
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, None, None, n, n, device=settings.device)

    def flex(q: Any, k: Any, v: Any) -> Any:
        return compiled(q, k, v, block_mask=block_mask)

    peers["flex-direct"] = flex

    def ours(q: Any, k: Any, v: Any) -> Any:
        return qkv.scaled_dot_product_attention(q, k, v, **options)

    peers["qkv-auto"] = ours
    return peers


def _torch_xp() -> Any:
    import array_api_compat.torch as torch_xp

    return torch_xp


def measure_case(shape: Shape, kind: str, settings: Settings) -> dict[str, Cell]:
    """Forward and forward + backward seconds of every peer for one case."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (
        torch.randn(shape.batch, shape.heads, shape.length, shape.dim, generator=generator).to(
            device=settings.device, dtype=settings.dtype
        )
        for _ in range(3)
    )
    cells: dict[str, Cell] = {}
    grad = torch.randn_like(q)
    for name, peer in _peers(kind, shape, settings).items():

        def forward(peer: Callable[..., Any] = peer) -> float:
            with torch.no_grad():
                return timed(lambda: peer(q, k, v), settings.device, settings.repeats)

        def training(peer: Callable[..., Any] = peer, name: str = name) -> float:
            if settings.device.type == "cpu" and name == "flex-direct":
                raise NotImplementedError("no FlexAttention backward on CPU")
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]

            def step() -> object:
                out = peer(*leaves)
                return torch.autograd.grad(out, leaves, grad)

            return timed(step, settings.device, settings.repeats)

        cells[name] = Cell(attempt(forward), attempt(training))
    return cells


def _fmt_time(value: float | str) -> str:
    return f"{value * 1e3:.2f}" if isinstance(value, float) else f"— ({value})"


def attention_section(settings: Settings, rate: float) -> None:
    settings.emit("## Attention: qkv auto against SDPA (flash) and compiled FlexAttention")
    settings.emit()
    settings.emit(
        f"{device_name(settings.device)}, {settings.dtype}, torch {torch.__version__}; "
        f"matrix-product rate measured: {rate / 1e12:.1f} TFLOP/s. Window: {settings.window} "
        f"keys before each query; documents: packed, about {settings.document} tokens each, "
        "causal inside. qkv/best: the faster peer's time over qkv's (throughput; target "
        "≥ 0.95)."
    )
    settings.emit()
    settings.emit(
        "| shape | mask | visible | pass | peer | ms | TFLOP/s | of peak | vs dense | qkv/best |"
    )
    settings.emit("|---|---|---:|---|---|---:|---:|---:|---:|---:|")
    for shape in settings.shapes:
        dense_time: dict[tuple[str, str], float] = {}
        for kind in settings.masks:
            share = visible_share(kind, shape, settings)
            cells = measure_case(shape, kind, settings)
            flops = 4.0 * shape.batch * shape.heads * shape.length**2 * shape.dim * share
            for which, factor in (("forward", 1.0), ("training", 3.5)):
                times = {n: getattr(c, which) for n, c in cells.items()}
                peers = [t for n, t in times.items() if n != "qkv-auto" and isinstance(t, float)]
                best = min(peers) if peers else None
                ours = times.get("qkv-auto")
                for name, seconds in times.items():
                    key = (name.split("-")[0], which)  # sdpa-mask against sdpa-flash dense
                    if kind == "dense" and isinstance(seconds, float):
                        dense_time[key] = seconds
                    if isinstance(seconds, float):
                        tflops = factor * flops / seconds / 1e12
                        of_peak = f"{factor * flops / seconds / rate:.0%}"
                        base = dense_time.get(key)
                        versus = f"{seconds / base:.2f}" if base else "—"
                        rate_text = f"{tflops:.1f}"
                    else:
                        rate_text = of_peak = versus = "—"
                    ratio = "—"
                    if name == "qkv-auto" and best is not None and isinstance(ours, float):
                        ratio = f"{best / ours:.2f}"
                    settings.emit(
                        f"| {shape} | {kind} | {share:.1%} | {which} | {name} | "
                        f"{_fmt_time(seconds)} | {rate_text} | {of_peak} | {versus} | {ratio} |"
                    )
            if settings.device.type == "cuda":
                torch.cuda.empty_cache()
    settings.emit()


# -- a training step of a small transformer --------------------------------------------------------


class _Block(torch.nn.Module):
    """A pre-norm transformer block around either attention module."""

    def __init__(self, width: int, heads: int, ours: bool) -> None:
        super().__init__()
        self.ours = ours
        self.norm1 = torch.nn.LayerNorm(width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.attn: torch.nn.Module = (
            MultiHeadAttention(width, heads)
            if ours
            else torch.nn.MultiheadAttention(width, heads, batch_first=True)
        )
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        if self.ours:
            attended = self.attn(h, is_causal=True)
        else:
            n = h.shape[1]
            mask = torch.ones(n, n, dtype=torch.bool, device=h.device).triu(1)
            attended, _ = self.attn(h, h, h, attn_mask=mask, is_causal=True, need_weights=False)
        x = x + attended
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


def _model(width: int, heads: int, layers: int, ours: bool, settings: Settings) -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(_Block(width, heads, ours) for _ in range(layers))).to(
        device=settings.device, dtype=settings.dtype
    )


def mha_section(settings: Settings) -> None:
    width, heads, layers = (64, 4, 2) if settings.smoke else (1024, 16, 4)
    batch, length = (2, 64) if settings.smoke else (8, 2048)
    settings.emit("## A training step: qkv.nn.MultiHeadAttention against torch's")
    settings.emit()
    settings.emit(
        f"{device_name(settings.device)}, {settings.dtype}: {layers} pre-norm causal blocks, "
        f"E = {width}, H = {heads}, B = {batch}, N = {length}; forward, backward, AdamW step."
    )
    settings.emit()
    settings.emit("| attention module | ms per step | qkv / torch |")
    settings.emit("|---|---:|---:|")
    x = torch.randn(batch, length, width, device=settings.device, dtype=settings.dtype)
    results: dict[str, float | str] = {}
    for name, ours in (("torch.nn.MultiheadAttention", False), ("qkv.nn.MultiHeadAttention", True)):
        model = _model(width, heads, layers, ours, settings)
        optimiser = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model: Any = model, optimiser: Any = optimiser) -> None:
            optimiser.zero_grad(set_to_none=True)
            model(x).float().square().mean().backward()
            optimiser.step()

        def measured(step: Callable[[], None] = step) -> float:
            return timed(step, settings.device, settings.repeats)

        results[name] = attempt(measured)
    theirs = results["torch.nn.MultiheadAttention"]
    for name, seconds in results.items():
        ratio = (
            f"{seconds / theirs:.2f}"
            if isinstance(seconds, float) and isinstance(theirs, float)
            else "—"
        )
        settings.emit(f"| {name} | {_fmt_time(seconds)} | {ratio} |")
    settings.emit()


# -- tracing one head ------------------------------------------------------------------------------


def trace_section(settings: Settings) -> None:
    width, heads, layers = (64, 4, 2) if settings.smoke else (1024, 16, 4)
    batch, length = (1, 64) if settings.smoke else (1, 8192)
    settings.emit("## Tracing one head of one layer")
    settings.emit()
    settings.emit(
        f"{device_name(settings.device)}, {settings.dtype}: the model of the training step "
        f"(N = {length}), forward under torch.no_grad(); traced: layer 0, head 0, the last "
        "query row (recorded on the CPU)."
    )
    settings.emit()
    settings.emit("| run | ms | vs untraced |")
    settings.emit("|---|---:|---:|")
    model = _model(width, heads, layers, True, settings).eval()
    x = torch.randn(batch, length, width, device=settings.device, dtype=settings.dtype)

    def plain() -> object:
        with torch.no_grad():
            return model(x)

    def traced() -> object:
        with torch.no_grad(), qkv.tracing(model=model, layers=0, heads=[0], queries=[-1]):
            return model(x)

    base = attempt(lambda: timed(plain, settings.device, settings.repeats))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cost = attempt(lambda: timed(traced, settings.device, settings.repeats))
    settings.emit(f"| untraced | {_fmt_time(base)} | 1.00 |")
    ratio = f"{cost / base:.2f}" if isinstance(cost, float) and isinstance(base, float) else "—"
    settings.emit(f"| one head, one row traced | {_fmt_time(cost)} | {ratio} |")
    settings.emit()


# -- the dispatch overhead of auto ---------------------------------------------------------------


def dispatch_section(settings: Settings) -> None:
    shapes = (
        (Shape(1, 2, 16, 64),)
        if settings.smoke
        else (Shape(1, 8, 64, 128), Shape(4, 16, 64, 1024), Shape(8, 16, 128, 2048))
    )
    calls = 10 if settings.smoke else 200
    settings.emit("## The dispatch overhead of auto")
    settings.emit()
    settings.emit(
        f"{device_name(settings.device)}, {settings.dtype}: {calls} calls in a row, one "
        "synchronisation at the end, µs per call (median of 5). overhead: qkv's time minus "
        "SDPA's, for the same mask."
    )
    settings.emit()
    settings.emit("| shape | mask | SDPA direct | qkv auto | overhead | explain_dispatch alone |")
    settings.emit("|---|---|---:|---:|---:|---:|")
    runs: dict[str, Callable[..., Any]] = {
        "sdpa": torch.nn.functional.scaled_dot_product_attention,
        "qkv": qkv.scaled_dot_product_attention,
        "explain": qkv.explain_dispatch,
    }
    for shape in shapes:
        generator = torch.Generator().manual_seed(0)
        q, k, v = (
            torch.randn(shape.batch, shape.heads, shape.length, shape.dim, generator=generator).to(
                device=settings.device, dtype=settings.dtype
            )
            for _ in range(3)
        )
        for causal in (False, True):
            seconds: dict[str, float | str] = {}
            for name, function in runs.items():
                call = functools.partial(function, q, k, v, is_causal=causal)
                with torch.no_grad():
                    seconds[name] = attempt(
                        functools.partial(per_call, call, settings.device, calls)
                    )
            theirs, ours, alone = seconds["sdpa"], seconds["qkv"], seconds["explain"]
            extra = (
                f"{(ours - theirs) * 1e6:+.1f}"
                if isinstance(ours, float) and isinstance(theirs, float)
                else "—"
            )
            settings.emit(
                f"| {shape} | {'causal' if causal else 'dense'} | {_fmt_us(theirs)} | "
                f"{_fmt_us(ours)} | {extra} | {_fmt_us(alone)} |"
            )
    settings.emit()


def _fmt_us(value: float | str) -> str:
    return f"{value * 1e6:.1f}" if isinstance(value, float) else f"— ({value})"


# -- tracing a Hugging Face model ------------------------------------------------------------------


def hf_section(settings: Settings) -> None:
    try:
        from transformers import LlamaConfig, LlamaModel
    except ImportError:
        settings.emit("## Tracing a Hugging Face model: skipped (transformers is not installed)")
        settings.emit()
        return
    hidden, heads, kv_heads, layers = (64, 4, 2, 2) if settings.smoke else (768, 12, 4, 12)
    lengths = (32,) if settings.smoke else (1024, 4096)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max(lengths),
    )
    torch.manual_seed(0)
    model: Any = LlamaModel(config)
    model = model.to(settings.device).eval()  # float32
    settings.emit("## Tracing one head of a Hugging Face model")
    settings.emit()
    settings.emit(
        f"{device_name(settings.device)}, float32: a Llama-like model, {layers} layers, hidden "
        f"{hidden}, {heads} heads, {kv_heads} key/value heads, random weights; B = 1. traced: "
        "the last layer, head 0, the last query row. max |Δ| vs eager: the traced model's "
        "output and the recorded row against eager with output_attentions."
    )
    settings.emit()
    settings.emit("| N | run | ms | vs sdpa | max \\|Δ\\| output | max \\|Δ\\| row |")
    settings.emit("|---:|---|---:|---:|---:|---:|")
    for length in lengths:
        for line in _hf_rows(model, length, settings):
            settings.emit(line)
        if settings.device.type == "cuda":
            torch.cuda.empty_cache()
    model.set_attn_implementation("sdpa")
    settings.emit()


def _hf_rows(model: Any, length: int, settings: Settings) -> list[str]:
    """The table rows of one length: untraced SDPA, one traced head and row, eager with
    every weight; the traced output and row against eager's."""
    ids = torch.randint(0, 1000, (1, length), generator=torch.Generator().manual_seed(1))
    ids = ids.to(settings.device)

    def run(implementation: str, weights: bool = False) -> Any:
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            return model(input_ids=ids, output_attentions=weights)

    def traced() -> tuple[Any, Any]:
        model.set_attn_implementation("sdpa")  # tracing puts qkv's in, then restores it
        with torch.no_grad(), qkv.tracing(model=model, layers=-1, heads=0, queries=-1) as trace:
            out = model(input_ids=ids)
        return out, trace

    eager = attempt(lambda: run("eager", weights=True))
    out, trace = traced()
    output_error = row_error = "—"
    if not isinstance(eager, str):
        difference = out.last_hidden_state - eager.last_hidden_state
        output_error = f"{float(difference.abs().max()):.1e}"
        row = torch.from_numpy(trace["weights"].value[0, 0, 0])
        row_error = f"{float((row - eager.attentions[-1][0, 0, -1].cpu()).abs().max()):.1e}"
        del eager
    cases: dict[str, Callable[[], object]] = {
        "sdpa, untraced": lambda: run("sdpa"),
        "qkv.tracing, 1 head x 1 row": traced,
        "eager + output_attentions": lambda: run("eager", weights=True),
    }
    times = {
        name: attempt(functools.partial(timed, case, settings.device, settings.repeats))
        for name, case in cases.items()
    }
    base = times["sdpa, untraced"]
    rows = []
    for name, seconds in times.items():
        ratio = (
            f"{seconds / base:.2f}"
            if isinstance(seconds, float) and isinstance(base, float)
            else "—"
        )
        errors = f"{output_error} | {row_error}" if name.startswith("qkv") else " | "
        rows.append(f"| {length} | {name} | {_fmt_time(seconds)} | {ratio} | {errors} |")
    return rows


# -- decoding with a KV cache ----------------------------------------------------------------------


def decode_section(settings: Settings) -> None:
    width, heads = (64, 4) if settings.smoke else (2048, 16)
    batch = 1 if settings.smoke else 8
    prompt, steps = (32, 8) if settings.smoke else (4096, 64)
    settings.emit("## Decoding with qkv.nn.KVCache")
    settings.emit()
    settings.emit(
        f"{device_name(settings.device)}, {settings.dtype}: one MultiHeadAttention, E = {width}, "
        f"H = {heads}, B = {batch}; a prompt of {prompt} tokens, then {steps} tokens one at a "
        "time with the cache, against recomputing the causal pass over every token so far."
    )
    settings.emit()
    settings.emit("| run | ms per token | vs recompute |")
    settings.emit("|---|---:|---:|")
    torch.manual_seed(0)
    attn = MultiHeadAttention(width, heads).to(device=settings.device, dtype=settings.dtype).eval()
    tokens = torch.randn(batch, prompt + steps, width, device=settings.device, dtype=settings.dtype)

    def cached() -> object:
        cache = KVCache()
        with torch.no_grad():
            attn(tokens[:, :prompt], is_causal=True, cache=cache)
            for i in range(prompt, prompt + steps):
                attn(tokens[:, i : i + 1], is_causal=True, cache=cache)
        return cache

    def prefill() -> object:
        with torch.no_grad():
            return attn(tokens[:, :prompt], is_causal=True, cache=KVCache())

    def recompute() -> object:
        with torch.no_grad():
            return [attn(tokens[:, : i + 1], is_causal=True) for i in range(prompt, prompt + steps)]

    total = attempt(lambda: timed(cached, settings.device, settings.repeats))
    first = attempt(lambda: timed(prefill, settings.device, settings.repeats))
    again = attempt(lambda: timed(recompute, settings.device, settings.repeats))
    per_token: float | str = "—"
    if isinstance(total, float) and isinstance(first, float):
        per_token = max(total - first, 0.0) / steps
    per_recompute = again / steps if isinstance(again, float) else again
    ratio = (
        f"{per_token / per_recompute:.2f}"
        if isinstance(per_token, float) and isinstance(per_recompute, float)
        else "—"
    )
    settings.emit(f"| KVCache, one token | {_fmt_time(per_token)} | {ratio} |")
    settings.emit(f"| recompute, one token | {_fmt_time(per_recompute)} | 1.00 |")
    settings.emit()


# -- the run --------------------------------------------------------------------------------------


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, seconds")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per figure")
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        help="attention shapes as B,H,D,N (default: six from 8,16,64,4096 to 1,16,128,65536)",
    )
    parser.add_argument(
        "--masks", nargs="+", choices=MASK_KINDS, default=list(MASK_KINDS), help="mask kinds"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the tables here")
    return parser.parse_args(argv)


def _shape(text: str) -> Shape:
    try:
        batch, heads, dim, length = (int(n) for n in text.split(","))
    except ValueError:
        raise SystemExit(
            f"--shapes: expected B,H,D,N such as 1,16,128,65536, got {text!r}"
        ) from None
    return Shape(batch, heads, dim, length)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
    elif torch.cuda.is_available():
        device, dtype = torch.device("cuda"), torch.bfloat16
    else:
        print("bench_gpu.py needs a CUDA GPU; --smoke runs tiny sizes on the CPU", file=sys.stderr)
        return 2
    shapes = tuple(_shape(s) for s in args.shapes) if args.shapes else None
    settings = Settings(
        device=device,
        dtype=dtype,
        repeats=args.repeats or (1 if args.smoke else 10),
        shapes=shapes or (SMOKE_SHAPES if args.smoke else FULL_SHAPES),
        smoke=args.smoke,
        window=32 if args.smoke else WINDOW,
        document=64 if args.smoke else DOCUMENT,
        out=args.out,
        masks=tuple(args.masks),
    )
    if args.out is not None:
        args.out.write_text("", encoding="utf-8")
    settings.emit(f"# qkv on {device_name(device)}")
    settings.emit()
    settings.emit(
        f"torch {torch.__version__}, qkv {qkv.__version__}, Python {platform.python_version()}; "
        f"median of {settings.repeats} timed calls after a warm-up (compilation) call."
    )
    settings.emit()
    # torch.compile's warnings stay visible: they say when a peer ran uncompiled
    if "attention" in args.only:
        attention_section(settings, matmul_rate(settings))
    if "dispatch" in args.only:
        dispatch_section(settings)
    if "mha" in args.only:
        mha_section(settings)
    if "trace" in args.only:
        trace_section(settings)
    if "hf" in args.only:
        hf_section(settings)
    if "decode" in args.only:
        decode_section(settings)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
