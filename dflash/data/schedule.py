"""Which batches make which optimizer step: a pure function of (batches per epoch, drafters,
start position, step).

With D data-parallel drafters, optimizer step s of epoch e trains batch ids
``s*D, s*D + 1, …, s*D + D − 1`` of that epoch, one per drafter rank. The last step of an epoch may
leave some ranks without a batch (``None``): they contribute zero gradient and zero loss weight,
which is exact because the loss is normalised by the all-reduced weight sum. The reference trainer
uses the same plan with its D batches concatenated along rows, so both train the same data per step.

**Data position.** Progress through the data is counted in batches, not steps: a
:class:`DataPosition` ``(epoch, batch)`` names the next untrained batch. A checkpoint stores it,
and a resumed plan (``StepPlan(..., start_step=k, start=position)``) continues from it with
its own D: step ``k`` trains batches ``batch … batch + D − 1`` of that epoch, and so on. So a
resume with another number of drafters trains every batch of the data exactly once (none twice,
none skipped); only the step at which an epoch ends depends on D.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["DataPosition", "StepAssignment", "StepPlan"]


@dataclass(frozen=True)
class DataPosition:
    """The next untrained batch: batch id ``batch`` of ``epoch`` (``(0, 0)`` at a fresh start).

    ``batch`` may equal the epoch's batch count only transiently; :meth:`StepPlan.position_after`
    always returns the normalised form ``(epoch + 1, 0)``.
    """

    epoch: int = 0
    batch: int = 0

    def to_list(self) -> list[int]:
        """``[epoch, batch]`` (what checkpoints and control messages carry)."""
        return [self.epoch, self.batch]

    @classmethod
    def from_list(cls, value) -> "DataPosition":
        """From ``[epoch, batch]``.

        Raises:
            ValueError: not two integers >= 0.
        """
        if (not isinstance(value, (list, tuple)) or len(value) != 2
                or not all(type(v) is int and v >= 0 for v in value)):
            raise ValueError(f"a data position is [epoch, batch] with two integers >= 0, got {value!r}")
        return cls(int(value[0]), int(value[1]))


@dataclass(frozen=True)
class StepAssignment:
    """One optimizer step: ``batch_ids[d]`` is drafter rank d's batch of ``epoch`` (or None)."""

    step: int
    epoch: int
    step_in_epoch: int
    batch_ids: tuple[Optional[int], ...]


class StepPlan:
    """Global optimizer steps over all epochs, from a start step and data position.

    Args:
        batches_per_epoch: number of batches in each epoch (epoch e = index e).
        num_drafters: data-parallel drafter ranks D (≥ 1).
        max_steps: stop after this many steps in all (None = all epochs).
        start_step: steps already trained (a resume); the plan covers steps ``start_step …``.
        start: the data position at ``start_step`` (the next untrained batch); ``None`` =
            ``(0, 0)`` for a fresh plan. The steps before ``start_step`` are not part of the plan.
    Raises:
        ValueError: no epochs, an empty epoch, D < 1, a negative ``start_step``, or a ``start``
            outside the epochs.
    """

    def __init__(self, batches_per_epoch: Sequence[int], num_drafters: int, max_steps: Optional[int] = None,
                 start_step: int = 0, start: Optional[DataPosition] = None):
        if num_drafters < 1:
            raise ValueError(f"num_drafters must be >= 1, got {num_drafters}")
        if not batches_per_epoch or min(batches_per_epoch) < 1:
            raise ValueError(f"every epoch needs at least one batch, got {list(batches_per_epoch)}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.batches_per_epoch = list(batches_per_epoch)
        start = start or DataPosition()
        if start.epoch < len(self.batches_per_epoch) and start.batch >= self.batches_per_epoch[start.epoch]:
            start = DataPosition(start.epoch + 1, 0)  # the end of an epoch is the start of the next
        if start.epoch > len(self.batches_per_epoch) or (start.epoch == len(self.batches_per_epoch) and start.batch):
            raise ValueError(f"data position {start.to_list()} is past the plan's {len(self.batches_per_epoch)} "
                             f"epoch(s) of {self.batches_per_epoch} batches")
        self.num_drafters = num_drafters
        self.max_steps = max_steps
        self.start_step = start_step
        self.start = start
        #: first batch id of each epoch in this plan (the start position's batch in its epoch, else 0)
        self._first = [start.batch if e == start.epoch else 0 for e in range(len(self.batches_per_epoch))]
        self.steps_per_epoch = [0 if e < start.epoch else math.ceil((b - self._first[e]) / num_drafters)
                                for e, b in enumerate(self.batches_per_epoch)]
        self._starts = [start_step]
        for n in self.steps_per_epoch:
            self._starts.append(self._starts[-1] + n)
        #: steps the data gives (all epochs), whatever ``max_steps`` says
        self.data_steps = self._starts[-1]
        self.total_steps = self.data_steps if max_steps is None else min(self.data_steps, max_steps)

    @property
    def num_epochs(self) -> int:
        return len(self.batches_per_epoch)

    def assignment(self, step: int) -> StepAssignment:
        """The batches of global step ``step`` (0-based).

        Raises:
            IndexError: step outside ``[start_step, total_steps)``.
        """
        if not self.start_step <= step < self.total_steps:
            raise IndexError(f"step {step} outside [{self.start_step}, {self.total_steps})")
        epoch = bisect.bisect_right(self._starts, step) - 1
        k = step - self._starts[epoch]
        n = self.batches_per_epoch[epoch]
        d = self.num_drafters
        first = self._first[epoch] + k * d
        ids = tuple(first + r if first + r < n else None for r in range(d))
        return StepAssignment(step=step, epoch=epoch, step_in_epoch=k, batch_ids=ids)

    def position_after(self, step: int) -> DataPosition:
        """The data position once ``step`` is trained: the batch after its last one, ``(epoch + 1, 0)``
        at the end of an epoch (``(num_epochs, 0)`` at the end of the data).

        Raises:
            IndexError: step outside ``[start_step, total_steps)``.
        """
        a = self.assignment(step)
        last = max(b for b in a.batch_ids if b is not None)
        if last + 1 >= self.batches_per_epoch[a.epoch]:
            return DataPosition(a.epoch + 1, 0)
        return DataPosition(a.epoch, last + 1)

    def resumed(self, step: int, position: DataPosition, num_drafters: Optional[int] = None) -> "StepPlan":
        """The same data and ``max_steps`` continued from ``step`` at ``position`` (a checkpoint's),
        with ``num_drafters`` ranks (default: this plan's)."""
        return StepPlan(self.batches_per_epoch, num_drafters or self.num_drafters, self.max_steps, step, position)

    def position_at(self, step: int) -> DataPosition:
        """The data position before ``step`` (``start`` at ``start_step``).

        Raises:
            IndexError: step outside ``[start_step, total_steps]``.
        """
        if step == self.start_step:
            return self.start
        return self.position_after(step - 1)
