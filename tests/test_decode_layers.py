"""The fused decoder layers of static-cache decoding (dflash/inference/decode_layers.py) against the
transformers layers they replace: same tokens, top-2 logits and context features in fp32, for
Llama, Qwen2 (projection biases), Qwen3 (q/k norms), Qwen3 with sliding-window layers and Mistral
(a window on every layer, no ``layer_types``), and against the naive full-forward greedy loop."""

from __future__ import annotations

import pytest
import torch
import transformers

from dflash.inference.decode_layers import FLEX_KV_BLOCK, fusable, fuse_layers, split_attention
from dflash.inference.decode_steps import CACHE_ALIGN, compile_options
from dflash.inference.generation import Generator
from dflash.inference.oracle import naive_greedy_decode

SMALL = dict(vocab_size=257, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=6,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=512)


def _model(kind: str, **shape) -> torch.nn.Module:
    torch.manual_seed({"llama": 0, "qwen2": 1, "qwen3": 2, "qwen3-sliding": 3, "mistral": 4}[kind])
    small = {**SMALL, **shape}
    if kind == "llama":
        cfg = transformers.LlamaConfig(**small)
    elif kind == "mistral":  # a window on every layer, without layer_types
        cfg = transformers.MistralConfig(**small, sliding_window=5)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**small)
    else:
        extra = {}
        if kind == "qwen3-sliding":
            extra = dict(layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=5,
                         use_sliding_window=True)
        cfg = transformers.Qwen3Config(**small, **extra)
    cfg._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    # Random, not-small biases and norm weights, so that each term of the layer matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
    return model


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("attention", ["matmul", "sdpa", "flex", "reduce", "flex+sdpa", "matmul+flex", "reduce+sdpa"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3-sliding", "mistral"])
def test_fused_decoding_equals_transformers_layers_and_naive(kind, attention):
    model = _model(kind)
    layer_ids = [0, 2, 3]
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 257, (n,), generator=g) for n in (1, 6, 19)]
    naive = [naive_greedy_decode(model, p, 12) for p in prompts]
    plain = Generator(model, layer_ids, 64, batch_size=3, fuse=False, compile=False)
    ref = plain.greedy(prompts, 12)
    fused = Generator(model, layer_ids, 64, batch_size=3, compile=False, attention=attention)
    assert fused.fused is not None
    out = fused.greedy(prompts, 12)
    for r, f, n in zip(ref, out, naive):
        assert f.tokens == r.tokens == n
        torch.testing.assert_close(torch.tensor(f.top2), torch.tensor(r.top2), rtol=1e-5, atol=1e-5)
    # The B-token verification forward of both paths: logits and context features of every position.
    pos = torch.arange(5, 9).expand(3, 4)
    ids = torch.randint(0, 257, (3, 4), generator=g)
    v1, i1, f1 = plain.forward(ids, pos)
    v2, i2, f2 = fused.forward(ids, pos)
    torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(f2, f1, rtol=1e-5, atol=1e-5)
    assert torch.equal(i1[..., 0], i2[..., 0])


def test_split_attention():
    assert split_attention("sdpa") == ("sdpa", "sdpa")
    assert split_attention("flex+sdpa") == ("flex", "sdpa")
    for bad in ("cudnn", "flex+", "flex+sdpa+matmul", "+sdpa"):
        with pytest.raises(ValueError, match="attention"):
            split_attention(bad)
    with pytest.raises(ValueError, match="attention"):
        Generator(_model("llama"), [0], 32, compile=False, attention="sdpa+bogus")


def test_mixed_attention_uses_each_part_where_it_belongs(monkeypatch):
    """``"X+Y"``: the one-token step runs X, verification Y, the prefill its causal attention over the
    prompt's own keys (recorded per call)."""
    import dflash.inference.decode_layers as dl

    model = _model("qwen3")
    seen = []
    real = dl.FusedDecoderLayer.forward

    def spy(self, *args, **kwargs):
        seen.append((args[0].shape[1], kwargs.get("attention", args[9] if len(args) > 9 else None)))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(dl.FusedDecoderLayer, "forward", spy)
    proposer, _ = _oracle(model, [torch.arange(5)], 4, 64, 4)
    gen = Generator(model, [1, 3], 64, batch_size=1, drafter=proposer, compile=False, attention="matmul+flex")
    gen.greedy([torch.arange(5)], 3)
    gen.speculative([torch.arange(5)], 6)
    assert {a for t, a in seen if t == 1} == {"matmul"}
    assert {a for t, a in seen if t == 4} == {"flex"}  # verification of a block of 4
    assert {a for t, a in seen if t == 5} == {"causal"}  # the prefill of the 5-token prompt


