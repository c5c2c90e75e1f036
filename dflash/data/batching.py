"""Fixed-shape packed batches, each a deterministic function of (seed, epoch, batch id).

The batch contract (docs/ARCHITECTURE.md): every batch is ``R = token_budget // max_length`` rows
of ``S = max_length`` tokens. A row holds one or more whole conversations back to back, then
padding:

- ``input_ids``    int64 ``[R, S]``: tokens; padding = ``pad_id``
- ``position_ids`` int64 ``[R, S]``: position inside its own conversation (restarts at 0); 0 on padding
- ``doc_ids``      int32 ``[R, S]``: 1, 2, ... for the conversations of the row; 0 = padding
- ``loss_mask``    bool  ``[R, S]``: assistant tokens

How an epoch is planned (:class:`BatchPlan`): the conversations are shuffled with a generator
seeded by ``(seed, epoch)``; the shuffled list is cut into chunks of ``sort_chunk`` conversations;
inside each chunk conversations are sorted by length (longest first) and packed best-fit into rows
of ``S`` tokens (each goes to the open row with the least room that still fits it, else a new row),
which keeps padding small while the chunks keep the epoch random. The rows of the whole epoch are
then shuffled with the same generator and cut into batches of ``R`` rows; the last batch may have
empty (all-padding) rows. Every conversation is in exactly one batch per epoch, and the order
differs from epoch to epoch. Planning 17k conversations takes a few tens of milliseconds; the last
few epochs' plans are kept.

Conversations are never split across rows, so padding depends on the length mix: ShareGPT V3 at
``S = 256`` pads ~0.3 % (most conversations fill a row); at ``S = 3072`` ~12.5 %, even with one
global sort, because its conversations were pre-split at ~2k tokens and two of them rarely fit one
row.
"""

from __future__ import annotations

import bisect
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Protocol

import numpy as np
import torch

__all__ = ["Batch", "BatchPlan", "EpochPlan", "batch_tensor_specs", "pack_best_fit", "BATCH_TENSORS"]

log = logging.getLogger(__name__)

#: Conversations per sort-and-pack chunk: larger packs tighter, smaller keeps more randomness.
DEFAULT_SORT_CHUNK = 1024
#: Epoch plans kept in memory per :class:`BatchPlan`.
DEFAULT_CACHED_EPOCHS = 2
#: Names of the tensors of a batch, in slot order.
BATCH_TENSORS = ("input_ids", "position_ids", "doc_ids", "loss_mask")


class Corpus(Protocol):
    """What :class:`BatchPlan` needs (``dflash.data.corpus.TokenizedCorpus`` provides it)."""

    @property
    def lengths(self) -> np.ndarray: ...

    def get_numpy(self, i: int) -> tuple[np.ndarray, np.ndarray]: ...

    def __len__(self) -> int: ...


def batch_tensor_specs(rows: int, seq_len: int) -> dict[str, tuple[tuple[int, int], torch.dtype]]:
    """``{name: (shape, dtype)}`` of a batch's tensors: what a transport slot must hold."""
    shape = (rows, seq_len)
    return {"input_ids": (shape, torch.int64), "position_ids": (shape, torch.int64),
            "doc_ids": (shape, torch.int32), "loss_mask": (shape, torch.bool)}


@dataclass
class Batch:
    """One packed batch (CPU tensors, see the module doc for the contract).

    Attributes:
        input_ids: int64 ``[R, S]``.
        position_ids: int64 ``[R, S]``.
        doc_ids: int32 ``[R, S]``.
        loss_mask: bool ``[R, S]``.
        epoch, batch_id: which batch this is.
        num_tokens: real (non-padding) tokens in the batch.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    loss_mask: torch.Tensor
    epoch: int
    batch_id: int
    num_tokens: int

    def to_dict(self) -> dict[str, torch.Tensor]:
        """The four tensors by name (:data:`BATCH_TENSORS` order), for copying into a slot."""
        return {name: getattr(self, name) for name in BATCH_TENSORS}

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]


def pack_best_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Pack items into bins of ``capacity``, longest first, each into the fullest bin it fits.

    Args:
        lengths: int ``[n]``, every entry in ``1..capacity``.

    Returns:
        Bins as lists of item positions (into ``lengths``), in opening order.

    Raises:
        ValueError: an item is longer than ``capacity`` or shorter than 1.
    """
    if len(lengths) and (int(lengths.max()) > capacity or int(lengths.min()) < 1):
        raise ValueError(f"item lengths must be in 1..{capacity}, got {int(lengths.min())}..{int(lengths.max())}")
    order = np.argsort(-lengths, kind="stable")
    bins: list[list[int]] = []
    # Open bins sorted by free room: parallel lists of (room, bin number) keys and bin numbers.
    keys: list[tuple[int, int]] = []
    for item in order.tolist():
        size = int(lengths[item])
        at = bisect.bisect_left(keys, (size, -1))
        if at < len(keys):
            room, number = keys.pop(at)
        else:
            room, number = capacity, len(bins)
            bins.append([])
        bins[number].append(item)
        room -= size
        if room > 0:
            bisect.insort(keys, (room, number))
    return bins


