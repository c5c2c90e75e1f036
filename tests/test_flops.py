"""Model FLOPs (dflash/models/flops.py) against naive counts of what the models actually run.

The naive count hooks every ``nn.Linear`` call (``2 · in · out`` per input row), counts the
attention pairs of every SDPA call by a Python loop over the mask it is given, counts the
Gated-DeltaNet delta rule's matrix products op by op (a dispatch mode over its ``mm`` / ``bmm`` /
triangular solves) and its convolution's taps, and the LM-head rows the loss feeds through its
chunks; the train step adds what autograd actually computes for each linear (weight gradient,
and input gradient where the input needs one).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dflash.config import TargetConfig
from dflash.models import flops as fl
from dflash.models.masks import FULL_ATTENTION, SLIDING_ATTENTION, dense_attention_mask
from dflash.models.target import packed_attention_mask
from dflash.models.target_loader import load_target
from dflash.training.chunked_ce import linear_ce_chunk
from dflash.training.objective import dflash_loss
from dflash.training.trainer import DrafterTrainer

from tests.test_trainer import B, drafter_cfg, random_batch, tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# --------------------------------------------------------------------------- naive counters

def naive_mask_pairs(mask: torch.Tensor) -> int:
    """True entries of a ``[R, 1, Q, K]`` bool mask, one by one."""
    total = 0
    for row in mask[:, 0].tolist():
        for query in row:
            for allowed in query:
                total += 1 if allowed else 0
    return total


class Counter:
    """Naive FLOPs of linears (forward hooks) and SDPA calls (pairs of the mask they get)."""

    def __init__(self, module: nn.Module, monkeypatch, backward: bool = False):
        self.linear = 0
        self.linear_backward = 0
        self.attention = 0
        #: work of each SDPA call, in call order
        self.attention_calls: list[int] = []
        self.handles = []
        for m in module.modules():
            if isinstance(m, nn.Linear):
                self.handles.append(m.register_forward_hook(self._forward_hook))
                if backward:
                    self.handles.append(m.register_full_backward_hook(self._backward_hook))
        sdpa = F.scaled_dot_product_attention

        def counted_sdpa(q, k, v, attn_mask=None, **kw):
            assert attn_mask is not None and attn_mask.dtype == torch.bool
            mask = attn_mask.expand(q.shape[0], 1, q.shape[-2], k.shape[-2])
            work = 4 * q.shape[1] * q.shape[-1] * naive_mask_pairs(mask)  # QKᵀ and PV, H heads of hd
            self.attention += work
            self.attention_calls.append(work)
            return sdpa(q, k, v, attn_mask=attn_mask, **kw)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted_sdpa)

    def _forward_hook(self, m, inputs, output):
        self.linear += 2 * m.in_features * m.out_features * (inputs[0].numel() // m.in_features)

    def _backward_hook(self, m, grad_input, grad_output):
        rows = grad_output[0].numel() // m.out_features
        per = 2 * m.in_features * m.out_features * rows
        if m.weight.requires_grad:
            self.linear_backward += per
        if grad_input[0] is not None:
            self.linear_backward += per

    def close(self):
        for h in self.handles:
            h.remove()


class MatmulOps(TorchDispatchMode):
    """FLOPs of every matrix product (mm, bmm, addmm, baddbmm) and unit-triangular solve
    dispatched inside it, from the operands' shapes."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in ("mm", "bmm", "addmm", "baddbmm"):
            a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
            batch = a.shape[0] if a.dim() == 3 else 1
            self.flops += 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
        elif name == "linalg_solve_triangular":
            a, rhs = args[0], args[1]
            n = a.shape[-1]
            assert kwargs.get("unitriangular", False) and not kwargs.get("upper", True)
            self.flops += rhs.numel() // rhs.shape[-2] * n * (n - 1)  # n(n−1)/2 multiply-adds per column
        return out


