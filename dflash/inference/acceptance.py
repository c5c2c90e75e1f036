"""Acceptance length τ: measured per block position, and offline on whole sequences.

**Acceptance length τ** (measured): the mean, over the target's verification passes, of the
tokens each pass adds, ``m + 1`` (accepted drafts *plus the bonus*), so ``1 ≤ τ ≤ B``. The prefill
is not a pass. The last pass counts its full ``m + 1`` even when a stop token or
``max_new_tokens`` cuts some of its tokens. Over several prompts τ is pooled: Σ(m + 1) / Σ passes.

**Offline τ** (:func:`offline_tau`, what training's evaluation measures with
:func:`dflash.training.objective.acceptance_lengths`): on a token sequence with the target's features and
greedy labels, ``1 +`` the leading block positions whose argmax equals the label, averaged over
blocks. Computed three ways, to take the measured τ apart:

* on the *dataset* conversation (every valid anchor): what training's held-out τ measures;
* on the target's *own greedy continuation* of the prompt (every anchor of it): the text decoding
  sees, so the dataset-vs-target-text gap is gone;
* on that continuation at exactly the anchors decoding visited (*replay*): in fp32 this equals the
  measured τ (the same computation, batched), so a gap between it and the measured τ is a bug
  (features, positions, mask or mask token differing between training's forward and decoding),
  and the gap between it and the all-anchor value is the anchors decoding picks: after a partial
  acceptance the next anchor is the token the drafter just got wrong, which is harder than the
  average position.

Per block position ``k = 1 … B−1`` the report gives the fraction of passes (decoding) and of blocks
(offline) in which position ``k`` was accepted (``m ≥ k``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from dflash.inference.proposer import drafter_hidden
from dflash.training.anchors import valid_anchor_mask
from dflash.training.objective import acceptance_lengths, build_block_labels

__all__ = ["OfflineTau", "offline_tau", "measured_per_position", "OFFLINE_ANCHORS_PER_CHUNK"]

#: Anchors per drafter forward in :func:`offline_tau` (bounds the ``[A·(B−1), V]`` logits).
OFFLINE_ANCHORS_PER_CHUNK = 64


@dataclass
class OfflineTau:
    """Offline acceptance length on token sequences.

    Attributes:
        tau / blocks: mean τ over all blocks of all sequences, and their number.
        first_turn_tau / first_turn_blocks: the same over anchors inside the first assistant turn.
        per_conversation: τ of each sequence (``nan`` without a block).
        per_position: ``[B − 1]``: the fraction of blocks whose block position ``k`` was accepted
            (``τ − 1 ≥ k``), ``k = 1 … B−1``.
    """

    tau: float
    blocks: int
    first_turn_tau: float
    first_turn_blocks: int
    per_conversation: list[float]
    per_position: list[float]


def _first_turn_end(loss_mask: Tensor) -> int:
    """End (exclusive) of the first run of ``True`` in ``loss_mask [S]`` (0 when there is none)."""
    idx = torch.nonzero(loss_mask).flatten()
    if idx.numel() == 0:
        return 0
    start = int(idx[0])
    after = torch.nonzero(~loss_mask[start:]).flatten()
    return start + int(after[0]) if after.numel() else loss_mask.numel()


@torch.no_grad()
def offline_tau(target: Any, drafter: nn.Module, conversations: Sequence[tuple[Tensor, Tensor]],
                labels: str = "target", anchors_per_chunk: int = OFFLINE_ANCHORS_PER_CHUNK,
                anchors: Optional[Sequence[Sequence[int]]] = None) -> OfflineTau:
    """Training's held-out τ on whole sequences.

    For each sequence: the target's ``features [1, S, L·D]`` and greedy ``target_tokens``
    (:meth:`dflash.models.target.TargetModel.forward_features`, as the target workers compute them);
    anchors = every position ``p`` with ``loss_mask[p] & loss_mask[p+1]``
    (:func:`dflash.training.anchors.valid_anchor_mask`), or those of ``anchors`` that are valid; labels
    and block-position validity from :func:`dflash.training.objective.build_block_labels`; τ per block from
    :func:`dflash.training.objective.acceptance_lengths` on the argmax of ``lm_head(hidden)``.

    Args:
        target: a :class:`dflash.models.target.TargetModel` whose ``layer_ids`` are the drafter's.
        drafter: :class:`dflash.models.drafter.DFlashDraftModel`.
        conversations: ``(input_ids [S] int64, loss_mask [S] bool)`` each.
        labels: ``target`` (the target's greedy tokens, training's default) or ``data``.
        anchors_per_chunk: anchors per drafter forward.
        anchors: per sequence, the anchor positions to use (``None`` = every valid one).

    Returns:
        :class:`OfflineTau`.

    Raises:
        ValueError: ``anchors`` has a different length than ``conversations``.
    """
    if anchors is not None and len(anchors) != len(conversations):
        raise ValueError(f"anchors: {len(anchors)} lists for {len(conversations)} conversations")
    drafter.eval()
    device = target.device
    b = int(drafter.block_size)
    head = drafter.lm_head
    all_tau: list[Tensor] = []
    first_tau: list[Tensor] = []
    per_conv: list[float] = []
    for c, (ids, mask) in enumerate(conversations):
        s = ids.numel()
        ids_r = ids.to(device).view(1, s)
        mask_r = mask.to(device).bool().view(1, s)
        pos = torch.arange(s, device=device).view(1, s)
        doc = torch.ones(1, s, dtype=torch.int32, device=device)
        feats, tgt_tokens = target.forward_features(ids_r, pos, doc)
        valid = valid_anchor_mask(mask_r, doc)[0]
        if anchors is not None:
            chosen = torch.zeros_like(valid)
            wanted = torch.tensor([a for a in anchors[c] if 0 <= a < s], dtype=torch.long, device=device)
            chosen[wanted] = True
            valid = valid & chosen
        anchor_pos = torch.nonzero(valid).flatten()
        taus = []
        for chunk in torch.split(anchor_pos, anchors_per_chunk):
            anc = chunk.view(1, -1)
            keep = torch.ones_like(anc, dtype=torch.bool)
            lab, ok = build_block_labels(ids_r, tgt_tokens, mask_r, doc, anc, keep, b, labels)
            hidden = drafter_hidden(drafter, feats, ids_r, pos, doc, anc, keep)  # [1, A, B, D]
            pred = head(hidden[:, :, 1:].to(head.weight.dtype)).argmax(dim=-1)  # [1, A, B-1]
            correct = torch.cat([lab[:, :, :1], pred], dim=2) == lab
            taus.append(acceptance_lengths(correct, ok)[0].cpu())
        tau = torch.cat(taus) if taus else torch.zeros(0)
        all_tau.append(tau)
        first_tau.append(tau[anchor_pos.cpu() < _first_turn_end(mask_r[0].cpu())])
        per_conv.append(float(tau.mean()) if tau.numel() else float("nan"))
    joined = torch.cat(all_tau) if all_tau else torch.zeros(0)
    first = torch.cat(first_tau) if first_tau else torch.zeros(0)
    per_position = [float((joined - 1 >= k).float().mean()) if joined.numel() else float("nan")
                    for k in range(1, b)]
    return OfflineTau(tau=float(joined.mean()) if joined.numel() else float("nan"), blocks=int(joined.numel()),
                      first_turn_tau=float(first.mean()) if first.numel() else float("nan"),
                      first_turn_blocks=int(first.numel()), per_conversation=per_conv, per_position=per_position)


def measured_per_position(accepted: Sequence[int], block_size: int) -> list[float]:
    """``[B − 1]``: the fraction of verification passes that accepted block position ``k``
    (``m ≥ k``, i.e. ``m + 1 > k``), ``k = 1 … B−1``; ``nan`` without passes."""
    n = len(accepted)
    return [sum(a - 1 >= k for a in accepted) / n if n else float("nan") for k in range(1, block_size)]
