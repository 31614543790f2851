"""The console's parts that start no process: password digests, sessions and their
CSRF tokens, the login limiter, the CSV, the forms' checks, and the WSGI application's
refusals (host, origin, CSRF, session) with a Redis that is not there.
(Over 600 lines: the console's pure parts, each a few short tests; splitting them
would only copy the config and request helpers they share.)"""

from __future__ import annotations

import html
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from tokengate import config as tg_config
from tokengate import http_server as server
from tokengate.console import app as console_app
from tokengate.console import data, forms, password
from tokengate.console.cli import set_admin
from tokengate.console.session import LoginLimiter, Sessions
from tokengate.ledger.report import UsageRow

from tests.conftest import NO_REDIS, REPO_CONFIG

pytestmark = pytest.mark.unit

PASSWORD = "correct horse battery"
# the tests' admins: scrypt at 2**10 (verify reads the cost from the digest; the default's
# 0.3 s per login and digest cost the suite ~45 CPU-s)
TEST_SCRYPT_N = 2**10


def admin_digest(pw: str = PASSWORD) -> str:
    """A digest of ``pw`` at ``TEST_SCRYPT_N``."""
    return password.digest(pw, n=TEST_SCRYPT_N)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_digest_checks_its_password_and_nothing_else() -> None:
    d = password.digest(PASSWORD)
    assert re.fullmatch(r"scrypt\$n=32768,r=8,p=3\$[A-Za-z0-9_-]{22}\$[A-Za-z0-9_-]{43}", d)
    assert password.verify(PASSWORD, d)
    assert not password.verify(PASSWORD + " ", d)
    assert not password.verify("", d)
    assert not password.verify(PASSWORD, d.replace("n=32768", "n=16384"))
    assert not password.verify(PASSWORD, "not a digest")
    assert not password.verify("x" * 5000, d)
    assert password.digest(PASSWORD) != d  # a fresh salt each time


def test_an_unknown_admin_is_refused_and_a_short_password_is_not_set() -> None:
    admins = {"alice": password.digest(PASSWORD)}
    assert password.verify_admin(admins, "alice", PASSWORD)
    assert not password.verify_admin(admins, "bob", PASSWORD)
    assert password.check_new("short") == "a password has at least 10 characters"
    assert password.check_new(" padded password ") is not None
    assert password.check_new(PASSWORD) is None


def repo_config_without_console() -> str:
    """The repository's tokengate.yaml, model paths absolute, less its ledger.console
    block (the demo admin)."""
    text = REPO_CONFIG.read_text().replace("dir: var/models/",
                                           f"dir: {REPO_CONFIG.parent / 'var/models'}/")
    text = text.replace("url: redis://127.0.0.1:6380/0", f"url: {NO_REDIS}")  # not make run's
    return re.sub(r"  console:.*\n(    .*\n)+", "", text)


def test_the_configuration_takes_a_digest_and_refuses_a_password(tmp_path: Path) -> None:
    base = repo_config_without_console()
    good = base.replace(
        "  rotate_wait_s: 5.0 ",
        f"  console:\n    admins:\n      alice: '{admin_digest()}'\n"
        "  rotate_wait_s: 5.0 ")
    cfg = tg_config.loads(good, tmp_path / "tokengate.yaml")
    assert list(cfg.ledger.console.admins) == ["alice"]
    bad = good.replace(cfg.ledger.console.admins["alice"], PASSWORD)
    with pytest.raises(tg_config.ConfigError) as e:
        tg_config.loads(bad, tmp_path / "tokengate.yaml")
    assert e.value.errors[0].startswith("ledger.console.admins.alice: expected a digest "
                                        "written by `tokengate console passwd NAME`")
    clash = good.replace("  console:\n", "  console:\n    listen: 127.0.0.1:8083\n")
    with pytest.raises(tg_config.ConfigError) as e:
        tg_config.loads(clash, tmp_path / "tokengate.yaml")
    assert e.value.errors == [("ledger.console.listen: 127.0.0.1:8083 is also "
                               "metrics.ledger_listen")]


