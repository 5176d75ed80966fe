"""Find and load a local Hugging Face model and its tokenizer, offline by default.

``qkv explain --hf MODEL`` takes a folder written by ``save_pretrained`` or the id of a
model already in the local Hugging Face cache (``~/.cache/huggingface/hub``). Nothing is
downloaded unless ``online=True``, and then only the configs, the tokenizer's files and
safetensors weights. No code from the folder is ever run: the folder is checked first
(:mod:`qkv.hf._folder`: its own code, its sizes, its weight files, the memory it needs) and
every ``from_pretrained`` runs with ``trust_remote_code=False`` and ``weights_only=True``.
The weights are loaded in float32 and the model is put in evaluation mode.
"""

from __future__ import annotations

import contextlib
import pickle
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkv._extras import require
from qkv.hf._folder import (
    check_fits,
    check_sizes,
    check_weights,
    code_needed,
    first_line,
    model_class,
    not_a_folder,
    problem,
    read_json,
)

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


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1


_DOWNLOADED = (
    "*.json",
    "*.safetensors",
    "*.txt",
    "*.model",
    "*.tiktoken",
)
"""What ``online=True`` downloads: configs, tokenizers' files and safetensors weights; never
code (``*.py``) nor pickles (``*.bin``)."""


def _folder(name: str, *, online: bool) -> Path:
    """Where ``name``'s files are: the folder itself or its snapshot in the local cache
    (downloaded first when ``online`` and not cached)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise problem(
                name,
                "this folder holds no config.json, so it is no saved transformers model",
                "save one with model.save_pretrained(FOLDER) and tokenizer.save_pretrained(FOLDER)",
            )
        return path
    if path.exists():
        raise not_a_folder(name, path)
    if _looks_like_path(name):
        raise problem(
            name,
            "no such folder",
            "give a folder written by save_pretrained, or the id of a model in the local "
            "Hugging Face cache (e.g. gpt2)",
        )
    hub = require("huggingface_hub", feature=_FEATURE, extra="hf")
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(hub.snapshot_download(name, local_files_only=True))
    except HFValidationError:
        raise problem(
            name,
            "neither a folder nor a valid model id",
            "give a folder written by save_pretrained, or a model id such as gpt2",
        ) from None
    except (OSError, ValueError):  # not in the cache (LocalEntryNotFoundError, ...)
        if not online:
            cache = _home_as_tilde(str(hub.constants.HF_HUB_CACHE))
            raise problem(
                name,
                f"not a folder, and not in the local Hugging Face cache ({cache}); qkv does "
                "not download models by itself",
                f"download it first with `hf download {name}`, or allow the download with "
                "--online (online=True)",
            ) from None
    try:
        return Path(hub.snapshot_download(name, allow_patterns=list(_DOWNLOADED)))
    except (OSError, ValueError) as error:
        raise problem(
            name,
            f"the download failed ({first_line(error)})",
            "check the model id and the network, or download it with `hf download`",
        ) from None


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """No progress bar and no warning from transformers or torch while loading (restored
    after): the command's only lines are its own."""
    logging = transformers.utils.logging
    bars, verbosity = logging.is_progress_bar_enabled(), logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def load_model(name: str, *, online: bool = False) -> LoadedModel:
    """Load the model and tokenizer saved in a folder, or cached under a model id.

    The folder is checked before anything in it is built (:mod:`qkv.hf._folder`): a folder
    that needs its own code (an ``auto_map`` naming a class transformers does not have),
    absurd or inconsistent sizes in ``config.json``, ``architectures`` naming a class that
    is no model, damaged safetensors files, or a model whose float32 parameters do not fit
    in the memory available, are each refused in one line. Every ``from_pretrained`` runs
    with ``trust_remote_code=False`` (transformers never asks to run code), and a PyTorch
    weights file is read with ``weights_only=True``.

    Args:
        name: a folder written by ``save_pretrained`` (config.json, the weights and the
            tokenizer's files), or the id of a model in the local Hugging Face cache.
        online: download ``name`` when it is not cached (its configs, its tokenizer's files
            and its safetensors weights; default: never download).

    Returns:
        A :class:`LoadedModel`, the model in float32 and evaluation mode.

    Raises:
        ValueError: no such folder or cached model, a folder without a model or a
            tokenizer, a model that reads no text (ViT, Whisper), or any of the refusals
            above; one line, with a hint.
        MissingExtraError: transformers is not installed (``pip install 'qkv[hf]'``).

    Example:
        >>> load_model("./no-such-model")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: ./no-such-model: no such folder. Hint: give a folder written by ...
    """
    if not name.strip():
        raise problem(repr(name), "an empty model name", "give a folder or a model id")
    folder = _folder(name, online=online)
    transformers = require("transformers", feature=_FEATURE, extra="hf")
    torch = require("torch", feature=_FEATURE, extra="hf")
    raw = read_json(folder, "config.json", name) or {}
    check_sizes(raw, name)
    cls = model_class(transformers, raw, name)
    needed = code_needed(raw, read_json(folder, "tokenizer_config.json", name), cls)
    if needed is not None:
        raise _runs_code(name, needed)
    check_weights(folder, name)
    local = {"local_files_only": True, "trust_remote_code": False}
    with _quiet(transformers):
        try:
            config = transformers.AutoConfig.from_pretrained(folder, **local)
        except Exception as error:  # a hostile config.json: transformers raises any type
            raise _refusal(name, error, "transformers cannot read its config.json") from None
        family = str(getattr(config, "model_type", "") or type(config).__name__)
        cls = cls or transformers.AutoModel
        reads = getattr(cls, "main_input_name", "input_ids")
        if reads != "input_ids":
            raise problem(
                name,
                f"a {family} model reads {reads}, not text, and --hf explains a text",
                "trace it from Python with qkv.tracing(model=...) (docs/hf.md)",
            )
        check_fits(transformers, cls, config, name, family)
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(folder, **local)
        except Exception as error:
            if _asks_for_code(error):
                raise _runs_code(name, "its tokenizer is its own code") from None
            raise problem(
                name,
                "no tokenizer could be loaded from it (no tokenizer.json, nor the files of "
                "a tokenizer class transformers knows)",
                "save one next to the model with tokenizer.save_pretrained(FOLDER)",
            ) from None
        try:
            model = cls.from_pretrained(
                folder, config=config, dtype=torch.float32, weights_only=True, **local
            ).eval()
        except pickle.UnpicklingError:
            files = ", ".join(sorted(p.name for p in folder.glob("*.bin"))) or "its weights"
            raise problem(
                name,
                f"{files} holds Python objects besides the weights (a pickle, which would run "
                "code when loaded), refused by torch.load(weights_only=True)",
                "save the weights as safetensors (model.save_pretrained(FOLDER)) from a "
                "source you trust",
            ) from None
        except Exception as error:
            raise _refusal(name, error, f"transformers cannot load the {family} model") from None
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        family=family,
        encoder_only=bool(getattr(config, "is_encoder_decoder", False)),
    )


def _asks_for_code(error: BaseException) -> bool:
    """transformers' own refusal of a folder's code (``trust_remote_code=False``)."""
    return "trust_remote_code" in str(error) or "custom code" in str(error)


def _runs_code(name: str, needed: str) -> ValueError:
    return problem(
        name,
        f"loading it would run code from the folder ({needed}), and qkv runs no code from "
        "a model folder",
        "if you trust its authors, load it in Python with trust_remote_code=True and trace "
        "it with qkv.tracing(model=...) (docs/hf.md)",
    )


def _refusal(name: str, error: BaseException, what: str) -> ValueError:
    if _asks_for_code(error):
        return _runs_code(name, "transformers found code of its own in it")
    return problem(
        name,
        f"{what} ({first_line(error)})",
        "check the folder's config.json and weights (model.safetensors), or load it in Python",
    )


def _home_as_tilde(path: str) -> str:
    """``~/.cache/...`` for a path under the home folder, as people write it."""
    home = str(Path.home())
    return "~" + path[len(home) :] if path.startswith(home + "/") else path
