"""The coordinator: one busy loop that hands out work and delegates everything else.

It runs in the launcher's main thread and talks to the workers over
:mod:`dflash.runtime.control`. It never touches tensors: a batch is a deterministic function of
(split, data epoch, batch id), so every part holds ids only and any target can (re)compute any batch.

Parts, one job each:

* :mod:`dflash.runtime.work`: the drafters' common work sequence (steps and evaluation rounds);
* :mod:`dflash.runtime.assignment`: which target computes which job for which drafter;
* :mod:`dflash.runtime.ledger`: exactly-once accounting of training batches;
* :mod:`dflash.runtime.restarts`: what a worker's exit does (restart with back-off, drafter-group
  rollback to the newest checkpoint, give up);
* :mod:`dflash.runtime.run_metrics`: the record of each finished step and the console line;
* :mod:`dflash.runtime.commands`: the control commands of a running cluster (a dispatch table).

Item i of the work sequence is issued (``produce`` to a target for each of its batches,
``train``/``evaluate`` to every drafter) once every drafter is READY and at most ``lookahead``
items are unfinished, so targets fill ring slots ahead of the drafters while credits bound memory.
Workers' messages are dispatched by type through one table.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from dflash.data.schedule import StepPlan
from dflash.runtime.assignment import Assignment, Job, job_key
from dflash.runtime.commands import ControlCommands
from dflash.runtime.control import CoordinatorSocket
from dflash.runtime.ledger import Ledger
from dflash.runtime.messages import (Checkpointed, Command, ControlMessage, Dropped, Evaluate, Evaluated, Failed,
                                    Heartbeat, Hello, NODE_MESSAGES, Produce, Produced, Ready, Received, Save, Stop,
                                    Targets, Train, Trained)
from dflash.runtime.restarts import ClusterControl, RestartPolicy, RunFailed, SupervisionMixin, WorkerInfo
from dflash.runtime.run_metrics import StepMetrics, progress_text
from dflash.runtime.stopping import CheckpointProgress, StopMixin
from dflash.runtime.work import WorkItem, WorkQueue, build_work_items, eval_round
from dflash.training.evaluation import aggregate_eval

__all__ = ["WorkItem", "Ledger", "Coordinator", "CoordinatorConfig", "CoordinatorSetup", "CoordinatorResult",
           "ClusterControl", "RunFailed", "build_work_items", "eval_round"]

log = logging.getLogger(__name__)

POLL_S = 0.2
#: After a stop request: the longest wait (s) for the issued items to finish (a target may be
#: restarting meanwhile); past it the run ends without them, at the newest checkpoint on disk.
STOP_DRAIN_S = 300.0
#: The longest wait (s) for a checkpoint write to reach the disk: the final one after a stop, or
#: one in flight when a drafter-group restart is requested.
CHECKPOINT_WAIT_S = 600.0
#: A drafter no target could hand a batch to for this many ``peer_timeout_s`` (it stays detached
#: from the targets' rings) is treated as failed: the restart policy applies to the drafter group.
UNDELIVERED_TIMEOUTS = 3


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
class CoordinatorSetup:
    """What one run is made of.

    Attributes:
        targets / drafters: worker names (``target.0`` …, ``drafter.0`` … in rank order).
        endpoints: ``{target name: ring endpoint}`` (stable across target restarts).
        plan: the global step plan; ``start_step``: steps already done (resume).
        items: the work sequence (:func:`build_work_items`).
        item_args: the arguments of :func:`build_work_items` besides plan / start step, plus
            ``first_step`` (this launch's first step), to rebuild the sequence after a rollback.
        slots_per_target: ring slots of each target (bounds the look-ahead).
        config: time limits and restart policy.
    """

    targets: list[str]
    drafters: list[str]
    endpoints: dict[str, str]
    plan: StepPlan
    start_step: int
    items: list[WorkItem]
    item_args: dict
    slots_per_target: int
    config: CoordinatorConfig = field(default_factory=CoordinatorConfig)


@dataclass
class CoordinatorResult:
    exit_code: int
    steps_done: int
    final_eval: Optional[dict] = None
    first_eval: Optional[dict] = None
    ledger_problems: list[str] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)


class Coordinator(SupervisionMixin, StopMixin):
    """Drives one run from READY to the last checkpoint, through worker failures and restarts.

    ``Coordinator(socket, setup, control, on_metrics, on_progress, on_trained=None, on_rollback=None)``.

    Args:
        socket: the bound control socket.
        setup: the run's workers, plan, work sequence and limits (:class:`CoordinatorSetup`).
        control: starts / kills worker processes (:class:`ClusterControl`).
        on_metrics: called with ``(step, metrics)`` for every finished step / eval round.
        on_progress: called with ``(steps_done, text)`` for the console line.
        on_trained: called with ``(train item, attempt)`` when every drafter has trained a step
            (the launcher appends it to ``ledger.jsonl``).
        on_rollback: called with ``(to_step, from_step, reason)`` when a drafter-group restart
            undoes steps ``to_step …`` (the launcher marks it in the ledger and the metrics).

    Worker exits and restarts: :class:`dflash.runtime.restarts.SupervisionMixin`; stopping:
    :class:`dflash.runtime.stopping.StopMixin`.
    """

    def __init__(self, socket: CoordinatorSocket, setup: CoordinatorSetup, control: ClusterControl,
                 on_metrics: Callable[[int, dict], None], on_progress: Callable[[int, str], None],
                 on_trained: Optional[Callable[[WorkItem, int], None]] = None,
                 on_rollback: Optional[Callable[[int, int, str], None]] = None) -> None:
        self.sock = socket
        self.config = setup.config
        self.targets, self.drafters, self.endpoints = setup.targets, setup.drafters, setup.endpoints
        self.plan = setup.plan
        self.item_args = setup.item_args
        self.control = control
        self.on_metrics, self.on_progress = on_metrics, on_progress
        self.on_trained, self.on_rollback = on_trained, on_rollback
        #: the lowest step training (re)started from in this launch: its first step, or lower after
        #: a rollback to an older checkpoint (the newer one was damaged)
        self.first_step = setup.item_args.get("first_step") or 0
        self.lowest_step = self.first_step
        self.lookahead = max(2, math.ceil(len(self.targets) * setup.slots_per_target / max(1, len(self.drafters))))
        self.workers = {n: WorkerInfo(n, "target") for n in self.targets}
        self.workers.update({n: WorkerInfo(n, "drafter") for n in self.drafters})
        self.last_seen: dict[str, float] = {}
        self.ready_info: dict[str, dict] = {}
        self.ledger = Ledger()
        self.assignment = Assignment(self._send_produce, near=lambda drafter, target: self.node_of(drafter) == self.node_of(target))
        self.metrics = StepMetrics()
        self.policy = RestartPolicy(setup.config.max_restarts, setup.config.restart_backoff_s)
        self.commands = ControlCommands(self)
        written = setup.start_step if setup.start_step > 0 else -1  # a resumed launch starts from a checkpoint
        self.checkpoints = CheckpointProgress(written, written)
        self._init_stop_state()
        self.result = CoordinatorResult(exit_code=0, steps_done=setup.start_step)
        self.steps_done = setup.start_step
        self.attempt = 0
        self.group_down_since: Optional[float] = None
        self.restarts: list[dict] = []
        #: evaluation rounds whose results were reported (kept across rollbacks)
        self.done_rounds: set[int] = set()
        self.work = WorkQueue(setup.items)
        self._started = False
        self.handlers: dict[type, Callable[[WorkerInfo, Any], None]] = {
            Hello: self._on_hello, Ready: self._on_ready, Heartbeat: self._on_heartbeat,
            Produced: self._on_produced, Dropped: self._on_dropped, Received: self._on_received,
            Trained: self._on_trained, Evaluated: self._on_evaluated, Checkpointed: self._on_checkpointed,
            Failed: self._on_failed,
        }

    # ------------------------------------------------------------------ the loop
    def run(self) -> CoordinatorResult:
        try:
            if self._wait_all_ready():
                self._started = True
                self._loop()
        except RunFailed as exc:
            log.error("%s", exc)
            self.result.exit_code = 1
        finally:
            self.finishing = True
            for name in self.targets + self.drafters:
                self.sock.send(name, Stop(reason=self.stop_reason or "done"))
        self.result.steps_done = self.steps_done
        return self.result

    def _all_ready(self, names: list[str]) -> bool:
        return all(self.workers[n].ready for n in names)

    def unready_workers(self) -> list[str]:
        """Workers not ready now (starting, loading, restarting): they hold no state to save."""
        return [n for n, w in self.workers.items() if not w.ready]

    def _wait_all_ready(self) -> bool:
        """Wait until every worker is READY; False when a stop is requested first."""
        deadline = time.monotonic() + self.config.ready_timeout_s
        while not self._all_ready(self.targets + self.drafters):
            if self.stop_reason is not None:
                log.warning("stopped (%s) before every worker was ready (not ready: %s): nothing trained in this "
                            "launch", self.stop_reason, ", ".join(self.unready_workers()))
                return False
            if time.monotonic() > deadline:
                raise RunFailed(f"workers not ready after {self.config.ready_timeout_s:.0f} s: "
                                f"{self.unready_workers()}")
            self._tick()
        log.info("all %d target(s) and %d drafter(s) ready (warmed up): handing out batches",
                 len(self.targets), len(self.drafters))
        return True

    def _tick(self) -> None:
        """One round of supervision and message handling (at most ``POLL_S`` of waiting)."""
        self._supervise()
        self.assignment.assign_unassigned(self._live_targets())
        got = self.sock.recv(POLL_S)
        if got is not None:
            self._handle(*got)

    def _loop(self) -> None:
        # the run is over once every item is done and the final checkpoint is on disk (a drafter
        # group rollback meanwhile re-opens items and the loop goes on)
        while not self.work.all_finished() or self._awaiting_last_checkpoint():
            if self.pending_restart is not None:
                self._restart_when_written()
            self._check_undelivered()
            if self.stop_reason is None and self.pending_restart is None and self._all_ready(self.drafters):
                while self.work.can_issue(self.lookahead):
                    self._issue(self.work.items[self.work.next_item])
                    self.work.next_item += 1
            if self.stop_reason is not None and (self.work.issued_open() <= 0 or self._stop_overdue()):
                break
            self._tick()
            while self.work.head_finished(len(self.drafters)):
                self._finish_item(self.work.items[self.work.first_open])
                self.work.first_open += 1
        if self.stop_reason is not None:
            self._final_checkpoint()

    def _check_undelivered(self) -> None:
        """A drafter that no target could hand a batch to for too long (it does not attach to their
        rings again) holds up every issued step: after a stop request (past ``peer_timeout_s``)
        the stop stops waiting for the issued items; otherwise (past ``UNDELIVERED_TIMEOUTS``
        peer timeouts) it counts as a drafter failure and the drafter group restarts from its
        newest checkpoint (:class:`~dflash.runtime.restarts.RestartPolicy`; the run fails past
        ``max_restarts``).

        Raises:
            RunFailed: the drafter group failed more than ``max_restarts`` times in a row.
        """
        if self.pending_restart is not None or self.finishing:
            return
        stopping = self.stop_reason is not None
        bound = self.config.peer_timeout_s * (1 if stopping else UNDELIVERED_TIMEOUTS)
        stuck = self.assignment.undelivered(bound)
        if not stuck:
            return
        reason = (f"no target could hand {stuck[0]} a batch for {bound:.0f} s "
                  f"({UNDELIVERED_TIMEOUTS if not stopping else 1} x transport.peer_timeout_s): it is not attached")
        if stopping:
            if self.group_lost is None:
                self.group_lost = reason
                log.error("%s: the issued items cannot finish", reason)
            return
        self.policy.drafter_failed(stuck[0], reason)
        self.assignment.undelivered_since.clear()
        if self.checkpoints.in_flight() is not None:  # restarting now would lose the write: wait for it
            self.pending_restart = (reason, time.monotonic() + self.config.checkpoint_wait_s)
        else:
            self.restart_drafter_group(reason)

    # ------------------------------------------------------------------ issuing work
    def _live_targets(self) -> list[str]:
        return [t for t in self.targets if self.workers[t].ready]

    def _send_produce(self, target: str, job: Job) -> None:
        self.sock.send(target, Produce(job_key=job.key, data_epoch=job.epoch, batch_id=job.batch_id,
                                       split=job.split, drafter=job.drafter))

    def _new_job(self, split: str, epoch: int, batch_id: int, drafter: str, tag: str) -> str:
        return self.assignment.add(job_key(split, tag, batch_id, self.attempt), split, epoch, batch_id, drafter,
                                   self._live_targets())

    def _issue(self, item: WorkItem) -> None:
        """Open the item's jobs and send every drafter its ``train`` / ``evaluate`` command."""
        for rank, name in enumerate(self.drafters):
            if item.kind == "train":
                batch_id = item.batches[rank]
                key = (None if batch_id is None else
                       self._new_job("train", item.epoch, batch_id, name, f"e{item.epoch}"))
                self.sock.send(name, Train(attempt=self.attempt, step=item.index, data_epoch=item.epoch,
                                           batch_id=batch_id, job_key=key, checkpoint=item.checkpoint,
                                           position=self.plan.position_after(item.index).to_list()))
            else:
                ids = item.batches[rank]
                keys = [self._new_job("heldout", 0, b, name, f"r{item.index}") for b in ids]
                self.sock.send(name, Evaluate(attempt=self.attempt, round=item.index, batch_ids=ids,
                                              job_keys=keys, step=item.at_step))

    # ------------------------------------------------------------------ messages
    def _handle(self, sender: str, msg: ControlMessage) -> None:
        if isinstance(msg, Command):
            self.commands.handle(sender, msg)
            return
        if isinstance(msg, NODE_MESSAGES) and hasattr(self.control, "on_node_message"):
            self.control.on_node_message(sender, msg)  # a node launcher (multi-node runs)
            return
        sender = getattr(msg, "name", "") or sender  # heartbeats come from a second socket of the worker
        w = self.workers.get(sender)
        handler = self.handlers.get(type(msg))
        if w is None or handler is None:
            log.error("%s message from %s dropped (%s)", msg.TAG, sender,
                      "unknown sender" if w is None else "not a worker's message")
            return
        self.last_seen[sender] = time.monotonic()
        handler(w, msg)

    def _on_hello(self, w: WorkerInfo, msg: Hello) -> None:
        w.up, w.pid = True, msg.pid
        log.info("%s says hello (pid %s, incarnation %s)", w.name, msg.pid, msg.incarnation)
        if w.role == "drafter":
            self.sock.send(w.name, Targets(endpoints=self.endpoints))

    def _on_ready(self, w: WorkerInfo, msg: Ready) -> None:
        w.ready = True
        self.ready_info[w.name] = msg.info
        log.info("%s ready: %s", w.name, {k: v for k, v in msg.info.items() if k != "endpoint"})
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

    def _on_heartbeat(self, w: WorkerInfo, msg: Heartbeat) -> None:
        self.metrics.worker_stats[w.name] = msg.stats

    def _on_produced(self, w: WorkerInfo, msg: Produced) -> None:
        if msg.job_key in self.assignment.jobs:
            self.ledger.mark_produced(msg.split, msg.data_epoch, msg.batch_id)
            self.metrics.produced(msg.split, msg.tokens, msg.seconds, msg.flops, msg.peak_flops)
        w.failures = 0

    def _on_dropped(self, w: WorkerInfo, msg: Dropped) -> None:
        self.assignment.dropped(msg.job_key, w.name, msg.reason)

    def _on_received(self, w: WorkerInfo, msg: Received) -> None:
        self.assignment.received(msg.job_key)

    def _current_attempt(self, w: WorkerInfo, msg: Any) -> bool:
        if msg.attempt != self.attempt:
            log.debug("%s reported work of attempt %d (now %d): ignored", w.name, msg.attempt, self.attempt)
        return msg.attempt == self.attempt

    def _on_trained(self, w: WorkerInfo, msg: Trained) -> None:
        if not self._current_attempt(w, msg):
            return
        i = self.work.index("train", msg.step)
        if i is None or i >= self.work.next_item or w.name in self.work.done[i]:
            log.debug("%s reported step %d from before a rollback: ignored", w.name, msg.step)
            return
        rank0 = w.name == self.drafters[0]
        if rank0 and self.work.items[i].checkpoint:  # rank 0 now writes this step's checkpoint
            self.checkpoints.started = max(self.checkpoints.started, msg.step + 1)
        if msg.batch_id is not None:
            self.ledger.mark_trained(msg.data_epoch, msg.batch_id)
        self.metrics.trained(w.name, msg.step, msg.metrics, rank0)
        self.policy.drafter_failures = 0
        self.work.mark_done("train", msg.step, w.name)

    def _on_evaluated(self, w: WorkerInfo, msg: Evaluated) -> None:
        if not self._current_attempt(w, msg):
            return
        self.work.eval_sums.setdefault(msg.round, []).append(msg.sums)
        if not self.work.mark_done("eval", msg.round, w.name):
            log.debug("%s reported eval %d from before a rollback: ignored", w.name, msg.round)

    def _on_checkpointed(self, w: WorkerInfo, msg: Checkpointed) -> None:
        self.checkpoints.written = max(self.checkpoints.written, msg.step)
        log.info("checkpoint at step %d: %s", msg.step, msg.path)

    def _on_failed(self, w: WorkerInfo, msg: Failed) -> None:
        log.error("%s reports a failure: %s", w.name, msg.error)

    def status(self) -> dict:
        """The run's state for ``launch.cluster status`` (steps, workers, restarts).

        A worker's ``undelivered_s``: seconds since a target last failed to hand that drafter a
        batch without it taking one since (None: its batches are delivered)."""
        now = time.monotonic()
        undelivered = {d: round(now - t, 1) for d, t in self.assignment.undelivered_since.items()}
        return {
            "step": self.steps_done, "total_steps": self.plan.total_steps, "attempt": self.attempt,
            "stop_requested": self.stop_reason,
            "unassigned_batches": len(self.assignment.unassigned),
            "batches_in_flight": self.assignment.in_flight(),
            "workers": {n: {"role": w.role, "pid": self.control.pid(n) if not w.external else w.pid, "up": w.up,
                            # a drafter no target can hand a batch to (not attached) is not ready
                            "ready": w.ready and n not in undelivered, "failures": w.failures,
                            "external": w.external, "node": self.node_of(n),
                            "undelivered_s": undelivered.get(n)}
                        for n, w in self.workers.items()},
            "nodes": getattr(self.control, "node_status", lambda: {})(),
            "restarts": self.restarts,
        }

    def node_of(self, name: str) -> int:
        """The node rank running worker ``name`` (0 on one machine)."""
        node_of = getattr(self.control, "node_of", None)
        return node_of(name) if node_of is not None else 0

    # ------------------------------------------------------------------ finished items
    def _finish_item(self, item: WorkItem) -> None:
        if item.kind == "train":
            self.steps_done = item.index + 1
            metrics = self.metrics.step_record(item.index, item.epoch, len(self.targets),
                                               self.assignment.in_flight())
            self.assignment.forget_step(item.epoch, item.batches)
            if self.on_trained is not None:
                self.on_trained(item, self.attempt)
            self.result.history.append({"step": self.steps_done, **metrics})
            self.on_metrics(self.steps_done, metrics)
            self.on_progress(self.steps_done, progress_text(metrics))
            return
        self.assignment.forget_round(item.index)
        ev = aggregate_eval(self.work.eval_sums.pop(item.index, []))
        ev["eval/round"] = item.index
        ev["eval/step"] = item.at_step
        self.done_rounds.add(item.index)
        walked = (f"; walked as decoding (its prediction of decoding τ): τ {ev['eval/tau_walk']:.3f} over "
                  f"{ev['eval/walk_blocks']} blocks, {ev['eval/tau_walk_head']:.3f} over the "
                  f"{ev['eval/walk_head_blocks']} within train.eval_head_tokens" if "eval/tau_walk" in ev else "")
        log.info("held-out eval %s at step %d: loss %.4f, τ %.3f over %d blocks, τ %.3f over the %d within "
                 "train.eval_head_tokens of their response's start%s",
                 "(the resumed run's baseline)" if item.index < 0 else f"round {item.index}", item.at_step,
                 ev.get("eval/loss", float("nan")), ev.get("eval/tau", float("nan")), ev.get("eval/blocks", 0),
                 ev.get("eval/tau_head", float("nan")), ev.get("eval/head_blocks", 0), walked)
        if self.result.first_eval is None:
            self.result.first_eval = {"step": item.at_step, **ev}
        self.result.final_eval = {"step": item.at_step, **ev}
        self.on_metrics(item.at_step, ev)

    def _send_save(self, step: int) -> bool:
        return self.sock.send(self.drafters[0], Save(step=step))
