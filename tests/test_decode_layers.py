"""The fused decoder layers of static-cache decoding (dflash/inference/decode_layers.py) against the
transformers layers they replace: same tokens, top-2 logits and context features in fp32, for
Llama, Qwen2 (projection biases), Qwen3 (q/k norms) and Qwen3 with sliding-window layers, and
against the naive full-forward greedy loop."""

from __future__ import annotations

import pytest
import torch
import transformers

from dflash.inference.decode_layers import fusable, fuse_layers
from dflash.inference.generation import Generator
from dflash.inference.oracle import naive_greedy_decode

SMALL = dict(vocab_size=257, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=6,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=512)


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed({"llama": 0, "qwen2": 1, "qwen3": 2, "qwen3-sliding": 3}[kind])
    if kind == "llama":
        cfg = transformers.LlamaConfig(**SMALL)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**SMALL)
    else:
        extra = {}
        if kind == "qwen3-sliding":
            extra = dict(layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=5,
                         use_sliding_window=True)
        cfg = transformers.Qwen3Config(**SMALL, **extra)
    cfg._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    # Random, not-small biases and norm weights, so that each term of the layer matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
    return model


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("attention", ["matmul", "sdpa", "flex"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3-sliding"])
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


def test_unsupported_layers_fall_back():
    model = _model("llama")
    layer = model.model.layers[0]
    assert fusable(layer, model.config) is None
    del layer.mlp.gate_proj
    assert "MLP" in fusable(layer, model.config)
    assert fuse_layers(model.model.layers, model.config) is None
    model.config.attn_logit_softcapping = 50.0
    assert "softcapping" in fusable(model.model.layers[1], model.config)