def test_a_session_ends_on_the_servers_clock_and_checks_its_csrf_token() -> None:
    clock = Clock()
    sessions = Sessions(ttl_s=60, clock=clock)
    s = sessions.start("alice")
    assert sessions.get(s.token) == s
    assert s.csrf_ok(s.csrf) and not s.csrf_ok(None) and not s.csrf_ok(s.csrf[:-1] + "x")
    assert sessions.get("forged") is None and sessions.get(None) is None
    clock.t += 59.9
    assert sessions.get(s.token) == s
    clock.t += 0.1
    assert sessions.get(s.token) is None
    t = sessions.start("bob")
    sessions.end_admin("bob")
    assert sessions.get(t.token) is None


def test_failed_logins_are_limited_per_address_and_an_admins_known_address_stays_open(
        ) -> None:
    clock = Clock()
    limiter = LoginLimiter(attempts=3, window_s=300, clock=clock)
    for _ in range(3):
        assert limiter.attempt("alice", "10.0.0.1") == 0   # counted before the check
    assert limiter.attempt("alice", "10.0.0.1") == 300
    assert limiter.attempt("bob", "10.0.0.1") == 300     # the address, any name
    assert limiter.attempt("alice", "10.0.0.2") == 0      # another address: open
    limiter.succeeded("alice", "10.0.0.2")
    # guesses for alice from 9 more addresses: the name's limit (3 x 10) is reached...
    for i in range(9):
        for _ in range(3):
            assert limiter.attempt("alice", f"10.0.1.{i}") == 0
    assert limiter.attempt("alice", "10.0.2.1") == 300    # a new address waits
    assert limiter.attempt("alice", "10.0.0.2") == 0      # her known address does not
    limiter.succeeded("alice", "10.0.0.2")
    clock.t += 120
    assert limiter.attempt("bob", "10.0.0.1") == 180
    clock.t += 180
    assert limiter.attempt("bob", "10.0.0.1") == 0
    limiter.succeeded("bob", "10.0.0.1")
    assert "c:10.0.0.1" not in limiter._failures and "n:bob" not in limiter._failures


def test_the_csv_has_the_ledgers_numbers_and_defuses_formulas() -> None:
    rows = [UsageRow("2026-12-01", "demo", "tiny-qwen3", requests=3, errors=1,
                     prompt_tokens=30, cached_tokens=0, completion_tokens=12,
                     cost=4.62e-05),
            UsageRow("2026-12-01", "=cmd|'/c calc'!A1", "-model", requests=1)]
    assert data.usage_csv(rows).split("\r\n") == [
        "day,key,model,requests,errors,prompt_tokens,cached_tokens,completion_tokens,cost",
        "2026-12-01,demo,tiny-qwen3,3,1,30,0,12,4.62e-05",
        "2026-12-01,'=cmd|'/c calc'!A1,'-model,1,0,0,0,0,0", ""]


def _cfg(tmp_path: Path) -> tg_config.Config:
    text = REPO_CONFIG.read_text().replace("dir: var/models/",
                                           f"dir: {REPO_CONFIG.parent / 'var/models'}/")
    return tg_config.loads(text, tmp_path / "tokengate.yaml")


