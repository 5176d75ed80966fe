"""The sweeps that ``qkv bench``'s patching section and ``benchmarks/bench_patching.py``
time: qkv's sweep, a forward per head, eager attention with hooks, TransformerLens and
nnsight, on one GPT-2 model of 12 layers and 12 heads (hidden 96, head size 8, vocabulary
512, random weights from its config; float32, B = 1), clean and corrupt prompts of N tokens.

``python -m qkv.edits._timing '{"length": 128, "repeats": 1}'`` measures one length in this
process and prints JSON (``qkv bench`` runs it in a fresh process: its section sits in the
layer below ``qkv.edits``). TransformerLens and nnsight run when they can be imported
(``qkv[interp]``); every table is checked against qkv's (to :data:`TOLERANCE`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from qkv.edits._intervene import intervene
from qkv.edits._patching import patching, path_patching, position_patching
from qkv.edits._record import record
from qkv.edits._specs import patch
from qkv.edits._sweep import Stop

__all__ = ["BY", "QKV", "TOLERANCE", "build", "measure", "positions", "sweeps"]

TOLERANCE = 1e-4
VOCAB = 512
QKV = "qkv.patching"

Table = list[list[float]]
Sweep = Callable[[Any, torch.Tensor, torch.Tensor], Table]


def build(quick: bool) -> Any:
    """The model: 12 layers x 12 heads, hidden 96 (quick: 2 layers x 4 heads, hidden 16)."""
    layers, heads, hidden = (2, 4, 16) if quick else (12, 12, 96)
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=1024,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model: Any = GPT2LMHeadModel(config)
    return model.eval()


def prompts(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(length)
    clean = torch.randint(0, VOCAB, (1, length), generator=generator)
    corrupt = clean.clone()
    corrupt[0, length // 2] = (corrupt[0, length // 2] + 1) % VOCAB
    return clean, corrupt


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[0, -1, 3] - logits[0, -1, 7]


def qkv_metric(logits: torch.Tensor) -> float:
    return float(metric(logits))


def _shape(model: Any) -> tuple[int, int, int]:
    config = model.config
    return config.n_layer, config.n_head, config.n_embd // config.n_head


@contextmanager
def _eager(model: Any) -> Iterator[None]:
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def qkv_sweep(model: Any, clean: torch.Tensor, corrupt: torch.Tensor) -> Table:
    values: Table = patching(model, clean, corrupt, qkv_metric).values
    return values


def positions(length: int) -> tuple[int, ...]:
    """The positions a sweep by position patches: the token before the changed one (where
    clean and corrupt agree), the changed token, one between it and the end, the last."""
    return (length // 2 - 1, length // 2, (3 * length) // 4, length - 1)


def qkv_position_sweep(model: Any, clean: torch.Tensor, corrupt: torch.Tensor) -> Table:
    """``qkv.edits.position_patching``: ``table[layer][i * heads + head]`` for
    ``positions(N)[i]``."""
    chosen = list(positions(int(clean.shape[1])))
    found = position_patching(model, clean, corrupt, qkv_metric, positions=chosen).values
    return [[value for at in layer for value in at] for layer in found]


def receiver(model: Any) -> tuple[int, int]:
    """The receiver of a sweep by path: the middle head of the third layer from the top."""
    layers, heads, _ = _shape(model)
    return max(layers - 3, 1), heads // 2


def qkv_path_sweep(model: Any, clean: torch.Tensor, corrupt: torch.Tensor) -> Table:
    """``qkv.edits.path_patching``: each earlier head to :func:`receiver`'s keys."""
    found: Table = path_patching(
        model, clean, corrupt, qkv_metric, receiver=receiver(model), through="keys"
    ).values
    return found


