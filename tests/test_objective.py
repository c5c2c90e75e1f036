"""Anchors, labels, attention mask, decayed CE loss and τ (dflash/training/objective.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash.config import default_gamma
from dflash.training.objective import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    LossOutput,
    acceptance_lengths,
    anchor_generator,
    anchor_seed,
    build_attention_masks,
    build_block_labels,
    dense_attention_mask,
    dflash_loss,
    flex_block_mask,
    restage_attention_mask,
    mask_tiles,
    conversation_anchor_quotas,
    dpace_weights,
    draw_anchors,
    sample_anchors,
    sample_anchors_per_conversation,
    slot_weights,
    valid_anchor_mask,
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


# --------------------------------------------------------------------------- anchors


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


def test_anchors_more_slots_than_positions() -> None:
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
    slots by priority; inside a conversation the valid positions of largest key (ties: lower first)."""
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
            # the row's slots are used up unless every conversation is exhausted (or capped)
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
    # level 3 fits (3 + 2 + 0 + 3 = 8 <= 9), level 4 does not (10): one slot left for the
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


# --------------------------------------------------------------------------- labels


@pytest.mark.parametrize("mode", ["target", "data"])
def test_labels_same_position(mode: str) -> None:
    b = packed_batch()
    bs = 5
    anchors, keep = sample_anchors(b["loss_mask"], b["doc_ids"], 8, anchor_generator(0, 0, 1))
    keep[0, 1] = False  # a dropped block has no valid slot
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
    assert valid[keep].any(-1).all()       # a kept anchor always has slot 1 valid
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


# --------------------------------------------------------------------------- attention mask


def engine_visible(a: int, k: int, key_pos: int, key_is_block: bool, same_doc: bool, window: int | None,
                   block_size: int) -> bool:
    """The serving engines' DFlash attention rule for one (query, key) pair, restated from their code.

    vLLM (``qwen3_dflash.py``: a layer is causal iff its ``layer_types`` entry is
    ``sliding_attention``; the attention backend keeps keys in ``[q − (W − 1), q]``), SGLang
    (``models/dflash.py``: sliding → ``DECODER`` with ``window_left = W − 1``; full →
    ``ENCODER_ONLY``) and the reference ``z-lab/dflash`` ``_attention_mask`` (``q − key < W``).
    The query is block position ``k`` at position ``a + k``; the keys are the context positions
    ``j < a`` of its own conversation and its own block's tokens at positions ``a + k'``.
    """
    q_pos = a + k
    if not key_is_block:
        if not same_doc or key_pos >= a:
            return False
    elif not a <= key_pos < a + block_size:
        return False
    if window is None:               # full_attention: non-causal, no window
        return True
    return key_pos <= q_pos and q_pos - key_pos < window  # sliding: causal, window counts the query


def loop_mask(anchors: torch.Tensor, keep: torch.Tensor, doc_ids: torch.Tensor, bs: int,
              window: int | None) -> torch.Tensor:
    """Dense ``[R, 1, A·B, S + A·B]`` mask from :func:`engine_visible`, one (query, key) at a time.

    A dropped block sees its own block only (same rule, no context)."""
    r, s = doc_ids.shape
    na = anchors.shape[1]
    out = torch.zeros(r, 1, na * bs, s + na * bs, dtype=torch.bool)
    for row in range(r):
        for i in range(na):
            a = int(anchors[row, i])
            kept = bool(keep[row, i])
            for k in range(bs):
                q = i * bs + k
                for j in range(s):
                    same = kept and bool(doc_ids[row, j] == doc_ids[row, a])
                    out[row, 0, q, j] = engine_visible(a, k, j, False, same, window, bs)
                for k2 in range(bs):
                    out[row, 0, q, s + i * bs + k2] = engine_visible(a, k, a + k2, True, True, window, bs)
    return out


