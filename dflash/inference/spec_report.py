"""The report of the speculative-decoding check: decode held-out prompts target-only and
speculatively, compare the outputs, take the measured τ apart, and format it all as text.

:func:`decode_report` is the check's core (the CLI :mod:`dflash.inference.speculative` and
``scripts/decode_bench.py`` run it): the outputs are compared by the margin rule of
:mod:`dflash.inference.lossless`, τ is measured per pass and compared with the offline τ of
:mod:`dflash.inference.acceptance`; :func:`format_report` renders the result.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from dflash.inference.acceptance import Walk, conditional_acceptance, measured_per_position, offline_tau, walk_tau
from dflash.inference.decode_steps import CUDA_GRAPHS
from dflash.inference.generation import PASS_SCHEDULES, Generation, Generator
from dflash.inference.lossless import first_difference
from dflash.inference.oracle import naive_greedy_decode
from dflash.inference.prompts import PromptCase
from dflash.inference.tau_stats import standard_error
from dflash.progress import Progress
from dflash.utils import count_noun

__all__ = ["decode_report", "default_length_bucket", "format_report", "length_buckets", "prompt_digest", "rates_text",
           "repeats_phrase", "set_summaries", "LENGTH_BUCKET", "POOLED", "WARMUP_TOKENS"]

log = logging.getLogger(__name__)

#: Tokens generated (and thrown away) by each decoder once before timing: first-call
#: allocations and, on CUDA, compilation and graph capture do not count.
WARMUP_TOKENS = 16
#: Length buckets of the eager decoders (tokens; :func:`length_buckets`).
LENGTH_BUCKET = 256
#: At most this many decoders (compiled step sets) per report.
MAX_BUCKETS = 4
#: Progress: a log line this often (s) when stderr is not a terminal.
PROGRESS_LOG_S = 10.0
#: The name of the pooled row of :func:`set_summaries`.
POOLED = "pooled"


def _batches(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _pooled(gens: Sequence[Generation], groups: Sequence[Sequence[int]]) -> dict[str, float]:
    """Tokens/s and time split over prompts decoded in ``groups`` (batches of indices into ``gens``;
    a batch's time counted once): whole seconds, prefill, decoding loop (the reference benchmark's
    clock), device time of drafting and verification, host time enqueuing the loop's work."""
    tokens = sum(len(g.tokens) for g in gens)

    def total(key: str) -> float:
        return sum(getattr(gens[grp[0]], key) for grp in groups)

    seconds, draft, verify = total("seconds"), total("draft_seconds"), total("verify_seconds")
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds if seconds else float("nan"),
            "draft_s": draft, "verify_s": verify, "host_s": max(0.0, seconds - draft - verify),
            "prefill_s": total("prefill_seconds"), "decode_s": total("decode_seconds"),
            "enqueue_s": total("enqueue_seconds")}


def _speedups(target: dict[str, float], spec: dict[str, float]) -> dict[str, float]:
    """``speedup`` (whole seconds) and ``speedup_decode`` (the decoding loops alone) of two
    :func:`_pooled` results, target-only over speculative (NaN where the speculative time is 0)."""
    return {name: target[key] / spec[key] if spec[key] else float("nan")
            for name, key in (("speedup", "seconds"), ("speedup_decode", "decode_s"))}


def _per_response(rows: Sequence[dict[str, Any]], key: str) -> float:
    """Mean over responses of ``row[key]`` (rows without a value, or with NaN, skipped; NaN when none
    has one): the reference benchmark's average, each response's τ first, then their mean
    (z-lab/dflash ``dflash/benchmark.py``, ``_print_decode_summary``), where the pooled τ weights
    every pass alike."""
    vals = [r[key] for r in rows if r.get(key) is not None and not math.isnan(r[key])]
    return sum(vals) / len(vals) if vals else float("nan")


def _mean_ratio(rows: Sequence[dict[str, Any]], num: Callable[[dict[str, Any]], float],
                den: Callable[[dict[str, Any]], float]) -> float:
    """Mean over ``rows`` with ``den(row) > 0`` of ``num(row) / den(row)``; NaN when none has one."""
    kept = [r for r in rows if den(r)]
    return sum(num(r) / den(r) for r in kept) / len(kept) if kept else float("nan")


def _tpot(rows: Sequence[dict[str, Any]], seconds: str, tokens: str, decoded: bool = False) -> float:
    """Mean over ``rows`` with tokens of ``row[seconds] / row[tokens]`` (s), NaN when none has any.
    ``decoded``: only rows whose decoding loop ran (more than the prefill's one token); a loop that
    decoded nothing has no time per token."""
    least = 2 if decoded else 1
    return _mean_ratio(rows, lambda r: r[seconds], lambda r: r[tokens] if r[tokens] >= least else 0)


def _per_pass(rows: Sequence[dict[str, Any]], *seconds: str) -> float:
    """Mean over ``rows`` with verification passes of ``Σ row[k] for k in seconds`` over the row's
    passes (``len(row["accepted"])``), s; NaN when none has a pass or a row lacks a key."""
    if any(k not in r for r in rows if r["accepted"] for k in seconds):
        return float("nan")
    return _mean_ratio(rows, lambda r: sum(r[k] for k in seconds), lambda r: len(r["accepted"]))


