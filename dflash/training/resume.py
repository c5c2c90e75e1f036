"""What a launch continues from: its step plan and learning-rate schedule, and ``plan.json``.

* :func:`plan_launch`: the step plan and learning-rate schedule of a fresh or resumed launch.
  A resume continues at the checkpoint's **data position** (the next untrained batch, counted in
  batches: :class:`dflash.data.schedule.DataPosition`), whatever the number of drafters now, and keeps
  the learning rate continuous (:meth:`dflash.training.optim.LRSchedule.spread`); a changed
  ``train.max_steps`` / ``epochs`` / ``lr`` / ``warmup_ratio`` / ``min_lr_ratio`` rebuilds the
  schedule for the new settings, said in one log line with the old and the new schedule.
* :class:`LaunchPlan` (``<run_dir>/plan.json``): what the launcher decided, read by the drafter
  workers (total steps and schedule) before they build their optimizer.

Whether a checkpoint can be continued by this config at all: :mod:`dflash.training.resume_check`;
the record of what each step trained (``ledger.jsonl``): :mod:`dflash.training.ledger_file`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from dflash.training.optim import LRSchedule
from dflash.data.schedule import DataPosition, StepPlan
from dflash.utils import atomic_write_text

__all__ = ["PLAN_FILE", "SCHEDULE_KEYS", "LaunchPlan", "plan_launch", "checkpoint_position", "flat_config"]

log = logging.getLogger(__name__)

PLAN_FILE = "plan.json"
#: Config keys that define the learning-rate schedule: a change at ``--resume`` rebuilds it.
SCHEDULE_KEYS = ("train.max_steps", "train.epochs", "train.lr", "train.warmup_ratio", "train.min_lr_ratio")
#: What each step trains towards: a resume may change them (the drafter's shape stays), and says so.
OBJECTIVE_KEYS = ("drafter.labels", "drafter.label_chain", "drafter.distillation", "drafter.loss_weighting",
                  "drafter.loss_gamma", "drafter.dpace_alpha", "drafter.anchor_sampling", "drafter.anchors_per_row",
                  "drafter.anchors_per_conversation")


@dataclass
class LaunchPlan:
    """One launch's plan: it starts at ``start_step`` / ``start``, ends at ``total_steps``, with
    ``num_drafters`` ranks and the learning rate ``schedule``."""

    start_step: int
    start: DataPosition
    num_drafters: int
    total_steps: int
    schedule: LRSchedule

    def write(self, run_dir: Path) -> Path:
        """Write ``<run_dir>/plan.json`` atomically (:func:`dflash.utils.atomic_write_text`)."""
        path = Path(run_dir) / PLAN_FILE
        atomic_write_text(path, json.dumps({"start_step": self.start_step, "start": self.start.to_list(),
                                   "num_drafters": self.num_drafters, "total_steps": self.total_steps,
                                   "schedule": self.schedule.to_dict()}, indent=1))
        return path

    @classmethod
    def read(cls, run_dir: Path) -> Optional["LaunchPlan"]:
        """``<run_dir>/plan.json``, or ``None`` when there is none.

        Raises:
            ValueError: the file is not a launch plan.
        """
        path = Path(run_dir) / PLAN_FILE
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            return cls(int(data["start_step"]), DataPosition.from_list(data["start"]), int(data["num_drafters"]),
                       int(data["total_steps"]), LRSchedule.from_dict(data["schedule"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path} is not a launch plan ({type(exc).__name__}: {exc})") from None


def checkpoint_position(state: dict, batches_per_epoch: Sequence[int], num_drafters: int) -> DataPosition:
    """The data position a checkpoint's ``state.json`` records (``data_position``).

    A checkpoint that records none was written by a run that kept one plan from step 0: its
    position is derived from that plan with the checkpoint's ``num_drafters`` (else
    ``num_drafters``).

    Raises:
        ValueError: a malformed ``data_position``, or a step past that plan.
    """
    if state.get("data_position") is not None:
        return DataPosition.from_list(state["data_position"])
    step = int(state["step"])
    old = StepPlan(batches_per_epoch, int(state.get("num_drafters") or num_drafters))
    if step > old.total_steps:
        raise ValueError(f"checkpoint step {step} is past the {old.total_steps} steps its data gives")
    return old.position_at(step)


def flat_config(cfg: Optional[dict]) -> dict:
    """A run config as a dict (``RunConfig.to_dict()``, a loaded ``config.yaml``) flattened to
    ``{"section.key": value}``; non-dict sections are left out, ``None`` gives ``{}``."""
    out = {}
    for section, values in (cfg or {}).items():
        if isinstance(values, dict):
            out.update({f"{section}.{k}": v for k, v in values.items()})
    return out


def plan_launch(cfg: Any, batches_per_epoch: Sequence[int], state: Optional[dict] = None,
                saved_cfg: Optional[dict] = None) -> tuple[StepPlan, LaunchPlan, list[str]]:
    """The step plan, launch plan and notes of a fresh launch (``state=None``) or a resume.

    Args:
        cfg: this launch's :class:`dflash.config.RunConfig`.
        batches_per_epoch: training batches of each epoch (``train.epochs`` entries).
        state: the resumed checkpoint's ``state.json`` (``step``; ``data_position``,
            ``num_drafters``, ``schedule`` when it records them).
        saved_cfg: the run's previous ``config.yaml`` as a dict (what the checkpoint was trained
            with), to tell a changed :data:`SCHEDULE_KEYS` entry.

    Returns:
        ``(plan, launch, notes)``: ``notes`` are the lines to log (a changed schedule, objective
        (:data:`OBJECTIVE_KEYS`) or number of drafters; ``train.max_steps`` the data cannot give).

    Raises:
        ValueError: a checkpoint position past this config's data (fewer epochs or batches).
    """
    d = len(cfg.cluster.drafters)
    max_steps = cfg.train.max_steps
    notes: list[str] = []
    if state is None:
        plan = StepPlan(batches_per_epoch, d, max_steps)
        schedule = LRSchedule.nominal(plan.total_steps, cfg.train)
    else:
        step = int(state["step"])
        position = checkpoint_position(state, batches_per_epoch, d)
        plan = StepPlan(batches_per_epoch, d, max_steps, start_step=step, start=position)
        old_d = state.get("num_drafters")
        old = LRSchedule.from_dict(state["schedule"]) if state.get("schedule") else None
        before, now = flat_config(saved_cfg), flat_config(cfg.to_dict())
        changed = [f"{k} {json.dumps(before[k])} -> {json.dumps(now[k])}" for k in SCHEDULE_KEYS
                   if k in before and before[k] != now[k]]
        objective = [f"{k} {json.dumps(before[k])} -> {json.dumps(now[k])}" for k in OBJECTIVE_KEYS
                     if k in before and k in now and before[k] != now[k]]
        if objective:
            notes.append(f"the objective changes at step {step}: {', '.join(objective)} (the steps before it were "
                         "trained with the old values)")
        if old is not None and old_d is not None and old_d != d:
            notes.append(f"resuming with {d} drafter(s) where the checkpoint was trained with {old_d}: continuing "
                         f"at data position epoch {position.epoch} batch {position.batch} (every batch trained once)")
        if old is None:
            schedule = LRSchedule.nominal(max(plan.total_steps, 1), cfg.train)
            if changed or (old_d is not None and old_d != d):
                notes.append(f"the checkpoint records no LR schedule: using {schedule.describe(step)}")
        elif changed:
            schedule = LRSchedule.nominal(max(plan.total_steps, 1), cfg.train)
            notes.append(f"LR schedule rebuilt at step {step} for {', '.join(changed)}: before {old.describe(step)}; "
                         f"now {schedule.describe(step)}")
        else:
            schedule = old.spread(step, plan.total_steps)
            if schedule != old:
                notes.append(f"LR schedule continued at step {step} and spread over the steps now left: before "
                             f"{old.describe(step)}; now {schedule.describe(step)}")
    if max_steps is not None and plan.data_steps < max_steps:
        notes.append(f"train.max_steps={max_steps} cannot be honoured: the data gives {plan.data_steps} steps "
                     f"({sum(batches_per_epoch)} batches in {len(batches_per_epoch)} epoch(s) over {d} drafter(s)"
                     f"{f', from step {plan.start_step}' if plan.start_step else ''}); the run ends at step "
                     f"{plan.total_steps} (raise train.epochs or add data for more)")
    launch = LaunchPlan(plan.start_step, plan.start, d, plan.total_steps, schedule)
    return plan, launch, notes
