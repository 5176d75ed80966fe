"""Checks that make a wrong experiment impossible (issue 39, item 3): a recording or a mean
is checked against the model it is used on, where it is used, in one line; head_stats bounds
its sizes before allocating; set_weights takes attention rows only; ``qkv explain --hf``
names a file given for a folder.

Each case is the mistake a user makes (a recording of another model, a run that overflowed,
a row of ones meant as "evenly"), and asserts that nothing runs and the line says what
differs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from torch import nn

import qkv
from qkv.cli import main
from qkv.edits import HeadMeans, Recording, ablate, head_means, patch, record, set_weights
from tests.support.hf_models import save_tiny


class Stack(nn.Module):
    """``layers`` qkv.nn attention layers of ``heads`` heads of size ``size`` on token ids."""

    def __init__(self, layers: int, heads: int, size: int) -> None:
        super().__init__()
        width = heads * size
        self.embed = nn.Embedding(10, width)
        self.blocks = nn.ModuleList(
            qkv.nn.MultiHeadAttention(width, num_heads=heads) for _ in range(layers)
        )

    def forward(self, ids: torch.Tensor) -> Any:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x, is_causal=True)
        return x


IDS = torch.tensor([[1, 2, 3, 4]])


def _refused(model: nn.Module, edit: Any, match: str) -> None:
    """The edit is refused with one line matching ``match``, before the model returns."""
    with pytest.raises(ValueError, match=match) as caught, qkv.intervene(model, edit):
        model(IDS)
    assert "\n" not in str(caught.value) and "Hint:" in str(caught.value)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (Stack(1, 6, 4), "the recording has 6 heads per layer, the model 4"),
        (Stack(1, 4, 8), "the recording has heads of size 8, the model's are of size 4"),
        (Stack(2, 4, 4), "the recording has 2 attention layers, the model 1"),
    ],
)
def test_a_recording_of_another_model_is_refused_where_it_is_used(
    source: nn.Module, message: str
) -> None:
    torch.manual_seed(0)
    model = Stack(1, 4, 4)
    recording = record(source, IDS)
    _refused(model, patch(0, 1, recording), rf"^patch\(layer=0, head=1\): {message}\. Hint")
    weights = record(source, IDS, what="weights")
    _refused(model, patch(0, 1, weights, what="weights"), message)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (Stack(1, 6, 4), "the head means have 6 heads per layer, the model 4"),
        (Stack(1, 4, 8), "the head means have heads of size 8, the model's are of size 4"),
        (Stack(3, 4, 4), "the head means have 3 attention layers, the model 1"),
    ],
)
def test_head_means_of_another_model_are_refused(source: nn.Module, message: str) -> None:
    means = head_means(source, IDS)
    _refused(Stack(1, 4, 4), ablate(0, 1, how="mean", mean=means), message)


def test_a_recording_of_the_same_model_still_patches_exactly() -> None:
    """The checks refuse nothing right: a recording of the same model (and of another model
    of the same layers, heads and head size: patching across checkpoints) patches."""
    torch.manual_seed(0)
    model, twin = Stack(2, 4, 4), Stack(2, 4, 4)
    for source in (model, twin):
        recording = record(source, torch.tensor([[5, 6, 7, 8]]))
        with torch.no_grad(), qkv.intervene(model, patch(-1, 3, recording)):
            edited = record(model, IDS)
        assert torch.equal(edited.contexts[1][3], recording.contexts[1][3])
    assert record(model, IDS).sizes == {0: (4, 4), 1: (4, 4)}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_recording_or_mean_holding_nan_is_refused_before_the_run(bad: float) -> None:
    model = Stack(1, 4, 4)
    recording = record(model, IDS)
    spoiled = {0: {h: c.clone() for h, c in recording.contexts[0].items()}}
    spoiled[0][2][0, 1, 3] = bad
    broken = dataclasses.replace(recording, contexts=spoiled)
    ran = []
    model.register_forward_hook(lambda *_: ran.append(True))
    _refused(model, patch(0, 2, broken), r"the recording holds NaN or infinity for this head "
             r"\(1 of 16 numbers\)")  # fmt: skip
    assert not ran  # refused before the forward
    with qkv.intervene(model, patch(0, 1, broken)):  # another head's numbers are finite
        model(IDS)
    means = head_means(model, IDS)
    nan_means = HeadMeans(means.layers, {0: means.means[0] * bad}, means.tokens)
    _refused(model, ablate(0, 0, how="mean", mean=nan_means), "the head means hold NaN")


def test_a_recording_made_by_hand_without_sizes_is_still_checked_for_layers() -> None:
    """A Recording built by hand has no sizes: the layers and the numbers are still
    checked, the heads and head size cannot be."""
    model = Stack(1, 4, 4)
    context = torch.randn(1, 4, 4)
    by_hand = Recording("context", ("a", "b"), {0: {0: context}})
    _refused(model, patch(0, 0, by_hand), "the recording has 2 attention layers, the model 1")
    ok = Recording("context", ("blocks.0",), {0: {0: context}})
    with torch.no_grad(), qkv.intervene(model, patch(0, 0, ok)):
        assert torch.equal(record(model, IDS).contexts[0][0], context)


def test_a_hugging_face_recording_of_another_config_is_refused() -> None:
    """The check where it is used on a Hugging Face model: a Llama of 4 heads patched
    from one of 2 heads (same width, so the head size differs too)."""
    common: dict[str, Any] = {"vocab_size": 30, "hidden_size": 32, "intermediate_size": 16,
                              "num_hidden_layers": 2}  # fmt: skip
    torch.manual_seed(0)
    four = tf.LlamaForCausalLM(tf.LlamaConfig(**common, num_attention_heads=4)).eval()
    two = tf.LlamaForCausalLM(tf.LlamaConfig(**common, num_attention_heads=2)).eval()
    source = record(two, IDS)
    with (
        pytest.raises(ValueError, match="the recording has 2 heads per layer, the model 4"),
        torch.no_grad(),
        qkv.intervene(four, patch(0, 1, source)),
    ):
        four(IDS)
    assert four.config._attn_implementation == "sdpa"  # restored after the refusal


# -- head_stats bounds its sizes -----------------------------------------------------------


class Tokens(nn.Module):
    """A qkv.nn model on token ids with no config: no positions limit, sizes from its layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.attn = nn.Embedding(10, 8), qkv.nn.MultiHeadAttention(8, 2)

    def forward(self, ids: torch.Tensor) -> Any:
        return self.attn(self.embed(ids), is_causal=True)


