"""Drafter worker: one process per drafter GPU (or CPU process), data-parallel. One loop.

Start-up: join the drafters' torch.distributed group (NCCL on GPU, gloo on CPU; the launcher
sets a torchrun-compatible environment), build the drafter around the target's frozen
embedding and LM head (only those two tensors are loaded), restore a checkpoint when resuming,
compile and warm up the train step in this main thread (GPU), connect to every target's slot
ring, say READY.

Loop: commands arrive in the same order at every rank and are dispatched by type through one
table. ``train {step, data epoch, batch id, job key}``: take that job's ring slot (waiting on its fill event on CUDA), run :meth:`DrafterTrainer.step` with the
loss denominator and the gradients all-reduced over the group, all-reduce the metrics, report.
``evaluate``: held-out batches without gradients. ``save`` / ``train.checkpoint``: rank 0 writes
an atomic checkpoint. ``stop``: leave.

Data parallelism is plain torch.distributed collectives rather than a DDP wrapper: one
all-reduce of ``Σw`` before the backward and one of the flattened gradients after it, outside
the compiled region, so the compiled step holds no communication.
"""

from __future__ import annotations

import collections
import datetime
import logging
import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from dflash.training.checkpoint import CheckpointWriter, set_rng_state
from dflash.training.checkpoint_identity import run_identity
from dflash.training.checkpoint_load import is_damage_error, load_trainer_state, quarantine
from dflash.compile_watch import CompileWatch
from dflash.models.flops import peak_flops
from dflash.training.factory import build_batch_plans, build_drafter, slot_spec, target_hf_config
from dflash.training.objective import LossOutput
from dflash.training.evaluation import EvalOutput, eval_sums
from dflash.training.optim import LRSchedule
from dflash.training.resume import LaunchPlan, checkpoint_position
from dflash.data.schedule import DataPosition, StepPlan
from dflash.runtime.base import WorkerContext, WorkerStop, memory_gib, run_worker
from dflash.runtime.messages import (Checkpointed, ControlMessage, Evaluate, Evaluated, Ready, Received, Save, Stop,
                                    Targets, Train, Trained)

log = logging.getLogger("dflash.runtime.drafter")

WARMUP_ITERS = 3
RECEIVE_SLICE_S = 0.5
ATTACH_TIMEOUT_S = 60.0
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


