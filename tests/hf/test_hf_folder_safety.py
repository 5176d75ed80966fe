"""Issue 24, item 1: a model folder never runs code, and a hostile one is one line.

``qkv explain --hf DIR`` on a folder that carries its own code (``auto_map`` naming a
``modeling_*.py`` or a ``tokenization_*.py``), with stdin answering ``y`` to transformers'
"Do you wish to run the custom code? [y/N]": the code writes a canary file when it runs,
and the canary must not appear. Before the fix the model route asked and ran the
configuration's code; the tokenizer route ran its code and exited 0.

The expectation is transformers' own (``tests/models/auto/test_tokenization_auto.py``,
``test_from_pretrained_dynamic_tokenizer``, and ``test_modeling_auto.py``,
``test_from_pretrained_dynamic_model_local``): with ``trust_remote_code=False`` a folder
whose code is needed is refused with a ``ValueError``; qkv adds that nothing prompts and
that the refusal is one line, exit 2.

Every hostile folder runs in a child process with 2 GiB of address space and a time limit
(a config of a million layers hung before the fix), all in one child to pay the import of
transformers once.
"""

from __future__ import annotations

import pickle
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from qkv.cli import main
from tests.support.hf_models import save_tiny, variant
from tests.support.isolated import run_cli_isolated

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("models") / "llama")


def canary_code(canary: Path, module: str) -> str:
    """Python that leaves ``canary`` behind when it runs: the proof that code ran."""
    return f"open({str(canary)!r}, 'w').write({module!r})\n"


class Evil:
    """Unpickling this runs ``open(canary, "w")``: a pickle that is a program."""

    def __init__(self, canary: Path) -> None:
        self.canary = str(canary)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.canary, "w"))


def one_line(result: tuple[int, str]) -> str:
    code, err = result
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("qkv: error: --hf ") and "Hint:" in lines[0], lines[0]
    assert "[y/N]" not in err
    return lines[0]


def remote_model(base: Path, folder: Path, canary: Path) -> Path:
    """A folder whose config names its own configuration and model classes."""
    return variant(
        base,
        folder,
        config={
            "model_type": "evil",
            "architectures": ["EvilForCausalLM"],
            "auto_map": {
                "AutoConfig": "configuration_evil.EvilConfig",
                "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
            },
        },
        files={
            "configuration_evil.py": canary_code(canary, "configuration")
            + "from transformers import LlamaConfig\n"
            "class EvilConfig(LlamaConfig):\n    model_type = 'evil'\n",
            "modeling_evil.py": canary_code(canary, "modeling")
            + "from transformers import LlamaForCausalLM\n"
            "from .configuration_evil import EvilConfig\n"
            "class EvilForCausalLM(LlamaForCausalLM):\n    config_class = EvilConfig\n",
        },
    )


def remote_tokenizer(base: Path, folder: Path, canary: Path) -> Path:
    """A folder whose tokenizer_config.json names its own tokenizer class."""
    return variant(
        base,
        folder,
        tokenizer_config={
            "tokenizer_class": "EvilTokenizer",
            "auto_map": {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]},
        },
        files={
            "tokenization_evil.py": canary_code(canary, "tokenization")
            + "from transformers import PreTrainedTokenizerFast\n"
            "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n",
        },
    )


def test_a_folder_with_its_own_code_runs_none_of_it_even_when_stdin_says_yes(
    base: Path, tmp_path: Path
) -> None:
    canary = tmp_path / "CANARY"
    folders = [
        remote_model(base, tmp_path / "model", canary),
        remote_tokenizer(base, tmp_path / "tokenizer", canary),
    ]
    runs = [["explain", "--hf", str(f), "--text", "the cat"] for f in folders]
    results = run_cli_isolated(runs, stdin="y\n" * 50)
    assert not canary.exists(), f"the folder's {canary.read_text()} code ran"
    model, tokenizer = (one_line(r) for r in results)
    assert "would run code from the folder (config.json's auto_map names" in model
    assert "evil.py), and qkv runs no code from a model folder" in model
    assert "tokenizer_config.json's auto_map names tokenization_evil.py" in tokenizer


