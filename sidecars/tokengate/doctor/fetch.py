"""One HTTP request of a doctor's check: to an upstream (vLLM's routes, JSON bodies) or to
a running sidecar's own loopback port (its metrics, the ledger's status)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from functools import cached_property
from typing import Any


class Unreachable(Exception):
    """No HTTP answer (connection refused, timeout, reset, a bad URL)."""


@dataclass(frozen=True)
class Answer:
    """An HTTP answer, whatever its status: ``raw`` is its body."""

    status: int
    raw: bytes

    @cached_property
    def body(self) -> Any:
        """The body as parsed JSON, or None (empty, or not JSON)."""
        try:
            return json.loads(self.raw) if self.raw else None
        except ValueError:
            return None


def request(method: str, url: str, body: Any = None, timeout_s: float = 60.0,
            headers: dict[str, str] | None = None) -> Answer:
    """``method url`` with ``body`` sent as JSON (None: no body) and ``headers``; urllib
    sends the URL's ``host:port`` as the Host header (what the ledger's admin view
    requires of a request to its metrics port). Any status is an ``Answer``; raises
    ``Unreachable`` when no answer comes within ``timeout_s`` seconds."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={
        **({} if data is None else {"Content-Type": "application/json"}), **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return Answer(r.status, r.read())
    except urllib.error.HTTPError as e:
        return Answer(e.code, e.read())
    except (OSError, ValueError) as e:  # URLError, timeouts, a reset; a bad URL
        raise Unreachable(str(getattr(e, "reason", None) or e)) from None


def why(a: Answer) -> str:
    """A refusal as one short phrase: ``HTTP 400: <vLLM's message>``."""
    msg = None
    if isinstance(a.body, dict):
        err = a.body.get("error")
        msg = err.get("message") if isinstance(err, dict) else a.body.get("detail")
    text = f"HTTP {a.status}"
    if isinstance(msg, str) and msg:
        msg = " ".join(msg.split())
        text += ": " + (msg if len(msg) <= 200 else msg[:197] + "...")
    return text
