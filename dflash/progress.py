"""Progress that shows everywhere: a live line on a terminal, a log line every N seconds elsewhere.

A terminal with columns gets one tqdm line, redrawn in place, kept below the log lines written
through :meth:`Progress.write`. Anything else (a pipe, a file, ``script`` or a job scheduler whose
terminal reports 0 columns) gets a plain log line when something changes and at least
``interval_s`` has passed since the last one, plus a heartbeat: when nothing changed for
``interval_s`` (start-up, an evaluation, a slow step), a line saying so — so a reader of a pipe
never waits more than ``interval_s`` for a sign of life (:data:`DEFAULT_INTERVAL_S`, 30 s).

Usage (the launcher, regeneration and the decoding CLI)::

    progress = Progress(total=300, initial=0, unit="step", desc="train")
    progress.update(12, "loss 3.1 | τ 1.4")   # absolute count done, free text after it
    progress.write("a log line")             # above the live line
    progress.close()                         # final line; stops the heartbeat

The heartbeat thread only calls :meth:`Progress.poll`; tests pass ``heartbeat=False``, a fake
``clock`` and a non-terminal ``stream`` and call :meth:`poll` themselves.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from typing import Callable, Optional, TextIO

from tqdm import tqdm

__all__ = ["Progress", "is_live", "format_duration", "DEFAULT_INTERVAL_S"]

log = logging.getLogger("dflash.progress")

#: Seconds between two progress log lines when the stream is not a live terminal.
DEFAULT_INTERVAL_S = 30.0
#: How often the heartbeat thread looks (seconds); far below any sensible interval.
HEARTBEAT_POLL_S = 1.0


def format_duration(seconds: float) -> str:
    """``3725`` → ``1:02:05``; non-finite or negative → ``?``."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:d}:{s:02d}"


def is_live(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal that can show a redrawn line: a tty with at least one column."""
    try:
        if not stream.isatty():
            return False
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):  # no fileno (captured), closed, not a terminal
        return False


class Progress:
    """One progress display: ``desc n/total text | elapsed, eta``.

    Args:
        total: units to do (steps, rows, prompts).
        initial: units already done (a resumed run).
        desc: what is counted (``train``, ``regenerate``); the line starts with it.
        unit: the unit's name, in the heartbeat line.
        stream: where the live line goes (default ``sys.stderr``); it also decides live or not.
        interval_s: the longest silence between two log lines when not live (> 0).
        clock: seconds, monotonic (tests pass a fake one).
        live: force the live line on / off (``None`` = :func:`is_live` of ``stream``).
        heartbeat: run the thread that calls :meth:`poll` every second (not live only).
        logger: where the log lines go (default ``dflash.progress``).

    Raises:
        ValueError: ``total < 0`` or ``interval_s <= 0``.
    """

    def __init__(self, total: int, initial: int = 0, desc: str = "", unit: str = "step",
                 stream: Optional[TextIO] = None, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, live: Optional[bool] = None, heartbeat: bool = True,
                 logger: Optional[logging.Logger] = None) -> None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.total = total
        self.n = initial
        self.desc = desc
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self.clock = clock
        self.log = logger or log
        self.live = is_live(self.stream) if live is None else live
        self.text = ""
        self.started = clock()
        self._first: Optional[tuple[int, float]] = None  # (n, time) of the first update: the rate's origin
        self._last_line = self.started  # when the last log line was written (not live)
        self._last_change = self.started
        self._logged_n: Optional[int] = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.bar = (tqdm(total=total, initial=initial, file=self.stream, dynamic_ncols=True, bar_format="{desc}",
                         leave=True) if self.live else None)
        self._thread = None
        if not self.live and heartbeat:
            self._thread = threading.Thread(target=self._beat, name="progress-heartbeat", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ the line
    def eta(self) -> float:
        """Seconds left at the rate since the first update (start-up before it does not count);
        ``nan`` before two updates."""
        if self._first is None:
            return float("nan")
        first_n, first_t = self._first
        done = self.n - first_n
        if done <= 0:
            return float("nan")
        return (self.clock() - first_t) / done * (self.total - self.n)

    def line(self) -> str:
        """``train 12/300 loss … | 0:41 elapsed, eta 16:20``."""
        head = f"{self.desc} " if self.desc else ""
        text = f" {self.text}" if self.text else ""
        return (f"{head}{self.n}/{self.total}{text} | {format_duration(self.clock() - self.started)} elapsed, "
                f"eta {format_duration(self.eta())}")

    def update(self, n: int, text: Optional[str] = None) -> None:
        """``n`` units are done (absolute); ``text`` replaces the free text (``None`` keeps it)."""
        with self._lock:
            now = self.clock()
            if self._first is None:
                self._first = (n, now)
            if n != self.n or text is not None:
                self._last_change = now
            self.n = n
            if text is not None:
                self.text = text
            if self.bar is not None:
                self.bar.n = n
                self.bar.set_description_str(self.line(), refresh=True)
            elif n >= self.total or now - self._last_line >= self.interval_s:
                self._emit(now)

    def set_total(self, total: int) -> None:
        """Change the units to do: an estimate refined as the work goes (>= 0; the line and the ETA use it)."""
        with self._lock:
            self.total = max(0, int(total))
            if self.bar is not None:
                self.bar.total = self.total

    def advance(self, k: int = 1, text: Optional[str] = None) -> None:
        """``k`` more units are done."""
        self.update(self.n + k, text)

    def poll(self) -> None:
        """Not live: write the line when ``interval_s`` passed since the last one, saying how long
        nothing changed when that is the case. Called by the heartbeat thread (or a test)."""
        if self.live:
            return
        with self._lock:
            now = self.clock()
            if now - self._last_line >= self.interval_s:
                self._emit(now)

    def _emit(self, now: float) -> None:
        quiet = now - self._last_change
        suffix = (f" (no {self.unit} finished for {format_duration(quiet)})"
                  if self._logged_n == self.n and quiet >= self.interval_s else "")
        self.log.info("%s%s", self.line(), suffix)
        self._last_line = now
        self._logged_n = self.n

    def write(self, line: str) -> None:
        """Write a log line without breaking the live line."""
        if self.bar is not None:
            self.bar.write(line, file=self.stream)  # tqdm serialises its writes
        else:
            # one write a line, under the lock: the launcher's reader threads (one per worker pipe)
            # call this at once, and print() writes the text and its newline separately
            with self._lock:
                self.stream.write(line + "\n")
                self.stream.flush()

    def _beat(self) -> None:
        while not self._closed.wait(HEARTBEAT_POLL_S):
            self.poll()

    def close(self) -> None:
        """Stop the heartbeat; leave the live line on screen."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * HEARTBEAT_POLL_S)
        if self.bar is not None:
            self.bar.close()
            self.bar = None
