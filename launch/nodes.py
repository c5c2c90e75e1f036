"""More than one machine: the rendezvous (torchrun's flags and environment) and node 0's view of
the other nodes' launchers.

One launcher per node, started the torchrun way (``--nnodes N --node-rank R --master-addr HOST
--master-port P``, or ``NNODES`` / ``NODE_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT``, or SLURM's
``SLURM_NNODES`` / ``SLURM_NODEID``; flags win). Node 0 runs the coordinator, its control socket
bound on every interface at the master port; the launcher of node R > 0 (:mod:`launch.node_agent`)
registers there (:class:`~dflash.runtime.messages.NodeHello`) and starts, kills and reports its
node's workers on the coordinator's word. :class:`NodeCluster` is the coordinator's
:class:`~dflash.runtime.restarts.ClusterControl` over all nodes: node 0's workers as
:class:`~launch.local_cluster.LocalCluster` does, the others through their node's launcher.

A node's launcher that dies takes its workers with it (parent-death signal); the coordinator
learns it from the launcher's silence (``transport.peer_timeout_s``) or a failed send, reports
every worker of that node as exited, and the restart policy runs: a worker of a lost node cannot
be restarted, so the run fails with a report naming the node (:class:`NodeLost`).
The run directory must be on a filesystem every node sees (config, logs, checkpoints).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

from dflash.config import RunConfig
from dflash.runtime.control import CoordinatorSocket
from dflash.runtime.messages import NodeBeat, NodeExited, NodeHello, NodeKill, NodeStart, NodeStop
from dflash.runtime.restarts import RunFailed
from launch.local_cluster import LocalCluster
from dflash.runtime.supervisor import Supervisor

__all__ = ["Rendezvous", "NodeCluster", "NodeLost", "add_rendezvous_args", "node_address", "DEFAULT_MASTER_PORT"]

log = logging.getLogger("dflash.cluster")

#: torchrun's default master port.
DEFAULT_MASTER_PORT = 29500
#: Seconds between "still waiting for node(s)" lines while nodes join.
JOIN_NOTE_S = 30.0
#: After the run: the longest wait (s) for the other nodes' launchers to report their workers stopped.
NODE_STOP_WAIT_S = 60.0


class NodeLost(RunFailed):
    """A node's launcher is gone: its workers cannot be restarted."""


def add_rendezvous_args(p: argparse.ArgumentParser) -> None:
    """``--nnodes --node-rank --master-addr --master-port --node-addr`` (torchrun's names; absent from the
    namespace unless given, so the environment can supply them)."""
    g = p.add_argument_group("several machines (torchrun's rendezvous; env NNODES / NODE_RANK / MASTER_ADDR / "
                             "MASTER_PORT, SLURM_NNODES / SLURM_NODEID)")
    g.add_argument("--nnodes", type=int, default=argparse.SUPPRESS, help="machines of the run (= len(cluster.nodes))")
    g.add_argument("--node-rank", type=int, default=argparse.SUPPRESS, help="this machine's rank; node 0 runs the coordinator")
    g.add_argument("--master-addr", default=argparse.SUPPRESS, help="node 0's address, reachable from every node")
    g.add_argument("--master-port", type=int, default=argparse.SUPPRESS, help=f"the coordinator's port (default {DEFAULT_MASTER_PORT})")
    g.add_argument("--node-addr", default=argparse.SUPPRESS,
                   help="this machine's address as the other nodes reach it (default: the interface that routes "
                        "to --master-addr)")


def node_address(master_addr: str) -> str:
    """This machine's IP address on the route to ``master_addr`` (no packet is sent): the
    address its targets bind and the other nodes connect to (``127.0.0.1`` for a local master)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(master_addr), 9))
        return s.getsockname()[0]


@dataclass(frozen=True)
class Rendezvous:
    """Where this launcher stands among the run's machines."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    node_addr: str = "127.0.0.1"

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> "Rendezvous":
        """Flags first, then torchrun's and SLURM's environment variables, then one machine.

        Raises:
            ValueError: a rank outside ``[0, nnodes)``, a non-integer variable, a bad port (named).
        """
        def pick(flag: Optional[object], *names: str, default: object) -> object:
            if flag is not None:
                return flag
            for name in names:
                if env.get(name, "") != "":
                    return env[name]
            return default

        try:
            nnodes = int(pick(getattr(args, "nnodes", None), "NNODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", default=1))
            rank = int(pick(getattr(args, "node_rank", None), "NODE_RANK", "GROUP_RANK", "SLURM_NODEID", default=0))
            port = int(pick(getattr(args, "master_port", None), "MASTER_PORT", default=DEFAULT_MASTER_PORT))
        except ValueError as exc:
            raise ValueError(f"--nnodes / --node-rank / --master-port: {exc}") from None
        addr = str(pick(getattr(args, "master_addr", None), "MASTER_ADDR", default="127.0.0.1"))
        if rank > 0 and getattr(args, "master_addr", None) is None and not env.get("MASTER_ADDR"):
            log.warning("node %d: no --master-addr (or MASTER_ADDR): node 0 is assumed on this machine (127.0.0.1)",
                        rank)
        if nnodes < 1 or not 0 <= rank < nnodes:
            raise ValueError(f"--node-rank {rank} is outside [0, --nnodes {nnodes})")
        if not 0 < port < 65536:
            raise ValueError(f"--master-port {port} is not a TCP port")
        node_addr = pick(getattr(args, "node_addr", None), "DFLASH_NODE_ADDR", default=None)
        if node_addr is None:
            node_addr = node_address(addr) if nnodes > 1 else "127.0.0.1"
        return cls(nnodes, rank, addr, port, str(node_addr))

    def check(self, cfg: RunConfig) -> None:
        """Raises ValueError when ``--nnodes`` differs from the config's placement."""
        if self.nnodes != cfg.cluster.num_nodes:
            unset = "" if cfg.cluster.nodes else " (cluster.nodes is not set: one machine)"
            raise ValueError(f"--nnodes {self.nnodes} but cluster.nodes places workers on {cfg.cluster.num_nodes} "
                             f"node(s){unset}")

    @property
    def control_endpoint(self) -> str:
        """The coordinator's endpoint as every node reaches it."""
        return f"tcp://{self.master_addr}:{self.master_port}"


