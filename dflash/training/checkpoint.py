"""Writing training checkpoints atomically: drafter (HF directory), optimizer, scheduler, data position, RNG.

Layout of ``<run_dir>/checkpoints/step-00000100/``::

    drafter/config.json, drafter/model.safetensors   the DFlash HF directory (engine-loadable)
    trainer.pt                                        optimizer + scheduler state, RNG states
    state.json                                        step, data position, schedule, what it was trained with

A checkpoint is written under ``step-XXXXXXXX.tmp-<pid>``, flushed to disk (``fsync``) and renamed
into place, so a crash or a power loss mid-write never leaves a checkpoint that looks complete.
:func:`dflash.training.checkpoint_load.latest_checkpoint` ignores temporary directories; the next
checkpoint written removes those of processes that are gone. Finding, checking and loading a
checkpoint: :mod:`dflash.training.checkpoint_load`; what it was trained with:
:mod:`dflash.training.checkpoint_identity`.

:class:`CheckpointWriter` writes from a host copy of the state in a background thread, so
training goes on while the files are written (a checkpoint of the 1.05 B-parameter Qwen3-8B
drafter with its AdamW state is ~12.6 GB and blocked a GPU drafter for ~13 s when written in
the step).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch

from dflash.training.checkpoint_load import CheckpointError, checkpoint_steps
from dflash.utils import atomic_directory, process_alive

__all__ = ["CheckpointWriter", "host_copy", "save_checkpoint", "rng_state", "set_rng_state"]

log = logging.getLogger(__name__)

_TMP_DIR = re.compile(r"^step-\d{8}\.tmp-(\d+)$")


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
                    keep_last: int = 2, extra: Optional[dict] = None, *,
                    model_state: Optional[dict[str, torch.Tensor]] = None,
                    rng: Optional[dict[str, Any]] = None) -> Path:
    """Write checkpoint ``step`` (the number of optimizer steps done) atomically; prune old ones.

    Args:
        model: has ``save_pretrained(directory, state_dict=None)`` (the DFlash drafter).
        trainer_state: optimizer/scheduler state dicts (tensors allowed).
        keep_last: keep this many newest checkpoints.
        model_state: weights to write instead of the model's live ones (a host snapshot).
        rng: RNG states to store instead of the current ones (taken with the snapshot).
    Returns:
        The final checkpoint directory.
    """
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step:08d}"
    started = time.perf_counter()
    # on disk before the rename makes it the newest and older ones get pruned
    with atomic_directory(final, replace=True, tmp=root / f"step-{step:08d}.tmp-{os.getpid()}") as tmp:
        if model_state is None:
            model.save_pretrained(tmp / "drafter")
        else:
            model.save_pretrained(tmp / "drafter", state_dict=model_state)
        torch.save({"trainer": trainer_state, "rng": rng_state() if rng is None else rng}, tmp / "trainer.pt")
        state = {"step": step, "epoch": epoch, "time": time.time(), **(extra or {})}
        (tmp / "state.json").write_text(json.dumps(state, indent=2))
    log.info("checkpoint step %d written to %s in %.1f s", step, final, time.perf_counter() - started)
    steps = sorted(checkpoint_steps(root))
    for old in steps[:-keep_last]:
        shutil.rmtree(root / f"step-{old:08d}", ignore_errors=True)
    _sweep_orphans(root)
    return final


def _sweep_orphans(root: Path) -> None:
    """Remove temporary checkpoint directories of processes that no longer exist."""
    for child in root.iterdir():
        m = _TMP_DIR.match(child.name)
        if m and int(m.group(1)) != os.getpid() and not process_alive(int(m.group(1))):
            log.info("removing %s (its writer, pid %s, is gone)", child, m.group(1))
            shutil.rmtree(child, ignore_errors=True)


def host_copy(obj: Any, buffers: Optional[dict] = None, key: tuple = ()) -> Any:
    """A copy of a nested dict / list / tuple whose tensors are copied to host memory.

    Containers are rebuilt (so later changes to the live state do not show); tensors are
    copied: CUDA ones into page-locked host buffers (``buffers[key path]``, reused when shape
    and dtype match, with a non-blocking copy: the caller synchronises), CPU ones with
    ``clone()``. Other leaves (numbers, strings, ``None``) are shared.

    Args:
        obj: a state dict (model, optimizer, scheduler) or any nesting of containers.
        buffers: page-locked buffers to reuse between calls; ``None`` = allocate fresh.
        key: key path prefix of ``obj`` in ``buffers``.
    """
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.device.type != "cuda":
            return t.clone()
        buf = None if buffers is None else buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            if buffers is not None:
                buffers[key] = buf
        return buf.copy_(t, non_blocking=True)
    if isinstance(obj, dict):
        return type(obj)((k, host_copy(v, buffers, key + (k,))) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(host_copy(v, buffers, key + (i,)) for i, v in enumerate(obj))
    return obj


class CheckpointWriter:
    """Checkpoints written by a background thread from a host copy of the state.

    :meth:`save` copies the model weights, the trainer state and the RNG states to host memory
    (page-locked buffers reused from one checkpoint to the next, one device synchronisation),
    then a thread writes them with :func:`save_checkpoint` (same files, same atomic rename)
    while training goes on. At most one write is in flight: :meth:`save` first waits for the
    previous one. The caller reports completion from its own thread via :meth:`poll` /
    :meth:`wait` (ZeroMQ sockets are not thread-safe, so the writer thread sends nothing).

    Args:
        run_dir: the run directory (checkpoints go to ``run_dir/checkpoints``).
        keep_last: newest checkpoints kept.
        background: ``False`` = write inside :meth:`save` (no thread, no host buffers kept).
    """

    def __init__(self, run_dir: Path, keep_last: int = 2, background: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.keep_last = keep_last
        self.background = background
        self._buffers: dict = {}
        self._thread: Optional[threading.Thread] = None
        self._step: Optional[int] = None
        self._result: Optional[Path] = None
        self._error: Optional[BaseException] = None
        #: seconds the caller was blocked by the last :meth:`save` (host copy, or the whole write)
        self.last_blocking_s = 0.0

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def save(self, step: int, epoch: int, model: Any, trainer_state: dict,
             extra: Optional[dict] = None) -> Optional[tuple[int, Path]]:
        """Checkpoint ``step``: snapshot now, write in the background.

        Returns:
            ``(step, path)`` of a checkpoint finished meanwhile: the previous one when this call
            had to wait for it, or this one when ``background`` is off; else ``None``.

        Raises:
            CheckpointError: the previous background write failed.
        """
        started = time.perf_counter()
        done = self.wait()
        if not self.background:
            path = save_checkpoint(self.run_dir, step, epoch, model, trainer_state, self.keep_last, extra)
            self.last_blocking_s = time.perf_counter() - started
            return step, path
        model_state = host_copy(model.state_dict(), self._buffers, ("model",))
        trainer_host = host_copy(trainer_state, self._buffers, ("trainer",))
        rng = rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the non-blocking copies into the page-locked buffers
        self.last_blocking_s = time.perf_counter() - started
        self._step, self._result, self._error = step, None, None
        self._thread = threading.Thread(
            target=self._write, name=f"checkpoint-{step}", daemon=True,
            args=(step, epoch, model, trainer_host, model_state, rng, extra))
        self._thread.start()
        log.info("checkpoint step %d: state copied to host in %.1f s, writing in the background",
                 step, self.last_blocking_s)
        return done

    def _write(self, step: int, epoch: int, model: Any, trainer_state: dict, model_state: dict,
               rng: dict, extra: Optional[dict]) -> None:
        try:
            self._result = save_checkpoint(self.run_dir, step, epoch, model, trainer_state, self.keep_last, extra,
                                           model_state=model_state, rng=rng)
        except BaseException as exc:  # handed to the caller's thread by poll()/wait()
            self._error = exc

    def poll(self) -> Optional[tuple[int, Path]]:
        """``(step, path)`` once the write in flight has finished (then nothing is in flight).

        Raises:
            CheckpointError: the write failed.
        """
        if self._thread is None or self._thread.is_alive():
            return None
        return self._finish()

    def wait(self, timeout: Optional[float] = None) -> Optional[tuple[int, Path]]:
        """Wait for the write in flight (``None`` when there is none, or on timeout).

        Raises:
            CheckpointError: the write failed.
        """
        if self._thread is None:
            return None
        self._thread.join(timeout)
        if self._thread.is_alive():
            return None
        return self._finish()

    def _finish(self) -> tuple[int, Path]:
        step, error, result = self._step, self._error, self._result
        self._thread, self._step, self._result, self._error = None, None, None, None
        if error is not None:
            raise CheckpointError(f"writing checkpoint step {step} failed: {error}") from error
        assert step is not None and result is not None
        return step, result
