"""Counter-based sampling (dflash.inference.sampling) against plain-Python references."""

from __future__ import annotations

import math
import random
import re

import pytest
import torch

from dflash.inference.sampling import (Sampling, gumbel_noise, lowbias32, sample_tokens, token_ids, uniform_noise,
                                      unit_interval)

M32 = 0xFFFFFFFF


def py_lowbias32(x: int) -> int:
    """The published lowbias32, on Python ints (exact 32-bit arithmetic)."""
    x &= M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    x ^= x >> 16
    return x


def py_uniform(seed: int, position: int, token: int) -> float:
    """Two 32-bit lanes (the seed's halves, as int64 bits), each hashed with the position and the id."""
    seed &= (1 << 64) - 1
    h = None
    for half, (c_pos, c_id) in enumerate(((0x9E3779B9, 0x85EBCA6B), (0xC2B2AE35, 0x27D4EB2F))):
        lane = py_lowbias32(py_lowbias32((seed >> (32 * half)) & M32) + half)
        at = py_lowbias32(lane ^ py_lowbias32(position + c_pos))
        mixed = py_lowbias32(at ^ py_lowbias32(token + c_id))
        h = mixed if h is None else py_lowbias32(h ^ mixed)
    return ((h >> 9) + 0.5) / (1 << 23)


def py_sample(logits: list[float], seed: int, position: int, temperature: float, top_p: float) -> int:
    """One token by a loop over the vocabulary: the nucleus by value, then Gumbel-max."""
    top = max(logits)
    scaled = [(z - top) / temperature for z in logits]
    kept = set(range(len(scaled)))
    if top_p < 1.0:
        order = sorted(range(len(scaled)), key=lambda v: -scaled[v])
        top = max(scaled)
        weights = [math.exp(scaled[v] - top) for v in order]
        total = sum(weights)
        mass, floor = 0.0, None
        for v, w in zip(order, weights):
            if mass < top_p:
                floor = scaled[v]
            mass += w / total
        kept = {v for v in range(len(scaled)) if scaled[v] >= floor}
    best, best_v = -math.inf, -1
    for v in range(len(scaled)):
        if v in kept:
            score = scaled[v] - math.log(-math.log(py_uniform(seed, position, v)))
            if score > best:
                best, best_v = score, v
    return best_v


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lowbias32_is_the_published_hash(seed):
    rng = random.Random(seed)
    xs = [rng.randrange(0, 1 << 32) for _ in range(200)] + [0, 1, M32, 0x80000000]
    got = lowbias32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [py_lowbias32(x) for x in xs]
    assert len(set(got)) == len(set(xs))  # a bijection on 32 bits


def test_uniform_noise_is_a_function_of_seed_position_and_token():
    rng = random.Random(3)
    seeds = [rng.randrange(0, 1 << 63) for _ in range(3)]
    positions = [[rng.randrange(0, 4096) for _ in range(4)] for _ in range(3)]
    u = uniform_noise(torch.tensor(seeds), torch.tensor(positions), 37)
    assert u.shape == (3, 4, 37) and u.dtype == torch.float32
    for b in range(3):
        for t in range(4):
            for v in range(37):
                assert u[b, t, v].item() == pytest.approx(py_uniform(seeds[b], positions[b][t], v), abs=1e-7)
    assert 0 < u.min().item() and u.max().item() < 1
    # the rows in another order, one of them alone: the same noise
    swapped = uniform_noise(torch.tensor(seeds[::-1]), torch.tensor(positions[::-1]), 37)
    assert torch.equal(swapped, u.flip(0))
    alone = uniform_noise(torch.tensor(seeds[1:2]), torch.tensor(positions[1:2]), 37)
    assert torch.equal(alone[0], u[1])


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5), (0.5, 1e-9)])
def test_sample_tokens_equals_a_loop_over_the_vocabulary(temperature, top_p):
    g = torch.Generator().manual_seed(11)
    b, t, v = 3, 5, 23
    logits = torch.randn(b, t, v, generator=g) * 3
    logits[0, 0, 7] = logits[0, 0, 8] = logits[0, 0].max() + 1.0  # a tie at the top
    seeds = torch.randint(0, 1 << 62, (b,), generator=g)
    positions = torch.randint(0, 2048, (b, t), generator=g)
    got = sample_tokens(logits, seeds, positions, Sampling(temperature, top_p))
    assert got.shape == (b, t) and got.dtype == torch.int64
    for i in range(b):
        for j in range(t):
            want = py_sample(logits[i, j].tolist(), int(seeds[i]), int(positions[i, j]), temperature, top_p)
            assert got[i, j].item() == want
    if top_p < 1e-6:  # the nucleus of the single largest logit: the argmax (a tie keeps both)
        top = logits.max(dim=-1, keepdim=True).values
        assert bool((logits.gather(-1, got[..., None]) == top).all())