def test_issue_small_case() -> None:
    """B = 4, anchor 10, W = 6: block position 2 sees context [7, 8, 9] and block keys [0, 1, 2]."""
    s, bs = 16, 4
    doc_ids = torch.ones(1, s, dtype=torch.int32)
    anchors, keep = torch.tensor([[10]]), torch.tensor([[True]])
    sliding = dense_attention_mask(anchors, keep, doc_ids, bs, 6)[0, 0, 2]
    assert torch.nonzero(sliding[:s]).flatten().tolist() == [7, 8, 9]
    assert torch.nonzero(sliding[s:]).flatten().tolist() == [0, 1, 2]
    full = dense_attention_mask(anchors, keep, doc_ids, bs, None)[0, 0, 2]
    assert torch.nonzero(full[:s]).flatten().tolist() == list(range(10))
    assert torch.nonzero(full[s:]).flatten().tolist() == [0, 1, 2, 3]


def flex_effective_mask(block_mask, q_len: int, kv_len: int, r: int) -> torch.Tensor:
    """``[R, Q, K]`` what flex_attention lets through: full tiles entirely, partial tiles where
    ``mask_mod`` says so, every other tile nothing."""
    tile = block_mask.BLOCK_SIZE[0]
    n_q, n_kv = -(-q_len // tile), -(-kv_len // tile)
    partial = torch.zeros(r, n_q, n_kv, dtype=torch.bool)
    full = torch.zeros(r, n_q, n_kv, dtype=torch.bool)
    for row in range(r):
        for t in range(n_q):
            for c in block_mask.kv_indices[row, 0, t, :int(block_mask.kv_num_blocks[row, 0, t])].tolist():
                partial[row, t, c] = True
            for c in block_mask.full_kv_indices[row, 0, t, :int(block_mask.full_kv_num_blocks[row, 0, t])].tolist():
                full[row, t, c] = True
    expand = lambda x: x.repeat_interleave(tile, 1).repeat_interleave(tile, 2)[:, :q_len, :kv_len]
    b = torch.arange(r).view(r, 1, 1)
    q = torch.arange(q_len).view(1, q_len, 1)
    kv = torch.arange(kv_len).view(1, 1, kv_len)
    mod = block_mask.mask_mod(b, torch.zeros(1, 1, 1, dtype=torch.long), q, kv)
    return expand(full) | (expand(partial) & mod)


def engine_cases():
    """(batch, anchors, keep) with anchors near the row start, right after doc boundaries, and dropped."""
    for seed, bs, s in ((0, 4, 30), (1, 16, 45)):
        b = packed_batch(r=2, s=s, seed=seed)
        doc = b["doc_ids"]
        starts = [[p for p in range(s) if doc[row, p] > 0 and (p == 0 or doc[row, p] != doc[row, p - 1])]
                  for row in range(2)]
        rows = []
        for row in range(2):
            first_doc_end = starts[row][1]
            picks = [0, 1, 2, starts[row][1], starts[row][1] + 1, starts[row][-1] + 1, first_doc_end - 1, s - 3]
            rows.append(sorted(picks))
        anchors = torch.tensor(rows)
        keep = torch.ones_like(anchors, dtype=torch.bool)
        keep[1, 3] = False
        yield b, anchors, keep, bs


@pytest.mark.parametrize("window", [None, 1, 3, 6, 20, 100])
def test_masks_follow_the_engine_rule(window: int | None) -> None:
    """Dense mask, flex BlockMask (tiles + mask_mod) and block-sparse tiles == the engines' per-query
    rule: B = 4 and 16, windows below B, inside and beyond the context, anchors at the row start and
    at doc boundaries of packed rows, a dropped block."""
    for b, anchors, keep, bs in engine_cases():
        doc = b["doc_ids"]
        ref = loop_mask(anchors, keep, doc, bs, window)
        assert ref.any(-1).all()  # no fully masked query row
        dense = dense_attention_mask(anchors, keep, doc, bs, window)
        assert torch.equal(dense, ref)
        r, _, q_len, kv_len = ref.shape
        for tile in (8, 16, 128):
            block_mask = flex_block_mask(anchors, keep, doc, bs, window, tile=tile)
            assert torch.equal(flex_effective_mask(block_mask, q_len, kv_len, r), ref[:, 0]), (window, bs, tile)
            partial, full = mask_tiles(anchors, keep, doc, bs, window, tile)
            n_q, n_kv = partial.shape[1:]
            padded = torch.zeros(r, n_q * tile, n_kv * tile, dtype=torch.bool)
            padded[:, :q_len, :kv_len] = ref[:, 0]
            any_visible = padded.view(r, n_q, tile, n_kv, tile).any(-1).any(2)
            assert ((partial | full) >= any_visible).all()


@pytest.mark.parametrize("window", [None, 4])
def test_dense_mask_equals_loop(window: int | None) -> None:
    b = packed_batch(r=2, s=30)
    anchors, keep = sample_anchors(b["loss_mask"], b["doc_ids"], 6, anchor_generator(0, 0, 2))
    keep[1, 0] = False
    bs = 3
    mask = dense_attention_mask(anchors, keep, b["doc_ids"], bs, window)
    assert mask.shape == (2, 1, 18, 30 + 18) and mask.dtype == torch.bool
    assert torch.equal(mask, loop_mask(anchors, keep, b["doc_ids"], bs, window))
    assert mask.any(-1).all()  # no fully masked query row


def test_build_attention_masks_per_layer_type() -> None:
    b = packed_batch(r=2, s=30)
    anchors, keep = sample_anchors(b["loss_mask"], b["doc_ids"], 5, anchor_generator(0, 0, 3))
    masks = build_attention_masks(anchors, keep, b["doc_ids"], 4, [SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION],
                                  3, backend="sdpa")
    assert set(masks) == {FULL_ATTENTION, SLIDING_ATTENTION}
    assert torch.equal(masks[SLIDING_ATTENTION], loop_mask(anchors, keep, b["doc_ids"], 4, 3))
    assert torch.equal(masks[FULL_ATTENTION], loop_mask(anchors, keep, b["doc_ids"], 4, None))
    with pytest.raises(ValueError):
        build_attention_masks(anchors, keep, b["doc_ids"], 4, ["linear_attention"], 3, backend="sdpa")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [None, 5])
