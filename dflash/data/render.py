"""One normalised conversation → token sequences with the assistant loss mask, rendered with the
target's chat template the way a server prompts.

For each assistant turn k, the *context* is the template's generation prompt for turns ``0..k-1``
(``add_generation_prompt=True``: history as the template keeps it, e.g. Qwen3 drops the think blocks
of earlier assistant turns), encoded as a whole as a server encodes a prompt; the *trained tokens*
are the turn as the template writes it after that prompt (rendering of turns ``0..k`` minus the
prompt; e.g. Qwen3 with thinking on: ``<think>\\n…\\n</think>\\n\\n`` + the answer), up to and
including its end-of-turn token (``<|im_end|>`` for ChatML); the newline after it is not trained (the
target never generates it). Turn k continues the sequence of turn k-1 when its context starts with
that sequence token for token (ChatML templates such as SmolLM2's keep history verbatim: one
sequence per conversation, every assistant turn in the loss mask); otherwise it starts a new
sequence (Qwen3: one sequence per assistant turn). Sequences are cut at ``data.max_length`` tokens; a
turn whose context alone is that long is skipped, and a conversation left with no trained token is
dropped (``no_assistant_tokens``). With thinking off, a turn that carries reasoning is trained
without it (the server's prompt already closes an empty think block; counted as
``reasoning_dropped``). :class:`ChatRenderer` probes whether the template renders tool calls.

Known limits: special-token strings written inside a message (``<|im_end|>`` typed by a user)
become special tokens, as in ``apply_chat_template``. Only as much text as ``max_length`` needs is
encoded (see :func:`encode_prefix`).
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
from jinja2.exceptions import TemplateError

from dflash.data.report import NO_ASSISTANT_TOKENS, TEMPLATE_ERROR, TEMPLATE_MISMATCH

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["ChatRenderer", "end_of_turn_tokens", "encode_prefix", "stop_token_ids", "tokenize_conversation"]

log = logging.getLogger(__name__)

#: First guess of characters per token when deciding how much of a long text to encode;
#: a wrong guess only costs another round (see :func:`encode_prefix`).
CHARS_PER_TOKEN_GUESS = 8
#: :func:`encode_prefix` keeps the first ``limit`` tokens of a cut text only when at least this many
#: more tokens follow them, so that the cut cannot change them.
CUT_MARGIN_TOKENS = 32
#: Strings that end a turn in common chat templates; the tokenizer's ``eos_token`` is added.
END_OF_TURN_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|eot|>")


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


class ChatRenderer:
    """Renders conversations with the tokenizer's chat template the way a server prompts (module doc).

    ``supports_tools`` says whether the template writes tool calls and tool results (probed once);
    ``end_of_turn`` holds the strings that close an assistant turn (:func:`end_of_turn_tokens`).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, enable_thinking: Optional[bool]) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs: dict[str, Any] = {}
        if enable_thinking is not None:
            self.template_kwargs["enable_thinking"] = enable_thinking
        self.end_of_turn = end_of_turn_tokens(tokenizer)
        self.supports_tools = self._probe_tools()

    def render(self, messages: list[dict[str, Any]], tools: Optional[list[Any]], generation_prompt: bool) -> str:
        """The template's text for ``messages`` (and ``tools``), with the generation prompt when asked."""
        kwargs = dict(self.template_kwargs)
        if tools:
            kwargs["tools"] = tools
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **kwargs)

    def render_turn(self, messages: list[dict[str, Any]], k: int, tools: Optional[list[Any]]) -> tuple[str, str]:
        """``(prompt, full)``: the generation prompt for ``messages[:k]`` and the rendering of
        ``messages[:k + 1]``. When ``full`` does not start with ``prompt`` but does once the reasoning
        of turn ``k`` is removed (thinking off: the prompt closes an empty think block),
        ``messages[k]`` is replaced by its reasoning-free copy and that rendering is returned.

        Raises:
            TemplateError, TypeError, ValueError, KeyError, AttributeError: the template failed.
        """
        prompt = self.render(messages[:k], tools, True)
        full = self.render(messages[:k + 1], tools, False)
        if not full.startswith(prompt):
            stripped = _without_reasoning(messages[k])
            if stripped is not None:
                full_stripped = self.render(messages[:k] + [stripped], tools, False)
                if full_stripped.startswith(prompt):
                    messages[k] = stripped
                    return prompt, full_stripped
        return prompt, full

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
                          renderer: Optional[ChatRenderer] = None, probe: bool = False,
                          ) -> tuple[list[tuple[np.ndarray, np.ndarray]], Optional[str], dict]:
    """Tokenise a normalised conversation as a server prompts it, with the assistant loss mask.

    For each assistant turn, the tokens before it are the template's generation prompt for the
    conversation so far, encoded as a whole, and its masked tokens are the turn as the template writes
    it, end-of-turn token included (module doc). A turn continues the previous turn's
    sequence when its prompt starts with that sequence token for token, else it starts a new one.

    Args:
        messages: turns from :func:`dflash.data.conversations.normalize_conversation` (tool turns
            only when the template supports tools).
        tools: the row's tool definitions, passed to the template.
        renderer: a :class:`ChatRenderer` of ``tokenizer`` to reuse across conversations (its
            thinking mode then wins over ``enable_thinking``); built here when None.
        probe: only decide whether the conversation is kept: once a turn has given a sequence,
            later turns are rendered and checked (a template error or mismatch still drops the
            conversation) but not encoded, and no turn's trained tokens are. The reason is the
            full call's; the only sequence returned is then the first one's context (no trained
            token), and ``info`` counts only the contexts encoded.

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
    renderer = renderer or ChatRenderer(tokenizer, enable_thinking)
    info = {"truncated": False, "missing_eot": 0, "reasoning_dropped": 0, "context_too_long": 0}
    messages = [dict(m) for m in messages]
    sequences: list[tuple[list[int], list[int]]] = []
    text = ""          # the text of the last sequence so far
    is_open = False    # whether the next turn may continue it (not cut at max_length)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        try:
            prompt, full = renderer.render_turn(messages, k, tools)
            if messages[k] is not message:  # trained without its reasoning
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
        if not turn or (probe and sequences):
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
        if probe:  # the conversation has a sequence, so it is kept: the rest only renders
            continue
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


def stop_token_ids(tokenizer: Any, model: Any = None) -> list[int]:
    """Token ids that end a response: the tokenizer's EOS, its end-of-turn tokens
    (:func:`end_of_turn_tokens`: ``<|im_end|>`` for ChatML; one the vocabulary maps to unk does not
    count) and the model's ``generation_config.eos_token_id`` when ``model`` is given (pass None for
    a random target, whose generation config knows nothing of the tokenizer).

    Returns:
        sorted distinct ids, all ``>= 0``.
    """
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for text in end_of_turn_tokens(tokenizer):
        tid = tokenizer.convert_tokens_to_ids(text)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    gen = getattr(model, "generation_config", None) if model is not None else None
    eos = getattr(gen, "eos_token_id", None)
    ids.update(e for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if isinstance(e, int))
    return sorted(i for i in ids if i >= 0)
