"""The Files and Batch API in OpenAI's shapes (a WSGI app behind the edge).

The edge reads the API key (401 in OpenAI's shape, the lockout of guessers) and forwards
``/v1/files`` and ``/v1/batches`` with the key's id in ``X-Tokengate-Key``; every object
belongs to one key, and another key gets 404 for it (as for an id that never existed).

Routes (OpenAI's API reference, Files and Batch)::

    POST   /v1/files                  multipart: purpose=batch, file -> file object
    GET    /v1/files                  ?purpose, limit (1-10000), after, order -> list
    GET    /v1/files/{id}             -> file object
    GET    /v1/files/{id}/content     -> the bytes
    DELETE /v1/files/{id}             -> {id, object: "file", deleted: true}
    POST   /v1/batches                {input_file_id, endpoint, completion_window: "24h",
                                      metadata} -> batch object (validating)
    GET    /v1/batches                ?limit (1-100), after -> list
    GET    /v1/batches/{id}           -> batch object
    POST   /v1/batches/{id}/cancel    -> batch object (cancelling)

Errors: ``{"error": {"message", "type", "param", "code"}}`` with 400 (bad input), 401 (no
key: only without the edge), 404, 405, 413 (a file above ``batch.max_file_bytes``), 415,
503 (Redis unavailable).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from email.errors import CloseBoundaryNotFoundDefect
from email.message import Message
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any
from urllib.parse import parse_qs

import redis

from tokengate.batch import lines as lines_mod
from tokengate.batch.store import NotFound, Page, Store
from tokengate.config import BatchConfig

StartResponse = Callable[..., Any]
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512  # OpenAI's metadata bounds
UPLOAD_PURPOSES = ("batch",)
CREATE_MAX_BYTES = 1024 * 1024  # a create request is a small JSON object
CREATE_UTF8 = ("utf-8", "utf8")  # the charsets a create body may name (JSON: UTF-8)

_FILE = re.compile(r"/v1/files/([^/]+)(/content)?")
_BATCH = re.compile(r"/v1/batches/([^/]+)(/cancel)?")


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> bytes:
        """The error's JSON body."""
        etype = "invalid_request_error" if self.status < 500 else "server_error"
        return json.dumps({"error": {"message": self.message, "type": etype,
                                     "param": self.param, "code": self.code}}).encode()


REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
           405: "Method Not Allowed", 413: "Payload Too Large",
           415: "Unsupported Media Type", 500: "Internal Server Error",
           503: "Service Unavailable"}


