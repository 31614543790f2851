"""The console's readers of the usage files, on files written like the edge writes them
(one O_APPEND write per line) and rotated like logrotate and nginx rotate them: the
request log (newest first, filters, pages, one request) and the per-minute traffic of
the Live page (incremental, across rotations, the refusals of a rotated file too)."""

from __future__ import annotations

import json
import os
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from tokengate.console import requests, traffic
from tokengate.ledger import tail

from tests.fixtures_ledger import UsageWriter, make_event

pytestmark = pytest.mark.unit

# half a minute into the current minute: files written now are within every window
NOW = datetime.now(UTC).replace(second=30, microsecond=0)


def at(seconds_ago: float) -> str:
    return (NOW - timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def ids(page: requests.Page) -> list[str]:
    return [r.request_id for r in page.rows]


def rid(i: int) -> str:
    return f"{i:032x}"


def settle(path: Path, age_s: float) -> None:
    """Give a rotated file the last write time it would have (newest first ordering)."""
    t = NOW.timestamp() - age_s
    os.utime(path, (t, t))


def test_lines_before_gives_every_complete_line_last_first_across_chunks(
        tmp_path: Path) -> None:
    lines = [b"x" * n for n in (0, 1, 5, 17, 3, 40, 2)]
    path = tmp_path / "f"
    path.write_bytes(b"".join(line + b"\n" for line in lines) + b"partial, no newline")
    fd = os.open(path, os.O_RDONLY)
    try:
        starts = [sum(len(x) + 1 for x in lines[:i]) for i in range(len(lines))]
        want = list(zip(starts, lines, strict=True))[::-1]
        for chunk in (1, 2, 3, 7, 64, 1 << 16):
            assert list(requests.lines_before(fd, path.stat().st_size, chunk)) == want, chunk
        # from inside a line: that line is not complete there
        assert list(requests.lines_before(fd, starts[5] + 3, 4)) == want[2:]
    finally:
        os.close(fd)


def test_the_request_log_pages_newest_first_through_rotated_files(tmp_path: Path) -> None:
    w = UsageWriter(tmp_path / "usage.jsonl")
    for i in range(25):
        w.write(make_event(request_id=rid(i), ts=at(100 - i)))
        if i in (7, 15):
            settle(w.rotate(), 100 - i)
    w.write_raw(b'{"request_id": "half a line')      # being written: not read
    newest_first = [rid(i) for i in range(24, -1, -1)]
    seen: list[str] = []
    page = requests.request_log(w.path, requests.Filters(), size=10)
    cursors = []
    while True:
        seen += ids(page)
        if page.older is None:
            break
        cursors.append(page.older)
        before = tail.Position.decode(page.older)
        page = requests.request_log(w.path, requests.Filters(), before, size=10)
    assert seen == newest_first
    # a rotation renames the files a cursor points into: the next page is the same
    second = requests.request_log(w.path, requests.Filters(),
                                  tail.Position.decode(cursors[0]), size=10)
    settle(w.rotate(), 1)
    assert ids(requests.request_log(w.path, requests.Filters(),
                                    tail.Position.decode(cursors[0]), size=10)) == ids(second)
    w.close()


def test_the_request_log_filters_by_key_model_and_status(tmp_path: Path) -> None:
    w = UsageWriter(tmp_path / "usage.jsonl")
    cases = [("a", "m1", 200, None), ("b", "m1", 429, "rate_limit_exceeded"),
             ("a", "m2", 404, "model_not_found"), ("a", "m1", 503, "overloaded"),
             ("b", "m2", 200, None)]
    for i, (key, model, status, error) in enumerate(cases):
        w.write(make_event(request_id=rid(i), key_id=key, model=model, status=status,
                           error=error, ts=at(10 - i)))
    w.close()

    def shown(**f: str) -> list[int]:
        return [int(x, 16) for x in ids(requests.request_log(w.path, requests.Filters(**f)))]

    assert shown() == [4, 3, 2, 1, 0]
    assert shown(key="a") == [3, 2, 0]
    assert shown(model="m2") == [4, 2]
    assert shown(status="answered") == [4, 0]
    assert shown(status="refused") == [3, 2, 1]
    assert shown(status="4xx") == [2, 1]
    assert shown(status="503", key="a", model="m1") == [3]
    row = requests.request_log(w.path, requests.Filters(status="429")).rows[0]
    assert (row.key, row.model, row.status, row.reason, row.prompt_tokens,
            row.completion_tokens, row.ttft_ms, row.total_ms) == \
        ("b", "m1", 429, "rate_limit_exceeded", 12, 30, 35.5, 410.25)


def test_a_page_that_reads_its_limit_ends_there_and_the_next_goes_on(tmp_path: Path) -> None:
    w = UsageWriter(tmp_path / "usage.jsonl")
    for i in range(40):
        w.write(make_event(request_id=rid(i), ts=at(100 - i),
                           status=429 if i in (3, 30) else 200))
    w.close()
    line = len(make_event(request_id=rid(0), ts=at(0)).to_json()) + 1
    refused = requests.Filters(status="refused")
    page = requests.request_log(w.path, refused, scan_bytes=20 * line)
    # 20 lines read (39 down to 20): one refusal among them, the page stops there
    assert ids(page) == [rid(30)] and page.stopped_at == at(100 - 20)
    assert page.older is not None
    page = requests.request_log(w.path, refused, tail.Position.decode(page.older),
                                scan_bytes=20 * line)
    assert ids(page) == [rid(3)] and page.older is None


def test_the_quick_look_before_parsing_never_drops_a_matching_line(tmp_path: Path) -> None:
    """Another encoder's spacing and escapes (cjson writes "/" as "\\/") still match."""
    usage = tmp_path / "usage.jsonl"
    first = ('{"request_id": "RID", "ts": "TS", "key_id": "a", "model": "Qwen\\/Qwen3-8B", '
             '"status": 429}')
    compact = '{"request_id":"RID","ts":"TS","key_id":"KEY","model":"m","status":STATUS}'
    lines = [first.replace("RID", rid(1)).replace("TS", at(3)),
             compact.replace("RID", rid(2)).replace("TS", at(2)).replace("KEY", "a")
             .replace("STATUS", "503"),
             compact.replace("RID", rid(3)).replace("TS", at(1)).replace("KEY", "b")
             .replace("STATUS", "200")]
    usage.write_text("\n".join(lines) + "\n")

    def shown(**f: str) -> list[int]:
        return [int(x, 16) for x in ids(requests.request_log(usage, requests.Filters(**f)))]

    assert shown(model="Qwen/Qwen3-8B") == [1]
    assert shown(status="refused") == [2, 1]
    assert shown(status="4xx") == [1] and shown(status="5xx") == [2]
    assert shown(status="answered", key="b") == [3]
    assert shown(key="a", status="429") == [1]


def test_a_request_is_found_by_its_place_or_by_a_search(tmp_path: Path) -> None:
    w = UsageWriter(tmp_path / "usage.jsonl")
    for i in range(5):
        w.write(make_event(request_id=rid(i), ts=at(10 - i)))
    settle(w.rotate(), 5)
    w.write(make_event(request_id=rid(9), ts=at(1)))
    w.close()
    row = requests.request_log(w.path, requests.Filters()).rows[-1]
    assert row.request_id == rid(0)
    place = tail.Position.decode(row.at)
    assert requests.find(w.path, rid(0), place)["ts"] == at(10)
    assert requests.find(w.path, rid(3))["request_id"] == rid(3)     # a search
    assert requests.find(w.path, rid(3), place)["request_id"] == rid(3)  # a wrong place
    assert requests.find(w.path, "f" * 32) is None


def test_a_cursor_into_a_file_that_is_gone_starts_again_from_the_newest(
        tmp_path: Path) -> None:
    w = UsageWriter(tmp_path / "usage.jsonl")
    w.write(make_event(request_id=rid(1), ts=at(2)))
    w.close()
    page = requests.request_log(w.path, requests.Filters(),
                                tail.Position("0" * 32, 100))
    assert ids(page) == [rid(1)]
    assert page.problem is not None and page.problem.startswith("the file that page was in")


# --- traffic ---------------------------------------------------------------------------

def test_a_latency_percentile_is_within_ten_percent() -> None:
    values = [3.0, 12.5, 40.0, 41.0, 99.0, 250.0, 1000.0, 12_000.0]
    for v in values:
        got = traffic.percentile(Counter([traffic.latency_bin(v)]), 0.5)
        assert got is not None and abs(got - v) / v < 0.10, v
    hist = Counter(traffic.latency_bin(float(v)) for v in range(1, 1001))
    p50, p95 = traffic.percentile(hist, 0.5), traffic.percentile(hist, 0.95)
    assert p50 is not None and abs(p50 - 500) / 500 < 0.10
    assert p95 is not None and abs(p95 - 950) / 950 < 0.10
    assert traffic.percentile(Counter(), 0.5) is None


def test_traffic_counts_each_event_once_across_updates_and_rotations(tmp_path: Path) -> None:
    """A refusal in a rotated file is counted (the Live page once lost those), a line a
    worker appends to the renamed file after the rotation too, and nothing twice."""
    w = UsageWriter(tmp_path / "usage.jsonl")
    t = traffic.Traffic(w.path, clock=lambda: NOW.timestamp())
    w.write(make_event(ts=at(125), status=429, error="rate_limit_exceeded"))  # 2 min ago
    w.write(make_event(ts=at(65), prompt_tokens=100, completion_tokens=7))    # 1 min ago
    t.update()
    rotated = w.rotate()
    w.write(make_event(ts=at(20), total_ms=1000.0, ttft_ms=None))              # this minute
    with open(rotated, "a") as late:   # a worker that has not reopened yet
        late.write(make_event(ts=at(25), status=404, error="model_not_found").to_json()
                   + "\n")
    t.update()
    t.update()
    assert t.refusals(3600) == [("model_not_found", 404, 1),
                                ("rate_limit_exceeded", 429, 1)]
    buckets = t.buckets(3 * 60, 60)
    minute = NOW.replace(second=0)
    assert [b.start for b in buckets] == [minute - timedelta(minutes=m) for m in (2, 1, 0)]
    assert [(b.counts.requests, b.counts.refused) for b in buckets] == [(1, 1), (1, 0), (2, 1)]
    assert buckets[1].counts.prompt_tokens == 100
    assert buckets[1].p50_ms == pytest.approx(410.25, rel=0.1)
    assert buckets[2].p50_ms == pytest.approx(1000, rel=0.1)
    assert buckets[0].p50_ms is None      # refused only: no answered latency
    assert t.refusals(60) == [("model_not_found", 404, 1)]    # the current minute
    w.close()


def test_traffic_reads_a_new_files_window_only_and_forgets_old_minutes(
        tmp_path: Path) -> None:
    w = UsageWriter(tmp_path / "usage.jsonl")
    for i in range(10):   # hours old, then within the last hour
        w.write(make_event(ts=at(3 * 3600 - i * 60)))
    for i in range(5):
        w.write(make_event(ts=at(600 - i * 60)))
    w.close()
    clock = [NOW.timestamp()]
    t = traffic.Traffic(w.path, keep_s=3600, clock=lambda: clock[0])
    t.update()
    assert sum(b.counts.requests for b in t.buckets(3600, 60)) == 5
    clock[0] += 3600
    t.update()
    assert sum(b.counts.requests for b in t.buckets(3600, 60)) == 0


def test_a_malformed_line_is_no_event(tmp_path: Path) -> None:
    w = UsageWriter(tmp_path / "usage.jsonl")
    w.write_raw(b"not json\n[1, 2]\n" + json.dumps({"ts": at(5)}).encode() + b"\n")
    w.write(make_event(request_id=rid(7), ts=at(1)))
    w.close()
    assert ids(requests.request_log(w.path, requests.Filters())) == [rid(7)]
    t = traffic.Traffic(w.path, clock=lambda: NOW.timestamp())
    t.update()
    assert sum(b.counts.requests for b in t.buckets(3600, 60)) == 1
