"""How well a mean τ over prompts is known, and whether one drafter beats another on the same prompts.

Torch-free (the ablation's table imports it): plain floats in, plain floats out.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable

__all__ = ["GAIN_SE", "standard_error", "paired_gain"]

#: A paired gain counts as one (a win, or a loss) beyond this many of its standard errors
#: (:func:`paired_gain`): the ablation's stacked recipe and ``scripts.tau_compare`` both use it.
GAIN_SE = 2.0


def standard_error(values: Iterable[float]) -> float:
    """The standard error of the mean of ``values`` (``None`` and NaN skipped): the sample standard
    deviation (``n − 1`` in its denominator) over ``√n``; NaN with fewer than 2 values.

    What a mean over prompts, such as τ per response, is known to: one drafter's per-response τ on
    16 held-out ShareGPT prompts spreads over about 1.7 … 5, so another 16 prompts of the same kind
    give a mean about 2 standard errors away or closer, 95 % of the time.
    """
    vals = [float(v) for v in values if v is not None and not math.isnan(v)]
    return statistics.stdev(vals) / math.sqrt(len(vals)) if len(vals) >= 2 else float("nan")


def paired_gain(base: dict[Any, float], other: dict[Any, float]) -> tuple[float, float, int]:
    """``(mean gain, its standard error, prompts)`` of ``other`` over ``base``, prompt by prompt.

    The gain is the mean of ``other[k] − base[k]`` over the keys both have with neither value NaN
    (or ``None``); its standard error is :func:`standard_error` of those differences. Two drafters
    decoded on the same prompts differ by much less than either one's spread over prompts (a hard
    prompt is hard for both), so this, not each mean's own error, says whether a change helped.

    Returns:
        ``(nan, nan, 0)`` without a common prompt; ``(gain, nan, 1)`` with one.
    """
    def ok(x: Any) -> bool:
        return x is not None and not math.isnan(x)

    diffs = [float(other[k]) - float(base[k]) for k in base if k in other and ok(base[k]) and ok(other[k])]
    if not diffs:
        return float("nan"), float("nan"), 0
    return sum(diffs) / len(diffs), standard_error(diffs), len(diffs)