@pytest.mark.parametrize(("form", "errors"), [
    ({"name": "bad name!", "rpm": "10", "tpm": "1000"},
     {"name": "'bad name!': " + tg_config.KEY_ID_RULE}),
    ({"name": "demo", "rpm": "10", "tpm": "1000"},
     {"name": "a key named 'demo' exists: change it, or revoke it first"}),
    ({"name": "ok", "rpm": "12x", "tpm": "-5"},
     {"rpm": "'12x' is not a whole number: requests per minute",
      "tpm": "'-5' is not a whole number: tokens per minute"}),
    ({"name": "ok", "rpm": "0", "tpm": "99999999999999999999"},
     {"rpm": "requests per minute: from 1 to 1,000,000,000,000",
      "tpm": "tokens per minute: from 1 to 1,000,000,000,000"}),
    ({"name": "ok", "rpm": "", "tpm": "1"}, {"rpm": "required: requests per minute"}),
    ({"name": "ok", "rpm": "1", "tpm": "1", "budgets": "day=-1"},
     {"budgets": "a budget is not negative: 'day=-1'"}),
    ({"name": "ok", "rpm": "1", "tpm": "1", "budgets": "week=5"},
     {"budgets": "expected [MODEL:]day=AMOUNT or [MODEL:]month=AMOUNT (AMOUNT in the "
                 "currency, or tokens as 2000000t), got 'week=5'"}),
    ({"name": "ok", "rpm": "1", "tpm": "1", "models": "tiny-qwen3, gpt-9"},
     {"models": "not a served model: 'gpt-9' (served: tiny-qwen3; empty: all)"}),
    ({"name": "ok", "rpm": "1", "tpm": "1", "priority": "urgent"},
     {"priority": "'urgent' is not one of low, normal"}),
    ({"name": "x" * 5000, "rpm": "1", "tpm": "1"},
     {"name": "too long: 5,000 characters (at most 2,000)"}),
    ({"name": "٣", "rpm": "١٢", "tpm": "1"},
     {"name": "'٣': " + tg_config.KEY_ID_RULE,
      "rpm": "'١٢' is not a whole number: requests per minute"}),
])
def test_every_bad_field_of_the_create_form_gets_its_message(
        tmp_path: Path, form: dict[str, str], errors: dict[str, str]) -> None:
    change, checked = forms.create(form, _cfg(tmp_path), "0" * 64)
    assert change is None
    assert checked.errors == errors


def test_a_good_create_form_is_the_change_tokengate_keys_makes(tmp_path: Path) -> None:
    change, checked = forms.create(
        {"name": "team-a", "rpm": " 60 ", "tpm": "100000", "models": "tiny-qwen3",
         "budgets": "day=5.00\nmonth=2000000t", "priority": "low"}, _cfg(tmp_path), "a" * 64)
    assert checked.errors == {}
    assert change is not None
    assert (change.name, change.rpm, change.tpm, change.models, change.budgets,
            change.priority) == ("team-a", 60, 100000, "tiny-qwen3",
                                 ("day=5.00", "month=2000000t"), "low")


def test_safe_next_keeps_a_login_on_the_consoles_own_pages() -> None:
    assert console_app.safe_next("/usage?since=7d") == "/usage?since=7d"
    assert console_app.safe_next("/keys/demo") == "/keys/demo"
    assert console_app.safe_next("/usage?key=ключ") == "/usage?key=%D0%BA%D0%BB%D1%8E%D1%87"
    for bad in (None, "", "//evil.example", "/\\evil.example", "https://evil.example",
                "/keys\r\nSet-Cookie: x=1", "/\t/evil.example", "/\x0b/evil.example",
                "/\x85/evil.example", "/static/console.css", "/keysx", "evil.example/keys"):
        assert console_app.safe_next(bad) == "/keys"


# --- the application, with a Redis that is not there ---------------------------------

PORT = 18499


@pytest.fixture
def console(tmp_path: Path) -> tuple[httpx.Client, console_app.Console]:
    return make_console(tmp_path)


def make_console(tmp_path: Path) -> tuple[httpx.Client, console_app.Console]:
    """The repository's configuration with the admin alice, the console on ``PORT``
    (its usage file in ``tmp_path``, Redis not there) and a client of it."""
    path = tmp_path / "tokengate.yaml"
    path.write_text(repo_config_without_console())
    set_admin(path, "alice", admin_digest())
    raw = path.read_text().replace("  console:\n", f"  console:\n    listen: 127.0.0.1:{PORT}\n")
    path.write_text(raw)
    client = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2,
                         retry=Retry(NoBackoff(), 0))
    app = console_app.Console(path, client, tmp_path / "usage.jsonl")
    http = httpx.Client(transport=httpx.WSGITransport(app=app),
                        base_url=f"http://127.0.0.1:{PORT}")
    return http, app


