"""The target over the static KV cache and the step functions of decoding (the device side).

:class:`DecodeSteps` owns the decoding state (:class:`dflash.inference.decode_state.DecodeState`)
and every forward that writes it; :class:`dflash.inference.generation.Generator` adds the host
loops on top. In the manner of pytorch-labs/gpt-fast ``generate.py``, each step function is traced
once over fixed shapes and, on CUDA, replayed as a CUDA graph: captured once over the static
state into a :class:`torch.cuda.CUDAGraph` and replayed directly (``cuda_graphs="captured"``, the
default, :class:`CapturedStep`: the serving engines' full-graph decoding, no Python between
replays), or through CUDAGraph Trees (``torch.compile(mode="reduce-overhead")``,
``cuda_graphs="trees"``); on CPU the same functions run eagerly.

**Steps.**

* :meth:`DecodeSteps.prefill` (all prompts right-padded in one forward; causal attention over
  the prompts' own keys in the fused layers; compiled with dynamic shapes on CUDA, eager
  elsewhere): the prompts' keys/values, features and the first generated token.
* target-only step (compiled): run the anchor at ``anchor``, append the argmax (a sample, for a
  decoder built with ``sampling``: :mod:`dflash.inference.sampling`), ``anchor += 1``;
  the row turns inactive after a stop token or its last position.
* draft (compiled): for a drafter of full-attention layers,
  :class:`dflash.inference.proposer.CachedDFlashProposer`: the drafter's layers over the block,
  reading their context keys/values from a per-layer cache (filled by the prefill; each draft
  re-projects the window ``anchor − B … anchor − 1``, which holds the positions the last
  verification accepted), as the serving engines run it, with verification's cache attention;
  otherwise :class:`dflash.inference.proposer.DFlashProposer`: the drafter's own
  :meth:`dflash.models.drafter.DFlashDraftModel.forward` on the whole static feature buffer
  (``S = T_max`` when compiled, ``S = max(anchor) + 1`` when eager) with ``anchors = anchor``,
  exactly the training forward, which recomputes the context's projections every step. The two
  compute the same math in another floating-point order: identical drafts in fp32 over whole
  decodes (tested); in bf16 a draft at a near-tie of the drafter's logits can differ.
* verify (compiled): the target over ``[anchor token, d_1 … d_{B−1}]`` at ``anchor … anchor+B−1``;
  the number of accepted drafts ``m`` = leading ``k`` with ``d_{k+1} = g_k``; the block's features
  are written at ``anchor … anchor+B−1`` (the next draft reads only positions ``≤ anchor + m``,
  i.e. the anchor and the accepted drafts, all computed on correct tokens); the bonus ``g_m`` is
  written at ``anchor + m + 1`` and becomes the next anchor; the row turns inactive when one of
  ``g_0 … g_m`` is a stop token or reaches its last position.

The step functions take no arguments and return nothing: every decision (acceptance, the bonus
token, the new anchor, stopping a row) is made on the device and written into the state, so the
steps run back to back without a device→host sync.

The target is any transformers decoder with the ``embed_tokens / layers / norm / rotary_emb``
layout (Llama, Qwen2/3, Mistral; the layout :class:`dflash.models.target.TargetModel` runs), called layer
by layer with :class:`dflash.inference.decode_state.StaticKVCache` (duck-typed: transformers' attention calls
``cache.update(k, v, layer_idx, …)`` in every 5.x release). Linear-attention layers (Qwen3.5) are
not supported.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from dflash.inference.decode_layers import (FLEX_KV_BLOCK, PREFILL_ATTENTION, decode_block_mask, default_attention,
                                            fuse_layers, split_attention)
from dflash.inference.decode_state import DecodeState, StaticKVCache
from dflash.inference.proposer import CachedDFlashProposer, DFlashProposer, cacheable, drafter_for_decoding
from dflash.inference.sampling import Sampling, sample_tokens, token_ids
from dflash.models.drafter import FLEX_MIN_HEAD_DIM
from dflash.models.target import _decoder, layer_types_of

__all__ = ["CACHE_ALIGN", "CUDA_GRAPHS", "CapturedStep", "DecodeSteps", "add_cuda_graphs_argument", "compile_options",
           "cuda_graph_capture"]

log = logging.getLogger(__name__)

FULL = "full_attention"
SLIDING = "sliding_attention"


def _layer_cache_kwarg(layer: nn.Module) -> str:
    """``cache`` (transformers ≥ 5.2x) or ``past_key_values`` (earlier 5.x): the decoder layer's cache argument."""
    params = inspect.signature(layer.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def compile_options(flex: bool, cudagraphs: bool = True) -> dict[str, Any]:
    """``torch.compile`` keyword arguments of a decoding step: ``mode="reduce-overhead"`` (CUDA
    graphs) or, with ``cudagraphs=False``, inductor's defaults. With ``flex`` (flex_attention's CUDA
    kernels in the step) inductor's prologue fusion is off: fusing the block mask's and the
    decoding rule's index arithmetic into the flex template generated a kernel that did not
    compile (a fused pointwise prologue referring to ``XBLOCK`` inside the template, torch 2.11)."""
    if not (flex and hasattr(torch._inductor.config, "prologue_fusion")):
        return {"mode": "reduce-overhead"} if cudagraphs else {}
    return {"options": {"triton.cudagraphs": cudagraphs, "prologue_fusion": False}}


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


#: How compiled steps replay on CUDA, the default first: ``captured`` = one :class:`torch.cuda.CUDAGraph`
#: per step function and state layout, replayed directly (:class:`CapturedStep`); ``trees`` = CUDAGraph
#: Trees (``torch.compile(mode="reduce-overhead")``), whose Python bookkeeping runs at every call.
CUDA_GRAPHS = ("captured", "trees")


def add_cuda_graphs_argument(parser: Any) -> None:
    """``--cuda-graphs`` on an :class:`argparse.ArgumentParser`: one of :data:`CUDA_GRAPHS`, the
    first by default (``args.cuda_graphs``)."""
    parser.add_argument("--cuda-graphs", choices=CUDA_GRAPHS, default=CUDA_GRAPHS[0],
                        help="how the compiled steps replay on CUDA: captured = each step recorded once into a "
                             "torch.cuda.CUDAGraph over the static decoding state and replayed directly (dflash."
                             "inference.decode_steps.CapturedStep); trees = CUDAGraph Trees (torch.compile "
                             "mode=reduce-overhead); the same kernels and outputs (default: %(default)s)")


def cuda_graph_capture(pool: Any, device: torch.device) -> Callable[[Callable[..., Any], tuple], Callable[[], Any]]:
    """A capture function for :class:`CapturedStep`: records ``fn(*args)`` on ``device`` into a
    :class:`torch.cuda.CUDAGraph` whose intermediates live in the memory ``pool``
    (:func:`torch.cuda.graph_pool_handle`, shared by the steps of one decoder: they replay one after
    the other on one stream and keep nothing between replays) and returns its replay (on
    ``device``'s current stream). Recording does not run the kernels. A recompilation of ``fn``
    during the recording (a guard its warm-up calls did not pass) raises instead of compiling and
    autotuning under capture.

    The steps' cuBLAS calls allocate the capture stream's workspace inside the first recording's
    pool; CUDAGraph Trees free cuBLAS workspaces when they record, so a process decodes with one
    :data:`CUDA_GRAPHS` mode (``decode_bench`` runs one per process)."""

    def capture(fn: Callable[..., Any], args: tuple) -> Callable[[], Any]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device), torch._dynamo.config.patch(error_on_recompile=True):
            with torch.cuda.graph(graph, pool=pool):
                fn(*args)

        def replay() -> None:
            with torch.cuda.device(device):
                graph.replay()

        return replay

    return capture


