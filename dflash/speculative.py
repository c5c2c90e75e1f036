"""Lossless greedy speculative decoding with a trained DFlash drafter, and offline vs measured τ.

What happens per step (DFlash paper, arXiv 2602.06036, §3; docs/DFLASH.md), for a sequence
``x[0 … n]`` whose last token ``x[n]`` (the *anchor*) was the target's latest prediction:

1. **Draft.** The target has computed its hidden states for positions ``0 … n−1`` (not for the
   anchor: that needs a forward pass of ``x[n]``). The fused layer outputs at those positions are
   the context features ``[n, L·D]``. The drafter gets the block ``[x[n], MASK × (B−1)]`` at
   positions ``n … n+B−1`` and proposes ``d_1 … d_{B−1}`` = argmax of its slots 1 … B−1. It is
   called exactly as in training (:meth:`dflash.model.DFlashDraftModel.forward`): one row
   ``S = n + 1`` (the anchor's own feature row is zeros; the attention mask hides every
   context position ``j ≥ n``), ``doc_ids`` all 1, ``position_ids = arange(S)``,
   ``anchors = [[n]]``, ``keep = [[True]]``.
2. **Verify.** One target forward pass over ``[x[n], d_1, …, d_{B−1}]`` at positions
   ``n … n+B−1`` on top of the KV cache of ``0 … n−1`` gives the target's greedy tokens
   ``g_0 … g_{B−1}`` (``g_k`` = its prediction for position ``n+k+1``).
3. **Accept.** ``m`` = the number of leading ``k`` with ``d_{k+1} = g_k``; the tokens
   ``d_1 … d_m`` and the *bonus* ``g_m`` are appended (``m + 1`` tokens). Every appended token is
   the target's own greedy choice given the tokens before it, so the output equals target-only
   greedy decoding token for token (*lossless*; Leviathan et al. 2023, Chen et al. 2023). The KV
   cache is cropped to ``0 … n+m`` and the features of positions ``n … n+m`` (computed on correct
   tokens) are appended; the bonus becomes the next anchor.

**Acceptance length τ** (measured): the mean, over the target's verification passes, of the
tokens each pass adds, ``m + 1`` (accepted drafts *plus the bonus*), so ``1 ≤ τ ≤ B``: a drafter
that is always right gives τ = B, one that is always wrong τ = 1. The prefill pass (which yields
the first new token) is not a verification pass and is not counted. The last pass counts its full
``m + 1`` even when EOS or ``max_new_tokens`` cuts some of those tokens from the output.
Over several prompts τ is pooled: Σ(m + 1) / Σ passes.

**Offline τ** (:func:`offline_tau`) is what training's evaluation measures
(:func:`dflash.objective.acceptance_lengths`): on a dataset conversation with the target's
features and greedy labels (``target_tokens[a+k−1]``), ``1 +`` the leading slots whose argmax
equals the label, averaged over blocks. Here every valid anchor of the conversation is used (the
eval rounds draw ``drafter.anchors_per_row`` per packed row); it differs from the measured τ in that the context is the
*dataset's* response, not the target's own greedy continuation, and a block stops at the end of
the assistant turn or of the (``data.max_length``-truncated) sequence.

Speed: a step costs one drafter forward plus one B-token target pass. On a CPU the B-token pass
is compute-bound (SmolLM2-135M, B = 8, 1 thread: ~74 ms with features and 8 positions of logits
vs ~40 ms for a one-token step, plus ~20 ms of drafting), so speculative decoding only beats
target-only decoding there above τ ≈ 2.4; the tokens/s of the CLI report what was measured.

Context length: the drafter's RoPE is computed for any position and its dense SDPA mask is
``[1, 1, B, S + B]``, so ``S`` may exceed the training length; quality beyond it is untrained,
which is why the CLI by default keeps prompt + generation within ``data.max_length``.

CLI::

    python -m dflash.speculative --checkpoint runs/<name>/checkpoints/step-XXXXXXXX \\
        [--config configs/smollm2-135m-cpu.yaml] [--prompts 8] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence, Union

import torch
from torch import Tensor, nn

from dflash.objective import acceptance_lengths, build_block_labels, valid_anchor_mask

__all__ = [
    "DecodeResult",
    "SpeculativeResult",
    "Proposer",
    "DFlashProposer",
    "CachedTarget",
    "naive_greedy_decode",
    "greedy_decode",
    "speculative_decode",
    "OfflineTau",
    "offline_tau",
    "PromptCase",
    "prompts_from_corpus",
    "stop_token_ids",
    "resolve_checkpoint",
    "last_eval_tau",
    "checkpoint_step",
    "main",
]

log = logging.getLogger(__name__)

#: Anchors per drafter forward in :func:`offline_tau` (bounds the ``[A·(B−1), V]`` logits).
OFFLINE_ANCHORS_PER_CHUNK = 64
#: Default CLI settings.
DEFAULT_PROMPTS = 8
DEFAULT_MAX_NEW_TOKENS = 96
DEFAULT_CONFIG = "configs/smollm2-135m-cpu.yaml"
#: Tokens generated (and thrown away) by each decoder once before timing, so that first-call
#: allocations do not count against either side.
WARMUP_TOKENS = 8


# --------------------------------------------------------------------------- results


@dataclass
class DecodeResult:
    """Tokens generated for one prompt and how long it took.

    Attributes:
        tokens: generated token ids (the prompt excluded); ends with the first stop token
            (included) or after ``max_new_tokens``.
        seconds: wall time of the whole decode (prefill included), in s.
        target_forwards: target forward passes (prefill included).
    """

    tokens: list[int]
    seconds: float = 0.0
    target_forwards: int = 0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time (``nan`` for a zero-time decode)."""
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class SpeculativeResult(DecodeResult):
    """A speculative decode: :class:`DecodeResult` plus one entry per verification pass.

    Attributes:
        accepted: ``m + 1`` per verification pass (accepted drafts plus the bonus token).
        draft_seconds / verify_seconds: time in the drafter / in target verification passes, in s.
    """

    accepted: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def steps(self) -> int:
        """Verification passes."""
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Measured acceptance length: ``mean(m + 1)`` over verification passes (``nan`` if none)."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else float("nan")


