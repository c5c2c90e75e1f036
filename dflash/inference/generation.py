"""Greedy generation over a static KV cache: target-only decoding and DFlash speculative decoding.

One module serves every decoding caller (the lossless check, the decoding benchmark), in the manner
of pytorch-labs/gpt-fast ``generate.py``: every buffer has a fixed shape chosen up front, so each
step function is traced once and, on CUDA, replayed as a CUDA graph
(``torch.compile(mode="reduce-overhead")``); on CPU the same functions run eagerly.

**State** (:class:`DecodeState`, one row per sequence of the batch, rows independent):

* ``kv``: the target's keys and values ``[b, H_kv, T_max, hd]`` per layer (:class:`StaticKVCache`);
  slot ``j`` of a row holds position ``j`` of that row's sequence.
* ``tokens [b, T_max]``: prompt and generated tokens; ``anchor [b]``: position of each row's last
  token (the *anchor*: the target's latest prediction, not yet run through the target), so the cache
  holds positions ``0 … anchor − 1``.
* ``features [b, T_max, L·D]``: the DFlash context features (``hidden_states[id + 1]`` of the
  target's layers ``layer_ids``, concatenated) of every position the target has run.
* ``active [b]``, ``limit [b]``, ``stop_ids [S]``: which rows still generate, each row's last
  position, the stop tokens; ``top2 [b, T_max, 2]``: the target's top-2 logits (fp32) of the
  forward that produced each token; ``accepted [b, T_max]``: ``m + 1`` of the pass anchored at
  each position.

Entries past ``anchor`` are stale (rejected drafts) and are never read: the target's attention mask
hides cache slots beyond each query's position, and the drafter sees context ``j < anchor`` only.
That is the whole rollback after a partial acceptance: moving ``anchor`` back (vLLM and SGLang
roll back by slot bookkeeping in the same way).

**Steps.**

* :meth:`Generator.prefill` (eager, all prompts right-padded in one forward): the prompts' keys/values, features and the
  first generated token.
* target-only step (compiled): run the anchor at ``anchor``, append the argmax, ``anchor += 1``;
  the row turns inactive after a stop token or its last position.
* draft (compiled): the drafter's own :meth:`dflash.models.drafter.DFlashDraftModel.forward` on the whole
  static feature buffer (``S = T_max`` when compiled, ``S = max(anchor) + 1`` when eager) with
  ``anchors = anchor``: exactly the training forward (its attention-mask builder decides what the
  block sees), so what is trained is what drafts. Recomputing the context's projections every step
  costs ``O(T_max)`` small matmuls, which on a GPU is microseconds for the context lengths here;
  engines cache the projected context keys/values per drafter layer instead.
* verify (compiled): the target over ``[anchor token, d_1 … d_{B−1}]`` at ``anchor … anchor+B−1``;
  the number of accepted drafts ``m`` = leading ``k`` with ``d_{k+1} = g_k``; the block's features
  are written at ``anchor … anchor+B−1`` (the next draft reads only positions ``≤ anchor + m``,
  i.e. the anchor and the accepted drafts, all computed on correct tokens); the bonus ``g_m`` is
  written at ``anchor + m + 1`` and becomes the next anchor; the row turns inactive when one of
  ``g_0 … g_m`` is a stop token or reaches its last position.

**The host loop.** The step functions take no arguments and return nothing: every decision
(acceptance, the bonus token, the new anchor, stopping a row) is made on the device and written
into :class:`DecodeState`, so the steps run back to back without a device→host sync (gpt-fast
keeps its decode loop on the device the same way). The host reads ``anchor`` and ``active`` every
``sync_every`` target forwards, to learn when every row is done, and reads the tokens, their top-2
logits (so the lossless check can judge a difference between two runs by the target's own margin)
and the passes once at the end, cutting a row's tokens after its first stop token. It never
enqueues more forwards than the longest row can still need (target-only: its remaining tokens;
speculative: ``⌈remaining / B⌉``), so only a stop token can leave forwards that change nothing, and
the output does not depend on ``sync_every``.

The target is any transformers decoder with the ``embed_tokens / layers / norm / rotary_emb``
layout (Llama, Qwen2/3, Mistral; the layout :class:`dflash.models.target.TargetModel` runs), called layer
by layer with this module's cache (duck-typed: transformers' attention calls
``cache.update(k, v, layer_idx, …)`` in every 5.x release). Linear-attention layers (Qwen3.5) are
not supported.
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
from torch import Tensor, nn

from dflash.inference.decode_layers import ATTENTION, fuse_layers
from dflash.models.target import _decoder

__all__ = [
    "StaticKVCache",
    "DecodeState",
    "Generation",
    "Proposer",
    "Generator",
    "naive_greedy_decode",
]

log = logging.getLogger(__name__)

FULL = "full_attention"
SLIDING = "sliding_attention"
#: Slots past the last written position kept free: a verify pass writes B positions from the
#: anchor and the bonus lands at anchor + B.
SLACK = 1
#: Target forwards between two host checks of the decoding state (the only device→host syncs of a
#: compiled decode). Larger: more forwards queued without the host waiting; smaller: fewer forwards
#: wasted after a stop token (a row that stops is masked on the device; the batch ends at a check).
SYNC_EVERY = 8
#: Stop-token slots on the device (padded with -1); a longer stop list grows the buffer (one recompile).
STOP_SLOTS = 8


# --------------------------------------------------------------------------- results


@dataclass
class Generation:
    """One prompt's decode.

    Attributes:
        tokens: generated ids (prompt excluded), ending with the first stop token (kept) or after
            ``max_new_tokens``.
        top2: per generated token, the target's two largest logits ``(z1, z2)`` (fp32 of the
            model-dtype logits) at the forward that produced it.
        accepted: per verification pass, ``m + 1`` (accepted drafts plus the bonus); empty for
            target-only decoding.
        anchors: per verification pass, the anchor's position.
        target_forwards: target forward passes (prefill included).
        seconds / draft_seconds / verify_seconds: wall time of the whole decode (the batch's,
            for batched decoding), and the device time of drafting and of verification, in s.
    """

    tokens: list[int] = field(default_factory=list)
    top2: list[tuple[float, float]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    anchors: list[int] = field(default_factory=list)
    target_forwards: int = 0
    seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def steps(self) -> int:
        """Verification passes."""
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Measured acceptance length ``mean(m + 1)`` over verification passes (``nan`` if none)."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("nan")


# --------------------------------------------------------------------------- the static cache


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
    top2: Tensor        # [b, T_max, 2] fp32: the target's (z1, z2) at the forward that produced token j
    accepted: Tensor    # [b, T_max] int64: m + 1 of the verification pass anchored at j (0 = none)
    limit: Tensor       # [b] int64: the last position a row may emit (prompt length + max_new_tokens − 1)
    stop_ids: Tensor    # [S] int64: stop tokens, padded with -1 (never an id)


# --------------------------------------------------------------------------- drafting


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


# --------------------------------------------------------------------------- the generator


def _layer_cache_kwarg(layer: nn.Module) -> str:
    """``cache`` (transformers ≥ 5.2x) or ``past_key_values`` (earlier 5.x): the decoder layer's cache argument."""
    params = inspect.signature(layer.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


class _Timer:
    """Device time of labelled sections: CUDA events (no sync until :meth:`totals`), perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: dict[str, list[Any]] = {}
        self.cpu: dict[str, float] = {}

    def start(self, name: str) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, name: str, token: Any) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.setdefault(name, []).append((token, ev))
        else:
            self.cpu[name] = self.cpu.get(name, 0.0) + time.perf_counter() - token

    def totals(self) -> dict[str, float]:
        """Seconds per label (synchronises on CUDA)."""
        out = dict(self.cpu)
        if self.cuda:
            torch.cuda.synchronize()
            for name, pairs in self.marks.items():
                out[name] = out.get(name, 0.0) + sum(a.elapsed_time(b) for a, b in pairs) / 1e3
        return out


class Generator:
    """Target-only and speculative greedy decoding of a batch of prompts over static buffers.

    Args:
        model: the target's transformers ``*ForCausalLM`` (eval; its weights' dtype is the
            decoding dtype).
        layer_ids: target layers whose outputs form the context features (the drafter's
            ``target_layer_ids``); may be empty for target-only decoding.
        max_len: ``T_max``: positions per row (prompt + generated + ``B`` + 1 must fit).
        batch_size: rows decoded together (prompts of different lengths; each row accepts its
            own drafts).
        drafter: a :class:`dflash.models.drafter.DFlashDraftModel` or any :class:`Proposer`; ``None`` =
            target-only.
        compile: compile the step functions with ``torch.compile(mode="reduce-overhead")``
            (CUDA graphs); ``None`` = on CUDA only.
        sync_every: target forwards (steps or verification passes) the host enqueues between two
            reads of the decoding state (:data:`SYNC_EVERY`); any value gives the same outputs.
            Settable on the instance (:attr:`sync_every`) without recompiling.
        fuse: run the target's layers as :class:`dflash.inference.decode_layers.FusedDecoderLayer` (fused
            projections, grouped-query attention on the cache in place) when every layer is
            supported; ``False`` = through the transformers layers. Same math either way.
        attention: the fused layers' attention, ``"matmul"`` or ``"sdpa"``
            (:data:`dflash.inference.decode_layers.ATTENTION`).

    Raises:
        ValueError: a layer id outside the target, a layer type other than full / sliding attention
            (linear attention), an attention implementation other than sdpa / eager, ``max_len < 2``,
            ``batch_size < 1`` or ``sync_every < 1``.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], max_len: int, batch_size: int = 1,
                 drafter: Any = None, compile: Optional[bool] = None, sync_every: int = SYNC_EVERY,
                 fuse: bool = True, attention: str = ATTENTION) -> None:
        self.model = model.eval()
        self.decoder = _decoder(model)
        self.config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.device = _device_of(model)
        self.dtype = self.decoder.embed_tokens.weight.dtype
        self.num_layers = len(self.decoder.layers)
        self.layer_ids = [int(i) for i in layer_ids]
        bad = [i for i in self.layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"layer_ids {bad}: the target has layers 0..{self.num_layers - 1}")
        if max_len < 2:
            raise ValueError(f"max_len: must be >= 2, got {max_len}")
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        if sync_every < 1:
            raise ValueError(f"sync_every: must be >= 1, got {sync_every}")
        self.sync_every = int(sync_every)
        types = list(getattr(self.config, "layer_types", None) or [FULL] * self.num_layers)[: self.num_layers]
        unknown = sorted(set(types) - {FULL, SLIDING})
        if unknown:
            raise ValueError(f"{type(model).__name__}: layer types {unknown} are not supported by static-cache decoding")
        self.layer_types = types
        self.sliding_window = getattr(self.config, "sliding_window", None)
        impl = getattr(self.config, "_attn_implementation", None) or "eager"
        if impl not in ("sdpa", "eager"):
            raise ValueError(f"attention implementation {impl!r}: static-cache decoding needs sdpa or eager")
        self.additive_mask = impl == "eager"
        self.cache_arg = _layer_cache_kwarg(self.decoder.layers[0])
        self.fused = fuse_layers(self.decoder.layers, self.config, attention) if fuse else None
        self.max_len = int(max_len)
        self.batch_size = int(batch_size)
        if drafter is None:
            self.proposer = None
        elif hasattr(drafter, "fc") and hasattr(drafter, "layers"):
            self.proposer = DFlashProposer(drafter)
        else:
            self.proposer = drafter
        self.block_size = int(self.proposer.block_size) if self.proposer is not None else 1
        self.compiled = self.device.type == "cuda" if compile is None else bool(compile)
        width = int(self.config.hidden_size)
        kv_heads = int(getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads)
        self.group = int(self.config.num_attention_heads) // kv_heads
        head_dim = int(getattr(self.config, "head_dim", None) or width // self.config.num_attention_heads)
        b, dev = self.batch_size, self.device
        self.state = DecodeState(
            kv=StaticKVCache(self.num_layers, b, kv_heads, self.max_len, head_dim, self.dtype, dev),
            tokens=torch.zeros(b, self.max_len, dtype=torch.long, device=dev),
            anchor=torch.zeros(b, dtype=torch.long, device=dev),
            active=torch.zeros(b, dtype=torch.bool, device=dev),
            features=torch.zeros(b, self.max_len, max(1, len(self.layer_ids)) * width, dtype=self.dtype, device=dev),
            drafts=torch.zeros(b, max(0, self.block_size - 1), dtype=torch.long, device=dev),
            top2=torch.zeros(b, self.max_len, 2, dtype=torch.float32, device=dev),
            accepted=torch.zeros(b, self.max_len, dtype=torch.long, device=dev),
            limit=torch.zeros(b, dtype=torch.long, device=dev),
            stop_ids=torch.full((STOP_SLOTS,), -1, dtype=torch.long, device=dev))
        st = self.state
        for t in (st.tokens, st.anchor, st.active, st.features, st.drafts, st.top2, st.accepted, st.limit,
                  st.stop_ids):
            torch._dynamo.mark_static_address(t)
        self._slots: dict[int, list[int]] = {}
        for slot, layer in enumerate(self.layer_ids):
            self._slots.setdefault(layer, []).append(slot)
        self._stops: frozenset[int] = frozenset()
        self._greedy_step = self._wrap(self._greedy_step_impl)
        self._draft_step = self._wrap(self._draft_step_impl) if self.proposer is not None else None
        self._verify_step = self._wrap(self._verify_step_impl)

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not self.compiled:
            return fn
        compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=False, dynamic=False)

        def call(*args: Any) -> Any:
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(*args)

        return call

    # ----------------------------------------------------------------------- the target's forward

    def _masks(self, positions: Tensor) -> dict[str, Tensor]:
        """``[b', 1, T, T_max]`` per layer type: slot ``j`` visible to the query at ``p`` iff ``j ≤ p``
        (and ``p − j < W`` in a sliding layer, as transformers' sliding layers do). Additive under
        eager attention; for the fused layers bool and ``[b', 1, g·T, T_max]`` (each query row
        repeated for the ``g`` query heads of a key/value group, head-major)."""
        slots = torch.arange(self.max_len, device=positions.device)
        p = positions.unsqueeze(-1)  # [b', T, 1]
        out: dict[str, Tensor] = {}
        for kind in set(self.layer_types):
            allowed = slots <= p
            if kind == SLIDING and self.sliding_window is not None:
                allowed = allowed & (p - slots < int(self.sliding_window))
            mask = allowed.unsqueeze(1)
            if self.fused is not None:
                b, _, t, n = mask.shape
                mask = mask.unsqueeze(2).expand(b, 1, self.group, t, n).reshape(b, 1, self.group * t, n)
            elif self.additive_mask:
                zero = torch.zeros((), dtype=self.dtype, device=mask.device)
                mask = torch.where(mask, zero, torch.finfo(self.dtype).min)
            out[kind] = mask
        return out

    def forward(self, input_ids: Tensor, positions: Tensor, rows: Optional[Tensor] = None,
                features: bool = True, logits_at: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """The target over ``input_ids`` at ``positions``, on top of the cache; writes their keys/values.

        Args:
            input_ids / positions: ``[b', T]`` int64.
            rows: ``[b']`` row ids of the cache (``None`` = all rows, ``b' = b``).
            features: also return the fused features.
            logits_at: ``[b']`` int64: logits of that token of each row only (prefill: a row's last
                prompt token when prompts are right-padded to one length).

        Returns:
            ``(top2 values [b', T', 2] fp32, top2 ids [b', T', 2] int64, features [b', T, L·D] or None)``
            with ``T' = 1`` when ``logits_at`` is given; ids ``[..., 0]`` is the argmax (ties to the lowest id).
        """
        dec = self.decoder
        kv = self.state.kv
        kv.positions, kv.rows = positions, rows
        hidden = dec.embed_tokens(input_ids)
        rope_pos = positions
        if getattr(dec.rotary_emb, "mrope_section", None) is not None:
            rope_pos = positions.unsqueeze(0).expand(3, -1, -1)
        rotary = dec.rotary_emb(hidden, rope_pos)
        masks = self._masks(positions)
        width = hidden.shape[-1]
        feats = hidden.new_empty(*hidden.shape[:2], len(self.layer_ids) * width) if features else None
        last = self.num_layers - 1
        for i, layer in enumerate(dec.layers):
            if self.fused is not None:
                hidden = self.fused[i](hidden, rotary[0], rotary[1], kv.keys[i], kv.values[i], rows, positions,
                                       masks[self.layer_types[i]])
            else:
                out = layer(hidden, attention_mask=masks[self.layer_types[i]], position_ids=positions,
                            position_embeddings=rotary, **{self.cache_arg: kv})
                hidden = out[0] if isinstance(out, tuple) else out
            if feats is not None and i != last:
                for slot in self._slots.get(i, ()):
                    feats[..., slot * width:(slot + 1) * width] = hidden
        hidden = dec.norm(hidden)
        if feats is not None:
            for slot in self._slots.get(last, ()):
                feats[..., slot * width:(slot + 1) * width] = hidden
        # No tensor stays on the cache object after the call (under CUDA graphs it would pin a graph output).
        kv.positions = kv.rows = None
        if logits_at is not None:
            hidden = hidden.gather(1, logits_at.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1]))
        logits = self.model.get_output_embeddings()(hidden).float()
        top = logits.topk(2, dim=-1)
        return top.values, top.indices, feats

    # ----------------------------------------------------------------------- step functions

    def _ends(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """``[b, k]`` bool: emitting ``tokens [b, k]`` at ``positions [b, k]`` ends the row (a stop
        token, or the row's last position :attr:`DecodeState.limit`)."""
        st = self.state
        return (tokens.unsqueeze(-1) == st.stop_ids).any(dim=-1) | (positions >= st.limit.unsqueeze(-1))

    def _greedy_step_impl(self) -> None:
        """One target-only token per active row, entirely on the device (no output, no host sync).

        The argmax at ``anchor`` is written at ``anchor + 1`` with its top-2 logits, the anchor
        moves there, and the row turns inactive when that token is a stop token or sits at the
        row's last position. Inactive rows run the forward too (fixed shapes) but change nothing.
        """
        st = self.state
        a, active = st.anchor, st.active
        vals, ids, _ = self.forward(st.tokens.gather(1, a[:, None]), a[:, None], features=False)
        tok = ids[:, :, 0]  # [b, 1]
        nxt = torch.clamp(a + 1, max=self.max_len - 1)[:, None]  # [b, 1]
        act = active[:, None]
        st.tokens.scatter_(1, nxt, torch.where(act, tok, st.tokens.gather(1, nxt)))
        at = nxt.unsqueeze(-1).expand(-1, -1, 2)
        st.top2.scatter_(1, at, torch.where(act.unsqueeze(-1), vals, st.top2.gather(1, at)))
        ends = self._ends(tok, nxt)[:, 0]
        st.anchor.copy_(torch.where(active, nxt[:, 0], a))
        st.active.copy_(active & ~ends)

    def _draft_step_impl(self, length: Optional[int] = None) -> None:
        st = self.state
        if length is None:
            drafts = self.proposer(st.tokens, st.features, st.anchor)
        else:
            drafts = self.proposer(st.tokens[:, :length], st.features[:, :length], st.anchor)
        st.drafts.copy_(drafts.to(torch.long).view_as(st.drafts))

    def _verify_step_impl(self) -> None:
        """Verify the drafts of every active row and accept, entirely on the device (no output).

        The target runs ``[anchor token, d_1 … d_{B−1}]`` at ``anchor … anchor+B−1``; ``m`` = the
        leading drafts equal to the target's tokens ``g_0 … g_{B−2}``; the block's tokens and
        features are written at its positions, the bonus ``g_m`` at ``anchor + m + 1`` (the new
        anchor), the top-2 logits of ``g_k`` at ``anchor + 1 + k``, and ``m + 1`` in
        :attr:`DecodeState.accepted` at the pass's anchor. The row turns inactive when one of
        ``g_0 … g_m`` is a stop token or reaches its last position (the host trims the tokens
        after it). Inactive rows run the forward too but change nothing.
        """
        st = self.state
        b_sz = self.block_size
        a, active = st.anchor, st.active
        last = self.max_len - 1
        offsets = torch.arange(b_sz, device=a.device)
        # A finished row's anchor can lie up to B − 1 past its last position; clamping keeps its
        # (masked-out) reads and writes inside the buffers. An active row never reaches the clamp:
        # its anchor is below its last position, and _check keeps B + 1 slots after that.
        pos = torch.clamp(a[:, None] + offsets, max=last)  # [b, B]
        block = torch.cat([st.tokens.gather(1, a[:, None]), st.drafts], dim=1)
        vals, ids, feats = self.forward(block, pos, features=True)
        greedy = ids[..., 0]  # [b, B]: g_k, the target's token for position anchor + 1 + k
        right = (st.drafts == greedy[:, :-1]).long()
        m = torch.cumprod(right, dim=1).sum(dim=1)  # [b]
        act = active[:, None]
        rows = torch.arange(a.shape[0], device=a.device)[:, None]
        st.features[rows, pos] = torch.where(act.unsqueeze(-1), feats, st.features[rows, pos])
        st.tokens.scatter_(1, pos, torch.where(act, block, st.tokens.gather(1, pos)))
        nxt = torch.clamp(a + m + 1, max=last)[:, None]  # [b, 1]
        bonus = greedy.gather(1, m[:, None])
        st.tokens.scatter_(1, nxt, torch.where(act, bonus, st.tokens.gather(1, nxt)))
        emitted = torch.clamp(pos + 1, max=last)  # [b, B]: where g_k goes if accepted
        at = emitted.unsqueeze(-1).expand(-1, -1, 2)
        st.top2.scatter_(1, at, torch.where(act.unsqueeze(-1), vals, st.top2.gather(1, at)))
        here = a[:, None]
        st.accepted.scatter_(1, here, torch.where(act, m[:, None] + 1, st.accepted.gather(1, here)))
        ends = (self._ends(greedy, emitted) & (offsets <= m[:, None])).any(dim=1)
        st.anchor.copy_(torch.where(active, nxt[:, 0], a))
        st.active.copy_(active & ~ends)

    # ----------------------------------------------------------------------- decoding

    def _check(self, prompts: Sequence[Tensor], max_new_tokens: int, stop_ids: Sequence[int]) -> None:
        if not 1 <= len(prompts) <= self.batch_size:
            raise ValueError(f"prompts: need 1..{self.batch_size} (the batch size), got {len(prompts)}")
        for i, p in enumerate(prompts):
            if p.dim() != 1 or p.numel() < 1:
                raise ValueError(f"prompts[{i}]: need a non-empty 1-D tensor of ids, got shape {tuple(p.shape)}")
            need = p.numel() + max_new_tokens + self.block_size + SLACK
            if need > self.max_len:
                raise ValueError(f"prompts[{i}]: {p.numel()} tokens + {max_new_tokens} new + block "
                                 f"{self.block_size} needs max_len >= {need}, have {self.max_len}")
        bad = [s for s in stop_ids if int(s) < 0]
        if bad:
            raise ValueError(f"stop_ids: token ids are >= 0, got {bad}")

    #: Elements of one prefill chunk's attention scores (rows × g·P × T_max); longer prompt sets are
    #: prefilled in several forwards so the transient fp32 scores stay near 1 GiB.
    PREFILL_CHUNK_ELEMENTS = 1 << 28

    @torch.no_grad()
    def prefill(self, prompts: Sequence[Tensor]) -> list[tuple[int, tuple[float, float]]]:
        """Run ``prompts [P_r]`` into rows ``0 … n−1``: keys/values and features of positions
        ``0 … P_r − 1``; each row's first generated token is written at ``P_r`` (its top-2 logits
        too) and becomes its anchor. Eager; the prompts go right-padded to the longest in as few
        forwards as :attr:`PREFILL_CHUNK_ELEMENTS` allows. A padded row writes keys/values past its
        prompt too, at slots its own later forwards overwrite before any query can read them (a
        query at ``p`` reads slots ``≤ p``, and the forward at ``p`` writes slot ``p`` first).

        Returns:
            per row, ``(first token, (z1, z2))``.
        """
        st = self.state
        lens = [p.numel() for p in prompts]
        width = max(lens)
        per_row = max(1, self.group * width * self.max_len)
        chunk = max(1, self.PREFILL_CHUNK_ELEMENTS // per_row)
        out: list[tuple[int, tuple[float, float]]] = []
        for start in range(0, len(prompts), chunk):
            part = list(range(start, min(len(prompts), start + chunk)))
            ids = torch.zeros(len(part), width, dtype=torch.long)
            for i, r in enumerate(part):
                ids[i, :lens[r]] = prompts[r]
            ids = ids.to(self.device)
            pos = torch.arange(width, device=self.device).expand(len(part), width)
            rows = torch.tensor(part, device=self.device)
            last = torch.tensor([lens[r] - 1 for r in part], device=self.device)
            vals, top, feats = self.forward(ids, pos, rows=rows, features=bool(self.layer_ids), logits_at=last)
            st.tokens[rows, :width] = ids
            st.tokens[rows, last + 1] = top[:, 0, 0]
            st.top2[rows, last + 1] = vals[:, 0]
            if feats is not None:
                st.features[rows, :width] = feats
            st.anchor[rows] = last + 1
            st.active[rows] = True
            firsts, z = top[:, 0, 0].tolist(), vals[:, 0].tolist()
            out += [(int(t), (a, b)) for t, (a, b) in zip(firsts, z)]
        return out

    def _set_stops(self, stops: list[int]) -> None:
        """Write ``stops`` into :attr:`DecodeState.stop_ids` (grown to a power of two if too short)."""
        st = self.state
        if len(stops) > st.stop_ids.numel():
            st.stop_ids = torch.full((1 << (len(stops) - 1).bit_length(),), -1, dtype=torch.long, device=self.device)
            torch._dynamo.mark_static_address(st.stop_ids)
        padded = stops + [-1] * (st.stop_ids.numel() - len(stops))
        st.stop_ids.copy_(torch.tensor(padded, dtype=torch.long))

    def _start(self, prompts: Sequence[Tensor], max_new_tokens: int, stop_ids: Sequence[int]) -> list[bool]:
        """Validate, prefill every prompt and arm the device state. Returns which rows still generate."""
        self._check(prompts, max_new_tokens, stop_ids)
        st = self.state
        st.active.zero_()
        st.anchor.zero_()
        st.accepted.zero_()
        stops = sorted({int(s) for s in stop_ids})
        self._stops = frozenset(stops)
        if max_new_tokens < 1:
            return [False] * len(prompts)
        self._set_stops(stops)
        active = [tok not in self._stops and max_new_tokens > 1 for tok, _ in self.prefill(prompts)]
        pad = [False] * (self.batch_size - len(prompts))
        st.active.copy_(torch.tensor(active + pad))
        limits = [p.numel() + max_new_tokens - 1 for p in prompts] + [0] * len(pad)
        st.limit.copy_(torch.tensor(limits, dtype=torch.long))
        return active

    def _poll(self, n: int) -> tuple[list[int], list[bool]]:
        """Anchors and active flags of rows ``0 … n−1``: the one device→host sync of a check."""
        st = self.state
        both = torch.stack([st.anchor[:n], st.active[:n].long()]).tolist()
        return both[0], [bool(x) for x in both[1]]

    def _collect(self, prompts: Sequence[Tensor], max_new_tokens: int, passes: bool) -> list[Generation]:
        """Read each row's tokens, top-2 logits and passes off the device once, after decoding.

        A row's output is ``tokens[P … anchor]`` cut after its first stop token and at
        ``max_new_tokens`` (a verification pass that ends a row may have written tokens past the
        end); its passes are the positions ``P ≤ j < anchor`` with ``accepted[j] > 0``.
        """
        st = self.state
        n = len(prompts)
        gens = [Generation() for _ in prompts]
        if max_new_tokens < 1:
            return gens
        anchor = st.anchor[:n].tolist()
        end = max(anchor) + 1
        tokens = st.tokens[:n, :end].tolist()
        top2 = st.top2[:n, :end].tolist()
        accepted = st.accepted[:n, :end].tolist() if passes else None
        for r, (g, prompt) in enumerate(zip(gens, prompts)):
            p = prompt.numel()
            out = tokens[r][p:anchor[r] + 1][:max_new_tokens]
            cut = next((i for i, t in enumerate(out) if t in self._stops), None)
            g.tokens = out if cut is None else out[:cut + 1]
            g.top2 = [(z[0], z[1]) for z in top2[r][p:p + len(g.tokens)]]
            if accepted is None:
                g.target_forwards = len(g.tokens)
                continue
            g.anchors = [j for j in range(p, anchor[r]) if accepted[r][j] > 0]
            g.accepted = [accepted[r][j] for j in g.anchors]
            g.target_forwards = 1 + len(g.accepted)
        return gens

    @staticmethod
    def _bound(forwards: int, max_new_tokens: int) -> None:
        """Every forward emits at least one token per active row, so a row still active after
        ``max_new_tokens`` forwards means the device state is corrupt: fail rather than spin."""
        if forwards >= max_new_tokens:
            raise RuntimeError(f"decoding: rows still active after {forwards} target forwards for "
                               f"max_new_tokens={max_new_tokens} (inconsistent device state)")

    @staticmethod
    def _report(progress: Optional[Callable[[int], None]], shown: list[int], now: list[int]) -> None:
        """Tell ``progress`` the tokens added since the last call (``now[r]`` past the first, per row)."""
        added = sum(max(0, x - s) for x, s in zip(now, shown))
        shown[:] = [max(x, s) for x, s in zip(now, shown)]
        if progress is not None and added:
            progress(added)

    @torch.no_grad()
    def greedy(self, prompts: Sequence[Tensor], max_new_tokens: int, stop_ids: Sequence[int] = (),
               progress: Optional[Callable[[int], None]] = None) -> list[Generation]:
        """Target-only greedy decoding of up to ``batch_size`` prompts (one token per forward).

        The steps run back to back on the device (:meth:`_greedy_step_impl` stops each row itself);
        the host reads the anchors and active flags every :attr:`sync_every` steps (never more
        steps than the longest row still needs) and the tokens once at the end.

        Args:
            prompts: ``[P_i]`` int64 each.
            max_new_tokens: per prompt.
            stop_ids: a row stops after emitting one of these (kept).
            progress: called with the number of tokens added (after each prompt's first) at
                every check.

        Returns:
            one :class:`Generation` per prompt.

        Raises:
            ValueError: too many prompts, an empty prompt, one that does not fit ``max_len``, or a
                negative stop id.
        """
        start = time.perf_counter()
        active = self._start(prompts, max_new_tokens, stop_ids)
        n = len(prompts)
        lens = [p.numel() for p in prompts]
        limit = [p + max_new_tokens - 1 for p in lens]
        anchor = list(lens)
        shown = [0] * n
        forwards = 0
        while any(active):
            self._bound(forwards, max_new_tokens)
            steps = max(1, min(self.sync_every, max(limit[r] - anchor[r] for r in range(n) if active[r])))
            for _ in range(steps):
                self._greedy_step()
            forwards += steps
            anchor, active = self._poll(n)
            self._report(progress, shown, [a - p if on else 0 for a, p, on in zip(anchor, lens, active)])
        gens = self._collect(prompts, max_new_tokens, passes=False)
        self._report(progress, shown, [max(0, len(g.tokens) - 1) for g in gens])
        elapsed = time.perf_counter() - start
        for g in gens:
            g.seconds = elapsed
        return gens

    @torch.no_grad()
    def speculative(self, prompts: Sequence[Tensor], max_new_tokens: int, stop_ids: Sequence[int] = (),
                    progress: Optional[Callable[[int], None]] = None) -> list[Generation]:
        """Greedy speculative decoding of up to ``batch_size`` prompts: draft, verify, accept.

        Every emitted token is the target's greedy choice given the tokens before it, so the output
        equals target-only greedy decoding token for token up to floating-point differences between
        a B-token and a 1-token forward (Leviathan et al. 2023; DFlash, arXiv 2602.06036, §3).
        τ conventions: each pass counts ``m + 1`` (the last pass too, even when a stop token or
        ``max_new_tokens`` cuts its tokens); the prefill is not a pass.

        Acceptance runs on the device (:meth:`_verify_step_impl`); the host reads the anchors and
        active flags every :attr:`sync_every` passes, never more passes than the longest row
        certainly still needs (``⌈remaining / B⌉``: a pass emits at most ``B`` tokens), so only a
        stop token can leave passes that change nothing.

        Args / Returns / Raises: as :meth:`greedy`; ``ValueError`` too when no drafter was given.
        """
        if self.proposer is None:
            raise ValueError("speculative decoding needs a drafter (Generator(drafter=...))")
        start = time.perf_counter()
        active = self._start(prompts, max_new_tokens, stop_ids)
        n = len(prompts)
        b_sz = self.block_size
        lens = [p.numel() for p in prompts]
        limit = [p + max_new_tokens - 1 for p in lens]
        anchor = list(lens)
        shown = [0] * n
        timer = _Timer(self.device)
        forwards = 0
        while any(active):
            self._bound(forwards, max_new_tokens)
            need = max(-(-(limit[r] - anchor[r]) // b_sz) for r in range(n) if active[r])
            passes = max(1, min(self.sync_every, need))
            forwards += passes
            for _ in range(passes):
                t = timer.start("draft")
                if self.compiled:
                    self._draft_step()
                else:
                    self._draft_step(int(self.state.anchor[:n].max()) + 1)
                timer.stop("draft", t)
                t = timer.start("verify")
                self._verify_step()
                timer.stop("verify", t)
            anchor, active = self._poll(n)
            self._report(progress, shown, [a - p if on else 0 for a, p, on in zip(anchor, lens, active)])
        gens = self._collect(prompts, max_new_tokens, passes=True)
        self._report(progress, shown, [max(0, len(g.tokens) - 1) for g in gens])
        split = timer.totals()
        elapsed = time.perf_counter() - start
        for g in gens:
            g.seconds = elapsed
            g.draft_seconds = split.get("draft", 0.0)
            g.verify_seconds = split.get("verify", 0.0)
        return gens


# --------------------------------------------------------------------------- the oracle


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
    seq = prompt_ids.to(_device_of(model)).view(1, -1)
    stops = frozenset(int(s) for s in stop_ids)
    out: list[int] = []
    while len(out) < max_new_tokens:
        tok = int(model(input_ids=seq, use_cache=False).logits[0, -1].argmax())
        out.append(tok)
        if tok in stops:
            break
        seq = torch.cat([seq, seq.new_tensor([[tok]])], dim=1)
    return out
