"""``qkv explain --hf MODEL --text TEXT``: a saved Hugging Face model, explained offline.

Each model is a tiny random one built from its config and saved with ``save_pretrained`` to a
temporary folder, with a ``tokenizers`` WordLevel tokenizer built in the test
(``tests/support/hf_models.py``); nothing is downloaded. The weights ``--format json``
prints are compared with the model's own ``eager`` implementation
(``output_attentions=True``, as transformers' own tests read them) to 1e-6.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import qkv
from qkv.cli import main
from tests.support.hf_models import eager_attentions, save_tiny

TEXT = "the cat sat on the mat and the dog ran"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    code = main(["explain", *(str(a) for a in argv)])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("qkv: error: ") and "Hint:" in lines[0], lines[0]
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {family: save_tiny(family, root / family) for family in ("llama", "gpt2", "bert", "t5")}


def page_data(path: Path) -> dict[str, Any]:
    found = re.search(r'id="qkv-data">(.*?)</script>', path.read_text(encoding="utf-8"), re.S)
    assert found is not None
    data: dict[str, Any] = json.loads(found.group(1))
    return data


# -- the exact weights of one head and one query row ----------------------------------------


@pytest.mark.parametrize(
    ("family", "layer", "head", "query", "index", "row"),
    [
        ("llama", "-1", "3", "mat", 1, 5),  # GQA, RoPE; a token given as text
        ("gpt2", "1", "-1", "2", 1, 2),  # fused QKV; a position; the last head
        ("bert", "0", "2", "-1", 0, 11),  # [CLS] … [SEP]: the last token is [SEP]
        ("t5", "encoder.block.1", "1", "dog", 1, 8),  # its encoder; a block's module path
    ],
)
def test_json_prints_the_exact_weights_of_the_head_and_row(
    capsys: pytest.CaptureFixture[str],
    folders: dict[str, Path],
    family: str,
    layer: str,
    head: str,
    query: str,
    index: int,
    row: int,
) -> None:
    code, out, err = run(
        capsys, "--hf", folders[family], "--text", TEXT, "--layer", layer, "--head", head,
        "--query", query, "--format", "json",
    )  # fmt: skip
    assert code == 0, err
    trace = qkv.Trace.from_json(out)
    tokens, eager = eager_attentions(folders[family], TEXT)
    assert trace.tokens == tokens  # the tokenizer's own tokens
    assert len(trace.layer_names()) == 1  # only what was asked is traced
    weights = trace["weights"]
    assert weights.value.shape == (1, 1, 1, len(tokens))
    assert weights.index == {"head": [int(head) % 4], "query": [row]}
    expected = eager[index][0, int(head), row].numpy()
    np.testing.assert_allclose(weights.value[0, 0, 0], expected, rtol=0, atol=1e-6)


def test_the_explanation_says_q_and_k_are_after_rope(
    capsys: pytest.CaptureFixture[str], folders: dict[str, Path]
) -> None:
    code, out, _ = run(capsys, "--hf", folders["llama"], "--text", "the cat sat", "--head", "1")
    assert code == 0
    assert "after RoPE" in " ".join(out.split())
    assert "Head 1 of 4 heads (key/value head 0 of 2)" in out
    assert "model.layers.0.self_attn" in out
    assert max(len(line) for line in out.splitlines()) <= 80
    code, out, _ = run(capsys, "--hf", folders["gpt2"], "--text", "the cat sat")
    assert code == 0 and "RoPE" not in out and "Q and K are the model's own" in out


def test_without_query_every_row_of_a_short_text_is_traced(
    capsys: pytest.CaptureFixture[str], folders: dict[str, Path]
) -> None:
    code, out, _ = run(capsys, "--hf", folders["bert"], "--text", "a big red house", "-f", "json")
    assert code == 0
    weights = qkv.Trace.from_json(out)["weights"]
    assert weights.value.shape[-2:] == (6, 6)  # [CLS] a big red house [SEP]
    np.testing.assert_allclose(weights.value.sum(-1), 1.0, atol=1e-6)


@pytest.mark.parametrize("fmt", ["text", "markdown", "latex"])
def test_every_text_format_shows_the_tokens(
    capsys: pytest.CaptureFixture[str], folders: dict[str, Path], fmt: str
) -> None:
    code, out, err = run(
        capsys, "--hf", folders["gpt2"], "--text", "the quick brown fox", "--query", "fox",
        "--format", fmt, "--steps", "scores,weights",
    )  # fmt: skip
    assert code == 0, err
    assert "quick" in out and "brown" in out
    assert "Attention weights" in out or "attention weights" in out.lower()


def test_query_finds_a_token_without_its_word_mark() -> None:
    """Byte-level BPE (GPT-2) writes "Ġmat", SentencePiece (Llama) "▁mat", WordPiece "##s"."""
    from qkv.cli._explain_hf import _query

    tokens = ["<s>", "▁the", "Ġmat", "##s", "mat", "-1"]
    assert [_query(tokens, q) for q in ("the", "Ġmat", "s", "mat", "-1", "-2")] == [
        1,
        2,
        3,
        4,
        5,
        4,
    ]


def test_plot_writes_the_heads_picture(
    capsys: pytest.CaptureFixture[str], folders: dict[str, Path], tmp_path: Path
) -> None:
    picture = tmp_path / "weights.svg"
    code, _, err = run(capsys, "--hf", folders["llama"], "--text", "the cat sat", "--plot", picture)
    assert code == 0, err
    assert picture.read_text(encoding="utf-8").lstrip().startswith("<?xml")


def test_html_holds_every_layer_and_head_and_opens_on_the_one_asked(
    capsys: pytest.CaptureFixture[str], folders: dict[str, Path], tmp_path: Path
) -> None:
    page = tmp_path / "model.html"
    code, _, err = run(
        capsys, "--hf", folders["llama"], "--text", TEXT, "--layer", "1", "--head", "2",
        "--html", page,
    )  # fmt: skip
    assert code == 0, err
    data = page_data(page)
    assert [c["name"] for c in data["calls"]] == [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
    ]
    view = data["modelView"]
    assert [len(row["heads"]) for row in view["rows"]] == [4, 4]
    assert view["start"] == {"call": 1, "head": 2}
    titles = [section["title"] for section in data["calls"][1]["sections"]]
    assert titles[2].startswith("Head 2 of 4 heads")
    # every step of every head, for every token of the short text
    names = {step["name"] for step in data["calls"][0]["sections"][0]["steps"]}
    assert {"Q", "K", "V", "scores", "weights", "context"} <= names


@pytest.mark.parametrize("head", ["0", "3", "-1"])
def test_head_n_is_what_every_output_calls_head_n(
    capsys: pytest.CaptureFixture[str], folders: dict[str, Path], tmp_path: Path, head: str
) -> None:
    """Counted from 0 everywhere: ``--head N --layer 1 --query 2`` is the section titled
    ``Head N of 4 heads`` of layer 1, for the token at position 2, in the text, Markdown,
    LaTeX and JSON formats and on the page (issue 25, item 2)."""
    number = int(head) % 4
    title = f"Head {number} of 4 heads (key/value head {number // 2} of 2)"
    argv = ["--hf", folders["llama"], "--text", "the cat sat on", "--layer", "1"]
    argv += ["--head", head, "--query", "2"]
    for fmt in ("text", "markdown", "latex"):
        code, out, err = run(capsys, *argv, "--format", fmt)
        assert code == 0, err
        words = " ".join(out.split()).replace("\\_", "_")  # LaTeX escapes the underscore
        assert title in words, fmt
        assert f"head {number} of 4 heads" in words  # the description
        assert "model.layers.1.self_attn" in words
        assert re.search(rf"Head (?!{number} )\d of 4", words) is None, fmt  # no other head
    code, out, err = run(capsys, *argv, "--format", "json")
    assert code == 0, err
    trace = qkv.Trace.from_json(out)
    assert trace["weights"].index == {"head": [number], "query": [2]}
    assert trace.query_tokens == ["sat"] and trace.layer_names() == ["model.layers.1.self_attn"]
    page = tmp_path / "page.html"
    code, _, err = run(capsys, *argv, "--html", page)
    assert code == 0, err
    data = page_data(page)
    start = data["modelView"]["start"]
    assert start == {"call": 1, "head": number}
    sections = [s for s in data["calls"][1]["sections"] if s["head"] is not None]
    assert sections[number]["title"] == title
    row = data["modelView"]["rows"][1]
    assert [m["number"] for m in row["heads"]] == [0, 1, 2, 3]  # the grid's column headers


def test_the_page_reads_every_head_s_context_with_its_own_values(
    capsys: pytest.CaptureFixture[str], folders: dict[str, Path], tmp_path: Path
) -> None:
    """The case of issue 25: a grouped-query model (4 heads, 2 key/value heads) on the page
    with one query row. Every head of every layer shows the K and V of its key/value head
    and its context vectors as weighted sums of them (they read "no context vectors" for
    heads 2 and 3, which were given key/value head 0)."""
    page = tmp_path / "page.html"
    code, _, err = run(
        capsys, "--hf", folders["llama"], "--text", TEXT, "--query", "cat", "--html", page
    )
    assert code == 0, err
    data = page_data(page)
    for call in data["calls"]:
        sections = [s for s in call["sections"] if s["head"] is not None]
        assert len(sections) == 4
        values = []
        for section in sections:
            steps = {step["name"]: step for step in section["steps"]}
            assert steps["context"]["weightedSum"] is True, section["title"]
            values.append(steps["V"]["data"])
        assert values[0] == values[1] != values[2] == values[3]  # key/value heads 0, 0, 1, 1


def test_a_long_page_keeps_every_step_of_one_layer_and_the_weights_of_the_others(
    capsys: pytest.CaptureFixture[str],
    folders: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from qkv.cli import _explain_hf

    def steps_of(data: dict[str, Any]) -> list[set[str]]:
        return [
            {step["name"] for section in call["sections"] for step in section["steps"]}
            for call in data["calls"]
        ]

    monkeypatch.setattr(_explain_hf, "PAGE_VALUES", 4_000)
    page = tmp_path / "small.html"
    code, _, err = run(
        capsys, "--hf", folders["gpt2"], "--text", TEXT, "--layer", "1", "--html", page
    )
    assert code == 0, err
    data = page_data(page)
    first, second = steps_of(data)
    assert first == {"weights"} and {"Q", "K", "V", "weights", "context"} <= second
    assert "every step of transformer.h.1.attn" in data["description"]
    assert [len(row["heads"]) for row in data["modelView"]["rows"]] == [4, 4]

    monkeypatch.setattr(_explain_hf, "PAGE_VALUES", 1_000)
    code, _, err = run(capsys, "--hf", folders["gpt2"], "--text", TEXT, "--html", page)
    assert code == 0, err
    data = page_data(page)
    assert steps_of(data) == [{"weights"}, {"weights"}]
    assert "attention weights only" in data["description"]


def test_a_model_id_in_the_local_cache_is_found_offline(
    capsys: pytest.CaptureFixture[str],
    folders: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cache's layout (models--ORG--NAME/refs/main, snapshots/COMMIT/...) as
    huggingface_hub writes it."""
    import huggingface_hub

    repo = tmp_path / "hub" / "models--tiny--llama"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for file in folders["llama"].iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    code, out, err = run(capsys, "--hf", "tiny/llama", "--text", "the cat", "-f", "json")
    assert code == 0, err
    assert qkv.Trace.from_json(out).tokens == ["the", "cat"]
    code, _, err = run(capsys, "--hf", "tiny/other", "--text", "the cat")
    line = one_error_line(code, err)
    assert "not in the local Hugging Face cache" in line
    assert "hf download tiny/other" in line and "--online" in line


