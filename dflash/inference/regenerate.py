"""Data regeneration: the target rewrites the assistant turns of the training conversations.

DFlash trains on responses the target generated itself (docs/DFLASH.md, Recipe): a drafter trained on another
model's responses accepts less. This module replaces every assistant turn of ``data.dataset`` with the
target's own response and writes a JSONL file the trainer reads directly (``data.dataset=<output>``).

``python -m dflash.inference.regenerate --config configs/X.yaml --output data/regen.jsonl [--max-new-tokens 256]
[--temperature 0] [--top-p 1] [--seed 0] [--limit 200] [--batch-size 16] [--max-turns K]
[--max-prompt-tokens T] [--gpus 0,1] [--overwrite] [section.key=value ...]`` (also ``python -m launch.cluster
--mode regenerate ...``). As the first stage of training: the config's ``regenerate`` section
(:class:`dflash.config.RegenerateConfig`, off by default) makes ``python -m launch.cluster --config X.yaml``
call :func:`run_stage` before it trains, on ``regenerate.output``.

**What is generated.** Each assistant turn is regenerated given the conversation so far, rendered with
the target's chat template (``data.enable_thinking`` passed to it) and ``add_generation_prompt``, where
earlier assistant turns are *already the regenerated ones* (as SpecForge / DFlash regeneration does);
system and user turns are kept verbatim. A conversation ends at its last regenerated turn, and stops
early (keeping the turns done so far) when ``--max-turns`` turns are done, when the next prompt is
``--max-prompt-tokens`` tokens or longer (default ``data.max_length``: the trainer cuts longer
sequences anyway, so later turns would be wasted work), when a response is empty, or when the
template fails. Leading assistant turns (ShareGPT continuation rows: nothing to answer) are dropped.
Greedy (``--temperature 0``, the default) takes the argmax, which is the target's own greedy
continuation, through :class:`StaticGreedyGenerator` (:class:`dflash.inference.generation.Generator`);
sampling keeps :class:`BatchGenerator` and uses temperature and top-p with one ``torch.Generator`` per (seed, row id, turn), so a
sampled row does not depend on batching, sharding or restarts. A turn ends at the tokenizer's
end-of-turn / EOS token (not stored: the template adds it back) or after ``--max-new-tokens``.
Token ids the tokenizer does not have (padding rows of the embedding) are never generated.
Responses are decoded with special tokens kept, so that re-tokenising the stored text gives the
generated ids back; rows count the turns where it does not (``regen.retokenize_mismatch``).

**Batching.** A worker keeps up to ``--batch-size`` conversations active; each round generates the
next turn of every active conversation in one batch, and refills the pool from its queue as
conversations finish. Greedy: the static KV cache of :class:`dflash.inference.generation.Generator`, one row
per conversation, its step compiled into a CUDA graph on GPU (``target.compile``); the worker sorts
its rows by first-prompt length so that a batch holds prompts of similar length, and prompts of
:data:`SHORT_PROMPT_TOKENS` tokens or more go to a second, eager cache sized for
``--max-prompt-tokens`` (see :class:`StaticGreedyGenerator`). Sampling: one left-padded batch with
the Hugging Face causal LM called step by step (:class:`BatchGenerator`); left padding is exact for
attention layers (padded keys are masked, positions restart at 0 at each row's first token).
Workers log rows, new tokens/s and an ETA at least every 30 s; the launcher shows the same over all
workers, with each worker's rate.

**Files.** ``<output>`` (the merged result), ``<output>.rank<k>`` (worker k's shard, appended),
``<output>.rank<k>.log`` (its log), ``<output>.skipped`` (the skip records of merged shards),
``<output>.regen.json`` (options, checked on restart, and the last run's report: rows, skips,
new tokens, overall new tokens/s and ``per_worker`` rows, new tokens, seconds and new tokens/s),
``<output>.lock``. Every line is one JSON object with a stable ``id``:

* a regenerated row (ShareGPT form, read by :func:`dflash.data.corpus.normalize_row`):
  ``{"id", "conversations": [{"from": "system"|"human"|"gpt", "value"}], "regen": {"source_index",
  "turns", "new_tokens": [..], "finish": ["stop"|"length", ..], "retokenize_mismatch"}}``;
* a skipped row (shards and ``<output>.skipped``; never in ``<output>``): ``{"id", "skipped": reason,
  "regen": {"source_index"}}``, reasons :data:`SKIP_REASONS`. Skips are deterministic, so they count as
  done, also after a merge: a complete output starts no worker and is not rewritten.

**Ids.** The row's ``id`` field when it is a non-empty string or a number, else the first 16 hex digits of
the sha256 of its canonical JSON; the k-th repeat (k >= 1) of an id in file order becomes ``id#k``.
Rows that :func:`dflash.data.corpus.normalize_row` rejects are counted by reason and never sent to a worker.

**Sharding and resume.** Worker k of N (one per ``--gpus`` entry, default ``cluster.targets``; the
training stage uses ``cluster.targets`` + ``cluster.drafters``) owns the rows whose
``sha256(id) mod N == k``, loads the target on ``cuda:<gpus[k]>`` (CPU: cores / N torch threads; the
training layout's ``cluster.cpu_threads_per_target`` is not used), and appends finished rows to its own shard, one ``os.write`` plus
``fsync`` per round, under an exclusive ``flock`` on the shard. Rows already in ``<output>`` or in any
shard (of any earlier N) are done and skipped. A worker first truncates its own shard after the last
newline, so a line cut by a kill mid-write is dropped and regenerated, never duplicated. When every
worker has finished, the launcher merges ``<output>`` and the shards into a temporary file in source
order (an id once), renames it over ``<output>`` (skips into ``<output>.skipped``) and deletes the shards. Workers are separate
processes (``subprocess``, never a fork of a process holding CUDA) with a parent-death signal, so
none outlives the launcher; a restarted launcher waits (bounded) for the shard locks of a previous
run's workers before it reads the shards.

Known limits: sharding by id balances the rows, not the work, and a restart keeps the same owners (a
shard that had finished idles); a response cut at ``--max-new-tokens`` is kept (``finish: length``);
a greedy batch runs until its longest row ends (finished rows ride along on the static cache) and
each prompt's prefill is its own eager forward; a worker's ETA is optimistic early on (short prompts first);
thinking templates that strip earlier turns' reasoning are rendered as the template does.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import inspect
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from jinja2.exceptions import TemplateError

from dflash.config import ConfigError, RunConfig, load_config, resolve_device
from dflash.logs import setup_logging

__all__ = [
    "SKIP_REASONS",
    "GenerationOptions",
    "SourceRow",
    "Generated",
    "BatchGenerator",
    "StaticGreedyGenerator",
    "limit_vocab",
    "prompt_chars",
    "ConversationJob",
    "iter_source",
    "row_id",
    "shard_of",
    "shard_path",
    "read_lines",
    "recover_shard",
    "stop_token_ids",
    "turn_seed",
    "merge_outputs",
    "run_stage",
    "stage_workers",
    "main",
]

log = logging.getLogger("dflash.inference.regenerate")

#: Exit codes of the launcher.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
#: Seconds between two polls of the shard files by the launcher (progress, worker exits).
POLL_S = 0.5
#: Longest wait for a previous run's worker to release its shard lock (seconds).
LOCK_WAIT_S = 60.0
#: Seconds a worker gets to exit after SIGTERM before SIGKILL.
STOP_GRACE_S = 20.0
#: Lines of a failed worker's log shown by the launcher.
LOG_TAIL_LINES = 30
#: Hex digits of the sha256 used as the id of a row without an ``id`` field.
HASH_ID_CHARS = 16
SHARD_INFIX = ".rank"
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_BATCH_SIZE = 16

# Why a row is skipped (a line in a shard, never in the output).
NO_USER_TURN = "no_user_turn"          # only assistant turns before the first user turn
PROMPT_TOO_LONG = "prompt_too_long"    # the first prompt alone reaches --max-prompt-tokens
EMPTY_RESPONSE = "empty_response"      # the first regenerated turn is empty or only whitespace
TEMPLATE_ERROR = "template_error"      # the chat template raised on the first prompt
SKIP_REASONS = (NO_USER_TURN, PROMPT_TOO_LONG, EMPTY_RESPONSE, TEMPLATE_ERROR)
#: Reason a source row with tool calls or tool turns is not regenerated (counted with the reader's reasons).
TOOL_CALLS = "tool_calls"

#: Roles written in the output (ShareGPT ``from`` values).
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}
#: Options that must match for a restart to continue an existing output.
RESUME_KEYS = ("dataset", "target", "tokenizer", "enable_thinking", "max_new_tokens", "temperature", "top_p",
               "seed", "max_turns", "max_prompt_tokens")
#: Compared on a restart only when the previous run recorded them: what the tokenizer and its chat
#: template are (``dflash.training.checkpoint.run_identity``), not only how they were named.
IDENTITY_KEYS = ("tokenizer.sha256", "chat_template.sha256")


# --------------------------------------------------------------------------- options and source rows


@dataclass
class GenerationOptions:
    """How responses are generated (the command line of this module).

    ``temperature == 0`` is greedy; ``top_p`` in (0, 1] (1 = off); ``max_turns`` = None regenerates
    every assistant turn; ``max_prompt_tokens`` (tokens) stops a conversation before a longer prompt.
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = DEFAULT_BATCH_SIZE
    max_turns: Optional[int] = None
    max_prompt_tokens: int = 3072
    enable_thinking: Optional[bool] = None

    def check(self) -> None:
        """Raises:
            ConfigError: a value out of range (the message names the option)."""
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens: must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"--temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p: must be in (0, 1], got {self.top_p}")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size: must be >= 1, got {self.batch_size}")
        if self.max_turns is not None and self.max_turns < 1:
            raise ConfigError(f"--max-turns: must be >= 1, got {self.max_turns}")
        if self.max_prompt_tokens < 1:
            raise ConfigError(f"--max-prompt-tokens: must be >= 1, got {self.max_prompt_tokens}")


