"""The consumer's bookkeeping: its view of each producer, pending READYs and copies in progress.

No sockets here: :class:`~dflash.transport.consumer.Consumer` drives these states from its
message loop.

* :class:`ProducerLink`: one producer as this consumer sees it: the newest producer incarnation
  seen (older ones are stale), the imported ring of the attached incarnation, the last fill
  generation seen per ring slot (a READY that does not advance it is stale or duplicated) and the
  ring slots held (received, not yet freed).
* :class:`PendingReady`, :class:`PendingQueue`: READYs received and not yet taken by ``receive``.
* :class:`CopyQueue`: CUDA copies out of producers' rings that are enqueued and not yet known
  complete; each slot's FREE waits for its copy's "done" event.
* :class:`Received`: what ``receive`` hands to the caller.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Union

import torch
import zmq

from .carriers.base import ImportedRing
from .layout import SlotLayout
from .messages import Ready, Slots

__all__ = ["Received", "PendingReady", "PendingQueue", "ProducerLink", "CopyQueue"]


@dataclass
class Received:
    """One batch handed over by a producer.

    ``tensors`` are views of the consumer's own buffer number ``buffer`` (spec shapes/dtypes,
    on the consumer's device); they stay valid until that buffer is reused, i.e. for the next
    ``num_buffers - 1`` calls of :meth:`~dflash.transport.consumer.Consumer.receive`. On CUDA the
    copy is ordered on the consumer's current stream (work enqueued after ``receive`` sees the data).
    """

    producer: str
    producer_incarnation: int
    job_key: Union[int, str]
    meta: dict
    ring_slot: int
    generation: int
    buffer: int
    tensors: dict[str, torch.Tensor]


@dataclass(eq=False)  # identity: two READYs are never "equal"
class PendingReady:
    """A READY (and its payload frames, tcp) waiting to be taken; ``arrived`` in monotonic s."""

    link: "ProducerLink"
    msg: Ready
    frames: list
    arrived: float = field(default_factory=time.monotonic)


@dataclass
class ProducerLink:
    """This consumer's view of one producer."""

    producer: str
    endpoint: str
    socket: zmq.Socket
    #: producer incarnation of the imported ring (0 = none)
    incarnation: int = 0
    #: newest producer incarnation seen; messages of older incarnations are stale
    newest: int = 0
    attached: bool = False
    ring: Optional[ImportedRing] = None
    last_seen: float = field(default_factory=time.monotonic)
    next_timer: float = 0.0
    #: last generation seen per slot (this incarnation)
    generations: dict[int, int] = field(default_factory=dict)
    #: slots received (READY) and not yet freed: slot → generation
    held: dict[int, int] = field(default_factory=dict)
    stopped: str = ""
    #: the carrier of this producer's slots: the consumer's own, or ``tcp`` for a remote producer
    carrier: str = "tcp"

    def slots_problem(self, msg: Slots, layout: SlotLayout) -> str:
        """Why the SLOTS announcement ``msg`` cannot be imported (``""``: it can): another slot
        layout, another carrier than this link's, or an empty ring."""
        if msg.layout != layout.describe() or msg.slot_nbytes != layout.nbytes:
            return f"SLOTS layout {msg.layout} differs from this consumer's {layout.describe()}"
        if msg.carrier != self.carrier or msg.num_slots < 1:
            return f"SLOTS carrier {msg.carrier} / {msg.num_slots} slots (expected: {self.carrier})"
        return ""

    def hold(self, msg: Ready, payload: list) -> str:
        """Record the READY ``msg`` of the attached incarnation: its slot is held until freed.

        Returns:
            ``""`` when held, else why it is rejected: a slot outside the ring, a generation not
            newer than the last seen for that slot (stale or duplicated), a slot still held, or
            the wrong number of payload frames (1 over tcp, else 0).
        """
        assert self.ring is not None
        if not 0 <= msg.ring_slot < self.ring.num_slots:
            return f"READY for slot {msg.ring_slot} (ring of {self.ring.num_slots})"
        last = self.generations.get(msg.ring_slot, 0)
        if msg.generation <= last or msg.ring_slot in self.held:
            return (f"stale READY for slot {msg.ring_slot}: generation {msg.generation} (last seen {last}"
                    f"{', slot not freed yet' if msg.ring_slot in self.held else ''}), batch {msg.job_key!r}")
        expected_frames = 1 if self.carrier == "tcp" else 0
        if len(payload) != expected_frames:
            return f"READY with {len(payload)} payload frame(s), expected {expected_frames}"
        self.generations[msg.ring_slot] = msg.generation
        self.held[msg.ring_slot] = msg.generation
        return ""

    def release_ring(self, dead: bool) -> Optional[int]:
        """Close the imported ring (``dead``: also remove what its dead producer left behind) and
        detach; the caller has already forgotten the held slots.

        Returns:
            The producer incarnation whose ring was released, ``None`` when none was imported.
        """
        released = None
        self.generations.clear()
        self.attached = False
        if self.ring is not None:
            ring, self.ring = self.ring, None
            ring.close()
            if dead:
                ring.cleanup_dead_producer()
            released = self.incarnation
        self.incarnation = 0
        return released

    def release(self, slot: int, generation: int) -> bool:
        """Stop holding ``slot``'s fill ``generation``; False when it is not held (already freed,
        or dropped with its producer incarnation): then no FREE must be sent."""
        if self.held.get(slot) != generation:
            return False
        del self.held[slot]
        return True


