"""``benchmarks/bench_drafter_memory.py`` on CPU: a smoke run at a tiny shape writes its result
under a name that tells the settings apart, and bad flags exit 2 naming the flag before any model
is built."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import bench_drafter_memory as bench

TINY = ["--device", "cpu", "--arch", "tiny-qwen3.6", "--drafter-layers", "2", "--rows", "1", "--seq", "64",
        "--anchors", "4", "--block", "4", "--steps", "2", "--mask-token-id", "500"]


def test_tiny_distillation_run_on_cpu(tmp_path):
    assert bench.main([*TINY, "--distillation", "0.5", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.iterdir()
    assert path.name == "drafter_memory_eager_c1_kd0.5.json"
    assert all(math.isfinite(x) and x > 0 for x in json.loads(path.read_text())["losses"])


def test_tiny_run_on_cpu_writes_a_named_result(tmp_path, capsys):
    assert bench.main([*TINY, "--gradient-checkpointing", "--checkpoint-layers", "1", "--loss-chunk", "7",
                       "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.iterdir()
    assert path.name == "drafter_memory_eager_c1_ckpt1_lc7.json"
    res = json.loads(path.read_text())
    assert res["steps_run"] == 2 and res["loss_chunk"] == 7
    assert all(math.isfinite(x) and x > 0 for x in res["losses"])
    assert "| eager | ckpt first 1 layer(s) | mlp_chunks 1 | loss_chunk 7 |" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--loss-chunk", "0"], "--loss-chunk: must be >= 1, got 0"),
    (["--steps", "0"], "--steps: must be >= 1, got 0"),
    (["--block", "1"], "--block: must be >= 2, got 1"),
    (["--memory-fraction", "1.5"], "--memory-fraction: must be in (0, 1], got 1.5"),
    (["--distillation", "2"], "--distillation (drafter.distillation: must be in [0, 1], got 2.0)"),
    (["--checkpoint-layers", "1"], "--checkpoint-layers (drafter.checkpoint_layers: applies only with"),
    (["--gradient-checkpointing", "--checkpoint-layers", "3"], "--checkpoint-layers (drafter.checkpoint_layers: must be"),
    (["--activation-memory-budget", "0.5"], "--activation-memory-budget (drafter.activation_memory_budget: applies"),
    (["--mask-token-id", "512"], "--mask-token-id (drafter.mask_token_id: 512 is not a row of tiny-qwen3.6's 512-row"),
    (["--arch", "nosuch"], "--arch (target.arch: unknown architecture 'nosuch'"),
    (["--device", "cuda:1"], "--device: cuda (GPU 0) or cpu"),
])
def test_bad_flags_exit_2_naming_the_flag(extra, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main([*TINY, *extra, "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
