#!/usr/bin/env python3
"""The multi-process pipeline on GPUs: throughput, busy fraction, and restarts mid-stream.

Runs ``python -m launch.cluster`` on a config (default ``configs/h200-2gpu.yaml``: one target
process on cuda:0, one drafter process on cuda:1, slots over CUDA IPC) while sampling each GPU's
busy fraction with ``nvidia-smi``; optionally restarts workers through the control socket while
the drafter is mid-stream:

* ``--restart-target-at N``: once step N is logged, ``restart target.0`` (the CUDA IPC producer
  is killed and started again, re-loads and re-compiles its model, exports a new ring with a new
  epoch); measured: seconds until the cluster says it is back, and until the next optimizer step.
* ``--restart-drafters-at M``: once step M is logged, ``restart drafters`` (the drafter group
  rolls back to the newest checkpoint); measured likewise.

Steady-state numbers (steps/s, target and drafter tokens/s, busy fraction per GPU) come from the
window between ``--warm-steps`` and the first restart (or the end). After the run: each GPU's
memory in use (nothing may stay behind), per-worker memory before/after a restart (flat), the
consumer's rejected/dropped READY counts from the drafter log (no stale read), and the losses.

    python -m scripts.gpu_pipeline_check --restart-target-at 20 --restart-drafters-at 32 --out results \\
        target.tokenizer=.gpu/tokenizer-qwen3 data.dataset=.gpu/sharegpt.jsonl

With ``--out DIR``: writes ``DIR/pipeline.json``, the launcher log (``DIR/pipeline_launcher.log``,
written as the run goes) and its metrics (``DIR/pipeline_metrics.jsonl``). ``--budget-s`` bounds
the whole run (unbounded by default).
Exit status: the launcher's (0 = the run finished).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gpu_busy import GpuBusySampler

ROOT = Path(__file__).resolve().parent.parent


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return rows


def train_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "train/loss" in r]


def gpu_memory_used() -> dict:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        return {int(a): float(b) for a, b in (line.split(",") for line in out.strip().splitlines())}
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return {}


def control(run_dir: Path, *words: str) -> dict:
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "launch.cluster", *words, "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    return {"cmd": " ".join(words), "rc": proc.returncode, "at": t0, "out": (proc.stdout + proc.stderr)[-800:]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/h200-2gpu.yaml")
    p.add_argument("--run-dir", default="/tmp/dflash-gpu-run")
    p.add_argument("--warm-steps", type=int, default=5, help="steps excluded from the steady-state window")
    p.add_argument("--restart-target-at", type=int, default=0)
    p.add_argument("--restart-drafters-at", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=None,
                   help="bound on the whole run (s): the launcher is stopped (SIGTERM) when it is reached "
                        "(default: none)")
    p.add_argument("--out", default=None, help="folder for pipeline.json, the launcher log and the metrics")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    run_dir = Path(args.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    out_dir = args.out
    # the launcher log goes straight to --out: it is there even if this script is cut short
    launcher_log = Path(out_dir, "pipeline_launcher.log") if out_dir else run_dir / "launcher.log"
    launcher_log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "launch.cluster", "--config", args.config, "--overwrite", f"run_dir={run_dir}",
           *args.overrides]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    mem_before = gpu_memory_used()
    sampler = GpuBusySampler(interval_ms=100).start()
    t_start = time.time()
    deadline = time.monotonic() + args.budget_s if args.budget_s is not None else float("inf")
    with open(launcher_log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    events: list[dict] = []
    pending = [(n, w) for n, w in ((args.restart_target_at, "target.0"), (args.restart_drafters_at, "drafters")) if n]
    pending.sort()
    metrics_path = run_dir / "metrics.jsonl"
    timed_out = False
    reported = -1
    print(f"launched: {' '.join(cmd)}", flush=True)
    while proc.poll() is None:
        if time.monotonic() > deadline:
            timed_out = True
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            break
        rows = train_rows(read_metrics(metrics_path))
        last = rows[-1]["step"] if rows else 0
        if rows and rows[-1]["step"] != reported:
            reported = rows[-1]["step"]
            print(f"[{time.time() - t_start:6.1f} s] step {reported} loss {rows[-1]['train/loss']:.4f}", flush=True)
        if pending and last >= pending[0][0]:
            _, worker = pending.pop(0)
            ev = control(run_dir, "restart", worker)
            ev.update(worker=worker, at_step=last, mem_before=gpu_memory_used())
            events.append(ev)
            print(f"restart {worker} at step {last}: rc {ev['rc']}", flush=True)
        try:
            proc.wait(0.5)  # a wait on the child, bounded: the metrics file is read twice a second
        except subprocess.TimeoutExpired:
            pass
    rc = proc.returncode
    t_end = time.time()
    rows = read_metrics(metrics_path)
    train = train_rows(rows)
    log_text = launcher_log.read_text(errors="replace")
    # ---------------------------------------------------------------- steady state
    first_restart = min((e["at"] for e in events), default=t_end)
    window = [r for r in train if r["step"] > args.warm_steps and r["time"] <= first_restart]
    steady: dict = {}
    if len(window) >= 2:
        t0, t1 = window[0]["time"], window[-1]["time"]
        steps = window[-1]["step"] - window[0]["step"]
        busy = sampler.busy_between(t0, t1)
        steady = {"from_step": window[0]["step"], "to_step": window[-1]["step"], "seconds": round(t1 - t0, 2),
                  "s_per_step": round((t1 - t0) / max(1, steps), 3),
                  "tokens_per_step": window[-1].get("tokens"),
                  "target_tokens_per_s": round(sum(r.get("tokens", 0) for r in window[1:]) / max(1e-9, t1 - t0), 1),
                  "busy": busy.to_dict()}
        for key in ("time/step_s", "time/drafter_wait_s"):
            vals = [r[key] for r in window if key in r]
            if vals:
                steady[key + "_median"] = sorted(vals)[len(vals) // 2]
        for key in window[-1]:
            if key.endswith(("/step_s", "/busy_s", "/wait_s", "/wait_slot_s", "/mem_gib", "/recompiles", "/rerecords",
                             "tokens_per_s", "busy_fraction")):
                steady.setdefault("last_metrics", {})[key] = window[-1][key]
    sampler.stop()
    # ---------------------------------------------------------------- restarts
    for ev in events:
        after = [r for r in train if r["time"] > ev["at"]]
        ev["first_step_after_s"] = round(after[0]["time"] - ev["at"], 2) if after else None
        ev["first_step_after"] = after[0]["step"] if after else None
        ev.pop("out", None)
    back = [line for line in log_text.splitlines() if "is back after" in line]
    mem_after = gpu_memory_used()
    stale = [line for line in log_text.splitlines()
             if any(w in line for w in ("stale", "rejected", "dropping its ring", "released the ring", "epoch"))]
    mem_rows = {k: [(r["step"], r[k]) for r in train if k in r] for k in (train[-1] if train else {})
                if k.endswith("/mem_gib")}
    res = {"cmd": " ".join(cmd), "rc": rc, "timed_out": timed_out, "wall_s": round(t_end - t_start, 1),
           "steps_done": train[-1]["step"] if train else 0,
           "losses": [(r["step"], round(r["train/loss"], 4)) for r in train],
           "taus": [(r["step"], round(r.get("train/tau", 0), 4)) for r in train],
           "eval": [r for r in rows if "eval/tau" in r],
           "steady": steady, "restarts": events, "back_lines": back[-6:], "transport_lines": stale[-30:],
           "gpu_mem_used_mib_before": mem_before, "gpu_mem_used_mib_after": mem_after,
           "worker_mem_gib": {k: v[:: max(1, len(v) // 12)] + v[-1:] for k, v in mem_rows.items()},
           "errors": [line for line in log_text.splitlines() if " E " in line or "Traceback" in line][-20:]}
    print(json.dumps({k: v for k, v in res.items() if k not in ("losses", "taus", "transport_lines")}, indent=1))
    print("losses:", res["losses"])
    out = args.out
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "pipeline.json").write_text(json.dumps(res, indent=1))
        shutil.copy(metrics_path, Path(out, "pipeline_metrics.jsonl")) if metrics_path.exists() else None
    return rc if rc is not None else 1


if __name__ == "__main__":
    sys.exit(main())
