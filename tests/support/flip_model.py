"""A tiny Llama whose answer one head decides: the model of docs/interventions.md.

Its words are those of :mod:`tests.support.hf_models`. Embeddings are one-hot (token t in
feature t); head 0 of layer 0 attends from every token to the animal of the sentence (its
query and key use features 3 and 7 of the head, whose rotary frequency is tiny) and copies
which animal it is (``cat`` or ``dog``) into feature 27 or 28; the language-model head reads
``mat`` from 27 and ``house`` from 28. Every other head writes nothing (its columns of the
output projection are zero), and the MLPs are zero. So "the cat sat on the" predicts
``mat``, "the dog sat on the" predicts ``house``, and patching head 0 of layer 0 from the
first into the second flips the answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers as tf

from tests.support.hf_models import VOCAB, tokenizer

CAT, DOG, MAT, HOUSE = VOCAB["cat"], VOCAB["dog"], VOCAB["mat"], VOCAB["house"]


def flip_model() -> Any:
    """The model (a ``LlamaForCausalLM``), in evaluation mode."""
    config = tf.LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=32, intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
    )  # fmt: skip
    model = tf.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
        model.model.embed_tokens.weight[:, : len(VOCAB)] = torch.eye(len(VOCAB))
        attn = model.model.layers[0].self_attn
        attn.q_proj.weight[3, : len(VOCAB)] = 1.0  # head 0 asks "which animal?"
        attn.k_proj.weight[3, [CAT, DOG]] = 1.0  # key/value head 0: animals answer
        attn.v_proj.weight[0, CAT] = 1.0  # and say which one
        attn.v_proj.weight[1, DOG] = 1.0
        attn.o_proj.weight[27, 0] = 1.0  # head 0's context → features 27, 28
        attn.o_proj.weight[28, 1] = 1.0
        model.lm_head.weight[MAT, 27] = 1.0
        model.lm_head.weight[HOUSE, 28] = 1.0
    return model


def save_flip_model(folder: Path) -> Path:
    model = flip_model()
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder
