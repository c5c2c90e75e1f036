"""GPU check of the transport (CUDA IPC carrier): self-checking, a compact table, a JSON file.

Run from the repository root on a GPU machine (``docs/gpu-runbook.md``, Set-up, for one without
network access):

    python -m scripts.gpu_transport_check --out results     # ~2-4 min; --quick for a shorter run

Placements: ``same-gpu`` (producer and consumer processes on cuda:0) always; ``cross-gpu``
(producer cuda:0, consumer cuda:1, peer-to-peer copy) when two GPUs are visible. Per placement:

1. **exchange**: 10,000 handoffs between two separately started processes, each slot filled
   with a batch-specific pattern after a deliberately slow kernel (so a missing or misplaced
   event wait would read stale data), checked completely by the consumer: 0 wrong; the ring is
   imported once; memory (RSS, CUDA allocated / reserved / device used) flat on **both** sides
   between handoff 1,000 and 10,000.
2. **restart**: the producer is SIGKILLed mid-stream and restarted; the consumer continues with
   the new incarnation: 0 wrong, never an old-incarnation batch after a new one, one import alive;
   torch's ``/dev/shm/torch_<pid>_*`` ref-counter file of the dead producer is removed.
3. **bench**: handoff latency and GiB/s for 16 MiB … 1 GiB slots beside the raw copy of the same
   size (``benchmarks/bench_transport.py``); at 1 GiB the handoff / raw-copy time ratio
   (target ≤ 1.1) is checked for the best consumer mode.

Exit status 0 when every check passes. With ``--out DIR``: writes ``DIR/transport.json``.
``--budget-s`` bounds the whole run (unbounded by default). Only ``dflash/transport`` (and the
transport helpers in ``benchmarks/``) is imported.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_transport import format_table, run_bench
from benchmarks.transport_peer import PeerProcess, peer_args, spec_to_json

#: The slot of the checks: a realistic mix (bf16 features [R, S, L·D] + per-token tensors), 16 MiB.
CHECK_SPEC = {
    "features": ((2, 1024, 4096), torch.bfloat16),
    "input_ids": ((2, 1024), torch.int64),
    "loss_mask": ((2, 1024), torch.bool),
    "positions": ((2, 1024), torch.int64),
    "target_tokens": ((2, 1024), torch.int64),
}
#: The same mix, small, for ``--cpu-dry-run`` (a CPU fills 16 MiB patterns slowly).
DRY_RUN_SPEC = {
    "features": ((2, 64, 64), torch.bfloat16),
    "input_ids": ((2, 64), torch.int64),
    "loss_mask": ((2, 64), torch.bool),
    "positions": ((2, 64), torch.int64),
    "target_tokens": ((2, 64), torch.int64),
}
#: ~50 µs of GPU time before every fill (H200 SM clock ~1.98 GHz): the fill ends well after READY.
FILL_SLEEP_CYCLES = 100_000
RATIO_TARGET = 1.1
#: Memory growth allowed between the first and the last snapshot (MiB).
FLAT_LIMITS_MIB = {"rss_mib": 32.0, "allocated_mib": 1.0, "reserved_mib": 2.0, "device_used_mib": 16.0}
PEER_WAIT_S = 180.0
#: A step is not started with less than this left (s).
MIN_STEP_S = 40.0
_DEADLINE = [float("inf")]


def _wait_s() -> float:
    """Bound for one wait: PEER_WAIT_S, cut to the run's remaining budget (at least 5 s)."""
    return max(5.0, min(PEER_WAIT_S, _DEADLINE[0] - time.monotonic()))
HEARTBEAT_S = 0.1
PEER_TIMEOUT_S = 10.0


def _shm_torch_files(pid: int) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(f"/dev/shm/torch_{pid}_*"))


def _flat(mem: list[dict]) -> tuple[bool, dict]:
    """Growth per key between the first and the last snapshot, and whether all are within limits."""
    if len(mem) < 2:
        return False, {"error": f"{len(mem)} memory snapshots"}
    growth = {k: round(mem[-1][k] - mem[0][k], 2) for k in FLAT_LIMITS_MIB if k in mem[0]}
    return all(growth[k] <= FLAT_LIMITS_MIB[k] for k in growth), growth