def test_flex_block_mask_matches_dense(window: int | None) -> None:
    """flex_attention (eager on CPU) with the BlockMask == SDPA with the dense mask."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    b = packed_batch(r=2, s=37)
    bs = 4
    anchors, keep = sample_anchors(b["loss_mask"], b["doc_ids"], 7, anchor_generator(0, 0, 4))
    keep[0, -1] = False
    g = torch.Generator().manual_seed(0)
    q_len, kv_len = 7 * bs, 37 + 7 * bs
    q = torch.randn(2, 4, q_len, 8, generator=g)
    k = torch.randn(2, 2, kv_len, 8, generator=g)
    v = torch.randn(2, 2, kv_len, 8, generator=g)
    dense = dense_attention_mask(anchors, keep, b["doc_ids"], bs, window)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    for tile in (16, 128):  # several tiles, and one tile larger than the whole query length
        block_mask = flex_block_mask(anchors, keep, b["doc_ids"], bs, window, tile=tile)
        out = flex.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
        assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_restaged_block_mask_keeps_addresses_and_meaning() -> None:
    """Two batches' BlockMasks restaged into the same buffers: every tensor (index tensors and the
    mask_mod's context ranges) at the same address for both, and attention unchanged (== dense)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    buffers: dict = {}

    def stage(name, x):
        buf = buffers.setdefault(name, torch.empty_like(x))
        return buf.copy_(x)

    bs, a, s = 4, 7, 37
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, a * bs, 8, generator=g)
    k = torch.randn(2, 2, s + a * bs, 8, generator=g)
    v = torch.randn(2, 2, s + a * bs, 8, generator=g)
    addresses = []
    for seed in (0, 1):
        b = packed_batch(r=2, s=s, seed=seed)
        anchors, keep = sample_anchors(b["loss_mask"], b["doc_ids"], a, anchor_generator(0, 0, seed))
        mask = restage_attention_mask(flex_block_mask(anchors, keep, b["doc_ids"], bs, None, tile=16), stage, "full")
        tensors = {n: x for n, x in vars(mask).items() if isinstance(x, torch.Tensor)}
        closure = [c.cell_contents for c in mask.mask_mod.__closure__ if isinstance(c.cell_contents, torch.Tensor)]
        assert len(tensors) == 8 and len(closure) == 2  # kv/q (full) num + indices; lo, hi
        assert all(any(x is buf for buf in buffers.values()) for x in [*tensors.values(), *closure])
        addresses.append(sorted(x.data_ptr() for x in [*tensors.values(), *closure]))
        dense = dense_attention_mask(anchors, keep, b["doc_ids"], bs, None)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
        out = flex.flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
        assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert addresses[0] == addresses[1] and len(buffers) == 10
    dense = dense_attention_mask(anchors, keep, b["doc_ids"], bs, None)
    assert restage_attention_mask(dense, stage, "full") is buffers[("full", "dense")]


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("bs", [4, 5])
def test_mask_tiles_cover_the_dense_mask(window: int | None, bs: int) -> None:
    """Sparse tiles hold every visible entry; full tiles are exactly the all-visible context tiles."""
    b = packed_batch(r=3, s=70, seed=3)
    anchors, keep = sample_anchors(b["loss_mask"], b["doc_ids"], 9, anchor_generator(0, 0, 5))
    keep[2, 0] = False
    tile = 8
    dense = dense_attention_mask(anchors, keep, b["doc_ids"], bs, window)[:, 0]  # [R, Q, K]
    r, q_len, kv_len = dense.shape
    n_q, n_kv = -(-q_len // tile), -(-kv_len // tile)
    padded = torch.zeros(r, n_q * tile, n_kv * tile, dtype=torch.bool)
    padded[:, :q_len, :kv_len] = dense
    real = torch.zeros_like(padded)
    real[:, :q_len, :kv_len] = True
    tiles = padded.view(r, n_q, tile, n_kv, tile)
    dense_any = tiles.any(-1).any(2)
    dense_all = (tiles | ~real.view(r, n_q, tile, n_kv, tile)).all(-1).all(2) & dense_any
    partial, full = mask_tiles(anchors, keep, b["doc_ids"], bs, window, tile)
    assert partial.shape == full.shape == (r, n_q, n_kv)
    assert not (partial & full).any()
    assert ((partial | full) >= dense_any).all()            # no visible entry is skipped
    context_tile = (torch.arange(n_kv) + 1) * tile <= 70
    assert torch.equal(full, dense_all & context_tile)       # full tiles skip mask_mod: exact
    assert partial.sum() < 1.5 * (dense_any & ~full).sum()  # and the superset is tight
    assert full.any() or window is not None                # (a window of 6 < tile holds no full tile)


# --------------------------------------------------------------------------- loss, accuracy, τ


def test_slot_weights() -> None:
    w = slot_weights(16, default_gamma(16))
    assert w[0] == 0 and w[1] == 1
    assert torch.allclose(w[1:], torch.exp(-torch.arange(15, dtype=torch.float32) / 7.0))
    with pytest.raises(ValueError):
        slot_weights(4, 0.0)


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
    assert out.per_slot_count.tolist() == valid.float().sum((0, 1)).tolist()


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
    if alpha == 1.0:  # q̃ = 1: w_k = the number of valid slots at or after k
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
    valid[0, 2] = False  # a block without a valid slot does not count
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
    assert torch.equal(out.tau_sum, decay.tau_sum) and torch.equal(out.per_slot_correct, decay.per_slot_correct)
    assert not torch.allclose(out.loss, decay.loss)
    with pytest.raises(ValueError, match="weighting"):
        dflash_loss(hidden, head, labels, valid, 2.0, weighting="focal")


def test_compiled_loss_chunks_equal_the_loop_and_compile_once_per_shape() -> None:
    """The compiled LM-head chunk (what a compiled trainer uses) against the naive loop.

    Chunks of 8 rows over 2·5·5 = 50 rows: six full chunks (one shape, different offsets into
    the hidden states) and one of 2 rows: two compilations, none for the second call.
    """
    from dflash.compile_watch import compile_counts
    from dflash.training.objective import compiled_linear_ce_chunk

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
        assert torch.equal(out.per_slot_correct, eager.per_slot_correct)
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


def test_tau_and_per_slot_accuracy_by_hand() -> None:
    """Two blocks of B = 5 with a hand-picked head, so the argmax of slot k is known."""
    v, d = 6, 6
    head = nn.Linear(d, v, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(v))
    # Slot predictions (argmax = one-hot position of the hidden state):
    preds = torch.tensor([[[0, 1, 2, 3, 4],     # block 0
                           [0, 5, 5, 1, 1]]])   # block 1
    labels = torch.tensor([[[0, 1, 2, 0, 4],    # block 0: slots 1, 2 right, 3 wrong, 4 right
                            [0, 5, 4, 1, 0]]])  # block 1: slot 1 right, 2 wrong, 3 right, 4 invalid
    valid = torch.tensor([[[False, True, True, True, True],
                           [False, True, True, True, False]]])
    hidden = F.one_hot(preds, v).float() * 5.0
    out = dflash_loss(hidden, head, labels, valid, 3.0)
    # τ: block 0 = 1 + 2 (stops at the wrong slot 3); block 1 = 1 + 1.
    assert out.tau_sum.item() == 5.0 and out.num_blocks.item() == 2.0
    assert out.tau.item() == 2.5
    assert out.per_slot_correct.tolist() == [0.0, 2.0, 1.0, 1.0, 1.0]
    assert out.per_slot_count.tolist() == [0.0, 2.0, 2.0, 2.0, 1.0]
    assert out.per_slot_accuracy.tolist() == [0.0, 1.0, 0.5, 0.5, 1.0]
    # A block stops at its first invalid slot even if later ones are right.
    correct = torch.ones(1, 1, 5, dtype=torch.bool)
    stop = torch.tensor([[[False, True, False, True, True]]])
    assert acceptance_lengths(correct, stop).tolist() == [[2.0]]


def test_loss_output_stats_vector_round_trip() -> None:
    out = LossOutput(loss_sum=torch.tensor(3.5), weight_sum=torch.tensor(2.0), per_slot_correct=torch.tensor([0., 1., 2.]),
                     per_slot_count=torch.tensor([0., 2., 4.]), tau_sum=torch.tensor(6.0), num_blocks=torch.tensor(4.0))
    vec = out.stats_vector() + out.stats_vector()   # two ranks, all-reduce SUM
    both = LossOutput.from_stats_vector(vec)
    assert both.loss.item() == 1.75 and both.tau.item() == 1.5
    assert both.per_slot_accuracy.tolist() == [0.0, 0.5, 0.5]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 6, 100])
