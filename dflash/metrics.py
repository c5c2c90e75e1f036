"""Run metrics: the console progress line with ETA, ``metrics.jsonl`` and its final view, and a
wandb run (offline without an API key).

Only the coordinator (in the launcher process) writes metrics; workers send theirs over the
control plane.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

from dflash import jsonl
from dflash.progress import DEFAULT_INTERVAL_S, Progress, format_duration

__all__ = ["WandbRun", "ProgressLine", "format_duration", "rollback_record", "last_logged_step", "metrics_view"]

log = logging.getLogger(__name__)


class WandbRun:
    """A wandb run, or nothing when disabled / not installed.

    Mode ``auto`` means online when ``WANDB_API_KEY`` is set, offline otherwise. The run's config
    holds the whole run config plus the derived values the caller passes in ``config``.
    """

    def __init__(self, mode: str, project: str, name: str, run_dir: Path, config: dict, resume_id: Optional[str] = None):
        self.run = None
        if mode == "disabled":
            return
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        try:
            import wandb
        except ImportError:
            log.warning("wandb is not installed: metrics go to the console and logs only")
            return
        os.environ.setdefault("WANDB_SILENT", "true")
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(project=project, name=name, dir=str(run_dir), mode=mode, config=config,
                                  id=resume_id, resume="allow" if resume_id else None,
                                  settings=wandb.Settings(console="off", x_disable_stats=True))
        except Exception as exc:  # noqa: BLE001 - wandb raises many types; never fail a run for metrics
            log.warning("wandb.init failed (%s): continuing without wandb", exc)
            self.run = None
            return
        log.info("wandb run %s (%s) in %s", self.run.id, mode, self.run.dir)

    @property
    def id(self) -> Optional[str]:
        return self.run.id if self.run else None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def finish(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None


class ProgressLine(Progress):
    """The training run's line: ``step n/total ep | loss, τ, tokens/s per stage, queue, memory |
    elapsed, eta`` (:class:`dflash.progress.Progress`: live on a terminal, a log line at least
    every ``interval_s`` elsewhere)."""

    def __init__(self, total_steps: int, start_step: int = 0, interval_s: float = DEFAULT_INTERVAL_S, **kwargs):
        super().__init__(total_steps, start_step, desc="step", unit="step", interval_s=interval_s, **kwargs)


# --------------------------------------------------------------------------- metrics.jsonl: one record per step

def rollback_record(to_step: int, from_step: int, reason: str) -> dict:
    """The ``metrics.jsonl`` row that marks the rows of steps ``> to_step`` (written up to
    ``from_step``) as undone: ``{"rollback": {...}, "time": …}`` (no ``step`` key)."""
    return {"rollback": {"to_step": to_step, "from_step": from_step, "reason": reason}, "time": time.time()}


def last_logged_step(path: Path) -> int:
    """The highest ``step`` of any row of ``metrics.jsonl`` (undone ones included: what wandb has
    seen); ``-1`` when there is none."""
    return max((int(r["step"]) for r in jsonl.read_records(path) if isinstance(r.get("step"), int)), default=-1)


def metrics_view(path: Path) -> list[dict]:
    """The final view of ``metrics.jsonl``: each step's training row once, each evaluation
    (step, round) once, in step order.

    A rollback row (:func:`rollback_record`) drops the rows of steps ``> to_step`` written
    before it; a later row of the same step and kind replaces an earlier one.
    """
    view: dict[tuple, dict] = {}
    for row in jsonl.read_records(path):
        if "rollback" in row:
            to = int(row["rollback"]["to_step"])
            view = {k: r for k, r in view.items() if k[0] <= to}
        elif isinstance(row.get("step"), int):
            key = (row["step"], "eval", row.get("eval/round")) if "eval/round" in row else (row["step"], "train")
            view[key] = row
    return [view[k] for k in sorted(view, key=lambda k: (k[0], k[1] == "train"))]
