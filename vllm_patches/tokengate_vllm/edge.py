"""What the edge says about a request, kept for its engine record: the API key's id and
the edge's endpoint, from the headers the edge sets on every request it forwards
(``X-Tokengate-Key``, ``X-Tokengate-Endpoint``: lua/tokengate/phases.lua).

With them an engine record can be billed on its own when the edge's usage event of its
request never comes (an nginx worker killed mid-stream writes none): the ledger bills
such an orphan record to its key (``tokengate.ledger.join``).

``EdgeHeaders`` is an ASGI middleware, loaded by vLLM's own option
``--middleware tokengate_vllm.edge.EdgeHeaders`` (vllm/entrypoints/serve/middleware/
register.py adds a class with ``app.add_middleware``). It runs in the task that serves
the request and puts the two values in a context variable; every task the request
spawns afterwards (vLLM's ``with_cancellation`` handler task, Starlette's streaming
task, in which ``AsyncLLM.generate`` adds the request) copies that context, so
``hooks`` reads them in ``OutputProcessor.add_request`` and tags the request's state.
A request without the headers (sent to vLLM directly) gets ``null`` in both fields.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, MutableMapping
from contextvars import ContextVar
from typing import Any

KEY_HEADER = b"x-tokengate-key"
ENDPOINT_HEADER = b"x-tokengate-endpoint"

# printable ASCII without spaces, as key ids (tokengate.config.keys.KEY_ID) and the
# edge's endpoint names are; anything else is not the edge's and is left out
_VALUE = re.compile(r"[\x21-\x7e]{1,128}")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_edge: ContextVar[tuple[str | None, str | None]] = ContextVar("tokengate_edge",
                                                              default=(None, None))


def _value(raw: bytes) -> str | None:
    text = raw.decode("latin-1")
    return text if _VALUE.fullmatch(text) else None


def current() -> tuple[str | None, str | None]:
    """(key id, endpoint) the edge sent with the request being served, each None when
    not sent (or not a plain token)."""
    return _edge.get()


class EdgeHeaders:
    """ASGI middleware: the edge's ``X-Tokengate-Key`` and ``X-Tokengate-Endpoint`` of
    an HTTP request, in ``current()`` while it is served (module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = endpoint = None
        if scope.get("type") == "http":
            for name, value in scope.get("headers") or ():
                if name == KEY_HEADER:
                    key = _value(value)
                elif name == ENDPOINT_HEADER:
                    endpoint = _value(value)
        if key is None and endpoint is None:
            await self.app(scope, receive, send)
            return
        token = _edge.set((key, endpoint))
        try:
            await self.app(scope, receive, send)
        finally:
            _edge.reset(token)
