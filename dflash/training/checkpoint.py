"""Atomic training checkpoints: drafter (HF directory), optimizer, scheduler, data position, RNG.

Layout of ``<run_dir>/checkpoints/step-00000100/``::

    drafter/config.json, drafter/model.safetensors   the DFlash HF directory (engine-loadable)
    trainer.pt                                        optimizer + scheduler state, RNG states
    state.json                                        step, data position, schedule, what it was trained with

A checkpoint is written under ``step-XXXXXXXX.tmp-<pid>``, flushed to disk (``fsync``) and renamed
into place, so a crash or a power loss mid-write never leaves a checkpoint that looks complete.
``latest_checkpoint`` ignores temporary directories; the next checkpoint written removes those of
processes that are gone.

A checkpoint damaged afterwards (a truncated copy, a full disk, a bad file) is found by
:func:`checkpoint_problem` before it is used (``latest_checkpoint(..., verify=True)``, at
``--resume`` and at every drafter-group restart) or fails to load in a drafter; either way it is
moved aside to ``step-XXXXXXXX.damaged`` (never deleted: the files stay for inspection) with the
reason in ``DAMAGED.txt``, and the run goes on from the previous checkpoint.

``state.json`` records what the drafter was trained with (:func:`run_identity`: tokenizer
fingerprint, chat template hash, thinking mode, target architecture / layer count / hidden size /
vocabulary size / layer ids) under ``trained_with``; :func:`check_fits` compares it with what a
resume, a decoding run or an export would use and raises :class:`CheckpointMismatch` with one
line naming the difference.

:class:`CheckpointWriter` writes from a host copy of the state in a background thread, so
training goes on while the files are written (a checkpoint of the 1.05 B-parameter Qwen3-8B
drafter with its AdamW state is ~12.6 GB and blocked a GPU drafter for ~13 s when written in
the step).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import pickle
import zipfile
import os
import random
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch

from dflash.utils import atomic_directory, process_alive

__all__ = ["CheckpointError", "CheckpointWriter", "host_copy", "save_checkpoint", "latest_checkpoint",
           "checkpoint_problem", "is_damage_error", "quarantine", "load_trainer_state", "read_state",
           "rng_state", "set_rng_state", "CheckpointMismatch", "run_identity", "tokenizer_fingerprint",
           "check_fits", "trained_with"]

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{8})$")
_TMP_DIR = re.compile(r"^step-\d{8}\.tmp-(\d+)$")


class CheckpointError(RuntimeError):
    """A background checkpoint write failed, or a damaged checkpoint cannot be moved aside (the cause is chained)."""


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
    steps = sorted(_list_steps(root))
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


def _list_steps(root: Path) -> list[int]:
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
    for step in sorted(_list_steps(root), reverse=True):
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


# --------------------------------------------------------------------------- what a checkpoint was trained with

class CheckpointMismatch(ValueError):
    """A checkpoint does not fit the tokenizer, chat template, thinking mode or target it is used with."""


#: Identity fields a user may knowingly change (``--force``): the drafter still loads and runs, but
#: what it learnt may not transfer (another chat template or thinking mode collapses acceptance).
FORCIBLE = ("tokenizer.sha256", "chat_template.sha256", "enable_thinking", "target.architecture")
#: What each identity field is, in a mismatch message.
IDENTITY_NAMES = {
    "tokenizer.size": "tokenizer size (tokens)",
    "tokenizer.sha256": "tokenizer fingerprint (sha256 of its vocabulary and special tokens)",
    "chat_template.sha256": "chat template (sha256)",
    "enable_thinking": "thinking mode (data.enable_thinking)",
    "target.architecture": "target architecture",
    "target.num_layers": "target layer count",
    "target.hidden_size": "target hidden size",
    "target.vocab_size": "target vocabulary size (embedding rows)",
    "target.layer_ids": "target layer ids (the drafter's context features)",
}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 (hex) of a tokenizer's vocabulary (token → id, sorted) and its special token ids.

    Two tokenizers with the same fingerprint map every text to the same ids. Costs ~0.1 s for a
    150k-token vocabulary.
    """
    vocab = sorted(tokenizer.get_vocab().items())
    special = {name: getattr(tokenizer, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    blob = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def run_identity(tokenizer: Any = None, target_config: Any = None, layer_ids: Optional[list[int]] = None,
                 enable_thinking: Optional[bool] = None,
                 tokenizer_identity: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """What a drafter is trained with or used with, as flat ``{field: value}`` (see :data:`IDENTITY_NAMES`).

    Args:
        tokenizer: a Hugging Face tokenizer (``get_vocab``, ``chat_template``, ``len``); ``None``
            leaves out the tokenizer and template fields.
        target_config: the target's Hugging Face config (no weights needed); ``None`` leaves out
            the target fields.
        layer_ids: the target layers feeding the drafter; ``None`` leaves the field out.
        enable_thinking: ``data.enable_thinking`` (``None`` = the template's default).
        tokenizer_identity: the tokenizer and template fields of an earlier ``run_identity(tokenizer)``,
            used when ``tokenizer`` is ``None`` (a worker that has not loaded the tokenizer).

    Returns:
        JSON-serialisable values; fields left out are not compared by :func:`check_fits`.
    """
    out: dict[str, Any] = {"enable_thinking": enable_thinking}
    if tokenizer is not None:
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # several named templates
            template = json.dumps(template, sort_keys=True)
        out["tokenizer.size"] = len(tokenizer)
        out["tokenizer.sha256"] = tokenizer_fingerprint(tokenizer)
        out["chat_template.sha256"] = (hashlib.sha256(template.encode("utf-8")).hexdigest()
                                       if isinstance(template, str) else None)
    elif tokenizer_identity is not None:
        out.update({k: tokenizer_identity[k] for k in ("tokenizer.size", "tokenizer.sha256", "chat_template.sha256")})
    if target_config is not None:
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        archs = getattr(target_config, "architectures", None) or [type(target_config).__name__]
        out["target.architecture"] = str(archs[0])
        out["target.num_layers"] = int(text.num_hidden_layers)
        out["target.hidden_size"] = int(text.hidden_size)
        out["target.vocab_size"] = int(text.vocab_size)
    if layer_ids is not None:
        out["target.layer_ids"] = [int(i) for i in layer_ids]
    return out


def _short(value: Any) -> str:
    if isinstance(value, str) and len(value) == 64:  # a sha256
        return value[:12]
    return json.dumps(value)


def _checkpoint_root(path: Path) -> Path:
    """The training checkpoint directory of ``path`` (itself, or the parent of its ``drafter/``)."""
    path = Path(path)
    if not (path / "state.json").is_file() and (path.parent / "state.json").is_file():
        return path.parent
    return path


def trained_with(checkpoint_dir: Path) -> dict[str, Any]:
    """The ``trained_with`` record of a checkpoint (:func:`run_identity` at training time).

    Args:
        checkpoint_dir: ``runs/<name>/checkpoints/step-XXXXXXXX`` or its ``drafter/`` directory.

    Returns:
        ``{field: value}``; empty when the checkpoint records none or its ``state.json`` is
        missing or unreadable (a bare drafter directory).
    """
    try:
        return dict(read_state(_checkpoint_root(checkpoint_dir)).get("trained_with") or {})
    except (OSError, ValueError):
        return {}


def check_fits(checkpoint_dir: Path, identity: dict[str, Any], force: bool = False) -> list[str]:
    """Check that a checkpoint fits what it is about to be used with; stop with one line if not.

    Compares the checkpoint's ``state.json`` ``trained_with`` record with ``identity``
    (:func:`run_identity` of the tokenizer, target and thinking mode in use). Fields left out on
    either side are not compared (a checkpoint that records nothing is only checked for the
    vocabulary below). Independently, a tokenizer with more tokens than the drafter's target
    embedding has rows (``drafter/config.json`` ``vocab_size``) is refused: its ids would index
    past the embedding.

    Args:
        checkpoint_dir: ``runs/<name>/checkpoints/step-XXXXXXXX`` or its ``drafter/`` directory.
        identity: what is used now (:func:`run_identity`).
        force: accept differences in :data:`FORCIBLE` fields (tokenizer fingerprint, chat template,
            thinking mode, architecture name); they are returned so the caller can log them.

    Returns:
        The differences accepted because of ``force`` (empty when everything fits).

    Raises:
        CheckpointMismatch: one line naming the checkpoint and each difference, and ``--force``
            where every difference is one a user may knowingly accept.
    """
    root = _checkpoint_root(checkpoint_dir)
    saved = trained_with(root)
    try:
        drafter_cfg = json.loads(((root / "drafter") if (root / "drafter").is_dir() else root).joinpath(
            "config.json").read_text())
        if isinstance(drafter_cfg.get("vocab_size"), int):
            saved.setdefault("target.vocab_size", drafter_cfg["vocab_size"])
    except (OSError, ValueError):
        pass
    hard, soft = [], []
    size, rows = identity.get("tokenizer.size"), saved.get("target.vocab_size")
    if isinstance(size, int) and isinstance(rows, int) and size > rows:
        hard.append(f"the tokenizer has {size} tokens but the drafter's target embedding has {rows} rows "
                    f"(another tokenizer than the one it was trained with?)")
    for key, name in IDENTITY_NAMES.items():
        if key in saved and key in identity and saved[key] != identity[key]:
            text = f"{name}: checkpoint {_short(saved[key])}, now {_short(identity[key])}"
            (soft if key in FORCIBLE else hard).append(text)
    if hard or (soft and not force):
        hint = " (pass --force to use it anyway)" if soft and not hard else ""
        raise CheckpointMismatch(f"{root} does not fit what it is used with: {'; '.join(hard + soft)}{hint}")
    for text in soft:
        log.warning("%s was trained with another %s (--force)", root, text)
    return soft
