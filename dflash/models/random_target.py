"""Random targets at named real shapes (``target.kind: random``), for performance runs.

Weights do not change speed, so a random target at a real model's shape (:data:`RANDOM_ARCHS`)
stands in for it: built directly on the target device, seeded by ``target.seed``. Its token
embedding and LM head come from their own seeded generator, so a drafter process rebuilds exactly
the same two matrices without building the target (:func:`random_embedding_and_head`).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from dflash.config import ConfigError, TargetConfig
from dflash.models.target import FULL, LINEAR, text_config

__all__ = ["RANDOM_ARCHS", "build_random_config", "build_random_model", "random_embedding_and_head"]

logger = logging.getLogger(__name__)

#: ``*ForCausalLM`` class of each random-architecture config type.
_CAUSAL_LM_CLASS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM"}
#: std of the random embedding / LM head (transformers' initializer_range default).
_RANDOM_INIT_STD = 0.02


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



def build_random_model(cfg: TargetConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A ``*ForCausalLM`` with random weights at ``cfg.arch``'s shape, allocated and initialised
    directly on ``device`` (``torch.device`` context: 54 GB of Qwen3.6-27B bf16 never touches host
    memory), seeded by ``cfg.seed`` (transformers' init: normal(0, 0.02) linears/embeddings, unit
    norms; the embedding and LM head as :func:`random_embedding_and_head` draws them).

    Raises:
        ConfigError: unknown ``target.arch`` or a bad ``target.arch_overrides`` key.
    """
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
    return model


def random_embedding_and_head(cfg: TargetConfig, device: torch.device,
                              dtype: torch.dtype) -> tuple[nn.Embedding, nn.Linear]:
    """The token embedding ``[V, D]`` and LM head (``D → V``, no bias) of the random target ``cfg``,
    drawn exactly as :func:`build_random_model` draws them (same seed, same device type), without
    building the rest of the model. Tied weights share one tensor.

    Raises:
        ConfigError: unknown ``target.arch`` or a bad ``target.arch_overrides`` key.
    """
    config = text_config(build_random_config(cfg.arch, cfg.arch_overrides))
    vocab, hidden = config.vocab_size, config.hidden_size
    tied = bool(getattr(config, "tie_word_embeddings", False))
    embed = nn.Embedding(vocab, hidden, device=device, dtype=dtype)
    head = nn.Linear(hidden, vocab, bias=False, device=device, dtype=dtype)
    if tied:
        head.weight = embed.weight
    _init_shared_random(embed.weight, None if tied else head.weight, cfg.seed)
    return embed, head


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

