"""Per-process CUDA graphs: two OS processes each compile the drafter train step with
``torch.compile(mode="reduce-overhead")`` in their own main thread, capture their own graphs,
and replay them at the eager losses, with no CUDA-graph re-recording after warm-up.

GPU only: skipped on CPU. Run on the device with ``python -m pytest -q tests/test_gpu_compile.py``.
"""

from __future__ import annotations

import os
import queue

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

#: Bound on one worker process (compile included), seconds.
WORKER_TIMEOUT_S = 600.0
STEPS = 6
WARMUP_STEPS = 3


def _worker(rank: int, results, device_type: str = "cuda") -> None:  # runs in a spawned process
    try:
        from dflash.compile_watch import CompileWatch
        from dflash.config import TrainConfig
        from tests.test_trainer import drafter_cfg, pattern_batch, tiny_model
        from dflash.training.trainer import DrafterTrainer

        dev = torch.device("cpu")  # harness check only (the trainer runs eager on CPU)
        if device_type == "cuda":
            dev = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(dev)
        batches = [{k: v.to(dev) for k, v in pattern_batch(seed=i).items()} for i in range(STEPS)]
        losses = {}
        records = None
        for mode in ("eager", "compiled"):
            model = tiny_model(head_dim=16, attention="auto").to(dev)
            model.embed_tokens.to(dev)
            model.lm_head.to(dev)
            tr = DrafterTrainer(model, TrainConfig(), drafter_cfg(compile=mode == "compiled"), 10, dev,
                                autocast_dtype=None)
            watch = CompileWatch("drafter step", fail=False)
            out = []
            for i, batch in enumerate(batches):
                if i == WARMUP_STEPS:
                    watch.arm()
                out.append(float(tr.step(batch, 0, i)["loss"]))
            if mode == "compiled":
                records = watch.since_arm().cudagraph_records
            losses[mode] = out
        results.put({"rank": rank, "pid": os.getpid(), "losses": losses, "rerecords": records})
    except BaseException as exc:  # reported to the test, never swallowed
        results.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})


def test_two_processes_capture_their_own_graphs_and_match_eager() -> None:
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(rank, results)) for rank in range(2)]
    for p in procs:
        p.start()
    got = []
    try:
        for _ in procs:
            got.append(results.get(timeout=WORKER_TIMEOUT_S))
    except queue.Empty:
        pytest.fail(f"a worker gave no result within {WORKER_TIMEOUT_S:.0f} s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [r["error"] for r in got if "error" in r]
    assert not errors, errors
    assert len({r["pid"] for r in got}) == 2
    for r in got:
        eager, compiled = r["losses"]["eager"], r["losses"]["compiled"]
        assert min(eager[1:]) < eager[0]  # it learns
        for e, c in zip(eager, compiled):
            assert abs(e - c) <= 1e-3 * abs(e) + 1e-4, (r["rank"], eager, compiled)
        assert r["rerecords"] == 0, r
