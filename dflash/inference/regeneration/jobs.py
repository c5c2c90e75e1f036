"""Regeneration jobs: the generation options and one conversation regenerated turn by turn.

Each assistant turn is regenerated given the conversation so far, rendered with the target's chat
template (``enable_thinking`` passed to it) and ``add_generation_prompt``, where earlier assistant
turns are *already the regenerated ones*; system and user turns are kept verbatim. A conversation
ends at its last regenerated turn, and stops early (keeping the turns done so far) when
``max_turns`` turns are done, when the next prompt is ``max_prompt_tokens`` tokens or longer, when a
response is empty, or when the template fails; a row with no regenerated turn becomes a skip record
(:data:`SKIP_REASONS`). Leading assistant turns (nothing to answer) are dropped.

**Batching** (:func:`regenerate_rows`): a worker keeps a pool of conversations in flight, each
waiting for its next turn, and refills it from its queue as conversations finish. Each round
generates the next turn of up to ``batch_size`` of them in one batch
(:mod:`dflash.inference.regeneration.generators`). With one cache (the batch generator, or one
static cache for every prompt) the pool holds ``batch_size`` conversations and every round takes
them all. The static generator's two caches (short and long prompts) cost a batch of steps each whatever
rows they hold, so each round runs one cache, chosen by :func:`choose_round`, and the pool is
refilled while the short cache (where first turns mostly go) lacks a batch of its own rows, up to
``batch_size`` per cache in all: a conversation whose prompts grow past the short cache moves to the
long one, and rounds stay full where a round of every conversation in flight would run both caches
half empty. A started conversation waits at most :data:`MAX_WAIT_ROUNDS` rounds for its next turn.
Given a deadline, it stops before the first round that would start past it and writes each
conversation in flight that has a regenerated turn as a *partial* row
(:func:`dflash.inference.regeneration.shards.is_partial`): trained on like any row, regenerated
whole by a later run. Sampling seeds come from
:func:`dflash.inference.regeneration.rows.turn_seed` (seed, row id, turn), so a sampled row depends
neither on batching nor on sharding.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

from jinja2.exceptions import TemplateError

from dflash.config import ConfigError
from dflash.inference.regeneration.generators import BatchGenerator, Generated, StaticGenerator
from dflash.inference.regeneration.rows import SourceRow, turn_seed

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "DEFAULT_BATCH_SIZE", "SKIP_REASONS", "SHAREGPT_ROLE", "GenerationOptions",
           "prompt_chars", "ConversationJob", "choose_round", "regenerate_rows"]

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_BATCH_SIZE = 16

# Why a row is skipped (a line in a shard, never in the output).
NO_USER_TURN = "no_user_turn"          # only assistant turns before the first user turn
PROMPT_TOO_LONG = "prompt_too_long"    # the first prompt alone reaches --max-prompt-tokens
EMPTY_RESPONSE = "empty_response"      # the first regenerated turn is empty or only whitespace
TEMPLATE_ERROR = "template_error"      # the chat template raised on the first prompt
SKIP_REASONS = (NO_USER_TURN, PROMPT_TOO_LONG, EMPTY_RESPONSE, TEMPLATE_ERROR)

#: Roles written in the output (ShareGPT ``from`` values).
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


@dataclass
class GenerationOptions:
    """How responses are generated (the options of ``python -m dflash.inference.regenerate``).

    ``temperature == 0`` is greedy; ``top_p`` in (0, 1] (1 = off); ``max_turns`` = None regenerates
    every assistant turn; ``max_prompt_tokens`` (tokens) stops a conversation before a longer prompt;
    ``attention`` is the static-cache generator's decoding attention (``None`` = the batch size's default).
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = DEFAULT_BATCH_SIZE
    max_turns: Optional[int] = None
    max_prompt_tokens: int = 3072
    enable_thinking: Optional[bool] = None
    attention: Optional[str] = None

    def check(self) -> None:
        """Raises:
            ConfigError: a value out of range (the message names the option)."""
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens: must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"--temperature: must be a finite value >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p: must be in (0, 1], got {self.top_p}")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size: must be >= 1, got {self.batch_size}")
        if self.max_turns is not None and self.max_turns < 1:
            raise ConfigError(f"--max-turns: must be >= 1, got {self.max_turns}")
        if self.max_prompt_tokens < 1:
            raise ConfigError(f"--max-prompt-tokens: must be >= 1, got {self.max_prompt_tokens}")
        if self.attention is not None:
            from dflash.inference.decode_layers import attention_spec_error

            error = attention_spec_error(self.attention)
            if error is not None:
                raise ConfigError(f"--attention: {error}")


