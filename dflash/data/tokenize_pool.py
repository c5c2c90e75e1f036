"""Tokenising conversations in several processes, their results in order.

Rendering a conversation with the chat template and encoding it
(:func:`dflash.data.render.tokenize_conversation`) is the data stage's cost, and one
conversation's result does not depend on any other's. :class:`TokenizePool` runs it in worker
processes (:class:`concurrent.futures.ProcessPoolExecutor`, started with ``spawn``: the caller
may have threads) a chunk of conversations at a time and hands the results back in the order the
conversations were given, so what the caller builds from them is what one process builds, byte
for byte. Everything that depends on the order (deduplication, row numbers, the report, the
sample of ``data.extra_token_ratio``) stays in the caller.

A spawned worker imports the caller's main module before anything of this module runs in it, so
a script that prepares data outside an ``if __name__ == '__main__':`` guard runs again in each
worker, which dies there (it may not start processes of its own) or waits (for the data cache's
lock, which the caller holds). Both end in an error in the caller that names the guard. A worker's
start-up arguments are written into a pipe that the caller keeps open for reading until the write
is done, so they are kept to a few KiB (the tokenizer goes through shared memory): megabytes
would wait forever for a worker that died before reading them. A pool none of whose workers gets
through its start-up within :data:`STARTUP_TIMEOUT_S` fails. Workers start with ``SIGINT``
blocked: a Ctrl-C during their start-up leaves them quiet, and the calling process, which gets it
too, stops the pool.

``data.tokenize_workers`` sets the number of processes; by default (:func:`tokenize_workers`)
inputs under :data:`PARALLEL_MIN_BYTES` or :data:`PARALLEL_MIN_CONVERSATIONS` are tokenised in the
calling process (starting workers takes seconds) and larger ones on every CPU this process may use,
at most :data:`MAX_WORKERS`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, TypeVar

from dflash.data.render import ChatRenderer, tokenize_conversation

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["TokenizePool", "tokenize_workers", "PARALLEL_MIN_BYTES", "MAX_WORKERS"]

log = logging.getLogger(__name__)

#: Inputs (the data files' bytes) below this are tokenised in the calling process by default ...
PARALLEL_MIN_BYTES = 16 << 20
#: ... and so are fewer conversations than this (``data.max_conversations``).
PARALLEL_MIN_CONVERSATIONS = 2000
#: At most this many tokenising processes by default.
MAX_WORKERS = 32
#: Conversations a worker tokenises per task.
CHUNK_CONVERSATIONS = 32
#: Tasks queued per worker ahead of the one whose results the caller waits for.
TASKS_AHEAD_PER_WORKER = 4
#: Seconds between a worker's checks that the process that started it is still there.
ORPHAN_CHECK_S = 1.0
#: Seconds from the first task for some worker to get through its start-up (import the caller's
#: main module, load the tokenizer: about a second); none by then fails the pool (:meth:`TokenizePool.map`).
STARTUP_TIMEOUT_S = 120.0

K = TypeVar("K")
#: ``(messages, tools)`` of one conversation, as :func:`tokenize_conversation` takes them.
Job = tuple[list[dict[str, Any]], Optional[list[Any]]]
#: What :func:`tokenize_conversation` returns for a job.
Result = tuple[list, Optional[str], dict]


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def tokenize_workers(requested: Optional[int], input_bytes: int, max_conversations: Optional[int] = None) -> int:
    """Tokenising processes for ``input_bytes`` of data files read up to ``max_conversations`` rows
    (``data.max_conversations``): ``requested`` (``data.tokenize_workers``) when given, else 1
    below :data:`PARALLEL_MIN_BYTES` or :data:`PARALLEL_MIN_CONVERSATIONS`, and
    :func:`available_cpus` (at most :data:`MAX_WORKERS`) from there on."""
    if requested is not None:
        return int(requested)
    if input_bytes < PARALLEL_MIN_BYTES or (max_conversations is not None and max_conversations < PARALLEL_MIN_CONVERSATIONS):
        return 1
    return max(1, min(MAX_WORKERS, available_cpus()))


_worker: Optional[tuple[Any, int, ChatRenderer, bool]] = None  # (tokenizer, max_length, renderer, probe), per worker


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """``SIGINT`` blocked in the calling thread inside the block, where the OS has signal masks. A
    process started inside inherits the mask: a Ctrl-C waits in it until it unblocks the signal. One
    that comes meanwhile reaches this process all the same: on leaving the block, or at once through
    another of its threads, so the caller still gets its ``KeyboardInterrupt``."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _start_worker(tokenizer: Any, max_length: int, enable_thinking: Optional[bool], probe: bool,
                  started: Any) -> None:
    """A worker's initializer: the tokenizer (pickled, in the shared ``tokenizer`` bytes) and a
    renderer of it, kept for every task; ``started`` set to 1 once they are loaded.
    Ctrl-C is left to the calling process, which stops the pool (:meth:`TokenizePool.close`): the
    worker started with ``SIGINT`` blocked and ignores it from here on (one that came meanwhile is
    dropped). A worker whose calling process is gone (killed without stopping the pool) exits within
    :data:`ORPHAN_CHECK_S`."""
    global _worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(ORPHAN_CHECK_S)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    tok = pickle.loads(bytes(tokenizer))
    _worker = (tok, max_length, ChatRenderer(tok, enable_thinking), probe)
    started.value = 1


