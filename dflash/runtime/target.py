"""Target worker: one process per target GPU (or CPU process). One loop.

Start-up: build the batch plans (from the launcher's tokenised-data cache), load the target, compile and
warm up the forward in this main thread (on GPU when ``target.compile``: the whole forward with
CUDA graphs, ``torch.compile(mode="reduce-overhead")``, or one decoder layer of each kind,
``target.compile_scope``), export the slot ring, say READY with the ring's endpoint.

Loop: take ``produce {split, data epoch, batch id, drafter, job key}`` commands in order; for
each, build the batch (a deterministic function of its ids), copy it into the static input
buffers, run the forward, copy the context features and greedy tokens into a free ring slot
(credits permitting) and publish it to the named drafter under the job key. Report ``produced``
with the forward time. A batch the ring reports lost (its drafter was evicted, restarted or
dropped this ring after a silence) is reported ``dropped``: the coordinator re-assigns it.
Control messages are dispatched by type through one table.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import time
from typing import Any, Callable, Optional

import torch
import zmq

from dflash.compile_watch import CompileWatch
from dflash.models.flops import peak_flops
from dflash.training.factory import TARGET_OUTPUTS, build_batch_plans, slot_spec, target_forward
from dflash.runtime.base import WorkerContext, memory_gib, run_worker
from dflash.runtime.messages import Dropped, Flush, Produce, Produced, Ready, Stop

log = logging.getLogger("dflash.runtime.target")

WARMUP_ITERS = 3
IDLE_POLL_MS = 200
#: Test hook, inert unless set: ``<job key>=<seconds>`` makes this worker's main thread sleep that
#: long (no message handled, no heartbeat sent on the ring) before publishing that job, once per
#: process: a forward or a host busy past ``transport.peer_timeout_s``.
STALL_ENV = "DFLASH_TEST_TARGET_STALL"


def _stall_hook() -> tuple[str, float]:
    """``(job key, seconds)`` of :data:`STALL_ENV`, or ``("", 0.0)`` when it is unset.

    Raises:
        ValueError: the variable is set but not ``<job key>=<seconds>``.
    """
    raw = os.environ.get(STALL_ENV, "")
    if not raw:
        return "", 0.0
    key, _, seconds = raw.rpartition("=")
    try:
        value = float(seconds)
    except ValueError:
        value = -1.0
    if not key or not value >= 0:
        raise ValueError(f"{STALL_ENV}={raw!r}: expected <job key>=<seconds>, e.g. train:e0:4:a0=3")
    return key, value


def compile_scope(cfg: Any, target: Any) -> str:
    """``forward`` or ``layer`` for ``target.compile_scope`` (``auto``: ``layer`` when the target
    has linear-attention layers, whose fla kernels cannot be captured in a CUDA graph).

    Raises:
        ConfigError: ``forward`` for a target whose linear-attention layers run through fla.
    """
    from dflash.config import ConfigError

    if cfg.compile_scope == "forward" and target.linear_attention == "fla":
        raise ConfigError("target.compile_scope: forward captures CUDA graphs, which fla's varlen kernels "
                          "cannot run in (they read their segment offsets on the host); use auto or layer, "
                          "or target.linear_attention: torch")
    if cfg.compile_scope != "auto":
        return cfg.compile_scope
    return "layer" if target.linear_attention is not None else "forward"


class TargetWorker:
    def __init__(self, ctx: WorkerContext):
        from dflash.models.target_loader import load_target
        from dflash.transport import Producer

        self.ctx = ctx
        cfg = ctx.cfg
        self.device = ctx.device
        self.plans = build_batch_plans(cfg, log_report=False, cache_dir=ctx.data_cache)
        self.target = load_target(cfg.target, self.device, num_drafter_layers=cfg.drafter.num_layers)
        self.spec = slot_spec(cfg, self.target.feature_size, self.target.dtype, self.target.hidden_size)
        # Static inputs: the compiled forward always reads the same addresses.
        self.inputs = {k: torch.zeros(shape, dtype=dtype, device=self.device)
                       for k, (shape, dtype) in self.spec.items() if k not in TARGET_OUTPUTS}
        #: the slot tensors the forward fills, in the order it returns them (the final-normed
        #: hidden state only for a drafter that trains by distillation)
        self.outputs = [k for k in TARGET_OUTPUTS if k in self.spec]
        forward = target_forward(self.target, "target_hidden" in self.outputs)
        self.forward: Callable[..., Any] = forward
        self.compiled = bool(cfg.target.compile and self.device.type == "cuda")
        #: CUDA graphs of the whole forward (``compile_scope: forward``); per-layer compile has none.
        self.graphs = False
        if self.compiled:
            if compile_scope(cfg.target, self.target) == "layer":
                self.target.compile_layers()
            else:
                self.forward = torch.compile(forward, mode="reduce-overhead", dynamic=False)
                self.graphs = True
        self.warmup_s = self._warm_up()
        self.watch = CompileWatch("target forward")
        warm = self.watch.arm()
        ctx.stats.update(warmup_compiles=warm.compiles, warmup_cudagraph_records=warm.cudagraph_records)
        self.producer = Producer(ctx.name, ctx.endpoint or f"tcp://{cfg.transport.host}:0", self.spec, cfg.transport.slots,
                                 self.device, cfg.transport.carrier, heartbeat_s=cfg.transport.heartbeat_s,
                                 peer_timeout_s=cfg.transport.peer_timeout_s, incarnation=ctx.incarnation)
        self.queue: collections.deque[Produce] = collections.deque()
        self.stall_key, self.stall_s = _stall_hook()
        self.stats = ctx.stats
        self.stats.update(produced=0, busy_s=0.0, wait_slot_s=0.0)
        #: this device's peak FLOP/s for the target's MFU (None: unknown)
        self.peak_tflops = cfg.cluster.peak_tflops
        peak_flops(self.device, self.peak_tflops)  # a bad override fails at start; read again at each
        # use (on a CPU the measured rate can rise once the cores are less contended)

    def _peak(self) -> Optional[float]:
        """This device's peak FLOP/s for MFU (:func:`dflash.models.flops.peak_flops`; on a CPU the
        fastest rate measured so far)."""
        return peak_flops(self.device, self.peak_tflops)

    def _run_forward(self):
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        return self.forward(self.inputs["input_ids"], self.inputs["position_ids"], self.inputs["doc_ids"])

    def _warm_up(self) -> float:
        """Run the forward on a real batch until its graphs are captured (GPU) / caches warm (CPU)."""
        started = time.perf_counter()
        self._load_inputs(self.plans.train.batch(0, 0))
        for _ in range(WARMUP_ITERS if self.compiled else 1):
            self._run_forward()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        how = "eager" if not self.compiled else "compiled, graphs captured" if self.graphs else "compiled per layer"
        log.info("forward warmed up in %.1f s (%s)", seconds, how)
        return seconds

    def _load_inputs(self, batch: Any) -> None:
        for key, value in batch.to_dict().items():
            self.inputs[key].copy_(value, non_blocking=True)

    def produce(self, job: Produce, ring_slot: int) -> None:
        """Fill ``ring_slot`` with the job's batch and the target's outputs; publish it to the job's drafter."""
        from dflash.transport import PeerUnavailable

        split, epoch, batch_id = job.split, job.data_epoch, job.batch_id
        plan = self.plans.train if split == "train" else self.plans.heldout
        started = time.perf_counter()
        batch = plan.batch(epoch, batch_id)
        self._load_inputs(batch)
        results = self._run_forward()
        out = self.producer.slots[ring_slot]
        for key in self.inputs:
            out[key].copy_(self.inputs[key], non_blocking=True)
        for key, value in zip(self.outputs, results):
            out[key].copy_(value, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        seconds = time.perf_counter() - started
        if job.job_key == self.stall_key:
            log.warning("test hook %s: sleeping %.1f s before publishing %s", STALL_ENV, self.stall_s, job.job_key)
            time.sleep(self.stall_s)  # the simulated busy main thread (never set outside tests)
            self.stall_key = ""
        try:
            self.producer.publish(ring_slot, job.drafter, job.job_key,
                                  meta={"split": split, "data_epoch": epoch, "batch_id": batch_id})
        except PeerUnavailable as exc:
            self.producer.release(ring_slot)
            self.ctx.link.send(Dropped(job_key=job.job_key, reason=str(exc)))
            return
        self.stats["produced"] += 1
        self.stats["busy_s"] += seconds
        self.stats["mem_gib"] = memory_gib(self.device)
        delta = self.watch.check()  # raises RecompileError: a re-recording run fails loudly
        self.stats["recompiles"], self.stats["rerecords"] = delta.compiles, delta.cudagraph_records
        self.ctx.link.send(Produced(job_key=job.job_key, data_epoch=epoch, batch_id=batch_id, split=split,
                                    drafter=job.drafter, seconds=seconds, tokens=batch.num_tokens,
                                    flops=float(self.target.flops(batch.doc_ids).total), peak_flops=self._peak()))

    def _report_lost(self) -> None:
        """Tell the coordinator about every batch the ring lost in flight (``dropped``: it re-assigns
        the job unless its drafter took the batch meanwhile)."""
        for lost in self.producer.lost_batches():
            self.ctx.link.send(Dropped(job_key=str(lost.job_key),
                                       reason=f"lost in flight to {lost.consumer} ({lost.reason})"))

    def _on_flush(self, msg: Flush) -> bool:
        """The drafter group restarts: forget its queued jobs and reset its credits."""
        dropped = len(self.queue)
        self.queue.clear()
        for name in msg.drafters:
            self.producer.evict(name, reason="drafter group restart")
        log.info("flushed %d queued batch(es); credits of %s reset", dropped, msg.drafters)
        return True

    def _on_stop(self, msg: Stop) -> bool:
        log.info("stop (%s): %d batches produced", msg.reason, self.stats["produced"])
        return False

    def _on_produce(self, msg: Produce) -> bool:
        self.queue.append(msg)
        return True

    def _handle_control(self) -> bool:
        """Drain control messages through the dispatch table; False when told to stop."""
        handlers = {Produce: self._on_produce, Flush: self._on_flush, Stop: self._on_stop}
        while True:
            msg = self.ctx.link.recv(0)
            if msg is None:
                return True
            handler = handlers.get(type(msg))
            if handler is None:
                log.debug("ignoring %s", msg.TAG)
            elif not handler(msg):
                return False

    def run(self) -> None:
        link = self.ctx.link
        link.send(Ready(info={"endpoint": self.producer.endpoint, "warmup_s": self.warmup_s,
                              "params_M": self.target.num_parameters() / 1e6, "compiled": self.compiled}))
        poller = zmq.Poller()
        poller.register(link.socket, zmq.POLLIN)
        poller.register(self.producer.socket, zmq.POLLIN)
        waiting_since = None
        unattached_since = None
        while self._handle_control():
            self.producer.poll(0)
            self._report_lost()
            if self.queue:
                job = self.queue[0]
                if job.drafter not in self.producer.consumers:
                    # a restarted drafter has not attached yet: wait for it, within the peer timeout
                    unattached_since = unattached_since or time.monotonic()
                    if time.monotonic() - unattached_since > self.ctx.cfg.transport.peer_timeout_s:
                        self.queue.popleft()
                        link.send(Dropped(job_key=job.job_key, reason=f"{job.drafter} is not attached"))
                        unattached_since = None
                        continue
                else:
                    unattached_since = None
                    ring_slot = self.producer.acquire(timeout=0)
                    if ring_slot is not None:
                        if waiting_since is not None:
                            self.stats["wait_slot_s"] += time.perf_counter() - waiting_since
                            waiting_since = None
                        self.produce(self.queue.popleft(), ring_slot)
                        continue
                    waiting_since = waiting_since or time.perf_counter()
            poller.poll(min(IDLE_POLL_MS, max(1, int(self.producer.next_timer_s() * 1000))))

    def close(self) -> None:
        self.producer.close()


def main(argv: list[str] | None = None) -> int:
    return run_worker("target", TargetWorker, argv)


if __name__ == "__main__":
    sys.exit(main())
