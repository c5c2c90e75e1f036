"""Linear-attention (Gated-DeltaNet) layers over packed rows: each conversation exactly as alone.

References are slow and plain: the per-token recurrence in float64, one conversation at a time;
the convolution run on each conversation alone with ``F.conv1d``; transformers' own layers on a
row that holds one conversation (where nothing can leak).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash.config import ConfigError, TargetConfig, load_config
from dflash.models import linear_attention as la
from dflash.models.target_loader import load_target


def _assert_rel(got: torch.Tensor, ref: torch.Tensor, tol: float = 1e-5) -> None:
    """``||got - ref|| / ||ref|| < tol`` (float32 sums taken in another order differ by rounding)."""
    err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < tol, f"relative error {err:.3g} >= {tol:g}"


def _segments(lengths_per_row: list[list[int]], seq: int) -> torch.Tensor:
    """``[R, S]`` doc ids: the rows' conversations in order, then padding (0)."""
    doc = torch.zeros(len(lengths_per_row), seq, dtype=torch.int32)
    for r, lengths in enumerate(lengths_per_row):
        at = 0
        for i, n in enumerate(lengths):
            doc[r, at:at + n] = i + 1
            at += n
    return doc


def _naive_delta_rule(q, k, v, g, beta):
    """Per-token gated delta rule of one sequence, float64: q, k ``[T, H, dk]``, v ``[T, HV, dv]``."""
    rep = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(rep, 1).double(), k.repeat_interleave(rep, 1).double()
    v, g, beta = v.double(), g.double(), beta.double()
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    heads, d_k, d_v = v.shape[1], q.shape[-1], v.shape[-1]
    out = torch.zeros(v.shape, dtype=torch.float64)
    for h in range(heads):
        state = torch.zeros(d_k, d_v, dtype=torch.float64)
        for t in range(q.shape[0]):
            state = state * torch.exp(g[t, h])
            delta = beta[t, h] * (v[t, h] - state.T @ k[t, h])
            state = state + torch.outer(k[t, h], delta)
            out[t, h] = state.T @ q[t, h]
    return out


def _random_gdn_inputs(rows, seq, heads, v_heads, d_k, d_v, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, seq, heads, d_k, generator=gen)
    k = torch.randn(rows, seq, heads, d_k, generator=gen)
    v = torch.randn(rows, seq, v_heads, d_v, generator=gen)
    g = -torch.rand(rows, seq, v_heads, generator=gen) * 2.0  # decays e^g in (0.13, 1]
    beta = torch.rand(rows, seq, v_heads, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("chunk", [8, 16])
def test_chunked_delta_rule_equals_per_conversation_recurrence(chunk):
    # boundaries inside chunks, on chunk edges, a one-token conversation, padding, a row not a
    # multiple of the chunk size; value heads grouped over key heads (HV = 2 H)
    seq = 45
    lengths = [[7, 1, 16, 9], [24, 13], [45]]
    doc = _segments(lengths, seq)
    q, k, v, g, beta = _random_gdn_inputs(3, seq, 2, 4, 8, 6, seed=chunk)
    segments = la.conversation_starts(doc).cumsum(-1)
    got = la.chunk_gated_delta_rule(q, k, v, g, beta, segments, chunk_size=chunk)
    for r, row in enumerate(lengths):
        at = 0
        for n in row + [seq - sum(row)]:
            if n:
                ref = _naive_delta_rule(q[r, at:at + n], k[r, at:at + n], v[r, at:at + n], g[r, at:at + n],
                                        beta[r, at:at + n])
                torch.testing.assert_close(got[r, at:at + n].double(), ref, atol=2e-5, rtol=1e-4)
            at += n


def test_chunked_delta_rule_leaks_without_segments():
    """The reference has teeth: one segment id for the whole row changes the second conversation."""
    seq = 32
    doc = _segments([[12, 20]], seq)
    q, k, v, g, beta = _random_gdn_inputs(1, seq, 2, 2, 8, 8, seed=3)
    apart = la.chunk_gated_delta_rule(q, k, v, g, beta, la.conversation_starts(doc).cumsum(-1), chunk_size=8)
    mixed = la.chunk_gated_delta_rule(q, k, v, g, beta, torch.ones(1, seq, dtype=torch.long), chunk_size=8)
    torch.testing.assert_close(apart[:, :12], mixed[:, :12])
    assert (apart[:, 12:16] - mixed[:, 12:16]).abs().max() > 1e-2


def test_packed_causal_conv1d_equals_conv_per_conversation():
    seq, width, taps = 30, 5, 4
    lengths = [[2, 11, 1, 9], [30]]
    doc = _segments(lengths, seq)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, seq, width, generator=gen)
    weight = torch.randn(width, taps, generator=gen)
    bias = torch.randn(width, generator=gen)
    got = la.packed_causal_conv1d(x, weight, bias, la.conversation_starts(doc).cumsum(-1))
    for r, row in enumerate(lengths):
        at = 0
        for n in row + [seq - sum(row)]:
            if n:
                piece = x[r, at:at + n].T[None]  # [1, C, n]
                ref = F.conv1d(piece, weight[:, None], bias, padding=taps - 1, groups=width)[..., :n]
                torch.testing.assert_close(got[r, at:at + n], F.silu(ref)[0].T, atol=1e-6, rtol=1e-6)
            at += n