def test_only_online_downloads_and_never_code_nor_pickles(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    asked: list[dict[str, Any]] = []

    def snapshot_download(name: str, **options: Any) -> Any:
        asked.append(options)
        if options.get("local_files_only"):
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        raise OSError("no network here")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    code, _, err = run(capsys, "--hf", "tiny/llama", "--text", "the cat")
    assert "not in the local Hugging Face cache" in one_error_line(code, err)
    assert [a.get("local_files_only") for a in asked] == [True]  # no download was tried
    asked.clear()
    code, _, err = run(capsys, "--hf", "tiny/llama", "--text", "the cat", "--online")
    assert "the download failed (no network here)" in one_error_line(code, err)
    assert [a.get("local_files_only") for a in asked] == [True, None]
    patterns = asked[1]["allow_patterns"]
    assert "*.safetensors" in patterns and "*.json" in patterns
    assert not {"*.py", "*.bin", "*.pt", "*.pkl", "*"} & set(patterns)


# -- one line and exit 2 for each mistake ------------------------------------------------------


def test_bad_folders_and_names_are_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    cases = [
        (tmp_path / "missing", "no such folder"),
        (tmp_path, "holds no config.json"),
        ("not a model id!", "neither a folder nor a valid model id"),
    ]
    for model, expected in cases:
        code, _, err = run(capsys, "--hf", model, "--text", "the cat")
        assert expected in one_error_line(code, err)


def test_a_folder_without_a_tokenizer_or_text_input_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=30, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2,
    )  # fmt: skip
    tf.LlamaForCausalLM(config).save_pretrained(tmp_path / "bare")
    capsys.readouterr()  # transformers' progress bar
    code, _, err = run(capsys, "--hf", tmp_path / "bare", "--text", "the cat")
    assert "no tokenizer could be loaded" in one_error_line(code, err)
    vit = tf.ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        image_size=8, patch_size=4,
    )  # fmt: skip
    tf.ViTModel(vit).save_pretrained(tmp_path / "vit")
    capsys.readouterr()
    code, _, err = run(capsys, "--hf", tmp_path / "vit", "--text", "the cat")
    assert "reads pixel_values, not text" in one_error_line(code, err)


