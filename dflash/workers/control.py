"""Control plane between the coordinator and the workers: typed msgpack messages over ZeroMQ.

The coordinator binds one ROUTER socket; each worker connects a DEALER whose identity is its
name (``target.0``, ``drafter.1``). Messages carry no tensors (tensors travel through
:mod:`dflash.transport`). Every message is a msgpack map ``{"v": VERSION, "type": ..., **fields}``;
a message that does not decode, has another version or an unknown type raises
:class:`ControlError`, which receivers log (naming the sender) and drop.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

import msgpack
import zmq

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

CONTROL_VERSION = 1

#: Message types and the fields each must carry.
MESSAGE_FIELDS: dict[str, tuple[str, ...]] = {
    # worker -> coordinator
    "hello": ("name", "role", "rank", "pid", "incarnation"),
    "ready": ("name", "info"),
    "produced": ("name", "key", "epoch", "batch_id", "split", "drafter", "seconds", "tokens"),
    "dropped": ("name", "key", "reason"),
    "received": ("name", "key"),
    "trained": ("name", "attempt", "step", "epoch", "batch_id", "metrics"),
    "evaluated": ("name", "attempt", "round", "sums"),
    "checkpointed": ("name", "step", "path"),
    "heartbeat": ("name", "stats"),
    "failed": ("name", "error"),
    "bye": ("name",),
    # coordinator -> worker
    "targets": ("endpoints",),
    "produce": ("key", "epoch", "batch_id", "split", "drafter"),
    "flush": ("drafters",),
    "train": ("attempt", "step", "epoch", "batch_id", "key", "checkpoint"),
    "evaluate": ("attempt", "round", "batch_ids", "keys", "step"),
    "save": ("step",),
    "stop": ("reason",),
    # command-line client <-> coordinator (python -m launch.cluster status | restart | stop | attach)
    "ctl": ("cmd", "args"),
    "ctl_reply": ("ok", "text", "data"),
}


class ControlError(ValueError):
    """A control message that cannot be accepted (undecodable, wrong version, unknown type, missing field)."""


def encode(kind: str, **fields: Any) -> bytes:
    """Encode one control message.

    Raises:
        ControlError: unknown ``kind`` or a required field missing (guarded at the send).
    """
    required = MESSAGE_FIELDS.get(kind)
    if required is None:
        raise ControlError(f"unknown message type {kind!r}")
    missing = [f for f in required if f not in fields]
    if missing:
        raise ControlError(f"{kind}: missing field(s) {missing}")
    return msgpack.packb({"v": CONTROL_VERSION, "type": kind, **fields}, use_bin_type=True)


def decode(frame: bytes) -> dict:
    """Decode and check one control message.

    Raises:
        ControlError: not msgpack, not a map, another version, unknown type, missing field.
    """
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
        raise ControlError(f"undecodable frame of {len(frame)} bytes: {exc}") from None
    if not isinstance(msg, dict):
        raise ControlError(f"expected a map, got {type(msg).__name__}")
    if msg.get("v") != CONTROL_VERSION:
        raise ControlError(f"unsupported version {msg.get('v')!r} (expected {CONTROL_VERSION})")
    kind = msg.get("type")
    required = MESSAGE_FIELDS.get(kind) if isinstance(kind, str) else None
    if required is None:
        raise ControlError(f"unknown message type {kind!r}")
    missing = [f for f in required if f not in msg]
    if missing:
        raise ControlError(f"{kind}: missing field(s) {missing}")
    return msg


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

    def send(self, kind: str, **fields: Any) -> None:
        self.socket.send(encode(kind, name=self.name, **fields) if "name" in MESSAGE_FIELDS[kind] else encode(kind, **fields))

    def recv(self, timeout_s: Optional[float]) -> Optional[dict]:
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

    def __init__(self, host: str = "127.0.0.1", context: Optional[zmq.Context] = None):
        self.context = context or zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker takes over its name
        port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"

    def send(self, worker: str, kind: str, **fields: Any) -> bool:
        """Send to ``worker``; False (logged) when that worker is not connected."""
        try:
            self.socket.send_multipart([worker.encode(), encode(kind, **fields)])
            return True
        except zmq.ZMQError as exc:
            log.warning("cannot send %s to %s: %s", kind, worker, exc)
            return False

    def recv(self, timeout_s: float) -> Optional[tuple[str, dict]]:
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


@dataclass
class Incarnation:
    """Identity of one start of a worker: a new value at every (re)start."""

    pid: int
    started: float

    @classmethod
    def now(cls) -> "Incarnation":
        return cls(os.getpid(), time.time())

    @property
    def id(self) -> str:
        return f"{self.pid}-{int(self.started * 1e6)}"