def _hybrid(scale: float = 1.0):
    """tiny-qwen3.6 with its linear-attention weights scaled up, so conversations visibly interact."""
    target = load_target(TargetConfig(kind="random", arch="tiny-qwen3.6", seed=5), "cpu")
    with torch.no_grad():
        for layer in target.model.model.layers:
            if hasattr(layer, "linear_attn"):
                for name in ("in_proj_qkv", "in_proj_z", "out_proj"):
                    getattr(layer.linear_attn, name).weight.mul_(scale)
                layer.linear_attn.conv1d.weight.mul_(scale)
    return target


def test_hybrid_target_one_conversation_equals_transformers():
    target = _hybrid(scale=8.0)
    seq = 70
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, target.vocab_size, (1, seq), generator=gen)
    pos = torch.arange(seq)[None]
    features, tokens = target.forward_features(ids, pos, torch.ones(1, seq, dtype=torch.int32))
    with torch.no_grad():
        out = target.model(input_ids=ids, position_ids=pos, output_hidden_states=True)
    width = target.hidden_size
    for slot, layer in enumerate(target.layer_ids):
        _assert_rel(features[..., slot * width:(slot + 1) * width], out.hidden_states[layer + 1])
    assert torch.equal(tokens, out.logits.argmax(-1))


def test_hybrid_target_packed_conversations_equal_each_alone():
    target = _hybrid(scale=8.0)
    seq, lengths = 96, [40, 1, 33]
    doc = _segments([lengths], seq)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, target.vocab_size, (1, seq), generator=gen)
    pos = torch.zeros(1, seq, dtype=torch.long)
    at = 0
    for n in lengths + [seq - sum(lengths)]:
        pos[0, at:at + n] = torch.arange(n)
        at += n
    packed, packed_tokens = target.forward_features(ids, pos, doc)
    at = 0
    for n in lengths:
        alone, alone_tokens = target.forward_features(ids[:, at:at + n], pos[:, at:at + n],
                                                      torch.ones(1, n, dtype=torch.int32))
        _assert_rel(packed[:, at:at + n], alone)
        assert torch.equal(packed_tokens[:, at:at + n], alone_tokens)
        at += n
    # transformers from position_ids alone mixes them: the third conversation's features differ
    with torch.no_grad():
        leaked = target.model(input_ids=ids, position_ids=pos, output_hidden_states=True).hidden_states
    start = lengths[0] + lengths[1]
    width, layer = target.hidden_size, target.layer_ids[0]
    ours = packed[:, start:start + 4, :width]
    assert (leaked[layer + 1][:, start:start + 4] - ours).abs().max() > 1e-3 * ours.abs().max()


