"""Finding, checking and loading training checkpoints; moving a damaged one aside.

:func:`latest_checkpoint` gives the newest complete ``<run_dir>/checkpoints/step-XXXXXXXX``
(temporary ``.tmp-<pid>`` directories of a write in progress are never candidates).

A checkpoint damaged after it was written (a truncated copy, a full disk, a bad file) is found by
:func:`checkpoint_problem` before it is used (``latest_checkpoint(..., verify=True)``, at
``--resume`` and at every drafter-group restart) or fails to load in a drafter
(:func:`is_damage_error`); either way it is moved aside to ``step-XXXXXXXX.damaged`` by
:func:`quarantine` (never deleted: the files stay for inspection) with the reason in
``DAMAGED.txt``, and the run goes on from the previous checkpoint.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Optional

import torch

__all__ = ["CheckpointError", "checkpoint_steps", "latest_checkpoint", "checkpoint_problem", "is_damage_error",
           "quarantine", "read_state", "load_trainer_state"]

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A background checkpoint write failed, or a damaged checkpoint cannot be moved aside (the cause is chained)."""


def checkpoint_steps(root: Path) -> list[int]:
    """The steps of the complete checkpoints (``step-XXXXXXXX`` with a ``state.json``) in ``root``
    (``<run_dir>/checkpoints``), unordered; ``[]`` when ``root`` does not exist."""
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and (child / "state.json").is_file():
            out.append(int(m.group(1)))
    return out


def latest_checkpoint(run_dir: Path, verify: bool = False) -> Optional[Path]:
    """The newest complete checkpoint directory of a run, or None.

    Args:
        verify: check each candidate, newest first, with :func:`checkpoint_problem`; a damaged
            one is moved aside (:func:`quarantine`) and the next older one is tried.
    """
    root = Path(run_dir) / "checkpoints"
    for step in sorted(checkpoint_steps(root), reverse=True):
        ckpt = root / f"step-{step:08d}"
        problem = checkpoint_problem(ckpt) if verify else None
        if problem is None:
            return ckpt
        quarantine(ckpt, problem)
    return None


def checkpoint_problem(ckpt: Path) -> Optional[str]:
    """What makes a checkpoint directory unusable, found without loading its tensors; ``None`` if nothing.

    Reads ``state.json`` (a JSON object with an integer ``step``) and ``drafter/config.json``,
    opens ``drafter/model.safetensors`` (its header must cover the whole file: a truncated file
    fails) and ``trainer.pt`` (a zip archive: its directory must be readable and the pickle entry
    pass its CRC). Costs milliseconds. Not seen here: bytes changed inside the tensor data (the
    formats carry no checksum of it); a drafter refuses to checkpoint a non-finite loss, so such
    weights never replace good checkpoints.

    Raises:
        PermissionError: a file cannot be read (not damage: nothing is moved).
    """
    ckpt = Path(ckpt)
    part = ""  # the file being checked, named in the problem (state.json / config.json: by the error)
    try:
        state = json.loads((ckpt / "state.json").read_text())
        step = state.get("step") if isinstance(state, dict) else None
        if type(step) is not int or step < 0:
            return f"state.json: 'step' must be an integer >= 0, got {step!r}"
        named = _STEP_DIR.match(ckpt.name)
        if named and int(named.group(1)) != step:
            return f"state.json says step {step} in a directory named {ckpt.name}"
        if not isinstance(json.loads((ckpt / "drafter" / "config.json").read_text()), dict):
            return "drafter/config.json is not a JSON object"
        from safetensors import safe_open

        part = "drafter/model.safetensors: "
        with safe_open(str(ckpt / "drafter" / "model.safetensors"), framework="pt") as f:
            f.keys()
        part = "trainer.pt: "
        with zipfile.ZipFile(ckpt / "trainer.pt") as z:
            pickles = [n for n in z.namelist() if n.endswith("data.pkl")]
            if not pickles:
                return "trainer.pt: no data.pkl entry"
            z.read(pickles[0])
    except PermissionError:
        raise  # not damage: the files may be fine (the caller reports it)
    except Exception as exc:  # noqa: BLE001 - bad JSON, SafetensorError, BadZipFile, OSError: unusable either way
        return f"{part}{type(exc).__name__}: {exc}"
    return None


def is_damage_error(exc: BaseException) -> bool:
    """Whether an exception raised while loading a checkpoint means its files are damaged.

    True for unreadable / truncated / corrupt files (missing file, bad JSON, safetensors header
    errors, bad zip or pickle, torch's zip reader errors); False for everything else, e.g. out of
    memory, or a model or optimizer state that does not fit (``RuntimeError`` / ``ValueError`` of
    ``load_state_dict``: a config mismatch, not damage).
    """
    if isinstance(exc, pickle.UnpicklingError):  # torch's refusal of an unsupported type is not damage
        return "Weights only load failed" not in str(exc)
    if isinstance(exc, (FileNotFoundError, json.JSONDecodeError, EOFError, zipfile.BadZipFile)):
        return True
    if type(exc).__name__ == "SafetensorError":
        return True
    return isinstance(exc, RuntimeError) and "PytorchStreamReader" in str(exc)


def quarantine(ckpt: Path, reason: str) -> Optional[Path]:
    """Move a damaged checkpoint aside: ``step-X`` → ``step-X.damaged`` (``.damaged-2``, … if taken).

    Writes ``DAMAGED.txt`` with ``reason`` inside and logs a warning. Several processes may find
    the same damage at once: the first moves it, the others find it gone and return ``None``.

    Returns:
        the new path, or ``None`` when ``ckpt`` was already gone.

    Raises:
        CheckpointError: it cannot be renamed (read-only file system, permissions).
    """
    ckpt = Path(ckpt)
    for n in range(1, 100):
        dest = ckpt.with_name(ckpt.name + (".damaged" if n == 1 else f".damaged-{n}"))
        if dest.exists():
            continue
        try:
            os.rename(ckpt, dest)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):  # dest appeared meanwhile: the next name
                continue
            raise CheckpointError(f"checkpoint {ckpt} is damaged ({reason}) and cannot be moved aside: "
                                  f"{type(exc).__name__}: {exc}; move it out of {ckpt.parent} by hand") from exc
        try:
            (dest / "DAMAGED.txt").write_text(f"{reason}\n")
        except OSError:
            pass
        log.warning("checkpoint %s is damaged (%s): moved aside to %s", ckpt, reason, dest.name)
        return dest
    raise CheckpointError(f"checkpoint {ckpt} is damaged ({reason}) and cannot be moved aside: "
                          f"{ckpt.name}.damaged … .damaged-99 all exist")


def read_state(ckpt: Path) -> dict:
    """``state.json`` of a checkpoint (``step``, ``epoch``, …)."""
    return json.loads((Path(ckpt) / "state.json").read_text())


def load_trainer_state(ckpt: Path, map_location: str | torch.device = "cpu") -> dict:
    """``{"trainer": ..., "rng": ...}`` from ``trainer.pt`` (loaded without unpickling code)."""
    return torch.load(Path(ckpt) / "trainer.pt", map_location=map_location, weights_only=True)