class CapturedStep:
    """A step function that writes only static buffers, replayed from one recorded graph.

    The first ``warmup`` calls for a given ``(args, layout())`` run ``fn`` itself (compilation,
    autotuning and library handles happen outside any recording); the next records it with
    ``capture`` (which does not run it) and replays the recording once; later calls only replay.
    Each call is a real step: warm-up calls and replays write the same buffers, so the outputs do
    not depend on when the recording happens. ``layout()`` names the buffers the step reads and
    writes (their addresses and sizes): when one is reallocated (a longer stop list), the next
    call warms up and records again instead of replaying a graph that points at the old buffer.

    Args:
        fn: the step (``torch.compile`` without CUDA graphs, or eager); returns nothing.
        layout: a hashable description of the state's buffers, called at every call (µs).
        capture: ``capture(fn, args) -> replay`` (:func:`cuda_graph_capture`; tests pass one that
            replays by calling ``fn``).
        warmup: calls before recording (≥ 1).

    Raises:
        ValueError: ``warmup < 1``.
    """

    def __init__(self, fn: Callable[..., Any], layout: Callable[[], Any],
                 capture: Callable[[Callable[..., Any], tuple], Callable[[], Any]], warmup: int = 2) -> None:
        if warmup < 1:
            raise ValueError(f"warmup: must be >= 1, got {warmup}")
        self.fn, self.layout, self.capture, self.warmup = fn, layout, capture, int(warmup)
        self.replays: dict[Any, Callable[[], Any]] = {}
        self.calls: dict[Any, int] = {}

    @property
    def recordings(self) -> int:
        """Graphs recorded so far (one per argument tuple and buffer layout)."""
        return len(self.replays)

    def __call__(self, *args: Any) -> None:
        key = (args, self.layout())
        replay = self.replays.get(key)
        if replay is None:
            done = self.calls.get(key, 0)
            if done < self.warmup:
                self.calls[key] = done + 1
                self.fn(*args)
                return
            replay = self.replays[key] = self.capture(self.fn, args)
        replay()


