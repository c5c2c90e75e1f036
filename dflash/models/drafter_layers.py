"""The drafter's building blocks: RMSNorm, RoPE, KV-injection attention, SwiGLU, the decoder layer.

Qwen3-style layers (pre-RMSNorm, per-head q/k RMSNorm, RoPE, SwiGLU MLP; DFlash paper, arXiv
2602.06036, §3; public layout of z-lab/dflash ``dflash/models/drafter.py``) whose attention takes
queries from the block tokens and keys / values from ``[context ; block tokens]`` (*KV injection*),
through a dense SDPA mask or a flex_attention ``BlockMask``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.models.drafter_config import DFlashConfig
from dflash.models.masks import AttentionMask

__all__ = ["RMSNorm", "RotaryEmbedding", "DFlashAttention", "SwiGLU", "DFlashDecoderLayer"]


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) · weight`` over the last dim, computed in fp32, returned in x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        # Output in the input's dtype (bf16 under autocast): an fp32 weight must not promote it.
        return self.weight.to(dtype) * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """Default RoPE (Su et al.; Qwen3): ``cos, sin [..., head_dim]`` for integer positions."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``positions [R, T]`` int64 → ``(cos, sin)`` each ``[R, 1, T, head_dim]`` in ``dtype``."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [R, T, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + _rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Block queries over ``[context ; block]`` keys/values (KV injection, docs/DFLASH.md)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, rope_q: tuple[Tensor, Tensor], rope_kv: tuple[Tensor, Tensor],
                mask: AttentionMask) -> Tensor:
        """One attention sub-layer.

        Args:
            x: normed block hidden states ``[R, Q, D]`` (``Q = A·B``).
            ctx: context features ``[R, S, D]`` (already ``fc`` + ``hidden_norm``).
            rope_q: ``(cos, sin)`` of the block positions, ``[R, 1, Q, hd]``.
            rope_kv: ``(cos, sin)`` of ``[context ; block]`` positions, ``[R, 1, S + Q, hd]``.
            mask: dense bool ``[R, 1, Q, S + Q]`` (SDPA) or a flex_attention ``BlockMask``.

        Returns:
            ``[R, Q, D]``.
        """
        r, q_len, _ = x.shape
        kv_in = torch.cat([ctx.to(x.dtype), x], dim=1)  # [R, S + Q, D]
        kv_len = kv_in.shape[1]
        q = self.q_norm(self.q_proj(x).view(r, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(r, kv_len, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(r, kv_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = _apply_rope(q, rope_q[0].to(q.dtype), rope_q[1].to(q.dtype))
        k = _apply_rope(k, rope_kv[0].to(k.dtype), rope_kv[1].to(k.dtype))
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        if isinstance(mask, Tensor):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                                 enable_gqa=self.num_heads != self.num_kv_heads)
        else:
            out = _flex_attention(q, k, v, mask, self.scale, self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(r, q_len, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    """Qwen3 MLP: ``down(silu(gate(x)) · up(x))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``x + attn(norm(x), ctx)``, then ``x + mlp(norm(x))``.

    The context features enter every layer's ``k_proj`` / ``v_proj`` unnormed by the layer
    (they were normed once by ``hidden_norm``), as in the public DFlash drafters.
    """

    def __init__(self, cfg: DFlashConfig, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = DFlashAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, rope_q: tuple[Tensor, Tensor], rope_kv: tuple[Tensor, Tensor],
                mask: AttentionMask) -> Tensor:
        return self.mlp_block(self.attention_block(x, ctx, rope_q, rope_kv, mask))

    def attention_block(self, x: Tensor, ctx: Tensor, rope_q: tuple[Tensor, Tensor],
                        rope_kv: tuple[Tensor, Tensor], mask: AttentionMask) -> Tensor:
        """``x + attn(norm(x), ctx)``: ``[R, Q, D]`` in and out."""
        return x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_kv, mask)

    def mlp_block(self, x: Tensor) -> Tensor:
        """``x + mlp(norm(x))``: ``[..., D]`` in and out, token by token (so it may run on any
        slice of the block tokens)."""
        return x + self.mlp(self.post_attention_layernorm(x))


# --------------------------------------------------------------------------- flex_attention

_compiled_flex: Optional[Any] = None


def _flex_attention(q: Tensor, k: Tensor, v: Tensor, block_mask: Any, scale: float, gqa: bool) -> Tensor:
    """flex_attention, compiled on CUDA (eager flex materialises the full score matrix).

    Inside an outer ``torch.compile`` region the plain function is traced into that graph.
    On CPU the eager (unfused) implementation runs: tests only.

    ``FORCE_USE_FLEX_ATTENTION``: under 128 queries inductor would pick its flex-decoding kernel,
    which accepts no block mask tiled like ours (``dflash.models.masks.FLEX_TILE`` for queries and
    keys) and fails to lower ("No choices to select"); the main kernel handles any query length.
    """
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if q.is_cuda and not torch.compiler.is_compiling():
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    else:
        fn = flex_attention
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa,
              kernel_options={"FORCE_USE_FLEX_ATTENTION": True})
