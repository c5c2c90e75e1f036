"""One optimizer step of the drafter from one batch's tensors.

Shared by the single-process reference trainer (``dflash/training/reference.py``) and the drafter
workers (``dflash/runtime/drafter.py``): both hand :meth:`DrafterTrainer.step` the batch contract's
tensors plus the target's outputs (docs/ARCHITECTURE.md) and the batch's ``(epoch, batch_id)``.

A step, each stage in one module, in this order (:meth:`DrafterTrainer.prepare`, then
:meth:`DrafterTrainer.forward_loss`):

1. anchors (:mod:`dflash.training.anchors`; seeded by ``anchor_seed(seed, epoch, batch_id)``, so
   every process draws the same ones for the same batch; per row or per conversation,
   ``drafter.anchor_sampling``);
2. block labels and the loss denominator (:mod:`dflash.training.objective`);
3. the attention masks, built eagerly (:mod:`dflash.models.masks`);
4. the drafter forward (:mod:`dflash.models.drafter`);
5. the decayed cross-entropy, accuracy per block position and τ (:mod:`dflash.training.objective`);

then backward → gradient sync → clip → AdamW → schedule → zero grad.

**Data parallelism.** With ``N`` ranks, each on its own batch, the update must equal one process
on the concatenated batch, whose loss is ``Σ_ranks Σ CE·w / Σ_ranks Σ w``. Each rank therefore
back-propagates ``loss_sum_rank / W_global`` where ``W_global`` comes from the
``weight_sum_reduce`` hook (an all-reduce SUM of the local ``Σ w``, or of the block count with
D-PACE weights: :func:`dflash.training.objective.loss_denominator`; it depends only on the labels, so it
is known before the forward pass), and the gradients are then *summed* over ranks by the
``grad_sync`` hook. A caller that wraps the model in DDP instead (which *averages* gradients)
passes ``grads_averaged_over=N`` so the local objective is multiplied by ``N``.

Nothing in :meth:`step` reads a value back to the host: metrics are returned as tensors and
the caller decides when to call :func:`metrics_to_host`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import Tensor, nn

from dflash.config import default_gamma
from dflash.models.drafter import DFlashDraftModel
from dflash.models.masks import AttentionMask, drafter_attention_masks, restage_attention_mask
from dflash.training.anchors import anchor_generator, draw_anchors, response_offsets
from dflash.training.chunked_ce import compiled_linear_ce_chunk, compiled_linear_kd_chunk, loss_chunk_rows
from dflash.training.evaluation import EvalOutput, leading_tau, position_tau, walked_tau_sums
from dflash.training.objective import (DPACE_ALPHA, LossOutput, build_block_labels, dflash_loss, loss_denominator,
                                       teacher_rows)
from dflash.training.optim import LRSchedule, build_optimizer, build_scheduler

__all__ = ["EVAL_EPOCH", "REQUIRED_KEYS", "PreparedBatch", "DrafterTrainer", "metrics_to_host"]

logger = logging.getLogger(__name__)

#: ``epoch`` fed to :func:`dflash.training.anchors.anchor_seed` for evaluation anchors (fixed per batch id).
EVAL_EPOCH = -1
#: Batch tensors a step needs (``target_tokens`` only with ``drafter.labels: target``).
REQUIRED_KEYS = ("input_ids", "position_ids", "doc_ids", "loss_mask", "features")

WeightSumReduce = Callable[[Tensor], Tensor]
GradSync = Callable[[list[nn.Parameter]], None]


@dataclass
class PreparedBatch:
    """Everything a batch's forward pass and loss read, on the trainer's device."""

    #: The batch contract's tensors plus ``features`` (and ``target_tokens``).
    tensors: dict[str, Tensor]
    #: ``[R, A]`` int64 / bool.
    anchors: Tensor
    anchor_keep: Tensor
    #: ``[R, A, B]`` int64 / bool.
    labels: Tensor
    valid: Tensor
    #: The loss denominator of this batch (fp32 scalar): ``Σ w``, or the block count with D-PACE.
    weight_sum: Tensor
    #: ``{layer type: mask}`` (:func:`dflash.models.masks.drafter_attention_masks`).
    attn_masks: dict[str, AttentionMask]
    #: ``[R, A, B − 1, D]`` the target's hidden rows that teach block positions 1 … B − 1
    #: (:func:`dflash.training.objective.teacher_rows`); ``None`` without distillation.
    teacher: Optional[Tensor] = None


def metrics_to_host(metrics: dict[str, Any]) -> dict[str, Any]:
    """Tensors → Python floats / lists (one host sync per tensor); other values unchanged."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, Tensor):
            out[key] = value.item() if value.numel() == 1 else value.tolist()
        else:
            out[key] = value
    return out


