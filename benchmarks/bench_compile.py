"""Eager vs compiled (``torch.compile(mode="reduce-overhead")``) target forward and drafter train step.

For a random-initialised target at a real shape (default Qwen3-8B) and its DFlash drafter, in
this process's main thread (as each worker does):

- target forward (features + greedy tokens) at ``[rows, seq]``: eager ms, compiled ms, compile
  time, features agreement;
- drafter train step (forward, loss, backward, all-reduce-free optimizer step): eager ms,
  compiled ms, compile time, per-step losses of both over ``--steps`` steps from the same
  initial weights, peak memory;
- graph compilations and CUDA-graph recordings after warm-up (must be 0);
- model FLOPs of both stages (:mod:`dflash.models.flops`, the count the training metrics use),
  TFLOP/s and MFU against :func:`dflash.models.flops.peak_flops` (``DFLASH_PEAK_TFLOPS``, else the
  GPU's dense bf16 peak).

``--gradient-checkpointing`` sets ``drafter.gradient_checkpointing`` for both drafter runs (each
drafter layer recomputed in the backward: the anchor count that fits against the step time). A
drafter run that runs out of GPU memory is recorded (``drafter_<mode>_oom``) and the next one
still runs.

Prints a table; with ``--out DIR`` writes ``DIR/bench_compile.json``. GPU only (``--device cpu``:
a smoke test of this script).

    python -m benchmarks.bench_compile --arch qwen3-8b --steps 20
    python -m benchmarks.bench_compile --arch qwen3-8b --steps 20 --anchors 512 --skip-target-compile \
        --gradient-checkpointing --out results
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

from dflash.compile_watch import CompileWatch, compile_counts
from dflash.config import RunConfig, config_from_dict


def synthetic_batch(rows: int, seq: int, vocab: int, gen: torch.Generator, device) -> dict[str, torch.Tensor]:
    """Packed rows of random conversations (random lengths, assistant spans) on ``device``."""
    input_ids = torch.randint(0, vocab, (rows, seq), generator=gen)
    position_ids = torch.zeros(rows, seq, dtype=torch.int64)
    doc_ids = torch.zeros(rows, seq, dtype=torch.int32)
    loss_mask = torch.zeros(rows, seq, dtype=torch.bool)
    for r in range(rows):
        at, doc = 0, 1
        while at < seq - 16:
            n = int(torch.randint(64, max(65, seq // 2), (1,), generator=gen))
            n = min(n, seq - at)
            position_ids[r, at:at + n] = torch.arange(n)
            doc_ids[r, at:at + n] = doc
            start = at + n // 3
            loss_mask[r, start:at + n] = True
            at, doc = at + n, doc + 1
    return {k: v.to(device) for k, v in dict(input_ids=input_ids, position_ids=position_ids, doc_ids=doc_ids,
                                             loss_mask=loss_mask).items()}


def timed(fn, iters: int) -> float:
    """Median ms of ``iters`` calls (each synchronised)."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def phase_times(trainer, tensors: dict, batch_id: int) -> dict[str, float]:
    """GPU ms of one drafter step's phases, by CUDA events: where the step's time goes.

    Phases: ``prepare`` (anchors, labels, masks), ``forward`` (drafter layers, compiled or
    not), ``loss`` (the eager chunked LM-head cross-entropy, which also forms the hidden-state
    gradient), ``backward`` (through the drafter layers) and ``optimizer`` (clip, fused AdamW).
    Runs :meth:`DrafterTrainer.step`'s pieces in its order (one extra optimizer step).
    """
    import dflash.training.trainer as tr

    names = ["prepare", "forward", "loss", "backward", "optimizer"]
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(names) + 1)]
    real_loss = tr.dflash_loss

    def timed_loss(*a, **k):
        ev[2].record()
        return real_loss(*a, **k)

    tr.dflash_loss = timed_loss
    try:
        torch.cuda.synchronize()
        trainer.model.train()
        ev[0].record()
        prepared = trainer.prepare(tensors, 0, batch_id)
        ev[1].record()
        out = trainer.forward_loss(prepared)
        ev[3].record()
        (out.loss_sum * (trainer.grads_averaged_over / prepared.weight_sum)).backward()
        ev[4].record()
        trainer.optimizer_step()
        ev[5].record()
        torch.cuda.synchronize()
    finally:
        tr.dflash_loss = real_loss
    return {n: ev[i].elapsed_time(ev[i + 1]) for i, n in enumerate(names)}


