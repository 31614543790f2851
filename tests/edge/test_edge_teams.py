"""Teams and organizations at the edge: pooled windows and budgets over member keys,
reserved at every level in one step, on two edges sharing one limits sidecar and Redis.

Real processes: the counter, the limits sidecar (1 worker), a Redis of the test's own,
two nginx edges with ``global_limits.enabled``, and TokenStorm's fast upstream (it
generates exactly max_tokens, so a request uses exactly its reservation and the bounds
are exact numbers). The team's keys have limits far above the team's, so the team is
the level that binds; the organization test binds at the organization.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokengate import config as tg_config
from tokengate import redis_client
from tokengate.budget_store import nano
from tokengate.config import ModelCost
from tokengate.ledger import report
from tokengate.ledger.calculator import charge
from tokengate.ledger.ledger import Ledger
from tokengate.limits.window import window_keys
from tokengate_dev import devstack

from tests.conftest import MODEL, key_digest
from tests.edge.test_edge_global import (
    PRICES,
    _stopped,
    _with_global,
    post,
    start_edge,
    upstream_hostport,
)
from tests.fixtures_edge import EDGE_DIR, Edge, free_port
from tests.fixtures_ledger import svc_name, wait_until

__all__ = ["upstream_hostport"]  # the module fixture, shared with test_edge_global

TEAM_TPM = 3000            # tokens per minute of team "pool" (its keys: 1,000,000 each)
TEAM_SPEND = 10.0          # USD per day of team "spend" (its keys: no budget)
ORG_TPM = 2000             # tokens per minute of organization "acme"
MEMBERS = 4                # keys per team
BURST = 256                # concurrent requests spread over a team's keys and both edges


def member(team: str, i: int) -> str:
    return f"tg-test-{team}-{i}"


def _with_teams(upstream: str, sock: Path, name: str) -> Callable[[dict[str, Any]], None]:
    """YAML edit: ``_with_global``'s, plus teams "pool" (a pooled window), "spend" (a
    pooled daily budget) and "small" in organization "acme" (the organization's window
    binds), each with MEMBERS keys whose own limits never bind."""
    base = _with_global(upstream, sock, 3000, name)

    def edit(raw: dict[str, Any]) -> None:
        base(raw)
        raw["orgs"] = {"acme": {"rpm": 100_000, "tpm": ORG_TPM}}
        raw["teams"] = {
            "pool": {"rpm": 100_000, "tpm": TEAM_TPM},
            "spend": {"budgets": [{"period": "day", "spend": TEAM_SPEND}]},
            "small": {"org": "acme", "rpm": 100_000, "tpm": 1_000_000},
        }
        for team in raw["teams"]:
            for i in range(MEMBERS):
                raw["keys"][f"{team}-{i}"] = {"sha256": key_digest(member(team, i)),
                                              "rpm": 100_000, "tpm": 1_000_000, "team": team}
        # a budget of the key's own beside its team's (far above: never binds)
        raw["keys"]["spend-0"]["budgets"] = [{"period": "month", "spend": 1000.0}]

    return edit


def start_team_edge(config_path: Path, name: str, upstream: str, sock: Path) -> Edge:
    """An edge of the team configuration; stop it with ``edge.service.stop()``."""
    return start_edge(config_path, name, upstream, sock, limits_workers=1,
                      edit=_with_teams(upstream, sock, name))


@dataclass
class Teams:
    """Two edges, their limits sidecar and a Redis of the test's own."""

    a: Edge
    b: Edge
    redis: Any  # tests.fixtures_ledger.PrivateRedis


@contextlib.contextmanager
def team_stack(name: str, config_path: Path, upstream: str,
               private_redis: Callable[..., Any]) -> Iterator[Teams]:
    r = private_redis()
    sock = EDGE_DIR / name / "limits.sock"
    sock.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{sock}.0").unlink(missing_ok=True)
    sidecar = devstack.limits_service(config_path, free_port(), r.url, unix_socket=sock,
                                      workers=1, name=svc_name(f"test-{name}-limits"))
    sidecar.start()
    wait_until(lambda: Path(f"{sock}.0").exists(), 20, what="the limits socket")
    a = start_team_edge(config_path, f"{name}-a", upstream, sock)
    b = start_team_edge(config_path, f"{name}-b", upstream, sock)
    try:
        yield Teams(a, b, r)
    finally:
        a.service.stop()
        b.service.stop()
        sidecar.stop()


