"""Decoding speed with random weights at a real shape: no tokenizer, no data, no checkpoint.

A random target (default: SmolLM2-135M's shape, ``LlamaForCausalLM``, 30 layers, D = 576) and a
random drafter decode random prompts target-only and speculatively, eager and compiled (CUDA
graphs). Random weights decode at the same speed as trained ones, and a random drafter's τ is about
1, so the speculative figure is the cost of a pass with nothing accepted. Also checks that compiled
and eager decoding produce the same tokens in fp32 (exit 1 otherwise).

Modes: ``eager``, ``compiled`` (fused decoder layers, :mod:`dflash.inference.decode_layers`, SDPA
attention), ``compiled-ATTN`` (the same with the attention spec ``ATTN`` of
:func:`dflash.inference.decode_layers.split_attention`: ``matmul``, ``flex``, or ``flex+sdpa`` for
flex in the one-token step and SDPA in verification) and ``compiled-plain`` (the transformers
layers). ``--profile`` also counts the GPU kernels of one compiled target-only token and of one
verification pass (draft and verification) and lists the costliest (torch.profiler); each mode's
``enqueue_s`` beside ``decode_s`` says whether the host or the GPU bounds a compiled decoder. A
mode that fails (a kernel inductor cannot lower on this machine) is logged with its error and the
others still run; the exit status is then 1.

    python -m scripts.decode_speed --out results/speed [--dtype bfloat16] [--new-tokens 96] [--batch 1]
        [--modes eager,compiled,compiled-matmul,compiled-flex,compiled-flex+sdpa,compiled-plain] [--profile]
        [--prompts 1024 --batch 1024 --prompt-step 0 --target-only]   # regeneration's batches
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger("decode_speed")

PLAIN_MODES = ("eager", "compiled", "compiled-plain")


def mode_attention(mode: str) -> str:
    """The fused layers' attention spec of a mode (``compiled-ATTN``; every other mode: SDPA).

    Raises:
        ValueError: an unknown mode or attention spec.
    """
    from dflash.inference.decode_layers import split_attention

    if mode in PLAIN_MODES:
        return "sdpa"
    if not mode.startswith("compiled-"):
        raise ValueError(f"unknown mode {mode!r}: {', '.join(PLAIN_MODES)} or compiled-ATTN")
    spec = mode[len("compiled-"):]
    split_attention(spec)
    return spec

#: SmolLM2-135M-Instruct's shape (its config.json), on the tiny-llama family.
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                     tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})


#: Prompt ``i`` is this many tokens shorter than prompt ``i − 1`` (lengths vary, as real prompts do).
PROMPT_STEP = 7


def main(argv: Optional[list[str]] = None) -> int:
    from dflash.config import DrafterConfig, TargetConfig
    from dflash.logs import setup_logging
    from dflash.models.drafter import DFlashDraftModel
    from dflash.models.drafter_config import DFlashConfig, mask_fallback_token_ids, resolve_mask_token_id
    from dflash.models.target_loader import load_target

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=160,
                   help="the first prompt's length; prompt i has --prompt-step·i tokens fewer")
    p.add_argument("--prompt-step", type=int, default=PROMPT_STEP,
                   help="tokens by which each prompt is shorter than the one before (0: all of one length, "
                        "for large batches)")
    p.add_argument("--target-only", action="store_true",
                   help="time target-only decoding only (no speculative pass: large batches, regeneration's case)")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--drafter-intermediate-size", type=int, default=None,
                   help="the drafter's MLP width (drafter.intermediate_size; unset: the target's)")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="write speed.json here")
    from dflash.inference.decode_steps import add_cuda_graphs_argument

    add_cuda_graphs_argument(p)
    p.add_argument("--profile", action="store_true",
                   help="kernels of one compiled target-only token and one verification pass (CUDA only)")
    args = p.parse_args(argv)
    for name in ("prompts", "prompt_tokens", "new_tokens", "batch", "block_size", "drafter_layers",
                 "drafter_intermediate_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.prompt_step < 0:
        p.error(f"--prompt-step: must be >= 0, got {args.prompt_step}")
    if args.block_size < 2:
        p.error(f"--block-size: must be >= 2 (the anchor and at least one draft), got {args.block_size}")
    shortest = args.prompt_tokens - args.prompt_step * (args.prompts - 1)
    if shortest < 1:
        p.error(f"--prompt-tokens {args.prompt_tokens} is too short for {args.prompts} prompts: prompt i has "
                f"{args.prompt_step}·i tokens fewer, so the last would have {shortest}; give at least "
                f"{args.prompt_step * (args.prompts - 1) + 1} (or a smaller --prompt-step)")
    if args.profile and not args.device.startswith("cuda"):
        p.error("--profile counts CUDA kernels: it needs --device cuda")
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        try:
            mode_attention(m)
        except ValueError as e:
            p.error(f"--modes: {e}")
    setup_logging("decode_speed")
    device = torch.device(args.device)
    target = load_target(TargetConfig(kind="random", arch="tiny-llama", arch_overrides=SMOLLM2_SHAPE, dtype=args.dtype),
                         device, num_drafter_layers=args.drafter_layers)
    dcfg = DFlashConfig.from_target(target.config, DrafterConfig(num_layers=args.drafter_layers,
                                                                 block_size=args.block_size,
                                                                 intermediate_size=args.drafter_intermediate_size),
                                    target_layer_ids=target.layer_ids)
    vocab = SMOLLM2_SHAPE["vocab_size"]
    dcfg = replace(dcfg, mask_token_id=resolve_mask_token_id(None, vocab, vocab, mask_fallback_token_ids(target.config)))
    torch.manual_seed(0)
    drafter = DFlashDraftModel(dcfg, target.embed_tokens, target.lm_head, attention="sdpa").to(device).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (args.prompt_tokens - args.prompt_step * i,), generator=g)
               for i in range(args.prompts)]
    max_len = args.prompt_tokens + max(args.new_tokens, 16) + args.block_size + 1
    results: dict = {"dtype": args.dtype, "batch": args.batch, "new_tokens": args.new_tokens,
                     "prompt_tokens": args.prompt_tokens, "prompt_step": args.prompt_step,
                     "block_size": args.block_size,
                     "drafter_intermediate_size": dcfg.intermediate_size,
                     "cuda_graphs": args.cuda_graphs, "device": str(device),
                     "torch": torch.__version__}
    tokens_by_mode: dict = {}
    failed: list = []
    for mode in modes:
        try:
            row = run_mode(mode, target, drafter, prompts, max_len, args, tokens_by_mode)
        except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others' numbers
            log.exception("%s failed", mode)
            row = {"error": f"{type(e).__name__}: {e}"[:2000]}
            failed.append(mode)
            torch._dynamo.reset()
        results[mode] = row
        log.info("%s: %s", mode, json.dumps(row))
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"speed-{args.dtype}-b{args.batch}.json").write_text(json.dumps(results, indent=1))
    ok = not failed
    eager = tokens_by_mode.get("eager")
    for mode, toks in tokens_by_mode.items():
        if eager is None or mode == "eager":
            continue
        same = {k: sum(x == y for x, y in zip(eager[k], toks[k])) for k in eager}
        results[f"{mode}_equals_eager"] = same
        log.info("%s == eager (prompts of %d): %s", mode, len(prompts), same)
        ok = ok and (args.dtype != "float32" or all(v == len(prompts) for v in same.values()))
    if eager is not None and "speculative" in eager:
        results["speculative_equals_greedy_eager"] = sum(x == y for x, y in zip(eager["greedy"], eager["speculative"]))
    print(json.dumps(results, indent=1))
    if args.out:
        (Path(args.out) / f"speed-{args.dtype}-b{args.batch}.json").write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


def run_mode(mode: str, target, drafter, prompts: list, max_len: int, args: argparse.Namespace,
             tokens_by_mode: dict) -> dict:
    """One mode's target-only and speculative speed over ``prompts`` (and its profile with
    ``--profile``); its tokens go into ``tokens_by_mode[mode]``."""
    from dflash.inference.generation import Generator

    gen = Generator(target.model, target.layer_ids, max_len, batch_size=args.batch, drafter=drafter,
                    compile=mode.startswith("compiled"), fuse=mode != "compiled-plain",
                    attention=mode_attention(mode), cuda_graphs=args.cuda_graphs)
    kinds = ("greedy",) if args.target_only else ("greedy", "speculative")
    gen.warm_up(prompts[:args.batch], 16, speculative="speculative" in kinds, rounds=2)  # compile + capture, once more
    row: dict = {}
    for kind in kinds:
        fn = getattr(gen, kind)
        outs = []
        for i in range(0, len(prompts), args.batch):
            outs += fn(prompts[i:i + args.batch], args.new_tokens)
        groups = [outs[i:i + args.batch] for i in range(0, len(outs), args.batch)]
        seconds = sum(grp[0].seconds for grp in groups)
        tokens = sum(len(o.tokens) for o in outs)
        row[kind] = {"tok_s": tokens / seconds, "ms_per_token_or_pass": 1e3 * seconds / max(
            1, sum(o.steps for o in outs) if kind == "speculative" else tokens / args.batch),
            "tau": (sum(sum(o.accepted) for o in outs) / max(1, sum(o.steps for o in outs))
                    if kind == "speculative" else None),
            "draft_s": sum(grp[0].draft_seconds for grp in groups),
            "verify_s": sum(grp[0].verify_seconds for grp in groups), "seconds": seconds,
            "prefill_s": sum(grp[0].prefill_seconds for grp in groups),
            "decode_s": sum(grp[0].decode_seconds for grp in groups),
            # host time launching the steps / passes: as long as decode_s, the GPU waits for the host
            "enqueue_s": sum(grp[0].enqueue_seconds for grp in groups)}
        tokens_by_mode.setdefault(mode, {})[kind] = [o.tokens for o in outs]
    if args.profile and gen.compiled:
        row["profile"] = profile_greedy(gen, prompts[:args.batch])
        if "speculative" in kinds:
            row["profile_speculative"] = profile_speculative(gen, prompts[:args.batch])
    return row


def profile_greedy(gen, prompts: list, tokens: int = 32) -> dict:
    """GPU kernels per target-only token over ``tokens`` compiled steps: count, µs, the top 12 by time.
    ``tokens`` is capped by the decoder's room (its ``max_len`` was sized for ``--new-tokens``)."""
    from torch.profiler import ProfilerActivity, profile

    tokens = max(1, min(tokens, _room(gen, prompts) - 1))
    gen.greedy(prompts, 8)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gen.greedy(prompts, tokens + 1)
        torch.cuda.synchronize()
    return kernel_table(prof, tokens, "token")


