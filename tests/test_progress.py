"""The progress display: a log line at least every interval off a terminal (fake clock, no
waiting), one clean live line on a terminal."""

from __future__ import annotations

import io
import logging

import pytest

from dflash.progress import Progress, is_live


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "dflash.progress"]


def test_not_a_terminal_logs_at_least_every_interval(caplog):
    clock, stream = Clock(), io.StringIO()
    assert not is_live(stream)
    p = Progress(12, desc="step", stream=stream, interval_s=30, clock=clock, heartbeat=False)
    with caplog.at_level(logging.INFO, logger="dflash.progress"):
        for n in range(1, 7):  # a step every 10 s: a line every third step
            clock.t += 10
            p.update(n, f"loss {10 - n}")
        assert _lines(caplog) == ["step 3/12 loss 7 | 0:30 elapsed, eta 1:30", "step 6/12 loss 4 | 1:00 elapsed, eta 1:00"]
        # nothing finishes for a while (an evaluation): the heartbeat says so, every 30 s
        for _ in range(7):
            clock.t += 10
            p.poll()
        assert _lines(caplog)[2:] == ["step 6/12 loss 4 | 1:30 elapsed, eta 1:36 (no step finished for 0:30)",
                                      "step 6/12 loss 4 | 2:00 elapsed, eta 2:12 (no step finished for 1:00)"]
        clock.t += 1
        p.update(12, "done")  # the last one is always written
        assert _lines(caplog)[-1] == "step 12/12 done | 2:11 elapsed, eta 0:00"
    p.close()
    assert stream.getvalue() == ""  # nothing but log lines off a terminal


def test_heartbeat_thread_writes_while_nothing_happens(caplog):
    """The real thread with a clock that jumps 31 s per call: a line comes without any update."""
    clock = Clock()

    def jumping():
        clock.t += 31
        return clock.t

    with caplog.at_level(logging.INFO, logger="dflash.progress"):
        p = Progress(5, desc="regenerate", unit="row", stream=io.StringIO(), clock=jumping)
        try:
            for _ in range(200):
                if _lines(caplog):
                    break
                p._closed.wait(0.05)  # the heartbeat thread runs every second: bounded by 10 s in all
        finally:
            p.close()
    assert _lines(caplog) and _lines(caplog)[0].startswith("regenerate 0/5 | ")


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_live_line_shows_the_counter_once():
    stream = _Tty()
    p = Progress(12, desc="step", stream=stream, live=True, heartbeat=False)
    p.update(1, "ep 0 | loss 3.000")
    p.close()
    out = stream.getvalue()
    assert "step 1/12 ep 0 | loss 3.000" in out
    assert out.count("1/12") == out.count("step 1/12") and " , " not in out


def test_bad_arguments():
    with pytest.raises(ValueError, match="interval_s"):
        Progress(3, interval_s=0, live=False, heartbeat=False)
    with pytest.raises(ValueError, match="total"):
        Progress(-1, live=False, heartbeat=False)


def test_lines_from_many_threads_stay_whole():
    """The launcher's reader threads (one per worker pipe) write through one Progress at once:
    every write is one whole line, so no two workers' lines run together."""
    import threading

    class Recording(io.StringIO):
        def __init__(self):
            super().__init__()
            self.calls = []

        def write(self, s):
            self.calls.append(s)
            return super().write(s)

    stream = Recording()
    p = Progress(3, stream=stream, live=False, heartbeat=False)
    lines = {f"[worker.{w}] line {i}" for w in range(4) for i in range(200)}

    def pump(w):
        for i in range(200):
            p.write(f"[worker.{w}] line {i}")

    threads = [threading.Thread(target=pump, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(not t.is_alive() for t in threads)
    assert all(c.endswith("\n") and c.count("\n") == 1 for c in stream.calls)
    assert set(stream.getvalue().splitlines()) == lines and len(stream.getvalue().splitlines()) == len(lines)
