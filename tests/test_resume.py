"""Resume by data position, the LR schedule across resumes, the ledger and metrics files, and the
checks that a checkpoint fits what it is used with: against naive references, no processes."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest

from dflash.training.checkpoint_identity import CheckpointMismatch, check_fits, run_identity
from dflash.config import load_config
from dflash.metrics import metrics_view, rollback_record
from dflash.training.optim import LRSchedule
from dflash.training.ledger_file import LedgerFile, ledger_problems, ledger_view
from dflash.training.resume import LaunchPlan, checkpoint_position, plan_launch
from dflash.data.schedule import DataPosition, StepPlan

TINY = ["target.kind=random", "target.arch=tiny-qwen3", "target.tokenizer=qwen3", "cluster.device=cpu",
        "train.max_steps=null", "train.epochs=2", "train.warmup_ratio=0.2"]


def cfg_with(*overrides):
    return load_config(None, [*TINY, *overrides], gpu_count=0)


def naive_batches(bpe):
    return [(e, b) for e, n in enumerate(bpe) for b in range(n)]


# --------------------------------------------------------------------------- plans resumed with another D
@pytest.mark.parametrize("seed", range(8))
def test_resumes_with_other_drafter_counts_train_every_batch_once_in_order(seed):
    rng = random.Random(seed)
    bpe = [rng.randint(1, 13) for _ in range(rng.randint(1, 3))]
    plan = StepPlan(bpe, rng.randint(1, 4))
    trained, step = [], 0
    while step < plan.total_steps:  # several launches, each stopping at a random step
        stop = rng.randint(step + 1, plan.total_steps)
        for s in range(step, stop):
            a = plan.assignment(s)
            trained += [(a.epoch, b) for b in a.batch_ids if b is not None]
        position = plan.position_after(stop - 1)
        plan = plan.resumed(stop, position, rng.randint(1, 4))
        step = stop
    assert trained == naive_batches(bpe)


def test_position_after_and_at():
    plan = StepPlan([5, 4], 2)
    assert [plan.position_after(s).to_list() for s in range(5)] == [[0, 2], [0, 4], [1, 0], [1, 2], [2, 0]]
    assert plan.position_at(0) == DataPosition() and plan.position_at(3) == DataPosition(1, 0)
    assert plan.position_at(4) == DataPosition(1, 2)
    resumed = plan.resumed(2, DataPosition(0, 4), 3)
    assert resumed.total_steps == 5 and resumed.assignment(2).batch_ids == (4, None, None)
    assert [resumed.assignment(s).batch_ids for s in (3, 4)] == [(0, 1, 2), (3, None, None)]
    with pytest.raises(IndexError):
        resumed.assignment(1)
    with pytest.raises(ValueError, match="past the plan"):
        StepPlan([5], 1, start_step=3, start=DataPosition(1, 2))


# --------------------------------------------------------------------------- LR schedule
def naive_rate(step, total, cfg):
    """The recipe's curve written out: linear warm-up, then cosine to min_lr_ratio."""
    warm = math.ceil(cfg.warmup_ratio * total)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = min(1.0, (step - warm) / max(1, total - warm))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def test_nominal_schedule_is_the_recipe():
    train = cfg_with("train.min_lr_ratio=0.1").train
    sched = LRSchedule.nominal(37, train)
    assert [sched.rate(s) for s in range(37)] == pytest.approx([naive_rate(s, 37, train) for s in range(37)], rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_spread_keeps_the_rate_at_the_resume_step_and_ends_the_curve(seed):
    rng = random.Random(seed)
    train = cfg_with().train
    total = rng.randint(10, 60)
    sched = LRSchedule.nominal(total, train)
    s0 = rng.randint(1, total - 1)
    new_end = rng.randint(s0 + 1, 3 * total)
    spread = sched.spread(s0, new_end)
    assert spread.rate(s0) == sched.rate(s0)  # continuous: the very rate the uninterrupted run had
    assert spread.position(new_end) == pytest.approx(total)  # the curve ends where the run ends
    # a second resume with yet another D
    s1 = rng.randint(s0, new_end)
    again = spread.spread(s1, s1 + rng.randint(1, 20))
    assert again.rate(s1) == pytest.approx(spread.rate(s1), rel=1e-12)
    assert LRSchedule.from_dict(json.loads(json.dumps(again.to_dict()))) == again
    assert sched.spread(s0, total) is sched  # the end did not move: unchanged


def _state(step, position, drafters, schedule):
    return {"step": step, "data_position": position, "num_drafters": drafters, "schedule": schedule.to_dict()}


def test_plan_launch_spreads_the_schedule_for_another_drafter_count():
    cfg2, cfg1 = cfg_with("cluster.drafters=[0, 1]"), cfg_with("cluster.drafters=[0]")
    bpe = [6, 6]
    plan, launch, notes = plan_launch(cfg2, bpe)
    assert (plan.total_steps, notes) == (6, [])
    assert launch.schedule == LRSchedule.nominal(6, cfg2.train)
    state = _state(2, plan.position_after(1).to_list(), 2, launch.schedule)
    plan1, launch1, notes1 = plan_launch(cfg1, bpe, state, cfg2.to_dict())
    assert (plan1.start_step, plan1.start, plan1.total_steps) == (2, DataPosition(0, 4), 10)  # 2 + 2 + 6
    assert launch1.schedule == launch.schedule.spread(2, 10) and launch1.schedule.rate(2) == launch.schedule.rate(2)
    assert notes1[0].startswith("resuming with 1 drafter(s) where the checkpoint was trained with 2")
    assert notes1[1].startswith("LR schedule continued at step 2 and spread over the steps now left: before lr "
                                "0.0006, 6 steps, warm-up 2")


def test_plan_launch_rebuilds_a_changed_schedule_and_says_so():
    """The reported case: 2 drafters, max_steps 4, resumed at step 2 with max_steps 6: the schedule
    is rebuilt for 6 steps, in one line naming the field with the old and the new schedule."""
    before = cfg_with("cluster.drafters=[0, 1]", "train.max_steps=4", "train.warmup_ratio=0.04")
    after = cfg_with("cluster.drafters=[0]", "train.max_steps=6", "train.warmup_ratio=0.04")
    bpe = [50]
    old = LRSchedule.nominal(4, before.train)
    plan, launch, notes = plan_launch(after, bpe, _state(2, [0, 4], 2, old), before.to_dict())
    assert plan.total_steps == 6 and launch.schedule == LRSchedule.nominal(6, after.train)
    line = [n for n in notes if n.startswith("LR schedule rebuilt")]
    assert line == [f"LR schedule rebuilt at step 2 for train.max_steps 4 -> 6: before lr 0.0006, 4 steps, warm-up 1, "
                    f"min ratio 0, lr at step 2 {old.rate(2):.3g}; now lr 0.0006, 6 steps, warm-up 1, min ratio 0, "
                    f"lr at step 2 {launch.schedule.rate(2):.3g}"]
    # train.lr alone: rebuilt too, and the rate really changes (the saved optimizer's does not win)
    _, launch_lr, notes_lr = plan_launch(cfg_with("cluster.drafters=[0, 1]", "train.max_steps=4", "train.lr=1e-4",
                                                  "train.warmup_ratio=0.04"), bpe, _state(2, [0, 4], 2, old),
                                         before.to_dict())
    assert launch_lr.schedule.lr == 1e-4 and "train.lr 0.0006 -> 0.0001" in notes_lr[0]


def test_a_changed_objective_is_said_at_resume():
    """A resume may change what the steps train towards (distillation, labels, anchors): one line
    names each changed key with its old and new value; an unchanged config says nothing of it."""
    before = cfg_with("cluster.drafters=[0]", "drafter.distillation=0.5")
    bpe = [50]
    sched = LRSchedule.nominal(50, before.train)
    state = _state(7, [0, 7], 1, sched)
    after = cfg_with("cluster.drafters=[0]", "drafter.distillation=1.0", "drafter.anchors_per_row=32")
    notes = plan_launch(after, bpe, state, before.to_dict())[2]
    assert notes == ["the objective changes at step 7: drafter.distillation 0.5 -> 1.0, drafter.anchors_per_row "
                     f"{before.drafter.anchors_per_row} -> 32 (the steps before it were trained with the old values)"]
    assert plan_launch(before, bpe, state, before.to_dict())[2] == []
    old_file = before.to_dict()
    del old_file["drafter"]["distillation"]  # a run directory written before the key existed
    assert plan_launch(after, bpe, state, old_file)[2] == [notes[0].replace("drafter.distillation 0.5 -> 1.0, ", "")]


def test_max_steps_the_data_cannot_give_is_said_at_start():
    cfg = cfg_with("cluster.drafters=[0, 1]", "train.max_steps=3", "train.epochs=1")
    plan, _, notes = plan_launch(cfg, [3])
    assert plan.total_steps == 2
    assert notes == ["train.max_steps=3 cannot be honoured: the data gives 2 steps (3 batches in 1 epoch(s) over 2 "
                     "drafter(s)); the run ends at step 2 (raise train.epochs or add data for more)"]
    assert plan_launch(cfg_with("cluster.drafters=[0, 1]", "train.max_steps=2", "train.epochs=1"), [3])[2] == []


def test_a_checkpoint_without_a_position_is_placed_by_its_own_plan(tmp_path):
    assert checkpoint_position({"step": 3}, [5, 5], 2) == DataPosition(1, 0)
    assert checkpoint_position({"step": 3, "num_drafters": 1}, [5, 5], 2) == DataPosition(0, 3)
    launch = LaunchPlan(2, DataPosition(0, 4), 1, 8, LRSchedule(6e-4, 6, 1, 0.0))
    launch.write(tmp_path)
    assert LaunchPlan.read(tmp_path) == launch and LaunchPlan.read(tmp_path / "none") is None


# --------------------------------------------------------------------------- ledger.jsonl and metrics.jsonl
def test_ledger_final_view_after_rollbacks(tmp_path):
    ledger = LedgerFile(tmp_path)
    for s in range(4):
        ledger.trained(s, 0, [2 * s, 2 * s + 1], 0)
    ledger.rollback(2, 4, "drafter.1 died")
    with open(ledger.path, "a") as f:
        f.write('{"step": 2, "epo')  # a line torn by a crash
    ledger.trained(2, 0, [4, 5], 1)
    ledger.trained(3, 0, [6, 7], 1)
    view = ledger_view(ledger.path)
    assert sorted(view) == [0, 1, 2, 3] and view[3]["attempt"] == 1
    assert ledger_problems(ledger.path, [8]) == []
    ledger.trained(4, 0, [6, None], 1)  # batch 6 a second time, batch 7 never... and 8 missing
    problems = ledger_problems(ledger.path, [8], end=DataPosition(1, 0))
    assert problems == ["epoch 0 batch 6 trained 2 times", "batches trained out of order"]
    ledger.rollback(0, 5, "--resume at step 0")
    assert ledger_view(ledger.path) == {} and ledger_problems(ledger.path, [8], end=DataPosition(0, 2)) == [
        "epoch 0 batch 0 never trained", "epoch 0 batch 1 never trained"]


def test_metrics_view_each_step_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval/round": 0, "eval/tau": 1.0}] + [{"step": s, "train/loss": 10.0 - s} for s in (1, 2, 3, 4)]
    rows += [rollback_record(2, 4, "drafter.0 died"), {"step": 3, "train/loss": 6.5}, {"step": 4, "train/loss": 5.5},
             {"step": 4, "eval/round": 1, "eval/tau": 1.2}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    view = metrics_view(path)
    assert [(r["step"], r.get("train/loss"), r.get("eval/round")) for r in view] == [
        (0, None, 0), (1, 9.0, None), (2, 8.0, None), (3, 6.5, None), (4, None, 1), (4, 5.5, None)]


# --------------------------------------------------------------------------- check_fits
class _Tok:
    def __init__(self, n=100, template="{{ m }}", shift=0):
        self.n, self.chat_template, self.shift = n, template, shift
        self.bos_token_id = self.pad_token_id = None
        self.eos_token_id = 1

    def __len__(self):
        return self.n

    def get_vocab(self):
        return {f"tok{i + self.shift}": i for i in range(self.n)}


def _target(arch="Qwen3ForCausalLM", layers=8, hidden=64, vocab=128):
    return SimpleNamespace(architectures=[arch], num_hidden_layers=layers, hidden_size=hidden, vocab_size=vocab)


def _checkpoint(tmp_path, identity, vocab=128):
    ckpt = tmp_path / "checkpoints" / "step-00000004"
    (ckpt / "drafter").mkdir(parents=True)
    (ckpt / "drafter" / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    (ckpt / "state.json").write_text(json.dumps({"step": 4, "trained_with": identity}))
    return ckpt


TRAINED = dict(tokenizer=_Tok(), target_config=_target(), layer_ids=[1, 6], enable_thinking=None)


@pytest.mark.parametrize("changes, expected, forcible", [
    (dict(tokenizer=_Tok(shift=1)), "tokenizer fingerprint (sha256 of its vocabulary and special tokens): checkpoint ",
     True),
    (dict(tokenizer=_Tok(template="{{ other }}")), "chat template (sha256): checkpoint ", True),
    (dict(enable_thinking=True), "thinking mode (data.enable_thinking): checkpoint null, now true", True),
    (dict(target_config=_target(arch="LlamaForCausalLM")),
     'target architecture: checkpoint "Qwen3ForCausalLM", now "LlamaForCausalLM"', True),
    (dict(target_config=_target(layers=12)), "target layer count: checkpoint 8, now 12", False),
    (dict(target_config=_target(hidden=32)), "target hidden size: checkpoint 64, now 32", False),
    (dict(target_config=_target(vocab=256)), "target vocabulary size (embedding rows): checkpoint 128, now 256", False),
    (dict(layer_ids=[2, 6]), "target layer ids (the drafter's context features): checkpoint [1, 6], now [2, 6]", False),
])
def test_each_identity_difference_is_refused_in_one_line(tmp_path, changes, expected, forcible):
    ckpt = _checkpoint(tmp_path, run_identity(**TRAINED))
    now = run_identity(**{**TRAINED, **changes})
    assert check_fits(ckpt, run_identity(**TRAINED)) == []
    with pytest.raises(CheckpointMismatch) as err:
        check_fits(ckpt / "drafter", now)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{ckpt} does not fit what it is used with: {expected}")
    assert text.endswith("(pass --force to use it anyway)") == forcible
    if forcible:
        assert len(check_fits(ckpt, now, force=True)) == 1
    else:
        with pytest.raises(CheckpointMismatch):
            check_fits(ckpt, now, force=True)


def test_a_tokenizer_larger_than_the_drafters_vocabulary_is_refused(tmp_path):
    """The raw IndexError case: another tokenizer whose ids index past the target embedding, with
    a checkpoint that records nothing (written before identities were recorded)."""
    ckpt = _checkpoint(tmp_path, None, vocab=128)
    with pytest.raises(CheckpointMismatch, match="the tokenizer has 500 tokens but the drafter's target embedding "
                                                 "has 128 rows") as err:
        check_fits(ckpt, run_identity(_Tok(n=500)), force=True)
    assert "\n" not in str(err.value)
    assert check_fits(ckpt, run_identity(_Tok(n=100))) == []


def test_run_identity_of_a_real_tokenizer_is_stable():
    from dflash.data.tokenizer import load_tokenizer

    cfg = cfg_with()
    a = run_identity(load_tokenizer(cfg.target), None, None, None)
    b = run_identity(load_tokenizer(cfg.target), None, None, None)
    assert a == b and len(a["tokenizer.sha256"]) == 64 and a["tokenizer.size"] > 150_000
    assert a["chat_template.sha256"] is not None
