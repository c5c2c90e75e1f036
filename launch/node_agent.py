"""The launcher of node R > 0: registers with node 0's coordinator, runs this node's workers on its word.

One loop: say :class:`~dflash.runtime.messages.NodeHello` (this node's address and its targets'
ring endpoints, on ports fixed for the run) until the coordinator answers, then start / kill
workers as told (:class:`NodeStart` / :class:`NodeKill`), report each exit with its last log lines
(:class:`NodeExited`) and the live workers' pids every heartbeat (:class:`NodeBeat`). It ends when
told (:class:`NodeStop`: its workers leave on their own, the rest are stopped), on SIGTERM / SIGINT,
or when the coordinator is silent for ``transport.peer_timeout_s`` (node 0 is gone): then every
worker is stopped and the exit code is 1. Its workers die with it (parent-death signal).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import zmq

from dflash.config import RunConfig
from dflash.runtime.messages import (CODEC, ControlError, NodeBeat, NodeExited, NodeHello, NodeKill, NodeStart,
                                    NodeStop)
from dflash.transport.messages import new_incarnation
from launch.local_cluster import KILL_WAIT_S, free_port
from launch.nodes import Rendezvous
from dflash.runtime.supervisor import Supervisor, WorkerSpec

__all__ = ["run_node"]

log = logging.getLogger("dflash.cluster")

#: Exit code when the coordinator (node 0) went silent.
EXIT_COORDINATOR_LOST = 1


class NodeAgent:
    """This node's workers under the coordinator's control (see the module docstring)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, rdzv: Rendezvous):
        self.cfg, self.rdzv = cfg, rdzv
        self.node = rdzv.node_rank
        self.names = cfg.cluster.workers_on(self.node)
        self.endpoints = {n: f"tcp://{rdzv.node_addr}:{free_port(rdzv.node_addr)}" for n in self.names
                          if n.startswith("target.")}
        self.supervisor = Supervisor(run_dir / "logs", lambda line: (sys.stderr.write(line + "\n"), sys.stderr.flush()))
        self.incarnation = new_incarnation()
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"node.{self.node}".encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(rdzv.control_endpoint)
        self.reported: set[tuple[str, int]] = set()
        self.stop_reason = ""
        self.signalled = 0

    def send(self, msg) -> None:
        self.sock.send(CODEC.encode(msg))

    def beat(self) -> None:
        pids = {n: w.pid for n, w in self.supervisor.workers.items() if w.alive()}
        self.send(NodeBeat(node=self.node, pids=pids, stopped=bool(self.stop_reason) and not pids))

    def report_exits(self) -> None:
        for w in self.supervisor.dead():
            key = (w.name, w.starts)
            if key not in self.reported:
                self.reported.add(key)
                self.send(NodeExited(node=self.node, worker=w.name, report=self.supervisor.report(w)))

    def handle(self, msg) -> None:
        if isinstance(msg, NodeStart):
            if msg.worker not in self.names:
                log.error("node %d was asked to start %s, which runs on another node: ignored", self.node, msg.worker)
                return
            self.kill(msg.worker)
            role, rank = msg.worker.split(".")
            self.supervisor.start(WorkerSpec(msg.worker, role, int(rank), msg.module, list(msg.args), dict(msg.env)))
        elif isinstance(msg, NodeKill):
            self.kill(msg.worker)
        elif isinstance(msg, NodeStop):
            log.info("node %d: the run is over (%s): stopping its workers", self.node, msg.reason)
            self.stop_reason = msg.reason

    def kill(self, name: str) -> None:
        proc = self.supervisor.workers.get(name)
        if proc is not None and proc.alive():
            proc.signal(signal.SIGKILL)
            proc.wait(KILL_WAIT_S)

    def run(self) -> int:
        """The loop; returns the exit code (0: stopped by the coordinator or a signal after it)."""
        tp = self.cfg.transport
        hello = NodeHello(node=self.node, addr=self.rdzv.node_addr, pid=os.getpid(), incarnation=self.incarnation,
                          endpoints=self.endpoints)
        joined = False
        join_deadline = time.monotonic() + self.cfg.cluster.node_join_timeout_s
        last_heard = time.monotonic()
        next_beat = 0.0
        while True:
            now = time.monotonic()
            if self.signalled:
                log.warning("node %d: signal %d: stopping its workers", self.node, self.signalled)
                return self.shutdown(128 + self.signalled)
            if not joined and now > join_deadline:
                log.error("node %d: the coordinator at %s did not answer within %.0f s (cluster.node_join_timeout_s)",
                          self.node, self.rdzv.control_endpoint, self.cfg.cluster.node_join_timeout_s)
                return self.shutdown(EXIT_COORDINATOR_LOST)
            if joined and now - last_heard > tp.peer_timeout_s:
                log.error("node %d: the coordinator (node 0 at %s) sent nothing for %.0f s: it is gone; stopping this "
                          "node's workers", self.node, self.rdzv.control_endpoint, now - last_heard)
                return self.shutdown(EXIT_COORDINATOR_LOST)
            if now >= next_beat:
                next_beat = now + tp.heartbeat_s
                if joined:
                    self.beat()
                else:
                    self.send(hello)
            self.report_exits()
            if self.stop_reason and not any(w.alive() for w in self.supervisor.workers.values()):
                self.beat()
                return self.shutdown(0)
            if self.sock.poll(int(1000 * min(tp.heartbeat_s, 0.2))):
                try:
                    msg = CODEC.decode(self.sock.recv())
                except ControlError as exc:
                    log.error("node %d: rejected control message from the coordinator: %s", self.node, exc)
                    continue
                if not joined:
                    log.info("node %d (%s) joined the run at %s", self.node, self.rdzv.node_addr,
                             self.rdzv.control_endpoint)
                joined, last_heard = True, time.monotonic()
                self.handle(msg)

    def shutdown(self, code: int) -> int:
        """Stop every worker (bounded: SIGTERM, then SIGKILL) and report their exits; returns ``code``."""
        self.supervisor.stop_all(exit_s=5.0 if self.stop_reason else 0.0)
        try:
            self.report_exits()
            self.beat()
        except zmq.ZMQError:
            pass
        self.sock.close(linger=500)
        return code


def run_node(cfg: RunConfig, run_dir: Path, rdzv: Rendezvous) -> int:
    """Run node ``rdzv.node_rank`` (> 0) of a multi-node run until the coordinator ends it.

    Returns:
        0 when the coordinator stopped the run, 1 when it went silent or never answered,
        128 + N after signal N.
    """
    agent = NodeAgent(cfg, run_dir, rdzv)

    def on_signal(signum: int, _frame) -> None:
        agent.signalled = signum

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    log.info("node %d of %d on %s (%s): workers %s; coordinator at %s", rdzv.node_rank, rdzv.nnodes,
             socket.gethostname(), rdzv.node_addr, agent.names, rdzv.control_endpoint)
    return agent.run()
