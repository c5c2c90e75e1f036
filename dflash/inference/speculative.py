"""The lossless check of speculative decoding with a trained DFlash drafter, and where τ goes.

Decoding itself lives in :mod:`dflash.inference.generation` (static KV cache, fixed shapes, CUDA graphs on
GPU); this module runs it on held-out prompts both ways (target-only greedy and speculative), checks
that the outputs agree, and compares the measured acceptance length with the offline ones.

**Acceptance length τ** (measured): the mean, over the target's verification passes, of the
tokens each pass adds, ``m + 1`` (accepted drafts *plus the bonus*), so ``1 ≤ τ ≤ B``. The prefill
is not a pass. The last pass counts its full ``m + 1`` even when a stop token or
``max_new_tokens`` cuts some of its tokens. Over several prompts τ is pooled: Σ(m + 1) / Σ passes.

**Offline τ** (:func:`offline_tau`, what training's evaluation measures with
:func:`dflash.training.objective.acceptance_lengths`): on a token sequence with the target's features and
greedy labels, ``1 +`` the leading block positions whose argmax equals the label, averaged over
blocks. Computed three ways, to take the measured τ apart:

* on the *dataset* conversation (every valid anchor): what training's held-out τ measures;
* on the target's *own greedy continuation* of the prompt (every anchor of it): the text decoding
  sees, so the dataset-vs-target-text gap is gone;
* on that continuation at exactly the anchors decoding visited (*replay*): in fp32 this equals the
  measured τ (the same computation, batched), so a gap between it and the measured τ is a bug
  (features, positions, mask or mask token differing between training's forward and decoding),
  and the gap between it and the all-anchor value is the anchors decoding picks: after a partial
  acceptance the next anchor is the token the drafter just got wrong, which is harder than the
  average position.

Per block position ``k = 1 … B−1`` the report gives the fraction of passes (decoding) and of blocks
(offline) in which position ``k`` was accepted (``m ≥ k``).

**The lossless check.** Every emitted token is the target's greedy choice given the tokens before
it, so speculative output equals target-only greedy output. In fp32 it must be identical. In bf16
a ``B``-token verification forward and a one-token forward run different kernels (different
reduction orders), so a near-tie between the top two logits can flip. Where the outputs first
differ (position ``i``; the tokens before it are equal, so both runs scored the same context) the
report gives each run's top-1/top-2 logit margin there; the difference is a numerical **tie** only
when both margins are at most :func:`tie_bound`, anything else **fails** (exit 1).

:func:`tie_bound` derivation. A bf16 value has 8 significant bits: relative rounding error
``u = 2^-8`` (fp16: ``2^-11``). The final hidden state of an ``N``-layer target is the sum of
``N`` residual updates, each rounded to bf16; a logit ``z = ⟨h, w⟩`` is one more rounding.
Two forwards that differ only in reduction order make independent rounding errors at each of
these ``N + 1`` stages; summed as a random walk, the logit's relative difference is at most
``u·√(N + 1)``, i.e. ``|Δz| ≤ u·√(N + 1)·|z_1|``. A flip needs each run's margin below that
size. SmolLM2-135M (``N = 30``, ``|z_1|`` ≈ 15–25): 0.33–0.54. The bound is a stated model of bf16
noise, not a proof; the margins are in the report so a reader can judge.

CLI::

    python -m dflash.inference.speculative --checkpoint runs/<name>/checkpoints/step-XXXXXXXX \\
        [--config configs/smollm2-135m-cpu.yaml] [--prompts 8] [--max-new-tokens 96] \\
        [--device cuda] [--batch 1] [--compile auto|on|off]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from dflash.inference.generation import Generation, Generator, drafter_hidden
from dflash.training.objective import acceptance_lengths, build_block_labels, valid_anchor_mask
from dflash.progress import Progress
from dflash.training.resume import read_jsonl_rows

__all__ = [
    "Difference",
    "tie_bound",
    "first_difference",
    "OfflineTau",
    "offline_tau",
    "PromptCase",
    "prompts_from_corpus",
    "user_turn_header",
    "stop_token_ids",
    "resolve_checkpoint",
    "last_eval_tau",
    "checkpoint_step",
    "decode_report",
    "format_report",
    "main",
]

log = logging.getLogger(__name__)

#: Anchors per drafter forward in :func:`offline_tau` (bounds the ``[A·(B−1), V]`` logits).
OFFLINE_ANCHORS_PER_CHUNK = 64
#: Default CLI settings.
DEFAULT_PROMPTS = 8
DEFAULT_MAX_NEW_TOKENS = 96
DEFAULT_CONFIG = "configs/smollm2-135m-cpu.yaml"
#: Tokens generated (and thrown away) by each decoder once before timing: first-call
#: allocations and, on CUDA, compilation and graph capture do not count.
WARMUP_TOKENS = 16
#: Relative rounding error of one rounding, per dtype (8 / 11 significant bits); fp32 gets no allowance.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
#: Progress: a log line this often (s) when stderr is not a terminal.
PROGRESS_LOG_S = 10.0


# --------------------------------------------------------------------------- the margin rule


def tie_bound(top1_logit: float, num_layers: int, dtype: torch.dtype) -> float:
    """Largest top-1/top-2 margin a bf16/fp16 rounding difference can flip: ``u·√(N + 1)·max(|z_1|, 1)``.

    See the module docstring for the derivation. ``0`` for fp32 (outputs must be identical).

    Args:
        top1_logit: the larger logit ``z_1`` at the position.
        num_layers: ``N``, the target's decoder layers.
        dtype: the dtype the target ran in.

    Raises:
        ValueError: ``num_layers < 1``.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers: must be >= 1, got {num_layers}")
    u = UNIT_ROUNDOFF.get(dtype)
    if u is None:
        return 0.0
    return u * math.sqrt(num_layers + 1) * max(abs(top1_logit), 1.0)


