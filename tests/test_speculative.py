"""Speculative decoding with a DFlash drafter (dflash/speculative.py): lossless, τ, features, offline τ.

The oracle is :func:`naive_greedy_decode`: a full target forward over the whole sequence for every
token (no KV cache, no features). Targets are tiny random llamas; the drafter is either fresh,
briefly trained on the target's own greedy continuations (so that it is sometimes right), or a
scripted proposer that knows the oracle's output and is right for a chosen number of slots.
"""

from __future__ import annotations

import os
import random
from typing import Callable

import pytest
import torch

from dflash.config import DrafterConfig, TargetConfig, TrainConfig
from dflash.model import DFlashConfig, DFlashDraftModel
from dflash.speculative import (
    CachedTarget,
    DFlashProposer,
    greedy_decode,
    naive_greedy_decode,
    offline_tau,
    prompts_from_corpus,
    checkpoint_step,
    last_eval_tau,
    resolve_checkpoint,
    speculative_decode,
)
from dflash.target import TargetModel, load_target
from dflash.trainer import DrafterTrainer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 512          # tiny-llama
MAX_NEW = 40
MAX_B = 8
TRAIN_ROWS, TRAIN_PROMPT, TRAIN_LEN = 8, 8, 64


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: the tiny forwards gain nothing from more, and on a shared machine an
    oversubscribed OpenMP pool made them ~100x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return load_target(TargetConfig(kind="random", arch="tiny-llama"), "cpu", num_drafter_layers=2)


def make_drafter(target: TargetModel, block_size: int, num_layers: int = 1, seed: int = 0) -> DFlashDraftModel:
    cfg = DFlashConfig.from_target(target.config, DrafterConfig(num_layers=num_layers, block_size=block_size),
                                   target_layer_ids=target.layer_ids, mask_token_id=0)
    torch.manual_seed(seed)
    return DFlashDraftModel(cfg, target.embed_tokens, target.lm_head, attention="sdpa").eval()


@pytest.fixture(scope="module")
def greedy_rows(target: TargetModel) -> dict[str, torch.Tensor]:
    """Rows of [random prompt (8) ; the target's greedy continuation (56)], loss on the continuation."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(TRAIN_ROWS):
        prompt = torch.randint(0, VOCAB, (TRAIN_PROMPT,), generator=g)
        cont = greedy_decode(target.model, prompt, TRAIN_LEN - TRAIN_PROMPT).tokens
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
    return [naive_greedy_decode(target.model, p, MAX_NEW + MAX_B).tokens for p in prompts]


class ScriptedProposer:
    """Knows the target's greedy continuation; drafts it right for ``right(call)`` leading slots, then wrong."""

    def __init__(self, block_size: int, prompt_len: int, reference: list[int], right: Callable[[int], int]) -> None:
        self.block_size = block_size
        self.prompt_len = prompt_len
        self.reference = reference
        self.right = right
        self.made_right: list[int] = []

    def __call__(self, input_ids: torch.Tensor, context_features: torch.Tensor) -> torch.Tensor:
        n = input_ids.numel() - 1
        assert context_features.shape[0] == n
        truth = [self.reference[n + 1 + j - self.prompt_len] for j in range(self.block_size - 1)]
        k = min(self.right(len(self.made_right)), self.block_size - 1)
        self.made_right.append(k)
        return torch.tensor(truth[:k] + [(t + 1) % VOCAB for t in truth[k:]])


# --------------------------------------------------------------------------- lossless


def test_cached_greedy_equals_naive(target, prompts, references):
    for prompt, ref in zip(prompts, references):
        assert greedy_decode(target.model, prompt, MAX_NEW).tokens == ref[:MAX_NEW]


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_lossless_with_dflash_drafter(target, prompts, references, trained_drafter, block_size):
    drafter = trained_drafter if block_size == 4 else make_drafter(target, block_size, num_layers=2, seed=block_size)
    proposer = DFlashProposer(drafter)
    for prompt, ref in zip(prompts, references):
        res = speculative_decode(target.model, target.layer_ids, proposer, prompt, MAX_NEW)
        assert res.tokens == ref[:MAX_NEW]
        assert res.target_forwards == res.steps + 1 and all(1 <= a <= block_size for a in res.accepted)
        # Every step's m + 1 tokens went into the output, except possibly the last step's.
        assert sum(res.accepted[:-1]) + 1 < MAX_NEW <= sum(res.accepted) + 1


