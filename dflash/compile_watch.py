"""Count graph compilations and CUDA-graph recordings in this process; fail loudly after warm-up.

A compiled step that starts re-compiling or re-recording CUDA graphs does not crash: it slows
down quietly (a re-record costs about as much as the first iteration). Workers therefore
:meth:`CompileWatch.arm` the watch once their warm-up has captured the graphs and call
:meth:`CompileWatch.check` after every step: any new compilation or recording raises
:class:`RecompileError` naming the function, so the run stops instead of crawling.

Counts come from ``torch._dynamo.utils.counters["stats"]["unique_graphs"]`` (graphs compiled by
dynamo) and from wrapping ``CUDAGraphTreeManager.record_function`` in
``torch/_inductor/cudagraph_trees.py`` (one call per CUDA-graph recording).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

__all__ = ["CompileWatch", "RecompileError", "compile_counts"]

log = logging.getLogger(__name__)

_records = 0
_lock = threading.Lock()
_patched = False


class RecompileError(RuntimeError):
    """A graph was compiled or a CUDA graph recorded after warm-up."""


def _patch_cudagraph_trees() -> None:
    global _patched
    if _patched:
        return
    try:
        from torch._inductor import cudagraph_trees
    except ImportError:  # pragma: no cover - torch without inductor
        _patched = True
        return
    manager = getattr(cudagraph_trees, "CUDAGraphTreeManager", None)
    original = getattr(manager, "record_function", None)
    if original is None:  # pragma: no cover - another torch layout: counts stay 0
        log.warning("cannot count CUDA-graph recordings in this torch version")
        _patched = True
        return

    def counting_record_function(self, *args, **kwargs):
        global _records
        with _lock:
            _records += 1
        return original(self, *args, **kwargs)

    manager.record_function = counting_record_function
    _patched = True


@dataclass(frozen=True)
class CompileCounts:
    compiles: int
    cudagraph_records: int


def compile_counts() -> CompileCounts:
    """Graphs compiled by dynamo and CUDA graphs recorded so far in this process."""
    from torch._dynamo.utils import counters

    _patch_cudagraph_trees()
    return CompileCounts(compiles=int(counters["stats"]["unique_graphs"]), cudagraph_records=_records)


class CompileWatch:
    """Baseline the counts after warm-up; any increase later is an error.

    Args:
        what: the watched step's name for messages (``target forward``).
        fail: raise :class:`RecompileError` (True) or only log an error (False).
    """

    def __init__(self, what: str, fail: bool = True):
        _patch_cudagraph_trees()
        self.what = what
        self.fail = fail
        self.baseline = compile_counts()
        self.armed = False

    def arm(self) -> CompileCounts:
        """Take the post-warm-up baseline; returns the warm-up's counts."""
        counts = compile_counts()
        self.baseline = counts
        self.armed = True
        return counts

    def since_arm(self) -> CompileCounts:
        now = compile_counts()
        return CompileCounts(now.compiles - self.baseline.compiles,
                             now.cudagraph_records - self.baseline.cudagraph_records)

    def check(self) -> CompileCounts:
        """Counts since :meth:`arm`.

        Raises:
            RecompileError: something compiled or recorded since warm-up (when ``fail``).
        """
        delta = self.since_arm()
        if self.armed and (delta.compiles or delta.cudagraph_records):
            msg = (f"{self.what}: {delta.compiles} re-compilation(s) and {delta.cudagraph_records} CUDA-graph "
                   f"re-recording(s) after warm-up; shapes or guards are changing (run with "
                   f"TORCH_LOGS=recompiles to see why)")
            if self.fail:
                raise RecompileError(msg)
            log.error("%s", msg)
        return delta