@dataclass
class SourceRow:
    """One usable source conversation: its position in the file, stable id and normalised turns."""

    index: int
    id: str
    messages: list[dict[str, str]]


def row_id(row: Any) -> str:
    """The stable id of a source row (before de-duplication).

    The ``id`` field when it is a non-empty string or an integer, else the first
    :data:`HASH_ID_CHARS` hex digits of the sha256 of the row's canonical JSON (sorted keys).
    """
    if isinstance(row, dict):
        value = row.get("id")
        if isinstance(value, str) and value.strip():
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
    canonical = json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:HASH_ID_CHARS]


def iter_source(dataset: str, limit: Optional[int], dropped: Optional[dict[str, int]] = None) -> Iterator[SourceRow]:
    """Usable rows of ``dataset`` (``sharegpt`` or a JSONL path) in file order, at most ``limit`` rows read.

    Ids come from :func:`row_id`; the k-th repeat of an id (counting every row read, usable or not)
    becomes ``id#k``. Rows :func:`dflash.data.corpus.normalize_row` rejects, and rows with tool calls or tool
    turns (``tool_calls``: a regenerated tool call would need the tool run again), are not yielded;
    their reasons are counted into ``dropped``. Never raises on a bad row.

    Raises:
        ConfigError: ``dataset`` is neither ``sharegpt`` nor an existing file.
    """
    from dflash.data.corpus import normalize_row, read_rows

    seen: dict[str, int] = {}
    for index, row in enumerate(read_rows(dataset, limit)):
        base = row_id(row)
        repeat = seen.get(base, 0)
        seen[base] = repeat + 1
        messages, reason = normalize_row(row)
        if messages is not None and any(m["role"] == "tool" or "tool_calls" in m for m in messages):
            messages, reason = None, TOOL_CALLS  # the tools cannot be run again for new calls
        if messages is None:
            if dropped is not None:
                dropped[reason] = dropped.get(reason, 0) + 1
            continue
        yield SourceRow(index, base if repeat == 0 else f"{base}#{repeat}", messages)


def shard_of(rid: str, world: int) -> int:
    """The worker rank (0 ≤ rank < ``world``) that owns row id ``rid``: ``sha256(rid) mod world``."""
    return int.from_bytes(hashlib.sha256(rid.encode("utf-8")).digest()[:8], "little") % world


def turn_seed(seed: int, rid: str, turn: int) -> int:
    """The sampling seed of turn ``turn`` (0-based) of row ``rid``: 63 bits of a sha256."""
    digest = hashlib.sha256(f"{seed}\0{rid}\0{turn}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# --------------------------------------------------------------------------- files


def shard_path(output: Path, rank: int) -> Path:
    """``<output>.rank<rank>``: worker ``rank``'s shard."""
    return output.with_name(f"{output.name}{SHARD_INFIX}{rank}")


def existing_shards(output: Path) -> list[Path]:
    """Every shard of ``output`` on disk (any rank, any earlier worker count), by rank."""
    prefix = output.name + SHARD_INFIX
    found = []
    if output.parent.is_dir():
        for p in output.parent.iterdir():
            suffix = p.name[len(prefix):]
            if p.name.startswith(prefix) and suffix.isdigit() and p.is_file():
                found.append((int(suffix), p))
    return [p for _, p in sorted(found)]


def read_lines(path: Path, start: int = 0) -> tuple[list[dict], int, int]:
    """Complete JSON-object lines of ``path`` from byte ``start``.

    A trailing piece without a newline (a write cut by a kill) is not read; a complete line that
    does not parse as a JSON object with an ``id`` is skipped and counted.

    Returns:
        ``(records, end, bad)``: the records, the byte offset just after the last complete line
        (``start`` when there is none; 0 when the file does not exist) and the count of bad lines.
    """
    if not path.is_file():
        return [], 0, 0
    with open(path, "rb") as handle:
        handle.seek(start)
        data = handle.read()
    cut = data.rfind(b"\n") + 1
    records: list[dict] = []
    bad = 0
    for raw in data[:cut].split(b"\n"):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            bad += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("id"), str):
            records.append(record)
        else:
            bad += 1
    return records, start + cut, bad


