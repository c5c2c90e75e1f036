"""Fault tolerance on CPU: control commands, automatic restarts under random SIGKILLs, no orphans.

The fault-injection test kills a random worker (target or drafter) with SIGKILL at random
moments, 20 times over one run, through pids read with ``python -m launch.cluster status``.
A dead target is restarted (its batches re-assigned), a dead drafter restarts the drafter group
from the last checkpoint. The run must finish with an exact ledger and the same per-step losses
as the single-process reference trainer (restores are exact, batches deterministic), leaving no
worker process and no shared-memory segment behind.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.training.checkpoint_load import checkpoint_problem, read_state
from test_pipeline import CONFIG, ROOT, SMALL, _env, reference_losses, train_losses

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 900
FAULTS = ["cluster.drafters=[0, 1]", "train.max_steps=60", "train.eval_batches=0", "checkpoint.every=2",
          "cluster.max_restarts=4", "cluster.restart_backoff_s=0.2", "transport.peer_timeout_s=20"]


def ctl(run_dir: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cluster", *args, "--run-dir", str(run_dir)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=timeout)


def status(run_dir: Path) -> dict | None:
    res = ctl(run_dir, "status", "--json")
    return json.loads(res.stdout) if res.returncode == 0 else None


def wait_until(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the cluster exited while waiting for {what}:\n{finish(proc)[-4000:]}")
        time.sleep(0.3)  # polling another process's state, bounded by the deadline
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def descendants(pid: int) -> set[int]:
    """Live processes whose parent chain reaches ``pid`` (from /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    out, frontier = set(), {pid}
    while frontier:
        children = {c for c, p in parents.items() if p in frontier}
        frontier = children - out
        out |= children
    return out


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _kill_leftover_clusters():
    """A failing test must not leave a cluster running."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def launch(run_dir: Path, extra: list[str], env: dict | None = None) -> subprocess.Popen:
    """Start a cluster (``env``: added to its environment); its output goes to ``<run_dir>.log``
    (a pipe nobody reads would block it)."""
    cmd = [sys.executable, "-m", "launch.cluster", "--config", str(CONFIG), *SMALL, *extra, f"run_dir={run_dir}"]
    log_file = open(f"{run_dir}.log", "w")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**_env(), **(env or {})}, stdout=log_file, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    proc.log_path = Path(f"{run_dir}.log")  # type: ignore[attr-defined]
    _STARTED.append(proc)
    return proc


def finish(proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S) -> str:
    """Wait for the launcher; its whole output."""
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.log_path.read_text()  # type: ignore[attr-defined]


@pytest.mark.timeout(1500)  # 20 kills, each followed by a full recovery: ~4 min alone, far more on a busy 2-core box
def test_random_sigkills_run_finishes_with_exact_ledger(tmp_path):
    run_dir = tmp_path / "run"
    shm_before = shm_entries()
    proc = launch(run_dir, FAULTS)
    rng = random.Random(1234)
    kills = []
    wait_until(lambda: (s := status(run_dir)) and all(w["ready"] for w in s["workers"].values()), 180,
               "all workers ready", proc)
    while len(kills) < 20:
        # each kill once the run has trained past the previous kill's step: cluster.max_restarts
        # counts failures without progress, and kills landing on a recovery that has not trained a
        # step yet (a slow, loaded box) would be a restart storm, not the faults this test injects
        after = kills[-1][1] if kills else -1
        s = wait_until(lambda: (x := status(run_dir)) and all(w["ready"] for w in x["workers"].values())
                       and x["step"] > after and x, 240, f"a healthy cluster past step {after} before kill "
                       f"{len(kills) + 1}", proc)
        if s["step"] >= 56:
            break
        time.sleep(rng.uniform(0.0, 2.0))  # a random moment: the fault injector's choice, not synchronisation
        name = rng.choice(sorted(s["workers"]))
        pid = s["workers"][name]["pid"]
        if pid is None:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            kills.append((name, s["step"]))
        except ProcessLookupError:
            continue
    out = finish(proc)
    assert proc.returncode == 0, out[-6000:]
    assert len(kills) >= 10, f"only {len(kills)} kills before the run ended: {kills}"
    assert "ledger:" not in out, out[-3000:]  # the launcher logs ledger problems, if any
    assert "drafter group is back" in out or all(k[0].startswith("target") for k in kills)
    # the same losses as an unfaulted run: every rollback restored the exact state
    got = train_losses(run_dir)
    ref = reference_losses(FAULTS, 2)
    assert sorted(got) == list(range(1, len(ref) + 1))
    for step, loss in enumerate(ref, start=1):
        assert got[step] == pytest.approx(loss, rel=1e-5, abs=1e-5), (step, kills)
    # after the rollbacks: each step once in the final views of metrics.jsonl and ledger.jsonl,
    # every batch trained once by the ledger file alone
    from dflash.config import load_config
    from dflash.training.factory import build_batch_plans
    from dflash.metrics import metrics_view
    from dflash.training.ledger_file import ledger_problems, ledger_view

    rows = [r for r in metrics_view(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rows] == list(range(1, len(ref) + 1))
    assert sorted(ledger_view(run_dir / "ledger.jsonl")) == list(range(len(ref)))
    plans = build_batch_plans(load_config(CONFIG, [*SMALL, *FAULTS]))
    assert ledger_problems(run_dir / "ledger.jsonl", [plans.train.num_batches(0)]) == []
    # no orphans, no shared memory left behind
    wait_until(lambda: not descendants(proc.pid), 60, "no worker process left")
    assert shm_entries() - shm_before == set()


def test_status_restart_and_stop_commands(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, ["cluster.drafters=[0]", "train.max_steps=400", "train.eval_batches=0",
                            "checkpoint.every=3"])
    s = wait_until(lambda: (x := status(run_dir)) and all(w["ready"] for w in x["workers"].values()) and x, 180,
                   "all workers ready", proc)
    assert set(s["workers"]) == {"target.0", "drafter.0"}
    old_target = s["workers"]["target.0"]["pid"]
    res = ctl(run_dir, "restart", "target.0")
    assert res.returncode == 0, res.stderr
    s = wait_until(lambda: (x := status(run_dir)) and x["workers"]["target.0"]["ready"]
                   and x["workers"]["target.0"]["pid"] not in (None, old_target) and x, 120, "target.0 back", proc)
    step_after_target = s["step"]
    res = ctl(run_dir, "restart", "drafters")
    assert res.returncode == 0 and "drafter group restarting" in res.stdout, res.stdout + res.stderr
    wait_until(lambda: (x := status(run_dir)) and len(x["restarts"]) >= 2 and x["step"] > step_after_target, 180,
               "the drafter group back and training", proc)
    bad = ctl(run_dir, "restart", "target.7")
    assert bad.returncode == 1 and "no worker 'target.7'" in bad.stderr
    res = ctl(run_dir, "stop")
    assert res.returncode == 0
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "target.0 is back after" in out and "drafter group is back after" in out
    assert not (run_dir / "cluster.json").exists()


def test_launcher_sigkill_leaves_no_worker(tmp_path):
    run_dir = tmp_path / "run"
    shm_before = shm_entries()
    proc = launch(run_dir, ["cluster.drafters=[0, 1]", "train.max_steps=400", "train.eval_batches=0"])
    wait_until(lambda: (x := status(run_dir)) and all(w["ready"] for w in x["workers"].values()), 180,
               "all workers ready", proc)
    workers = descendants(proc.pid)
    assert len(workers) >= 3
    proc.kill()
    proc.wait(timeout=30)
    wait_until(lambda: not any(Path(f"/proc/{p}").exists() and _alive(p) for p in workers), 60,
               "every worker to exit after the launcher's SIGKILL")
    assert shm_entries() - shm_before == set()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# --------------------------------------------------------------------------- stop in every state

#: A random tiny Qwen3 target on a small generated dataset: workers start in seconds, steps take
#: milliseconds, and the run is long enough that it is always stopped before its end.
TINY = ["target.kind=random", "target.arch=tiny-qwen3", "target.arch_overrides={vocab_size: 151936}",
        "target.tokenizer=qwen3", "train.epochs=50", "train.max_steps=400", "train.eval_batches=0"]
#: Bound on a stop: from the request to the launcher's exit (s); generous for a loaded 2-core box.
STOP_BOUND_S = 150


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> list[str]:
    """Overrides for a 400-conversation JSONL dataset (and its own data cache)."""
    root = tmp_path_factory.mktemp("tiny-data")
    rows = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: how do I sort a list of {i} numbers in Python?"},
        {"from": "gpt", "value": "Use sorted(values) for a new list or values.sort() in place. " * (1 + i % 4)}]}
        for i in range(400)]
    (root / "conv.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [f"data.dataset={root / 'conv.jsonl'}", f"data.cache_dir={root / 'cache'}"]


def stopped(proc: subprocess.Popen, run_dir: Path, code: int, shm_before: set[str]) -> tuple[str, int, str]:
    """Wait (within :data:`STOP_BOUND_S`) for a stopped launcher; check its exit code, that no worker
    process and no shared memory of its workers is left, and that the checkpoint its last line
    names is whole. Returns ``(final | newest, step, output)``."""
    out = finish(proc, STOP_BOUND_S)
    assert proc.returncode == code, out[-5000:]
    pids = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", out)]
    assert pids and not [p for p in pids if _alive(p)], out[-3000:]
    assert not {e for e in shm_entries() - shm_before if "dflash" in e or any(str(p) in e for p in pids)}
    assert not (run_dir / "cluster.json").exists()
    m = re.search(r"(final|newest) checkpoint: (\S+) \(step (\d+)\)", out)
    assert m, out[-3000:]
    ckpt, step = Path(m.group(2)), int(m.group(3))
    assert checkpoint_problem(ckpt) is None and read_state(ckpt)["step"] == step
    return m.group(1), step, out


def test_stop_during_a_drafter_group_restart_then_during_start_up(tmp_path, tiny_data):
    """SIGKILL a drafter, then ``stop`` at once: the launcher wrote no checkpoint through the
    restarting group (it waited forever); now it ends at the checkpoint the group restarts from.
    Then ``--resume`` and SIGTERM twice while the workers start: it ends at once, at that checkpoint."""
    run_dir = tmp_path / "run"
    shm_before = shm_entries()
    extra = [*TINY, *tiny_data, "cluster.drafters=[0, 1]", "checkpoint.every=3"]
    proc = launch(run_dir, extra)
    s = wait_until(lambda: (x := status(run_dir)) and x["step"] >= 5 and x, 240, "step 5", proc)
    os.kill(s["workers"]["drafter.1"]["pid"], signal.SIGKILL)
    res = ctl(run_dir, "stop")
    assert res.returncode == 0, res.stderr
    kind, step, out = stopped(proc, run_dir, 0, shm_before)
    assert kind == "final" and step >= 3, out[-3000:]
    assert "drafter group restart (drafter.1 died)" in out or "drafter.1 exited while the run stops" in out

    proc = launch(run_dir, [*extra, "--resume"])
    wait_until(lambda: (run_dir / "cluster.json").is_file(), 240, "the workers to start", proc)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)  # a second one changes nothing
    kind2, step2, out = stopped(proc, run_dir, 128 + signal.SIGTERM, shm_before)
    assert "stopped (SIGTERM) before every worker was ready" in out, out[-3000:]
    assert (kind2, step2) == ("final", step)


@pytest.mark.parametrize("state", ["target restart", "evaluation and checkpoint writes"])
def test_stop_while_steps_are_in_flight(tmp_path, tiny_data, state):
    """``stop`` while a target restarts (twice: the second is answered and changes nothing), or
    while an evaluation and a checkpoint write are under way (a drafter is held with SIGSTOP
    until the stop is logged): the issued items finish and the final checkpoint holds the last step."""
    run_dir = tmp_path / "run"
    shm_before = shm_entries()
    if state == "target restart":
        extra = ["cluster.drafters=[0]", "checkpoint.every=3"]
    else:  # an evaluation after every step, a checkpoint at every step
        extra = ["cluster.drafters=[0, 1]", "checkpoint.every=1", "train.eval_every=1", "train.eval_batches=2"]
    proc = launch(run_dir, [*TINY, *tiny_data, *extra])
    s = wait_until(lambda: (x := status(run_dir)) and x["step"] >= 3 and x, 240, "step 3", proc)
    if state == "target restart":
        assert ctl(run_dir, "restart", "target.0").returncode == 0
        first, second = ctl(run_dir, "stop"), ctl(run_dir, "stop")
        assert first.returncode == 0, first.stderr
        if second.returncode == 0:  # answered by the stopping run
            assert second.stdout.startswith(("already stopping", "the run is ending")), second.stdout
        else:  # the run ended between the two commands: told so, nothing else happens
            assert second.returncode == 1 and "the run has ended" in second.stderr, second.stderr
    else:
        held = s["workers"]["drafter.1"]["pid"]
        os.kill(held, signal.SIGSTOP)
        try:
            assert ctl(run_dir, "stop").returncode == 0
            wait_until(lambda: "stop requested" in proc.log_path.read_text(), 60, "the stop to be logged", proc)
        finally:
            os.kill(held, signal.SIGCONT)
    kind, step, out = stopped(proc, run_dir, 0, shm_before)
    assert kind == "final" and step == max(train_losses(run_dir)), out[-3000:]
    after_stop = out.split("stop requested", 1)[1]
    if state == "target restart":
        assert "target.0 is back after" in out, out[-3000:]
    else:  # the evaluation in flight finished after the stop; the final checkpoint was not written twice
        assert "held-out eval" in after_stop and "writing the final checkpoint" not in after_stop, out[-3000:]


# --------------------------------------------------------------------------- a busy target


def test_target_busy_past_the_peer_timeout_recovers_with_exact_ledger(tmp_path, tiny_data):
    """The target's main thread sleeps past ``transport.peer_timeout_s`` before publishing one batch
    (test hook ``DFLASH_TEST_TARGET_STALL``): the drafter waiting for it drops the target's ring.
    The batches in flight to it must come back as lost and be re-assigned, the drafter must attach
    again, and the run must finish every step with each batch trained once (it used to hang with
    the batch's ring slot in flight forever)."""
    from dflash.config import load_config
    from dflash.training.factory import build_batch_plans
    from dflash.training.ledger_file import ledger_problems, ledger_view

    run_dir = tmp_path / "run"
    steps = 8
    extra = [*TINY, *tiny_data, "cluster.drafters=[0, 1]", f"train.max_steps={steps}", "checkpoint.every=3",
             "transport.heartbeat_s=0.25", "transport.peer_timeout_s=1.5"]
    proc = launch(run_dir, extra, env={"DFLASH_TEST_TARGET_STALL": "train:e0:4:a0=5"})
    out = finish(proc, 300)
    assert proc.returncode == 0, out[-6000:]
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert "sleeping 5.0 s before publishing train:e0:4:a0" in logs, logs[-3000:]
    assert "dropping its ring" in logs and "(silent: silent for more than 1.5 s)" in logs, logs[-3000:]
    assert "ledger:" not in out, out[-3000:]  # the launcher logs ledger problems, if any
    assert sorted(ledger_view(run_dir / "ledger.jsonl")) == list(range(steps))
    plans = build_batch_plans(load_config(CONFIG, [*SMALL, *extra]))
    assert ledger_problems(run_dir / "ledger.jsonl", [plans.train.num_batches(0)]) == []
    assert sorted(train_losses(run_dir)) == list(range(1, steps + 1))
