"""The DFlash training objective: block labels, position weights, the loss, accuracy and τ.

Follows docs/DFLASH.md and the label rule of docs/ARCHITECTURE.md (DFlash paper, arXiv
2602.06036, §3–4). The anchors come from :mod:`dflash.training.anchors`, the attention masks
from :mod:`dflash.models.masks`, the chunked LM-head cross-entropy from
:mod:`dflash.training.chunked_ce`.

* **Blocks.** Anchor ``a`` opens ``[input_ids[a], MASK × (B − 1)]`` at positions
  ``position_ids[a] + k``.
* **Labels** (same position, no shift). Block position ``k ≥ 1`` predicts the token at ``a + k``:
  ``target_tokens[a + k − 1]`` (``labels="target"``) or ``input_ids[a + k]`` (``"data"``); it
  counts when ``a + k < S``, same conversation, ``loss_mask[a + k]`` and the anchor is kept.
  Block position 0 never counts. With ``chain`` (``drafter.label_chain``) it also needs the text
  between the anchor and it, ``input_ids[a + 1 .. a + k − 1]``, to be the target's greedy tokens:
  the labels are then exactly the greedy continuation that decoding verifies, also on text the
  target did not write (raw data, sampled responses).
* **Loss.** ``Σ CE·w / Σ w`` with ``w_k = exp(−(k − 1)/γ)`` on valid block positions; or,
  optionally, D-PACE (:func:`dpace_weights`: weights from the drafter's own confidences) divided
  by the number of blocks. :func:`dflash_loss` returns numerator and denominator separately so
  data-parallel ranks can all-reduce the denominator (:func:`loss_denominator`: known before
  the forward pass).
* **Distillation** (optional, ``drafter.distillation`` λ > 0): each block position also learns
  the target's whole next-token distribution at its label, ``softmax(lm_head(target_hidden[a + k − 1]))``
  (:func:`teacher_rows`), by forward KL: the per-position loss is ``(1 − λ)·CE + λ·KL``
  (:func:`dflash.training.chunked_ce.linear_kd_chunk`).
* **τ** (acceptance length, greedy, per block): ``1 +`` the number of leading block positions
  ``k = 1, 2, …`` whose argmax equals the label; a block stops at its first invalid position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional

import torch
from torch import Tensor, nn

from dflash.training.chunked_ce import LOSS_CHUNK_ROWS, chunked_linear_ce, linear_ce_chunk, linear_kd_chunk

__all__ = [
    "LOSS_WEIGHTINGS",
    "DPACE_ALPHA",
    "LossOutput",
    "build_block_labels",
    "teacher_rows",
    "block_position_weights",
    "label_weights",
    "dpace_weights",
    "loss_denominator",
    "acceptance_lengths",
    "dflash_loss",
]

#: ``drafter.loss_weighting``: the paper's fixed decay ``exp(−(k − 1)/γ)``, or D-PACE.
LOSS_WEIGHTINGS = ("decay", "dpace")
#: D-PACE confidence smoothing α when ``drafter.dpace_alpha`` is null (the D-PACE paper's value).
DPACE_ALPHA = 0.5


def build_block_labels(input_ids: Tensor, target_tokens: Optional[Tensor], loss_mask: Tensor, doc_ids: Tensor,
                       anchors: Tensor, anchor_keep: Tensor, block_size: int,
                       labels: Literal["target", "data"] = "target", chain: bool = False) -> tuple[Tensor, Tensor]:
    """Labels and validity of every block position (docs/ARCHITECTURE.md, "The drafter's labels").

    Block position ``k`` of the block at anchor ``a`` is position ``p = a + k`` (same position, no shift).
    Its label is ``target_tokens[p − 1]`` (the target's greedy prediction *for* ``p``) or
    ``input_ids[p]``; it is valid when ``k ≥ 1``, ``p < S``, ``doc_ids[p] == doc_ids[a]``,
    ``loss_mask[p]`` and ``anchor_keep``; with ``chain``, also when ``input_ids[a + j] ==
    target_tokens[a + j − 1]`` for every ``1 ≤ j < k``: the block's labels are the target's greedy
    continuation from the anchor (what greedy verification accepts), cut where the text leaves it.
    Where the text is the target's own greedy output, ``chain`` changes nothing.

    Args:
        input_ids, loss_mask, doc_ids: ``[R, S]`` (int64, bool, int).
        target_tokens: ``[R, S]`` int64 (required for ``labels="target"``).
        anchors, anchor_keep: ``[R, A]`` int64 / bool.
        block_size: ``B``.
        chain: cut each block where the text leaves the target's greedy path (``labels="target"`` only).

    Returns:
        ``(labels [R, A, B] int64, valid [R, A, B] bool)``; invalid block positions hold label 0.

    Raises:
        ValueError: unknown ``labels``, missing ``target_tokens``, or ``chain`` with ``labels="data"``.
    """
    if labels not in ("target", "data"):
        raise ValueError(f"labels: must be 'target' or 'data', got {labels!r}")
    if labels == "target" and target_tokens is None:
        raise ValueError("labels='target' needs target_tokens")
    if chain and labels != "target":
        raise ValueError("chain: needs labels='target' (the greedy path is the target's)")
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
        if chain:
            # greedy[k]: the text at a + k is the target's greedy token there (block position 0: true)
            greedy = (input_ids.gather(1, safe).view(r, num_anchors, block_size) == lab) | (k == 0)
            # position k needs greedy text at 1 .. k - 1: the running product, shifted by one
            on_path = torch.cumprod(greedy.to(torch.int32), dim=-1).roll(1, dims=-1)
            on_path[..., 0] = 1
            valid = valid & on_path.bool()
    else:
        lab = input_ids.gather(1, safe).view(r, num_anchors, block_size)
    lab = torch.where(valid, lab, torch.zeros_like(lab))
    return lab.long(), valid


def teacher_rows(target_hidden: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """The target's final-normed hidden state that predicts each block position's label.

    Block position ``k ≥ 1`` of the block at anchor ``a`` is labelled by the target's prediction
    *for* ``a + k``, made at position ``a + k − 1`` (:func:`build_block_labels`), so its teacher row
    is ``target_hidden[a + k − 1]``, clamped to ``S − 1`` (positions past the row are invalid and
    weigh 0 in the loss).

    Args:
        target_hidden: ``[R, S, D]`` the target's final-normed hidden states (the LM head's input).
        anchors: ``[R, A]`` int64.
        block_size: ``B``.

    Returns:
        ``[R, A, B − 1, D]`` in ``target_hidden``'s dtype, for block positions ``1 … B − 1``.
    """
    r, s, d = target_hidden.shape
    num_anchors = anchors.shape[1]
    k = torch.arange(block_size - 1, device=anchors.device)
    pos = (anchors.unsqueeze(-1) + k).clamp(max=s - 1).reshape(r, num_anchors * (block_size - 1))
    rows = target_hidden.gather(1, pos.unsqueeze(-1).expand(-1, -1, d))
    return rows.view(r, num_anchors, block_size - 1, d)


def block_position_weights(block_size: int, gamma: float, device: Optional[torch.device] = None) -> Tensor:
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
    return valid.float() * block_position_weights(valid.shape[-1], gamma, valid.device)


def dpace_weights(confidence: Tensor, valid: Tensor, alpha: float = DPACE_ALPHA) -> Tensor:
    """D-PACE weights of every block position: ``[R, A, B]`` fp32, to be used detached.

    D-PACE (Dynamic Position-Aware Cross-Entropy; arXiv 2605.18810, Eq. 7–8; SpecForge PR 578,
    ``_dpace_weight`` in ``specforge/algorithms/common/dflash_family_model.py``). With ``q_k`` the
    drafter's probability of the label at block position ``k``: smoothed ``q̃_k = (1 − α)·q_k + α`` (Eq. 7),
    cumulative confidence ``P_m = Π_{i ≤ m} q̃_i`` (the chance a block is accepted through block
    ``m``) and ``w_k = Σ_{m ≥ k} P_m`` (Eq. 8), so ``Σ_k w_k · CE_k`` has the gradient of the
    (smoothed) expected acceptance length ``Σ_m P_m``. As in SpecForge, an invalid block position counts as
    ``q̃ = 1`` in the products and is left out of the sums; its own weight is 0.

    Args:
        confidence: ``[..., B]`` float: ``q_k = exp(−CE_k)``.
        valid: ``[..., B]`` bool: block positions that count (:func:`build_block_labels`).
        alpha: α in ``[0, 1]`` (``drafter.dpace_alpha``; 0.5 in the paper).

    Returns:
        ``[..., B]`` fp32 weights, 0 on invalid block positions.

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

    ``"decay"``: ``Σ w`` over valid block positions (:func:`label_weights`), so the loss is the weighted mean
    CE (DFlash paper §4). ``"dpace"``: the number of blocks with a valid block position, so the loss is the
    mean over blocks of ``Σ_k w_k CE_k`` (its weights depend on the forward pass, so ``Σ w``
    cannot be the denominator of an all-reduced loss; the D-PACE author's proposal in
    sgl-project/SpecForge issue #828, "normalize by the number of valid sampled anchors").

    Raises:
        ValueError: unknown ``weighting``.
    """
    if weighting == "decay":
        return label_weights(valid, gamma).sum()
    if weighting == "dpace":
        return valid.any(-1).float().sum()
    raise ValueError(f"weighting: must be one of {list(LOSS_WEIGHTINGS)}, got {weighting!r}")


@dataclass
class LossOutput:
    """What one batch contributes to the loss and the metrics.

    All fields are fp32 tensors on the batch's device (no host sync); sums, so ranks and batches
    add up. ``loss = loss_sum / weight_sum``; ``tau = tau_sum / num_blocks``;
    accuracy per block position ``= block_pos_correct / block_pos_count``.
    """

    #: ``Σ CE·w`` over valid block positions, with distillation ``Σ ((1 − λ)·CE + λ·KL)·w`` (the only
    #: field with a gradient).
    loss_sum: Tensor
    #: The loss denominator (no gradient): ``Σ w``, or with D-PACE weights the number of blocks
    #: with a valid block position (:func:`loss_denominator`).
    weight_sum: Tensor
    #: ``[B]``: valid block positions whose argmax equals the label (block position 0: 0).
    block_pos_correct: Tensor
    #: ``[B]``: valid block positions (block position 0: 0).
    block_pos_count: Tensor
    #: ``Σ τ`` over kept blocks.
    tau_sum: Tensor
    #: Number of kept blocks.
    num_blocks: Tensor
    #: ``[R, A]`` τ of every block (dropped ones: 1), as :func:`dflash_loss` computed it; not a
    #: sum, so not in :meth:`stats_vector` (``None`` after :meth:`from_stats_vector`).
    block_tau: Optional[Tensor] = field(default=None, kw_only=True, repr=False)
    #: Rows the LM head ran over (the counted block positions padded to whole chunks, or every
    #: one), for the step's FLOP count; ``None`` after :meth:`from_stats_vector`.
    head_rows: Optional[int] = field(default=None, kw_only=True)

    @property
    def loss(self) -> Tensor:
        return self.loss_sum / self.weight_sum.clamp_min(torch.finfo(torch.float32).tiny)

    @property
    def tau(self) -> Tensor:
        return self.tau_sum / self.num_blocks.clamp_min(1.0)

    @property
    def block_pos_accuracy(self) -> Tensor:
        return self.block_pos_correct / self.block_pos_count.clamp_min(1.0)

    def stats_vector(self) -> Tensor:
        """``[2B + 4]`` detached fp32: loss_sum, weight_sum, tau_sum, num_blocks, correct…, count….

        One tensor to all-reduce (SUM) across ranks; :meth:`from_stats_vector` reads it back.
        """
        head = torch.stack([self.loss_sum.detach(), self.weight_sum, self.tau_sum, self.num_blocks])
        return torch.cat([head, self.block_pos_correct, self.block_pos_count]).float()

    @classmethod
    def from_stats_vector(cls, vec: Tensor) -> "LossOutput":
        b = (vec.numel() - 4) // 2
        return cls(loss_sum=vec[0], weight_sum=vec[1], tau_sum=vec[2], num_blocks=vec[3],
                   block_pos_correct=vec[4:4 + b], block_pos_count=vec[4 + b:4 + 2 * b])


def acceptance_lengths(correct: Tensor, valid: Tensor) -> Tensor:
    """Greedy acceptance length per block: ``[R, A, B]`` bools → ``[R, A]`` fp32.

    ``τ = 1 + #leading block positions k = 1, 2, … with correct & valid``; block position 0 is ignored (the anchor is
    given). Dropped blocks get 1 here; exclude them when averaging.
    """
    ok = (correct & valid)[..., 1:].float()
    return 1.0 + torch.cumprod(ok, dim=-1).sum(-1)


def _counted_rows(counted: Tensor, chunk: int) -> Optional[tuple[Tensor, int]]:
    """The LM-head rows :func:`dflash_loss` computes when it skips uncounted ones: ``(idx [m]
    int64, k)``, the ``k`` counted rows of ``counted [n]`` in order, then ``m − k`` copies of row 0
    (padding) so that ``m`` is the least whole number of chunks (at least one). Every chunk then
    has ``chunk`` rows, so a compiled chunk function sees one shape whatever ``k`` is. ``None``
    when ``n ≤ chunk`` (one chunk of every row, a shape fixed by the batch). Reads ``k`` on the
    host (one sync)."""
    n = counted.numel()
    if n <= chunk:
        return None
    sel = counted.nonzero().view(-1)
    k = sel.numel()
    m = max(1, -(-k // chunk)) * chunk
    return torch.cat([sel, sel.new_zeros(m - k)]), k


def dflash_loss(hidden: Tensor, lm_head: nn.Module, labels: Tensor, valid: Tensor, gamma: float,
                chunk: int = LOSS_CHUNK_ROWS, block_keep: Optional[Tensor] = None,
                chunk_fn: Optional[Callable[..., Any]] = None, weighting: str = "decay",
                dpace_alpha: float = DPACE_ALPHA, teacher: Optional[Tensor] = None,
                distillation: float = 0.0, counted_rows_only: bool = True) -> LossOutput:
    """Position-weighted cross entropy of the drafter's block predictions, with accuracy and τ.

    ``loss_sum = Σ_{r,i,k} w · valid · CE(lm_head(hidden[r,i,k]), labels[r,i,k])`` over block
    positions ``k ≥ 1`` (position 0 excluded). ``weighting="decay"``: ``w_k = exp(−(k − 1)/γ)`` (DFlash paper
    §4) and ``weight_sum = Σ w``. ``weighting="dpace"``: ``w`` = :func:`dpace_weights` of the
    block's own confidences ``exp(−CE)`` (detached: no gradient flows through the weights) and
    ``weight_sum`` = the number of blocks with a valid block position (:func:`loss_denominator`). Logits
    are computed once, in chunks of ``chunk`` rows over block positions 1 … B−1 only; CE and softmax in fp32.

    **Counted rows only.** An invalid block position adds nothing: its weight is 0 in both
    weightings, and D-PACE reads only valid positions' confidences. So by default the LM head runs
    only over the valid rows, gathered (one device→host sync for their number) and padded with
    weight-0 rows to whole chunks, so every chunk has the same shape; the loss, its gradient, the
    accuracy and τ are those of all rows up to the order of the fp32 sums. Where label cutting
    (``drafter.label_chain`` on text the target did not write), response ends and dropped anchors
    leave most block positions invalid, that skips most of the head's work. Every chunk has
    ``chunk`` rows (one compiled shape), so up to ``chunk − 1`` padding rows run where every
    position counts; with at most ``chunk`` rows in all, one chunk takes them all.
    With ``distillation`` λ > 0 the CE of every row becomes ``(1 − λ)·CE + λ·KL(p ‖ q)``, ``p`` the
    target's distribution from ``teacher`` (:func:`dflash.training.chunked_ce.linear_kd_chunk`).

    Args:
        hidden: ``[R, A, B, D]`` final-normed drafter states (any float dtype).
        lm_head: the target's frozen head: a module with ``weight [V, D]`` (and optional ``bias``).
        labels: ``[R, A, B]`` int64 (:func:`build_block_labels`).
        valid: ``[R, A, B]`` bool.
        gamma: γ of the decay (``dflash.config.default_gamma(B)`` by default in the trainer).
        chunk: rows of logits per chunk (:data:`dflash.training.chunked_ce.LOSS_CHUNK_ROWS`).
        block_keep: ``[R, A]`` bool blocks counted by τ; ``None`` = blocks with a valid block position.
        chunk_fn: the per-chunk computation (default
            :func:`dflash.training.chunked_ce.linear_ce_chunk`, eager; the trainer passes
            :func:`~dflash.training.chunked_ce.compiled_linear_ce_chunk` when it compiles).
        weighting: ``"decay"`` or ``"dpace"`` (``drafter.loss_weighting``).
        dpace_alpha: α of :func:`dpace_weights` (``"dpace"`` only).
        teacher: ``[R, A, B − 1, D]`` the target's hidden rows of :func:`teacher_rows` (needed when
            ``distillation > 0``, else unused); ``chunk_fn`` must then take them
            (:func:`~dflash.training.chunked_ce.linear_kd_chunk` or its compiled form).
        distillation: λ in ``[0, 1]`` (``drafter.distillation``; decay weighting only).
        counted_rows_only: run the LM head over the valid rows only (above); ``False``: over
            every block position ``k ≥ 1``.

    Returns:
        :class:`LossOutput` (with ``block_tau`` and ``head_rows``); only ``loss_sum`` carries a
        gradient (to ``hidden``).

    Raises:
        ValueError: shape mismatch, ``chunk < 1``, unknown ``weighting``, α or λ outside ``[0, 1]``,
            distillation without ``teacher`` or with D-PACE weights.
    """
    if chunk < 1:
        raise ValueError(f"chunk: must be >= 1, got {chunk}")
    if not 0.0 <= distillation <= 1.0:
        raise ValueError(f"distillation: must be in [0, 1], got {distillation}")
    r, a, b, d = hidden.shape
    if labels.shape != (r, a, b) or valid.shape != (r, a, b):
        raise ValueError(f"labels {tuple(labels.shape)} / valid {tuple(valid.shape)} do not match hidden "
                         f"{tuple(hidden.shape)}")
    n = r * a * (b - 1)
    reweight: Optional[Callable[[Tensor], Tensor]] = None
    if weighting == "decay":
        weights = label_weights(valid, gamma)  # [R, A, B], block position 0 = 0
    elif weighting == "dpace":
        if not 0.0 <= dpace_alpha <= 1.0:
            raise ValueError(f"dpace_alpha: must be in [0, 1], got {dpace_alpha}")
        weights = valid.float()  # the chunks' 0/1 mask; D-PACE weights once every CE is known
        counted = valid[:, :, 1:]
        reweight = lambda ce: dpace_weights(torch.exp(-ce).view(r, a, b - 1), counted,  # noqa: E731
                                            dpace_alpha).reshape(n)
    else:
        raise ValueError(f"weighting: must be one of {list(LOSS_WEIGHTINGS)}, got {weighting!r}")
    teacher_h = None
    if distillation > 0:
        if weighting != "decay":
            raise ValueError("distillation: needs weighting='decay' (D-PACE weights come from the CE alone)")
        if teacher is None or teacher.shape[:3] != (r, a, b - 1):
            raise ValueError(f"distillation: needs teacher rows [R, A, B-1, D] = [{r}, {a}, {b - 1}, D], got "
                             f"{None if teacher is None else tuple(teacher.shape)}")
        teacher_h = teacher.reshape(n, teacher.shape[-1])
    h = hidden[:, :, 1:].reshape(n, d)
    y = labels[:, :, 1:].reshape(n)
    w = weights[:, :, 1:].reshape(n)
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    bias = getattr(lm_head, "bias", None)
    fn = chunk_fn or (linear_ce_chunk if teacher_h is None else linear_kd_chunk)
    rows = _counted_rows(valid[:, :, 1:].reshape(n), chunk) if counted_rows_only else None
    if rows is None:
        head_rows = n
        loss_sum, pred = chunked_linear_ce(h, lm_head.weight, bias, y, w, chunk, need_grad, fn, reweight, teacher_h,
                                           distillation)
    else:
        idx, k = rows  # [m] row ids: the k counted rows, then padding (row 0, weight 0)
        head_rows = idx.numel()
        reweight_rows = None
        if reweight is not None:
            every_row = reweight

            def reweight_rows(ce: Tensor) -> Tensor:  # the chunks' CE back in place, D-PACE over every row
                out = every_row(ce.new_zeros(n).index_copy_(0, idx[:k], ce[:k])).index_select(0, idx)
                out[k:] = 0.0
                return out

        w_rows = w.index_select(0, idx)
        w_rows[k:] = 0.0
        loss_sum, pred_rows = chunked_linear_ce(h.index_select(0, idx), lm_head.weight, bias, y.index_select(0, idx),
                                                w_rows, chunk, need_grad, fn, reweight_rows,
                                                None if teacher_h is None else teacher_h.index_select(0, idx),
                                                distillation)
        # an uncounted row's argmax is never read (accuracy and τ count valid positions only)
        pred = y.new_full((n,), -1).index_copy_(0, idx[:k], pred_rows[:k])
    with torch.no_grad():
        pred = torch.cat([labels[:, :, :1], pred.view(r, a, b - 1)], dim=2)  # block position 0: placeholder
        correct = (pred == labels) & valid
        block_pos_correct = correct.float().sum(dim=(0, 1))
        block_pos_count = valid.float().sum(dim=(0, 1))
        keep = valid.any(-1) if block_keep is None else block_keep
        tau = acceptance_lengths(correct, valid)
        tau_sum = (tau * keep.float()).sum()
        num_blocks = keep.float().sum()
        weight_sum = loss_denominator(valid, gamma, weighting)
    return LossOutput(loss_sum=loss_sum, weight_sum=weight_sum, block_pos_correct=block_pos_correct,
                      block_pos_count=block_pos_count, tau_sum=tau_sum, num_blocks=num_blocks, block_tau=tau,
                      head_rows=head_rows)
