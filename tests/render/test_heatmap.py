"""Heatmaps: PNG and SVG files, what they hold, and the errors."""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import qkv
from qkv import examples, render
from qkv._extras import MissingExtraError
from tests.support.traces import two_layers

ROOT = Path(__file__).resolve().parents[2]
SVG_NS = "{http://www.w3.org/2000/svg}"


def panels_in_svg(svg: str) -> list[str]:
    return re.findall(r'<g id="(qkv-panel-\d+-\d+)"', svg)


def svg_texts(svg: str) -> list[str]:
    root = ET.fromstring(svg)
    return ["".join(node.itertext()) for node in root.iter(f"{SVG_NS}text")]


def test_png_has_one_panel_per_head_and_the_expected_size(tmp_path: Path) -> None:
    trace = examples.run(examples.builtin("two-heads"))
    figure = render.heatmap(trace, tmp_path / "w.png", dpi=100)
    width, height = (round(v * 100) for v in figure.get_size_inches())
    with Image.open(tmp_path / "w.png") as image:
        assert image.format == "PNG" and image.size == (width, height)
        pixels = np.asarray(image.convert("RGB"))
    assert width > height > 200  # two panels side by side
    assert (pixels < 100).all(axis=-1).any()  # dark cells: 0.40 is the darkest weight
    panels = [ax for ax in figure.axes if ax.get_gid()]
    assert [ax.get_title() for ax in panels] == ["head 0", "head 1"]
    shown = np.asarray(panels[0].get_images()[0].get_array())
    np.testing.assert_allclose(shown, trace["weights"].value[0])


def test_svg_keeps_tokens_as_text_and_has_a_group_per_panel(tmp_path: Path) -> None:
    trace = examples.run(examples.builtin("two-heads"))
    trace.tokens = ["time", "<b>flies&", "like", "arrows"]
    render.heatmap(trace, tmp_path / "w.svg")
    svg = (tmp_path / "w.svg").read_text(encoding="utf-8")
    assert panels_in_svg(svg) == ["qkv-panel-1-1", "qkv-panel-1-2"]
    texts = svg_texts(svg)
    assert texts.count("<b>flies&") == 4  # query and key labels of both panels, escaped
    assert texts.count("time") == 4
    assert "0.40" in texts  # numbers in the cells of a small matrix
    assert "Attention weights: Time flies like arrows" in texts
    assert "<dc:date>" not in svg


def test_numbers_in_cells_are_readable_on_their_colour() -> None:
    def luminance(rgb: Sequence[float]) -> float:
        lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb[:3]]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    from matplotlib.colors import to_rgb

    trace = examples.run(examples.builtin("the-cat-sat-on-the-mat"), causal=True)
    for step in ("weights", "masked"):
        ax = render.heatmap(trace, step=step).axes[0]
        image = ax.get_images()[0]
        values = image.get_array()
        assert values is not None
        colours = np.asarray(image.to_rgba(values), dtype=np.float64)  # (Lq, Lk, 4)
        assert colours.max() <= 1.0
        for text in ax.texts:
            i, j = (round(v) for v in text.get_position()[::-1])
            a, b = luminance(to_rgb(text.get_color())), luminance(list(colours[i, j]))
            assert (max(a, b) + 0.05) / (min(a, b) + 0.05) >= 4.5, (step, text.get_text())


def test_files_are_the_same_each_time(tmp_path: Path) -> None:
    trace = examples.run(examples.builtin("i-love-statistics"))
    for name in ("a.svg", "b.svg", "a.png", "b.png"):
        render.heatmap(trace, tmp_path / name)
    assert (tmp_path / "a.svg").read_bytes() == (tmp_path / "b.svg").read_bytes()
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


def test_scores_on_request_with_a_diverging_scale_and_grey_masked_cells(tmp_path: Path) -> None:
    trace = examples.run(examples.builtin("the-cat-sat-on-the-mat"), causal=True)
    figure = render.heatmap(trace, tmp_path / "m.svg", step="masked")
    ax = figure.axes[0]
    low, high = ax.get_images()[0].get_clim()
    assert low == -high and high > 0
    texts = svg_texts((tmp_path / "m.svg").read_text(encoding="utf-8"))
    assert texts.count("−∞") == 15  # the upper triangle of 6 tokens
    assert "Masked attention scores: The cat sat on the mat" in texts
    weights = render.heatmap(trace)
    assert weights.axes[0].get_images()[0].get_clim()[0] == 0.0


