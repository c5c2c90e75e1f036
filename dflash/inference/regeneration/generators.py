"""One generated turn for a batch of prompts: the target's greedy or sampled continuation.

Regeneration goes through :class:`StaticGenerator`: the static KV cache of
:class:`dflash.inference.generation.Generator`, one row per conversation, its step compiled into a
CUDA graph on GPU (``target.compile``); prompts of :data:`SHORT_PROMPT_TOKENS` tokens or more go to
a second cache sized for ``--max-prompt-tokens`` (eager unless asked). :class:`BatchGenerator` is
the plain reference: one left-padded batch with the Hugging Face causal LM called step by step; left
padding is exact for attention layers (padded keys are masked, positions restart at 0 at each row's
first token). Both sample with :func:`dflash.inference.sampling.sample_tokens` (noise from the
row's seed, the token's position and id), so they draw the same tokens from the same logits, and a
row's turn never depends on the rows beside it. A turn ends at a stop token
(:func:`dflash.data.render.stop_token_ids`; not returned) or after ``max_new_tokens``; ids the
tokenizer does not have (padding rows of the embedding) are never generated.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from dflash.inference.sampling import Sampling, sample_tokens, seed_tensor

__all__ = ["STATIC_SLACK", "SHORT_PROMPT_TOKENS", "Generated", "BatchGenerator", "limit_vocab",
           "short_prompt_tokens_for", "StaticGenerator"]

log = logging.getLogger(__name__)


@dataclass
class Generated:
    """One generated turn: ``ids`` (the new tokens, the stop token excluded) and why it ended
    (``stop``: a stop token; ``length``: ``max_new_tokens`` reached)."""

    ids: list[int]
    finish: str


class BatchGenerator:
    """Left-padded batched generation with a KV cache, greedy or temperature / top-p sampling.

    Calls the Hugging Face causal LM ``model`` step by step (``logits_to_keep=1``, explicit
    ``position_ids`` that restart at each row's first real token, 2-D attention mask). Logits of ids
    ``>= vocab_limit`` (embedding rows without a token) are set to -inf before choosing.

    Args:
        model: a transformers causal LM in eval mode (``target.model``).
        stop_ids: ids that end a turn.
        pad_id: id written in padding positions (masked, any valid id).
        vocab_limit: the tokenizer's size (``len(tokenizer)``).
    """

    def __init__(self, model: Any, stop_ids: list[int], pad_id: int, vocab_limit: int) -> None:
        self.model = model
        self.stop_ids = set(stop_ids)
        self.fill_id = stop_ids[0] if stop_ids else pad_id
        self.pad_id = pad_id
        self.vocab_limit = vocab_limit
        self.device = next(model.parameters()).device
        # transformers renamed ``past_key_values`` to ``cache`` (5.24 has ``cache``, older 5.x the old name).
        params = inspect.signature(model.forward).parameters
        self.cache_key = "cache" if "cache" in params else "past_key_values"

    def _choose(self, logits: torch.Tensor, sampling: Optional[Sampling], seeds: Optional[torch.Tensor],
                at: torch.Tensor) -> torch.Tensor:
        """Next token per row from ``logits`` ``[B, V]`` → int64 ``[B]``: the argmax without
        ``sampling``, else :func:`dflash.inference.sampling.sample_tokens` with ``seeds [B]`` at
        the positions ``at [B]`` the tokens are written at."""
        logits = logits.float()
        if logits.shape[-1] > self.vocab_limit:
            logits[:, self.vocab_limit:] = float("-inf")
        if sampling is None:
            return logits.argmax(dim=-1)
        return sample_tokens(logits[:, None], seeds, at[:, None], sampling)[:, 0]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seeds: Optional[list[int]] = None) -> list[Generated]:
        """Generate one turn for each prompt.

        Args:
            prompts: B lists of token ids (each non-empty).
            max_new_tokens: at most this many new tokens per row (the stop token included).
            temperature: 0 = greedy; else sampling at this temperature.
            top_p: nucleus sampling mass (1 = off); only with ``temperature > 0``.
            seeds: one seed per row (required when sampling): row i's tokens depend on its seed,
                prompt and the model only (:mod:`dflash.inference.sampling`).
        Returns:
            B :class:`Generated`, in prompt order.
        Raises:
            ValueError: an empty prompt, sampling without one int64 seed per row, or a top_p outside (0, 1].
        """
        if any(len(p) == 0 for p in prompts):
            raise ValueError("generate: every prompt needs at least one token")
        sampling, seed_ids = None, None
        if temperature > 0:
            if seeds is None or len(seeds) != len(prompts):
                raise ValueError("generate: sampling needs one seed per prompt")
            sampling = Sampling(temperature, top_p)
            seed_ids = seed_tensor(seeds, self.device)
        rows, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1)
        new: list[list[int]] = [[] for _ in range(rows)]
        finish = ["length"] * rows
        active = list(range(rows))
        for step in range(max_new_tokens):
            chosen = self._choose(out.logits[:, -1, :], sampling, seed_ids, positions[:, -1] + 1)
            host = chosen.tolist()
            still = []
            for i in active:
                if host[i] in self.stop_ids:
                    finish[i] = "stop"
                else:
                    new[i].append(host[i])
                    still.append(i)
            active = still
            if not active or step + 1 == max_new_tokens:
                break
            # Finished rows keep running on a filler token; their outputs are ignored.
            done = torch.ones(rows, dtype=torch.bool)
            done[active] = False
            chosen = chosen.masked_fill(done.to(self.device), self.fill_id)
            mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
            positions = positions[:, -1:] + 1
            cache = out.get(self.cache_key)
            if cache is None:
                raise RuntimeError(f"{type(self.model).__name__} returned no {self.cache_key}: cannot generate with a cache")
            out = self.model(input_ids=chosen[:, None], attention_mask=mask, position_ids=positions, use_cache=True,
                             **{self.cache_key: cache})
        return [Generated(ids, f) for ids, f in zip(new, finish)]


#: Positions of the static cache beyond the longest prompt allowed plus ``max_new_tokens``
#: (:class:`dflash.inference.generation.Generator` keeps a few slots past a row's last token).
STATIC_SLACK = 8
#: Prompts shorter than this (tokens) use :class:`StaticGenerator`'s short cache.
SHORT_PROMPT_TOKENS = 512


def short_prompt_tokens_for(attention: Optional[str]) -> Optional[int]:
    """:class:`StaticGenerator`'s ``short_prompt_tokens`` for a decoding attention spec:
    ``None`` (one cache for every prompt) when the one-token step runs ``flex``, which visits only
    the cache blocks a row has written, so a step costs what the rows hold whatever the cache's
    length; else :data:`SHORT_PROMPT_TOKENS` (the other attentions read the whole cache).

    Raises:
        ValueError: an attention spec :func:`dflash.inference.decode_layers.split_attention` refuses.
    """
    from dflash.inference.decode_layers import split_attention

    if attention is not None and split_attention(attention)[0] == "flex":
        return None
    return SHORT_PROMPT_TOKENS


def limit_vocab(model: Any, vocab_limit: int) -> None:
    """Make ``model``'s output embedding produce logits for ids ``< vocab_limit`` only.

    When the head has more rows than the tokenizer has tokens (embedding padding, e.g. Qwen3's
    151,936 rows for 151,669 tokens), it is replaced by a ``Linear`` over the first ``vocab_limit``
    rows of the same weight (a view: no copy, tied weights stay tied). An argmax over the kept
    logits equals :class:`BatchGenerator`'s argmax with the extra logits set to ``-inf`` (ties to
    the lowest id in both), so greedy output never holds an id the tokenizer lacks. A head that
    already fits is left alone.

    Raises:
        ValueError: ``vocab_limit < 1`` or a head without a 2-D ``weight``.
    """
    if vocab_limit < 1:
        raise ValueError(f"vocab_limit: must be >= 1, got {vocab_limit}")
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is None or weight.dim() != 2:
        raise ValueError(f"{type(model).__name__}: the output embedding has no [V, D] weight")
    if weight.shape[0] <= vocab_limit:
        return
    bias = getattr(head, "bias", None)
    cut = torch.nn.Linear(weight.shape[1], vocab_limit, bias=bias is not None, device=weight.device,
                          dtype=weight.dtype)
    cut.weight = torch.nn.Parameter(weight[:vocab_limit], requires_grad=False)
    if bias is not None:
        cut.bias = torch.nn.Parameter(bias[:vocab_limit], requires_grad=False)
    model.set_output_embeddings(cut)
    log.info("output embedding cut from %d to %d rows (the tokenizer's size)", weight.shape[0], vocab_limit)


class StaticGenerator:
    """Generation through :class:`dflash.inference.generation.Generator` (static KV cache, fixed
    shapes; on CUDA a compiled step replayed as a CUDA graph): the :meth:`generate` contract of
    :class:`BatchGenerator`, greedy, or sampled at the one temperature / top-p it was built for
    (its compiled step holds them).

    Every step attends over the whole static cache, so its cost grows with ``max_len``, not with
    the prompts. Two caches keep it small for most rows: prompts shorter than
    ``short_prompt_tokens`` (most ShareGPT first turns: median 56 SmolLM2 tokens, 90 % under 627)
    run in the *short* generator (``max_len = short_prompt_tokens − 1 + max_new_tokens +``
    :data:`STATIC_SLACK`, compiled when ``compile``); longer ones, up to ``max_prompt_tokens − 1``
    (:class:`dflash.inference.regeneration.jobs.ConversationJob` never asks for more), in the
    *long* generator (``max_prompt_tokens`` in place of ``short_prompt_tokens``), built on first use
    and eager unless ``compile_long``: with first turns only it serves few batches, fewer than a
    second compilation would pay for. A call given prompts of both kinds runs two batches of
    steps, each over a whole cache; :func:`dflash.inference.regeneration.jobs.regenerate_rows`
    therefore gives each call one cache's prompts (``cache=``, :attr:`cache_slots`,
    :meth:`cache_for`), topped up with shorter ones.

    Ids the tokenizer lacks are cut off the head (:func:`limit_vocab`; the model is changed in
    place) and every returned id is checked against ``vocab_limit``.

    Args:
        model: a transformers causal LM in eval mode (``target.model``), on its device.
        stop_ids: ids that end a turn.
        vocab_limit: the tokenizer's size (``len(tokenizer)``).
        batch_size: rows of each static cache (most prompts per :meth:`generate` call).
        max_prompt_tokens: prompts are shorter than this (tokens).
        max_new_tokens: the most new tokens per call.
        short_prompt_tokens: prompts shorter than this use the short cache (``None`` or
            ``>= max_prompt_tokens``: one cache for all).
        compile: compile the short generator's step (CUDA graphs); ``None`` = on CUDA only. The
            prefill of both generators stays eager (each of its forwards fills the device at these
            batch sizes).
        attention: the fused layers' attention in decoding
            (:class:`dflash.inference.decode_steps.DecodeSteps`); ``None`` = the default for the
            batch size (:func:`dflash.inference.decode_layers.default_attention`).
        compile_long: compile the long generator's step too (one more compilation, on its first
            use): worth it when many batches are long (every turn of a conversation regenerated,
            where later turns' prompts hold the earlier ones).
        sampling: sample at this temperature / top-p (:mod:`dflash.inference.sampling`; one seed
            per prompt, :meth:`generate`); ``None`` = greedy.

    Raises:
        ValueError: see :class:`dflash.inference.generation.Generator` and :func:`limit_vocab`.
    """

    def __init__(self, model: Any, stop_ids: list[int], vocab_limit: int, batch_size: int, max_prompt_tokens: int,
                 max_new_tokens: int, short_prompt_tokens: Optional[int] = SHORT_PROMPT_TOKENS,
                 compile: Optional[bool] = None, compile_long: bool = False,
                 attention: Optional[str] = None, sampling: Optional[Sampling] = None) -> None:
        from dflash.inference.generation import Generator

        limit_vocab(model, vocab_limit)
        self.model = model
        self.stop_ids = sorted(set(stop_ids))
        self.vocab_limit = vocab_limit
        self.batch_size = batch_size
        self.max_prompt_tokens = max_prompt_tokens
        self.max_new_tokens = max_new_tokens
        if short_prompt_tokens is None or short_prompt_tokens >= max_prompt_tokens:
            short_prompt_tokens = max_prompt_tokens
        self.short_prompt_tokens = short_prompt_tokens
        # The prefill stays eager: at regeneration's batch sizes each prefill forward keeps the device
        # busy, and a dynamic-shape compilation of it (plus its recompilations) costs more than it saves.
        self.sampling = sampling
        self.short = Generator(model, [], max_len=self._max_len(short_prompt_tokens), batch_size=batch_size,
                               compile=compile, compile_prefill=False, attention=attention, sampling=sampling)
        self.long: Any = None
        self.compile_long = bool(compile_long) and self.short.compiled  # never where the short one is eager
        self.attention = attention
        #: Summed over :meth:`generate` calls: wall seconds of ``prefill_s`` (prompts into the cache)
        #: and ``decode_s`` (the one-token steps), ``batches`` (batches of steps run) and ``batch_rows``
        #: (prompts they held; ``batch_rows / (batches * batch_size)`` is how full they ran); where
        #: a regeneration's time goes, beside its tokenisation and bookkeeping.
        self.timings: dict[str, float] = {"prefill_s": 0.0, "decode_s": 0.0, "batches": 0, "batch_rows": 0}

    def _max_len(self, prompt_tokens: int) -> int:
        return prompt_tokens - 1 + self.max_new_tokens + STATIC_SLACK

    @property
    def cache_slots(self) -> tuple[int, ...]:
        """Positions of each cache (its ``max_len``), smallest first: ``(short, long)``, or one
        entry when one cache serves every prompt. A step of a cache reads all of its positions for
        all of its ``batch_size`` rows, used or not, so its cost follows this length."""
        if self.short_prompt_tokens >= self.max_prompt_tokens:
            return (self._max_len(self.max_prompt_tokens),)
        return (self._max_len(self.short_prompt_tokens), self._max_len(self.max_prompt_tokens))

    def cache_for(self, prompt_tokens: int) -> int:
        """Index into :attr:`cache_slots` of the smallest cache that holds a prompt of
        ``prompt_tokens`` tokens (what :meth:`generate` picks for it without ``cache``)."""
        return int(len(self.cache_slots) > 1 and prompt_tokens >= self.short_prompt_tokens)

    def _long(self) -> Any:
        if self.long is None:
            from dflash.inference.generation import Generator

            self.long = Generator(self.model, [], max_len=self._max_len(self.max_prompt_tokens),
                                  batch_size=self.batch_size, compile=self.compile_long, compile_prefill=False,
                                  attention=self.attention, sampling=self.sampling)
        return self.long

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seeds: Optional[list[int]] = None, cache: Optional[int] = None) -> list[Generated]:
        """One turn for each prompt: greedy (``temperature`` 0; ``top_p`` and ``seeds`` are ignored),
        or sampled with one seed per prompt at the temperature / top-p the generator was built for.

        Args:
            cache: run every prompt in this cache (an index into :attr:`cache_slots`; each prompt
                must fit it): one batch of steps. ``None``: each prompt in the smallest cache that
                holds it (:meth:`cache_for`), one batch of steps per cache used.
        Returns:
            B :class:`Generated`, in prompt order (the stop token excluded, as :class:`BatchGenerator`).
        Raises:
            ValueError: a ``temperature`` / ``top_p`` other than the constructor's ``sampling`` (0 when
                greedy), sampling without one seed per prompt, ``max_new_tokens`` above the
                constructor's, more prompts than ``batch_size``, an empty prompt or one of
                ``max_prompt_tokens`` tokens or more, ``cache`` out of range or a prompt too long for it.
            RuntimeError: an id ``>= vocab_limit`` was generated (a head :func:`limit_vocab` did not cut).
        """
        if self.sampling is None and temperature != 0:
            raise ValueError(f"temperature: this StaticGenerator is greedy (sampling=None), got {temperature}")
        if self.sampling is not None and (temperature, top_p) != (self.sampling.temperature, self.sampling.top_p):
            raise ValueError(f"temperature / top_p: this StaticGenerator samples at {self.sampling.temperature} / "
                             f"{self.sampling.top_p}, got {temperature} / {top_p}")
        if self.sampling is not None and (seeds is None or len(seeds) != len(prompts)):
            raise ValueError("seeds: sampling needs one seed per prompt")
        if max_new_tokens > self.max_new_tokens:
            raise ValueError(f"max_new_tokens: {max_new_tokens} exceeds the cache's {self.max_new_tokens}")
        if len(prompts) > self.batch_size:
            raise ValueError(f"prompts: at most {self.batch_size} (the batch size), got {len(prompts)}")
        for i, p in enumerate(prompts):
            if not 0 < len(p) < self.max_prompt_tokens:
                raise ValueError(f"prompts[{i}]: need 1..{self.max_prompt_tokens - 1} tokens, got {len(p)}")
        chosen = [self.cache_for(len(p)) for p in prompts]  # each prompt's smallest cache
        if cache is not None:
            if not 0 <= cache < len(self.cache_slots):
                raise ValueError(f"cache: an index into cache_slots {self.cache_slots}, got {cache}")
            for i, own in enumerate(chosen):
                if own > cache:
                    raise ValueError(f"prompts[{i}]: {len(prompts[i])} tokens do not fit cache {cache} "
                                     f"({self.cache_slots[cache]} positions)")
            chosen = [cache] * len(prompts)
        out: list[Optional[Generated]] = [None] * len(prompts)
        for index in range(len(self.cache_slots)):
            rows = [i for i, c in enumerate(chosen) if c == index]
            if not rows:
                continue
            generator = self.short if index == 0 else self._long()
            runs = generator.greedy([torch.tensor(prompts[i], dtype=torch.long) for i in rows], max_new_tokens,
                                    self.stop_ids, logit_stats=False,
                                    seeds=None if self.sampling is None else [seeds[i] for i in rows])
            self.timings["prefill_s"] += runs[0].prefill_seconds
            self.timings["decode_s"] += runs[0].decode_seconds
            self.timings["batches"] += 1
            self.timings["batch_rows"] += len(rows)
            for i, run in zip(rows, runs):
                out[i] = self._generated(list(run.tokens))
        return out  # type: ignore[return-value]

    def _generated(self, ids: list[int]) -> Generated:
        if any(t >= self.vocab_limit for t in ids):
            raise RuntimeError(f"generated an id >= the tokenizer's size {self.vocab_limit}: {max(ids)}")
        if ids and ids[-1] in self.stop_ids:
            return Generated(ids[:-1], "stop")
        return Generated(ids, "length")
