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
import difflib
import json
import os
import signal
import logging
import socket
import sys
import time
from pathlib import Path
from typing import Optional

import yaml

from dflash.checkpoint import latest_checkpoint, read_state
from dflash.config import ConfigError, RunConfig, load_config
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


class LocalCluster:
    """The worker processes of this node: specs, stable slot-ring endpoints, (re)starts.

    Implements :class:`dflash.workers.coordinator.ClusterControl` for the coordinator.
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, control_endpoint: str, supervisor: Supervisor):
        self.cfg = cfg
        self.run_dir = run_dir
        self.supervisor = supervisor
        self.targets = [f"target.{r}" for r in range(len(cfg.cluster.targets))]
        self.drafters = [f"drafter.{r}" for r in range(len(cfg.cluster.drafters))]
        # fixed ports: a restarted target binds the same endpoint, so drafters reconnect by themselves
        self.endpoints = {t: f"tcp://{cfg.transport.host}:{_free_port(cfg.transport.host)}" for t in self.targets}
        self.control_endpoint = control_endpoint
        self.common = ["--run-dir", str(run_dir), "--control", control_endpoint]
        self.master_port = _free_port()
        self._reported: set[tuple[str, int]] = set()

    def spec(self, name: str, resume_from: Optional[Path] = None) -> WorkerSpec:
        role, rank = name.split(".")
        r = int(rank)
        if role == "target":
            return WorkerSpec(name, role, r, "dflash.workers.target",
                              ["--rank", rank, *self.common, "--endpoint", self.endpoints[name]])
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.master_port), "RANK": rank,
               "WORLD_SIZE": str(len(self.drafters)), "LOCAL_RANK": rank}
        resume = ["--resume-from", str(resume_from)] if resume_from is not None else []
        return WorkerSpec(name, role, r, "dflash.workers.drafter", ["--rank", rank, *self.common, *resume], env=env)

    def start_all(self, resume_from: Optional[Path]) -> None:
        for name in self.targets:
            self.supervisor.start(self.spec(name))
        for name in self.drafters:
            self.supervisor.start(self.spec(name, resume_from))

    # ClusterControl
    def restart(self, name: str, resume_from: Optional[Path]) -> None:
        proc = self.supervisor.workers.get(name)
        if proc is not None and proc.alive():
            proc.signal(signal.SIGKILL)
            proc.wait(10.0)
        self.supervisor.start(self.spec(name, resume_from))

    def kill(self, name: str) -> None:
        proc = self.supervisor.workers.get(name)
        if proc is not None and proc.alive():
            proc.signal(signal.SIGKILL)
            proc.wait(10.0)

    def exited(self) -> list[str]:
        out = []
        for proc in self.supervisor.dead():
            key = (proc.name, proc.starts)
            if key not in self._reported:
                self._reported.add(key)
                out.append(proc.name)
        return out

    def pid(self, name: str) -> Optional[int]:
        proc = self.supervisor.workers.get(name)
        return proc.pid if proc is not None and proc.alive() else None

    def report(self, name: str) -> str:
        return self.supervisor.report(self.supervisor.workers[name])

    def new_drafter_group(self) -> None:
        self.master_port = _free_port()
        write_cluster_file(self.run_dir, self.control_endpoint, self)

    def latest_checkpoint(self) -> Optional[Path]:
        return latest_checkpoint(self.run_dir)


def write_cluster_file(run_dir: Path, endpoint: str, cluster: LocalCluster) -> None:
    """``<run_dir>/cluster.json``: how ``status / restart / stop / attach`` reach this cluster."""
    workers = {}
    for name in cluster.targets + cluster.drafters:
        spec = cluster.spec(name)
        workers[name] = {"module": spec.module, "args": spec.args, "env": spec.env}
    data = {"control": endpoint, "launcher_pid": os.getpid(), "workers": workers}
    tmp = run_dir / "cluster.json.tmp"
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, run_dir / "cluster.json")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launch.cluster", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint of the run directory (starts fresh when there is none)")
    p.add_argument("--overwrite", action="store_true", help="discard an existing run directory's checkpoints")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    return p.parse_intermixed_args(argv)  # overrides may come before or after the options


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


CONTROL_COMMANDS = ("status", "restart", "stop", "attach")
CONTROL_TIMEOUT_S = 15.0
#: Options of the training and control parsers that take a value (the next argument is not a command).
VALUE_OPTIONS = ("--config", "--run-dir", "--mode")
#: Flags a bare word may have been meant as (``resume`` → ``--resume``).
FLAG_OPTIONS = ("--resume", "--overwrite", "--json")
USAGE = ("python -m launch.cluster --config configs/X.yaml [section.key=value ...] [--resume | --overwrite], "
         "or python -m launch.cluster {status | restart WORKER | stop | attach WORKER} --run-dir runs/NAME")


def first_word(argv: list[str]) -> Optional[str]:
    """The first argument of ``argv`` that is neither an option nor an option's value, or None.

    The options of :data:`VALUE_OPTIONS` (``--config X``, ``--run-dir D``) consume their value;
    everything after ``--`` is ignored.
    """
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--":
            return None
        if arg.startswith("-"):
            skip = arg in VALUE_OPTIONS
            continue
        return arg
    return None


def unknown_command(word: str) -> str:
    """The error for a first word that is not a control command nor a ``section.key=value`` override.

    Returns:
        A message naming ``word`` and the closest control command (:func:`difflib.get_close_matches`),
        or the flag / ``--config`` it was likely meant as, and the usage.
    """
    close = difflib.get_close_matches(word.lower(), CONTROL_COMMANDS, n=1)
    if close:
        hint = f"did you mean '{close[0]}'?"
    elif f"--{word.lower()}" in FLAG_OPTIONS:
        hint = f"did you mean '--{word.lower()}'?"
    elif word.endswith((".yaml", ".yml")):
        hint = f"did you mean '--config {word}'?"
    else:
        hint = f"control commands are {', '.join(CONTROL_COMMANDS)}; overrides look like section.key=value"
    return f"unknown command {word!r}: {hint}\nusage: {USAGE}"


def _lock_run_dir(run_dir: Path):
    """An exclusive lock on ``<run_dir>/launcher.lock`` (the open file), or ``None`` after logging
    which launcher holds it: two launchers must not share checkpoints, logs and the control socket."""
    import fcntl

    handle = open(run_dir / "launcher.lock", "a+")  # noqa: SIM115 - kept open for the whole run
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        log.error("another launcher (pid %s) is running on %s: stop it first (python -m launch.cluster stop "
                  "--run-dir %s) or choose another run_dir / name", holder, run_dir, run_dir)
        return None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def _control_request(run_dir: Path, cmd: str, args: dict) -> dict:
    """Send one ``ctl`` message to the running cluster of ``run_dir``; return the reply.

    Raises:
        RuntimeError: no running cluster, or no answer within ``CONTROL_TIMEOUT_S``.
    """
    import zmq

    from dflash.workers.control import ControlError, decode, encode

    info_file = run_dir / "cluster.json"
    if not info_file.is_file():
        raise RuntimeError(f"no running cluster in {run_dir} ({info_file.name} is missing)")
    info = json.loads(info_file.read_text())
    from dflash.transport.carriers import process_gone

    pid = info.get("launcher_pid")
    if isinstance(pid, int) and process_gone(pid):
        raise RuntimeError(f"no running cluster in {run_dir}: its launcher (pid {pid}) is gone "
                           f"({info_file.name} is stale; resume the run with --resume)")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"ctl-{os.getpid()}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(info["control"])
    try:
        sock.send(encode("ctl", cmd=cmd, args=args))
        deadline = time.monotonic() + CONTROL_TIMEOUT_S
        while time.monotonic() < deadline:
            if sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                try:
                    msg = decode(sock.recv())
                except ControlError:
                    continue
                if msg["type"] == "ctl_reply":
                    return msg
        raise RuntimeError(f"the cluster at {info['control']} (launcher pid {info['launcher_pid']}) did not answer "
                           f"within {CONTROL_TIMEOUT_S:.0f} s")
    finally:
        sock.close(linger=0)


def _print_status(data: dict) -> None:
    print(f"step {data['step']}/{data['total_steps']}  attempt {data['attempt']}  "
          f"batches in flight {data['batches_in_flight']}  unassigned {data['unassigned_batches']}")
    print(f"{'worker':<12}{'role':<9}{'pid':>8}  {'up':<6}{'ready':<7}{'failures':<9}external")
    for name, w in data["workers"].items():
        print(f"{name:<12}{w['role']:<9}{str(w['pid']):>8}  {str(w['up']):<6}{str(w['ready']):<7}"
              f"{w['failures']:<9}{w['external']}")
    for r in data.get("restarts", []):
        print(f"restart: {r['worker']} back after {r['seconds']:.1f} s")


def control_main(argv: list[str]) -> int:
    """``status | restart WORKER | stop | attach WORKER`` against a running cluster."""
    p = argparse.ArgumentParser(prog="python -m launch.cluster", description="control a running cluster")
    p.add_argument("command", choices=CONTROL_COMMANDS)
    p.add_argument("worker", nargs="?", help="target.N, drafter.N or drafters (restart); target.N / drafter.N (attach)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--run-dir", type=Path)
    where.add_argument("--config", help="the run's config (its run directory is used)")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.add_argument("overrides", nargs="*", default=[])
    args = p.parse_intermixed_args(argv)
    if args.worker and "=" in args.worker:  # `status run_dir=... --config X`: an override, not a worker
        args.overrides.insert(0, args.worker)
        args.worker = None
    setup_logging("ctl")
    if args.command in ("restart", "attach") and not args.worker:
        p.error(f"{args.command} needs a worker name")
    try:
        run_dir = args.run_dir or load_config(args.config, args.overrides, gpu_count=0).resolved_run_dir()
        cmd = "detach" if args.command == "attach" else args.command
        reply = _control_request(Path(run_dir).resolve(), cmd, {"worker": args.worker} if args.worker else {})
    except (RuntimeError, ConfigError) as exc:
        log.error("%s", exc)
        return 1
    if not reply["ok"]:
        log.error("%s", reply["text"])
        return 1
    if args.json:
        print(json.dumps(reply["data"], indent=1))
    else:
        if reply["text"] != "ok":
            print(reply["text"])
        _print_status(reply["data"])
    if args.command != "attach":
        return 0
    # attach: run the worker here, in the foreground (pdb and prints work); the cluster waits for it
    run_dir = Path(run_dir).resolve()
    spec = json.loads((run_dir / "cluster.json").read_text())["workers"][args.worker]
    worker_args = list(spec["args"])
    if args.worker.startswith("drafter."):
        ckpt = latest_checkpoint(run_dir)
        if ckpt is not None:
            worker_args += ["--resume-from", str(ckpt)]
    env = {**os.environ, **spec["env"], "DFLASH_WORKER": args.worker, "PYTHONUNBUFFERED": "1"}
    log.info("attaching %s in the foreground: python -m %s %s", args.worker, spec["module"], " ".join(worker_args))
    os.execvpe(sys.executable, [sys.executable, "-m", spec["module"], *worker_args], env)
    return 0  # not reached


def main(argv: Optional[list[str]] = None) -> int:
    """The CLI: ``--mode regenerate``, a control command (:func:`control_main`) or a training run.

    A first word (see :func:`first_word`) that is neither a control command nor a
    ``section.key=value`` override is refused at once with :func:`unknown_command`'s message.

    Returns:
        The exit code: 0 done, :data:`EXIT_CONFIG` (2) for a bad command line or config, a locked or
        non-empty run directory; 1 a failed run; 128 + N stopped by signal N; 130 interrupted twice.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--mode=regenerate" in argv or ("--mode" in argv[:-1] and argv[argv.index("--mode") + 1] == "regenerate"):
        # issue 10: the target rewrites the training responses (dflash/regenerate.py)
        from dflash.regenerate import main as regenerate_main

        rest = [a for a in argv if a != "--mode=regenerate"]
        if "--mode" in rest:
            del rest[rest.index("--mode"):rest.index("--mode") + 2]
        return regenerate_main(rest)
    word = first_word(argv)
    if word in CONTROL_COMMANDS:  # `status --run-dir D`, also `--run-dir D status`
        return control_main(argv)
    if word is not None and "=" not in word:  # a mistyped command: stop before any config or worker
        setup_logging("cluster")
        log.error("%s", unknown_command(word))
        return EXIT_CONFIG
    args = parse_args(argv)
    setup_logging("cluster")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        log.error("config error: %s", exc)
        return EXIT_CONFIG
    setup_logging("cluster", cfg.log.level)
    run_dir = cfg.resolved_run_dir().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = _lock_run_dir(run_dir)  # held (open) until this process exits
    if lock is None:
        return EXIT_CONFIG
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

    item_args = {"heldout_batches": heldout_batches, "eval_every": cfg.train.eval_every,
                 "checkpoint_every": cfg.checkpoint.every, "eval_batches": cfg.train.eval_batches}
    items = build_work_items(plan, start_step, **item_args)
    sock = CoordinatorSocket(cfg.transport.host)
    progress = ProgressLine(plan.total_steps, start_step, every=cfg.log.every * 10)
    control = LocalCluster(cfg, run_dir, sock.endpoint, Supervisor(run_dir, progress.write))
    control.start_all(ckpt)
    write_cluster_file(run_dir, sock.endpoint, control)
    wandb_id_file = run_dir / "wandb_id"
    resume_id = wandb_id_file.read_text().strip() if (ckpt is not None and wandb_id_file.is_file()) else None
    wb = WandbRun(cfg.log.wandb, cfg.log.project, cfg.name, run_dir, {**cfg.to_dict(), **derived}, resume_id)
    if wb.id:
        wandb_id_file.write_text(wb.id)

    coordinator = Coordinator(sock, control.targets, control.drafters, control.endpoints, plan, start_step, items,
                              {**item_args, "first_step": start_step}, cfg.transport.slots, control,
                              on_metrics=lambda step, m: wb.log(m, step), on_progress=progress.update,
                              peer_timeout_s=cfg.transport.peer_timeout_s, max_restarts=cfg.cluster.max_restarts,
                              restart_backoff_s=cfg.cluster.restart_backoff_s)
    coordinator.install_signal_handlers()
    trainable_logged = False
    last_logged = [start_step - 1]

    def on_metrics(step: int, metrics: dict) -> None:
        nonlocal trainable_logged
        params_m = coordinator.ready_info.get("drafter.0", {}).get("trainable_params_M")
        if not trainable_logged and wb.run is not None and params_m is not None:
            wb.run.config.update({"trainable_params_M": params_m}, allow_val_change=True)
            trainable_logged = True
        if step > last_logged[0] or "eval/tau" in metrics:  # wandb steps never go back (after a rollback)
            wb.log(metrics, max(step, last_logged[0]))
            last_logged[0] = max(step, last_logged[0])

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
        control.supervisor.stop_all()
        (run_dir / "cluster.json").unlink(missing_ok=True)
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
