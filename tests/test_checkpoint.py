"""Checkpoints written in the background (dflash/checkpoint.py: CheckpointWriter, host_copy)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file

from dflash.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    host_copy,
    latest_checkpoint,
    load_trainer_state,
    read_state,
    save_checkpoint,
)
from dflash.config import TrainConfig
from dflash.trainer import DrafterTrainer
from tests.test_trainer import drafter_cfg, random_batch, tiny_model


def trained(seed: int = 0) -> DrafterTrainer:
    tr = DrafterTrainer(tiny_model(seed), TrainConfig(), drafter_cfg(), 10, "cpu", seed=3)
    for i in range(2):
        tr.step(random_batch(seed=i), 0, i)
    return tr


def read(ckpt) -> tuple[dict, dict]:
    return load_file(str(ckpt / "drafter" / "model.safetensors")), load_trainer_state(ckpt)


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_background_checkpoint_holds_the_state_at_save_time(tmp_path, monkeypatch) -> None:
    """The files hold the state when save() returned, though training changes it in place
    while the thread writes; they equal a checkpoint written synchronously at that moment."""
    tr = trained()
    sync = save_checkpoint(tmp_path / "sync", 2, 0, tr.model, tr.state_dict())
    gate = threading.Event()
    real_save = torch.save

    def slow_save(*args, **kwargs):  # the writer thread holds here until training has moved on
        assert gate.wait(30), "test gate never opened"
        return real_save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", slow_save)
    writer = CheckpointWriter(tmp_path / "bg", keep_last=2)
    assert writer.save(2, 0, tr.model, tr.state_dict()) is None and writer.in_flight
    assert writer.poll() is None  # still writing
    tr.step(random_batch(seed=5), 0, 5)  # in-place updates of weights and AdamW state
    gate.set()
    step, path = writer.wait(timeout=60)
    assert step == 2 and path == latest_checkpoint(tmp_path / "bg") and not writer.in_flight
    assert read_state(path)["step"] == 2
    weights_bg, state_bg = read(path)
    weights_sync, state_sync = read(sync)
    assert_same(weights_bg, weights_sync)
    assert_same(state_bg["trainer"], state_sync["trainer"])
    live = {k: v for k, v in tr.model.state_dict().items()}
    assert any(not torch.equal(live[k], weights_bg[k]) for k in weights_bg)  # training did move on


def test_one_write_in_flight_and_errors_reach_the_caller(tmp_path, monkeypatch) -> None:
    tr = trained()
    writer = CheckpointWriter(tmp_path, keep_last=1)
    writer.save(1, 0, tr.model, tr.state_dict())
    done = writer.save(2, 0, tr.model, tr.state_dict())  # waits for step 1 first
    assert done is not None and done[0] == 1
    assert writer.wait(timeout=60)[0] == 2
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000002"]  # keep_last=1
    assert writer.wait() is None and writer.poll() is None  # nothing in flight

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken)
    writer.save(3, 0, tr.model, tr.state_dict())
    with pytest.raises(CheckpointError, match="step 3.*disk full"):
        writer.wait(timeout=60)
    assert latest_checkpoint(tmp_path).name == "step-00000002"  # the half-written one is invisible


def test_foreground_writer_writes_inside_save(tmp_path) -> None:
    tr = trained()
    writer = CheckpointWriter(tmp_path, background=False)
    step, path = writer.save(4, 1, tr.model, tr.state_dict())
    assert step == 4 and not writer.in_flight and read_state(path)["epoch"] == 1


def test_host_copy_is_independent_of_the_live_state() -> None:
    live = {"a": torch.arange(4.0), "groups": [{"lr": 0.1, "params": [0, 1]}], "t": (torch.ones(2), "x")}
    snap = host_copy(live)
    live["a"].add_(1)
    live["groups"][0]["lr"] = 0.2
    live["groups"][0]["params"].append(2)
    live["t"][0].mul_(3)
    assert torch.equal(snap["a"], torch.arange(4.0)) and snap["groups"] == [{"lr": 0.1, "params": [0, 1]}]
    assert torch.equal(snap["t"][0], torch.ones(2)) and snap["t"][1] == "x"


def test_orphaned_temporary_directories_are_swept(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(proc.stdout)
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / f"step-00000003.tmp-{dead}").mkdir()  # a writer killed mid-write
    (root / "step-00000004.tmp-1").mkdir()  # pid 1 is alive: not ours to remove
    tr = trained()
    save_checkpoint(tmp_path, 5, 0, tr.model, tr.state_dict())
    names = sorted(p.name for p in root.iterdir())
    assert names == ["step-00000004.tmp-1", "step-00000005"]
