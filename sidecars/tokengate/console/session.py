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


NAME_FACTOR = 10       # a name's failures from every address: this many times an address's
KNOWN_MAX = 10_000     # (name, address) pairs remembered after a successful login


class LoginLimiter:
    """Failed logins, counted before the password is checked: ``attempt`` checks the
    limits and counts the attempt as a failure in one step under the lock, so
    concurrent guesses cannot all pass the check before the first failure is counted
    (a scrypt check takes a tenth of a second); ``succeeded`` takes that count back.

    Two limits, each ``window_s`` sliding:

    - per client address: ``attempts`` failures, whatever names they tried;
    - per admin name: ``attempts * NAME_FACTOR`` failures from every address together
      (guessing spread over many addresses), which an address this name has logged in
      from before (``succeeded``: remembered for ``window_s * 288``, a day with the
      default 300 s) does not count: a third party can lock out its own address and
      new ones, never an admin's known address.
    """

    def __init__(self, attempts: int, window_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.attempts = attempts
        self.name_attempts = attempts * NAME_FACTOR
        self.window_s = window_s
        self.known_s = window_s * 288
        self.clock = clock
        self._failures: dict[str, list[float]] = {}
        self._known: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def _recent(self, who: str, now: float) -> list[float]:
        kept = [t for t in self._failures.get(who, []) if t > now - self.window_s]
        if kept:
            self._failures[who] = kept
        else:
            self._failures.pop(who, None)
        return kept

    def _is_known(self, name: str, client: str, now: float) -> bool:
        seen = self._known.get((name, client))
        return seen is not None and seen > now - self.known_s

    def attempt(self, name: str, client: str) -> float:
        """One login attempt for ``name`` from ``client``: 0 when it may go on (it is
        counted as a failure until ``succeeded``), else the seconds until one may (and
        nothing is counted)."""
        now = self.clock()
        with self._lock:
            if len(self._failures) > 100_000:  # a flood of names: forget the stale ones
                for who in list(self._failures):
                    self._recent(who, now)
            counted = [(f"c:{client}", self.attempts)]
            if not self._is_known(name, client, now):
                counted.append((f"n:{name}", self.name_attempts))
            waits = [recent[-limit] + self.window_s - now for who, limit in counted
                     if len(recent := self._recent(who, now)) >= limit]
            if waits:
                return max(waits)
            for who, _ in counted:
                self._failures.setdefault(who, []).append(now)
            return 0.0

    def succeeded(self, name: str, client: str) -> None:
        """The attempt's password was right: the address's failures are forgotten, the
        name's (other addresses') stay, and the address is known for this name."""
        now = self.clock()
        with self._lock:
            self._failures.pop(f"c:{client}", None)
            named = None if self._is_known(name, client, now) \
                else self._failures.get(f"n:{name}")  # a known address's are not counted
            if named:
                named.pop()  # this attempt's (its list holds at least it)
                if not named:
                    del self._failures[f"n:{name}"]
            if len(self._known) >= KNOWN_MAX:
                del self._known[min(self._known, key=self._known.__getitem__)]
            self._known[(name, client)] = now