class BatchApi:
    """The WSGI app: ``BatchApi(store, cfg)(environ, start_response)``."""

    def __init__(self, store: Store, cfg: BatchConfig) -> None:
        self.store = store
        self.cfg = cfg

    def __call__(self, environ: dict[str, Any], start: StartResponse) -> Iterable[bytes]:
        try:
            status, body, ctype = self._route(environ)
        except ApiError as e:
            status, body, ctype = e.status, e.body(), "application/json"
        except redis.RedisError:
            err = ApiError(503, "The Batch API's store (Redis) is unavailable. Please retry.",
                           None, "store_unavailable")
            status, body, ctype = 503, err.body(), "application/json"
        except NotFound as e:
            err = ApiError(404, f"No such {e.kind}: '{e.ident[:64]}'.", "id", "not_found")
            status, body, ctype = 404, err.body(), "application/json"
        start(f"{status} {REASONS.get(status, 'Error')}",
              [("Content-Type", ctype), ("Content-Length", str(len(body)))])
        return [body]

    def _route(self, env: dict[str, Any]) -> tuple[int, bytes, str]:
        key_id = env.get("HTTP_X_TOKENGATE_KEY") or ""
        if not key_id:
            raise ApiError(401, "You didn't provide an API key.", None, "invalid_api_key")
        method, path = env["REQUEST_METHOD"], env.get("PATH_INFO", "")
        query = {k: v[-1] for k, v in parse_qs(env.get("QUERY_STRING", "")).items()}
        if path == "/v1/files":
            if method == "POST":
                return _json(self._upload(env, key_id))
            _allow(method, "GET", "POST")
            return _json(_list(self.store.files(
                key_id, query.get("purpose"), _limit(query, 10000), query.get("after"),
                _order(query))))
        if path == "/v1/batches":
            if method == "POST":
                return _json(self._create(env, key_id))
            _allow(method, "GET", "POST")
            return _json(_list(self.store.batches(key_id, _limit(query, 100),
                                                   query.get("after"))))
        m = _FILE.fullmatch(path)
        if m:
            file_id, content = m.group(1), m.group(2)
            if content:
                _allow(method, "GET")
                return 200, self.store.content(key_id, file_id), "application/octet-stream"
            if method == "DELETE":
                self.store.delete_file(key_id, file_id)
                return _json({"id": file_id, "object": "file", "deleted": True})
            _allow(method, "GET", "DELETE")
            return _json(self.store.file(key_id, file_id))
        m = _BATCH.fullmatch(path)
        if m:
            batch_id, cancel = m.group(1), m.group(2)
            if cancel:
                _allow(method, "POST")
                return _json(self.store.cancel(key_id, batch_id))
            _allow(method, "GET")
            return _json(self.store.batch(key_id, batch_id))
        raise ApiError(404, f"Invalid URL ({method} {path[:64]})", None, "unknown_url")

    def _body(self, env: dict[str, Any], most: int, bound: str, code: str) -> bytes:
        """The request body, at most ``most`` bytes (``bound`` names that bound in the
        413, ``code`` is its code). A longer body is read to its end and dropped before
        the 413: answering while nginx still sends it broke the connection under the
        answer (nginx then sent its own HTML page under the JSON's Content-Length)."""
        try:
            length = int(env.get("CONTENT_LENGTH") or 0)
        except ValueError:
            raise ApiError(400, "Content-Length is not a number.") from None
        stream = env["wsgi.input"]
        if length > most:
            left = length
            while left > 0 and (chunk := stream.read(min(left, 1 << 20))):
                left -= len(chunk)
            raise ApiError(413, f"The request has {length} bytes; at most {most} ({bound}).",
                           None, code)
        data: bytes = stream.read(length) if length else b""
        return data

    def _upload(self, env: dict[str, Any], key_id: str) -> dict[str, Any]:
        ctype = env.get("CONTENT_TYPE") or ""
        if not ctype.lower().startswith("multipart/form-data"):
            raise ApiError(415, "Upload a file as multipart/form-data (fields purpose and "
                           "file).", None, "unsupported_media_type")
        data = self._body(env, self.cfg.max_file_bytes + 64 * 1024,
                          "batch.max_file_bytes and the form's fields", "file_too_large")
        msg = BytesParser(policy=HTTP).parsebytes(
            f"Content-Type: {ctype}\r\n\r\n".encode("latin-1") + data)
        if not msg.is_multipart():
            raise ApiError(400, "The upload is not a multipart/form-data body with a "
                           "boundary (send the fields purpose and file as a form).", None,
                           "invalid_multipart")
        if any(isinstance(d, CloseBoundaryNotFoundDefect) for d in msg.defects):
            # a body cut short: its last part (often the file) may be missing its end
            raise ApiError(400, f"The upload ends without its closing boundary "
                           f"('--{msg.get_boundary()}--'): it may have been cut short.",
                           None, "invalid_multipart")
        fields: dict[str, tuple[str | None, bytes]] = {}
        for part in msg.iter_parts():
            name = part.get_param("name", header="content-disposition")
            if isinstance(name, str):
                if name in fields and name in ("purpose", "file"):
                    raise ApiError(400, f"The upload has more than one {name!r} field.",
                                   name, "invalid_multipart")
                payload = part.get_payload(decode=True)
                fields[name] = (part.get_filename(),
                                payload if isinstance(payload, bytes) else b"")
        purpose = fields.get("purpose", (None, b""))[1].decode("utf-8", "replace")
        if purpose not in UPLOAD_PURPOSES:
            raise ApiError(400, f"purpose must be one of {', '.join(UPLOAD_PURPOSES)} "
                           f"(got {purpose[:64]!r}).", "purpose", "invalid_purpose")
        if "file" not in fields:
            raise ApiError(400, "The upload has no file field.", "file", "missing_file")
        filename, content = fields["file"]
        if len(content) > self.cfg.max_file_bytes:
            raise ApiError(413, f"The file has {len(content)} bytes; at most "
                           f"{self.cfg.max_file_bytes} (batch.max_file_bytes).", "file",
                           "file_too_large")
        name = (filename or "upload.jsonl")[:255]
        return self.store.add_file(key_id, name, purpose, content)

    def _create(self, env: dict[str, Any], key_id: str) -> dict[str, Any]:
        # the body read first, whatever the answer (answering before it was read broke
        # the connection under nginx)
        data = self._body(env, CREATE_MAX_BYTES, "a batch's create request",
                          "request_too_large")
        ctype = env.get("CONTENT_TYPE") or ""
        header = Message()
        header["Content-Type"] = ctype
        charset = str(header.get_param("charset", "utf-8")).lower()
        if header.get_content_type() != "application/json" or charset not in CREATE_UTF8:
            # as the edge answers a JSON API (lua/tokengate/body.lua check_headers)
            raise ApiError(415, f"Unsupported Content-Type {ctype[:64]!r}: send the "
                           "request body as application/json (UTF-8).", None,
                           "unsupported_media_type")
        try:
            req = json.loads(data)
        except (ValueError, RecursionError):
            raise ApiError(400, "The body is not JSON (or nests too deep).", None,
                           "invalid_json") from None
        if not isinstance(req, dict):
            raise ApiError(400, "The body must be a JSON object.", None, "invalid_json")
        file_id = req.get("input_file_id")
        endpoint = req.get("endpoint")
        if req.get("completion_window") != "24h":
            raise ApiError(400, "completion_window must be '24h'.", "completion_window",
                           "invalid_value")
        if endpoint not in lines_mod.ENDPOINTS:
            raise ApiError(400, f"endpoint must be one of {', '.join(lines_mod.ENDPOINTS)}.",
                           "endpoint", "invalid_value")
        metadata = req.get("metadata")
        if metadata is not None and not _metadata_ok(metadata):
            raise ApiError(400, f"metadata: at most {METADATA_PAIRS} string pairs, keys up to "
                           f"{METADATA_KEY} and values up to {METADATA_VALUE} characters.",
                           "metadata", "invalid_value")
        if file_id is None:
            raise ApiError(400, "input_file_id is required.", "input_file_id",
                           "missing_required_parameter")
        if not isinstance(file_id, str):
            raise ApiError(400, "input_file_id must be a string (a file's id).",
                           "input_file_id", "invalid_type")
        try:
            f = self.store.file(key_id, file_id)
        except NotFound:
            raise ApiError(404, f"No such file: '{file_id[:64]}'.", "input_file_id",
                           "not_found") from None
        if f["purpose"] != "batch":
            raise ApiError(400, f"The file {file_id} was not uploaded with purpose 'batch'.",
                           "input_file_id", "invalid_value")
        self._bounds(self.store.content(key_id, file_id))
        return self.store.add_batch(key_id, file_id, endpoint, self.cfg.expiry_s, metadata)

    def _bounds(self, data: bytes) -> None:
        """400 for an input file above the line bounds (before any line is checked)."""
        rows = [r for r in data.split(b"\n") if r.strip()]
        if len(rows) > self.cfg.max_lines:
            raise ApiError(400, f"The input file has {len(rows)} requests; a batch takes at "
                           f"most {self.cfg.max_lines} (batch.max_lines).", "input_file_id",
                           "too_many_requests")
        big = max((len(r) for r in rows), default=0)
        if big > self.cfg.max_line_bytes:
            raise ApiError(400, f"A line of the input file has {big} bytes; at most "
                           f"{self.cfg.max_line_bytes} (batch.max_line_bytes).",
                           "input_file_id", "line_too_large")


