"""Which batches make which optimizer step: a pure function of (batches per epoch, drafters, step).

With D data-parallel drafters, optimizer step s of epoch e trains batch ids
``s*D, s*D + 1, …, s*D + D − 1`` of that epoch, one per drafter rank. The last step of an epoch may
leave some ranks without a batch (``None``): they contribute zero gradient and zero loss weight,
which is exact because the loss is normalised by the all-reduced weight sum. The reference trainer
uses the same plan with its D batches concatenated along rows, so both train the same data per step.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["StepAssignment", "StepPlan"]


@dataclass(frozen=True)
class StepAssignment:
    """One optimizer step: ``batch_ids[d]`` is drafter rank d's batch of ``epoch`` (or None)."""

    step: int
    epoch: int
    step_in_epoch: int
    batch_ids: tuple[Optional[int], ...]


class StepPlan:
    """Global optimizer steps over all epochs.

    Args:
        batches_per_epoch: number of batches in each epoch (epoch e = index e).
        num_drafters: data-parallel drafter ranks D (≥ 1).
        max_steps: stop after this many steps (None = all epochs).
    Raises:
        ValueError: no epochs, an empty epoch, or D < 1.
    """

    def __init__(self, batches_per_epoch: Sequence[int], num_drafters: int, max_steps: Optional[int] = None):
        if num_drafters < 1:
            raise ValueError(f"num_drafters must be >= 1, got {num_drafters}")
        if not batches_per_epoch or min(batches_per_epoch) < 1:
            raise ValueError(f"every epoch needs at least one batch, got {list(batches_per_epoch)}")
        self.batches_per_epoch = list(batches_per_epoch)
        self.num_drafters = num_drafters
        self.steps_per_epoch = [math.ceil(b / num_drafters) for b in self.batches_per_epoch]
        self._starts = [0]
        for n in self.steps_per_epoch:
            self._starts.append(self._starts[-1] + n)
        full = self._starts[-1]
        self.total_steps = full if max_steps is None else min(full, max_steps)

    @property
    def num_epochs(self) -> int:
        return len(self.batches_per_epoch)

    def assignment(self, step: int) -> StepAssignment:
        """The batches of global step ``step`` (0-based).

        Raises:
            IndexError: step outside ``[0, total_steps)``.
        """
        if not 0 <= step < self.total_steps:
            raise IndexError(f"step {step} outside [0, {self.total_steps})")
        epoch = bisect.bisect_right(self._starts, step) - 1
        k = step - self._starts[epoch]
        n = self.batches_per_epoch[epoch]
        d = self.num_drafters
        ids = tuple(k * d + r if k * d + r < n else None for r in range(d))
        return StepAssignment(step=step, epoch=epoch, step_in_epoch=k, batch_ids=ids)

    def epoch_of(self, step: int) -> int:
        return self.assignment(step).epoch
