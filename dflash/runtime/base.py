"""What every worker process does before its own loop: arguments, config, logging, device,
threads, the coordinator link, parent-death signal and a heartbeat.

The heartbeat runs in a small thread with its own ZeroMQ socket: it touches no CUDA graph
state (only ``torch.cuda.memory_allocated``-style counters), so the one-process-one-main-thread
rule for graphs holds.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import zmq

from dflash.config import RunConfig, load_config, resolve_device
from dflash.logs import setup_logging
from dflash.transport.messages import new_incarnation
from dflash.runtime.control import WorkerLink, set_parent_death_signal
from dflash.runtime.messages import CODEC, Failed, Heartbeat, Hello

__all__ = ["WorkerContext", "WorkerStop", "start_worker", "run_worker", "memory_gib"]

log = logging.getLogger(__name__)


def memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory on ``device`` (GiB), or this process's resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError):
        return float("nan")


@dataclass
class WorkerContext:
    """Everything a worker's loop needs from its start-up."""

    cfg: RunConfig
    name: str
    role: str
    rank: int
    run_dir: Path
    device: torch.device
    link: WorkerLink
    #: this process's incarnation id (:func:`~dflash.transport.messages.new_incarnation`), the same on
    #: the control plane and the data plane
    incarnation: int
    resume_from: Optional[Path]
    stats: dict
    endpoint: Optional[str] = None
    #: the tokenised-data cache directory the launcher prepared (``--data-cache``); None: the
    #: worker prepares the data itself
    data_cache: Optional[Path] = None

    def stop_heartbeat(self) -> None:
        """Stop the heartbeat; from here on the worker is exiting and ignores SIGTERM."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self._hb_stop.set()  # type: ignore[attr-defined]


def _cpu_threads(cfg: RunConfig, role: str, rank: int) -> int:
    chosen = cfg.cluster.cpu_threads_per_target if role == "target" else cfg.cluster.cpu_threads_per_drafter
    if chosen:
        return chosen
    node = cfg.cluster.node_of(f"{role}.{rank}")
    workers = len(cfg.cluster.workers_on(node))  # the processes sharing this machine's cores
    return max(1, (os.cpu_count() or 1) // workers)


def _heartbeat(endpoint: str, name: str, period_s: float, stop: threading.Event, stats: dict, device: torch.device) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"{name}/heartbeat".encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    parent = os.getppid()
    while not stop.wait(period_s):
        if os.getppid() != parent:  # the launcher is gone (belt and braces with PDEATHSIG)
            log.error("launcher (pid %d) is gone: exiting", parent)
            os._exit(3)
        snapshot = {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}
        snapshot["mem_gib"] = memory_gib(device)
        try:
            sock.send(CODEC.encode(Heartbeat(stats=snapshot, name=name)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
    sock.close(linger=0)


def exit_on_sigterm(signum: int, _frame: object) -> None:
    """SIGTERM handler of worker processes: the first SIGTERM leaves through the normal exit path
    (``finally`` blocks run); later ones are ignored."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def start_worker(role: str, argv: Optional[list[str]] = None) -> WorkerContext:
    """Parse ``--run-dir --rank --control [--resume-from] [--endpoint] [--data-cache]``, set everything
    up, say hello.

    The config is ``<run_dir>/config.yaml`` (written by the launcher, already validated).
    """
    parser = argparse.ArgumentParser(prog=f"dflash.runtime.{role}")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--rank", required=True, type=int)
    parser.add_argument("--control", required=True, help="coordinator endpoint, tcp://host:port")
    parser.add_argument("--resume-from", type=Path, default=None)
    parser.add_argument("--endpoint", default=None, help="target: slot-ring endpoint to bind (stable across restarts)")
    parser.add_argument("--data-cache", type=Path, default=None,
                        help="the tokenised-data cache directory the launcher prepared (read, never written)")
    args = parser.parse_args(argv)
    name = f"{role}.{args.rank}"
    set_parent_death_signal(signal.SIGKILL)
    cfg = load_config(args.run_dir / "config.yaml")
    setup_logging(name, cfg.log.level)
    # Ctrl-C in the terminal reaches the whole process group: only the launcher decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, exit_on_sigterm)

    device_kind = resolve_device(cfg)
    if device_kind == "cuda":
        gpu = (cfg.cluster.targets if role == "target" else cfg.cluster.drafters)[args.rank]
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(_cpu_threads(cfg, role, args.rank))
    link = WorkerLink(args.control, name)
    inc = new_incarnation()
    link.send(Hello(role=role, rank=args.rank, pid=os.getpid(), incarnation=inc))
    stats: dict = {}
    stop = threading.Event()
    threading.Thread(target=_heartbeat, args=(args.control, name, cfg.transport.heartbeat_s, stop, stats, device),
                     daemon=True, name="heartbeat").start()
    log.info("%s starting on %s (pid %d, %d torch threads)", name, device, os.getpid(), torch.get_num_threads())
    ctx = WorkerContext(cfg=cfg, name=name, role=role, rank=args.rank, run_dir=args.run_dir, device=device,
                        link=link, incarnation=inc, resume_from=args.resume_from, stats=stats,
                        endpoint=args.endpoint, data_cache=args.data_cache)
    ctx._hb_stop = stop  # type: ignore[attr-defined]
    return ctx


class WorkerStop(Exception):
    """Raised inside a worker's loop when the coordinator says stop while it waits."""


def run_worker(role: str, build: Callable[[WorkerContext], Any], argv: Optional[list[str]] = None) -> int:
    """A worker process's whole life: start-up, ``build(ctx).run()``, failure report, clean-up.

    Any exception is logged with its traceback and reported to the coordinator (``failed``);
    the exit code is then 1. ``worker.close()`` and the heartbeat stop run in every case.
    """
    ctx = start_worker(role, argv)
    worker = None
    try:
        worker = build(ctx)
        worker.run()
        return 0
    except WorkerStop as stop:
        log.info("stop (%s) while waiting", stop)
        return 0
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - report any failure to the coordinator, then exit non-zero
        log.exception("%s worker failed", role)
        ctx.link.send(Failed(error=f"{type(exc).__name__}: {exc}"))
        return 1
    finally:
        if worker is not None:
            worker.close()
        ctx.stop_heartbeat()
