"""The drafter's attention masks: one rule, as a flex ``mask_mod``, a dense mask and sparse tiles.

Every mask the drafter attends with is built here, for training (the trainer builds them eagerly,
outside the compiled forward) and for decoding (the drafter's forward builds them when it is
given none, as :class:`dflash.inference.proposer.DFlashProposer` calls it).

The rule is the serving engines' (vLLM ``vllm/model_executor/models/qwen3_dflash.py``, SGLang
``python/sglang/srt/models/dflash.py``, the reference ``z-lab/dflash``
``dflash/models/drafter.py`` and SpecForge's DFlash mask; DFlash paper, arXiv 2602.06036, §3).
Keys are ``[S context positions ; A·B block tokens]``, queries the ``A·B`` block tokens. Query
``k`` (block position) of block ``i`` (anchor ``a``) sees context ``j`` iff ``j`` is in ``a``'s
conversation (the contiguous run of equal ``doc_ids`` around ``a``: with the batch contract's
back-to-back packing, ``doc_ids[j] == doc_ids[a]``) and ``j < a`` (strict: at inference the
anchor's own hidden state does not exist yet). A ``full_attention`` layer then sees all ``B``
tokens of its own block. A ``sliding_attention`` layer with window ``W`` is a causal decoder
layer whose window counts the query itself: the query at position ``a + k`` sees keys at
positions ``a + k − W + 1 … a + k``, i.e. context ``j ≥ a + k − W + 1`` and block keys
``k' ≤ k`` with ``k − k' < W``. Nothing of other blocks is ever visible. A dropped block
(``keep = False``) sees only (the causal part of) itself, so no query row is ever fully masked
(no NaN).

One ``mask_mod`` (:func:`make_mask_mod`) defines both the flex_attention ``BlockMask`` (GPU,
:func:`flex_block_mask`) and the dense SDPA mask (CPU, :func:`dense_attention_mask`), so they
cannot disagree; the BlockMask's sparse tiles (:func:`mask_tiles`) are computed from the
per-query context ranges, never from a dense mask.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional, Sequence, Union

import torch
from torch import Tensor

__all__ = [
    "FULL_ATTENTION",
    "SLIDING_ATTENTION",
    "FLEX_TILE",
    "AttentionMask",
    "context_ranges",
    "query_context_ranges",
    "make_mask_mod",
    "dense_attention_mask",
    "mask_tiles",
    "flex_block_mask",
    "build_attention_masks",
    "drafter_attention_masks",
    "restage_attention_mask",
]

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
#: flex_attention tile (query and key rows per sparse block).
FLEX_TILE = 128

#: A dense bool mask ``[R, 1, Q, S + Q]`` (True = attend) or a flex_attention ``BlockMask``.
AttentionMask = Union[Tensor, Any]


def context_ranges(anchors: Tensor, anchor_keep: Tensor, doc_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Context positions ``[lo, hi)`` each block may see in a ``full_attention`` layer: ``[R, A]``
    int64 each.

    ``hi = a`` (strictly before the anchor); ``lo`` = the first position of the anchor's
    conversation. A sliding-window layer narrows this per block position ``k`` to
    ``[max(lo, a + k − W + 1), hi)`` (:func:`query_context_ranges`). A conversation is the
    contiguous run of equal ``doc_ids`` containing ``a`` (the batch contract packs conversations
    back to back, so this is ``doc_ids[j] == doc_ids[a]``). A dropped block gets ``lo = hi = 0``.
    """
    r, s = doc_ids.shape
    pos = torch.arange(s, device=doc_ids.device).expand(r, s)
    is_start = torch.ones_like(doc_ids, dtype=torch.bool)
    is_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    run_start = torch.cummax(torch.where(is_start, pos, torch.zeros_like(pos)), dim=1).values
    lo = run_start.gather(1, anchors)
    hi = anchors
    zero = torch.zeros_like(anchors)
    return torch.where(anchor_keep, lo, zero), torch.where(anchor_keep, hi, zero)