@dataclass
class Difference:
    """Where a speculative output first differs from the target-only one, and whether it is a tie.

    Attributes:
        position: index into the generated tokens.
        spec_token / target_token: the tokens there (``-1`` where a run has no token).
        spec_margin / target_margin: ``z_1 − z_2`` of the target's logits there, in each run
            (``nan`` where a run has no token).
        bound: :func:`tie_bound` there.
        tie: both margins ``≤ bound``.
    """

    position: int
    spec_token: int
    target_token: int
    spec_margin: float
    target_margin: float
    bound: float
    tie: bool


def first_difference(spec: Generation, target: Generation, num_layers: int, dtype: torch.dtype
                     ) -> Optional[Difference]:
    """Compare two greedy runs token by token; ``None`` when identical.

    A length difference with equal tokens up to the shorter one is never a tie.
    """
    for i, (a, b) in enumerate(zip(spec.tokens, target.tokens)):
        if a != b:
            s1, s2 = spec.top2[i]
            t1, t2 = target.top2[i]
            bound = tie_bound(max(abs(s1), abs(t1)), num_layers, dtype)
            ms, mt = s1 - s2, t1 - t2
            return Difference(i, a, b, ms, mt, bound, bool(ms <= bound and mt <= bound))
    if len(spec.tokens) == len(target.tokens):
        return None
    i = min(len(spec.tokens), len(target.tokens))
    get = lambda g: g.tokens[i] if i < len(g.tokens) else -1  # noqa: E731
    return Difference(i, get(spec), get(target), float("nan"), float("nan"), 0.0, False)


# --------------------------------------------------------------------------- offline τ


@dataclass
class OfflineTau:
    """Offline acceptance length on token sequences.

    Attributes:
        tau / blocks: mean τ over all blocks of all sequences, and their number.
        first_turn_tau / first_turn_blocks: the same over anchors inside the first assistant turn.
        per_conversation: τ of each sequence (``nan`` without a block).
        per_position: ``[B − 1]``: the fraction of blocks whose block position ``k`` was accepted
            (``τ − 1 ≥ k``), ``k = 1 … B−1``.
    """

    tau: float
    blocks: int
    first_turn_tau: float
    first_turn_blocks: int
    per_conversation: list[float]
    per_position: list[float]


def _first_turn_end(loss_mask: Tensor) -> int:
    """End (exclusive) of the first run of ``True`` in ``loss_mask [S]`` (0 when there is none)."""
    idx = torch.nonzero(loss_mask).flatten()
    if idx.numel() == 0:
        return 0
    start = int(idx[0])
    after = torch.nonzero(~loss_mask[start:]).flatten()
    return start + int(after[0]) if after.numel() else loss_mask.numel()




