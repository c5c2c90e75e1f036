"""DrafterTrainer, AdamW and the schedule (dflash/training/trainer.py, dflash/training/optim.py)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from dflash.config import DrafterConfig, TrainConfig
from dflash.models.drafter import DFlashDraftModel
from dflash.models.drafter_config import DFlashConfig
from dflash.models.masks import FULL_ATTENTION, SLIDING_ATTENTION
from dflash.training.anchors import anchor_generator, draw_anchors, sample_anchors
from dflash.training.optim import build_optimizer, build_scheduler, lr_factor, warmup_steps
from dflash.training.trainer import EVAL_EPOCH, DrafterTrainer, metrics_to_host

V, D, L, B = 32, 32, 2, 4


def tiny_model(seed: int = 0, head_dim: int = 8, attention: str = "sdpa", **overrides: object) -> DFlashDraftModel:
    """A 2-layer drafter; ``overrides`` go to :class:`DFlashConfig` (``layer_types``, ``sliding_window``)."""
    torch.manual_seed(seed)
    kw: dict = dict(hidden_size=D, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=head_dim, vocab_size=V, num_hidden_layers=2, num_target_layers=6, target_layer_ids=[1, 4],
                    block_size=B, mask_token_id=5, rope_theta=10000.0)
    kw.update(overrides)
    return DFlashDraftModel(DFlashConfig(**kw), nn.Embedding(V, D), nn.Linear(D, V, bias=False), attention=attention)


def random_batch(r: int = 4, s: int = 20, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    doc_ids = torch.ones(r, s, dtype=torch.int32)
    doc_ids[:, s // 2:] = 2
    doc_ids[:, -2:] = 0
    position_ids = torch.cat([torch.arange(s // 2), torch.arange(s - s // 2)]).repeat(r, 1)
    return {
        "input_ids": torch.randint(0, V, (r, s), generator=g),
        "target_tokens": torch.randint(0, V, (r, s), generator=g),
        "position_ids": position_ids,
        "doc_ids": doc_ids,
        "loss_mask": (torch.rand(r, s, generator=g) < 0.8) & (doc_ids > 0),
        "features": torch.randn(r, s, L * D, generator=g),
        "target_hidden": torch.randn(r, s, D, generator=g),  # read only by a drafter trained by distillation
    }


def pattern_batch(r: int = 4, s: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    """A learnable task: token p + 1 = (5·token p + 3) mod V, and the target predicts it exactly."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(r, s, dtype=torch.long)
    ids[:, 0] = torch.randint(0, V, (r,), generator=g)
    for p in range(1, s):
        ids[:, p] = (5 * ids[:, p - 1] + 3) % V
    nxt = (5 * ids + 3) % V
    proj = torch.randn(V, L * D, generator=torch.Generator().manual_seed(1234))  # the same "target" for every batch
    return {
        "input_ids": ids,
        "target_tokens": nxt,
        "position_ids": torch.arange(s).repeat(r, 1),
        "doc_ids": torch.ones(r, s, dtype=torch.int32),
        "loss_mask": torch.ones(r, s, dtype=torch.bool),
        "features": proj[ids],
    }


def drafter_cfg(**kw: object) -> DrafterConfig:
    base: dict = dict(num_layers=2, block_size=B, anchors_per_row=5, compile=False)
    base.update(kw)
    return DrafterConfig(**base)


# --------------------------------------------------------------------------- optimizer / schedule


def test_warmup_and_cosine_schedule() -> None:
    cfg = TrainConfig(lr=1.0, warmup_ratio=0.1, min_lr_ratio=0.1)
    assert warmup_steps(100, cfg) == 10 and warmup_steps(101, cfg) == 11
    assert warmup_steps(100, TrainConfig(warmup_ratio=0.0)) == 0
    opt = torch.optim.AdamW([nn.Parameter(torch.ones(2))], lr=1.0)
    sched = build_scheduler(opt, 100, cfg)
    lrs = []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 90)))
    assert lrs[99] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 89 / 90)))
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lr_factor(1000, 100, 10, 0.1) == pytest.approx(0.1)


def test_optimizer_holds_only_trainable_drafter_params() -> None:
    model = tiny_model()
    opt = build_optimizer(model, TrainConfig(weight_decay=0.1))
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for p in model.parameters()}
    assert id(model.embed_tokens.weight) not in held and id(model.lm_head.weight) not in held
    decay = {g["weight_decay"]: len(g["params"]) for g in opt.param_groups}
    assert decay[0.0] == sum(1 for p in model.parameters() if p.dim() < 2)
    assert opt.param_groups[0]["lr"] == 6e-4 and opt.param_groups[0]["betas"] == (0.9, 0.95)


# --------------------------------------------------------------------------- data parallel


