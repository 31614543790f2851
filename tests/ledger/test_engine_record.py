"""The engine usage record without a vLLM server: what the plugin writes (tokengate_vllm
record and writer), how the ledger parses and tails it (tokengate.ledger.engine_record,
tokengate.ledger.tail), and the plugin's version gate (tokengate_vllm.compat)."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from tokengate.ledger.engine_record import EngineRecord, parse_record
from tokengate.ledger.event import EventError
from tokengate.ledger.tail import Batch, UsageTail
from tokengate_vllm import compat, record, settings
from tokengate_vllm.writer import RecordWriter

from tests.conftest import VLLM_IN_PROCESS

# pure: starts no process of the stack (make test-unit)
pytestmark = [pytest.mark.unit, VLLM_IN_PROCESS]

LINE = ('{"request_id":"chatcmpl-5d41402abc4b2a76b9719d911017c592","index":1,"n":2,'
        '"ts":"2026-11-29T16:40:00.123Z","arrival_ts":"2026-11-29T16:39:59.900Z",'
        '"model":"tiny-qwen3","key_id":"team-a","endpoint":"chat",'
        '"finish_reason":"abort","source":"abort",'
        '"num_prompt_tokens":12,"num_generation_tokens":7,"num_cached_tokens":0,'
        '"prefilled":true,"max_tokens":500,"num_preemptions":0,"e2e_ms":223.5,'
        '"queued_ms":0.04,"prefill_ms":15.2,"decode_ms":80.1}')


def rec(**over: object) -> dict[str, object]:
    return {**json.loads(LINE), **over}


# -- the record and its parser --------------------------------------------------------

def test_a_plugin_line_parses_to_the_record():
    r = parse_record(LINE.encode() + b"\n")
    assert (r.request_id, r.index, r.n, r.finish_reason, r.source) == \
        ("chatcmpl-5d41402abc4b2a76b9719d911017c592", 1, 2, "abort", "abort")
    assert (r.num_prompt_tokens, r.num_generation_tokens, r.num_cached_tokens, r.prefilled) == \
        (12, 7, 0, True)
    assert (r.max_tokens, r.e2e_ms, r.queued_ms, r.prefill_ms, r.decode_ms) == \
        (500, 223.5, 0.04, 15.2, 80.1)
    assert r.edge_request_id == "5d41402abc4b2a76b9719d911017c592"
    assert r.key == "chatcmpl-5d41402abc4b2a76b9719d911017c592#1"


def test_the_writer_writes_the_parsers_fields_in_order():
    assert record.FIELDS == tuple(f.name for f in dataclasses.fields(EngineRecord))
    line = record.to_line(rec())
    assert line == LINE.encode() + b"\n"


@pytest.mark.parametrize("rid, edge", [
    ("chatcmpl-" + "ab" * 16, "ab" * 16),
    ("chatcmpl-" + "ab" * 16 + "_1", "ab" * 16),    # chat with several engine inputs
    ("cmpl-" + "ab" * 16 + "-0", "ab" * 16),        # completions: prompt index
    ("cmpl-" + "ab" * 16 + "-12", "ab" * 16),
    ("chatcmpl-" + "AB" * 16, None),                # the edge's ids are lowercase
    ("chatcmpl-" + "ab" * 15, None),
    ("chatcmpl-5f1c0e7c-9a2b-4b1e-8f00-3d2b1c0a9e88", None),  # vLLM's own uuid
    ("ab" * 16, None),
])
def test_edge_request_id_is_the_edges_id_inside_vllms(rid: str, edge: str | None):
    assert parse_record(json.dumps(rec(request_id=rid))).edge_request_id == edge


def test_a_line_of_an_older_plugin_names_no_key():
    """Files written before the plugin recorded the edge's key and endpoint still parse:
    their records name none (an orphan of them cannot be billed, only counted)."""
    old = {k: v for k, v in rec().items() if k not in ("key_id", "endpoint")}
    r = parse_record(json.dumps(old))
    assert (r.key_id, r.endpoint, r.num_generation_tokens) == (None, None, 7)
    assert (parse_record(LINE).key_id, parse_record(LINE).endpoint) == ("team-a", "chat")


def test_nulls_where_allowed_and_unknown_keys_ignored():
    r = parse_record(json.dumps(rec(model=None, max_tokens=None, queued_ms=None,
                                    prefill_ms=None, decode_ms=None, future_field=[1])))
    assert (r.model, r.max_tokens, r.queued_ms, r.prefill_ms, r.decode_ms) == \
        (None, None, None, None, None)


@pytest.mark.parametrize("change, field", [
    ({"request_id": ""}, "request_id"),
    ({"index": -1}, "index"),
    ({"index": 2}, "index"),          # index < n
    ({"n": 0}, "n"),
    ({"ts": "2026-11-29 16:40:00"}, "ts"),
    ({"arrival_ts": None}, "arrival_ts"),
    ({"finish_reason": "cancelled"}, "finish_reason"),
    ({"source": "edge"}, "source"),
    ({"source": "abort", "finish_reason": "stop"}, "finish_reason"),
    ({"num_prompt_tokens": 1.5}, "num_prompt_tokens"),
    ({"num_generation_tokens": True}, "num_generation_tokens"),
    ({"num_cached_tokens": 13}, "num_cached_tokens"),      # > num_prompt_tokens
    ({"prefilled": 1}, "prefilled"),
    ({"prefilled": False}, "num_generation_tokens"),       # tokens without a prefill
    ({"max_tokens": "500"}, "max_tokens"),
    ({"e2e_ms": -1}, "e2e_ms"),
    ({"decode_ms": "fast"}, "decode_ms"),
])
def test_invalid_fields_are_refused_by_name(change: dict[str, object], field: str):
    with pytest.raises(EventError, match=field):
        parse_record(json.dumps(rec(**change)))


@pytest.mark.parametrize("line, why", [
    (LINE[:-1], "not JSON"),                               # a cut line
    (LINE.replace('"n":2', '"n":2,"n":3'), "duplicate"),
    (LINE.replace('"e2e_ms":223.5', '"e2e_ms":NaN'), "NaN"),
    (b"\xff" + LINE.encode(), "UTF-8"),
    ("[]", "object"),
])
def test_broken_lines_are_refused(line: str | bytes, why: str):
    with pytest.raises(EventError, match=why):
        parse_record(line)


def test_a_record_from_vllms_finished_request_stats():
    """from_finished reads FinishedRequestStats as vLLM builds it
    (IterationStats.update_from_finished_request, vllm/v1/metrics/stats.py)."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics.stats import IterationStats, RequestStateStats

    it = IterationStats()
    st = RequestStateStats(num_generation_tokens=30, arrival_time=it.iteration_timestamp - 2.0,
                           queued_ts=100.0, scheduled_ts=100.5, first_token_ts=100.75,
                           last_token_ts=101.5)
    it.update_from_finished_request(FinishReason.LENGTH, "chatcmpl-" + "ab" * 16, 12, 30, st,
                                    num_cached_tokens=0)
    fin = it.finished_requests[0]
    fin.tokengate_child = (1, 2)
    fin.tokengate_edge = ("team-a", "chat")  # hooks: what the edge sent (tokengate_vllm.edge)
    got = record.from_finished(fin, it.iteration_timestamp, "tiny-qwen3")
    assert got == {
        "request_id": "chatcmpl-" + "ab" * 16, "index": 1, "n": 2,
        "ts": record.rfc3339(it.iteration_timestamp),
        "arrival_ts": record.rfc3339(it.iteration_timestamp - 2.0),
        "model": "tiny-qwen3", "key_id": "team-a", "endpoint": "chat",
        "finish_reason": "length", "source": "stats",
        "num_prompt_tokens": 12, "num_generation_tokens": 30, "num_cached_tokens": 0,
        "prefilled": True, "max_tokens": 30, "num_preemptions": 0, "e2e_ms": 2000.0,
        "queued_ms": 500.0, "prefill_ms": 250.0, "decode_ms": 750.0}
    assert parse_record(record.to_line(got)).index == 1


