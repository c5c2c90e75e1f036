"""scripts.tau_compare: per-set and pooled paired gains of two decode_bench reports, against a
naive loop over the prompts; bad inputs refused with exit 2."""

from __future__ import annotations

import json
import math
import random

import pytest

from scripts import tau_compare


def _bench(rows, dtype="bfloat16", compiled=True, extra_runs=()):
    run = {"summary": {"dtype": dtype, "compiled": compiled}, "prompts": rows}
    return {"meta": {}, "runs": [*extra_runs, run]}


def _rows(rng, sets, digests, shift=0.0):
    out = []
    for s in sets:
        for i, d in enumerate(digests[s]):
            out.append({"set": s, "index": i, "prompt_sha256": d, "tau": 1.0 + 4.0 * rng.random() + shift})
    return out


def _naive(base_rows, other_rows, want_set):
    """Mean and sample-SD/√n of other − base over the prompts both have, by a plain loop."""
    diffs = []
    for b in base_rows:
        if want_set is not None and b["set"] != want_set:
            continue
        for o in other_rows:
            if o["set"] == b["set"] and o["prompt_sha256"] == b["prompt_sha256"]:
                diffs.append(o["tau"] - b["tau"])
    n = len(diffs)
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1)
    return mean, math.sqrt(var / n), n


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gains_match_a_naive_loop(tmp_path, seed, capsys):
    rng = random.Random(seed)
    sets = ["sharegpt", "humaneval", "mt-bench"]
    digests = {s: [f"{s[:2]}{rng.getrandbits(48):012x}" for _ in range(rng.randint(5, 12))] for s in sets}
    base_rows = _rows(rng, sets, digests)
    # the other run shares all but two of each set's prompts, in another order, plus one of its own
    other_rows = []
    for s in sets:
        keep = digests[s][2:] + [f"zz{rng.getrandbits(48):012x}"]
        rng.shuffle(keep)
        other_rows += [{"set": s, "index": i, "prompt_sha256": d, "tau": 1.0 + 4.0 * rng.random()}
                       for i, d in enumerate(keep)]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "decode_bench.json").write_text(json.dumps(_bench(base_rows)))
    (tmp_path / "b.json").write_text(json.dumps(_bench(other_rows)))
    out_json = tmp_path / "cmp.json"
    assert tau_compare.main([str(tmp_path / "a"), str(tmp_path / "b.json"), "--json", str(out_json)]) == 0
    rows = {r["set"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert list(rows) == sets + ["pooled"]
    for s in sets + [None]:
        mean, se, n = _naive(base_rows, other_rows, s)
        r = rows[s or "pooled"]
        assert r["paired"] == n
        assert r["gain"] == pytest.approx(mean, abs=1e-12) and r["gain_se"] == pytest.approx(se, abs=1e-12)
        common = [b for b in base_rows if (s is None or b["set"] == s)
                  and any(o["set"] == b["set"] and o["prompt_sha256"] == b["prompt_sha256"] for o in other_rows)]
        assert r["base"] == pytest.approx(sum(b["tau"] for b in common) / n, abs=1e-12)
        want = "within noise" if abs(mean) <= 2 * se else ("gain" if mean > 0 else "loss")
        assert r["verdict"] == want
    printed = capsys.readouterr().out
    assert "| pooled |" in printed and "Δ τ per response (paired SE)" in printed


def test_a_clear_gain_and_the_bf16_run_preferred(tmp_path):
    rng = random.Random(5)
    digests = {"sharegpt": [f"{i:016x}" for i in range(20)]}
    base_rows = _rows(rng, ["sharegpt"], digests)
    other_rows = [dict(r, tau=r["tau"] + 0.3 + 0.01 * rng.random()) for r in base_rows]
    fp32_run = {"summary": {"dtype": "float32", "compiled": False},
                "prompts": [dict(r, tau=r["tau"] - 1.0) for r in other_rows]}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_bench(base_rows)))
    b.write_text(json.dumps(_bench(other_rows, extra_runs=[fp32_run])))
    rows = tau_compare.compare(*(tau_compare.prompt_tau(tau_compare.pick_run(tau_compare.load_bench(str(p)), str(p)),
                                                        str(p)) for p in (a, b)))
    assert rows[-1]["verdict"] == "gain" and rows[-1]["gain"] == pytest.approx(0.305, abs=0.006)
    # asking for the fp32 run of b compares against it: a loss
    fp = tau_compare.pick_run(tau_compare.load_bench(str(b)), str(b), dtype="float32")
    rows = tau_compare.compare(tau_compare.prompt_tau(tau_compare.pick_run(tau_compare.load_bench(str(a)), "a"), "a"),
                               tau_compare.prompt_tau(fp, "b"))
    assert rows[-1]["verdict"] == "loss"


