"""Block labels, position weights, the decayed / D-PACE loss, accuracy per block position and τ
(dflash/training/objective.py, dflash/training/chunked_ce.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash.config import default_gamma
from dflash.training.anchors import anchor_generator, sample_anchors
from dflash.training.objective import (
    LossOutput,
    acceptance_lengths,
    block_position_weights,
    build_block_labels,
    dflash_loss,
    dpace_weights,
    teacher_rows,
)


def packed_batch(r: int = 3, s: int = 40, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of 2–3 packed conversations, random loss masks, padding at the end."""
    g = torch.Generator().manual_seed(seed)
    doc_ids = torch.zeros(r, s, dtype=torch.int32)
    position_ids = torch.zeros(r, s, dtype=torch.long)
    for row in range(r):
        cuts = sorted(torch.randperm(s - 6, generator=g)[:2].add(3).tolist())
        ends = cuts + [s - 2 - row]
        start = 0
        for d, end in enumerate(ends, start=1):
            doc_ids[row, start:end] = d
            position_ids[row, start:end] = torch.arange(end - start)
            start = end
    loss_mask = (torch.rand(r, s, generator=g) < 0.7) & (doc_ids > 0)
    return {
        "input_ids": torch.randint(1, 50, (r, s), generator=g),
        "target_tokens": torch.randint(1, 50, (r, s), generator=g),
        "position_ids": position_ids,
        "doc_ids": doc_ids,
        "loss_mask": loss_mask,
    }


# --------------------------------------------------------------------------- labels


@pytest.mark.parametrize("mode", ["target", "data"])
def test_labels_same_position(mode: str) -> None:
    b = packed_batch()
    bs = 5
    anchors, keep = sample_anchors(b["loss_mask"], b["doc_ids"], 8, anchor_generator(0, 0, 1))
    keep[0, 1] = False  # a dropped block has no valid block position
    labels, valid = build_block_labels(b["input_ids"], b["target_tokens"], b["loss_mask"], b["doc_ids"],
                                       anchors, keep, bs, mode)
    s = b["input_ids"].shape[1]
    for r in range(3):
        for i in range(8):
            a = int(anchors[r, i])
            for k in range(bs):
                p = a + k
                ok = (k >= 1 and bool(keep[r, i]) and p < s and bool(b["loss_mask"][r, p])
                      and int(b["doc_ids"][r, p]) == int(b["doc_ids"][r, a]))
                assert bool(valid[r, i, k]) == ok, (r, i, k)
                if ok:
                    want = b["target_tokens"][r, p - 1] if mode == "target" else b["input_ids"][r, p]
                    assert int(labels[r, i, k]) == int(want)
                else:
                    assert int(labels[r, i, k]) == 0
    assert valid[keep].any(-1).all()       # a kept anchor always has block position 1 valid
    assert not valid[..., 0].any()


