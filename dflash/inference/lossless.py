"""The lossless comparison of speculative decoding: where two greedy runs first differ, and whether
that difference is a numerical tie.

**The lossless check.** Every emitted token is the target's greedy choice given the tokens before
it, so speculative output equals target-only greedy output. In fp32 it must be identical. In bf16
a ``B``-token verification forward and a one-token forward run different kernels (different
reduction orders), so a near-tie between the top two logits can flip. Where the outputs first
differ (position ``i``; the tokens before it are equal, so both runs scored the same context) the
report gives each run's top-1/top-2 logit margin there; the difference is a numerical **tie** only
when both margins are at most :func:`tie_bound`, anything else **fails** (the CLI
:mod:`dflash.inference.speculative` exits 1).

:func:`tie_bound` derivation. A bf16 value has 8 significant bits: relative rounding error
``u = 2^-8`` (fp16: ``2^-11``). The final hidden state of an ``N``-layer target is the sum of
``N`` residual updates, each rounded to bf16; a logit ``z = ⟨h, w⟩`` is one more rounding.
Two forwards that differ only in reduction order make independent rounding errors at each of
these ``N + 1`` stages; summed as a random walk, the logit's relative difference is at most
``u·√(N + 1)``, i.e. ``|Δz| ≤ u·√(N + 1)·s`` for a logit scale ``s``. A flip needs each run's
margin below that size.

The scale is ``s = max(|z_1|, max_v |z_v − z̄|, 1)`` (``z̄`` the mean logit of the position). Logits
are defined up to a common shift (argmax and softmax ignore it), so ``|z_1|`` alone is not the size
of the numbers that were rounded: a position whose logits all sit far below zero can have a top
logit near 0 and still carry the usual absolute error. Seen with SmolLM2-135M in bf16: ``z_1 = 2.8``
with ``z̄ = −15.3`` and ``max_v |z_v − z̄| = 20.0``, where the one-token and the verification forward
disagreed by 0.19 in the margin (fp32: 0.21); at the other positions where runs parted, ``z_1``
was 19–30 and ``max_v |z_v − z̄|`` 19–24. SmolLM2-135M (``N = 30``, ``s`` ≈ 18–30): bounds 0.4–0.65.
The bound is a stated model of bf16 noise, not a proof; the margins are in the report so a reader
can judge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from dflash.inference.generation import Generation

__all__ = ["UNIT_ROUNDOFF", "tie_bound", "Difference", "first_difference"]

#: Relative rounding error of one rounding, per dtype (8 / 11 significant bits); fp32 gets no allowance.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def tie_bound(top1_logit: float, num_layers: int, dtype: torch.dtype, spread: float = 0.0) -> float:
    """Largest top-1/top-2 margin a bf16/fp16 rounding difference can flip:
    ``u·√(N + 1)·max(|z_1|, spread, 1)``.

    See the module docstring for the derivation. ``0`` for fp32 (outputs must be identical).

    Args:
        top1_logit: the larger logit ``z_1`` at the position.
        num_layers: ``N``, the target's decoder layers.
        dtype: the dtype the target ran in.
        spread: ``max_v |z_v − mean(z)|`` of the position's logits (``0`` where unknown: the bound
            then rests on ``|z_1|`` alone).

    Raises:
        ValueError: ``num_layers < 1``.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers: must be >= 1, got {num_layers}")
    u = UNIT_ROUNDOFF.get(dtype)
    if u is None:
        return 0.0
    return u * math.sqrt(num_layers + 1) * max(abs(top1_logit), abs(spread), 1.0)


@dataclass
class Difference:
    """Where a speculative output first differs from the target-only one, and whether it is a tie.

    Attributes:
        position: index into the generated tokens.
        spec_token / target_token: the tokens there (``-1`` where a run has no token).
        spec_margin / target_margin: ``z_1 − z_2`` of the target's logits there, in each run
            (``nan`` where a run has no token).
        bound: :func:`tie_bound` there.
        tie: both margins ``≤ bound``.
        spread: the larger of the two runs' ``max_v |z_v − mean(z)|`` there (``nan`` where unknown).
    """

    position: int
    spec_token: int
    target_token: int
    spec_margin: float
    target_margin: float
    bound: float
    tie: bool
    spread: float = math.nan


def first_difference(spec: Generation, target: Generation, num_layers: int, dtype: torch.dtype
                     ) -> Optional[Difference]:
    """Compare two greedy runs token by token; ``None`` when identical.

    A length difference with equal tokens up to the shorter one is never a tie.
    """
    for i, (a, b) in enumerate(zip(spec.tokens, target.tokens)):
        if a != b:
            s1, s2 = spec.top2[i]
            t1, t2 = target.top2[i]
            known = [g.spread[i] for g in (spec, target) if i < len(g.spread)]
            bound = tie_bound(max(abs(s1), abs(t1)), num_layers, dtype, max(known, default=0.0))
            spread = max(known, default=math.nan)
            ms, mt = s1 - s2, t1 - t2
            return Difference(i, a, b, ms, mt, bound, bool(ms <= bound and mt <= bound), spread)
    if len(spec.tokens) == len(target.tokens):
        return None
    i = min(len(spec.tokens), len(target.tokens))
    get = lambda g: g.tokens[i] if i < len(g.tokens) else -1  # noqa: E731
    return Difference(i, get(spec), get(target), float("nan"), float("nan"), 0.0, False)
