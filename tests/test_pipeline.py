"""End to end on CPU with the real SmolLM2 target and real ShareGPT, small shapes.

- the multi-process pipeline (separate target and drafter processes, shared-memory slots, gloo)
  gives the same per-step losses as the single-process reference trainer: 1 drafter to 1e-6
  (with the default objective and with per-conversation anchors + D-PACE weights; and the same
  held-out loss, τ and head τ), 2 drafters to the reference's doubled batch to 1e-5;
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
#: ``cluster.peak_tflops`` of the MFU checks (a CPU has no peak of its own)
PEAK_TFLOPS = 0.5

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
    return run_reference_small(extra, replicas, evaluate=False).losses


def run_reference_small(extra: list[str], replicas: int, evaluate: bool):
    from dflash.training.reference import run_reference

    torch.set_num_threads(1)  # as the drafter workers: same kernels, same rounding
    cfg = load_config(CONFIG, [*SMALL, *extra])
    return run_reference(cfg, "cpu", num_replicas=replicas, evaluate=evaluate)


def eval_rows(run_dir: Path) -> dict[int, dict]:
    """``{step: held-out evaluation record}`` of a run's ``metrics.jsonl``."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "eval/tau" in r}


@pytest.mark.parametrize("objective", [["drafter.loss_weighting=decay"],
                                       ["drafter.anchor_sampling=conversation", "drafter.anchors_per_conversation=3",
                                        "drafter.loss_weighting=dpace"],
                                       ["drafter.distillation=0.5", "drafter.loss_weighting=decay"]],
                         ids=["row+decay", "conversation+dpace", "row+distillation"])
def test_one_drafter_matches_reference(tmp_path, objective):
    extra = ["cluster.drafters=[0]", "train.eval_head_tokens=16", f"cluster.peak_tflops={PEAK_TFLOPS}", *objective]
    out = run_cluster(tmp_path / "run", extra)
    got = train_losses(tmp_path / "run")
    reference = run_reference_small(extra, 1, evaluate=True)
    ref = reference.losses
    assert sorted(got) == list(range(1, len(ref) + 1))
    for step, loss in enumerate(ref, start=1):
        assert got[step] == pytest.approx(loss, rel=1e-6, abs=1e-6), (step, got, ref)
    assert ref[0] > 0 and len(set(ref)) == len(ref)  # real, changing losses
    if objective:  # the option changes what is trained (same batches and anchors, another loss)
        base = [o for o in extra if o not in objective]
        assert reference_losses(base, 1)[0] != pytest.approx(ref[0], rel=1e-3)
    # held-out evaluation at the start and the end: the same sums through the drafter's report
    evals = eval_rows(tmp_path / "run")
    assert sorted(evals) == [e["step"] for e in reference.evals] == [0, len(ref)]
    for ev in reference.evals:
        row = evals[ev["step"]]
        assert 0 < ev["eval/head_blocks"] < ev["eval/blocks"], ev  # some anchors lie past the first 16 tokens
        assert 0 < ev["eval/walk_head_blocks"] < ev["eval/walk_blocks"], ev  # walked, the head walk cut at 16 tokens
        for key in ("eval/loss", "eval/tau", "eval/blocks", "eval/tau_head", "eval/head_blocks", "eval/tau_walk",
                    "eval/walk_blocks", "eval/tau_walk_head", "eval/walk_head_blocks"):
            assert row[key] == pytest.approx(ev[key], rel=1e-6, abs=1e-6), (key, row, ev)
    # MFU of both stages in every training row: the drafter's is the step's model FLOPs (the
    # reference trainer's count of the same step) over its step time and the configured peak
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
            if "train/loss" in r}
    for step, m in enumerate(reference.metrics, start=1):
        row = rows[step]
        assert m["flops"] > 0 and "mfu/target" in row
        assert row["mfu/drafter"] == pytest.approx(m["flops"] / row["time/step_s"] / (PEAK_TFLOPS * 1e12), rel=1e-6)
    target_mfu = [r["mfu/target"] for r in rows.values() if r["mfu/target"] is not None]
    assert target_mfu and all(0 < x < 1 for x in target_mfu), target_mfu  # null only in a window without a forward
    assert " mfu tgt " in out and " dft " in out  # the progress line
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
    from dflash.training.factory import build_batch_plans
    from dflash.data.schedule import StepPlan

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


class _Piecewise:
    """The learning rate of a run resumed at ``starts[i]`` with ``schedules[i]`` (an LRSchedule each)."""

    def __init__(self, starts, schedules):
        self.starts, self.schedules = starts, schedules
        self.lr = schedules[0].lr

    def factor(self, step):
        i = max(k for k, s in enumerate(self.starts) if s <= step)
        return self.schedules[i].factor(step)


