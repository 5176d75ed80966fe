"""Loading a local Hugging Face model folder for ``qkv patch`` and ``qkv heads``: offline,
never its code, never a pickle (``qkv.hf``); every problem one line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkv.cli._common import CommandError, Output, write_all

__all__ = ["load", "show", "text_writer", "token_id"]


def load(folder: str, command: str) -> Any:
    """The :class:`~qkv.hf._load.LoadedModel` of ``--hf FOLDER``."""
    from qkv._extras import MissingExtraError

    try:
        from qkv.hf._load import load_model
    except MissingExtraError as error:
        raise CommandError(
            f"{command} needs the transformers and torch extras: {error}. Hint: "
            "pip install 'qkv[hf]'"
        ) from None
    try:
        return load_model(folder, online=False)
    except ValueError as error:
        raise CommandError(f"--hf {error}") from None


def token_id(loaded: Any, token: str, option: str) -> int:
    """The id of ``token``: a token as the tokenizer spells it (``Ġcat``), or a word it
    makes one token of (``cat``, `` cat``)."""
    tokenizer = loaded.tokenizer
    vocab = tokenizer.get_vocab()
    if token in vocab:
        return int(vocab[token])
    for text in (token, " " + token):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) == 1 and ids[0] != tokenizer.unk_token_id:
            return int(ids[0])
    from qkv._format import visible

    raise CommandError(
        f"{option} '{visible(token)}' is not one token of the model's vocabulary. Hint: "
        "give a word the tokenizer keeps whole, or a token as it spells it (e.g. 'Ġcat')"
    )


def text_writer(text: str) -> Callable[[Path], None]:
    """What an :class:`~qkv.cli._common.Output` calls to write ``text``, atomically."""
    from qkv._io import write_atomic

    def write(path: Path) -> None:
        write_atomic(path, text)

    return write


def show(rendered: str, fmt: str, output: str | None, files: list[Output]) -> int:
    """Write ``files`` (all or none) and the table to ``output``, or print the table."""
    if output is not None:
        files = [*files, Output("--output", output, text_writer(rendered), fmt)]
    if files:
        write_all(files)
    if output is None:
        print(rendered, end="")
    return 0
