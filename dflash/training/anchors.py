"""Anchor sampling: which positions of a batch open a draft block, drawn reproducibly.

Position ``p`` of a row is a valid anchor when ``loss_mask[p]``, ``loss_mask[p + 1]`` and
``doc_ids[p] == doc_ids[p + 1]`` (:func:`valid_anchor_mask`). Each row has ``A`` anchor entries,
filled either uniformly without replacement over the row (:func:`sample_anchors`) or
conversation by conversation, equal shares water-filled and capped (the DFlash paper's
per-sequence draw, arXiv 2602.06036 §4; :func:`sample_anchors_per_conversation`); sorted, padded
with ``keep = False``. Shapes are fixed by ``(R, S, A)``; nothing depends on the data's values
(no ``nonzero``, no host sync): the draw is a top-``A`` over i.i.d. uniform keys in which invalid
positions get key −1. The draw of a batch is seeded by ``(seed, data epoch, batch id)``
(:func:`anchor_seed`), so every process that trains or checks a batch draws the same anchors.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

__all__ = [
    "ANCHOR_SAMPLING",
    "anchor_seed",
    "anchor_generator",
    "valid_anchor_mask",
    "sample_anchors",
    "conversation_index",
    "conversation_anchor_quotas",
    "sample_anchors_per_conversation",
    "draw_anchors",
    "response_offsets",
]

#: ``drafter.anchor_sampling``: per packed row, or the row's anchor entries shared among its conversations.
ANCHOR_SAMPLING = ("row", "conversation")
#: Sort key of an invalid anchor position (valid ones draw from [0, 1)).
_INVALID_KEY = -1.0
_MASK64 = (1 << 64) - 1


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
    """How many of a row's ``A`` anchor entries each conversation gets: ``[R, C]`` int64.

    Water-filling (max–min fair share). With ``T = min(cap, A)`` (``A`` without a cap),
    conversation ``c`` with ``n_c`` valid anchor positions gets ``min(n_c, t)``, where the level
    ``t`` is the largest integer in ``[0, T]`` with ``Σ_c min(n_c, t) ≤ A``. When ``t < T``, the
    ``A − Σ_c min(n_c, t)`` entries left over (fewer than the conversations with ``n_c > t``) go one
    each to the conversations with ``n_c > t`` of highest ``priority`` (ties: lower index first).
    So every conversation gets an equal share, a short one all its positions with its unused
    share spread over the others, and none more than ``cap``: the rule of the DFlash paper
    (§4: up to 512 anchors per *sequence*) and of SpecForge (``_sample_anchor_positions`` in
    ``specforge/algorithms/common/dflash_family_model.py``: ``min(num_anchors, n)`` per sequence)
    whenever the row's anchor entries suffice, an equal split when they do not. No host synchronisation:
    a binary search over ``t`` whose number of steps depends only on ``T``.

    Args:
        counts: ``[R, C]`` int64 valid anchor positions per conversation.
        num_anchors: ``A``, the row's anchor entries (``drafter.anchors_per_row``).
        cap: most anchors of one conversation (``drafter.anchors_per_conversation``); ``None`` = no cap.
        priority: ``[R, C]`` float: the order in which left-over entries are handed out.

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
    row's fixed ``A`` anchor entries are shared among its conversations by :func:`conversation_anchor_quotas`
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


def response_offsets(loss_mask: Tensor, doc_ids: Tensor) -> Tensor:
    """How far into its response each position lies: ``[R, S]`` int64.

    A response is a maximal run of ``loss_mask == True`` inside one conversation (``doc_ids``
    constant): an assistant turn. Position ``p`` of a run starting at ``s`` gets ``p − s``
    (0 at the response's first token); positions outside ``loss_mask`` get −1. A new
    conversation (``doc_ids`` changes) or a new assistant turn (after masked user tokens) starts a
    new run. Vectorised (a cumulative max over the run starts), no host synchronisation.

    Used to split held-out τ by the anchor's offset (``train.eval_head_tokens``): speculative
    decoding of ``n`` new tokens only ever sees anchors at offsets below ``n``.

    Args:
        loss_mask: ``[R, S]`` bool.
        doc_ids: ``[R, S]`` int (conversations: runs of equal values).

    Returns:
        ``[R, S]`` int64 offsets, −1 where ``loss_mask`` is False.

    Raises:
        ValueError: mismatched or non-2-D shapes.
    """
    if loss_mask.shape != doc_ids.shape or loss_mask.dim() != 2:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} and doc_ids {tuple(doc_ids.shape)} must be [R, S]")
    in_loss = loss_mask.bool()
    r, s = in_loss.shape
    start = in_loss.clone()
    start[:, 1:] &= ~in_loss[:, :-1] | (doc_ids[:, 1:] != doc_ids[:, :-1])
    j = torch.arange(s, device=in_loss.device).expand(r, s)
    run_start = torch.cummax(torch.where(start, j, torch.zeros_like(j)), dim=1).values
    return torch.where(in_loss, j - run_start, torch.full_like(j, -1))
