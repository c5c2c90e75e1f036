"""Launcher guards that need no running cluster: the run-directory lock, a stale cluster.json, mistyped commands."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import launch.cluster as cluster
from dflash.config import ConfigError
from launch.cluster import _control_request, _lock_run_dir

ROOT = Path(__file__).resolve().parent.parent


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


@pytest.mark.parametrize("argv, word, suggestion", [
    (["restrat", "target.0", "--run-dir", "runs/x"], "restrat", "did you mean 'restart'?"),
    (["stauts"], "stauts", "did you mean 'status'?"),
    (["--config", "configs/smollm2-135m-cpu.yaml", "atach", "drafter.0"], "atach", "did you mean 'attach'?"),
    (["resume", "--config", "configs/smollm2-135m-cpu.yaml"], "resume", "did you mean '--resume'?"),
    (["configs/smollm2-135m-cpu.yaml"], "configs/smollm2-135m-cpu.yaml",
     "did you mean '--config configs/smollm2-135m-cpu.yaml'?"),
    (["launch", "--config", "c.yaml"], "launch", "control commands are status, restart, stop, attach"),
])
def test_mistyped_command_fails_before_any_config_loads(argv, word, suggestion, monkeypatch, caplog):
    monkeypatch.setenv("DFLASH_WORKER", "test")  # setup_logging writes it; restored after the test

    def must_not_run(*args, **kwargs):
        raise AssertionError("reached past the command check")

    for name in ("load_config", "parse_args", "control_main", "_lock_run_dir", "build_batch_plans"):
        monkeypatch.setattr(cluster, name, must_not_run)
    with caplog.at_level("ERROR"):
        assert cluster.main(argv) == cluster.EXIT_CONFIG == 2
    assert f"unknown command {word!r}: {suggestion}" in caplog.text


def test_existing_invocations_still_dispatch(monkeypatch):
    calls = []
    monkeypatch.setattr(cluster, "control_main", lambda argv: calls.append(("control", argv)) or 0)

    def fake_load_config(path, overrides, gpu_count=None):
        calls.append(("train", path, overrides))
        raise ConfigError("stop here")

    monkeypatch.setattr(cluster, "load_config", fake_load_config)
    monkeypatch.setenv("DFLASH_WORKER", "test")
    assert cluster.main(["status", "--run-dir", "runs/x", "--json"]) == 0
    assert cluster.main(["restart", "target.0", "--run-dir", "runs/x"]) == 0
    assert cluster.main(["--run-dir", "runs/x", "stop"]) == 0  # a command after its options, too
    assert cluster.main(["--config", "c.yaml", "train.lr=3e-4", "--resume", "run_dir=/tmp/r"]) == 2
    assert cluster.main(["cluster.drafters=[0, 1]", "--config", "c.yaml"]) == 2
    assert calls == [
        ("control", ["status", "--run-dir", "runs/x", "--json"]),
        ("control", ["restart", "target.0", "--run-dir", "runs/x"]),
        ("control", ["--run-dir", "runs/x", "stop"]),
        ("train", "c.yaml", ["train.lr=3e-4", "run_dir=/tmp/r"]),
        ("train", "c.yaml", ["cluster.drafters=[0, 1]"]),
    ]


def test_first_word_skips_options_and_their_values():
    assert cluster.first_word(["--config", "status", "x=1"]) == "x=1"
    assert cluster.first_word(["--config=c.yaml", "--resume", "stop"]) == "stop"
    assert cluster.first_word(["--run-dir", "d", "--json"]) is None
    assert cluster.first_word(["--", "stauts"]) is None
    assert cluster.first_word([]) is None


def test_mistyped_command_exit_code_from_the_shell(tmp_path):
    res = subprocess.run([sys.executable, "-m", "launch.cluster", "restrat", "target.0", "--config",
                          "configs/smollm2-135m-cpu.yaml", f"run_dir={tmp_path / 'run'}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "unknown command 'restrat': did you mean 'restart'?" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "run").exists()
