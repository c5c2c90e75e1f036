"""Finding a trained drafter: the drafter and run directories a checkpoint path names, the
checkpoint's optimizer step, and the run's last held-out τ from training's evaluation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

from dflash import jsonl

__all__ = ["EvalTau", "resolve_checkpoint", "open_checkpoint", "last_eval_tau", "training_eval_summary",
           "checkpoint_step", "fit_problem", "target_shape_problem"]


def resolve_checkpoint(path: Union[str, Path]) -> tuple[Path, Optional[Path]]:
    """``(drafter directory, run directory or None)`` for a checkpoint path.

    Accepts a run directory ``runs/<name>`` (its newest checkpoint), a training checkpoint
    ``runs/<name>/checkpoints/step-XXXXXXXX`` (the drafter is its
    ``drafter/`` sub-directory; the run directory is two levels up) or a drafter directory itself.

    Raises:
        FileNotFoundError: no ``config.json`` found, or a run without a complete checkpoint.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such run, checkpoint or drafter directory")
    if not (p / "drafter" / "config.json").is_file() and not (p / "config.json").is_file() \
            and (p / "checkpoints").is_dir():  # a run directory: its newest checkpoint
        from dflash.training.checkpoint_load import latest_checkpoint

        newest = latest_checkpoint(p)
        if newest is None:
            raise FileNotFoundError(f"{p}: the run has no complete checkpoint under {p / 'checkpoints'}")
        p = newest
    if (p / "drafter" / "config.json").is_file():
        run = p.parent.parent if p.parent.name == "checkpoints" else None
        return p / "drafter", run
    if (p / "config.json").is_file():
        run = p.parent.parent.parent if p.parent.parent.name == "checkpoints" else None
        return p, run
    raise FileNotFoundError(f"{p}: neither a checkpoint (drafter/config.json) nor a drafter directory (config.json)")


def open_checkpoint(path: Union[str, Path]) -> tuple[Path, Optional[Path], Any]:
    """``(drafter directory, run directory or None, drafter config)`` of a checkpoint path
    (:func:`resolve_checkpoint`), its ``config.json`` read and its weights file's header checked:
    what a decoding run needs to know before any model loads.

    Raises:
        FileNotFoundError: no checkpoint or drafter at ``path``, or no weights file.
        ValueError: a ``config.json`` that is not a servable DFlash drafter config, or a truncated or
            corrupt weights file (:func:`dflash.models.drafter_io.check_drafter_weights`).
    """
    from dflash.models.drafter_io import check_drafter_weights, read_drafter_config

    drafter_dir, run_dir = resolve_checkpoint(path)
    config = read_drafter_config(drafter_dir)
    check_drafter_weights(drafter_dir)
    return drafter_dir, run_dir, config


class EvalTau(NamedTuple):
    """A held-out evaluation of training (``metrics.jsonl``), the values a decoding run is compared with.

    Fields: ``step`` (optimizer step); ``tau`` (``eval/tau``: every anchor of whole responses);
    ``tau_head`` (``eval/tau_head``: anchors within ``train.eval_head_tokens`` of their response's
    start); ``tau_walk`` / ``tau_walk_head`` (``eval/tau_walk`` / ``eval/tau_walk_head``: the anchors
    decoding would visit, walked over whole responses / over their first ``train.eval_head_tokens``
    tokens: training's prediction of decoding τ); ``per_position`` (``eval/acc_block_pos_k`` for
    k = 1, 2, …: the fraction of blocks whose first k drafts are all right). A value the run did not
    record is ``None`` (``per_position``: empty).
    """

    step: int
    tau: float
    tau_head: Optional[float] = None
    tau_walk: Optional[float] = None
    tau_walk_head: Optional[float] = None
    per_position: tuple[float, ...] = ()


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def last_eval_tau(run_dir: Optional[Path], max_step: Optional[int] = None) -> Optional[EvalTau]:
    """The last held-out evaluation (:class:`EvalTau`) in ``run_dir/metrics.jsonl``.

    Args:
        run_dir: the run directory (``None`` = no run).
        max_step: ignore evaluations after this optimizer step (the checkpoint's step), so an
            older checkpoint is compared with the evaluation of its own weights or an earlier one.

    Returns:
        :class:`EvalTau`, or ``None`` when there is no such evaluation (unreadable lines are skipped).
    """
    if run_dir is None:
        return None
    found = None
    for rec in jsonl.read_records(Path(run_dir) / "metrics.jsonl"):
        if "eval/tau" not in rec:
            continue
        step = int(rec.get("step", -1))
        if max_step is None or step <= max_step:
            per_position: list[float] = []
            while (acc := _number(rec.get(f"eval/acc_block_pos_{len(per_position) + 1}"))) is not None:
                per_position.append(acc)
            found = EvalTau(step, float(rec["eval/tau"]), _number(rec.get("eval/tau_head")),
                            _number(rec.get("eval/tau_walk")), _number(rec.get("eval/tau_walk_head")),
                            tuple(per_position))
    return found


