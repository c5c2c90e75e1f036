"""Compare two drafters decoded on the same prompts: τ per response of each, and the paired gain.

Reads two ``decode_bench.json`` files (``scripts/decode_bench.py --out``; the ``--out`` folder itself
is accepted too) and pairs their responses prompt by prompt, per prompt set and pooled: each
response's τ (its mean acceptance length, the reference benchmark's per-response τ) in the base run
is subtracted from the same prompt's in the other. The mean of those differences and its standard
error (:func:`dflash.inference.tau_stats.paired_gain`) say whether a recipe change helped; each
mean's own standard error does not, because hard prompts are hard for both drafters
(``docs/benchmarks.md``, How well 16 prompts measure τ). Prompts are matched by their token digest
(``prompt_sha256``; ``set/index`` in files without it) within a set, so two runs whose held-out
splits differ pair only the prompts they share. No model is loaded.

Example::

    python -m scripts.tau_compare results/decode-base results/decode-gamma4
    python -m scripts.tau_compare base/decode_bench.json other/decode_bench.json --dtype bfloat16 --json cmp.json

Exit status: 0 after printing the table, 2 on bad input (a missing or unreadable file, a file
without per-prompt τ, no run of the asked dtype or mode, no prompt in common).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

from dflash.inference.tau_stats import GAIN_SE, paired_gain, standard_error

POOLED = "pooled"


class CompareError(ValueError):
    """Bad input to the comparison; the message names the file and what is wrong with it."""


def load_bench(path: str) -> dict[str, Any]:
    """The parsed ``decode_bench.json`` at ``path`` (a file, or a folder holding one).

    Raises:
        CompareError: no such file, unreadable or not JSON, or not a decode_bench report (no ``runs``).
    """
    p = Path(path)
    if p.is_dir():
        p = p / "decode_bench.json"
    if not p.is_file():
        raise CompareError(f"{path}: no such file (a decode_bench.json, or the --out folder of scripts.decode_bench)")
    try:
        bench = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CompareError(f"{p}: not a readable JSON file ({exc})") from None
    if not isinstance(bench, dict) or not isinstance(bench.get("runs"), list) or not bench["runs"]:
        raise CompareError(f"{p}: not a decode_bench report (no runs in it)")
    for i, run in enumerate(bench["runs"]):
        if not isinstance(run, dict) or not isinstance(run.get("summary", {}), dict) \
                or not isinstance(run.get("prompts", []), list):
            raise CompareError(f"{p}: run {i} is not a decode_bench run (an object with a summary and prompts)")
    return bench


def pick_run(bench: dict[str, Any], name: str, dtype: Optional[str] = None,
             mode: Optional[str] = None) -> dict[str, Any]:
    """The run of ``bench`` with ``dtype`` (``bfloat16``/``float32``) and ``mode``
    (``eager``/``compiled``), the first such; unset keys match any run, except that without
    ``dtype`` a bfloat16 run is preferred (the speed figure users compare).

    Raises:
        CompareError: no run matches (the message lists the runs there are).
    """
    def matches(run: dict[str, Any]) -> bool:
        s = run.get("summary", {})
        return ((dtype is None or s.get("dtype") == dtype)
                and (mode is None or ("compiled" if s.get("compiled") else "eager") == mode))

    runs = [r for r in bench["runs"] if matches(r)]
    if not runs:
        summaries = [r.get("summary", {}) for r in bench["runs"]]
        have = ", ".join(f"{s.get('dtype')}/{'compiled' if s.get('compiled') else 'eager'}" for s in summaries)
        raise CompareError(f"{name}: no run with dtype={dtype or 'any'} mode={mode or 'any'} (runs: {have})")
    if dtype is None:
        runs = [r for r in runs if r.get("summary", {}).get("dtype") == "bfloat16"] or runs
    return runs[0]


def run_label(run: dict[str, Any]) -> str:
    """``bfloat16, compiled``: the dtype and mode of a decode_bench run."""
    s = run.get("summary", {})
    return f"{s.get('dtype', '?')}, {'compiled' if s.get('compiled') else 'eager'}"


def prompt_tau(run: dict[str, Any], name: str) -> dict[tuple[str, str, int], float]:
    """Each response's τ of ``run``, keyed by ``(prompt set, prompt digest, occurrence)``: the digest
    is ``prompt_sha256`` (``#index`` in a row without one, ``@position`` without either), and the
    occurrence tells apart a prompt a set holds twice. A response without τ (``null``) is NaN.

    Raises:
        CompareError: a τ that is not a finite number or null; the run holds no τ at all.
    """
    out: dict[tuple[str, str, int], float] = {}
    for position, row in enumerate(run.get("prompts") or []):
        if not isinstance(row, dict) or "tau" not in row:
            continue
        digest = row.get("prompt_sha256") or (f"#{row['index']}" if row.get("index") is not None else f"@{position}")
        tau = row["tau"]
        if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau)):
            raise CompareError(f"{name}: prompt {position} ({row.get('set', '')} {digest}) has τ {tau!r}, "
                               "not a finite number")
        occurrence = 0
        while (str(row.get("set", "")), str(digest), occurrence) in out:
            occurrence += 1
        out[(str(row.get("set", "")), str(digest), occurrence)] = float("nan") if tau is None else float(tau)
    if not any(not math.isnan(v) for v in out.values()):
        raise CompareError(f"{name}: the run holds no per-prompt τ (decode_bench.json from an older version?)")
    return out


def compare(base: dict[tuple[str, str, int], float], other: dict[tuple[str, str, int], float]
            ) -> list[dict[str, Any]]:
    """One row per prompt set both runs decoded (in the base run's order), then a pooled row over
    every paired prompt: ``set``, ``paired`` (prompts in common), ``base`` and ``other`` (τ per
    response over the paired prompts), ``base_se`` and ``other_se`` (their standard errors),
    ``gain`` and ``gain_se`` (:func:`dflash.inference.tau_stats.paired_gain`) and ``verdict``
    (``gain``, ``loss`` or ``within noise`` at :data:`GAIN_SE` standard errors).

    Raises:
        CompareError: no prompt in common.
    """
    sets = list(dict.fromkeys(k[0] for k in base))
    rows = []
    for name in sets + [POOLED]:
        b = {k: v for k, v in base.items() if name == POOLED or k[0] == name}
        o = {k: v for k, v in other.items() if name == POOLED or k[0] == name}
        gain, se, n = paired_gain(b, o)
        if n == 0:
            continue
        common = [k for k in b if k in o and not math.isnan(b[k]) and not math.isnan(o[k])]
        bv, ov = [b[k] for k in common], [o[k] for k in common]
        verdict = "within noise"
        if not math.isnan(se) and abs(gain) > GAIN_SE * se:
            verdict = "gain" if gain > 0 else "loss"
        rows.append({"set": name, "paired": n, "base": sum(bv) / n, "base_se": standard_error(bv),
                     "other": sum(ov) / n, "other_se": standard_error(ov), "gain": gain, "gain_se": se,
                     "verdict": verdict})
    if not rows:
        raise CompareError("the two runs have no prompt in common (other prompt sets, or other held-out splits?)")
    return rows


def table(rows: list[dict[str, Any]], base_name: str, other_name: str) -> str:
    """``rows`` of :func:`compare` as a markdown table."""
    def f(x: float) -> str:
        return "–" if math.isnan(x) else f"{x:.3f}"

    lines = [f"base: {base_name}", f"other: {other_name}", "",
             "| prompt set | prompts paired | τ per response, base (SE) | τ per response, other (SE) "
             "| Δ τ per response (paired SE) | verdict |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['set']} | {r['paired']} | {f(r['base'])} ({f(r['base_se'])}) | {f(r['other'])} "
                     f"({f(r['other_se'])}) | {r['gain']:+.3f} ({f(r['gain_se'])}) | {r['verdict']} |")
    lines.append("")
    lines.append(f"verdict: a gain or a loss beyond {GAIN_SE:g} paired standard errors, else within noise")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="the base run's decode_bench.json (or its folder)")
    p.add_argument("other", help="the other run's decode_bench.json (or its folder)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="the run of each file to compare (unset: a bfloat16 one where there is one)")
    p.add_argument("--mode", choices=("eager", "compiled"), default=None, help="the run's mode (unset: any)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON to FILE")
    args = p.parse_args(argv)
    try:
        if args.json and (Path(args.json).is_dir() or not Path(args.json).resolve().parent.is_dir()):
            raise CompareError(f"--json {args.json}: not a file in an existing folder")
        taus, kinds = [], []
        for name in (args.base, args.other):
            run = pick_run(load_bench(name), name, args.dtype, args.mode)
            taus.append(prompt_tau(run, name))
            kinds.append(run_label(run))
        rows = compare(*taus)
    except CompareError as exc:
        print(f"tau_compare: {exc}", file=sys.stderr)
        return 2
    labels = [f"{name} ({kind})" for name, kind in zip((args.base, args.other), kinds)]
    print(table(rows, *labels))
    if kinds[0] != kinds[1]:
        print("note: the two runs differ in dtype or mode (--dtype, --mode pick the runs)")
    if args.json:
        clean = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows]
        try:
            Path(args.json).write_text(json.dumps({"base": labels[0], "other": labels[1], "rows": clean}, indent=1)
                                       + "\n", encoding="utf-8")
        except OSError as exc:
            print(f"tau_compare: --json {args.json}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