def test_per_layer_compile_is_two_graphs_and_equal(monkeypatch):
    """One graph per layer kind for all 8 layers, no graph break, the eager values (dynamo only:
    the ``eager`` compile backend keeps the test fast; inductor is exercised on the GPU)."""
    from torch._dynamo.utils import counters

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend="eager", **kw))
    target = _hybrid(scale=4.0)
    seq = 48
    doc = _segments([[20, 28], [48]], seq)
    ids = torch.randint(0, target.vocab_size, (2, seq), generator=torch.Generator().manual_seed(6))
    pos = torch.cat([torch.arange(20), torch.arange(28)]).repeat(2, 1)
    pos[1] = torch.arange(seq)
    eager = target.forward_features(ids, pos, doc)
    torch._dynamo.reset()
    counters.clear()
    target.compile_layers()
    for _ in range(2):
        compiled = target.forward_features(ids, pos, doc)
    assert counters["stats"]["unique_graphs"] == 2
    assert not counters["graph_break"]
    torch.testing.assert_close(compiled[0], eager[0])
    assert torch.equal(compiled[1], eager[1])


def test_unsupported_layouts_and_backends_refused():
    with pytest.raises(TypeError, match=r"^layer 3: Linear is not a Gated-DeltaNet layer.*A_log"):
        la.check_gated_deltanet(torch.nn.Linear(2, 2), "layer 3")
    with pytest.raises(ValueError, match=r"^target\.linear_attention: fla runs on CUDA devices only"):
        la.resolve_backend("fla", "cpu")
    with pytest.raises(ValueError, match=r"^target\.linear_attention: must be one of"):
        la.resolve_backend("triton", "cpu")
    assert la.resolve_backend("auto", "cpu") == "torch"
    with pytest.raises(ConfigError, match=r"^target\.linear_attention: fla runs on CUDA devices only"):
        load_target(TargetConfig(kind="random", arch="tiny-qwen3.6", linear_attention="fla"), "cpu")


