"""How a run stops, and the checkpoint writes a stop or a requested restart waits for.

Stopping (``stop``, SIGTERM, SIGINT; a second request is answered and changes nothing): no new
item is issued; the issued ones finish (within ``stop_drain_s``); then rank 0 writes a final
checkpoint of the newest step unless one of its checkpoints already covers it (a write in flight
is waited for, not repeated). A group that cannot write (restarting from a checkpoint, a drafter
gone, issued steps abandoned) writes nothing: the newest checkpoint on disk is then the run's
last. No worker is restarted once the final phase begins.

A requested drafter-group restart while rank 0 writes a checkpoint waits for the write (or for
rank 0's exit, or ``checkpoint_wait_s``), so the restart loses no finished write.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from dataclasses import dataclass
from typing import Optional

__all__ = ["CheckpointProgress", "StopMixin"]

log = logging.getLogger("dflash.runtime.coordinator")


@dataclass
class CheckpointProgress:
    """Rank 0's checkpoints, by step (-1: none).

    Attributes:
        written: the newest step whose checkpoint rank 0 reported on disk (written in the background).
        started: the newest step whose checkpoint rank 0 has begun to write (it trained a
            ``checkpoint`` step, or was sent ``save``); above ``written`` while a write is in flight.
    """

    written: int
    started: int

    def in_flight(self) -> Optional[int]:
        """The step of the checkpoint rank 0 is writing, or None."""
        return self.started if self.started > self.written else None


class StopMixin:
    """The coordinator's stop request, final checkpoint and checkpoint waits (see the module docstring).

    Uses the coordinator's ``config``, ``checkpoints``, ``workers``, ``drafters``, ``steps_done``,
    ``ledger``, ``plan``, ``work``, ``_tick``, ``_all_ready``, ``_send_save`` and
    ``restart_drafter_group``.
    """

    def _init_stop_state(self) -> None:
        self.stop_reason: Optional[str] = None
        self.stop_signal: Optional[int] = None
        self._stop_deadline = math.inf
        #: why the drafter group can no longer write a final checkpoint after a stop request
        self.group_lost: Optional[str] = None
        #: the final phase of a stop: no worker is restarted any more
        self.finishing = False
        #: a requested drafter-group restart waiting for a checkpoint write in flight: (reason, deadline)
        self.pending_restart: Optional[tuple[str, float]] = None

    def request_stop(self, reason: str) -> bool:
        """Stop the run (see the module docstring); False when a stop was already requested."""
        if self.stop_reason is not None:
            log.warning("stop requested again (%s): already stopping (%s)", reason, self.stop_reason)
            return False
        log.warning("stop requested (%s): finishing the issued steps (at most %.0f s), then a final checkpoint",
                    reason, self.config.stop_drain_s)
        self.stop_reason = reason
        self._stop_deadline = time.monotonic() + self.config.stop_drain_s
        if self.pending_restart is not None:
            log.info("the pending drafter group restart (%s) is dropped: the run stops", self.pending_restart[0])
            self.pending_restart = None
        return True

    def install_signal_handlers(self) -> None:
        """SIGINT / SIGTERM request a stop; a second SIGINT raises KeyboardInterrupt."""
        def handler(signum, _frame):
            if self.stop_reason is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.stop_signal = signum
            self.request_stop(signal.Signals(signum).name)

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    def serve_controls(self, timeout_s: float = 0.05) -> None:
        """After :meth:`run`: answer control commands (a second ``stop``, ``status``) while the
        launcher stops the workers; workers' messages are dropped. Waits up to ``timeout_s``."""
        from dflash.runtime.messages import Command

        got = self.sock.recv(timeout_s)
        while got is not None:
            if isinstance(got[1], Command):
                self.commands.handle(*got)
            got = self.sock.recv(0)

    def _awaiting_last_checkpoint(self) -> bool:
        """Every step is trained but the last step's checkpoint is not yet reported on disk."""
        final = self.work.final_checkpoint_step
        return self.stop_reason is None and final is not None and self.checkpoints.written < final

    def _stop_overdue(self) -> bool:
        """Stopping, with issued items left: True (the loop ends) when the group can no longer
        finish them (a drafter died) or they did not finish within ``stop_drain_s``."""
        if self.group_lost is None and time.monotonic() > self._stop_deadline:
            self.group_lost = (f"{self.work.issued_open()} issued item(s) did not finish within "
                               f"{self.config.stop_drain_s:.0f} s of the stop request")
            log.error("%s: stopping without them", self.group_lost)
        if self.group_lost is not None:
            # what the group trained past the last finished step is lost with it
            self.ledger.rollback(self.plan, self.steps_done, self.plan.total_steps)
            return True
        return False

    def _final_checkpoint(self) -> None:
        """After a stop: rank 0 writes a checkpoint of ``steps_done`` if it can and none covers it;
        a write in flight is waited for."""
        self.finishing = True
        step = self.steps_done
        if self.group_lost is None and not self._all_ready(self.drafters):
            self.group_lost = "the drafter group is restarting from a checkpoint"
        if self.group_lost is not None:
            log.warning("no final checkpoint (%s): the newest checkpoint on disk is the run's last", self.group_lost)
        elif step > self.checkpoints.started:
            log.info("writing the final checkpoint at step %d", step)
            if self._send_save(step):
                self.checkpoints.started = step
        if self.checkpoints.in_flight() is not None:
            self._wait_checkpoint(self.checkpoints.started, "the final checkpoint" if step == self.checkpoints.started
                                  else "the checkpoint being written")

    def _wait_checkpoint(self, step: int, what: str) -> bool:
        """Handle messages until checkpoint ``step`` is reported on disk (True), rank 0 exits or
        ``checkpoint_wait_s`` pass (False, logged)."""
        started = time.monotonic()
        log.info("waiting for %s (step %d) to reach the disk", what, step)
        while self.checkpoints.written < step:
            if not self.workers[self.drafters[0]].up:
                log.error("%s exited before %s (step %d) was on disk", self.drafters[0], what, step)
                return False
            if time.monotonic() - started > self.config.checkpoint_wait_s:
                log.error("%s (step %d) not on disk within %.0f s", what, step, self.config.checkpoint_wait_s)
                return False
            self._tick()
        return True

    def _restart_when_written(self) -> None:
        """A requested drafter-group restart, once no checkpoint write is in flight (or rank 0 has
        exited, or ``checkpoint_wait_s`` passed: the restart goes on from what is on disk)."""
        reason, deadline = self.pending_restart
        step = self.checkpoints.in_flight()
        if step is not None and self.workers[self.drafters[0]].up and time.monotonic() < deadline:
            return
        self.pending_restart = None
        if step is None:
            reason += f", after checkpoint step {self.checkpoints.written} was written"
        else:
            reason += f", checkpoint step {step} being written was not reported on disk"
        self.restart_drafter_group(reason)
