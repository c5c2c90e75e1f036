"""The control commands' side: ask a running cluster (``status | restart | stop | attach``), show
its status, and say what a run directory without a running cluster holds.

The request travels over the control plane (:mod:`dflash.runtime.control`) to the coordinator
named in ``<run_dir>/cluster.json``; the reply's ``data`` is the coordinator's status.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Optional

import yaml

from dflash import jsonl
from dflash.training.checkpoint_load import checkpoint_problem, latest_checkpoint, read_state
from dflash.utils import process_alive
from launch import EXIT_BROKEN_PIPE
from launch.local_cluster import CLUSTER_FILE

__all__ = ["CONTROL_TIMEOUT_S", "control_request", "ended_run_summary", "worker_view", "status_view",
           "print_status", "show_reply", "attach_here"]

log = logging.getLogger("dflash.cluster")

#: Seconds a control command waits for the coordinator's answer.
CONTROL_TIMEOUT_S = 15.0


def control_request(run_dir: Path, cmd: str, args: dict) -> dict:
    """Send one ``ctl`` message to the running cluster of ``run_dir``; return the ``ctl_reply``.

    Raises:
        RuntimeError: no running cluster (no run directory, no ``cluster.json``, its launcher is
            gone: said at once, with what the run directory holds), or no answer within
            :data:`CONTROL_TIMEOUT_S`.
    """
    from dflash.runtime.control import WorkerLink
    from dflash.runtime.messages import Command, CommandReply

    info_file = run_dir / CLUSTER_FILE
    if not run_dir.is_dir():
        raise RuntimeError(f"no running cluster: {run_dir} does not exist")
    if not info_file.is_file():
        ended = ended_run_summary(run_dir)
        if ended is not None:
            raise RuntimeError(f"no running cluster in {run_dir}: the run has ended; {ended}")
        raise RuntimeError(f"no running cluster in {run_dir} ({info_file.name} is missing)")
    info = json.loads(info_file.read_text())
    pid = info.get("launcher_pid")
    if isinstance(pid, int) and not process_alive(pid):
        ended = ended_run_summary(run_dir)
        raise RuntimeError(f"no running cluster in {run_dir}: its launcher (pid {pid}) is gone "
                           f"({info_file.name} is stale; resume the run with --resume)"
                           + (f"; {ended}" if ended else ""))
    link = WorkerLink(info["control"], f"ctl-{os.getpid()}")
    try:
        link.send(Command(cmd=cmd, args=args))
        deadline = time.monotonic() + CONTROL_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            msg = link.recv(left)
            if isinstance(msg, CommandReply):
                return msg
        raise RuntimeError(f"the cluster at {info['control']} (launcher pid {info['launcher_pid']}) did not answer "
                           f"within {CONTROL_TIMEOUT_S:.0f} s")
    finally:
        link.close()


def _last_metrics(path: Path, tail_bytes: int = 1 << 16) -> tuple[Optional[dict], Optional[dict]]:
    """The last record of ``metrics.jsonl`` and the last one with ``eval/tau`` (within its last
    ``tail_bytes``); ``(None, None)`` when there is none."""
    try:
        records = jsonl.read(path, max(0, path.stat().st_size - tail_bytes)).records
    except OSError:
        return None, None
    last = last_eval = None
    for record in reversed(records):
        if "step" not in record:
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
    ``config.yaml``, when it was written) and the last step and held-out τ of ``metrics.jsonl`` (over
    every anchor, ``eval/tau_head``: over those in the first ``train.eval_head_tokens`` of a response, and
    ``eval/tau_walk`` / ``eval/tau_walk_head``: walked as decoding walks, training's prediction of decoding τ).
    """
    run_dir = Path(run_dir)
    ckpt = latest_checkpoint(run_dir)
    last, last_eval = _last_metrics(run_dir / "metrics.jsonl")
    if ckpt is None and last is None:
        return None
    try:
        train = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("train") or {}
        max_steps, head_tokens = train.get("max_steps"), train.get("eval_head_tokens")
    except (OSError, yaml.YAMLError, AttributeError):
        max_steps = head_tokens = None
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
        head = last_eval.get("eval/tau_head") if last_eval is not None else None
        if tau and isinstance(head, (int, float)) and head == head:
            tokens = head_tokens if isinstance(head_tokens, int) else "train.eval_head_tokens"
            tau += f", {head:.3f} in the first {tokens} tokens of each response"
        walk, walk_head = ((last_eval.get("eval/tau_walk"), last_eval.get("eval/tau_walk_head"))
                           if last_eval is not None else (None, None))
        if tau and isinstance(walk, (int, float)) and walk == walk:
            tokens = head_tokens if isinstance(head_tokens, int) else "train.eval_head_tokens"
            head_text = (f" ({walk_head:.3f} in the first {tokens})"
                         if isinstance(walk_head, (int, float)) and walk_head == walk_head else "")
            tau += f", walked as decoding {walk:.3f}{head_text} (training's prediction of decoding τ)"
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
    (a process, no hello yet), ``loading`` (up, not ready), ``ready``, ``unreachable`` (a drafter
    up that no target could hand a batch to lately: ``undelivered_s``); an ``attach``-ed worker is
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
        state = ("ready" if ready else "unreachable" if up and w.get("undelivered_s") is not None
                 else "loading" if up else "starting")
    return {**w, "up": up, "ready": ready, "state": state}


