"""Data-plane messages: typed, versioned msgpack, no pickle.

Every message is a frozen dataclass. On the wire it is one msgpack array
``[PROTOCOL_VERSION, type code, field 1, field 2, ...]`` in the dataclass's field order (nested
dataclasses are nested arrays). :func:`decode` checks the version, the type code, the number of
fields and the type of every field against the dataclass annotations, and raises
:class:`MessageError` for anything else; receivers log that error naming the sender and drop the
message (a malformed message never crashes a receiver). :func:`encode` checks the same at the send,
so a tensor (or anything else msgpack cannot carry) in ``meta`` fails in the sender
(tensor-free messages checked at the send: docs/ARCHITECTURE.md, The data plane).

Conversation (producer = target worker, ROUTER; consumer = drafter worker, one DEALER per producer)::

    consumer                          producer
    HELLO(epoch c)          ───────►  registers c (a new c resets c's old credits → lost batches)
                            ◄───────  SLOTS(epoch p, layout, export)        once per (p, c)
                            ◄───────  READY(p, c, slot, generation, batch id, meta) [+ payload]
    FREE(c, p, slot, gen)   ───────►  slot may be refilled
    HEARTBEAT(c, p)         ◄──────►  HEARTBEAT(p, c)      liveness; an unknown epoch triggers HELLO
    STOP(reason)            ◄──────►  STOP(reason)         clean end / evicted / incompatible

Epochs are ids of one process incarnation (:func:`new_epoch`: milliseconds since the Unix epoch
in the high bits, 20 random low bits), so a later start has a larger epoch and a message from an
older incarnation is recognisably *stale*.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
import typing
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Callable, ClassVar, Optional, Union

import msgpack

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_HEADER_BYTES",
    "MessageError",
    "MsgType",
    "StopReason",
    "CudaExport",
    "Hello",
    "Slots",
    "Ready",
    "Free",
    "Heartbeat",
    "Stop",
    "Message",
    "encode",
    "decode",
    "new_epoch",
]

#: Bump on any change of a message's fields or meaning.
PROTOCOL_VERSION = 1

#: Largest header frame accepted (payload bytes of the tcp carrier travel in their own frame).
MAX_HEADER_BYTES = 1 << 20

_EPOCH_RANDOM_BITS = 20


def new_epoch() -> int:
    """A fresh incarnation id: ``(ms since 1970) << 20 | 20 random bits`` (fits in 63 bits).

    Later starts get larger ids (millisecond resolution), so receivers can tell a newer
    incarnation (re-attach) from a stale one (reject).
    """
    return (time.time_ns() // 1_000_000) << _EPOCH_RANDOM_BITS | secrets.randbits(_EPOCH_RANDOM_BITS)


class MessageError(ValueError):
    """A message that cannot be accepted: undecodable, unknown version or type, wrong field types."""


class MsgType(IntEnum):
    HELLO = 1
    SLOTS = 2
    READY = 3
    FREE = 4
    HEARTBEAT = 5
    STOP = 6


class StopReason:
    """Reasons a STOP carries (distinct terminal messages)."""

    #: Clean end of the sender's work.
    DONE = "done"
    #: The sender failed (the consumer or producer loop died with an error).
    FAILED = "failed"
    #: Producer → consumer: you were silent past ``peer_timeout_s``; your credits were reset and
    #: your in-flight batches reported lost. Drop pending READYs and say HELLO again.
    EVICTED = "evicted"
    #: Producer → consumer: your HELLO does not match (layout, carrier, host); not attached.
    INCOMPATIBLE = "incompatible"

    ALL = (DONE, FAILED, EVICTED, INCOMPATIBLE)


@dataclass(frozen=True)
class CudaExport:
    """The fields of ``torch.multiprocessing.reductions.reduce_tensor`` for a CUDA ring tensor.

    The ring is one ``[num_slots, slot_nbytes]`` uint8 tensor; these are the arguments that
    ``rebuild_cuda_tensor`` needs, minus the Python classes (always ``torch.Tensor`` /
    ``torch.UntypedStorage`` / uint8 here), plus the exporting GPU's UUID so a consumer can tell
    which of its devices (if any) holds the memory.
    """

    size: list[int]
    stride: list[int]
    tensor_offset: int
    device: int
    device_uuid: str
    handle: bytes
    storage_nbytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass(frozen=True)
class Hello:
    """Consumer → producer: "I am ``sender`` (incarnation ``epoch``), send me your slots"."""

    TYPE: ClassVar[MsgType] = MsgType.HELLO
    sender: str
    epoch: int
    pid: int
    #: Host identity (Linux boot id): shm and CUDA IPC need the same host.
    host: str
    carrier: str
    #: :attr:`SlotLayout.digest` of the consumer's spec.
    layout_digest: str
    #: shm carrier: abstract unix socket name (without the leading NUL) the producer connects to
    #: to pass the ring's memfd; ``""`` otherwise.
    fd_socket: str


@dataclass(frozen=True)
class Slots:
    """Producer → consumer: the ring, exported once per producer incarnation (``epoch``)."""

    TYPE: ClassVar[MsgType] = MsgType.SLOTS
    sender: str
    epoch: int
    #: The consumer incarnation this answers (a reply to an older HELLO is stale).
    consumer_epoch: int
    pid: int
    host: str
    #: inode of the producer's pid namespace (``/proc/self/ns/pid``): ``pid`` means the same
    #: process to a consumer only when this matches its own.
    pidns: int
    carrier: str
    num_slots: int
    slot_nbytes: int
    #: :meth:`SlotLayout.describe` of the producer's spec.
    layout: list[list]
    #: cuda_ipc: the ring's export; ``None`` for shm / tcp.
    cuda: Optional[CudaExport] = None
    #: cuda_ipc: one interprocess event IPC handle per slot (64 bytes each).
    events: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class Ready:
    """Producer → consumer: slot ``slot`` holds batch ``batch_id`` (fill number ``generation``).

    tcp carrier: followed by one payload frame of ``payload_nbytes`` bytes (the whole slot).
    cuda_ipc: the slot's interprocess event was recorded after the fill; wait on it before reading.
    """

    TYPE: ClassVar[MsgType] = MsgType.READY
    sender: str
    epoch: int
    consumer_epoch: int
    slot: int
    generation: int
    batch_id: Union[int, str]
    meta: dict
    payload_nbytes: int = 0


@dataclass(frozen=True)
class Free:
    """Consumer → producer: the consumer's copy of ``slot`` (fill ``generation``) is complete."""

    TYPE: ClassVar[MsgType] = MsgType.FREE
    sender: str
    epoch: int
    producer_epoch: int
    slot: int
    generation: int


