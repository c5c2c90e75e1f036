"""Decoding over the static cache (dflash/inference/generation.py) and the speculative check
(dflash/inference/speculative.py and the modules it runs: lossless, acceptance, prompts, drafter_checkpoint).

The oracle is :func:`naive_greedy_decode`: a full target forward over the whole sequence for every
token (no KV cache, no features). Targets are tiny random llamas in fp32; the drafter is either
fresh, briefly trained on the target's own greedy continuations (so that it is sometimes right), or
a scripted proposer that knows the oracle's output and is right for a chosen number of slots.
"""

from __future__ import annotations

import copy
import math
import os
import random
from typing import Callable

import pytest
import torch

from dflash.config import DrafterConfig, TargetConfig, TrainConfig
from dflash.inference.generation import PASS_SCHEDULES, Generation, Generator, passes_before_check
from dflash.inference.oracle import naive_greedy_decode
from dflash.models.drafter import DFlashDraftModel
from dflash.models.drafter_config import DFlashConfig
from dflash.inference.acceptance import measured_per_position, offline_tau, walk_tau
from dflash.inference.drafter_checkpoint import (checkpoint_step, last_eval_tau, resolve_checkpoint,
                                                training_eval_summary)
from dflash.inference.lossless import first_difference, tie_bound
from dflash.inference.prompts import prompts_from_corpus
from dflash.models.target import TargetModel
from dflash.models.target_loader import load_target
from dflash.training.trainer import DrafterTrainer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 512          # tiny-llama
MAX_NEW = 40
MAX_B = 8
MAX_LEN = 256
TRAIN_ROWS, TRAIN_PROMPT, TRAIN_LEN = 8, 8, 64


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return load_target(TargetConfig(kind="random", arch="tiny-llama"), "cpu", num_drafter_layers=2)


def make_drafter(target: TargetModel, block_size: int, num_layers: int = 1, seed: int = 0) -> DFlashDraftModel:
    cfg = DFlashConfig.from_target(target.config, DrafterConfig(num_layers=num_layers, block_size=block_size),
                                   target_layer_ids=target.layer_ids, mask_token_id=0)
    torch.manual_seed(seed)
    return DFlashDraftModel(cfg, target.embed_tokens, target.lm_head, attention="sdpa").eval()


def greedy(target: TargetModel, prompt: torch.Tensor, n: int, stops=()) -> list[int]:
    return Generator(target.model, [], MAX_LEN).greedy([prompt], n, stops)[0].tokens


def speculative(target: TargetModel, proposer, prompt: torch.Tensor, n: int, stops=(), max_len: int = MAX_LEN
                ) -> Generation:
    return Generator(target.model, target.layer_ids, max_len, drafter=proposer).speculative([prompt], n, stops)[0]


@pytest.fixture(scope="module")
def greedy_rows(target: TargetModel) -> dict[str, torch.Tensor]:
    """Rows of [random prompt (8) ; the target's greedy continuation (56)], loss on the continuation."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(TRAIN_ROWS):
        prompt = torch.randint(0, VOCAB, (TRAIN_PROMPT,), generator=g)
        cont = naive_greedy_decode(target.model, prompt, TRAIN_LEN - TRAIN_PROMPT)
        rows.append(torch.cat([prompt, torch.tensor(cont)]))
    ids = torch.stack(rows)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, TRAIN_PROMPT:] = True
    return {"input_ids": ids, "loss_mask": mask}


@pytest.fixture(scope="module")
def trained_drafter(target: TargetModel, greedy_rows: dict[str, torch.Tensor]) -> DFlashDraftModel:
    """A B=4 drafter trained for 60 steps on ``greedy_rows`` (it then often drafts them right)."""
    b = 4
    drafter = make_drafter(target, b)
    ids, mask = greedy_rows["input_ids"], greedy_rows["loss_mask"]
    r, s = ids.shape
    pos = torch.arange(s).expand(r, s).contiguous()
    doc = torch.ones(r, s, dtype=torch.int32)
    feats, tokens = target.forward_features(ids, pos, doc)
    batch = dict(input_ids=ids, position_ids=pos, doc_ids=doc, loss_mask=mask, features=feats, target_tokens=tokens)
    steps = 60
    trainer = DrafterTrainer(drafter, TrainConfig(lr=3e-3, warmup_ratio=0.0),
                             DrafterConfig(num_layers=1, block_size=b, anchors_per_row=16), steps, "cpu")
    for step in range(steps):
        trainer.step(batch, 0, step)
    return drafter.eval()


@pytest.fixture(scope="module")
def prompts(greedy_rows: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Two prompts the trained drafter has seen, a one-token prompt, and a long one (150 tokens)."""
    g = torch.Generator().manual_seed(1)
    return [greedy_rows["input_ids"][0, :TRAIN_PROMPT], greedy_rows["input_ids"][3, :TRAIN_PROMPT],
            torch.randint(0, VOCAB, (1,), generator=g), torch.randint(0, VOCAB, (150,), generator=g)]


@pytest.fixture(scope="module")
def references(target: TargetModel, prompts: list[torch.Tensor]) -> list[list[int]]:
    """Naive greedy output of every prompt, long enough for any scripted block."""
    return [naive_greedy_decode(target.model, p, MAX_NEW + MAX_B) for p in prompts]