def status_view(data: dict) -> dict:
    """The coordinator's status with every worker passed through :func:`worker_view`."""
    return {**data, "workers": {name: worker_view(w) for name, w in data.get("workers", {}).items()}}


def print_status(data: dict) -> None:
    """Print the coordinator's status (:func:`status_view`) as a table: step, then one row per worker."""
    data = status_view(data)
    print(f"step {data['step']}/{data['total_steps']}  attempt {data['attempt']}  "
          f"batches in flight {data['batches_in_flight']}  unassigned {data['unassigned_batches']}")
    for rank, node in sorted(data.get("nodes", {}).items(), key=lambda kv: int(kv[0])):
        print(f"node {rank}: {node['addr']}  launcher pid {node['pid']}  {node['state']}")
    print(f"{'worker':<12}{'node':>4}  {'role':<9}{'pid':>8}  {'state':<12}{'up':<6}{'ready':<7}{'failures':<9}external")
    for name, w in data["workers"].items():
        pid = "-" if w["pid"] is None else str(w["pid"])
        print(f"{name:<12}{w.get('node', 0):>4}  {w['role']:<9}{pid:>8}  {w['state']:<12}{str(w['up']):<6}"
              f"{str(w['ready']):<7}{w['failures']:<9}{w['external']}")
    for r in data.get("restarts", []):
        print(f"restart: {r['worker']} back after {r['seconds']:.1f} s")


def stdout_closed() -> int:
    """stdout's reader has gone (``status --json | head -1``): send the rest of this process's
    output, including the flush at exit, to /dev/null; return :data:`launch.EXIT_BROKEN_PIPE`."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout file descriptor (captured): nothing to silence
        pass
    return EXIT_BROKEN_PIPE


def show_reply(reply: dict, as_json: bool) -> int:
    """Print a ``ctl_reply``: its text (unless ``ok``) and the status table, or the status as JSON.

    Returns:
        0, or :data:`launch.EXIT_BROKEN_PIPE` when stdout was closed early (quietly).
    """
    try:
        if as_json:
            print(json.dumps(status_view(reply["data"]), indent=1))
        else:
            if reply["text"] != "ok":
                print(reply["text"])
            print_status(reply["data"])
        sys.stdout.flush()
    except BrokenPipeError:
        return stdout_closed()
    return 0


def attach_here(run_dir: Path, worker: str) -> None:
    """Replace this process with worker ``worker`` of ``run_dir``'s cluster, in the foreground
    (pdb and prints work); a drafter loads the newest checkpoint. The coordinator, told
    ``detach`` before, waits for it. Does not return.

    Raises:
        KeyError: ``cluster.json`` names no such worker.
    """
    spec = json.loads((run_dir / CLUSTER_FILE).read_text())["workers"][worker]
    worker_args = list(spec["args"])
    if worker.startswith("drafter."):
        ckpt = latest_checkpoint(run_dir, verify=True)
        if ckpt is not None:
            worker_args += ["--resume-from", str(ckpt)]
    env = {**os.environ, **spec["env"], "DFLASH_WORKER": worker, "PYTHONUNBUFFERED": "1"}
    log.info("attaching %s in the foreground: python -m %s %s", worker, spec["module"], " ".join(worker_args))
    os.execvpe(sys.executable, [sys.executable, "-m", spec["module"], *worker_args], env)
