"""The request log: the edge's usage events (``tokengate.ledger.event``), one per finished
request of a valid key, read from the usage file and its rotated siblings
(``tokengate.ledger.tail.listing``: ``usage.jsonl.1``, ``usage.jsonl-20261129``, ...;
compressed ones are not read), newest first.

Files are named by content as the ledger names them (``tail.fingerprint``: a hash of the
first line), so a page's cursor (``tail.Position``: that id and a byte offset, "older
than here") stays valid when the file it points into is renamed by a rotation. A page
reads at most ``SCAN_BYTES``: a filter that matches little ends the page early, and its
cursor goes on from where the reading stopped. The live file comes first, then the
rotated ones by their last write, newest first; a last line still being written is not
read.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokengate.ledger import tail

READ_CHUNK = 256 << 10      # bytes read at a time, backwards
SCAN_BYTES = 32 << 20       # bytes of events one page reads at most
FIND_BYTES = 256 << 20      # bytes searched for one request id without a position
PAGE_SIZE = 50              # rows of a page
MAX_LINE = 1 << 20          # a line longer than this is not an event (not parsed)
STATUS_FILTER = re.compile(r"answered|refused|[1-5]xx|[1-5][0-9][0-9]")
_PLAIN = re.compile(r"[A-Za-z0-9._:@-]+")     # what JSON writes as it is, in any encoder
_STATUS = re.compile(rb'"status":\s*([1-5])[0-9][0-9][,}\s]')


@dataclass(frozen=True)
class UsageFile:
    """One of the usage files, open: ``file_id`` its ``tail.fingerprint``, ``size`` its
    length when opened (what is read of it)."""

    path: Path
    fd: int
    file_id: str
    size: int


@contextmanager
def open_files(usage_file: Path) -> Iterator[list[UsageFile]]:
    """The usage file and its rotated siblings that hold a line, open, newest first (the
    live file, then by last write); closed on exit. A file that vanishes meanwhile is
    left out."""
    opened: list[tuple[bool, float, UsageFile]] = []
    try:
        for name in tail.listing(usage_file):
            path = usage_file.parent / name
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            st = os.fstat(fd)
            file_id = tail.fingerprint(fd)
            if file_id is None:
                os.close(fd)
                continue
            opened.append((name == usage_file.name, st.st_mtime,
                           UsageFile(path, fd, file_id, st.st_size)))
        opened.sort(key=lambda o: (o[0], o[1]), reverse=True)
        yield [f for _, _, f in opened]
    finally:
        for _, _, f in opened:
            os.close(f.fd)


def lines_before(fd: int, end: int, chunk: int = READ_CHUNK) -> Iterator[tuple[int, bytes]]:
    """The complete lines (each ended by a newline) of the open file ``fd`` that end at or
    before byte ``end``, last first, as (offset of the line's first byte, the line
    without its newline); a line still being written at ``end`` is skipped."""
    pos = end
    carry = b""         # the bytes [pos, first newline] of what was read: a line's end
    first = True
    while pos > 0:
        n = min(chunk, pos)
        pos -= n
        data = os.pread(fd, n, pos) + carry
        if first:
            cut = data.rfind(b"\n")
            if cut < 0:
                carry = b""        # no line ends here yet: the end lies further back
                continue
            data, first = data[:cut + 1], False
        parts = data.split(b"\n")    # the last part is b"": data ends with a newline
        offsets = [pos]
        for part in parts[:-1]:
            offsets.append(offsets[-1] + len(part) + 1)
        whole = range(len(parts) - 2, -1 if pos == 0 else 0, -1)
        for i in whole:
            yield offsets[i], parts[i]
        carry = b"" if pos == 0 else data[:len(parts[0]) + 1]


def event(line: bytes) -> dict[str, Any] | None:
    """A usage line as a dict with at least ``request_id``, ``ts`` and ``status``, or None
    (not an event)."""
    if len(line) > MAX_LINE:
        return None
    try:
        ev = json.loads(line)
    except ValueError:
        return None
    if not isinstance(ev, dict) or not isinstance(ev.get("ts"), str) \
            or not isinstance(ev.get("request_id"), str) \
            or not isinstance(ev.get("status"), int):
        return None
    return ev


@dataclass(frozen=True)
class Filters:
    """What the request log shows: events of ``key`` (its id), of ``model``, whose
    ``status`` is "answered" (< 400), "refused" (>= 400), a class ("4xx") or a code
    ("429"); None: any."""

    key: str | None = None
    model: str | None = None
    status: str | None = None

    def might_match(self, line: bytes) -> bool:
        """False only for a line whose event cannot pass (no false negatives): a cheap
        look at the bytes before the line is parsed. A key or model is looked for as
        written when it has no character JSON may escape; a status by its first digit."""
        for value in (self.key, self.model):
            if value is not None and _PLAIN.fullmatch(value) \
                    and value.encode() not in line:
                return False
        want = self.status or ""
        m = _STATUS.search(line) if want in ("refused", "answered") or want.endswith("xx") \
            else None
        if m is None:
            return True
        first = m.group(1)
        return first in (b"4", b"5") if want == "refused" else \
            first in (b"1", b"2", b"3") if want == "answered" else first == want[0].encode()

    def match(self, ev: dict[str, Any]) -> bool:
        """Whether the event ``ev`` passes every filter."""
        if self.key is not None and ev.get("key_id") != self.key:
            return False
        if self.model is not None and ev.get("model") != self.model:
            return False
        s, want = ev["status"], self.status
        if want is None:
            return True
        if want == "answered":
            return bool(s < 400)
        if want == "refused":
            return bool(s >= 400)
        if want.endswith("xx"):
            return str(s)[:1] == want[0]
        return str(s) == want


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _ms(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok else None


@dataclass(frozen=True)
class Row:
    """One request of the log: the usage event's fields a table shows (tokens in tokens,
    times in ms on the edge's monotonic clock; ``reason`` the error code of a refused or
    failed request) and ``at``, its place (``tail.Position`` of its line, encoded)."""

    request_id: str
    ts: str
    key: str | None
    model: str | None
    endpoint: str
    status: int
    stream: bool
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    ttft_ms: float | None
    total_ms: float | None
    reason: str | None
    usage_source: str | None
    client_aborted: bool
    at: str

    @classmethod
    def of(cls, ev: dict[str, Any], at: tail.Position) -> Row:
        """The row of a usage event (a field of the wrong type shows as unknown)."""
        def text(name: str) -> str | None:
            v = ev.get(name)
            return v if isinstance(v, str) else None

        return cls(ev["request_id"], ev["ts"], text("key_id"), text("model"),
                   text("endpoint") or "", ev["status"], ev.get("stream") is True,
                   _int(ev.get("prompt_tokens")), _int(ev.get("cached_tokens")),
                   _int(ev.get("completion_tokens")), _ms(ev.get("ttft_ms")),
                   _ms(ev.get("total_ms")), text("error"), text("usage_source"),
                   ev.get("client_aborted") is True, at.encode())


@dataclass
class Page:
    """A page of the request log: ``rows`` newest first; ``older`` the cursor of the next
    page (None: nothing older is left); ``scanned`` bytes read; ``stopped_at`` the time
    of the oldest event read when the page ended at ``SCAN_BYTES`` before it was full;
    ``problem`` what to tell the reader (a cursor whose file is gone, a folder that cannot
    be read)."""

    rows: list[Row]
    older: str | None = None
    scanned: int = 0
    stopped_at: str | None = None
    problem: str | None = None


def _lines(files: list[UsageFile], before: tail.Position | None
           ) -> Iterator[tuple[tail.Position, bytes]]:
    """(place, line) of every line of ``files``, newest first, from ``before``
    (exclusive) on."""
    start = 0
    if before is not None:
        start = next((i for i, f in enumerate(files) if f.file_id == before.file_id), 0)
    for i, f in enumerate(files[start:], start):
        end = min(before.offset, f.size) if before is not None and i == start \
            and f.file_id == before.file_id else f.size
        for offset, line in lines_before(f.fd, end):
            yield tail.Position(f.file_id, offset), line


def request_log(usage_file: Path, filters: Filters, before: tail.Position | None = None,
                size: int = PAGE_SIZE, scan_bytes: int = SCAN_BYTES) -> Page:
    """The ``size`` newest requests that pass ``filters``, older than ``before`` (a
    ``Page.older`` of an earlier page; None: the newest), reading at most
    ``scan_bytes``."""
    page = Page([])
    with open_files(usage_file) as files:
        if not files and not os.access(usage_file.parent, os.R_OK | os.X_OK):
            page.problem = f"cannot read the folder {usage_file.parent}"
            return page
        if before is not None and all(f.file_id != before.file_id for f in files):
            page.problem = ("the file that page was in is no longer there (rotated away "
                            "or compressed): the newest requests instead")
            before = None
        last: tail.Position | None = None
        for at, line in _lines(files, before):
            page.scanned += len(line) + 1
            last = at
            ev = event(line) if filters.might_match(line) else None
            if ev is not None and filters.match(ev):
                page.rows.append(Row.of(ev, at))
                if len(page.rows) >= size:
                    page.older = at.encode()
                    break
            if page.scanned >= scan_bytes:
                page.older = at.encode()
                read = ev or event(line)
                page.stopped_at = read["ts"] if read is not None else None
                break
        if last is not None and page.older is not None and _is_oldest(files, last):
            page.older = None
    return page


def _is_oldest(files: list[UsageFile], at: tail.Position) -> bool:
    """Whether ``at`` is the first line of the oldest file: nothing is older."""
    return at.offset == 0 and files[-1].file_id == at.file_id


def find(usage_file: Path, request_id: str, at: tail.Position | None = None,
         scan_bytes: int = FIND_BYTES) -> dict[str, Any] | None:
    """The usage event of ``request_id``: the line at ``at`` when it is that request's
    (a row's ``at``), else the newest such line among the last ``scan_bytes`` of the
    files; None when not found."""
    needle = request_id.encode()
    with open_files(usage_file) as files:
        if at is not None:
            for f in files:
                if f.file_id == at.file_id and at.offset < f.size:
                    line = os.pread(f.fd, MAX_LINE, at.offset).split(b"\n", 1)[0]
                    ev = event(line)
                    if ev is not None and ev["request_id"] == request_id:
                        return ev
        scanned = 0
        for f in files:
            for _offset, line in lines_before(f.fd, f.size):
                scanned += len(line) + 1
                if needle in line:
                    ev = event(line)
                    if ev is not None and ev["request_id"] == request_id:
                        return ev
                if scanned >= scan_bytes:
                    return None
    return None
