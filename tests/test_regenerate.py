"""Data regeneration (``dflash.inference.regenerate`` and ``dflash.inference.regeneration``) on CPU with a tiny random target and the Qwen3 tokenizer.

- batched, left-padded greedy generation with a KV cache equals a naive loop (full forward, argmax)
  for each prompt on its own; sampling depends only on (seed, row, turn), not on the batch;
- ids are stable and de-duplicated, shards cover every id once, a line cut mid-write is dropped;
- end to end through ``python -m launch.cluster --mode regenerate`` with 2 workers: SIGKILL of the
  launcher mid-way (no worker outlives it), a cut line injected, a restart: every id exactly once,
  the reader's drops counted, the output read back by ``dflash.data.corpus`` without a drop, and a
  multi-turn row equal to the target's own greedy continuation, turn by turn.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from dflash.config import TargetConfig
from dflash.data.render import stop_token_ids
from dflash.inference.regeneration.generators import BatchGenerator, Generated
from dflash.inference.regeneration.jobs import ConversationJob, GenerationOptions
from dflash.inference.regeneration.rows import SourceRow, iter_source, row_id, shard_of
from dflash.inference.regeneration.shards import (ShardWriter, done_ids, merge_outputs, read_lines, shard_lock_path,
                                                  shard_path)
from dflash.utils import file_lock

ROOT = Path(__file__).resolve().parent.parent
BAD_ROWS = ROOT / "tests" / "fixtures" / "bad_rows.jsonl"
QWEN3_VOCAB = 151669  # len(qwen3 tokenizer): the random target's vocabulary matches it
MAX_NEW = 16
RUN_TIMEOUT_S = 120
WAIT_S = 60.0


@pytest.fixture(scope="module")
def tokenizer():
    from dflash.data.tokenizer import load_tokenizer

    return load_tokenizer(TargetConfig(kind="random", tokenizer="qwen3"))


@pytest.fixture(scope="module")
def target():
    from dflash.models.target_loader import load_target

    torch.set_num_threads(1)
    return load_target(TargetConfig(kind="random", arch="tiny-llama", arch_overrides={"vocab_size": QWEN3_VOCAB},
                                    tokenizer="qwen3"), "cpu")


@pytest.fixture(scope="module")
def generator(target, tokenizer):
    return BatchGenerator(target.model, stop_token_ids(tokenizer), tokenizer.pad_token_id, len(tokenizer))


def naive_greedy(model, prompt: list[int], stop: set[int], max_new: int) -> Generated:
    """The target's own greedy continuation: a full forward per token, no cache, no padding."""
    ids = list(prompt)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            if nxt in stop:
                return Generated(new, "stop")
            new.append(nxt)
            ids.append(nxt)
    return Generated(new, "length")