# --------------------------------------------------------------------------- the target, incrementally


def _cache_kwarg(model: nn.Module) -> str:
    """Name of the KV-cache argument of ``model.forward``: ``cache`` (transformers ≥ 5.2x, where
    ``past_key_values`` is deprecated) or ``past_key_values`` (earlier 5.x)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class CachedTarget:
    """A Hugging Face causal LM run incrementally on one sequence with its KV cache.

    Each :meth:`extend` feeds the next tokens on top of the cache and returns their logits and
    the DFlash context features ``[T, L·D]`` (the outputs of ``layer_ids``, i.e. transformers'
    ``hidden_states[id + 1]``, concatenated in ``layer_ids`` order: the same features as
    :meth:`dflash.target.TargetModel.forward_features`, whose last layer is also final-normed).
    :meth:`truncate` drops rejected positions from the cache.

    The cache is the one the model creates on its first call (a ``DynamicCache``); cropping uses
    ``crop(-k)`` (remove ``k`` tokens), which transformers 5.17 and 5.24 both accept.

    Args:
        model: the target's ``*ForCausalLM`` (``TargetModel.model``), eval mode.
        layer_ids: fused layer ids (the drafter's ``dflash_config.target_layer_ids``).
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]) -> None:
        self.model = model
        self.layer_ids = [int(i) for i in layer_ids]
        self._cache_arg = _cache_kwarg(model)
        self.cache: Any = None
        self.length = 0

    def reset(self) -> None:
        """Forget the sequence (a new prompt starts)."""
        self.cache = None
        self.length = 0

    @torch.no_grad()
    def extend(self, input_ids: Tensor, *, all_logits: bool = True, features: bool = True
               ) -> tuple[Tensor, Optional[Tensor]]:
        """Run ``input_ids`` at positions ``length … length+T−1``.

        Args:
            input_ids: ``[T]`` int64 on the model's device.
            all_logits: logits for every position (``[T, V]``), else only the last (``[1, V]``).
            features: also return the fused layer outputs.

        Returns:
            ``(logits [T or 1, V] fp32, features [T, L·D] in the model dtype or None)``.
        """
        kwargs: dict[str, Any] = {"input_ids": input_ids.view(1, -1), "use_cache": True,
                                  "logits_to_keep": 0 if all_logits else 1}
        if self.cache is not None:
            kwargs[self._cache_arg] = self.cache
        if features:
            kwargs["output_hidden_states"] = True
        out = self.model(**kwargs)
        if self.cache is None:
            self.cache = out.past_key_values if getattr(out, "past_key_values", None) is not None else out.cache
        self.length += input_ids.numel()
        feats = None
        if features:
            hs = out.hidden_states
            feats = torch.cat([hs[i + 1][0] for i in self.layer_ids], dim=-1)
        return out.logits[0].float(), feats

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions of the cache.

        Raises:
            ValueError: ``length`` is negative or more than the cached length.
            RuntimeError: the cache did not end up at ``length`` (an unsupported cache type).
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate to {length}: the cache holds {self.length} positions")
        remove = self.length - length
        if remove:
            self.cache.crop(-remove)
            self.length = length
        got = self.cache.get_seq_length()
        if got != length:
            raise RuntimeError(f"KV cache holds {got} positions after cropping to {length}")


