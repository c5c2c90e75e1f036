"""The GPU check runner (benchmarks/gpu_checks.py) on the CPU: dry runs, budget and GPU skipping,
the pass rules on canned outputs, real runs of tiny checks, and the runbook's generated table."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_checks as gc
from benchmarks.gpu_checks import (CHECKS, Check, Context, ExitZero, FileExists, JsonValue, Match, Metric, NotReady,
                                   Outcome, Proc, Result)

REPO = Path(__file__).resolve().parent.parent
RUNBOOK = REPO / "docs" / "gpu-runbook.md"
BEGIN, END = "<!-- gpu-checks table: begin -->", "<!-- gpu-checks table: end -->"


def ctx_for(tmp_path: Path, gpus: int = 2, **kw) -> Context:
    return Context(root=str(tmp_path / "out"), gpus=gpus, python=sys.executable, **kw)


def test_dry_run_prints_commands_and_skips_by_gpus_inputs_and_budget(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gc, "packaged_gguf", lambda: None)  # as without the PyPI model package
    out = tmp_path / "out"
    rc = gc.main(["compile", "decode_tests", "limits", "compiled_pipeline", "regen", "--out", str(out),
                  "--budget-s", "800", "--gpus", "1", "--dry-run"])
    text = capsys.readouterr().out
    assert rc == 0
    assert not out.exists()  # a dry run writes nothing
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| check")}
    # compile (330 s) fits 800 s; decode_tests (600 s) does not fit the 470 s left; limits (300 s) does
    assert rows["compile"][0] == "would run" and rows["limits"][0] == "would run"
    assert rows["decode_tests"][0] == "skipped" and "470 s of the budget left" in rows["decode_tests"][-1]
    assert rows["compiled_pipeline"][0] == "skipped" and "needs 2 GPU(s), 1 visible" in rows["compiled_pipeline"][-1]
    assert rows["regen"][0] == "skipped" and "--gguf" in rows["regen"][-1]
    assert "-m benchmarks.bench_compile --arch qwen3-8b" in text and f"--out {out / 'compile'}" in text
    assert "limit 330 s" in text


def test_budget_counts_each_run_check(tmp_path):
    """Budget skipping against a naive running sum of the limits of the checks that ran."""
    checks = [Check(f"c{i}", "x", ((Proc(("{python}", "-c", "pass")),),), gpus=0, limit_s=lim)
              for i, lim in enumerate([300, 500, 250, 100, 400])]
    ran: list[str] = []

    def runner(check, ctx):  # each run check takes its whole limit: advance a fake clock
        ran.append(check.name)
        clock[0] += check.limit_s
        return Result(check.name, "passed", seconds=check.limit_s, limit_s=check.limit_s)

    clock = [0.0]
    results = gc.run_checks(checks, ctx_for(tmp_path), budget_s=1000, runner=runner, clock=lambda: clock[0])
    expect, used = [], 0
    for c in checks:
        if c.limit_s <= 1000 - used:
            expect.append(c.name)
            used += c.limit_s
    assert ran == expect == ["c0", "c1", "c3"]
    assert [r.status for r in results] == ["passed", "passed", "skipped", "passed", "skipped"]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [c["name"] for c in summary["checks"]] == [c.name for c in checks]
    assert summary["checks"][2]["reason"] == "needs up to 250 s, 200 s of the budget left"


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert gc.main(["no_such_check", "--out", str(tmp_path)]) == 2
    assert "unknown check(s) no_such_check" in capsys.readouterr().err
    assert gc.main(["compile", "--out", str(tmp_path), "--set", "stepz=3"]) == 2
    assert "--set 'stepz=3'" in capsys.readouterr().err
    for item, why in (("steps=0", "whole number >= 1"), ("steps=3e3", "whole number >= 1"),
                      ("regen_new_tokens=-5", "or empty"), ("ablation_raw=yes", "0 or 1"), ("decode_long=2", "0 or 1"),
                      ("ablation_sets=", "at least one"), ("ablation_sets=sharegpt sharegpt", "more than once"),
                      (f"ablation_sets=sharegpt {tmp_path / 'no.jsonl'}", "neither a name"),
                      ("decode_sets=sharegpt sharegpt", "more than once"), ("pass_schedules=", "comma-separated"),
                      ("pass_schedules=predicted,eager", "comma-separated")):
        assert gc.main(["compile", "--dry-run", "--set", item]) == 2, item
        assert f"--set {item}: " in (err := capsys.readouterr().err) and why in err, err
    assert gc.main(["compile", "--dry-run", "--set", "regen_new_tokens=", "--set", "steps=12"]) == 0
    capsys.readouterr()
    assert gc.main(["compile"]) == 2
    assert "--out DIR is required" in capsys.readouterr().err
    assert gc.main(["regen", "--out", str(tmp_path), "--gguf", str(tmp_path / "missing.gguf")]) == 2
    assert "--gguf" in capsys.readouterr().err


def _outcome(tmp_path: Path, rcs, logs: dict[str, str] | None = None, files: dict[str, str] | None = None) -> Outcome:
    folder = tmp_path / "out" / "check"
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in {**(logs or {}), **(files or {})}.items():
        (folder / name).write_text(text)
    return Outcome(folder, list(rcs))


def test_rules_on_canned_outputs(tmp_path):
    pytest_log = "....s.\n5 passed, 1 skipped in 12.3s\n"
    skipped_log = "ssss\n4 skipped in 0.5s\n"
    o = _outcome(tmp_path, [0], logs={"output.log": pytest_log})
    assert ExitZero().failure(o) is None
    assert Match(r"\b[1-9][0-9]* passed").failure(o) is None
    assert Match(r"\bfailed\b", absent=True).failure(o) is None
    assert ExitZero().failure(_outcome(tmp_path, [0, 1])) == "exit status [0, 1]"
    assert ExitZero().failure(_outcome(tmp_path, [])) is not None  # nothing ran
    (o.folder / "output.log").write_text(skipped_log)  # every test skipped: not a pass
    assert "not found" in Match(r"\b[1-9][0-9]* passed").failure(o)

    (o.folder / "bench.json").write_text(json.dumps({"a": {"b": 0.95}, "re": 0, "loss": 4.4e-4, "s": "ok"}))
    assert JsonValue("bench.json", "a.b", ">=", 0.9).failure(o) is None
    assert JsonValue("bench.json", "a.b", ">=", 0.96).failure(o) == "bench.json: a.b = 0.95"
    assert JsonValue("bench.json", "re", "==", 0).failure(o) is None
    assert JsonValue("bench.json", "loss", "<=", 1e-3).failure(o) is None
    assert JsonValue("bench.json", "s", "==", "ok").failure(o) is None
    assert JsonValue("bench.json", "a.c", "==", 0).failure(o) == "bench.json: no a.c"
    assert "missing.json" in JsonValue("missing.json", "a", "==", 0).failure(o)

    rows = [{"step": 1, "target.0/rerecords": 0, "drafter.0/rerecords": 0, "drafter.0/checkpoint_block_s": 0.0},
            {"step": 10, "target.0/rerecords": 0, "drafter.0/rerecords": 0, "drafter.0/checkpoint_block_s": 7.6},
            {"step": 20, "target.0/rerecords": 0, "drafter.0/rerecords": 2, "drafter.0/checkpoint_block_s": 0.23}]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 21, "drafter.0/rer'  # a cut last line
    (o.folder / "m.jsonl").write_text(text)
    assert Metric("m.jsonl", r"^target\.0/rerecords$", "==", 0).failure(o) is None
    assert Metric("m.jsonl", r"/rerecords$", "==", 0).failure(o) == "m.jsonl: drafter.0/rerecords = 2"
    assert Metric("m.jsonl", r"checkpoint_block_s$", "<=", 1.0).failure(o) is None  # the last one
    assert Metric("m.jsonl", r"checkpoint_block_s$", "<=", 1.0, rows="all").failure(o) == \
        "m.jsonl: drafter.0/checkpoint_block_s = 7.6"
    assert "no key matching" in Metric("m.jsonl", r"^nothing$", "==", 0).failure(o)

    assert "missing or empty" in FileExists("{root}/regen/turn1.jsonl").failure(o)
    (tmp_path / "out" / "regen").mkdir()
    (tmp_path / "out" / "regen" / "turn1.jsonl").write_text('{"id": 1}\n')
    assert FileExists("{root}/regen/turn1.jsonl").failure(o) is None


def test_run_check_passes_fails_and_stops_at_its_limit(tmp_path):
    ctx = ctx_for(tmp_path)
    ok = Check("ok", "x", ((Proc(("{python}", "-c", "print('7 passed')"), log="a.log"),
                            Proc(("{python}", "-c", "import json; json.dump(dict(v=3), open('{out}/r.json', 'w'))"),
                                 log="b.log")),
                           (Proc(("{python}", "-c", "print('second step')")),)),
               gpus=0, limit_s=120, passes=(ExitZero(), Match(r"7 passed", log="a.log"), JsonValue("r.json", "v", "==", 3)))
    r = gc.run_check(ok, ctx)
    assert (r.status, r.rcs, r.reason) == ("passed", [0, 0, 0], "")
    folder = tmp_path / "out" / "ok"
    assert "second step" in (folder / "output.log").read_text()
    assert (folder / "a.log").read_text().startswith("$ ")  # the command line, then its output

    bad = Check("bad", "x", ((Proc(("{python}", "-c", "import sys; sys.exit(3)")),),
                             (Proc(("{python}", "-c", "print('never')")),)), gpus=0, limit_s=120)
    r = gc.run_check(bad, ctx)
    assert (r.status, r.rcs) == ("failed", [3]) and "exit status [3]" in r.reason
    assert "never" not in (tmp_path / "out" / "bad" / "output.log").read_text()

    slow = Check("slow", "x", ((Proc(("{python}", "-c", "import time; time.sleep(120)")),),), gpus=0, limit_s=1)
    r = gc.run_check(slow, ctx)
    assert r.status == "timeout" and r.rcs[0] != 0 and "limit of 1 s" in r.reason


def test_regen_data_gathers_complete_rows_of_a_cut_run(tmp_path):
    root = tmp_path / "out"
    with pytest.raises(NotReady, match="run the regen check first"):
        gc.regen_data(root)
    folder = root / "regen"
    folder.mkdir(parents=True)
    (folder / "turn1.jsonl.rank0").write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c", "conv')
    (folder / "turn1.jsonl.rank1").write_text('{"id": "d"}\n')
    (folder / "turn1.jsonl.rank1.tmp").write_text('{"id": "x"}\n')  # not a shard
    path = gc.regen_data(root)
    assert path == str(folder / "partial.jsonl")
    assert [json.loads(line)["id"] for line in Path(path).read_text().splitlines()] == ["a", "b", "d"]
    (folder / "turn1.jsonl").write_text('{"id": "full"}\n')
    assert gc.regen_data(root) == str(folder / "turn1.jsonl")


def test_every_check_resolves_to_runnable_commands(tmp_path):
    """With every input present, no placeholder is left, every module exists and every test file too."""
    root = tmp_path / "out"
    (root / "regen").mkdir(parents=True)
    (root / "regen" / "turn1.jsonl").write_text('{"id": 1}\n')
    (root / "ablation").mkdir()
    (root / "ablation" / "recipe.json").write_text(json.dumps({"overrides": ["train.lr=1.2e-3"]}))
    ctx = ctx_for(tmp_path, gpus=1, gguf="/m/smollm2.gguf", sharegpt="/d/sharegpt.jsonl", tokenizer="/t/qwen3")
    names = [c.name for c in CHECKS]
    assert len(set(names)) == len(names)
    for check in CHECKS:
        steps = check.commands(ctx)
        assert steps and check.limit_s > 0 and check.gpus >= 1
        for step in steps:
            for argv, _ in step:
                line = " ".join(argv)
                assert not re.search(r"\{[a-z_]+\}", line), (check.name, line)
                assert argv[0] == sys.executable and argv[1] == "-m"
                assert importlib.util.find_spec(argv[2]) is not None, argv[2]
                for a in argv:
                    if a.startswith(("tests/", "configs/")):
                        assert (REPO / a).is_file(), a
    train_best = gc.BY_NAME["train_best"].commands(ctx)[0][0][0]
    assert "train.lr=1.2e-3" in train_best and "cluster.allow_shared_gpu=true" in train_best
    assert f"data.dataset={root / 'regen' / 'turn1.jsonl'}" in train_best
    with pytest.raises(NotReady, match="recipe.json"):
        (root / "ablation" / "recipe.json").unlink()
        gc.BY_NAME["train_best"].commands(ctx)


def test_settings_fill_the_commands(tmp_path):
    values = {k: v for k, (v, _) in gc.VARIABLES.items()}
    values.update(attention="reduce+sdpa", speed_modes="none", decode_long="0", checkpoint="/r/run-best",
                  decode_sets="sharegpt humaneval", pass_schedules="predicted,pipelined")
    ctx = ctx_for(tmp_path, gpus=1, gguf="/m.gguf", sharegpt="/s.jsonl", values=values)
    steps = gc.BY_NAME["decode_one"].commands(ctx)
    assert len(steps) == 1  # no speed step, one spec, no 512-token bench
    argv = steps[0][0][0]
    assert argv[argv.index("--attention") + 1] == "reduce+sdpa"
    assert argv[argv.index("--config") + 1] == "/r/run-best/config.yaml"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--prompt-set"] == ["sharegpt", "humaneval"]
    assert argv[argv.index("--pass-schedules") + 1] == "predicted,pipelined"
    assert argv[argv.index("--out") + 1] == str(tmp_path / "out" / "decode_one" / "decode-96-reduce-sdpa")


def test_runbook_table_is_the_generated_one():
    text = RUNBOOK.read_text()
    assert BEGIN in text and END in text, f"{RUNBOOK} lacks the generated table's markers"
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"
    assert table == gc.markdown_table() + "\n" + gc.variables_table(), (
        "docs/gpu-runbook.md's check table is stale: replace it with "
        "`python -m benchmarks.gpu_checks --list --markdown`")


def test_dry_run_needs_no_out_and_budget_must_be_positive(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert gc.main(["--dry-run", "gpu_tests"]) == 0
    assert not (tmp_path / "results").exists()  # a dry run writes nothing
    assert gc.main(["--dry-run", "gpu_tests", "--budget-s", "0"]) == 2
    assert "--budget-s 0: must be > 0" in capsys.readouterr().err
