"""Raw vs target-regenerated ShareGPT: held-out τ of drafters trained on each.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 .venv/bin/python -m scripts.regen_compare \\
        [--config configs/smollm2-135m-cpu.yaml] [--out runs/regen_compare] [--limit 400] [--heldout 32] \\
        [--steps 400] [--labels data,target] [--eval-anchors 64] [--spec-prompts 8] [--spec-new-tokens 64] \\
        [--threads 2] [section.key=value ...]

1. ``python -m dflash.inference.regenerate`` (greedy) over the first ``--limit`` ShareGPT rows into
   ``OUT/regen.jsonl``; an existing complete output is reused (the regenerate launcher resumes it).
2. Pairs: every regenerated row with the same source row, cut to the same turns, its assistant
   turns the original ones (``raw``). Same ids, same prompts; only the responses differ.
   ``--heldout`` ids (seeded sample) are held out of both training sets.
3. The reference trainer (:func:`dflash.training.reference.run_reference`: same init seed, same anchors
   seeds, same step count) trains one drafter per (data, ``drafter.labels``).
   The target's features are cached per conversation (:class:`FeatureCache`), so later epochs and
   the second label mode cost no target pass; a packed row's conversations are independent
   (per-document attention), so the cached features are those the target computes for that row.
4. Held-out τ, labels = the target's greedy tokens, every valid anchor (``--eval-anchors`` per row):
   on the *regenerated* held-out conversations (the target's own responses: what speculative
   decoding sees) and, for reference, on the raw held-out ones. Then real greedy speculative
   decoding (:meth:`dflash.inference.generation.Generator.speculative`) on the first ``--spec-prompts`` held-out
   prompts: τ = tokens per target verification pass.

Results: ``OUT/results.json`` (one entry per drafter, written as each finishes; a rerun with the
same settings skips finished entries) and a table on stdout. Trained weights:
``OUT/drafter_<data>_<labels>_<steps>.pt``; a rerun with other evaluation settings loads them
instead of training again.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

from dflash.data.batching import BatchPlan
from dflash.config import load_config
from dflash.data.conversations import normalize_row
from dflash.data.corpus import prepare_data
from dflash.training.factory import DataPlans, build_batch_plans, pad_token_id
from dflash.logs import setup_logging
from dflash.training.reference import evaluate_heldout, run_reference
from dflash.inference.regeneration.rows import iter_source
from dflash.inference.generation import Generator
from dflash.data.render import stop_token_ids
from dflash.inference.prompts import prompts_from_corpus
from dflash.models.target_loader import load_target
from dflash.data.tokenizer import load_tokenizer

log = logging.getLogger("regen_compare")


class FeatureCache:
    """A target whose ``forward_features`` reuses each conversation's features once computed.

    Key: a conversation's token ids (a row's ``doc_ids`` segment). A batch with any unseen
    conversation runs the real target on the whole batch and stores every segment; otherwise the
    batch is assembled from the cache (padding: zero features, token 0 — never a context or a label).
    Everything else is the wrapped target's.
    """

    def __init__(self, target) -> None:
        self.__dict__["target"] = target
        self.__dict__["store"] = {}
        self.__dict__["misses"] = 0

    def __getattr__(self, name):
        return getattr(self.target, name)

    @staticmethod
    def _segments(ids: torch.Tensor, docs: torch.Tensor):
        for r in range(ids.shape[0]):
            d = docs[r].tolist()
            start = 0
            for p in range(1, len(d) + 1):
                if p == len(d) or d[p] != d[start]:
                    if d[start] != 0:
                        yield r, start, p, ids[r, start:p].numpy().tobytes()
                    start = p

    def forward_features(self, input_ids, position_ids, doc_ids):
        segs = list(self._segments(input_ids, doc_ids))
        if any(key not in self.store for *_, key in segs):
            self.__dict__["misses"] += 1
            features, tokens = self.target.forward_features(input_ids, position_ids, doc_ids)
            for r, a, b, key in segs:
                self.store[key] = (features[r, a:b].clone(), tokens[r, a:b].clone())
            return features, tokens
        rows, seq = input_ids.shape
        features = torch.zeros(rows, seq, self.target.feature_size, dtype=self.target.dtype)
        tokens = torch.zeros(rows, seq, dtype=torch.int64)
        for r, a, b, key in segs:
            features[r, a:b], tokens[r, a:b] = self.store[key]
        return features, tokens

    forward = forward_features


def write_jsonl(path: Path, rows: list[dict]) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return str(path)


def paired_rows(regen_path: Path, dataset: str, limit: int) -> tuple[list[dict], list[dict]]:
    """(regenerated rows, raw rows): the same ids and turns; raw keeps the source's assistant turns."""
    source = {r.id: r.messages for r in iter_source(dataset, limit)}
    regen, raw = [], []
    for line in regen_path.open():
        row = json.loads(line)
        msgs, _ = normalize_row(row)
        src = source[row["id"]]
        while src and src[0]["role"] == "assistant":  # regenerate drops leading assistant turns
            src = src[1:]
        src = src[:len(msgs)]
        if [m["role"] for m in src] != [m["role"] for m in msgs]:
            log.warning("%s: turns do not line up with the source; left out", row["id"])
            continue
        regen.append({"id": row["id"], "messages": msgs})
        raw.append({"id": row["id"], "messages": src})
    return regen, raw


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/smollm2-135m-cpu.yaml")
    p.add_argument("--out", default="runs/regen_compare")
    p.add_argument("--limit", type=int, default=400, help="ShareGPT rows read for regeneration")
    p.add_argument("--heldout", type=int, default=32)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--labels", default="data,target", help="drafter.labels modes, in order")
    p.add_argument("--eval-anchors", type=int, default=64, help="anchors per held-out row (data.max_length = all)")
    p.add_argument("--spec-prompts", type=int, default=8, help="0 = no speculative decoding")
    p.add_argument("--spec-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="held-out sample")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    setup_logging("regen_compare")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    # 1. regenerate (or resume / reuse)
    regen_path = out / "regen.jsonl"
    subprocess.run([sys.executable, "-m", "dflash.inference.regenerate", "--config", args.config, "--output", str(regen_path),
                    "--limit", str(args.limit), *args.overrides], check=True)

    # 2. paired raw / regenerated data, same held-out ids
    base = load_config(args.config, args.overrides)
    regen, raw = paired_rows(regen_path, base.data.dataset, args.limit)
    held = set(random.Random(args.seed).sample([r["id"] for r in regen], args.heldout))
    files = {}
    for name, rows in (("regen", regen), ("raw", raw)):
        files[name] = write_jsonl(out / f"{name}_train.jsonl", [r for r in rows if r["id"] not in held])
        files[f"{name}_heldout"] = write_jsonl(out / f"{name}_heldout.jsonl", [r for r in rows if r["id"] in held])
    log.info("%d paired conversations: %d train, %d held-out", len(regen), len(regen) - len(held), len(held))

    common = [*args.overrides, "data.heldout_conversations=0", "data.max_conversations=null", "train.epochs=100",
              f"train.max_steps={args.steps}", "log.wandb=disabled"]

    def cfg_for(dataset: str, labels: str = "target"):
        return load_config(args.config, [*common, f"data.dataset={dataset}", f"drafter.labels={labels}"])

    tok = load_tokenizer(base.target)
    pad = pad_token_id(tok)
    target = FeatureCache(load_target(base.target, "cpu", num_drafter_layers=base.drafter.num_layers))
    evals = {}
    for name in ("regen_heldout", "raw_heldout"):
        c = cfg_for(files[name])
        data = prepare_data(c, tok)
        plan = BatchPlan(data.train, rows=c.rows_per_batch, seq_len=c.data.max_length, seed=c.data.seed, pad_id=pad)
        evals[name] = DataPlans(data=data, train=plan, heldout=plan, tokenizer=tok, pad_id=pad)
    stops = stop_token_ids(tok, target.model)
    cases = prompts_from_corpus(evals["regen_heldout"].data.train, args.spec_prompts,
                                max(1, base.data.max_length - args.spec_new_tokens))

    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    settings = {k: getattr(args, k) for k in ("steps", "eval_anchors", "spec_prompts", "spec_new_tokens", "seed",
                                              "heldout", "limit", "overrides")}
    for labels in args.labels.split(","):
        for data_name in ("regen", "raw"):
            key = f"{data_name}/labels={labels}"
            if results.get(key, {}).get("settings") == settings:
                log.info("%s: done before, skipped", key)
                continue
            cfg = cfg_for(files[data_name], labels)
            plans = build_batch_plans(cfg, tok)
            weights = out / f"drafter_{data_name}_{labels}_{args.steps}.pt"  # trained weights: re-evaluate only
            t0 = time.perf_counter()
            if weights.is_file():
                saved = torch.load(weights)
                res = run_reference(cfg, "cpu", steps=0, evaluate=False, plans=plans, target=target)
                res.model.load_state_dict(saved["model"], strict=False)
                entry = saved["entry"]
            else:
                res = run_reference(cfg, "cpu", steps=args.steps, evaluate=False, plans=plans, target=target)
                entry = {"steps": len(res.losses), "train_conversations": len(plans.data.train),
                         "train_minutes": round((time.perf_counter() - t0) / 60, 2),
                         "train_loss_first_last": [round(res.losses[0], 4), round(res.losses[-1], 4)]}
                trainable = {n for n, q in res.model.named_parameters() if q.requires_grad}
                torch.save({"model": {n: v for n, v in res.model.state_dict().items() if n in trainable},
                            "entry": entry}, weights)
            entry = {**entry, "settings": settings}
            trainer = res.trainer
            trainer.labels, trainer.num_anchors = "target", args.eval_anchors  # τ against the target's greedy
            for name, ep in evals.items():
                ev = evaluate_heldout(trainer, target, ep, None, torch.device("cpu"))
                entry[name] = {k.split("/")[1]: round(v, 4) if isinstance(v, float) else v for k, v in ev.items()}
            if cases:
                longest = max(c.prompt_ids.numel() for c in cases)
                gen = Generator(target.model, target.layer_ids, longest + args.spec_new_tokens + res.model.block_size + 1,
                                drafter=res.model)
                passes = added = 0
                t1 = time.perf_counter()
                for case in cases:
                    spec = gen.speculative([case.prompt_ids], args.spec_new_tokens, stops)[0]
                    passes += spec.steps
                    added += sum(spec.accepted)
                entry["speculative"] = {"prompts": len(cases), "max_new_tokens": args.spec_new_tokens,
                                        "passes": passes, "tau": round(added / max(passes, 1), 4),
                                        "seconds": round(time.perf_counter() - t1, 1)}
            results[key] = entry
            results_path.write_text(json.dumps(results, indent=1))
            log.info("%s: %s", key, json.dumps(entry))
    log.info("target passes (cache misses): %d; total %.1f min", target.misses, (time.perf_counter() - started) / 60)

    print(f"\n{'drafter':<22} {'steps':>5} {'tau regen held-out':>18} {'acc pos1':>9} {'tau raw held-out':>16} "
          f"{'spec tau':>8}")
    for key, e in results.items():
        print(f"{key:<22} {e['steps']:>5} {e['regen_heldout']['tau']:>18.4f} {e['regen_heldout']['acc_block_pos_1']:>9.4f} "
              f"{e['raw_heldout']['tau']:>16.4f} {e.get('speculative', {}).get('tau', float('nan')):>8.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