class DrafterWorker:
    def __init__(self, ctx: WorkerContext):
        from dflash.models.layer_ids import resolve_layer_ids
        from dflash.models.target_loader import load_embedding_and_head, resolve_dtype
        from dflash.training.trainer import DrafterTrainer

        self.ctx = ctx
        cfg = ctx.cfg
        self.cfg = cfg
        self.device = ctx.device
        self.rank = ctx.rank
        self.world = len(cfg.cluster.drafters)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        kwargs = {"device_id": self.device} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method="env://", rank=self.rank, world_size=self.world,
                                timeout=COLLECTIVE_TIMEOUT, **kwargs)
        log.info("joined the drafter group: rank %d of %d (%s)", self.rank, self.world, backend)

        plans = build_batch_plans(cfg, log_report=False, cache_dir=ctx.data_cache)
        self.batches_per_epoch = [plans.train.num_batches(e) for e in range(cfg.train.epochs)]
        launch = LaunchPlan.read(ctx.run_dir)  # the launcher's plan: steps and LR schedule of this launch
        if launch is None:
            plan = StepPlan(self.batches_per_epoch, self.world, cfg.train.max_steps)
            launch = LaunchPlan(0, DataPosition(), self.world, plan.total_steps,
                                LRSchedule.nominal(plan.total_steps, cfg.train))
        self.total_steps = launch.total_steps
        self.schedule = launch.schedule
        #: the next untrained batch after the last trained step (recorded in checkpoints)
        self.position = launch.start
        tc = target_hf_config(cfg)
        text = tc.get_text_config() if hasattr(tc, "get_text_config") else tc
        layer_ids = resolve_layer_ids(cfg.target.layer_ids, int(text.num_hidden_layers), cfg.drafter.num_layers)
        #: what this drafter is trained with (state.json ``trained_with``)
        self.identity = run_identity(plans.tokenizer, tc, layer_ids, cfg.data.enable_thinking,
                                     tokenizer_identity=plans.tokenizer_identity)
        feature_dtype = resolve_dtype(cfg.target.dtype, self.device)
        self.spec = slot_spec(cfg, len(layer_ids) * int(text.hidden_size), feature_dtype, int(text.hidden_size))
        embed, head = load_embedding_and_head(cfg.target, self.device)
        self.model = build_drafter(cfg, embed, head, plans.tokenizer_size, self.device, tc)
        self.trainer = DrafterTrainer(self.model, cfg.train, cfg.drafter, max(1, self.total_steps), self.device,
                                      weight_sum_reduce=self._all_reduce, grad_sync=self._grad_sync,
                                      schedule=self.schedule)
        self.steps_done = 0
        self.writer = (CheckpointWriter(ctx.run_dir, cfg.checkpoint.keep_last, cfg.checkpoint.background)
                       if self.rank == 0 else None)
        if ctx.resume_from is not None:
            self._restore(ctx.resume_from)
        self.warmup_s = self._warm_up(plans.train.batch(0, 0))
        self.watch = CompileWatch("drafter train step")
        warm = self.watch.arm()
        ctx.stats.update(warmup_compiles=warm.compiles, warmup_cudagraph_records=warm.cudagraph_records)
        self.consumer = None
        #: job keys already taken: a duplicate READY (a batch re-assigned after its first
        #: target died while we were copying it) is discarded, freeing its ring slot
        self.consumed: set[str] = set()
        self.commands: collections.deque[ControlMessage] = collections.deque()
        self.stats = ctx.stats
        self._last_loss: Optional[float] = None  # rank 0: the last step's training loss
        self.stats.update(trained=0, wait_s=0.0, step_s=0.0, copy_s=0.0)
        #: this device's peak FLOP/s for the drafter's MFU (None: unknown)
        self.peak_tflops = cfg.cluster.peak_tflops
        peak_flops(self.device, self.peak_tflops)  # a bad override fails at start; read again at each
        # use (on a CPU the measured rate can rise once the cores are less contended)

    # ------------------------------------------------------------------ collectives
    def _peak(self) -> Optional[float]:
        """This device's peak FLOP/s for MFU (:func:`dflash.models.flops.peak_flops`; on a CPU the
        fastest rate measured so far)."""
        return peak_flops(self.device, self.peak_tflops)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def _grad_sync(self, params: list[torch.nn.Parameter]) -> None:
        """Sum every trainable parameter's gradient over the group (one flat all-reduce)."""
        if self.world == 1:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)

    # ------------------------------------------------------------------ start-up
    def _restore(self, ckpt: Path) -> None:
        from safetensors.torch import load_file

        from dflash.training.checkpoint_load import read_state

        try:
            state = load_file(str(ckpt / "drafter" / "model.safetensors"), device=str(self.device))
            self.model.load_state_dict(state, strict=True)
            saved = load_trainer_state(ckpt, self.device)
            self.trainer.load_state_dict(saved["trainer"])
            set_rng_state(saved["rng"])
            state = read_state(ckpt)
            self.steps_done = state["step"]
            self.position = checkpoint_position(state, self.batches_per_epoch, self.world)
        except Exception as exc:
            if is_damage_error(exc):  # the group restarts from the previous checkpoint
                moved = quarantine(ckpt, f"{type(exc).__name__} while loading it: {exc}")
                raise RuntimeError(f"checkpoint {ckpt} is damaged ({type(exc).__name__}: {exc}); "
                                   f"moved aside to {moved.name if moved else 'a .damaged directory'}; "
                                   f"the drafter group restarts from the previous checkpoint") from exc
            raise RuntimeError(
                f"checkpoint {ckpt} cannot be loaded ({type(exc).__name__}: {exc}). If it is damaged, move it "
                f"out of {ckpt.parent} and resume: the run continues from the previous checkpoint") from exc
        log.info("resumed from %s (step %d)", ckpt, self.steps_done)

    def _warm_up(self, batch) -> float:
        """GPU: run forward+backward (and one held-out forward) on a synthetic batch until every
        compiled piece is built: the whole step's graphs with ``drafter.compile``, and in eager
        mode too the compiled flex_attention kernels (one for training, one without gradients),
        so that the compile watch armed next sees no compilation in a healthy run.

        Gradients are discarded and no optimizer step is taken, so warm-up never changes weights.
        """
        if self.device.type != "cuda":
            return 0.0
        started = time.perf_counter()
        tensors = {k: v.to(self.device) for k, v in batch.to_dict().items()}
        shape, dtype = self.spec["features"]
        gen = torch.Generator(device=self.device).manual_seed(0)
        tensors["features"] = torch.randn(shape, generator=gen, device=self.device).to(dtype)
        tensors["target_tokens"] = torch.roll(tensors["input_ids"], -1, dims=1)
        if "target_hidden" in self.spec:
            shape, dtype = self.spec["target_hidden"]
            tensors["target_hidden"] = torch.randn(shape, generator=gen, device=self.device).to(dtype)
        for i in range(WARMUP_ITERS):
            self.trainer.forward_backward(tensors, -2, i, weight_sum_reduce=lambda w: w)
            self.trainer.optimizer.zero_grad(set_to_none=True)
        self.trainer.evaluate(tensors, 0, epoch=-2, walk=False)  # the walk's forwards have these shapes
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        log.info("train step warmed up in %.1f s (%s)", seconds,
                 "compiled, graphs captured" if self.cfg.drafter.compile else "eager; attention kernels compiled")
        return seconds

    # ------------------------------------------------------------------ commands
    def _next_command(self) -> ControlMessage:
        while not self.commands:
            self._report_checkpoints()
            msg = self.ctx.link.recv(1.0)
            if msg is not None:
                self.commands.append(msg)
        return self.commands.popleft()

    def _check_stop(self) -> None:
        while True:
            msg = self.ctx.link.recv(0)
            if msg is None:
                return
            if isinstance(msg, Stop):
                raise WorkerStop(msg.reason)
            self.commands.append(msg)

    def _receive(self, job_key: str):
        """The ring slot of ``job_key`` (waiting for it; duplicates of taken job keys are freed)."""
        started = time.perf_counter()
        copy_before = self.consumer.stats["copy_s"]
        while True:
            while self.consumer.receive(0, match=lambda key, meta: key in self.consumed) is not None:
                log.info("discarded a duplicate batch")
            got = self.consumer.receive(RECEIVE_SLICE_S, match=lambda key, meta: key == job_key)
            if got is not None:
                self.stats["wait_s"] += time.perf_counter() - started
                self.stats["copy_s"] = self.consumer.stats["copy_s"] - copy_before
                self.consumed.add(job_key)
                self.ctx.link.send(Received(job_key=job_key))
                return got
            self._report_checkpoints()  # a write in flight is reported while the batch is awaited
            self._check_stop()

    def connect(self, endpoints: dict[str, str]) -> None:
        from dflash.transport import Consumer

        tp = self.cfg.transport
        here = self.cfg.cluster.node_of(self.ctx.name)
        # targets on another node: tcp; on this one: the configured carrier (CUDA IPC / shm)
        remote = [t for t in endpoints if self.cfg.cluster.node_of(t) != here]
        self.consumer = Consumer(self.ctx.name, endpoints, self.spec, self.device, tp.carrier,
                                 heartbeat_s=tp.heartbeat_s, peer_timeout_s=tp.peer_timeout_s,
                                 incarnation=self.ctx.incarnation, remote=remote)
        if not self.consumer.wait_attached(timeout=ATTACH_TIMEOUT_S):
            # a target may be restarting: carry on, it attaches when it is back
            log.warning("attached to %s of %s within %.0f s; continuing", sorted(self.consumer.attached()),
                        sorted(endpoints), ATTACH_TIMEOUT_S)

    def train(self, cmd: Train) -> None:
        step, epoch, batch_id = cmd.step, cmd.data_epoch, cmd.batch_id
        wait_before = self.stats["wait_s"]
        tokens = 0
        if batch_id is None:  # the epoch's last step has no batch for this rank
            started = time.perf_counter()
            self._all_reduce(torch.zeros((), device=self.device))
            for p in self.trainer.params:
                p.grad = torch.zeros_like(p)
            lr = self.trainer.scheduler.get_last_lr()[0]
            grad_norm = self.trainer.optimizer_step()
            b = self.trainer.block_size
            local = torch.zeros(2 * b + 4, device=self.device)
            metrics = {"lr": lr, "grad_norm": grad_norm, "flops": 0}
        else:
            got = self._receive(cmd.job_key)
            started = time.perf_counter()
            metrics = self.trainer.step(got.tensors, epoch, batch_id)
            local = LossOutput(loss_sum=metrics["loss_sum"], weight_sum=metrics["weight_sum"],
                               block_pos_correct=metrics["block_pos_correct"],
                               block_pos_count=metrics["block_pos_count"], tau_sum=metrics["tau_sum"],
                               num_blocks=metrics["num_blocks"]).stats_vector()
            tokens = int((got.tensors["doc_ids"] > 0).sum())
        total = LossOutput.from_stats_vector(self._all_reduce(local.clone()))
        step_s = time.perf_counter() - started
        self.steps_done = step + 1
        if cmd.position is not None:
            self.position = DataPosition.from_list(cmd.position)
        self.stats["trained"] += 1
        delta = self.watch.check()  # raises RecompileError: a re-recording run fails loudly
        self.stats["recompiles"], self.stats["rerecords"] = delta.compiles, delta.cudagraph_records
        self.stats["step_s"] = step_s
        self.stats["mem_gib"] = memory_gib(self.device)
        out = {"tokens": tokens, "stats": {"wait_s": self.stats["wait_s"], "step_s": step_s,
                                          "copy_s": self.stats["copy_s"],
                                          "checkpoint_block_s": self.stats.get("checkpoint_block_s", 0.0),
                                          "mem_gib": self.stats["mem_gib"], "rerecords": delta.cudagraph_records,
                                          "recompiles": delta.compiles},
               "compute": {"flops": float(metrics["flops"]), "seconds": step_s, "peak_flops": self._peak()}}
        if self.rank == 0:
            acc = total.block_pos_accuracy.tolist()
            self._last_loss = float(total.loss)
            out.update({"train/loss": self._last_loss, "train/tau": float(total.tau),
                        "train/lr": float(metrics["lr"]), "train/grad_norm": float(metrics["grad_norm"]),
                        "train/blocks": float(total.num_blocks), "time/step_s": step_s,
                        "time/drafter_wait_s": self.stats["wait_s"] - wait_before})
            out.update({f"train/acc_block_pos_{k}": a for k, a in enumerate(acc) if k > 0})
        self.ctx.link.send(Trained(attempt=cmd.attempt, step=step, data_epoch=epoch, batch_id=batch_id, metrics=out))
        if cmd.checkpoint:
            self.save()
        else:
            self._report_checkpoints()

    def evaluate(self, cmd: Evaluate) -> None:
        sums = None
        for batch_id, job_key in zip(cmd.batch_ids, cmd.job_keys):
            got = self._receive(job_key)
            s = eval_sums(self.trainer.evaluate(got.tensors, batch_id))
            if sums is None:
                sums = s
            else:
                sums = {k: ([a + b for a, b in zip(v, s[k])] if isinstance(v, list) else v + s[k])
                        for k, v in sums.items()}
        b = self.trainer.block_size
        sums = sums or {"loss_sum": 0.0, "weight_sum": 0.0, "tau_sum": 0.0, "blocks": 0.0, "head_tau_sum": 0.0,
                        "head_blocks": 0.0, "correct": [0.0] * b, "count": [0.0] * b,
                        **(dict.fromkeys(EvalOutput.WALK_SUMS, 0.0) if self.trainer.eval_walk else {})}
        self.ctx.link.send(Evaluated(attempt=cmd.attempt, round=cmd.round, sums=sums))

    def save(self, block: bool = False) -> None:
        """Rank 0: checkpoint the current step (``block``: wait until it is on disk).

        The state is copied to host memory here and written by a background thread
        (``checkpoint.background``); ``checkpointed`` goes to the coordinator when the files are
        in place (:meth:`_report_checkpoints`, polled between commands).
        """
        if self.rank != 0:
            return
        loss = self._last_loss
        if loss is not None and not math.isfinite(loss):
            # weights that give a non-finite loss must not replace good checkpoints (pruning would
            # delete those): fail, and the group restarts from the last checkpoint
            raise RuntimeError(f"step {self.steps_done}: the training loss is {loss}; not writing a checkpoint of "
                               f"these weights. If it recurs after the restart from the last checkpoint, that "
                               f"checkpoint's tensors may be corrupt (move it aside) or training diverged "
                               f"(lower train.lr)")
        extra = {"data_position": self.position.to_list(), "num_drafters": self.world,
                 "schedule": self.schedule.to_dict(), "trained_with": self.identity}
        self._announce(self.writer.save(self.steps_done, self.position.epoch, self.model, self.trainer.state_dict(),
                                        extra))
        self.stats["checkpoint_block_s"] = self.writer.last_blocking_s
        if block:
            self._announce(self.writer.wait())

    def _report_checkpoints(self) -> None:
        if self.writer is not None:
            self._announce(self.writer.poll())

    def _announce(self, done) -> None:
        if done is not None:
            step, path = done
            self.ctx.link.send(Checkpointed(step=step, path=str(path)))

    def _on_stop(self, cmd: Stop) -> bool:
        log.info("stop (%s) after %d steps", cmd.reason, self.steps_done)
        if self.writer is not None:  # the last checkpoint may still be being written
            self._announce(self.writer.wait())
        return False

    def _on_train(self, cmd: Train) -> bool:
        self.train(cmd)
        return True

    def _on_evaluate(self, cmd: Evaluate) -> bool:
        self.evaluate(cmd)
        return True

    def _on_save(self, cmd: Save) -> bool:
        self.save(block=True)
        return True

    def _on_targets(self, cmd: Targets) -> bool:
        log.info("new target endpoints: %s", cmd.endpoints)
        return True

    def run(self) -> None:
        link = self.ctx.link
        while True:  # wait for the targets' endpoints
            cmd = self._next_command()
            if isinstance(cmd, Targets):
                self.connect(cmd.endpoints)
                break
            if isinstance(cmd, Stop):
                return
        link.send(Ready(info={"trainable_params_M": self.model.num_trainable_params() / 1e6,
                              "warmup_s": self.warmup_s, "steps_done": self.steps_done}))
        handlers = {Train: self._on_train, Evaluate: self._on_evaluate, Save: self._on_save, Stop: self._on_stop,
                    Targets: self._on_targets}
        while True:
            cmd = self._next_command()
            handler = handlers.get(type(cmd))
            if handler is None:
                log.debug("ignoring %s", cmd.TAG)
            elif not handler(cmd):
                return

    def close(self) -> None:
        writer = getattr(self, "writer", None)
        if writer is not None and writer.in_flight:
            try:  # never leave with a half-written checkpoint when the write can finish
                writer.wait()
            except Exception:  # noqa: BLE001 - the worker is already failing or stopping
                log.exception("background checkpoint write failed")
        if self.consumer is not None:
            self.consumer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: Optional[list[str]] = None) -> int:
    return run_worker("drafter", DrafterWorker, argv)


if __name__ == "__main__":
    sys.exit(main())