def check_exchange(placement: str, prod_dev: str, cons_dev: str, count: int, run_dir: str,
                   slot_spec: dict = CHECK_SPEC) -> dict:
    endpoint = f"ipc://{run_dir}/x-{placement}"
    spec = spec_to_json(slot_spec)
    mem_every = max(1, count // 10)
    common = peer_args(spec=spec, heartbeat=HEARTBEAT_S, peer_timeout=PEER_TIMEOUT_S, count=count,
                       mem_every=mem_every)
    t0 = time.monotonic()
    producer = PeerProcess("producer", "--name", "target.0", "--endpoint", endpoint, "--device", prod_dev,
                           "--fill-sleep-cycles", str(FILL_SLEEP_CYCLES), "--slots", "2", *common)
    consumer = None
    try:
        producer.next_event("started", _wait_s())
        consumer = PeerProcess("consumer", "--name", "drafter.0", "--producers", f"target.0={endpoint}",
                               "--device", cons_dev, "--max-seconds", str(_wait_s()), *common)
        done = consumer.next_event("done", _wait_s())
        pdone = producer.next_event("done", _wait_s())
        consumer.finish(_wait_s())
        producer.finish(_wait_s())
        seconds = time.monotonic() - t0
    except (TimeoutError, RuntimeError, subprocess.TimeoutExpired) as exc:
        return {"name": "exchange", "placement": placement, "ok": False, "error": str(exc)[-3000:]}
    finally:
        for peer in (producer, consumer):
            if peer is not None:
                peer.close()
    c_flat, c_growth = _flat(done["mem"])
    p_flat, p_growth = _flat(pdone["mem"])
    ok = (done["received"] == count and done["wrong"] == 0 and done["imports"] == 1
          and done["stats"].get("imports") == 1 and c_flat and p_flat)
    return {"name": "exchange", "placement": placement, "ok": ok, "received": done["received"],
            "wrong": done["wrong"], "imports": done["stats"].get("imports"), "seconds": round(seconds, 1),
            "consumer_growth_mib": c_growth, "producer_growth_mib": p_growth,
            "consumer_mem_last": done["mem"][-1] if done["mem"] else {},
            "producer_mem_last": pdone["mem"][-1] if pdone["mem"] else {},
            "torch_shm_left": _shm_torch_files(producer.pid) + _shm_torch_files(consumer.pid)}


def check_restart(placement: str, prod_dev: str, cons_dev: str, run_dir: str, before_kill: int,
                  after_kill: int, slot_spec: dict = CHECK_SPEC) -> dict:
    endpoint = f"ipc://{run_dir}/r-{placement}"
    spec = spec_to_json(slot_spec)
    common = peer_args(spec=spec, heartbeat=HEARTBEAT_S, peer_timeout=PEER_TIMEOUT_S)
    prod_args = ["--name", "target.0", "--endpoint", endpoint, "--device", prod_dev, "--slots", "2",
                 "--fill-sleep-cycles", str(FILL_SLEEP_CYCLES), *common]
    total = before_kill + after_kill
    first = PeerProcess("producer", *prod_args, "--first-batch", "0")
    second = consumer = None
    try:
        first_incarnation = first.next_event("started", _wait_s())["incarnation"]
        consumer = PeerProcess("consumer", "--name", "drafter.0", "--producers", f"target.0={endpoint}",
                               "--device", cons_dev, "--count", str(total), "--progress-every", "10",
                               "--max-seconds", str(_wait_s()), *common)
        while consumer.next_event("progress", _wait_s())["received"] < before_kill:
            pass
        first.kill(signal.SIGKILL)  # mid-stream: slots in flight, READYs pending, fills running
        dead_pid = first.pid
        second = PeerProcess("producer", *prod_args, "--first-batch", "100000")
        second_incarnation = second.next_event("started", _wait_s())["incarnation"]
        done = consumer.next_event("done", _wait_s())
        consumer.finish(_wait_s())
        second.kill(signal.SIGTERM)
        consumer_log = consumer.log(20000)
    except (TimeoutError, RuntimeError, subprocess.TimeoutExpired) as exc:
        return {"name": "restart", "placement": placement, "ok": False, "error": str(exc)[-3000:]}
    finally:
        for peer in (first, second, consumer):
            if peer is not None:
                peer.close()
    incarnations = done["incarnations"].get("target.0", [])
    new_batches = [b for b in done["batches"] if b >= 100000]
    first_new = next((i for i, b in enumerate(done["batches"]) if b >= 100000), len(done["batches"]))
    no_stale = all(b >= 100000 for b in done["batches"][first_new:])
    left = _shm_torch_files(dead_pid)
    ok = (done["received"] == total and done["wrong"] == 0 and no_stale
          and incarnations == [first_incarnation, second_incarnation] and done["imports"] == 1 and done["stats"].get("imports") == 2 and len(new_batches) >= after_kill // 2
          and not left)
    return {"name": "restart", "placement": placement, "ok": ok, "received": done["received"], "wrong": done["wrong"],
            "incarnations_seen": len(incarnations), "old_after_new": not no_stale, "imports_alive": done["imports"],
            "imports_total": done["stats"].get("imports"), "dropped_pending": done["stats"].get("dropped", 0),
            "torch_shm_left_by_dead_producer": left,
            "swept_refcounter_file": "left by dead producer" in consumer_log}


def env_info() -> dict:
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda, "gpus": gpus,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}


