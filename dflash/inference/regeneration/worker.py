"""One regeneration worker process: load the target, regenerate the pending rows of its shard.

Started by :mod:`dflash.inference.regeneration.launcher` as ``python -m dflash.inference.regenerate
--worker-rank k --world N ...``. Worker k of N owns the rows whose ``sha256(id) mod N == k``
(:func:`dflash.inference.regeneration.rows.shard_of`), loads the target on ``cuda:<gpus[k]>`` (CPU:
cores / N torch threads; the training layout's ``cluster.cpu_threads_per_target`` is not used) and
appends finished rows to its shard (:class:`dflash.inference.regeneration.shards.ShardWriter`).
With ``--deadline EPOCH_S`` (the launcher's time budget) it stops once that wall-clock time has come:
before loading the model, or before its next generation round; it exits 0 and its stats say
``stopped_at_deadline``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from dflash.compile_watch import compile_counts
from dflash.config import RunConfig, resolve_device
from dflash.data.render import stop_token_ids
from dflash.inference.regeneration.generators import StaticGenerator, short_prompt_tokens_for
from dflash.inference.regeneration.jobs import GenerationOptions, prompt_chars, regenerate_rows
from dflash.inference.regeneration.rows import SourceRow, iter_source, shard_of
from dflash.inference.regeneration.shards import ShardWriter, done_ids, is_partial, shard_path
from dflash.inference.sampling import Sampling

__all__ = ["stats_path", "run_worker"]

log = logging.getLogger(__name__)


def stats_path(output: Path, rank: int) -> Path:
    """``<output>.rank<rank>.stats.json``: what worker ``rank`` did (written when it ends)."""
    shard = shard_path(output, rank)
    return shard.with_name(shard.name + ".stats.json")


def _cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _generate_shard(shard: ShardWriter, rows: list[SourceRow], generator: Any, tokenizer: Any,
                    options: GenerationOptions, stats: dict[str, Any], deadline: Optional[float] = None,
                    clock: Callable[[], float] = time.time) -> None:
    """Regenerate ``rows`` into ``shard`` until done or ``deadline`` (:func:`regenerate_rows`); count
    rows, new tokens and seconds into ``stats``; a progress line (rows, new tokens/s, the
    generator's prefill and decoding seconds where it times them, ETA) at least every 30 s."""
    from dflash.progress import Progress

    started = time.perf_counter()
    timings = getattr(generator, "timings", None)  # updated in place by the generator
    bar = Progress(len(rows), desc="regenerate", unit="row", logger=log)
    try:
        for records in regenerate_rows(rows, generator, tokenizer, options, deadline, clock):
            shard.append(records)
            partial = sum(is_partial(r) for r in records)
            stats["rows"] += len(records) - partial
            stats["partial_rows"] += partial
            stats["new_tokens"] += sum(sum(r["regen"].get("new_tokens", [])) for r in records)
            rate = stats["new_tokens"] / max(time.perf_counter() - started, 1e-9)
            split = (f" (prefill {timings['prefill_s']:.0f} s, decoding {timings['decode_s']:.0f} s)"
                     if timings else "")
            bar.update(stats["rows"], f"rows | {stats['new_tokens']} new tokens, {rate:.0f} new tok/s{split}")
    finally:
        bar.close()
    stats["generate_s"] = time.perf_counter() - started
    stats["tokens_per_s"] = round(stats["new_tokens"] / max(stats["generate_s"], 1e-9), 1)


def _split(stats: dict[str, Any], batch_size: int) -> str:
    """``"; prefill X s, decoding Y s, host Z s over N batches (F % full); C graphs compiled, R
    CUDA graphs recorded"`` when the generator timed its batches (the static-cache generator), else
    ``""``. A batch is full when it holds ``batch_size`` prompts (its cache's rows)."""
    if "prefill_s" not in stats:
        return ""
    host = stats["generate_s"] - stats["prefill_s"] - stats["decode_s"]
    batches = int(stats["batches"])
    full = 100 * stats.get("batch_rows", 0) / max(batches * batch_size, 1)
    return (f"; prefill {stats['prefill_s']:.1f} s, decoding {stats['decode_s']:.1f} s, tokenising and "
            f"bookkeeping {host:.1f} s over {batches} batches ({full:.0f} % full); {stats['compiles']} graphs "
            f"compiled, {stats['cudagraph_records']} CUDA graphs recorded")


def _device(cfg: RunConfig, rank: int, world: int, gpus: Optional[list[int]]) -> torch.device:
    """Worker ``rank``'s device: ``cuda:<gpus[rank]>`` (``gpus`` defaults to ``cluster.targets``), made
    current; or the CPU, with cores / ``world`` torch threads."""
    if resolve_device(cfg) == "cuda":
        gpu = (gpus or cfg.cluster.targets)[rank]
        torch.cuda.set_device(gpu)
        return torch.device("cuda", gpu)
    torch.set_num_threads(max(1, _cores() // world))
    return torch.device("cpu")


def _generator(cfg: RunConfig, options: GenerationOptions, rows: list[SourceRow], device: torch.device,
               tokenizer: Any) -> StaticGenerator:
    """Load the target on ``device`` and wrap it in a :class:`StaticGenerator`, greedy or sampling
    at ``options``' temperature / top-p (``rows`` are sorted by first-prompt length, so that similar
    lengths share a batch and a cache)."""
    from dflash.models.target_loader import load_target

    model = load_target(cfg.target, device).model
    stop_ids = stop_token_ids(tokenizer, None if cfg.target.kind == "random" else model)
    sampling = Sampling(options.temperature, options.top_p) if options.temperature != 0 else None
    rows.sort(key=prompt_chars)
    compile = cfg.target.compile and device.type == "cuda"
    # Later turns' prompts hold the earlier turns: most of their batches go to the long cache.
    return StaticGenerator(model, stop_ids, len(tokenizer), min(options.batch_size, len(rows)),
                           options.max_prompt_tokens, options.max_new_tokens,
                           short_prompt_tokens=short_prompt_tokens_for(options.attention), compile=compile,
                           compile_long=compile and options.max_turns != 1, attention=options.attention,
                           sampling=sampling)


def _past(deadline: Optional[float], clock: Callable[[], float]) -> bool:
    """Whether ``deadline`` (None = none) has come."""
    return deadline is not None and clock() >= deadline


def run_worker(cfg: RunConfig, options: GenerationOptions, output: Path, rank: int, world: int,
               limit: Optional[int], gpus: Optional[list[int]] = None, deadline: Optional[float] = None,
               clock: Callable[[], float] = time.time) -> int:
    """One worker process: load the target, regenerate the pending rows of shard ``rank``, append them.

    Runs on ``cuda:<gpus[rank]>`` (``gpus`` defaults to ``cluster.targets``) or the CPU. Generation,
    greedy or sampled, goes through :class:`StaticGenerator` (one per worker, ``options.batch_size``
    rows). Logs a progress line (rows, new tokens/s, ETA)
    at least every 30 s and writes :func:`stats_path` (rows finished, ``partial_rows``, new tokens,
    seconds, new tokens/s, device, ``rows_left`` and ``stopped_at_deadline``) at the end. The
    shard's lock is held from before the shard is read until the end.

    Args:
        deadline: the launcher's time budget as a ``clock()`` time (seconds since the epoch; None =
            no limit). Once it has come the worker stops: before loading the model, or before its
            next generation round (the conversations in flight with a regenerated turn are written
            as partial rows, :func:`dflash.inference.regeneration.shards.is_partial`; a later run
            regenerates them whole). It then logs what it wrote and what it left (partial rows
            count as left), and its stats say ``stopped_at_deadline: true``.
        clock: the time compared with ``deadline`` (default :func:`time.time`; tests pass a fake one).

    Returns:
        0 when every row of the shard is written, or when the deadline stopped it.
    Raises:
        TimeoutError: the shard stays locked by another process.
    """
    from dflash.data.tokenizer import load_tokenizer

    device = _device(cfg, rank, world, gpus)
    with ShardWriter(shard_path(output, rank)) as shard:
        done = done_ids(output)
        rows = [r for r in iter_source(cfg.data.dataset, limit) if shard_of(r.id, world) == rank and r.id not in done]
        log.info("shard %d/%d on %s (%d torch threads): %d rows to regenerate", rank, world, device,
                 torch.get_num_threads(), len(rows))
        stats: dict[str, Any] = {"rank": rank, "device": str(device), "rows": 0, "partial_rows": 0, "new_tokens": 0,
                                 "load_s": 0.0,
                                 "generate_s": 0.0, "tokens_per_s": None}
        if rows and not _past(deadline, clock):
            started = time.perf_counter()
            tokenizer = load_tokenizer(cfg.target)
            generator = _generator(cfg, options, rows, device, tokenizer)
            stats["load_s"] = time.perf_counter() - started
            before = compile_counts()
            _generate_shard(shard, rows, generator, tokenizer, options, stats, deadline, clock)
            after = compile_counts()
            stats["compiles"] = after.compiles - before.compiles
            stats["cudagraph_records"] = after.cudagraph_records - before.cudagraph_records
            timings = getattr(generator, "timings", None)
            if timings:
                stats.update({k: round(v, 2) for k, v in timings.items()})
            log.info("shard %d: %d rows, %d new tokens in %.1f s (%.1f new tokens/s)%s", rank, stats["rows"],
                     stats["new_tokens"], stats["generate_s"], stats["tokens_per_s"],
                     _split(stats, getattr(generator, "batch_size", options.batch_size)))
        # regenerate_rows writes every row unless the deadline stopped it
        stats["rows_left"] = len(rows) - stats["rows"]
        stats["stopped_at_deadline"] = stats["rows_left"] > 0 and _past(deadline, clock)
        if stats["stopped_at_deadline"]:
            log.warning("shard %d: stopped at the time budget (--max-seconds): wrote %d rows, left %d of %d "
                        "(%d of them written as partial rows: in flight with the turns done so far; a later run "
                        "regenerates them whole)", rank, stats["rows"], stats["rows_left"], len(rows),
                        stats["partial_rows"])
        stats_path(output, rank).write_text(json.dumps(stats))
    return 0
