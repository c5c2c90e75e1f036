"""Control-plane messages: the coordinator, the workers and the command-line client.

Every message is a frozen dataclass whose ``TAG`` is its kind (``"produce"``, ``"trained"``, …),
serialised by the shared :class:`~dflash.transport.codec.Codec` (``[CONTROL_VERSION, kind, fields…]``,
every field checked at the send and at the receipt). Messages carry no tensors: tensors travel in
ring slots (:mod:`dflash.transport`).

Terms: a **job key** names one (batch, drafter, attempt) assignment of the coordinator
(``train:e0:12:a0``); it travels with the batch's READY so a drafter takes the right ring slot.
``data_epoch`` is a pass over the training data; ``incarnation`` is the id of one run of a worker
process (:func:`~dflash.transport.messages.new_incarnation`, the same id on both planes).

Worker → coordinator messages end with ``name`` (the sender, filled in by
:meth:`dflash.runtime.control.WorkerLink.send`): a worker's heartbeat thread sends from a second
socket, so the socket identity alone does not name the worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

from dflash.transport.codec import Codec, MessageError

__all__ = [
    "CONTROL_VERSION", "ControlError", "ControlMessage", "CODEC", "BY_KIND",
    # worker -> coordinator
    "Hello", "Ready", "Produced", "Dropped", "Received", "Trained", "Evaluated", "Checkpointed", "Heartbeat",
    "Failed",
    # coordinator -> worker
    "Targets", "Produce", "Flush", "Train", "Evaluate", "Save", "Stop",
    # node launcher <-> coordinator
    "NodeHello", "NodeBeat", "NodeExited", "NodeStart", "NodeKill", "NodeStop", "NODE_MESSAGES",
    # command-line client <-> coordinator
    "Command", "CommandReply", "Message",
]

#: Bump on any change of a message's fields or meaning.
CONTROL_VERSION = 4


class ControlError(MessageError):
    """A control message that cannot be sent or accepted (undecodable, another version, unknown
    kind, a missing or mistyped field: the error names the message kind and the field)."""


class ControlMessage:
    """Base of the control-plane messages.

    ``msg["type"]`` is the kind and ``msg[field]`` a field's value, for callers that read a
    message as a map (the command-line client).
    """

    TAG: ClassVar[str]

    @property
    def type(self) -> str:
        return self.TAG

    def __getitem__(self, key: str) -> Any:
        if key == "type":
            return self.TAG
        if key not in self.__dataclass_fields__:  # type: ignore[attr-defined]
            raise KeyError(f"{type(self).__name__} has no field {key!r}")
        return getattr(self, key)


# --------------------------------------------------------------------------- worker -> coordinator
@dataclass(frozen=True)
class Hello(ControlMessage):
    """A worker process has started: its role, rank, pid and incarnation id."""

    TAG: ClassVar[str] = "hello"
    role: str
    rank: int
    pid: int
    incarnation: int
    name: str = ""


@dataclass(frozen=True)
class Ready(ControlMessage):
    """The worker is warmed up (graphs captured) and takes work; ``info``: what it reports
    (a target's ``endpoint``, ``warmup_s``, parameter counts)."""

    TAG: ClassVar[str] = "ready"
    info: dict
    name: str = ""


@dataclass(frozen=True)
class Produced(ControlMessage):
    """A target filled and published the batch of job ``job_key``: forward time ``seconds`` (s)
    over ``tokens`` real tokens, ``flops`` model FLOPs (:meth:`dflash.models.target.TargetModel.flops`)
    on a device of ``peak_flops`` FLOP/s (``None``: unknown, no MFU)."""

    TAG: ClassVar[str] = "produced"
    job_key: str
    data_epoch: int
    batch_id: int
    split: str
    drafter: str
    seconds: float
    tokens: int
    flops: float = 0.0
    peak_flops: Optional[float] = None
    name: str = ""


@dataclass(frozen=True)
class Dropped(ControlMessage):
    """A target could not hand job ``job_key`` to its drafter (``reason``): re-assign it."""

    TAG: ClassVar[str] = "dropped"
    job_key: str
    reason: str
    name: str = ""


@dataclass(frozen=True)
class Received(ControlMessage):
    """A drafter has copied the ring slot of job ``job_key``: the job can no longer be lost."""

    TAG: ClassVar[str] = "received"
    job_key: str
    name: str = ""


@dataclass(frozen=True)
class Trained(ControlMessage):
    """A drafter finished optimizer step ``step`` on batch ``batch_id`` of ``data_epoch`` (None: the
    data epoch's last step has no batch for this rank); ``attempt``: the coordinator's attempt
    counter when the step was issued (steps of an attempt before a rollback are ignored)."""

    TAG: ClassVar[str] = "trained"
    attempt: int
    step: int
    data_epoch: int
    batch_id: Optional[int]
    metrics: dict
    name: str = ""


@dataclass(frozen=True)
class Evaluated(ControlMessage):
    """A drafter's held-out sums of evaluation round ``round`` (``loss_sum``, ``weight_sum``,
    ``tau_sum``, ``blocks``, ``head_tau_sum``, ``head_blocks``, per-block-position ``correct`` / ``count``)."""

    TAG: ClassVar[str] = "evaluated"
    attempt: int
    round: int
    sums: dict
    name: str = ""


@dataclass(frozen=True)
class Checkpointed(ControlMessage):
    """Rank 0's checkpoint of step ``step`` is complete on disk at ``path``."""

    TAG: ClassVar[str] = "checkpointed"
    step: int
    path: str
    name: str = ""


@dataclass(frozen=True)
class Heartbeat(ControlMessage):
    """Liveness, with the worker's counters (``stats``: numbers and strings)."""

    TAG: ClassVar[str] = "heartbeat"
    stats: dict
    name: str = ""


@dataclass(frozen=True)
class Failed(ControlMessage):
    """The worker's loop raised ``error``; the process exits non-zero next."""

    TAG: ClassVar[str] = "failed"
    error: str
    name: str = ""


# --------------------------------------------------------------------------- coordinator -> worker
@dataclass(frozen=True)
class Targets(ControlMessage):
    """To a drafter: ``{target name: ring endpoint}`` of every target."""

    TAG: ClassVar[str] = "targets"
    endpoints: dict[str, str]


@dataclass(frozen=True)
class Produce(ControlMessage):
    """To a target: compute batch ``batch_id`` of ``data_epoch`` of ``split`` (``train`` /
    ``heldout``) and publish it to ``drafter`` under ``job_key``."""

    TAG: ClassVar[str] = "produce"
    job_key: str
    data_epoch: int
    batch_id: int
    split: str
    drafter: str


@dataclass(frozen=True)
class Flush(ControlMessage):
    """To a target: the drafter group restarts; forget queued jobs and the credits of ``drafters``."""

    TAG: ClassVar[str] = "flush"
    drafters: list[str]


@dataclass(frozen=True)
class Train(ControlMessage):
    """To every drafter, in the same order: optimizer step ``step`` on batch ``batch_id`` of
    ``data_epoch`` (None: no batch for this rank), taken from the ring slot of ``job_key``;
    ``checkpoint``: rank 0 writes a checkpoint after it; ``position``: the data position after the
    step (what a checkpoint records, :meth:`dflash.data.schedule.DataPosition.to_list`)."""

    TAG: ClassVar[str] = "train"
    attempt: int
    step: int
    data_epoch: int
    batch_id: Optional[int]
    job_key: Optional[str]
    checkpoint: bool
    position: Optional[list[int]] = None


@dataclass(frozen=True)
class Evaluate(ControlMessage):
    """To every drafter: evaluation round ``round`` at step ``step`` on held-out ``batch_ids``,
    taken from the ring slots of ``job_keys`` (same order)."""

    TAG: ClassVar[str] = "evaluate"
    attempt: int
    round: int
    batch_ids: list[int]
    job_keys: list[str]
    step: int


@dataclass(frozen=True)
class Save(ControlMessage):
    """To rank 0: write a checkpoint of step ``step`` now (the final one after a stop)."""

    TAG: ClassVar[str] = "save"
    step: int


@dataclass(frozen=True)
class Stop(ControlMessage):
    """To a worker: leave (``reason``: ``done`` or why the run stops)."""

    TAG: ClassVar[str] = "stop"
    reason: str


# --------------------------------------------------------------------------- node launcher <-> coordinator
@dataclass(frozen=True)
class NodeHello(ControlMessage):
    """A node's launcher (node rank ``node`` > 0) has joined: its address (where its targets bind
    their ring endpoints), pid, incarnation and ``{target name: ring endpoint}`` of its targets."""

    TAG: ClassVar[str] = "node_hello"
    node: int
    addr: str
    pid: int
    incarnation: int
    endpoints: dict[str, str]


@dataclass(frozen=True)
class NodeBeat(ControlMessage):
    """Liveness of a node launcher (both ways). From the node: ``pids`` of its live workers and
    ``stopped`` once every worker has exited after :class:`NodeStop`."""

    TAG: ClassVar[str] = "node_beat"
    node: int
    pids: dict[str, int] = field(default_factory=dict)
    stopped: bool = False


@dataclass(frozen=True)
class NodeExited(ControlMessage):
    """A worker of node ``node`` exited; ``report``: its exit code and last log lines."""

    TAG: ClassVar[str] = "node_exited"
    node: int
    worker: str
    report: str


@dataclass(frozen=True)
class NodeStart(ControlMessage):
    """To a node launcher: (re)start ``worker`` (killing a running one first) as
    ``python -m module *args`` with ``env`` added to the launcher's environment."""

    TAG: ClassVar[str] = "node_start"
    worker: str
    module: str
    args: list[str]
    env: dict[str, str]


@dataclass(frozen=True)
class NodeKill(ControlMessage):
    """To a node launcher: SIGKILL ``worker`` and reap it."""

    TAG: ClassVar[str] = "node_kill"
    worker: str


@dataclass(frozen=True)
class NodeStop(ControlMessage):
    """To a node launcher: the run is over (``reason``): stop its workers, then exit."""

    TAG: ClassVar[str] = "node_stop"
    reason: str


#: Messages a node launcher sends to the coordinator.
NODE_MESSAGES = (NodeHello, NodeBeat, NodeExited)


# --------------------------------------------------------------------------- command-line client <-> coordinator
@dataclass(frozen=True)
class Command(ControlMessage):
    """``python -m launch.cluster status | stop | restart | detach``: command ``cmd`` with ``args``
    (``{"worker": name}`` for restart / detach)."""

    TAG: ClassVar[str] = "ctl"
    cmd: str
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CommandReply(ControlMessage):
    """The coordinator's answer: ``ok``, a line of ``text``, and its status (``data``)."""

    TAG: ClassVar[str] = "ctl_reply"
    ok: bool
    text: str
    data: dict


_TYPES = (Hello, Ready, Produced, Dropped, Received, Trained, Evaluated, Checkpointed, Heartbeat, Failed,
          Targets, Produce, Flush, Train, Evaluate, Save, Stop, Command, CommandReply,
          NodeHello, NodeBeat, NodeExited, NodeStart, NodeKill, NodeStop)
CODEC = Codec("control plane", CONTROL_VERSION, _TYPES, error=ControlError)
#: kind → message class
BY_KIND: dict[str, type] = {cls.TAG: cls for cls in _TYPES}

Message = Union[_TYPES]  # type: ignore[valid-type]
