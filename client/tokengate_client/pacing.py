"""Token-aware pacing: send a request only when the key's limits will admit it.

The edge limits each key with a sliding-window counter over wall-clock minute windows
(``lua/tokengate/local_limit.lua``; the global tier in Redis has the same shape):

    used(t) = prev * (1 - f) + cur        f = fraction of the current window elapsed

and admits a request when ``used + reservation <= limit``, the reservation being
``prompt + n x prompts x min(max_tokens_effective, output_reserve)`` tokens (RPM: 1). The
pacer keeps a copy of that counter for its key, fed by what every answer says:

- ``x-ratelimit-limit-*`` and ``x-ratelimit-remaining-*``: ``used = limit - remaining``
  when the edge decided;
- ``x-ratelimit-reset-*``: the time until the counts have slid out completely, which is
  ``(2 - f) x 60 s`` while the current window holds something and ``(1 - f) x 60 s``
  when only the previous one does: so it also says where the window boundary is, on the
  pacer's monotonic clock (no wall-clock agreement with the edge is needed);
- its own reservations and settlements (the billed usage of each answer).

Usage the pacer cannot attribute (other clients of the key, a first answer) is put in the
current window, where it does not decay until the window ends: the safe side. A request
that does not fit waits until, by the same formula as the edge's ``Retry-After``, it will;
a 429 is answered by waiting exactly its ``Retry-After``. ``margin`` tokens (one second of
the key's rate by default) stay unused, for what a header cannot say (its durations are
rounded up to a tenth of a second below one minute and to whole seconds above).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

WINDOW_S = 60.0  # the edge's limits are per minute (lua/tokengate/local_limit.lua WINDOW)
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
# a wait this short is float rounding of "fits now"; one this long at least, so that a
# clock's resolution cannot make it zero again
_FITS_S, _MIN_WAIT_S = 1e-6, 0.001


def parse_duration(text: str) -> float | None:
    """Seconds of an OpenAI-style duration (``"250ms"``, ``"1.2s"``, ``"6m0s"``,
    ``"1h2m3s"``); None when ``text`` is not one."""
    text = text.strip()
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


@dataclass(frozen=True)
class RateLimits:
    """The ``x-ratelimit-*`` headers of one answer (requests, tokens, seconds), and its
    ``Retry-After`` (whole seconds, 429s only)."""

    limit_requests: int
    limit_tokens: int
    remaining_requests: int
    remaining_tokens: int
    reset_requests_s: float
    reset_tokens_s: float
    retry_after_s: float | None = None

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> RateLimits | None:
        """Parsed from a response's headers (any mapping with case-insensitive ``get``,
        such as httpx's); None when one of the six ``x-ratelimit-*`` is missing or
        malformed (an answer that is not the edge's)."""
        try:
            limit_r = int(headers["x-ratelimit-limit-requests"])
            limit_t = int(headers["x-ratelimit-limit-tokens"])
            rem_r = int(headers["x-ratelimit-remaining-requests"])
            rem_t = int(headers["x-ratelimit-remaining-tokens"])
        except (KeyError, ValueError):
            return None
        reset_r = parse_duration(headers.get("x-ratelimit-reset-requests", ""))
        reset_t = parse_duration(headers.get("x-ratelimit-reset-tokens", ""))
        if reset_r is None or reset_t is None:
            return None
        retry: float | None
        try:
            retry = float(headers.get("retry-after", ""))
        except ValueError:
            retry = None
        return cls(limit_r, limit_t, rem_r, rem_t, reset_r, reset_t, retry)


@dataclass
class _Window:
    """One limit's sliding-window counts (the edge's ``prev`` and ``cur``), in tokens
    (or requests for RPM)."""

    limit: float
    prev: float = 0.0
    cur: float = 0.0

    def used(self, f: float) -> float:
        return self.prev * (1 - f) + self.cur

    def wait_s(self, cost: float, f: float, margin: float) -> float | None:
        """Seconds from fraction ``f`` of the window until ``used + cost <= limit -
        margin``, assuming nothing else is admitted meanwhile (``retry_after`` of
        ``local_limit.lua``, unrounded); None when ``cost`` can never fit."""
        room = self.limit - margin - cost
        if room < 0:
            return None
        if self.used(f) <= room:
            return 0.0
        if self.prev > 0 and self.cur <= room:
            # still in this window, once enough of the previous one has slid out
            return (1 - (room - self.cur) / self.prev - f) * WINDOW_S
        # in the next window, where this window's count becomes the decaying "previous"
        g = max(0.0, 1 - room / self.cur) if self.cur > 0 else 0.0
        return (1 - f + g) * WINDOW_S

    def set_used(self, used: float, f: float) -> None:
        """Make ``used(f)`` equal ``used``: the difference goes to (or comes off) the
        current window first, which does not decay (the safe side)."""
        cur = self.cur + used - self.used(f)
        if cur >= 0:
            self.cur = cur
        else:
            self.cur = 0.0
            self.prev = used / (1 - f) if f < 1 else 0.0


@dataclass
class Ticket:
    """One request's place in the pacer: its reservation (tokens; None: not counted) and
    the window it was reserved in."""

    tokens: int | None
    window: int = 0
    seq: int = 0
    reserved: bool = False


class Pacer:
    """A copy of one key's RPM and TPM windows; thread-safe (one lock, held briefly).

    ``acquire(tokens)`` -> ``(wait_s, ticket)``: wait_s > 0 means "sleep that long and
    ask again"; 0 means "send now", the reservation is held by ``ticket``. Then
    ``admitted(ticket, limits)`` with the answer's headers, and ``settle(ticket,
    billed_tokens)`` when the answer ended (prompt + completion tokens billed), or
    ``refused(ticket, limits)`` for a 429 (returns the seconds to wait).
    ``margin``: tokens left unused; None for one second of the key's TPM.
    """

    def __init__(self, margin: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._margin = margin
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens: _Window | None = None
        self._requests = _Window(0)
        self._window_end = 0.0   # monotonic time the current window ends
        self._window = 0         # windows rolled so far (tickets remember theirs)
        self._seq = 0

    # -- the model ----------------------------------------------------------------------

    def _roll(self, now: float) -> float:
        """Advance to the window holding ``now``; returns its elapsed fraction f."""
        assert self._tokens is not None
        while now >= self._window_end:
            skipped = now >= self._window_end + WINDOW_S
            for w in (self._tokens, self._requests):
                w.prev, w.cur = (0.0 if skipped else w.cur), 0.0
            self._window_end += WINDOW_S
            self._window += 1
        return min(1.0, max(0.0, 1 - (self._window_end - now) / WINDOW_S))

    def _margin_tokens(self) -> float:
        assert self._tokens is not None
        return self._tokens.limit / WINDOW_S if self._margin is None else self._margin

    def _observe(self, limits: RateLimits, now: float, exact: bool) -> None:
        """Takes in an answer's headers. ``exact``: nothing was reserved after the
        answer's request, so its counts replace the pacer's (else they can only raise
        them: a later reservation is not in them yet)."""
        reset = max(limits.reset_tokens_s, limits.reset_requests_s)
        if reset <= 0:
            return  # empty windows say nothing about where the boundary is
        # an upper bound of the boundary (the header was made before it arrived, and is
        # rounded up); the tightest one seen is kept
        end = now + (reset - WINDOW_S if reset > WINDOW_S else reset)
        if self._tokens is not None:
            self._roll(now)
        if self._tokens is None or abs(end - self._window_end) > 1.5:
            # unknown (first answer) or inconsistent: start over, all of it undecaying
            self._tokens = _Window(limits.limit_tokens, 0.0,
                                   limits.limit_tokens - limits.remaining_tokens)
            self._requests = _Window(limits.limit_requests, 0.0,
                                     limits.limit_requests - limits.remaining_requests)
            self._window_end = end
            return
        self._window_end = min(self._window_end, end)
        f = self._roll(now)
        self._tokens.limit, self._requests.limit = limits.limit_tokens, limits.limit_requests
        for w, used in ((self._tokens, limits.limit_tokens - limits.remaining_tokens),
                        (self._requests, limits.limit_requests - limits.remaining_requests)):
            if exact or used > w.used(f):
                w.set_used(used, f)

    # -- the protocol -------------------------------------------------------------------

    def acquire(self, tokens: int | None) -> tuple[float, Ticket]:
        """(seconds to wait first, ticket). ``tokens``: the request's TPM reservation
        as the edge will compute it (None when unknown: sent without pacing)."""
        with self._lock:
            ticket = Ticket(tokens, self._window, self._seq + 1)
            if self._tokens is None or tokens is None:
                self._seq += 1
                return 0.0, ticket  # nothing known yet: the first answer tells
            f = self._roll(self._clock())
            wait_t = self._tokens.wait_s(tokens, f, self._margin_tokens())
            wait_r = self._requests.wait_s(1, f, 0.0)
            if wait_t is None or wait_r is None:
                return 0.0, ticket  # can never fit: the edge says why
            wait = max(wait_t, wait_r)
            if wait > _FITS_S:
                return max(wait, _MIN_WAIT_S), ticket
            self._tokens.cur += tokens
            self._requests.cur += 1
            self._seq += 1
            ticket.window, ticket.reserved = self._window, True
            return 0.0, ticket

    def admitted(self, ticket: Ticket, limits: RateLimits | None) -> None:
        """The request was admitted; ``limits``: its answer's headers."""
        if limits is None:
            return
        with self._lock:
            self._observe(limits, self._clock(), exact=ticket.seq == self._seq)

    def settle(self, ticket: Ticket, billed_tokens: int) -> None:
        """The answer ended, ``billed_tokens`` = prompt + completion (the edge corrects
        its window by billed - reserved, in the window the request was admitted in)."""
        with self._lock:
            if not ticket.reserved or ticket.tokens is None or self._tokens is None:
                return
            self._roll(self._clock())
            delta = billed_tokens - ticket.tokens
            age = self._window - ticket.window
            if age == 0:
                self._tokens.cur = max(0.0, self._tokens.cur + delta)
            elif age == 1:
                self._tokens.prev = max(0.0, self._tokens.prev + delta)

    def refused(self, ticket: Ticket, limits: RateLimits | None) -> float:
        """A 429: the reservation is taken back (as the edge did), the headers taken in;
        returns the seconds to wait: ``Retry-After`` exactly (1 s without one)."""
        with self._lock:
            now = self._clock()
            if ticket.reserved and self._tokens is not None and ticket.tokens is not None:
                self._roll(now)
                if self._window == ticket.window:
                    self._tokens.cur = max(0.0, self._tokens.cur - ticket.tokens)
                    self._requests.cur = max(0.0, self._requests.cur - 1)
                ticket.reserved = False
            if limits is not None:
                self._observe(limits, now, exact=ticket.seq == self._seq)
        if limits is None or limits.retry_after_s is None:
            return 1.0
        return limits.retry_after_s