def _set_summary(name: str, rows: Sequence[dict[str, Any]], block_size: Optional[int]) -> dict[str, Any]:
    """One row of :func:`set_summaries` over ``rows``."""
    accepted = [a for r in rows for a in r["accepted"]]
    # each side over its own tokens: at a numerical tie the two outputs may differ in length; the
    # decoding loops over responses that had one after the prefill (its token is the prefill's)
    target_tpot = _tpot(rows, "target_decode_s", "target_new_tokens", decoded=True)
    spec_tpot = _tpot(rows, "spec_decode_s", "new_tokens", decoded=True)
    target_e2e = _tpot(rows, "target_s", "target_new_tokens")
    spec_e2e = _tpot(rows, "spec_s", "new_tokens")
    return {"set": name, "prompts": len(rows), "identical": sum(r["result"] == "identical" for r in rows),
            "ties": sum(r["result"] == "tie" for r in rows), "failures": sum(r["result"] == "FAIL" for r in rows),
            "new_tokens": sum(r["new_tokens"] for r in rows), "verification_steps": len(accepted),
            "tau": sum(accepted) / len(accepted) if accepted else float("nan"),
            "tau_per_response": _per_response(rows, "tau"), "tau_per_response_se": standard_error(r.get("tau") for r in rows),
            "accept_conditional": conditional_acceptance(accepted, block_size) if block_size else [],
            "target_ms_per_token": 1e3 * target_tpot, "spec_ms_per_token": 1e3 * spec_tpot,
            "speedup": target_tpot / spec_tpot if spec_tpot > 0 else float("nan"),
            "target_ms_per_token_end_to_end": 1e3 * target_e2e, "spec_ms_per_token_end_to_end": 1e3 * spec_e2e,
            "speedup_end_to_end": target_e2e / spec_e2e if spec_e2e > 0 else float("nan"),
            "spec_ms_per_pass": 1e3 * _per_pass(rows, "spec_decode_s"),
            "spec_device_ms_per_pass": 1e3 * _per_pass(rows, "draft_s", "verify_s")}