@torch.no_grad()
def offline_tau(target: Any, drafter: nn.Module, conversations: Sequence[tuple[Tensor, Tensor]],
                labels: str = "target", anchors_per_chunk: int = OFFLINE_ANCHORS_PER_CHUNK,
                anchors: Optional[Sequence[Sequence[int]]] = None) -> OfflineTau:
    """Training's held-out τ on whole sequences.

    For each sequence: the target's ``features [1, S, L·D]`` and greedy ``target_tokens``
    (:meth:`dflash.models.target.TargetModel.forward_features`, as the target workers compute them);
    anchors = every position ``p`` with ``loss_mask[p] & loss_mask[p+1]``
    (:func:`dflash.training.objective.valid_anchor_mask`), or those of ``anchors`` that are valid; labels
    and slot validity from :func:`dflash.training.objective.build_block_labels`; τ per block from
    :func:`dflash.training.objective.acceptance_lengths` on the argmax of ``lm_head(hidden)``.

    Args:
        target: a :class:`dflash.models.target.TargetModel` whose ``layer_ids`` are the drafter's.
        drafter: :class:`dflash.models.drafter.DFlashDraftModel`.
        conversations: ``(input_ids [S] int64, loss_mask [S] bool)`` each.
        labels: ``target`` (the target's greedy tokens, training's default) or ``data``.
        anchors_per_chunk: anchors per drafter forward.
        anchors: per sequence, the anchor positions to use (``None`` = every valid one).

    Returns:
        :class:`OfflineTau`.

    Raises:
        ValueError: ``anchors`` has a different length than ``conversations``.
    """
    if anchors is not None and len(anchors) != len(conversations):
        raise ValueError(f"anchors: {len(anchors)} lists for {len(conversations)} conversations")
    drafter.eval()
    device = target.device
    b = int(drafter.block_size)
    head = drafter.lm_head
    all_tau: list[Tensor] = []
    first_tau: list[Tensor] = []
    per_conv: list[float] = []
    for c, (ids, mask) in enumerate(conversations):
        s = ids.numel()
        ids_r = ids.to(device).view(1, s)
        mask_r = mask.to(device).bool().view(1, s)
        pos = torch.arange(s, device=device).view(1, s)
        doc = torch.ones(1, s, dtype=torch.int32, device=device)
        feats, tgt_tokens = target.forward_features(ids_r, pos, doc)
        valid = valid_anchor_mask(mask_r, doc)[0]
        if anchors is not None:
            chosen = torch.zeros_like(valid)
            wanted = torch.tensor([a for a in anchors[c] if 0 <= a < s], dtype=torch.long, device=device)
            chosen[wanted] = True
            valid = valid & chosen
        anchor_pos = torch.nonzero(valid).flatten()
        taus = []
        for chunk in torch.split(anchor_pos, anchors_per_chunk):
            anc = chunk.view(1, -1)
            keep = torch.ones_like(anc, dtype=torch.bool)
            lab, ok = build_block_labels(ids_r, tgt_tokens, mask_r, doc, anc, keep, b, labels)
            hidden = drafter_hidden(drafter, feats, ids_r, pos, doc, anc, keep)  # [1, A, B, D]
            pred = head(hidden[:, :, 1:].to(head.weight.dtype)).argmax(dim=-1)  # [1, A, B-1]
            correct = torch.cat([lab[:, :, :1], pred], dim=2) == lab
            taus.append(acceptance_lengths(correct, ok)[0].cpu())
        tau = torch.cat(taus) if taus else torch.zeros(0)
        all_tau.append(tau)
        first_tau.append(tau[anchor_pos.cpu() < _first_turn_end(mask_r[0].cpu())])
        per_conv.append(float(tau.mean()) if tau.numel() else float("nan"))
    joined = torch.cat(all_tau) if all_tau else torch.zeros(0)
    first = torch.cat(first_tau) if first_tau else torch.zeros(0)
    per_position = [float((joined - 1 >= k).float().mean()) if joined.numel() else float("nan")
                    for k in range(1, b)]
    return OfflineTau(tau=float(joined.mean()) if joined.numel() else float("nan"), blocks=int(joined.numel()),
                      first_turn_tau=float(first.mean()) if first.numel() else float("nan"),
                      first_turn_blocks=int(first.numel()), per_conversation=per_conv, per_position=per_position)


def measured_per_position(accepted: Sequence[int], block_size: int) -> list[float]:
    """``[B − 1]``: the fraction of verification passes that accepted block position ``k``
    (``m ≥ k``, i.e. ``m + 1 > k``), ``k = 1 … B−1``; ``nan`` without passes."""
    n = len(accepted)
    return [sum(a - 1 >= k for a in accepted) / n if n else float("nan") for k in range(1, block_size)]


# --------------------------------------------------------------------------- prompts


@dataclass
class PromptCase:
    """A held-out conversation and its prompt.

    Attributes:
        index: item of the held-out corpus; source_row: its row in the data file.
        prompt_ids: ``[P]`` int64: every token before the first assistant token, i.e. the
            chat-templated first user turn(s) ending with the assistant header (what
            ``apply_chat_template(..., add_generation_prompt=True)`` renders, tokenised the way
            training tokenised it).
        input_ids / loss_mask: ``[S]`` the whole tokenised conversation (for offline τ).
    """

    index: int
    source_row: int
    prompt_ids: Tensor
    input_ids: Tensor
    loss_mask: Tensor


