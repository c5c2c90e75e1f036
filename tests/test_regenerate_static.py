"""Regeneration through the static-cache generator and the regeneration stage of training.

- :class:`StaticGenerator` gives the rows :class:`BatchGenerator` gives (and a naive
  full-forward loop) on random prompts of several lengths, with a stop token hit mid-way, also
  when a call runs short prompts in the long cache, and never emits an id the tokenizer lacks even
  when the model's head prefers one; sampled, it draws the batch generator's tokens, and a row's
  tokens follow from its seed alone;
- the ``regenerate`` config section fails on bad keys and values before any model loads;
- the stage regenerates, hands the training config the output, and is skipped (no worker, no model)
  when the output is complete.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from dflash.config import ConfigError, RunConfig, TargetConfig, load_config
from dflash.inference.generation import Generator
from dflash.inference.regeneration.generators import BatchGenerator, Generated, StaticGenerator, limit_vocab
from dflash.inference.sampling import Sampling

VOCAB = 512        # the tiny-llama's embedding rows
VOCAB_LIMIT = 500  # a "tokenizer" smaller than the embedding: ids 500..511 must never appear
MAX_NEW = 12
MAX_PROMPT = 40
PAD = 0


def _target(seed: int = 0):
    from dflash.models.target_loader import load_target

    torch.set_num_threads(1)
    return load_target(TargetConfig(kind="random", arch="tiny-llama", seed=seed), "cpu", torch.float32)


@pytest.fixture(scope="module")
def model():
    return _target().model


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB_LIMIT, (n,), generator=g).tolist() for n in lengths]


def naive_greedy(model, prompt: list[int], stops: set[int], max_new: int, vocab_limit: int) -> Generated:
    """A full forward per token, no cache, argmax over the ids ``< vocab_limit``."""
    ids, new = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1, :vocab_limit].argmax())
            if nxt in stops:
                return Generated(new, "stop")
            new.append(nxt)
            ids.append(nxt)
    return Generated(new, "length")


def test_static_greedy_equals_batch_generator_and_naive_loop(model):
    prompts = _prompts([3, 17, 1, 29, 8], seed=1)
    # a stop token that one row emits mid-way: its 4th greedy token (not earlier in that row)
    free = BatchGenerator(model, [], PAD, VOCAB_LIMIT).generate(prompts, MAX_NEW)
    row = next(i for i, g in enumerate(free) if len(g.ids) == MAX_NEW and g.ids[3] not in g.ids[:3])
    stops = [free[row].ids[3], VOCAB_LIMIT - 1]
    old = BatchGenerator(model, stops, PAD, VOCAB_LIMIT).generate(prompts, MAX_NEW)
    # prompts of 1..15 tokens run in the short cache, 17 and 29 in the long one, in the same call
    static = StaticGenerator(_target().model, stops, VOCAB_LIMIT, batch_size=len(prompts),
                             max_prompt_tokens=MAX_PROMPT, max_new_tokens=MAX_NEW, short_prompt_tokens=16)
    new = static.generate(prompts, MAX_NEW)
    assert static.long is not None and static.short.max_len < static.long.max_len
    assert new == old
    assert new[row] == Generated(free[row].ids[:3], "stop")
    assert {g.finish for g in new} == {"stop", "length"}
    for prompt, got in zip(prompts, new):
        assert got == naive_greedy(model, prompt, set(stops), MAX_NEW, VOCAB_LIMIT)
    # the static cache is reused: a second, smaller batch with other lengths
    more = _prompts([39, 2], seed=2)
    assert static.generate(more, MAX_NEW) == BatchGenerator(model, stops, PAD, VOCAB_LIMIT).generate(more, MAX_NEW)
    with pytest.raises(ValueError, match="temperature"):
        static.generate(more, MAX_NEW, temperature=1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        static.generate(more, MAX_NEW + 1)
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        static.generate(_prompts([MAX_PROMPT], seed=5), MAX_NEW)  # a prompt the jobs never ask for


def test_a_round_in_one_cache_gives_the_same_rows(model):
    """``generate(..., cache=1)``: short prompts ride in the long cache (one batch of steps for the
    call) and get the rows the two-cache split and the naive loop give; a prompt too long for the
    chosen cache, or a cache that does not exist, is refused."""
    prompts = _prompts([3, 17, 1, 29, 8], seed=3)
    stops = [VOCAB_LIMIT - 1]
    static = StaticGenerator(_target().model, stops, VOCAB_LIMIT, batch_size=len(prompts),
                             max_prompt_tokens=MAX_PROMPT, max_new_tokens=MAX_NEW, short_prompt_tokens=16)
    assert static.cache_slots == (16 - 1 + MAX_NEW + 8, MAX_PROMPT - 1 + MAX_NEW + 8)
    assert [static.cache_for(len(p)) for p in prompts] == [0, 1, 0, 1, 0]
    split = static.generate(prompts, MAX_NEW)
    assert static.timings["batches"] == 2 and static.timings["batch_rows"] == 5
    together = static.generate(prompts, MAX_NEW, cache=1)
    assert static.timings["batches"] == 3 and static.timings["batch_rows"] == 10
    assert together == split
    for prompt, got in zip(prompts, together):
        assert got == naive_greedy(model, prompt, set(stops), MAX_NEW, VOCAB_LIMIT)
    short = [p for p in prompts if len(p) < 16]
    assert static.generate(short, MAX_NEW, cache=0) == [g for p, g in zip(prompts, split) if len(p) < 16]
    with pytest.raises(ValueError, match=r"prompts\[1\]: 17 tokens do not fit cache 0"):
        static.generate(prompts, MAX_NEW, cache=0)
    with pytest.raises(ValueError, match="cache: an index"):
        static.generate(short, MAX_NEW, cache=2)
    one = StaticGenerator(_target().model, stops, VOCAB_LIMIT, batch_size=2, max_prompt_tokens=MAX_PROMPT,
                          max_new_tokens=MAX_NEW, short_prompt_tokens=None)
    assert len(one.cache_slots) == 1 and one.cache_for(MAX_PROMPT - 1) == 0


def test_one_flex_cache_equals_batch_generator(model):
    """flex decoding (the cache blocks a row has written) in one cache for every prompt length:
    the batch generator's tokens and finishes."""
    prompts = _prompts([3, 17, 1, 29, 8], seed=1)
    static = StaticGenerator(_target().model, [VOCAB_LIMIT - 1], VOCAB_LIMIT, batch_size=len(prompts),
                             max_prompt_tokens=MAX_PROMPT, max_new_tokens=MAX_NEW, short_prompt_tokens=None,
                             attention="flex")
    assert static.short.step_attention == "flex"
    assert static.generate(prompts, MAX_NEW) == BatchGenerator(model, [VOCAB_LIMIT - 1], PAD,
                                                               VOCAB_LIMIT).generate(prompts, MAX_NEW)
    assert static.long is None  # every prompt went to the one cache


