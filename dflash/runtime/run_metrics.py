"""The coordinator's metrics: one record per finished step or evaluation round, and the console line.

Throughput is measured over the window since the previous finished step: target tokens/s (forward
passes reported ``produced``), drafter tokens/s (tokens trained by every rank) and the targets'
busy fraction. Worker counters (heartbeats and ``trained`` stats) appear as ``<worker>/<counter>``.

Model FLOPs utilisation per stage (:mod:`dflash.models.flops`), over the same window:
``mfu/target`` = Σ FLOPs of the targets' training forwards / Σ (forward seconds × the device's
peak), ``mfu/drafter`` = the same over every drafter rank's train steps (step seconds, waiting for
data excluded). ``None`` (JSON null) when no such work finished in the window or no peak is known
(a GPU missing from the peak table, without ``cluster.peak_tflops``).
"""

from __future__ import annotations

import time
from typing import Optional

__all__ = ["StepMetrics", "progress_text"]


def progress_text(m: dict) -> str:
    """The console line of one step's metrics ``m`` (data epoch, loss, τ, tokens/s, MFU, queue, memory)."""
    mem = " ".join(f"{k.split('/')[0]}={v:.1f}G" for k, v in sorted(m.items()) if k.endswith("/mem_gib"))
    mfu = " ".join(f"{stage} {'-' if m.get(f'mfu/{key}') is None else format(m[f'mfu/{key}'], '.1%')}"
                   for stage, key in (("tgt", "target"), ("dft", "drafter")))
    return (f"ep {m.get('epoch', 0)} | loss {m.get('train/loss', float('nan')):.3f} "
            f"τ {m.get('train/tau', float('nan')):.2f} | tgt {m['throughput/target_tokens_per_s']:.0f} tok/s "
            f"dft {m['throughput/drafter_tokens_per_s']:.0f} tok/s | mfu {mfu} | q {m['queue/outstanding_batches']} "
            f"| {mem}")


class _Utilisation:
    """Σ model FLOPs and Σ (seconds × peak FLOP/s) of one stage's finished work in a window."""

    def __init__(self) -> None:
        self.flops = 0.0
        self.peak_seconds = 0.0

    def add(self, flops: float, seconds: float, peak: Optional[float]) -> None:
        if peak is not None and seconds > 0:
            self.flops += flops
            self.peak_seconds += seconds * peak

    def value(self) -> Optional[float]:
        return self.flops / self.peak_seconds if self.peak_seconds > 0 else None


class StepMetrics:
    """Counters between finished steps, and the record of each finished step."""

    def __init__(self) -> None:
        self.worker_stats: dict[str, dict] = {}
        self._rank0: dict = {}
        #: real tokens trained per step, summed over the drafter ranks
        self._step_tokens: dict[int, int] = {}
        self._reset_window()

    def _reset_window(self) -> None:
        self._window_start = time.monotonic()
        self._target_tokens = 0
        self._target_busy_s = 0.0
        self._drafter_tokens = 0
        self._target_mfu = _Utilisation()
        self._drafter_mfu = _Utilisation()

    def produced(self, split: str, tokens: int, seconds: float, flops: float = 0.0,
                 peak_flops: Optional[float] = None) -> None:
        """A target's forward pass: ``tokens`` real tokens and ``flops`` model FLOPs in ``seconds``
        on a device of ``peak_flops`` FLOP/s (training batches count)."""
        if split == "train":
            self._target_tokens += tokens
            self._target_busy_s += seconds
            self._target_mfu.add(flops, seconds, peak_flops)

    def trained(self, sender: str, step: int, metrics: dict, rank0: bool) -> None:
        """A drafter's ``trained`` report of ``step`` (rank 0's carries the step's loss and τ; every
        rank's ``compute``: ``flops``, ``seconds`` and ``peak_flops`` of its step)."""
        self.worker_stats.setdefault(sender, {}).update(metrics.get("stats", {}))
        compute = metrics.get("compute") or {}
        self._drafter_mfu.add(float(compute.get("flops", 0.0)), float(compute.get("seconds", 0.0)),
                              compute.get("peak_flops"))
        if rank0:
            self._rank0 = metrics
        tokens = metrics.get("tokens", 0)
        self._drafter_tokens += tokens
        self._step_tokens[step] = self._step_tokens.get(step, 0) + tokens

    def forget_steps(self) -> None:
        """Drop the per-step token counts (a rollback: the steps are trained again)."""
        self._step_tokens.clear()

    def step_record(self, step: int, data_epoch: int, num_targets: int, outstanding: int) -> dict:
        """The metrics of finished ``step`` (then a new throughput window starts)."""
        metrics = dict(self._rank0)
        metrics.pop("stats", None)
        metrics.pop("compute", None)
        metrics["tokens"] = self._step_tokens.pop(step, 0)  # all ranks (rank 0 reported its own)
        elapsed = max(1e-9, time.monotonic() - self._window_start)
        metrics["throughput/target_tokens_per_s"] = self._target_tokens / elapsed
        metrics["throughput/drafter_tokens_per_s"] = self._drafter_tokens / elapsed
        metrics["throughput/target_busy_fraction"] = self._target_busy_s / elapsed / max(1, num_targets)
        metrics["mfu/target"] = self._target_mfu.value()
        metrics["mfu/drafter"] = self._drafter_mfu.value()
        metrics["queue/outstanding_batches"] = outstanding
        metrics["epoch"] = data_epoch
        for name, stats in self.worker_stats.items():
            for key, value in stats.items():
                if isinstance(value, (int, float)):
                    metrics[f"{name}/{key}"] = value
        self._reset_window()
        return metrics
