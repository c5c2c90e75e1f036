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
from typing import Callable

from dflash.runtime.control import CoordinatorSocket
from dflash.runtime.coordinator_state import CoordinatorState
from dflash.runtime.messages import Save
from dflash.runtime.restarts import Supervision

__all__ = ["Stopping"]

log = logging.getLogger("dflash.runtime.coordinator")


class Stopping:
    """The coordinator's stop request, final checkpoint and checkpoint waits (see the module docstring).

    Args:
        state: the coordinator's state (checkpoints, workers, work sequence, ledger, stop state).
        sock: the control socket (``save`` to rank 0 for the final checkpoint).
        supervision: restarts the drafter group once a checkpoint write it waited for is done.
        tick: one round of the coordinator's supervision and message handling (the waits here
            go on handling messages).
    """

    def __init__(self, state: CoordinatorState, sock: CoordinatorSocket, supervision: Supervision,
                 tick: Callable[[], None]) -> None:
        self.state = state
        self.sock = sock
        self.supervision = supervision
        self.tick = tick
        self._deadline = math.inf

    def request_stop(self, reason: str) -> bool:
        """Stop the run (see the module docstring); False when a stop was already requested."""
        s = self.state
        if s.stop_reason is not None:
            log.warning("stop requested again (%s): already stopping (%s)", reason, s.stop_reason)
            return False
        log.warning("stop requested (%s): finishing the issued steps (at most %.0f s), then a final checkpoint",
                    reason, s.config.stop_drain_s)
        s.stop_reason = reason
        self._deadline = time.monotonic() + s.config.stop_drain_s
        if s.pending_restart is not None:
            log.info("the pending drafter group restart (%s) is dropped: the run stops", s.pending_restart[0])
            s.pending_restart = None
        return True

    def install_signal_handlers(self) -> None:
        """SIGINT / SIGTERM request a stop; a second SIGINT raises KeyboardInterrupt."""
        def handler(signum, _frame):
            if self.state.stop_reason is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.state.stop_signal = signum
            self.request_stop(signal.Signals(signum).name)

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    def awaiting_last_checkpoint(self) -> bool:
        """Every step is trained but the last step's checkpoint is not yet reported on disk."""
        s = self.state
        final = s.work.final_checkpoint_step
        return s.stop_reason is None and final is not None and s.checkpoints.written < final

    def overdue(self) -> bool:
        """Stopping, with issued items left: True (the loop ends) when the group can no longer
        finish them (a drafter died) or they did not finish within ``stop_drain_s``."""
        s = self.state
        if s.group_lost is None and time.monotonic() > self._deadline:
            s.group_lost = (f"{s.work.issued_open()} issued item(s) did not finish within "
                            f"{s.config.stop_drain_s:.0f} s of the stop request")
            log.error("%s: stopping without them", s.group_lost)
        if s.group_lost is not None:
            # what the group trained past the last finished step is lost with it
            s.ledger.rollback(s.plan, s.steps_done, s.plan.total_steps)
            return True
        return False

    def final_checkpoint(self) -> None:
        """After a stop: rank 0 writes a checkpoint of ``steps_done`` if it can and none covers it;
        a write in flight is waited for."""
        s = self.state
        s.finishing = True
        step = s.steps_done
        if s.group_lost is None and not s.all_ready(s.drafters):
            s.group_lost = "the drafter group is restarting from a checkpoint"
        if s.group_lost is not None:
            log.warning("no final checkpoint (%s): the newest checkpoint on disk is the run's last", s.group_lost)
        elif step > s.checkpoints.started:
            log.info("writing the final checkpoint at step %d", step)
            if self.sock.send(s.drafters[0], Save(step=step)):
                s.checkpoints.started = step
        if s.checkpoints.in_flight() is not None:
            self.wait_checkpoint(s.checkpoints.started, "the final checkpoint" if step == s.checkpoints.started
                                 else "the checkpoint being written")

    def wait_checkpoint(self, step: int, what: str) -> bool:
        """Handle messages until checkpoint ``step`` is reported on disk (True), rank 0 exits or
        ``checkpoint_wait_s`` pass (False, logged)."""
        s = self.state
        started = time.monotonic()
        log.info("waiting for %s (step %d) to reach the disk", what, step)
        while s.checkpoints.written < step:
            if not s.workers[s.drafters[0]].up:
                log.error("%s exited before %s (step %d) was on disk", s.drafters[0], what, step)
                return False
            if time.monotonic() - started > s.config.checkpoint_wait_s:
                log.error("%s (step %d) not on disk within %.0f s", what, step, s.config.checkpoint_wait_s)
                return False
            self.tick()
        return True

    def restart_when_written(self) -> None:
        """A requested drafter-group restart, once no checkpoint write is in flight (or rank 0 has
        exited, or ``checkpoint_wait_s`` passed: the restart goes on from what is on disk)."""
        s = self.state
        reason, deadline = s.pending_restart
        step = s.checkpoints.in_flight()
        if step is not None and s.workers[s.drafters[0]].up and time.monotonic() < deadline:
            return
        s.pending_restart = None
        if step is None:
            reason += f", after checkpoint step {s.checkpoints.written} was written"
        else:
            reason += f", checkpoint step {step} being written was not reported on disk"
        self.supervision.restart_drafter_group(reason)