def test_resume_with_other_drafter_counts_trains_every_batch_once(tmp_path):
    """2 drafters → resume at step 2 with 1 → resume at step 4 with 3 (later checkpoints deleted,
    as after a crash): the ledger's final view trains every batch of both epochs once, in order;
    the learning rate stays continuous (the schedule spread over the steps left); the losses equal
    a single-process run on the same batches with the same rates; metrics.jsonl holds each step
    once in its final view, with the rollbacks marked."""
    from dflash.training.factory import build_batch_plans
    from dflash.metrics import metrics_view
    from dflash.training.optim import LRSchedule
    from dflash.training.ledger_file import ledger_problems, ledger_view
    from dflash.data.schedule import StepPlan

    base = ["data.max_conversations=20", "train.epochs=2", "train.max_steps=null", "train.eval_batches=0",
            "checkpoint.every=2", "checkpoint.keep_last=10",
            "data.set_aside_parts=false"]  # 5 + 5 training batches (a held-out conversation's part would take one)
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"

    def drop_after(step):
        for ckpt in root.glob("step-*"):
            if int(ckpt.name[5:13]) > step:
                import shutil

                shutil.rmtree(ckpt)

    run_cluster(run_dir, [*base, "cluster.drafters=[0, 1]"])  # steps 0..5: (0,1) (2,3) (4,-) (0,1) (2,3) (4,-)
    drop_after(2)
    out = run_cluster(run_dir, [*base, "cluster.drafters=[0]"], "--resume")
    assert "resuming with 1 drafter(s) where the checkpoint was trained with 2" in out, out[-3000:]
    assert "LR schedule continued at step 2" in out, out[-3000:]
    drop_after(4)
    out = run_cluster(run_dir, [*base, "cluster.drafters=[0, 1, 2]"], "--resume")
    assert "resuming with 3 drafter(s) where the checkpoint was trained with 1" in out, out[-3000:]

    cfg = load_config(CONFIG, [*SMALL, *base])
    bpe = [build_batch_plans(cfg).train.num_batches(e) for e in range(2)]
    assert bpe == [5, 5]
    # the plan, by hand: 2 drafters for steps 0-1, 1 for steps 2-3, 3 for steps 4-5
    expected = [(0, [0, 1]), (0, [2, 3]), (0, [4]), (1, [0]), (1, [1, 2, 3]), (1, [4, None, None])]
    view = ledger_view(run_dir / "ledger.jsonl")
    assert [(r["epoch"], r["batches"]) for _, r in sorted(view.items())] == expected
    assert ledger_problems(run_dir / "ledger.jsonl", bpe) == []
    raw = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert sum("rollback" in r for r in raw) == 2 and sum("step" in r for r in raw) > len(expected)

    a = LRSchedule.nominal(StepPlan(bpe, 2).total_steps, cfg.train)  # 6 steps
    b = a.spread(2, 8)  # 1 drafter: the data ends at step 8
    c = b.spread(4, 6)  # 3 drafters: at step 6
    states = {s: json.loads((root / f"step-{s:08d}" / "state.json").read_text()) for s in (2, 4, 6)}
    assert [LRSchedule.from_dict(states[s]["schedule"]) for s in (2, 4, 6)] == [a, b, c]
    assert [states[s]["data_position"] for s in (2, 4, 6)] == [[0, 4], [1, 1], [2, 0]]
    assert [states[s]["num_drafters"] for s in (2, 4, 6)] == [2, 1, 3]

    rows = metrics_view(run_dir / "metrics.jsonl")
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5, 6]  # each step once
    raw_metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum("rollback" in r for r in raw_metrics) == 2
    schedule = _Piecewise([0, 2, 4], [a, b, c])
    rates = [r["train/lr"] for r in train_rows]
    assert rates == pytest.approx([schedule.lr * schedule.factor(s) for s in range(6)], rel=1e-6)
    assert rates[2] == pytest.approx(a.rate(2), rel=1e-12) and rates[4] == pytest.approx(b.rate(4), rel=1e-12)

    from dflash.training.reference import run_reference

    torch.set_num_threads(1)
    ref = run_reference(cfg, "cpu", evaluate=False, assignments=expected, schedule=schedule)
    for row, loss in zip(train_rows, ref.losses):
        assert row["train/loss"] == pytest.approx(loss, rel=1e-5, abs=1e-5), (row["step"], train_rows, ref.losses)
    assert len(set(ref.losses)) == len(ref.losses)
