"""What a held-out evaluation adds to the loss's sums: τ over the response heads and speculative
decoding's walk over whole responses (training's prediction of decoding τ).

:class:`EvalOutput` extends :class:`dflash.training.objective.LossOutput` with the head sums
(anchors within ``train.eval_head_tokens`` of their response's start) and, optionally, the walk's
sums (:class:`WalkSums`, :func:`walked_tau_sums` over :func:`position_tau`, whose blocks
:func:`leading_tau` scores). :func:`eval_sums` turns a batch's output into host numbers that add
over batches and ranks, :func:`aggregate_eval` turns their sum into the ``eval/*`` metrics.

This module knows nothing of the trainer: :class:`dflash.training.trainer.DrafterTrainer` calls it
with its tensors and its forward.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, field, fields
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.training.anchors import valid_anchor_mask
from dflash.training.objective import LossOutput

__all__ = ["EvalOutput", "WalkSums", "walked_tau_sums", "position_tau", "leading_tau", "eval_sums", "aggregate_eval"]


@dataclass(frozen=True)
class WalkSums:
    """Σ τ and the number of blocks of speculative decoding's walk over held-out responses.

    ``tau_sum / blocks`` is the walked τ over every token of each response; ``head_tau_sum /
    head_blocks`` the walk cut at the first ``train.eval_head_tokens`` tokens; ``first_tau_sum /
    first_blocks`` that cut walk over each conversation's first response alone, the one a held-out
    prompt of the decoding check asks for (:func:`dflash.inference.prompts.prompts_from_corpus`:
    every token before a conversation's first assistant token) (:func:`walked_tau_sums`). Plain
    Python numbers (the walk runs on the host).
    """

    tau_sum: float = 0.0
    blocks: int = 0
    head_tau_sum: float = 0.0
    head_blocks: int = 0
    first_tau_sum: float = 0.0
    first_blocks: int = 0


@dataclass
class EvalOutput(LossOutput):
    """A held-out batch's :class:`LossOutput` plus τ over its *head* blocks and, optionally, the walk.

    Head blocks are the kept blocks whose anchor lies within the first ``train.eval_head_tokens``
    tokens of its response (:func:`dflash.training.anchors.response_offsets`): the part of a
    response that speculative decoding of that many new tokens sees. On long responses the
    every-anchor τ (``tau``) is dominated by their tails; ``tau_head = head_tau_sum / head_blocks``.

    Both still average τ over anchors, which is length-biased: inside a stretch the drafter
    predicts well every anchor has a high τ and all of them count, while decoding crosses it with
    one block. The *walked* τ (:func:`walked_tau_sums`) visits the anchors decoding would visit and
    is training's prediction of decoding τ: ``tau_walk = walk_tau_sum / walk_blocks`` over whole
    responses, ``tau_walk_head`` over the first ``train.eval_head_tokens`` tokens of each. The walk
    fields are ``None`` when the evaluation did not walk (``train.eval_walk: false``).
    ``tau_walk_first`` is the cut walk over each conversation's first response alone: what the
    decoding check decodes from the held-out prompts (later turns have more context to draft from).
    """

    #: ``Σ τ`` over head blocks (fp32 scalar).
    head_tau_sum: Tensor
    #: Number of head blocks (fp32 scalar).
    head_blocks: Tensor
    #: ``Σ τ`` over the walked blocks of whole responses, and their number (fp32 scalars).
    walk_tau_sum: Optional[Tensor] = field(default=None, kw_only=True)
    walk_blocks: Optional[Tensor] = field(default=None, kw_only=True)
    #: The same for the walk cut at ``train.eval_head_tokens`` tokens of each response.
    walk_head_tau_sum: Optional[Tensor] = field(default=None, kw_only=True)
    walk_head_blocks: Optional[Tensor] = field(default=None, kw_only=True)
    #: The same for the cut walk over each conversation's first response.
    walk_first_tau_sum: Optional[Tensor] = field(default=None, kw_only=True)
    walk_first_blocks: Optional[Tensor] = field(default=None, kw_only=True)

    #: The walk fields, in :class:`WalkSums`' order (the stats vector's and :func:`eval_sums`' keys).
    WALK_SUMS = ("walk_tau_sum", "walk_blocks", "walk_head_tau_sum", "walk_head_blocks", "walk_first_tau_sum",
                 "walk_first_blocks")

    @property
    def tau_head(self) -> Tensor:
        return self.head_tau_sum / self.head_blocks.clamp_min(1.0)

    @property
    def walked(self) -> bool:
        """Whether the walk fields are set."""
        return self.walk_blocks is not None

    @property
    def tau_walk(self) -> Optional[Tensor]:
        return None if not self.walked else self.walk_tau_sum / self.walk_blocks.clamp_min(1.0)

    @property
    def tau_walk_head(self) -> Optional[Tensor]:
        return None if not self.walked else self.walk_head_tau_sum / self.walk_head_blocks.clamp_min(1.0)

    @property
    def tau_walk_first(self) -> Optional[Tensor]:
        return None if not self.walked else self.walk_first_tau_sum / self.walk_first_blocks.clamp_min(1.0)

    @classmethod
    def from_loss(cls, out: LossOutput, head: Tensor, walk: Optional[WalkSums] = None) -> "EvalOutput":
        """``out``'s sums (detached) plus the head sums over the blocks of ``head`` and ``walk``'s sums.

        Args:
            out: a batch's :class:`LossOutput` with ``block_tau`` (:func:`dflash_loss`'s).
            head: ``[R, A]`` bool, the head blocks (a subset of the kept blocks).
            walk: the batch's walked sums (:func:`walked_tau_sums`), or ``None`` (no walk).

        Raises:
            ValueError: ``out`` has no ``block_tau`` or ``head`` does not match its shape.
        """
        if out.block_tau is None:
            raise ValueError("out: has no block_tau (a LossOutput from dflash_loss is needed, not a stats vector's)")
        if head.shape != out.block_tau.shape:
            raise ValueError(f"head {tuple(head.shape)} does not match block_tau {tuple(out.block_tau.shape)}")
        sums = {f.name: getattr(out, f.name).detach() for f in fields(LossOutput)
                if f.name not in ("block_tau", "head_rows")}
        if walk is not None:
            dev = out.block_tau.device
            sums.update({name: torch.tensor(float(value), dtype=torch.float32, device=dev) for name, value in
                         zip(cls.WALK_SUMS, astuple(walk))})
        return cls(**sums, block_tau=out.block_tau, head_rows=out.head_rows,
                   head_tau_sum=(out.block_tau * head.float()).sum(), head_blocks=head.float().sum())

    def stats_vector(self) -> Tensor:
        """``[2B + 6]`` fp32: :meth:`LossOutput.stats_vector`, then head_tau_sum, head_blocks; with the
        walk ``[2B + 12]``: then walk_tau_sum, walk_blocks, walk_head_tau_sum, walk_head_blocks,
        walk_first_tau_sum, walk_first_blocks."""
        extra = [self.head_tau_sum, self.head_blocks]
        if self.walked:
            extra += [getattr(self, name) for name in self.WALK_SUMS]
        return torch.cat([super().stats_vector(), torch.stack(extra).float()])

    @classmethod
    def from_stats_vector(cls, vec: Tensor, walked: bool = False) -> "EvalOutput":
        """Read back :meth:`stats_vector` (``walked``: it holds the walk sums)."""
        walk = len(cls.WALK_SUMS) if walked else 0
        n = 2 + walk
        base = LossOutput.from_stats_vector(vec[:-n])
        sums = {f.name: getattr(base, f.name) for f in fields(LossOutput) if f.name != "block_tau"}
        if walked:
            sums.update(zip(cls.WALK_SUMS, vec[-walk:]))
        return cls(**sums, head_tau_sum=vec[-n], head_blocks=vec[-n + 1])


def eval_sums(out: EvalOutput) -> dict:
    """Host-side sums of one or more held-out batches' :class:`EvalOutput` (to add over batches and ranks);
    ``walk_tau_sum``, ``walk_blocks``, ``walk_head_tau_sum``, ``walk_head_blocks``,
    ``walk_first_tau_sum``, ``walk_first_blocks`` only when it walked."""
    sums = {"loss_sum": float(out.loss_sum), "weight_sum": float(out.weight_sum), "tau_sum": float(out.tau_sum),
            "blocks": float(out.num_blocks), "head_tau_sum": float(out.head_tau_sum),
            "head_blocks": float(out.head_blocks), "correct": out.block_pos_correct.tolist(),
            "count": out.block_pos_count.tolist()}
    if out.walked:
        sums.update({name: float(getattr(out, name)) for name in EvalOutput.WALK_SUMS})
    return sums


def aggregate_eval(sums: list[dict]) -> dict:
    """Combine per-drafter evaluation sums into held-out loss, τ and per-block-position accuracy.

    Args:
        sums: one dict per drafter with ``loss_sum``, ``weight_sum``, ``tau_sum``, ``blocks``,
            ``head_tau_sum``, ``head_blocks``, the lists ``correct`` / ``count`` indexed by block position
            and, from an evaluation that walked (``train.eval_walk``), ``walk_tau_sum``, ``walk_blocks``,
            ``walk_head_tau_sum``, ``walk_head_blocks`` (and ``walk_first_tau_sum``, ``walk_first_blocks``).
    Returns:
        ``eval/loss`` = Σ loss_sum / Σ weight_sum, ``eval/tau`` = Σ tau_sum / Σ blocks,
        ``eval/blocks``, ``eval/tau_head`` = Σ head_tau_sum / Σ head_blocks (the blocks whose anchor lies in
        the first ``train.eval_head_tokens`` tokens of its response; NaN without any), ``eval/head_blocks``,
        with the walk ``eval/tau_walk`` = Σ walk_tau_sum / Σ walk_blocks (decoding's anchors walked over
        every held-out response, pooled as decoding pools: training's prediction of decoding τ),
        ``eval/walk_blocks``, ``eval/tau_walk_head`` / ``eval/walk_head_blocks`` (the walk over the first
        ``train.eval_head_tokens`` tokens of each response; NaN without blocks), ``eval/tau_walk_first`` /
        ``eval/walk_first_blocks`` (that walk over each conversation's first response alone: the
        decoding check's held-out prompts; NaN without blocks), and
        ``eval/acc_block_pos_k`` = Σ correct[k] / Σ count[k] for block positions k ≥ 1; ``{}`` without sums.
    """
    if not sums:
        return {}
    total: dict[str, Any] = {}
    for s in sums:
        for key, value in s.items():
            if isinstance(value, list):
                prev = total.setdefault(key, [0.0] * len(value))
                total[key] = [a + b for a, b in zip(prev, value)]
            else:
                total[key] = total.get(key, 0.0) + value
    out = {
        "eval/loss": total["loss_sum"] / max(total["weight_sum"], 1e-12),
        "eval/tau": total["tau_sum"] / max(total["blocks"], 1),
        "eval/blocks": int(total["blocks"]),
    }
    if "head_blocks" in total:
        head = total["head_blocks"]
        out["eval/tau_head"] = total["head_tau_sum"] / head if head else float("nan")
        out["eval/head_blocks"] = int(head)
    if "walk_blocks" in total:
        for name, tau_key, blocks_key in (("walk", "walk_tau_sum", "walk_blocks"),
                                          ("walk_head", "walk_head_tau_sum", "walk_head_blocks"),
                                          ("walk_first", "walk_first_tau_sum", "walk_first_blocks")):
            if blocks_key not in total:
                continue
            n = total[blocks_key]
            out[f"eval/tau_{name}"] = total[tau_key] / n if n else float("nan")
            out[f"eval/{name}_blocks"] = int(n)
    for k, (c, n) in enumerate(zip(total.get("correct", []), total.get("count", []))):
        if k > 0:
            out[f"eval/acc_block_pos_{k}"] = c / n if n else float("nan")
    return out


def walked_tau_sums(position_tau: Tensor, loss_mask: Tensor, doc_ids: Tensor, head_tokens: int) -> WalkSums:
    """Walk speculative decoding's anchors over every response of a batch, each block accepting its τ.

    A response is a maximal run ``s … e`` of ``loss_mask`` inside one conversation
    (:func:`dflash.training.anchors.response_offsets`). Greedy DFlash decoding of it (the rule of
    :func:`dflash.inference.acceptance.walk_tau`, which
    :meth:`dflash.inference.decode_steps.DecodeSteps._verify_step_impl` implements): the first block
    is anchored at the response's first token ``s`` (the token the prefill emits); a block at
    anchor ``a`` accepts ``τ(a)`` tokens (``m`` drafts and the bonus), so the next anchor is
    ``a + τ(a)``; blocks run while ``a < e``. The head walk stops at ``min(e, s + head_tokens − 1)``
    (decoding ``head_tokens`` new tokens): its blocks are the first blocks of the whole walk. The
    first-response sums are the head walk's over each conversation's first response (the first
    response of each ``doc_ids`` value in a row). Pooled as decoding pools: ``Σ τ`` over walked
    blocks and their number, over all responses.

    ``τ(a)`` is scored on the response text only (block positions past ``e`` are invalid), so a
    whole response's last block counts ``min(m + 1, 1 + e − a)`` where decoding exactly
    ``e − s + 1`` new tokens would count ``m + 1``: lower by at most ``B − 2`` a response, in its
    last block only. A head walk that ends ``B − 1`` or more tokens before its response ends is
    scored on the continued text and so counts exactly what decoding counts.

    Args:
        position_tau: ``[R, S]`` τ at every position that is a valid anchor
            (:func:`dflash.training.anchors.valid_anchor_mask`: every position of a response but
            its last), any value elsewhere (any numeric dtype, integers ``≥ 1`` where read).
        loss_mask: ``[R, S]`` bool.
        doc_ids: ``[R, S]`` int.
        head_tokens: ``train.eval_head_tokens`` (``≥ 1``).

    Returns:
        :class:`WalkSums`.

    Raises:
        ValueError: mismatched shapes, ``head_tokens < 1``, or a τ below 1 on the walk.
    """
    if not (position_tau.shape == loss_mask.shape == doc_ids.shape) or loss_mask.dim() != 2:
        raise ValueError(f"position_tau {tuple(position_tau.shape)}, loss_mask {tuple(loss_mask.shape)} and "
                         f"doc_ids {tuple(doc_ids.shape)} must be the same [R, S]")
    if head_tokens < 1:
        raise ValueError(f"head_tokens: must be >= 1, got {head_tokens}")
    taus = position_tau.detach().round().long().cpu().tolist()
    masks = loss_mask.bool().cpu().tolist()
    docs = doc_ids.cpu().tolist()
    tau_sum = blocks = head_sum = head_blocks = first_sum = first_blocks = 0
    for tau, mask, doc in zip(taus, masks, docs):
        s = len(mask)
        p = 0
        seen: set = set()  # conversations of this row whose first response was walked
        while p < s:
            if not mask[p]:
                p += 1
                continue
            start = p  # a response: loss_mask run inside one conversation
            while p + 1 < s and mask[p + 1] and doc[p + 1] == doc[start]:
                p += 1
            end, head_end = p, min(p, start + head_tokens - 1)
            first = doc[start] not in seen
            seen.add(doc[start])
            a = start
            while a < end:
                t = tau[a]
                if t < 1:
                    raise ValueError(f"position_tau: τ at position {a} is {t}, must be >= 1")
                tau_sum += t
                blocks += 1
                if a < head_end:
                    head_sum += t
                    head_blocks += 1
                    if first:
                        first_sum += t
                        first_blocks += 1
                a += t
            p += 1
    return WalkSums(tau_sum=float(tau_sum), blocks=blocks, head_tau_sum=float(head_sum), head_blocks=head_blocks,
                    first_tau_sum=float(first_sum), first_blocks=first_blocks)


@torch.no_grad()
def position_tau(loss_mask: Tensor, doc_ids: Tensor, num_anchors: int,
                 block_tau: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """τ at every valid anchor of a batch: ``[R, S]`` fp32, 0 where no block can be anchored.

    Every position of :func:`dflash.training.anchors.valid_anchor_mask` is an anchor, taken in
    ascending order ``num_anchors`` at a time per row (the anchor count of the training step, so
    the forwards have its shapes and at most its memory, less without gradients); ``block_tau``
    scores each chunk and its per-block τ is scattered to the anchors' positions. A drafter block
    sees its context and its own block only (:mod:`dflash.models.masks`), so τ at an anchor does
    not depend on which anchors share its forward. Syncs with the host (the number of chunks).

    Args:
        loss_mask: ``[R, S]`` bool.
        doc_ids: ``[R, S]`` int (0 = padding).
        num_anchors: anchors per forward (``drafter.anchors_per_row``, ``≥ 1``).
        block_tau: ``(anchors [R, A] int64, keep [R, A] bool) → [R, A]`` fp32 τ of each kept block
            (the trainer's eager forward and :func:`leading_tau`); ``A = num_anchors``.

    Raises:
        ValueError: ``num_anchors < 1`` or mismatched shapes.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors: must be >= 1, got {num_anchors}")
    if loss_mask.shape != doc_ids.shape or loss_mask.dim() != 2:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} and doc_ids {tuple(doc_ids.shape)} must be the same [R, S]")
    valid = valid_anchor_mask(loss_mask.bool(), doc_ids)
    r, s = valid.shape
    a = num_anchors
    j = torch.arange(s, device=valid.device).expand(r, s)
    order = torch.argsort(torch.where(valid, j, j + s), dim=1)  # valid positions first, ascending
    keep_all = valid.gather(1, order)
    chunks = -(-int(valid.sum(dim=1).max()) // a) if s else 0
    width = chunks * a
    if width > s:
        order = torch.cat([order, order.new_zeros(r, width - s)], dim=1)
        keep_all = torch.cat([keep_all, keep_all.new_zeros(r, width - s)], dim=1)
    tau = torch.zeros(r, s, dtype=torch.float32, device=valid.device)
    for c in range(chunks):
        keep = keep_all[:, c * a:(c + 1) * a]
        anchors = torch.where(keep, order[:, c * a:(c + 1) * a], torch.zeros_like(keep, dtype=torch.long))
        chunk_tau = block_tau(anchors, keep)
        tau.scatter_add_(1, anchors, torch.where(keep, chunk_tau, torch.zeros_like(chunk_tau)))
    return tau


@torch.no_grad()
def leading_tau(hidden: Tensor, lm_head: nn.Module, labels: Tensor, valid: Tensor, anchor_keep: Tensor,
                chunk_rows: int) -> Tensor:
    """τ of every kept block, ``[R, A]`` fp32 (dropped blocks: 1), eagerly.

    :func:`dflash.training.objective.acceptance_lengths` of the argmax of ``lm_head(hidden)`` (as
    :func:`dflash.training.objective.dflash_loss` computes it: the head in its weight's dtype,
    argmax in fp32), but block position ``k`` goes through the LM head only for the blocks that
    accepted every position before it, ``chunk_rows`` rows at a time: the ``[·, V]`` logits cost
    about ``τ`` rows a block instead of ``B − 1``. Syncs with the host (the blocks alive at each
    block position).

    Args:
        hidden: ``[R, A, B, D]`` drafter hidden states.
        lm_head: the frozen LM head (``weight [V, D]``, optional ``bias``).
        labels: ``[R, A, B]`` int64 block labels; valid: ``[R, A, B]`` bool
            (:func:`dflash.training.objective.build_block_labels`).
        anchor_keep: ``[R, A]`` bool.
        chunk_rows: rows of logits per LM-head call.
    """
    r, a, b, d = hidden.shape
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    h = hidden.reshape(r * a, b, d)
    labels = labels.reshape(r * a, b)
    valid = valid.reshape(r * a, b)
    alive = anchor_keep.reshape(r * a).clone()
    tau = torch.ones(r * a, dtype=torch.float32, device=hidden.device)
    for k in range(1, b):
        rows = torch.nonzero(alive & valid[:, k]).flatten()
        alive.zero_()
        for idx in torch.split(rows, chunk_rows):
            pred = F.linear(h[idx, k].to(weight.dtype), weight, bias).float().argmax(dim=-1)
            hit = idx[pred == labels[idx, k]]
            tau[hit] += 1.0
            alive[hit] = True
        if not bool(alive.any()):
            break
    return tau.view(r, a)
