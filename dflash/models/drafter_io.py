"""Saving and reading a drafter as a Hugging Face directory.

Format (docs/DFLASH.md, Checkpoint format): ``config.json`` (:meth:`DFlashConfig.to_hf_dict`) and
``model.safetensors`` whose tensor names follow the public DFlash drafters (``fc.weight``,
``hidden_norm.weight``, ``layers.{i}.self_attn.q_proj.weight``, …, ``norm.weight``); no
embedding and no LM head (they are the target's). A serving export also ships
:data:`MODELING_FILE` (:mod:`dflash.models.modeling_dflash`) and an ``auto_map`` naming it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Union

import torch
from torch import Tensor

from dflash.models.drafter_config import ARCHITECTURE, DFlashConfig
from dflash.utils import atomic_directory

__all__ = [
    "AUTO_MAP",
    "CONFIG_FILE",
    "LEARNED_MASK_MESSAGE",
    "MODELING_FILE",
    "SAVE_DTYPES",
    "WEIGHTS_FILE",
    "modeling_source",
    "check_drafter_weights",
    "read_drafter_config",
    "read_drafter_weights",
    "write_drafter_directory",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
#: File name of the modeling code shipped beside exported weights (``auto_map`` points at it).
MODELING_FILE = "modeling_dflash.py"
#: ``auto_map`` of an exported drafter: ``AutoModel.from_pretrained(dir, trust_remote_code=True)``.
AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}
#: dtypes :func:`write_drafter_directory` writes.
SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

#: Why a drafter with ``dflash_config.mask_embedding`` / ``mask_token_id: null`` is refused.
LEARNED_MASK_MESSAGE = (
    "this drafter was trained with its own learned mask vector (dflash_config.mask_embedding, "
    "mask_token_id null): no serving engine embeds the mask positions that way, so it cannot be served "
    "as trained. Train it again: the mask token is an integer id whose frozen target "
    "embedding row is the mask (see drafter.mask_token_id).")


def modeling_source() -> str:
    """The text shipped with an export as :data:`MODELING_FILE`: the source of
    :mod:`dflash.models.modeling_dflash`, the module the training drafter's layers come from,
    unchanged (it imports torch and transformers only)."""
    return (Path(__file__).with_name(MODELING_FILE)).read_text()


def _match_umask(path: Path) -> None:
    """Give ``path`` the mode a plain file gets under the process umask (safetensors writes 0600,
    which a serving engine running as another user cannot read)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_drafter_directory(directory: Union[str, os.PathLike], config: DFlashConfig, state: dict[str, Tensor],
                            dtype: Optional[str] = None, modeling_file: bool = False,
                            extra_files: Optional[dict[str, str]] = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (+ the modeling file) into ``directory``, atomically.

    Files go to a temporary sibling directory first, flushed to disk, which then replaces
    ``directory`` (:func:`dflash.utils.atomic_directory`: an existing one is moved aside and
    deleted only after the rename). Holds no embedding and no LM
    head. Floating-point tensors are cast to ``dtype``; ``config.json`` states it (``dtype`` and
    ``torch_dtype``). With ``modeling_file`` the directory also holds :data:`MODELING_FILE` and
    the config an ``auto_map`` naming it, so ``transformers.AutoModel.from_pretrained(directory,
    trust_remote_code=True)`` builds the drafter.

    Args:
        directory: the HF directory to write.
        config: the drafter's config (``mask_token_id`` must be set).
        state: ``{name: tensor}`` under the public DFlash names.
        dtype: ``float32`` or ``bfloat16`` (default: ``config.dtype``).
        modeling_file: ship the modeling file and ``auto_map``.
        extra_files: ``{file name: text}`` written beside them, in the same atomic replacement.

    Returns:
        the directory.

    Raises:
        ValueError: an unknown ``dtype`` or no mask token id.
    """
    from safetensors.torch import save_file

    dtype = dtype or config.dtype
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype: must be one of {sorted(SAVE_DTYPES)}, got {dtype!r}")
    cfg = config.to_hf_dict(dtype=dtype)
    if modeling_file:
        cfg["auto_map"] = dict(AUTO_MAP)
    cast = SAVE_DTYPES[dtype]
    tensors = {k: (v.detach().to("cpu", cast) if v.is_floating_point() else v.detach().to("cpu")).contiguous()
               for k, v in state.items()}
    target = Path(directory)
    with atomic_directory(target, replace=True) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        _match_umask(tmp / WEIGHTS_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        if modeling_file:
            (tmp / MODELING_FILE).write_text(modeling_source())
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return target


def read_drafter_config(directory: Union[str, os.PathLike]) -> DFlashConfig:
    """Read ``directory/config.json`` of a drafter written by :func:`write_drafter_directory` (or a
    public DFlash drafter's).

    Raises:
        FileNotFoundError: no config.json.
        ValueError: not a DFlash drafter config, or a drafter trained with its own learned mask
            vector (``dflash_config.mask_embedding``), which no engine can serve.
    """
    path = Path(directory) / CONFIG_FILE
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if ARCHITECTURE not in (data.get("architectures") or []):
        raise ValueError(f"{path}: architectures {data.get('architectures')} does not name {ARCHITECTURE}")
    flags = data.get("dflash_config") or {}
    if flags.get("mask_embedding") or flags.get("mask_token_id") is None:
        raise ValueError(f"{path}: {LEARNED_MASK_MESSAGE}")
    return DFlashConfig.from_hf_dict(data)


def check_drafter_weights(directory: Union[str, os.PathLike]) -> list[str]:
    """The tensor names of ``directory/model.safetensors``, reading only its header: a cheap check,
    before any model loads, that the weights file is there and whole.

    Raises:
        FileNotFoundError: no weights file.
        ValueError: the file is not a complete safetensors file (truncated, corrupt).
    """
    from safetensors import SafetensorError, safe_open

    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no weights file")
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except SafetensorError as exc:
        raise ValueError(f"{path}: not a complete safetensors file ({exc})") from exc


def read_drafter_weights(directory: Union[str, os.PathLike],
                         device: Optional[Union[str, torch.device]] = None) -> dict[str, Tensor]:
    """``{name: tensor}`` of ``directory/model.safetensors``, in fp32 (a bf16 export is upcast), on
    ``device`` (default CPU).

    Raises:
        FileNotFoundError: no weights file.
    """
    from safetensors.torch import load_file

    state = load_file(str(Path(directory) / WEIGHTS_FILE), device=str(device) if device else "cpu")
    return {k: v.float() for k, v in state.items()}
