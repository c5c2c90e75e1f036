"""Temperature / top-p sampling whose randomness is a function of (row seed, position, token id).

A sampled token is ``argmax_v (z_v / T + g_v)`` over the ids the nucleus keeps, where ``g_v`` is
Gumbel noise: the Gumbel-max trick (Gumbel 1954; Maddison, Tarlow & Minka, "A* Sampling", NeurIPS
2014, §2) draws exactly from ``softmax(z / T)`` restricted to the kept ids. The noise is not drawn
from a generator's stream but computed: ``g = −log(−log u)`` with ``u`` uniform in (0, 1) from an
integer hash of the row's seed, the position the token is written at and the token id
(:func:`uniform_noise`). So a row's sample never depends on the batch it runs in, the rows beside
it, how many steps ran before or on which device, and it is computed inside a compiled step or a
CUDA graph without a host round trip: the static-cache generator and the Hugging Face batch
generator of regeneration draw the same tokens from the same logits.

The hash is ``lowbias32`` (C. Wellons, "Prospecting for Hash Functions", 2018: ``x ^= x >> 16;
x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16``), evaluated in int64 tensors with
every product below 2⁶³ (:func:`_mul32`), so it is exact on every backend. It runs in two 32-bit
lanes, one per half of the 64-bit seed, each mixed with the position and the token id and XORed at
the end: two seeds give the same noise at a position, in effect, only when they are equal. ``u`` takes the top
23 bits, ``(h >> 9 + ½) / 2²³``: exact in fp32 and in [2⁻²⁴, 1 − 2⁻²⁴], so ``g`` lies in
[−2.8, 16.6]: a token whose scaled logit is more than about 19 below the largest (softmax mass
under 5·10⁻⁹ each) is never drawn.

Logits are shifted by their row's maximum before the temperature divides them (the same
distribution; no overflow at tiny temperatures). **Top-p** (nucleus; Holtzman et al., "The Curious
Case of Neural Text Degeneration", ICLR 2020, §3.1) keeps, in descending order of ``z``, each id
whose predecessors' probabilities sum to less than ``top_p`` (the first id always), and then every
id whose logit equals the last kept one's: a rule on values, so ties at the cut are kept or dropped
together whatever order a sort gives them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

__all__ = ["SAMPLE_CHUNK_ELEMENTS", "Sampling", "gumbel_noise", "lowbias32", "sample_tokens", "seed_tensor",
           "token_ids", "uniform_noise", "unit_interval"]

_M32 = 0xFFFFFFFF
_M16 = 0xFFFF
#: Eagerly (not compiled), :func:`sample_tokens` takes rows in chunks of at most this many
#: ``T × V`` elements: the hash's int64 temporaries stay near 128 MiB each (a regeneration
#: prefill samples thousands of rows at once). Compiled, the hash is one fused kernel.
SAMPLE_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of a decoder: a finite ``temperature`` > 0 and ``top_p`` in (0, 1] (1 = off).

    Raises:
        ValueError: a temperature that is not finite and > 0, or a top_p outside (0, 1].
    """

    temperature: float
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature: sampling needs a finite value > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")


def seed_tensor(seeds: Sequence[int], device: Union[str, torch.device, None] = None) -> Tensor:
    """``[n]`` int64 of one seed per row (any ints in the int64 range; negative ones too).

    Raises:
        ValueError: a seed outside the int64 range, naming it.
    """
    bad = [s for s in seeds if not -(1 << 63) <= int(s) < (1 << 63)]
    if bad:
        raise ValueError(f"seeds: int64 values, got {bad[:3]}")
    return torch.tensor([int(s) for s in seeds], dtype=torch.int64, device=device)


def _mul32(x: Tensor, c: int) -> Tensor:
    """``x · c mod 2³²`` for int64 ``x`` in [0, 2³²) and a 32-bit constant ``c``, in two 16-bit halves
    so that no product reaches 2⁶³ (signed overflow is not defined in the generated kernels)."""
    hi = ((x >> 16) * c) & _M16
    return ((hi << 16) + (x & _M16) * c) & _M32


