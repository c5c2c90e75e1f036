"""The coordinator's state: one object that its components share.

The coordinator (:mod:`dflash.runtime.coordinator`) builds one :class:`CoordinatorState` and hands
it to each of its components: supervision of worker exits (:class:`dflash.runtime.restarts.Supervision`),
stopping (:class:`dflash.runtime.stopping.Stopping`) and the control commands
(:class:`dflash.runtime.commands.ControlCommands`). Whatever else a component needs (the control
socket, the cluster control, another component, a callback) is an argument of its constructor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from dflash.data.schedule import StepPlan
from dflash.runtime.assignment import Assignment
from dflash.runtime.ledger import Ledger
from dflash.runtime.run_metrics import StepMetrics
from dflash.runtime.work import WorkQueue

__all__ = ["CoordinatorConfig", "WorkerInfo", "CheckpointProgress", "CoordinatorState", "STOP_DRAIN_S",
           "CHECKPOINT_WAIT_S"]

#: After a stop request: the longest wait (s) for the issued items to finish (a target may be
#: restarting meanwhile); past it the run ends without them, at the newest checkpoint on disk.
STOP_DRAIN_S = 300.0
#: The longest wait (s) for a checkpoint write to reach the disk: the final one after a stop, or
#: one in flight when a drafter-group restart is requested.
CHECKPOINT_WAIT_S = 600.0


@dataclass(frozen=True)
class CoordinatorConfig:
    """Time limits and restart policy (s: seconds).

    Attributes:
        ready_timeout_s: the longest wait for every worker's first READY.
        peer_timeout_s: a worker silent this long is killed (``transport.peer_timeout_s``).
        max_restarts: restarts of one target, or of the drafter group, without progress in between
            before the run fails (``cluster.max_restarts``).
        restart_backoff_s: a target's first restart delay, doubled each time (``cluster.restart_backoff_s``).
        stop_drain_s: after a stop request, the longest wait for the issued items.
        checkpoint_wait_s: the longest wait for a checkpoint write to reach the disk.
    """

    ready_timeout_s: float = 1800.0
    peer_timeout_s: float = 120.0
    max_restarts: int = 3
    restart_backoff_s: float = 1.0
    stop_drain_s: float = STOP_DRAIN_S
    checkpoint_wait_s: float = CHECKPOINT_WAIT_S


@dataclass
class WorkerInfo:
    """What the coordinator knows of one worker (times: ``time.monotonic()`` seconds)."""

    name: str
    role: str
    up: bool = False  # process started and said hello
    ready: bool = False
    pid: Optional[int] = None
    #: restarts since the worker last made progress (a batch produced / a step trained)
    failures: int = 0
    restart_at: Optional[float] = None
    down_since: Optional[float] = None
    #: run by a developer in another terminal (``attach``): never restarted by the coordinator
    external: bool = False


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


@dataclass
class CoordinatorState:
    """Everything the coordinator's components read and change (times: ``time.monotonic()`` seconds).

    Attributes:
        config: time limits and restart policy.
        targets / drafters: worker names in rank order.
        plan: the global step plan (re-planned by a rollback below this launch's first step).
        item_args: the arguments that rebuild the work sequence after a rollback (``first_step`` included).
        work: the work sequence and which of its items are issued and finished.
        assignment: which target computes which job for which drafter.
        workers: ``{name: WorkerInfo}`` of every target and drafter.
        steps_done: steps the drafter group has finished (rolled back by a group restart).
        first_step: this launch's first step.
        lowest_step: the lowest step training (re)started from in this launch: ``first_step``, or
            lower after a rollback to an older checkpoint (the newer one was damaged).
        lookahead: the most unfinished items issued at once.
        checkpoints: rank 0's checkpoints written and begun.
        ledger: exactly-once accounting of the training batches.
        metrics: the record of the steps being finished.
        last_seen: ``{worker: time of its last message}``.
        attempt: drafter-group rollbacks so far (work reported for an older attempt is ignored).
        group_down_since: when the drafter group went down for a restart (None: it is up).
        restarts: ``{"worker", "seconds"}`` of every worker (or ``"drafters"``) back after a restart.
        done_rounds: evaluation rounds whose results were reported (kept across rollbacks).
        stop_reason: why the run stops (None: no stop requested).
        stop_signal: the signal number that requested the stop, if one did.
        group_lost: why the drafter group can no longer write a final checkpoint after a stop request.
        finishing: the final phase of a stop: no worker is restarted any more.
        pending_restart: a requested drafter-group restart waiting for a checkpoint write in
            flight: ``(reason, deadline)``.
    """

    config: CoordinatorConfig
    targets: list[str]
    drafters: list[str]
    plan: StepPlan
    item_args: dict
    work: WorkQueue
    assignment: Assignment
    workers: dict[str, WorkerInfo]
    steps_done: int
    first_step: int
    lowest_step: int
    lookahead: int
    checkpoints: CheckpointProgress
    ledger: Ledger = field(default_factory=Ledger)
    metrics: StepMetrics = field(default_factory=StepMetrics)
    last_seen: dict[str, float] = field(default_factory=dict)
    attempt: int = 0
    group_down_since: Optional[float] = None
    restarts: list[dict] = field(default_factory=list)
    done_rounds: set[int] = field(default_factory=set)
    stop_reason: Optional[str] = None
    stop_signal: Optional[int] = None
    group_lost: Optional[str] = None
    finishing: bool = False
    pending_restart: Optional[tuple[str, float]] = None

    def all_ready(self, names: list[str]) -> bool:
        """Every worker of ``names`` is READY."""
        return all(self.workers[n].ready for n in names)

    def unready_workers(self) -> list[str]:
        """Workers not ready now (starting, loading, restarting): they hold no state to save."""
        return [n for n, w in self.workers.items() if not w.ready]

    def live_targets(self) -> list[str]:
        """The targets READY now, in rank order."""
        return [t for t in self.targets if self.workers[t].ready]