def _login(http: httpx.Client, name: str = "alice", pw: str = PASSWORD,
           origin: str = f"http://127.0.0.1:{PORT}") -> httpx.Response:
    page = http.get("/login")
    token = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert token is not None
    return http.post("/login", data={"name": name, "password": pw, "csrf": token[1],
                                     "next": "/keys"},
                     headers={"Origin": origin, "Cookie": f"tg_console_login={token[1]}"})


def test_every_answer_carries_the_security_headers(console: Any) -> None:
    http, _ = console
    r = http.get("/login")
    assert r.headers["content-security-policy"] == console_app.CSP
    assert (r.headers["x-content-type-options"], r.headers["referrer-policy"],
            r.headers["x-frame-options"], r.headers["cache-control"]) == \
        ("nosniff", "same-origin", "DENY", "no-store")
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Secure" in cookie


def test_a_page_without_a_session_goes_to_the_login_and_a_post_is_refused(
        console: Any) -> None:
    http, _ = console
    r = http.get("/usage")
    assert (r.status_code, r.headers["location"]) == (303, "/login?next=%2Fusage")
    r = http.post("/keys/new", data={"name": "x"},
                  headers={"Origin": f"http://127.0.0.1:{PORT}"})
    assert r.status_code == 403


def test_another_host_or_origin_is_refused(console: Any) -> None:
    http, _ = console
    assert http.get("/login", headers={"Host": "evil.example:18499"}).status_code == 421
    assert _login(http, origin="http://evil.example").status_code == 403
    r = http.post("/login", data={"name": "alice", "password": PASSWORD},
                  headers={"Origin": f"http://127.0.0.1:{PORT}"})
    assert r.status_code == 403  # no login form token


def test_a_login_sets_a_session_and_a_post_needs_its_csrf_token(console: Any) -> None:
    http, app = console
    r = _login(http)
    assert (r.status_code, r.headers["location"]) == (303, "/keys")
    token = re.search(r"tg_console=([^;]+)", r.headers.get_list("set-cookie")[0])
    assert token is not None
    session = app.sessions.get(token[1])
    assert session is not None and session.admin == "alice"
    cookie = {"Cookie": f"tg_console={token[1]}", "Origin": f"http://127.0.0.1:{PORT}"}
    form = {"name": "team-x", "rpm": "1", "tpm": "1"}
    assert http.post("/keys/new", data=form, headers=cookie).status_code == 403
    assert http.post("/keys/new", data={**form, "csrf": "forged"}, headers=cookie
                     ).status_code == 403
    bad = http.post("/keys/new", data={**form, "csrf": session.csrf, "rpm": "many"},
                    headers=cookie)
    assert bad.status_code == 400
    assert "&#39;many&#39; is not a whole number: requests per minute" in bad.text
    huge = http.post("/keys/new", content=b"name=" + b"x" * 70_000, headers={
        **cookie, "Content-Type": "application/x-www-form-urlencoded"})
    assert huge.status_code == 413
    assert "team-x" not in app.config.current().keys


def _session(http: httpx.Client, app: console_app.Console) -> tuple[dict[str, str], str]:
    """Logs alice in: (the headers of her requests, her CSRF token)."""
    r = _login(http)
    token = re.search(r"tg_console=([^;]+)", r.headers.get_list("set-cookie")[0])
    assert token is not None
    session = app.sessions.get(token[1])
    assert session is not None
    return {"Cookie": f"tg_console={token[1]}", "Origin": f"http://127.0.0.1:{PORT}"}, \
        session.csrf