def set_summaries(rows: Sequence[dict[str, Any]], block_size: Optional[int] = None
                  ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per prompt set (in the order the rows first name them) and pooled over all rows: prompts,
    identical / tie / FAIL, τ pooled (Σ τ / Σ passes) and per response (:func:`_per_response`) with
    the standard error of the latter over the responses (``tau_per_response_se``,
    :func:`dflash.inference.tau_stats.standard_error`), with ``block_size`` the conditional
    acceptance of each draft position (``accept_conditional``,
    :func:`dflash.inference.acceptance.conditional_acceptance`; empty without), the
    mean time per output token both ways and the speedup as their ratio, target-only over
    speculative, as the reference benchmark takes them: each response's decoding time (the clock
    starting once the prefill's first token is on the host, z-lab/dflash ``dflash/model.py``,
    ``dflash_generate``) over its output tokens (the prefill's first token counted), then the mean
    over responses (``dflash/benchmark.py``, ``_print_decode_summary``); ms. Beside them the same
    with the prefill and the reading of the results counted (``*_end_to_end``). Each side divides
    by its own tokens. And the mean over responses of a verification pass's time (a response's
    decoding time over its passes, ``spec_ms_per_pass``; its drafting and verification on the
    device, ``spec_device_ms_per_pass``: the rest is the GPU waiting for the host), to set beside a
    target-only token. At batch > 1 a response's seconds are its batch's.

    Args:
        rows: :func:`decode_report`'s ``prompts`` rows (``set``, ``result``, ``accepted``, ``tau``,
            ``new_tokens``, ``target_new_tokens``, ``target_s``, ``spec_s``, ``target_decode_s``,
            ``spec_decode_s``, ``draft_s``, ``verify_s``; without the last two the device time a
            pass is NaN).
        block_size: the drafter's ``B``, for ``accept_conditional``.

    Returns:
        ``(per set, pooled)``; the pooled row's ``set`` is :data:`POOLED`.
    """
    names = list(dict.fromkeys(r["set"] for r in rows))
    return ([_set_summary(n, [r for r in rows if r["set"] == n], block_size) for n in names],
            _set_summary(POOLED, rows, block_size))


def _continuation(case: PromptCase, gen: Generation) -> tuple[Tensor, Tensor]:
    """``(input_ids [P + N], loss_mask [P + N])``: the prompt followed by a decode's ``N`` tokens,
    the loss mask on the decoded tokens only."""
    ids = torch.cat([case.prompt_ids, torch.tensor(gen.tokens, dtype=torch.long)])
    mask = torch.zeros(ids.numel(), dtype=torch.bool)
    mask[case.prompt_ids.numel():] = True
    return ids, mask


def length_buckets(lengths: Sequence[int], bucket: int, max_buckets: int = MAX_BUCKETS) -> list[int]:
    """Each length rounded up to its bucket: a multiple of ``bucket`` tokens, with the multiple
    doubled until at most ``max_buckets`` distinct buckets remain (each one is a compiled decoder
    of its own). ``bucket = 0``: every length gets the largest (one decoder).

    Args:
        lengths: the positions each prompt needs (prompt + new tokens + block + 1).
        bucket: granularity in tokens (``>= 0``).
        max_buckets: at most this many distinct results (``>= 1``).

    Raises:
        ValueError: a negative ``bucket`` or ``max_buckets < 1``.
    """
    if bucket < 0 or max_buckets < 1:
        raise ValueError(f"length bucket {bucket} / max buckets {max_buckets}: need >= 0 / >= 1")
    if not lengths:
        return []
    if bucket == 0:
        return [max(lengths)] * len(lengths)
    while True:
        out = [-(-n // bucket) * bucket for n in lengths]
        if len(set(out)) <= max_buckets:
            return out
        bucket *= 2


def default_length_bucket(compiled: bool) -> int:
    """The length bucket when none is asked for: :data:`LENGTH_BUCKET` for eager decoders, 0 (one
    decoder sized for the longest prompt) for compiled ones. Every compiled decoder compiles and
    captures its own steps, since the static buffers' length is part of each graph: on an H200 with
    SmolLM2-135M that is ~90 s a decoder (4 decoders took 365 s), against seconds of decoding; what
    a smaller cache saves a token there is not measured."""
    return 0 if compiled else LENGTH_BUCKET


def _warm_generators(target: Any, drafter: nn.Module, cases: Sequence[PromptCase], max_new_tokens: int,
                     stop_ids: Sequence[int], batch: int, compile: Optional[bool], attention: Optional[str],
                     length_bucket: int, pass_schedule: str = "certain", draft_cache: bool = True,
                     cuda_graphs: str = CUDA_GRAPHS[0]) -> tuple[dict[int, Generator], list[int], float]:
    """A :class:`Generator` per length bucket of ``cases`` (:func:`length_buckets`), each run both
    ways for :data:`WARMUP_TOKENS` tokens (:meth:`Generator.warm_up`: compilation and graph capture
    on CUDA, repeated until every captured step has recorded its graph).

    Attention and the drafter's context read all ``max_len`` slots of a decoder's static buffers
    whatever the prompt, so a short prompt decodes faster in a smaller decoder, as it does in an
    engine that attends over the sequence's own length.

    Returns:
        ``(generators by max_len, each case's max_len, warm-up seconds)``.
    """
    b_sz = int(drafter.block_size)
    need = [c.prompt_ids.numel() + max(max_new_tokens, WARMUP_TOKENS) + b_sz + 1 for c in cases]
    sizes = length_buckets(need, length_bucket)
    sizes = [-(-n // 64) * 64 for n in sizes]
    gens: dict[int, Generator] = {}
    t0 = time.perf_counter()
    bar = Progress(2 * len(set(sizes)), desc="warm-up", unit="decoder pass", interval_s=PROGRESS_LOG_S, logger=log)
    for size in sorted(set(sizes)):
        gen = Generator(target.model, target.layer_ids, size, batch_size=batch, drafter=drafter, compile=compile,
                        attention=attention, pass_schedule=pass_schedule, draft_cache=draft_cache,
                        cuda_graphs=cuda_graphs)
        warm = [c.prompt_ids for c, n in zip(cases, sizes) if n == size][:batch]
        gen.warm_up(warm, WARMUP_TOKENS, stop_ids)
        bar.advance(2)
        gens[size] = gen
    bar.close()
    _warm_prompt_lengths(gens, sizes, cases, stop_ids, batch)
    warmup_s = time.perf_counter() - t0
    log.info("warm-up (%s) %.1f s for %d decoder(s) of %s positions", "compile + graph capture"
             if next(iter(gens.values())).compiled else "eager", warmup_s, len(gens), sorted(gens))
    return gens, sizes, warmup_s


#: New tokens of :func:`_warm_prompt_lengths`' decodes: the prefill and a step.
PREFILL_WARMUP_TOKENS = 2


def _warm_prompt_lengths(gens: dict[int, Generator], sizes: Sequence[int], cases: Sequence[PromptCase],
                         stop_ids: Sequence[int], batch: int) -> None:
    """Decode each prompt length once both ways (:data:`PREFILL_WARMUP_TOKENS` tokens) before the
    timed runs: at batch 1 one prompt of every (decoder, prompt length) pair, above it every batch
    as the timed runs make it (its shape depends on its prompts).

    The first prefill of a new length costs more than the next ones (measured on 1 × H100,
    bf16, compiled: 47 ms against 8 ms for SmolLM2-135M). Timed runs decode target-only first, so
    without this the target-only side alone would pay it, and a single run's time per token with
    the prefill counted would favour speculative decoding.
    """
    if batch == 1:
        first: dict[tuple[int, int], int] = {}
        for i, (case, size) in enumerate(zip(cases, sizes)):
            first.setdefault((size, case.prompt_ids.numel()), i)
        keep = sorted(first.values())
    else:
        keep = list(range(len(cases)))
    _decode_both(gens, [sizes[i] for i in keep], [cases[i] for i in keep], PREFILL_WARMUP_TOKENS, stop_ids, batch,
                 desc="warm-up: prompt lengths")


def _decode_both(gens: dict[int, Generator], sizes: Sequence[int], cases: Sequence[PromptCase], max_new_tokens: int,
                 stop_ids: Sequence[int], batch: int, methods: Sequence[str] = ("greedy", "speculative"),
                 desc: str = "decoding") -> tuple[list[Generation], list[Generation], list[list[int]]]:
    """``(target-only, speculative)`` generations of ``cases`` (in their order), ``batch`` prompts of
    one length bucket at a time, and those batches as lists of case indices; a method left out of
    ``methods`` gives an empty list."""
    groups = [grp for size in sorted(gens) for grp in _batches([i for i, n in enumerate(sizes) if n == size], batch)]
    base: list[Optional[Generation]] = [None] * len(cases) if "greedy" in methods else []
    spec: list[Optional[Generation]] = [None] * len(cases) if "speculative" in methods else []
    bar = Progress(len(methods) * len(cases) * max_new_tokens, desc=desc, unit="tok",
                   interval_s=PROGRESS_LOG_S, logger=log)
    for out, method in ((base, "greedy"), (spec, "speculative")):
        if method not in methods:
            continue
        for grp in groups:
            decode = getattr(gens[sizes[grp[0]]], method)
            for i, g in zip(grp, decode([cases[i].prompt_ids for i in grp], max_new_tokens, stop_ids,
                                        progress=bar.advance)):
                out[i] = g
            # the tokens a stop token spared and the first (from the prefill), so that the total is reached
            bar.advance(sum(max_new_tokens - max(0, len(out[i].tokens) - 1) for i in grp))
    bar.close()
    return base, spec, groups  # type: ignore[return-value]


def _decode_repeated(gens: dict[int, Generator], sizes: Sequence[int], cases: Sequence[PromptCase],
                     max_new_tokens: int, stop_ids: Sequence[int], batch: int, repeats: int,
                     methods: Sequence[str] = ("greedy", "speculative")
                     ) -> tuple[list[Generation], list[Generation], list[list[int]], dict[str, int]]:
    """:func:`_decode_both` ``repeats`` times (each time every method in turn, so a slow stretch of the
    machine falls on both); per batch and method, the run whose decoding time is the median (the
    lower of the two middle ones for an even count) is kept whole, its tokens and its times.

    Returns:
        ``(target-only, speculative, batches, differing)``; ``differing[method]`` counts the
        responses of later runs whose tokens differ from the first run's (0 when decoding is
        deterministic, as it is on one device with fixed shapes).
    """
    runs = [_decode_both(gens, sizes, cases, max_new_tokens, stop_ids, batch, methods,
                         desc="decoding" if repeats == 1 else f"decoding (run {k + 1}/{repeats})")
            for k in range(repeats)]
    groups = runs[0][2]
    picked: list[list[Generation]] = []
    differing: dict[str, int] = {}
    for m, method in enumerate(("greedy", "speculative")):
        if method not in methods:
            picked.append([])
            continue
        first = runs[0][m]
        differing[method] = sum(run[m][i].tokens != first[i].tokens for run in runs[1:] for i in range(len(cases)))
        out = list(first)
        for grp in groups:
            order = sorted(range(repeats), key=lambda k: runs[k][m][grp[0]].decode_seconds)
            keep = runs[order[(repeats - 1) // 2]][m]
            for i in grp:
                out[i] = keep[i]
        picked.append(out)
    for method, n in differing.items():
        if n:
            log.warning("%s decoding: %d response(s) of runs 2..%d differ from run 1's tokens (the median run's "
                        "tokens are reported)", method, n, repeats)
    return picked[0], picked[1], groups, differing


def prompt_digest(prompt_ids: Tensor) -> str:
    """A prompt's identity across runs: the first 16 hex digits of the sha256 of its token ids as
    int64 (two runs decoded the same prompt when, and only when, these are equal)."""
    return hashlib.sha256(prompt_ids.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:16]


def _prompt_row(case: PromptCase, t: Generation, s: Generation, num_layers: int, dtype: torch.dtype
                ) -> dict[str, Any]:
    """One prompt's row of the report: the comparison of ``s`` (speculative) with ``t``
    (target-only), τ, passes and timings; a difference is logged."""
    diff = first_difference(s, t, num_layers, dtype)
    row = {"set": case.prompt_set, "label": case.label, "index": case.index, "source_row": case.source_row,
           "prompt_tokens": case.prompt_ids.numel(), "prompt_sha256": prompt_digest(case.prompt_ids),
           "new_tokens": len(s.tokens), "result": "identical" if diff is None else
           ("tie" if diff.tie else "FAIL"), "difference": None if diff is None else vars(diff),
           "tau": s.tau, "steps": s.steps, "accepted": s.accepted, "anchors": s.anchors,
           "spec_tok_s": s.tokens_per_s, "target_tok_s": t.tokens_per_s,
           "spec_s": s.seconds, "target_s": t.seconds, "draft_s": s.draft_seconds,
           "verify_s": s.verify_seconds, "target_tokens": t.tokens, "target_new_tokens": len(t.tokens),
           "spec_decode_s": s.decode_seconds, "target_decode_s": t.decode_seconds,
           "spec_prefill_s": s.prefill_seconds, "target_prefill_s": t.prefill_seconds,
           "spec_enqueue_s": s.enqueue_seconds, "target_enqueue_s": t.enqueue_seconds}
    if diff is not None:
        (log.warning if diff.tie else log.error)(
            "prompt set %s, prompt %d: speculative output differs from target-only greedy at token %d (%d vs %d): "
            "margins z1-z2 %.4f (speculative) / %.4f (target-only), tie bound %.4f (logit spread %.2f): %s",
            case.prompt_set, case.index,
            diff.position, diff.spec_token, diff.target_token, diff.spec_margin, diff.target_margin, diff.bound,
            diff.spread,
            "a numerical tie" if diff.tie else "NOT a tie")
    return row


def _walk_own(target: Any, drafter: nn.Module, case: PromptCase, base: Generation, anchors: Tensor, taus: Tensor
              ) -> Walk:
    """The walk of decoding's anchors over ``base``'s text (:func:`dflash.inference.acceptance.walk_tau`,
    from the prompt length to the last generated token), each block accepting its offline τ.

    Decoding verifies its last block whole, past the text's end too. When the walk's last block
    is right up to the end of the text (``τ = 1 + end − a < B``), that block is scored again on
    the text continued by the target's greedy tokens up to ``a + B − 1``
    (:func:`dflash.inference.oracle.naive_greedy_decode`, stop tokens not stopping it), as the
    verification pass sees it; so in fp32 the walk counts what decoding counts, pass for pass.
    """
    p = case.prompt_ids.numel()
    end = p + len(base.tokens) - 1
    walk = walk_tau(anchors, taus, p, end)
    b = int(drafter.block_size)
    if not walk.passes or walk.accepted[-1] != 1 + end - walk.anchors[-1] or walk.accepted[-1] >= b:
        return walk
    a = walk.anchors[-1]
    ids, _ = _continuation(case, base)
    more = naive_greedy_decode(target.model, ids, a + b - 1 - end)
    longer = torch.cat([ids, torch.tensor(more, dtype=torch.long)])
    mask = torch.zeros(longer.numel(), dtype=torch.bool)
    mask[p:] = True
    last = offline_tau(target, drafter, [(longer, mask)], labels="target", anchors=[[a]])
    walk.accepted[-1] = int(last.per_anchor[0][1][0])
    return walk


def _add_offline(summary: dict[str, Any], rows: list[dict[str, Any]], target: Any, drafter: nn.Module,
                 cases: Sequence[PromptCase], base: Sequence[Generation], spec: Sequence[Generation],
                 labels: str) -> None:
    """Add the offline τ values (dataset, own continuation at every anchor and walked, replay) to
    ``summary`` and ``rows``, with progress (a sequence at a time). The walk (:func:`_walk_own`) runs
    over each prompt's target-only continuation and is pooled like the measured τ: Σ τ / Σ passes.
    The dataset's τ covers the prompts that have a dataset conversation (the held-out ones); the
    others' is ``None``."""
    tau = summary["tau"]
    with_data = [i for i, c in enumerate(cases) if c.input_ids is not None]
    bar = Progress(len(with_data) + 3 * len(cases), desc="offline tau", unit="sequence", interval_s=PROGRESS_LOG_S,
                   logger=log)
    data = offline_tau(target, drafter, [(cases[i].input_ids, cases[i].loss_mask) for i in with_data], labels=labels,
                       progress=bar.advance)
    own = offline_tau(target, drafter, [_continuation(c, t) for c, t in zip(cases, base)], labels="target",
                      progress=bar.advance)
    replay = offline_tau(target, drafter, [_continuation(c, s) for c, s in zip(cases, spec)], labels="target",
                         anchors=[s.anchors for s in spec], progress=bar.advance)
    walks = []
    for c, t, (anc, taus) in zip(cases, base, own.per_anchor):
        walks.append(_walk_own(target, drafter, c, t, anc, taus))
        bar.advance()
    bar.close()
    data_tau: list[Optional[float]] = [None] * len(cases)
    for i, value in zip(with_data, data.per_conversation):
        data_tau[i] = value
    for row, d, o, r, w in zip(rows, data_tau, own.per_conversation, replay.per_conversation, walks):
        row.update(offline_tau_dataset=d, offline_tau_own=o, offline_tau_replay=r, offline_tau_own_walk=w.tau,
                   offline_walk_steps=w.passes, offline_walk_anchors=w.anchors,
                   measured_over_offline_walk=row["tau"] / w.tau if w.passes else float("nan"))
    walk_passes = sum(w.passes for w in walks)
    walk = sum(w.total for w in walks) / walk_passes if walk_passes else float("nan")
    summary.update(offline_tau_dataset=data.tau, offline_tau_dataset_first_turn=data.first_turn_tau,
                   offline_tau_own=own.tau, offline_tau_replay=replay.tau, offline_blocks_own=own.blocks,
                   offline_blocks_replay=replay.blocks, per_position_offline_own=own.per_position,
                   per_position_offline_replay=replay.per_position,
                   per_position_offline_dataset=data.per_position,
                   measured_over_offline_own=tau / own.tau if own.tau else float("nan"),
                   offline_tau_own_walk=walk, offline_walk_steps=walk_passes,
                   measured_over_offline_walk=tau / walk if walk_passes else float("nan"))
    own_resp = _per_response(rows, "offline_tau_own")
    summary.update(offline_tau_own_per_response=own_resp,
                   offline_tau_own_walk_per_response=_per_response(rows, "offline_tau_own_walk"),
                   measured_over_offline_own_per_response=summary["tau_per_response"] / own_resp)