def test_a_record_of_a_request_aborted_while_it_waited():
    """from_aborted reads vLLM's frontend RequestState (output_processor.py) the way
    update_from_finished_request reads it; never scheduled: no phase durations."""
    from vllm.v1.metrics.stats import RequestStateStats

    state = SimpleNamespace(
        external_req_id="chatcmpl-" + "cd" * 16, request_index=0, parent_req=None,
        prompt_len=40, num_cached_tokens=0, is_prefilling=True, max_tokens_param=None,
        stats=RequestStateStats(arrival_time=1_790_000_000.0, queued_ts=50.0))
    got = record.from_aborted(state, 1_790_000_000.25, None)
    assert got == {
        "request_id": "chatcmpl-" + "cd" * 16, "index": 0, "n": 1,
        "ts": "2026-09-21T14:13:20.250Z", "arrival_ts": "2026-09-21T14:13:20.000Z",
        "model": None, "key_id": None, "endpoint": None, "finish_reason": "abort",
        "source": "abort",
        "num_prompt_tokens": 40, "num_generation_tokens": 0, "num_cached_tokens": 0,
        "prefilled": False, "max_tokens": None, "num_preemptions": 0, "e2e_ms": 250.0,
        "queued_ms": None, "prefill_ms": None, "decode_ms": None}
    assert parse_record(record.to_line(got)).prefilled is False