class ScriptedProposer:
    """Knows each row's greedy continuation; drafts it right for ``right(call)`` leading slots, then wrong."""

    def __init__(self, block_size: int, prompt_lens: list[int], references: list[list[int]],
                 right: Callable[[int], int]) -> None:
        self.block_size = block_size
        self.prompt_lens = prompt_lens
        self.references = references
        self.right = right
        self.made_right: list[list[int]] = [[] for _ in prompt_lens]
        self.calls = 0

    def __call__(self, tokens: torch.Tensor, features: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        out = []
        k = min(self.right(self.calls), self.block_size - 1)
        self.calls += 1
        for r in range(tokens.shape[0]):
            if r >= len(self.prompt_lens):
                out.append([0] * (self.block_size - 1))
                continue
            n = int(anchor[r])
            ref = self.references[r]
            truth = [ref[n + 1 + j - self.prompt_lens[r]] if n + 1 + j - self.prompt_lens[r] < len(ref) else 0
                     for j in range(self.block_size - 1)]
            self.made_right[r].append(k)
            out.append(truth[:k] + [(t + 1) % VOCAB for t in truth[k:]])
        return torch.tensor(out)


# --------------------------------------------------------------------------- static cache vs the oracle


@pytest.mark.parametrize("batch", [1, 3])
def test_static_greedy_equals_naive(target, prompts, references, batch):
    gen = Generator(target.model, [], MAX_LEN, batch_size=batch)
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        for out, ref in zip(gen.greedy(group, MAX_NEW), references[i:i + batch]):
            assert out.tokens == ref[:MAX_NEW]
            assert len(out.top2) == MAX_NEW and all(z1 >= z2 for z1, z2 in out.top2)


def test_static_greedy_without_logit_stats_gives_the_same_tokens(target, prompts, references):
    """``logit_stats=False`` (regeneration) skips the top-2 / spread read, and nothing else."""
    gen = Generator(target.model, [], MAX_LEN, batch_size=3)
    outs = gen.greedy(prompts[:3], MAX_NEW, logit_stats=False)
    for out, ref in zip(outs, references[:3]):
        assert out.tokens == ref[:MAX_NEW]
        assert out.top2 == [] and out.spread == []
        assert out.prefill_seconds > 0 and out.decode_seconds > 0
        assert out.prefill_seconds + out.decode_seconds <= out.seconds
        assert 0 < out.enqueue_seconds <= out.decode_seconds  # eagerly on CPU, enqueuing a step is running it


def test_static_greedy_records_the_logit_spread(target, prompts, references):
    """Each token's recorded spread equals ``max_v |z_v − mean(z)|`` of a full forward over the
    prompt and the tokens before it, computed here with a plain loop over the vocabulary."""
    gen = Generator(target.model, [], MAX_LEN, batch_size=2)
    for prompt, out in zip(prompts[:2], gen.greedy(prompts[:2], 6)):
        assert len(out.spread) == len(out.tokens) == 6
        for j in range(6):
            seq = torch.cat([prompt, torch.tensor(out.tokens[:j], dtype=torch.long)])
            with torch.no_grad():
                z = target.model(input_ids=seq[None]).logits[0, -1].float().tolist()
            mean = sum(z) / len(z)
            want = max(abs(v - mean) for v in z)
            assert out.spread[j] == pytest.approx(want, rel=1e-4, abs=1e-4)
            assert out.top2[j][0] == pytest.approx(max(z), rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_lossless_with_dflash_drafter(target, prompts, references, trained_drafter, block_size):
    drafter = trained_drafter if block_size == 4 else make_drafter(target, block_size, num_layers=2, seed=block_size)
    for prompt, ref in zip(prompts, references):
        res = speculative(target, drafter, prompt, MAX_NEW)
        assert res.tokens == ref[:MAX_NEW]
        assert res.target_forwards == res.steps + 1 and all(1 <= a <= block_size for a in res.accepted)
        # Every step's m + 1 tokens went into the output, except possibly the last step's.
        assert sum(res.accepted[:-1]) + 1 < MAX_NEW <= sum(res.accepted) + 1


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_batched_rows_accept_independently(target, prompts, references, block_size):
    """Four prompts of lengths 8, 8, 1, 150 in one batch, each row with its own random acceptance."""
    rng = random.Random(block_size)
    proposer = ScriptedProposer(block_size, [p.numel() for p in prompts], references,
                                lambda _: rng.randint(0, block_size - 1))
    gen = Generator(target.model, target.layer_ids, MAX_LEN, batch_size=4, drafter=proposer)
    outs = gen.speculative(prompts, MAX_NEW)
    for out, ref in zip(outs, references):
        assert out.tokens == ref[:MAX_NEW]
    # A full batch and a partial one (3 prompts in 4 rows) agree with one-row decoding.
    trained = make_drafter(target, block_size, num_layers=2, seed=1)
    gen = Generator(target.model, target.layer_ids, MAX_LEN, batch_size=4, drafter=trained)
    for out, ref in zip(gen.speculative(prompts[1:], MAX_NEW), references[1:]):
        assert out.tokens == ref[:MAX_NEW]


def test_trained_drafter_really_accepts(target, prompts, references, trained_drafter):
    """The real drafter's acceptance path is exercised: it drafts its training rows right often."""
    res = speculative(target, trained_drafter, prompts[0], MAX_NEW)
    assert res.tokens == references[0][:MAX_NEW]
    assert res.tau > 1.5 and max(res.accepted) == 4


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_lossless_with_scripted_proposer_random_acceptance(target, prompts, references, block_size):
    rng = random.Random(block_size)
    for prompt, ref in zip(prompts, references):
        proposer = ScriptedProposer(block_size, [prompt.numel()], [ref], lambda _: rng.randint(0, block_size - 1))
        res = speculative(target, proposer, prompt, MAX_NEW)
        assert res.tokens == ref[:MAX_NEW]
        # passes the schedule predicted past the row's end draft too (and change nothing): the
        # row's passes are the proposer's first calls
        assert res.accepted == [k + 1 for k in proposer.made_right[0][:len(res.accepted)]]


# --------------------------------------------------------------------------- τ by hand


def test_tau_always_right_is_block_size(target, prompts, references):
    b = 4
    proposer = ScriptedProposer(b, [prompts[0].numel()], [references[0]], lambda _: b)
    res = speculative(target, proposer, prompts[0], 1 + 3 * b)
    assert res.tokens == references[0][:1 + 3 * b]
    assert res.accepted == [4, 4, 4] and res.tau == 4.0 and res.target_forwards == 4
    p = prompts[0].numel()
    assert res.anchors == [p, p + 4, p + 8]


def test_tau_always_wrong_is_one(target, prompts, references):
    proposer = ScriptedProposer(4, [prompts[0].numel()], [references[0]], lambda _: 0)
    res = speculative(target, proposer, prompts[0], 9)
    assert res.tokens == references[0][:9]
    assert res.accepted == [1] * 8 and res.tau == 1.0 and res.target_forwards == 9


def test_tau_hand_checked_pattern(target, prompts, references):
    """B = 4, right for 2, 0, 1, 2, 0 slots: the passes add 3, 1, 2, 3, 1 tokens: τ = 10 / 5 = 2."""
    pattern = [2, 0, 1, 2, 0]
    proposer = ScriptedProposer(4, [prompts[1].numel()], [references[1]], lambda i: pattern[i])
    res = speculative(target, proposer, prompts[1], 11)
    assert res.tokens == references[1][:11]
    assert res.accepted == [3, 1, 2, 3, 1] and res.tau == 2.0
    assert measured_per_position(res.accepted, 4) == [3 / 5, 2 / 5, 0.0]


def test_max_new_tokens_cuts_the_last_block(target, prompts, references):
    proposer = ScriptedProposer(8, [prompts[0].numel()], [references[0]], lambda _: 8)
    res = speculative(target, proposer, prompts[0], 12)
    assert res.tokens == references[0][:12] and res.accepted == [8, 8]  # 1 + 8 + 3 of 8 kept
    assert speculative(target, proposer, prompts[0], 1).tokens == references[0][:1]
    assert speculative(target, proposer, prompts[0], 0).tokens == []


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_stop_token_inside_a_block_ends_like_greedy(target, prompts, references, block_size):
    ref = references[1]
    first = next(i for i in range(2, MAX_NEW) if ref.index(ref[i]) == i)  # a token's first occurrence
    assert first <= 7
    stop = ref[first]
    want = ref[:first + 1]
    assert naive_greedy_decode(target.model, prompts[1], MAX_NEW, [stop]) == want
    assert greedy(target, prompts[1], MAX_NEW, [stop]) == want
    for right in (0, 2, block_size):  # the stop token comes as a bonus, or drafted right mid-block
        proposer = ScriptedProposer(block_size, [prompts[1].numel()], [ref], lambda _: right)
        assert speculative(target, proposer, prompts[1], MAX_NEW, [stop]).tokens == want
    proposer = ScriptedProposer(block_size, [prompts[1].numel()], [ref], lambda _: block_size)
    assert speculative(target, proposer, prompts[1], MAX_NEW, [ref[0]]).tokens == ref[:1]
    # In a batch, the row that stops early leaves the others running.
    proposer = ScriptedProposer(block_size, [p.numel() for p in prompts[:2]], references[:2], lambda _: 2)
    gen = Generator(target.model, target.layer_ids, MAX_LEN, batch_size=2, drafter=proposer)
    outs = gen.speculative(prompts[:2], MAX_NEW, [stop])
    other = references[0][:MAX_NEW]
    cut = next((i for i, t in enumerate(other) if t == stop), None)
    assert outs[1].tokens == want and outs[0].tokens == (other if cut is None else other[:cut + 1])


def _cut(tokens: list[int], stops: set[int], n: int) -> list[int]:
    """``tokens[:n]`` ending at the first stop token (kept): what decoding with ``stops`` must emit."""
    out = tokens[:n]
    i = next((k for k, t in enumerate(out) if t in stops), None)
    return out if i is None else out[:i + 1]


def _first_from(ref: list[int], i: int) -> int:
    """The first token of ``ref`` from index ``i`` on that does not occur before (decoding with it as
    a stop token ends there), else the last such token (random tiny targets soon repeat themselves)."""
    firsts = [k for k in range(len(ref)) if ref.index(ref[k]) == k]
    return ref[next((k for k in firsts if k >= i), firsts[-1])]


@pytest.mark.parametrize("kind", ["greedy", "scripted", "dflash"])
def test_stop_check_every_n_forwards_equals_every_forward(target, prompts, references, trained_drafter, kind):
    """The host reads the device's stop flags every N target forwards: whatever N and pass schedule,
    each row's tokens, top-2 logits and passes are those of checking after every forward (N = 1), and
    the predicted schedule checks no more often than the certain one; each row's tokens are
    the oracle's cut after the first stop token. Three rows of one batch, stops at various positions
    (the first token, mid-block, past max_new_tokens) and a stop list longer than the device's slots."""
    rows, refs = prompts[:3], references[:3]
    b = 4
    rng = random.Random(7)
    pattern = [rng.randint(0, b - 1) for _ in range(4096)]
    scripted = ScriptedProposer(b, [p.numel() for p in rows], refs, lambda i: pattern[i])
    proposer = {"greedy": None, "scripted": scripted, "dflash": trained_drafter}[kind]
    gen = Generator(target.model, target.layer_ids, MAX_LEN, batch_size=3, drafter=proposer)
    run = gen.greedy if kind == "greedy" else gen.speculative
    base = Generator(target.model, [], MAX_LEN, batch_size=3, sync_every=1)
    lens = [p.numel() for p in rows]
    many = set(range(VOCAB - 12, VOCAB)) | {_first_from(refs[1], 5)}
    cases = [set(), {refs[0][0]}, {_first_from(refs[1], 1), _first_from(refs[2], 9)},
             {_first_from(refs[0], 7), _first_from(refs[1], 8), _first_from(refs[2], 16)},
             {_first_from(refs[2], 20)}, many]
    for stops in cases:
        outs, checks, idle = {}, {}, {}
        for n, overlap in [(n, False) for n in (1, 2, 5, 8, 64)] + [(n, True) for n in (1, 2, 8)]:
            for schedule in PASS_SCHEDULES if kind != "greedy" else PASS_SCHEDULES[:1]:
                gen.sync_every, gen.pass_schedule, gen.overlap_checks = n, schedule, overlap
                scripted.calls = 0
                gens = run(rows, MAX_NEW, sorted(stops))
                key = (n, schedule) if not overlap else (n, schedule, "overlap")
                outs[key] = [(g.tokens, g.top2, g.accepted, g.anchors, g.target_forwards, g.spread) for g in gens]
                checks[key] = gens[0].checks
                idle[key] = gens[0].idle_checks
                if kind == "greedy":  # the batch's steps: the longest row's, and at most one check's
                    # more (and the step the device takes while the host reads, overlapping)
                    need = max(len(g.tokens) for g in gens) - 1
                    assert need <= gens[0].passes_enqueued <= need + n - 1 + overlap, (n, need, gens[0].passes_enqueued)
                elif kind == "scripted" and overlap and schedule != "pipelined":  # a draft behind each idle check
                    assert scripted.calls == gens[0].passes_enqueued + 1, (scripted.calls, gens[0].passes_enqueued)
        first = outs[1, PASS_SCHEDULES[0]]
        assert all(out == first for out in outs.values()), f"stops {sorted(stops)}"
        if kind != "greedy":  # the prediction never checks more often than the certain need alone
            assert all(checks[n, "predicted"] <= checks[n, "certain"] for n in (1, 2, 5, 8, 64))
            # pipelined: the host reads a chunk's outcome while the next one runs, so the GPU waits
            # for the host at fewer checks
            assert all(idle[n, "pipelined"] <= idle[n, "predicted"] == checks[n, "predicted"] for n in (1, 2, 5, 8, 64))
            if not stops:  # rows that run to max_new_tokens: fewer syncs
                assert checks[64, "predicted"] < checks[64, "certain"], checks
                assert idle[8, "pipelined"] < idle[8, "predicted"], idle
        outs = {1: first}
        assert [o[0] for o in outs[1]] == [_cut(r, stops, MAX_NEW) for r in refs]
        # The device stopped each row itself: its anchor is at (greedy) or within a block past
        # (speculative) its last token, and every row is inactive.
        last = [p + len(o[0]) - 1 for p, o in zip(lens, outs[1])]
        anchor = gen.state.anchor[:3].tolist()
        assert not gen.state.active.any()
        if kind == "greedy":
            assert anchor == last
            continue
        assert all(x <= a < x + b for x, a in zip(last, anchor))
        assert all(f == len(a) + 1 for _, _, a, _, f, _ in outs[1])
        # The top-2 logits and their spread land at the tokens they produced: a block forward's
        # equal a one-token one's.
        for got, want in zip(outs[1], base.greedy(rows, MAX_NEW, sorted(stops))):
            assert got[0] == want.tokens
            torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want.top2), atol=1e-4, rtol=1e-4)
            assert len(got[5]) == len(got[0])
            torch.testing.assert_close(torch.tensor(got[5]), torch.tensor(want.spread), atol=1e-4, rtol=1e-4)
    assert any(len(_cut(r, c, MAX_NEW)) < MAX_NEW for c in cases for r in refs)  # stops really cut


def _naive_passes(remaining: list[int], emitted: list[int], done: int, b: int, cap: int, schedule: str) -> int:
    """Passes before the next check, counted one pass at a time: a row certainly needs passes while
    ``b`` tokens a pass have not covered its remaining tokens, and is predicted to need them while
    its rate so far (``emitted / done`` a pass) has not."""
    need = 0
    for r, (rem, out) in enumerate(zip(remaining, emitted)):
        k = 0
        while k * b < rem:
            k += 1
        if schedule != "certain" and done > 0 and out > 0:
            j = 0
            while (j + 1) * out <= rem * done:  # (j + 1) passes at out / done tokens a pass fit in rem
                j += 1
            k = max(k, j)
        need = max(need, k)
    return min(cap, max(1, need))


def test_passes_before_check_against_a_naive_count():
    """Random rows (remaining 0-200 tokens, 0-300 emitted over 0-60 passes), block sizes 1-16 and
    caps 1-64: the closed form equals counting pass by pass; ``predicted`` is never below ``certain``,
    and before the first pass the two agree."""
    rng = random.Random(11)
    for _ in range(3000):
        rows = rng.randint(1, 4)
        remaining = [rng.randint(0, 200) for _ in range(rows)]
        done = rng.randint(0, 60)
        emitted = [rng.randint(done, 16 * done) if done else 0 for _ in range(rows)]
        b, cap = rng.randint(1, 16), rng.randint(1, 64)
        for schedule in PASS_SCHEDULES:
            want = _naive_passes(remaining, emitted, done, b, cap, schedule)
            assert passes_before_check(remaining, emitted, done, b, cap, schedule) == want
        assert (passes_before_check(remaining, emitted, done, b, cap, "predicted")
                >= passes_before_check(remaining, emitted, done, b, cap, "certain"))
        assert passes_before_check(remaining, emitted, 0, b, cap) == passes_before_check(remaining, emitted, 0, b, cap,
                                                                                        "certain")
    # a row at τ = 2.5 with 90 tokens to go: 36 passes predicted, capped at 8; 6 certain with B = 16
    assert passes_before_check([90], [25], 10, 16, 8, "predicted") == 8
    assert passes_before_check([90], [25], 10, 16, 64, "predicted") == 36
    assert passes_before_check([90], [25], 10, 16, 64) == 6  # certain, the default
    with pytest.raises(ValueError, match="schedule"):
        passes_before_check([1], [1], 1, 4, 8, "eager")
    with pytest.raises(ValueError, match="differ in length"):
        passes_before_check([1, 2], [1], 1, 4, 8)


