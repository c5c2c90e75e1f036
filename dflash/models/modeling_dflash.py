"""The DFlash drafter's layers, and the drafter as a ``transformers.PreTrainedModel``.

One module serves two roles:

* **Training and decoding.** :class:`dflash.models.drafter.DFlashDraftModel` (the drafter that
  trains) builds its layers from :class:`RMSNorm`, :class:`RotaryEmbedding` and
  :class:`DFlashDecoderLayer`; the fused target layers of decoding
  (:mod:`dflash.inference.decode_layers`) rotate with :func:`apply_rope`.
* **Serving.** The export (``python -m dflash.inference.export``) copies this file, unchanged, beside
  the weights as ``modeling_dflash.py``; ``config.json`` names :class:`DFlashDraftModel` in
  ``auto_map``, so ``transformers.AutoModel.from_pretrained(dir, trust_remote_code=True)`` builds
  the drafter from the very layers that were trained. The file therefore imports the standard
  library, torch (≥ 2.5, for ``enable_gqa``) and transformers (5.x) only, never the project.

The drafter (DFlash paper, arXiv 2602.06036, §3; public layout of ``z-lab/dflash``
``dflash/models/drafter.py``):

* ``target_hidden [b, C, L·D]``: the target's hidden states of the ``L`` layers
  ``dflash_config.target_layer_ids`` (``hidden_states[id + 1]``), concatenated, at the ``C``
  context positions; ``fc`` (``L·D → D``) then ``hidden_norm`` (RMSNorm) make the context.
* ``noise_embedding [b, Q, D]``: the target's input embedding of the block
  ``[anchor token, mask_token_id × (Q − 1)]``.
* Each decoder layer is Qwen3-style (pre-RMSNorm, per-head q/k RMSNorm, RoPE, SwiGLU MLP) and
  takes queries from the block and keys / values from ``[context ; block]`` through the same
  projections (*KV injection*). A ``full_attention`` layer attends to every key it is given; a
  ``sliding_attention`` layer is causal with a window of ``sliding_window`` key positions that
  counts the query itself (the rule vLLM's and SGLang's DFlash drafters run): with keys numbered
  ``0 … K − 1`` and the ``Q`` queries at ``K − Q … K − 1``, query ``p`` sees keys
  ``p − W + 1 … p`` (:func:`sliding_window_mask`). Training passes its own masks
  (``dflash.models.masks``: a dense SDPA mask or a flex_attention ``BlockMask``) instead.
* Output: the final-normed block hidden states ``[b, Q, D]``; logits come from the target's
  LM head (:meth:`DFlashDraftModel.compute_logits`).

A ``past_key_values`` cache (``transformers.DynamicCache``) may carry the keys and values of
earlier context positions, as in the reference decoding loop.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

__all__ = ["FULL_ATTENTION", "SLIDING_ATTENTION", "RMSNorm", "RotaryEmbedding", "rotate_half", "apply_rope",
           "sliding_window_mask", "DFlashAttention", "SwiGLU", "DFlashDecoderLayer", "DFlashDraftModel"]

#: ``layer_types`` values of a transformers config (Qwen3) that the drafter's layers take.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


# --------------------------------------------------------------------------- layers


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
    """Default RoPE (Su et al., arXiv 2104.09864; Qwen3): ``cos, sin`` of integer positions.

    Frequency ``i`` of ``head_dim / 2`` is ``theta^(−2i / head_dim)``, each used for two channels
    paired by :func:`rotate_half`. The frequencies are computed in :meth:`forward` rather than kept
    in a buffer: transformers 5.x builds a remote-code model without running tensor initialisers,
    which would leave a non-persistent buffer unset. The module has no parameters.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = int(head_dim)
        self.theta = float(theta)

    def forward(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """``positions [R, T]`` int64 → ``(cos, sin)`` each ``[R, 1, T, head_dim]`` in ``dtype``."""
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=positions.device) / self.head_dim
        inv_freq = 1.0 / (self.theta ** exponent)
        freqs = positions.float().unsqueeze(-1) * inv_freq  # [R, T, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] → [−x2, x1]`` over the last dimension (halves of ``head_dim``): the channel pairing
    of RoPE in Llama / Qwen3 (transformers ``apply_rotary_pos_emb``)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x · cos + rotate_half(x) · sin``: ``x [..., T, hd]`` rotated by ``cos, sin`` broadcastable to it."""
    return x * cos + rotate_half(x) * sin


def sliding_window_mask(q_len: int, k_len: int, window: int, device: torch.device) -> Tensor:
    """The engines' sliding-window rule as a bool mask ``[q_len, k_len]`` (True = attend).

    The queries are the last ``q_len`` of the ``k_len`` keys: query ``i`` is at position
    ``p = k_len − q_len + i`` and sees keys ``p − window + 1 … p`` (the window counts the query
    itself; vLLM ``qwen3_dflash.py``, SGLang ``models/dflash.py``: a causal layer with
    ``window_left = window − 1``).
    """
    q_pos = torch.arange(k_len - q_len, k_len, device=device).unsqueeze(1)
    k_pos = torch.arange(k_len, device=device).unsqueeze(0)
    return (k_pos <= q_pos) & (q_pos - k_pos < window)


def _head_dim(config: Any) -> int:
    """``config.head_dim``, else ``hidden_size / num_attention_heads`` (a Qwen3 config may omit it)."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