def test_a_folder_whose_auto_map_transformers_has_itself_loads_its_own_class(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Llama saved with an ``auto_map`` (as Hub models upstreamed into transformers are):
    transformers' own Llama is loaded and the folder's modeling_llama.py never runs."""
    canary = tmp_path / "CANARY"
    folder = variant(
        base,
        tmp_path / "upstreamed",
        config={"auto_map": {"AutoModelForCausalLM": "modeling_llama.LlamaForCausalLM"}},
        files={"modeling_llama.py": canary_code(canary, "modeling")},
    )
    assert main(["explain", "--hf", str(folder), "--text", "the cat", "-f", "json"]) == 0
    assert not canary.exists()


def test_every_from_pretrained_gets_trust_remote_code_false(
    base: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import transformers

    seen: dict[str, dict[str, Any]] = {}
    for cls in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.LlamaForCausalLM):
        original = cls.from_pretrained

        def spy(*args: Any, _name: str = cls.__name__, _call: Any = original, **kw: Any) -> Any:
            seen[_name] = kw
            return _call(*args, **kw)

        monkeypatch.setattr(cls, "from_pretrained", spy)
    assert main(["explain", "--hf", str(base), "--text", "the cat", "-f", "json"]) == 0
    assert set(seen) == {"AutoConfig", "AutoTokenizer", "LlamaForCausalLM"}
    assert all(kw["trust_remote_code"] is False for kw in seen.values()), seen
    assert seen["LlamaForCausalLM"]["weights_only"] is True


def hostile_folders(base: Path, root: Path, canary: Path) -> dict[str, tuple[Path, str]]:
    """Each hostile folder and the words its one line must hold."""
    weights = (base / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", weights[:8])
    return {
        "a million layers": (
            variant(base, root / "layers", config={"num_hidden_layers": 1_000_000}),
            "num_hidden_layers: expected from 0 to 1,024 layers, got 1,000,000",
        ),
        "a width of 10**9": (
            variant(base, root / "width", config={"hidden_size": 10**9}),
            "needs about 2.5 TB of memory for its 635,000,000,000 parameters in float32",
        ),
        "no heads": (
            variant(base, root / "heads0", config={"num_attention_heads": 0}),
            "num_attention_heads: expected from 1 to 2,147,483,647 heads, got 0",
        ),
        "heads not dividing the width": (
            variant(base, root / "heads7", config={"num_attention_heads": 7, "head_dim": None}),
            "num_attention_heads: expected a number of heads that divides hidden_size (32)",
        ),
        "key/value heads not dividing the heads": (
            variant(base, root / "kv3", config={"num_key_value_heads": 3}),
            "num_key_value_heads: expected a number that divides num_attention_heads (4)",
        ),
        "a width that is text": (
            variant(base, root / "text", config={"hidden_size": "32"}),
            "hidden_size: expected a whole number, got '32'",
        ),
        "Trainer as architecture": (
            variant(base, root / "trainer", config={"architectures": ["Trainer"]}),
            "architectures names 'Trainer', which is not a model class of transformers",
        ),
        "AutoTokenizer as architecture": (
            variant(base, root / "autotok", config={"architectures": ["AutoTokenizer"]}),
            "architectures names 'AutoTokenizer', which is not a model class",
        ),
        "a truncated safetensors file": (
            variant(
                base, root / "truncated", files={"model.safetensors": weights[: len(weights) // 2]}
            ),
            "model.safetensors is no valid safetensors file: its tensors need",
        ),
        "a huge safetensors header": (
            variant(
                base,
                root / "header",
                files={"model.safetensors": struct.pack("<Q", 1 << 62) + weights[8:]},
            ),
            "its header claims 4,611,686,018,427,387,904 bytes, more than the format allows",
        ),
        "a header longer than the file": (
            variant(
                base,
                root / "longer",
                files={"model.safetensors": weights[: 8 + length // 2]},
            ),
            "more than the file holds",
        ),
        "a pickle that runs code": (
            variant(
                base,
                root / "pickle",
                files={"model.safetensors": b"", "pytorch_model.bin": pickle.dumps(Evil(canary))},
            ),
            "pytorch_model.bin holds Python objects besides the weights (a pickle",
        ),
        "config.json not JSON": (
            variant(base, root / "notjson", files={"config.json": "{nope"}),
            "config.json cannot be read",
        ),
    }


def test_hostile_folders_are_one_line_before_anything_is_built(base: Path, tmp_path: Path) -> None:
    canary = tmp_path / "CANARY"
    cases = hostile_folders(base, tmp_path, canary)
    runs = [["explain", "--hf", str(folder), "--text", "the cat"] for folder, _ in cases.values()]
    results = run_cli_isolated(runs, stdin="y\n" * 50)
    for (case, (_, expected)), result in zip(cases.items(), results, strict=True):
        assert expected in one_line(result), (case, result)
    assert not canary.exists()


def test_a_pytorch_weights_file_of_tensors_alone_still_loads(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch
    from safetensors.torch import load_file

    folder = variant(base, tmp_path / "bin", files={})
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    assert main(["explain", "--hf", str(folder), "--text", "the cat", "-f", "json"]) == 0


def test_a_model_larger_than_the_memory_available_is_refused_with_the_estimate(
    base: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from qkv.hf import _folder

    monkeypatch.setattr(_folder, "available_memory", lambda: 50_000)
    assert main(["explain", "--hf", str(base), "--text", "the cat"]) == 2
    line = capsys.readouterr().err.strip()
    assert "the llama model needs about 81.3 kB of memory for its 20,320 parameters" in line
    assert "more than the 50.0 kB available. Hint: choose a smaller model" in line


def test_available_memory_sees_the_address_space_limit() -> None:
    code = (
        "import resource\n"
        "from qkv._memory import available_memory\n"
        "mapped = int(next(l for l in open('/proc/self/status') if l.startswith('VmSize'))"
        ".split()[1]) * 1024\n"
        "resource.setrlimit(resource.RLIMIT_AS, (mapped + (300 << 20), mapped + (300 << 20)))\n"
        "print(available_memory())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert 0 < int(done.stdout) <= 300 << 20


def test_the_page_quotes_the_refusals_qkv_prints(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/hf.md's two refusals are, word for word, the lines qkv prints."""
    monkeypatch.chdir(tmp_path)
    variant(
        base,
        tmp_path / "custom-model",
        config={"model_type": "custom", "auto_map": {"AutoModel": "modeling_custom.Custom"}},
    )
    variant(base, tmp_path / "edited-model", config={"num_hidden_layers": 1_000_000})
    page = (Path(__file__).resolve().parents[2] / "docs" / "hf.md").read_text(encoding="utf-8")
    for folder in ("./custom-model", "./edited-model"):
        assert main(["explain", "--hf", folder, "--text", "the cat"]) == 2
        line = capsys.readouterr().err.strip()
        assert f'$ qkv explain --hf {folder} --text "the cat"\n{line}\n' in page
