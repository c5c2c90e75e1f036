"""JSON lines of the project's own files: appends safe against a cut line, and one reader.

``ledger.jsonl``, ``metrics.jsonl`` and the shards of data regeneration are written here and read
here. A file holds one JSON object per line, each line ended by ``\\n``, UTF-8.

Writing (:func:`append`, :class:`Appender`): the lines of one call go out in one ``write`` on an
``O_APPEND`` descriptor (repeated for what a short write left), then ``fsync``. A crash can
still cut the file inside its last line; the next writer to open the file first truncates it just
after its last ``\\n``, so a cut line never runs into the next one and is never read. A file has
one writer at a time (the launcher for a run's files, the worker that holds a shard's lock).

Reading (:func:`read`): every complete line from a byte offset on. An incomplete final piece
(no ``\\n``: cut by a crash, or still being written) is not a record and not an error. A
complete line that is not a JSON object (an old cut line that a writer ended, a hand edit) is
reported in :attr:`JsonLines.bad`, or raised as :class:`JsonlError` with ``strict``;
:func:`read_records` logs and skips it.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Union

__all__ = ["JsonlError", "BadLine", "JsonLines", "dumps", "Appender", "append", "read", "read_records"]

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]

#: Bytes read per step while looking backwards for a file's last newline.
_SCAN_BYTES = 1 << 16
_COMPACT = (",", ":")


class JsonlError(ValueError):
    """A complete line of a JSON-lines file that is not a JSON object (``strict`` reads)."""


@dataclass(frozen=True)
class BadLine:
    """A complete line that is not a JSON object: its 1-based number among the lines read (from
    ``start``), the byte offset where it begins, and why it was refused."""

    line: int
    offset: int
    error: str


@dataclass
class JsonLines:
    """What :func:`read` found.

    Attributes:
        records: the JSON objects of the complete lines, in file order.
        end: the byte offset just after the last complete line (``start`` when there is none,
            0 when the file does not exist): where the next read of new lines starts.
        bad: the complete lines that are not JSON objects.
        cut: bytes after ``end``: an incomplete final line, not read.
    """

    records: list[dict] = field(default_factory=list)
    end: int = 0
    bad: list[BadLine] = field(default_factory=list)
    cut: int = 0


def dumps(records: Iterable[dict], *, compact: bool = False, ensure_ascii: bool = True) -> str:
    """``records`` as JSON lines, each ended by ``\\n``.

    Args:
        compact: no spaces after ``,`` and ``:`` (``json.dumps``'s ``separators=(",", ":")``).
        ensure_ascii: escape non-ASCII characters (``json.dumps``'s flag of that name).

    Raises:
        TypeError, ValueError: a record ``json.dumps`` cannot write.
    """
    separators = _COMPACT if compact else None
    return "".join(json.dumps(r, separators=separators, ensure_ascii=ensure_ascii) + "\n" for r in records)


def _last_line_end(fd: int, size: int) -> int:
    """The byte offset just after the last ``\\n`` of the first ``size`` bytes of ``fd`` (0: none)."""
    pos = size
    while pos > 0:
        step = min(_SCAN_BYTES, pos)
        chunk = os.pread(fd, step, pos - step)
        newline = chunk.rfind(b"\n")
        if newline >= 0:
            return pos - step + newline + 1
        pos -= step
    return 0


class Appender:
    """A JSON-lines file held open for appending; its cut last line, if any, is dropped on opening.

    Args:
        path: the file (created when missing).
        compact, ensure_ascii: how records are written (:func:`dumps`).

    Raises:
        OSError: the file cannot be opened, read or truncated.
    """

    def __init__(self, path: PathLike, *, compact: bool = False, ensure_ascii: bool = True) -> None:
        self.path = Path(path)
        self.compact = compact
        self.ensure_ascii = ensure_ascii
        self.fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(self.fd).st_size
            if size and os.pread(self.fd, 1, size - 1) != b"\n":
                end = _last_line_end(self.fd, size)
                log.warning("%s: dropping %d bytes of a line cut mid-write", self.path, size - end)
                os.ftruncate(self.fd, end)
                os.fsync(self.fd)
        except BaseException:
            os.close(self.fd)
            raise

    def append(self, records: Union[dict, Iterable[dict]]) -> None:
        """Append one record (a dict) or several as JSON lines in one write (repeated until
        complete), then ``fsync``.

        Raises:
            TypeError, ValueError: a record ``json.dumps`` cannot write (nothing is written).
            OSError: writing fails.
        """
        batch = [records] if isinstance(records, dict) else list(records)
        view = memoryview(dumps(batch, compact=self.compact, ensure_ascii=self.ensure_ascii).encode("utf-8"))
        while view:
            view = view[os.write(self.fd, view):]
        os.fsync(self.fd)

    def close(self) -> None:
        """Close the file (once)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Appender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def append(path: PathLike, records: Union[dict, Iterable[dict]], *, compact: bool = False,
           ensure_ascii: bool = True) -> None:
    """Open ``path``, append ``records`` (:meth:`Appender.append`), close it.

    Raises:
        TypeError, ValueError: a record ``json.dumps`` cannot write.
        OSError: opening or writing fails.
    """
    with Appender(path, compact=compact, ensure_ascii=ensure_ascii) as out:
        out.append(records)


def read(path: PathLike, start: int = 0, *, strict: bool = False) -> JsonLines:
    """The complete lines of ``path`` from byte ``start`` on (:class:`JsonLines`); nothing when
    the file does not exist.

    A line that begins before ``start`` is not read (so ``start`` may be any offset, e.g. the
    last 64 KiB of a long file). Blank lines are passed over.

    Raises:
        JsonlError: ``strict`` and a complete line that is not a JSON object (naming the file,
            the line and the error).
        OSError: the file exists but cannot be read.
    """
    path = Path(path)
    begin = max(0, start - 1)  # the byte before start says whether a line begins at start
    try:
        with open(path, "rb") as handle:
            handle.seek(begin)
            data = handle.read()
    except FileNotFoundError:
        return JsonLines()
    first = 0
    if start > 0:
        newline = data.find(b"\n")
        if newline < 0:  # still inside a line that begins before start
            return JsonLines(end=start, cut=max(0, len(data) - 1))
        first = newline + 1
    last = data.rfind(b"\n") + 1
    out = JsonLines(end=begin + last, cut=len(data) - last)
    pos = first
    number = 0
    while pos < last:
        stop = data.index(b"\n", pos) + 1
        raw = data[pos:stop]
        number += 1
        if raw.strip():
            try:
                record = json.loads(raw.decode("utf-8"))
                error = "" if isinstance(record, dict) else f"not a JSON object but a {type(record).__name__}"
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                error = str(exc)
            if not error:
                out.records.append(record)
            elif strict:
                raise JsonlError(f"{path}: line {number} (byte {begin + pos}) is not a JSON object: {error}")
            else:
                out.bad.append(BadLine(number, begin + pos, error))
        pos = stop
    return out


def read_records(path: PathLike, start: int = 0, what: Optional[str] = None) -> list[dict]:
    """The records of :func:`read`; each complete line that is not a JSON object is logged (a
    warning naming ``what``, default the path) and skipped."""
    found = read(path, start)
    for bad in found.bad:
        log.warning("%s: line %d (byte %d) skipped, not a JSON object: %s", what or path, bad.line, bad.offset,
                    bad.error)
    return found.records
