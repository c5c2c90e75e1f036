"""What both ends of the data plane share: identity, message intake, sends, liveness and close.

:class:`Peer` is the base of :class:`~dflash.transport.producer.Producer` (one ROUTER socket,
many consumers) and :class:`~dflash.transport.consumer.Consumer` (one DEALER socket per
producer). It owns what the two do alike:

* the identity of this end: name, device, resolved carrier, slot layout, incarnation, host;
* the intake of one message: decode, check that it comes from the socket identity it claims,
  refuse payload frames on anything but READY, route it to the handler of its type, and count and
  log (:meth:`Peer._reject`) whatever is not acted on;
* non-blocking sends that report failure instead of raising (the timers retry);
* liveness: the heartbeat message, the silence check against ``peer_timeout_s`` and the STOP
  that tells a silent peer it was dropped;
* an idempotent :meth:`Peer.close` (a STOP to each attached peer, then the subclass's teardown) and
  the context manager.

What differs stays in the subclasses: routing (identity frame or one socket per peer), the
per-peer state (:mod:`~dflash.transport.producer_state`, :mod:`~dflash.transport.consumer_state`)
and the handlers themselves.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable, ClassVar, Optional, TypeVar, Union

import torch
import zmq

from .carriers import resolve_carrier
from .carriers.base import TransportError, host_id
from .layout import SlotLayout, SlotSpec
from .messages import Heartbeat, MessageError, Ready, Stop, StopReason, decode, encode, new_incarnation

__all__ = ["DEFAULT_HEARTBEAT_S", "DEFAULT_PEER_TIMEOUT_S", "SOCKET_HWM", "Deadline", "Peer", "stop_text"]

log = logging.getLogger("dflash.transport")

#: Defaults match :class:`dflash.config.TransportConfig`.
DEFAULT_HEARTBEAT_S = 2.0
DEFAULT_PEER_TIMEOUT_S = 30.0
#: Outgoing/incoming message queue bound per peer (READYs are bounded by credits anyway).
SOCKET_HWM = 10_000

_P = TypeVar("_P", bound="Peer")


class Deadline:
    """A wait of ``timeout`` seconds from now (``None``: forever), on the monotonic clock."""

    def __init__(self, timeout: Optional[float]) -> None:
        self.at = None if timeout is None else time.monotonic() + timeout

    def left(self) -> Optional[float]:
        """Seconds left (``<= 0`` once passed), or ``None`` for a wait without end."""
        return None if self.at is None else self.at - time.monotonic()

    def passed(self) -> bool:
        """True once the deadline is reached (never for a wait without end)."""
        left = self.left()
        return left is not None and left <= 0


class Peer:
    """The shared part of a data-plane end: identity, message intake, sends, liveness, close.

    A subclass sets :attr:`ROLE`, :attr:`PEER_ROLE` and :attr:`COUNTED`, fills
    :attr:`_handlers` (``{message type: handler}``, in the order the log names them) and provides
    :meth:`_shutdown` and :meth:`_next_timer`.

    Args:
        name: this end's name (``target.0``, ``drafter.0``); in every message and log line.
        spec: the slot's tensors ``{name: (shape, dtype)}``, identical at both ends.
        device: where this end's slots or buffers live.
        carrier: ``auto`` or a carrier name (:func:`~dflash.transport.carriers.resolve_carrier`).
        heartbeat_s: heartbeat period (s).
        peer_timeout_s: a peer silent this long (s) is dropped; must exceed ``heartbeat_s``.
        incarnation: this incarnation's id (default :func:`~dflash.transport.messages.new_incarnation`).

    Attributes:
        stats: counters; every end counts ``rejected``.

    Raises:
        TransportError: ``peer_timeout_s <= heartbeat_s``, a bad carrier/device combination or spec.
    """

    #: This end's role in log lines (``producer`` / ``consumer``).
    ROLE: ClassVar[str]
    #: The role of the ends it talks to.
    PEER_ROLE: ClassVar[str]
    #: The ``stats`` counter that the closing log line reports (``published`` / ``received``).
    COUNTED: ClassVar[str]

    def __init__(self, name: str, spec: SlotSpec, device: Union[str, torch.device], carrier: str,
                 heartbeat_s: float, peer_timeout_s: float, incarnation: Optional[int]):
        if peer_timeout_s <= heartbeat_s:
            raise TransportError(f"peer_timeout_s ({peer_timeout_s}) must exceed heartbeat_s ({heartbeat_s})")
        self.name = name
        self.device = torch.device(device)
        self.carrier = resolve_carrier(carrier, self.device)
        self.layout = SlotLayout(spec)
        self.incarnation = new_incarnation() if incarnation is None else incarnation
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.host = host_id()
        self.stats: collections.Counter = collections.Counter()
        self._handlers: dict[type, Callable[..., None]] = {}
        self._closed = False

    # ------------------------------------------------------------------ public API

    def next_timer_s(self) -> float:
        """Seconds until ``poll`` has timer work (heartbeats, HELLO retries, timeouts), for a
        caller's poll timeout."""
        return max(0.0, self._next_timer() - time.monotonic())

    def close(self, reason: str = StopReason.DONE, detail: str = "") -> None:
        """Tell the attached peers STOP (``reason``, ``detail``), release sockets and memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._shutdown(Stop(self.name, self.incarnation, reason, detail))
        log.info("%s: %s closed (%s): %d %s", self.name, self.ROLE, reason, self.stats[self.COUNTED], self.COUNTED)

    def __enter__(self: _P) -> _P:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(StopReason.FAILED if exc[0] is not None else StopReason.DONE)

    # ------------------------------------------------------------------ for the subclasses

    def _shutdown(self, stop: Stop) -> None:
        """Send ``stop`` to each attached peer and release this end's sockets and memory (once)."""
        raise NotImplementedError

    def _next_timer(self) -> float:
        """The monotonic time of the next timer work."""
        raise NotImplementedError

    def _drain(self, sock: zmq.Socket, handle: Callable[[list], None], copy: bool = True) -> int:
        """Receive every message queued on ``sock`` without waiting, ``handle(frames)`` each;
        returns how many."""
        handled = 0
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                return handled
            handle(frames)
            handled += 1

    def _dispatch(self, sender: str, route: Any, header: bytes, payload: list) -> None:
        """Decode ``header`` from ``sender`` and call its type's handler as ``handler(route, msg)``
        (READY: ``handler(route, msg, payload)``); reject an undecodable message, one that claims
        another sender, payload frames on anything but READY, and a type this end does not receive."""
        try:
            msg = decode(header)
        except MessageError as exc:
            self._reject(sender, str(exc))
            return
        if msg.sender != sender:
            self._reject(sender, f"{type(msg).__name__} claims sender {msg.sender!r}")
            return
        if payload and not isinstance(msg, Ready):
            self._reject(sender, f"{type(msg).__name__} with {len(payload)} unexpected payload frame(s)")
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            receives = ", ".join(t.TAG.name for t in self._handlers)
            self._reject(sender, f"unexpected {type(msg).__name__} (a {self.ROLE} receives {receives})")
        elif isinstance(msg, Ready):
            handler(route, msg, payload)
        else:
            handler(route, msg)

    def _send_on(self, sock: zmq.Socket, route: list[bytes], msg: Any, to: object) -> bool:
        """Send ``msg`` without blocking (after the routing frames ``route``); False when it cannot
        leave now (a peer not connected, a full queue): the timers retry."""
        try:
            sock.send_multipart([*route, encode(msg)], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            log.debug("%s: cannot send %s to %s: %s", self.name, type(msg).__name__, to, exc)
            return False

    def _reject(self, sender: str, what: str, stale: bool = False) -> None:
        """Count and log a message that is not acted on: an error, or (``stale``) a warning for
        a message of an earlier incarnation of its sender or of this end (normal after restarts)."""
        self.stats["rejected"] += 1
        log.log(logging.WARNING if stale else logging.ERROR, "%s: %s message from %s: %s", self.name,
                "ignored stale" if stale else "rejected", sender, what)

    def _heartbeat(self, peer_incarnation: int) -> Heartbeat:
        """This end's HEARTBEAT to a peer it knows as ``peer_incarnation`` (0: unknown)."""
        return Heartbeat(self.name, self.incarnation, peer_incarnation)

    def _silent(self, peer: str, last_seen: float, now: float, consequence: str) -> bool:
        """True, logged with ``consequence``, when ``peer`` (last heard at monotonic ``last_seen``)
        has been silent longer than ``peer_timeout_s``."""
        if now - last_seen <= self.peer_timeout_s:
            return False
        log.warning("%s: %s %s silent for %.1f s: %s", self.name, self.PEER_ROLE, peer, now - last_seen, consequence)
        return True

    def _silence_stop(self, reason: str) -> Stop:
        """The STOP that tells a peer it was dropped for silence (``reason``: evicted / silent)."""
        return Stop(self.name, self.incarnation, reason, f"silent for more than {self.peer_timeout_s} s")


def stop_text(msg: Stop) -> str:
    """``reason`` or ``reason: detail`` of a STOP, for a log line."""
    return f"{msg.reason}: {msg.detail}" if msg.detail else msg.reason
