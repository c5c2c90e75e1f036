"""The target forward at a real shape: exactness over packed rows, eager vs compiled per layer.

For a random-initialised target (default: Qwen3.6-27B, 48 Gated-DeltaNet + 16 full-attention
layers), on one GPU, in this process's main thread (as a target worker runs it):

- **exactness**: a conversation packed after another (``--before`` tokens) against the same
  conversation alone in its row, relative error ``||f_packed - f_alone|| / ||f_alone||`` of every
  fused layer's features over its first 16 tokens, over all its tokens and over its last 16;
- **speed** at ``[rows, seq]`` packed rows: eager, then compiled per decoder layer
  (:meth:`dflash.models.target.TargetModel.compile_layers`): warm-up seconds (compile + first
  forwards), median seconds per batch, peak GiB, and whether the compiled features equal the
  eager ones. Throughput is given two ways: by ``2 · parameters · tokens`` and by the project's
  count (:meth:`dflash.models.target.TargetModel.flops`: the linear layers, the attention over the
  per-conversation causal pairs, the Gated-DeltaNet recurrence, the LM head), each as MFU against
  ``--peak-tflops`` (the data sheet's dense bf16 peak) and against the dense bf16 matmul rate
  measured on the same device before the run (``benchmarks.bench_pipeline.measure_matmul``,
  8192³), the rate a perfectly efficient model could reach on it.

Writes ``bench_target.json`` under ``--out``. GPU only.

    python -m benchmarks.bench_target --arch qwen3.6-27b --out runs/bench-target
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

#: bf16 dense peak of an H100 / H200 SXM (datasheet), TFLOP/s: the default MFU denominator.
H200_BF16_PEAK_TFLOPS = 989.0


def _packed(lengths: list[int], seq: int, vocab: int, gen: torch.Generator, device) -> tuple[torch.Tensor, ...]:
    """One row ``[1, seq]``: the conversations of ``lengths`` in order, then padding."""
    ids = torch.randint(0, vocab, (1, seq), generator=gen)
    pos = torch.zeros(1, seq, dtype=torch.long)
    doc = torch.zeros(1, seq, dtype=torch.int32)
    at = 0
    for i, n in enumerate(lengths):
        pos[0, at:at + n] = torch.arange(n)
        doc[0, at:at + n] = i + 1
        at += n
    return ids.to(device), pos.to(device), doc.to(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def exactness(target, before: int, length: int, gen: torch.Generator) -> dict:
    """Relative error of a conversation's features packed after ``before`` tokens vs alone."""
    ids, pos, doc = _packed([before, length], before + length, target.vocab_size, gen, target.device)
    packed, packed_tokens = target.forward_features(ids, pos, doc)
    alone, alone_tokens = target.forward_features(ids[:, before:], pos[:, before:], doc[:, before:] - 1)
    mine = packed[:, before:]
    width = target.hidden_size
    rows = {}
    for slot, layer in enumerate(target.layer_ids):
        a, b = mine[..., slot * width:(slot + 1) * width], alone[..., slot * width:(slot + 1) * width]
        rows[str(layer)] = {"first16": _rel(a[:, :16], b[:, :16]), "all": _rel(a, b), "last16": _rel(a[:, -16:], b[:, -16:])}
    rows["tokens_agree"] = float((packed_tokens[:, before:] == alone_tokens).float().mean())
    return rows


