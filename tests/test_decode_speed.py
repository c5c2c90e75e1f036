"""``scripts/decode_speed.py`` at regeneration's shape of batch: one prompt length, target-only.

The script times random-weight decoding; here only its options and its report are checked on CPU
(the speed figures are the GPU benchmark's): ``--prompt-step 0`` gives prompts of one length,
``--target-only`` skips the speculative pass, and every timed batch splits into prefill and decoding.
"""

from __future__ import annotations

import json

import pytest
import torch

from scripts import decode_speed


def test_target_only_batch_of_one_length_reports_prefill_and_decoding(tmp_path):
    out = tmp_path / "speed"
    code = decode_speed.main(["--device", "cpu", "--dtype", "float32", "--prompts", "4", "--batch", "2",
                              "--prompt-tokens", "12", "--prompt-step", "0", "--new-tokens", "3",
                              "--target-only", "--modes", "eager", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "speed-float32-b2.json").read_text())
    assert report["prompt_tokens"] == 12 and report["prompt_step"] == 0
    row = report["eager"]
    assert set(row) == {"greedy"}  # no speculative pass
    greedy = row["greedy"]
    assert greedy["prefill_s"] > 0 and greedy["decode_s"] > 0
    assert greedy["prefill_s"] + greedy["decode_s"] <= greedy["seconds"] + 1e-6
    assert 0 < greedy["enqueue_s"] <= greedy["decode_s"]
    assert "speculative_equals_greedy_eager" not in report


@pytest.mark.parametrize("argv, needle", [
    (["--prompt-step", "-1"], "--prompt-step: must be >= 0"),
    (["--prompts", "3", "--prompt-tokens", "10", "--prompt-step", "5"], "or a smaller --prompt-step"),
])
def test_bad_prompt_shapes_are_refused_before_any_model_loads(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        decode_speed.main(["--device", "cpu"] + argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_kernel_table_takes_the_prefill_profile_away():
    """Per-unit kernel counts and times after subtracting another profile, against a naive count."""
    import random
    from types import SimpleNamespace

    cuda = torch.autograd.DeviceType.CUDA

    def fake(events):
        cpu = SimpleNamespace(name="cpu op", device_time=99.0, device_type=torch.autograd.DeviceType.CPU)
        return SimpleNamespace(events=lambda: [SimpleNamespace(name=n, device_time=t, device_type=cuda)
                                               for n, t in events] + [cpu])

    rng = random.Random(0)
    names = ["gemm", "softmax", "norm", "argmax"]
    prefill = [(rng.choice(names[:3]), rng.uniform(1, 9)) for _ in range(20)]
    passes = [(rng.choice(names), rng.uniform(1, 9)) for _ in range(70)]
    table = decode_speed.kernel_table(fake(prefill + passes), 7, "pass", minus=fake(prefill))
    assert table["kernels_per_pass"] == pytest.approx(70 / 7)
    assert table["kernel_us_per_pass"] == pytest.approx(sum(t for _, t in passes) / 7)
    for row in table["top"]:
        mine = [t for n, t in passes if n == row["name"]]
        assert row["per_pass"] == pytest.approx(len(mine) / 7) and row["us_per_pass"] == pytest.approx(sum(mine) / 7)