def test_token_ids_given_equal_token_ids_made():
    """The ids a compiled decoder hands in (read from memory, not an in-graph arange) give the same
    tokens as ids made inside (compiled: the next test; the GPU path: the compiled sampling test of
    tests/test_regenerate_static.py)."""
    g = torch.Generator().manual_seed(5)
    b, t, v = 2, 3, 41
    logits = torch.randn(b, t, v, generator=g) * 2
    seeds = torch.randint(0, 1 << 62, (b,), generator=g)
    positions = torch.randint(0, 4096, (b, t), generator=g)
    ids = token_ids(v)
    assert ids.dtype == torch.int64 and ids.tolist() == list(range(v))
    sampling = Sampling(0.8, 0.9)
    made = sample_tokens(logits, seeds, positions, sampling)
    assert torch.equal(sample_tokens(logits, seeds, positions, sampling, ids), made)
    assert torch.equal(uniform_noise(seeds, positions, ids), uniform_noise(seeds, positions, v))
    for i in range(b):
        for j in range(t):
            assert made[i, j].item() == py_sample(logits[i, j].tolist(), int(seeds[i]), int(positions[i, j]), 0.8, 0.9)
    with pytest.raises(ValueError, match=r"ids: \[V\] = \[41\]"):
        sample_tokens(logits, seeds, positions, sampling, token_ids(v + 1))
    with pytest.raises(ValueError, match="vocab"):
        token_ids(0)


def test_compiled_sampler_adds_no_hash_constant_to_index_arithmetic():
    """The generated kernel adds the hash's 32-bit constants (≥ 2³¹) to loaded ids, never to an
    index variable: GPU kernels type index arithmetic as int32, where such a constant does not fit
    and the kernel fails to compile. Checked on the CPU kernel's code, which shows the same
    lowering; without the ids handed in, the constant does meet the index (the check can fail).
    Both compiled runs draw the eager tokens."""
    from torch._inductor.utils import run_and_get_code

    logits = torch.randn(2, 1, 37, generator=torch.Generator().manual_seed(9)) * 2
    seeds, positions = torch.tensor([3, 4]), torch.tensor([[5], [6]])
    on_index = re.compile(r"\b(?:2246822507|2654435769|3266489909|668265263)L?\s*\+\s*x\d")
    codes, tokens = {}, {}
    for given in (True, False):
        torch._dynamo.reset()
        fn = torch.compile(sample_tokens, fullgraph=True)
        tokens[given], code = run_and_get_code(fn, logits, seeds, positions, Sampling(0.8, 0.9),
                                               token_ids(37) if given else None)
        codes[given] = "\n".join(code)
    assert not on_index.search(codes[True])
    assert on_index.search(codes[False])
    eager = sample_tokens(logits, seeds, positions, Sampling(0.8, 0.9))
    assert torch.equal(tokens[True], eager) and torch.equal(tokens[False], eager)  # compiled = eager


def test_sampled_frequencies_follow_the_softmax():
    """Gumbel-max over counter noise draws from softmax(z / T) (restricted to the nucleus)."""
    z = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 40_000
    positions = torch.arange(n).view(1, n)
    seeds = torch.tensor([12345])
    for temperature, top_p in ((1.0, 1.0), (0.8, 1.0), (1.0, 0.8)):
        scaled = z / temperature
        probs = scaled.softmax(-1)
        if top_p < 1:
            before = probs.cumsum(-1) - probs  # z is sorted descending already
            probs = torch.where(before < top_p, probs, torch.zeros(()))
            probs = probs / probs.sum()
        tokens = sample_tokens(z.expand(1, n, 6), seeds, positions, Sampling(temperature, top_p))[0]
        freq = torch.bincount(tokens, minlength=6).float() / n
        assert torch.allclose(freq, probs, atol=0.008), (temperature, top_p, freq, probs)
        assert bool((freq[probs == 0] == 0).all())


