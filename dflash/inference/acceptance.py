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

The *walk* (:func:`walk_tau`) predicts the measured τ without decoding: it visits, on the
target's own continuation, the anchors decoding would visit given the offline τ of each (the first
at the prompt length, the next at ``a + τ(a)``) and averages τ over them. With the text scored at
least ``B − 1`` tokens past its last token it equals the measured τ pass for pass in fp32; on the
continuation alone only the last pass of a prompt can come out lower (see :func:`walk_tau`; the
decoding report re-scores that block on the continued text, :mod:`dflash.inference.spec_report`).

Per block position ``k = 1 … B−1`` the report gives the fraction of passes (decoding) and of blocks
(offline) in which position ``k`` was accepted (``m ≥ k``), and, per prompt set, the *conditional*
acceptance (:func:`conditional_acceptance`): of the passes that accepted drafts ``1 … k−1``, the
fraction that accepted draft ``k`` too. When those rates are alike at every ``k`` (one rate ``p``),
τ ≈ ``(1 − p^B) / (1 − p)``, and a recipe raises τ only by raising every position's rate, the first's
included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from dflash.inference.proposer import drafter_hidden
from dflash.training.anchors import valid_anchor_mask
from dflash.training.objective import acceptance_lengths, build_block_labels

__all__ = ["OfflineTau", "offline_tau", "Walk", "walk_tau", "measured_per_position",
           "conditional_acceptance", "OFFLINE_ANCHORS_PER_CHUNK"]

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
        per_anchor: per sequence, ``(anchor positions [N] int64, τ [N] int64)`` on the CPU, the
            anchors ascending (the input of :func:`walk_tau`).
    """

    tau: float
    blocks: int
    first_turn_tau: float
    first_turn_blocks: int
    per_conversation: list[float]
    per_position: list[float]
    per_anchor: list[tuple[Tensor, Tensor]] = field(default_factory=list)


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
                anchors: Optional[Sequence[Sequence[int]]] = None,
                progress: Optional[Callable[[int], None]] = None) -> OfflineTau:
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
        progress: called with 1 after each sequence (e.g. :meth:`dflash.progress.Progress.advance`).

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
    per_anchor: list[tuple[Tensor, Tensor]] = []
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
        # torch.split of no anchors still yields one (empty) chunk: a response of one token has none
        for chunk in torch.split(anchor_pos, anchors_per_chunk) if anchor_pos.numel() else ():
            anc = chunk.view(1, -1)
            keep = torch.ones_like(anc, dtype=torch.bool)
            lab, ok = build_block_labels(ids_r, tgt_tokens, mask_r, doc, anc, keep, b, labels)
            hidden = drafter_hidden(drafter, feats, ids_r, pos, doc, anc, keep)  # [1, A, B, D]
            pred = head(hidden[:, :, 1:].to(head.weight.dtype)).argmax(dim=-1)  # [1, A, B-1]
            correct = torch.cat([lab[:, :, :1], pred], dim=2) == lab
            taus.append(acceptance_lengths(correct, ok)[0].cpu())
        tau = torch.cat(taus) if taus else torch.zeros(0)
        all_tau.append(tau)
        per_anchor.append((anchor_pos.cpu().long(), tau.round().long()))
        first_tau.append(tau[anchor_pos.cpu() < _first_turn_end(mask_r[0].cpu())])
        per_conv.append(float(tau.mean()) if tau.numel() else float("nan"))
        if progress is not None:
            progress(1)
    joined = torch.cat(all_tau) if all_tau else torch.zeros(0)
    first = torch.cat(first_tau) if first_tau else torch.zeros(0)
    per_position = [float((joined - 1 >= k).float().mean()) if joined.numel() else float("nan")
                    for k in range(1, b)]
    return OfflineTau(tau=float(joined.mean()) if joined.numel() else float("nan"), blocks=int(joined.numel()),
                      first_turn_tau=float(first.mean()) if first.numel() else float("nan"),
                      first_turn_blocks=int(first.numel()), per_conversation=per_conv, per_position=per_position,
                      per_anchor=per_anchor)


@dataclass
class Walk:
    """The anchors speculative decoding visits on a fixed text, and the τ of each.

    Attributes:
        anchors: visited anchor positions, ascending (as
            :attr:`dflash.inference.generation.Generation.anchors`).
        accepted: τ at each, ``m + 1`` (as :attr:`dflash.inference.generation.Generation.accepted`).
    """

    anchors: list[int]
    accepted: list[int]

    @property
    def passes(self) -> int:
        """Verification passes."""
        return len(self.anchors)

    @property
    def total(self) -> int:
        """Σ τ over the passes (tokens the passes add, the last pass counted in full)."""
        return sum(self.accepted)

    @property
    def tau(self) -> float:
        """Mean τ over the passes (``nan`` without one)."""
        return self.total / self.passes if self.passes else float("nan")


def walk_tau(anchors: Tensor, taus: Tensor, start: int, end: int) -> Walk:
    """Walk speculative decoding's anchors over a fixed text, each block accepting its offline τ.

    The rule is greedy DFlash decoding's (:meth:`dflash.inference.decode_steps.DecodeSteps._verify_step_impl`):
    the prefill emits the token at ``start`` (the prompt length), which is the first anchor; the
    pass at anchor ``a`` accepts ``m = τ(a) − 1`` drafts and emits them and the bonus token, i.e.
    positions ``a + 1 … a + τ(a)``, and the bonus at ``a + τ(a)`` is the next anchor; the row ends
    with the pass that emits position ``end``, the text's last token (its stop token or its
    ``max_new_tokens``-th): a pass runs at ``a`` iff ``a < end``. So ``start == end`` (one new token)
    gives no pass, as decoding does.

    The last pass: decoding verifies its whole block, also past ``end`` (drafts after a stop
    token, or past ``max_new_tokens``), and counts ``m + 1`` in full. The walk reproduces that
    exactly when ``taus`` were scored on text that goes on at least ``B − 1`` tokens past ``end``
    (the target's greedy continuation without stopping). On text that ends at ``end`` the block
    positions past it are not scored, so the last pass gets ``min(m + 1, 1 + end − a)``: the walk
    visits the same anchors as decoding and the same τ at every pass but the last, where it is
    lower by the drafts decoding accepted past the text's end (at most ``B − 2`` tokens a prompt).

    Args:
        anchors: ``[N]`` int64 anchor positions (any order; every position ``start … end − 1`` the
            walk lands on must be among them), e.g. :attr:`OfflineTau.per_anchor`.
        taus: ``[N]`` τ at each anchor (integers ``≥ 1``, any numeric dtype).
        start: position of the first generated token (the prompt length ``P``).
        end: position of the last generated token (``P + new tokens − 1``); ``end < start`` (no
            new token) gives no pass.

    Returns:
        :class:`Walk`.

    Raises:
        ValueError: ``anchors`` and ``taus`` differ in shape or are not 1-D, a τ below 1, or the
            walk lands on a position that has no τ.
    """
    if anchors.dim() != 1 or anchors.shape != taus.shape:
        raise ValueError(f"anchors {tuple(anchors.shape)} / taus {tuple(taus.shape)}: need two 1-D tensors "
                         "of one length")
    tau_at = dict(zip(anchors.tolist(), (int(round(float(t))) for t in taus.tolist())))
    visited: list[int] = []
    accepted: list[int] = []
    a = int(start)
    while a < end:
        if a not in tau_at:
            raise ValueError(f"anchors: the walk from {start} to {end} lands on position {a}, which has no τ")
        t = tau_at[a]
        if t < 1:
            raise ValueError(f"taus: τ at anchor {a} is {t}, must be >= 1")
        visited.append(a)
        accepted.append(t)
        a += t
    return Walk(anchors=visited, accepted=accepted)


def measured_per_position(accepted: Sequence[int], block_size: int) -> list[float]:
    """``[B − 1]``: the fraction of verification passes that accepted block position ``k``
    (``m ≥ k``, i.e. ``m + 1 > k``), ``k = 1 … B−1``; ``nan`` without passes."""
    n = len(accepted)
    return [sum(a - 1 >= k for a in accepted) / n if n else float("nan") for k in range(1, block_size)]


def conditional_acceptance(accepted: Sequence[int], block_size: int) -> list[float]:
    """``[B − 1]``: per draft position ``k = 1 … B−1``, the fraction of the verification passes that
    accepted drafts ``1 … k−1`` (``m + 1 ≥ k``) which accepted draft ``k`` too (``m + 1 ≥ k + 1``);
    ``nan`` where no pass reached ``k``.

    Args:
        accepted: each pass's ``m + 1`` (:attr:`dflash.inference.generation.Generation.accepted`),
            ints in ``[1, B]``.
        block_size: ``B``.

    Raises:
        ValueError: an entry outside ``[1, block_size]``.
    """
    bad = [a for a in accepted if not 1 <= a <= block_size]
    if bad:
        raise ValueError(f"accepted: every pass adds 1 … {block_size} tokens, got {bad[:5]}")
    rates = []
    for k in range(1, block_size):
        reached = sum(a >= k for a in accepted)
        rates.append(sum(a >= k + 1 for a in accepted) / reached if reached else float("nan"))
    return rates