@torch.no_grad()
def _schedule_row(schedule: str, spec: Sequence[Generation], ref: Sequence[Generation], groups: Sequence[Sequence[int]],
                  rows: Sequence[dict[str, Any]], target: dict[str, float]) -> dict[str, Any]:
    """One row of the summary's ``pass_schedules``: speculative decoding's time under ``schedule``
    (``spec``, against the target-only times ``target`` (:func:`_pooled`) and the first schedule's
    outputs ``ref``)."""
    p = _pooled(spec, groups)
    sets, pooled = set_summaries(rows)
    return {"schedule": schedule, "checks": sum(spec[grp[0]].checks for grp in groups),
            "idle_checks": sum(spec[grp[0]].idle_checks for grp in groups),
            "passes": sum(g.steps for g in spec),
            "passes_enqueued": sum(spec[grp[0]].passes_enqueued for grp in groups),
            "same_tokens": sum(a.tokens == b.tokens for a, b in zip(spec, ref)),
            "spec_s": p["seconds"], "host_s": p["host_s"], "draft_s": p["draft_s"], "verify_s": p["verify_s"],
            "decode_s": p["decode_s"], "enqueue_s": p["enqueue_s"], **_speedups(target, p),
            "sets": {x["set"]: {"spec_ms_per_token": x["spec_ms_per_token"], "speedup": x["speedup"]}
                     for x in sets + [pooled]}}


