"""The coordinator's metrics: one record per finished step or evaluation round, and the console line.

Throughput is measured over the window since the previous finished step: target tokens/s (forward
passes reported ``produced``), drafter tokens/s (tokens trained by every rank) and the targets'
busy fraction. Worker counters (heartbeats and ``trained`` stats) appear as ``<worker>/<counter>``.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["StepMetrics", "aggregate_eval", "progress_text"]


def aggregate_eval(sums: list[dict]) -> dict:
    """Combine per-drafter evaluation sums into held-out loss, τ and per-block-position accuracy.

    Args:
        sums: one dict per drafter with ``loss_sum``, ``weight_sum``, ``tau_sum``, ``blocks``,
            ``head_tau_sum``, ``head_blocks``, the lists ``correct`` / ``count`` indexed by block position
            and, from an evaluation that walked (``train.eval_walk``), ``walk_tau_sum``, ``walk_blocks``,
            ``walk_head_tau_sum``, ``walk_head_blocks``.
    Returns:
        ``eval/loss`` = Σ loss_sum / Σ weight_sum, ``eval/tau`` = Σ tau_sum / Σ blocks,
        ``eval/blocks``, ``eval/tau_head`` = Σ head_tau_sum / Σ head_blocks (the blocks whose anchor lies in
        the first ``train.eval_head_tokens`` tokens of its response; NaN without any), ``eval/head_blocks``,
        with the walk ``eval/tau_walk`` = Σ walk_tau_sum / Σ walk_blocks (decoding's anchors walked over
        every held-out response, pooled as decoding pools: training's prediction of decoding τ),
        ``eval/walk_blocks``, ``eval/tau_walk_head`` / ``eval/walk_head_blocks`` (the walk over the first
        ``train.eval_head_tokens`` tokens of each response; NaN without blocks), and
        ``eval/acc_block_pos_k`` = Σ correct[k] / Σ count[k] for block positions k ≥ 1; ``{}`` without sums.
    """
    if not sums:
        return {}
    total: dict[str, Any] = {}
    for s in sums:
        for key, value in s.items():
            if isinstance(value, list):
                prev = total.setdefault(key, [0.0] * len(value))
                total[key] = [a + b for a, b in zip(prev, value)]
            else:
                total[key] = total.get(key, 0.0) + value
    out = {
        "eval/loss": total["loss_sum"] / max(total["weight_sum"], 1e-12),
        "eval/tau": total["tau_sum"] / max(total["blocks"], 1),
        "eval/blocks": int(total["blocks"]),
    }
    if "head_blocks" in total:
        head = total["head_blocks"]
        out["eval/tau_head"] = total["head_tau_sum"] / head if head else float("nan")
        out["eval/head_blocks"] = int(head)
    if "walk_blocks" in total:
        for name, tau_key, blocks_key in (("walk", "walk_tau_sum", "walk_blocks"),
                                          ("walk_head", "walk_head_tau_sum", "walk_head_blocks")):
            n = total[blocks_key]
            out[f"eval/tau_{name}"] = total[tau_key] / n if n else float("nan")
            out[f"eval/{name}_blocks"] = int(n)
    for k, (c, n) in enumerate(zip(total.get("correct", []), total.get("count", []))):
        if k > 0:
            out[f"eval/acc_block_pos_{k}"] = c / n if n else float("nan")
    return out


def progress_text(m: dict) -> str:
    """The console line of one step's metrics ``m`` (data epoch, loss, τ, tokens/s, queue, memory)."""
    mem = " ".join(f"{k.split('/')[0]}={v:.1f}G" for k, v in sorted(m.items()) if k.endswith("/mem_gib"))
    return (f"ep {m.get('epoch', 0)} | loss {m.get('train/loss', float('nan')):.3f} "
            f"τ {m.get('train/tau', float('nan')):.2f} | tgt {m['throughput/target_tokens_per_s']:.0f} tok/s "
            f"dft {m['throughput/drafter_tokens_per_s']:.0f} tok/s | q {m['queue/outstanding_batches']} | {mem}")


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

    def produced(self, split: str, tokens: int, seconds: float) -> None:
        """A target's forward pass: ``tokens`` real tokens in ``seconds`` (training batches count)."""
        if split == "train":
            self._target_tokens += tokens
            self._target_busy_s += seconds

    def trained(self, sender: str, step: int, metrics: dict, rank0: bool) -> None:
        """A drafter's ``trained`` report of ``step`` (rank 0's carries the step's loss and τ)."""
        self.worker_stats.setdefault(sender, {}).update(metrics.get("stats", {}))
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
        metrics["tokens"] = self._step_tokens.pop(step, 0)  # all ranks (rank 0 reported its own)
        elapsed = max(1e-9, time.monotonic() - self._window_start)
        metrics["throughput/target_tokens_per_s"] = self._target_tokens / elapsed
        metrics["throughput/drafter_tokens_per_s"] = self._drafter_tokens / elapsed
        metrics["throughput/target_busy_fraction"] = self._target_busy_s / elapsed / max(1, num_targets)
        metrics["queue/outstanding_batches"] = outstanding
        metrics["epoch"] = data_epoch
        for name, stats in self.worker_stats.items():
            for key, value in stats.items():
                if isinstance(value, (int, float)):
                    metrics[f"{name}/{key}"] = value
        self._reset_window()
        return metrics
