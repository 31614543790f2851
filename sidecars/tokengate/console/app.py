"""The console's WSGI application: routes, logins, CSRF and origin checks, security
headers, and the pages (Jinja2 templates, autoescaped).

Every answer carries the content security policy ``CSP`` (no script at all, styles and
images from the console itself, images also as ``data:`` URLs: the charts), nosniff,
no referrer and no framing, and ``Cache-Control: no-store``. A request whose Host is
not the console's own address (or an ``origins`` entry's) is refused: a DNS-rebinding
page never reaches it. Every POST must come from the console's own origin (the Origin
header, which browsers send with every POST) and, but for the login, carry the
session's CSRF token; else 403 and nothing changes.
"""

from __future__ import annotations

import argparse
import json
import logging
import secrets
import sys
import threading
import traceback
import urllib.parse
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from http import HTTPStatus
from pathlib import Path
from typing import Any, Literal

import jinja2
from redis.exceptions import RedisError

from tokengate import config as tg_config
from tokengate import version as tg_version
from tokengate.console import changes, data, forms, password
from tokengate.console.pages import ReportPages
from tokengate.console.session import COOKIE, LoginLimiter, Sessions
from tokengate.console.traffic import Traffic
from tokengate.console.web import Request, Response, cookies, first, redirect
from tokengate.keys.edit import parse_duration
from tokengate.keys.secret import digest as key_digest
from tokengate.keys.secret import new_key
from tokengate.ledger import admin, report
from tokengate.redis_client import SyncRedis

log = logging.getLogger("tokengate.console")

CSP = ("default-src 'none'; img-src 'self' data:; style-src 'self'; form-action 'self'; "
       "frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = [
    ("Content-Security-Policy", CSP),
    ("X-Content-Type-Options", "nosniff"),
    # not no-referrer: with it Chrome sends "Origin: null" with a form's POST
    ("Referrer-Policy", "same-origin"),
    ("X-Frame-Options", "DENY"),
    ("Cache-Control", "no-store"),
    ("Cross-Origin-Opener-Policy", "same-origin"),
    ("Cross-Origin-Resource-Policy", "same-origin"),
]
MAX_BODY = 64 * 1024        # bytes of a form; more: 413
LOGIN_COOKIE = "tg_console_login"
SESSIONS_SHOWN = 20         # a key's most recent agent sessions on its page
MAX_FIELDS = 50             # fields of a query or a form; more: 400
# the pages a login may go on to (``next``)
PAGES = ("/keys", "/usage", "/live", "/requests", "/batches", "/audit")
FLASHES_MAX = 1_000         # outcomes kept for the page a POST redirects to
HERE = Path(__file__).parent


def safe_next(target: str | None) -> str:
    """Where a login goes on: one of the console's own pages (``PAGES``, or below
    one), as ASCII. Anything else is ``/keys``: a control character anywhere (browsers
    drop TAB and newlines from a URL, so ``/\t/evil`` is ``//evil``), a backslash, a
    scheme or host. Other non-ASCII characters are percent-encoded: a ``Location``
    header is Latin-1 at most, and a character beyond it would cut the answer."""
    if not target or any(ord(c) < 0x20 or 0x7f <= ord(c) <= 0x9f or c == "\\"
                         for c in target):
        return "/keys"
    path = target.split("?", 1)[0].split("#", 1)[0]
    if not any(path == p or path.startswith(p + "/") for p in PAGES):
        return "/keys"
    return urllib.parse.quote(target, safe="/?&=%#+,;:@!$'()*~.-_")


