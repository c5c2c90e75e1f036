"""Slot handoff benchmark: latency and GiB/s per slot size, beside a raw copy of the same size.

    python -m benchmarks.bench_transport                       # CPU: shm carrier
    python -m benchmarks.bench_transport --device cuda:0 --consumer-device cuda:1
    python -m benchmarks.bench_transport --sizes 16,64 --out results   # results/bench_transport.json

This process is the consumer (and the orchestrator); it starts itself once more as the producer
(``--role producer``), a separate process, which serves every size in turn. Per size and per
*round* (a consumer configuration: CUDA ``sync`` or ``async`` FREE, ``own`` or ``exporter`` import
device) it measures:

* **pipelined**: the producer keeps every slot (K = 2) published as soon as it is free; the
  consumer's time per handoff (receive → event wait → copy into its own buffer → FREE), over
  ``iters`` handoffs after a warm-up → ``handoff GiB/s`` = slot bytes / time per handoff;
* **ping-pong**: one slot in flight at a time; the producer's round trip publish → FREE received
  (median, µs) = the latency of one handoff including the copy;
* **raw copy**: in the consumer process, ``dst.copy_(src)`` of the same byte count, ``src`` on the
  producer's device (a peer copy across GPUs, a device copy on one GPU, a memcpy on CPU) →
  ``raw GiB/s``; ``ratio`` = handoff time / raw copy time (1.0 = the transport costs nothing).

Producer fills are not timed (the slot's content is irrelevant here; the fill event is still
recorded and waited on for every handoff).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from dflash.transport import Consumer, Producer, SlotLayout

REPO = Path(__file__).resolve().parents[1]

log = logging.getLogger("bench_transport")

MIB = 2**20
GIB = 2**30
DEFAULT_SIZES_MIB = (16, 64, 256, 1024)
#: Bytes moved per size and phase: iterations = clamp(budget / size, MIN_ITERS, MAX_ITERS).
BYTES_BUDGET = {"cpu": 2 * GIB, "cuda": 16 * GIB}
MIN_ITERS, MAX_ITERS = 3, 200
WARMUP = 2
NUM_SLOTS = 2
CONSUMER = "bench.consumer"
PRODUCER = "bench.producer"
#: Bound on any wait for the other process (s).
WAIT_S = 120.0
#: Rounds (consumer configurations) by placement; CPU has one.
ROUNDS_CPU = [{"sync": True, "import_device": "own"}]
ROUNDS_CUDA = [{"sync": True, "import_device": "own"}, {"sync": False, "import_device": "own"}]
ROUNDS_CUDA_CROSS = ROUNDS_CUDA + [{"sync": False, "import_device": "exporter"}]


def iters_for(size_bytes: int, kind: str) -> int:
    return max(MIN_ITERS, min(MAX_ITERS, BYTES_BUDGET[kind] // size_bytes))


def slot_spec(size_bytes: int) -> dict:
    """A slot of ``size_bytes``: bf16 features plus the small per-token tensors of a batch."""
    tokens = 8192
    small = {"input_ids": ((tokens,), torch.int64), "loss_mask": ((tokens,), torch.bool),
             "positions": ((tokens,), torch.int64), "target_tokens": ((tokens,), torch.int64)}
    small_bytes = tokens * (8 + 1 + 8 + 8)
    return {"features": ((max(1, (size_bytes - small_bytes) // 2),), torch.bfloat16), **small}


def _emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


# --------------------------------------------------------------------------- producer process


def run_producer(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kind = device.type
    for size_mib in [int(s) for s in args.sizes.split(",")]:
        size = size_mib * MIB
        iters = iters_for(size, kind)
        producer = Producer(PRODUCER, f"{args.endpoint}-{size_mib}", slot_spec(size), num_slots=NUM_SLOTS,
                            device=device, carrier=args.carrier, heartbeat_s=0.5, peer_timeout_s=60.0)
        for slot in producer.slots:
            for t in slot.values():
                t.zero_()
        _emit("ready", size_mib=size_mib)
        rtts_all = []
        for _round in range(args.rounds):
            deadline = time.monotonic() + WAIT_S
            while CONSUMER not in producer.consumers:
                if time.monotonic() > deadline:
                    raise TimeoutError("the consumer never attached")
                producer.poll(10)
            # pipelined: every slot in flight as soon as it is free
            for i in range(WARMUP + iters):
                slot = producer.acquire(timeout=WAIT_S)
                if slot is None:
                    raise TimeoutError("no slot freed")
                producer.publish(slot, CONSUMER, i)
            # ping-pong: one in flight; round trip publish → FREE
            while producer.free_slots() < NUM_SLOTS:
                producer.poll(1)
            rtts = []
            for i in range(WARMUP + iters):
                slot = producer.acquire(timeout=WAIT_S)
                t0 = time.perf_counter()
                producer.publish(slot, CONSUMER, 100_000 + i)
                while producer.free_slots() < NUM_SLOTS:
                    producer.poll(1)  # returns on the FREE's arrival: a wait for a message, not a sleep
                if i >= WARMUP:
                    rtts.append(time.perf_counter() - t0)
            rtts_all.append(rtts)
            deadline = time.monotonic() + WAIT_S
            while CONSUMER in producer.consumers:  # the consumer's STOP ends the round
                if time.monotonic() > deadline:
                    raise TimeoutError("the consumer never stopped")
                producer.poll(10)
        _emit("rtts", size_mib=size_mib, rtts=rtts_all)
        producer.close()
    return 0


# --------------------------------------------------------------------------- consumer side (this process)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def raw_copy_s(size: int, src_device: torch.device, dst_device: torch.device, iters: int) -> float:
    """Seconds per ``dst.copy_(src)`` of ``size`` bytes (median of ``iters``; CUDA: event-timed).

    The sources alternate between ``NUM_SLOTS`` buffers, as the ring's slots do, so caches favour
    neither side of the comparison.
    """
    srcs = [torch.full((size,), 1, dtype=torch.uint8, device=src_device) for _ in range(NUM_SLOTS)]
    dst = torch.empty(size, dtype=torch.uint8, device=dst_device)
    times = []
    for i in range(WARMUP):
        dst.copy_(srcs[i % NUM_SLOTS])
    _sync(dst_device)
    _sync(src_device)
    for i in range(iters):
        src = srcs[i % NUM_SLOTS]
        if dst_device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del srcs, dst
    return statistics.median(times)


class _Follower:
    """Reads the producer's JSON lines with deadlines."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        os.set_blocking(proc.stdout.fileno(), False)
        self.buf = b""

    def next(self, kind: str, timeout: float = WAIT_S) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                event = json.loads(line)
                if event["event"] == kind:
                    return event
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"producer sent no {kind!r} within {timeout} s")
            if select.select([self.proc.stdout], [], [], remaining)[0]:
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    raise RuntimeError(f"producer exited ({self.proc.wait()}) before {kind!r}")
                self.buf += chunk


