"""The shared message codec: every message type of both planes round-trips with random field
values; a bad field is refused at the send and at the receipt with an error naming the message
type and the field."""

from __future__ import annotations

import dataclasses
import random
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import msgpack
import pytest
import torch

from dflash.transport import messages as data_plane
from dflash.transport.codec import Codec, MessageError
from dflash.runtime import control
from dflash.runtime import messages as control_plane

PLANES = [(data_plane.CODEC, data_plane.MessageError), (control_plane.CODEC, control_plane.ControlError)]
ALL_TYPES = [(codec, cls) for codec, _ in PLANES for cls in codec.by_tag.values()]


def _random_value(tp: Any, rng: random.Random) -> Any:
    """A random value of annotation ``tp`` (the slow, obvious generator the codec is checked against)."""
    origin = typing.get_origin(tp)
    if origin is Union:
        args = typing.get_args(tp)
        return _random_value(rng.choice(args), rng) if type(None) not in args or rng.random() < 0.7 else None
    if tp is type(None):
        return None
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: _random_value(hints[f.name], rng) for f in dataclasses.fields(tp)})
    if origin is list or tp is list:
        (item,) = typing.get_args(tp) or (int,)
        return [_random_value(item, rng) for _ in range(rng.randint(0, 4))]
    if origin is dict or tp is dict:
        value_tp = typing.get_args(tp)[1] if typing.get_args(tp) else rng.choice([int, float, str, list[int]])
        return {f"k{rng.randint(0, 99)}": _random_value(value_tp, rng) for _ in range(rng.randint(0, 4))}
    if tp is bool:
        return rng.random() < 0.5
    if tp is int:
        return rng.randint(-2**62, 2**62)
    if tp is float:
        return rng.uniform(-1e6, 1e6)
    if tp is str:
        return "".join(rng.choice("abcτ.:_0123") for _ in range(rng.randint(0, 12)))
    if tp is bytes:
        return rng.randbytes(rng.randint(0, 16))
    raise AssertionError(f"no generator for {tp}")


def _random_message(cls: type, rng: random.Random) -> Any:
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _random_value(hints[f.name], rng) for f in dataclasses.fields(cls)})


def test_both_planes_register_every_message_type():
    assert {cls.__name__ for cls in data_plane.CODEC.by_tag.values()} == {
        "Hello", "Slots", "Ready", "Free", "Heartbeat", "Stop"}
    assert set(control_plane.BY_KIND) == {
        "hello", "ready", "produced", "dropped", "received", "trained", "evaluated", "checkpointed", "heartbeat",
        "failed", "targets", "produce", "flush", "train", "evaluate", "save", "stop", "ctl", "ctl_reply",
        "node_hello", "node_beat", "node_exited", "node_start", "node_kill", "node_stop"}


@pytest.mark.parametrize("codec, cls", ALL_TYPES, ids=lambda x: getattr(x, "__name__", getattr(x, "plane", "")))
def test_every_message_round_trips_with_random_fields(codec, cls):
    rng = random.Random(hash(cls.__name__) % 2**32)
    for _ in range(50):
        msg = _random_message(cls, rng)
        frame = codec.encode(msg)
        back = codec.decode(frame)
        assert type(back) is cls and back == msg
        # the wire form is [version, tag, fields in declaration order]
        wire = msgpack.unpackb(frame, raw=False)
        assert wire[:2] == [codec.version, cls.TAG] and len(wire) == 2 + len(dataclasses.fields(cls))


@pytest.mark.parametrize("codec, cls", ALL_TYPES, ids=lambda x: getattr(x, "__name__", getattr(x, "plane", "")))
def test_a_bad_field_is_named_at_send_and_at_receipt(codec, cls):
    rng = random.Random(1)
    msg = _random_message(cls, rng)
    hints = typing.get_type_hints(cls)
    for i, f in enumerate(dataclasses.fields(cls)):
        if hints[f.name] is Any or hints[f.name] is dict:
            continue
        # an object of the wrong type: at the send
        bad = dataclasses.replace(msg, **{f.name: object()})
        with pytest.raises(codec.error, match=rf"^{cls.__name__}\.{f.name}\b"):
            codec.encode(bad)
        # a frame carrying a value of another msgpack type: at the receipt
        wire = msgpack.unpackb(codec.encode(msg), raw=False)
        wire[2 + i] = b"\x00bytes" if hints[f.name] is not bytes else "text"
        with pytest.raises(codec.error, match=rf"^{cls.__name__}\.{f.name}\b"):
            codec.decode(msgpack.packb(wire, use_bin_type=True))


def test_a_tensor_in_a_map_is_refused_at_the_send_naming_the_field():
    ready = data_plane.Ready("target.0", 1, 2, 0, 1, "train:e0:3:a0", {"features": torch.zeros(2)})
    with pytest.raises(MessageError, match=r"^Ready\.meta: cannot serialise"):
        data_plane.encode(ready)
    trained = control_plane.Trained(attempt=0, step=1, data_epoch=0, batch_id=3, metrics={"loss": torch.ones(1)})
    with pytest.raises(control_plane.ControlError, match=r"^Trained\.metrics: cannot serialise"):
        control_plane.CODEC.encode(trained)


