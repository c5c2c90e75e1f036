"""``<run_dir>/ledger.jsonl``: what each trained step trained, and which steps were undone.

:class:`LedgerFile` writes one row per trained step with the batch ids it trained, and one row per
rollback (a drafter-group restart or a ``--resume`` from an older step) that supersedes the rows
of the steps it undoes. :func:`ledger_view` gives the final view (each step once) and
:func:`ledger_problems` checks exactly-once from the file alone. The file is written and read
with :mod:`dflash.jsonl` (safe against a line cut by a crash). The in-memory accounting of a
running cluster is :class:`dflash.runtime.ledger.Ledger`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from dflash import jsonl
from dflash.data.schedule import DataPosition

__all__ = ["LEDGER_FILE", "LedgerFile", "ledger_view", "ledger_problems"]

LEDGER_FILE = "ledger.jsonl"


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
        jsonl.append(self.path, {"step": step, "epoch": epoch, "batches": list(batches), "attempt": attempt},
                     compact=True)

    def rollback(self, to_step: int, from_step: int, reason: str) -> None:
        jsonl.append(self.path, {"rollback": {"to_step": to_step, "from_step": from_step, "reason": reason}},
                     compact=True)


def ledger_view(path: Path) -> dict[int, dict]:
    """The final view of a ledger file: ``{step: row}``, each step once (a rollback to ``k`` drops
    the rows of steps ``>= k`` written before it; a later row of a step replaces an earlier one)."""
    view: dict[int, dict] = {}
    for row in jsonl.read_records(path):
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
