"""Recipe ablation: train one drafter per variant of a base config, same data and steps, then
measure each one's held-out τ (training's evaluation) and decoding τ (the speculative check).

Each variant is the base config plus a few overrides (``VARIANTS``; ``--variant name=k=v,k=v`` adds
one). On CUDA every variant runs with the target and the drafter on one GPU
(``cluster.allow_shared_gpu``), ``--per-gpu`` variants per GPU of ``--gpus`` at a time; on CPU
(``--gpus cpu``) one after the other with the config's own placement. After training, the
variant's newest checkpoint decodes ``--prompts`` held-out prompts (``scripts/decode_bench.py``,
bf16 on GPUs, ``--decode-mode`` eager by default: the ablation compares τ, not speed, and eager skips the
compile warm-up; ``--decode-batch`` prompts at a time, each row accepting its own drafts; one run,
as greedy decoding's τ does not change from run to run).

Results: ``<out>/<variant>/result.json`` per variant and, after every variant, ``<out>/ablation.md``
(one table row per variant), ``<out>/ablation.json`` and ``<out>/recipe.json`` (the overrides of
every variant that beat the baseline's decoding τ beyond noise, stacked: :func:`stacked_recipe`). A variant whose ``result.json`` exists is
not run again (if it was made with the same settings, else the script refuses to start); an
interrupted one resumes from its newest checkpoint (``--resume``). Every
variant's config is loaded and checked before anything runs, so a bad override fails at once.

Example (two GPUs, the SmolLM2 GGUF at ``models/smollm2.gguf`` and regenerated data already at
``runs/regen/turn1.jsonl``)::

    python -m scripts.ablation --gpus 0,1 --steps 1000 --out runs/ablation \\
        target.path=models/smollm2.gguf regenerate.enabled=false data.dataset=runs/regen/turn1.jsonl

Exit status: 0 when every variant trained and decoded, 1 when one failed (the others still run),
2 on bad arguments or a config error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from dflash.inference.prompt_sets import add_prompt_set_argument, check_prompt_sets
from dflash.inference.tau_stats import GAIN_SE, paired_gain

REPO = Path(__file__).resolve().parent.parent

#: The built-in variants: name -> (overrides, what changes). ``baseline`` is the base config as is.
VARIANTS: dict[str, tuple[list[str], str]] = {
    "baseline": ([], "the base config"),
    "anchors-conversation": (["drafter.anchor_sampling=conversation", "drafter.anchors_per_conversation=512"],
                             "anchors drawn per conversation (≤ 512 each), not uniformly over the packed row"),
    "gamma-2": (["drafter.loss_weighting=decay", "drafter.loss_gamma=2"], "loss position decay γ 2"),
    "gamma-3": (["drafter.loss_weighting=decay", "drafter.loss_gamma=3"], "loss position decay γ 3"),
    "gamma-4": (["drafter.loss_weighting=decay", "drafter.loss_gamma=4"], "loss position decay γ 4"),
    "gamma-10": (["drafter.loss_weighting=decay", "drafter.loss_gamma=10"], "loss position decay γ 10"),
    "lr-3e-4": (["train.lr=3e-4"], "learning rate 3e-4"),
    "lr-6e-4": (["train.lr=6e-4"], "learning rate 6e-4 (the DFlash recipe's)"),
    "lr-1.2e-3": (["train.lr=1.2e-3"], "learning rate 1.2e-3"),
    "lr-2.4e-3": (["train.lr=2.4e-3"], "learning rate 2.4e-3"),
    "warmup-0.1": (["train.warmup_ratio=0.1"], "warm-up 10 % of the steps"),
    "layers-3": (["drafter.num_layers=3"], "3 drafter layers"),
    "layers-8": (["drafter.num_layers=8"], "8 drafter layers"),
    "mlp-target": (["drafter.intermediate_size=null"], "the drafter's MLP at the target's width"),
    "mlp-3072": (["drafter.intermediate_size=3072"], "the drafter's MLP at 3,072 channels (twice SmolLM2's)"),
    "block-8": (["drafter.block_size=8"], "block size 8 (γ 4 by default)"),
    "labels-data": (["drafter.labels=data", "drafter.label_chain=false"],
                    "labels from the dataset's tokens, not the target's greedy ones"),
    "label-chain": (["drafter.label_chain=true"], "a block's labels cut where the text leaves the target's greedy path"),
    "raw-extra": (["data.extra_datasets=[sharegpt]", "drafter.label_chain=true"],
                  "raw ShareGPT beside the data, training only, labels cut off the target's greedy path"),
    "no-extra": (["data.extra_datasets=[]", "data.extra_token_ratio=null", "regenerate.sampled.output=null"],
                 "no rows beside the data (the regeneration config's raw ShareGPT and sampled rows left out)"),
    "no-sampled": (["regenerate.sampled.output=null"], "no sampled regeneration pass beside the greedy one"),
    "sampled-first": (["regenerate.sampled.max_turns=1"], "the sampled pass samples first responses only"),
    "extra-all": (["data.extra_token_ratio=null"], "every row of data.extra_datasets, not a sample"),
    "extra-1": (["data.extra_token_ratio=1.0"], "a sample of data.extra_datasets as large in tokens as the data"),
    "extra-2": (["data.extra_token_ratio=2.0"], "a sample of data.extra_datasets twice the data's tokens"),
    "weight-decay-0.1": (["train.weight_decay=0.1"], "AdamW weight decay 0.1"),
    "anchors-512": (["drafter.anchors_per_row=512"], "512 anchors a packed row"),
    "dpace": (["drafter.loss_weighting=dpace", "drafter.loss_gamma=null"], "D-PACE position weights (α 0.5)"),
    "distill": (["drafter.distillation=1.0", "drafter.loss_weighting=decay"],
                "forward KL to the target's whole distribution, no hard labels (with the fixed position decay)"),
    "distill-0.5": (["drafter.distillation=0.5", "drafter.loss_weighting=decay"],
                    "half cross entropy, half forward KL to the target's distribution (with the fixed position decay)"),
}

#: What a variant's name may be (it names its folders).
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
#: Seconds between two echoes of a variant's training progress line on the console.
ECHO_S = 60.0
#: Seconds a stopped variant's training or decoding gets to end after SIGTERM, before SIGKILL.
STOP_GRACE_S = 120.0

#: ``metrics.jsonl`` keys of the last held-out evaluation that go into the table.
EVAL_KEYS = ("eval/loss", "eval/tau", "eval/tau_head", "eval/tau_walk", "eval/tau_walk_head", "eval/tau_walk_first")


@dataclass
class Variant:
    """One line of the ablation: ``overrides`` on top of the base config's (and the command line's)."""

    name: str
    overrides: list[str]
    about: str = ""
    result: Optional[dict[str, Any]] = field(default=None, repr=False)


def parse_variant(text: str) -> Variant:
    """``name=section.key=value,section.key=value`` -> :class:`Variant`.

    Raises:
        ValueError: no ``=`` after the name, a name that is not a folder name (:data:`NAME`), no
            override, or an override without ``=``.
    """
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ValueError(f"--variant {text!r}: expected name=section.key=value[,section.key=value ...]")
    if not NAME.fullmatch(name):
        raise ValueError(f"--variant {name!r}: a variant name is a folder name: letters, digits, '.', '_', '-', "
                         "not starting with '.'")
    overrides = [o.strip() for o in rest.split(",") if o.strip()]
    if not overrides:
        raise ValueError(f"--variant {name}: no overrides (that is the baseline)")
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ValueError(f"--variant {name}: overrides must be section.key=value, got {bad}")
    return Variant(name, overrides, "custom: " + " ".join(overrides))


def select_variants(names: Optional[str], custom: list[str]) -> list[Variant]:
    """The built-in variants named in ``names`` (comma-separated; ``None`` = all) and the custom ones.

    Raises:
        ValueError: an unknown or repeated name, or a malformed custom variant.
    """
    picked = list(VARIANTS) if names is None else [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in picked if n not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; built-in variants are {list(VARIANTS)}")
    variants = [Variant(n, list(VARIANTS[n][0]), VARIANTS[n][1]) for n in picked] + [parse_variant(c) for c in custom]
    seen: set[str] = set()
    for v in variants:
        if v.name in seen:
            raise ValueError(f"variant {v.name!r} given twice")
        seen.add(v.name)
    return variants


def train_summary(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """The table's training columns from ``metrics.jsonl`` rows (:func:`dflash.metrics.metrics_view`):
    the last step, the last held-out evaluation (``EVAL_KEYS``, ``NaN`` where it never ran), and the
    median ``time/step_s`` (s a step; the first 10 % of steps, warm-up and compilation, left out)."""
    steps = [r for r in metrics if "step" in r]
    last_eval = next((r for r in reversed(steps) if "eval/tau" in r), {})
    times = [(r["step"], r["time/step_s"]) for r in steps if isinstance(r.get("time/step_s"), (int, float))]
    last = max((s for s, _ in times), default=0)
    warm = [t for s, t in times if s > 0.1 * last] or [t for _, t in times]
    out: dict[str, Any] = {"steps": max((r["step"] for r in steps), default=0),
                           "step_s": statistics.median(warm) if warm else math.nan,
                           "eval_step": last_eval.get("step")}
    for k in EVAL_KEYS:
        out[k] = float(last_eval.get(k, math.nan))
    return out


def decode_summary(bench: dict[str, Any]) -> dict[str, Any]:
    """The table's decoding columns from ``decode_bench.json``'s first run: measured τ (pooled over
    the prompt sets), the walked offline τ on the target's own text, the outputs' check, tokens/s
    both ways, per prompt set (``decode_sets``) its pooled and per-response τ, the latter's standard
    error and its check, and each response's τ (``decode_prompt_tau``, keyed by the prompt's digest
    (:func:`dflash.inference.spec_report.prompt_digest`; ``set/index`` in a report without one): what
    :func:`stacked_recipe` pairs prompt by prompt, so variants whose held-out splits differ pair only
    the prompts they share)."""
    if not bench.get("runs"):
        return {}
    run = bench["runs"][0]
    s = run["summary"]
    return {"decode_tau": s["tau"], "decode_walk": s.get("offline_tau_own_walk", math.nan),
            "decode_check": f"{s['identical']}/{s['ties']}/{s['failures']}",
            "target_tok_s": s["target_tok_s"], "spec_tok_s": s["spec_tok_s"],
            "decode_sets": {x["set"]: {"tau": x["tau"], "tau_per_response": x["tau_per_response"],
                                       "tau_per_response_se": x.get("tau_per_response_se", math.nan),
                                       "check": f"{x['identical']}/{x['ties']}/{x['failures']}"}
                            for x in s.get("sets", [])},
            "decode_prompt_tau": {p.get("prompt_sha256") or f"{p['set']}/{p['index']}": p["tau"]
                                  for p in run.get("prompts", [])}}


#: Decoding-τ gain over ``baseline`` a variant needs to enter the stacked recipe, at least.
GAIN_MARGIN = 0.02
#: ... and its per-response gain, paired prompt by prompt, must exceed
#: :data:`dflash.inference.tau_stats.GAIN_SE` of its standard errors (where both carry each response's τ).


def stacked_recipe(results: list[dict[str, Any]], margin: float = GAIN_MARGIN,
                   check: Optional[Callable[[list[str]], Optional[str]]] = None,
                   n_se: float = GAIN_SE) -> dict[str, Any]:
    """The recipe the ablation suggests: the overrides of every decoded variant whose decoding τ
    exceeds the baseline's by more than ``margin``, the largest gain first; a winner that sets a
    config key to another value than a larger gain already did is left out (its change cannot be
    had beside that one), with the key named. Each gain was measured alone: whether they add up is
    for a training run of the stacked recipe to show.

    A winner whose result and the baseline's both carry each response's τ (``decode_prompt_tau``)
    must also gain per response, over the prompts both decoded, by more than ``n_se`` standard
    errors of the paired differences; otherwise it is left out as within noise.

    Args:
        results: ``result.json`` contents (``variant``, ``overrides``, ``ok``, ``decode_tau``;
            optionally ``decode_prompt_tau``).
        margin: τ gain needed (tokens a verification pass).
        n_se: the paired per-response gain needed, in its standard errors.
        check: the error of a stacked override list, ``None`` when it makes a valid config
            (:func:`config_error`); a winner whose overrides would make the stack invalid (two options
            that exclude each other, e.g. D-PACE weights and distillation) is left out, with the
            reason, and the larger gains keep their place.

    Returns:
        ``{"baseline_tau", "margin", "variants": [names, largest gain first], "gains": {name: gain},
        "paired": {name: [per-response gain, its standard error, prompts]} (every variant paired
        with the baseline), "overrides": [key=value, ...], "left_out": {name: reason}}``.

    Raises:
        ValueError: no decoded ``baseline`` among ``results``.
    """
    ok = [r for r in results if r.get("ok") and "decode_tau" in r]
    base = next((r for r in ok if r["variant"] == "baseline"), None)
    if base is None:
        raise ValueError("no decoded baseline variant: the recipe is measured against it")
    gains = {r["variant"]: r["decode_tau"] - base["decode_tau"] for r in ok if r["variant"] != "baseline"}
    better = sorted((n for n, g in gains.items() if g > margin), key=lambda n: -gains[n])
    by_name = {r["variant"]: r for r in ok}
    paired = {r["variant"]: list(paired_gain(base["decode_prompt_tau"], r["decode_prompt_tau"]))
              for r in ok if r["variant"] != "baseline" and "decode_prompt_tau" in r and "decode_prompt_tau" in base}
    overrides: dict[str, str] = {}
    kept: list[str] = []
    left_out: dict[str, str] = {}
    for name in better:
        if name in paired:
            gain, se, n = paired[name]
            if not gain > n_se * se:  # NaN (one common prompt, none) is not a gain either
                left_out[name] = (f"per-response τ gain {gain:+.3f} ± {se:.3f} (paired standard error over {n} "
                                  f"prompts) is within {n_se:g} standard errors")
                continue
        stacked = dict(overrides)
        clash = None
        for item in by_name[name]["overrides"]:
            key = item.split("=", 1)[0]
            if stacked.get(key, item) != item:
                clash = f"sets {item}, where a larger gain set {stacked[key]}"
                break
            stacked[key] = item
        error = clash or (check(list(stacked.values())) if check is not None else None)
        if error is not None:
            left_out[name] = error
            continue
        overrides = stacked
        kept.append(name)
    return {"baseline_tau": base["decode_tau"], "margin": margin, "variants": kept,
            "gains": {n: gains[n] for n in kept}, "paired": paired, "overrides": list(overrides.values()),
            "left_out": left_out}


def table(variants: list[Variant], meta: dict[str, Any]) -> str:
    """Markdown: one row per variant with a result, decoding τ also as the difference from
    ``baseline`` where that ran."""
    def f(x: Any, d: int = 3) -> str:
        return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{d}f}"

    base = next((v.result for v in variants if v.name == "baseline" and v.result), None)
    lines = [f"Ablation: `{meta['config']}` {' '.join(meta['overrides'])}; {meta['steps']} steps each; decoding: "
             f"{meta['prompts']} held-out prompts × {meta['max_new_tokens']} new tokens, {meta['decode_dtype']}, {meta['decode_mode']}, "
             f"batch {meta['decode_batch']}. " + ("On CPU, one variant at a time." if meta.get("gpus") == "cpu" else
                                                   f"GPUs {meta.get('gpus', '–')}, {meta.get('per_gpu', 1)} "
                                                   "variant(s) a GPU at a time (s/step compares variants run alike)."),
             "",
             "| variant | change | s/step | train wall s | eval/tau | eval/tau_head | eval/tau_walk_head | "
             "eval/tau_walk_first | decoding τ | Δ vs baseline | Δ τ per response (paired SE) | walked τ (own text) | "
             "same/tie/FAIL | τ per response (SE) by prompt set |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in variants:
        r = v.result
        if not r:
            continue
        delta = paired = "–"
        if base and v.name != "baseline" and "decode_tau" in r and "decode_tau" in base:
            delta = f"{r['decode_tau'] - base['decode_tau']:+.3f}"
        if base and v.name != "baseline" and "decode_prompt_tau" in r and "decode_prompt_tau" in base:
            gain, se, n = paired_gain(base["decode_prompt_tau"], r["decode_prompt_tau"])
            if n:
                paired = f"{gain:+.3f} ({f(se)}, {n} prompts)"
        status = "" if r.get("ok") else f" ({r.get('error', 'failed')})"
        by_set = " · ".join(f"{name} {f(x.get('tau_per_response'))} ({f(x.get('tau_per_response_se'), 2)})"
                            for name, x in r.get("decode_sets", {}).items()) or "–"
        lines.append(
            f"| {v.name}{status} | {v.about} | {f(r.get('step_s'))} | {f(r.get('train_s'), 0)} | "
            f"{f(r.get('eval/tau'))} | {f(r.get('eval/tau_head'))} | {f(r.get('eval/tau_walk_head'))} | "
            f"{f(r.get('eval/tau_walk_first'))} | {f(r.get('decode_tau'))} | {delta} | {paired} | {f(r.get('decode_walk'))} | {r.get('decode_check', '–')} | "
            f"{by_set} |")
    return "\n".join(lines) + "\n"


def check_configs(config: str, common: list[str], variants: list[Variant], shared_gpu: bool) -> None:
    """Load and check every variant's config (no model loads).

    Raises:
        ValueError: the variant's name and the config error.
    """
    error = config_error(config, common + (placement() if shared_gpu else []))
    for v in variants:
        message = error(v.overrides)
        if message is not None:
            raise ValueError(f"variant {v.name}: {message}")


def config_error(config: str, common: list[str]) -> Callable[[list[str]], Optional[str]]:
    """A :func:`stacked_recipe` check: the config error of ``config`` with ``common`` and the given
    overrides, ``None`` when it loads."""
    from dflash.config import ConfigError, load_config

    def error(overrides: list[str]) -> Optional[str]:
        try:
            load_config(config, common + overrides)
        except (ConfigError, OSError) as e:
            return str(e)
        return None

    return error


def placement() -> list[str]:
    """Overrides that put the target and the drafter on the one visible GPU."""
    return ["cluster.device=cuda", "cluster.targets=[0]", "cluster.drafters=[0]", "cluster.allow_shared_gpu=true"]


def setup(args: argparse.Namespace, v: Variant) -> dict[str, Any]:
    """What a variant's result depends on: a kept result must have been made with the same."""
    return {"config": args.config, "overrides": args.overrides + v.overrides, "steps": args.steps,
            "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "decode_mode": args.decode_mode,
            "decode_dtype": args.decode_dtype, "decode_batch": args.decode_batch,
            "prompt_sets": [ps.name for ps in args.prompt_sets]}