#: Drafter options beside the defaults that the data-parallel equality must hold for.
VARIANTS = {
    "default": {},
    "conversation+dpace": dict(anchor_sampling="conversation", anchors_per_conversation=2, loss_weighting="dpace",
                               dpace_alpha=0.3),
    "distillation": dict(distillation=0.7),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mode", ["sum", "ddp_mean"])
def test_two_rank_update_equals_one_concatenated_batch(mode: str, variant: str) -> None:
    """Two ranks (half batches, all-reduced loss denominator, synced grads) == one process on the
    whole batch, with the default objective and with per-conversation anchors + D-PACE weights."""
    model = tiny_model()
    train_cfg = TrainConfig(lr=1e-2, warmup_ratio=0.0, grad_clip=1e9)
    opts = VARIANTS[variant]
    batch = random_batch(r=4)
    anchors = draw_anchors(batch["loss_mask"], batch["doc_ids"], 5, opts.get("anchor_sampling", "row"),
                           opts.get("anchors_per_conversation"), anchor_generator(0, 0, 0))
    halves = [{k: v[sl] for k, v in batch.items()} for sl in (slice(0, 2), slice(2, 4))]
    half_anchors = [(anchors[0][sl], anchors[1][sl]) for sl in (slice(0, 2), slice(2, 4))]

    full = DrafterTrainer(copy.deepcopy(model), train_cfg, drafter_cfg(**opts), 10, "cpu")
    full_out, _ = full.forward_backward(batch, 0, 0, anchors=anchors)
    full_grads = [p.grad.clone() for p in full.params]

    factor = 2 if mode == "ddp_mean" else 1
    ranks = [DrafterTrainer(copy.deepcopy(model), train_cfg, drafter_cfg(**opts), 10, "cpu",
                            grads_averaged_over=factor) for _ in range(2)]
    w_local = [ranks[i].prepare(halves[i], 0, 0, half_anchors[i]).weight_sum for i in range(2)]
    w_global = w_local[0] + w_local[1]
    assert w_global.item() > 0 and all(w.item() > 0 for w in w_local)
    outs = []
    for i, tr in enumerate(ranks):
        out, wg = tr.forward_backward(halves[i], 0, 0, anchors=half_anchors[i],
                                      weight_sum_reduce=lambda w, i=i: w + w_local[1 - i])
        assert torch.allclose(wg, w_global)
        outs.append(out)
    # The all-reduce of gradients: SUM (grad_sync) or MEAN (what DDP does).
    for ps in zip(ranks[0].params, ranks[1].params):
        g = ps[0].grad + ps[1].grad
        if mode == "ddp_mean":
            g = g / 2
        for p in ps:
            p.grad = g.clone()
    for p_grad, ref in zip((p.grad for p in ranks[0].params), full_grads):
        assert torch.allclose(p_grad, ref, atol=1e-6, rtol=1e-5)
    assert torch.allclose(outs[0].loss_sum + outs[1].loss_sum, full_out.loss_sum, atol=1e-5)

    # Adam's first step is ~lr·sign(g): float noise on near-zero gradients would dominate the
    # comparison, so a larger eps damps it (the gradients themselves were compared above).
    for tr in [full, *ranks]:
        for group in tr.optimizer.param_groups:
            group["eps"] = 1e-3
        tr.optimizer_step()
    for p_full, p0, p1 in zip(full.params, ranks[0].params, ranks[1].params):
        assert torch.allclose(p0, p_full, atol=1e-6) and torch.equal(p0, p1)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_reference_draw_equals_the_trainers_own(variant: str) -> None:
    """The reference trainer draws each batch's anchors with ``DrafterTrainer.draw_anchors`` and
    passes them in; a drafter worker lets ``step`` draw them: same anchors, same update."""
    opts = VARIANTS[variant]
    batch = many_conversations_batch()
    worker = DrafterTrainer(tiny_model(), TrainConfig(), drafter_cfg(anchors_per_row=7, **opts), 10, "cpu", seed=5)
    ref = DrafterTrainer(tiny_model(), TrainConfig(), drafter_cfg(anchors_per_row=7, **opts), 10, "cpu", seed=5)
    for batch_id in range(3):
        anchors = ref.draw_anchors(batch["loss_mask"], batch["doc_ids"], 2, batch_id)
        prepared = worker.prepare(batch, 2, batch_id)
        assert torch.equal(prepared.anchors, anchors[0]) and torch.equal(prepared.anchor_keep, anchors[1])
        m_worker, m_ref = worker.step(batch, 2, batch_id), ref.step(batch, 2, batch_id, anchors=anchors)
        assert torch.equal(m_worker["loss"], m_ref["loss"]) and torch.equal(m_worker["tau"], m_ref["tau"])
    assert all(torch.equal(p, q) for p, q in zip(worker.params, ref.params))
    row = sample_anchors(batch["loss_mask"], batch["doc_ids"], 7, anchor_generator(5, 2, 0))
    drawn = worker.draw_anchors(batch["loss_mask"], batch["doc_ids"], 2, 0)
    assert torch.equal(drawn[0], row[0]) == (opts.get("anchor_sampling", "row") == "row")  # the configured rule


def many_conversations_batch(r: int = 3, s: int = 30) -> dict[str, torch.Tensor]:
    """Rows of conversations of 6 tokens each: a per-row draw and a per-conversation draw differ."""
    batch = random_batch(r=r, s=s, seed=4)
    batch["doc_ids"] = (torch.arange(s) // 6 + 1).to(torch.int32).repeat(r, 1)
    batch["position_ids"] = (torch.arange(s) % 6).repeat(r, 1)
    batch["loss_mask"] = torch.ones(r, s, dtype=torch.bool)
    return batch


def test_grad_sync_hook_is_called_with_trainable_params() -> None:
    seen: list[int] = []
    tr = DrafterTrainer(tiny_model(), TrainConfig(), drafter_cfg(), 10, "cpu",
                        grad_sync=lambda params: seen.append(len(params)),
                        weight_sum_reduce=lambda w: w * 2)
    m = tr.step(random_batch(), 0, 0)
    assert seen == [len(list(tr.model.parameters()))]
    assert torch.allclose(m["global_weight_sum"], 2 * m["weight_sum"])


# --------------------------------------------------------------------------- training


def test_step_metrics_and_determinism() -> None:
    batch = random_batch()
    a = DrafterTrainer(tiny_model(), TrainConfig(), drafter_cfg(), 10, "cpu", seed=3)
    b = DrafterTrainer(tiny_model(), TrainConfig(), drafter_cfg(), 10, "cpu", seed=3)
    ma, mb = a.step(batch, 1, 7), b.step(batch, 1, 7)
    assert torch.equal(ma["loss"], mb["loss"]) and torch.equal(ma["grad_norm"], mb["grad_norm"])
    host = metrics_to_host(ma)
    assert set(host) >= {"loss", "tau", "block_pos_acc", "lr", "grad_norm", "num_blocks", "step"}
    assert len(host["block_pos_acc"]) == B and host["block_pos_acc"][0] == 0.0
    assert host["num_blocks"] > 0 and 1.0 <= host["tau"] <= B
    assert math.isfinite(host["loss"]) and host["loss"] > 0 and host["grad_norm"] > 0
    assert host["step"] == 1 and host["lr"] == pytest.approx(6e-4)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_loss_falls_on_a_learnable_pattern(variant: str) -> None:
    torch.manual_seed(0)
    # one conversation per row here: no cap, so the conversation's share is the row's 6 anchor entries
    opts = {k: v for k, v in VARIANTS[variant].items() if k != "anchors_per_conversation"}
    tr = DrafterTrainer(tiny_model(), TrainConfig(lr=2e-2, warmup_ratio=0.1), drafter_cfg(anchors_per_row=6, **opts),
                        30, "cpu")
    batch = pattern_batch()
    held_out = pattern_batch(seed=1)
    if "distillation" in opts:  # a teacher whose head logits put 8 on the pattern's next token
        head = tr.module.lm_head.weight.detach()  # [V, D], square here
        for b in (batch, held_out):
            logits = 8.0 * torch.nn.functional.one_hot(b["target_tokens"], V).float()
            b["target_hidden"] = torch.linalg.solve(head, logits.reshape(-1, V).T).T.reshape(*logits.shape[:2], D)
    before = tr.evaluate(held_out, 0)
    losses = [tr.step(batch, 0, i)["loss"].item() for i in range(30)]
    after = tr.evaluate(held_out, 0)
    if variant == "default":  # D-PACE weights grow with the drafter's confidence: its loss is no yardstick
        assert sum(losses[-5:]) / 5 < 0.65 * sum(losses[:5]) / 5, losses
        assert after.loss.item() < 0.75 * before.loss.item()     # held-out batch, fixed anchors
    assert after.tau.item() > before.tau.item() + 0.5, (before.tau.item(), after.tau.item())


def test_evaluate_is_deterministic_and_does_not_train() -> None:
    tr = DrafterTrainer(tiny_model(), TrainConfig(), drafter_cfg(), 10, "cpu")
    batch = random_batch()
    before = [p.detach().clone() for p in tr.params]
    e1, e2 = tr.evaluate(batch, 4), tr.evaluate(batch, 4)
    assert torch.equal(e1.stats_vector(), e2.stats_vector())
    assert not torch.equal(e1.stats_vector(), tr.evaluate(batch, 5).stats_vector())
    assert all(torch.equal(a, p) for a, p in zip(before, tr.params))
    assert all(p.grad is None for p in tr.params)


def trained_on_packed_turns(head_tokens: int, r: int = 4, s: int = 64):
    """A tiny trainer after 20 steps (it accepts some drafts: τ varies between blocks) and a held-out
    batch of packed multi-turn rows: ``(trainer, batch, loss_mask, doc_ids)``."""
    from tests.test_anchors import packed_turns

    loss_mask, doc_ids = packed_turns(r, s, seed=3, max_conversation=64, max_turn=24)
    batch = {**pattern_batch(r, s, seed=5), "doc_ids": doc_ids, "loss_mask": loss_mask}
    tr = DrafterTrainer(tiny_model(), TrainConfig(lr=2e-2, warmup_ratio=0.1, eval_head_tokens=head_tokens),
                        drafter_cfg(anchors_per_row=12), 20, "cpu")
    for i in range(20):
        tr.step(pattern_batch(seed=i), 0, i)
    return tr, batch, loss_mask, doc_ids


@pytest.mark.parametrize("head_tokens", [1, 4, 9])
def test_eval_tau_head_equals_the_naive_filter(head_tokens: int) -> None:
    """``tau_head`` = mean τ of the evaluation's own blocks whose anchor's offset in its response
    (naive loop) is below ``train.eval_head_tokens``; ``tau`` = mean over every kept block."""
    from tests.test_anchors import naive_response_offsets

    tr, batch, loss_mask, doc_ids = trained_on_packed_turns(head_tokens)
    out = tr.evaluate(batch, 7)
    anchors, keep = tr.draw_anchors(loss_mask, doc_ids, EVAL_EPOCH, 7)
    offsets = naive_response_offsets(loss_mask, doc_ids)
    taus = out.block_tau.tolist()
    kept = [(taus[i][j], offsets[i][int(anchors[i, j])]) for i in range(loss_mask.shape[0]) for j in range(12) if keep[i, j]]
    head = [tau for tau, offset in kept if 0 <= offset < head_tokens]
    assert 0 < len(head) < len(kept) and len(set(tau for tau, _ in kept)) > 2
    assert out.head_blocks.item() == len(head) and out.num_blocks.item() == len(kept)
    assert out.head_tau_sum.item() == pytest.approx(sum(head))
    assert out.tau_head.item() == pytest.approx(sum(head) / len(head))
    assert out.tau_sum.item() == pytest.approx(sum(tau for tau, _ in kept))
    # the stats vector carries the head sums; a round trip keeps them
    again = type(out).from_stats_vector(out.stats_vector() + out.stats_vector(), walked=out.walked)
    assert again.head_blocks.item() == 2 * len(head) and again.tau_head.item() == pytest.approx(out.tau_head.item())
    assert again.tau.item() == pytest.approx(out.tau.item())


def naive_walk_sums(tau: list[list[int]], loss_mask: torch.Tensor, doc_ids: torch.Tensor,
                    head_tokens: int) -> tuple[int, int, int, int, int, int]:
    """Decoding token by token over every response (runs of naive response offsets): a block runs
    where the next anchor is and the response has a token after it; the head walk stops at the
    ``head_tokens``-th token; the first-response sums are the head walk's over the responses whose
    conversation (doc id) has no response earlier in the row. ``(Σ τ, blocks, head Σ τ, head
    blocks, first-response Σ τ, first-response blocks)``."""
    from tests.test_anchors import naive_response_offsets

    total = blocks = head_total = head_blocks = first_total = first_blocks = 0
    for r, (row, offsets) in enumerate(zip(tau, naive_response_offsets(loss_mask, doc_ids))):
        s = len(offsets)
        starts = [p for p in range(s) if offsets[p] == 0]
        for start in starts:
            earlier = [q for q in starts if q < start and int(doc_ids[r, q]) == int(doc_ids[r, start])]
            end = start
            while end + 1 < s and offsets[end + 1] == offsets[end] + 1:
                end += 1
            nxt = start
            for p in range(start, end):
                if p == nxt:
                    total, blocks = total + row[p], blocks + 1
                    if p - start < head_tokens - 1:
                        head_total, head_blocks = head_total + row[p], head_blocks + 1
                        if not earlier:
                            first_total, first_blocks = first_total + row[p], first_blocks + 1
                    nxt = p + row[p]
    return total, blocks, head_total, head_blocks, first_total, first_blocks


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("head_tokens", [1, 5, 16])
def test_walked_tau_sums_equal_a_naive_scan(seed: int, head_tokens: int) -> None:
    """Random τ ∈ [1, B] at every position of random packed rows (responses of any length,
    several per conversation): the walk's sums are the naive token-by-token scan's, and agree
    response by response with :func:`dflash.inference.acceptance.walk_tau`."""
    from dflash.inference.acceptance import walk_tau
    from dflash.training.evaluation import walked_tau_sums
    from tests.test_anchors import naive_response_offsets, packed_turns

    loss_mask, doc_ids = packed_turns(5, 160, seed, noise=0.1, max_conversation=80, max_turn=40)
    g = torch.Generator().manual_seed(seed)
    b = 2 + seed * 2
    tau = torch.randint(1, b + 1, loss_mask.shape, generator=g)
    got = walked_tau_sums(tau.float(), loss_mask, doc_ids, head_tokens)
    want = naive_walk_sums(tau.tolist(), loss_mask, doc_ids, head_tokens)
    assert (got.tau_sum, got.blocks, got.head_tau_sum, got.head_blocks, got.first_tau_sum, got.first_blocks) == want
    assert want[1] > 50 and want[0] > want[1] and (0 < want[3] <= want[1] or head_tokens == 1)  # real walks
    assert 0 < want[5] < want[3] or head_tokens == 1  # conversations of several responses: some are not first
    total = passes = 0
    for r, offsets in enumerate(naive_response_offsets(loss_mask, doc_ids)):
        for start in (p for p in range(len(offsets)) if offsets[p] == 0):
            end = start
            while end + 1 < len(offsets) and offsets[end + 1] == offsets[end] + 1:
                end += 1
            w = walk_tau(torch.arange(start, end), tau[r, start:end], start, end)
            total, passes = total + w.total, passes + w.passes
    assert (total, passes) == (got.tau_sum, got.blocks)
    with pytest.raises(ValueError, match="must be >= 1"):
        walked_tau_sums(torch.zeros(loss_mask.shape), loss_mask, doc_ids, head_tokens)
    with pytest.raises(ValueError, match="must be the same"):
        walked_tau_sums(tau[:, 1:], loss_mask, doc_ids, head_tokens)


def test_eval_walk_over_the_evaluations_own_tau() -> None:
    """``evaluate``'s walk = the naive scan over :meth:`position_tau`; ``position_tau`` at the
    evaluation's sampled anchors is their ``block_tau`` (the extra forwards score blocks as the
    sampled forward does) and 0 off the valid anchors; ``eval/tau`` and ``eval/tau_head`` are those
    of an evaluation without the walk; ``train.eval_walk: false`` leaves the walk out."""
    from dflash.training.anchors import valid_anchor_mask
    head_tokens = 6
    tr, batch, loss_mask, doc_ids = trained_on_packed_turns(head_tokens)
    out = tr.evaluate(batch, 7)
    tau = tr.position_tau(batch)
    valid = valid_anchor_mask(loss_mask, doc_ids)
    assert valid.sum() > 4 * 12  # more anchors than one forward holds: several chunks
    assert bool((tau[valid] >= 1).all()) and bool((tau[~valid] == 0).all()) and len(set(tau[valid].tolist())) > 2
    anchors, keep = tr.draw_anchors(loss_mask, doc_ids, EVAL_EPOCH, 7)
    assert torch.equal(tau.gather(1, anchors)[keep], out.block_tau[keep])
    want = naive_walk_sums(tau.long().tolist(), loss_mask, doc_ids, head_tokens)
    assert out.walked and (out.walk_tau_sum.item(), out.walk_blocks.item(), out.walk_head_tau_sum.item(),
                           out.walk_head_blocks.item(), out.walk_first_tau_sum.item(),
                           out.walk_first_blocks.item()) == want
    assert out.tau_walk.item() == pytest.approx(want[0] / want[1])
    assert out.tau_walk_head.item() == pytest.approx(want[2] / want[3])
    assert out.tau_walk_first.item() == pytest.approx(want[4] / want[5]) and 0 < want[5] < want[3]
    again = type(out).from_stats_vector(out.stats_vector() + out.stats_vector(), walked=True)
    assert again.walk_blocks.item() == 2 * want[1] and again.tau_walk.item() == pytest.approx(out.tau_walk.item())
    assert again.walk_first_blocks.item() == 2 * want[5]
    assert again.tau_head.item() == pytest.approx(out.tau_head.item())
    tr.eval_walk = False
    plain = tr.evaluate(batch, 7)
    assert not plain.walked and plain.tau_walk is None
    assert torch.equal(plain.stats_vector(), out.stats_vector()[:-6])


def test_state_dict_resume_gives_identical_steps() -> None:
    batch = random_batch()
    tr = DrafterTrainer(tiny_model(), TrainConfig(warmup_ratio=0.2), drafter_cfg(), 10, "cpu")
    for i in range(3):
        tr.step(batch, 0, i)
    state = copy.deepcopy(tr.state_dict())
    weights = copy.deepcopy(tr.model.state_dict())
    # Fresh drafter weights, the same frozen (shared) embedding and head.
    resumed_model = DFlashDraftModel(tr.module.config, tr.module.embed_tokens, tr.module.lm_head, attention="sdpa")
    resumed_model.load_state_dict(weights)
    resumed = DrafterTrainer(resumed_model, TrainConfig(warmup_ratio=0.2), drafter_cfg(), 10, "cpu")
    resumed.load_state_dict(state)
    assert resumed.step_count == 3
    m1, m2 = tr.step(batch, 0, 3), resumed.step(batch, 0, 3)
    assert m1["lr"] == m2["lr"]
    assert torch.equal(m1["loss"], m2["loss"])
    for p, q in zip(tr.params, resumed.params):
        assert torch.equal(p, q)


def test_missing_tensor_is_reported() -> None:
    tr = DrafterTrainer(tiny_model(), TrainConfig(), drafter_cfg(), 10, "cpu")
    batch = random_batch()
    del batch["target_tokens"]
    with pytest.raises(KeyError, match="target_tokens"):
        tr.step(batch, 0, 0)
    data_labels = DrafterTrainer(tiny_model(), TrainConfig(), drafter_cfg(labels="data"), 10, "cpu")
    assert data_labels.step(batch, 0, 0)["num_blocks"].item() > 0


def test_label_chain_reaches_the_step() -> None:
    """drafter.label_chain: on random text (off the target's greedy path almost everywhere) only
    block position 1 of each block counts; on the target's own greedy text every position does."""
    batch = random_batch()
    plain = DrafterTrainer(tiny_model(), TrainConfig(), drafter_cfg(), 10, "cpu").prepare(batch, 0, 0)
    chained = DrafterTrainer(tiny_model(), TrainConfig(), drafter_cfg(label_chain=True), 10, "cpu").prepare(batch, 0, 0)
    off_path = batch["input_ids"][:, 1:] != batch["target_tokens"][:, :-1]
    assert off_path.float().mean() > 0.9
    assert chained.valid[..., 2:].sum() < plain.valid[..., 2:].sum()
    assert torch.equal(chained.valid[..., :2], plain.valid[..., :2])
    own = dict(batch)
    own["input_ids"] = batch["input_ids"].clone()
    own["input_ids"][:, 1:] = batch["target_tokens"][:, :-1]
    assert torch.equal(DrafterTrainer(tiny_model(), TrainConfig(), drafter_cfg(label_chain=True), 10, "cpu")
                       .prepare(own, 0, 0).valid,
                       DrafterTrainer(tiny_model(), TrainConfig(), drafter_cfg(), 10, "cpu").prepare(own, 0, 0).valid)


def test_compile_on_cpu_is_ignored_and_says_so(caplog) -> None:
    with caplog.at_level("INFO", logger="dflash.training.trainer"):
        tr = DrafterTrainer(tiny_model(), TrainConfig(), drafter_cfg(compile=True), 10, "cpu")
    assert not tr.compiled
    assert "drafter.compile: ignored on cpu (CUDA graphs need a GPU); the drafter runs eager" in caplog.text


# --------------------------------------------------------------------------- activation checkpointing


#: A sliding layer (window 5 < a conversation's 6 tokens) then a full one: both mask kinds.
MIXED_LAYERS = dict(layer_types=[SLIDING_ATTENTION, FULL_ATTENTION], sliding_window=5)


def checkpointing_step(checkpointing: bool, batch: dict[str, torch.Tensor], opts: dict,
                       compile_backend: str | None = None, device: str = "cpu") -> dict:
    """One forward/backward of a fresh mixed-layer drafter (7 anchors per row, seed 5): the loss,
    every parameter's gradient, how often the decoder layers ran and (CPU) the bytes autograd saved
    for the backward. ``compile_backend``: the trainer's drafter forward under ``torch.compile`` with
    that backend; ``"trainer"``: the trainer's own compiled step (``drafter.compile``, CUDA only)."""
    on_cpu = device == "cpu"
    model = tiny_model(head_dim=8 if on_cpu else 16, attention="sdpa" if on_cpu else "auto", **MIXED_LAYERS)
    model.gradient_checkpointing = checkpointing
    model.to(device)
    model.embed_tokens.to(device)
    model.lm_head.to(device)
    tr = DrafterTrainer(model, TrainConfig(), drafter_cfg(anchors_per_row=7, compile=compile_backend == "trainer",
                                                          **opts), 10, device, seed=5, autocast_dtype=None)
    if compile_backend not in (None, "trainer"):
        tr._forward, tr.compiled = torch.compile(tr._hidden, backend=compile_backend, dynamic=False), True
    layer_calls = [0]
    for layer in model.layers:
        layer.self_attn.register_forward_pre_hook(lambda *_: layer_calls.__setitem__(0, layer_calls[0] + 1))
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    tensors = {k: v.to(device) for k, v in batch.items()}
    if on_cpu:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, _ = tr.forward_backward(tensors, 0, 0)
    else:
        out, _ = tr.forward_backward(tensors, 0, 0)
    return {"loss": out.loss_sum.detach().cpu(), "grads": [p.grad.cpu() for p in tr.params],
            "layer_calls": layer_calls[0], "saved_bytes": saved[0]}


def assert_same_step(got: dict, ref: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert torch.allclose(got["loss"], ref["loss"], rtol=rtol, atol=atol), (got["loss"], ref["loss"])
    assert len(got["grads"]) == len(ref["grads"]) > 0
    for g, r in zip(got["grads"], ref["grads"]):
        assert torch.allclose(g, r, rtol=rtol, atol=atol), (g - r).abs().max()
    assert sum(r.abs().sum().item() for r in ref["grads"]) > 0


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gradient_checkpointing_same_loss_and_gradients(variant: str) -> None:
    """Checkpointed drafter layers (recomputed in the backward) give the loss and every parameter's
    gradient of the plain forward, with a sliding and a full layer and 7 anchors per row; each
    layer runs twice and autograd keeps far fewer bytes for the backward."""
    batch = many_conversations_batch()
    plain = checkpointing_step(False, batch, VARIANTS[variant])
    ckpt = checkpointing_step(True, batch, VARIANTS[variant])
    assert_same_step(ckpt, plain, rtol=1e-6, atol=1e-7)
    assert (plain["layer_calls"], ckpt["layer_calls"]) == (2, 4)
    assert ckpt["saved_bytes"] < plain["saved_bytes"] / 2, (ckpt["saved_bytes"], plain["saved_bytes"])


def test_gradient_checkpointing_under_torch_compile(monkeypatch) -> None:
    """The trainer's compiled drafter forward with checkpointed layers (non-reentrant checkpoint as
    a higher-order op) gives the eager loss and gradients and still saves fewer bytes than the
    compiled forward without checkpointing. ``aot_eager_decomp_partition``: Dynamo, AOTAutograd and
    inductor's min-cut partitioner (which honours the recompute tags) without code generation,
    to keep this CPU test short; the GPU test below runs inductor with CUDA graphs."""
    import dflash.training.trainer as trainer_module
    from dflash.training.chunked_ce import linear_ce_chunk

    monkeypatch.setattr(trainer_module, "compiled_linear_ce_chunk", lambda: linear_ce_chunk)
    torch._dynamo.reset()
    batch = many_conversations_batch()
    eager = checkpointing_step(False, batch, {})
    compiled_plain = checkpointing_step(False, batch, {}, compile_backend="aot_eager_decomp_partition")
    compiled_ckpt = checkpointing_step(True, batch, {}, compile_backend="aot_eager_decomp_partition")
    torch._dynamo.reset()
    assert_same_step(compiled_ckpt, eager)
    assert_same_step(compiled_plain, eager)
    assert compiled_ckpt["saved_bytes"] < compiled_plain["saved_bytes"] / 2, \
        (compiled_ckpt["saved_bytes"], compiled_plain["saved_bytes"])


def test_build_drafter_takes_gradient_checkpointing_from_the_config(caplog) -> None:
    from dflash.config import load_config
    from dflash.training.factory import build_drafter, target_hf_config

    configs = Path(__file__).resolve().parent.parent / "configs"
    for value in (False, True):
        cfg = load_config(configs / "smollm2-135m-cpu.yaml",
                          ["target.kind=random", "target.arch=tiny-llama", "drafter.num_layers=2",
                           f"drafter.gradient_checkpointing={str(value).lower()}"], gpu_count=0)
        tc = target_hf_config(cfg)
        text = tc.get_text_config() if hasattr(tc, "get_text_config") else tc
        embed = nn.Embedding(int(text.vocab_size), int(text.hidden_size))
        head = nn.Linear(int(text.hidden_size), int(text.vocab_size), bias=False)
        caplog.clear()
        with caplog.at_level("INFO", logger="dflash.training.factory"):
            model = build_drafter(cfg, embed, head, int(text.vocab_size) - 8, torch.device("cpu"), tc)
        assert model.gradient_checkpointing is value
        assert f"gradient checkpointing {'on' if value else 'off'}" in caplog.text


# --------------------------------------------------------------------------- GPU only


def test_compiled_path_stages_inputs_and_builds_masks_outside() -> None:
    """The compiled-forward path (a stand-in for torch.compile on CPU) gets the same staged input
    tensors at every step, prebuilt attention masks, and takes exactly the eager steps."""
    eager = DrafterTrainer(tiny_model(), TrainConfig(), drafter_cfg(), 10, "cpu", seed=3)
    staged = DrafterTrainer(tiny_model(), TrainConfig(), drafter_cfg(), 10, "cpu", seed=3)
    seen: list[tuple[list[int], object]] = []

    def fake_compiled(*args):
        *tensors, masks = args
        seen.append(([t.data_ptr() for t in tensors], masks))
        return staged._hidden(*args)

    staged._forward, staged.compiled, staged.graphs = fake_compiled, True, True
    for i in range(3):
        batch = random_batch(seed=10 + i)  # fresh tensors (new addresses) every step
        me, ms = eager.step(batch, 0, i), staged.step(batch, 0, i)
        assert torch.allclose(ms["loss"], me["loss"], rtol=1e-6, atol=1e-7)
        assert torch.allclose(ms["grad_norm"], me["grad_norm"], rtol=1e-6, atol=1e-7)
        assert seen[-1][0][0] != batch["features"].data_ptr()  # a copy, not the caller's tensor
    assert len(seen) == 3 and seen[0][0] == seen[1][0] == seen[2][0]
    assert set(seen[0][1]) == {"full_attention"}  # masks built outside, one per layer type
    mask_ptrs = [m["full_attention"].data_ptr() for _, m in seen]  # dense (CPU) mask: one buffer
    assert mask_ptrs[0] == mask_ptrs[1] == mask_ptrs[2]
    for pe, ps in zip(eager.params, staged.params):  # the compiled loss sums in another order
        assert (pe - ps).abs().max() < 1e-6, (pe - ps).abs().max()
    assert not eager.compiled and not eager._staging  # eager runs read the caller's tensors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("compile_step", [False, True])
def test_gpu_step_matches_cpu(compile_step: bool, variant: str) -> None:
    """GPU (flex_attention, optionally compiled) and CPU (dense SDPA mask) take the same steps."""
    batch = many_conversations_batch(r=4, s=24) if variant != "default" else pattern_batch()
    opts = VARIANTS[variant]
    cpu = DrafterTrainer(tiny_model(head_dim=16), TrainConfig(), drafter_cfg(**opts), 10, "cpu")
    gpu_model = tiny_model(head_dim=16, attention="auto").cuda()
    gpu_model.embed_tokens.cuda()
    gpu_model.lm_head.cuda()
    gpu = DrafterTrainer(gpu_model, TrainConfig(), drafter_cfg(compile=compile_step, **opts), 10, "cuda",
                         autocast_dtype=None)
    anchors = cpu.draw_anchors(batch["loss_mask"], batch["doc_ids"], 0, 0)
    cuda_batch = {k: v.cuda() for k, v in batch.items()}
    for i in range(3):
        mc = cpu.step(batch, 0, i, anchors=anchors)
        mg = gpu.step(cuda_batch, 0, i, anchors=tuple(a.cuda() for a in anchors))
        assert torch.allclose(mg["loss"].cpu(), mc["loss"], rtol=1e-3, atol=1e-3)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_compiled_checkpointed_step_matches_eager() -> None:
    """On CUDA (flex_attention, fp32): the trainer's compiled step (``drafter.compile``: inductor,
    CUDA graphs) with checkpointed layers gives the eager step's loss and gradients, checkpointed
    eager too."""
    batch = many_conversations_batch()
    eager = checkpointing_step(False, batch, {}, device="cuda")
    assert_same_step(checkpointing_step(True, batch, {}, device="cuda"), eager, rtol=1e-4, atol=1e-5)
    assert_same_step(checkpointing_step(True, batch, {}, compile_backend="trainer", device="cuda"), eager,
                     rtol=1e-3, atol=1e-4)
    torch.cuda.synchronize()


def test_rng_state_round_trip_through_a_checkpoint_file(tmp_path):
    """rng_state → trainer.pt → load_trainer_state → set_rng_state replays the same draws, also
    when the states come back as another dtype / a non-contiguous copy (the GPU-mapped case is
    covered by scripts/gpu_pipeline_check.py's drafter-group restart)."""
    import random

    from dflash.training.checkpoint import rng_state, set_rng_state
    from dflash.training.checkpoint_load import load_trainer_state

    torch.manual_seed(123)
    random.seed(7)
    torch.save({"trainer": {}, "rng": rng_state()}, tmp_path / "trainer.pt")
    want = (torch.rand(5), random.random())
    torch.manual_seed(999)
    random.seed(1)
    saved = load_trainer_state(tmp_path)
    saved["rng"]["torch"] = saved["rng"]["torch"].to(torch.int16)  # a state not in uint8 is converted
    set_rng_state(saved["rng"])
    got = (torch.rand(5), random.random())
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