def _key_form(page: str) -> dict[str, str]:
    """The key page's change form, as a browser would send it unchanged."""
    form = re.search(r'<form method="post" action="/keys/[^"]+" class="stack" '
                     r'id="set-form">(.*?)</form>', page, re.DOTALL)
    assert form is not None
    out = {m[1]: html.unescape(m[2]) for m in re.finditer(
        r'<input[^>]*name="([^"]+)"[^>]*value="([^"]*)"', form[1])}
    out.update({m[1]: html.unescape(m[2]) for m in re.finditer(
        r'<textarea[^>]*name="([^"]+)"[^>]*>(.*?)</textarea>', form[1], re.DOTALL)})
    sel = re.search(r'<option value="([^"]*)" selected>', form[1])
    out["priority"] = sel[1] if sel else out.get("priority", "")
    return out


def test_a_stale_key_form_is_answered_409_with_what_changed_never_a_revert(
        console: Any) -> None:
    http, app = console
    headers, _csrf = _session(http, app)
    shown = _key_form(http.get("/keys/demo", headers=headers).text)
    assert (shown["rpm"], shown["tpm"]) == ("600", "200000")
    # meanwhile, the command line changes the tokens per minute and the priority
    subprocess.run([sys.executable, "-m", "tokengate.cli", "keys", "set", "demo",
                    "--tpm", "5555", "--priority", "low", "--config", str(app.config.path),
                    "--no-apply"], capture_output=True, check=True)
    r = http.post("/keys/demo", data={**shown, "rpm": "7"}, headers=headers)
    assert r.status_code == 409
    stale = {f: (was, now) for f, was, now in re.findall(
        r'<tr data-field="(\w+)"><td>\w+</td><td><code>([^<]*)</code></td>'
        r'<td><code>([^<]*)</code>', r.text)}
    assert stale == {"tpm": ("200000", "5555"), "priority": ("normal", "low")}
    demo = tg_config.load(app.config.path).keys["demo"]
    assert (demo.rpm, demo.tpm, demo.priority) == (600, 5555, "low")   # nothing reverted
    # the 409's form shows the key as it is now: saved, it changes only what was typed
    fresh = _key_form(r.text)
    assert (fresh["tpm"], fresh["priority"]) == ("5555", "low")
    saved = http.post("/keys/demo", data={**fresh, "rpm": "7"}, headers=headers)
    assert (saved.status_code, saved.headers["location"]) == (303, "/keys/demo")
    demo = tg_config.load(app.config.path).keys["demo"]
    assert (demo.rpm, demo.tpm, demo.priority) == (7, 5555, "low")
    # a form without a version (a page from before) changes nothing
    old = {k: v for k, v in fresh.items() if k not in ("version", "shown")}
    r = http.post("/keys/demo", data={**old, "rpm": "8"}, headers=headers)
    assert r.status_code == 400
    assert re.search(r'id="e-version">Not changed: this form has no version of the key it '
                     r'showed: reload the page', r.text)
    assert tg_config.load(app.config.path).keys["demo"].rpm == 7


def test_a_change_with_redis_down_is_made_and_says_it_has_no_audit_entry(
        console: Any) -> None:
    http, app = console
    headers, _csrf = _session(http, app)
    form = _key_form(http.get("/keys/demo", headers=headers).text)
    r = http.post("/keys/demo", data={**form, "rpm": "9"}, headers=headers)
    assert (r.status_code, r.headers["location"]) == (303, "/keys/demo")
    assert tg_config.load(app.config.path).keys["demo"].rpm == 9
    page = http.get("/keys/demo", headers=headers).text
    said = re.search(r'<p class="problem" id="not-audited">([^<]*)<', page)
    assert said is not None and said[1].startswith("Made, but not in the audit stream "
                                                    "(Redis: ")
    # said once: the page's next load is the page itself
    assert 'id="not-audited"' not in http.get("/keys/demo", headers=headers).text