class Children:
    """The running training and decoding processes of every lane, so that a stop reaches them.

    Each runs in its own session (a terminal's Ctrl-C reaches only this script, which stops them in
    order); its output goes to its log file, and its training progress line is echoed to the
    console every :data:`ECHO_S` seconds.
    """

    def __init__(self) -> None:
        self.procs: set[subprocess.Popen] = set()
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    def run(self, cmd: list[str], env: dict[str, str], log_path: Path, echo: Optional[Any] = None) -> int:
        """Run ``cmd`` to its end; its exit status (``-15`` when the ablation is stopping)."""
        with open(log_path, "ab") as fh:
            with self.lock:
                if self.stopping.is_set():
                    return -signal.SIGTERM
                proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        start_new_session=True)
                self.procs.add(proc)
            last = 0.0
            try:
                for line in proc.stdout:
                    fh.write(line)
                    fh.flush()
                    if echo is not None and b"dflash.progress" in line and time.monotonic() - last >= ECHO_S:
                        last = time.monotonic()
                        echo(line.decode(errors="replace").strip())
                return proc.wait()
            finally:
                with self.lock:
                    self.procs.discard(proc)

    def stop(self) -> None:
        """SIGTERM every running child (a training launcher then stops its workers, as on
        ``launch.cluster stop``), SIGKILL its session after :data:`STOP_GRACE_S`."""
        self.stopping.set()
        with self.lock:
            procs = list(self.procs)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def setup_conflict(args: argparse.Namespace, v: Variant) -> Optional[str]:
    """Why ``v`` cannot run or be kept in ``--out`` / ``--work`` with these settings, or ``None``.

    A variant's folder records the settings it started with (``setup.json``); its run directory
    must come from that same start (a run directory without it could hold any schedule)."""
    vdir, run_dir = Path(args.out) / v.name, Path(args.work) / v.name
    now = setup(args, v)
    advice = f"use another --out and --work, or delete {vdir} and {run_dir}"
    befores = []
    if (vdir / "setup.json").exists():
        befores.append(json.loads((vdir / "setup.json").read_text()))
    if (vdir / "result.json").exists():
        befores.append(json.loads((vdir / "result.json").read_text()).get("setup", now))
    for before in befores:
        diff = {k: (before.get(k), now.get(k)) for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)}
        if diff:
            return "started with other settings (" + "; ".join(f"{k}: then {a!r}, now {b!r}" for k, (a, b) in
                                                             diff.items()) + f"): {advice}"
    if not befores and run_dir.exists():
        return f"{run_dir} holds a run this ablation did not record starting: {advice}"
    return None