def _prompt(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------- generation


def test_batched_greedy_equals_naive_loop(target, tokenizer, generator):
    prompts = [_prompt(tokenizer, [{"role": "user", "content": text}]) for text in
               ("Hi", "Write a long poem about the sea, the wind and the sky.", "What is 2 + 2?")]
    assert len({len(p) for p in prompts}) == 3  # left padding is exercised
    batched = generator.generate(prompts, MAX_NEW)
    stop = set(stop_token_ids(tokenizer))
    for prompt, got in zip(prompts, batched):
        assert got == naive_greedy(target.model, prompt, stop, MAX_NEW)
    # a stop token ends a row early while the others go on
    forced = BatchGenerator(target.model, [batched[1].ids[2]], tokenizer.pad_token_id, len(tokenizer))
    short = forced.generate(prompts, MAX_NEW)
    assert short[1] == Generated(batched[1].ids[:2], "stop")


def test_sampling_depends_on_row_seed_only(tokenizer, generator):
    a = _prompt(tokenizer, [{"role": "user", "content": "Tell me a story."}])
    b = _prompt(tokenizer, [{"role": "user", "content": "A much longer question about many different things?"}])
    alone = generator.generate([a], MAX_NEW, temperature=1.0, top_p=0.9, seeds=[7])[0]
    batched = generator.generate([b, a], MAX_NEW, temperature=1.0, top_p=0.9, seeds=[3, 7])[1]
    assert alone == batched
    other = generator.generate([a], MAX_NEW, temperature=1.0, seeds=[8])[0]
    assert other.ids != alone.ids
    nucleus_of_one = generator.generate([a], MAX_NEW, temperature=1.0, top_p=1e-9, seeds=[8])[0]
    assert nucleus_of_one == generator.generate([a], MAX_NEW)[0]  # top_p -> 0 keeps only the argmax
    with pytest.raises(ValueError):
        generator.generate([a], MAX_NEW, temperature=1.0)


def test_options_are_checked():
    from dflash.config import ConfigError

    for bad in (dict(max_new_tokens=0), dict(temperature=-1.0), dict(temperature=float("nan")),
                dict(temperature=float("inf")), dict(top_p=0.0), dict(top_p=1.5),
                dict(batch_size=0), dict(max_turns=0), dict(attention="flex+cudnn")):
        with pytest.raises(ConfigError):
            GenerationOptions(**bad).check()


# --------------------------------------------------------------------------- ids, shards, files


def test_ids_are_stable_and_unique(tmp_path):
    rows = [{"id": "a", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "r"}]},
            {"id": "a", "conversations": [{"from": "human", "value": "q2"}, {"from": "gpt", "value": "r2"}]},
            {"messages": [{"role": "user", "content": "no id"}, {"role": "assistant", "content": "ok"}]},
            {"id": 5, "messages": []}]
    path = tmp_path / "src.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    dropped: dict[str, int] = {}
    got = list(iter_source(str(path), None, dropped))
    assert [r.id for r in got] == ["a", "a#1", row_id(rows[2])]
    assert [r.index for r in got] == [0, 1, 2]
    assert row_id(rows[2]) == row_id(json.loads(json.dumps(rows[2]))) and len(row_id(rows[2])) == 16
    assert dropped == {"empty_conversation": 1, "invalid_json": 1}
    ids = [f"row-{i}" for i in range(200)]
    owners = [shard_of(i, 3) for i in ids]
    assert set(owners) == {0, 1, 2} and owners == [shard_of(i, 3) for i in ids]


def test_recover_shard_drops_a_cut_line(tmp_path):
    out = tmp_path / "out.jsonl"
    path = shard_path(out, 0)
    path.write_bytes(b'{"id": "a", "conversations": []}\n{"id": "b", "skipped": "x"}\n{"id": "c", "conv')
    records, end, bad = read_lines(path)
    assert [r["id"] for r in records] == ["a", "b"] and bad == 0 and end < path.stat().st_size
    with ShardWriter(path) as shard:
        assert path.stat().st_size == end
        with pytest.raises(TimeoutError):  # the shard is locked while its worker writes
            ShardWriter(path, timeout_s=0.2)
        shard.append([{"id": "c", "conversations": [], "regen": {"source_index": 0}}])
    assert [r["id"] for r in read_lines(path)[0]] == ["a", "b", "c"]
    report = merge_outputs(out)
    assert report.rows == 2 and report.skipped == {"x": 1} and report.duplicates == 0
    assert [r["id"] for r in read_lines(out)[0]] == ["c", "a"]  # source order first
    assert not path.exists() and not shard_lock_path(path).exists()


def _row(rid: str, index: int, turns: int, partial: bool = False, tag: str = "") -> dict:
    meta = {"source_index": index, "turns": turns, "new_tokens": [3] * turns}
    if partial:
        meta["partial"] = True
    conversation = []
    for t in range(turns):
        conversation += [{"from": "human", "value": f"q{t}"}, {"from": "gpt", "value": f"a{t}{tag}"}]
    return {"id": rid, "conversations": conversation, "regen": meta}


