"""Model FLOPs of the target forward and the drafter train step, and model FLOPs utilisation (MFU).

One counting rule for every stage (Kaplan et al. 2020, arXiv 2001.08361, §2.1; Chinchilla,
Hoffmann et al. 2022, arXiv 2203.15556, appendix F; PaLM, Chowdhery et al. 2022, arXiv 2204.02311,
appendix B; nanoGPT ``model.py`` ``estimate_mfu``): only matrix products count, 2 FLOPs per
multiply-add; norms, activations, softmax, RoPE, gating and other elementwise work do not.

* **Linear layers**: ``2 · in · out`` per position a ``nn.Linear`` runs on (bias not counted).
  Every position of the batch shape counts, padding included: the forward computes it.
* **Attention** (score product ``QKᵀ`` and value product ``PV``): ``4 · H · hd`` per (query, key)
  pair the layer's mask allows (``H`` query heads of ``hd``). PaLM's attention term
  (``12 · L · H · Q · T`` a token for forward and backward) counts every key of the context; here
  only the keys the mask lets a query see count, not the ``S²`` a dense kernel computes.
* **Backward**: twice the forward for a product whose input needs a gradient (input gradient and
  weight gradient; PaLM appendix B, Chinchilla appendix F: the ``6N`` rule), once for one whose
  input does not (the drafter's ``fc`` on the target's features, the frozen LM head's weight).
  Activation checkpointing recomputes each drafter layer's forward once more in the backward.

**MFU** = model FLOPs / seconds / peak FLOP/s of the device (PaLM appendix B), per stage: the
target's FLOPs over its forward time, the drafter's over its step time. The peak is
:func:`peak_flops` (the dense bf16 table :data:`PEAK_BF16_FLOPS`, or a configured value).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from dflash.models.linear_attention import CHUNK_SIZE
from dflash.models.masks import FULL_ATTENTION, SLIDING_ATTENTION, query_context_ranges

__all__ = [
    "LINEAR_ATTENTION",
    "DELTA_RULE_CHUNK",
    "PEAK_BF16_FLOPS",
    "PEAK_ENV",
    "FlopCount",
    "linear_weights",
    "packed_causal_pairs",
    "drafter_attention_pairs",
    "delta_rule_chunk_flops",
    "target_forward_flops",
    "drafter_flops",
    "peak_flops",
    "mfu",
]

#: ``config.layer_types`` entry of a Gated-DeltaNet (linear-attention) layer of the Qwen3.5 family.
LINEAR_ATTENTION = "linear_attention"
#: Chunk length of the chunked gated delta rule (the torch path's, fla's default).
DELTA_RULE_CHUNK = CHUNK_SIZE
#: Dense (no sparsity) bf16 tensor-core peak of one GPU in FLOP/s, matched in this order as a
#: substring of ``torch.cuda.get_device_name``: NVIDIA's data sheets, which state the figure with
#: sparsity (twice these). SXM parts unless named.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("B200", 2250e12),
)
#: Environment variable that sets the peak (TFLOP/s of one device) where the config does not.
PEAK_ENV = "DFLASH_PEAK_TFLOPS"

Number = Union[int, float, Tensor]


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of one forward (or train step) by part.

    Each part is a Python int, or a 0-dim int64 tensor where it depends on device data (the
    drafter's attention pairs, counted without a host sync); ``int(count.total)`` reads it.
    """

    parts: dict[str, Number] = field(default_factory=dict)

    @property
    def total(self) -> Number:
        """The sum of the parts (a tensor when a part is one)."""
        return sum(self.parts.values())

    def to_dict(self) -> dict[str, int]:
        """Every part and ``total`` as Python ints (syncs with the device for tensor parts)."""
        out = {k: int(v) for k, v in self.parts.items()}
        out["total"] = sum(out.values())
        return out


def linear_weights(module: nn.Module, names: Optional[Sequence[str]] = None, exclude: Sequence[str] = ()) -> int:
    """Weights (``in · out``) of the ``nn.Linear`` modules under ``module`` whose leaf name is in
    ``names`` (``None`` = any) and not in ``exclude``; a shared weight counts at every use."""
    total = 0
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear):
            leaf = name.rsplit(".", 1)[-1]
            if (names is None or leaf in names) and leaf not in exclude:
                total += m.in_features * m.out_features
    return total


