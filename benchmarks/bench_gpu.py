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
- trace: one head and one query row of one layer traced (``qkv.tracing(model=...)``)
  against the untraced forward.
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
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import qkv
from qkv import masks
from qkv.nn import KVCache, MultiHeadAttention

SECTIONS = ("attention", "mha", "trace", "decode")
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
    document: int = DOCUMENT
    lines: list[str] = field(default_factory=list)

    def emit(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)


# -- timing --------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def attempt(run: Callable[[], float]) -> float | str:
    """A measurement, or a short reason it could not be taken (out of memory, an error)."""
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
    elif n * n <= 1 << 28:  # a boolean (N, N) mask array of at most 256 MiB
        rule = options["mask"]
        dense = rule.dense(n, n, xp=_torch_xp(), device=settings.device)

        def sdpa_masked(q: Any, k: Any, v: Any) -> Any:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)

        peers["sdpa-mask"] = sdpa_masked
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
        for kind in MASK_KINDS:
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
    )
    settings.emit(f"# qkv on {device_name(device)}")
    settings.emit()
    settings.emit(
        f"torch {torch.__version__}, qkv {qkv.__version__}, Python {platform.python_version()}; "
        f"median of {settings.repeats} timed calls after a warm-up (compilation) call."
    )
    settings.emit()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.compile.*")
        if "attention" in args.only:
            attention_section(settings, matmul_rate(settings))
        if "mha" in args.only:
            mha_section(settings)
        if "trace" in args.only:
            trace_section(settings)
        if "decode" in args.only:
            decode_section(settings)
    if args.out is not None:
        args.out.write_text("\n".join(settings.lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
