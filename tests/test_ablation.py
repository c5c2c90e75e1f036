"""scripts/ablation.py: variant parsing, the training and decoding columns against naive
computations on random metrics, and config errors before anything runs."""

from __future__ import annotations

import importlib
import math
import random
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ablation():
    return importlib.import_module("scripts.ablation")


def test_parse_variant(ablation):
    v = ablation.parse_variant("wide=drafter.num_layers=7, train.lr=1e-3")
    assert (v.name, v.overrides) == ("wide", ["drafter.num_layers=7", "train.lr=1e-3"])
    for bad in ("noequals", "=train.lr=1", "x=train.lr", "x=", "../x=train.lr=1", "a/b=train.lr=1", ".h=train.lr=1"):
        with pytest.raises(ValueError, match="--variant"):
            ablation.parse_variant(bad)


def test_select_variants(ablation):
    assert [v.name for v in ablation.select_variants(None, [])] == list(ablation.VARIANTS)
    got = ablation.select_variants("gamma-4, baseline", ["c=train.lr=1e-4"])
    assert [(v.name, v.overrides) for v in got] == [("gamma-4", ["drafter.loss_weighting=decay", "drafter.loss_gamma=4"]),
                                                    ("baseline", []),
                                                    ("c", ["train.lr=1e-4"])]
    with pytest.raises(ValueError, match="unknown.*'nope'"):
        ablation.select_variants("baseline,nope", [])
    with pytest.raises(ValueError, match="given twice"):
        ablation.select_variants("baseline", ["baseline=train.lr=1"])


@pytest.mark.parametrize("base", ["smollm2-135m-h200-regen.yaml", "smollm2-135m-cpu.yaml"])
def test_every_builtin_variant_is_a_valid_config_on_the_shipped_bases(ablation, base):
    """A variant's overrides name every setting the change needs (a position decay on a D-PACE base
    sets the weighting too), so none fails its config check on either base the ablation defaults to."""
    from dflash.config import load_config

    path = REPO / "configs" / base
    for name, (overrides, _) in ablation.VARIANTS.items():
        if name in ("extra-1", "extra-2") and base == "smollm2-135m-cpu.yaml":
            continue  # samples data.extra_datasets, which the CPU base leaves empty
        load_config(path, overrides, gpu_count=2)


