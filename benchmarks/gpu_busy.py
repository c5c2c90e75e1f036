"""Per-GPU busy fraction sampled with ``nvidia-smi`` in a background process.

``utilization.gpu`` is the percentage of the driver's last sample period during which at least
one kernel was running on the GPU, so its mean over a window is the fraction of that window the
GPU was busy (not how much of the GPU each kernel used: one small kernel at a time reads 100 %).

    from benchmarks.gpu_busy import GpuBusySampler

    with GpuBusySampler(interval_ms=100) as sampler:   # nvidia-smi ... -lms 100 runs meanwhile
        do_work()
    res = sampler.result                  # BusyResult
    res.available                         # False on a machine without nvidia-smi / GPUs
    res.busy                              # {nvidia-smi index: mean busy fraction in [0, 1]}
    res.samples                           # {index: number of samples averaged}
    res.to_dict()                         # JSON-ready

    # or over a sub-window of a longer sampling (host ``time.time()`` seconds):
    sampler = GpuBusySampler().start(); ...; t0 = time.time(); ...; t1 = time.time(); ...
    res = sampler.stop(window=(t0, t1))
    sampler.busy_between(t0, t1)          # another window of the same samples

Samples are time-stamped by ``nvidia-smi`` itself (``timestamp`` column, wall clock with
milliseconds), so pipe buffering does not shift them. nvidia-smi numbers GPUs by PCI bus order,
ignoring ``CUDA_VISIBLE_DEVICES``; :func:`smi_index` maps a torch device ordinal to that index.

Run as a module for a quick look: ``python -m benchmarks.gpu_busy [seconds]``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Optional, Sequence

__all__ = ["BusyResult", "GpuBusySampler", "smi_index"]

QUERY = "timestamp,index,utilization.gpu"
_TS_FORMATS = ("%Y/%m/%d %H:%M:%S.%f", "%Y/%m/%d %H:%M:%S")


@dataclass
class BusyResult:
    """Mean busy fraction per GPU over a window; ``available=False`` (with ``reason``) when none."""

    available: bool
    #: nvidia-smi GPU index -> mean of ``utilization.gpu / 100`` over the window's samples.
    busy: dict[int, float] = field(default_factory=dict)
    #: nvidia-smi GPU index -> samples averaged.
    samples: dict[int, int] = field(default_factory=dict)
    #: Window length in seconds (host clock).
    seconds: float = 0.0
    interval_ms: int = 100
    reason: Optional[str] = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["busy"] = {str(k): round(v, 4) for k, v in self.busy.items()}
        d["samples"] = {str(k): v for k, v in self.samples.items()}
        return d

    def of(self, index: int) -> Optional[float]:
        """Busy fraction of nvidia-smi GPU ``index`` (``None`` when unavailable / not sampled)."""
        return self.busy.get(index)


def _parse_ts(text: str) -> Optional[float]:
    for fmt in _TS_FORMATS:
        try:
            return datetime.strptime(text.strip(), fmt).timestamp()
        except ValueError:
            continue
    return None


def smi_index(ordinal: int) -> int:
    """The nvidia-smi index of torch CUDA device ``ordinal``.

    Matches the device UUID when torch and nvidia-smi report it; else reads ``CUDA_VISIBLE_DEVICES``
    when it lists integers; else ``ordinal`` itself.
    """
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(ordinal).uuid)
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        for line in out.stdout.splitlines():
            idx, _, smi_uuid = (p.strip() for p in line.partition(","))
            if smi_uuid.replace("GPU-", "") == uuid.replace("GPU-", ""):
                return int(idx)
    except Exception:  # noqa: BLE001 - no torch/CUDA/nvidia-smi: fall through
        pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    parts = [p.strip() for p in visible.split(",") if p.strip()]
    if parts and all(p.isdigit() for p in parts) and ordinal < len(parts):
        return int(parts[ordinal])
    return ordinal


class GpuBusySampler:
    """Samples ``nvidia-smi --query-gpu=timestamp,index,utilization.gpu -lms <interval>`` until stopped.

    Args:
        interval_ms: nvidia-smi's loop interval.
        gpus: nvidia-smi indices to keep (``None`` = all).
        nvidia_smi: the executable (a path or a name on ``PATH``).

    Never raises for a missing tool or a failing GPU query: the result is then
    ``BusyResult(available=False, reason=...)``.
    """

    def __init__(self, interval_ms: int = 100, gpus: Optional[Sequence[int]] = None,
                 nvidia_smi: str = "nvidia-smi") -> None:
        self.interval_ms = int(interval_ms)
        self.gpus = None if gpus is None else {int(g) for g in gpus}
        self.nvidia_smi = nvidia_smi
        self.result: Optional[BusyResult] = None
        self._proc: Optional[subprocess.Popen] = None
        self._reader: Optional[threading.Thread] = None
        self._rows: list[tuple[float, int, float]] = []  # (time, index, fraction)
        self._lock = threading.Lock()
        self._error: Optional[str] = None
        self._t0 = self._t1 = 0.0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "GpuBusySampler":
        self._rows.clear()
        self.result = None
        self._error = None
        self._t0 = time.time()
        exe = shutil.which(self.nvidia_smi)
        if exe is None:
            self._error = f"{self.nvidia_smi} not found"
            return self
        cmd = [exe, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)]
        stdbuf = shutil.which("stdbuf")
        if stdbuf:
            cmd = [stdbuf, "-oL"] + cmd
        try:
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          bufsize=1)
        except OSError as exc:
            self._error = f"cannot start {self.nvidia_smi}: {exc}"
            return self
        self._reader = threading.Thread(target=self._read, name="gpu-busy-reader", daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            now = time.time()
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 3:
                continue
            try:
                idx, util = int(parts[1]), float(parts[2])
            except ValueError:  # "[N/A]", "[Not Supported]", errors
                continue
            ts = _parse_ts(parts[0])
            with self._lock:
                self._rows.append((ts if ts is not None else now, idx, util / 100.0))

    def stop(self, window: Optional[tuple[float, float]] = None) -> BusyResult:
        """Stop sampling; the result over ``window`` (``time.time()`` seconds), default start..stop."""
        self._t1 = time.time()
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
            try:
                _, err = self._proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                _, err = self._proc.communicate()
            if self._reader is not None:
                self._reader.join(timeout=5)
            if not self._rows and self._error is None:
                msg = (err or "").strip().splitlines()
                self._error = (f"{self.nvidia_smi} gave no samples (exit {self._proc.returncode})"
                               + (f": {msg[0]}" if msg else ""))
            self._proc = None
        self.result = self.busy_between(*(window or (self._t0, self._t1)))
        return self.result

    def __enter__(self) -> "GpuBusySampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ results
    def busy_between(self, t0: float, t1: float) -> BusyResult:
        """Mean busy fraction per GPU over the samples stamped in ``[t0, t1]``.

        A window shorter than the sample interval that caught no sample takes the nearest sample
        of each GPU instead.
        """
        if self._error is not None:
            return BusyResult(False, seconds=t1 - t0, interval_ms=self.interval_ms, reason=self._error)
        with self._lock:
            rows = [r for r in self._rows if self.gpus is None or r[1] in self.gpus]
        if not rows:
            return BusyResult(False, seconds=t1 - t0, interval_ms=self.interval_ms, reason="no samples")
        inside = [r for r in rows if t0 <= r[0] <= t1]
        if not inside:  # short window: nearest sample of each GPU
            nearest: dict[int, tuple[float, int, float]] = {}
            mid = (t0 + t1) / 2
            for r in rows:
                if r[1] not in nearest or abs(r[0] - mid) < abs(nearest[r[1]][0] - mid):
                    nearest[r[1]] = r
            inside = list(nearest.values())
        sums: dict[int, float] = {}
        counts: dict[int, int] = {}
        for _, idx, frac in inside:
            sums[idx] = sums.get(idx, 0.0) + frac
            counts[idx] = counts.get(idx, 0) + 1
        busy = {i: sums[i] / counts[i] for i in sorted(sums)}
        return BusyResult(True, busy=busy, samples={i: counts[i] for i in sorted(counts)}, seconds=t1 - t0,
                          interval_ms=self.interval_ms)

    def timeline(self) -> list[tuple[float, int, float]]:
        """Every sample so far: ``(time.time() seconds, nvidia-smi index, busy fraction)``."""
        with self._lock:
            return list(self._rows)


if __name__ == "__main__":
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    with GpuBusySampler() as s:
        time.sleep(seconds)
    print(s.result.to_dict() if s.result else None)