def synthetic_rows(rows: int, seq: int, vocab: int, gen: torch.Generator, device) -> tuple[torch.Tensor, ...]:
    """``rows`` packed rows of random conversations of 64 … seq/2 tokens."""
    out = []
    for _ in range(rows):
        lengths, left = [], seq
        while left > 0:
            n = min(left, int(torch.randint(64, max(65, seq // 2), (1,), generator=gen)))
            lengths.append(n)
            left -= n
        out.append(_packed(lengths, seq, vocab, gen, device))
    return tuple(torch.cat(parts) for parts in zip(*out))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="qwen3.6-27b")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--seq", type=int, default=3072)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--before", type=int, default=1024, help="tokens packed before the checked conversation")
    p.add_argument("--length", type=int, default=2048, help="the checked conversation's tokens")
    p.add_argument("--linear-attention", default="auto", choices=["auto", "fla", "torch"])
    p.add_argument("--modes", default="eager,layer", help="comma list of eager, layer (compiled per layer)")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_PEAK_TFLOPS)
    p.add_argument("--out", type=Path, default=None, help="directory for bench_target.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_target: needs a CUDA device", file=sys.stderr)
        return 2
    from benchmarks.bench_compile import timed
    from benchmarks.bench_pipeline import measure_matmul
    from dflash.config import TargetConfig
    from dflash.models.target_loader import load_target

    dev = torch.device("cuda", 0)
    t0 = time.perf_counter()
    target = load_target(TargetConfig(kind="random", arch=args.arch, linear_attention=args.linear_attention), dev)
    res: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "device": torch.cuda.get_device_name(0),
                 "torch": torch.__version__, "load_s": time.perf_counter() - t0,
                 "params_B": target.num_parameters() / 1e9, "linear_attention": target.linear_attention}
    res["matmul"] = measure_matmul(dev, 8192)
    measured_peak = res["matmul"]["tflops"]
    gen = torch.Generator().manual_seed(0)
    res["exactness"] = exactness(target, args.before, args.length, gen)
    print(json.dumps(res, indent=1), flush=True)
    ids, pos, doc = synthetic_rows(args.rows, args.seq, target.vocab_size, gen, dev)
    flops = 2 * target.num_parameters() * args.rows * args.seq
    counted = target.flops(doc).to_dict()
    res["flops"] = {"2_params_tokens": flops, "counted": counted}
    reference = None
    for mode in args.modes.split(","):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        if mode == "layer":
            target.compile_layers()
        feats, tokens = target.forward_features(ids, pos, doc)
        torch.cuda.synchronize()
        warm = time.perf_counter() - t0
        seconds = timed(lambda: target.forward_features(ids, pos, doc), args.iters) / 1e3
        row = {"first_call_s": warm, "s_per_batch": seconds, "tflops": flops / seconds / 1e12,
               "mfu": flops / seconds / 1e12 / args.peak_tflops,
               "mfu_vs_matmul": flops / seconds / 1e12 / measured_peak,
               "counted_tflops": counted["total"] / seconds / 1e12,
               "counted_mfu": counted["total"] / seconds / 1e12 / args.peak_tflops,
               "counted_mfu_vs_matmul": counted["total"] / seconds / 1e12 / measured_peak,
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
        if reference is None:
            reference = (feats.clone(), tokens.clone())
        else:
            row["features_rel_err_vs_eager"] = _rel(feats, reference[0])
            row["tokens_agree_vs_eager"] = float((tokens == reference[1]).float().mean())
        res[mode] = row
        print(json.dumps({mode: row}), flush=True)
        del feats, tokens
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_target.json").write_text(json.dumps(res, indent=1))
    print(f"\n{args.arch} {args.rows}x{args.seq}, linear attention: {target.linear_attention}; "
          f"MFU against {args.peak_tflops:.0f} TFLOP/s (data sheet) / {measured_peak:.0f} (measured matmul)")
    print("| mode | first call s | s/batch | TFLOP/s 2NT | MFU 2NT | TFLOP/s counted | MFU counted | peak GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        r = res[mode]
        print(f"| {mode} | {r['first_call_s']:.1f} | {r['s_per_batch']:.2f} | {r['tflops']:.0f} | "
              f"{r['mfu']:.2f} / {r['mfu_vs_matmul']:.2f} | {r['counted_tflops']:.0f} | "
              f"{r['counted_mfu']:.2f} / {r['counted_mfu_vs_matmul']:.2f} | {r['peak_gib']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
