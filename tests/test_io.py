"""specjax.io: the one JSONL reader (torn-line repair, strict and lenient modes) and the durable writers."""
from __future__ import annotations

import json
import os

import pytest

from specjax import io as sio


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_reader_yields_decoded_lines_with_their_numbers_and_skips_blank_lines(tmp_path):
    p = _write(tmp_path / "a.jsonl", b'{"a": 1}\n\n  \n[1, 2]\n"\xc3\xa9"\n')
    rows = list(sio.iter_jsonl(p))
    assert [(r.line, r.value, r.error) for r in rows] == [(1, {"a": 1}, None), (4, [1, 2], None), (5, "é", None)]
    assert sio.read_jsonl(p) == [{"a": 1}, [1, 2], "é"]


def test_strict_errors_name_file_and_line_lenient_mode_reports_them(tmp_path):
    p = _write(tmp_path / "b.jsonl", b'{"a": 1}\n{"a": \n\xff\xfe\n[3]\n')
    with pytest.raises(sio.JsonlError, match=r"b\.jsonl:2: not valid JSON") as ei:
        sio.read_jsonl(p)
    assert ei.value.line == 2 and isinstance(ei.value, ValueError)
    rows = list(sio.iter_jsonl(p, strict=False, objects=True))
    assert [r.line for r in rows] == [1, 2, 3, 4]
    assert rows[0].error is None and rows[1].value is None and "not valid JSON" in rows[1].error
    assert "not valid JSON" in rows[2].error  # bad UTF-8 is a bad line, not a crash
    assert rows[3].value is None and "not a JSON object" in rows[3].error
    with pytest.raises(sio.JsonlError, match=r":4: line is a JSON list, not a JSON object"):
        sio.read_jsonl(_write(tmp_path / "c.jsonl", b'{}\n{}\n{}\n[3]\n'), objects=True)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        sio.read_jsonl(tmp_path / "nope.jsonl")
    assert sio.read_jsonl(tmp_path / "nope.jsonl", missing_ok=True) == []


@pytest.mark.parametrize("data, kept", [
    (b'{"id": 1}\n{"id": 2}\n{"id": 3, "te', b'{"id": 1}\n{"id": 2}\n'),  # torn by a kill mid-write
    (b'{"id": 1}\n{"id": 2}', b'{"id": 1}\n'),  # even a complete-looking value without its newline
    (b'{"id": 1, "x"', b''),  # the only line torn
    (b'{"id": 1}\n', b'{"id": 1}\n'),  # intact: untouched
    (b'', b''),
])
def test_torn_last_line_is_cut_off_the_file(tmp_path, data, kept):
    p = _write(tmp_path / "out.jsonl", data)
    rows = sio.read_jsonl(p, objects=True, repair_torn_tail=True)
    assert p.read_bytes() == kept
    assert rows == [json.loads(x) for x in kept.splitlines()]
    with sio.DurableAppender(p) as out:  # resuming appends whole lines after the cut
        out.append({"id": 9})
    assert sio.read_jsonl(p)[-1] == {"id": 9}


def test_torn_tail_is_found_past_a_long_last_line(tmp_path):
    long = b'{"t": "' + b"x" * 200_000 + b'"}\n'
    p = _write(tmp_path / "long.jsonl", long + b'{"t": "cut')
    assert len(sio.read_jsonl(p, repair_torn_tail=True)) == 1 and p.read_bytes() == long


def test_negative_control_without_repair_a_torn_line_is_an_error(tmp_path):
    p = _write(tmp_path / "o.jsonl", b'{"id": 1}\n{"id": 2, "te')
    with pytest.raises(sio.JsonlError, match=":2:"):
        sio.read_jsonl(p)
    assert p.read_bytes().endswith(b'"te')  # and the file is left alone


def test_write_atomic_replaces_whole_fsyncs_and_leaves_no_temp(tmp_path, monkeypatch):
    p = tmp_path / "sub" / "f.json"
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    sio.write_json_atomic(p, {"a": [1, 2]})
    assert json.loads(p.read_text()) == {"a": [1, 2]} and p.read_text().endswith("\n")
    assert len(synced) >= 2  # the file and its directory
    sio.write_atomic(p, "new")
    assert p.read_text() == "new" and os.listdir(p.parent) == ["f.json"]


def test_write_atomic_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    p = tmp_path / "f.txt"
    sio.write_atomic(p, "old")

    def boom(fd):
        raise OSError("disk full")
    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        sio.write_atomic(p, "new")
    assert p.read_text() == "old" and os.listdir(tmp_path) == ["f.txt"]


def test_appender_writes_one_full_line_per_row_and_fsyncs(tmp_path, monkeypatch):
    p = tmp_path / "a.jsonl"
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    out = sio.DurableAppender(p)
    out.append({"id": 1, "text": "😀"})
    out.append({"id": 2})
    out.close()
    assert p.read_bytes() == '{"id": 1, "text": "😀"}\n{"id": 2}\n'.encode()
    assert len(synced) == 2
    with pytest.raises(ValueError, match="closed"):
        out.append({"id": 3})
