"""The slow obvious oracle of decoding: target-only greedy decoding without a cache.

Tests compare :class:`dflash.inference.generation.Generator` (static KV cache, fused layers,
CUDA graphs) with :func:`naive_greedy_decode` token for token.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

__all__ = ["naive_greedy_decode"]


@torch.no_grad()
def naive_greedy_decode(model: nn.Module, prompt_ids: Tensor, max_new_tokens: int,
                        stop_ids: Sequence[int] = ()) -> list[int]:
    """Target-only greedy decoding the slow obvious way: a full forward of the whole sequence per token.

    The oracle of the tests (no cache, no features, nothing to get wrong).

    Args:
        model: a transformers causal LM.
        prompt_ids: ``[P]`` int64.
        max_new_tokens: generate at most this many tokens.
        stop_ids: stop after emitting one of these (kept in the output).

    Returns:
        the generated ids.
    """
    seq = prompt_ids.to(next(model.parameters()).device).view(1, -1)
    stops = frozenset(int(s) for s in stop_ids)
    out: list[int] = []
    while len(out) < max_new_tokens:
        tok = int(model(input_ids=seq, use_cache=False).logits[0, -1].argmax())
        out.append(tok)
        if tok in stops:
            break
        seq = torch.cat([seq, seq.new_tensor([[tok]])], dim=1)
    return out