def _lock(fd: int, timeout_s: float, what: str) -> None:
    """Take an exclusive ``flock`` on ``fd``, polling until ``timeout_s``.

    Raises:
        TimeoutError: still held by another process after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{what} is still locked by another process after {timeout_s:.0f} s") from None
            time.sleep(0.1)  # polling a lock with a deadline


def recover_shard(path: Path, timeout_s: float = LOCK_WAIT_S) -> int:
    """Open (create) a worker's shard for appending under an exclusive lock; drop a cut last line.

    The file is truncated just after its last newline, so a line cut by a kill mid-write disappears
    (its row is regenerated, once). The lock is held until the returned descriptor is closed.

    Returns:
        the file descriptor (``O_WRONLY | O_APPEND``).
    Raises:
        TimeoutError: another process holds the shard's lock for ``timeout_s`` seconds.
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        _lock(fd, timeout_s, str(path))
        _, end, _ = read_lines(path)
        size = os.fstat(fd).st_size
        if size != end:
            log.warning("%s: dropping %d bytes of a line cut mid-write", path, size - end)
            os.ftruncate(fd, end)
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def append_records(fd: int, records: list[dict]) -> None:
    """Append ``records`` as JSON lines with one write call (retried until complete), then ``fsync``."""
    data = b"".join((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8") for r in records)
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
    os.fsync(fd)


def skipped_path(output: Path) -> Path:
    """``<output>.skipped``: the skip records of merged shards (rows that will never be in ``<output>``)."""
    return output.with_name(output.name + ".skipped")


def done_ids(output: Path) -> set[str]:
    """Ids already finished: every complete line of ``<output>``, of ``<output>.skipped`` and of every shard."""
    done: set[str] = set()
    for path in [output, skipped_path(output), *existing_shards(output)]:
        records, _, _ = read_lines(path)
        done.update(r["id"] for r in records)
    return done


@dataclass
class MergeReport:
    """What a merge wrote: rows, skipped rows by reason, lines seen twice, unreadable lines."""

    rows: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    bad_lines: int = 0
    new_tokens: int = 0


def merge_outputs(output: Path) -> MergeReport:
    """Merge ``<output>`` and its shards into ``<output>`` (atomically), then delete the shards.

    Rows are ordered by ``regen.source_index`` (rows without one keep their order, last); an id is
    written once (the first seen: ``<output>`` first, then ``<output>.skipped``, then shards by
    rank) and later copies are counted as duplicates. Skip records are counted and kept in
    ``<output>.skipped`` (so that a later run does not check those rows again). Without shards
    nothing is rewritten: ``<output>`` keeps its bytes and modification time (a complete output
    stays valid for every cache keyed on it).
    """
    report = MergeReport()
    seen: set[str] = set()
    rows: list[tuple[int, int, dict]] = []
    skips: list[dict] = []
    shards = existing_shards(output)
    for path in [output, skipped_path(output), *shards]:
        records, _, bad = read_lines(path)
        report.bad_lines += bad
        for record in records:
            if record["id"] in seen:
                report.duplicates += 1
                continue
            seen.add(record["id"])
            if "skipped" in record:
                reason = str(record["skipped"])
                report.skipped[reason] = report.skipped.get(reason, 0) + 1
                skips.append(record)
                continue
            meta = record.get("regen") if isinstance(record.get("regen"), dict) else {}
            index = meta.get("source_index")
            report.new_tokens += sum(meta.get("new_tokens", []) or [])
            rows.append((0 if isinstance(index, int) else 1, index if isinstance(index, int) else len(rows), record))
    report.rows = len(rows)
    if not shards and output.exists():
        return report
    rows.sort(key=lambda item: (item[0], item[1]))
    _write_atomically(skipped_path(output), skips)  # first: a kill between the two renames loses no skip
    _write_atomically(output, [record for _, _, record in rows])
    for path in shards:
        path.unlink()
    return report


def _write_atomically(path: Path, records: list[dict]) -> None:
    """Write ``records`` as JSON lines to a temporary file, fsync, rename over ``path``, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        for record in records:
            handle.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# --------------------------------------------------------------------------- generation


def stop_token_ids(tokenizer: Any, model: Any = None) -> list[int]:
    """Ids that end a turn: the tokenizer's end-of-turn tokens and EOS, plus the model's
    ``generation_config.eos_token_id`` when ``model`` is given (pass None for a random target, whose
    generation config is a default that knows nothing of the tokenizer)."""
    from dflash.data.corpus import end_of_turn_tokens

    ids = {int(tokenizer.convert_tokens_to_ids(t)) for t in end_of_turn_tokens(tokenizer)}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None) if model is not None else None
    eos = getattr(gen, "eos_token_id", None)
    for value in (eos if isinstance(eos, (list, tuple)) else [eos]):
        if isinstance(value, int):
            ids.add(value)
    return sorted(i for i in ids if i >= 0)


@dataclass
class Generated:
    """One generated turn: ``ids`` (the new tokens, the stop token excluded) and why it ended
    (``stop``: a stop token; ``length``: ``max_new_tokens`` reached)."""

    ids: list[int]
    finish: str


class BatchGenerator:
    """Left-padded batched generation with a KV cache, greedy or temperature / top-p sampling.

    Calls the Hugging Face causal LM ``model`` step by step (``logits_to_keep=1``, explicit
    ``position_ids`` that restart at each row's first real token, 2-D attention mask). Logits of ids
    ``>= vocab_limit`` (embedding rows without a token) are set to -inf before choosing.

    Args:
        model: a transformers causal LM in eval mode (``target.model``).
        stop_ids: ids that end a turn.
        pad_id: id written in padding positions (masked, any valid id).
        vocab_limit: the tokenizer's size (``len(tokenizer)``).
    """

    def __init__(self, model: Any, stop_ids: list[int], pad_id: int, vocab_limit: int) -> None:
        self.model = model
        self.stop_ids = set(stop_ids)
        self.fill_id = stop_ids[0] if stop_ids else pad_id
        self.pad_id = pad_id
        self.vocab_limit = vocab_limit
        self.device = next(model.parameters()).device
        # transformers renamed ``past_key_values`` to ``cache`` (5.24 has ``cache``, older 5.x the old name).
        params = inspect.signature(model.forward).parameters
        self.cache_key = "cache" if "cache" in params else "past_key_values"

    def _choose(self, logits: torch.Tensor, temperature: float, top_p: float,
                generators: Optional[list[torch.Generator]]) -> torch.Tensor:
        """Next token per row from ``logits`` ``[B, V]`` → int64 ``[B]`` (argmax when temperature is 0)."""
        logits = logits.float()
        if logits.shape[-1] > self.vocab_limit:
            logits[:, self.vocab_limit:] = float("-inf")
        if temperature == 0:
            return logits.argmax(dim=-1)
        logits = logits / temperature
        if top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(dim=-1)
            # Drop a token when the tokens ranked before it already reach top_p (the first always stays).
            drop = (probs.cumsum(dim=-1) - probs) >= top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        if generators is None or len(generators) != probs.shape[0]:
            raise ValueError("sampling needs one generator per row")
        return torch.cat([torch.multinomial(probs[i:i + 1], 1, generator=g)[0] for i, g in enumerate(generators)])

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seeds: Optional[list[int]] = None) -> list[Generated]:
        """Generate one turn for each prompt.

        Args:
            prompts: B lists of token ids (each non-empty).
            max_new_tokens: at most this many new tokens per row (the stop token included).
            temperature: 0 = greedy; else sampling at this temperature.
            top_p: nucleus sampling mass (1 = off); only with ``temperature > 0``.
            seeds: one seed per row (required when sampling): row i samples from its own generator.
        Returns:
            B :class:`Generated`, in prompt order.
        Raises:
            ValueError: an empty prompt, or sampling without one seed per row.
        """
        if any(len(p) == 0 for p in prompts):
            raise ValueError("generate: every prompt needs at least one token")
        generators = None
        if temperature > 0:
            if seeds is None or len(seeds) != len(prompts):
                raise ValueError("generate: sampling needs one seed per prompt")
            generators = [torch.Generator(device=self.device).manual_seed(s) for s in seeds]
        rows, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1)
        new: list[list[int]] = [[] for _ in range(rows)]
        finish = ["length"] * rows
        active = list(range(rows))
        for step in range(max_new_tokens):
            chosen = self._choose(out.logits[:, -1, :], temperature, top_p, generators)
            host = chosen.tolist()
            still = []
            for i in active:
                if host[i] in self.stop_ids:
                    finish[i] = "stop"
                else:
                    new[i].append(host[i])
                    still.append(i)
            active = still
            if not active or step + 1 == max_new_tokens:
                break
            # Finished rows keep running on a filler token; their outputs are ignored.
            done = torch.ones(rows, dtype=torch.bool)
            done[active] = False
            chosen = chosen.masked_fill(done.to(self.device), self.fill_id)
            mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
            positions = positions[:, -1:] + 1
            cache = out.get(self.cache_key)
            if cache is None:
                raise RuntimeError(f"{type(self.model).__name__} returned no {self.cache_key}: cannot generate with a cache")
            out = self.model(input_ids=chosen[:, None], attention_mask=mask, position_ids=positions, use_cache=True,
                             **{self.cache_key: cache})
        return [Generated(ids, f) for ids, f in zip(new, finish)]


#: Positions of the static cache beyond the longest prompt allowed plus ``max_new_tokens``
#: (:class:`dflash.inference.generation.Generator` keeps a few slots past a row's last token).
STATIC_SLACK = 8
#: Prompts shorter than this (tokens) use :class:`StaticGreedyGenerator`'s short cache.
SHORT_PROMPT_TOKENS = 512


def limit_vocab(model: Any, vocab_limit: int) -> None:
    """Make ``model``'s output embedding produce logits for ids ``< vocab_limit`` only.

    When the head has more rows than the tokenizer has tokens (embedding padding, e.g. Qwen3's
    151,936 rows for 151,669 tokens), it is replaced by a ``Linear`` over the first ``vocab_limit``
    rows of the same weight (a view: no copy, tied weights stay tied). An argmax over the kept
    logits equals :class:`BatchGenerator`'s argmax with the extra logits set to ``-inf`` (ties to
    the lowest id in both), so greedy output never holds an id the tokenizer lacks. A head that
    already fits is left alone.

    Raises:
        ValueError: ``vocab_limit < 1`` or a head without a 2-D ``weight``.
    """
    if vocab_limit < 1:
        raise ValueError(f"vocab_limit: must be >= 1, got {vocab_limit}")
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is None or weight.dim() != 2:
        raise ValueError(f"{type(model).__name__}: the output embedding has no [V, D] weight")
    if weight.shape[0] <= vocab_limit:
        return
    bias = getattr(head, "bias", None)
    cut = torch.nn.Linear(weight.shape[1], vocab_limit, bias=bias is not None, device=weight.device,
                          dtype=weight.dtype)
    cut.weight = torch.nn.Parameter(weight[:vocab_limit], requires_grad=False)
    if bias is not None:
        cut.bias = torch.nn.Parameter(bias[:vocab_limit], requires_grad=False)
    model.set_output_embeddings(cut)
    log.info("output embedding cut from %d to %d rows (the tokenizer's size)", weight.shape[0], vocab_limit)


class StaticGreedyGenerator:
    """Greedy generation through :class:`dflash.inference.generation.Generator` (static KV cache, fixed
    shapes; on CUDA a compiled step replayed as a CUDA graph): the :meth:`generate` contract of
    :class:`BatchGenerator` at temperature 0.

    Every step attends over the whole static cache, so its cost grows with ``max_len``, not with
    the prompts. Two caches keep it small for most rows: prompts shorter than
    ``short_prompt_tokens`` (most ShareGPT first turns: median 56 SmolLM2 tokens, 90 % under 627)
    run in the *short* generator (``max_len = short_prompt_tokens − 1 + max_new_tokens +``
    :data:`STATIC_SLACK`, compiled when ``compile``); longer ones, up to ``max_prompt_tokens − 1``
    (:class:`ConversationJob` never asks for more), in the *long* generator (``max_prompt_tokens``
    in place of ``short_prompt_tokens``), built on first use and always eager: it serves few
    batches, fewer than a second compilation would pay for. Callers that sort rows by prompt
    length (:func:`run_worker` does) give each call prompts of one kind.

    Ids the tokenizer lacks are cut off the head (:func:`limit_vocab`; the model is changed in
    place) and every returned id is checked against ``vocab_limit``.

    Args:
        model: a transformers causal LM in eval mode (``target.model``), on its device.
        stop_ids: ids that end a turn.
        vocab_limit: the tokenizer's size (``len(tokenizer)``).
        batch_size: rows of each static cache (most prompts per :meth:`generate` call).
        max_prompt_tokens: prompts are shorter than this (tokens).
        max_new_tokens: the most new tokens per call.
        short_prompt_tokens: prompts shorter than this use the short cache (``None`` or
            ``>= max_prompt_tokens``: one cache for all).
        compile: compile the short generator's step (CUDA graphs); ``None`` = on CUDA only.

    Raises:
        ValueError: see :class:`dflash.inference.generation.Generator` and :func:`limit_vocab`.
    """

    def __init__(self, model: Any, stop_ids: list[int], vocab_limit: int, batch_size: int, max_prompt_tokens: int,
                 max_new_tokens: int, short_prompt_tokens: Optional[int] = SHORT_PROMPT_TOKENS,
                 compile: Optional[bool] = None) -> None:
        from dflash.inference.generation import Generator

        limit_vocab(model, vocab_limit)
        self.model = model
        self.stop_ids = sorted(set(stop_ids))
        self.vocab_limit = vocab_limit
        self.batch_size = batch_size
        self.max_prompt_tokens = max_prompt_tokens
        self.max_new_tokens = max_new_tokens
        if short_prompt_tokens is None or short_prompt_tokens >= max_prompt_tokens:
            short_prompt_tokens = max_prompt_tokens
        self.short_prompt_tokens = short_prompt_tokens
        self.short = Generator(model, [], max_len=self._max_len(short_prompt_tokens), batch_size=batch_size,
                               compile=compile)
        self.long: Any = None

    def _max_len(self, prompt_tokens: int) -> int:
        return prompt_tokens - 1 + self.max_new_tokens + STATIC_SLACK

    def _long(self) -> Any:
        if self.long is None:
            from dflash.inference.generation import Generator

            self.long = Generator(self.model, [], max_len=self._max_len(self.max_prompt_tokens),
                                  batch_size=self.batch_size, compile=False)
        return self.long

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seeds: Optional[list[int]] = None) -> list[Generated]:
        """Greedy turn for each prompt (``top_p`` and ``seeds`` are ignored: greedy needs neither).

        Returns:
            B :class:`Generated`, in prompt order (the stop token excluded, as :class:`BatchGenerator`).
        Raises:
            ValueError: ``temperature != 0``, ``max_new_tokens`` above the constructor's, more prompts
                than ``batch_size``, an empty prompt or one of ``max_prompt_tokens`` tokens or more.
            RuntimeError: an id ``>= vocab_limit`` was generated (a head :func:`limit_vocab` did not cut).
        """
        if temperature != 0:
            raise ValueError(f"temperature: StaticGreedyGenerator is greedy only, got {temperature}")
        if max_new_tokens > self.max_new_tokens:
            raise ValueError(f"max_new_tokens: {max_new_tokens} exceeds the cache's {self.max_new_tokens}")
        if len(prompts) > self.batch_size:
            raise ValueError(f"prompts: at most {self.batch_size} (the batch size), got {len(prompts)}")
        for i, p in enumerate(prompts):
            if not 0 < len(p) < self.max_prompt_tokens:
                raise ValueError(f"prompts[{i}]: need 1..{self.max_prompt_tokens - 1} tokens, got {len(p)}")
        out: list[Optional[Generated]] = [None] * len(prompts)
        short = [i for i, p in enumerate(prompts) if len(p) < self.short_prompt_tokens]
        long = [i for i, p in enumerate(prompts) if len(p) >= self.short_prompt_tokens]
        for rows, generator in ((short, self.short), (long, self.long if not long else self._long())):
            if not rows:
                continue
            runs = generator.greedy([torch.tensor(prompts[i], dtype=torch.long) for i in rows], max_new_tokens,
                                    self.stop_ids)
            for i, run in zip(rows, runs):
                out[i] = self._generated(list(run.tokens))
        return out  # type: ignore[return-value]

    def _generated(self, ids: list[int]) -> Generated:
        if any(t >= self.vocab_limit for t in ids):
            raise RuntimeError(f"generated an id >= the tokenizer's size {self.vocab_limit}: {max(ids)}")
        if ids and ids[-1] in self.stop_ids:
            return Generated(ids[:-1], "stop")
        return Generated(ids, "length")


def prompt_chars(row: SourceRow) -> int:
    """Characters of ``row``'s first prompt (every message before its first assistant turn that
    follows a user turn): the sort key that batches prompts of similar length together."""
    total, seen_user = 0, False
    for message in row.messages:
        if message["role"] == "assistant" and seen_user:
            break
        seen_user = seen_user or message["role"] == "user"
        total += len(message.get("content") or "")
    return total


class ConversationJob:
    """One conversation being regenerated turn by turn (see the module doc for the rules).

    ``messages`` grows with the kept system/user turns and the regenerated assistant turns;
    :meth:`next_prompt` gives the token ids of the next prompt (or None when the conversation is
    finished) and :meth:`accept` takes the generated turn.
    """

    def __init__(self, row: SourceRow, tokenizer: Any, options: GenerationOptions) -> None:
        self.row = row
        self.tokenizer = tokenizer
        self.options = options
        self.messages: list[dict[str, str]] = []
        self.cursor = 0  # next source message to look at
        self.turns = 0
        self.new_tokens: list[int] = []
        self.finish: list[str] = []
        self.retokenize_mismatch = 0
        self.stop_reason: Optional[str] = None
        self.done = False
        self.template_kwargs: dict[str, Any] = {}
        if options.enable_thinking is not None:
            self.template_kwargs["enable_thinking"] = options.enable_thinking

    def _stop(self, reason: Optional[str]) -> None:
        self.done = True
        if self.turns == 0:
            self.stop_reason = reason or NO_USER_TURN

    def next_prompt(self) -> Optional[list[int]]:
        """Token ids of the prompt for the next assistant turn, or None (then :attr:`done` is set)."""
        if self.done:
            return None
        if self.options.max_turns is not None and self.turns >= self.options.max_turns:
            self._stop(None)
            return None
        source = self.row.messages
        while self.cursor < len(source):
            message = source[self.cursor]
            if message["role"] != "assistant":
                self.messages.append(dict(message))
                self.cursor += 1
                continue
            if not any(m["role"] == "user" for m in self.messages):
                self.cursor += 1  # a leading assistant turn answers nothing here: dropped
                continue
            try:
                text = self.tokenizer.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True,
                                                          **self.template_kwargs)
            except (TemplateError, TypeError, ValueError, KeyError) as exc:
                log.debug("%s: chat template failed: %s", self.row.id, exc)
                self._stop(TEMPLATE_ERROR)
                return None
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) >= self.options.max_prompt_tokens:
                self._stop(PROMPT_TOO_LONG)
                return None
            return ids
        self._stop(None)
        return None

    def accept(self, generated: Generated) -> None:
        """Take the turn generated for the last :meth:`next_prompt`."""
        text = self.tokenizer.decode(generated.ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if not text.strip():
            self._stop(EMPTY_RESPONSE)
            return
        if self.tokenizer(text, add_special_tokens=False)["input_ids"] != generated.ids:
            self.retokenize_mismatch += 1
        self.messages.append({"role": "assistant", "content": text})
        self.cursor += 1
        self.turns += 1
        self.new_tokens.append(len(generated.ids) + (generated.finish == "stop"))
        self.finish.append(generated.finish)

    def record(self) -> dict:
        """The output line of a finished job: a regenerated row, or a skip record."""
        meta: dict[str, Any] = {"source_index": self.row.index}
        if self.turns == 0:
            return {"id": self.row.id, "skipped": self.stop_reason or NO_USER_TURN, "regen": meta}
        last = max(i for i, m in enumerate(self.messages) if m["role"] == "assistant")
        conversation = [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in self.messages[:last + 1]]
        meta.update(turns=self.turns, new_tokens=self.new_tokens, finish=self.finish,
                    retokenize_mismatch=self.retokenize_mismatch)
        return {"id": self.row.id, "conversations": conversation, "regen": meta}


def regenerate_rows(rows: list[SourceRow], generator: BatchGenerator, tokenizer: Any, options: GenerationOptions,
                    ) -> Iterator[list[dict]]:
    """Regenerate ``rows``; yield the records of the conversations that finish, as soon as they do.

    A pool of at most ``options.batch_size`` active conversations, each with its next prompt ready,
    generates one turn per round (one batch); finished conversations leave the pool and the queue
    refills it. Rows skipped before any generation are yielded before the round that replaces them.
    """
    queue = list(reversed(rows))
    active: list[tuple[ConversationJob, list[int]]] = []
    while queue or active:
        skipped: list[dict] = []
        while len(active) < options.batch_size and queue:
            job = ConversationJob(queue.pop(), tokenizer, options)
            prompt = job.next_prompt()
            if prompt is None:
                skipped.append(job.record())
            else:
                active.append((job, prompt))
        if skipped:
            yield skipped
        if not active:
            continue
        seeds = [turn_seed(options.seed, job.row.id, job.turns) for job, _ in active]
        outs = generator.generate([prompt for _, prompt in active], options.max_new_tokens, options.temperature,
                                  options.top_p, seeds)
        finished: list[dict] = []
        still: list[tuple[ConversationJob, list[int]]] = []
        for (job, _), out in zip(active, outs):
            job.accept(out)
            prompt = job.next_prompt()
            if prompt is None:
                finished.append(job.record())
            else:
                still.append((job, prompt))
        active = still
        if finished:
            yield finished


# --------------------------------------------------------------------------- worker


def _cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _on_sigterm(signum: int, _frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def _generate_shard(fd: int, rows: list[SourceRow], generator: Any, tokenizer: Any, options: GenerationOptions,
                    stats: dict[str, Any]) -> None:
    """Regenerate ``rows`` into the shard ``fd``; count rows, new tokens and seconds into ``stats``;
    a progress line (rows, new tokens/s, ETA) at least every 30 s."""
    from dflash.progress import Progress

    started = time.perf_counter()
    bar = Progress(len(rows), desc="regenerate", unit="row", logger=log)
    try:
        for records in regenerate_rows(rows, generator, tokenizer, options):
            append_records(fd, records)
            stats["rows"] += len(records)
            stats["new_tokens"] += sum(sum(r["regen"].get("new_tokens", [])) for r in records)
            rate = stats["new_tokens"] / max(time.perf_counter() - started, 1e-9)
            bar.update(stats["rows"], f"rows | {stats['new_tokens']} new tokens, {rate:.0f} new tok/s")
    finally:
        bar.close()
    stats["generate_s"] = time.perf_counter() - started
    stats["tokens_per_s"] = round(stats["new_tokens"] / max(stats["generate_s"], 1e-9), 1)


def run_worker(cfg: RunConfig, options: GenerationOptions, output: Path, rank: int, world: int,
               limit: Optional[int], gpus: Optional[list[int]] = None) -> int:
    """One worker process: load the target, regenerate the pending rows of shard ``rank``, append them.

    Runs on ``cuda:<gpus[rank]>`` (``gpus`` defaults to ``cluster.targets``) or the CPU. Greedy
    generation goes through :class:`StaticGreedyGenerator` (one per worker, ``options.batch_size``
    rows), sampling through :class:`BatchGenerator`. Logs a progress line (rows, new tokens/s, ETA)
    at least every 30 s and writes ``<output>.rank<rank>.stats.json`` (rows, new tokens, seconds,
    new tokens/s, device) at the end.

    Returns:
        0 when every row of the shard is written.
    Raises:
        TimeoutError: the shard stays locked by another process.
    """
    from dflash.training.factory import pad_token_id
    from dflash.models.target_loader import load_target
    from dflash.data.tokenizer import load_tokenizer

    if resolve_device(cfg) == "cuda":
        gpu = (gpus or cfg.cluster.targets)[rank]
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, _cores() // world))
    path = shard_path(output, rank)
    fd = recover_shard(path)
    try:
        done = done_ids(output)
        rows = [r for r in iter_source(cfg.data.dataset, limit) if shard_of(r.id, world) == rank and r.id not in done]
        log.info("shard %d/%d on %s (%d torch threads): %d rows to regenerate", rank, world, device,
                 torch.get_num_threads(), len(rows))
        stats: dict[str, Any] = {"rank": rank, "device": str(device), "rows": 0, "new_tokens": 0, "load_s": 0.0,
                                 "generate_s": 0.0, "tokens_per_s": None}
        if rows:
            started = time.perf_counter()
            tokenizer = load_tokenizer(cfg.target)
            target = load_target(cfg.target, device)
            model = target.model
            stop_ids = stop_token_ids(tokenizer, None if cfg.target.kind == "random" else model)
            if options.temperature == 0:
                rows.sort(key=prompt_chars)  # similar prompt lengths share a batch (and a cache)
                generator: Any = StaticGreedyGenerator(
                    model, stop_ids, len(tokenizer), min(options.batch_size, len(rows)), options.max_prompt_tokens,
                    options.max_new_tokens, compile=cfg.target.compile and device.type == "cuda")
            else:
                generator = BatchGenerator(model, stop_ids, pad_token_id(tokenizer), len(tokenizer))
            stats["load_s"] = time.perf_counter() - started
            _generate_shard(fd, rows, generator, tokenizer, options, stats)
            log.info("shard %d: %d rows, %d new tokens in %.1f s (%.1f new tokens/s)", rank, stats["rows"],
                     stats["new_tokens"], stats["generate_s"], stats["tokens_per_s"])
        stats_path = path.with_name(path.name + ".stats.json")
        stats_path.write_text(json.dumps(stats))
    finally:
        os.close(fd)
    return 0


# --------------------------------------------------------------------------- launcher


def _options_record(cfg: RunConfig, options: GenerationOptions) -> dict:
    t = cfg.target
    return {
        "dataset": cfg.data.dataset,
        "target": {"kind": t.kind, "path": t.path, "arch": t.arch, "arch_overrides": t.arch_overrides,
                   "dtype": t.dtype, "seed": t.seed},
        "tokenizer": t.tokenizer,
        "enable_thinking": options.enable_thinking,
        "max_new_tokens": options.max_new_tokens,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "seed": options.seed,
        "max_turns": options.max_turns,
        "max_prompt_tokens": options.max_prompt_tokens,
    }


def _stop_workers(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=STOP_GRACE_S)


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    if not path.is_file():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _worker_command(args: argparse.Namespace, rank: int, world: int) -> list[str]:
    cmd = [sys.executable, "-m", "dflash.inference.regenerate", "--config", str(args.config), "--output", str(args.output),
           "--max-new-tokens", str(args.max_new_tokens), "--temperature", repr(args.temperature),
           "--top-p", repr(args.top_p), "--seed", str(args.seed), "--batch-size", str(args.batch_size),
           "--worker-rank", str(rank), "--world", str(world)]
    if args.gpus is not None:
        cmd += ["--gpus", ",".join(str(g) for g in args.gpus)]
    for flag, value in (("--limit", args.limit), ("--max-turns", args.max_turns),
                        ("--max-prompt-tokens", args.max_prompt_tokens)):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd + list(args.overrides)


def run_launcher(args: argparse.Namespace, cfg: RunConfig, options: GenerationOptions) -> int:
    """Start one worker per ``cluster.targets`` entry, show progress, merge the shards.

    Returns:
        :data:`EXIT_OK`, :data:`EXIT_FAILED` (a worker failed; shards are kept for a restart) or
        :data:`EXIT_CONFIG` (options differ from the existing output's, output locked).
    """
    from dflash.progress import Progress

    output = Path(args.output).resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    lock_fd = os.open(output.with_name(output.name + ".lock"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.error("%s is being regenerated by another launcher", output)
            return EXIT_CONFIG
        return _launch_locked(args, cfg, options, output, Progress)
    finally:
        os.close(lock_fd)


def _launch_locked(args: argparse.Namespace, cfg: RunConfig, options: GenerationOptions, output: Path,
                   progress: Any) -> int:
    started = time.monotonic()
    sidecar = output.with_name(output.name + ".regen.json")
    wanted = _options_record(cfg, options)
    from dflash.training.checkpoint import run_identity
    from dflash.data.tokenizer import load_tokenizer

    identity = run_identity(load_tokenizer(cfg.target))
    wanted.update({k: identity[k] for k in IDENTITY_KEYS})
    if args.overwrite:
        for path in [output, sidecar, skipped_path(output), *existing_shards(output)]:
            path.unlink(missing_ok=True)
    if sidecar.is_file():
        previous = json.loads(sidecar.read_text()).get("options", {})
        diff = [k for k in RESUME_KEYS if previous.get(k) != wanted.get(k)]
        diff += [k for k in IDENTITY_KEYS if k in previous and previous[k] != wanted[k]]
        if diff:
            log.error("%s was made with other options (%s: %s, now %s): pass --overwrite or choose another --output",
                      output, diff[0], previous.get(diff[0]), wanted.get(diff[0]))
            return EXIT_CONFIG
    elif output.exists() or existing_shards(output):
        log.warning("%s has no %s: continuing it, assuming the same options", output, sidecar.name)
    # A previous launcher's workers may still be exiting: wait for their shard locks (bounded).
    for path in existing_shards(output):
        fd = os.open(path, os.O_RDONLY)
        try:
            _lock(fd, LOCK_WAIT_S, str(path))
        finally:
            os.close(fd)
    for stale in output.parent.glob(output.name + SHARD_INFIX + "*.stats.json"):
        stale.unlink()
    output.with_name(output.name + ".tmp").unlink(missing_ok=True)
    skipped_path(output).with_name(skipped_path(output).name + ".tmp").unlink(missing_ok=True)

    dropped: dict[str, int] = {}
    source = list(iter_source(cfg.data.dataset, args.limit, dropped))
    done = done_ids(output)
    pending = [r for r in source if r.id not in done]
    reasons = ", ".join(f"{k}={v}" for k, v in sorted(dropped.items())) or "none"
    log.info("%s: %d usable rows (dropped %d: %s); %d already done, %d to regenerate", cfg.data.dataset,
             len(source), sum(dropped.values()), reasons, len(source) - len(pending), len(pending))
    sidecar.write_text(json.dumps({"options": wanted}, indent=1))

    world = len(args.gpus or cfg.cluster.targets)
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    offsets = {shard_path(output, k): read_lines(shard_path(output, k))[1] for k in range(world)}
    new_tokens = [0] * world
    done_now = 0
    gen_started = time.monotonic()
    exit_code = EXIT_OK
    bar = progress(len(pending), desc="regenerate", unit="row")  # a live line, or a log line every 30 s
    try:
        if pending:
            for k in range(world):
                logs.append(shard_path(output, k).with_name(f"{output.name}{SHARD_INFIX}{k}.log"))
                env = dict(os.environ, DFLASH_WORKER=f"regen.{k}", PYTHONUNBUFFERED="1")
                with open(logs[-1], "ab") as log_file:
                    procs.append(subprocess.Popen(_worker_command(args, k, world), env=env, stdin=subprocess.DEVNULL,
                                                  stdout=log_file, stderr=subprocess.STDOUT))
                log.info("started regen.%d (pid %d), log %s", k, procs[-1].pid, logs[-1])
        while procs:
            codes = [p.poll() for p in procs]
            for k, (path, start) in enumerate(list(offsets.items())):
                records, end, _ = read_lines(path, start)
                offsets[path] = end
                for r in records:
                    meta = r.get("regen") if isinstance(r.get("regen"), dict) else {}
                    new_tokens[k] += sum(meta.get("new_tokens", []) or [])
                done_now += len(records)
            elapsed = max(time.monotonic() - gen_started, 1e-9)
            per_worker = ", ".join(f"regen.{k} {n / elapsed:.0f}" for k, n in enumerate(new_tokens))
            if done_now < len(pending) or done_now != bar.n:  # once complete, one line (workers are exiting)
                bar.update(done_now, f"rows | {sum(new_tokens) / elapsed:.0f} new tok/s ({per_worker})")
            failed = [k for k, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                k = failed[0]
                log.error("regen.%d failed (exit %s); last lines of %s:\n%s", k, codes[k], logs[k], _tail(logs[k]))
                exit_code = EXIT_FAILED
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(POLL_S)  # polling the shard files and the workers
    except KeyboardInterrupt:
        log.error("interrupted: stopping the workers (finished rows are kept; run again to continue)")
        exit_code = 130
    finally:
        bar.close()
        _stop_workers(procs)
    if exit_code != EXIT_OK:
        return exit_code

    stats = []
    for path in output.parent.glob(output.name + SHARD_INFIX + "*.stats.json"):
        stats.append(json.loads(path.read_text()))
        path.unlink()
    stats.sort(key=lambda st: st.get("rank", 0))
    finished = done_ids(output)  # one read of the output and the shards (not one per row)
    remaining = [r.id for r in source if r.id not in finished]
    if remaining:
        log.error("%d rows were not written (first: %s); shards kept", len(remaining), remaining[0])
        return EXIT_FAILED
    report = merge_outputs(output)
    tokens = sum(s["new_tokens"] for s in stats)
    gen_s = max((s["generate_s"] for s in stats), default=0.0)
    skipped = ", ".join(f"{k}={v}" for k, v in sorted(report.skipped.items())) or "none"
    summary = {
        "rows_read": len(source) + sum(dropped.values()), "dropped": dropped, "rows": report.rows,
        "skipped": report.skipped, "duplicates": report.duplicates, "bad_lines": report.bad_lines,
        "regenerated_now": len(pending), "new_tokens_now": tokens, "generate_s": round(gen_s, 2),
        "tokens_per_s": round(tokens / gen_s, 1) if gen_s > 0 else None,
        "wall_s": round(time.monotonic() - started, 2), "workers": world,
        "per_worker": [{k: st.get(k) for k in ("rank", "device", "rows", "new_tokens", "load_s", "generate_s",
                                               "tokens_per_s")} for st in stats],
    }
    sidecar.write_text(json.dumps({"options": wanted, "last_run": summary}, indent=1))
    log.info("wrote %d rows to %s (skipped: %s; dropped by the reader: %s; duplicates %d); this run: %d rows, "
             "%d new tokens, %.1f tokens/s over %d worker(s) (generation %.1f s, wall %.1f s)", report.rows, output,
             skipped, reasons, report.duplicates, len(pending), tokens, summary["tokens_per_s"] or 0.0, world, gen_s,
             summary["wall_s"])
    for st in stats:
        log.info("regen.%s on %s: %d rows, %d new tokens, %.1f new tokens/s (load %.1f s, generation %.1f s)",
                 st.get("rank"), st.get("device"), st.get("rows", 0), st.get("new_tokens", 0),
                 st.get("tokens_per_s") or 0.0, st.get("load_s", 0.0), st.get("generate_s", 0.0))
    return EXIT_OK


# --------------------------------------------------------------------------- command line


def _gpu_list(text: str) -> list[int]:
    """``"0,1"`` → ``[0, 1]`` (argparse type of ``--gpus``)."""
    try:
        gpus = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated GPU ids, got {text!r}") from None
    if not gpus or any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise argparse.ArgumentTypeError(f"expected distinct GPU ids >= 0, got {text!r}")
    return gpus


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash.inference.regenerate",
                                description="The target rewrites the assistant turns of data.dataset.")
    p.add_argument("--config", required=True, help="YAML config (target, data, cluster sections are used)")
    p.add_argument("--output", type=Path, default=None, help="output JSONL (ShareGPT form; default regenerate.output)")
    # Defaults of the options below: the config's regenerate section (dflash.config.RegenerateConfig).
    p.add_argument("--max-new-tokens", type=int, default=None, help="per assistant turn (default 256)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (1 = off, default)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (per row and turn; default 0)")
    p.add_argument("--limit", type=int, default=None,
                   help="read at most this many rows (default regenerate.limit, else data.max_conversations)")
    p.add_argument("--batch-size", type=int, default=None, help="conversations per generation batch (default 16)")
    p.add_argument("--max-turns", type=int, default=None,
                   help="regenerate at most this many assistant turns (default all)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="stop a conversation before a prompt this long (default data.max_length)")
    p.add_argument("--overwrite", action="store_true", help="delete an existing output and its shards first")
    p.add_argument("--gpus", type=_gpu_list, default=None,
                   help="comma-separated GPU ids, one worker each (default cluster.targets; on CPU: the worker count)")
    p.add_argument("--worker-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    return p.parse_intermixed_args(argv)  # overrides may come before or after the options


def _options(args: argparse.Namespace, cfg: RunConfig) -> GenerationOptions:
    """The checked options of a command line; options not given are filled in ``args`` from the
    config's ``regenerate`` section (``--limit`` then from ``data.max_conversations``).

    Raises:
        ConfigError: an option out of range (named).
    """
    for key in ("max_new_tokens", "temperature", "top_p", "seed", "batch_size", "max_turns", "max_prompt_tokens",
                "limit"):
        if getattr(args, key) is None:
            setattr(args, key, getattr(cfg.regenerate, key))
    if args.output is None:
        if not cfg.regenerate.output:
            raise ConfigError("--output: required (or regenerate.output in the config)")
        args.output = Path(cfg.regenerate.output)
    if args.limit is None:
        args.limit = cfg.data.max_conversations
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit: must be >= 1, got {args.limit}")
    options = GenerationOptions(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        batch_size=args.batch_size, max_turns=args.max_turns,
        max_prompt_tokens=args.max_prompt_tokens if args.max_prompt_tokens is not None else cfg.data.max_length,
        enable_thinking=cfg.data.enable_thinking)
    options.check()
    return options


def stage_workers(cfg: RunConfig) -> list[int]:
    """The regeneration stage's workers: every distinct GPU id of ``cluster.targets`` then
    ``cluster.drafters``, in that order (on CPU, the same count of processes)."""
    return list(dict.fromkeys(cfg.cluster.targets + cfg.cluster.drafters))


def run_stage(cfg: RunConfig, config_path: str | os.PathLike, overrides: list[str]) -> tuple[int, RunConfig]:
    """Regeneration as the first stage of training: regenerate ``data.dataset`` into
    ``regenerate.output`` when ``regenerate.enabled``, then hand back the training config.

    Runs :func:`run_launcher` in this process with the ``regenerate`` section as its options and
    one worker per GPU of :func:`stage_workers` (the workers read ``config_path`` with
    ``overrides``, as the caller did). Resumable like the command line: rows already in the output
    (or in a shard, or skipped) are not generated again, and a complete output starts no worker and
    loads no model.

    Args:
        cfg: the validated run config.
        config_path / overrides: what ``cfg`` was loaded from (passed on to the workers).

    Returns:
        ``(exit code, config)``: :data:`EXIT_OK` and ``cfg`` with ``data.dataset`` = the output
        and ``regenerate.enabled`` false (what the training stage and its ``config.yaml`` read);
        otherwise the launcher's exit code (:data:`EXIT_FAILED`, :data:`EXIT_CONFIG`, 130) and
        ``cfg`` unchanged. A disabled section returns ``(EXIT_OK, cfg)`` at once.
    """
    import dataclasses

    r = cfg.regenerate
    if not r.enabled:
        return EXIT_OK, cfg
    argv = ["--config", str(config_path), "--output", str(r.output), "--max-new-tokens", str(r.max_new_tokens),
            "--temperature", repr(r.temperature), "--top-p", repr(r.top_p), "--seed", str(r.seed),
            "--batch-size", str(r.batch_size), "--gpus", ",".join(str(g) for g in stage_workers(cfg))]
    for flag, value in (("--limit", r.limit), ("--max-turns", r.max_turns),
                        ("--max-prompt-tokens", r.max_prompt_tokens)):
        if value is not None:
            argv += [flag, str(value)]
    args = parse_args(argv + list(overrides))
    try:
        options = _options(args, cfg)
    except ConfigError as exc:
        log.error("config error: %s", exc)
        return EXIT_CONFIG, cfg
    log.info("stage 1: regenerating %s into %s on %d worker(s)", cfg.data.dataset, r.output, len(args.gpus))
    code = run_launcher(args, cfg, options)
    if code != EXIT_OK:
        return code, cfg
    output = str(Path(r.output).resolve())
    log.info("stage 2: training on %s", output)
    return EXIT_OK, dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dataset=output),
                                        regenerate=dataclasses.replace(r, enabled=False))


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the launcher (no ``--worker-rank``) and of each worker (internal flags)."""
    args = parse_args(argv)
    worker = args.worker_rank is not None
    name = f"regen.{args.worker_rank}" if worker else "regen"
    if worker:
        from dflash.runtime.control import set_parent_death_signal

        set_parent_death_signal(signal.SIGKILL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the launcher decides
        signal.signal(signal.SIGTERM, _on_sigterm)
    else:
        signal.signal(signal.SIGTERM, _on_sigterm)  # leave through the finally blocks: workers are stopped
    setup_logging(name)
    try:
        cfg = load_config(args.config, args.overrides)
        options = _options(args, cfg)
    except ConfigError as exc:
        log.error("config error: %s", exc)
        return EXIT_CONFIG
    setup_logging(name, cfg.log.level)
    output = Path(args.output).resolve()
    if worker:
        return run_worker(cfg, options, output, args.worker_rank, args.world, args.limit, args.gpus)
    return run_launcher(args, cfg, options)


if __name__ == "__main__":
    sys.exit(main())
