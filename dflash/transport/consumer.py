"""The consumer end (a drafter worker): receive filled slots from any producer into its own buffer.

The consumer connects one DEALER (identity = its name) to every producer's endpoint, says HELLO,
imports each producer's ring once per producer incarnation, and turns each READY into a
:class:`Received`: the slot's tensors copied into the consumer's **own static buffer** (fixed
addresses, so a captured CUDA graph can read them), after which the slot is freed (FREE) at once.

This module is the consumer's message loop and receive path; what it knows about each producer
(incarnations, held ring slots, pending READYs, copies in progress) is kept by
:mod:`dflash.transport.consumer_state`.

Everything runs in the caller's thread. To wait on the transport together with other sockets
(e.g. the coordinator's), register :attr:`Consumer.sockets` in the caller's ``zmq.Poller`` and
call :meth:`Consumer.poll` (then :meth:`Consumer.receive` with ``timeout=0``) when one is
readable, and at least every :meth:`Consumer.next_timer_s` seconds for heartbeats::

    consumer = Consumer("drafter.0", {"target.0": ep0, "target.1": ep1}, spec, device="cuda:5")
    poller = zmq.Poller()
    poller.register(coordinator_socket, zmq.POLLIN)
    for s in consumer.sockets:
        poller.register(s, zmq.POLLIN)
    while running:
        events = dict(poller.poll(timeout=int(1000 * consumer.next_timer_s())))
        consumer.poll(0)
        got = consumer.receive(timeout=0)   # None when nothing is pending
        if got is not None:
            train_step(got.tensors)         # valid until the next receive()
        ...
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Callable, Any, Collection, Optional, Union

import torch
import zmq

from .carriers import import_ring
from .carriers.base import TransportError
from .carriers.shm import FdMailbox
from .consumer_state import CopyQueue, PendingQueue, PendingReady, ProducerLink, Received
from .layout import SlotSpec
from .messages import Free, Heartbeat, Hello, Ready, Slots, Stop, StopReason
from .peer import DEFAULT_HEARTBEAT_S, DEFAULT_PEER_TIMEOUT_S, SOCKET_HWM, Deadline, Peer, stop_text

__all__ = ["Consumer"]

log = logging.getLogger("dflash.transport")

#: How long ``close`` lets queued STOP messages leave (ms).
CLOSE_LINGER_MS = 200
#: Retry period (s) of a HELLO that could not be sent (the producer is not connected yet).
HELLO_RETRY_S = 0.05
#: While a pending READY's fill event is not complete, ``receive`` re-checks it every ms.
EVENT_POLL_MS = 1
#: A READY blocked on its fill event this long (s) makes the consumer check that the producer's
#: process still exists (same host): a dead producer's event may never complete.
BLOCKED_CHECK_S = 0.5


class Consumer(Peer):
    """Receives slots from several producers into its own static buffer; returns credits.

    Args:
        name: this consumer's name (``drafter.0``), its socket identity at every producer.
        producers: ``{producer name: endpoint}``.
        spec: the slot spec, identical to the producers'.
        device: where the consumer's buffer lives (``cuda:N`` or ``cpu``).
        carrier: ``auto`` (cuda_ipc on CUDA, shm on CPU), ``cuda_ipc``, ``shm`` or ``tcp``; must
            match the producers' (of those not in ``remote``).
        remote: producers on another host: their slots come over ``tcp`` whatever ``carrier``
            is (a producer serves tcp to any consumer that asks for it).
        num_buffers: own buffers used round-robin (``Received.tensors`` stay valid for
            ``num_buffers - 1`` further receives).
        heartbeat_s, peer_timeout_s: liveness (s); a producer silent past the timeout is dropped
            (its mapping released, its pending READYs discarded).
        sync: CUDA only. True: ``receive`` waits for its copy, then sends FREE (simple, costs a
            host sync). False: FREE is sent by a later ``poll``/``receive`` once the copy's event
            has completed (no host sync; the producer's slot stays busy a little longer).
        import_device: cuda_ipc: ``own`` (open producers' memory on this consumer's device) or
            ``exporter`` (on the exporting GPU when it is visible here); see
            :class:`~dflash.transport.carriers.cuda_ipc.CudaIpcImport`.
        host_gate: cuda_ipc: take a READY only once its fill event has completed (checked with a
            non-blocking ``query``), then wait on it on the stream as well. A producer that dies
            between its event record and the fill's completion then cannot stall this
            consumer's stream forever (the READY is dropped with the dead producer's ring).
            ``False``: stream wait only (lets the copy be enqueued before the fill ends).
        context: a zmq context (default: the process-wide instance).
        incarnation: this incarnation's id (default: a new one).

    Raises:
        TransportError: a bad carrier/device combination or spec.
    """

    ROLE = "consumer"
    PEER_ROLE = "producer"
    COUNTED = "received"

    def __init__(self, name: str, producers: dict[str, str], spec: SlotSpec,
                 device: Union[str, torch.device] = "cpu", carrier: str = "auto", *, num_buffers: int = 1,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S, peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
                 sync: bool = True, import_device: str = "own", host_gate: bool = True,
                 remote: Collection[str] = (), context: Optional[zmq.Context] = None, incarnation: Optional[int] = None):
        if num_buffers < 1:
            raise TransportError(f"num_buffers must be >= 1, got {num_buffers}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(name, spec, device, carrier, heartbeat_s, peer_timeout_s, incarnation)
        self._handlers = {Slots: self._on_slots, Ready: self._on_ready, Heartbeat: self._on_heartbeat,
                          Stop: self._on_stop}
        self.sync = sync or self.device.type != "cuda"
        self.import_device = import_device
        self.host_gate = host_gate
        #: ``[num_buffers, slot_nbytes]`` uint8: the consumer's own static input buffer(s).
        self.buffers = torch.zeros(num_buffers, self.layout.nbytes, dtype=torch.uint8, device=self.device)
        self._views = [self.layout.views(self.buffers[i]) for i in range(num_buffers)]
        self._next_buffer = 0
        self._pending = PendingQueue()
        #: CUDA copies enqueued and not yet known complete (their FREEs wait)
        self._copies = CopyQueue()
        unknown = sorted(set(remote) - set(producers))
        if unknown:
            raise TransportError(f"{name}: remote producer(s) {unknown} are not among the producers {sorted(producers)}")
        local = [p for p in producers if p not in remote]
        self._mailbox = FdMailbox(name, self.incarnation) if self.carrier == "shm" and local else None
        ctx = context or zmq.Context.instance()
        self._links: dict[str, ProducerLink] = {}
        self._by_socket: dict[zmq.Socket, ProducerLink] = {}
        self._poller = zmq.Poller()
        for producer, endpoint in producers.items():
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, name.encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a producer that is not connected
            sock.setsockopt(zmq.SNDHWM, SOCKET_HWM)
            sock.setsockopt(zmq.RCVHWM, SOCKET_HWM)
            sock.connect(endpoint)
            link = ProducerLink(producer, endpoint, sock, carrier="tcp" if producer in remote else self.carrier)
            self._links[producer] = link
            self._by_socket[sock] = link
            self._poller.register(sock, zmq.POLLIN)
        log.info("%s: consumer incarnation %d, carrier %s, device %s, producers %s", name, self.incarnation, self.carrier,
                 self.device, ", ".join(f"{p}@{e}" + (" (tcp)" if p in remote else "") for p, e in producers.items()))
        self._timers()

    # ------------------------------------------------------------------ public API

    @property
    def sockets(self) -> list[zmq.Socket]:
        """The DEALER sockets (one per producer), to register in a caller's ``zmq.Poller``."""
        return [link.socket for link in self._links.values()]

    def attached(self) -> dict[str, int]:
        """``{producer: incarnation}`` of the producers whose ring is imported and attached."""
        return {p: link.incarnation for p, link in self._links.items() if link.attached}

    def stopped(self) -> dict[str, str]:
        """``{producer: reason}`` of the producers that sent STOP (cleared when they re-attach)."""
        return {p: link.stopped for p, link in self._links.items() if link.stopped}

    def imports(self) -> int:
        """Rings currently imported (one per producer at most: the import cache)."""
        return sum(1 for link in self._links.values() if link.ring is not None)

    def pending(self) -> int:
        """READYs received and not yet taken by :meth:`receive`."""
        return len(self._pending)

    def wait_attached(self, producers: Optional[list[str]] = None, timeout: float = 30.0) -> bool:
        """Poll until every producer in ``producers`` (default: all) is attached; False on timeout."""
        want = list(self._links) if producers is None else producers
        deadline = Deadline(timeout)
        while not all(self._links[p].attached for p in want):
            remaining = deadline.left()
            if remaining <= 0:
                return False
            self.poll(max(1, int(min(remaining, self.heartbeat_s) * 1000)))
        return True

    def receive(self, timeout: Optional[float] = None,
                match: Optional[Callable[[Union[int, str], dict], bool]] = None) -> Optional[Received]:
        """The next batch from any producer (arrival order), or ``None`` after ``timeout`` s.

        Copies the slot into the next own buffer (cuda_ipc: after waiting on the fill's
        interprocess event on this consumer's current stream), then frees the slot (``sync``)
        or queues its FREE until the copy completes. ``timeout=None`` waits forever, ``0``
        only looks.

        Args:
            match: ``match(job_key, meta) -> bool``: take only a READY it accepts; the others
                stay pending (their slots held) for later calls. ``None`` = the oldest.
        """
        deadline = Deadline(timeout)
        while True:
            self.poll(0)  # drain first: a STOP/EVICTED or a new incarnation invalidates pending READYs
            item, blocked = self._pending.pop(match, self._fill_done if self.host_gate else None)
            if item is not None:
                got = self._take(item)
                if got is not None:
                    return got
                continue
            if deadline.passed():
                return None
            if self._copies and not blocked:
                # Nothing to take while slots we hold are still being copied out: a READY may
                # need our FREE first, so wait for the oldest copy (GPU-bound, short) and free
                # its slot now rather than at the next socket timeout.
                if not self._wait(0):
                    self._flush_copies(block=False, wait_oldest=True)
                continue
            wait_s = max(0.001, min(self.heartbeat_s, self.next_timer_s()))
            remaining = deadline.left()
            if remaining is not None:
                wait_s = min(wait_s, remaining)
            # a READY whose fill is still running on the producer's GPU: look again in a ms
            self._wait(EVENT_POLL_MS if blocked else max(1, int(wait_s * 1000)))

    def _fill_done(self, item: PendingReady) -> bool:
        try:
            return item.link.ring.ready(item.msg.ring_slot)
        except TransportError as exc:
            log.error("%s: fill event of %s slot %d unusable (%s): dropping its ring", self.name,
                      item.link.producer, item.msg.ring_slot, exc)
            self._drop_ring(item.link, "fill event failed", dead=True)
            return False

    def poll(self, timeout_ms: int = 0) -> int:
        """Handle incoming messages (waiting up to ``timeout_ms`` for the first), finished copies
        (their FREEs) and the timers.

        Returns:
            The number of messages handled (valid or rejected).
        """
        handled = self._wait(timeout_ms)
        self._flush_copies(block=False)
        self._timers()
        return handled

    # ------------------------------------------------------------------ internals

    def _next_timer(self) -> float:
        return min((link.next_timer for link in self._links.values()), default=time.monotonic())

    def _shutdown(self, stop: Stop) -> None:
        """Finish copies, free what is held, tell the attached producers ``stop``, drop every mapping."""
        self._flush_copies(block=True)
        for link in self._links.values():
            if link.attached:
                self._send(link, stop)
            self._drop_ring(link, "closing")
            link.socket.close(linger=CLOSE_LINGER_MS)
        if self._mailbox is not None:
            self._mailbox.close()

    def _wait(self, timeout_ms: int) -> int:
        """Receive and handle messages from all producers; wait up to ``timeout_ms`` for the first."""
        handled = 0
        if len(self._links) == 1:
            link = next(iter(self._links.values()))
            ready = [link.socket] if link.socket.poll(timeout_ms, zmq.POLLIN) else []
        else:
            ready = [s for s, _ in self._poller.poll(timeout_ms)]
        for sock in ready:
            link = self._by_socket[sock]
            handled += self._drain(sock, functools.partial(self._handle, link), copy=False)
        return handled

    def _handle(self, link: ProducerLink, frames: list) -> None:
        """One message from ``link``'s socket: its header frame, then (tcp READY) the payload."""
        self._dispatch(link.producer, link, frames[0].bytes, frames[1:])

    def _send(self, link: ProducerLink, msg: Any) -> bool:
        # False when not connected (IMMEDIATE) or the queue is full: the timers retry
        return self._send_on(link.socket, [], msg, link.producer)

    def _hello(self, link: ProducerLink) -> bool:
        return self._send(link, Hello(self.name, self.incarnation, os.getpid(), self.host, link.carrier, self.layout.digest,
                               self._mailbox.address if self._mailbox is not None else ""))

    def _check_incarnation(self, link: ProducerLink, msg: Any) -> bool:
        """True for a message of the attached producer incarnation. An older incarnation is rejected as stale;
        a newer one means the producer restarted: drop the old ring (its handles are never
        touched again) and say HELLO to the new incarnation."""
        if msg.incarnation < link.newest:
            self._reject(link.producer, f"{type(msg).__name__} from stale producer incarnation {msg.incarnation} (current {link.newest})", stale=True)
            return False
        if msg.incarnation > link.newest:
            if link.newest:
                log.warning("%s: producer %s restarted (incarnation %d -> %d): dropping the old ring", self.name,
                            link.producer, link.newest, msg.incarnation)
                self._drop_ring(link, "producer restarted", dead=True)
            link.newest = msg.incarnation
        if link.attached and msg.incarnation == link.incarnation:
            return True
        self._hello(link)
        return False

    def _on_slots(self, link: ProducerLink, msg: Slots) -> None:
        if msg.consumer_incarnation != self.incarnation:
            self._reject(link.producer, f"SLOTS for stale consumer incarnation {msg.consumer_incarnation} (this is {self.incarnation})", stale=True)
            return
        if msg.incarnation < link.newest:
            self._reject(link.producer, f"SLOTS from stale producer incarnation {msg.incarnation} (current {link.newest})", stale=True)
            return
        link.newest = msg.incarnation
        link.last_seen = time.monotonic()
        if link.attached and msg.incarnation == link.incarnation:
            return  # a duplicate answer to a repeated HELLO
        problem = link.slots_problem(msg, self.layout)
        if problem:
            self._reject(link.producer, problem)
            return
        if link.ring is not None and msg.incarnation != link.incarnation:
            self._drop_ring(link, "producer restarted", dead=True)
        if link.ring is None:  # import once per (producer, incarnation)
            try:
                link.ring = import_ring(msg, link.carrier, self.device, self.import_device, self._mailbox)
            except (TransportError, RuntimeError, OSError) as exc:
                log.error("%s: cannot import the ring of %s (incarnation %d): %s", self.name, link.producer, msg.incarnation, exc)
                return
            self.stats["imports"] += 1
        link.incarnation = msg.incarnation
        link.attached = True
        link.stopped = ""
        log.info("%s: attached to %s incarnation %d (%d slots of %.1f MiB, %s)", self.name, link.producer, msg.incarnation,
                 msg.num_slots, msg.slot_nbytes / 2**20, msg.carrier)

    def _on_ready(self, link: ProducerLink, msg: Ready, payload: list) -> None:
        if not self._check_incarnation(link, msg):
            return
        link.last_seen = time.monotonic()
        if msg.consumer_incarnation != self.incarnation:
            self._reject(link.producer, f"READY for stale consumer incarnation {msg.consumer_incarnation} (this is {self.incarnation})", stale=True)
            return
        problem = link.hold(msg, payload)
        if problem:
            self._reject(link.producer, problem)
            return
        self._pending.append(PendingReady(link, msg, payload))

    def _on_heartbeat(self, link: ProducerLink, msg: Heartbeat) -> None:
        if not self._check_incarnation(link, msg):
            return
        link.last_seen = time.monotonic()
        if msg.peer_incarnation != self.incarnation:  # the producer lost track of us: attach again
            self._hello(link)

    def _on_stop(self, link: ProducerLink, msg: Stop) -> None:
        if msg.incarnation < link.newest:
            self._reject(link.producer, f"STOP from stale producer incarnation {msg.incarnation} (current {link.newest})", stale=True)
            return
        level = logging.INFO if msg.reason == StopReason.DONE else logging.ERROR
        log.log(level, "%s: %s sent STOP (%s)", self.name, link.producer, stop_text(msg))
        if msg.reason == StopReason.EVICTED:
            if msg.incarnation == link.incarnation:
                # Same incarnation: keep the import (cached per incarnation), forget what was in flight.
                self._forget_in_flight(link, "evicted")
                link.attached = False
            else:  # its ring is already dropped (this side timed out too) or is of an older incarnation
                self._drop_ring(link, "evicted", dead=True)
            self._hello(link)  # attach again at once: the producer is alive
            return
        link.stopped = msg.reason
        self._drop_ring(link, f"producer sent STOP ({msg.reason})")

    def _forget_in_flight(self, link: ProducerLink, why: str) -> None:
        dropped = self._pending.drop(link)
        if dropped:
            log.warning("%s: dropping %d pending batch(es) from %s (%s): %s", self.name, len(dropped),
                        link.producer, why, dropped)
            self.stats["dropped"] += len(dropped)
        self._copies.forget(link)
        link.held.clear()

    def _drop_ring(self, link: ProducerLink, why: str, dead: bool = False) -> None:
        """Forget a producer incarnation: pending READYs, held slots and the imported ring.

        ``dead``: the incarnation ended without a clean STOP (restart or silence): also remove
        what it could not clean up itself (torch's CUDA IPC ref-counter file, once its process
        is gone).
        """
        self._forget_in_flight(link, why)
        released = link.release_ring(dead)
        if released is not None:
            log.info("%s: released the ring of %s incarnation %d (%s)", self.name, link.producer, released, why)

    def _take(self, item: PendingReady) -> Optional[Received]:
        link, msg = item.link, item.msg
        if link.ring is None or not link.attached or link.incarnation != msg.incarnation:
            return None  # its producer incarnation was dropped meanwhile
        ipc = link.ring.carrier == "cuda_ipc"
        if ipc and link.ring.producer_gone():  # never read the memory of a dead producer
            self._drop_ring(link, "producer process gone", dead=True)
            return None
        started = time.perf_counter()
        index = self._next_buffer
        self._next_buffer = (index + 1) % self.buffers.shape[0]
        dst = self.buffers[index]  # copies into one buffer are ordered by the stream
        try:
            link.ring.copy_slot(msg.ring_slot, item.frames, dst)
        except TransportError as exc:
            self._reject(link.producer, str(exc))
            link.held.pop(msg.ring_slot, None)
            return None
        if self.device.type == "cuda":
            self._copies.record(torch.cuda.current_stream(self.device), link, msg.ring_slot, msg.generation)
            self._flush_copies(block=self.sync)
            if ipc and self.sync and link.ring is not None and link.ring.producer_gone():
                # it died while we copied: the bytes may be garbage, do not hand them out
                self._drop_ring(link, "producer died during a copy", dead=True)
                return None
        else:
            self._free(link, msg.ring_slot, msg.generation)
        self.stats["received"] += 1
        # host seconds spent taking slots: the copy until complete with ``sync``, its launch otherwise
        self.stats["copy_s"] += time.perf_counter() - started
        return Received(link.producer, msg.incarnation, msg.job_key, msg.meta, msg.ring_slot, msg.generation, index,
                        self._views[index])

    def _free(self, link: ProducerLink, slot: int, generation: int) -> None:
        if link.release(slot, generation):
            self._send(link, Free(self.name, self.incarnation, link.incarnation, slot, generation))

    def _flush_copies(self, block: bool, wait_oldest: bool = False) -> None:
        """Send FREE for every finished copy, in order (``block``: wait for all of them;
        ``wait_oldest``: wait for the first one only)."""
        for link, slot, generation in self._copies.finished(block, wait_oldest):
            self._free(link, slot, generation)

    def _timers(self) -> None:
        now = time.monotonic()
        for item in self._pending:
            ring = item.link.ring
            if ring is not None and now - item.arrived > BLOCKED_CHECK_S and ring.producer_gone():
                log.warning("%s: producer %s (pid %d) is gone: dropping its ring", self.name, item.link.producer,
                            ring.producer_pid)
                self._drop_ring(item.link, "producer process gone", dead=True)
        for link in self._links.values():
            if link.attached and self._silent(link.producer, link.last_seen, now, "dropping its ring"):
                # It may only be busy: STOP(silent) makes it reclaim the slots in flight to us and report
                # their batches lost (READYs it sends before reading the STOP are discarded here);
                # our next HELLO, behind the STOP on the same connection, attaches again.
                self._send(link, self._silence_stop(StopReason.SILENT))
                self._drop_ring(link, "timeout", dead=True)
            if now >= link.next_timer:
                if link.attached:
                    self._send(link, self._heartbeat(link.incarnation))
                    link.next_timer = now + self.heartbeat_s
                else:
                    sent = self._hello(link)
                    # a producer that said STOP (done, incompatible) is asked again only rarely
                    period = self.peer_timeout_s if link.stopped else self.heartbeat_s
                    link.next_timer = now + (period if sent else min(HELLO_RETRY_S, period))
