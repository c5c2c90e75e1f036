"""Diagnose the compiled drafter step: eager vs torch.compile (default) vs reduce-overhead on a tiny
drafter with bf16 autocast; prints per-step (loss, grad norm). GPU only."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import torch  # noqa: E402

from bench_compile import synthetic_batch  # noqa: E402
from dflash.config import config_from_dict  # noqa: E402
from dflash.factory import build_drafter  # noqa: E402
from dflash.target import load_target  # noqa: E402
from dflash.trainer import DrafterTrainer, metrics_to_host  # noqa: E402

cfg = config_from_dict({"target": {"kind": "random", "arch": "tiny-qwen3", "tokenizer": "qwen3"},
                        "drafter": {"num_layers": 2, "block_size": 16, "anchors_per_row": 32, "mask_token_id": 0},
                        "data": {"max_length": 512, "token_budget": 2048}})
dev = torch.device("cuda")
t = load_target(cfg.target, dev, num_drafter_layers=2)
b = synthetic_batch(4, 512, t.vocab_size, torch.Generator().manual_seed(0), dev)
f, tok = t.forward_features(b["input_ids"], b["position_ids"], b["doc_ids"])
tensors = dict(b, features=f, target_tokens=tok)
for mode in [None, "default", "reduce-overhead"]:
    cfg.drafter.compile = mode is not None
    m = build_drafter(cfg, t.embed_tokens, t.lm_head, 0, dev, t.config)
    tr = DrafterTrainer(m, cfg.train, cfg.drafter, 50, dev, compile_mode=mode or "default")
    out = []
    for s in range(6):
        r = metrics_to_host(tr.step(tensors, 0, s))
        out.append((round(r["loss"], 4), round(r["grad_norm"], 3)))
    print(mode, out, flush=True)
