"""End to end on CPU with the real SmolLM2 target and real ShareGPT, small shapes.

- the multi-process pipeline (separate target and drafter processes, shared-memory slots, gloo)
  gives the same per-step losses as the single-process reference trainer: 1 drafter to 1e-6,
  2 drafters to the reference's doubled batch to 1e-5;
- a run stopped with SIGTERM writes a final checkpoint, and ``--resume`` continues it with the
  losses of an uninterrupted run;
- a bad config fails before any worker starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash.config import load_config

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "smollm2-135m-cpu.yaml"
SMALL = ["data.max_conversations=400", "data.max_length=96", "data.token_budget=192", "data.heldout_conversations=8",
         "drafter.anchors_per_row=8", "drafter.block_size=4", "train.max_steps=5", "train.eval_batches=1",
         "train.eval_every=0", "log.wandb=disabled", "checkpoint.every=0", "transport.heartbeat_s=0.5",
         "cluster.cpu_threads_per_target=1"]
RUN_TIMEOUT_S = 300

pytestmark = pytest.mark.slow


def _env() -> dict:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def launch(run_dir: Path, extra: list[str], *args: str, new_session: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "launch.cluster", "--config", str(CONFIG), *args, *SMALL, *extra,
           f"run_dir={run_dir}"]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=new_session)


def run_cluster(run_dir: Path, extra: list[str], *args: str) -> str:
    proc = launch(run_dir, extra, *args)
    out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, out[-4000:]
    return out


def train_losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "train/loss" in row:
            out[row["step"]] = row["train/loss"]
    return out


def reference_losses(extra: list[str], replicas: int) -> list[float]:
    from dflash.reference import run_reference

    torch.set_num_threads(1)  # as the drafter workers: same kernels, same rounding
    cfg = load_config(CONFIG, [*SMALL, *extra])
    return run_reference(cfg, "cpu", num_replicas=replicas, evaluate=False).losses


def test_one_drafter_matches_reference(tmp_path):
    extra = ["cluster.drafters=[0]"]
    out = run_cluster(tmp_path / "run", extra)
    got = train_losses(tmp_path / "run")
    ref = reference_losses(extra, 1)
    assert sorted(got) == list(range(1, len(ref) + 1))
    for step, loss in enumerate(ref, start=1):
        assert got[step] == pytest.approx(loss, rel=1e-6, abs=1e-6), (step, got, ref)
    assert ref[0] > 0 and len(set(ref)) == len(ref)  # real, changing losses
    # every log line of a worker names it
    assert "[target.0]" in out and "[drafter.0]" in out
    assert (tmp_path / "run" / "checkpoints" / "step-00000005" / "drafter" / "model.safetensors").is_file()


def test_two_drafters_match_reference_doubled_batch(tmp_path):
    extra = ["cluster.drafters=[0, 1]"]
    run_cluster(tmp_path / "run", extra)
    got = train_losses(tmp_path / "run")
    ref = reference_losses(extra, 2)
    assert sorted(got) == list(range(1, len(ref) + 1))
    for step, loss in enumerate(ref, start=1):
        assert got[step] == pytest.approx(loss, rel=1e-5, abs=1e-5), (step, got, ref)
    # each step's "tokens" counts both ranks' batches (real tokens, from the batch plan)
    from dflash.factory import build_batch_plans
    from dflash.schedule import StepPlan

    cfg = load_config(CONFIG, [*SMALL, *extra])
    plans = build_batch_plans(cfg)
    plan = StepPlan([plans.train.num_batches(e) for e in range(cfg.train.epochs)], 2, cfg.train.max_steps)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    tokens = {r["step"]: r["tokens"] for r in rows if "train/loss" in r}
    for step, n in tokens.items():
        a = plan.assignment(step - 1)
        assert n == sum(plans.train.batch(a.epoch, b).num_tokens for b in a.batch_ids if b is not None), step


def test_group_sigterm_checkpoint_then_resume_matches_uninterrupted(tmp_path):
    extra = ["cluster.drafters=[0]", "train.max_steps=8", "train.eval_batches=0"]
    run_dir = tmp_path / "run"
    proc = launch(run_dir, extra, new_session=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(train_losses(run_dir)) >= 2:
            break
        time.sleep(0.2)  # polling a file written by another process; the run itself is not timed
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    # to the launcher's whole process group, as `timeout`, Ctrl-C or a batch scheduler signal it:
    # the workers (each in its own session) must not see it; the launcher stops the run gracefully
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 128 + signal.SIGTERM, out[-4000:]  # stopped by the signal, checkpoint written
    assert "Traceback" not in out, out[-4000:]
    first = train_losses(run_dir)
    stopped_at = max(first)
    assert 2 <= stopped_at < 8, out[-3000:]
    assert f"checkpoint at step {stopped_at}" in out
    # resume: the remaining steps, and a refusal without --resume
    refused = subprocess.run([sys.executable, "-m", "launch.cluster", "--config", str(CONFIG), *SMALL, *extra,
                              f"run_dir={run_dir}"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                             timeout=RUN_TIMEOUT_S)
    assert refused.returncode == 2 and "--resume" in refused.stderr
    run_cluster(run_dir, extra, "--resume")
    resumed = train_losses(run_dir)
    assert sorted(resumed) == list(range(1, 9))
    ref = reference_losses(extra, 1)
    for step, loss in enumerate(ref, start=1):
        assert resumed[step] == pytest.approx(loss, rel=1e-6, abs=1e-6), (step, stopped_at, resumed, ref)


def test_resume_past_a_damaged_newest_checkpoint(tmp_path):
    """--resume finds the newest checkpoint truncated (say, a copy that ran out of disk), moves it
    aside and goes on from the previous one: the same losses as an uninterrupted run."""
    extra = ["cluster.drafters=[0]", "train.max_steps=4", "checkpoint.every=2", "train.eval_batches=0"]
    run_dir = tmp_path / "run"
    run_cluster(run_dir, extra)
    root = run_dir / "checkpoints"
    weights = root / "step-00000004" / "drafter" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    out = run_cluster(run_dir, extra, "--resume")
    assert "Traceback" not in out, out[-4000:]
    assert "step-00000004 is damaged" in out and "moved aside to step-00000004.damaged" in out, out[-4000:]
    assert "incomplete metadata" in (root / "step-00000004.damaged" / "DAMAGED.txt").read_text()
    assert json.loads((root / "step-00000004" / "state.json").read_text())["step"] == 4  # written again
    resumed = train_losses(run_dir)
    ref = reference_losses(extra, 1)
    assert sorted(resumed) == [1, 2, 3, 4]
    for step, loss in enumerate(ref, start=1):
        assert resumed[step] == pytest.approx(loss, rel=1e-6, abs=1e-6), (step, resumed, ref)


def test_bad_config_fails_before_workers_start(tmp_path):
    res = subprocess.run([sys.executable, "-m", "launch.cluster", "--config", str(CONFIG), "drafter.block_size=1",
                          f"run_dir={tmp_path / 'run'}"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2
    assert "drafter.block_size: must be >= 2" in res.stderr
    assert not (tmp_path / "run").exists()
