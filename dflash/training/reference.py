"""The single-process reference trainer: target forward, then drafter step, in one process.

No transport, no coordinator: the simplest place to debug the DFlash math, and the oracle the
multi-process pipeline is tested against. It trains exactly what the pipeline trains: the same
:class:`~dflash.data.schedule.StepPlan`, and with ``num_replicas = D`` it concatenates the D batches
a step gives the D drafter ranks (each with its own anchors, seeded by its batch id) into one
batch — which is what D data-parallel drafters with an all-reduced loss denominator compute.

``python -m dflash.training.reference --config configs/smollm2-135m-cpu.yaml [key=value ...]`` runs it.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from dflash.config import RunConfig, load_config
from dflash.training.factory import TARGET_OUTPUTS, DataPlans, build_batch_plans, build_drafter, target_forward
from dflash.training.evaluation import aggregate_eval, eval_sums
from dflash.data.schedule import StepPlan
from dflash.training.trainer import DrafterTrainer, metrics_to_host

__all__ = ["ReferenceResult", "run_reference", "target_tensors", "evaluate_heldout"]

log = logging.getLogger(__name__)


@dataclass
class ReferenceResult:
    losses: list[float] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    model: Any = None
    trainer: Any = None


def target_tensors(target: Any, batch: Any, device: torch.device, final_hidden: bool = False) -> dict[str, torch.Tensor]:
    """A batch's tensors plus the target's ``features [R, S, L·D]`` and ``target_tokens [R, S]``
    (and, with ``final_hidden``, ``target_hidden [R, S, D]``: a drafter trained by distillation),
    as a target worker fills a slot (:data:`dflash.training.factory.TARGET_OUTPUTS`)."""
    t = {k: v.to(device) for k, v in batch.to_dict().items()}
    t.update(zip(TARGET_OUTPUTS, target_forward(target, final_hidden)(t["input_ids"], t["position_ids"], t["doc_ids"])))
    return t


def evaluate_heldout(trainer: DrafterTrainer, target: Any, plans: DataPlans, num_batches: Optional[int],
                     device: torch.device) -> dict:
    """Held-out loss, τ (every anchor, the head's and, with ``train.eval_walk``, walked) and accuracy per block position over the first
    ``num_batches`` held-out batches (:func:`dflash.training.evaluation.aggregate_eval`)."""
    if plans.heldout is None:
        return {}
    n = plans.heldout.num_batches(0)
    n = n if num_batches is None else min(n, num_batches)
    sums = [eval_sums(trainer.evaluate(target_tensors(target, plans.heldout.batch(0, b), device,
                                                      bool(trainer.distillation)), b))
            for b in range(n)]
    return aggregate_eval(sums)


def run_reference(cfg: RunConfig, device: str | torch.device = "cpu", num_replicas: Optional[int] = None,
                  steps: Optional[int] = None, evaluate: bool = True, plans: Optional[DataPlans] = None,
                  target: Any = None, assignments: Optional[Sequence[tuple[int, Sequence[Optional[int]]]]] = None,
                  schedule: Any = None) -> ReferenceResult:
    """Train for ``steps`` (default: the whole plan) optimizer steps in this process.

    Args:
        num_replicas: batches per step (default: ``len(cluster.drafters)``, the pipeline's D).
        evaluate: held-out evaluation before and after (``train.eval_batches`` batches).
        assignments: ``(epoch, batch ids)`` of every step, instead of the plan's (e.g. a run
            resumed with another number of drafters: its ledger).
        schedule: the learning rate of every step (``factor(step)``, ``lr``:
            :class:`dflash.training.optim.LRSchedule` or alike); ``None`` = the recipe's curve.
    Returns:
        per-step losses and metrics, evaluations, wall time, the trained model and trainer.
    """
    from dflash.models.target_loader import load_target

    device = torch.device(device)
    d = num_replicas or len(cfg.cluster.drafters)
    plans = plans or build_batch_plans(cfg)
    target = target or load_target(cfg.target, device, num_drafter_layers=cfg.drafter.num_layers)
    plan = StepPlan([plans.train.num_batches(e) for e in range(cfg.train.epochs)], d, cfg.train.max_steps)
    if assignments is None:
        assignments = [(a.epoch, a.batch_ids) for a in map(plan.assignment, range(plan.total_steps))]
    total = len(assignments) if steps is None else min(steps, len(assignments))
    model = build_drafter(cfg, target.embed_tokens, target.lm_head, plans.tokenizer_size, device, target.config)
    trainer = DrafterTrainer(model, cfg.train, cfg.drafter, max(1, len(assignments)), device, schedule=schedule)
    result = ReferenceResult(model=model, trainer=trainer)
    if evaluate:
        result.evals.append({"step": 0, **evaluate_heldout(trainer, target, plans, cfg.train.eval_batches, device)})
        log.info("step 0 held-out: %s", result.evals[-1])
    started = time.perf_counter()
    for step in range(total):
        epoch, batch_ids = assignments[step]
        parts, anchors, keeps = [], [], []
        for batch_id in batch_ids:
            if batch_id is None:
                continue
            t = target_tensors(target, plans.train.batch(epoch, batch_id), device, bool(trainer.distillation))
            anc, keep = trainer.draw_anchors(t["loss_mask"], t["doc_ids"], epoch, batch_id)
            parts.append(t)
            anchors.append(anc)
            keeps.append(keep)
        tensors = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        m = metrics_to_host(trainer.step(tensors, epoch, batch_ids[0],
                                         anchors=(torch.cat(anchors), torch.cat(keeps))))
        result.losses.append(m["loss"])
        result.metrics.append(m)
        if (step + 1) % max(1, cfg.log.every * 10) == 0 or step + 1 == total:
            log.info("step %d/%d loss %.4f tau %.3f lr %.2e grad_norm %.3f", step + 1, total, m["loss"], m["tau"],
                     m["lr"], m["grad_norm"])
    result.seconds = time.perf_counter() - started
    if evaluate:
        result.evals.append({"step": total, **evaluate_heldout(trainer, target, plans, cfg.train.eval_batches,
                                                                device)})
        log.info("step %d held-out: %s", total, result.evals[-1])
    return result


def main(argv: Optional[list[str]] = None) -> int:
    from dflash.logs import setup_logging

    p = argparse.ArgumentParser(prog="python -m dflash.training.reference", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    setup_logging("reference")
    cfg = load_config(args.config, args.overrides)
    device = "cuda" if cfg.cluster.device != "cpu" and torch.cuda.is_available() else "cpu"
    res = run_reference(cfg, device, steps=args.steps)
    first, last = res.evals[0], res.evals[-1]
    nan = float("nan")
    log.info("%d steps in %.1f min: train loss %.3f -> %.3f; held-out loss %.3f -> %.3f, tau %.3f -> %.3f "
             "(first %d response tokens %.3f -> %.3f); walked as decoding: tau %.3f -> %.3f (first %d response "
             "tokens %.3f -> %.3f)", len(res.losses), res.seconds / 60, res.losses[0],
             res.losses[-1], first.get("eval/loss", nan), last.get("eval/loss", nan),
             first.get("eval/tau", nan), last.get("eval/tau", nan), cfg.train.eval_head_tokens,
             first.get("eval/tau_head", nan), last.get("eval/tau_head", nan),
             first.get("eval/tau_walk", nan), last.get("eval/tau_walk", nan), cfg.train.eval_head_tokens,
             first.get("eval/tau_walk_head", nan), last.get("eval/tau_walk_head", nan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
