"""Issue 24, item 6: the files qkv reads back, and the options of ``qkv train``.

Each case failed before its fix: a trace file that was accepted silently (a step naming a
call of an empty ``calls``, ``meta.num_heads`` of 0 or 10¹², ``"nan"`` among the weights,
tokens that do not label the keys), an edited checkpoint config that gave a traceback, a
plot that failed on a token with ``$``, a ``qkv train`` error that named a value and not
the option, and a NumPy warning printed before ``qkv check``'s error line.
"""

from __future__ import annotations

import copy
import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qkv import examples
from qkv.cli import main
from qkv.trace import Trace, TraceFileError
from tests.support.isolated import run_cli_isolated
from tests.support.runs import edit_config, tiny_run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``qkv ARGV``: exit 2 and one line ``qkv: error: ... Hint: ...``, nothing else."""
    code = main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, out + err
    assert len(lines) == 1 and lines[0].startswith("qkv: error: "), err
    assert lines[0].count("Hint:") == 1, lines[0]
    return lines[0]


# -- traces --------------------------------------------------------------------------------


def _trace(example: str = "i-love-statistics") -> dict[str, Any]:
    data: dict[str, Any] = examples.run(examples.resolve(example)).to_dict()
    return data


def _changed(change: Callable[[dict[str, Any]], None], example: str = "i-love-statistics") -> Any:
    data = copy.deepcopy(_trace(example))
    change(data)
    return data


def _weight(value: Any) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        step = next(s for s in data["steps"] if s["name"] == "weights")
        step["value"][4] = value

    return change


@pytest.mark.parametrize(
    ("change", "field", "expected"),
    [
        (lambda t: t.update(calls=[]), "steps[0].call", "names call 0, but 'calls' is empty"),
        (
            lambda t: t["meta"].update(num_heads=0),
            "meta.num_heads",
            "expected a whole number from 1 to 1,048,576, got 0",
        ),
        (
            lambda t: t["meta"].update(num_heads=10**12),
            "meta.num_heads",
            "got 1,000,000,000,000",
        ),
        (lambda t: t["calls"][0]["meta"].update(d_k=-2), "calls[0].meta.d_k", "got -2"),
        (
            lambda t: t["meta"].update(num_heads=4, num_kv_heads=3),
            "meta.num_kv_heads",
            "expected a number of key/value heads that divides num_heads (4), got 3",
        ),
        (
            lambda t: t["meta"].update(layers={"a": {"num_heads": 10**12}}),
            "meta.layers.a.num_heads",
            "from 1 to 1,048,576",
        ),
        (lambda t: t["meta"].update(layers={"a": 3}), "meta.layers.a", "an object"),
        (_weight("nan"), "steps[9].value[4]", "expected attention weights from 0 to 1"),
        (_weight("inf"), "steps[9].value[4]", "got inf"),
        (_weight(1.5), "steps[9].value[4]", "got 1.5"),
        (_weight(-0.25), "steps[9].value[4]", "got -0.25"),
        (
            lambda t: t.update(tokens=["I"]),
            "tokens",
            "expected one token per key (3, as in the steps), got 1",
        ),
        (lambda t: t.update(tokens=["a", "b", "c", "d"]), "tokens", "got 4"),
    ],
)
def test_a_damaged_trace_names_the_field(
    change: Callable[[dict[str, Any]], None], field: str, expected: str
) -> None:
    with pytest.raises(TraceFileError) as info:
        Trace.from_json(json.dumps(_changed(change)))
    assert info.value.field == field and expected in str(info.value)


def test_a_damaged_trace_is_one_line_on_the_command_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_changed(_weight("nan"))))
    line = one_line_error(
        capsys, ["explain", "--trace", str(path), "--plot", str(tmp_path / "p.png")]
    )
    assert "trace.json: steps[9].value[4]: expected attention weights from 0 to 1" in line
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("example", ["i-love-statistics", "two-heads", "the-cat-sat-on-the-mat"])
def test_traces_qkv_writes_still_read_back(tmp_path: Path, example: str) -> None:
    """What the checks must never refuse: qkv's own traces."""
    trace = examples.run(examples.resolve(example))
    trace.save(tmp_path / "t.json")
    again = Trace.load(tmp_path / "t.json")
    assert again.tokens == trace.tokens and again.names == trace.names