def test_a_family_without_the_attention_interface_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import transformers as tf

    from tests.support.hf_models import VOCAB, tokenizer

    config = tf.BloomConfig(vocab_size=len(VOCAB), hidden_size=16, n_layer=1, n_head=2)
    tf.BloomForCausalLM(config).save_pretrained(tmp_path / "bloom")
    tokenizer().save_pretrained(tmp_path / "bloom")
    capsys.readouterr()
    code, _, err = run(capsys, "--hf", tmp_path / "bloom", "--text", "the cat")
    line = one_error_line(code, err)
    assert "the bloom family" in line and "does not call transformers' AttentionInterface" in line


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--layer", "2"], "--layer 2: expected a position from 0 to 1 (or from -2 to -1)"),
        (["--layer", "model.nope"], "the 2 attention layers are model.layers.0.self_attn"),
        (["--head", "4"], "--head 4: index 4 does not exist in layer 'model.layers.0.self_attn'"),
        (["--head", "-5", "--html", "page.html"], "--head -5: index -5 does not exist"),
        (["--query", "emu"], "--query 'emu' is not a token of --text"),
        (["--query", "3"], "--query 3: expected a position from 0 to 2"),
        (["--example", "two-heads"], "--example cannot be"),
        (["--heads", "2"], "--heads cannot be"),
    ],
)
def test_bad_layer_head_or_query_is_one_line(
    capsys: pytest.CaptureFixture[str],
    folders: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    expected: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "--hf", folders["llama"], "--text", "the cat sat", *argv)
    assert expected in one_error_line(code, err)
    assert not (tmp_path / "page.html").exists()