def run_bench(sizes_mib: list[int], device: str = "cpu", consumer_device: Optional[str] = None,
              carrier: str = "auto", rounds: Optional[list[dict]] = None) -> list[dict]:
    """Run the benchmark; one row per (size, round).

    Args:
        sizes_mib: slot sizes (MiB).
        device: the producer's device (``cpu`` → shm carrier, ``cuda:N`` → CUDA IPC).
        consumer_device: this process's device (default: ``device``).
        carrier: ``auto``, ``shm``, ``cuda_ipc`` or ``tcp``.
        rounds: consumer configurations ``{"sync": bool, "import_device": "own" | "exporter"}``.
    Returns:
        Rows with ``size_mib``, ``placement``, ``sync``, ``import_device``, ``iters``,
        ``handoff_us`` (pipelined, per handoff), ``handoff_gibs``, ``rtt_us`` (ping-pong median),
        ``raw_us``, ``raw_gibs`` and ``ratio`` (handoff / raw time).
    """
    prod_dev = torch.device(device)
    cons_dev = torch.device(consumer_device or device)
    kind = cons_dev.type
    if kind == "cuda":
        torch.cuda.set_device(cons_dev)
    if rounds is None:
        rounds = ROUNDS_CPU if kind == "cpu" else (ROUNDS_CUDA_CROSS if prod_dev != cons_dev else ROUNDS_CUDA)
    placement = ("cpu" if kind == "cpu" else "same-gpu" if prod_dev == cons_dev else "cross-gpu")
    rows = []
    with tempfile.TemporaryDirectory(prefix="dfb-") as run_dir:
        endpoint = f"ipc://{run_dir}/p"
        cmd = [sys.executable, "-m", "benchmarks.bench_transport", "--role", "producer", "--device", str(prod_dev),
               "--sizes", ",".join(map(str, sizes_mib)), "--endpoint", endpoint, "--carrier", carrier,
               "--rounds", str(len(rounds))]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=REPO)
        follow = _Follower(proc)
        try:
            for size_mib in sizes_mib:
                size = size_mib * MIB
                iters = iters_for(size, kind)
                spec = slot_spec(size)
                follow.next("ready")
                # measured while the producer idles (waiting for the attach), not while it allocates
                raw = raw_copy_s(SlotLayout(spec).nbytes, prod_dev, cons_dev, iters)
                handoffs = []
                for cfg in rounds:
                    consumer = Consumer(CONSUMER, {PRODUCER: f"{endpoint}-{size_mib}"}, spec, device=cons_dev,
                                        carrier=carrier, heartbeat_s=0.5, peer_timeout_s=60.0, sync=cfg["sync"],
                                        import_device=cfg["import_device"])
                    if not consumer.wait_attached(timeout=WAIT_S):
                        raise TimeoutError("never attached")
                    nbytes = consumer.layout.nbytes
                    for _ in range(WARMUP):
                        consumer.receive(WAIT_S)
                    _sync(cons_dev)
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        if consumer.receive(WAIT_S) is None:
                            raise TimeoutError("receive timed out")
                    _sync(cons_dev)
                    handoffs.append((time.perf_counter() - t0) / iters)
                    for _ in range(WARMUP + iters):  # the ping-pong phase (timed by the producer)
                        if consumer.receive(WAIT_S) is None:
                            raise TimeoutError("receive timed out")
                    consumer.close()
                rtts = follow.next("rtts")["rtts"]
                for cfg, handoff, rtt in zip(rounds, handoffs, rtts):
                    rows.append({
                        "size_mib": size_mib, "slot_mib": round(nbytes / MIB, 2), "placement": placement,
                        "sync": cfg["sync"], "import_device": cfg["import_device"], "iters": iters,
                        "handoff_us": handoff * 1e6, "handoff_gibs": nbytes / GIB / handoff,
                        "rtt_us": statistics.median(rtt) * 1e6, "raw_us": raw * 1e6, "raw_gibs": nbytes / GIB / raw,
                        "ratio": handoff / raw})
            proc.wait(timeout=WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
    return rows


def format_table(rows: list[dict]) -> str:
    head = (f"{'slot MiB':>9} {'placement':>10} {'mode':>14} {'iters':>5} {'handoff us':>11} {'handoff GiB/s':>13} "
            f"{'RTT us':>9} {'raw GiB/s':>10} {'ratio':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        mode = ("sync" if r["sync"] else "async") + ("/exp" if r["import_device"] == "exporter" else "")
        lines.append(f"{r['slot_mib']:>9.1f} {r['placement']:>10} {mode:>14} {r['iters']:>5} {r['handoff_us']:>11.1f} "
                     f"{r['handoff_gibs']:>13.1f} {r['rtt_us']:>9.1f} {r['raw_gibs']:>10.1f} {r['ratio']:>6.2f}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="slot handoff latency and bandwidth")
    parser.add_argument("--role", choices=["consumer", "producer"], default="consumer")
    parser.add_argument("--device", default="cpu", help="the producer's device")
    parser.add_argument("--consumer-device", default=None)
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES_MIB)), help="slot sizes, MiB")
    parser.add_argument("--carrier", default="auto")
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="folder for bench_transport.json (the rows)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname).1s [bench.{args.role}] %(name)s: %(message)s")
    if args.role == "producer":
        return run_producer(args)
    rows = run_bench([int(s) for s in args.sizes.split(",")], args.device, args.consumer_device, args.carrier)
    print(format_table(rows))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "bench_transport.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
