"""Held-out prompts for decoding.

:func:`prompts_from_corpus` takes each held-out conversation's first user turn(s), chat-templated
and tokenised the way training tokenised them, up to the assistant header (the ids that end a
response: :func:`dflash.data.render.stop_token_ids`). The other prompt sets of the decoding check
(HumanEval, MT-Bench, a file) are :mod:`dflash.inference.prompt_sets`'.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["PromptCase", "SHAREGPT_SET", "heldout_prompts", "prompt_limit", "prompts_from_corpus", "user_turn_header"]

log = logging.getLogger(__name__)


#: The prompt set of the run's held-out conversations.
SHAREGPT_SET = "sharegpt"


@dataclass
class PromptCase:
    """A prompt to decode: a held-out conversation's, or one of another prompt set.

    Attributes:
        index: item of the held-out corpus (``sharegpt``), else the prompt's number in its set;
            source_row: its row in the data or prompt file (0-based).
        prompt_ids: ``[P]`` int64: the chat-templated conversation up to the assistant header
            (what ``apply_chat_template(..., add_generation_prompt=True)`` renders, tokenised as a
            whole); for a held-out conversation every token before its first assistant token,
            tokenised the way training tokenised it.
        input_ids / loss_mask: ``[S]`` the whole tokenised conversation (for the dataset's offline
            τ), ``None`` for a prompt set without responses.
        prompt_set: the set's name (:mod:`dflash.inference.prompt_sets`); label: the prompt's id in
            its set when it has one (``HumanEval/0``, MT-Bench question 81), else ``""``.
    """

    index: int
    source_row: int
    prompt_ids: Tensor
    input_ids: Optional[Tensor]
    loss_mask: Optional[Tensor]
    prompt_set: str = SHAREGPT_SET
    label: str = ""


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
    skipped = too_long = 0
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
            too_long += 1
            continue
        if header is not None and header not in tokenizer.decode(ids[:p].tolist(), skip_special_tokens=False):
            skipped += 1
            continue
        out.append(PromptCase(index=i, source_row=corpus.source_row(i), prompt_ids=ids[:p].clone(),
                              input_ids=ids, loss_mask=mask))
    if skipped:
        log.info("skipped %d held-out conversations whose prompt holds no user turn (assistant-first)", skipped)
    if too_long:
        log.info("skipped %d held-out conversations whose prompt has more than %d tokens", too_long, max_prompt_tokens)
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


def heldout_prompts(cfg: Any, tokenizer: Any, count: int, max_new_tokens: int,
                    max_prompt_tokens: Optional[int] = None) -> list[PromptCase]:
    """The first ``count`` held-out prompts of a run's data (:func:`prompts_from_corpus` over
    :func:`dflash.data.corpus.prepare_data`'s held-out split, found without tokenising the training
    conversations when the data cache is cold: :func:`dflash.data.corpus.prepare_heldout`), each at most
    ``max_prompt_tokens`` long (default: :func:`prompt_limit`); logs why when there are none or fewer
    than ``count``.
    """
    from dflash.data.corpus import prepare_heldout

    if max_prompt_tokens is None:
        max_prompt_tokens = prompt_limit(cfg, max_new_tokens)
        if max_prompt_tokens is None:
            return []
    cases = prompts_from_corpus(prepare_heldout(cfg, tokenizer), count, max_prompt_tokens, tokenizer=tokenizer)
    if not cases:
        log.error("no held-out prompt of at most %d tokens that ends a user turn", max_prompt_tokens)
    elif len(cases) < count:
        log.warning("only %d held-out prompts of at most %d tokens", len(cases), max_prompt_tokens)
    return cases


def prompt_limit(cfg: Any, max_new_tokens: int) -> Optional[int]:
    """The longest prompt by default, ``data.max_length − max_new_tokens`` (decoding then stays within
    the trained length); ``None``, with the reason logged, when that leaves no room for a prompt."""
    if max_new_tokens >= cfg.data.max_length:
        log.error("max_new_tokens %d leaves no room for a prompt within data.max_length %d (the trained length); "
                  "ask for fewer new tokens (--max-new-tokens) or give a prompt limit (--max-prompt-tokens)",
                  max_new_tokens, cfg.data.max_length)
        return None
    return cfg.data.max_length - max_new_tokens