def hooks_path_sweep(model: Any, clean: torch.Tensor, corrupt: torch.Tensor) -> Table:
    """Path patching written with forward hooks on SDPA (Wang et al., 2022, as researchers
    write it for TransformerLens): per sender, (1) the corrupt run with the sender's slice of
    its ``c_proj`` input from the clean run and the heads between frozen to the corrupt run's,
    stopped at the receiver's ``c_attn``, whose key columns are kept; (2) the corrupt run with
    those columns swapped in and the receiver layer's other heads frozen."""
    blocks = model.transformer.h
    _, heads, width = _shape(model)
    at, head = receiver(model)
    outs = [block.attn.c_proj for block in blocks]
    target = blocks[at].attn.c_attn
    keys = slice(heads * width + head * width, heads * width + (head + 1) * width)
    runs: dict[str, dict[int, torch.Tensor]] = {}

    def keep(store: dict[int, torch.Tensor], i: int) -> Callable[..., None]:
        return lambda _, args: store.__setitem__(i, args[0].clone())

    def put(tensor: torch.Tensor, part: slice) -> Callable[..., tuple[torch.Tensor]]:
        def hook(_: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
            edited = args[0].clone()
            edited[..., part] = tensor[..., part]
            return (edited,)

        return hook

    def stop(seen: dict[str, torch.Tensor]) -> Callable[..., None]:
        def hook(_: Any, args: tuple[torch.Tensor, ...]) -> None:
            seen["keys"] = target.forward(args[0])[..., keys]
            raise Stop

        return hook

    def swap(seen: dict[str, torch.Tensor]) -> Callable[..., torch.Tensor]:
        def hook(_: Any, __: Any, out: torch.Tensor) -> torch.Tensor:
            out = out.clone()
            out[..., keys] = seen["keys"]
            return out

        return hook

    table = []
    with torch.no_grad():
        for name, inputs in (("clean", clean), ("corrupt", corrupt)):
            runs[name] = {}
            handles = [o.register_forward_pre_hook(keep(runs[name], i)) for i, o in enumerate(outs)]
            model(inputs)
            for handle in handles:
                handle.remove()
        others = [slice(h * width, (h + 1) * width) for h in range(heads) if h != head]
        for sender in range(at):
            row = []
            for h in range(heads):
                seen: dict[str, torch.Tensor] = {}
                part = slice(h * width, (h + 1) * width)
                handles = [outs[sender].register_forward_pre_hook(put(runs["clean"][sender], part))]
                handles += [
                    outs[i].register_forward_pre_hook(put(runs["corrupt"][i], slice(None)))
                    for i in range(sender + 1, at)
                ]
                handles.append(target.register_forward_pre_hook(stop(seen)))
                with contextlib.suppress(Stop):
                    model(corrupt)
                for handle in handles:
                    handle.remove()
                handles = [target.register_forward_hook(swap(seen))]
                handles += [
                    outs[at].register_forward_pre_hook(put(runs["corrupt"][at], other))
                    for other in others
                ]
                row.append(qkv_metric(model(corrupt).logits))
                for handle in handles:
                    handle.remove()
            table.append(row)
    return table


def per_head_sweep(model: Any, clean: torch.Tensor, corrupt: torch.Tensor) -> Table:
    source = record(model, clean)
    layers, heads, _ = _shape(model)
    table = []
    with torch.no_grad():
        for layer in range(layers):
            row = []
            for head in range(heads):
                with intervene(model, patch(layer, head, source)):
                    row.append(qkv_metric(model(corrupt).logits))
            table.append(row)
    return table


def eager_sweep(model: Any, clean: torch.Tensor, corrupt: torch.Tensor) -> Table:
    blocks = model.transformer.h
    _, heads, width = _shape(model)
    captured: dict[int, torch.Tensor] = {}

    def capture(index: int) -> Callable[..., None]:
        def hook(_: Any, args: tuple[torch.Tensor, ...]) -> None:
            captured[index] = args[0].clone()

        return hook

    def write(index: int, head: int) -> Callable[..., tuple[torch.Tensor, ...]]:
        part = slice(head * width, (head + 1) * width)

        def hook(_: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            edited = args[0].clone()
            edited[..., part] = captured[index][..., part]
            return (edited, *args[1:])

        return hook

    table = []
    with torch.no_grad(), _eager(model):
        handles = [
            b.attn.c_proj.register_forward_pre_hook(capture(i)) for i, b in enumerate(blocks)
        ]
        model(clean)
        for handle in handles:
            handle.remove()
        for i, block in enumerate(blocks):
            row = []
            for head in range(heads):
                handle = block.attn.c_proj.register_forward_pre_hook(write(i, head))
                row.append(qkv_metric(model(corrupt).logits))
                handle.remove()
            table.append(row)
    return table


def _quiet() -> contextlib.ExitStack:
    """No progress bars or warnings from the peers on the table's terminal."""
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def lens_peer(model: Any, by: str = "head") -> Sweep | None:
    """TransformerLens's sweep on a bridge to the same weights (None if not installed)."""
    if importlib.util.find_spec("transformer_lens") is None:
        return None
    from transformer_lens import patching
    from transformer_lens.model_bridge import TransformerBridge

    folder = tempfile.mkdtemp(prefix="qkv-bench-")
    model.save_pretrained(folder)
    logging.getLogger("transformer_lens").setLevel(logging.ERROR)
    with _quiet():
        bridge = TransformerBridge.boot_transformers(folder, tokenizer=None)
    bridge.eval()

    def sweep(_: Any, clean: torch.Tensor, corrupt: torch.Tensor) -> Table:
        with torch.no_grad(), _quiet():
            _, cache = bridge.run_with_cache(clean)
            found = patching.get_act_patch_attn_head_out_all_pos(bridge, corrupt, cache, metric)
        table: Table = found.tolist()
        return table

    def by_position(_: Any, clean: torch.Tensor, corrupt: torch.Tensor) -> Table:
        pd = importlib.import_module("pandas")  # TransformerLens's own dependency

        layers, heads, _ = _shape(model)
        chosen = positions(int(clean.shape[1]))
        rows = [(i, p, h) for i in range(layers) for p in chosen for h in range(heads)]
        index = pd.DataFrame(rows, columns=["layer", "pos", "head"])
        with torch.no_grad(), _quiet():
            _, cache = bridge.run_with_cache(clean)
            found = patching.generic_activation_patch(
                bridge, corrupt, cache, metric, patching.layer_pos_head_vector_patch_setter,
                "z", index_df=index,
            )  # fmt: skip
        flat: list[float] = found.tolist()
        width = len(chosen) * heads
        return [flat[i * width : (i + 1) * width] for i in range(layers)]

    return by_position if by == "position" else sweep


def nnsight_peer(model: Any, by: str = "head") -> Sweep | None:
    """An nnsight loop on the same model (None if not installed)."""
    if importlib.util.find_spec("nnsight") is None:
        return None
    from nnsight import LanguageModel
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t1")  # type: ignore[no-untyped-call]
    with _quiet():
        wrapped = LanguageModel(model, tokenizer=tokenizer)
    layers, heads, width = _shape(model)

    def sweep(_: Any, clean: torch.Tensor, corrupt: torch.Tensor) -> Table:
        kept: dict[int, Any] = {}
        table = []
        chosen: tuple[Any, ...] = (slice(None),)  # every position at once
        if by == "position":
            chosen = positions(int(clean.shape[1]))
        with torch.no_grad(), _quiet():
            with wrapped.trace(clean):
                for i in range(layers):
                    kept[i] = wrapped.transformer.h[i].attn.c_proj.input.save()
            for i in range(layers):
                row = []
                for at in chosen:
                    for head in range(heads):
                        part = slice(head * width, (head + 1) * width)
                        with wrapped.trace(corrupt):
                            z = wrapped.transformer.h[i].attn.c_proj.input
                            z[:, at, part] = kept[i][:, at, part]
                            out = wrapped.lm_head.output.save()
                        row.append(qkv_metric(out))
                table.append(row)
        return table

    return sweep


def _worst(ours: Table, theirs: Table) -> float:
    return max(
        abs(a - b) for ra, rb in zip(ours, theirs, strict=True) for a, b in zip(ra, rb, strict=True)
    )


BY = ("head", "position", "path")
"""What a sweep patches at a time: a head at every position, a head at one position (at
each of :func:`positions`), or a head's path to :func:`receiver`'s keys."""


def sweeps(model: Any, only: list[str] | None = None, by: str = "head") -> dict[str, Sweep]:
    """The sweeps to time, qkv's first; ``only``: those names (and qkv's). By position:
    qkv's, TransformerLens's and nnsight's; by path (which neither tool has), qkv's and
    hooks written out."""
    own: dict[str, dict[str, Sweep]] = {
        "head": {
            QKV: qkv_sweep,
            "qkv, a forward per head": per_head_sweep,
            "eager + hooks": eager_sweep,
        },
        "position": {QKV: qkv_position_sweep},
        "path": {QKV: qkv_path_sweep, "hooks, two runs per path": hooks_path_sweep},
    }
    found = dict(own[by])
    for name, make in (("TransformerLens", lens_peer), ("nnsight", nnsight_peer)):
        if (only and name not in only) or by == "path":  # neither has path patching
            continue
        peer = make(model, by)
        if peer is not None:
            found[name] = peer
    return {k: v for k, v in found.items() if not only or k == QKV or k in only}


def forwards(model: Any, name: str, by: str = "head") -> str:
    """The model runs of a sweep: qkv's, the clean and corrupt prompts then a batch per layer
    (from that layer up); the others, the clean prompt then a run per head (by position: per
    head and position)."""
    layers, heads, _ = _shape(model)
    if by == "path":
        senders = receiver(model)[0] * heads
        return f"2 + {2 * receiver(model)[0]} batches" if name == QKV else f"{2 * senders + 2}"
    runs = layers * heads * (len(positions(16)) if by == "position" else 1)
    return f"2 + {layers} batches" if name == QKV else f"{runs + 1}"


def measure(
    model: Any, found: dict[str, Sweep], length: int, repeats: int, clock: str = "wall"
) -> dict[str, float]:
    """The median seconds of each sweep at N = ``length``, the sweeps alternating; the first
    run of each is checked against qkv's table. ``clock``: ``"wall"`` (``perf_counter``) or
    ``"cpu"`` (this process's CPU time, ``process_time``: what a sweep costs on a machine
    shared with other jobs, all threads summed).

    Raises:
        RuntimeError: a sweep's table differs from qkv's by more than :data:`TOLERANCE`.
    """
    clean, corrupt = prompts(length)
    times: dict[str, list[float]] = {name: [] for name in found}
    tables: dict[str, Table] = {}
    now = time.process_time if clock == "cpu" else time.perf_counter
    for repeat in range(max(repeats, 1)):
        for name, sweep in found.items():
            start = now()
            table = sweep(model, clean, corrupt)
            times[name].append(now() - start)
            if repeat == 0:
                tables[name] = table
    for name, table in tables.items():
        worst = _worst(tables[QKV], table)
        if worst > TOLERANCE:
            raise RuntimeError(f"{name} differs from qkv by {worst:.2e} at N = {length}")
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def warm(model: Any, found: dict[str, Sweep]) -> None:
    """Run each sweep once on 8 tokens: imports, registrations and first calls."""
    for sweep in found.values():
        sweep(model, *prompts(8))


def _main(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    model = build(bool(spec.get("quick")))
    by = spec.get("by", "head")
    found = sweeps(model, spec.get("only"), by)
    warm(model, found)
    seconds = measure(
        model, found, int(spec["length"]), int(spec.get("repeats", 1)), spec.get("clock", "wall")
    )
    return {"seconds": seconds, "forwards": {name: forwards(model, name, by) for name in found}}


if __name__ == "__main__":
    print(json.dumps(_main(json.loads(sys.argv[1]))))