def test_head_stats_refuses_a_huge_induction_length_before_allocating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """induction_length=10**9 once tried to allocate 32 GB of random ids: now the sizes
    are compared with the memory the process may take (here made 1 GB) before anything."""
    drawn: list[Any] = []
    real = torch.randint

    def randint(*args: Any, **options: Any) -> Any:
        drawn.append(args)
        return real(*args, **options)

    monkeypatch.setattr(torch, "randint", randint)
    monkeypatch.setattr("qkv.edits._stats.available_memory", lambda: 10**9)
    with pytest.raises(ValueError, match=r"^head_stats\(model, texts\): induction_length="
                       r"1000000000 makes 4 × 2,000,000,000 tokens, about .* TB for the run, "
                       r"more than the 1.0 GB this process may still take\. Hint"):  # fmt: skip
        qkv.head_stats(Tokens(), [IDS[0]], vocab_size=10, induction_length=10**9)
    assert not drawn
    stats = qkv.head_stats(Tokens(), [IDS[0]], vocab_size=10, induction_length=8)
    assert drawn and all(0 <= v <= 1 for v in stats.values["induction"][0])


def test_head_stats_refuses_sequences_longer_than_the_models_positions(tmp_path: Path) -> None:
    save_tiny("gpt2", tmp_path)  # n_positions = 64
    model = tf.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    with pytest.raises(ValueError, match="makes sequences of 66 tokens, more than the 64 "
                       r"positions the model reads \(its config\)\. Hint: at most 64 tokens "
                       r"\(induction_length at most 32\)"):  # fmt: skip
        qkv.head_stats(model, [IDS[0]], induction_length=33)
    with pytest.raises(ValueError, match=r"prompt 0 makes sequences of 70 tokens, .*Hint: at "
                       r"most 64 tokens \(a shorter prompt, or several\)\.$"):  # fmt: skip
        qkv.head_stats(model, [torch.ones(70, dtype=torch.long)])
    assert qkv.head_stats(model, [IDS[0]], induction_length=32).prompts == 1


@pytest.mark.parametrize(
    ("option", "value"),
    [("induction_length", 1), ("induction_length", 2.5), ("induction_prompts", 0),
     ("vocab_size", True)],
)  # fmt: skip
def test_head_stats_checks_its_sizes(option: str, value: Any) -> None:
    with pytest.raises(TypeError, match=rf"^head_stats\(model, texts\): {option} must be an "
                       r"integer from \d, got .*Hint"):  # fmt: skip
        qkv.head_stats(Tokens(), [IDS[0]], **{"vocab_size": 10, option: value})


# -- set_weights takes attention rows ----------------------------------------------------------


def test_set_weights_takes_rows_that_sum_to_one_as_its_docstring_says() -> None:
    assert "sum to" in (set_weights.__doc__ or "")
    with pytest.raises(ValueError, match=r"weights must sum to 1 in each row \(an attention "
                       r"row\), got a sum of 3\. Hint: divide by the sum"):  # fmt: skip
        set_weights(0, 1, 2, [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"got a sum of 0\.5"):  # the second row of a batch
        set_weights(0, 1, 2, [[0.5, 0.5, 0.0], [0.25, 0.25, 0.0]])
    with pytest.raises(ValueError, match=r"weights must be ≥ 0 \(an attention row\), got -0.5"):
        set_weights(0, 1, 2, [1.5, -0.5, 0.0])
    thirds = torch.full((3,), 1 / 3, dtype=torch.float32)  # sums to 1 within rounding
    softmax = torch.randn(2, 1000, dtype=torch.float64).softmax(-1)
    assert set_weights(0, 1, 2, thirds).weights.shape == (3,)
    assert set_weights(0, 1, 2, softmax).weights.shape == (2, 1000)


# -- qkv explain --hf FILE ---------------------------------------------------------------------


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = main(["explain", *argv, "--text", "the cat"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    return lines[0]


def test_explain_hf_names_a_file_given_where_a_folder_is_expected(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    folder = save_tiny("gpt2", tmp_path / "tiny")
    capsys.readouterr()
    line = _error(capsys, "--hf", str(folder / "config.json"))
    assert line == (
        f"qkv: error: --hf {folder / 'config.json'}: this is a file, not a model's folder. "
        f"Hint: give the folder that holds it: --hf {folder}"
    )
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model", encoding="utf-8")
    assert _error(capsys, "--hf", str(notes)).endswith(
        "this is a file, not a model's folder. Hint: give the folder written by "
        "save_pretrained (it holds config.json)"
    )
    assert "no such folder" in _error(capsys, "--hf", str(tmp_path / "missing"))
