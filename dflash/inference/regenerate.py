"""Data regeneration: the target rewrites the assistant turns of the training conversations.

DFlash trains on responses the target generated itself (docs/DFLASH.md, Recipe): a drafter trained on another
model's responses accepts less. This command replaces every assistant turn of ``data.dataset`` with the
target's own response and writes a JSONL file the trainer reads directly (``data.dataset=<output>``).
Its parts live in :mod:`dflash.inference.regeneration`; this module is the command line (the
launcher, and each worker with the internal ``--worker-rank``).

``python -m dflash.inference.regenerate --config configs/X.yaml --output data/regen.jsonl [--max-new-tokens 256]
[--temperature 0] [--top-p 1] [--seed 0] [--limit 200] [--batch-size 16] [--max-turns K]
[--max-prompt-tokens T] [--gpus 0,1] [--max-seconds S] [--overwrite] [section.key=value ...]`` (also
``python -m launch.cluster --mode regenerate ...``). As the first stage of training: the config's ``regenerate`` section
(:class:`dflash.config.RegenerateConfig`, off by default) makes ``python -m launch.cluster --config X.yaml``
call :func:`run_stage` before it trains, on ``regenerate.output``; with ``regenerate.sampled.output`` the
stage then regenerates the data a second time with sampling, within what is left of
``regenerate.max_seconds``, and training reads those rows as extra data (``data.extra_datasets``).

**What is generated** (:mod:`dflash.inference.regeneration.jobs`). Each assistant turn is regenerated
given the conversation so far, rendered with the target's chat template (``data.enable_thinking``
passed to it) and ``add_generation_prompt``, where earlier assistant turns are *already the
regenerated ones* (as SpecForge / DFlash regeneration does); system and user turns are kept
verbatim. A conversation ends at its last regenerated turn, and stops early (keeping the turns done
so far) when ``--max-turns`` turns are done, when the next prompt is ``--max-prompt-tokens`` tokens
or longer (default ``data.max_length``: the trainer cuts longer sequences anyway, so later turns
would be wasted work), when a response is empty, or when the template fails. Leading assistant
turns (ShareGPT continuation rows: nothing to answer) are dropped. Greedy (``--temperature 0``, the
default) takes the argmax, which is the target's own greedy continuation; sampling
(``--temperature T --top-p P``) draws each token with noise computed from the seed of its (seed, row
id, turn) and its position (:mod:`dflash.inference.sampling`), so a sampled row does not depend on
batching, sharding or restarts. Both run through the static-cache generator
(:mod:`dflash.inference.regeneration.generators`). A turn ends at the tokenizer's end-of-turn / EOS
token (not stored: the template adds it back) or after ``--max-new-tokens``. Token ids the
tokenizer does not have (padding rows of the embedding) are never generated. Responses are decoded
with special tokens kept, so that re-tokenising the stored text gives the generated ids back; rows
count the turns where it does not (``regen.retokenize_mismatch``). Workers log rows, new tokens/s
and an ETA at least every 30 s; the launcher shows the same over all workers, with each worker's rate
(and the time budget left).

**Time budget** (``--max-seconds S``, default ``regenerate.max_seconds``; unset = no limit; a
finite number > 0). One run lasts about S seconds of wall clock, model loads included: the launcher
takes its deadline when it starts and hands it to the workers (internal ``--deadline``), and each
worker stops before its next generation round once it has passed (a conversation in flight is
written as a *partial* row, ``regen.partial: true``, when it has a regenerated turn: the turns done
so far, a valid row to train on; a later run regenerates it whole and its whole row replaces the
partial one), logs what it wrote and left, and exits 0. The launcher then merges the finished and
partial rows into ``<output>`` as after a complete run, records ``time_limited: true``,
``rows_left`` (partial rows included) and ``partial_rows`` in ``last_run``, logs a warning with
the command that continues (the same one without the budget) and exits 0. The budget is not one of
the options an output is "made with": any later run, with or without one, continues it. As the
training stage with ``regenerate.max_seconds`` set, an output whose last run was time-limited is
used as it is (no worker, no model load), so a resumed training run trains on the same rows;
continue it with the standalone command.

**Files** (:mod:`dflash.inference.regeneration.shards`). ``<output>`` (the merged result),
``<output>.rank<k>`` (worker k's shard, appended), ``<output>.rank<k>.lock`` (held by worker k while
it appends), ``<output>.rank<k>.log`` (its log), ``<output>.skipped`` (the skip records of merged
shards), ``<output>.regen.json`` (options, checked on restart, and the last run's report: rows,
skips, new tokens, overall new tokens/s and ``per_worker`` rows, new tokens, seconds and new
tokens/s; ``time_limited``, ``rows_left`` and ``partial_rows`` when the time budget ended it),
``<output>.lock`` (held
by the launcher). Every line is one JSON object with a stable
``id`` (:mod:`dflash.inference.regeneration.rows`):

* a regenerated row (ShareGPT form, read by :func:`dflash.data.conversations.normalize_row`):
  ``{"id", "conversations": [{"from": "system"|"human"|"gpt", "value"}], "regen": {"source_index",
  "turns", "new_tokens": [..], "finish": ["stop"|"length", ..], "retokenize_mismatch"}}`` (and
  ``"partial": true`` in ``regen`` for a partial row);
* a skipped row (shards and ``<output>.skipped``; never in ``<output>``): ``{"id", "skipped": reason,
  "regen": {"source_index"}}``, reasons :data:`dflash.inference.regeneration.jobs.SKIP_REASONS`.
  Skips are deterministic, so they count as done, also after a merge: a complete output starts no
  worker and is not rewritten.

**Sharding and resume.** Worker k of N (one per ``--gpus`` entry, default ``cluster.targets``; the
training stage uses ``cluster.targets`` + ``cluster.drafters``) owns the rows whose
``sha256(id) mod N == k`` (:mod:`dflash.inference.regeneration.worker`) and appends finished rows to
its own shard, one ``os.write`` plus ``fsync`` per round, under its shard's exclusive lock. Rows
already in ``<output>`` or in any shard (of any earlier N) are done and skipped; a line cut by a
kill mid-write is dropped and regenerated, never duplicated. When every worker has finished, the
launcher (:mod:`dflash.inference.regeneration.launcher`) merges ``<output>`` and the shards in
source order (an id once), replaces ``<output>`` atomically (skips into ``<output>.skipped``) and
deletes the shards. Workers are separate processes started by
:class:`dflash.runtime.supervisor.Supervisor` (never a fork of a process holding CUDA) with a
parent-death signal, so none outlives the launcher; a restarted launcher waits (bounded) for the
shard locks of a previous run's workers before it reads the shards.

Known limits: sharding by id balances the rows, not the work, and a restart keeps the same owners (a
shard that had finished idles); a response cut at ``--max-new-tokens`` is kept (``finish: length``);
a greedy batch runs until its longest row ends (finished rows ride along on the static cache) and
each prompt's prefill is its own eager forward; a worker's ETA is optimistic early on (short prompts first);
thinking templates that strip earlier turns' reasoning are rendered as the template does; the time
budget is checked between rounds, so a run overshoots it by up to one round (a greedy batch runs to its
longest row) plus the merge, and a time-limited output (the shortest prompts first) is not a
uniform sample of the data.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

from dflash.config import ConfigError, RegenerateConfig, RunConfig, load_config
from dflash.inference.regeneration.jobs import GenerationOptions
from dflash.inference.regeneration.launcher import (EXIT_CONFIG, EXIT_OK, continue_command, option_flags,
                                                    run_launcher, time_limited_run)
from dflash.inference.regeneration.worker import run_worker
from dflash.logs import setup_logging
from dflash.runtime.base import exit_on_sigterm

__all__ = ["parse_args", "run_stage", "stage_workers", "main"]

log = logging.getLogger("dflash.inference.regenerate")


def _gpu_list(text: str) -> list[int]:
    """``"0,1"`` → ``[0, 1]`` (argparse type of ``--gpus``)."""
    try:
        gpus = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated GPU ids, got {text!r}") from None
    if not gpus or any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise argparse.ArgumentTypeError(f"expected distinct GPU ids >= 0, got {text!r}")
    return gpus


def parse_args(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> argparse.Namespace:
    """The command line of the launcher and of each worker (``--worker-rank``, ``--world``,
    ``--deadline``: internal);
    ``prog``: the name ``--help`` shows (default ``python -m dflash.inference.regenerate``)."""
    p = argparse.ArgumentParser(prog=prog or "python -m dflash.inference.regenerate",
                                description="The target rewrites the assistant turns of data.dataset.")
    p.add_argument("--config", required=True, help="YAML config (target, data, cluster sections are used)")
    p.add_argument("--output", type=Path, default=None, help="output JSONL (ShareGPT form; default regenerate.output)")
    # Defaults of the options below: the config's regenerate section (dflash.config.RegenerateConfig).
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="per assistant turn (default regenerate.max_new_tokens: 256 unless the config says)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default regenerate.temperature: 0)")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling mass, 1 = off (default regenerate.top_p: 1)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed, per row and turn (default regenerate.seed: 0)")
    p.add_argument("--limit", type=int, default=None,
                   help="read at most this many rows (default regenerate.limit, else data.max_conversations)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="conversations per generation batch (default regenerate.batch_size: 16 unless the config says)")
    p.add_argument("--max-turns", type=int, default=None,
                   help="regenerate at most this many assistant turns (default regenerate.max_turns: all)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="stop a conversation before a prompt this long "
                        "(default regenerate.max_prompt_tokens, else data.max_length)")
    p.add_argument("--attention", default=None,
                   help="the static-cache generator's decoding attention: sdpa, flex, matmul, reduce or X+Y (default "
                        "regenerate.attention, else the batch size's default); flex visits only the cache blocks a "
                        "row has written and uses one cache for every prompt length")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="wall-clock budget of this run in seconds, model loads included: then the workers stop "
                        "before their next round, the finished rows and the conversations in flight (cut after "
                        "their last turn: partial rows) are merged into the output and a later run continues "
                        "(default regenerate.max_seconds: no limit)")
    p.add_argument("--overwrite", action="store_true", help="delete an existing output and its shards first")
    p.add_argument("--gpus", type=_gpu_list, default=None,
                   help="comma-separated GPU ids, one worker each (default cluster.targets; on CPU: the worker count)")
    p.add_argument("--worker-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)  # the launcher's, epoch seconds
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    return p.parse_intermixed_args(argv)  # overrides may come before or after the options


def _options(args: argparse.Namespace, cfg: RunConfig) -> GenerationOptions:
    """The checked options of a command line; options not given are filled in ``args`` from the
    config's ``regenerate`` section (``--limit`` then from ``data.max_conversations``), also
    ``args.max_seconds`` (the time budget: not a generation option).

    Raises:
        ConfigError: an option out of range (named).
    """
    for key in ("max_new_tokens", "temperature", "top_p", "seed", "batch_size", "max_turns", "max_prompt_tokens",
                "limit", "attention", "max_seconds"):
        if getattr(args, key) is None:
            setattr(args, key, getattr(cfg.regenerate, key))
    if args.max_seconds is not None and not (math.isfinite(args.max_seconds) and args.max_seconds > 0):
        raise ConfigError(f"--max-seconds: must be a finite number of seconds > 0 (or leave it out: no limit), "
                          f"got {args.max_seconds}")
    if args.output is None:
        if not cfg.regenerate.output:
            raise ConfigError("--output: required (or regenerate.output in the config)")
        args.output = Path(cfg.regenerate.output)
    if args.limit is None:
        args.limit = cfg.data.max_conversations
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit: must be >= 1, got {args.limit}")
    options = GenerationOptions(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        batch_size=args.batch_size, max_turns=args.max_turns,
        max_prompt_tokens=args.max_prompt_tokens if args.max_prompt_tokens is not None else cfg.data.max_length,
        enable_thinking=cfg.data.enable_thinking, attention=args.attention)
    options.check()
    return options


def stage_workers(cfg: RunConfig) -> list[int]:
    """The regeneration stage's workers: every distinct GPU id of ``cluster.targets`` then
    ``cluster.drafters``, in that order (on CPU, the same count of processes)."""
    return list(dict.fromkeys(cfg.cluster.targets + cfg.cluster.drafters))


def run_stage(cfg: RunConfig, config_path: str | os.PathLike, overrides: list[str]) -> tuple[int, RunConfig]:
    """Regeneration as the first stage of training: regenerate ``data.dataset`` into
    ``regenerate.output`` when ``regenerate.enabled`` (greedy, or as the section says), then, when
    ``regenerate.sampled.output`` is set, a second time into that file with sampling; then hand
    back the training config.

    Each pass runs :func:`dflash.inference.regeneration.launcher.run_launcher` in this process with
    the ``regenerate`` section as its options (the sampled pass: with ``regenerate.sampled``'s
    temperature, top-p and seed) and one worker per GPU of :func:`stage_workers` (the workers read
    ``config_path`` with ``overrides``, as the caller did). Resumable like the command line: rows
    already in an output (or in a shard, or skipped) are not generated again, and a complete output
    starts no worker and loads no model. ``regenerate.max_seconds`` is the budget of both passes
    together, from this call on: the greedy pass gets all of it, the sampled pass what is left
    (none left: its workers stop before loading the model and its output, marked time-limited,
    holds no row; training goes on without it and the log says so).
    An output whose last run was stopped by its budget is then used as it is (no worker, no model:
    a resumed training run trains on the same data) and the log says how to continue it (the
    standalone command, :func:`dflash.inference.regeneration.launcher.continue_command`). Without
    ``regenerate.max_seconds`` such an output, or one left by Ctrl-C, is continued.

    Args:
        cfg: the validated run config.
        config_path / overrides: what ``cfg`` was loaded from (passed on to the workers).

    Returns:
        ``(exit code, config)``: :data:`EXIT_OK` and ``cfg`` with ``data.dataset`` = the greedy
        output, the sampled output (when it holds a row) appended to ``data.extra_datasets``, and
        ``regenerate.enabled`` false (what the training stage and its ``config.yaml`` read);
        otherwise the failing pass's launcher exit code
        (:func:`dflash.inference.regeneration.launcher.run_launcher`), or :data:`EXIT_CONFIG` when
        the greedy output holds no row (the log says why), and ``cfg`` unchanged. A disabled
        section returns ``(EXIT_OK, cfg)`` at once.
    """
    r = cfg.regenerate
    if not r.enabled:
        return EXIT_OK, cfg
    deadline = None if r.max_seconds is None else time.time() + r.max_seconds
    code, output = _stage_pass(cfg, config_path, overrides, r, "stage 1")
    if code != EXIT_OK:
        return code, cfg
    if not _holds_a_row(Path(output)):
        why = (f"the time budget (regenerate.max_seconds = {r.max_seconds!r} s) ran out before any conversation "
               f"was done: raise it, or continue the output with the command the launcher logged"
               if r.max_seconds is not None else f"every conversation was skipped ({output}.skipped says why)")
        log.error("stage 1: %s holds no regenerated row, nothing to train on: %s", output, why)
        return EXIT_CONFIG, cfg
    extra, more = list(cfg.data.extra_datasets), ""
    s = r.sampled
    if s.output is not None:
        turns = "" if s.max_turns is None else f", at most {s.max_turns} turn(s) a conversation"
        label = f"stage 1, sampled (temperature {s.temperature!r}, top-p {s.top_p!r}, seed {s.seed}{turns})"
        budget = None
        if deadline is not None:
            # what the greedy pass left, at least a token amount: with none left the launcher still
            # runs, its workers stop before loading the model, and the output it writes is marked
            # time-limited, so a resumed run reuses it as it is instead of sampling anew
            budget = round(max(deadline - time.time(), MIN_SAMPLED_PASS_S), 1)
            log.info("%s: %.1f s left of regenerate.max_seconds = %r s%s", label, budget, r.max_seconds,
                     "" if budget > MIN_SAMPLED_PASS_S else " (none: the pass stops at once)")
        code, sampled = _stage_pass(cfg, config_path, overrides, _sampled_section(r, budget), label,
                                    "regenerate.sampled")
        if code != EXIT_OK:
            return code, cfg
        if _holds_a_row(Path(sampled)):
            extra.append(sampled)
            more = f" (+ {sampled} as training-only extra data)"
        else:
            log.warning("%s: %s holds no row (the time budget ran out before any was done); training without "
                        "sampled rows", label, sampled)
    log.info("stage 2: training on %s%s", output, more)
    data = dataclasses.replace(cfg.data, dataset=output, extra_datasets=extra)
    return EXIT_OK, dataclasses.replace(cfg, data=data, regenerate=dataclasses.replace(r, enabled=False))


#: The least time budget the sampled pass gets, in seconds (0.1: the launcher's log rounds to it).
MIN_SAMPLED_PASS_S = 0.1


def _sampled_section(r: RegenerateConfig, max_seconds: Optional[float]) -> RegenerateConfig:
    """The ``regenerate`` section of the sampled pass: ``r`` with ``r.sampled``'s output,
    temperature, top-p, seed and turns (when set) and the time budget ``max_seconds`` (seconds;
    None = none)."""
    s = r.sampled
    turns = r.max_turns if s.max_turns is None else s.max_turns
    return dataclasses.replace(r, output=s.output, temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                               max_turns=turns, max_seconds=max_seconds)


def _holds_a_row(path: Path) -> bool:
    """Whether the JSONL ``path`` exists and has a non-blank line."""
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return any(line.strip() for line in f)


def _stage_pass(cfg: RunConfig, config_path: str | os.PathLike, overrides: list[str], r: RegenerateConfig,
                label: str, section: str = "regenerate") -> tuple[int, str]:
    """One pass of :func:`run_stage`: regenerate ``cfg.data.dataset`` into ``r.output`` with the
    options and the time budget (``r.max_seconds``) of the section ``r``, or reuse an output its
    budget stopped (with a budget). ``label`` starts its log lines;
    ``section``: the config section whose keys the launcher's errors name (``regenerate`` or
    ``regenerate.sampled``).

    Returns:
        ``(exit code, the output's absolute path)``; :data:`EXIT_CONFIG` for an option out of range.
    """
    argv = ["--config", str(config_path), "--output", str(r.output), *option_flags(r),
            "--gpus", ",".join(str(g) for g in stage_workers(cfg))]
    args = parse_args(argv + list(overrides))
    args.config_section = section
    output = str(Path(r.output).resolve())
    try:
        options = _options(args, cfg)
    except ConfigError as exc:
        log.error("config error: %s", exc)
        return EXIT_CONFIG, output
    last = time_limited_run(Path(output), cfg, options) if args.max_seconds is not None else None
    if last is not None:
        log.info("%s: %s is the output of a regeneration stopped by its time budget (%s rows, %s left); "
                 "regenerate.max_seconds is set, so the stage uses it as it is. Continue it with: %s", label, output,
                 last.get("rows"), last.get("rows_left"), continue_command(args, cfg))
        return EXIT_OK, output
    log.info("%s: regenerating %s into %s on %d worker(s)", label, cfg.data.dataset, r.output, len(args.gpus))
    return run_launcher(args, cfg, options), output


def main(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> int:
    """Entry point of the launcher (no ``--worker-rank``) and of each worker (internal flags);
    ``prog``: the command name ``--help`` shows."""
    args = parse_args(argv, prog)
    worker = args.worker_rank is not None
    name = f"regen.{args.worker_rank}" if worker else "regen"
    if worker:
        from dflash.runtime.control import set_parent_death_signal

        set_parent_death_signal(signal.SIGKILL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's: it stops the workers
    # leave through the finally blocks (a launcher's stops its workers)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    setup_logging(name)
    try:
        cfg = load_config(args.config, args.overrides)
        options = _options(args, cfg)
    except ConfigError as exc:
        log.error("config error: %s", exc)
        return EXIT_CONFIG
    setup_logging(name, cfg.log.level)
    output = Path(args.output).resolve()
    if worker:
        return run_worker(cfg, options, output, args.worker_rank, args.world, args.limit, args.gpus, args.deadline)
    return run_launcher(args, cfg, options)


if __name__ == "__main__":
    sys.exit(main())
