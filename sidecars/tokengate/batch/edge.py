"""The batch service's calls to the edge: a line checked and counted (at creation) or
sent (when it runs), as ``batch.worker_key`` acting for the batch's key
(``lua/tokengate/batch.lua``: the headers below)."""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass(frozen=True, slots=True)
class Answer:
    """The edge's answer: status, body (bytes), its X-Request-Id, Retry-After (s) and
    whether the edge says retrying can help (x-should-retry is not "false")."""

    status: int
    body: bytes
    request_id: str | None
    retry_after_s: float | None
    should_retry: bool

    def json(self) -> Any:
        """The body decoded; None when it is not JSON."""
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    def error_code(self) -> str | None:
        """The code of an OpenAI error body, or None."""
        doc = self.json()
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
            code = doc["error"].get("code")
            return code if isinstance(code, str) else None
        return None


class EdgeClient:
    """HTTP/1.1 to the edge's API listener, one kept-alive connection per thread.

    ``url``: the edge (``batch.edge_url``); ``secret``: the worker key's secret;
    ``timeout_s``: a call's connect and read timeout (a line's whole generation).

    nginx closes a kept-alive connection that stays idle past its ``keepalive_timeout``
    (75 s on the API listener): such a connection is replaced before a request goes on
    it (``_conn``). A request is never sent twice here: a connection that breaks once
    it is out leaves the outcome unknown to the worker, which sends the line again with
    the same request id (``tokengate.batch.worker``); an immediate second send could
    meet an edge still starting, whose refusal would move the line to a new request id
    while its first send may have run."""

    def __init__(self, url: str, secret: str, timeout_s: float = 900.0) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.secret = secret
        self.timeout_s = timeout_s
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        """This thread's connection; one the edge closed while it was idle is replaced
        by a new one."""
        c = getattr(self._local, "conn", None)
        if c is not None and c.sock is not None and closed_by_peer(c.sock):
            c.close()
            c = None
        if c is None:
            c = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            self._local.conn = c
        return c

    def post(self, path: str, body: bytes, key_id: str, batch_id: str, custom_id: str,
             line_request_id: str | None) -> Answer:
        """POST ``body`` to ``path`` for ``key_id``'s batch line. ``line_request_id``:
        the line's request id (sent); None: a check (X-Tokengate-Batch-Check, answered
        with the count, never billed). Raises ``OSError`` or ``http.client.HTTPException``
        when the edge cannot be reached or the connection breaks (the outcome unknown)."""
        headers = {"Authorization": f"Bearer {self.secret}", "Content-Type": "application/json",
                   "X-Tokengate-Batch-Key": key_id, "X-Tokengate-Batch-Id": batch_id,
                   "X-Tokengate-Batch-Custom-Id": custom_id}
        if line_request_id is None:
            headers["X-Tokengate-Batch-Check"] = "1"
        else:
            headers["X-Tokengate-Batch-Line"] = line_request_id
        conn = self._conn()
        try:
            conn.request("POST", path, body=body, headers=headers)
            r = conn.getresponse()
            data = r.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            self._local.conn = None
            raise
        retry = r.getheader("Retry-After")
        try:
            retry_s = float(retry) if retry is not None else None
        except ValueError:
            retry_s = None
        if r.getheader("Connection", "").lower() == "close":
            conn.close()
            self._local.conn = None
        return Answer(r.status, data, r.getheader("X-Request-Id"), retry_s,
                      r.getheader("x-should-retry", "").lower() != "false")


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the peer closed this idle HTTP/1.1 connection: with no request out, a
    kept-alive connection has nothing to read, so a readable one holds the peer's end
    of stream (or bytes no request asked for: unusable as well). urllib3 tests a pooled
    connection the same way before it reuses it (``util.wait.wait_for_read``)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))
