"""Logging with the worker's name in every line (``target.0``, ``drafter.1``, ``cluster``)."""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["setup_logging", "worker_name"]

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
    return logging.getLogger("dflash")
