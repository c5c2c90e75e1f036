"""The files of data regeneration: each worker's shard, the finished ids, the merge into the output.

``<output>.rank<k>`` is worker k's shard: finished rows appended (:class:`dflash.jsonl.Appender`: one
``os.write`` plus ``fsync`` per round), while the worker holds the exclusive lock
``<output>.rank<k>.lock`` (:func:`dflash.utils.file_lock`) — so a restarted launcher can wait,
bounded, for a previous run's workers to exit before it reads the shards. Opening a shard truncates
it after its last newline, so a line cut by a kill mid-write is dropped and regenerated, never
duplicated.
``<output>.skipped`` keeps the skip records of merged shards. Rows already in ``<output>``, in
``<output>.skipped`` or in any shard (of any earlier worker count) are done, except *partial* rows
(conversations a time budget stopped after some turns,
:func:`is_partial`), which a later run regenerates whole.
:func:`merge_outputs` writes ``<output>`` and ``<output>.skipped`` in source order (an id once, a
finished row before a partial one; :func:`dflash.utils.atomic_write_text`) and deletes the shards
and their locks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dflash import jsonl
from dflash.utils import atomic_write_text, file_lock

__all__ = ["LOCK_WAIT_S", "SHARD_INFIX", "shard_path", "shard_lock_path", "existing_shards", "read_lines",
           "ShardWriter", "wait_for_shard_locks", "skipped_path", "is_partial", "done_ids", "MergeReport",
           "merge_outputs"]

#: Longest wait for a previous run's worker to release its shard lock (seconds).
LOCK_WAIT_S = 60.0
SHARD_INFIX = ".rank"
LOCK_SUFFIX = ".lock"


def shard_path(output: Path, rank: int) -> Path:
    """``<output>.rank<rank>``: worker ``rank``'s shard."""
    return output.with_name(f"{output.name}{SHARD_INFIX}{rank}")


def shard_lock_path(shard: Path) -> Path:
    """``<shard>.lock``: held (exclusively) by the worker that appends to ``shard``."""
    return shard.with_name(shard.name + LOCK_SUFFIX)


def existing_shards(output: Path) -> list[Path]:
    """Every shard of ``output`` on disk (any rank, any earlier worker count), by rank."""
    prefix = output.name + SHARD_INFIX
    found = []
    if output.parent.is_dir():
        for p in output.parent.iterdir():
            suffix = p.name[len(prefix):]
            if p.name.startswith(prefix) and suffix.isdigit() and p.is_file():
                found.append((int(suffix), p))
    return [p for _, p in sorted(found)]


def read_lines(path: Path, start: int = 0) -> tuple[list[dict], int, int]:
    """Complete JSON-object lines of ``path`` from byte ``start`` (:func:`dflash.jsonl.read`).

    A trailing piece without a newline (a write cut by a kill) is not read; a complete line that
    does not parse as a JSON object with an ``id`` is skipped and counted.

    Returns:
        ``(records, end, bad)``: the records, the byte offset just after the last complete line
        (``start`` when there is none; 0 when the file does not exist) and the count of bad lines.
    """
    found = jsonl.read(path, start)
    records = [r for r in found.records if isinstance(r.get("id"), str)]
    return records, found.end, len(found.bad) + len(found.records) - len(records)


class ShardWriter:
    """A worker's shard opened for appending while the worker holds the shard's exclusive lock.

    Opening takes the lock (:func:`shard_lock_path`, waiting up to ``timeout_s``), creates the shard
    when missing and truncates it just after its last newline, so a line cut by a kill mid-write
    disappears (its row is regenerated, once). The lock is held until :meth:`close` (also on
    leaving a ``with`` block); the operating system releases it when the process dies.

    Raises:
        TimeoutError: another process holds the shard's lock for ``timeout_s`` seconds
            (:data:`dflash.utils.LockTimeout` is a ``TimeoutError``).
    """

    def __init__(self, path: Path, timeout_s: float = LOCK_WAIT_S) -> None:
        self.path = path
        self.lock = file_lock(shard_lock_path(path))
        self.lock.acquire(timeout=timeout_s)
        try:
            self.file = jsonl.Appender(path, ensure_ascii=False)
        except BaseException:
            self.lock.release()
            raise

    def append(self, records: list[dict]) -> None:
        """Append ``records`` as JSON lines with one write call (retried until complete), then ``fsync``."""
        self.file.append(records)

    def close(self) -> None:
        """Close the shard, then release its lock."""
        try:
            self.file.close()
        finally:
            self.lock.release()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_for_shard_locks(output: Path, timeout_s: float = LOCK_WAIT_S) -> None:
    """Wait until no process holds the lock of any shard of ``output``: a previous launcher's
    workers may still be exiting.

    Raises:
        TimeoutError: a shard's lock is still held after ``timeout_s`` seconds (each).
    """
    prefix = output.name + SHARD_INFIX
    for path in sorted(output.parent.glob(f"{prefix}*{LOCK_SUFFIX}")):
        if path.name[len(prefix):-len(LOCK_SUFFIX)].isdigit():
            lock = file_lock(path)
            lock.acquire(timeout=timeout_s)
            lock.release()


