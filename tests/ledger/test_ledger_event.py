"""The usage event parser: what the edge writes, and what the ledger refuses."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from tokengate.ledger.event import EventError, parse_event

from tests.fixtures_ledger import make_event

# pure: starts no process of the stack (make test-unit)
pytestmark = pytest.mark.unit

LINE = ('{"request_id":"5d41402abc4b2a76b9719d911017c592","ts":"2026-11-29T16:40:00.123Z",'
        '"key_id":"demo","model":"tiny-qwen3","endpoint":"chat","status":200,"stream":true,'
        '"token_estimate":12,"count_source":"counter","reserved":268,"prompt_tokens":12,'
        '"completion_tokens":30,"cached_tokens":0,"system_tokens":5,"usage_source":"running",'
        '"client_aborted":true,"ttft_ms":35.5,"total_ms":410,"upstream":"127.0.0.1:8000",'
        '"error":null}')


def test_an_edge_line_parses_to_the_event():
    ev = parse_event(LINE.encode() + b"\n")
    assert ev.request_id == "5d41402abc4b2a76b9719d911017c592"
    assert ev.time == datetime(2026, 11, 29, 16, 40, 0, 123000, tzinfo=UTC)
    assert ev.day == "2026-11-29"
    assert (ev.key_id, ev.model, ev.endpoint, ev.status, ev.stream) == \
        ("demo", "tiny-qwen3", "chat", 200, True)
    assert (ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens, ev.system_tokens) == \
        (12, 30, 0, 5)
    assert (ev.usage_source, ev.client_aborted, ev.ttft_ms, ev.total_ms) == \
        ("running", True, 35.5, 410.0)
    assert parse_event(ev.to_json()) == ev


def test_a_rejected_request_has_nulls_where_allowed():
    obj = {**json.loads(LINE), "key_id": None, "model": None, "status": 401,
           "usage_source": "none", "count_source": "none", "prompt_tokens": 0,
           "completion_tokens": 0, "ttft_ms": None, "upstream": None, "error": "invalid_api_key"}
    ev = parse_event(json.dumps(obj))
    assert (ev.key_id, ev.model, ev.ttft_ms, ev.upstream, ev.error) == \
        (None, None, None, None, "invalid_api_key")


def test_uppercase_request_ids_are_normalised():
    assert parse_event(make_event(request_id="AB" * 16).to_json()).request_id == "ab" * 16


@pytest.mark.parametrize("change, field", [
    ({"request_id": "5d41402abc4b2a76b9719d911017c59"}, "request_id"),
    ({"ts": "2026-11-29T16:40:00.123+01:00"}, "ts"),
    ({"ts": "2026-02-30T00:00:00Z"}, "ts"),
    ({"key_id": ""}, "key_id"),
    ({"key_id": 7}, "key_id"),
    ({"endpoint": None}, "endpoint"),
    ({"status": 200.0}, "status"),
    ({"status": True}, "status"),
    ({"stream": 1}, "stream"),
    ({"token_estimate": -3}, "token_estimate"),
    ({"count_source": "guess"}, "count_source"),
    ({"reserved": "268"}, "reserved"),
    ({"cached_tokens": 13}, "cached_tokens"),
    ({"usage_source": "partial"}, "usage_source"),
    ({"client_aborted": None}, "client_aborted"),
    ({"ttft_ms": -1}, "ttft_ms"),
    ({"total_ms": None}, "total_ms"),
    ({"upstream": 8000}, "upstream"),
])
def test_a_wrong_field_is_named(change, field):
    with pytest.raises(EventError, match=f"^{field}"):
        parse_event(json.dumps({**json.loads(LINE), **change}))


@pytest.mark.parametrize("name", list(json.loads(LINE)))
def test_every_field_is_required(name):
    obj = json.loads(LINE)
    del obj[name]
    with pytest.raises(EventError, match=f"^{name}: missing"):
        parse_event(json.dumps(obj))


@pytest.mark.parametrize("line, why", [
    (b"{", "not JSON"),
    (b"\xff", "not UTF-8"),
    (b"[]", "not a JSON object"),
    (LINE[:-1].encode() + b',"status":201}', "status: duplicate key"),
    (LINE.replace('"total_ms":410', '"total_ms":Infinity').encode(), "Infinity"),
])
def test_malformed_lines_are_refused(line, why):
    with pytest.raises(EventError, match=why):
        parse_event(line)


def test_count_drift_is_signed_and_zero_when_absent():
    # LINE predates the field: an older edge's event
    assert parse_event(LINE).count_drift == 0
    for drift in (3, -2, 0):
        ev = parse_event(json.dumps({**json.loads(LINE), "count_drift": drift}))
        assert ev.count_drift == drift
        assert parse_event(ev.to_json()) == ev


@pytest.mark.parametrize("value", [1.5, "3", None, True, 2**60])
def test_a_count_drift_that_is_not_an_integer_is_named(value):
    with pytest.raises(EventError, match="^count_drift: expected an integer"):
        parse_event(json.dumps({**json.loads(LINE), "count_drift": value}))
