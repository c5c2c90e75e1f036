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
from dflash.models.target import TargetInfo, TargetModel, _decoder, layer_types_of, text_config

__all__ = ["resolve_dtype", "describe_target", "target_layer_types", "load_embedding_and_head", "load_target"]

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


def _source_text_config(cfg: TargetConfig):
    """The (text) transformers config of a ``random`` or ``hf`` target, read without weights."""
    if cfg.kind == "random":
        return text_config(build_random_config(cfg.arch, cfg.arch_overrides))
    from transformers import AutoConfig

    return text_config(AutoConfig.from_pretrained(cfg.path))


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
        tc = _source_text_config(cfg)
        n, d, v, mtype = tc.num_hidden_layers, tc.hidden_size, tc.vocab_size, tc.model_type
    ids = resolve_layer_ids(cfg.layer_ids, n, num_drafter_layers)
    return TargetInfo(num_layers=int(n), hidden_size=int(d), vocab_size=int(v), layer_ids=tuple(ids),
                      model_type=str(mtype))


def target_layer_types(cfg: TargetConfig) -> list[str]:
    """The configured target's ``layer_types`` (``full_attention`` / ``sliding_attention`` /
    ``linear_attention``), read from its config without weights; a GGUF (llama) target's are all
    ``full_attention``.

    Raises:
        ConfigError / FileNotFoundError: as :func:`describe_target`.
    """
    _check_source(cfg)
    if cfg.kind == "gguf":
        n = gguf_dims(resolve_gguf_path(cfg.path))[0]
        return ["full_attention"] * int(n)
    tc = _source_text_config(cfg)
    return layer_types_of(tc, int(tc.num_hidden_layers))


# --------------------------------------------------------------------------- loading

def _finish(model: nn.Module, device: torch.device) -> nn.Module:
    model.eval()
    model.requires_grad_(False)
    model.config.use_cache = False
    if next(model.parameters()).device != device:
        model.to(device)
    return model


#: Where a Hugging Face checkpoint keeps the token embedding: a ``*ForCausalLM`` directory, or a
#: multimodal one whose text model is nested (Qwen3.5 / Qwen3.6 ``*ForConditionalGeneration``).
EMBEDDING_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
#: The LM head's key in either form.
LM_HEAD_KEY = "lm_head.weight"


def _ties_embeddings(config) -> bool:
    """Whether a checkpoint's LM head is its token embedding: ``tie_word_embeddings`` set on the
    config or on its text part. A multimodal config (``Qwen3_5Config``) carries the flag at its top
    level while its ``text_config`` keeps its own default, and ``AutoModelForCausalLM`` reads only
    the latter."""
    return any(bool(getattr(c, "tie_word_embeddings", False)) for c in (config, text_config(config)))


