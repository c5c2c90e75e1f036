"""A separately started producer or consumer process for the transport tests and the GPU check.

Not a test module: ``python -m benchmarks.transport_peer producer|consumer ...``. It prints one JSON
object per line on stdout (``{"event": "started" | "attached" | "stalled" | "done", ...}``) so the
parent can follow it with bounded waits; logs go to stderr.

Every batch is a deterministic pattern of its batch id (:func:`fill_pattern`), so the consumer
checks each received slot completely (:func:`check_pattern`): a stale, torn or misplaced read
counts as ``wrong``.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflash.transport import Consumer, PeerUnavailable, Producer, StopReason
from dflash.transport.layout import DTYPES, SlotSpec

REPO = Path(__file__).resolve().parents[1]

#: Pattern values stay below 251 (a prime): exact in bf16/fp16/int8 and shifted per batch id.
PATTERN_MODULUS = 251
#: Per-field offset so that two fields swapped in the layout cannot both check out.
FIELD_SALT = 17
#: Default bound (s) on one wait for a peer's event.
DEFAULT_WAIT_S = 60.0

log = logging.getLogger("transport_peer")


def spec_from_json(text: str) -> SlotSpec:
    """``{"name": [[dims...], "dtype"], ...}`` → :data:`SlotSpec`."""
    return {k: (tuple(v[0]), DTYPES[v[1]]) for k, v in json.loads(text).items()}


def spec_to_json(spec: SlotSpec) -> str:
    from dflash.transport.layout import dtype_name

    return json.dumps({k: [list(shape), dtype_name(dtype)] for k, (shape, dtype) in spec.items()})


def _expected(t: torch.Tensor, batch_id: int, k: int) -> torch.Tensor:
    base = torch.arange(t.numel(), device=t.device, dtype=torch.int64)
    values = (base + batch_id + FIELD_SALT * k) % PATTERN_MODULUS
    if t.dtype == torch.bool:
        return (values % 2 == 0).view(t.shape)
    return values.to(t.dtype).view(t.shape)


def fill_pattern(tensors: dict[str, torch.Tensor], batch_id: int) -> None:
    """Write batch ``batch_id``'s pattern into every tensor (on their device's current stream)."""
    for k, t in enumerate(tensors.values()):
        t.copy_(_expected(t, batch_id, k))


def check_pattern(tensors: dict[str, torch.Tensor], batch_id: int) -> bool:
    """True when every tensor holds exactly batch ``batch_id``'s pattern."""
    return all(torch.equal(t, _expected(t, batch_id, k)) for k, t in enumerate(tensors.values()))


