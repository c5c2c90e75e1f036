"""Where a drafter train step's GPU memory goes, and what it costs in time.

Builds the drafter for a random target's shape (default: Qwen3.6-27B, 5 layers = 4 sliding-window
+ 1 full, B = 16, mask token 248070) around that target's frozen embedding and LM head, feeds it
random context features for ``[rows, seq]`` packed rows with ``--anchors`` anchors a row, and runs
``--steps`` train steps (forward, chunked LM-head loss, backward, AdamW), eager or compiled
(``drafter.compile``: ``torch.compile(mode="reduce-overhead")``). Reports the median step
seconds, the peak allocated and reserved GiB, and, with ``--snapshot``, the tensors alive at the
peak of one steady-state step, summed by the line of the project's code that allocated them
(``torch.cuda.memory._record_memory_history``; allocations made before the recorded step, such as
parameters and optimizer states, are one "before the step" line).

``--memory-fraction F`` caps this process at ``F`` of the card
(``torch.cuda.set_per_process_memory_fraction``): a run that completes under the cap fits a card
of that size. ``--profile``: after the timed steps, one more step's GPU milliseconds by phase
(``benchmarks.bench_compile.phase_times``) and its top CUDA kernels (torch.profiler). One
configuration per process; loop over configurations in the shell (``--tag`` names the result
file of a variant the flags do not tell apart, e.g. one run under other inductor settings).

    python -m benchmarks.bench_drafter_memory --compile --gradient-checkpointing --mlp-chunks 4 \\
        --memory-fraction 0.57 --snapshot --out runs/bench-drafter-memory
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

import torch

#: Reference drafter layer types (the public Qwen3.6-27B drafter: 4 sliding-window layers, then 1 full).
REFERENCE_LAYER_TYPES = ["sliding_attention"] * 4 + ["full_attention"]


def synthetic_batch(rows: int, seq: int, vocab: int, feature_size: int, gen: torch.Generator,
                    device: torch.device, hidden_size: int = 0) -> dict[str, torch.Tensor]:
    """:func:`benchmarks.bench_compile.synthetic_batch`'s packed rows with random context features
    ``[rows, seq, feature_size]`` (bf16 on CUDA, fp32 on CPU) and random target tokens; with
    ``hidden_size`` also a random final hidden state ``[rows, seq, hidden_size]`` (distillation)."""
    from benchmarks.bench_compile import synthetic_batch as packed_rows

    batch = packed_rows(rows, seq, vocab, gen, device)
    batch["target_tokens"] = torch.randint(0, vocab, (rows, seq), generator=gen).to(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch["features"] = torch.randn(rows, seq, feature_size, device=device, dtype=dtype)
    if hidden_size:
        batch["target_hidden"] = torch.randn(rows, seq, hidden_size, device=device, dtype=dtype)
    return batch


def live_at_peak(snapshot: dict, baseline: int, top: int = 15) -> dict:
    """The allocations alive at the peak of a recorded trace, summed by allocating site.

    Args:
        snapshot: ``torch.cuda.memory._snapshot()`` with a recorded history.
        baseline: bytes allocated when the recording started (reported as one line).

    Returns:
        ``{"peak_gib": ..., "sites": [{"site": "file:line function", "gib": ...}, ...]}``.
    """
    trace = [e for dev in snapshot.get("device_traces", []) for e in dev]
    live, total, peak, peak_at = {}, 0, 0, -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, peak_at = total, i
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])
    sites: dict = collections.Counter()
    alive: dict = {}
    for e in trace[:peak_at + 1]:
        if e["action"] == "alloc":
            alive[e["addr"]] = e
        elif e["action"] == "free_completed":
            alive.pop(e["addr"], None)
    for e in alive.values():
        frames = [f for f in e.get("frames", []) if "/dflash/" in f.get("filename", "")]
        frame = frames[0] if frames else (e.get("frames") or [{"filename": "?", "line": 0, "name": "?"}])[0]
        sites[f"{frame['filename'].split('/dflash/')[-1]}:{frame['line']} {frame['name']}"] += e["size"]
    rows = [{"site": "before the step (parameters, optimizer states, batch)", "gib": baseline / 2**30}]
    rows += [{"site": s, "gib": b / 2**30} for s, b in sites.most_common(top)]
    return {"peak_gib": (baseline + peak) / 2**30, "sites": rows}


#: The config keys this script sets, by the flag that sets them (a config error names the flag).
FLAG_OF_KEY = {"target.arch": "--arch", "drafter.num_layers": "--drafter-layers", "drafter.block_size": "--block",
               "drafter.anchors_per_row": "--anchors", "drafter.mask_token_id": "--mask-token-id",
               "drafter.mlp_chunks": "--mlp-chunks", "drafter.checkpoint_layers": "--checkpoint-layers",
               "drafter.activation_memory_budget": "--activation-memory-budget",
               "drafter.gradient_checkpointing": "--gradient-checkpointing", "drafter.compile": "--compile",
               "data.max_length": "--seq", "data.token_budget": "--rows", "train.max_steps": "--steps",
               "drafter.distillation": "--distillation"}


def result_name(args: argparse.Namespace, compiled: bool) -> str:
    """The result file's name: every setting that changes the step, then ``--tag``."""
    parts = [f"drafter_memory_{args.compile_mode if compiled else 'eager'}", f"c{args.mlp_chunks}"]
    if args.gradient_checkpointing:
        parts.append("ckpt" if args.checkpoint_layers is None else f"ckpt{args.checkpoint_layers}")
    if args.loss_chunk is not None:
        parts.append(f"lc{args.loss_chunk}")
    if args.activation_memory_budget is not None:
        parts.append(f"amb{args.activation_memory_budget:g}")
    if args.expandable_segments:
        parts.append("es")
    if args.distillation:
        parts.append(f"kd{args.distillation:g}")
    return "_".join(parts) + f"{args.tag}.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="qwen3.6-27b")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--seq", type=int, default=3072)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--mask-token-id", type=int, default=248070)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--compile", action="store_true", help="drafter.compile=true")
    p.add_argument("--compile-mode", default="reduce-overhead", choices=["reduce-overhead", "default", "layer"])
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--mlp-chunks", type=int, default=1)
    p.add_argument("--checkpoint-layers", type=int, default=None,
                   help="drafter.checkpoint_layers: layers (from the first) recomputed in the backward (default: all)")
    p.add_argument("--loss-chunk", type=int, default=None,
                   help="rows per LM-head loss chunk (default: dflash.training.chunked_ce.loss_chunk_rows)")
    p.add_argument("--activation-memory-budget", type=float, default=None,
                   help="drafter.activation_memory_budget (with --compile): share of activations kept for the backward")
    p.add_argument("--expandable-segments", action="store_true",
                   help="the CUDA caching allocator's expandable_segments (less fragmentation)")
    p.add_argument("--memory-fraction", type=float, default=None)
    p.add_argument("--distillation", type=float, default=0.0,
                   help="drafter.distillation: λ of the forward KL to the target's distribution (default: 0)")
    p.add_argument("--snapshot", action="store_true", help="the tensors alive at one step's peak, by site")
    p.add_argument("--profile", action="store_true", help="one more step: GPU ms by phase and the top CUDA kernels")
    p.add_argument("--tag", default="", help="suffix of the result file's name")
    p.add_argument("--out", type=Path, default=None, help="directory for bench_drafter_memory.json")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (no memory figures)")
    args = p.parse_args(argv)
    for name, low in (("rows", 1), ("seq", 1), ("anchors", 1), ("block", 2), ("drafter_layers", 1), ("steps", 1),
                      ("mlp_chunks", 1), ("loss_chunk", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            p.error(f"--{name.replace('_', '-')}: must be >= {low}, got {value}")
    if args.memory_fraction is not None and not 0.0 < args.memory_fraction <= 1.0:
        p.error(f"--memory-fraction: must be in (0, 1], got {args.memory_fraction}")
    if args.device not in ("cpu", "cuda"):
        p.error(f"--device: cuda (GPU 0) or cpu, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_drafter_memory: needs a CUDA device (--device cpu for a smoke test)", file=sys.stderr)
        return 2
    on_gpu = args.device == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    from dflash.config import ConfigError, config_from_dict, validate_config
    from dflash.models.target_loader import describe_target, load_embedding_and_head
    from dflash.training.factory import build_drafter
    from dflash.training.trainer import DrafterTrainer, metrics_to_host

    dev = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if args.expandable_segments and on_gpu:  # read when the allocator starts, at the first allocation
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(
            x for x in (os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "expandable_segments:True") if x)
    if args.memory_fraction is not None and on_gpu:
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction, dev)
    layer_types = REFERENCE_LAYER_TYPES if args.drafter_layers == 5 else None
    raw = {
        "target": {"kind": "random", "arch": args.arch, "tokenizer": "qwen3.6"},
        "drafter": {"num_layers": args.drafter_layers, "block_size": args.block, "anchors_per_row": args.anchors,
                    "mask_token_id": args.mask_token_id, "layer_types": layer_types,
                    "gradient_checkpointing": args.gradient_checkpointing, "mlp_chunks": args.mlp_chunks,
                    "checkpoint_layers": args.checkpoint_layers,
                    "activation_memory_budget": args.activation_memory_budget,
                    "compile": args.compile, "compile_mode": args.compile_mode,
                    "distillation": args.distillation},
        "data": {"max_length": args.seq, "token_budget": args.rows * args.seq},
        "train": {"max_steps": args.steps},
        "cluster": {"device": args.device, "targets": [0], "drafters": [0], "allow_shared_gpu": True},
        "transport": {"carrier": "cuda_ipc" if on_gpu else "shm"},
    }
    try:
        cfg = validate_config(config_from_dict(raw), gpu_count=torch.cuda.device_count() if on_gpu else 0)
        info = describe_target(cfg.target, args.drafter_layers)
        if not 0 <= args.mask_token_id < info.vocab_size:
            raise ConfigError(f"drafter.mask_token_id: {args.mask_token_id} is not a row of {args.arch}'s "
                              f"{info.vocab_size}-row embedding")
    except ConfigError as exc:
        key = str(exc).split(":", 1)[0]
        flag = FLAG_OF_KEY.get(key)
        p.error(f"{flag} ({exc})" if flag else str(exc))
    embed, head = load_embedding_and_head(cfg.target, dev)
    model = build_drafter(cfg, embed, head, args.mask_token_id, dev)
    trainer = DrafterTrainer(model, cfg.train, cfg.drafter, args.steps, dev, loss_chunk=args.loss_chunk)
    batch = synthetic_batch(args.rows, args.seq, info.vocab_size, info.feature_size, torch.Generator().manual_seed(0), dev,
                            hidden_size=info.hidden_size if args.distillation else 0)
    cap = torch.cuda.get_device_properties(dev).total_memory * (args.memory_fraction or 1.0) if on_gpu else 0
    res: dict = {"args": {k: str(v) for k, v in vars(args).items()},
                 "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
                 "torch": torch.__version__, "drafter_params_M": model.num_trainable_params() / 1e6,
                 "cap_gib": cap / 2**30, "loss_chunk": trainer.loss_chunk}
    times, losses = [], []
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    try:
        for step in range(args.steps):
            record = args.snapshot and on_gpu and step == args.steps - 1
            if record:
                sync()
                baseline = torch.cuda.memory_allocated()
                torch.cuda.memory._record_memory_history(max_entries=1_000_000)
            sync()
            t0 = time.perf_counter()
            m = trainer.step(batch, 0, step)
            sync()
            times.append(time.perf_counter() - t0)
            losses.append(metrics_to_host({"loss": m["loss"]})["loss"])
            peak = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else 0.0
            print(f"step {step}: {times[-1]:.2f} s, loss {losses[-1]:.4f}, peak so far {peak:.1f} GiB", flush=True)
            if record:
                res["live_at_peak"] = live_at_peak(torch.cuda.memory._snapshot(), baseline)
                torch.cuda.memory._record_memory_history(enabled=None)
        if args.profile and on_gpu:
            from benchmarks.bench_compile import phase_times, top_kernels

            res["phases_ms"] = phase_times(trainer, batch, args.steps)
            res["top_kernels"] = top_kernels(trainer, batch, args.steps + 1, rows=25)
    except torch.cuda.OutOfMemoryError as exc:
        res["oom"] = str(exc).splitlines()[0]
    steady = sorted(times[2:]) or times
    res.update(steps_run=len(times), first_step_s=times[0] if times else None,
               s_per_step=steady[len(steady) // 2] if steady else None, losses=losses,
               peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30 if on_gpu else 0.0,
               peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30 if on_gpu else 0.0)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / result_name(args, trainer.compiled)).write_text(json.dumps(res, indent=1))
    mode = f"compiled {args.compile_mode}" if trainer.compiled else "eager"
    ckpt = "off" if not args.gradient_checkpointing else (
        "on" if args.checkpoint_layers is None else f"first {args.checkpoint_layers} layer(s)")
    extra = "".join(f" | {k} {v}" for k, v in (("loss_chunk", trainer.loss_chunk),
                                                 ("activation_memory_budget", args.activation_memory_budget),
                                                 ("expandable_segments", args.expandable_segments or None)) if v)
    print(f"| {mode} | ckpt {ckpt} | mlp_chunks {args.mlp_chunks}{extra} | "
          f"{res['s_per_step'] or float('nan'):.2f} s/step | peak {res['peak_allocated_gib']:.1f} GiB allocated, "
          f"{res['peak_reserved_gib']:.1f} reserved | cap {res['cap_gib']:.1f} | "
          f"{'OOM' if 'oom' in res else 'ok'} | losses {', '.join(f'{x:.3f}' for x in losses)} |")
    for row in res.get("live_at_peak", {}).get("sites", []):
        print(f"    {row['gib']:7.2f} GiB  {row['site']}")
    if "phases_ms" in res:
        print("    phases (GPU ms): " + ", ".join(f"{k} {v:.0f}" for k, v in res["phases_ms"].items()))
        for row in res["top_kernels"]:
            print(f"    {row['ms']:8.1f} ms {row['calls']:5d}x  {row['name']}")
    return 1 if "oom" in res else 0


if __name__ == "__main__":
    sys.exit(main())
