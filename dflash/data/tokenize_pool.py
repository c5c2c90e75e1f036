"""Tokenising conversations in several processes, their results in order.

Rendering a conversation with the chat template and encoding it
(:func:`dflash.data.render.tokenize_conversation`) is the data stage's cost, and one
conversation's result does not depend on any other's. :class:`TokenizePool` runs it in worker
processes (:class:`concurrent.futures.ProcessPoolExecutor`, started with ``spawn``: the caller
may have threads) a chunk of conversations at a time and hands the results back in the order the
conversations were given, so what the caller builds from them is what one process builds, byte
for byte. Everything that depends on the order (deduplication, row numbers, the report, the
sample of ``data.extra_token_ratio``) stays in the caller.

``data.tokenize_workers`` sets the number of processes; by default (:func:`tokenize_workers`)
inputs under :data:`PARALLEL_MIN_BYTES` or :data:`PARALLEL_MIN_CONVERSATIONS` are tokenised in the
calling process (starting workers takes seconds) and larger ones on every CPU this process may use,
at most :data:`MAX_WORKERS`.
"""

from __future__ import annotations

import concurrent.futures
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


def _start_worker(tokenizer: bytes, max_length: int, enable_thinking: Optional[bool], probe: bool) -> None:
    """A worker's initializer: the pickled tokenizer and a renderer of it, kept for every task.
    Ctrl-C is left to the calling process, which stops the pool (:meth:`TokenizePool.close`); a
    worker whose calling process is gone (killed without stopping the pool) exits within
    :data:`ORPHAN_CHECK_S`."""
    global _worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(ORPHAN_CHECK_S)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    tok = pickle.loads(tokenizer)
    _worker = (tok, max_length, ChatRenderer(tok, enable_thinking), probe)


def _tokenize_chunk(jobs: list[Job]) -> list[Result]:
    """A worker's task: :func:`tokenize_conversation` of each job, in order."""
    assert _worker is not None, "the worker was not initialised"
    tok, max_length, renderer, probe = _worker
    return [tokenize_conversation(messages, tok, max_length, tools=tools, renderer=renderer, probe=probe)
            for messages, tools in jobs]


class TokenizePool:
    """:func:`tokenize_conversation` over a stream of conversations in ``workers`` processes.

    :meth:`map` gives the results in order; :meth:`close` stops the workers. The workers are started
    with ``spawn`` and get the tokenizer pickled: :meth:`create` returns None (the caller tokenises
    itself) when it does not pickle.

    Args:
        tokenizer: the tokenizer (with its chat template) every worker encodes with.
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
        self.executor = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
            initargs=(tokenizer, max_length, enable_thinking, probe))

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
        """Stop the workers; tasks not started are cancelled."""
        self.executor.shutdown(wait=True, cancel_futures=True)

    def map(self, items: Iterable[tuple[K, Optional[Job]]]) -> Iterator[tuple[K, Optional[Result]]]:
        """``(key, result)`` for each ``(key, job)`` of ``items``, in their order: the job's
        :func:`tokenize_conversation` result, or None for a None job (a row with nothing to
        tokenise, passed through in its place). Reads at most ``workers ×``
        :data:`TASKS_AHEAD_PER_WORKER` chunks ahead of the results handed out; stopping early
        leaves the rest to :meth:`close`.

        Raises:
            RuntimeError: a worker process died (out of memory, killed), naming
                ``data.tokenize_workers``.
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
        return chunk, (self.executor.submit(_tokenize_chunk, jobs) if jobs else None)

    @staticmethod
    def _results(chunk: list[tuple[K, Optional[Job]]], future: Optional[concurrent.futures.Future]
                 ) -> Iterator[tuple[K, Optional[Result]]]:
        try:
            results = iter(future.result() if future is not None else [])
        except concurrent.futures.process.BrokenProcessPool as exc:
            raise RuntimeError(f"a tokenising process died ({exc}): out of memory, killed, or started from a script "
                               f"that prepares data outside an `if __name__ == '__main__':` guard (spawned workers "
                               f"import the main module); give it more memory, add the guard, or set "
                               f"data.tokenize_workers to fewer processes (1: the calling process alone)") from None
        for key, job in chunk:
            yield key, (next(results) if job is not None else None)
