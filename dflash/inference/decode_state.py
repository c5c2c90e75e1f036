"""The decoding state: the target's static KV cache and the per-row buffers of a decode.

Every buffer has a fixed shape chosen up front (``b`` rows, ``T_max`` positions), so the step
functions of :mod:`dflash.inference.decode_steps` are traced once and, on CUDA, replayed as CUDA
graphs (pytorch-labs/gpt-fast ``generate.py`` keeps its cache the same way).

:class:`DecodeState` (one row per sequence of the batch, rows independent):

* ``kv``: the target's keys and values ``[b, H_kv, T_max, hd]`` per layer (:class:`StaticKVCache`);
  slot ``j`` of a row holds position ``j`` of that row's sequence.
* ``tokens [b, T_max]``: prompt and generated tokens; ``anchor [b]``: position of each row's last
  token (the *anchor*: the target's latest prediction, not yet run through the target), so the cache
  holds positions ``0 … anchor − 1``.
* ``features [b, T_max, L·D]``: the DFlash context features (``hidden_states[id + 1]`` of the
  target's layers ``layer_ids``, concatenated) of every position the target has run.
* ``active [b]``, ``limit [b]``, ``stop_ids [S]``: which rows still generate, each row's last
  position, the stop tokens; ``logit_stats [b, T_max, 3]``: the target's two largest logits and
  their spread (fp32; :meth:`DecodeSteps.forward`) at the forward that produced each token;
  ``accepted [b, T_max]``: ``m + 1`` of the pass anchored at each position.

Entries past ``anchor`` are stale (rejected drafts) and are never read: the target's attention mask
hides cache slots beyond each query's position, and the drafter sees context ``j < anchor`` only.
That is the whole rollback after a partial acceptance: moving ``anchor`` back (vLLM and SGLang
roll back by slot bookkeeping in the same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["StaticKVCache", "DecodeState", "SLACK", "STOP_SLOTS"]

#: Slots past the last written position kept free: a verify pass writes B positions from the
#: anchor and the bonus lands at anchor + B.
SLACK = 1
#: Stop-token slots on the device (padded with -1); a longer stop list grows the buffer (one recompile).
STOP_SLOTS = 8


class StaticKVCache:
    """Keys and values of every target layer in fixed buffers ``[b, H_kv, T_max, hd]``.

    Before each forward the caller sets :attr:`positions` (``[b', T]`` int64, the positions being
    written) and :attr:`rows` (``None`` = all ``b`` rows, else ``[b']`` int64 row ids);
    :meth:`update` writes the new keys/values at those slots and returns the layer's whole buffer
    (rows ``rows``), which attention reads under the caller's mask.

    Args:
        num_layers, batch, kv_heads, max_len, head_dim: buffer shape.
        dtype, device: of the buffers (the target's).
    """

    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (batch, kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for t in self.keys + self.values:
            torch._dynamo.mark_static_address(t)
        self.positions: Optional[Tensor] = None
        self.rows: Optional[Tensor] = None

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Write ``key/value [b', H_kv, T, hd]`` at :attr:`positions`; return the layer's buffers.

        The signature takes whatever transformers passes after ``layer_idx`` (``cache_kwargs``
        in early 5.x, ``kwargs=`` later) and ignores it.
        """
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        pos = self.positions
        if self.rows is None:
            rows = torch.arange(k_buf.shape[0], device=pos.device).unsqueeze(1)
            k_buf[rows, :, pos] = key.transpose(1, 2).to(k_buf.dtype)
            v_buf[rows, :, pos] = value.transpose(1, 2).to(v_buf.dtype)
            return k_buf, v_buf
        rows = self.rows.unsqueeze(1)
        k_buf[rows, :, pos] = key.transpose(1, 2).to(k_buf.dtype)
        v_buf[rows, :, pos] = value.transpose(1, 2).to(v_buf.dtype)
        return k_buf[self.rows], v_buf[self.rows]


@dataclass
class DecodeState:
    """The per-row decoding buffers (see the module docstring). All on the target's device."""

    kv: StaticKVCache
    tokens: Tensor      # [b, T_max] int64
    anchor: Tensor      # [b] int64
    active: Tensor      # [b] bool: rows still generating (others keep their anchor)
    features: Tensor    # [b, T_max, L·D] target dtype
    drafts: Tensor      # [b, B-1] int64 (speculative only; [b, 0] otherwise)
    logit_stats: Tensor  # [b, T_max, 3] fp32: the target's (z1, z2, spread) at the forward that produced token j
    accepted: Tensor    # [b, T_max] int64: m + 1 of the verification pass anchored at j (0 = none)
    limit: Tensor       # [b] int64: the last position a row may emit (prompt length + max_new_tokens − 1)
    stop_ids: Tensor    # [S] int64: stop tokens, padded with -1 (never an id)
    seeds: Tensor       # [b] int64: each row's sampling seed (read only by a sampling decoder)

    @classmethod
    def allocate(cls, kv: StaticKVCache, batch: int, max_len: int, feature_width: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> "DecodeState":
        """Zeroed buffers of ``batch`` rows and ``max_len`` positions around the cache ``kv``, each
        marked as a static address (CUDA graphs read them in place).

        Args:
            kv: the target's cache.
            batch, max_len: ``b`` and ``T_max``.
            feature_width: ``L·D`` of the context features (at least ``D`` when no layer feeds them).
            block_size: ``B`` (``drafts`` holds ``B − 1`` tokens per row; 1 = target-only).
            dtype, device: the target's (``features``).
        """
        b, dev = batch, device
        state = cls(
            kv=kv,
            tokens=torch.zeros(b, max_len, dtype=torch.long, device=dev),
            anchor=torch.zeros(b, dtype=torch.long, device=dev),
            active=torch.zeros(b, dtype=torch.bool, device=dev),
            features=torch.zeros(b, max_len, feature_width, dtype=dtype, device=dev),
            drafts=torch.zeros(b, max(0, block_size - 1), dtype=torch.long, device=dev),
            logit_stats=torch.zeros(b, max_len, 3, dtype=torch.float32, device=dev),
            accepted=torch.zeros(b, max_len, dtype=torch.long, device=dev),
            limit=torch.zeros(b, dtype=torch.long, device=dev),
            stop_ids=torch.full((STOP_SLOTS,), -1, dtype=torch.long, device=dev),
            seeds=torch.zeros(b, dtype=torch.long, device=dev))
        for t in (state.tokens, state.anchor, state.active, state.features, state.drafts, state.logit_stats,
                  state.accepted, state.limit, state.stop_ids, state.seeds):
            torch._dynamo.mark_static_address(t)
        return state