def test_a_decoding_trace_with_growing_keys_reads_back(tmp_path: Path) -> None:
    """A KV-cache decoding trace: its earlier calls have fewer keys than there are tokens."""
    import torch

    import qkv
    from qkv.nn import KVCache, MultiHeadAttention

    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 2).eval()
    cache = KVCache()
    x = torch.randn(1, 4, 8)
    with torch.no_grad(), qkv.tracing(qkv.Trace(tokens=list("abcd")), model=layer) as trace:
        for i in range(4):
            layer(x[:, i : i + 1], is_causal=True, cache=cache)
    trace.save(tmp_path / "decode.json")
    again = Trace.load(tmp_path / "decode.json")
    assert len(again.calls) == 4 and again.tokens == list("abcd")
    weights = [call["weights"].value for call in again.calls]
    assert [w.shape[-1] for w in weights] == [1, 2, 3, 4]
    np.testing.assert_allclose(weights[-1].sum(-1), 1.0, atol=1e-6)


# -- checkpoints ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    return {task: tiny_run(root / task, task) for task in ("classify", "recall")}


def _drop(section: str, key: str) -> Callable[[dict[str, Any]], None]:
    return lambda config: config[section].pop(key)


def _put(section: str, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda config: config[section].update({key: value})


CLASSIFY_TEXT = ["--text", "the food was great"]
RECALL_TEXT = ["--text", "a 3 b 5 a"]

EDITS: dict[str, tuple[str, Callable[[dict[str, Any]], None], list[str], str]] = {
    # the three tracebacks of the issue: KeyError 'lowercase', KeyError 'pairs', a slice
    "no lowercase": ("classify", _drop("data", "lowercase"), CLASSIFY_TEXT, "data.lowercase"),
    "no pairs": ("recall", _drop("data", "pairs"), ["--data", "generated"], "data.pairs"),
    "max_length text": ("classify", _put("data", "max_length", "64"), CLASSIFY_TEXT, "max_length"),
    "max_length 0": ("classify", _put("data", "max_length", 0), CLASSIFY_TEXT, "max_length"),
    "lowercase text": (
        "classify",
        _put("data", "lowercase", "yes"),
        CLASSIFY_TEXT,
        "true or false",
    ),
    "keys -1": ("recall", _put("data", "keys", -1), ["--data", "generated"], "data.keys"),
    # 10¹⁵ values: drawing the sequences would need petabytes
    "values 10**15": ("recall", _put("data", "values", 10**15), RECALL_TEXT, "keys + values = 36"),
    "pairs > keys": ("recall", _put("data", "pairs", 27), RECALL_TEXT, "data.pairs: expected at"),
    "size text": ("recall", _put("data", "validation_size", "x"), RECALL_TEXT, "validation_size"),
    "no seed": ("recall", lambda c: c.pop("seed"), ["--data", "generated"], "config.seed"),
    "seed 2**70": ("recall", lambda c: c.update(seed=2**70), ["--data", "generated"], "seed"),
    "data a list": ("classify", lambda c: c.update(data=[]), CLASSIFY_TEXT, "data: expected an"),
    "kind": ("classify", _put("model", "kind", "??"), CLASSIFY_TEXT, "config.model: unknown"),
    "heads": ("classify", _put("model", "num_heads", 3), CLASSIFY_TEXT, "config.model: embed"),
    "dropout": ("classify", _put("model", "dropout", "x"), CLASSIFY_TEXT, "config.model: drop"),
    "lr": ("classify", lambda c: c["training"].update(lr="x"), CLASSIFY_TEXT, "config.training"),
}


@pytest.fixture(scope="module")
def edited(
    runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[int, str]]:
    """Each edit of :data:`EDITS` made to a copy of its run, then read back by ``qkv
    explain --model`` or ``qkv evaluate``, all in one child with 2 GiB and a time limit."""
    root = tmp_path_factory.mktemp("edited")
    argvs = []
    for i, (task, change, argv, _) in enumerate(EDITS.values()):
        run = root / f"run{i}"
        shutil.copytree(runs[task], run)
        edit_config(run, change)
        command = ["explain", "--model", str(run)] if "--text" in argv else ["evaluate", str(run)]
        argvs.append([*command, *argv])
    return dict(zip(EDITS, run_cli_isolated(argvs), strict=True))


@pytest.mark.parametrize("case", EDITS)
def test_an_edited_checkpoint_config_is_one_line(
    edited: dict[str, tuple[int, str]], case: str
) -> None:
    code, err = edited[case]
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    line = lines[0]
    assert line.startswith("qkv: error: ") and line.count("Hint:") == 1, line
    assert "/run" in line and EDITS[case][3] in line, line


# -- pictures ------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_a_plot_shows_tokens_with_dollars_as_written(tmp_path: Path, suffix: str) -> None:
    """Before: matplotlib read ``$...$`` in a tick label as a formula, and one it cannot
    parse (``$\\foo$``, ``$a^$``) ended --plot with a ParseException."""
    pytest.importorskip("matplotlib")
    from qkv import render

    trace = examples.run(examples.resolve("i-love-statistics"))
    trace.tokens = ["$\\foo$", "$a^$", "$\\frac{1}{2}$"]
    trace.meta["name"] = "$\\bad$ name"
    render.heatmap(trace, tmp_path / f"p{suffix}")
    figure = render.heatmap(trace)
    labels = [t.get_text() for ax in figure.axes for t in ax.get_xticklabels()]
    assert labels[:3] == trace.tokens
    if suffix == ".svg":  # SVG keeps text as text: the tokens are there as written
        assert "$\\frac{1}{2}$" in (tmp_path / "p.svg").read_text(encoding="utf-8")


# -- qkv train's options -------------------------------------------------------------------


TRAIN_OPTIONS = {
    "--heads 7": (["recall", "--heads", "7"], "--heads 7: expected a number of heads that divides"),
    "--heads 7 classify": (["classify", "--heads", "7"], "--heads 7: expected a number of heads"),
    "--pairs 1e9": (["recall", "--pairs", "1e9"], "--pairs: expected a whole number"),
    "--pairs 10**9": (["recall", "--pairs", "1000000000"], "--pairs 1000000000: expected at most"),
    "--seed 2**70": (["recall", "--seed", str(2**70)], "--seed: expected a number from 0 to"),
    "--seed 2**70 classify": (["classify", "--seed", str(2**70)], "--seed: expected a number"),
    "--data /dev/zero": (["classify", "--data", "/dev/zero"], "--data /dev/zero: "),
    "--min-count 10**6": (["classify", "--min-count", "1000000"], "--min-count 1000000: expected"),
}


@pytest.fixture(scope="module")
def train_errors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str]]:
    """Each of :data:`TRAIN_OPTIONS` run by ``qkv train`` in one child with 2 GiB."""
    root = tmp_path_factory.mktemp("train")
    argvs = [
        ["train", argv[0], "--out", str(root / f"run{i}"), "--steps", "2", "--quiet", *argv[1:]]
        for i, (argv, _) in enumerate(TRAIN_OPTIONS.values())
    ]
    return dict(zip(TRAIN_OPTIONS, run_cli_isolated(argvs), strict=True))


