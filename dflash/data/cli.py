"""The data command line, ``python -m launch.cluster data``: prepare the data of a config (or load
it from the cache) and print its report.

The report gives the rows read and kept, every drop / fix / flag reason's count, the split and the
held-out conversations with a twin in training; ``--ids REASON`` lists the rows under one reason and
``--json PATH`` writes the whole report.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Optional

from dflash.data.corpus import PreparedData, prepare_data
from dflash.data.heldout import heldout_twins
from dflash.data.report import DROP_REASONS, FIX_REASONS, FLAG_REASONS

__all__ = ["main"]

log = logging.getLogger(__name__)

PROG = "python -m launch.cluster data"


def report_lines(prepared: PreparedData, twins: int, max_length: int) -> list[str]:
    """The printed report: rows read, kept, each reason's count (dropped, fixed, flagged) and the held-out
    conversations with ``twins`` of them equal to a training conversation, and the other parts of held-out
    conversations set aside (:attr:`dflash.data.corpus.PreparedData.set_aside`)."""
    report = prepared.report
    lines = [f"rows read: {report.rows_read}", f"kept: {report.conversations} conversations, "
             f"{report.sequences} sequences ({report.truncated} truncated at {max_length} tokens)"]
    if report.primary_rows is not None:
        lines.append(f"  of them from data.extra_datasets (training only): {report.extra_conversations} "
                     f"conversations{report.extra_tokens_text()}")
    for title, reasons, counts in (("dropped", DROP_REASONS, report.dropped), ("fixed", FIX_REASONS, report.fixed),
                                   ("flagged", FLAG_REASONS, report.flagged)):
        lines.append(f"{title}: {sum(counts.values())}")
        lines += [f"  {reason}: {counts[reason]}" for reason in reasons if counts.get(reason)]
    lines.append(f"held out: {len(set(prepared.heldout.source_rows[prepared.heldout.indices].tolist()))} "
                 f"conversations; with a twin in training: {twins}; their other parts, in neither split: "
                 f"{prepared.set_aside}")
    return lines


def main(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> int:
    """``python -m launch.cluster data --config configs/X.yaml [key=value ...] [--ids REASON] [--json PATH]``:
    prepare the data of a config (or load it from the cache) and print its report: rows read, kept,
    every reason's count, the split and the held-out conversations with a twin in training.

    Returns:
        0 done; 2 the config does not load, or a data file cannot be read as its name says.
    """
    from dflash.config import ConfigError, load_config
    from dflash.data.tokenizer import load_tokenizer
    from dflash.logs import setup_logging

    parser = argparse.ArgumentParser(prog=prog or PROG, description=main.__doc__)
    parser.add_argument("--config", default=None, help="YAML config (default: the built-in defaults)")
    parser.add_argument("--ids", default=None, metavar="REASON", help="also print the rows under REASON")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the full report as JSON")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args(argv)
    setup_logging("data")
    known = DROP_REASONS + FIX_REASONS + FLAG_REASONS
    if args.ids is not None and args.ids not in known:
        parser.error(f"--ids {args.ids}: not a reason; one of {', '.join(known)}")
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as exc:
        log.error("%s", exc)
        return 2
    try:
        prepared = prepare_data(cfg, load_tokenizer(cfg.target))
    except ConfigError as exc:  # e.g. a .json data file that is not a JSON array, found while reading it
        log.error("%s", exc)
        return 2
    except KeyboardInterrupt:
        log.error("interrupted: nothing was cached (the next run tokenises again)")
        return 130
    twins = heldout_twins(prepared, cfg.data.dataset, cfg.data.max_conversations)
    print("\n".join(report_lines(prepared, twins, cfg.data.max_length)))
    if args.ids:
        ids = "\n".join(prepared.report.ids(args.ids))
        print(ids.encode("utf-8", "backslashreplace").decode("utf-8"))  # an id may hold a lone surrogate
    if args.json:
        Path(args.json).write_text(json.dumps({**prepared.report.to_dict(), "heldout_twins": twins}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
