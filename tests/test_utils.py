"""dflash.utils: atomic directory / file writes, the file lock between processes, process checks."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.utils import LockTimeout, atomic_directory, atomic_write_text, file_lock, process_alive

ROOT = Path(__file__).resolve().parent.parent


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def test_atomic_directory_writes_and_leaves_no_temporary(tmp_path):
    final = tmp_path / "cache" / "abc"
    with atomic_directory(final) as tmp:
        assert tmp.parent == final.parent and tmp != final and not final.exists()
        (tmp / "sub").mkdir()
        (tmp / "a.txt").write_text("one")
        (tmp / "sub" / "b.txt").write_text("two")
    assert _tree(final) == {"a.txt": "one", "sub/b.txt": "two"}
    assert _siblings(final) == []


def test_atomic_directory_fsyncs_every_file_before_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a))), real_replace(a, b))[1])
    final = tmp_path / "d"
    with atomic_directory(final, tmp=tmp_path / "d.tmp-1") as tmp:
        for name in ("x", "y", "z"):
            (tmp / name).write_text(name)
    (rename,) = [i for i, e in enumerate(events) if e == ("replace", str(tmp_path / "d.tmp-1"))]
    assert {("fsync", str(tmp_path / "d.tmp-1" / n)) for n in "xyz"} <= set(events[:rename])
    assert ("fsync", str(tmp_path / "d.tmp-1")) in events[:rename]
    assert ("fsync", str(tmp_path)) in events[rename:]  # the rename itself is on disk


def test_atomic_directory_failure_keeps_the_old_version(tmp_path):
    final = tmp_path / "d"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="half way"):
        with atomic_directory(final, replace=True) as tmp:
            (tmp / "new.txt").write_text("new")
            raise RuntimeError("half way")
    assert _tree(final) == {"old.txt": "old"} and _siblings(final) == []


def test_atomic_directory_replace_or_keep(tmp_path):
    final = tmp_path / "d"
    for content, replace in (("first", False), ("second", True), ("third", False)):
        with atomic_directory(final, replace=replace) as tmp:
            (tmp / "f").write_text(content)
    # replace=True replaced the first; without it the existing directory (another writer's) is kept
    assert _tree(final) == {"f": "second"} and _siblings(final) == []


def test_atomic_directory_removes_a_stale_named_temporary(tmp_path):
    stale = tmp_path / "d.tmp-7"
    stale.mkdir()
    (stale / "junk").write_text("junk")
    with atomic_directory(tmp_path / "d", tmp=stale) as tmp:
        (tmp / "f").write_text("f")
    assert _tree(tmp_path / "d") == {"f": "f"} and not stale.exists()


def test_atomic_write_text(tmp_path, monkeypatch):
    path = tmp_path / "cluster.json"
    atomic_write_text(path, "one")
    atomic_write_text(path, "two")
    assert path.read_text() == "two" and _siblings(path) == []

    def no_rename(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(path, "three")
    assert path.read_text() == "two" and _siblings(path) == []


HOLDER = """
import sys
from dflash.utils import file_lock
lock = file_lock(sys.argv[1])
lock.acquire()
print("held", flush=True)
sys.stdin.read()  # holds the lock until the test closes stdin
"""


def test_file_lock_excludes_another_process_until_it_exits(tmp_path):
    path = tmp_path / "sub" / "x.lock"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        lock = file_lock(path)
        with pytest.raises(LockTimeout):
            lock.acquire(timeout=0)
        holder.stdin.close()  # the holder exits: the operating system releases its lock
        assert holder.wait(timeout=60) == 0
        lock.acquire(timeout=60)
        assert lock.is_locked
        lock.release()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=60)


def test_process_alive():
    assert process_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    assert not process_alive(child.pid)
    child.wait(timeout=60)  # reaped: the pid names no process
    assert not process_alive(child.pid)
