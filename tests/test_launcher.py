"""Launcher guards that need no running cluster: the run-directory lock, a stale cluster.json, mistyped commands,
``--resume`` against the checkpoint's drafter, data errors, and ``status`` (consistent view, closed pipe, ended run)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import launch.cluster as cluster
import launch.status as status
import launch.train as train
from dflash.config import ConfigError, load_config
from launch.status import control_request
from launch.train import lock_run_dir
from tests.test_resume_check import TINY, TINY_TOKENS, write_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def test_second_launcher_on_a_run_dir_is_refused(tmp_path, caplog):
    first = lock_run_dir(tmp_path)
    assert first is not None
    pid = (tmp_path / "launcher.pid").read_text().strip()
    assert pid == str(os.getpid())
    with caplog.at_level("ERROR"):
        assert lock_run_dir(tmp_path) is None
    assert f"another launcher (pid {pid})" in caplog.text and str(tmp_path) in caplog.text
    first.release()  # the first launcher exits: the directory is free again
    again = lock_run_dir(tmp_path)
    assert again is not None
    again.release()


def test_status_of_a_dead_launcher_answers_at_once(tmp_path, monkeypatch):
    import zmq

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "cluster.json").write_text(json.dumps({"control": "tcp://127.0.0.1:9", "launcher_pid": dead.pid,
                                                       "workers": {}}))

    def no_socket(*args, **kwargs):
        raise AssertionError("asked a dead launcher's socket (waits out the control timeout)")

    monkeypatch.setattr(zmq.Context, "instance", no_socket)
    with pytest.raises(RuntimeError, match="is gone"):
        control_request(tmp_path, "status", {})


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

    for module, name in ((cluster, "train"), (cluster, "control"), (train, "load_config"), (train, "lock_run_dir"),
                         (train, "build_batch_plans")):
        monkeypatch.setattr(module, name, must_not_run)
    with caplog.at_level("ERROR"):
        assert cluster.main(argv) == cluster.EXIT_CONFIG == 2
    assert f"unknown command {word!r}: {suggestion}" in caplog.text


def test_existing_invocations_still_dispatch(monkeypatch):
    calls = []
    for name in cluster.COMMANDS:
        monkeypatch.setitem(cluster.COMMANDS, name, lambda args: calls.append(vars(args)) or 0)
    assert cluster.main(["status", "--run-dir", "runs/x", "--json"]) == 0
    assert cluster.main(["restart", "target.0", "--run-dir", "runs/x"]) == 0
    assert cluster.main(["--run-dir", "runs/x", "stop"]) == 0  # a command after its options, too
    assert cluster.main(["--config", "c.yaml", "train.lr=3e-4", "--resume", "run_dir=/tmp/r"]) == 0
    assert cluster.main(["cluster.drafters=[0, 1]", "--config", "c.yaml"]) == 0
    assert cluster.main(["--mode", "regenerate", "--config", "c.yaml", "--output", "o.jsonl", "a.b=1"]) == 0
    assert cluster.main(["status", "run_dir=/tmp/r", "--config", "c.yaml"]) == 0
    where = {"run_dir": Path("runs/x"), "config": None, "overrides": []}
    assert calls == [
        {"command": "status", **where, "json": True},
        {"command": "restart", **where, "json": False, "worker": "target.0"},
        {"command": "stop", **where, "json": False},
        {"command": "train", "config": "c.yaml", "resume": True, "overwrite": False, "force": False,
         "overrides": ["train.lr=3e-4", "run_dir=/tmp/r"]},
        {"command": "train", "config": "c.yaml", "resume": False, "overwrite": False, "force": False,
         "overrides": ["cluster.drafters=[0, 1]"]},
        {"command": "regenerate", "args": ["--config", "c.yaml", "--output", "o.jsonl", "a.b=1"]},
        {"command": "status", "run_dir": None, "config": "c.yaml", "overrides": ["run_dir=/tmp/r"], "json": False},
    ]


def test_subcommand_forms_dispatch(monkeypatch):
    calls = []
    for name in cluster.COMMANDS:
        monkeypatch.setitem(cluster.COMMANDS, name, lambda args: calls.append(vars(args)) or 0)
    assert cluster.main(["train", "--config", "c.yaml", "--overwrite", "train.lr=3e-4"]) == 0
    assert cluster.main(["regenerate", "--config", "c.yaml", "--output", "o.jsonl"]) == 0
    assert cluster.main(["speculate", "--checkpoint", "runs/x", "--max-new-tokens", "8"]) == 0
    assert cluster.main(["export", "--checkpoint", "runs/x", "--out", "exports/x"]) == 0
    assert cluster.main(["attach", "drafter.1", "--config", "c.yaml"]) == 0
    assert calls == [
        {"command": "train", "config": "c.yaml", "resume": False, "overwrite": True, "force": False,
         "overrides": ["train.lr=3e-4"]},
        {"command": "regenerate", "args": ["--config", "c.yaml", "--output", "o.jsonl"]},
        {"command": "speculate", "args": ["--checkpoint", "runs/x", "--max-new-tokens", "8"]},
        {"command": "export", "args": ["--checkpoint", "runs/x", "--out", "exports/x"]},
        {"command": "attach", "run_dir": None, "config": "c.yaml", "json": False, "overrides": [],
         "worker": "drafter.1"},
    ]


def test_forwarded_commands_reach_their_module(monkeypatch):
    import dflash.inference.export
    import dflash.inference.regenerate
    import dflash.inference.speculative

    seen = []
    for module in (dflash.inference.regenerate, dflash.inference.speculative, dflash.inference.export):
        monkeypatch.setattr(module, "main", lambda argv, prog, name=module.__name__: seen.append((name, argv)) or 7)
    assert cluster.main(["--mode=regenerate", "--limit", "3"]) == 7
    assert cluster.main(["speculate", "--help"]) == 7
    assert cluster.main(["export", "--out", "x"]) == 7
    assert seen == [("dflash.inference.regenerate", ["--limit", "3"]), ("dflash.inference.speculative", ["--help"]),
                    ("dflash.inference.export", ["--out", "x"])]


@pytest.mark.parametrize("command", ["regenerate", "speculate", "export", "data"])
def test_forwarded_help_names_the_subcommand(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cluster.main([command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m launch.cluster {command} ")


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


# --------------------------------------------------------------------------- --resume against the checkpoint

CPU_CONFIG = ROOT / "configs" / "smollm2-135m-cpu.yaml"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tiny-run")
    return run_dir, write_checkpoint(run_dir, load_config(None, TINY, gpu_count=0), TINY_TOKENS)


class _Tokenizer:
    chat_template = "{{ messages }}"
    bos_token_id = eos_token_id = pad_token_id = None

    def __len__(self) -> int:
        return TINY_TOKENS

    def get_vocab(self) -> dict:
        return {f"t{i}": i for i in range(TINY_TOKENS)}


def _must_not_run(*args, **kwargs):
    raise AssertionError("reached past the --resume check")


def test_resume_mismatch_stops_before_data_and_workers(tiny_checkpoint, tmp_path, monkeypatch, caplog):
    run_dir, ckpt = tiny_checkpoint
    monkeypatch.setenv("DFLASH_WORKER", "test")
    monkeypatch.setattr(train, "load_tokenizer", lambda target_cfg: _Tokenizer())
    for name in ("build_batch_plans", "LocalCluster", "Supervisor", "Coordinator", "start_wandb"):
        monkeypatch.setattr(train, name, _must_not_run)
    before = (run_dir / "config.yaml").read_text()
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(load_config(None, TINY, gpu_count=0).to_dict()))
    with caplog.at_level("ERROR"):
        rc = cluster.main(["--config", str(config), "--resume", "drafter.num_layers=3", "drafter.block_size=8",
                           f"run_dir={run_dir}"])
    assert rc == cluster.EXIT_CONFIG == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "\n" not in errors[0]
    assert errors[0].startswith(f"--resume: this run's drafter does not match the checkpoint it would continue "
                                f"({ckpt / 'drafter' / 'config.json'}): num_hidden_layers (set by drafter.num_layers): "
                                f"checkpoint 2, this run 3; block_size (set by drafter.block_size): checkpoint 4, "
                                f"this run 8; ")
    assert (f"The run's {run_dir / 'config.yaml'} was written with drafter.num_layers=2, drafter.block_size=4. "
            in errors[0])
    assert errors[0].endswith("To continue this run, drop or fix the override(s) so that these fields match; to "
                              "start a new run in this directory instead, pass --overwrite (its checkpoints are "
                              "deleted), or choose another run_dir / name.")
    assert (run_dir / "config.yaml").read_text() == before and not (run_dir / "cluster.json").exists()
    assert not (run_dir / "logs").exists()


def test_resume_with_the_same_drafter_goes_on_to_the_data(tiny_checkpoint, tmp_path, monkeypatch, caplog):
    run_dir, _ = tiny_checkpoint
    monkeypatch.setenv("DFLASH_WORKER", "test")
    monkeypatch.setattr(train, "load_tokenizer", lambda target_cfg: _Tokenizer())

    def data_fails(cfg, tokenizer):
        assert isinstance(tokenizer, _Tokenizer)  # the tokenizer of the check is reused
        raise ConfigError("data.dataset: stop here")

    monkeypatch.setattr(train, "build_batch_plans", data_fails)
    monkeypatch.setattr(train, "LocalCluster", _must_not_run)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(load_config(None, TINY, gpu_count=0).to_dict()))
    with caplog.at_level("ERROR"):
        assert cluster.main(["--config", str(config), "--resume", "train.lr=1e-4", f"run_dir={run_dir}"]) == 2
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        "config error: data.dataset: stop here"]


def test_resume_mismatch_from_the_shell(tmp_path):
    """The reported case: the embedded CPU config's 1-layer checkpoint resumed with drafter.num_layers=2."""
    run_dir = tmp_path / "run"
    write_checkpoint(run_dir, load_config(CPU_CONFIG, gpu_count=0), 49152, step=300)
    res = subprocess.run([sys.executable, "-m", "launch.cluster", "--config", str(CPU_CONFIG), "--resume",
                          "drafter.num_layers=2", f"run_dir={run_dir}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "size mismatch" not in res.stderr
    assert "num_hidden_layers (set by drafter.num_layers): checkpoint 1, this run 2" in res.stderr
    assert "pass --overwrite" in res.stderr
    assert not (run_dir / "logs").exists() and not (run_dir / "cluster.json").exists()


# --------------------------------------------------------------------------- data errors, --resume/--overwrite

def _launch(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cluster", "--config", str(CPU_CONFIG), *overrides,
                           f"run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def _only_error(stderr: str) -> str:
    """The one error line of the launcher's log; asserts there is no traceback."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if " E [cluster] " in line]
    assert len(errors) == 1, stderr
    return errors[0].split(" dflash.cluster: ", 1)[1]


def test_too_few_conversations_for_the_held_out_set(tmp_path):
    res = _launch(tmp_path, "data.max_conversations=10")
    assert res.returncode == 2
    error = _only_error(res.stderr)
    assert error.startswith("config error: data.heldout_conversations: 32 held out of 9 conversations "
                            "leaves none to train on; data report: prepared 9 conversations (9 sequences) from 10 rows")
    assert "dropped 1: no_assistant_tokens=1" in error  # the report says where the 10th row went


def test_a_dataset_without_a_usable_row(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"id": "a", "text": "no messages"}\n[1, 2]\n')
    res = _launch(tmp_path, f"data.dataset={data}")
    assert res.returncode == 2
    assert _only_error(res.stderr).startswith(f"config error: data.dataset: no usable conversation in {data} "
                                              f"(prepared 0 conversations (0 sequences) from 2 rows")


def test_json_lines_saved_as_json(tmp_path):
    data = tmp_path / "x.json"
    data.write_text((ROOT / "tests" / "fixtures" / "bad_rows.jsonl").read_text())
    res = _launch(tmp_path, f"data.dataset={data}")
    assert res.returncode == 2
    assert _only_error(res.stderr) == (
        f"config error: data.dataset: {data}: not a JSON array (it does not start with '['): a .json file is read "
        f"as one JSON array of conversations; a JSON-lines file (one conversation per line) must end in .jsonl")


def test_resume_and_overwrite_are_exclusive(monkeypatch, capsys):
    monkeypatch.setattr(train, "load_config", _must_not_run)
    with pytest.raises(SystemExit) as exc:
        cluster.main(["--config", "c.yaml", "--resume", "--overwrite"])
    assert exc.value.code == 2
    assert "error: argument --overwrite: not allowed with argument --resume" in capsys.readouterr().err
    assert cluster.parse_args(["--config", "c.yaml", "--resume"]).resume
    assert cluster.parse_args(["--overwrite", "--config", "c.yaml", "a.b=1"]).overwrite


# --------------------------------------------------------------------------- status

RESTARTING = {"step": 7, "total_steps": 60, "attempt": 0, "stop_requested": None, "unassigned_batches": 2,
              "batches_in_flight": 1, "restarts": [],
              "workers": {"target.0": {"role": "target", "pid": None, "up": True, "ready": True, "failures": 1,
                                       "external": False},
                          "drafter.0": {"role": "drafter", "pid": 4242, "up": True, "ready": True, "failures": 0,
                                        "external": False},
                          "drafter.1": {"role": "drafter", "pid": 4243, "up": False, "ready": False, "failures": 0,
                                        "external": False}}}


def test_status_shows_a_worker_without_a_process_as_restarting(capsys):
    status.print_status(RESTARTING)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["worker", "node", "role", "pid", "state", "up", "ready", "failures", "external"]
    assert lines[2].split() == ["target.0", "0", "target", "-", "restarting", "False", "False", "1", "False"]
    assert lines[3].split() == ["drafter.0", "0", "drafter", "4242", "ready", "True", "True", "0", "False"]
    assert lines[4].split() == ["drafter.1", "0", "drafter", "4243", "starting", "False", "False", "0", "False"]


def test_status_lists_every_node_and_each_workers_node(capsys):
    data = {**RESTARTING, "nodes": {"0": {"addr": "10.0.0.1", "pid": 11, "state": "coordinator"},
                                    "1": {"addr": "10.0.0.2", "pid": 12, "state": "lost: silent"}},
            "workers": {**RESTARTING["workers"], "drafter.1": {**RESTARTING["workers"]["drafter.1"], "node": 1}}}
    status.print_status(data)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "node 0: 10.0.0.1  launcher pid 11  coordinator"
    assert lines[2] == "node 1: 10.0.0.2  launcher pid 12  lost: silent"
    assert lines[6].split()[:2] == ["drafter.1", "1"]
    view = status.worker_view
    assert view({"pid": 5, "up": True, "ready": False, "external": False})["state"] == "loading"
    assert view({"pid": 5, "up": True, "ready": True, "external": True})["state"] == "attached"
    assert view({"pid": 5, "up": False, "ready": False, "external": True})["state"] == "detached"


@pytest.fixture
def fake_cluster(tmp_path):
    """A run directory whose cluster.json points at a socket answering every ctl with RESTARTING."""
    import threading

    from dflash.runtime.control import CoordinatorSocket

    sock = CoordinatorSocket("127.0.0.1")
    done = threading.Event()

    def serve():
        while not done.is_set():
            got = sock.recv(0.05)
            if got is not None and got[1]["type"] == "ctl":
                sock.send(got[0], "ctl_reply", ok=True, text="ok", data=RESTARTING)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    (tmp_path / "cluster.json").write_text(json.dumps({"control": sock.endpoint, "launcher_pid": os.getpid(),
                                                       "workers": {}}))
    yield tmp_path
    done.set()
    thread.join(5)
    sock.close()


def test_status_json_is_consistent(fake_cluster):
    res = subprocess.run([sys.executable, "-m", "launch.cluster", "status", "--json", "--run-dir", str(fake_cluster)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    workers = json.loads(res.stdout)["workers"]
    assert workers["target.0"] == {"role": "target", "pid": None, "up": False, "ready": False, "failures": 1,
                                   "external": False, "state": "restarting"}
    assert workers["drafter.0"]["state"] == "ready" and workers["drafter.1"]["state"] == "starting"


@pytest.mark.parametrize("json_flag", [["--json"], []])
def test_status_into_a_closed_pipe_exits_quietly(fake_cluster, json_flag):
    proc = subprocess.Popen([sys.executable, "-m", "launch.cluster", "status", *json_flag, "--run-dir",
                             str(fake_cluster)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # `| head -1` gone before the answer is printed
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == cluster.EXIT_BROKEN_PIPE == 141
    assert err == "", err


def _ended_run(run_dir: Path, max_steps: int, step: int = 300) -> Path:
    import torch
    from safetensors.torch import save_file

    ckpt = run_dir / "checkpoints" / f"step-{step:08d}"
    (ckpt / "drafter").mkdir(parents=True)
    (ckpt / "drafter" / "config.json").write_text("{}")
    save_file({"w": torch.ones(2)}, str(ckpt / "drafter" / "model.safetensors"))
    torch.save({"trainer": {}, "rng": {}}, ckpt / "trainer.pt")
    (ckpt / "state.json").write_text(json.dumps({"step": step, "epoch": 0, "time": 1_800_000_000.0}))
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"name": "r", "train": {"max_steps": max_steps,
                                                                                  "eval_head_tokens": 96}}))
    lines = [{"step": step, "time": 1.0, "eval/tau": 1.125, "eval/tau_head": 1.25, "eval/tau_walk": 1.0625,
              "eval/tau_walk_head": 1.03125, "eval/loss": 6.4},
             {"step": step, "time": 2.0, "train/loss": 6.7}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return ckpt


def _status_error(run_dir: Path, monkeypatch, caplog, code: int = 1) -> str:
    monkeypatch.setenv("DFLASH_WORKER", "test")
    with caplog.at_level("ERROR"):
        assert cluster.main(["status", "--run-dir", str(run_dir)]) == code
    (message,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    return message


def test_status_of_a_finished_run(tmp_path, monkeypatch, caplog):
    ckpt = _ended_run(tmp_path, max_steps=300)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1_800_000_000.0))
    assert _status_error(tmp_path, monkeypatch, caplog) == (
        f"no running cluster in {tmp_path.resolve()}: the run has ended; its last checkpoint is "
        f"{tmp_path.resolve() / 'checkpoints' / ckpt.name} (step 300 of 300 (train.max_steps), written on {when}); "
        f"metrics up to step 300 are in {tmp_path.resolve() / 'metrics.jsonl'}, last held-out τ 1.125 at step 300, "
        f"1.250 in the first 96 tokens of each response, walked as decoding 1.062 (1.031 in the first 96) "
        f"(training's prediction of decoding τ); it is complete")


def test_status_of_a_stopped_run(tmp_path, monkeypatch, caplog):
    _ended_run(tmp_path, max_steps=400)
    message = _status_error(tmp_path, monkeypatch, caplog)
    assert "the run has ended; its last checkpoint is " in message and "(step 300 of 400 (train.max_steps)" in message
    assert message.endswith("; continue it with --resume (python -m launch.cluster --config <its config> --resume)")


def test_status_without_a_run(tmp_path, monkeypatch, caplog):
    assert _status_error(tmp_path, monkeypatch, caplog) == (
        f"no running cluster in {tmp_path.resolve()} (cluster.json is missing)")
    caplog.clear()
    assert _status_error(tmp_path / "nope", monkeypatch, caplog, code=2) == (
        f"no running cluster: {(tmp_path / 'nope').resolve()} does not exist")


# --------------------------------------------------------------------------- damaged checkpoints


def _resume_main(tmp_path, cfg, run_dir, monkeypatch) -> int:
    """``cluster.main --resume`` on ``run_dir``; fails the test if it gets past the checkpoint checks."""
    monkeypatch.setenv("DFLASH_WORKER", "test")
    for name in ("load_tokenizer", "build_batch_plans", "LocalCluster", "Supervisor", "Coordinator", "start_wandb"):
        monkeypatch.setattr(train, name, _must_not_run)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(cfg.to_dict()))
    return cluster.main(["--config", str(config), "--resume", f"run_dir={run_dir}"])


def test_resume_refuses_when_every_checkpoint_is_damaged(tmp_path, monkeypatch, caplog):
    run_dir = tmp_path / "run"
    cfg = load_config(None, TINY, gpu_count=0)
    for step in (2, 4):
        ckpt = write_checkpoint(run_dir, cfg, TINY_TOKENS, step=step)
        (ckpt / "trainer.pt").write_bytes(b"")
    with caplog.at_level("WARNING"):
        rc = _resume_main(tmp_path, cfg, run_dir, monkeypatch)
    assert rc == cluster.EXIT_CONFIG
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [f"--resume: every checkpoint in {run_dir / 'checkpoints'} is damaged (moved aside: "
                      f"step-00000002.damaged, step-00000004.damaged; the reasons are in their DAMAGED.txt); "
                      f"nothing to continue from: pass --overwrite to start again"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and all("moved aside to step-0000000" in w for w in warnings)


def test_resume_when_a_damaged_checkpoint_cannot_be_moved(tmp_path, monkeypatch, caplog):
    import errno
    import os

    run_dir = tmp_path / "run"
    cfg = load_config(None, TINY, gpu_count=0)
    ckpt = write_checkpoint(run_dir, cfg, TINY_TOKENS, step=2)
    (ckpt / "state.json").write_text('{"step": 2, "epo')

    def read_only(src, dst):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "rename", read_only)
    with caplog.at_level("ERROR"):
        rc = _resume_main(tmp_path, cfg, run_dir, monkeypatch)
    assert rc == cluster.EXIT_CONFIG
    (error,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert error.startswith(f"--resume: checkpoint {ckpt} is damaged (JSONDecodeError: ")
    assert error.endswith(f"and cannot be moved aside: OSError: [Errno {errno.EROFS}] Read-only file system; "
                          f"move it out of {ckpt.parent} by hand")


def test_status_of_an_ended_run_names_a_damaged_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(None, TINY, gpu_count=0)
    ckpt = write_checkpoint(run_dir, cfg, TINY_TOKENS, step=100)
    weights = ckpt / "drafter" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    text = status.ended_run_summary(run_dir)
    assert "that checkpoint is damaged (drafter/model.safetensors: SafetensorError" in text
    assert text.endswith("--resume moves it aside and continues from the previous one; continue it with --resume "
                         "(python -m launch.cluster --config <its config> --resume)")
    assert ckpt.is_dir()  # status only looks


def test_every_worker_gets_the_launchers_data_cache(tmp_path):
    """The launcher's cache directory is on every worker's command line (and in ``cluster.json``,
    which ``restart`` reuses); without one the workers prepare the data themselves."""
    from launch.local_cluster import CLUSTER_FILE, LocalCluster

    cfg = load_config(None, [*TINY, "cluster.drafters=[0, 1]"], gpu_count=0)
    cache = tmp_path / "data" / "0123456789abcdef"
    cluster_ = LocalCluster(cfg, tmp_path, "tcp://127.0.0.1:1", supervisor=None, data_cache=cache)
    cluster_.write_info()
    saved = json.loads((tmp_path / CLUSTER_FILE).read_text())["workers"]
    assert sorted(saved) == ["drafter.0", "drafter.1", "target.0"]
    for name, worker in saved.items():
        args = cluster_.spec(name).args
        assert args[args.index("--data-cache") + 1] == str(cache.resolve()) and worker["args"] == args
    plain = LocalCluster(cfg, tmp_path, "tcp://127.0.0.1:1", supervisor=None)
    assert all("--data-cache" not in plain.spec(name).args for name in saved)


def test_overwrite_refused_by_a_later_check_keeps_the_checkpoints(tmp_path):
    """--overwrite deletes the checkpoints only once the tokenizer and the data have passed: a
    tokenizer of another model is refused (before the data is tokenised with it) and nothing is lost."""
    run_dir = tmp_path / "run"
    write_checkpoint(run_dir, load_config(CPU_CONFIG, gpu_count=0), 49152, step=300)
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    res = _launch(tmp_path, "--overwrite", "target.tokenizer=qwen3")
    assert res.returncode == 2
    assert _only_error(res.stderr).startswith("config error: target.tokenizer: its 151669 tokens do not fit the "
                                              "target's 49152-row embedding")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == kept
    assert not list((tmp_path / "cache").glob("data/*"))  # refused before any data was prepared


def test_tokenizer_directories_that_cannot_load_are_config_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    res = _launch(tmp_path, f"target.tokenizer={empty}")
    assert res.returncode == 2
    assert _only_error(res.stderr).startswith(f"config error: target.tokenizer: {empty} holds no tokenizer")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    res = _launch(tmp_path, f"target.tokenizer={broken}")
    assert res.returncode == 2
    assert _only_error(res.stderr).startswith(f"config error: target.tokenizer: {broken} is not a tokenizer "
                                              "transformers can load")
