"""Tiny Hugging Face models saved to a folder, with a tokenizer built here: what
``qkv explain --hf DIR`` reads, made without downloading anything.

Each model is built from its config with random weights (seeded) and written with
``save_pretrained``; its tokenizer is a ``tokenizers`` WordLevel model over :data:`WORDS`
(whitespace pre-tokenizer), wrapped in ``PreTrainedTokenizerFast`` and saved beside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers as tf
from tokenizers import Tokenizer, models, pre_tokenizers, processors

WORDS = (
    "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "big", "red", "house", "and",
    "then", "it", "was", "happy", "quick", "brown", "fox", "jumps", "over", "lazy",
)  # fmt: skip
SPECIAL = ("[UNK]", "[PAD]", "[CLS]", "[SEP]")
VOCAB = {word: i for i, word in enumerate((*SPECIAL, *WORDS))}

_SMALL: dict[str, Any] = {
    "vocab_size": len(VOCAB),
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def _configs() -> dict[str, tuple[Any, Any]]:
    return {
        "llama": (tf.LlamaConfig(**_SMALL, num_key_value_heads=2), tf.LlamaForCausalLM),
        "gpt2": (
            tf.GPT2Config(
                vocab_size=len(VOCAB),
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_positions=64,
                bos_token_id=0,
                eos_token_id=0,
            ),
            tf.GPT2LMHeadModel,
        ),
        "bert": (tf.BertConfig(**_SMALL, max_position_embeddings=64), tf.BertModel),
        "t5": (
            tf.T5Config(
                vocab_size=len(VOCAB),
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_decoder_layers=1,
                num_heads=4,
            ),
            tf.T5ForConditionalGeneration,
        ),
    }


FAMILIES = tuple(_configs())
"""The families :func:`save_tiny` builds."""


def tokenizer(*, special: bool = False) -> Any:
    """A WordLevel tokenizer over :data:`WORDS`; with ``special``, BERT's ``[CLS] … [SEP]``."""
    model = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    if special:
        model.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            special_tokens=[("[CLS]", VOCAB["[CLS]"]), ("[SEP]", VOCAB["[SEP]"])],
        )
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=model, unk_token="[UNK]", pad_token="[PAD]",
        cls_token="[CLS]", sep_token="[SEP]",
    )  # fmt: skip


def save_tiny(family: str, folder: Path, *, seed: int = 0) -> Path:
    """Build the tiny ``family`` model (random weights from ``seed``) and save it, with its
    tokenizer, to ``folder``; return the folder."""
    config, cls = _configs()[family]
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.save_pretrained(folder)
    tokenizer(special=family == "bert").save_pretrained(folder)
    return folder


def eager_attentions(folder: Path, text: str) -> tuple[list[str], tuple[Any, ...]]:
    """The tokens of ``text`` and the model's own ``eager`` attention weights, one
    (B, H, N, N) tensor per layer (the encoder's for an encoder–decoder model)."""
    tok = tf.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    config = tf.AutoConfig.from_pretrained(folder, local_files_only=True)
    cls = getattr(tf, config.architectures[0])
    model = cls.from_pretrained(folder, local_files_only=True, attn_implementation="eager")
    model.eval()
    ids = tok(text, return_tensors="pt")["input_ids"]
    run = model.get_encoder() if config.is_encoder_decoder else model
    with torch.no_grad():
        out = run(input_ids=ids, output_attentions=True)
    tokens = [str(t) for t in tok.convert_ids_to_tokens(ids[0].tolist())]
    return tokens, tuple(out.attentions)


def variant(
    base: Path,
    folder: Path,
    *,
    config: dict[str, Any] | None = None,
    tokenizer_config: dict[str, Any] | None = None,
    files: dict[str, str | bytes] | None = None,
) -> Path:
    """A copy of the saved model ``base`` in ``folder`` with keys of its ``config.json`` and
    ``tokenizer_config.json`` changed (a value None removes the key) and ``files`` written
    (text or bytes; an empty bytes value removes the file): a hostile or damaged folder."""
    import json
    import shutil

    shutil.copytree(base, folder)
    for name, changes in (("config.json", config), ("tokenizer_config.json", tokenizer_config)):
        if changes:
            data = json.loads((folder / name).read_text(encoding="utf-8"))
            data.update(changes)
            data = {key: value for key, value in data.items() if value is not None}
            (folder / name).write_text(json.dumps(data), encoding="utf-8")
    for name, content in (files or {}).items():
        if content == b"":
            (folder / name).unlink()
        elif isinstance(content, bytes):
            (folder / name).write_bytes(content)
        else:
            (folder / name).write_text(content, encoding="utf-8")
    return folder