def summary(results: dict) -> str:
    lines = ["", "== transport GPU check ==", f"torch {results['env']['torch']}, GPUs: {results['env']['gpus']}", ""]
    head = f"{'check':<9} {'placement':<10} {'result':<6} details"
    lines += [head, "-" * 100]
    for c in results["checks"]:
        if "error" in c:
            details = "ERROR: " + c["error"].strip().splitlines()[-1][:80]
        elif c["name"] == "exchange":
            details = (f"{c['received']} handoffs, {c['wrong']} wrong, {c['imports']} import, {c['seconds']} s; "
                       f"growth cons {c['consumer_growth_mib']} prod {c['producer_growth_mib']}")
        elif c["name"] == "restart":
            details = (f"{c['received']} received, {c['wrong']} wrong, incarnations {c['incarnations_seen']}, old-after-new "
                       f"{c['old_after_new']}, imports {c['imports_alive']} alive/{c['imports_total']} total, "
                       f"/dev/shm left {c['torch_shm_left_by_dead_producer']}")
        else:
            details = c.get("details", "")
        lines.append(f"{c['name']:<9} {c['placement']:<10} {'PASS' if c['ok'] else 'FAIL':<6} {details}")
    if results["bench"]:
        lines += ["", format_table(results["bench"])]
    for r in results.get("ratios", []):
        lines.append(f"1 GiB handoff / raw copy, {r['placement']}: {r['ratio']:.3f}x ({r['mode']}), "
                     f"target <= {RATIO_TARGET}x: {'PASS' if r['ok'] else 'FAIL'}")
    lines.append(f"\nOVERALL: {'PASS' if results['ok'] else 'FAIL'} ({results['seconds']:.0f} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GPU check of dflash.transport")
    parser.add_argument("--quick", action="store_true", help="fewer handoffs, two bench sizes")
    parser.add_argument("--sizes", default="16,64,256,1024", help="bench slot sizes (MiB)")
    parser.add_argument("--no-bench", action="store_true")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="whole-run time budget (s): waits are cut to what is left, steps that cannot start "
                             "are reported skipped (default: none)")
    parser.add_argument("--out", default=None, help="folder for transport.json")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run the same orchestration with CPU peers (shm): tests this script without a GPU")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    _DEADLINE[0] = t0 + args.budget_s if args.budget_s is not None else float("inf")
    if args.cpu_dry_run:
        placements = [("cpu", "cpu", "cpu")]
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing to check (use --cpu-dry-run to exercise this script on CPU)")
        return 2
    else:
        placements = [("same-gpu", "cuda:0", "cuda:0")]
        if torch.cuda.device_count() >= 2:
            placements.append(("cross-gpu", "cuda:0", "cuda:1"))
    count = 2_000 if args.quick else 10_000
    results: dict = {"env": env_info(), "checks": [], "bench": [], "ratios": []}
    with tempfile.TemporaryDirectory(prefix="dfg-") as run_dir:
        for placement, prod, cons in placements:
            spec = DRY_RUN_SPEC if args.cpu_dry_run else CHECK_SPEC
            for name, check in (("exchange", lambda: check_exchange(placement, prod, cons, count, run_dir, spec)),
                                 ("restart", lambda: check_restart(placement, prod, cons, run_dir, 200, 300, spec))):
                if _DEADLINE[0] - time.monotonic() < MIN_STEP_S:
                    res = {"name": name, "placement": placement, "ok": False, "error": "skipped: time budget spent"}
                else:
                    res = check()
                results["checks"].append(res)
                print(json.dumps(res), flush=True)
    sizes = [16, 1024] if args.quick else [int(s) for s in args.sizes.split(",")]
    if not args.no_bench:
        for placement, prod, cons in placements:
            if _DEADLINE[0] - time.monotonic() < MIN_STEP_S:
                results["checks"].append({"name": "bench", "placement": placement, "ok": False,
                                          "error": "skipped: time budget spent"})
                continue
            try:
                rows = run_bench(sizes, device=prod, consumer_device=cons,
                                 carrier="auto" if args.cpu_dry_run else "cuda_ipc")
            except (TimeoutError, RuntimeError, subprocess.TimeoutExpired) as exc:
                results["checks"].append({"name": "bench", "placement": placement, "ok": False, "error": str(exc)})
                continue
            results["bench"] += rows
            big = [r for r in rows if r["size_mib"] == max(sizes)]
            if big and max(sizes) == 1024:
                best = min(big, key=lambda r: r["ratio"])
                mode = ("sync" if best["sync"] else "async") + f"/{best['import_device']}"
                results["ratios"].append({"placement": placement, "ratio": best["ratio"], "mode": mode,
                                          "ok": best["ratio"] <= RATIO_TARGET})
    results["seconds"] = time.monotonic() - t0
    results["ok"] = all(c["ok"] for c in results["checks"]) and all(r["ok"] for r in results["ratios"])
    print(summary(results))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "transport.json").write_text(json.dumps(results, indent=1))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