def prompts_from_corpus(corpus: Any, count: int, max_prompt_tokens: Optional[int] = None,
                        tokenizer: Any = None) -> list[PromptCase]:
    """The first ``count`` conversations of ``corpus`` whose prompt has at most ``max_prompt_tokens`` tokens.

    Args:
        corpus: a :class:`dflash.data.corpus.TokenizedCorpus` (e.g. ``prepare_data(cfg, tok).heldout``).
        count: prompts wanted.
        max_prompt_tokens: skip longer prompts (``None`` = no limit).
        tokenizer: when given, skip prompts that do not end a user turn: a conversation that
            starts with the assistant has as its prompt only the template's system prompt and
            assistant header (:func:`user_turn_header` finds no user turn in it).

    Returns:
        up to ``count`` :class:`PromptCase` in corpus order (fewer when the corpus runs out).
    """
    header = user_turn_header(tokenizer) if tokenizer is not None else None
    skipped = 0
    out: list[PromptCase] = []
    for i in range(len(corpus)):
        if len(out) >= count:
            break
        ids, mask = corpus.get(i)
        first = torch.nonzero(mask).flatten()
        if first.numel() == 0 or int(first[0]) == 0:
            continue
        p = int(first[0])
        if max_prompt_tokens is not None and p > max_prompt_tokens:
            continue
        if header is not None and header not in tokenizer.decode(ids[:p].tolist(), skip_special_tokens=False):
            skipped += 1
            continue
        out.append(PromptCase(index=i, source_row=corpus.source_row(i), prompt_ids=ids[:p].clone(),
                              input_ids=ids, loss_mask=mask))
    if skipped:
        log.info("skipped %d held-out conversations whose prompt holds no user turn (assistant-first)", skipped)
    return out


#: Content that no template rewrites, used to find where a turn's content goes.
_MARKER = "DFLASHMARKERq7Z"


