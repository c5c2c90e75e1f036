"""Tests of the target (dflash/models/target.py, target_loader.py, layer_ids.py, random_target.py,
gguf_cache.py): layer ids, features vs transformers' hidden states, packed rows,
greedy tokens, random architectures, the GGUF cache (real SmolLM2), GPU-only shapes."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

from dflash.models import gguf_cache, random_target
from dflash.config import ConfigError, TargetConfig
from dflash.models.layer_ids import default_layer_ids, resolve_layer_ids
from dflash.models.random_target import build_random_config
from dflash.models.target import TargetModel, packed_attention_mask
from dflash.models.target_loader import describe_target, load_target, resolve_dtype

os.environ.setdefault("HF_HUB_OFFLINE", "1")
CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
TINY = ["tiny-llama", "tiny-qwen3", "tiny-qwen3.6"]


def _tiny(arch: str, **kw) -> TargetModel:
    return load_target(TargetConfig(kind="random", arch=arch, **kw), "cpu")


def _single_doc_batch(rows: int, seq: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    pos = torch.arange(seq).expand(rows, seq).contiguous()
    doc = torch.ones(rows, seq, dtype=torch.int32)
    return ids, pos, doc


def _packed_row(lengths: list[int], seq: int, vocab: int, seed: int = 0):
    """One row: documents of ``lengths`` back to back, then padding (doc 0, position 0, pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(1, seq, dtype=torch.long)
    pos = torch.zeros(1, seq, dtype=torch.long)
    doc = torch.zeros(1, seq, dtype=torch.int32)
    start = 0
    for d, n in enumerate(lengths, start=1):
        ids[0, start:start + n] = torch.randint(1, vocab, (n,), generator=g)
        pos[0, start:start + n] = torch.arange(n)
        doc[0, start:start + n] = d
        start += n
    return ids, pos, doc


# --------------------------------------------------------------------------- layer ids

def test_default_layer_ids_dflash_rule():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B (docs/DFLASH.md, Target layer ids)
    assert default_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # Qwen3.6-27B
    # Python's round-half-to-even, as the public DFlash code: 20.5 → 20 (half-up would give 21).
    assert default_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # SmolLM2-135M
    assert default_layer_ids(30, 1) == [15]  # L = 1: the middle layer
    assert default_layer_ids(36, 1) == [18]
    assert default_layer_ids(30, 2) == [1, 27]
    assert default_layer_ids(8, 5) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="target.layer_ids"):
        default_layer_ids(2, 3)


def test_one_layer_id_rule_for_target_and_drafter_config():
    """The drafter's config takes its default ids from the one rule the target uses, and both sides refuse
    an id past N - 2 (a naive check of every id of the rule against the engines' range)."""
    from transformers import LlamaConfig

    from dflash.config import DrafterConfig
    from dflash.models.drafter_config import DFlashConfig

    target = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=12, vocab_size=100)
    for n in range(1, 70):
        target.num_hidden_layers = n
        for k in range(1, 8):
            try:
                ids = default_layer_ids(n, k)
            except ValueError:
                with pytest.raises(ValueError):
                    DFlashConfig.from_target(target, DrafterConfig(num_layers=k), mask_token_id=None)
                continue
            if len(set(ids)) < len(ids):  # the rule repeats a layer (small N, deep drafter): refused downstream
                with pytest.raises(ValueError, match="duplicates"):
                    DFlashConfig.from_target(target, DrafterConfig(num_layers=k), mask_token_id=None)
                continue
            assert DFlashConfig.from_target(target, DrafterConfig(num_layers=k), mask_token_id=None
                                            ).target_layer_ids == ids
            assert all(0 <= i <= n - 2 for i in ids), (n, k, ids)
    target.num_hidden_layers = 12
    with pytest.raises(ValueError, match="target.layer_ids"):
        default_layer_ids(2, 1)  # the middle layer of 2 is the last one
    # The drafter's config (what the export writes) takes the same rule.
    assert DFlashConfig.from_target(target, DrafterConfig(num_layers=1), target_layer_ids=[10],
                                    mask_token_id=None).target_layer_ids == [10]
    with pytest.raises(ValueError, match=r"^DFlashConfig\.target_layer_ids: target\.layer_ids: layer 11 is out"):
        DFlashConfig.from_target(target, DrafterConfig(num_layers=1), target_layer_ids=[11], mask_token_id=None)