def _load_pretrained(path: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` on the host, then moved to ``device`` (transformers
    5.x refuses a ``device_map`` or a device context without ``accelerate``).

    A ``*ForConditionalGeneration`` directory (text model under ``model.language_model``, a vision
    tower beside it) loads as its text ``*ForCausalLM``: transformers maps the nested keys and
    leaves the vision tower out. transformers fills a weight the files lack with a random
    initialisation and only logs it; here that is an error, except an LM head that the config ties
    to the embedding, which is then tied (transformers leaves it random when only the top-level
    config of a multimodal directory says so).

    Raises:
        ValueError: the files lack a weight of the model, hold one of the wrong shape, or could not
            be loaded.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                       output_loading_info=True)
    missing = set(info.get("missing_keys") or ())
    if (LM_HEAD_KEY in missing and model.get_output_embeddings() is not None
            and _ties_embeddings(AutoConfig.from_pretrained(path))):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
        model.config.tie_word_embeddings = True
        missing.discard(LM_HEAD_KEY)
        logger.info("%s: no %s in its files, and its config.json ties it (tie_word_embeddings): the LM head "
                    "is the token embedding, not the random one transformers reports", path, LM_HEAD_KEY)
    problems = []
    if missing:
        problems.append(f"missing from its files (transformers would leave them random): {sorted(missing)}")
    if info.get("mismatched_keys"):
        problems.append(f"of another shape than the model's: {sorted(map(str, info['mismatched_keys']))}")
    if info.get("error_msgs"):
        problems.append(f"load errors: {list(info['error_msgs'])}")
    if problems:
        raise ValueError(f"{path} does not hold every weight of {type(model).__name__}; weights "
                         + "; ".join(problems))
    if info.get("unexpected_keys"):
        logger.info("%s: %d tensors not used by %s (e.g. %s)", path, len(info["unexpected_keys"]),
                    type(model).__name__, sorted(info["unexpected_keys"])[0])
    return _finish(model, device)


def _embedding_key(keys: set[str], model_dir: Path) -> str:
    """The token embedding's key among a checkpoint's tensor names (:data:`EMBEDDING_KEYS`, else the
    one name ending in ``embed_tokens.weight``).

    Raises:
        KeyError: no such name, or several and none of :data:`EMBEDDING_KEYS`.
    """
    for key in EMBEDDING_KEYS:
        if key in keys:
            return key
    found = sorted(k for k in keys if k.endswith("embed_tokens.weight"))
    if len(found) != 1:
        raise KeyError(f"{model_dir}: {'no' if not found else 'more than one'} embed_tokens.weight in its "
                       f"safetensors files{': ' + ', '.join(found) if found else ''} (expected one of "
                       f"{', '.join(EMBEDDING_KEYS)})")
    return found[0]


def _read_embedding_and_head(model_dir: Path, device: torch.device,
                             dtype: torch.dtype) -> tuple[nn.Embedding, nn.Linear]:
    """The token embedding and LM head of the Hugging Face directory ``model_dir``, read from its
    safetensors files alone (no other tensor is loaded), as :func:`_load_pretrained` loads them:
    ``lm_head.weight`` when the files have it, else the embedding itself (one shared tensor) when the
    config ties them (:func:`_ties_embeddings`); a tied config whose files hold an equal
    ``lm_head.weight`` shares one tensor too. Keys of either form (:data:`EMBEDDING_KEYS`).

    Raises:
        KeyError: no embedding in the safetensors files (or no single one), or no LM head in an
            untied checkpoint.
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    files = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                files.setdefault(key, file)
    embed_key = _embedding_key(set(files), model_dir)
    wanted = {"embed": embed_key}
    if LM_HEAD_KEY in files:
        wanted["head"] = LM_HEAD_KEY
    elif not _ties_embeddings(config):
        raise KeyError(f"{model_dir}: no {LM_HEAD_KEY} in its safetensors files and its config does not tie "
                       "the LM head to the embedding (tie_word_embeddings)")
    found: dict[str, torch.Tensor] = {}
    for name, key in wanted.items():
        with safe_open(str(files[key]), framework="pt") as f:
            found[name] = f.get_tensor(key)
    embed = nn.Embedding.from_pretrained(found["embed"].to(device=device, dtype=dtype), freeze=True)
    head = nn.Linear(embed.embedding_dim, embed.num_embeddings, bias=False, device=device, dtype=dtype)
    if "head" not in found or (_ties_embeddings(config) and torch.equal(found["head"], found["embed"])):
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
        FileNotFoundError / KeyError: the checkpoint lacks the embedding, or (untied) the LM head.
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
            ``random`` builds ``cfg.arch`` on the device. A Hugging Face directory may be a
            ``*ForCausalLM`` or a multimodal ``*ForConditionalGeneration`` (the released
            Qwen3.6-27B): its text model is loaded, the vision tower is not.
        device: where the weights live.
        dtype: weight/feature dtype; ``None`` = ``cfg.dtype`` (``auto``: bf16 on CUDA, fp32 on CPU).
        num_drafter_layers: L for the DFlash layer rule when ``cfg.layer_ids`` is not set.

    Raises:
        ConfigError: bad ``target.kind``/``arch``/``arch_overrides``/``layer_ids``, or
            ``target.linear_attention: fla`` where fla cannot run.
        FileNotFoundError: missing GGUF file or HF directory.
        ValueError: the checkpoint lacks a weight of the model or holds one of the wrong shape
            (:func:`_load_pretrained`).
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
