"""Control commands of a running cluster (``python -m launch.cluster status | stop | restart | attach``;
``attach`` sends ``detach``, then runs the worker in the foreground).

Each command is one handler in a table (command name → method); an unknown command, or one the
run's state refuses, gets a reply with ``ok: false`` and a line saying why. Every reply carries
the coordinator's status.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from dflash.runtime.control import CoordinatorSocket
from dflash.runtime.coordinator_state import CoordinatorState
from dflash.runtime.messages import Command, CommandReply
from dflash.runtime.restarts import ClusterControl, Supervision
from dflash.runtime.stopping import Stopping

__all__ = ["ControlCommands"]

log = logging.getLogger(__name__)


class ControlCommands:
    """The command table of one coordinator.

    Args:
        state: the coordinator's state the commands read and change (workers, checkpoints, stop state).
        sock: the control socket the replies go out on.
        control: kills worker processes (``restart`` / ``detach``).
        supervision: takes a target down, restarts the drafter group.
        stopping: the stop request.
        status: the run's status, carried by every reply.
    """

    def __init__(self, state: CoordinatorState, sock: CoordinatorSocket, control: ClusterControl,
                 supervision: Supervision, stopping: Stopping, status: Callable[[], dict]) -> None:
        self.state = state
        self.sock = sock
        self.control = control
        self.supervision = supervision
        self.stopping = stopping
        self.run_status = status
        self.table: dict[str, Callable[[dict], str]] = {
            "status": self.status,
            "stop": self.stop,
            "restart": lambda args: self.restart_or_detach("restart", args),
            "detach": lambda args: self.restart_or_detach("detach", args),
        }

    def handle(self, client: str, msg: Command) -> None:
        """Run ``msg.cmd`` and send ``client`` the reply (``ok``, a line of text, the status)."""
        handler = self.table.get(msg.cmd)
        try:
            if handler is None:
                raise ValueError(f"unknown command {msg.cmd!r} (known: {', '.join(sorted(self.table))})")
            ok, text = True, handler(msg.args or {})
        except ValueError as exc:
            ok, text = False, str(exc)
        self.sock.send(client, CommandReply(ok=ok, text=text, data=self.run_status()))

    def status(self, args: dict) -> str:
        return "ok"

    def stop(self, args: dict) -> str:
        s = self.state
        if s.stop_reason is None and s.finishing:
            return "the run is ending: its workers are stopping"
        if self.stopping.request_stop("requested by `launch.cluster stop`"):
            return "stopping after the issued steps, with a final checkpoint"
        return f"already stopping ({s.stop_reason})"

    def restart_or_detach(self, cmd: str, args: dict) -> str:
        """``restart``: the worker (or the drafter group) restarts; ``detach``: it is killed and left
        to a developer to ``attach`` in another terminal.

        Raises:
            ValueError: the run is stopping, or no such worker.
        """
        s = self.state
        worker = args.get("worker", "")
        if s.stop_reason is not None or s.finishing:
            phase = f"stopping ({s.stop_reason})" if s.stop_reason else "ending"
            raise ValueError(f"the run is {phase}: no {cmd}")
        if worker == "drafters" or worker.startswith("drafter."):
            return self._drafter_group(cmd, worker)
        if worker not in s.workers:
            raise ValueError(f"no worker {worker!r} (known: {sorted(s.workers)} or 'drafters')")
        w = s.workers[worker]
        w.external = cmd == "detach"
        if not w.external:
            w.restart_at = time.monotonic()  # restart right after it exits
        self.control.kill(worker)
        if not w.up:  # already down: nothing will exit
            self.supervision.target_down(worker)
        return f"{worker} {'detached' if w.external else 'restarting'}"

    def _drafter_group(self, cmd: str, worker: str) -> str:
        s = self.state
        if worker.startswith("drafter.") and worker not in s.workers:
            raise ValueError(f"no worker {worker!r}")
        if cmd == "detach":
            s.workers[worker].external = True
        elif worker in s.workers:
            s.workers[worker].external = False
        in_flight = s.checkpoints.in_flight() if cmd == "restart" else None
        if in_flight is not None:  # restarting now would lose the write: wait for it
            s.pending_restart = (f"{cmd} {worker} requested", time.monotonic() + s.config.checkpoint_wait_s)
            log.info("%s %s requested: the drafter group restarts once checkpoint step %d, being written, is on "
                     "disk", cmd, worker, in_flight)
            return f"drafter group restarting once checkpoint step {in_flight}, being written, is on disk"
        self.supervision.restart_drafter_group(f"{cmd} {worker} requested")
        return f"drafter group restarting from the last checkpoint (step {s.steps_done})"