def test_layer_id_override_validation():
    assert resolve_layer_ids([0, 28], 30, 5) == [0, 28]
    assert resolve_layer_ids(None, 36, 5) == [1, 9, 17, 25, 33]
    # Engines read layer id's feature as hidden_states[id + 1]: the last layer (N - 1) has none.
    for bad in ([3, 35], [3, 36], [-1, 2], [], [4, 4]):
        with pytest.raises(ConfigError, match=r"^target\.layer_ids"):
            resolve_layer_ids(bad, 36, 5)
    with pytest.raises(ConfigError, match=r"^target\.layer_ids: layer 35 is out of range .* valid ids are 0\.\.34"):
        resolve_layer_ids([35], 36, 5)
    with pytest.raises(ConfigError, match=r"^target\.layer_ids.*out of range"):
        describe_target(TargetConfig(kind="random", arch="tiny-llama", layer_ids=[1, 8]))
    with pytest.raises(ConfigError, match=r"^target\.layer_ids"):
        load_target(TargetConfig(kind="random", arch="tiny-llama", layer_ids=[9]), "cpu")


# --------------------------------------------------------------------------- features

@pytest.mark.parametrize("arch", TINY)
def test_features_equal_hidden_states_sliced_by_hand(arch):
    target = _tiny(arch)
    assert target.layer_ids == [1, 2, 3, 4, 5]
    ids, pos, doc = _single_doc_batch(2, 48, target.vocab_size)
    features, tokens = target.forward_features(ids, pos, doc)
    assert features.shape == (2, 48, 5 * target.hidden_size) and features.dtype == torch.float32
    assert tokens.shape == (2, 48) and tokens.dtype == torch.int64
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    expected = torch.cat([out.hidden_states[i + 1] for i in target.layer_ids], dim=-1)
    assert features.abs().mean() > 1e-3 and features.std() > 1e-3  # real values, not zeros
    torch.testing.assert_close(features, expected, atol=1e-6, rtol=0)
    assert torch.equal(tokens, out.logits.argmax(dim=-1))


@pytest.mark.parametrize("arch", TINY)
def test_final_hidden_is_the_lm_heads_input(arch):
    """``forward_with_hidden``'s third output is the final-normed state transformers feeds its LM
    head: its logits are the model's, and the features and tokens are ``forward_features``'s."""
    target = _tiny(arch)
    ids, pos, doc = _single_doc_batch(2, 40, target.vocab_size, seed=7)
    features, tokens, hidden = target.forward_with_hidden(ids, pos, doc)
    assert hidden.shape == (2, 40, target.hidden_size) and hidden.dtype == target.dtype
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    assert hidden.std() > 1e-3
    torch.testing.assert_close(target.lm_head(hidden), out.logits, atol=1e-5, rtol=1e-5)
    f2, t2 = target.forward_features(ids, pos, doc)
    assert torch.equal(features, f2) and torch.equal(tokens, t2)


def test_last_valid_layer_is_input_of_last_layer():
    """id = N-2 → hidden_states[N-1] (the input of the last layer); id = N-1 has no feature in an
    engine (hidden_states[N] is past its layers) and is refused."""
    target = _tiny("tiny-llama", layer_ids=[6, 0])
    ids, pos, doc = _single_doc_batch(1, 20, target.vocab_size, seed=3)
    features, _ = target.forward_features(ids, pos, doc)
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    d = target.hidden_size
    torch.testing.assert_close(features[..., :d], out.hidden_states[7], atol=1e-6, rtol=0)
    torch.testing.assert_close(features[..., d:], out.hidden_states[1], atol=1e-6, rtol=0)
    with pytest.raises(ConfigError, match=r"^target\.layer_ids: layer 7 is out of range .* 0\.\.6"):
        _tiny("tiny-llama", layer_ids=[7, 0])


def test_target_tokens_are_argmax_of_logits_chunked():
    target = _tiny("tiny-qwen3")
    target.lm_head_chunk_tokens = 7  # 2×40 positions: 12 chunks, the last one partial
    ids, pos, doc = _single_doc_batch(2, 40, target.vocab_size, seed=5)
    _, tokens = target.forward_features(ids, pos, doc)
    with torch.no_grad():
        hidden = target.model.model(input_ids=ids).last_hidden_state
        logits = hidden @ target.lm_head.weight.T
    assert torch.equal(tokens, logits.argmax(dim=-1))


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3"])
def test_packed_rows_match_documents_run_alone(arch):
    target = _tiny(arch)
    a, b, seq = 21, 30, 64
    ids, pos, doc = _packed_row([a, b], seq, target.vocab_size, seed=7)
    features, tokens = target.forward_features(ids, pos, doc)
    assert not torch.isnan(features).any() and not torch.isnan(features[:, a + b:]).any()
    for start, n in ((0, a), (a, b)):
        alone_f, alone_t = target.forward_features(
            ids[:, start:start + n], torch.arange(n)[None], torch.ones(1, n, dtype=torch.int32))
        torch.testing.assert_close(features[:, start:start + n], alone_f, atol=1e-5, rtol=0)
        assert torch.equal(tokens[:, start:start + n], alone_t)