def test_rows_without_a_digest_pair_by_index(tmp_path):
    base_rows = [{"set": "mt-bench", "index": i, "tau": 2.0 + i} for i in range(4)]
    other_rows = [{"set": "mt-bench", "index": i, "tau": 2.5 + i + (0.1 if i % 2 else 0.0)} for i in range(4)]
    rows = tau_compare.compare(tau_compare.prompt_tau({"prompts": base_rows}, "a"),
                               tau_compare.prompt_tau({"prompts": other_rows}, "b"))
    assert rows[0]["paired"] == 4 and rows[0]["gain"] == pytest.approx(0.55)


def test_bad_inputs_exit_2(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_bench([{"set": "sharegpt", "index": 0, "prompt_sha256": "aa", "tau": 2.0},
                                       {"set": "sharegpt", "index": 1, "prompt_sha256": "bb", "tau": 3.0}])))
    cases = {
        "missing": (str(tmp_path / "nope.json"), "no such file"),
        "not json": ("notjson", "not a readable JSON file"),
        "no runs": ("noruns", "not a decode_bench report"),
        "no per-prompt tau": ("noprompts", "no per-prompt τ"),
        "no common prompt": ("other", "no prompt in common"),
        "no fp32 run": (str(good), "no run with dtype=float32"),
        "runs not objects": ("intruns", "run 0 is not a decode_bench run"),
        "summary not an object": ("strsummary", "run 0 is not a decode_bench run"),
        "tau a string": ("strtau", "has τ 'abc', not a finite number"),
        "tau infinite": ("inftau", "has τ inf, not a finite number"),
        "tau a bool": ("booltau", "has τ True, not a finite number"),
        "every tau null": ("nulltau", "holds no per-prompt τ"),
    }
    (tmp_path / "intruns").write_text(json.dumps({"runs": [1, 2]}))
    (tmp_path / "strsummary").write_text(json.dumps({"runs": [{"summary": "x", "prompts": []}]}))
    one = lambda tau: json.dumps(_bench([{"set": "sharegpt", "index": 0, "prompt_sha256": "aa", "tau": tau}]))  # noqa: E731
    (tmp_path / "strtau").write_text(one("abc"))
    (tmp_path / "inftau").write_text(one(float("inf")))
    (tmp_path / "booltau").write_text(one(True))
    (tmp_path / "nulltau").write_text(one(None))
    (tmp_path / "notjson").write_text("{ cut")
    (tmp_path / "noruns").write_text(json.dumps({"meta": {}}))
    (tmp_path / "noprompts").write_text(json.dumps(_bench([])))
    (tmp_path / "other").write_text(json.dumps(_bench([{"set": "sharegpt", "index": 0, "prompt_sha256": "cc",
                                                        "tau": 2.0}])))
    for what, (name, message) in cases.items():
        path = name if name.startswith("/") else str(tmp_path / name)
        extra = ["--dtype", "float32"] if what == "no fp32 run" else []
        assert tau_compare.main([str(good), path, *extra]) == 2, what
        err = capsys.readouterr().err
        assert message in err, (what, err)

    # --json into a folder, or a missing one: refused before anything is printed
    for target in (str(tmp_path), str(tmp_path / "no" / "x.json")):
        assert tau_compare.main([str(good), str(good), "--json", target]) == 2
        captured = capsys.readouterr()
        assert "not a file in an existing folder" in captured.err and captured.out == ""


def test_repeated_prompts_pair_in_order_and_nan_is_null_in_json(tmp_path, capsys):
    """A prompt a set holds twice pairs occurrence by occurrence; a standard error of one paired
    prompt is NaN, written as null; runs of other dtypes are named and noted."""
    base = [{"set": "s", "index": 0, "prompt_sha256": "aa", "tau": 2.0},
            {"set": "s", "index": 1, "prompt_sha256": "aa", "tau": 3.0},
            {"set": "t", "index": 0, "prompt_sha256": "bb", "tau": 1.5}]
    other = [dict(r, tau=r["tau"] + d) for r, d in zip(base, (0.5, 1.5, 0.25))]
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "cmp.json"
    a.write_text(json.dumps(_bench(base)))
    b.write_text(json.dumps(_bench(other, dtype="float32", compiled=False)))
    assert tau_compare.main([str(a), str(b), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "(bfloat16, compiled)" in printed and "(float32, eager)" in printed and "differ in dtype or mode" in printed
    rows = {r["set"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["s"]["paired"] == 2 and rows["s"]["gain"] == pytest.approx(1.0)
    assert rows["t"]["paired"] == 1 and rows["t"]["gain_se"] is None and rows["t"]["base_se"] is None
    assert rows["pooled"]["gain"] == pytest.approx((0.5 + 1.5 + 0.25) / 3)
