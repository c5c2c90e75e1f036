"""Drafting for speculative decoding: the proposer interface and the DFlash drafter behind it.

A proposer drafts ``B − 1`` tokens per row from the decoding state
(:class:`dflash.inference.decode_state.DecodeState`). :class:`DFlashProposer` runs the drafter's own
training forward (:meth:`dflash.models.drafter.DFlashDraftModel.forward`) over the static feature
buffer, so what is trained is what drafts; :func:`drafter_hidden` is that forward under the
autocast training used, shared with the offline τ of :mod:`dflash.inference.acceptance`.
:class:`CachedDFlashProposer` computes the same math the way the serving engines do: each drafter
layer's context keys/values are cached per position, so a draft projects only the block and the
positions the last verification accepted, and its attention reads the cache under the decoding
attentions of :mod:`dflash.inference.decode_layers`.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.inference.decode_layers import ATTENTIONS, cache_attention, decode_block_mask, fuse_linears
from dflash.models.modeling_dflash import FULL_ATTENTION, apply_rope

__all__ = ["Proposer", "drafter_hidden", "drafter_for_decoding", "DFlashProposer", "CachedDFlashProposer",
           "cacheable"]


class Proposer(Protocol):
    """Drafts ``B − 1`` tokens per row from the decoding state (a test hook; the DFlash drafter is built in).

    Called as ``proposer(tokens [b, T_max], features [b, T_max, L·D], anchor [b])``: row ``r``'s
    anchor token is ``tokens[r, anchor[r]]`` and its context features are ``features[r, :anchor[r]]``.
    Returns ``[b, B − 1]`` int64 drafts for positions ``anchor + 1 … anchor + B − 1``.
    """

    block_size: int

    def __call__(self, tokens: Tensor, features: Tensor, anchor: Tensor) -> Tensor: ...


def drafter_hidden(drafter: nn.Module, features: Tensor, input_ids: Tensor, position_ids: Tensor,
                   doc_ids: Tensor, anchors: Tensor, keep: Tensor) -> Tensor:
    """:meth:`DFlashDraftModel.forward` under the autocast training used: autocast to the
    features' dtype when it is bf16 / fp16 (a half-precision target, on any device), else the
    features cast to the drafter's parameter dtype and no autocast."""
    features, autocast = _drafter_precision(drafter, features)
    with autocast:
        return drafter(features, input_ids, position_ids, doc_ids, anchors, keep)


def _drafter_precision(drafter: nn.Module, features: Tensor) -> tuple[Tensor, Any]:
    """``(features, context)`` for a drafter forward as training ran it: bf16 / fp16 features as they
    are under autocast to their dtype, other features cast to the drafter's parameter dtype with no
    autocast."""
    if features.dtype in (torch.bfloat16, torch.float16):
        return features, torch.autocast(features.device.type, dtype=features.dtype)
    return features.to(next(drafter.parameters()).dtype), nullcontext()