@dataclass
class EpochPlan:
    """The rows of one epoch: row ``r`` holds conversations ``items[row_offsets[r]:row_offsets[r + 1]]``.

    Attributes:
        items: int64 ``[n]`` corpus indices in row order.
        row_offsets: int64 ``[num_rows + 1]``.
        rows_per_batch: ``R``; batch ``b`` is rows ``b*R .. b*R + R - 1``.
    """

    items: np.ndarray
    row_offsets: np.ndarray
    rows_per_batch: int

    @property
    def num_rows(self) -> int:
        return len(self.row_offsets) - 1

    @property
    def num_batches(self) -> int:
        return -(-self.num_rows // self.rows_per_batch)

    def row(self, r: int) -> np.ndarray:
        return self.items[self.row_offsets[r]:self.row_offsets[r + 1]]


class BatchPlan:
    """Packs a tokenised corpus into ``[rows, seq_len]`` batches, deterministic per (seed, epoch, batch id).

    Args:
        corpus: conversations (``lengths`` int ``[n]``, ``get_numpy(i)`` → (ids ``[L]``, mask ``[L]``)).
        rows: ``R`` rows per batch (``data.token_budget // data.max_length``).
        seq_len: ``S`` tokens per row (``data.max_length``).
        seed: data seed (``data.seed``).
        pad_id: ``input_ids`` value on padding (the tokenizer's pad id, or 0).
        sort_chunk: conversations per sort-and-pack chunk.

    Raises:
        ValueError: empty corpus, a conversation longer than ``seq_len`` (or empty), ``rows`` or
            ``seq_len`` < 1, negative ``seed`` or ``pad_id``.
    """

    def __init__(self, corpus: Corpus, rows: int, seq_len: int, seed: int, pad_id: int = 0,
                 sort_chunk: int = DEFAULT_SORT_CHUNK, cached_epochs: int = DEFAULT_CACHED_EPOCHS) -> None:
        if rows < 1 or seq_len < 1:
            raise ValueError(f"rows ({rows}) and seq_len ({seq_len}) must be >= 1")
        if seed < 0 or pad_id < 0:
            raise ValueError(f"seed ({seed}) and pad_id ({pad_id}) must be >= 0")
        if sort_chunk < 1:
            raise ValueError(f"sort_chunk must be >= 1, got {sort_chunk}")
        lengths = np.asarray(corpus.lengths, dtype=np.int64)
        if len(lengths) == 0:
            raise ValueError("cannot plan batches over an empty corpus")
        if int(lengths.max()) > seq_len:
            worst = int(lengths.argmax())
            raise ValueError(f"conversation {worst} has {int(lengths[worst])} tokens, more than seq_len {seq_len} "
                             f"(data.max_length); prepare the data with the same max_length")
        if int(lengths.min()) < 1:
            raise ValueError(f"conversation {int(lengths.argmin())} is empty")
        self.corpus = corpus
        self.rows = rows
        self.seq_len = seq_len
        self.seed = seed
        self.pad_id = pad_id
        self.sort_chunk = sort_chunk
        self._lengths = lengths
        self._cached_epochs = max(1, cached_epochs)
        self._plans: OrderedDict[int, EpochPlan] = OrderedDict()

    # ------------------------------------------------------------------ planning

    def plan(self, epoch: int) -> EpochPlan:
        """The rows of ``epoch`` (computed once, then cached).

        Raises:
            ValueError: negative ``epoch``.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        plan = self._plans.get(epoch)
        if plan is None:
            plan = self._build(epoch)
            self._plans[epoch] = plan
            while len(self._plans) > self._cached_epochs:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(epoch)
        return plan

    def _build(self, epoch: int) -> EpochPlan:
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self._lengths))
        rows: list[np.ndarray] = []
        for start in range(0, len(order), self.sort_chunk):
            chunk = order[start:start + self.sort_chunk]
            for bin_items in pack_best_fit(self._lengths[chunk], self.seq_len):
                rows.append(chunk[bin_items])
        row_order = rng.permutation(len(rows))
        ordered = [rows[r] for r in row_order]
        items = np.concatenate(ordered).astype(np.int64)
        row_offsets = np.zeros(len(ordered) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in ordered], out=row_offsets[1:])
        plan = EpochPlan(items=items, row_offsets=row_offsets, rows_per_batch=self.rows)
        log.debug("epoch %d: %d conversations in %d rows, %d batches, padding %.1f%%", epoch, len(items),
                  plan.num_rows, plan.num_batches, 100 * self._padding(plan))
        return plan

    # ------------------------------------------------------------------ queries

    def num_batches(self, epoch: int) -> int:
        """Batches in ``epoch`` (may differ slightly between epochs)."""
        return self.plan(epoch).num_batches

    def batch_rows(self, epoch: int, batch_id: int) -> list[np.ndarray]:
        """Corpus indices packed in each of the ``R`` rows of a batch (empty arrays for empty rows).

        Raises:
            IndexError: ``batch_id`` not in ``0..num_batches(epoch) - 1``.
        """
        plan = self.plan(epoch)
        if not 0 <= batch_id < plan.num_batches:
            raise IndexError(f"batch {batch_id} out of range: epoch {epoch} has {plan.num_batches} batches")
        first = batch_id * self.rows
        return [plan.row(r) if r < plan.num_rows else np.zeros(0, dtype=np.int64)
                for r in range(first, first + self.rows)]

    def batch(self, epoch: int, batch_id: int) -> Batch:
        """Build batch ``batch_id`` of ``epoch`` (fresh CPU tensors, shapes ``[R, S]``).

        Raises:
            IndexError: ``batch_id`` out of range; ValueError: negative ``epoch``.
        """
        shape = (self.rows, self.seq_len)
        input_ids = np.full(shape, self.pad_id, dtype=np.int64)
        position_ids = np.zeros(shape, dtype=np.int64)
        doc_ids = np.zeros(shape, dtype=np.int32)
        loss_mask = np.zeros(shape, dtype=np.bool_)
        num_tokens = 0
        for r, conversations in enumerate(self.batch_rows(epoch, batch_id)):
            at = 0
            for doc, index in enumerate(conversations.tolist(), start=1):
                ids, mask = self.corpus.get_numpy(index)
                n = len(ids)
                input_ids[r, at:at + n] = ids
                position_ids[r, at:at + n] = np.arange(n)
                doc_ids[r, at:at + n] = doc
                loss_mask[r, at:at + n] = mask
                at += n
            num_tokens += at
        return Batch(input_ids=torch.from_numpy(input_ids), position_ids=torch.from_numpy(position_ids),
                     doc_ids=torch.from_numpy(doc_ids), loss_mask=torch.from_numpy(loss_mask),
                     epoch=epoch, batch_id=batch_id, num_tokens=num_tokens)

    def iter_epoch(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        """Batches ``start, start + 1, ...`` of ``epoch`` in order."""
        for batch_id in range(start, self.num_batches(epoch)):
            yield self.batch(epoch, batch_id)

    def padding_fraction(self, epoch: int) -> float:
        """Share of the epoch's ``num_batches * R * S`` token slots that are padding (0..1)."""
        return self._padding(self.plan(epoch))

    def _padding(self, plan: EpochPlan) -> float:
        slots = plan.num_batches * self.rows * self.seq_len
        real = int(self._lengths[plan.items].sum())
        return 1.0 - real / slots

    @property
    def batch_shape(self) -> tuple[int, int]:
        """``(R, S)``."""
        return self.rows, self.seq_len

    def tensor_specs(self) -> dict[str, tuple[tuple[int, int], torch.dtype]]:
        """``{name: (shape, dtype)}`` of every batch tensor (see :func:`batch_tensor_specs`)."""
        return batch_tensor_specs(self.rows, self.seq_len)