def test_trained_drafter_really_accepts(target, prompts, references, trained_drafter):
    """The real drafter's acceptance path is exercised: it drafts its training rows right often."""
    res = speculative_decode(target.model, target.layer_ids, DFlashProposer(trained_drafter), prompts[0], MAX_NEW)
    assert res.tokens == references[0][:MAX_NEW]
    assert res.tau > 1.5 and max(res.accepted) == 4


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_lossless_with_scripted_proposer_random_acceptance(target, prompts, references, block_size):
    rng = random.Random(block_size)
    for prompt, ref in zip(prompts, references):
        proposer = ScriptedProposer(block_size, prompt.numel(), ref, lambda _: rng.randint(0, block_size - 1))
        res = speculative_decode(target.model, target.layer_ids, proposer, prompt, MAX_NEW)
        assert res.tokens == ref[:MAX_NEW]
        assert res.accepted == [k + 1 for k in proposer.made_right]


# --------------------------------------------------------------------------- τ by hand


def test_tau_always_right_is_block_size(target, prompts, references):
    b = 4
    proposer = ScriptedProposer(b, prompts[0].numel(), references[0], lambda _: b)
    res = speculative_decode(target.model, target.layer_ids, proposer, prompts[0], 1 + 3 * b)
    assert res.tokens == references[0][:1 + 3 * b]
    assert res.accepted == [4, 4, 4] and res.tau == 4.0 and res.target_forwards == 4


def test_tau_always_wrong_is_one(target, prompts, references):
    proposer = ScriptedProposer(4, prompts[0].numel(), references[0], lambda _: 0)
    res = speculative_decode(target.model, target.layer_ids, proposer, prompts[0], 9)
    assert res.tokens == references[0][:9]
    assert res.accepted == [1] * 8 and res.tau == 1.0 and res.target_forwards == 9


def test_tau_hand_checked_pattern(target, prompts, references):
    """B = 4, right for 2, 0, 1, 2, 0 slots: the passes add 3, 1, 2, 3, 1 tokens: τ = 10 / 5 = 2."""
    pattern = [2, 0, 1, 2, 0]
    proposer = ScriptedProposer(4, prompts[1].numel(), references[1], lambda i: pattern[i])
    res = speculative_decode(target.model, target.layer_ids, proposer, prompts[1], 11)
    assert res.tokens == references[1][:11]
    assert res.accepted == [3, 1, 2, 3, 1] and res.tau == 2.0


def test_max_new_tokens_cuts_the_last_block(target, prompts, references):
    proposer = ScriptedProposer(8, prompts[0].numel(), references[0], lambda _: 8)
    res = speculative_decode(target.model, target.layer_ids, proposer, prompts[0], 12)
    assert res.tokens == references[0][:12] and res.accepted == [8, 8]  # 1 + 8 + 3 of 8 kept
    assert speculative_decode(target.model, target.layer_ids, proposer, prompts[0], 1).tokens == references[0][:1]
    assert speculative_decode(target.model, target.layer_ids, proposer, prompts[0], 0).tokens == []


def test_stop_token_ends_like_greedy(target, prompts, references):
    ref = references[1]
    first = next(i for i in range(2, MAX_NEW) if ref.index(ref[i]) == i)  # a token's first occurrence
    assert first <= 7
    stop = ref[first]
    want = ref[:first + 1]
    assert naive_greedy_decode(target.model, prompts[1], MAX_NEW, [stop]).tokens == want
    assert greedy_decode(target.model, prompts[1], MAX_NEW, [stop]).tokens == want
    for right in (0, 2, 8):  # the stop token comes as a bonus, or drafted right mid-block
        proposer = ScriptedProposer(8, prompts[1].numel(), ref, lambda _: right)
        res = speculative_decode(target.model, target.layer_ids, proposer, prompts[1], MAX_NEW, [stop])
        assert res.tokens == want
    proposer = ScriptedProposer(8, prompts[1].numel(), ref, lambda _: 8)
    assert speculative_decode(target.model, target.layer_ids, proposer, prompts[1], MAX_NEW, [ref[0]]).tokens == ref[:1]


# --------------------------------------------------------------------------- what the drafter sees


