"""``qkv explain --tiled``: every format shows the tiled pass with the core's numbers, fits the
terminal, escapes hostile tokens, and bad options get one line with exit status 2."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from rich.cells import cell_len

from qkv import examples
from qkv.attention._tiled_steps import tiled_steps
from qkv.cli import main
from qkv.render._tiled import render_tiled, tiled_run

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _run(causal: bool = False, block: int = 2, name: str = "i-love-statistics") -> object:
    return tiled_run(examples.run(examples.builtin(name), causal=causal), block_size=block)


def test_the_run_holds_the_examples_q_k_v_and_equals_its_context() -> None:
    trace = examples.run(examples.builtin("the-cat-sat-on-the-mat"), causal=True)
    run = tiled_run(trace, block_size=4)
    q, k, v = (trace[n].value for n in ("Q", "K", "V"))
    direct = tiled_steps(q, k, v, block_size=4, causal=True, scale=trace.meta["scale"])
    np.testing.assert_array_equal(run.heads[0].output, direct.output)
    np.testing.assert_allclose(run.heads[0].output, trace["context"].value, atol=1e-15)
    assert run.reference_difference < 1e-15
    assert run.heads[0].kinds.tolist() == [["masked", "skipped"], ["full", "masked"]]


@pytest.mark.parametrize("causal", [False, True])
def test_text_shows_every_step_within_80_columns(causal: bool) -> None:
    run = _run(causal)
    text = render_tiled(run, "text")  # type: ignore[arg-type]
    assert max(cell_len(line) for line in text.splitlines()) <= 80  # m̃: 1 column
    steps = run.heads[0]  # type: ignore[attr-defined]
    for t in steps.tiles:
        assert f"Tile (query block {t.q_block}, key block {t.k_block}): {t.kind}" in text
    # the numbers of the last tile of "statistics" and the final O / l, as the core has them
    last = steps.tiles[-1]
    assert f"α[statistics] = exp(0.9533 − 1.0040) = {last.rescale[0]:.4f}" in text
    assert "O[statistics] = [1.5072, 2.2932] / 2.7981 = [0.5386, 0.8196]" in text
    assert "L[statistics] = 1.0040 + log 2.7981 = 2.0330" in text
    assert "Backward of key block 0 (I, love): D = rowsum(dO ∘ O)" in text
    assert re.search(r"max \|O − C\| = \d\.\de-1[5-7]|max \|O − C\| = 0\.0e\+00", text)
    if causal:
        assert "Tile (query block 0, key block 1): skipped" in text
        assert "(on the diagonal of the causal mask)" in text
        assert "α[I] = exp(−∞ − 0.6949) = 0.0000" in text  # the first tile a row sees


@pytest.mark.parametrize("name", examples.builtin_names())
@pytest.mark.parametrize("block", [1, 3])
def test_text_fits_80_columns_on_every_builtin(name: str, block: int) -> None:
    text = render_tiled(_run(True, block, name), "text")  # type: ignore[arg-type]
    assert max(cell_len(line) for line in text.splitlines()) <= 80
    assert "NaN" not in text


def test_every_format_renders() -> None:
    run = _run(True, name="two-heads")
    markdown = render_tiled(run, "markdown")  # type: ignore[arg-type]
    assert markdown.startswith("# FlashAttention, tile by tile: Time flies like arrows")
    assert "## Head 1 of 2 heads" in markdown and "| S' (query \\\\ key) |" in markdown
    latex = render_tiled(run, "latex")  # type: ignore[arg-type]
    assert latex.count(r"\begin{") == latex.count(r"\end{") > 0
    assert latex.count("{") == latex.count("}")
    assert r"\alpha" in latex and "NaN" not in latex
    data = json.loads(render_tiled(run, "json"))  # type: ignore[arg-type]
    assert data["kind"] == "tiled-attention" and data["lse_base"] == "e"
    head = data["heads"][1]
    assert [t["kind"] for t in head["forward"]] == ["masked", "skipped", "full", "masked"]
    assert head["forward"][1]["scores"] == [["-inf", "-inf"], ["-inf", "-inf"]]
    assert head["max_difference"]["output_vs_reference"] < 1e-15
    assert len(head["backward"]["tiles"]) == 2  # key block 0: both query blocks


def test_hostile_tokens_are_shown_as_text(tmp_path: Path) -> None:
    example = tmp_path / "evil.yaml"
    example.write_text(
        "format: 2\ntokens: ['<script>x', \"\\e[31mred\", '[a](b)']\ninputs:\n"
        "  Q: [[1, 0], [0, 1], [1, 1]]\n  K: [[1, 0], [0, 1], [1, 1]]\n"
        "  V: [[1, 2], [3, 4], [5, 6]]\n",
        encoding="utf-8",
    )
    run = tiled_run(examples.run(examples.load(example)), block_size=2)
    text = render_tiled(run, "text")
    assert "\x1b" not in text and "\\x1b[31mred" in text
    markdown = render_tiled(run, "markdown")
    assert "<script>" not in markdown and "\x1b" not in markdown
    assert "\x1b" not in render_tiled(run, "latex")


def _status(argv: list[str]) -> int:
    """The exit status of ``qkv ARGV``, whether main returns it or exits with it."""
    try:
        return main(argv)
    except SystemExit as stop:
        return int(stop.code or 0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--block-size", "0"], "argument --block-size: expected a number from 1 to 4096, got 0"),
        (["--block-size", "-2"], "expected a number from 1 to 4096, got -2"),
        (["--block-size", "two"], "argument --block-size: expected a whole number, got 'two'"),
        (["--block-size", "10" * 20], "expected a number from 1 to 4096"),
        (["--query", "love"], "--query cannot be used with --tiled"),
        (["--practice"], "--practice: it makes a practice page, which needs --html FILE"),
        (
            ["--practice", "--example", "two-heads", "--html", "x.html"],
            "--practice: a tiled practice page needs one head",
        ),
    ],
)
def test_bad_options_get_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _status(["explain", "--tiled", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err


def test_block_size_without_tiled_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert _status(["explain", "--block-size", "3"]) == 2
    assert "--block-size 3: the size of a tile goes with --tiled" in capsys.readouterr().err


def test_cli_formats_and_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--tiled", "--causal", "--block-size", "1", "-f", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["block_size"] == 1 and len(data["heads"][0]["forward"]) == 9
    page = tmp_path / "tiles.html"
    assert main(["explain", "--tiled", "--example", "two-heads", "--html", str(page)]) == 0
    html = page.read_text(encoding="utf-8")
    assert 'id="qkv-tiled"' in html and "Content-Security-Policy" in html


def _differences(text: str) -> str:
    """Lines with the float64 differences (``1.1e-16``) made alike: they depend on rounding."""
    return re.sub(r"\d\.\de[+-]\d\d", "#e#", text)


def test_the_flash_guide_prints_what_the_command_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = (DOCS / "flash.md").read_text(encoding="utf-8")
    assert "```sh\nqkv explain --tiled --causal\n```" in text
    blocks = re.findall(r"```text\n(.*?)```", text, re.S)
    assert len(blocks) >= 6
    assert main(["explain", "--tiled", "--causal"]) == 0
    printed = _differences(capsys.readouterr().out)
    for block in blocks:
        assert _differences(block) in printed


def test_the_page_holds_the_runs_numbers_and_sets_text_only() -> None:
    from qkv.render._tiled_page import tiled_page

    run = tiled_run(examples.run(examples.builtin("two-heads"), causal=True), block_size=2)
    page = tiled_page(run)
    found = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S)
    assert found is not None
    data = json.loads(found.group(1))
    forward = data["heads"][1]["forward"]
    assert [t["kind"] for t in forward] == run.heads[1].kinds.flatten().tolist()
    np.testing.assert_array_equal(forward[3]["accumulator"]["new"], run.heads[1].tiles[3].o_new)
    assert data["heads"][0]["output"] == run.heads[0].output.tolist()
    script = re.findall(r"<script>(.*?)</script>", page, re.S)[0]
    for unsafe in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert unsafe not in script
    assert "fetch(" not in script and "XMLHttpRequest" not in script


_EXP_LINE = re.compile(r"= exp\((−∞|-?[\d.]+) − (-?[\d.]+)\) = (-?[\d.]+)$")


def _reads_true(a: float, b: float, shown: float, decimals: int) -> bool:
    """exp(a − b) = shown, with the numbers as printed: within half a unit of the last
    decimal, or off only by what the rounding of a and b carries, when that is under 5%."""
    half = 0.5 * 10.0**-decimals
    off = abs(math.exp(a - b) - shown)
    bound = half + 2 * half * abs(shown)
    return off <= half * (1 + 1e-6) or (off <= bound and bound <= 0.05 * abs(shown))


@pytest.mark.parametrize("precision", [0, 1, 2])
def test_worked_lines_read_true_with_their_rounded_numbers(precision: int, tmp_path: Path) -> None:
    # scores 0.4 and 0.6 print as 0 and 1 at precision 0: exp(0 − 1) = 1 would be false
    example = tmp_path / "close.yaml"
    example.write_text(
        "format: 2\ntokens: [a, b, c]\ninputs:\n  Q: [[1, 0], [1, 0], [1, 0]]\n"
        "  K: [[0.4, 0], [0.6, 0], [1.45, 0]]\n  V: [[1, 2], [3, 4], [5, 6]]\n"
        "options: {scale: false}\n",
        encoding="utf-8",
    )
    run = tiled_run(examples.run(examples.load(example)), block_size=2)
    text = render_tiled(run, "text", precision=precision)
    checked = 0
    for line in text.splitlines():
        found = _EXP_LINE.search(line)
        if found is None or found.group(1) == "−∞":
            continue
        a, b, shown = (float(x) for x in found.groups())
        assert _reads_true(a, b, shown, len(found.group(3).partition(".")[2])), line
        checked += 1
    assert checked >= 9
    if precision == 0:
        assert "Worked out with 1 decimal instead of 0" in text


def test_the_commands_numbers_are_the_tiled_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    from qkv.kernels import tiled_attention

    argv = ["explain", "--tiled", "-e", "the-cat-sat-on-the-mat", "--causal", "--block-size", "4"]
    assert main([*argv, "-f", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (head,) = data["heads"]
    trace = examples.run(examples.builtin("the-cat-sat-on-the-mat"), causal=True)
    q, k, v = (torch.tensor(trace[n].value)[None, None].requires_grad_() for n in "QKV")
    out, lse = tiled_attention(
        q, k, v, is_causal=True, scale=data["scale"], return_lse=True, block_q=4, block_kv=4
    )
    out.backward(torch.ones_like(out))  # the command's dO: all ones
    np.testing.assert_allclose(head["output"], out[0, 0].detach().numpy(), atol=1e-14)
    np.testing.assert_allclose(head["lse"], lse[0, 0].detach().numpy(), atol=1e-14)
    backward = head["backward"]
    k0, k1 = backward["tiles"][0]["cols"]
    assert backward["key_block"] == 0 and (k0, k1) == (0, 4)
    for name, tensor in (("dK", k), ("dV", v)):
        assert tensor.grad is not None
        shown = np.sum([tile[f"{name}_part"] for tile in backward["tiles"]], axis=0)
        np.testing.assert_allclose(shown, tensor.grad[0, 0, k0:k1].numpy(), atol=1e-14)
        np.testing.assert_allclose(backward[name], tensor.grad[0, 0].numpy(), atol=1e-14)
    assert q.grad is not None
    np.testing.assert_allclose(backward["dQ"], q.grad[0, 0].numpy(), atol=1e-14)