def test_gumbel_noise_has_the_gumbel_mean():
    g = gumbel_noise(torch.tensor([7, 8]), torch.arange(64).view(1, 64).expand(2, 64), 512)
    assert abs(g.mean().item() - 0.5772) < 0.01  # the Euler-Mascheroni constant
    assert torch.isfinite(g).all()


def test_sampling_settings_are_checked():
    for bad in (dict(temperature=0.0), dict(temperature=-1.0), dict(temperature=float("nan")),
                dict(temperature=float("inf")), dict(temperature=1.0, top_p=0.0), dict(temperature=1.0, top_p=1.5)):
        with pytest.raises(ValueError):
            Sampling(**bad)


def test_the_unit_interval_never_reaches_its_ends():
    """The largest and smallest hashes map strictly inside (0, 1), so the Gumbel noise is finite."""
    h = torch.tensor([0, 1, (1 << 31), (1 << 32) - 1, (1 << 32) - 512, (1 << 32) - 513], dtype=torch.int64)
    u = unit_interval(h)
    assert u.tolist() == [((x >> 9) + 0.5) / (1 << 23) for x in h.tolist()]
    assert 0 < u.min().item() and u.max().item() < 1
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


def test_a_one_token_nucleus_is_the_argmax_at_a_large_vocabulary(monkeypatch):
    """Qwen3's vocabulary, ids past the tokenizer at -inf (as the batch generator sets them), many
    rows and positions (the rows taken in chunks): a nucleus of one token and a tiny temperature
    both give the argmax, and a -inf id is never drawn at any temperature."""
    import dflash.inference.sampling as sampling

    monkeypatch.setattr(sampling, "SAMPLE_CHUNK_ELEMENTS", 1 << 22)  # one row at a time
    g = torch.Generator().manual_seed(2)
    b, t, v = 3, 24, 151_936
    logits = torch.randn(b, t, v, generator=g)
    logits[..., 151_669:] = float("-inf")
    seeds = torch.randint(-(1 << 62), 1 << 62, (b,), generator=g)
    positions = torch.arange(t).expand(b, t)
    argmax = logits.argmax(dim=-1)
    assert torch.equal(sample_tokens(logits, seeds, positions, Sampling(1.0, 1e-9)), argmax)
    assert torch.equal(sample_tokens(logits, seeds, positions, Sampling(1e-40)), argmax)
    drawn = sample_tokens(logits, seeds, positions, Sampling(50.0))
    assert int(drawn.max()) < 151_669 and len(set(drawn.flatten().tolist())) > b * t // 2


def test_seeds_that_share_a_half_give_other_noise():
    """Every bit of the 64-bit seed counts: seeds equal in one 32-bit half, or built to collide
    through one lane, differ in their noise."""
    positions = torch.arange(32).view(1, 32)
    base = uniform_noise(torch.tensor([5]), positions, 64)
    for other in (5 + (1 << 32), 5 - (1 << 40), -313555955755253754, (1 << 62) + 5):
        assert not torch.equal(uniform_noise(torch.tensor([other]), positions, 64), base)
    shifted = uniform_noise(torch.tensor([-2617223156011630585]), torch.arange(32).view(1, 32) - 1, 64)
    assert not torch.equal(shifted[:, 1:], base[:, :-1])


def test_seeds_outside_int64_are_refused_by_name():
    from dflash.inference.sampling import seed_tensor

    assert seed_tensor([0, -1, (1 << 63) - 1, -(1 << 63)]).tolist() == [0, -1, (1 << 63) - 1, -(1 << 63)]
    with pytest.raises(ValueError, match=r"seeds: int64 values, got \[9223372036854775808\]"):
        seed_tensor([1, 1 << 63])