def _stop_index(tokens: Sequence[int], stop_ids: frozenset[int]) -> Optional[int]:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return i
    return None


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def naive_greedy_decode(model: nn.Module, prompt_ids: Tensor, max_new_tokens: int,
                        stop_ids: Sequence[int] = ()) -> DecodeResult:
    """Target-only greedy decoding, the slow obvious way: a full forward of the whole sequence per token.

    The oracle of the tests (no KV cache, no features, nothing to get wrong).

    Args:
        model: a Hugging Face causal LM.
        prompt_ids: ``[P]`` int64.
        max_new_tokens: generate at most this many tokens.
        stop_ids: stop after emitting one of these (it is kept in the output).
    """
    device = _device_of(model)
    seq = prompt_ids.to(device).view(1, -1)
    stops = frozenset(int(s) for s in stop_ids)
    out: list[int] = []
    start = time.perf_counter()
    while len(out) < max_new_tokens:
        tok = int(model(input_ids=seq, use_cache=False).logits[0, -1].argmax())
        out.append(tok)
        if tok in stops:
            break
        seq = torch.cat([seq, seq.new_tensor([[tok]])], dim=1)
    return DecodeResult(out, time.perf_counter() - start, len(out))


@torch.no_grad()
def greedy_decode(model: nn.Module, prompt_ids: Tensor, max_new_tokens: int,
                  stop_ids: Sequence[int] = ()) -> DecodeResult:
    """Target-only greedy decoding with the KV cache: prefill, then one token per forward pass.

    The baseline of the tokens/s comparison (the same model, cache and argmax as
    :func:`speculative_decode`, without features).

    Args / Returns: as :func:`naive_greedy_decode`.
    """
    device = _device_of(model)
    runner = CachedTarget(model, [])
    stops = frozenset(int(s) for s in stop_ids)
    out: list[int] = []
    _sync(device)
    start = time.perf_counter()
    if max_new_tokens > 0:
        logits, _ = runner.extend(prompt_ids.to(device), all_logits=False, features=False)
        forwards = 1
        while True:
            tok = int(logits[-1].argmax())
            out.append(tok)
            if tok in stops or len(out) >= max_new_tokens:
                break
            logits, _ = runner.extend(torch.tensor([tok], device=device), all_logits=False, features=False)
            forwards += 1
    else:
        forwards = 0
    _sync(device)
    return DecodeResult(out, time.perf_counter() - start, forwards)


# --------------------------------------------------------------------------- drafting


class Proposer(Protocol):
    """Proposes ``B − 1`` tokens after the anchor.

    ``block_size`` is ``B``. Called as ``proposer(input_ids [n+1], context_features [n, L·D])``:
    the sequence up to and including the anchor ``input_ids[n]``, and the target's fused features
    at positions ``0 … n−1``. Returns ``[B − 1]`` int64 token ids for positions ``n+1 … n+B−1``.
    """

    block_size: int

    def __call__(self, input_ids: Tensor, context_features: Tensor) -> Tensor: ...


