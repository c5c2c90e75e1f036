"""The lossless check of speculative decoding with a trained DFlash drafter, and where τ goes (the CLI).

Decodes the prompts of one or more prompt sets (:mod:`dflash.inference.prompt_sets`: the run's
held-out conversations by default, HumanEval, MT-Bench, a file) both ways, target-only greedy and
speculative, over the static cache of :mod:`dflash.inference.generation`; checks that the outputs
agree up to numerical ties (:mod:`dflash.inference.lossless`) and compares the measured acceptance
length with the offline ones (:mod:`dflash.inference.acceptance`); prints the report of
:mod:`dflash.inference.spec_report`. The drafter comes from a run, a training checkpoint or a
drafter directory (:mod:`dflash.inference.drafter_checkpoint`).

CLI::

    python -m dflash.inference.speculative --checkpoint runs/<name>/checkpoints/step-XXXXXXXX \\
        [--config configs/smollm2-135m-cpu.yaml] [--prompt-set sharegpt|humaneval|mt-bench|FILE ...] \\
        [--prompts 8] [--max-new-tokens 96] [--device cuda] [--batch 1] [--compile auto|on|off]
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

from dflash.inference.drafter_checkpoint import (fit_problem, open_checkpoint, target_shape_problem,
                                                training_eval_summary)
from dflash.data.render import stop_token_ids
from dflash.inference.prompt_sets import (add_prompt_set_argument, check_prompt_sets, context_problem,
                                          heldout_split_problem, load_prompt_sets)
from dflash.inference.spec_report import LENGTH_BUCKET, MAX_BUCKETS, decode_report, format_report

__all__ = ["compile_flag", "main"]

log = logging.getLogger(__name__)

#: Default CLI settings.
DEFAULT_PROMPTS = 16
DEFAULT_MAX_NEW_TOKENS = 96
#: The embedded default config, from the checkout this package runs from (any working directory).
DEFAULT_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "smollm2-135m-cpu.yaml")


def _parse_args(argv: Optional[list[str]], prog: Optional[str] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog or "python -m dflash.inference.speculative",
                                description="Lossless speculative decoding with a trained DFlash drafter on "
                                            "prompt sets (held-out conversations, HumanEval, MT-Bench, a file): "
                                            "output check, measured and offline tau, speedup.")
    p.add_argument("--checkpoint", required=True,
                   help="a run directory (its newest checkpoint), runs/<name>/checkpoints/step-XXXXXXXX or a "
                        "drafter directory")
    p.add_argument("--config", default=None,
                   help=f"run config (default: the run's config.yaml, else {DEFAULT_CONFIG})")
    add_prompt_set_argument(p)
    p.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS,
                   help="prompts to decode of each prompt set (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help=f"new tokens a prompt (default {DEFAULT_MAX_NEW_TOKENS}; decoding stops earlier at a stop token)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="skip longer prompts (default: data.max_length - max_new_tokens, so decoding stays "
                        "within the trained length)")
    p.add_argument("--device", default=None, help="cpu / cuda (default: the config's cluster.device)")
    p.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="torch.compile the decoding steps (auto = on CUDA, where they also become CUDA graphs; "
                        "on CPU `on` compiles without graphs)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--length-bucket", type=int, default=None,
                   help=f"one decoder per prompt-length bucket of this many tokens (doubled until at most {MAX_BUCKETS} "
                        f"buckets remain), 0 = one sized for the longest prompt (default: {LENGTH_BUCKET} eager, 0 "
                        f"compiled, since each compiled decoder compiles its own steps: ~90 s on an H200)")
    p.add_argument("--no-offline", action="store_true", help="skip the offline tau values")
    p.add_argument("--show-text", action="store_true", help="print each decoded response")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")
    p.add_argument("--force", action="store_true",
                   help="use a checkpoint trained with another tokenizer, chat template or thinking mode")
    p.add_argument("overrides", nargs="*", help="config overrides section.key=value")
    args = p.parse_args(argv)
    args.prompt_sets = check_prompt_sets(p, args.prompt_set)  # a missing package or file: exit 2 here
    for name in ("prompts", "max_new_tokens", "batch", "threads", "max_prompt_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1, got {value}")
    if args.length_bucket is not None and args.length_bucket < 0:
        p.error(f"--length-bucket: must be >= 0, got {args.length_bucket}")
    if args.json and Path(args.json).is_dir():
        p.error(f"--json {args.json}: is a directory; give a file name")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        p.error(f"--json {args.json}: its directory {Path(args.json).resolve().parent} does not exist")
    if args.device is not None:
        try:
            dev = torch.device(args.device)
        except RuntimeError:
            dev = None
        if dev is None or dev.type not in ("cpu", "cuda"):
            p.error(f"--device {args.device}: expected cpu, cuda or cuda:N")
        if dev.type == "cuda" and not torch.cuda.is_available():
            p.error(f"--device {args.device}: this torch sees no CUDA device")
    return args


def compile_flag(value: str) -> Optional[bool]:
    """``auto`` / ``on`` / ``off`` → ``None`` / ``True`` / ``False``."""
    return {"auto": None, "on": True, "off": False}[value]


def main(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> int:
    """The CLI: decode the prompt sets both ways and print the report (``prog``: the command name
    ``--help`` shows).

    Returns:
        0 when every speculative output is identical to target-only greedy or differs only at a
        numerical tie (:func:`tie_bound`), 1 otherwise (the lossless check failed), 2 on bad input
        (arguments, config, a prompt set's missing package or file, a missing or damaged checkpoint,
        no usable prompt, a checkpoint that does
        not fit the tokenizer, template, thinking mode or target:
        :func:`dflash.training.checkpoint_identity.check_fits`), 3 on any other error (its traceback is
        logged), 130 when interrupted.
    """
    from dflash.logs import run_logged, setup_logging

    args = _parse_args(argv, prog)
    setup_logging("speculative")
    return run_logged(lambda: _run(args), log, "speculative decoding")


def _run(args: argparse.Namespace) -> int:
    from dflash.config import load_config
    from dflash.models.drafter import DFlashDraftModel
    from dflash.models.target_loader import load_target, target_layer_types
    from dflash.data.tokenizer import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        drafter_dir, run_dir, dcfg = open_checkpoint(args.checkpoint)  # a damaged drafter fails here
        config_path = args.config
        if config_path is None:
            config_path = (str(run_dir / "config.yaml") if run_dir and (run_dir / "config.yaml").is_file()
                           else DEFAULT_CONFIG)
        cfg = load_config(config_path, args.overrides)
    except (OSError, ValueError) as exc:  # ConfigError and a corrupt config.json are ValueErrors
        log.error("%s", exc)
        return 2
    ignored = [o for o in args.overrides if o.split("=", 1)[0].startswith("drafter.")]
    if ignored:  # the drafter's shape and block size are the checkpoint's
        log.warning("ignored %s: the drafter is %s's (block size %d, %d layers)", ", ".join(ignored), drafter_dir,
                    dcfg.block_size, dcfg.num_hidden_layers)
    device = torch.device(args.device or ("cuda" if cfg.cluster.device != "cpu" and torch.cuda.is_available()
                                          else "cpu"))
    tokenizer = load_tokenizer(cfg.target)
    # before any model loads (check_fits logs what --force accepts); the target's shape once it is loaded
    problem = fit_problem(drafter_dir, dcfg, tokenizer, cfg.data.enable_thinking, force=args.force)
    if problem:
        log.error("%s", problem)
        return 2
    problem = heldout_split_problem(args.prompt_sets, cfg, run_dir)
    if problem:  # an override that would draw the sharegpt set from conversations the drafter trained on
        log.error("%s", problem)
        return 2
    # before any model loads: the prompts need only the tokenizer and the data
    cases, set_info = load_prompt_sets(args.prompt_sets, cfg, tokenizer, args.prompts, args.max_new_tokens,
                                       args.max_prompt_tokens)
    if not cases:
        return 2
    # The drafter's checkpoint decides which target layers feed it.
    target_cfg = replace(cfg.target, layer_ids=list(dcfg.target_layer_ids))
    if "linear_attention" in target_layer_types(target_cfg):
        log.error("%s: the target has linear-attention (Gated-DeltaNet) layers, which static-cache "
                  "speculative decoding does not support (no recurrent-state cache)", target_cfg.arch or target_cfg.path)
        return 2
    target = load_target(target_cfg, device, num_drafter_layers=dcfg.num_hidden_layers)
    problem = (target_shape_problem(drafter_dir, dcfg, target)
               or context_problem(cases, args.max_new_tokens, dcfg.block_size, target.config))
    if problem:
        log.error("%s", problem)
        return 2
    drafter = DFlashDraftModel.from_pretrained(drafter_dir, target.embed_tokens, target.lm_head, attention="sdpa",
                                               device=device).eval()
    stops = stop_token_ids(tokenizer, target.model)
    if args.batch > len(cases):
        log.info("--batch %d: %d prompts, so batches of %d", args.batch, len(cases), len(cases))
        args.batch = len(cases)
    log.info("drafter %s: B=%d, target layers %s, mask %s; %d prompts, max %d new tokens, stop ids %s, "
             "%d torch threads", drafter_dir, dcfg.block_size, dcfg.target_layer_ids,
             dcfg.mask_token_id, len(cases),
             args.max_new_tokens, stops, torch.get_num_threads())
    report = decode_report(target, drafter, cases, max_new_tokens=args.max_new_tokens, stop_ids=stops,
                           batch=args.batch, compile=compile_flag(args.compile), offline=not args.no_offline,
                           labels=cfg.drafter.labels, length_bucket=args.length_bucket)
    report["summary"].update(checkpoint=str(args.checkpoint), threads=torch.get_num_threads(), prompt_sets=set_info,
                             **training_eval_summary(drafter_dir, run_dir))
    if args.show_text:
        for row in report["prompts"]:
            row["text"] = tokenizer.decode(row["target_tokens"])
    print(f"\nSpeculative decoding: {drafter_dir}")
    print(format_report(report, show_text=args.show_text))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if report["summary"]["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
