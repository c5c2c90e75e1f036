"""The DFlash training objective: anchors, blocks, labels, attention mask, decayed CE loss, τ.

Everything here follows docs/DFLASH.md and the label rule of docs/ARCHITECTURE.md (DFlash paper,
arXiv 2602.06036, §3–4):

* **Anchors.** Position ``p`` of a row is a valid anchor when ``loss_mask[p]``,
  ``loss_mask[p + 1]`` and ``doc_ids[p] == doc_ids[p + 1]``. Each row has ``A`` anchor slots,
  filled either uniformly without replacement over the row (:func:`sample_anchors`) or
  conversation by conversation, equal shares water-filled and capped (the paper's per-sequence
  draw; :func:`sample_anchors_per_conversation`); sorted, padded with ``keep = False``.
  Shapes are fixed by ``(R, S, A)``; nothing depends on the data's values (no ``nonzero``, no
  host sync): the draw is a top-``A`` over i.i.d. uniform keys in which invalid positions get
  key −1.
* **Blocks.** Anchor ``a`` opens ``[input_ids[a], MASK × (B − 1)]`` at positions
  ``position_ids[a] + k``.
* **Labels** (same position, no shift). Slot ``k ≥ 1`` predicts the token at ``a + k``:
  ``target_tokens[a + k − 1]`` (``labels="target"``) or ``input_ids[a + k]`` (``"data"``); it counts
  when ``a + k < S``, same conversation, ``loss_mask[a + k]`` and the anchor is kept. Slot 0 never
  counts.
* **Attention mask** (the serving engines' rule: vLLM
  ``vllm/model_executor/models/qwen3_dflash.py``, SGLang ``python/sglang/srt/models/dflash.py``,
  the reference ``z-lab/dflash`` ``dflash/models/drafter.py`` and SpecForge's DFlash mask). Keys are
  ``[S context positions ; A·B block positions]``, queries the ``A·B`` block positions. Query
  ``k`` (block position) of block ``i`` (anchor ``a``) sees context ``j`` iff ``j`` is in ``a``'s
  conversation (the contiguous run of equal ``doc_ids`` around ``a``: with the batch contract's
  back-to-back packing, ``doc_ids[j] == doc_ids[a]``) and ``j < a`` (strict: at inference the
  anchor's own hidden state does not exist yet). A ``full_attention`` layer then sees all ``B``
  tokens of its own block. A ``sliding_attention`` layer with window ``W`` is a causal decoder
  layer whose window counts the query itself: the query at position ``a + k`` sees keys at
  positions ``a + k − W + 1 … a + k``, i.e. context ``j ≥ a + k − W + 1`` and block keys
  ``k' ≤ k`` with ``k − k' < W``. Nothing of other blocks is ever visible. A dropped block
  (``keep = False``) sees only (the causal part of) itself, so no query row is ever fully masked
  (no NaN). One ``mask_mod`` defines both the flex_attention ``BlockMask`` (GPU) and the dense
  SDPA mask (CPU), so they cannot disagree; the BlockMask's sparse tiles are computed from the
  per-query context ranges, never from a dense mask.
* **Loss.** ``Σ CE·w / Σ w`` with ``w_k = exp(−(k − 1)/γ)`` on valid slots; or, optionally,
  D-PACE (:func:`dpace_weights`: weights from the drafter's own confidences) divided by the
  number of blocks. :func:`dflash_loss` returns numerator and denominator separately so
  data-parallel ranks can all-reduce the denominator (:func:`loss_denominator`: known before
  the forward pass). The LM head runs in row chunks inside a custom autograd function that computes
  the gradient with respect to the hidden states during the forward pass: the ``[rows, V]``
  logits never exist at once and are not kept for backward.
* **τ** (acceptance length, greedy, per block): ``1 +`` the number of leading slots
  ``k = 1, 2, …`` whose argmax equals the label; a block stops at its first invalid slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "FULL_ATTENTION",
    "SLIDING_ATTENTION",
    "LOSS_CHUNK_ROWS",
    "AttentionMask",
    "LossOutput",
    "anchor_seed",
    "anchor_generator",
    "valid_anchor_mask",
    "ANCHOR_SAMPLING",
    "LOSS_WEIGHTINGS",
    "DPACE_ALPHA",
    "sample_anchors",
    "conversation_index",
    "conversation_anchor_quotas",
    "sample_anchors_per_conversation",
    "draw_anchors",
    "build_block_labels",
    "slot_weights",
    "label_weights",
    "dpace_weights",
    "loss_denominator",
    "FLEX_TILE",
    "context_ranges",
    "query_context_ranges",
    "make_mask_mod",
    "mask_tiles",
    "dense_attention_mask",
    "flex_block_mask",
    "build_attention_masks",
    "dflash_loss",
    "linear_ce_chunk",
    "compiled_linear_ce_chunk",
    "acceptance_lengths",
]

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
#: Rows of ``hidden @ lm_head.T`` computed at once (2,048 × 151,936 fp32 logits ≈ 1.2 GiB).
LOSS_CHUNK_ROWS = 2048
#: flex_attention tile (query and key rows per sparse block).
FLEX_TILE = 128
#: ``drafter.anchor_sampling``: per packed row, or the row's slots shared among its conversations.
ANCHOR_SAMPLING = ("row", "conversation")
#: ``drafter.loss_weighting``: the paper's fixed decay ``exp(−(k − 1)/γ)``, or D-PACE.
LOSS_WEIGHTINGS = ("decay", "dpace")
#: D-PACE confidence smoothing α when ``drafter.dpace_alpha`` is null (the D-PACE paper's value).
DPACE_ALPHA = 0.5
#: Sort key of an invalid anchor position (valid ones draw from [0, 1)).
_INVALID_KEY = -1.0
_MASK64 = (1 << 64) - 1

#: A dense bool mask ``[R, 1, Q, S + Q]`` (True = attend) or a flex_attention ``BlockMask``.
AttentionMask = Union[Tensor, Any]


# --------------------------------------------------------------------------- anchors


def _splitmix64(x: int) -> int:
    """The SplitMix64 finaliser (Steele et al. 2014): a bijective 64-bit mix."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def anchor_seed(seed: int, epoch: int, batch_id: int) -> int:
    """Seed of the anchor draw for one batch: a deterministic function of ``(seed, epoch, batch_id)``.

    The reference trainer and every drafter worker call it with the same three numbers and so
    draw the same anchors for the same batch. Any Python ints (negatives too) are accepted.

    Returns:
        an int in ``[0, 2**63)`` (what ``torch.Generator.manual_seed`` takes).
    """
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (epoch & _MASK64))
    h = _splitmix64(h ^ (batch_id & _MASK64))
    return h >> 1


