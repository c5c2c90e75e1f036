"""Checkpoints written in the background (dflash/training/checkpoint.py: CheckpointWriter, host_copy) and
damaged ones found and moved aside (dflash/training/checkpoint_load.py)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file

from dflash.training.checkpoint import CheckpointWriter, host_copy, save_checkpoint
from dflash.training.checkpoint_load import (
    CheckpointError,
    checkpoint_problem,
    is_damage_error,
    latest_checkpoint,
    load_trainer_state,
    quarantine,
    read_state,
)
from dflash.config import TrainConfig
from dflash.training.trainer import DrafterTrainer
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


# --------------------------------------------------------------------------- damaged checkpoints


def _three_checkpoints(tmp_path):
    tr = trained()
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, 0, tr.module, tr.state_dict(), keep_last=3)
    return tmp_path / "checkpoints"


def _truncate(path, keep: float = 0.5) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))


@pytest.mark.parametrize("damage", ["weights_truncated", "trainer_truncated", "state_garbage", "pickle_corrupt",
                                    "config_missing"])
def test_verify_moves_a_damaged_newest_checkpoint_aside(tmp_path, damage) -> None:
    root = _three_checkpoints(tmp_path)
    newest = root / "step-00000006"
    assert checkpoint_problem(newest) is None
    if damage == "weights_truncated":
        _truncate(newest / "drafter" / "model.safetensors")
    elif damage == "trainer_truncated":
        _truncate(newest / "trainer.pt")
    elif damage == "state_garbage":
        (newest / "state.json").write_text('{"step": 6, "epo')
    elif damage == "pickle_corrupt":  # the zip directory is intact; the pickle entry's CRC is not
        data = bytearray((newest / "trainer.pt").read_bytes())
        start = data.index(b"data.pkl") + len(b"data.pkl") + 64
        data[start:start + 32] = b"\xff" * 32
        (newest / "trainer.pt").write_bytes(bytes(data))
    else:
        (newest / "drafter" / "config.json").unlink()
    problem = checkpoint_problem(newest)
    assert problem is not None
    assert latest_checkpoint(tmp_path) == newest  # without verify: only names are looked at
    assert latest_checkpoint(tmp_path, verify=True) == root / "step-00000004"
    moved = root / "step-00000006.damaged"
    assert not newest.exists() and moved.is_dir()
    assert (moved / "DAMAGED.txt").read_text().strip() == problem
    assert latest_checkpoint(tmp_path, verify=True) == root / "step-00000004"  # stays put
    # the next checkpoint written prunes good ones only; the damaged one stays for inspection
    tr = trained(1)
    save_checkpoint(tmp_path, 8, 0, tr.module, tr.state_dict(), keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000006.damaged", "step-00000008"]


def test_every_checkpoint_damaged_means_none(tmp_path) -> None:
    root = _three_checkpoints(tmp_path)
    for step in (2, 4, 6):
        _truncate(root / f"step-{step:08d}" / "drafter" / "model.safetensors", 0.9)
    assert latest_checkpoint(tmp_path, verify=True) is None
    assert sorted(p.name for p in root.iterdir()) == [f"step-{s:08d}.damaged" for s in (2, 4, 6)]


def test_quarantine_names_and_races(tmp_path) -> None:
    root = _three_checkpoints(tmp_path)
    (root / "step-00000006.damaged").mkdir()  # an earlier damaged copy of the same step
    assert quarantine(root / "step-00000006", "bad") == root / "step-00000006.damaged-2"
    assert quarantine(root / "step-00000006", "bad") is None  # another rank moved it first


def test_damage_errors_are_told_from_other_load_errors(tmp_path) -> None:
    root = _three_checkpoints(tmp_path)
    ckpt = root / "step-00000006"
    _truncate(ckpt / "drafter" / "model.safetensors")
    with pytest.raises(Exception) as weights:
        load_file(str(ckpt / "drafter" / "model.safetensors"))
    _truncate(ckpt / "trainer.pt")
    with pytest.raises(Exception) as trainer:
        load_trainer_state(ckpt)
    with pytest.raises(Exception) as missing:
        read_state(root / "step-00000009")
    assert is_damage_error(weights.value) and is_damage_error(trainer.value) and is_damage_error(missing.value)
    # not damage: a state that does not fit this model or optimizer, or no memory
    with pytest.raises(RuntimeError) as mismatch:
        tiny_model(0, head_dim=16).load_state_dict(load_file(str(root / "step-00000004" / "drafter" / "model.safetensors")))
    assert not is_damage_error(mismatch.value)
    assert not is_damage_error(ValueError("loaded state dict contains a parameter group that doesn't match"))
    assert not is_damage_error(torch.OutOfMemoryError("CUDA out of memory"))


@pytest.mark.parametrize("state, expected", [
    ('{"step": true}', "state.json: 'step' must be an integer >= 0, got True"),
    ('{"step": -1}', "state.json: 'step' must be an integer >= 0, got -1"),
    ('{"step": 5}', "state.json says step 5 in a directory named step-00000006"),
    ('[6]', "state.json: 'step' must be an integer >= 0, got None"),
])
def test_state_json_contents_are_checked(tmp_path, state, expected) -> None:
    root = _three_checkpoints(tmp_path)
    (root / "step-00000006" / "state.json").write_text(state)
    assert checkpoint_problem(root / "step-00000006") == expected


def test_unreadable_is_not_damaged_and_a_failed_move_says_why(tmp_path, monkeypatch) -> None:
    import errno
    import os
    from pathlib import Path

    root = _three_checkpoints(tmp_path)
    real_read = Path.read_text

    def denied(self, *a, **k):
        if self.name == "state.json":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_read(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(PermissionError):
        latest_checkpoint(tmp_path, verify=True)
    assert (root / "step-00000006").is_dir()  # nothing moved
    monkeypatch.setattr(Path, "read_text", real_read)

    def read_only(src, dst):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "rename", read_only)
    with pytest.raises(CheckpointError, match=r"step-00000006 is damaged \(bad\) and cannot be moved aside: "
                                              r"OSError: \[Errno \d+\] Read-only file system"):
        quarantine(root / "step-00000006", "bad")


def test_an_unsupported_type_is_not_damage() -> None:
    import pickle

    assert not is_damage_error(pickle.UnpicklingError("Weights only load failed. ... Unsupported global: GLOBAL x.Y"))
    assert is_damage_error(pickle.UnpicklingError("invalid load key, '\\xff'."))


def test_the_drafter_refuses_to_checkpoint_a_non_finite_loss() -> None:
    """Weights that give a NaN loss (diverged, or restored from silently corrupt tensors) must not
    be checkpointed: pruning would then delete the good checkpoints before them."""
    from types import SimpleNamespace

    from dflash.training.optim import LRSchedule
    from dflash.data.schedule import DataPosition
    from dflash.runtime.drafter import DrafterWorker

    saved = []
    fake = SimpleNamespace(rank=0, steps_done=7, _last_loss=float("nan"), model=None, world=1,
                           position=DataPosition(0, 7), schedule=LRSchedule(6e-4, 10, 1, 0.0), identity={},
                           trainer=SimpleNamespace(state_dict=lambda: {}),
                           writer=SimpleNamespace(save=lambda *a: saved.append(a), last_blocking_s=0.0),
                           stats={}, _announce=lambda done: None)
    with pytest.raises(RuntimeError, match="step 7: the training loss is nan; not writing a checkpoint"):
        DrafterWorker.save(fake)
    fake._last_loss = 2.5
    DrafterWorker.save(fake)
    assert len(saved) == 1


def test_files_are_on_disk_before_the_rename(tmp_path, monkeypatch) -> None:
    """Every file of a checkpoint is fsync'ed before the rename that makes it the newest (after
    which older checkpoints are pruned): a power loss cannot leave zero-filled files behind a
    complete-looking directory."""
    import os

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a))), real_replace(a, b))[1])
    tr = trained()
    final = save_checkpoint(tmp_path, 3, 0, tr.module, tr.state_dict())
    tmp = tmp_path / "checkpoints" / f"step-00000003.tmp-{os.getpid()}"
    (rename,) = [i for i, e in enumerate(events) if e == ("replace", str(tmp))]
    synced = {p for kind, p in events[:rename] if kind == "fsync"}
    files = [p.relative_to(final) for p in final.rglob("*") if p.is_file()]
    assert len(files) >= 4
    assert all(str(tmp / f) in synced for f in files), (files, synced)
    assert ("fsync", str(tmp_path / "checkpoints")) in events[rename:]
