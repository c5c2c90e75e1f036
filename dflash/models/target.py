"""The frozen target model and the DFlash context features it computes.

The product is :meth:`TargetModel.forward_features`: for a packed batch (docs/ARCHITECTURE.md,
"The batch contract") it returns the outputs of the L chosen target layers, concatenated, and the
target's greedy next token at every position ("The target's output"). Which layers: see
:mod:`dflash.models.layer_ids`. Loading a target (GGUF, Hugging Face directory, random at a real
shape) is :mod:`dflash.models.target_loader`.

Formula: "output of layer id = ``hidden_states[id+1]``" is docs/DFLASH.md, Target layer ids
(DFlash paper arXiv 2602.06036; z-lab/dflash ``build_target_layer_ids``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from dflash.models.layer_ids import check_layer_ids
from dflash.models.linear_attention import (
    check_gated_deltanet,
    conversation_starts,
    gated_deltanet_forward,
    resolve_backend,
)

__all__ = [
    "TargetInfo",
    "TargetModel",
    "text_config",
    "layer_types_of",
    "packed_attention_mask",
]

logger = logging.getLogger(__name__)

#: Full-vocabulary logits materialised at once by the LM-head argmax, in elements
#: (2**28 = 512 MiB in bf16): ~1,080 tokens per chunk at Qwen3.6's 248,320-token vocabulary.
LM_HEAD_CHUNK_ELEMENTS: int = 1 << 28
#: Attention implementations whose 4D mask format we build (boolean for sdpa, additive for eager).
SUPPORTED_ATTENTION = ("sdpa", "eager")
#: Layer types of ``config.layer_types`` this module knows how to mask.
FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"


# --------------------------------------------------------------------------- shape (no weights)

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


def text_config(config):
    """The text part of a (possibly multimodal) transformers config; the config itself otherwise."""
    getter = getattr(config, "get_text_config", None)
    return getter() if getter is not None else config


def layer_types_of(config, num_layers: int) -> list[str]:
    """Each of the first ``num_layers`` layers' attention type, as the model's own layers apply it.

    ``config.layer_types`` when the config has it (Qwen2/3, Gemma, Qwen3.5 hybrids). Without it, a
    set ``config.sliding_window`` is applied by every layer (transformers' Mistral, Mixtral, Phi-3,
    Starcoder2 attentions pass it to each layer), unless ``config.use_sliding_window`` is false;
    otherwise every layer attends fully (Llama).

    Args:
        config: a transformers (text) config.
        num_layers: the decoder's layers.

    Returns:
        ``num_layers`` strings of ``full_attention`` / ``sliding_attention`` / ``linear_attention``
        (or whatever else the config names: callers refuse types they do not support).
    """
    given = getattr(config, "layer_types", None)
    if given:
        return list(given)[:num_layers]
    sliding = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    return [SLIDING if sliding else FULL] * num_layers


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
                 lm_head_chunk_tokens: Optional[int] = None, linear_attention: str = "auto") -> None:
        super().__init__()
        self.model = model
        self.config = text_config(model.config)
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
        types = layer_types_of(self.config, self.num_layers)
        unknown = sorted(set(types) - {FULL, SLIDING, LINEAR})
        if unknown:
            raise ValueError(f"{type(model).__name__}: layer types {unknown} are not supported")
        self.layer_types = types
        self.sliding_window = getattr(self.config, "sliding_window", None)
        #: ``fla`` / ``torch`` for the linear-attention layers (``None``: the target has none).
        self.linear_attention: Optional[str] = None
        if LINEAR in types:
            for i, layer in enumerate(self._decoder[0].layers):
                if types[i] == LINEAR:
                    _check_linear_decoder_layer(layer, f"{type(model).__name__} layer {i}")
            self.linear_attention = resolve_backend(linear_attention, self.device)
            logger.info("%s: %d linear-attention layers, each conversation of a packed row from a zero "
                        "state (%s backend)", type(model).__name__, types.count(LINEAR), self.linear_attention)
        self._run_linear = _linear_layer
        self._run_attention = _attention_layer
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

    def compile_layers(self) -> None:
        """``torch.compile`` one decoder layer of each kind (attention, linear attention), reused
        for every layer of that kind, as torchtitan compiles per block: dynamo traces one layer
        instead of all N, so warm-up takes one layer's compile, and the weights are graph inputs
        (a layer of the same kind does not recompile). No CUDA graphs (flash-linear-attention's
        varlen kernels read their segment offsets on the host; they run as opaque custom ops
        inside the compiled layer). The embedding, rotary embedding, masks and the chunked LM-head
        argmax stay eager."""
        self._run_linear = torch.compile(_linear_layer, dynamic=False)
        self._run_attention = torch.compile(_attention_layer, dynamic=False)

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
        :meth:`forward_with_hidden` also returns the final-normed hidden state.

        Runs the decoder layer by layer (embedding, rotary embedding from ``position_ids``, each
        attention layer with the per-document mask of its type, each linear-attention layer with
        every conversation from a zero state, final norm) and copies the output of every layer in
        ``layer_ids`` into its slice of the feature buffer as soon as it exists, so only L hidden
        states are kept. "Output of layer id" is transformers' ``hidden_states[id + 1]``; for
        id = N-1 that tuple holds the *final-normed* state, and so do we. Every conversation's
        features are those of the conversation computed alone.

        Shapes are fixed and, unless the fla backend runs linear-attention layers (its varlen
        kernels read segment offsets on the host), nothing syncs with the host, so the method can
        be wrapped in ``torch.compile(mode="reduce-overhead")``; :meth:`compile_layers` is the
        alternative that compiles per layer. Runs under ``torch.no_grad()`` (not inference mode:
        results may later meet autograd).

        Args:
            input_ids: ``[R, S]`` int64 tokens.
            position_ids: ``[R, S]`` int64 positions, restarting at 0 for each packed conversation.
            doc_ids: ``[R, S]`` int32 conversation ids, 0 = padding.

        Returns:
            features: ``[R, S, L·D]`` in ``self.dtype``, the L layer outputs concatenated in
                ``layer_ids`` order. target_tokens: ``[R, S]`` int64, ``argmax`` of the logits at
                each position (the target's prediction for position p + 1).
        """
        features, tokens, _ = self.forward_with_hidden(input_ids, position_ids, doc_ids)
        return features, tokens

    def forward_with_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                            doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`forward_features` plus ``final_hidden [R, S, D]`` (``self.dtype``): the final-normed
        hidden state, the LM head's input, from which the drafter computes the target's whole
        next-token distribution when it trains by distillation (``drafter.distillation``). Same
        arguments, same guarantees (fixed shapes, compilable)."""
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
            if self.linear_attention is not None:
                starts = conversation_starts(doc_ids)
                segments = starts.cumsum(dim=-1)
            last = self.num_layers - 1
            for i, layer in enumerate(decoder.layers):
                kind = self.layer_types[i]
                if kind == LINEAR:
                    hidden = self._run_linear(layer, hidden, starts, segments, self.linear_attention)
                else:
                    hidden = self._run_attention(layer, hidden, masks[kind], position_ids, rotary)
                if i != last:
                    for slot in self._slot_of.get(i, ()):
                        features[..., slot * width:(slot + 1) * width] = hidden
            hidden = decoder.norm(hidden)
            for slot in self._slot_of.get(last, ()):
                features[..., slot * width:(slot + 1) * width] = hidden
            tokens = self.greedy_tokens(hidden)
        return features, tokens, hidden

    forward = forward_features

    def flops(self, doc_ids: torch.Tensor):
        """Model FLOPs of :meth:`forward_features` on a batch with these ``doc_ids`` ``[R, S]``
        (:func:`dflash.models.flops.target_forward_flops`: every decoder layer, its attention over
        the per-document causal pairs or its Gated-DeltaNet recurrence, and the LM head).

        Returns:
            a :class:`dflash.models.flops.FlopCount` of Python ints.
        """
        from dflash.models.flops import target_forward_flops

        return target_forward_flops(self._decoder[0].layers, self.layer_types, self.config,
                                    self.lm_head.weight.numel(), doc_ids, self.sliding_window)


# --------------------------------------------------------------------------- one decoder layer

#: The submodules of a hybrid decoder layer that :func:`_linear_layer` runs (transformers'
#: ``Qwen3_5DecoderLayer``: pre-norm token mixer, residual, pre-norm MLP, residual).
_LINEAR_DECODER_PARTS = ("input_layernorm", "linear_attn", "post_attention_layernorm", "mlp")


def _check_linear_decoder_layer(layer: nn.Module, where: str) -> None:
    """Refuse a linear-attention decoder layer whose layout :func:`_linear_layer` does not know.

    Raises:
        TypeError: naming ``where`` and what is missing.
    """
    missing = [p for p in _LINEAR_DECODER_PARTS if not hasattr(layer, p)]
    if missing:
        raise TypeError(f"{where}: {type(layer).__name__} has no {', '.join(missing)}: not the Qwen3.5 "
                        "hybrid layer layout, so its packed rows cannot be kept apart exactly")
    check_gated_deltanet(layer.linear_attn, where)


def _linear_layer(layer: nn.Module, hidden: torch.Tensor, starts: torch.Tensor, segments: torch.Tensor,
                  backend: str) -> torch.Tensor:
    """One hybrid decoder layer with a Gated-DeltaNet token mixer, every conversation of the packed
    rows alone (:func:`dflash.models.linear_attention.gated_deltanet_forward`); ``[R, S, D]`` in and out."""
    mixed = gated_deltanet_forward(layer.linear_attn, layer.input_layernorm(hidden), starts, segments, backend)
    hidden = hidden + mixed
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def _attention_layer(layer: nn.Module, hidden: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor,
                     rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One attention decoder layer as transformers runs it, with the per-document ``mask``."""
    out = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=rotary)
    return out[0] if isinstance(out, tuple) else out
