"""What a launch continues from, and the files that let anyone check it afterwards.

* :func:`plan_launch`: the step plan and learning-rate schedule of a fresh or resumed launch.
  A resume continues at the checkpoint's **data position** (the next untrained batch, counted in
  batches: :class:`dflash.data.schedule.DataPosition`), whatever the number of drafters now, and keeps
  the learning rate continuous (:meth:`dflash.training.optim.LRSchedule.spread`); a changed
  ``train.max_steps`` / ``epochs`` / ``lr`` / ``warmup_ratio`` / ``min_lr_ratio`` rebuilds the
  schedule for the new settings, said in one log line with the old and the new schedule.
* :class:`LaunchPlan` (``<run_dir>/plan.json``): what the launcher decided, read by the drafter
  workers (total steps and schedule) before they build their optimizer.
* :class:`LedgerFile` (``<run_dir>/ledger.jsonl``): one row per trained step with the batch ids
  it trained, and one row per rollback (a drafter-group restart or a ``--resume`` from an older
  step) that supersedes the rows of the steps it undoes. :func:`ledger_view` gives the final
  view (each step once) and :func:`ledger_problems` checks exactly-once from the file alone.
* :func:`check_resume`: whether a checkpoint can be continued by this config at all (the
  drafter's shape, then the tokenizer / template / target it was trained with), before any model
  loads; :func:`resume_mismatches` names each differing field and the key that sets it.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from dflash.training.optim import LRSchedule
from dflash.data.schedule import DataPosition, StepPlan
from dflash.utils import atomic_write_text

__all__ = ["PLAN_FILE", "LEDGER_FILE", "SCHEDULE_KEYS", "LaunchPlan", "plan_launch", "checkpoint_position",
           "LedgerFile", "append_line", "read_jsonl_rows", "ledger_view", "ledger_problems", "RESUME_FIELDS",
           "check_resume", "expected_drafter_fields", "resume_mismatches", "resume_mismatch_message"]

log = logging.getLogger(__name__)

PLAN_FILE = "plan.json"
LEDGER_FILE = "ledger.jsonl"
#: Config keys that define the learning-rate schedule: a change at ``--resume`` rebuilds it.
SCHEDULE_KEYS = ("train.max_steps", "train.epochs", "train.lr", "train.warmup_ratio", "train.min_lr_ratio")


@dataclass
class LaunchPlan:
    """One launch's plan: it starts at ``start_step`` / ``start``, ends at ``total_steps``, with
    ``num_drafters`` ranks and the learning rate ``schedule``."""

    start_step: int
    start: DataPosition
    num_drafters: int
    total_steps: int
    schedule: LRSchedule

    def write(self, run_dir: Path) -> Path:
        """Write ``<run_dir>/plan.json`` atomically (:func:`dflash.utils.atomic_write_text`)."""
        path = Path(run_dir) / PLAN_FILE
        atomic_write_text(path, json.dumps({"start_step": self.start_step, "start": self.start.to_list(),
                                   "num_drafters": self.num_drafters, "total_steps": self.total_steps,
                                   "schedule": self.schedule.to_dict()}, indent=1))
        return path

    @classmethod
    def read(cls, run_dir: Path) -> Optional["LaunchPlan"]:
        """``<run_dir>/plan.json``, or ``None`` when there is none.

        Raises:
            ValueError: the file is not a launch plan.
        """
        path = Path(run_dir) / PLAN_FILE
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            return cls(int(data["start_step"]), DataPosition.from_list(data["start"]), int(data["num_drafters"]),
                       int(data["total_steps"]), LRSchedule.from_dict(data["schedule"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path} is not a launch plan ({type(exc).__name__}: {exc})") from None


def checkpoint_position(state: dict, batches_per_epoch: Sequence[int], num_drafters: int) -> DataPosition:
    """The data position a checkpoint's ``state.json`` records (``data_position``).

    A checkpoint that records none was written by a run that kept one plan from step 0: its
    position is derived from that plan with the checkpoint's ``num_drafters`` (else
    ``num_drafters``).

    Raises:
        ValueError: a malformed ``data_position``, or a step past that plan.
    """
    if state.get("data_position") is not None:
        return DataPosition.from_list(state["data_position"])
    step = int(state["step"])
    old = StepPlan(batches_per_epoch, int(state.get("num_drafters") or num_drafters))
    if step > old.total_steps:
        raise ValueError(f"checkpoint step {step} is past the {old.total_steps} steps its data gives")
    return old.position_at(step)


def _flat(cfg: Optional[dict]) -> dict:
    out = {}
    for section, values in (cfg or {}).items():
        if isinstance(values, dict):
            out.update({f"{section}.{k}": v for k, v in values.items()})
    return out


def plan_launch(cfg: Any, batches_per_epoch: Sequence[int], state: Optional[dict] = None,
                saved_cfg: Optional[dict] = None) -> tuple[StepPlan, LaunchPlan, list[str]]:
    """The step plan, launch plan and notes of a fresh launch (``state=None``) or a resume.

    Args:
        cfg: this launch's :class:`dflash.config.RunConfig`.
        batches_per_epoch: training batches of each epoch (``train.epochs`` entries).
        state: the resumed checkpoint's ``state.json`` (``step``; ``data_position``,
            ``num_drafters``, ``schedule`` when it records them).
        saved_cfg: the run's previous ``config.yaml`` as a dict (what the checkpoint was trained
            with), to tell a changed :data:`SCHEDULE_KEYS` entry.

    Returns:
        ``(plan, launch, notes)``: ``notes`` are the lines to log (a changed schedule or number
        of drafters; ``train.max_steps`` the data cannot give).

    Raises:
        ValueError: a checkpoint position past this config's data (fewer epochs or batches).
    """
    d = len(cfg.cluster.drafters)
    max_steps = cfg.train.max_steps
    notes: list[str] = []
    if state is None:
        plan = StepPlan(batches_per_epoch, d, max_steps)
        schedule = LRSchedule.nominal(plan.total_steps, cfg.train)
    else:
        step = int(state["step"])
        position = checkpoint_position(state, batches_per_epoch, d)
        plan = StepPlan(batches_per_epoch, d, max_steps, start_step=step, start=position)
        old_d = state.get("num_drafters")
        old = LRSchedule.from_dict(state["schedule"]) if state.get("schedule") else None
        before, now = _flat(saved_cfg), _flat(cfg.to_dict())
        changed = [f"{k} {json.dumps(before[k])} -> {json.dumps(now[k])}" for k in SCHEDULE_KEYS
                   if k in before and before[k] != now[k]]
        if old is not None and old_d is not None and old_d != d:
            notes.append(f"resuming with {d} drafter(s) where the checkpoint was trained with {old_d}: continuing "
                         f"at data position epoch {position.epoch} batch {position.batch} (every batch trained once)")
        if old is None:
            schedule = LRSchedule.nominal(max(plan.total_steps, 1), cfg.train)
            if changed or (old_d is not None and old_d != d):
                notes.append(f"the checkpoint records no LR schedule: using {schedule.describe(step)}")
        elif changed:
            schedule = LRSchedule.nominal(max(plan.total_steps, 1), cfg.train)
            notes.append(f"LR schedule rebuilt at step {step} for {', '.join(changed)}: before {old.describe(step)}; "
                         f"now {schedule.describe(step)}")
        else:
            schedule = old.spread(step, plan.total_steps)
            if schedule != old:
                notes.append(f"LR schedule continued at step {step} and spread over the steps now left: before "
                             f"{old.describe(step)}; now {schedule.describe(step)}")
    if max_steps is not None and plan.data_steps < max_steps:
        notes.append(f"train.max_steps={max_steps} cannot be honoured: the data gives {plan.data_steps} steps "
                     f"({sum(batches_per_epoch)} batches in {len(batches_per_epoch)} epoch(s) over {d} drafter(s)"
                     f"{f', from step {plan.start_step}' if plan.start_step else ''}); the run ends at step "
                     f"{plan.total_steps} (raise train.epochs or add data for more)")
    launch = LaunchPlan(plan.start_step, plan.start, d, plan.total_steps, schedule)
    return plan, launch, notes


# --------------------------------------------------------------------------- the ledger file

def append_line(path: Path, record: dict) -> None:
    """Append one JSON line to ``path`` in a single ``write`` on an ``O_APPEND`` descriptor, then
    ``fsync``: a reader (or a crash) sees the whole line or none of it (a line torn by a crash is
    ended first, so it never swallows the next one; the readers here skip it)."""
    data = (json.dumps(record, separators=(",", ":")) + "\n").encode("utf-8")
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":  # a line torn by a crash: keep it on its own line
            data = b"\n" + data
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


class LedgerFile:
    """``<run_dir>/ledger.jsonl``: what each step trained, and which steps were undone.

    Rows: ``{"step": s, "epoch": e, "batches": [ids or null per rank], "attempt": a}`` for a
    trained step s (0-based: the step that took the run from s to s + 1 steps done), and
    ``{"rollback": {"to_step": k, "from_step": n, "reason": …}}`` when steps ``k …`` are undone
    (a drafter-group restart from a checkpoint, or a launch resuming at ``k``).
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LEDGER_FILE

    def trained(self, step: int, epoch: int, batches: Sequence[Optional[int]], attempt: int) -> None:
        append_line(self.path, {"step": step, "epoch": epoch, "batches": list(batches), "attempt": attempt})

    def rollback(self, to_step: int, from_step: int, reason: str) -> None:
        append_line(self.path, {"rollback": {"to_step": to_step, "from_step": from_step, "reason": reason}})


