"""``--resume`` against the checkpoint's drafter (:mod:`dflash.training.resume_check`): each field of the
drafter this config builds compared with the checkpoint's ``drafter/config.json``, no processes."""

import json
from pathlib import Path

import pytest
import yaml

from dflash.config import load_config
from dflash.training import resume_check

TINY = ["target.kind=random", "target.arch=tiny-qwen3", "target.tokenizer=qwen3", "cluster.device=cpu",
        "drafter.num_layers=2", "drafter.block_size=4", "data.max_length=64", "data.token_budget=128"]
TINY_TOKENS = 500  # < the 512 embedding rows: the mask token is row 500


def write_checkpoint(run_dir: Path, cfg, tokenizer_size: int, step: int = 100) -> Path:
    """A checkpoint whose drafter/config.json is what dflash.training.factory.build_drafter builds for ``cfg``
    (written as save_pretrained writes it), with its weights and an empty trainer state: enough for
    the launcher's checks (``--resume`` verifies the files are whole; it loads no tensor)."""
    import torch
    from safetensors.torch import save_file

    from dflash.training.factory import build_drafter, target_hf_config

    tc = target_hf_config(cfg)
    text = tc.get_text_config() if hasattr(tc, "get_text_config") else tc
    embed = torch.nn.Embedding(int(text.vocab_size), int(text.hidden_size))
    head = torch.nn.Linear(int(text.hidden_size), int(text.vocab_size), bias=False)
    model = build_drafter(cfg, embed, head, tokenizer_size, torch.device("cpu"), tc)
    ckpt = run_dir / "checkpoints" / f"step-{step:08d}"
    (ckpt / "drafter").mkdir(parents=True)
    config = model.config.to_hf_dict()
    (ckpt / "drafter" / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "drafter" / "model.safetensors"))
    torch.save({"trainer": {}, "rng": {}}, ckpt / "trainer.pt")
    (ckpt / "state.json").write_text(json.dumps({"step": step, "epoch": 0, "time": 1_800_000_000.0}))
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return ckpt



@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tiny-run")
    return run_dir, write_checkpoint(run_dir, load_config(None, TINY, gpu_count=0), TINY_TOKENS)


@pytest.mark.parametrize("overrides, tokens", [
    ([], TINY_TOKENS),
    (["drafter.num_layers=2", "drafter.block_size=4"], TINY_TOKENS),  # the same values, restated
    (["train.lr=1e-4", "data.max_length=32", "drafter.anchors_per_row=4", "train.eval_batches=0"], TINY_TOKENS),
])
def test_resume_accepts_the_same_drafter(tiny_checkpoint, overrides, tokens):
    _, ckpt = tiny_checkpoint
    assert resume_check.resume_mismatches(load_config(None, TINY + overrides, gpu_count=0), ckpt, tokens) == []


@pytest.mark.parametrize("overrides, tokens, expected", [
    (["drafter.num_layers=3"], TINY_TOKENS,
     ["num_hidden_layers (set by drafter.num_layers): checkpoint 2, this run 3",
      "layer_types (set by drafter.layer_types=null: full attention in each of drafter.num_layers): "
      'checkpoint ["full_attention", "full_attention"], this run ["full_attention", "full_attention", '
      '"full_attention"]',
      "target_layer_ids (set by target.layer_ids=null: the DFlash rule for drafter.num_layers and the target's "
      "depth): checkpoint [1, 5], this run [1, 3, 5]"]),
    (["drafter.block_size=8"], TINY_TOKENS, ["block_size (set by drafter.block_size): checkpoint 4, this run 8"]),
    (["target.layer_ids=[2, 6]"], TINY_TOKENS,
     ["target_layer_ids (set by target.layer_ids): checkpoint [1, 5], this run [2, 6]"]),
    (["drafter.intermediate_size=96"], TINY_TOKENS,
     ["intermediate_size (set by drafter.intermediate_size): checkpoint 128, this run 96"]),
    (["drafter.layer_types=[sliding_attention, full_attention]"], TINY_TOKENS,
     ['layer_types (set by drafter.layer_types): checkpoint ["full_attention", "full_attention"], '
      'this run ["sliding_attention", "full_attention"]']),
    (["drafter.mask_token_id=7"], TINY_TOKENS,
     ["mask_token_id (set by drafter.mask_token_id): checkpoint 500, this run 7"]),
    ([], 499, ["mask_token_id (set by drafter.mask_token_id=null: the target's first unused embedding row, else "
               "its unk / pad / eos / bos token): checkpoint 500, this run 499"]),
    (["target.arch_overrides={hidden_size: 128, num_attention_heads: 8}"], TINY_TOKENS,
     ["hidden_size (set by the target model: target.kind / path / arch / arch_overrides): checkpoint 64, this run 128",
      "num_attention_heads (set by the target model: target.kind / path / arch / arch_overrides): checkpoint 4, "
      "this run 8"]),
    (["target.arch=tiny-llama"], TINY_TOKENS,
     ["rope_theta (set by the target model: target.kind / path / arch / arch_overrides): checkpoint 1000000.0, "
      "this run 10000.0"]),
])
def test_resume_names_each_differing_field(tiny_checkpoint, overrides, tokens, expected):
    _, ckpt = tiny_checkpoint
    assert resume_check.resume_mismatches(load_config(None, TINY + overrides, gpu_count=0), ckpt, tokens) == expected


