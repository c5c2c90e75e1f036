"""benchmarks/bench_pipeline.py on the CPU with a tiny random target: threaded and sequential runs
write sane JSON, train the same losses, and a failing thread is reported instead of hanging."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STEPS = 3


def _dataset(path: Path) -> Path:
    rows = []
    for i in range(24):
        rows.append({"id": f"c{i}", "conversations": [
            {"from": "human", "value": f"Question {i}: how do I sort a list of {i} numbers in Python?"},
            {"from": "gpt", "value": "Use sorted(values) for a new list or values.sort() in place. " * (1 + i % 4)},
        ]})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_pipeline")
    overrides = [
        "target.arch=tiny-qwen3", "target.arch_overrides={vocab_size: 151936}", "target.tokenizer=qwen3",
        f"data.dataset={_dataset(tmp / 'conv.jsonl')}", f"data.cache_dir={tmp / 'cache'}", "data.max_length=128",
        "data.token_budget=256", "data.heldout_conversations=2", "drafter.num_layers=1", "drafter.block_size=4",
        "drafter.anchors_per_row=8",
    ]
    return tmp, overrides


def _run(tmp: Path, overrides: list[str], mode: str, *extra: str) -> tuple[int, dict, str]:
    out = tmp / f"{mode}{'-'.join(extra)}.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("OUT", None)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_pipeline", "--mode", mode, "--steps", str(STEPS), "--cpu-threads", "1", "--json", str(out),
         "--config", str(REPO / "configs" / "h200-2gpu.yaml"), "--timeout-s", "100", *extra, *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    result = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, result, proc.stdout + proc.stderr


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def runs(setup):
    tmp, overrides = setup
    return {mode: _run(tmp, overrides, mode) for mode in ("sequential", "threaded")}


@pytest.mark.parametrize("mode", ["sequential", "threaded"])
def test_json_fields(runs, mode):
    rc, r, log = runs[mode]
    assert rc == 0, log[-3000:]
    assert r["status"] == "ok" and r["mode"] == mode and r["devices"] == {"target": "cpu", "drafter": "cpu"}
    assert r["steps"] == STEPS and r["steady_steps"] == STEPS - r["warmup_steps"] >= 1
    for key in ("wall_s", "steady_s_per_step", "target_tokens_per_s", "drafter_tokens_per_s",
                "drafter_block_tokens_per_s", "peak_tflops"):
        assert _positive(r[key]), (key, r[key])
    assert r["steady_s_per_step"] * r["steady_steps"] <= r["wall_s"] + 1e-6
    split = r["time_split"]
    assert _positive(split["target_forward_s"]) and _positive(split["drafter_step_s"])
    if mode == "threaded":
        assert split["target_queue_put_wait_s"] >= 0 and split["drafter_queue_get_wait_s"] >= 0
    else:  # one thread: a step is the target forward plus the drafter step
        total = split["target_forward_s"] + split["drafter_step_s"]
        assert abs(total - r["steady_s_per_step"]) < 0.05 * r["steady_s_per_step"] + 0.01
    flops = r["flops_per_step"]
    assert _positive(flops["target_forward"]) and _positive(flops["drafter_step"])
    # the parts of dflash.models.flops, the count the training metrics use
    t, d = flops["target_detail"], flops["drafter_detail"]
    assert t["flops"] == t["linear"] + t["attention"] + t["linear_attention"] + t["lm_head"]
    assert d["flops"] == d["fc"] + d["layers"] + d["attention"] + d["lm_head"] and d["attention"] > 0
    for key in ("target_forward", "drafter_step", "pipeline"):
        assert _positive(r["mfu"][key]), (key, r["mfu"])
    assert "real (non-padding)" in r["tokens_definition"]["drafter_tokens_per_s"]
    assert r["gpu_busy"]["available"] is False
    assert len(r["losses"]) == STEPS and all(math.isfinite(x) for x in r["losses"])
    assert "| " + mode + " |" in log  # the markdown row


def test_threaded_trains_what_sequential_trains(runs):
    seq, thr = runs["sequential"][1]["losses"], runs["threaded"][1]["losses"]
    assert thr == pytest.approx(seq, rel=1e-5)


def test_failing_thread_is_reported(setup):
    tmp, overrides = setup
    rc, r, log = _run(tmp, overrides, "threaded", "--fail-in", "drafter")
    assert rc == 1, log[-3000:]
    assert r["status"] == "error"
    err = r["error"]
    assert err["stage"] == "drafter" and err["type"] == "RuntimeError" and "injected" in err["message"]
    assert err["where"] and err["step"] == 0 and err["warmup"] is True


def test_distillation_runs_through_both_designs(setup, runs):
    """With ``drafter.distillation`` the stages hand the target's final hidden state over too: both
    designs train, to the same losses, and differ from the cross-entropy-only run."""
    tmp, overrides = setup
    got = {}
    for mode in ("sequential", "threaded"):
        rc, r, log = _run(tmp, [*overrides, "drafter.distillation=0.5"], mode)
        assert rc == 0 and r["status"] == "ok", log[-3000:]
        got[mode] = r["losses"]
    assert got["threaded"] == pytest.approx(got["sequential"], rel=1e-5)
    assert len(got["sequential"]) == STEPS and all(_positive(x) for x in got["sequential"])
    assert got["sequential"][0] != pytest.approx(runs["sequential"][1]["losses"][0], rel=1e-3)