def packed_causal_pairs(doc_ids: Tensor, window: Optional[int] = None) -> Tensor:
    """(query, key) pairs of the target's per-document causal mask, summed over rows: 0-dim int64.

    The mask of :func:`dflash.models.target.packed_attention_mask`: query ``q`` sees key ``k ≤ q``
    of its own document (and ``q − k < W`` in a sliding layer). With the batch contract's packing
    (each conversation one contiguous run of equal ``doc_ids``, padding one run at the row's end)
    the query at offset ``i`` of its run sees ``min(i + 1, W)`` keys; the run-length form is what
    this counts, on ``doc_ids``' device.

    Args:
        doc_ids: ``[R, S]`` integer document ids (0 = padding).
        window: ``W`` of a sliding layer, ``None`` for full attention.

    Raises:
        ValueError: ``doc_ids`` is not 2-D, or ``window < 1``.
    """
    if doc_ids.dim() != 2:
        raise ValueError(f"doc_ids: expected [R, S], got shape {tuple(doc_ids.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"window: must be >= 1, got {window}")
    r, s = doc_ids.shape
    pos = torch.arange(s, device=doc_ids.device).expand(r, s)
    is_start = torch.ones_like(doc_ids, dtype=torch.bool)
    is_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    run_start = torch.cummax(torch.where(is_start, pos, torch.zeros_like(pos)), dim=1).values
    keys = pos - run_start + 1
    if window is not None:
        keys = keys.clamp(max=window)
    return keys.sum()


def drafter_attention_pairs(anchors: Tensor, anchor_keep: Tensor, doc_ids: Tensor, block_size: int,
                            window: Optional[int] = None) -> Tensor:
    """(query, key) pairs of one drafter layer's mask (:mod:`dflash.models.masks`): 0-dim int64.

    Per block query: the context positions ``[lo, hi)`` it sees
    (:func:`dflash.models.masks.query_context_ranges`; none for a dropped block) plus the keys of
    its own block: all ``B`` in a ``full_attention`` layer, ``min(k + 1, W)`` at block position
    ``k`` in a ``sliding_attention`` layer. Computed on the anchors' device, without a host sync.

    Args:
        anchors, anchor_keep: ``[R, A]`` int64 / bool.
        doc_ids: ``[R, S]``.
        block_size: ``B``.
        window: ``W`` of a sliding layer, ``None`` for full attention.
    """
    lo, hi = query_context_ranges(anchors, anchor_keep, doc_ids, block_size, window)
    ctx = (hi - lo).clamp(min=0).sum()
    own = block_size * block_size if window is None else sum(min(k + 1, window) for k in range(block_size))
    return ctx + own * anchors.numel()


def delta_rule_chunk_flops(chunk: int, key_dim: int, value_dim: int) -> int:
    """FLOPs of one head's chunk of the chunked gated delta rule (Gated-DeltaNet).

    The chunkwise (WY / UT-transform) form of Yang, Kautz & Hatamizadeh, "Gated Delta Networks"
    (arXiv 2412.06464, §3.3), as :func:`dflash.models.linear_attention.chunk_gated_delta_rule`
    (and transformers' ``torch_chunk_gated_delta_rule``) runs it, for a chunk of ``C`` positions,
    key head dim ``dk`` and value head dim ``dv``:

    * ``(βK) Kᵀ`` and ``Q Kᵀ`` (``C × dk × C`` each): ``4 C² dk``;
    * two unit lower-triangular solves of the ``C × C`` system for ``βV`` and the decayed ``βK``
      (``C (C − 1) / 2`` multiply-adds per right-hand side column): ``C (C − 1)(dv + dk)``;
    * reading the state ``S [dk × dv]`` for the keys and the queries (``C × dk × dv`` each) and
      writing it back (``Kᵀ V_new``, ``dk × C × dv``): ``6 C dk dv``;
    * the intra-chunk attention times the new values (``C × C × dv``): ``2 C² dv``.

    The FLA kernels compute the same products with the triangular system inverted once; the
    count is this algorithm's. The segment masks that keep packed conversations apart are
    elementwise and not counted.
    """
    c = chunk
    return 4 * c * c * key_dim + 2 * c * c * value_dim + c * (c - 1) * (key_dim + value_dim) + 6 * c * key_dim * value_dim


def _config_int(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if value is None:
        raise ValueError(f"target config: has no {name!r}, needed to count its FLOPs")
    return int(value)


def target_forward_flops(layers: Sequence[nn.Module], layer_types: Sequence[str], config: Any,
                         lm_head_weights: int, doc_ids: Tensor, sliding_window: Optional[int] = None) -> FlopCount:
    """FLOPs of one target forward (:meth:`dflash.models.target.TargetModel.forward_features`).

    With ``T = R·S`` positions:

    * ``linear``: ``2 · (Σ nn.Linear weights of the decoder layers) · T`` (attention, MLP and the
      Gated-DeltaNet projections alike; dense layers only: an MoE layer runs its experts on
      subsets of the positions and is not modelled);
    * ``lm_head``: ``2 · V · D · T`` (the greedy target token is taken at every position);
    * ``attention``: each ``full_attention`` / ``sliding_attention`` layer ``4 · H · hd ·
      pairs``, with the per-document causal pairs of :func:`packed_causal_pairs` (the window
      applied in sliding layers);
    * ``linear_attention`` (Qwen3.5 Gated-DeltaNet layers, :mod:`dflash.models.linear_attention`):
      the causal depthwise convolution ``2 · K · (2·Hk·dk + Hv·dv)`` per position, and the chunked
      delta rule :func:`delta_rule_chunk_flops` per value head and chunk, ``⌈S / 64⌉`` chunks per
      row, as the torch path chunks the packed row (keys are shared by ``Hv / Hk`` value heads);
      fla's variable-length kernels chunk each conversation instead, ``Σ ⌈L / 64⌉`` chunks, a few
      more.

    Args:
        layers: the decoder layers, in order.
        layer_types: one of ``full_attention`` / ``sliding_attention`` / ``linear_attention`` per layer.
        config: the (text) transformers config: ``num_attention_heads``, ``head_dim`` (else
            ``hidden_size / heads``), and for linear attention ``linear_num_key_heads``,
            ``linear_num_value_heads``, ``linear_key_head_dim``, ``linear_value_head_dim``,
            ``linear_conv_kernel_dim``.
        lm_head_weights: ``V · D``.
        doc_ids: ``[R, S]`` integer document ids of the batch (0 = padding).
        sliding_window: ``W`` of the sliding layers.

    Returns:
        a :class:`FlopCount` of Python ints (read back from the device when ``doc_ids`` is on one).

    Raises:
        ValueError: ``layers`` and ``layer_types`` differ in length, an unknown layer type, or a
            config field the count needs is missing.
    """
    if len(layers) != len(layer_types):
        raise ValueError(f"layer_types: {len(layer_types)} entries for {len(layers)} layers")
    unknown = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION})
    if unknown:
        raise ValueError(f"layer_types: cannot count FLOPs of {unknown}")
    rows, seq = doc_ids.shape
    tokens = rows * seq
    heads = _config_int(config, "num_attention_heads")
    head_dim = int(getattr(config, "head_dim", None) or _config_int(config, "hidden_size") // heads)
    pairs: dict[Optional[int], Tensor] = {}
    attention: Number = 0
    linear_attention = 0
    for kind in layer_types:
        if kind == LINEAR_ATTENTION:
            kh, vh = _config_int(config, "linear_num_key_heads"), _config_int(config, "linear_num_value_heads")
            kd, vd = _config_int(config, "linear_key_head_dim"), _config_int(config, "linear_value_head_dim")
            conv = 2 * _config_int(config, "linear_conv_kernel_dim") * (2 * kh * kd + vh * vd) * tokens
            chunks = rows * -(-seq // DELTA_RULE_CHUNK)
            linear_attention += conv + vh * chunks * delta_rule_chunk_flops(DELTA_RULE_CHUNK, kd, vd)
        else:
            window = sliding_window if kind == SLIDING_ATTENTION else None
            if window not in pairs:
                pairs[window] = packed_causal_pairs(doc_ids, window)
            attention = attention + 4 * heads * head_dim * pairs[window]
    parts: dict[str, Number] = {
        "linear": 2 * sum(linear_weights(layer) for layer in layers) * tokens,
        "attention": int(attention) if isinstance(attention, Tensor) else attention,
        "linear_attention": linear_attention,
        "lm_head": 2 * int(lm_head_weights) * tokens,
    }
    return FlopCount(parts)


def drafter_flops(model: nn.Module, anchors: Tensor, anchor_keep: Tensor, doc_ids: Tensor, *,
                  training: bool = True, recompute: bool = False, distillation: bool = False,
                  head_rows: Optional[int] = None) -> FlopCount:
    """FLOPs of the drafter's train step, or of its forward, on one batch.

    With ``T = R·S`` context positions, ``Q = R·A·B`` block tokens (every anchor slot, dropped
    ones too: they are computed) and ``N = R·A·(B − 1)`` predicted block positions, the forward:

    * ``fc``: ``2 · (L·D) · D · T``;
    * ``layers``: per decoder layer ``2 · P_kv · (T + Q)`` (``k_proj`` / ``v_proj`` run on the
      context and the block tokens: KV injection) ``+ 2 · P_rest · Q`` (``q_proj``, ``o_proj``
      and the MLP, block tokens only);
    * ``attention``: per layer ``4 · H · hd · pairs`` with the pairs of its mask
      (:func:`drafter_attention_pairs`);
    * ``lm_head``: the frozen head's logits over the rows it runs, ``2 · V · D · N_h``: ``N_h =
      head_rows``, the rows the loss computed (:attr:`dflash.training.objective.LossOutput.head_rows`:
      the counted block positions padded to whole chunks), or all ``N`` predicted positions.

    ``training=True`` (the step: forward, loss, backward): ``fc`` × 2 (its input, the target's
    features, needs no gradient), ``layers`` and ``attention`` × 3, ``lm_head`` × 2 (the logits and
    the hidden states' gradient; the frozen weight gets none), and with ``recompute`` (activation
    checkpointing) a ``recompute`` part: each layer's forward once more, but for the last product
    of each checkpointed region, the attention's ``o_proj`` and the MLP's ``down_proj``, whose
    outputs no backward needs (``torch.utils.checkpoint``'s non-reentrant recompute stops after
    the last tensor the backward uses; :meth:`dflash.models.drafter.DFlashDraftModel._checkpointed_layer`
    checkpoints the two sub-layers as separate regions), over the layers the model checkpoints
    (:meth:`~dflash.models.drafter.DFlashDraftModel.checkpointed`), and with ``distillation``
    (``drafter.distillation > 0``) a ``teacher`` part: the head once more over the target's hidden
    rows of the same positions, ``2 · V · D · N_h`` (no gradient). ``training=False``: the forward alone.

    Args:
        model: a :class:`dflash.models.drafter.DFlashDraftModel` (its config, ``fc``, ``layers``
            and ``lm_head``).
        anchors, anchor_keep: ``[R, A]`` int64 / bool.
        doc_ids: ``[R, S]``.
        training: count the train step instead of one forward.
        recompute: activation checkpointing is on (``training`` only).
        distillation: the step also computes the target's logits (``training`` only).
        head_rows: the LM head's rows (``N_h``, above); ``None`` = ``N``.

    Returns:
        a :class:`FlopCount` whose ``attention`` part is a tensor on the anchors' device.

    Raises:
        ValueError: ``anchors`` / ``anchor_keep`` / ``doc_ids`` disagree in rows.
    """
    if anchors.shape != anchor_keep.shape or anchors.dim() != 2 or doc_ids.dim() != 2 \
            or anchors.shape[0] != doc_ids.shape[0]:
        raise ValueError(f"anchors {tuple(anchors.shape)}, anchor_keep {tuple(anchor_keep.shape)} and doc_ids "
                         f"{tuple(doc_ids.shape)}: expected [R, A], [R, A] and [R, S]")
    cfg = model.config
    b = int(cfg.block_size)
    rows, seq = doc_ids.shape
    t, q, n = rows * seq, anchors.numel() * b, anchors.numel() * (b - 1)
    per_pair = 4 * int(cfg.num_attention_heads) * int(cfg.head_dim)
    pairs: dict[Optional[int], Tensor] = {}
    layers = 0
    attention: Number = 0
    recomputed: Number = 0
    for index, layer in enumerate(model.layers):
        window = cfg.sliding_window if layer.layer_type == SLIDING_ATTENTION else None
        if window not in pairs:
            pairs[window] = drafter_attention_pairs(anchors, anchor_keep, doc_ids, b, window)
        kv = linear_weights(layer, ("k_proj", "v_proj"))
        here = 2 * kv * (t + q) + 2 * linear_weights(layer, exclude=("k_proj", "v_proj")) * q
        layer_attention = per_pair * pairs[window]
        layers += here
        attention = attention + layer_attention
        if recompute and model.checkpointed(index):
            recomputed = recomputed + here - 2 * linear_weights(layer, ("o_proj", "down_proj")) * q + layer_attention
    vocab, hidden = model.lm_head.weight.shape
    fc = 2 * linear_weights(model.fc) * t
    head = 2 * int(vocab) * int(hidden) * (n if head_rows is None else int(head_rows))
    if training:
        parts = {"fc": 2 * fc, "layers": 3 * layers, "attention": 3 * attention, "lm_head": 2 * head}
        if recompute:
            parts["recompute"] = recomputed
        if distillation:
            parts["teacher"] = head
        return FlopCount(parts)
    return FlopCount({"fc": fc, "layers": layers, "attention": attention, "lm_head": head})


def env_peak_flops() -> Optional[float]:
    """FLOP/s from the :data:`PEAK_ENV` environment variable (TFLOP/s), ``None`` when it is unset.

    Raises:
        ValueError: it is set but not a positive number.
    """
    raw = os.environ.get(PEAK_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{PEAK_ENV}={raw!r}: expected a positive number of TFLOP/s")
    return value * 1e12


def peak_flops(device: Union[str, torch.device], override_tflops: Optional[float] = None) -> Optional[float]:
    """Peak FLOP/s of one ``device`` for MFU; ``None`` when unknown.

    In order: ``override_tflops`` (``cluster.peak_tflops``), the :data:`PEAK_ENV` environment
    variable (both TFLOP/s of one device, in the precision the run computes in), then for a CUDA
    device :data:`PEAK_BF16_FLOPS` by its name; for a CPU, which has no data-sheet entry, the fp32
    matmul rate this process measures on its own threads (:func:`measured_cpu_flops`), so a CPU
    run's MFU is the fraction of that rate its model FLOPs reach. A GPU not in the table has no
    peak unless one is given.

    Raises:
        ValueError: the override or :data:`PEAK_ENV` is not a positive number.
    """
    if override_tflops is not None:
        if not override_tflops > 0:
            raise ValueError(f"cluster.peak_tflops: must be > 0, got {override_tflops}")
        return float(override_tflops) * 1e12
    from_env = env_peak_flops()
    if from_env is not None:
        return from_env
    device = torch.device(device)
    if device.type == "cpu":
        return measured_cpu_flops()
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_FLOPS:
        if key in name:
            return value
    return None


#: Side of the square fp32 matrices whose product measures a CPU's rate (2·n³ FLOPs each).
CPU_PROBE_SIZE = 512
#: Products timed by :func:`measured_cpu_flops` (the fastest counts), after one untimed.
CPU_PROBE_REPEATS = 8
#: Seconds after which :func:`measured_cpu_flops` measures again (keeping the fastest).
CPU_PROBE_EVERY_S = 60.0
_cpu_flops: Optional[float] = None
_cpu_probed_at = 0.0


def measured_cpu_flops() -> float:
    """This process's fp32 matmul rate on the CPU in FLOP/s, at its current torch thread count:
    the fastest of :data:`CPU_PROBE_REPEATS` products of two random ``CPU_PROBE_SIZE``-square
    matrices (``2·n³`` FLOPs each; about 40 ms on 2 cores). Measured again when the last
    measurement is :data:`CPU_PROBE_EVERY_S` old, keeping the fastest so far: a probe taken while
    other processes load (a worker's start) or compute on the same cores reads low, and MFU against
    it would exceed 1."""
    global _cpu_flops, _cpu_probed_at
    now = time.monotonic()
    if _cpu_flops is None or now - _cpu_probed_at >= CPU_PROBE_EVERY_S:
        _cpu_probed_at = now
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(CPU_PROBE_SIZE, CPU_PROBE_SIZE, generator=gen)
        b = torch.randn(CPU_PROBE_SIZE, CPU_PROBE_SIZE, generator=gen)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(CPU_PROBE_REPEATS):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        _cpu_flops = max(_cpu_flops or 0.0, 2.0 * CPU_PROBE_SIZE ** 3 / max(best, 1e-9))
    return _cpu_flops


def mfu(flops: float, seconds: float, peak: Optional[float]) -> Optional[float]:
    """``flops / seconds / peak``; ``None`` without a peak or a positive time."""
    if peak is None or not seconds > 0:
        return None
    return float(flops) / seconds / peak