def test_labels_target_rule_on_a_small_row() -> None:
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    target_tokens = torch.tensor([[21, 22, 23, 24, 25, 26]])  # target's prediction for p + 1
    loss_mask = torch.tensor([[False, True, True, True, False, True]])
    doc_ids = torch.ones(1, 6, dtype=torch.int32)
    anchors, keep = torch.tensor([[1]]), torch.tensor([[True]])
    labels, valid = build_block_labels(input_ids, target_tokens, loss_mask, doc_ids, anchors, keep, 4)
    assert valid.tolist() == [[[False, True, True, False]]]
    assert labels.tolist() == [[[0, 22, 23, 0]]]
    labels, _ = build_block_labels(input_ids, target_tokens, loss_mask, doc_ids, anchors, keep, 4, "data")
    assert labels.tolist() == [[[0, 12, 13, 0]]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_label_chain_against_a_naive_walk(seed: int) -> None:
    """With chain, block position k counts only while the text at a+1 .. a+k−1 is the target's
    greedy token there; the labels themselves are those of labels='target'."""
    b = packed_batch(r=3, s=48, seed=seed)
    g = torch.Generator().manual_seed(100 + seed)
    # the text follows the target's greedy tokens (target_tokens[p − 1]) at ~70 % of positions
    follow = torch.rand(b["input_ids"].shape, generator=g) < 0.7
    follow[:, 0] = False
    ids = b["input_ids"].clone()
    ids[:, 1:] = torch.where(follow[:, 1:], b["target_tokens"][:, :-1], ids[:, 1:])
    bs = 6
    anchors, keep = sample_anchors(b["loss_mask"], b["doc_ids"], 10, anchor_generator(seed, 0, 1))
    plain_labels, plain_valid = build_block_labels(ids, b["target_tokens"], b["loss_mask"], b["doc_ids"],
                                                   anchors, keep, bs)
    labels, valid = build_block_labels(ids, b["target_tokens"], b["loss_mask"], b["doc_ids"], anchors, keep, bs,
                                       chain=True)
    s = ids.shape[1]
    cut = 0
    for r in range(ids.shape[0]):
        for i in range(anchors.shape[1]):
            a = int(anchors[r, i])
            on_path = True
            for k in range(bs):
                if k >= 2:  # the token at a + k − 1 must be the target's greedy one
                    p = a + k - 1
                    on_path = on_path and p < s and int(ids[r, p]) == int(b["target_tokens"][r, p - 1])
                want = bool(plain_valid[r, i, k]) and on_path
                assert bool(valid[r, i, k]) == want, (r, i, k)
                cut += bool(plain_valid[r, i, k]) and not on_path
                assert int(labels[r, i, k]) == (int(plain_labels[r, i, k]) if want else 0)
    assert cut > 0  # the walk did cut blocks
    # on the target's own greedy text the chain changes nothing
    own = b["input_ids"].clone()
    own[:, 1:] = b["target_tokens"][:, :-1]
    assert torch.equal(build_block_labels(own, b["target_tokens"], b["loss_mask"], b["doc_ids"], anchors, keep, bs,
                                          chain=True)[1],
                       build_block_labels(own, b["target_tokens"], b["loss_mask"], b["doc_ids"], anchors, keep, bs)[1])
    with pytest.raises(ValueError, match="chain"):
        build_block_labels(ids, b["target_tokens"], b["loss_mask"], b["doc_ids"], anchors, keep, bs, "data", chain=True)


# --------------------------------------------------------------------------- loss, accuracy, τ


def test_block_position_weights() -> None:
    w = block_position_weights(16, default_gamma(16))
    assert w[0] == 0 and w[1] == 1
    assert torch.allclose(w[1:], torch.exp(-torch.arange(15, dtype=torch.float32) / 7.0))
    with pytest.raises(ValueError):
        block_position_weights(4, 0.0)


def naive_loss(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, valid: torch.Tensor,
               gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    num = hidden.new_zeros(())
    den = 0.0
    r, a, bs, _ = hidden.shape
    for row in range(r):
        for i in range(a):
            for k in range(1, bs):
                if valid[row, i, k]:
                    w = math.exp(-(k - 1) / gamma)
                    logits = head(hidden[row, i, k])
                    num = num + w * F.cross_entropy(logits[None], labels[row, i, k][None])
                    den += w
    return num, torch.tensor(den)


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_loss_equals_per_block_loop(chunk: int) -> None:
    torch.manual_seed(0)
    r, a, bs, d, v = 2, 5, 6, 16, 40
    head = nn.Linear(d, v, bias=True)
    hidden = torch.randn(r, a, bs, d, requires_grad=True)
    labels = torch.randint(0, v, (r, a, bs))
    valid = torch.rand(r, a, bs) < 0.7
    valid[..., 0] = False
    gamma = 2.5
    out = dflash_loss(hidden, head, labels, valid, gamma, chunk=chunk)
    (grad,) = torch.autograd.grad(out.loss, hidden)
    hidden2 = hidden.detach().clone().requires_grad_(True)
    num, den = naive_loss(hidden2, head, labels, valid, gamma)
    (grad_ref,) = torch.autograd.grad(num / den, hidden2)
    assert torch.allclose(out.loss_sum, num, atol=1e-5, rtol=1e-5)
    assert torch.allclose(out.weight_sum, den, atol=1e-6)
    assert torch.allclose(out.loss, num / den, atol=1e-5, rtol=1e-5)
    assert torch.allclose(grad, grad_ref, atol=1e-6, rtol=1e-5)
    assert out.block_pos_count.tolist() == valid.float().sum((0, 1)).tolist()


def naive_dpace_weights(conf: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE weights by loops: w_k = Σ_{m ≥ k, valid} Π_{i ≤ m, valid} ((1 − α) q_i + α)."""
    out = torch.zeros(conf.shape, dtype=torch.float64)
    *lead, bs = conf.shape
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in lead]).view(-1, len(lead)).tolist():
        q, ok = conf[tuple(idx)].tolist(), valid[tuple(idx)].tolist()
        for k in range(bs):
            if not ok[k]:
                continue
            total = 0.0
            for m in range(k, bs):
                if ok[m]:
                    total += math.prod((1 - alpha) * q[i] + alpha for i in range(m + 1) if ok[i])
            out[tuple(idx) + (k,)] = total
    return out


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 1.0])
def test_dpace_weights_equal_the_naive_loop(alpha: float) -> None:
    g = torch.Generator().manual_seed(int(alpha * 10))
    conf = torch.rand(3, 4, 7, generator=g)
    valid = torch.rand(3, 4, 7, generator=g) < 0.7
    valid[..., 0] = False
    got = dpace_weights(conf, valid, alpha)
    want = naive_dpace_weights(conf, valid, alpha)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)
    assert (got[~valid] == 0).all() and (got[valid] > 0).all()
    if alpha == 1.0:  # q̃ = 1: w_k = the number of valid block positions at or after k
        counts = valid.flip(-1).cumsum(-1).flip(-1).float() * valid
        assert torch.equal(got, counts)
    with pytest.raises(ValueError, match="alpha"):
        dpace_weights(conf, valid, 1.5)


def naive_dpace_loss(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, valid: torch.Tensor,
                     alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ over blocks of Σ_k w_k·CE_k with detached D-PACE weights, and the number of blocks."""
    num = hidden.new_zeros(())
    blocks = 0
    r, a, bs, _ = hidden.shape
    for row in range(r):
        for i in range(a):
            ok = valid[row, i].tolist()
            if not any(ok):
                continue
            blocks += 1
            ce = [F.cross_entropy(head(hidden[row, i, k])[None], labels[row, i, k][None]) for k in range(bs)]
            q = [math.exp(-float(c.detach())) for c in ce]
            for k in range(1, bs):
                if ok[k]:
                    w = sum(math.prod((1 - alpha) * q[j] + alpha for j in range(m + 1) if ok[j])
                            for m in range(k, bs) if ok[m])
                    num = num + w * ce[k]
    return num, torch.tensor(float(blocks))


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_dpace_loss_equals_per_block_loop(chunk: int) -> None:
    torch.manual_seed(2)
    r, a, bs, d, v = 2, 5, 6, 16, 40
    head = nn.Linear(d, v, bias=True)
    hidden = torch.randn(r, a, bs, d, requires_grad=True)
    labels = torch.randint(0, v, (r, a, bs))
    valid = torch.rand(r, a, bs) < 0.7
    valid[..., 0] = False
    valid[0, 2] = False  # a block without a valid block position does not count
    out = dflash_loss(hidden, head, labels, valid, 99.0, chunk=chunk, weighting="dpace", dpace_alpha=0.4)
    (grad,) = torch.autograd.grad(out.loss, hidden)
    hidden2 = hidden.detach().clone().requires_grad_(True)
    num, den = naive_dpace_loss(hidden2, head, labels, valid, 0.4)
    (grad_ref,) = torch.autograd.grad(num / den, hidden2)
    assert den.item() == valid.any(-1).sum().item() == 9
    assert torch.allclose(out.loss_sum, num, atol=1e-5, rtol=1e-5)
    assert torch.allclose(out.weight_sum, den)
    assert torch.allclose(grad, grad_ref, atol=1e-6, rtol=1e-4)
    decay = dflash_loss(hidden.detach(), head, labels, valid, 2.0, chunk=chunk)
    assert torch.equal(out.tau_sum, decay.tau_sum) and torch.equal(out.block_pos_correct, decay.block_pos_correct)
    assert not torch.allclose(out.loss, decay.loss)
    with pytest.raises(ValueError, match="weighting"):
        dflash_loss(hidden, head, labels, valid, 2.0, weighting="focal")


# --------------------------------------------------------------------------- distillation


def naive_distill_loss(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, valid: torch.Tensor,
                       teacher_hidden: torch.Tensor, anchors: torch.Tensor, gamma: float,
                       lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """By loops, in float64: Σ w_k ((1 − λ) CE + λ KL(p ‖ q)) over valid block positions, the teacher
    p = softmax(head(target hidden at a + k − 1)), q = softmax(head(drafter hidden))."""
    num = torch.zeros((), dtype=torch.float64)
    den = 0.0
    r, a, bs, _ = hidden.shape
    seq = teacher_hidden.shape[1]
    w64, b64 = head.weight.double(), head.bias.double()
    for row in range(r):
        for i in range(a):
            for k in range(1, bs):
                if not valid[row, i, k]:
                    continue
                w = math.exp(-(k - 1) / gamma)
                logq = torch.log_softmax(hidden[row, i, k].double() @ w64.T + b64, dim=-1)
                pos = min(int(anchors[row, i]) + k - 1, seq - 1)
                p = torch.softmax(teacher_hidden[row, pos].double() @ w64.T + b64, dim=-1)
                kl = sum(p[v] * (torch.log(p[v]) - logq[v]) for v in range(p.numel()))
                ce = -logq[labels[row, i, k]]
                num = num + w * ((1 - lam) * ce + lam * kl)
                den += w
    return num, torch.tensor(den, dtype=torch.float64)


def test_teacher_rows_are_the_target_state_before_each_label() -> None:
    g = torch.Generator().manual_seed(5)
    target_hidden = torch.randn(2, 11, 3, generator=g)
    anchors = torch.tensor([[0, 4, 9], [2, 3, 10]])
    rows = teacher_rows(target_hidden, anchors, block_size=4)
    assert rows.shape == (2, 3, 3, 3)
    for r in range(2):
        for i in range(3):
            for k in range(1, 4):
                assert torch.equal(rows[r, i, k - 1], target_hidden[r, min(int(anchors[r, i]) + k - 1, 10)])


@pytest.mark.parametrize("lam,chunk", [(1.0, 7), (0.3, 1), (0.3, 4096)])
def test_distillation_loss_equals_the_naive_loop(lam: float, chunk: int) -> None:
    """The KL-mixed loss and its gradient against loops in float64, on random states, labels and anchors."""
    torch.manual_seed(3)
    r, a, bs, d, v, s = 2, 4, 5, 16, 40, 30
    head = nn.Linear(d, v, bias=True)
    hidden = torch.randn(r, a, bs, d, requires_grad=True)
    target_hidden = 2 * torch.randn(r, s, d)
    anchors = torch.sort(torch.randint(0, s, (r, a)), dim=1).values
    anchors[0, -1] = s - 2  # its last block positions run past the row
    labels = torch.randint(0, v, (r, a, bs))
    valid = torch.rand(r, a, bs) < 0.7
    valid[..., 0] = False
    gamma = 2.5
    teacher = teacher_rows(target_hidden, anchors, bs)
    out = dflash_loss(hidden, head, labels, valid, gamma, chunk=chunk, teacher=teacher, distillation=lam)
    (grad,) = torch.autograd.grad(out.loss, hidden)
    hidden2 = hidden.detach().clone().requires_grad_(True)
    num, den = naive_distill_loss(hidden2, head, labels, valid, target_hidden, anchors, gamma, lam)
    (grad_ref,) = torch.autograd.grad(num / den, hidden2)
    assert torch.allclose(out.loss_sum.double(), num, rtol=1e-5, atol=1e-5)
    assert torch.allclose(out.weight_sum.double(), den)
    assert torch.allclose(grad, grad_ref, rtol=1e-4, atol=1e-6)
    plain = dflash_loss(hidden.detach(), head, labels, valid, gamma, chunk=chunk)
    assert torch.equal(out.tau_sum, plain.tau_sum) and torch.equal(out.block_pos_correct, plain.block_pos_correct)
    assert not torch.allclose(out.loss, plain.loss)


def test_distillation_to_a_one_hot_teacher_is_cross_entropy() -> None:
    """A teacher whose distribution is (numerically) one-hot on the label: KL equals CE, any λ."""
    torch.manual_seed(4)
    r, a, bs, d, v = 1, 3, 4, 8, 12
    head = nn.Linear(d, v, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(v, d) * 1.0 + 0.01 * torch.randn(v, d))
    hidden = torch.randn(r, a, bs, d)
    labels = torch.randint(0, d, (r, a, bs))  # rows of the head that the teacher can pick out
    valid = torch.ones(r, a, bs, dtype=torch.bool)
    teacher = 1e4 * F.one_hot(labels[:, :, 1:], d).float()  # logits ≈ 1e4 on the label, ≈ 0 elsewhere
    plain = dflash_loss(hidden, head, labels, valid, 3.0)
    mixed = dflash_loss(hidden, head, labels, valid, 3.0, teacher=teacher, distillation=0.6)
    assert torch.allclose(mixed.loss_sum, plain.loss_sum, rtol=1e-5)


def test_distillation_arguments_are_checked() -> None:
    head = nn.Linear(8, 20, bias=False)
    hidden = torch.randn(1, 2, 3, 8)
    labels = torch.randint(0, 20, (1, 2, 3))
    valid = torch.ones(1, 2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="teacher rows"):
        dflash_loss(hidden, head, labels, valid, 4.0, distillation=0.5)
    with pytest.raises(ValueError, match="teacher rows"):
        dflash_loss(hidden, head, labels, valid, 4.0, teacher=torch.randn(1, 2, 3, 8), distillation=0.5)
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        dflash_loss(hidden, head, labels, valid, 4.0, teacher=torch.randn(1, 2, 2, 8), distillation=1.5)
    with pytest.raises(ValueError, match="decay"):
        dflash_loss(hidden, head, labels, valid, 4.0, teacher=torch.randn(1, 2, 2, 8), distillation=0.5,
                    weighting="dpace")


def test_compiled_distillation_chunks_equal_eager() -> None:
    from dflash.training.chunked_ce import compiled_linear_kd_chunk

    torch.manual_seed(6)
    r, a, bs, d, v = 2, 5, 6, 16, 40
    head = nn.Linear(d, v, bias=True)
    labels = torch.randint(0, v, (r, a, bs))
    valid = torch.rand(r, a, bs) < 0.7
    teacher = torch.randn(r, a, bs - 1, d)
    hidden = torch.randn(r, a, bs, d, requires_grad=True)
    out = dflash_loss(hidden, head, labels, valid, 2.5, chunk=8, chunk_fn=compiled_linear_kd_chunk(),
                      teacher=teacher, distillation=0.7)
    (grad,) = torch.autograd.grad(out.loss, hidden)
    hidden2 = hidden.detach().clone().requires_grad_(True)
    eager = dflash_loss(hidden2, head, labels, valid, 2.5, chunk=8, teacher=teacher, distillation=0.7)
    (grad_eager,) = torch.autograd.grad(eager.loss, hidden2)
    assert torch.allclose(out.loss_sum, eager.loss_sum, rtol=1e-5, atol=1e-5)
    assert torch.allclose(grad, grad_eager, rtol=1e-4, atol=1e-6)
    assert torch.equal(out.tau_sum, eager.tau_sum)


def test_compiled_loss_chunks_equal_the_loop_and_compile_once_per_shape() -> None:
    """The compiled LM-head chunk (what a compiled trainer uses) against the naive loop.

    Of the 2·5·5 = 50 rows about 35 are valid: padded to whole chunks of 8 rows (one shape,
    different offsets into the gathered hidden states), at most two compilations, none for the
    second call.
    """
    from dflash.compile_watch import compile_counts
    from dflash.training.chunked_ce import compiled_linear_ce_chunk

    torch.manual_seed(1)
    r, a, bs, d, v = 2, 5, 6, 16, 40
    head = nn.Linear(d, v, bias=True)
    labels = torch.randint(0, v, (r, a, bs))
    valid = torch.rand(r, a, bs) < 0.7
    gamma = 2.5
    fn = compiled_linear_ce_chunk()
    before = compile_counts().compiles
    for call in range(2):
        hidden = torch.randn(r, a, bs, d, requires_grad=True)
        out = dflash_loss(hidden, head, labels, valid, gamma, chunk=8, chunk_fn=fn)
        (grad,) = torch.autograd.grad(out.loss, hidden)
        hidden2 = hidden.detach().clone().requires_grad_(True)
        num, den = naive_loss(hidden2, head, labels, valid, gamma)
        (grad_ref,) = torch.autograd.grad(num / den, hidden2)
        assert torch.allclose(out.loss_sum, num, atol=1e-5, rtol=1e-5)
        assert torch.allclose(grad, grad_ref, atol=1e-6, rtol=1e-4)
        eager = dflash_loss(hidden.detach(), head, labels, valid, gamma, chunk=8)
        assert torch.equal(out.block_pos_correct, eager.block_pos_correct)
        assert torch.equal(out.tau_sum, eager.tau_sum)
        if call == 0:
            after_first = compile_counts().compiles
    assert after_first - before <= 2
    assert compile_counts().compiles == after_first


def test_loss_gives_the_frozen_head_no_gradient() -> None:
    head = nn.Linear(8, 20, bias=False)
    hidden = torch.randn(1, 2, 3, 8, requires_grad=True)
    valid = torch.ones(1, 2, 3, dtype=torch.bool)
    out = dflash_loss(hidden, head, torch.randint(0, 20, (1, 2, 3)), valid, 4.0)
    out.loss.backward()
    assert head.weight.grad is None and hidden.grad is not None
    with torch.no_grad():
        out2 = dflash_loss(hidden, head, torch.randint(0, 20, (1, 2, 3)), valid, 4.0)
    assert not out2.loss_sum.requires_grad


def test_tau_and_block_pos_accuracy_by_hand() -> None:
    """Two blocks of B = 5 with a hand-picked head, so the argmax at block position k is known."""
    v, d = 6, 6
    head = nn.Linear(d, v, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(v))
    # Predictions per block position (argmax = one-hot position of the hidden state):
    preds = torch.tensor([[[0, 1, 2, 3, 4],     # block 0
                           [0, 5, 5, 1, 1]]])   # block 1
    labels = torch.tensor([[[0, 1, 2, 0, 4],    # block 0: positions 1, 2 right, 3 wrong, 4 right
                            [0, 5, 4, 1, 0]]])  # block 1: position 1 right, 2 wrong, 3 right, 4 invalid
    valid = torch.tensor([[[False, True, True, True, True],
                           [False, True, True, True, False]]])
    hidden = F.one_hot(preds, v).float() * 5.0
    out = dflash_loss(hidden, head, labels, valid, 3.0)
    # τ: block 0 = 1 + 2 (stops at the wrong position 3); block 1 = 1 + 1.
    assert out.tau_sum.item() == 5.0 and out.num_blocks.item() == 2.0
    assert out.tau.item() == 2.5
    assert out.block_pos_correct.tolist() == [0.0, 2.0, 1.0, 1.0, 1.0]
    assert out.block_pos_count.tolist() == [0.0, 2.0, 2.0, 2.0, 1.0]
    assert out.block_pos_accuracy.tolist() == [0.0, 1.0, 0.5, 0.5, 1.0]
    # A block stops at its first invalid block position even if later ones are right.
    correct = torch.ones(1, 1, 5, dtype=torch.bool)
    stop = torch.tensor([[[False, True, False, True, True]]])
    assert acceptance_lengths(correct, stop).tolist() == [[2.0]]


def test_loss_output_stats_vector_round_trip() -> None:
    out = LossOutput(loss_sum=torch.tensor(3.5), weight_sum=torch.tensor(2.0), block_pos_correct=torch.tensor([0., 1., 2.]),
                     block_pos_count=torch.tensor([0., 2., 4.]), tau_sum=torch.tensor(6.0), num_blocks=torch.tensor(4.0))
    vec = out.stats_vector() + out.stats_vector()   # two ranks, all-reduce SUM
    both = LossOutput.from_stats_vector(vec)
    assert both.loss.item() == 1.75 and both.tau.item() == 1.5
    assert both.block_pos_accuracy.tolist() == [0.0, 0.5, 0.5]


def test_eval_output_head_sums_and_errors() -> None:
    from dflash.training.evaluation import EvalOutput

    tau = torch.tensor([[1.0, 3.0, 2.0], [4.0, 1.0, 1.0]])
    out = LossOutput(loss_sum=torch.tensor(3.5), weight_sum=torch.tensor(2.0), block_pos_correct=torch.tensor([0., 1.]),
                     block_pos_count=torch.tensor([0., 2.]), tau_sum=torch.tensor(12.0), num_blocks=torch.tensor(6.0),
                     block_tau=tau)
    head = torch.tensor([[True, True, False], [False, False, True]])
    ev = EvalOutput.from_loss(out, head)
    assert ev.head_tau_sum.item() == 5.0 and ev.head_blocks.item() == 3.0 and ev.tau_head.item() == pytest.approx(5 / 3)
    assert ev.stats_vector().tolist() == [3.5, 2.0, 12.0, 6.0, 0.0, 1.0, 0.0, 2.0, 5.0, 3.0]
    with pytest.raises(ValueError, match=r"head \(2, 2\) does not match block_tau \(2, 3\)"):
        EvalOutput.from_loss(out, head[:, :2])
    with pytest.raises(ValueError, match="out: has no block_tau"):
        EvalOutput.from_loss(LossOutput.from_stats_vector(out.stats_vector()), head)


def test_loss_chunk_rows_fill_whole_tiles_and_bound_the_logits():
    from dflash.training.chunked_ce import LOSS_CHUNK_ALIGN, LOSS_CHUNK_ELEMENTS, LOSS_CHUNK_ROWS, loss_chunk_rows

    cases = {248_320: 1024, 151_936: 1536, 49_152: 2048, 100: 2048, 1 << 20: 256, 700_000: 256, 3_000_000: 89, 1 << 29: 1}
    for vocab, rows in cases.items():
        got = loss_chunk_rows(vocab)
        assert got == rows, (vocab, got)
        # by hand: the most rows within both caps, then whole tiles above one tile
        naive = max(1, min(LOSS_CHUNK_ROWS, LOSS_CHUNK_ELEMENTS // vocab))
        while naive > LOSS_CHUNK_ALIGN and naive % LOSS_CHUNK_ALIGN:
            naive -= 1
        assert got == naive and got * vocab <= max(LOSS_CHUNK_ELEMENTS, vocab)
    with pytest.raises(ValueError, match="vocab_size"):
        loss_chunk_rows(0)


# --------------------------------------------------------------------------- the LM head over counted rows only


def test_counted_rows_are_the_valid_ones_in_order_padded_to_whole_chunks() -> None:
    from dflash.training.objective import _counted_rows

    counted = torch.tensor([0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0], dtype=torch.bool)
    idx, k = _counted_rows(counted, 3)
    assert k == 4 and idx.tolist() == [1, 2, 5, 10, 0, 0]  # 4 rows in 2 chunks of 3, padded with row 0
    idx, k = _counted_rows(counted, 8)
    assert k == 4 and idx.tolist() == [1, 2, 5, 10, 0, 0, 0, 0]
    idx, k = _counted_rows(torch.zeros(16, dtype=torch.bool), 3)
    assert k == 0 and idx.tolist() == [0, 0, 0]  # no counted row: one chunk of padding
    idx, k = _counted_rows(torch.ones(16, dtype=torch.bool), 5)
    assert k == 16 and idx.tolist() == list(range(16)) + [0] * 4  # whole chunks of 5: no 1-row tail
    assert _counted_rows(counted, 16) is None  # one chunk holds every row


@pytest.mark.parametrize("weighting,lam", [("decay", 0.0), ("dpace", 0.0), ("decay", 0.4)])
@pytest.mark.parametrize("chunk", [1, 4])
def test_loss_over_counted_rows_equals_every_row(weighting: str, lam: float, chunk: int) -> None:
    """Few valid block positions (as label cutting leaves them on raw text): the LM head over the
    counted rows only gives every row's loss, gradient, accuracy and τ, and the naive loops'."""
    from dflash.training.objective import _counted_rows

    torch.manual_seed(7 + chunk)
    r, a, bs, d, v = 3, 6, 6, 16, 40
    head = nn.Linear(d, v, bias=True)
    labels = torch.randint(0, v, (r, a, bs))
    # a valid prefix of random length per block, most of them short: ~20 % of the rows count
    lengths = torch.randint(0, 3, (r, a))
    lengths[0, 0] = bs - 1  # one block valid throughout
    valid = torch.arange(bs)[None, None, :] <= lengths[..., None]
    valid[..., 0] = False
    valid[1, 2] = False  # a block with no valid position
    n = r * a * (bs - 1)
    assert _counted_rows(valid[:, :, 1:].reshape(n), chunk) is not None  # the counted path runs
    teacher = torch.randn(r, a, bs - 1, d) if lam else None
    hidden = torch.randn(r, a, bs, d, requires_grad=True)
    kw = dict(chunk=chunk, weighting=weighting, dpace_alpha=0.3, teacher=teacher, distillation=lam)
    out = dflash_loss(hidden, head, labels, valid, 2.5, **kw)
    (grad,) = torch.autograd.grad(out.loss, hidden)
    hidden2 = hidden.detach().clone().requires_grad_(True)
    every = dflash_loss(hidden2, head, labels, valid, 2.5, counted_rows_only=False, **kw)
    (grad_every,) = torch.autograd.grad(every.loss, hidden2)
    assert torch.allclose(out.loss_sum, every.loss_sum, rtol=1e-6, atol=1e-6)
    assert torch.equal(out.weight_sum, every.weight_sum)
    assert torch.allclose(grad, grad_every, rtol=1e-6, atol=1e-7)
    assert (grad[~valid] == 0).all() and (grad[valid].abs().sum(-1) > 0).all()
    assert torch.equal(out.block_pos_correct, every.block_pos_correct)
    assert torch.equal(out.block_pos_count, every.block_pos_count)
    assert torch.equal(out.tau_sum, every.tau_sum) and torch.equal(out.block_tau, every.block_tau)
    hidden3 = hidden.detach().clone().requires_grad_(True)
    if weighting == "dpace":
        num, den = naive_dpace_loss(hidden3, head, labels, valid, 0.3)
    elif lam:
        return  # the distillation loop is checked against every row above and in its own test
    else:
        num, den = naive_loss(hidden3, head, labels, valid, 2.5)
    (grad_ref,) = torch.autograd.grad(num / den, hidden3)
    assert torch.allclose(out.loss_sum, num, rtol=1e-5, atol=1e-5)
    assert torch.allclose(grad, grad_ref, rtol=1e-4, atol=1e-6)


def test_loss_with_no_counted_row_is_zero_with_a_gradient() -> None:
    torch.manual_seed(9)
    head = nn.Linear(8, 20, bias=False)
    hidden = torch.randn(2, 4, 5, 8, requires_grad=True)
    labels = torch.randint(0, 20, (2, 4, 5))
    valid = torch.zeros(2, 4, 5, dtype=torch.bool)
    for weighting in ("decay", "dpace"):
        out = dflash_loss(hidden, head, labels, valid, 3.0, chunk=2, weighting=weighting)
        assert out.loss_sum.item() == 0.0 and out.num_blocks.item() == 0.0
        (grad,) = torch.autograd.grad(out.loss_sum, hidden)
        assert (grad == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_gpu_compiled_loss_over_counted_rows_equals_every_row(weighting: str) -> None:
    """On CUDA with the trainer's compiled chunk function and bf16 drafter states: the LM head over
    the counted rows only (several chunks, a padded last one) gives every row's loss and gradient."""
    from dflash.training.chunked_ce import compiled_linear_ce_chunk
    from dflash.training.objective import _counted_rows

    torch.manual_seed(11)
    r, a, bs, d, v, chunk = 4, 32, 16, 64, 1000, 128
    head = nn.Linear(d, v, bias=False).cuda()
    labels = torch.randint(0, v, (r, a, bs), device="cuda")
    lengths = torch.randint(0, 6, (r, a), device="cuda")
    valid = torch.arange(bs, device="cuda")[None, None, :] <= lengths[..., None]
    valid[..., 0] = False
    n = r * a * (bs - 1)
    picked = _counted_rows(valid[:, :, 1:].reshape(n), chunk)
    assert picked is not None and picked[0].numel() >= 3 * chunk  # several chunks run
    hidden = torch.randn(r, a, bs, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fn = compiled_linear_ce_chunk()
    out = dflash_loss(hidden, head, labels, valid, 4.0, chunk=chunk, chunk_fn=fn, weighting=weighting)
    (grad,) = torch.autograd.grad(out.loss, hidden)
    hidden2 = hidden.detach().clone().requires_grad_(True)
    every = dflash_loss(hidden2, head, labels, valid, 4.0, chunk=chunk, chunk_fn=fn, weighting=weighting,
                        counted_rows_only=False)
    (grad_every,) = torch.autograd.grad(every.loss, hidden2)
    assert torch.allclose(out.loss_sum, every.loss_sum, rtol=1e-4, atol=1e-4)
    assert torch.equal(out.weight_sum, every.weight_sum)
    assert torch.allclose(grad.float(), grad_every.float(), rtol=1e-2, atol=1e-5)
    assert (grad[~valid] == 0).all() and (grad[valid].float().abs().sum(-1) > 0).all()
    assert torch.equal(out.tau_sum, every.tau_sum)
