"""qkv.train checkpoints: round trips, exact resume, atomic writes under crashes, clear errors."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from qkv.train import (
    CheckpointError,
    CheckpointMismatchError,
    _checkpoint,
    latest_checkpoint,
    load_checkpoint,
    restore_rng_states,
    rng_states,
    save_checkpoint,
)


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3))


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> float:
    """Steps on random batches drawn from the global torch generator; the last loss."""
    loss = torch.tensor(0.0)
    for _ in range(steps):
        tokens = torch.randint(0, 10, (8,))
        labels = torch.randint(0, 3, (8,))
        loss = torch.nn.functional.cross_entropy(model(tokens), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


def save_run(folder: Path, step: int, value: float = 1.0, **options: Any) -> Path:
    return save_checkpoint(
        folder,
        step=step,
        tensors={"w": torch.full((2, 3), value)},
        config={"embedding_dim": 3, "layers": [1, 2]},
        state={"seen": step},
        **options,
    )


# -- round trips -------------------------------------------------------------------------------


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    train_steps(model, optimizer, 3)
    save_checkpoint(
        tmp_path,
        step=3,
        tensors=model.state_dict(),
        config={"vocab": 10, "dim": 4},
        state={"optimizer": optimizer.state_dict(), "rng": rng_states()},
    )
    uninterrupted = [train_steps(model, optimizer, 1) for _ in range(3)]

    torch.manual_seed(999)  # a fresh process: other weights, other random state
    resumed = tiny_model(seed=5)
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=0.05)
    ckpt = load_checkpoint(tmp_path, expected_config={"dim": 4})
    resumed.load_state_dict(ckpt.tensors)
    resumed_opt.load_state_dict(ckpt.state["optimizer"])
    restore_rng_states(ckpt.state["rng"])
    assert ckpt.step == 3
    assert [train_steps(resumed, resumed_opt, 1) for _ in range(3)] == uninterrupted


def test_state_values_come_back_as_they_were(tmp_path: Path) -> None:
    state = {
        "tuple": (0.9, 0.999),
        "bytes": b"\x00\xff raw",
        "int_keys": {0: {"step": torch.tensor(4.0)}, 7: "x"},
        "nan": float("nan"),
        "inf": float("-inf"),
        "array": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "nested": [{"a": None, "b": True}, (1, "two")],
        "numpy_scalar": np.float64(0.5),
        "tied": [torch.ones(2)] * 2,
    }
    save_checkpoint(tmp_path, step=0, tensors={}, config={}, state=state)
    got = load_checkpoint(tmp_path).state
    assert got["tuple"] == (0.9, 0.999)
    assert got["bytes"] == b"\x00\xff raw"
    assert list(got["int_keys"]) == [0, 7] and float(got["int_keys"][0]["step"]) == 4.0
    assert np.isnan(got["nan"]) and got["inf"] == float("-inf")
    assert got["array"].dtype == np.uint32 and got["array"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert got["nested"] == [{"a": None, "b": True}, (1, "two")]
    assert got["numpy_scalar"] == 0.5
    assert [t.tolist() for t in got["tied"]] == [[1.0, 1.0], [1.0, 1.0]]


def test_rng_states_restore_python_numpy_and_torch() -> None:
    states = rng_states()
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng_states(states)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_files_are_safetensors_and_json_not_pickle(tmp_path: Path) -> None:
    model = tiny_model()
    path = save_checkpoint(tmp_path, step=12, tensors=model.state_dict(), config={"dim": 4})
    assert path == tmp_path / "step-000000012"
    assert sorted(p.name for p in path.iterdir()) == [
        "checkpoint.json",
        "state.safetensors",
        "tensors.safetensors",
    ]
    tensors = load_file(path / "tensors.safetensors")  # any safetensors reader can read them
    assert torch.equal(tensors["1.weight"], model.state_dict()["1.weight"])
    manifest = json.loads((path / "checkpoint.json").read_text())
    assert manifest["step"] == 12 and manifest["config"] == {"dim": 4}
    assert (tmp_path / "latest").read_text() == "step-000000012\n"


def test_tied_and_non_contiguous_tensors_are_saved(tmp_path: Path) -> None:
    shared = torch.arange(6.0).reshape(2, 3)
    save_checkpoint(tmp_path, step=1, tensors={"a": shared, "b": shared, "t": shared.T},
                    config={})  # fmt: skip
    got = load_checkpoint(tmp_path).tensors
    assert torch.equal(got["a"], shared) and torch.equal(got["b"], shared)
    assert torch.equal(got["t"], shared.T)


def test_keep_prunes_old_checkpoints_and_a_repeated_step_gets_a_new_folder(
    tmp_path: Path,
) -> None:
    for step in range(5):
        save_run(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000000003", "step-000000004"]
    again = save_run(tmp_path, 4, value=7.0, keep=2)
    assert again.name == "step-000000004.1"
    assert float(load_checkpoint(tmp_path).tensors["w"][0, 0]) == 7.0
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000000004", again.name]
    save_run(tmp_path, 2, value=3.0, keep=1)  # an older step, saved last, is the newest
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000000002"


def test_load_accepts_a_step_folder_or_a_file_in_it(tmp_path: Path) -> None:
    first = save_run(tmp_path, 1, value=1.0)
    save_run(tmp_path, 2, value=2.0)
    assert float(load_checkpoint(first).tensors["w"][0, 0]) == 1.0
    assert load_checkpoint(first / "checkpoint.json").step == 1


# -- atomic writes: a crash never leaves a broken checkpoint in place -------------------------


def test_crash_while_writing_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_run(tmp_path, 1, value=1.0)
    real_write = _checkpoint._write_file

    def write_half_then_fail(path: Path, data: bytes) -> None:
        if path.name == "state.safetensors":
            real_write(path, data[: len(data) // 2])
            raise OSError(28, "No space left on device")
        real_write(path, data)

    monkeypatch.setattr(_checkpoint, "_write_file", write_half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        save_run(tmp_path, 2, value=2.0)
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.step == 1 and float(ckpt.tensors["w"][0, 0]) == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000000001"]


@pytest.mark.parametrize("fails", ["rename", "pointer"])
def test_crash_at_the_commit_keeps_a_complete_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: str
) -> None:
    save_run(tmp_path, 1, value=1.0)

    def boom(*args: object) -> None:
        raise OSError(5, "Input/output error")

    if fails == "rename":
        monkeypatch.setattr(os, "rename", boom)
    else:
        monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="Input/output error"):
        save_run(tmp_path, 2, value=2.0)
    monkeypatch.undo()
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.step == 1 and float(ckpt.tensors["w"][0, 0]) == 1.0
    assert (tmp_path / "latest").read_text() == "step-000000001\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert save_run(tmp_path, 3).name == "step-000000003"


@pytest.mark.slow
def test_a_killed_process_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import os, torch
        from qkv.train import _checkpoint, save_checkpoint
        folder = {str(tmp_path)!r}
        save_checkpoint(folder, step=1, tensors={{"w": torch.ones(64, 64)}}, config={{}})
        real = _checkpoint._write_file
        def die(path, data):
            real(path, data[: len(data) // 3])
            os._exit(3)  # killed mid-write: no cleanup, no exception handlers
        _checkpoint._write_file = die
        save_checkpoint(folder, step=2, tensors={{"w": torch.zeros(64, 64)}}, config={{}})
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 3, done.stderr
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers  # the half-written save is there, but hidden and never loaded
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.step == 1 and bool((ckpt.tensors["w"] == 1).all())
    save_run(tmp_path, 2)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_a_pointer_to_a_missing_folder_falls_back_to_the_newest_complete(tmp_path: Path) -> None:
    save_run(tmp_path, 1)
    save_run(tmp_path, 2)
    (tmp_path / "latest").write_text("step-000000009\n")
    assert load_checkpoint(tmp_path).step == 2
    (tmp_path / "latest").unlink()
    assert load_checkpoint(tmp_path).step == 2


# -- damaged files and mismatches: clear errors ----------------------------------------------


def test_truncated_tensor_file_is_reported(tmp_path: Path) -> None:
    path = save_run(tmp_path, 1)
    file = path / "tensors.safetensors"
    size = file.stat().st_size
    os.truncate(file, size - 10)
    with pytest.raises(
        CheckpointError,
        match=rf"step-000000001: tensors\.safetensors is truncated: {size - 10} bytes, but "
        rf"{size} were saved\. Hint: the file was cut short .*use another checkpoint",
    ):
        load_checkpoint(tmp_path)


def test_damaged_files_are_reported(tmp_path: Path) -> None:
    path = save_run(tmp_path, 1)
    file = path / "state.safetensors"
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"state\.safetensors is damaged: its SHA-256"):
        load_checkpoint(path)
    (path / "checkpoint.json").write_text('{"format": "qkv-checkpoint", "step": 1,')
    with pytest.raises(
        CheckpointError, match=r"checkpoint\.json is not valid JSON \(line 1, column 40\)"
    ):
        load_checkpoint(path)
    (path / "checkpoint.json").unlink()
    with pytest.raises(CheckpointError, match=r"the checkpoint is incomplete: checkpoint\.json"):
        load_checkpoint(path)
    other = save_run(tmp_path, 2)
    (other / "tensors.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"step-000000002: tensors\.safetensors is missing"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("missing", r"missing: no checkpoint here: the path does not exist"),
        ("empty", r"empty: no checkpoint here \(no step-\* folder with a checkpoint\.json\)"),
    ],
)
def test_no_checkpoint_here(tmp_path: Path, where: str, message: str) -> None:
    if where == "empty":
        (tmp_path / where).mkdir()
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path / where)
    assert latest_checkpoint(tmp_path / where) is None


def test_mismatched_config_and_shapes_are_listed(tmp_path: Path) -> None:
    save_run(tmp_path, 1)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"the checkpoint does not match: config\['embedding_dim'\] is 3 in the checkpoint, "
        r"expected 300; config\['heads'\] is missing \(expected 2\)\. Hint: use the settings",
    ):
        load_checkpoint(tmp_path, expected_config={"embedding_dim": 300, "heads": 2})
    with pytest.raises(
        CheckpointMismatchError,
        match=r"'w' has shape \(2, 3\), expected \(2, 300\); 'b' is missing\. Hint: the model "
        r"was built with other sizes \(e\.g\. another embedding dimension\)",
    ):
        load_checkpoint(tmp_path, expected_shapes={"w": (2, 300), "b": torch.zeros(3)})
    ok = load_checkpoint(
        tmp_path,
        expected_config={"embedding_dim": 3, "layers": (1, 2)},
        expected_shapes={"w": torch.zeros(2, 3)},
    )
    assert ok.config["layers"] == [1, 2]
    with pytest.raises(CheckpointMismatchError, match=r"is 3 in the checkpoint, expected True"):
        load_checkpoint(tmp_path, expected_config={"embedding_dim": True})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tensors": {"w": [1.0]}}, r"tensors\['w'\] must be a torch\.Tensor, got list"),
        ({"tensors": [torch.ones(1)]}, r"tensors must be a mapping of names to tensors"),
        ({"config": {"w": torch.ones(1)}}, r"config\['w'\] is a Tensor, which a JSON config"),
        ({"config": {"x": float("nan")}}, r"config\['x'\] is nan; JSON config values must be"),
        ({"config": {1: 2}}, r"config has the key 1; config keys must be strings"),
        (
            {"state": {"f": print}},
            r"state\['f'\] is a builtin_function_or_method, which a "
            r"checkpoint cannot store without pickle",
        ),
        ({"state": {"d": {(1, 2): 3}}}, r"state\['d'\] has the key \(1, 2\)"),
        ({"step": -1}, r"step must be a whole number >= 0, got -1"),
        ({"keep": 0}, r"keep must be a whole number >= 1 or None, got 0"),
    ],
)
def test_bad_values_are_refused_before_anything_is_written(
    tmp_path: Path, options: dict[str, Any], message: str
) -> None:
    arguments: dict[str, Any] = {"step": 1, "tensors": {}, "config": {}, "state": {}}
    arguments.update(options)
    with pytest.raises(CheckpointError, match=message):
        save_checkpoint(tmp_path / "run", **arguments)
    assert not (tmp_path / "run").exists()


def test_without_torch_the_error_names_the_extra() -> None:
    code = "import sys; sys.modules['torch'] = None; import qkv.train"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1
    assert "qkv.train needs torch, which is not installed. Hint: pip install 'qkv[torch]'" in (
        done.stderr
    )