def run_variant(v: Variant, gpu: Optional[str], args: argparse.Namespace, log: Any,
                children: Children) -> dict[str, Any]:
    """Train ``v`` (resuming its run directory), decode with its newest checkpoint, return its result."""
    from dflash.metrics import metrics_view

    vdir = Path(args.out) / v.name
    run_dir = Path(args.work) / v.name
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    over = args.overrides + v.overrides + (placement() if gpu is not None else []) + [
        f"run_dir={run_dir}", f"train.max_steps={args.steps}", "log.wandb=disabled"]
    result: dict[str, Any] = {"variant": v.name, "overrides": v.overrides, "gpu": gpu, "ok": False,
                              "setup": setup(args, v)}
    t0 = time.perf_counter()
    rc = children.run([sys.executable, "-m", "launch.cluster", "train", "--config", args.config, "--resume", *over],
                      env, vdir / "train.log", echo=lambda line: log(f"{v.name}: {line}"))
    result["train_s"] = time.perf_counter() - t0
    if (run_dir / "metrics.jsonl").exists():
        result.update(train_summary(metrics_view(run_dir / "metrics.jsonl")))
    if rc != 0:
        result["error"] = f"training exit {rc}, see {vdir / 'train.log'}"
        return result
    log(f"{v.name}: trained in {result['train_s']:.0f} s, eval/tau {result.get('eval/tau', math.nan):.3f}; decoding")
    device = "cuda" if gpu is not None else "cpu"
    cmd = [sys.executable, "-m", "scripts.decode_bench", "--config", str(run_dir / "config.yaml"), "--checkpoint",
           str(run_dir), "--prompts", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens),
           "--dtypes", args.decode_dtype, "--modes", args.decode_mode, "--batch", str(args.decode_batch),
           "--repeats", "1", "--device", device, "--out", str(vdir / "decode")]
    for ps in args.prompt_sets:
        cmd += ["--prompt-set", ps.key]
    rc = children.run(cmd, env, vdir / "decode.log")
    bench = vdir / "decode" / "decode_bench.json"
    if bench.exists():
        result.update(decode_summary(json.loads(bench.read_text())))
    if rc not in (0, 1) or "decode_tau" not in result:  # 1 = a FAIL of the margin rule: reported, not an error
        result["error"] = f"decoding exit {rc}, see {vdir / 'decode.log'}"
        return result
    result["ok"] = True
    return result


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="built-in variants: " + ", ".join(f"{k} ({a})" for k, (_, a) in VARIANTS.items()))
    p.add_argument("--config", default=None,
                   help="base config (default: configs/smollm2-135m-h200-regen.yaml on GPUs, "
                        "configs/smollm2-135m-cpu.yaml with --gpus cpu)")
    p.add_argument("--gpus", default=None, help="comma-separated GPU ids, --per-gpu variants on each at a time; "
                                                "`cpu`: one variant at a time on CPU (default: every visible GPU, "
                                                "else cpu)")
    p.add_argument("--per-gpu", type=int, default=1,
                   help="variants at once on each GPU; a small target leaves a GPU mostly idle (default: %(default)s)")
    p.add_argument("--steps", type=int, default=1000, help="train.max_steps of every variant (default: %(default)s)")
    p.add_argument("--variants", default=None, help="comma-separated built-in variants (default: all)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=K=V[,K=V]",
                   help="a custom variant (repeatable)")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts decoded per variant (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="new tokens a prompt (default: %(default)s)")
    p.add_argument("--decode-mode", choices=("eager", "compiled"), default="eager",
                   help="the decoding check's mode (default: %(default)s: τ is the same, and eager has no warm-up)")
    p.add_argument("--decode-batch", type=int, default=16,
                   help="prompts decoded together, each row accepting its own drafts (default: %(default)s)")
    p.add_argument("--decode-dtype", choices=("bfloat16", "float32"), default=None,
                   help="the decoding check's dtype (default: bfloat16 on GPUs, float32 on CPU)")
    add_prompt_set_argument(p)
    p.add_argument("--out", default="ablation-out",
                   help="results: result.json per variant, ablation.md, ablation.json (default: %(default)s)")
    p.add_argument("--work", default=None, help="the variants' run directories (default: <out>/runs)")
    p.add_argument("overrides", nargs="*", help="config overrides of every variant, section.key=value")
    args = p.parse_args(argv)
    args.prompt_sets = check_prompt_sets(p, args.prompt_set)  # a missing package or file: exit 2 here
    for name in ("steps", "prompts", "max_new_tokens", "decode_batch", "per_gpu"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1")
    if args.gpus is None:
        import torch

        args.gpus = ",".join(str(i) for i in range(torch.cuda.device_count())) or "cpu"
    args.gpu_list = None if args.gpus == "cpu" else [g.strip() for g in args.gpus.split(",") if g.strip()]
    if args.gpu_list is not None and (not args.gpu_list or not all(g.isdigit() for g in args.gpu_list)):
        p.error(f"--gpus: expected comma-separated GPU ids or `cpu`, got {args.gpus!r}")
    if args.gpu_list is not None:
        import torch

        visible = torch.cuda.device_count()
        missing = [g for g in args.gpu_list if int(g) >= visible]
        if missing:
            p.error(f"--gpus {args.gpus}: this machine has {visible} visible GPU(s), no GPU {', '.join(missing)} "
                    "(`--gpus cpu` runs on CPU)")
    if args.config is None:
        args.config = "configs/smollm2-135m-cpu.yaml" if args.gpu_list is None else "configs/smollm2-135m-h200-regen.yaml"
    args.decode_dtype = args.decode_dtype or ("float32" if args.gpu_list is None else "bfloat16")
    args.work = args.work or str(Path(args.out) / "runs")
    for name in ("out", "work"):
        if Path(getattr(args, name)).exists() and not Path(getattr(args, name)).is_dir():
            p.error(f"--{name} {getattr(args, name)}: is a file, not a directory")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    try:
        variants = select_variants(args.variants, args.variant)
        check_configs(args.config, args.overrides, variants, shared_gpu=args.gpu_list is not None)
    except ValueError as e:
        print(f"ablation: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    meta = {"config": args.config, "overrides": args.overrides, "steps": args.steps, "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens, "decode_mode": args.decode_mode, "decode_dtype": args.decode_dtype, "decode_batch": args.decode_batch,
            "gpus": args.gpus, "per_gpu": args.per_gpu, "prompt_sets": [ps.name for ps in args.prompt_sets]}
    lock = threading.Lock()
    start = time.perf_counter()

    def log(msg: str) -> None:
        with lock:
            print(f"[ablation {time.perf_counter() - start:7.0f} s] {msg}", flush=True)

    def write() -> None:
        (out / "ablation.json").write_text(json.dumps({"meta": meta, "variants": [v.result for v in variants if v.result]},
                                                      indent=1))
        (out / "ablation.md").write_text(table(variants, meta))
        try:
            (out / "recipe.json").write_text(json.dumps(stacked_recipe([v.result for v in variants if v.result],
                                                                       check=config_error(args.config, args.overrides)),
                                                        indent=1))
        except ValueError:  # no baseline decoded yet
            pass

    todo: list[Variant] = []
    for v in variants:
        problem = setup_conflict(args, v)
        if problem:
            print(f"ablation: variant {v.name}: {problem}", file=sys.stderr)
            return 2
        done = out / v.name / "result.json"
        before = json.loads(done.read_text()) if done.exists() else {}
        if before.get("ok"):
            v.result = before
            log(f"{v.name}: done before, kept")
        else:
            todo.append(v)
    durations: list[float] = []
    queue = list(todo)
    lanes = [g for g in args.gpu_list for _ in range(args.per_gpu)] if args.gpu_list else [None]
    children = Children()

    def lane(gpu: Optional[str]) -> None:
        while not children.stopping.is_set():
            with lock:
                if not queue:
                    return
                v = queue.pop(0)
                left = len(queue)
            log(f"{v.name}: start on {'GPU ' + gpu if gpu is not None else 'CPU'} ({' '.join(v.overrides) or 'as is'})")
            (out / v.name).mkdir(parents=True, exist_ok=True)
            (out / v.name / "setup.json").write_text(json.dumps(setup(args, v), indent=1))
            t0 = time.perf_counter()
            try:
                v.result = run_variant(v, gpu, args, log, children)
            except Exception as e:  # noqa: BLE001 - one variant's failure must not stop the others
                v.result = {"variant": v.name, "overrides": v.overrides, "ok": False, "setup": setup(args, v),
                            "error": f"{type(e).__name__}: {e}"}
            if children.stopping.is_set() and not v.result.get("ok"):
                log(f"{v.name}: stopped; a later run resumes it")
                return
            (out / v.name / "result.json").write_text(json.dumps(v.result, indent=1))
            with lock:
                durations.append(time.perf_counter() - t0)
                eta = statistics.mean(durations) * math.ceil(left / len(lanes))
                write()
            state = (f"ok in {durations[-1]:.0f} s; decoding τ {v.result['decode_tau']:.3f}" if v.result.get("ok")
                     else f"FAILED in {durations[-1]:.0f} s: {v.result.get('error')}")
            log(f"{v.name}: {state}; {left} left, ETA {eta:.0f} s")

    def on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signum)

    signal.signal(signal.SIGTERM, on_signal)
    threads = [threading.Thread(target=lane, args=(g,), name=f"lane-{i}") for i, g in enumerate(lanes)]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(timeout=1.0)
    except KeyboardInterrupt as stop:
        signum = stop.args[0] if stop.args else signal.SIGINT
        log(f"stopping: {signal.Signals(signum).name}; the running variants stop (their last checkpoint is kept)")
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        children.stop()
        for t in threads:
            t.join(timeout=STOP_GRACE_S)
        write()
        return 128 + int(signum)
    write()
    print(table(variants, meta), flush=True)
    return 0 if all(v.result and v.result.get("ok") for v in variants) else 1


if __name__ == "__main__":
    sys.exit(main())
