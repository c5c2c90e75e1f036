"""``python -m launch.cluster train``: one training run, from the config to the final checkpoint.

Starts the coordinator (in this process) and one OS process per worker: target ranks on their
GPUs, drafter ranks on theirs (on CPU, one process per entry of ``cluster.targets`` /
``cluster.drafters``). Supervises them, forwards their logs with the worker's name, writes
metrics (console line with ETA, wandb) and exits non-zero when the run fails.

Order of events (:func:`run`): validate the config (before any model loads) → lock the run
directory → pick the checkpoint to continue (``--resume``) → check that it fits this config
(:func:`dflash.training.resume_check.check_resume`) → prepare and cache the data → start workers → every
target READY (model loaded, forward compiled and warmed up, ring slots exported) → drafters
connect → every drafter READY (graphs captured) → batches flow → final checkpoint → workers
stopped.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import filelock
import yaml
import zmq

from dflash.training.checkpoint_identity import CheckpointMismatch
from dflash.training.checkpoint_load import CheckpointError, latest_checkpoint, read_state
from dflash.config import ConfigError, RunConfig, load_config
from dflash.training.factory import build_batch_plans
from dflash.models.target_loader import describe_target
from dflash.logs import setup_logging
from dflash.metrics import ProgressLine, format_duration
from dflash.training.resume import LaunchPlan, plan_launch
from dflash.training.resume_check import check_resume
from dflash.data.schedule import StepPlan
from dflash.utils import LockTimeout, atomic_write_text, file_lock
from dflash.runtime.control import CoordinatorSocket
from dflash.runtime.coordinator import Coordinator, CoordinatorConfig, CoordinatorSetup, build_work_items
from dflash.runtime.supervisor import Supervisor
from launch import EXIT_CONFIG
from launch.local_cluster import CLUSTER_FILE, LocalCluster
from launch.nodes import NodeCluster, NodeLost, Rendezvous
from launch.recorder import METRICS_FILE, RunRecorder, start_wandb, undo_later_steps

__all__ = ["run", "lock_run_dir", "select_checkpoint", "prepare_launch", "LaunchRefused"]

log = logging.getLogger("dflash.cluster")

LOCK_FILE = "launcher.lock"
#: The pid of the launcher holding :data:`LOCK_FILE` (the lock itself is the operating system's).
PID_FILE = "launcher.pid"
#: Exit code after a second Ctrl-C (the workers are stopped at once).
EXIT_INTERRUPTED = 130


class LaunchRefused(Exception):
    """A launch that stops before any worker starts; the message is the one error line to log."""


def load_tokenizer(target_cfg):
    """:func:`dflash.data.tokenizer.load_tokenizer`, imported when first needed (transformers takes
    ~0.7 s to import)."""
    from dflash.data.tokenizer import load_tokenizer as load

    return load(target_cfg)


@dataclass
class Prepared:
    """What a launch decided before any worker starts: its steps, schedule and data sizes."""

    plan: StepPlan
    launch: LaunchPlan
    batches_per_epoch: list[int]
    heldout_batches: int
    #: the tokenised-data cache directory, handed to every worker
    data_cache: Optional[Path] = None


def run(args: argparse.Namespace) -> int:
    """Train: ``args`` has ``config``, ``overrides``, ``resume``, ``overwrite``, ``force``.

    Returns:
        The exit code: 0 done, :data:`launch.EXIT_CONFIG` (2) for a bad config, a checkpoint this
        config cannot continue, data that cannot be prepared, a locked or non-empty run directory;
        1 a failed run; 128 + N stopped by signal N; 130 interrupted twice.
    """
    setup_logging("cluster")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        log.error("config error: %s", exc)
        return EXIT_CONFIG
    setup_logging("cluster", cfg.log.level)
    try:
        rdzv = Rendezvous.from_args(args)
        rdzv.check(cfg)
    except (ValueError, OSError) as exc:
        log.error("rendezvous: %s", exc)
        return EXIT_CONFIG
    run_dir = cfg.resolved_run_dir().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if rdzv.node_rank > 0:  # node 0 holds the run directory's lock, data and coordinator
        from launch.node_agent import run_node

        setup_logging(f"node.{rdzv.node_rank}", cfg.log.level)
        return run_node(cfg, run_dir, rdzv)
    args.rendezvous = rdzv
    lock = lock_run_dir(run_dir)
    if lock is None:
        return EXIT_CONFIG
    try:
        return _launch(cfg, run_dir, args)
    finally:
        lock.release()


def _launch(cfg: RunConfig, run_dir: Path, args: argparse.Namespace) -> int:
    """:func:`run` in the locked run directory."""
    try:
        ckpt = select_checkpoint(run_dir, args.resume, args.overwrite)
    except LaunchRefused as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    if cfg.regenerate.enabled:  # stage 1: the target regenerates data.dataset; training reads the output
        from dflash.inference.regenerate import run_stage

        code, cfg = run_stage(cfg, args.config, args.overrides)
        if code:
            return code
    try:
        started = time.monotonic()
        prepared = prepare_launch(cfg, run_dir, ckpt, args.force)
    except LaunchRefused as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    if args.overwrite and (run_dir / "checkpoints").exists():
        shutil.rmtree(run_dir / "checkpoints")
        log.info("--overwrite: deleted the checkpoints of %s", run_dir)
    plan = prepared.plan
    if plan.start_step >= plan.total_steps:
        log.info("run %s is already complete (%d/%d steps); nothing to do", cfg.name, plan.start_step,
                 plan.total_steps)
        return 0
    log.info("%d batches/epoch x %d epoch(s), %d drafter(s) -> %d optimizer steps%s; data ready in %.1f s",
             prepared.batches_per_epoch[0], cfg.train.epochs, len(cfg.cluster.drafters), plan.total_steps,
             f", resuming at step {plan.start_step}" if plan.start_step else "", time.monotonic() - started)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    prepared.launch.write(run_dir)
    undo_later_steps(run_dir, plan.start_step, f"launch at step {plan.start_step}"
                     + (f" (--resume from {ckpt.name})" if ckpt is not None else ""))
    return run_workers(cfg, run_dir, ckpt, prepared, started, getattr(args, "rendezvous", Rendezvous()))


def lock_run_dir(run_dir: Path) -> Optional[filelock.FileLock]:
    """An exclusive lock on ``<run_dir>/launcher.lock`` (a ``filelock.FileLock``, held until
    released or this process exits) with this process's pid in ``launcher.pid``; ``None`` after
    logging which launcher holds it: two launchers must not share checkpoints, logs and the
    control socket."""
    lock = file_lock(run_dir / LOCK_FILE)
    try:
        lock.acquire(timeout=0)
    except LockTimeout:
        try:
            holder = (run_dir / PID_FILE).read_text().strip() or "?"
        except OSError:
            holder = "?"
        log.error("another launcher (pid %s) is running on %s: stop it first (python -m launch.cluster stop "
                  "--run-dir %s) or choose another run_dir / name", holder, run_dir, run_dir)
        return None
    atomic_write_text(run_dir / PID_FILE, f"{os.getpid()}\n")
    return lock


def select_checkpoint(run_dir: Path, resume: bool, overwrite: bool) -> Optional[Path]:
    """The checkpoint this launch continues: the newest complete one with ``resume`` (damaged
    ones are moved aside), none with ``overwrite`` (the caller deletes the checkpoints once every
    check has passed: a refused launch loses nothing) or a fresh run.

    Raises:
        LaunchRefused: checkpoints exist and neither flag says what to do with them; every
            checkpoint is damaged; a damaged one cannot be moved aside.
    """
    try:
        ckpt = latest_checkpoint(run_dir, verify=resume)
    except (CheckpointError, PermissionError) as exc:
        raise LaunchRefused(f"--resume: {exc}") from None
    if ckpt is not None and resume:
        log.info("--resume: continuing from %s", ckpt)
    if ckpt is not None and not (resume or overwrite):
        raise LaunchRefused(f"{run_dir} already holds checkpoints (newest: {ckpt.name}): pass --resume to continue it "
                            f"or --overwrite to start again, or choose another run_dir / name")
    if overwrite:
        ckpt = None  # deleted by _launch once the config, tokenizer and data have passed their checks
    if resume and ckpt is None:
        damaged = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*.damaged*"))
        if damaged:
            raise LaunchRefused(f"--resume: every checkpoint in {run_dir / 'checkpoints'} is damaged (moved aside: "
                                f"{', '.join(damaged)}; the reasons are in their DAMAGED.txt); nothing to continue "
                                f"from: pass --overwrite to start again")
        log.info("--resume: no checkpoint in %s yet, starting fresh", run_dir)
    return ckpt


def prepare_launch(cfg: RunConfig, run_dir: Path, ckpt: Optional[Path], force: bool) -> Prepared:
    """Check ``ckpt`` against ``cfg`` (:func:`dflash.training.resume_check.check_resume`), prepare the data
    (tokenised and cached) and plan the launch's steps and learning-rate schedule; loads no model.

    Raises:
        LaunchRefused: the checkpoint does not fit, a config error, unreadable data or model
            files, a checkpoint position past this config's data.
    """
    try:
        tokenizer = load_tokenizer(cfg.target)
        vocab = describe_target(cfg.target, cfg.drafter.num_layers).vocab_size
        if len(tokenizer) > vocab:  # before the data is tokenised with it
            raise ConfigError(f"target.tokenizer: its {len(tokenizer)} tokens do not fit the target's "
                              f"{vocab}-row embedding (a tokenizer of another model? for a random target, "
                              "target.arch_overrides.vocab_size sets the rows)")
        if ckpt is not None:
            check_resume(cfg, run_dir, ckpt, tokenizer, force=force)
        plans = build_batch_plans(cfg, tokenizer)
    except CheckpointMismatch as exc:
        raise LaunchRefused(f"--resume: {exc}") from None
    except ConfigError as exc:
        raise LaunchRefused(f"config error: {exc}") from None
    except OSError as exc:  # an unreadable dataset or model file, a cache directory that is not writable
        raise LaunchRefused(f"preparing the data failed: {exc}") from None
    batches_per_epoch = [plans.train.num_batches(e) for e in range(cfg.train.epochs)]
    heldout_batches = plans.heldout.num_batches(0) if plans.heldout is not None else 0
    try:
        saved_cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) if ckpt is not None else None
    except (OSError, yaml.YAMLError):
        saved_cfg = None
    try:
        plan, launch, notes = plan_launch(cfg, batches_per_epoch, read_state(ckpt) if ckpt is not None else None,
                                          saved_cfg if isinstance(saved_cfg, dict) else None)
    except ValueError as exc:
        raise LaunchRefused(f"--resume: {ckpt}: {exc} (train.epochs / data.* differ from the run's?)") from None
    for note in notes:
        log.warning("%s", note)
    return Prepared(plan, launch, batches_per_epoch, heldout_batches, plans.data.cache_path)


def derived_values(cfg: RunConfig, prepared: Prepared) -> dict:
    """The values a run derives from its config (logged to wandb with it)."""
    return {
        "batches_per_epoch": prepared.plan.batches_per_epoch[0],
        "optimizer_steps_per_drafter": prepared.plan.total_steps,
        "warmup_steps": prepared.launch.schedule.warmup_steps,
        "heldout_batches": prepared.heldout_batches,
        "rows_per_batch": cfg.rows_per_batch,
        "num_targets": len(cfg.cluster.targets),
        "num_drafters": len(cfg.cluster.drafters),
    }


def run_workers(cfg: RunConfig, run_dir: Path, ckpt: Optional[Path], prepared: Prepared, started: float,
                rdzv: Rendezvous = Rendezvous()) -> int:
    """Start the workers and the coordinator (node 0 of ``rdzv``; the other nodes' launchers
    first join it), run until done or stopped, stop the workers and report; returns the exit code
    (see :func:`run`)."""
    plan, start_step = prepared.plan, prepared.plan.start_step
    item_args = {"heldout_batches": prepared.heldout_batches, "eval_every": cfg.train.eval_every,
                 "checkpoint_every": cfg.checkpoint.every, "eval_batches": cfg.train.eval_batches}
    progress = ProgressLine(plan.total_steps, start_step)
    early_signals: list[int] = []  # a stop while workers start, before the coordinator's handlers
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda sig, _frame: early_signals.append(sig))
    if rdzv.nnodes > 1:  # the control socket on every interface at the master port; wait for every node
        try:
            sock = CoordinatorSocket("*", port=rdzv.master_port, advertise=rdzv.master_addr)
        except zmq.ZMQError as exc:
            log.error("cannot bind the coordinator at port %d (--master-port): %s", rdzv.master_port, exc)
            return 1
        control = NodeCluster(cfg, run_dir, sock, Supervisor(run_dir / "logs", progress.write), rdzv,
                              data_cache=prepared.data_cache)
        try:
            control.wait_for_nodes(cfg.cluster.node_join_timeout_s)
        except NodeLost as exc:
            log.error("%s", exc)
            control.stop_nodes("a node did not join", wait_s=5.0)
            sock.close()
            return 1
    else:
        sock = CoordinatorSocket(cfg.transport.host)
        control = LocalCluster(cfg, run_dir, sock.endpoint, Supervisor(run_dir / "logs", progress.write),
                               data_cache=prepared.data_cache)
    control.start_all(ckpt)
    control.write_info()
    recorder = RunRecorder(run_dir, start_wandb(cfg, run_dir, derived_values(cfg, prepared), ckpt is not None),
                           start_step, lambda: coordinator.ready_info.get("drafter.0", {}).get("trainable_params_M"))
    setup = CoordinatorSetup(
        control.targets, control.drafters, control.endpoints, plan, start_step,
        build_work_items(plan, start_step, **item_args), {**item_args, "first_step": start_step}, cfg.transport.slots,
        CoordinatorConfig(peer_timeout_s=cfg.transport.peer_timeout_s, max_restarts=cfg.cluster.max_restarts,
                          restart_backoff_s=cfg.cluster.restart_backoff_s))
    coordinator = Coordinator(sock, setup, control, on_metrics=recorder.metrics, on_progress=progress.update,
                              on_trained=recorder.trained, on_rollback=recorder.rollback)
    coordinator.install_signal_handlers()
    for signum in early_signals[:1]:
        coordinator.state.stop_signal = signum
        coordinator.request_stop(signal.Signals(signum).name)
    exit_code, result = 1, None
    try:
        result = coordinator.run()
        exit_code = result.exit_code
    except KeyboardInterrupt:
        log.error("interrupted twice: stopping workers now")
    finally:
        progress.close()
        control.supervisor.stop_all(terminate_now=coordinator.unready_workers(), between=coordinator.serve_controls)
        if isinstance(control, NodeCluster):
            control.stop_nodes(coordinator.state.stop_reason or ("done" if exit_code == 0 else "failed"))
        (run_dir / CLUSTER_FILE).unlink(missing_ok=True)
        sock.close()
        recorder.close(exit_code)
    log.info("%s", newest_checkpoint_line(run_dir, coordinator.state.steps_done))
    if result is None:
        return EXIT_INTERRUPTED
    return final_report(cfg, run_dir, plan, coordinator, result, exit_code, time.monotonic() - started)


def newest_checkpoint_line(run_dir: Path, steps_done: int) -> str:
    """Which checkpoint a run that has just ended leaves: the newest complete one on disk (checked
    as ``--resume`` checks it) against ``steps_done``, the steps the drafter group had done."""
    try:
        ckpt = latest_checkpoint(run_dir, verify=True)
    except (CheckpointError, PermissionError) as exc:
        return f"the newest checkpoint cannot be told: {exc}"
    if ckpt is None:
        return (f"no checkpoint on disk after {steps_done} step(s): nothing to resume from" if steps_done
                else "no checkpoint on disk")
    step = read_state(ckpt)["step"]
    if step >= steps_done:
        return f"final checkpoint: {ckpt} (step {step})"
    return (f"newest checkpoint: {ckpt} (step {step}); steps {step + 1}..{steps_done} are in no checkpoint: "
            f"--resume trains them again")


def _tau_text(ev: dict, key: str) -> str:
    """``ev[key]`` as ``1.234``, or ``n/a`` when absent (no such blocks)."""
    value = ev.get(key)
    return f"{value:.3f}" if isinstance(value, (int, float)) and value == value else "n/a"


def final_report(cfg: RunConfig, run_dir: Path, plan: StepPlan, coordinator: Coordinator, result, exit_code: int,
                 elapsed: float) -> int:
    """Check the ledger, log the run's summary (steps, held-out τ first → last, where the files
    are) and return the final exit code (128 + N after a stop by signal N)."""
    # a rollback below this launch's first step (its checkpoint moved aside) re-planned from there
    state = coordinator.state
    problems = state.ledger.check(state.plan, min(plan.start_step, state.lowest_step), result.steps_done)
    if problems:
        log.error("ledger: %d problem(s): %s", len(problems), "; ".join(problems[:10]))
        exit_code = exit_code or 1
    if exit_code == 0 and state.stop_signal is not None:
        exit_code = 128 + state.stop_signal  # stopped by a signal, after the final checkpoint
    first, final = result.first_eval or {}, result.final_eval or {}
    head = f"first {cfg.train.eval_head_tokens} response tokens"
    if first and final and final["step"] != first["step"]:
        walked = (f"; walked as decoding {_tau_text(first, 'eval/tau_walk')} -> {_tau_text(final, 'eval/tau_walk')}, "
                  f"{head} {_tau_text(first, 'eval/tau_walk_head')} -> {_tau_text(final, 'eval/tau_walk_head')}, "
                  f"of each conversation's first response {_tau_text(first, 'eval/tau_walk_first')} -> "
                  f"{_tau_text(final, 'eval/tau_walk_first')}"
                  if "eval/tau_walk" in final else "")
        evals = (f"held-out τ {first['eval/tau']:.3f} (step {first['step']}) -> {final['eval/tau']:.3f} "
                 f"(step {final['step']}), {head} {_tau_text(first, 'eval/tau_head')} -> "
                 f"{_tau_text(final, 'eval/tau_head')}{walked}, loss {first['eval/loss']:.3f} -> "
                 f"{final['eval/loss']:.3f}")
    elif first:
        walked = (f"; walked as decoding {_tau_text(first, 'eval/tau_walk')}, {head} "
                  f"{_tau_text(first, 'eval/tau_walk_head')}" if "eval/tau_walk" in first else "")
        evals = (f"held-out τ {first['eval/tau']:.3f} at step {first['step']} ({head} "
                 f"{_tau_text(first, 'eval/tau_head')}{walked}; no later evaluation)")
    else:
        evals = "no held-out evaluation"
    log.info("run %s: %d/%d steps in %s; %s; checkpoints in %s; metrics in %s; exit %d", cfg.name,
             result.steps_done, plan.total_steps, format_duration(elapsed), evals, run_dir / "checkpoints",
             run_dir / METRICS_FILE, exit_code)
    if result.steps_done < plan.total_steps:
        log.warning("stopped early at step %d: resume with --resume", result.steps_done)
    return exit_code
