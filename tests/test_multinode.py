"""Two launchers on this machine as two nodes (node ranks 0 and 1, master address 127.0.0.1, CPU, gloo):
target.0 and drafter.0 on node 0 (shared memory between them), drafter.1 on node 1 (tcp to target.0).

- the per-step losses equal the single-process reference trainer's with the doubled batch (1e-5);
- SIGKILL of node 1's launcher: its workers die with it, the run stops with exit code 1 and a
  report naming node 1; no worker process is left and nothing is left in /dev/shm.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from launch.local_cluster import free_port
from tests.test_pipeline import CONFIG, ROOT, RUN_TIMEOUT_S, SMALL, _env, reference_losses, train_losses

pytestmark = pytest.mark.slow

PLACEMENT = ["cluster.nodes=[{targets: [0], drafters: [0]}, {drafters: [0]}]"]
#: Bound on the wait for the processes of a stopped run to disappear (s).
EXIT_WAIT_S = 60.0


def launch_node(run_dir: Path, rank: int, port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "launch.cluster", "train", "--config", str(CONFIG), "--nnodes", "2",
           "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
           *SMALL, *PLACEMENT, *extra, f"run_dir={run_dir}"]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def worker_pids(text: str) -> set[int]:
    return {int(p) for p in re.findall(r"started (?:target|drafter)\.\d+ \(pid (\d+)\)", text)}


def shm_entries() -> set[str]:
    return {e for e in os.listdir("/dev/shm") if "dflash" in e or e.startswith("torch_")} if os.path.isdir("/dev/shm") else set()


def test_two_nodes_match_reference_doubled_batch(tmp_path):
    port = free_port()
    node1 = launch_node(tmp_path / "run", 1, port, [])
    node0 = launch_node(tmp_path / "run", 0, port, [])
    out0, _ = node0.communicate(timeout=RUN_TIMEOUT_S)
    out1, _ = node1.communicate(timeout=RUN_TIMEOUT_S)
    assert node0.returncode == 0, out0[-4000:]
    assert node1.returncode == 0, out1[-4000:]
    got = train_losses(tmp_path / "run")
    ref = reference_losses(["cluster.drafters=[0, 1]"], 2)
    assert sorted(got) == list(range(1, len(ref) + 1))
    for step, loss in enumerate(ref, start=1):
        assert got[step] == pytest.approx(loss, rel=1e-5, abs=1e-5), (step, got, ref)
    assert ref[0] > 0 and len(set(ref)) == len(ref)
    # drafter.1 runs under node 1's launcher and reads target.0 over tcp; drafter.0 over shm
    assert "started drafter.1" in out1 and "started drafter.1" not in out0
    log1 = (tmp_path / "run" / "logs" / "drafter.1.log").read_text()
    log0 = (tmp_path / "run" / "logs" / "drafter.0.log").read_text()
    assert "attached to target.0" in log1 and "tcp)" in log1
    assert "attached to target.0" in log0 and "shm)" in log0


def test_sigkill_of_node1_launcher_stops_the_run_naming_the_node(tmp_path):
    before = shm_entries()
    port = free_port()
    extra = ["train.max_steps=400", "transport.peer_timeout_s=10", "cluster.max_restarts=1"]
    run_dir = tmp_path / "run"
    node1 = launch_node(run_dir, 1, port, extra)
    node0 = launch_node(run_dir, 0, port, extra)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline and node0.poll() is None:
        if (run_dir / "metrics.jsonl").is_file() and len(train_losses(run_dir)) >= 2:
            break
        time.sleep(0.2)  # polling a file written by another process; the run itself is not timed
    assert node0.poll() is None, node0.communicate()[0][-3000:]
    node1_workers = {p.pid for p in psutil.Process(node1.pid).children()}
    assert node1_workers, "node 1 runs no worker"
    os.kill(node1.pid, signal.SIGKILL)
    out0, _ = node0.communicate(timeout=RUN_TIMEOUT_S)
    out1, _ = node1.communicate(timeout=RUN_TIMEOUT_S)
    assert node0.returncode == 1, out0[-4000:]
    assert re.search(r"node 1 \(127\.0\.0\.1.*\) is lost", out0), out0[-4000:]
    assert "cannot be (re)started: node 1" in out0, out0[-4000:]
    # no orphan: every worker of either node is gone (node 1's died with their launcher)
    pids = worker_pids(out0) | worker_pids(out1) | node1_workers
    gone, alive = psutil.wait_procs([p for p in map(_process, pids) if p is not None], timeout=EXIT_WAIT_S)
    assert not alive, [p.pid for p in alive]
    assert shm_entries() <= before


def test_a_node_that_never_joins_stops_node_0_with_the_command_to_start_it(tmp_path):
    port = free_port()
    node0 = launch_node(tmp_path / "run", 0, port, ["cluster.node_join_timeout_s=3"])
    out, _ = node0.communicate(timeout=RUN_TIMEOUT_S)
    assert node0.returncode == 1, out[-3000:]
    assert "waiting for node(s) [1] to join" in out, out[-3000:]
    assert "did not join within 3 s" in out and f"--master-addr 127.0.0.1 --master-port {port}" in out, out[-3000:]
    assert "is lost" not in out and "cannot send" not in out, out[-3000:]  # nothing to stop on a node never seen
    assert not worker_pids(out), "a worker started before every node joined"


def _process(pid: int):
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def test_rendezvous_flags_win_over_torchrun_and_slurm_environment():
    import argparse

    from launch.nodes import Rendezvous

    env = {"SLURM_NNODES": "4", "SLURM_NODEID": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29600"}
    r = Rendezvous.from_args(argparse.Namespace(), env)
    assert (r.nnodes, r.node_rank, r.master_addr, r.master_port, r.node_addr) == (4, 3, "127.0.0.1", 29600, "127.0.0.1")
    r = Rendezvous.from_args(argparse.Namespace(nnodes=2, node_rank=1), {**env, "NNODES": "8", "NODE_RANK": "5"})
    assert (r.nnodes, r.node_rank, r.master_port) == (2, 1, 29600)
    assert Rendezvous.from_args(argparse.Namespace(), {}) == Rendezvous()
    with pytest.raises(ValueError, match="--node-rank 2 is outside"):
        Rendezvous.from_args(argparse.Namespace(nnodes=2, node_rank=2), {})
    with pytest.raises(ValueError, match="--nnodes 3 but cluster.nodes"):
        from dflash.config import load_config

        Rendezvous(nnodes=3).check(load_config(CONFIG, PLACEMENT))
    with pytest.raises(ValueError, match=r"cluster.nodes is not set"):
        Rendezvous(nnodes=2).check(load_config(CONFIG))


def test_a_node_without_master_address_says_it_assumes_this_machine(caplog):
    import argparse

    from launch.nodes import Rendezvous

    with caplog.at_level("WARNING", logger="dflash.cluster"):
        r = Rendezvous.from_args(argparse.Namespace(nnodes=2, node_rank=1), {})
    assert r.master_addr == "127.0.0.1" and "no --master-addr (or MASTER_ADDR)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="dflash.cluster"):
        Rendezvous.from_args(argparse.Namespace(nnodes=2, node_rank=1), {"MASTER_ADDR": "127.0.0.1"})
        Rendezvous.from_args(argparse.Namespace(nnodes=2, node_rank=0), {})
    assert "no --master-addr" not in caplog.text
