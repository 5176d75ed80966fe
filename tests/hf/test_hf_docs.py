"""The examples of docs/hf.md run and print what the page says."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest
import torch
import transformers as tf
from transformers.masking_utils import AttentionMaskInterface

import qkv
from qkv.hf import IMPLEMENTATION

ROOT = Path(__file__).resolve().parents[2]


def test_hf_page_examples_run() -> None:
    result = doctest.testfile(
        str(ROOT / "docs" / "hf.md"),
        module_relative=False,
        optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS,
    )
    assert result.attempted >= 15
    assert result.failed == 0


def test_hf_page_quotes_the_unmasked_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The error quoted on the page is, word for word, the one qkv raises."""
    monkeypatch.delitem(AttentionMaskInterface._global_mapping, IMPLEMENTATION)
    config = tf.LlamaConfig(
        vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = tf.LlamaModel(config).eval()
    with (
        pytest.raises(ValueError, match="without a mask") as caught,
        torch.no_grad(),
        qkv.tracing(model=model),
    ):
        model(torch.arange(6)[None])
    text = (ROOT / "docs" / "hf.md").read_text(encoding="utf-8")
    assert f"ValueError: {caught.value}\n" in text
