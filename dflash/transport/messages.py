"""Data-plane messages: typed, versioned msgpack, no pickle.

Every message is a frozen dataclass declared with :func:`message` (which sets its ``TAG``, a
:class:`MsgType`), its fields after those of the :class:`Envelope` (sender, incarnation), serialised by the
shared :class:`~dflash.transport.codec.Codec`: one msgpack array
``[PROTOCOL_VERSION, type code, field 1, field 2, ...]`` in the dataclass's field order, every field
checked against its annotation at the send and at the receipt. Receivers log a
:class:`MessageError` naming the sender and drop the message (a malformed message never crashes a
receiver); a tensor (or anything else msgpack cannot carry) in ``meta`` fails in the sender.

Conversation (producer = target worker, ROUTER; consumer = drafter worker, one DEALER per producer)::

    consumer                               producer
    HELLO(incarnation c)         ───────►  registers c (a new c resets c's old credits → lost batches)
                                 ◄───────  SLOTS(incarnation p, layout, export)      once per (p, c)
                                 ◄───────  READY(p, c, ring slot, generation, job key, meta) [+ payload]
    FREE(c, p, ring slot, gen)   ───────►  the ring slot may be refilled
    HEARTBEAT(c, p)              ◄──────►  HEARTBEAT(p, c)   liveness; an unknown incarnation triggers HELLO
    STOP(reason)                 ◄──────►  STOP(reason)      clean end / evicted / incompatible / silent

An incarnation id names one run of a process (:func:`new_incarnation`: milliseconds since
1970-01-01 in the high bits, 20 random low bits), so a later start has a larger id and a message
from an older incarnation is recognisably *stale*. A worker uses the same id on the control plane.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Callable, ClassVar, Optional, Union

from dflash.transport.codec import Codec, MessageError

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_HEADER_BYTES",
    "MessageError",
    "MsgType",
    "StopReason",
    "CudaExport",
    "Envelope",
    "message",
    "Hello",
    "Slots",
    "Ready",
    "Free",
    "Heartbeat",
    "Stop",
    "Message",
    "CODEC",
    "encode",
    "decode",
    "new_incarnation",
]

#: Bump on any change of a message's fields or meaning.
PROTOCOL_VERSION = 1

#: Largest header frame accepted (payload bytes of the tcp carrier travel in their own frame).
MAX_HEADER_BYTES = 1 << 20

_INCARNATION_RANDOM_BITS = 20


def new_incarnation() -> int:
    """A fresh incarnation id: ``(ms since 1970) << 20 | 20 random bits`` (fits in 63 bits).

    Later starts get larger ids (millisecond resolution), so receivers can tell a newer
    incarnation (re-attach) from a stale one (reject).
    """
    return ((time.time_ns() // 1_000_000) << _INCARNATION_RANDOM_BITS
            | secrets.randbits(_INCARNATION_RANDOM_BITS))


class MsgType(IntEnum):
    """The type code (``TAG``) of each data-plane message."""

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
    #: Consumer → producer: you were silent past ``peer_timeout_s``; I dropped your ring and the
    #: READYs I held or will receive from it. Reclaim the slots in flight to me (report their
    #: batches lost); my next HELLO attaches again.
    SILENT = "silent"

    ALL = (DONE, FAILED, EVICTED, INCOMPATIBLE, SILENT)


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
class Envelope:
    """The fields every data-plane message starts with (first on the wire, in this order)."""

    #: The message's type code, set by :func:`message`.
    TAG: ClassVar[MsgType]
    #: The sending end's name (``target.0``, ``drafter.0``); a receiver checks it against the socket identity.
    sender: str
    #: The sending end's incarnation id (:func:`new_incarnation`).
    incarnation: int


def message(tag: MsgType) -> Callable[[type], type]:
    """Class decorator of a data-plane message type: its ``TAG`` is ``tag``; it becomes a frozen dataclass."""
    def make(cls: type) -> type:
        cls.TAG = tag
        return dataclass(frozen=True)(cls)
    return make


@message(MsgType.HELLO)
class Hello(Envelope):
    """Consumer → producer: "I am ``sender`` (incarnation ``incarnation``), send me your ring"."""
    pid: int
    #: Host identity (Linux boot id): shm and CUDA IPC need the same host.
    host: str
    carrier: str
    #: :attr:`SlotLayout.digest` of the consumer's spec.
    layout_digest: str
    #: shm carrier: abstract unix socket name (without the leading NUL) the producer connects to
    #: to pass the ring's memfd; ``""`` otherwise.
    fd_socket: str


@message(MsgType.SLOTS)
class Slots(Envelope):
    """Producer → consumer: the ring, exported once per producer incarnation."""
    #: The consumer incarnation this answers (a reply to an older HELLO is stale).
    consumer_incarnation: int
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
    #: cuda_ipc: one interprocess event IPC handle per ring slot (64 bytes each).
    events: list[bytes] = field(default_factory=list)


@message(MsgType.READY)
class Ready(Envelope):
    """Producer → consumer: ring slot ``ring_slot`` holds the batch of job ``job_key`` (the
    coordinator's name for one assignment, or any id a caller chooses), fill number ``generation``.

    tcp carrier: followed by one payload frame of ``payload_nbytes`` bytes (the whole ring slot).
    cuda_ipc: the ring slot's interprocess event was recorded after the fill; wait on it before reading.
    """
    consumer_incarnation: int
    ring_slot: int
    generation: int
    job_key: Union[int, str]
    meta: dict
    payload_nbytes: int = 0


@message(MsgType.FREE)
class Free(Envelope):
    """Consumer → producer: the consumer's copy of ``ring_slot`` (fill ``generation``) is complete."""
    producer_incarnation: int
    ring_slot: int
    generation: int


@message(MsgType.HEARTBEAT)
class Heartbeat(Envelope):
    """Either way: "I (``sender``, ``incarnation``) am alive and I know you as ``peer_incarnation``"
    (0 = unknown)."""
    peer_incarnation: int


@message(MsgType.STOP)
class Stop(Envelope):
    """Either way: a terminal message; ``reason`` is one of :class:`StopReason`."""
    reason: str
    detail: str = ""


Message = Union[Hello, Slots, Ready, Free, Heartbeat, Stop]

CODEC = Codec("data plane", PROTOCOL_VERSION, (Hello, Slots, Ready, Free, Heartbeat, Stop), max_bytes=MAX_HEADER_BYTES)


def encode(msg: Message) -> bytes:
    """Serialise one data-plane message (:meth:`Codec.encode <dflash.transport.codec.Codec.encode>`).

    Raises:
        MessageError: not a data-plane message, a field of the wrong type (named ``Type.field``), or a
            ``meta`` that msgpack cannot carry (e.g. a tensor: tensors travel in ring slots, never in messages).
    """
    return CODEC.encode(msg)


def decode(frame: bytes) -> Message:
    """Parse and check one data-plane message (:meth:`Codec.decode <dflash.transport.codec.Codec.decode>`).

    Raises:
        MessageError: larger than :data:`MAX_HEADER_BYTES`, not msgpack, not an array, another
            protocol version, an unknown type code, a wrong number of fields, a field of the wrong type.
    """
    return CODEC.decode(frame)
