"""Logging with the worker's name in every line (``target.0``, ``drafter.1``, ``cluster``)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable

__all__ = ["setup_logging", "worker_name", "run_logged", "EXIT_ERROR", "EXIT_INTERRUPTED"]

_FORMAT = "%(asctime)s %(levelname).1s [%(worker)s] %(name)s: %(message)s"
_DATEFMT = "%H:%M:%S"


def worker_name() -> str:
    """This process's worker name: ``$DFLASH_WORKER`` (set by the launcher), else ``main``."""
    return os.environ.get("DFLASH_WORKER", "main")


class _WorkerFilter(logging.Filter):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.worker = name

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.worker
        return True


def setup_logging(name: str | None = None, level: str | int = "INFO") -> logging.Logger:
    """Configure the root logger once per process: one stderr handler, the worker's name in each line.

    Args:
        name: worker name (default :func:`worker_name`).
        level: logging level name or number.
    Returns:
        The ``dflash`` logger.
    """
    name = name or worker_name()
    os.environ["DFLASH_WORKER"] = name
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_dflash", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._dflash = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter(_FORMAT, _DATEFMT))
    handler.addFilter(_WorkerFilter(name))
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("urllib3", "filelock", "wandb", "torch._dynamo", "torch._inductor"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    if not sys.stderr.isatty():
        # piped: carriage-return progress bars without the worker's name (transformers' "Loading
        # weights") would garble the log; transformers and huggingface_hub read this when imported
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        if "transformers" in sys.modules:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
    return logging.getLogger("dflash")


#: Exit status of a command stopped by an unexpected error (its traceback is logged).
EXIT_ERROR = 3
#: Exit status of a command stopped by Ctrl-C.
EXIT_INTERRUPTED = 130


def run_logged(run: Callable[[], int], log: logging.Logger, what: str) -> int:
    """``run()``'s exit status; :data:`EXIT_INTERRUPTED` on Ctrl-C and :data:`EXIT_ERROR` (traceback
    logged) on any other exception, so an error never reads as one of the command's own statuses
    (the decoding commands use 1 for a failed lossless check)."""
    try:
        return run()
    except KeyboardInterrupt:
        log.error("interrupted")
        return EXIT_INTERRUPTED
    except Exception:  # noqa: BLE001 - every error becomes EXIT_ERROR
        log.exception("%s stopped by an error", what)
        return EXIT_ERROR