def test_a_query_of_more_than_50_fields_is_400_and_get_logout_405(console: Any) -> None:
    http, app = console
    headers, _csrf = _session(http, app)
    many = "&".join(f"f{i}=1" for i in range(51))
    r = http.get(f"/usage?{many}", headers=headers)
    assert r.status_code == 400 and "a query has at most 50 fields" in r.text
    r = http.get("/logout", headers=headers)
    assert (r.status_code, r.headers["allow"]) == (405, "POST")


def test_a_third_party_cannot_lock_an_admin_out(console: Any) -> None:
    http, app = console
    attacker = httpx.Client(transport=httpx.WSGITransport(app=app, remote_addr="10.9.9.9"),
                            base_url=f"http://127.0.0.1:{PORT}")
    for _ in range(5):
        assert _login(attacker, pw="wrong password").status_code == 401
    assert _login(attacker).status_code == 429          # that address waits
    r = _login(http)                                     # alice, from her own address
    assert (r.status_code, r.headers["location"]) == (303, "/keys")


def test_too_many_failed_logins_are_answered_429(console: Any) -> None:
    http, _ = console
    for _ in range(5):
        assert _login(http, pw="wrong password").status_code == 401
    r = _login(http)
    assert r.status_code == 429
    assert 1 <= int(r.headers["retry-after"]) <= 301
    assert "Too many failed logins" in r.text


def test_a_queued_change_is_made_by_console_apply_and_answered(tmp_path: Path) -> None:
    """The systemd way (ledger.console.changes_dir): the console queues, root's
    `tokengate console apply` edits the file, the console reads the result."""
    import threading

    from tokengate.console import changes

    path = tmp_path / "tokengate.yaml"
    path.write_text(REPO_CONFIG.read_text().replace(
        "dir: var/models/", f"dir: {REPO_CONFIG.parent / 'var/models'}/"))
    queue = tmp_path / "queue"
    got: list[changes.Outcome] = []
    ask = threading.Thread(target=lambda: got.append(changes.submit(
        queue, changes.KeyChange("set", "demo", rpm=7, priority="low"), "alice", wait_s=20)))
    ask.start()
    while not list((queue / "requests").glob("*.json")):
        time.sleep(0.01)
    assert changes.apply_queued(path, queue, []) == 1
    ask.join(20)
    assert got[0].ok and got[0].no_edge == f"no running edge of {path}: nothing reloaded"
    demo = tg_config.load(path).keys["demo"]
    assert (demo.rpm, demo.priority) == (7, "low")
    assert list(queue.rglob("*.json")) == []
    # a form's version checked by root's side too: a stale one changes nothing
    shown = forms.form_values(tg_config.KeyConfig.model_validate(
        {"sha256": "0" * 64, "rpm": 600, "tpm": 200000}))
    got.clear()
    ask = threading.Thread(target=lambda: got.append(changes.submit(
        queue, changes.KeyChange("set", "demo", rpm=8, version=forms.key_version(shown),
                                 shown=shown), "alice", wait_s=20)))
    ask.start()
    while not list((queue / "requests").glob("*.json")):
        time.sleep(0.01)
    assert changes.apply_queued(path, queue, []) == 1
    ask.join(20)
    assert got[0].stale == {"rpm": ["600", "7"], "priority": ["normal", "low"]}
    assert tg_config.load(path).keys["demo"].rpm == 7
    bad = changes.submit(queue, changes.KeyChange("revoke", "nobody"), "alice", wait_s=0.2)
    assert bad.errors[0].startswith("not applied within 0 s: is tokengate-console-apply.path")
    assert changes.apply_queued(path, queue, []) == 1  # then answered, to no one