#: Cache slots a decoder's ``T_max`` is rounded up to a multiple of. With ``matmul`` attention the
#: scores and probabilities are ``[.., g·T, T_max]`` matrices: an odd ``T_max`` leaves their rows
#: unaligned, and cuBLAS then runs its alignment-1 CUTLASS kernels (SmolLM2-135M's shape, bf16,
#: T_max = 593, one H200: the 70 of a speculative pass took 0.68 ms of its 1.86 ms of kernels;
#: ``scripts/decode_speed.py --profile``). 8 slots are 16 bytes in bf16.
CACHE_ALIGN = 8


class DecodeSteps:
    """The decoding state of a batch and the target / drafter forwards that write it.

    Args:
        model: the target's transformers ``*ForCausalLM`` (eval; its weights' dtype is the
            decoding dtype).
        layer_ids: target layers whose outputs form the context features (the drafter's
            ``target_layer_ids``); may be empty for target-only decoding.
        max_len: ``T_max``: positions per row (prompt + generated + ``B`` + 1 must fit); rounded up
            to a multiple of :data:`CACHE_ALIGN`, or of
            :data:`dflash.inference.decode_layers.FLEX_KV_BLOCK` when flex_attention's kernels run
            (``"flex"`` compiled on CUDA), which read whole key/value blocks.
        batch_size: rows decoded together (prompts of different lengths; each row accepts its
            own drafts).
        drafter: a :class:`dflash.models.drafter.DFlashDraftModel` or any
            :class:`dflash.inference.proposer.Proposer`; ``None`` = target-only.
        compile: compile the step functions with ``torch.compile`` and replay them as CUDA graphs
            on CUDA (``cuda_graphs``); ``None`` = on CUDA only.
        fuse: run the target's layers as :class:`dflash.inference.decode_layers.FusedDecoderLayer` (fused
            projections, grouped-query attention on the cache in place) when every layer is
            supported; ``False`` = through the transformers layers. Same math either way.
        compile_prefill: compile the prefill forward too (:meth:`compile_prefill`) when the
            steps are compiled on CUDA; ``None`` = yes. ``False`` for large batches, whose prefill
            forwards are device-bound: a dynamic-shape compilation (and its recompilations) costs
            more than it saves there.
        attention: the fused layers' attention, one of
            :data:`dflash.inference.decode_layers.ATTENTIONS`, or ``"X+Y"``: ``X`` in the
            target-only one-token step, ``Y`` in verification (the prefill of the fused layers runs
            :data:`dflash.inference.decode_layers.PREFILL_ATTENTION`)
            (:func:`dflash.inference.decode_layers.split_attention`); ``"flex"`` builds no mask tensor;
            ``None``: :func:`dflash.inference.decode_layers.default_attention` of ``batch_size``
            (kept in :attr:`attention`).
        draft_cache: a :class:`dflash.models.drafter.DFlashDraftModel` of full-attention layers drafts
            through :class:`dflash.inference.proposer.CachedDFlashProposer` (its context keys/values
            cached per layer, the engines' way); ``False``, or a drafter with sliding-window layers:
            through :class:`dflash.inference.proposer.DFlashProposer` (its training forward over the
            whole feature buffer at every draft). The same math either way (identical drafts in
            fp32; in bf16 a near-tie of the drafter's logits can flip). A DFlash drafter's weights
            are cast in place to a half-precision target's dtype
            (:func:`dflash.inference.proposer.drafter_for_decoding`).
        cuda_graphs: how compiled steps replay on CUDA, one of :data:`CUDA_GRAPHS`: ``"captured"``
            (the default; :class:`CapturedStep`: inductor's kernels without CUDA graphs, each step
            traced whole (``fullgraph=True``: a target whose forward breaks the trace fails at its
            first step instead of replaying Python decisions frozen at recording) and recorded
            once into a :class:`torch.cuda.CUDAGraph` over the static state, replayed directly) or
            ``"trees"`` (CUDAGraph Trees through ``mode="reduce-overhead"``: their Python
            bookkeeping runs at every call). The same kernels and outputs either way.
        sampling: target-only decoding samples each token at this temperature / top-p
            (:func:`dflash.inference.sampling.sample_tokens`: the noise is a function of the row's
            seed in :attr:`DecodeState.seeds`, the token's position and id, so a row's tokens do not
            depend on the batch) instead of taking the argmax; ``None`` = greedy. Fixed for the
            decoder's life (its compiled steps hold it). Speculative decoding here is greedy: a
            sampling decoder takes no drafter.

    Raises:
        ValueError: a layer id outside the target, a layer type other than full / sliding attention
            (linear attention), an attention implementation other than sdpa / eager, an
            ``attention`` that :func:`dflash.inference.decode_layers.split_attention` refuses (or ``"flex"``
            compiled on CUDA with a target's or cached drafter's head dim below 16), ``max_len < 2``,
            ``batch_size < 1``, a ``cuda_graphs`` not in :data:`CUDA_GRAPHS`, or ``sampling`` with a
            drafter.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], max_len: int, batch_size: int = 1,
                 drafter: Any = None, compile: Optional[bool] = None, fuse: bool = True,
                 attention: Optional[str] = None, compile_prefill: Optional[bool] = None,
                 draft_cache: bool = True, cuda_graphs: str = CUDA_GRAPHS[0],
                 sampling: Optional[Sampling] = None) -> None:
        if cuda_graphs not in CUDA_GRAPHS:
            raise ValueError(f"cuda_graphs: one of {CUDA_GRAPHS}, got {cuda_graphs!r}")
        if sampling is not None and drafter is not None:
            raise ValueError("sampling: speculative decoding here is greedy; a sampling decoder takes no drafter")
        self.cuda_graphs = cuda_graphs
        self.sampling = sampling
        self.attention = default_attention(batch_size) if attention is None else attention
        self.step_attention, self.block_attention = split_attention(self.attention)
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
        types = layer_types_of(self.config, self.num_layers)
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
        self.fused = fuse_layers(self.decoder.layers, self.config, self.block_attention) if fuse else None
        self.compiled = self.device.type == "cuda" if compile is None else bool(compile)
        self.flex_kernels = (self.compiled and self.device.type == "cuda"
                             and "flex" in (self.step_attention, self.block_attention))
        # flex_attention's CUDA kernels read whole key/value blocks: a cache of whole blocks; else
        # whole multiples of CACHE_ALIGN slots (aligned rows for the GEMMs of matmul attention)
        align = FLEX_KV_BLOCK if self.flex_kernels else CACHE_ALIGN
        self.max_len = -(-int(max_len) // align) * align
        self.batch_size = int(batch_size)
        if drafter is None:
            self.proposer = None
        elif hasattr(drafter, "fc") and hasattr(drafter, "layers"):
            drafter_for_decoding(drafter, self.dtype)  # its weights as served, not cast at every draft
            self.proposer = (CachedDFlashProposer(drafter, batch_size, self.max_len, self.dtype, self.block_attention)
                             if draft_cache and cacheable(drafter) else DFlashProposer(drafter))
        else:
            self.proposer = drafter
        self.block_size = int(self.proposer.block_size) if self.proposer is not None else 1
        width = int(self.config.hidden_size)
        kv_heads = int(getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads)
        self.group = int(self.config.num_attention_heads) // kv_heads
        head_dim = int(getattr(self.config, "head_dim", None) or width // self.config.num_attention_heads)
        # flex_attention's CUDA kernels, compiled, need head_dim >= 16 in every model that runs them
        flex_heads = []
        if self.flex_kernels and self.fused is not None:
            flex_heads.append(("the target", head_dim))
        if self.flex_kernels and isinstance(self.proposer, CachedDFlashProposer) and self.block_attention == "flex":
            flex_heads.append(("the drafter (draft_cache=False drafts without flex)", self.proposer.head_dim))
        for who, dim in flex_heads:
            if dim < FLEX_MIN_HEAD_DIM:
                raise ValueError(f"attention 'flex': flex_attention's CUDA kernels need head_dim >= "
                                 f"{FLEX_MIN_HEAD_DIM}, {who} has {dim}")
        kv = StaticKVCache(self.num_layers, self.batch_size, kv_heads, self.max_len, head_dim, self.dtype, self.device)
        self.state = DecodeState.allocate(kv, self.batch_size, self.max_len, max(1, len(self.layer_ids)) * width,
                                          self.block_size, self.dtype, self.device)
        #: ``[V]`` int64, the ids the sampler hashes, made here so the compiled steps read them from
        #: memory (:func:`dflash.inference.sampling.token_ids`); ``None`` when greedy. ``V`` is the
        #: output head's width now: a model whose head is replaced afterwards needs a new decoder.
        self.token_ids = None
        if sampling is not None:
            self.token_ids = token_ids(int(self.model.get_output_embeddings().weight.shape[0]), self.device)
            torch._dynamo.mark_static_address(self.token_ids)
        self._slots: dict[int, list[int]] = {}
        for slot, layer in enumerate(self.layer_ids):
            self._slots.setdefault(layer, []).append(slot)
        self._graph_pool: Any = None  # the memory pool of this decoder's recorded steps (cuda_graphs="captured")
        self._greedy_step = self._wrap(self._greedy_step_impl)
        self._draft_step = self._wrap(self._draft_step_impl) if self.proposer is not None else None
        self._verify_step = self._wrap(self._verify_step_impl)
        #: The fused layers' attention in :meth:`prefill`: :data:`PREFILL_ATTENTION` (the prompts'
        #: own keys, causal); ``None`` (the transformers layers) = the multi-token attention over the cache.
        self.prefill_attention: Optional[str] = PREFILL_ATTENTION if self.fused is not None else None
        self._prefill_forward: Callable[..., Any] = self.forward
        if self.compiled and self.device.type == "cuda" and compile_prefill is not False:
            self.compile_prefill()

    def graphs_recorded(self) -> bool:
        """Whether every step this decoder has run as a :class:`CapturedStep` (``cuda_graphs=
        "captured"``) has recorded its graph; ``True`` for the other modes (nothing to record, or
        CUDAGraph Trees' own recording)."""
        steps = (self._greedy_step, self._draft_step, self._verify_step)
        return all(s.recordings > 0 for s in steps if isinstance(s, CapturedStep))

    def _layout(self) -> tuple[tuple[int, int], ...]:
        """The addresses and sizes of the decoding state's buffers (:class:`CapturedStep`'s
        ``layout``): only :attr:`DecodeState.stop_ids` is ever reallocated, always larger (a longer
        stop list), so a buffer the allocator hands out again at a freed address still gives a new
        key; the caches are fixed."""
        st = self.state
        return tuple((t.data_ptr(), t.numel()) for t in (st.tokens, st.anchor, st.active, st.features, st.drafts,
                                                         st.logit_stats, st.accepted, st.limit, st.stop_ids))

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not self.compiled:
            return fn
        if self.cuda_graphs == "captured" and self.device.type == "cuda":
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            # one graph for the whole step: Python between graph pieces would run at recording only
            compiled = torch.compile(fn, fullgraph=True, dynamic=False,
                                     **compile_options(self.flex_kernels, cudagraphs=False))
            return CapturedStep(compiled, self._layout, cuda_graph_capture(self._graph_pool, self.device))
        compiled = torch.compile(fn, fullgraph=False, dynamic=False, **compile_options(self.flex_kernels))

        def call(*args: Any) -> Any:
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(*args)

        return call

    def compile_prefill(self, backend: Any = "inductor") -> None:
        """Run the prefill forward through ``torch.compile`` with dynamic shapes (one graph for every
        prompt width and row count; no CUDA graphs, whose recordings are per shape).

        Eagerly a prefill is host-bound: ~45 small ops a fused layer (1,350 for SmolLM2's 30 layers),
        each costing several µs of host time whatever the prompt's length. Compiled, inductor's
        fused kernels launch from one wrapper. Should compiling fail (a lowering this torch cannot
        do), the prefill stays eager with a warning: slower, same tokens.

        Args:
            backend: ``torch.compile`` backend, a name or a callable (``"aot_eager"`` checks the
                trace on CPU).
        """
        compiled = torch.compile(self.forward, backend=backend, dynamic=True)

        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return compiled(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - any compile failure: the eager forward does the same
                # A later width may recompile (dynamic shapes specialise 0/1), so every call is guarded.
                log.warning("compiled prefill failed (%s: %s); prefill runs eagerly", type(e).__name__,
                            str(e).splitlines()[0][:200] if str(e) else "")
                self._prefill_forward = self.forward
                return self.forward(*args, **kwargs)

        self._prefill_forward = guarded

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

    @torch.no_grad()
    def forward(self, input_ids: Tensor, positions: Tensor, rows: Optional[Tensor] = None,
                features: bool = True, logits_at: Optional[Tensor] = None, attention: Optional[str] = None,
                sample_at: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """The target over ``input_ids`` at ``positions``, on top of the cache; writes their keys/values.
        Without gradients (decoding never needs them; flex_attention has no CPU backward).

        Args:
            input_ids / positions: ``[b', T]`` int64.
            rows: ``[b']`` row ids of the cache (``None`` = all rows, ``b' = b``).
            features: also return the fused features.
            logits_at: ``[b']`` int64: logits of that token of each row only (prefill: a row's last
                prompt token when prompts are right-padded to one length).
            attention: the fused layers' attention in this forward (default: the multi-token one;
                :data:`dflash.inference.decode_layers.PREFILL_ATTENTION` when ``positions`` are
                ``0 … T−1`` in every row: a prefill into empty rows, which reads no cache slot).
            sample_at: ``[b', T']`` int64, the positions the chosen tokens are written at: a
                sampling decoder (``sampling``) samples them there instead of taking the argmax.

        Returns:
            ``(logit stats [b', T', 3] fp32, argmax (or sampled) ids [b', T', 1] int64, features [b', T, L·D] or None)``
            with ``T' = 1`` when ``logits_at`` is given. The stats are ``(z1, z2, spread)``: the two largest
            logits and ``max_v |z_v − mean(z)|`` over the vocabulary (the logits' scale for the tie bound,
            :func:`dflash.inference.lossless.tie_bound`). The argmax takes the lowest id of tied logits
            (``torch.argmax``, as the oracle and the drafter's proposals do; ``topk``'s order of ties
            differs by device).
        """
        dec = self.decoder
        kv = self.state.kv
        kv.positions, kv.rows = positions, rows
        hidden = dec.embed_tokens(input_ids)
        rope_pos = positions
        if getattr(dec.rotary_emb, "mrope_section", None) is not None:
            rope_pos = positions.unsqueeze(0).expand(3, -1, -1)
        rotary = dec.rotary_emb(hidden, rope_pos)
        attention = attention or self.block_attention
        maskless = self.fused is not None and attention in ("flex", PREFILL_ATTENTION)
        masks = {} if maskless else self._masks(positions)
        if self.fused is not None and attention == "flex" and torch.compiler.is_compiling():
            # The cache blocks each row has written, for every layer (the window is the score_mod's).
            blocks = decode_block_mask(positions, self.group * positions.shape[1], self.max_len)
            masks = {kind: blocks for kind in set(self.layer_types)}
        width = hidden.shape[-1]
        feats = hidden.new_empty(*hidden.shape[:2], len(self.layer_ids) * width) if features else None
        last = self.num_layers - 1
        for i, layer in enumerate(dec.layers):
            if self.fused is not None:
                kind = self.layer_types[i]
                window = int(self.sliding_window) if kind == SLIDING and self.sliding_window is not None else None
                hidden = self.fused[i](hidden, rotary[0], rotary[1], kv.keys[i], kv.values[i], rows, positions,
                                       masks.get(kind), window, attention)
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
        spread = (logits - logits.mean(dim=-1, keepdim=True)).abs().amax(dim=-1, keepdim=True)
        if sample_at is not None and self.sampling is not None:
            seeds = self.state.seeds if rows is None else self.state.seeds[rows]
            ids = sample_tokens(logits, seeds, sample_at, self.sampling, self.token_ids).unsqueeze(-1)
        else:
            ids = logits.argmax(dim=-1, keepdim=True)
        return torch.cat([top.values, spread], dim=-1), ids, feats

    # ----------------------------------------------------------------------- step functions

    def _ends(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """``[b, k]`` bool: emitting ``tokens [b, k]`` at ``positions [b, k]`` ends the row (a stop
        token, or the row's last position :attr:`DecodeState.limit`)."""
        st = self.state
        return (tokens.unsqueeze(-1) == st.stop_ids).any(dim=-1) | (positions >= st.limit.unsqueeze(-1))

    def _greedy_step_impl(self) -> None:
        """One target-only token per active row, entirely on the device (no output, no host sync).

        The argmax at ``anchor`` (sampled, by a sampling decoder) is written at ``anchor + 1`` with
        its logit stats, the anchor moves there, and the row turns inactive when that token is a
        stop token or sits at the row's last position. Inactive rows run the forward too (fixed
        shapes) but change nothing.
        """
        st = self.state
        a, active = st.anchor, st.active
        nxt = torch.clamp(a + 1, max=self.max_len - 1)[:, None]  # [b, 1]
        vals, ids, _ = self.forward(st.tokens.gather(1, a[:, None]), a[:, None], features=False,
                                    attention=self.step_attention, sample_at=nxt)
        tok = ids[:, :, 0]  # [b, 1]
        act = active[:, None]
        st.tokens.scatter_(1, nxt, torch.where(act, tok, st.tokens.gather(1, nxt)))
        at = nxt.unsqueeze(-1).expand(-1, -1, 3)
        st.logit_stats.scatter_(1, at, torch.where(act.unsqueeze(-1), vals, st.logit_stats.gather(1, at)))
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
        anchor), the logit stats of ``g_k`` at ``anchor + 1 + k``, and ``m + 1`` in
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
        at = emitted.unsqueeze(-1).expand(-1, -1, 3)
        st.logit_stats.scatter_(1, at, torch.where(act.unsqueeze(-1), vals, st.logit_stats.gather(1, at)))
        here = a[:, None]
        st.accepted.scatter_(1, here, torch.where(act, m[:, None] + 1, st.accepted.gather(1, here)))
        ends = (self._ends(greedy, emitted) & (offsets <= m[:, None])).any(dim=1)
        st.anchor.copy_(torch.where(active, nxt[:, 0], a))
        st.active.copy_(active & ~ends)

    # ----------------------------------------------------------------------- prefill

    #: Elements of one prefill chunk's attention scores (rows × g·P × T_max) where the prefill reads
    #: the cache (the transformers layers); longer prompt sets are prefilled in several forwards so
    #: the transient fp32 scores stay near 1 GiB.
    PREFILL_CHUNK_ELEMENTS = 1 << 28
    #: Positions (rows × padded width) of one prefill forward of the fused layers, whose causal
    #: attention keeps no scores: the transient activations (the MLP's ``2·I`` channels the
    #: largest) stay near ``PREFILL_CHUNK_TOKENS × 6·I`` bytes in bf16 (SmolLM2-135M: 0.6 GiB).
    PREFILL_CHUNK_TOKENS = 1 << 16

    @torch.no_grad()
    def prefill(self, prompts: Sequence[Tensor], fill_draft_cache: bool = True) -> list[int]:
        """Run ``prompts [P_r]`` into rows ``0 … n−1``: keys/values and features of positions
        ``0 … P_r − 1``; each row's first generated token (the argmax, or a sample) is written at
        ``P_r`` (its logit stats too) and becomes its anchor. Compiled with dynamic shapes where the
        steps are compiled on CUDA (:meth:`compile_prefill`) unless ``compile_prefill=False``, else
        eager. The prompts go
        longest first in forwards of as many rows as :attr:`PREFILL_CHUNK_TOKENS` (fused layers:
        causal attention over the prompts' own keys, :data:`PREFILL_ATTENTION`) or
        :attr:`PREFILL_CHUNK_ELEMENTS` (transformers layers: attention over the cache) allows at
        the width of each forward's longest prompt, the others right-padded to it: a batch of
        mixed lengths pads each forward to its own longest prompt, not to the batch's. A padded
        row writes keys/values past its prompt too, at slots its own later forwards overwrite
        before any query can read them (a query at ``p`` reads slots ``≤ p``, and the forward at
        ``p`` writes slot ``p`` first); its real tokens never read the padding, which comes after
        them. With a :class:`dflash.inference.proposer.CachedDFlashProposer` and ``fill_draft_cache``,
        each forward's features also fill the drafter's context cache (target-only decoding passes
        ``False``: it never drafts).

        Returns:
            per row, its first generated token.
        """
        st = self.state
        lens = [p.numel() for p in prompts]
        attention = self.prefill_attention

        def rows_at(width: int) -> int:  # rows of one forward at this width
            if attention == PREFILL_ATTENTION:
                return max(1, self.PREFILL_CHUNK_TOKENS // width)
            return max(1, self.PREFILL_CHUNK_ELEMENTS // max(1, self.group * width * self.max_len))

        longest_first = sorted(range(len(prompts)), key=lambda r: (-lens[r], r))
        first = [0] * len(prompts)
        start = 0
        while start < len(longest_first):
            width = lens[longest_first[start]]
            part = longest_first[start:start + rows_at(width)]
            start += len(part)
            ids = torch.zeros(len(part), width, dtype=torch.long)
            for i, r in enumerate(part):
                ids[i, :lens[r]] = prompts[r]
            ids = ids.to(self.device)
            pos = torch.arange(width, device=self.device).expand(len(part), width)
            rows = torch.tensor(part, device=self.device)
            last = torch.tensor([lens[r] - 1 for r in part], device=self.device)
            vals, top, feats = self._prefill_forward(ids, pos, rows=rows, features=bool(self.layer_ids),
                                                     logits_at=last, attention=attention, sample_at=(last + 1)[:, None])
            st.tokens[rows, :width] = ids
            st.tokens[rows, last + 1] = top[:, 0, 0]
            st.logit_stats[rows, last + 1] = vals[:, 0]
            if feats is not None:
                st.features[rows, :width] = feats
                if fill_draft_cache and isinstance(self.proposer, CachedDFlashProposer):
                    self.proposer.fill(feats, rows)
            st.anchor[rows] = last + 1
            st.active[rows] = True
            for r, token in zip(part, top[:, 0, 0].tolist()):
                first[r] = token
        return first
