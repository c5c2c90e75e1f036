"""The drafter's attention masks (dflash/models/masks.py) against the engines' rule, written as loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash.models.masks import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    build_attention_masks,
    dense_attention_mask,
    flex_block_mask,
    mask_tiles,
    restage_attention_mask,
)
from dflash.training.anchors import anchor_generator, sample_anchors
from tests.test_objective import packed_batch


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 6, 100])
@pytest.mark.parametrize("bs", [4, 16])
def test_compiled_flex_matches_dense_on_gpu(window: int | None, bs: int) -> None:
    """On CUDA, compiled flex_attention with our BlockMask == SDPA with the dense mask (engines' rule)."""
    from dflash.models.modeling_dflash import _flex_attention

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
