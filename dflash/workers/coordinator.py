"""The coordinator: epochs, batch order, assignment of batch ids, the ledger, metrics.

It runs in the launcher's main thread (one loop) and talks to the workers over
:mod:`dflash.workers.control`. It never touches tensors: a batch is a deterministic function of
(split, epoch, batch id), so the ledger holds ids only and any target can (re)compute any batch.

The work is a sequence of items, identical for every drafter rank:
``eval 0, step 0 … step k, eval 1, step k+1 …, final eval``; an evaluation round's number is a
function of its step (:func:`eval_round`), the same in a fresh, resumed or rolled-back run. Item i
is issued (``produce`` to a target for each of its batches, ``train``/``evaluate`` to every drafter)
once every drafter is READY and at most ``lookahead`` items are unfinished, so targets fill slots
ahead of the drafters while slot credits bound memory.
"""

from __future__ import annotations

import collections
import logging
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Optional, Protocol

from dflash.checkpoint import CheckpointError, read_state
from dflash.schedule import StepPlan
from dflash.workers.control import CoordinatorSocket

__all__ = ["WorkItem", "Ledger", "Coordinator", "CoordinatorResult", "ClusterControl", "build_work_items",
           "eval_round"]

log = logging.getLogger(__name__)

POLL_S = 0.2
#: After a stop request: the longest wait (s) for the issued items to finish (a target may be
#: restarting meanwhile); past it the run ends without them, at the newest checkpoint on disk.
STOP_DRAIN_S = 300.0
#: The longest wait (s) for a checkpoint write to reach the disk: the final one after a stop, or
#: one in flight when a drafter-group restart is requested.
CHECKPOINT_WAIT_S = 600.0


@dataclass
class WorkItem:
    """One item of the drafters' common work sequence."""

    kind: str  # "train" | "eval"
    index: int  # the global step (train) or the eval round (eval: :func:`eval_round`, or -step off-schedule)
    epoch: int = 0
    #: train: one batch id (or None) per drafter rank; eval: a list of held-out ids per rank.
    batches: list[Any] = field(default_factory=list)
    checkpoint: bool = False
    #: optimizer steps done when an eval item runs.
    at_step: int = 0


def eval_round(step: int, total_steps: int, eval_every: int) -> Optional[int]:
    """The round number of the evaluation at ``step`` in the run's schedule, or None off the schedule.

    The schedule's evaluation points are step 0 (the run's fresh start), every ``eval_every``
    steps (``eval_every > 0``) and the last step ``total_steps``; a point's round is its index
    among them (``0, 1, 2, …``). It depends on the step alone, so a fresh run, a ``--resume`` and a
    drafter-group rollback give the same step the same round (only the final evaluation's round
    depends on ``total_steps``, i.e. on ``train.max_steps``).
    """
    if step == 0:
        return 0
    if not 0 < step <= total_steps:
        return None
    if eval_every > 0:
        if step % eval_every == 0:
            return step // eval_every
        return step // eval_every + 1 if step == total_steps else None
    return 1 if step == total_steps else None


def build_work_items(plan: StepPlan, start_step: int, heldout_batches: int, eval_every: int,
                     checkpoint_every: int, eval_batches: Optional[int] = None, eval_at_start: bool = True,
                     done_rounds: Collection[int] = ()) -> list[WorkItem]:
    """The common work sequence from ``start_step`` to the end of the plan.

    Evaluation rounds run at the schedule's evaluation points (see :func:`eval_round`: step 0,
    every ``eval_every`` steps and the last step) and are numbered by it; each round spreads
    ``min(heldout_batches, eval_batches)`` held-out batches over the drafter ranks round-robin.
    Checkpoints every ``checkpoint_every`` steps and at the last step.

    At ``start_step`` itself:

    * ``eval_at_start=True`` (the launcher: a fresh run or ``--resume``): a baseline evaluation
      of the starting weights. At an evaluation point it is that point's round (after a resume
      possibly a second time: the previous launch may have completed it); off the schedule
      (a resume from a checkpoint at a step ``k`` that is no evaluation point, e.g. with
      ``checkpoint.every`` not a multiple of ``eval_every`` or after a stop) it is an extra,
      off-schedule round numbered ``-k`` (negative: it collides with no scheduled round, and
      ``-round`` is its step; ``eval/step`` in the metrics says the same).
    * ``eval_at_start=False`` (a drafter-group rollback to a checkpoint at ``start_step``): an
      evaluation only if ``start_step`` is an evaluation point (its scheduled round).

    Either way the start evaluation is left out when its round is in ``done_rounds`` (rounds
    already completed, on the same weights, before a rollback). Evaluations after ``start_step``
    are always part of the sequence: after a rollback they run again on the retrained weights,
    under the same round numbers.
    """
    d = plan.num_drafters
    total = plan.total_steps
    n_eval = heldout_batches if eval_batches is None else min(heldout_batches, eval_batches)
    eval_ids = [[b for b in range(n_eval) if b % d == r] for r in range(d)]
    items: list[WorkItem] = []

    def add_eval(at_step: int, rnd: int) -> None:
        if n_eval > 0:
            items.append(WorkItem("eval", rnd, epoch=0, batches=eval_ids, at_step=at_step))

    if start_step < total:
        rnd = eval_round(start_step, total, eval_every)
        if rnd is None and eval_at_start:
            rnd = -start_step  # off-schedule baseline (start_step > 0: step 0 is always on the schedule)
        if rnd is not None and rnd not in done_rounds:
            add_eval(start_step, rnd)
    for step in range(start_step, total):
        a = plan.assignment(step)
        done = step + 1
        ckpt = done == total or (checkpoint_every > 0 and done % checkpoint_every == 0)
        items.append(WorkItem("train", step, epoch=a.epoch, batches=list(a.batch_ids), checkpoint=ckpt, at_step=step))
        rnd = eval_round(done, total, eval_every)
        if rnd is not None:
            add_eval(done, rnd)
    return items


