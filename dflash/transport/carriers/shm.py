"""The ``shm`` carrier (CPU, same host): a sealed anonymous memfd passed over a unix socket.

The ring lives in an anonymous ``memfd`` (sealed against resizing), never in ``/dev/shm``: the
producer passes the file descriptor to each consumer over a unix socket (``SCM_RIGHTS``,
``socket.send_fds``) bound in the *abstract* namespace, which has no file either. The memory is
freed by the kernel when the last process holding a mapping or a descriptor exits, so nothing
survives any exit, SIGKILL included, and there is no name to clean up. The consumer checks the
sender's pid with ``SO_PEERCRED``.

:class:`ShmRing` is the producer's ring, :class:`FdMailbox` the consumer's socket where producers
drop their descriptors, :class:`ShmImport` the consumer's mapping of one ring.
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

import msgpack
import torch

from ..layout import SlotLayout
from ..messages import PROTOCOL_VERSION, Hello, Slots
from .base import ImportedRing, ProducerRing, TransportError

__all__ = ["ShmRing", "FdMailbox", "ShmImport"]

log = logging.getLogger("dflash.transport")

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
