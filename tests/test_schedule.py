"""Step plan, work sequence and ledger: exactly-once over epochs, against a naive enumeration."""

import dataclasses
import json
import random

import pytest

from dflash.data.schedule import StepPlan
from dflash.runtime.coordinator import (Coordinator, CoordinatorConfig, CoordinatorSetup, Ledger, build_work_items,
                                       eval_round)
from dflash.training.evaluation import aggregate_eval
from dflash.runtime.messages import Checkpointed, Command


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
    sums = [{"loss_sum": 2.0, "weight_sum": 4.0, "tau_sum": 6.0, "blocks": 4, "head_tau_sum": 2.5, "head_blocks": 2.0,
             "correct": [0, 3, 1], "count": [0, 4, 4]},
            {"loss_sum": 1.0, "weight_sum": 2.0, "tau_sum": 3.0, "blocks": 2, "head_tau_sum": 1.0, "head_blocks": 1.0,
             "correct": [0, 1, 1], "count": [0, 2, 2]}]
    ev = aggregate_eval(sums)
    assert ev["eval/loss"] == pytest.approx(0.5)
    assert ev["eval/tau"] == pytest.approx(1.5)
    assert ev["eval/blocks"] == 6
    assert ev["eval/tau_head"] == pytest.approx(3.5 / 3) and ev["eval/head_blocks"] == 3
    assert ev["eval/acc_block_pos_1"] == pytest.approx(4 / 6)
    assert ev["eval/acc_block_pos_2"] == pytest.approx(2 / 6)
    no_head = aggregate_eval([{**s, "head_tau_sum": 0.0, "head_blocks": 0.0} for s in sums])
    assert no_head["eval/head_blocks"] == 0 and no_head["eval/tau_head"] != no_head["eval/tau_head"]  # NaN
    assert not any("walk" in key for key in ev)  # an evaluation that did not walk reports no walk
    walks = [{"walk_tau_sum": 9.0, "walk_blocks": 5.0, "walk_head_tau_sum": 4.0, "walk_head_blocks": 3.0},
             {"walk_tau_sum": 3.0, "walk_blocks": 1.0, "walk_head_tau_sum": 0.0, "walk_head_blocks": 0.0}]
    walked = aggregate_eval([{**s, **w} for s, w in zip(sums, walks)])
    assert walked["eval/tau_walk"] == pytest.approx(12 / 6) and walked["eval/walk_blocks"] == 6
    assert walked["eval/tau_walk_head"] == pytest.approx(4 / 3) and walked["eval/walk_head_blocks"] == 3
    assert walked["eval/tau"] == ev["eval/tau"] and walked["eval/tau_head"] == ev["eval/tau_head"]
    none = aggregate_eval([{**s, **w, "walk_head_tau_sum": 0.0, "walk_head_blocks": 0.0} for s, w in zip(sums, walks)])
    assert none["eval/walk_head_blocks"] == 0 and none["eval/tau_walk_head"] != none["eval/tau_walk_head"]  # NaN


# ---------------------------------------------------------------- evaluation rounds: a function of the step
def evals(items):
    """(round, at_step) of the eval items, in order."""
    return [(it.index, it.at_step) for it in items if it.kind == "eval"]


EVAL_ARGS = {"heldout_batches": 3, "eval_every": 4, "checkpoint_every": 2}  # 10 steps: evals at 0, 4, 8, 10


def test_eval_round_is_the_index_among_eval_points():
    assert [eval_round(s, 10, 4) for s in range(12)] == [0, None, None, None, 1, None, None, None, 2, None, 3, None]
    assert [eval_round(s, 8, 4) for s in range(9)] == [0, None, None, None, 1, None, None, None, 2]  # last = 8
    assert [eval_round(s, 5, 0) for s in range(6)] == [0, None, None, None, None, 1]  # start and end only


def test_eval_rounds_fresh_run():
    items = build_work_items(StepPlan([10], 1), 0, **EVAL_ARGS)
    assert evals(items) == [(0, 0), (1, 4), (2, 8), (3, 10)]
    assert items[0].kind == "eval" and items[-1].kind == "eval"
    # each eval comes right after the train step that completes its at_step
    for i, it in enumerate(items):
        if it.kind == "eval" and it.at_step > 0:
            assert (items[i - 1].kind, items[i - 1].index) == ("train", it.at_step - 1)


