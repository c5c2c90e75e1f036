"""The reference deployment's layout end to end on CPU: ``configs/qwen3.6-27b-8xgpu.yaml`` (5 targets,
3 drafters) with its target shrunk to the ``tiny-qwen3.6`` hybrid shape, run as 5 target processes
and 3 drafter processes (gloo, shared-memory slots).

- the per-step training losses equal the single-process reference trainer's over the same 3
  batches a step (to 1e-5), and they are real, changing losses;
- every worker's log lines carry its name, and each of the 5 targets computed some of the batches
  (the launcher assigns work across all of them, not just the first).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from dflash.config import load_config
from dflash.training.reference import run_reference
from tests.test_pipeline import ROOT, RUN_TIMEOUT_S, _env, train_losses

CONFIG = ROOT / "configs" / "qwen3.6-27b-8xgpu.yaml"
TARGETS, DRAFTERS, STEPS = 5, 3, 4
MASK_TOKEN_ID = 248070  # the config's, kept: it must be an embedding row of the shrunk target
SMALL = [
    "cluster.device=cpu", "transport.carrier=shm", "cluster.cpu_threads_per_target=1",
    "cluster.cpu_threads_per_drafter=1", "transport.heartbeat_s=0.5",
    # tiny-qwen3.6 has 512 embedding rows: the launcher would refuse the config's qwen3.6 tokenizer
    # (248077 tokens) and 248070 would be no row. The real model's 248320 rows admit both, so the
    # tokenizer and the mask token stay the config's; the rest of the shape stays tiny.
    "target.arch=tiny-qwen3.6", "target.arch_overrides={vocab_size: 248320}",
    # the config's drafter features (sliding + full attention, gradient checkpointing with MLP
    # slices) at toy size; hidden sizes follow the target (64, intermediate 128)
    "drafter.num_layers=2", "drafter.layer_types=[sliding_attention, full_attention]", "drafter.sliding_window=16",
    "drafter.block_size=4", "drafter.anchors_per_row=4", "drafter.mlp_chunks=2",
    "data.max_conversations=60", "data.max_length=64", "data.token_budget=128", "data.heldout_conversations=4",
    f"train.max_steps={STEPS}", "train.eval_batches=0", "train.eval_every=0",
    "log.wandb=disabled", "checkpoint.every=0",
]

pytestmark = pytest.mark.slow


def test_five_targets_three_drafters_match_reference(tmp_path):
    cfg = load_config(CONFIG, SMALL)
    assert (len(cfg.cluster.targets), len(cfg.cluster.drafters)) == (TARGETS, DRAFTERS)
    assert cfg.target.tokenizer == "qwen3.6" and cfg.drafter.mask_token_id == MASK_TOKEN_ID

    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "launch.cluster", "--config", str(CONFIG), *SMALL,
                           f"run_dir={run_dir}"], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=RUN_TIMEOUT_S)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    assert f"all {TARGETS} target(s) and {DRAFTERS} drafter(s) ready" in out, out[-4000:]
    assert f"mask token {MASK_TOKEN_ID}" in out, out[-4000:]

    got = train_losses(run_dir)
    torch.set_num_threads(1)  # as the drafter workers: same kernels, same rounding
    ref = run_reference(cfg, "cpu", num_replicas=DRAFTERS, evaluate=False).losses
    assert len(ref) == STEPS and sorted(got) == list(range(1, STEPS + 1)), (got, ref)
    for step, loss in enumerate(ref, start=1):
        assert got[step] == pytest.approx(loss, rel=1e-5, abs=1e-5), (step, got, ref)
    assert min(ref) > 0 and len(set(ref)) == len(ref), ref  # real, changing losses

    # every log line of a worker names it
    for name in [f"target.{r}" for r in range(TARGETS)] + [f"drafter.{r}" for r in range(DRAFTERS)]:
        assert f"[{name}]" in out, name
    # each target's closing line counts its batches: all 5 worked, and together they computed each
    # step's 3 batches once
    produced = {int(r): int(n) for r, n in
                re.findall(r"\[target\.(\d+)\] dflash\.runtime\.target: stop \(done\): (\d+) batches produced", out)}
    assert sorted(produced) == list(range(TARGETS)), out[-4000:]
    assert all(n >= 1 for n in produced.values()) and sum(produced.values()) == STEPS * DRAFTERS, produced
