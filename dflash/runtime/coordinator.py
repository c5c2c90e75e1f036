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
* :mod:`dflash.runtime.stopping`: stop requests, the final checkpoint, waits for a checkpoint write;
* :mod:`dflash.runtime.run_metrics`: the record of each finished step and the console line;
* :mod:`dflash.runtime.commands`: the control commands of a running cluster (a dispatch table).

The state these parts share is one :class:`~dflash.runtime.coordinator_state.CoordinatorState`;
the coordinator owns it and hands it to its components (:class:`~dflash.runtime.restarts.Supervision`,
:class:`~dflash.runtime.stopping.Stopping`, :class:`~dflash.runtime.commands.ControlCommands`),
whose constructors name everything else they use.

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
from dflash.runtime.coordinator_state import CheckpointProgress, CoordinatorConfig, CoordinatorState, WorkerInfo
from dflash.runtime.ledger import Ledger
from dflash.runtime.messages import (Checkpointed, Command, ControlMessage, Dropped, Evaluate, Evaluated, Failed,
                                    Heartbeat, Hello, NODE_MESSAGES, Produce, Produced, Ready, Received, Stop,
                                    Targets, Train, Trained)
from dflash.runtime.restarts import ClusterControl, RestartPolicy, RunFailed, Supervision
from dflash.runtime.run_metrics import progress_text
from dflash.runtime.stopping import Stopping
from dflash.runtime.work import WorkItem, WorkQueue, build_work_items, eval_round
from dflash.training.evaluation import aggregate_eval

__all__ = ["WorkItem", "Ledger", "Coordinator", "CoordinatorConfig", "CoordinatorSetup", "CoordinatorResult",
           "ClusterControl", "RunFailed", "build_work_items", "eval_round"]

log = logging.getLogger(__name__)

POLL_S = 0.2
#: A drafter no target could hand a batch to for this many ``peer_timeout_s`` (it stays detached
#: from the targets' rings) is treated as failed: the restart policy applies to the drafter group.
UNDELIVERED_TIMEOUTS = 3


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


