"""Range and cross-field checks of a built :class:`~dflash.config.schema.RunConfig`.

:func:`validate_config` runs one check function per section, in a fixed order (the first bad key
is the one reported); every failure is a :class:`ConfigError` ``<dotted key>: <what is wrong>``.
Types were already checked when the dataclasses were built (``dflash/config/coerce.py``).
Also here: :func:`resolve_device`, the device the cluster checks depend on.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from dflash.config.schema import (
    ClusterConfig,
    ConfigError,
    DataConfig,
    DrafterConfig,
    RunConfig,
    TargetConfig,
    TrainConfig,
    TransportConfig,
    derive_placement,
)

__all__ = ["validate_config", "resolve_device"]


def _visible_gpus() -> int:
    """CUDA devices torch sees here (0 without torch or CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - torch missing or broken CUDA: treat as no GPU
        return 0


def resolve_device(cfg: RunConfig, gpu_count: Optional[int] = None) -> str:
    """``cuda`` or ``cpu`` for this run (``cluster.device: auto`` picks CUDA when visible)."""
    if cfg.cluster.device != "auto":
        return cfg.cluster.device
    count = _visible_gpus() if gpu_count is None else gpu_count
    return "cuda" if count > 0 else "cpu"


def validate_config(cfg: RunConfig, gpu_count: Optional[int] = None) -> RunConfig:
    """Check every range and cross-field rule; return ``cfg`` (with ``cluster.nodes``: its
    ``cluster.targets`` / ``cluster.drafters`` derived from the placement, :func:`derive_placement`).

    Args:
        gpu_count: GPUs on this machine (``None`` = ask torch).

    Raises:
        ConfigError: naming the first bad key.
    """
    _need(bool(cfg.name) and "/" not in cfg.name, "name", f"must be a non-empty name without '/', got {cfg.name!r}")
    _check_drafter(cfg.drafter)
    _check_target(cfg.target)
    _check_data(cfg.data, cfg.drafter)
    _check_train(cfg.train)
    _check_cluster(cfg.cluster)
    device = resolve_device(cfg, gpu_count)
    if device == "cuda":
        _check_cluster_gpus(cfg.cluster, _visible_gpus() if gpu_count is None else gpu_count)
    _check_transport(cfg.transport, device)
    _need(cfg.target.linear_attention != "fla" or device == "cuda", "target.linear_attention",
          "fla runs on CUDA devices only (use auto or torch on CPU)")
    _need(not (cfg.target.linear_attention == "fla" and cfg.target.compile_scope == "forward"),
          "target.compile_scope", "forward captures CUDA graphs, which fla's varlen kernels cannot run in "
          "(use auto or layer)")
    _check_peak_env()
    _need(cfg.log.every >= 1, "log.every", "must be >= 1")
    _need(cfg.checkpoint.every >= 0, "checkpoint.every", "must be >= 0")
    _need(cfg.checkpoint.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")
    _check_regenerate(cfg)
    return cfg


def _check_peak_env() -> None:
    """``DFLASH_PEAK_TFLOPS``, when set, is a positive number (the workers read it for MFU)."""
    import os

    from dflash.models.flops import PEAK_ENV, env_peak_flops

    try:
        env_peak_flops()
    except ValueError:
        raise ConfigError(f"{PEAK_ENV}: expected a positive number of TFLOP/s, "
                          f"got {os.environ.get(PEAK_ENV, '').strip()!r}") from None


def _need(ok: bool, key: str, msg: str) -> None:
    """Raise ``ConfigError("<key>: <msg>")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def _check_drafter(d: DrafterConfig) -> None:
    """The ``drafter`` section: sizes, and options that apply only with a given sampling or weighting."""
    _need(d.mlp_chunks >= 1, "drafter.mlp_chunks", f"must be >= 1, got {d.mlp_chunks}")
    _need(d.checkpoint_layers is None or d.gradient_checkpointing, "drafter.checkpoint_layers",
          f"applies only with drafter.gradient_checkpointing: true (got checkpoint_layers: {d.checkpoint_layers})")
    _need(d.checkpoint_layers is None or 0 <= d.checkpoint_layers <= d.num_layers, "drafter.checkpoint_layers",
          f"must be null (every layer) or 0 ... drafter.num_layers ({d.num_layers}), got {d.checkpoint_layers}")
    _need(d.activation_memory_budget is None or 0.0 < d.activation_memory_budget <= 1.0,
          "drafter.activation_memory_budget", f"must be in (0, 1] or null, got {d.activation_memory_budget}")
    _need(d.activation_memory_budget is None or d.compile, "drafter.activation_memory_budget",
          "applies only with drafter.compile: true (it steers torch.compile's partitioner)")
    _need(d.block_size >= 2, "drafter.block_size", f"must be >= 2 (an anchor plus at least one predicted token), got {d.block_size}")
    _need(d.num_layers >= 1, "drafter.num_layers", f"must be >= 1, got {d.num_layers}")
    _need(d.anchors_per_row >= 1, "drafter.anchors_per_row", f"must be >= 1, got {d.anchors_per_row}")
    _need(d.anchors_per_conversation is None or d.anchor_sampling == "conversation", "drafter.anchors_per_conversation",
          f"applies only to drafter.anchor_sampling: conversation (got anchor_sampling: {d.anchor_sampling}); "
          "set it to null or use anchor_sampling: conversation")
    _need(d.anchors_per_conversation is None or d.anchors_per_conversation >= 1, "drafter.anchors_per_conversation",
          f"must be >= 1 or null (no cap), got {d.anchors_per_conversation}")
    _need(d.loss_gamma is None or d.loss_weighting == "decay", "drafter.loss_gamma",
          f"applies only to drafter.loss_weighting: decay (got loss_weighting: {d.loss_weighting}); set it to null")
    _need(d.dpace_alpha is None or d.loss_weighting == "dpace", "drafter.dpace_alpha",
          f"applies only to drafter.loss_weighting: dpace (got loss_weighting: {d.loss_weighting}); set it to null")
    _need(d.dpace_alpha is None or 0.0 <= d.dpace_alpha <= 1.0, "drafter.dpace_alpha",
          f"must be in [0, 1], got {d.dpace_alpha}")
    _need(0.0 <= d.distillation <= 1.0, "drafter.distillation", f"must be in [0, 1], got {d.distillation}")
    _need(not d.label_chain or d.labels == "target", "drafter.label_chain",
          f"applies only to drafter.labels: target (the greedy path is the target's; got labels: {d.labels})")
    _need(d.distillation == 0 or d.loss_weighting == "decay", "drafter.distillation",
          f"applies only to drafter.loss_weighting: decay (D-PACE weights come from the cross entropy alone; "
          f"got loss_weighting: {d.loss_weighting})")
    _need(d.sliding_window >= 1, "drafter.sliding_window", f"must be >= 1, got {d.sliding_window}")
    _need(d.loss_gamma is None or d.loss_gamma > 0, "drafter.loss_gamma", f"must be > 0, got {d.loss_gamma}")
    _need(d.mask_token_id is None or d.mask_token_id >= 0, "drafter.mask_token_id", f"must be >= 0, got {d.mask_token_id}")
    _need(d.intermediate_size is None or d.intermediate_size >= 1, "drafter.intermediate_size", "must be >= 1")
    if d.layer_types is not None:
        _need(len(d.layer_types) == d.num_layers, "drafter.layer_types",
              f"has {len(d.layer_types)} entries but drafter.num_layers is {d.num_layers}")
        for i, lt in enumerate(d.layer_types):
            _need(lt in ("full_attention", "sliding_attention"), f"drafter.layer_types[{i}]",
                  f"must be full_attention or sliding_attention, got {lt!r}")


def _check_target(tg: TargetConfig) -> None:
    """The ``target`` section: the path or architecture its ``kind`` needs, and ``layer_ids``."""
    if tg.kind == "hf":
        _need(tg.path is not None, "target.path", "is required for target.kind: hf")
        _need(Path(tg.path).is_dir(), "target.path", f"no such directory: {tg.path}")
        weights = [f for pattern in ("*.safetensors", "pytorch_model*.bin") for f in Path(tg.path).glob(pattern)]
        _need(bool(weights), "target.path", f"{tg.path} holds no weights (*.safetensors or pytorch_model*.bin)")
    elif tg.kind == "gguf":
        _need(tg.path is None or Path(tg.path).is_file(), "target.path", f"no such GGUF file: {tg.path}")
    elif tg.kind == "random":
        _need(tg.arch is not None, "target.arch", "is required for target.kind: random")
    if tg.layer_ids is not None:
        _need(len(tg.layer_ids) >= 1, "target.layer_ids", "must not be empty")
        _need(all(i >= 0 for i in tg.layer_ids), "target.layer_ids", f"must be >= 0, got {tg.layer_ids}")
        _need(len(set(tg.layer_ids)) == len(tg.layer_ids), "target.layer_ids", f"has duplicates: {tg.layer_ids}")


def _check_data(t: DataConfig, d: DrafterConfig) -> None:
    """The ``data`` section: sequence length against ``drafter.block_size``, the token budget, the dataset file."""
    _need(t.max_length >= d.block_size + 1, "data.max_length",
          f"must be > drafter.block_size ({d.block_size}), got {t.max_length}")
    _need(t.token_budget >= t.max_length, "data.token_budget",
          f"({t.token_budget}) is smaller than one sequence (data.max_length = {t.max_length})")
    _need(t.heldout_conversations >= 0, "data.heldout_conversations", "must be >= 0")
    _need(t.max_conversations is None or t.max_conversations >= 1, "data.max_conversations", "must be >= 1")
    if t.dataset != "sharegpt":
        _need(Path(t.dataset).is_file(), "data.dataset", f"no such file: {t.dataset} (use 'sharegpt' or a JSONL path)")
    for i, extra in enumerate(t.extra_datasets):
        key = f"data.extra_datasets[{i}]"
        _need(isinstance(extra, str), key, f"expected a path, got {extra!r}")
        if extra != "sharegpt":
            _need(not Path(extra).is_dir(), key, f"{extra} is a directory (give the JSONL file in it)")
            _need(Path(extra).is_file(), key, f"no such file: {extra} (use 'sharegpt' or a JSONL path)")
    _need(t.tokenize_workers is None or t.tokenize_workers >= 1, "data.tokenize_workers",
          f"must be >= 1 (or null: by the data's size), got {t.tokenize_workers}")
    if t.extra_token_ratio is not None:
        _need(math.isfinite(t.extra_token_ratio) and t.extra_token_ratio > 0, "data.extra_token_ratio",
              f"must be a finite number > 0 (or null: every extra row), got {t.extra_token_ratio}")
        _need(bool(t.extra_datasets), "data.extra_token_ratio", "samples data.extra_datasets, which is empty "
                                                          "(set data.extra_token_ratio=null too)")


def _check_train(tr: TrainConfig) -> None:
    """The ``train`` section: schedule lengths and optimiser ranges."""
    _need(tr.epochs >= 1, "train.epochs", f"must be >= 1, got {tr.epochs}")
    _need(tr.max_steps is None or tr.max_steps >= 1, "train.max_steps", f"must be >= 1, got {tr.max_steps}")
    _need(tr.lr > 0, "train.lr", f"must be > 0, got {tr.lr}")
    _need(0 <= tr.warmup_ratio < 1, "train.warmup_ratio", f"must be in [0, 1), got {tr.warmup_ratio}")
    _need(0 <= tr.min_lr_ratio <= 1, "train.min_lr_ratio", f"must be in [0, 1], got {tr.min_lr_ratio}")
    _need(tr.grad_clip > 0, "train.grad_clip", f"must be > 0, got {tr.grad_clip}")
    _need(tr.eval_every >= 0, "train.eval_every", f"must be >= 0, got {tr.eval_every}")
    _need(tr.eval_batches is None or tr.eval_batches >= 0, "train.eval_batches",
          f"must be >= 0 (0 = no held-out evaluation, null = all held-out batches), got {tr.eval_batches}")
    _need(tr.eval_head_tokens >= 1, "train.eval_head_tokens",
          f"must be >= 1 (response tokens counted by eval/tau_head), got {tr.eval_head_tokens}")


def _check_cluster(c: ClusterConfig) -> None:
    """The ``cluster`` section, whatever the device: placement (:func:`_check_nodes`), worker lists,
    restart policy, CPU threads."""
    _check_nodes(c)
    _need(len(c.targets) >= 1, "cluster.targets", "needs at least one target worker")
    _need(len(c.drafters) >= 1, "cluster.drafters", "needs at least one drafter worker")
    for node in range(c.num_nodes):
        where = f"cluster.nodes[{node}]" if c.nodes else "cluster"
        for role in ("targets", "drafters"):
            ids = _node_gpus(c, node, role)
            _need(len(set(ids)) == len(ids), f"{where}.{role}", f"lists a GPU twice: {ids}")
    _need(all(i >= 0 for i in c.targets + c.drafters), "cluster.targets", "GPU ids must be >= 0")
    _need(c.max_restarts >= 0, "cluster.max_restarts", f"must be >= 0, got {c.max_restarts}")
    _need(c.restart_backoff_s >= 0, "cluster.restart_backoff_s", f"must be >= 0, got {c.restart_backoff_s}")
    for key in ("cpu_threads_per_target", "cpu_threads_per_drafter"):
        _need(getattr(c, key) is None or getattr(c, key) >= 1, f"cluster.{key}", "must be >= 1")
    _need(c.peak_tflops is None or c.peak_tflops > 0, "cluster.peak_tflops", f"must be > 0, got {c.peak_tflops}")


def _check_cluster_gpus(c: ClusterConfig, count: int) -> None:
    """On CUDA: every GPU id exists among the ``count`` of this machine, and no GPU hosts both a
    target and a drafter unless ``cluster.allow_shared_gpu``."""
    for role in ("targets", "drafters"):
        for gpu in getattr(c, role):
            _need(gpu < count, f"cluster.{role}", f"GPU {gpu} does not exist (this machine has {count} GPU(s))")
    shared = sorted({g for node in range(c.num_nodes) for g in _node_gpus(c, node, "targets")
                     if g in _node_gpus(c, node, "drafters")})
    _need(not shared or c.allow_shared_gpu, "cluster.drafters",
          f"GPU(s) {shared} are used by both targets and drafters (set cluster.allow_shared_gpu: true for the 1-GPU layout)")


def _check_transport(tp: TransportConfig, device: str) -> None:
    """The ``transport`` section: ring slots, heartbeat and peer timeout, a carrier that fits ``device``."""
    _need(tp.slots >= 1, "transport.slots", f"must be >= 1, got {tp.slots}")
    _need(tp.heartbeat_s > 0, "transport.heartbeat_s", "must be > 0")
    _need(tp.peer_timeout_s > tp.heartbeat_s, "transport.peer_timeout_s", "must be larger than transport.heartbeat_s")
    if device == "cpu":
        _need(tp.carrier in ("auto", "shm", "tcp"), "transport.carrier", f"{tp.carrier} needs CUDA; use shm or tcp on CPU")


def _node_gpus(c: ClusterConfig, node: int, role: str) -> list[int]:
    """The GPU ids of ``role`` (``targets`` / ``drafters``) placed on ``node``, in rank order."""
    return [g for r, g in enumerate(getattr(c, role)) if c.node_of(f"{role[:-1]}.{r}") == node]


def _check_nodes(c: ClusterConfig) -> None:
    """``cluster.nodes``: a non-empty list of ``{targets: [...], drafters: [...]}`` mappings of GPU
    ids, every node with at least one worker; derives ``targets`` / ``drafters`` from it."""
    if c.nodes is None:
        return
    _need(len(c.nodes) >= 1, "cluster.nodes", "needs at least one node (or null for one machine)")
    for i, node in enumerate(c.nodes):
        _need(isinstance(node, dict), f"cluster.nodes[{i}]", f"expected a mapping {{targets: [...], drafters: [...]}}, got {node!r}")
        unknown = sorted(set(node) - {"targets", "drafters"})
        _need(not unknown, f"cluster.nodes[{i}]", f"unknown key(s) {unknown} (known: drafters, targets)")
        for role in ("targets", "drafters"):
            ids = node.get(role, []) or []
            _need(isinstance(ids, list) and all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in ids),
                  f"cluster.nodes[{i}].{role}", f"expected a list of GPU ids >= 0, got {ids!r}")
        _need(node.get("targets") or node.get("drafters"), f"cluster.nodes[{i}]", "places no worker on this node")
    derive_placement(c)
    _need(c.node_join_timeout_s > 0, "cluster.node_join_timeout_s", "must be > 0")


def _need_writable_folder(path: Path, key: str) -> None:
    """Raise ``ConfigError`` naming ``key`` when a folder above ``path`` is a file (the output's
    folder could not be made); missing folders are fine (made when the output is written)."""
    for folder in path.absolute().parents:
        if folder.exists():
            _need(folder.is_dir(), key, f"cannot be written: {folder} is a file, not a folder ({path})")
            return


def _check_regenerate(cfg: RunConfig) -> None:
    """The ``regenerate`` section's ranges (checked whether enabled or not) and, when enabled, its output."""
    r = cfg.regenerate
    _need(r.max_new_tokens >= 1, "regenerate.max_new_tokens", f"must be >= 1, got {r.max_new_tokens}")
    _need(r.batch_size >= 1, "regenerate.batch_size", f"must be >= 1, got {r.batch_size}")
    _need(r.max_turns is None or r.max_turns >= 1, "regenerate.max_turns", f"must be >= 1, got {r.max_turns}")
    _need(r.max_prompt_tokens is None or r.max_prompt_tokens >= 1, "regenerate.max_prompt_tokens",
          f"must be >= 1, got {r.max_prompt_tokens}")
    _need(r.temperature >= 0, "regenerate.temperature", f"must be >= 0, got {r.temperature}")
    _need(0 < r.top_p <= 1, "regenerate.top_p", f"must be in (0, 1], got {r.top_p}")
    _need(r.limit is None or r.limit >= 1, "regenerate.limit", f"must be >= 1, got {r.limit}")
    _need(r.max_seconds is None or (math.isfinite(r.max_seconds) and r.max_seconds > 0), "regenerate.max_seconds",
          f"must be a finite number of seconds > 0 (null = no limit), got {r.max_seconds}")
    if r.attention is not None:
        from dflash.inference.decode_layers import attention_spec_error

        error = attention_spec_error(r.attention)
        _need(error is None, "regenerate.attention", error or "")
    s = r.sampled
    _need(math.isfinite(s.temperature) and s.temperature > 0, "regenerate.sampled.temperature",
          f"must be > 0 (the greedy pass is regenerate.output), got {s.temperature}")
    _need(0 < s.top_p <= 1, "regenerate.sampled.top_p", f"must be in (0, 1], got {s.top_p}")
    _need(s.max_turns is None or s.max_turns >= 1, "regenerate.sampled.max_turns", f"must be >= 1, got {s.max_turns}")
    if not r.enabled:
        return
    _need(bool(r.output), "regenerate.output", "is required when regenerate.enabled is true")
    out = Path(r.output)
    _need(not out.is_dir(), "regenerate.output", f"is a directory: {r.output}")
    _need_writable_folder(out, "regenerate.output")
    _need(out.resolve() != Path(cfg.data.dataset).resolve(), "regenerate.output",
          f"must differ from data.dataset ({cfg.data.dataset}): the source is read while the output is written")
    if s.output is None:
        return
    _need(s.output != "", "regenerate.sampled.output", "must be a path (or null: no sampled pass)")
    sampled = Path(s.output)
    _need(not sampled.is_dir(), "regenerate.sampled.output", f"is a directory: {s.output}")
    _need_writable_folder(sampled, "regenerate.sampled.output")
    for key, other in (("regenerate.output", r.output), ("data.dataset", cfg.data.dataset),
                       *((f"data.extra_datasets[{i}]", e) for i, e in enumerate(cfg.data.extra_datasets))):
        _need(sampled.resolve() != Path(other).resolve(), "regenerate.sampled.output",
              f"must differ from {key} ({other}): the sampled pass writes its own file, which the training stage "
              f"adds to data.extra_datasets")