def burst(edges: list[Edge], team: str) -> list[tuple[Edge, httpx.Response]]:
    """BURST requests at once (32 threads), spread over the team's keys and the edges."""
    plan = [(edges[i % len(edges)], member(team, i % MEMBERS)) for i in range(BURST)]
    with ThreadPoolExecutor(32) as pool:
        return list(pool.map(lambda ek: (ek[0], post(ek[0], ek[1])), plan))


def split(answers: list[tuple[Edge, httpx.Response]]
          ) -> tuple[list[tuple[Edge, httpx.Response]], list[httpx.Response]]:
    """(the admitted answers with their edge, the refused answers)."""
    return ([(e, r) for e, r in answers if r.status_code == 200],
            [r for _e, r in answers if r.status_code != 200])


def used_tokens(answers: list[tuple[Edge, httpx.Response]]) -> int:
    return sum(r.json()["usage"]["prompt_tokens"] + r.json()["usage"]["completion_tokens"]
               for _e, r in answers)


def test_a_team_window_over_two_edges_admits_exactly_its_tpm(
        config_path: Path, counter_addr: str, upstream_hostport: str,
        private_redis: Callable[..., Any]) -> None:
    with team_stack("tm-tpm", config_path, upstream_hostport, private_redis) as st:
        ok, refused = split(burst([st.a, st.b], "pool"))
        cost = int(ok[0][1].headers["x-token-count"]) + 40  # max_tokens 40: used == reserved
        # the pooled window admits exactly what fits, on both edges together; each key's
        # own window (1,000,000) would have admitted all 256
        assert len(ok) == TEAM_TPM // cost
        assert used_tokens(ok) == len(ok) * cost <= TEAM_TPM
        assert {e.port for e, _r in ok} == {st.a.port, st.b.port}
        assert len({r.request.headers["authorization"] for _e, r in ok}) == MEMBERS
        assert {r.status_code for r in refused} == {429}
        for r in refused:
            err = r.json()["error"]
            assert (err["type"], err["code"]) == ("tokens", "rate_limit_exceeded")
            assert err["message"].startswith(
                f"Rate limit reached for tokens per minute (TPM) on team pool: limit {TEAM_TPM}")
            # the refusing level's headers: the team's window, not the key's
            assert r.headers["x-tokengate-limit-level"] == "team"
            assert r.headers["x-ratelimit-limit-tokens"] == str(TEAM_TPM)
            assert int(r.headers["x-ratelimit-remaining-tokens"]) < cost
        # the admitted answers show the tightest level: the team's window
        assert {r.headers["x-tokengate-limit-level"] for _e, r in ok} == {"team"}
        client = st.redis.client()
        assert int(client.hget(window_keys("team:pool")[1], "#sum")) == used_tokens(ok)
        client.close()
        # the edges' metrics count the refusals by the level that refused; a refusal is
        # counted in nginx's log phase, after its answer went out: wait for the last one
        def limited() -> float:
            return sum(float(line.rsplit(" ", 1)[1]) for e in (st.a, st.b)
                       for line in httpx.get(f"http://127.0.0.1:{e.status_port}/metrics",
                                             timeout=10).text.splitlines()
                       if line.startswith("tokengate_rate_limited_total{")
                       and 'level="team"' in line)
        wait_until(lambda: limited() >= len(refused), what="every refusal counted")
        assert limited() == len(refused)


def test_a_team_budget_over_two_edges_is_never_passed(
        config_path: Path, counter_addr: str, upstream_hostport: str,
        private_redis: Callable[..., Any]) -> None:
    with team_stack("tm-spend", config_path, upstream_hostport, private_redis) as st:
        ok, refused = split(burst([st.a, st.b], "spend"))
        cost = nano(charge(int(ok[0][1].headers["x-token-count"]), 40,
                           weights=ModelCost(**PRICES)).cost)
        budget = round(TEAM_SPEND * 1e9)
        assert len(ok) == budget // cost
        assert {r.status_code for r in refused} == {429}
        err = refused[0].json()["error"]
        assert (err["type"], err["code"]) == ("insufficient_quota", "insufficient_quota")
        assert err["message"].startswith("You exceeded your current quota on team spend (key "
                                         "spend-")
        assert refused[0].headers["x-tokengate-limit-level"] == "team"
        client = st.redis.client()
        (spend_key,) = client.keys("tg:bg:{team%3Aspend}:*:day:*:s")
        wait_until(lambda: int(client.get(spend_key) or 0) == len(ok) * cost, 10,
                   what="every settlement")
        assert int(client.get(spend_key)) <= budget
        client.close()


