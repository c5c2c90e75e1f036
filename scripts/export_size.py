"""Sizes of a drafter's training checkpoint and its serving export (bf16 and fp32) at a real shape.

Builds a randomly initialised 5-layer drafter at Qwen3-8B shape (hidden 4096, FFN 12288, 32/8 heads
of 128, vocabulary 151,936) on the given device, writes its checkpoint form (``drafter/``, fp32),
exports it with :func:`dflash.inference.export.export_drafter` in bfloat16 and float32, and prints each
directory's files with their sizes in bytes and GiB.

    python -m scripts.export_size --out results/export-size [--device cuda]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from dflash.inference.export import export_drafter
from dflash.models.drafter import DFlashDraftModel
from dflash.models.drafter_config import DFlashConfig
from dflash.models.layer_ids import default_layer_ids


def _sizes(directory: Path) -> str:
    files = sorted((p.name, p.stat().st_size) for p in directory.iterdir() if p.is_file())
    total = sum(size for _, size in files)
    return f"{directory.name}: {total:,} bytes ({total / 2**30:.2f} GiB) " + ", ".join(
        f"{name} {size:,}" for name, size in files)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    out = Path(args.out)
    cfg = DFlashConfig(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, num_hidden_layers=5, num_target_layers=36,
                       target_layer_ids=default_layer_ids(36, 5), mask_token_id=151669)
    with torch.device(args.device):
        embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=torch.bfloat16)
        head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=torch.bfloat16)
        model = DFlashDraftModel(cfg, embed, head)
    ckpt = model.save_pretrained(out / "drafter")
    lines = [_sizes(Path(ckpt))]
    for dtype in ("bfloat16", "float32"):
        report = export_drafter(Path(ckpt), out / f"export-{dtype}", dtype=dtype)
        lines.append(_sizes(report.directory))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
