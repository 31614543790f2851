"""A batch's input file: OpenAI's request-input lines, read and checked for their shape.

Each line is ``{"custom_id": str, "method": "POST", "url": <the batch's endpoint>,
"body": {...}}`` (OpenAI's Batch API reference, "The request input object"). What a line
asks of its endpoint (its model, its context, its fields) is not checked here: the edge
checks and counts each line as an online request of the endpoint (``tokengate.batch``
at the edge), so a line that cannot run gets the very error an online request gets.
A file whose shape is wrong fails its batch (OpenAI's ``validating`` -> ``failed``, with
``errors.data`` naming the lines).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

# the endpoints a batch may name (OpenAI's, where vLLM serves them)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
# a custom_id travels to the edge in a header and into the usage event
CUSTOM_ID = re.compile(r"[\x20-\x7e]{1,512}")
MAX_ERRORS = 20  # errors.data of a failed batch: the first this many


@dataclass(frozen=True, slots=True)
class Line:
    """One request of a batch: its 0-based index, custom_id and body (JSON text)."""

    index: int
    custom_id: str
    body: bytes


@dataclass(frozen=True, slots=True)
class LineError:
    """Why a file cannot be a batch (OpenAI's batch error: code, message, line 1-based)."""

    code: str
    message: str
    line: int | None
    param: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The ``errors.data`` entry."""
        return {"code": self.code, "message": self.message, "line": self.line,
                "param": self.param}


def parse(data: bytes, endpoint: str, max_lines: int,
          max_line_bytes: int) -> tuple[list[Line], list[LineError]]:
    """The lines of an input file for ``endpoint``, or the errors that fail its batch
    (at most ``MAX_ERRORS``): bad UTF-8 or JSON, a line above ``max_line_bytes``, more
    than ``max_lines`` lines, a missing or repeated custom_id, a method other than POST,
    a url other than ``endpoint``, a body that is not an object or asks for a stream.
    Empty lines are skipped, and a UTF-8 byte order mark opening the file (as some
    Windows tools write one). Bodies are kept as the client's JSON re-encoded (compact,
    UTF-8): what the edge checks and what it is sent later are the same bytes."""
    errors: list[LineError] = []
    lines: list[Line] = []
    seen: set[str] = set()
    raw_lines = data.removeprefix(codecs.BOM_UTF8).split(b"\n")
    if sum(1 for r in raw_lines if r.strip()) > max_lines:
        return [], [LineError("too_many_requests", f"The file has more than {max_lines} "
                              "requests (batch.max_lines).", None)]
    for n, raw in enumerate(raw_lines, start=1):
        if len(errors) >= MAX_ERRORS:
            break
        if not raw.strip():
            continue
        if len(raw) > max_line_bytes:
            errors.append(LineError("line_too_large", f"Line {n} has {len(raw)} bytes; at "
                                    f"most {max_line_bytes} (batch.max_line_bytes).", n))
            continue
        try:
            obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_object,
                             parse_constant=_no_constant)
        except RecursionError:
            errors.append(LineError("invalid_json_line", f"Line {n} nests too deep.", n))
            continue
        except UnicodeDecodeError as e:
            errors.append(LineError("invalid_json_line", f"Line {n} is not UTF-8 (byte "
                                    f"{e.start + 1} of the line).", n))
            continue
        except ValueError as e:
            errors.append(LineError("invalid_json_line", f"Line {n} is not JSON: {e}.", n))
            continue
        err = _check(obj, n, endpoint, seen)
        if err:
            errors.append(err)
            continue
        seen.add(obj["custom_id"])
        lines.append(Line(len(lines), obj["custom_id"], _encode(obj["body"])))
    if not lines and not errors:
        errors.append(LineError("empty_file", "The file has no requests.", None))
    return lines, errors


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object that names no key twice: the edge refuses a repeated key online
    (400 duplicate_key), and a dict would keep only the last value unseen."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for k, _v in pairs:
            if k in seen:
                raise ValueError(f"duplicate key {k!r} in an object")
            seen.add(k)
    return obj


def _no_constant(name: str) -> Any:
    """NaN and Infinity are not JSON (RFC 8259); the edge refuses them online too."""
    raise ValueError(f"{name} is not a JSON number")


def _encode(body: dict[str, Any]) -> bytes:
    """A line's body as compact JSON (UTF-8). A lone surrogate escape (``"\\ud800"``)
    cannot be UTF-8: such a body is written with ASCII escapes, so the edge reads the
    same escape the client sent and answers as online (400 invalid_unicode)."""
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        return json.dumps(body, separators=(",", ":")).encode()


def _check(obj: Any, n: int, endpoint: str, seen: set[str]) -> LineError | None:
    if not isinstance(obj, dict):
        return LineError("invalid_request", f"Line {n} is not a JSON object.", n)
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not CUSTOM_ID.fullmatch(cid):
        return LineError("invalid_custom_id", f"Line {n}: custom_id must be 1-512 printable "
                         "ASCII characters.", n, "custom_id")
    if cid in seen:
        return LineError("duplicate_custom_id", f"Line {n}: custom_id {cid!r} is used by an "
                         "earlier line.", n, "custom_id")
    if obj.get("method") != "POST":
        return LineError("invalid_method", f"Line {n}: method must be POST.", n, "method")
    if obj.get("url") != endpoint:
        return LineError("mismatched_endpoint", f"Line {n}: url must be the batch's "
                         f"endpoint {endpoint}.", n, "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        return LineError("invalid_body", f"Line {n}: body must be a JSON object.", n, "body")
    if body.get("stream") is True:
        return LineError("invalid_body", f"Line {n}: a batch line cannot stream "
                         "(stream: true).", n, "body.stream")
    unknown = set(obj) - {"custom_id", "method", "url", "body"}
    if unknown:
        first = min(unknown)
        return LineError("invalid_request", f"Line {n}: unknown field {first!r}.", n, first)
    return None


def request_id(batch_id: str, index: int, attempt: int) -> str:
    """The request id (32 hex digits) that line ``index`` of ``batch_id`` is sent with at
    ``attempt``: the same on every try of one attempt, so the ledger, which applies each
    request id once, bills the line once however often a crash made it go out again."""
    return hashlib.sha256(f"{batch_id}:{index}:{attempt}".encode()).hexdigest()[:32]
