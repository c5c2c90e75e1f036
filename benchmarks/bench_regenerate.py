"""Regeneration's generator at its batch size: prefill and decoding seconds per batch, by attention.

A random target at SmolLM2-135M's shape (``scripts.decode_speed.SMOLLM2_SHAPE``; random weights
decode at the speed of trained ones) is wrapped in
:class:`dflash.inference.regeneration.generators.StaticGenerator`, the generator a
regeneration worker runs, and generates one turn for batches of ``--batch`` random prompts of
about each of ``--widths`` tokens (prompt ``i`` is ``i mod 37`` tokens shorter, as sorted real
prompts are), ``--new-tokens`` each, no stop token. The first batch of each generator pays its
compilation (reported as ``warmup_s``); each width is then timed over ``--repeats`` batches:
prefill seconds, decoding seconds, new tokens per second. Attentions (``--attentions``) are the
decoding specs of :mod:`dflash.inference.decode_layers` (``sdpa``, ``flex``, ``X+Y``, ...), each
with the caches a regeneration worker gives it
(:func:`dflash.inference.regeneration.generators.short_prompt_tokens_for`: one cache for ``flex``,
a short and a long one otherwise); ``--one-cache`` sizes one cache for every attention. ``--profile`` lists the
costliest kernels of the decoding steps of the first width's batch (torch.profiler; CUDA only).

Writes ``bench_regenerate.json`` under ``--out`` after each attention. Also runs on CPU (small
``--batch`` and ``--widths``; no compilation there).

    python -m benchmarks.bench_regenerate --batch 1024 --widths 64,480,900 --new-tokens 128 \\
        --attentions sdpa,flex --out runs/bench-regenerate [--one-cache] [--profile]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

log = logging.getLogger("bench_regenerate")


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers >= 1, got {text!r}")
    return values


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    from dflash.inference.decode_layers import attention_spec_error

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch", type=int, default=1024, help="rows of the static caches (prompts per batch)")
    p.add_argument("--widths", type=_positive_ints, default=[64, 480, 900],
                   help="comma-separated prompt lengths in tokens, one timed set of batches each")
    p.add_argument("--new-tokens", type=int, default=128, help="new tokens a row (no stop token: every row runs them all)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="prompts are shorter than this")
    p.add_argument("--attentions", default="sdpa", help="comma-separated decoding attention specs")
    p.add_argument("--one-cache", action="store_true",
                   help="one cache for every prompt length, whatever the attention (default: as regeneration)")
    p.add_argument("--compile-long", action="store_true", help="compile the long cache's step too")
    p.add_argument("--repeats", type=int, default=2, help="timed batches per width")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the target's dtype")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"),
                   help="cuda (the current GPU: steps compiled into CUDA graphs) or cpu (eager)")
    p.add_argument("--profile", action="store_true", help="kernels of the first width's decoding (CUDA only)")
    p.add_argument("--out", default=None, help="write bench_regenerate.json here")
    args = p.parse_args(argv)
    for name in ("batch", "new_tokens", "repeats", "max_prompt_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    too_long = [w for w in args.widths if w >= args.max_prompt_tokens]
    if too_long:
        p.error(f"--widths {too_long}: must be below --max-prompt-tokens {args.max_prompt_tokens}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU is visible")
    args.attentions = [a for a in args.attentions.split(",") if a]
    if not args.attentions:
        p.error("--attentions: name at least one attention spec")
    for spec in args.attentions:
        error = attention_spec_error(spec)
        if error is not None:
            p.error(f"--attentions: {error}")
    return args


def _prompts(width: int, batch: int, vocab: int, gen: torch.Generator) -> list[list[int]]:
    return [torch.randint(0, vocab, (max(1, width - i % 37),), generator=gen).tolist() for i in range(batch)]


def _timed(generator: Any, prompts: list[list[int]], new_tokens: int, cuda: bool) -> dict:
    """One batch: wall, prefill and decoding seconds (the generator's own split), milliseconds a
    decoding step (the prefill gives each row its first token, the steps the rest), new tokens/s."""
    before = dict(generator.timings)
    start = time.perf_counter()
    out = generator.generate(prompts, new_tokens)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    tokens = sum(len(o.ids) for o in out)
    decode_s = generator.timings["decode_s"] - before["decode_s"]
    return {"wall_s": round(wall, 3), "prefill_s": round(generator.timings["prefill_s"] - before["prefill_s"], 3),
            "decode_s": round(decode_s, 3), "ms_per_step": round(1e3 * decode_s / max(1, new_tokens - 1), 3),
            "new_tok_s": round(tokens / wall, 1)}


def _profile(generator: Any, prompts: list[list[int]], new_tokens: int) -> dict:
    """The costliest kernels of one batch (its prefill's among them), per decoding step
    (:func:`scripts.decode_speed.kernel_table`)."""
    from torch.profiler import ProfilerActivity, profile

    from scripts.decode_speed import kernel_table

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generator.generate(prompts, new_tokens)
        torch.cuda.synchronize()
    return kernel_table(prof, max(1, new_tokens - 1), "step", rows=16)


def run_attention(spec: str, target: Any, args: argparse.Namespace, vocab: int) -> dict:
    """Every width's batches through a fresh generator decoding with ``spec``."""
    from dflash.inference.regeneration.generators import StaticGenerator, short_prompt_tokens_for

    cuda = target.device.type == "cuda"
    torch._dynamo.reset()
    generator = StaticGenerator(target.model, [], vocab, args.batch, args.max_prompt_tokens, args.new_tokens,
                                short_prompt_tokens=None if args.one_cache else short_prompt_tokens_for(spec),
                                compile=cuda, compile_long=args.compile_long, attention=spec)
    gen = torch.Generator().manual_seed(0)
    row: dict[str, Any] = {"widths": {}}
    warmed: set[bool] = set()
    for width in args.widths:
        long = width >= generator.short_prompt_tokens
        if long not in warmed:  # the generator's first batch compiles and records its step
            row.setdefault("warmup_s", {})["long" if long else "short"] = _timed(
                generator, _prompts(width, args.batch, vocab, gen), args.new_tokens, cuda)["wall_s"]
            warmed.add(long)
        runs = [_timed(generator, _prompts(width, args.batch, vocab, gen), args.new_tokens, cuda)
                for _ in range(args.repeats)]
        row["widths"][str(width)] = {k: round(sum(r[k] for r in runs) / len(runs), 3) for k in runs[0]}
        log.info("%s, prompts of ~%d tokens: %s", spec, width, json.dumps(row["widths"][str(width)]))
        if args.profile and cuda and "profile" not in row:
            row["profile"] = _profile(generator, _prompts(width, args.batch, vocab, gen), args.new_tokens)
    return row


def main(argv: Optional[list[str]] = None) -> int:
    from dflash.config import TargetConfig
    from dflash.logs import setup_logging
    from dflash.models.target_loader import load_target
    from scripts.decode_speed import SMOLLM2_SHAPE

    args = parse_args(argv)
    setup_logging("bench_regenerate")
    target = load_target(TargetConfig(kind="random", arch="tiny-llama", arch_overrides=SMOLLM2_SHAPE,
                                      dtype=args.dtype), torch.device(args.device))
    results: dict[str, Any] = {"batch": args.batch, "new_tokens": args.new_tokens, "widths": args.widths,
                               "max_prompt_tokens": args.max_prompt_tokens, "one_cache": args.one_cache,
                               "compile_long": args.compile_long, "dtype": args.dtype, "device": args.device,
                               "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
                               "torch": torch.__version__, "attentions": {}}
    failed = False
    for spec in args.attentions:
        try:
            results["attentions"][spec] = run_attention(spec, target, args, SMOLLM2_SHAPE["vocab_size"])
        except Exception as e:  # noqa: BLE001 - one attention failing must not lose the others' numbers
            log.exception("%s failed", spec)
            results["attentions"][spec] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            failed = True
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "bench_regenerate.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
