"""Run metrics: a live console line with ETA, and a wandb run (offline without an API key).

Only the coordinator (in the launcher process) writes metrics; workers send theirs over the
control plane.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from tqdm import tqdm

__all__ = ["WandbRun", "ProgressLine", "format_duration"]

log = logging.getLogger(__name__)


def format_duration(seconds: float) -> str:
    """``3725`` → ``1:02:05``; non-finite → ``?``."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:d}:{s:02d}"


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


class ProgressLine:
    """One console line: step/total, epoch, tokens/s per stage, loss, τ, queue depth, memory, ETA.

    On a terminal it is a live tqdm bar kept below the forwarded log lines; otherwise a log
    line every ``every`` steps.
    """

    def __init__(self, total_steps: int, start_step: int = 0, every: int = 10):
        self.total = total_steps
        self.start_step = start_step
        self.every = max(1, every)
        self.started = time.monotonic()
        self._first: Optional[tuple[int, float]] = None
        self.tty = sys.stderr.isatty()
        self.bar = tqdm(total=total_steps, initial=start_step, dynamic_ncols=True, file=sys.stderr,
                        bar_format="{n_fmt}/{total_fmt} {postfix}", disable=not self.tty) if self.tty else None
        self.last_text = ""

    def write(self, line: str) -> None:
        """Print a log line without breaking the live bar."""
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def eta(self, step_done: int) -> float:
        """Seconds left at the rate since the first reported step (start-up and the first
        evaluation, which come before it, do not count); ``nan`` before two reports."""
        now = time.monotonic()
        if self._first is None:
            self._first = (step_done, now)
        first_step, first_t = self._first
        done = step_done - first_step
        if done <= 0:
            return float("nan")
        return (now - first_t) / done * (self.total - step_done)

    def update(self, step_done: int, text: str) -> None:
        """``step_done`` optimizer steps are finished; ``text`` is the rest of the line."""
        line = f"step {step_done}/{self.total} {text} | eta {format_duration(self.eta(step_done))}"
        self.last_text = line
        if self.bar is not None:
            self.bar.n = step_done
            self.bar.set_postfix_str(line, refresh=True)
        elif step_done % self.every == 0 or step_done == self.total:
            log.info("%s", line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
