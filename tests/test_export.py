"""Export: the drafter inside a training checkpoint is an engine-loadable DFlash HF directory.

The checkpoint is written by the pipeline's own code path: ``factory.build_drafter`` around the
embedding and head a drafter worker loads (``load_embedding_and_head``), a few ``DrafterTrainer``
steps on real target features, then ``checkpoint.save_checkpoint``. Checked: the DFlash fields of
``config.json`` (docs/DFLASH.md, Checkpoint format), the tensor names and values of ``model.safetensors``, that
transformers reads the config, and that a reload gives bit-identical outputs.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dflash.training.checkpoint import save_checkpoint
from dflash.training.checkpoint_load import latest_checkpoint
from dflash.config import config_from_dict, validate_config
from dflash.training.factory import build_drafter
from dflash.models.drafter import DFlashDraftModel
from dflash.models.target_loader import load_embedding_and_head, load_target
from dflash.training.trainer import DrafterTrainer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, NUM_TARGET_LAYERS, HIDDEN = 512, 8, 64   # tiny-llama
BLOCK = 4
STEP = 3


pytestmark = pytest.mark.usefixtures("one_thread")


def run_config(tmp: Path):
    return validate_config(config_from_dict({
        "name": "export-test", "run_dir": str(tmp / "run"),
        "target": {"kind": "random", "arch": "tiny-llama", "tokenizer": "qwen3"},
        "drafter": {"num_layers": 2, "block_size": BLOCK, "anchors_per_row": 8},
        "data": {"max_length": 32, "token_budget": 64},
        "train": {"max_steps": STEP, "lr": 3e-3, "warmup_ratio": 0.0},
        "cluster": {"device": "cpu", "targets": [0], "drafters": [0]},
    }), gpu_count=0)


@pytest.fixture(scope="module")
def target():
    return load_target(run_config(Path("/nonexistent")).target, "cpu", num_drafter_layers=2)


def batch(target) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    r, s = 2, 32
    ids = torch.randint(0, VOCAB, (r, s), generator=g)
    pos = torch.arange(s).expand(r, s).contiguous()
    doc = torch.ones(r, s, dtype=torch.int32)
    mask = torch.zeros(r, s, dtype=torch.bool)
    mask[:, 6:] = True
    feats, tokens = target.forward_features(ids, pos, doc)
    return dict(input_ids=ids, position_ids=pos, doc_ids=doc, loss_mask=mask, features=feats, target_tokens=tokens)


def trained_checkpoint(tmp: Path, target, tokenizer_size: int) -> tuple[Path, DFlashDraftModel, dict]:
    """Build, train ``STEP`` steps and checkpoint a drafter exactly as a drafter worker does."""
    cfg = run_config(tmp)
    embed, head = load_embedding_and_head(cfg.target, "cpu")
    drafter = build_drafter(cfg, embed, head, tokenizer_size, torch.device("cpu"), target.config)
    trainer = DrafterTrainer(drafter, cfg.train, cfg.drafter, STEP, "cpu")
    data = batch(target)
    for step in range(STEP):
        trainer.step(data, 0, step)
    ckpt = save_checkpoint(cfg.resolved_run_dir(), STEP, 0, drafter, trainer.state_dict())
    return ckpt, drafter.eval(), data


def outputs(model: DFlashDraftModel, data: dict[str, torch.Tensor]) -> torch.Tensor:
    anchors = torch.tensor([[6, 11, 20], [8, 15, 27]])
    with torch.no_grad():
        hidden = model(data["features"], data["input_ids"], data["position_ids"], data["doc_ids"], anchors,
                       torch.ones_like(anchors, dtype=torch.bool))
        return model.lm_head(hidden)


@pytest.mark.parametrize("tokenizer_size", [VOCAB, 500], ids=["no-free-row", "mask-token-row"])
def test_checkpoint_is_a_dflash_hf_directory(tmp_path, target, tokenizer_size):
    ckpt, drafter, data = trained_checkpoint(tmp_path, target, tokenizer_size)
    assert ckpt.name == f"step-{STEP:08d}" and latest_checkpoint(tmp_path / "run") == ckpt
    directory = ckpt / "drafter"
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((directory / "config.json").read_text())

    # The DFlash fields engines read (docs/DFLASH.md, Checkpoint format).
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == BLOCK
    assert cfg["num_target_layers"] == NUM_TARGET_LAYERS
    assert cfg["dflash_config"]["target_layer_ids"] == target.layer_ids == [1, 5]
    no_free_row = tokenizer_size == VOCAB  # every row a token: the target's eos (tiny-llama: no unk / pad)
    assert cfg["dflash_config"]["mask_token_id"] == (2 if no_free_row else 500)
    assert "mask_embedding" not in cfg["dflash_config"]
    # The Qwen3 decoder fields of the drafter layers, sized like the target.
    assert cfg["model_type"] == "qwen3" and cfg["num_hidden_layers"] == 2
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"]) == (HIDDEN, VOCAB, 4, 2, 16)
    assert cfg["tie_word_embeddings"] is False and cfg["torch_dtype"] == "float32"

    # Weights: the drafter's trainable tensors only, under the public DFlash names; no embedding/head.
    state = drafter.state_dict()
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.metadata() == {"format": "pt"}
        for key in keys:
            assert torch.equal(f.get_tensor(key), state[key]), key
            assert f.get_tensor(key).dtype == torch.float32
    assert keys == set(state)
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(2):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "input_layernorm", "post_attention_layernorm"):
            expected.add(f"layers.{i}.{name}.weight")
    assert keys == expected
    assert not any("embed_tokens" in k or "lm_head" in k for k in keys)
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        assert tuple(f.get_tensor("fc.weight").shape) == (HIDDEN, 2 * HIDDEN)

    # Training moved the weights (a checkpoint of the initial weights would prove less).
    fresh = build_drafter(run_config(tmp_path), drafter.embed_tokens, drafter.lm_head, tokenizer_size,
                          torch.device("cpu"), target.config)
    assert not torch.equal(fresh.state_dict()["fc.weight"], state["fc.weight"])

    # Reload around the target's own embedding and head: bit-identical logits.
    reloaded = DFlashDraftModel.from_pretrained(directory, target.embed_tokens, target.lm_head).eval()
    before, after = outputs(drafter, data), outputs(reloaded, data)
    assert before.shape == (2, 3, BLOCK, VOCAB) and before.abs().max() > 1e-3
    assert torch.equal(before, after)


def test_transformers_reads_the_config(tmp_path, target):
    """Engines parse config.json with transformers first: it must load as a Qwen3 config with the DFlash keys."""
    from transformers import AutoConfig

    ckpt, _, _ = trained_checkpoint(tmp_path, target, VOCAB)
    hf = AutoConfig.from_pretrained(ckpt / "drafter")
    assert type(hf).__name__ == "Qwen3Config"
    assert hf.architectures == ["DFlashDraftModel"] and hf.block_size == BLOCK
    assert hf.num_target_layers == NUM_TARGET_LAYERS and hf.num_hidden_layers == 2
    assert hf.dflash_config["target_layer_ids"] == [1, 5] and hf.dflash_config["mask_token_id"] == 2


# --------------------------------------------------------------------------- the serving export

SERVE_V, SERVE_D = 96, 32


def serving_drafter(tmp: Path, free_row: bool, layer_types: list[str], window: int = 3) -> tuple[Path, DFlashDraftModel]:
    """A tiny drafter saved as a training checkpoint's ``drafter/`` directory (fp32).

    ``free_row=False``: SmolLM2-like, every embedding row a token; the mask token is the target's
    unk token (id 0) through :func:`resolve_mask_token_id`. ``free_row=True``: Qwen3-like, the
    tokenizer stops short of the embedding and the mask token is the first unused row.
    """
    from transformers import LlamaConfig

    from dflash.models.drafter_config import DFlashConfig, mask_fallback_token_ids, resolve_mask_token_id

    target = LlamaConfig(vocab_size=SERVE_V, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    target.unk_token_id = 0
    tokenizer_size = SERVE_V - 6 if free_row else SERVE_V
    mask_id = resolve_mask_token_id(None, tokenizer_size, SERVE_V, mask_fallback_token_ids(target))
    assert mask_id == (SERVE_V - 6 if free_row else 0)
    cfg = DFlashConfig(hidden_size=SERVE_D, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, vocab_size=SERVE_V, num_hidden_layers=len(layer_types), num_target_layers=8,
                       target_layer_ids=[1, 5], block_size=BLOCK, mask_token_id=mask_id, layer_types=layer_types,
                       sliding_window=window, rope_theta=10000.0)
    torch.manual_seed(1)
    embed, head = torch.nn.Embedding(SERVE_V, SERVE_D), torch.nn.Linear(SERVE_D, SERVE_V, bias=False)
    model = DFlashDraftModel(cfg, embed, head, attention="sdpa").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    directory = tmp / "run" / "checkpoints" / "step-00000001" / "drafter"
    model.save_pretrained(directory)
    (directory.parent / "state.json").write_text(json.dumps({"step": 1, "epoch": 0}))
    return directory, model


def naive_dflash_forward(weights: dict[str, torch.Tensor], hf: dict, target_hidden: torch.Tensor,
                         block_embeds: torch.Tensor) -> torch.Tensor:
    """The reference DFlash drafter forward, restated from its public description, one query at a time.

    ``target_hidden [C, L·D]`` (context positions 0 … C−1), ``block_embeds [B, D]`` (positions
    C … C+B−1) → ``[B, D]``. ``fc`` + RMSNorm make the context; each layer: pre-RMSNorm, queries
    from the block, keys / values from [context ; block] (per-head RMSNorm on q and k, RoPE with
    rotate-half), softmax attention where a full layer sees every key and a sliding layer sees key
    positions p − W + 1 … p of query position p; o_proj, residual; RMSNorm, SwiGLU, residual; final
    RMSNorm.
    """
    eps, heads, kv_heads, hd = hf["rms_norm_eps"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    theta = hf["rope_parameters"]["rope_theta"]

    def rms(x, w):
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    def rope(x, pos):  # x [hd]
        half = hd // 2
        freq = torch.tensor([theta ** (-2 * i / hd) for i in range(half)], dtype=torch.float64) * pos
        cos, sin = torch.cat([freq.cos(), freq.cos()]), torch.cat([freq.sin(), freq.sin()])
        rotated = torch.cat([-x[half:], x[:half]])
        return x * cos + rotated * sin

    w = {k: v.double() for k, v in weights.items()}
    c, b = target_hidden.shape[0], block_embeds.shape[0]
    ctx = rms(target_hidden.double() @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = block_embeds.double()
    for i, layer_type in enumerate(hf["layer_types"]):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        kv_in = torch.cat([ctx, h])
        out = torch.zeros(b, heads * hd, dtype=torch.float64)
        for qi in range(b):
            q_pos = c + qi
            q_all = (h[qi] @ w[p + "self_attn.q_proj.weight"].T).view(heads, hd)
            for head in range(heads):
                g = head // (heads // kv_heads)
                q = rope(rms(q_all[head], w[p + "self_attn.q_norm.weight"]), q_pos)
                scores, values = [], []
                for key in range(c + b):
                    if layer_type == "sliding_attention" and not (key <= q_pos and q_pos - key < hf["sliding_window"]):
                        continue
                    k = (kv_in[key] @ w[p + "self_attn.k_proj.weight"].T).view(kv_heads, hd)[g]
                    k = rope(rms(k, w[p + "self_attn.k_norm.weight"]), key)
                    v = (kv_in[key] @ w[p + "self_attn.v_proj.weight"].T).view(kv_heads, hd)[g]
                    scores.append(float(q @ k) / math.sqrt(hd))
                    values.append(v)
                probs = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
                out[qi, head * hd:(head + 1) * hd] = sum(pr * v for pr, v in zip(probs, values))
        x = x + out @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["norm.weight"])


@pytest.mark.parametrize("free_row", [False, True], ids=["smollm2-like-no-free-row", "qwen3-like-free-row"])
@pytest.mark.parametrize("layer_types", [["full_attention", "full_attention"], ["sliding_attention", "full_attention"],
                                         ["sliding_attention", "sliding_attention"]], ids=["full", "mixed", "sliding"])
def test_export_serves_what_was_trained(tmp_path, monkeypatch, free_row, layer_types):
    """The fp32 export loaded by transformers' AutoModel (trust_remote_code) and by a naive reference
    forward gives our logits to 1e-5, for full and sliding layers (window 3 < block size 4 < context)."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    from dflash.inference.export import export_drafter

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    src, model = serving_drafter(tmp_path, free_row, layer_types)
    report = export_drafter(tmp_path / "run", tmp_path / "serve", dtype="float32")  # the run's newest checkpoint
    assert report.mask_token_id == model.config.mask_token_id
    hf_cfg = json.loads((tmp_path / "serve" / "config.json").read_text())
    served = AutoModel.from_pretrained(tmp_path / "serve", trust_remote_code=True, dtype=torch.float32).eval()
    assert type(served).__name__ == "DFlashDraftModel" and served.mask_token_id == model.config.mask_token_id
    assert served.block_size == BLOCK and served.target_layer_ids == [1, 5]
    assert {k: v for k, v in served.state_dict().items()}.keys() == model.state_dict().keys()

    g = torch.Generator().manual_seed(3)
    for anchor in (1, 2, 9):  # near the start (context shorter than the window) and deeper
        s = anchor + 3
        feats = torch.randn(1, s, 2 * SERVE_D, generator=g)
        ids = torch.randint(3, SERVE_V, (1, s), generator=g)
        with torch.no_grad():
            ours = model(feats, ids, torch.arange(s).view(1, s), torch.ones(1, s, dtype=torch.int32),
                         torch.tensor([[anchor]]), torch.tensor([[True]]))[0, 0]
            block = torch.tensor([int(ids[0, anchor])] + [served.mask_token_id] * (BLOCK - 1))
            embeds = model.embed_tokens(block)
            theirs = served(position_ids=torch.arange(anchor + BLOCK).view(1, -1), noise_embedding=embeds[None],
                            target_hidden=feats[:, :anchor])[0]
            naive = naive_dflash_forward(load_file(str(tmp_path / "serve" / "model.safetensors")), hf_cfg,
                                         feats[0, :anchor], embeds).float()
            head = model.lm_head
            assert (head(ours) - head(theirs)).abs().max() <= 1e-5
            assert (head(ours) - head(naive)).abs().max() <= 1e-5
            assert head(ours).abs().max() > 0.1