def _pool_failed(what: str) -> RuntimeError:
    """The error of a pool whose workers died or did not start: ``what`` happened, and why it may have."""
    return RuntimeError(f"{what}: out of memory, killed, or started from a script that prepares data outside an "
                        f"`if __name__ == '__main__':` guard (spawned workers import the main module); give it more "
                        f"memory, add the guard, or set data.tokenize_workers to fewer processes (1: the calling "
                        f"process alone)")


def _tokenize_chunk(jobs: list[Job]) -> list[Result]:
    """A worker's task: :func:`tokenize_conversation` of each job, in order."""
    assert _worker is not None, "the worker was not initialised"
    tok, max_length, renderer, probe = _worker
    return [tokenize_conversation(messages, tok, max_length, tools=tools, renderer=renderer, probe=probe)
            for messages, tools in jobs]


class TokenizePool:
    """:func:`tokenize_conversation` over a stream of conversations in ``workers`` processes.

    :meth:`map` gives the results in order; :meth:`close` stops the workers. The workers are started
    with ``spawn``, ``SIGINT`` blocked, and get the tokenizer pickled, in shared memory: :meth:`create`
    returns None (the caller tokenises itself) when it does not pickle.

    Args:
        tokenizer: the tokenizer (with its chat template) every worker encodes with, pickled.
        max_length, enable_thinking, probe: as :func:`tokenize_conversation` takes them.
        workers: processes (>= 2).

    Raises:
        ValueError: ``workers < 2``.
    """

    def __init__(self, tokenizer: bytes, max_length: int, enable_thinking: Optional[bool], probe: bool,
                 workers: int) -> None:
        if workers < 2:
            raise ValueError(f"workers: a pool needs at least 2, got {workers}")
        self.ahead = workers * TASKS_AHEAD_PER_WORKER
        context = multiprocessing.get_context("spawn")
        shared = context.RawArray(ctypes.c_ubyte, len(tokenizer))
        ctypes.memmove(shared, tokenizer, len(tokenizer))
        self.started = context.RawValue(ctypes.c_int, 0)  # 1 once a worker has loaded the tokenizer
        self.deadline: Optional[float] = None  # time.monotonic() by which one must have: set by the first task
        self.executor = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=context, initializer=_start_worker,
            initargs=(shared, max_length, enable_thinking, probe, self.started))

    @classmethod
    def create(cls, tokenizer: PreTrainedTokenizerBase, max_length: int, enable_thinking: Optional[bool],
               workers: int, probe: bool = False) -> Optional["TokenizePool"]:
        """A pool of ``workers`` processes, or None when ``workers < 2`` or ``tokenizer`` does not
        pickle (logged: the data is then tokenised in the calling process)."""
        if workers < 2:
            return None
        if workers > available_cpus():
            log.warning("data.tokenize_workers=%d is more than the %d CPUs this process may use: the extra processes "
                        "only add their memory (about 100 MiB each)", workers, available_cpus())
        try:
            payload = pickle.dumps(tokenizer)
        except Exception as exc:  # noqa: BLE001 - any pickling failure means: tokenise here
            log.info("tokenising in one process: the tokenizer does not pickle (%s: %s)", type(exc).__name__, exc)
            return None
        log.info("tokenising in %d processes (data.tokenize_workers)", workers)
        return cls(payload, max_length, enable_thinking, probe, workers)

    def close(self) -> None:
        """Stop the workers; tasks not started are cancelled. When no worker has got through its
        start-up (stopped during it, or stuck in the caller's main module), the workers are killed
        first, so that stopping does not wait for them."""
        if not self.started.value:  # the executor has no public way to stop its processes
            for process in list((getattr(self.executor, "_processes", None) or {}).values()):
                process.kill()
        self.executor.shutdown(wait=True, cancel_futures=True)

    def map(self, items: Iterable[tuple[K, Optional[Job]]]) -> Iterator[tuple[K, Optional[Result]]]:
        """``(key, result)`` for each ``(key, job)`` of ``items``, in their order: the job's
        :func:`tokenize_conversation` result, or None for a None job (a row with nothing to
        tokenise, passed through in its place). Reads at most ``workers ×``
        :data:`TASKS_AHEAD_PER_WORKER` chunks ahead of the results handed out; stopping early
        leaves the rest to :meth:`close`.

        Raises:
            RuntimeError: a worker process died (out of memory, killed, or its start-up ran a
                script that prepares data outside a main guard), or none got through its start-up
                within :data:`STARTUP_TIMEOUT_S` of the first task; naming ``data.tokenize_workers``.
        """
        pending: deque = deque()
        chunk: list[tuple[K, Optional[Job]]] = []
        for item in items:
            chunk.append(item)
            if len(chunk) == CHUNK_CONVERSATIONS:
                pending.append(self._submit(chunk))
                chunk = []
                while len(pending) >= self.ahead:
                    yield from self._results(*pending.popleft())
        if chunk:
            pending.append(self._submit(chunk))
        while pending:
            yield from self._results(*pending.popleft())

    def _submit(self, chunk: list[tuple[K, Optional[Job]]]) -> tuple[list, Optional[concurrent.futures.Future]]:
        jobs = [job for _, job in chunk if job is not None]
        if not jobs:
            return chunk, None
        if self.deadline is None:
            self.deadline = time.monotonic() + STARTUP_TIMEOUT_S
        try:
            with _sigint_blocked():  # a worker it starts inherits the blocked SIGINT
                return chunk, self.executor.submit(_tokenize_chunk, jobs)
        except concurrent.futures.process.BrokenProcessPool as exc:
            raise _pool_failed(f"a tokenising process died ({exc})") from None

    def _results(self, chunk: list[tuple[K, Optional[Job]]], future: Optional[concurrent.futures.Future]
                 ) -> Iterator[tuple[K, Optional[Result]]]:
        results: Iterator[Result] = iter([])
        if future is not None:
            while not self.started.value and not future.done():
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise _pool_failed(f"no tokenising process got through its start-up within "
                                       f"{STARTUP_TIMEOUT_S:g} s")
                concurrent.futures.wait([future], timeout=left)
            try:
                results = iter(future.result())
            except concurrent.futures.process.BrokenProcessPool as exc:
                raise _pool_failed(f"a tokenising process died ({exc})") from None
        for key, job in chunk:
            yield key, (next(results) if job is not None else None)
