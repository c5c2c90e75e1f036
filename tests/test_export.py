"""Export: the drafter inside a training checkpoint is an engine-loadable DFlash HF directory.

The checkpoint is written by the pipeline's own code path: ``factory.build_drafter`` around the
embedding and head a drafter worker loads (``load_embedding_and_head``), a few ``DrafterTrainer``
steps on real target features, then ``checkpoint.save_checkpoint``. Checked: the DFlash fields of
``config.json`` (DESIGN.md §4), the tensor names and values of ``model.safetensors``, that
transformers reads the config, and that a reload gives bit-identical outputs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dflash.checkpoint import latest_checkpoint, save_checkpoint
from dflash.config import config_from_dict, validate_config
from dflash.factory import build_drafter
from dflash.model import DFlashDraftModel
from dflash.target import load_embedding_and_head, load_target
from dflash.trainer import DrafterTrainer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, NUM_TARGET_LAYERS, HIDDEN = 512, 8, 64   # tiny-llama
BLOCK = 4
STEP = 3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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

    # The DFlash fields engines read (DESIGN.md §4).
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