def test_an_organization_window_binds_its_teams_keys(
        config_path: Path, counter_addr: str, upstream_hostport: str,
        private_redis: Callable[..., Any]) -> None:
    with team_stack("tm-org", config_path, upstream_hostport, private_redis) as st:
        ok, refused = split(burst([st.a, st.b], "small"))
        cost = int(ok[0][1].headers["x-token-count"]) + 40
        assert len(ok) == ORG_TPM // cost
        r = refused[0]
        assert r.headers["x-tokengate-limit-level"] == "org"
        assert r.headers["x-ratelimit-limit-tokens"] == str(ORG_TPM)
        assert r.json()["error"]["message"].startswith(
            "Rate limit reached for tokens per minute (TPM) on organization acme")
        # the Anthropic shape: the same level's limit in anthropic-ratelimit-* headers
        m = httpx.post(f"{st.a.base_url}/messages", headers={"x-api-key": member("small", 0)},
                       json={"model": MODEL, "max_tokens": 40,
                             "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert m.status_code == 429
        assert m.json()["type"] == "error"
        assert m.json()["error"]["type"] == "rate_limit_error"
        assert m.headers["anthropic-ratelimit-tokens-limit"] == str(ORG_TPM)
        assert m.headers["x-tokengate-limit-level"] == "org"


def test_redis_stalled_each_edge_holds_a_team_to_its_own_window_and_budget(
        config_path: Path, counter_addr: str, upstream_hostport: str,
        private_redis: Callable[..., Any]) -> None:
    """Redis stopped (SIGSTOP) under the burst: each edge falls back to its own
    counters, which hold every level as they hold a key, so the team's window admits at
    most its TPM per edge (2 x TEAM_TPM over two edges) and its budget at most what
    Redis last left per edge."""
    with team_stack("tm-stall", config_path, upstream_hostport, private_redis) as st:
        # each edge hears the team's budget from Redis once (a budget never heard of
        # since nginx started is refused in fallback: 503 budget_unavailable)
        first = [post(e, member("spend", 0)) for e in (st.a, st.b)]
        assert [r.status_code for r in first] == [200, 200]
        cost_nano = nano(charge(int(first[0].headers["x-token-count"]), 40,
                                weights=ModelCost(**PRICES)).cost)
        left = round(TEAM_SPEND * 1e9) - 2 * cost_nano
        # the edges' windows stand still from here: the bursts may straddle a minute,
        # and the quota then read a window whose previous minute had begun to slide out
        with st.a.window_clock(here=True), st.b.window_clock(here=True), \
                _stopped(st.redis.svc.proc.pid):
            window = burst([st.a, st.b], "pool")
            spend = burst([st.a, st.b], "spend")
            # the quota endpoint answers from the edge's own counters meanwhile
            quota = httpx.get(f"{st.a.base_url}/key", timeout=30, headers={
                "Authorization": f"Bearer {member('pool', 0)}"}).json()["data"]
        ok = [(e, r) for e, r in window if r.status_code == 200]
        assert {r.headers["x-tokengate-limits"] for _e, r in ok} == {"local"}
        cost = int(ok[0][1].headers["x-token-count"]) + 40
        for edge in (st.a, st.b):
            mine = [(e, r) for e, r in ok if e is edge]
            assert used_tokens(mine) <= TEAM_TPM
            assert len(mine) == TEAM_TPM // cost  # each edge's own window, exactly
        assert used_tokens(ok) <= 2 * TEAM_TPM
        on_a = [(e, r) for e, r in ok if e is st.a]
        assert quota["source"] == "local"
        assert [(w["level"], w["requests"], w["tokens"]) for w in quota["limits"]][1] == \
            ("team", len(on_a), used_tokens(on_a))
        spent = [(e, r) for e, r in spend if r.status_code == 200]
        # each edge admits what Redis had left when it last heard from it: a (first) saw
        # only its own request there, b both; so a admits one more than b, and the two
        # together pass the budget by at most what was left (the fallback bound)
        fits = round(TEAM_SPEND * 1e9) // cost_nano
        assert [len([r for e, r in spent if e is edge]) for edge in (st.a, st.b)] == \
            [fits - 1, fits - 2]
        assert len(spent) * cost_nano <= 2 * left + cost_nano
        assert {r.json()["error"]["code"] for _e, r in spend if r.status_code != 200} == \
            {"insufficient_quota"}


def test_a_request_larger_than_the_team_window_is_told_retrying_cannot_help(
        config_path: Path, counter_addr: str, upstream_hostport: str,
        private_redis: Callable[..., Any]) -> None:
    with team_stack("tm-alone", config_path, upstream_hostport, private_redis) as st:
        r = post(st.a, member("pool", 0), content="hi " * TEAM_TPM)
        assert r.status_code == 429
        assert r.headers["x-should-retry"] == "false"
        assert r.headers["x-tokengate-limit-level"] == "team"
        assert r.json()["error"]["message"].startswith("Request too large for team pool: ")


def test_the_quota_endpoint_shows_the_key_and_its_team_as_the_ledger_bills_them(
        config_path: Path, counter_addr: str, upstream_hostport: str, redis_url: str,
        private_redis: Callable[..., Any]) -> None:
    with team_stack("tm-quota", config_path, upstream_hostport, private_redis) as st:
        sent = [post(st.a, member("spend", 0)) for _ in range(5)] + \
            [post(st.b, member("spend", 1)) for _ in range(3)]
        assert {r.status_code for r in sent} == {200}
        client = st.redis.client()
        wait_until(lambda: all(client.get(f"tg:bg:{{spend-{k}}}:r:{r.headers['x-request-id']}")
                               == "settled" for k, rs in ((0, sent[:5]), (1, sent[5:]))
                               for r in rs), 10, what="every settlement")
        client.close()
        # asked on the other edge: Redis's figures, every edge's
        got = httpx.get(f"{st.b.base_url}/key",
                        headers={"Authorization": f"Bearer {member('spend', 0)}"}, timeout=10)
        assert got.status_code == 200
        data = got.json()["data"]
        assert (data["label"], data["team"], data["org"], data["source"]) == \
            ("spend-0", "spend", None, "global")
        assert [(w["level"], w["name"], w["requests"]) for w in data["limits"]] == \
            [("key", "spend-0", 5)]
        by_level = {b["level"]: b for b in data["budgets"]}
        assert set(by_level) == {"key", "team"}  # nobody else's
        # the ledger's bill of the two edges' usage events
        cfg = tg_config.load(EDGE_DIR / "tm-quota-a" / "tokengate.yaml")
        for edge in (st.a, st.b):
            ledger = Ledger(cfg, redis_client.connect(cfg.redis, url=st.redis.url),
                            edge.usage_file)
            ledger.drain()
            ledger.client.close()
        rows = report.query(redis_client.connect(cfg.redis, url=st.redis.url))
        billed = {k: sum(r.cost for r in rows if r.key_id == k)
                  for k in ("spend-0", "spend-1")}
        tokens = {k: sum(r.prompt_tokens + r.completion_tokens for r in rows if r.key_id == k)
                  for k in ("spend-0", "spend-1")}
        key, team = by_level["key"], by_level["team"]
        # each request's cost is counted in whole nano-units, rounded up (the edge's and
        # the ledger's budget rounding): equal to the ledger's to that rounding
        assert key["spent"] == pytest.approx(billed["spend-0"], abs=5e-9)
        assert team["spent"] == pytest.approx(billed["spend-0"] + billed["spend-1"], abs=8e-9)
        assert (key["tokens_used"], team["tokens_used"]) == \
            (tokens["spend-0"], tokens["spend-0"] + tokens["spend-1"])
        assert (key["reserved"], team["reserved"]) == (0, 0)
        assert (key["spend_limit"], team["spend_limit"]) == (1000.0, TEAM_SPEND)
        assert team["period"] == "day" and team["resets_at"].endswith("T00:00:00Z")
        # the tightest spend limit, in OpenRouter's fields
        assert data["limit"] == TEAM_SPEND
        assert data["usage"] == team["spent"]
        assert data["limit_remaining"] == pytest.approx(TEAM_SPEND - team["spent"], abs=1e-9)
        unauth = httpx.get(f"{st.b.base_url}/key", timeout=10)
        assert unauth.status_code == 401
        # `tokengate usage --by team` bills the team what the quota shows as spent
        out = subprocess.run([sys.executable, "-m", "tokengate.cli", "usage", "--config",
                              str(cfg.path), "--redis-url", st.redis.url, "--by", "team",
                              "--json"], capture_output=True, text=True, check=False)
        assert out.returncode == 0, out.stderr
        out = out.stdout
        (row,) = json.loads(out)["rows"]
        # 8 completions and the GET /v1/key (a request of the key that costs nothing)
        assert (row["team"], row["key_id"], row["requests"]) == ("spend", None, 9)
        assert row["cost"] == pytest.approx(team["spent"], abs=8e-9)
        assert row["prompt_tokens"] + row["completion_tokens"] == team["tokens_used"]
