"""Decoding benchmark: target-only vs speculative greedy decoding, bf16 and fp32, eager and compiled.

For each dtype and mode it runs :func:`dflash.inference.spec_report.decode_report` (the lossless check's core:
the same prompts decoded target-only and speculatively over the static cache of
:mod:`dflash.inference.generation`) and writes, after every run, ``decode_bench.json`` (all reports) and
``decode_bench.md`` (one table row per run, then one row per run and prompt set) into ``--out``, so a
run cut short still leaves its results. The prompts are those of ``--prompt-set`` (repeatable; the
run's held-out conversations by default, ``humaneval``, ``mt-bench`` or a JSONL file:
:mod:`dflash.inference.prompt_sets`), the first ``--prompts`` of each.

Without ``--checkpoint`` the drafter is randomly initialised (the config's drafter shape): its τ is
about 1, so the speculative numbers mean nothing, but the target-only tokens/s do.

Example (the H200, real SmolLM2, a trained drafter)::

    python -m scripts.decode_bench --target /path/to/smollm2-hf-dir --checkpoint runs/x/checkpoints/step-N \\
        --prompt-set sharegpt --prompt-set humaneval --prompt-set mt-bench --out /tmp/decode \\
        data.dataset=.gpu/sharegpt.jsonl

Run it from the repository root as a module (``python -m scripts.decode_bench``), or as a script
where the package is installed.

Exit status: 0 when every run's outputs are identical or differ at numerical ties, 1 when any run's
outputs FAIL the margin rule, 2 on bad input (arguments, config, a prompt set's missing package or
file, checkpoint, no usable prompt; all before any model loads), 3 on any other error (its traceback
is logged), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch

from dflash.inference.prompt_sets import add_prompt_set_argument, check_prompt_sets
from dflash.inference.spec_report import rates_text
from dflash.inference.speculative import DEFAULT_CONFIG, DEFAULT_PROMPTS

log = logging.getLogger("decode_bench")

DTYPES = ("bfloat16", "float32")
MODES = ("eager", "compiled")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.decode_bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default=None, help="a Hugging Face directory of the target (unset: the config's)")
    p.add_argument("--checkpoint", default=None, help="drafter checkpoint (unset: a randomly initialised drafter)")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="run config")
    add_prompt_set_argument(p)
    p.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS, help="prompts of each prompt set (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=96,
                   help="new tokens a response decodes at most (both ways), the prefill's first among them")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="skip longer prompts (unset: data.max_length - max_new_tokens)")
    p.add_argument("--batch", type=int, default=1,
                   help="prompts decoded together; the sets share batches, so above 1 the per-set timings are the "
                        "batches' (tau and outputs stay per set)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {DTYPES}")
    p.add_argument("--modes", default=None,
                   help=f"comma-separated, of {MODES} (unset: both on CUDA, eager on CPU; compiled on CPU is "
                        "torch.compile without CUDA graphs)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device of the target and the drafter")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's; on a CPU shared with other jobs, fewer threads than "
                        "cores keeps the timings meaningful)")
    p.add_argument("--length-bucket", type=int, default=None,
                   help="decoders sized per length bucket of this many tokens (doubled until at most "
                        "dflash.inference.spec_report.MAX_BUCKETS remain), 0 = one sized for the longest "
                        "prompt (unset: dflash.inference.spec_report.default_length_bucket: "
                        "256 eager, 0 compiled, since each compiled decoder compiles its own steps)")
    p.add_argument("--attention", default=None,
                   help="the fused target layers' attention: sdpa, matmul, flex or reduce, or X+Y (X in the "
                        "one-token step, Y in verification and prefill; unset: reduce+matmul at batch 1, sdpa "
                        "above, dflash.inference.decode_layers.default_attention)")
    p.add_argument("--draft-cache", choices=("on", "off"), default="on",
                   help="on: draft from the drafter's context key/value cache (dflash.inference.proposer."
                        "CachedDFlashProposer, as the engines run it); off: through its training forward over "
                        "the whole feature buffer (DFlashProposer); the same math in another floating-point order")
    from dflash.inference.decode_steps import add_cuda_graphs_argument
    from dflash.inference.generation import PASS_SCHEDULES

    add_cuda_graphs_argument(p)

    p.add_argument("--pass-schedules", default=PASS_SCHEDULES[0],
                   help=f"speculative decoding's host-check schedules, comma-separated, of {PASS_SCHEDULES}: "
                        "the report is the first's; each further one decodes the prompts again for its time "
                        "(dflash.inference.generation.passes_before_check)")
    p.add_argument("--repeats", type=int, default=3,
                   help="decode the prompts this many times each way; each prompt's timings are those of its "
                        "median run (the lower median for an even count), its outputs too (runs whose tokens "
                        "differ from the first's are counted and warned about)")
    p.add_argument("--no-offline", action="store_true", help="skip the offline tau values")
    p.add_argument("--force", action="store_true",
                   help="use a checkpoint trained with another tokenizer, chat template or thinking mode")
    p.add_argument("--out", default="decode-bench-out", metavar="DIR",
                   help="directory for decode_bench.json and decode_bench.md (made once the input checks pass)")
    p.add_argument("overrides", nargs="*", help="config overrides section.key=value")
    args = p.parse_args(argv)
    args.prompt_sets = check_prompt_sets(p, args.prompt_set)  # a missing package or file: exit 2 here
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if args.modes is None:
        args.modes = ",".join(MODES) if args.device.startswith("cuda") else "eager"
    args.modes = [m for m in args.modes.split(",") if m]
    from dflash.inference.decode_layers import default_attention, split_attention
    args.attention = args.attention or default_attention(args.batch)
    if args.length_bucket is not None and args.length_bucket < 0:
        p.error("--length-bucket: must be >= 0")
    try:
        split_attention(args.attention)
    except ValueError as e:
        p.error(f"--attention: {e}")
    bad = [d for d in args.dtypes if d not in DTYPES] + [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"unknown dtype/mode {bad}: dtypes are {DTYPES}, modes {MODES}")
    args.pass_schedules = [x for x in args.pass_schedules.split(",") if x]
    if not args.pass_schedules or any(x not in PASS_SCHEDULES for x in args.pass_schedules):
        p.error(f"--pass-schedules: comma-separated, of {PASS_SCHEDULES}; got {args.pass_schedules}")
    for name in ("prompts", "max_new_tokens", "batch", "repeats", "threads", "max_prompt_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1, got {value}")
    return args


def _num(x: Any, d: int = 3) -> str:
    """``x`` with ``d`` decimals; ``–`` for None or NaN."""
    return "–" if x is None or x != x else f"{x:.{d}f}"  # x != x: NaN


def table(runs: list[dict[str, Any]]) -> str:
    """Markdown table, one row per run."""
    head = ("| dtype | mode, attention | batch | outputs (same / tie / FAIL) | τ measured | τ offline, own text | "
            "τ offline walk, own text | τ replay | τ per response, measured / own text | "
            "τ offline, dataset | target-only tok/s | speculative tok/s | speedup end to end / decoding | "
            "draft / verify / host s | warm-up s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    for r in runs:
        s = r["summary"]
        lines.append(
            f"| {s['dtype']} | {'compiled' if s['compiled'] else 'eager'}, {s.get('attention', 'sdpa')} | {s['batch']} | "
            f"{s['identical']} / {s['ties']} / {s['failures']} | {_num(s['tau'])} | {_num(s.get('offline_tau_own'))} | "
            f"{_num(s.get('offline_tau_own_walk'))} | {_num(s.get('offline_tau_replay'))} | "
            f"{_num(s.get('tau_per_response'))} / {_num(s.get('offline_tau_own_per_response'))} | "
            f"{_num(s.get('offline_tau_dataset'))} | {_num(s['target_tok_s'], 1)} | "
            f"{_num(s['spec_tok_s'], 1)} | {_num(s['speedup'], 2)}× / {_num(s.get('speedup_decode'), 2)}× | "
            f"{_num(s['draft_s'])} / {_num(s['verify_s'])} / "
            f"{_num(s['host_s'])} | {_num(s['warmup_s'], 1)} |")
    return "\n".join(lines) + "\n"


def schedule_table(runs: list[dict[str, Any]]) -> str:
    """Markdown table, one row per run and host-check schedule (the summary's ``pass_schedules``):
    host checks, passes (emitted / enqueued), outputs equal to the run's first schedule, speculative
    and host seconds, and the speedup per prompt set and pooled; empty when no run compared two."""
    runs = [r for r in runs if len(r["summary"].get("pass_schedules") or []) > 1]
    if not runs:
        return ""
    names = list(runs[0]["summary"]["pass_schedules"][0]["sets"])
    head = ("| dtype | mode | schedule | host checks (GPU idle) | passes / enqueued | same outputs | speculative s, end to end "
            "| host s | decoding s | " + " | ".join(f"speedup {n} (time per output token)" for n in names) + " |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        s = r["summary"]
        for x in s["pass_schedules"]:
            lines.append(f"| {s['dtype']} | {'compiled' if s['compiled'] else 'eager'} | {x['schedule']} | "
                         f"{x['checks']} ({x['idle_checks']}) | {x['passes']} / {x['passes_enqueued']} | {x['same_tokens']} / "
                         f"{s['prompts']} | {_num(x['spec_s'])} | {_num(x['host_s'])} | {_num(x.get('decode_s'))} | "
                         + " | ".join(f"{_num(x['sets'].get(n, {}).get('speedup'), 2)}×" for n in names) + " |")
    return "\nHost-check schedules (the rows above are the first's):\n\n" + "\n".join(lines) + "\n"


def set_table(runs: list[dict[str, Any]]) -> str:
    """Markdown table, one row per run and prompt set, then the run's pooled row
    (:func:`dflash.inference.spec_report.set_summaries`): τ per response with its standard error over
    the set's prompts, the conditional acceptance of the first four draft positions, time per output token as the reference
    benchmark takes it (decoding after the prefill), a verification pass's time (on the clock and,
    in brackets, the device's drafting and verification), and the speedup end to end beside it."""
    head = ("| dtype | mode | prompt set | prompts | outputs (same / tie / FAIL) | τ pooled | τ per response (SE) | "
            "drafts 1 / 2 / 3 / 4 accepted, given the one before | "
            "target-only ms/token | speculative ms/token | a pass, ms (on the device) | "
            "speedup (time per output token) | speedup end to end |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    for r in runs:
        s = r["summary"]
        for x in s.get("sets", []) + ([s["sets_pooled"]] if "sets_pooled" in s else []):
            lines.append(f"| {s['dtype']} | {'compiled' if s['compiled'] else 'eager'} | {x['set']} | {x['prompts']} | "
                         f"{x['identical']} / {x['ties']} / {x['failures']} | {_num(x['tau'])} | "
                         f"{_num(x['tau_per_response'])} ({_num(x.get('tau_per_response_se'), 2)}) | "
                         f"{rates_text(x.get('accept_conditional'))} | {_num(x['target_ms_per_token'])} | "
                         f"{_num(x['spec_ms_per_token'])} | {_num(x.get('spec_ms_per_pass'), 2)} "
                         f"({_num(x.get('spec_device_ms_per_pass'), 2)}) | {_num(x['speedup'], 2)}× | "
                         f"{_num(x.get('speedup_end_to_end'), 2)}× |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    """The benchmark; returns the exit status of the module docstring."""
    from dflash.logs import run_logged

    args = parse_args(argv)
    return run_logged(lambda: _run(args), log, "decode_bench")


def _run(args: argparse.Namespace) -> int:
    from dflash.config import load_config
    from dflash.training.factory import build_drafter
    from dflash.logs import setup_logging
    from dflash.models.drafter import DFlashDraftModel
    from dflash.inference.drafter_checkpoint import (fit_problem, open_checkpoint, target_shape_problem,
                                                    training_eval_summary)
    from dflash.data.render import stop_token_ids
    from dflash.inference.prompt_sets import context_problem, heldout_split_problem, load_prompt_sets
    from dflash.inference.spec_report import decode_report, format_report, repeats_phrase
    from dflash.models.target_loader import load_target
    from dflash.data.tokenizer import load_tokenizer

    setup_logging("decode_bench")
    out = Path(args.out)  # made once the input is known to be good
    if out.exists() and not out.is_dir():
        log.error("--out %s: is a file; give a directory (decode_bench.json and decode_bench.md are written in it)",
                  out)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = list(args.overrides)
    if args.target:
        overrides += ["target.kind=hf", f"target.path={args.target}"]
    try:
        cfg = load_config(args.config, overrides)
    except (OSError, ValueError) as exc:  # ConfigError is a ValueError
        log.error("%s", exc)
        return 2
    device = torch.device(args.device)
    dcfg = None
    drafter_dir = run_dir = None
    trained: dict[str, Any] = {}
    if args.checkpoint:
        try:
            drafter_dir, run_dir, dcfg = open_checkpoint(args.checkpoint)
            trained = training_eval_summary(drafter_dir, run_dir)
        except (OSError, ValueError) as exc:
            log.error("--checkpoint %s: %s", args.checkpoint, exc)
            return 2
    tokenizer = load_tokenizer(cfg.target)
    problem = drafter_dir and fit_problem(drafter_dir, dcfg, tokenizer, cfg.data.enable_thinking, force=args.force)
    if problem:  # another tokenizer, template or thinking mode, refused by name
        log.error("%s", problem)
        return 2
    problem = heldout_split_problem(args.prompt_sets, cfg, run_dir)
    if problem:  # an override that would draw the sharegpt set from conversations the drafter trained on
        log.error("%s", problem)
        return 2
    cases, set_info = load_prompt_sets(args.prompt_sets, cfg, tokenizer, args.prompts, args.max_new_tokens,
                                       args.max_prompt_tokens)
    if not cases:
        return 2
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.error("--out %s: cannot make the directory: %s", out, exc.strerror or exc)
        return 2
    runs: list[dict[str, Any]] = []
    meta = {"config": args.config, "overrides": overrides, "checkpoint": args.checkpoint,
            "drafter": "checkpoint" if args.checkpoint else "random (tau ~ 1: speculative numbers are not meaningful)",
            "prompts": len(cases), "prompt_sets": set_info, "max_new_tokens": args.max_new_tokens, "batch": args.batch,
            "attention": args.attention, "draft_cache": args.draft_cache, "cuda_graphs": args.cuda_graphs,
            "length_bucket": args.length_bucket,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "threads": torch.get_num_threads()}
    failed = False
    for dtype in args.dtypes:
        target_cfg = replace(cfg.target, dtype=dtype)
        if dcfg is not None:
            target_cfg = replace(target_cfg, layer_ids=list(dcfg.target_layer_ids))
        target = load_target(target_cfg, device, num_drafter_layers=dcfg.num_hidden_layers if dcfg else
                             cfg.drafter.num_layers)
        problem = ((drafter_dir and target_shape_problem(drafter_dir, dcfg, target))
                   or context_problem(cases, args.max_new_tokens, dcfg.block_size if dcfg else cfg.drafter.block_size,
                                      target.config))
        if problem:
            log.error("%s", problem)
            return 2
        if drafter_dir is not None:
            drafter = DFlashDraftModel.from_pretrained(drafter_dir, target.embed_tokens, target.lm_head,
                                                       attention="sdpa", device=device)
        else:
            torch.manual_seed(cfg.target.seed)
            drafter = build_drafter(cfg, target.embed_tokens, target.lm_head, len(tokenizer), device, target.config)
        drafter.eval()
        stops = stop_token_ids(tokenizer, target.model)
        for mode in args.modes:
            torch._dynamo.reset()  # each run compiles its own decoders; earlier ones need no cache entries
            t0 = time.perf_counter()
            report = decode_report(target, drafter, cases, max_new_tokens=args.max_new_tokens, stop_ids=stops,
                                   batch=args.batch, compile=mode == "compiled", offline=not args.no_offline,
                                   labels=cfg.drafter.labels, attention=args.attention,
                                   length_bucket=args.length_bucket, pass_schedules=args.pass_schedules,
                                   draft_cache=args.draft_cache == "on", cuda_graphs=args.cuda_graphs,
                                   repeats=args.repeats)
            report["summary"].update(run_s=time.perf_counter() - t0, **trained)
            print(f"\n== {dtype}, {mode}\n{format_report(report)}", flush=True)
            failed |= report["summary"]["failures"] > 0
            runs.append(report)
            (out / "decode_bench.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
            sets = ", ".join(f"{name} {v['prompts']}" for name, v in set_info.items())
            (out / "decode_bench.md").write_text(
                f"Decoding benchmark: {meta['device']}, {len(cases)} prompts ({sets}), {args.max_new_tokens} new "
                f"tokens, batch {args.batch}, drafter {args.checkpoint or 'random'}; timings per prompt: the "
                f"{repeats_phrase(args.repeats)} each way\n\n" + table(runs)
                + "\nPer prompt set:\n\n" + set_table(runs) + schedule_table(runs))
        del target, drafter
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("\n" + table(runs) + "\n" + set_table(runs) + schedule_table(runs))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