class DrafterTrainer:
    """Optimizer, schedule and the step/eval logic of one drafter replica.

    Args:
        model: a :class:`DFlashDraftModel`, or a DDP wrapper around one.
        train_cfg: :class:`dflash.config.TrainConfig` (lr, betas, weight decay, warm-up, clip, and
            ``eval_head_tokens`` and ``eval_walk`` for :meth:`evaluate`).
        drafter_cfg: :class:`dflash.config.DrafterConfig` (block size, anchors per row, anchor
            sampling, loss weighting, γ, labels, compile).
        total_steps: optimizer steps of the whole run (the schedule's length).
        device: where the batch tensors live / are moved.
        seed: anchor seed (``None`` = ``train_cfg.seed``).
        weight_sum_reduce: ``Σw_local -> Σw_global`` (e.g. an all-reduce SUM); ``None`` = local.
        grad_sync: sums the trainable parameters' ``.grad`` over ranks in place; ``None`` = none.
        grads_averaged_over: ``N`` when gradients are *averaged* over ``N`` ranks by someone
            else (DDP); the local objective is multiplied by it.
        loss_chunk: rows of logits per LM-head chunk; ``None`` = :func:`dflash.training.chunked_ce.loss_chunk_rows`
            of the drafter's vocabulary.
        autocast_dtype: ``"auto"`` = bf16 autocast on CUDA, none on CPU; or a dtype / ``None``.
        compile_mode: ``torch.compile`` mode of the drafter forward (and so its backward) when
            ``drafter_cfg.compile`` and on CUDA (ignored on CPU); ``"config"`` = ``drafter.compile_mode``;
            ``None`` = eager.
            ``drafter_cfg.compile`` and on CUDA (ignored on CPU).
        schedule: the learning rate of every step (:class:`dflash.training.optim.LRSchedule`); ``None`` =
            the recipe's curve over ``total_steps``.

    Raises:
        ValueError: ``total_steps < 1`` or the model is not a DFlash drafter.
    """

    def __init__(self, model: nn.Module, train_cfg: Any, drafter_cfg: Any, total_steps: int,
                 device: Union[str, torch.device], seed: Optional[int] = None, *,
                 weight_sum_reduce: Optional[WeightSumReduce] = None, grad_sync: Optional[GradSync] = None,
                 grads_averaged_over: int = 1, loss_chunk: Optional[int] = None,
                 autocast_dtype: Union[str, torch.dtype, None] = "auto",
                 compile_mode: Optional[str] = "config", schedule: Optional[LRSchedule] = None) -> None:
        self.model = model
        self.module: DFlashDraftModel = getattr(model, "module", model)
        if not isinstance(self.module, DFlashDraftModel):
            raise ValueError(f"model: expected a DFlashDraftModel (or a wrapper of one), got {type(model).__name__}")
        if grads_averaged_over < 1:
            raise ValueError(f"grads_averaged_over: must be >= 1, got {grads_averaged_over}")
        self.train_cfg = train_cfg
        self.drafter_cfg = drafter_cfg
        self.device = torch.device(device)
        self.seed = train_cfg.seed if seed is None else seed
        self.total_steps = total_steps
        self.block_size = drafter_cfg.block_size
        if self.module.block_size != self.block_size:
            raise ValueError(f"drafter.block_size {self.block_size} != model block size {self.module.block_size}")
        self.gamma = drafter_cfg.loss_gamma if drafter_cfg.loss_gamma is not None else default_gamma(self.block_size)
        self.num_anchors = drafter_cfg.anchors_per_row
        self.anchor_sampling = drafter_cfg.anchor_sampling
        self.anchors_per_conversation = drafter_cfg.anchors_per_conversation
        self.loss_weighting = drafter_cfg.loss_weighting
        self.dpace_alpha = drafter_cfg.dpace_alpha if drafter_cfg.dpace_alpha is not None else DPACE_ALPHA
        self.labels = drafter_cfg.labels
        #: cut each block where the text leaves the target's greedy path (drafter.label_chain)
        self.label_chain = bool(drafter_cfg.label_chain)
        #: λ of the forward KL to the target's distribution (0: cross entropy alone)
        self.distillation = float(drafter_cfg.distillation)
        #: evaluation's head: anchors within this many tokens of their response's start
        self.eval_head_tokens = train_cfg.eval_head_tokens
        #: evaluation also walks decoding's anchors over every held-out response (eval/tau_walk)
        self.eval_walk = bool(train_cfg.eval_walk)
        self.loss_chunk = loss_chunk if loss_chunk is not None else loss_chunk_rows(self.module.config.vocab_size)
        self.weight_sum_reduce = weight_sum_reduce
        self.grad_sync = grad_sync
        self.grads_averaged_over = grads_averaged_over
        if autocast_dtype == "auto":
            autocast_dtype = torch.bfloat16 if self.device.type == "cuda" else None
        self.autocast_dtype: Optional[torch.dtype] = autocast_dtype  # type: ignore[assignment]

        self.optimizer = build_optimizer(model, train_cfg)
        self.schedule = schedule if schedule is not None else LRSchedule.nominal(total_steps, train_cfg)
        self.scheduler = build_scheduler(self.optimizer, total_steps, train_cfg, self.schedule)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.step_count = 0

        self._forward = self._hidden
        self._staging: dict[Any, Tensor] = {}
        #: whether the drafter forward (and the LM-head loss chunks) run compiled.
        if compile_mode == "config":
            compile_mode = drafter_cfg.compile_mode
        self.compiled = bool(drafter_cfg.compile and self.device.type == "cuda" and compile_mode is not None)
        #: the compiled forward replays CUDA graphs (its inputs must keep their addresses: staged)
        self.graphs = self.compiled and compile_mode == "reduce-overhead"
        if drafter_cfg.compile and self.device.type != "cuda":
            logger.info("drafter.compile: ignored on %s (CUDA graphs need a GPU); the drafter runs eager",
                        self.device.type)
        budget = drafter_cfg.activation_memory_budget
        if self.compiled and budget is not None:
            # read by the partitioner when a graph compiles (at the first step): set process-wide,
            # as a drafter process compiles only the drafter
            import torch._functorch.config as functorch_config

            functorch_config.activation_memory_budget = float(budget)
            logger.info("drafter: activation_memory_budget %.2f (torch.compile's partitioner)", budget)
        if self.compiled and compile_mode == "layer":
            self.module.compile_layers()
            logger.info("drafter layers compiled (each attention and MLP sub-layer, no CUDA graphs)")
        elif self.compiled:
            self._forward = torch.compile(self._hidden, mode=compile_mode, dynamic=False)
            logger.info("drafter forward compiled (mode=%s)", compile_mode)
        weighting = (f"gamma={self.gamma:.3g}" if self.loss_weighting == "decay"
                     else f"D-PACE alpha={self.dpace_alpha:.3g}")
        sampling = "per row" if self.anchor_sampling == "row" else (
            f"per conversation (at most {self.anchors_per_conversation or self.num_anchors} each)")
        logger.info("drafter trainer: %d trainable params, B=%d, A=%d drawn %s, %s, labels=%s%s, %d steps",
                    self.module.num_trainable_params(), self.block_size, self.num_anchors, sampling, weighting,
                    self.labels + (" (cut off the greedy path)" if self.label_chain else ""),
                    f", distillation {self.distillation:g}" if self.distillation else "", total_steps)

    # ----------------------------------------------------------------------- pieces

    def _batch(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        missing = [k for k in REQUIRED_KEYS if k not in tensors]
        if self.labels == "target" and "target_tokens" not in tensors:
            missing.append("target_tokens")
        if self.distillation and "target_hidden" not in tensors:
            missing.append("target_hidden")
        if missing:
            raise KeyError(f"batch is missing tensor(s) {missing}")
        return {k: v.to(self.device, non_blocking=True) for k, v in tensors.items() if isinstance(v, Tensor)}

    def draw_anchors(self, loss_mask: Tensor, doc_ids: Tensor, epoch: int, batch_id: int) -> tuple[Tensor, Tensor]:
        """The anchors of one batch: ``(anchors [R, A] int64, keep [R, A] bool)`` on ``loss_mask``'s device.

        Seeded by ``anchor_seed(seed, epoch, batch_id)`` on this trainer's device and drawn by
        ``drafter.anchor_sampling`` (:func:`dflash.training.anchors.draw_anchors`), so the reference
        trainer and every drafter worker draw the same anchors for the same batch.
        """
        gen = anchor_generator(self.seed, epoch, batch_id, self.device)
        return draw_anchors(loss_mask, doc_ids, self.num_anchors, self.anchor_sampling,
                            self.anchors_per_conversation, gen)

    def prepare(self, tensors: dict[str, Tensor], epoch: int, batch_id: int,
                anchors: Optional[tuple[Tensor, Tensor]] = None, teacher: bool = True) -> PreparedBatch:
        """A batch on this trainer's device with its anchors, labels, loss denominator and masks.

        In order: anchors (seeded by ``(seed, epoch, batch_id)``, or given;
        :mod:`dflash.training.anchors`), block labels and the loss denominator
        (:mod:`dflash.training.objective`), then the drafter's attention masks
        (:mod:`dflash.models.masks`).

        The masks are built here, eagerly, never inside the compiled forward: on CUDA (torch
        2.11), a flex_attention ``BlockMask`` built *inside* the compiled drafter forward (its
        ``argsort``-based block indices) gave a slightly different forward and gradients ~500×
        off the eager ones, so the compiled step did not learn (``scripts/gpu_compile_diag.py``;
        docs/benchmarks.md, Correctness of the compiled step). Built here, the compiled gradients
        match eager to ~1 % (bf16).

        Args:
            tensors: the batch contract's tensors plus ``features`` / ``target_tokens``.
            anchors: ``(anchors [R, A], keep [R, A])`` to use instead of drawing them.
            teacher: gather the distillation teacher's rows (``drafter.distillation > 0``); ``False``
                for a pass that computes no loss (the walked τ).

        Raises:
            KeyError: a required tensor is missing.
        """
        t = self._batch(tensors)
        if anchors is None:
            anc, keep = self.draw_anchors(t["loss_mask"], t["doc_ids"], epoch, batch_id)
        else:
            anc, keep = (x.to(self.device) for x in anchors)
        labels, valid = build_block_labels(t["input_ids"], t.get("target_tokens"), t["loss_mask"], t["doc_ids"],
                                           anc, keep, self.block_size, self.labels, chain=self.label_chain)
        rows = teacher_rows(t["target_hidden"], anc, self.block_size) if self.distillation and teacher else None
        return PreparedBatch(tensors=t, anchors=anc, anchor_keep=keep, labels=labels, valid=valid,
                             weight_sum=loss_denominator(valid, self.gamma, self.loss_weighting),
                             attn_masks=drafter_attention_masks(self.module, anc, keep, t["doc_ids"]), teacher=rows)

    def _stage(self, name: Any, x: Tensor) -> Tensor:
        """Copy a compiled-forward input into this trainer's persistent buffer ``name``.

        The compiled step then reads the same tensors (addresses, strides, alignment) at warm-up
        and at every step, whatever the caller hands in: views into the transport's receive
        buffers, which alternate between steps, or fresh tensors (anchors, masks). One device
        copy per input (~2 GiB of features at the Qwen3-8B shape: ~1 ms on an H200).

        Measured without it (docs/benchmarks.md, Correctness of the compiled step): with the masks built per step outside
        the graph and passed in fresh, the compiled step re-records its CUDA graphs on 10 of
        17 steps in one process and on every step in the drafter worker.
        """
        buf = self._staging.get(name)
        if buf is None or buf.shape != x.shape or buf.dtype != x.dtype or buf.device != x.device:
            buf = self._staging[name] = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return buf.copy_(x, non_blocking=True)

    def _hidden(self, features: Tensor, input_ids: Tensor, position_ids: Tensor, doc_ids: Tensor,
                anchors: Tensor, anchor_keep: Tensor, attn_masks: dict[str, AttentionMask]) -> Tensor:
        """Drafter forward under the trainer's autocast: ``[R, A, B, D]`` (what gets compiled)."""
        if self.autocast_dtype is None:
            return self.model(features, input_ids, position_ids, doc_ids, anchors, anchor_keep, attn_masks)
        with torch.autocast(self.device.type, dtype=self.autocast_dtype):
            return self.model(features, input_ids, position_ids, doc_ids, anchors, anchor_keep, attn_masks)

    def forward_loss(self, prepared: PreparedBatch, compiled: bool = True) -> LossOutput:
        """Drafter forward and loss of a prepared batch (grad mode as the caller set it).

        The drafter forward runs compiled when the trainer compiles; the chunked LM-head loss
        stays eager (a Python loop over row chunks that compilation would only unroll).
        """
        t = prepared.tensors
        args = (t["features"], t["input_ids"], t["position_ids"], t["doc_ids"], prepared.anchors, prepared.anchor_keep)
        if compiled and self.graphs:
            # Every tensor the compiled forward reads lives in a persistent buffer (CUDA graphs
            # re-record when an input they treat as static moves), masks included.
            staged = [self._stage(("input", i), x) for i, x in enumerate(args)]
            masks = {lt: restage_attention_mask(m, self._stage, ("mask", lt)) for lt, m in prepared.attn_masks.items()}
            # Each call is a new step for CUDAGraph Trees: the previous step's graph outputs (its
            # hidden states, and gradients, dropped by ``zero_grad(set_to_none=True)``) are dead.
            torch.compiler.cudagraph_mark_step_begin()
            hidden = self._forward(*staged, masks)
        else:  # compiled without CUDA graphs, or compiled per layer (``_forward`` is ``_hidden``), or eager
            forward = self._forward if compiled else self._hidden
            hidden = forward(*args, prepared.attn_masks)
        # Compiled runs also compile the LM-head loss chunks (fused fp32 softmax passes); the
        # eval path (compiled=False) stays eager, so it never triggers a compile after warm-up.
        chunk_fn = None
        if compiled and self.compiled:
            chunk_fn = compiled_linear_kd_chunk() if self.distillation else compiled_linear_ce_chunk()
        return dflash_loss(hidden, self.module.lm_head, prepared.labels, prepared.valid, self.gamma,
                           chunk=self.loss_chunk, block_keep=prepared.anchor_keep, chunk_fn=chunk_fn,
                           weighting=self.loss_weighting, dpace_alpha=self.dpace_alpha,
                           teacher=prepared.teacher, distillation=self.distillation)

    def forward_backward(self, tensors: dict[str, Tensor], epoch: int, batch_id: int, *,
                         anchors: Optional[tuple[Tensor, Tensor]] = None,
                         weight_sum_reduce: Optional[WeightSumReduce] = None,
                         prepared: Optional[PreparedBatch] = None) -> tuple[LossOutput, Tensor]:
        """Forward, loss and backward; gradients accumulate into ``.grad`` (not yet synced).

        The back-propagated objective is ``loss_sum · grads_averaged_over / W_global``.
        ``prepared``: the batch as :meth:`prepare` made it (``tensors``, ``anchors`` are then unused).

        Returns:
            ``(LossOutput of this batch, W_global)``.
        """
        self.model.train()
        if prepared is None:
            prepared = self.prepare(tensors, epoch, batch_id, anchors)
        reduce = weight_sum_reduce or self.weight_sum_reduce
        w_global = reduce(prepared.weight_sum.clone()) if reduce is not None else prepared.weight_sum
        out = self.forward_loss(prepared)
        objective = out.loss_sum * (self.grads_averaged_over / w_global.clamp_min(torch.finfo(torch.float32).tiny))
        objective.backward()
        return out, w_global

    def optimizer_step(self, grad_sync: Optional[GradSync] = None) -> Tensor:
        """Sync gradients (sum over ranks), clip, AdamW, schedule, zero grad.

        Returns:
            the gradient norm before clipping (fp32 scalar tensor).
        """
        sync = grad_sync or self.grad_sync
        if sync is not None:
            sync(self.params)
        grads = [p for p in self.params if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(grads, self.train_cfg.grad_clip, foreach=True)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        return grad_norm.detach()

    # ----------------------------------------------------------------------- public steps

    def step(self, tensors: dict[str, Tensor], epoch: int, batch_id: int, *,
             anchors: Optional[tuple[Tensor, Tensor]] = None,
             weight_sum_reduce: Optional[WeightSumReduce] = None,
             grad_sync: Optional[GradSync] = None) -> dict[str, Any]:
        """One optimizer step on one batch.

        Args:
            tensors: ``input_ids``, ``position_ids``, ``doc_ids``, ``loss_mask`` ``[R, S]``,
                ``features [R, S, L·D]``, ``target_tokens [R, S]`` (docs/ARCHITECTURE.md).
            epoch, batch_id: seed the anchors (with the trainer's seed).
            anchors: explicit ``(anchors, keep)`` (tests, replays).
            weight_sum_reduce, grad_sync: per-call overrides of the constructor's hooks.

        Returns:
            metrics (tensors unless noted): ``loss`` (this batch's mean), ``loss_sum``,
            ``weight_sum``, ``global_weight_sum``, ``tau``, ``tau_sum``, ``num_blocks``,
            ``block_pos_acc [B]``, ``block_pos_correct [B]``, ``block_pos_count [B]`` (indexed by block position),
            ``grad_norm``, ``lr`` (float, the rate this step used), ``step`` (int, after it),
            ``flops`` (int64 tensor, the step's model FLOPs: :meth:`dflash.models.drafter.DFlashDraftModel.flops`).

        Raises:
            KeyError: a required tensor is missing.
        """
        lr = self.scheduler.get_last_lr()[0]
        prepared = self.prepare(tensors, epoch, batch_id, anchors)
        out, w_global = self.forward_backward(tensors, epoch, batch_id, weight_sum_reduce=weight_sum_reduce,
                                              prepared=prepared)
        flops = self.module.flops(prepared.anchors, prepared.anchor_keep, prepared.tensors["doc_ids"],
                                  distillation=bool(self.distillation), head_rows=out.head_rows).total
        # Clone: with CUDA graphs the outputs live in memory the next replay overwrites.
        stats = LossOutput.from_stats_vector(out.stats_vector().clone())
        grad_norm = self.optimizer_step(grad_sync)
        return {
            "loss": stats.loss,
            "loss_sum": stats.loss_sum,
            "weight_sum": stats.weight_sum,
            "global_weight_sum": w_global.detach().clone(),
            "tau": stats.tau,
            "tau_sum": stats.tau_sum,
            "num_blocks": stats.num_blocks,
            "block_pos_acc": stats.block_pos_accuracy,
            "block_pos_correct": stats.block_pos_correct,
            "block_pos_count": stats.block_pos_count,
            "grad_norm": grad_norm,
            "lr": lr,
            "step": self.step_count,
            "flops": flops,
        }

    @torch.no_grad()
    def evaluate(self, tensors: dict[str, Tensor], batch_id: int, epoch: int = EVAL_EPOCH,
                 walk: Optional[bool] = None) -> EvalOutput:
        """Loss / τ / per-block-position accuracy *sums* of one held-out batch, without gradients.

        Anchors are deterministic: ``anchor_seed(seed, EVAL_EPOCH, batch_id)``, the same at every
        evaluation. Besides τ over every kept block, the same forward gives τ over the *head*
        blocks: kept blocks whose anchor's offset in its response
        (:func:`dflash.training.anchors.response_offsets`) is below ``train.eval_head_tokens``.
        With ``train.eval_walk`` it also walks decoding's anchors over every response of the batch
        (:func:`dflash.training.evaluation.walked_tau_sums` on :meth:`position_tau`: extra eager
        forwards, after the sampled anchors', which they leave as they are); ``walk`` overrides
        ``train.eval_walk`` (``False``: the drafter worker's warm-up, which only warms the kernels).
        Add the returned :class:`EvalOutput` stats over batches (and ranks) with
        :meth:`EvalOutput.stats_vector`, then read ``loss``, ``tau``, ``tau_head``, ``tau_walk``,
        ``tau_walk_head``, ``block_pos_accuracy``; ``block_tau [R, A]`` holds this batch's τ per block.
        """
        was_training = self.model.training
        self.model.eval()
        try:
            prepared = self.prepare(tensors, epoch, batch_id)
            out = self.forward_loss(prepared, compiled=False)
            t = prepared.tensors
            walk = (walked_tau_sums(self.position_tau(t), t["loss_mask"], t["doc_ids"], self.eval_head_tokens)
                    if (self.eval_walk if walk is None else walk) else None)
        finally:
            self.model.train(was_training)
        offsets = response_offsets(t["loss_mask"], t["doc_ids"]).gather(1, prepared.anchors)
        head = prepared.anchor_keep & (offsets >= 0) & (offsets < self.eval_head_tokens)
        return EvalOutput.from_loss(out, head, walk)

    @torch.no_grad()
    def position_tau(self, tensors: dict[str, Tensor]) -> Tensor:
        """τ at every valid anchor of a batch, ``[R, S]`` fp32, 0 elsewhere
        (:func:`dflash.training.evaluation.position_tau`).

        Each chunk of ``drafter.anchors_per_row`` anchors goes through :meth:`prepare` (with the
        batch's labels, ``drafter.labels``) and the drafter forward eagerly, and its blocks are
        scored by :func:`dflash.training.evaluation.leading_tau`. The model's train/eval mode is
        the caller's.

        Raises:
            KeyError: a required tensor is missing.
        """
        t = self._batch(tensors)

        def block_tau(anchors: Tensor, keep: Tensor) -> Tensor:
            prepared = self.prepare(t, EVAL_EPOCH, 0, anchors=(anchors, keep), teacher=False)
            p = prepared.tensors
            hidden = self._hidden(p["features"], p["input_ids"], p["position_ids"], p["doc_ids"], prepared.anchors,
                                  prepared.anchor_keep, prepared.attn_masks)
            return leading_tau(hidden, self.module.lm_head, prepared.labels, prepared.valid, prepared.anchor_keep,
                               self.loss_chunk)

        return position_tau(t["loss_mask"], t["doc_ids"], self.num_anchors, block_tau)

    # ----------------------------------------------------------------------- checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, schedule and step count (the model's weights go through ``save_pretrained``)."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "step": self.step_count, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            KeyError: a field is missing.
        """
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = int(state["step"])
        # the saved scheduler carries the old run's base rate and the optimizer its last rate: this
        # run's schedule decides (the launcher has said how it differs)
        self.scheduler.base_lrs = [self.schedule.lr] * len(self.optimizer.param_groups)
        rate = self.schedule.rate(self.step_count)
        for group in self.optimizer.param_groups:
            group["initial_lr"] = self.schedule.lr
            group["lr"] = rate
        self.scheduler._last_lr = [rate] * len(self.optimizer.param_groups)
        if state.get("seed", self.seed) != self.seed:
            logger.warning("checkpoint anchor seed %s differs from this run's %s", state.get("seed"), self.seed)

    def trainable_parameters(self) -> Iterable[nn.Parameter]:
        return iter(self.params)