def test_resume_without_a_free_row_or_a_special_token(tiny_checkpoint):
    """tiny-qwen3 names no unk / pad / eos / bos token: with every row a token, the mask is the last row."""
    _, ckpt = tiny_checkpoint
    assert resume_check.resume_mismatches(load_config(None, TINY, gpu_count=0), ckpt, 512) == [
        "mask_token_id (set by drafter.mask_token_id=null: the target's first unused embedding row, else its unk / "
        "pad / eos / bos token): checkpoint 500, this run 511"]


def test_resume_check_without_the_target_config(tiny_checkpoint, monkeypatch):
    """A GGUF target not converted yet: described from its metadata (no conversion), fewer fields."""
    _, ckpt = tiny_checkpoint
    monkeypatch.setattr(resume_check, "_cheap_target_config", lambda cfg: None)
    assert resume_check.resume_mismatches(load_config(None, TINY, gpu_count=0), ckpt, TINY_TOKENS) == []
    cfg = load_config(None, TINY + ["drafter.block_size=8", "target.arch_overrides={hidden_size: 128}"], gpu_count=0)
    assert resume_check.resume_mismatches(cfg, ckpt, TINY_TOKENS) == [
        "block_size (set by drafter.block_size): checkpoint 4, this run 8",
        "hidden_size (set by the target model: target.kind / path / arch / arch_overrides): checkpoint 64, "
        "this run 128"]


def test_resume_compares_the_sliding_window_only_where_a_layer_slides(tmp_path):
    sliding = TINY + ["drafter.layer_types=[sliding_attention, full_attention]", "drafter.sliding_window=16"]
    ckpt = write_checkpoint(tmp_path, load_config(None, sliding, gpu_count=0), TINY_TOKENS)
    assert resume_check.resume_mismatches(load_config(None, sliding + ["drafter.sliding_window=32"], gpu_count=0), ckpt,
                                     TINY_TOKENS) == [
        "sliding_window (set by drafter.sliding_window): checkpoint 16, this run 32"]
    full = TINY + ["drafter.sliding_window=32"]  # no sliding layer on either side: the window means nothing
    plain = write_checkpoint(tmp_path / "plain", load_config(None, TINY, gpu_count=0), TINY_TOKENS)
    assert resume_check.resume_mismatches(load_config(None, full, gpu_count=0), plain, TINY_TOKENS) == []


def test_resume_with_an_unreadable_drafter_config(tmp_path):
    ckpt = tmp_path / "checkpoints" / "step-00000010"
    (ckpt / "drafter").mkdir(parents=True)
    (ckpt / "drafter" / "config.json").write_text("{not json")
    out = resume_check.resume_mismatches(load_config(None, TINY, gpu_count=0), ckpt, TINY_TOKENS)
    assert len(out) == 1 and out[0].startswith(f"{ckpt / 'drafter' / 'config.json'} cannot be read as a DFlash "
                                               "drafter config (")
