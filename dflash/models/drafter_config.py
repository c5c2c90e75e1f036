"""The drafter's configuration (:class:`DFlashConfig`, its ``config.json``) and its mask token.

Mask token. Every serving engine embeds the ``B − 1`` mask positions by looking
``dflash_config.mask_token_id`` up in the target's embedding, so the drafter trains with exactly
that: the frozen target row ``embed_tokens.weight[mask_token_id]``, an integer id always.
:func:`resolve_mask_token_id` picks the first unused embedding row when the target has one
(Qwen3: 151669); when every row is a token (SmolLM2: 49,152 tokens, 49,152 rows) it picks an
existing special token of the target's config (unk, then pad, eos, bos: SpecForge likewise falls
back to a pad / eos / unk id; the last row when the config names none), so that every engine
reproduces training exactly.

``config.json`` (docs/DFLASH.md, Checkpoint format): ``architectures: ["DFlashDraftModel"]``,
``block_size``, ``num_target_layers``, ``dflash_config: {mask_token_id, target_layer_ids}`` and the
Qwen3 fields. Target layer ids follow the one rule of :mod:`dflash.models.layer_ids`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from dflash.models.layer_ids import check_layer_ids, default_layer_ids
from dflash.models.target import text_config
from dflash.models.masks import FULL_ATTENTION, SLIDING_ATTENTION

__all__ = [
    "ARCHITECTURE",
    "DFlashConfig",
    "mask_fallback_token_ids",
    "resolve_mask_token_id",
]

logger = logging.getLogger(__name__)

#: ``architectures`` entry of ``config.json`` that DFlash-aware engines look for.
ARCHITECTURE = "DFlashDraftModel"
#: Std of the normal init of the drafter's linear layers (Qwen3 ``initializer_range``).
DEFAULT_INIT_STD = 0.02
_LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
#: ``config.json`` keys read but never carried over: ``is_causal`` would force one causality on every
#: layer (vLLM ``_dflash_layer_causal``, the reference model; refused on read when it contradicts
#: ``layer_types``), ``auto_map`` is written only beside the modeling file it names.
_DROPPED_KEYS = ("is_causal", "auto_map")


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
            layer_ids = default_layer_ids(int(kwargs["num_target_layers"]), int(kwargs["num_hidden_layers"]))
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
            target_layer_ids: the fused layer ids (``None`` =
                :func:`dflash.models.layer_ids.default_layer_ids`).
            mask_token_id: already resolved (:func:`resolve_mask_token_id`).

        Only default RoPE is modelled: a target with RoPE scaling logs a warning.
        """
        tc = text_config(target_config)
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
        ids = list(target_layer_ids) if target_layer_ids is not None else default_layer_ids(
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
