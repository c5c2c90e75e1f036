"""What a checkpoint's drafter was trained with, and whether it fits what it is used with now.

``state.json`` records what the drafter was trained with (:func:`run_identity`: tokenizer
fingerprint, chat template hash, thinking mode, target architecture / layer count / hidden size /
vocabulary size / layer ids) under ``trained_with``; :func:`check_fits` compares it with what a
resume, a decoding run or an export would use and raises :class:`CheckpointMismatch` with one
line naming the difference.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Optional

from dflash.training.checkpoint_load import read_state

__all__ = ["CheckpointMismatch", "FORCIBLE", "IDENTITY_NAMES", "TRAINED_WITH_FILE", "run_identity",
           "tokenizer_fingerprint", "check_fits", "trained_with"]

log = logging.getLogger(__name__)


class CheckpointMismatch(ValueError):
    """A checkpoint does not fit the tokenizer, chat template, thinking mode or target it is used with."""


#: Identity fields a user may knowingly change (``--force``): the drafter still loads and runs, but
#: what it learnt may not transfer (another chat template or thinking mode collapses acceptance).
FORCIBLE = ("tokenizer.sha256", "chat_template.sha256", "enable_thinking", "target.architecture")
#: The ``trained_with`` record in a serving export (a drafter directory without ``state.json``).
TRAINED_WITH_FILE = "trained_with.json"
#: What each identity field is, in a mismatch message.
IDENTITY_NAMES = {
    "tokenizer.size": "tokenizer size (tokens)",
    "tokenizer.sha256": "tokenizer fingerprint (sha256 of its vocabulary and special tokens)",
    "chat_template.sha256": "chat template (sha256)",
    "enable_thinking": "thinking mode (data.enable_thinking)",
    "target.architecture": "target architecture",
    "target.num_layers": "target layer count",
    "target.hidden_size": "target hidden size",
    "target.vocab_size": "target vocabulary size (embedding rows)",
    "target.layer_ids": "target layer ids (the drafter's context features)",
}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 (hex) of a tokenizer's vocabulary (token → id, sorted) and its special token ids.

    Two tokenizers with the same fingerprint map every text to the same ids. Costs ~0.1 s for a
    150k-token vocabulary.
    """
    vocab = sorted(tokenizer.get_vocab().items())
    special = {name: getattr(tokenizer, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    blob = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def run_identity(tokenizer: Any = None, target_config: Any = None, layer_ids: Optional[list[int]] = None,
                 enable_thinking: Optional[bool] = None,
                 tokenizer_identity: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """What a drafter is trained with or used with, as flat ``{field: value}`` (see :data:`IDENTITY_NAMES`).

    Args:
        tokenizer: a Hugging Face tokenizer (``get_vocab``, ``chat_template``, ``len``); ``None``
            leaves out the tokenizer and template fields.
        target_config: the target's Hugging Face config (no weights needed); ``None`` leaves out
            the target fields.
        layer_ids: the target layers feeding the drafter; ``None`` leaves the field out.
        enable_thinking: ``data.enable_thinking`` (``None`` = the template's default).
        tokenizer_identity: the tokenizer and template fields of an earlier ``run_identity(tokenizer)``,
            used when ``tokenizer`` is ``None`` (a worker that has not loaded the tokenizer).

    Returns:
        JSON-serialisable values; fields left out are not compared by :func:`check_fits`.
    """
    out: dict[str, Any] = {"enable_thinking": enable_thinking}
    if tokenizer is not None:
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # several named templates
            template = json.dumps(template, sort_keys=True)
        out["tokenizer.size"] = len(tokenizer)
        out["tokenizer.sha256"] = tokenizer_fingerprint(tokenizer)
        out["chat_template.sha256"] = (hashlib.sha256(template.encode("utf-8")).hexdigest()
                                       if isinstance(template, str) else None)
    elif tokenizer_identity is not None:
        out.update({k: tokenizer_identity[k] for k in ("tokenizer.size", "tokenizer.sha256", "chat_template.sha256")})
    if target_config is not None:
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        archs = getattr(target_config, "architectures", None) or [type(target_config).__name__]
        out["target.architecture"] = str(archs[0])
        out["target.num_layers"] = int(text.num_hidden_layers)
        out["target.hidden_size"] = int(text.hidden_size)
        out["target.vocab_size"] = int(text.vocab_size)
    if layer_ids is not None:
        out["target.layer_ids"] = [int(i) for i in layer_ids]
    return out


def _short(value: Any) -> str:
    if isinstance(value, str) and len(value) == 64:  # a sha256
        return value[:12]
    return json.dumps(value)


def _checkpoint_root(path: Path) -> Path:
    """The training checkpoint directory of ``path`` (itself, or the parent of its ``drafter/``)."""
    path = Path(path)
    if not (path / "state.json").is_file() and (path.parent / "state.json").is_file():
        return path.parent
    return path


def trained_with(checkpoint_dir: Path) -> dict[str, Any]:
    """The ``trained_with`` record of a checkpoint (:func:`run_identity` at training time).

    Args:
        checkpoint_dir: ``runs/<name>/checkpoints/step-XXXXXXXX``, its ``drafter/`` directory, or a
            serving export (its :data:`TRAINED_WITH_FILE`).

    Returns:
        ``{field: value}``; empty when the checkpoint records none or its ``state.json`` (an export's
        :data:`TRAINED_WITH_FILE`) is missing or unreadable (a bare drafter directory).
    """
    root = _checkpoint_root(checkpoint_dir)
    try:
        if not (root / "state.json").is_file() and (root / TRAINED_WITH_FILE).is_file():
            record = json.loads((root / TRAINED_WITH_FILE).read_text())
        else:
            record = read_state(root).get("trained_with")
        return dict(record or {})
    except (OSError, ValueError, TypeError):
        return {}


def check_fits(checkpoint_dir: Path, identity: dict[str, Any], force: bool = False) -> list[str]:
    """Check that a checkpoint fits what it is about to be used with; stop with one line if not.

    Compares the checkpoint's ``state.json`` ``trained_with`` record with ``identity``
    (:func:`run_identity` of the tokenizer, target and thinking mode in use). Fields left out on
    either side are not compared (a checkpoint that records nothing is only checked for the
    vocabulary below). Independently, a tokenizer with more tokens than the drafter's target
    embedding has rows (``drafter/config.json`` ``vocab_size``) is refused: its ids would index
    past the embedding.

    Args:
        checkpoint_dir: ``runs/<name>/checkpoints/step-XXXXXXXX`` or its ``drafter/`` directory.
        identity: what is used now (:func:`run_identity`).
        force: accept differences in :data:`FORCIBLE` fields (tokenizer fingerprint, chat template,
            thinking mode, architecture name); they are returned so the caller can log them.

    Returns:
        The differences accepted because of ``force`` (empty when everything fits).

    Raises:
        CheckpointMismatch: one line naming the checkpoint and each difference, and ``--force``
            where every difference is one a user may knowingly accept.
    """
    root = _checkpoint_root(checkpoint_dir)
    saved = trained_with(root)
    try:
        drafter_cfg = json.loads(((root / "drafter") if (root / "drafter").is_dir() else root).joinpath(
            "config.json").read_text())
        if isinstance(drafter_cfg.get("vocab_size"), int):
            saved.setdefault("target.vocab_size", drafter_cfg["vocab_size"])
    except (OSError, ValueError):
        pass
    hard, soft = [], []
    size, rows = identity.get("tokenizer.size"), saved.get("target.vocab_size")
    if isinstance(size, int) and isinstance(rows, int) and size > rows:
        hard.append(f"the tokenizer has {size} tokens but the drafter's target embedding has {rows} rows "
                    f"(another tokenizer than the one it was trained with?)")
    for key, name in IDENTITY_NAMES.items():
        if key in saved and key in identity and saved[key] != identity[key]:
            text = f"{name}: checkpoint {_short(saved[key])}, now {_short(identity[key])}"
            (soft if key in FORCIBLE else hard).append(text)
    if hard or (soft and not force):
        hint = " (pass --force to use it anyway)" if soft and not hard else ""
        raise CheckpointMismatch(f"{root} does not fit what it is used with: {'; '.join(hard + soft)}{hint}")
    for text in soft:
        log.warning("%s was trained with another %s (--force)", root, text)
    return soft
