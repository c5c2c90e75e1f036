"""The coordinator: epochs, batch order, assignment of batch ids, the ledger, metrics.

It runs in the launcher's main thread (one loop) and talks to the workers over
:mod:`dflash.workers.control`. It never touches tensors: a batch is a deterministic function of
(split, epoch, batch id), so the ledger holds ids only and any target can (re)compute any batch.

The work is a sequence of items, identical for every drafter rank:
``eval 0, step 0 … step k, eval 1, step k+1 …, final eval``. Item i is issued (``produce`` to a
target for each of its batches, ``train``/``evaluate`` to every drafter) once every drafter is
READY and at most ``lookahead`` items are unfinished, so targets fill slots ahead of the
drafters while slot credits bound memory.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from dflash.schedule import StepPlan
from dflash.workers.control import CoordinatorSocket

__all__ = ["WorkItem", "Ledger", "Coordinator", "CoordinatorResult", "build_work_items"]

log = logging.getLogger(__name__)

POLL_S = 0.2


@dataclass
class WorkItem:
    """One item of the drafters' common work sequence."""

    kind: str  # "train" | "eval"
    index: int  # the global step (train) or the eval round (eval)
    epoch: int = 0
    #: train: one batch id (or None) per drafter rank; eval: a list of held-out ids per rank.
    batches: list[Any] = field(default_factory=list)
    checkpoint: bool = False
    #: optimizer steps done when an eval item runs.
    at_step: int = 0


def build_work_items(plan: StepPlan, start_step: int, heldout_batches: int, eval_every: int,
                     checkpoint_every: int, first_eval_round: int = 0,
                     eval_batches: Optional[int] = None) -> list[WorkItem]:
    """The common work sequence from ``start_step`` to the end of the plan.

    Evaluation rounds run at the start (step ``start_step``), every ``eval_every`` steps and at
    the end; each round spreads ``min(heldout_batches, eval_batches)`` held-out batches over the
    drafter ranks round-robin. Checkpoints every ``checkpoint_every`` steps and at the last step.
    """
    d = plan.num_drafters
    n_eval = heldout_batches if eval_batches is None else min(heldout_batches, eval_batches)
    eval_ids = [[b for b in range(n_eval) if b % d == r] for r in range(d)]
    items: list[WorkItem] = []
    rnd = first_eval_round

    def add_eval(at_step: int) -> None:
        nonlocal rnd
        if n_eval > 0:
            items.append(WorkItem("eval", rnd, epoch=0, batches=eval_ids, at_step=at_step))
            rnd += 1

    if start_step < plan.total_steps:
        add_eval(start_step)
    for step in range(start_step, plan.total_steps):
        a = plan.assignment(step)
        done = step + 1
        ckpt = done == plan.total_steps or (checkpoint_every > 0 and done % checkpoint_every == 0)
        items.append(WorkItem("train", step, epoch=a.epoch, batches=list(a.batch_ids), checkpoint=ckpt, at_step=step))
        if done == plan.total_steps or (eval_every > 0 and done % eval_every == 0):
            add_eval(done)
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


