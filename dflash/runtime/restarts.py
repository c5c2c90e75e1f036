"""Restart policy: what the coordinator does when a worker process exits.

* A **target** is restarted alone, after a back-off of ``restart_backoff_s · 2^(n−1)`` for its
  n-th consecutive failure; past ``max_restarts`` failures without progress (a batch produced)
  the run fails. Its jobs not yet received go to the other targets meanwhile.
* A **drafter** takes the whole drafter group down (they train one model together): every
  drafter restarts from the newest checkpoint on disk (the ledger rolls back to it); past
  ``max_restarts`` group failures without progress (a step trained) the run fails.
* A worker attached by a developer (``attach``) is never restarted by the coordinator.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Optional, Protocol

from dflash.runtime.control import CoordinatorSocket
from dflash.runtime.coordinator_state import CoordinatorState, WorkerInfo
from dflash.runtime.messages import Flush
from dflash.runtime.work import WorkQueue, build_work_items
from dflash.training.checkpoint_load import CheckpointError, read_state

__all__ = ["RunFailed", "RestartPolicy", "ClusterControl", "Supervision", "rollback_checkpoint"]

log = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """The run cannot go on (a worker failed too often, no checkpoint to restart from, not ready in time)."""


class ClusterControl(Protocol):
    """What the coordinator needs from the launcher to (re)start and stop worker processes."""

    def restart(self, name: str, resume_from: Optional[Path]) -> None: ...

    def kill(self, name: str) -> None: ...

    def exited(self) -> list[str]: ...

    def pid(self, name: str) -> Optional[int]: ...

    def report(self, name: str) -> str: ...

    def new_drafter_group(self) -> None: ...

    def latest_checkpoint(self) -> Optional[Path]: ...


class RestartPolicy:
    """Failure counts and back-off.

    Args:
        max_restarts: restarts of one target, or of the drafter group, without progress in
            between before the run fails.
        backoff_s: a target's first restart delay (s), doubled at each further failure.
    """

    def __init__(self, max_restarts: int, backoff_s: float):
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        #: drafter-group restarts since the group last trained a step
        self.drafter_failures = 0

    def target_failed(self, w: WorkerInfo, report: str) -> float:
        """Count a failure of target ``w``; the delay (s) before its restart.

        Raises:
            RunFailed: more than ``max_restarts`` failures in a row.
        """
        w.failures += 1
        if w.failures > self.max_restarts:
            raise RunFailed(f"{w.name} failed {w.failures} times in a row; giving up.\n{report}")
        delay = self.backoff_s * 2 ** (w.failures - 1)
        log.error("%s died; restarting it in %.1f s (attempt %d of %d).\n%s", w.name, delay, w.failures,
                  self.max_restarts, report)
        return delay

    def drafter_failed(self, name: str, report: str) -> None:
        """Count a failure of the drafter group (``name`` died).

        Raises:
            RunFailed: more than ``max_restarts`` group failures in a row.
        """
        self.drafter_failures += 1
        if self.drafter_failures > self.max_restarts:
            raise RunFailed(f"{name} failed; the drafter group failed {self.drafter_failures} times in a row; "
                            f"giving up.\n{report}")
        log.error("%s died: restarting the drafter group from the last checkpoint (attempt %d of %d).\n%s",
                  name, self.drafter_failures, self.max_restarts, report)


def rollback_checkpoint(control: ClusterControl, first_step: int) -> tuple[Optional[Path], dict]:
    """The checkpoint a drafter-group restart resumes from and its ``state.json`` (``{"step":
    first_step}`` with no checkpoint on disk: the launch's initial weights).

    Raises:
        RunFailed: the newest checkpoint cannot be read, or none is left while this launch resumed
            at ``first_step > 0`` (its weights cannot be rebuilt).
    """
    try:
        ckpt = control.latest_checkpoint()  # verified: damaged ones are moved aside
    except (CheckpointError, PermissionError) as exc:
        raise RunFailed(f"the drafter group cannot restart: {exc}") from exc
    if ckpt is None and first_step > 0:
        raise RunFailed(f"the drafter group cannot restart: no usable checkpoint is left in the run directory "
                        f"(damaged ones are moved aside to step-*.damaged) and this launch resumed at step "
                        f"{first_step}, so its weights cannot be rebuilt")
    return ckpt, (read_state(ckpt) if ckpt is not None else {"step": first_step})


class Supervision:
    """The coordinator's side of worker exits: silent workers killed, exits handled by the policy
    (module docstring), scheduled restarts started, drafter-group rollbacks.

    Args:
        state: the coordinator's state (workers, plan, ledger, work sequence, checkpoints, stop state).
        control: starts / kills worker processes.
        sock: the control socket (a drafter-group restart sends ``flush`` to every target).
        policy: failure counts and back-off.
        on_rollback: called with ``(to_step, from_step, reason)`` when a drafter-group restart
            undoes steps ``to_step …``.
    """

    def __init__(self, state: CoordinatorState, control: ClusterControl, sock: CoordinatorSocket,
                 policy: RestartPolicy, on_rollback: Optional[Callable[[int, int, str], None]] = None) -> None:
        self.state = state
        self.control = control
        self.sock = sock
        self.policy = policy
        self.on_rollback = on_rollback

    def supervise(self) -> None:
        """Handle the workers that exited, kill the silent ones, start the restarts that are due.

        Raises:
            RunFailed: a target, or the drafter group, failed more than ``max_restarts`` times in a row.
        """
        s = self.state
        now = time.monotonic()
        for name in self.control.exited():
            self.on_exit(name, self.control.report(name))
        for name, seen in list(s.last_seen.items()):
            w = s.workers.get(name)
            if w is not None and w.up and now - seen > s.config.peer_timeout_s:
                log.error("%s sent nothing for %.0f s (transport.peer_timeout_s): killing it", name, now - seen)
                s.last_seen.pop(name)
                self.control.kill(name)
        for w in s.workers.values():
            if w.restart_at is not None and now >= w.restart_at and not s.finishing:
                w.restart_at = None
                self.control.restart(w.name, None)

    def on_exit(self, name: str, report: str) -> None:
        """Worker ``name`` exited (``report``: its exit and the tail of its log).

        Raises:
            RunFailed: it failed too often (:class:`RestartPolicy`), or the drafter group cannot restart.
        """
        s = self.state
        w = s.workers[name]
        w.up = w.ready = False
        s.last_seen.pop(name, None)
        if w.external:
            log.warning("attached worker %s exited; `python -m launch.cluster restart %s` hands it back", name, name)
            if w.role == "target":
                self.target_down(name)
        elif w.role == "target":
            self.target_down(name)
            if s.finishing:
                log.warning("%s exited while the run stops: not restarted.\n%s", name, report)
            elif w.restart_at is None:  # not a requested restart (already scheduled)
                w.restart_at = time.monotonic() + self.policy.target_failed(w, report)
        elif self.control.pid(name) is None:
            # (a pid means an earlier process of this name, already replaced by a group restart:
            # several drafters die together when one does; a restarted one that dies has no pid)
            self._drafter_exited(name, report)

    def _drafter_exited(self, name: str, report: str) -> None:
        s = self.state
        if s.stop_reason is not None:
            for n in s.drafters:
                s.workers[n].ready = False
            if s.group_lost is None:
                s.group_lost = f"{name} exited while the run stops"
                log.error("%s: the drafter group is not restarted; the run ends at its newest checkpoint on "
                          "disk.\n%s", s.group_lost, report)
            return
        self.policy.drafter_failed(name, report)
        self.restart_drafter_group(f"{name} died")

    def target_down(self, name: str) -> None:
        """Target ``name`` is down: its jobs not yet received go to the other targets."""
        s = self.state
        s.workers[name].down_since = time.monotonic()
        moved = s.assignment.target_down(name)
        if moved:
            log.warning("%s is down: re-assigning its %d batch(es) not yet taken by a drafter", name, moved)

    def restart_drafter_group(self, reason: str) -> None:
        """Kill every drafter, roll the ledger back to the newest checkpoint, restart them from it.

        Raises:
            RunFailed: no checkpoint to restart from (:func:`rollback_checkpoint`).
        """
        s = self.state
        s.group_down_since = time.monotonic()
        for name in s.drafters:
            s.workers[name].ready = False
            if s.workers[name].up and not s.workers[name].external:
                self.control.kill(name)
        ckpt, ckpt_state = rollback_checkpoint(self.control, s.first_step)
        step = ckpt_state["step"]
        s.lowest_step = min(s.lowest_step, step)
        lost_until = s.steps_done + s.lookahead + 1
        s.ledger.rollback(s.plan, max(step, s.plan.start_step), min(s.plan.total_steps, lost_until))
        if step < s.plan.start_step:  # an older checkpoint than this launch's first: its own data position
            from dflash.training.resume import checkpoint_position

            position = checkpoint_position(ckpt_state, s.plan.batches_per_epoch, s.plan.num_drafters)
            s.plan = s.plan.resumed(step, position)
        source = (f"{ckpt}, the newest checkpoint on disk" if ckpt is not None
                  else "no checkpoint on disk yet: the initial weights")
        log.warning("drafter group restart (%s): rolling back from step %d to step %d (%s)", reason,
                    s.steps_done, step, source)
        s.pending_restart = None
        s.checkpoints.written = s.checkpoints.started = step if ckpt is not None else -1
        if self.on_rollback is not None:
            self.on_rollback(step, s.steps_done, reason)
        s.steps_done = step
        s.attempt += 1
        s.assignment.clear()
        s.metrics.forget_steps()
        for t in s.targets:
            self.sock.send(t, Flush(drafters=s.drafters))
        args = dict(s.item_args)
        first_step = args.pop("first_step", None)
        # the evaluation at the checkpoint's step runs again unless it completed before the rollback:
        # a scheduled one, or this launch's baseline (eval_at_start) when rolling back to the start
        s.work = WorkQueue(build_work_items(s.plan, step, eval_at_start=step == first_step,
                                            done_rounds=s.done_rounds, **args))
        self.control.new_drafter_group()
        for name in s.drafters:
            if not s.workers[name].external:
                self.control.restart(name, ckpt)
