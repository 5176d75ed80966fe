"""The sdpa backend adds no copy of its output to a usual CPU call (issue 27 §2: auto's own
cost per call): the look at torch's output (its log-sum-exp, or two sums) leaves the output
as it is when no input holds a NaN."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import qkv

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Outputs(TorchDispatchMode):
    """The sizes (bytes) of the memory each PyTorch operation in the block allocated: its
    outputs' storages not seen before (a view of an output is no new memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, int]] = []
        self._storages: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in self._storages:
                    self._storages.add(storage.data_ptr())
                    self.made.append((str(func), storage.nbytes()))
        return out


@pytest.mark.parametrize("causal", [False, True])
def test_a_usual_call_makes_one_output_and_no_copy(causal: bool) -> None:
    q, k, v = (torch.randn(1, 8, 256, 64) for _ in range(3))
    size = q.numel() * q.element_size()
    with _Outputs() as seen:
        out = qkv.scaled_dot_product_attention(q, k, v, is_causal=causal)
    large = [name for name, nbytes in seen.made if nbytes >= size]
    assert len(large) == 1, large  # torch's own output, nothing more
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, expected)


def test_a_nan_query_row_still_comes_out_nan() -> None:
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    q[0, 1, 3, 0] = torch.nan
    out = qkv.scaled_dot_product_attention(q, k, v)
    assert bool(torch.isnan(out[0, 1, 3]).all())
    assert bool(torch.isfinite(out[0, 0]).all()) and bool(torch.isfinite(out[0, 1, :3]).all())