def test_several_layers_give_one_row_each_and_a_layer_can_be_chosen(tmp_path: Path) -> None:
    trace = two_layers()
    render.heatmap(trace, tmp_path / "all.svg")
    svg = (tmp_path / "all.svg").read_text(encoding="utf-8")
    assert panels_in_svg(svg) == [f"qkv-panel-{r}-{c}" for r in (1, 2) for c in (1, 2)]
    assert "blocks.1.attn, head 1" in svg_texts(svg)
    one = render.heatmap(trace, layer="blocks.1.attn", heads=[1])
    (panel,) = [ax for ax in one.axes if ax.get_gid()]
    np.testing.assert_allclose(
        np.asarray(panel.get_images()[0].get_array()), trace.steps[1].value[1]
    )
    assert len([ax for ax in render.heatmap(trace, layer=0).axes if ax.get_gid()]) == 2


def test_long_sequences_label_some_tokens_and_write_no_numbers() -> None:
    rng = np.random.default_rng(3)

    def attention(length: int) -> qkv.Trace:
        w_q, w_k, w_v = (rng.normal(size=(4, 4)) for _ in range(3))
        with qkv.tracing() as trace:
            qkv.self_attention(rng.normal(size=(length, 4)), w_q, w_k, w_v)
        return trace

    ax = render.heatmap(attention(100)).axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels[:3] == ["t0", "t3", "t6"] and len(labels) == 34  # every 3rd of 100
    assert len(ax.texts) == 0
    ax = render.heatmap(attention(13)).axes[0]
    assert len(ax.texts) == 0  # 13 > 12: no numbers unless asked
    ax = render.heatmap(attention(13), values=True).axes[0]
    assert len(ax.texts) == 169 and ax.texts[0].get_text().startswith("0.")


def test_errors_name_the_argument(tmp_path: Path) -> None:
    trace = examples.run(examples.builtin("two-heads"))
    with pytest.raises(ValueError, match=r"step must be one of scores, .*got 'Q'"):
        render.heatmap(trace, step="Q")
    with pytest.raises(ValueError, match=r"no step 'masked' to draw \(recorded: embeddings"):
        render.heatmap(trace, step="masked")
    with pytest.raises(ValueError, match=r"path must end in .png or .svg, got '.*w.jpg'. Hint"):
        render.heatmap(trace, tmp_path / "w.jpg")
    with pytest.raises(ValueError, match=r"heads: 2 is not a head of this trace; .* 0 to 1"):
        render.heatmap(trace, heads=[2])
    with pytest.raises(ValueError, match=r"no layer named 'x'"):
        render.heatmap(trace, layer="x")
    with pytest.raises(ValueError, match=r"layer 3 is out of range"):
        render.heatmap(trace, layer=3)
    with pytest.raises(ValueError, match=r"folder '.*missing' does not exist"):
        render.heatmap(trace, tmp_path / "missing" / "w.png")
    with pytest.raises(TypeError, match=r"trace must be a qkv\.Trace"):
        render.heatmap("trace")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_too_many_panels_is_refused_with_a_hint() -> None:
    trace = qkv.Trace(tokens=["a", "b"])
    trace.record("weights", np.full((65, 2, 2), 0.5), formula="A", description="",
                 axes=("head", "query", "key"))  # fmt: skip
    with pytest.raises(ValueError, match=r"65 panels are too many .*Hint: choose a layer"):
        render.heatmap(trace)
    assert len([ax for ax in render.heatmap(trace, heads=[0, 64]).axes if ax.get_gid()]) == 2


def test_without_matplotlib_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    trace = examples.run(examples.builtin("two-heads"))
    with pytest.raises(MissingExtraError, match=r"heatmap needs matplotlib.*qkv\[viz\]"):
        render.heatmap(trace)


def test_the_readme_picture_is_what_the_documented_command_draws(tmp_path: Path) -> None:
    committed = ROOT / "docs" / "img" / "weights.png"
    assert "docs/img/weights.png" in (ROOT / "README.md").read_text(encoding="utf-8")
    command = "qkv explain --example two-heads --plot docs/img/weights.png"
    assert command in (ROOT / "docs" / "pictures.md").read_text(encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "qkv", *command.split()[1:-1], str(tmp_path / "w.png")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with Image.open(committed) as old, Image.open(tmp_path / "w.png") as new:
        assert old.size == new.size


def test_the_commands_and_code_of_docs_pictures_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from qkv.cli import main

    text = (ROOT / "docs" / "pictures.md").read_text(encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs" / "img").mkdir(parents=True)
    commands = [
        line.split("#")[0].split()
        for block in re.findall(r"```sh\n(.*?)```", text, re.S)
        for line in block.splitlines()
        if line.startswith("qkv ")
    ]
    assert len(commands) >= 5
    for argv in commands:
        assert main(argv[1:]) == 0, (argv, capsys.readouterr().err)
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "examples.run" in b]
    assert len(blocks) == 2
    for block in blocks:
        exec(block, {})
    written = {p.name for p in tmp_path.iterdir()}
    assert {"weights.png", "explain.html", "cat.html", "weights.svg", "scores.pdf"} <= written
    assert {"scaled.png", "masked.svg"} <= written
    assert (tmp_path / "docs" / "img" / "weights.png").is_file()
