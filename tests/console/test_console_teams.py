"""The console's team page: members, the pooled budgets' bill of this period and the
alerts sent, through the WSGI application on a real Redis the ledger filled."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml
from tokengate import config as tg_config
from tokengate import redis_client
from tokengate.console import app as console_app
from tokengate.console.cli import set_admin
from tokengate.ledger.alerts import BudgetAlerts
from tokengate.ledger.ledger import Ledger

from tests.conftest import MODEL, key_digest
from tests.console.test_console_unit import (
    PORT,
    _login,
    admin_digest,
    repo_config_without_console,
)
from tests.fixtures_ledger import UsageWriter, make_event


def test_a_team_page_shows_members_pooled_spend_and_alerts_sent(
        tmp_path: Path, private_redis: Callable[..., Any]) -> None:
    r = private_redis()
    path = tmp_path / "tokengate.yaml"
    raw = yaml.safe_load(repo_config_without_console())
    raw["redis"]["url"] = r.url
    raw["global_limits"]["enabled"] = True
    raw["ledger"]["console"] = {"listen": f"127.0.0.1:{PORT}"}
    raw["teams"] = {"t": {"rpm": 100, "tpm": 9000,
                          "budgets": [{"period": "day", "spend": 0.001, "alerts": [50]}]}}
    for i in (1, 2):
        raw["keys"][f"t-{i}"] = {"sha256": key_digest(f"tg-test-t-{i}"), "rpm": 10,
                                 "tpm": 1000, "team": "t"}
    path.write_text(yaml.safe_dump(raw))
    set_admin(path, "alice", admin_digest())
    cfg = tg_config.load(path)
    # the ledger bills 6 + 4 events of the two members; the team crosses 50 % of 0.001
    writer = UsageWriter(tmp_path / "usage.jsonl")
    now = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    for key_id, n in (("t-1", 6), ("t-2", 4)):
        for _ in range(n):
            writer.write(make_event(key_id=key_id, model=MODEL, ts=now))
    writer.close()
    client = redis_client.connect(cfg.redis, url=r.url)
    Ledger(cfg, client, writer.path).drain()
    assert BudgetAlerts(lambda: cfg, client, "test").check() == 1
    app = console_app.Console(path, client, writer.path)
    http = httpx.Client(transport=httpx.WSGITransport(app=app),
                        base_url=f"http://127.0.0.1:{PORT}")
    login = _login(http)
    assert login.status_code == 303
    token = re.search(r"tg_console=([^;]+)", login.headers.get_list("set-cookie")[0])
    assert token is not None
    http.headers["Cookie"] = f"tg_console={token[1]}"
    page = http.get("/teams/t")
    assert page.status_code == 200, page.text[-500:]
    members = re.search(r'id="team-members">(.*?)</dd>', page.text)
    assert members is not None
    assert re.findall(r">(t-\d)</a>", members[1]) == ["t-1", "t-2"]
    spent = re.search(r'data-spent="([^"]+)"', page.text)
    assert spent is not None
    # every member's bill: 10 events of 12 prompt + 30 completion tokens at 1.0 / 1.35
    assert float(spent[1]) == round(10 * (12 * 1.0 + 30 * 1.35) / 1e6, 9)
    alerts = re.search(r'id="team-alerts">(.*?)</dd>', page.text)
    assert alerts is not None and alerts[1].endswith("/spend/50")
    assert "9,000 tokens per minute" in page.text
    assert 'href="/teams/t"' in http.get("/keys/t-1").text
    missing = http.get("/teams/nobody")
    assert missing.status_code == 404 and "There is no team named" in missing.text
    client.close()
