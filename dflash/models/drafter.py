"""The DFlash drafter: a block-diffusion draft model conditioned on the target's hidden states.

What is trained (docs/DFLASH.md; DFlash paper, arXiv 2602.06036, §3):

* **Context features.** The outputs of ``L`` chosen target layers, concatenated per position
  (``[R, S, L·D]``), go through ``fc`` (Linear ``L·D → D``, no bias) and ``hidden_norm``
  (RMSNorm) once per forward: ``ctx [R, S, D]``.
* **Blocks.** Every anchor ``a`` of a row opens a block of ``B`` tokens
  ``[input_ids[a], MASK × (B − 1)]`` at positions ``position_ids[a] + k`` (k = 0 … B−1).
* **Layers.** ``num_hidden_layers`` Qwen3-style decoder layers (pre-RMSNorm, per-head q/k
  RMSNorm, RoPE, SwiGLU MLP). Queries come only from the block tokens; keys and values come from
  ``[ctx ; block tokens]`` through the same ``k_proj`` / ``v_proj`` (*KV injection*). A block sees
  the context positions ``j < a`` of its own conversation and nothing of other blocks. A
  ``full_attention`` layer is bidirectional inside the block; a ``sliding_attention`` layer is
  causal inside the block with a window of ``W`` key positions that counts the query itself, as
  the serving engines run it. The mask lives in :mod:`dflash.models.masks`.
* **Shared, frozen.** ``embed_tokens`` and ``lm_head`` are the target's. They are held as plain
  attributes, *not* registered sub-modules: they never appear in ``parameters()``,
  ``state_dict()``, the optimizer, DDP's buckets or the checkpoint.

Mask token. Every serving engine embeds the ``B − 1`` mask positions by looking
``dflash_config.mask_token_id`` up in the target's embedding, so the drafter trains with exactly
that: the frozen target row ``embed_tokens.weight[mask_token_id]``, an integer id always.
:func:`resolve_mask_token_id` picks the first unused embedding row when the target has one
(Qwen3: 151669); when every row is a token (SmolLM2: 49,152 tokens, 49,152 rows) it picks an
existing special token of the target's config (unk, then pad, eos, bos: SpecForge likewise falls
back to a pad / eos / unk id; the last row when the config names none), so that every engine
reproduces training exactly.

Checkpoint format (docs/DFLASH.md, Checkpoint format): a Hugging Face directory with ``config.json``
(``architectures: ["DFlashDraftModel"]``, ``block_size``, ``num_target_layers``,
``dflash_config: {mask_token_id, target_layer_ids}`` and the Qwen3 fields) and
``model.safetensors`` whose tensor names follow the public DFlash drafters (``fc.weight``,
``hidden_norm.weight``, ``layers.{i}.self_attn.q_proj.weight``, …, ``norm.weight``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from dflash.models.masks import FULL_ATTENTION, SLIDING_ATTENTION, AttentionMask, drafter_attention_masks
from dflash.utils import atomic_directory

__all__ = [
    "ARCHITECTURE",
    "AUTO_MAP",
    "CONFIG_FILE",
    "MODELING_FILE",
    "WEIGHTS_FILE",
    "DFlashConfig",
    "DFlashDraftModel",
    "default_target_layer_ids",
    "mask_fallback_token_ids",
    "resolve_mask_token_id",
    "write_drafter_directory",
]

logger = logging.getLogger(__name__)

#: ``architectures`` entry of ``config.json`` that DFlash-aware engines look for.
ARCHITECTURE = "DFlashDraftModel"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
#: Smallest head dim flex_attention's CUDA kernel takes.
FLEX_MIN_HEAD_DIM = 16
#: Std of the normal init of the drafter's linear layers (Qwen3 ``initializer_range``).
DEFAULT_INIT_STD = 0.02
_LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
#: ``config.json`` keys read but never carried over: ``is_causal`` would force one causality on every
#: layer (vLLM ``_dflash_layer_causal``, the reference model; refused on read when it contradicts
#: ``layer_types``), ``auto_map`` is written only beside the modeling file it names.
_DROPPED_KEYS = ("is_causal", "auto_map")
#: File name of the modeling code shipped beside exported weights (``auto_map`` points at it).
MODELING_FILE = "modeling_dflash.py"
#: ``auto_map`` of an exported drafter: ``AutoModel.from_pretrained(dir, trust_remote_code=True)``.
AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}
#: dtypes :meth:`DFlashDraftModel.save_pretrained` writes.
SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _check_causality(data: dict[str, Any]) -> None:
    """Refuse a ``config.json`` whose global causality override contradicts ``layer_types``.

    vLLM (``_dflash_layer_causal``) and the reference model let ``is_causal`` (or vLLM's
    ``dflash_config.causal``) force one causality on every layer; this drafter runs sliding layers
    causal and full layers bidirectional, so an override is accepted only where it agrees.

    Raises:
        ValueError: naming the field.
    """
    layer_types = data.get("layer_types") or [FULL_ATTENTION] * int(data.get("num_hidden_layers") or 0)
    for name, value in (("is_causal", data.get("is_causal")),
                        ("dflash_config.causal", (data.get("dflash_config") or {}).get("causal"))):
        if value is None:
            continue
        wrong = [i for i, t in enumerate(layer_types) if bool(value) != (t == SLIDING_ATTENTION)]
        if wrong:
            raise ValueError(f"config.json: {name}={value} makes layer(s) {wrong} "
                             f"{'causal' if value else 'bidirectional'}, but this drafter runs sliding_attention "
                             f"layers causal and full_attention layers bidirectional (layer_types {layer_types})")


# --------------------------------------------------------------------------- config helpers


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layer ids fused into the context features: :func:`dflash.models.target.default_layer_ids`
    (the one rule; ids valid under the engines' ``hidden_states[id + 1]`` indexing).

    Raises:
        ValueError: ``num_target_layers < 1`` or ``num_draft_layers < 1``, or the rule names no valid layer.
    """
    from dflash.models.target import default_layer_ids

    return default_layer_ids(num_target_layers, num_draft_layers)


