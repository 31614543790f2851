"""Browsers calling the API from pages of other origins (edge.cors): a preflight is
answered by the edge without a key, and every answer to an allowed origin carries
Access-Control-Allow-Origin and exposes the limit headers, errors and 429s included.
Requests as a browser sends them (Fetch standard, CORS protocol), with httpx: the
headers are what is tested, no browser is needed to send them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from tokengate import config as tg_config
from tokengate.config import ConfigError

from tests.conftest import MODEL, PORT_OFFSET, REPO_CONFIG
from tests.fixtures_edge import EDGE_DIR, MAIN_KEY, Edge
from tests.fixtures_ledger import wait_until

APP = "https://app.example.com"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
# what the openai JavaScript SDK asks for on its preflight
ASKED = ("authorization,content-type,x-stainless-arch,x-stainless-lang,x-stainless-os,"
         "x-stainless-package-version,x-stainless-retry-count,x-stainless-runtime,"
         "x-stainless-runtime-version,x-stainless-timeout")
PREFLIGHT_VARY = "Origin, Access-Control-Request-Method, Access-Control-Request-Headers"
EXPOSED = {"x-request-id", "x-token-count", "x-token-count-source", "x-tokengate-limits",
           "x-tokengate-max-tokens-capped", "x-tokengate-upstream",
           "retry-after", "x-ratelimit-limit-requests", "x-ratelimit-limit-tokens",
           "x-ratelimit-remaining-requests", "x-ratelimit-remaining-tokens",
           "x-ratelimit-reset-requests", "x-ratelimit-reset-tokens", "x-budget-limit-spend",
           "x-budget-remaining-spend", "x-budget-reset-spend", "x-budget-limit-tokens",
           "x-budget-remaining-tokens", "x-budget-reset-tokens",
           # the Messages API's own (tokengate.apis.messages)
           *(f"anthropic-ratelimit-{k}-{w}" for k in ("requests", "tokens")
             for w in ("limit", "remaining", "reset"))}


def _edge(start: Callable[..., Edge], fast_upstream_url: str, name: str,
          origins: list[str] | None) -> Edge:
    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [fast_upstream_url.removeprefix("http://")
                                             .removesuffix("/v1")]
        if origins is not None:
            raw["edge"]["cors"] = {"allow_origins": origins, "max_age_s": 3600}
    return start(name, edit)


@pytest.fixture
def cors_edge(edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str) -> Edge:
    """An edge in front of the fast upstream that lets APP and http://localhost:3000 in."""
    return _edge(edge_variant_off_vllm, fast_upstream_url, "cors",
                 [APP, "http://LOCALHOST:3000"])


def preflight(edge: Edge, path: str, origin: str, method: str = "POST",
              asked: str | None = ASKED) -> httpx.Response:
    headers = {"Origin": origin, "Access-Control-Request-Method": method}
    if asked is not None:
        headers["Access-Control-Request-Headers"] = asked
    return httpx.options(f"{edge.base_url}{path}", headers=headers, timeout=10)


def test_a_preflight_from_an_allowed_origin_is_answered_204_without_a_key(
        cors_edge: Edge) -> None:
    r = preflight(cors_edge, "/chat/completions", APP)
    assert r.status_code == 204 and r.content == b""
    assert (r.headers["access-control-allow-origin"], r.headers["access-control-allow-methods"],
            r.headers["access-control-allow-headers"], r.headers["access-control-max-age"],
            r.headers["vary"]) == (APP, "POST", ASKED, "3600", PREFLIGHT_VARY)
    assert "access-control-allow-credentials" not in r.headers
    # the model list takes GET and HEAD; the origin is compared without case
    r = preflight(cors_edge, "/models", "http://localhost:3000", "GET", asked=None)
    assert r.status_code == 204
    assert (r.headers["access-control-allow-origin"], r.headers["access-control-allow-methods"]) \
        == ("http://localhost:3000", "GET, HEAD")
    assert "access-control-allow-headers" not in r.headers
    # a path that is no route: its 404, readable by the page (not the key's 401)
    r = preflight(cors_edge, "/audio/speech", APP)
    assert (r.status_code, r.headers["access-control-allow-origin"], r.json()["error"]) == \
        (404, APP, {"message": "Invalid URL (OPTIONS /v1/audio/speech)",
                    "type": "invalid_request_error", "param": None, "code": "unknown_url"})
    # counted in the log phase, after the answer was sent
    wait_until(lambda: cors_edge.status()["cors_preflight_refused"] == 1)
    m = cors_edge.status()
    assert (m["cors_preflight_allowed"], m["cors_preflight_refused"],
            m["unauthenticated_missing_key"]) == (2, 1, 0)
    assert cors_edge.events() == []