def lowbias32(x: Tensor) -> Tensor:
    """The ``lowbias32`` hash of int64 ``x`` (any shape; its low 32 bits are hashed), int64 in [0, 2³²)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def token_ids(vocab: int, device: Union[str, torch.device, None] = None) -> Tensor:
    """``[V]`` int64 of the token ids ``0 … V−1``, to hand to :func:`sample_tokens` from a compiled step.

    Made outside the compiled region (a decoder's constructor), the ids are a tensor the kernels
    read from memory. An ``arange`` inside the compiled region becomes index arithmetic, which
    inductor's GPU kernels type as int32 when ``V`` is small, and the hash's constants (up to
    2³² − 1) do not fit there: the kernel fails to compile.

    Raises:
        ValueError: ``vocab < 1``.
    """
    if vocab < 1:
        raise ValueError(f"vocab: must be >= 1, got {vocab}")
    return torch.arange(int(vocab), dtype=torch.int64, device=device)


def uniform_noise(seeds: Tensor, positions: Tensor, vocab: Union[int, Tensor]) -> Tensor:
    """Uniform noise in (0, 1), a function of (seed, position, token id) only.

    Args:
        seeds: ``[b]`` int64, one per row (its 64 bits are used).
        positions: ``[b, T]`` int64: the position each row's token is written at.
        vocab: ``V``, the token ids ``0 … V−1``; or those ids, ``[V]`` int64 (:func:`token_ids`:
            what a compiled caller passes).

    Returns:
        ``[b, T, V]`` fp32 on ``positions``' device.
    """
    ids = token_ids(vocab, positions.device) if isinstance(vocab, int) else vocab
    h = None
    for half, (c_pos, c_id) in enumerate(((0x9E3779B9, 0x85EBCA6B), (0xC2B2AE35, 0x27D4EB2F))):
        lane = lowbias32(lowbias32((seeds >> (32 * half)) & _M32) + half)  # [b]
        at = lowbias32(lane[:, None] ^ lowbias32(positions + c_pos))  # [b, T]
        mixed = lowbias32(at[..., None] ^ lowbias32(ids + c_id))  # [b, T, V]
        h = mixed if h is None else lowbias32(h ^ mixed)
    return unit_interval(h)


def unit_interval(h: Tensor) -> Tensor:
    """int64 hashes in [0, 2³²) → fp32 in (0, 1): ``((h >> 9) + ½) / 2²³``, whose every value fp32
    holds exactly (24 significant bits), so neither end is reached by rounding."""
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def gumbel_noise(seeds: Tensor, positions: Tensor, vocab: Union[int, Tensor]) -> Tensor:
    """Standard Gumbel noise ``−log(−log u)`` of :func:`uniform_noise`'s ``u``: ``[b, T, V]`` fp32."""
    return -torch.log(-torch.log(uniform_noise(seeds, positions, vocab)))


def sample_tokens(logits: Tensor, seeds: Tensor, positions: Tensor, sampling: Sampling,
                  ids: Optional[Tensor] = None) -> Tensor:
    """One sampled token per row and position (see the module docstring for the rule).

    Args:
        logits: ``[b, T, V]`` (any float dtype; computed in fp32).
        seeds: ``[b]`` int64, one per row.
        positions: ``[b, T]`` int64: where each token is written (its noise's position).
        sampling: temperature and top-p.
        ids: ``[V]`` int64 token ids from :func:`token_ids`, made outside the compiled region; a
            compiled caller must pass them (see there). ``None``: made here.

    Returns:
        ``[b, T]`` int64 token ids.

    Raises:
        ValueError: ``ids`` not of shape ``[V]``.
    """
    b, t, v = logits.shape
    rows = max(1, SAMPLE_CHUNK_ELEMENTS // max(1, t * v))
    if rows < b and not torch.compiler.is_compiling():
        return torch.cat([sample_tokens(logits[i:i + rows], seeds[i:i + rows], positions[i:i + rows], sampling, ids)
                          for i in range(0, b, rows)])
    if ids is not None and tuple(ids.shape) != (v,):
        raise ValueError(f"ids: [V] = [{v}] token ids, got shape {tuple(ids.shape)}")
    logits = logits.float()
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / sampling.temperature
    if sampling.top_p < 1.0:
        ranked = scaled.sort(dim=-1, descending=True).values
        probs = ranked.softmax(dim=-1)
        kept = ((probs.cumsum(dim=-1) - probs) < sampling.top_p).sum(dim=-1, keepdim=True)  # >= 1
        floor = ranked.gather(-1, kept - 1)  # the last kept logit
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    return (scaled + gumbel_noise(seeds, positions, v if ids is None else ids)).argmax(dim=-1)
