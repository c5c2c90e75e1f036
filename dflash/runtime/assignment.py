"""Assignment: which target computes which job, for which drafter.

A **job** is one batch handed to a target for one drafter, named by its job key
(``train:e0:12:a0`` = split, data epoch / eval round tag, batch id, attempt); it lives until the
drafter reports its ring slot received. A job goes to the ready target with the fewest jobs not
yet received (ties round-robin) among those on its drafter's node when one is ready there (CUDA IPC
or shared memory instead of the network), else among all; a job whose target dies or cannot deliver it goes back to the
queue of unassigned jobs and is given to another target. A drafter whose jobs cannot be
delivered (it is not attached to the target, or a batch was lost in flight to it) is recorded
in :attr:`Assignment.undelivered_since` until it takes a batch again.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

__all__ = ["Job", "Assignment", "job_key"]

log = logging.getLogger(__name__)


def job_key(split: str, tag: str, batch_id: int, attempt: int) -> str:
    """The job key of batch ``batch_id`` of ``split`` (``tag``: ``e<data epoch>`` for training,
    ``r<round>`` for an evaluation round) issued in ``attempt``."""
    return f"{split}:{tag}:{batch_id}:a{attempt}"


@dataclass
class Job:
    """One batch handed to a target for one drafter, until the drafter has taken its ring slot."""

    key: str
    split: str
    epoch: int
    batch_id: int
    drafter: str
    target: Optional[str] = None
    received: bool = False


class Assignment:
    """The open jobs and the targets computing them.

    Args:
        send_produce: ``send_produce(target, job)`` sends the job's ``produce`` command to ``target``.
        near: ``near(drafter, target)``: the target runs on the drafter's node (preferred);
            default: every target is near.
    """

    def __init__(self, send_produce: Callable[[str, Job], None],
                 near: Optional[Callable[[str, str], bool]] = None):
        self.send_produce = send_produce
        self.near = near
        self.jobs: dict[str, Job] = {}
        self.unassigned: collections.deque[str] = collections.deque()
        #: drafter → monotonic time (s) of the first job a target could not hand it since it last
        #: took a batch (absent: its batches are being delivered)
        self.undelivered_since: dict[str, float] = {}
        self._rr = 0

    def in_flight(self) -> int:
        """Jobs whose ring slot no drafter has received yet."""
        return sum(1 for j in self.jobs.values() if not j.received)

    def _pick_target(self, live: list[str], drafter: str = "") -> Optional[str]:
        if self.near is not None:
            live = [t for t in live if self.near(drafter, t)] or live
        if not live:
            return None
        load = {t: sum(1 for j in self.jobs.values() if j.target == t and not j.received) for t in live}
        best = min(load.values())
        candidates = [t for t in live if load[t] == best]
        target = candidates[self._rr % len(candidates)]
        self._rr += 1
        return target

    def _assign(self, job: Job, live: list[str]) -> bool:
        target = self._pick_target(live, job.drafter)
        if target is None:
            return False
        job.target = target
        self.send_produce(target, job)
        return True

    def add(self, key: str, split: str, epoch: int, batch_id: int, drafter: str, live: list[str]) -> str:
        """Open job ``key`` and give it to one of the ``live`` targets (or queue it); returns ``key``."""
        job = Job(key, split, epoch, batch_id, drafter)
        self.jobs[key] = job
        if not self._assign(job, live):
            self.unassigned.append(key)
        return key

    def assign_unassigned(self, live: list[str]) -> None:
        """Give queued jobs to the ``live`` targets, in order, while one is available."""
        while self.unassigned:
            job = self.jobs.get(self.unassigned[0])
            if job is not None and job.target is None and not job.received and not self._assign(job, live):
                return
            self.unassigned.popleft()

    def target_down(self, target: str) -> int:
        """Queue again every job of ``target`` not yet received; returns how many."""
        moved = 0
        for job in self.jobs.values():
            if job.target == target and not job.received:
                job.target = None
                self.unassigned.append(job.key)
                moved += 1
        return moved

    def dropped(self, key: str, target: str, reason: str) -> None:
        """``target`` could not deliver job ``key``: queue it again (unless it was received meanwhile
        or already moved to another target)."""
        job = self.jobs.get(key)
        if job is not None and job.target == target and not job.received:
            log.warning("%s could not hand %s to %s (%s): re-assigning", target, job.key, job.drafter, reason)
            job.target = None
            self.unassigned.append(job.key)
            self.undelivered_since.setdefault(job.drafter, time.monotonic())

    def received(self, key: str) -> None:
        job = self.jobs.get(key)
        if job is not None:
            job.received = True
            self.undelivered_since.pop(job.drafter, None)

    def undelivered(self, for_s: float) -> list[str]:
        """Drafters none of whose jobs could be delivered for more than ``for_s`` seconds."""
        now = time.monotonic()
        return [d for d, since in self.undelivered_since.items() if now - since > for_s]

    def forget(self, keys: Iterable[str]) -> None:
        for key in list(keys):
            del self.jobs[key]

    def forget_step(self, epoch: int, batch_ids: list) -> None:
        """Forget the received training jobs of one finished step."""
        self.forget([k for k, j in self.jobs.items() if j.received and j.split == "train"
                     and j.epoch == epoch and j.batch_id in batch_ids])

    def forget_round(self, round_: int) -> None:
        """Forget the jobs of one finished evaluation round."""
        self.forget([k for k in self.jobs if k.startswith(f"heldout:r{round_}:")])

    def clear(self) -> None:
        self.jobs.clear()
        self.unassigned.clear()
        self.undelivered_since.clear()