class ListCache:
    """The part of ``transformers.DynamicCache``'s contract the drafter uses: ``update(k, v, i)``
    appends ``[b, H_kv, T, hd]`` keys / values of layer ``i`` along ``T`` and returns all of them."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx in self.kv:
            k = torch.cat([self.kv[layer_idx][0], k], dim=2)
            v = torch.cat([self.kv[layer_idx][1], v], dim=2)
        self.kv[layer_idx] = (k, v)
        return k, v

    def keep(self, length: int) -> None:
        """Drop every position from ``length`` on (the decoding loop drops the last block's keys)."""
        self.kv = {i: (k[:, :, :length], v[:, :, :length]) for i, (k, v) in self.kv.items()}


@pytest.mark.parametrize("layer_types", [["sliding_attention", "full_attention"], ["sliding_attention"] * 2],
                         ids=["mixed", "sliding"])
def test_export_decodes_with_a_context_cache(tmp_path, monkeypatch, layer_types):
    """The exported AutoModel with earlier context in ``past_key_values`` (the reference decoding
    loop: context cached chunk by chunk, each block's keys dropped after drafting) gives the
    training drafter's logits to 1e-5, the sliding rule counted over cached keys too; a
    ``transformers.DynamicCache`` is accepted as the cache."""
    from transformers import AutoModel, DynamicCache

    from dflash.inference.export import export_drafter

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    _, model = serving_drafter(tmp_path, True, layer_types)
    export_drafter(tmp_path / "run", tmp_path / "serve", dtype="float32")
    served = AutoModel.from_pretrained(tmp_path / "serve", trust_remote_code=True, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    s = 16
    feats = torch.randn(1, s, 2 * SERVE_D, generator=g)
    ids = torch.randint(3, SERVE_V, (1, s), generator=g)
    cache, cached = ListCache(), 0
    head = model.lm_head
    with torch.no_grad():
        for anchor in (2, 7, 8, 13):  # context grows by 2, 5, 1 and 5 positions
            ours = model(feats, ids, torch.arange(s).view(1, s), torch.ones(1, s, dtype=torch.int32),
                         torch.tensor([[anchor]]), torch.tensor([[True]]))[0, 0]
            block = torch.tensor([int(ids[0, anchor])] + [served.mask_token_id] * (BLOCK - 1))
            embeds = model.embed_tokens(block)[None]
            theirs = served(position_ids=torch.arange(cached, anchor + BLOCK).view(1, -1), noise_embedding=embeds,
                            target_hidden=feats[:, cached:anchor], past_key_values=cache)[0]
            cache.keep(anchor)
            cached = anchor
            assert (head(ours) - head(theirs)).abs().max() <= 1e-5
            assert head(ours).abs().max() > 0.1
            whole = served(position_ids=torch.arange(anchor + BLOCK).view(1, -1), noise_embedding=embeds,
                           target_hidden=feats[:, :anchor], past_key_values=DynamicCache())[0]
            assert (head(ours) - head(whole)).abs().max() <= 1e-5


def test_export_is_bf16_with_the_engine_fields(tmp_path, monkeypatch, capsys):
    from safetensors import safe_open
    from transformers import AutoModel

    from dflash.inference import export
    from dflash.models.drafter_io import modeling_source

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    src, model = serving_drafter(tmp_path, False, ["sliding_attention", "full_attention"], window=2048)
    assert export.main(["--checkpoint", str(src.parent), "--out", str(tmp_path / "bf16")]) == 0
    printed = capsys.readouterr().out
    assert "mask_token_id 0" in printed and "bfloat16" in printed and "VLLM_USE_V2_MODEL_RUNNER=1" in printed
    assert export.main(["--checkpoint", str(src), "--out", str(tmp_path / "fp32"), "--dtype", "float32"]) == 0
    out = tmp_path / "bf16"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "modeling_dflash.py"]
    assert (out / "modeling_dflash.py").read_text() == modeling_source()  # the training layers' own file
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == 0 and type(cfg["dflash_config"]["mask_token_id"]) is int
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    assert cfg["use_sliding_window"] is True and cfg["sliding_window"] == 2048 and cfg["max_window_layers"] == 2
    assert "is_causal" not in cfg and "causal" not in cfg["dflash_config"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        assert torch.equal(f.get_tensor("fc.weight"), model.state_dict()["fc.weight"].bfloat16())
    ratio = (out / "model.safetensors").stat().st_size / (tmp_path / "fp32" / "model.safetensors").stat().st_size
    assert 0.5 <= ratio < 0.55  # the header is the same size in both
    served = AutoModel.from_pretrained(out, trust_remote_code=True)
    assert served.fc.weight.dtype == torch.bfloat16  # the config's dtype


def test_full_only_export_states_no_window(tmp_path):
    from dflash.inference.export import export_drafter

    serving_drafter(tmp_path, True, ["full_attention"] * 2)
    export_drafter(tmp_path / "run", tmp_path / "serve")
    cfg = json.loads((tmp_path / "serve" / "config.json").read_text())
    assert cfg["use_sliding_window"] is False and cfg["sliding_window"] is None


def test_export_never_replaces_the_run_or_foreign_files(tmp_path, capsys):
    """--out may be new, empty or an earlier export; never the run, the checkpoint, a folder above
    them, one inside them, or a folder holding other files. Written files are readable by all
    (mode 0644 under umask 022: a serving engine may run as another user)."""
    import os
    import stat

    from dflash.inference import export

    src, _ = serving_drafter(tmp_path, True, ["full_attention"] * 2)
    run, step = tmp_path / "run", src.parent
    before = sorted(p.relative_to(tmp_path) for p in run.rglob("*"))
    for bad in (run, step, src, tmp_path, step / "inside"):
        assert export.main(["--checkpoint", str(run), "--out", str(bad)]) == 2, bad
        assert "would replace or nest in the drafter" in capsys.readouterr().err
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert export.main(["--checkpoint", str(run), "--out", str(foreign)]) == 2
    assert "not an export (notes.txt)" in capsys.readouterr().err and (foreign / "notes.txt").is_file()
    assert sorted(p.relative_to(tmp_path) for p in run.rglob("*")) == before
    out = tmp_path / "serve"
    old_umask = os.umask(0o022)
    try:
        assert export.main(["--checkpoint", str(run), "--out", str(out)]) == 0
        assert export.main(["--checkpoint", str(run), "--out", str(out)]) == 0  # an earlier export is replaced
    finally:
        os.umask(old_umask)
    written = [name for name in export.EXPORT_FILES if (out / name).exists()]
    assert len(written) >= 3 and {stat.S_IMODE((out / name).stat().st_mode) for name in written} == {0o644}


def test_export_keeps_what_it_was_trained_with(tmp_path, capsys):
    """The checkpoint's ``trained_with`` record goes into the export, and decoding with the export
    is refused under another thinking mode or template, as with the checkpoint itself."""
    from dflash.inference import export
    from dflash.training.checkpoint_identity import CheckpointMismatch, check_fits, trained_with

    src, _ = serving_drafter(tmp_path, True, ["full_attention"] * 2)
    record = {"tokenizer.size": SERVE_V - 6, "tokenizer.sha256": "ab" * 32, "chat_template.sha256": "cd" * 32,
              "enable_thinking": False, "target.layer_ids": [1, 5]}
    (src.parent / "state.json").write_text(json.dumps({"step": 1, "epoch": 0, "trained_with": record}))
    assert export.main(["--checkpoint", str(src.parent), "--out", str(tmp_path / "serve")]) == 0
    assert "thinking mode (data.enable_thinking): False" in capsys.readouterr().out
    assert json.loads((tmp_path / "serve" / "trained_with.json").read_text()) == record
    assert trained_with(tmp_path / "serve") == record
    assert check_fits(tmp_path / "serve", dict(record)) == []
    for key, value in (("enable_thinking", True), ("chat_template.sha256", "ef" * 32)):
        with pytest.raises(CheckpointMismatch, match="--force"):
            check_fits(tmp_path / "serve", {**record, key: value})
    assert export.main(["--checkpoint", str(src.parent), "--out", str(tmp_path / "serve")]) == 0  # replaced again


def test_export_refuses_a_learned_mask_vector(tmp_path, capsys):
    """A drafter trained with its own mask vector (mask_token_id null) cannot be served as trained."""
    from safetensors.torch import load_file, save_file

    from dflash.inference import export

    src, _ = serving_drafter(tmp_path, False, ["full_attention"] * 2)
    cfg = json.loads((src / "config.json").read_text())
    cfg["dflash_config"].update(mask_token_id=None, mask_embedding=True)
    (src / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(src / "model.safetensors"))
    save_file({**state, "mask_embedding": torch.randn(SERVE_D)}, str(src / "model.safetensors"))
    assert export.main(["--checkpoint", str(src), "--out", str(tmp_path / "serve")]) == 2
    assert "learned mask vector" in capsys.readouterr().err
    assert not (tmp_path / "serve").exists()
    assert export.main(["--checkpoint", str(tmp_path / "nothing"), "--out", str(tmp_path / "serve")]) == 2


def test_engine_rules_refuse_a_global_causality_override():
    from dflash.inference.export import engine_rules
    from dflash.models.drafter_config import DFlashConfig

    cfg = DFlashConfig(hidden_size=8, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                       vocab_size=16, num_hidden_layers=2, num_target_layers=4, target_layer_ids=[1, 2],
                       mask_token_id=3, layer_types=["sliding_attention", "full_attention"]).to_hf_dict()
    assert any("_dflash_layer_causal" in rule for rule in engine_rules(cfg))
    with pytest.raises(ValueError, match="is_causal"):
        engine_rules({**cfg, "is_causal": False})
    with pytest.raises(ValueError, match="is_causal=False"):
        DFlashConfig.from_hf_dict({**cfg, "is_causal": False})   # would make the sliding layer bidirectional
    assert DFlashConfig.from_hf_dict({**cfg, "layer_types": ["full_attention"] * 2, "is_causal": False})


def test_qwen3_8b_shaped_export_is_half_the_fp32_size():
    """5-layer Qwen3-8B-shaped drafter (hidden 4096, FFN 12288, 32/8 heads of 128): sizes from the
    parameter count (built on the meta device, no memory)."""
    from dflash.inference.export import _expected_shapes
    from dflash.models.drafter_config import DFlashConfig
    from dflash.models.layer_ids import default_layer_ids

    cfg = DFlashConfig(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, num_hidden_layers=5, num_target_layers=36,
                       target_layer_ids=default_layer_ids(36, 5), mask_token_id=151669)
    params = sum(math.prod(shape) for shape in _expected_shapes(cfg).values())
    assert params == 5 * 4096 * 4096 + 4096 + 5 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 12288
                                                     + 2 * 128 + 2 * 4096) + 4096
    fp32, bf16 = 4 * params, 2 * params
    assert params == 1_048_626_432  # 4.19 GB (3.91 GiB) in fp32, 2.10 GB (1.95 GiB) in bf16
    assert bf16 / fp32 == 0.5 and round(fp32 / 2**30, 2) == 3.91 and round(bf16 / 2**30, 2) == 1.95


# --------------------------------------------------------------------------- the shipped modeling file

DFLASH_PACKAGE = Path(__file__).resolve().parents[1] / "dflash"
#: What the layer module defines for training, decoding and serving alike.
LAYER_NAMES = ("RMSNorm", "RotaryEmbedding", "rotate_half", "apply_rope", "sliding_window_mask", "DFlashAttention",
               "SwiGLU", "DFlashDecoderLayer")


def test_the_training_layers_are_the_shipped_file():
    """Every layer module of the training drafter is defined in the file the export ships."""
    import inspect

    from dflash.models import modeling_dflash
    from dflash.models.drafter_config import DFlashConfig
    from dflash.models.drafter_io import MODELING_FILE, modeling_source

    cfg = DFlashConfig(hidden_size=8, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                       vocab_size=16, num_hidden_layers=2, num_target_layers=4, target_layer_ids=[1, 2],
                       mask_token_id=3, layer_types=["sliding_attention", "full_attention"])
    model = DFlashDraftModel(cfg, torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16, bias=False), attention="sdpa")
    shipped = Path(modeling_dflash.__file__)
    assert shipped.name == MODELING_FILE and shipped.read_text() == modeling_source()
    classes = {type(m) for m in model.modules()} - {DFlashDraftModel, torch.nn.Linear, torch.nn.ModuleList}
    assert {c.__name__ for c in classes} == {"RMSNorm", "RotaryEmbedding", "DFlashDecoderLayer", "DFlashAttention",
                                             "SwiGLU"}
    for cls in classes:
        assert Path(inspect.getsourcefile(cls)) == shipped, cls
    assert [layer.self_attn.sliding_window for layer in model.layers] == [cfg.sliding_window, None]


