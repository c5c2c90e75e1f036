"""The producer end of a slot ring (a target worker): fill a slot, publish it to a named consumer.

One ROUTER socket bound at ``endpoint``; consumers connect one DEALER each, whose identity is the
consumer's name. Everything runs in the caller's thread: :meth:`Producer.poll` (also called by
:meth:`~Producer.acquire`) handles HELLO / FREE / HEARTBEAT / STOP and the timers. Typical loop::

    producer = Producer("target.0", "ipc:///run/dir/target.0.sock", spec, num_slots=2, device="cuda:0")
    while working:
        slot = producer.acquire(timeout=1.0)          # None: every slot is still in flight
        if slot is None:
            continue
        fill(producer.slots[slot])                     # on the current CUDA stream
        producer.publish(slot, consumer="drafter.1", job_key=job_key, meta={"data_epoch": e})
        for lost in producer.lost_batches():           # a consumer restarted / was evicted
            reassign(lost.job_key)
    producer.close()

Credits (kept by :class:`~dflash.transport.producer_state.SlotCredits`; this module is the message
loop that drives them): a slot is FREE, ACQUIRED (by the caller) or IN_FLIGHT (published to one
consumer, until that consumer's FREE for that exact fill generation). A slot is never handed out
again while in flight. A consumer restart (a HELLO with a newer consumer incarnation), its STOP (``silent``
included: it dropped this ring after this producer's silence) or its silence past ``peer_timeout_s`` returns its in-flight slots to the pool and reports their batch ids as
:class:`~dflash.transport.producer_state.LostBatch` (``on_lost`` callback and :meth:`Producer.lost_batches`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Optional, Union

import torch
import zmq

from .carriers import make_ring
from .carriers.base import ProducerRing, TransportError, pid_namespace
from .layout import SlotSpec
from .messages import Free, Heartbeat, Hello, MessageError, Ready, Slots, Stop, StopReason, encode
from .peer import DEFAULT_HEARTBEAT_S, DEFAULT_PEER_TIMEOUT_S, SOCKET_HWM, Deadline, Peer, stop_text
from .producer_state import ConsumerState, LostBatch, SlotCredits

__all__ = ["Producer", "PeerUnavailable", "DEFAULT_HEARTBEAT_S", "DEFAULT_PEER_TIMEOUT_S"]

log = logging.getLogger("dflash.transport")

#: Frames of an incoming message on the ROUTER: identity + header.
_ROUTER_FRAMES = 2

class PeerUnavailable(TransportError):
    """``publish`` to a consumer that is not attached (never said HELLO, restarted, evicted, gone)."""


class Producer(Peer):
    """Owns K slots, exports them once, hands filled slots to named consumers under credits.

    Args:
        name: this producer's name (``target.0``); in every message and log line.
        endpoint: ``ipc:///path`` or ``tcp://host:port`` to bind (``tcp://host:0`` picks a free
            port; :attr:`endpoint` then holds the real one).
        spec: the slot's tensors ``{name: (shape, dtype)}``; consumers must use the same spec.
        num_slots: K, the ring size (credits).
        device: where slots live (``cuda:N`` for cuda_ipc, ``cpu`` for shm; either for tcp).
        carrier: ``auto`` (cuda_ipc on CUDA, shm on CPU), ``cuda_ipc``, ``shm`` or ``tcp``: the
            ring's carrier. A consumer that says HELLO with ``tcp`` (one on another host) is served
            over tcp whatever the ring's carrier: each READY brings the slot's bytes.
        heartbeat_s: heartbeat period to attached consumers (s).
        peer_timeout_s: a consumer silent this long (s) is evicted: credits reset, batches lost.
        on_lost: called with each list of :class:`LostBatch` when it is detected (they are also
            kept for :meth:`lost_batches`).
        context: a zmq context (default: the process-wide instance).
        incarnation: this incarnation's id (default :func:`~dflash.transport.messages.new_incarnation`).

    Attributes:
        socket: the ROUTER socket; register it in a caller's ``zmq.Poller`` (``POLLIN``) and call
            :meth:`poll` when it is readable, and at least every :meth:`next_timer_s` seconds.
        endpoint: the bound endpoint (with the real port for ``tcp://host:0``).
        incarnation: this incarnation's id.
        stats: counters ``published``, ``freed``, ``rejected``, ``lost``.

    Raises:
        TransportError: a bad carrier/device combination, a bad spec, an endpoint that cannot bind.
    """

    ROLE = "producer"
    PEER_ROLE = "consumer"
    COUNTED = "published"

    def __init__(self, name: str, endpoint: str, spec: SlotSpec, num_slots: int = 2,
                 device: Union[str, torch.device] = "cpu", carrier: str = "auto", *,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S, peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
                 on_lost: Optional[Callable[[list[LostBatch]], None]] = None,
                 context: Optional[zmq.Context] = None, incarnation: Optional[int] = None):
        super().__init__(name, spec, device, carrier, heartbeat_s, peer_timeout_s, incarnation)
        self._handlers = {Hello: self._on_hello, Free: self._on_free, Heartbeat: self._on_heartbeat,
                          Stop: self._on_stop}
        self.num_slots = num_slots
        self.on_lost = on_lost
        self._ring: ProducerRing = make_ring(self.carrier, self.layout, num_slots, self.device, name)
        self._export = self._ring.export()
        self._credits = SlotCredits(name, num_slots)
        self._consumers: dict[str, ConsumerState] = {}
        self._lost: list[LostBatch] = []
        self._next_heartbeat = time.monotonic() + heartbeat_s
        ctx = context or zmq.Context.instance()
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted consumer takes over its name
        self.socket.setsockopt(zmq.SNDHWM, SOCKET_HWM)
        self.socket.setsockopt(zmq.RCVHWM, SOCKET_HWM)
        try:
            if endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1] in ("0", "*"):
                host = endpoint[len("tcp://"):].rsplit(":", 1)[0]
                port = self.socket.bind_to_random_port(f"tcp://{host}")
                endpoint = f"tcp://{host}:{port}"
            else:
                self.socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self.socket.close(linger=0)
            self._ring.close()
            raise TransportError(f"{name}: cannot bind {endpoint}: {exc}") from None
        self.endpoint = endpoint
        log.info("%s: producer incarnation %d on %s, %d x %.1f MiB slots, carrier %s, device %s", name, self.incarnation,
                 endpoint, num_slots, self.layout.nbytes / 2**20, self.carrier, self.device)

    # ------------------------------------------------------------------ public API

    @property
    def slots(self) -> list[dict[str, torch.Tensor]]:
        """``slots[i]``: the named tensors of slot i (fill them after :meth:`acquire` returns i)."""
        return self._ring.slots

    @property
    def consumers(self) -> list[str]:
        """Names of the attached consumers (those a READY can be addressed to)."""
        return sorted(self._consumers)

    def free_slots(self) -> int:
        """Slots neither acquired nor in flight."""
        return self._credits.free_slots()

    def in_flight(self) -> dict[int, tuple[str, Union[int, str]]]:
        """``{slot: (consumer, job_key)}`` of the slots published and not yet freed."""
        return self._credits.in_flight()

    def acquire(self, timeout: Optional[float] = None) -> Optional[int]:
        """A free slot for the caller to fill, or ``None`` when none frees within ``timeout`` s.

        Handles incoming messages (FREE, HELLO, ...) while it waits; ``timeout=None`` waits
        forever, ``0`` only looks.
        """
        deadline = Deadline(timeout)
        while True:
            self.poll(0)
            slot = self._credits.acquire()
            if slot is not None:
                return slot
            remaining = deadline.left()
            if remaining is not None and remaining <= 0:
                return None
            wait_s = self.heartbeat_s if remaining is None else min(remaining, self.heartbeat_s)
            self.poll(max(1, int(wait_s * 1000)))

    def release(self, slot: int) -> None:
        """Give back an acquired slot without publishing it.

        Raises:
            TransportError: the slot is not acquired by the caller.
        """
        self._credits.release(slot)

    def publish(self, slot: int, consumer: str, job_key: Union[int, str], meta: Optional[dict] = None,
                stream: Optional[Any] = None) -> int:
        """Hand the filled slot to ``consumer``: record the fill event (CUDA), send READY.

        Args:
            slot: a slot returned by :meth:`acquire` and filled on ``stream``.
            consumer: the attached consumer's name (``drafter.1``).
            job_key: the job's key (the coordinator's job key, or any int or str id the caller chooses),
                reported back in :class:`LostBatch`.
            meta: plain msgpack data for the consumer (no tensors).
            stream: the CUDA stream that filled the slot (default: the current stream).
        Returns:
            The fill's generation number.
        Raises:
            TransportError: ``slot`` is not acquired, or ``meta`` is not msgpack data.
            PeerUnavailable: ``consumer`` is not attached or not reachable; the slot stays
                acquired (publish it to another consumer or :meth:`release` it).
        """
        self._credits.check_acquired(slot, "publish")
        peer = self._consumers.get(consumer)
        if peer is None:
            raise PeerUnavailable(f"{self.name}: consumer {consumer!r} is not attached (attached: {self.consumers})")
        generation = self._credits.next_generation(slot)
        meta = dict(meta or {})
        over_tcp = peer.carrier == "tcp"
        try:
            header = encode(Ready(self.name, self.incarnation, peer.incarnation, slot, generation, job_key, meta,
                                  self.layout.nbytes if over_tcp else 0))
        except MessageError as exc:
            raise TransportError(f"{self.name}: cannot publish batch {job_key!r}: {exc}") from None
        self._ring.mark_filled(slot, stream)
        payload = self._ring.host_bytes(slot, stream) if over_tcp else self._ring.payload(slot, stream)
        frames = [peer.identity, header, *payload]
        try:
            self.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=len(frames) == _ROUTER_FRAMES)
        except zmq.ZMQError as exc:
            raise PeerUnavailable(f"{self.name}: cannot send READY to {consumer}: {exc}") from None
        self._credits.send(slot, consumer, job_key, meta, generation)
        self.stats["published"] += 1
        return generation

    def lost_batches(self) -> list[LostBatch]:
        """The batches lost since the last call (and forget them)."""
        lost, self._lost = self._lost, []
        return lost

    def evict(self, consumer: str, reason: str = "stopped") -> list[LostBatch]:
        """Forget ``consumer`` now (e.g. the supervisor saw it die): reset its credits.

        Returns:
            The batches that were in flight to it (also reported like any other loss).
        """
        if consumer not in self._consumers:
            return []
        return self._drop_consumer(consumer, reason)

    def poll(self, timeout_ms: int = 0) -> int:
        """Handle incoming messages (waiting up to ``timeout_ms`` for the first) and the timers.

        Returns:
            The number of messages handled (valid or rejected).
        """
        handled = self._drain(self.socket, self._handle) if self.socket.poll(timeout_ms, zmq.POLLIN) else 0
        self._timers()
        return handled

    # ------------------------------------------------------------------ internals

    def _next_timer(self) -> float:
        return self._next_heartbeat

    def _shutdown(self, stop: Stop) -> None:
        """Tell the attached consumers ``stop``, close the socket and free the ring."""
        for peer in list(self._consumers.values()):
            self._send(peer.identity, stop)
        self.socket.close(linger=100)
        self._ring.close()

    def _send(self, identity: bytes, msg: Any) -> bool:
        return self._send_on(self.socket, [identity], msg, identity)

    def _handle(self, frames: list[bytes]) -> None:
        identity = frames[0]
        sender = identity.decode("utf-8", errors="replace")
        if not sender.isprintable():  # a socket without a name: its raw identity would garble the log
            sender = "0x" + identity.hex()
        if len(frames) != _ROUTER_FRAMES:
            self._reject(sender, f"{len(frames) - 1} frames (expected 1 header frame)")
            return
        self._dispatch(sender, identity, frames[1], [])

    def _on_hello(self, identity: bytes, msg: Hello) -> None:
        known = self._consumers.get(msg.sender)
        if known is not None and msg.incarnation < known.incarnation:
            self._reject(msg.sender, f"HELLO with stale consumer incarnation {msg.incarnation} (current {known.incarnation})", stale=True)
            return
        problem = ""
        if msg.carrier not in (self.carrier, "tcp"):  # every ring also serves tcp (a consumer on another host)
            problem = f"carrier {msg.carrier} != {self.carrier} (nor tcp)"
        elif msg.layout_digest != self.layout.digest:
            problem = f"slot layout {msg.layout_digest} != {self.layout.digest} ({self.layout})"
        elif msg.carrier in ("shm", "cuda_ipc") and msg.host != self.host:
            problem = f"host {msg.host} != {self.host}: {self.carrier} needs the same host (use tcp)"
        if problem:
            self._reject(msg.sender, f"incompatible HELLO: {problem}")
            self._send(identity, Stop(self.name, self.incarnation, StopReason.INCOMPATIBLE, problem))
            return
        if known is not None and msg.incarnation > known.incarnation:
            log.warning("%s: consumer %s restarted (incarnation %d -> %d)", self.name, msg.sender, known.incarnation, msg.incarnation)
            self._drop_consumer(msg.sender, "restarted")
            known = None
        local = msg.carrier == self.carrier and self.carrier != "tcp"
        if local:
            try:
                self._ring.on_hello(msg, self.name, self.incarnation)
            except TransportError as exc:
                log.error("%s: cannot attach %s: %s", self.name, msg.sender, exc)
                return
        now = time.monotonic()
        if known is None:
            self._consumers[msg.sender] = ConsumerState(msg.sender, identity, msg.incarnation, now, carrier=msg.carrier)
            log.info("%s: consumer %s attached (incarnation %d, pid %d, carrier %s)", self.name, msg.sender,
                     msg.incarnation, msg.pid, msg.carrier)
        else:
            known.last_seen = now
        slots = Slots(self.name, self.incarnation, msg.incarnation, os.getpid(), self.host, pid_namespace(), msg.carrier,
                      self.num_slots,
                      self.layout.nbytes, self.layout.describe(), **(self._export if local else {}))
        self._send(identity, slots)

    def _on_free(self, identity: bytes, msg: Free) -> None:
        peer = self._consumers.get(msg.sender)
        if msg.producer_incarnation != self.incarnation:
            self._reject(msg.sender, f"FREE for stale producer incarnation {msg.producer_incarnation} (current {self.incarnation})", stale=True)
            return
        if peer is None or peer.incarnation != msg.incarnation:
            have = "unknown" if peer is None else str(peer.incarnation)
            self._reject(msg.sender, f"FREE from stale consumer incarnation {msg.incarnation} (attached: {have})", stale=True)
            return
        peer.last_seen = time.monotonic()
        problem = self._credits.free(msg.ring_slot, msg.sender, msg.generation)
        if problem:
            self._reject(msg.sender, problem)
            return
        self.stats["freed"] += 1

    def _on_heartbeat(self, identity: bytes, msg: Heartbeat) -> None:
        peer = self._consumers.get(msg.sender)
        if peer is not None and peer.incarnation == msg.incarnation and msg.peer_incarnation == self.incarnation:
            peer.last_seen = time.monotonic()
            return
        if peer is not None and msg.incarnation < peer.incarnation:
            self._reject(msg.sender, f"HEARTBEAT from stale consumer incarnation {msg.incarnation} (current {peer.incarnation})", stale=True)
            return
        # The consumer knows another incarnation of us, or we do not know it: tell it our incarnation;
        # it answers with HELLO.
        self._send(identity, self._heartbeat(peer.incarnation if peer else 0))

    def _on_stop(self, identity: bytes, msg: Stop) -> None:
        peer = self._consumers.get(msg.sender)
        if peer is None or peer.incarnation != msg.incarnation:
            self._reject(msg.sender, f"STOP from unknown or stale consumer incarnation {msg.incarnation}", stale=True)
            return
        log.log(logging.WARNING if msg.reason == StopReason.SILENT else logging.INFO, "%s: consumer %s stopped (%s)",
                self.name, msg.sender, stop_text(msg))
        # SILENT: it dropped our ring while we were busy; it attaches again with HELLO
        self._drop_consumer(msg.sender, "timeout" if msg.reason == StopReason.SILENT else "stopped")

    def _drop_consumer(self, name: str, reason: str) -> list[LostBatch]:
        self._consumers.pop(name, None)
        lost = self._credits.reclaim(name, reason)
        if lost:
            self.stats["lost"] += len(lost)
            log.warning("%s: %d batch(es) in flight to %s lost (%s): %s", self.name, len(lost), name, reason,
                        [b.job_key for b in lost])
            self._lost.extend(lost)
            if self.on_lost is not None:
                self.on_lost(lost)
        return lost

    def _timers(self) -> None:
        now = time.monotonic()
        for peer in list(self._consumers.values()):
            if self._silent(peer.name, peer.last_seen, now, "evicted"):
                self._send(peer.identity, self._silence_stop(StopReason.EVICTED))
                self._drop_consumer(peer.name, "timeout")
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat_s
            for peer in self._consumers.values():
                self._send(peer.identity, self._heartbeat(peer.incarnation))
