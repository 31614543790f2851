"""Budget alerts: two real ``tokengate-ledger`` processes on one Redis, the usage events of
two edges' files, and a real webhook receiver (an HTTP server that checks the signature
and can refuse). Each threshold of each period reaches the receiver exactly once, across
a kill -9 of a ledger while deliveries are pending, with both ledgers watching the same
budgets; failed deliveries are retried."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from tokengate import redis_keys
from tokengate_dev import devstack

from tests.conftest import MODEL, key_digest
from tests.fixtures_ledger import make_event, svc_name, wait_until

SECRET = "tg-test-alert-secret"
TEAM_SPEND = 0.0005   # USD per day; an event of 12 + 30 tokens costs 0.0000525
KEY_TOKENS = 1000     # tokens per day of key al-1; an event uses 42


class Receiver:
    """A webhook receiver: answers 503 while ``failing``, else 204; keeps every POST."""

    def __init__(self) -> None:
        self.failing = True
        self.posts: list[tuple[int, dict[str, str], bytes]] = []  # (status sent, ...)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                status = 503 if outer.failing else 204
                outer.posts.append((status, dict(self.headers), body))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/budget"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def delivered(self) -> list[dict[str, Any]]:
        """The alerts acknowledged (2xx), in order."""
        return [json.loads(b) for s, _h, b in self.posts if s == 204]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()


def alerts_config(config_path: Path, out: Path, url: str) -> Path:
    raw = yaml.safe_load(config_path.read_text())
    raw["global_limits"] = {"enabled": True, "listen": "127.0.0.1:1"}
    raw["teams"] = {"al": {"budgets": [{"period": "day", "spend": TEAM_SPEND,
                                        "alerts": [50, 80, 100]}]}}
    for i in (1, 2):
        raw["keys"][f"al-{i}"] = {"sha256": key_digest(f"tg-test-al-{i}"), "rpm": 100,
                                  "tpm": 100_000, "team": "al"}
    raw["keys"]["al-1"]["budgets"] = [{"period": "day", "tokens": KEY_TOKENS,
                                       "alerts": [50]}]
    raw["alerts"] = {"webhooks": [{"url": url, "secret": SECRET}],
                     "retry_initial_s": 0.2, "retry_max_s": 1.0}
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


def write(path: Path, key_id: str, n: int) -> None:
    now = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    with path.open("a") as f:
        for _ in range(n):
            f.write(make_event(key_id=key_id, model=MODEL, ts=now).to_json() + "\n")


def test_each_threshold_reaches_the_webhook_once_across_a_ledger_kill_9(
        config_path: Path, tmp_path: Path, receiver: Receiver,
        private_redis: Callable[..., Any]) -> None:
    r = private_redis(persist=True)
    cfg = alerts_config(config_path, tmp_path / "tokengate.yaml", receiver.url)
    usage = [tmp_path / "edge-1.jsonl", tmp_path / "edge-2.jsonl"]
    for u in usage:
        u.touch()
    ledgers = [devstack.ledger_service(cfg, u, r.url, ledger_id=f"al-{i}",
                                       name=svc_name(f"test-alerts-{i}"))
               for i, u in enumerate(usage)]
    client = r.client()
    try:
        for svc in ledgers:
            svc.log_path.unlink(missing_ok=True)  # (this run's lines only)
            svc.start()
        # the team crosses 50 % (6 events) and 80 % (9) over both edges; the receiver
        # refuses: every delivery stays pending and is retried
        write(usage[0], "al-1", 6)
        write(usage[1], "al-2", 3)
        team = f"team:al/*:day:{(datetime.now(UTC).date() - datetime(1970, 1, 1).date()).days}"
        claimed = [f"{team}/spend/{p}" for p in (50, 80)]
        wait_until(lambda: all(client.exists(redis_keys.alert_mark(a)) for a in claimed), 20,
                   what="the 50 % and 80 % alerts claimed")
        wait_until(lambda: len([p for p in receiver.posts if p[0] == 503]) >= 4, 20,
                   what="deliveries refused and retried")
        assert len(client.hgetall(redis_keys.ALERTS_KEY)) == 2
        # kill -9 of a ledger with deliveries pending, then more spend: 100 % of the team
        # and 50 % of key al-1's own token quota (12 events of 42 tokens)
        proc = ledgers[0].proc
        assert proc is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        write(usage[0], "al-1", 6)
        ledgers[0].start()
        wait_until(lambda: len(client.hgetall(redis_keys.ALERTS_KEY)) == 4, 20,
                   what="the 100 % and key alerts claimed")
        receiver.failing = False
        wait_until(lambda: client.hlen(redis_keys.ALERTS_KEY) == 0, 20,
                   what="every alert delivered")
    finally:
        for svc in ledgers:
            svc.stop()
        client.close()
    # one log line per claim, across both ledgers and the restart
    lines = [line for svc in ledgers for line in svc.log_path.read_text().splitlines()
             if "budget alert: " in line]
    assert len(lines) == 4
    assert any("budget alert: team al's daily spend budget (every model) reached 100%" in line
               for line in lines)
    got = receiver.delivered()
    ids = [a["id"] for a in got]
    key = f"key:al-1/*:day:{team.rsplit(':', 1)[1]}/tokens/50"
    assert sorted(ids) == sorted([*claimed, f"{team}/spend/100", key])  # each once
    for status, headers, body in receiver.posts:
        t, v1 = (p.split("=", 1)[1] for p in headers["X-Tokengate-Signature"].split(","))
        want = hmac.new(SECRET.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
        assert hmac.compare_digest(v1, want)
        assert headers["X-Tokengate-Alert-Id"] == json.loads(body)["id"]
        assert status in (204, 503)
    by_id = {a["id"]: a for a in got}
    hundred = by_id[f"{team}/spend/100"]
    assert (hundred["level"], hundred["name"], hundred["kind"], hundred["limit"],
            hundred["currency"]) == ("team", "al", "spend", TEAM_SPEND, "USD")
    assert hundred["used"] >= TEAM_SPEND
    assert (by_id[key]["level"], by_id[key]["limit"]) == ("key", KEY_TOKENS)
    assert by_id[key]["used"] >= KEY_TOKENS / 2