def test_eval_rounds_resume_at_eval_point():
    plan = StepPlan([10], 1)
    items = build_work_items(plan, 4, **EVAL_ARGS)
    assert evals(items) == [(1, 4), (2, 8), (3, 10)]  # baseline at 4 is round 1, as in the fresh run
    fresh = build_work_items(plan, 0, **EVAL_ARGS)
    assert [(it.kind, it.index, it.at_step) for it in items] == \
        [(it.kind, it.index, it.at_step) for it in fresh[-len(items):]]


def test_eval_rounds_resume_off_eval_point():
    plan = StepPlan([10], 1)
    # a baseline at step 6 (checkpoint.every=2, eval_every=4) keyed off the schedule as round -6
    assert evals(build_work_items(plan, 6, **EVAL_ARGS)) == [(-6, 6), (2, 8), (3, 10)]
    assert evals(build_work_items(plan, 9, **EVAL_ARGS)) == [(-9, 9), (3, 10)]
    # eval_every=0: start and end only; the end keeps round 1
    assert evals(build_work_items(plan, 0, 3, 0, 0)) == [(0, 0), (1, 10)]
    assert evals(build_work_items(plan, 5, 3, 0, 0)) == [(-5, 5), (1, 10)]


def test_eval_rounds_rollback():
    plan = StepPlan([10], 1)
    # rollback onto eval point 4, whose round 1 had not completed: it runs again, as round 1
    assert evals(build_work_items(plan, 4, eval_at_start=False, done_rounds={0}, **EVAL_ARGS)) == \
        [(1, 4), (2, 8), (3, 10)]
    # ... had completed: not again; later rounds run again on the retrained weights, same numbers
    assert evals(build_work_items(plan, 4, eval_at_start=False, done_rounds={0, 1, 2}, **EVAL_ARGS)) == \
        [(2, 8), (3, 10)]
    # rollback onto step 6, no eval point: no evaluation at 6
    assert evals(build_work_items(plan, 6, eval_at_start=False, done_rounds={0, 1}, **EVAL_ARGS)) == \
        [(2, 8), (3, 10)]
    # rollback onto step 0 (no checkpoint yet) before the first evaluation completed
    assert evals(build_work_items(plan, 0, eval_at_start=False, **EVAL_ARGS))[0] == (0, 0)
    # rollback onto a resume's off-schedule start (eval_at_start=True): its baseline again unless done
    assert evals(build_work_items(plan, 6, done_rounds=set(), **EVAL_ARGS))[0] == (-6, 6)
    assert evals(build_work_items(plan, 6, done_rounds={-6}, **EVAL_ARGS))[0] == (2, 8)
    assert [it.index for it in build_work_items(plan, 6, eval_at_start=False, **EVAL_ARGS)
            if it.kind == "train"] == [6, 7, 8, 9]


class _Sock:
    def __init__(self):
        self.sent = []

    def send(self, name, msg):
        self.sent.append((name, msg.TAG, msg))


