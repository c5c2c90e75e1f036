"""Turn a :class:`~dflash.config.RunConfig` into components: batch plans, slot spec, drafter.

Shared by the reference trainer and the workers, so both build exactly the same things.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from dflash.data.batching import BatchPlan, batch_tensor_specs
from dflash.config import RunConfig

__all__ = ["DataPlans", "TARGET_OUTPUTS", "build_batch_plans", "target_forward", "slot_spec", "target_hf_config", "build_drafter", "pad_token_id",
           "tokenizer_facts"]

log = logging.getLogger(__name__)


@dataclass
class DataPlans:
    """Tokenised data and its batch plans (``train`` over epochs, ``heldout`` at epoch 0)."""

    data: Any  # dflash.data.corpus.PreparedData
    train: BatchPlan
    heldout: Optional[BatchPlan]
    #: the target's tokenizer; None when the plans come from the launcher's cache (:func:`build_batch_plans`
    #: ``cache_dir``) with its tokenizer facts
    tokenizer: Any
    pad_id: int
    #: ``len(tokenizer)``: the tokens the tokenizer can produce
    tokenizer_size: int = 0
    #: the tokenizer fields of :func:`dflash.training.checkpoint_identity.run_identity`
    tokenizer_identity: dict = field(default_factory=dict)


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, else its EOS id, else 0."""
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if value is not None:
            return int(value)
    return 0


def tokenizer_facts(tokenizer: Any) -> dict[str, Any]:
    """What the workers need of the tokenizer, as JSON values: ``pad_id`` (:func:`pad_token_id`),
    ``size`` (``len(tokenizer)``) and ``identity`` (the tokenizer fields of
    :func:`dflash.training.checkpoint_identity.run_identity`). Stored in the data cache's ``meta.json`` by the
    launcher (:func:`dflash.data.corpus.prepare_cache`) so that workers need not load the tokenizer."""
    from dflash.training.checkpoint_identity import run_identity

    identity = run_identity(tokenizer)
    identity.pop("enable_thinking")
    return {"pad_id": pad_token_id(tokenizer), "size": len(tokenizer), "identity": identity}


def build_batch_plans(cfg: RunConfig, tokenizer: Any = None, log_report: bool = True,
                      cache_dir: Optional[Path] = None) -> DataPlans:
    """Tokenise ``cfg.data`` (or load the cache) and plan its batches.

    With ``cache_dir`` (a directory :func:`dflash.data.corpus.prepare_cache` made: workers, given it
    by the launcher) only the cached arrays are read (:func:`dflash.data.corpus.load_prepared`); the
    tokenizer is loaded only when the cache's ``meta.json`` lacks the launcher's
    :func:`tokenizer_facts`. Without it the tokenizer (``tokenizer``, else loaded from
    ``cfg.target``) finds or makes the cache and its facts are stored there.

    ``log_report=False`` logs the data report at DEBUG (workers: the launcher already logged it).

    Raises:
        ConfigError: from data preparation (missing dataset, nothing usable, ``cache_dir`` holding
            no complete cache, …).
    """
    from dflash.data.corpus import load_prepared, prepare_data

    def load_tokenizer(target_cfg):  # transformers' tokenizers are imported only when one is loaded
        from dflash.data.tokenizer import load_tokenizer as load

        return load(target_cfg)

    started = time.perf_counter()
    if cache_dir is not None:
        data = load_prepared(cache_dir, cfg, log_report)
        facts = data.tokenizer_facts
        if not facts:
            log.info("%s has no tokenizer facts: loading the tokenizer", Path(cache_dir) / "meta.json")
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.target)
            facts = tokenizer_facts(tokenizer)
    else:
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.target)
        facts = tokenizer_facts(tokenizer)
        data = prepare_data(cfg, tokenizer, log_report, facts)
    pad_id = int(facts["pad_id"])
    log.log(logging.INFO if cache_dir is not None else logging.DEBUG, "data from %s in %.2f s (%s)", data.cache_path,
            time.perf_counter() - started, "tokenizer loaded" if tokenizer is not None else "no tokenizer loaded")
    rows, seq = cfg.rows_per_batch, cfg.data.max_length
    train = BatchPlan(data.train, rows=rows, seq_len=seq, seed=cfg.data.seed, pad_id=pad_id)
    heldout = (BatchPlan(data.heldout, rows=rows, seq_len=seq, seed=cfg.data.seed, pad_id=pad_id)
               if len(data.heldout) else None)
    return DataPlans(data=data, train=train, heldout=heldout, tokenizer=tokenizer, pad_id=pad_id,
                     tokenizer_size=int(facts["size"]), tokenizer_identity=dict(facts["identity"]))


