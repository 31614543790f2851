"""Teams in the ledger's per-day counters: every request is also counted for its key's
team and organization as the ledger applies it, so ``tokengate usage --by team`` keeps
each team's history when a key moves to another team (``--by key,team`` shows each key
under its team now)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from tokengate import config as tg_config
from tokengate import redis_client
from tokengate.ledger.ledger import Ledger

from tests.conftest import MODEL, key_digest
from tests.fixtures_ledger import UsageWriter, make_event
from tests.ledger.test_ledger_report import usage_json


def team_config(base: Path, out: Path, team: str) -> tg_config.Config:
    raw: dict[str, Any] = yaml.safe_load(base.read_text())
    raw["orgs"] = {"acme": {}}
    raw["teams"] = {"red": {"org": "acme"}, "blue": {"org": "acme"}}
    raw["keys"]["mover"] = {"sha256": key_digest("tg-test-mover"), "rpm": 10, "tpm": 1000,
                            "team": team}
    out.write_text(yaml.safe_dump(raw))
    return tg_config.load(out)


@pytest.mark.usefixtures("ledger_redis")
def test_a_key_moved_to_another_team_leaves_its_history_with_the_first(
        config_path: Path, redis_url: str, tmp_path: Path) -> None:
    writer = UsageWriter(tmp_path / "usage.jsonl")
    path = tmp_path / "tokengate.yaml"
    for team, n in (("red", 3), ("blue", 2)):
        cfg = team_config(config_path, path, team)
        for _ in range(n):
            writer.write(make_event(key_id="mover", model=MODEL))
        client = redis_client.connect(cfg.redis, url=redis_url)
        Ledger(cfg, client, writer.path, "teams").drain()
        client.close()
    writer.close()
    by_team = {r["team"]: r for r in usage_json(path, redis_url, "--by", "team")["rows"]}
    assert {t: r["requests"] for t, r in by_team.items()} == {"red": 3, "blue": 2}
    one = make_event()  # 12 prompt + 30 completion tokens at 1.0 / 1.35 per 1M
    assert by_team["red"]["cost"] == pytest.approx(3 * (12 + 30 * 1.35) / 1e6, rel=1e-9)
    assert by_team["blue"]["completion_tokens"] == 2 * one.completion_tokens
    # the organization's counters hold both
    (acme,) = usage_json(path, redis_url, "--by", "org")["rows"]
    assert (acme["org"], acme["requests"]) == ("acme", 5)
    # with keys: each key under its team now
    (now,) = usage_json(path, redis_url, "--by", "key,team")["rows"]
    assert (now["key_id"], now["team"], now["requests"]) == ("mover", "blue", 5)

