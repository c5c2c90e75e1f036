"""Step plan, work sequence and ledger: exactly-once over epochs, against a naive enumeration."""

import random

import pytest

from dflash.schedule import StepPlan
from dflash.workers.coordinator import Ledger, aggregate_eval, build_work_items


def naive_steps(batches_per_epoch, d):
    """Obvious reference: walk every epoch's ids in order, D at a time."""
    out = []
    for epoch, n in enumerate(batches_per_epoch):
        ids = list(range(n))
        for k in range(0, n, d):
            chunk = ids[k:k + d]
            out.append((epoch, tuple(chunk + [None] * (d - len(chunk)))))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_plan_matches_naive_enumeration(seed):
    rng = random.Random(seed)
    bpe = [rng.randint(1, 23) for _ in range(rng.randint(1, 4))]
    d = rng.randint(1, 5)
    plan = StepPlan(bpe, d)
    ref = naive_steps(bpe, d)
    assert plan.total_steps == len(ref)
    for step, (epoch, ids) in enumerate(ref):
        a = plan.assignment(step)
        assert (a.epoch, a.batch_ids) == (epoch, ids)


def test_max_steps_and_bounds():
    plan = StepPlan([10, 10], 3, max_steps=5)
    assert plan.total_steps == 5
    with pytest.raises(IndexError):
        plan.assignment(5)
    with pytest.raises(ValueError):
        StepPlan([0], 1)
    with pytest.raises(ValueError):
        StepPlan([3], 0)


def test_work_items_cover_every_batch_once_with_evals_and_checkpoints():
    plan = StepPlan([7, 6], 2)
    items = build_work_items(plan, 0, heldout_batches=5, eval_every=3, checkpoint_every=4)
    train = [it for it in items if it.kind == "train"]
    evals = [it for it in items if it.kind == "eval"]
    assert [it.index for it in train] == list(range(plan.total_steps))
    seen = [(it.epoch, b) for it in train for b in it.batches if b is not None]
    assert sorted(seen) == sorted({(0, b) for b in range(7)} | {(1, b) for b in range(6)})
    assert len(seen) == len(set(seen))
    assert [it.at_step for it in evals] == [0, 3, 6, 7]  # start, every 3, end (7 steps)
    assert evals[0].batches == [[0, 2, 4], [1, 3]]
    assert [it.index for it in train if it.checkpoint] == [3, 6]  # steps 4 and 7 done


def test_resume_work_items_start_at_step():
    plan = StepPlan([8], 1)
    items = build_work_items(plan, 5, heldout_batches=0, eval_every=0, checkpoint_every=0)
    assert [it.index for it in items] == [5, 6, 7]
    assert items[-1].checkpoint


def test_ledger_detects_missing_and_double():
    plan = StepPlan([4], 2)
    ledger = Ledger()
    for b in (0, 1, 2):
        ledger.mark_trained(0, b)
    assert ledger.check(plan, 0, 2) == ["epoch 0 batch 3 never trained"]
    ledger.mark_trained(0, 3)
    ledger.mark_trained(0, 3)
    assert ledger.check(plan, 0, 2) == ["epoch 0 batch 3 trained 2 times"]


def test_aggregate_eval_sums_ranks():
    sums = [{"loss_sum": 2.0, "weight_sum": 4.0, "tau_sum": 6.0, "blocks": 4, "correct": [0, 3, 1], "count": [0, 4, 4]},
            {"loss_sum": 1.0, "weight_sum": 2.0, "tau_sum": 3.0, "blocks": 2, "correct": [0, 1, 1], "count": [0, 2, 2]}]
    ev = aggregate_eval(sums)
    assert ev["eval/loss"] == pytest.approx(0.5)
    assert ev["eval/tau"] == pytest.approx(1.5)
    assert ev["eval/blocks"] == 6
    assert ev["eval/acc_slot_1"] == pytest.approx(4 / 6)
    assert ev["eval/acc_slot_2"] == pytest.approx(2 / 6)
