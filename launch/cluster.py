"""``python -m launch.cluster COMMAND ...``: the command line of the system, one subcommand per job.

============  ==================================================================  ==================
command       what it does                                                        implemented in
============  ==================================================================  ==================
train         train a drafter: workers, coordinator, checkpoints, metrics         :mod:`launch.train`
status        a running cluster's workers, pids, step and restarts (``--json``)   :mod:`launch.status`
restart       restart ``target.K`` alone, or the drafter group (``drafters``)     :mod:`launch.status`
stop          stop a running cluster gracefully (final checkpoint, then exit)     :mod:`launch.status`
attach        run worker ``target.K`` / ``drafter.K`` here, in the foreground     :mod:`launch.status`
regenerate    rewrite the training responses with the target                      :mod:`dflash.inference.regenerate`
speculate     speculative decoding with a trained drafter against the target     :mod:`dflash.inference.speculative`
export        write a trained drafter in the serving layout                       :mod:`dflash.inference.export`
data          prepare a config's data (or load its cache) and print the report    :mod:`dflash.data.cli`
============  ==================================================================  ==================

The forms without a subcommand keep working: ``--config X.yaml [section.key=value ...]`` is
``train``, ``--mode regenerate ...`` is ``regenerate``, and a command word may stand after its
options (``--run-dir D stop``). A first word that is neither a command nor a ``section.key=value``
override is refused before any config loads, with the closest command (:func:`unknown_command`).
"""

from __future__ import annotations

import argparse
import difflib
import logging
import sys
from pathlib import Path
from typing import Callable, Optional

from launch import EXIT_BROKEN_PIPE, EXIT_CONFIG

__all__ = ["COMMANDS", "EXIT_BROKEN_PIPE", "EXIT_CONFIG", "main", "parse_args", "split_command", "first_word",
           "unknown_command"]

log = logging.getLogger("dflash.cluster")

PROG = "python -m launch.cluster"
CONTROL_COMMANDS = ("status", "restart", "stop", "attach")
#: Subcommands whose arguments go, unparsed, to another module's command line: name -> (module, help).
FORWARDED = {
    "regenerate": ("dflash.inference.regenerate", "rewrite the training data's responses with the target (--help: its options)"),
    "speculate": ("dflash.inference.speculative", "speculative decoding with a trained drafter vs the target alone (--help)"),
    "export": ("dflash.inference.export", "export a trained drafter for vLLM / SGLang / transformers (--help: its options)"),
    "data": ("dflash.data.cli", "prepare a config's data (or load its cache) and print the data report (--help)"),
}
#: Options that take a value (the next argument is not a command).
VALUE_OPTIONS = ("--config", "--run-dir", "--mode", "--nnodes", "--node-rank", "--master-addr", "--master-port",
                 "--node-addr")
#: Flags a bare word may have been meant as (``resume`` → ``--resume``).
FLAG_OPTIONS = ("--resume", "--overwrite", "--json")
USAGE = (f"{PROG} [train] --config configs/X.yaml [section.key=value ...] [--resume | --overwrite], "
         f"or {PROG} {{status | restart WORKER | stop | attach WORKER}} --run-dir runs/NAME, "
         f"or {PROG} {{regenerate | speculate | export | data}} ... (--help)")


class UnknownCommand(ValueError):
    """A first word that is neither a command nor a ``section.key=value`` override."""


# --------------------------------------------------------------------------- the parser

