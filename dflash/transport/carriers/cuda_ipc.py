"""The ``cuda_ipc`` carrier (GPU, same host): one CUDA allocation shared through CUDA IPC handles.

The ring is one CUDA allocation, exported with ``torch.multiprocessing.reductions.reduce_tensor``;
its fields travel as msgpack (:class:`~dflash.transport.messages.CudaExport`), never pickle. The
consumer rebuilds it with ``rebuild_cuda_tensor`` once per (producer, incarnation) — each
``reduce_tensor`` call is a separate reference count (vLLM #51258), so the producer exports once and
every consumer imports once.

One interprocess CUDA event per slot, recorded after every fill; the consumer opens each event
handle once **on its own device** (opening it on the producer's device hung on an H200) and waits
on it on its own stream before every copy (a cached import skips the export-time event wait, so the
per-fill event is the only valid guard). Slot memory is allocated with ``expandable_segments`` off:
expandable-segment IPC needs ``pidfd_getfd``, which containers refuse (EPERM).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator, Optional

import torch

from ..layout import SlotLayout
from ..messages import CudaExport, Slots
from .base import ImportedRing, ProducerRing, TransportError

__all__ = ["CudaIpcRing", "CudaIpcImport"]

log = logging.getLogger("dflash.transport")

#: Where POSIX shared memory names live on Linux (torch's CUDA IPC ref-counter files).
SHM_DIR = "/dev/shm"


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _device_uuid(index: int) -> str:
    return str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))


@contextlib.contextmanager
def _no_expandable_segments() -> Iterator[None]:
    """Allocate with ``expandable_segments`` off (its IPC needs ``pidfd_getfd``, refused in containers)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    enabled = "expandable_segments:true" in conf.replace(" ", "").lower()
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if not enabled:
        yield
        return
    if setter is None:
        log.warning("expandable_segments is on and this torch cannot switch it off: CUDA IPC of slots may fail")
        yield
        return
    setter("expandable_segments:False")
    try:
        yield
    finally:
        setter("expandable_segments:True")



class CudaIpcRing(ProducerRing):
    """A CUDA ring exported once with ``reduce_tensor``; one interprocess event per slot."""

    carrier = "cuda_ipc"

    def __init__(self, layout: SlotLayout, num_slots: int, device: torch.device):
        from torch.multiprocessing.reductions import reduce_tensor

        if device.type != "cuda":
            raise TransportError(f"cuda_ipc needs a CUDA device, got {device}")
        device = torch.device("cuda", _cuda_index(device))
        super().__init__(layout, num_slots, device)
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device)
            self.events = [torch.cuda.Event(interprocess=True) for _ in range(num_slots)]
            for ev in self.events:  # create each event on this device before taking its handle
                ev.record(stream)
            event_handles = [bytes(ev.ipc_handle()) for ev in self.events]
            stream.synchronize()
            _rebuild, args = reduce_tensor(self.ring)
        (_cls, size, stride, tensor_offset, _storage_cls, _dtype, dev, handle, storage_nbytes,
         storage_offset_bytes, _requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
         event_sync_required) = args
        self._export = CudaExport(
            size=list(size), stride=list(stride), tensor_offset=int(tensor_offset), device=int(dev),
            device_uuid=_device_uuid(int(dev)), handle=bytes(handle), storage_nbytes=int(storage_nbytes),
            storage_offset_bytes=int(storage_offset_bytes), ref_counter_handle=bytes(ref_counter_handle),
            ref_counter_offset=int(ref_counter_offset), event_handle=bytes(event_handle),
            event_sync_required=bool(event_sync_required))
        self._event_handles = event_handles

    def _allocate(self) -> torch.Tensor:
        with _no_expandable_segments():
            return torch.zeros(self.num_slots, self.layout.nbytes, dtype=torch.uint8, device=self.device)

    def export(self) -> dict[str, Any]:
        return {"cuda": self._export, "events": list(self._event_handles)}

    def mark_filled(self, slot: int, stream: Optional[Any] = None) -> None:
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        self.events[slot].record(stream)

    def close(self) -> None:
        with torch.cuda.device(self.device):
            torch.cuda.current_stream(self.device).synchronize()
        self.events = []
        super().close()