def test_fused_weights_are_views_and_model_forward_is_unchanged():
    model = _model("qwen3")
    ids = torch.randint(0, 257, (2, 9))
    before = model(input_ids=ids).logits
    layers = fuse_layers(model.model.layers, model.config)
    attn = model.model.layers[1].self_attn
    assert attn.k_proj.weight.data_ptr() == layers[1].wqkv[attn.q_proj.out_features:].data_ptr()
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)
    again = fuse_layers(model.model.layers, model.config, attention="matmul")  # a second decoder
    assert again[1].wqkv is layers[1].wqkv and again[1].w_gate_up is layers[1].w_gate_up
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)


def test_a_model_cast_after_fusing_is_fused_again():
    """Fused, then cast to bf16 (``.to`` gives the linears new tensors): the next decoder fuses the
    bf16 weights again (not the stale fp32 tensors), and decodes what a decoder of a model cast
    before fusing decodes."""
    model = _model("qwen3")
    fresh = _model("qwen3").to(torch.bfloat16)
    first = fuse_layers(model.model.layers, model.config)
    model.to(torch.bfloat16)
    again = fuse_layers(model.model.layers, model.config)
    assert again[1].wqkv is not first[1].wqkv and again[1].wqkv.dtype == torch.bfloat16
    attn = model.model.layers[1].self_attn
    assert attn.q_proj.weight.data_ptr() == again[1].wqkv.data_ptr()
    prompts = [torch.randint(0, 257, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 11)]
    want = Generator(fresh, [], 64, batch_size=2, compile=False).greedy(prompts, 12)
    got = Generator(model, [], 64, batch_size=2, compile=False).greedy(prompts, 12)
    assert [g.tokens for g in got] == [w.tokens for w in want]


def test_unsupported_layers_fall_back():
    model = _model("llama")
    layer = model.model.layers[0]
    assert fusable(layer, model.config) is None
    del layer.mlp.gate_proj
    assert "MLP" in fusable(layer, model.config)
    assert fuse_layers(model.model.layers, model.config) is None
    model.config.attn_logit_softcapping = 50.0
    assert "softcapping" in fusable(model.model.layers[1], model.config)


# --------------------------------------------------------------------------- flex attention


def _naive_attention(q, k, v, positions, scale, window):
    """Softmax attention one query row, one key at a time: row ``j·T + t`` of ``q [b, H_kv, g·T, hd]``
    is token ``t`` at ``positions[b, t]``; it reads slots ``k ≤ p`` (and ``p − k < window``)."""
    b, h, rows, hd = q.shape
    t = positions.shape[1]
    out = torch.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            for r in range(rows):
                p = int(positions[bi, r % t])
                slots = [j for j in range(k.shape[2]) if j <= p and (window is None or p - j < window)]
                scores = torch.stack([(q[bi, hi, r] * k[bi, hi, j]).sum() * scale for j in slots])
                w = torch.softmax(scores, dim=0)
                out[bi, hi, r] = sum(w[i] * v[bi, hi, j] for i, j in enumerate(slots))
    return out


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("tokens", [1, 4])
def test_flex_score_mod_equals_naive_attention(tokens, window):
    """The score_mod rule over the folded query layout, rows at different cache fill levels (the
    slots past a row's positions hold stale values that must not be read)."""
    from torch.nn.attention.flex_attention import flex_attention

    from dflash.inference.decode_layers import decode_score_mod

    g = torch.Generator().manual_seed(11)
    b, kv_heads, group, hd, t_max = 3, 2, 3, 8, 24
    q = torch.randn(b, kv_heads, group * tokens, hd, generator=g)
    k, v = torch.randn(2, b, kv_heads, t_max, hd, generator=g)
    starts = torch.tensor([0, 7, t_max - tokens])  # empty cache, partly filled, full
    positions = starts[:, None] + torch.arange(tokens)
    with torch.no_grad():
        got = flex_attention(q, k, v, score_mod=decode_score_mod(positions, window), scale=0.3)
    torch.testing.assert_close(got, _naive_attention(q, k, v, positions, 0.3, window), rtol=1e-5, atol=1e-5)