def test_packed_mask_shape_and_rules():
    doc = torch.tensor([[1, 1, 2, 2, 2, 0]], dtype=torch.int32)
    m = packed_attention_mask(doc)
    assert m.shape == (1, 1, 6, 6) and m.dtype == torch.bool
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(m[0, 0], expected)
    assert m[0, 0].any(dim=-1).all()  # every query sees at least itself: no NaN
    w = packed_attention_mask(doc, sliding_window=2)[0, 0]
    assert not w[4, 2] and w[4, 3] and w[4, 4]


def test_eager_attention_gets_an_additive_mask():
    from transformers import AutoModelForCausalLM

    sdpa = _tiny("tiny-llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_random_config("tiny-llama"), attn_implementation="eager")
    model.load_state_dict(sdpa.model.state_dict())
    eager = TargetModel(model.eval().requires_grad_(False), sdpa.layer_ids)
    ids, pos, doc = _packed_row([17, 25], 48, sdpa.vocab_size, seed=2)
    f_sdpa, t_sdpa = sdpa.forward_features(ids, pos, doc)
    f_eager, t_eager = eager.forward_features(ids, pos, doc)
    assert not torch.isnan(f_eager).any()
    torch.testing.assert_close(f_eager, f_sdpa, atol=1e-5, rtol=0)
    assert torch.equal(t_eager, t_sdpa)


def test_hybrid_qwen36_trailing_padding_and_layer_types(caplog):
    with caplog.at_level(logging.INFO, logger="dflash.models.target"):
        target = _tiny("tiny-qwen3.6")
    assert type(target.model).__name__ == "Qwen3_5ForCausalLM"
    assert target.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    assert target.linear_attention == "torch" and "from a zero state (torch backend)" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    ids, pos, doc = _packed_row([37], 64, target.vocab_size, seed=4)
    features, tokens = target.forward_features(ids, pos, doc)
    alone_f, alone_t = target.forward_features(ids[:, :37], pos[:, :37], doc[:, :37])
    assert not torch.isnan(features).any()
    torch.testing.assert_close(features[:, :37], alone_f, atol=1e-5, rtol=0)
    assert torch.equal(tokens[:, :37], alone_t)


def test_forward_is_one_graph_without_breaks():
    """What torch.compile(mode="reduce-overhead") will see: one graph, no host sync."""
    target = _tiny("tiny-llama")
    ids, pos, doc = _packed_row([10, 20], 32, target.vocab_size)
    explained = torch._dynamo.explain(target.forward_features)(ids, pos, doc)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


def test_bf16_on_cpu_when_asked():
    target = load_target(TargetConfig(kind="random", arch="tiny-qwen3"), "cpu", torch.bfloat16)
    ids, pos, doc = _packed_row([12, 9], 24, target.vocab_size)
    features, _ = target.forward_features(ids, pos, doc)
    assert target.dtype == features.dtype == torch.bfloat16
    assert not torch.isnan(features).any()


def test_no_grad_and_frozen():
    target = _tiny("tiny-llama")
    assert not any(p.requires_grad for p in target.parameters()) and not target.model.training
    ids, pos, doc = _single_doc_batch(1, 8, target.vocab_size)
    features, _ = target.forward_features(ids, pos, doc)
    assert not features.requires_grad and not features.is_inference()
    assert isinstance(target.embed_tokens, torch.nn.Embedding) and isinstance(target.lm_head, torch.nn.Linear)
    assert target.tokenizer is None  # random weights: no tokenizer directory


# --------------------------------------------------------------------------- random architectures, dtype

def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    assert resolve_dtype(torch.bfloat16, "cpu") == torch.bfloat16


def test_arch_overrides_and_errors():
    cfg = TargetConfig(kind="random", arch="tiny-qwen3", arch_overrides={"num_hidden_layers": 3, "hidden_size": 32})
    info = describe_target(cfg, num_drafter_layers=1)
    assert (info.num_layers, info.hidden_size, info.layer_ids) == (3, 32, (1,))
    target = load_target(cfg, "cpu", num_drafter_layers=1)
    assert target.num_layers == 3 and target.hidden_size == 32 and target.layer_ids == [1]
    hybrid = build_random_config("tiny-qwen3.6", {"num_hidden_layers": 6})
    assert hybrid.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2
    with pytest.raises(ConfigError, match=r"^target\.arch_overrides"):
        build_random_config("tiny-llama", {"num_hidden_layerz": 2})
    with pytest.raises(ConfigError, match=r"^target\.arch:"):
        describe_target(TargetConfig(kind="random", arch="gpt-5"))


def test_seeded_random_weights():
    a = _tiny("tiny-llama")
    b = _tiny("tiny-llama")
    c = load_target(TargetConfig(kind="random", arch="tiny-llama", seed=1), "cpu")
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_real_shapes_described_without_weights():
    q8 = describe_target(TargetConfig(kind="random", arch="qwen3-8b"))
    assert (q8.num_layers, q8.hidden_size, q8.vocab_size, q8.layer_ids) == (36, 4096, 151936, (1, 9, 17, 25, 33))
    assert q8.feature_size == 5 * 4096
    q27 = describe_target(TargetConfig(kind="random", arch="qwen3.6-27b"))
    assert (q27.num_layers, q27.hidden_size, q27.vocab_size) == (64, 5120, 248320)
    assert q27.layer_ids == (1, 16, 31, 46, 61)
    c = build_random_config("qwen3.6-27b")
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (24, 4, 256, 17408)
    assert c.layer_types.count("linear_attention") == 48 and c.layer_types.count("full_attention") == 16


def test_qwen36_falls_back_to_dense_qwen3_without_qwen3_5(monkeypatch, caplog):
    monkeypatch.setattr(random_target, "_has_qwen3_5", lambda: False)
    with caplog.at_level(logging.WARNING, logger="dflash.models.random_target"):
        c = build_random_config("qwen3.6-27b")
    assert type(c).__name__ == "Qwen3Config" and "dense Qwen3" in caplog.text
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.head_dim) == (64, 5120, 17408, 256)
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (24, 4, 248320)
    target = load_target(TargetConfig(kind="random", arch="tiny-qwen3.6"), "cpu")
    assert type(target.model).__name__ == "Qwen3ForCausalLM" and set(target.layer_types) == {"full_attention"}