class CudaIpcImport(ImportedRing):
    """The ring rebuilt from :class:`CudaExport`, and the per-slot events opened on our device.

    Args:
        device: the consumer's own CUDA device (its stream waits on the events, its buffer is
            the copy's destination).
        import_device: ``own`` opens the memory handle on ``device`` (peer access is enabled
            lazily; works whatever the visibility); ``exporter`` opens it on the local device with
            the exporter's UUID when visible (torch's default route), else on ``device``.
    """

    carrier = "cuda_ipc"

    def __init__(self, slots: Slots, device: torch.device, import_device: str = "own"):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        super().__init__(slots)
        exp = slots.cuda
        if exp is None or len(slots.events) != slots.num_slots:
            raise TransportError(f"SLOTS from {slots.sender} lacks the CUDA export or one event per slot")
        own = _cuda_index(device)
        open_on = own
        if import_device == "exporter":
            for i in range(torch.cuda.device_count()):
                if exp.device_uuid and _device_uuid(i) == exp.device_uuid:
                    open_on = i
                    break
        elif import_device != "own":
            raise TransportError(f"import_device must be 'own' or 'exporter', got {import_device!r}")
        self.device = torch.device("cuda", own)
        self.open_on = open_on
        with torch.cuda.device(open_on):
            ring = rebuild_cuda_tensor(
                torch.Tensor, torch.Size(exp.size), tuple(exp.stride), exp.tensor_offset, torch.UntypedStorage,
                torch.uint8, open_on, exp.handle, exp.storage_nbytes, exp.storage_offset_bytes, False,
                exp.ref_counter_handle, exp.ref_counter_offset, exp.event_handle, exp.event_sync_required)
        if tuple(ring.shape) != (slots.num_slots, slots.slot_nbytes):
            raise TransportError(f"ring from {slots.sender} rebuilt as {list(ring.shape)}, "
                                 f"expected [{slots.num_slots}, {slots.slot_nbytes}]")
        self.ring = ring
        with torch.cuda.device(own):
            # on the consumer's own device: opening on the producer's device hung on an H200
            self.events = [torch.cuda.Event.from_ipc_handle(self.device, h) for h in slots.events]
        self.ref_counter_handle = exp.ref_counter_handle

    def cleanup_dead_producer(self) -> None:
        """Unlink torch's CUDA IPC ref-counter file (``/dev/shm/torch_<pid>_...``) of a dead producer.

        ``reduce_tensor`` makes the producer create that file; a SIGKILLed producer cannot unlink
        it. Done only when the producer's pid is provably gone (same host, same pid namespace).
        """
        name = self.ref_counter_handle.decode(errors="replace").lstrip("/")
        if not name.startswith("torch_") or "/" in name or not self.producer_gone():
            return
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            log.info("removed %s/%s left by dead producer %s (pid %d)", SHM_DIR, name, self.producer,
                     self.producer_pid)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove %s/%s of dead producer %s: %s", SHM_DIR, name, self.producer, exc)

    def ready(self, slot: int) -> bool:
        try:
            return self.events[slot].query()
        except RuntimeError as exc:  # a CUDA error on the imported event
            raise TransportError(str(exc)) from None

    def copy_slot(self, slot: int, frames: list, dst: torch.Tensor) -> None:
        stream = torch.cuda.current_stream(self.device)
        self.events[slot].wait(stream)
        with torch.cuda.device(self.device):
            dst.copy_(self.ring[slot], non_blocking=True)

    def close(self) -> None:
        # Let copies already enqueued finish before the mapping goes (no new reads are issued).
        torch.cuda.current_stream(self.device).synchronize()
        self.events = []
        self.ring = None