def mask_fallback_token_ids(target_config: Any) -> list[int]:
    """Existing token ids a drafter may use as its mask token, best first: ``[unk, pad, eos, bos]``.

    Read from the target's Hugging Face config (a multimodal config's text part first); missing or
    ``None`` ids are skipped, a list-valued ``eos_token_id`` contributes its first entry. unk comes
    first because a chat template never emits it, so an anchor token is (almost) never the mask
    token; SpecForge falls back to the pad / eos / unk id for the same job.
    """
    configs = [target_config]
    if hasattr(target_config, "get_text_config"):
        configs.insert(0, target_config.get_text_config())
    out: list[int] = []
    for name in ("unk_token_id", "pad_token_id", "eos_token_id", "bos_token_id"):
        for c in configs:
            value = getattr(c, name, None)
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if isinstance(value, int) and not isinstance(value, bool) and value not in out:
                out.append(value)
                break
    return out


def resolve_mask_token_id(requested: Optional[int], tokenizer_size: int, embedding_rows: int,
                          fallback_ids: Sequence[int] = ()) -> int:
    """Pick the drafter's mask token id: always an integer row of the target's embedding.

    Args:
        requested: ``drafter.mask_token_id`` (``None`` = choose).
        tokenizer_size: ``len(tokenizer)``: ids ``>=`` this are never emitted by the tokenizer.
        embedding_rows: rows of the target's input embedding.
        fallback_ids: existing token ids to use when the embedding has no unused row, best first
            (:func:`mask_fallback_token_ids`).

    Returns:
        ``requested`` when given; else the first unused row (``tokenizer_size``) when the
        embedding has one (Qwen3: 151669); else the first of ``fallback_ids`` that is a row; else
        (a config naming no special token, e.g. a random test target) the last row, with a
        warning.

    Raises:
        ValueError: ``requested`` is not a row of the embedding (naming ``drafter.mask_token_id``).
    """
    if requested is not None:
        if not 0 <= requested < embedding_rows:
            raise ValueError(f"drafter.mask_token_id: {requested} is not a row of the target's {embedding_rows}-row "
                             f"embedding (engines embed the mask token with the target's embedding)")
        return int(requested)
    if tokenizer_size < embedding_rows:
        return int(tokenizer_size)
    for candidate in fallback_ids:
        if 0 <= candidate < embedding_rows:
            return int(candidate)
    logger.warning("the target's %d-row embedding has no unused row and its config names no unk / pad / eos / bos "
                   "token: the mask token is the last row, %d (set drafter.mask_token_id to choose)",
                   embedding_rows, embedding_rows - 1)
    return int(embedding_rows - 1)