class Ledger:
    """Exactly-once accounting of training batches: ``(epoch, batch_id) → times trained``."""

    def __init__(self) -> None:
        self.trained: dict[tuple[int, int], int] = {}
        self.produced: dict[tuple[str, int, int], int] = {}

    def mark_produced(self, split: str, epoch: int, batch_id: int) -> None:
        key = (split, epoch, batch_id)
        self.produced[key] = self.produced.get(key, 0) + 1

    def mark_trained(self, epoch: int, batch_id: int) -> None:
        key = (epoch, batch_id)
        self.trained[key] = self.trained.get(key, 0) + 1
        if self.trained[key] > 1:
            log.error("ledger: batch %d of epoch %d trained %d times", batch_id, epoch, self.trained[key])

    def rollback(self, plan: StepPlan, from_step: int, to_step: int) -> None:
        """Forget the training of steps ``[from_step, to_step)`` (a drafter rollback to a checkpoint)."""
        for step in range(from_step, min(to_step, plan.total_steps)):
            a = plan.assignment(step)
            for b in a.batch_ids:
                if b is not None:
                    self.trained.pop((a.epoch, b), None)

    def check(self, plan: StepPlan, start_step: int, end_step: int) -> list[str]:
        """Problems with steps ``[start_step, end_step)``: batches missing or trained more than once."""
        expected = set()
        for step in range(start_step, end_step):
            a = plan.assignment(step)
            expected.update((a.epoch, b) for b in a.batch_ids if b is not None)
        problems = [f"epoch {e} batch {b} never trained" for (e, b) in sorted(expected - set(self.trained))]
        problems += [f"epoch {e} batch {b} trained {n} times" for (e, b), n in sorted(self.trained.items()) if n != 1]
        problems += [f"epoch {e} batch {b} trained but not planned" for (e, b) in sorted(set(self.trained) - expected)]
        return problems


@dataclass
class CoordinatorResult:
    exit_code: int
    steps_done: int
    final_eval: Optional[dict] = None
    first_eval: Optional[dict] = None
    ledger_problems: list[str] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)


class ClusterControl(Protocol):
    """What the coordinator needs from the launcher to (re)start and stop worker processes."""

    def restart(self, name: str, resume_from: Optional[Path]) -> None: ...

    def kill(self, name: str) -> None: ...

    def exited(self) -> list[str]: ...

    def pid(self, name: str) -> Optional[int]: ...

    def report(self, name: str) -> str: ...

    def new_drafter_group(self) -> None: ...

    def latest_checkpoint(self) -> Optional[Path]: ...


@dataclass
class Job:
    """One batch handed to a target for one drafter, until the drafter has taken its slot."""

    key: str
    split: str
    epoch: int
    batch_id: int
    drafter: str
    target: Optional[str] = None
    received: bool = False


@dataclass
class WorkerInfo:
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


