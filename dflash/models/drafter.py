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

Its configuration is :mod:`dflash.models.drafter_config`, its layers :mod:`dflash.models.modeling_dflash`,
its saved form :mod:`dflash.models.drafter_io`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional, Union

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from dflash.models.drafter_config import DFlashConfig
from dflash.models.drafter_io import read_drafter_config, read_drafter_weights, write_drafter_directory
from dflash.models.modeling_dflash import DFlashDecoderLayer, RMSNorm, RotaryEmbedding
from dflash.models.masks import AttentionMask, drafter_attention_masks

__all__ = ["DFlashDraftModel"]

logger = logging.getLogger(__name__)

#: Smallest head dim flex_attention's CUDA kernel takes.
FLEX_MIN_HEAD_DIM = 16


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
            Settable later as an attribute. Each layer is recomputed as its attention sub-layer
            and its MLP sub-layer in ``mlp_chunks`` slices of the block tokens
            (:meth:`_checkpointed_layer`).
        mlp_chunks: slices of the MLP's recomputation under gradient checkpointing (>= 1).
        checkpoint_layers: under gradient checkpointing, how many decoder layers from the first
            are checkpointed (``None`` = all); the later ones keep their activations and are not
            recomputed (:meth:`checkpointed`). Settable later as an attribute.

    Both shared modules get ``requires_grad_(False)`` and are stored outside the module tree, so
    ``model.to(...)`` does not move or cast them (they may be the target's own modules): put them
    on the drafter's device yourself.

    Raises:
        ValueError: the embedding width is not ``config.hidden_size``, ``attention`` is unknown or
            ``mlp_chunks < 1`` or ``checkpoint_layers`` is outside ``0 … num_layers``.
    """

    def __init__(self, config: DFlashConfig, embed_tokens: nn.Module, lm_head: nn.Module,
                 attention: str = "auto", gradient_checkpointing: bool = False, mlp_chunks: int = 1,
                 checkpoint_layers: Optional[int] = None) -> None:
        super().__init__()
        if attention not in ("auto", "flex", "sdpa"):
            raise ValueError(f"attention: must be auto, flex or sdpa, got {attention!r}")
        if mlp_chunks < 1:
            raise ValueError(f"mlp_chunks: must be >= 1, got {mlp_chunks}")
        self.mlp_chunks = mlp_chunks
        if checkpoint_layers is not None and not 0 <= checkpoint_layers <= config.num_hidden_layers:
            raise ValueError(f"checkpoint_layers: must be None or 0 ... {config.num_hidden_layers}, got {checkpoint_layers}")
        self.checkpoint_layers = checkpoint_layers
        #: ``(attention_block, mlp_block)`` compiled by :meth:`compile_layers`, else ``None``.
        self._compiled_regions: Optional[tuple] = None
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

    def flops(self, anchors: Tensor, anchor_keep: Tensor, doc_ids: Tensor, training: bool = True,
              distillation: bool = False, head_rows: Optional[int] = None):
        """Model FLOPs of a train step (``training``) or of one forward with the LM head's logits,
        on a batch with these anchors: :func:`dflash.models.flops.drafter_flops` (activation
        checkpointing's recompute counted when :attr:`gradient_checkpointing` is on; the
        teacher's logits with ``distillation``).

        Args:
            anchors, anchor_keep: ``[R, A]`` int64 / bool; doc_ids: ``[R, S]``.
            head_rows: the rows the LM head ran over
                (:attr:`dflash.training.objective.LossOutput.head_rows`); ``None`` = every
                predicted block position.

        Returns:
            a :class:`dflash.models.flops.FlopCount` (its ``attention`` part a tensor on the
            anchors' device: ``int(count.total)`` reads it).
        """
        from dflash.models.flops import drafter_flops

        return drafter_flops(self, anchors, anchor_keep, doc_ids, training=training,
                             recompute=training and self.gradient_checkpointing,
                             distillation=training and distillation, head_rows=head_rows)

    def checkpointed(self, index: int) -> bool:
        """Whether decoder layer ``index`` (0-based) is recomputed in the backward: gradient
        checkpointing is on and ``index < checkpoint_layers`` (every layer when that is ``None``)."""
        return self.gradient_checkpointing and (self.checkpoint_layers is None or index < self.checkpoint_layers)

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
        grad = torch.is_grad_enabled()
        for index, layer in enumerate(self.layers):
            mask = attn_masks[layer.layer_type]
            if grad and self.checkpointed(index):
                x = self._checkpointed_layer(layer, x, ctx, rope_q, rope_kv, mask)
            elif self._compiled_regions is not None and grad:
                attention, mlp = self._compiled_regions
                x = mlp(layer, attention(layer, x, ctx, rope_q, rope_kv, mask))
            else:
                x = layer(x, ctx, rope_q, rope_kv, mask)
        return self.norm(x).reshape(r, num_anchors, b, -1)

    def compile_layers(self) -> None:
        """``torch.compile`` the attention and the MLP sub-layer (inductor, no CUDA graphs), one
        compiled function each shared by every layer (the layer is an argument: its weights are
        graph inputs), as torchtitan compiles per block. Used by training's forward only (grad
        enabled); evaluation and decoding stay eager. With gradient checkpointing each compiled
        region is one checkpoint region, recomputed on its own in the backward."""
        self._compiled_regions = (torch.compile(DFlashDecoderLayer.attention_block, dynamic=False),
                                  torch.compile(DFlashDecoderLayer.mlp_block, dynamic=False))

    def _checkpointed_layer(self, layer: DFlashDecoderLayer, x: Tensor, ctx: Tensor, rope_q: tuple[Tensor, Tensor],
                            rope_kv: tuple[Tensor, Tensor], mask: AttentionMask) -> Tensor:
        """One decoder layer as ``1 + mlp_chunks`` checkpoint regions: the attention sub-layer,
        then the MLP sub-layer over ``mlp_chunks`` equal slices of the block tokens (the MLP is
        token-wise). Each region is recomputed once in the backward, as one region per layer
        would be, so the FLOPs are the same; what the backward holds at once is the larger of
        the attention's activations and one slice's MLP activations (``[R, Q/mlp_chunks, I]``
        gate, up and product), instead of both sub-layers' together. The price is the
        sub-layers' boundary ``[R, Q, D]`` kept per layer."""
        attention, mlp = self._compiled_regions or (DFlashDecoderLayer.attention_block, DFlashDecoderLayer.mlp_block)
        x = torch.utils.checkpoint.checkpoint(attention, layer, x, ctx, rope_q, rope_kv, mask, use_reentrant=False)
        if self.mlp_chunks == 1:
            return torch.utils.checkpoint.checkpoint(mlp, layer, x, use_reentrant=False)
        return torch.cat([torch.utils.checkpoint.checkpoint(mlp, layer, part, use_reentrant=False)
                          for part in x.chunk(self.mlp_chunks, dim=1)], dim=1)

    # ----------------------------------------------------------------------- checkpoint

    def save_pretrained(self, directory: Union[str, os.PathLike],
                        state_dict: Optional[dict[str, Tensor]] = None, dtype: Optional[str] = None,
                        modeling_file: bool = False) -> Path:
        """Write the drafter as a Hugging Face directory, atomically
        (:func:`dflash.models.drafter_io.write_drafter_directory`).

        Args:
            directory: the HF directory to write.
            state_dict: the weights to write instead of the live ones (a host snapshot taken
                earlier, :class:`dflash.training.checkpoint.CheckpointWriter`); same keys as
                :meth:`state_dict`.
            dtype: ``float32`` / ``bfloat16`` weights (default: the config's ``dtype``).
            modeling_file: also ship :data:`dflash.models.drafter_io.MODELING_FILE` and ``auto_map``
                (serving export).

        Returns:
            the directory.
        """
        source = self.state_dict() if state_dict is None else state_dict
        target = write_drafter_directory(directory, self.config, source, dtype=dtype, modeling_file=modeling_file)
        logger.info("saved drafter (%d params) to %s", self.num_trainable_params(), target)
        return target

    @classmethod
    def load_config(cls, directory: Union[str, os.PathLike]) -> DFlashConfig:
        """Read ``directory/config.json`` (:func:`dflash.models.drafter_io.read_drafter_config`).

        Raises:
            FileNotFoundError: no config.json.
            ValueError: not a DFlash drafter config, or a drafter trained with its own learned mask
                vector (``dflash_config.mask_embedding``), which no engine can serve.
        """
        return read_drafter_config(directory)

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
        model = cls(read_drafter_config(directory), embed_tokens, lm_head, attention=attention)
        model.load_state_dict(read_drafter_weights(directory, device), strict=True)
        if device is not None:
            model.to(device)
        return model
