"""The target's decoder layers rewritten for static-cache decoding: fewer, larger kernels per layer.

At batch 1 a small target decodes at the speed of its kernel launches, not of its weights
(SmolLM2-135M: ~450 kernels a token through the transformers layers, each a few microseconds on an
H200). :class:`FusedDecoderLayer` runs the same math as a Llama / Qwen2 / Qwen3 / Mistral decoder
layer with

* one matmul for the query, key and value projections (their weights concatenated, as vLLM's
  ``QKVParallelLinear`` and gpt-fast's ``wqkv`` do) and one for the MLP's gate and up projections
  (vLLM ``MergedColumnParallelLinear``, gpt-fast ``w1``/``w3``);
* grouped-query attention without copying keys/values per query head: the ``g = H / H_kv`` query
  heads that share a key/value head are folded into the query length, so attention reads the
  static cache ``[b, H_kv, T_max, hd]`` in place (the FlashInfer / vLLM decode layout);
* the cache write as one indexed store per buffer, which inductor fuses with the rotary embedding
  that produces it;
* attention by :func:`torch.nn.functional.scaled_dot_product_attention` (``"sdpa"``), or written out as two batched matmuls around an fp32 masked softmax
  (``"matmul"``): a fused SDPA kernel spends a 64- or 128-row tile on the 3–48 query rows of a
  decoding step, where inductor can fuse mask, scale and softmax into one small kernel; or by
  :func:`torch.nn.attention.flex_attention.flex_attention` (``"flex"``) with the causal and
  sliding-window rule as a ``score_mod`` that reads the step's positions, so no mask tensor is
  built or copied: under ``torch.compile`` inductor lowers a step of fewer than 128 query rows to
  its split-KV flex-decoding kernel (``torch/_inductor/kernel/flex/flex_decoding.py``; the folded
  query heads keep ``H = H_kv``, so its power-of-two GQA condition holds for any group size); or
  as broadcast products and sums (``"reduce"``, :func:`reduce_attention`), which inductor splits
  over the cache slots like flash-decoding. ``"X+Y"`` picks ``X`` for the one-token step and ``Y``
  for the multi-token forwards (:func:`split_attention`). A prefill into empty cache rows runs
  ``"causal"`` (:data:`PREFILL_ATTENTION`): the prompt attends to its own keys only, through SDPA's
  causal kernels (FlashAttention on CUDA), never reading or masking the rest of the cache.

The original ``nn.Linear`` weights become views into the fused tensors, so the model's own forward
(prefill in other code, training) keeps working and no weight is stored twice.

Supported layers: ``self_attn.{q,k,v,o}_proj`` (optionally ``q_norm``/``k_norm`` on the head
dimension, Qwen3), ``mlp.{gate,up,down}_proj`` with ``mlp.act_fn``, ``input_layernorm`` and
``post_attention_layernorm``; anything else (attention soft-capping, sinks, other MLPs) is reported
by :func:`fusable` and decoded through the transformers layers instead.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflash.models.modeling_dflash import apply_rope

__all__ = ["ATTENTION", "ATTENTIONS", "BATCH_ATTENTION", "FLEX_KV_BLOCK", "FLEX_Q_BLOCK", "FusedDecoderLayer",
           "PREFILL_ATTENTION", "REDUCE_MAX_BATCH", "attention_spec_error", "cache_attention",
           "causal_prefill_attention", "decode_block_mask", "decode_score_mod", "default_attention", "fusable",
           "fuse_layers", "reduce_attention", "split_attention"]

#: Decoding's default attention spec (:func:`split_attention`): ``"reduce"`` in the one-token step,
#: ``"matmul"`` in verification (and in the cached drafter's layers). Measured at batch 1, bf16,
#: SmolLM2-135M (docs/benchmarks.md, Decoding, Attention in verification): ``reduce`` in the
#: one-token step gave 564 target-only tokens/s against 457 with SDPA alone (H200, prompts of up to
#: 544 tokens; ``reduce`` in verification made a pass 40 % slower); in verification, two matmuls
#: around an fp32 softmax cut the time per speculative token from 0.995 to 0.757 ms against
#: cuDNN's SDPA (H100, a 1,152-position decoder), whose kernel walks every cache slot in one thread
#: block per key/value head.
ATTENTION = "reduce+matmul"
#: The default attention spec for batches above :data:`REDUCE_MAX_BATCH` rows.
BATCH_ATTENTION = "sdpa"
#: The largest batch that gets :data:`ATTENTION` by default: ``reduce`` was measured faster at batch
#: 1 only; larger batches keep SDPA, with which regeneration (256–512 rows) was measured.
REDUCE_MAX_BATCH = 1
#: Every attention a fused layer implements: ``"sdpa"``, ``"matmul"`` (softmax(q·kᵀ·scale + mask)·v,
#: fp32 softmax), ``"flex"`` (flex_attention with the mask as a ``score_mod``, :func:`decode_score_mod`)
#: and ``"reduce"`` (fp32 attention written as broadcast products and sums that inductor splits over
#: the cache slots, :func:`reduce_attention`).
ATTENTIONS = ("sdpa", "matmul", "flex", "reduce")
#: The attention of a prefill into empty cache rows (positions ``0 … T−1`` in every row): the
#: prompt's queries over the prompt's own keys, causal (:func:`causal_prefill_attention`). Not a
#: decoding spec: the steps read the cache, this reads only the forward's own keys.
PREFILL_ATTENTION = "causal"


def default_attention(batch_size: int) -> str:
    """The attention spec decoding uses when none is given: :data:`ATTENTION` up to
    :data:`REDUCE_MAX_BATCH` rows, :data:`BATCH_ATTENTION` above (``reduce``'s fp32 broadcast sums
    pay off when one row's few query heads would leave a fused kernel's thread blocks idle, not
    when hundreds of rows fill them)."""
    return ATTENTION if batch_size <= REDUCE_MAX_BATCH else BATCH_ATTENTION


def split_attention(spec: str) -> tuple[str, str]:
    """``(one-token attention, multi-token attention)`` of an attention spec.

    ``spec`` is one of :data:`ATTENTIONS` (every forward) or ``"X+Y"``: ``X`` for the target-only
    one-token step, ``Y`` for every forward of several tokens (verification of a block; a prefill of
    the fused layers runs :data:`PREFILL_ATTENTION`).
    The two regimes favour different kernels: a one-token step has ``g`` query rows per key/value
    head, a verification ``g·B``.

    Raises:
        ValueError: a part that is not in :data:`ATTENTIONS`, or more than two parts.
    """
    parts = spec.split("+") if isinstance(spec, str) else [spec]
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or any(p not in ATTENTIONS for p in parts):
        raise ValueError(f"attention: one of {ATTENTIONS} or 'X+Y' of them (one-token step + multi-token "
                         f"forwards), got {spec!r}")
    return parts[0], parts[1]

def attention_spec_error(spec: str) -> Optional[str]:
    """What is wrong with an attention spec, for a message that names the option (``None`` when
    :func:`split_attention` takes it)."""
    try:
        split_attention(spec)
    except ValueError as e:
        return str(e).removeprefix("attention: ")
    return None


_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
#: Attribute of a decoder layer holding its fused tensors ``(wqkv, bqkv, w_gate_up, b_gate_up)``.
FUSED_ATTR = "_dflash_fused"
#: Config attributes that change a layer's math in ways this module does not implement.
_UNSUPPORTED_CONFIG = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar")


def fusable(layer: nn.Module, config: object) -> Optional[str]:
    """Why ``layer`` cannot be run by :class:`FusedDecoderLayer` (``None`` when it can).

    Args:
        layer: one decoder layer of a transformers model.
        config: the model's (text) config.
    """
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or not all(isinstance(getattr(attn, n, None), nn.Linear) for n in _ATTN):
        return "attention without q/k/v/o linear projections"
    if mlp is None or not all(isinstance(getattr(mlp, n, None), nn.Linear) for n in _MLP) \
            or not callable(getattr(mlp, "act_fn", None)):
        return "MLP without gate/up/down projections and act_fn"
    for name in ("input_layernorm", "post_attention_layernorm"):
        if not isinstance(getattr(layer, name, None), nn.Module):
            return f"no {name}"
    extra = [n for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm", "sinks") if hasattr(layer, n)
             or hasattr(attn, n)]
    if extra:
        return f"unsupported parts {extra}"
    set_attrs = [a for a in _UNSUPPORTED_CONFIG if getattr(config, a, None) is not None]
    if set_attrs:
        return f"unsupported config {set_attrs}"
    return None


def decode_score_mod(positions: Tensor, window: Optional[int] = None) -> Callable[..., Tensor]:
    """The decoding attention rule as a flex_attention ``score_mod`` over the folded query layout.

    Query row ``q`` of batch row ``b`` is token ``t = q mod T`` of that row (query head
    ``j = q div T`` of a key/value group, the layout of :meth:`FusedDecoderLayer.forward`), at
    absolute position ``p = positions[b, t]``. Cache slot ``k`` keeps its score iff ``k ≤ p`` and,
    in a sliding-window layer, ``p − k < window`` (transformers' sliding layers); every other score
    becomes ``−inf``. Slots past the cache's written length are excluded by ``k ≤ p`` (the step
    writes slot ``p`` before attending), so stale rejected drafts are never read. Slot ``p`` itself
    always survives, so no row is fully masked.

    The function reads ``positions`` in place and closes over nothing else that changes per step,
    so a compiled step replays without a new block mask or a host sync.

    Args:
        positions: ``[b', T]`` int64 absolute positions of the step's tokens.
        window: sliding window ``W`` in tokens, ``None`` = full causal attention.

    Returns:
        ``score_mod(score, b, h, q_idx, kv_idx) -> score`` (scalar tensors, flex_attention's signature).
    """
    tokens = positions.shape[-1]

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        p = positions[b, q_idx % tokens]
        keep = kv_idx <= p
        if window is not None:
            keep = keep & (p - kv_idx < window)
        return torch.where(keep, score, -float("inf"))

    return score_mod


#: Cache slots per key/value block of :func:`decode_block_mask` (flex_attention's default block).
FLEX_KV_BLOCK = 128
#: The query block of :func:`decode_block_mask` is the smallest multiple of this covering the
#: forward's folded query rows (flex_attention's largest query tile).
FLEX_Q_BLOCK = 128


def decode_block_mask(positions: Tensor, query_rows: int, max_len: int, block: int = FLEX_KV_BLOCK) -> BlockMask:
    """The cache blocks a decoding forward can read, per batch row: blocks ``0 … ⌊max_t p / block⌋``
    of ``block`` slots, where ``p = positions[b, t]``; the later blocks hold only slots ``> p`` for
    every query of the row, which :func:`decode_score_mod` masks anyway, so skipping them changes
    no score. flex_attention's kernels then read ``O(p)`` slots of each row, not ``T_max``: a batch
    of short rows in a cache sized for long ones costs what its rows hold.

    Args:
        positions: ``[b', T]`` int64 absolute positions of the forward's tokens.
        query_rows: ``Q`` of the folded query layout (``g·T``).
        max_len: ``T_max``, the cache's slots.
        block: slots per key/value block.

    Returns:
        a :class:`torch.nn.attention.flex_attention.BlockMask` over ``[b', 1, Q, T_max]`` (one query
        block; the same blocks for every head), without the transposed indices a backward needs.
    """
    blocks = -(-max_len // block)
    last = positions.amax(dim=-1)  # [b']
    count = torch.clamp(last // block + 1, max=blocks).to(torch.int32).view(-1, 1, 1)
    order = torch.arange(blocks, device=positions.device, dtype=torch.int32).expand(positions.shape[0], 1, 1, blocks)
    # One query block over all ``Q`` rows, a multiple of 128: flex-decoding's kernels (``Q`` < 128, a
    # step or a verification) need a multiple of their 16-row tile, flex_attention's own kernels (a
    # longer forward) a multiple of their 64- or 128-row tile.
    q_block = -(-max(query_rows, 1) // FLEX_Q_BLOCK) * FLEX_Q_BLOCK
    return BlockMask.from_kv_blocks(count, order, BLOCK_SIZE=(q_block, block), seq_lengths=(query_rows, max_len),
                                    compute_q_blocks=False)


def _flex(q: Tensor, keys: Tensor, values: Tensor, score_mod: Callable[..., Tensor], scale: float,
          block_mask: Optional[BlockMask] = None) -> Tensor:
    """flex_attention of ``q [b', H_kv, Q, hd]`` over ``keys/values [b', H_kv, T_max, hd]`` under
    ``score_mod`` (no ``enable_gqa``: the query heads are folded into ``Q``), visiting only the
    key/value blocks of ``block_mask`` (:func:`decode_block_mask`; ``None`` = all).

    Inside ``torch.compile`` (the step functions) flex_attention is traced into the graph and
    lowered to a fused kernel. Outside it (prefill, CPU decoding) ``score_mod`` is applied to the
    dense fp32 score matrix over broadcast index tensors: what flex_attention's own unfused
    fallback computes, without the dynamo trace that fallback runs for every new prompt width
    (the skipped blocks hold only scores that ``score_mod`` sets to ``−inf``).
    """
    if torch.compiler.is_compiling():
        return flex_attention(q, keys, values, score_mod=score_mod, block_mask=block_mask, scale=scale)
    b, h, rows, _ = q.shape
    dev = q.device
    idx = [torch.arange(n, device=dev).view([-1 if i == d else 1 for i in range(4)])
           for d, n in enumerate((b, h, rows, keys.shape[2]))]
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # [b', H_kv, Q, T_max]
    probs = score_mod(scores, *idx).softmax(dim=-1)
    return torch.matmul(probs.to(values.dtype), values)


def reduce_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """``softmax(q·kᵀ·scale, masked)·v`` in fp32, written for inductor as broadcast products and sums.

    A decoding step has ``g`` (one token) or ``g·B`` (a block) query rows per key/value head against
    ``T_max`` cache slots. A fused attention kernel (cuDNN, flex) walks the slots in one thread block
    per head and query tile, so its time grows with ``T_max`` (22 µs a layer at ``T_max`` ≈ 600 on
    an H200). Written as sums, inductor spreads the slots over many blocks: one kernel for the
    scores (a sum over ``hd``, the rotary embedding and casts fused in), one for the masked softmax
    and one for the weighted sum of values (a sum over ``T_max``): the split-KV idea of
    flash-decoding (Dao et al., 2023) without writing a kernel; 7.7 µs a layer measured.

    Outside ``torch.compile`` (prefill, CPU decoding) the same fp32 math runs as two matmuls, since
    eagerly the broadcast products would be materialised (``b'·H_kv·Q·T_max·hd`` elements).

    Args:
        q: ``[b', H_kv, Q, hd]``; keys, values: ``[b', H_kv, T_max, hd]``.
        mask: ``[b', 1, Q, T_max]`` bool, True = may attend (every row has at least one True).
        scale: the softmax scale.

    Returns:
        ``[b', H_kv, Q, hd]`` in ``values.dtype``.
    """
    qf, kf, vf = q.float(), keys.float(), values.float()
    compiling = torch.compiler.is_compiling()
    if compiling:
        scores = (qf.unsqueeze(3) * kf.unsqueeze(2)).sum(-1)  # [b', H_kv, Q, T_max]
    else:
        scores = torch.matmul(qf, kf.transpose(-1, -2))
    probs = (scores * scale).masked_fill(~mask, float("-inf")).softmax(dim=-1)
    out = (probs.unsqueeze(-1) * vf.unsqueeze(2)).sum(-2) if compiling else torch.matmul(probs, vf)
    return out.to(values.dtype)


def cache_attention(q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, mask: Any, scale: float,
                    attention: str, window: Optional[int] = None) -> Tensor:
    """Attention of folded queries over a static cache by one of :data:`ATTENTIONS`.

    Args:
        q: ``[b', H_kv, g·T, hd]`` queries (rotary applied), query row ``j·T + t`` is query head
            ``j`` of a key/value group at token ``t``; in ``keys.dtype``.
        keys, values: ``[b', H_kv, T_max, hd]`` the cache rows of the ``b'`` sequences.
        positions: ``[b', T]`` int64: token ``t`` reads slots ``≤ positions[:, t]`` (the rule
            ``"flex"`` applies through :func:`decode_score_mod`; the others take it from ``mask``).
        mask: ``[b', 1, g·T, T_max]`` bool (broadcastable), True = may read, for ``"sdpa"``,
            ``"matmul"`` and ``"reduce"``; for ``"flex"`` the cache blocks to visit (a
            :func:`decode_block_mask`, or ``None`` = every block).
        scale: the softmax scale.
        attention: one of :data:`ATTENTIONS`.
        window: a sliding window in tokens (``"flex"`` only; the others have it in ``mask``).

    Returns:
        ``[b', H_kv, g·T, hd]`` in ``values.dtype``.
    """
    if attention == "flex":
        return _flex(q, keys, values, decode_score_mod(positions, window), scale, mask)
    if attention == "sdpa":
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    if attention == "reduce":
        return reduce_attention(q, keys, values, mask, scale)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # [b', H_kv, g·T, T_max]
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.matmul(probs.to(values.dtype), values)


def causal_prefill_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, window: Optional[int] = None) -> Tensor:
    """Causal self-attention of ``T`` tokens at positions ``0 … T−1`` over their own keys: token ``t``
    reads tokens ``j ≤ t`` (and ``t − j < window`` in a sliding layer, as transformers' sliding
    layers do). What a prefill into an empty cache computes, without the cache: with right-padded
    prompts, a row's real tokens read only real tokens before them (the padding comes after).

    Args:
        q: ``[b, T, H, hd]`` queries (rotary applied).
        k, v: ``[b, T, H_kv, hd]`` keys (rotary applied) and values; ``H`` a multiple of ``H_kv``
            (each key/value head serves ``H / H_kv`` consecutive query heads, the Llama / Qwen layout).
        scale: the softmax scale.
        window: the sliding window in tokens, ``None`` = full attention.

    Returns:
        ``[b, T, H, hd]`` in ``q``'s dtype.

    Uses :func:`torch.nn.functional.scaled_dot_product_attention` with ``is_causal`` (FlashAttention
    or memory-efficient kernels on CUDA, whose work grows with ``T²/2``, not with the cache's length);
    a sliding layer passes its ``[T, T]`` band as a boolean mask instead.
    """
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)  # [b, H, T, hd]
    kh = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(group, dim=1)
    if window is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        t = torch.arange(q.shape[1], device=q.device)
        band = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < int(window))  # [T(query), T(key)]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=band, scale=scale)
    return out.transpose(1, 2)


def fuse_linears(linears: list[nn.Linear]) -> tuple[nn.Parameter, Optional[nn.Parameter]]:
    """Concatenate the linears' weights (and biases) along the output dimension and make each
    linear's weight a view into the result: one GEMM instead of ``len(linears)`` (the fused
    projections of :class:`FusedDecoderLayer` and :class:`dflash.inference.proposer.CachedDFlashProposer`).

    Returns:
        ``(weight [Σ out_features, in_features], bias [Σ out_features] or None)``, without gradients;
        a linear without a bias has zeros in the fused bias when another has one."""
    weight = nn.Parameter(torch.cat([m.weight.detach() for m in linears]), requires_grad=False)
    has_bias = [m.bias is not None for m in linears]
    bias = None
    if any(has_bias):
        parts = [m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears]
        bias = nn.Parameter(torch.cat(parts), requires_grad=False)
    start = 0
    for m in linears:
        stop = start + m.out_features
        m.weight.data = weight.data[start:stop]
        if m.bias is not None:
            m.bias.data = bias.data[start:stop]
        start = stop
    return weight, bias


class FusedDecoderLayer(nn.Module):
    """One decoder layer over a static KV cache (see the module docstring).

    Args:
        layer: the transformers decoder layer (its weights are re-pointed into the fused tensors).
        num_heads, num_kv_heads, head_dim: ``H``, ``H_kv``, ``hd`` of the attention.
        attention: one of :data:`ATTENTIONS` (default ``"sdpa"``; a call may pick another).

    Raises:
        ValueError: :func:`fusable` says no, ``H`` is not a multiple of ``H_kv``, or an unknown
            ``attention``.
    """

    def __init__(self, layer: nn.Module, config: object, num_heads: int, num_kv_heads: int, head_dim: int,
                 attention: str = "sdpa") -> None:
        super().__init__()
        why = fusable(layer, config)
        if why is not None:
            raise ValueError(f"{type(layer).__name__}: {why}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention: one of {ATTENTIONS}, got {attention!r}")
        self.attention = attention
        attn, mlp = layer.self_attn, layer.mlp
        self.heads, self.kv_heads, self.head_dim = int(num_heads), int(num_kv_heads), int(head_dim)
        self.scaling = float(getattr(attn, "scaling", head_dim ** -0.5))
        # Fused once per layer: a second decoder over the same model (target-only, then speculative)
        # reuses the tensors the linears already point into instead of copying the weights again.
        # The linears stay views into the fused tensors until the model is moved or cast (``.to``
        # gives them new tensors): then the layer is fused again.
        fused = getattr(layer, FUSED_ATTR, None)
        if fused is None or attn.q_proj.weight.data_ptr() != fused[0].data_ptr() \
                or mlp.gate_proj.weight.data_ptr() != fused[2].data_ptr():
            fused = (*fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj]),
                     *fuse_linears([mlp.gate_proj, mlp.up_proj]))
            object.__setattr__(layer, FUSED_ATTR, fused)
        self.wqkv, self.bqkv, self.w_gate_up, self.b_gate_up = fused
        self.o_proj, self.down_proj, self.act = attn.o_proj, mlp.down_proj, mlp.act_fn
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)

    def forward(self, hidden: Tensor, cos: Tensor, sin: Tensor, k_buf: Tensor, v_buf: Tensor,
                rows: Optional[Tensor], positions: Tensor, mask: Optional[Tensor],
                window: Optional[int] = None, attention: Optional[str] = None) -> Tensor:
        """One layer for ``T`` new tokens per row.

        Args:
            hidden: ``[b', T, D]`` the residual stream.
            cos, sin: ``[b', T, hd]`` the rotary embedding at ``positions`` (the decoder's
                ``rotary_emb``).
            k_buf, v_buf: ``[b, H_kv, T_max, hd]`` this layer's cache (written at ``positions``).
            rows: ``[b']`` int64 cache rows of the ``b'`` sequences, ``None`` = all rows.
            positions: ``[b', T]`` int64 positions of the new tokens.
            mask: ``[b', 1, g·T, T_max]`` bool, True = the query may read that cache slot; query
                row ``j·T + t`` is query head ``j`` of a key/value group at token ``t``. Unused
                (may be ``None``) by ``"causal"``, and by ``"flex"``, which applies the same rule
                from ``positions`` and takes here the cache blocks to visit (a
                :func:`decode_block_mask`; ``None`` = every block).
            window: the layer's sliding window in tokens (``None`` = full attention); read by
                ``"flex"`` and ``"causal"`` only (the other attentions take it from ``mask``).
            attention: this call's attention (one of :data:`ATTENTIONS`, or
                :data:`PREFILL_ATTENTION` when every row's ``positions`` are ``0 … T−1``: a prefill
                into empty rows; the keys/values are still written into the cache), ``None`` = the
                layer's.

        Returns:
            ``[b', T, D]`` the layer's output (same dtype as ``hidden``).
        """
        b, t, _ = hidden.shape
        hq, hkv, hd = self.heads, self.kv_heads, self.head_dim
        x = self.input_layernorm(hidden)
        qkv = F.linear(x, self.wqkv, self.bqkv)
        q, k, v = qkv.split([hq * hd, hkv * hd, hkv * hd], dim=-1)
        q, k, v = q.view(b, t, hq, hd), k.view(b, t, hkv, hd), v.view(b, t, hkv, hd)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        c, s = cos.unsqueeze(2), sin.unsqueeze(2)  # [b', T, 1, hd]
        q, k = apply_rope(q, c, s), apply_rope(k, c, s)
        row_ix = torch.arange(k_buf.shape[0], device=hidden.device) if rows is None else rows
        row_ix = row_ix.unsqueeze(1)  # [b', 1]
        k_buf[row_ix, :, positions] = k.to(k_buf.dtype)  # [b', T, H_kv, hd] at [b', T]
        v_buf[row_ix, :, positions] = v.to(v_buf.dtype)
        attention = attention or self.attention
        if attention == PREFILL_ATTENTION:
            out = causal_prefill_attention(q.to(k_buf.dtype), k.to(k_buf.dtype), v.to(v_buf.dtype), self.scaling,
                                           window)
            return self._mlp(hidden, out.reshape(b, t, hq * hd))
        keys, values = (k_buf, v_buf) if rows is None else (k_buf[rows], v_buf[rows])
        # [b', T, H, hd] → [b', H_kv, g·T, hd]: the g query heads of a group read one key/value head.
        g = hq // hkv
        q = q.view(b, t, hkv, g, hd).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, hd)
        out = cache_attention(q.to(keys.dtype), keys, values, positions, mask, self.scaling, attention, window)
        return self._mlp(hidden, out.view(b, hkv, g, t, hd).permute(0, 3, 1, 2, 4).reshape(b, t, hq * hd))

    def _mlp(self, hidden: Tensor, attn: Tensor) -> Tensor:
        """The layer after attention: ``hidden [b', T, D]`` plus the output projection of ``attn
        [b', T, H·hd]``, then the MLP block with its residual."""
        hidden = hidden + self.o_proj(attn.to(hidden.dtype))
        x = self.post_attention_layernorm(hidden)
        gate, up = F.linear(x, self.w_gate_up, self.b_gate_up).chunk(2, dim=-1)
        return hidden + self.down_proj(self.act(gate) * up)


def fuse_layers(layers: nn.ModuleList, config: object, attention: str = "sdpa"
                ) -> Optional[list[FusedDecoderLayer]]:
    """:class:`FusedDecoderLayer` for every layer, or ``None`` (and nothing changed) when one of
    them is not :func:`fusable`.

    Args:
        layers: the decoder's layers.
        config: the model's (text) config (``num_attention_heads``, ``num_key_value_heads``,
            ``head_dim`` or ``hidden_size``).
        attention: one of :data:`ATTENTIONS` (default ``"sdpa"``).
    """
    if any(fusable(layer, config) is not None for layer in layers):
        return None
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return [FusedDecoderLayer(layer, config, heads, kv_heads, head_dim, attention) for layer in layers]
