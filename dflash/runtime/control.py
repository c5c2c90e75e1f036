"""Control plane between the coordinator and the workers: typed msgpack messages over ZeroMQ.

The coordinator binds one ROUTER socket; each worker connects a DEALER whose identity is its
name (``target.0``, ``drafter.1``). The messages are the dataclasses of
:mod:`dflash.runtime.messages`, encoded by the shared codec; a message that does not decode, has
another version, an unknown kind or a mistyped field raises :class:`ControlError`, which
receivers log (naming the sender) and drop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Optional, Union

import zmq

from dflash.runtime.messages import BY_KIND, CODEC, CONTROL_VERSION, ControlError, ControlMessage

__all__ = [
    "CONTROL_VERSION",
    "ControlError",
    "encode",
    "decode",
    "WorkerLink",
    "CoordinatorSocket",
    "set_parent_death_signal",
]

log = logging.getLogger(__name__)


def _message(kind: Union[str, ControlMessage], fields: dict) -> ControlMessage:
    if isinstance(kind, ControlMessage):
        if fields:
            raise ControlError(f"{type(kind).__name__}: fields given twice ({sorted(fields)})")
        return kind
    cls = BY_KIND.get(kind)
    if cls is None:
        raise ControlError(f"unknown message type {kind!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise ControlError(f"{cls.__name__}: unknown field(s) {unknown} (fields: {names})")
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in fields
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ControlError(f"{kind}: missing field(s) {missing}")
    return cls(**fields)


def encode(kind: Union[str, ControlMessage], **fields: Any) -> bytes:
    """Encode one control message: a message object, or its kind and fields
    (``encode("ctl", cmd="status", args={})``).

    Raises:
        ControlError: an unknown kind, a missing, unknown or mistyped field (named), or a value
            msgpack cannot carry (guarded at the send).
    """
    return CODEC.encode(_message(kind, fields))


def decode(frame: bytes) -> ControlMessage:
    """Decode and check one control message (read it by attribute, or as a map: ``msg["type"]``).

    Raises:
        ControlError: not msgpack, not an array, another version, an unknown kind, a wrong number
            of fields or a mistyped field (named).
    """
    return CODEC.decode(frame)


class WorkerLink:
    """A worker's DEALER connection to the coordinator.

    Args:
        endpoint: the coordinator's ROUTER endpoint (``tcp://127.0.0.1:PORT``).
        name: this worker's name, used as the socket identity.
    """

    def __init__(self, endpoint: str, name: str, context: Optional[zmq.Context] = None):
        self.name = name
        self.context = context or zmq.Context.instance()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, name.encode())
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.connect(endpoint)

    def send(self, msg: ControlMessage) -> None:
        """Send ``msg`` to the coordinator, with this worker's name as its ``name`` (when it has one).

        Raises:
            ControlError: a mistyped field (named).
        """
        if "name" in msg.__dataclass_fields__:  # type: ignore[attr-defined]
            msg = dataclasses.replace(msg, name=self.name)
        self.socket.send(CODEC.encode(msg))

    def recv(self, timeout_s: Optional[float]) -> Optional[ControlMessage]:
        """Next valid message, or None after ``timeout_s`` (None = wait forever). Bad ones are logged and dropped."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.socket.poll(None if remaining is None else int(remaining * 1000)):
                return None
            frame = self.socket.recv()
            try:
                return decode(frame)
            except ControlError as exc:
                log.error("rejected control message from coordinator: %s", exc)
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def close(self) -> None:
        self.socket.close(linger=0)


class CoordinatorSocket:
    """The coordinator's ROUTER socket: receives from any worker, sends to a named one."""

    def __init__(self, host: str = "127.0.0.1", context: Optional[zmq.Context] = None, port: int = 0,
                 advertise: Optional[str] = None):
        """Bind on ``host`` (``*``: every interface) at ``port`` (0: a free one); :attr:`endpoint`
        names ``advertise`` (default ``host``), the address workers and node launchers connect to.

        Raises:
            zmq.ZMQError: the port cannot be bound.
        """
        self.context = context or zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker takes over its name
        if port:
            try:
                self.socket.bind(f"tcp://{host}:{port}")
            except zmq.ZMQError:
                self.socket.close(linger=0)
                raise
        else:
            port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{advertise or host}:{port}"

    def send(self, worker: str, kind: Union[str, ControlMessage], **fields: Any) -> bool:
        """Send a message (an object, or its kind and fields) to ``worker``; False (logged) when that
        worker is not connected.

        Raises:
            ControlError: an unknown kind or a missing, unknown or mistyped field (named).
        """
        msg = _message(kind, fields)
        try:
            self.socket.send_multipart([worker.encode(), CODEC.encode(msg)])
            return True
        except zmq.ZMQError as exc:
            log.warning("cannot send %s to %s: %s", msg.TAG, worker, exc)
            return False

    def recv(self, timeout_s: float) -> Optional[tuple[str, ControlMessage]]:
        """(sender, message) or None after ``timeout_s``; malformed messages are logged and skipped."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            if not self.socket.poll(int(remaining * 1000)):
                return None
            frames = self.socket.recv_multipart()
            sender = frames[0].decode(errors="replace")
            if len(frames) != 2:
                log.error("rejected control message from %s: %d frames", sender, len(frames))
                continue
            try:
                return sender, decode(frames[1])
            except ControlError as exc:
                log.error("rejected control message from %s: %s", sender, exc)

    def close(self) -> None:
        self.socket.close(linger=0)


def set_parent_death_signal(sig: int = 15) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``).

    Together with heartbeats this guarantees no worker outlives the launcher, even after a
    SIGKILL of the launcher. No-op on other platforms.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except OSError:
        return
    if os.getppid() == 1:  # parent already gone before prctl took effect
        os._exit(1)
