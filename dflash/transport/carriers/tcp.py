"""The ``tcp`` carrier (another node; works on any endpoint): slot bytes in zmq frames.

The slot's bytes follow the READY header as one zmq frame (zero-copy from the producer's slot: the
credit protocol guarantees the slot is not refilled before the consumer's FREE). A CUDA producer
stages the slot through a pinned host mirror (:meth:`~.base.ProducerRing.host_bytes`, which also
serves a remote consumer of a cuda_ipc or shm ring); a CUDA consumer copies from the frame.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from ..layout import SlotLayout
from .base import ImportedRing, ProducerRing, TransportError

__all__ = ["TcpRing", "TcpImport"]


class TcpRing(ProducerRing):
    """Slots whose bytes travel in zmq frames; CUDA slots are staged through a pinned mirror."""

    carrier = "tcp"

    def __init__(self, layout: SlotLayout, num_slots: int, device: torch.device):
        super().__init__(layout, num_slots, device)
        self._mirror = None
        if device.type == "cuda":
            self._mirror = torch.empty(num_slots, layout.nbytes, dtype=torch.uint8, pin_memory=True)

    def payload(self, slot: int, stream: Optional[Any] = None) -> list:
        return self.host_bytes(slot, stream)



class TcpImport(ImportedRing):
    """No mapping: each READY brings the slot's bytes in one frame."""

    carrier = "tcp"

    def copy_slot(self, slot: int, frames: list, dst: torch.Tensor) -> None:
        if len(frames) != 1:
            raise TransportError(f"tcp READY from {self.producer} carries {len(frames)} payload frames, expected 1")
        buf = frames[0].buffer if hasattr(frames[0], "buffer") else memoryview(frames[0])
        if buf.nbytes != self.slot_nbytes:
            raise TransportError(f"tcp payload from {self.producer} has {buf.nbytes} B, expected {self.slot_nbytes}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only read it
            src = torch.frombuffer(buf, dtype=torch.uint8)
        dst.copy_(src)
