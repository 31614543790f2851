"""The console's pages that read the ledger's Redis (the session's real one): the audit
page and the Usage filter's keys."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from tokengate import redis_keys
from tokengate.console import app as console_app
from tokengate.console import changes, data
from tokengate.console.cli import set_admin

from tests.console.test_console_unit import (
    PORT,
    _session,
    admin_digest,
    repo_config_without_console,
)


@pytest.fixture
def console(tmp_path: Path, ledger_redis: redis.Redis) -> tuple[httpx.Client, Any]:
    path = tmp_path / "tokengate.yaml"
    path.write_text(repo_config_without_console())
    set_admin(path, "alice", admin_digest())
    path.write_text(path.read_text().replace(
        "  console:\n", f"  console:\n    listen: 127.0.0.1:{PORT}\n"))
    app = console_app.Console(path, ledger_redis, tmp_path / "usage.jsonl")
    http = httpx.Client(transport=httpx.WSGITransport(app=app),
                        base_url=f"http://127.0.0.1:{PORT}")
    return http, app


def test_the_audit_page_lists_the_changes_newest_first_escaped(
        console: Any, ledger_redis: redis.Redis) -> None:
    http, app = console
    headers, _csrf = _session(http, app)       # audited: a login by alice
    # a billed request's entry (tokengate.ledger.join's), then a command line change
    ledger_redis.xadd(redis_keys.AUDIT_KEY, {"rid": "r-1", "ts": "2026-12-05T10:00:00Z",
                                             "key": "demo", "status": "200"})
    changes.audit(ledger_redis, 1000, "root", "key_changed", "cli", "<b>demo</b>",
                  '{"rpm": "<script>alert(1)</script>"}')
    page = http.get("/audit", headers=headers)
    assert page.status_code == 200
    rows = re.findall(r'<tr data-id="[^"]+"><td>[^<]*</td><td>([^<]*)</td><td>([^<]*)</td>'
                      r'<td>([^<]*)</td><td>([^<]*)</td><td><code>([^<]*)</code>', page.text)
    assert rows == [
        ("console", "root", "key_changed", "&lt;b&gt;demo&lt;/b&gt;",
         "{&#34;rpm&#34;: &#34;&lt;script&gt;alert(1)&lt;/script&gt;&#34;}"),
        ("console", "alice", "login", "", ""),
    ]
    every = http.get("/audit?all=1", headers=headers).text
    assert len(re.findall(r'<tr data-id=', every)) == 3
    assert "rid=r-1 status=200" in every


def test_the_audit_stream_is_read_in_pages_and_bounded(ledger_redis: redis.Redis) -> None:
    for i in range(1200):
        ledger_redis.xadd(redis_keys.AUDIT_KEY, {"rid": f"r-{i}", "key": "demo"})
        if i % 400 == 0:
            changes.audit(ledger_redis, 100_000, "alice", "key_changed", "10.0.0.1",
                          f"k{i}")
    entries, scanned = data.audit_entries(ledger_redis, 2, 20_000)
    assert [e.key for e in entries] == ["k800", "k400"]
    assert scanned == 399 + 1 + 400 + 1   # newest first, up to the second change
    entries, scanned = data.audit_entries(ledger_redis, 10, 700)
    assert ([e.key for e in entries], scanned) == (["k800"], 700)


def test_a_revoked_keys_usage_can_be_picked_in_the_usage_filter(
        console: Any, ledger_redis: redis.Redis) -> None:
    http, app = console
    headers, _csrf = _session(http, app)
    day = data.today() - timedelta(days=1)
    # the ledger's day index (tokengate.ledger): a key no longer in the file had usage
    ledger_redis.zadd(redis_keys.DAYS_KEY, {day.isoformat(): redis_keys.day_score(
        day.isoformat())})
    ledger_redis.sadd(redis_keys.idx_key(day.isoformat()), '["gone-team", "tiny-qwen3"]',
                      '["demo", "tiny-qwen3"]')
    page = http.get("/usage?key=gone-team", headers=headers).text
    options = re.findall(r'<option(?: selected)?>([^<]*)</option>',
                         page.split('id="key"')[1].split("</select>")[0])
    assert options == ["demo", "gone-team"]
    assert "<option selected>gone-team</option>" in page