def _autocast_dtype(dtype: torch.dtype, device: torch.device) -> Optional[torch.dtype]:
    """bf16/fp16 autocast on CUDA when the target runs in half precision (as training does), else none."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return dtype
    return None


def _drafter_hidden(drafter: nn.Module, features: Tensor, input_ids: Tensor, position_ids: Tensor,
                    doc_ids: Tensor, anchors: Tensor, keep: Tensor) -> Tensor:
    """The drafter's forward under the autocast training used (bf16 on CUDA, none on CPU)."""
    amp = _autocast_dtype(features.dtype, features.device)
    if amp is None:
        param_dtype = next(drafter.parameters()).dtype
        return drafter(features.to(param_dtype), input_ids, position_ids, doc_ids, anchors, keep)
    with torch.autocast(features.device.type, dtype=amp):
        return drafter(features, input_ids, position_ids, doc_ids, anchors, keep)


class DFlashProposer:
    """The trained DFlash drafter as a :class:`Proposer`.

    Builds one row of length ``S = n + 1``: ``context_features`` plus a zero row for the anchor
    (masked: the block sees context ``j < n`` only), ``doc_ids`` all 1, ``position_ids =
    arange(S)``, ``anchors = [[n]]``, ``keep = [[True]]``; drafted tokens = argmax of
    ``lm_head(hidden)`` at slots 1 … B−1 (ties to the lowest id).

    Args:
        drafter: a :class:`dflash.model.DFlashDraftModel` (eval mode is set here).
    """

    def __init__(self, drafter: nn.Module) -> None:
        self.drafter = drafter.eval()
        self.block_size = int(drafter.block_size)

    @torch.no_grad()
    def __call__(self, input_ids: Tensor, context_features: Tensor) -> Tensor:
        n = input_ids.numel() - 1
        if context_features.shape[0] != n:
            raise ValueError(f"context_features has {context_features.shape[0]} rows for anchor position {n}")
        device = input_ids.device
        s = n + 1
        feats = torch.cat([context_features, context_features.new_zeros(1, context_features.shape[1])])
        hidden = _drafter_hidden(
            self.drafter, feats.unsqueeze(0), input_ids.view(1, s), torch.arange(s, device=device).view(1, s),
            torch.ones(1, s, dtype=torch.int32, device=device), torch.tensor([[n]], device=device),
            torch.ones(1, 1, dtype=torch.bool, device=device))  # [1, 1, B, D]
        head = self.drafter.lm_head
        logits = head(hidden[0, 0, 1:].to(head.weight.dtype))  # [B-1, V]
        return logits.argmax(dim=-1)


# --------------------------------------------------------------------------- speculative decoding