def test_sampled_static_rows_equal_batch_generator_and_follow_their_seeds(model):
    """Sampling at temperature / top-p: the static generator (both caches) draws the batch
    generator's tokens from the same logits; a row alone, or beside other rows in another order,
    gets the same tokens; another seed gives others; a nucleus of one token is greedy."""
    prompts = _prompts([3, 17, 1, 29, 8], seed=4)
    seeds = [11, 12, 13, 14, (1 << 62) + 5]
    stops = [VOCAB_LIMIT - 1]
    sampling = Sampling(0.9, 0.95)
    static = StaticGenerator(_target().model, stops, VOCAB_LIMIT, batch_size=len(prompts), max_prompt_tokens=MAX_PROMPT,
                             max_new_tokens=MAX_NEW, short_prompt_tokens=16, sampling=sampling)
    got = static.generate(prompts, MAX_NEW, 0.9, 0.95, seeds)
    reference = BatchGenerator(model, stops, PAD, VOCAB_LIMIT)
    assert got == reference.generate(prompts, MAX_NEW, 0.9, 0.95, seeds)
    greedy = reference.generate(prompts, MAX_NEW)
    assert got != greedy and all(t < VOCAB_LIMIT for g in got for t in g.ids)
    order = [3, 0, 4]
    assert static.generate([prompts[i] for i in order], MAX_NEW, 0.9, 0.95, [seeds[i] for i in order]) == \
        [got[i] for i in order]
    assert static.generate([prompts[1]], MAX_NEW, 0.9, 0.95, [seeds[1]]) == [got[1]]
    assert static.generate([prompts[1]], MAX_NEW, 0.9, 0.95, [seeds[1] + 1]) != [got[1]]
    one = StaticGenerator(_target().model, stops, VOCAB_LIMIT, batch_size=len(prompts), max_prompt_tokens=MAX_PROMPT,
                          max_new_tokens=MAX_NEW, short_prompt_tokens=16, sampling=Sampling(1.0, 1e-9))
    assert one.generate(prompts, MAX_NEW, 1.0, 1e-9, seeds) == greedy
    with pytest.raises(ValueError, match="samples at 0.9 / 0.95"):
        static.generate(prompts, MAX_NEW, 0.8, 0.95, seeds)
    with pytest.raises(ValueError, match="samples at"):
        static.generate(prompts, MAX_NEW)
    with pytest.raises(ValueError, match="one seed per prompt"):
        static.generate(prompts, MAX_NEW, 0.9, 0.95, seeds[:2])


