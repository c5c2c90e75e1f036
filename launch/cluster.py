"""``python -m launch.cluster --config configs/X.yaml [section.key=value ...]``

Starts the coordinator (in this process) and one OS process per worker: target ranks on their
GPUs, drafter ranks on theirs (on CPU, one process per entry of ``cluster.targets`` /
``cluster.drafters``). Supervises them, forwards their logs with the worker's name, writes
metrics (console line with ETA, wandb) and exits non-zero when the run fails.

Order of events: validate the config (before any model loads) → with ``--resume``, check that
the newest checkpoint's drafter has the shape this config builds → prepare and cache the data →
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

from dflash.checkpoint import (CheckpointError, CheckpointMismatch, check_fits, checkpoint_problem, latest_checkpoint,
                               read_state, run_identity)
from dflash.config import ConfigError, RunConfig, load_config
from dflash.factory import build_batch_plans, target_hf_config
from dflash.logs import setup_logging
from dflash.metrics import (ProgressLine, WandbRun, format_duration, last_logged_step, metrics_view,
                            rollback_record)
from dflash.resume import LEDGER_FILE, LedgerFile, append_line, ledger_view, plan_launch
from dflash.schedule import StepPlan
from dflash.workers.control import CoordinatorSocket
from dflash.workers.coordinator import Coordinator, build_work_items
from launch.supervisor import Supervisor, WorkerSpec

log = logging.getLogger("dflash.cluster")

EXIT_CONFIG = 2
#: ``status | head -1``: stdout's reader went away; what a shell reports for a process killed by SIGPIPE.
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


def load_tokenizer(target_cfg):
    """:func:`dflash.tokenizer.load_tokenizer`, imported when first needed (transformers takes
    ~0.7 s to import; control commands need none)."""
    from dflash.tokenizer import load_tokenizer as load

    return load(target_cfg)


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
        return latest_checkpoint(self.run_dir, verify=True)


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


def undo_later_steps(run_dir: Path, start_step: int, reason: str) -> None:
    """A launch at ``start_step``: mark the rows of later steps in ``ledger.jsonl`` and
    ``metrics.jsonl`` (written by a previous launch past its last checkpoint) as undone."""
    ledger = ledger_view(run_dir / LEDGER_FILE)
    last_step = max((r["step"] for r in metrics_view(run_dir / "metrics.jsonl")), default=-1)
    if max(ledger, default=-1) >= start_step:
        LedgerFile(run_dir).rollback(start_step, max(ledger) + 1, reason)
    if last_step > start_step:
        append_line(run_dir / "metrics.jsonl", rollback_record(start_step, last_step, reason))
    elif (run_dir / "metrics.jsonl").is_file():
        append_line(run_dir / "metrics.jsonl", {"launch": {"step": start_step, "reason": reason}, "time": time.time()})


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
    epilog = ("a running cluster (--run-dir runs/<name> or --config):\n"
              "  python -m launch.cluster status   --run-dir DIR [--json]   workers, pids, step, restarts\n"
              "  python -m launch.cluster restart  target.K|drafters --run-dir DIR\n"
              "  python -m launch.cluster attach   WORKER --run-dir DIR     run it here in the foreground\n"
              "  python -m launch.cluster stop     --run-dir DIR            final checkpoint, then exit\n"
              "regenerating the data with the target:\n"
              "  python -m launch.cluster --mode regenerate --config X.yaml --output OUT.jsonl [--help]")
    p = argparse.ArgumentParser(prog="python -m launch.cluster", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog)
    p.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true",
                       help="continue from the newest checkpoint of the run directory (starts fresh when there is "
                            "none); its drafter must have this config's shape")
    start.add_argument("--overwrite", action="store_true", help="discard an existing run directory's checkpoints")
    p.add_argument("--force", action="store_true",
                   help="with --resume: continue although the checkpoint was trained with another tokenizer, chat "
                        "template, thinking mode or target architecture name (shapes must still match)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    return p.parse_intermixed_args(argv)  # overrides may come before or after the options


def derived_values(cfg: RunConfig, plan: StepPlan, heldout_batches: int, warmup_steps: int) -> dict:
    """The values a run derives from its config (logged to wandb with it); ``warmup_steps`` is the
    launch's LR schedule's."""
    return {
        "batches_per_epoch": plan.batches_per_epoch[0],
        "optimizer_steps_per_drafter": plan.total_steps,
        "warmup_steps": warmup_steps,
        "heldout_batches": heldout_batches,
        "rows_per_batch": cfg.rows_per_batch,
        "num_targets": len(cfg.cluster.targets),
        "num_drafters": len(cfg.cluster.drafters),
    }


TARGET_SOURCE = "the target model: target.kind / path / arch / arch_overrides"
#: Fields of a drafter's ``config.json`` that ``--resume`` compares with what this run's config
#: builds (:func:`resume_mismatches`): each changes a parameter's shape or what the weights mean.
#: Value: the run-config key that sets it.
RESUME_FIELDS = {
    "num_hidden_layers": "drafter.num_layers",
    "block_size": "drafter.block_size",
    "layer_types": "drafter.layer_types",
    "sliding_window": "drafter.sliding_window",
    "intermediate_size": "drafter.intermediate_size",
    "target_layer_ids": "target.layer_ids",
    "mask_token_id": "drafter.mask_token_id",
    "hidden_size": TARGET_SOURCE,
    "num_attention_heads": TARGET_SOURCE,
    "num_key_value_heads": TARGET_SOURCE,
    "head_dim": TARGET_SOURCE,
    "vocab_size": TARGET_SOURCE,
    "num_target_layers": TARGET_SOURCE,
    "rope_theta": TARGET_SOURCE,
}
#: Keys of the run's saved ``config.yaml`` quoted when they differ (what the run was started with).
RESUME_CONFIG_KEYS = ("target.kind", "target.path", "target.arch", "target.arch_overrides", "target.tokenizer",
                      "target.layer_ids", "drafter.num_layers", "drafter.block_size", "drafter.mask_token_id",
                      "drafter.layer_types", "drafter.sliding_window", "drafter.intermediate_size")


def _cheap_target_config(cfg: RunConfig):
    """The target's HF config when reading it loads no weights and converts nothing, else ``None``
    (a GGUF target whose conversion is not cached)."""
    if cfg.target.kind == "gguf":
        from dflash import assets
        from dflash.target import _cache_complete, _gguf_cache_dir

        path = Path(cfg.target.path) if cfg.target.path is not None else assets.smollm2_gguf_path()
        if not path.is_file() or not _cache_complete(_gguf_cache_dir(path)):
            return None
    return target_hf_config(cfg)


def expected_drafter_fields(cfg: RunConfig, tokenizer_size: int) -> dict:
    """The :data:`RESUME_FIELDS` of the drafter this run would build (as ``dflash.factory.build_drafter``
    does), without loading any weights.

    The target's HF config is read as the factory reads it; a GGUF target that is not converted
    yet is described from its metadata instead (:func:`dflash.target.describe_target`), which
    leaves out the fields it cannot tell (heads, head_dim, RoPE, the default intermediate size).

    Raises:
        ConfigError: a bad ``target.layer_ids`` / ``target.arch`` for this target.
        OSError: a missing model file or directory.
    """
    from dflash.factory import drafter_config
    from dflash.model import resolve_mask_token_id
    from dflash.objective import FULL_ATTENTION, SLIDING_ATTENTION
    from dflash.target import describe_target

    d = cfg.drafter
    quiet = logging.getLogger("dflash.model")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its RoPE / mask warnings are the workers' to give
    try:
        tc = _cheap_target_config(cfg)
        if tc is not None:
            text = tc.get_text_config() if hasattr(tc, "get_text_config") else tc
            try:
                dcfg = drafter_config(cfg, tc, tokenizer_size, int(text.vocab_size))
            except ValueError as exc:
                raise ConfigError(f"drafter: {exc}") from None
            out = {name: getattr(dcfg, name) for name in RESUME_FIELDS}
        else:
            info = describe_target(cfg.target, d.num_layers)
            # Without the target's config its special token ids are unknown: the mask token is
            # compared only when it does not fall back to one of them.
            mask_id = (resolve_mask_token_id(d.mask_token_id, tokenizer_size, info.vocab_size)
                       if d.mask_token_id is not None or tokenizer_size < info.vocab_size else None)
            out = {"num_hidden_layers": d.num_layers, "block_size": d.block_size,
                   "layer_types": list(d.layer_types) if d.layer_types else [FULL_ATTENTION] * d.num_layers,
                   "sliding_window": d.sliding_window, "target_layer_ids": list(info.layer_ids),
                   "mask_token_id": mask_id, "hidden_size": info.hidden_size, "vocab_size": info.vocab_size,
                   "num_target_layers": info.num_layers}
            if d.intermediate_size is not None:
                out["intermediate_size"] = d.intermediate_size
            if mask_id is None:
                del out["mask_token_id"]
    finally:
        quiet.setLevel(level)
    out["_sliding"] = SLIDING_ATTENTION in out["layer_types"]
    return out


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and key in ("target", "drafter") and not prefix:
            out.update(_flat(value, f"{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def resume_mismatches(cfg: RunConfig, ckpt: Path, tokenizer_size: int) -> list[str]:
    """How the drafter in checkpoint ``ckpt`` differs from the one this run's config builds.

    Compares the checkpoint's ``drafter/config.json`` with :func:`expected_drafter_fields`, field
    by field (:data:`RESUME_FIELDS`; ``sliding_window`` only when a layer of either uses it).

    Returns:
        One ``field (key): checkpoint X, this run Y`` per differing field; empty when they match.
        An unreadable ``config.json`` is one entry saying so.

    Raises:
        ConfigError / OSError: from :func:`expected_drafter_fields`.
    """
    from dflash.model import DFlashDraftModel
    from dflash.objective import FULL_ATTENTION, SLIDING_ATTENTION

    directory = Path(ckpt) / "drafter"
    try:
        saved_cfg = DFlashDraftModel.load_config(directory)  # refuses a learned mask vector
    except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
        return [f"{directory / 'config.json'} cannot be read as a DFlash drafter config ({exc})"]
    saved = {name: getattr(saved_cfg, name) for name in RESUME_FIELDS if hasattr(saved_cfg, name)}
    expected = expected_drafter_fields(cfg, tokenizer_size)
    sliding = expected.pop("_sliding") or SLIDING_ATTENTION in (saved_cfg.layer_types or [FULL_ATTENTION])
    out = []
    for name, key in RESUME_FIELDS.items():
        if name not in expected or name not in saved or (name == "sliding_window" and not sliding):
            continue
        a, b = saved[name], expected[name]
        same = (abs(float(a) - float(b)) <= 1e-6 * max(1.0, abs(float(a)))) if name == "rope_theta" else a == b
        if not same:
            out.append(f"{name} (set by {_field_source(cfg, name, key)}): checkpoint {json.dumps(a)}, "
                       f"this run {json.dumps(b)}")
    return out


def _field_source(cfg: RunConfig, name: str, key: str) -> str:
    """What sets field ``name`` in this run: ``key``, or what a ``null`` there defaults to."""
    if name == "target_layer_ids" and cfg.target.layer_ids is None:
        return "target.layer_ids=null: the DFlash rule for drafter.num_layers and the target's depth"
    if name == "layer_types" and cfg.drafter.layer_types is None:
        return "drafter.layer_types=null: full attention in each of drafter.num_layers"
    if name == "intermediate_size" and cfg.drafter.intermediate_size is None:
        return "drafter.intermediate_size=null: the target's"
    if name == "mask_token_id" and cfg.drafter.mask_token_id is None:
        return ("drafter.mask_token_id=null: the target's first unused embedding row, else its unk / pad / eos / bos "
                "token")
    return key


def resume_mismatch_message(cfg: RunConfig, run_dir: Path, ckpt: Path, mismatches: list[str]) -> str:
    """The one-paragraph error for :func:`resume_mismatches`: the fields, what the run was started
    with (its saved ``config.yaml``, where it differs), and how to proceed."""
    text = (f"--resume: this run's drafter does not match the checkpoint it would continue "
            f"({ckpt / 'drafter' / 'config.json'}): {'; '.join(mismatches)}.")
    saved_file = run_dir / "config.yaml"
    try:
        saved = _flat(yaml.safe_load(saved_file.read_text()) or {})
    except (OSError, yaml.YAMLError, AttributeError):
        saved = {}
    now = _flat(cfg.to_dict())
    started_with = [f"{k}={json.dumps(saved[k])}" for k in RESUME_CONFIG_KEYS if k in saved and saved[k] != now.get(k)]
    if started_with:
        text += f" The run's {saved_file} was written with {', '.join(started_with)}."
    return (text + " To continue this run, drop or fix the override(s) so that these fields match; to start a "
            "new run in this directory instead, pass --overwrite (its checkpoints are deleted), or choose "
            "another run_dir / name.")


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
    if not run_dir.is_dir():
        raise RuntimeError(f"no running cluster: {run_dir} does not exist")
    if not info_file.is_file():
        ended = ended_run_summary(run_dir)
        if ended is not None:
            raise RuntimeError(f"no running cluster in {run_dir}: the run has ended; {ended}")
        raise RuntimeError(f"no running cluster in {run_dir} ({info_file.name} is missing)")
    info = json.loads(info_file.read_text())
    from dflash.transport.carriers import process_gone

    pid = info.get("launcher_pid")
    if isinstance(pid, int) and process_gone(pid):
        ended = ended_run_summary(run_dir)
        raise RuntimeError(f"no running cluster in {run_dir}: its launcher (pid {pid}) is gone "
                           f"({info_file.name} is stale; resume the run with --resume)"
                           + (f"; {ended}" if ended else ""))
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


def _last_metrics(path: Path, tail_bytes: int = 1 << 16) -> tuple[Optional[dict], Optional[dict]]:
    """The last record of ``metrics.jsonl`` and the last one with ``eval/tau`` (within its last
    ``tail_bytes``); ``(None, None)`` when there is none."""
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - tail_bytes))
            lines = handle.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None, None
    last = last_eval = None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or "step" not in record:
            continue
        last = last or record
        if "eval/tau" in record:
            last_eval = record
            break
    return last, last_eval


def ended_run_summary(run_dir: Path) -> Optional[str]:
    """What a run directory without a running cluster says about its run, or ``None`` when it
    holds no checkpoint and no metrics (no run has trained there).

    Names the newest checkpoint (step, whether that is ``train.max_steps`` of the run's saved
    ``config.yaml``, when it was written) and the last step and held-out τ of ``metrics.jsonl``.
    """
    run_dir = Path(run_dir)
    ckpt = latest_checkpoint(run_dir)
    last, last_eval = _last_metrics(run_dir / "metrics.jsonl")
    if ckpt is None and last is None:
        return None
    try:
        max_steps = ((yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("train") or {}).get("max_steps")
    except (OSError, yaml.YAMLError, AttributeError):
        max_steps = None
    parts = []
    complete = False
    if ckpt is not None:
        try:
            state = read_state(ckpt)
        except (OSError, ValueError):
            state = {}
        step = state.get("step")
        when = (time.strftime(" on %Y-%m-%d %H:%M:%S", time.localtime(state["time"]))
                if isinstance(state.get("time"), (int, float)) else "")
        complete = isinstance(max_steps, int) and isinstance(step, int) and step >= max_steps
        of = f" of {max_steps} (train.max_steps)" if isinstance(max_steps, int) else ""
        parts.append(f"its last checkpoint is {ckpt} (step {step}{of}, written{when})")
        try:
            problem = checkpoint_problem(ckpt)
        except OSError as exc:
            problem = f"unreadable: {exc}"
        if problem is not None:
            complete = False
            parts.append(f"that checkpoint is damaged ({problem}): --resume moves it aside and continues "
                         f"from the previous one")
    else:
        parts.append(f"it wrote no checkpoint (nothing under {run_dir / 'checkpoints'})")
    if last is not None:
        tau = (f", last held-out τ {last_eval['eval/tau']:.3f} at step {last_eval['step']}"
               if last_eval is not None and isinstance(last_eval.get("eval/tau"), (int, float)) else "")
        parts.append(f"metrics up to step {last['step']} are in {run_dir / 'metrics.jsonl'}{tau}")
    text = "; ".join(parts)
    if complete:
        return text + "; it is complete"
    if ckpt is not None:
        return text + "; continue it with --resume (python -m launch.cluster --config <its config> --resume)"
    return text


def worker_view(w: dict) -> dict:
    """One worker of the coordinator's status, made consistent, with a ``state``.

    The coordinator reports ``up`` / ``ready`` as last heard from the worker's process, and its
    pid from the supervisor: right after a kill (``restart target.N``, a crash before the exit is
    handled) ``pid`` is already ``None`` while ``up`` / ``ready`` still say ``True``. A worker the
    launcher runs is up only while it has a pid, and ready only when up.

    ``state``: ``restarting`` (no process: killed or crashed, to be started again), ``starting``
    (a process, no hello yet), ``loading`` (up, not ready), ``ready``; an ``attach``-ed worker is
    ``attached`` while its process is connected, else ``detached``.
    """
    external = bool(w.get("external"))
    up = bool(w.get("up")) and (external or w.get("pid") is not None)
    ready = bool(w.get("ready")) and up
    if external:
        state = "attached" if up else "detached"
    elif w.get("pid") is None:
        state = "restarting"
    else:
        state = "ready" if ready else "loading" if up else "starting"
    return {**w, "up": up, "ready": ready, "state": state}


def status_view(data: dict) -> dict:
    """The coordinator's status with every worker passed through :func:`worker_view`."""
    return {**data, "workers": {name: worker_view(w) for name, w in data.get("workers", {}).items()}}