def _room(gen, prompts: list) -> int:
    """The most new tokens every prompt of ``prompts`` has room for in ``gen`` (``Generator._check``'s rule)."""
    from dflash.inference.decode_state import SLACK

    return gen.max_len - max(p.numel() for p in prompts) - gen.block_size - SLACK


def profile_speculative(gen, prompts: list, tokens: int = 64) -> dict:
    """GPU kernels per verification pass (its draft and verification) over a ``tokens``-token
    speculative decode (capped by the decoder's room), as :func:`profile_greedy` gives them per
    token, the prefill's kernels left out (a prefill-only decode profiled apart and subtracted);
    with the clock's time per pass beside it (``clock_us_per_pass``, decoding after the prefill),
    the difference is the GPU idling between kernels. With the decoder's ``overlap_checks`` (on
    CUDA) the draft past the last pass is among the kernels: a draft over ``passes`` more per pass."""
    from torch.profiler import ProfilerActivity, profile

    tokens = max(2, min(tokens, _room(gen, prompts)))
    gen.speculative(prompts, 8)
    with profile(activities=[ProfilerActivity.CUDA]) as prefill_only:
        gen.speculative(prompts, 1)  # one token: the prefill's, no pass
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        outs = gen.speculative(prompts, tokens)
        torch.cuda.synchronize()
    passes = max(1, outs[0].passes_enqueued)
    table = kernel_table(prof, passes, "pass", minus=prefill_only)
    table["passes"] = passes
    table["clock_us_per_pass"] = 1e6 * outs[0].decode_seconds / passes
    table["enqueue_us_per_pass"] = 1e6 * outs[0].enqueue_seconds / passes
    return table