class Coordinator:
    """Drives one run from READY to the last checkpoint.

    Args:
        socket: the bound control socket.
        targets / drafters: worker names (``target.0`` …, ``drafter.0`` … in rank order).
        plan: global step plan; ``start_step``: steps already done (resume).
        items: the work sequence (:func:`build_work_items`).
        slots_per_target: transport slots of each target (bounds the look-ahead).
        alive: returns the names of workers whose process died (and their report), for failure.
        on_metrics: called with ``(step, metrics)`` for every finished step / eval round.
        on_progress: called with ``(steps_done, text)`` for the console line.
        ready_timeout_s: how long to wait for every worker to be READY.
    """

    def __init__(self, socket: CoordinatorSocket, targets: list[str], drafters: list[str], plan: StepPlan,
                 start_step: int, items: list[WorkItem], slots_per_target: int,
                 dead_workers: Callable[[], list[str]], on_metrics: Callable[[int, dict], None],
                 on_progress: Callable[[int, str], None], ready_timeout_s: float = 1800.0,
                 peer_timeout_s: float = 120.0):
        self.sock = socket
        self.targets = targets
        self.drafters = drafters
        self.plan = plan
        self.start_step = start_step
        self.items = items
        self.lookahead = max(2, math.ceil(len(targets) * slots_per_target / max(1, len(drafters))))
        self.dead_workers = dead_workers
        self.on_metrics = on_metrics
        self.on_progress = on_progress
        self.ready_timeout_s = ready_timeout_s
        self.peer_timeout_s = peer_timeout_s
        self.ready: dict[str, dict] = {}
        self.last_seen: dict[str, float] = {}
        self.outstanding: dict[str, int] = {t: 0 for t in targets}
        self.ledger = Ledger()
        self.stop_reason: Optional[str] = None
        self.stop_signal: Optional[int] = None
        self.worker_stats: dict[str, dict] = {}
        # progress of items
        self.next_item = 0
        self.item_done: list[set[str]] = [set() for _ in items]
        self._item_index = {(item.kind, item.index): i for i, item in enumerate(items)}
        self.eval_sums: dict[int, list[dict]] = {}
        self.steps_done = start_step
        self.result = CoordinatorResult(exit_code=0, steps_done=start_step)
        self._window_start = time.monotonic()
        self._window_target_tokens = 0
        self._window_target_busy = 0.0
        self._window_drafter_tokens = 0
        self._last_checkpoint: Optional[str] = None
        self._rr = 0

    # ------------------------------------------------------------------ signals
    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            log.warning("stop requested (%s): finishing issued steps, then a final checkpoint", reason)
            self.stop_reason = reason

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
            if not self._wait_ready():
                self.result.exit_code = 1
                return self.result
            self._train_loop()
        except _Failure as exc:
            log.error("%s", exc)
            self.result.exit_code = 1
        finally:
            for name in self.targets + self.drafters:
                self.sock.send(name, "stop", reason=self.stop_reason or "done")
        self.result.steps_done = self.steps_done
        return self.result

    def _check_dead(self) -> None:
        dead = self.dead_workers()
        if dead:
            raise _Failure("worker failed: " + "\n".join(dead))

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.ready_timeout_s
        sent_targets = False
        everyone = set(self.targets + self.drafters)
        while set(self.ready) != everyone or not sent_targets:
            self._check_dead()
            if self.stop_reason is not None:
                return False
            if time.monotonic() > deadline:
                missing = sorted(everyone - set(self.ready))
                raise _Failure(f"workers not ready after {self.ready_timeout_s:.0f} s: {missing}")
            if not sent_targets and all(t in self.ready for t in self.targets):
                endpoints = {t: self.ready[t]["endpoint"] for t in self.targets}
                for d in self.drafters:
                    self.sock.send(d, "targets", endpoints=endpoints)
                sent_targets = True
                log.info("all %d target(s) ready; drafters connect to %s", len(self.targets), endpoints)
            got = self.sock.recv(POLL_S)
            if got is not None:
                self._handle(*got)
        log.info("all %d drafter(s) ready (graphs captured): handing out batches", len(self.drafters))
        return True

    def _train_loop(self) -> None:
        first_open = 0
        while first_open < len(self.items):
            self._check_dead()
            self._check_heartbeats()
            # issue items within the look-ahead window (not after a stop request)
            while (self.stop_reason is None and self.next_item < len(self.items)
                   and self.next_item - first_open < self.lookahead):
                self._issue(self.next_item)
                self.next_item += 1
            if self.stop_reason is not None and first_open >= self.next_item:
                break
            got = self.sock.recv(POLL_S)
            if got is not None:
                self._handle(*got)
            while first_open < len(self.items) and len(self.item_done[first_open]) == len(self.drafters):
                self._finish_item(first_open)
                first_open += 1
        if self.stop_reason is not None and first_open < len(self.items):
            self._final_save()

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        for name, seen in self.last_seen.items():
            if now - seen > self.peer_timeout_s:
                raise _Failure(f"{name} sent nothing for {now - seen:.0f} s (peer_timeout_s = {self.peer_timeout_s:.0f})")

    def _pick_target(self) -> str:
        best = min(self.outstanding.values())
        candidates = [t for t in self.targets if self.outstanding[t] == best]
        target = candidates[self._rr % len(candidates)]
        self._rr += 1
        return target

    def _produce(self, split: str, epoch: int, batch_id: int, drafter: str) -> None:
        target = self._pick_target()
        self.outstanding[target] += 1
        self.sock.send(target, "produce", epoch=epoch, batch_id=batch_id, split=split, drafter=drafter)

    def _issue(self, i: int) -> None:
        item = self.items[i]
        if item.kind == "train":
            for rank, batch_id in enumerate(item.batches):
                if batch_id is not None:
                    self._produce("train", item.epoch, batch_id, self.drafters[rank])
            for rank, name in enumerate(self.drafters):
                self.sock.send(name, "train", step=item.index, epoch=item.epoch,
                               batch_id=item.batches[rank], checkpoint=item.checkpoint)
        else:
            for rank, ids in enumerate(item.batches):
                for batch_id in ids:
                    self._produce("heldout", 0, batch_id, self.drafters[rank])
            for rank, name in enumerate(self.drafters):
                self.sock.send(name, "evaluate", round=item.index, batch_ids=item.batches[rank], step=item.at_step)

    def _final_save(self) -> None:
        """After a stop request: all issued steps are trained; checkpoint the current state."""
        step = self.steps_done
        log.info("writing the final checkpoint at step %d", step)
        self.sock.send(self.drafters[0], "save", step=step)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            self._check_dead()
            got = self.sock.recv(POLL_S)
            if got is None:
                continue
            sender, msg = got
            self._handle(sender, msg)
            if msg["type"] == "checkpointed" and msg["step"] == step:
                return
        raise _Failure("final checkpoint not written within 600 s")

    # ------------------------------------------------------------------ messages
    def _handle(self, sender: str, msg: dict) -> None:
        sender = msg.get("name", sender)  # heartbeats come from a second socket of the worker
        self.last_seen[sender] = time.monotonic()
        kind = msg["type"]
        if kind == "hello":
            log.info("%s says hello (pid %s, incarnation %s)", sender, msg["pid"], msg["incarnation"])
        elif kind == "ready":
            self.ready[sender] = msg["info"]
            log.info("%s ready: %s", sender, {k: v for k, v in msg["info"].items() if k != "endpoint"})
        elif kind == "heartbeat":
            self.worker_stats[sender] = msg["stats"]
        elif kind == "produced":
            if sender in self.outstanding:
                self.outstanding[sender] = max(0, self.outstanding[sender] - 1)
            self.ledger.mark_produced(msg["split"], msg["epoch"], msg["batch_id"])
            if msg["split"] == "train":
                self._window_target_tokens += msg["tokens"]
                self._window_target_busy += msg["seconds"]
            self.worker_stats.setdefault(sender, {}).update(msg.get("stats", {}))
        elif kind == "trained":
            self._on_trained(sender, msg)
        elif kind == "evaluated":
            self.eval_sums.setdefault(msg["round"], []).append(msg["sums"])
            self._mark_done("eval", msg["round"], sender)
        elif kind == "checkpointed":
            self._last_checkpoint = msg["path"]
            log.info("checkpoint at step %d: %s", msg["step"], msg["path"])
        elif kind == "failed":
            raise _Failure(f"{sender} failed: {msg['error']}")
        elif kind == "bye":
            pass
        else:
            log.error("unexpected %s message from %s", kind, sender)

    def _mark_done(self, kind: str, index: int, sender: str) -> None:
        i = self._item_index.get((kind, index))
        if i is not None:
            self.item_done[i].add(sender)
            return
        log.error("%s reported %s %d, which is not in the plan", sender, kind, index)

    def _on_trained(self, sender: str, msg: dict) -> None:
        if msg["batch_id"] is not None:
            self.ledger.mark_trained(msg["epoch"], msg["batch_id"])
        self.worker_stats.setdefault(sender, {}).update(msg["metrics"].get("stats", {}))
        if sender == self.drafters[0]:
            self._rank0_metrics = msg["metrics"]
        self._window_drafter_tokens += msg["metrics"].get("tokens", 0)
        self._mark_done("train", msg["step"], sender)

    def _finish_item(self, i: int) -> None:
        item = self.items[i]
        if item.kind == "train":
            self.steps_done = item.index + 1
            metrics = dict(getattr(self, "_rank0_metrics", {}))
            metrics.pop("stats", None)
            elapsed = max(1e-9, time.monotonic() - self._window_start)
            metrics["throughput/target_tokens_per_s"] = self._window_target_tokens / elapsed
            metrics["throughput/drafter_tokens_per_s"] = self._window_drafter_tokens / elapsed
            metrics["throughput/target_busy_fraction"] = self._window_target_busy / elapsed / max(1, len(self.targets))
            metrics["queue/outstanding_batches"] = sum(self.outstanding.values())
            metrics["epoch"] = item.epoch
            for name, stats in self.worker_stats.items():
                for key, value in stats.items():
                    if isinstance(value, (int, float)):
                        metrics[f"{name}/{key}"] = value
            self._window_start = time.monotonic()
            self._window_target_tokens = self._window_drafter_tokens = 0
            self._window_target_busy = 0.0
            self.result.history.append({"step": self.steps_done, **metrics})
            self.on_metrics(self.steps_done, metrics)
            self.on_progress(self.steps_done, self._progress_text(metrics))
        else:
            sums = self.eval_sums.pop(item.index, [])
            ev = aggregate_eval(sums)
            ev["eval/round"] = item.index
            log.info("held-out eval %d at step %d: loss %.4f, τ %.3f over %d blocks", item.index, item.at_step,
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