def _print_status(data: dict) -> None:
    data = status_view(data)
    print(f"step {data['step']}/{data['total_steps']}  attempt {data['attempt']}  "
          f"batches in flight {data['batches_in_flight']}  unassigned {data['unassigned_batches']}")
    print(f"{'worker':<12}{'role':<9}{'pid':>8}  {'state':<12}{'up':<6}{'ready':<7}{'failures':<9}external")
    for name, w in data["workers"].items():
        pid = "-" if w["pid"] is None else str(w["pid"])
        print(f"{name:<12}{w['role']:<9}{pid:>8}  {w['state']:<12}{str(w['up']):<6}{str(w['ready']):<7}"
              f"{w['failures']:<9}{w['external']}")
    for r in data.get("restarts", []):
        print(f"restart: {r['worker']} back after {r['seconds']:.1f} s")


def _stdout_closed() -> int:
    """stdout's reader has gone (``status --json | head -1``): send the rest of this process's
    output, including the flush at exit, to /dev/null; return :data:`EXIT_BROKEN_PIPE`."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout file descriptor (captured): nothing to silence
        pass
    return EXIT_BROKEN_PIPE


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
    try:
        if args.json:
            print(json.dumps(status_view(reply["data"]), indent=1))
        else:
            if reply["text"] != "ok":
                print(reply["text"])
            _print_status(reply["data"])
        sys.stdout.flush()
    except BrokenPipeError:
        return _stdout_closed()
    if args.command != "attach":
        return 0
    # attach: run the worker here, in the foreground (pdb and prints work); the cluster waits for it
    run_dir = Path(run_dir).resolve()
    spec = json.loads((run_dir / "cluster.json").read_text())["workers"][args.worker]
    worker_args = list(spec["args"])
    if args.worker.startswith("drafter."):
        ckpt = latest_checkpoint(run_dir, verify=True)
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
        The exit code: 0 done, :data:`EXIT_CONFIG` (2) for a bad command line or config (also
        ``--resume`` with ``--overwrite``, a config whose drafter does not match the checkpoint
        ``--resume`` would continue, data that cannot be prepared), a locked or non-empty run
        directory; 1 a failed run; 128 + N stopped by signal N; 130 interrupted twice. A control
        command: 0 done, 1 no running cluster / refused, :data:`EXIT_BROKEN_PIPE` (141) when its
        stdout was closed early (``status | head -1``), quietly.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--mode=regenerate" in argv or ("--mode" in argv[:-1] and argv[argv.index("--mode") + 1] == "regenerate"):
        # the target rewrites the training responses (dflash/regenerate.py)
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
    try:
        ckpt = latest_checkpoint(run_dir, verify=args.resume)
    except (CheckpointError, PermissionError) as exc:
        log.error("--resume: %s", exc)
        return EXIT_CONFIG
    if ckpt is not None and args.resume:
        log.info("--resume: continuing from %s", ckpt)
    if ckpt is not None and not (args.resume or args.overwrite):
        log.error("%s already holds checkpoints (newest: %s): pass --resume to continue it or --overwrite to "
                  "start again, or choose another run_dir / name", run_dir, ckpt.name)
        return EXIT_CONFIG
    if args.overwrite and (run_dir / "checkpoints").exists():
        import shutil

        shutil.rmtree(run_dir / "checkpoints")
        ckpt = None
    if args.resume and ckpt is None:
        damaged = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*.damaged*"))
        if damaged:
            log.error("--resume: every checkpoint in %s is damaged (moved aside: %s; the reasons are in their "
                      "DAMAGED.txt); nothing to continue from: pass --overwrite to start again",
                      run_dir / "checkpoints", ", ".join(damaged))
            return EXIT_CONFIG
        log.info("--resume: no checkpoint in %s yet, starting fresh", run_dir)
    if cfg.regenerate.enabled:  # stage 1: the target regenerates data.dataset; training reads the output
        from dflash.regenerate import run_stage

        code, cfg = run_stage(cfg, args.config, args.overrides)
        if code:
            return code

    started = time.monotonic()
    try:  # still before any worker starts and any model loads
        tokenizer = load_tokenizer(cfg.target)
        if ckpt is not None:
            mismatches = resume_mismatches(cfg, ckpt, len(tokenizer))
            if mismatches:
                log.error("%s", resume_mismatch_message(cfg, run_dir, ckpt, mismatches))
                return EXIT_CONFIG
            check_fits(ckpt, run_identity(tokenizer, _cheap_target_config(cfg), None, cfg.data.enable_thinking),
                       force=args.force)
        plans = build_batch_plans(cfg, tokenizer)
    except CheckpointMismatch as exc:
        log.error("--resume: %s", exc)
        return EXIT_CONFIG
    except ConfigError as exc:
        log.error("config error: %s", exc)
        return EXIT_CONFIG
    except OSError as exc:  # an unreadable dataset or model file, a cache directory that is not writable
        log.error("preparing the data failed: %s", exc)
        return EXIT_CONFIG
    batches_per_epoch = [plans.train.num_batches(e) for e in range(cfg.train.epochs)]
    heldout_batches = plans.heldout.num_batches(0) if plans.heldout is not None else 0
    try:
        saved_cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) if ckpt is not None else None
    except (OSError, yaml.YAMLError):
        saved_cfg = None
    try:
        plan, launch_plan, notes = plan_launch(cfg, batches_per_epoch, read_state(ckpt) if ckpt is not None else None,
                                               saved_cfg if isinstance(saved_cfg, dict) else None)
    except ValueError as exc:
        log.error("--resume: %s: %s (train.epochs / data.* differ from the run's?)", ckpt, exc)
        return EXIT_CONFIG
    for note in notes:
        log.warning("%s", note)
    start_step = plan.start_step
    if start_step >= plan.total_steps:
        log.info("run %s is already complete (%d/%d steps); nothing to do", cfg.name, start_step, plan.total_steps)
        return 0
    derived = derived_values(cfg, plan, heldout_batches, launch_plan.schedule.warmup_steps)
    log.info("%d batches/epoch x %d epoch(s), %d drafter(s) -> %d optimizer steps%s; data ready in %.1f s",
             batches_per_epoch[0], cfg.train.epochs, len(cfg.cluster.drafters), plan.total_steps,
             f", resuming at step {start_step}" if start_step else "", time.monotonic() - started)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    launch_plan.write(run_dir)
    ledger = LedgerFile(run_dir)
    undo_later_steps(run_dir, start_step, f"launch at step {start_step}" + (f" (--resume from {ckpt.name})"
                                                                             if ckpt is not None else ""))

    item_args = {"heldout_batches": heldout_batches, "eval_every": cfg.train.eval_every,
                 "checkpoint_every": cfg.checkpoint.every, "eval_batches": cfg.train.eval_batches}
    items = build_work_items(plan, start_step, **item_args)
    sock = CoordinatorSocket(cfg.transport.host)
    progress = ProgressLine(plan.total_steps, start_step)
    control = LocalCluster(cfg, run_dir, sock.endpoint, Supervisor(run_dir, progress.write))
    early_signals: list[int] = []  # a stop while workers start, before the coordinator's handlers
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda sig, _frame: early_signals.append(sig))
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
    for signum in early_signals[:1]:
        coordinator.stop_signal = signum
        coordinator.request_stop(signal.Signals(signum).name)
    trainable_logged = False
    # wandb steps never go back: a resumed run continues the same wandb run after its last logged step
    last_logged = [max(start_step - 1, last_logged_step(run_dir / "metrics.jsonl"))]

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

    def on_rollback(to_step: int, from_step: int, reason: str) -> None:
        ledger.rollback(to_step, from_step, reason)
        metrics_file.write(json.dumps(rollback_record(to_step, from_step, reason)) + "\n")
        wb.log({"rollback/to_step": to_step, "rollback/from_step": from_step}, max(last_logged[0], 0))

    coordinator.on_metrics = write_metrics
    coordinator.on_rollback = on_rollback
    coordinator.on_trained = lambda item, attempt: ledger.trained(item.index, item.epoch, item.batches, attempt)
    exit_code = 1
    try:
        result = coordinator.run()
        exit_code = result.exit_code
    except KeyboardInterrupt:
        log.error("interrupted twice: stopping workers now")
        result = None
    finally:
        progress.close()
        control.supervisor.stop_all(terminate_now=coordinator.unready_workers(), between=coordinator.serve_controls)
        (run_dir / "cluster.json").unlink(missing_ok=True)
        sock.close()
        wb.finish(exit_code)
        metrics_file.close()
    log.info("%s", newest_checkpoint_line(run_dir, coordinator.steps_done))
    if result is None:
        return 130
    # a rollback below this launch's first step (its checkpoint moved aside) re-planned from there
    problems = coordinator.ledger.check(coordinator.plan, min(start_step, coordinator.lowest_step),
                                        result.steps_done)
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
