"""Anchor sampling (dflash/training/anchors.py): valid, uniform, seeded, per row or per conversation."""

from __future__ import annotations

import pytest
import torch

from dflash.training.anchors import (
    anchor_generator,
    anchor_seed,
    conversation_anchor_quotas,
    draw_anchors,
    response_offsets,
    sample_anchors,
    sample_anchors_per_conversation,
    valid_anchor_mask,
)
from tests.test_objective import packed_batch


def test_anchor_seed_is_deterministic_and_spreads() -> None:
    assert anchor_seed(0, 1, 2) == anchor_seed(0, 1, 2)
    seeds = {anchor_seed(s, e, b) for s in range(3) for e in range(-1, 3) for b in range(20)}
    assert len(seeds) == 3 * 4 * 20
    assert all(0 <= x < 2**63 for x in seeds)


def test_anchors_valid_sorted_unique_fixed_shape() -> None:
    b = packed_batch()
    valid = valid_anchor_mask(b["loss_mask"], b["doc_ids"])
    for batch_id in range(20):
        for a in (1, 4, 9, 64):
            anchors, keep = sample_anchors(b["loss_mask"], b["doc_ids"], a, anchor_generator(7, 0, batch_id))
            assert anchors.shape == keep.shape == (3, a)
            assert anchors.dtype == torch.int64 and keep.dtype == torch.bool
            for row in range(3):
                n_valid = int(valid[row].sum())
                kept = anchors[row][keep[row]].tolist()
                assert len(kept) == min(n_valid, a)
                assert keep[row].tolist() == [True] * len(kept) + [False] * (a - len(kept))  # kept first
                assert kept == sorted(set(kept))  # sorted, unique
                for p in kept:
                    assert b["loss_mask"][row, p] and b["loss_mask"][row, p + 1]
                    assert b["doc_ids"][row, p] == b["doc_ids"][row, p + 1]
                assert (anchors[row][~keep[row]] == 0).all()


