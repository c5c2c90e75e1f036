"""Loading the frozen target from its configured source, or describing it without weights.

Three sources (``target.kind``, :class:`dflash.config.TargetConfig`):

* ``gguf``: a GGUF file, dequantised once into a cached Hugging Face directory
  (:mod:`dflash.models.gguf_cache`).
* ``hf``: a local Hugging Face directory.
* ``random``: random weights at a named real shape (:mod:`dflash.models.random_target`), built
  directly on the target device, for performance runs (weights do not change speed).

:func:`load_target` gives the :class:`dflash.models.target.TargetModel`;
:func:`load_embedding_and_head` only the two matrices a drafter process shares with it;
:func:`describe_target` its shape and layer ids, reading no weights.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from dflash.config import ConfigError, DrafterConfig, TargetConfig
from dflash.data import assets
from dflash.models.gguf_cache import gguf_dims, gguf_hf_dir, resolve_gguf_path
from dflash.models.layer_ids import resolve_layer_ids
from dflash.models.linear_attention import resolve_backend
from dflash.models.random_target import build_random_config, build_random_model, random_embedding_and_head
from dflash.models.target import TargetInfo, TargetModel, _decoder, text_config

__all__ = ["resolve_dtype", "describe_target", "load_embedding_and_head", "load_target"]

logger = logging.getLogger(__name__)

#: Default drafter depth L when a caller does not say (``DrafterConfig.num_layers``).
DEFAULT_DRAFTER_LAYERS: int = DrafterConfig().num_layers
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KINDS = ("gguf", "hf", "random")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device | str) -> torch.dtype:
    """``auto`` → bf16 on CUDA, fp32 elsewhere; names → torch dtypes; torch dtypes pass through."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ConfigError(f"target.dtype: must be one of auto, {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _check_source(cfg: TargetConfig) -> None:
    """Refuse a ``target`` section that names no loadable source, before anything is read.

    Raises:
        ConfigError: unknown ``target.kind``, or ``random`` without ``target.arch``.
        FileNotFoundError: ``hf`` whose ``target.path`` is not a directory.
    """
    if cfg.kind not in _KINDS:
        raise ConfigError(f"target.kind: must be gguf, hf or random, got {cfg.kind!r}")
    if cfg.kind == "random" and cfg.arch is None:
        raise ConfigError("target.arch: is required for target.kind: random")
    if cfg.kind == "hf" and (cfg.path is None or not Path(cfg.path).is_dir()):
        raise FileNotFoundError(f"target.path: no such directory: {cfg.path}")


def describe_target(cfg: TargetConfig, num_drafter_layers: int = DEFAULT_DRAFTER_LAYERS) -> TargetInfo:
    """N, D, vocabulary and layer ids of the configured target, without loading weights.

    ``random``: the named config; ``hf``: the directory's ``config.json``; ``gguf``: the cached
    conversion's ``config.json`` if present, else the GGUF metadata (:func:`dflash.models.gguf_cache.gguf_dims`).

    Raises:
        ConfigError: unknown ``target.arch``/``kind``, or bad ``target.layer_ids``.
        FileNotFoundError: a missing model file or directory.
    """
    _check_source(cfg)
    if cfg.kind == "gguf":
        n, d, v, mtype = gguf_dims(resolve_gguf_path(cfg.path))
    else:
        if cfg.kind == "random":
            tc = text_config(build_random_config(cfg.arch, cfg.arch_overrides))
        else:
            from transformers import AutoConfig

            tc = text_config(AutoConfig.from_pretrained(cfg.path))
        n, d, v, mtype = tc.num_hidden_layers, tc.hidden_size, tc.vocab_size, tc.model_type
    ids = resolve_layer_ids(cfg.layer_ids, n, num_drafter_layers)
    return TargetInfo(num_layers=int(n), hidden_size=int(d), vocab_size=int(v), layer_ids=tuple(ids),
                      model_type=str(mtype))


# --------------------------------------------------------------------------- loading

def _finish(model: nn.Module, device: torch.device) -> nn.Module:
    model.eval()
    model.requires_grad_(False)
    model.config.use_cache = False
    if next(model.parameters()).device != device:
        model.to(device)
    return model


def _load_pretrained(path: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """``from_pretrained`` on the host, then moved to ``device`` (transformers 5.x refuses a
    ``device_map`` or a device context without ``accelerate``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return _finish(model, device)


def _read_embedding_and_head(model_dir: Path, device: torch.device,
                             dtype: torch.dtype) -> tuple[nn.Embedding, nn.Linear]:
    """The token embedding and LM head of the Hugging Face directory ``model_dir``, read from its
    safetensors files alone (no other tensor is loaded). Tied weights, or no ``lm_head.weight``,
    give one shared tensor.

    Raises:
        KeyError: no ``embed_tokens.weight`` in the safetensors files.
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    config = text_config(AutoConfig.from_pretrained(model_dir))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    found: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.endswith("embed_tokens.weight") and "embed" not in found:
                    found["embed"] = f.get_tensor(key)
                elif key == "lm_head.weight":
                    found["head"] = f.get_tensor(key)
    if "embed" not in found:
        raise KeyError(f"{model_dir}: no embed_tokens.weight in its safetensors files")
    embed = nn.Embedding.from_pretrained(found["embed"].to(device=device, dtype=dtype), freeze=True)
    head = nn.Linear(embed.embedding_dim, embed.num_embeddings, bias=False, device=device, dtype=dtype)
    if tied or "head" not in found:
        head.weight = embed.weight
    else:
        head.weight = nn.Parameter(found["head"].to(device=device, dtype=dtype), requires_grad=False)
    return embed, head


def load_embedding_and_head(cfg: TargetConfig, device: torch.device | str,
                            dtype: Optional[torch.dtype] = None) -> tuple[nn.Embedding, nn.Linear]:
    """Only the target's token embedding and LM head, frozen, for a drafter process.

    Reads just those tensors from the safetensors files (GGUF cache or HF directory) or, for a
    random target, draws them exactly as :func:`load_target` does (same seed, same device type).

    Returns:
        ``(embed_tokens [V, D], lm_head [V, D] without bias)``; tied weights share one tensor.
    Raises:
        FileNotFoundError / KeyError: the checkpoint lacks the embedding.
    """
    device = torch.device(device)
    dtype = dtype or resolve_dtype(cfg.dtype, device)
    if cfg.kind == "random":
        embed, head = random_embedding_and_head(cfg, device, dtype)
    else:
        model_dir = gguf_hf_dir(cfg.path) if cfg.kind == "gguf" else Path(cfg.path)
        embed, head = _read_embedding_and_head(model_dir, device, dtype)
    embed.requires_grad_(False)
    head.requires_grad_(False)
    return embed, head


def load_target(cfg: TargetConfig, device: torch.device | str, dtype: Optional[torch.dtype] = None, *,
                num_drafter_layers: int = DEFAULT_DRAFTER_LAYERS) -> TargetModel:
    """Load the configured target on ``device``: eval mode, ``requires_grad_(False)``, sdpa attention.

    Args:
        cfg: ``target`` section. ``kind: gguf`` converts and caches on first use
            (:func:`dflash.models.gguf_cache.gguf_hf_dir`); ``hf`` reads a local directory;
            ``random`` builds ``cfg.arch`` on the device.
        device: where the weights live.
        dtype: weight/feature dtype; ``None`` = ``cfg.dtype`` (``auto``: bf16 on CUDA, fp32 on CPU).
        num_drafter_layers: L for the DFlash layer rule when ``cfg.layer_ids`` is not set.

    Raises:
        ConfigError: bad ``target.kind``/``arch``/``arch_overrides``/``layer_ids``, or
            ``target.linear_attention: fla`` where fla cannot run.
        FileNotFoundError: missing GGUF file or HF directory.
    """
    device = torch.device(device)
    dtype = dtype or resolve_dtype(cfg.dtype, device)
    start = time.perf_counter()
    _check_source(cfg)
    if cfg.linear_attention == "fla":  # before any weight is read; only hybrid targets use it
        try:
            resolve_backend("fla", device)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    model_dir: Optional[Path] = None
    if cfg.kind == "gguf":
        model_dir = gguf_hf_dir(cfg.path)
        model = _load_pretrained(model_dir, dtype, device)
        source = f"gguf {cfg.path or assets.SMOLLM2_GGUF} via {model_dir}"
    elif cfg.kind == "hf":
        model_dir = Path(cfg.path)
        model = _load_pretrained(model_dir, dtype, device)
        source = f"hf {model_dir}"
    else:
        model = _finish(build_random_model(cfg, dtype, device), device)
        source = f"random {cfg.arch} ({type(model).__name__}, seed {cfg.seed})"
    num_layers = len(_decoder(model).layers)
    ids = resolve_layer_ids(cfg.layer_ids, num_layers, num_drafter_layers)
    target = TargetModel(model, ids, model_dir=model_dir, linear_attention=cfg.linear_attention)
    logger.info("target %s: %s, %.1fM params, N=%d D=%d V=%d, layer_ids=%s, %s on %s, loaded in %.1f s",
                source, type(model).__name__, target.num_parameters() / 1e6, target.num_layers,
                target.hidden_size, target.vocab_size, ids, str(dtype).replace("torch.", ""), device,
                time.perf_counter() - start)
    return target