@dataclass(frozen=True)
class Heartbeat:
    """Either way: "I (``sender``, ``epoch``) am alive and I know you as ``peer_epoch``" (0 = unknown)."""

    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    sender: str
    epoch: int
    peer_epoch: int


@dataclass(frozen=True)
class Stop:
    """Either way: a terminal message; ``reason`` is one of :class:`StopReason`."""

    TYPE: ClassVar[MsgType] = MsgType.STOP
    sender: str
    epoch: int
    reason: str
    detail: str = ""


Message = Union[Hello, Slots, Ready, Free, Heartbeat, Stop]
_BY_CODE: dict[int, type] = {cls.TYPE: cls for cls in (Hello, Slots, Ready, Free, Heartbeat, Stop)}
_Checker = Callable[[Any, str], Any]
#: Per message class: ``[(field name, checker), ...]`` compiled once from the annotations.
_CHECKERS: dict[type, list[tuple[str, _Checker]]] = {}


def _type_label(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _compile(tp: Any) -> _Checker:
    """A function ``check(value, where) -> value`` for one annotation (nested dataclasses are
    rebuilt from their field lists). Raises :class:`MessageError` on a mismatch."""
    origin = typing.get_origin(tp)
    if origin is Union:
        args = typing.get_args(tp)
        optional = type(None) in args
        options = [_compile(a) for a in args if a is not type(None)]
        label = _type_label(tp)

        def check_union(value: Any, where: str) -> Any:
            if value is None and optional:
                return None
            for option in options:
                try:
                    return option(value, where)
                except MessageError:
                    continue
            raise MessageError(f"{where}: expected {label}, got {type(value).__name__}")
        return check_union
    if dataclasses.is_dataclass(tp):
        return lambda value, where: _from_fields(tp, value, where)
    if origin is list or tp is list:
        (item_tp,) = typing.get_args(tp) or (Any,)
        item = None if item_tp is Any else _compile(item_tp)

        def check_list(value: Any, where: str) -> Any:
            if not isinstance(value, list):
                raise MessageError(f"{where}: expected a list, got {type(value).__name__}")
            return value if item is None else [item(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return check_list
    if tp is dict:
        def check_map(value: Any, where: str) -> Any:
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise MessageError(f"{where}: expected a map with string keys, got {type(value).__name__}")
            return value
        return check_map
    if tp is Any:
        return lambda value, where: value
    if tp in (bool, int, str, bytes):
        def check_scalar(value: Any, where: str) -> Any:
            # bool is an int subclass: an int field never accepts True/False
            if type(value) is not tp and not (tp is not bool and isinstance(value, tp) and not isinstance(value, bool)):
                raise MessageError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
            return value
        return check_scalar
    raise TypeError(f"unsupported annotation {tp}")  # a bug in this module, found at import


def _checkers(cls: type) -> list[tuple[str, _Checker]]:
    checkers = _CHECKERS.get(cls)
    if checkers is None:
        hints = typing.get_type_hints(cls)
        checkers = [(f.name, _compile(hints[f.name])) for f in dataclasses.fields(cls)]
        _CHECKERS[cls] = checkers
    return checkers


def _from_fields(cls: type, values: Any, where: str) -> Any:
    checkers = _checkers(cls)
    if not isinstance(values, list) or len(values) != len(checkers):
        got = f"{len(values)} fields" if isinstance(values, list) else type(values).__name__
        raise MessageError(f"{where}: expected {len(checkers)} fields, got {got}")
    return cls(**{name: check(v, f"{where}.{name}") for (name, check), v in zip(checkers, values)})


def _to_fields(obj: Any) -> list:
    out = []
    for name, _ in _checkers(type(obj)):
        v = getattr(obj, name)
        out.append(_to_fields(v) if dataclasses.is_dataclass(v) else v)
    return out


def encode(msg: Message) -> bytes:
    """Serialise one message.

    Raises:
        MessageError: an unknown message class, a field of the wrong type, or a ``meta`` that
            msgpack cannot carry (e.g. a tensor: tensors travel in slots, never in messages).
    """
    cls = type(msg)
    if _BY_CODE.get(getattr(cls, "TYPE", None)) is not cls:
        raise MessageError(f"not a transport message: {cls.__name__}")
    fields = _to_fields(msg)
    # Guard at the send: the receiver would reject what does not type-check.
    _from_fields(cls, fields, cls.__name__)
    try:
        return msgpack.packb([PROTOCOL_VERSION, int(cls.TYPE), *fields], use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise MessageError(f"{cls.__name__}: cannot serialise ({exc}); meta must be plain msgpack data") from None


def decode(frame: bytes) -> Message:
    """Parse and check one message.

    Raises:
        MessageError: too large, not msgpack, not an array, another protocol version, an unknown
            type code, a wrong number of fields, a field of the wrong type.
    """
    if len(frame) > MAX_HEADER_BYTES:
        raise MessageError(f"header of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # noqa: BLE001 - msgpack raises many unrelated types on garbage
        raise MessageError(f"undecodable frame of {len(frame)} bytes ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, list) or len(obj) < 2:
        raise MessageError(f"expected [version, type, ...], got {type(obj).__name__}")
    version, code = obj[0], obj[1]
    if version != PROTOCOL_VERSION:
        raise MessageError(f"unsupported protocol version {version!r} (this side speaks {PROTOCOL_VERSION})")
    cls = _BY_CODE.get(code) if isinstance(code, int) and not isinstance(code, bool) else None
    if cls is None:
        raise MessageError(f"unknown message type {code!r}")
    return _from_fields(cls, obj[2:], cls.__name__)