class _OracleProposer:
    """Drafts each row's true greedy continuation (``truth [b, T_max]``) with the drafts from block
    position ``right[anchor] + 1`` on corrupted (``right``: random in ``0 … B − 1`` per position), so
    passes accept anywhere from 0 to B − 1 drafts."""

    def __init__(self, truth: torch.Tensor, block_size: int, vocab: int) -> None:
        self.truth, self.block_size, self.vocab = truth, block_size, vocab
        self.right = torch.randint(0, block_size, (truth.shape[1],), generator=torch.Generator().manual_seed(3))

    def __call__(self, tokens, features, anchor):
        offsets = torch.arange(1, self.block_size, device=anchor.device)
        at = torch.clamp(anchor[:, None] + offsets, max=self.truth.shape[1] - 1)
        drafts = self.truth.gather(1, at)
        wrong = offsets > self.right[anchor][:, None]
        return torch.where(wrong, (drafts + 1) % self.vocab, drafts)


def _oracle(model, prompts, n, max_len, block_size):
    truth = torch.zeros(len(prompts), max_len, dtype=torch.long)
    refs = []
    for r, p in enumerate(prompts):
        ref = naive_greedy_decode(model, p, n)
        seq = torch.cat([p, torch.tensor(ref)])
        truth[r, :seq.numel()] = seq
        refs.append(ref)
    return _OracleProposer(truth, block_size, SMALL["vocab_size"]), refs


def test_odd_cache_length_rounds_up_to_aligned_slots():
    """A decoder asked for an odd ``T_max`` gets whole multiples of CACHE_ALIGN slots (its state and
    cache too), with the room of all of them: 15 prompt + 20 new + B 4 + 1 = 40 slots, more than the
    37 asked for; its target-only and speculative decoding (matmul attention in verification) give
    the naive loop's tokens."""
    model = _model("llama")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 257, (n,), generator=g) for n in (15, 9)]
    proposer, refs = _oracle(model, prompts, 20, 48, 4)
    gen = Generator(model, [1, 3], 37, batch_size=2, drafter=proposer, compile=False, attention="reduce+matmul")
    assert gen.max_len == -(-37 // CACHE_ALIGN) * CACHE_ALIGN == 40
    assert gen.state.tokens.shape[1] == gen.max_len and gen.state.kv.keys[0].shape[2] == gen.max_len
    outs = gen.greedy(prompts, 20) + gen.speculative(prompts, 20)
    for out, ref in zip(outs, refs * 2):
        assert out.tokens == ref
    assert {a for o in outs[2:] for a in o.accepted} >= {1, 2, 3, 4}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3-sliding"])
def test_flex_decoding_equals_sdpa_and_naive(kind):
    """Target-only and speculative greedy decoding with flex attention give sdpa's tokens, top-2
    logits and acceptance (fp32), and the naive full-forward loop's tokens; the B-token
    verification forward agrees at several cache fill levels (every row at its own)."""
    model = _model(kind)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 257, (n,), generator=g) for n in (2, 9, 23)]
    proposer, refs = _oracle(model, prompts, 14, 72, 4)
    outs = {}
    for attention in ("sdpa", "flex"):
        gen = Generator(model, [1, 3], 72, batch_size=3, drafter=proposer, compile=False, attention=attention)
        outs[attention] = gen.greedy(prompts, 14) + gen.speculative(prompts, 14)
        for start in (0, 5, 31, 72 - 4):
            pos = torch.clamp(torch.arange(3)[:, None] * 11 + start + torch.arange(4), max=71)
            ids = torch.randint(0, 257, (3, 4), generator=torch.Generator().manual_seed(start))
            outs[attention, start] = gen.forward(ids, pos)
    for got, want, ref in zip(outs["flex"], outs["sdpa"], refs * 2):
        assert got.tokens == want.tokens == ref
        assert (got.accepted, got.anchors) == (want.accepted, want.anchors)
        torch.testing.assert_close(torch.tensor(got.top2), torch.tensor(want.top2), rtol=1e-5, atol=1e-5)
    assert {a for o in outs["flex"][3:] for a in o.accepted} >= {1, 2, 3, 4}
    for start in (0, 5, 31, 72 - 4):
        (v1, i1, f1), (v2, i2, f2) = outs["sdpa", start], outs["flex", start]
        torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(f2, f1, rtol=1e-5, atol=1e-5)
        assert torch.equal(i1[..., 0], i2[..., 0])