def test_rfc3339_matches_the_edges_format():
    assert record.rfc3339(1_790_000_000.0) == "2026-09-21T14:13:20.000Z"
    assert record.rfc3339(1_790_000_000.9996) == "2026-09-21T14:13:21.000Z"


# -- the writer and the ledger's tail ------------------------------------------------

def lines(n: int, start: int = 0) -> list[bytes]:
    return [record.to_line(rec(request_id=f"chatcmpl-{i:032x}", index=0, n=1))
            for i in range(start, start + n)]


def tail_all(path: Path) -> list[bytes]:
    tail = UsageTail(path, rotate_wait_s=0.0)
    tail.seek(None)
    out: list[bytes] = []
    while isinstance(b := tail.read(), Batch):
        out += b.lines
        tail.commit(b)
    tail.close()
    return out


def test_one_write_per_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    calls = []
    real = os.write

    def counting(fd: int, data: bytes | memoryview) -> int:
        calls.append(len(data))
        return real(fd, data)

    w = RecordWriter(tmp_path / "usage" / "engine.jsonl")
    monkeypatch.setattr(os, "write", counting)
    batch = lines(5)
    assert w.write(batch)
    assert calls == [sum(len(x) for x in batch)]
    assert w.write([]) and len(calls) == 1  # nothing pending: no write
    assert (tmp_path / "usage" / "engine.jsonl").read_bytes() == b"".join(batch)
    assert w.written == 5