def top_kernels(trainer, tensors: dict, batch_id: int, rows: int = 15) -> list[dict]:
    """The ``rows`` CUDA kernels with the most GPU time in one drafter step (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        trainer.step(tensors, 0, batch_id)
        torch.cuda.synchronize()
    table = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        table.append({"name": e.key[:120], "ms": t / 1e3, "calls": e.count})
    table.sort(key=lambda r: -r["ms"])
    return table[:rows]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="qwen3-8b")
    p.add_argument("--target-layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--seq", type=int, default=3072)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip-target-compile", action="store_true")
    p.add_argument("--mask-token-id", type=int, default=151669)
    p.add_argument("--profile", action="store_true", help="also list each mode's top CUDA kernels")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="drafter.gradient_checkpointing=true for both drafter runs")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (no CUDA graphs)")
    p.add_argument("--out", default=None, help="folder for bench_compile.json")
    args = p.parse_args()
    on_gpu = args.device == "cuda"
    if on_gpu:
        assert torch.cuda.is_available(), "no GPU: use --device cpu for a smoke test"
    else:  # CPU smoke test: the CUDA calls below become no-ops
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
        torch.cuda.max_memory_allocated = lambda *a, **k: 0
        torch.cuda.empty_cache = lambda *a, **k: None
        torch.cuda.get_device_name = lambda *a, **k: "cpu"
        torch.compiler.cudagraph_mark_step_begin = lambda: None
    from dflash.training.factory import build_drafter
    from dflash.models.target_loader import load_target
    from dflash.training.trainer import DrafterTrainer, metrics_to_host

    from dflash.models.flops import mfu, peak_flops

    dev = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    peak = peak_flops(dev)  # DFLASH_PEAK_TFLOPS, else the GPU's dense bf16 peak; None on CPU
    overrides = {"num_hidden_layers": args.target_layers} if args.target_layers else {}
    cfg: RunConfig = config_from_dict({
        "target": {"kind": "random", "arch": args.arch, "arch_overrides": overrides, "tokenizer": "qwen3"},
        "drafter": {"num_layers": args.drafter_layers, "block_size": args.block, "anchors_per_row": args.anchors,
                    "mask_token_id": args.mask_token_id, "gradient_checkpointing": args.gradient_checkpointing},
        "data": {"max_length": args.seq, "token_budget": args.rows * args.seq},
        "train": {"max_steps": args.steps},
    })
    res: dict = {"args": vars(args), "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    t0 = time.perf_counter()
    target = load_target(cfg.target, dev, num_drafter_layers=args.drafter_layers)
    res["target_load_s"] = time.perf_counter() - t0
    res["target_params_B"] = target.num_parameters() / 1e9
    gen = torch.Generator().manual_seed(0)
    batch = synthetic_batch(args.rows, args.seq, target.vocab_size, gen, dev)

    # ---------------------------------------------------------------- target forward
    def fwd_eager():
        return target.forward_features(batch["input_ids"], batch["position_ids"], batch["doc_ids"])

    feats_eager, toks_eager = fwd_eager()
    feats_eager, toks_eager = feats_eager.clone(), toks_eager.clone()
    torch.cuda.reset_peak_memory_stats()
    res["target_eager_ms"] = timed(fwd_eager, 3)
    res["target_eager_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    res["target_flops"] = int(target.flops(batch["doc_ids"]).total)  # dflash.models.flops
    res["target_eager_tflops"] = res["target_flops"] / (res["target_eager_ms"] / 1e3) / 1e12
    res["target_eager_mfu"] = mfu(res["target_flops"], res["target_eager_ms"] / 1e3, peak)
    if not args.skip_target_compile:
        compiled = torch.compile(target.forward_features, mode="reduce-overhead" if on_gpu else None, dynamic=False)

        def fwd_compiled():
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(batch["input_ids"], batch["position_ids"], batch["doc_ids"])

        t0 = time.perf_counter()
        for _ in range(3):
            fwd_compiled()
        torch.cuda.synchronize()
        res["target_compile_warmup_s"] = time.perf_counter() - t0
        watch = CompileWatch("target forward", fail=False)
        watch.arm()
        res["target_compiled_ms"] = timed(fwd_compiled, 5)
        res["target_compiled_mfu"] = mfu(res["target_flops"], res["target_compiled_ms"] / 1e3, peak)
        f, t = fwd_compiled()
        res["target_features_rel_err"] = float((f.float() - feats_eager.float()).norm() / feats_eager.float().norm())
        res["target_tokens_agree"] = float((t == toks_eager).float().mean())
        d = watch.check()
        res["target_recompiles_after_warmup"], res["target_rerecords_after_warmup"] = d.compiles, d.cudagraph_records
        res["target_speedup"] = res["target_eager_ms"] / res["target_compiled_ms"]
        del compiled
    features, target_tokens = feats_eager, toks_eager
    embed, head, target_config = target.embed_tokens, target.lm_head, target.config
    del target, fwd_eager  # free the target's layers (and graph pools): the drafter runs alone
    gc.collect()
    torch.cuda.empty_cache()
    tensors = dict(batch, features=features, target_tokens=target_tokens)
    print(json.dumps(res, indent=1), flush=True)

    # ---------------------------------------------------------------- drafter step
    def make_trainer(compile_: bool):
        cfg.drafter.compile = compile_
        model = build_drafter(cfg, embed, head, args.mask_token_id, dev, target_config)
        return model, DrafterTrainer(model, cfg.train, cfg.drafter, args.steps, dev)

    def drafter_run(mode: str) -> list[float]:
        """``--steps`` drafter steps in ``mode``; its figures go into ``res``; returns the losses."""
        model, trainer = make_trainer(mode == "compiled")
        res["drafter_params_M"] = model.num_trainable_params() / 1e6
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        losses, times, flops = [], [], []
        watch = None
        t_start = time.perf_counter()
        for step in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            m = trainer.step(tensors, 0, step)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
            host = metrics_to_host({"loss": m["loss"], "flops": m["flops"]})
            losses.append(host["loss"])
            flops.append(host["flops"])
            if step == 2:  # graphs are recorded within the first steps
                res[f"drafter_{mode}_warmup_s"] = time.perf_counter() - t_start
                watch = CompileWatch("drafter step", fail=False)
                watch.arm()
        steady = sorted(times[3:])
        res[f"drafter_{mode}_ms"] = steady[len(steady) // 2]
        res["drafter_step_flops"] = sum(flops) / len(flops)  # dflash.models.flops, per step
        res[f"drafter_{mode}_tflops"] = res["drafter_step_flops"] / (res[f"drafter_{mode}_ms"] / 1e3) / 1e12
        res[f"drafter_{mode}_mfu"] = mfu(res["drafter_step_flops"], res[f"drafter_{mode}_ms"] / 1e3, peak)
        if on_gpu:
            res[f"drafter_{mode}_phases_ms"] = phase_times(trainer, tensors, args.steps)
            if args.profile:
                res[f"drafter_{mode}_top_kernels"] = top_kernels(trainer, tensors, args.steps + 1)
        res[f"drafter_{mode}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        res[f"drafter_{mode}_losses"] = losses
        if watch is not None:
            d = watch.check()
            res[f"drafter_{mode}_recompiles_after_warmup"] = d.compiles
            res[f"drafter_{mode}_rerecords_after_warmup"] = d.cudagraph_records
        print(json.dumps({k: v for k, v in res.items() if k.startswith(f"drafter_{mode}")}), flush=True)
        return losses

    runs = {}
    for mode in ("eager", "compiled"):
        try:
            runs[mode] = drafter_run(mode)
        except torch.cuda.OutOfMemoryError as exc:  # recorded; the other mode still runs
            res[f"drafter_{mode}_oom"] = str(exc).splitlines()[0]
            res[f"drafter_{mode}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            print(json.dumps({f"drafter_{mode}_oom": res[f"drafter_{mode}_oom"]}), flush=True)
        gc.collect()  # the run's model, trainer and graphs
        torch.cuda.empty_cache()
    both = len(runs) == 2
    if both:
        res["drafter_speedup"] = res["drafter_eager_ms"] / res["drafter_compiled_ms"]
        rel = [abs(a - b) / max(abs(a), 1e-9) for a, b in zip(runs["eager"], runs["compiled"])]
        res["drafter_loss_max_rel_diff"] = max(rel)
    res["compile_counts_total"] = vars(compile_counts())
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "bench_compile.json").write_text(json.dumps(res, indent=1))
    print(f"\ndrafter: {args.anchors} anchors per row, gradient checkpointing "
          f"{'on' if args.gradient_checkpointing else 'off'}")
    print("| stage | eager ms | compiled ms | speed-up | warm-up s | re-records after warm-up |")
    print("|---|---|---|---|---|---|")
    if "target_compiled_ms" in res:
        print(f"| target forward {args.rows}x{args.seq} | {res['target_eager_ms']:.0f} | {res['target_compiled_ms']:.0f} | "
              f"{res['target_speedup']:.2f}x | {res['target_compile_warmup_s']:.0f} | {res['target_rerecords_after_warmup']} |")

    def cell(mode: str, key: str, fmt: str) -> str:
        return "OOM" if f"drafter_{mode}_oom" in res else format(res[f"drafter_{mode}_{key}"], fmt)

    speedup = f"{res['drafter_speedup']:.2f}x" if both else "-"
    print(f"| drafter step | {cell('eager', 'ms', '.0f')} | {cell('compiled', 'ms', '.0f')} | {speedup} | "
          f"{cell('compiled', 'warmup_s', '.0f')} | {res.get('drafter_compiled_rerecords_after_warmup')} |")
    if both:
        print(f"loss agreement over {args.steps} steps: max rel diff {res['drafter_loss_max_rel_diff']:.2e}")
    print(f"peak GiB eager {cell('eager', 'peak_gib', '.1f')} / compiled {cell('compiled', 'peak_gib', '.1f')}")

    def share(key: str) -> str:
        return "-" if res.get(key) is None else f"{res[key]:.1%}"

    print(f"MFU (dflash.models.flops; peak {'unknown' if peak is None else f'{peak / 1e12:g} TFLOP/s'}): target "
          f"eager {share('target_eager_mfu')} / compiled {share('target_compiled_mfu')}, drafter eager "
          f"{share('drafter_eager_mfu')} / compiled {share('drafter_compiled_mfu')}")
    for mode in ("eager", "compiled"):
        if f"drafter_{mode}_phases_ms" in res:
            print(f"{mode} phases (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in res[f"drafter_{mode}_phases_ms"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