def _traced_steps(gen, backend, steps):
    """Compile ``steps`` (``_greedy_step``, ``_verify_step``) as one graph each (``fullgraph``: a
    graph break would fail here, and under CUDA graphs would split the replay)."""
    for name in steps:
        setattr(gen, name, torch.compile(getattr(gen, name + "_impl"), backend=backend, fullgraph=True,
                                         dynamic=False))


def _compiled_flex_equals_eager(kind, backend, steps=("_greedy_step", "_verify_step")):
    import torch._dynamo

    model = _model(kind)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 257, (n,), generator=g) for n in (3, 17)]
    proposer, refs = _oracle(model, prompts, 12, 64, 4)
    eager = Generator(model, [1, 3], 64, batch_size=2, drafter=proposer, compile=False, attention="flex")
    want = eager.greedy(prompts, 12) + eager.speculative(prompts, 12)
    torch._dynamo.reset()
    try:
        gen = Generator(model, [1, 3], 64, batch_size=2, drafter=proposer, compile=False, attention="flex")
        _traced_steps(gen, backend, steps)
        got = gen.greedy(prompts, 12) + gen.speculative(prompts, 12)
        with torch._dynamo.config.patch(error_on_recompile=True):  # other prompts and fill levels: same graphs
            gen.greedy(prompts[::-1], 7)
            gen.speculative(prompts[:1], 9)
    finally:
        torch._dynamo.reset()
    for a, b, ref in zip(got, want, refs * 2):
        assert a.tokens == b.tokens == ref
        assert (a.accepted, a.anchors) == (b.accepted, b.anchors)
        torch.testing.assert_close(torch.tensor(a.top2), torch.tensor(b.top2), rtol=1e-5, atol=1e-5)


def test_flex_steps_trace_whole_and_decode_like_eager():
    """The flex steps trace into one graph each without recompiling per step (the functionalised
    graph, ``aot_eager``): what CUDA graphs need, checked on CPU."""
    _compiled_flex_equals_eager("qwen3-sliding", "aot_eager")


@pytest.mark.slow
def test_flex_greedy_step_inductor_on_cpu():
    """The target-only flex step through inductor (its C++ flex template) decodes like eager; ~40 s.
    The verification step is not compiled here: torch 2.13's CPU flex template fails to lower its
    query ("too many values to unpack" in ``cpp_flex_attention_template.choose_flex_template``);
    the GPU lowering is a different (Triton) template, checked by the GPU test below."""
    _compiled_flex_equals_eager("qwen3-sliding", "inductor", steps=("_greedy_step",))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex decoding kernels need a GPU")
