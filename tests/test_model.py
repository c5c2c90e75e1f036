"""The DFlash drafter (dflash/models/drafter.py, drafter_config.py, modeling_dflash.py, drafter_io.py): shapes, no-leak attention, mask token, checkpoint format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from dflash.config import DrafterConfig
from dflash.models.drafter import DFlashDraftModel
from dflash.models.drafter_config import DFlashConfig, mask_fallback_token_ids, resolve_mask_token_id
from dflash.models.layer_ids import default_layer_ids
from dflash.models.masks import SLIDING_ATTENTION, build_attention_masks

V, D, L = 48, 32, 2


def tiny_config(**overrides: object) -> DFlashConfig:
    kw: dict = dict(hidden_size=D, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    vocab_size=V, num_hidden_layers=2, num_target_layers=8, target_layer_ids=[2, 5], block_size=4,
                    mask_token_id=7, rope_theta=10000.0, max_position_embeddings=512)
    kw.update(overrides)
    return DFlashConfig(**kw)


def tiny_model(seed: int = 0, attention: str = "sdpa", **overrides: object) -> DFlashDraftModel:
    torch.manual_seed(seed)
    embed = nn.Embedding(V, D)
    head = nn.Linear(D, V, bias=False)
    model = DFlashDraftModel(tiny_config(**overrides), embed, head, attention=attention)
    # Non-trivial norm weights so that no test passes by symmetry.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


def tiny_inputs(seed: int = 1) -> dict[str, torch.Tensor]:
    """Row 0: doc 1 = 0..11, doc 2 = 12..23. Row 1: one document 0..21, then padding."""
    g = torch.Generator().manual_seed(seed)
    r, s = 2, 24
    doc_ids = torch.tensor([[1] * 12 + [2] * 12, [1] * 22 + [0] * 2], dtype=torch.int32)
    position_ids = torch.tensor([list(range(12)) * 2, list(range(22)) + [0, 0]])
    return {
        "context_features": torch.randn(r, s, L * D, generator=g),
        "input_ids": torch.randint(0, V, (r, s), generator=g),
        "position_ids": position_ids,
        "doc_ids": doc_ids,
        "anchors": torch.tensor([[5, 9, 15, 20], [3, 8, 17, 0]]),
        "anchor_keep": torch.tensor([[True, True, True, True], [True, True, True, False]]),
    }


def run(model: DFlashDraftModel, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)


# --------------------------------------------------------------------------- config


def test_config_json_without_layer_ids_takes_the_dflash_rule() -> None:
    """A ``config.json`` without ``dflash_config.target_layer_ids`` gets the target layers of the one
    DFlash rule for its ``num_target_layers`` and drafter depth."""
    data = tiny_config().to_hf_dict()
    del data["dflash_config"]["target_layer_ids"]
    for n, k, expected in ((36, 5, [1, 9, 17, 25, 33]), (30, 1, [15]), (30, 2, [1, 27])):
        layers = {"num_target_layers": n, "num_hidden_layers": k, "layer_types": ["full_attention"] * k,
                  "max_window_layers": k}
        assert DFlashConfig.from_hf_dict({**data, **layers}).target_layer_ids == expected == default_layer_ids(n, k)


def test_resolve_mask_token_id() -> None:
    from transformers import LlamaConfig

    assert resolve_mask_token_id(None, 151669, 151936, [0]) == 151669   # Qwen3: first unused row
    assert resolve_mask_token_id(248070, 248070, 248320) == 248070
    # SmolLM2: 49,152 tokens in 49,152 rows: its unk token (0), else pad / eos / bos.
    smollm2 = LlamaConfig(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    smollm2.unk_token_id = 0
    assert mask_fallback_token_ids(smollm2) == [0, 2, 1]
    assert resolve_mask_token_id(None, 49152, 49152, mask_fallback_token_ids(smollm2)) == 0
    no_unk = LlamaConfig(vocab_size=49152, bos_token_id=1, eos_token_id=[5, 6], pad_token_id=None)
    assert mask_fallback_token_ids(no_unk) == [5, 1]
    assert resolve_mask_token_id(None, 49152, 49152, [60000, 5]) == 5       # the first that is a row
    with pytest.raises(ValueError, match="drafter.mask_token_id"):
        resolve_mask_token_id(60000, 49152, 49152)                          # not a row
    assert resolve_mask_token_id(None, 49152, 49152, []) == 49151          # no special token: the last row


def test_config_from_target_and_round_trip() -> None:
    from transformers import LlamaConfig

    target = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=12, vocab_size=100, rope_theta=50000.0, max_position_embeddings=1024)
    dcfg = DrafterConfig(num_layers=3, block_size=8, layer_types=["sliding_attention"] * 2 + ["full_attention"],
                         sliding_window=16)
    cfg = DFlashConfig.from_target(target, dcfg, mask_token_id=0)
    assert cfg.target_layer_ids == default_layer_ids(12, 3) == [1, 5, 9]
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, cfg.intermediate_size) == (64, 16, 2, 96)
    assert cfg.rope_theta == 50000.0 and cfg.block_size == 8 and cfg.num_target_layers == 12
    again = DFlashConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict())))
    assert again == cfg
    with pytest.raises(ValueError):
        tiny_config(layer_types=["full_attention"])
    with pytest.raises(ValueError):
        tiny_config(num_key_value_heads=3)


# --------------------------------------------------------------------------- forward


def test_forward_shape_and_frozen_shared_modules() -> None:
    model = tiny_model()
    out = run(model, tiny_inputs())
    assert out.shape == (2, 4, 4, D) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    names = [n for n, _ in model.named_parameters()]
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert not model.embed_tokens.weight.requires_grad and not model.lm_head.weight.requires_grad
    expected = sum(p.numel() for p in model.parameters())
    assert model.num_trainable_params() == expected
    assert expected == (L * D * D + D) + 2 * (4 * 8 * D * 2 + 2 * 8 * D * 2 + 2 * 8 + 3 * D * 64 + 2 * D) + D


def test_block_inputs_are_anchor_then_mask() -> None:
    model = tiny_model(mask_token_id=7)
    assert not any("mask" in n for n, _ in model.named_parameters())  # the mask row is the target's, frozen
    ids = torch.randint(0, V, (2, 24))
    emb = model.block_embeddings(ids, torch.tensor([[3, 10], [0, 5]]))
    assert torch.equal(emb[1, 1, 0], model.embed_tokens.weight[ids[1, 5]])
    assert torch.equal(emb[0, 0, 1:], model.embed_tokens.weight[7].expand(3, D))
    for bad in (None, V + 5):
        with pytest.raises(ValueError, match="mask_token_id"):
            tiny_model(mask_token_id=bad)


def test_no_leak_across_anchor_documents_and_blocks() -> None:
    """Block 2 of row 0 (anchor 15, doc 2 starts at 12) sees only context 12..14 and itself."""
    model = tiny_model()
    base = tiny_inputs()
    ref = run(model, base)

    def perturbed(**changes: object) -> torch.Tensor:
        x = {k: v.clone() for k, v in base.items()}
        for key, fn in changes.items():
            fn(x[key])  # type: ignore[operator]
        return run(model, x)

    noise = lambda t, sl: t.__setitem__(sl, t[sl] + torch.randn_like(t[sl]) * 3)  # noqa: E731
    # Context at positions >= the anchor, same document.
    out = perturbed(context_features=lambda t: noise(t, (0, slice(15, 24))))
    assert torch.equal(out[0, 2], ref[0, 2])
    # Context in the other document (positions 0..11).
    out = perturbed(context_features=lambda t: noise(t, (0, slice(0, 12))))
    assert torch.equal(out[0, 2], ref[0, 2])
    assert torch.equal(out[0, 3], ref[0, 3])
    assert not torch.equal(out[0, 0], ref[0, 0])
    # Tokens of the other blocks (their anchors), and any other token not an anchor.
    def other_tokens(t: torch.Tensor) -> None:
        t[0, [5, 9, 20, 16, 14]] = (t[0, [5, 9, 20, 16, 14]] + 1) % V
    out = perturbed(input_ids=other_tokens)
    assert torch.equal(out[0, 2], ref[0, 2])
    # Another row entirely.
    out = perturbed(context_features=lambda t: noise(t, (1, slice(0, 24))))
    assert torch.equal(out[0], ref[0])
    # Position anchor − 1 (the last context the block may see) does change it …
    out = perturbed(context_features=lambda t: noise(t, (0, 14)))
    assert not torch.equal(out[0, 2], ref[0, 2])
    assert not torch.equal(out[0, 3], ref[0, 3])  # anchor 20 sees 14 too
    assert torch.equal(out[0, 0], ref[0, 0]) and torch.equal(out[0, 1], ref[0, 1])
    # … and so does the block's own anchor token.
    out = perturbed(input_ids=lambda t: t.__setitem__((0, 15), (t[0, 15] + 1) % V))
    assert not torch.equal(out[0, 2], ref[0, 2])


def test_no_leak_sliding_window() -> None:
    """W = 4: block 2 of row 1 (anchor 17): block position k of a sliding layer sees context
    14 + k … 16 (the window counts the query at 17 + k), a full layer 0..16."""
    all_sliding = tiny_model(layer_types=[SLIDING_ATTENTION] * 2, sliding_window=4)
    mixed = tiny_model(layer_types=[SLIDING_ATTENTION, "full_attention"], sliding_window=4)
    base = tiny_inputs()
    ref_sliding, ref_mixed = run(all_sliding, base), run(mixed, base)

    def bump(pos: int) -> dict[str, torch.Tensor]:
        x = {k: v.clone() for k, v in base.items()}
        x["context_features"][1, pos] += 5.0
        return x

    # Position 13 = anchor − W: outside every sliding window, inside the full layer's context.
    assert torch.equal(run(all_sliding, bump(13))[1, 2], ref_sliding[1, 2])
    assert not torch.equal(run(mixed, bump(13))[1, 2], ref_mixed[1, 2])
    # One sliding layer (no propagation through block keys of earlier layers):
    # position 14 = anchor − W + 1 reaches block position 0 only, position 16 = anchor − 1 reaches
    # positions 0 … 2 but not 3 (whose window is 17 … 20).
    one = tiny_model(num_hidden_layers=1, layer_types=[SLIDING_ATTENTION], sliding_window=4)
    ref_one = run(one, base)[1, 2]
    out = run(one, bump(14))[1, 2]
    assert not torch.equal(out[0], ref_one[0]) and torch.equal(out[1:], ref_one[1:])
    out = run(one, bump(16))[1, 2]
    assert all(not torch.equal(out[k], ref_one[k]) for k in range(3)) and torch.equal(out[3], ref_one[3])
    # Position 17 = the anchor itself: never context.
    assert torch.equal(run(mixed, bump(17))[1, 2], ref_mixed[1, 2])


def test_dropped_block_is_finite_and_isolated() -> None:
    model = tiny_model()
    base = tiny_inputs()
    ref = run(model, base)
    assert torch.isfinite(ref[1, 3]).all()
    x = {k: v.clone() for k, v in base.items()}
    x["context_features"][1] += 1.0
    out = run(model, x)
    # The dropped block (anchor 0, keep False) sees no context at all.
    assert torch.equal(out[1, 3], ref[1, 3])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_backend_matches_sdpa_on_cpu() -> None:
    pytest.importorskip("torch.nn.attention.flex_attention")
    model = tiny_model(layer_types=[SLIDING_ATTENTION, "full_attention"], sliding_window=5)
    x = tiny_inputs()
    ref = run(model, x)
    masks = build_attention_masks(x["anchors"], x["anchor_keep"], x["doc_ids"], 4, model.config.layer_types, 5,
                                  backend="flex")
    with torch.no_grad():
        out = model(**x, attn_masks=masks)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------- checkpoint


@pytest.mark.parametrize("mask_token_id", [0, 3])
def test_save_load_identical_without_shared_weights(tmp_path: Path, mask_token_id: int | None) -> None:
    model = tiny_model(mask_token_id=mask_token_id, layer_types=[SLIDING_ATTENTION, "full_attention"],
                       sliding_window=6)
    x = tiny_inputs()
    ref = run(model, x)
    out_dir = tmp_path / "ckpt"
    model.save_pretrained(out_dir)
    model.save_pretrained(out_dir)  # overwrite in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert sorted(p.name for p in out_dir.iterdir()) == ["config.json", "model.safetensors"]

    from safetensors.torch import load_file

    keys = set(load_file(str(out_dir / "model.safetensors")))
    assert not any("embed_tokens" in k or "lm_head" in k for k in keys)
    assert "mask_embedding" not in keys
    assert "fc.weight" in keys and "layers.1.self_attn.k_norm.weight" in keys and "norm.weight" in keys

    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == 4 and cfg["num_target_layers"] == 8
    assert cfg["dflash_config"]["mask_token_id"] == mask_token_id
    assert cfg["dflash_config"]["target_layer_ids"] == [2, 5]
    assert cfg["layer_types"] == [SLIDING_ATTENTION, "full_attention"] and cfg["sliding_window"] == 6
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "rms_norm_eps", "rope_theta", "vocab_size", "num_hidden_layers", "max_position_embeddings"):
        assert field in cfg, field

    loaded = DFlashDraftModel.from_pretrained(out_dir, model.embed_tokens, model.lm_head, attention="sdpa").eval()
    assert torch.equal(run(loaded, x), ref)


def test_from_pretrained_rejects_other_architectures(tmp_path: Path) -> None:
    model = tiny_model()
    model.save_pretrained(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="DFlashDraftModel"):
        DFlashDraftModel.from_pretrained(tmp_path / "m", model.embed_tokens, model.lm_head)


# --------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_matches_sdpa_on_gpu() -> None:
    model = tiny_model(attention="flex", head_dim=16, layer_types=[SLIDING_ATTENTION, "full_attention"],
                       sliding_window=5).cuda()
    model.embed_tokens.cuda()
    model.lm_head.cuda()
    assert DFlashDraftModel.attention_backend(model, torch.device("cuda")) == "flex"
    x = {k: v.cuda() for k, v in tiny_inputs().items()}
    out = run(model, x)
    model.attention = "sdpa"
    ref = run(model, x)
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-3)


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    x = tiny_inputs()
    grads, outs = [], []
    for ckpt, chunks, first in ((False, 1, None), (True, 1, None), (True, 3, None), (True, 2, 1), (True, 1, 0)):
        model = tiny_model().train()
        model.gradient_checkpointing, model.mlp_chunks, model.checkpoint_layers = ckpt, chunks, first
        out = model(**x)
        out.pow(2).mean().backward()
        outs.append(out.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    for other in range(1, len(grads)):
        torch.testing.assert_close(outs[other], outs[0], atol=1e-6, rtol=1e-5)
        for a, b in zip(grads[0], grads[other]):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def test_compiled_sub_layers_give_the_eager_step(monkeypatch) -> None:
    """``compile_layers`` (the attention and MLP sub-layers compiled, each a checkpoint region;
    ``aot_eager`` keeps the CPU test short) gives the eager outputs and gradients, with two compiled
    functions shared by every layer."""
    real_compile = torch.compile
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(fn) or real_compile(fn, backend="aot_eager", **kw))
    x = tiny_inputs()
    results = []
    for compile_layers in (False, True):
        torch.manual_seed(0)
        model = tiny_model().train()
        model.gradient_checkpointing, model.mlp_chunks = True, 2
        if compile_layers:
            model.compile_layers()
        out = model(**x)
        out.pow(2).mean().backward()
        results.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    assert len(compiled) == 2
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-6, rtol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
