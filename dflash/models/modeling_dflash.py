"""A DFlash drafter for ``transformers.AutoModel.from_pretrained(dir, trust_remote_code=True)``.

Shipped beside the weights of an exported drafter (``config.json`` names it in ``auto_map``).
Self-contained: it imports torch and transformers only, and runs with transformers 5.x.

The drafter (DFlash paper, arXiv 2602.06036, §3; public layout of ``z-lab/dflash``
``dflash/models/drafter.py``):

* ``target_hidden [b, C, L·D]``: the target's hidden states of the ``L`` layers
  ``dflash_config.target_layer_ids`` (``hidden_states[id + 1]``), concatenated, at the ``C``
  context positions; ``fc`` (``L·D → D``) then ``hidden_norm`` (RMSNorm) make the context.
* ``noise_embedding [b, Q, D]``: the target's input embedding of the block
  ``[anchor token, mask_token_id × (Q − 1)]``.
* ``position_ids [b, C + Q]``: positions of ``[context ; block]`` (RoPE).
* Each decoder layer (pre-RMSNorm, per-head q/k RMSNorm, RoPE, SwiGLU MLP) takes queries from the
  block and keys / values from ``[context ; block]`` through the same projections. A
  ``full_attention`` layer attends to every key; a ``sliding_attention`` layer is causal with a
  window of ``sliding_window`` key positions that counts the query itself (the rule vLLM's and
  SGLang's DFlash drafters run): with keys numbered ``0 … K − 1`` and the ``Q`` queries at
  ``K − Q … K − 1``, query ``p`` sees keys ``p − W + 1 … p``.
* Output: the final-normed block hidden states ``[b, Q, D]``; logits come from the target's
  LM head (:meth:`DFlashDraftModel.compute_logits`).

A ``past_key_values`` cache (``transformers.DynamicCache``) may carry the keys and values of
earlier context positions, as in the reference decoding loop.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

SLIDING_ATTENTION = "sliding_attention"


def _dflash_value(config: Any, name: str, default: Any = None) -> Any:
    """``config.dflash_config[name]``, else ``config.<name>``, else ``default``."""
    value = (getattr(config, "dflash_config", None) or {}).get(name)
    return getattr(config, name, default) if value is None else value


class DFlashRMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) · weight`` over the last dim, in fp32, returned in x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * h.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def sliding_window_mask(q_len: int, k_len: int, window: int, device: torch.device) -> torch.Tensor:
    """``[q_len, k_len]`` bool: query ``p = k_len − q_len + i`` sees keys ``p − window + 1 … p``."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device).unsqueeze(1)
    k_pos = torch.arange(k_len, device=device).unsqueeze(0)
    return (k_pos <= q_pos) & (q_pos - k_pos < window)


class DFlashAttention(nn.Module):
    """Block queries over ``[context ; block]`` keys and values."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None)
        self.is_causal = bool(layer_types) and layer_types[layer_idx] == SLIDING_ATTENTION
        self.sliding_window = config.sliding_window if self.is_causal else None

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None, past_key_values: Any = None) -> torch.Tensor:
        """``x [b, Q, D]`` block, ``ctx [b, C, D]`` context, ``cos``/``sin [b, 1, C + Q, hd]`` → ``[b, Q, D]``."""
        b, q_len, _ = x.shape
        kv_in = torch.cat([ctx.to(x.dtype), x], dim=1)
        kv_len = kv_in.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(b, kv_len, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, kv_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = _rope(q, cos[..., -q_len:, :].to(q.dtype), sin[..., -q_len:, :].to(q.dtype))
        k = _rope(k, cos.to(k.dtype), sin.to(k.dtype))
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        if attention_mask is None and self.sliding_window is not None:
            attention_mask = sliding_window_mask(q_len, k.shape[2], self.sliding_window, x.device)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))


class DFlashMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) · up(x))``."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    """``x + attn(norm(x), ctx)``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None, past_key_values: Any = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, attention_mask, past_key_values)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    """The DFlash drafter (no embedding, no LM head: both are the target's).

    Attributes read by decoding loops: ``block_size``, ``mask_token_id``, ``target_layer_ids``.
    """

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        self.target_layer_ids = [int(i) for i in _dflash_value(config, "target_layer_ids")]
        self.block_size = int(_dflash_value(config, "block_size", 16))
        self.mask_token_id = int(_dflash_value(config, "mask_token_id"))
        d = config.hidden_size
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        self.norm = DFlashRMSNorm(d, config.rms_norm_eps)
        self.head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
        rope = getattr(config, "rope_parameters", None) or {}
        self.rope_theta = float(rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, DFlashRMSNorm):
            nn.init.ones_(module.weight)

    def rotary(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids [b, T]`` → ``(cos, sin)`` each ``[b, 1, T, head_dim]`` fp32 (default RoPE).

        The frequencies are computed here rather than kept in a buffer: transformers 5.x builds the
        module without running tensor initialisers, which leaves non-persistent buffers unset.
        """
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=position_ids.device) / self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** exponent)
        freqs = position_ids.float().unsqueeze(-1) * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        return emb.cos(), emb.sin()

    def forward(self, position_ids: torch.Tensor, noise_embedding: torch.Tensor, target_hidden: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None, past_key_values: Any = None,
                use_cache: bool = False, **kwargs: Any) -> torch.Tensor:
        """Final-normed hidden states of the block.

        Args:
            position_ids: ``[b, C + Q]`` int64 positions of ``[context ; block]``.
            noise_embedding: ``[b, Q, D]`` the block's embeddings (the target's).
            target_hidden: ``[b, C, L·D]`` concatenated target hidden states.
            attention_mask: optional bool / additive mask broadcastable to ``[b, H, Q, K]``
                overriding the per-layer rule (``K`` = keys incl. any cached ones).
            past_key_values: optional ``transformers.DynamicCache`` holding earlier context.

        Returns:
            ``[b, Q, D]``.
        """
        ctx = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        x = noise_embedding.to(self.fc.weight.dtype)
        cos, sin = self.rotary(position_ids)
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, attention_mask, past_key_values)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, output_head: nn.Module) -> torch.Tensor:
        """Logits of the block through the target's LM head: ``[b, Q, V]``."""
        return output_head(hidden.to(output_head.weight.dtype))