def anchor_generator(seed: int, epoch: int, batch_id: int,
                     device: Union[str, torch.device] = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with :func:`anchor_seed`.

    The same seed gives the same stream on the same device type; CPU and CUDA streams differ.
    """
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(anchor_seed(seed, epoch, batch_id))
    return gen


def valid_anchor_mask(loss_mask: Tensor, doc_ids: Tensor) -> Tensor:
    """``[R, S]`` bool: ``loss_mask[p] & loss_mask[p + 1] & doc_ids[p] == doc_ids[p + 1]`` (last = False)."""
    valid = torch.zeros_like(loss_mask, dtype=torch.bool)
    valid[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:] & (doc_ids[:, :-1] == doc_ids[:, 1:])
    return valid


def _check_anchor_inputs(loss_mask: Tensor, doc_ids: Tensor, num_anchors: int) -> None:
    if num_anchors < 1:
        raise ValueError(f"num_anchors: must be >= 1, got {num_anchors}")
    if loss_mask.shape != doc_ids.shape or loss_mask.dim() != 2:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} and doc_ids {tuple(doc_ids.shape)} must be [R, S]")


def _uniform_keys(shape: tuple[int, ...], generator: Optional[torch.Generator], device: torch.device) -> Tensor:
    """I.i.d. uniform ``[0, 1)`` fp32 keys drawn on the generator's device, moved to ``device``."""
    gen_device = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, device=gen_device).to(device)


def _take_top_keys(keys: Tensor, num_anchors: int) -> tuple[Tensor, Tensor]:
    """Anchors = the positions of the top ``min(A, S)`` keys that are ``>= 0``, sorted, padded to ``A``."""
    r, s = keys.shape
    k = min(num_anchors, s)
    top_keys, top_pos = torch.topk(keys, k, dim=1)
    keep = top_keys >= 0
    # Kept anchors first, ascending; dropped ones after them.
    order = torch.argsort(torch.where(keep, top_pos, top_pos + s), dim=1)
    anchors = top_pos.gather(1, order)
    keep = keep.gather(1, order)
    anchors = torch.where(keep, anchors, torch.zeros_like(anchors))
    if k < num_anchors:
        pad = num_anchors - k
        anchors = torch.cat([anchors, anchors.new_zeros(r, pad)], dim=1)
        keep = torch.cat([keep, keep.new_zeros(r, pad)], dim=1)
    return anchors.long(), keep


