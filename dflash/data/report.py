"""The data preparation report: every reason a row is dropped, changed or flagged, and
:class:`DataReport`, which counts rows under those reasons and keeps the first dropped rows of each.

:func:`dflash.data.corpus.tokenize_rows` fills a report; it is logged at the end of preparation and
stored with the cached corpus (``report.json``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from dflash.data.sources import InvalidRow

__all__ = [
    "DROP_REASONS",
    "FIX_REASONS",
    "FLAG_REASONS",
    "DataReport",
    "drop_example",
    "row_id",
]

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
NOT_UTF8 = "not_utf8"                      # a JSONL line whose bytes are not UTF-8 text (e.g. Latin-1), or a
                                           # string holding a lone surrogate (a "\ud800" escape)
NOT_OBJECT = "not_object"                  # parses, but is not a JSON object
NO_MESSAGES = "no_messages_field"          # neither a ``conversations`` nor a ``messages`` list
EMPTY_CONVERSATION = "empty_conversation"  # the list is empty
BAD_TURN = "bad_turn"                      # a turn is not an object, lacks role/content, content is not text,
                                           # or its tool calls are malformed
EMPTY_TURN = "empty_turn"                  # a turn's content is empty or only whitespace (and no tool call)
UNKNOWN_ROLE = "unknown_role"              # a role other than system/developer/user/human/assistant/gpt/tool
NO_USER_TURN = "no_user_turn"              # nothing left once the turns before the first user turn are dropped
SAME_ROLE_RUN = "same_role_run"            # two consecutive turns of the same role (tool turns aside)
NO_ASSISTANT_TURN = "no_assistant_turn"    # no assistant turn after the first user turn
DUPLICATE_CONVERSATION = "duplicate_conversation"  # same normalised content as an earlier row
TOOL_CALLS_UNSUPPORTED = "tool_calls_unsupported"  # the template cannot render tools, nothing before them
TEMPLATE_ERROR = "template_error"          # the chat template raised (e.g. roles must alternate)
TEMPLATE_MISMATCH = "template_mismatch"    # a turn's rendering does not start with the generation prompt
NO_ASSISTANT_TOKENS = "no_assistant_tokens"  # every assistant turn's context is max_length tokens or longer
EXTRA_NOT_SAMPLED = "extra_not_sampled"    # a row of data.extra_datasets left out of data.extra_token_ratio's sample
# Drop reasons of prompt files only (dflash.inference.prompt_sets), not of training rows.
BAD_PROMPT = "bad_prompt"                  # a {"prompt": ...} row whose prompt is not a non-empty string
PROMPT_TOO_LONG = "prompt_too_long"        # the rendered prompt is longer than the decoding check allows
#: Every reason a row can be dropped for, in pipeline order.
DROP_REASONS = (
    NOT_UTF8, INVALID_JSON, NOT_OBJECT, NO_MESSAGES, EMPTY_CONVERSATION, BAD_TURN, EMPTY_TURN, UNKNOWN_ROLE,
    NO_USER_TURN, SAME_ROLE_RUN, NO_ASSISTANT_TURN, DUPLICATE_CONVERSATION, TOOL_CALLS_UNSUPPORTED,
    TEMPLATE_ERROR, TEMPLATE_MISMATCH, NO_ASSISTANT_TOKENS, EXTRA_NOT_SAMPLED,
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
    #: Token sequences made from them (one or more per conversation; see :mod:`dflash.data.render`).
    sequences: int = 0
    #: Rows dropped, by reason (keys from :data:`DROP_REASONS`).
    dropped: dict[str, int] = field(default_factory=dict)
    #: Kept rows changed by normalisation or rendering, by reason (keys from :data:`FIX_REASONS`).
    fixed: dict[str, int] = field(default_factory=dict)
    #: Kept rows flagged, by reason (keys from :data:`FLAG_REASONS`).
    flagged: dict[str, int] = field(default_factory=dict)
    #: The first :data:`DROP_EXAMPLES_PER_REASON` dropped rows of each reason, in the order the rows
    #: were read (file order; a ``data.extra_token_ratio`` sample is read in its random order), each
    #: ``{"row": 0-based row index (numbered as TokenizedCorpus.source_rows), "line": 1-based line
    #: of a JSONL file (absent for a JSON array), "id": the row's ``id`` field (absent when it has
    #: none), "error": the parser's message (``invalid_json`` only)}``.
    drop_examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: Every row under each reason (dropped, fixed or flagged), in the order the rows were read (as
    #: :attr:`drop_examples`; so is which of two rows with one id is flagged): its ``id`` as a
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
    #: With ``data.extra_datasets``: the rows read from ``data.dataset`` (the first ones; row
    #: numbers from this one on are the extra datasets', in order) and the conversations kept from
    #: the extra datasets (included in :attr:`conversations`); ``None`` / 0 without them.
    primary_rows: Optional[int] = None
    extra_conversations: int = 0
    #: With ``data.extra_datasets``: the tokens kept from ``data.dataset`` (the rest of
    #: :attr:`tokens` are the extra rows'); ``None`` without them.
    primary_tokens: Optional[int] = None
    #: ``data.extra_token_ratio`` when the extra rows were sampled (``None``: all of them).
    extra_token_ratio: Optional[float] = None
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
        extra = ""
        if self.primary_rows is not None:
            extra = (f" ({self.extra_conversations} of them from the {self.rows_read - self.primary_rows} rows of "
                     f"data.extra_datasets, training only{self.extra_tokens_text()})")
        return (f"prepared {self.conversations} conversations ({self.sequences} sequences) from {self.rows_read} "
                f"rows of {self.source}{extra}; {dropped}; {self.truncated} truncated; {self.tokens} tokens, "
                f"{self.assistant_tokens} assistant{where}{first}")

    def extra_tokens_text(self) -> str:
        """``, 1200 of the 2400 tokens, a sample of 1 × data.dataset's 1200`` (empty for a report
        without :attr:`primary_tokens`)."""
        if self.primary_tokens is None:
            return ""
        text = f", {self.tokens - self.primary_tokens} of the {self.tokens} tokens"
        if self.extra_token_ratio is not None:
            text += f", a sample of {self.extra_token_ratio:g} × data.dataset's {self.primary_tokens}"
        return text

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


def drop_example(row: Any, row_number: int, line: Optional[int] = None) -> dict[str, Any]:
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
    if isinstance(row, InvalidRow):
        example["error"] = row.error[:DROP_EXAMPLE_ERROR_CHARS]
    identity = row_id(row)
    if isinstance(identity, str):
        example["id"] = identity[:DROP_EXAMPLE_ID_CHARS]
    elif identity is not None:
        example["id"] = identity
    return example


def row_id(row: Any) -> Union[str, int, None]:
    """The row's ``id`` field when it is a string or an integer, else None."""
    identity = row.get("id") if isinstance(row, dict) else None
    if isinstance(identity, str) or (isinstance(identity, int) and not isinstance(identity, bool)):
        return identity
    return None