def test_qwen36_27b_built_on_meta_has_the_real_size():
    """The whole 27B model, allocated on the meta device (no memory): the real parameter count."""
    target = load_target(TargetConfig(kind="random", arch="qwen3.6-27b"), "meta", torch.bfloat16)
    assert target.device.type == "meta" and target.dtype == torch.bfloat16
    assert type(target.model).__name__ == "Qwen3_5ForCausalLM"
    assert 26.8e9 < target.num_parameters() < 27.0e9, target.num_parameters()  # 26.90B (text only: no vision, no MTP)
    q8 = load_target(TargetConfig(kind="random", arch="qwen3-8b"), "meta", torch.bfloat16)
    assert q8.num_parameters() == 8_190_735_360  # Qwen3-8B


# --------------------------------------------------------------------------- GGUF cache

def test_gguf_conversion_crash_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF not really")

    def crash(path: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(gguf_cache, "_convert_gguf", crash)
    with pytest.raises(RuntimeError, match="mid-conversion"):
        gguf_cache.gguf_hf_dir(fake)
    models = tmp_path / "cache" / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []

    def ok(path: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"x")
        (out / gguf_cache._CACHE_MARKER).write_text("{}")

    monkeypatch.setattr(gguf_cache, "_convert_gguf", ok)
    done = gguf_cache.gguf_hf_dir(fake)
    assert done.parent == models and done.name.startswith("model-") and (done / "config.json").is_file()
    monkeypatch.setattr(gguf_cache, "_convert_gguf", crash)
    assert gguf_cache.gguf_hf_dir(fake) == done  # cached: not converted again


@pytest.mark.slow
def test_smollm2_gguf_loads_caches_and_answers(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    cfg = TargetConfig(kind="gguf")
    described = describe_target(cfg)  # from GGUF metadata: no cache yet
    assert (described.num_layers, described.hidden_size, described.vocab_size) == (30, 576, 49152)
    assert described.layer_ids == (1, 8, 14, 20, 27)

    t0 = time.perf_counter()
    first = load_target(cfg, "cpu")
    t_first = time.perf_counter() - t0
    cache_dirs = [p for p in (tmp_path / "models").iterdir() if p.is_dir()]
    assert len(cache_dirs) == 1 and not cache_dirs[0].name.startswith(".tmp")
    cache = cache_dirs[0]
    for name in ("config.json", "model.safetensors", "tokenizer.json", gguf_cache._CACHE_MARKER):
        assert (cache / name).is_file(), name
    assert describe_target(cfg) == described  # now from the cache's config.json

    t0 = time.perf_counter()
    target = load_target(cfg, "cpu")
    t_cached = time.perf_counter() - t0
    print(f"\nSmolLM2 GGUF: first load (convert + cache) {t_first:.1f} s, cached load {t_cached:.2f} s")
    assert t_cached < t_first / 3
    assert type(target.model).__name__ == "LlamaForCausalLM" and target.model_dir == cache
    assert target.num_parameters() == 134_515_008  # 134.5M, LM head tied to the embedding
    assert target.lm_head.weight is target.embed_tokens.weight
    assert torch.equal(first.lm_head.weight, target.lm_head.weight)

    tok = target.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    for _ in range(7):  # greedy decoding with forward_features alone
        n = ids.shape[1]
        _, tokens = target.forward_features(ids, torch.arange(n)[None], torch.ones(1, n, dtype=torch.int32))
        ids = torch.cat([ids, tokens[:, -1:]], dim=1)
    answer = tok.decode(ids[0, -7:])
    print(f"SmolLM2 greedy answer: {answer!r}")
    assert "Paris" in answer


# --------------------------------------------------------------------------- GPU only

@gpu
def test_gpu_random_qwen3_8b_full_shape():
    device = torch.device("cuda")
    free_before = torch.cuda.mem_get_info(device)[0]
    target = load_target(TargetConfig(kind="random", arch="qwen3-8b"), device)
    assert target.dtype == torch.bfloat16 and target.device.type == "cuda"
    assert 8.0e9 < target.num_parameters() < 8.4e9  # Qwen3-8B: 8.19B
    assert free_before - torch.cuda.mem_get_info(device)[0] > 15e9  # the weights are on the GPU
    ids, pos, doc = (t.to(device) for t in _packed_row([300, 200], 512, target.vocab_size))
    features, tokens = target.forward_features(ids, pos, doc)
    assert features.shape == (1, 512, 5 * 4096) and features.dtype == torch.bfloat16
    assert torch.isfinite(features).all() and tokens.max() < 151936
    del target
    torch.cuda.empty_cache()


@gpu
def test_gpu_random_qwen36_hybrid_runs():
    device = torch.device("cuda")
    cfg = TargetConfig(kind="random", arch="qwen3.6-27b", arch_overrides={"num_hidden_layers": 8})
    target = load_target(cfg, device, num_drafter_layers=2)
    ids, pos, doc = (t.to(device) for t in _packed_row([100, 156], 256, target.vocab_size))
    features, tokens = target.forward_features(ids, pos, doc)
    assert features.shape == (1, 256, 2 * 5120) and torch.isfinite(features).all()
    del target
    torch.cuda.empty_cache()


@gpu
def test_gpu_matches_cpu_and_compiles():
    cpu = _tiny("tiny-qwen3")
    cuda = load_target(TargetConfig(kind="random", arch="tiny-qwen3"), "cuda", torch.float32)
    cuda.model.load_state_dict(cpu.model.state_dict())  # CPU and CUDA generators differ
    ids, pos, doc = _packed_row([40, 50], 128, cpu.vocab_size, seed=9)
    f_cpu, t_cpu = cpu.forward_features(ids, pos, doc)
    args = [t.cuda() for t in (ids, pos, doc)]
    f_gpu, t_gpu = cuda.forward_features(*args)
    torch.testing.assert_close(f_gpu.cpu(), f_cpu, atol=1e-4, rtol=1e-4)
    compiled = torch.compile(cuda.forward_features, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        f_c, t_c = compiled(*args)
        f_c, t_c = f_c.clone(), t_c.clone()
    torch.testing.assert_close(f_c, f_gpu, atol=1e-4, rtol=1e-4)
    assert (t_c == t_gpu).float().mean() > 0.99


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3"])
def test_embedding_and_head_alone_equal_the_targets(arch):
    """A drafter process rebuilds the random target's embedding and LM head without the target."""
    from dflash.models.target_loader import load_embedding_and_head

    cfg = TargetConfig(kind="random", arch=arch, seed=5)
    target = load_target(cfg, "cpu", num_drafter_layers=2)
    embed, head = load_embedding_and_head(cfg, "cpu")
    assert torch.equal(embed.weight, target.embed_tokens.weight)
    assert torch.equal(head.weight, target.lm_head.weight)
    assert not embed.weight.requires_grad and not head.weight.requires_grad
    assert embed.weight.std().item() == pytest.approx(0.02, rel=0.2)