class Config:
    """The configuration file as it is now: read again whenever it changed (``tokengate
    keys``, ``tokengate console passwd`` and the console's own changes edit it); a file
    that does not load leaves the last one that did."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.stamp: tuple[int, int, int] | None = None
        self.cfg = tg_config.load(path)

    def current(self) -> tg_config.Config:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp != self.stamp:
                self.stamp = stamp
                self.cfg = tg_config.load(self.path)
        except (tg_config.ConfigError, OSError) as e:
            log.error("%s does not load, the console shows the last configuration that "
                      "did: %s", self.path, " ".join(str(e).split())[:300])
        return self.cfg


def _fmt_amount(value: float | None) -> str:
    return "?" if value is None else f"{value:.9f}".rstrip("0").rstrip(".")


def _fmt_int(value: float | None) -> str:
    return "?" if value is None else f"{int(value):,}"


def _fmt_ms(value: float | None) -> str:
    """A time in ms as the tables show it: one decimal below 10 ms, whole ms above."""
    if value is None:
        return "–"
    return f"{value:.1f}" if value < 10 else f"{value:,.0f}"


def _fmt_utc(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%d %H:%M UTC")


def _pct(part: float | None, whole: float | None) -> int | None:
    if part is None or not whole:
        return None
    return min(100, round(100 * part / whole))


class Console(ReportPages):
    """The WSGI application (``__call__``); one per ``tokengate-console`` process.
    ``listen``: the address it is served on (default ``ledger.console.listen``), which
    the Host header must name."""

    def __init__(self, config_path: Path, client: SyncRedis, usage_file: Path,
                 clock: Callable[[], float] | None = None, listen: str | None = None) -> None:
        self.config = Config(config_path)
        self.listen = listen
        cc = self.config.cfg.ledger.console
        self.client = client
        self.usage_file = usage_file
        self.traffic = Traffic(usage_file)
        self.sessions = Sessions(cc.session_ttl_s, **({"clock": clock} if clock else {}))
        self.limiter = LoginLimiter(cc.login_attempts, cc.login_window_s,
                                    **({"clock": clock} if clock else {}))
        self.templates = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
            lstrip_blocks=True)
        self.templates.filters.update(amount=_fmt_amount, num=_fmt_int, ms=_fmt_ms,
                                      utc=_fmt_utc)
        # what runs, for the admins (not on the login page): tokengate.version
        self.templates.globals.update(pct=_pct, tokengate_version=tg_version.describe())
        self.css = (HERE / "static" / "console.css").read_bytes()
        # what a POST did, for the page its 303 leads to (one per session, shown once)
        self._flashes: dict[str, dict[str, Any]] = {}
        self._flash_lock = threading.Lock()

    # --- the WSGI side -------------------------------------------------------------

    def __call__(self, environ: dict[str, Any],
                 start_response: Callable[..., Any]) -> Iterable[bytes]:
        try:
            resp = self.handle(environ)
        except Exception:  # noqa: BLE001 (a page never shows a traceback; the log keeps it)
            print("tokengate console: " + traceback.format_exc(), file=sys.stderr,
                  flush=True)
            resp = self.page(500, "error.html", None, title="Error",
                             message="The console failed to answer; its log says why.")
        headers = [*SECURITY_HEADERS, ("Content-Type", resp.content_type),
                   ("Content-Length", str(len(resp.body))), *resp.headers]
        start_response(f"{resp.status} {HTTPStatus(resp.status).phrase}", headers)
        return [b""] if environ.get("REQUEST_METHOD") == "HEAD" else [resp.body]

    def allowed_hosts(self, cfg: tg_config.Config) -> set[str]:
        """Host header values the console answers: its listen address, and with a
        loopback or wildcard one the loopback names on its port, and the hosts of
        ``origins``."""
        cc = cfg.ledger.console
        listen = self.listen or cc.listen
        host, _, port = listen.rpartition(":")
        out = {listen}
        if host in ("0.0.0.0", "[::]", "::", "127.0.0.1", "localhost", "[::1]"):
            out |= {f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"}
        out |= {urllib.parse.urlsplit(o).netloc for o in cc.origins}
        return out

    def handle(self, environ: dict[str, Any]) -> Response:
        cfg = self.config.current()
        method = environ.get("REQUEST_METHOD", "GET")
        host = environ.get("HTTP_HOST", "")
        if host not in self.allowed_hosts(cfg):
            return self.plain(421, f"this console does not answer to host {host[:100]!r}")
        try:
            query = first(urllib.parse.parse_qs(environ.get("QUERY_STRING", ""),
                                                 max_num_fields=MAX_FIELDS))
        except ValueError:
            return self.plain(400, f"a query has at most {MAX_FIELDS} fields")
        req = Request(method, environ.get("PATH_INFO") or "/", query,
                      cookies(environ.get("HTTP_COOKIE", "")), host,
                      environ.get("HTTP_ORIGIN"), environ.get("REMOTE_ADDR", ""))
        if req.path == "/static/console.css":
            return Response(200, self.css, "text/css; charset=utf-8")
        if req.path == "/favicon.ico":  # browsers ask for it unprompted: not a login page
            return Response(404, b"", "text/plain")
        if method == "POST":
            refused = self.read_post(environ, req, cfg)
            if refused is not None:
                return refused
        elif method not in ("GET", "HEAD"):
            return self.plain(405, f"{method[:20]} is not allowed here", [("Allow", "GET, POST")])
        if req.path == "/login":
            return self.login(req, cfg)
        req.session = self.sessions.get(req.cookies.get(COOKIE))
        if req.session is None \
                or cfg.ledger.console.admins.get(req.session.admin) != req.session.digest:
            # logged out, expired, or the admin was removed or given a new password
            if method == "POST":
                return self.plain(403, "not logged in (or the session ended): log in again")
            return redirect("/login?" + urllib.parse.urlencode({"next": req.path}))
        if method == "POST" and not req.session.csrf_ok(req.form.get("csrf")):
            return self.plain(403, "this form is not from this session (CSRF token missing "
                                   "or wrong): reload the page and try again")
        # the role as the file says now: a demotion applies to the next request
        req.read_only = cfg.ledger.console.role(req.session.admin) == "read-only"
        if req.read_only and method == "POST" and req.path != "/logout":
            return self.plain(403, f"{req.session.admin} is a read-only admin: every page, "
                                   "no change (ledger.console.roles)")
        return self.route(req, cfg)

    def read_post(self, environ: dict[str, Any], req: Request,
                  cfg: tg_config.Config) -> Response | None:
        """Origin check and form parsing of a POST; an answer when it is refused."""
        own = {f"http://{req.host}", f"https://{req.host}", *cfg.ledger.console.origins}
        if req.origin not in own:
            return self.plain(403, "a change must come from the console's own pages "
                                   f"(Origin {str(req.origin)[:100]!r} refused)")
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            return self.plain(413, f"a form is at most {MAX_BODY // 1024} KiB")
        kind = environ.get("CONTENT_TYPE", "").split(";")[0].strip()
        if kind != "application/x-www-form-urlencoded":
            return self.plain(415, "a form is application/x-www-form-urlencoded")
        body = environ["wsgi.input"].read(length).decode("utf-8", "replace")
        try:
            req.form = first(urllib.parse.parse_qs(body, keep_blank_values=True,
                                                    max_num_fields=MAX_FIELDS))
        except ValueError:
            return self.plain(400, f"a form has at most {MAX_FIELDS} fields")
        return None

    def route(self, req: Request, cfg: tg_config.Config) -> Response:
        p, m = req.path.rstrip("/") or "/", req.method
        if p == "/":
            return redirect("/keys")
        if p == "/logout" and m == "POST":
            assert req.session is not None
            self.sessions.end(req.session.token)
            return redirect("/login", 303)
        if p == "/logout":  # a link or a typed URL: logging out is the header's button
            return self.plain(405, "log out with the Log out button (a POST)",
                              [("Allow", "POST")])
        if p == "/keys":
            return self.keys_page(req, cfg)
        if p == "/keys/new" and req.read_only:
            return self.plain(403, "a read-only admin creates no key")
        if p == "/keys/new":
            return self.create_key(req, cfg) if m == "POST" else self.new_key_page(req, cfg)
        if p.startswith("/keys/"):
            name, _, action = urllib.parse.unquote(p.removeprefix("/keys/")).partition("/")
            if name not in cfg.keys:
                return self.page(404, "error.html", req, title="No such key",
                                 message=f"There is no key named {name[:64]!r}.")
            if action == "revoke" and m == "POST":
                return self.revoke_key(req, cfg, name)
            if action == "rotate" and m == "POST":
                return self.rotate_key(req, cfg, name)
            if action == "disable" and m == "POST":
                return self.switch_key(req, cfg, name, "disable")
            if action == "enable" and m == "POST":
                return self.switch_key(req, cfg, name, "enable")
            if action == "" and m == "POST":
                return self.set_key(req, cfg, name)
            if action == "":
                return self.key_page(req, cfg, name)
        if p.startswith("/teams/"):
            name = urllib.parse.unquote(p.removeprefix("/teams/"))
            if name not in cfg.teams:
                return self.page(404, "error.html", req, title="No such team",
                                 message=f"There is no team named {name[:64]!r}.")
            return self.team_page(req, cfg, name)
        if p == "/usage":
            return self.usage_page(req, cfg)
        if p == "/usage.csv":
            return self.usage_csv(req, cfg)
        if p == "/live":
            return self.live_page(req, cfg)
        if p == "/requests":
            return self.requests_page(req, cfg)
        if p.startswith("/requests/"):
            return self.request_page(req, cfg, urllib.parse.unquote(p.removeprefix(
                "/requests/")))
        if p == "/batches":
            return self.batches_page(req, cfg)
        if p == "/audit":
            return self.audit_page(req, cfg)
        return self.page(404, "error.html", req, title="Not found",
                         message=f"No page at {req.path[:200]!r}.")

    # --- rendering -----------------------------------------------------------------

    def page(self, status: int, template: str, req: Request | None,
             headers: list[tuple[str, str]] | None = None, **ctx: Any) -> Response:
        cfg = self.config.cfg
        ctx.setdefault("page", "")
        ctx.setdefault("title", "Log in")
        ctx.setdefault("no_admin", not cfg.ledger.console.admins)
        html = self.templates.get_template(template).render(
            session=req.session if req else None, read_only=bool(req and req.read_only),
            currency=cfg.currency, **ctx)
        return Response(status, html.encode(), headers=headers or [])

    def plain(self, status: int, message: str,
              headers: list[tuple[str, str]] | None = None) -> Response:
        return self.page(status, "error.html", None, headers,
                         title=HTTPStatus(status).phrase, message=message)

    def audit(self, req: Request, action: str, key: str = "", detail: str = "",
              result: str = "ok", admin: str | None = None) -> str | None:
        """Writes the audit entry; returns why it could not (None: written)."""
        cfg = self.config.cfg
        who = admin if admin is not None else (req.session.admin if req.session else "")
        try:
            changes.audit(self.client, cfg.ledger.audit_maxlen, who, action, req.client,
                          key, detail, result)
        except (RedisError, OSError) as e:
            log.error("audit entry not written (Redis: %s): %s %s %s by %s", e, action,
                      key, result, who)
            return f"Redis: {' '.join(str(e).split())[:200]}"
        return None

    def flash(self, req: Request, at: str, **ctx: Any) -> None:
        """Keeps ``ctx`` for page ``at`` (a path), the next this session shows (the
        303 after a POST leads there)."""
        assert req.session is not None
        with self._flash_lock:
            if len(self._flashes) >= FLASHES_MAX:
                del self._flashes[next(iter(self._flashes))]
            self._flashes[req.session.token] = {"at": at, **ctx}

    def flashed(self, req: Request) -> dict[str, Any]:
        """What the last POST of this session left for this page (once), or {}."""
        if req.session is None or req.method != "GET":
            return {}
        with self._flash_lock:
            ctx = self._flashes.pop(req.session.token, {})
        return ctx if ctx.get("at") == req.path else {}

    # --- login ---------------------------------------------------------------------

    def login(self, req: Request, cfg: tg_config.Config) -> Response:
        if req.method != "POST":
            # the browser's token stays while it lasts: a second login page (another
            # tab) must not make the first one's form stale
            token = req.cookies.get(LOGIN_COOKIE) or secrets.token_urlsafe(24)
            return self.page(200, "login.html", None, self._login_cookie(token, cfg),
                             csrf=token, next=safe_next(req.query.get("next")), error=None,
                             name="")
        name = req.form.get("name", "")[:64]
        given = req.form.get("csrf")
        if not given or given != req.cookies.get(LOGIN_COOKIE):
            return self.plain(403, "this login form is not from this browser: reload it")
        # counted as a failure before the (slow) check: see LoginLimiter
        wait = self.limiter.attempt(name, req.client)
        token = secrets.token_urlsafe(24)
        if wait > 0:
            return self.page(429, "login.html", None,
                             [("Retry-After", str(int(wait) + 1)),
                              *self._login_cookie(token, cfg)],
                             csrf=token, next=safe_next(req.form.get("next")), name=name,
                             error=f"Too many failed logins: try again in {int(wait) + 1} s.")
        if not password.verify_admin(dict(cfg.ledger.console.admins), name,
                                     req.form.get("password", "")):
            self.audit(req, "login_failed", result="refused", admin=name)
            return self.page(401, "login.html", None, self._login_cookie(token, cfg),
                             csrf=token, next=safe_next(req.form.get("next")), name=name,
                             error="Wrong name or password.")
        self.limiter.succeeded(name, req.client)
        s = self.sessions.start(name, cfg.ledger.console.admins[name])
        self.audit(req, "login", admin=name)
        secure = "; Secure" if cfg.ledger.console.secure_cookie else ""
        return Response(
            303, b"", headers=[
                ("Location", safe_next(req.form.get("next"))),
                ("Set-Cookie", (f"{COOKIE}={s.token}; Path=/; HttpOnly; SameSite=Strict"
                                f"; Max-Age={cfg.ledger.console.session_ttl_s}{secure}")),
                ("Set-Cookie", (f"{LOGIN_COOKIE}=; Path=/login; Max-Age=0; HttpOnly"
                                f"; SameSite=Strict{secure}"))])

    def _login_cookie(self, token: str, cfg: tg_config.Config) -> list[tuple[str, str]]:
        secure = "; Secure" if cfg.ledger.console.secure_cookie else ""
        return [("Set-Cookie", (f"{LOGIN_COOKIE}={token}; Path=/login; HttpOnly"
                                f"; SameSite=Strict; Max-Age=3600{secure}"))]

    # --- keys ----------------------------------------------------------------------

    def keys_page(self, req: Request, cfg: tg_config.Config, status: int = 200,
                  notice: str | None = None, outcome: changes.Outcome | None = None
                  ) -> Response:
        entries, minutes, problem = data.keys_view(cfg, self.client, data.today())
        if status == 200 and notice is None and outcome is None:
            flashed = self.flashed(req)
            notice, outcome = flashed.get("notice"), flashed.get("outcome")
        return self.page(status, "keys.html", req, title="Keys", entries=entries,
                         minutes=minutes, problem=problem, notice=notice, outcome=outcome,
                         global_limits=cfg.global_limits.enabled, page="keys")

    def new_key_page(self, req: Request, cfg: tg_config.Config,
                     checked: forms.Checked | None = None, status: int = 200,
                     outcome: changes.Outcome | None = None) -> Response:
        values = checked.values if checked else {"name": "", "rpm": "60", "tpm": "100000",
                                                  "models": "", "budgets": "", "priority": ""}
        return self.page(status, "key_new.html", req, title="New key", values=values,
                         errors=checked.errors if checked else {}, outcome=outcome,
                         models=list(cfg.models), page="keys",
                         priorities=list(cfg.edge.admission.priorities))

    def _make(self, req: Request, cfg: tg_config.Config,
              change: changes.KeyChange) -> changes.Outcome:
        assert req.session is not None
        cc = cfg.ledger.console
        if cc.changes_dir is not None:
            outcome = changes.submit(cc.changes_dir, change, req.session.admin)
        else:
            outcome = changes.make(cfg.path, change, list(cc.edges))
        if outcome.stale:
            result = "refused: stale form: changed since " + ", ".join(outcome.stale)
        else:
            result = "ok" if outcome.ok else "refused: " + "; ".join(outcome.errors)[:500]
        problem = self.audit(req, changes.ACTIONS[change.verb], change.name,
                             change.audit_detail(), result)
        if problem is not None and outcome.ok:
            # made, and said so: never a change that silently has no audit entry
            outcome.not_audited = problem
        return outcome

    def create_key(self, req: Request, cfg: tg_config.Config) -> Response:
        key = new_key()
        change, checked = forms.create(req.form, cfg, key_digest(key))
        if change is None:
            return self.new_key_page(req, cfg, checked, 400)
        outcome = self._make(req, cfg, change)
        if not outcome.ok:
            return self.new_key_page(req, cfg, checked, 400, outcome)
        return self.page(201, "key_created.html", req, title="Key created", name=change.name,
                         key=key, outcome=outcome, page="keys", rotated=False, until=None)

    def key_page(self, req: Request, cfg: tg_config.Config, name: str,
                 checked: forms.Checked | None = None, status: int = 200,
                 outcome: changes.Outcome | None = None) -> Response:
        k = cfg.keys[name]
        if status == 200 and outcome is None:
            outcome = self.flashed(req).get("outcome")
        current = forms.form_values(k)
        values = checked.values if checked else current
        # the version the form carries: a form shown again with its messages keeps the
        # one it was loaded with, so saving it still finds a change made meanwhile
        shown = current
        if checked is not None:
            given = req.form.get("shown", "")
            try:
                doc = json.loads(given) if given else None
            except ValueError:
                doc = None
            if isinstance(doc, dict) and forms.key_version(doc) == req.form.get("version"):
                shown = doc
        one = cfg.model_copy(update={"keys": {name: k}})
        entries, minutes, problem = data.keys_view(one, self.client, data.today())
        since = data.today() - timedelta(days=29)
        try:
            rows = report.group(data.usage_rows(self.client, data.UsageQuery(
                since, data.today(), key=name)), ["model"])
            sessions = report.query_sessions(self.client, [name], limit=SESSIONS_SHOWN)
        except (RedisError, OSError) as e:
            rows, sessions, problem = [], [], f"Redis unavailable: {e}"
        return self.page(status, "key.html", req, title=f"Key {name}", name=name,
                         entry=entries[0], minute=(minutes or {}).get(name), problem=problem,
                         values=values, errors=checked.errors if checked else {},
                         version=forms.key_version(shown),
                         shown=json.dumps(shown, sort_keys=True, separators=(",", ":")),
                         outcome=outcome, rows=rows, since=since.isoformat(), page="keys",
                         sessions=sessions, session_budget=k.session_budget,
                         session_days=cfg.ledger.session_days,
                         models=list(cfg.models),
                         priorities=list(cfg.edge.admission.priorities),
                         global_limits=cfg.global_limits.enabled)

    def team_page(self, req: Request, cfg: tg_config.Config, name: str) -> Response:
        """A team: its limits, members, pooled budgets and the alerts sent this period."""
        team, problem = admin.team_view(cfg, self.client, name, data.today())
        return self.page(200, "team.html", req, title=f"Team {name}", team=team,
                         problem=problem, page="keys")

    def set_key(self, req: Request, cfg: tg_config.Config, name: str) -> Response:
        change, checked = forms.set_(req.form, cfg, name)
        if change is None:
            return self.key_page(req, cfg, name, checked, 400)
        outcome = self._make(req, cfg, change)
        cfg = self.config.current()
        if outcome.stale and name in cfg.keys:
            # the current settings, with a new version, and what changed: the admin
            # makes the change again on them, never over them
            return self.key_page(req, cfg, name, None, 409, outcome)
        if not outcome.ok or name not in cfg.keys:
            return self.key_page(req, cfg, name, checked, 400, outcome)
        at = f"/keys/{urllib.parse.quote(name, safe='')}"
        self.flash(req, urllib.parse.unquote(at), outcome=outcome)
        return redirect(at)

    def revoke_key(self, req: Request, cfg: tg_config.Config, name: str) -> Response:
        if req.form.get("confirm") != name:
            return self.key_page(req, cfg, name, None, 400, changes.Outcome(
                errors=[f"to revoke, type the key's name ({name}) in the box"]))
        outcome = self._make(req, cfg, changes.KeyChange("revoke", name))
        cfg = self.config.current()
        if not outcome.ok:
            return self.key_page(req, cfg, name, None, 400, outcome)
        self.flash(req, "/keys", notice=f"Key {name} revoked.", outcome=outcome)
        return redirect("/keys")

    def rotate_key(self, req: Request, cfg: tg_config.Config, name: str) -> Response:
        """A new secret, shown once (as a created key's); the old one valid for the
        form's ``overlap`` (``tokengate keys rotate --overlap``'s durations) more."""
        try:
            overlap = parse_duration(req.form.get("overlap", "24h").strip() or "24h")
        except argparse.ArgumentTypeError as e:
            return self.key_page(req, cfg, name, None, 400, changes.Outcome(errors=[str(e)]))
        key = new_key()
        outcome = self._make(req, cfg, changes.KeyChange(
            "rotate", name, sha256=key_digest(key), overlap_s=int(overlap.total_seconds())))
        if not outcome.ok:
            return self.key_page(req, cfg, name, None, 400, outcome)
        prev = self.config.current().keys[name].previous
        until = tg_config.rfc3339(prev[-1].expires_at) if overlap and prev else None
        return self.page(201, "key_created.html", req, title="Key rotated", name=name,
                         key=key, outcome=outcome, page="keys", rotated=True,
                         until=until)

    def switch_key(self, req: Request, cfg: tg_config.Config, name: str,
                   verb: Literal["disable", "enable"]) -> Response:
        outcome = self._make(req, cfg, changes.KeyChange(verb, name))
        cfg = self.config.current()
        return self.key_page(req, cfg, name, None, 200 if outcome.ok else 400, outcome)
