"""Whether a checkpoint can be continued by this launch's config, checked before any model loads.

:func:`check_resume` runs two checks: the drafter this config builds has the checkpoint's shape
(:func:`resume_mismatches` names each differing field and the config key that sets it); then the
checkpoint was trained with this tokenizer, chat template, thinking mode and target
(:func:`dflash.training.checkpoint_identity.check_fits`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from dflash.training.resume import flat_config

__all__ = ["RESUME_FIELDS", "check_resume", "expected_drafter_fields", "resume_mismatches", "resume_mismatch_message"]

TARGET_SOURCE = "the target model: target.kind / path / arch / arch_overrides"
#: Fields of a drafter's ``config.json`` that ``--resume`` compares with what this run's config
#: builds (:func:`resume_mismatches`): each changes a parameter's shape or what the weights mean.
#: Value: the run-config key that sets it.
RESUME_FIELDS = {
    "num_hidden_layers": "drafter.num_layers",
    "block_size": "drafter.block_size",
    "layer_types": "drafter.layer_types",
    "sliding_window": "drafter.sliding_window",
    "intermediate_size": "drafter.intermediate_size",
    "target_layer_ids": "target.layer_ids",
    "mask_token_id": "drafter.mask_token_id",
    "hidden_size": TARGET_SOURCE,
    "num_attention_heads": TARGET_SOURCE,
    "num_key_value_heads": TARGET_SOURCE,
    "head_dim": TARGET_SOURCE,
    "vocab_size": TARGET_SOURCE,
    "num_target_layers": TARGET_SOURCE,
    "rope_theta": TARGET_SOURCE,
}
#: Keys of the run's saved ``config.yaml`` quoted when they differ (what the run was started with).
RESUME_CONFIG_KEYS = ("target.kind", "target.path", "target.arch", "target.arch_overrides", "target.tokenizer",
                      "target.layer_ids", "drafter.num_layers", "drafter.block_size", "drafter.mask_token_id",
                      "drafter.layer_types", "drafter.sliding_window", "drafter.intermediate_size")


def check_resume(cfg: Any, run_dir: Path, ckpt: Path, tokenizer: Any, force: bool = False) -> None:
    """Check, before any model loads, that checkpoint ``ckpt`` of ``run_dir`` can be continued by
    a launch of ``cfg`` with ``tokenizer``.

    Two checks, in this order: the drafter this config builds has the checkpoint's shape
    (:func:`resume_mismatches`: layers, block size, target layer ids, mask token, the target's
    dimensions); then the checkpoint was trained with this tokenizer, chat template, thinking
    mode and target (:func:`dflash.training.checkpoint_identity.check_fits`, which ``force`` relaxes for the
    fields a user may knowingly change).

    Args:
        cfg: this launch's :class:`dflash.config.RunConfig`.
        run_dir: the run directory (its ``config.yaml`` says what the run was started with).
        ckpt: the checkpoint to continue (``<run_dir>/checkpoints/step-XXXXXXXX``).
        tokenizer: this launch's tokenizer (``len(tokenizer)`` tokens).
        force: accept another tokenizer, chat template, thinking mode or architecture name.

    Raises:
        CheckpointMismatch: one paragraph naming each differing field and how to proceed.
        ConfigError: a bad ``target.layer_ids`` / ``target.arch`` for this target.
        OSError: a missing model file or directory.
    """
    from dflash.training.checkpoint_identity import CheckpointMismatch, check_fits, run_identity

    mismatches = resume_mismatches(cfg, ckpt, len(tokenizer))
    if mismatches:
        raise CheckpointMismatch(resume_mismatch_message(cfg, run_dir, ckpt, mismatches))
    check_fits(ckpt, run_identity(tokenizer, _cheap_target_config(cfg), None, cfg.data.enable_thinking), force=force)


def _cheap_target_config(cfg: Any):
    """The target's HF config when reading it loads no weights and converts nothing, else ``None``
    (a GGUF target whose conversion is not cached)."""
    from dflash.training.factory import target_hf_config

    if cfg.target.kind == "gguf":
        from dflash.data import assets
        from dflash.models.gguf_cache import gguf_converted

        path = Path(cfg.target.path) if cfg.target.path is not None else assets.smollm2_gguf_path()
        if not path.is_file() or not gguf_converted(path):
            return None
    return target_hf_config(cfg)


def expected_drafter_fields(cfg: Any, tokenizer_size: int) -> dict:
    """The :data:`RESUME_FIELDS` of the drafter this run would build (as ``dflash.training.factory.build_drafter``
    does), without loading any weights.

    The target's HF config is read as the factory reads it; a GGUF target that is not converted
    yet is described from its metadata instead (:func:`dflash.models.target_loader.describe_target`), which
    leaves out the fields it cannot tell (heads, head_dim, RoPE, the default intermediate size).

    Raises:
        ConfigError: a bad ``target.layer_ids`` / ``target.arch`` for this target.
        OSError: a missing model file or directory.
    """
    from dflash.models.masks import SLIDING_ATTENTION

    quiet = logging.getLogger("dflash.models.drafter_config")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its RoPE / mask warnings are the workers' to give
    try:
        tc = _cheap_target_config(cfg)
        out = _fields_from_target_config(cfg, tc, tokenizer_size) if tc is not None else \
            _fields_from_target_metadata(cfg, tokenizer_size)
    finally:
        quiet.setLevel(level)
    out["_sliding"] = SLIDING_ATTENTION in out["layer_types"]
    return out


def _fields_from_target_config(cfg: Any, tc: Any, tokenizer_size: int) -> dict:
    from dflash.config import ConfigError
    from dflash.training.factory import drafter_config

    text = tc.get_text_config() if hasattr(tc, "get_text_config") else tc
    try:
        dcfg = drafter_config(cfg, tc, tokenizer_size, int(text.vocab_size))
    except ValueError as exc:
        raise ConfigError(f"drafter: {exc}") from None
    return {name: getattr(dcfg, name) for name in RESUME_FIELDS}


def _fields_from_target_metadata(cfg: Any, tokenizer_size: int) -> dict:
    from dflash.models.drafter_config import resolve_mask_token_id
    from dflash.models.masks import FULL_ATTENTION
    from dflash.models.target_loader import describe_target

    d = cfg.drafter
    info = describe_target(cfg.target, d.num_layers)
    # Without the target's config its special token ids are unknown: the mask token is
    # compared only when it does not fall back to one of them.
    mask_id = (resolve_mask_token_id(d.mask_token_id, tokenizer_size, info.vocab_size)
               if d.mask_token_id is not None or tokenizer_size < info.vocab_size else None)
    out = {"num_hidden_layers": d.num_layers, "block_size": d.block_size,
           "layer_types": list(d.layer_types) if d.layer_types else [FULL_ATTENTION] * d.num_layers,
           "sliding_window": d.sliding_window, "target_layer_ids": list(info.layer_ids),
           "mask_token_id": mask_id, "hidden_size": info.hidden_size, "vocab_size": info.vocab_size,
           "num_target_layers": info.num_layers}
    if d.intermediate_size is not None:
        out["intermediate_size"] = d.intermediate_size
    if mask_id is None:
        del out["mask_token_id"]
    return out


def resume_mismatches(cfg: Any, ckpt: Path, tokenizer_size: int) -> list[str]:
    """How the drafter in checkpoint ``ckpt`` differs from the one this run's config builds.

    Compares the checkpoint's ``drafter/config.json`` with :func:`expected_drafter_fields`, field
    by field (:data:`RESUME_FIELDS`; ``sliding_window`` only when a layer of either uses it;
    ``rope_theta`` to a relative 1e-6).

    Returns:
        One ``field (set by key): checkpoint X, this run Y`` per differing field; empty when they
        match. An unreadable ``config.json`` is one entry saying so.

    Raises:
        ConfigError / OSError: from :func:`expected_drafter_fields`.
    """
    from dflash.models.drafter import DFlashDraftModel
    from dflash.models.masks import FULL_ATTENTION, SLIDING_ATTENTION

    directory = Path(ckpt) / "drafter"
    try:
        saved_cfg = DFlashDraftModel.load_config(directory)  # refuses a learned mask vector
    except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
        return [f"{directory / 'config.json'} cannot be read as a DFlash drafter config ({exc})"]
    saved = {name: getattr(saved_cfg, name) for name in RESUME_FIELDS if hasattr(saved_cfg, name)}
    expected = expected_drafter_fields(cfg, tokenizer_size)
    sliding = expected.pop("_sliding") or SLIDING_ATTENTION in (saved_cfg.layer_types or [FULL_ATTENTION])
    out = []
    for name, key in RESUME_FIELDS.items():
        if name not in expected or name not in saved or (name == "sliding_window" and not sliding):
            continue
        a, b = saved[name], expected[name]
        same = (abs(float(a) - float(b)) <= 1e-6 * max(1.0, abs(float(a)))) if name == "rope_theta" else a == b
        if not same:
            out.append(f"{name} (set by {_field_source(cfg, name, key)}): checkpoint {json.dumps(a)}, "
                       f"this run {json.dumps(b)}")
    return out


def _field_source(cfg: Any, name: str, key: str) -> str:
    """What sets field ``name`` in this run: ``key``, or what a ``null`` there defaults to."""
    if name == "target_layer_ids" and cfg.target.layer_ids is None:
        return "target.layer_ids=null: the DFlash rule for drafter.num_layers and the target's depth"
    if name == "layer_types" and cfg.drafter.layer_types is None:
        return "drafter.layer_types=null: full attention in each of drafter.num_layers"
    if name == "intermediate_size" and cfg.drafter.intermediate_size is None:
        return "drafter.intermediate_size=null: the target's"
    if name == "mask_token_id" and cfg.drafter.mask_token_id is None:
        return ("drafter.mask_token_id=null: the target's first unused embedding row, else its unk / pad / eos / bos "
                "token")
    return key


def resume_mismatch_message(cfg: Any, run_dir: Path, ckpt: Path, mismatches: list[str]) -> str:
    """The one-paragraph error for :func:`resume_mismatches`: the fields, what the run was started
    with (its saved ``config.yaml``, where it differs), and how to proceed."""
    import yaml

    text = (f"this run's drafter does not match the checkpoint it would continue "
            f"({ckpt / 'drafter' / 'config.json'}): {'; '.join(mismatches)}.")
    saved_file = run_dir / "config.yaml"
    try:
        saved = flat_config(yaml.safe_load(saved_file.read_text()))
    except (OSError, yaml.YAMLError, AttributeError):
        saved = {}
    now = flat_config(cfg.to_dict())
    started_with = [f"{k}={json.dumps(saved[k])}" for k in RESUME_CONFIG_KEYS if k in saved and saved[k] != now.get(k)]
    if started_with:
        text += f" The run's {saved_file} was written with {', '.join(started_with)}."
    return (text + " To continue this run, drop or fix the override(s) so that these fields match; to start a "
            "new run in this directory instead, pass --overwrite (its checkpoints are deleted), or choose "
            "another run_dir / name.")