def test_context_features_are_the_training_features(target, prompts, trained_drafter):
    """The drafter gets exactly ``forward_features`` of the verified tokens before the anchor."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    inner = DFlashProposer(trained_drafter)

    def spy(input_ids: torch.Tensor, context_features: torch.Tensor) -> torch.Tensor:
        seen.append((input_ids.clone(), context_features.clone()))
        return inner(input_ids, context_features)

    spy.block_size = inner.block_size  # type: ignore[attr-defined]
    res = speculative_decode(target.model, target.layer_ids, spy, prompts[0], MAX_NEW)
    full = torch.cat([prompts[0], torch.tensor(res.tokens)])
    assert len(seen) == res.steps >= 3
    for ids, ctx in seen:
        n = ids.numel() - 1
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


def test_long_context_beyond_training_length(target):
    """S well past any training length: the drafter still runs and decoding stays lossless."""
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, VOCAB, (700,), generator=g)
    drafter = make_drafter(target, 4, seed=4)
    res = speculative_decode(target.model, target.layer_ids, DFlashProposer(drafter), prompt, 6)
    assert res.tokens == naive_greedy_decode(target.model, prompt, 6).tokens


def test_cache_truncate_checks(target):
    runner = CachedTarget(target.model, target.layer_ids)
    logits, feats = runner.extend(torch.arange(10))
    assert logits.shape == (10, VOCAB) and feats.shape == (10, 2 * target.hidden_size)
    runner.truncate(6)
    assert runner.length == 6 and runner.cache.get_seq_length() == 6
    with pytest.raises(ValueError):
        runner.truncate(7)


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


# --------------------------------------------------------------------------- prompts, checkpoints


def test_prompts_from_corpus_are_the_tokens_before_the_first_assistant_token():
    import numpy as np

    from dflash.data import TokenizedCorpus

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
    with pytest.raises(FileNotFoundError):
        resolve_checkpoint(tmp_path)


def test_training_eval_tau_of_the_checkpoint_step(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000150" / "drafter").mkdir(parents=True)
    (run / "checkpoints" / "step-00000150" / "state.json").write_text('{"step": 150, "epoch": 0}')
    lines = ['{"step": 0, "eval/tau": 1.0}', '{"step": 50, "train/tau": 1.5}', "not json",
             '{"step": 100, "eval/tau": 1.25}', '{"step": 200, "eval/tau": 1.75}']
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    step = checkpoint_step(run / "checkpoints" / "step-00000150" / "drafter")
    assert step == 150
    assert last_eval_tau(run, max_step=step) == (100, 1.25)
    assert last_eval_tau(run) == (200, 1.75)
    assert last_eval_tau(tmp_path / "none") is None and last_eval_tau(None) is None
    assert checkpoint_step(tmp_path) is None


# --------------------------------------------------------------------------- real SmolLM2


@pytest.mark.slow
def test_smollm2_heldout_prompts_lossless_and_cli(tmp_path, capsys):
    """Real SmolLM2 target, a fresh drafter saved as a pipeline checkpoint, two held-out prompts."""
    from dflash.checkpoint import save_checkpoint
    from dflash.config import load_config
    from dflash.data import normalize_row, prepare_data, read_rows
    from dflash.factory import build_drafter
    from dflash.speculative import main, stop_token_ids
    from dflash.tokenizer import load_tokenizer

    cfg = load_config("configs/smollm2-135m-cpu.yaml")
    target = load_target(cfg.target, "cpu", num_drafter_layers=cfg.drafter.num_layers)
    tok = load_tokenizer(cfg.target)
    cases = prompts_from_corpus(prepare_data(cfg, tok).heldout, 2, 96)
    assert len(cases) == 2
    # The prompt is what the chat template renders for the first user turn(s) with a generation prompt.
    rows = list(read_rows(cfg.data.dataset, limit=cases[0].source_row + 1))
    messages, _ = normalize_row(rows[cases[0].source_row])
    first_assistant = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    text = tok.apply_chat_template(messages[:first_assistant], add_generation_prompt=True, tokenize=False)
    assert cases[0].prompt_ids.tolist() == tok(text, add_special_tokens=False)["input_ids"]

    drafter = build_drafter(cfg, target.embed_tokens, target.lm_head, len(tok), torch.device("cpu"), target.config)
    stops = stop_token_ids(tok, target.model)
    assert tok.convert_tokens_to_ids("<|im_end|>") in stops
    for case in cases:
        want = greedy_decode(target.model, case.prompt_ids, 16, stops).tokens
        got = speculative_decode(target.model, target.layer_ids, DFlashProposer(drafter), case.prompt_ids, 16, stops)
        assert got.tokens == want and len(want) >= 2

    ckpt = save_checkpoint(tmp_path / "run", 1, 0, drafter, {})
    code = main(["--checkpoint", str(ckpt), "--config", "configs/smollm2-135m-cpu.yaml", "--prompts", "2",
                 "--max-new-tokens", "12", "--json", str(tmp_path / "report.json")])
    out = capsys.readouterr().out
    assert code == 0 and "identical outputs: 2/2" in out
    import json

    report = json.loads((tmp_path / "report.json").read_text())
    assert report["summary"]["identical_all"] and report["summary"]["tau"] >= 1.0
    assert report["summary"]["offline_tau_same_conversations"] >= 1.0
