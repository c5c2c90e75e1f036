"""The carrier protocol: what every carrier provides on the producer's and the consumer's side.

A producer owns a *ring*: one ``[K, slot_nbytes]`` uint8 buffer (K slots, each laid out by
:class:`~dflash.transport.layout.SlotLayout`), allocated and exported **once** per producer
incarnation (:class:`ProducerRing`). A consumer *imports* it once per (producer, incarnation) and
copies one slot at a time into its own buffer (:class:`ImportedRing`). The carriers themselves live
in :mod:`.cuda_ipc`, :mod:`.shm` and :mod:`.tcp`; :mod:`dflash.transport.carriers` picks one.

Also here: the host and pid-namespace identity that decides whether a same-host carrier can be
used and whether a producer's pid can be checked from the consumer.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Optional

import torch

from ...utils import process_alive
from ..layout import SlotLayout
from ..messages import Hello, Slots

__all__ = ["TransportError", "host_id", "pid_namespace", "ProducerRing", "ImportedRing"]

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


class TransportError(RuntimeError):
    """A transport operation failed (bad arguments, an unusable peer, a missing device)."""


def host_id() -> str:
    """This host's identity for same-host carriers: the Linux boot id (hostname as a fallback)."""
    try:
        with open(_BOOT_ID_PATH) as fh:
            return fh.read().strip()
    except OSError:
        return socket.gethostname()


def pid_namespace() -> int:
    """Inode of this process's pid namespace (0 when unknown): equal values mean pids compare."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class ProducerRing:
    """K slots in one ``[K, slot_nbytes]`` uint8 buffer, shareable through one carrier.

    Attributes:
        ring: ``[num_slots, layout.nbytes]`` uint8 on ``device``.
        slots: ``slots[i]`` = the named views of slot i (what the caller fills).
    """

    carrier = ""

    def __init__(self, layout: SlotLayout, num_slots: int, device: torch.device):
        if num_slots < 1:
            raise TransportError(f"num_slots must be >= 1, got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        self.device = device
        self._mirror: Optional[torch.Tensor] = None
        self.ring = self._allocate()
        self.slots: list[dict[str, torch.Tensor]] = [layout.views(self.ring[i]) for i in range(num_slots)]

    def _allocate(self) -> torch.Tensor:
        return torch.zeros(self.num_slots, self.layout.nbytes, dtype=torch.uint8, device=self.device)

    def export(self) -> dict[str, Any]:
        """Carrier fields of the SLOTS message (``cuda``, ``events``)."""
        return {}

    def on_hello(self, hello: Hello, producer: str, incarnation: int) -> None:
        """Per-consumer set-up before SLOTS is sent (shm: hand over the memfd).

        Raises:
            TransportError: the consumer cannot be reached.
        """

    def mark_filled(self, slot: int, stream: Optional[Any] = None) -> None:
        """The caller finished enqueueing the fill of ``slot`` (cuda_ipc: record its event)."""

    def payload(self, slot: int, stream: Optional[Any] = None) -> list:
        """Frames that follow READY (tcp: the slot's bytes)."""
        return []

    def host_bytes(self, slot: int, stream: Optional[Any] = None) -> list:
        """The slot's bytes as one frame, for a consumer served over tcp (any ring: a consumer on
        another host of a cuda_ipc / shm ring). CUDA slots are staged through a pinned host mirror
        (allocated at the first use) after ``stream`` (default: the current one) is synchronised;
        the frame is a view, valid while the slot is in flight (credits keep it unchanged)."""
        host = self.ring[slot]
        if self.device.type == "cuda":
            if self._mirror is None:
                self._mirror = torch.empty(self.num_slots, self.layout.nbytes, dtype=torch.uint8, pin_memory=True)
            stream = stream if stream is not None else torch.cuda.current_stream(self.device)
            with torch.cuda.stream(stream):
                self._mirror[slot].copy_(self.ring[slot], non_blocking=True)
            stream.synchronize()
            host = self._mirror[slot]
        # numpy view keeps the tensor alive while zmq sends it without copying.
        return [host.numpy()]

    def close(self) -> None:
        self._mirror = None
        self.slots = []
        self.ring = torch.empty(0, dtype=torch.uint8)


class ImportedRing:
    """A producer's ring as seen by one consumer (one per (producer, incarnation))."""

    carrier = ""

    def __init__(self, slots: Slots):
        self.producer = slots.sender
        self.incarnation = slots.incarnation
        self.num_slots = slots.num_slots
        self.slot_nbytes = slots.slot_nbytes
        self.producer_pid = slots.pid
        self.same_process_space = slots.host == host_id() and slots.pidns == pid_namespace() != 0

    def copy_slot(self, slot: int, frames: list, dst: torch.Tensor) -> None:
        """Copy slot ``slot`` into ``dst`` (``[slot_nbytes]`` uint8 on the consumer's device).

        CUDA: enqueued on the consumer's current stream after a wait on the slot's fill event;
        CPU: done on return.

        Raises:
            TransportError: the payload does not match the slot.
        """
        raise NotImplementedError

    def close(self) -> None:
        """Drop the mapping. Never reads the memory."""

    def cleanup_dead_producer(self) -> None:
        """After :meth:`close`, when the producer died without cleaning up: remove what it left."""

    def ready(self, slot: int) -> bool:
        """Has the producer's fill of ``slot`` completed? (non-blocking; CPU carriers: always)

        Raises:
            TransportError: the fill event cannot be queried.
        """
        return True

    def producer_gone(self) -> bool:
        """True when the producer's process provably no longer exists (same host and pid namespace)."""
        return self.same_process_space and not process_alive(self.producer_pid)