@pytest.mark.parametrize("bs", [4, 16])
def test_compiled_flex_matches_dense_on_gpu(window: int | None, bs: int) -> None:
    """On CUDA, compiled flex_attention with our BlockMask == SDPA with the dense mask (engines' rule)."""
    from dflash.models.drafter_layers import _flex_attention

    b = {k: v.cuda() for k, v in packed_batch(r=2, s=300, seed=4).items()}
    anchors, keep = sample_anchors(b["loss_mask"], b["doc_ids"], 24, anchor_generator(0, 0, 7, "cuda"))
    keep[1, -1] = False
    g = torch.Generator(device="cuda").manual_seed(0)
    q_len, kv_len = 24 * bs, 300 + 24 * bs
    q = torch.randn(2, 4, q_len, 32, generator=g, device="cuda")
    k = torch.randn(2, 2, kv_len, 32, generator=g, device="cuda")
    v = torch.randn(2, 2, kv_len, 32, generator=g, device="cuda")
    dense = dense_attention_mask(anchors, keep, b["doc_ids"], bs, window)
    assert torch.equal(dense.cpu(), loop_mask(anchors.cpu(), keep.cpu(), b["doc_ids"].cpu(), bs, window))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    block_mask = flex_block_mask(anchors, keep, b["doc_ids"], bs, window)
    out = _flex_attention(q, k, v, block_mask, 32 ** -0.5, True)
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-4)
