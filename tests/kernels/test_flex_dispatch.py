"""The ``flex`` backend in the dispatcher and the SDPA kernel naming on CUDA (issue 19), tested
on CPU: CPU dispatch and its report are unchanged; ``backend="flex"`` on CPU refuses what
compiled FlexAttention cannot do there, with the reason; CUDA dispatch is simulated by
declaring the call's tensors to be on CUDA (nothing runs: explain_dispatch computes
nothing), and torch's SDPA kernel checks are replaced by stand-ins that refuse with a
reason, as torch's do with ``debug=True``.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch

import qkv
from qkv import masks
from qkv.attention import _options
from qkv.kernels import _sdpa_choice
from qkv.kernels._api import closes_over_learnable
from qkv.kernels._sdpa_choice import sdpa_kernel_choice

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _qkv(length: int = 256, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(1, 4, length, 32, dtype=dtype) for _ in range(3))


# -- on CPU: auto takes flex only for repeated calls (tests/kernels/test_compiled_cpu.py) ---------


def test_on_cpu_a_single_call_stays_on_tiled_and_the_report_lists_every_backend() -> None:
    q, k, v = _qkv(4096)
    report = qkv.explain_dispatch(q, k, v, mask=masks.sliding_window(511))
    assert report.backend == "tiled"
    assert [name for name, _ in report.reasons] == list(qkv.attention.BACKENDS)
    assert report.sdpa_kernel is None
    assert "auto takes it once a rule and shape have run 3 times" in dict(report.reasons)["flex"]
    assert "torch's SDPA kernel" not in str(report)
    dense = qkv.explain_dispatch(*_qkv(), is_causal=True)
    assert dense.backend == "sdpa" and dense.sdpa_kernel is None


def test_flex_asked_for_on_cpu_is_listed_with_the_others() -> None:
    q, k, v = _qkv()
    report = qkv.explain_dispatch(q, k, v, mask=masks.causal(), backend="flex")
    assert report.backend == "flex"
    assert [name for name, _ in report.reasons] == list(qkv.attention.BACKENDS)
    assert any("block mask" in note for note in report.notes)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda q: {"query": q.double()}, "float64 on CPU"),
        (
            lambda q: {"bias": torch.zeros(256, 256), "sinks": torch.zeros(4)},
            "a bias array and sinks",
        ),
        (lambda q: {"dropout_p": 0.1}, "FlexAttention has no dropout"),
        (lambda q: {"mask": torch.ones(256, 256, dtype=torch.bool)}, "a boolean mask array"),
        (lambda q: {"return_weights": True}, "weights asked for"),
    ],
)
def test_flex_on_cpu_refuses_what_it_cannot_do_with_the_reason(make: Any, reason: str) -> None:
    q, k, v = _qkv()
    given = make(q)
    q = given.pop("query", q)
    if q.dtype == torch.float64:
        k, v = k.double(), v.double()
    report = qkv.explain_dispatch(q, k, v, backend="flex", **given)
    assert report.backend == "none"
    assert report.refusal is not None and reason in report.refusal
    with pytest.raises(ValueError, match=r"backend='flex' cannot run this call: .*"):
        qkv.scaled_dot_product_attention(q, k, v, backend="flex", **given)


# -- CUDA, simulated: which backend auto takes, and why ------------------------------------------


@pytest.fixture
def on_cuda(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Declare every call to be on CUDA; torch's SDPA checks: flash refuses float32 (as on a
    GPU), memory-efficient accepts. Returns the log of the checks asked."""
    asked: list[str] = []
    monkeypatch.setattr(_options, "is_cuda", lambda device: True)
    cuda = torch.backends.cuda

    def flash(params: Any, debug: bool = False) -> bool:
        asked.append("flash")
        if debug:
            warnings.warn("Flash attention only supports float16 and bfloat16", stacklevel=2)
        return False

    def efficient(params: Any, debug: bool = False) -> bool:
        asked.append("memory-efficient")
        return True

    monkeypatch.setattr(cuda, "can_use_flash_attention", flash)
    monkeypatch.setattr(cuda, "can_use_efficient_attention", efficient)
    monkeypatch.setattr(cuda, "can_use_cudnn_attention", lambda params, debug=False: True)
    for flag in ("flash", "mem_efficient", "math", "cudnn"):
        monkeypatch.setattr(cuda, f"{flag}_sdp_enabled", lambda: True)
    monkeypatch.setattr(_sdpa_choice, "_priority", lambda: _sdpa_choice._DEFAULT_ORDER)
    return asked