@torch.no_grad()
def speculative_decode(model: nn.Module, layer_ids: Sequence[int], proposer: Proposer, prompt_ids: Tensor,
                       max_new_tokens: int, stop_ids: Sequence[int] = ()) -> SpeculativeResult:
    """Greedy speculative decoding: draft ``B − 1`` tokens, verify them in one target pass, accept.

    See the module docstring for the algorithm and the definition of τ. The output equals
    :func:`naive_greedy_decode` (lossless) for any proposer, up to floating-point differences
    between a B-token and a 1-token forward pass that could flip an exact argmax tie.

    Args:
        model: the target's Hugging Face causal LM.
        layer_ids: target layers whose outputs form the context features (must be those the
            drafter was trained on).
        proposer: the drafter (:class:`DFlashProposer`) or any :class:`Proposer`.
        prompt_ids: ``[P]`` int64, ``P ≥ 1``.
        max_new_tokens: generate at most this many tokens.
        stop_ids: stop after emitting one of these (kept in the output).

    Returns:
        :class:`SpeculativeResult`.

    Raises:
        ValueError: an empty prompt, or a proposer that returns the wrong number of tokens.
    """
    if prompt_ids.numel() < 1:
        raise ValueError("prompt_ids: need at least one token")
    device = _device_of(model)
    b = int(proposer.block_size)
    stops = frozenset(int(s) for s in stop_ids)
    runner = CachedTarget(model, layer_ids)
    result = SpeculativeResult(tokens=[])
    if max_new_tokens < 1:
        return result
    _sync(device)
    start = time.perf_counter()
    seq = prompt_ids.to(device).view(-1)
    logits, feats = runner.extend(seq, all_logits=False)
    result.target_forwards = 1
    features = [feats]  # rows = positions 0 … len(seq) − 2 once the anchor is appended
    first = int(logits[-1].argmax())
    result.tokens.append(first)
    seq = torch.cat([seq, seq.new_tensor([first])])
    done = first in stops or max_new_tokens <= 1
    while not done:
        n = seq.numel() - 1  # the anchor's position; the cache and the features cover 0 … n−1
        context = torch.cat(features) if len(features) > 1 else features[0]
        features = [context]
        t0 = time.perf_counter()
        drafts = proposer(seq, context).to(device=device, dtype=torch.long).view(-1)
        _sync(device)
        t1 = time.perf_counter()
        if drafts.numel() != b - 1:
            raise ValueError(f"proposer returned {drafts.numel()} tokens, expected B - 1 = {b - 1}")
        block = torch.cat([seq[n:], drafts])  # [B] at positions n … n+B−1
        logits, feats = runner.extend(block)
        result.target_forwards += 1
        greedy = logits.argmax(dim=-1)  # [B]: greedy[k] is the target's token for position n+k+1
        m = int(torch.cumprod((drafts == greedy[:-1]).long(), dim=0).sum())
        new = drafts[:m].tolist() + [int(greedy[m])]
        runner.truncate(n + m + 1)
        features.append(feats[:m + 1])
        _sync(device)
        result.draft_seconds += t1 - t0
        result.verify_seconds += time.perf_counter() - t1
        result.accepted.append(m + 1)
        stop_at = _stop_index(new, stops)
        if stop_at is not None:
            new = new[:stop_at + 1]
            done = True
        room = max_new_tokens - len(result.tokens)
        if len(new) >= room:
            new = new[:room]
            done = True
        result.tokens.extend(new)
        seq = torch.cat([seq, seq.new_tensor(new)])
    result.seconds = time.perf_counter() - start
    return result


# --------------------------------------------------------------------------- offline τ


@dataclass
class OfflineTau:
    """Offline acceptance length on dataset conversations (training's τ, every valid anchor).

    Attributes:
        tau / blocks: mean τ over all blocks of all conversations, and their number.
        first_turn_tau / first_turn_blocks: the same over anchors inside the first assistant turn
            (the part a decode of the first prompt generates).
        per_conversation: τ of each conversation (``nan`` without a valid anchor).
    """

    tau: float
    blocks: int
    first_turn_tau: float
    first_turn_blocks: int
    per_conversation: list[float]


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
                labels: str = "target", anchors_per_chunk: int = OFFLINE_ANCHORS_PER_CHUNK) -> OfflineTau:
    """Training's held-out τ on whole conversations, with every valid anchor.

    For each conversation: the target's ``features [1, S, L·D]`` and greedy ``target_tokens``
    (:meth:`dflash.target.TargetModel.forward_features`, as the target workers compute them);
    anchors = every position ``p`` with ``loss_mask[p] & loss_mask[p+1]``
    (:func:`dflash.objective.valid_anchor_mask`); labels and slot validity from
    :func:`dflash.objective.build_block_labels`; τ per block from
    :func:`dflash.objective.acceptance_lengths` on the argmax of ``lm_head(hidden)``.

    Args:
        target: a :class:`dflash.target.TargetModel` whose ``layer_ids`` are the drafter's.
        drafter: :class:`dflash.model.DFlashDraftModel`.
        conversations: ``(input_ids [S] int64, loss_mask [S] bool)`` each.
        labels: ``target`` (the target's greedy tokens, training's default) or ``data``.
        anchors_per_chunk: anchors per drafter forward.

    Returns:
        :class:`OfflineTau`.
    """
    drafter.eval()
    device = target.device
    b = int(drafter.block_size)
    head = drafter.lm_head
    all_tau: list[Tensor] = []
    first_tau: list[Tensor] = []
    per_conv: list[float] = []
    for ids, mask in conversations:
        s = ids.numel()
        ids_r = ids.to(device).view(1, s)
        mask_r = mask.to(device).bool().view(1, s)
        pos = torch.arange(s, device=device).view(1, s)
        doc = torch.ones(1, s, dtype=torch.int32, device=device)
        feats, tgt_tokens = target.forward_features(ids_r, pos, doc)
        anchor_pos = torch.nonzero(valid_anchor_mask(mask_r, doc)[0]).flatten()
        taus = []
        for chunk in torch.split(anchor_pos, anchors_per_chunk):
            anc = chunk.view(1, -1)
            keep = torch.ones_like(anc, dtype=torch.bool)
            lab, valid = build_block_labels(ids_r, tgt_tokens, mask_r, doc, anc, keep, b, labels)
            hidden = _drafter_hidden(drafter, feats, ids_r, pos, doc, anc, keep)  # [1, A, B, D]
            pred = head(hidden[:, :, 1:].to(head.weight.dtype)).argmax(dim=-1)  # [1, A, B-1]
            correct = torch.cat([lab[:, :, :1], pred], dim=2) == lab
            taus.append(acceptance_lengths(correct, valid)[0].cpu())
        tau = torch.cat(taus) if taus else torch.zeros(0)
        all_tau.append(tau)
        first_tau.append(tau[anchor_pos.cpu() < _first_turn_end(mask_r[0].cpu())])
        per_conv.append(float(tau.mean()) if tau.numel() else float("nan"))
    joined = torch.cat(all_tau) if all_tau else torch.zeros(0)
    first = torch.cat(first_tau) if first_tau else torch.zeros(0)
    return OfflineTau(tau=float(joined.mean()) if joined.numel() else float("nan"), blocks=int(joined.numel()),
                      first_turn_tau=float(first.mean()) if first.numel() else float("nan"),
                      first_turn_blocks=int(first.numel()), per_conversation=per_conv)


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


