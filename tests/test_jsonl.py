"""dflash.jsonl against a naive reader: random records, a cut last line, a corrupt middle line,
reads from any byte offset, and the bytes each writer option produces."""

from __future__ import annotations

import json
import logging
import random

import pytest

from dflash import jsonl

WORDS = ["step", "loss", "τ", "épreuve", "id", "a\"b", "x\\y", "tab\t", "草", ""]


def _value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 2 else 5)
    if kind == 0:
        return rng.randint(-10**12, 10**12)
    if kind == 1:
        return rng.uniform(-1e6, 1e6)
    if kind == 2:
        return rng.choice(WORDS) * rng.randint(0, 3)
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return rng.choice(WORDS) + "\n" + rng.choice(WORDS)  # a newline inside a string is escaped
    if kind == 5:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return _record(rng, depth + 1)


def _record(rng: random.Random, depth: int = 0) -> dict:
    return {f"{rng.choice(WORDS)}{i}": _value(rng, depth) for i in range(rng.randint(0, 5))}


def _naive(path) -> list:
    """Every line of the file parsed, the obviously-correct way (the file must be whole)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


def _naive_bytes(records, compact: bool, ensure_ascii: bool) -> bytes:
    seps = (",", ":") if compact else (", ", ": ")
    return b"".join((json.dumps(r, separators=seps, ensure_ascii=ensure_ascii) + "\n").encode("utf-8")
                    for r in records)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("compact, ensure_ascii", [(False, True), (True, True), (False, False)])
def test_appends_read_back_as_a_naive_reader_sees_them(tmp_path, seed, compact, ensure_ascii):
    rng = random.Random(seed)
    path = tmp_path / "f.jsonl"
    records = [_record(rng) for _ in range(rng.randint(20, 60))]
    i = 0
    with jsonl.Appender(path, compact=compact, ensure_ascii=ensure_ascii) as out:  # batches on one descriptor
        while i < len(records) // 2:
            n = rng.randint(1, 4)
            out.append(records[i:i + n])
            i += n
    for record in records[i:]:  # one open per record
        jsonl.append(path, record, compact=compact, ensure_ascii=ensure_ascii)
    assert path.read_bytes() == _naive_bytes(records, compact, ensure_ascii)
    assert _naive(path) == records
    found = jsonl.read(path)
    assert found.records == records and found.bad == [] and found.cut == 0
    assert found.end == path.stat().st_size


@pytest.mark.parametrize("seed", range(6))
def test_a_cut_last_line_is_not_read_and_the_next_writer_drops_it(tmp_path, seed, caplog):
    rng = random.Random(seed)
    path = tmp_path / "f.jsonl"
    records = [_record(rng) for _ in range(rng.randint(1, 12))]
    jsonl.append(path, records)
    whole = path.stat().st_size
    lost = (json.dumps({"lost": _record(rng)}) + "\n").encode("utf-8")
    piece = lost[:rng.randint(1, len(lost) - 1)]  # cut anywhere, also just before its newline
    with open(path, "ab") as handle:
        handle.write(piece)
    found = jsonl.read(path)
    assert found.records == records and found.bad == []
    assert (found.end, found.cut) == (whole, len(piece))
    later = [_record(rng) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="dflash.jsonl"):
        jsonl.append(path, later)
    assert f"dropping {len(piece)} bytes of a line cut mid-write" in caplog.text
    assert _naive(path) == records + later and jsonl.read(path).records == records + later


def test_a_file_that_is_one_cut_line(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_bytes(b'{"step": 1, "lo')
    assert jsonl.read(path) == jsonl.JsonLines([], 0, [], 15)
    jsonl.append(path, {"step": 1})
    assert path.read_bytes() == b'{"step": 1}\n'


@pytest.mark.parametrize("seed", range(4))
def test_a_corrupt_middle_line_is_reported_or_raised(tmp_path, seed, caplog):
    rng = random.Random(seed)
    path = tmp_path / "f.jsonl"
    records = [_record(rng) for _ in range(rng.randint(4, 12))]
    at = rng.randint(1, len(records) - 1)
    garbage = rng.choice(['{"step": 2, "epo', "[1, 2]", "7", "\udcff", "}{"])
    lines = [json.dumps(r) for r in records]
    lines.insert(at, garbage)
    path.write_bytes("".join(line + "\n" for line in lines).encode("utf-8", "surrogateescape"))
    offset = sum(len(line.encode("utf-8", "surrogateescape")) + 1 for line in lines[:at])
    found = jsonl.read(path)
    assert found.records == records and found.cut == 0 and found.end == path.stat().st_size
    assert [(b.line, b.offset) for b in found.bad] == [(at + 1, offset)]
    with pytest.raises(jsonl.JsonlError, match=rf"f.jsonl: line {at + 1} \(byte {offset}\) is not a JSON object"):
        jsonl.read(path, strict=True)
    with caplog.at_level(logging.WARNING, logger="dflash.jsonl"):
        assert jsonl.read_records(path, what="the ledger") == records
    assert f"the ledger: line {at + 1} (byte {offset}) skipped" in caplog.text


@pytest.mark.parametrize("seed", range(3))
def test_reads_from_any_offset_see_the_lines_that_begin_there_or_later(tmp_path, seed):
    rng = random.Random(seed)
    path = tmp_path / "f.jsonl"
    records = [_record(rng) for _ in range(15)]
    jsonl.append(path, records)
    data = path.read_bytes() + b'{"cut'
    path.write_bytes(data)
    starts = [0] + [i + 1 for i, byte in enumerate(data) if byte == ord("\n")]  # where each line begins
    for start in rng.sample(range(len(data) + 1), 40) + starts:
        expected = [r for r, s in zip(records, starts) if s >= start]
        found = jsonl.read(path, start)
        assert found.records == expected, start
        end = max(start, starts[-1])  # after the last complete line, or start inside the cut piece
        assert (found.end, found.cut, found.bad) == (end, len(data) - end, []), start


def test_a_missing_file_reads_as_empty(tmp_path):
    assert jsonl.read(tmp_path / "none.jsonl") == jsonl.JsonLines()
    assert jsonl.read_records(tmp_path / "none.jsonl") == []


def test_a_record_json_cannot_write_writes_nothing(tmp_path):
    path = tmp_path / "f.jsonl"
    jsonl.append(path, {"a": 1})
    with pytest.raises(TypeError):
        jsonl.append(path, [{"b": 2}, {"c": object()}])
    assert _naive(path) == [{"a": 1}]
