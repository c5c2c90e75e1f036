"""The data plane: slot rings between producers (target workers) and consumers (drafter workers).

DESIGN.md §3 in code. A producer owns K fixed-shape slots (one ring, exported once per producer
incarnation, announced with its *epoch*); consumers import each ring once per (producer, epoch)
and copy each READY slot into their own static buffer, then return the credit (FREE).

=====================  ======================================================================
module                 job
=====================  ======================================================================
``layout``             :data:`SlotSpec` → :class:`SlotLayout` (named views into one byte buffer)
``messages``           typed, versioned msgpack messages (HELLO, SLOTS, READY, FREE, HEARTBEAT, STOP)
``carriers``           ``cuda_ipc`` (CUDA IPC handles + interprocess events), ``shm`` (memfd
                       passed over a unix socket), ``tcp`` (slot bytes in zmq frames)
``producer``           :class:`Producer`: acquire → fill → publish(slot, consumer, batch_id, meta)
``consumer``           :class:`Consumer`: receive() → :class:`Received` (tensors in its own buffer)
=====================  ======================================================================

Routing: each producer binds one ROUTER endpoint (``ipc://`` in the run dir, or ``tcp://``); every
consumer connects a DEALER (identity = its name, e.g. ``drafter.0``) to every producer. A READY is
addressed to one named consumer. A consumer restart (newer consumer epoch in HELLO) resets the
credits of the slots in flight to it and reports their batch ids (:class:`LostBatch`); a producer
restart (newer producer epoch) makes every consumer drop the old ring and import the new one.
"""

from .carriers import CARRIERS, TransportError
from .consumer import Consumer, Received
from .layout import SlotLayout, SlotSpec
from .messages import PROTOCOL_VERSION, MessageError, StopReason
from .producer import LostBatch, PeerUnavailable, Producer

__all__ = [
    "CARRIERS",
    "PROTOCOL_VERSION",
    "Consumer",
    "LostBatch",
    "MessageError",
    "PeerUnavailable",
    "Producer",
    "Received",
    "SlotLayout",
    "SlotSpec",
    "StopReason",
    "TransportError",
]
