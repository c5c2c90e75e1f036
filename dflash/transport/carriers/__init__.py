"""Carriers: how a ring of slots is shared between a producer and a consumer, and which one to use.

One protocol (:mod:`.base`), three carriers (docs/ARCHITECTURE.md, The data plane):

=============  ============================  ===================================================
carrier        where                         module
=============  ============================  ===================================================
``cuda_ipc``   GPU, same host                :mod:`.cuda_ipc`: CUDA IPC handles + interprocess events
``shm``        CPU, same host                :mod:`.shm`: sealed anonymous memfd over a unix socket
``tcp``        another node (any endpoint)   :mod:`.tcp`: the slot's bytes in a zmq frame
=============  ============================  ===================================================

This module picks the carrier: :func:`resolve_carrier` turns a configured choice into one of
:data:`CARRIERS`, :func:`make_ring` allocates a producer's ring for it and :func:`import_ring`
imports a producer's announced ring on the consumer's side.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..layout import SlotLayout
from ..messages import Slots
from .base import ImportedRing, ProducerRing, TransportError
from .cuda_ipc import CudaIpcImport, CudaIpcRing
from .shm import FdMailbox, ShmImport, ShmRing
from .tcp import TcpImport, TcpRing

__all__ = ["CARRIERS", "resolve_carrier", "make_ring", "import_ring"]

CARRIERS = ("cuda_ipc", "shm", "tcp")


def resolve_carrier(carrier: str, device: torch.device) -> str:
    """``auto`` → ``cuda_ipc`` on a CUDA device, ``shm`` on CPU; check explicit choices.

    Raises:
        TransportError: an unknown carrier, ``cuda_ipc`` without a CUDA device, ``shm`` with one.
    """
    if carrier == "auto":
        return "cuda_ipc" if device.type == "cuda" else "shm"
    if carrier not in CARRIERS:
        raise TransportError(f"unknown carrier {carrier!r} (one of auto, {', '.join(CARRIERS)})")
    if carrier == "cuda_ipc" and device.type != "cuda":
        raise TransportError(f"carrier cuda_ipc needs a CUDA device, got {device}")
    if carrier == "shm" and device.type != "cpu":
        raise TransportError(f"carrier shm holds CPU slots, got device {device} (use cuda_ipc or tcp)")
    return carrier


def make_ring(carrier: str, layout: SlotLayout, num_slots: int, device: torch.device, name: str) -> ProducerRing:
    """Allocate and export a producer's ring for ``carrier`` (resolved: not ``auto``)."""
    if carrier == "cuda_ipc":
        return CudaIpcRing(layout, num_slots, device)
    if carrier == "shm":
        return ShmRing(layout, num_slots, device, name=name)
    if carrier == "tcp":
        return TcpRing(layout, num_slots, device)
    raise TransportError(f"unknown carrier {carrier!r}")


def import_ring(slots: Slots, carrier: str, device: torch.device, import_device: str = "own",
                mailbox: Optional[FdMailbox] = None) -> ImportedRing:
    """Import the ring announced by ``slots`` over ``carrier`` (resolved: not ``auto``).

    Args:
        slots: the producer's SLOTS message.
        device: the consumer's device (cuda_ipc: where events are opened and copies run).
        import_device: cuda_ipc: ``own`` or ``exporter`` (see :class:`~.cuda_ipc.CudaIpcImport`).
        mailbox: shm: the consumer's fd mailbox; descriptors of older incarnations of the same
            producer are closed once the ring is mapped.

    Raises:
        TransportError: the ring cannot be imported (missing export fields, no descriptor, a
            size mismatch, no mailbox for shm).
    """
    if carrier == "cuda_ipc":
        return CudaIpcImport(slots, device, import_device)
    if carrier == "shm":
        if mailbox is None:
            raise TransportError(f"cannot import the shm ring of {slots.sender}: this consumer has no fd mailbox")
        ring = ShmImport(slots, mailbox)
        mailbox.discard_older(slots.sender, slots.incarnation)
        return ring
    return TcpImport(slots)
