"""The held-out split, by conversation, and the check that it is sound.

:func:`dflash.data.corpus.prepare_data` splits the conversations left after deduplication: the last
``data.heldout_conversations`` of a shuffle seeded by ``data.seed`` are held out, the rest trains, and
every sequence of a conversation goes to its conversation's side. Deduplication comes first, so no
held-out conversation equals a training one; :func:`heldout_twins` counts any that do (0 when the
split is sound).

ShareGPT keeps a long conversation as several rows, its parts, with ids ``<id>_0``, ``<id>_1``, …
(each part a run of its turns). The parts of one conversation share its topic, its format and often
its text, so a part in training would tell the drafter much of a held-out part's response. Rows of
one :func:`conversation_group` are therefore one conversation to the split: the held-out
conversations are drawn as above, and every other part of their conversations is set aside, in
neither split (:func:`dflash.data.corpus.load_prepared`). The held-out set is the same with or
without the parts, and so are the prompts the decoding check draws from it. Ids that name rows
(``sample_1``, ``sample_2``, …) would make one conversation of them all: when the parts set aside
would be more than half of the training conversations the split refuses, naming
``data.set_aside_parts`` (``false`` turns the rule off).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Optional, Union

import numpy as np

from dflash.config import ConfigError
from dflash.data.conversations import conversation_hash, normalize_conversation
from dflash.data.sources import read_rows

if TYPE_CHECKING:
    from dflash.data.corpus import PreparedData

__all__ = ["split_heldout", "heldout_twins", "conversation_group"]

#: A part's id: the conversation's id, an underscore, the part's number.
_PART_ID = re.compile(r"^(.+)_(\d+)$")


def conversation_group(identity: Union[str, int, None]) -> Optional[str]:
    """The conversation a row belongs to, from its ``id`` (:func:`dflash.data.report.row_id`):
    ``"QWJhYvA_3"`` → ``"QWJhYvA"`` (ShareGPT's part 3 of conversation ``QWJhYvA``), any other id as
    a string (``7`` → ``"7"``); ``None`` for a row without an id (a conversation of its own)."""
    if identity is None:
        return None
    text = str(identity)
    part = _PART_ID.match(text)
    return part.group(1) if part else text


def split_heldout(num_conversations: int, heldout: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices (int64, sorted) of the train and held-out conversations (:func:`dflash.data.corpus.prepare_data`
    splits the deduplicated conversations, then takes every sequence of each).

    Held-out = the last ``heldout`` of a permutation drawn from ``numpy.random.default_rng(seed)``;
    deterministic and disjoint from train.

    Raises:
        ConfigError: ``data.heldout_conversations`` leaves no conversation to train on.
    """
    if heldout >= num_conversations:
        raise ConfigError(f"data.heldout_conversations: {heldout} held out of {num_conversations} conversations "
                          f"leaves none to train on")
    order = np.random.default_rng(seed).permutation(num_conversations)
    cut = num_conversations - heldout
    return np.sort(order[:cut]).astype(np.int64), np.sort(order[cut:]).astype(np.int64)


def heldout_twins(prepared: PreparedData, dataset: str, limit: Optional[int]) -> int:
    """Held-out conversations whose normalised content equals a training conversation's (re-read from
    ``dataset``; 0 when the split is sound). Training rows of ``data.extra_datasets`` are not
    re-read: tokenisation already dropped any of them equal to an earlier row, held-out ones
    included."""
    rows_of = {int(prepared.train.source_row(i)) for i in range(len(prepared.train))}
    held = {int(prepared.heldout.source_row(i)) for i in range(len(prepared.heldout))}
    train_hashes: set[str] = set()
    held_hashes: list[str] = []
    for number, row in enumerate(read_rows(dataset, limit)):
        if number in rows_of or number in held:
            normalized = normalize_conversation(row)
            digest = conversation_hash(normalized.messages or [], normalized.tools)
            (held_hashes.append(digest) if number in held else train_hashes.add(digest))
    return sum(h in train_hashes for h in held_hashes)

