"""Greedy generation over a static KV cache: target-only decoding and DFlash speculative decoding.

One module serves every decoding caller (the lossless check, the decoding benchmark, the
regeneration of training responses), in the manner of pytorch-labs/gpt-fast ``generate.py``:
:class:`Generator` decodes a batch of prompts over fixed buffers
(:mod:`dflash.inference.decode_state`) with step functions traced once and, on CUDA, replayed as
CUDA graphs (:mod:`dflash.inference.decode_steps`); this module holds the host loops around them.

**The host loop.** The step functions take no arguments and return nothing: every decision
(acceptance, the bonus token, the new anchor, stopping a row) is made on the device and written
into :class:`dflash.inference.decode_state.DecodeState`, so the steps run back to back without a
device→host sync (gpt-fast keeps its decode loop on the device the same way). The host reads
``anchor`` and ``active`` every ``sync_every`` target forwards, to learn when every row is done,
and reads the tokens, their top-2 logits (so the lossless check can judge a difference between two
runs by the target's own margin) and the passes once at the end, cutting a row's tokens after its
first stop token. Target-only decoding never enqueues more steps than the longest row still needs,
so only a stop token can leave steps that change nothing. Speculative decoding enqueues, between two
checks, the passes every row still certainly needs (``⌈remaining / B⌉``, which a pass cannot beat;
:func:`passes_before_check`), so no pass runs after the rows are done unless a stop token ends
them. Two other schedules trade checks for passes: ``predicted`` also counts on the rows going on
at their acceptance so far (fewer checks, a few passes past the end), and ``pipelined`` sizes its
chunks the same way but enqueues the next chunk before it waits for the state after the previous
one (copied into pinned host memory behind it), so the GPU idles only where the prediction says no
chunk is needed. Measured on SmolLM2-135M on one H200 (96 new tokens, batch 1), the passes they add
cost more than the checks they save: ``certain`` is the default. A pass that turns out not to be
needed runs on inactive rows and changes nothing, so the output depends neither on ``sync_every``
nor on the schedule.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from dflash.inference.decode_state import SLACK
from dflash.inference.decode_steps import CUDA_GRAPHS, DecodeSteps
from dflash.inference.sampling import Sampling, seed_tensor

__all__ = ["Generation", "Generator", "PASS_SCHEDULES", "WARMUP_ROUNDS", "passes_before_check"]

log = logging.getLogger(__name__)

#: How speculative decoding chooses the passes between two host checks (:func:`passes_before_check`);
#: the first is the default.
PASS_SCHEDULES = ("certain", "predicted", "pipelined")

#: Target forwards between two host checks of the decoding state (the only device→host syncs of a
#: compiled decode). Larger: more forwards queued without the host waiting; smaller: fewer forwards
#: wasted after a stop token (a row that stops is masked on the device; the batch ends at a check).
SYNC_EVERY = 8

#: Warm-up decodes (both ways) :meth:`Generator.warm_up` runs at most: a captured step records its
#: graph on its third call, and a drafter that accepts whole blocks needs few passes for a few tokens.
WARMUP_ROUNDS = 3


def passes_before_check(remaining: Sequence[int], emitted: Sequence[int], passes_done: int, block_size: int,
                        cap: int, schedule: str = "certain") -> int:
    """Verification passes to enqueue before the host next reads the decoding state.

    A pass emits between 1 and ``block_size`` tokens per active row, so every row still needs at
    least ``⌈remaining / block_size⌉`` passes (``certain``). ``predicted`` (and ``pipelined``, which
    sizes its chunks the same way) also counts on each row going on at the rate it has had so far in
    this decode: ``⌊remaining · passes_done / emitted⌋`` passes (the floor keeps the guess at or under
    the expected need). The largest need over the rows, capped at ``cap``, at least 1.

    Args:
        remaining: per active row, tokens still to emit before its last position (≥ 0).
        emitted: per active row (same order), tokens emitted by the ``passes_done`` passes so far.
        passes_done: passes run in this decode (0 before the first: only the certain need counts).
        block_size: the drafter's block size ``B`` (tokens per pass at most).
        cap: at most this many passes (``Generator.sync_every``, plus the passes already enqueued
            past the rows' known state under ``pipelined``).
        schedule: one of :data:`PASS_SCHEDULES` (``pipelined`` predicts as ``predicted`` does).

    Returns:
        a whole number in ``[1, cap]``.

    Raises:
        ValueError: an unknown ``schedule``, or ``remaining`` and ``emitted`` of different lengths.
    """
    if schedule not in PASS_SCHEDULES:
        raise ValueError(f"schedule: must be one of {PASS_SCHEDULES}, got {schedule!r}")
    if len(remaining) != len(emitted):
        raise ValueError(f"remaining ({len(remaining)} rows) and emitted ({len(emitted)} rows) differ in length")
    need = max((-(-rem // block_size) for rem in remaining), default=0)
    if schedule != "certain" and passes_done > 0:
        need = max([need] + [rem * passes_done // out for rem, out in zip(remaining, emitted) if out > 0])
    return max(1, min(cap, need))


# --------------------------------------------------------------------------- results


@dataclass
class Generation:
    """One prompt's decode.

    Attributes:
        tokens: generated ids (prompt excluded), ending with the first stop token (kept) or after
            ``max_new_tokens``.
        top2: per generated token, the target's two largest logits ``(z1, z2)`` (fp32 of the
            model-dtype logits) at the forward that produced it.
        spread: per generated token, ``max_v |z_v − mean(z)|`` of those logits (the scale of
            :func:`dflash.inference.lossless.tie_bound`); empty where a producer did not record it.
        accepted: per verification pass, ``m + 1`` (accepted drafts plus the bonus); empty for
            target-only decoding.
        anchors: per verification pass, the anchor's position.
        target_forwards: target forward passes (prefill included).
        checks: the host's reads of the decoding state during speculative decoding (each a
            device→host sync; the batch's count); 0 for target-only decoding.
        idle_checks: those of :attr:`checks` with no pass enqueued behind the state read (every
            check but under the ``pipelined`` schedule), where the GPU has only the next pass's
            draft to run while the host reads.
        passes_enqueued: target forwards the host enqueued for the batch after the prefill:
            verification passes, or one-token steps for target-only decoding (at least the most any
            of its rows needed: the rest ran on inactive rows, e.g. after a stop token).
        seconds / draft_seconds / verify_seconds: wall time of the whole decode (the batch's,
            for batched decoding), and the device time of drafting and of verification, in s.
        prefill_seconds / decode_seconds: wall time of the batch's prefill (to its first tokens
            on the host) and of the decoding loop after it (steps or passes), in s; ``seconds``
            minus both is the host's reading of the results. ``decode_seconds`` over the tokens is
            the time per output token of the reference benchmark (z-lab/dflash ``dflash/model.py``,
            ``dflash_generate``: the clock starts after the prefill).
        enqueue_seconds: host time spent enqueuing the decoding loop's steps or passes (the Python
            calls that launch them, CUDA graph replays on a compiled CUDA decoder), in s. On a
            compiled decoder, against the device time of the same steps it says which side bounds
            decoding: where enqueuing a pass takes as long as running it, the GPU waits for the
            host. An eager decoder runs its ops as it launches them (and an eager draft reads the
            anchors off the device, outside this time), so there it is most of the decoding time.
    """

    tokens: list[int] = field(default_factory=list)
    top2: list[tuple[float, float]] = field(default_factory=list)
    spread: list[float] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    anchors: list[int] = field(default_factory=list)
    target_forwards: int = 0
    checks: int = 0
    idle_checks: int = 0
    passes_enqueued: int = 0
    seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    enqueue_seconds: float = 0.0

    @property
    def steps(self) -> int:
        """Verification passes."""
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Measured acceptance length ``mean(m + 1)`` over verification passes (``nan`` if none)."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("nan")


# --------------------------------------------------------------------------- the generator


class _Timer:
    """Device time of labelled sections: CUDA events on ``device``'s current stream (no sync until
    :meth:`totals`; the device need not be the current one), perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.marks: dict[str, list[Any]] = {}
        self.cpu: dict[str, float] = {}

    def start(self, name: str) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            return ev
        return time.perf_counter()

    def stop(self, name: str, token: Any) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            self.marks.setdefault(name, []).append((token, ev))
        else:
            self.cpu[name] = self.cpu.get(name, 0.0) + time.perf_counter() - token

    def totals(self) -> dict[str, float]:
        """Seconds per label (synchronises on CUDA)."""
        out = dict(self.cpu)
        if self.cuda:
            torch.cuda.synchronize()
            for name, pairs in self.marks.items():
                out[name] = out.get(name, 0.0) + sum(a.elapsed_time(b) for a, b in pairs) / 1e3
        return out