def test_the_console_rotates_a_key_showing_the_new_secret_once(console: Any) -> None:
    from tokengate.keys import digest

    http, app = console
    headers, csrf = _session(http, app)
    old = app.config.current().keys["demo"].sha256
    r = http.post("/keys/demo/rotate", data={"csrf": csrf, "overlap": "2h"}, headers=headers)
    assert r.status_code == 201, r.text[-2000:]
    secret = re.search(r'<code id="new-key">(tg-[A-Za-z0-9_-]{43})</code>', r.text)
    assert secret is not None
    demo = app.config.current().keys["demo"]
    assert demo.sha256 == digest(secret[1])
    [prev] = demo.previous
    assert prev.sha256 == old
    assert 7190 <= prev.expires_at.timestamp() - time.time() <= 7200
    assert f"The previous secret is valid until {tg_config.rfc3339(prev.expires_at)}." \
        in r.text
    page = http.get("/keys/demo", headers=headers)
    assert f'<dd id="key-previous">valid until {tg_config.rfc3339(prev.expires_at)}</dd>' \
        in page.text
    assert secret[1] not in page.text  # shown once
    bad = http.post("/keys/demo/rotate", data={"csrf": csrf, "overlap": "soon"},
                    headers=headers)
    assert bad.status_code == 400
    assert "expected a duration such as 90s, 30m, 24h or 7d, got &#39;soon&#39;" in bad.text
    assert app.config.current().keys["demo"].sha256 == digest(secret[1])


def test_the_console_disables_and_enables_a_key(console: Any) -> None:
    http, app = console
    headers, csrf = _session(http, app)
    off = http.post("/keys/demo/disable", data={"csrf": csrf}, headers=headers)
    assert off.status_code == 200
    assert app.config.current().keys["demo"].disabled is True
    assert '<dd id="key-state">disabled (refused, 401)</dd>' in off.text
    assert 'action="/keys/demo/enable"' in off.text
    on = http.post("/keys/demo/enable", data={"csrf": csrf}, headers=headers)
    assert on.status_code == 200 and app.config.current().keys["demo"].disabled is False
    assert '<dd id="key-state">enabled</dd>' in on.text


def test_a_queued_rotation_is_made_by_console_apply(tmp_path: Path) -> None:
    import threading

    from tokengate.console import changes

    path = tmp_path / "tokengate.yaml"
    path.write_text(REPO_CONFIG.read_text().replace(
        "dir: var/models/", f"dir: {REPO_CONFIG.parent / 'var/models'}/"))
    old = tg_config.load(path).keys["demo"].sha256
    queue = tmp_path / "queue"
    got: list[changes.Outcome] = []
    ask = threading.Thread(target=lambda: got.append(changes.submit(
        queue, changes.KeyChange("rotate", "demo", sha256="b" * 64, overlap_s=60), "alice",
        wait_s=20)))
    ask.start()
    while not list((queue / "requests").glob("*.json")):
        time.sleep(0.01)
    assert changes.apply_queued(path, queue, []) == 1
    ask.join(20)
    assert got[0].ok
    demo = tg_config.load(path).keys["demo"]
    assert (demo.sha256, [p.sha256 for p in demo.previous]) == ("b" * 64, [old])
    assert changes.KeyChange("rotate", "demo", sha256="b" * 64, overlap_s=60
                             ).audit_detail() == '{"overlap_s": 60}'


# --- the console's own server, on a real socket ----------------------------------------


@pytest.fixture
def small_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """``served`` with small bounds: 2 workers, 3 queued, reads time out after 1 s."""
    monkeypatch.setattr(server._Server, "workers", 2)
    monkeypatch.setattr(server._Server, "queued", 3)
    monkeypatch.setattr(server._Handler, "timeout", 1.0)
    monkeypatch.setattr(server._Handler, "deadline_s", 2.0)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, console_app.Console]]:
    """The console of ``console``'s file served by ``server.listen`` (the ledger's) on a
    free loopback port."""
    from tokenstorm.process import free_port

    port = free_port()
    path = tmp_path / "tokengate.yaml"
    path.write_text(repo_config_without_console())
    set_admin(path, "alice", admin_digest())
    path.write_text(path.read_text().replace(
        "  console:\n", f"  console:\n    listen: 127.0.0.1:{port}\n"))
    client = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2,
                         retry=Retry(NoBackoff(), 0))
    app = console_app.Console(path, client, tmp_path / "usage.jsonl")
    srv = server.listen("127.0.0.1", port, app)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        srv.shutdown()
        srv.server_close()


