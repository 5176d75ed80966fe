"""The training step of a small transformer on packed documents, for ``qkv bench``: qkv's
blocks given the documents' offsets (``cu_seqlens``) against the same model built from
``torch.nn.MultiheadAttention`` with the dense mask of the documents, and against qkv's
blocks on the documents padded to the longest.

One step: the forward of two pre-norm causal blocks (E = 256, H = 4, MLP 4·E, float32), a
mean-square loss, its backward to every weight, and an AdamW step. The documents: lengths
drawn in [256, 1024] (seed 0), causal each, attending only to themselves. The three models
start from the same weights, and the first step checks that they agree on the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from qkv.bench._measure import medians, ratios
from qkv.bench._results import Row, Settings, Table
from qkv.nn import TransformerBlock

__all__ = ["train_step_section"]

EMBED, HEADS, LAYERS = 256, 4, 2


def _lengths(settings: Settings) -> list[int]:
    count, low, high = (4, 64, 256) if settings.quick else (8, 256, 1024)
    generator = torch.Generator().manual_seed(0)
    return torch.randint(low, high + 1, (count,), generator=generator).tolist()


def _qkv_model() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(TransformerBlock(EMBED, HEADS) for _ in range(LAYERS))


def _torch_model(blocks: nn.ModuleList) -> nn.ModuleList:
    """The same blocks as torch's ``TransformerEncoderLayer`` (pre-norm, GELU), weights
    copied from qkv's."""
    layers = nn.ModuleList()
    for block in blocks:
        assert isinstance(block, TransformerBlock)
        attn, mlp = block.attn, block.mlp
        layer = nn.TransformerEncoderLayer(
            EMBED,
            HEADS,
            4 * EMBED,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        with torch.no_grad():
            layer.self_attn.in_proj_weight.copy_(torch.cat([p.weight for p in projections]))
            layer.self_attn.in_proj_bias.copy_(torch.cat([p.bias for p in projections]))
            layer.self_attn.out_proj.load_state_dict(attn.out_proj.state_dict())
            layer.norm1.load_state_dict(block.attn_norm.state_dict())
            layer.norm2.load_state_dict(block.mlp_norm.state_dict())
            layer.linear1.load_state_dict(mlp[0].state_dict())
            layer.linear2.load_state_dict(mlp[2].state_dict())
        layers.append(layer)
    return layers


def _step(model: nn.Module, forward: Callable[[], torch.Tensor]) -> Callable[[], float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = forward().pow(2).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        return float(loss.detach())

    return step


def train_step_section(settings: Settings, tick: Callable[[], None]) -> Table:
    """Time one training step of the three models (module docstring); ratios to packed."""
    lengths = _lengths(settings)
    total, longest = sum(lengths), max(lengths)
    generator = torch.Generator().manual_seed(1)
    packed = torch.randn(1, total, EMBED, generator=generator)
    cu_seqlens = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    padded = torch.zeros(len(lengths), longest, EMBED)
    for b, (start, n) in enumerate(zip(cu_seqlens[:-1], lengths, strict=True)):
        padded[b, :n] = packed[0, start : start + n]
    document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    positions = torch.arange(total)
    allowed = (document[:, None] == document[None, :]) & (positions[:, None] >= positions[None, :])

    qkv_packed, qkv_padded = _qkv_model(), _qkv_model()
    qkv_padded.load_state_dict(qkv_packed.state_dict())
    torch_model = _torch_model(qkv_packed)

    def run_packed() -> torch.Tensor:
        x = packed
        for block in qkv_packed:
            x = block(x, cu_seqlens=cu_seqlens, is_causal=True)
        return x

    def run_padded() -> torch.Tensor:
        x = padded
        for block in qkv_padded:
            x = block(x, key_padding_lengths=lengths, is_causal=True)
        rows = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
        return x[rows][None]  # the real tokens, in packed order: the same loss

    def run_torch() -> torch.Tensor:
        x = packed
        for layer in torch_model:
            x = layer(x, src_mask=~allowed)  # True: may not attend (torch's convention)
        return x

    steps: dict[str, Callable[[], Any]] = {
        "qkv-packed": _step(qkv_packed, run_packed),
        "torch-mha-mask": _step(torch_model, run_torch),
        "qkv-padded": _step(qkv_padded, run_padded),
    }
    with torch.no_grad():
        first = {
            name: float(run().pow(2).mean())
            for name, run in (
                ("qkv-packed", run_packed),
                ("torch-mha-mask", run_torch),
                ("qkv-padded", run_padded),
            )
        }
    if max(first.values()) - min(first.values()) > 1e-4 * max(abs(x) for x in first.values()):
        raise RuntimeError(f"the three models disagree before training: losses {first}")
    for step in steps.values():  # two calls a step: auto compiles and decides within these
        for _ in range(3):
            step()
    seconds_of = medians(steps, settings.repeats)
    table = Table(
        "train",
        f"Training step, {len(lengths)} causal documents packed in {total} tokens "
        f"(longest {longest})",
        "qkv-packed",
        note=(
            f"One step of {LAYERS} pre-norm blocks (E={EMBED}, H={HEADS}, MLP 4·E, float32): "
            "forward, mean-square loss, backward, AdamW. qkv-packed: qkv.nn.TransformerBlock "
            "with cu_seqlens; torch-mha-mask: nn.TransformerEncoderLayer "
            "(nn.MultiheadAttention) on the packed tokens with the (T, T) document mask; "
            f"qkv-padded: qkv's blocks on the documents padded to {longest}. Same weights; "
            "timed after 3 steps each. ratio: time / qkv-packed time."
        ),
    )
    for name, seconds in seconds_of.items():
        row = Row("documents", total, name, seconds)
        row.spread = seconds_of.spreads[name]
        table.rows.append(row)
    ratios(table.rows, "qkv-packed")
    tick()
    return table
