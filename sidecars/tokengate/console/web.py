"""What the console's handlers read of a request and give back: ``Request``,
``Response``, and the small readers of cookies and queries they share."""

from __future__ import annotations

from dataclasses import dataclass, field
from http.cookies import CookieError, SimpleCookie

from tokengate.console.session import Session


@dataclass
class Request:
    """What a handler reads of one request; ``read_only``: its session's admin has the
    read-only role (``ledger.console.roles``)."""

    method: str
    path: str
    query: dict[str, str]
    cookies: dict[str, str]
    host: str
    origin: str | None
    client: str
    form: dict[str, str] = field(default_factory=dict)
    session: Session | None = None
    read_only: bool = False


@dataclass
class Response:
    """An answer: status, body, its type and more headers (the security headers are
    added to every one)."""

    status: int
    body: bytes = b""
    content_type: str = "text/html; charset=utf-8"
    headers: list[tuple[str, str]] = field(default_factory=list)


def redirect(location: str, status: int = 303) -> Response:
    """A redirect to ``location`` (303: the page a POST leads to is fetched with GET)."""
    return Response(status, b"", headers=[("Location", location)])


def cookies(header: str) -> dict[str, str]:
    """A Cookie header's values by name ({} for one that does not parse)."""
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(header)
    except CookieError:
        return {}
    return {k: m.value for k, m in jar.items()}


def first(qs: dict[str, list[str]]) -> dict[str, str]:
    """``urllib.parse.parse_qs``' answer with each field's first value."""
    return {k: v[0] for k, v in qs.items() if v}