def test_concurrent_wrong_passwords_are_counted_before_they_are_checked(
        served: tuple[str, console_app.Console]) -> None:
    """30 wrong passwords at once, then the right one: 5 checked, the rest 429."""
    base, _ = served
    with httpx.Client(base_url=base, timeout=60) as http:
        forms_ = []
        for _ in range(30):
            page = http.get("/login")
            token = re.search(r'name="csrf" value="([^"]+)"', page.text)
            assert token is not None
            forms_.append(token[1])
    start = threading.Barrier(30)
    codes: list[int] = []

    def guess(token: str) -> None:
        with httpx.Client(base_url=base, timeout=60) as c:
            start.wait()
            codes.append(c.post("/login", data={
                "name": "alice", "password": "wrong password", "csrf": token,
                "next": "/keys"}, headers={"Origin": base,
                                           "Cookie": f"tg_console_login={token}"}
                ).status_code)

    threads = [threading.Thread(target=guess, args=(t,)) for t in forms_]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [401] * 5 + [429] * 25
    with httpx.Client(base_url=base, timeout=60) as http:
        assert _login(http, origin=base).status_code == 429


def test_a_non_latin1_next_is_sent_percent_encoded(
        served: tuple[str, console_app.Console]) -> None:
    base, _ = served
    with httpx.Client(base_url=base, timeout=60) as http:
        page = http.get("/login")
        token = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert token is not None
        r = http.post("/login", data={"name": "alice", "password": PASSWORD,
                                      "csrf": token[1], "next": "/usage?key=ключ"},
                      headers={"Origin": base, "Cookie": f"tg_console_login={token[1]}"})
    assert (r.status_code, r.headers["location"]) == \
        (303, "/usage?key=%D0%BA%D0%BB%D1%8E%D1%87")
    assert r.headers["set-cookie"].startswith("tg_console=")


def _console_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("console"))


def test_slow_connections_take_no_more_than_the_pool_and_time_out(
        small_pool: None, served: tuple[str, console_app.Console]) -> None:
    """300 connections that send half a request: 2 workers serve, 3 wait, the others
    are answered 503 at once; each slow one is closed when its read times out, and the
    console answers again."""
    base, _ = served
    port = int(base.rsplit(":", 1)[1])
    slow = []
    for _ in range(300):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"GET /login HTTP/1.1\r\nHost: 127.0.0")
        slow.append(s)
    assert _console_threads() <= 2
    answers = [s.recv(200) for s in slow]   # every one ends: 503 at once, or timed out
    assert {a if a == b"" else a[:13] for a in answers} == {b"", b"HTTP/1.1 503 "}
    assert _console_threads() <= 2
    for s in slow:
        s.close()
    with httpx.Client(base_url=base, timeout=60) as http:
        assert http.get("/login").status_code == 200


def test_a_request_sent_a_byte_at_a_time_is_cut_at_its_deadline(
        small_pool: None, served: tuple[str, console_app.Console]) -> None:
    """One header byte every 0.2 s never lets a read time out; the request's deadline
    (2 s here) still ends the connection, unanswered."""
    base, _ = served
    port = int(base.rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    s.settimeout(0.2)
    got = None
    for _ in range(300):   # 60 s at most; the deadline ends it after about 2 s
        try:
            s.sendall(b"a")
            got = s.recv(200)
        except TimeoutError:
            continue
        except OSError:    # reset: the server closed it while bytes were arriving
            got = b""
        break
    s.close()
    assert got == b""
    with httpx.Client(base_url=base, timeout=60) as http:
        assert http.get("/login").status_code == 200