def test_fla_refused_in_config_on_cpu(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: x\ncluster: {device: cpu}\ntarget: {kind: random, arch: tiny-qwen3.6, "
                    "linear_attention: fla}\ndata: {dataset: sharegpt}\n")
    with pytest.raises(ConfigError, match=r"^target\.linear_attention"):
        load_config(path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not la.fla_available(), reason="needs flash-linear-attention")
def test_fla_backend_equals_torch_backend_on_gpu():
    """fla's varlen kernels and the torch path compute the same packed layer (bf16 inputs)."""
    seq, lengths = 300, [[130, 1, 100], [64, 200]]
    doc = _segments(lengths, seq).cuda()
    q, k, v, g, beta = (t.cuda() for t in _random_gdn_inputs(2, seq, 4, 8, 64, 64, seed=9))
    q, k, v, beta = (t.bfloat16() for t in (q, k, v, beta))
    starts = la.conversation_starts(doc)
    fla_out = la._fla_packed_gated_delta_rule(q, k, v, g.float(), beta, starts).float()
    ref = la.chunk_gated_delta_rule(q, k, v, g.float(), beta, starts.cumsum(-1)).float()
    assert (fla_out - ref).norm() / ref.norm() < 1e-2
    x = torch.randn(2, seq, 96, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(96, 4, device="cuda", dtype=torch.bfloat16)
    conv = la._fla_packed_conv1d(x, w, None, starts).float()
    ref = la.packed_causal_conv1d(x, w, None, starts.cumsum(-1)).float()
    assert (conv - ref).norm() / ref.norm() < 1e-2


#: tiny-qwen3.6 widened to linear-attention heads of 64 (the kernels' tiles) over sequences of
#: several of fla's 64-token chunks.
WIDE = dict(hidden_size=256, intermediate_size=512, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["torch", "fla"])
def test_packed_conversations_equal_each_alone_on_gpu_in_bf16(backend):
    """Every conversation of packed bf16 rows (first, middle, one token, shorter than the
    convolution, across chunk boundaries, then padding) equals that conversation alone in bf16.

    The tolerance is bf16's own: against the fp32 features of the conversation alone (the exact
    torch path), the packed features' relative error may be at most twice (+ 2e-3) the error of the
    same conversation alone in bf16, whose order is bf16's 2^-8 rounding carried through 8 layers.
    Transformers' own forward over the packed rows (the state runs on) is checked to miss that
    bound by a wide margin, so the bound tells a leak apart.
    """
    if backend == "fla" and not la.fla_available():
        pytest.skip("needs flash-linear-attention")
    ref = load_target(TargetConfig(kind="random", arch="tiny-qwen3.6", seed=5, linear_attention="torch",
                                   arch_overrides=WIDE), "cuda", torch.float32)
    with torch.no_grad():  # linear-attention weights scaled up, as in _hybrid: the state matters
        for layer in ref.model.model.layers:
            if hasattr(layer, "linear_attn"):
                for name in ("in_proj_qkv", "in_proj_z", "out_proj"):
                    getattr(layer.linear_attn, name).weight.mul_(4.0)
                layer.linear_attn.conv1d.weight.mul_(4.0)
    low = load_target(TargetConfig(kind="random", arch="tiny-qwen3.6", seed=5, linear_attention=backend,
                                   arch_overrides=WIDE), "cuda", torch.bfloat16)
    low.model.load_state_dict(ref.model.state_dict())  # the same weights, rounded to bf16
    seq, lengths = 512, [[150, 3, 1, 97, 200], [64, 128, 2, 70]]
    doc = _segments(lengths, seq).cuda()
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, ref.vocab_size, (len(lengths), seq), generator=gen).cuda()
    pos = torch.zeros_like(ids)
    for r, row in enumerate(lengths):
        at = 0
        for n in row + [seq - sum(row)]:
            pos[r, at:at + n] = torch.arange(n)
            at += n
    packed, _ = low.forward_features(ids, pos, doc)
    with torch.no_grad():
        leaked = low.model(input_ids=ids, position_ids=pos, output_hidden_states=True).hidden_states
    leaked = torch.cat([leaked[i + 1] for i in low.layer_ids], dim=-1)

    def rel(got, want):
        return ((got.double() - want.double()).norm() / want.double().norm()).item()

    worst_leak = 0.0
    for r, row in enumerate(lengths):
        at = 0
        for n in row:
            one = (slice(r, r + 1), slice(at, at + n))
            ones = torch.ones(1, n, dtype=torch.int32, device="cuda")
            exact, _ = ref.forward_features(ids[one], pos[one], ones)
            alone, _ = low.forward_features(ids[one], pos[one], ones)
            floor = rel(alone, exact)
            bound = 2 * floor + 2e-3
            err = rel(packed[one], exact)
            assert err <= bound, (backend, r, at, n, err, floor)
            if at > 0:
                worst_leak = max(worst_leak, rel(leaked[one], exact) / bound)
            at += n
    assert worst_leak > 5, worst_leak  # transformers from position_ids alone is far outside the bound


def test_target_worker_compile_scope():
    from types import SimpleNamespace

    from dflash.runtime.target import compile_scope

    hybrid_fla, hybrid_torch, dense = (SimpleNamespace(linear_attention=x) for x in ("fla", "torch", None))
    auto, forward, layer = (SimpleNamespace(compile_scope=x) for x in ("auto", "forward", "layer"))
    assert compile_scope(auto, hybrid_fla) == compile_scope(auto, hybrid_torch) == "layer"
    assert compile_scope(auto, dense) == compile_scope(forward, dense) == "forward"
    assert compile_scope(layer, dense) == "layer"
    assert compile_scope(forward, hybrid_torch) == "forward"
    with pytest.raises(ConfigError, match=r"^target\.compile_scope: forward captures CUDA graphs"):
        compile_scope(forward, hybrid_fla)


def test_layer_types_read_without_weights():
    from dflash.models.target_loader import target_layer_types

    types = target_layer_types(TargetConfig(kind="random", arch="tiny-qwen3.6"))
    assert types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert set(target_layer_types(TargetConfig(kind="random", arch="tiny-llama"))) == {"full_attention"}