class Generator(DecodeSteps):
    """Target-only and speculative greedy decoding of a batch of prompts over static buffers.

    Args:
        model, layer_ids, max_len, batch_size, drafter, compile, fuse, attention, compile_prefill, draft_cache,
        cuda_graphs, sampling: the decoding state and its step functions
            (:class:`dflash.inference.decode_steps.DecodeSteps`); with ``sampling``, :meth:`greedy`
            samples (one seed per prompt), and no drafter is taken.
        sync_every: target forwards (steps or verification passes) the host enqueues between two
            reads of the decoding state (:data:`SYNC_EVERY`); any value gives the same outputs.
            Settable on the instance (:attr:`sync_every`) without recompiling.
        pass_schedule: how speculative decoding chooses the passes between two checks
            (:func:`passes_before_check`: ``certain``, the default, or ``predicted``; ``pipelined``
            sizes chunks as ``predicted`` does but enqueues the next chunk before reading the state
            after the previous one, so the GPU does not idle at a check); any value gives the same
            outputs. Settable on the instance (:attr:`pass_schedule`).
        overlap_checks: while the host reads the decoding state with nothing enqueued behind it,
            the device runs work the decode will most likely need: the next pass's draft
            (speculative; wasted once a decode, after its last pass) or, when the longest row
            needs more than ``sync_every`` steps, the next step (target-only; wasted only after a
            stop token). The proposer is then called once more than there are passes. ``None`` =
            on CUDA, where the device runs asynchronously (elsewhere nothing would overlap). Same
            outputs either way. Settable on the instance (:attr:`overlap_checks`).

    Raises:
        ValueError: ``sync_every < 1``, an unknown ``pass_schedule``, or a bad argument of
            :class:`dflash.inference.decode_steps.DecodeSteps`.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], max_len: int, batch_size: int = 1,
                 drafter: Any = None, compile: Optional[bool] = None, sync_every: int = SYNC_EVERY,
                 fuse: bool = True, attention: Optional[str] = None, compile_prefill: Optional[bool] = None,
                 pass_schedule: str = "certain", draft_cache: bool = True, cuda_graphs: str = CUDA_GRAPHS[0],
                 sampling: Optional[Sampling] = None, overlap_checks: Optional[bool] = None) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every: must be >= 1, got {sync_every}")
        if pass_schedule not in PASS_SCHEDULES:
            raise ValueError(f"pass_schedule: must be one of {PASS_SCHEDULES}, got {pass_schedule!r}")
        super().__init__(model, layer_ids, max_len, batch_size=batch_size, drafter=drafter, compile=compile,
                         fuse=fuse, attention=attention, compile_prefill=compile_prefill, draft_cache=draft_cache,
                         cuda_graphs=cuda_graphs, sampling=sampling)
        self.sync_every = int(sync_every)
        self.pass_schedule = pass_schedule
        self.overlap_checks = self.device.type == "cuda" if overlap_checks is None else bool(overlap_checks)
        # pinned host copies of (anchor, active) for the checks, reused in turn (at most two chunks in flight)
        pin = self.device.type == "cuda"
        self._snapshots = [torch.empty(2 * batch_size, dtype=torch.long, pin_memory=pin) for _ in range(3)]
        self._next_snapshot = 0
        self._stops: frozenset[int] = frozenset()

    # ----------------------------------------------------------------------- decoding

    def _check(self, prompts: Sequence[Tensor], max_new_tokens: int, stop_ids: Sequence[int]) -> None:
        if not 1 <= len(prompts) <= self.batch_size:
            raise ValueError(f"prompts: need 1..{self.batch_size} (the batch size), got {len(prompts)}")
        for i, p in enumerate(prompts):
            if p.dim() != 1 or p.numel() < 1:
                raise ValueError(f"prompts[{i}]: need a non-empty 1-D tensor of ids, got shape {tuple(p.shape)}")
            need = p.numel() + max_new_tokens + self.block_size + SLACK
            if need > self.max_len:
                raise ValueError(f"prompts[{i}]: {p.numel()} tokens + {max_new_tokens} new + block "
                                 f"{self.block_size} needs max_len >= {need}, have {self.max_len}")
        bad = [s for s in stop_ids if int(s) < 0]
        if bad:
            raise ValueError(f"stop_ids: token ids are >= 0, got {bad}")

    def _set_stops(self, stops: list[int]) -> None:
        """Write ``stops`` into :attr:`DecodeState.stop_ids` (grown to a power of two if too short)."""
        st = self.state
        if len(stops) > st.stop_ids.numel():
            st.stop_ids = torch.full((1 << (len(stops) - 1).bit_length(),), -1, dtype=torch.long, device=self.device)
            torch._dynamo.mark_static_address(st.stop_ids)
        padded = stops + [-1] * (st.stop_ids.numel() - len(stops))
        st.stop_ids.copy_(torch.tensor(padded, dtype=torch.long))

    def _start(self, prompts: Sequence[Tensor], max_new_tokens: int, stop_ids: Sequence[int],
               speculative: bool, seeds: Optional[Sequence[int]] = None) -> list[bool]:
        """Validate, prefill every prompt (filling the drafter's context cache when ``speculative``)
        and arm the device state (``seeds``: a sampling decoder's, one per prompt). Returns which
        rows still generate."""
        self._check(prompts, max_new_tokens, stop_ids)
        st = self.state
        if self.sampling is not None:
            if seeds is None or len(seeds) != len(prompts):
                raise ValueError(f"seeds: a sampling decoder needs one per prompt ({len(prompts)}), got "
                                 f"{'none' if seeds is None else len(seeds)}")
            st.seeds[:len(prompts)].copy_(seed_tensor(seeds))
        elif seeds is not None:
            raise ValueError("seeds: this decoder is greedy (Generator(sampling=...) samples)")
        st.active.zero_()
        st.anchor.zero_()
        st.accepted.zero_()
        stops = sorted({int(s) for s in stop_ids})
        self._stops = frozenset(stops)
        if max_new_tokens < 1:
            return [False] * len(prompts)
        self._set_stops(stops)
        active = [tok not in self._stops and max_new_tokens > 1 for tok in self.prefill(prompts, speculative)]
        pad = [False] * (self.batch_size - len(prompts))
        st.active.copy_(torch.tensor(active + pad))
        limits = [p.numel() + max_new_tokens - 1 for p in prompts] + [0] * len(pad)
        st.limit.copy_(torch.tensor(limits, dtype=torch.long))
        return active

    def _snapshot(self, n: int) -> tuple[Tensor, Any]:
        """Enqueue a copy of rows ``0 … n−1``'s anchors and active flags into a pinned host buffer
        (after the work enqueued so far); :meth:`_read_snapshot` waits for it."""
        st = self.state
        buf = self._snapshots[self._next_snapshot][:2 * n].view(2, n)  # contiguous: an asynchronous copy
        self._next_snapshot = (self._next_snapshot + 1) % len(self._snapshots)
        buf.copy_(torch.stack([st.anchor[:n], st.active[:n].long()]), non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))  # the copy's stream, also off the current device
        return buf, event

    @staticmethod
    def _read_snapshot(snapshot: tuple[Tensor, Any]) -> tuple[list[int], list[bool]]:
        """The anchors and active flags of :meth:`_snapshot`: the one device→host wait of a check."""
        buf, event = snapshot
        if event is not None:
            event.synchronize()
        both = buf.tolist()
        return both[0], [bool(x) for x in both[1]]

    def _collect(self, prompts: Sequence[Tensor], max_new_tokens: int, passes: bool,
                 logit_stats: bool = True) -> list[Generation]:
        """Read each row's tokens, top-2 logits (unless not ``logit_stats``) and passes off the
        device once, after decoding.

        A row's output is ``tokens[P … anchor]`` cut after its first stop token and at
        ``max_new_tokens`` (a verification pass that ends a row may have written tokens past the
        end); its passes are the positions ``P ≤ j < anchor`` with ``accepted[j] > 0``.
        """
        st = self.state
        n = len(prompts)
        gens = [Generation() for _ in prompts]
        if max_new_tokens < 1:
            return gens
        anchor = st.anchor[:n].tolist()
        end = max(anchor) + 1
        tokens = st.tokens[:n, :end].tolist()
        stats = st.logit_stats[:n, :end].tolist() if logit_stats else None  # [n, end, 3]: the costly read
        accepted = st.accepted[:n, :end].tolist() if passes else None
        for r, (g, prompt) in enumerate(zip(gens, prompts)):
            p = prompt.numel()
            out = tokens[r][p:anchor[r] + 1][:max_new_tokens]
            cut = next((i for i, t in enumerate(out) if t in self._stops), None)
            g.tokens = out if cut is None else out[:cut + 1]
            if stats is not None:
                mine = stats[r][p:p + len(g.tokens)]
                g.top2 = [(z[0], z[1]) for z in mine]
                g.spread = [z[2] for z in mine]
            if accepted is None:
                g.target_forwards = len(g.tokens)
                continue
            g.anchors = [j for j in range(p, anchor[r]) if accepted[r][j] > 0]
            g.accepted = [accepted[r][j] for j in g.anchors]
            g.target_forwards = 1 + len(g.accepted)
        return gens

    @staticmethod
    def _bound(forwards: int, max_new_tokens: int) -> None:
        """Every forward emits at least one token per active row, so a row still active after
        ``max_new_tokens`` forwards means the device state is corrupt: fail rather than spin."""
        if forwards >= max_new_tokens:
            raise RuntimeError(f"decoding: rows still active after {forwards} target forwards for "
                               f"max_new_tokens={max_new_tokens} (inconsistent device state)")

    @staticmethod
    def _report(progress: Optional[Callable[[int], None]], shown: list[int], now: list[int]) -> None:
        """Tell ``progress`` the tokens added since the last call (``now[r]`` past the first, per row)."""
        added = sum(max(0, x - s) for x, s in zip(now, shown))
        shown[:] = [max(x, s) for x, s in zip(now, shown)]
        if progress is not None and added:
            progress(added)

    @torch.no_grad()
    def greedy(self, prompts: Sequence[Tensor], max_new_tokens: int, stop_ids: Sequence[int] = (),
               progress: Optional[Callable[[int], None]] = None, logit_stats: bool = True,
               seeds: Optional[Sequence[int]] = None) -> list[Generation]:
        """Target-only decoding of up to ``batch_size`` prompts (one token per forward): greedy, or
        sampled by a decoder built with ``sampling``.

        The steps run back to back on the device (:meth:`_greedy_step_impl` stops each row itself);
        the host reads the anchors and active flags every :attr:`sync_every` steps (never more
        steps than the longest row still needs; with :attr:`overlap_checks`, one more runs while it
        reads) and the tokens once at the end.

        Args:
            prompts: ``[P_i]`` int64 each.
            max_new_tokens: per prompt.
            stop_ids: a row stops after emitting one of these (kept).
            progress: called with the number of tokens added (after each prompt's first) at
                every check.
            logit_stats: read each token's top-2 logits and spread off the device
                (:attr:`Generation.top2`, :attr:`Generation.spread`); ``False`` leaves them empty
                (callers that need only the tokens: the ``[n, T, 3]`` read is the costliest of a
                large batch).
            seeds: a sampling decoder's seed of each prompt (its row's tokens depend on it, the
                prompt and the model only: :mod:`dflash.inference.sampling`); none for a greedy one.

        Returns:
            one :class:`Generation` per prompt.

        Raises:
            ValueError: too many prompts, an empty prompt, one that does not fit ``max_len``, a
                negative stop id, or ``seeds`` missing (sampling), outside int64 or given (greedy).
        """
        start = time.perf_counter()
        active = self._start(prompts, max_new_tokens, stop_ids, speculative=False, seeds=seeds)
        prefilled = time.perf_counter()  # the prefill's first tokens reached the host: synchronised
        n = len(prompts)
        lens = [p.numel() for p in prompts]
        limit = [p + max_new_tokens - 1 for p in lens]
        anchor = list(lens)
        shown = [0] * n
        forwards = 0
        enqueue = 0.0
        pending = 0  # steps enqueued behind the state the host last read
        while any(active):
            self._bound(forwards, max_new_tokens)
            need = max(limit[r] - anchor[r] for r in range(n) if active[r])  # steps the longest row may still take
            steps = max(0, min(self.sync_every, need) - pending)
            t = time.perf_counter()
            for _ in range(steps):
                self._greedy_step()
            enqueue += time.perf_counter() - t
            forwards += steps
            snapshot = self._snapshot(n)
            # While the host reads the state, the device takes the next step when a row certainly
            # has room for it (past sync_every steps): it is wasted only where every row stopped at
            # a stop token in the steps just read (one step a decode at most), and waited for below.
            pending = int(self.overlap_checks and need > self.sync_every)
            if pending:
                t = time.perf_counter()
                self._greedy_step()
                enqueue += time.perf_counter() - t
                forwards += 1
            anchor, active = self._read_snapshot(snapshot)
            self._report(progress, shown, [a - p if on else 0 for a, p, on in zip(anchor, lens, active)])
        if pending and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # a step past the last read is decoding's time
        decoded = time.perf_counter()  # the last poll synchronised
        gens = self._collect(prompts, max_new_tokens, passes=False, logit_stats=logit_stats)
        self._report(progress, shown, [max(0, len(g.tokens) - 1) for g in gens])
        elapsed = time.perf_counter() - start
        for g in gens:
            g.seconds = elapsed
            g.prefill_seconds = prefilled - start
            g.decode_seconds = decoded - prefilled
            g.enqueue_seconds = enqueue
            g.passes_enqueued = forwards
        return gens

    @torch.no_grad()
    def warm_up(self, prompts: Sequence[Tensor], max_new_tokens: int, stop_ids: Sequence[int] = (),
                speculative: bool = True, rounds: int = 1) -> int:
        """Decode ``prompts`` target-only (and speculatively) ``rounds`` times, then again, up to
        :data:`WARMUP_ROUNDS` rounds in all, until every captured step has recorded its graph
        (:meth:`graphs_recorded`): compilation and graph recording happen here, not in a timed run.

        Returns:
            the rounds run.
        """
        done = 0
        while done < max(rounds, 1) or (done < WARMUP_ROUNDS and not self.graphs_recorded()):
            self.greedy(prompts, max_new_tokens, stop_ids)
            if speculative:
                self.speculative(prompts, max_new_tokens, stop_ids)
            done += 1
        return done

    def speculative(self, prompts: Sequence[Tensor], max_new_tokens: int, stop_ids: Sequence[int] = (),
                    progress: Optional[Callable[[int], None]] = None) -> list[Generation]:
        """Greedy speculative decoding of up to ``batch_size`` prompts: draft, verify, accept.

        Every emitted token is the target's greedy choice given the tokens before it, so the output
        equals target-only greedy decoding token for token up to floating-point differences between
        a B-token and a 1-token forward (Leviathan et al. 2023; DFlash, arXiv 2602.06036, §3).
        τ conventions: each pass counts ``m + 1`` (the last pass too, even when a stop token or
        ``max_new_tokens`` cuts its tokens); the prefill is not a pass.

        Acceptance runs on the device (:meth:`_verify_step_impl`); the host reads the anchors and
        active flags after at most :attr:`sync_every` passes, as many as :func:`passes_before_check`
        gives under :attr:`pass_schedule` (the rows' acceptance so far, or only what they certainly
        still need). :attr:`Generation.checks` counts the reads; with :attr:`overlap_checks` the
        device drafts the next pass while the host reads.

        Args / Returns / Raises: as :meth:`greedy`; ``ValueError`` too when no drafter was given.
        """
        if self.proposer is None:
            raise ValueError("speculative decoding needs a drafter (Generator(drafter=...))")
        start = time.perf_counter()
        active = self._start(prompts, max_new_tokens, stop_ids, speculative=True)
        prefilled = time.perf_counter()  # the prefill's first tokens reached the host: synchronised
        n = len(prompts)
        b_sz = self.block_size
        lens = [p.numel() for p in prompts]
        limit = [p + max_new_tokens - 1 for p in lens]
        anchor = list(lens)
        shown = [0] * n
        timer = _Timer(self.device)
        pipelined = self.pass_schedule == "pipelined"
        forwards = checks = idle = 0  # passes enqueued, host checks, checks with nothing enqueued behind them
        known = 0  # passes whose outcome (anchor, active) the host has read
        enqueue = 0.0
        in_flight: list[tuple[int, tuple[Tensor, Any]]] = []  # (forwards after a chunk, its snapshot)
        drafted = False  # the next pass's draft is enqueued already (behind the last check's snapshot)

        def draft() -> float:
            """Enqueue a draft; the host's seconds to enqueue it (an eager draft's width read excluded)."""
            width = None if self.compiled else int(self.state.anchor[:n].max()) + 1  # eager: a device read
            launched = time.perf_counter()
            t = timer.start("draft")
            if width is None:
                self._draft_step()
            else:
                self._draft_step(width)
            timer.stop("draft", t)
            return time.perf_counter() - launched

        while any(active):
            self._bound(known, max_new_tokens)
            live = [r for r in range(n) if active[r]]
            ahead = forwards - known  # passes enqueued past the state the host knows
            need = passes_before_check([limit[r] - anchor[r] for r in live], [anchor[r] - lens[r] for r in live],
                                       known, b_sz, ahead + self.sync_every, self.pass_schedule)
            chunk = need - ahead if in_flight else max(1, need - ahead)
            for _ in range(max(0, chunk)):
                if not drafted:
                    enqueue += draft()
                drafted = False
                launched = time.perf_counter()
                t = timer.start("verify")
                self._verify_step()
                timer.stop("verify", t)
                enqueue += time.perf_counter() - launched
            if chunk > 0:
                forwards += chunk
                in_flight.append((forwards, self._snapshot(n)))
            if pipelined and chunk > 0 and len(in_flight) < 2:
                continue  # the GPU runs this chunk while the host sizes the next one
            known, snapshot = in_flight.pop(0)
            idle += known == forwards  # no pass enqueued behind what is read
            if known == forwards and not drafted and self.overlap_checks:
                # The GPU would wait for the host while it reads the state: it drafts the next pass
                # meanwhile. A draft writes only the drafts buffer, which the next verification
                # reads; after the last pass it is wasted (one draft a decode, waited for below).
                enqueue += draft()
                drafted = True
            anchor, active = self._read_snapshot(snapshot)
            checks += 1
            self._report(progress, shown, [a - p if on else 0 for a, p, on in zip(anchor, lens, active)])
        for _, snapshot in in_flight:  # a chunk enqueued behind the last read (pipelined): its time is decoding's
            self._read_snapshot(snapshot)
        if drafted and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the draft past the last pass is decoding's time
        decoded = time.perf_counter()  # every enqueued pass has run
        gens = self._collect(prompts, max_new_tokens, passes=True)
        self._report(progress, shown, [max(0, len(g.tokens) - 1) for g in gens])
        split = timer.totals()
        elapsed = time.perf_counter() - start
        for g in gens:
            g.seconds = elapsed
            g.checks = checks
            g.idle_checks = idle
            g.passes_enqueued = forwards
            g.draft_seconds = split.get("draft", 0.0)
            g.verify_seconds = split.get("verify", 0.0)
            g.prefill_seconds = prefilled - start
            g.decode_seconds = decoded - prefilled
            g.enqueue_seconds = enqueue
        return gens
