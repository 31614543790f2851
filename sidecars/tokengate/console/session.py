"""Logins of the console, kept on the server: a session is a random token (the cookie's
value; 256 bits), its admin, its CSRF token and when it ends. Expiry is the server's
(``ledger.console.session_ttl_s`` after the login, on a monotonic clock), whatever the
browser keeps. ``Sessions`` and ``LoginLimiter`` are shared by the server's threads.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

COOKIE = "tg_console"
MAX_SESSIONS = 10_000  # the oldest go first beyond this


@dataclass(frozen=True)
class Session:
    """One login: ``token`` is the cookie's value, ``csrf`` the token every form of
    this session carries, ``ends`` the monotonic time it expires."""

    token: str
    admin: str
    csrf: str
    ends: float
    digest: str = ""   # the admin's password digest at the login: a new password ends it

    def csrf_ok(self, given: str | None) -> bool:
        """Whether a form's token is this session's (compared in constant time)."""
        return given is not None and hmac.compare_digest(given.encode(), self.csrf.encode())


class Sessions:
    """The logged-in sessions of one console process."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._by_token: dict[str, Session] = {}
        self._lock = threading.Lock()

    def start(self, admin: str, digest: str = "") -> Session:
        """A new session of ``admin`` (a login with the password of ``digest``)."""
        s = Session(secrets.token_urlsafe(32), admin, secrets.token_urlsafe(32),
                    self.clock() + self.ttl_s, digest)
        with self._lock:
            if len(self._by_token) >= MAX_SESSIONS:
                oldest = min(self._by_token.values(), key=lambda x: x.ends)
                del self._by_token[oldest.token]
            self._by_token[s.token] = s
        return s

    def get(self, token: str | None) -> Session | None:
        """The live session of a cookie's value, or None (none, unknown or expired; an
        expired one is forgotten)."""
        if not token:
            return None
        with self._lock:
            s = self._by_token.get(token)
            if s is not None and s.ends <= self.clock():
                del self._by_token[token]
                return None
            return s

    def end(self, token: str | None) -> None:
        """Logs the session out (nothing for an unknown token)."""
        with self._lock:
            self._by_token.pop(token or "", None)

    def end_admin(self, admin: str) -> None:
        """Every session of ``admin`` ends (their password changed, or they were removed)."""
        with self._lock:
            for token in [t for t, s in self._by_token.items() if s.admin == admin]:
                del self._by_token[token]


class LoginLimiter:
    """Failed logins per admin name and per client address: after ``attempts`` failures
    within ``window_s`` (sliding) the next attempt is refused until the oldest of them
    is ``window_s`` old; a successful login clears its name and address."""

    def __init__(self, attempts: int, window_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.attempts = attempts
        self.window_s = window_s
        self.clock = clock
        self._failures: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def _recent(self, who: str, now: float) -> list[float]:
        kept = [t for t in self._failures.get(who, []) if t > now - self.window_s]
        if kept:
            self._failures[who] = kept
        else:
            self._failures.pop(who, None)
        return kept

    def wait_s(self, name: str, client: str) -> float:
        """Seconds until an attempt for ``name`` from ``client`` is allowed (0: now)."""
        now = self.clock()
        with self._lock:
            waits = [recent[0] + self.window_s - now
                     for who in (f"n:{name}", f"c:{client}")
                     if len(recent := self._recent(who, now)) >= self.attempts]
        return max(waits, default=0.0)

    def failed(self, name: str, client: str) -> None:
        now = self.clock()
        with self._lock:
            if len(self._failures) > 100_000:  # a flood of names: forget the stale ones
                for who in list(self._failures):
                    self._recent(who, now)
            for who in (f"n:{name}", f"c:{client}"):
                self._failures.setdefault(who, []).append(now)

    def succeeded(self, name: str, client: str) -> None:
        with self._lock:
            self._failures.pop(f"n:{name}", None)
            self._failures.pop(f"c:{client}", None)
