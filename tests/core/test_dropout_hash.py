"""The dropout pattern's hash: MurmurHash3's 32-bit finaliser, bit for bit, on NumPy arrays,
0-d values and torch tensors, with no overflow warning (the products are taken modulo 2³²)."""

from __future__ import annotations

import warnings

import array_api_compat.numpy as xnp
import numpy as np
import torch
from array_api_compat import array_namespace

from qkv.masks import dropout_keep
from qkv.masks._dropout import _mix32


def fmix32(h: int) -> int:
    """MurmurHash3's finaliser in Python integers (the published algorithm)."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_the_hash_is_murmur3s_finaliser_on_every_32_bit_value_tried() -> None:
    values = np.random.default_rng(0).integers(0, 2**32, size=4096, dtype=np.int64)
    values[:3] = (0, 1, 2**32 - 1)
    got = _mix32(xnp, values)
    assert got.tolist() == [fmix32(int(v)) for v in values]
    tensor = torch.from_numpy(values)
    assert _mix32(array_namespace(tensor), tensor).tolist() == got.tolist()


def test_a_single_position_gives_no_overflow_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        keep = dropout_keep(0.5, seed=2**61 + 12345)
        one = keep.dense(1, 1)
        value = _mix32(xnp, np.int64(2**32 - 1))
    assert int(value) == fmix32(2**32 - 1) and one.shape[-2:] == (1, 1)


def test_the_pattern_is_the_same_in_numpy_and_torch() -> None:
    keep = dropout_keep(0.3, seed=987654321987)
    dense = np.asarray(keep.dense(33, 47))
    assert 0.6 < dense.mean() < 0.8
    torch_dense = keep.dense(33, 47, xp=array_namespace(torch.zeros(1)))
    assert np.array_equal(np.asarray(torch_dense), dense)