def _packed_doc_ids(rows: int, seq: int, seed: int) -> torch.Tensor:
    """Conversations of random lengths back to back in each row, then padding (doc 0)."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.zeros(rows, seq, dtype=torch.int32)
    for r in range(rows):
        at, d = 0, 1
        while at < seq - 6:
            n = int(torch.randint(3, seq // 2, (1,), generator=g))
            doc[r, at:at + n] = d
            at, d = at + n, d + 1
    return doc


# --------------------------------------------------------------------------- pair counts

@pytest.mark.parametrize("window", [None, 1, 5, 200])
def test_packed_causal_pairs_are_the_target_masks_pairs(window):
    doc = _packed_doc_ids(3, 40, seed=window or 0)
    assert int(fl.packed_causal_pairs(doc, window)) == naive_mask_pairs(packed_attention_mask(doc, sliding_window=window))


@pytest.mark.parametrize("window", [None, 3, 6])
def test_drafter_attention_pairs_are_the_drafter_masks_pairs(window):
    g = torch.Generator().manual_seed(1)
    doc = _packed_doc_ids(2, 30, seed=3)
    anchors = torch.randint(0, 30, (2, 7), generator=g)
    keep = (torch.rand(2, 7, generator=g) < 0.7) & (doc.gather(1, anchors) > 0)
    mask = dense_attention_mask(anchors, keep, doc, B, window)
    assert int(fl.drafter_attention_pairs(anchors, keep, doc, B, window)) == naive_mask_pairs(mask)


# --------------------------------------------------------------------------- the target

def _target_cases():
    sliding = {"layer_types": [SLIDING_ATTENTION, FULL_ATTENTION] * 4, "sliding_window": 7,
               "use_sliding_window": True, "max_window_layers": 8}
    return [("tiny-qwen3", {}), ("tiny-qwen3", sliding), ("tiny-qwen3.6", {})]


@pytest.mark.parametrize("arch, overrides", _target_cases(), ids=["qwen3", "qwen3-sliding", "qwen3.6-hybrid"])
def test_target_flops_match_a_naive_count(arch, overrides, monkeypatch):
    target = load_target(TargetConfig(kind="random", arch=arch, arch_overrides=overrides), "cpu")
    kernels = MatmulOps()
    conv = []
    if "linear_attention" in target.layer_types:
        import dflash.models.linear_attention as gdn

        delta_rule, causal_conv = gdn.chunk_gated_delta_rule, gdn.packed_causal_conv1d

        def counted_delta_rule(*args, **kwargs):
            with kernels:
                return delta_rule(*args, **kwargs)

        def counted_conv(x, weight, bias, segments):
            conv.append(2 * x.shape[0] * x.shape[1] * x.shape[2] * weight.shape[1])  # a multiply-add per tap
            return causal_conv(x, weight, bias, segments)

        monkeypatch.setattr(gdn, "chunk_gated_delta_rule", counted_delta_rule)
        monkeypatch.setattr(gdn, "packed_causal_conv1d", counted_conv)
    rows, seq = 2, 75  # not a multiple of the delta rule's 64-position chunk
    doc = _packed_doc_ids(rows, seq, seed=5)
    ids = torch.randint(0, target.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(0))
    pos = torch.zeros(rows, seq, dtype=torch.long)
    for r in range(rows):
        for p in range(1, seq):
            pos[r, p] = pos[r, p - 1] + 1 if doc[r, p] == doc[r, p - 1] else 0
    counter = Counter(target.model, monkeypatch)
    target.forward_features(ids, pos, doc)
    counter.close()
    count = target.flops(doc)
    parts = count.to_dict()
    assert parts["linear"] + parts["lm_head"] == counter.linear
    assert parts["attention"] == counter.attention > 0
    assert parts["linear_attention"] == kernels.flops + sum(conv)
    assert len(conv) == target.layer_types.count("linear_attention")
    assert (kernels.flops > 0) == ("linear_attention" in target.layer_types)
    assert parts["total"] == counter.linear + counter.attention + kernels.flops + sum(conv)


def test_target_flops_errors():
    target = load_target(TargetConfig(kind="random", arch="tiny-qwen3"), "cpu")
    layers = target.model.model.layers
    with pytest.raises(ValueError, match="layer_types"):
        fl.target_forward_flops(layers, target.layer_types[:-1], target.config, 1, torch.ones(1, 4))
    with pytest.raises(ValueError, match="cannot count"):
        fl.target_forward_flops(layers, ["mamba"] * len(layers), target.config, 1, torch.ones(1, 4))
    with pytest.raises(ValueError, match="doc_ids"):
        fl.packed_causal_pairs(torch.ones(4))


# --------------------------------------------------------------------------- the drafter

def _drafter_batch(seed: int = 0):
    batch = random_batch(r=3, s=20, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    anchors = torch.randint(0, 20, (3, 5), generator=g)
    keep = (torch.rand(3, 5, generator=g) < 0.8) & (batch["doc_ids"].gather(1, anchors) > 0)
    return batch, anchors, keep


MIXED = dict(layer_types=[SLIDING_ATTENTION, FULL_ATTENTION], sliding_window=6)


@pytest.mark.parametrize("overrides", [{}, MIXED], ids=["full", "sliding+full"])
def test_drafter_forward_flops_match_a_naive_count(overrides, monkeypatch):
    model = tiny_model(**overrides)
    batch, anchors, keep = _drafter_batch()
    counter = Counter(model, monkeypatch)
    head_rows = []

    def chunk_fn(h, weight, bias, y, w, need_grad):
        head_rows.append(h.shape[0])
        return linear_ce_chunk(h, weight, bias, y, w, need_grad)

    with torch.no_grad():
        hidden = model(batch["features"], batch["input_ids"], batch["position_ids"], batch["doc_ids"], anchors, keep)
        r, a, b, _ = hidden.shape
        labels = torch.zeros(r, a, b, dtype=torch.long)
        out = dflash_loss(hidden, model.lm_head, labels, torch.ones(r, a, b, dtype=torch.bool), 4.0, chunk=7,
                          chunk_fn=chunk_fn)
    counter.close()
    vocab, width = model.lm_head.weight.shape
    # every block position counts: all of them, padded to whole chunks of 7
    assert out.head_rows == sum(head_rows) == -(-r * a * (B - 1) // 7) * 7
    parts = model.flops(anchors, keep, batch["doc_ids"], training=False, head_rows=out.head_rows).to_dict()
    assert parts["fc"] + parts["layers"] == counter.linear
    assert parts["attention"] == counter.attention > 0
    assert parts["lm_head"] == 2 * vocab * width * sum(head_rows)
    every = model.flops(anchors, keep, batch["doc_ids"], training=False).to_dict()
    assert every["lm_head"] == 2 * vocab * width * r * a * (B - 1)  # without head_rows: every position


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # fc: its input needs no gradient
@pytest.mark.parametrize("checkpointing, mlp_chunks, checkpoint_layers",
                         [(False, 1, None), (True, 1, None), (True, 3, None), (True, 2, 1)],
                         ids=["plain", "checkpointed", "checkpointed-mlp3", "first-layer-checkpointed"])
@pytest.mark.parametrize("overrides", [{}, MIXED], ids=["full", "sliding+full"])
def test_train_step_flops_match_what_autograd_runs(overrides, checkpointing, mlp_chunks, checkpoint_layers,
                                                   monkeypatch):
    """The trainer's ``flops`` metric = forward hooks + backward hooks of every linear (weight and,
    where needed, input gradients; a checkpointed layer's recompute fires its hooks again) + the
    attention pairs of every SDPA call (forward and recompute) × 3 for the backward + the LM head's
    logits and hidden gradient over the predicted block positions."""
    from dflash.config import TrainConfig

    model = tiny_model(**overrides)
    model.gradient_checkpointing = checkpointing
    model.mlp_chunks = mlp_chunks
    model.checkpoint_layers = checkpoint_layers
    batch, anchors, keep = _drafter_batch(seed=2)
    trainer = DrafterTrainer(model, TrainConfig(), drafter_cfg(anchors_per_row=5), 4, "cpu")
    counter = Counter(model, monkeypatch, backward=True)
    m = trainer.step(batch, 0, 0, anchors=(anchors, keep))
    counter.close()
    vocab, width = model.lm_head.weight.shape
    head = 2 * 2 * vocab * width * anchors.numel() * (B - 1)
    layers = len(model.layers)
    calls = counter.attention_calls
    # the backward of each layer's attention (dP, dV, dQ, dK: twice its forward) runs once; a
    # checkpointed layer's recompute ran its attention again, in the backward's (reverse) order
    # (hooks count the recomputed linears; the recompute stops before each region's last product)
    recomputed = [i for i in range(layers) if model.checkpointed(i)]
    assert recomputed == (list(range(layers if checkpoint_layers is None else checkpoint_layers))
                          if checkpointing else [])
    assert len(calls) == layers + len(recomputed)
    assert calls[layers:] == [calls[i] for i in reversed(recomputed)]
    naive = counter.linear + counter.linear_backward + counter.attention + 2 * sum(calls[:layers]) + head
    assert int(m["flops"]) == naive
    plain = model.flops(anchors, keep, batch["doc_ids"], training=False).to_dict()
    steps = model.flops(anchors, keep, batch["doc_ids"]).to_dict()
    assert (steps["fc"], steps["layers"], steps["attention"], steps["lm_head"]) == (
        2 * plain["fc"], 3 * plain["layers"], 3 * plain["attention"], 2 * plain["lm_head"])
    assert ("recompute" in steps) == checkpointing


def test_distillation_step_counts_the_teacher_logits(monkeypatch):
    """With ``drafter.distillation`` the step's count adds the head over the teacher rows: every
    product through the LM head's weight counted as it runs (logits, teacher logits, hidden gradient)."""
    from dflash.config import TrainConfig
    import torch.nn.functional as F

    model = tiny_model()
    batch, anchors, keep = _drafter_batch(seed=3)
    batch["target_hidden"] = torch.randn(*batch["doc_ids"].shape, model.lm_head.weight.shape[1])
    trainer = DrafterTrainer(model, TrainConfig(), drafter_cfg(anchors_per_row=5, distillation=0.5), 4, "cpu")
    head_weight = model.lm_head.weight
    counted = []
    linear = F.linear

    def counting_linear(x, weight, bias=None):
        if weight is head_weight:
            counted.append(2 * x.shape[0] * weight.numel())
        return linear(x, weight, bias)

    monkeypatch.setattr(F, "linear", counting_linear)
    m = trainer.step(batch, 0, 0, anchors=(anchors, keep))
    monkeypatch.undo()
    n = anchors.numel() * (B - 1)
    steps = model.flops(anchors, keep, batch["doc_ids"], distillation=True).to_dict()
    assert steps["teacher"] == 2 * head_weight.numel() * n == sum(counted) // 2  # drafter and teacher logits
    assert int(m["flops"]) == int(model.flops(anchors, keep, batch["doc_ids"]).total) + steps["teacher"]