def sample_anchors(loss_mask: Tensor, doc_ids: Tensor, num_anchors: int,
                   generator: Optional[torch.Generator] = None) -> tuple[Tensor, Tensor]:
    """Draw up to ``num_anchors`` anchors per row, uniformly without replacement (``anchor_sampling: row``).

    Method: i.i.d. uniform keys ``[R, S]`` from ``generator``; invalid positions get key −1; the
    top ``min(A, S)`` keys are taken, so a row with ``n`` valid positions gets
    ``min(n, A)`` distinct valid anchors, a uniform random subset. Kept anchors are sorted
    ascending and come first; the rest have ``keep = False`` and point at index 0. Shapes depend
    only on ``(R, S, A)``; no host synchronisation.

    Args:
        loss_mask: ``[R, S]`` bool.
        doc_ids: ``[R, S]`` int (0 = padding).
        num_anchors: ``A`` (``drafter.anchors_per_row``).
        generator: seeds the draw (see :func:`anchor_generator`); drawn on the generator's
            device, then moved to ``loss_mask``'s device.

    Returns:
        ``(anchors [R, A] int64, keep [R, A] bool)``.

    Raises:
        ValueError: ``num_anchors < 1`` or mismatched shapes.
    """
    _check_anchor_inputs(loss_mask, doc_ids, num_anchors)
    valid = valid_anchor_mask(loss_mask.bool(), doc_ids)
    keys = _uniform_keys(tuple(loss_mask.shape), generator, loss_mask.device)
    return _take_top_keys(torch.where(valid, keys, torch.full_like(keys, _INVALID_KEY)), num_anchors)


def conversation_index(doc_ids: Tensor) -> Tensor:
    """``[R, S]`` int64: the index ``0, 1, …`` of each position's conversation inside its row.

    A conversation is a maximal run of equal ``doc_ids`` (the batch contract packs conversations
    back to back; trailing padding is one more run), so the index lies in ``[0, S)``.
    """
    start = torch.ones_like(doc_ids, dtype=torch.long)
    start[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]).long()
    return torch.cumsum(start, dim=1) - 1