def test_the_shipped_file_imports_only_torch_and_transformers():
    """Engines load the file alone from the export directory: no relative import, no project
    import, anywhere in it (imports inside functions included)."""
    import ast
    import sys

    from dflash.models.drafter_io import modeling_source

    tops = set()
    for node in ast.walk(ast.parse(modeling_source())):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"relative import at line {node.lineno}"
            tops.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            tops.update(alias.name.split(".")[0] for alias in node.names)
    assert {"torch", "transformers"} <= tops
    assert tops - {"torch", "transformers"} <= set(sys.stdlib_module_names), tops


def test_each_layer_is_defined_once_in_the_package():
    """``rotate_half`` and the other layer functions / classes have one definition under ``dflash/``:
    the shipped file's (no private copy under another spelling either)."""
    import ast

    where: dict[str, list[str]] = {}
    for path in sorted(DFLASH_PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                name = node.name.lstrip("_").lower()
                if any(name == n.lower() or name.endswith(n.lower()) for n in LAYER_NAMES):
                    where.setdefault(name, []).append(f"{path.relative_to(DFLASH_PACKAGE)}:{node.lineno}")
    assert sorted(where) == sorted(n.lower() for n in LAYER_NAMES)
    for name, places in where.items():
        assert len(places) == 1 and places[0].startswith("models/modeling_dflash.py:"), (name, places)


def test_a_sliding_layer_needs_a_window():
    from transformers import Qwen3Config

    from dflash.models.modeling_dflash import DFlashAttention

    cfg = Qwen3Config(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4, sliding_window=None)
    with pytest.raises(ValueError, match="sliding_window"):
        DFlashAttention(cfg, "sliding_attention", 0)
    assert DFlashAttention(cfg, "full_attention", 0).sliding_window is None
