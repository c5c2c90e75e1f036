"""The frozen LM head's weighted cross-entropy over row chunks, its hidden-state gradient computed
in the forward pass.

The drafter's loss needs ``CE(h Wᵀ + b, y)`` for up to ``R·A·(B − 1)`` rows against a vocabulary of
``V`` (151,936 for Qwen3): the ``[rows, V]`` fp32 logits would take tens of GiB. Rows are taken
``chunk`` at a time (:data:`LOSS_CHUNK_ROWS`); each chunk yields its weighted CE sum, its argmax
and ``d/dh``, so the logits never exist at once and none are kept for backward
(:func:`chunked_linear_ce`). The per-chunk computation (:func:`linear_ce_chunk`) is pure tensor
code with static shapes, compiled once per process by :func:`compiled_linear_ce_chunk`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["LOSS_CHUNK_ROWS", "LOSS_CHUNK_ELEMENTS", "LOSS_CHUNK_ALIGN", "loss_chunk_rows", "linear_ce_chunk",
           "linear_kd_chunk", "compiled_linear_ce_chunk", "compiled_linear_kd_chunk", "chunked_linear_ce"]

#: Most rows of ``hidden @ lm_head.T`` computed at once.
LOSS_CHUNK_ROWS = 2048
#: Most fp32 logits of one chunk (2**28 = 1 GiB): fewer rows for large vocabularies
#: (1,024 at Qwen3.6's 248,320 tokens), so a chunk's logits, probabilities and their bf16 copy
#: stay a few GiB whatever the vocabulary (:func:`loss_chunk_rows`).
LOSS_CHUNK_ELEMENTS = 1 << 28
#: Chunks of more rows than this are a multiple of it: whole tiles of the two matmuls
#: (1,081 rows would leave a 57-row tail tile in each of them, every chunk).
LOSS_CHUNK_ALIGN = 256


def loss_chunk_rows(vocab_size: int) -> int:
    """Rows per LM-head loss chunk for a vocabulary of ``vocab_size``:
    ``min(LOSS_CHUNK_ROWS, LOSS_CHUNK_ELEMENTS // vocab_size)``, rounded down to a multiple of
    :data:`LOSS_CHUNK_ALIGN` when larger than it, at least 1.

    Raises:
        ValueError: ``vocab_size < 1``.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size: must be >= 1, got {vocab_size}")
    rows = max(1, min(LOSS_CHUNK_ROWS, LOSS_CHUNK_ELEMENTS // vocab_size))
    return rows - rows % LOSS_CHUNK_ALIGN if rows > LOSS_CHUNK_ALIGN else rows


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


def linear_kd_chunk(h: Tensor, weight: Tensor, bias: Optional[Tensor], y: Tensor, w: Tensor, need_grad: bool,
                    target_h: Tensor, distillation: float) -> tuple[Tensor, Tensor, Optional[Tensor], Tensor]:
    """Weighted mix of cross entropy and forward KL to the target's distribution, one chunk of rows.

    Knowledge distillation with the target as teacher (forward KL, as DistillSpec, arXiv
    2310.08461, §3; Hinton et al., arXiv 1503.02531): besides the label ``y``, each row learns
    the target's whole next-token distribution ``p = softmax(target_h Wᵀ + b)``, computed here
    through the same frozen head from the target's final-normed hidden state. With
    ``z = h Wᵀ + b``, ``q = softmax(z)`` and λ = ``distillation``, the row's loss is
    ``ℓ = (1 − λ)·CE(z, y) + λ·KL(p ‖ q)``, ``KL = Σ_v p_v (log p_v − log q_v)``, and
    ``d ℓ / d z = q − (1 − λ)·onehot(y) − λ·p``. Logits, log-sum-exps and probabilities in fp32;
    three ``[c, V]`` fp32 arrays live at once (the CE chunk's two and ``p``), the gradient built in
    the logits' memory.

    Args:
        h: ``[c, D]`` drafter hidden states; weight: ``[V, D]``; bias: ``[V]`` or ``None``.
        y: ``[c]`` int64 labels; w: ``[c]`` fp32 row weights.
        need_grad: also return the ``[c, D]`` gradient (in ``h``'s dtype).
        target_h: ``[c, D]`` the target's final-normed hidden state at the position *before* each
            row's label (the one whose logits predict it).
        distillation: λ in ``[0, 1]``.

    Returns:
        ``(Σ w·ℓ fp32 scalar, argmax [c] int64, gradient [c, D] or None, ℓ [c] fp32 unweighted)``.
    """
    logits = F.linear(h.to(weight.dtype), weight, bias).float()  # [c, V]
    lse = torch.logsumexp(logits, dim=-1)
    pred = logits.argmax(dim=-1)
    ce = lse - logits.gather(1, y.unsqueeze(1)).squeeze(1)
    logp = F.linear(target_h.to(weight.dtype), weight, bias).float()
    logp = logp.sub_(torch.logsumexp(logp, dim=-1, keepdim=True))  # log p, in place
    p = torch.exp(logp)
    # KL = Σ p log p − Σ p z + lse (Σ p = 1); row dot products as batched matmuls: no [c, V] product
    kl = _row_dot(p, logp) - _row_dot(p, logits) + lse
    del logp
    loss = (1.0 - distillation) * ce + distillation * kl
    total = (loss * w).sum()
    if not need_grad:
        return total, pred, None, loss
    dz = logits.sub_(lse.unsqueeze(1)).exp_().sub_(p, alpha=distillation)  # q − λ p, in the logits' memory
    dz.scatter_add_(1, y.unsqueeze(1), torch.full_like(w, distillation - 1.0).unsqueeze(1))
    grad = (dz.mul_(w.unsqueeze(1)).to(weight.dtype) @ weight).to(h.dtype)
    return total, pred, grad, loss


def _row_dot(a: Tensor, b: Tensor) -> Tensor:
    """``Σ_v a[n, v] · b[n, v]`` of every row ``n``: ``[c, V] × [c, V] → [c]``."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


_compiled_ce_chunk: Optional[Callable[..., Any]] = None
_compiled_kd_chunk: Optional[Callable[..., Any]] = None


def compiled_linear_ce_chunk() -> Callable[..., Any]:
    """:func:`linear_ce_chunk` under ``torch.compile(dynamic=False)`` (inductor, no CUDA graphs).

    One compiled function per process, shared by every caller; it compiles once per chunk shape
    and ``need_grad`` value (the trainer's step uses one: :func:`dflash.training.objective.dflash_loss`
    pads its rows to whole chunks when they fill more than one).
    Measured on the H200 against the eager chunk loop (docs/benchmarks.md, Drafter train step).
    """
    global _compiled_ce_chunk
    if _compiled_ce_chunk is None:
        _compiled_ce_chunk = torch.compile(linear_ce_chunk, dynamic=False)
    return _compiled_ce_chunk


def compiled_linear_kd_chunk() -> Callable[..., Any]:
    """:func:`linear_kd_chunk` under ``torch.compile(dynamic=False)``, one per process, as
    :func:`compiled_linear_ce_chunk`."""
    global _compiled_kd_chunk
    if _compiled_kd_chunk is None:
        _compiled_kd_chunk = torch.compile(linear_kd_chunk, dynamic=False)
    return _compiled_kd_chunk


class _ChunkedLinearCE(torch.autograd.Function):
    """``Σ_n w_n · CE(h_n W^T + b, y_n)`` and ``argmax`` over row chunks, gradient computed in forward.

    For one row, ``d CE / d h = (softmax(z) − onehot(y)) W`` (z = logits). The forward pass keeps
    only that ``[N, D]`` gradient (scaled by ``w``); backward multiplies it by the incoming scalar
    gradient. The frozen head (``W``, ``b``) gets no gradient. Each chunk runs
    ``chunk_fn`` (:func:`linear_ce_chunk` or its compiled form; with ``target_hidden``,
    :func:`linear_kd_chunk` or its compiled form, which also get the chunk's teacher rows and λ).

    With ``reweight`` (weights that depend on the CE itself, e.g. D-PACE), the chunks run with
    ``row_weights`` as a 0/1 mask; then ``w = reweight(CE [N])`` (detached) scales the per-row CE
    and the kept per-row gradients, so the logits are still computed once.
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                row_weights: Tensor, chunk: int, need_grad: bool, chunk_fn: Callable[..., Any],
                reweight: Optional[Callable[[Tensor], Tensor]] = None, target_hidden: Optional[Tensor] = None,
                distillation: float = 0.0) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        preds = []
        grads = []
        ces = []
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            for start in range(0, n, chunk):
                end = min(start + chunk, n)
                teacher = () if target_hidden is None else (target_hidden[start:end], distillation)
                part, pred, grad, ce = chunk_fn(hidden[start:end], weight, bias, labels[start:end],
                                                row_weights[start:end], need_grad, *teacher)
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
        return grad_hidden, None, None, None, None, None, None, None, None, None, None


def chunked_linear_ce(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, row_weights: Tensor,
                      chunk: int, need_grad: bool, chunk_fn: Callable[..., Any] = linear_ce_chunk,
                      reweight: Optional[Callable[[Tensor], Tensor]] = None, target_hidden: Optional[Tensor] = None,
                      distillation: float = 0.0) -> tuple[Tensor, Tensor]:
    """``Σ_n w_n · CE(h_n Wᵀ + b, y_n)`` and ``argmax`` of every row, over chunks of ``chunk`` rows;
    with ``target_hidden``, ``Σ_n w_n · ((1 − λ)·CE + λ·KL(p_n ‖ q_n))`` (:func:`linear_kd_chunk`).

    Args:
        hidden: ``[N, D]`` hidden states (any float dtype); the only input that gets a gradient.
        weight: ``[V, D]`` the frozen head; bias: ``[V]`` or ``None``.
        labels: ``[N]`` int64; row_weights: ``[N]`` fp32 (a 0/1 mask when ``reweight`` is given).
        chunk: rows per chunk (:data:`LOSS_CHUNK_ROWS`).
        need_grad: compute and keep ``d/dhidden`` (``[N, D]``, ``hidden``'s dtype) for backward.
        chunk_fn: :func:`linear_ce_chunk` or :func:`compiled_linear_ce_chunk`'s result.
        reweight: ``CE [N] fp32 -> w [N]``: weights that depend on the CE itself (D-PACE), applied
            after every chunk has run, detached.
        target_hidden: ``[N, D]`` the target's final-normed hidden state that predicts each row's
            label (the teacher's rows), or ``None`` (cross entropy alone); ``chunk_fn`` must then be
            :func:`linear_kd_chunk` or its compiled form.
        distillation: λ in ``[0, 1]``, the forward KL's share (with ``target_hidden`` only).

    Returns:
        ``(Σ w·CE fp32 scalar with a gradient to hidden, argmax [N] int64)``.
    """
    return _ChunkedLinearCE.apply(hidden, weight, bias, labels, row_weights, chunk, need_grad, chunk_fn, reweight,
                                  target_hidden, distillation)
