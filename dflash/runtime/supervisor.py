"""Start, watch and stop worker processes; forward their output with the worker's name.

Each worker is a separate OS process (``python -m dflash.runtime.target|drafter`` for training,
``python -m dflash.inference.regenerate --worker-rank k`` for regeneration), in its own session.
Its stdout and stderr are read by one small thread each in the launcher (the launcher owns no CUDA
state, so threads are harmless here), prefixed with the worker's name when the line does not carry
it, written to its log file (``<log_dir>/<name>.log`` unless its :class:`WorkerSpec` names one) and
kept in a tail buffer for failure reports.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Collection, Optional

__all__ = ["WorkerSpec", "WorkerProcess", "Supervisor"]

log = logging.getLogger(__name__)

TAIL_LINES = 40
STOP_GRACE_S = 20.0
EXIT_WAIT_S = 15.0
#: Seconds a worker that is not ready gets between SIGTERM and SIGKILL when the run stops.
UNREADY_GRACE_S = 5.0
#: Longest single wait (s) while stopping workers, between calls of ``stop_all(between=...)``.
WAIT_SLICE_S = 0.1


@dataclass
class WorkerSpec:
    """How to start one worker."""

    name: str  # "target.0"
    role: str  # "target" | "drafter" | "regen"
    rank: int
    module: str  # "dflash.runtime.target"
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_path: Optional[Path] = None  # default: <log_dir>/<name>.log


class WorkerProcess:
    """One running (or finished) worker process with its output tail."""

    def __init__(self, spec: WorkerSpec, log_dir: Path, emit: Callable[[str], None]):
        self.spec = spec
        self.log_path = spec.log_path or log_dir / f"{spec.name}.log"
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.emit = emit
        self.popen: Optional[subprocess.Popen] = None
        self.starts = 0
        self._threads: list[threading.Thread] = []

    @property
    def name(self) -> str:
        return self.spec.name

    def start(self) -> None:
        env = dict(os.environ)
        env.update(self.spec.env)
        env["DFLASH_WORKER"] = self.spec.name
        env["PYTHONUNBUFFERED"] = "1"
        cmd = [sys.executable, "-m", self.spec.module, *self.spec.args]
        self.popen = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, errors="replace", bufsize=1,
            # its own session: a signal sent to the launcher's process group (Ctrl-C, `timeout`,
            # a batch scheduler's SIGTERM) reaches the launcher alone, which stops the run
            # gracefully; the workers still die with it (parent-death signal, heartbeat check)
            start_new_session=True,
        )
        self.starts += 1
        logfile = open(self.log_path, "a", buffering=1)  # noqa: SIM115 - closed by the reader threads
        lock = threading.Lock()
        remaining = [2]

        def pump(stream) -> None:
            tag = f"[{self.spec.name}]"
            for line in stream:
                line = line.rstrip("\n")
                with lock:
                    logfile.write(line + "\n")
                self.tail.append(line)
                self.emit(line if tag in line else f"{tag} {line}")
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    logfile.close()

        self._threads = [threading.Thread(target=pump, args=(s,), daemon=True, name=f"pump-{self.name}")
                         for s in (self.popen.stdout, self.popen.stderr)]
        for t in self._threads:
            t.start()
        log.info("started %s (pid %d): %s", self.name, self.popen.pid, " ".join(cmd[2:]))

    @property
    def pid(self) -> Optional[int]:
        return self.popen.pid if self.popen else None

    def returncode(self) -> Optional[int]:
        return None if self.popen is None else self.popen.poll()

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                self.popen.send_signal(sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> Optional[int]:
        if self.popen is None:
            return None
        try:
            rc = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        for t in self._threads:
            t.join(timeout=2.0)
        return rc


class Supervisor:
    """Owns all worker processes of a run.

    Args:
        log_dir: where worker logs go (created), unless a :class:`WorkerSpec` names its own file.
        emit: called with every output line of every worker, tagged with the worker's name.
    """

    def __init__(self, log_dir: Path, emit: Callable[[str], None]):
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.emit = emit
        self.workers: dict[str, WorkerProcess] = {}

    def start(self, spec: WorkerSpec) -> WorkerProcess:
        proc = self.workers.get(spec.name)
        if proc is None:
            proc = WorkerProcess(spec, self.log_dir, self.emit)
            self.workers[spec.name] = proc
        proc.spec = spec
        proc.start()
        return proc

    def dead(self) -> list[WorkerProcess]:
        """Workers that have exited (any return code)."""
        return [w for w in self.workers.values() if w.popen is not None and not w.alive()]

    def stop_all(self, exit_s: float = EXIT_WAIT_S, grace_s: float = STOP_GRACE_S,
                 terminate_now: Collection[str] = (), between: Optional[Callable[[], None]] = None) -> None:
        """Wait up to ``exit_s`` for workers told to stop to exit on their own, then SIGTERM the
        rest, wait up to ``grace_s``, then SIGKILL what is left.

        Args:
            terminate_now: workers still starting or restarting: they may not read a stop message
                for minutes (loading a model, joining a process group) and hold nothing to save;
                SIGTERM at once, SIGKILL after :data:`UNREADY_GRACE_S`.
            between: called between short waits (the launcher answers control commands).
        """
        early = [self.workers[n] for n in terminate_now if n in self.workers]
        for w in early:
            w.signal(signal.SIGTERM)
        self._wait(early, UNREADY_GRACE_S, between)
        for w in early:
            if w.alive():
                log.warning("%s (not ready) did not stop within %.0f s of SIGTERM: SIGKILL", w.name, UNREADY_GRACE_S)
                w.signal(signal.SIGKILL)
        self._wait(list(self.workers.values()), exit_s, between)
        for w in self.workers.values():
            w.signal(signal.SIGTERM)
        self._wait(list(self.workers.values()), grace_s, between)
        for w in self.workers.values():
            if w.alive():
                log.warning("%s did not stop within %.0f s: SIGKILL", w.name, grace_s)
                w.signal(signal.SIGKILL)
                w.wait(5.0)

    @staticmethod
    def _wait(workers: list[WorkerProcess], seconds: float, between: Optional[Callable[[], None]]) -> None:
        """Wait up to ``seconds`` in all for ``workers`` to exit, calling ``between`` every
        :data:`WAIT_SLICE_S` or so."""
        deadline = time.monotonic() + seconds
        for w in workers:
            while w.alive() and time.monotonic() < deadline:
                if between is not None:
                    between()
                w.wait(max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic())))
        for w in workers:  # exited: collect their output threads
            if w.popen is not None and not w.alive():
                w.wait(0.0)

    def report(self, worker: WorkerProcess) -> str:
        lines = "\n".join(f"    {line}" for line in worker.tail)
        return (f"{worker.name} (pid {worker.pid}) exited with code {worker.returncode()}; "
                f"last lines (full log: {worker.log_path}):\n{lines}")