def test_bad_inputs(target, prompts):
    with pytest.raises(ValueError, match="max_len"):
        Generator(target.model, [], MAX_LEN).greedy([prompts[3]], MAX_LEN)
    with pytest.raises(ValueError, match="batch size"):
        Generator(target.model, [], MAX_LEN).greedy(prompts[:2], 4)
    with pytest.raises(ValueError, match="layer_ids"):
        Generator(target.model, [99], MAX_LEN)
    with pytest.raises(ValueError, match="drafter"):
        Generator(target.model, [], MAX_LEN).speculative([prompts[0]], 4)


# --------------------------------------------------------------------------- what the drafter sees


def test_context_features_are_the_training_features(target, prompts, trained_drafter):
    """The drafter gets exactly ``forward_features`` of the verified tokens before the anchor."""
    from dflash.inference.proposer import DFlashProposer

    seen: list[tuple[torch.Tensor, torch.Tensor, int]] = []
    inner = DFlashProposer(trained_drafter)

    def spy(tokens: torch.Tensor, features: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        n = int(anchor[0])
        seen.append((tokens[0, :n + 1].clone(), features[0, :n].clone(), n))
        return inner(tokens, features, anchor)

    spy.block_size = inner.block_size  # type: ignore[attr-defined]
    res = speculative(target, spy, prompts[0], MAX_NEW)
    full = torch.cat([prompts[0], torch.tensor(res.tokens)])
    assert len(seen) == res.steps >= 3 and [n for _, _, n in seen] == res.anchors
    for ids, ctx, n in seen:
        assert torch.equal(ids, full[:n + 1])
        feats, _ = target.forward_features(ids[None, :n], torch.arange(n)[None], torch.ones(1, n, dtype=torch.int32))
        assert ctx.shape == (n, len(target.layer_ids) * target.hidden_size)
        torch.testing.assert_close(ctx, feats[0], atol=1e-5, rtol=1e-5)
        assert ctx.abs().max() > 0.1


def test_proposer_ignores_the_anchor_row_and_sees_the_context(target, trained_drafter):
    """The block sees context j < anchor only: the anchor's (uncomputed) feature row does not matter."""
    g = torch.Generator().manual_seed(3)
    n = 20
    ids = torch.randint(0, VOCAB, (n + 1,), generator=g)
    ctx = torch.randn(n, len(target.layer_ids) * target.hidden_size, generator=g)
    s = n + 1
    args = (ids.view(1, s), torch.arange(s).view(1, s), torch.ones(1, s, dtype=torch.int32), torch.tensor([[n]]),
            torch.ones(1, 1, dtype=torch.bool))
    with torch.no_grad():
        zero_row = trained_drafter(torch.cat([ctx, torch.zeros(1, ctx.shape[1])])[None], *args)
        rand_row = trained_drafter(torch.cat([ctx, torch.randn(1, ctx.shape[1], generator=g)])[None], *args)
        other_ctx = ctx.clone()
        other_ctx[n - 1] += 1.0
        moved = trained_drafter(torch.cat([other_ctx, torch.zeros(1, ctx.shape[1])])[None], *args)
    assert torch.equal(zero_row, rand_row)
    assert (moved - zero_row).abs().max() > 1e-4


def test_static_buffer_draft_equals_the_exact_length_draft(target, prompts, trained_drafter):
    """Drafting over the whole static buffer (what the compiled path does) gives the same drafts as
    drafting over exactly ``anchor + 1`` positions: stale entries past the anchor are never seen."""
    from dflash.inference.proposer import DFlashProposer

    gen = Generator(target.model, target.layer_ids, MAX_LEN, drafter=trained_drafter)
    gen.speculative([prompts[0]], 20)  # leaves stale drafts and features past the anchor
    st = gen.state
    n = int(st.anchor[0])
    prop = DFlashProposer(trained_drafter)
    with torch.no_grad():
        full = prop(st.tokens, st.features, st.anchor)
        exact = prop(st.tokens[:, :n + 1], st.features[:, :n + 1], st.anchor)
        garbage = st.features.clone()
        garbage[:, n:] = torch.randn_like(garbage[:, n:])
        tokens = st.tokens.clone()
        tokens[:, n + 1:] = 7
        moved = prop(tokens, garbage, st.anchor)
    assert torch.equal(full, exact) and torch.equal(full, moved)


def _record_cached_drafts(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Patch :meth:`CachedDFlashProposer.block_hidden` to record, at every draft, its block hidden
    states and the training forward's on the same tokens, features and anchors (fp32 copies)."""
    from dflash.inference.proposer import CachedDFlashProposer, drafter_hidden

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    cached = CachedDFlashProposer.block_hidden

    def checked(self, tokens, features, anchor):
        b, s = tokens.shape
        want = drafter_hidden(self.drafter, features, tokens, torch.arange(s).expand(b, s),
                              torch.ones(b, s, dtype=torch.int32), anchor.view(b, 1),
                              torch.ones(b, 1, dtype=torch.bool))[:, 0]
        got = cached(self, tokens, features, anchor)
        seen.append((got.float(), want.float()))
        return got

    monkeypatch.setattr(CachedDFlashProposer, "block_hidden", checked)
    return seen


@pytest.mark.parametrize("attention", ["sdpa", "matmul", "reduce", "flex"])
def test_cached_proposer_equals_the_training_forward_over_a_decode(target, prompts, references, trained_drafter,
                                                                   monkeypatch, attention):
    """The cached drafter (context keys/values per layer, filled by the prefill and updated from the
    window before each anchor) against the drafter's training forward over the buffer, at every
    draft of a 3-row decode (prompts of 8, 1 and 150 tokens, rows finishing at different passes,
    rejected drafts' features left past each anchor): block hidden states equal within fp32
    rounding, drafts identical; the outputs are the naive oracle's."""
    from dflash.inference.proposer import CachedDFlashProposer

    seen = _record_cached_drafts(monkeypatch)
    rows = [0, 2, 3]
    gen = Generator(target.model, target.layer_ids, MAX_LEN, batch_size=3, drafter=trained_drafter,
                    attention=f"sdpa+{attention}")
    assert isinstance(gen.proposer, CachedDFlashProposer) and gen.proposer.attention == attention
    outs = gen.speculative([prompts[r] for r in rows], MAX_NEW)
    assert len(seen) >= 10
    head = trained_drafter.lm_head
    for got, want in seen:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        assert torch.equal(head(got[:, 1:]).argmax(-1), head(want[:, 1:]).argmax(-1))
    for r, out in zip(rows, outs):
        assert out.tokens == references[r][:len(out.tokens)] and len(out.tokens) == MAX_NEW


def test_cached_proposer_in_bf16_is_the_training_forward_within_rounding(prompts, trained_drafter, monkeypatch):
    """The target and the trained drafter in bf16 (drafter_for_decoding): at every draft of a 2-row
    decode (anchors moving by up to B) the cached drafter's block hidden states are the training
    forward's (under the same autocast) within bf16 rounding (relative Frobenius error ≤ 2e-2), and
    a draft differs only where the training forward's top-1/top-2 logit margin is within bf16
    rounding of the logits (2⁻⁶ of their scale)."""
    from dflash.inference.proposer import drafter_for_decoding

    # the same random target in bf16 (its weights are the fp32 fixture's, rounded)
    target = load_target(TargetConfig(kind="random", arch="tiny-llama", dtype="bfloat16"), "cpu",
                         num_drafter_layers=2)
    drafter = copy.deepcopy(trained_drafter)
    object.__setattr__(drafter, "embed_tokens", target.embed_tokens)  # the bf16 target's, shared
    object.__setattr__(drafter, "lm_head", target.lm_head)
    drafter_for_decoding(drafter, torch.bfloat16)
    assert target.embed_tokens.weight.dtype == target.lm_head.weight.dtype == torch.bfloat16
    seen = _record_cached_drafts(monkeypatch)
    gen = Generator(target.model, target.layer_ids, MAX_LEN, batch_size=2, drafter=drafter)
    outs = gen.speculative([prompts[0], prompts[3]], MAX_NEW)
    assert len(seen) >= 10 and max(a for o in outs for a in o.accepted) >= 3
    head = target.lm_head
    for got, want in seen:
        assert ((got - want).norm() / want.norm()).item() <= 2e-2
        logits = head(want[:, 1:].to(torch.bfloat16)).float()
        top = logits.topk(2, dim=-1).values
        differ = head(got[:, 1:].to(torch.bfloat16)).argmax(-1) != logits.argmax(-1)
        assert ((top[..., 0] - top[..., 1])[differ] <= 2 ** -6 * logits.abs().amax(-1)[differ]).all()


def test_cached_proposer_reads_only_the_context_before_the_anchor(target, prompts, trained_drafter):
    """After a decode, other features and cache contents past the block (random, finite) change
    nothing: the draft reads the slots up to the block's last position, whose context part it
    rewrote from the window before the anchor; a changed feature before the anchor does change it."""
    from dflash.inference.proposer import CachedDFlashProposer

    gen = Generator(target.model, target.layer_ids, MAX_LEN, drafter=trained_drafter)
    gen.speculative([prompts[3]], 20)
    prop, st = gen.proposer, gen.state
    assert isinstance(prop, CachedDFlashProposer)
    n, b_sz = int(st.anchor[0]), prop.block_size
    first = prop.block_hidden(st.tokens, st.features, st.anchor)
    g = torch.Generator().manual_seed(5)
    garbage = st.features.clone()
    garbage[:, n:] = torch.randn(garbage[:, n:].shape, generator=g)
    for buf in prop.keys + prop.values:
        buf[:, :, n + b_sz:] = torch.randn(buf[:, :, n + b_sz:].shape, generator=g)
    again = prop.block_hidden(st.tokens, garbage, st.anchor)
    assert torch.equal(first, again)
    moved = garbage.clone()
    moved[:, n - 1] += 1.0
    assert (prop.block_hidden(st.tokens, moved, st.anchor) - first).abs().max() > 1e-4


def test_only_speculative_decoding_fills_the_draft_cache(target, prompts, references, trained_drafter):
    """Target-only decoding on a decoder with a drafter leaves the drafter's context cache as it is
    (its prefill time is the target's alone); speculative decoding on the same decoder then fills it
    and decodes the oracle's tokens."""
    gen = Generator(target.model, target.layer_ids, MAX_LEN, drafter=trained_drafter)
    assert gen.greedy([prompts[3]], 8)[0].tokens == references[3][:8]
    assert all(not buf.any() for buf in gen.proposer.keys + gen.proposer.values)
    assert gen.speculative([prompts[3]], MAX_NEW)[0].tokens == references[3][:MAX_NEW]
    assert all(buf[0, :, :prompts[3].numel()].abs().amax(dim=-1).gt(0).all() for buf in gen.proposer.keys)


def test_drafter_for_decoding_drafts_what_autocast_drafts(target):
    """A drafter cast once to bf16 gives bit for bit the block hidden states that its fp32 weights
    give under the bf16 autocast of drafting (the target's embedding and head bf16 in both, as in
    bf16 decoding); an fp32 dtype casts nothing."""
    from dflash.inference.proposer import drafter_for_decoding, drafter_hidden

    drafter = make_drafter(target, 4, num_layers=2)
    auto, cast = copy.deepcopy(drafter), copy.deepcopy(drafter)
    for d in (auto, cast):  # the target's modules, not the drafter's: bf16 in bf16 decoding
        d.embed_tokens.to(torch.bfloat16)
        d.lm_head.to(torch.bfloat16)
    drafter_for_decoding(cast, torch.bfloat16)
    assert {p.dtype for p in cast.parameters()} == {torch.bfloat16}
    assert torch.float32 in {p.dtype for p in auto.parameters()}
    g = torch.Generator().manual_seed(8)
    r, s = 2, 40
    feats = torch.randn(r, s, len(target.layer_ids) * target.hidden_size, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (r, s), generator=g)
    args = (ids, torch.arange(s).expand(r, s), torch.ones(r, s, dtype=torch.int32), torch.tensor([[20], [33]]),
            torch.ones(r, 1, dtype=torch.bool))
    with torch.no_grad():
        want = drafter_hidden(auto, feats, *args)
        got = drafter_hidden(cast, feats, *args)
    assert want.dtype == got.dtype == torch.bfloat16 and want.abs().max() > 0.1
    assert torch.equal(got, want)
    same = make_drafter(target, 4, num_layers=2)
    assert drafter_for_decoding(same, torch.float32) is same and {p.dtype for p in same.parameters()} == {torch.float32}


def test_a_sliding_drafter_drafts_through_the_training_forward(target, prompts, references):
    """A drafter with a sliding-attention layer is not cached (its window rule is per query): the
    decoder drafts through DFlashProposer, and decoding stays the oracle's."""
    from dflash.inference.proposer import DFlashProposer, cacheable

    cfg = DFlashConfig.from_target(target.config, DrafterConfig(num_layers=2, block_size=4,
                                                                layer_types=["sliding_attention", "full_attention"],
                                                                sliding_window=6),
                                   target_layer_ids=target.layer_ids, mask_token_id=0)
    torch.manual_seed(0)
    drafter = DFlashDraftModel(cfg, target.embed_tokens, target.lm_head, attention="sdpa").eval()
    assert not cacheable(drafter)
    gen = Generator(target.model, target.layer_ids, MAX_LEN, drafter=drafter)
    assert isinstance(gen.proposer, DFlashProposer)
    assert gen.speculative([prompts[0]], 12)[0].tokens == references[0][:12]


def test_long_context_beyond_training_length(target):
    """A 700-token prompt: the drafter still runs and decoding stays lossless."""
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, VOCAB, (700,), generator=g)
    drafter = make_drafter(target, 4, seed=4)
    res = speculative(target, drafter, prompt, 6, max_len=720)
    assert res.tokens == naive_greedy_decode(target.model, prompt, 6)


# --------------------------------------------------------------------------- the margin rule


def test_tie_bound_values():
    assert tie_bound(20.0, 30, torch.float32) == 0.0
    assert tie_bound(20.0, 30, torch.bfloat16) == pytest.approx(2 ** -8 * math.sqrt(31) * 20.0)
    assert tie_bound(-20.0, 30, torch.bfloat16) == tie_bound(20.0, 30, torch.bfloat16)
    assert tie_bound(0.1, 3, torch.bfloat16) == pytest.approx(2 ** -8 * 2.0)  # |z1| floored at 1
    assert tie_bound(20.0, 30, torch.float16) == pytest.approx(2 ** -11 * math.sqrt(31) * 20.0)
    assert tie_bound(2.8, 30, torch.bfloat16, spread=20.0) == pytest.approx(2 ** -8 * math.sqrt(31) * 20.0)
    assert tie_bound(25.0, 30, torch.bfloat16, spread=20.0) == tie_bound(25.0, 30, torch.bfloat16)
    assert tie_bound(2.8, 30, torch.float32, spread=20.0) == 0.0
    with pytest.raises(ValueError):
        tie_bound(1.0, 0, torch.bfloat16)


def _run(tokens: list[int], logits: list[list[float]], spread: bool = True) -> Generation:
    """A run whose top-2 (and, with ``spread``, spread) per token comes from constructed logits;
    checks the tokens are their argmax."""
    top2, spreads = [], []
    for tok, row in zip(tokens, logits):
        t = torch.tensor(row)
        assert int(t.argmax()) == tok
        v = t.topk(2).values.tolist()
        top2.append((v[0], v[1]))
        mean = sum(row) / len(row)
        spreads.append(max(abs(z - mean) for z in row))
    return Generation(tokens=tokens, top2=top2, spread=spreads if spread else [])


def test_margin_rule_on_constructed_logits():
    n_layers = 30
    bound = tie_bound(20.0, n_layers, torch.bfloat16)  # ≈ 0.436
    same = [[20.0, 10.0, 0.0]]
    # Identical outputs: no difference.
    assert first_difference(_run([0], same), _run([0], same), n_layers, torch.bfloat16) is None
    # A flip between two logits 0.1 apart in both runs: a tie in bf16, a failure in fp32.
    spec = _run([0, 1], same + [[1.0, 20.05, 19.95]])
    base = _run([0, 2], same + [[1.0, 19.95, 20.05]])
    d = first_difference(spec, base, n_layers, torch.bfloat16)
    assert d.position == 1 and (d.spec_token, d.target_token) == (1, 2)
    assert d.spec_margin == pytest.approx(0.1, abs=1e-5) and d.target_margin == pytest.approx(0.1, abs=1e-5)
    assert d.bound == pytest.approx(tie_bound(20.05, n_layers, torch.bfloat16)) and d.tie
    assert not first_difference(spec, base, n_layers, torch.float32).tie
    # One run had a clear winner (margin 2 > bound): not a tie.
    spec = _run([0, 1], same + [[1.0, 21.0, 19.0]])
    d = first_difference(spec, base, n_layers, torch.bfloat16)
    assert d.spec_margin == pytest.approx(2.0) and not d.tie
    # Just above / below the bound in both runs.
    for eps, tie in ((-1e-3, True), (1e-3, False)):
        m = bound + eps
        spec = _run([0, 1], same + [[0.0, 20.0, 20.0 - m]])
        base = _run([0, 2], same + [[0.0, 20.0 - m, 20.0]])
        assert first_difference(spec, base, n_layers, torch.bfloat16).tie is tie
    # Equal tokens but one run is longer: never a tie.
    d = first_difference(_run([0], same), _run([0, 0], same * 2), n_layers, torch.bfloat16)
    assert d.position == 1 and not d.tie


def test_margin_rule_ignores_a_common_shift_of_the_logits():
    """Logits shifted far below zero (top logit near 0) keep the bound of their spread: a flip with
    margins 0.17 / 0.016 (as seen in bf16 with z1 = 2.8, mean −15) is a tie, and shifting every
    logit by the same constant changes nothing while |z1| stays under the spread. Without a
    recorded spread the bound rests on |z1| and the same flip fails."""
    n_layers = 30
    tail = [-35.0, -30.0, -25.0, -20.0, -18.0, -16.0, -15.0]
    spec_row = [2.8, 2.628] + tail        # token 0 wins by 0.172
    base_row = [2.8, 2.816] + tail        # token 1 wins by 0.016
    same = [[5.0, -3.0] + tail]
    for shift in (0.0, -4.0, 3.0, 10.0):
        s = [[z + shift for z in same[0]], [z + shift for z in spec_row]]
        b = [[z + shift for z in same[0]], [z + shift for z in base_row]]
        d = first_difference(_run([0, 0], s), _run([0, 1], b), n_layers, torch.bfloat16)
        mean = sum(base_row) / len(base_row)
        spread = max(max(abs(z - mean) for z in base_row), max(abs(z - sum(spec_row) / 9) for z in spec_row))
        assert d.position == 1 and d.spread == pytest.approx(spread, rel=1e-5)
        assert d.bound == pytest.approx(2 ** -8 * math.sqrt(31) * spread, rel=1e-5) and d.tie, shift
    d = first_difference(_run([0, 0], [same[0], spec_row], spread=False),
                         _run([0, 1], [same[0], base_row], spread=False), n_layers, torch.bfloat16)
    assert d.bound == pytest.approx(tie_bound(2.816, n_layers, torch.bfloat16)) and not d.tie
    # A margin well above the spread's bound still fails.
    far = [2.8, 1.0] + tail
    d = first_difference(_run([0, 0], [same[0], far]), _run([0, 1], [same[0], base_row]), n_layers, torch.bfloat16)
    assert d.spec_margin == pytest.approx(1.8, rel=1e-5) and not d.tie


# --------------------------------------------------------------------------- offline τ


def test_offline_tau_equals_a_slow_per_anchor_loop(target, trained_drafter, greedy_rows):
    convs = [(greedy_rows["input_ids"][i], greedy_rows["loss_mask"][i]) for i in range(3)]
    # Make the third one two turns: loss off in the middle (the first turn ends at 30).
    mask2 = convs[2][1].clone()
    mask2[30:36] = False
    convs[2] = (convs[2][0], mask2)
    got = offline_tau(target, trained_drafter, convs, anchors_per_chunk=7)

    b = trained_drafter.block_size
    taus, first_taus, per_conv = [], [], []
    for c, (ids, mask) in enumerate(convs):
        s = ids.numel()
        pos, doc = torch.arange(s)[None], torch.ones(1, s, dtype=torch.int32)
        feats, tokens = target.forward_features(ids[None], pos, doc)
        conv = []
        for a in range(s - 1):
            if not (mask[a] and mask[a + 1]):
                continue
            with torch.no_grad():
                hidden = trained_drafter(feats, ids[None], pos, doc, torch.tensor([[a]]), torch.tensor([[True]]))
                pred = trained_drafter.lm_head(hidden[0, 0]).argmax(-1)
            tau = 1
            for k in range(1, b):
                if a + k >= s or not mask[a + k] or int(pred[k]) != int(tokens[0, a + k - 1]):
                    break
                tau += 1
            conv.append(tau)
            if a < (30 if c == 2 else s):
                first_taus.append(tau)
        taus += conv
        per_conv.append(sum(conv) / len(conv))
    assert got.blocks == len(taus) and got.first_turn_blocks == len(first_taus)
    assert got.tau == pytest.approx(sum(taus) / len(taus), abs=1e-6)
    assert got.first_turn_tau == pytest.approx(sum(first_taus) / len(first_taus), abs=1e-6)
    assert got.per_conversation == pytest.approx(per_conv, abs=1e-6)
    assert got.tau > 1.5  # the drafter is right often on its training rows: not a trivial τ = 1


def test_offline_replay_at_decodings_anchors_equals_measured_tau(target, prompts, trained_drafter):
    """In fp32 the offline τ at exactly the anchors decoding visited, on the decoded text, is the
    measured τ (block for block): training's forward and decoding see the same thing."""
    for prompt in prompts[:3]:
        res = speculative(target, trained_drafter, prompt, MAX_NEW)
        p = prompt.numel()
        ids = torch.cat([prompt, torch.tensor(res.tokens)])
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[p:] = True
        # The last pass may reach past the decoded text (offline cannot score it): drop it.
        got = offline_tau(target, trained_drafter, [(ids, mask)], anchors=[res.anchors[:-1]])
        want = res.accepted[:-1]
        assert got.blocks == len(want)
        assert got.tau == pytest.approx(sum(want) / len(want), abs=1e-6)
        assert got.per_position == pytest.approx(measured_per_position(want, trained_drafter.block_size))


def _naive_walk(tau: dict[int, int], start: int, end: int) -> tuple[list[int], list[int]]:
    """Decoding token by token: scan every position of the text; a pass runs where the next anchor
    is and the text is not finished (the pass that emits ``end`` is the last)."""
    anchors, accepted = [], []
    nxt = start
    for p in range(start, end):
        if p == nxt:
            anchors.append(p)
            accepted.append(tau[p])
            nxt = p + tau[p]
    return anchors, accepted


@pytest.mark.parametrize("seed", range(6))
def test_walk_tau_equals_a_naive_scan(seed):
    g = random.Random(seed)
    for _ in range(50):
        b = g.randint(2, 16)
        start = g.randint(0, 40)
        end = start + g.randint(-2, 120)  # end < start: no new token; end == start: one, no pass
        lo, hi = max(0, start - 5), max(start, end) + b + 5  # anchors outside the walk too
        positions = list(range(lo, hi))
        g.shuffle(positions)
        tau = {p: g.randint(1, b) for p in positions}
        walk = walk_tau(torch.tensor(positions), torch.tensor([tau[p] for p in positions]), start, end)
        want_anchors, want_accepted = _naive_walk(tau, start, end)
        assert walk.anchors == want_anchors and walk.accepted == want_accepted
        assert walk.passes == len(want_anchors) and walk.total == sum(want_accepted)
        if want_anchors:
            assert walk.tau == pytest.approx(sum(want_accepted) / len(want_accepted))
            assert want_anchors[-1] < end <= want_anchors[-1] + want_accepted[-1]  # the last pass emits `end`
        else:
            assert math.isnan(walk.tau) and end <= start
    # Float τ (as acceptance_lengths gives it) and a hand-checked walk: 5 → 7 → 8 → 11, end at 12.
    walk = walk_tau(torch.arange(5, 13), torch.tensor([2., 4, 1, 3, 1, 1, 1, 2]), 5, 12)
    assert walk.anchors == [5, 7, 8, 11] and walk.accepted == [2, 1, 3, 1] and walk.tau == 1.75


def test_walk_tau_bad_inputs():
    with pytest.raises(ValueError, match="lands on position 7"):
        walk_tau(torch.tensor([5, 6]), torch.tensor([2, 1]), 5, 9)
    with pytest.raises(ValueError, match="must be >= 1"):
        walk_tau(torch.tensor([5, 6]), torch.tensor([0, 1]), 5, 9)
    with pytest.raises(ValueError, match="1-D tensors"):
        walk_tau(torch.tensor([5, 6]), torch.tensor([1]), 5, 9)


def _own_text(prompt: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([prompt, torch.tensor(tokens, dtype=torch.long)])
    mask = torch.zeros(ids.numel(), dtype=torch.bool)
    mask[prompt.numel():] = True
    return ids, mask


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_offline_walk_on_own_text_is_decodings_walk(target, prompts, references, trained_drafter, block_size):
    """fp32: the walk over the target's own greedy text, each block accepting its offline τ, visits
    decoding's anchors and accepts decoding's counts pass for pass, with and without a stop token.
    Scored on the text ``B − 1`` tokens past its end it is exact; on the text alone only the last
    pass differs, by the drafts decoding accepted past the end (``min(m + 1, 1 + end − a)``)."""
    drafter = copy.deepcopy(trained_drafter)
    drafter.block_size = block_size  # trained at B = 4: right often enough at B = 2 and 8 too
    nontrivial = 0
    for prompt, ref in zip(prompts[:3], references[:3]):
        p = prompt.numel()
        for stops in ((), (_first_from(ref, 15),)):
            res = speculative(target, drafter, prompt, MAX_NEW, stops)
            assert res.tokens == _cut(ref, set(stops), MAX_NEW)
            end = p + len(res.tokens) - 1
            past = offline_tau(target, drafter, [_own_text(prompt, ref)])  # the greedy text, no stop
            walk = walk_tau(*past.per_anchor[0], p, end)
            assert walk.anchors == res.anchors and walk.accepted == res.accepted
            assert walk.tau == res.tau
            own = offline_tau(target, drafter, [_own_text(prompt, res.tokens)])
            cut = walk_tau(*own.per_anchor[0], p, end)
            assert cut.anchors == res.anchors
            assert cut.accepted == [min(m, 1 + end - a) for a, m in zip(res.anchors, res.accepted)]
            assert cut.accepted[:-1] == res.accepted[:-1]
            nontrivial += sum(m > 1 for m in res.accepted)
    assert nontrivial >= 5  # the drafter is right now and then: not a walk of τ = 1 steps


def test_decode_report_walked_tau_is_the_measured_tau(target, prompts, references, trained_drafter, greedy_rows):
    """The decoding report's walk over each prompt's target-only text (its last block re-scored
    past the text's end) predicts decoding's anchors and τ exactly in fp32, stop token or not."""
    from dflash.inference.prompts import PromptCase
    from dflash.inference.spec_report import decode_report, format_report

    cases = [PromptCase(i, i, prompt, greedy_rows["input_ids"][i], greedy_rows["loss_mask"][i])
             for i, prompt in enumerate(prompts[:3])]
    for block_size, stops in ((4, ()), (8, (_first_from(references[1], 15),))):
        drafter = copy.deepcopy(trained_drafter)
        drafter.block_size = block_size
        report = decode_report(target, drafter, cases, max_new_tokens=MAX_NEW, stop_ids=stops, compile=False)
        s, rows = report["summary"], report["prompts"]
        assert s["identical"] == len(cases)
        for row in rows:
            assert row["offline_walk_anchors"] == row["anchors"] and row["offline_walk_steps"] == row["steps"]
            assert row["offline_tau_own_walk"] == pytest.approx(row["tau"], abs=1e-12)
        assert s["offline_walk_steps"] == s["verification_steps"]
        assert s["offline_tau_own_walk"] == pytest.approx(s["tau"], abs=1e-12)
        assert s["measured_over_offline_walk"] == pytest.approx(1.0, abs=1e-12)
        # per response (the reference benchmark's average): each prompt's τ, then the plain mean
        for key, row_key in (("tau_per_response", "tau"), ("offline_tau_own_per_response", "offline_tau_own"),
                             ("offline_tau_own_walk_per_response", "offline_tau_own_walk")):
            total = 0.0
            for row in rows:
                total += row[row_key]
            assert s[key] == pytest.approx(total / len(rows), abs=1e-12)
        assert s["offline_tau_own_walk_per_response"] == pytest.approx(s["tau_per_response"], abs=1e-12)
        assert s["measured_over_offline_own_per_response"] == pytest.approx(
            s["tau_per_response"] / s["offline_tau_own_per_response"], abs=1e-12)
        text = format_report(report)
        assert "walked" in text and f"{s['offline_tau_own_walk']:.3f}" in text
        assert "per response" in text and f"{s['tau_per_response']:.3f}" in text
        # training's evaluation beside decoding: its walked heads, and its acceptance per position
        s.update(training_eval_step=7, offline_tau_training_eval=2.5, offline_tau_training_eval_head=2.25,
                 offline_tau_training_eval_walk=2.0, offline_tau_training_eval_walk_head=1.75,
                 per_position_training_eval=[0.625])
        text = format_report(report)
        assert "(step 7): every anchor 2.500, response heads 2.250, walked 2.000, walked over the heads 1.750" in text
        assert f"measured / walked heads = {s['tau'] / 1.75:.3f}" in text
        table = text[text.index("acceptance per block position"):].splitlines()
        assert table[1].split()[-2:] == ["training", "acc"] and "eval/acc_block_pos_k" in table[0]
        assert table[2].split()[-1] == "0.625" and table[3].split()[-1] == "–"
        assert len(table) == 2 + block_size - 1


def test_decode_report_drafts_the_same_with_and_without_the_draft_cache(target, prompts, references,
                                                                      trained_drafter):
    """decode_report with the drafter's context cache and with its training forward (``draft_cache
    =False``, decode_bench's ``--draft-cache off``): the same outputs, passes and accepted counts; the
    summary and the text name the way each drafted."""
    from dflash.inference.prompts import PromptCase
    from dflash.inference.spec_report import decode_report, format_report

    cases = []
    for i in (0, 3):
        ids = torch.cat([prompts[i], torch.tensor(references[i][:MAX_NEW])])
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[prompts[i].numel():] = True
        cases.append(PromptCase(i, i, prompts[i], ids, mask))
    reports = {cached: decode_report(target, trained_drafter, cases, max_new_tokens=MAX_NEW, stop_ids=(),
                                     compile=False, offline=False, draft_cache=cached) for cached in (True, False)}
    assert [reports[c]["summary"]["drafting"] for c in (True, False)] == ["CachedDFlashProposer", "DFlashProposer"]
    assert "drafting CachedDFlashProposer" in format_report(reports[True])
    for key in ("steps", "accepted", "anchors"):
        assert [r[key] for r in reports[True]["prompts"]] == [r[key] for r in reports[False]["prompts"]]
    assert sum(r["steps"] for r in reports[True]["prompts"]) >= 10


def test_decode_report_survives_a_one_token_response(target, prompts, references, trained_drafter, monkeypatch):
    """A response that stops at its first token (the prefill's) has no verification pass and no
    anchor: its τ values are NaN, left out of the per-response means, and nothing crashes
    (offline τ of a sequence without anchors, the text report, decode_bench's table)."""
    from pathlib import Path

    from dflash.inference.prompts import PromptCase
    from dflash.inference.spec_report import decode_report, format_report

    stop = references[0][0]
    cases = []
    for i, prompt in enumerate(prompts[:2]):
        ids = torch.cat([prompt, torch.tensor(references[i][:MAX_NEW])])
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[prompt.numel():] = True
        cases.append(PromptCase(i, i, prompt, ids, mask))
    report = decode_report(target, trained_drafter, cases, max_new_tokens=MAX_NEW, stop_ids=[stop], compile=False,
                           repeats=3)
    s, rows = report["summary"], report["prompts"]
    assert s["repeats"] == 3 and s["repeat_differences"] == {"greedy": 0, "speculative": 0}
    assert rows[0]["new_tokens"] == 1 and rows[0]["steps"] == 0 and rows[0]["result"] == "identical"
    assert math.isnan(rows[0]["tau"]) and math.isnan(rows[0]["offline_tau_own"])
    assert rows[1]["steps"] > 0
    for key, row_key in (("tau_per_response", "tau"), ("offline_tau_own_per_response", "offline_tau_own")):
        kept = [r[row_key] for r in rows if not math.isnan(r[row_key])]
        assert len(kept) == 1 and s[key] == pytest.approx(kept[0], abs=1e-12)
    text = format_report(report)
    assert "nan" not in text and "the median of 3 runs" in text
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "scripts"))
    import decode_bench

    s["warmup_s"] = 1.5
    assert "nan" not in decode_bench.table([report])
    per_set = decode_bench.set_table([report])
    assert "nan" not in per_set and "a pass, ms" in per_set