def prompt_chars(row: SourceRow) -> int:
    """Characters of ``row``'s first prompt (every message before its first assistant turn that
    follows a user turn): the sort key that batches prompts of similar length together."""
    total, seen_user = 0, False
    for message in row.messages:
        if message["role"] == "assistant" and seen_user:
            break
        seen_user = seen_user or message["role"] == "user"
        total += len(message.get("content") or "")
    return total


class ConversationJob:
    """One conversation being regenerated turn by turn (the rules: this module's docstring).

    ``messages`` grows with the kept system/user turns and the regenerated assistant turns;
    :meth:`next_prompt` gives the token ids of the next prompt (or None when the conversation is
    finished) and :meth:`accept` takes the generated turn.
    """

    def __init__(self, row: SourceRow, tokenizer: Any, options: GenerationOptions) -> None:
        self.row = row
        self.tokenizer = tokenizer
        self.options = options
        self.messages: list[dict[str, str]] = []
        self.cursor = 0  # next source message to look at
        self.turns = 0
        self.new_tokens: list[int] = []
        self.finish: list[str] = []
        self.retokenize_mismatch = 0
        self.stop_reason: Optional[str] = None
        self.done = False
        self.template_kwargs: dict[str, Any] = {}
        if options.enable_thinking is not None:
            self.template_kwargs["enable_thinking"] = options.enable_thinking

    def _stop(self, reason: Optional[str]) -> None:
        self.done = True
        if self.turns == 0:
            self.stop_reason = reason or NO_USER_TURN

    def next_prompt(self) -> Optional[list[int]]:
        """Token ids of the prompt for the next assistant turn, or None (then :attr:`done` is set)."""
        text = self.next_text()
        return None if text is None else self.take_prompt(_encode(self.tokenizer, [text])[0])

    def next_text(self) -> Optional[str]:
        """The next prompt rendered with the chat template, not yet tokenised (:meth:`take_prompt`
        takes its ids), or None (then :attr:`done` is set)."""
        if self.done:
            return None
        if self.options.max_turns is not None and self.turns >= self.options.max_turns:
            self._stop(None)
            return None
        source = self.row.messages
        while self.cursor < len(source):
            message = source[self.cursor]
            if message["role"] != "assistant":
                self.messages.append(dict(message))
                self.cursor += 1
                continue
            if not any(m["role"] == "user" for m in self.messages):
                self.cursor += 1  # a leading assistant turn answers nothing here: dropped
                continue
            try:
                return self.tokenizer.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True,
                                                          **self.template_kwargs)
            except (TemplateError, TypeError, ValueError, KeyError) as exc:
                log.debug("%s: chat template failed: %s", self.row.id, exc)
                self._stop(TEMPLATE_ERROR)
                return None
        self._stop(None)
        return None

    def take_prompt(self, ids: list[int]) -> Optional[list[int]]:
        """``ids`` (the tokens of :meth:`next_text`'s prompt), or None when the prompt is
        ``max_prompt_tokens`` long or longer (the conversation stops there)."""
        if len(ids) >= self.options.max_prompt_tokens:
            self._stop(PROMPT_TOO_LONG)
            return None
        return ids

    def accept(self, generated: Generated, text: Optional[str] = None, retokenized: Optional[list[int]] = None
               ) -> None:
        """Take the turn generated for the last :meth:`next_prompt`.

        Args:
            generated: the new tokens and why they ended.
            text: ``generated.ids`` decoded (special tokens kept, no clean-up); None = decode here.
            retokenized: ``text`` tokenised again (counted as a mismatch when it differs from
                ``generated.ids``); None = tokenise here.
        """
        if text is None:
            text = _decode(self.tokenizer, [generated.ids])[0]
        if not text.strip():
            self._stop(EMPTY_RESPONSE)
            return
        if retokenized is None:
            retokenized = _encode(self.tokenizer, [text])[0]
        if retokenized != generated.ids:
            self.retokenize_mismatch += 1
        self.messages.append({"role": "assistant", "content": text})
        self.cursor += 1
        self.turns += 1
        self.new_tokens.append(len(generated.ids) + (generated.finish == "stop"))
        self.finish.append(generated.finish)

    def record(self, partial: bool = False) -> dict:
        """The output line of a finished job: a regenerated row, or a skip record.

        ``partial``: the job is not finished (the time budget stopped it after at least one
        turn): its row so far, marked ``regen.partial``
        (:func:`dflash.inference.regeneration.shards.is_partial`)."""
        meta: dict[str, Any] = {"source_index": self.row.index}
        if self.turns == 0:
            if partial:
                raise ValueError(f"{self.row.id}: a partial record needs a regenerated turn")
            return {"id": self.row.id, "skipped": self.stop_reason or NO_USER_TURN, "regen": meta}
        last = max(i for i, m in enumerate(self.messages) if m["role"] == "assistant")
        conversation = [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in self.messages[:last + 1]]
        meta.update(turns=self.turns, new_tokens=self.new_tokens, finish=self.finish,
                    retokenize_mismatch=self.retokenize_mismatch)
        if partial:
            meta["partial"] = True
        return {"id": self.row.id, "conversations": conversation, "regen": meta}


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text (no special tokens added), in one call: a fast tokenizer encodes a
    list in parallel."""
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def _decode(tokenizer: Any, ids: list[list[int]]) -> list[str]:
    """Each id list as text, special tokens kept and no clean-up (the turn as the target wrote it)."""
    return tokenizer.batch_decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) if ids else []


def _next_prompts(jobs: list[ConversationJob], tokenizer: Any) -> list[Optional[list[int]]]:
    """:meth:`ConversationJob.next_prompt` of every job, the prompts tokenised in one call."""
    texts = [job.next_text() for job in jobs]
    wanted = [i for i, t in enumerate(texts) if t is not None]
    out: list[Optional[list[int]]] = [None] * len(jobs)
    for i, ids in zip(wanted, _encode(tokenizer, [texts[i] for i in wanted])):  # type: ignore[misc]
        out[i] = jobs[i].take_prompt(ids)
    return out


def _accept_all(jobs: list[ConversationJob], outs: list[Generated], tokenizer: Any) -> None:
    """:meth:`ConversationJob.accept` of every job's turn, decoded and re-tokenised in one call each."""
    texts = _decode(tokenizer, [out.ids for out in outs])
    kept = [i for i, t in enumerate(texts) if t.strip()]
    retokenized: list[Optional[list[int]]] = [None] * len(jobs)
    for i, ids in zip(kept, _encode(tokenizer, [texts[i] for i in kept])):
        retokenized[i] = ids
    for job, out, text, ids in zip(jobs, outs, texts, retokenized):
        job.accept(out, text, ids)


