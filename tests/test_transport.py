"""Transport tests: layout, messages (fuzzed), credits, incarnations, restarts, /dev/shm hygiene, tcp.

Multi-process tests start ``benchmarks/transport_peer.py`` with ``subprocess`` (nothing fork-shared) and
follow its JSON event lines with bounded waits; nothing sleeps to synchronise.
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
import time

import msgpack
import pytest
import torch
import zmq

from benchmarks.transport_peer import PeerProcess, check_pattern, fill_pattern, peer_args, spec_to_json
from dflash.transport import Consumer, MessageError, PeerUnavailable, Producer, SlotLayout, TransportError
from dflash.transport.layout import ALIGN_BYTES
from dflash.transport.messages import (PROTOCOL_VERSION, CudaExport, Free, Heartbeat, Hello, MsgType, Ready, Slots,
                                       Stop, decode, encode, new_incarnation)


SPEC = {
    "features": ((2, 64, 32), torch.float32),
    "hidden_bf16": ((2, 16, 8), torch.bfloat16),
    "input_ids": ((2, 64), torch.int64),
    "loss_mask": ((2, 64), torch.bool),
    "positions": ((2, 64), torch.int64),
    "target_tokens": ((2, 64), torch.int64),
}
#: Bound on any single wait for a peer process event (s); generous for a loaded 2-core CI box.
EVENT_TIMEOUT_S = 60.0
#: Fast heartbeats; a liveness timeout no wait of a loaded test process comes near (the eviction
#: test moves the producer's clock instead of waiting for it).
FAST = {"heartbeat_s": 0.05, "peer_timeout_s": EVENT_TIMEOUT_S}
TRANSPORT_LOGGER = "dflash.transport"


# --------------------------------------------------------------------------- helpers


def Peer(role: str, *args: str) -> PeerProcess:  # noqa: N802 - reads like the class it returns
    return PeerProcess(role, *args)


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def ours(entries: set[str], pids: list[int]) -> set[str]:
    """Entries that this test's processes could have made (others' files are not our business)."""
    return {e for e in entries if "dflash" in e or any(f"_{pid}_" in e or str(pid) in e for pid in pids)}


def attach(producer: Producer, consumer: Consumer, name: str = "drafter.0", timeout: float = EVENT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while name not in producer.consumers or not consumer.attached():
        assert time.monotonic() < deadline, "consumer did not attach"
        producer.poll(5)
        consumer.poll(5)


def drain_until(consumer: Consumer, producer: Producer, pred, timeout: float = EVENT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        producer.poll(2)
        consumer.poll(2)


@pytest.fixture
def run_dir():
    # short path: ipc:// endpoints are unix socket paths (<= 107 bytes)
    with tempfile.TemporaryDirectory(prefix="dft-") as d:
        yield d


# --------------------------------------------------------------------------- layout and messages


def test_layout_packs_aligned_views():
    layout = SlotLayout(SPEC)
    assert layout.nbytes % ALIGN_BYTES == 0
    assert all(f.offset % ALIGN_BYTES == 0 for f in layout.fields)
    flat = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = layout.views(flat)
    for name, (shape, dtype) in SPEC.items():
        assert views[name].shape == shape and views[name].dtype == dtype
    views["input_ids"].fill_(7)
    assert views["positions"].sum() == 0  # no overlap
    assert SlotLayout(SPEC) == layout and SlotLayout(SPEC).digest == layout.digest
    other = dict(SPEC, input_ids=((2, 65), torch.int64))
    assert SlotLayout(other).digest != layout.digest
    with pytest.raises(ValueError):
        SlotLayout({"x": ((2,), torch.complex64)})


def _samples() -> list:
    export = CudaExport([2, 512], [512, 1], 0, 0, "GPU-x", b"h" * 64, 1024, 0, b"/torch_1_2_0", 3, b"e" * 64, True)
    return [
        Hello("drafter.0", 5, 123, "boot", "shm", "abcd", "dflash-fds/x"),
        Slots("target.0", 9, 5, 77, "boot", 4026531836, "cuda_ipc", 2, 512, [["a", [2], "int64", 0, 16]], export,
              [b"e" * 64, b"f" * 64]),
        Slots("target.0", 9, 5, 77, "boot", 1, "shm", 2, 512, [["a", [2], "int64", 0, 16]]),
        Ready("target.0", 9, 5, 1, 3, 42, {"data_epoch": 0, "rows": [1, 2]}),
        Ready("target.0", 9, 5, 1, 3, "eval-7", {}, 512),
        Free("drafter.0", 5, 9, 1, 3),
        Heartbeat("drafter.0", 5, 9),
        Stop("target.0", 9, "done", "bye"),
    ]


def test_messages_roundtrip():
    for msg in _samples():
        assert decode(encode(msg)) == msg


def test_messages_guarded_at_send():
    with pytest.raises(MessageError, match="meta"):
        encode(Ready("target.0", 1, 1, 0, 1, 0, {"features": torch.zeros(2)}))
    with pytest.raises(MessageError, match="slot"):
        encode(Ready("target.0", 1, 1, "zero", 1, 0, {}))  # type: ignore[arg-type]


def test_messages_reject_garbage_wrong_types_and_versions():
    rng = random.Random(0)
    bad = [rng.randbytes(rng.randint(0, 64)) for _ in range(300)]
    bad += [msgpack.packb(x) for x in (None, 1, "x", {}, [], [PROTOCOL_VERSION], {"v": 1})]
    bad += [msgpack.packb([PROTOCOL_VERSION + 1, int(MsgType.FREE), "d", 1, 2, 3, 4])]  # unknown version
    bad += [msgpack.packb([PROTOCOL_VERSION, 99, "d"])]  # unknown type
    bad += [msgpack.packb([PROTOCOL_VERSION, int(MsgType.FREE), "d", 1, 2, 3])]  # missing field
    bad += [msgpack.packb([PROTOCOL_VERSION, int(MsgType.FREE), "d", 1, 2, "3", 4])]  # wrong type
    bad += [msgpack.packb([PROTOCOL_VERSION, int(MsgType.FREE), "d", True, 2, 3, 4])]  # bool is not int
    bad += [msgpack.packb([PROTOCOL_VERSION, int(MsgType.READY), "t", 1, 1, 0, 1, 0, {1: 2}, 0])]  # int map key
    bad += [b"\xc1" * 10, b"\xdd\xff\xff\xff\xff"]  # never-used byte, huge array header
    # mutations of valid messages: every field replaced by a value of another type
    for msg in _samples():
        fields = msgpack.unpackb(encode(msg))
        for i in range(2, len(fields)):
            for junk in (None, 1.5, "s", b"b", [1], {"k": 1}):
                mutated = list(fields)
                mutated[i] = junk
                frame = msgpack.packb(mutated, use_bin_type=True)
                try:
                    decode(frame)
                except MessageError:
                    continue
                # some junk is valid for a permissive field (meta: any map); it must still type-check
                assert type(decode(frame)) is type(msg)
    for frame in bad:
        try:
            decode(frame)
        except MessageError:
            continue
        pytest.fail(f"accepted {frame!r}")  # only MessageError may come out: anything else propagates


def test_incarnations_increase():
    a = new_incarnation()
    time.sleep(0.002)  # incarnation ids have millisecond resolution; this is not synchronisation
    assert new_incarnation() > a > 0 and a < 2**63


# --------------------------------------------------------------------------- one process, real sockets


@pytest.mark.parametrize("carrier", ["shm", "tcp"])
def test_credits_generations_and_lost_on_consumer_restart(run_dir, carrier):
    lost_cb = []
    producer = Producer("target.0", f"ipc://{run_dir}/t0", SPEC, num_slots=3, carrier=carrier,
                        on_lost=lost_cb.extend, **FAST)
    consumer = Consumer("drafter.0", {"target.0": producer.endpoint}, SPEC, carrier=carrier, **FAST)
    try:
        attach(producer, consumer)
        with pytest.raises(PeerUnavailable):
            producer.publish(producer.acquire(0), "drafter.9", 0)
        producer.release(0)
        gens = []
        for b in range(3):  # fill every slot; none is freed yet
            slot = producer.acquire(0)
            fill_pattern(producer.slots[slot], b)
            gens.append(producer.publish(slot, "drafter.0", b, {"b": b}))
        assert producer.acquire(0) is None, "a slot in flight was handed out again"
        got = consumer.receive(EVENT_TIMEOUT_S)
        assert got.job_key == 0 and check_pattern(got.tensors, 0) and got.meta == {"b": 0}
        drain_until(consumer, producer, lambda: producer.free_slots() == 1)
        slot = producer.acquire(0)
        fill_pattern(producer.slots[slot], 3)
        assert producer.publish(slot, "drafter.0", 3) == gens[slot] + 1  # generation per fill
        # The consumer restarts (new incarnation, same name) holding batches 1, 2, 3 in flight.
        consumer.close()
        consumer2 = Consumer("drafter.0", {"target.0": producer.endpoint}, SPEC, carrier=carrier, **FAST)
        consumer = consumer2
        drain_until(consumer, producer, lambda: bool(consumer.attached()))
        lost = sorted(b.job_key for b in producer.lost_batches())
        assert lost == [1, 2, 3] and sorted(b.job_key for b in lost_cb) == [1, 2, 3]
        assert producer.free_slots() == 3, "credits of the dead consumer were not reset"
        for b in lost:  # the coordinator re-assigns them
            slot = producer.acquire(EVENT_TIMEOUT_S)
            fill_pattern(producer.slots[slot], b)
            producer.publish(slot, "drafter.0", b)
            got = consumer.receive(EVENT_TIMEOUT_S)
            assert got.job_key == b and check_pattern(got.tensors, b)
    finally:
        consumer.close()
        producer.close()


def test_routing_two_producers_two_consumers(run_dir):
    """Every consumer connects to every producer; each READY goes to the consumer it names."""
    producers = [Producer(f"target.{i}", f"ipc://{run_dir}/t{i}", SPEC, num_slots=2, carrier="shm", **FAST)
                 for i in range(2)]
    endpoints = {p.name: p.endpoint for p in producers}
    consumers = [Consumer(f"drafter.{j}", endpoints, SPEC, carrier="shm", **FAST) for j in range(2)]
    try:
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while not all(len(c.attached()) == 2 for c in consumers) or not all(len(p.consumers) == 2 for p in producers):
            assert time.monotonic() < deadline, "not everyone attached"
            for x in producers + consumers:
                x.poll(1)
        got: dict[str, list] = {"drafter.0": [], "drafter.1": []}
        for b in range(40):
            producer, target = producers[b % 2], f"drafter.{(b // 2) % 2}"
            slot = producer.acquire(EVENT_TIMEOUT_S)
            fill_pattern(producer.slots[slot], b)
            producer.publish(slot, target, b, {"to": target})
            consumer = consumers[int(target[-1])]
            r = consumer.receive(EVENT_TIMEOUT_S)
            assert r is not None and r.meta["to"] == consumer.name and r.producer == producer.name
            assert check_pattern(r.tensors, b)
            got[consumer.name].append(b)
        assert got == {"drafter.0": [b for b in range(40) if (b // 2) % 2 == 0],
                       "drafter.1": [b for b in range(40) if (b // 2) % 2 == 1]}
        assert all(c.stats["imports"] == 2 for c in consumers)
    finally:
        for x in consumers + producers:
            x.close()


def test_one_ring_serves_a_local_consumer_over_shm_and_a_remote_one_over_tcp():
    """A producer of an shm ring serves a consumer that says it is remote (``remote=``) over tcp:
    that consumer's SLOTS carry no memfd, each READY brings the slot's bytes; the local one maps
    the ring. Both receive exactly what was filled."""
    producer = Producer("target.0", "tcp://127.0.0.1:0", SPEC, num_slots=2, carrier="shm", **FAST)
    near = Consumer("drafter.0", {"target.0": producer.endpoint}, SPEC, carrier="shm", **FAST)
    far = Consumer("drafter.1", {"target.0": producer.endpoint}, SPEC, carrier="shm", remote=["target.0"], **FAST)
    try:
        attach(producer, near, "drafter.0")
        attach(producer, far, "drafter.1")
        for b in range(12):
            consumer = (near, far)[b % 2]
            slot = producer.acquire(EVENT_TIMEOUT_S)
            fill_pattern(producer.slots[slot], b)
            producer.publish(slot, consumer.name, b)
            r = consumer.receive(EVENT_TIMEOUT_S)
            assert r is not None and r.job_key == b and check_pattern(r.tensors, b)
        assert near._links["target.0"].ring.carrier == "shm"
        assert far._links["target.0"].ring.carrier == "tcp"
        assert near.stats["received"] == far.stats["received"] == 6
    finally:
        for x in (near, far, producer):
            x.close()
    with pytest.raises(TransportError, match="remote producer"):
        Consumer("drafter.2", {"target.0": "tcp://127.0.0.1:1"}, SPEC, remote=["target.9"], **FAST)


def test_silent_consumer_is_evicted_and_reattaches_without_stale_reads(run_dir):
    producer = Producer("target.0", f"ipc://{run_dir}/t0", SPEC, num_slots=2, carrier="shm", **FAST)
    consumer = Consumer("drafter.0", {"target.0": producer.endpoint}, SPEC, carrier="shm", **FAST)
    try:
        attach(producer, consumer)
        for b in range(2):
            slot = producer.acquire(0)
            fill_pattern(producer.slots[slot], b)
            producer.publish(slot, "drafter.0", b)
        drain_until(consumer, producer, lambda: consumer.pending() == 2)
        # The consumer goes silent past peer_timeout_s (its clock is moved, nobody sleeps).
        producer._consumers["drafter.0"].last_seen -= FAST["peer_timeout_s"] + 1
        producer.poll(0)
        lost = producer.lost_batches()
        assert sorted(b.job_key for b in lost) == [0, 1] and all(b.reason == "timeout" for b in lost)
        assert producer.free_slots() == 2 and not producer.consumers
        slot = producer.acquire(0)  # refilled for someone else while the consumer still holds a READY for it
        fill_pattern(producer.slots[slot], 99)
        # the EVICTED STOP drops the old READYs before any is handed out (none may be: slot refilled)
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while consumer.stats["dropped"] < 2:
            assert time.monotonic() < deadline, "the EVICTED STOP never arrived"
            consumer.poll(10)
        assert consumer.receive(0) is None and consumer.stats["dropped"] == 2 and consumer.imports() == 1
        drain_until(consumer, producer, lambda: "drafter.0" in producer.consumers and bool(consumer.attached()))
        producer.publish(slot, "drafter.0", 99)
        got = consumer.receive(EVENT_TIMEOUT_S)
        assert got.job_key == 99 and check_pattern(got.tensors, 99)
        assert consumer.stats["imports"] == 1  # same producer incarnation: the import is reused
    finally:
        consumer.close()
        producer.close()


def test_busy_producer_dropped_by_its_consumer_reclaims_its_slots_and_reattaches(run_dir):
    """A producer whose thread is busy past the peer timeout (it reads nothing, sends nothing) is
    dropped by its consumer. The consumer tells it (STOP ``silent``): once the producer reads its
    socket again, every batch in flight to that consumer comes back as lost (the held one and one
    published during the silence, which the consumer discards), all credits return, and the
    consumer attaches again and receives a re-published batch."""
    producer = Producer("target.0", f"ipc://{run_dir}/t0", SPEC, num_slots=3, carrier="shm", **FAST)
    consumer = Consumer("drafter.0", {"target.0": producer.endpoint}, SPEC, carrier="shm", **FAST)
    try:
        attach(producer, consumer)
        slot = producer.acquire(0)
        fill_pattern(producer.slots[slot], 0)
        producer.publish(slot, "drafter.0", 0)
        drain_until(consumer, producer, lambda: consumer.pending() == 1)
        slot = producer.acquire(0)  # (acquire reads the socket: before the silence)
        # The producer goes silent past peer_timeout_s (the consumer's clock is moved, nobody sleeps).
        consumer._links["target.0"].last_seen -= FAST["peer_timeout_s"] + 1
        consumer.poll(0)
        assert not consumer.attached() and consumer.pending() == 0 and consumer.stats["dropped"] == 1
        # still busy: it publishes one more batch before it reads the STOP
        fill_pattern(producer.slots[slot], 1)
        producer.publish(slot, "drafter.0", 1)
        assert producer.free_slots() == 1
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        lost = []
        while sorted(b.job_key for b in lost) != [0, 1]:
            assert time.monotonic() < deadline, f"in-flight batches never reported lost: {lost}"
            producer.poll(5)
            consumer.poll(5)
            lost += producer.lost_batches()
        assert all(b.consumer == "drafter.0" and b.reason == "timeout" for b in lost)
        drain_until(consumer, producer, lambda: "drafter.0" in producer.consumers and bool(consumer.attached()))
        assert producer.free_slots() == 3 and consumer.pending() == 0  # the READY of batch 1 was discarded
        slot = producer.acquire(0)
        fill_pattern(producer.slots[slot], 1)
        producer.publish(slot, "drafter.0", 1)
        got = consumer.receive(EVENT_TIMEOUT_S)
        assert got.job_key == 1 and check_pattern(got.tensors, 1)
        consumer.poll(0)
        drain_until(consumer, producer, lambda: producer.free_slots() == 3)
    finally:
        consumer.close()
        producer.close()


def test_fuzzed_messages_at_producer_are_rejected_and_logged(run_dir, caplog):
    caplog.set_level(logging.WARNING, logger=TRANSPORT_LOGGER)
    producer = Producer("target.0", f"ipc://{run_dir}/t0", SPEC, num_slots=2, carrier="shm", **FAST)
    consumer = Consumer("drafter.0", {"target.0": producer.endpoint}, SPEC, carrier="shm", **FAST)
    ctx = zmq.Context.instance()
    fuzz = ctx.socket(zmq.DEALER)
    fuzz.setsockopt(zmq.IDENTITY, b"fuzzer.1")
    fuzz.setsockopt(zmq.LINGER, 0)
    fuzz.connect(producer.endpoint)
    try:
        attach(producer, consumer)
        slot = producer.acquire(0)
        fill_pattern(producer.slots[slot], 0)
        gen = producer.publish(slot, "drafter.0", 0)
        rng = random.Random(1)
        frames = [rng.randbytes(rng.randint(1, 40)) for _ in range(50)]
        frames += [msgpack.packb([PROTOCOL_VERSION + 7, int(MsgType.HELLO), "fuzzer.1"])]
        frames += [msgpack.packb([PROTOCOL_VERSION, int(MsgType.FREE), "fuzzer.1", "x", 1, 2, 3])]
        # well-formed but wrong: stale producer incarnation, unknown consumer, impersonation, wrong generation
        frames += [encode(Free("fuzzer.1", 1, producer.incarnation - 1, slot, gen))]
        frames += [encode(Free("fuzzer.1", 1, producer.incarnation, slot, gen))]
        frames += [encode(Free("drafter.0", consumer.incarnation, producer.incarnation, slot, gen))]
        frames += [encode(Ready("fuzzer.1", 1, 1, 0, 1, 0, {}))]
        frames += [encode(Hello("fuzzer.1", 1, 1, "other-host", "shm", "nope", ""))]
        for frame in frames:
            fuzz.send(frame)
        fuzz.send_multipart([b"a", b"b", b"c"])
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while producer.stats["rejected"] < len(frames) + 1:
            assert time.monotonic() < deadline, f"only {producer.stats['rejected']} rejected"
            producer.poll(10)
        # A FREE with the wrong generation from the right consumer fails loudly and frees nothing.
        consumer.sockets[0].send(encode(Free("drafter.0", consumer.incarnation, producer.incarnation, slot, gen + 5)))
        drain_until(consumer, producer, lambda: producer.stats["rejected"] == len(frames) + 2)
        assert producer.free_slots() == 1
        # The real exchange still works.
        got = consumer.receive(EVENT_TIMEOUT_S)
        assert got is not None and check_pattern(got.tensors, 0)
        drain_until(consumer, producer, lambda: producer.free_slots() == 2)
    finally:
        fuzz.close()
        consumer.close()
        producer.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert all("target.0: rejected message from" in e for e in errors)
    # messages of an earlier incarnation are normal after a restart: a warning, not an error
    stale = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "ignored stale" in r.getMessage()]
    assert all("target.0: ignored stale message from" in e for e in stale)
    errors += stale
    assert len(errors) >= len(frames) + 1
    assert sum("from fuzzer.1" in e for e in errors) >= len(frames)
    assert any("undecodable" in e for e in errors)
    assert any("unsupported protocol version" in e for e in errors)
    assert any("stale producer incarnation" in e for e in errors)
    assert any("claims sender 'drafter.0'" in e for e in errors)
    assert any("incompatible HELLO" in e for e in errors)
    assert any(f"stale FREE of slot {slot} generation {gen + 5}" in e for e in errors)


def test_fuzzed_messages_at_consumer_are_rejected_and_logged(run_dir, caplog):
    """A fake producer (raw ROUTER) feeds the consumer garbage, stale incarnations and stale generations."""
    caplog.set_level(logging.WARNING, logger=TRANSPORT_LOGGER)
    layout = SlotLayout(SPEC)
    ctx = zmq.Context.instance()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{run_dir}/fake"
    fake.bind(endpoint)
    consumer = Consumer("drafter.0", {"target.9": endpoint}, SPEC, carrier="tcp", **FAST)
    try:
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while not fake.poll(0):  # the consumer (re)sends HELLO from its own loop
            assert time.monotonic() < deadline, "no HELLO"
            consumer.poll(5)
        ident, hello = fake.recv_multipart()
        hello = decode(hello)
        assert isinstance(hello, Hello) and hello.sender == "drafter.0"

        def slots_msg(incarnation):
            return encode(Slots("target.9", incarnation, hello.incarnation, os.getpid(), hello.host, 0, "tcp", 2, layout.nbytes,
                                layout.describe()))

        def ready(incarnation, slot, gen, batch, nbytes=layout.nbytes, consumer_incarnation=None):
            return encode(Ready("target.9", incarnation, consumer_incarnation or hello.incarnation, slot, gen, batch, {}, nbytes))

        payload = torch.zeros(layout.nbytes, dtype=torch.uint8)
        fill_pattern(layout.views(payload), 5)
        e1 = new_incarnation()
        fake.send_multipart([ident, slots_msg(e1)])
        fake.send_multipart([ident, ready(e1, 0, 1, 5), payload.numpy().tobytes()])
        got = consumer.receive(EVENT_TIMEOUT_S)
        assert got is not None and got.producer_incarnation == e1 and check_pattern(got.tensors, 5)
        n_bad = 0
        rng = random.Random(2)
        for _ in range(30):
            fake.send_multipart([ident, rng.randbytes(rng.randint(1, 30))])
            n_bad += 1
        bad = [
            [msgpack.packb([PROTOCOL_VERSION + 1, int(MsgType.READY)])],
            [ready(e1, 0, 1, 6), payload.numpy().tobytes()],  # stale generation (1 already seen)
            [ready(e1, 7, 9, 6), payload.numpy().tobytes()],  # no such slot
            [ready(e1, 1, 1, 6, consumer_incarnation=hello.incarnation - 1), payload.numpy().tobytes()],  # stale consumer incarnation
            [ready(e1, 1, 1, 6)],  # missing payload
            [encode(Heartbeat("target.8", e1, hello.incarnation))],  # impersonation
            [encode(Free("target.9", e1, 1, 0, 1))],  # a consumer never receives FREE
            [encode(Stop("target.9", e1, "done")), b"extra"],
        ]
        for frames in bad:
            fake.send_multipart([ident, *frames])
            n_bad += 1
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while consumer.stats["rejected"] < n_bad:
            assert time.monotonic() < deadline, f"only {consumer.stats['rejected']} of {n_bad} rejected"
            consumer.poll(10)
        # The fake producer "restarts": a newer incarnation replaces the old ring; the old one is stale.
        e2 = e1 + 1
        fake.send_multipart([ident, encode(Heartbeat("target.9", e2, 0))])
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while True:  # the consumer answers the new incarnation with HELLO
            assert time.monotonic() < deadline, "no HELLO after a new incarnation"
            consumer.poll(5)
            if fake.poll(0) and isinstance(decode(fake.recv_multipart()[1]), Hello):
                break
        fake.send_multipart([ident, slots_msg(e2)])
        fill_pattern(layout.views(payload), 8)
        fake.send_multipart([ident, ready(e1, 1, 2, 99), payload.numpy().tobytes()])  # stale incarnation
        fake.send_multipart([ident, ready(e2, 1, 1, 8), payload.numpy().tobytes()])
        got = consumer.receive(EVENT_TIMEOUT_S)
        assert got is not None and got.job_key == 8 and got.producer_incarnation == e2 and check_pattern(got.tensors, 8)
        assert consumer.imports() == 1
    finally:
        consumer.close()
        fake.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
              and ("rejected message" in r.getMessage() or "ignored stale message" in r.getMessage())]
    assert all(r.levelno == logging.WARNING for r in caplog.records if "ignored stale message" in r.getMessage())
    assert sum("drafter.0: rejected message from target.9" in e or "drafter.0: ignored stale message from target.9" in e
               for e in errors) >= n_bad + 1
    for needle in ("undecodable", "unsupported protocol version", "stale READY for slot 0", "READY for slot 7",
                   "stale consumer incarnation", "payload frame", "claims sender 'target.8'", "unexpected Free",
                   "stale producer incarnation"):
        assert any(needle in e for e in errors), needle


# --------------------------------------------------------------------------- separate processes


def test_two_processes_exchange_1000_slots_with_checksums(run_dir):
    before = shm_entries()
    endpoint = f"ipc://{run_dir}/t0"
    producer = Peer("producer", *peer_args(name="target.0", endpoint=endpoint, spec=spec_to_json(SPEC), carrier="shm",
                                           slots=3, count=1000, heartbeat=0.05))
    try:
        started = producer.next_event("started")
        assert started["memfds"], "the ring is not in a memfd"
        consumer = Consumer("drafter.0", {"target.0": endpoint}, SPEC, carrier="shm", **FAST)
        wrong, got_ids = 0, []
        try:
            deadline = time.monotonic() + EVENT_TIMEOUT_S
            while len(got_ids) < 1000:
                assert time.monotonic() < deadline, f"only {len(got_ids)} received"
                got = consumer.receive(1.0)
                if got is not None:
                    wrong += not check_pattern(got.tensors, got.job_key)
                    got_ids.append(got.job_key)
                    deadline = time.monotonic() + EVENT_TIMEOUT_S  # a bound on each batch, not on all
            assert consumer.imports() == 1 and consumer.stats["imports"] == 1
        finally:
            consumer.close()
        done = producer.next_event("done")
        assert producer.finish() == 0
    finally:
        producer.close()
    assert wrong == 0 and got_ids == list(range(1000))
    assert done["published"] == 1000 and done["stats"]["freed"] == 1000
    assert not ours(shm_entries() - before, [started["pid"], os.getpid()])


def test_producer_sigkill_and_restart(run_dir):
    before = shm_entries()
    endpoint = f"ipc://{run_dir}/t0"
    common = peer_args(name="target.0", endpoint=endpoint, spec=spec_to_json(SPEC), carrier="shm", slots=2,
                       heartbeat=0.05)
    first = Peer("producer", *common, "--first-batch", "0")
    consumer = Consumer("drafter.0", {"target.0": endpoint}, SPEC, carrier="shm", **FAST)
    pids = [os.getpid()]
    try:
        pids.append(first.next_event("started")["pid"])
        seen: list[tuple[int, int]] = []
        wrong = 0

        def take(n: int) -> None:
            nonlocal wrong
            deadline = time.monotonic() + EVENT_TIMEOUT_S
            while n:
                assert time.monotonic() < deadline, "receive stalled"
                got = consumer.receive(1.0)
                if got is not None:
                    wrong += not check_pattern(got.tensors, got.job_key)
                    seen.append((got.producer_incarnation, got.job_key))
                    n -= 1
                    deadline = time.monotonic() + EVENT_TIMEOUT_S

        take(100)
        first.kill()  # mid-stream: slots are in flight, READYs may be pending
        second = Peer("producer", *common, "--first-batch", "100000")
        try:
            started = second.next_event("started")
            pids.append(started["pid"])
            take(100)
            new_incarnation_id = started["incarnation"]
            after = [(e, b) for e, b in seen if e == new_incarnation_id]
            assert len(after) >= 100 - 2
            # after the first batch of the new incarnation, nothing of the old one is ever read
            first_new = next(i for i, (e, _) in enumerate(seen) if e == new_incarnation_id)
            assert all(e == new_incarnation_id for e, _ in seen[first_new:])
            assert all(b >= 100000 for _, b in after)
            assert consumer.imports() == 1 and consumer.stats["imports"] == 2
        finally:
            second.kill()
            second.close()
    finally:
        consumer.close()
        first.close()
    assert wrong == 0
    assert not ours(shm_entries() - before, pids)


def test_consumer_sigkill_restart_resets_credits(run_dir):
    before = shm_entries()
    producer = Producer("target.0", f"ipc://{run_dir}/t0", SPEC, num_slots=3, carrier="shm", **FAST)
    common = peer_args(name="drafter.0", producers=f"target.0={producer.endpoint}", spec=spec_to_json(SPEC),
                       carrier="shm", heartbeat=0.05)
    first = Peer("consumer", *common, "--count", "1000", "--stall-after", "5")
    pids = [os.getpid()]
    batch = 0
    try:
        pids.append(first.next_event("started")["pid"])

        def publish_until(pred, timeout=EVENT_TIMEOUT_S):
            nonlocal batch
            deadline = time.monotonic() + timeout
            while not pred():
                assert time.monotonic() < deadline, "publishing stalled"
                slot = producer.acquire(0.01)
                if slot is None or "drafter.0" not in producer.consumers:
                    if slot is not None:
                        producer.release(slot)
                    continue
                fill_pattern(producer.slots[slot], batch)
                producer.publish(slot, "drafter.0", batch)
                batch += 1

        publish_until(lambda: batch >= 5)
        first.next_event("stalled")
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while producer.stats["freed"] < 5:  # the 5 received batches are freed before the stall
            assert time.monotonic() < deadline, "FREEs of the received batches never arrived"
            producer.poll(10)
        publish_until(lambda: producer.free_slots() == 0)  # every credit is now held by the stalled consumer
        in_flight = sorted(b for _, b in producer.in_flight().values())
        assert len(in_flight) == 3
        first.kill()
        second = Peer("consumer", *common, "--count", "20")
        try:
            pids.append(second.next_event("started")["pid"])
            deadline = time.monotonic() + EVENT_TIMEOUT_S
            lost = []
            while not lost:
                assert time.monotonic() < deadline, "the restart was not detected"
                producer.poll(10)
                lost = producer.lost_batches()
            assert sorted(b.job_key for b in lost) == in_flight
            assert all(b.reason == "restarted" for b in lost)
            assert producer.free_slots() == 3, "credits were not reset"
            redo = [b.job_key for b in lost]
            deadline = time.monotonic() + EVENT_TIMEOUT_S
            sent = 0
            while sent < 20:  # the lost batches first, then new ones: no slot and no batch is lost
                assert time.monotonic() < deadline
                slot = producer.acquire(0.05)
                if slot is None:
                    continue
                deadline = time.monotonic() + EVENT_TIMEOUT_S
                b = redo.pop(0) if redo else batch
                batch += b == batch
                fill_pattern(producer.slots[slot], b)
                producer.publish(slot, "drafter.0", b)
                sent += 1
            done = second.next_event("done")
            assert second.finish() == 0
        finally:
            second.close()
    finally:
        first.close()
        producer.close()
    assert done["wrong"] == 0 and done["received"] == 20
    assert sorted(done["batches"][:3]) == in_flight
    assert not ours(shm_entries() - before, pids)


def test_tcp_carrier_between_processes_on_loopback():
    with zmq.Context.instance().socket(zmq.ROUTER) as probe:  # a free loopback port
        port = probe.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    producer = Peer("producer", *peer_args(name="target.0", endpoint=endpoint, spec=spec_to_json(SPEC), carrier="tcp",
                                           slots=2, count=300, heartbeat=0.05))
    try:
        producer.next_event("started")
        wrong, ids = 0, []
        with Consumer("drafter.0", {"target.0": endpoint}, SPEC, carrier="tcp", **FAST) as consumer:
            deadline = time.monotonic() + EVENT_TIMEOUT_S
            while len(ids) < 300:
                assert time.monotonic() < deadline
                got = consumer.receive(1.0)
                if got is not None:
                    wrong += not check_pattern(got.tensors, got.job_key)
                    ids.append(got.job_key)
                    deadline = time.monotonic() + EVENT_TIMEOUT_S
        assert producer.next_event("done")["stats"]["freed"] == 300
        assert producer.finish() == 0
    finally:
        producer.close()
    assert wrong == 0 and ids == list(range(300))


def test_mismatched_spec_is_refused(run_dir, caplog):
    caplog.set_level(logging.ERROR, logger=TRANSPORT_LOGGER)
    producer = Producer("target.0", f"ipc://{run_dir}/t0", SPEC, carrier="shm", **FAST)
    other = dict(SPEC, input_ids=((2, 65), torch.int64))
    consumer = Consumer("drafter.0", {"target.0": producer.endpoint}, other, carrier="shm", **FAST)
    try:
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while not consumer.stopped():
            assert time.monotonic() < deadline
            producer.poll(5)
            consumer.poll(5)
        assert consumer.stopped() == {"target.0": "incompatible"} and not producer.consumers
    finally:
        consumer.close()
        producer.close()
    assert any("incompatible HELLO: slot layout" in r.getMessage() for r in caplog.records)


def test_bad_arguments():
    with pytest.raises(TransportError, match="cuda_ipc needs a CUDA device"):
        Producer("t", "ipc:///tmp/never", SPEC, carrier="cuda_ipc")
    with pytest.raises(TransportError, match="unknown carrier"):
        Consumer("d", {}, SPEC, carrier="pigeon")


# --------------------------------------------------------------------------- GPU (skipped on CPU)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ipc_exchange_between_processes(run_dir):
    endpoint = f"ipc://{run_dir}/t0"
    spec = dict(SPEC, features=((4, 256, 512), torch.bfloat16))
    producer = Peer("producer", *peer_args(name="target.0", endpoint=endpoint, spec=spec_to_json(spec), device="cuda:0",
                                           slots=2, count=200, heartbeat=0.05, fill_sleep_cycles=200_000))
    dev = torch.cuda.device_count() - 1
    try:
        producer.next_event("started")
        consumer = Peer("consumer", *peer_args(name="drafter.0", producers=f"target.0={endpoint}",
                                               spec=spec_to_json(spec), device=f"cuda:{dev}", count=200, heartbeat=0.05))
        try:
            done = consumer.next_event("done", timeout=120)
            assert consumer.finish() == 0
        finally:
            consumer.close()
        assert producer.finish() == 0
    finally:
        producer.close()
    assert done["received"] == 200 and done["wrong"] == 0 and done["imports"] == 1
