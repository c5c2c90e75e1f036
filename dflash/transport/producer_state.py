"""The producer's bookkeeping: ring slot credits, the attached consumers and lost batches.

A ring slot is FREE, ACQUIRED (by the caller, being filled) or IN_FLIGHT (published to exactly
one consumer, until that consumer's FREE for that exact fill *generation*). A slot is never
handed out again while in flight. When a consumer restarts, stops or goes silent, its in-flight
slots return to the pool and their job keys become :class:`LostBatch` records. No sockets here:
:class:`~dflash.transport.producer.Producer` drives these states from its message loop.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Optional, Union

from .carriers.base import TransportError

__all__ = ["LostBatch", "ConsumerState", "SlotCredits"]

FREE, ACQUIRED, IN_FLIGHT = "free", "acquired", "in_flight"


@dataclass(frozen=True)
class LostBatch:
    """A batch that was in flight to a consumer that restarted, stopped or went silent.

    The slot has been returned to the pool; the batch must be recomputed / re-assigned (batches
    are deterministic functions of (data epoch, batch id): docs/ARCHITECTURE.md, The batch contract).
    """

    consumer: str
    job_key: Union[int, str]
    ring_slot: int
    generation: int
    meta: dict
    #: ``restarted`` | ``stopped`` | ``timeout`` | ``closed``
    reason: str


@dataclass
class ConsumerState:
    """The producer's view of one attached consumer."""

    name: str
    identity: bytes
    incarnation: int
    last_seen: float
    attached_at: float = field(default_factory=time.monotonic)
    #: the ring's carrier, or ``tcp`` for a consumer served over the network (another host)
    carrier: str = "tcp"


@dataclass
class _SlotState:
    state: str = FREE
    consumer: str = ""
    job_key: Union[int, str] = -1
    meta: dict = field(default_factory=dict)
    generation: int = 0


class SlotCredits:
    """The credit state of a ring of ``num_slots`` slots (FREE → ACQUIRED → IN_FLIGHT → FREE).

    Args:
        owner: the producer's name, in error messages.
        num_slots: K, the ring size.
    """

    def __init__(self, owner: str, num_slots: int):
        self.owner = owner
        self.num_slots = num_slots
        self._slots = [_SlotState() for _ in range(num_slots)]
        self._free: collections.deque[int] = collections.deque(range(num_slots))

    def free_slots(self) -> int:
        """Slots neither acquired nor in flight."""
        return len(self._free)

    def in_flight(self) -> dict[int, tuple[str, Union[int, str]]]:
        """``{slot: (consumer, job_key)}`` of the slots published and not yet freed."""
        return {i: (s.consumer, s.job_key) for i, s in enumerate(self._slots) if s.state == IN_FLIGHT}

    def acquire(self) -> Optional[int]:
        """The oldest free slot, now ACQUIRED; ``None`` when every slot is acquired or in flight."""
        if not self._free:
            return None
        slot = self._free.popleft()
        self._slots[slot].state = ACQUIRED
        return slot

    def check_acquired(self, slot: int, what: str) -> None:
        """Raises:
            TransportError: ``slot`` is not a slot of the ring, or not acquired by the caller."""
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise TransportError(f"{self.owner}: {what}: no slot {slot!r} (ring of {self.num_slots})")
        if self._slots[slot].state != ACQUIRED:
            raise TransportError(f"{self.owner}: {what}: slot {slot} is {self._slots[slot].state}, not acquired")

    def release(self, slot: int) -> None:
        """An acquired slot goes back to the pool unpublished.

        Raises:
            TransportError: the slot is not acquired.
        """
        self.check_acquired(slot, "release")
        self._slots[slot].state = FREE
        self._free.append(slot)

    def next_generation(self, slot: int) -> int:
        """The generation number the next fill of ``slot`` will carry."""
        return self._slots[slot].generation + 1

    def send(self, slot: int, consumer: str, job_key: Union[int, str], meta: dict, generation: int) -> None:
        """The acquired ``slot`` is in flight to ``consumer`` with fill ``generation``."""
        state = self._slots[slot]
        state.state, state.consumer, state.job_key, state.meta = IN_FLIGHT, consumer, job_key, meta
        state.generation = generation

    def free(self, slot: int, consumer: str, generation: int) -> str:
        """Return ``slot`` to the pool on ``consumer``'s FREE of fill ``generation``.

        Returns:
            ``""`` when the slot was freed, else why the FREE is rejected (no such slot, or a
            stale/duplicated FREE: the slot is not in flight to that consumer with that generation).
        """
        if not 0 <= slot < self.num_slots:
            return f"FREE of slot {slot} (ring of {self.num_slots})"
        state = self._slots[slot]
        if state.state != IN_FLIGHT or state.consumer != consumer or state.generation != generation:
            return (f"stale FREE of slot {slot} generation {generation} (slot is "
                    f"{state.state}, generation {state.generation}, consumer {state.consumer or '-'})")
        state.state, state.consumer, state.meta = FREE, "", {}
        self._free.append(slot)
        return ""

    def reclaim(self, consumer: str, reason: str) -> list[LostBatch]:
        """Return every slot in flight to ``consumer`` to the pool.

        Returns:
            One :class:`LostBatch` (with ``reason``) per slot that was in flight, in slot order.
        """
        lost = []
        for i, s in enumerate(self._slots):
            if s.state == IN_FLIGHT and s.consumer == consumer:
                lost.append(LostBatch(consumer, s.job_key, i, s.generation, s.meta, reason))
                s.state, s.consumer, s.meta = FREE, "", {}
                self._free.append(i)
        return lost