def test_the_batch_apis_paths_answer_preflights_and_carry_cors_headers(
        cors_edge: Edge) -> None:
    # /v1/files and /v1/batches are served by the batch service behind the edge: their
    # preflight is answered without a key all the same, with the Batch API's methods
    for path, method in (("/files", "POST"), ("/batches/batch_1/cancel", "POST"),
                         ("/files/file-1", "DELETE")):
        r = preflight(cors_edge, path, APP, method)
        assert r.status_code == 204, (path, r.text)
        assert (r.headers["access-control-allow-origin"],
                r.headers["access-control-allow-methods"],
                r.headers["access-control-allow-headers"]) == (APP, "GET, POST, DELETE", ASKED)
    r = preflight(cors_edge, "/files", "https://evil.example")
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    # their answers are readable by the page: the key's 401, the 502 of this edge, that
    # has no batch service behind it
    with httpx.Client(base_url=cors_edge.base_url, timeout=30, headers={"Origin": APP}) as c:
        no_key = c.get("/files")
        down = c.get("/batches", headers={"Authorization": f"Bearer {MAIN_KEY}"})
    assert (no_key.status_code, down.status_code) == (401, 502), down.text
    assert down.json()["error"]["type"] == "server_error"
    for r in (no_key, down):
        assert (r.headers["access-control-allow-origin"], r.headers["vary"]) == (APP, "Origin")
        assert "x-token-count" in r.headers["access-control-expose-headers"].lower()
    wait_until(lambda: cors_edge.status()["cors_preflight_refused"] == 1)
    m = cors_edge.status()
    assert (m["cors_preflight_allowed"], m["unauthenticated_missing_key"]) == (3, 1)
    # the preflights and the 401 wrote no usage event; the 502 one with nothing billed
    assert [(e["status"], e["prompt_tokens"]) for e in cors_edge.events()] == [(502, 0)]


def test_answers_to_an_allowed_origin_carry_cors_headers_errors_included(
        cors_edge: Edge) -> None:
    with httpx.Client(base_url=cors_edge.base_url, timeout=30,
                      headers={"Origin": APP}) as c:
        ok = c.post("/chat/completions", json=CHAT,
                    headers={"Authorization": f"Bearer {MAIN_KEY}"})
        no_key = c.post("/chat/completions", json=CHAT)
        bad = c.post("/chat/completions", json={"model": MODEL, "messages": "hi"},
                     headers={"Authorization": f"Bearer {MAIN_KEY}"})
    assert (ok.status_code, no_key.status_code, bad.status_code) == (200, 401, 400)
    for r in (ok, no_key, bad):
        assert (r.headers["access-control-allow-origin"], r.headers["vary"]) == (APP, "Origin")
        exposed = {h.strip().lower() for h in
                   r.headers["access-control-expose-headers"].split(",")}
        assert exposed == EXPOSED
    assert ok.json()["usage"]["prompt_tokens"] == int(ok.headers["x-token-count"])