def user_turn_header(tokenizer: Any) -> Optional[str]:
    """The text the chat template puts before a user turn's content (ChatML: ``<|im_start|>user\\n``).

    Found by rendering ``[system, user]`` and ``[system]`` and taking what the user turn adds
    before its content. ``None`` when the tokenizer has no chat template or the rendering does not
    have that shape (then no prompt is skipped).
    """
    try:
        system = [{"role": "system", "content": _MARKER + "S"}]
        both = tokenizer.apply_chat_template(system + [{"role": "user", "content": _MARKER}], tokenize=False)
        alone = tokenizer.apply_chat_template(system, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - any template failure means "cannot tell"
        log.warning("no user-turn filter for prompts: the chat template failed (%s)", exc)
        return None
    head = both.rsplit(_MARKER, 1)[0]
    if not head.startswith(alone) or len(head) == len(alone):
        log.warning("no user-turn filter for prompts: unexpected chat template rendering")
        return None
    return head[len(alone):]


def stop_token_ids(tokenizer: Any, model: Optional[nn.Module] = None) -> list[int]:
    """Ids that end a response: the tokenizer's EOS, its end-of-turn tokens
    (:func:`dflash.data.corpus.end_of_turn_tokens`: ``<|im_end|>`` for ChatML) and the model's
    ``generation_config.eos_token_id``."""
    from dflash.data.corpus import end_of_turn_tokens

    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for text in end_of_turn_tokens(tokenizer):
        tid = tokenizer.convert_tokens_to_ids(text)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    gen = getattr(model, "generation_config", None) if model is not None else None
    eos = getattr(gen, "eos_token_id", None)
    if eos is not None:
        ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return sorted(ids)


# --------------------------------------------------------------------------- checkpoints and runs


def resolve_checkpoint(path: Union[str, Path]) -> tuple[Path, Optional[Path]]:
    """``(drafter directory, run directory or None)`` for a checkpoint path.

    Accepts a run directory ``runs/<name>`` (its newest checkpoint), a training checkpoint
    ``runs/<name>/checkpoints/step-XXXXXXXX`` (the drafter is its
    ``drafter/`` sub-directory; the run directory is two levels up) or a drafter directory itself.

    Raises:
        FileNotFoundError: no ``config.json`` found, or a run without a complete checkpoint.
    """
    p = Path(path)
    if not (p / "drafter" / "config.json").is_file() and not (p / "config.json").is_file() \
            and (p / "checkpoints").is_dir():  # a run directory: its newest checkpoint
        from dflash.training.checkpoint import latest_checkpoint

        newest = latest_checkpoint(p)
        if newest is None:
            raise FileNotFoundError(f"{p}: the run has no complete checkpoint under {p / 'checkpoints'}")
        p = newest
    if (p / "drafter" / "config.json").is_file():
        run = p.parent.parent if p.parent.name == "checkpoints" else None
        return p / "drafter", run
    if (p / "config.json").is_file():
        run = p.parent.parent.parent if p.parent.parent.name == "checkpoints" else None
        return p, run
    raise FileNotFoundError(f"{p}: neither a checkpoint (drafter/config.json) nor a drafter directory (config.json)")


def last_eval_tau(run_dir: Optional[Path], max_step: Optional[int] = None) -> Optional[tuple[int, float]]:
    """``(step, eval/tau)`` of the last held-out evaluation in ``run_dir/metrics.jsonl``.

    Args:
        run_dir: the run directory (``None`` = no run).
        max_step: ignore evaluations after this optimizer step (the checkpoint's step), so an
            older checkpoint is compared with the evaluation of its own weights or an earlier one.

    Returns:
        ``(step, tau)``, or ``None`` when there is no such evaluation (unreadable lines are skipped).
    """
    if run_dir is None:
        return None
    found = None
    for rec in read_jsonl_rows(Path(run_dir) / "metrics.jsonl"):
        if "eval/tau" not in rec:
            continue
        step = int(rec.get("step", -1))
        if max_step is None or step <= max_step:
            found = (step, float(rec["eval/tau"]))
    return found


def checkpoint_step(drafter_dir: Path) -> Optional[int]:
    """The optimizer step of the training checkpoint holding ``drafter_dir`` (its ``state.json``), or ``None``."""
    from dflash.training.checkpoint import read_state

    ckpt = Path(drafter_dir).parent
    if Path(drafter_dir).name != "drafter" or not (ckpt / "state.json").is_file():
        return None
    try:
        return int(read_state(ckpt)["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None




# --------------------------------------------------------------------------- the check


def _batches(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _pooled(gens: Sequence[Generation], batch: int) -> dict[str, float]:
    """Tokens/s and time split over prompts decoded ``batch`` at a time (a batch's time counted once)."""
    tokens = sum(len(g.tokens) for g in gens)
    groups = _batches(list(gens), batch)
    seconds = sum(grp[0].seconds for grp in groups)
    draft = sum(grp[0].draft_seconds for grp in groups)
    verify = sum(grp[0].verify_seconds for grp in groups)
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds if seconds else float("nan"),
            "draft_s": draft, "verify_s": verify, "host_s": max(0.0, seconds - draft - verify)}


def _continuation(case: PromptCase, gen: Generation) -> tuple[Tensor, Tensor]:
    """``(input_ids [P + N], loss_mask [P + N])``: the prompt followed by a decode's ``N`` tokens,
    the loss mask on the decoded tokens only."""
    ids = torch.cat([case.prompt_ids, torch.tensor(gen.tokens, dtype=torch.long)])
    mask = torch.zeros(ids.numel(), dtype=torch.bool)
    mask[case.prompt_ids.numel():] = True
    return ids, mask


@torch.no_grad()
def decode_report(target: Any, drafter: nn.Module, cases: Sequence["PromptCase"], *, max_new_tokens: int,
                  stop_ids: Sequence[int], batch: int = 1, compile: Optional[bool] = None, offline: bool = True,
                  labels: str = "target") -> dict[str, Any]:
    """Decode ``cases`` target-only and speculatively; compare; take τ apart. The check's core.

    Args:
        target: :class:`dflash.models.target.TargetModel` (its ``layer_ids`` are the drafter's).
        drafter: :class:`dflash.models.drafter.DFlashDraftModel`.
        cases: held-out prompts (:func:`prompts_from_corpus`).
        max_new_tokens / stop_ids: per prompt.
        batch: prompts decoded together.
        compile: CUDA graphs (``None`` = on CUDA).
        offline: also compute the offline τ values (dataset, own continuation, replay).
        labels: offline τ labels on the dataset conversations (training's ``drafter.labels``).

    Returns:
        ``{"summary": {...}, "prompts": [...]}``: per prompt and pooled τ, tokens/s both ways,
        speedup, time split, the first difference and its margins, per-position acceptance.
    """
    b_sz = int(drafter.block_size)
    dtype = target.dtype
    longest = max(c.prompt_ids.numel() for c in cases)
    max_len = longest + max(max_new_tokens, WARMUP_TOKENS) + b_sz + 1
    max_len = -(-max_len // 64) * 64
    gen = Generator(target.model, target.layer_ids, max_len, batch_size=batch, drafter=drafter, compile=compile)
    warm = [c.prompt_ids for c in cases[:batch]]
    t0 = time.perf_counter()
    gen.greedy(warm, WARMUP_TOKENS, stop_ids)
    gen.speculative(warm, WARMUP_TOKENS, stop_ids)
    warmup_s = time.perf_counter() - t0
    log.info("warm-up (%s) %.1f s", "compile + graph capture" if gen.compiled else "eager", warmup_s)

    prompts = [c.prompt_ids for c in cases]
    base: list[Generation] = []
    spec: list[Generation] = []
    bar = Progress(2 * len(cases) * max_new_tokens, desc="decoding", unit="tok", interval_s=PROGRESS_LOG_S,
                   logger=log)
    for group in _batches(prompts, batch):
        base += gen.greedy(group, max_new_tokens, stop_ids, progress=bar.advance)
    for group in _batches(prompts, batch):
        spec += gen.speculative(group, max_new_tokens, stop_ids, progress=bar.advance)
    bar.close()

    rows: list[dict[str, Any]] = []
    for case, t, s in zip(cases, base, spec):
        diff = first_difference(s, t, gen.num_layers, dtype)
        rows.append({"index": case.index, "source_row": case.source_row, "prompt_tokens": case.prompt_ids.numel(),
                     "new_tokens": len(s.tokens), "result": "identical" if diff is None else
                     ("tie" if diff.tie else "FAIL"), "difference": None if diff is None else vars(diff),
                     "tau": s.tau, "steps": s.steps, "accepted": s.accepted, "anchors": s.anchors,
                     "spec_tok_s": s.tokens_per_s, "target_tok_s": t.tokens_per_s,
                     "spec_s": s.seconds, "target_s": t.seconds, "draft_s": s.draft_seconds,
                     "verify_s": s.verify_seconds, "target_tokens": t.tokens})
        if diff is not None:
            (log.warning if diff.tie else log.error)(
                "prompt %d: speculative output differs from target-only greedy at token %d (%d vs %d): margins "
                "z1-z2 %.4f (speculative) / %.4f (target-only), tie bound %.4f: %s", case.index, diff.position,
                diff.spec_token, diff.target_token, diff.spec_margin, diff.target_margin, diff.bound,
                "a numerical tie" if diff.tie else "NOT a tie")

    all_accepted = [a for s in spec for a in s.accepted]
    steps = len(all_accepted)
    tau = sum(all_accepted) / steps if steps else float("nan")
    ps, pt = _pooled(spec, batch), _pooled(base, batch)
    summary: dict[str, Any] = {
        "prompts": len(rows), "max_new_tokens": max_new_tokens, "block_size": b_sz, "batch": batch,
        "dtype": str(dtype).replace("torch.", ""), "compiled": gen.compiled, "device": str(gen.device),
        "identical": sum(r["result"] == "identical" for r in rows), "ties": sum(r["result"] == "tie" for r in rows),
        "failures": sum(r["result"] == "FAIL" for r in rows),
        "tau": tau, "verification_steps": steps, "new_tokens": ps["tokens"],
        "spec_tok_s": ps["tok_s"], "target_tok_s": pt["tok_s"],
        "speedup": pt["seconds"] / ps["seconds"] if ps["seconds"] else float("nan"),
        "spec_s": ps["seconds"], "target_s": pt["seconds"], "draft_s": ps["draft_s"], "verify_s": ps["verify_s"],
        "host_s": ps["host_s"], "warmup_s": warmup_s,
        "per_position_measured": measured_per_position(all_accepted, b_sz)}
    if offline:
        data = offline_tau(target, drafter, [(c.input_ids, c.loss_mask) for c in cases], labels=labels)
        own = offline_tau(target, drafter, [_continuation(c, t) for c, t in zip(cases, base)], labels="target")
        replay = offline_tau(target, drafter, [_continuation(c, s) for c, s in zip(cases, spec)], labels="target",
                             anchors=[s.anchors for s in spec])
        for row, d, o, r in zip(rows, data.per_conversation, own.per_conversation, replay.per_conversation):
            row.update(offline_tau_dataset=d, offline_tau_own=o, offline_tau_replay=r)
        summary.update(offline_tau_dataset=data.tau, offline_tau_dataset_first_turn=data.first_turn_tau,
                       offline_tau_own=own.tau, offline_tau_replay=replay.tau, offline_blocks_own=own.blocks,
                       offline_blocks_replay=replay.blocks, per_position_offline_own=own.per_position,
                       per_position_offline_replay=replay.per_position,
                       per_position_offline_dataset=data.per_position,
                       measured_over_offline_own=tau / own.tau if own.tau else float("nan"))
    return {"summary": summary, "prompts": rows}


def _fmt(x: Optional[float], digits: int = 2) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def format_report(report: dict[str, Any], show_text: bool = False) -> str:
    """The report of :func:`decode_report` as text: a row per prompt, pooled lines, per-position acceptance."""
    s, rows = report["summary"], report["prompts"]
    lines = [f"{s['prompts']} held-out prompts, max {s['max_new_tokens']} new tokens, B={s['block_size']}, "
             f"batch {s['batch']}, {s['dtype']}, {'compiled' if s['compiled'] else 'eager'}, {s['device']}",
             "tau = mean tokens added per target verification pass (accepted drafts + 1 bonus token)", ""]
    lines.append(f"{'prompt':>6} {'row':>6} {'P':>4} {'new':>4} {'result':>9} {'tau':>5} {'steps':>5} "
                 f"{'spec tok/s':>10} {'target tok/s':>12} {'off own':>7} {'replay':>7} {'off data':>8}")
    for r in rows:
        lines.append(f"{r['index']:>6} {r['source_row']:>6} {r['prompt_tokens']:>4} {r['new_tokens']:>4} "
                     f"{r['result']:>9} {_fmt(r['tau']):>5} {r['steps']:>5} {_fmt(r['spec_tok_s'], 1):>10} "
                     f"{_fmt(r['target_tok_s'], 1):>12} {_fmt(r.get('offline_tau_own')):>7} "
                     f"{_fmt(r.get('offline_tau_replay')):>7} {_fmt(r.get('offline_tau_dataset')):>8}")
        d = r["difference"]
        if d is not None:
            lines.append(f"       differs at token {d['position']}: {d['spec_token']} vs {d['target_token']}, "
                         f"margin {_fmt(d['spec_margin'], 4)} / {_fmt(d['target_margin'], 4)} "
                         f"(tie bound {_fmt(d['bound'], 4)})")
        if show_text and "text" in r:
            lines.append(f"       {r['text']!r}")
    lines += ["", f"outputs: {s['identical']} identical, {s['ties']} differ at a numerical tie, "
                  f"{s['failures']} FAIL (of {s['prompts']})",
              f"measured tau: {_fmt(s['tau'], 3)} over {s['verification_steps']} verification passes, "
              f"{s['new_tokens']} tokens",
              f"tokens/s: speculative {_fmt(s['spec_tok_s'], 1)}, target-only {_fmt(s['target_tok_s'], 1)} "
              f"(speedup {_fmt(s['speedup'], 2)}x)",
              f"speculative time: {_fmt(s['spec_s'], 3)} s = draft {_fmt(s['draft_s'], 3)} + verify "
              f"{_fmt(s['verify_s'], 3)} + host {_fmt(s['host_s'], 3)}"]
    if "offline_tau_own" in s:
        lines += [f"offline tau: target's own continuation {_fmt(s['offline_tau_own'], 3)} "
                  f"({s['offline_blocks_own']} blocks, every anchor); at decoding's anchors (replay) "
                  f"{_fmt(s['offline_tau_replay'], 3)} ({s['offline_blocks_replay']} blocks); dataset conversations "
                  f"{_fmt(s['offline_tau_dataset'], 3)} (first turn {_fmt(s['offline_tau_dataset_first_turn'], 3)}); "
                  f"measured / own = {_fmt(s['measured_over_offline_own'], 3)}"]
    if "offline_tau_training_eval" in s and s["offline_tau_training_eval"] is not None:
        lines.append(f"offline tau, training eval (step {s['training_eval_step']}): "
                     f"{_fmt(s['offline_tau_training_eval'], 3)}")
    lines += ["", "acceptance per block position k (fraction of passes / blocks with m >= k):",
              f"{'k':>3} {'decoding':>9} {'replay':>7} {'own':>7} {'dataset':>7}"]
    for k, meas in enumerate(s["per_position_measured"], start=1):
        extra = ""
        if "per_position_offline_own" in s:
            extra = (f" {_fmt(s['per_position_offline_replay'][k - 1], 3):>7} "
                     f"{_fmt(s['per_position_offline_own'][k - 1], 3):>7} "
                     f"{_fmt(s['per_position_offline_dataset'][k - 1], 3):>7}")
        lines.append(f"{k:>3} {_fmt(meas, 3):>9}{extra}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI


def _parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash.inference.speculative",
                                description="Lossless speculative decoding with a trained DFlash drafter on "
                                            "held-out prompts: output check, measured and offline tau, tokens/s.")
    p.add_argument("--checkpoint", required=True,
                   help="runs/<name>/checkpoints/step-XXXXXXXX (or a drafter directory)")
    p.add_argument("--config", default=None,
                   help=f"run config (default: the run's config.yaml, else {DEFAULT_CONFIG})")
    p.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS, help="held-out prompts to decode")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="skip longer prompts (default: data.max_length - max_new_tokens, so decoding stays "
                        "within the trained length)")
    p.add_argument("--device", default=None, help="cpu / cuda (default: the config's cluster.device)")
    p.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="CUDA graphs for the decoding steps (auto = on CUDA)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-offline", action="store_true", help="skip the offline tau values")
    p.add_argument("--show-text", action="store_true", help="print each decoded response")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")
    p.add_argument("--force", action="store_true",
                   help="use a checkpoint trained with another tokenizer, chat template or thinking mode")
    p.add_argument("overrides", nargs="*", help="config overrides section.key=value")
    args = p.parse_args(argv)
    for name in ("prompts", "max_new_tokens", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    return args


def compile_flag(value: str) -> Optional[bool]:
    """``auto`` / ``on`` / ``off`` → ``None`` / ``True`` / ``False``."""
    return {"auto": None, "on": True, "off": False}[value]


def main(argv: Optional[list[str]] = None) -> int:
    """The CLI: decode held-out prompts both ways and print the report.

    Returns:
        0 when every speculative output is identical to target-only greedy or differs only at a
        numerical tie (:func:`tie_bound`), 1 otherwise, 2 when there is no usable prompt or the checkpoint
        does not fit the tokenizer, template, thinking mode or target (:func:`dflash.training.checkpoint.check_fits`).
    """
    from dflash.training.checkpoint import CheckpointMismatch, check_fits, run_identity
    from dflash.config import ConfigError, load_config
    from dflash.data.corpus import prepare_data
    from dflash.logs import setup_logging
    from dflash.models.drafter import DFlashDraftModel
    from dflash.models.target_loader import load_target
    from dflash.data.tokenizer import load_tokenizer

    args = _parse_args(argv)
    setup_logging("speculative")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        drafter_dir, run_dir = resolve_checkpoint(args.checkpoint)
        config_path = args.config
        if config_path is None:
            config_path = (str(run_dir / "config.yaml") if run_dir and (run_dir / "config.yaml").is_file()
                           else DEFAULT_CONFIG)
        cfg = load_config(config_path, args.overrides)
    except (FileNotFoundError, ConfigError) as exc:
        log.error("%s", exc)
        return 2
    dcfg = DFlashDraftModel.load_config(drafter_dir)
    device = torch.device(args.device or ("cuda" if cfg.cluster.device != "cpu" and torch.cuda.is_available()
                                          else "cpu"))
    tokenizer = load_tokenizer(cfg.target)
    try:  # before any model loads; the target's shape is compared once it is loaded
        check_fits(drafter_dir, run_identity(tokenizer, None, list(dcfg.target_layer_ids), cfg.data.enable_thinking),
                   force=args.force)  # logs what --force accepts
    except CheckpointMismatch as exc:
        log.error("%s", exc)
        return 2
    # The drafter's checkpoint decides which target layers feed it.
    target_cfg = replace(cfg.target, layer_ids=list(dcfg.target_layer_ids))
    target = load_target(target_cfg, device, num_drafter_layers=dcfg.num_hidden_layers)
    if target.num_layers != dcfg.num_target_layers or target.hidden_size != dcfg.hidden_size:
        log.error("%s: drafter for a %d-layer, D=%d target; this target has %d layers, D=%d", drafter_dir,
                  dcfg.num_target_layers, dcfg.hidden_size, target.num_layers, target.hidden_size)
        return 2
    drafter = DFlashDraftModel.from_pretrained(drafter_dir, target.embed_tokens, target.lm_head, attention="sdpa",
                                               device=device).eval()
    stops = stop_token_ids(tokenizer, target.model)
    max_prompt = args.max_prompt_tokens
    if max_prompt is None:
        max_prompt = max(1, cfg.data.max_length - args.max_new_tokens)
    cases = prompts_from_corpus(prepare_data(cfg, tokenizer).heldout, args.prompts, max_prompt, tokenizer=tokenizer)
    if not cases:
        log.error("no held-out prompt of at most %d tokens that ends a user turn", max_prompt)
        return 2
    if len(cases) < args.prompts:
        log.warning("only %d held-out prompts of at most %d tokens", len(cases), max_prompt)
    log.info("drafter %s: B=%d, target layers %s, mask %s; %d prompts, max %d new tokens, stop ids %s, "
             "%d torch threads", drafter_dir, dcfg.block_size, dcfg.target_layer_ids,
             dcfg.mask_token_id, len(cases),
             args.max_new_tokens, stops, torch.get_num_threads())
    report = decode_report(target, drafter, cases, max_new_tokens=args.max_new_tokens, stop_ids=stops,
                           batch=args.batch, compile=compile_flag(args.compile), offline=not args.no_offline,
                           labels=cfg.drafter.labels)
    step = checkpoint_step(drafter_dir)
    trained = last_eval_tau(run_dir, max_step=step)
    report["summary"].update(checkpoint=str(args.checkpoint), checkpoint_step=step,
                             offline_tau_training_eval=trained[1] if trained else None,
                             training_eval_step=trained[0] if trained else None, threads=torch.get_num_threads())
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