class Coordinator:
    """Drives one run from READY to the last checkpoint, through worker failures and restarts.

    Args:
        socket: the bound control socket.
        targets / drafters: worker names (``target.0`` …, ``drafter.0`` … in rank order).
        endpoints: ``{target name: slot-ring endpoint}`` (stable across target restarts).
        plan: global step plan; ``start_step``: steps already done (resume).
        items: the work sequence (:func:`build_work_items`).
        item_args: the arguments of :func:`build_work_items` besides plan / start step (to
            rebuild the sequence after a drafter rollback).
        slots_per_target: transport slots of each target (bounds the look-ahead).
        control: starts / kills worker processes (:class:`ClusterControl`).
        on_metrics: called with ``(step, metrics)`` for every finished step / eval round.
        on_progress: called with ``(steps_done, text)`` for the console line.
        max_restarts: restarts of one worker (a target, or the drafter group) without progress
            in between before the run fails; ``restart_backoff_s``: first delay, doubled each time.
        stop_drain_s: after a stop request, the longest wait for the issued items (s).
        checkpoint_wait_s: the longest wait for a checkpoint write to reach the disk (s).
        on_trained: called with ``(train item, attempt)`` when every drafter has trained a step
            (the launcher appends it to ``ledger.jsonl``).
        on_rollback: called with ``(to_step, from_step, reason)`` when a drafter-group restart
            undoes steps ``to_step …`` (the launcher marks it in the ledger and the metrics).

    Stopping (``stop``, SIGTERM, SIGINT; a second request is answered and changes nothing): no
    new item is issued; the issued ones finish (within ``stop_drain_s``); then rank 0 writes a
    final checkpoint of the newest step unless one of its checkpoints already covers it (a write
    in flight is waited for, not repeated). A group that cannot write (restarting from a
    checkpoint, a drafter gone, issued steps abandoned) writes nothing: the newest checkpoint on
    disk is then the run's last. No worker is restarted once the final phase begins.
    """

    def __init__(self, socket: CoordinatorSocket, targets: list[str], drafters: list[str],
                 endpoints: dict[str, str], plan: StepPlan, start_step: int, items: list[WorkItem],
                 item_args: dict, slots_per_target: int, control: ClusterControl,
                 on_metrics: Callable[[int, dict], None], on_progress: Callable[[int, str], None],
                 ready_timeout_s: float = 1800.0, peer_timeout_s: float = 120.0, max_restarts: int = 3,
                 restart_backoff_s: float = 1.0, stop_drain_s: float = STOP_DRAIN_S,
                 checkpoint_wait_s: float = CHECKPOINT_WAIT_S,
                 on_trained: Optional[Callable[[WorkItem, int], None]] = None,
                 on_rollback: Optional[Callable[[int, int, str], None]] = None):
        self.sock = socket
        self.targets = targets
        self.drafters = drafters
        self.endpoints = endpoints
        self.plan = plan
        self.item_args = item_args
        #: the lowest step training (re)started from in this launch: its first step, or lower after
        #: a rollback to an older checkpoint (the newer one was damaged)
        self.first_step = item_args.get("first_step") or 0
        self.lowest_step = self.first_step
        self.lookahead = max(2, math.ceil(len(targets) * slots_per_target / max(1, len(drafters))))
        self.control = control
        self.on_metrics = on_metrics
        self.on_progress = on_progress
        self.on_trained = on_trained
        self.on_rollback = on_rollback
        self.ready_timeout_s = ready_timeout_s
        self.peer_timeout_s = peer_timeout_s
        self.max_restarts = max_restarts
        self.restart_backoff_s = restart_backoff_s
        self.stop_drain_s = stop_drain_s
        self.checkpoint_wait_s = checkpoint_wait_s
        self.workers = {n: WorkerInfo(n, "target") for n in targets}
        self.workers.update({n: WorkerInfo(n, "drafter") for n in drafters})
        self.last_seen: dict[str, float] = {}
        self.ledger = Ledger()
        #: newest step whose checkpoint rank 0 reported on disk (checkpoints are written in the
        #: background); a launch that resumed starts from a checkpoint of its first step
        self.checkpointed_step = start_step if start_step > 0 else -1
        #: newest step whose checkpoint rank 0 has begun to write (it trained a ``checkpoint``
        #: step, or was sent ``save``); above ``checkpointed_step`` while a write is in flight
        self.checkpoint_started = self.checkpointed_step
        self.stop_reason: Optional[str] = None
        self.stop_signal: Optional[int] = None
        self._stop_deadline = math.inf
        #: why the drafter group can no longer write a final checkpoint after a stop request
        self.group_lost: Optional[str] = None
        #: the final phase of a stop: no worker is restarted any more
        self._finishing = False
        #: a requested drafter-group restart waiting for a checkpoint write in flight: (reason, deadline)
        self.pending_restart: Optional[tuple[str, float]] = None
        self.worker_stats: dict[str, dict] = {}
        self.result = CoordinatorResult(exit_code=0, steps_done=start_step)
        self.steps_done = start_step
        self.attempt = 0
        self.jobs: dict[str, Job] = {}
        self.unassigned: collections.deque[str] = collections.deque()
        self.drafter_failures = 0
        self.group_down_since: Optional[float] = None
        self.restarts: list[dict] = []
        #: evaluation rounds whose results were reported (kept across rollbacks)
        self.done_rounds: set[int] = set()
        self.ready_info: dict[str, dict] = {}
        self._set_items(items)
        self._window_start = time.monotonic()
        self._window_target_tokens = 0
        self._window_target_busy = 0.0
        self._window_drafter_tokens = 0
        self._rank0_metrics: dict = {}
        #: real tokens trained per step, summed over the drafter ranks
        self._step_tokens: dict[int, int] = {}
        self._rr = 0
        self._started = False

    def _set_items(self, items: list[WorkItem]) -> None:
        self.items = items
        #: the step of the last checkpoint these items write (the run ends once it is on disk)
        self.final_checkpoint_step = max((it.index + 1 for it in items if it.kind == "train" and it.checkpoint),
                                         default=None)
        self.item_done: list[set[str]] = [set() for _ in items]
        self._item_index = {(item.kind, item.index): i for i, item in enumerate(items)}
        self.eval_sums: dict[int, list[dict]] = {}
        self.next_item = 0
        self.first_open = 0

    # ------------------------------------------------------------------ signals
    def request_stop(self, reason: str) -> bool:
        """Stop the run (see the class docstring); False when a stop was already requested."""
        if self.stop_reason is not None:
            log.warning("stop requested again (%s): already stopping (%s)", reason, self.stop_reason)
            return False
        log.warning("stop requested (%s): finishing the issued steps (at most %.0f s), then a final checkpoint",
                    reason, self.stop_drain_s)
        self.stop_reason = reason
        self._stop_deadline = time.monotonic() + self.stop_drain_s
        if self.pending_restart is not None:
            log.info("the pending drafter group restart (%s) is dropped: the run stops", self.pending_restart[0])
            self.pending_restart = None
        return True

    def install_signal_handlers(self) -> None:
        def handler(signum, _frame):
            if self.stop_reason is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.stop_signal = signum
            self.request_stop(signal.Signals(signum).name)

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    # ------------------------------------------------------------------ main loop
    def run(self) -> CoordinatorResult:
        try:
            if self._wait_all_ready():
                self._started = True
                self._loop()
        except _Failure as exc:
            log.error("%s", exc)
            self.result.exit_code = 1
        finally:
            self._finishing = True
            for name in self.targets + self.drafters:
                self.sock.send(name, "stop", reason=self.stop_reason or "done")
        self.result.steps_done = self.steps_done
        return self.result

    def serve_controls(self, timeout_s: float = 0.05) -> None:
        """After :meth:`run`: answer control commands (a second ``stop``, ``status``) while the
        launcher stops the workers; workers' messages are dropped. Waits up to ``timeout_s``."""
        got = self.sock.recv(timeout_s)
        while got is not None:
            if got[1]["type"] == "ctl":
                self._on_ctl(*got)
            got = self.sock.recv(0)

    def _all_ready(self, names: list[str]) -> bool:
        return all(self.workers[n].ready for n in names)

    def unready_workers(self) -> list[str]:
        """Workers not ready now (starting, loading, restarting): they hold no state to save."""
        return [n for n, w in self.workers.items() if not w.ready]

    def _wait_all_ready(self) -> bool:
        """Wait until every worker is READY; False when a stop is requested first."""
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._all_ready(self.targets + self.drafters):
            if self.stop_reason is not None:
                log.warning("stopped (%s) before every worker was ready (not ready: %s): nothing trained in this "
                            "launch", self.stop_reason, ", ".join(self.unready_workers()))
                return False
            if time.monotonic() > deadline:
                missing = [n for n, w in self.workers.items() if not w.ready]
                raise _Failure(f"workers not ready after {self.ready_timeout_s:.0f} s: {missing}")
            self._tick()
        log.info("all %d target(s) and %d drafter(s) ready (warmed up): handing out batches",
                 len(self.targets), len(self.drafters))
        return True

    def _tick(self) -> None:
        """One round of supervision and message handling (at most ``POLL_S`` of waiting)."""
        self._supervise()
        self._assign_unassigned()
        got = self.sock.recv(POLL_S)
        if got is not None:
            self._handle(*got)

    def _awaiting_last_checkpoint(self) -> bool:
        """Every step is trained but the last step's checkpoint is not yet reported on disk."""
        return (self.stop_reason is None and self.final_checkpoint_step is not None
                and self.checkpointed_step < self.final_checkpoint_step)

    def _loop(self) -> None:
        # the run is over once every item is done and the final checkpoint is on disk (a drafter
        # group rollback meanwhile re-opens items and the loop goes on)
        while self.first_open < len(self.items) or self._awaiting_last_checkpoint():
            if self.pending_restart is not None:
                self._restart_when_written()
            group_ready = self._all_ready(self.drafters)
            while (self.stop_reason is None and self.pending_restart is None and group_ready
                   and self.next_item < len(self.items) and self.next_item - self.first_open < self.lookahead):
                self._issue(self.next_item)
                self.next_item += 1
            if self.stop_reason is not None and (self.first_open >= self.next_item or self._stop_overdue()):
                break
            self._tick()
            while self.first_open < len(self.items) and len(self.item_done[self.first_open]) == len(self.drafters):
                self._finish_item(self.first_open)
                self.first_open += 1
        if self.stop_reason is not None:
            self._final_checkpoint()

    def _stop_overdue(self) -> bool:
        """Stopping, with issued items left: True (the loop ends) when the group can no longer
        finish them (a drafter died) or they did not finish within ``stop_drain_s``."""
        if self.group_lost is None and time.monotonic() > self._stop_deadline:
            self.group_lost = (f"{self.next_item - self.first_open} issued item(s) did not finish within "
                               f"{self.stop_drain_s:.0f} s of the stop request")
            log.error("%s: stopping without them", self.group_lost)
        if self.group_lost is not None:
            # what the group trained past the last finished step is lost with it
            self.ledger.rollback(self.plan, self.steps_done, self.plan.total_steps)
            return True
        return False

    # ------------------------------------------------------------------ supervision
    def _supervise(self) -> None:
        now = time.monotonic()
        for name in self.control.exited():
            self._on_exit(name, self.control.report(name))
        for name, seen in list(self.last_seen.items()):
            w = self.workers.get(name)
            if w is not None and w.up and now - seen > self.peer_timeout_s:
                log.error("%s sent nothing for %.0f s (transport.peer_timeout_s): killing it", name, now - seen)
                self.last_seen.pop(name)
                self.control.kill(name)
        for w in self.workers.values():
            if w.restart_at is not None and now >= w.restart_at and not self._finishing:
                w.restart_at = None
                self.control.restart(w.name, None)

    def _on_exit(self, name: str, report: str) -> None:
        w = self.workers[name]
        w.up = w.ready = False
        self.last_seen.pop(name, None)
        if w.external:
            log.warning("attached worker %s exited; `python -m launch.cluster restart %s` hands it back", name, name)
            if w.role == "target":
                self._target_down(name)
            return
        if w.role == "target":
            self._target_down(name)
            if self._finishing:
                log.warning("%s exited while the run stops: not restarted.\n%s", name, report)
                return
            if w.restart_at is not None:  # a requested restart: already scheduled
                return
            w.failures += 1
            if w.failures > self.max_restarts:
                raise _Failure(f"{name} failed {w.failures} times in a row; giving up.\n{report}")
            delay = self.restart_backoff_s * 2 ** (w.failures - 1)
            log.error("%s died; restarting it in %.1f s (attempt %d of %d).\n%s", name, delay, w.failures,
                      self.max_restarts, report)
            w.restart_at = time.monotonic() + delay
        else:
            if self.control.pid(name) is not None:
                # an earlier process of this name, already replaced by a group restart (several
                # drafters die together when one does); a restarted one that dies has no pid
                return
            if self.stop_reason is not None:
                for n in self.drafters:
                    self.workers[n].ready = False
                if self.group_lost is None:
                    self.group_lost = f"{name} exited while the run stops"
                    log.error("%s: the drafter group is not restarted; the run ends at its newest checkpoint on "
                              "disk.\n%s", self.group_lost, report)
                return
            self.drafter_failures += 1
            if self.drafter_failures > self.max_restarts:
                raise _Failure(f"{name} failed; the drafter group failed {self.drafter_failures} times in a row; "
                               f"giving up.\n{report}")
            log.error("%s died: restarting the drafter group from the last checkpoint (attempt %d of %d).\n%s",
                      name, self.drafter_failures, self.max_restarts, report)
            self._restart_drafter_group(f"{name} died")

    def _target_down(self, name: str) -> None:
        w = self.workers[name]
        w.down_since = time.monotonic()
        moved = 0
        for job in self.jobs.values():
            if job.target == name and not job.received:
                job.target = None
                self.unassigned.append(job.key)
                moved += 1
        if moved:
            log.warning("%s is down: re-assigning its %d batch(es) not yet taken by a drafter", name, moved)

    def _restart_drafter_group(self, reason: str) -> None:
        """Kill every drafter, roll the ledger back to the newest checkpoint, restart them from it."""
        self.group_down_since = time.monotonic()
        for name in self.drafters:
            self.workers[name].ready = False
            if self.workers[name].up and not self.workers[name].external:
                self.control.kill(name)
        try:
            ckpt = self.control.latest_checkpoint()  # verified: damaged ones are moved aside
        except (CheckpointError, PermissionError) as exc:
            raise _Failure(f"the drafter group cannot restart: {exc}") from exc
        if ckpt is None and self.first_step > 0:
            raise _Failure(f"the drafter group cannot restart: no usable checkpoint is left in the run directory "
                           f"(damaged ones are moved aside to step-*.damaged) and this launch resumed at step "
                           f"{self.first_step}, so its weights cannot be rebuilt")
        state = read_state(ckpt) if ckpt is not None else {"step": self.first_step}
        step = state["step"]
        self.lowest_step = min(self.lowest_step, step)
        lost = range(step, self.steps_done + self.lookahead + 1)
        self.ledger.rollback(self.plan, max(step, self.plan.start_step), min(self.plan.total_steps, lost.stop))
        if step < self.plan.start_step:  # an older checkpoint than this launch's first: its own data position
            from dflash.resume import checkpoint_position

            position = checkpoint_position(state, self.plan.batches_per_epoch, self.plan.num_drafters)
            self.plan = self.plan.resumed(step, position)
        source = (f"{ckpt}, the newest checkpoint on disk" if ckpt is not None
                  else "no checkpoint on disk yet: the initial weights")
        log.warning("drafter group restart (%s): rolling back from step %d to step %d (%s)", reason,
                    self.steps_done, step, source)
        self.pending_restart = None
        self.checkpointed_step = self.checkpoint_started = step if ckpt is not None else -1
        if self.on_rollback is not None:
            self.on_rollback(step, self.steps_done, reason)
        self.steps_done = step
        self.attempt += 1
        self.jobs.clear()
        self.unassigned.clear()
        self._step_tokens.clear()
        for t in self.targets:
            self.sock.send(t, "flush", drafters=self.drafters)
        args = dict(self.item_args)
        first_step = args.pop("first_step", None)
        # the evaluation at the checkpoint's step runs again unless it completed before the rollback:
        # a scheduled one, or this launch's baseline (eval_at_start) when rolling back to the start
        self._set_items(build_work_items(self.plan, step, eval_at_start=step == first_step,
                                         done_rounds=self.done_rounds, **args))
        self.control.new_drafter_group()
        for name in self.drafters:
            if not self.workers[name].external:
                self.control.restart(name, ckpt)

    def _pick_target(self) -> Optional[str]:
        live = [t for t in self.targets if self.workers[t].ready]
        if not live:
            return None
        load = {t: sum(1 for j in self.jobs.values() if j.target == t and not j.received) for t in live}
        best = min(load.values())
        candidates = [t for t in live if load[t] == best]
        target = candidates[self._rr % len(candidates)]
        self._rr += 1
        return target

    def _assign(self, job: Job) -> bool:
        target = self._pick_target()
        if target is None:
            return False
        job.target = target
        self.sock.send(target, "produce", epoch=job.epoch, batch_id=job.batch_id, split=job.split,
                       drafter=job.drafter, key=job.key)
        return True

    def _assign_unassigned(self) -> None:
        while self.unassigned:
            job = self.jobs.get(self.unassigned[0])
            if job is not None and job.target is None and not job.received and not self._assign(job):
                return
            self.unassigned.popleft()

    def _new_job(self, split: str, epoch: int, batch_id: int, drafter: str, tag: str) -> str:
        key = f"{split}:{tag}:{batch_id}:a{self.attempt}"
        job = Job(key, split, epoch, batch_id, drafter)
        self.jobs[key] = job
        if not self._assign(job):
            self.unassigned.append(key)
        return key

    def _issue(self, i: int) -> None:
        item = self.items[i]
        if item.kind == "train":
            for rank, name in enumerate(self.drafters):
                batch_id = item.batches[rank]
                key = (None if batch_id is None else
                       self._new_job("train", item.epoch, batch_id, name, f"e{item.epoch}"))
                self.sock.send(name, "train", attempt=self.attempt, step=item.index, epoch=item.epoch,
                               batch_id=batch_id, checkpoint=item.checkpoint, key=key,
                               position=self.plan.position_after(item.index).to_list())
        else:
            for rank, name in enumerate(self.drafters):
                ids = item.batches[rank]
                keys = [self._new_job("heldout", 0, b, name, f"r{item.index}") for b in ids]
                self.sock.send(name, "evaluate", attempt=self.attempt, round=item.index, batch_ids=ids,
                               step=item.at_step, keys=keys)

    def _final_checkpoint(self) -> None:
        """After a stop: rank 0 writes a checkpoint of ``steps_done`` if it can and none covers it;
        a write in flight is waited for (see the class docstring)."""
        self._finishing = True
        step, rank0 = self.steps_done, self.drafters[0]
        if self.group_lost is None and not self._all_ready(self.drafters):
            self.group_lost = "the drafter group is restarting from a checkpoint"
        if self.group_lost is not None:
            log.warning("no final checkpoint (%s): the newest checkpoint on disk is the run's last", self.group_lost)
        elif step > self.checkpoint_started:
            log.info("writing the final checkpoint at step %d", step)
            if self.sock.send(rank0, "save", step=step):
                self.checkpoint_started = step
        if self._write_in_flight() is not None:
            self._wait_checkpoint(self.checkpoint_started, "the final checkpoint" if step == self.checkpoint_started
                                  else "the checkpoint being written")

    def _write_in_flight(self) -> Optional[int]:
        """The step of the checkpoint rank 0 is writing, or None."""
        return self.checkpoint_started if self.checkpoint_started > self.checkpointed_step else None

    def _wait_checkpoint(self, step: int, what: str) -> bool:
        """Handle messages until checkpoint ``step`` is reported on disk (True), rank 0 exits or
        ``checkpoint_wait_s`` pass (False, logged)."""
        started = time.monotonic()
        log.info("waiting for %s (step %d) to reach the disk", what, step)
        while self.checkpointed_step < step:
            if not self.workers[self.drafters[0]].up:
                log.error("%s exited before %s (step %d) was on disk", self.drafters[0], what, step)
                return False
            if time.monotonic() - started > self.checkpoint_wait_s:
                log.error("%s (step %d) not on disk within %.0f s", what, step, self.checkpoint_wait_s)
                return False
            self._tick()
        return True

    def _restart_when_written(self) -> None:
        """A requested drafter-group restart, once no checkpoint write is in flight (or rank 0 has
        exited, or ``checkpoint_wait_s`` passed: the restart goes on from what is on disk)."""
        reason, deadline = self.pending_restart
        step = self._write_in_flight()
        if step is not None and self.workers[self.drafters[0]].up and time.monotonic() < deadline:
            return
        self.pending_restart = None
        if step is None:
            reason += f", after checkpoint step {self.checkpointed_step} was written"
        else:
            reason += f", checkpoint step {step} being written was not reported on disk"
        self._restart_drafter_group(reason)

    # ------------------------------------------------------------------ messages
    def _handle(self, sender: str, msg: dict) -> None:
        kind = msg["type"]
        if kind == "ctl":
            self._on_ctl(sender, msg)
            return
        sender = msg.get("name", sender)  # heartbeats come from a second socket of the worker
        w = self.workers.get(sender)
        if w is None:
            log.error("message %s from unknown sender %s dropped", kind, sender)
            return
        self.last_seen[sender] = time.monotonic()
        if kind == "hello":
            w.up, w.pid = True, msg["pid"]
            log.info("%s says hello (pid %s, incarnation %s)", sender, msg["pid"], msg["incarnation"])
            if w.role == "drafter":
                self.sock.send(sender, "targets", endpoints=self.endpoints)
        elif kind == "ready":
            self._on_ready(w, msg["info"])
        elif kind == "heartbeat":
            self.worker_stats[sender] = msg["stats"]
        elif kind == "produced":
            job = self.jobs.get(msg.get("key", ""))
            if job is not None:
                self.ledger.mark_produced(msg["split"], msg["epoch"], msg["batch_id"])
                if msg["split"] == "train":
                    self._window_target_tokens += msg["tokens"]
                    self._window_target_busy += msg["seconds"]
            w.failures = 0
        elif kind == "dropped":
            job = self.jobs.get(msg["key"])
            if job is not None and job.target == sender and not job.received:
                log.warning("%s could not hand %s to %s (%s): re-assigning", sender, job.key, job.drafter,
                            msg["reason"])
                job.target = None
                self.unassigned.append(job.key)
        elif kind == "received":
            job = self.jobs.get(msg["key"])
            if job is not None:
                job.received = True
        elif kind in ("trained", "evaluated") and msg["attempt"] != self.attempt:
            log.debug("%s reported work of attempt %d (now %d): ignored", sender, msg["attempt"], self.attempt)
        elif kind == "trained":
            self._on_trained(sender, msg)
        elif kind == "evaluated":
            self.eval_sums.setdefault(msg["round"], []).append(msg["sums"])
            self._mark_done("eval", msg["round"], sender)
        elif kind == "checkpointed":
            self.checkpointed_step = max(self.checkpointed_step, int(msg["step"]))
            log.info("checkpoint at step %d: %s", msg["step"], msg["path"])
        elif kind == "failed":
            log.error("%s reports a failure: %s", sender, msg["error"])
        elif kind == "bye":
            pass
        else:
            log.error("unexpected %s message from %s", kind, sender)

    def _on_ready(self, w: WorkerInfo, info: dict) -> None:
        w.ready = True
        self.ready_info[w.name] = info
        log.info("%s ready: %s", w.name, {k: v for k, v in info.items() if k != "endpoint"})
        if w.role == "target" and w.down_since is not None and self._started:
            seconds = time.monotonic() - w.down_since
            log.warning("%s is back after %.1f s", w.name, seconds)
            self.restarts.append({"worker": w.name, "seconds": seconds})
            w.down_since = None
        if w.role == "drafter" and self.group_down_since is not None and self._all_ready(self.drafters):
            seconds = time.monotonic() - self.group_down_since
            log.warning("drafter group is back after %.1f s, at step %d", seconds, self.steps_done)
            self.restarts.append({"worker": "drafters", "seconds": seconds})
            self.group_down_since = None

    def _mark_done(self, kind: str, index: int, sender: str) -> None:
        i = self._item_index.get((kind, index))
        if i is not None:
            self.item_done[i].add(sender)
            return
        log.debug("%s reported %s %d from before a rollback: ignored", sender, kind, index)

    def _on_trained(self, sender: str, msg: dict) -> None:
        i = self._item_index.get(("train", msg["step"]))
        if i is None or i >= self.next_item or sender in self.item_done[i]:
            log.debug("%s reported step %d from before a rollback: ignored", sender, msg["step"])
            return
        if sender == self.drafters[0] and self.items[i].checkpoint:  # rank 0 now writes this step's checkpoint
            self.checkpoint_started = max(self.checkpoint_started, msg["step"] + 1)
        if msg["batch_id"] is not None:
            self.ledger.mark_trained(msg["epoch"], msg["batch_id"])
        self.worker_stats.setdefault(sender, {}).update(msg["metrics"].get("stats", {}))
        if sender == self.drafters[0]:
            self._rank0_metrics = msg["metrics"]
        self._window_drafter_tokens += msg["metrics"].get("tokens", 0)
        self._step_tokens[msg["step"]] = self._step_tokens.get(msg["step"], 0) + msg["metrics"].get("tokens", 0)
        self.drafter_failures = 0
        self._mark_done("train", msg["step"], sender)

    # ------------------------------------------------------------------ control commands
    def status(self) -> dict:
        return {
            "step": self.steps_done, "total_steps": self.plan.total_steps, "attempt": self.attempt,
            "stop_requested": self.stop_reason,
            "unassigned_batches": len(self.unassigned),
            "batches_in_flight": sum(1 for j in self.jobs.values() if not j.received),
            "workers": {n: {"role": w.role, "pid": self.control.pid(n) if not w.external else w.pid, "up": w.up,
                            "ready": w.ready, "failures": w.failures, "external": w.external}
                        for n, w in self.workers.items()},
            "restarts": self.restarts,
        }

    def _on_ctl(self, client: str, msg: dict) -> None:
        cmd, args = msg["cmd"], msg.get("args") or {}
        ok, text = True, ""
        try:
            if cmd == "status":
                text = "ok"
            elif cmd == "stop":
                if self.stop_reason is None and self._finishing:
                    text = "the run is ending: its workers are stopping"
                elif self.request_stop("requested by `launch.cluster stop`"):
                    text = "stopping after the issued steps, with a final checkpoint"
                else:
                    text = f"already stopping ({self.stop_reason})"
            elif cmd in ("restart", "detach"):
                worker = args.get("worker", "")
                if self.stop_reason is not None or self._finishing:
                    state = f"stopping ({self.stop_reason})" if self.stop_reason else "ending"
                    raise ValueError(f"the run is {state}: no {cmd}")
                if worker == "drafters" or worker.startswith("drafter."):
                    if worker.startswith("drafter.") and worker not in self.workers:
                        raise ValueError(f"no worker {worker!r}")
                    if cmd == "detach":
                        self.workers[worker].external = True
                    elif worker in self.workers:
                        self.workers[worker].external = False
                    in_flight = self._write_in_flight() if cmd == "restart" else None
                    if in_flight is not None:  # restarting now would lose the write: wait for it
                        self.pending_restart = (f"{cmd} {worker} requested",
                                                time.monotonic() + self.checkpoint_wait_s)
                        log.info("%s %s requested: the drafter group restarts once checkpoint step %d, being "
                                 "written, is on disk", cmd, worker, in_flight)
                        text = f"drafter group restarting once checkpoint step {in_flight}, being written, is on disk"
                    else:
                        self._restart_drafter_group(f"{cmd} {worker} requested")
                        text = f"drafter group restarting from the last checkpoint (step {self.steps_done})"
                elif worker in self.workers:
                    w = self.workers[worker]
                    w.external = cmd == "detach"
                    if not w.external:
                        w.restart_at = time.monotonic()  # restart right after it exits
                    self.control.kill(worker)
                    if not w.up:  # already down: nothing will exit
                        self._target_down(worker)
                    text = f"{worker} {'detached' if w.external else 'restarting'}"
                else:
                    raise ValueError(f"no worker {worker!r} (known: {sorted(self.workers)} or 'drafters')")
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except ValueError as exc:
            ok, text = False, str(exc)
        self.sock.send(client, "ctl_reply", ok=ok, text=text, data=self.status())

    # ------------------------------------------------------------------ metrics
    def _finish_item(self, i: int) -> None:
        item = self.items[i]
        if item.kind == "train":
            self.steps_done = item.index + 1
            metrics = dict(self._rank0_metrics)
            metrics.pop("stats", None)
            metrics["tokens"] = self._step_tokens.pop(item.index, 0)  # all ranks (rank 0 reported its own)
            elapsed = max(1e-9, time.monotonic() - self._window_start)
            metrics["throughput/target_tokens_per_s"] = self._window_target_tokens / elapsed
            metrics["throughput/drafter_tokens_per_s"] = self._window_drafter_tokens / elapsed
            metrics["throughput/target_busy_fraction"] = self._window_target_busy / elapsed / max(1, len(self.targets))
            metrics["queue/outstanding_batches"] = sum(1 for j in self.jobs.values() if not j.received)
            metrics["epoch"] = item.epoch
            for name, stats in self.worker_stats.items():
                for key, value in stats.items():
                    if isinstance(value, (int, float)):
                        metrics[f"{name}/{key}"] = value
            self._window_start = time.monotonic()
            self._window_target_tokens = self._window_drafter_tokens = 0
            self._window_target_busy = 0.0
            # forget the finished step's jobs
            for key in [k for k, j in self.jobs.items() if j.received and j.split == "train"
                        and j.epoch == item.epoch and j.batch_id in item.batches]:
                del self.jobs[key]
            if self.on_trained is not None:
                self.on_trained(item, self.attempt)
            self.result.history.append({"step": self.steps_done, **metrics})
            self.on_metrics(self.steps_done, metrics)
            self.on_progress(self.steps_done, self._progress_text(metrics))
        else:
            for key in [k for k in self.jobs if k.startswith(f"heldout:r{item.index}:")]:
                del self.jobs[key]
            sums = self.eval_sums.pop(item.index, [])
            ev = aggregate_eval(sums)
            ev["eval/round"] = item.index
            ev["eval/step"] = item.at_step
            self.done_rounds.add(item.index)
            log.info("held-out eval %d%s at step %d: loss %.4f, τ %.3f over %d blocks", item.index,
                     " (off-schedule baseline)" if item.index < 0 else "", item.at_step,
                     ev.get("eval/loss", float("nan")), ev.get("eval/tau", float("nan")), ev.get("eval/blocks", 0))
            if self.result.first_eval is None:
                self.result.first_eval = {"step": item.at_step, **ev}
            self.result.final_eval = {"step": item.at_step, **ev}
            self.on_metrics(item.at_step, ev)

    def _progress_text(self, m: dict) -> str:
        mem = " ".join(f"{k.split('/')[0]}={v:.1f}G" for k, v in sorted(m.items()) if k.endswith("/mem_gib"))
        return (f"ep {m.get('epoch', 0)} | loss {m.get('train/loss', float('nan')):.3f} "
                f"τ {m.get('train/tau', float('nan')):.2f} | tgt {m['throughput/target_tokens_per_s']:.0f} tok/s "
                f"dft {m['throughput/drafter_tokens_per_s']:.0f} tok/s | q {m['queue/outstanding_batches']} | {mem}")


def aggregate_eval(sums: list[dict]) -> dict:
    """Combine per-drafter evaluation sums into held-out loss, τ and per-slot accuracy."""
    if not sums:
        return {}
    total: dict[str, Any] = {}
    for s in sums:
        for key, value in s.items():
            if isinstance(value, list):
                prev = total.setdefault(key, [0.0] * len(value))
                total[key] = [a + b for a, b in zip(prev, value)]
            else:
                total[key] = total.get(key, 0.0) + value
    out = {
        "eval/loss": total["loss_sum"] / max(total["weight_sum"], 1e-12),
        "eval/tau": total["tau_sum"] / max(total["blocks"], 1),
        "eval/blocks": int(total["blocks"]),
    }
    for k, (c, n) in enumerate(zip(total.get("correct", []), total.get("count", []))):
        if k > 0:
            out[f"eval/acc_slot_{k}"] = c / n if n else float("nan")
    return out


class _Failure(RuntimeError):
    pass
