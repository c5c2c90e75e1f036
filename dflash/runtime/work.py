"""The drafters' common work sequence: which step or evaluation round comes next, and which are done.

The sequence is identical for every drafter rank:
``eval 0, step 0 … step k, eval 1, step k+1 …, final eval``; an evaluation round's number is a
function of its step (:func:`eval_round`), the same in a fresh, resumed or rolled-back run.
:class:`WorkQueue` tracks which items are issued and which every drafter has finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Optional

from dflash.data.schedule import StepPlan

__all__ = ["WorkItem", "WorkQueue", "build_work_items", "eval_round"]


@dataclass
class WorkItem:
    """One item of the drafters' common work sequence."""

    kind: str  # "train" | "eval"
    index: int  # the global step (train) or the eval round (eval: :func:`eval_round`, or -step off-schedule)
    #: the data epoch of a train item (0 for eval items)
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


class WorkQueue:
    """The work sequence of one attempt: items ``[first_open, next_item)`` are issued and not yet
    finished by every drafter; ``done[i]`` holds the drafters that finished item ``i``.

    Args:
        items: the sequence (:func:`build_work_items`).
    """

    def __init__(self, items: list[WorkItem]):
        self.items = items
        #: the step of the last checkpoint these items write (the run ends once it is on disk)
        self.final_checkpoint_step = max((it.index + 1 for it in items if it.kind == "train" and it.checkpoint),
                                         default=None)
        self.done: list[set[str]] = [set() for _ in items]
        self._index = {(item.kind, item.index): i for i, item in enumerate(items)}
        #: evaluation round → the drafters' held-out sums reported so far
        self.eval_sums: dict[int, list[dict]] = {}
        self.next_item = 0
        self.first_open = 0

    def index(self, kind: str, index: int) -> Optional[int]:
        """The position of item (``kind``, ``index``) in the sequence, or None (not in this attempt)."""
        return self._index.get((kind, index))

    def mark_done(self, kind: str, index: int, sender: str) -> bool:
        """Record that ``sender`` finished item (``kind``, ``index``); False for an item of an
        earlier attempt (before a rollback)."""
        i = self._index.get((kind, index))
        if i is None:
            return False
        self.done[i].add(sender)
        return True

    def can_issue(self, lookahead: int) -> bool:
        """An item is left to issue and fewer than ``lookahead`` issued items are unfinished."""
        return self.next_item < len(self.items) and self.next_item - self.first_open < lookahead

    def all_finished(self) -> bool:
        return self.first_open >= len(self.items)

    def issued_open(self) -> int:
        """Issued items not yet finished by every drafter."""
        return self.next_item - self.first_open

    def head_finished(self, num_drafters: int) -> bool:
        """The oldest unfinished item is finished by all ``num_drafters`` drafters."""
        return self.first_open < len(self.items) and len(self.done[self.first_open]) == num_drafters