@pytest.mark.parametrize("case", TRAIN_OPTIONS)
def test_train_errors_name_the_option(train_errors: dict[str, tuple[int, str]], case: str) -> None:
    code, err = train_errors[case]
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("qkv: error: "), err
    assert TRAIN_OPTIONS[case][1] in lines[0] and lines[0].count("Hint:") == 1, lines[0]


# -- qkv check -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("inputs", "expected"),
    [
        (
            "embeddings: [[1e300, 0], [0, 1]]\n"
            "weights: {W_q: [[1e10], [0]], W_k: [[1], [1]], W_v: [[1], [2]]}\n",
            "Q = x·W_q overflowed float64",
        ),
        (
            "format: 2\ninputs: {Q: [[1e200, 0], [0, 1]], K: [[1e200, 0], [0, 1]], "
            "V: [[1, 0], [0, 1]]}\n",
            "the scaled scores Q·Kᵀ × scale overflowed float64",
        ),
    ],
)
def test_check_prints_no_numpy_warning_before_its_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, inputs: str, expected: str
) -> None:
    """Before: two RuntimeWarnings (overflow in matmul, invalid value in subtract) above the
    error line; with Q and K given, no error at all and "correct: nan" in the report."""
    path = tmp_path / "ex.yaml"
    path.write_text(f"tokens: [a, b]\n{inputs}claimed: {{weights: {{a: [1, 0]}}}}\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = one_line_error(capsys, ["check", "--example", str(path)])
    assert expected in line
    assert [str(w.message) for w in caught] == []


def test_explaining_a_trace_of_infinite_numbers_prints_no_numpy_warning(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Before: "RuntimeWarning: invalid value encountered in matmul" above it."""

    def huge(data: dict[str, Any]) -> None:
        step = next(s for s in data["steps"] if s["name"] == "embeddings")
        step["value"][:3] = ["inf", "-inf", 0]  # x·W_q is inf - inf: NaN

    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_changed(huge)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["explain", "--trace", str(path)]) == 0
    assert [str(w.message) for w in caught] == []
    assert "Step 1. Token embeddings" in capsys.readouterr().out