def query_context_ranges(anchors: Tensor, anchor_keep: Tensor, doc_ids: Tensor, block_size: int,
                         window: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """Context positions ``[lo, hi)`` each block query may see: ``[R, A·B]`` int64 each.

    Query ``i·B + k`` (block ``i``, block position ``k``): ``hi = a`` and ``lo`` = the start of
    ``a``'s conversation, in a sliding-window layer raised to ``a + k − W + 1`` (vLLM / SGLang run
    a sliding DFlash layer as a causal decoder layer with a window ``(W − 1, 0)`` of key
    positions, the query's own position included). Empty (``lo ≥ hi``) for a dropped block.
    """
    lo, hi = context_ranges(anchors, anchor_keep, doc_ids)
    num_anchors = anchors.shape[1]
    lo = lo.repeat_interleave(block_size, dim=1)
    hi = hi.repeat_interleave(block_size, dim=1)
    if window is not None:
        k = torch.arange(block_size, device=anchors.device).repeat(num_anchors)
        lo = torch.maximum(lo, hi + k - window + 1)
    return lo, hi


def make_mask_mod(anchors: Tensor, anchor_keep: Tensor, doc_ids: Tensor, block_size: int,
                  window: Optional[int] = None) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """The DFlash ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (the engines' rule, module docstring).

    Query ``q`` is block position ``k = q mod B`` of block ``q // B``; key ``kv < S`` is context
    position ``kv`` (visible when ``lo ≤ kv < hi``, :func:`context_ranges`, and, in a sliding
    layer, ``kv ≥ a + k − W + 1``), key ``kv ≥ S`` is block token ``kv − S`` (visible when it is in
    the query's own block; in a sliding layer only block positions ``k' ≤ k`` with
    ``k − k' < W``). Works on flex_attention's scalar indices and on broadcast index tensors alike,
    so :func:`flex_block_mask` and :func:`dense_attention_mask` share it.

    Args:
        anchors, anchor_keep: ``[R, A]`` int64 / bool.
        doc_ids: ``[R, S]``.
        block_size: ``B``.
        window: ``W`` of a ``sliding_attention`` layer, ``None`` for ``full_attention``.
    """
    seq_len = doc_ids.shape[1]
    num_anchors = anchors.shape[1]
    lo, hi = context_ranges(anchors, anchor_keep, doc_ids)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        blk = torch.clamp(q_idx // block_size, max=num_anchors - 1)
        anchor = hi[b, blk]  # the anchor of a kept block; 0 (= lo, empty context) for a dropped one
        ctx = (kv_idx < seq_len) & (kv_idx >= lo[b, blk]) & (kv_idx < anchor)
        key_pos = kv_idx - seq_len - blk * block_size  # block position of a block key
        own = (kv_idx >= seq_len) & (key_pos >= 0) & (key_pos < block_size)
        if window is not None:
            k = q_idx - blk * block_size
            ctx = ctx & (kv_idx > anchor + k - window)
            own = own & (key_pos <= k) & (key_pos > k - window)
        return ctx | own

    return mask_mod


def dense_attention_mask(anchors: Tensor, anchor_keep: Tensor, doc_ids: Tensor, block_size: int,
                         window: Optional[int] = None) -> Tensor:
    """Dense SDPA mask ``[R, 1, A·B, S + A·B]`` bool (True = attend), for CPU: :func:`make_mask_mod`
    evaluated on every (query, key) pair."""
    r, s = doc_ids.shape
    q_len = anchors.shape[1] * block_size
    dev = anchors.device
    mod = make_mask_mod(anchors, anchor_keep, doc_ids, block_size, window)
    b = torch.arange(r, device=dev).view(r, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev)
    q = torch.arange(q_len, device=dev).view(1, 1, q_len, 1)
    kv = torch.arange(s + q_len, device=dev).view(1, 1, 1, s + q_len)
    return mod(b, h, q, kv)


def mask_tiles(anchors: Tensor, anchor_keep: Tensor, doc_ids: Tensor, block_size: int, window: Optional[int] = None,
               tile: int = FLEX_TILE) -> tuple[Tensor, Tensor]:
    """Which ``tile × tile`` tiles of the mask are partly / fully visible: ``[R, n_q, n_kv]`` bool each.

    Computed from the per-query context ranges (:func:`query_context_ranges`), never from the
    dense mask: ``O(R · A · B)`` work and memory. ``partial`` is a superset of the tiles that hold
    a visible entry and are not full (flex_attention applies ``mask_mod`` there); ``full`` tiles
    are exactly visible everywhere (``mask_mod`` skipped). Only context tiles can be full.
    """
    r, s = doc_ids.shape
    num_anchors = anchors.shape[1]
    q_len = num_anchors * block_size
    kv_len = s + q_len
    n_q, n_kv = -(-q_len // tile), -(-kv_len // tile)
    dev = anchors.device
    lo_q, hi_q = query_context_ranges(anchors, anchor_keep, doc_ids, block_size, window)  # [R, Q]
    pad = n_q * tile - q_len
    if pad:
        lo_q = torch.cat([lo_q, lo_q.new_zeros(r, pad)], dim=1)
        hi_q = torch.cat([hi_q, hi_q.new_zeros(r, pad)], dim=1)
    qpos = torch.arange(n_q * tile, device=dev)
    real = qpos < q_len
    empty = hi_q <= lo_q
    big = kv_len + tile
    # Partial (superset): some query of the tile has a context range meeting the kv tile.
    seen = ~empty & real
    lo_any = torch.where(seen, lo_q, torch.full_like(lo_q, big)).view(r, n_q, tile).amin(-1)
    hi_any = torch.where(seen, hi_q, torch.full_like(hi_q, -1)).view(r, n_q, tile).amax(-1)
    u = torch.arange(n_kv, device=dev) * tile  # first key of each kv tile
    ctx_end = torch.clamp(u + tile, max=s)
    ctx_any = (u < s) & (lo_any.unsqueeze(-1) < ctx_end) & (hi_any.unsqueeze(-1) > u)
    # Full: every real query of the tile sees every key of a kv tile lying inside the context.
    lo_all = torch.where(real, lo_q, torch.full_like(lo_q, -1)).view(r, n_q, tile).amax(-1)
    hi_all = torch.where(real, hi_q, torch.full_like(hi_q, big)).view(r, n_q, tile).amin(-1)
    none_empty = ~(empty & real).view(r, n_q, tile).any(-1)
    full = ((u + tile <= s) & (lo_all.unsqueeze(-1) <= u) & (hi_all.unsqueeze(-1) >= u + tile)
            & none_empty.unsqueeze(-1))
    # Own block: the tile's blocks [i0, i1] against the kv tile's block tokens [j0, j1].
    t = torch.arange(n_q, device=dev)
    i0 = (t * tile) // block_size
    i1 = (torch.clamp((t + 1) * tile, max=q_len) - 1) // block_size
    j0 = (torch.clamp(u, min=s) - s) // block_size
    j1 = (torch.clamp(u + tile, max=kv_len) - 1 - s) // block_size
    own_any = (u + tile > s) & (j0 <= i1.unsqueeze(-1)) & (j1 >= i0.unsqueeze(-1))  # [n_q, n_kv]
    partial = (ctx_any | own_any) & ~full
    return partial, full


def _tiles_to_indices(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """``[R, n_q, n_kv]`` bool → (``num [R, 1, n_q]``, ``indices [R, 1, n_q, n_kv]``) int32, in order."""
    num = tiles.sum(-1, dtype=torch.int32)
    idx = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num.unsqueeze(1), idx.unsqueeze(1)


def flex_block_mask(anchors: Tensor, anchor_keep: Tensor, doc_ids: Tensor, block_size: int,
                    window: Optional[int] = None, tile: int = FLEX_TILE) -> Any:
    """flex_attention ``BlockMask`` of the same rule as :func:`dense_attention_mask`.

    Built directly from :func:`mask_tiles` with ``BlockMask.from_kv_blocks`` (no
    ``create_block_mask``: that would evaluate ``mask_mod`` over all ``R · Q · K`` entries, or
    recompile per step for a new closure). Fixed shapes, no host sync, traceable by
    ``torch.compile``.
    """
    from torch.nn.attention.flex_attention import BlockMask

    s = doc_ids.shape[1]
    q_len = anchors.shape[1] * block_size
    partial, full = mask_tiles(anchors, anchor_keep, doc_ids, block_size, window, tile)
    kv_num, kv_idx = _tiles_to_indices(partial)
    full_num, full_idx = _tiles_to_indices(full)
    mod = make_mask_mod(anchors, anchor_keep, doc_ids, block_size, window)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=mod,
                                    seq_lengths=(q_len, s + q_len))


def build_attention_masks(anchors: Tensor, anchor_keep: Tensor, doc_ids: Tensor, block_size: int,
                          layer_types: Sequence[str], sliding_window: int,
                          backend: Literal["flex", "sdpa"]) -> dict[str, AttentionMask]:
    """One mask per distinct layer type: ``{"full_attention": …, "sliding_attention": …}``.

    Args:
        anchors, anchor_keep: ``[R, A]`` int64 / bool.
        doc_ids: ``[R, S]`` int (0 = padding).
        block_size: ``B``.
        layer_types: the drafter's layer types, one per layer (repeats are built once).
        sliding_window: ``W`` of the ``sliding_attention`` layers (in key positions, the query's own
            included).
        backend: ``flex`` (a ``BlockMask`` per type, :func:`flex_block_mask`) or ``sdpa`` (a dense
            ``[R, 1, A·B, S + A·B]`` bool mask, :func:`dense_attention_mask`).

    Raises:
        ValueError: unknown backend or layer type.
    """
    if backend not in ("flex", "sdpa"):
        raise ValueError(f"backend: must be flex or sdpa, got {backend!r}")
    build = flex_block_mask if backend == "flex" else dense_attention_mask
    masks: dict[str, AttentionMask] = {}
    for lt in dict.fromkeys(layer_types):
        if lt == FULL_ATTENTION:
            masks[lt] = build(anchors, anchor_keep, doc_ids, block_size, None)
        elif lt == SLIDING_ATTENTION:
            masks[lt] = build(anchors, anchor_keep, doc_ids, block_size, sliding_window)
        else:
            raise ValueError(f"layer type {lt!r}: must be {FULL_ATTENTION} or {SLIDING_ATTENTION}")
    return masks


def drafter_attention_masks(drafter: Any, anchors: Tensor, anchor_keep: Tensor,
                            doc_ids: Tensor) -> dict[str, AttentionMask]:
    """The masks a drafter attends with: :func:`build_attention_masks` for its block size, layer
    types, sliding window and attention backend.

    Args:
        drafter: a :class:`dflash.models.drafter.DFlashDraftModel` (``block_size``,
            ``config.layer_types``, ``config.sliding_window``, ``attention_backend(device)``).
        anchors, anchor_keep: ``[R, A]`` int64 / bool.
        doc_ids: ``[R, S]`` int.

    Returns:
        ``{layer type: mask}`` on ``anchors``' device.
    """
    cfg = drafter.config
    return build_attention_masks(anchors, anchor_keep, doc_ids, drafter.block_size, cfg.layer_types,
                                 cfg.sliding_window, backend=drafter.attention_backend(anchors.device))


def restage_attention_mask(mask: AttentionMask, stage: Callable[[Any, Tensor], Tensor], key: Any) -> AttentionMask:
    """Move every tensor a mask holds into caller-owned buffers: ``stage(name, tensor) -> buffer``.

    For CUDA graphs every tensor the compiled drafter forward reads must keep its address from
    step to step. A dense mask is one tensor; a flex ``BlockMask`` holds its block-index tensors
    and, through its ``mask_mod`` closure, the per-block context ranges
    (:func:`context_ranges`), all freshly allocated per batch. ``stage`` (e.g. the trainer's
    persistent-buffer copy) returns a tensor equal to its argument, with the same address every
    call for the same name; the BlockMask's attributes and its ``mask_mod``'s closure cells are
    then pointed at those buffers, in place.

    Args:
        mask: a dense ``[R, 1, Q, S + Q]`` bool tensor or a ``BlockMask``
            (:func:`build_attention_masks`).
        stage: ``(name, tensor) -> tensor`` copy into a persistent buffer.
        key: prefix of the names passed to ``stage`` (e.g. the layer type).

    Returns:
        the dense mask's buffer, or ``mask`` itself (modified).
    """
    if isinstance(mask, Tensor):
        return stage((key, "dense"), mask)
    for name, value in list(vars(mask).items()):
        if isinstance(value, Tensor):
            setattr(mask, name, stage((key, name), value))
    for j, cell in enumerate(getattr(mask.mask_mod, "__closure__", None) or ()):
        if isinstance(cell.cell_contents, Tensor):
            cell.cell_contents = stage((key, "mask_mod", j), cell.cell_contents)
    return mask

