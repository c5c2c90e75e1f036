"""Export a trained drafter for serving: ``python -m dflash.inference.export --checkpoint PATH --out DIR``.

``PATH`` is a run directory (its newest checkpoint), a checkpoint ``step-XXXXXXXX`` or a drafter
directory. ``DIR`` gets ``config.json``, ``model.safetensors`` (bfloat16 by default, ``--dtype
float32`` on request), ``modeling_dflash.py`` (:mod:`dflash.models.modeling_dflash`, the layers training
ran, copied unchanged) with ``auto_map`` and, when the checkpoint records it,
``trained_with.json`` (the tokenizer, chat template and thinking mode it was trained with, which
the decoding check compares as for a checkpoint; engines ignore the file), so that

* vLLM (``vllm/model_executor/models/qwen3_dflash.py``) and SGLang
  (``python/sglang/srt/models/dflash.py``) load it as a DFlash draft model (integer
  ``dflash_config.mask_token_id``, ``target_layer_ids``, ``block_size``, per-layer attention from
  ``layer_types`` / ``sliding_window``), and
* ``transformers.AutoModel.from_pretrained(DIR, trust_remote_code=True)`` builds the drafter.

The command prints the files, their sizes, the dtype, the mask token id, the layer types and the
engine rules the export satisfies; it exits with 2 on a bad input (a message naming it).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from dflash.models.drafter import DFlashDraftModel
from dflash.models.drafter_config import DFlashConfig
from dflash.models.drafter_io import (CONFIG_FILE, MODELING_FILE, SAVE_DTYPES, WEIGHTS_FILE, check_drafter_weights,
                                     write_drafter_directory)
from dflash.training.checkpoint_identity import IDENTITY_NAMES, TRAINED_WITH_FILE, trained_with
from dflash.models.masks import SLIDING_ATTENTION

__all__ = ["ExportReport", "resolve_drafter_dir", "export_drafter", "engine_rules", "main"]

log = logging.getLogger("export")


@dataclass
class ExportReport:
    """What :func:`export_drafter` wrote."""

    directory: Path
    dtype: str
    mask_token_id: int
    layer_types: list[str]
    sliding_window: Optional[int]
    #: ``(file name, bytes)`` of every file written.
    files: list[tuple[str, int]] = field(default_factory=list)
    #: One line per engine rule the export satisfies (:func:`engine_rules`).
    rules: list[str] = field(default_factory=list)


def resolve_drafter_dir(path: Path) -> Path:
    """The drafter directory of a run directory (newest checkpoint), a checkpoint, or a drafter dir.

    Raises:
        FileNotFoundError: none of those, or a run without checkpoints.
    """
    from dflash.training.checkpoint_load import latest_checkpoint

    p = Path(path)
    if (p / CONFIG_FILE).is_file() and (p / WEIGHTS_FILE).is_file():
        return p
    if (p / "drafter" / CONFIG_FILE).is_file():
        return p / "drafter"
    if (p / "checkpoints").is_dir():
        ckpt = latest_checkpoint(p)
        if ckpt is None:
            raise FileNotFoundError(f"--checkpoint {p}: the run has no complete checkpoint under {p / 'checkpoints'}")
        return ckpt / "drafter"
    raise FileNotFoundError(f"--checkpoint {p}: neither a run directory, a checkpoint (drafter/{CONFIG_FILE}) nor a "
                            f"drafter directory ({CONFIG_FILE} + {WEIGHTS_FILE})")


def _expected_shapes(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of a drafter with ``config``, built on the meta device (no memory)."""
    with torch.device("meta"):
        embed = nn.Embedding(config.vocab_size, config.hidden_size)
        head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        model = DFlashDraftModel(config, embed, head, attention="sdpa")
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def engine_rules(hf_config: dict) -> list[str]:
    """The serving engines' loading rules an exported ``config.json`` satisfies, one line each.

    Raises:
        ValueError: a rule is broken (naming the field).
    """
    flags = hf_config.get("dflash_config") or {}
    mask = flags.get("mask_token_id")
    if not isinstance(mask, int) or isinstance(mask, bool):
        raise ValueError(f"dflash_config.mask_token_id: engines need an integer, got {mask!r}")
    if "is_causal" in hf_config or "causal" in flags:
        raise ValueError("is_causal / dflash_config.causal: would override the per-layer causality engines read")
    types = hf_config["layer_types"]
    sliding = SLIDING_ATTENTION in types
    if sliding and not hf_config.get("sliding_window"):
        raise ValueError("sliding_window: sliding_attention layers need a window")
    mixed = sliding and any(t != SLIDING_ATTENTION for t in types)
    rules = [
        f"all engines: integer dflash_config.mask_token_id {mask}, embedded with the target's own embedding "
        f"(no extra mask weight)",
        f"all engines: dflash_config.target_layer_ids {flags.get('target_layer_ids')}, block_size "
        f"{hf_config.get('block_size')}, weights fc / hidden_norm / layers.* / norm (no embedding, no LM head)",
        "vLLM qwen3_dflash.py _dflash_layer_causal: no is_causal / dflash_config.causal, so a layer is causal "
        "exactly when layer_types says sliding_attention (full layers non-causal)",
        "SGLang models/dflash.py: sliding_attention -> causal DECODER layer with window_left = sliding_window - 1, "
        "full_attention -> ENCODER_ONLY (non-causal)",
        "reference z-lab/dflash model.py: no is_causal, so sliding layers causal with q - k < sliding_window",
        f"transformers: AutoModel.from_pretrained(dir, trust_remote_code=True) via auto_map -> {MODELING_FILE}",
    ]
    if sliding:
        rules.append(f"sliding_window {hf_config['sliding_window']} counts the query itself (trained so)")
    if mixed:
        rules.append("vLLM: mixed sliding/full layers need the V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1)")
    return rules