def test_train_summary_matches_a_naive_reading(ablation):
    rng = random.Random(3)
    rows, evals = [], []
    for step in range(1, 201):
        row = {"step": step, "train/loss": rng.random(), "time/step_s": rng.uniform(0.05, 0.5)}
        if step % 50 == 0:
            row.update({k: rng.uniform(1, 5) for k in ablation.EVAL_KEYS})
            evals.append(row)
        rows.append(row)
    rows.insert(0, {"step": 0, "eval/tau": 1.0, "eval/loss": 9.0})  # the evaluation before training
    got = ablation.train_summary(rows)
    times = sorted(r["time/step_s"] for r in rows if r["step"] > 20)
    n = len(times)
    median = times[n // 2] if n % 2 else (times[n // 2 - 1] + times[n // 2]) / 2
    assert got["steps"] == 200 and got["eval_step"] == 200
    assert got["step_s"] == pytest.approx(median)
    for k in ablation.EVAL_KEYS:
        assert got[k] == evals[-1][k]
    none = ablation.train_summary([{"step": 1, "time/step_s": 0.2}])
    assert none["step_s"] == 0.2 and all(math.isnan(none[k]) for k in ablation.EVAL_KEYS)


def test_table_rows_and_baseline_delta(ablation):
    rng = random.Random(5)
    vs = ablation.select_variants("baseline,gamma-4,layers-3", [])
    for v in vs:
        v.result = {"ok": True, "step_s": rng.uniform(0.1, 0.2), "train_s": 100.0, "decode_tau": rng.uniform(1.5, 3),
                    "decode_walk": 2.0, "decode_check": "3/13/0", **{k: rng.uniform(1, 5) for k in ablation.EVAL_KEYS}}
    vs[2].result = {"ok": False, "error": "training exit 1"}
    meta = {"config": "c.yaml", "overrides": ["a=b"], "steps": 10, "prompts": 16, "max_new_tokens": 96,
            "decode_mode": "eager", "decode_dtype": "bfloat16", "decode_batch": 16}
    lines = ablation.table(vs, meta).splitlines()
    rows = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| variant")]
    assert len(rows) == 3
    cells = [c.strip() for c in rows[1].split("|")[1:-1]]
    assert cells[0] == "gamma-4"
    assert cells[6:8] == [f"{vs[1].result['eval/tau_walk_head']:.3f}", f"{vs[1].result['eval/tau_walk_first']:.3f}"]
    assert cells[8] == f"{vs[1].result['decode_tau']:.3f}"
    assert cells[9] == f"{vs[1].result['decode_tau'] - vs[0].result['decode_tau']:+.3f}"
    assert rows[0].split("|")[10].strip() == "–"  # the baseline has no delta
    assert "layers-3 (training exit 1)" in rows[2] and rows[2].count("–") >= 6


def test_bad_override_fails_before_any_run(ablation, tmp_path, capsys):
    rc = ablation.main(["--config", str(REPO / "configs/smollm2-135m-cpu.yaml"), "--gpus", "cpu", "--variants", "baseline",
                        "--variant", "oops=drafter.block_size=-3", "--out", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "variant oops" in err and "drafter.block_size" in err
    assert not (tmp_path / "o").exists()


def test_kept_results_are_reused_only_with_the_same_setup(ablation, tmp_path, capsys):
    """A finished variant is kept when its settings match (nothing runs), refused when they do not,
    and so is a run directory that the ablation did not record starting."""
    import json

    out = tmp_path / "o"
    argv = ["--config", str(REPO / "configs/smollm2-135m-cpu.yaml"), "--gpus", "cpu", "--variants", "gamma-4",
            "--steps", "7", "--out", str(out), "train.lr=1e-3"]
    args = ablation.parse_args(argv)
    (v,) = ablation.select_variants("gamma-4", [])
    (out / "gamma-4").mkdir(parents=True)
    kept = {"variant": "gamma-4", "ok": True, "setup": ablation.setup(args, v), "decode_tau": 2.5, "step_s": 0.1}
    (out / "gamma-4" / "result.json").write_text(json.dumps(kept))
    assert ablation.main(argv) == 0
    assert "| gamma-4 | loss position decay γ 4 | 0.100 |" in (out / "ablation.md").read_text()
    assert args.overrides + ["drafter.loss_weighting=decay", "drafter.loss_gamma=4"] == kept["setup"]["overrides"]
    assert ablation.main([a if a != "7" else "8" for a in argv]) == 2
    err = capsys.readouterr().err
    assert "variant gamma-4: started with other settings (steps: then 7, now 8)" in err
    assert str(out / "runs" / "gamma-4") in err  # the advice names the run directory too
    (out / "gamma-4" / "result.json").unlink()
    (out / "runs" / "gamma-4").mkdir(parents=True)  # a run left by someone else
    assert ablation.main(argv) == 2
    assert "holds a run this ablation did not record starting" in capsys.readouterr().err
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit):
        ablation.parse_args(argv[:-3] + ["--out", str(tmp_path / "f")])
    assert "--out" in capsys.readouterr().err  # "is a file, not a directory"


def test_stacked_recipe_against_a_naive_reading(ablation):
    """Random results: the stacked recipe holds the variants beating baseline by more than the
    margin, largest gain first, except one that sets a key to another value than a kept one did;
    each key once."""
    rng = random.Random(7)
    keys = ["drafter.loss_gamma", "train.lr", "drafter.num_layers", "train.warmup_ratio"]
    clashes = 0
    for _ in range(200):
        results = [{"variant": "baseline", "overrides": [], "ok": True, "decode_tau": rng.uniform(1.5, 2.5)}]
        for i in range(rng.randint(0, 6)):
            over = [f"{k}={rng.randint(1, 3)}" for k in rng.sample(keys, rng.randint(1, 2))]
            r = {"variant": f"v{i}", "overrides": over, "ok": rng.random() > 0.2, "decode_tau": rng.uniform(1.5, 2.5)}
            if rng.random() < 0.1:
                del r["decode_tau"]
            results.append(r)
        rng.shuffle(results)
        got = ablation.stacked_recipe(results, margin=0.05)
        base = next(r["decode_tau"] for r in results if r["variant"] == "baseline")
        winners = [r for r in results if r["variant"] != "baseline" and r["ok"] and "decode_tau" in r
                   and r["decode_tau"] - base > 0.05]
        winners.sort(key=lambda r: r["decode_tau"], reverse=True)
        kept, want, value = [], [], {}
        for r in winners:  # naive: walk the winners; one that contradicts a kept value stays out
            items = [(item.split("=")[0], item) for item in r["overrides"]]
            if any(k in value and value[k] != item for k, item in items):
                clashes += 1
                assert r["variant"] in got["left_out"]
                continue
            kept.append(r["variant"])
            for k, item in items:
                if k not in value:
                    value[k] = item
                    want.append(item)
        assert got["variants"] == kept
        assert got["overrides"] == want
        assert got["baseline_tau"] == base
        for r in winners:
            if r["variant"] in kept:
                assert math.isclose(got["gains"][r["variant"]], r["decode_tau"] - base)
    assert clashes > 20  # the random results do contradict each other
    with pytest.raises(ValueError, match="baseline"):
        ablation.stacked_recipe([{"variant": "v0", "overrides": [], "ok": True, "decode_tau": 2.0}])


def test_stacked_recipe_leaves_out_a_winner_that_breaks_the_config(ablation):
    """D-PACE weights and distillation exclude each other: the smaller gain stays out, with the key
    they set apart, a winner the config refuses beside the larger gains stays out with the config's
    reason, and the next winner still stacks."""
    results = [{"variant": "baseline", "overrides": [], "ok": True, "decode_tau": 2.0},
               {"variant": "distill", "overrides": ablation.VARIANTS["distill"][0], "ok": True, "decode_tau": 2.3},
               {"variant": "dpace", "overrides": ablation.VARIANTS["dpace"][0], "ok": True, "decode_tau": 2.2},
               {"variant": "alpha", "overrides": ["drafter.dpace_alpha=0.3"], "ok": True, "decode_tau": 2.15},
               {"variant": "lr", "overrides": ["train.lr=1.2e-3"], "ok": True, "decode_tau": 2.1}]
    check = ablation.config_error(str(ablation.REPO / "configs" / "smollm2-135m-cpu.yaml"), ["log.wandb=disabled"])
    got = ablation.stacked_recipe(results, margin=0.02, check=check)
    assert got["variants"] == ["distill", "lr"]
    assert got["overrides"] == ablation.VARIANTS["distill"][0] + ["train.lr=1.2e-3"]
    assert list(got["left_out"]) == ["dpace", "alpha"] and "drafter.loss_weighting" in got["left_out"]["dpace"]
    # no key of its own clashes, but the config refuses it beside the decay: the config's reason
    assert got["left_out"]["alpha"].startswith("drafter.dpace_alpha: applies only to drafter.loss_weighting: dpace")
    unchecked = ablation.stacked_recipe(results, margin=0.02)  # the two set drafter.loss_weighting apart
    assert unchecked["variants"] == ["distill", "alpha", "lr"]
    assert unchecked["left_out"] == {"dpace": "sets drafter.loss_weighting=dpace, where a larger gain set "
                                              "drafter.loss_weighting=decay"}
    same = [dict(r, overrides=["train.lr=1.2e-3"]) if r["variant"] == "dpace" else r for r in results]
    assert ablation.stacked_recipe(same, margin=0.02)["variants"] == ["distill", "dpace", "alpha", "lr"]  # one value


def test_stacked_recipe_leaves_out_a_gain_within_noise(ablation):
    """Both variants beat the baseline's pooled τ by more than the margin; on the same prompts one
    gains on every response, the other's gain is two prompts' luck: only the first stacks. The table
    shows each paired gain with its standard error and each set's per-response τ with its own."""
    rng = random.Random(5)
    keys = [f"sharegpt/{i}" for i in range(16)]
    base = {k: rng.uniform(1.7, 5.0) for k in keys}
    steady = {k: t + rng.uniform(0.1, 0.2) for k, t in base.items()}
    lucky = dict(base, **{keys[0]: base[keys[0]] + 2.0, keys[1]: base[keys[1]] - 1.0})
    results = [{"variant": "baseline", "overrides": [], "ok": True, "decode_tau": 2.0, "decode_prompt_tau": base},
               {"variant": "lucky", "overrides": ["train.lr=2e-3"], "ok": True, "decode_tau": 2.2,
                "decode_prompt_tau": lucky},
               {"variant": "steady", "overrides": ["drafter.loss_gamma=4"], "ok": True, "decode_tau": 2.1,
                "decode_prompt_tau": steady},
               {"variant": "old", "overrides": ["train.warmup_ratio=0.1"], "ok": True, "decode_tau": 2.05}]
    got = ablation.stacked_recipe(results, margin=0.02)
    assert got["variants"] == ["steady", "old"]  # a result without each response's τ is judged by the margin
    assert list(got["left_out"]) == ["lucky"] and "within 2 standard errors" in got["left_out"]["lucky"]
    diffs = [steady[k] - base[k] for k in keys]
    gain, se, n = got["paired"]["steady"]
    assert n == 16 and gain == pytest.approx(sum(diffs) / 16)
    mean = sum(diffs) / 16
    assert se == pytest.approx(math.sqrt(sum((d - mean) ** 2 for d in diffs) / 15 / 16))
    assert "old" not in got["paired"]

    variants = ablation.select_variants("baseline", ["steady=drafter.loss_gamma=4"])
    for v, r in zip(variants, (results[0], results[2])):
        v.result = dict(r, decode_sets={"sharegpt": {"tau_per_response": 2.5, "tau_per_response_se": 0.25}})
    meta = {"config": "c.yaml", "overrides": [], "steps": 10, "prompts": 16, "max_new_tokens": 96,
            "decode_mode": "eager", "decode_dtype": "bfloat16", "decode_batch": 16}
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[1:-1]]
            for ln in ablation.table(variants, meta).splitlines() if ln.startswith("| ")}
    head = rows["variant"]
    cell = dict(zip(head, rows["steady"]))
    assert cell["Δ τ per response (paired SE)"] == f"{gain:+.3f} ({se:.3f}, 16 prompts)"
    assert dict(zip(head, rows["baseline"]))["Δ τ per response (paired SE)"] == "–"
    assert cell["τ per response (SE) by prompt set"] == "sharegpt 2.500 (0.25)"


