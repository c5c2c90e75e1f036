"""The time budget of regeneration (``--max-seconds`` / ``regenerate.max_seconds``), on CPU.

- :func:`regenerate_rows` with a fake clock that passes the deadline after k rounds yields exactly
  the finished records the unbudgeted run yields before its (k+1)-th round, for every k, with one
  cache or two (a round per cache, :func:`choose_round`), then the conversations in flight as
  partial rows (each a prefix of its whole row);
- :func:`choose_round` drains a pool at the least cost an exhaustive search finds and bounds a
  started conversation's wait; a two-cache run keeps its rounds full and writes the rows a
  one-cache run writes;
- a worker stops there too (its shard holds the finished rows and one partial row, its stats say
  so), and before loading the model when the deadline has already come; the merge of a later
  complete run keeps whole rows only;
- end to end (a launcher in this process, its workers as processes, a tiny random target): a run
  whose budget is spent before the workers load merges the rows done so far, records
  ``time_limited`` and ``rows_left``, exits 0 and names the command that continues; the training
  stage with ``regenerate.max_seconds`` then reuses that output (no worker); the same command
  without the budget completes it, every id once;
- the budget is not an option an output is "made with", travels to the workers as a deadline, and
  bad values are refused before any model loads.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from dflash.config import ConfigError, RegenerateConfig, load_config
from dflash.inference.regeneration.generators import Generated
from dflash.inference.regeneration.jobs import MAX_WAIT_ROUNDS, GenerationOptions, choose_round, regenerate_rows
from dflash.inference.regeneration.rows import SourceRow, iter_source
from dflash.inference.regeneration.shards import (done_ids, existing_shards, is_partial, merge_outputs, read_lines,
                                                  shard_path, skipped_path)

QWEN3_VOCAB = 151669  # len(qwen3 tokenizer): the random target's vocabulary matches it


class _RoundPastBudget(Exception):
    """Raised by :class:`CountingGenerator` at the round it is told not to run."""


class CountingGenerator:
    """A stand-in for the generators: a fixed answer per prompt length, counting its rounds
    (``calls``); with ``stop_at`` it raises :class:`_RoundPastBudget` instead of running round
    ``stop_at + 1``."""

    def __init__(self, tokenizer, stop_at: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop_at = stop_at
        self.calls = 0

    def generate(self, prompts, max_new_tokens, temperature=0.0, top_p=1.0, seeds=None):
        if self.stop_at is not None and self.calls >= self.stop_at:
            raise _RoundPastBudget
        self.calls += 1
        return [Generated(self.tokenizer(f"answer {len(p)}", add_special_tokens=False)["input_ids"], "stop")
                for p in prompts]


def _rows() -> list[SourceRow]:
    """10 conversations of 1 to 3 turns, one whose first prompt is too long (a skip) and one with
    only a leading assistant turn (a skip)."""
    rows = []
    for i in range(10):
        messages = []
        for t in range(1 + i % 3):
            messages += [{"role": "user", "content": f"Question {t} of {i}?"},
                         {"role": "assistant", "content": f"Old answer {t}."}]
        rows.append(SourceRow(i, f"r{i}", messages))
    rows.insert(3, SourceRow(10, "long", [{"role": "user", "content": " ".join(["word"] * 80)},
                                          {"role": "assistant", "content": "ok"}]))
    rows.insert(6, SourceRow(11, "leading", [{"role": "assistant", "content": "Continuing."}]))
    return rows


def _finished_before_round(rows, tokenizer, options, k: int, kind=CountingGenerator) -> list[dict]:
    """The naive expectation: what the run without a budget yields before its (k+1)-th round."""
    got: list[dict] = []
    try:
        for records in regenerate_rows(rows, kind(tokenizer, stop_at=k), tokenizer, options):
            got += records
    except _RoundPastBudget:
        pass
    return got


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("kind", ["one cache", "two caches"])
def test_regenerate_rows_stops_at_the_deadline(qwen3, batch_size, kind):
    kind = CountingGenerator if kind == "one cache" else TwoCacheGenerator
    rows = _rows()
    options = GenerationOptions(max_new_tokens=8, batch_size=batch_size, max_prompt_tokens=60, enable_thinking=False)
    unlimited = kind(qwen3)
    everything = [r for records in regenerate_rows(rows, unlimited, qwen3, options) for r in records]
    assert sorted(r["id"] for r in everything) == sorted(r.id for r in rows)
    assert {r.get("skipped") for r in everything} >= {"prompt_too_long", "no_user_turn"}
    whole = {r["id"]: r for r in everything}
    rounds = unlimited.calls
    cut = cut_rows = 0
    for k in range(rounds + 2):
        generator = kind(qwen3)
        # the clock reads the rounds done: the deadline k has come once k rounds have run
        got = [r for records in regenerate_rows(rows, generator, qwen3, options, deadline=k,
                                                clock=lambda: generator.calls) for r in records]
        finished = [r for r in got if not is_partial(r)]
        partial = [r for r in got if is_partial(r)]
        assert finished == _finished_before_round(rows, qwen3, options, k, kind), k
        assert got[len(finished):] == partial  # the partial rows come last, once the budget ran out
        assert generator.calls == min(k, rounds)  # no round starts at or past the deadline
        assert len({r["id"] for r in got}) == len(got)
        for row in partial:  # the turns done so far: a prefix of the whole row
            full, meta = whole[row["id"]], row["regen"]
            assert 0 < meta["turns"] < full["regen"]["turns"]
            assert row["conversations"] == full["conversations"][:len(row["conversations"])]
            assert row["conversations"][-1]["from"] == "gpt"
            assert meta["new_tokens"] == full["regen"]["new_tokens"][:meta["turns"]]
        cut += 0 < len(finished) < len(rows)
        cut_rows += len(partial)
    assert got == everything  # a deadline after the last round changes nothing
    assert cut >= 2  # the budget did cut conversations short
    assert cut_rows >= 1  # and conversations in flight were written as partial rows


class TwoCacheGenerator(CountingGenerator):
    """:class:`CountingGenerator` with the two static caches of the greedy generator: prompts of
    ``threshold`` tokens or more need the long one; each call is told its cache (recorded in
    ``rounds`` as ``(cache, prompt lengths)``) and every prompt must fit it."""

    def __init__(self, tokenizer, stop_at: int | None = None, threshold: int = 30) -> None:
        super().__init__(tokenizer, stop_at)
        self.threshold = threshold
        self.cache_slots = (threshold + 16, 2 * threshold + 16)
        self.rounds: list[tuple[int, list[int]]] = []

    def cache_for(self, prompt_tokens: int) -> int:
        return int(prompt_tokens >= self.threshold)

    def generate(self, prompts, max_new_tokens, temperature=0.0, top_p=1.0, seeds=None, cache=None):
        assert cache is not None and all(self.cache_for(len(p)) <= cache for p in prompts)
        out = super().generate(prompts, max_new_tokens, temperature, top_p, seeds)
        self.rounds.append((cache, [len(p) for p in prompts]))
        return out


def _drain_cost(caches: list[int], slots: tuple[int, ...], batch_size: int) -> int:
    """Cache positions read draining ``caches`` (no new turns) with :func:`choose_round`."""
    cost = 0
    while caches:
        cache, take = choose_round(caches, batch_size)
        assert len(take) <= batch_size and all(caches[i] <= cache for i in take)
        cost += slots[cache]
        caches = [c for i, c in enumerate(caches) if i not in set(take)]
    return cost


def _least_cost(counts: tuple[int, ...], slots: tuple[int, ...], batch_size: int) -> int:
    """Exhaustive search: the fewest cache positions of any sequence of rounds that runs every row
    once, each round a cache and at most ``batch_size`` rows that fit it."""
    @functools.lru_cache(maxsize=None)
    def best(left: tuple[int, ...]) -> int:
        if not any(left):
            return 0
        options = []
        for cache in range(len(slots)):
            for take in itertools.product(*(range(n + 1) if j <= cache else (0,) for j, n in enumerate(left))):
                if 0 < sum(take) <= batch_size:
                    options.append(slots[cache] + best(tuple(n - t for n, t in zip(left, take))))
        return min(options)

    return best(tuple(counts))


def test_choose_round_by_hand():
    # a full batch of the long cache's own rows runs first, oldest first
    assert choose_round([0, 1, 0, 1, 1, 0], 3) == (1, [1, 3, 4])
    # only the short cache is full: it runs
    assert choose_round([0, 1, 0, 0, 0], 3) == (0, [0, 2, 3])
    # draining: the long cache, topped up with short rows oldest first
    assert choose_round([0, 1, 0, 0], 4) == (1, [0, 1, 2, 3])
    # three caches: the top-up takes the next smaller cache first
    assert choose_round([0, 1, 2, 0, 1], 3) == (2, [1, 2, 4])
    assert choose_round([0], 5) == (0, [0])
    with pytest.raises(ValueError, match="empty"):
        choose_round([], 2)
    with pytest.raises(ValueError, match="batch_size"):
        choose_round([0], 0)
    with pytest.raises(ValueError, match="indices are >= 0"):
        choose_round([0, -1], 2)


def test_choose_round_bounds_the_wait():
    # the short cache's own row has waited 5 rounds (the bound): it runs, though the long one is full
    assert choose_round([0, 1, 1, 1], 3, waits=[5, 0, 0, 0], max_wait=5) == (0, [0])
    assert choose_round([0, 1, 1, 1], 3, waits=[4, 0, 0, 0], max_wait=5) == (1, [1, 2, 3])
    # several overdue caches: the largest; its rows that waited longest first, then smaller caches' rows
    assert choose_round([1, 0, 1, 1, 0], 2, waits=[5, 9, 7, 0, 0], max_wait=5) == (1, [0, 2])
    assert choose_round([1, 0, 0], 3, waits=[6, 9, 2], max_wait=5) == (1, [0, 1, 2])
    with pytest.raises(ValueError, match="waits: one per conversation"):
        choose_round([0, 1], 2, waits=[0])
    with pytest.raises(ValueError, match="max_wait"):
        choose_round([0, 1], 2, waits=[0, 0], max_wait=0)


def test_a_started_conversation_is_not_held_back_by_a_full_cache(qwen3):
    """Two short 3-turn conversations started, then a queue of long first prompts that keeps the
    long cache full: each started conversation still gets its next turn within
    :data:`MAX_WAIT_ROUNDS` rounds (without the bound it would wait for the queue to run dry)."""
    def conversation(turns):
        return [m for t in range(turns) for m in ({"role": "user", "content": f"Q{t}"},
                                                   {"role": "assistant", "content": "old"})]
    rows = [SourceRow(i, f"{'one' if i < 2 else 'three'}{i}", conversation(1 if i < 2 else 3)) for i in range(4)]
    rows += [SourceRow(i, f"long{i}", [{"role": "user", "content": " ".join(["word"] * 80)},
                                       {"role": "assistant", "content": "x"}]) for i in range(4, 204)]
    options = GenerationOptions(max_new_tokens=8, batch_size=4, max_prompt_tokens=200, enable_thinking=False)
    generator = TwoCacheGenerator(qwen3, threshold=60)
    finished_at = {}
    for records in regenerate_rows(rows, generator, qwen3, options):
        finished_at.update((r["id"], generator.calls) for r in records)
    assert len(finished_at) == len(rows)
    bound = 1 + 2 * (MAX_WAIT_ROUNDS + 1)  # the first round, then two turns each after at most the bound
    assert finished_at["three2"] <= bound and finished_at["three3"] <= bound < generator.calls - 2
    short_rounds = [len(lengths) for cache, lengths in generator.rounds if cache == 0]
    assert short_rounds[0] == 4 and short_rounds[1:] == [2, 2]  # the two bounded waits


@pytest.mark.parametrize("slots", [(3, 5), (2, 7), (2, 3, 4), (1, 4, 9)])
def test_choose_round_drains_a_pool_at_the_least_cost(slots):
    rng = random.Random(len(slots) * 100 + slots[-1])
    for _ in range(40):
        batch_size = rng.randint(1, 4)
        caches = [rng.randrange(len(slots)) for _ in range(rng.randint(1, 9))]
        counts = tuple(caches.count(c) for c in range(len(slots)))
        assert _drain_cost(caches, slots, batch_size) == _least_cost(counts, slots, batch_size), (caches, batch_size)


def test_rounds_of_two_caches_stay_full_and_write_the_same_rows(qwen3):
    """A pool of ``batch_size`` per cache: every round runs one cache over rows that fit it, full
    until the pool drains; the rows written are those of one cache for every prompt."""
    rows = _rows() * 3
    rows = [SourceRow(i, f"{r.id}-{i}", r.messages) for i, r in enumerate(rows)]
    options = GenerationOptions(max_new_tokens=8, batch_size=3, max_prompt_tokens=60, enable_thinking=False)
    one = [r for records in regenerate_rows(rows, CountingGenerator(qwen3), qwen3, options) for r in records]
    two = TwoCacheGenerator(qwen3)
    got = [r for records in regenerate_rows(rows, two, qwen3, options) for r in records]
    assert sorted(got, key=lambda r: r["id"]) == sorted(one, key=lambda r: r["id"])
    assert {c for c, _ in two.rounds} == {0, 1}  # both caches ran
    assert all(len(lengths) <= options.batch_size for _, lengths in two.rounds)
    # every round but the last few of the drain is a full batch
    sizes = [len(lengths) for _, lengths in two.rounds]
    assert sizes[:-2] == [options.batch_size] * (len(sizes) - 2)
    # each round runs its own cache's rows (a long round may carry short ones, never the reverse)
    assert all(any(two.cache_for(n) == cache for n in lengths) for cache, lengths in two.rounds)


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.8, 0.9)])
def test_two_static_caches_write_what_the_batch_generator_writes(qwen3, temperature, top_p):
    """The real generator with two caches (prompts of 30 tokens or more in the long one), greedy
    and sampled (each turn's seed from its row id and turn), rounds chosen per cache: the rows the
    left-padded batch generator writes, one round at a time for every conversation in flight."""
    from dflash.config import TargetConfig
    from dflash.inference.regeneration.generators import BatchGenerator, StaticGenerator
    from dflash.inference.sampling import Sampling
    from dflash.models.target_loader import load_target

    torch.set_num_threads(1)
    target = TargetConfig(kind="random", arch="tiny-llama", arch_overrides={"vocab_size": QWEN3_VOCAB}, seed=3)
    model = load_target(target, "cpu", torch.float32).model
    stops = [qwen3.convert_tokens_to_ids("<|im_end|>")]
    rows = [SourceRow(i, f"{r.id}-{i}", r.messages) for i, r in enumerate(_rows() * 2)]
    options = GenerationOptions(max_new_tokens=6, batch_size=3, max_prompt_tokens=60, enable_thinking=False,
                                temperature=temperature, top_p=top_p, seed=5)
    static = StaticGenerator(model, stops, len(qwen3), options.batch_size, options.max_prompt_tokens,
                             options.max_new_tokens, short_prompt_tokens=30, compile=False,
                             sampling=Sampling(temperature, top_p) if temperature else None)
    assert len(static.cache_slots) == 2
    got = [r for records in regenerate_rows(rows, static, qwen3, options) for r in records]
    reference = BatchGenerator(model, stops, qwen3.pad_token_id or 0, len(qwen3))
    want = [r for records in regenerate_rows(rows, reference, qwen3, options) for r in records]
    assert sorted(got, key=lambda r: r["id"]) == sorted(want, key=lambda r: r["id"])
    assert static.long is not None and static.timings["batch_rows"] > 0
    assert sum(r.get("regen", {}).get("turns", 0) for r in got) > len(rows)  # later turns were regenerated


def _cpu_config(tmp_path: Path, source: Path, regenerate: dict) -> Path:
    path = tmp_path / "regen.yaml"
    path.write_text(yaml.safe_dump({
        "name": "regen-budget",
        "target": {"kind": "random", "arch": "tiny-llama", "arch_overrides": {"vocab_size": QWEN3_VOCAB},
                   "tokenizer": "qwen3", "compile": False},
        "data": {"dataset": str(source), "max_length": 128, "enable_thinking": False},
        "cluster": {"device": "cpu", "targets": [0], "drafters": [1], "cpu_threads_per_target": 1},
        "regenerate": {"max_new_tokens": 8, "max_turns": 2, "batch_size": 2, "max_prompt_tokens": 64, **regenerate},
        "log": {"wandb": "disabled"},
    }))
    return path


def _write_source(path: Path) -> list[str]:
    """9 conversations (1 or 2 turns) and one whose prompt is too long; the ids the reader keeps."""
    rows = []
    for i in range(9):
        turns = [{"from": "human", "value": f"What is {i} + {i}?"}, {"from": "gpt", "value": "Someone's answer."}]
        if i % 2:
            turns += [{"from": "human", "value": "And twice that?"}, {"from": "gpt", "value": "Another."}]
        rows.append({"id": f"c{i}", "conversations": turns})
    rows.insert(5, {"id": "long", "conversations": [{"from": "human", "value": " ".join(["word"] * 200)},
                                                    {"from": "gpt", "value": "ok"}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [r.id for r in iter_source(str(path), None)]


def test_worker_stops_at_the_deadline(tmp_path, monkeypatch, caplog):
    from dflash.inference.regeneration import worker

    source = tmp_path / "source.jsonl"
    ids = _write_source(source)
    cfg = load_config(_cpu_config(tmp_path, source, {}), gpu_count=0)
    options = GenerationOptions(max_new_tokens=8, batch_size=2, max_turns=2, max_prompt_tokens=64,
                                enable_thinking=False)
    out = tmp_path / "out.jsonl"
    generators: list[CountingGenerator] = []

    def fake_generator(cfg, options, rows, device, tokenizer):
        generators.append(CountingGenerator(tokenizer))
        return generators[-1]

    monkeypatch.setattr(worker, "_generator", fake_generator)
    threads = torch.get_num_threads()
    try:
        with caplog.at_level(logging.WARNING, logger=worker.log.name):
            # the deadline comes after 3 rounds (the clock reads the rounds done)
            assert worker.run_worker(cfg, options, out, 0, 1, None, deadline=3,
                                     clock=lambda: generators[-1].calls if generators else 0) == 0
        records = read_lines(shard_path(out, 0))[0]
        written = [r["id"] for r in records if not is_partial(r)]
        cut = [r["id"] for r in records if is_partial(r)]
        stats = json.loads(worker.stats_path(out, 0).read_text())
        assert generators[0].calls == 3 and 0 < len(written) < len(ids)
        assert len(cut) == 1 and cut[0] not in written and done_ids(out) == set(written)  # in flight after a turn
        assert stats["stopped_at_deadline"] is True and stats["rows"] == len(written)
        assert stats["rows_left"] == len(ids) - len(written) and stats["partial_rows"] == 1
        left = len(ids) - len(written)
        assert f"wrote {len(written)} rows, left {left} of {len(ids)} (1 of them written as partial" in caplog.text

        # a deadline that has come before the model loads: no model, nothing written, the rest left
        def no_model(*args, **kwargs):
            raise AssertionError("a model was loaded past the deadline")

        monkeypatch.setattr(worker, "_generator", no_model)
        assert worker.run_worker(cfg, options, out, 0, 1, None, deadline=time.time() - 1) == 0
        stats = json.loads(worker.stats_path(out, 0).read_text())
        assert stats == {**stats, "rows": 0, "rows_left": len(ids) - len(written), "stopped_at_deadline": True}
        # without a deadline nothing is "stopped"
        monkeypatch.setattr(worker, "_generator", fake_generator)
        assert worker.run_worker(cfg, options, out, 0, 1, None) == 0
        stats = json.loads(worker.stats_path(out, 0).read_text())
        assert stats["rows_left"] == 0 and stats["stopped_at_deadline"] is False
        records = read_lines(shard_path(out, 0))[0]
        assert sorted(r["id"] for r in records if not is_partial(r)) == sorted(ids)
        # the merge keeps the whole row of the conversation cut before, not its partial one
        report = merge_outputs(out)
        merged = read_lines(out)[0] + read_lines(skipped_path(out))[0]
        assert sorted(r["id"] for r in merged) == sorted(ids) and not any(is_partial(r) for r in merged)
        assert report.duplicates == 0 and report.partial == 0
    finally:
        torch.set_num_threads(threads)


def test_launcher_report_counts_partial_rows_as_left(tmp_path):
    """The launcher's check after its workers: a worker stopped at the budget left its partial row
    and the rows it never started; they are exactly the rows not done, so the finished and partial
    rows are merged and the report says ``time_limited``, ``rows_left`` and ``partial_rows``."""
    from dflash.inference.regeneration import launcher, worker

    out = tmp_path / "out.jsonl"
    source = [SourceRow(i, f"c{i}", []) for i in range(5)]
    finished = [{"id": f"c{i}", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
                 "regen": {"source_index": i, "turns": 1, "new_tokens": [2]}} for i in (0, 1)]
    cut = {"id": "c2", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
           "regen": {"source_index": 2, "turns": 1, "new_tokens": [4], "partial": True}}
    shard_path(out, 0).write_text("".join(json.dumps(r) + "\n" for r in [*finished, cut]))
    worker.stats_path(out, 0).write_text(json.dumps({"rank": 0, "rows": 2, "partial_rows": 1, "new_tokens": 6,
                                                     "generate_s": 1.0, "rows_left": 3,
                                                     "stopped_at_deadline": True}))
    summary = launcher._merge_and_report(out, source, {}, pending=5, world=1)
    assert summary is not None
    assert (summary["time_limited"], summary["rows_left"], summary["partial_rows"], summary["rows"]) == (True, 3, 1, 3)
    assert summary["regenerated_now"] == 2 and summary["per_worker"][0]["partial_rows"] == 1
    assert [r["id"] for r in read_lines(out)[0]] == ["c0", "c1", "c2"] and done_ids(out) == {"c0", "c1"}
    # a worker that claims fewer rows left than are not done: rows are missing, nothing is merged
    shard_path(out, 0).write_text(json.dumps(cut) + "\n")
    worker.stats_path(out, 0).write_text(json.dumps({"rank": 0, "rows": 0, "new_tokens": 0, "generate_s": 1.0,
                                                     "rows_left": 2, "stopped_at_deadline": True}))
    assert launcher._merge_and_report(out, source, {}, pending=3, world=1) is None


def _regenerate(config: Path, out: Path, *flags: str) -> int:
    """``python -m dflash.inference.regenerate --config C --output O --gpus 0 FLAGS`` in this process
    (its logging left as pytest's); the workers are processes."""
    from dflash.inference.regenerate import _options, parse_args
    from dflash.inference.regeneration.launcher import run_launcher

    args = parse_args(["--config", str(config), "--output", str(out), "--gpus", "0", *flags])
    cfg = load_config(args.config, args.overrides, gpu_count=0)
    return run_launcher(args, cfg, _options(args, cfg))


def test_time_limited_run_merges_then_continues(tmp_path, monkeypatch, caplog):
    from dflash.inference import regenerate
    from dflash.inference.regeneration import launcher

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    source = tmp_path / "source.jsonl"
    ids = _write_source(source)
    config = _cpu_config(tmp_path, source, {})
    out = tmp_path / "regen.jsonl"
    sidecar = out.with_name(out.name + ".regen.json")

    # 1) the first 3 rows, complete
    assert _regenerate(config, out, "--limit", "3") == 0
    first = [r["id"] for r in read_lines(out)[0]]
    assert first == ids[:3]

    # 2) every row, with a budget spent before any worker has loaded: the workers stop at once,
    #    the rows done are merged, the sidecar says the run was time-limited
    with caplog.at_level(logging.INFO):
        assert _regenerate(config, out, "--max-seconds", "0.001") == 0
    assert [r["id"] for r in read_lines(out)[0]] == first and not existing_shards(out)
    last = json.loads(sidecar.read_text())["last_run"]
    assert last["time_limited"] is True and last["rows_left"] == len(ids) - 3 and last["max_seconds"] == 0.001
    assert last["regenerated_now"] == 0 and last["rows"] == 3
    assert [w["stopped_at_deadline"] for w in last["per_worker"]] == [True]
    warning = [r for r in caplog.records if r.levelno == logging.WARNING and "time budget" in r.getMessage()]
    assert len(warning) == 1, caplog.text
    message = warning[0].getMessage()
    assert f"{len(ids) - 3} left" in message and "--max-seconds" in message
    command = message.split("Continue with: ")[1]
    assert command.startswith("python -m dflash.inference.regenerate --config ") and "--max-seconds" not in command

    # 3) the training stage with regenerate.max_seconds set uses that output as it is: no worker
    stamp = out.stat().st_mtime_ns, out.read_bytes()

    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started for a time-limited output")

    stage = ["regenerate.enabled=true", f"regenerate.output={out}", "regenerate.max_seconds=60"]
    cfg = load_config(config, stage, gpu_count=0)
    with monkeypatch.context() as patch, caplog.at_level(logging.INFO):
        patch.setattr(subprocess, "Popen", no_worker)
        code, trained = regenerate.run_stage(cfg, config, stage)
    assert code == 0 and trained.data.dataset == str(out.resolve()) and trained.regenerate.enabled is False
    assert (out.stat().st_mtime_ns, out.read_bytes()) == stamp
    assert "regenerate.max_seconds=null" in caplog.text.split("Continue it with: ")[1]

    # 4) the same command without the budget completes it: every id once
    assert _regenerate(config, out) == 0
    records = read_lines(out)[0]
    skipped = read_lines(skipped_path(out))[0]
    done = [r["id"] for r in records] + [r["id"] for r in skipped]
    assert sorted(done) == sorted(ids) and len(set(done)) == len(done)
    assert [r["id"] for r in skipped] == ["long"]
    last = json.loads(sidecar.read_text())["last_run"]
    assert last["time_limited"] is False and last["rows_left"] == 0 and last["regenerated_now"] == len(ids) - 3
    assert launcher.time_limited_run(out, cfg, regenerate._options(regenerate.parse_args(
        ["--config", str(config)]), cfg)) is None


def test_stage_reuses_a_time_limited_output_only_with_a_budget(tmp_path, monkeypatch):
    """``run_stage`` decides from the sidecar alone: a time-limited output made with the same
    options is reused while ``regenerate.max_seconds`` is set; otherwise the launcher runs (and
    continues it, or says which option differs)."""
    from dflash.inference import regenerate
    from dflash.inference.regeneration import launcher

    source = tmp_path / "source.jsonl"
    _write_source(source)
    out = tmp_path / "regen.jsonl"
    out.write_text('{"id": "c0", "conversations": []}\n')
    config = _cpu_config(tmp_path, source, {"enabled": True, "output": str(out), "max_seconds": 30})
    cfg = load_config(config, gpu_count=0)
    options = regenerate._options(regenerate.parse_args(["--config", str(config)]), cfg)
    sidecar = out.with_name(out.name + ".regen.json")
    launched: list[list[str]] = []

    def fake_launcher(args, cfg, options):
        launched.append(launcher.option_flags(args))
        return 0

    monkeypatch.setattr(regenerate, "run_launcher", fake_launcher)
    record = {"options": launcher._options_record(cfg, options), "last_run": {"time_limited": True, "rows": 1,
                                                                             "rows_left": 9}}
    sidecar.write_text(json.dumps(record))
    assert regenerate.run_stage(cfg, config, [])[0] == 0 and launched == []
    # without a budget: continued by the launcher
    unlimited = load_config(config, ["regenerate.max_seconds=null"], gpu_count=0)
    assert regenerate.run_stage(unlimited, config, ["regenerate.max_seconds=null"])[0] == 0
    assert len(launched) == 1 and "--max-seconds" not in launched[0]
    # the budget goes to the launcher as --max-seconds
    sidecar.write_text(json.dumps({**record, "last_run": {**record["last_run"], "time_limited": False}}))
    assert regenerate.run_stage(cfg, config, [])[0] == 0
    assert launched[-1][-2:] == ["--max-seconds", "30.0"]
    # other options: the launcher runs (and refuses with the option's name)
    sidecar.write_text(json.dumps({**record, "options": {**record["options"], "max_new_tokens": 9}}))
    assert regenerate.run_stage(cfg, config, [])[0] == 0 and len(launched) == 3
    # an interrupted run (no last_run yet) and no sidecar: the launcher runs
    sidecar.write_text(json.dumps({"options": record["options"]}))
    assert regenerate.run_stage(cfg, config, [])[0] == 0 and len(launched) == 4
    sidecar.unlink()
    assert regenerate.run_stage(cfg, config, [])[0] == 0 and len(launched) == 5


def test_budget_is_no_output_option_and_reaches_workers_as_a_deadline(tmp_path):
    from dflash.inference.regenerate import _options, parse_args
    from dflash.inference.regeneration import launcher

    assert "max_seconds" not in launcher.RESUME_KEYS
    section = RegenerateConfig(max_seconds=0.1 + 0.2)
    args = parse_args(["--config", "c.yaml", *launcher.option_flags(section)])
    assert args.max_seconds == section.max_seconds  # exact
    assert parse_args(["--config", "c.yaml", *launcher.option_flags(args)]) == args
    assert "--max-seconds" not in launcher.option_flags(args, budget=False)

    source = tmp_path / "source.jsonl"
    _write_source(source)
    config = _cpu_config(tmp_path, source, {"max_seconds": 45})
    args = parse_args(["--config", str(config), "--output", str(tmp_path / "o.jsonl"), "x.y=1"])
    cfg = load_config(config, gpu_count=0)
    options = _options(args, cfg)
    assert args.max_seconds == 45.0  # from the config
    assert "max_seconds" not in launcher._options_record(cfg, options)
    deadline = time.time() + 45.0
    spec = launcher._worker_spec(args, tmp_path / "o.jsonl", 1, 2, deadline)
    worker = parse_args(spec.args)
    assert worker.deadline == deadline and worker.max_seconds is None and worker.worker_rank == 1
    command = launcher.continue_command(args, cfg).split()
    assert "--max-seconds" not in command and command[-2:] == ["x.y=1", "regenerate.max_seconds=null"]

    progress = launcher._ShardProgress(tmp_path / "o.jsonl", 1, time.time() + 125.4)
    assert progress.text().endswith(", budget left 2:05")
    progress.deadline = time.time() - 1
    assert "time budget spent" in progress.text()
    assert "budget" not in launcher._ShardProgress(tmp_path / "o.jsonl", 1).text()


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf"])
def test_bad_budget_is_refused_before_any_model(tmp_path, monkeypatch, caplog, bad):
    from dflash.inference import regenerate
    import dflash.models.target_loader

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(dflash.models.target_loader, "load_target", no_model)
    source = tmp_path / "source.jsonl"
    _write_source(source)
    config = _cpu_config(tmp_path, source, {})
    with pytest.raises(ConfigError, match="^regenerate.max_seconds: must be a finite number of seconds > 0"):
        load_config(config, [f"regenerate.max_seconds={bad}"], gpu_count=0)
    with pytest.raises(ConfigError, match="^regenerate.max_seconds:"):
        load_config(_cpu_config(tmp_path, source, {"max_seconds": float(bad)}), gpu_count=0)
    config = _cpu_config(tmp_path, source, {})
    # the command line: exit 2 with the flag named, nothing loaded
    monkeypatch.setattr(regenerate, "setup_logging", lambda *args, **kwargs: None)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with caplog.at_level(logging.ERROR):
            assert regenerate.main(["--config", str(config), "--output", str(tmp_path / "o.jsonl"),
                                    "--max-seconds", bad]) == 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "--max-seconds: must be a finite number of seconds > 0" in caplog.text
    assert not (tmp_path / "o.jsonl.regen.json").exists()


def test_sampled_regeneration_does_not_depend_on_the_workers(tmp_path, monkeypatch):
    """``--temperature 0.8 --top-p 0.9`` through the workers' static generator: one worker and two
    (each a shard of the rows, other batches) write the same conversations; greedy writes others."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    source = tmp_path / "source.jsonl"
    ids = _write_source(source)
    config = _cpu_config(tmp_path, source, {})
    sampled = ("--temperature", "0.8", "--top-p", "0.9", "--seed", "3")
    one, two, greedy = tmp_path / "one.jsonl", tmp_path / "two.jsonl", tmp_path / "greedy.jsonl"
    assert _regenerate(config, one, *sampled) == 0
    assert _regenerate(config, two, *sampled, "--gpus", "0,1") == 0
    assert _regenerate(config, greedy) == 0

    def turns(path: Path) -> dict[str, list]:
        return {r["id"]: r["conversations"] for r in read_lines(path)[0]}

    assert len(turns(one)) == len(ids) - 1  # "long" is skipped
    assert turns(one) == turns(two)
    assert turns(one) != turns(greedy)
    last = json.loads(two.with_name(two.name + ".regen.json").read_text())["last_run"]
    assert len(last["per_worker"]) == 2


class _Clock:
    """A wall clock the test moves (``regenerate.time`` stand-in): seconds since the epoch."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now


def test_stage_gives_the_sampled_pass_the_budget_left(tmp_path, monkeypatch, caplog):
    """``regenerate.sampled.output``: after the greedy pass the stage runs a second launcher with
    the sampled section's temperature, top-p and seed and what is left of ``regenerate.max_seconds``;
    its output joins ``data.extra_datasets``. No budget left: no second launcher, no extra data."""
    from dflash.inference import regenerate
    from dflash.inference.regeneration import launcher

    source = tmp_path / "source.jsonl"
    _write_source(source)
    out, sampled = tmp_path / "regen.jsonl", tmp_path / "sampled.jsonl"
    raw = tmp_path / "raw.jsonl"
    raw.write_text(source.read_text())
    section = {"enabled": True, "output": str(out), "max_seconds": 30,
               "sampled": {"output": str(sampled), "temperature": 0.7, "top_p": 0.9, "seed": 5, "max_turns": 1}}
    config = _cpu_config(tmp_path, source, section)
    cfg = load_config(config, [f"data.extra_datasets=[{raw}]"], gpu_count=0)
    clock = _Clock()
    monkeypatch.setattr(regenerate, "time", clock)
    launched: list[tuple[str, list[str], float]] = []
    greedy_seconds = [12.5]

    def fake_launcher(args, cfg, options):
        launched.append((str(args.output), launcher.option_flags(args), args.max_seconds))
        assert options.temperature == args.temperature
        Path(args.output).write_text('{"id": "c0", "conversations": []}\n')
        clock.now += greedy_seconds[0] if len(launched) % 2 else 3.0
        return 0

    monkeypatch.setattr(regenerate, "run_launcher", fake_launcher)
    with caplog.at_level(logging.INFO):
        code, trained = regenerate.run_stage(cfg, config, [])
    assert code == 0 and len(launched) == 2
    (first, greedy_flags, greedy_budget), (second, flags, budget) = launched
    assert first == str(out) and greedy_budget == 30.0
    assert greedy_flags[greedy_flags.index("--temperature") + 1] == "0.0"
    assert second == str(sampled) and budget == 30.0 - 12.5
    assert flags[flags.index("--temperature") + 1] == "0.7" and flags[flags.index("--top-p") + 1] == "0.9"
    assert flags[flags.index("--seed") + 1] == "5"
    assert greedy_flags[greedy_flags.index("--max-turns") + 1] == "2" and flags[flags.index("--max-turns") + 1] == "1"
    assert "at most 1 turn(s) a conversation" in caplog.text
    assert trained.data.dataset == str(out.resolve())
    assert trained.data.extra_datasets == [str(raw), str(sampled.resolve())]
    assert trained.regenerate.enabled is False and cfg.data.extra_datasets == [str(raw)]
    assert "as training-only extra data" in caplog.text
    # the training config written to the run directory reads both and validates
    saved = tmp_path / "saved.yaml"
    saved.write_text(yaml.safe_dump(trained.to_dict()))
    assert load_config(saved, gpu_count=0).data.extra_datasets == trained.data.extra_datasets

    # the greedy pass spends the budget: the sampled pass gets the least budget (its workers stop
    # before loading the model; here its launcher writes an empty output) and training goes on
    # without it
    sampled.unlink()
    greedy_seconds[0] = 30.5
    launched.clear()
    caplog.clear()
    written = fake_launcher

    def empty_sampled(args, cfg, options):
        code = written(args, cfg, options)
        if str(args.output) == str(sampled):
            sampled.write_text("")
        return code

    monkeypatch.setattr(regenerate, "run_launcher", empty_sampled)
    with caplog.at_level(logging.INFO):
        code, trained = regenerate.run_stage(cfg, config, [])
    assert code == 0 and [(o, b) for o, _, b in launched] == [(str(out), 30.0),
                                                               (str(sampled), regenerate.MIN_SAMPLED_PASS_S)]
    assert trained.data.extra_datasets == [str(raw)]
    assert "(none: the pass stops at once)" in caplog.text and "holds no row" in caplog.text
    monkeypatch.setattr(regenerate, "run_launcher", fake_launcher)

    # a greedy output with no row (its budget ran out first): refused before training, the budget named
    def nothing(args, cfg, options):
        launched.append((str(args.output), [], args.max_seconds))
        Path(args.output).write_text("")
        return 0

    monkeypatch.setattr(regenerate, "run_launcher", nothing)
    launched.clear()
    with caplog.at_level(logging.ERROR):
        code, same = regenerate.run_stage(cfg, config, [])
    assert code == 2 and same is cfg and [o for o, _, _ in launched] == [str(out)]
    assert "holds no regenerated row" in caplog.text and "regenerate.max_seconds = 30.0 s" in caplog.text
    monkeypatch.setattr(regenerate, "run_launcher", fake_launcher)

    # without a budget: both passes run unbounded
    unlimited = load_config(config, ["regenerate.max_seconds=null"], gpu_count=0)
    launched.clear()
    assert regenerate.run_stage(unlimited, config, ["regenerate.max_seconds=null"])[0] == 0
    assert [b for _, _, b in launched] == [None, None]
    assert all("--max-seconds" not in f for _, f, _ in launched)

    # a sampled output its budget stopped, made with these options, is used as it is
    options = regenerate._options(regenerate.parse_args(
        ["--config", str(config), *launcher.option_flags(regenerate._sampled_section(cfg.regenerate, 1.0))]), cfg)
    sampled.with_name(sampled.name + ".regen.json").write_text(json.dumps(
        {"options": launcher._options_record(cfg, options), "last_run": {"time_limited": True, "rows": 1,
                                                                          "rows_left": 8}}))
    greedy_seconds[0] = 1.0
    launched.clear()
    code, trained = regenerate.run_stage(cfg, config, [])
    assert code == 0 and [o for o, _, _ in launched] == [str(out)]
    assert trained.data.extra_datasets == [str(raw), str(sampled.resolve())]


@pytest.mark.parametrize("override, message", [
    ("regenerate.sampled.temperature=0", "regenerate.sampled.temperature: must be > 0"),
    ("regenerate.sampled.top_p=0", r"regenerate.sampled.top_p: must be in \(0, 1\]"),
    ("regenerate.sampled.output={out}", r"regenerate.sampled.output: must differ from regenerate.output"),
    ("regenerate.sampled.output={source}", r"regenerate.sampled.output: must differ from data.dataset"),
    ("regenerate.sampled.output={raw}", r"regenerate.sampled.output: must differ from data.extra_datasets\[0\]"),
    ("regenerate.sampled.max_turns=0", "regenerate.sampled.max_turns: must be >= 1"),
    ("regenerate.sampled.colour=red", r"regenerate.sampled.colour: unknown key in regenerate.sampled"),
    ("regenerate.sampled.output={source}/s.jsonl", r"regenerate.sampled.output: cannot be written: .* is a file"),
    ("regenerate.output={source}/x/r.jsonl", r"regenerate.output: cannot be written: .* is a file"),
])
def test_bad_sampled_pass_is_refused_by_name(tmp_path, override, message):
    source = tmp_path / "source.jsonl"
    _write_source(source)
    out, raw = tmp_path / "regen.jsonl", tmp_path / "raw.jsonl"
    config = _cpu_config(tmp_path, source, {"enabled": True, "output": str(out),
                                            "sampled": {"output": str(tmp_path / "s.jsonl")}})
    raw.write_text(source.read_text())
    extra = [f"data.extra_datasets=[{raw}]"]
    assert load_config(config, extra, gpu_count=0).regenerate.sampled.temperature == 0.8
    with pytest.raises(ConfigError, match="^" + message):
        load_config(config, extra + [override.format(out=out, source=source, raw=raw)], gpu_count=0)


def test_stage_with_a_sampled_pass_end_to_end(tmp_path, monkeypatch):
    """Both passes through real workers (CPU, random target): the sampled output holds the same
    conversations as the greedy one with other responses, made with the sampled section's options,
    and the standalone sampled command writes the same rows."""
    from dflash.inference import regenerate

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    source = tmp_path / "source.jsonl"
    ids = _write_source(source)
    out, sampled, alone = tmp_path / "regen.jsonl", tmp_path / "sampled.jsonl", tmp_path / "alone.jsonl"
    config = _cpu_config(tmp_path, source, {"enabled": True, "output": str(out), "max_seconds": 600,
                                            "sampled": {"output": str(sampled), "seed": 4}})
    cfg = load_config(config, gpu_count=0)
    code, trained = regenerate.run_stage(cfg, config, [])
    assert code == 0 and trained.data.extra_datasets == [str(sampled.resolve())]

    def turns(path: Path) -> dict[str, list]:
        return {r["id"]: r["conversations"] for r in read_lines(path)[0]}

    greedy, drawn = turns(out), turns(sampled)
    assert sorted(greedy) == sorted(drawn) == sorted(i for i in ids if i != "long")
    assert greedy != drawn
    for key in greedy:  # the prompts are the source's: the first user turn is kept verbatim
        assert greedy[key][0] == drawn[key][0]
    options = json.loads(sampled.with_name(sampled.name + ".regen.json").read_text())["options"]
    assert (options["temperature"], options["top_p"], options["seed"]) == (0.8, 0.95, 4)
    assert _regenerate(config, alone, "--temperature", "0.8", "--top-p", "0.95", "--seed", "4") == 0
    assert turns(alone) == drawn

    # no budget left after the greedy pass (its output complete, the stage's clock past the
    # deadline): the sampled launcher's workers stop before loading the model, its output holds no
    # row and is marked time-limited, and a resumed run reuses it as it is (no worker)
    late = tmp_path / "late.jsonl"
    clock = _Clock()
    real_time = regenerate.time

    class Late:
        def time(self) -> float:
            clock.now += 1_000.0  # each reading is 1,000 s later: the deadline has passed
            return clock.now

    monkeypatch.setattr(regenerate, "time", Late())
    stage = [f"regenerate.sampled.output={late}"]
    late_cfg = load_config(config, stage, gpu_count=0)
    code, trained = regenerate.run_stage(late_cfg, config, stage)
    assert code == 0 and trained.data.extra_datasets == []
    assert late.is_file() and not read_lines(late)[0]
    assert json.loads(late.with_name(late.name + ".regen.json").read_text())["last_run"]["time_limited"] is True

    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started for a time-limited output")

    monkeypatch.setattr(subprocess, "Popen", no_worker)
    code, again = regenerate.run_stage(late_cfg, config, stage)
    assert code == 0 and again.data.extra_datasets == []
    monkeypatch.setattr(regenerate, "time", real_time)


def test_changed_options_name_the_config_keys_in_the_stage(tmp_path, caplog):
    """An output made with other options is refused; from the training stage the error names the
    config key (``regenerate.sampled.temperature``) and the way out, not a command-line flag."""
    from dflash.inference import regenerate
    from dflash.inference.regeneration import launcher

    source = tmp_path / "source.jsonl"
    _write_source(source)
    out = tmp_path / "sampled.jsonl"
    config = _cpu_config(tmp_path, source, {})
    cfg = load_config(config, gpu_count=0)
    args = regenerate.parse_args(["--config", str(config), "--output", str(out), "--temperature", "0.7"])
    options = regenerate._options(args, cfg)
    made = {**launcher._options_record(cfg, options), "temperature": 0.8}
    out.with_name(out.name + ".regen.json").write_text(json.dumps({"options": made}))
    with caplog.at_level(logging.ERROR):
        assert launcher._wanted_options(args, cfg, options, out) is None
    assert "(temperature: 0.8, now 0.7): pass --overwrite or choose another --output" in caplog.text
    caplog.clear()
    args.config_section = "regenerate.sampled"
    with caplog.at_level(logging.ERROR):
        assert launcher._wanted_options(args, cfg, options, out) is None
    assert ("(regenerate.sampled.temperature: 0.8, now 0.7): delete it (and its sampled.jsonl.regen.json) or set "
            "another regenerate.sampled.output") in caplog.text
    caplog.clear()
    made = {**launcher._options_record(cfg, options), "max_new_tokens": 99}
    out.with_name(out.name + ".regen.json").write_text(json.dumps({"options": made}))
    with caplog.at_level(logging.ERROR):
        assert launcher._wanted_options(args, cfg, options, out) is None
    assert "(regenerate.max_new_tokens: 99, now 8)" in caplog.text
