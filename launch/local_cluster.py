"""The worker processes of this node: their command lines, stable ring endpoints, (re)starts.

:class:`LocalCluster` is what the coordinator (:class:`dflash.runtime.coordinator.Coordinator`)
drives to start, kill and restart workers; ``<run_dir>/cluster.json`` (:meth:`LocalCluster.write_info`)
tells ``python -m launch.cluster status | restart | stop | attach`` how to reach the running cluster.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path
from typing import Optional

from dflash.training.checkpoint_load import latest_checkpoint
from dflash.config import RunConfig
from dflash.utils import atomic_write_text
from dflash.runtime.supervisor import Supervisor, WorkerSpec

__all__ = ["CLUSTER_FILE", "LocalCluster", "free_port"]

#: ``<run_dir>/cluster.json``: the control endpoint, the launcher's pid and every worker's command line.
CLUSTER_FILE = "cluster.json"
#: Seconds to wait for a killed worker to exit before starting it again.
KILL_WAIT_S = 10.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the operating system's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalCluster:
    """The worker processes of this node: specs, stable ring endpoints, (re)starts.

    Implements :class:`dflash.runtime.coordinator.ClusterControl` for the coordinator.

    Args:
        cfg: the run's config (``cluster.targets`` / ``cluster.drafters``: one worker each).
        run_dir: the run directory (logs, checkpoints, ``cluster.json``).
        control_endpoint: the coordinator's ROUTER endpoint the workers connect to.
        supervisor: starts the processes and forwards their output.
        data_cache: the tokenised-data cache directory the launcher prepared, handed to every worker
            (``--data-cache``; on a filesystem every node sees, as the run directory is); None: each
            worker prepares the data itself.
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, control_endpoint: str, supervisor: Supervisor,
                 node_addr: Optional[str] = None, data_cache: Optional[Path] = None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.supervisor = supervisor
        self.targets = [f"target.{r}" for r in range(len(cfg.cluster.targets))]
        self.drafters = [f"drafter.{r}" for r in range(len(cfg.cluster.drafters))]
        #: this machine's address as the other nodes reach it (``transport.host`` on one machine)
        self.node_addr = node_addr or cfg.transport.host
        #: the workers of this node (node 0); the others run under their node's launcher
        self.local = set(cfg.cluster.workers_on(0))
        # fixed ports: a restarted target binds the same endpoint, so drafters reconnect by themselves
        self.endpoints = {t: f"tcp://{self.node_addr}:{free_port(self.node_addr)}" for t in self.targets
                          if t in self.local}
        self.control_endpoint = control_endpoint
        self.common = ["--run-dir", str(run_dir), "--control", control_endpoint]
        if data_cache is not None:
            self.common += ["--data-cache", str(Path(data_cache).resolve())]
        #: the drafter group's torch.distributed rendezvous (hosted by drafter.0's node)
        self.master_addr = self.node_addr
        self.master_port = free_port(self.node_addr)
        self._reported: set[tuple[str, int]] = set()

    def spec(self, name: str, resume_from: Optional[Path] = None) -> WorkerSpec:
        """How to start worker ``name`` (``target.K`` / ``drafter.K``); a drafter loads ``resume_from``."""
        role, rank = name.split(".")
        r = int(rank)
        if role == "target":
            return WorkerSpec(name, role, r, "dflash.runtime.target",
                              ["--rank", rank, *self.common, "--endpoint", self.endpoints[name]])
        env = {"MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port), "RANK": rank,
               "WORLD_SIZE": str(len(self.drafters)), "LOCAL_RANK": str(self.cfg.cluster.local_rank(name))}
        resume = ["--resume-from", str(resume_from)] if resume_from is not None else []
        return WorkerSpec(name, role, r, "dflash.runtime.drafter", ["--rank", rank, *self.common, *resume], env=env)

    def start_all(self, resume_from: Optional[Path]) -> None:
        """Start every target, then every drafter (loading ``resume_from`` when given)."""
        for name in self.targets:
            self.start(name, None)
        for name in self.drafters:
            self.start(name, resume_from)

    def start(self, name: str, resume_from: Optional[Path]) -> None:
        """Start worker ``name`` (a local process here)."""
        self.supervisor.start(self.spec(name, resume_from))

    def write_info(self) -> Path:
        """Write ``<run_dir>/cluster.json`` atomically: how ``status / restart / stop / attach`` reach
        this cluster (control endpoint, launcher pid, each worker's module, arguments and environment)."""
        workers = {}
        for name in self.targets + self.drafters:
            spec = self.spec(name)
            workers[name] = {"module": spec.module, "args": spec.args, "env": spec.env}
        data = {"control": self.control_endpoint, "launcher_pid": os.getpid(), "workers": workers}
        return atomic_write_text(self.run_dir / CLUSTER_FILE, json.dumps(data, indent=1))

    # ClusterControl
    def restart(self, name: str, resume_from: Optional[Path]) -> None:
        self.kill(name)
        self.start(name, resume_from)

    def kill(self, name: str) -> None:
        proc = self.supervisor.workers.get(name)
        if proc is not None and proc.alive():
            proc.signal(signal.SIGKILL)
            proc.wait(KILL_WAIT_S)

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
        self.master_port = free_port(self.node_addr)
        self.write_info()

    def latest_checkpoint(self) -> Optional[Path]:
        return latest_checkpoint(self.run_dir, verify=True)