#: The slot tensors a target worker fills from its forward, in the order
#: :meth:`dflash.models.target.TargetModel.forward_with_hidden` returns them (``target_hidden``
#: only with ``drafter.distillation > 0``); the rest of a slot is the batch itself.
TARGET_OUTPUTS = ("features", "target_tokens", "target_hidden")


def target_forward(target: Any, with_hidden: bool) -> Callable[..., tuple]:
    """The target's forward that returns :data:`TARGET_OUTPUTS` in order: ``forward_with_hidden``
    when the slot carries ``target_hidden`` (``drafter.distillation > 0``), else ``forward_features``."""
    return target.forward_with_hidden if with_hidden else target.forward_features


def slot_spec(cfg: RunConfig, feature_size: int, feature_dtype: torch.dtype,
              hidden_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors of one slot: the batch contract plus the target's outputs.

    ``features [R, S, L·D]`` (target dtype) and ``target_tokens [R, S]`` int64 beside
    ``input_ids``, ``position_ids``, ``doc_ids``, ``loss_mask`` (docs/ARCHITECTURE.md); with
    ``drafter.distillation > 0`` also ``target_hidden [R, S, D]`` (target dtype), the target's
    final-normed hidden state (``hidden_size`` = D).
    """
    rows, seq = cfg.rows_per_batch, cfg.data.max_length
    spec: dict[str, tuple[tuple[int, ...], torch.dtype]] = dict(batch_tensor_specs(rows, seq))
    spec["features"] = ((rows, seq, feature_size), feature_dtype)
    spec["target_tokens"] = ((rows, seq), torch.int64)
    if cfg.drafter.distillation > 0:
        spec["target_hidden"] = ((rows, seq, hidden_size), feature_dtype)
    return spec


def target_hf_config(cfg: RunConfig) -> Any:
    """The target's Hugging Face config without loading its weights."""
    from transformers import AutoConfig

    from dflash.models.gguf_cache import gguf_hf_dir
    from dflash.models.random_target import build_random_config

    t = cfg.target
    if t.kind == "random":
        return build_random_config(t.arch, t.arch_overrides)
    directory = gguf_hf_dir(t.path) if t.kind == "gguf" else t.path
    return AutoConfig.from_pretrained(directory)


def drafter_config(cfg: RunConfig, target_config: Any, tokenizer_size: int, embedding_rows: int):
    """The :class:`dflash.models.drafter_config.DFlashConfig` this run's drafter gets (no weights touched).

    Raises:
        ConfigError: a bad ``target.layer_ids`` for this target.
        ValueError: a drafter setting the target's shape cannot take.
    """
    from dflash.models.drafter_config import DFlashConfig, mask_fallback_token_ids, resolve_mask_token_id
    from dflash.models.layer_ids import resolve_layer_ids

    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    layer_ids = resolve_layer_ids(cfg.target.layer_ids, int(text.num_hidden_layers), cfg.drafter.num_layers)
    mask_id = resolve_mask_token_id(cfg.drafter.mask_token_id, tokenizer_size, embedding_rows,
                                    mask_fallback_token_ids(target_config))
    return DFlashConfig.from_target(target_config, cfg.drafter, target_layer_ids=layer_ids, mask_token_id=mask_id)


def build_drafter(cfg: RunConfig, embed_tokens: torch.nn.Module, lm_head: torch.nn.Module, tokenizer_size: int,
                  device: torch.device, target_config: Any = None):
    """A fresh DFlash drafter (seeded by ``train.seed``) around the target's frozen embedding and head.

    ``drafter.gradient_checkpointing`` becomes the model's ``gradient_checkpointing``.

    Returns:
        :class:`dflash.models.drafter.DFlashDraftModel` on ``device`` in fp32 (bf16 autocast on GPU).
    """
    from dflash.models.drafter import DFlashDraftModel

    tc = target_config if target_config is not None else target_hf_config(cfg)
    dcfg = drafter_config(cfg, tc, tokenizer_size, embed_tokens.weight.shape[0])
    layer_ids, mask_id = dcfg.target_layer_ids, dcfg.mask_token_id
    torch.manual_seed(cfg.train.seed)
    model = DFlashDraftModel(dcfg, embed_tokens, lm_head, attention=cfg.drafter.attention,
                             gradient_checkpointing=cfg.drafter.gradient_checkpointing,
                             mlp_chunks=cfg.drafter.mlp_chunks,
                             checkpoint_layers=cfg.drafter.checkpoint_layers).to(device)
    log.info("drafter: %d layer(s), B=%d, mask token %d, target layers %s, %.2fM trainable params, "
             "gradient checkpointing %s", dcfg.num_hidden_layers, dcfg.block_size, mask_id, layer_ids,
             model.num_trainable_params() / 1e6,
             "off" if not model.gradient_checkpointing else "on" if model.checkpoint_layers is None
             else f"on for the first {model.checkpoint_layers} of {len(model.layers)} layer(s)")
    return model