class PendingQueue:
    """READYs received and not yet taken, in arrival order."""

    def __init__(self) -> None:
        self._items: collections.deque[PendingReady] = collections.deque()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[PendingReady]:
        """A snapshot: the queue may change while the caller walks it."""
        return iter(list(self._items))

    def append(self, item: PendingReady) -> None:
        self._items.append(item)

    def pop(self, match: Optional[Callable[[Union[int, str], dict], bool]],
            gate: Optional[Callable[[PendingReady], bool]]) -> tuple[Optional[PendingReady], bool]:
        """The oldest READY accepted by ``match(job_key, meta)`` (``None``: any) whose fill is
        complete by ``gate(item)`` (``None``: no gate; not asked while its ring is not imported),
        and whether an accepted one is still waiting for its fill. ``gate`` may drop READYs."""
        blocked = False
        for item in list(self._items):
            if item not in self._items:  # its ring was dropped while we looked at another one
                continue
            if match is not None and not match(item.msg.job_key, item.msg.meta):
                continue
            if gate is not None and item.link.ring is not None and not gate(item):
                blocked = True
                continue
            self._items.remove(item)
            return item, blocked
        return None, blocked

    def drop(self, link: "ProducerLink") -> list[Union[int, str]]:
        """Forget ``link``'s READYs; returns their job keys."""
        dropped = [p.msg.job_key for p in self._items if p.link is link]
        self._items = collections.deque(p for p in self._items if p.link is not link)
        return dropped


class CopyQueue:
    """CUDA copies out of producers' rings, in enqueue order, each with a reusable "done" event
    (no event allocation per receive once warm)."""

    def __init__(self) -> None:
        #: (done event, link, slot, generation)
        self._copies: collections.deque[tuple[Any, ProducerLink, int, int]] = collections.deque()
        self._event_pool: list[Any] = []

    def __len__(self) -> int:
        return len(self._copies)

    def record(self, stream: Any, link: ProducerLink, slot: int, generation: int) -> None:
        """The copy of ``link``'s ``slot`` (fill ``generation``) was just enqueued on ``stream``."""
        done = self._event_pool.pop() if self._event_pool else torch.cuda.Event()
        done.record(stream)
        self._copies.append((done, link, slot, generation))

    def finished(self, block: bool, wait_oldest: bool = False) -> Iterator[tuple[ProducerLink, int, int]]:
        """Yield ``(link, slot, generation)`` of each finished copy, oldest first, and forget it;
        stops at the first unfinished one (``block``: wait for all of them; ``wait_oldest``: wait
        for the first one only)."""
        wait = block or wait_oldest
        while self._copies:
            done, link, slot, generation = self._copies[0]
            if wait:
                done.synchronize()
                wait = block
            elif not done.query():
                break
            self._copies.popleft()
            self._event_pool.append(done)
            yield link, slot, generation

    def forget(self, link: ProducerLink) -> None:
        """Wait for ``link``'s copies (they read a ring that is about to go) and forget them."""
        for c in [c for c in self._copies if c[1] is link]:
            c[0].synchronize()
            self._event_pool.append(c[0])
        self._copies = collections.deque(c for c in self._copies if c[1] is not link)