def training_eval_summary(drafter_dir: Path, run_dir: Optional[Path]) -> dict[str, Any]:
    """The keys a decoding report's summary takes from training (:func:`last_eval_tau` at the
    checkpoint's own step or before): ``checkpoint_step``, ``training_eval_step``,
    ``offline_tau_training_eval`` (every anchor), ``offline_tau_training_eval_head``,
    ``offline_tau_training_eval_walk``, ``offline_tau_training_eval_walk_head`` and
    ``per_position_training_eval``; ``None`` (a list: empty) where the run has no such value or no
    run is known (a drafter directory on its own)."""
    step = checkpoint_step(drafter_dir)
    ev = last_eval_tau(run_dir, max_step=step)
    return {"checkpoint_step": step, "training_eval_step": ev.step if ev else None,
            "offline_tau_training_eval": ev.tau if ev else None,
            "offline_tau_training_eval_head": ev.tau_head if ev else None,
            "offline_tau_training_eval_walk": ev.tau_walk if ev else None,
            "offline_tau_training_eval_walk_head": ev.tau_walk_head if ev else None,
            "per_position_training_eval": list(ev.per_position) if ev else []}


def checkpoint_step(drafter_dir: Path) -> Optional[int]:
    """The optimizer step of the training checkpoint holding ``drafter_dir`` (its ``state.json``), or ``None``."""
    from dflash.training.checkpoint_load import read_state

    ckpt = Path(drafter_dir).parent
    if Path(drafter_dir).name != "drafter" or not (ckpt / "state.json").is_file():
        return None
    try:
        return int(read_state(ckpt)["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def fit_problem(drafter_dir: Path, dcfg: Any, tokenizer: Any, enable_thinking: Optional[bool],
                force: bool = False) -> Optional[str]:
    """Why the drafter at ``drafter_dir`` (config ``dcfg``) must not be used with ``tokenizer`` and
    this thinking mode, or ``None``: another tokenizer, chat template or thinking mode than it was
    trained with (:func:`dflash.training.checkpoint_identity.check_fits`; ``force`` accepts those).
    Loads no model, so a decoding command can refuse before the target loads."""
    from dflash.training.checkpoint_identity import CheckpointMismatch, check_fits, run_identity

    try:
        check_fits(drafter_dir, run_identity(tokenizer, None, list(dcfg.target_layer_ids), enable_thinking),
                   force=force)
    except CheckpointMismatch as exc:
        return str(exc)
    return None


def target_shape_problem(drafter_dir: Path, dcfg: Any, target: Any) -> Optional[str]:
    """Why the drafter (config ``dcfg``) cannot run on the loaded ``target``
    (:class:`dflash.models.target.TargetModel`), or ``None``: another layer count or hidden size."""
    if target.num_layers == dcfg.num_target_layers and target.hidden_size == dcfg.hidden_size:
        return None
    return (f"{drafter_dir}: drafter for a {dcfg.num_target_layers}-layer, D={dcfg.hidden_size} target; "
            f"this target has {target.num_layers} layers, D={target.hidden_size}")
