"""Carriers: how a ring of slots is shared between a producer and a consumer.

One protocol, three carriers (docs/ARCHITECTURE.md, The data plane). A producer owns a *ring*: one ``[K, slot_nbytes]``
uint8 buffer (K slots, each laid out by :class:`~dflash.transport.layout.SlotLayout`), allocated
and exported **once** per producer incarnation. A consumer *imports* it once per (producer, incarnation)
and copies one slot at a time into its own buffer.

``cuda_ipc`` (GPU, same host)
    The ring is one CUDA allocation, exported with
    ``torch.multiprocessing.reductions.reduce_tensor``; its fields travel as msgpack
    (:class:`~dflash.transport.messages.CudaExport`), never pickle. The consumer rebuilds it with
    ``rebuild_cuda_tensor`` once per (producer, incarnation) — each ``reduce_tensor`` call is a separate
    reference count (vLLM #51258), so the producer exports once and every consumer imports once.
    One interprocess CUDA event per slot, recorded after every fill; the consumer opens each event
    handle once **on its own device** (opening it on the producer's device hung on an H200) and
    waits on it on its own stream before every copy (a cached import skips the export-time event
    wait, so the per-fill event is the only valid guard). Slot memory is allocated with
    ``expandable_segments`` off: expandable-segment IPC needs ``pidfd_getfd``, which containers
    refuse (EPERM).

``shm`` (CPU, same host)
    The ring lives in an anonymous ``memfd`` (sealed against resizing), never in ``/dev/shm``:
    the producer passes the file descriptor to each consumer over a unix socket
    (``SCM_RIGHTS``, ``socket.send_fds``) bound in the *abstract* namespace, which has no file
    either. The memory is freed by the kernel when the last process holding a mapping or a
    descriptor exits, so nothing survives any exit, SIGKILL included, and there is no name to
    clean up. The consumer checks the sender's pid with ``SO_PEERCRED``.

``tcp`` (another node; works on any endpoint)
    The slot's bytes follow the READY header as one zmq frame (zero-copy from the producer's slot:
    the credit protocol guarantees the slot is not refilled before the consumer's FREE). A CUDA
    producer stages the slot through a pinned host mirror; a CUDA consumer copies from the frame.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import select
import socket
import struct
import time
import warnings
from typing import Any, Iterator, Optional

import msgpack
import torch

from .layout import SlotLayout
from .messages import PROTOCOL_VERSION, CudaExport, Hello, Slots

__all__ = [
    "CARRIERS",
    "TransportError",
    "resolve_carrier",
    "host_id",
    "pid_namespace",
    "ProducerRing",
    "CudaIpcRing",
    "ShmRing",
    "TcpRing",
    "make_ring",
    "ImportedRing",
    "CudaIpcImport",
    "ShmImport",
    "TcpImport",
    "FdMailbox",
]

log = logging.getLogger("dflash.transport")

CARRIERS = ("cuda_ipc", "shm", "tcp")

#: Seconds a producer waits to connect to a consumer's fd socket and hand over the memfd.
FD_SEND_TIMEOUT_S = 2.0
#: Seconds a consumer waits for the memfd after its SLOTS arrived (it was sent before SLOTS).
FD_RECV_TIMEOUT_S = 5.0
#: Pending connections on a consumer's fd socket.
FD_BACKLOG = 64
#: Largest fd-passing header (msgpack ``[version, producer, incarnation, nbytes]``).
FD_HEADER_MAX = 4096
#: Abstract unix socket names are limited to 107 bytes (108 with the leading NUL).
UNIX_NAME_MAX = 107
#: Linux memfd seals (``fcntl.F_SEAL_*``; spelled out for Pythons that lack the constants).
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW = 0x0001, 0x0002, 0x0004
F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
#: Where POSIX shared memory names live on Linux.
SHM_DIR = "/dev/shm"


class TransportError(RuntimeError):
    """A transport operation failed (bad arguments, an unusable peer, a missing device)."""


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


def process_gone(pid: int) -> bool:
    """True when ``pid`` does not exist or is a zombie (its CUDA context and memory are gone
    before it is reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2:][:1]  # the field after "(comm)"
    return state in (b"Z", b"X")


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


# --------------------------------------------------------------------------- producer side


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


