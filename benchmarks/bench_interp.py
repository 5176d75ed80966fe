"""qkv inside TransformerLens and nnsight: the memory of a forward pass and of one head's
pattern, beside the tools' own eager attention, measured in one run.

A GPT-2-like model (hidden size 768, 12 heads, 4 layers by default, float32, random weights
built from its config and saved with ``save_pretrained`` to a temporary folder, beside a
WordLevel tokenizer: nothing is downloaded) is loaded twice by each tool: as the tool
loads it (TransformerLens 4's ``TransformerBridge.boot_transformers`` forces eager; nnsight's
``LanguageModel`` is given ``attn_implementation="eager"``, what reading a pattern in
nnsight needs), and switched with ``qkv.interp.use_qkv``. At each N (B = 1):

- forward: the logits, nothing hooked;
- pattern of 1 head: the last row of head 0 in layer 0. TransformerLens:
  ``run_with_cache(names_filter="blocks.0.attn.hook_pattern")``, which on eager holds
  (B, H, N, N) and forms one per layer; with qkv inside ``qkv.tracing(model=bridge,
  layers=0, heads=0, queries=-1)``, where ``hook_pattern`` fires with that row (B, 1, 1, N).
  nnsight: on eager the model's ``output_attentions`` (every layer's (B, H, N, N)); with
  qkv, ``qkv.tracing`` around ``model.trace``.

The floor beside them: the same model's own ``attn_implementation="sdpa"`` forward in
transformers, no tool, no hook. Peak: the most memory the call added at any moment,
measured by the operating system (``qkv.bench.peak_memory``: PyTorch's CPU tensors are
invisible to tracemalloc), after handing freed memory back to the system. Time: one run
each (a rough figure on a busy machine; the memory is the point). Before measuring, the
script checks that both give the same logits and the same pattern row.

Usage:
    python benchmarks/bench_interp.py                  # N = 1024, 2048, 4096
    python benchmarks/bench_interp.py --quick          # a smoke run: 2 small layers, N = 32
    python benchmarks/bench_interp.py --lengths 8192 --layers 12 --threads 2
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from nnsight import LanguageModel
from tokenizers import Tokenizer, models, pre_tokenizers
from transformer_lens.model_bridge import TransformerBridge
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

import qkv
from qkv.bench import peak_memory
from qkv.interp import use_qkv

HEADER = (
    "| N | tool | case | eager peak (MiB) | qkv peak (MiB) | sdpa, no tool (MiB) "
    "| eager time (s) | qkv time (s) |"
)
TOLERANCE = 1e-4  # float32 through the layers: what the check before measuring allows


def save_model(folder: Path, *, hidden: int, heads: int, layers: int, positions: int) -> Path:
    """A random GPT-2 of this size and a WordLevel tokenizer over a few words, saved."""
    words = ["[UNK]", "[PAD]", *(f"w{i}" for i in range(62))]
    config = GPT2Config(
        vocab_size=len(words), n_embd=hidden, n_head=heads, n_layer=layers,
        n_positions=positions, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    GPT2LMHeadModel(config).train(False).save_pretrained(folder)
    tokens = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokens.pre_tokenizer = pre_tokenizers.Whitespace()
    fast_tokenizer: Any = PreTrainedTokenizerFast  # untyped in transformers
    fast_tokenizer(tokenizer_object=tokens, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(
        folder
    )
    return folder


def _release() -> None:
    """Hand the memory freed by earlier runs back to the system (glibc's ``malloc_trim``)."""
    gc.collect()
    with contextlib.suppress(AttributeError, OSError):  # not glibc: as it is
        ctypes.CDLL(None).malloc_trim(0)


def measure(call: Callable[[], Any]) -> tuple[int, float, Any]:
    """(peak bytes added, seconds, result) of one call."""
    seconds = []

    def timed() -> Any:
        start = time.perf_counter()
        result = call()
        seconds.append(time.perf_counter() - start)
        return result

    _release()
    peak, result = peak_memory(timed)
    return peak, seconds[0], result


def lens_cases(
    eager: Any, fast: Any, ids: torch.Tensor
) -> dict[str, tuple[Callable[[], Any], ...]]:
    """TransformerLens: (eager, qkv) callables per case; each returns (logits, pattern row)."""
    name = "blocks.0.attn.hook_pattern"

    def forward(bridge: Any) -> Callable[[], Any]:
        def run() -> Any:
            with torch.no_grad():
                return bridge(ids), None

        return run

    def pattern_eager() -> Any:
        with torch.no_grad():
            logits, cache = eager.run_with_cache(ids, names_filter=name)
        return logits, cache[name][0, 0, -1]

    def pattern_fast() -> Any:
        with torch.no_grad(), qkv.tracing(model=fast, layers=0, heads=0, queries=-1):
            logits, cache = fast.run_with_cache(ids, names_filter=name)
        return logits, cache[name][0, 0, 0]

    return {
        "forward": (forward(eager), forward(fast)),
        "pattern of 1 head": (pattern_eager, pattern_fast),
    }


def nnsight_cases(
    eager: Any, fast: Any, ids: torch.Tensor
) -> dict[str, tuple[Callable[[], Any], ...]]:
    """nnsight: (eager, qkv) callables per case; each returns (logits, pattern row)."""

    def forward(model: Any) -> Callable[[], Any]:
        def run() -> Any:
            with torch.no_grad(), model.trace(ids):
                logits = model.lm_head.output.save()
            return logits, None

        return run

    def pattern_eager() -> Any:
        with torch.no_grad():
            out = eager._module(ids, output_attentions=True)
        return out.logits, out.attentions[0][0, 0, -1]

    def pattern_fast() -> Any:
        selected = qkv.tracing(model=fast, layers=0, heads=0, queries=-1)
        with torch.no_grad(), selected as t, fast.trace(ids):
            logits = fast.lm_head.output.save()
        return logits, torch.from_numpy(t["weights"].value[0, 0, 0])

    return {
        "forward": (forward(eager), forward(fast)),
        "pattern of 1 head": (pattern_eager, pattern_fast),
    }


def run(folder: Path, lengths: Sequence[int]) -> list[str]:
    """The table's rows, every case at every length."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # LanguageModel's deprecation notice in nnsight 0.8
        tools = {
            "TransformerLens": (
                TransformerBridge.boot_transformers(str(folder), device="cpu"),
                TransformerBridge.boot_transformers(str(folder), device="cpu"),
                lens_cases,
            ),
            "nnsight": (
                LanguageModel(str(folder), device_map="cpu", dispatch=True,
                              attn_implementation="eager"),
                LanguageModel(str(folder), device_map="cpu", dispatch=True),
                nnsight_cases,
            ),
        }  # fmt: skip
    plain = GPT2LMHeadModel.from_pretrained(folder, attn_implementation="sdpa").train(False)
    baseline = {}  # the model's own sdpa forward, no tool: the floor at each N
    for length in lengths:
        ids = torch.randint(2, 64, (1, length))

        def forward(ids: torch.Tensor = ids) -> Any:
            with torch.no_grad():
                return plain(ids).logits

        baseline[length] = measure(forward)[0]
    rows = []
    for tool, (eager, fast, cases) in tools.items():
        use_qkv(fast)
        for length in lengths:
            ids = torch.randint(2, 64, (1, length))
            for case, (slow_call, fast_call) in cases(eager, fast, ids).items():
                slow_peak, slow_time, (slow_logits, slow_row) = measure(slow_call)
                fast_peak, fast_time, (fast_logits, fast_row) = measure(fast_call)
                worst = float((fast_logits - slow_logits).abs().max())
                if slow_row is not None:
                    worst = max(worst, float((fast_row - slow_row).abs().max()))
                if worst > TOLERANCE:
                    sys.exit(f"{tool} {case} at N = {length}: qkv is {worst:.1e} from eager")
                floor = f"{baseline[length] / 2**20:.0f}" if case == "forward" else "-"
                rows.append(
                    f"| {length} | {tool} | {case} | {slow_peak / 2**20:.0f} | "
                    f"{fast_peak / 2**20:.0f} | {floor} | {slow_time:.2f} | {fast_time:.2f} |"
                )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--lengths", type=int, nargs="+", help="sequence lengths N (1024 2048 4096)"
    )
    parser.add_argument("--layers", type=int, help="layers of the model (4)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 small layers, N=32")
    args = parser.parse_args(argv)
    lengths = args.lengths or ([32] if args.quick else [1024, 2048, 4096])
    if min(lengths) < 2:
        parser.error("--lengths must be at least 2")
    if args.threads:
        torch.set_num_threads(args.threads)
    hidden, heads = (32, 4) if args.quick else (768, 12)
    layers = args.layers or (2 if args.quick else 4)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_model(
            Path(tmp), hidden=hidden, heads=heads, layers=layers, positions=max(lengths)
        )
        print(
            f"torch {torch.__version__}, qkv {qkv.__version__}, {torch.get_num_threads()} "
            f"threads; GPT-2, {layers} layers, {heads} heads, hidden {hidden}, float32, B = 1",
            file=sys.stderr,
        )
        print("\n".join([HEADER, "|---|---|---|---|---|---|---|---|", *run(folder, lengths)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
