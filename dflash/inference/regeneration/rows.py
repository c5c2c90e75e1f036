"""Source rows of data regeneration: their stable ids, their owner worker, their sampling seeds.

**Ids.** The row's ``id`` field when it is a non-empty string or a number, else the first
:data:`HASH_ID_CHARS` hex digits of the sha256 of its canonical JSON; the k-th repeat (k >= 1) of an
id in file order becomes ``id#k``. Rows that :func:`dflash.data.conversations.normalize_row` rejects are
counted by reason and never sent to a worker. Worker k of N owns the rows whose
``sha256(id) mod N == k``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterator, Optional

__all__ = ["HASH_ID_CHARS", "TOOL_CALLS", "SourceRow", "row_id", "iter_source", "shard_of", "turn_seed"]

#: Hex digits of the sha256 used as the id of a row without an ``id`` field.
HASH_ID_CHARS = 16
#: Reason a source row with tool calls or tool turns is not regenerated (counted with the reader's reasons).
TOOL_CALLS = "tool_calls"


@dataclass
class SourceRow:
    """One usable source conversation: its position in the file, stable id and normalised turns."""

    index: int
    id: str
    messages: list[dict[str, str]]


def row_id(row: Any) -> str:
    """The stable id of a source row (before de-duplication).

    The ``id`` field when it is a non-empty string or an integer, else the first
    :data:`HASH_ID_CHARS` hex digits of the sha256 of the row's canonical JSON (sorted keys).
    """
    if isinstance(row, dict):
        value = row.get("id")
        if isinstance(value, str) and value.strip():
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
    canonical = json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:HASH_ID_CHARS]


def iter_source(dataset: str, limit: Optional[int], dropped: Optional[dict[str, int]] = None) -> Iterator[SourceRow]:
    """Usable rows of ``dataset`` (``sharegpt`` or a JSONL path) in file order, at most ``limit`` rows read.

    Ids come from :func:`row_id`; the k-th repeat of an id (counting every row read, usable or not)
    becomes ``id#k``. Rows :func:`dflash.data.conversations.normalize_row` rejects, and rows with tool calls or tool
    turns (``tool_calls``: a regenerated tool call would need the tool run again), are not yielded;
    their reasons are counted into ``dropped``. Never raises on a bad row.

    Raises:
        ConfigError: ``dataset`` is neither ``sharegpt`` nor an existing file.
    """
    from dflash.data.conversations import normalize_row
    from dflash.data.sources import read_rows

    seen: dict[str, int] = {}
    for index, row in enumerate(read_rows(dataset, limit)):
        base = row_id(row)
        repeat = seen.get(base, 0)
        seen[base] = repeat + 1
        messages, reason = normalize_row(row)
        if messages is not None and any(m["role"] == "tool" or "tool_calls" in m for m in messages):
            messages, reason = None, TOOL_CALLS  # the tools cannot be run again for new calls
        if messages is None:
            if dropped is not None:
                dropped[reason] = dropped.get(reason, 0) + 1
            continue
        yield SourceRow(index, base if repeat == 0 else f"{base}#{repeat}", messages)


def shard_of(rid: str, world: int) -> int:
    """The worker rank (0 ≤ rank < ``world``) that owns row id ``rid``: ``sha256(rid) mod world``."""
    return int.from_bytes(hashlib.sha256(rid.encode("utf-8")).digest()[:8], "little") % world


def turn_seed(seed: int, rid: str, turn: int) -> int:
    """The sampling seed of turn ``turn`` (0-based) of row ``rid``: 63 bits of a sha256."""
    digest = hashlib.sha256(f"{seed}\0{rid}\0{turn}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