def test_drafter_flops_shape_errors():
    model = tiny_model()
    with pytest.raises(ValueError, match="anchors"):
        model.flops(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool), torch.ones(2, 9))


# --------------------------------------------------------------------------- peak and MFU

def test_cpu_rate_is_measured_again_and_keeps_the_fastest(monkeypatch):
    """A probe taken while the cores are busy reads low: the next one after CPU_PROBE_EVERY_S
    replaces it when faster, and a slower one never lowers it."""
    from types import SimpleNamespace

    times = iter([0.5, 0.25, 1.0])  # seconds of the timed products, one probe at a time
    monkeypatch.setattr(fl, "CPU_PROBE_REPEATS", 1)
    monkeypatch.setattr(fl, "CPU_PROBE_SIZE", 8)
    clock = {"t": 1000.0}
    calls = []

    def perf_counter():
        calls.append(None)
        return 0.0 if len(calls) % 2 else next(times)

    monkeypatch.setattr(fl, "time", SimpleNamespace(monotonic=lambda: clock["t"], perf_counter=perf_counter))
    monkeypatch.setattr(fl, "_cpu_flops", None)
    flops = 2.0 * 8 ** 3
    assert fl.measured_cpu_flops() == flops / 0.5
    clock["t"] += 1.0
    assert fl.measured_cpu_flops() == flops / 0.5  # cached: no new probe within CPU_PROBE_EVERY_S
    clock["t"] += fl.CPU_PROBE_EVERY_S
    assert fl.measured_cpu_flops() == flops / 0.25  # faster: replaces
    clock["t"] += fl.CPU_PROBE_EVERY_S
    assert fl.measured_cpu_flops() == flops / 0.25  # slower (1.0 s): kept the fastest
    monkeypatch.setattr(fl, "_cpu_flops", None)


