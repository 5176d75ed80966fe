"""qkv as the attention of TransformerLens 4.3's ``TransformerBridge``, against the same
bridge on TransformerLens's own eager attention.

The bridge is booted from a local folder (``TransformerBridge.boot_transformers(folder)``,
as TransformerLens's docs load a model, here offline). TransformerLens's eager attention
is the oracle: every hook it fires (``run_with_cache``), the logits, the edits made
through hooks as its docs make them (``run_with_hooks`` with ``hook_z``, ``hook_result``
with ``cfg.use_attn_result``, ``hook_v``, ``hook_rot_q``, ``hook_pattern``,
``hook_attn_scores``), gradients and generation must come out equal within 1e-5 in
float32.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformer_lens.model_bridge import TransformerBridge

import qkv
from qkv.interp import LENS_IMPLEMENTATION, use_qkv
from tests.interp.conftest import FAMILIES

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOKENS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]])  # N = 12
TOL = 1e-5


def boot(folder: Path) -> Any:
    return TransformerBridge.boot_transformers(str(folder), device="cpu")


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request: pytest.FixtureRequest, folders: dict[str, Path]) -> tuple[Any, Any]:
    """(TransformerLens's eager bridge, the same model's bridge switched to qkv)."""
    folder = folders[request.param]
    fast = boot(folder)
    use_qkv(fast)
    return boot(folder), fast


def close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> bool:
    return a.shape == b.shape and bool((a - b).abs().max() <= tol)


def test_switch_runs_qkv_not_eager(pair: tuple[Any, Any]) -> None:
    eager, fast = pair
    assert eager.original_model.config._attn_implementation == "eager"
    assert fast.original_model.config._attn_implementation == LENS_IMPLEMENTATION
    with torch.no_grad(), qkv.tracing(model=fast, heads=0, queries=-1) as t:
        fast(TOKENS)
    assert t.layer_names() == ["blocks.0.attn", "blocks.1.attn"]  # TransformerLens's names
    assert {c.meta["backend"] for c in t.calls} == {"sdpa"}


def test_every_hook_fires_with_eager_values(pair: tuple[Any, Any]) -> None:
    eager, fast = pair
    with torch.no_grad():
        logits_eager, cache_eager = eager.run_with_cache(TOKENS)
        logits_fast, cache_fast = fast.run_with_cache(TOKENS)
    assert close(logits_fast, logits_eager)
    fast_values, eager_values = cache_fast.cache_dict, cache_eager.cache_dict
    assert sorted(fast_values) == sorted(eager_values)
    assert "blocks.1.attn.hook_pattern" in fast_values
    for name, value in eager_values.items():
        assert close(fast_values[name], value), name


def _zero_head(tensor: torch.Tensor, hook: Any) -> torch.Tensor:
    tensor[:, :, 1] = 0.0  # hook_z, hook_v, hook_result, hook_rot_q: head 1 (axis 2 or 1)
    return tensor


def _rot(tensor: torch.Tensor, hook: Any) -> torch.Tensor:
    tensor[..., 0] = 30.0  # (B, H, N, D) after RoPE: every query asks for feature 0
    return tensor


def _look_at_first(pattern: torch.Tensor, hook: Any) -> torch.Tensor:
    pattern[:, 2, -1] = 0.0
    pattern[:, 2, -1, 0] = 1.0  # head 2's last row: all on the first token
    return pattern


def _first_token_scores(scores: torch.Tensor, hook: Any) -> torch.Tensor:
    scores[..., 0] += 10.0  # every row looks at the first token (never masked)
    return scores


EDITS: dict[str, tuple[str, Callable[..., torch.Tensor]]] = {
    "hook_z": ("blocks.0.attn.hook_z", _zero_head),
    "hook_v": ("blocks.1.attn.hook_v", _zero_head),
    "hook_pattern": ("blocks.1.attn.hook_pattern", _look_at_first),
    "hook_attn_scores": ("blocks.0.attn.hook_attn_scores", _first_token_scores),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_edits_through_hooks_equal_eager(pair: tuple[Any, Any], edit: str) -> None:
    eager, fast = pair
    hooks = [EDITS[edit]]
    with torch.no_grad():
        clean = eager(TOKENS)
        edited_eager = eager.run_with_hooks(TOKENS, fwd_hooks=hooks)
        edited_fast = fast.run_with_hooks(TOKENS, fwd_hooks=hooks)
    assert not close(edited_eager, clean, 1e-3)  # the edit changes the answer
    assert close(edited_fast, edited_eager)


def test_hook_rot_q_edit_equals_eager(folders: dict[str, Path]) -> None:
    eager, fast = boot(folders["llama"]), boot(folders["llama"])
    hooks = [("blocks.0.attn.hook_rot_q", _rot)]
    with use_qkv(fast), torch.no_grad():
        edited_fast = fast.run_with_hooks(TOKENS, fwd_hooks=hooks)
        edited_eager = eager.run_with_hooks(TOKENS, fwd_hooks=hooks)
    assert not close(edited_eager, eager(TOKENS), 1e-3)
    assert close(edited_fast, edited_eager)


def test_hook_result_ablation_equals_eager(pair: tuple[Any, Any]) -> None:
    eager, fast = pair
    hooks = [("blocks.1.attn.hook_result", _zero_head)]
    eager.set_use_attn_result(True)
    fast.set_use_attn_result(True)
    try:
        with torch.no_grad():
            _, cache_eager = eager.run_with_cache(TOKENS, names_filter=lambda n: "result" in n)
            _, cache_fast = fast.run_with_cache(TOKENS, names_filter=lambda n: "result" in n)
            edited_eager = eager.run_with_hooks(TOKENS, fwd_hooks=hooks)
            edited_fast = fast.run_with_hooks(TOKENS, fwd_hooks=hooks)
    finally:
        eager.set_use_attn_result(False)
        fast.set_use_attn_result(False)
    name = "blocks.1.attn.hook_result"
    assert cache_fast[name].shape == (1, 12, 4, 32)  # (B, N, H, E): one term per head
    assert close(cache_fast[name], cache_eager[name])
    assert close(edited_fast, edited_eager)


def test_pattern_of_the_heads_and_rows_a_trace_selects(pair: tuple[Any, Any]) -> None:
    eager, fast = pair
    with torch.no_grad():
        _, cache_eager = eager.run_with_cache(TOKENS, names_filter=lambda n: "pattern" in n)
        with qkv.tracing(model=fast, layers="blocks.1.attn", heads=[3, 0], queries=-1) as t:
            _, cache = fast.run_with_cache(TOKENS, names_filter=lambda n: "pattern" in n)
    full = cache_eager["blocks.1.attn.hook_pattern"]  # (B, H, N, N)
    rows = cache["blocks.1.attn.hook_pattern"]  # (B, 2 heads, 1 row, N)
    assert rows.shape == (1, 2, 1, 12)
    assert close(rows, full[:, [3, 0]][:, :, [-1]], 1e-6)
    assert close(torch.from_numpy(t["weights"].value), rows, 1e-6)  # the trace's rows
    # a layer the block does not record shows every head and row, as TransformerLens does
    assert close(cache["blocks.0.attn.hook_pattern"], cache_eager["blocks.0.attn.hook_pattern"])


def test_an_edit_of_the_selected_rows_equals_eager_editing_those_rows(
    pair: tuple[Any, Any],
) -> None:
    eager, fast = pair

    def first_token(pattern: torch.Tensor, hook: Any) -> torch.Tensor:
        pattern[:, 0, 0] = 0.0  # the one row kept: head 2's last
        pattern[:, 0, 0, 0] = 1.0
        return pattern

    with torch.no_grad():
        edited_eager = eager.run_with_hooks(
            TOKENS, fwd_hooks=[("blocks.1.attn.hook_pattern", _look_at_first)]
        )
        with qkv.tracing(model=fast, layers="blocks.1.attn", heads=2, queries=-1):
            edited_fast = fast.run_with_hooks(
                TOKENS, fwd_hooks=[("blocks.1.attn.hook_pattern", first_token)]
            )
    assert close(edited_fast, edited_eager)


def test_a_padded_batch_gives_eager_patterns_and_logits_on_its_tokens(
    pair: tuple[Any, Any],
) -> None:
    """The padding mask reaches the pattern hooks as it reaches the output (the Hugging Face
    adapter's options, ``call_options``): on the tokens that are not padding, every score,
    pattern and logit equals eager. A padding query whose keys are all padding gets zero
    weights (qkv's convention), where eager spreads it evenly."""
    eager, fast = pair
    tokens = TOKENS[:, :6].repeat(2, 1)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])  # the second: 2 pads left
    with torch.no_grad():
        logits_eager, cache_eager = eager.run_with_cache(tokens, attention_mask=mask)
        logits_fast, cache_fast = fast.run_with_cache(tokens, attention_mask=mask)
    assert close(logits_fast[0], logits_eager[0]) and close(logits_fast[1, 2:], logits_eager[1, 2:])
    for layer in (0, 1):
        for hook in ("hook_attn_scores", "hook_pattern"):
            name = f"blocks.{layer}.attn.{hook}"
            ours, theirs = cache_fast[name], cache_eager[name]
            assert close(ours[0], theirs[0]), name
            assert close(ours[1, :, 2:, 2:], theirs[1, :, 2:, 2:]), name
        pattern = cache_fast[f"blocks.{layer}.attn.hook_pattern"]
        assert bool((pattern[1, :, 2:, :2] == 0).all())  # no real token attends a pad
        assert bool((pattern[1, :, 0] == 0).all())  # the first pad sees only itself: none