class ShmRing(ProducerRing):
    """A CPU ring in a sealed anonymous memfd, passed to consumers with ``SCM_RIGHTS``."""

    carrier = "shm"

    def __init__(self, layout: SlotLayout, num_slots: int, device: torch.device, name: str = "ring"):
        if device.type != "cpu":
            raise TransportError(f"shm holds CPU slots, got {device}")
        self._memfd_name = f"dflash-{name}"
        super().__init__(layout, num_slots, device)

    def _allocate(self) -> torch.Tensor:
        total = self.num_slots * self.layout.nbytes
        self.fd = os.memfd_create(self._memfd_name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, total)
        fcntl.fcntl(self.fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
        self._mm = mmap.mmap(self.fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return torch.frombuffer(self._mm, dtype=torch.uint8).view(self.num_slots, self.layout.nbytes)

    def on_hello(self, hello: Hello, producer: str, incarnation: int) -> None:
        if not hello.fd_socket:
            raise TransportError(f"{hello.sender} announced no fd socket for the shm carrier")
        header = msgpack.packb([PROTOCOL_VERSION, producer, incarnation, self.num_slots * self.layout.nbytes])
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(FD_SEND_TIMEOUT_S)
            sock.connect("\0" + hello.fd_socket)
            socket.send_fds(sock, [header], [self.fd])
        except OSError as exc:
            raise TransportError(f"cannot pass the ring's memfd to {hello.sender} at @{hello.fd_socket}: {exc}") from None
        finally:
            sock.close()

    def close(self) -> None:
        super().close()
        with contextlib.suppress(BufferError):  # a caller still holds a slot view: GC unmaps later
            self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


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


def make_ring(carrier: str, layout: SlotLayout, num_slots: int, device: torch.device, name: str) -> ProducerRing:
    """Allocate and export a producer's ring for ``carrier`` (resolved: not ``auto``)."""
    if carrier == "cuda_ipc":
        return CudaIpcRing(layout, num_slots, device)
    if carrier == "shm":
        return ShmRing(layout, num_slots, device, name=name)
    if carrier == "tcp":
        return TcpRing(layout, num_slots, device)
    raise TransportError(f"unknown carrier {carrier!r}")


# --------------------------------------------------------------------------- consumer side


class FdMailbox:
    """A consumer's abstract unix socket where producers drop the memfd of their ring.

    Producers connect and send ``[version, producer, incarnation, nbytes]`` plus one descriptor
    (``SCM_RIGHTS``); the mailbox keeps the latest descriptor per (producer, incarnation) until
    :meth:`take` claims it, and closes superseded ones.
    """

    def __init__(self, owner: str, incarnation: int):
        name = f"dflash-fds/{owner}/{incarnation}/{os.getpid()}"
        if len(name) > UNIX_NAME_MAX:
            name = name[-UNIX_NAME_MAX:]
        self.address = name
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.sock.bind("\0" + name)
        self.sock.listen(FD_BACKLOG)
        self.sock.setblocking(False)
        #: (producer, incarnation) → (fd, nbytes, sender pid)
        self._fds: dict[tuple[str, int], tuple[int, int, int]] = {}

    def _drain(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            try:
                conn.settimeout(FD_RECV_TIMEOUT_S)
                pid, _uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                       struct.calcsize("3i")))
                data, fds, _flags, _addr = socket.recv_fds(conn, FD_HEADER_MAX, 1)
            except OSError as exc:
                log.error("fd mailbox %s: a connection failed: %s", self.address, exc)
                continue
            finally:
                conn.close()
            try:
                version, producer, incarnation, nbytes = msgpack.unpackb(data, raw=False)
                ok = version == PROTOCOL_VERSION and isinstance(producer, str) and len(fds) == 1
            except (ValueError, TypeError, msgpack.UnpackException) as exc:
                ok, producer = False, f"pid {pid}"
                log.error("fd mailbox %s: rejected a malformed fd message from pid %d: %s", self.address, pid, exc)
            if not ok:
                for fd in fds:
                    os.close(fd)
                continue
            old = self._fds.pop((producer, incarnation), None)
            if old is not None:
                os.close(old[0])
            self._fds[(producer, incarnation)] = (fds[0], int(nbytes), pid)

    def take(self, producer: str, incarnation: int, pid: int, nbytes: int, timeout_s: float = FD_RECV_TIMEOUT_S) -> int:
        """The ring's descriptor from ``producer`` incarnation ``incarnation`` (the caller owns it).

        Raises:
            TransportError: none arrived within ``timeout_s``, or it came from another pid or
                announces another size.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            self._drain()
            entry = self._fds.pop((producer, incarnation), None)
            if entry is not None:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportError(f"no ring descriptor from {producer} (incarnation {incarnation}) within {timeout_s:.1f} s")
            select.select([self.sock], [], [], remaining)
        fd, got_nbytes, got_pid = entry
        if got_pid != pid or got_nbytes != nbytes:
            os.close(fd)
            raise TransportError(f"ring descriptor from {producer}: pid {got_pid} / {got_nbytes} B, "
                                 f"expected pid {pid} / {nbytes} B")
        return fd

    def discard_older(self, producer: str, incarnation: int) -> None:
        """Close descriptors of ``producer`` from incarnations up to ``incarnation``."""
        for key in [k for k in self._fds if k[0] == producer and k[1] <= incarnation]:
            os.close(self._fds.pop(key)[0])

    def close(self) -> None:
        for fd, _, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.sock.close()


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
        return self.same_process_space and process_gone(self.producer_pid)


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
        if not name.startswith("torch_") or "/" in name or not self.same_process_space or not process_gone(self.producer_pid):
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


class ShmImport(ImportedRing):
    """The producer's memfd ring, mapped once; the descriptor is closed right after mapping."""

    carrier = "shm"

    def __init__(self, slots: Slots, mailbox: FdMailbox):
        super().__init__(slots)
        total = slots.num_slots * slots.slot_nbytes
        fd = mailbox.take(slots.sender, slots.incarnation, slots.pid, total)
        try:
            if os.fstat(fd).st_size != total:
                raise TransportError(f"ring memfd from {slots.sender} has {os.fstat(fd).st_size} B, expected {total}")
            # MAP_POPULATE: fault the pages in now, not during the first copies
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(fd, total, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.ring = torch.frombuffer(self._mm, dtype=torch.uint8).view(slots.num_slots, slots.slot_nbytes)

    def copy_slot(self, slot: int, frames: list, dst: torch.Tensor) -> None:
        dst.copy_(self.ring[slot])

    def close(self) -> None:
        self.ring = None
        with contextlib.suppress(BufferError):
            self._mm.close()


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
