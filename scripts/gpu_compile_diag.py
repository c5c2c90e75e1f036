"""Why does the compiled drafter step not learn at the Qwen3-8B shape? Eager vs compiled variants.

From the same initial weights and the same batch (and the same anchors at every step, so the loss
must fall), each variant runs ``--steps`` optimizer steps and reports, per step: loss, gradient
norm, parameters without a gradient, and at step 0 the per-parameter gradient agreement with
eager (relative L2 difference, cosine), plus how far the weights moved.

Variants: ``eager``; ``default`` (torch.compile, no CUDA graphs); ``reduce-overhead`` (with
``cudagraph_mark_step_begin()`` before each step); ``ro-no-mark`` (without it, as
``DrafterTrainer.step`` runs); ``ro-clone-grads`` (gradients cloned out of the CUDA-graph pool
before the optimizer step); ``ro-sdpa`` (SDPA with a dense mask instead of flex_attention);
``ro-masks-inside`` / ``default-masks-inside`` (the attention masks built *inside* the compiled
region: on CUDA, torch 2.11, their gradients are ~500× off eager (docs/benchmarks.md); the
trainer builds them eagerly, :meth:`dflash.training.trainer.DrafterTrainer.prepare`).

    python -m scripts.gpu_compile_diag --layers 2 --rows 4 --anchors 128     # GPU, ~3-4 min
    python -m scripts.gpu_compile_diag --cpu-smoke                            # CPU, tiny shapes

With ``--out DIR``: writes ``DIR/compile_diag.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.bench_compile import synthetic_batch
from dflash.config import config_from_dict
from dflash.training.factory import build_drafter, target_hf_config
from dflash.models.masks import flex_block_mask
from dflash.training.anchors import anchor_generator, sample_anchors
from dflash.training.trainer import DrafterTrainer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="qwen3-8b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=3072)
    p.add_argument("--anchors", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--variants", default="eager,default,reduce-overhead,ro-sdpa,ro-masks-inside")
    p.add_argument("--mask-check", action="store_true",
                   help="compare a flex BlockMask built under torch.compile with the eager one first")
    p.add_argument("--attention", default="auto", choices=["auto", "flex", "sdpa"],
                   help="drafter attention backend of every variant but ro-sdpa")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--out", default=None, help="folder for compile_diag.json")
    args = p.parse_args()
    if args.cpu_smoke:
        args.arch, args.seq, args.rows, args.anchors, args.layers = "tiny-qwen3", 256, 2, 8, 1
        args.variants = args.variants if args.variants != p.get_default("variants") else "eager,default"
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    cfg = config_from_dict({"target": {"kind": "random", "arch": args.arch, "tokenizer": "qwen3"},
                            "drafter": {"num_layers": args.layers, "block_size": 16, "anchors_per_row": args.anchors,
                                        "mask_token_id": 0, "compile": True},
                            "data": {"max_length": args.seq, "token_budget": args.seq * args.rows}})
    tc = target_hf_config(cfg)
    text = tc.get_text_config() if hasattr(tc, "get_text_config") else tc
    d, vocab = int(text.hidden_size), int(text.vocab_size)
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    embed = nn.Embedding(vocab, d).to(dev, dtype).requires_grad_(False)
    head = nn.Linear(d, vocab, bias=False).to(dev, dtype).requires_grad_(False)
    with torch.no_grad():
        embed.weight.normal_(0, 0.02, generator=None)
        head.weight.normal_(0, 0.02)
    batch = synthetic_batch(args.rows, args.seq, vocab, gen, dev)
    feat = torch.randn(args.rows, args.seq, args.layers * d, generator=gen).mul_(3.0).to(dev, dtype)
    tok = torch.randint(0, vocab, (args.rows, args.seq), generator=gen).to(dev)
    tensors = dict(batch, features=feat, target_tokens=tok)
    res = {"args": vars(args), "torch": torch.__version__, "variants": {}}
    if args.mask_check:
        res["mask_check"] = mask_check(tensors, args.anchors, dev)
        print("mask_check", json.dumps(res["mask_check"]), flush=True)
    base = build_drafter(cfg, embed, head, vocab, dev, tc)
    init = {k: v.detach().clone() for k, v in base.state_dict().items()}
    del base
    eager_grads = None
    for variant in args.variants.split(","):
        t0 = time.perf_counter()
        cfg.drafter.attention = "sdpa" if variant == "ro-sdpa" else args.attention
        model = build_drafter(cfg, embed, head, vocab, dev, tc)
        model.load_state_dict(init, strict=False)
        tr = DrafterTrainer(model, cfg.train, cfg.drafter, 100, dev, compile_mode=None)
        mode = ("default" if variant.startswith("default") else None if variant == "eager" else "reduce-overhead")
        if mode is not None:
            if variant in ("ro-masks-inside", "default-masks-inside"):  # the old, broken layout
                fn = torch.compile(lambda f, i, pos, doc, a, k: _hidden(tr, f, i, pos, doc, a, k, None),
                                   mode=mode, dynamic=False)
                tr._forward = lambda f, i, pos, doc, a, k, masks, fn=fn: fn(f, i, pos, doc, a, k)
            else:
                tr._forward = torch.compile(tr._hidden, mode=mode, dynamic=False)
        rows = []
        params = dict((n, q) for n, q in model.named_parameters() if q.requires_grad)
        for step in range(args.steps):
            if mode == "reduce-overhead" and dev.type == "cuda" and variant != "ro-no-mark":
                torch.compiler.cudagraph_mark_step_begin()
            out, w = tr.forward_backward(tensors, 0, 0)
            if variant == "ro-clone-grads":  # gradients out of the CUDA-graph pool before the step
                for q in params.values():
                    if q.grad is not None:
                        q.grad = q.grad.clone()
            loss = float(out.loss_sum / out.weight_sum)
            none = [n for n, q in params.items() if q.grad is None]
            gn = math.sqrt(sum(float(q.grad.float().pow(2).sum()) for q in params.values() if q.grad is not None))
            row = {"step": step, "loss": round(loss, 5), "grad_norm": round(gn, 5), "no_grad": len(none),
                   "no_grad_names": none[:5]}
            if step == 0:
                grads = {n: q.grad.detach().float().clone() for n, q in params.items() if q.grad is not None}
                if variant == "eager":
                    eager_grads = grads
                elif eager_grads is not None:
                    worst = []
                    for n, g in eager_grads.items():
                        c = grads.get(n)
                        if c is None:
                            worst.append((n, None, None))
                            continue
                        rel = float((c - g).norm() / g.norm().clamp_min(1e-30))
                        cos = float(torch.nn.functional.cosine_similarity(c.flatten(), g.flatten(), dim=0))
                        worst.append((n, round(rel, 4), round(cos, 4)))
                    worst.sort(key=lambda x: -(x[1] if x[1] is not None else 1e9))
                    row["grad_vs_eager_worst"] = worst[:8]
                    row["grad_vs_eager_median_rel"] = sorted(x[1] for x in worst if x[1] is not None)[len(worst) // 2]
                before = {n: q.detach().float().clone() for n, q in params.items()}
            tr.optimizer_step()
            if step == 0:
                moved = math.sqrt(sum(float((q.detach().float() - before[n]).pow(2).sum()) for n, q in params.items()))
                row["weights_moved"] = round(moved, 6)
                del before
            rows.append(row)
            print(variant, json.dumps(row), flush=True)
        res["variants"][variant] = {"rows": rows, "seconds": round(time.perf_counter() - t0, 1)}
        del tr, model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "compile_diag.json").write_text(json.dumps(res, indent=1))
    for v, r in res["variants"].items():
        print(f"{v:>18}: losses {[x['loss'] for x in r['rows']]} grad norms {[x['grad_norm'] for x in r['rows']]} "
              f"no-grad {r['rows'][0]['no_grad']} moved {r['rows'][0].get('weights_moved')} "
              f"median rel grad diff {r['rows'][0].get('grad_vs_eager_median_rel')} ({r['seconds']} s)")
    return 0


def mask_check(tensors: dict, num_anchors: int, dev: torch.device) -> dict:
    """Fields of a flex ``BlockMask`` built eagerly vs inside ``torch.compile``: mismatch counts.

    Indices are compared within each row's valid prefix (``num`` entries), as sets and in order.
    """
    gen = anchor_generator(0, 0, 0, dev)
    anc, keep = sample_anchors(tensors["loss_mask"], tensors["doc_ids"], num_anchors, gen)

    def fields(a, k, doc):
        m = flex_block_mask(a, k, doc, 16)
        return (m.kv_num_blocks, m.kv_indices, m.full_kv_num_blocks, m.full_kv_indices,
                m.q_num_blocks, m.q_indices, m.full_q_num_blocks, m.full_q_indices)

    eager = fields(anc, keep, tensors["doc_ids"])
    comp = torch.compile(fields, dynamic=False, fullgraph=True)(anc, keep, tensors["doc_ids"])
    names = ("kv", "full_kv", "q", "full_q")
    out = {}
    for j, name in enumerate(names):
        ne, ie, nc, ic = eager[2 * j], eager[2 * j + 1], comp[2 * j], comp[2 * j + 1]
        out[f"{name}_num_mismatch"] = int((ne != nc).sum())
        valid = torch.arange(ie.shape[-1], device=ie.device) < ne.unsqueeze(-1)
        out[f"{name}_idx_in_order_mismatch"] = int(((ie != ic) & valid).sum())
        se = torch.where(valid, ie, -1).sort(-1).values
        sc = torch.where(valid, ic, -1).sort(-1).values
        out[f"{name}_idx_as_set_mismatch"] = int((se != sc).sum())
        out[f"{name}_valid_entries"] = int(valid.sum())
    return out


def _hidden(tr, f, i, pos, doc, a, k, masks):
    if tr.autocast_dtype is None:
        return tr.model(f, i, pos, doc, a, k, attn_masks=masks)
    with torch.autocast(tr.device.type, dtype=tr.autocast_dtype):
        return tr.model(f, i, pos, doc, a, k, attn_masks=masks)


if __name__ == "__main__":
    sys.exit(main())