def test_prompt_sets_reach_the_decoding_check_and_the_table(ablation, tmp_path, capsys):
    """Each ``--prompt-set`` is handed to decode_bench; each set's per-response τ gets its cell;
    a missing file is refused with exit 2 before anything runs."""
    rng = random.Random(8)
    sets = [{"set": name, "prompts": 16, "identical": i, "ties": 16 - i - 1, "failures": 1,
             "tau": rng.uniform(1.5, 3.5), "tau_per_response": rng.uniform(1.5, 3.5)}
            for i, name in enumerate(["sharegpt", "humaneval", "mt-bench"])]
    prompts = [{"set": x["set"], "index": i, "tau": rng.uniform(1, 5)} for x in sets for i in range(3)]
    prompts[0]["prompt_sha256"] = "0123456789abcdef"  # a report with digests keys by them
    bench = {"runs": [{"summary": {"tau": 2.5, "identical": 3, "ties": 42, "failures": 3, "target_tok_s": 400.0,
                                   "spec_tok_s": 800.0, "sets": sets}, "prompts": prompts}]}
    got = ablation.decode_summary(bench)
    assert got["decode_prompt_tau"] == {p.get("prompt_sha256") or f"{p['set']}/{p['index']}": p["tau"] for p in prompts}
    assert "0123456789abcdef" in got["decode_prompt_tau"]
    for x in sets:
        row = got["decode_sets"][x["set"]]
        assert row["tau_per_response"] == x["tau_per_response"] and row["tau"] == x["tau"]
        assert math.isnan(row["tau_per_response_se"])  # a summary from before the standard error
        assert row["check"] == f"{x['identical']}/{x['ties']}/{x['failures']}"
    (v,) = ablation.select_variants("baseline", [])
    v.result = {"ok": True, **got}
    meta = {"config": "c.yaml", "overrides": [], "steps": 10, "prompts": 16, "max_new_tokens": 96,
            "decode_mode": "eager", "decode_dtype": "bfloat16", "decode_batch": 16}
    row = [ln for ln in ablation.table([v], meta).splitlines() if ln.startswith("| baseline")][0]
    assert row.split("|")[-2].strip() == " · ".join(f"{x['set']} {x['tau_per_response']:.3f} (–)" for x in sets)

    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    args = ablation.parse_args(["--gpus", "cpu", "--prompt-set", "sharegpt", "--prompt-set", str(prompts)])
    assert [ps.name for ps in args.prompt_sets] == ["sharegpt", str(prompts)]
    assert ablation.setup(args, v)["prompt_sets"] == ["sharegpt", str(prompts)]
    with pytest.raises(SystemExit) as exc:
        ablation.parse_args(["--gpus", "cpu", "--prompt-set", str(tmp_path / "none.jsonl")])
    assert exc.value.code == 2 and "none.jsonl" in capsys.readouterr().err


def test_the_default_base_config_follows_the_device(ablation):
    """`--gpus cpu` without `--config` takes the CPU default, GPUs the GPU recipe; a given one wins."""
    assert ablation.parse_args(["--gpus", "cpu"]).config == "configs/smollm2-135m-cpu.yaml"
    assert ablation.parse_args(["--gpus", "cpu", "--config", "x.yaml"]).config == "x.yaml"
