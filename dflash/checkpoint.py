"""Atomic training checkpoints: drafter (HF directory), optimizer, scheduler, data position, RNG.

Layout of ``<run_dir>/checkpoints/step-00000100/``::

    drafter/config.json, drafter/model.safetensors   the DFlash HF directory (engine-loadable)
    trainer.pt                                        optimizer + scheduler state, RNG states
    state.json                                        step (data position), epoch, run name, time

A checkpoint is written under ``step-XXXXXXXX.tmp-<pid>`` and renamed into place, so a crash
mid-write never leaves a checkpoint that looks complete. ``latest_checkpoint`` ignores temporary
directories.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = ["save_checkpoint", "latest_checkpoint", "load_trainer_state", "read_state", "rng_state", "set_rng_state"]

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{8})$")


def rng_state() -> dict[str, Any]:
    """Python, torch CPU and (if present) CUDA RNG states."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned.

    The torch states must be CPU ``uint8`` tensors; a checkpoint loaded with a CUDA
    ``map_location`` (the drafter worker loads onto its GPU) holds them on the GPU, so they are
    moved back first.
    """
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    torch.set_rng_state(state["torch"].to("cpu", torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].to("cpu", torch.uint8))


def save_checkpoint(run_dir: Path, step: int, epoch: int, model: Any, trainer_state: dict,
                    keep_last: int = 2, extra: Optional[dict] = None) -> Path:
    """Write checkpoint ``step`` (the number of optimizer steps done) atomically; prune old ones.

    Args:
        model: has ``save_pretrained(directory)`` (the DFlash drafter).
        trainer_state: optimizer/scheduler state dicts (tensors allowed).
        keep_last: keep this many newest checkpoints.
    Returns:
        The final checkpoint directory.
    """
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f"step-{step:08d}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    started = time.perf_counter()
    model.save_pretrained(tmp / "drafter")
    torch.save({"trainer": trainer_state, "rng": rng_state()}, tmp / "trainer.pt")
    state = {"step": step, "epoch": epoch, "time": time.time(), **(extra or {})}
    (tmp / "state.json").write_text(json.dumps(state, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    log.info("checkpoint step %d written to %s in %.1f s", step, final, time.perf_counter() - started)
    steps = sorted(_list_steps(root))
    for old in steps[:-keep_last]:
        shutil.rmtree(root / f"step-{old:08d}", ignore_errors=True)
    return final


def _list_steps(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and (child / "state.json").is_file():
            out.append(int(m.group(1)))
    return out


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint directory of a run, or None."""
    root = Path(run_dir) / "checkpoints"
    steps = _list_steps(root)
    return root / f"step-{max(steps):08d}" if steps else None


def read_state(ckpt: Path) -> dict:
    """``state.json`` of a checkpoint (``step``, ``epoch``, …)."""
    return json.loads((Path(ckpt) / "state.json").read_text())


def load_trainer_state(ckpt: Path, map_location: str | torch.device = "cpu") -> dict:
    """``{"trainer": ..., "rng": ...}`` from ``trainer.pt`` (loaded without unpickling code)."""
    return torch.load(Path(ckpt) / "trainer.pt", map_location=map_location, weights_only=True)
