"""AdamW and the learning-rate schedule of the DFlash recipe (docs/DFLASH.md, Recipe).

AdamW at ``train.lr`` (6e-4) over the drafter's *trainable* parameters only (the target's shared
embedding and LM head are not drafter parameters at all). Weight decay applies to matrices;
norm weights and the mask embedding (1-D) are exempt, the usual transformer practice.

Schedule, per optimizer step ``s = 0, 1, …, total − 1`` (the factor multiplies ``lr``):

* warm-up, ``s < n_w`` with ``n_w = ceil(warmup_ratio · total)``: ``(s + 1) / n_w``;
* then cosine: ``m + (1 − m) · ½ (1 + cos(π · (s − n_w) / max(1, total − n_w)))``,
  ``m = min_lr_ratio``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

__all__ = ["build_optimizer", "build_scheduler", "warmup_steps", "lr_factor"]


def build_optimizer(model: nn.Module, train_cfg: Any) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters with ``requires_grad`` (fused on CUDA).

    Args:
        model: the drafter (or a DDP wrapper around it).
        train_cfg: :class:`dflash.config.TrainConfig` (``lr``, ``adam_beta1``, ``adam_beta2``,
            ``weight_decay``).

    Raises:
        ValueError: the model has no trainable parameter.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    if not decay and not no_decay:
        raise ValueError("build_optimizer: the model has no trainable parameter")
    groups = [{"params": decay, "weight_decay": train_cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    on_cuda = all(p.is_cuda for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=train_cfg.lr, betas=(train_cfg.adam_beta1, train_cfg.adam_beta2),
                             eps=1e-8, fused=True if on_cuda else None)


def warmup_steps(total_steps: int, train_cfg: Any) -> int:
    """``ceil(warmup_ratio · total_steps)`` (0 when the ratio is 0)."""
    return int(math.ceil(train_cfg.warmup_ratio * total_steps))


def lr_factor(step: int, total_steps: int, warmup: int, min_lr_ratio: float) -> float:
    """The multiplier of ``lr`` at optimizer step ``step`` (0-based); see the module docstring."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int,
                    train_cfg: Any) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up then cosine decay to ``min_lr_ratio · lr`` over ``total_steps``.

    Call ``scheduler.step()`` once after every ``optimizer.step()``; before any call the
    optimizer runs at ``lr_factor(0)``.

    Raises:
        ValueError: ``total_steps < 1``.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps: must be >= 1, got {total_steps}")
    warm = warmup_steps(total_steps, train_cfg)
    ratio = float(train_cfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, warm, ratio))