def test_merge_prefers_whole_rows_to_partial_ones(tmp_path):
    """Partial rows (a time budget cut the conversation) are not done; in the merge a finished row
    replaces them, else the partial row with the most turns (the first seen among equals) stays."""
    out = tmp_path / "out.jsonl"
    files = {
        out: [_row("r1", 0, 1, partial=True), _row("r2", 1, 2), _row("r3", 2, 1, partial=True)],
        shard_path(out, 0): [_row("r1", 0, 3), _row("r3", 2, 2, partial=True), _row("r4", 3, 1, partial=True, tag="x"),
                             _row("r2", 1, 2, tag="again"), {"id": "r5", "skipped": "empty_response",
                                                              "regen": {"source_index": 4}}],
        shard_path(out, 1): [_row("r4", 3, 1, partial=True, tag="y"), _row("r3", 2, 1, partial=True)],
    }
    for path, records in files.items():
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert done_ids(out) == {"r1", "r2", "r5"}
    report = merge_outputs(out)
    merged = {r["id"]: r for r in read_lines(out)[0]}
    assert list(merged) == ["r1", "r2", "r3", "r4"]  # source order
    assert merged["r1"] == files[shard_path(out, 0)][0]  # the finished row, though the output came first
    assert merged["r2"] == files[out][1]  # finished twice: the first seen, the other a duplicate
    assert merged["r3"] == files[shard_path(out, 0)][1]  # the partial row with the most turns
    assert merged["r4"]["conversations"][-1]["value"] == "a0x"  # equal turns: the first seen
    assert (report.rows, report.partial, report.duplicates, report.skipped) == (4, 2, 1, {"empty_response": 1})
    assert report.new_tokens == 3 * (3 + 2 + 2 + 1)
    assert done_ids(out) == {"r1", "r2", "r5"}  # partial rows stay to do after the merge


# --------------------------------------------------------------------------- end to end


def _conversation(i: int, turns: int) -> list[dict]:
    out = []
    for t in range(turns):
        out += [{"from": "human", "value": f"Question {t} of conversation {i}: what is {i} + {t}?"},
                {"from": "gpt", "value": f"Someone else's answer {t}."}]
    return out


def _write_source(path: Path) -> list[str]:
    """12 prompts (multi-turn, a repeated id, a row without id, a leading assistant turn) and the
    bad rows of the data fixtures; returns the ids the reader keeps."""
    rows = [{"id": f"conv-{i}", "conversations": _conversation(i, 1 + i % 4)} for i in range(9)]
    rows.append({"id": "conv-0", "conversations": _conversation(100, 2)})  # repeated id -> conv-0#1
    rows.append({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"},
                              {"role": "assistant", "content": "Hi."}]})
    rows.append({"id": "leading", "conversations": [{"from": "gpt", "value": "Continuing."},
                                                    {"from": "human", "value": "Go on."},
                                                    {"from": "gpt", "value": "Done."}]})
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        f.write(BAD_ROWS.read_text())
    return [r.id for r in iter_source(str(path), None)]


def _launch(cfg: Path, out: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "launch.cluster", "--mode", "regenerate", "--config", str(cfg), "--output", str(out),
           "--max-new-tokens", str(MAX_NEW), "--batch-size", "1"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    with open(log, "ab") as handle:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT)


def _shard_ids(out: Path) -> list[str]:
    return [r["id"] for k in range(2) for r in read_lines(shard_path(out, k))[0]]


def _wait_unlocked(shard: Path, timeout_s: float) -> None:
    """Wait (bounded) until nobody holds ``shard``'s lock: its worker has exited."""
    lock = file_lock(shard_lock_path(shard))
    try:
        lock.acquire(timeout=timeout_s)
    except TimeoutError:
        raise AssertionError(f"a worker still holds {shard_lock_path(shard)} after the launcher died") from None
    lock.release()