@pytest.mark.usefixtures("on_cuda")
@pytest.mark.parametrize(
    "options",
    [
        {"mask": masks.sliding_window(63)},
        {"mask": masks.document([0] * 100 + [1] * 156) & masks.causal()},
        {"mask": masks.causal()},  # a rule, even the causal one
        {"score_mod": masks.softcap(30.0)},
        {"is_causal": True, "score_mod": lambda s, b, h, q, kv: s * 0.5},
        {"mask": masks.key_padding([200]), "sinks": torch.zeros(4)},
    ],
)
def test_on_cuda_mask_rules_and_score_modifiers_go_to_flex(options: dict[str, Any]) -> None:
    report = qkv.explain_dispatch(*_qkv(), **options)
    assert report.backend == "flex", str(report)
    reasons = dict(report.reasons)
    assert "FlexAttention" in reasons["flex"]
    assert report.sdpa_kernel is None


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"is_causal": True},
        {"mask": torch.rand(256, 256) > 0.5},  # a boolean array: SDPA takes it as it is
        {"bias": torch.randn(4, 256, 256)},
    ],
)
def test_on_cuda_dense_causal_and_boolean_masks_go_to_sdpa_which_names_its_kernel(
    on_cuda: list[str], options: dict[str, Any]
) -> None:
    report = qkv.explain_dispatch(*_qkv(), **options)
    assert report.backend == "sdpa", str(report)
    assert report.sdpa_kernel == "memory-efficient"
    assert on_cuda == ["flash", "memory-efficient"]  # torch's order, stopping at the first fit
    text = str(report)
    assert "torch's SDPA kernel: memory-efficient" in text
    assert "flash: refused by torch: Flash attention only supports float16" in " ".join(
        text.split()
    )


@pytest.mark.usefixtures("on_cuda")
@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"mask": masks.sliding_window(63), "dropout_p": 0.1}, "no dropout"),
        # (a causal rule alone goes to SDPA's own causal kernel: a window shows the fallback)
        ({"mask": masks.sliding_window(63), "query_dtype": torch.float64}, "float64"),
        ({"mask": masks.sliding_window(63), "dim": 8}, "D ≥ 16"),
    ],
)
def test_on_cuda_auto_falls_back_to_tiled_and_says_why(
    options: dict[str, Any], reason: str
) -> None:
    dtype = options.pop("query_dtype", torch.float32)
    dim = options.pop("dim", 32)
    q, k, v = (torch.randn(1, 4, 4096, dim, dtype=dtype) for _ in range(3))
    report = qkv.explain_dispatch(q, k, v, **options)
    assert report.backend == "tiled", str(report)
    assert reason in dict(report.reasons)["flex"]