def decode_report(target: Any, drafter: nn.Module, cases: Sequence[PromptCase], *, max_new_tokens: int,
                  stop_ids: Sequence[int], batch: int = 1, compile: Optional[bool] = None, offline: bool = True,
                  labels: str = "target", attention: Optional[str] = None, length_bucket: Optional[int] = None,
                  pass_schedules: Sequence[str] = ("certain",), repeats: int = 1,
                  draft_cache: bool = True, cuda_graphs: str = CUDA_GRAPHS[0]) -> dict[str, Any]:
    """Decode ``cases`` target-only and speculatively; compare; take τ apart. The check's core.

    Args:
        target: :class:`dflash.models.target.TargetModel` (its ``layer_ids`` are the drafter's).
        drafter: :class:`dflash.models.drafter.DFlashDraftModel`.
        cases: held-out prompts (:func:`dflash.inference.prompts.prompts_from_corpus`).
        max_new_tokens / stop_ids: per prompt.
        batch: prompts decoded together.
        compile: CUDA graphs (``None`` = on CUDA).
        offline: also compute the offline τ values (dataset, own continuation at every anchor and
            walked, replay).
        labels: offline τ labels on the dataset conversations (training's ``drafter.labels``).
        attention: the fused target layers' attention spec
            (:func:`dflash.inference.decode_layers.split_attention`; ``None``: by batch size,
            :func:`dflash.inference.decode_layers.default_attention`).
        length_bucket: prompts are decoded by a decoder sized to their length bucket
            (:func:`length_buckets`; 0 = one decoder sized for the longest), target-only and
            speculative alike; ``None``: :func:`default_length_bucket`.
        pass_schedules: speculative decoding's host-check schedules
            (:func:`dflash.inference.generation.passes_before_check`); the report is the first's,
            and each further one decodes the prompts speculatively again with the same warm
            generators, for its time alone (the summary's ``pass_schedules``, one row each).
        repeats: decode the prompts this many times each way and keep, per batch and way, the run
            with the median decoding time (:func:`_decode_repeated`): the timings of one run on a
            busy host scatter by tens of percent from prompt to prompt.
        draft_cache: draft from the drafter's context key/value cache (``False``: through its
            training forward; :class:`dflash.inference.decode_steps.DecodeSteps`).
        cuda_graphs: how compiled steps replay on CUDA
            (:data:`dflash.inference.decode_steps.CUDA_GRAPHS`; both ways alike).

    Returns:
        ``{"summary": {...}, "prompts": [...]}``: per prompt and pooled τ, tokens/s both ways,
        speedup, time split, the first difference and its margins, per-position acceptance; the
        summary's ``sets`` and ``sets_pooled``: :func:`set_summaries`; ``pass_schedules``: per
        schedule its host checks (all, and those where the GPU waited for the host), passes, outputs equal to the first schedule's, speculative
        seconds (host, draft, verify) and speedups (pooled, and per set as :func:`set_summaries`).

    The drafter's weights are cast in place to a half-precision target's dtype (it stays so after
    the call: :class:`dflash.inference.decode_steps.DecodeSteps`).

    Raises:
        ValueError: an empty or unknown ``pass_schedules`` entry, ``repeats < 1``.
    """
    if not pass_schedules or any(p not in PASS_SCHEDULES for p in pass_schedules):
        raise ValueError(f"pass_schedules: each of {PASS_SCHEDULES}, at least one; got {list(pass_schedules)}")
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats}")
    if length_bucket is None:
        device = next(target.model.parameters()).device
        length_bucket = default_length_bucket(compile if compile is not None else device.type == "cuda")
    gens, sizes, warmup_s = _warm_generators(target, drafter, cases, max_new_tokens, stop_ids, batch, compile,
                                             attention, length_bucket, pass_schedules[0], draft_cache,
                                             cuda_graphs)
    base, spec, groups, differing = _decode_repeated(gens, sizes, cases, max_new_tokens, stop_ids, batch, repeats)
    gen = next(iter(gens.values()))
    b_sz = int(drafter.block_size)
    dtype = target.dtype
    rows = [_prompt_row(case, t, s, gen.num_layers, dtype) for case, t, s in zip(cases, base, spec)]
    all_accepted = [a for s in spec for a in s.accepted]
    steps = len(all_accepted)
    tau = sum(all_accepted) / steps if steps else float("nan")
    ps, pt = _pooled(spec, groups), _pooled(base, groups)
    summary: dict[str, Any] = {
        "prompts": len(rows), "max_new_tokens": max_new_tokens, "block_size": b_sz, "batch": batch,
        "dtype": str(dtype).replace("torch.", ""), "compiled": gen.compiled, "attention": gen.attention,
        "drafting": type(gen.proposer).__name__,
        "cuda_graphs": gen.cuda_graphs if gen.compiled and gen.device.type == "cuda" else None,
        "decoder_lengths": sorted(gens),
        "device": str(gen.device),
        "identical": sum(r["result"] == "identical" for r in rows), "ties": sum(r["result"] == "tie" for r in rows),
        "failures": sum(r["result"] == "FAIL" for r in rows),
        "tau": tau, "tau_per_response": _per_response(rows, "tau"), "verification_steps": steps,
        "new_tokens": ps["tokens"],
        "spec_tok_s": ps["tok_s"], "target_tok_s": pt["tok_s"],
        **_speedups(pt, ps),
        "spec_s": ps["seconds"], "target_s": pt["seconds"], "draft_s": ps["draft_s"], "verify_s": ps["verify_s"],
        "host_s": ps["host_s"], "warmup_s": warmup_s,
        "spec_prefill_s": ps["prefill_s"], "target_prefill_s": pt["prefill_s"],
        "spec_decode_s": ps["decode_s"], "target_decode_s": pt["decode_s"],
        "spec_enqueue_s": ps["enqueue_s"], "target_enqueue_s": pt["enqueue_s"],
        "target_steps": sum(base[grp[0]].passes_enqueued for grp in groups),
        "passes_enqueued": sum(spec[grp[0]].passes_enqueued for grp in groups),
        "repeats": repeats, "repeat_differences": differing,
        "per_position_measured": measured_per_position(all_accepted, b_sz)}
    summary["sets"], summary["sets_pooled"] = set_summaries(rows, b_sz)
    summary["pass_schedules"] = [_schedule_row(pass_schedules[0], spec, spec, groups, rows, pt)]
    for schedule in pass_schedules[1:]:
        for g in gens.values():
            g.pass_schedule = schedule
        _, again, _, _ = _decode_repeated(gens, sizes, cases, max_new_tokens, stop_ids, batch, repeats,
                                          methods=("speculative",))
        again_rows = [_prompt_row(case, t, s2, gen.num_layers, dtype) for case, t, s2 in zip(cases, base, again)]
        summary["pass_schedules"].append(_schedule_row(schedule, again, spec, groups, again_rows, pt))
    for g in gens.values():
        g.pass_schedule = pass_schedules[0]
    if offline:
        _add_offline(summary, rows, target, drafter, cases, base, spec, labels)
    return {"summary": summary, "prompts": rows}