def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a drafter (the default: --config X.yaml without a command)",
                       description="Train a drafter: one process per target and drafter rank, supervised, with "
                                   "checkpoints and metrics under the run directory.")
    p.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true",
                       help="continue from the newest checkpoint of the run directory (starts fresh when there is "
                            "none); its drafter must have this config's shape")
    start.add_argument("--overwrite", action="store_true", help="discard an existing run directory's checkpoints")
    p.add_argument("--force", action="store_true",
                   help="with --resume: continue although the checkpoint was trained with another tokenizer, chat "
                        "template, thinking mode or target architecture name (shapes must still match)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    from launch.nodes import add_rendezvous_args

    add_rendezvous_args(p)


def _control_parser(sub, name: str, help_text: str, worker_help: Optional[str]) -> None:
    p = sub.add_parser(name, help=help_text, description=f"{help_text} (a running cluster).")
    if worker_help is not None:
        p.add_argument("worker", help=worker_help)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--run-dir", type=Path, help="the run directory (runs/<name>)")
    where.add_argument("--config", help="the run's config (its run directory is used)")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.add_argument("overrides", nargs="*", default=[], metavar="section.key=value",
                   help="config overrides (with --config: those that set the run directory)")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line: the parser (its ``--help`` lists the commands) and each command's
    subparser by name; the forwarded commands' subparsers take any arguments (their modules parse them)."""
    parser = argparse.ArgumentParser(prog=PROG, description="The command line of dflash-pipeline: one subcommand per job.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="without a command: --config X.yaml ... trains; --mode regenerate ... "
                                            "regenerates")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _train_parser(sub)
    _control_parser(sub, "status", "workers, pids, step, restarts", None)
    _control_parser(sub, "restart", "restart one target, or the drafter group from the newest checkpoint",
                    "target.N, or drafters (the whole group)")
    _control_parser(sub, "stop", "stop gracefully: final checkpoint, then exit", None)
    _control_parser(sub, "attach", "run one worker here, in the foreground (pdb works)", "target.N or drafter.N")
    for name, (_, help_text) in FORWARDED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser, dict(sub.choices)


def first_word(argv: list[str]) -> Optional[str]:
    """The first argument of ``argv`` that is neither an option nor an option's value, or None.

    The options of :data:`VALUE_OPTIONS` (``--config X``, ``--run-dir D``) consume their value;
    everything after ``--`` is ignored.
    """
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--":
            return None
        if arg.startswith("-"):
            skip = arg in VALUE_OPTIONS
            continue
        return arg
    return None


def unknown_command(word: str) -> str:
    """The error for a first word that is not a command nor a ``section.key=value`` override.

    Returns:
        A message naming ``word`` and the closest command (:func:`difflib.get_close_matches`),
        or the flag / ``--config`` it was likely meant as, and the usage.
    """
    close = difflib.get_close_matches(word.lower(), list(COMMANDS), n=1)
    if close:
        hint = f"did you mean '{close[0]}'?"
    elif f"--{word.lower()}" in FLAG_OPTIONS:
        hint = f"did you mean '--{word.lower()}'?"
    elif word.endswith((".yaml", ".yml")):
        hint = f"did you mean '--config {word}'?"
    else:
        hint = (f"control commands are {', '.join(CONTROL_COMMANDS)}; the others are train, "
                f"{', '.join(FORWARDED)}; overrides look like section.key=value")
    return f"unknown command {word!r}: {hint}\nusage: {USAGE}"


def split_command(argv: list[str]) -> tuple[str, list[str]]:
    """The command of a command line in any accepted form, and its arguments.

    ``--mode regenerate`` names the command; otherwise the first word (:func:`first_word`) does
    wherever it stands; no word, or an override, is ``train``; ``-h`` alone is ``help`` (the list of commands).

    Raises:
        UnknownCommand: the first word is neither a command nor an override.
    """
    mode = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    mode.add_argument("--mode", choices=("train", "regenerate"))
    known, rest = mode.parse_known_args(argv)
    if known.mode is not None:
        return known.mode, rest
    word = first_word(argv)
    if argv and all(a in ("-h", "--help") for a in argv):
        return "help", []
    if word is None or "=" in word:
        return "train", argv
    if word not in COMMANDS:
        raise UnknownCommand(unknown_command(word))
    at = argv.index(word)
    return word, argv[:at] + argv[at + 1:]


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse a command line (any form, :func:`split_command`) into its command's namespace:
    ``command``, the command's options, and ``args`` (the unparsed rest) for a forwarded one.

    Raises:
        UnknownCommand: see :func:`split_command`.
        SystemExit: argparse's exit for a bad command line (2) or ``--help`` (0).
    """
    command, rest = split_command(list(argv))
    parser, subparsers = build_parser()
    if command == "help":
        parser.parse_args(["--help"])
    if command in FORWARDED:
        return argparse.Namespace(command=command, args=rest)
    args = subparsers[command].parse_intermixed_args(rest)
    args.command = command
    return args


# --------------------------------------------------------------------------- the entries

def train(args: argparse.Namespace) -> int:
    """``train``: :func:`launch.train.run`."""
    from launch.train import run

    return run(args)


def control(args: argparse.Namespace) -> int:
    """``status | restart WORKER | stop | attach WORKER`` against the running cluster of
    ``--run-dir`` (or of ``--config``'s run directory).

    Returns:
        0 done (``attach`` does not return: this process becomes the worker), 1 no running cluster
        or the coordinator refused, :data:`EXIT_CONFIG` (2) a bad config or a run directory that
        does not exist, :data:`EXIT_BROKEN_PIPE` when stdout was closed early.
    """
    from dflash.config import ConfigError, load_config
    from dflash.logs import setup_logging
    from launch.status import attach_here, control_request, show_reply

    setup_logging("ctl")
    worker = getattr(args, "worker", None)
    try:
        run_dir = Path(args.run_dir or load_config(args.config, args.overrides, gpu_count=0).resolved_run_dir())
    except ConfigError as exc:
        log.error("config error: %s", exc)
        return EXIT_CONFIG
    if not run_dir.is_dir():
        log.error("no running cluster: %s does not exist", run_dir.resolve())
        return EXIT_CONFIG
    try:
        cmd = "detach" if args.command == "attach" else args.command
        reply = control_request(run_dir.resolve(), cmd, {"worker": worker} if worker else {})
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    if not reply["ok"]:
        log.error("%s", reply["text"])
        return 1
    code = show_reply(reply, args.json)
    if code or args.command != "attach":
        return code
    attach_here(run_dir.resolve(), worker)
    return 0  # not reached


def forward(args: argparse.Namespace) -> int:
    """``regenerate | speculate | export | data``: that module's ``main`` with the arguments as given."""
    import importlib

    module = importlib.import_module(FORWARDED[args.command][0])
    return module.main(args.args, prog=f"{PROG} {args.command}")


#: Command name -> entry (takes the parsed namespace, returns the exit code).
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "train": train, **{name: control for name in CONTROL_COMMANDS}, **{name: forward for name in FORWARDED}}


def main(argv: Optional[list[str]] = None) -> int:
    """The CLI: parse (:func:`parse_args`) and run the command's entry (:data:`COMMANDS`).

    Returns:
        The entry's exit code (:func:`launch.train.run`, :func:`control`, the forwarded module's
        ``main``); :data:`EXIT_CONFIG` (2) for an unknown command, before any config loads.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
    except UnknownCommand as exc:
        from dflash.logs import setup_logging

        setup_logging("cluster")
        log.error("%s", exc)
        return EXIT_CONFIG
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