def test_compiled_flex_equals_sdpa_on_gpu_bf16():
    """bf16 on CUDA, compiled (CUDA graphs): the flex step's top-2 logits and context features are
    as close to an fp32 SDPA reference as the SDPA step's, one-token steps and B-token verification
    at several fill levels; greedy tokens agree wherever the target's top-1/top-2 margin is not a
    near-tie.

    bf16 bound: relative Frobenius error ≤ 2.5e-2 and largest error ≤ 4·u·√(N+1)·max|ref|
    (u = 2⁻⁸, N = 4 layers). On this model (CPU, eager bf16) both attentions measure about 1 %
    relative error and up to 2 % of max|ref| in their features: rounding of features of magnitude ~4
    reaches 0.08, beyond a fixed elementwise tolerance between the two bf16 runs."""
    model = _model("qwen3-sliding", head_dim=16).to("cuda", torch.bfloat16)  # flex's CUDA minimum
    reference = _model("qwen3-sliding", head_dim=16).to("cuda")
    g = torch.Generator().manual_seed(10)
    prompts = [torch.randint(0, 257, (n,), generator=g) for n in (5, 30)]
    cases = ((1, 0), (1, 40), (4, 7), (16, 60))
    outs = {}
    for attention in ("sdpa", "flex", "fp32"):
        gen = (Generator(reference, [1, 3], 96, batch_size=2, compile=False, attention="sdpa") if attention == "fp32"
               else Generator(model, [1, 3], 96, batch_size=2, compile=True, attention=attention))
        if attention != "fp32":
            outs[attention] = gen.greedy(prompts, 24)
        if attention == "flex":  # whole key/value blocks for flex_attention's kernels
            assert gen.flex_kernels and gen.max_len == FLEX_KV_BLOCK, gen.max_len
        step = (gen.forward if attention == "fp32" else
                torch.compile(gen.forward, dynamic=False, **compile_options(attention == "flex", cudagraphs=False)))
        # the same 96-token history in every run's cache, whatever greedy decoding wrote there
        step(torch.randint(0, 257, (2, 96), generator=torch.Generator().manual_seed(11)).to(model.device),
             torch.arange(96, device=model.device).expand(2, 96))
        for t, start in cases:
            pos = torch.clamp(torch.arange(2)[:, None] * 13 + start + torch.arange(t), max=95).cuda()
            ids = torch.randint(0, 257, (2, t), generator=torch.Generator().manual_seed(start)).cuda()
            outs[attention, t, start] = step(ids, pos)
    bound = 4 * 2.0 ** -8 * 5 ** 0.5
    for t, start in cases:
        ref_v, _, ref_f = (x.float() for x in outs["fp32", t, start])
        for attention in ("sdpa", "flex"):
            v, _, f = (x.float() for x in outs[attention, t, start])
            for name, x, ref in (("top-2 logits", v, ref_v), ("features", f, ref_f)):
                rel = ((x - ref).norm() / ref.norm()).item()
                worst = (x - ref).abs().max().item()
                assert rel <= 2.5e-2 and worst <= bound * ref.abs().max().item(), (attention, t, start, name, rel, worst)
    for a, b in zip(outs["flex"], outs["sdpa"]):
        n = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
        if n is not None:  # a flip is only allowed at a near-tie of either run
            assert min(b.top2[n][0] - b.top2[n][1], a.top2[n][0] - a.top2[n][1]) < 5e-2, n
        m = len(a.tokens) if n is None else n
        torch.testing.assert_close(torch.tensor(a.top2[:m]), torch.tensor(b.top2[:m]), rtol=2e-2, atol=5e-2)


def test_default_attention_by_batch_size():
    """``reduce`` in the one-token step at batch 1 (where it was measured faster), SDPA above; an
    explicit spec wins."""
    from dflash.inference.decode_layers import ATTENTION, BATCH_ATTENTION, REDUCE_MAX_BATCH, default_attention

    model = _model("llama")
    for batch in (1, REDUCE_MAX_BATCH + 1, 16):
        want = ATTENTION if batch <= REDUCE_MAX_BATCH else BATCH_ATTENTION
        assert default_attention(batch) == want
        gen = Generator(model, [1], 32, batch_size=batch, compile=False)
        assert gen.attention == want
        assert (gen.step_attention, gen.block_attention) == split_attention(want)
    assert Generator(model, [1], 32, batch_size=4, compile=False, attention="reduce").attention == "reduce"


# --------------------------------------------------------------------------- causal prefill


