"""dflash.inference.tau_stats and conditional acceptance against their definitions, on random values."""

from __future__ import annotations

import math
import random

import pytest

from dflash.inference.acceptance import conditional_acceptance, measured_per_position
from dflash.inference.tau_stats import paired_gain, standard_error


@pytest.mark.parametrize("seed", range(4))
def test_standard_error_is_the_sample_deviation_over_root_n(seed):
    rng = random.Random(seed)
    vals = [rng.uniform(1, 6) for _ in range(rng.randint(2, 40))]
    n = len(vals)
    mean = sum(vals) / n
    want = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) / math.sqrt(n)
    assert standard_error(vals + [float("nan"), None]) == pytest.approx(want)
    assert math.isnan(standard_error(vals[:1])) and math.isnan(standard_error([]))


@pytest.mark.parametrize("seed", range(4))
def test_paired_gain_over_the_common_prompts(seed):
    rng = random.Random(10 + seed)
    base = {f"s/{i}": rng.uniform(1, 5) for i in range(30)}
    other = {k: v + rng.gauss(0.2, 0.1) for k, v in base.items() if rng.random() < 0.8}
    other["s/99"] = 4.0  # only in one: not paired
    base["s/0"] = float("nan")  # not measured: not paired
    diffs = []
    for k in sorted(base):
        if k in other and not math.isnan(base[k]):
            diffs.append(other[k] - base[k])
    gain, se, n = paired_gain(base, other)
    assert n == len(diffs) and gain == pytest.approx(sum(diffs) / n) and se == pytest.approx(standard_error(diffs))
    # a hard prompt is hard for both: the paired error is far below either mean's own
    assert se < standard_error(list(other.values())) / 3
    assert paired_gain({"a": 1.0}, {"b": 2.0})[2] == 0 and math.isnan(paired_gain({}, {})[0])


@pytest.mark.parametrize("seed", range(4))
def test_conditional_acceptance_against_a_naive_count(seed):
    rng = random.Random(20 + seed)
    b = rng.choice([4, 8, 16])
    accepted = [min(b, 1 + int(rng.expovariate(0.7))) for _ in range(rng.randint(1, 300))]
    got = conditional_acceptance(accepted, b)
    assert len(got) == b - 1
    for k in range(1, b):
        reached = [a for a in accepted if a - 1 >= k - 1]  # drafts 1 … k-1 accepted
        if not reached:
            assert math.isnan(got[k - 1])
        else:
            assert got[k - 1] == pytest.approx(sum(a - 1 >= k for a in reached) / len(reached))
    # the unconditional fractions are the running products of the conditional rates
    unconditional = measured_per_position(accepted, b)
    prod = 1.0
    for k in range(1, b):
        if math.isnan(got[k - 1]):
            break
        prod *= got[k - 1]
        assert unconditional[k - 1] == pytest.approx(prod)
    with pytest.raises(ValueError, match="accepted"):
        conditional_acceptance([1, b + 1], b)
    with pytest.raises(ValueError, match="accepted"):
        conditional_acceptance([0], b)