def test_anchors_keep_mask_when_few_valid_positions() -> None:
    s = 12
    loss_mask = torch.zeros(3, s, dtype=torch.bool)
    doc_ids = torch.ones(3, s, dtype=torch.int32)
    loss_mask[0, 3:6] = True            # valid anchors 3, 4
    loss_mask[1, 9:12] = True           # 9, 10 (11 is last: no p + 1)
    doc_ids[1, 10:] = 2                 # 9 → 10 crosses a document: only 10 is valid
    anchors, keep = sample_anchors(loss_mask, doc_ids, 5, anchor_generator(0, 0, 0))
    assert anchors.tolist() == [[3, 4, 0, 0, 0], [10, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert keep.tolist() == [[True, True, False, False, False], [True, False, False, False, False], [False] * 5]


def test_anchors_more_entries_than_positions() -> None:
    loss_mask = torch.ones(2, 6, dtype=torch.bool)
    doc_ids = torch.ones(2, 6, dtype=torch.int32)
    anchors, keep = sample_anchors(loss_mask, doc_ids, 10, anchor_generator(0, 0, 0))
    assert anchors.shape == (2, 10)
    assert anchors[:, :5].tolist() == [[0, 1, 2, 3, 4]] * 2
    assert keep.sum(1).tolist() == [5, 5]


def test_anchors_deterministic_under_seed() -> None:
    b = packed_batch()
    draw = lambda s, e, i: sample_anchors(b["loss_mask"], b["doc_ids"], 6, anchor_generator(s, e, i))  # noqa: E731
    a1, k1 = draw(3, 1, 5)
    a2, k2 = draw(3, 1, 5)
    assert torch.equal(a1, a2) and torch.equal(k1, k2)
    others = [draw(3, 1, 6)[0], draw(3, 2, 5)[0], draw(4, 1, 5)[0]]
    assert all(not torch.equal(a1, o) for o in others)


def test_anchors_are_uniform() -> None:
    s, a, draws = 10, 3, 3000
    loss_mask = torch.ones(1, s, dtype=torch.bool)
    loss_mask[0, 4] = False  # positions 3 and 4 invalid; 9 is last → valid: 0,1,2,5,6,7,8
    doc_ids = torch.ones(1, s, dtype=torch.int32)
    counts = torch.zeros(s)
    for i in range(draws):
        anchors, keep = sample_anchors(loss_mask, doc_ids, a, anchor_generator(1, 0, i))
        counts.index_add_(0, anchors[0][keep[0]], torch.ones(int(keep.sum())))
    valid = [0, 1, 2, 5, 6, 7, 8]
    expected = draws * a / len(valid)
    assert counts[[3, 4, 9]].sum() == 0
    assert torch.allclose(counts[valid], torch.full((7,), expected), rtol=0.1)


def test_anchor_sampling_has_no_data_dependent_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    b = packed_batch()

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("data-dependent op / host sync in the anchor draw")

    for name in ("nonzero", "item", "tolist", "masked_select", "unique"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    for name in ("nonzero", "masked_select", "unique", "argwhere"):
        monkeypatch.setattr(torch, name, forbidden)
    shapes = set()
    for mask in (b["loss_mask"], torch.zeros_like(b["loss_mask"]), torch.ones_like(b["loss_mask"])):
        for sampling, cap in (("row", None), ("conversation", None), ("conversation", 3)):
            anchors, keep = draw_anchors(mask, b["doc_ids"], 8, sampling, cap, anchor_generator(0, 0, 0))
            shapes.add((tuple(anchors.shape), tuple(keep.shape)))
    assert shapes == {((3, 8), (3, 8))}


def random_packed_rows(r: int, s: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_mask, doc_ids)`` of ``r`` rows: 1–7 conversations of random lengths (some of one
    token), loss masks in random runs (some conversations without a valid anchor), padding at the end."""
    g = torch.Generator().manual_seed(seed)
    doc_ids = torch.zeros(r, s, dtype=torch.int32)
    loss_mask = torch.zeros(r, s, dtype=torch.bool)
    for row in range(r):
        n = int(torch.randint(1, 8, (1,), generator=g))
        used = int(torch.randint(s // 2, s + 1, (1,), generator=g))
        cuts = sorted(set(torch.randint(1, max(used, 2), (n - 1,), generator=g).tolist()))
        bounds = [0, *cuts, used]
        for d, (lo, hi) in enumerate(zip(bounds, bounds[1:]), start=1):
            doc_ids[row, lo:hi] = d
            density = float(torch.rand((), generator=g))
            loss_mask[row, lo:hi] = torch.rand(hi - lo, generator=g) < density
    return loss_mask, doc_ids


def naive_conversation_anchors(loss_mask: torch.Tensor, doc_ids: torch.Tensor, a: int, cap: int | None,
                               keys: torch.Tensor, priority: torch.Tensor) -> tuple[list, list]:
    """Per-conversation anchors by Python loops: equal shares (water-filling), capped, left-over
    anchor entries by priority; inside a conversation the valid positions of largest key (ties: lower first)."""
    r, s = loss_mask.shape
    all_anchors, all_keep = [], []
    for row in range(r):
        lm, doc = loss_mask[row].tolist(), doc_ids[row].tolist()
        runs, start = [], 0  # conversations: maximal runs of equal doc ids
        for p in range(1, s + 1):
            if p == s or doc[p] != doc[p - 1]:
                runs.append((start, p))
                start = p
        valid = [[p for p in range(lo, hi - 1) if lm[p] and lm[p + 1]] for lo, hi in runs]
        counts = [len(v) for v in valid]
        top = a if cap is None else min(cap, a)
        level = max(t for t in range(top + 1) if sum(min(n, t) for n in counts) <= a)
        quota = [min(n, level) for n in counts]
        left = a - sum(quota)
        if level < top:
            eligible = sorted((c for c, n in enumerate(counts) if n > level),
                              key=lambda c: (-float(priority[row, c]), c))
            for c in eligible[:left]:
                quota[c] += 1
        chosen = []
        for c, positions in enumerate(valid):
            chosen += sorted(positions, key=lambda p: (-float(keys[row, p]), p))[:quota[c]]
        chosen.sort()
        assert len(chosen) <= a
        all_anchors.append(chosen + [0] * (a - len(chosen)))
        all_keep.append([True] * len(chosen) + [False] * (a - len(chosen)))
    return all_anchors, all_keep


@pytest.mark.parametrize("seed", range(6))
def test_conversation_anchors_equal_the_naive_loops(seed: int) -> None:
    """The vectorised per-conversation draw == Python loops over conversations and positions,
    fed the same generator draws (keys, then priorities), on random packed rows."""
    r, s = 5, 48
    loss_mask, doc_ids = random_packed_rows(r, s, seed)
    for a in (1, 3, 8, 20, 64):
        for cap in (None, 1, 2, 5, 600):
            batch_id = 10 * a + (cap or 0)
            anchors, keep = sample_anchors_per_conversation(loss_mask, doc_ids, a, cap,
                                                            anchor_generator(seed, 0, batch_id))
            g = anchor_generator(seed, 0, batch_id)
            keys = torch.rand((r, s), generator=g)
            priority = torch.rand((r, s), generator=g)
            want_anchors, want_keep = naive_conversation_anchors(loss_mask, doc_ids, a, cap, keys, priority)
            assert anchors.shape == keep.shape == (r, a) and anchors.dtype == torch.int64
            assert keep.tolist() == want_keep, (a, cap)
            assert anchors.tolist() == want_anchors, (a, cap)
            # the row's anchor entries are used up unless every conversation is exhausted (or capped)
            valid = valid_anchor_mask(loss_mask, doc_ids)
            if cap is None:
                assert keep.sum(1).tolist() == valid.sum(1).clamp(max=a).tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_conversation_anchors_on_gpu_equal_the_naive_loops() -> None:
    """On CUDA (the generator's own stream), the draw still equals the loops fed the same draws."""
    r, s = 6, 256
    loss_mask, doc_ids = random_packed_rows(r, s, 11)
    for a, cap in ((16, None), (64, 8), (300, None)):
        anchors, keep = sample_anchors_per_conversation(loss_mask.cuda(), doc_ids.cuda(), a, cap,
                                                        anchor_generator(0, 1, a, "cuda"))
        g = anchor_generator(0, 1, a, "cuda")
        keys = torch.rand((r, s), generator=g, device="cuda").cpu()
        priority = torch.rand((r, s), generator=g, device="cuda").cpu()
        want_anchors, want_keep = naive_conversation_anchors(loss_mask, doc_ids, a, cap, keys, priority)
        assert anchors.is_cuda and keep.cpu().tolist() == want_keep and anchors.cpu().tolist() == want_anchors


def test_conversation_quotas_by_hand() -> None:
    counts = torch.tensor([[10, 2, 0, 5]])
    prio = torch.tensor([[0.1, 0.9, 0.8, 0.7]])
    # level 3 fits (3 + 2 + 0 + 3 = 8 <= 9), level 4 does not (10): one entry left for the
    # conversations above the level (0 and 3), the higher priority (3) takes it.
    assert conversation_anchor_quotas(counts, 9, None, prio).tolist() == [[3, 2, 0, 4]]
    assert conversation_anchor_quotas(counts, 9, 2, prio).tolist() == [[2, 2, 0, 2]]      # capped
    assert conversation_anchor_quotas(counts, 100, None, prio).tolist() == [[10, 2, 0, 5]]  # all fit
    assert conversation_anchor_quotas(counts, 100, 512, prio).tolist() == [[10, 2, 0, 5]]
    assert conversation_anchor_quotas(counts, 1, None, prio).tolist() == [[0, 1, 0, 0]]    # priority decides
    tie = torch.tensor([[0.5, 0.5, 0.5, 0.5]])
    assert conversation_anchor_quotas(counts, 2, None, tie).tolist() == [[1, 1, 0, 0]]     # ties: lower index
    with pytest.raises(ValueError, match="cap"):
        conversation_anchor_quotas(counts, 4, 0, prio)
    with pytest.raises(ValueError, match="num_anchors"):
        conversation_anchor_quotas(counts, 0, None, prio)


def test_conversation_anchors_on_one_conversation_rows_equal_the_row_draw() -> None:
    loss_mask = torch.rand(4, 64, generator=torch.Generator().manual_seed(3)) < 0.8
    doc_ids = torch.ones(4, 64, dtype=torch.int32)
    for a in (1, 7, 30, 100):
        row = sample_anchors(loss_mask, doc_ids, a, anchor_generator(1, 2, a))
        conv = sample_anchors_per_conversation(loss_mask, doc_ids, a, None, anchor_generator(1, 2, a))
        assert torch.equal(row[0], conv[0]) and torch.equal(row[1], conv[1])


def test_conversation_anchors_share_the_row_between_conversations() -> None:
    """A short conversation gets all its positions, the long one the rest (the row draw would give
    the short one about its proportional share only)."""
    s = 64
    loss_mask = torch.ones(1, s, dtype=torch.bool)
    doc_ids = torch.ones(1, s, dtype=torch.int32)
    doc_ids[0, 56:] = 2                     # conversation 2: positions 56..63, valid anchors 56..62
    for i in range(20):
        anchors, keep = sample_anchors_per_conversation(loss_mask, doc_ids, 16, None, anchor_generator(0, 0, i))
        kept = anchors[0][keep[0]].tolist()
        assert len(kept) == 16 and [p for p in kept if p >= 56] == list(range(56, 63))
        capped, ckeep = sample_anchors_per_conversation(loss_mask, doc_ids, 16, 3, anchor_generator(0, 0, i))
        assert int(ckeep.sum()) == 6 and sum(p >= 56 for p in capped[0][ckeep[0]].tolist()) == 3


def test_draw_anchors_dispatches_and_checks() -> None:
    b = packed_batch()
    lm, doc = b["loss_mask"], b["doc_ids"]
    assert all(torch.equal(x, y) for x, y in zip(draw_anchors(lm, doc, 6, "row", None, anchor_generator(0, 0, 1)),
                                                  sample_anchors(lm, doc, 6, anchor_generator(0, 0, 1))))
    got = draw_anchors(lm, doc, 6, "conversation", 2, anchor_generator(0, 0, 1))
    want = sample_anchors_per_conversation(lm, doc, 6, 2, anchor_generator(0, 0, 1))
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    with pytest.raises(ValueError, match="sampling"):
        draw_anchors(lm, doc, 6, "sequence")
    with pytest.raises(ValueError, match="cap"):
        draw_anchors(lm, doc, 6, "row", 4)


def packed_turns(r: int, s: int, seed: int, noise: float = 0.1, max_conversation: int = 40,
                 max_turn: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed rows: conversations of random lengths (< ``max_conversation``) back to back
    (doc ids 1, 2, …, then padding 0), each alternating masked user turns and loss-masked
    assistant turns of random lengths (< ``max_turn``; a conversation may open with either); then
    a fraction ``noise`` of the loss mask flipped at random.
    Returns ``(loss_mask [R, S] bool, doc_ids [R, S] int32)``."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    loss_mask = torch.zeros(r, s, dtype=torch.bool)
    doc_ids = torch.zeros(r, s, dtype=torch.int32)
    for row in range(r):
        p, doc = 0, 1
        end = s - rand(0, 6)  # trailing padding
        while p < end:
            conv_end = min(end, p + rand(4, max_conversation))
            assistant = bool(rand(0, 2))
            while p < conv_end:
                turn_end = min(conv_end, p + rand(1, max_turn))
                doc_ids[row, p:turn_end] = doc
                loss_mask[row, p:turn_end] = assistant
                assistant = not assistant
                p = turn_end
            doc += 1
    flip = torch.rand(r, s, generator=g) < noise
    loss_mask = (loss_mask ^ flip) & (doc_ids > 0)
    return loss_mask, doc_ids


def naive_response_offsets(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> list[list[int]]:
    """``p − start`` of the run of ``loss_mask`` inside one conversation holding ``p``, else −1 (loops)."""
    out = []
    for mask, docs in zip(loss_mask.tolist(), doc_ids.tolist()):
        row, start = [], None
        for p, (m, d) in enumerate(zip(mask, docs)):
            if not m:
                start = None
                row.append(-1)
                continue
            if start is None or docs[p - 1] != d:
                start = p
            row.append(p - start)
        out.append(row)
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("noise", [0.0, 0.15])
def test_response_offsets_equal_the_naive_loop(seed: int, noise: float) -> None:
    loss_mask, doc_ids = packed_turns(6, 120, seed, noise)
    got = response_offsets(loss_mask, doc_ids)
    assert got.dtype == torch.int64 and got.shape == loss_mask.shape
    assert got.tolist() == naive_response_offsets(loss_mask, doc_ids)
    assert got.max() > 5 and (got == 0).sum() > 3 * 6  # several responses per row, some long


def test_response_offsets_restart_at_a_new_conversation_and_turn() -> None:
    doc_ids = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2, 2, 0]])
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 0, 1, 1, 1, 0]], dtype=torch.bool)
    assert response_offsets(loss_mask, doc_ids).tolist() == [[-1, 0, 1, 0, 1, -1, 0, 1, 2, -1]]
    with pytest.raises(ValueError, match=r"loss_mask \(1, 10\) and doc_ids \(10,\) must be \[R, S\]"):
        response_offsets(loss_mask, doc_ids[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_response_offsets_on_gpu_equal_the_naive_loop() -> None:
    loss_mask, doc_ids = packed_turns(8, 300, 7)
    got = response_offsets(loss_mask.cuda(), doc_ids.cuda())
    assert got.cpu().tolist() == naive_response_offsets(loss_mask, doc_ids)