def test_another_origin_gets_no_cors_headers_and_its_preflight_is_refused(
        cors_edge: Edge) -> None:
    r = preflight(cors_edge, "/chat/completions", "https://evil.example")
    assert r.status_code == 403
    assert r.json() == {"error": {
        "message": "Cross-origin requests from https://evil.example are not allowed by "
                   "this gateway.",
        "type": "invalid_request_error", "param": None, "code": "cors_origin_not_allowed"}}
    assert "access-control-allow-origin" not in r.headers
    assert r.headers["vary"] == PREFLIGHT_VARY
    # the request itself is served (the browser withholds the answer from the page);
    # the answer varies by Origin, for any cache between
    r = httpx.post(f"{cors_edge.base_url}/chat/completions", json=CHAT, timeout=30,
                   headers={"Origin": "https://evil.example",
                            "Authorization": f"Bearer {MAIN_KEY}"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    assert r.headers["vary"] == "Origin"
    # a header list that is none
    r = preflight(cors_edge, "/chat/completions", APP, asked="content-type;evil")
    assert r.status_code == 400
    assert r.json()["error"]["message"] == \
        "Access-Control-Request-Headers is not a list of header names."
    assert "access-control-allow-origin" not in r.headers
    # OPTIONS without Origin is no preflight: the route's 405 (after the key)
    r = httpx.options(f"{cors_edge.base_url}/chat/completions", timeout=10,
                      headers={"Authorization": f"Bearer {MAIN_KEY}"})
    assert (r.status_code, r.headers["allow"], r.json()["error"]["code"]) == \
        (405, "POST", "method_not_allowed")
    wait_until(lambda: cors_edge.status()["cors_preflight_refused"] == 2)
    m = cors_edge.status()
    assert (m["cors_preflight_allowed"], m["cors_preflight_refused"]) == (0, 2)


def test_any_origin_with_a_star_and_none_when_cors_is_off(
        edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str) -> None:
    star = _edge(edge_variant_off_vllm, fast_upstream_url, "cors-star", ["*"])
    r = preflight(star, "/completions", "https://anyone.example")
    assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "*"
    r = httpx.get(f"{star.base_url}/models", timeout=10,
                  headers={"Origin": "https://anyone.example",
                           "Authorization": f"Bearer {MAIN_KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert "vary" not in r.headers

    off = _edge(edge_variant_off_vllm, fast_upstream_url, "cors-off", None)
    r = preflight(off, "/chat/completions", APP)
    assert r.status_code == 403 and r.json()["error"]["code"] == "cors_origin_not_allowed"
    r = httpx.get(f"{off.base_url}/models", timeout=10,
                  headers={"Origin": APP, "Authorization": f"Bearer {MAIN_KEY}"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


NOT_AN_ORIGIN = ("expected an origin such as https://app.example.com or http://localhost:3000 "
                 "(scheme, host, optional port; no path), or *")


def test_config_apply_turns_cors_on_in_a_running_edge(
        edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str) -> None:
    e = _edge(edge_variant_off_vllm, fast_upstream_url, "cors-apply", None)
    assert preflight(e, "/chat/completions", APP).status_code == 403
    path = EDGE_DIR / "cors-apply" / "tokengate.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["edge"]["cors"] = {"allow_origins": [APP]}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    prefix = EDGE_DIR / f"test-nginx-cors-apply{PORT_OFFSET or ''}"
    r = subprocess.run([sys.executable, "-m", "tokengate.cli", "config", "apply", str(path),
                        "--edge", str(prefix)], capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines()[-1] == f"applied: {prefix / 'edge.json'} (nginx reloaded)"
    assert preflight(e, "/chat/completions", APP).status_code == 204
    # a file that does not validate is not applied
    raw["edge"]["cors"] = {"allow_origins": [APP + ":443"]}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    r = subprocess.run([sys.executable, "-m", "tokengate.cli", "config", "apply", str(path),
                        "--edge", str(prefix)], capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 1 and r.stderr.startswith("edge.cors.allow_origins.0: ")
    assert preflight(e, "/chat/completions", APP).status_code == 204


@pytest.mark.unit
@pytest.mark.parametrize("origins,error", [
    (["*", APP], "edge.cors.allow_origins: `*` already allows every origin: list it alone"),
    ([APP, APP.upper()], "edge.cors.allow_origins: an origin is listed twice"),
    ([APP + "/chat"], f"edge.cors.allow_origins.0: {NOT_AN_ORIGIN}, got '{APP}/chat'"),
    (["app.example.com"], f"edge.cors.allow_origins.0: {NOT_AN_ORIGIN}, got 'app.example.com'"),
    ([APP + ":443"], (f"edge.cors.allow_origins.0: browsers send '{APP}', never the default "
                      "port: list it without ':443'")),
    (["http://localhost:99999"], ("edge.cors.allow_origins.0: port 99999 is not 1..65535 in "
                                  "'http://localhost:99999'")),
])
def test_an_origin_list_that_cannot_be_meant_is_refused(origins: list[str], error: str,
                                                        tmp_path: Path) -> None:
    raw = yaml.safe_load(REPO_CONFIG.read_text())
    raw.setdefault("edge", {})["cors"] = {"allow_origins": origins}
    with pytest.raises(ConfigError) as e:
        tg_config.parse(raw, tmp_path / "tokengate.yaml")
    assert e.value.errors == [error]
