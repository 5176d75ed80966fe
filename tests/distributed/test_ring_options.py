"""Every rank of ``ring_attention`` must pass the same options (issue 24, item 5): when
``is_causal``, the layout, the strategy, the scale, the sinks or the mask rule differ between
ranks, every rank fails at once with one line naming the option and the ranks (before: wrong
numbers returned silently, or for different strategies a gloo "Connection closed by peer"
after 47 s)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qkv import masks
from qkv.distributed import ring_attention, shard
from qkv.distributed._checks import encode_options
from tests.distributed._group import run_group

N = 12


def _window(width: int) -> masks.Mask:
    return masks.sliding_window(width)


def _options(rank: int) -> dict[str, dict[str, Any]]:
    """For each option, the keyword arguments of this rank: rank 1 differs from the rest."""
    other = rank == 1
    return {
        "is_causal": {"is_causal": other},
        "layout": {"layout": "contiguous" if other else "zigzag"},
        "strategy": {"strategy": "allgather" if other else "ring"},
        "scale": {"scale": 0.5 if other else None},
        "sinks": {"sinks": torch.tensor([1.0 if other else 0.0, 0.0])},
        "mask": {"mask": _window(2 if other else 3)},
        "mask rule": {"mask": masks.causal() if other else _window(3)},
    }


def work(rank: int, size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    full = torch.randn(1, 2, N, 4, generator=torch.Generator().manual_seed(0))
    found: dict[str, Any] = {}
    for name, options in _options(rank).items():
        layout = options.get("layout", "zigzag")
        q = shard(full, layout=layout)
        try:
            ring_attention(q, q, q, **options)
            found[name] = "no error"
        except ValueError as error:
            found[name] = str(error)
    same = shard(full, layout="zigzag")
    out = ring_attention(same, same, same, mask=_window(3), sinks=torch.zeros(2))
    found["same"] = bool(torch.isfinite(out).all())
    return found


def test_options_that_differ_between_ranks_fail_on_every_rank(tmp_path: Path) -> None:
    per_rank = run_group(3, work, tmp_path)
    for results in per_rank:
        assert results.pop("same") is True  # equal options (and rules built alike) agree
        for name, message in results.items():
            option = name.split()[0]
            assert message.startswith(f"ring_attention: {option} differs between ranks"), message
            assert "on rank 1" in message and "on ranks 0, 2" in message, message
            assert "\n" not in message and "Hint:" in message
    assert per_rank[0]["is_causal"] == (
        "ring_attention: is_causal differs between ranks (False on ranks 0, 2; True on rank "
        "1). Hint: every rank must call it with the same is_causal, layout, strategy, scale, "
        "sinks, mask"
    )
    assert "'ring' on ranks 0, 2; 'allgather' on rank 1" in per_rank[2]["strategy"]


def test_the_option_digest_is_equal_for_equal_options_only() -> None:
    def encode(**options: Any) -> list[int]:
        given: dict[str, Any] = {
            "is_causal": False,
            "layout": "zigzag",
            "strategy": "ring",
            "scale": None,
        }
        given |= {"sinks": None, "mask": None, **options}
        return encode_options(**given)

    assert encode(mask=_window(3)) == encode(mask=_window(3))
    assert encode(mask=_window(3)) != encode(mask=_window(4))
    assert encode(mask=masks.causal() & _window(3)) != encode(mask=_window(3))
    assert encode(scale=0.5) != encode(scale=0.25) != encode()
    assert encode(sinks=torch.zeros(2)) != encode(sinks=torch.ones(2))