def skipped_path(output: Path) -> Path:
    """``<output>.skipped``: the skip records of merged shards (rows that will never be in ``<output>``)."""
    return output.with_name(output.name + ".skipped")


def is_partial(record: dict) -> bool:
    """Whether an output line is a partial row: a conversation a time budget stopped after some of
    its turns (``regen.partial``, :meth:`dflash.inference.regeneration.jobs.ConversationJob.record`).
    It is a valid row to train on, and not done: a later run regenerates the conversation from
    its start and the whole row replaces this one."""
    meta = record.get("regen")
    return isinstance(meta, dict) and meta.get("partial") is True


def done_ids(output: Path) -> set[str]:
    """Ids already finished: every complete line of ``<output>``, of ``<output>.skipped`` and of
    every shard, partial rows excepted."""
    done: set[str] = set()
    for path in [output, skipped_path(output), *existing_shards(output)]:
        records, _, _ = read_lines(path)
        done.update(r["id"] for r in records if not is_partial(r))
    return done


@dataclass
class MergeReport:
    """What a merge wrote: rows (``partial`` of them partial), skipped rows by reason, lines seen
    twice, unreadable lines, new tokens of the rows written."""

    rows: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    bad_lines: int = 0
    new_tokens: int = 0
    partial: int = 0


def _turns(record: dict) -> int:
    meta = record.get("regen")
    turns = meta.get("turns") if isinstance(meta, dict) else None
    return turns if isinstance(turns, int) else 0


def merge_outputs(output: Path) -> MergeReport:
    """Merge ``<output>`` and its shards into ``<output>`` (atomically), then delete the shards and
    their lock files (the caller holds the output's lock; no worker runs).

    Rows are ordered by ``regen.source_index`` (rows without one keep their order, last); an id is
    written once (the first finished record seen: ``<output>`` first, then ``<output>.skipped``,
    then shards by rank; later copies are counted as duplicates). A partial row is written only
    when its id has no finished record (the one with the most turns, the first seen among equals);
    the partial rows a finished one replaces are not duplicates. Skip records are counted and kept in
    ``<output>.skipped`` (so that a later run does not check those rows again). Without shards
    nothing is rewritten: ``<output>`` keeps its bytes and modification time (a complete output
    stays valid for every cache keyed on it).
    """
    report = MergeReport()
    seen: set[str] = set()
    partial: dict[str, dict] = {}  # id -> its partial row with the most turns (the first seen among equals)
    rows: list[tuple[int, int, dict]] = []
    skips: list[dict] = []

    def keep(record: dict) -> None:
        meta = record.get("regen") if isinstance(record.get("regen"), dict) else {}
        index = meta.get("source_index")
        report.new_tokens += sum(meta.get("new_tokens", []) or [])
        rows.append((0 if isinstance(index, int) else 1, index if isinstance(index, int) else len(rows), record))

    shards = existing_shards(output)
    for path in [output, skipped_path(output), *shards]:
        records, _, bad = read_lines(path)
        report.bad_lines += bad
        for record in records:
            rid = record["id"]
            if is_partial(record):
                kept = partial.get(rid)
                if kept is None or _turns(record) > _turns(kept):
                    partial[rid] = record
                continue
            if rid in seen:
                report.duplicates += 1
                continue
            seen.add(rid)
            if "skipped" in record:
                reason = str(record["skipped"])
                report.skipped[reason] = report.skipped.get(reason, 0) + 1
                skips.append(record)
                continue
            keep(record)
    for rid, record in partial.items():
        if rid not in seen:  # else a finished row (or skip) replaces it
            keep(record)
            report.partial += 1
    report.rows = len(rows)
    if not shards and output.exists():
        return report
    rows.sort(key=lambda item: (item[0], item[1]))
    atomic_write_text(skipped_path(output), jsonl.dumps(skips, ensure_ascii=False))  # first: a kill between the two renames loses no skip
    atomic_write_text(output, jsonl.dumps([record for _, _, record in rows], ensure_ascii=False))
    for path in shards:
        path.unlink()
        shard_lock_path(path).unlink(missing_ok=True)
    return report
