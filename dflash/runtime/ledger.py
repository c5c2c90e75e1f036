"""The ledger: exactly-once accounting of training batches, by id (never tensors).

A batch is a deterministic function of (split, data epoch, batch id), so the ledger counts ids;
any target can (re)compute a lost batch (docs/ARCHITECTURE.md, The batch contract).
"""

from __future__ import annotations

import logging

from dflash.data.schedule import StepPlan

__all__ = ["Ledger"]

log = logging.getLogger(__name__)


class Ledger:
    """Exactly-once accounting of training batches: ``(data epoch, batch id) → times trained``.

    :meth:`check` after a run lists every planned batch trained zero or several times (and any
    trained batch outside the plan); :meth:`rollback` forgets steps the drafter group undid.
    """

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