@dataclass
class DFlashConfig:
    """Shape and DFlash settings of a drafter; serialised as a Hugging Face ``config.json``.

    A plain dataclass (no ``transformers.PretrainedConfig``: its constructor changed between
    transformers 5.17 and 5.24). :meth:`to_hf_dict` writes the Qwen3 fields DFlash-aware engines
    read, :meth:`from_hf_dict` reads them back.

    ``hidden_size`` is the target's (the drafter shares its embedding and LM head);
    ``num_hidden_layers`` counts *drafter* layers; ``num_target_layers`` the target's.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_hidden_layers: int
    num_target_layers: int
    target_layer_ids: list[int]
    block_size: int = 16
    #: Row of the target's embedding that embeds the mask positions (:func:`resolve_mask_token_id`).
    mask_token_id: Optional[int] = None
    #: One of ``full_attention`` / ``sliding_attention`` per drafter layer; ``None`` = all full.
    layer_types: Optional[list[str]] = None
    sliding_window: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    initializer_range: float = DEFAULT_INIT_STD
    #: Weight dtype written to ``config.json`` (``float32`` / ``bfloat16`` / ``float16``).
    dtype: str = "float32"
    #: Extra keys read from a ``config.json`` that this class does not model (kept on save).
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = [FULL_ATTENTION] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.validate()

    def validate(self) -> None:
        """Check shapes and settings.

        Raises:
            ValueError: naming the bad field.
        """
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "vocab_size", "num_hidden_layers", "num_target_layers", "sliding_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"DFlashConfig.{name}: must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError(f"DFlashConfig.block_size: must be >= 2, got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"DFlashConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"DFlashConfig.head_dim: must be even for RoPE, got {self.head_dim}")
        from dflash.models.target import check_layer_ids

        try:
            check_layer_ids(self.target_layer_ids, self.num_target_layers)
        except ValueError as exc:
            raise ValueError(f"DFlashConfig.target_layer_ids: {exc}") from None
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"DFlashConfig.layer_types: {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")
        bad = [t for t in self.layer_types if t not in _LAYER_TYPES]
        if bad:
            raise ValueError(f"DFlashConfig.layer_types: unknown type(s) {bad}; use {list(_LAYER_TYPES)}")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ValueError(f"DFlashConfig.mask_token_id: must be >= 0, got {self.mask_token_id}")

    @property
    def num_fused_layers(self) -> int:
        """``L``: target layers concatenated into the context features."""
        return len(self.target_layer_ids)

    # ----------------------------------------------------------------------- (de)serialisation

    def to_hf_dict(self, dtype: Optional[str] = None) -> dict[str, Any]:
        """The ``config.json`` content: the Qwen3 fields plus the DFlash ones engines read.

        Attention semantics are stated the way engines read them: ``layer_types`` (vLLM's
        ``_dflash_layer_causal`` makes a layer causal exactly when its entry is
        ``sliding_attention``, SGLang runs it as a causal decoder layer, full layers
        non-causal), ``use_sliding_window``, ``sliding_window`` (the window in key positions,
        the query's own included; ``null`` when no layer slides, as transformers' Qwen3Config
        sets it) and ``max_window_layers``. No global ``is_causal`` / ``dflash_config.causal`` is
        written: either would override the per-layer causality in vLLM and the reference model.

        Args:
            dtype: the weights' dtype to state (``dtype`` and ``torch_dtype``); default
                ``self.dtype``.

        Raises:
            ValueError: ``mask_token_id`` is not set (engines need an integer).
        """
        if self.mask_token_id is None:
            raise ValueError("DFlashConfig.mask_token_id: engines need an integer mask token id, got None")
        dtype = dtype or self.dtype
        sliding = SLIDING_ATTENTION in self.layer_types
        out: dict[str, Any] = {k: v for k, v in self.extra.items() if k not in _DROPPED_KEYS}
        out.update({
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_scaling": None,
            "vocab_size": self.vocab_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "use_sliding_window": sliding,
            "sliding_window": self.sliding_window if sliding else None,
            "max_window_layers": self.num_hidden_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
            "dtype": dtype,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token_id": int(self.mask_token_id),
                "target_layer_ids": list(self.target_layer_ids),
                "block_size": self.block_size,
            },
        })
        return out

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> "DFlashConfig":
        """Read a ``config.json`` written by :meth:`to_hf_dict` (or a public DFlash drafter's).

        Raises:
            ValueError: a required field is missing, or the values are inconsistent.
        """
        dflash = dict(data.get("dflash_config") or {})
        _check_causality(data)
        known = {f.name for f in dataclasses.fields(cls)} - {"extra", "target_layer_ids", "mask_token_id"}
        kwargs: dict[str, Any] = {}
        for name in known:
            if name in data and data[name] is not None:
                kwargs[name] = data[name]
        if "rope_theta" not in kwargs and isinstance(data.get("rope_parameters"), dict):
            theta = data["rope_parameters"].get("rope_theta")
            if theta is not None:
                kwargs["rope_theta"] = theta
        if "dtype" not in kwargs and data.get("torch_dtype"):
            kwargs["dtype"] = data["torch_dtype"]
        if "head_dim" not in kwargs and "hidden_size" in data and "num_attention_heads" in data:
            kwargs["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
        missing = [n for n in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                               "vocab_size", "num_hidden_layers", "num_target_layers") if n not in kwargs]
        if missing:
            raise ValueError(f"config.json: missing DFlash drafter field(s) {missing}")
        layer_ids = dflash.get("target_layer_ids")
        if layer_ids is None:
            layer_ids = default_target_layer_ids(int(kwargs["num_target_layers"]), int(kwargs["num_hidden_layers"]))
        written = set(cls(**{**kwargs, "target_layer_ids": layer_ids, "mask_token_id": 0}).to_hf_dict())
        extra = {k: v for k, v in data.items() if k not in written and k not in _DROPPED_KEYS}
        return cls(**kwargs, target_layer_ids=layer_ids, mask_token_id=dflash.get("mask_token_id"), extra=extra)

    @classmethod
    def from_target(cls, target_config: Any, drafter_cfg: Any, target_layer_ids: Optional[list[int]] = None,
                    mask_token_id: Optional[int] = None, dtype: str = "float32") -> "DFlashConfig":
        """Build the drafter's config from the target's Hugging Face config and ``DrafterConfig``.

        Args:
            target_config: the target's ``transformers`` config (Qwen3, Llama, …; a multimodal
                config's text part is used).
            drafter_cfg: :class:`dflash.config.DrafterConfig` (``num_layers``, ``block_size``,
                ``layer_types``, ``sliding_window``, ``intermediate_size``).
            target_layer_ids: the fused layer ids (``None`` = :func:`default_target_layer_ids`).
            mask_token_id: already resolved (:func:`resolve_mask_token_id`).

        Only default RoPE is modelled: a target with RoPE scaling logs a warning.
        """
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        heads = int(tc.num_attention_heads)
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
        rope = getattr(tc, "rope_parameters", None) or {}
        theta = getattr(tc, "rope_theta", None) or rope.get("rope_theta") or 10000.0
        scaling = getattr(tc, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            logger.warning("target RoPE type %r is not modelled by the drafter, which uses default RoPE "
                           "(theta=%s)", rope_type, theta)
        n_target = int(tc.num_hidden_layers)
        ids = list(target_layer_ids) if target_layer_ids is not None else default_target_layer_ids(
            n_target, drafter_cfg.num_layers)
        return cls(
            hidden_size=int(tc.hidden_size),
            intermediate_size=int(drafter_cfg.intermediate_size or tc.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            vocab_size=int(tc.vocab_size),
            num_hidden_layers=int(drafter_cfg.num_layers),
            num_target_layers=n_target,
            target_layer_ids=ids,
            block_size=int(drafter_cfg.block_size),
            mask_token_id=mask_token_id,
            layer_types=list(drafter_cfg.layer_types) if drafter_cfg.layer_types else None,
            sliding_window=int(drafter_cfg.sliding_window),
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=int(getattr(tc, "max_position_embeddings", 40960)),
            dtype=dtype,
        )


# --------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) · weight`` over the last dim, computed in fp32, returned in x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        # Output in the input's dtype (bf16 under autocast): an fp32 weight must not promote it.
        return self.weight.to(dtype) * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """Default RoPE (Su et al.; Qwen3): ``cos, sin [..., head_dim]`` for integer positions."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``positions [R, T]`` int64 → ``(cos, sin)`` each ``[R, 1, T, head_dim]`` in ``dtype``."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [R, T, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + _rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Block queries over ``[context ; block]`` keys/values (KV injection, docs/DFLASH.md)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, rope_q: tuple[Tensor, Tensor], rope_kv: tuple[Tensor, Tensor],
                mask: AttentionMask) -> Tensor:
        """One attention sub-layer.

        Args:
            x: normed block hidden states ``[R, Q, D]`` (``Q = A·B``).
            ctx: context features ``[R, S, D]`` (already ``fc`` + ``hidden_norm``).
            rope_q: ``(cos, sin)`` of the block positions, ``[R, 1, Q, hd]``.
            rope_kv: ``(cos, sin)`` of ``[context ; block]`` positions, ``[R, 1, S + Q, hd]``.
            mask: dense bool ``[R, 1, Q, S + Q]`` (SDPA) or a flex_attention ``BlockMask``.

        Returns:
            ``[R, Q, D]``.
        """
        r, q_len, _ = x.shape
        kv_in = torch.cat([ctx.to(x.dtype), x], dim=1)  # [R, S + Q, D]
        kv_len = kv_in.shape[1]
        q = self.q_norm(self.q_proj(x).view(r, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(r, kv_len, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(r, kv_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = _apply_rope(q, rope_q[0].to(q.dtype), rope_q[1].to(q.dtype))
        k = _apply_rope(k, rope_kv[0].to(k.dtype), rope_kv[1].to(k.dtype))
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        if isinstance(mask, Tensor):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                                 enable_gqa=self.num_heads != self.num_kv_heads)
        else:
            out = _flex_attention(q, k, v, mask, self.scale, self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(r, q_len, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    """Qwen3 MLP: ``down(silu(gate(x)) · up(x))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``x + attn(norm(x), ctx)``, then ``x + mlp(norm(x))``.

    The context features enter every layer's ``k_proj`` / ``v_proj`` unnormed by the layer
    (they were normed once by ``hidden_norm``), as in the public DFlash drafters.
    """

    def __init__(self, cfg: DFlashConfig, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = DFlashAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, rope_q: tuple[Tensor, Tensor], rope_kv: tuple[Tensor, Tensor],
                mask: AttentionMask) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


# --------------------------------------------------------------------------- flex_attention

_compiled_flex: Optional[Any] = None


def _flex_attention(q: Tensor, k: Tensor, v: Tensor, block_mask: Any, scale: float, gqa: bool) -> Tensor:
    """flex_attention, compiled on CUDA (eager flex materialises the full score matrix).

    Inside an outer ``torch.compile`` region the plain function is traced into that graph.
    On CPU the eager (unfused) implementation runs: tests only.

    ``FORCE_USE_FLEX_ATTENTION``: under 128 queries inductor would pick its flex-decoding kernel,
    which accepts no block mask tiled like ours (``dflash.models.masks.FLEX_TILE`` for queries and
    keys) and fails to lower ("No choices to select"); the main kernel handles any query length.
    """
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if q.is_cuda and not torch.compiler.is_compiling():
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    else:
        fn = flex_attention
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa,
              kernel_options={"FORCE_USE_FLEX_ATTENTION": True})


# --------------------------------------------------------------------------- the drafter


class DFlashDraftModel(nn.Module):
    """The DFlash drafter (docs/DFLASH.md; DFlash paper, arXiv 2602.06036, §3).

    Args:
        config: shapes and DFlash settings.
        embed_tokens: the target's input embedding (``nn.Embedding``, ``[V, D]``); frozen, shared.
        lm_head: the target's output head (``nn.Linear`` ``D → V``); frozen, shared. Not used by
            :meth:`forward` (the loss applies it in chunks), kept for callers.
        attention: ``auto`` (flex_attention on CUDA, dense SDPA mask on CPU; see
            :meth:`attention_backend`), ``flex`` or ``sdpa``.
        gradient_checkpointing: recompute each decoder layer in the backward pass instead of
            keeping its activations (gigabytes per packed row and layer at A = 512, B = 16 for a
            Qwen3-8B-sized drafter), at the cost of one more forward pass of the layers.
            Settable later as an attribute.

    Both shared modules get ``requires_grad_(False)`` and are stored outside the module tree, so
    ``model.to(...)`` does not move or cast them (they may be the target's own modules): put them
    on the drafter's device yourself.

    Raises:
        ValueError: the embedding width is not ``config.hidden_size``, or ``attention`` is unknown.
    """

    def __init__(self, config: DFlashConfig, embed_tokens: nn.Module, lm_head: nn.Module,
                 attention: str = "auto", gradient_checkpointing: bool = False) -> None:
        super().__init__()
        if attention not in ("auto", "flex", "sdpa"):
            raise ValueError(f"attention: must be auto, flex or sdpa, got {attention!r}")
        emb_weight = embed_tokens.weight
        if emb_weight.shape[1] != config.hidden_size:
            raise ValueError(f"embed_tokens width {emb_weight.shape[1]} != config.hidden_size {config.hidden_size}")
        self.config = config
        self.attention = attention
        self.gradient_checkpointing = gradient_checkpointing
        self.block_size = config.block_size
        embed_tokens.requires_grad_(False)
        lm_head.requires_grad_(False)
        # Plain attributes, not sub-modules: outside parameters(), state_dict() and the optimizer.
        object.__setattr__(self, "embed_tokens", embed_tokens)
        object.__setattr__(self, "lm_head", lm_head)

        d = config.hidden_size
        self.fc = nn.Linear(config.num_fused_layers * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, t) for t in config.layer_types)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)

        rows = emb_weight.shape[0]
        mid = config.mask_token_id
        if mid is None or not 0 <= mid < rows:
            raise ValueError(f"DFlashConfig.mask_token_id: must be a row of the target's {rows}-row embedding "
                             f"(engines embed the mask token with it), got {mid}")
        self.reset_parameters()

    # ----------------------------------------------------------------------- parameters

    def reset_parameters(self) -> None:
        """Linear weights ~ N(0, initializer_range), norms = 1."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def num_trainable_params(self) -> int:
        """Parameters that train (the shared embedding and LM head are not among them)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    # ----------------------------------------------------------------------- forward

    def block_embeddings(self, input_ids: Tensor, anchors: Tensor) -> Tensor:
        """Embeddings of the blocks ``[input_ids[a], MASK × (B − 1)]``: ``[R, A, B, D]``.

        MASK is the target's frozen row ``embed_tokens.weight[mask_token_id]``, as every engine
        embeds it."""
        r, a = anchors.shape
        anchor_tok = input_ids.gather(1, anchors)  # [R, A]
        first = self.embed_tokens(anchor_tok).unsqueeze(2)  # [R, A, 1, D]
        mask_vec = self.embed_tokens.weight[self.config.mask_token_id]
        rest = mask_vec.to(first.dtype).expand(r, a, self.block_size - 1, first.shape[-1])
        return torch.cat([first, rest], dim=2)

    def attention_backend(self, device: torch.device) -> str:
        """``flex`` or ``sdpa`` for tensors on ``device``.

        ``auto`` picks flex_attention on CUDA when ``head_dim >= 16`` (its Triton kernel's
        minimum), else the dense SDPA mask.
        """
        if self.attention != "auto":
            return self.attention
        return "flex" if device.type == "cuda" and self.config.head_dim >= FLEX_MIN_HEAD_DIM else "sdpa"

    def forward(self, context_features: Tensor, input_ids: Tensor, position_ids: Tensor, doc_ids: Tensor,
                anchors: Tensor, anchor_keep: Tensor,
                attn_masks: Optional[dict[str, AttentionMask]] = None) -> Tensor:
        """Final-normed hidden states of every block token.

        Args:
            context_features: ``[R, S, L·D]`` target features (bf16 on GPU, fp32 on CPU).
            input_ids: ``[R, S]`` int64.
            position_ids: ``[R, S]`` int64, per conversation; block positions are
                ``position_ids[a] + k``.
            doc_ids: ``[R, S]`` int (0 = padding).
            anchors: ``[R, A]`` int64 anchor positions (padded entries point at any valid index).
            anchor_keep: ``[R, A]`` bool; a dropped block sees only itself (its outputs are
                finite but meaningless and get zero loss weight).
            attn_masks: prebuilt masks per layer type (see
                :func:`dflash.models.masks.drafter_attention_masks`); ``None`` = build them here.

        Returns:
            ``[R, A, B, D]`` hidden states; ``logits = lm_head(hidden)`` (the loss does it in chunks).

        Raises:
            ValueError: mismatched shapes.
        """
        r, s = input_ids.shape
        num_anchors = anchors.shape[1]
        b = self.block_size
        if context_features.shape[:2] != (r, s) or position_ids.shape != (r, s) or doc_ids.shape != (r, s):
            raise ValueError(f"batch tensors disagree: features {tuple(context_features.shape)}, input_ids "
                             f"{(r, s)}, position_ids {tuple(position_ids.shape)}, doc_ids {tuple(doc_ids.shape)}")
        if anchors.shape != anchor_keep.shape or anchors.shape[0] != r:
            raise ValueError(f"anchors {tuple(anchors.shape)} / anchor_keep {tuple(anchor_keep.shape)} for {r} rows")
        expect = self.config.num_fused_layers * self.config.hidden_size
        if context_features.shape[-1] != expect:
            raise ValueError(f"context_features last dim {context_features.shape[-1]} != L·D = {expect}")

        ctx = self.hidden_norm(self.fc(context_features))  # [R, S, D]
        x = self.block_embeddings(input_ids, anchors).reshape(r, num_anchors * b, -1)  # [R, Q, D]

        offsets = torch.arange(b, device=anchors.device)
        block_pos = (position_ids.gather(1, anchors).unsqueeze(-1) + offsets).reshape(r, num_anchors * b)
        cos_kv, sin_kv = self.rotary_emb(torch.cat([position_ids, block_pos], dim=1), dtype=torch.float32)
        rope_kv = (cos_kv, sin_kv)
        rope_q = (cos_kv[:, :, s:], sin_kv[:, :, s:])

        if attn_masks is None:
            attn_masks = drafter_attention_masks(self, anchors, anchor_keep, doc_ids)
        checkpointing = self.gradient_checkpointing and torch.is_grad_enabled()
        for layer in self.layers:
            mask = attn_masks[layer.layer_type]
            if checkpointing:
                x = torch.utils.checkpoint.checkpoint(layer, x, ctx, rope_q, rope_kv, mask, use_reentrant=False)
            else:
                x = layer(x, ctx, rope_q, rope_kv, mask)
        return self.norm(x).reshape(r, num_anchors, b, -1)

    # ----------------------------------------------------------------------- checkpoint

    def save_pretrained(self, directory: Union[str, os.PathLike],
                        state_dict: Optional[dict[str, Tensor]] = None, dtype: Optional[str] = None,
                        modeling_file: bool = False) -> Path:
        """Write the drafter as a Hugging Face directory (:func:`write_drafter_directory`), atomically.

        Args:
            directory: the HF directory to write.
            state_dict: the weights to write instead of the live ones (a host snapshot taken
                earlier, :class:`dflash.training.checkpoint.CheckpointWriter`); same keys as
                :meth:`state_dict`.
            dtype: ``float32`` / ``bfloat16`` weights (default: the config's ``dtype``).
            modeling_file: also ship :data:`MODELING_FILE` and ``auto_map`` (serving export).

        Returns:
            the directory.
        """
        source = self.state_dict() if state_dict is None else state_dict
        target = write_drafter_directory(directory, self.config, source, dtype=dtype, modeling_file=modeling_file)
        logger.info("saved drafter (%d params) to %s", self.num_trainable_params(), target)
        return target

    @classmethod
    def load_config(cls, directory: Union[str, os.PathLike]) -> DFlashConfig:
        """Read ``directory/config.json``.

        Raises:
            FileNotFoundError: no config.json.
            ValueError: not a DFlash drafter config, or a drafter trained with its own learned mask
                vector (``dflash_config.mask_embedding``), which no engine can serve.
        """
        path = Path(directory) / CONFIG_FILE
        data = json.loads(path.read_text())
        if ARCHITECTURE not in (data.get("architectures") or []):
            raise ValueError(f"{path}: architectures {data.get('architectures')} does not name {ARCHITECTURE}")
        flags = data.get("dflash_config") or {}
        if flags.get("mask_embedding") or flags.get("mask_token_id") is None:
            raise ValueError(f"{path}: {LEARNED_MASK_MESSAGE}")
        return DFlashConfig.from_hf_dict(data)

    @classmethod
    def from_pretrained(cls, directory: Union[str, os.PathLike], embed_tokens: nn.Module, lm_head: nn.Module,
                        attention: str = "auto", device: Optional[Union[str, torch.device]] = None
                        ) -> "DFlashDraftModel":
        """Load a drafter saved by :meth:`save_pretrained` around the target's embedding and head.

        Weights are loaded in fp32 (a bf16 export is upcast).

        Raises:
            FileNotFoundError: missing files.
            ValueError: not a DFlash config, or a drafter with a learned mask vector.
            RuntimeError: the weights do not match the config (strict loading).
        """
        from safetensors.torch import load_file

        cfg = cls.load_config(directory)
        model = cls(cfg, embed_tokens, lm_head, attention=attention)
        state = load_file(str(Path(directory) / WEIGHTS_FILE), device=str(device) if device else "cpu")
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
        if device is not None:
            model.to(device)
        return model


#: Why a drafter with ``dflash_config.mask_embedding`` / ``mask_token_id: null`` is refused.
LEARNED_MASK_MESSAGE = (
    "this drafter was trained with its own learned mask vector (dflash_config.mask_embedding, "
    "mask_token_id null): no serving engine embeds the mask positions that way, so it cannot be served "
    "as trained. Train it again: the mask token is an integer id whose frozen target "
    "embedding row is the mask (see drafter.mask_token_id).")


def modeling_source() -> str:
    """The text of the self-contained modeling file shipped with an export (:data:`MODELING_FILE`)."""
    return (Path(__file__).with_name(MODELING_FILE)).read_text()


def _match_umask(path: Path) -> None:
    """Give ``path`` the mode a plain file gets under the process umask (safetensors writes 0600,
    which a serving engine running as another user cannot read)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_drafter_directory(directory: Union[str, os.PathLike], config: DFlashConfig, state: dict[str, Tensor],
                            dtype: Optional[str] = None, modeling_file: bool = False) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (+ the modeling file) into ``directory``, atomically.

    Files go to a temporary sibling directory first, flushed to disk, which then replaces
    ``directory`` (:func:`dflash.utils.atomic_directory`: an existing one is moved aside and
    deleted only after the rename). Holds no embedding and no LM
    head. Floating-point tensors are cast to ``dtype``; ``config.json`` states it (``dtype`` and
    ``torch_dtype``). With ``modeling_file`` the directory also holds :data:`MODELING_FILE` and
    the config an ``auto_map`` naming it, so ``transformers.AutoModel.from_pretrained(directory,
    trust_remote_code=True)`` builds the drafter.

    Args:
        directory: the HF directory to write.
        config: the drafter's config (``mask_token_id`` must be set).
        state: ``{name: tensor}`` under the public DFlash names.
        dtype: ``float32`` or ``bfloat16`` (default: ``config.dtype``).
        modeling_file: ship the modeling file and ``auto_map``.

    Returns:
        the directory.

    Raises:
        ValueError: an unknown ``dtype`` or no mask token id.
    """
    from safetensors.torch import save_file

    dtype = dtype or config.dtype
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype: must be one of {sorted(SAVE_DTYPES)}, got {dtype!r}")
    cfg = config.to_hf_dict(dtype=dtype)
    if modeling_file:
        cfg["auto_map"] = dict(AUTO_MAP)
    cast = SAVE_DTYPES[dtype]
    tensors = {k: (v.detach().to("cpu", cast) if v.is_floating_point() else v.detach().to("cpu")).contiguous()
               for k, v in state.items()}
    target = Path(directory)
    with atomic_directory(target, replace=True) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        _match_umask(tmp / WEIGHTS_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        if modeling_file:
            (tmp / MODELING_FILE).write_text(modeling_source())
    return target