def _with_se(x: dict[str, Any]) -> str:
    """``τ per response (SE)`` of a :func:`set_summaries` row."""
    return f"{_fmt(x['tau_per_response'], 3)} ({_fmt(x.get('tau_per_response_se'), 2)})"


def rates_text(rates: Optional[Sequence[float]], first: int = 4) -> str:
    """The first ``first`` rates (fractions) as percentages, ``54 / 52 / 55 / 51 %``; ``–`` without any."""
    if not rates:
        return "–"
    return " / ".join("–" if math.isnan(r) else f"{100 * r:.0f}" for r in rates[:first]) + " %"


def _fmt(x: Optional[float], digits: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def repeats_phrase(repeats: int) -> str:
    """``"median of 3 runs"`` (``"lower median of 4 runs"`` for an even count: the faster middle
    run, :func:`_decode_repeated`; ``"one run"`` for 1)."""
    if repeats == 1:
        return "one run"
    return f"{'lower ' if repeats % 2 == 0 else ''}median of {repeats} runs"


def _times(x: Optional[float]) -> str:
    """``1.23x``; ``–`` for None or NaN (:func:`_fmt`)."""
    text = _fmt(x, 2)
    return text if text == "–" else text + "x"


def _ms_each(seconds: float, count: int) -> str:
    """``seconds`` over ``count`` in ms (3 decimals), ``–`` when there is nothing to divide by."""
    return _fmt(1e3 * seconds / count, 3) if count else "–"


def format_report(report: dict[str, Any], show_text: bool = False) -> str:
    """The report of :func:`decode_report` as text: a row per prompt, pooled lines, per-position acceptance."""
    s, rows = report["summary"], report["prompts"]
    sets = s.get("sets") or []
    counts = ", ".join(f"{x['set']} {x['prompts']}" for x in sets)
    lines = [f"{count_noun(s['prompts'], 'prompt')}{f' ({counts})' if counts else ''}, "
             f"max {s['max_new_tokens']} new tokens, "
             f"B={s['block_size']}, "
             f"batch {s['batch']}, {s['dtype']}, {'compiled' if s['compiled'] else 'eager'}, {s['device']}, "
             f"attention {s.get('attention', '?')}, drafting {s.get('drafting', '?')}, "
             f"decoders of {s.get('decoder_lengths', '?')} positions"
             + (f", CUDA graphs {s['cuda_graphs']}" if s.get("cuda_graphs") else "")
             + (f", host checks {s['pass_schedules'][0]['schedule']}" if s.get("pass_schedules") else ""),
             "tau = mean tokens added per target verification pass (accepted drafts + 1 bonus token)", ""]
    width = max([len("set")] + [len(r.get("set", "")) for r in rows])
    lines.append(f"{'set':<{width}} {'prompt':>6} {'row':>6} {'P':>4} {'new':>4} {'result':>9} {'tau':>5} {'steps':>5} "
                 f"{'spec tok/s':>10} {'target tok/s':>12} {'off own':>7} {'walk':>5} {'replay':>7} {'off data':>8}")
    for r in rows:
        lines.append(f"{r.get('set', ''):<{width}} {r['index']:>6} {r['source_row']:>6} {r['prompt_tokens']:>4} "
                     f"{r['new_tokens']:>4} "
                     f"{r['result']:>9} {_fmt(r['tau']):>5} {r['steps']:>5} {_fmt(r['spec_tok_s'], 1):>10} "
                     f"{_fmt(r['target_tok_s'], 1):>12} {_fmt(r.get('offline_tau_own')):>7} "
                     f"{_fmt(r.get('offline_tau_own_walk')):>5} "
                     f"{_fmt(r.get('offline_tau_replay')):>7} {_fmt(r.get('offline_tau_dataset')):>8}")
        d = r["difference"]
        if d is not None:
            lines.append(f"       differs at token {d['position']}: {d['spec_token']} vs {d['target_token']}, "
                         f"margin {_fmt(d['spec_margin'], 4)} / {_fmt(d['target_margin'], 4)} "
                         f"(tie bound {_fmt(d['bound'], 4)})")
        if show_text and "text" in r:
            lines.append(f"       {r['text']!r}")
    if sets:
        lines += ["", "per prompt set (tau pooled over passes and per response; time per output token as the reference "
                      "benchmark takes it: each response's decoding after its prefill over its tokens, then the mean "
                      "over responses; the speedup is the ratio; end to end: prefill and reading the results counted):",
                  f"{'set':<{max(width, len(POOLED))}} {'prompts':>7} {'same':>5} {'tie':>4} {'FAIL':>4} {'tau':>6} "
                  f"{'tau/resp (SE)':>15} {'target ms/tok':>13} {'spec ms/tok':>11} {'speedup':>7} {'end to end':>10} "
                  f" draft 1/2/3/4 accepted, given the one before"]
        for x in sets + [s["sets_pooled"]]:
            e2e = x.get("speedup_end_to_end")
            lines.append(f"{x['set']:<{max(width, len(POOLED))}} {x['prompts']:>7} {x['identical']:>5} {x['ties']:>4} "
                         f"{x['failures']:>4} {_fmt(x['tau'], 3):>6} {_with_se(x):>15} "
                         f"{_fmt(x['target_ms_per_token'], 3):>13} {_fmt(x['spec_ms_per_token'], 3):>11} "
                         f"{_times(x['speedup']):>7} {_times(e2e):>10}  {rates_text(x.get('accept_conditional'))}")
        lines.append("(SE: the standard error of tau per response over the set's prompts; two recipes compare by "
                     "their paired difference on the same prompts, which varies much less)")
    lines += ["", f"outputs: {s['identical']} identical, {s['ties']} differ at a numerical tie, "
                  f"{s['failures']} FAIL (of {s['prompts']})",
              f"measured tau: {_fmt(s['tau'], 3)} over {s['verification_steps']} verification passes "
              f"({count_noun(s['new_tokens'], 'new token')}: the passes' and each prompt's "
              "first, from the prefill); per "
              f"response {_fmt(s['tau_per_response'], 3)} (each response's tau, then their mean, as the reference "
              "benchmark averages)",
              f"tokens/s end to end: speculative {_fmt(s['spec_tok_s'], 1)}, target-only {_fmt(s['target_tok_s'], 1)} "
              f"(speedup {_fmt(s['speedup'], 2)}x; decoding alone, after the prefills: "
              f"{_fmt(s.get('speedup_decode'), 2)}x)",
              f"speculative time: {_fmt(s['spec_s'], 3)} s = draft {_fmt(s['draft_s'], 3)} + verify "
              f"{_fmt(s['verify_s'], 3)} + host {_fmt(s['host_s'], 3)}"]
    if s.get("spec_decode_s") is not None:
        passes, steps = s.get("passes_enqueued") or 0, s.get("target_steps") or 0
        lines += [f"  prefill {_fmt(s['spec_prefill_s'], 3)} s, decoding {_fmt(s['spec_decode_s'], 3)} s, "
                  f"{passes} passes enqueued: {_ms_each(s['spec_decode_s'], passes)} ms a pass on the clock, "
                  f"{_ms_each(s['draft_s'] + s['verify_s'], passes)} on the device (draft + verify), "
                  f"{_ms_each(s['spec_enqueue_s'], passes)} for the host to enqueue it",
                  f"target-only time: {_fmt(s['target_s'], 3)} s: prefill {_fmt(s['target_prefill_s'], 3)} s, decoding "
                  f"{_fmt(s['target_decode_s'], 3)} s, {steps} steps: {_ms_each(s['target_decode_s'], steps)} ms a "
                  f"step on the clock, {_ms_each(s['target_enqueue_s'], steps)} for the host to enqueue it "
                  "(on a compiled decoder, where enqueuing takes as long as running, the GPU waits for the host)"]
        if s.get("repeats", 1) > 1:
            lines.append(f"  timings: per prompt, the {repeats_phrase(s['repeats'])} each way")
    schedules = s.get("pass_schedules") or []
    if len(schedules) > 1:
        names = [k for k in schedules[0]["sets"]]
        lines += ["", "host checks between verification passes (each a device->host sync), the same prompts decoded "
                      "again under each schedule (spec s end to end, decode s after the prefills; speedups in time "
                      "per output token after the prefill):",
                  f"{'schedule':<10} {'checks':>6} {'idle':>5} {'passes':>6} {'enqueued':>8} {'same':>5} {'spec s':>7} "
                  f"{'host s':>7} {'decode s':>8} " + " ".join(f"{n[:12]:>12}" for n in names)]
        for x in schedules:
            lines.append(f"{x['schedule']:<10} {x['checks']:>6} {x['idle_checks']:>5} {x['passes']:>6} "
                         f"{x['passes_enqueued']:>8} "
                         f"{x['same_tokens']:>5} "
                         f"{_fmt(x['spec_s'], 3):>7} {_fmt(x['host_s'], 3):>7} {_fmt(x.get('decode_s'), 3):>8} "
                         + " ".join(f"{_times(x['sets'][n]['speedup']):>12}" for n in names))
    if "offline_tau_own" in s:
        lines += [f"offline tau on the target's own continuation: every anchor {_fmt(s['offline_tau_own'], 3)} "
                  f"({s['offline_blocks_own']} blocks; the drafter's average position); walked "
                  f"{_fmt(s['offline_tau_own_walk'], 3)} ({s['offline_walk_steps']} passes; the anchors decoding "
                  f"would visit, its prediction of the measured tau); measured / walked = "
                  f"{_fmt(s['measured_over_offline_walk'], 3)}",
                  f"offline tau: at decoding's anchors (replay) "
                  f"{_fmt(s['offline_tau_replay'], 3)} ({s['offline_blocks_replay']} blocks); dataset conversations "
                  f"{_fmt(s['offline_tau_dataset'], 3)} (first turn {_fmt(s['offline_tau_dataset_first_turn'], 3)}); "
                  f"measured / own = {_fmt(s['measured_over_offline_own'], 3)}",
                  f"per response: measured {_fmt(s['tau_per_response'], 3)}, own continuation every anchor "
                  f"{_fmt(s['offline_tau_own_per_response'], 3)}, walked "
                  f"{_fmt(s['offline_tau_own_walk_per_response'], 3)}; measured / own = "
                  f"{_fmt(s['measured_over_offline_own_per_response'], 3)} (compare like with like: pooled values "
                  "weight each pass or block alike, per-response means each response alike, so a response "
                  "caught in a repetition loop lifts pooled every-anchor tau most and per-response means both)"]
    if s.get("offline_tau_training_eval") is not None:
        walk_head = s.get("offline_tau_training_eval_walk_head")
        lines.append(f"training's held-out evaluation (step {s['training_eval_step']}): every anchor "
                     f"{_fmt(s['offline_tau_training_eval'], 3)}, response heads "
                     f"{_fmt(s.get('offline_tau_training_eval_head'), 3)}, walked "
                     f"{_fmt(s.get('offline_tau_training_eval_walk'), 3)}, walked over the heads "
                     f"{_fmt(walk_head, 3)} (heads: the first train.eval_head_tokens tokens of each response; "
                     "the walked heads predict decoding tau over as many new tokens)"
                     + (f"; measured / walked heads = {_fmt(s['tau'] / walk_head, 3)}" if walk_head else ""))
    if s["batch"] > 1:
        lines.append(f"per prompt, tok/s is the row's tokens over its batch's time (rows of a batch of {s['batch']} "
                     "share it); the pooled lines count each batch's time once")
    trained = s.get("per_position_training_eval") or []
    lines += ["", "acceptance per block position k (fraction of passes / blocks with m >= k"
              + ("; training: the held-out accuracy at position k alone, eval/acc_block_pos_k, which does not "
                 "need the positions before it right):" if trained else "):"),
              f"{'k':>3} {'decoding':>9}" + (f" {'replay':>7} {'own':>7} {'dataset':>7}"
                                             if "per_position_offline_own" in s else "")
              + (f" {'training acc':>12}" if trained else "")]
    for k, meas in enumerate(s["per_position_measured"], start=1):
        extra = ""
        if "per_position_offline_own" in s:
            extra = (f" {_fmt(s['per_position_offline_replay'][k - 1], 3):>7} "
                     f"{_fmt(s['per_position_offline_own'][k - 1], 3):>7} "
                     f"{_fmt(s['per_position_offline_dataset'][k - 1], 3):>7}")
        if trained:
            extra += f" {_fmt(trained[k - 1] if k <= len(trained) else None, 3):>12}"
        lines.append(f"{k:>3} {_fmt(meas, 3):>9}{extra}")
    return "\n".join(lines)