@pytest.mark.parametrize("repeats", [1, 2, 3, 4, 5])
def test_repeated_decoding_keeps_the_median_run_of_each_batch(monkeypatch, repeats):
    """Per batch and way, the run kept is the one whose decoding time is the median (the lower middle
    for an even count), against a naive sort of random times; differing tokens are counted."""
    import random

    from dflash.inference import spec_report

    rng = random.Random(repeats)
    groups = [[0, 1], [2], [3, 4, 5]]
    runs = []
    for k in range(repeats):
        both = []
        for method in ("greedy", "speculative"):
            out = []
            for grp in groups:
                t = rng.uniform(0.1, 1.0)  # a batch's rows share its time
                for i in grp:
                    tokens = [i, k] if method == "speculative" and i == 4 and k > 0 else [i]
                    out.append(Generation(tokens=tokens, decode_seconds=t, seconds=t + 0.01))
            both.append(out)
        runs.append((both[0], both[1], groups))
    calls = iter(runs)
    monkeypatch.setattr(spec_report, "_decode_both", lambda *a, **k: next(calls))
    base, spec, got_groups, differing = spec_report._decode_repeated({}, [], [None] * 6, 8, [], 3, repeats)
    assert got_groups == groups
    assert differing == {"greedy": 0, "speculative": repeats - 1}
    for m, picked in enumerate((base, spec)):
        for grp in groups:
            times = sorted(runs[k][m][grp[0]].decode_seconds for k in range(repeats))
            want = times[(repeats - 1) // 2]
            assert all(picked[i].decode_seconds == want for i in grp)
            k = next(k for k in range(repeats) if runs[k][m][grp[0]].decode_seconds == want)
            assert all(picked[i] is runs[k][m][i] for i in grp)


def test_length_buckets_round_up_and_stay_few():
    from dflash.inference.spec_report import length_buckets

    g = torch.Generator().manual_seed(4)
    for _ in range(50):
        lengths = torch.randint(1, 3000, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        bucket, most = int(torch.randint(1, 300, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        out = length_buckets(lengths, bucket, most)
        step = bucket
        while len({-(-n // step) * step for n in lengths}) > most:  # the naive doubling search
            step *= 2
        assert out == [-(-n // step) * step for n in lengths]
        assert all(o >= n for o, n in zip(out, lengths)) and len(set(out)) <= most
    assert length_buckets([5, 300, 40], 0) == [300, 300, 300]
    assert length_buckets([], 256) == []
    with pytest.raises(ValueError, match="length bucket"):
        length_buckets([5], -1)


def test_compiled_decoding_defaults_to_one_decoder():
    """Every compiled decoder compiles its own steps: one by default; eager decoders are bucketed."""
    from dflash.inference.spec_report import LENGTH_BUCKET, default_length_bucket, length_buckets

    assert default_length_bucket(True) == 0 and default_length_bucket(False) == LENGTH_BUCKET
    lengths = [120, 700, 1500, 1800]
    assert len(set(length_buckets(lengths, default_length_bucket(True)))) == 1
    assert len(set(length_buckets(lengths, default_length_bucket(False)))) == 4


@pytest.mark.parametrize("batch", [1, 2])
def test_decode_report_length_buckets_decode_like_one_decoder(target, prompts, references, trained_drafter,
                                                              greedy_rows, batch):
    """Prompts of 8, 8, 1 and 150 tokens in decoders per length bucket: the same tokens, passes and
    τ as one decoder sized for the longest, in the cases' order, and the greedy references."""
    from dflash.inference.prompts import PromptCase
    from dflash.inference.spec_report import decode_report

    cases = [PromptCase(i, i, prompt, greedy_rows["input_ids"][i], greedy_rows["loss_mask"][i])
             for i, prompt in enumerate(prompts[:4])]
    runs = {lb: decode_report(target, trained_drafter, cases, max_new_tokens=MAX_NEW, stop_ids=(), batch=batch,
                              compile=False, offline=False, length_bucket=lb) for lb in (0, 32)}
    assert len(runs[0]["summary"]["decoder_lengths"]) == 1 and len(runs[32]["summary"]["decoder_lengths"]) == 2
    for one, many, ref in zip(runs[0]["prompts"], runs[32]["prompts"], references):
        assert one["target_tokens"] == many["target_tokens"] == ref[:MAX_NEW]
        assert (one["anchors"], one["accepted"]) == (many["anchors"], many["accepted"])
        assert many["result"] == "identical"
    assert runs[32]["summary"]["tau"] == runs[0]["summary"]["tau"] > 1


@pytest.mark.parametrize("block_size", [4, 8])
def test_training_eval_walk_is_decodings_tau(target, prompts, references, trained_drafter, block_size):
    """Held-out conversations whose responses are the target's own greedy continuations, packed
    two and more to a row: training's evaluation (labels from the target) walks decoding's anchors.
    ``eval/tau_walk_head`` over the first ``H`` response tokens, scored on text ``B − 1`` tokens
    longer, is decoding τ of ``H`` new tokens exactly (Σ τ and passes, pooled over prompts);
    ``eval/tau_walk`` over whole responses has decoding's passes for the response's length and the
    same Σ τ but in each prompt's last pass, which counts only the tokens up to the response's end."""
    from dflash.training.evaluation import WalkSums

    head_tokens, n = MAX_NEW, MAX_NEW + MAX_B
    drafter = copy.deepcopy(trained_drafter)
    drafter.block_size = block_size
    rows = [[0, 1, 2], [3]]  # prompts of 8, 8, 1 tokens in one row; the 150-token prompt alone
    s = max(sum(prompts[i].numel() + n for i in row) for row in rows) + 3  # and some padding
    ids = torch.zeros(len(rows), s, dtype=torch.long)
    pos = torch.zeros(len(rows), s, dtype=torch.long)
    doc = torch.zeros(len(rows), s, dtype=torch.int32)
    mask = torch.zeros(len(rows), s, dtype=torch.bool)
    for r, row in enumerate(rows):
        p = 0
        for d, i in enumerate(row, start=1):
            conv = torch.cat([prompts[i], torch.tensor(references[i][:n])])
            ids[r, p:p + conv.numel()] = conv
            pos[r, p:p + conv.numel()] = torch.arange(conv.numel())
            doc[r, p:p + conv.numel()] = d
            mask[r, p + prompts[i].numel():p + conv.numel()] = True
            p += conv.numel()
    feats, tokens = target.forward_features(ids, pos, doc)
    batch = dict(input_ids=ids, position_ids=pos, doc_ids=doc, loss_mask=mask, features=feats, target_tokens=tokens)
    trainer = DrafterTrainer(drafter, TrainConfig(eval_head_tokens=head_tokens),
                             DrafterConfig(num_layers=1, block_size=block_size, anchors_per_row=16), 1, "cpu")
    out = trainer.evaluate(batch, 0)

    head, whole = WalkSums(), WalkSums()
    for i, prompt in enumerate(prompts):
        p = prompt.numel()
        short = speculative(target, drafter, prompt, head_tokens)
        assert short.tokens == references[i][:head_tokens]
        head = WalkSums(head.tau_sum + sum(short.accepted), head.blocks + len(short.accepted))
        full = speculative(target, drafter, prompt, n)
        assert full.tokens == references[i][:n]
        end = p + n - 1  # the response's last token: past it, block positions are not scored
        cut = full.accepted[:-1] + [min(full.accepted[-1], 1 + end - full.anchors[-1])]
        whole = WalkSums(whole.tau_sum + sum(cut), whole.blocks + len(cut))
    assert (out.walk_head_tau_sum.item(), out.walk_head_blocks.item()) == (head.tau_sum, head.blocks)
    assert out.tau_walk_head.item() == pytest.approx(head.tau_sum / head.blocks, abs=1e-6)
    assert (out.walk_tau_sum.item(), out.walk_blocks.item()) == (whole.tau_sum, whole.blocks)
    assert head.tau_sum > 1.3 * head.blocks  # the drafter is right often: not a walk of τ = 1 steps
    assert out.tau.item() != pytest.approx(out.tau_walk.item(), abs=1e-3)  # the walk is not the anchor mean


# --------------------------------------------------------------------------- prompts, checkpoints


def test_prompts_from_corpus_are_the_tokens_before_the_first_assistant_token():
    import numpy as np

    from dflash.data.corpus import TokenizedCorpus

    convs = [([5, 6, 7, 8, 9], [0, 0, 1, 1, 0]), ([1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 0, 1, 1]),
             ([4, 4, 4], [1, 1, 1]), ([9, 8, 7, 6], [0, 1, 1, 1])]
    tokens = np.concatenate([np.asarray(t, dtype=np.int32) for t, _ in convs])
    mask = np.concatenate([np.asarray(m, dtype=np.uint8) for _, m in convs])
    offsets = np.cumsum([0] + [len(t) for t, _ in convs]).astype(np.int64)
    corpus = TokenizedCorpus(tokens, mask, offsets, source_rows=np.array([10, 11, 12, 13]))
    got = prompts_from_corpus(corpus, 5)
    assert [c.index for c in got] == [0, 1, 3]  # item 2 has no prompt
    assert [c.prompt_ids.tolist() for c in got] == [[5, 6], [1, 2, 3, 4, 5], [9]]
    assert [c.source_row for c in got] == [10, 11, 13]
    short = prompts_from_corpus(corpus, 2, max_prompt_tokens=2)
    assert [c.index for c in short] == [0, 3]
    assert short[0].input_ids.tolist() == [5, 6, 7, 8, 9] and short[0].loss_mask.tolist() == [0, 0, 1, 1, 0]


def test_resolve_checkpoint(tmp_path):
    ckpt = tmp_path / "runs" / "r" / "checkpoints" / "step-00000300"
    (ckpt / "drafter").mkdir(parents=True)
    (ckpt / "drafter" / "config.json").write_text("{}")
    assert resolve_checkpoint(ckpt) == (ckpt / "drafter", tmp_path / "runs" / "r")
    assert resolve_checkpoint(ckpt / "drafter") == (ckpt / "drafter", tmp_path / "runs" / "r")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):  # a run with none yet
        resolve_checkpoint(tmp_path / "runs" / "r")
    (ckpt / "state.json").write_text('{"step": 300}')
    older = ckpt.parent / "step-00000100"
    (older / "drafter").mkdir(parents=True)
    (older / "drafter" / "config.json").write_text("{}")
    (older / "state.json").write_text('{"step": 100}')
    assert resolve_checkpoint(tmp_path / "runs" / "r") == (ckpt / "drafter", tmp_path / "runs" / "r")  # the newest
    with pytest.raises(FileNotFoundError, match="neither a checkpoint"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such run, checkpoint or drafter directory"):
        resolve_checkpoint(tmp_path / "runs" / "nope")


def test_cli_bad_input_fails_before_any_model_loads(target, tmp_path, monkeypatch, capsys, caplog):
    """Bad arguments exit 2 at parse time; a damaged drafter (corrupt config.json, truncated
    weights) exits 2 before the target loads; an unexpected error exits 3 (not 1, the lossless
    check's failure), an interruption 130."""
    from dflash.inference import speculative
    from dflash.models import target_loader

    def no_target(*args, **kwargs):
        raise AssertionError("the target must not load")

    monkeypatch.setattr(target_loader, "load_target", no_target)
    cfg = "configs/smollm2-135m-cpu.yaml"
    ckpt = tmp_path / "step-00000001"
    (ckpt / "drafter").mkdir(parents=True)
    for argv, msg in ((["--json", str(tmp_path / "no" / "dir" / "r.json")], "does not exist"),
                      (["--threads", "-1"], "--threads: must be >= 1"),
                      (["--max-prompt-tokens", "0"], "--max-prompt-tokens: must be >= 1"),
                      (["--device", "tpu"], "--device tpu")):
        with pytest.raises(SystemExit) as exc:
            speculative.main(["--checkpoint", str(ckpt), "--config", cfg, *argv])
        assert exc.value.code == 2 and msg in capsys.readouterr().err
    (ckpt / "drafter" / "config.json").write_text('{"model_type": ')  # cut mid-write
    assert speculative.main(["--checkpoint", str(ckpt), "--config", cfg]) == 2
    drafter = make_drafter(target, 4, seed=1)
    drafter.save_pretrained(ckpt / "drafter")
    weights = ckpt / "drafter" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert speculative.main(["--checkpoint", str(ckpt), "--config", cfg]) == 2
    assert "not a complete safetensors file" in caplog.text

    def boom(args):
        raise RuntimeError("unexpected")

    monkeypatch.setattr(speculative, "_run", boom)
    assert speculative.main(["--checkpoint", str(ckpt), "--config", cfg]) == 3

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(speculative, "_run", interrupted)
    assert speculative.main(["--checkpoint", str(ckpt), "--config", cfg]) == 130


def test_training_eval_tau_of_the_checkpoint_step(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000150" / "drafter").mkdir(parents=True)
    (run / "checkpoints" / "step-00000150" / "state.json").write_text('{"step": 150, "epoch": 0}')
    lines = ['{"step": 0, "eval/tau": 1.0}', '{"step": 50, "train/tau": 1.5}', "not json",
             '{"step": 100, "eval/tau": 1.25}',
             '{"step": 200, "eval/tau": 1.75, "eval/tau_head": 1.5, "eval/tau_walk": 1.4, "eval/tau_walk_head": 1.3, '
             '"eval/acc_block_pos_1": 0.5, "eval/acc_block_pos_2": 0.25, "eval/acc_block_pos_4": 0.1}']
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    drafter = run / "checkpoints" / "step-00000150" / "drafter"
    step = checkpoint_step(drafter)
    assert step == 150
    assert last_eval_tau(run, max_step=step) == (100, 1.25, None, None, None, ())
    # positions are read while consecutive (k = 3 is missing: k = 4 is not taken)
    assert last_eval_tau(run) == (200, 1.75, 1.5, 1.4, 1.3, (0.5, 0.25))
    assert last_eval_tau(tmp_path / "none") is None and last_eval_tau(None) is None
    assert checkpoint_step(tmp_path) is None
    assert training_eval_summary(drafter, run) == {
        "checkpoint_step": 150, "training_eval_step": 100, "offline_tau_training_eval": 1.25,
        "offline_tau_training_eval_head": None, "offline_tau_training_eval_walk": None,
        "offline_tau_training_eval_walk_head": None, "per_position_training_eval": []}
    (run / "checkpoints" / "step-00000150" / "state.json").write_text('{"step": 250, "epoch": 1}')
    summary = training_eval_summary(drafter, run)
    assert summary["training_eval_step"] == 200 and summary["offline_tau_training_eval_walk_head"] == 1.3
    assert summary["per_position_training_eval"] == [0.5, 0.25]
    assert training_eval_summary(drafter, None)["offline_tau_training_eval"] is None


# --------------------------------------------------------------------------- real SmolLM2


@pytest.mark.slow
def test_smollm2_heldout_prompts_lossless_and_cli(tmp_path, capsys):
    """Real SmolLM2 target, a fresh drafter saved as a pipeline checkpoint, two held-out prompts."""
    from dflash.training.checkpoint import save_checkpoint
    from dflash.config import load_config
    from dflash.data.conversations import normalize_row
    from dflash.data.corpus import prepare_data
    from dflash.data.sources import read_rows
    from dflash.training.factory import build_drafter
    from dflash.data.render import stop_token_ids
    from dflash.inference.speculative import main
    from dflash.data.tokenizer import load_tokenizer

    cfg = load_config("configs/smollm2-135m-cpu.yaml")
    target = load_target(cfg.target, "cpu", num_drafter_layers=cfg.drafter.num_layers)
    tok = load_tokenizer(cfg.target)
    heldout = prepare_data(cfg, tok).heldout
    cases = prompts_from_corpus(heldout, 2, 96, tokenizer=tok)
    assert len(cases) == 2
    # The prompt is what the chat template renders for the first user turn(s) with a generation prompt.
    rows = list(read_rows(cfg.data.dataset, limit=max(c.source_row for c in cases) + 1))
    messages, _ = normalize_row(rows[cases[0].source_row])
    first_assistant = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    assert any(m["role"] == "user" for m in messages[:first_assistant])
    text = tok.apply_chat_template(messages[:first_assistant], add_generation_prompt=True, tokenize=False)
    assert cases[0].prompt_ids.tolist() == tok(text, add_special_tokens=False)["input_ids"]
    # Every prompt ends a real user turn; assistant-first conversations are skipped.
    for case in prompts_from_corpus(heldout, 32, 192, tokenizer=tok):
        assert "<|im_start|>user\n" in tok.decode(case.prompt_ids.tolist())
    # The reader drops leading non-user turns, so without the template check too no prompt is
    # the default system prompt alone.
    assert all("<|im_start|>user\n" in tok.decode(c.prompt_ids.tolist())
               for c in prompts_from_corpus(heldout, 32, 192))

    drafter = build_drafter(cfg, target.embed_tokens, target.lm_head, len(tok), torch.device("cpu"), target.config)
    stops = stop_token_ids(tok, target.model)
    assert tok.convert_tokens_to_ids("<|im_end|>") in stops
    gen = Generator(target.model, target.layer_ids, 128, drafter=drafter)
    for case in cases:
        want = gen.greedy([case.prompt_ids], 16, stops)[0].tokens
        got = gen.speculative([case.prompt_ids], 16, stops)[0].tokens
        assert got == want and len(want) >= 2

    ckpt = save_checkpoint(tmp_path / "run", 1, 0, drafter, {})
    code = main(["--checkpoint", str(ckpt), "--config", "configs/smollm2-135m-cpu.yaml", "--prompts", "2",
                 "--max-new-tokens", "12", "--json", str(tmp_path / "report.json")])
    out = capsys.readouterr().out
    assert code == 0 and "outputs: 2 identical, 0 differ at a numerical tie, 0 FAIL (of 2)" in out
    import json

    summary = json.loads((tmp_path / "report.json").read_text())["summary"]
    assert summary["identical"] == 2 and summary["tau"] >= 1.0
    assert summary["offline_tau_dataset"] >= 1.0 and summary["offline_tau_own"] >= 1.0
    assert summary["offline_tau_replay"] >= 1.0 and len(summary["per_position_measured"]) == cfg.drafter.block_size - 1
    assert summary["offline_tau_own_walk"] >= 1.0 and summary["offline_walk_steps"] >= 1

    # A checkpoint trained with another chat template is refused before decoding (exit 2).
    state_file = ckpt / "state.json"
    state = json.loads(state_file.read_text())
    state["trained_with"] = {"chat_template.sha256": "0" * 64}
    state_file.write_text(json.dumps(state))
    code = main(["--checkpoint", str(ckpt), "--config", "configs/smollm2-135m-cpu.yaml", "--prompts", "1",
                 "--max-new-tokens", "2"])
    assert code == 2


def test_step_functions_trace_whole_and_decode_like_eager(target):
    """What CUDA graphs need, checked on CPU: each step function traces into one graph (fullgraph,
    so no eager op runs between graph replays), its functionalised graph (``aot_eager``) decodes
    exactly like eager, stop tokens included, and later calls (other prompts, stop lists,
    ``sync_every``, a partial batch) reuse it without recompiling."""
    import torch._dynamo

    drafter = make_drafter(target, 4, seed=2)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (3, 17)]
    ref = naive_greedy_decode(target.model, prompts[1], 16)
    stop = [_first_from(ref, 6)]
    outs = {}
    torch._dynamo.reset()
    try:
        for traced in (False, True):
            gen = Generator(target.model, target.layer_ids, 128, batch_size=2, drafter=drafter)
            if traced:
                for name in ("_greedy_step", "_draft_step", "_verify_step"):
                    fn = getattr(gen, name + "_impl")
                    setattr(gen, name, torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=False))
                gen.compiled = True  # the draft reads the whole static buffer, as on CUDA
            outs[traced] = gen.greedy(prompts, 16, stop) + gen.speculative(prompts, 16, stop)
        with torch._dynamo.config.patch(error_on_recompile=True):
            other = [torch.randint(0, VOCAB, (n,), generator=g) for n in (40, 5)]
            gen.greedy(other, 10, [1, 2, 3])
            gen.sync_every = 1
            gen.speculative(other[:1], 10)
    finally:
        torch._dynamo.reset()
    for got, want in zip(outs[True], outs[False]):
        assert (got.tokens, got.accepted, got.anchors) == (want.tokens, want.accepted, want.anchors)
        torch.testing.assert_close(torch.tensor(got.top2), torch.tensor(want.top2), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.tensor(got.spread), torch.tensor(want.spread), atol=1e-5, rtol=1e-5)
    assert outs[False][1].tokens == _cut(ref, set(stop), 16) and len(outs[False][1].tokens) < 16


def test_compiled_prefill_traces_once_for_every_width(target):
    """The prefill forward under ``torch.compile(dynamic=True)`` (its functionalised graph,
    ``aot_eager``, on CPU) decodes like the eager prefill for prompts of many widths and row
    counts, without recompiling after the first two calls (sizes 1 and >1 are specialised)."""
    import torch._dynamo

    drafter = make_drafter(target, 4, seed=2)
    g = torch.Generator().manual_seed(8)
    sets = [[torch.randint(0, VOCAB, (n,), generator=g) for n in lens] for lens in
            ((3, 17), (9,), (40, 5), (2, 33), (21,), (11, 12))]
    torch._dynamo.reset()
    try:
        eager = Generator(target.model, target.layer_ids, 128, batch_size=2, drafter=drafter)
        traced = Generator(target.model, target.layer_ids, 128, batch_size=2, drafter=drafter)
        traced.compile_prefill(backend="aot_eager")
        for i, prompts in enumerate(sets):
            with torch._dynamo.config.patch(error_on_recompile=i >= 2):
                got = traced.greedy(prompts, 6) + traced.speculative(prompts, 6)
            want = eager.greedy(prompts, 6) + eager.speculative(prompts, 6)
            for a, b in zip(got, want):
                assert (a.tokens, a.accepted, a.anchors) == (b.tokens, b.accepted, b.anchors)
                torch.testing.assert_close(torch.tensor(a.top2), torch.tensor(b.top2), atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(torch.tensor(a.spread), torch.tensor(b.spread), atol=1e-5, rtol=1e-5)
        assert traced._prefill_forward is not traced.forward  # compiled, not fallen back
    finally:
        torch._dynamo.reset()


def test_compiled_prefill_falls_back_to_eager(target, caplog):
    """A prefill that cannot compile runs eagerly, with a warning, and decodes the same tokens."""
    drafter = make_drafter(target, 4, seed=2)
    prompts = [torch.arange(1, 9), torch.arange(3, 20)]
    want = Generator(target.model, target.layer_ids, 64, batch_size=2, drafter=drafter).greedy(prompts, 5)
    gen = Generator(target.model, target.layer_ids, 64, batch_size=2, drafter=drafter)
    def broken(gm, example_inputs):
        raise RuntimeError("this lowering is not supported")

    gen.compile_prefill(backend=broken)
    with caplog.at_level("WARNING"):
        got = gen.greedy(prompts, 5)
    assert [a.tokens for a in got] == [b.tokens for b in want]
    assert "prefill runs eagerly" in caplog.text and gen._prefill_forward == gen.forward


class _Recorder:
    """A stand-in for :func:`dflash.inference.decode_steps.cuda_graph_capture` on CPU: recording
    runs nothing (as a CUDA graph capture launches no kernel) and the replay calls the step."""

    def __init__(self) -> None:
        self.recorded: list[tuple] = []

    def __call__(self, fn, args):
        self.recorded.append(args)
        return lambda: fn(*args)


def test_captured_step_warms_up_records_once_and_replays():
    """CapturedStep: the first ``warmup`` calls per (args, layout) run the step, the next records it
    without running it and replays it once, later calls replay; a new layout or new arguments warm
    up and record again; every call is one real step."""
    from dflash.inference.decode_steps import CapturedStep

    ran: list[tuple] = []
    layout = {"buffers": 1}
    rec = _Recorder()
    step = CapturedStep(lambda *a: ran.append(a), lambda: layout["buffers"], rec, warmup=2)
    for _ in range(5):
        step()
    assert ran == [()] * 5 and rec.recorded == [()] and step.recordings == 1
    step(7)
    assert ran[-1] == (7,) and step.recordings == 1  # new args: warming up
    layout["buffers"] = 2
    for _ in range(4):
        step()
    assert ran == [()] * 5 + [(7,)] + [()] * 4 and rec.recorded == [(), ()] and step.recordings == 2
    with pytest.raises(ValueError, match="warmup"):
        CapturedStep(lambda: None, lambda: 0, rec, warmup=0)


def test_warm_up_runs_until_every_captured_step_recorded(target):
    """Generator.warm_up: ``rounds`` rounds when nothing is to record (eager), one more round at a
    time while a captured step has not recorded (stood in for on CPU), at most WARMUP_ROUNDS."""
    from dflash.inference.decode_steps import CapturedStep
    from dflash.inference.generation import WARMUP_ROUNDS

    drafter = make_drafter(target, 4, num_layers=2)
    prompts = [torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(12))]
    assert Generator(target.model, target.layer_ids, 64, drafter=drafter, compile=False).warm_up(prompts, 8, rounds=2) == 2
    for warmup, want in ((1, 1), (1000, WARMUP_ROUNDS)):
        gen = Generator(target.model, target.layer_ids, 64, drafter=drafter, compile=False)
        gen._greedy_step, gen._draft_step, gen._verify_step = (
            CapturedStep(f, gen._layout, _Recorder(), warmup=warmup)
            for f in (gen._greedy_step_impl, gen._draft_step_impl, gen._verify_step_impl))
        gen.compiled = True
        assert gen.warm_up(prompts, 8) == want
        assert gen.graphs_recorded() == (want < WARMUP_ROUNDS)


def test_recorded_steps_decode_like_the_plain_steps(target):
    """The decoder's three steps wrapped as CapturedStep over its state layout (recording stood in
    for on CPU) give the naive loop's tokens and the plain steps' acceptance, batched, with a stop
    token; a stop list that outgrows the state's stop buffer (reallocated) makes every step record
    again instead of replaying graphs of the old buffer."""
    from dflash.inference.decode_state import STOP_SLOTS
    from dflash.inference.decode_steps import CapturedStep

    drafter = make_drafter(target, 4, num_layers=2)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 21)]
    refs = [naive_greedy_decode(target.model, p, 20) for p in prompts]
    stop = {_first_from(refs[0], 6)}
    plain = Generator(target.model, target.layer_ids, 64, batch_size=2, drafter=drafter, compile=False)
    want = plain.speculative(prompts, 20, sorted(stop))
    gen = Generator(target.model, target.layer_ids, 64, batch_size=2, drafter=drafter, compile=False)
    rec = _Recorder()
    gen._greedy_step, gen._draft_step, gen._verify_step = (
        CapturedStep(f, gen._layout, rec) for f in (gen._greedy_step_impl, gen._draft_step_impl, gen._verify_step_impl))
    steps = (gen._greedy_step, gen._draft_step, gen._verify_step)
    assert not gen.graphs_recorded()
    gen.compiled = True  # the host loop of compiled decoding: no width argument, no device read per pass
    greedy = gen.greedy(prompts, 20, sorted(stop))
    spec = gen.speculative(prompts, 20, sorted(stop))
    assert [o.tokens for o in greedy + spec] == [_cut(r, stop, 20) for r in refs] * 2
    assert [o.accepted for o in spec] == [o.accepted for o in want]
    assert gen.graphs_recorded() and [s.recordings for s in steps] == [1, 1, 1]
    many = sorted(stop) + [VOCAB + i for i in range(STOP_SLOTS)]
    spec = gen.speculative(prompts, 20, many)
    assert [o.tokens for o in spec] == [_cut(r, stop, 20) for r in refs]
    assert [s.recordings for s in steps] == [1, 2, 2]  # the target-only step has not run since


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_compiled_decoding_equals_eager_on_gpu():
    """fp32 on CUDA: the CUDA-graph steps (CUDAGraph Trees, and steps recorded once and replayed)
    give the eager steps' tokens, target-only and speculative, batched, with and without a stop
    token, whether the host checks every forward or every 8, under each host-check schedule
    (pipelined: pinned snapshots read while the next chunk runs); a stop list longer than the
    state's stop buffer reallocates it, and the recorded steps record again."""
    from dflash.inference.decode_state import STOP_SLOTS

    target = load_target(TargetConfig(kind="random", arch="tiny-llama", dtype="float32"), "cuda", num_drafter_layers=2)
    drafter = make_drafter(target, 4, num_layers=2).cuda()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (3, 17, 40)]
    refs = [naive_greedy_decode(target.model, p, 24) for p in prompts]
    stop = {_first_from(refs[1], 5)}
    outs = {}
    for compiled, graphs in ((False, "trees"), (True, "trees"), (True, "captured")):
        gen = Generator(target.model, target.layer_ids, 128, batch_size=2, drafter=drafter, compile=compiled,
                        cuda_graphs=graphs)
        for every, schedule in ((1, "predicted"), (8, "predicted"), (8, "certain"), (4, "pipelined")):
            gen.sync_every, gen.pass_schedule = every, schedule
            for stops in (set(), stop):
                runs = [o for grp in (prompts[:2], prompts[2:]) for o in gen.greedy(grp, 24, sorted(stops))]
                runs += [o for grp in (prompts[:2], prompts[2:]) for o in gen.speculative(grp, 24, sorted(stops))]
                outs[compiled, graphs, every, schedule, bool(stops)] = [o.tokens for o in runs]
                assert [o.tokens for o in runs] == [_cut(r, stops, 24) for r in refs] * 2
        if graphs == "captured":
            assert gen.graphs_recorded()
            assert [s.recordings for s in (gen._greedy_step, gen._draft_step, gen._verify_step)] == [1, 1, 1]
            # ids the target never emits first: the buffer grows past STOP_SLOTS, the steps record again
            many = sorted(stop) + [VOCAB + i for i in range(STOP_SLOTS)]
            runs = gen.greedy(prompts[:2], 24, many) + gen.speculative(prompts[:2], 24, many)
            assert [o.tokens for o in runs] == [_cut(r, stop, 24) for r in refs[:2]] * 2
            assert [s.recordings for s in (gen._greedy_step, gen._draft_step, gen._verify_step)] == [2, 2, 2]
    assert all(out == outs[False, "trees", 1, "predicted", key[-1]] for key, out in outs.items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("attention", ["sdpa", "flex", "reduce", "matmul"])
def test_compiled_cached_drafter_drafts_what_the_training_forward_drafts_on_gpu(attention):
    """fp32 on CUDA, compiled (CUDA graphs): the cached drafter under each verification attention
    walks the same anchors as the drafter's training forward over the buffer (the same drafts at
    every pass), batched, and both give the naive oracle's tokens."""
    from dflash.inference.proposer import CachedDFlashProposer, DFlashProposer

    target = load_target(TargetConfig(kind="random", arch="tiny-llama", dtype="float32"), "cuda", num_drafter_layers=2)
    drafter = make_drafter(target, 4, num_layers=2).cuda()
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (3, 40)]
    refs = [naive_greedy_decode(target.model, p, 24) for p in prompts]
    runs = {}
    for cached in (True, False):
        gen = Generator(target.model, target.layer_ids, 160, batch_size=2, compile=True,
                        attention=f"reduce+{attention}", drafter=drafter if cached else DFlashProposer(drafter))
        assert isinstance(gen.proposer, CachedDFlashProposer) == cached
        runs[cached] = gen.speculative(prompts, 24)
        assert [o.tokens for o in runs[cached]] == refs
    assert [o.anchors for o in runs[True]] == [o.anchors for o in runs[False]]


class _RecordingGenerator:
    """Stands in for a Generator: records each decode's prompts (lengths) and new tokens."""

    def __init__(self, calls: list):
        self.calls = calls

    def _decode(self, method, prompts, max_new_tokens, stop_ids, progress=None):
        self.calls.append((method, [int(p.numel()) for p in prompts], max_new_tokens))
        return [Generation(tokens=[1] * (max_new_tokens + 1)) for _ in prompts]

    def greedy(self, *args, **kwargs):
        return self._decode("greedy", *args, **kwargs)

    def speculative(self, *args, **kwargs):
        return self._decode("speculative", *args, **kwargs)


@pytest.mark.parametrize("batch", [1, 3])
def test_each_prompt_length_is_warmed_before_timing(batch):
    """At batch 1 one prompt of each (decoder, prompt length) pair is decoded both ways, briefly; above
    it every prompt, in the timed runs' batches."""
    from dflash.inference import spec_report
    from dflash.inference.prompts import PromptCase

    rng = random.Random(batch)
    lengths = [rng.choice([5, 7, 9, 12]) for _ in range(11)]
    sizes = [64 if n < 10 else 128 for n in lengths]
    cases = [PromptCase(index=i, source_row=i, prompt_ids=torch.arange(n), input_ids=None, loss_mask=None)
             for i, n in enumerate(lengths)]
    calls: list = []
    gens = {64: _RecordingGenerator(calls), 128: _RecordingGenerator(calls)}
    spec_report._warm_prompt_lengths(gens, sizes, cases, [], batch)
    for method in ("greedy", "speculative"):
        seen = [n for m, ns, k in calls if m == method for n in ns]
        assert all(k == spec_report.PREFILL_WARMUP_TOKENS for _, _, k in calls)
        if batch == 1:
            assert sorted(seen) == sorted(set(lengths))  # each length once (a length is one decoder's here)
        else:
            assert sorted(seen) == sorted(lengths)
            assert all(len(ns) <= batch for m, ns, _ in calls)
