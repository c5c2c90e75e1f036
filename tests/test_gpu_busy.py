"""GpuBusySampler (benchmarks/gpu_busy.py) against a fake nvidia-smi, and without one."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from benchmarks.gpu_busy import GpuBusySampler

#: Bound on a wait for the fake tool's output (s): generous for a loaded machine.
WAIT_S = 60.0


def wait_for_rows(sampler: GpuBusySampler, pred, what: str) -> None:
    """Poll the sampler's rows (bounded by :data:`WAIT_S`) until ``pred(rows)`` holds."""
    deadline = time.monotonic() + WAIT_S
    while not pred(sampler.timeline()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)  # polling the reader thread's rows, bounded by the deadline

FAKE = """#!/bin/sh
# prints two GPUs every ~20 ms: GPU 0 at 100 %, GPU 1 at 50 %, plus a line to ignore
while true; do
  ts=$(date '+%Y/%m/%d %H:%M:%S.%N' | cut -c1-23)
  echo "$ts, 0, 100"
  echo "$ts, 1, 50"
  echo "$ts, 2, [N/A]"
  sleep 0.02
done
"""


def _fake(tmp_path: Path) -> str:
    exe = tmp_path / "nvidia-smi"
    exe.write_text(FAKE)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def test_fake_nvidia_smi(tmp_path):
    with GpuBusySampler(interval_ms=20, nvidia_smi=_fake(tmp_path)) as s:
        wait_for_rows(s, lambda rows: sum(i == 0 for _, i, _ in rows) >= 3, "3 samples of GPU 0")
    r = s.result
    assert r.available, r
    assert r.busy[0] == 1.0 and abs(r.busy[1] - 0.5) < 1e-9 and 2 not in r.busy
    assert r.samples[0] >= 3 and r.seconds > 0
    d = r.to_dict()
    assert d["busy"] == {"0": 1.0, "1": 0.5}


def test_window_and_gpu_filter(tmp_path):
    s = GpuBusySampler(interval_ms=20, gpus=[1], nvidia_smi=_fake(tmp_path)).start()
    wait_for_rows(s, bool, "a first sample")
    t0 = time.time()
    wait_for_rows(s, lambda rows: any(t > t0 and i == 1 for t, i, _ in rows), "a sample of GPU 1 after t0")
    t1 = time.time()
    r = s.stop(window=(t0, t1))
    assert r.available and list(r.busy) == [1] and abs(r.seconds - (t1 - t0)) < 1e-6
    assert s.busy_between(t0, t0 + 1e-4).available  # shorter than a sample: nearest one


def test_unavailable():
    with GpuBusySampler(nvidia_smi="no-such-nvidia-smi-here") as s:
        pass
    assert not s.result.available and "not found" in s.result.reason
    assert s.result.to_dict()["busy"] == {}


def test_failing_tool(tmp_path):
    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    with GpuBusySampler(nvidia_smi=str(exe)) as s:
        s._proc.wait(timeout=WAIT_S)  # the tool has failed (its message is written) before the sampler stops
    assert not s.result.available and "NVIDIA-SMI has failed" in s.result.reason, s.result
    assert os.path.exists(exe)
