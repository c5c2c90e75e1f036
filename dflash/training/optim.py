"""AdamW and the learning-rate schedule of the DFlash recipe (docs/DFLASH.md, Recipe).

AdamW at ``train.lr`` (6e-4) over the drafter's *trainable* parameters only (the target's shared
embedding and LM head are not drafter parameters at all). Weight decay applies to matrices;
norm weights and the mask embedding (1-D) are exempt, the usual transformer practice.

Schedule, per optimizer step ``s = 0, 1, …, total − 1`` (the factor multiplies ``lr``):

* warm-up, ``s < n_w`` with ``n_w = ceil(warmup_ratio · total)``: ``(s + 1) / n_w``;
* then cosine: ``m + (1 − m) · ½ (1 + cos(π · (s − n_w) / max(1, total − n_w)))``,
  ``m = min_lr_ratio``.

**Resumed with another number of drafters.** The plan then needs another number of steps to
finish the data (:class:`dflash.data.schedule.StepPlan`), so the curve cannot stay a function of the
step alone without a jump. :class:`LRSchedule` evaluates the curve at a *schedule position*
``x(s) = x₀ + (s − s₀) · k``, the identity for a run that kept its plan; :meth:`LRSchedule.spread`
re-anchors it at the resume step ``s₀`` (``x₀`` = the old position there) and spreads the rest of
the curve over the steps now left (``k = (total − x₀) / (end − s₀)``). The rate at the resume
step is exactly the one the uninterrupted run would have used, and the curve still ends where
it ended. A changed ``train.max_steps`` / ``epochs`` / ``lr`` / ``warmup_ratio`` /
``min_lr_ratio`` rebuilds the curve for the new settings instead (:meth:`LRSchedule.nominal`),
as if the run had been started with them; the launcher says so.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["build_optimizer", "build_scheduler", "warmup_steps", "lr_factor", "LRSchedule"]


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


def lr_factor(step: float, total_steps: int, warmup: int, min_lr_ratio: float) -> float:
    """The multiplier of ``lr`` at optimizer step ``step`` (0-based; a fractional schedule
    position between steps is allowed); see the module docstring."""
    if warmup > 0 and step < warmup:
        return min(1.0, (step + 1) / warmup)
    progress = min(1.0, max(0.0, (step - warmup) / max(1, total_steps - warmup)))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate of every optimizer step: ``lr · lr_factor(x(s), total_steps, warmup_steps,
    min_lr_ratio)`` with the schedule position ``x(s) = origin_x + (s − origin_step) · scale``.

    A fresh run has ``x(s) = s`` over ``end_step = total_steps`` steps; see the module docstring
    for :meth:`spread` (a resume with another number of drafters). Checkpoints store it
    (:meth:`to_dict`) so that a resume can tell what changed.

    Attributes:
        lr: peak learning rate (``train.lr``).
        total_steps, warmup_steps, min_lr_ratio: the curve (steps of the run it was built for).
        origin_step, origin_x, scale: the step → schedule position map.
        end_step: the step at which the run ends (its curve reaches ``x = total_steps`` there).
    """

    lr: float
    total_steps: int
    warmup_steps: int
    min_lr_ratio: float
    origin_step: int = 0
    origin_x: float = 0.0
    scale: float = 1.0
    end_step: Optional[int] = None

    @classmethod
    def nominal(cls, total_steps: int, train_cfg: Any) -> "LRSchedule":
        """The recipe's curve over ``total_steps`` steps (``train.lr``, ``warmup_ratio``, ``min_lr_ratio``).

        Raises:
            ValueError: ``total_steps < 1``.
        """
        if total_steps < 1:
            raise ValueError(f"total_steps: must be >= 1, got {total_steps}")
        return cls(lr=float(train_cfg.lr), total_steps=total_steps, warmup_steps=warmup_steps(total_steps, train_cfg),
                   min_lr_ratio=float(train_cfg.min_lr_ratio), end_step=total_steps)

    def position(self, step: int) -> float:
        """The schedule position ``x(step)``."""
        return self.origin_x + (step - self.origin_step) * self.scale

    def factor(self, step: int) -> float:
        """The multiplier of ``lr`` at optimizer step ``step``."""
        return lr_factor(self.position(step), self.total_steps, self.warmup_steps, self.min_lr_ratio)

    def rate(self, step: int) -> float:
        """The learning rate at optimizer step ``step``."""
        return self.lr * self.factor(step)

    def spread(self, at_step: int, end_step: int) -> "LRSchedule":
        """This curve continued from ``at_step`` (the same rate there) and spread over the steps up
        to ``end_step`` (the curve's end lands on ``end_step``). Unchanged when the end does not move.

        Raises:
            ValueError: ``end_step < at_step``.
        """
        if end_step < at_step:
            raise ValueError(f"end_step {end_step} is before at_step {at_step}")
        end = self.end_step if self.end_step is not None else self.total_steps
        if end_step == end:
            return self
        x0 = self.position(at_step)
        if end_step == at_step or x0 >= self.total_steps:  # nothing left to spread, or the curve is over
            return LRSchedule(self.lr, self.total_steps, self.warmup_steps, self.min_lr_ratio, at_step, x0,
                              self.scale, end_step)
        return LRSchedule(self.lr, self.total_steps, self.warmup_steps, self.min_lr_ratio, at_step, x0,
                          (self.total_steps - x0) / (end_step - at_step), end_step)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "LRSchedule":
        """From :meth:`to_dict`.

        Raises:
            ValueError: a missing or mistyped field.
        """
        try:
            return cls(lr=float(data["lr"]), total_steps=int(data["total_steps"]),
                       warmup_steps=int(data["warmup_steps"]), min_lr_ratio=float(data["min_lr_ratio"]),
                       origin_step=int(data.get("origin_step", 0)), origin_x=float(data.get("origin_x", 0.0)),
                       scale=float(data.get("scale", 1.0)),
                       end_step=None if data.get("end_step") is None else int(data["end_step"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not an LR schedule record ({type(exc).__name__}: {exc}): {data!r}") from None

    def describe(self, step: Optional[int] = None) -> str:
        """``lr 6e-04, 300 steps, warm-up 12, min ratio 0`` (and ``, lr at step N 1.5e-04``)."""
        text = (f"lr {self.lr:.3g}, {self.end_step if self.end_step is not None else self.total_steps} steps, "
                f"warm-up {self.warmup_steps}, min ratio {self.min_lr_ratio:g}")
        if self.scale != 1.0 or self.origin_x != self.origin_step:
            text += (f" (the curve of {self.total_steps} steps, from step {self.origin_step} spread "
                     f"×{self.scale:.4g})")
        if step is not None:
            text += f", lr at step {step} {self.rate(step):.3g}"
        return text


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int,
                    train_cfg: Any, schedule: Optional[LRSchedule] = None) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up then cosine decay to ``min_lr_ratio · lr`` over ``total_steps``
    (or ``schedule``'s factors, :class:`LRSchedule`).

    Call ``scheduler.step()`` once after every ``optimizer.step()``; before any call the
    optimizer runs at ``lr_factor(0)``.

    Raises:
        ValueError: ``total_steps < 1``.
    """
    if schedule is None:
        schedule = LRSchedule.nominal(total_steps, train_cfg)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule.factor(step))