#: Rounds a started conversation waits at most for its next turn while other caches run
#: (:func:`choose_round`). Loose on purpose: a round forced by it may run part-empty, or carry short
#: prompts in the long cache; it only keeps a conversation from waiting until the queue runs dry
#: (then the time budget would cut it).
MAX_WAIT_ROUNDS = 16


class _Waiting(NamedTuple):
    """A conversation of :func:`regenerate_rows`'s pool: its next prompt's token ids, the index of
    the smallest cache that holds it, and the round it became ready in."""

    job: ConversationJob
    prompt: list[int]
    cache: int
    ready: int


def choose_round(caches: Sequence[int], batch_size: int, waits: Optional[Sequence[int]] = None,
                 max_wait: int = MAX_WAIT_ROUNDS) -> tuple[int, list[int]]:
    """The next round's cache and conversations, from the pool of those waiting for a turn.

    A step of a static cache reads all of its positions for all of its rows, used or not, so a
    round costs what its cache's length costs whatever it holds; every waiting turn must run in a
    cache that fits it, the smallest one it fits (its *own* cache) or a larger one. The round runs
    the largest cache that has a full batch of its own rows, else (the pool is draining) the
    largest cache that has any: its own rows in pool order, topped up with the rows of the next
    smaller caches (larger first, in pool order within one), which ride along at no cost. Draining
    a pool this way (no new turns) costs the fewest cache positions any order of rounds can
    (``tests/test_regenerate_budget.py`` checks it against an exhaustive search). One exception
    bounds the wait: a cache with an own row that has waited ``max_wait`` rounds or more runs first
    (the largest such), its rows that waited longest first, whether or not it is full.

    Args:
        caches: per conversation of the pool, the index of its own cache (``generator.cache_for``
            of its next prompt; caches ordered by size). Pool order is the order rows are taken in.
        batch_size: rows of each cache.
        waits: per conversation, the rounds it has waited for its next turn (``None``: no bound).
        max_wait: the wait (rounds) that makes a cache run next.
    Returns:
        ``(cache, rows)``: the cache's index and the pool indices of the round's conversations,
        ascending (at most ``batch_size``; each fits the cache).
    Raises:
        ValueError: an empty pool, a negative cache index, ``batch_size < 1``, ``waits`` of another
            length than ``caches``, or ``max_wait < 1``.
    """
    if not caches:
        raise ValueError("choose_round: the pool is empty")
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    if min(caches) < 0:
        raise ValueError(f"caches: indices are >= 0, got {min(caches)}")
    if waits is not None and len(waits) != len(caches):
        raise ValueError(f"waits: one per conversation of the pool ({len(caches)}), got {len(waits)}")
    if max_wait < 1:
        raise ValueError(f"max_wait: must be >= 1, got {max_wait}")
    waited = list(waits) if waits is not None else [0] * len(caches)
    overdue = [c for c, w in zip(caches, waited) if w >= max_wait]
    if overdue:
        cache = max(overdue)
        order = sorted((i for i, c in enumerate(caches) if c <= cache),
                       key=lambda i: (caches[i] != cache, -caches[i], -waited[i], i))
        return cache, sorted(order[:batch_size])
    counts = {cache: sum(c == cache for c in caches) for cache in set(caches)}
    full = [cache for cache, n in counts.items() if n >= batch_size]
    cache = max(full) if full else max(counts)
    fits = sorted((i for i, c in enumerate(caches) if c <= cache), key=lambda i: (-caches[i], i))
    return cache, sorted(fits[:batch_size])