def test_a_write_cut_short_leaves_a_fragment_on_its_own_line(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch):
    """Disk full half way through a batch: the records written whole stay, the torn one
    and the rest are written again, after a newline that closes the fragment."""
    path = tmp_path / "engine.jsonl"
    w = RecordWriter(path)
    first, second = lines(3), lines(2, start=3)
    real = os.write
    cut = len(first[0]) + 10   # record 0 whole, 10 bytes of record 1
    room = [cut]

    def disk_full(fd: int, data: bytes | memoryview) -> int:
        if not room[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real(fd, bytes(data[:room[0]]))
        room[0] -= n
        return n

    monkeypatch.setattr(os, "write", disk_full)
    assert not w.write(first)
    assert w.pending() == 2 and w.written == 1
    monkeypatch.setattr(os, "write", real)
    assert w.write(second)
    assert w.pending() == 0 and w.written == 5
    got = tail_all(path)
    assert got[0] + b"\n" == first[0]
    assert got[1] == first[1][:10]                          # the fragment, alone
    assert [x + b"\n" for x in got[2:]] == first[1:] + second
    with pytest.raises(EventError):
        parse_record(got[1])
    assert [parse_record(x).request_id for x in got[2:]] == \
        [f"chatcmpl-{i:032x}" for i in range(1, 5)]


def test_the_writer_follows_a_rotation(tmp_path: Path):
    path = tmp_path / "engine.jsonl"
    w = RecordWriter(path)
    w.write(lines(2))
    path.rename(tmp_path / "engine.jsonl.1")
    w.write(lines(1, start=2))
    assert (tmp_path / "engine.jsonl.1").read_bytes() == b"".join(lines(2))
    assert path.read_bytes() == b"".join(lines(1, start=2))
    path.unlink()                    # deleted: a new file again
    w.write(lines(1, start=3))
    assert path.read_bytes() == b"".join(lines(1, start=3))


def test_a_file_left_inside_a_line_is_closed_before_the_first_record(tmp_path: Path):
    path = tmp_path / "engine.jsonl"
    path.write_bytes(lines(1)[0] + b'{"request_id":"chatcm')   # a crash mid-line
    RecordWriter(path).write(lines(1, start=1))
    got = tail_all(path)
    assert len(got) == 3 and got[1] == b'{"request_id":"chatcm'
    assert parse_record(got[2]).request_id == f"chatcmpl-{1:032x}"


def test_records_kept_while_writes_fail_are_bounded(tmp_path: Path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    w = RecordWriter(blocker / "engine.jsonl", max_pending=3)
    assert not w.write(lines(2))
    assert not w.write(lines(2, start=2))
    assert (w.pending(), w.dropped) == (3, 1)


def test_the_tail_never_hands_out_a_line_still_being_written(tmp_path: Path):
    """The ledger's UsageTail reads the engine file as it reads the edge's: complete
    lines only, the trailing partial one once its newline arrives."""
    path = tmp_path / "engine.jsonl"
    full = lines(2)
    path.write_bytes(full[0] + full[1][:25])
    tail = UsageTail(path, rotate_wait_s=5.0)
    tail.seek(None)
    b = tail.read()
    assert isinstance(b, Batch) and [x + b"\n" for x in b.lines] == [full[0]]
    tail.commit(b)
    assert tail.read() is None
    with open(path, "ab") as f:
        f.write(full[1][25:])
    b = tail.read()
    assert isinstance(b, Batch) and [x + b"\n" for x in b.lines] == [full[1]]
    tail.close()


# -- settings and the version gate ----------------------------------------------------

def test_usage_file_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    assert settings.usage_file({}) == tmp_path / "var" / "usage" / "engine.jsonl"
    assert settings.usage_file({"TOKENGATE_ENGINE_USAGE_FILE": "/x/e.jsonl"}) == \
        Path("/x/e.jsonl")
    assert settings.usage_file({"TOKENGATE_ENGINE_USAGE_FILE": "off"}) is None


@pytest.mark.parametrize("version, setting, on, warn", [
    ("0.32.0", None, True, False),
    ("0.32.7rc1+cpu", "auto", True, False),
    ("0.33.0", None, False, True),     # the regular package's newer release
    ("0.31.2", "auto", False, True),
    (None, None, False, True),         # no vLLM importable
    ("0.33.0", "1", True, True),       # forced on an untested version: still warned
    ("0.32.0", "1", True, False),
    ("0.32.0", "0", False, False),
    ("0.32.0", "maybe", True, False),  # not a setting: auto (and a warning of its own)
])
def test_the_version_gate(version: str | None, setting: str | None, on: bool, warn: bool):
    got_on, got_warn, why = compat.decide(version, setting)
    assert (got_on, got_warn) == (on, warn)
    assert (str(version) in why) or setting == "0"


def test_the_installed_vllm_is_a_tested_one():
    assert compat.parse_version(compat.vllm_version()) in compat.TESTED
