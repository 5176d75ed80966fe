"""The self-contained HTML page: what it holds, how it escapes, where it is written.

What the page does in a browser is tested in test_browser.py (headless Chromium).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import qkv
from qkv import examples, render
from qkv.cli import main
from qkv.render._html import notebook_html, page_data, page_script
from tests.support.traces import two_layers

ASSETS = Path(render.__file__).parent / "assets"
HOSTILE = [
    "<script>alert(1)</script>",
    '"><img src=x onerror=alert(2)>',
    "</script><!--",
    "a\u2028b\u2029&amp;",
]


def data_of(page: str) -> dict[str, Any]:
    found = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S)
    assert found is not None
    result: dict[str, Any] = json.loads(found.group(1))
    return result


def matrix(step: dict[str, Any]) -> np.ndarray:
    raw = np.frombuffer(base64.b64decode(step["data"]), dtype="<f4")
    return raw.reshape(step["shape"])


def steps_of(call: dict[str, Any], head: int | None = None) -> dict[str, dict[str, Any]]:
    """The steps of one call as the page shows them for ``head``."""
    return {
        step["name"]: step
        for section in call["sections"]
        if section["head"] is None or section["head"] == head
        for step in section["steps"]
    }


# -- the page -----------------------------------------------------------------------------


def test_page_is_one_file_with_its_own_script_and_style_and_no_address() -> None:
    page = render.html(examples.run(examples.builtin("two-heads")))
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert page.count("<script") == 2 and page.count("<style>") == 1
    no_svg_namespace = page.replace('"http://www.w3.org/2000/svg"', "")
    assert re.search(r"https?:|//cdn|\bsrc=|\bhref=|@import|url\(", no_svg_namespace) is None
    assert (ASSETS / "page.js").read_text(encoding="utf-8") in page
    assert page_script() in page


def test_content_security_policy_allows_only_the_inline_script_and_style() -> None:
    page = render.html(examples.run(examples.builtin("i-love-statistics")))
    policy = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', page)
    assert policy is not None
    script = re.findall(r"<script>(.*?)</script>", page, re.S)[0]
    style = re.search(r"<style>(.*?)</style>", page, re.S)
    assert style is not None

    def digest(text: str) -> str:
        return base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()

    assert "default-src 'none'" in policy.group(1)
    assert f"script-src 'sha256-{digest(script)}'" in policy.group(1)
    assert f"style-src 'sha256-{digest(style.group(1))}'" in policy.group(1)


def test_the_script_never_writes_html() -> None:
    script = (ASSETS / "page.js").read_text(encoding="utf-8")
    for unsafe in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert unsafe not in script
    assert "new Function" not in script and "</script" not in script.lower()


def test_numbers_are_the_traces_own() -> None:
    trace = examples.run(examples.builtin("i-love-statistics"))
    data = data_of(render.html(trace))
    (call,) = data["calls"]
    steps = steps_of(call)
    np.testing.assert_allclose(matrix(steps["weights"]), trace["weights"].value, rtol=1e-6)
    assert data["labels"][steps["weights"]["rows"]] == ["I", "love", "statistics"]
    assert steps["weights"]["formula"] == "A = softmax(S') row by row"
    assert steps["weights"]["number"] == 10 and steps["weights"]["title"] == "Attention weights"
    assert any("e^0.7891" in line for line in steps["weights"]["equations"])
    assert steps["context"]["weightedSum"] is True
    assert call["query"] == 1  # the example shows "love": the page opens on it
    assert ["tokens", "I, love, statistics (3 tokens)"] in call["facts"]
    assert data["title"] == "I love statistics"


def test_every_head_has_its_own_matrices() -> None:
    trace = examples.run(examples.builtin("two-heads"))
    (call,) = page_data(trace)["calls"]
    assert [s["head"] for s in call["sections"]] == [None, 0, 1, None]
    assert [s["title"] for s in call["sections"]][1] == "Head 0 of 2 heads"
    for head in (0, 1):
        shown = matrix(steps_of(call, head)["weights"])
        np.testing.assert_allclose(shown, trace["weights"].value[head], rtol=1e-6)
    assert "output" in steps_of(call, 0)


def test_grouped_query_batched_and_masked_traces() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 5, 8))
    w = [rng.normal(size=(8, 8)) for _ in range(3)]
    w_kv = [rng.normal(size=(8, 4)) for _ in range(2)]
    with qkv.tracing() as trace:
        qkv.multi_head_attention(x, w[0], w_kv[0], w_kv[1], w[2], num_heads=2, num_kv_heads=1,
                                 is_causal=True)  # fmt: skip
    (call,) = page_data(trace)["calls"]
    assert call["heads"] == 2
    weights = matrix(steps_of(call, 1)["weights"])
    np.testing.assert_allclose(weights, trace["weights"].value[0, 1], rtol=1e-6)
    masked = matrix(steps_of(call, 1)["masked"])
    assert np.isneginf(masked[0, 1:]).all()  # causal: −∞ survives the float32 encoding
    v = matrix(steps_of(call, 1)["V"])
    np.testing.assert_allclose(v, trace["V"].value[0, 0], rtol=1e-6)  # the shared K/V head
    assert steps_of(call, 1)["context"]["weightedSum"] is True


def test_several_layers_become_a_layer_choice() -> None:
    trace = two_layers()
    data = page_data(trace)
    assert [c["name"] for c in data["calls"]] == ["blocks.0.attn", "blocks.1.attn"]
    second = matrix(steps_of(data["calls"][1], 1)["weights"])
    np.testing.assert_allclose(second, trace.steps[1].value[1], rtol=1e-6)
    assert [c["name"] for c in page_data(trace, layers=["blocks.1.attn"])["calls"]] == [
        "blocks.1.attn"
    ]
    assert len(page_data(trace, layers=[-1, 1])["calls"]) == 1
    with pytest.raises(ValueError, match=r"no attention call named 'blocks.9'.*blocks.0.attn"):
        page_data(trace, layers=["blocks.9"])
    with pytest.raises(ValueError, match=r"position 2 is out of range.*0 to 1"):
        page_data(trace, layers=[2])


def test_calls_without_a_layer_name_are_numbered() -> None:
    with qkv.tracing() as trace:
        qkv.self_attention(np.eye(2), np.eye(2), np.eye(2), np.eye(2))
        qkv.self_attention(np.eye(2), np.eye(2), np.eye(2), np.eye(2))
    assert [c["name"] for c in page_data(trace)["calls"]] == ["call 0", "call 1"]


def test_keep_only_some_steps_and_a_limit_on_size() -> None:
    trace = examples.run(examples.builtin("two-heads"))
    (call,) = page_data(trace, steps=["weights"])["calls"]
    assert set(steps_of(call, 0)) == {"weights"}
    with pytest.raises(ValueError, match=r"no step named 'masked'.*recorded: embeddings"):
        render.html(trace, steps=["masked"])
    with pytest.raises(
        ValueError, match=r"would hold 272 numbers \(about 0.0 MB\).*Hint: keep fewer steps"
    ):
        render.html(trace, max_values=50)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(TypeError, match=r"trace must be a qkv\.Trace, got dict"):
        render.html({})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no steps to show"):
        render.html(qkv.Trace())
    with pytest.raises(ValueError, match="precision must be an integer"):
        render.html(examples.run(examples.builtin("two-heads")), precision=99)


# -- escaping -----------------------------------------------------------------------------


def test_tokens_names_and_layers_are_escaped() -> None:
    trace = examples.run(examples.builtin("two-heads"))
    trace.tokens = HOSTILE
    trace.meta["name"] = HOSTILE[0]
    trace.meta["description"] = HOSTILE[1]
    saved = trace.to_dict()  # a layer name from a file anyone may write
    for record in [*saved["calls"], *saved["steps"]]:
        record["layer"] = HOSTILE[2]
    trace = qkv.Trace.from_dict(saved)
    page = render.html(trace)
    for text in HOSTILE:
        assert text not in page
    assert "<img" not in page and "<!--" not in page and "\u2028" not in page
    block = re.search(r'id="qkv-data">(.*?)</script>', page, re.S)
    assert block is not None and not set("<>&") & set(block.group(1))
    assert "<title>&lt;script&gt;alert(1)&lt;/script&gt; · qkv</title>" in page
    data = data_of(page)
    assert data["title"] == HOSTILE[0] and data["description"] == HOSTILE[1]
    assert data["calls"][0]["name"] == HOSTILE[2]
    assert data["labels"][steps_of(data["calls"][0], 0)["weights"]["rows"]] == HOSTILE


# -- files, the CLI and Jupyter ---------------------------------------------------------------


def test_written_atomically_and_folder_errors(tmp_path: Path) -> None:
    trace = examples.run(examples.builtin("i-love-statistics"))
    page = render.html(trace, tmp_path / "page.html")
    assert (tmp_path / "page.html").read_text(encoding="utf-8") == page
    with pytest.raises(ValueError, match=r"folder '.*nowhere' does not exist. Hint: create it"):
        render.html(trace, tmp_path / "nowhere" / "page.html")
    with pytest.raises(ValueError, match="is a folder"):
        render.html(trace, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.html"]


def test_explain_html_and_plot_write_files_and_say_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page, picture = tmp_path / "explain.html", tmp_path / "weights.png"
    status = main(["explain", "-e", "two-heads", "--html", str(page), "--plot", str(picture)])
    out, err = capsys.readouterr()
    assert status == 0 and out == ""
    assert err.splitlines() == [
        f"qkv: wrote {picture} (the attention weights, one panel per head)",
        f"qkv: wrote {page} (open it in a browser)",
    ]
    assert data_of(page.read_text(encoding="utf-8"))["calls"][0]["heads"] == 2
    assert picture.read_bytes().startswith(b"\x89PNG")


def test_explain_html_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["explain", "--html", str(tmp_path / "missing" / "x.html")])
    _, err = capsys.readouterr()
    assert status == 2 and err.startswith("qkv: error: --html cannot write") and "Hint:" in err
    assert len(err.splitlines()) == 1
    status = main(["explain", "--plot", str(tmp_path / "x.jpg")])
    _, err = capsys.readouterr()
    assert status == 2 and "must end in .png or .svg" in err and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_explain_html_with_output_also_writes_the_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["explain", "--html", str(tmp_path / "a.html"), "-o", str(tmp_path / "a.md"),
                   "-f", "markdown"])  # fmt: skip
    capsys.readouterr()
    assert status == 0
    assert (tmp_path / "a.md").read_text(encoding="utf-8").startswith("# I love statistics")


def test_jupyter_shows_the_page_in_a_sandboxed_iframe() -> None:
    trace = examples.run(examples.builtin("two-heads"))
    trace.tokens = HOSTILE
    shown = render.html(trace)._repr_html_()  # the page shows itself; the trace does not
    assert shown is not None
    assert shown.startswith('<iframe sandbox="allow-scripts" ')
    assert shown.count("<") == 2 and shown.endswith("></iframe>")  # the page is all escaped
    srcdoc = re.search(r'srcdoc="([^"]*)"', shown)
    assert srcdoc is not None and "&lt;!DOCTYPE html&gt;" in srcdoc.group(1)
    assert notebook_html(qkv.Trace()) is None
    assert not hasattr(qkv.Trace, "_repr_html_")  # the core does not draw


def test_jupyter_says_why_a_trace_is_too_big(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("qkv.render._html.MAX_VALUES", 10)
    shown = notebook_html(examples.run(examples.builtin("two-heads")))
    assert shown is not None and shown.startswith("<p>qkv: the page would hold")


def test_cross_attention_labels_queries_and_keys_apart() -> None:
    rng = np.random.default_rng(2)
    w_q, w_k, w_v = (rng.normal(size=(4, 4)) for _ in range(3))
    with qkv.tracing() as trace:
        qkv.multi_head_attention(
            rng.normal(size=(2, 4)), w_q, w_k, w_v, num_heads=2, context=rng.normal(size=(5, 4))
        )
    trace.tokens, trace.query_tokens = list("abcde"), ["x", "y"]
    data = page_data(trace)
    weights = steps_of(data["calls"][0], 1)["weights"]
    assert weights["shape"] == [2, 5]
    assert data["labels"][weights["rows"]] == ["x", "y"]
    assert data["labels"][weights["cols"]] == list("abcde")
    figure = render.heatmap(trace)
    assert [t.get_text() for t in figure.axes[0].get_yticklabels()] == ["x", "y"]
    assert [t.get_text() for t in figure.axes[0].get_xticklabels()] == list("abcde")