def memory_snapshot(device: torch.device) -> dict:
    """RSS (MiB) and, on CUDA, allocated / reserved / device-used memory (MiB)."""
    with open("/proc/self/statm") as fh:
        rss_pages = int(fh.read().split()[1])
    out = {"rss_mib": rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        out.update(allocated_mib=torch.cuda.memory_allocated(device) / 2**20,
                   reserved_mib=torch.cuda.memory_reserved(device) / 2**20,
                   device_used_mib=(total - free) / 2**20)
    return out


def _memfds() -> list[str]:
    """Targets of this process's memfd descriptors (``/memfd:dflash-target.0 (deleted)``)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, already closed
            continue
        if target.startswith("/memfd:"):
            out.append(target)
    return out


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


class PeerProcess:
    """Parent side: start this script as a subprocess and read its JSON event lines with deadlines."""

    def __init__(self, role: str, *args: str, env: dict | None = None):
        self.stderr = tempfile.TemporaryFile()
        env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.transport_peer", role, *args],
                                     stdout=subprocess.PIPE, stderr=self.stderr, env=env, cwd=REPO)
        os.set_blocking(self.proc.stdout.fileno(), False)
        self._buf = b""
        self.events: list[dict] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    def next_event(self, kind: str, timeout: float = DEFAULT_WAIT_S) -> dict:
        """The next event named ``kind`` (earlier ones of other kinds are kept in :attr:`events`).

        Raises:
            TimeoutError: none within ``timeout`` s. RuntimeError: the process exited first.
        """
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                event = json.loads(line)
                self.events.append(event)
                if event["event"] == kind:
                    return event
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no {kind!r} event within {timeout} s; stderr:\n{self.log()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], remaining)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    raise RuntimeError(f"peer exited ({self.proc.wait()}) before {kind!r}; stderr:\n{self.log()}")
                self._buf += chunk

    def log(self, tail: int = 6000) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-tail:]

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def finish(self, timeout: float = DEFAULT_WAIT_S) -> int:
        """Wait for the process to exit by itself; its exit status (the log stays readable)."""
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        """Kill it if still running; release the pipes. Idempotent."""
        if self.proc.poll() is None:
            self.kill()
        self.proc.stdout.close()
        self.stderr.close()


def peer_args(**kw) -> list[str]:
    """``peer_args(first_batch=5)`` → ``["--first-batch", "5"]``."""
    out = []
    for key, value in kw.items():
        out += [f"--{key.replace('_', '-')}", str(value)]
    return out


class _Stop:
    requested = False


def _on_term(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    _Stop.requested = True


def run_producer(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    spec = spec_from_json(args.spec)
    consumers = args.consumers.split(",")
    producer = Producer(args.name, args.endpoint, spec, num_slots=args.slots, device=device, carrier=args.carrier,
                        heartbeat_s=args.heartbeat, peer_timeout_s=args.peer_timeout)
    emit("started", pid=os.getpid(), incarnation=producer.incarnation, endpoint=producer.endpoint, memfds=_memfds())
    redo: collections.deque = collections.deque()
    next_batch = args.first_batch
    published = 0
    turn = 0
    mem = []
    while not _Stop.requested and (args.count == 0 or published < args.count):
        for lost in producer.lost_batches():
            redo.append(lost.job_key)
        slot = producer.acquire(timeout=0.05)
        if slot is None:
            continue
        attached = [c for c in consumers if c in producer.consumers]
        if not attached:
            producer.release(slot)
            producer.poll(10)
            continue
        consumer = attached[turn % len(attached)]
        turn += 1
        batch_id = redo.popleft() if redo else next_batch
        if device.type == "cuda" and args.fill_sleep_cycles:
            torch.cuda._sleep(args.fill_sleep_cycles)  # a slow fill: a missing event wait would read stale data
        fill_pattern(producer.slots[slot], batch_id)
        try:
            producer.publish(slot, consumer, batch_id, meta={"published": published})
        except PeerUnavailable:
            producer.release(slot)
            redo.appendleft(batch_id)
            continue
        if batch_id == next_batch:
            next_batch += 1
        published += 1
        if args.mem_every and published % args.mem_every == 0:
            mem.append(memory_snapshot(device))
    # Let the consumers free what is in flight, then stop cleanly.
    deadline = time.monotonic() + args.linger
    while producer.in_flight() and time.monotonic() < deadline and not _Stop.requested:
        producer.poll(20)
    emit("done", published=published, stats=dict(producer.stats), in_flight=len(producer.in_flight()), mem=mem)
    producer.close()
    return 0


def run_consumer(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    spec = spec_from_json(args.spec)
    producers = dict(item.split("=", 1) for item in args.producers.split(","))
    consumer = Consumer(args.name, producers, spec, device=device, carrier=args.carrier,
                        heartbeat_s=args.heartbeat, peer_timeout_s=args.peer_timeout,
                        import_device=args.import_device)
    emit("started", pid=os.getpid(), incarnation=consumer.incarnation)
    received, wrong = 0, 0
    batches = []
    incarnations: dict[str, list[int]] = {}
    mem = []
    stalled = False
    deadline = time.monotonic() + args.max_seconds
    while not _Stop.requested and received < args.count and time.monotonic() < deadline:
        if args.stall_after and received >= args.stall_after:
            if not stalled:
                emit("stalled", received=received, batches=batches)
                stalled = True
            consumer.poll(50)  # alive (heartbeats) but never frees: its credits stay in flight
            continue
        got = consumer.receive(timeout=0.5)
        if got is None:
            continue
        ok = check_pattern(got.tensors, int(got.job_key))
        wrong += not ok
        received += 1
        batches.append(got.job_key)
        seen = incarnations.setdefault(got.producer, [])
        if not seen or seen[-1] != got.producer_incarnation:
            seen.append(got.producer_incarnation)
        if args.mem_every and received % args.mem_every == 0:
            mem.append(memory_snapshot(device))
        if args.progress_every and received % args.progress_every == 0:
            emit("progress", received=received)
    emit("done", received=received, wrong=wrong, batches=batches, incarnations=incarnations, imports=consumer.imports(),
         stats=dict(consumer.stats), mem=mem)
    consumer.close(StopReason.DONE)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=["producer", "consumer"])
    parser.add_argument("--name", required=True)
    parser.add_argument("--spec", required=True, help="JSON {name: [[dims], dtype]}")
    parser.add_argument("--carrier", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--heartbeat", type=float, default=0.1)
    parser.add_argument("--peer-timeout", type=float, default=DEFAULT_WAIT_S,
                        help="liveness timeout (s): generous, the parent may be slow to poll on a loaded machine")
    parser.add_argument("--count", type=int, default=0, help="batches to publish/receive (0: until killed)")
    parser.add_argument("--mem-every", type=int, default=0)
    # producer
    parser.add_argument("--endpoint")
    parser.add_argument("--consumers", default="drafter.0")
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--first-batch", type=int, default=0)
    parser.add_argument("--fill-sleep-cycles", type=int, default=0)
    parser.add_argument("--linger", type=float, default=DEFAULT_WAIT_S,
                        help="longest wait (s) for the consumers to free what is in flight before 'done'")
    # consumer
    parser.add_argument("--producers", help="name=endpoint,...")
    parser.add_argument("--stall-after", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=120.0)
    parser.add_argument("--import-device", default="own")
    parser.add_argument("--progress-every", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname).1s [{args.name}] %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _on_term)
    torch.set_num_threads(1)
    return run_producer(args) if args.role == "producer" else run_consumer(args)


if __name__ == "__main__":
    sys.exit(main())
