"""Tiny local models for the tests of ``qkv.interp``: GPT-2 (fused ``c_attn``) and Llama
(RoPE, grouped-query attention: 4 query heads over 2 key/value heads), built from their
configs with random weights and saved with ``save_pretrained`` beside a WordLevel tokenizer
(``tests/support/hf_models.py``): TransformerLens and nnsight load them from the folder,
offline."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.hf_models import save_tiny

FAMILIES = ("gpt2", "llama")


@pytest.fixture(scope="session")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One saved model folder per family."""
    root = tmp_path_factory.mktemp("interp-models")
    return {family: save_tiny(family, root / family) for family in FAMILIES}