def test_regenerate_sigkill_and_resume(tmp_path, monkeypatch, target, tokenizer):
    source = tmp_path / "source.jsonl"
    expected = _write_source(source)
    assert len(expected) == 17  # 12 prompts + the 5 usable rows of the fixtures
    cfg = tmp_path / "regen.yaml"
    cfg.write_text(yaml.safe_dump({
        "name": "regen-test",
        "target": {"kind": "random", "arch": "tiny-llama", "arch_overrides": {"vocab_size": QWEN3_VOCAB},
                   "tokenizer": "qwen3", "compile": False},
        "data": {"dataset": str(source), "max_length": 256, "enable_thinking": False},
        "cluster": {"device": "cpu", "targets": [0, 1], "cpu_threads_per_target": 1},
        "log": {"wandb": "disabled"},
    }))
    out = tmp_path / "regen.jsonl"
    log = tmp_path / "launcher.log"

    # 1) start, SIGKILL the launcher as soon as a worker has written a row
    proc = _launch(cfg, out, log)
    deadline = time.monotonic() + WAIT_S
    while not _shard_ids(out):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no row written in time: " + log.read_text()[-3000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=WAIT_S)
    for k in range(2):
        if shard_path(out, k).exists():
            _wait_unlocked(shard_path(out, k), WAIT_S)  # no worker outlives the launcher
    before = _shard_ids(out)
    assert not out.exists() and 0 < len(before) < len(expected), before
    assert len(set(before)) == len(before)
    # a row cut mid-write (as a kill during os.write would leave it)
    pending = [i for i in expected if i not in before]
    with open(shard_path(out, 0), "ab") as f:
        f.write(json.dumps({"id": pending[0], "conversations": [{"from": "human", "value": "x"}]})[:25].encode())

    # 2) restart: finishes the rest, merges
    proc = _launch(cfg, out, log)
    assert proc.wait(timeout=RUN_TIMEOUT_S) == 0, log.read_text()[-4000:]
    records, _, bad = read_lines(out)
    ids = [r["id"] for r in records]
    summary = json.loads(out.with_name(out.name + ".regen.json").read_text())["last_run"]
    skipped = summary["skipped"]
    assert bad == 0 and len(ids) == len(set(ids)), ids
    assert len(ids) + sum(skipped.values()) == len(expected)
    assert set(ids) <= set(expected) and summary["duplicates"] == 0
    assert summary["regenerated_now"] == len(expected) - len(before)
    assert summary["dropped"] == {"bad_turn": 3, "empty_conversation": 2, "empty_turn": 2, "invalid_json": 2,
                                  "no_assistant_turn": 2, "no_messages_field": 2, "not_object": 2, "unknown_role": 1,
                                  "tool_calls": 1}
    assert not any(shard_path(out, k).exists() for k in range(2))
    assert [r["regen"]["source_index"] for r in records] == sorted(r["regen"]["source_index"] for r in records)

    # 3) the trainer's reader takes every row
    from dflash.data.corpus import tokenize_rows
    from dflash.data.sources import read_rows

    *_, report = tokenize_rows(read_rows(str(out)), tokenizer, 256, False)
    assert report.conversations == len(ids) and report.num_dropped == 0

    # 4) greedy regeneration is the target's own greedy continuation, turn by turn
    by_id = {r["id"]: r for r in records}
    row = by_id["conv-3"]  # 4 turns
    assert row["regen"]["turns"] == 4 and len(row["conversations"]) == 8
    stop = set(stop_token_ids(tokenizer))
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    history: list[dict] = []
    for turn in row["conversations"]:
        message = {"role": roles[turn["from"]], "content": turn["value"]}
        if message["role"] == "assistant":
            want = naive_greedy(target.model, _prompt(tokenizer, history), stop, MAX_NEW)
            assert turn["value"] == tokenizer.decode(want.ids, skip_special_tokens=False,
                                                     clean_up_tokenization_spaces=False)
        history.append(message)
    assert by_id["leading"]["conversations"][0] == {"from": "human", "value": "Go on."}
    assert "conv-0#1" in by_id  # the repeated id, de-duplicated

    # 5) a third run (in this process: no worker is needed) has nothing to do and keeps the output
    from launch.cluster import main as cluster_main

    monkeypatch.setenv("DFLASH_WORKER", "test")  # setup_logging sets it; restored after the test
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert cluster_main(["--mode", "regenerate", "--config", str(cfg), "--output", str(out),
                             "--max-new-tokens", str(MAX_NEW)]) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert [r["id"] for r in read_lines(out)[0]] == ids
    assert json.loads(out.with_name(out.name + ".regen.json").read_text())["last_run"]["regenerated_now"] == 0


