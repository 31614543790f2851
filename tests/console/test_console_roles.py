"""Read-only admins (``ledger.console.roles``) and how they are set, the login page of a
console without admins, and the Live page's refresh, through the WSGI application with
a Redis that is not there."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from tokengate import config as tg_config
from tokengate.console import app as console_app
from tokengate.console import password
from tokengate.console.cli import set_admin

from tests.console.test_console_unit import (
    PASSWORD,
    PORT,
    _login,
    _session,
    admin_digest,
    make_console,
)
from tests.fixtures_ledger import UsageWriter, make_event

pytestmark = pytest.mark.unit

ORIGIN = {"Origin": f"http://127.0.0.1:{PORT}"}


@pytest.fixture
def console(tmp_path: Path) -> tuple[httpx.Client, console_app.Console]:
    return make_console(tmp_path)


def passwd(path: Path, *args: str, stdin: str = PASSWORD + "\n"
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokengate.cli", "console", *args,
                           "--config", str(path)], input=stdin, capture_output=True,
                          text=True, timeout=60, check=False)


def test_passwd_and_role_set_an_admins_role_and_remove_takes_it_away(
        console: Any) -> None:
    _http, app = console
    path = app.config.path
    r = passwd(path, "passwd", "bob", "--password-stdin", "--role", "read-only")
    assert r.returncode == 0, r.stderr
    assert "admin bob: password set, role read-only" in r.stderr
    cc = tg_config.load(path).ledger.console
    assert (cc.role("bob"), cc.role("alice")) == ("read-only", "admin")
    # a new password keeps the role; `role` changes it, the password stays
    digest = cc.admins["bob"]
    assert passwd(path, "passwd", "bob", "--password-stdin").returncode == 0
    assert tg_config.load(path).ledger.console.role("bob") == "read-only"
    assert passwd(path, "role", "bob", "admin").returncode == 0
    cc = tg_config.load(path).ledger.console
    assert (cc.role("bob"), "roles" in yaml.safe_load(path.read_text())["ledger"]["console"]) \
        == ("admin", False)
    assert password.verify(PASSWORD, cc.admins["bob"]) and cc.admins["bob"] != digest
    assert passwd(path, "role", "bob", "read-only").returncode == 0
    assert passwd(path, "passwd", "bob", "--remove").returncode == 0
    raw = yaml.safe_load(path.read_text())["ledger"]["console"]
    assert "bob" not in raw["admins"] and "roles" not in raw
    r = passwd(path, "role", "carol", "read-only")
    assert (r.returncode, r.stderr.strip()) == (2, "tokengate console: no admin 'carol'")
    r = passwd(path, "role", "alice", "owner")
    assert r.returncode == 2 and "invalid choice: 'owner'" in r.stderr


def test_a_role_for_no_admin_is_refused_by_the_schema(tmp_path: Path, console: Any) -> None:
    _http, app = console
    text = app.config.path.read_text().replace(
        "  console:\n", "  console:\n    roles:\n      mallory: read-only\n")
    with pytest.raises(tg_config.ConfigError) as e:
        tg_config.loads(text, tmp_path / "tokengate.yaml")
    assert e.value.errors == [("ledger.console.roles.mallory: not an admin of admins (a "
                               "role is an admin's: `tokengate console passwd NAME --role "
                               "ROLE`)")]


def _read_only(http: httpx.Client, app: console_app.Console) -> tuple[dict[str, str], str]:
    """bob, a read-only admin, logged in: (his requests' headers, his CSRF token)."""
    set_admin(app.config.path, "bob", admin_digest(), "read-only")
    r = _login(http, name="bob")
    assert r.status_code == 303, r.text
    token = re.search(r"tg_console=([^;]+)", r.headers.get_list("set-cookie")[0])
    assert token is not None
    s = app.sessions.get(token[1])
    assert s is not None
    return {"Cookie": f"tg_console={token[1]}", **ORIGIN}, s.csrf


def test_a_read_only_admin_sees_every_page_and_no_form(console: Any) -> None:
    http, app = console
    headers, _csrf = _read_only(http, app)
    for page in ("/keys", "/keys/demo", "/usage", "/live", "/requests", "/audit"):
        r = http.get(page, headers=headers)
        assert r.status_code == 200, (page, r.text[-500:])
        assert "bob (read-only)" in r.text, page
        # the one form of a read-only page is the header's Log out (and GET filters)
        posts = re.findall(r'<form method="post" action="([^"]+)"', r.text)
        assert posts == ["/logout"], (page, posts)
    assert 'id="new-key-link"' not in http.get("/keys", headers=headers).text
    r = http.get("/keys/new", headers=headers)
    assert r.status_code == 403 and "a read-only admin creates no key" in r.text


def test_every_post_of_a_read_only_admin_is_403_and_changes_nothing(console: Any) -> None:
    http, app = console
    headers, csrf = _read_only(http, app)
    before = app.config.path.read_text()
    for action, form in (
            ("/keys/new", {"name": "sneaky", "rpm": "1", "tpm": "1"}),
            ("/keys/demo", {"rpm": "1", "tpm": "1", "version": "0" * 64}),
            ("/keys/demo/revoke", {"confirm": "demo"}),
            ("/keys/demo/rotate", {"overlap": "0"}),
            ("/keys/demo/disable", {}), ("/keys/demo/enable", {})):
        r = http.post(action, data={**form, "csrf": csrf}, headers=headers)
        assert r.status_code == 403, action
        assert "bob is a read-only admin: every page, no change" in r.text
    assert app.config.path.read_text() == before
    # logging out is no change
    r = http.post("/logout", data={"csrf": csrf}, headers=headers)
    assert (r.status_code, r.headers["location"]) == (303, "/login")


def test_a_role_change_applies_to_the_next_request_of_a_session(console: Any) -> None:
    http, app = console
    alice, csrf = _session(http, app)
    assert 'id="new-key-link"' in http.get("/keys", headers=alice).text
    set_admin(app.config.path, "alice", role="read-only")
    assert 'id="new-key-link"' not in http.get("/keys", headers=alice).text
    r = http.post("/keys/demo/disable", data={"csrf": csrf}, headers=alice)
    assert r.status_code == 403
    set_admin(app.config.path, "alice", role="admin")
    assert 'id="new-key-link"' in http.get("/keys", headers=alice).text


def test_a_console_without_admins_says_how_to_set_one(console: Any) -> None:
    http, app = console
    set_admin(app.config.path, "alice", None)
    page = http.get("/login").text
    assert "No admin yet: on the host, <code>tokengate console passwd NAME</code>" in page
    # one set now logs in at once: the file is read at every request
    set_admin(app.config.path, "alice", admin_digest())
    assert "No admin yet" not in http.get("/login").text
    assert _login(http).status_code == 303


def test_live_reloads_itself_with_a_meta_refresh_under_the_same_policy(
        console: Any) -> None:
    http, app = console
    headers, _csrf = _session(http, app)
    r = http.get("/live", headers=headers)
    assert r.headers["content-security-policy"] == console_app.CSP
    assert "script" not in r.text
    assert '<meta http-equiv="refresh" content="15">' in r.text
    assert '<meta http-equiv="refresh" content="2">' in \
        http.get("/live?refresh=2", headers=headers).text
    paused = http.get("/live?range=6h&refresh=off", headers=headers).text
    assert 'http-equiv="refresh"' not in paused
    assert 'href="/live?range=24h&amp;refresh=off"' in paused  # the ranges keep it off
    assert 'id="refresh-on"' in paused


def test_a_request_in_the_log_opens_with_every_field(console: Any, tmp_path: Path) -> None:
    http, app = console
    headers, _csrf = _session(http, app)
    w = UsageWriter(app.usage_file)
    ev = make_event(status=429, error="rate_limit_exceeded", key_id="<b>demo</b>")
    w.write(ev)
    w.close()
    log = http.get("/requests?status=429", headers=headers).text
    link = re.search(r'<a href="(/requests/[0-9a-f]{32}\?at=[^"]+)"><code>', log)
    assert link is not None
    assert "<td>&lt;b&gt;demo&lt;/b&gt;</td>" in log
    page = http.get(link[1].replace("&amp;", "&"), headers=headers)
    assert page.status_code == 200
    fields = dict(re.findall(r'<tr data-field="(\w+)"><th>\w+</th><td>(?:<code>)?([^<]*)',
                             page.text))
    assert (fields["request_id"], fields["status"], fields["error"], fields["key_id"],
            fields["total_ms"], fields["trace"]) == (
        ev.request_id, "429", "rate_limit_exceeded", "&lt;b&gt;demo&lt;/b&gt;", "410.25",
        "null")
    assert http.get("/requests/" + "f" * 32, headers=headers).status_code == 404
    assert http.get("/requests/..%2f..%2fetc", headers=headers).status_code == 404
    r = http.get("/requests?status=teapot", headers=headers)
    assert r.status_code == 400 and 'id="e-status"' in r.text