def test_a_sampling_decoder_refuses_speculative_decoding_and_checks_seeds():
    prompts = [torch.tensor(p) for p in _prompts([5, 9], seed=6)]
    sampler = Generator(_target().model, [], max_len=64, batch_size=2, sampling=Sampling(1.0))
    with pytest.raises(ValueError, match="seeds: a sampling decoder needs one per prompt"):
        sampler.greedy(prompts, 4)
    with pytest.raises(ValueError, match="a sampling decoder takes no drafter"):
        Generator(_target().model, [], max_len=64, batch_size=2, sampling=Sampling(1.0), drafter=object())
    runs = sampler.greedy(prompts, 4, seeds=[1, 2])
    assert [len(r.tokens) for r in runs] == [4, 4]
    with pytest.raises(ValueError, match="seeds: this decoder is greedy"):
        Generator(_target().model, [], max_len=64, batch_size=2).greedy(prompts, 4, seeds=[1, 2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_compiled_sampling_equals_eager_and_batch_generator_on_gpu():
    """fp32 on CUDA: the sampled static generator with its step compiled and recorded as a CUDA
    graph draws the eager one's tokens and the batch generator's, per row seed."""
    from dflash.models.target_loader import load_target

    def model():
        return load_target(TargetConfig(kind="random", arch="tiny-llama", seed=0), "cuda", torch.float32).model

    prompts = _prompts([3, 17, 1, 29, 8], seed=7)
    seeds = [21, 22, 23, 24, 25]
    stops = [VOCAB_LIMIT - 1]
    rows = {}
    for compiled in (False, True):
        static = StaticGenerator(model(), stops, VOCAB_LIMIT, batch_size=len(prompts), max_prompt_tokens=MAX_PROMPT,
                                 max_new_tokens=MAX_NEW, short_prompt_tokens=16, compile=compiled, compile_long=compiled,
                                 sampling=Sampling(0.9, 0.95))
        rows[compiled] = static.generate(prompts, MAX_NEW, 0.9, 0.95, seeds)
        assert static.generate(prompts[2:], MAX_NEW, 0.9, 0.95, seeds[2:]) == rows[compiled][2:]
    assert rows[True] == rows[False]
    assert rows[True] == BatchGenerator(model(), stops, PAD, VOCAB_LIMIT).generate(prompts, MAX_NEW, 0.9, 0.95, seeds)


def test_prompt_chars_is_the_first_prompt():
    from dflash.inference.regeneration.jobs import prompt_chars
    from dflash.inference.regeneration.rows import SourceRow

    row = SourceRow(0, "x", [{"role": "assistant", "content": "lead"}, {"role": "system", "content": "sys"},
                             {"role": "user", "content": "hello"}, {"role": "assistant", "content": "answer"},
                             {"role": "user", "content": "more"}])
    assert prompt_chars(row) == len("lead") + len("sys") + len("hello")


def test_ids_beyond_the_tokenizer_are_never_generated():
    """A head whose padding rows win the argmax: both paths pick within the tokenizer, identically."""
    biased = _target(seed=3).model
    with torch.no_grad():
        biased.lm_head.weight[VOCAB_LIMIT:] = biased.lm_head.weight[:VOCAB - VOCAB_LIMIT] * 50
    prompts = _prompts([5, 11, 2], seed=4)
    unmasked = BatchGenerator(biased, [], PAD, VOCAB).generate(prompts, MAX_NEW)
    assert any(t >= VOCAB_LIMIT for g in unmasked for t in g.ids)  # the bias bites without the limit
    old = BatchGenerator(biased, [], PAD, VOCAB_LIMIT).generate(prompts, MAX_NEW)
    new = StaticGenerator(biased, [], VOCAB_LIMIT, 3, MAX_PROMPT, MAX_NEW).generate(prompts, MAX_NEW)
    assert new == old and all(t < VOCAB_LIMIT for g in new for t in g.ids)
    assert biased.get_output_embeddings().weight.shape[0] == VOCAB_LIMIT
    assert biased.get_output_embeddings().weight.data_ptr() == biased.lm_head.weight.data_ptr()
    limit_vocab(biased, VOCAB)  # a head that already fits is left alone
    assert biased.get_output_embeddings().weight.shape[0] == VOCAB_LIMIT
    with pytest.raises(ValueError, match="vocab_limit"):
        limit_vocab(biased, 0)


# --------------------------------------------------------------------------- the config section


def _write(tmp_path: Path, extra: dict) -> Path:
    path = tmp_path / "c.yaml"
    data = {"target": {"kind": "random", "arch": "tiny-llama", "tokenizer": "qwen3"},
            "cluster": {"device": "cpu", "targets": [0], "drafters": [1]}}
    data.update(extra)
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("section, key", [
    ({"enabled": True}, "regenerate.output"),
    ({"bogus": 1}, "regenerate.bogus"),
    ({"max_new_tokens": 0}, "regenerate.max_new_tokens"),
    ({"batch_size": 0}, "regenerate.batch_size"),
    ({"batch_size": "big"}, "regenerate.batch_size"),
    ({"max_turns": 0}, "regenerate.max_turns"),
    ({"max_prompt_tokens": 0}, "regenerate.max_prompt_tokens"),
    ({"temperature": -0.5}, "regenerate.temperature"),
    ({"top_p": 0.0}, "regenerate.top_p"),
    ({"limit": 0}, "regenerate.limit"),
    ({"attention": "cudnn"}, "regenerate.attention"),
    ({"enabled": "yes", "output": "x.jsonl"}, "regenerate.enabled"),
])
def test_regenerate_section_is_checked(tmp_path, monkeypatch, section, key):
    import dflash.models.target_loader

    monkeypatch.setattr(dflash.models.target_loader, "load_target", _no_model)
    with pytest.raises(ConfigError) as exc:
        load_config(_write(tmp_path, {"regenerate": section}), gpu_count=0)
    assert str(exc.value).startswith(key + ":"), exc.value
    with pytest.raises(ConfigError, match="^regenerate.max_turns:"):
        load_config(_write(tmp_path, {}), ["regenerate.max_turns=-1"], gpu_count=0)


def test_regenerate_output_must_not_be_the_source(tmp_path):
    source = tmp_path / "source.jsonl"
    source.write_text("")
    with pytest.raises(ConfigError, match="^regenerate.output: must differ from data.dataset"):
        load_config(_write(tmp_path, {"data": {"dataset": str(source)},
                                      "regenerate": {"enabled": True, "output": str(source)}}), gpu_count=0)
    cfg = load_config(_write(tmp_path, {}), gpu_count=0)
    assert cfg.regenerate.enabled is False  # off by default


def _no_model(*args, **kwargs):
    raise AssertionError("a model was loaded")


# --------------------------------------------------------------------------- the stage


QWEN3_VOCAB = 151669


def test_stage_regenerates_then_is_skipped_when_complete(tmp_path, monkeypatch):
    from dflash.inference import regenerate
    from dflash.inference.regeneration import launcher
    from dflash.data.sources import read_rows

    source = tmp_path / "source.jsonl"
    long_question = " ".join(["word"] * 200)  # its prompt reaches max_prompt_tokens: a skip record
    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"What is {i} + {i}?"},
                                              {"from": "gpt", "value": "Someone else's answer."},
                                              {"from": "human", "value": "And twice that?"},
                                              {"from": "gpt", "value": "Another answer."}]} for i in range(5)]
    rows.append({"id": "long", "conversations": [{"from": "human", "value": long_question},
                                                 {"from": "gpt", "value": "ok"}]})
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "regen.jsonl"
    config = _write(tmp_path, {
        "target": {"kind": "random", "arch": "tiny-llama", "arch_overrides": {"vocab_size": QWEN3_VOCAB},
                   "tokenizer": "qwen3", "compile": False},
        "data": {"dataset": str(source), "max_length": 128, "enable_thinking": False},
        "cluster": {"device": "cpu", "targets": [0], "drafters": [1], "cpu_threads_per_target": 1},
        "regenerate": {"enabled": True, "output": str(out), "max_new_tokens": 8, "max_turns": 1, "batch_size": 4,
                       "max_prompt_tokens": 64},
        "log": {"wandb": "disabled"}})
    cfg = load_config(config, gpu_count=0)
    assert regenerate.stage_workers(cfg) == [0, 1]

    code, trained = regenerate.run_stage(cfg, config, [])
    assert code == 0
    assert trained.data.dataset == str(out.resolve()) and trained.regenerate.enabled is False
    assert cfg.data.dataset == str(source)  # the caller's config is not changed
    records = list(read_rows(str(out), None))
    assert sorted(r["id"] for r in records) == [f"c{i}" for i in range(5)]
    assert all(r["regen"]["turns"] == 1 and len(r["conversations"]) == 2 for r in records)
    report = json.loads(out.with_name(out.name + ".regen.json").read_text())["last_run"]
    assert report["skipped"] == {"prompt_too_long": 1} and report["workers"] == 2
    assert [w["rank"] for w in report["per_worker"]] == [0, 1]
    assert report["new_tokens_now"] == sum(sum(r["regen"]["new_tokens"]) for r in records) > 0
    assert report["new_tokens_now"] == sum(w["new_tokens"] for w in report["per_worker"])
    assert report["tokens_per_s"] > 0
    for w in report["per_worker"]:  # the static-cache generator timed its batches (a worker may get no row)
        if w["rows"]:
            assert w["batches"] >= 1 and 0 < w["prefill_s"] and 0 < w["decode_s"]
            assert w["prefill_s"] + w["decode_s"] <= w["generate_s"] + 0.01
            assert w["compiles"] == 0 and w["cudagraph_records"] == 0  # target.compile: false
    assert any(w["rows"] for w in report["per_worker"])
    # the training config written to the run directory reads the output and validates
    saved = tmp_path / "saved.yaml"
    saved.write_text(yaml.safe_dump(trained.to_dict()))
    assert load_config(saved, gpu_count=0).data.dataset == str(out.resolve())

    # complete: no worker starts, no model loads, the output keeps its bytes and time
    stamp = out.stat().st_mtime_ns, out.read_bytes()

    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started for a complete output")

    monkeypatch.setattr(subprocess, "Popen", no_worker)
    reads = []
    read_done = launcher.done_ids
    monkeypatch.setattr(launcher, "done_ids", lambda path: reads.append(path) or read_done(path))
    code, again = regenerate.run_stage(cfg, config, [])
    assert code == 0 and again.data.dataset == trained.data.dataset
    # the finished rows are read a fixed number of times, not once per row (a 17k-row output
    # read per row is hours)
    assert len(reads) <= 2
    assert (out.stat().st_mtime_ns, out.read_bytes()) == stamp
    report = json.loads(out.with_name(out.name + ".regen.json").read_text())["last_run"]
    assert report["regenerated_now"] == 0 and report["skipped"] == {"prompt_too_long": 1}