class Coordinator:
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

    Attributes:
        state: what the run's parts share (:class:`~dflash.runtime.coordinator_state.CoordinatorState`).
        supervision: worker exits and restarts (:class:`dflash.runtime.restarts.Supervision`).
        stopping: the stop request and the final checkpoint (:class:`dflash.runtime.stopping.Stopping`).
        commands: the control commands (:class:`dflash.runtime.commands.ControlCommands`).
        ready_info: ``{worker: the info of its READY}``.
    """

    def __init__(self, socket: CoordinatorSocket, setup: CoordinatorSetup, control: ClusterControl,
                 on_metrics: Callable[[int, dict], None], on_progress: Callable[[int, str], None],
                 on_trained: Optional[Callable[[WorkItem, int], None]] = None,
                 on_rollback: Optional[Callable[[int, int, str], None]] = None) -> None:
        self.sock = socket
        self.control = control
        self.endpoints = setup.endpoints
        self.on_metrics, self.on_progress, self.on_trained = on_metrics, on_progress, on_trained
        self.ready_info: dict[str, dict] = {}
        self.policy = RestartPolicy(setup.config.max_restarts, setup.config.restart_backoff_s)
        first_step = setup.item_args.get("first_step") or 0
        written = setup.start_step if setup.start_step > 0 else -1  # a resumed launch starts from a checkpoint
        workers = {n: WorkerInfo(n, "target") for n in setup.targets}
        workers.update({n: WorkerInfo(n, "drafter") for n in setup.drafters})
        self.state = CoordinatorState(
            config=setup.config, targets=setup.targets, drafters=setup.drafters, plan=setup.plan,
            item_args=setup.item_args, work=WorkQueue(setup.items),
            assignment=Assignment(self._send_produce,
                                  near=lambda drafter, target: self.node_of(drafter) == self.node_of(target)),
            workers=workers, steps_done=setup.start_step, first_step=first_step, lowest_step=first_step,
            lookahead=max(2, math.ceil(len(setup.targets) * setup.slots_per_target / max(1, len(setup.drafters)))),
            checkpoints=CheckpointProgress(written, written))
        self.supervision = Supervision(self.state, control, socket, self.policy, on_rollback)
        self.stopping = Stopping(self.state, socket, self.supervision, self._tick)
        self.commands = ControlCommands(self.state, socket, control, self.supervision, self.stopping, self.status)
        self.result = CoordinatorResult(exit_code=0, steps_done=setup.start_step)
        self._started = False
        self.handlers: dict[type, Callable[[WorkerInfo, Any], None]] = {
            Hello: self._on_hello, Ready: self._on_ready, Heartbeat: self._on_heartbeat,
            Produced: self._on_produced, Dropped: self._on_dropped, Received: self._on_received,
            Trained: self._on_trained, Evaluated: self._on_evaluated, Checkpointed: self._on_checkpointed,
            Failed: self._on_failed,
        }

    # ------------------------------------------------------------------ the loop
    def run(self) -> CoordinatorResult:
        s = self.state
        try:
            if self._wait_all_ready():
                self._started = True
                self._loop()
        except RunFailed as exc:
            log.error("%s", exc)
            self.result.exit_code = 1
        finally:
            s.finishing = True
            for name in s.targets + s.drafters:
                self.sock.send(name, Stop(reason=s.stop_reason or "done"))
        self.result.steps_done = s.steps_done
        return self.result

    def unready_workers(self) -> list[str]:
        """Workers not ready now (starting, loading, restarting): they hold no state to save."""
        return self.state.unready_workers()

    def request_stop(self, reason: str) -> bool:
        """Stop the run (:meth:`dflash.runtime.stopping.Stopping.request_stop`); False when a stop
        was already requested."""
        return self.stopping.request_stop(reason)

    def install_signal_handlers(self) -> None:
        """SIGINT / SIGTERM request a stop; a second SIGINT raises KeyboardInterrupt."""
        self.stopping.install_signal_handlers()

    def serve_controls(self, timeout_s: float = 0.05) -> None:
        """After :meth:`run`: answer control commands (a second ``stop``, ``status``) while the
        launcher stops the workers; workers' messages are dropped. Waits up to ``timeout_s``."""
        got = self.sock.recv(timeout_s)
        while got is not None:
            if isinstance(got[1], Command):
                self.commands.handle(*got)
            got = self.sock.recv(0)

    def _wait_all_ready(self) -> bool:
        """Wait until every worker is READY; False when a stop is requested first."""
        s = self.state
        deadline = time.monotonic() + s.config.ready_timeout_s
        while not s.all_ready(s.targets + s.drafters):
            if s.stop_reason is not None:
                log.warning("stopped (%s) before every worker was ready (not ready: %s): nothing trained in this "
                            "launch", s.stop_reason, ", ".join(self.unready_workers()))
                return False
            if time.monotonic() > deadline:
                raise RunFailed(f"workers not ready after {s.config.ready_timeout_s:.0f} s: "
                                f"{self.unready_workers()}")
            self._tick()
        log.info("all %d target(s) and %d drafter(s) ready (warmed up): handing out batches",
                 len(s.targets), len(s.drafters))
        return True

    def _tick(self) -> None:
        """One round of supervision and message handling (at most ``POLL_S`` of waiting)."""
        self.supervision.supervise()
        self.state.assignment.assign_unassigned(self.state.live_targets())
        got = self.sock.recv(POLL_S)
        if got is not None:
            self._handle(*got)

    def _loop(self) -> None:
        s = self.state
        # the run is over once every item is done and the final checkpoint is on disk (a drafter
        # group rollback meanwhile re-opens items and the loop goes on)
        while not s.work.all_finished() or self.stopping.awaiting_last_checkpoint():
            if s.pending_restart is not None:
                self.stopping.restart_when_written()
            self._check_undelivered()
            if s.stop_reason is None and s.pending_restart is None and s.all_ready(s.drafters):
                while s.work.can_issue(s.lookahead):
                    self._issue(s.work.items[s.work.next_item])
                    s.work.next_item += 1
            if s.stop_reason is not None and (s.work.issued_open() <= 0 or self.stopping.overdue()):
                break
            self._tick()
            while s.work.head_finished(len(s.drafters)):
                self._finish_item(s.work.items[s.work.first_open])
                s.work.first_open += 1
        if s.stop_reason is not None:
            self.stopping.final_checkpoint()

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
        s = self.state
        if s.pending_restart is not None or s.finishing:
            return
        stopping = s.stop_reason is not None
        bound = s.config.peer_timeout_s * (1 if stopping else UNDELIVERED_TIMEOUTS)
        stuck = s.assignment.undelivered(bound)
        if not stuck:
            return
        reason = (f"no target could hand {stuck[0]} a batch for {bound:.0f} s "
                  f"({UNDELIVERED_TIMEOUTS if not stopping else 1} x transport.peer_timeout_s): it is not attached")
        if stopping:
            if s.group_lost is None:
                s.group_lost = reason
                log.error("%s: the issued items cannot finish", reason)
            return
        self.policy.drafter_failed(stuck[0], reason)
        s.assignment.undelivered_since.clear()
        if s.checkpoints.in_flight() is not None:  # restarting now would lose the write: wait for it
            s.pending_restart = (reason, time.monotonic() + s.config.checkpoint_wait_s)
        else:
            self.supervision.restart_drafter_group(reason)

    # ------------------------------------------------------------------ issuing work
    def _send_produce(self, target: str, job: Job) -> None:
        self.sock.send(target, Produce(job_key=job.key, data_epoch=job.epoch, batch_id=job.batch_id,
                                       split=job.split, drafter=job.drafter))

    def _new_job(self, split: str, epoch: int, batch_id: int, drafter: str, tag: str) -> str:
        s = self.state
        return s.assignment.add(job_key(split, tag, batch_id, s.attempt), split, epoch, batch_id, drafter,
                                s.live_targets())

    def _issue(self, item: WorkItem) -> None:
        """Open the item's jobs and send every drafter its ``train`` / ``evaluate`` command."""
        s = self.state
        for rank, name in enumerate(s.drafters):
            if item.kind == "train":
                batch_id = item.batches[rank]
                key = (None if batch_id is None else
                       self._new_job("train", item.epoch, batch_id, name, f"e{item.epoch}"))
                self.sock.send(name, Train(attempt=s.attempt, step=item.index, data_epoch=item.epoch,
                                           batch_id=batch_id, job_key=key, checkpoint=item.checkpoint,
                                           position=s.plan.position_after(item.index).to_list()))
            else:
                ids = item.batches[rank]
                keys = [self._new_job("heldout", 0, b, name, f"r{item.index}") for b in ids]
                self.sock.send(name, Evaluate(attempt=s.attempt, round=item.index, batch_ids=ids,
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
        w = self.state.workers.get(sender)
        handler = self.handlers.get(type(msg))
        if w is None or handler is None:
            log.error("%s message from %s dropped (%s)", msg.TAG, sender,
                      "unknown sender" if w is None else "not a worker's message")
            return
        self.state.last_seen[sender] = time.monotonic()
        handler(w, msg)

    def _on_hello(self, w: WorkerInfo, msg: Hello) -> None:
        w.up, w.pid = True, msg.pid
        log.info("%s says hello (pid %s, incarnation %s)", w.name, msg.pid, msg.incarnation)
        if w.role == "drafter":
            self.sock.send(w.name, Targets(endpoints=self.endpoints))

    def _on_ready(self, w: WorkerInfo, msg: Ready) -> None:
        s = self.state
        w.ready = True
        self.ready_info[w.name] = msg.info
        log.info("%s ready: %s", w.name, {k: v for k, v in msg.info.items() if k != "endpoint"})
        if w.role == "target" and w.down_since is not None and self._started:
            seconds = time.monotonic() - w.down_since
            log.warning("%s is back after %.1f s", w.name, seconds)
            s.restarts.append({"worker": w.name, "seconds": seconds})
            w.down_since = None
        if w.role == "drafter" and s.group_down_since is not None and s.all_ready(s.drafters):
            seconds = time.monotonic() - s.group_down_since
            log.warning("drafter group is back after %.1f s, at step %d", seconds, s.steps_done)
            s.restarts.append({"worker": "drafters", "seconds": seconds})
            s.group_down_since = None

    def _on_heartbeat(self, w: WorkerInfo, msg: Heartbeat) -> None:
        self.state.metrics.worker_stats[w.name] = msg.stats

    def _on_produced(self, w: WorkerInfo, msg: Produced) -> None:
        s = self.state
        if msg.job_key in s.assignment.jobs:
            s.ledger.mark_produced(msg.split, msg.data_epoch, msg.batch_id)
            s.metrics.produced(msg.split, msg.tokens, msg.seconds, msg.flops, msg.peak_flops)
        w.failures = 0

    def _on_dropped(self, w: WorkerInfo, msg: Dropped) -> None:
        self.state.assignment.dropped(msg.job_key, w.name, msg.reason)

    def _on_received(self, w: WorkerInfo, msg: Received) -> None:
        self.state.assignment.received(msg.job_key)

    def _current_attempt(self, w: WorkerInfo, msg: Any) -> bool:
        s = self.state
        if msg.attempt != s.attempt:
            log.debug("%s reported work of attempt %d (now %d): ignored", w.name, msg.attempt, s.attempt)
        return msg.attempt == s.attempt

    def _on_trained(self, w: WorkerInfo, msg: Trained) -> None:
        s = self.state
        if not self._current_attempt(w, msg):
            return
        i = s.work.index("train", msg.step)
        if i is None or i >= s.work.next_item or w.name in s.work.done[i]:
            log.debug("%s reported step %d from before a rollback: ignored", w.name, msg.step)
            return
        rank0 = w.name == s.drafters[0]
        if rank0 and s.work.items[i].checkpoint:  # rank 0 now writes this step's checkpoint
            s.checkpoints.started = max(s.checkpoints.started, msg.step + 1)
        if msg.batch_id is not None:
            s.ledger.mark_trained(msg.data_epoch, msg.batch_id)
        s.metrics.trained(w.name, msg.step, msg.metrics, rank0)
        self.policy.drafter_failures = 0
        s.work.mark_done("train", msg.step, w.name)

    def _on_evaluated(self, w: WorkerInfo, msg: Evaluated) -> None:
        if not self._current_attempt(w, msg):
            return
        self.state.work.eval_sums.setdefault(msg.round, []).append(msg.sums)
        if not self.state.work.mark_done("eval", msg.round, w.name):
            log.debug("%s reported eval %d from before a rollback: ignored", w.name, msg.round)

    def _on_checkpointed(self, w: WorkerInfo, msg: Checkpointed) -> None:
        self.state.checkpoints.written = max(self.state.checkpoints.written, msg.step)
        log.info("checkpoint at step %d: %s", msg.step, msg.path)

    def _on_failed(self, w: WorkerInfo, msg: Failed) -> None:
        log.error("%s reports a failure: %s", w.name, msg.error)

    def status(self) -> dict:
        """The run's state for ``launch.cluster status`` (steps, workers, restarts).

        A worker's ``undelivered_s``: seconds since a target last failed to hand that drafter a
        batch without it taking one since (None: its batches are delivered)."""
        s = self.state
        now = time.monotonic()
        undelivered = {d: round(now - t, 1) for d, t in s.assignment.undelivered_since.items()}
        return {
            "step": s.steps_done, "total_steps": s.plan.total_steps, "attempt": s.attempt,
            "stop_requested": s.stop_reason,
            "unassigned_batches": len(s.assignment.unassigned),
            "batches_in_flight": s.assignment.in_flight(),
            "workers": {n: {"role": w.role, "pid": self.control.pid(n) if not w.external else w.pid, "up": w.up,
                            # a drafter no target can hand a batch to (not attached) is not ready
                            "ready": w.ready and n not in undelivered, "failures": w.failures,
                            "external": w.external, "node": self.node_of(n),
                            "undelivered_s": undelivered.get(n)}
                        for n, w in s.workers.items()},
            "nodes": getattr(self.control, "node_status", lambda: {})(),
            "restarts": s.restarts,
        }

    def node_of(self, name: str) -> int:
        """The node rank running worker ``name`` (0 on one machine)."""
        node_of = getattr(self.control, "node_of", None)
        return node_of(name) if node_of is not None else 0

    # ------------------------------------------------------------------ finished items
    def _finish_item(self, item: WorkItem) -> None:
        s = self.state
        if item.kind == "train":
            s.steps_done = item.index + 1
            metrics = s.metrics.step_record(item.index, item.epoch, len(s.targets), s.assignment.in_flight())
            s.assignment.forget_step(item.epoch, item.batches)
            if self.on_trained is not None:
                self.on_trained(item, s.attempt)
            self.result.history.append({"step": s.steps_done, **metrics})
            self.on_metrics(s.steps_done, metrics)
            self.on_progress(s.steps_done, progress_text(metrics))
            return
        s.assignment.forget_round(item.index)
        ev = aggregate_eval(s.work.eval_sums.pop(item.index, []))
        ev["eval/round"] = item.index
        ev["eval/step"] = item.at_step
        s.done_rounds.add(item.index)
        walked = (f"; walked as decoding (its prediction of decoding τ): τ {ev['eval/tau_walk']:.3f} over "
                  f"{ev['eval/walk_blocks']} blocks, {ev['eval/tau_walk_head']:.3f} over the "
                  f"{ev['eval/walk_head_blocks']} within train.eval_head_tokens, "
                  f"{ev.get('eval/tau_walk_first', float('nan')):.3f} over the {ev.get('eval/walk_first_blocks', 0)} "
                  f"of those in each conversation's first response" if "eval/tau_walk" in ev else "")
        log.info("held-out eval %s at step %d: loss %.4f, τ %.3f over %d blocks, τ %.3f over the %d within "
                 "train.eval_head_tokens of their response's start%s",
                 "(the resumed run's baseline)" if item.index < 0 else f"round {item.index}", item.at_step,
                 ev.get("eval/loss", float("nan")), ev.get("eval/tau", float("nan")), ev.get("eval/blocks", 0),
                 ev.get("eval/tau_head", float("nan")), ev.get("eval/head_blocks", 0), walked)
        if self.result.first_eval is None:
            self.result.first_eval = {"step": item.at_step, **ev}
        self.result.final_eval = {"step": item.at_step, **ev}
        self.on_metrics(item.at_step, ev)