def _kernels(prof) -> list:
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def kernel_table(prof, per: int, unit: str, rows: int = 12, minus=None) -> dict:
    """The CUDA kernels of a ``torch.profiler`` run, per ``unit`` (``per`` of them ran): their count
    and µs (``kernels_per_<unit>``, ``kernel_us_per_<unit>``) and the ``rows`` costliest by name
    (``top``: name, calls and µs per ``unit``); ``minus``: another profile whose kernels are
    taken away first (by name: calls and time)."""
    by_name: dict = {}
    for e in _kernels(prof):
        n, t = by_name.get(e.name, (0, 0.0))
        by_name[e.name] = (n + 1, t + e.device_time)
    for e in _kernels(minus) if minus is not None else []:
        n, t = by_name.get(e.name, (0, 0.0))
        by_name[e.name] = (n - 1, t - e.device_time)
    by_name = {k: (n, t) for k, (n, t) in by_name.items() if n > 0}
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:rows]
    return {f"kernels_per_{unit}": sum(n for n, _ in by_name.values()) / per,
            f"kernel_us_per_{unit}": sum(t for _, t in by_name.values()) / per,
            "top": [{"name": k[:90], f"per_{unit}": n / per, f"us_per_{unit}": t / per} for k, (n, t) in top]}


if __name__ == "__main__":
    sys.exit(main())
