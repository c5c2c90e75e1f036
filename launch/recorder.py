"""Where a training run's records go: ``metrics.jsonl``, the wandb run and ``ledger.jsonl``.

:class:`RunRecorder` gives the coordinator its ``on_metrics`` / ``on_trained`` / ``on_rollback``
callbacks; :func:`undo_later_steps` marks, at a launch, the rows a previous launch wrote past
the step this one starts at.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Optional

from dflash import jsonl
from dflash.config import RunConfig
from dflash.metrics import WandbRun, last_logged_step, metrics_view, rollback_record
from dflash.training.ledger_file import LEDGER_FILE, LedgerFile, ledger_view

__all__ = ["METRICS_FILE", "RunRecorder", "start_wandb", "undo_later_steps"]

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_id"


def undo_later_steps(run_dir: Path, start_step: int, reason: str) -> None:
    """A launch at ``start_step``: mark the rows of later steps in ``ledger.jsonl`` and
    ``metrics.jsonl`` (written by a previous launch past its last checkpoint) as undone."""
    ledger = ledger_view(run_dir / LEDGER_FILE)
    last_step = max((r["step"] for r in metrics_view(run_dir / METRICS_FILE)), default=-1)
    if max(ledger, default=-1) >= start_step:
        LedgerFile(run_dir).rollback(start_step, max(ledger) + 1, reason)
    if last_step > start_step:
        jsonl.append(run_dir / METRICS_FILE, rollback_record(start_step, last_step, reason), compact=True)
    elif (run_dir / METRICS_FILE).is_file():
        jsonl.append(run_dir / METRICS_FILE, {"launch": {"step": start_step, "reason": reason}, "time": time.time()},
                     compact=True)


def start_wandb(cfg: RunConfig, run_dir: Path, derived: dict, resuming: bool) -> WandbRun:
    """The run's wandb run (config: the run config and ``derived``); a resumed launch continues
    the wandb run whose id ``<run_dir>/wandb_id`` holds."""
    id_file = run_dir / WANDB_ID_FILE
    resume_id = id_file.read_text().strip() if (resuming and id_file.is_file()) else None
    wb = WandbRun(cfg.log.wandb, cfg.log.project, cfg.name, run_dir, {**cfg.to_dict(), **derived}, resume_id)
    if wb.id:
        id_file.write_text(wb.id)
    return wb


class RunRecorder:
    """Writes each finished step / evaluation round to ``metrics.jsonl`` and wandb, each trained
    step and each rollback to ``ledger.jsonl``.

    wandb steps never go back: after a rollback (or a resume from an older checkpoint) the
    training rows of steps wandb has already seen are not sent again; evaluation rows are, at the
    highest step seen.

    Args:
        run_dir: the run directory.
        wandb_run: where metrics go besides the file.
        first_step: the step this launch starts at.
        trainable_params: the drafter's trainable parameters in millions once a drafter is ready
            (logged once to the wandb config), else ``None``.
    """

    def __init__(self, run_dir: Path, wandb_run: WandbRun, first_step: int,
                 trainable_params: Callable[[], Optional[float]]):
        self.wandb = wandb_run
        self.ledger = LedgerFile(run_dir)
        self._last_logged = max(first_step - 1, last_logged_step(run_dir / METRICS_FILE))
        self._trainable_params = trainable_params
        self._params_logged = False
        self._file = jsonl.Appender(run_dir / METRICS_FILE)  # closed by close()

    def metrics(self, step: int, metrics: dict[str, Any]) -> None:
        """``on_metrics``: one step's training metrics or one evaluation round's."""
        params_m = self._trainable_params()
        if not self._params_logged and self.wandb.run is not None and params_m is not None:
            self.wandb.run.config.update({"trainable_params_M": params_m}, allow_val_change=True)
            self._params_logged = True
        if step > self._last_logged or "eval/tau" in metrics:
            self.wandb.log(metrics, max(step, self._last_logged))
            self._last_logged = max(step, self._last_logged)
        self._file.append({"step": step, "time": time.time(), **metrics})

    def trained(self, item: Any, attempt: int) -> None:
        """``on_trained``: every drafter has trained work item ``item`` (a ``WorkItem``) in ``attempt``."""
        self.ledger.trained(item.index, item.epoch, item.batches, attempt)

    def rollback(self, to_step: int, from_step: int, reason: str) -> None:
        """``on_rollback``: the steps after ``to_step`` (done up to ``from_step``) are undone."""
        self.ledger.rollback(to_step, from_step, reason)
        self._file.append(rollback_record(to_step, from_step, reason))
        self.wandb.log({"rollback/to_step": to_step, "rollback/from_step": from_step}, max(self._last_logged, 0))

    def close(self, exit_code: int) -> None:
        """Finish the wandb run with ``exit_code`` and close ``metrics.jsonl``."""
        self.wandb.finish(exit_code)
        self._file.close()
