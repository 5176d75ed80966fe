"""qkv.nn.MultiHeadAttention against torch.nn.MultiheadAttention, in one run.

Both modules hold the same weights (``MultiHeadAttention.from_torch``) and see the same input;
torch's is called with ``need_weights=False`` (its fast path). For each sequence length L the
script prints the median time of

- forward: ``module.eval()`` under ``torch.no_grad()``;
- forward+backward: ``module.train()`` (dropout 0), ``out.sum().backward()`` w.r.t. the
  input and every weight;

and the ratio qkv / torch (below 1 means qkv is faster). The two modules alternate within each
repeat, so that a machine busy with something else slows both alike. Timings on a shared
machine are indicative: look at the ratios, not the milliseconds.

With ``--compile``, it measures models instead: a stack of ``--blocks`` pre-norm causal
transformer blocks (LayerNorm, attention, LayerNorm, MLP, both residual) built from
``qkv.nn.TransformerBlock`` and the same blocks built from ``torch.nn.MultiheadAttention``
(the same weights), each run eagerly and under ``torch.compile(model, fullgraph=True)``
(``--backend``, inductor by default), forward and forward+backward, in one run. Compiling
takes its time once per model, length and mode, before the timed runs.

Usage:
    python benchmarks/bench_mha.py                      # L = 512, 2048, 8192
    python benchmarks/bench_mha.py --lengths 512 1024 --repeats 9 --causal
    python benchmarks/bench_mha.py --device cuda --dtype bfloat16
    python benchmarks/bench_mha.py --compile --lengths 256 1024 --embed-dim 256 --heads 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.progress import Progress

import qkv
from qkv.nn import MultiHeadAttention, TransformerBlock


@dataclass
class Row:
    length: int
    forward: tuple[float, float]  # (torch, qkv) median seconds
    backward: tuple[float, float]

    @staticmethod
    def ratio(pair: tuple[float, float]) -> float:
        return pair[1] / pair[0]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(run: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    run()
    _sync(device)
    return time.perf_counter() - start


def measure(
    length: int,
    *,
    batch: int,
    embed_dim: int,
    heads: int,
    repeats: int,
    causal: bool,
    device: torch.device,
    dtype: torch.dtype,
    progress: Callable[[], None] = lambda: None,
) -> Row:
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(
        embed_dim, heads, batch_first=True, device=device, dtype=dtype
    )
    ours = MultiHeadAttention.from_torch(theirs)
    x = torch.randn(batch, length, embed_dim, device=device, dtype=dtype)
    torch_mask = (
        torch.ones(length, length, dtype=torch.bool, device=device).triu(1) if causal else None
    )

    def torch_forward(inp: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor
        out, _ = theirs(inp, inp, inp, need_weights=False, attn_mask=torch_mask, is_causal=causal)
        return out

    def qkv_forward(inp: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = ours(inp, is_causal=causal)
        return out

    with torch.no_grad():  # the same numbers, before timing anything
        difference = (torch_forward(x) - qkv_forward(x)).abs().max().item()
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    if difference > tolerance:
        raise SystemExit(f"qkv and torch disagree at L={length}: max difference {difference:.3g}")

    def inference(forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                return forward(x)

        return run

    def training(forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], object]:
        def run() -> object:
            inp = x.detach().requires_grad_()
            forward(inp).sum().backward()  # type: ignore[no-untyped-call]
            return inp.grad

        return run

    row: dict[str, tuple[float, float]] = {}
    for mode, wrap in (("forward", inference), ("backward", training)):
        for module in (theirs, ours):
            module.train(mode == "backward")
        runs = (wrap(torch_forward), wrap(qkv_forward))
        for run in runs:  # warm-up
            run()
        times: tuple[list[float], list[float]] = ([], [])
        for i in range(repeats):
            order = (0, 1) if i % 2 == 0 else (1, 0)  # alternate who goes first
            for which in order:
                times[which].append(_time(runs[which], device))
            progress()
        row[mode] = (statistics.median(times[0]), statistics.median(times[1]))
    return Row(length, row["forward"], row["backward"])


# -- models, eager and compiled ----------------------------------------------------------


class TorchBlock(torch.nn.Module):
    """``qkv.nn.TransformerBlock``'s layout with ``torch.nn.MultiheadAttention``."""

    def __init__(self, embed_dim: int, heads: int) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(embed_dim, heads, batch_first=True)
        self.attn_norm = torch.nn.LayerNorm(embed_dim)
        self.mlp_norm = torch.nn.LayerNorm(embed_dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(embed_dim, 4 * embed_dim),
            torch.nn.GELU(),
            torch.nn.Linear(4 * embed_dim, embed_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        attended, _ = self.attn(h, h, h, need_weights=False, is_causal=True, attn_mask=_causal(x))
        x = x + attended
        out: torch.Tensor = x + self.mlp(self.mlp_norm(x))
        return out


def _causal(x: torch.Tensor) -> torch.Tensor:
    """torch's True = ignore causal mask (its module wants one beside ``is_causal``)."""
    n = x.shape[1]
    return torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)


class QkvCausal(torch.nn.Module):
    """A qkv.nn.TransformerBlock called with ``is_causal=True``."""

    def __init__(self, block: TransformerBlock) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.block(x, is_causal=True)
        return out


def twin_models(
    blocks: int, embed_dim: int, heads: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(torch's model, qkv's model): the same weights, the same layout."""
    torch.manual_seed(0)
    torch_blocks = [TorchBlock(embed_dim, heads) for _ in range(blocks)]
    theirs = torch.nn.Sequential(*torch_blocks)
    ours = []
    for block in torch_blocks:
        mine = TransformerBlock(embed_dim, heads)
        mine.attn = MultiHeadAttention.from_torch(block.attn)
        for name in ("attn_norm", "mlp_norm", "mlp"):
            getattr(mine, name).load_state_dict(getattr(block, name).state_dict())
        ours.append(QkvCausal(mine))
    return (
        theirs.to(device=device, dtype=dtype),
        torch.nn.Sequential(*ours).to(device=device, dtype=dtype),
    )


@dataclass
class ModelRow:
    length: int
    mode: str  # "forward" or "fwd+bwd"
    times: dict[str, float]  # torch, torch compiled, qkv, qkv compiled: median seconds


MODELS = ("torch", "torch compiled", "qkv", "qkv compiled")


def measure_models(
    length: int,
    *,
    batch: int,
    blocks: int,
    embed_dim: int,
    heads: int,
    repeats: int,
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    progress: Callable[[], None] = lambda: None,
) -> list[ModelRow]:
    """The four models, forward and forward+backward, at one length."""
    theirs, ours = twin_models(blocks, embed_dim, heads, device, dtype)
    torch._dynamo.reset()
    models: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "torch": theirs,
        "torch compiled": torch.compile(theirs, fullgraph=True, backend=backend),
        "qkv": ours,
        "qkv compiled": torch.compile(ours, fullgraph=True, backend=backend),
    }
    x = torch.randn(batch, length, embed_dim, device=device, dtype=dtype)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    rows = []
    for mode in ("forward", "fwd+bwd"):
        for model in (theirs, ours):
            model.train(mode == "fwd+bwd")

        def run(
            model: Callable[[torch.Tensor], torch.Tensor], mode: str = mode
        ) -> Callable[[], object]:
            def once() -> object:
                if mode == "forward":
                    with torch.no_grad():
                        return model(x)
                inp = x.detach().requires_grad_()
                model(inp).sum().backward()  # type: ignore[no-untyped-call]
                return inp.grad

            return once

        runs = {name: run(model) for name, model in models.items()}
        with torch.no_grad():  # the same numbers (compiling the forward graphs as it goes)
            want = theirs(x)
            for name in MODELS[1:]:
                difference = (models[name](x) - want).abs().max().item()
                if difference > tolerance:
                    raise SystemExit(f"{name} disagrees at L={length}: {difference:.3g}")
        for warm_up in runs.values():  # (and the compilation of the training graphs)
            warm_up()
        times: dict[str, list[float]] = {name: [] for name in MODELS}
        for i in range(repeats):
            order = MODELS if i % 2 == 0 else MODELS[::-1]  # alternate who goes first
            for name in order:
                times[name].append(_time(runs[name], device))
            progress()
        rows.append(ModelRow(length, mode, {n: statistics.median(t) for n, t in times.items()}))
    return rows


def model_table(rows: Sequence[ModelRow]) -> str:
    lines = [
        "| L | mode | torch (ms) | torch compiled (ms) | qkv (ms) | qkv compiled (ms) "
        "| qkv compiled / qkv | qkv compiled / torch compiled |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ms = " | ".join(f"{r.times[name] * 1e3:.1f}" for name in MODELS)
        speed = r.times["qkv compiled"] / r.times["qkv"]
        against = r.times["qkv compiled"] / r.times["torch compiled"]
        lines.append(f"| {r.length} | {r.mode} | {ms} | {speed:.2f} | {against:.2f} |")
    return "\n".join(lines)


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| L | forward torch (ms) | forward qkv (ms) | ratio | fwd+bwd torch (ms) "
        "| fwd+bwd qkv (ms) | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.length} | {r.forward[0] * 1e3:.1f} | {r.forward[1] * 1e3:.1f} | "
            f"{Row.ratio(r.forward):.2f} | {r.backward[0] * 1e3:.1f} | "
            f"{r.backward[1] * 1e3:.1f} | {Row.ratio(r.backward):.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Example: python benchmarks/bench_mha.py --lengths 512 2048 --repeats 5",
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--embed-dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=9, help="timed runs per cell (median; 9)")
    parser.add_argument("--causal", action="store_true", help="causal self-attention")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--compile",
        action="store_true",
        help="models of --blocks causal blocks, eager and torch.compile'd, qkv and torch",
    )
    parser.add_argument("--blocks", type=int, default=2, help="blocks per model (--compile; 2)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (inductor)")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    console = Console(stderr=True)
    if args.compile:
        return _main_models(args, device, dtype, console)
    console.print(
        f"torch {torch.__version__}, qkv {qkv.__version__}, {args.device} "
        f"({torch.get_num_threads()} threads), {args.dtype}; B={args.batch}, "
        f"E={args.embed_dim}, H={args.heads}, causal={args.causal}, "
        f"median of {args.repeats}"
    )
    rows = []
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("timing", total=2 * args.repeats * len(args.lengths))
        for length in args.lengths:
            rows.append(
                measure(
                    length,
                    batch=args.batch,
                    embed_dim=args.embed_dim,
                    heads=args.heads,
                    repeats=args.repeats,
                    causal=args.causal,
                    device=device,
                    dtype=dtype,
                    progress=lambda: bar.advance(task),
                )
            )
    print(table(rows))
    print("ratio = qkv time / torch time (below 1: qkv is faster)", file=sys.stderr)
    return 0


def _main_models(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, console: Console
) -> int:
    console.print(
        f"torch {torch.__version__}, qkv {qkv.__version__}, {args.device} "
        f"({torch.get_num_threads()} threads), {args.dtype}; {args.blocks} causal blocks, "
        f"B={args.batch}, E={args.embed_dim}, H={args.heads}, torch.compile backend "
        f"{args.backend}, fullgraph; median of {args.repeats}"
    )
    rows = []
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("timing", total=2 * args.repeats * len(args.lengths))
        for length in args.lengths:
            rows += measure_models(
                length,
                batch=args.batch,
                blocks=args.blocks,
                embed_dim=args.embed_dim,
                heads=args.heads,
                repeats=args.repeats,
                backend=args.backend,
                device=device,
                dtype=dtype,
                progress=lambda: bar.advance(task),
            )
    print(model_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
