"""Conversation normalisation: a data row (ShareGPT or OpenAI form) → turns ``[{role, content, ...}]``,
or the reason it is dropped; and the content hash that finds duplicate conversations.

Roles become ``system`` / ``user`` / ``assistant`` / ``tool`` (``human`` → user, ``gpt`` → assistant),
the way SpecForge and speculators pre-process ShareGPT. Turns before the first user turn (after an
optional leading system turn) are dropped (ShareGPT continuation rows start with the assistant;
trained as they are, their context would be the template's default system prompt alone, which no
server sends), counted under ``leading_turns_dropped``; the row is dropped (``no_user_turn``) when no
user turn is left. A row with two consecutive turns of the same role (``tool`` runs aside) is dropped
(``same_role_run``): merging would invent a message nobody sent in one piece (and, for the
assistant, a response the model never produced at once), and such rows are rare (0.4 % of ShareGPT).

Two rows whose normalised content (turns and tools, :func:`conversation_hash`) is equal are the same
conversation whatever their ``id`` or source form; :func:`dflash.data.corpus.tokenize_rows` keeps the
first.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from dflash.data.report import (
    BAD_PROMPT, BAD_TURN, EMPTY_CONVERSATION, EMPTY_TURN, INVALID_JSON, LEADING_TURNS_DROPPED, NO_ASSISTANT_TURN, NO_MESSAGES,
    NO_USER_TURN, NOT_OBJECT, NOT_UTF8, SAME_ROLE_RUN, UNKNOWN_ROLE,
)
from dflash.data.sources import InvalidRow

__all__ = ["ROLE_ALIASES", "NormalizedRow", "conversation_hash", "has_conversation", "is_text",
           "normalize_conversation", "normalize_prompt", "normalize_row"]

#: Accepted roles (ShareGPT ``from`` and OpenAI ``role``) and what they become. OpenAI's
#: ``developer`` role is its newer name for the system message.
ROLE_ALIASES = {
    "system": "system",
    "developer": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
}


def _turn_text(value: Any) -> Optional[str]:
    """Text content of a turn: a string, or OpenAI content parts that are all text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    return None


def is_text(value: str) -> bool:
    """Whether ``value`` is text UTF-8 can encode: not when it holds a lone surrogate, as a JSON
    ``\\ud800`` escape decodes to (tokenizers refuse such strings)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def has_conversation(row: Any) -> bool:
    """Whether ``row`` holds a non-empty ``messages`` or ``conversations`` list."""
    return isinstance(row, dict) and any(isinstance(row.get(k), list) and row[k] for k in ("messages", "conversations"))


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
    texts = [content, message.get("reasoning_content", "")]
    if tool_calls is not None:
        texts.append(json.dumps(tool_calls, ensure_ascii=False))
    if not all(map(is_text, texts)):
        return None, NOT_UTF8
    return message, None


def normalize_conversation(row: Any) -> NormalizedRow:
    """A data row → its normalised turns, or the reason it is dropped (see the module doc).

    Accepts ``{"conversations": [{"from", "value"}]}`` (ShareGPT) and ``{"messages": [{"role",
    "content"}]}`` (OpenAI: content may be a list of text parts, or null on an assistant turn with
    ``tool_calls``; ``reasoning_content`` or ``reasoning`` on assistant turns; ``tool`` turns; a
    row-level ``tools`` list). Roles map through :data:`ROLE_ALIASES`; content is kept verbatim.
    Turns before the first user turn (a leading system turn aside) are dropped. Never raises.
    """
    normalized = _normalize_turns(row)
    if normalized.messages is None:
        return normalized
    if not any(m["role"] == "assistant" for m in normalized.messages):
        return NormalizedRow(None, NO_ASSISTANT_TURN)
    return normalized


def normalize_prompt(row: Any) -> NormalizedRow:
    """A prompt row → the turns a server is sent: the conversation up to and including its last
    user turn, or the reason the row is dropped.

    Accepts what :func:`normalize_conversation` accepts (ShareGPT or OpenAI rows, normalised the
    same way: leading turns dropped, a same-role run refused) with or without an assistant turn, and
    ``{"prompt": "..."}`` (one user turn; a ``prompt`` that is not a non-empty string is
    ``bad_prompt``) or ``{"prompt": [turns]}`` (TRL's conversational prompt). A row with both a
    ``prompt`` and a non-empty ``messages`` / ``conversations`` list is its conversation; with an
    empty or null one, its prompt. Never raises.
    """
    if isinstance(row, dict) and "prompt" in row and not has_conversation(row):
        prompt = row["prompt"]
        if isinstance(prompt, list):  # TRL's conversational prompt: the turns themselves
            row = {"messages": prompt, "tools": row.get("tools")}
        elif not isinstance(prompt, str) or not prompt.strip():
            return NormalizedRow(None, BAD_PROMPT)
        elif not is_text(prompt):
            return NormalizedRow(None, NOT_UTF8)
        else:
            row = {"messages": [{"role": "user", "content": prompt}], "tools": row.get("tools")}
    normalized = _normalize_turns(row)
    if normalized.messages is None:
        return normalized
    last_user = max(i for i, m in enumerate(normalized.messages) if m["role"] == "user")
    normalized.messages = normalized.messages[:last_user + 1]
    return normalized


def _normalize_turns(row: Any) -> NormalizedRow:
    """:func:`normalize_conversation` but for its assistant-turn check: the turns hold a user turn."""
    if isinstance(row, InvalidRow):
        return NormalizedRow(None, NOT_UTF8 if row.not_utf8 else INVALID_JSON)
    if not isinstance(row, dict):
        return NormalizedRow(None, NOT_OBJECT)
    lists = [row[k] for k in ("messages", "conversations") if isinstance(row.get(k), list)]
    if not lists:
        return NormalizedRow(None, NO_MESSAGES)
    turns = next((t for t in lists if t), lists[0])  # a non-empty one wins over an empty one
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
    tools = row.get("tools") if isinstance(row.get("tools"), list) and row.get("tools") else None
    if tools is not None and not is_text(json.dumps(tools, ensure_ascii=False)):
        return NormalizedRow(None, NOT_UTF8)
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

