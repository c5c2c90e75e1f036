"""The regeneration launcher: start one worker per GPU, show progress over all of them, merge, report.

Holds ``<output>.lock`` (:func:`dflash.utils.file_lock`: one launcher per output) for the whole
run. Checks the options against ``<output>.regen.json`` (a restart continues only with the same
options, tokenizer and chat template), waits (bounded) for a previous run's workers to release
their shard locks, counts the rows still to do, and starts the workers through
:class:`dflash.runtime.supervisor.Supervisor` — separate processes (never a fork of a process
holding CUDA), each with a parent-death signal, so none outlives the launcher; their output goes
to ``<output>.rank<k>.log``. It polls the shards for progress (rows, new tokens/s, each worker's
rate) and the workers for their exit; when every worker has finished it merges the shards
(:func:`dflash.inference.regeneration.shards.merge_outputs`) and writes the run's report into
``<output>.regen.json``.

**Time budget** (``--max-seconds`` / ``regenerate.max_seconds``). The launcher takes one wall-clock
deadline when it starts (``time.time() + max_seconds``: model loads count) and hands it to every
worker (``--deadline EPOCH_S``); its progress line shows the budget left. A worker stops once the
deadline has come, before loading the model or before its next generation round (conversations in
flight with a regenerated turn are written as partial rows,
:func:`dflash.inference.regeneration.shards.is_partial`), and exits 0 saying so in its stats. When
rows are left *because* workers stopped there, the launcher still merges the finished and partial
rows into ``<output>``, records ``time_limited: true``, ``rows_left`` (partial rows included) and
``partial_rows`` in ``last_run``, says how to continue
(:func:`continue_command`) and returns :data:`EXIT_OK`; rows missing for any other reason are an
error. A round in flight at the deadline runs to its end, so a run overshoots its budget by up to
one round (plus the merge).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import signal
import time
from pathlib import Path
from typing import Any, Optional

from dflash.config import RegenerateConfig, RunConfig, SampledRegenerateConfig
from dflash.inference.regeneration.jobs import GenerationOptions
from dflash.inference.regeneration.rows import SourceRow, iter_source
from dflash.inference.regeneration.shards import (SHARD_INFIX, done_ids, existing_shards, is_partial, merge_outputs,
                                                  read_lines, shard_path, skipped_path, wait_for_shard_locks)
from dflash.progress import format_duration
from dflash.runtime.supervisor import Supervisor, WorkerProcess, WorkerSpec
from dflash.utils import LockTimeout, atomic_write_text, file_lock

__all__ = ["EXIT_OK", "EXIT_FAILED", "EXIT_CONFIG", "EXIT_INTERRUPTED", "RESUME_KEYS", "IDENTITY_KEYS",
           "option_flags", "continue_command", "time_limited_run", "run_launcher"]

log = logging.getLogger(__name__)

#: Exit codes of the launcher.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 128 + signal.SIGINT
#: The module every worker runs (the command line, with ``--worker-rank``).
WORKER_MODULE = "dflash.inference.regenerate"
#: Seconds between two polls of the shard files by the launcher (progress, worker exits).
POLL_S = 0.5
#: Seconds a worker gets to exit after SIGTERM before SIGKILL.
STOP_GRACE_S = 20.0
#: Options that must match for a restart to continue an existing output (never the time budget,
#: ``max_seconds``: it does not change what a row holds).
RESUME_KEYS = ("dataset", "target", "tokenizer", "enable_thinking", "max_new_tokens", "temperature", "top_p",
               "seed", "max_turns", "max_prompt_tokens")
#: The keys of :data:`RESUME_KEYS` that are options of the ``regenerate`` section (the rest name
#: the data, the target and its tokenizer).
RESUME_OPTION_KEYS = tuple(k for k in RESUME_KEYS if k in {f.name for f in dataclasses.fields(RegenerateConfig)})
#: The options ``regenerate.sampled`` sets for its pass (the rest are the ``regenerate`` section's).
_SAMPLED_KEYS = frozenset(f.name for f in dataclasses.fields(SampledRegenerateConfig))
#: Compared on a restart only when the previous run recorded them: what the tokenizer and its chat
#: template are (``dflash.training.checkpoint_identity.run_identity``), not only how they were named.
IDENTITY_KEYS = ("tokenizer.sha256", "chat_template.sha256")
#: Option flags of the command line taken from same-named attributes (always given / only when set).
VALUE_FLAGS = ("max_new_tokens", "temperature", "top_p", "seed", "batch_size")
OPTIONAL_FLAGS = ("limit", "max_turns", "max_prompt_tokens", "attention")


def option_flags(source: Any, budget: bool = True) -> list[str]:
    """The generation options of ``source`` (command-line arguments, or the config's ``regenerate``
    section: the same attribute names) as command-line flags; floats in ``repr`` (exact).
    ``budget``: also ``--max-seconds`` when ``source.max_seconds`` is set (workers get the launcher's
    deadline instead)."""
    argv: list[str] = []
    for key in VALUE_FLAGS:
        value = getattr(source, key)
        argv += [f"--{key.replace('_', '-')}", repr(value) if isinstance(value, float) else str(value)]
    for key in OPTIONAL_FLAGS:
        value = getattr(source, key)
        if value is not None:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    if budget and getattr(source, "max_seconds", None) is not None:
        argv += ["--max-seconds", repr(float(source.max_seconds))]
    return argv


def continue_command(args: argparse.Namespace, cfg: RunConfig) -> str:
    """The standalone command that continues ``args.output`` with the same options, workers and
    overrides and without a time budget (``regenerate.max_seconds=null`` added when the config sets
    one), as one shell-quoted line."""
    argv = ["python", "-m", WORKER_MODULE, "--config", str(args.config), "--output", str(args.output),
            *option_flags(args, budget=False)]
    if args.gpus is not None:
        argv += ["--gpus", ",".join(str(g) for g in args.gpus)]
    argv += list(args.overrides)
    if cfg.regenerate.max_seconds is not None:
        argv.append("regenerate.max_seconds=null")
    return shlex.join(argv)


def _worker_spec(args: argparse.Namespace, output: Path, rank: int, world: int,
                 deadline: Optional[float] = None) -> WorkerSpec:
    """How to start worker ``rank`` of ``world``: the launcher's command line (without its
    ``--max-seconds``) plus its rank and ``deadline`` (seconds since the epoch; None = none)."""
    argv = ["--config", str(args.config), "--output", str(args.output), *option_flags(args, budget=False),
            "--worker-rank", str(rank), "--world", str(world)]
    if args.gpus is not None:
        argv += ["--gpus", ",".join(str(g) for g in args.gpus)]
    if deadline is not None:
        argv += ["--deadline", repr(deadline)]
    shard = shard_path(output, rank)
    return WorkerSpec(f"regen.{rank}", "regen", rank, WORKER_MODULE, argv + list(args.overrides),
                      log_path=shard.with_name(shard.name + ".log"))


def _options_record(cfg: RunConfig, options: GenerationOptions) -> dict:
    """What an output was made with (``options`` in ``<output>.regen.json``), without the identity."""
    t = cfg.target
    return {
        "dataset": cfg.data.dataset,
        "target": {"kind": t.kind, "path": t.path, "arch": t.arch, "arch_overrides": t.arch_overrides,
                   "dtype": t.dtype, "seed": t.seed},
        "tokenizer": t.tokenizer,
        "enable_thinking": options.enable_thinking,
        "max_new_tokens": options.max_new_tokens,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "seed": options.seed,
        "max_turns": options.max_turns,
        "max_prompt_tokens": options.max_prompt_tokens,
    }


def time_limited_run(output: Path, cfg: RunConfig, options: GenerationOptions) -> Optional[dict]:
    """The report (``last_run`` of ``<output>.regen.json``) of ``output``'s last run when that run
    was stopped by its time budget (``time_limited``) and made with the options of ``cfg`` and
    ``options`` (:data:`RESUME_KEYS`); None otherwise: no output or sidecar, an unreadable sidecar,
    a complete, interrupted or running regeneration, or other options (the launcher then says which).
    Loads nothing (the tokenizer's identity is not compared)."""
    sidecar = output.with_name(output.name + ".regen.json")
    if not output.is_file() or not sidecar.is_file():
        return None
    try:
        record = json.loads(sidecar.read_text())
    except (OSError, ValueError):
        return None
    last = record.get("last_run") if isinstance(record, dict) else None
    if not isinstance(last, dict) or not last.get("time_limited"):
        return None
    previous, wanted = record.get("options") or {}, _options_record(cfg, options)
    if any(previous.get(k) != wanted.get(k) for k in RESUME_KEYS):
        return None
    return last


def _stats_files(output: Path) -> list[Path]:
    """Every worker's ``<output>.rank<k>.stats.json`` on disk."""
    return list(output.parent.glob(output.name + SHARD_INFIX + "*.stats.json"))


def run_launcher(args: argparse.Namespace, cfg: RunConfig, options: GenerationOptions) -> int:
    """Start one worker per ``--gpus`` entry (default ``cluster.targets``), show progress, merge the shards.

    With ``args.max_seconds`` (seconds), the run's deadline is ``time.time() + args.max_seconds``
    taken here; when it stops the workers with rows left, the finished rows are merged anyway and
    the run counts as done (this module's docstring, Time budget).

    Returns:
        :data:`EXIT_OK` (also when the time budget left rows: ``last_run.time_limited`` says so),
        :data:`EXIT_FAILED` (a worker failed, rows missing; shards are kept for a restart),
        :data:`EXIT_CONFIG` (options differ from the existing output's, output locked) or
        :data:`EXIT_INTERRUPTED` (Ctrl-C; finished rows are kept).
    """
    deadline = None if args.max_seconds is None else time.time() + args.max_seconds
    output = Path(args.output).resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    lock = file_lock(output.with_name(output.name + ".lock"))
    try:
        lock.acquire(timeout=0)
    except LockTimeout:
        log.error("%s is being regenerated by another launcher", output)
        return EXIT_CONFIG
    try:
        return _launch_locked(args, cfg, options, output, deadline)
    finally:
        lock.release()


def _wanted_options(args: argparse.Namespace, cfg: RunConfig, options: GenerationOptions, output: Path) -> dict | None:
    """The options record of this run (with the tokenizer's identity), after ``--overwrite`` has
    deleted an existing output; None (logged) when the existing output was made with other options."""
    from dflash.data.tokenizer import load_tokenizer
    from dflash.training.checkpoint_identity import run_identity

    sidecar = output.with_name(output.name + ".regen.json")
    wanted = _options_record(cfg, options)
    identity = run_identity(load_tokenizer(cfg.target))
    wanted.update({k: identity[k] for k in IDENTITY_KEYS})
    if args.overwrite:
        for path in [output, sidecar, skipped_path(output), *existing_shards(output)]:
            path.unlink(missing_ok=True)
    if sidecar.is_file():
        previous = json.loads(sidecar.read_text()).get("options", {})
        diff = [k for k in RESUME_KEYS if previous.get(k) != wanted.get(k)]
        diff += [k for k in IDENTITY_KEYS if k in previous and previous[k] != wanted[k]]
        if diff:
            section = getattr(args, "config_section", None)
            if section is None:
                name, fix = diff[0], "pass --overwrite or choose another --output"
            else:  # the training stage: name the config keys
                sampled = section == "regenerate.sampled" and diff[0] in _SAMPLED_KEYS
                name = f"{section if sampled else 'regenerate'}.{diff[0]}" if diff[0] in RESUME_OPTION_KEYS \
                    else diff[0]
                fix = f"delete it (and its {sidecar.name}) or set another {section}.output"
            log.error("%s was made with other options (%s: %s, now %s): %s", output, name, previous.get(diff[0]),
                      wanted.get(diff[0]), fix)
            return None
    elif output.exists() or existing_shards(output):
        log.warning("%s has no %s: continuing it, assuming the same options", output, sidecar.name)
    return wanted


def _launch_locked(args: argparse.Namespace, cfg: RunConfig, options: GenerationOptions, output: Path,
                   deadline: Optional[float] = None) -> int:
    """:func:`run_launcher` once ``<output>.lock`` is held; ``deadline``: the time budget's end
    (seconds since the epoch; None = no limit)."""
    started = time.monotonic()
    sidecar = output.with_name(output.name + ".regen.json")
    wanted = _wanted_options(args, cfg, options, output)
    if wanted is None:
        return EXIT_CONFIG
    wait_for_shard_locks(output)  # a previous launcher's workers may still be exiting
    for stale in _stats_files(output):
        stale.unlink()

    dropped: dict[str, int] = {}
    source = list(iter_source(cfg.data.dataset, args.limit, dropped))
    done = done_ids(output)
    pending = [r for r in source if r.id not in done]
    reasons = ", ".join(f"{k}={v}" for k, v in sorted(dropped.items())) or "none"
    log.info("%s: %d usable rows (dropped %d: %s); %d already done, %d to regenerate", cfg.data.dataset,
             len(source), sum(dropped.values()), reasons, len(source) - len(pending), len(pending))
    if deadline is not None and pending:
        log.info("time budget: %s s (--max-seconds / regenerate.max_seconds), %s left", repr(args.max_seconds),
                 format_duration(max(deadline - time.time(), 0.0)))
    atomic_write_text(sidecar, json.dumps({"options": wanted}, indent=1))

    world = len(args.gpus or cfg.cluster.targets)
    code = _run_workers(args, output, world, len(pending), deadline)
    if code != EXIT_OK:
        return code
    summary = _merge_and_report(output, source, dropped, len(pending), world)
    if summary is None:
        return EXIT_FAILED
    summary["wall_s"] = round(time.monotonic() - started, 2)
    summary["max_seconds"] = args.max_seconds
    atomic_write_text(sidecar, json.dumps({"options": wanted, "last_run": summary}, indent=1))
    _log_summary(output, summary, reasons)
    if summary["time_limited"]:
        log.warning("the time budget (--max-seconds / regenerate.max_seconds = %s s) ran out: %d conversations "
                    "done in this run (regenerated or skipped), %d left; %s holds the %d regenerated rows, %d of "
                    "them partial (the turns done when the budget ran out; regenerated whole by a later run; "
                    "skips: <output>.skipped). Continue with: %s",
                    repr(args.max_seconds), summary["regenerated_now"], summary["rows_left"], output,
                    summary["rows"], summary["partial_rows"], continue_command(args, cfg))
    elif summary["partial_rows"]:
        log.warning("%s holds %d partial rows (conversations cut by an earlier run's time budget) that this run "
                    "did not regenerate: they lie outside its rows (--limit / regenerate.limit). A run over "
                    "them replaces them with whole rows; the training stage trains on them as they are",
                    output, summary["partial_rows"])
    return EXIT_OK


def _run_workers(args: argparse.Namespace, output: Path, world: int, pending: int,
                 deadline: Optional[float] = None) -> int:
    """Start ``world`` workers (with ``deadline``, seconds since the epoch) when ``pending`` rows
    remain; poll their shards (progress, budget left) and their exits until all have finished
    (:data:`EXIT_OK`, also when the deadline stopped them), one has failed (:data:`EXIT_FAILED`,
    its log's tail shown) or Ctrl-C (:data:`EXIT_INTERRUPTED`); the workers are stopped in every case."""
    from dflash.progress import Progress

    supervisor = Supervisor(output.parent, emit=lambda line: None)  # worker output: its log file only
    workers: list[WorkerProcess] = []
    progress = _ShardProgress(output, world, deadline)
    bar = Progress(pending, desc="regenerate", unit="row")  # a live line, or a log line every 30 s
    exit_code = EXIT_OK
    try:
        if pending:
            for k in range(world):
                workers.append(supervisor.start(_worker_spec(args, output, k, world, deadline)))
                log.info("regen.%d logs to %s", k, workers[-1].log_path)
        while workers:
            codes = [w.returncode() for w in workers]
            progress.poll()
            if progress.rows < pending or progress.rows != bar.n:  # once complete, one line (workers exiting)
                bar.update(progress.rows, progress.text())
            failed = [w for w, c in zip(workers, codes) if c not in (None, 0)]
            if failed:
                failed[0].wait(0.0)  # its output read to the end
                log.error("%s", supervisor.report(failed[0]))
                exit_code = EXIT_FAILED
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(POLL_S)  # polling the shard files and the workers
    except KeyboardInterrupt:
        log.error("interrupted: stopping the workers (finished rows are kept; run again to continue)")
        exit_code = EXIT_INTERRUPTED
    finally:
        bar.close()
        supervisor.stop_all(exit_s=0.0, grace_s=STOP_GRACE_S)
    return exit_code


class _ShardProgress:
    """Rows and new tokens appended to each worker's shard since the launcher started (read
    incrementally from each shard's last complete line); ``deadline``: the time budget's end
    (seconds since the epoch, :func:`time.time`; None = no limit)."""

    def __init__(self, output: Path, world: int, deadline: Optional[float] = None) -> None:
        self.paths = [shard_path(output, k) for k in range(world)]
        self.offsets = [read_lines(path)[1] for path in self.paths]
        self.new_tokens = [0] * world
        self.rows = 0
        self.started = time.monotonic()
        self.deadline = deadline

    def poll(self) -> None:
        """Read the lines appended since the last poll."""
        for k, path in enumerate(self.paths):
            records, self.offsets[k], _ = read_lines(path, self.offsets[k])
            for r in records:
                meta = r.get("regen") if isinstance(r.get("regen"), dict) else {}
                self.new_tokens[k] += sum(meta.get("new_tokens", []) or [])
            self.rows += sum(not is_partial(r) for r in records)  # a partial row is not done

    def text(self) -> str:
        """The progress line's tail: new tokens/s over all workers and per worker."""
        elapsed = max(time.monotonic() - self.started, 1e-9)
        per_worker = ", ".join(f"regen.{k} {n / elapsed:.0f}" for k, n in enumerate(self.new_tokens))
        return f"rows | {sum(self.new_tokens) / elapsed:.0f} new tok/s ({per_worker}){self.budget()}"

    def budget(self) -> str:
        """``", budget left 4:10"`` (or that it is spent), ``""`` without a deadline."""
        if self.deadline is None:
            return ""
        left = self.deadline - time.time()
        if left <= 0:
            return ", time budget spent: workers stop before their next round"
        return f", budget left {format_duration(left)}"


def _merge_and_report(output: Path, source: list[SourceRow], dropped: dict[str, int], pending: int,
                      world: int) -> dict | None:
    """Collect the workers' stats, check every source row is done, merge the shards; the run's
    summary (``last_run`` of ``<output>.regen.json``, without ``wall_s`` and ``max_seconds``), or
    None (logged) when rows are missing (the shards are then kept).

    Rows left by workers that stopped at the time budget (their stats: ``stopped_at_deadline``,
    ``rows_left``) are not missing: when they are exactly the rows not done, the finished rows are
    merged and the summary says ``time_limited: true`` and ``rows_left``."""
    stats = []
    for path in _stats_files(output):
        stats.append(json.loads(path.read_text()))
        path.unlink()
    stats.sort(key=lambda st: st.get("rank", 0))
    finished = done_ids(output)  # one read of the output and the shards (not one per row)
    remaining = [r.id for r in source if r.id not in finished]
    time_limited = any(st.get("stopped_at_deadline") for st in stats)
    left_by_workers = sum(st.get("rows_left") or 0 for st in stats if st.get("stopped_at_deadline"))
    if remaining and not (time_limited and left_by_workers == len(remaining)):
        explained = f", {left_by_workers} of them left at the time budget" if time_limited else ""
        log.error("%d rows were not written (first: %s)%s; shards kept", len(remaining), remaining[0], explained)
        return None
    report = merge_outputs(output)
    tokens = sum(s["new_tokens"] for s in stats)
    gen_s = max((s["generate_s"] for s in stats), default=0.0)
    return {
        "rows_read": len(source) + sum(dropped.values()), "dropped": dropped, "rows": report.rows,
        "skipped": report.skipped, "duplicates": report.duplicates, "bad_lines": report.bad_lines,
        "regenerated_now": pending - len(remaining), "new_tokens_now": tokens, "generate_s": round(gen_s, 2),
        "tokens_per_s": round(tokens / gen_s, 1) if gen_s > 0 else None,
        "wall_s": None, "workers": world, "time_limited": bool(remaining), "rows_left": len(remaining),
        "partial_rows": report.partial,
        "per_worker": [{k: st.get(k) for k in ("rank", "device", "rows", "partial_rows", "new_tokens", "load_s",
                                               "generate_s", "tokens_per_s", "prefill_s", "decode_s", "batches",
                                               "batch_rows", "compiles", "cudagraph_records", "rows_left",
                                               "stopped_at_deadline")}
                       for st in stats],
    }


def _log_summary(output: Path, summary: dict, reasons: str) -> None:
    """The run's final log lines: the output, then each worker's rate."""
    skipped = ", ".join(f"{k}={v}" for k, v in sorted(summary["skipped"].items())) or "none"
    log.info("wrote %d rows to %s (skipped: %s; dropped by the reader: %s; duplicates %d); this run: %d rows, "
             "%d new tokens, %.1f tokens/s over %d worker(s) (generation %.1f s, wall %.1f s)", summary["rows"], output,
             skipped, reasons, summary["duplicates"], summary["regenerated_now"], summary["new_tokens_now"],
             summary["tokens_per_s"] or 0.0, summary["workers"], summary["generate_s"], summary["wall_s"])
    for st in summary["per_worker"]:
        log.info("regen.%s on %s: %d rows, %d new tokens, %.1f new tokens/s (load %.1f s, generation %.1f s)",
                 st.get("rank"), st.get("device"), st.get("rows") or 0, st.get("new_tokens") or 0,
                 st.get("tokens_per_s") or 0.0, st.get("load_s") or 0.0, st.get("generate_s") or 0.0)