@pytest.mark.usefixtures("on_cuda")
def test_on_cuda_a_learnable_score_modifier_stays_on_the_tiled_kernel_under_auto() -> None:
    slopes = torch.full((4,), 0.1, requires_grad=True)

    def learned(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return score - slopes[h] * (q - kv).abs()

    q, k, v = (torch.randn(1, 4, 4096, 32) for _ in range(3))
    report = qkv.explain_dispatch(q, k, v, score_mod=learned, is_causal=True)
    assert report.backend == "tiled"
    assert "need a gradient" in dict(report.reasons)["flex"]
    with torch.no_grad():  # no gradient recorded: flex takes it
        assert qkv.explain_dispatch(q, k, v, score_mod=learned).backend == "flex"
    asked = qkv.explain_dispatch(q, k, v, score_mod=learned, backend="flex")
    assert asked.backend == "flex"  # asked for: runs (torch's own captured-tensor gradient)


@pytest.mark.usefixtures("on_cuda")
def test_on_cuda_a_trace_still_runs_on_the_reference_when_it_fits() -> None:
    q, k, v = _qkv(64)
    with qkv.tracing() as trace:
        report = qkv.explain_dispatch(q, k, v, mask=masks.causal(), trace=trace)
    assert report.backend == "reference"
    assert [name for name, _ in report.reasons] == list(qkv.attention.BACKENDS)


# -- the SDPA kernel, by torch's own checks -------------------------------------------------------


def test_sdpa_kernel_choice_follows_torchs_order_and_enabled_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = torch.backends.cuda
    monkeypatch.setattr(cuda, "can_use_flash_attention", lambda p, debug=False: True)
    monkeypatch.setattr(cuda, "can_use_efficient_attention", lambda p, debug=False: True)
    monkeypatch.setattr(cuda, "can_use_cudnn_attention", lambda p, debug=False: True)
    monkeypatch.setattr(_sdpa_choice, "_priority", lambda: _sdpa_choice._DEFAULT_ORDER)
    q, k, v = _qkv(16)
    flags = {"flash": True, "mem_efficient": True, "math": True, "cudnn": True}
    for flag in flags:
        monkeypatch.setattr(cuda, f"{flag}_sdp_enabled", lambda flag=flag: flags[flag])
    assert sdpa_kernel_choice(q, k, v).kernel == "flash"
    flags["flash"] = False  # as inside sdpa_kernel([EFFICIENT_ATTENTION, ...])
    choice = sdpa_kernel_choice(q, k, v)
    assert choice.kernel == "memory-efficient"
    assert dict(choice.reasons)["flash"].startswith("disabled")
    assert dict(choice.reasons)["cuDNN"] == "not reached"
    flags["mem_efficient"] = False
    assert sdpa_kernel_choice(q, k, v).kernel == "math"
    monkeypatch.setattr(  # cuDNN first, as torch.nn.attention.sdpa_kernel(set_priority=True)
        _sdpa_choice, "_priority", lambda: ("CUDNN_ATTENTION", *_sdpa_choice._DEFAULT_ORDER[:3])
    )
    assert sdpa_kernel_choice(q, k, v).kernel == "cuDNN"
    flags.update(math=False, cudnn=False)
    nothing = sdpa_kernel_choice(q, k, v)
    assert nothing.kernel == "none"
    assert str(nothing).startswith("torch's SDPA kernel: none")


def test_torchs_priority_order_is_read_from_torch() -> None:
    order = _sdpa_choice._priority()
    assert sorted(order) == sorted(_sdpa_choice.KERNELS)
    assert order[0] == "FLASH_ATTENTION"  # torch's default


def test_the_mask_stand_in_has_the_shape_and_dtype_torch_would_get_and_no_memory() -> None:
    q, k, _ = _qkv(300)
    stand_in, causal = _sdpa_choice.torch_mask_stand_in(
        q, k, mask=masks.sliding_window(5), bias=None, is_causal=False, alignment="top-left"
    )
    assert stand_in is not None and not causal
    assert (tuple(stand_in.shape), stand_in.dtype) == ((1, 1, 300, 300), torch.bool)
    assert stand_in.stride() == (0, 0, 0, 0)
    none, causal = _sdpa_choice.torch_mask_stand_in(
        q, k, mask=None, bias=None, is_causal=True, alignment="top-left"
    )
    assert none is None and causal
    bias = torch.zeros(1, 4, 300, 300)
    with_bias, _ = _sdpa_choice.torch_mask_stand_in(
        q, k, mask=None, bias=bias, is_causal=True, alignment="top-left"
    )
    assert with_bias is not None
    assert (tuple(with_bias.shape), with_bias.dtype) == ((1, 4, 300, 300), torch.float32)


LEARNED_TABLE = torch.zeros(4, 65, requires_grad=True)  # a module-level learned table


@pytest.mark.usefixtures("on_cuda")
@pytest.mark.parametrize(
    "holder",
    ["closure", "default", "global", "partial", "probe fails"],
)
def test_on_cuda_a_modifier_holding_a_learned_tensor_stays_off_flex(holder: str) -> None:
    """Issue 30: on an H200, auto sent a learnable modifier to flex where the one-position
    probe found no learned tensor. Reading what the modifier holds catches it wherever the
    tensor is kept, also when the probe raises."""
    table = torch.zeros(4, 65, requires_grad=True)

    def closure(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return s + table[h, (kv - q).clamp(-32, 32) + 32]

    def default(s: Any, b: Any, h: Any, q: Any, kv: Any, t: Any = table) -> Any:
        return s + t[h, 0]

    def by_global(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return s + LEARNED_TABLE[h, 0]

    def shifted(t: Any, s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return s + t[h, 0]

    def probe_fails(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        if s.numel() == 1:
            raise ValueError("needs a whole block")
        return s + table[h, 0]

    modifier = {
        "closure": closure,
        "default": default,
        "global": by_global,
        "partial": functools.partial(shifted, table),
        "probe fails": probe_fails,
    }[holder]
    q, k, v = _qkv()
    report = qkv.explain_dispatch(q, k, v, score_mod=modifier, is_causal=True)
    assert report.backend == "tiled", str(report)
    assert "need a gradient" in dict(report.reasons)["flex"]


def test_a_modifier_without_learned_tensors_is_not_taken_for_one() -> None:
    fixed = torch.zeros(4, 65)  # no gradient
    assert not closes_over_learnable(lambda s, b, h, q, kv: s + fixed[h, 0])
    assert not closes_over_learnable(masks.softcap(30.0))
    assert not closes_over_learnable(masks.alibi(4))
    q = torch.zeros(1, requires_grad=True)  # the call's own query does not count
    assert not closes_over_learnable(lambda s, b, h, qi, kv: s + q[0], exclude=(q,))
    assert closes_over_learnable(masks.score_function(lambda s, b, h, qi, kv: s + q[0]))
