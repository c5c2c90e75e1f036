"""Launcher guards that need no running cluster: the run-directory lock and a stale cluster.json."""

import json
import subprocess
import sys
import time

import pytest

from launch.cluster import _control_request, _lock_run_dir


def test_second_launcher_on_a_run_dir_is_refused(tmp_path, caplog):
    first = _lock_run_dir(tmp_path)
    assert first is not None
    assert (tmp_path / "launcher.lock").read_text().strip().isdigit()
    with caplog.at_level("ERROR"):
        assert _lock_run_dir(tmp_path) is None
    assert "another launcher" in caplog.text and str(tmp_path) in caplog.text
    first.close()  # the first launcher exits: the directory is free again
    again = _lock_run_dir(tmp_path)
    assert again is not None
    again.close()


def test_status_of_a_dead_launcher_answers_at_once(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "cluster.json").write_text(json.dumps({"control": "tcp://127.0.0.1:9", "launcher_pid": dead.pid,
                                                       "workers": {}}))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="is gone"):
        _control_request(tmp_path, "status", {})
    assert time.monotonic() - started < 5.0
