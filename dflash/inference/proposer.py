"""Drafting for speculative decoding: the proposer interface and the DFlash drafter behind it.

A proposer drafts ``B − 1`` tokens per row from the decoding state
(:class:`dflash.inference.decode_state.DecodeState`). :class:`DFlashProposer` runs the drafter's own
training forward (:meth:`dflash.models.drafter.DFlashDraftModel.forward`) over the static feature
buffer, so what is trained is what drafts; :func:`drafter_hidden` is that forward under the
autocast training used, shared with the offline τ of :mod:`dflash.inference.acceptance`.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

__all__ = ["Proposer", "drafter_hidden", "DFlashProposer"]


class Proposer(Protocol):
    """Drafts ``B − 1`` tokens per row from the decoding state (a test hook; the DFlash drafter is built in).

    Called as ``proposer(tokens [b, T_max], features [b, T_max, L·D], anchor [b])``: row ``r``'s
    anchor token is ``tokens[r, anchor[r]]`` and its context features are ``features[r, :anchor[r]]``.
    Returns ``[b, B − 1]`` int64 drafts for positions ``anchor + 1 … anchor + B − 1``.
    """

    block_size: int

    def __call__(self, tokens: Tensor, features: Tensor, anchor: Tensor) -> Tensor: ...


def drafter_hidden(drafter: nn.Module, features: Tensor, input_ids: Tensor, position_ids: Tensor,
                   doc_ids: Tensor, anchors: Tensor, keep: Tensor) -> Tensor:
    """:meth:`DFlashDraftModel.forward` under the autocast training used: autocast to the
    features' dtype when it is bf16 / fp16 (a half-precision target, on any device), else the
    features cast to the drafter's parameter dtype and no autocast."""
    if features.dtype not in (torch.bfloat16, torch.float16):
        param_dtype = next(drafter.parameters()).dtype
        return drafter(features.to(param_dtype), input_ids, position_ids, doc_ids, anchors, keep)
    with torch.autocast(features.device.type, dtype=features.dtype):
        return drafter(features, input_ids, position_ids, doc_ids, anchors, keep)


class DFlashProposer:
    """The DFlash drafter as a :class:`Proposer`: its training forward over the static buffers.

    One row per sequence, ``S`` = the buffer length given (``doc_ids`` all 1, ``position_ids =
    arange(S)``, ``anchors = anchor[:, None]``, ``keep`` all True); drafts = argmax of
    ``lm_head(hidden)`` at block positions 1 … B−1 (ties to the lowest id). The drafter's dense
    SDPA mask is used (``drafter.attention`` is set to ``sdpa``: fixed shapes, no BlockMask).

    Args:
        drafter: a :class:`dflash.models.drafter.DFlashDraftModel`.
    """

    def __init__(self, drafter: nn.Module) -> None:
        self.drafter = drafter.eval()
        self.drafter.attention = "sdpa"
        self.block_size = int(drafter.block_size)

    def __call__(self, tokens: Tensor, features: Tensor, anchor: Tensor) -> Tensor:
        b, s = tokens.shape
        dev = tokens.device
        pos = torch.arange(s, device=dev).expand(b, s)
        doc = torch.ones(b, s, dtype=torch.int32, device=dev)
        keep = torch.ones(b, 1, dtype=torch.bool, device=dev)
        hidden = drafter_hidden(self.drafter, features, tokens, pos, doc, anchor.view(b, 1), keep)  # [b,1,B,D]
        head = self.drafter.lm_head
        return head(hidden[:, 0, 1:].to(head.weight.dtype)).argmax(dim=-1)
