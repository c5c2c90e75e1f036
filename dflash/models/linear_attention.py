"""Gated-DeltaNet (linear-attention) layers of hybrid targets, exact over packed rows.

A packed row holds several conversations. Full-attention layers keep them apart with the
per-document mask; a Gated-DeltaNet layer has no mask to keep them apart: it carries a recurrent
state from token to token and runs a short causal convolution (kernel 4) over its q/k/v
projections. Run as transformers runs it from ``position_ids`` alone, both cross from one
conversation into the next, so a conversation's features depend on whatever was packed before it.
Here every conversation starts from a zero state and its convolution reads no token of the
conversation before it: its features are those of the conversation computed alone, which is what
a serving engine computes for each request.

The layer (Gated DeltaNet: Yang, Kautz and Hatamizadeh, arXiv 2412.06464, §2-3; its Qwen3.5
module layout is transformers' ``Qwen3_5GatedDeltaNet``)::

    x        = silu(causal_conv1d(in_proj_qkv(h)))                  -> q, k, v (q, k L2-normalised)
    g_t      = -exp(A_log) * softplus(in_proj_a(h)_t + dt_bias)      (log-decay, <= 0)
    beta_t   = sigmoid(in_proj_b(h)_t)
    S_t      = e^{g_t} S_{t-1} + beta_t k_t (v_t - e^{g_t} S_{t-1}^T k_t)^T     S: [d_k, d_v]
    o_t      = S_t^T q_t / sqrt(d_k)
    out      = out_proj(rmsnorm_gated(o, in_proj_z(h)))

Two backends compute the same function (:func:`resolve_backend`):

* ``fla``: flash-linear-attention's variable-length kernels (``fla.modules.causal_conv1d`` and
  ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` with ``cu_seqlens``: the batch flattened to
  one sequence, each conversation its own segment). CUDA only. Wrapped as ``torch.library`` custom
  ops, so ``torch.compile`` treats them as opaque calls inside a compiled layer.
* ``torch``: our own chunked form (:func:`chunk_gated_delta_rule`), with segment masks in place of
  the varlen offsets, and a masked causal convolution (:func:`packed_causal_conv1d`). Any device;
  static shapes, no host synchronisation.

A layer whose module does not have the Qwen3.5 layout is refused (:func:`check_gated_deltanet`):
no path here computes a linear-attention layer it cannot compute exactly.
"""

from __future__ import annotations

import importlib
import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "BACKENDS",
    "CHUNK_SIZE",
    "check_gated_deltanet",
    "chunk_gated_delta_rule",
    "conversation_starts",
    "fla_available",
    "gated_deltanet_forward",
    "packed_causal_conv1d",
    "resolve_backend",
]

logger = logging.getLogger(__name__)

#: ``target.linear_attention`` values: ``auto`` = ``fla`` on CUDA when it imports, else ``torch``.
BACKENDS = ("auto", "fla", "torch")
#: Positions per chunk of the chunked delta rule (fla's default; its kernels accept 16, 32, 64).
CHUNK_SIZE = 64
#: The parameters and submodules :func:`gated_deltanet_forward` reads from a linear-attention module.
_GDN_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "dt_bias", "A_log", "norm", "out_proj")
#: ... and the sizes it reads.
_GDN_SIZES = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
#: eps of the q/k L2 normalisation (fla's ``l2norm`` and transformers' torch path use 1e-6).
_L2NORM_EPS = 1e-6


# --------------------------------------------------------------------------- where conversations start