class _Control:
    """Processes by name: ``restart`` starts a new (live) one, ``die`` ends the current one."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        self.live: dict[str, bool] = {}
        self.restarts: list[str] = []
        self.dead: list[str] = []

    def kill(self, name):
        self.live[name] = False

    def restart(self, name, resume_from):
        self.live[name] = True
        self.restarts.append(name)

    def die(self, name):
        self.live[name] = False
        self.dead.append(name)

    def exited(self):
        out, self.dead = self.dead, []
        return out

    def pid(self, name):
        return 1000 if self.live.get(name, True) else None

    def report(self, name):
        return f"{name} exited"

    def new_drafter_group(self):
        pass

    def latest_checkpoint(self):
        return self.ckpt


def _coordinator(tmp_path, start_step, ckpt_step, sock=None, **callbacks):
    plan = StepPlan([10], 1)
    ckpt = tmp_path / f"step-{ckpt_step:08d}"
    ckpt.mkdir()
    (ckpt / "state.json").write_text(json.dumps({"step": ckpt_step}))
    metrics = []
    setup = CoordinatorSetup(["target.0"], ["drafter.0"], {"target.0": "tcp://x"}, plan, start_step,
                             build_work_items(plan, start_step, **EVAL_ARGS),
                             {**EVAL_ARGS, "first_step": start_step}, 2)
    c = Coordinator(sock or _Sock(), setup, _Control(ckpt), on_metrics=lambda step, m: metrics.append((step, m)),
                    on_progress=lambda *a: None, **callbacks)
    return c, metrics


def _finish_evals_up_to(c, step):
    """Finish the items in order up to the eval at ``step`` (no drafters: empty eval sums)."""
    for i, it in enumerate(c.state.work.items):
        c.state.work.done[i].add("drafter.0")
        c._finish_item(it)
        if it.kind == "eval" and it.at_step == step:
            return


def test_coordinator_rollback_reruns_an_unfinished_eval_at_the_checkpoint(tmp_path):
    c, metrics = _coordinator(tmp_path, 0, 8)
    _finish_evals_up_to(c, 4)
    got = [(m["eval/round"], m["eval/step"], step) for step, m in metrics if "eval/round" in m]
    assert got == [(0, 0, 0), (1, 4, 4)]
    c.state.steps_done = 8  # steps 4..7 trained, checkpoint at 8 written, eval round 2 not finished
    c.supervision.restart_drafter_group("test")
    assert evals(c.state.work.items) == [(2, 8), (3, 10)]
    assert c.state.work.items[1].kind == "train" and c.state.work.items[1].index == 8


def test_coordinator_rollback_skips_a_finished_eval_at_the_checkpoint(tmp_path):
    c, metrics = _coordinator(tmp_path, 0, 8)
    _finish_evals_up_to(c, 8)
    assert [m["eval/round"] for _, m in metrics if "eval/round" in m] == [0, 1, 2]
    c.supervision.restart_drafter_group("test")
    assert evals(c.state.work.items) == [(3, 10)]
    assert c.state.work.items[0].kind == "train" and c.state.work.items[0].index == 8


def test_coordinator_resume_off_schedule_rollback_to_start(tmp_path):
    c, metrics = _coordinator(tmp_path, 6, 6)
    assert evals(c.state.work.items) == [(-6, 6), (2, 8), (3, 10)]
    c.supervision.restart_drafter_group("before the baseline finished")
    assert evals(c.state.work.items) == [(-6, 6), (2, 8), (3, 10)]
    _finish_evals_up_to(c, 6)
    assert [(m["eval/round"], m["eval/step"]) for _, m in metrics] == [(-6, 6)]
    c.supervision.restart_drafter_group("after the baseline")
    assert evals(c.state.work.items) == [(2, 8), (3, 10)]


def test_rollback_below_the_launch_step_is_tracked(tmp_path):
    """Launched with --resume at step 6; that checkpoint is later found damaged and moved aside,
    the group rolls back to step 4: the ledger must be checked from 4 (not from 6)."""
    c, _ = _coordinator(tmp_path, 6, 4)
    assert c.state.lowest_step == 6
    c.state.steps_done = 7
    c.supervision.restart_drafter_group("checkpoint step 6 damaged")
    assert c.state.steps_done == 4 and c.state.lowest_step == 4
    assert [it.index for it in c.state.work.items if it.kind == "train"][0] == 4


def test_no_checkpoint_left_in_a_resumed_launch_fails_instead_of_starting_from_scratch(tmp_path):
    """Every checkpoint moved aside as damaged while a launch that resumed at step 6 runs: the
    group cannot rebuild its weights; restarting it from random weights at step 6 (what happened)
    would train on silently. The run stops with the reason."""
    from dflash.runtime.coordinator import RunFailed

    c, _ = _coordinator(tmp_path, 6, 6)
    c.control.ckpt = None
    c.state.steps_done = 8
    with pytest.raises(RunFailed, match="no usable checkpoint is left .* resumed at step 6"):
        c.supervision.restart_drafter_group("restart drafters requested")
    (tmp_path / "fresh").mkdir()
    fresh, _ = _coordinator(tmp_path / "fresh", 0, 2)
    fresh.control.ckpt = None  # a launch from step 0: restarting from scratch is right
    fresh.state.steps_done = 1
    fresh.supervision.restart_drafter_group("test")
    assert fresh.state.steps_done == 0


def test_drafters_dying_after_a_group_restart_are_retried_then_the_run_fails(tmp_path):
    """A restarted drafter that dies before it is ready (bad checkpoint, OOM at load) counts as
    another failure of the group: retried up to max_restarts, then the run stops with a report
    (also while the group restart is still under way, so the launcher cannot hang)."""
    plan = StepPlan([10], 2)
    ckpt = tmp_path / "step-00000000"
    ckpt.mkdir()
    (ckpt / "state.json").write_text(json.dumps({"step": 0}))
    control = _Control(ckpt)
    setup = CoordinatorSetup(["target.0"], ["drafter.0", "drafter.1"], {"target.0": "tcp://x"}, plan, 0,
                             build_work_items(plan, 0, **EVAL_ARGS), {**EVAL_ARGS, "first_step": 0}, 2,
                             CoordinatorConfig(max_restarts=2))
    c = Coordinator(_Sock(), setup, control, on_metrics=lambda *a: None, on_progress=lambda *a: None)
    control.die("drafter.0")
    control.die("drafter.1")  # both in one poll: one group restart, the second exit is the replaced process'
    c.supervision.supervise()
    assert c.policy.drafter_failures == 1 and control.restarts == ["drafter.0", "drafter.1"]
    control.die("drafter.1")  # the restarted drafter dies during start-up
    c.supervision.supervise()
    assert c.policy.drafter_failures == 2 and control.restarts.count("drafter.1") == 2
    control.die("drafter.0")
    with pytest.raises(Exception, match="failed 3 times in a row"):
        c.supervision.supervise()


# --------------------------------------------------------------------------- stop and requested restarts


class _ScriptedSock(_Sock):
    """Sends are recorded; ``recv`` hands out the scripted ``(sender, message)`` pairs, then None."""

    def __init__(self, script=()):
        super().__init__()
        self.script = list(script)

    def send(self, name, msg):
        super().send(name, msg)
        return True

    def recv(self, timeout_s):
        return self.script.pop(0) if self.script else None


def _running(tmp_path, ckpt_step, steps_done, written, started, script=()):
    """A coordinator in mid-run: every worker up and ready, ``steps_done`` steps trained, checkpoint
    ``written`` on disk and ``started`` begun by rank 0; ``latest_checkpoint`` gives step ``ckpt_step``."""
    c, _ = _coordinator(tmp_path, 0, ckpt_step, sock=_ScriptedSock(script))
    c.state.config = dataclasses.replace(c.state.config, checkpoint_wait_s=30.0)
    for w in c.state.workers.values():
        w.up = w.ready = True
    c._started = True
    c.state.steps_done, c.state.checkpoints.written, c.state.checkpoints.started = steps_done, written, started
    return c


def _checkpointed(step):
    return ("drafter.0", Checkpointed(step=step, path=f"step-{step:08d}", name="drafter.0"))


def _ctl(c, cmd, **args):
    c.commands.handle("ctl-1", Command(cmd=cmd, args=args))
    name, kind, fields = c.sock.sent[-1]
    assert (name, kind) == ("ctl-1", "ctl_reply")
    return fields


def test_requested_restart_waits_for_the_checkpoint_being_written(tmp_path, caplog):
    c = _running(tmp_path, 8, steps_done=9, written=4, started=8)
    reply = _ctl(c, "restart", worker="drafters")
    assert reply["ok"] and reply["text"] == "drafter group restarting once checkpoint step 8, being written, is on disk"
    c.stopping.restart_when_written()
    assert c.state.pending_restart is not None and c.control.restarts == [] and c.state.steps_done == 9
    c._handle(*_checkpointed(8))
    with caplog.at_level("WARNING"):
        c.stopping.restart_when_written()
    assert c.state.pending_restart is None and c.control.restarts == ["drafter.0"] and c.state.steps_done == 8
    assert (f"drafter group restart (restart drafters requested, after checkpoint step 8 was written): rolling back "
            f"from step 9 to step 8 ({c.control.ckpt}, the newest checkpoint on disk)") in caplog.text


def test_requested_restart_without_a_write_in_flight_is_immediate_and_a_crash_is_not_delayed(tmp_path):
    c = _running(tmp_path, 8, steps_done=9, written=8, started=8)
    assert _ctl(c, "restart", worker="drafters")["text"] == "drafter group restarting from the last checkpoint (step 8)"
    assert c.control.restarts == ["drafter.0"]
    (tmp_path / "crash").mkdir()
    crashed = _running(tmp_path / "crash", 8, steps_done=9, written=4, started=8)
    _ctl(crashed, "restart", worker="drafters")
    crashed.control.die("drafter.0")  # a crash mid-write: the group restarts now, from what is on disk
    crashed.supervision.supervise()
    assert crashed.state.pending_restart is None and crashed.control.restarts == ["drafter.0"]
    assert crashed.state.steps_done == 8


@pytest.mark.parametrize("state, steps_done, written, started, ready, script, save, done", [
    # steps past the newest checkpoint: rank 0 writes step 9, the stop waits for it
    ("trained past the checkpoint", 9, 8, 8, True, [_checkpointed(9)], 9, 9),
    # the checkpoint of step 9 is being written: waited for, not written twice
    ("checkpoint write in flight", 9, 8, 9, True, [_checkpointed(9)], None, 9),
    # the group is restarting from checkpoint 8: it holds nothing newer, nothing is written
    ("drafter group restarting", 8, 8, 8, False, [], None, 8),
])
def test_stop_writes_or_waits_for_the_final_checkpoint(tmp_path, state, steps_done, written, started, ready, script,
                                                        save, done):
    c = _running(tmp_path, 8, steps_done, written, started, script)
    for name in c.state.drafters:
        c.state.workers[name].ready = ready
    assert c.request_stop("test")
    c.stopping.final_checkpoint()
    saves = [fields["step"] for name, kind, fields in c.sock.sent if kind == "save"]
    assert saves == ([] if save is None else [save]), state
    assert c.state.checkpoints.written == done and c.state.checkpoints.in_flight() is None, state


def test_second_stop_is_answered_and_nothing_restarts_while_stopping(tmp_path):
    c = _running(tmp_path, 8, steps_done=9, written=8, started=8)
    assert _ctl(c, "stop")["text"] == "stopping after the issued steps, with a final checkpoint"
    assert _ctl(c, "stop")["text"] == "already stopping (requested by `launch.cluster stop`)"
    refused = _ctl(c, "restart", worker="drafters")
    assert not refused["ok"] and refused["text"] == "the run is stopping (requested by `launch.cluster stop`): no restart"
    c.control.die("drafter.0")  # a drafter dying while the run stops: the group is not restarted
    c.supervision.supervise()
    assert c.control.restarts == [] and c.state.group_lost == "drafter.0 exited while the run stops"
    c.stopping.final_checkpoint()
    assert not [kind for _, kind, _ in c.sock.sent if kind == "save"]


def test_rollback_is_reported_and_train_commands_carry_the_data_position(tmp_path):
    """A drafter-group restart calls on_rollback (the launcher marks ledger.jsonl and metrics.jsonl);
    each train command carries the data position after its step (what a checkpoint records)."""
    rollbacks, trained = [], []
    c, _ = _coordinator(tmp_path, 0, 4, on_rollback=lambda to, frm, reason: rollbacks.append((to, frm, reason)),
                        on_trained=lambda item, attempt: trained.append((item.index, item.batches, attempt)))
    c._issue(c.state.work.items[1])  # train step 0
    sent = [f for name, kind, f in c.sock.sent if kind == "train"]
    assert sent[0]["position"] == [0, 1] and sent[0]["batch_id"] == 0
    for i in range(3):  # eval 0, steps 0 and 1
        c.state.work.done[i].add("drafter.0")
        c._finish_item(c.state.work.items[i])
    assert trained == [(0, [0], 0), (1, [1], 0)]
    c.state.steps_done = 6
    c.supervision.restart_drafter_group("drafter.0 died")
    assert rollbacks == [(4, 6, "drafter.0 died")]


def test_rollback_below_the_launch_start_replans_from_that_checkpoint(tmp_path):
    """A launch resumed at step 6 with 1 drafter from a checkpoint written with 2; its own checkpoint
    is then found damaged and the group rolls back to step 2, whose data position is [0, 4]."""
    plan = StepPlan([20], 1, start_step=6, start=StepPlan([20], 2).position_at(6))  # position [0, 12]
    ckpt = tmp_path / "step-00000002"
    ckpt.mkdir()
    (ckpt / "state.json").write_text(json.dumps({"step": 2, "data_position": [0, 4], "num_drafters": 2}))
    setup = CoordinatorSetup(["target.0"], ["drafter.0"], {"target.0": "tcp://x"}, plan, 6,
                             build_work_items(plan, 6, **EVAL_ARGS), {**EVAL_ARGS, "first_step": 6}, 2)
    c = Coordinator(_Sock(), setup, _Control(ckpt), on_metrics=lambda *a: None, on_progress=lambda *a: None)
    c.state.steps_done = 7
    c.supervision.restart_drafter_group("checkpoint step 6 damaged")
    assert c.state.plan.start_step == 2 and c.state.plan.assignment(2).batch_ids == (4,)
    assert [it.batches for it in c.state.work.items if it.kind == "train"][:2] == [[4], [5]]


# --------------------------------------------------------------------------- a drafter no target can reach


def _undeliverable(tmp_path, written=8, started=8):
    """A coordinator in mid-run whose first train job for drafter.0 target.0 could not hand over
    (drafter.0 is not attached), ``peer_timeout_s`` 10 s."""
    from dflash.runtime.messages import Dropped

    c = _running(tmp_path, 8, steps_done=9, written=written, started=started)
    c.state.config = dataclasses.replace(c.state.config, peer_timeout_s=10.0)
    item = next(it for it in c.state.work.items if it.kind == "train")
    c._issue(item)
    key = next(iter(c.state.assignment.jobs))
    c._handle("target.0", Dropped(job_key=key, reason="drafter.0 is not attached", name="target.0"))
    assert c.state.assignment.undelivered_since.keys() == {"drafter.0"} and c.state.assignment.unassigned[0] == key
    return c, key


def _age(c, seconds):
    """Move the first failed hand-over ``seconds`` into the past (nobody sleeps)."""
    c.state.assignment.undelivered_since["drafter.0"] -= seconds


def test_a_drafter_no_target_can_reach_is_treated_as_failed(tmp_path):
    """Within 3 peer timeouts the job is just re-assigned (the drafter may attach again, and a batch
    taken clears it); past them the drafter group restarts under the restart policy, and past
    ``max_restarts`` the run fails instead of re-assigning forever. ``status`` does not call it ready."""
    from dflash.runtime.messages import Received

    c, key = _undeliverable(tmp_path)
    s = c.status()["workers"]
    assert s["drafter.0"]["ready"] is False and s["drafter.0"]["undelivered_s"] is not None
    assert s["target.0"]["ready"] is True and s["target.0"]["undelivered_s"] is None
    _age(c, 29)
    c._check_undelivered()
    assert c.control.restarts == [] and c.policy.drafter_failures == 0
    c._handle("drafter.0", Received(job_key=key, name="drafter.0"))  # it attached again and took the batch
    assert c.state.assignment.undelivered_since == {} and c.status()["workers"]["drafter.0"]["ready"] is True

    for attempt in range(1, c.policy.max_restarts + 2):
        (tmp_path / f"a{attempt}").mkdir()
        c, key = _undeliverable(tmp_path / f"a{attempt}")
        c.policy.drafter_failures = attempt - 1
        _age(c, 31)
        if attempt > c.policy.max_restarts:
            with pytest.raises(Exception, match=r"no target could hand drafter.0 a batch for 30 s .*not attached"):
                c._check_undelivered()
            break
        c._check_undelivered()
        assert c.policy.drafter_failures == attempt and c.control.restarts == ["drafter.0"] and c.state.steps_done == 8
        assert c.state.assignment.undelivered_since == {} and c.state.attempt == 1


def test_a_drafter_no_target_can_reach_waits_for_the_checkpoint_being_written(tmp_path):
    c, _ = _undeliverable(tmp_path, written=4, started=8)
    _age(c, 31)
    c._check_undelivered()
    assert c.state.pending_restart is not None and c.control.restarts == [] and c.policy.drafter_failures == 1
    c._handle(*_checkpointed(8))
    c.stopping.restart_when_written()
    assert c.control.restarts == ["drafter.0"] and c.state.steps_done == 8


def test_stop_does_not_wait_for_items_a_drafter_no_target_can_reach_holds_up(tmp_path):
    """A stop waits for the issued items only while they can be handed out: a drafter no target
    could hand a batch to for a peer timeout ends the wait (no final checkpoint: rank 0 is stuck)."""
    c, _ = _undeliverable(tmp_path)
    assert _ctl(c, "stop")["ok"]
    c._check_undelivered()
    assert c.state.group_lost is None and not c.stopping.overdue()
    _age(c, 11)
    c._check_undelivered()
    assert c.state.group_lost.startswith("no target could hand drafter.0 a batch for 10 s") and c.stopping.overdue()
    assert c.control.restarts == [] and c.policy.drafter_failures == 0
    c.stopping.final_checkpoint()
    assert not [kind for _, kind, _ in c.sock.sent if kind == "save"]