class DFlashAttention(nn.Module):
    """Block queries over ``[context ; block]`` keys and values (KV injection).

    Args:
        config: any object with ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
            ``head_dim`` (optional), ``rms_norm_eps`` and ``sliding_window`` (read for a sliding
            layer): the training ``DFlashConfig`` or a transformers ``Qwen3Config``.
        layer_type: ``full_attention`` or ``sliding_attention``: the rule applied when
            :meth:`forward` is given no mask.
        layer_idx: this layer's index in a ``past_key_values`` cache (``None``: no cache).

    Raises:
        ValueError: a sliding layer without a positive ``config.sliding_window``.
    """

    def __init__(self, config: Any, layer_type: str = FULL_ATTENTION, layer_idx: Optional[int] = None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        self.scale = self.head_dim ** -0.5
        self.layer_idx = layer_idx
        self.sliding_window = None
        if layer_type == SLIDING_ATTENTION:
            if not getattr(config, "sliding_window", None):
                raise ValueError(f"sliding_window: a {SLIDING_ATTENTION} layer needs a window, got "
                                 f"{getattr(config, 'sliding_window', None)!r}")
            self.sliding_window = int(config.sliding_window)
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, rope_q: tuple[Tensor, Tensor], rope_kv: tuple[Tensor, Tensor],
                mask: Any = None, past_key_values: Any = None) -> Tensor:
        """One attention sub-layer.

        Args:
            x: normed block hidden states ``[R, Q, D]``.
            ctx: context features ``[R, S, D]`` (already ``fc`` + ``hidden_norm``).
            rope_q: ``(cos, sin)`` of the block positions, ``[R, 1, Q, hd]``.
            rope_kv: ``(cos, sin)`` of ``[context ; block]`` positions, ``[R, 1, S + Q, hd]``.
            mask: a dense bool or additive mask broadcastable to ``[R, H, Q, K]`` (SDPA), a
                flex_attention ``BlockMask``, or ``None``: every key for a full layer,
                :func:`sliding_window_mask` for a sliding one. ``K`` counts cached keys too.
            past_key_values: a ``transformers.DynamicCache`` holding earlier keys and values
                (updated in place), or ``None``.

        Returns:
            ``[R, Q, D]``.

        Raises:
            ValueError: a cache given to a layer built without ``layer_idx``.
        """
        r, q_len, _ = x.shape
        kv_in = torch.cat([ctx.to(x.dtype), x], dim=1)  # [R, S + Q, D]
        kv_len = kv_in.shape[1]
        q = self.q_norm(self.q_proj(x).view(r, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(r, kv_len, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(r, kv_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, rope_q[0].to(q.dtype), rope_q[1].to(q.dtype))
        k = apply_rope(k, rope_kv[0].to(k.dtype), rope_kv[1].to(k.dtype))
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        if past_key_values is not None:
            if self.layer_idx is None:
                raise ValueError("past_key_values: this attention layer was built without a layer_idx")
            k, v = past_key_values.update(k, v, self.layer_idx)
        if mask is None and self.sliding_window is not None:
            mask = sliding_window_mask(q_len, k.shape[2], self.sliding_window, x.device)
        gqa = self.num_heads != self.num_kv_heads
        if mask is None or isinstance(mask, Tensor):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        else:
            out = _flex_attention(q, k, v, mask, self.scale, gqa)
        return self.o_proj(out.transpose(1, 2).reshape(r, q_len, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    """Qwen3 MLP (Shazeer, arXiv 2002.05202): ``down(silu(gate(x)) · up(x))``, ``dim → hidden → dim``."""

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

    Args:
        config: as for :class:`DFlashAttention`, plus ``intermediate_size``.
        layer_type: ``full_attention`` or ``sliding_attention`` (kept as :attr:`layer_type`).
        layer_idx: the layer's index in a ``past_key_values`` cache (``None``: no cache).
    """

    def __init__(self, config: Any, layer_type: str = FULL_ATTENTION, layer_idx: Optional[int] = None) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = DFlashAttention(config, layer_type, layer_idx)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, rope_q: tuple[Tensor, Tensor], rope_kv: tuple[Tensor, Tensor],
                mask: Any = None, past_key_values: Any = None) -> Tensor:
        """``x [R, Q, D]`` block, ``ctx [R, S, D]`` context → ``[R, Q, D]`` (arguments as
        :meth:`DFlashAttention.forward`)."""
        return self.mlp_block(self.attention_block(x, ctx, rope_q, rope_kv, mask, past_key_values))

    def attention_block(self, x: Tensor, ctx: Tensor, rope_q: tuple[Tensor, Tensor],
                        rope_kv: tuple[Tensor, Tensor], mask: Any = None, past_key_values: Any = None) -> Tensor:
        """``x + attn(norm(x), ctx)``: ``[R, Q, D]`` in and out."""
        return x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_kv, mask, past_key_values)

    def mlp_block(self, x: Tensor) -> Tensor:
        """``x + mlp(norm(x))``: ``[..., D]`` in and out, token by token (so it may run on any
        slice of the block tokens)."""
        return x + self.mlp(self.post_attention_layernorm(x))


_compiled_flex: Optional[Any] = None


def _flex_attention(q: Tensor, k: Tensor, v: Tensor, block_mask: Any, scale: float, gqa: bool) -> Tensor:
    """flex_attention, compiled on CUDA (eager flex materialises the full score matrix).

    Inside an outer ``torch.compile`` region the plain function is traced into that graph.
    On CPU the eager (unfused) implementation runs: tests only.

    ``FORCE_USE_FLEX_ATTENTION``: under 128 queries inductor would pick its flex-decoding kernel,
    which accepts no block mask tiled like training's (128 queries and keys a tile) and fails to
    lower ("No choices to select"); the main kernel handles any query length.
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


# --------------------------------------------------------------------------- the served model


def _dflash_value(config: Any, name: str, default: Any = None) -> Any:
    """``config.dflash_config[name]``, else ``config.<name>``, else ``default``."""
    value = (getattr(config, "dflash_config", None) or {}).get(name)
    return getattr(config, name, default) if value is None else value


class DFlashDraftModel(PreTrainedModel):
    """The DFlash drafter for ``AutoModel`` (no embedding, no LM head: both are the target's).

    Built from a ``Qwen3Config`` holding ``dflash_config`` (``target_layer_ids``, ``block_size``,
    ``mask_token_id``), ``layer_types`` and ``sliding_window``; its weights are named as the
    training drafter's (``fc``, ``hidden_norm``, ``layers.{i}.…``, ``norm``).

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
        types = getattr(config, "layer_types", None) or [FULL_ATTENTION] * config.num_hidden_layers
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, types[i], i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        rope = getattr(config, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)
        self.rotary_emb = RotaryEmbedding(_head_dim(config), theta)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def forward(self, position_ids: Tensor, noise_embedding: Tensor, target_hidden: Tensor,
                attention_mask: Optional[Tensor] = None, past_key_values: Any = None,
                use_cache: bool = False, **kwargs: Any) -> Tensor:
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
        q_len = x.shape[1]
        cos, sin = self.rotary_emb(position_ids)
        rope_kv, rope_q = (cos, sin), (cos[..., -q_len:, :], sin[..., -q_len:, :])
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_kv, attention_mask, past_key_values)
        return self.norm(x)

    def compute_logits(self, hidden: Tensor, output_head: nn.Module) -> Tensor:
        """Logits of the block through the target's LM head: ``[b, Q, V]``."""
        return output_head(hidden.to(output_head.weight.dtype))