@dataclass
class _Node:
    rank: int
    addr: str = ""
    pid: int = 0
    incarnation: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    pids: dict[str, int] = field(default_factory=dict)
    lost: str = ""
    stopped: bool = False


class NodeCluster(LocalCluster):
    """The coordinator's cluster control over every node (see the module docstring).

    Args:
        cfg, run_dir, supervisor, data_cache: as :class:`LocalCluster` (node 0's workers).
        sock: the coordinator's bound control socket (the node launchers connect to it too).
        rdzv: this launch's rendezvous (node 0).
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, sock: CoordinatorSocket, supervisor: Supervisor,
                 rdzv: Rendezvous, data_cache: Optional[Path] = None):
        super().__init__(cfg, run_dir, rdzv.control_endpoint, supervisor, node_addr=rdzv.node_addr,
                         data_cache=data_cache)
        self.sock = sock
        self.rdzv = rdzv
        self.timeout_s = cfg.transport.peer_timeout_s
        self.beat_s = cfg.transport.heartbeat_s
        self.nodes = {r: _Node(r) for r in range(1, rdzv.nnodes)}
        self._exits: list[tuple[str, str]] = []
        #: the last exit report of each worker of another node
        self._reports: dict[str, str] = {}
        self._next_beat = 0.0

    # ------------------------------------------------------------------ joining
    def wait_for_nodes(self, timeout_s: float) -> None:
        """Wait until every other node's launcher has said hello (before any worker starts).

        Raises:
            NodeLost: a node did not join within ``timeout_s`` (named, with the command to start it).
        """
        deadline = time.monotonic() + timeout_s
        where = f"--master-addr {self.rdzv.master_addr} --master-port {self.rdzv.master_port}"
        log.info("waiting for node(s) %s to join (%s, at most %.0f s: cluster.node_join_timeout_s)",
                 sorted(self.nodes), where, timeout_s)
        next_note = time.monotonic() + JOIN_NOTE_S
        while not all(n.incarnation for n in self.nodes.values()):
            missing = sorted(r for r, n in self.nodes.items() if not n.incarnation)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NodeLost(f"node(s) {missing} did not join within {timeout_s:.0f} s "
                               f"(cluster.node_join_timeout_s): start `python -m launch.cluster train --node-rank R "
                               f"--nnodes {len(self.nodes) + 1} {where}` on each, with the same config "
                               f"(is the port reachable from there, and the same on every node?)")
            if time.monotonic() >= next_note:
                log.info("still waiting for node(s) %s (%.0f s left)", missing, remaining)
                next_note += JOIN_NOTE_S
            got = self.sock.recv(min(remaining, 1.0))
            if got is not None and isinstance(got[1], (NodeHello, NodeBeat, NodeExited)):
                self.on_node_message(*got)
            elif got is not None:
                log.warning("%s message from %s before every node joined: dropped", got[1].TAG, got[0])
        first = self.cfg.cluster.node_of("drafter.0")
        if first != 0:  # the drafter group's store is hosted by its rank 0
            self.master_addr = self.nodes[first].addr
        log.info("all %d node(s) joined: %s", len(self.nodes) + 1,
                 ", ".join([f"0@{self.node_addr}"] + [f"{r}@{n.addr}" for r, n in sorted(self.nodes.items())]))

    def on_node_message(self, sender: str, msg) -> None:
        """A node launcher's message (hello, beat, a worker's exit)."""
        node = self.nodes.get(msg.node)
        if node is None or sender != f"node.{msg.node}":
            log.error("%s from %s claiming node %s dropped (nodes: 1..%d)", msg.TAG, sender, msg.node, len(self.nodes))
            return
        if node.lost:
            log.warning("%s from node %d, lost before (%s): ignored", msg.TAG, msg.node, node.lost)
            return
        node.last_seen = time.monotonic()
        if isinstance(msg, NodeHello):
            if node.incarnation and msg.incarnation != node.incarnation:
                self._lose(node, f"its launcher restarted (pid {node.pid} -> {msg.pid})")
                return
            node.addr, node.pid, node.incarnation = msg.addr, msg.pid, msg.incarnation
            self.endpoints.update(msg.endpoints)
            log.info("node %d joined: %s, launcher pid %d, targets %s", msg.node, msg.addr, msg.pid,
                     sorted(msg.endpoints) or "none")
        elif isinstance(msg, NodeBeat):
            node.pids, node.stopped = dict(msg.pids), msg.stopped
        elif isinstance(msg, NodeExited):
            node.pids.pop(msg.worker, None)
            self._exits.append((msg.worker, msg.report))

    # ------------------------------------------------------------------ liveness
    def _lose(self, node: _Node, why: str) -> None:
        node.lost = why
        log.error("node %d (%s, launcher pid %d) is lost: %s; its workers are gone", node.rank, node.addr or "?",
                  node.pid, why)
        for name in self.cfg.cluster.workers_on(node.rank):
            self._exits.append((name, f"{name} ran on node {node.rank} ({node.addr}), whose launcher is lost: {why}"))
        node.pids.clear()

    def _send(self, node: _Node, msg) -> None:
        if not node.lost and not self.sock.send(f"node.{node.rank}", msg):
            self._lose(node, "its launcher is not connected")

    def _check_nodes(self) -> None:
        now = time.monotonic()
        for node in self.nodes.values():
            if not node.lost and now - node.last_seen > self.timeout_s:
                self._lose(node, f"its launcher sent nothing for {now - node.last_seen:.0f} s "
                                 f"(transport.peer_timeout_s)")
        if now >= self._next_beat:
            self._next_beat = now + self.beat_s
            for node in self.nodes.values():
                self._send(node, NodeBeat(node=node.rank))

    def _node(self, name: str) -> Optional[_Node]:
        return self.nodes.get(self.cfg.cluster.node_of(name))

    # ------------------------------------------------------------------ ClusterControl
    def start(self, name: str, resume_from: Optional[Path]) -> None:
        node = self._node(name)
        if node is None:
            super().start(name, resume_from)
            return
        if node.lost:
            raise NodeLost(f"{name} cannot be (re)started: node {node.rank} ({node.addr}) is lost ({node.lost}). "
                           f"Restart the launchers of every node with --resume to continue from the newest checkpoint")
        spec = self.spec(name, resume_from)
        self._send(node, NodeStart(worker=name, module=spec.module, args=spec.args, env=spec.env))

    def kill(self, name: str) -> None:
        node = self._node(name)
        if node is None:
            super().kill(name)
        else:
            self._send(node, NodeKill(worker=name))

    def exited(self) -> list[str]:
        self._check_nodes()
        out = super().exited()
        while self._exits:
            name, report = self._exits.pop(0)
            self._reports[name] = report
            out.append(name)
        return out

    def pid(self, name: str) -> Optional[int]:
        node = self._node(name)
        return super().pid(name) if node is None else node.pids.get(name)

    def report(self, name: str) -> str:
        return super().report(name) if self._node(name) is None else self._reports.get(name, f"{name} exited")

    def node_of(self, name: str) -> int:
        return self.cfg.cluster.node_of(name)

    def node_status(self) -> dict:
        """``{rank: {addr, pid, state}}`` of every node (``launch.cluster status``)."""
        out = {"0": {"addr": self.node_addr, "pid": os.getpid(), "state": "coordinator"}}
        for r, n in self.nodes.items():
            out[str(r)] = {"addr": n.addr, "pid": n.pid, "state": f"lost: {n.lost}" if n.lost else "up"}
        return out

    def stop_nodes(self, reason: str, wait_s: float = NODE_STOP_WAIT_S) -> None:
        """Tell every node launcher the run is over and wait (at most ``wait_s``) until each has
        stopped its workers or is lost."""
        for node in self.nodes.values():
            if not node.incarnation:  # never joined: nothing to stop there
                node.stopped = True
                continue
            self._send(node, NodeStop(reason=reason))
        deadline = time.monotonic() + wait_s
        while not all(n.lost or n.stopped for n in self.nodes.values()) and time.monotonic() < deadline:
            got = self.sock.recv(0.2)
            if got is not None and isinstance(got[1], (NodeHello, NodeBeat, NodeExited)):
                self.on_node_message(*got)
            self._check_nodes()
        late = [r for r, n in self.nodes.items() if not (n.lost or n.stopped)]
        if late:
            log.warning("node(s) %s did not report their workers stopped within %.0f s", late, wait_s)
