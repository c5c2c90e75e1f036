"""Control commands of a running cluster (``python -m launch.cluster status | stop | restart | attach``;
``attach`` sends ``detach``, then runs the worker in the foreground).

Each command is one handler in a table (command name → method); an unknown command, or one the
run's state refuses, gets a reply with ``ok: false`` and a line saying why. Every reply carries
the coordinator's status.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from dflash.runtime.messages import Command, CommandReply

if TYPE_CHECKING:
    from dflash.runtime.coordinator import Coordinator

__all__ = ["ControlCommands"]

log = logging.getLogger(__name__)


class ControlCommands:
    """The command table of one coordinator.

    Args:
        coordinator: the run the commands act on.
    """

    def __init__(self, coordinator: "Coordinator"):
        self.c = coordinator
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
        self.c.sock.send(client, CommandReply(ok=ok, text=text, data=self.c.status()))

    def status(self, args: dict) -> str:
        return "ok"

    def stop(self, args: dict) -> str:
        c = self.c
        if c.stop_reason is None and c.finishing:
            return "the run is ending: its workers are stopping"
        if c.request_stop("requested by `launch.cluster stop`"):
            return "stopping after the issued steps, with a final checkpoint"
        return f"already stopping ({c.stop_reason})"

    def restart_or_detach(self, cmd: str, args: dict) -> str:
        """``restart``: the worker (or the drafter group) restarts; ``detach``: it is killed and left
        to a developer to ``attach`` in another terminal.

        Raises:
            ValueError: the run is stopping, or no such worker.
        """
        c = self.c
        worker = args.get("worker", "")
        if c.stop_reason is not None or c.finishing:
            state = f"stopping ({c.stop_reason})" if c.stop_reason else "ending"
            raise ValueError(f"the run is {state}: no {cmd}")
        if worker == "drafters" or worker.startswith("drafter."):
            return self._drafter_group(cmd, worker)
        if worker not in c.workers:
            raise ValueError(f"no worker {worker!r} (known: {sorted(c.workers)} or 'drafters')")
        w = c.workers[worker]
        w.external = cmd == "detach"
        if not w.external:
            w.restart_at = time.monotonic()  # restart right after it exits
        c.control.kill(worker)
        if not w.up:  # already down: nothing will exit
            c.target_down(worker)
        return f"{worker} {'detached' if w.external else 'restarting'}"

    def _drafter_group(self, cmd: str, worker: str) -> str:
        c = self.c
        if worker.startswith("drafter.") and worker not in c.workers:
            raise ValueError(f"no worker {worker!r}")
        if cmd == "detach":
            c.workers[worker].external = True
        elif worker in c.workers:
            c.workers[worker].external = False
        in_flight = c.checkpoints.in_flight() if cmd == "restart" else None
        if in_flight is not None:  # restarting now would lose the write: wait for it
            c.pending_restart = (f"{cmd} {worker} requested", time.monotonic() + c.config.checkpoint_wait_s)
            log.info("%s %s requested: the drafter group restarts once checkpoint step %d, being written, is on "
                     "disk", cmd, worker, in_flight)
            return f"drafter group restarting once checkpoint step {in_flight}, being written, is on disk"
        c.restart_drafter_group(f"{cmd} {worker} requested")
        return f"drafter group restarting from the last checkpoint (step {c.steps_done})"