def test_peak_flops_sources(monkeypatch):
    monkeypatch.delenv(fl.PEAK_ENV, raising=False)
    monkeypatch.setattr(fl, "_cpu_flops", None)
    measured = fl.peak_flops("cpu")  # this process's fp32 matmul rate
    assert measured == fl.measured_cpu_flops() and 1e8 < measured < 1e14
    assert fl.peak_flops("cpu", 2.5) == 2.5e12
    monkeypatch.setenv(fl.PEAK_ENV, "0.5")
    assert fl.peak_flops("cpu") == 0.5e12
    assert fl.peak_flops("cpu", 3.0) == 3.0e12  # the config wins
    monkeypatch.setenv(fl.PEAK_ENV, "fast")
    with pytest.raises(ValueError, match=fl.PEAK_ENV):
        fl.peak_flops("cpu")
    with pytest.raises(ValueError, match="cluster.peak_tflops"):
        fl.peak_flops("cpu", 0.0)


def test_peak_table_by_device_name(monkeypatch):
    monkeypatch.delenv(fl.PEAK_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, expect in [("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                         ("NVIDIA H100 NVL", 835e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA T4", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, _n=name: _n)
        assert fl.peak_flops("cuda:0") == expect, name


def test_mfu():
    assert fl.mfu(3e12, 2.0, 1e12) == pytest.approx(1.5)
    assert fl.mfu(3e12, 2.0, None) is None
    assert fl.mfu(3e12, 0.0, 1e12) is None


def test_step_record_mfu_pools_the_windows_work():
    """``mfu/*`` of a metrics row = Σ FLOPs / Σ (seconds × peak) over the window's finished work;
    work without a peak is left out, and a stage with none is null."""
    from dflash.runtime.run_metrics import StepMetrics, progress_text

    m = StepMetrics()
    m.produced("train", 10, 2.0, flops=6e12, peak_flops=1e12)
    m.produced("train", 10, 1.0, flops=1e12, peak_flops=2e12)
    m.produced("heldout", 10, 1.0, flops=9e12, peak_flops=1e12)  # evaluation batches are not training work
    m.produced("train", 10, 1.0, flops=5e12, peak_flops=None)  # a device without a known peak
    m.trained("drafter.0", 0, {"compute": {"flops": 3e12, "seconds": 1.5, "peak_flops": 1e12}}, rank0=True)
    m.trained("drafter.1", 0, {"compute": {"flops": 1e12, "seconds": 0.5, "peak_flops": 1e12}}, rank0=False)
    row = m.step_record(0, 0, num_targets=2, outstanding=0)
    assert row["mfu/target"] == pytest.approx((6e12 + 1e12) / (2.0 * 1e12 + 1.0 * 2e12))
    assert row["mfu/drafter"] == pytest.approx(4e12 / 2e12)
    assert "compute" not in row
    assert "mfu tgt 175.0% dft 200.0%" in progress_text(row)
    empty = m.step_record(1, 0, num_targets=2, outstanding=0)  # a new window: nothing finished in it
    assert empty["mfu/target"] is None and empty["mfu/drafter"] is None
    assert "mfu tgt - dft -" in progress_text(empty)
