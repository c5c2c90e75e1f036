"""Small operating-system utilities shared by the launcher, the workers and the caches.

- :func:`atomic_directory` / :func:`atomic_write_text`: build a directory or file under a
  temporary sibling name, flush it to disk (``fsync``) and rename it into place, so a crash or a
  power loss never leaves a half-written one under the final name;
- :func:`file_lock`: an exclusive lock between processes (``flock`` through :mod:`filelock`);
- :func:`process_alive`: whether a pid names a running process (through :mod:`psutil`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator, Optional, Union

import filelock
import psutil

__all__ = ["atomic_directory", "atomic_write_text", "fsync_dir", "fsync_tree", "file_lock", "LockTimeout",
           "process_alive"]

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
#: Raised by ``file_lock(path).acquire(timeout=...)`` when another process holds the lock past the timeout.
LockTimeout = filelock.Timeout


def fsync_dir(path: PathLike) -> None:
    """``fsync`` directory ``path``, so that a rename or a new entry in it survives a power loss.

    A platform or file system without directory descriptors is skipped silently.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: PathLike) -> None:
    """``fsync`` every file and directory under ``root`` (``root`` included)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(dirpath)


def _temporary_sibling(final: Path) -> Path:
    return final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def atomic_directory(final: PathLike, *, replace: bool = False, tmp: Optional[PathLike] = None) -> Iterator[Path]:
    """Build directory ``final`` under a temporary sibling name; rename it into place at the end.

    Yields the (new, empty) temporary directory to fill. When the block ends normally, every file
    and directory in it is ``fsync``-ed, it is renamed to ``final`` (``os.replace``) and ``final``'s
    parent is ``fsync``-ed: ``final`` is either absent, the previous version or the whole new one,
    also after a power loss. When the block raises, the temporary directory is removed.

    Args:
        final: the directory to write; its parent is created.
        replace: an existing ``final`` is replaced (moved aside, the new one renamed in, the old
            one removed). Without it an existing ``final`` is kept (another process wrote the
            same content first) and the temporary copy is discarded.
        tmp: the temporary directory's path (a sibling of ``final``); one that exists is removed
            first. Default: ``.<name>.tmp-<pid>-<random>`` beside ``final``.

    Raises:
        OSError: from creating, writing or renaming the directories.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tmp) if tmp is not None else _temporary_sibling(final)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        old = None
        if replace and final.exists():
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
        try:
            os.replace(tmp, final)
        except OSError:
            if replace or not final.is_dir():
                raise
            log.debug("%s already written by another process; keeping it", final)
        fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_text(path: PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to file ``path`` through a temporary sibling, ``fsync`` it, rename it
    into place and ``fsync`` the directory: readers see the old or the new content, never a part.

    Raises:
        OSError: from writing or renaming.
    """
    path = Path(path)
    tmp = _temporary_sibling(path)
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return path


def file_lock(path: PathLike) -> filelock.FileLock:
    """An exclusive lock between processes on file ``path`` (``flock``), its directory created.

    Use it as a context manager (waits for the lock) or call ``acquire(timeout=0)`` (raises
    :data:`LockTimeout` when another process holds it) and ``release()``. The operating system
    releases the lock when its holder exits, also after a crash; the file stays in place.
    Source: the ``filelock`` package (``FileLock`` is ``UnixFileLock`` on Linux).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return filelock.FileLock(str(path))


def process_alive(pid: int) -> bool:
    """Whether ``pid`` names a process that still runs: ``False`` when there is none or it is a
    zombie (exited, not reaped: its memory and CUDA context are already gone); ``True`` when it
    exists but may not be inspected (another user's)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def count_noun(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: ``"1 prompt"``, ``"2 prompts"``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
