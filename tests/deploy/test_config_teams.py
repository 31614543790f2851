"""Teams and organizations in tokengate.yaml: the schema's rules, the compiled levels the
edge reads, and ``tokengate keys --team``."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from tokengate import config as tg_config
from tokengate.ledger.alerts import sign
from tokengate.tools import compile_config

from tests.conftest import MODEL
from tests.deploy.test_config import errors_of, put
from tests.doc_pages import code_block

DAY = {"period": "day", "spend": 5.0}


@pytest.fixture
def raw(config_path: Path) -> dict[str, Any]:
    r = yaml.safe_load(config_path.read_text())
    r["global_limits"] = {"enabled": True}
    r["orgs"] = {"acme": {"rpm": 100, "tpm": 9000, "allowed_models": [MODEL],
                          "budgets": [{"period": "month", "spend": 50.0}]}}
    r["teams"] = {"eng": {"org": "acme", "rpm": 50, "tpm": 4000, "budgets": [DAY]}}
    r["keys"]["demo"]["team"] = "eng"
    return r


@pytest.mark.parametrize(("edit", "error"), [
    (put("keys.demo.team", "nobody"), "keys.demo.team: 'nobody' is not in teams"),
    (put("teams.eng.org", "nobody"), "teams.eng.org: 'nobody' is not in orgs"),
    (put("teams.eng.tpm", None), "teams.eng.tpm: a pooled window needs both rpm and tpm"),
    (put("teams.eng.allowed_models", ["other"]),
     f"teams.eng.allowed_models.0: 'other' is not a configured model ({MODEL})"),
    (put("teams.e:g", {}), ("teams.e:g: a name is 1-64 letters, digits, '.', '_', '-' or "
                            "'@', starting with a letter or digit")),
    (put("global_limits.enabled", False),
     "teams.eng.budgets: budgets need global_limits.enabled: true"),
    (put("redis.cluster", True),
     "teams.eng: pooled limits and budgets in Redis need one Redis (redis.cluster: false)"),
    (put("teams.eng.budgets", [DAY, DAY]),
     "teams.eng.budgets.1: a second day budget for every model"),
])
@pytest.mark.unit
def test_a_team_the_file_cannot_hold_is_refused_naming_the_key(
        raw: dict[str, Any], tmp_path: Path, edit: Any, error: str) -> None:
    assert any(e.startswith(error) for e in errors_of(raw, edit, tmp_path)), error


def test_a_key_of_a_team_compiles_to_its_levels_and_their_model_intersection(
        raw: dict[str, Any], tmp_path: Path) -> None:
    r = copy.deepcopy(raw)
    r["keys"]["demo"]["allowed_models"] = [MODEL]
    cfg = tg_config.parse(r, tmp_path / "tokengate.yaml")
    doc = compile_config.compile_config(cfg)
    key = doc["keys"][cfg.keys["demo"].sha256]
    assert key["team"] == "eng"
    assert key["levels"] == [
        {"level": "team", "name": "eng", "id": "team:eng", "rpm": 50, "tpm": 4000,
         "budgets": [{"period": "day", "spend": 5.0, "tokens": None, "model": None,
                      "alerts": []}]},
        {"level": "org", "name": "acme", "id": "org:acme", "rpm": 100, "tpm": 9000,
         "budgets": [{"period": "month", "spend": 50.0, "tokens": None, "model": None,
                      "alerts": []}]}]
    assert key["allowed_models"] == [MODEL]
    # the webhooks' secrets stay with the ledger
    assert "alerts" not in compile_config.compile_config(tg_config.parse(
        {**r, "alerts": {"webhooks": [{"url": "https://hooks.example/x", "secret": "s"}]}},
        tmp_path / "tokengate.yaml"))
    # a team that allows no model the key may use: the key may use none
    r["teams"]["eng"]["allowed_models"] = [MODEL]
    r["orgs"]["acme"]["allowed_models"] = [MODEL]
    r["keys"]["demo"]["allowed_models"] = None
    doc = compile_config.compile_config(tg_config.parse(r, tmp_path / "tokengate.yaml"))
    assert doc["keys"][cfg.keys["demo"].sha256]["allowed_models"] == [MODEL]


def test_keys_create_and_set_put_a_key_in_a_team_and_list_shows_it(
        raw: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "tokengate.yaml"
    path.write_text(yaml.safe_dump(raw))
    cmd = [sys.executable, "-m", "tokengate.cli", "keys"]
    common = ["--config", str(path), "--no-apply"]
    made = subprocess.run([*cmd, "create", "k1", "--rpm", "5", "--tpm", "100", "--team", "eng",
                           *common], capture_output=True, text=True, check=False)
    assert made.returncode == 0, made.stderr
    assert tg_config.load(path).keys["k1"].team == "eng"
    bad = subprocess.run([*cmd, "set", "k1", "--team", "nobody", *common],
                         capture_output=True, text=True, check=False)
    assert bad.returncode == 1
    assert "keys.k1.team: 'nobody' is not in teams" in bad.stderr
    listed = subprocess.run([*cmd, "list", "--json", "--config", str(path), "--redis-url",
                             "redis://127.0.0.1:1/0"], capture_output=True, text=True,
                            check=True).stdout
    assert next(k for k in json.loads(listed)["keys"] if k["name"] == "k1")["team"] == "eng"
    dropped = subprocess.run([*cmd, "set", "k1", "--team", "", *common],
                             capture_output=True, text=True, check=False)
    assert dropped.returncode == 0, dropped.stderr
    assert tg_config.load(path).keys["k1"].team is None


def test_the_teams_page_configuration_is_a_valid_file(config_path: Path,
                                                      tmp_path: Path) -> None:
    raw = yaml.safe_load(config_path.read_text())
    raw["global_limits"] = {"enabled": True}
    raw.update(yaml.safe_load(code_block("operators/teams.md", "yaml").replace(
        "tiny-qwen3", MODEL)))
    cfg = tg_config.parse(raw, tmp_path / "tokengate.yaml")
    assert (cfg.keys["alice"].team, cfg.teams["research"].org) == ("research", "acme")


def test_the_alerts_page_configuration_is_a_valid_file_and_its_verifier_checks(
        config_path: Path, tmp_path: Path) -> None:
    raw = yaml.safe_load(config_path.read_text())
    raw["global_limits"] = {"enabled": True}
    raw.update(yaml.safe_load(code_block("operators/alerts.md", "yaml")))
    cfg = tg_config.parse(raw, tmp_path / "tokengate.yaml")
    assert cfg.teams["research"].budgets[0].alerts == [50, 80, 100]
    assert cfg.alerts.webhooks[0].url == "https://hooks.example.com/tokengate"
    scope: dict[str, Any] = {}
    exec(code_block("operators/alerts.md", "python"), scope)  # noqa: S102 (the page's own)
    body = b'{"id":"x"}'
    assert scope["verify"]("s", sign("s", 1700000000, body), body)
    assert not scope["verify"]("s", sign("other", 1700000000, body), body)