def _naive_causal(q, k, v, scale, window):
    """Token ``t`` of ``q [b, T, H, hd]`` over the tokens ``j ≤ t`` (and ``t − j < window``) of
    ``k, v [b, T, H_kv, hd]``, one key at a time; query head ``h`` reads key/value head ``h // g``."""
    b, t, heads, hd = q.shape
    group = heads // k.shape[2]
    out = torch.zeros_like(q)
    for bi in range(b):
        for h in range(heads):
            for i in range(t):
                keys = [j for j in range(i + 1) if window is None or i - j < window]
                scores = torch.stack([(q[bi, i, h] * k[bi, j, h // group]).sum() * scale for j in keys])
                w = torch.softmax(scores, dim=0)
                out[bi, i, h] = sum(w[n] * v[bi, j, h // group] for n, j in enumerate(keys))
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_causal_prefill_attention_equals_naive(window):
    from dflash.inference.decode_layers import causal_prefill_attention

    g = torch.Generator().manual_seed(12)
    q = torch.randn(2, 7, 6, 8, generator=g)
    k, v = torch.randn(2, 2, 7, 2, 8, generator=g)
    got = causal_prefill_attention(q, k, v, 0.4, window)
    torch.testing.assert_close(got, _naive_causal(q, k, v, 0.4, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3-sliding", "mistral"])
def test_causal_prefill_equals_prefill_over_the_cache(kind, monkeypatch):
    """The fused layers' prefill (causal attention over the prompts' own keys, in chunks of a few
    rows) writes the keys/values, features, first tokens and logit stats of the prefill that
    attends over the whole masked cache (fp32), for right-padded prompts of different lengths."""
    from dflash.inference.decode_steps import DecodeSteps

    model = _model(kind)
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 257, (n,), generator=g) for n in (1, 6, 19, 11)]
    gens = {}
    for attention in ("causal", "matmul"):
        gen = Generator(model, [0, 2, 3], 48, batch_size=4, compile=False)
        gen.prefill_attention = attention
        monkeypatch.setattr(DecodeSteps, "PREFILL_CHUNK_TOKENS", 40)  # 2 rows of 19 a forward
        gens[attention] = (gen, gen.prefill(prompts))
    (causal, first_c), (cache, first_m) = gens["causal"], gens["matmul"]
    assert first_c == first_m
    for r, p in enumerate(prompts):
        n = p.numel()
        for layer in range(len(model.model.layers)):
            for buf in ("keys", "values"):
                got = getattr(causal.state.kv, buf)[layer][r, :, :n]
                want = getattr(cache.state.kv, buf)[layer][r, :, :n]
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(causal.state.features[r, :n], cache.state.features[r, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(causal.state.logit_stats[r, n], cache.state.logit_stats[r, n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["causal", "matmul"])
def test_prefill_in_forwards_of_similar_widths_equals_one_prompt_at_a_time(attention, monkeypatch):
    """A batch of mixed lengths goes longest first in forwards padded to their own longest prompt:
    each row's keys/values, features, first token and logit stats equal those of its prompt
    prefilled alone (fp32), and the forwards hold fewer padded positions than padding every
    prompt to the batch's longest would."""
    from dflash.inference.decode_steps import DecodeSteps

    model = _model("llama")
    g = torch.Generator().manual_seed(17)
    lengths = (1, 6, 19, 11, 3, 19, 8, 14)
    prompts = [torch.randint(0, 257, (n,), generator=g) for n in lengths]
    batch = Generator(model, [0, 2], 48, batch_size=len(prompts), compile=False)
    batch.prefill_attention = attention
    monkeypatch.setattr(DecodeSteps, "PREFILL_CHUNK_TOKENS", 40)  # 2 rows of 19, 3 of 14 or 11, ...
    monkeypatch.setattr(DecodeSteps, "PREFILL_CHUNK_ELEMENTS", 40 * batch.group * 48)
    shapes = []
    forward = batch._prefill_forward

    def counted(ids, *args, **kwargs):
        shapes.append(tuple(ids.shape))
        return forward(ids, *args, **kwargs)

    batch._prefill_forward = counted
    first = batch.prefill(prompts)
    assert [w for _, w in shapes] == sorted((w for _, w in shapes), reverse=True)
    assert sum(n * w for n, w in shapes) < len(lengths) * max(lengths)
    for r, p in enumerate(prompts):
        alone = Generator(model, [0, 2], 48, batch_size=1, compile=False)
        alone.prefill_attention = attention
        assert first[r] == alone.prefill([p])[0]
        n = p.numel()
        for layer in range(len(model.model.layers)):
            for buf in ("keys", "values"):
                torch.testing.assert_close(getattr(batch.state.kv, buf)[layer][r, :, :n],
                                           getattr(alone.state.kv, buf)[layer][0, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch.state.features[r, :n], alone.state.features[0, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch.state.logit_stats[r, n], alone.state.logit_stats[0, n], rtol=1e-5,
                                   atol=1e-5)
        assert int(batch.state.anchor[r]) == n and int(batch.state.tokens[r, n]) == first[r]


@pytest.mark.parametrize("query_rows", [1, 48, 128, 129, 288])
def test_decode_block_mask_covers_the_query_rows_in_one_aligned_block(query_rows):
    """One query block over all rows, its size a multiple of 128 (flex_attention's kernels refuse a
    query block that is not a multiple of their tile, e.g. 288 rows: a 96-token forward of 3 folded
    query heads); the key/value blocks are those up to each row's last position."""
    from dflash.inference.decode_layers import FLEX_KV_BLOCK, FLEX_Q_BLOCK, decode_block_mask

    positions = torch.tensor([[5], [FLEX_KV_BLOCK + 3], [3 * FLEX_KV_BLOCK - 1]])
    mask = decode_block_mask(positions, query_rows, 3 * FLEX_KV_BLOCK)
    q_block, kv_block = mask.BLOCK_SIZE
    assert q_block % FLEX_Q_BLOCK == 0 and query_rows <= q_block < query_rows + FLEX_Q_BLOCK
    assert kv_block == FLEX_KV_BLOCK
    assert mask.kv_num_blocks.view(-1).tolist() == [1, 2, 3]


def test_decode_block_mask_skips_only_blocks_past_each_row():
    """Compiled flex attention with :func:`decode_block_mask` equals the naive rule at three fill
    levels, and never reads the blocks past a row's positions: NaN values there (a block a kernel
    visited would turn into NaN, masked or not) leave the row finite; without the block mask they
    do not."""
    from torch.nn.attention.flex_attention import flex_attention

    from dflash.inference.decode_layers import FLEX_KV_BLOCK, decode_block_mask, decode_score_mod

    g = torch.Generator().manual_seed(11)
    b, kv_heads, group, hd, t_max, tokens = 3, 2, 3, 16, 300, 4
    q = torch.randn(b, kv_heads, group * tokens, hd, generator=g)
    k, v = torch.randn(2, b, kv_heads, t_max, hd, generator=g)
    starts = torch.tensor([0, FLEX_KV_BLOCK + 2, t_max - tokens])  # block 0, blocks 0-1, every block
    positions = starts[:, None] + torch.arange(tokens)
    want = _naive_attention(q, k, v, positions, 0.3, None)
    v[0, :, FLEX_KV_BLOCK:] = float("nan")

    def sparse(q, k, v, positions):
        mask = decode_block_mask(positions, q.shape[2], k.shape[2])
        return flex_attention(q, k, v, score_mod=decode_score_mod(positions), block_mask=mask, scale=0.3)

    def dense(q, k, v, positions):
        return flex_attention(q, k, v, score_mod=decode_score_mod(positions), scale=0.3)

    torch._dynamo.reset()
    try:
        got = torch.compile(sparse)(q, k, v, positions)
        visited = torch.compile(dense)(q, k, v, positions)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert visited[0].isnan().any()  # the check can fail: a kernel that visits the block sees the NaN


def test_compiled_flex_step_with_block_mask_equals_naive():
    """The one-token step compiled by inductor (CPU) with flex attention and its block mask: the
    naive loop's tokens for rows in the first block, and one that crosses into the second."""
    import torch._dynamo

    model = _model("qwen3")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 257, (n,), generator=g) for n in (1, 6, 122)]
    naive = [naive_greedy_decode(model, p, 12) for p in prompts]
    torch._dynamo.reset()
    try:
        gen = Generator(model, [], 300, batch_size=3, compile=True, attention="flex")
        out = gen.greedy(prompts, 12)
    finally:
        torch._dynamo.reset()
    assert [o.tokens for o in out] == naive


def test_layer_types_follow_what_each_model_applies():
    from dflash.models.target import layer_types_of

    assert layer_types_of(_model("mistral").config, 4) == ["sliding_attention"] * 4
    assert layer_types_of(_model("llama").config, 4) == ["full_attention"] * 4
    assert layer_types_of(_model("qwen3-sliding").config, 4) == ["sliding_attention", "full_attention"] * 2
    off = transformers.Qwen2Config(**SMALL, sliding_window=5, use_sliding_window=False)
    assert layer_types_of(off, 4) == ["full_attention"] * 4
    assert Generator(_model("mistral"), [], 32, compile=False).layer_types == ["sliding_attention"] * 4
