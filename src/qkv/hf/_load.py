"""Find and load a local Hugging Face model and its tokenizer, offline by default.

``qkv explain --hf MODEL`` takes a folder written by ``save_pretrained`` or the id of a
model already in the local Hugging Face cache (``~/.cache/huggingface/hub``). Nothing is
downloaded unless ``online=True``; no code from the model's folder is ever run
(``trust_remote_code`` stays off). The weights are loaded in float32 and the model is put
in evaluation mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkv._extras import require

__all__ = ["LoadedModel", "load_model"]

_FEATURE = "qkv explain --hf"


@dataclass(frozen=True)
class LoadedModel:
    """A model and its tokenizer, ready to run on a text.

    Attributes:
        model: the transformers ``PreTrainedModel`` (float32, evaluation mode).
        tokenizer: its tokenizer.
        name: the model as the user named it (a folder or a model id).
        family: ``config.model_type`` (``"llama"``, ``"gpt2"``, ``"bert"``, ...).
        encoder_only: an encoder–decoder model (T5, BART): the text goes through its
            encoder, whose self-attention is what is shown.
    """

    model: Any
    tokenizer: Any
    name: str
    family: str
    encoder_only: bool


def _problem(name: str, what: str, hint: str) -> ValueError:
    return ValueError(f"{name}: {what}. Hint: {hint}")


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1


def _folder(name: str, *, online: bool) -> tuple[str, bool]:
    """Where to load ``name`` from: the folder itself or its snapshot in the local cache
    (and False), or, ``online`` and not cached, the model id to download (and True)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise _problem(
                name,
                "this folder holds no config.json, so it is no saved transformers model",
                "save one with model.save_pretrained(FOLDER) and tokenizer.save_pretrained(FOLDER)",
            )
        return str(path), False
    if path.exists() or _looks_like_path(name):
        raise _problem(
            name,
            "no such folder",
            "give a folder written by save_pretrained, or the id of a model in the local "
            "Hugging Face cache (e.g. gpt2)",
        )
    hub = require("huggingface_hub", feature=_FEATURE, extra="hf")
    from huggingface_hub.errors import HFValidationError

    try:
        return str(hub.snapshot_download(name, local_files_only=True)), False
    except HFValidationError:
        raise _problem(
            name,
            "neither a folder nor a valid model id",
            "give a folder written by save_pretrained, or a model id such as gpt2",
        ) from None
    except (OSError, ValueError):  # not in the cache (LocalEntryNotFoundError, ...)
        if online:
            return name, True
        cache = _home_as_tilde(str(hub.constants.HF_HUB_CACHE))
        raise _problem(
            name,
            f"not a folder, and not in the local Hugging Face cache ({cache}); qkv does "
            "not download models by itself",
            f"download it first with `hf download {name}`, or allow the download with "
            "--online (online=True)",
        ) from None


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """No progress bar and no warning from transformers while loading (restored after)."""
    logging = transformers.utils.logging
    bars, verbosity = logging.is_progress_bar_enabled(), logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def _model_class(transformers: Any, config: Any) -> Any:
    """The class the folder was saved from (``config.architectures``), else ``AutoModel``'s."""
    for architecture in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, str(architecture), None)
        if isinstance(cls, type):
            return cls
    return transformers.AutoModel


def load_model(name: str, *, online: bool = False) -> LoadedModel:
    """Load the model and tokenizer saved in a folder, or cached under a model id.

    Args:
        name: a folder written by ``save_pretrained`` (config.json, the weights and the
            tokenizer's files), or the id of a model in the local Hugging Face cache.
        online: let transformers download ``name`` when it is not cached (default: never).

    Returns:
        A :class:`LoadedModel`, the model in float32 and evaluation mode.

    Raises:
        ValueError: no such folder or cached model, a folder without a model or a
            tokenizer, a model that reads no text (ViT, Whisper), or one that needs its
            own code (``trust_remote_code``); one line, with a hint.
        MissingExtraError: transformers is not installed (``pip install 'qkv[hf]'``).

    Example:
        >>> load_model("./no-such-model")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: ./no-such-model: no such folder. Hint: give a folder written by ...
    """
    if not name.strip():
        raise _problem(repr(name), "an empty model name", "give a folder or a model id")
    folder, download = _folder(name, online=online)
    transformers = require("transformers", feature=_FEATURE, extra="hf")
    torch = require("torch", feature=_FEATURE, extra="hf")
    local_only = not download
    with _quiet(transformers):
        try:
            config = transformers.AutoConfig.from_pretrained(folder, local_files_only=local_only)
        except (OSError, ValueError, KeyError) as error:
            raise _problem(
                name,
                f"transformers cannot read its config.json ({_first_line(error)})",
                "check that the folder was written by save_pretrained of transformers >= 5",
            ) from None
        family = str(getattr(config, "model_type", "") or type(config).__name__)
        cls = _model_class(transformers, config)
        reads = getattr(cls, "main_input_name", "input_ids")
        if reads != "input_ids":
            raise _problem(
                name,
                f"a {family} model reads {reads}, not text, and --hf explains a text",
                "trace it from Python with qkv.tracing(model=...) (docs/hf.md)",
            )
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                folder, local_files_only=local_only
            )
        except (OSError, ValueError, KeyError, TypeError):
            raise _problem(
                name,
                "no tokenizer could be loaded from it (no tokenizer.json, nor the files of "
                "a tokenizer class transformers knows)",
                "save one next to the model with tokenizer.save_pretrained(FOLDER)",
            ) from None
        try:
            model = cls.from_pretrained(
                folder, local_files_only=local_only, dtype=torch.float32
            ).eval()
        except (OSError, ValueError, KeyError, RuntimeError) as error:
            raise _problem(
                name,
                f"transformers cannot load the {family} model ({_first_line(error)})",
                "check the folder's weights (model.safetensors), or load it in Python",
            ) from None
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        family=family,
        encoder_only=bool(getattr(config, "is_encoder_decoder", False)),
    )


def _home_as_tilde(path: str) -> str:
    """``~/.cache/...`` for a path under the home folder, as people write it."""
    home = str(Path.home())
    return "~" + path[len(home) :] if path.startswith(home + "/") else path


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0].rstrip(".") if text else type(error).__name__