def read_jsonl_rows(path: Path) -> list[dict]:
    """The JSON objects of a JSONL file written by :func:`append_line`, in order; ``[]`` when it
    does not exist. A line cut by a crash mid-write (or any non-object line) is skipped."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:  # a line cut by a crash mid-write
            continue
        if isinstance(row, dict):
            out.append(row)
    return out


def ledger_view(path: Path) -> dict[int, dict]:
    """The final view of a ledger file: ``{step: row}``, each step once (a rollback to ``k`` drops
    the rows of steps ``>= k`` written before it; a later row of a step replaces an earlier one)."""
    view: dict[int, dict] = {}
    for row in read_jsonl_rows(path):
        if "rollback" in row:
            to = int(row["rollback"]["to_step"])
            view = {s: r for s, r in view.items() if s < to}
        elif "step" in row:
            view[int(row["step"])] = row
    return view


def ledger_problems(path: Path, batches_per_epoch: Sequence[int], end: Optional[DataPosition] = None) -> list[str]:
    """Exactly-once from the file alone: every batch from ``(0, 0)`` up to ``end`` (default: the
    position after the last step of the final view) trained once, and the steps ``0 … n − 1``
    each present.

    Returns:
        One line per problem (missing step, batch never trained / trained n times / out of order).
    """
    view = ledger_view(path)
    problems = [f"step {s} missing" for s in range(max(view, default=-1) + 1) if s not in view]
    seen: dict[tuple[int, int], int] = {}
    order: list[tuple[int, int]] = []
    for s in sorted(view):
        for b in view[s]["batches"]:
            if b is not None:
                key = (int(view[s]["epoch"]), int(b))
                seen[key] = seen.get(key, 0) + 1
                order.append(key)
    if end is None:
        if order:
            e, b = order[-1]
            end = DataPosition(e + 1, 0) if b + 1 >= batches_per_epoch[e] else DataPosition(e, b + 1)
        else:
            end = DataPosition()
    expected = [(e, b) for e, n in enumerate(batches_per_epoch) for b in range(n) if (e, b) < (end.epoch, end.batch)]
    problems += [f"epoch {e} batch {b} never trained" for e, b in expected if (e, b) not in seen]
    problems += [f"epoch {e} batch {b} trained {n} times" for (e, b), n in sorted(seen.items()) if n > 1]
    problems += [f"epoch {e} batch {b} trained but not before the end position" for e, b in sorted(seen)
                 if (e, b) >= (end.epoch, end.batch)]
    if order != sorted(order):
        problems.append("batches trained out of order")
    return problems


# --------------------------------------------------------------------------- does the checkpoint fit this config

TARGET_SOURCE = "the target model: target.kind / path / arch / arch_overrides"
#: Fields of a drafter's ``config.json`` that ``--resume`` compares with what this run's config
#: builds (:func:`resume_mismatches`): each changes a parameter's shape or what the weights mean.
#: Value: the run-config key that sets it.
RESUME_FIELDS = {
    "num_hidden_layers": "drafter.num_layers",
    "block_size": "drafter.block_size",
    "layer_types": "drafter.layer_types",
    "sliding_window": "drafter.sliding_window",
    "intermediate_size": "drafter.intermediate_size",
    "target_layer_ids": "target.layer_ids",
    "mask_token_id": "drafter.mask_token_id",
    "hidden_size": TARGET_SOURCE,
    "num_attention_heads": TARGET_SOURCE,
    "num_key_value_heads": TARGET_SOURCE,
    "head_dim": TARGET_SOURCE,
    "vocab_size": TARGET_SOURCE,
    "num_target_layers": TARGET_SOURCE,
    "rope_theta": TARGET_SOURCE,
}
#: Keys of the run's saved ``config.yaml`` quoted when they differ (what the run was started with).
RESUME_CONFIG_KEYS = ("target.kind", "target.path", "target.arch", "target.arch_overrides", "target.tokenizer",
                      "target.layer_ids", "drafter.num_layers", "drafter.block_size", "drafter.mask_token_id",
                      "drafter.layer_types", "drafter.sliding_window", "drafter.intermediate_size")


def check_resume(cfg: Any, run_dir: Path, ckpt: Path, tokenizer: Any, force: bool = False) -> None:
    """Check, before any model loads, that checkpoint ``ckpt`` of ``run_dir`` can be continued by
    a launch of ``cfg`` with ``tokenizer``.

    Two checks, in this order: the drafter this config builds has the checkpoint's shape
    (:func:`resume_mismatches`: layers, block size, target layer ids, mask token, the target's
    dimensions); then the checkpoint was trained with this tokenizer, chat template, thinking
    mode and target (:func:`dflash.training.checkpoint.check_fits`, which ``force`` relaxes for the
    fields a user may knowingly change).

    Args:
        cfg: this launch's :class:`dflash.config.RunConfig`.
        run_dir: the run directory (its ``config.yaml`` says what the run was started with).
        ckpt: the checkpoint to continue (``<run_dir>/checkpoints/step-XXXXXXXX``).
        tokenizer: this launch's tokenizer (``len(tokenizer)`` tokens).
        force: accept another tokenizer, chat template, thinking mode or architecture name.

    Raises:
        CheckpointMismatch: one paragraph naming each differing field and how to proceed.
        ConfigError: a bad ``target.layer_ids`` / ``target.arch`` for this target.
        OSError: a missing model file or directory.
    """
    from dflash.training.checkpoint import CheckpointMismatch, check_fits, run_identity

    mismatches = resume_mismatches(cfg, ckpt, len(tokenizer))
    if mismatches:
        raise CheckpointMismatch(resume_mismatch_message(cfg, run_dir, ckpt, mismatches))
    check_fits(ckpt, run_identity(tokenizer, _cheap_target_config(cfg), None, cfg.data.enable_thinking), force=force)


def _cheap_target_config(cfg: Any):
    """The target's HF config when reading it loads no weights and converts nothing, else ``None``
    (a GGUF target whose conversion is not cached)."""
    from dflash.training.factory import target_hf_config

    if cfg.target.kind == "gguf":
        from dflash.data import assets
        from dflash.models.gguf_cache import gguf_converted

        path = Path(cfg.target.path) if cfg.target.path is not None else assets.smollm2_gguf_path()
        if not path.is_file() or not gguf_converted(path):
            return None
    return target_hf_config(cfg)


def expected_drafter_fields(cfg: Any, tokenizer_size: int) -> dict:
    """The :data:`RESUME_FIELDS` of the drafter this run would build (as ``dflash.training.factory.build_drafter``
    does), without loading any weights.

    The target's HF config is read as the factory reads it; a GGUF target that is not converted
    yet is described from its metadata instead (:func:`dflash.models.target_loader.describe_target`), which
    leaves out the fields it cannot tell (heads, head_dim, RoPE, the default intermediate size).

    Raises:
        ConfigError: a bad ``target.layer_ids`` / ``target.arch`` for this target.
        OSError: a missing model file or directory.
    """
    from dflash.models.masks import SLIDING_ATTENTION

    quiet = logging.getLogger("dflash.models.drafter_config")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its RoPE / mask warnings are the workers' to give
    try:
        tc = _cheap_target_config(cfg)
        out = _fields_from_target_config(cfg, tc, tokenizer_size) if tc is not None else \
            _fields_from_target_metadata(cfg, tokenizer_size)
    finally:
        quiet.setLevel(level)
    out["_sliding"] = SLIDING_ATTENTION in out["layer_types"]
    return out


def _fields_from_target_config(cfg: Any, tc: Any, tokenizer_size: int) -> dict:
    from dflash.config import ConfigError
    from dflash.training.factory import drafter_config

    text = tc.get_text_config() if hasattr(tc, "get_text_config") else tc
    try:
        dcfg = drafter_config(cfg, tc, tokenizer_size, int(text.vocab_size))
    except ValueError as exc:
        raise ConfigError(f"drafter: {exc}") from None
    return {name: getattr(dcfg, name) for name in RESUME_FIELDS}


def _fields_from_target_metadata(cfg: Any, tokenizer_size: int) -> dict:
    from dflash.models.drafter_config import resolve_mask_token_id
    from dflash.models.masks import FULL_ATTENTION
    from dflash.models.target_loader import describe_target

    d = cfg.drafter
    info = describe_target(cfg.target, d.num_layers)
    # Without the target's config its special token ids are unknown: the mask token is
    # compared only when it does not fall back to one of them.
    mask_id = (resolve_mask_token_id(d.mask_token_id, tokenizer_size, info.vocab_size)
               if d.mask_token_id is not None or tokenizer_size < info.vocab_size else None)
    out = {"num_hidden_layers": d.num_layers, "block_size": d.block_size,
           "layer_types": list(d.layer_types) if d.layer_types else [FULL_ATTENTION] * d.num_layers,
           "sliding_window": d.sliding_window, "target_layer_ids": list(info.layer_ids),
           "mask_token_id": mask_id, "hidden_size": info.hidden_size, "vocab_size": info.vocab_size,
           "num_target_layers": info.num_layers}
    if d.intermediate_size is not None:
        out["intermediate_size"] = d.intermediate_size
    if mask_id is None:
        del out["mask_token_id"]
    return out


def resume_mismatches(cfg: Any, ckpt: Path, tokenizer_size: int) -> list[str]:
    """How the drafter in checkpoint ``ckpt`` differs from the one this run's config builds.

    Compares the checkpoint's ``drafter/config.json`` with :func:`expected_drafter_fields`, field
    by field (:data:`RESUME_FIELDS`; ``sliding_window`` only when a layer of either uses it;
    ``rope_theta`` to a relative 1e-6).

    Returns:
        One ``field (set by key): checkpoint X, this run Y`` per differing field; empty when they
        match. An unreadable ``config.json`` is one entry saying so.

    Raises:
        ConfigError / OSError: from :func:`expected_drafter_fields`.
    """
    from dflash.models.drafter import DFlashDraftModel
    from dflash.models.masks import FULL_ATTENTION, SLIDING_ATTENTION

    directory = Path(ckpt) / "drafter"
    try:
        saved_cfg = DFlashDraftModel.load_config(directory)  # refuses a learned mask vector
    except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
        return [f"{directory / 'config.json'} cannot be read as a DFlash drafter config ({exc})"]
    saved = {name: getattr(saved_cfg, name) for name in RESUME_FIELDS if hasattr(saved_cfg, name)}
    expected = expected_drafter_fields(cfg, tokenizer_size)
    sliding = expected.pop("_sliding") or SLIDING_ATTENTION in (saved_cfg.layer_types or [FULL_ATTENTION])
    out = []
    for name, key in RESUME_FIELDS.items():
        if name not in expected or name not in saved or (name == "sliding_window" and not sliding):
            continue
        a, b = saved[name], expected[name]
        same = (abs(float(a) - float(b)) <= 1e-6 * max(1.0, abs(float(a)))) if name == "rope_theta" else a == b
        if not same:
            out.append(f"{name} (set by {_field_source(cfg, name, key)}): checkpoint {json.dumps(a)}, "
                       f"this run {json.dumps(b)}")
    return out


def _field_source(cfg: Any, name: str, key: str) -> str:
    """What sets field ``name`` in this run: ``key``, or what a ``null`` there defaults to."""
    if name == "target_layer_ids" and cfg.target.layer_ids is None:
        return "target.layer_ids=null: the DFlash rule for drafter.num_layers and the target's depth"
    if name == "layer_types" and cfg.drafter.layer_types is None:
        return "drafter.layer_types=null: full attention in each of drafter.num_layers"
    if name == "intermediate_size" and cfg.drafter.intermediate_size is None:
        return "drafter.intermediate_size=null: the target's"
    if name == "mask_token_id" and cfg.drafter.mask_token_id is None:
        return ("drafter.mask_token_id=null: the target's first unused embedding row, else its unk / pad / eos / bos "
                "token")
    return key


def resume_mismatch_message(cfg: Any, run_dir: Path, ckpt: Path, mismatches: list[str]) -> str:
    """The one-paragraph error for :func:`resume_mismatches`: the fields, what the run was started
    with (its saved ``config.yaml``, where it differs), and how to proceed."""
    import yaml

    text = (f"this run's drafter does not match the checkpoint it would continue "
            f"({ckpt / 'drafter' / 'config.json'}): {'; '.join(mismatches)}.")
    saved_file = run_dir / "config.yaml"
    try:
        saved = _flat(yaml.safe_load(saved_file.read_text()))
    except (OSError, yaml.YAMLError, AttributeError):
        saved = {}
    now = _flat(cfg.to_dict())
    started_with = [f"{k}={json.dumps(saved[k])}" for k in RESUME_CONFIG_KEYS if k in saved and saved[k] != now.get(k)]
    if started_with:
        text += f" The run's {saved_file} was written with {', '.join(started_with)}."
    return (text + " To continue this run, drop or fix the override(s) so that these fields match; to start a "
            "new run in this directory instead, pass --overwrite (its checkpoints are deleted), or choose "
            "another run_dir / name.")
