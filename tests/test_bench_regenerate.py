"""``benchmarks/bench_regenerate.py`` on CPU: a small run through both caches writes each
attention's timings per width, and bad flags exit 2 naming the flag before any model is built."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_regenerate as bench

SMALL = ["--device", "cpu", "--widths", "9", "--batch", "2", "--new-tokens", "3", "--repeats", "1",
         "--max-prompt-tokens", "600"]


def test_small_run_times_each_width_and_cache(tmp_path):
    assert bench.main([*SMALL, "--widths", "9,520", "--attentions", "sdpa,flex", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "bench_regenerate.json").read_text())
    assert list(res["attentions"]) == ["sdpa", "flex"]
    assert set(res["attentions"]["sdpa"]["warmup_s"]) == {"short", "long"}  # 9 tokens: short cache; 520: long
    assert set(res["attentions"]["flex"]["warmup_s"]) == {"short"}  # flex: one cache, as regeneration gives it
    for row in res["attentions"].values():
        for width in ("9", "520"):
            t = row["widths"][width]
            assert t["wall_s"] + 0.002 >= t["prefill_s"] + t["decode_s"] > 0  # each rounded to 1 ms
            assert t["ms_per_step"] == pytest.approx(1e3 * t["decode_s"] / 2, abs=0.3)  # decode_s rounded to 1 ms
            assert t["new_tok_s"] == pytest.approx(2 * 3 / t["wall_s"], rel=0.01, abs=0.06)  # rounded to 0.1


def test_one_cache_warms_once(tmp_path):
    assert bench.main([*SMALL, "--widths", "9,520", "--one-cache", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "bench_regenerate.json").read_text())
    assert list(res["attentions"]["sdpa"]["warmup_s"]) == ["short"] and res["one_cache"] is True


@pytest.mark.parametrize("extra, message", [
    (["--widths", "0,5"], "--widths: expected comma-separated whole numbers >= 1"),
    (["--widths", "700"], "--widths [700]: must be below --max-prompt-tokens 600"),
    (["--attentions", "sdpa,cudnn"], "--attentions: one of"),
    (["--attentions", ","], "--attentions: name at least one attention spec"),
    (["--device", "tpu"], "--device: invalid choice"),
    (["--batch", "0"], "--batch: must be >= 1, got 0"),
])
def test_bad_flags_exit_2(extra, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main([*SMALL, *extra])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