def regenerate_rows(rows: list[SourceRow], generator: BatchGenerator | StaticGenerator, tokenizer: Any,
                    options: GenerationOptions, deadline: Optional[float] = None,
                    clock: Callable[[], float] = time.time) -> Iterator[list[dict]]:
    """Regenerate ``rows``; yield the records of the conversations that finish, as soon as they do.

    A pool of conversations, each with its next prompt ready, generates one turn of up to
    ``options.batch_size`` of them per round (one batch); finished conversations leave the pool
    and the queue refills it. A generator with several caches (``cache_slots`` and ``cache_for``,
    :class:`dflash.inference.regeneration.generators.StaticGenerator`) gets one cache's
    prompts a round (``generate(..., cache=c)``, the cache and rows of :func:`choose_round`, the
    rows that waited longest first; the others wait in the pool), and the pool is refilled while
    the smallest cache has fewer than ``batch_size`` rows of its own, to at most ``batch_size``
    per cache; any other generator gets a pool of ``batch_size``, all of it every round. Rows
    skipped before any generation are yielded before the round that replaces them. Each round
    tokenises its prompts, and decodes and re-tokenises its turns, one call each.

    Args:
        deadline: when given, ``clock()`` is read before each generation round, and once it is at or
            past ``deadline`` the generator yields the conversations in flight that have a
            regenerated turn as partial records (``regen.partial``; in pool order) and ends
            without that round; the others, and the rows never started, are not yielded. Every row
            is yielded exactly once as a finished record otherwise, so the rows left are
            ``len(rows)`` minus the finished records yielded.
        clock: the time that is compared with ``deadline``, in the same unit (default
            :func:`time.time`, seconds since the epoch; tests pass a fake one).
    """
    caches = max(1, len(getattr(generator, "cache_slots", ())))
    cache_for: Callable[[int], int] = getattr(generator, "cache_for") if caches > 1 else lambda n: 0
    batch = options.batch_size
    capacity = batch * caches
    queue = list(reversed(rows))
    pool: list[_Waiting] = []  # in flight, longest waiting first
    rounds = 0
    while queue or pool:
        skipped: list[dict] = []
        # refill while the smallest cache (where first turns mostly go) lacks a batch
        while queue and len(pool) < capacity and (smallest := sum(w.cache == 0 for w in pool)) < batch:
            fresh = [ConversationJob(queue.pop(), tokenizer, options)
                     for _ in range(min(capacity - len(pool), batch - smallest, len(queue)))]
            for job, prompt in zip(fresh, _next_prompts(fresh, tokenizer)):
                if prompt is None:
                    skipped.append(job.record())
                else:
                    pool.append(_Waiting(job, prompt, cache_for(len(prompt)), rounds))
        if skipped:
            yield skipped
        if not pool:
            continue
        if deadline is not None and clock() >= deadline:
            partial = [w.job.record(partial=True) for w in pool if w.job.turns > 0]
            log.debug("deadline passed: %d conversations in flight (%d written as partial rows) and %d not "
                      "started are left", len(pool), len(partial), len(queue))
            if partial:
                yield partial
            return
        extra: dict[str, Any] = {}
        take = list(range(len(pool)))  # one cache: the pool is one batch
        if caches > 1:
            # only started conversations count as waiting: a row not begun loses nothing at a deadline
            waits = [rounds - w.ready if w.job.turns else 0 for w in pool]
            extra["cache"], take = choose_round([w.cache for w in pool], batch, waits)
        taken = set(take)
        jobs = [pool[i].job for i in take]
        seeds = [turn_seed(options.seed, job.row.id, job.turns) for job in jobs]
        outs = generator.generate([pool[i].prompt for i in take], options.max_new_tokens, options.temperature,
                                  options.top_p, seeds, **extra)
        rounds += 1
        pool = [entry for i, entry in enumerate(pool) if i not in taken]
        _accept_all(jobs, outs, tokenizer)
        finished: list[dict] = []
        for job, prompt in zip(jobs, _next_prompts(jobs, tokenizer)):
            if prompt is None:
                finished.append(job.record())
            else:
                pool.append(_Waiting(job, prompt, cache_for(len(prompt)), rounds))
        if finished:
            yield finished