def test_source_rows_follow_template(tokenizer):
    """A consistency check of the job rules without a model: leading assistant turns are dropped."""
    row = SourceRow(0, "x", [{"role": "assistant", "content": "cont"}, {"role": "user", "content": "q"},
                             {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}])
    job = ConversationJob(row, tokenizer, GenerationOptions(max_prompt_tokens=256, enable_thinking=False))
    prompt = job.next_prompt()
    assert prompt == _prompt(tokenizer, [{"role": "user", "content": "q"}])
    job.accept(Generated(tokenizer("new answer", add_special_tokens=False)["input_ids"], "stop"))
    assert job.next_prompt() is None and job.done  # the trailing user turn has no answer to regenerate
    rec = job.record()
    assert rec["conversations"] == [{"from": "human", "value": "q"}, {"from": "gpt", "value": "new answer"}]
    assert rec["regen"]["finish"] == ["stop"] and rec["regen"]["retokenize_mismatch"] == 0
    long_job = ConversationJob(row, tokenizer, GenerationOptions(max_prompt_tokens=3, enable_thinking=False))
    assert long_job.next_prompt() is None and long_job.record()["skipped"] == "prompt_too_long"


def test_a_round_tokenised_in_one_call_equals_each_job_alone(tokenizer):
    """The round helpers of :func:`regenerate_rows` (one tokenizer call for all prompts, one decode
    and one re-tokenisation for all turns) leave every job as its own one-at-a-time calls do: same
    prompts, same stops (prompt too long, trailing user turn, empty response), same records."""
    from dflash.inference.regeneration.jobs import _accept_all, _next_prompts

    g = torch.Generator().manual_seed(3)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]

    def text(n: int) -> str:
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))

    rows = []
    for k in range(9):
        turns = []
        for t in range(1 + k % 3):
            turns += [{"role": "user", "content": text(3 + 5 * k)}, {"role": "assistant", "content": text(4)}]
        if k % 4 == 0:
            turns.append({"role": "user", "content": "a trailing question"})
        rows.append(SourceRow(k, f"r{k}", turns))
    options = GenerationOptions(max_prompt_tokens=60, max_turns=2, enable_thinking=False)
    answers = [Generated([], "length") if k == 5 else
               Generated(tokenizer(text(2 + k), add_special_tokens=False)["input_ids"], "stop") for k in range(9)]

    alone = [ConversationJob(r, tokenizer, options) for r in rows]
    batched = [ConversationJob(r, tokenizer, options) for r in rows]
    for _ in range(3):  # more rounds than max_turns: every job ends
        want = [job.next_prompt() for job in alone]
        got = _next_prompts(batched, tokenizer)
        assert got == want
        live = [i for i, p in enumerate(want) if p is not None]
        for i in live:
            alone[i].accept(answers[i])
        _accept_all([batched[i] for i in live], [answers[i] for i in live], tokenizer)
    assert [job.record() for job in batched] == [job.record() for job in alone]
    reasons = {job.record().get("skipped") for job in alone}
    assert "prompt_too_long" in reasons and "empty_response" in reasons  # the test reaches both stops
