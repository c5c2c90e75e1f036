"""The data plane: slot rings between producers (target workers) and consumers (drafter workers).

docs/ARCHITECTURE.md, The data plane, in code. A producer owns K fixed-shape slots (one ring, exported once per producer
incarnation, announced with its *incarnation id*); consumers import each ring once per (producer, incarnation)
and copy each READY slot into their own static buffer, then return the credit (FREE).

=====================  ======================================================================
module                 job
=====================  ======================================================================
``layout``             :data:`SlotSpec` → :class:`SlotLayout` (named views into one byte buffer)
``codec``              one msgpack codec of typed dataclass messages (shared with the control plane)
``messages``           typed, versioned msgpack messages (HELLO, SLOTS, READY, FREE, HEARTBEAT, STOP)
``carriers``           carrier selection; ``carriers.base`` the carrier protocol, one module per
                       carrier: ``carriers.cuda_ipc`` (CUDA IPC handles + interprocess events),
                       ``carriers.shm`` (memfd passed over a unix socket), ``carriers.tcp`` (slot
                       bytes in zmq frames)
``peer``               :class:`~dflash.transport.peer.Peer`, the base of both ends: message intake,
                       sends, heartbeats and silence, close
``producer_state``     the producer's ring slot credits and :class:`LostBatch` records
``producer``           :class:`Producer`: acquire → fill → publish(slot, consumer, job_key, meta)
``consumer_state``     the consumer's view of each producer, pending READYs, copies in progress
``consumer``           :class:`Consumer`: receive() → :class:`Received` (tensors in its own buffer)
=====================  ======================================================================

Usage (one loop per process; see :mod:`.producer` and :mod:`.consumer` for the full API)::

    # target worker                                  # drafter worker
    p = Producer("target.0", "tcp://10.0.0.1:0",      c = Consumer("drafter.0", {"target.0": ep0, ...},
                 spec, num_slots=2, device="cuda:0")               spec, device="cuda:5")
    slot = p.acquire(timeout=1.0)                      got = c.receive(timeout=1.0)   # Received | None
    fill(p.slots[slot])              # current stream  train(got.tensors)  # own static buffer
    p.publish(slot, "drafter.0", job_key, meta)       # poll c.sockets in your zmq.Poller with
    lost = p.lost_batches()          # re-assign them  # your coordinator socket; call c.poll(0)

Design decisions (the pitfalls they avoid in brackets)

* **Incarnations.** Every process incarnation has an id (ms timestamp << 20 | random bits: later
  starts are larger). Every message carries its sender's incarnation; READY and FREE carry both sides'.
  Older incarnations are rejected as stale (logged, never fatal); a newer producer incarnation makes the
  consumer drop the old ring before touching anything of the new one [a dead producer's handles
  are invalid]; a newer consumer incarnation in HELLO resets that consumer's credits.
* **Credits.** A slot is free, acquired or in flight to exactly one consumer; only the FREE of that
  consumer, for that slot's current fill *generation*, returns it. A stale or duplicated FREE or
  READY is rejected loudly. In-flight slots of a consumer that restarts, sends STOP, is evicted
  after ``peer_timeout_s`` of silence (it is told so: STOP ``evicted``) or is
  :meth:`Producer.evict`-ed come back to the pool and their job keys are reported as
  :class:`LostBatch`; batches are deterministic, so the coordinator just re-assigns them.
  A consumer that drops a silent producer's ring tells it so (STOP ``silent``): a producer that
  was only busy then reclaims the slots in flight to that consumer the same way. Either side
  that comes back attaches again with HELLO (same incarnations: the import is reused).
* **CUDA IPC.** One export per producer incarnation [each ``reduce_tensor`` is a separate
  refcount], one import per (producer, incarnation) per consumer, fields as msgpack (no pickle); slot
  memory allocated with ``expandable_segments`` off [pidfd_getfd is EPERM in containers]; one
  interprocess event per slot, recorded after each fill, opened on the consumer's **own** device
  [opening on the producer's device hung] and waited on the consumer's stream before each copy [a
  cached import skips the export-time event wait]. Before that, the consumer checks the event
  with a non-blocking ``query`` (it never enqueues a wait that a dead producer could leave pending
  forever) and checks the producer's process is alive (and again after a synchronous copy).
  The consumer copies into its own buffer [a received IPC tensor cannot be re-exported] and frees
  the slot right after. When a producer dies, the consumer removes the ``/dev/shm/torch_<pid>_*``
  ref-counter file that torch's export created and the dead process could not unlink.
* **Shared memory without names.** The CPU ring is a sealed anonymous ``memfd`` handed to each
  consumer over an abstract-namespace unix socket (``SCM_RIGHTS``): nothing is ever created in
  ``/dev/shm`` or on disk, so nothing can survive any exit, SIGKILL of either side included (the
  kernel frees the memory with the last mapping). The alternative, a named segment unlinked once
  every consumer mapped it, leaks whenever the producer dies before that moment.
* **tcp.** The same protocol; the slot's bytes follow READY in one zmq frame (sent zero-copy: the
  credits guarantee the slot is not refilled before the consumer's FREE).

Routing: each producer binds one ROUTER endpoint (``ipc://`` in the run dir, or ``tcp://``); every
consumer connects a DEALER (identity = its name, e.g. ``drafter.0``) to every producer. A READY is
addressed to one named consumer. A consumer restart (newer consumer incarnation in HELLO) resets the
credits of the slots in flight to it and reports their batch ids (:class:`LostBatch`); a producer
restart (newer producer incarnation) makes every consumer drop the old ring and import the new one.
"""

from .carriers import CARRIERS
from .carriers.base import TransportError
from .consumer import Consumer
from .consumer_state import Received
from .layout import SlotLayout, SlotSpec
from .messages import PROTOCOL_VERSION, MessageError, StopReason
from .producer import PeerUnavailable, Producer
from .producer_state import LostBatch

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