def prompts_from_corpus(corpus: Any, count: int, max_prompt_tokens: Optional[int] = None) -> list[PromptCase]:
    """The first ``count`` conversations of ``corpus`` whose prompt has at most ``max_prompt_tokens`` tokens.

    Args:
        corpus: a :class:`dflash.data.TokenizedCorpus` (e.g. ``prepare_data(cfg, tok).heldout``).
        count: prompts wanted.
        max_prompt_tokens: skip longer prompts (``None`` = no limit).

    Returns:
        up to ``count`` :class:`PromptCase` in corpus order (fewer when the corpus runs out).
    """
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
        out.append(PromptCase(index=i, source_row=corpus.source_row(i), prompt_ids=ids[:p].clone(),
                              input_ids=ids, loss_mask=mask))
    return out


def stop_token_ids(tokenizer: Any, model: Optional[nn.Module] = None) -> list[int]:
    """Ids that end a response: the tokenizer's EOS, its end-of-turn tokens
    (:func:`dflash.data.end_of_turn_tokens`: ``<|im_end|>`` for ChatML) and the model's
    ``generation_config.eos_token_id``."""
    from dflash.data import end_of_turn_tokens

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

    Accepts a training checkpoint ``runs/<name>/checkpoints/step-XXXXXXXX`` (the drafter is its
    ``drafter/`` sub-directory; the run directory is two levels up) or a drafter directory itself.

    Raises:
        FileNotFoundError: no ``config.json`` found.
    """
    p = Path(path)
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
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    found = None
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(rec, dict) or "eval/tau" not in rec:
            continue
        step = int(rec.get("step", -1))
        if max_step is None or step <= max_step:
            found = (step, float(rec["eval/tau"]))
    return found


def checkpoint_step(drafter_dir: Path) -> Optional[int]:
    """The optimizer step of the training checkpoint holding ``drafter_dir`` (its ``state.json``), or ``None``."""
    from dflash.checkpoint import read_state

    ckpt = Path(drafter_dir).parent
    if Path(drafter_dir).name != "drafter" or not (ckpt / "state.json").is_file():
        return None
    try:
        return int(read_state(ckpt)["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


# --------------------------------------------------------------------------- CLI


def _parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash.speculative",
                                description="Lossless speculative decoding with a trained DFlash drafter on "
                                            "held-out prompts: identical output, measured and offline tau, tokens/s.")
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
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-offline", action="store_true", help="skip the offline tau of the same conversations")
    p.add_argument("--show-text", action="store_true", help="print each decoded response")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")
    p.add_argument("overrides", nargs="*", help="config overrides section.key=value")
    return p.parse_args(argv)


def _fmt(x: float, digits: int = 2) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def main(argv: Optional[list[str]] = None) -> int:
    """The CLI: decode held-out prompts both ways and print the report.

    Returns:
        0 when every speculative output equals the target-only output, else 1.
    """
    from dflash.config import load_config
    from dflash.data import prepare_data
    from dflash.logs import setup_logging
    from dflash.model import DFlashDraftModel
    from dflash.target import load_target
    from dflash.tokenizer import load_tokenizer

    args = _parse_args(argv)
    setup_logging("speculative")
    if args.threads:
        torch.set_num_threads(args.threads)
    drafter_dir, run_dir = resolve_checkpoint(args.checkpoint)
    config_path = args.config
    if config_path is None:
        config_path = str(run_dir / "config.yaml") if run_dir and (run_dir / "config.yaml").is_file() else DEFAULT_CONFIG
    cfg = load_config(config_path, args.overrides)
    dcfg = DFlashDraftModel.load_config(drafter_dir)
    device = torch.device(args.device or ("cuda" if cfg.cluster.device != "cpu" and torch.cuda.is_available()
                                          else "cpu"))
    # The drafter's checkpoint decides which target layers feed it.
    target_cfg = replace(cfg.target, layer_ids=list(dcfg.target_layer_ids))
    target = load_target(target_cfg, device, num_drafter_layers=dcfg.num_hidden_layers)
    if target.num_layers != dcfg.num_target_layers or target.hidden_size != dcfg.hidden_size:
        raise ValueError(f"{drafter_dir}: drafter for a {dcfg.num_target_layers}-layer, D={dcfg.hidden_size} target; "
                         f"this target has {target.num_layers} layers, D={target.hidden_size}")
    drafter = DFlashDraftModel.from_pretrained(drafter_dir, target.embed_tokens, target.lm_head, attention="sdpa",
                                               device=device).eval()
    tokenizer = load_tokenizer(cfg.target)
    stops = stop_token_ids(tokenizer, target.model)
    max_prompt = args.max_prompt_tokens
    if max_prompt is None:
        max_prompt = max(1, cfg.data.max_length - args.max_new_tokens)
    cases = prompts_from_corpus(prepare_data(cfg, tokenizer).heldout, args.prompts, max_prompt)
    if not cases:
        log.error("no held-out prompt of at most %d tokens", max_prompt)
        return 2
    if len(cases) < args.prompts:
        log.warning("only %d held-out prompts of at most %d tokens", len(cases), max_prompt)
    log.info("drafter %s: B=%d, target layers %s, mask %s; %d prompts, max %d new tokens, stop ids %s, "
             "%d torch threads", drafter_dir, dcfg.block_size, dcfg.target_layer_ids,
             dcfg.mask_token_id, len(cases),
             args.max_new_tokens, stops, torch.get_num_threads())

    proposer = DFlashProposer(drafter)
    warm = cases[0].prompt_ids
    greedy_decode(target.model, warm, WARMUP_TOKENS, stops)
    speculative_decode(target.model, dcfg.target_layer_ids, proposer, warm, WARMUP_TOKENS, stops)

    rows = []
    for case in cases:
        base = greedy_decode(target.model, case.prompt_ids, args.max_new_tokens, stops)
        spec = speculative_decode(target.model, dcfg.target_layer_ids, proposer, case.prompt_ids,
                                  args.max_new_tokens, stops)
        same = spec.tokens == base.tokens
        rows.append({"index": case.index, "source_row": case.source_row, "prompt_tokens": case.prompt_ids.numel(),
                     "new_tokens": len(spec.tokens), "identical": same, "tau": spec.tau, "steps": spec.steps,
                     "accepted": spec.accepted, "spec_s": spec.seconds, "target_s": base.seconds,
                     "spec_tok_s": spec.tokens_per_s, "target_tok_s": base.tokens_per_s,
                     "draft_s": spec.draft_seconds, "verify_s": spec.verify_seconds})
        if not same:
            diverge = next((i for i, (a, b) in enumerate(zip(spec.tokens, base.tokens)) if a != b),
                           min(len(spec.tokens), len(base.tokens)))
            log.error("prompt %d: speculative output differs from target-only greedy at token %d", case.index,
                      diverge)
        if args.show_text:
            rows[-1]["text"] = tokenizer.decode(base.tokens)

    offline = None
    if not args.no_offline:
        offline = offline_tau(target, drafter, [(c.input_ids, c.loss_mask) for c in cases],
                              labels=cfg.drafter.labels)
        for row, t in zip(rows, offline.per_conversation):
            row["offline_tau"] = t
    step = checkpoint_step(drafter_dir)
    trained = last_eval_tau(run_dir, max_step=step)

    steps = sum(r["steps"] for r in rows)
    tau = sum(sum(r["accepted"]) for r in rows) / steps if steps else float("nan")
    tokens = sum(r["new_tokens"] for r in rows)
    spec_s = sum(r["spec_s"] for r in rows)
    base_s = sum(r["target_s"] for r in rows)
    summary = {"checkpoint": str(args.checkpoint), "checkpoint_step": step, "prompts": len(rows), "max_new_tokens": args.max_new_tokens,
               "block_size": dcfg.block_size, "identical_all": all(r["identical"] for r in rows),
               "tau": tau, "verification_steps": steps, "new_tokens": tokens,
               "spec_tok_s": tokens / spec_s if spec_s else float("nan"),
               "target_tok_s": tokens / base_s if base_s else float("nan"),
               "speedup": base_s / spec_s if spec_s else float("nan"),
               "offline_tau_same_conversations": offline.tau if offline else None,
               "offline_tau_first_turn": offline.first_turn_tau if offline else None,
               "offline_tau_training_eval": trained[1] if trained else None,
               "training_eval_step": trained[0] if trained else None,
               "device": str(device), "threads": torch.get_num_threads()}
    if trained:
        summary["measured_over_training_eval"] = tau / trained[1]
    if offline:
        summary["measured_over_offline_same"] = tau / offline.tau

    print(f"\nSpeculative decoding: {drafter_dir} (B={dcfg.block_size}), {len(rows)} held-out prompts, "
          f"max {args.max_new_tokens} new tokens, {device}, {torch.get_num_threads()} threads")
    print("tau = mean tokens added per target verification pass (accepted drafts + 1 bonus token)\n")
    head = (f"{'prompt':>6} {'row':>6} {'P':>4} {'new':>4} {'same':>4} {'tau':>5} {'steps':>5} "
            f"{'spec tok/s':>10} {'target tok/s':>12} {'offline tau':>11}")
    print(head)
    for r in rows:
        print(f"{r['index']:>6} {r['source_row']:>6} {r['prompt_tokens']:>4} {r['new_tokens']:>4} "
              f"{'yes' if r['identical'] else 'NO':>4} {_fmt(r['tau']):>5} {r['steps']:>5} "
              f"{_fmt(r['spec_tok_s'], 1):>10} {_fmt(r['target_tok_s'], 1):>12} "
              f"{_fmt(r.get('offline_tau', float('nan'))):>11}")
        if args.show_text:
            print(f"       {r['text']!r}")
    print(f"\nidentical outputs: {sum(r['identical'] for r in rows)}/{len(rows)}")
    print(f"measured tau: {_fmt(tau, 3)} over {steps} verification passes, {tokens} tokens")
    print(f"tokens/s: speculative {_fmt(summary['spec_tok_s'], 1)}, target-only {_fmt(summary['target_tok_s'], 1)}"
          f" (speedup {_fmt(summary['speedup'], 2)}x)")
    if offline:
        print(f"offline tau, same conversations (all anchors): {_fmt(offline.tau, 3)} over {offline.blocks} blocks;"
              f" first assistant turn: {_fmt(offline.first_turn_tau, 3)} over {offline.first_turn_blocks} blocks;"
              f" measured / offline = {_fmt(summary['measured_over_offline_same'], 3)}")
    if trained:
        print(f"offline tau, training eval (step {trained[0]}, metrics.jsonl): {_fmt(trained[1], 3)};"
              f" measured / training eval = {_fmt(summary['measured_over_training_eval'], 3)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "prompts": rows}, indent=1))
    return 0 if summary["identical_all"] else 1


if __name__ == "__main__":
    sys.exit(main())