class _SquareTensors(TorchDispatchMode):
    """Records the floating-point results of shape (..., N, N) of every operation."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            square = isinstance(t, torch.Tensor) and tuple(t.shape[-2:]) == (self.n, self.n)
            if square and t.is_floating_point():
                self.seen.append((str(func), tuple(t.shape)))
        return out


def test_no_n_by_n_pattern_is_formed(pair: tuple[Any, Any]) -> None:
    eager, fast = pair
    with torch.no_grad():
        with _SquareTensors(12) as in_eager:
            eager(TOKENS)
        with _SquareTensors(12) as in_fast:
            fast(TOKENS)
    assert any(shape == (1, 4, 12, 12) for _, shape in in_eager.seen)  # eager's scores
    assert in_fast.seen == []


def test_gradients_equal_eager(pair: tuple[Any, Any]) -> None:
    eager, fast = pair
    grads = []
    for bridge in (eager, fast):
        bridge.zero_grad()
        logits = bridge(TOKENS)
        logits[0, -1].logsumexp(-1).backward()
        weight = bridge.blocks[0].attn.q.original_component.weight
        grads.append(weight.grad.clone())
    assert close(grads[1], grads[0])


def test_generation_with_cache_equals_eager(pair: tuple[Any, Any]) -> None:
    eager, fast = pair
    prompt = TOKENS[:, :4]
    args = {"max_new_tokens": 6, "do_sample": False, "verbose": False}
    assert torch.equal(fast.generate(prompt, **args), eager.generate(prompt, **args))


def test_restore_gives_back_transformer_lens_attention(folders: dict[str, Path]) -> None:
    bridge = boot(folders["llama"])
    with torch.no_grad():
        before = bridge(TOKENS)
        with use_qkv(bridge) as switch:
            assert use_qkv(bridge) is switch  # one switch per model
            during = bridge(TOKENS)
        _, cache = bridge.run_with_cache(TOKENS, names_filter=lambda n: "pattern" in n)
    assert "restored" in repr(switch)
    assert bridge.original_model.config._attn_implementation == "eager"
    assert "forward" not in vars(bridge.blocks[0].attn)
    assert close(during, before)
    assert cache["blocks.0.attn.hook_pattern"].shape == (1, 4, 12, 12)


def test_tracing_a_bridge_switches_it_for_the_block(folders: dict[str, Path]) -> None:
    bridge = boot(folders["gpt2"])
    with torch.no_grad(), qkv.tracing(model=bridge, layers=-1, heads=1, queries=-1) as t:
        bridge(TOKENS)
        inside = bridge.original_model.config._attn_implementation
    assert inside == LENS_IMPLEMENTATION
    assert bridge.original_model.config._attn_implementation == "eager"
    assert t.layer_names() == ["blocks.1.attn"] and t["weights"].value.shape == (1, 1, 1, 12)


def test_split_inputs_are_refused_in_one_line(folders: dict[str, Path]) -> None:
    bridge = boot(folders["gpt2"])
    use_qkv(bridge)
    bridge.set_use_split_qkv_input(True)
    with pytest.raises(ValueError, match=r"cfg.use_split_qkv_input is set") as error:
        bridge(TOKENS)
    assert "\n" not in str(error.value) and "Hint:" in str(error.value)


def test_an_attention_qkv_does_not_switch_is_refused_and_nothing_changes(
    folders: dict[str, Path],
) -> None:
    bridge = boot(folders["llama"])
    attention = bridge.blocks[1].attn
    attention.__class__ = type("SinkAttentionBridge", (type(attention),), {})
    with pytest.raises(ValueError, match=r"'blocks.1.attn' is a SinkAttentionBridge") as error:
        use_qkv(bridge)
    assert "\n" not in str(error.value) and "Hint:" in str(error.value)
    assert bridge.original_model.config._attn_implementation == "eager"
    assert "forward" not in vars(bridge.blocks[0].attn)


def test_a_model_of_another_library_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"use_qkv\(model\): expected a TransformerLens") as e:
        use_qkv(torch.nn.Linear(2, 2))
    assert "\n" not in str(e.value) and "Hint:" in str(e.value)