def test_shipped_regeneration_config():
    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "smollm2-135m-h200-regen.yaml",
                      gpu_count=2)
    r = cfg.regenerate
    assert r.enabled and r.max_turns is None and r.max_new_tokens == 128 and r.batch_size == 1024
    assert r.max_prompt_tokens == 1024 and r.max_seconds == 480
    assert cfg.train.lr == 1.2e-3 and cfg.drafter.anchor_sampling == "conversation" and cfg.train.max_steps == 5000
    assert cfg.drafter.num_layers == 5 and cfg.drafter.intermediate_size == 3072
    assert cfg.drafter.loss_weighting == "dpace" and cfg.drafter.loss_gamma is None and cfg.drafter.label_chain and cfg.drafter.labels == "target"
    assert cfg.data.extra_datasets == ["sharegpt"] and cfg.data.extra_token_ratio is None
    assert r.sampled.output == "data/sharegpt-smollm2-135m-sampled.jsonl" and (r.sampled.temperature, r.sampled.top_p) == (0.8, 0.95)
    from dflash.inference.regenerate import stage_workers

    assert stage_workers(cfg) == [0, 1]


def test_stage_off_does_nothing(tmp_path):
    from dflash.inference import regenerate

    cfg = RunConfig()
    assert regenerate.run_stage(cfg, tmp_path / "missing.yaml", []) == (0, cfg)


@pytest.mark.parametrize("given", [
    dict(max_new_tokens=7, temperature=0.1 + 0.2, top_p=0.9, seed=3, batch_size=5, limit=11, max_turns=2,
         max_prompt_tokens=99, attention="flex+sdpa"),
    dict(temperature=1, limit=None, max_turns=None, max_prompt_tokens=None),  # an int temperature, unset options
])
def test_option_flags_read_back_as_the_same_options(given):
    """The flags a launcher gives its workers (and the training stage its launcher) parse back to
    the same values, floats exactly; unset options stay unset."""
    from dflash.config import RegenerateConfig
    from dflash.inference.regenerate import parse_args
    from dflash.inference.regeneration.launcher import option_flags

    section = RegenerateConfig(**given)
    args = parse_args(["--config", "c.yaml", *option_flags(section)])
    for key in ("max_new_tokens", "temperature", "top_p", "seed", "batch_size", "limit", "max_turns",
                "max_prompt_tokens", "attention"):
        assert getattr(args, key) == getattr(section, key), key
    assert parse_args(["--config", "c.yaml", *option_flags(args)]) == args