def conversation_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[R, S]`` bool: True at the first token of every conversation of a packed row (and at
    position 0 of every row). A run of padding (doc 0) is a segment of its own.

    Args:
        doc_ids: ``[R, S]`` integer conversation ids (the batch contract: 1, 2, ... per row, 0 = padding).
    """
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return starts


def _cu_seqlens(starts: torch.Tensor) -> torch.Tensor:
    """``[N + 1]`` int64 offsets of the N segments of ``starts`` flattened to one sequence (varlen
    kernels' ``cu_seqlens``, as flash-attention's). Synchronises with the host (``nonzero``)."""
    flat = starts.reshape(-1)
    begin = flat.nonzero().reshape(-1)
    end = torch.full((1,), flat.numel(), dtype=begin.dtype, device=begin.device)
    return torch.cat([begin, end]).to(torch.long)


# --------------------------------------------------------------------------- the torch backend

def packed_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         segments: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution with SiLU, each tap that reaches into another segment dropped.

    ``out[t, c] = silu(bias[c] + sum_i weight[c, K-1-i] * x[t-i, c] * [seg[t-i] == seg[t]])`` for
    i = 0..K-1 (``x[t-i] = 0`` for t < i): exactly ``silu(F.conv1d(x, weight, padding=K-1)[:S])``
    run on each segment alone (the convolution of transformers' ``causal_conv1d_fn``). Computed in
    float32, returned in ``x.dtype``.

    Args:
        x: ``[R, S, C]`` activations. weight: ``[C, K]`` taps (``conv1d.weight.squeeze(1)``).
        bias: ``[C]`` or ``None``. segments: ``[R, S]`` integer segment ids, equal within a segment.
    """
    taps = weight.shape[-1]
    xf = x.float()
    w = weight.float()
    out = xf * w[:, taps - 1]
    for shift in range(1, taps):
        earlier = F.pad(xf, (0, 0, shift, 0))[:, : x.shape[1]]
        same = F.pad(segments, (shift, 0), value=-1)[:, : x.shape[1]] == segments
        out = out + earlier * same.unsqueeze(-1) * w[:, taps - 1 - shift]
    if bias is not None:
        out = out + bias.float()
    return F.silu(out).to(x.dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + _L2NORM_EPS)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, segments: torch.Tensor, *,
                           chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """The gated delta rule over packed rows, every segment from a zero state (float32 math).

    Chunked WY form (DeltaNet's chunkwise algorithm, Yang et al. arXiv 2406.06484 §3.2, with the
    gate of arXiv 2412.06464 §3.3). In a chunk with local cumulative log-decay ``c_i``, the decay
    between positions j <= i of one segment is ``D_ij = exp(c_i - c_j)``, and 0 across segments;
    position i reads the state carried into the chunk with ``gamma_i = exp(c_i)`` only while it is
    in the segment that state belongs to. With ``A_ij = beta_i D_ij k_i.k_j`` (j < i) and
    ``T = (I + A)^-1``, the chunk's pseudo-values, output and carried state are::

        U  = T (beta V) - T (beta gamma K) S0
        O  = (gamma Q) S0 + ((Q K^T) * D) U
        S1 = gamma_last S0 + (D_last K)^T U

    which unrolls to the per-token recurrence of the module docstring (tests check it against a
    per-conversation loop). q and k are L2-normalised here and q scaled by ``d_k ** -0.5``, as
    fla's ``chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True)``.

    Args:
        q, k: ``[R, S, H, d_k]``; v: ``[R, S, HV, d_v]`` with HV a multiple of H (value head h
            uses key head ``h // (HV // H)``, transformers' ``repeat_interleave``).
        g: ``[R, S, HV]`` log-decay (<= 0). beta: ``[R, S, HV]`` in (0, 1).
        segments: ``[R, S]`` integer segment ids (non-decreasing along a row).
        chunk_size: positions per chunk.

    Returns:
        ``[R, S, HV, d_v]`` in ``v.dtype``.
    """
    rows, seq, heads, _ = q.shape
    v_heads, d_v = v.shape[-2:]
    if v_heads % heads:
        raise ValueError(f"value heads ({v_heads}) must be a multiple of key heads ({heads})")
    if v_heads != heads:
        q = q.repeat_interleave(v_heads // heads, dim=2)
        k = k.repeat_interleave(v_heads // heads, dim=2)
    pad = (-seq) % chunk_size
    # [R, HV, S, d] in float32; padding is a segment of its own with k = v = 0, so it changes nothing
    q, k, v = (F.pad(t.transpose(1, 2).float(), (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t.transpose(1, 2).float(), (0, pad)) for t in (g, beta))
    seg = F.pad(segments, (0, pad), value=-2) if pad else segments
    q = _l2norm(q) * q.shape[-1] ** -0.5
    k = _l2norm(k)
    chunks = (seq + pad) // chunk_size
    q, k, v = (t.reshape(rows, v_heads, chunks, chunk_size, -1) for t in (q, k, v))
    g, beta = (t.reshape(rows, v_heads, chunks, chunk_size) for t in (g, beta))
    seg = seg.reshape(rows, 1, chunks, chunk_size)

    cum = g.cumsum(dim=-1)                                                    # c_i
    same = seg.unsqueeze(-1) == seg.unsqueeze(-2)                             # [R, 1, N, C, C]
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~(same & lower), float("-inf")).exp()
    carried = torch.full_like(seg[..., :1], -1)                               # no state before a row
    carried[:, :, 1:] = seg[:, :, :-1, -1:]
    gamma = cum.exp() * (seg == carried)                                      # [R, HV, N, C]

    kb = k * beta.unsqueeze(-1)
    a = (kb @ k.transpose(-1, -2)) * decay
    eye = torch.eye(chunk_size, dtype=a.dtype, device=a.device)
    system = a.tril(-1) + eye                                                 # I + A
    u0 = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * gamma.unsqueeze(-1), upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay
    q_read = q * gamma.unsqueeze(-1)
    k_write = k * decay[..., -1, :].unsqueeze(-1)                             # D_last,j k_j
    gamma_last = gamma[..., -1, None, None]

    state = q.new_zeros(rows, v_heads, q.shape[-1], d_v)
    out = torch.empty_like(v)
    for n in range(chunks):
        u = u0[:, :, n] - w[:, :, n] @ state
        out[:, :, n] = q_read[:, :, n] @ state + qk[:, :, n] @ u
        state = gamma_last[:, :, n] * state + k_write[:, :, n].transpose(-1, -2) @ u
    out = out.reshape(rows, v_heads, chunks * chunk_size, d_v)[:, :, :seq]
    return out.transpose(1, 2).to(v.dtype)


# --------------------------------------------------------------------------- the fla backend

def fla_available() -> bool:
    """Whether flash-linear-attention's varlen kernels import (the ``fla`` package, with Triton)."""
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
        importlib.import_module("fla.modules.causal_conv1d")
    except Exception:  # noqa: BLE001 - any import failure (no package, no Triton, no GPU driver) means "not here"
        return False
    return True


@torch.library.custom_op("dflash::fla_packed_conv1d", mutates_args=())
def _fla_packed_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       starts: torch.Tensor) -> torch.Tensor:
    """fla's causal convolution + SiLU over the segments of ``starts``; ``[R, S, C]`` in and out."""
    from fla.modules.causal_conv1d import causal_conv1d

    rows, seq, width = x.shape
    out, _ = causal_conv1d(x.reshape(1, rows * seq, width), weight, bias, activation="silu",
                           cu_seqlens=_cu_seqlens(starts))
    return out.reshape(rows, seq, width).contiguous()


@_fla_packed_conv1d.register_fake
def _(x, weight, bias, starts):
    return torch.empty_like(x)


@torch.library.custom_op("dflash::fla_packed_gated_delta_rule", mutates_args=())
def _fla_packed_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """fla's chunked gated delta rule over the segments of ``starts`` (shapes as
    :func:`chunk_gated_delta_rule`, ``starts`` in place of segment ids)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    rows, seq = q.shape[:2]
    flat = [t.reshape(1, rows * seq, *t.shape[2:]) for t in (q, k, v, g, beta)]
    out, _ = fla_chunk(*flat, use_qk_l2norm_in_kernel=True, cu_seqlens=_cu_seqlens(starts))
    return out.reshape(rows, seq, *v.shape[2:]).contiguous()


@_fla_packed_gated_delta_rule.register_fake
def _(q, k, v, g, beta, starts):
    return torch.empty_like(v)


def resolve_backend(requested: str, device: torch.device | str) -> str:
    """``fla`` or ``torch`` for ``target.linear_attention``.

    ``auto`` takes ``fla`` on a CUDA device where it imports, else ``torch`` (exact too, slower:
    a Qwen3.6-27B forward of 16 × 3,072 tokens took 8.2 s against fla's 5.8 s on one H200).

    Raises:
        ValueError: an unknown value, or ``fla`` asked for off CUDA or where it does not import.
    """
    device = torch.device(device)
    if requested not in BACKENDS:
        raise ValueError(f"target.linear_attention: must be one of {', '.join(BACKENDS)}, got {requested!r}")
    if requested == "torch":
        return "torch"
    usable = device.type == "cuda" and fla_available()
    if requested == "fla" and not usable:
        why = "runs on CUDA devices only" if device.type != "cuda" else "does not import here"
        raise ValueError(f"target.linear_attention: fla {why} (install flash-linear-attention, which "
                         "`make setup` does where a GPU is visible, or set target.linear_attention: torch)")
    return "fla" if usable else "torch"


# --------------------------------------------------------------------------- the layer

def check_gated_deltanet(module: nn.Module, where: str) -> None:
    """Refuse a linear-attention module :func:`gated_deltanet_forward` cannot compute exactly.

    Raises:
        TypeError: naming ``where`` (e.g. ``layer 0``) and the missing parts.
    """
    missing = [p for p in _GDN_PARTS + _GDN_SIZES if not hasattr(module, p)]
    if missing:
        raise TypeError(f"{where}: {type(module).__name__} is not a Gated-DeltaNet layer of the Qwen3.5 "
                        f"layout (missing {', '.join(missing)}), so its packed rows cannot be kept apart "
                        "exactly; no other linear-attention layout is supported")
    activation = getattr(module, "activation", "silu")
    if activation not in ("silu", "swish"):
        raise TypeError(f"{where}: convolution activation {activation!r} is not supported (silu only)")


def gated_deltanet_forward(module: nn.Module, hidden: torch.Tensor, starts: torch.Tensor,
                           segments: torch.Tensor, backend: str) -> torch.Tensor:
    """A Gated-DeltaNet token mixer over packed rows, each conversation alone (module docstring).

    Args:
        module: a ``Qwen3_5GatedDeltaNet`` (checked by :func:`check_gated_deltanet`).
        hidden: ``[R, S, D]`` the layer's normed input, in the weights' dtype.
        starts: ``[R, S]`` bool from :func:`conversation_starts` (the fla backend's segments).
        segments: ``[R, S]`` int64 ``starts.cumsum(-1)`` (the torch backend's segments).
        backend: ``fla`` or ``torch`` (:func:`resolve_backend`).

    Returns:
        ``[R, S, D]``: the token mixer's output, before the residual add.
    """
    rows, seq, _ = hidden.shape
    h_k, h_v = module.num_k_heads, module.num_v_heads
    d_k, d_v = module.head_k_dim, module.head_v_dim
    mixed = module.in_proj_qkv(hidden)
    z = module.in_proj_z(hidden)
    b = module.in_proj_b(hidden)
    a = module.in_proj_a(hidden)
    weight = module.conv1d.weight.squeeze(1)
    if backend == "fla":
        mixed = _fla_packed_conv1d(mixed, weight, module.conv1d.bias, starts)
    else:
        mixed = packed_causal_conv1d(mixed, weight, module.conv1d.bias, segments)
    q, k, v = torch.split(mixed, [h_k * d_k, h_k * d_k, h_v * d_v], dim=-1)
    q = q.reshape(rows, seq, h_k, d_k)
    k = k.reshape(rows, seq, h_k, d_k)
    v = v.reshape(rows, seq, h_v, d_v)
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    if backend == "fla":
        core = _fla_packed_gated_delta_rule(q, k, v, g, beta, starts)
    else:
        core = chunk_gated_delta_rule(q, k, v, g, beta, segments).to(v.dtype)  # fp32 recurrence, back to bf16 weights
    core = module.norm(core.reshape(-1, d_v), z.reshape(-1, d_v)).reshape(rows, seq, h_v * d_v)
    return module.out_proj(core)