def _metadata_ok(m: Any) -> bool:
    return isinstance(m, dict) and len(m) <= METADATA_PAIRS and all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= METADATA_KEY
        and len(v) <= METADATA_VALUE for k, v in m.items())


def _allow(method: str, *allowed: str) -> None:
    """405 unless ``method`` is one of the path's ``allowed`` methods (HEAD with GET)."""
    if method not in allowed and not (method == "HEAD" and "GET" in allowed):
        raise ApiError(405, f"Method {method[:16]} not allowed here (allowed: "
                       f"{', '.join(allowed)}).", None, "method_not_allowed")


def _limit(query: dict[str, str], most: int) -> int:
    try:
        n = int(query.get("limit", "20"))
    except ValueError:
        raise ApiError(400, "limit must be a whole number.", "limit") from None
    if not 1 <= n <= most:
        raise ApiError(400, f"limit must be between 1 and {most}.", "limit")
    return n


def _order(query: dict[str, str]) -> bool:
    """``order`` of a files list: True for ``desc`` (the default, newest first), False
    for ``asc``; anything else is a 400, as OpenAI's API answers it."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be asc or desc (got {order[:16]!r}).", "order",
                       "invalid_value")
    return order == "desc"


def _list(page: Page) -> dict[str, Any]:
    return {"object": "list", "data": page.data,
            "first_id": page.data[0]["id"] if page.data else None,
            "last_id": page.data[-1]["id"] if page.data else None,
            "has_more": page.has_more}


def _json(obj: Any) -> tuple[int, bytes, str]:
    return 200, json.dumps(obj, ensure_ascii=False).encode(), "application/json"