#: What an export directory holds; ``--out`` may replace a directory holding only these.
EXPORT_FILES = frozenset({CONFIG_FILE, WEIGHTS_FILE, MODELING_FILE, TRAINED_WITH_FILE})


def check_out_dir(out: Path, src: Path) -> None:
    """Refuse an export directory whose replacement would lose anything but an earlier export.

    Args:
        out: the ``--out`` directory.
        src: the drafter directory being exported.

    Raises:
        ValueError: ``out`` is ``src`` or its training checkpoint, holds it (the run directory or
            any folder above) or lies inside it; ``out`` is a file; ``out`` is a directory holding
            anything other than :data:`EXPORT_FILES`.
    """
    o, d = out.resolve(), src.resolve()
    if d.name == "drafter" and (d.parent / "state.json").is_file():
        d = d.parent  # the whole training checkpoint is protected, not only its drafter/
    if o == d or d.is_relative_to(o) or o.is_relative_to(d):
        raise ValueError(f"--out {out}: would replace or nest in the drafter it exports ({src}); "
                         f"choose a directory outside that checkpoint")
    if o.exists() and not o.is_dir():
        raise ValueError(f"--out {out}: is a file, not a directory")
    if o.is_dir():
        other = sorted(p.name for p in o.iterdir() if p.name not in EXPORT_FILES)
        if other:
            raise ValueError(f"--out {out}: holds files that are not an export ({', '.join(other[:5])}"
                             f"{', ...' if len(other) > 5 else ''}); it would be replaced: choose a new or empty "
                             f"directory")


def export_drafter(checkpoint: Path, out: Path, dtype: str = "bfloat16") -> ExportReport:
    """Write the serving export of ``checkpoint`` into ``out`` (replaced atomically if it exists).

    Args:
        checkpoint: run directory, checkpoint or drafter directory (:func:`resolve_drafter_dir`).
        out: the directory to write.
        dtype: ``bfloat16`` (default) or ``float32``.

    Returns:
        :class:`ExportReport`.

    Raises:
        FileNotFoundError: no drafter at ``checkpoint``.
        ValueError: a bad ``dtype``; a drafter with a learned mask vector; a truncated or corrupt
            weights file; weights whose names or shapes do not match the config.
    """
    from safetensors.torch import load_file

    if dtype not in SAVE_DTYPES:
        raise ValueError(f"--dtype: must be one of {sorted(SAVE_DTYPES)}, got {dtype!r}")
    src = resolve_drafter_dir(checkpoint)
    out = Path(out)
    check_out_dir(out, src)
    config = DFlashDraftModel.load_config(src)
    check_drafter_weights(src)  # a truncated or corrupt file: one line, not a safetensors traceback
    state = load_file(str(src / WEIGHTS_FILE))
    expected = _expected_shapes(config)
    got = {k: tuple(v.shape) for k, v in state.items()}
    if got != expected:
        missing = sorted(set(expected) - set(got))
        unexpected = sorted(set(got) - set(expected))
        wrong = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
        raise ValueError(f"{src / WEIGHTS_FILE}: weights do not match {CONFIG_FILE}: missing {missing}, "
                         f"unexpected {unexpected}, wrong shape {wrong}")
    record = trained_with(src)  # kept so that decoding with the export is checked as with the checkpoint
    extra = {TRAINED_WITH_FILE: json.dumps(record, indent=1, sort_keys=True) + "\n"} if record else None
    write_drafter_directory(out, config, state, dtype=dtype, modeling_file=True, extra_files=extra)
    hf_config = json.loads((out / CONFIG_FILE).read_text())
    files = sorted((p.name, p.stat().st_size) for p in out.iterdir() if p.is_file())
    return ExportReport(directory=out, dtype=dtype, mask_token_id=int(config.mask_token_id),
                        layer_types=list(config.layer_types), sliding_window=hf_config.get("sliding_window"),
                        files=files, rules=engine_rules(hf_config))


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    """The CLI: export, then print what was written (``prog``: the command name ``--help`` shows).
    Returns the exit status (0 ok, 2 bad input)."""
    parser = argparse.ArgumentParser(prog=prog or "python -m dflash.inference.export",
                                     description="Export a trained DFlash drafter for vLLM / SGLang / transformers.")
    parser.add_argument("--checkpoint", required=True, type=Path,
                        help="run directory (newest checkpoint), checkpoint step-XXXXXXXX, or drafter directory")
    parser.add_argument("--out", required=True, type=Path, help="directory to write (a new or empty one, or an earlier export, which is replaced)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(SAVE_DTYPES),
                        help="weight dtype (default bfloat16, as released DFlash drafters)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        src = resolve_drafter_dir(args.checkpoint)
        report = export_drafter(src, args.out, args.dtype)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {src} -> {report.directory}")
    for name, size in report.files:
        print(f"  {name:<20} {size:>14,d} bytes")
    print(f"  dtype {report.dtype}; mask_token_id {report.mask_token_id}; layer_types {report.layer_types}; "
          f"sliding_window {report.sliding_window}")
    record = trained_with(src)
    if record:
        print("trained with (serve with the same tokenizer, chat template and thinking mode):")
        for key in sorted(record):
            print(f"  {IDENTITY_NAMES.get(key, key)}: {record[key]}")
    else:
        print("trained with: not recorded in this checkpoint")
    print("engine rules satisfied:")
    for rule in report.rules:
        print(f"  - {rule}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