def conversation_anchor_quotas(counts: Tensor, num_anchors: int, cap: Optional[int],
                               priority: Tensor) -> Tensor:
    """How many of a row's ``A`` anchor slots each conversation gets: ``[R, C]`` int64.

    Water-filling (max–min fair share). With ``T = min(cap, A)`` (``A`` without a cap),
    conversation ``c`` with ``n_c`` valid anchor positions gets ``min(n_c, t)``, where the level
    ``t`` is the largest integer in ``[0, T]`` with ``Σ_c min(n_c, t) ≤ A``. When ``t < T``, the
    ``A − Σ_c min(n_c, t)`` slots left over (fewer than the conversations with ``n_c > t``) go one
    each to the conversations with ``n_c > t`` of highest ``priority`` (ties: lower index first).
    So every conversation gets an equal share, a short one all its positions with its unused
    share spread over the others, and none more than ``cap``: the rule of the DFlash paper
    (§4: up to 512 anchors per *sequence*) and of SpecForge (``_sample_anchor_positions`` in
    ``specforge/algorithms/common/dflash_family_model.py``: ``min(num_anchors, n)`` per sequence)
    whenever the row's slots suffice, an equal split when they do not. No host synchronisation:
    a binary search over ``t`` whose number of steps depends only on ``T``.

    Args:
        counts: ``[R, C]`` int64 valid anchor positions per conversation.
        num_anchors: ``A``, the row's anchor slots (``drafter.anchors_per_row``).
        cap: most anchors of one conversation (``drafter.anchors_per_conversation``); ``None`` = no cap.
        priority: ``[R, C]`` float: the order in which left-over slots are handed out.

    Returns:
        quotas ``[R, C]`` int64: ``quota ≤ counts``, ``quota ≤ cap``,
        ``Σ_c quota = min(A, Σ_c min(n_c, cap))``.

    Raises:
        ValueError: ``num_anchors < 1``, ``cap < 1`` or mismatched shapes.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors: must be >= 1, got {num_anchors}")
    if cap is not None and cap < 1:
        raise ValueError(f"cap: must be >= 1 or None, got {cap}")
    if counts.dim() != 2 or priority.shape != counts.shape:
        raise ValueError(f"counts {tuple(counts.shape)} and priority {tuple(priority.shape)} must be the same [R, C]")
    r, c = counts.shape
    top = num_anchors if cap is None else min(cap, num_anchors)
    lo = counts.new_zeros(r)
    hi = counts.new_full((r,), top)
    for _ in range(top.bit_length()):  # invariant: level lo fits, every level above hi does not
        mid = (lo + hi + 1) // 2
        fits = torch.minimum(counts, mid.unsqueeze(1)).sum(dim=1) <= num_anchors
        lo = torch.where(fits, mid, lo)
        hi = torch.where(fits, hi, mid - 1)
    level = lo.unsqueeze(1)
    base = torch.minimum(counts, level)
    left = num_anchors - base.sum(dim=1, keepdim=True)
    eligible = (counts > level) & (level < top)
    prio = priority.float()
    order = torch.argsort(torch.where(eligible, -prio, torch.full_like(prio, 2.0)), dim=1, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(c, device=counts.device).expand(r, c))
    return base + (eligible & (rank < left)).long()


def sample_anchors_per_conversation(loss_mask: Tensor, doc_ids: Tensor, num_anchors: int,
                                    cap: Optional[int] = None,
                                    generator: Optional[torch.Generator] = None) -> tuple[Tensor, Tensor]:
    """Draw a row's ``A`` anchors conversation by conversation (``anchor_sampling: conversation``).

    The paper and SpecForge draw anchors per *sequence*; a packed row holds several. Here the
    row's fixed ``A`` slots are shared among its conversations by :func:`conversation_anchor_quotas`
    (equal shares, water-filled, at most ``cap`` each), and conversation ``c`` then takes
    ``quota_c`` of its valid positions (:func:`valid_anchor_mask`) uniformly without replacement.

    Draws from ``generator``, in this order: position keys ``[R, S]``, then conversation
    priorities ``[R, S]`` (indexed by :func:`conversation_index`), both i.i.d. uniform ``[0, 1)``.
    Conversation ``c`` takes its ``quota_c`` valid positions of largest key (ties: lower position
    first). Kept anchors are sorted ascending and come first, padded with ``keep = False`` and
    index 0, as in :func:`sample_anchors`. Shapes depend only on ``(R, S, A)``; no host
    synchronisation. With one conversation per row and no binding cap the anchors are those of
    :func:`sample_anchors` with the same generator (up to ties between keys).

    Args:
        loss_mask: ``[R, S]`` bool.
        doc_ids: ``[R, S]`` int (conversations: runs of equal values).
        num_anchors: ``A`` (``drafter.anchors_per_row``).
        cap: at most this many anchors per conversation (``drafter.anchors_per_conversation``),
            ``None`` = no cap besides ``A``.
        generator: seeds the draw (:func:`anchor_generator`).

    Returns:
        ``(anchors [R, A] int64, keep [R, A] bool)``.

    Raises:
        ValueError: ``num_anchors < 1``, ``cap < 1`` or mismatched shapes.
    """
    _check_anchor_inputs(loss_mask, doc_ids, num_anchors)
    device = loss_mask.device
    r, s = loss_mask.shape
    valid = valid_anchor_mask(loss_mask.bool(), doc_ids)
    keys = _uniform_keys((r, s), generator, device)
    priority = _uniform_keys((r, s), generator, device)
    conv = conversation_index(doc_ids)
    counts = torch.zeros((r, s), dtype=torch.long, device=device).scatter_add_(1, conv, valid.long())
    quota = conversation_anchor_quotas(counts, num_anchors, cap, priority)
    # Positions grouped by conversation; inside one, valid positions by key descending, then position.
    order = torch.argsort(torch.where(valid, -keys, torch.full_like(keys, 2.0)), dim=1, stable=True)
    order = order.gather(1, torch.argsort(conv.gather(1, order), dim=1, stable=True))
    conv_sorted = conv.gather(1, order)
    j = torch.arange(s, device=device).expand(r, s)
    first = torch.ones_like(conv_sorted, dtype=torch.bool)
    first[:, 1:] = conv_sorted[:, 1:] != conv_sorted[:, :-1]
    rank = j - torch.cummax(torch.where(first, j, torch.zeros_like(j)), dim=1).values
    chosen_sorted = valid.gather(1, order) & (rank < quota.gather(1, conv_sorted))
    chosen = torch.zeros_like(valid).scatter_(1, order, chosen_sorted)
    return _take_top_keys(torch.where(chosen, keys, torch.full_like(keys, _INVALID_KEY)), num_anchors)


def draw_anchors(loss_mask: Tensor, doc_ids: Tensor, num_anchors: int, sampling: str = "row",
                 cap: Optional[int] = None,
                 generator: Optional[torch.Generator] = None) -> tuple[Tensor, Tensor]:
    """The configured anchor draw: :func:`sample_anchors` (``sampling="row"``) or
    :func:`sample_anchors_per_conversation` (``"conversation"``, with ``cap``).

    Returns:
        ``(anchors [R, A] int64, keep [R, A] bool)``.

    Raises:
        ValueError: unknown ``sampling``, ``cap`` given with ``"row"``, or what the draw raises.
    """
    if sampling == "row":
        if cap is not None:
            raise ValueError(f"cap: applies to sampling='conversation' only, got cap={cap} with sampling='row'")
        return sample_anchors(loss_mask, doc_ids, num_anchors, generator)
    if sampling == "conversation":
        return sample_anchors_per_conversation(loss_mask, doc_ids, num_anchors, cap, generator)
    raise ValueError(f"sampling: must be one of {list(ANCHOR_SAMPLING)}, got {sampling!r}")


# --------------------------------------------------------------------------- labels


def build_block_labels(input_ids: Tensor, target_tokens: Optional[Tensor], loss_mask: Tensor, doc_ids: Tensor,
                       anchors: Tensor, anchor_keep: Tensor, block_size: int,
                       labels: Literal["target", "data"] = "target") -> tuple[Tensor, Tensor]:
    """Labels and validity of every block slot (docs/ARCHITECTURE.md, "The drafter's labels").

    Slot ``k`` of the block at anchor ``a`` is position ``p = a + k`` (same position, no shift).
    Its label is ``target_tokens[p − 1]`` (the target's greedy prediction *for* ``p``) or
    ``input_ids[p]``; it is valid when ``k ≥ 1``, ``p < S``, ``doc_ids[p] == doc_ids[a]``,
    ``loss_mask[p]`` and ``anchor_keep``.

    Args:
        input_ids, loss_mask, doc_ids: ``[R, S]`` (int64, bool, int).
        target_tokens: ``[R, S]`` int64 (required for ``labels="target"``).
        anchors, anchor_keep: ``[R, A]`` int64 / bool.
        block_size: ``B``.

    Returns:
        ``(labels [R, A, B] int64, valid [R, A, B] bool)``; invalid slots hold label 0.

    Raises:
        ValueError: unknown ``labels`` or missing ``target_tokens``.
    """
    if labels not in ("target", "data"):
        raise ValueError(f"labels: must be 'target' or 'data', got {labels!r}")
    if labels == "target" and target_tokens is None:
        raise ValueError("labels='target' needs target_tokens")
    r, s = input_ids.shape
    num_anchors = anchors.shape[1]
    k = torch.arange(block_size, device=anchors.device)
    pos = anchors.unsqueeze(-1) + k  # [R, A, B]
    in_range = pos < s
    safe = pos.clamp(max=s - 1).reshape(r, num_anchors * block_size)
    anchor_doc = doc_ids.gather(1, anchors).unsqueeze(-1)
    same_doc = doc_ids.gather(1, safe).view(r, num_anchors, block_size) == anchor_doc
    in_loss = loss_mask.bool().gather(1, safe).view(r, num_anchors, block_size)
    valid = in_range & same_doc & in_loss & (k >= 1) & anchor_keep.unsqueeze(-1)
    if labels == "target":
        prev = (pos - 1).clamp(min=0, max=s - 1).reshape(r, num_anchors * block_size)
        lab = target_tokens.gather(1, prev).view(r, num_anchors, block_size)
    else:
        lab = input_ids.gather(1, safe).view(r, num_anchors, block_size)
    lab = torch.where(valid, lab, torch.zeros_like(lab))
    return lab.long(), valid


def slot_weights(block_size: int, gamma: float, device: Optional[torch.device] = None) -> Tensor:
    """``[B]`` fp32: ``w_0 = 0``, ``w_k = exp(−(k − 1)/γ)`` (DFlash paper §4; docs/DFLASH.md, Labels and loss).

    Raises:
        ValueError: ``gamma <= 0``.
    """
    if not gamma > 0:
        raise ValueError(f"gamma: must be > 0, got {gamma}")
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1.0) / gamma)
    w[0] = 0.0
    return w


def label_weights(valid: Tensor, gamma: float) -> Tensor:
    """``[R, A, B]`` fp32 loss weights: ``valid · w_k``."""
    return valid.float() * slot_weights(valid.shape[-1], gamma, valid.device)


def dpace_weights(confidence: Tensor, valid: Tensor, alpha: float = DPACE_ALPHA) -> Tensor:
    """D-PACE position weights of every block slot: ``[R, A, B]`` fp32, to be used detached.

    D-PACE (Dynamic Position-Aware Cross-Entropy; arXiv 2605.18810, Eq. 7–8; SpecForge PR 578,
    ``_dpace_weight`` in ``specforge/algorithms/common/dflash_family_model.py``). With ``q_k`` the
    drafter's probability of the label at slot ``k``: smoothed ``q̃_k = (1 − α)·q_k + α`` (Eq. 7),
    cumulative confidence ``P_m = Π_{i ≤ m} q̃_i`` (the chance a block is accepted through slot
    ``m``) and ``w_k = Σ_{m ≥ k} P_m`` (Eq. 8), so ``Σ_k w_k · CE_k`` has the gradient of the
    (smoothed) expected acceptance length ``Σ_m P_m``. As in SpecForge, an invalid slot counts as
    ``q̃ = 1`` in the products and is left out of the sums; its own weight is 0.

    Args:
        confidence: ``[..., B]`` float: ``q_k = exp(−CE_k)``.
        valid: ``[..., B]`` bool: slots that count (:func:`build_block_labels`).
        alpha: α in ``[0, 1]`` (``drafter.dpace_alpha``; 0.5 in the paper).

    Returns:
        ``[..., B]`` fp32 weights, 0 on invalid slots.

    Raises:
        ValueError: ``alpha`` outside ``[0, 1]`` or mismatched shapes.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha: must be in [0, 1], got {alpha}")
    if confidence.shape != valid.shape:
        raise ValueError(f"confidence {tuple(confidence.shape)} and valid {tuple(valid.shape)} must match")
    smooth = (1.0 - alpha) * confidence.float() + alpha
    smooth = torch.where(valid, smooth, torch.ones_like(smooth))
    prefix = torch.cumprod(smooth, dim=-1) * valid.float()
    suffix = prefix.flip(-1).cumsum(-1).flip(-1)
    return suffix * valid.float()


def loss_denominator(valid: Tensor, gamma: float, weighting: str = "decay") -> Tensor:
    """The loss's denominator for a batch, known before the forward pass: fp32 scalar.

    ``"decay"``: ``Σ w`` over valid slots (:func:`label_weights`), so the loss is the weighted mean
    CE (DFlash paper §4). ``"dpace"``: the number of blocks with a valid slot, so the loss is the
    mean over blocks of ``Σ_k w_k CE_k`` (its weights depend on the forward pass, so ``Σ w``
    cannot be the denominator of an all-reduced loss; the D-PACE author's proposal in
    SpecForge issue 828, "normalize by the number of valid sampled anchors").

    Raises:
        ValueError: unknown ``weighting``.
    """
    if weighting == "decay":
        return label_weights(valid, gamma).sum()
    if weighting == "dpace":
        return valid.any(-1).float().sum()
    raise ValueError(f"weighting: must be one of {list(LOSS_WEIGHTINGS)}, got {weighting!r}")


# --------------------------------------------------------------------------- attention mask


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


# --------------------------------------------------------------------------- loss


def linear_ce_chunk(h: Tensor, weight: Tensor, bias: Optional[Tensor], y: Tensor, w: Tensor,
                    need_grad: bool) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """Weighted cross entropy of one chunk of rows through the LM head, with its hidden gradient.

    ``z = h Wᵀ + b`` (in ``weight``'s dtype, then fp32); ``Σ_n w_n (logsumexp(z_n) − z_n[y_n])``;
    ``argmax z_n``; and, when ``need_grad``, ``d/dh = (w_n (softmax(z_n) − onehot(y_n))) W``.
    Pure tensor code with static shapes, so ``torch.compile`` can fuse the fp32 softmax passes
    over the ``[c, V]`` logits (cast, log-sum-exp, exp, one-hot subtraction, scaling, cast back)
    into a few kernels.

    Args:
        h: ``[c, D]`` hidden states; weight: ``[V, D]``; bias: ``[V]`` or ``None``.
        y: ``[c]`` int64 labels; w: ``[c]`` fp32 row weights.
        need_grad: also return the ``[c, D]`` gradient (in ``h``'s dtype).

    Returns:
        ``(Σ w·CE fp32 scalar, argmax [c] int64, gradient [c, D] or None, CE [c] fp32 unweighted)``.
    """
    logits = F.linear(h.to(weight.dtype), weight, bias).float()  # [c, V]
    lse = torch.logsumexp(logits, dim=-1)
    ce = lse - logits.gather(1, y.unsqueeze(1)).squeeze(1)
    total = (ce * w).sum()
    pred = logits.argmax(dim=-1)
    if not need_grad:
        return total, pred, None, ce
    probs = torch.exp(logits - lse.unsqueeze(1))
    probs.scatter_add_(1, y.unsqueeze(1), torch.full_like(w, -1.0).unsqueeze(1))  # in place: no [c, V] copy
    grad = ((probs * w.unsqueeze(1)).to(weight.dtype) @ weight).to(h.dtype)
    return total, pred, grad, ce


_compiled_ce_chunk: Optional[Callable[..., Any]] = None


def compiled_linear_ce_chunk() -> Callable[..., Any]:
    """:func:`linear_ce_chunk` under ``torch.compile(dynamic=False)`` (inductor, no CUDA graphs).

    One compiled function per process, shared by every caller; it compiles once per chunk shape
    and ``need_grad`` value (the trainer's step uses one or two: full chunks and the last one).
    Measured on the H200 against the eager chunk loop (docs/benchmarks.md, Drafter train step).
    """
    global _compiled_ce_chunk
    if _compiled_ce_chunk is None:
        _compiled_ce_chunk = torch.compile(linear_ce_chunk, dynamic=False)
    return _compiled_ce_chunk


class _ChunkedLinearCE(torch.autograd.Function):
    """``Σ_n w_n · CE(h_n W^T + b, y_n)`` and ``argmax`` over row chunks, gradient computed in forward.

    For one row, ``d CE / d h = (softmax(z) − onehot(y)) W`` (z = logits). The forward pass keeps
    only that ``[N, D]`` gradient (scaled by ``w``); backward multiplies it by the incoming scalar
    gradient. The frozen head (``W``, ``b``) gets no gradient. Each chunk runs
    ``chunk_fn`` (:func:`linear_ce_chunk` or its compiled form).

    With ``reweight`` (weights that depend on the CE itself, e.g. D-PACE), the chunks run with
    ``row_weights`` as a 0/1 mask; then ``w = reweight(CE [N])`` (detached) scales the per-row CE
    and the kept per-row gradients, so the logits are still computed once.
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                row_weights: Tensor, chunk: int, need_grad: bool, chunk_fn: Callable[..., Any],
                reweight: Optional[Callable[[Tensor], Tensor]] = None) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        preds = []
        grads = []
        ces = []
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            for start in range(0, n, chunk):
                end = min(start + chunk, n)
                part, pred, grad, ce = chunk_fn(hidden[start:end], weight, bias, labels[start:end],
                                                row_weights[start:end], need_grad)
                total = total + part
                preds.append(pred)
                ces.append(ce)
                if need_grad:
                    grads.append(grad)
        pred = torch.cat(preds) if preds else labels.new_zeros(0)
        ctx.mark_non_differentiable(pred)
        grad_rows = (torch.cat(grads) if grads else torch.zeros_like(hidden)) if need_grad else None
        if reweight is not None:
            ce = torch.cat(ces) if ces else row_weights.new_zeros(0)
            w = reweight(ce).float()
            total = (ce * w).sum()
            if grad_rows is not None:
                grad_rows.mul_(w.unsqueeze(1).to(grad_rows.dtype))
        if need_grad:
            ctx.save_for_backward(grad_rows)
        ctx.need_grad = need_grad
        return total, pred

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor, grad_pred: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
        grad_hidden = None
        if ctx.need_grad:
            (g,) = ctx.saved_tensors
            grad_hidden = g * grad_total.to(g.dtype)
        return grad_hidden, None, None, None, None, None, None, None, None


@dataclass
class LossOutput:
    """What one batch contributes to the loss and the metrics.

    All fields are fp32 tensors on the batch's device (no host sync); sums, so ranks and batches
    add up. ``loss = loss_sum / weight_sum``; ``tau = tau_sum / num_blocks``;
    per-slot accuracy ``= per_slot_correct / per_slot_count``.
    """

    #: ``Σ CE·w`` over valid slots (the only field with a gradient).
    loss_sum: Tensor
    #: The loss denominator (no gradient): ``Σ w``, or with D-PACE weights the number of blocks
    #: with a valid slot (:func:`loss_denominator`).
    weight_sum: Tensor
    #: ``[B]``: valid slots whose argmax equals the label (slot 0: 0).
    per_slot_correct: Tensor
    #: ``[B]``: valid slots (slot 0: 0).
    per_slot_count: Tensor
    #: ``Σ τ`` over kept blocks.
    tau_sum: Tensor
    #: Number of kept blocks.
    num_blocks: Tensor

    @property
    def loss(self) -> Tensor:
        return self.loss_sum / self.weight_sum.clamp_min(torch.finfo(torch.float32).tiny)

    @property
    def tau(self) -> Tensor:
        return self.tau_sum / self.num_blocks.clamp_min(1.0)

    @property
    def per_slot_accuracy(self) -> Tensor:
        return self.per_slot_correct / self.per_slot_count.clamp_min(1.0)

    def stats_vector(self) -> Tensor:
        """``[2B + 4]`` detached fp32: loss_sum, weight_sum, tau_sum, num_blocks, correct…, count….

        One tensor to all-reduce (SUM) across ranks; :meth:`from_stats_vector` reads it back.
        """
        head = torch.stack([self.loss_sum.detach(), self.weight_sum, self.tau_sum, self.num_blocks])
        return torch.cat([head, self.per_slot_correct, self.per_slot_count]).float()

    @classmethod
    def from_stats_vector(cls, vec: Tensor) -> "LossOutput":
        b = (vec.numel() - 4) // 2
        return cls(loss_sum=vec[0], weight_sum=vec[1], tau_sum=vec[2], num_blocks=vec[3],
                   per_slot_correct=vec[4:4 + b], per_slot_count=vec[4 + b:4 + 2 * b])


def acceptance_lengths(correct: Tensor, valid: Tensor) -> Tensor:
    """Greedy acceptance length per block: ``[R, A, B]`` bools → ``[R, A]`` fp32.

    ``τ = 1 + #leading slots k = 1, 2, … with correct & valid``; slot 0 is ignored (the anchor is
    given). Dropped blocks get 1 here; exclude them when averaging.
    """
    ok = (correct & valid)[..., 1:].float()
    return 1.0 + torch.cumprod(ok, dim=-1).sum(-1)


def dflash_loss(hidden: Tensor, lm_head: nn.Module, labels: Tensor, valid: Tensor, gamma: float,
                chunk: int = LOSS_CHUNK_ROWS, block_keep: Optional[Tensor] = None,
                chunk_fn: Optional[Callable[..., Any]] = None, weighting: str = "decay",
                dpace_alpha: float = DPACE_ALPHA) -> LossOutput:
    """Position-weighted cross entropy of the drafter's block predictions, with accuracy and τ.

    ``loss_sum = Σ_{r,i,k} w · valid · CE(lm_head(hidden[r,i,k]), labels[r,i,k])`` over slots
    ``k ≥ 1`` (slot 0 excluded). ``weighting="decay"``: ``w_k = exp(−(k − 1)/γ)`` (DFlash paper
    §4) and ``weight_sum = Σ w``. ``weighting="dpace"``: ``w`` = :func:`dpace_weights` of the
    block's own confidences ``exp(−CE)`` (detached: no gradient flows through the weights) and
    ``weight_sum`` = the number of blocks with a valid slot (:func:`loss_denominator`). Logits
    are computed once, in chunks of ``chunk`` rows over slots 1 … B−1 only; CE and softmax in fp32.

    Args:
        hidden: ``[R, A, B, D]`` final-normed drafter states (any float dtype).
        lm_head: the target's frozen head: a module with ``weight [V, D]`` (and optional ``bias``).
        labels: ``[R, A, B]`` int64 (:func:`build_block_labels`).
        valid: ``[R, A, B]`` bool.
        gamma: γ of the decay (``dflash.config.default_gamma(B)`` by default in the trainer).
        chunk: rows of logits per chunk (``LOSS_CHUNK_ROWS``).
        block_keep: ``[R, A]`` bool blocks counted by τ; ``None`` = blocks with a valid slot.
        chunk_fn: the per-chunk computation (default :func:`linear_ce_chunk`, eager; the trainer
            passes :func:`compiled_linear_ce_chunk` when it compiles).
        weighting: ``"decay"`` or ``"dpace"`` (``drafter.loss_weighting``).
        dpace_alpha: α of :func:`dpace_weights` (``"dpace"`` only).

    Returns:
        :class:`LossOutput`; only ``loss_sum`` carries a gradient (to ``hidden``).

    Raises:
        ValueError: shape mismatch, ``chunk < 1``, unknown ``weighting`` or α outside ``[0, 1]``.
    """
    if chunk < 1:
        raise ValueError(f"chunk: must be >= 1, got {chunk}")
    r, a, b, d = hidden.shape
    if labels.shape != (r, a, b) or valid.shape != (r, a, b):
        raise ValueError(f"labels {tuple(labels.shape)} / valid {tuple(valid.shape)} do not match hidden "
                         f"{tuple(hidden.shape)}")
    n = r * a * (b - 1)
    reweight: Optional[Callable[[Tensor], Tensor]] = None
    if weighting == "decay":
        weights = label_weights(valid, gamma)  # [R, A, B], slot 0 = 0
    elif weighting == "dpace":
        if not 0.0 <= dpace_alpha <= 1.0:
            raise ValueError(f"dpace_alpha: must be in [0, 1], got {dpace_alpha}")
        weights = valid.float()  # the chunks' 0/1 mask; D-PACE weights once every CE is known
        slots = valid[:, :, 1:]
        reweight = lambda ce: dpace_weights(torch.exp(-ce).view(r, a, b - 1), slots,  # noqa: E731
                                            dpace_alpha).reshape(n)
    else:
        raise ValueError(f"weighting: must be one of {list(LOSS_WEIGHTINGS)}, got {weighting!r}")
    h = hidden[:, :, 1:].reshape(n, d)
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    bias = getattr(lm_head, "bias", None)
    loss_sum, pred = _ChunkedLinearCE.apply(h, lm_head.weight, bias, labels[:, :, 1:].reshape(n),
                                            weights[:, :, 1:].reshape(n), chunk, need_grad,
                                            chunk_fn or linear_ce_chunk, reweight)
    with torch.no_grad():
        pred = torch.cat([labels[:, :, :1], pred.view(r, a, b - 1)], dim=2)  # slot 0: placeholder
        correct = (pred == labels) & valid
        per_slot_correct = correct.float().sum(dim=(0, 1))
        per_slot_count = valid.float().sum(dim=(0, 1))
        keep = valid.any(-1) if block_keep is None else block_keep
        tau = acceptance_lengths(correct, valid)
        tau_sum = (tau * keep.float()).sum()
        num_blocks = keep.float().sum()
        weight_sum = loss_denominator(valid, gamma, weighting)
    return LossOutput(loss_sum=loss_sum, weight_sum=weight_sum, per_slot_correct=per_slot_correct,
                      per_slot_count=per_slot_count, tau_sum=tau_sum, num_blocks=num_blocks)