def test_versions_tags_and_planes_are_checked():
    hb = data_plane.Heartbeat("drafter.0", 5, 9)
    wire = msgpack.unpackb(data_plane.encode(hb), raw=False)
    with pytest.raises(MessageError, match="unsupported protocol version"):
        data_plane.decode(msgpack.packb([wire[0] + 1, *wire[1:]]))
    with pytest.raises(MessageError, match="unknown message type 99"):
        data_plane.decode(msgpack.packb([wire[0], 99, *wire[2:]]))
    with pytest.raises(MessageError, match="expected 3 fields, got 2"):
        data_plane.decode(msgpack.packb(wire[:-1]))
    # a message of one plane is not a message of the other
    with pytest.raises(control_plane.ControlError, match="not a control plane message: Heartbeat"):
        control_plane.CODEC.encode(hb)
    with pytest.raises(MessageError, match="not a data plane message"):
        data_plane.encode(control_plane.Save(step=3))
    # bool is never an int, and an int is accepted (as a float) in a float field
    with pytest.raises(MessageError, match=r"Free\.ring_slot: expected int, got bool"):
        data_plane.encode(data_plane.Free("drafter.0", 1, 2, True, 3))
    produced = control_plane.Produced(job_key="k", data_epoch=0, batch_id=1, split="train", drafter="drafter.0",
                                      seconds=2, tokens=10)
    assert control_plane.CODEC.decode(control_plane.CODEC.encode(produced)).seconds == 2.0


def test_the_codec_refuses_bad_message_types():
    @dataclass(frozen=True)
    class A:
        TAG: ClassVar[int] = 1
        x: int

    @dataclass(frozen=True)
    class B:
        TAG: ClassVar[int] = 1
        y: int

    @dataclass(frozen=True)
    class C:
        TAG: ClassVar[int] = 2
        z: set

    with pytest.raises(TypeError, match="share the tag 1"):
        Codec("test", 1, [A, B])
    with pytest.raises(TypeError, match="unsupported annotation"):
        Codec("test", 1, [C])
    with pytest.raises(TypeError, match="not a dataclass with a TAG"):
        Codec("test", 1, [int])


def test_control_client_functions_keep_their_map_form():
    """The command-line client encodes by kind and fields and reads replies as maps."""
    frame = control.encode("ctl", cmd="restart", args={"worker": "target.0"})
    msg = control.decode(frame)
    assert isinstance(msg, control_plane.Command) and msg["type"] == "ctl" and msg["args"] == {"worker": "target.0"}
    reply = control.decode(control.encode("ctl_reply", ok=False, text="no worker", data={"step": 3}))
    assert (reply["type"], reply["ok"], reply["text"], reply["data"]) == ("ctl_reply", False, "no worker", {"step": 3})
    with pytest.raises(control_plane.ControlError, match=r"missing field\(s\) \['text', 'data'\]"):
        control.encode("ctl_reply", ok=True)
    with pytest.raises(control_plane.ControlError, match=r"CommandReply: unknown field\(s\) \['txt'\]"):
        control.encode("ctl_reply", ok=True, txt="x", text="", data={})
    with pytest.raises(control_plane.ControlError, match="unknown message type 'nope'"):
        control.encode("nope")
    with pytest.raises(KeyError, match="no field 'missing'"):
        reply["missing"]


def test_optional_fields_take_none_and_their_type_only():
    train = control_plane.Train(attempt=0, step=4, data_epoch=1, batch_id=None, job_key=None, checkpoint=False)
    assert control_plane.CODEC.decode(control_plane.CODEC.encode(train)) == train
    with pytest.raises(control_plane.ControlError, match=r"^Train\.batch_id: expected Optional\[int\], got str"):
        control_plane.CODEC.encode(dataclasses.replace(train, batch_id="4"))


def test_data_plane_fields_keep_their_wire_order():
    """Each data-plane message's fields in wire order (protocol version 1): the envelope's sender and
    incarnation first, then the message's own; a Heartbeat's bytes spelled out."""
    m = data_plane
    expected = {
        m.Hello: "sender incarnation pid host carrier layout_digest fd_socket",
        m.Slots: "sender incarnation consumer_incarnation pid host pidns carrier num_slots slot_nbytes layout cuda events",
        m.Ready: "sender incarnation consumer_incarnation ring_slot generation job_key meta payload_nbytes",
        m.Free: "sender incarnation producer_incarnation ring_slot generation",
        m.Heartbeat: "sender incarnation peer_incarnation",
        m.Stop: "sender incarnation reason detail",
    }
    assert {cls: " ".join(f.name for f in dataclasses.fields(cls)) for cls in expected} == expected
    assert [cls.TAG for cls in expected] == [1, 2, 3, 4, 5, 6]
    assert m.encode(m.Heartbeat("drafter.0", 12345, 678)) == msgpack.packb([1, 5, "drafter.0", 12345, 678])
