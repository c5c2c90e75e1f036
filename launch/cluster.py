"""``python -m launch.cluster --config configs/X.yaml [section.key=value ...]``

Starts the coordinator (in this process) and one OS process per worker: target ranks on their
GPUs, drafter ranks on theirs (on CPU, one process per entry of ``cluster.targets`` /
``cluster.drafters``). Supervises them, forwards their logs with the worker's name, writes
metrics (console line with ETA, wandb) and exits non-zero when the run fails.

Order of events: validate the config (before any model loads) → prepare and cache the data →
start workers → every target READY (model loaded, forward compiled and warmed up, slots
exported) → drafters connect → every drafter READY (graphs captured) → batches flow → final
checkpoint → workers stopped.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import time
from pathlib import Path
from typing import Optional

import yaml

from dflash.checkpoint import latest_checkpoint, read_state
from dflash.config import ConfigError, RunConfig, load_config, resolve_device
from dflash.factory import build_batch_plans
from dflash.logs import setup_logging
from dflash.metrics import ProgressLine, WandbRun, format_duration
from dflash.schedule import StepPlan
from dflash.workers.control import CoordinatorSocket
from dflash.workers.coordinator import Coordinator, build_work_items
from launch.supervisor import Supervisor, WorkerSpec

log = logging.getLogger("dflash.cluster")

EXIT_CONFIG = 2


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launch.cluster", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint of the run directory (starts fresh when there is none)")
    p.add_argument("--overwrite", action="store_true", help="discard an existing run directory's checkpoints")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    return p.parse_args(argv)


def derived_values(cfg: RunConfig, plan: StepPlan, heldout_batches: int) -> dict:
    from dflash.optim import warmup_steps

    return {
        "batches_per_epoch": plan.batches_per_epoch[0],
        "optimizer_steps_per_drafter": plan.total_steps,
        "warmup_steps": warmup_steps(plan.total_steps, cfg.train),
        "heldout_batches": heldout_batches,
        "rows_per_batch": cfg.rows_per_batch,
        "num_targets": len(cfg.cluster.targets),
        "num_drafters": len(cfg.cluster.drafters),
    }


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--mode=regenerate" in argv or ("--mode" in argv[:-1] and argv[argv.index("--mode") + 1] == "regenerate"):
        # issue 10: the target rewrites the training responses (dflash/regenerate.py)
        from dflash.regenerate import main as regenerate_main

        rest = [a for a in argv if a != "--mode=regenerate"]
        if "--mode" in rest:
            del rest[rest.index("--mode"):rest.index("--mode") + 2]
        return regenerate_main(rest)
    args = parse_args(argv)
    setup_logging("cluster")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        log.error("config error: %s", exc)
        return EXIT_CONFIG
    setup_logging("cluster", cfg.log.level)
    run_dir = cfg.resolved_run_dir().resolve()
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None and not (args.resume or args.overwrite):
        log.error("%s already holds checkpoints (newest: %s): pass --resume to continue it or --overwrite to "
                  "start again, or choose another run_dir / name", run_dir, ckpt.name)
        return EXIT_CONFIG
    if args.overwrite and (run_dir / "checkpoints").exists():
        import shutil

        shutil.rmtree(run_dir / "checkpoints")
        ckpt = None
    if args.resume and ckpt is None:
        log.info("--resume: no checkpoint in %s yet, starting fresh", run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg)

    started = time.monotonic()
    plans = build_batch_plans(cfg)
    batches_per_epoch = [plans.train.num_batches(e) for e in range(cfg.train.epochs)]
    plan = StepPlan(batches_per_epoch, len(cfg.cluster.drafters), cfg.train.max_steps)
    heldout_batches = plans.heldout.num_batches(0) if plans.heldout is not None else 0
    start_step = read_state(ckpt)["step"] if ckpt is not None else 0
    if start_step >= plan.total_steps:
        log.info("run %s is already complete (%d/%d steps); nothing to do", cfg.name, start_step, plan.total_steps)
        return 0
    derived = derived_values(cfg, plan, heldout_batches)
    log.info("%d batches/epoch x %d epoch(s), %d drafter(s) -> %d optimizer steps%s; data ready in %.1f s",
             batches_per_epoch[0], cfg.train.epochs, len(cfg.cluster.drafters), plan.total_steps,
             f", resuming at step {start_step}" if start_step else "", time.monotonic() - started)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))

    items = build_work_items(plan, start_step, heldout_batches, cfg.train.eval_every, cfg.checkpoint.every,
                             eval_batches=cfg.train.eval_batches)
    sock = CoordinatorSocket(cfg.transport.host)
    progress = ProgressLine(plan.total_steps, start_step, every=cfg.log.every * 10)
    supervisor = Supervisor(run_dir, progress.write)
    master_port = _free_port()
    common = ["--run-dir", str(run_dir), "--control", sock.endpoint]
    resume_args = ["--resume-from", str(ckpt)] if ckpt is not None else []
    targets = [f"target.{r}" for r in range(len(cfg.cluster.targets))]
    drafters = [f"drafter.{r}" for r in range(len(cfg.cluster.drafters))]
    for r in range(len(targets)):
        supervisor.start(WorkerSpec(targets[r], "target", r, "dflash.workers.target", ["--rank", str(r), *common]))
    for r in range(len(drafters)):
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), "RANK": str(r),
               "WORLD_SIZE": str(len(drafters)), "LOCAL_RANK": str(r)}
        supervisor.start(WorkerSpec(drafters[r], "drafter", r, "dflash.workers.drafter",
                                    ["--rank", str(r), *common, *resume_args], env=env))

    wandb_id_file = run_dir / "wandb_id"
    resume_id = wandb_id_file.read_text().strip() if (ckpt is not None and wandb_id_file.is_file()) else None
    wb = WandbRun(cfg.log.wandb, cfg.log.project, cfg.name, run_dir, {**cfg.to_dict(), **derived}, resume_id)
    if wb.id:
        wandb_id_file.write_text(wb.id)

    def dead_workers() -> list[str]:
        return [supervisor.report(w) for w in supervisor.dead()]

    coordinator = Coordinator(sock, targets, drafters, plan, start_step, items, cfg.transport.slots,
                              dead_workers=dead_workers, on_metrics=lambda step, m: wb.log(m, step),
                              on_progress=progress.update, peer_timeout_s=cfg.transport.peer_timeout_s)
    coordinator.install_signal_handlers()
    trainable_logged = False

    def on_metrics(step: int, metrics: dict) -> None:
        nonlocal trainable_logged
        if not trainable_logged and wb.run is not None and "drafter.0" in coordinator.ready:
            wb.run.config.update({"trainable_params_M": coordinator.ready["drafter.0"].get("trainable_params_M")},
                                 allow_val_change=True)
            trainable_logged = True
        wb.log(metrics, step)

    metrics_file = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed below

    def write_metrics(step: int, metrics: dict) -> None:
        on_metrics(step, metrics)
        metrics_file.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")

    coordinator.on_metrics = write_metrics
    exit_code = 1
    try:
        result = coordinator.run()
        exit_code = result.exit_code
    except KeyboardInterrupt:
        log.error("interrupted twice: stopping workers now")
        result = None
    finally:
        progress.close()
        supervisor.stop_all()
        sock.close()
        wb.finish(exit_code)
        metrics_file.close()
    if result is None:
        return 130
    problems = coordinator.ledger.check(plan, start_step, result.steps_done)
    if problems:
        log.error("ledger: %d problem(s): %s", len(problems), "; ".join(problems[:10]))
        exit_code = exit_code or 1
    if exit_code == 0 and coordinator.stop_signal is not None:
        exit_code = 128 + coordinator.stop_signal  # stopped by a signal, after the final checkpoint
    elapsed = time.monotonic() - started
    first, final = result.first_eval or {}, result.final_eval or {}
    if first and final and final["step"] != first["step"]:
        evals = (f"held-out τ {first['eval/tau']:.3f} (step {first['step']}) -> {final['eval/tau']:.3f} "
                 f"(step {final['step']}), loss {first['eval/loss']:.3f} -> {final['eval/loss']:.3f}")
    elif first:
        evals = f"held-out τ {first['eval/tau']:.3f} at step {first['step']} (no later evaluation)"
    else:
        evals = "no held-out evaluation"
    log.info("run %s: %d/%d steps in %s; %s; checkpoints in %s; metrics in %s; exit %d", cfg.name,
             result.steps_done, plan.total_steps, format_duration(elapsed), evals, run_dir / "checkpoints",
             run_dir / "metrics.jsonl", exit_code)
    if result.steps_done < plan.total_steps:
        log.warning("stopped early at step %d: resume with --resume", result.steps_done)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