def drafter_for_decoding(drafter: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast ``drafter``'s weights to ``dtype`` when it is bf16 / fp16 (in place; returned).

    A drafter loaded with fp32 weights (:meth:`dflash.models.drafter.DFlashDraftModel.from_pretrained`)
    drafts under autocast to the features' half-precision dtype (:func:`drafter_hidden`), which casts
    every weight to that dtype at every draft: under CUDA graphs a cast kernel per weight per pass.
    Cast once, the drafter computes the same drafts (autocast rounds each weight the same way; the
    norms compute in fp32 either way) from the weights as they are served. An fp32 ``dtype`` leaves it as it is.
    """
    if dtype in (torch.bfloat16, torch.float16):
        drafter.to(dtype)
    return drafter


class DFlashProposer:
    """The DFlash drafter as a :class:`Proposer`: its training forward over the static buffers.

    One row per sequence, ``S`` = the buffer length given (``doc_ids`` all 1, ``position_ids =
    arange(S)``, ``anchors = anchor[:, None]``, ``keep`` all True); drafts = argmax of
    ``lm_head(hidden)`` at block positions 1 … B−1 (ties to the lowest id). The drafter's dense
    SDPA mask is used (``drafter.attention`` is set to ``sdpa``: fixed shapes, no BlockMask).

    Args:
        drafter: a :class:`dflash.models.drafter.DFlashDraftModel`.
    """

    def __init__(self, drafter: nn.Module) -> None:
        self.drafter = drafter.eval()
        self.drafter.attention = "sdpa"
        self.block_size = int(drafter.block_size)

    def __call__(self, tokens: Tensor, features: Tensor, anchor: Tensor) -> Tensor:
        b, s = tokens.shape
        dev = tokens.device
        pos = torch.arange(s, device=dev).expand(b, s)
        doc = torch.ones(b, s, dtype=torch.int32, device=dev)
        keep = torch.ones(b, 1, dtype=torch.bool, device=dev)
        hidden = drafter_hidden(self.drafter, features, tokens, pos, doc, anchor.view(b, 1), keep)  # [b,1,B,D]
        head = self.drafter.lm_head
        return head(hidden[:, 0, 1:].to(head.weight.dtype)).argmax(dim=-1)


def cacheable(drafter: nn.Module) -> bool:
    """Whether :class:`CachedDFlashProposer` computes ``drafter``'s drafts: every layer is full
    attention (a sliding layer's window would need each block query's own position in the cache
    rule; those drafters draft through :class:`DFlashProposer`)."""
    return all(getattr(layer, "layer_type", FULL_ATTENTION) == FULL_ATTENTION for layer in drafter.layers)


class CachedDFlashProposer:
    """The DFlash drafter as a :class:`Proposer`, its context keys/values cached per layer.

    What the serving engines keep for a DFlash drafter (vLLM ``qwen3_dflash.py``, SGLang
    ``models/dflash.py``): a layer's keys/values of context position ``j`` depend only on the
    target features at ``j`` (``k_norm(k_proj(hidden_norm(fc(f_j))))`` rotated to ``j``, and
    ``v_proj`` of the same), so they are computed once per position instead of once per draft.

    * :meth:`fill` writes positions ``0 … W−1`` of the given rows (after the prefill wrote their
      features).
    * A draft at anchor ``a`` (:meth:`__call__`), in each layer, projects the window ``a − B …
      a − 1`` of context (it holds every position the last verification accepted: the anchor moves
      at most ``B``) together with the block, writes both at their positions (the block at ``a …
      a + B − 1``, where no context slot is visible yet), and attends from the ``B`` block queries
      (rotated to ``a + k``) to slots ``≤ a + B − 1``:
      the context before the anchor and the whole block, bidirectionally, which is the training
      mask of a block (:func:`dflash.models.masks.dense_attention_mask`). Slots past the anchor
      that hold rejected drafts' features are never read, and are rewritten before they are.
    * Drafts are ``argmax lm_head(norm(h))`` at block positions ``1 … B−1``, as in
      :class:`DFlashProposer`; the forward runs under the same autocast (:func:`drafter_hidden`).
    * Each layer's projections run as the engines load them (vLLM ``QKVParallelLinear`` and
      ``MergedColumnParallelLinear``): one GEMM of the concatenated ``q_proj / k_proj / v_proj``
      weights over ``[window ; block]`` (the window's queries are not used) and one of ``gate_proj /
      up_proj``, so a draft launches 4 GEMMs a layer instead of 7
      (:func:`dflash.inference.decode_layers.fuse_linears`: the drafter's linears become views into
      the fused weights, as the target's fused layers do; a drafter moved or cast afterwards needs a
      new proposer).

    Same math as :class:`DFlashProposer` up to floating-point order (the context is projected a
    window at a time; the softmax runs over the cache's slots): in fp32 the same drafts over whole
    decodes (tested); in bf16 a draft at a near-tie of the drafter's logits can differ.

    **A stateful proposer.** A call is right only when the cache holds every row's context: after
    :meth:`fill` (the prefill) each row's anchor may move at most ``B`` between two calls, and
    every call passes all ``batch_size`` rows, as :class:`dflash.inference.generation.Generator`
    does. A row whose block reaches past ``T_max`` (a finished row, whose anchor the decoder lets
    run up to ``B − 1`` past its last position) has its block positions clamped to the last slot:
    its hidden states are not the training forward's, and nothing reads them.

    Args:
        drafter: a :class:`dflash.models.drafter.DFlashDraftModel` whose layers are all full
            attention (:func:`cacheable`).
        batch_size, max_len: the decoder's rows and ``T_max``.
        dtype: the features' dtype (the target's): the cache holds bf16 / fp16 keys under autocast,
            else the drafter's parameter dtype.
        attention: the cache attention, one of :data:`dflash.inference.decode_layers.ATTENTIONS`
            (verification's, :attr:`dflash.inference.decode_steps.DecodeSteps.block_attention`).

    Raises:
        ValueError: a sliding-attention layer, or an unknown ``attention``.
    """

    def __init__(self, drafter: nn.Module, batch_size: int, max_len: int, dtype: torch.dtype,
                 attention: str = "sdpa") -> None:
        if not cacheable(drafter):
            raise ValueError("CachedDFlashProposer: the drafter has sliding-attention layers; use DFlashProposer")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention: one of {ATTENTIONS}, got {attention!r}")
        self.drafter = drafter.eval()
        self.block_size = int(drafter.block_size)
        self.attention = attention
        self.max_len = int(max_len)
        attn = drafter.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = int(attn.num_heads), int(attn.num_kv_heads), int(attn.head_dim)
        self.group = self.heads // self.kv_heads
        param = next(drafter.parameters())
        cache_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else param.dtype
        shape = (int(batch_size), self.kv_heads, self.max_len, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=cache_dtype, device=param.device) for _ in drafter.layers]
        self.values = [torch.zeros(shape, dtype=cache_dtype, device=param.device) for _ in drafter.layers]
        for t in self.keys + self.values:
            torch._dynamo.mark_static_address(t)
        #: per layer: ``(weight [(H + 2·H_kv)·hd, D], bias)`` of q / k / v and ``(weight [2·I, D], bias)``
        #: of gate / up
        self.qkv = [fuse_linears([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
                    for layer in drafter.layers]
        self.gate_up = [fuse_linears([layer.mlp.gate_proj, layer.mlp.up_proj]) for layer in drafter.layers]
        for t in (t for pair in self.qkv + self.gate_up for t in pair if t is not None):
            torch._dynamo.mark_static_address(t)  # fixed weights: CUDA graphs read them where they are
        self.q_width = self.heads * self.head_dim

    def _write_kv(self, i: int, kv: Tensor, slots: Tensor, cos: Tensor, sin: Tensor, rows: Tensor) -> None:
        """Layer ``i``'s keys/values from ``kv [b', T, 2·H_kv·hd]``, the ``k_proj`` and ``v_proj``
        outputs side by side (normed by ``k_norm`` and rotated by ``cos, sin [b', 1, T, hd]``, as
        :class:`dflash.models.modeling_dflash.DFlashAttention` computes them from ``[context ; block]``),
        written at ``slots [b', T]`` of cache rows ``rows [b']``."""
        a = self.drafter.layers[i].self_attn
        b, t, _ = kv.shape
        k, v = kv.view(b, t, 2, self.kv_heads, self.head_dim).unbind(2)
        k = a.k_norm(k).transpose(1, 2)  # [b', H_kv, T, hd]
        v = v.transpose(1, 2)
        k = apply_rope(k, cos.to(k.dtype), sin.to(k.dtype))
        self.keys[i][rows.unsqueeze(1), :, slots] = k.transpose(1, 2).to(self.keys[i].dtype)
        self.values[i][rows.unsqueeze(1), :, slots] = v.transpose(1, 2).to(self.values[i].dtype)

    @torch.no_grad()
    def fill(self, features: Tensor, rows: Tensor) -> None:
        """Cache the context keys/values of positions ``0 … W−1`` of rows ``rows [b']`` from their
        features ``[b', W, L·D]`` (the prefill's; positions past a row's prompt get what its later
        drafts rewrite before reading)."""
        d = self.drafter
        b, w, _ = features.shape
        positions = torch.arange(w, device=features.device).expand(b, w)
        features, autocast = _drafter_precision(d, features)
        with autocast:
            ctx = d.hidden_norm(d.fc(features))  # [b', W, D]
            cos, sin = d.rotary_emb(positions, dtype=torch.float32)
            for i in range(len(d.layers)):
                w, bias = self.qkv[i]  # the k / v rows of the fused weight
                kv = F.linear(ctx, w[self.q_width:], None if bias is None else bias[self.q_width:])
                self._write_kv(i, kv, positions, cos, sin, rows)

    @torch.no_grad()
    def __call__(self, tokens: Tensor, features: Tensor, anchor: Tensor) -> Tensor:
        """Drafts ``[b, B − 1]`` int64 for positions ``anchor + 1 … anchor + B − 1`` of every row
        (the :class:`Proposer` call: ``tokens [b, S]``, ``features [b, S, L·D]``, ``anchor [b]``
        with ``anchor < S``; ``b`` = all the cache's rows, each anchor at most ``B`` past the
        previous call's or the prefill's: see the class docstring)."""
        head = self.drafter.lm_head
        return head(self.block_hidden(tokens, features, anchor)[:, 1:].to(head.weight.dtype)).argmax(dim=-1)

    @torch.no_grad()
    def block_hidden(self, tokens: Tensor, features: Tensor, anchor: Tensor) -> Tensor:
        """The drafter's final-normed hidden states of every row's block, ``[b, B, D]`` (what
        :func:`drafter_hidden` gives at ``anchors = anchor``, dtype as there), after updating the
        cache with the window before the anchor; arguments as :meth:`__call__`."""
        d = self.drafter
        b = anchor.shape[0]
        bs = self.block_size
        dev = anchor.device
        offsets = torch.arange(bs, device=dev)
        window = torch.clamp(anchor[:, None] - bs + offsets, min=0)  # [b, B]: holds every newly accepted position
        block_pos = torch.clamp(anchor[:, None] + offsets, max=self.max_len - 1)  # [b, B] (the clamp: finished rows)
        slots = torch.cat([window, block_pos], dim=1)  # [b, 2B]: the window's context, then the block
        # Every block query reads the slots up to the block's last position: the context before the
        # anchor and the whole block (bidirectional), the training mask of a block.
        last = block_pos[:, -1:].expand(b, bs).contiguous()
        if self.attention == "flex":
            mask = decode_block_mask(last, self.group * bs, self.max_len) if torch.compiler.is_compiling() else None
        else:
            mask = (torch.arange(self.max_len, device=dev) <= last[:, :1]).view(b, 1, 1, self.max_len)
        hq, hkv, hd, g = self.heads, self.kv_heads, self.head_dim, self.group
        features, autocast = _drafter_precision(d, features)
        feats = features.gather(1, window.unsqueeze(-1).expand(-1, -1, features.shape[-1]))
        rows = torch.arange(b, device=dev)
        with autocast:
            ctx = d.hidden_norm(d.fc(feats))  # [b, B, D]: the window's context
            x = d.block_embeddings(tokens, anchor[:, None]).reshape(b, bs, -1)  # [b, B, D]
            cos, sin = d.rotary_emb(slots, dtype=torch.float32)  # [b, 1, 2B, hd]
            cos_q, sin_q = cos[:, :, bs:], sin[:, :, bs:]
            for i, layer in enumerate(d.layers):
                a = layer.self_attn
                h = layer.input_layernorm(x)
                # the window's context and the block in one projection, as the training forward
                # projects [context ; block]; the block's rows give the queries too
                qkv = F.linear(torch.cat([ctx.to(h.dtype), h], dim=1), *self.qkv[i])  # [b, 2B, (H + 2·H_kv)·hd]
                self._write_kv(i, qkv[..., self.q_width:], slots, cos, sin, rows)
                q = a.q_norm(qkv[:, bs:, :self.q_width].reshape(b, bs, hq, hd)).transpose(1, 2)  # [b, H, B, hd]
                q = apply_rope(q, cos_q.to(q.dtype), sin_q.to(q.dtype))
                # [b, H, B, hd] → [b, H_kv, g·B, hd]: the g query heads of a group read one key/value head
                keys, values = self.keys[i], self.values[i]
                qf = q.view(b, hkv, g, bs, hd).reshape(b, hkv, g * bs, hd).to(keys.dtype)
                out = cache_attention(qf, keys, values, last, mask, a.scale, self.attention)
                out = out.view(b, hkv, g, bs, hd).reshape(b, hq, bs, hd).transpose(1, 2).reshape(b, bs, hq * hd)
                x = x + a.o_proj(out.to(x.dtype))
                gate, up = F.linear(layer.post_attention_layernorm(x), *self.gate_up[i]).chunk(2, dim=-1)
                x = x + layer.mlp.down_proj(F.silu(gate) * up)  # DFlashDecoderLayer.mlp_block, one GEMM for gate / up
            return d.norm(x)