def test_text_and_hf_go_together(
    capsys: pytest.CaptureFixture[str], folders: dict[str, Path]
) -> None:
    code, _, err = run(capsys, "--hf", folders["llama"])
    assert "needs --text TEXT" in one_error_line(code, err)
    code, _, err = run(capsys, "--head", "1")
    assert "--head goes with --hf MODEL" in one_error_line(code, err)
    code, _, err = run(capsys, "--online")
    assert "--online goes with --hf MODEL" in one_error_line(code, err)
    long = " ".join(["the"] * 70)  # the tiny GPT-2 has 64 positions
    code, _, err = run(capsys, "--hf", folders["gpt2"], "--text", long)
    assert "70 tokens, more than the 64 positions" in one_error_line(code, err)


def test_without_transformers_it_says_which_extra(
    capsys: pytest.CaptureFixture[str], folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    for name in [n for n in sys.modules if n == "qkv.hf" or n.startswith("qkv.hf.")]:
        monkeypatch.delitem(sys.modules, name)
    code, _, err = run(capsys, "--hf", folders["llama"], "--text", "the cat")
    line = one_error_line(code, err)
    assert "--hf needs transformers" in line and "pip install 'qkv[hf]'" in line


def test_the_guide_quotes_the_errors_as_printed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    guide = (Path(__file__).resolve().parents[2] / "docs" / "hf.md").read_text(encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    default = Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(default))
    for model in ("./no-such-model", "tiny/llama"):
        code, _, err = run(capsys, "--hf", model, "--text", "the cat")
        line = one_error_line(code, err)
        assert f'$ qkv explain --hf {model} --text "the cat"\n{line}\n' in guide


def test_help_shows_an_hf_example(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "--hf MODEL" in out and "qkv explain --hf ./my-model" in out
    assert max(len(line) for line in out.splitlines()) <= 80
