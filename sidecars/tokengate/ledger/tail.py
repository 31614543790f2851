"""Reads the usage file from a position, line by line, across log rotations.

Rotation follows nginx's reopen semantics: the file is renamed (``usage.jsonl`` ->
``usage.jsonl.1``), a new ``usage.jsonl`` is created, and writers keep appending to the
old file until they reopen. The tail therefore

- holds the file it reads open by descriptor, so a rename (or unlink) loses nothing;
- notices a rotation when the path names another file than the one it reads;
- finishes the old file: reads it to its end and switches to the next file only once
  the old one has not been written for ``rotate_wait_s`` (late writers' lines count);
- a final line without a newline in a finished file is handed out as it is (the
  ledger counts it as a bad line).

A ``Position`` names a file by content, not by name or inode: ``file_id`` is a hash of
its first line (which contains a unique request id), so the position survives renames,
copies and inode reuse. Files are read one at a time; when one is finished, ``read()``
says so (``Finished``) and the ledger records its id as done before the tail moves on.
``seek(position, done)`` therefore needs no notion of file age: it takes the usage file
and its rotated siblings (``usage.jsonl*``, compressed ones skipped), drops those
whose id is done, starts with the one the position names (at its offset) and reads
every other one from its start, the live file last.

Lines are handed out in batches (``read()``) and consumed only by ``commit()``, so a
batch can be retried after a failure.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("tokengate.ledger.tail")

FINGERPRINT_BYTES = 4096
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip")


@dataclass(frozen=True, slots=True)
class Position:
    """How far the usage files have been consumed: a file (by content) and a byte offset
    just after a newline."""

    file_id: str
    offset: int

    def encode(self) -> str:
        """``<file_id>:<offset>``, the form stored in the ledger's checkpoint."""
        return f"{self.file_id}:{self.offset}"

    @classmethod
    def decode(cls, text: str | None) -> Position | None:
        """Inverse of ``encode``; ``None`` for an empty or malformed value."""
        if not text or ":" not in text:
            return None
        fid, _, off = text.rpartition(":")
        return cls(fid, int(off)) if off.isdigit() and fid else None


@dataclass(slots=True)
class Batch:
    """Complete lines of one file from ``start`` to ``end`` (bytes), newlines removed."""

    path: Path
    file_id: str
    start: int
    end: int
    lines: list[bytes] = field(default_factory=list)

    @property
    def position(self) -> Position:
        """The position after this batch."""
        return Position(self.file_id, self.end)


@dataclass(frozen=True, slots=True)
class Finished:
    """The current file is finished (rotated, read to its end, quiet for
    ``rotate_wait_s``); ``file_id`` is None for a file that never had a line."""

    path: Path
    file_id: str | None
    end: int


@dataclass(slots=True)
class _Open:
    path: Path            # the name it had when opened (for logs only)
    fd: int
    ino: tuple[int, int]  # (st_dev, st_ino)
    file_id: str | None = None
    offset: int = 0

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def fingerprint(fd: int) -> str | None:
    """Hex id of an open file: SHA-256 (first 32 hex digits) of its first line (at most
    ``FINGERPRINT_BYTES``); ``None`` while the first line is still incomplete."""
    head = os.pread(fd, FINGERPRINT_BYTES, 0)
    nl = head.find(b"\n")
    if nl >= 0:
        head = head[:nl + 1]
    elif len(head) < FINGERPRINT_BYTES:
        return None
    return hashlib.sha256(head).hexdigest()[:32]


def listing(path: Path) -> dict[str, tuple[int, int]]:
    """Names of the usage file ``path`` and its uncompressed rotated siblings (regular
    files in its folder whose names start with its name: ``usage.jsonl.1``,
    ``usage.jsonl-20261129``) -> (st_dev, st_ino); {} when the folder cannot be
    listed."""
    out: dict[str, tuple[int, int]] = {}
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return out
    for e in entries:
        if not e.name.startswith(path.name) or e.name.endswith(COMPRESSED):
            continue
        try:
            st = os.stat(e.path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out[e.name] = (st.st_dev, st.st_ino)
    return out


class UsageTail:
    """Line reader over the usage file and its rotations (see the module docstring).

    ``path``: the live usage file; ``rotate_wait_s``: how long a rotated file must be
    quiet (seconds since its last write) before it is considered finished;
    ``max_lines`` / ``max_bytes``: the most one batch carries.
    """

    def __init__(self, path: Path, rotate_wait_s: float = 5.0, max_lines: int = 500,
                 max_bytes: int = 1 << 20) -> None:
        self.path = Path(path)
        self.rotate_wait_s = rotate_wait_s
        self.max_lines = max_lines
        self.max_bytes = max_bytes
        self._cur: _Open | None = None
        self._queue: list[_Open] = []

    # -- positioning ---------------------------------------------------------------

    def _listing(self) -> dict[str, tuple[int, int]]:
        return listing(self.path)

    def _siblings(self) -> list[_Open]:
        """The usage file and its rotated siblings, open; by mtime, the live file last.

        A rotation can run while they are listed and opened (the ledger starting during
        a logrotate): a name listed before a rename opens the new file, and the renamed
        one would be missed until the next start. So the folder is listed again after
        the files are open, until both listings agree with what was opened."""
        out: list[_Open] = []
        for attempt in range(20):
            before = self._listing()
            out = []
            for name, ino in sorted(before.items()):
                if any(o.ino == ino for o in out):  # a second name of one file
                    continue
                try:
                    fd = os.open(self.path.parent / name, os.O_RDONLY)
                except OSError:
                    continue
                st = os.fstat(fd)
                out.append(_Open(self.path.parent / name, fd, (st.st_dev, st.st_ino),
                                 fingerprint(fd)))
            stable = before == self._listing() and \
                {o.ino for o in out} == set(before.values())
            if stable or attempt == 19:
                break
            for o in out:
                o.close()
            time.sleep(0.01)
        live = self._live_ino()
        out.sort(key=lambda o: (o.ino == live, os.fstat(o.fd).st_mtime))
        return out

    def seek(self, pos: Position | None, done: Collection[str] = ()) -> None:
        """Position the reader: skip files whose id is in ``done``; start with the file
        ``pos`` names, at its offset; then every other file from its start, the live
        file last."""
        self.close()
        files = []
        for f in self._siblings():
            if f.file_id is not None and f.file_id in done:
                f.close()
            else:
                files.append(f)
        if pos is not None:
            for i, f in enumerate(files):
                if f.file_id == pos.file_id:
                    size = os.fstat(f.fd).st_size
                    if pos.offset > size:
                        log.warning("%s: checkpoint offset %d beyond its size %d (truncated?);"
                                    " reading it again from the start", f.path, pos.offset,
                                    size)
                    else:
                        f.offset = pos.offset
                    files.insert(0, files.pop(i))
                    break
            else:
                log.warning("checkpointed usage file %s is gone; reading the %d usage files "
                            "not yet done from their start", pos.file_id, len(files))
        self._queue = files
        self._cur = self._queue.pop(0) if self._queue else None

    @property
    def position(self) -> Position | None:
        """Where the next batch starts; ``None`` before any line of a file is consumed
        from its start."""
        c = self._cur
        if c is None or c.file_id is None:
            return None
        return Position(c.file_id, c.offset)

    # -- reading -------------------------------------------------------------------

    def _live_ino(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino)

    def _check_rotation(self) -> None:
        """Queue the live file when it is not one we hold (created after a rotation)."""
        live = self._live_ino()
        if live is None:
            return
        held = [o.ino for o in self._queue]
        if self._cur is not None:
            held.append(self._cur.ino)
        if live in held:
            return
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != live:  # rotated again in between: next poll
            os.close(fd)
            return
        if self._cur is not None:
            log.info("usage file rotated: finishing the file opened as %s, then reading the "
                     "new %s", self._cur.path, self.path)
        o = _Open(self.path, fd, live)
        if self._cur is None:
            self._cur = o
        else:
            self._queue.append(o)

    def _finished(self, cur: _Open) -> bool:
        """A file is finished when a newer file exists and it was not written for
        ``rotate_wait_s``; the live file never is."""
        if not self._queue or cur.ino == self._live_ino():
            return False
        return time.time() - os.fstat(cur.fd).st_mtime >= self.rotate_wait_s

    def read(self) -> Batch | Finished | None:
        """The next complete lines (at most ``max_lines``) without consuming them, or
        ``Finished`` when the current file is done (call ``advance()``), or ``None``
        when nothing new is there."""
        self._check_rotation()
        while self._cur is not None:
            cur = self._cur
            size = os.fstat(cur.fd).st_size
            if size < cur.offset:
                log.warning("%s shrank below the read offset (%d < %d): truncated in place;"
                            " reading it from the start", cur.path, size, cur.offset)
                cur.offset, cur.file_id = 0, None
            data = os.pread(cur.fd, self.max_bytes, cur.offset)
            nl = data.rfind(b"\n")
            if nl < 0 and len(data) == self.max_bytes:
                nl = self._overlong(cur)
                if nl >= 0:
                    data = os.pread(cur.fd, nl + 1 - cur.offset, cur.offset)
                    nl = len(data) - 1
            if nl >= 0:
                lines = data[:nl].split(b"\n")[: self.max_lines]
                end = cur.offset + sum(len(x) + 1 for x in lines)
                return self._batch(cur, end, lines)
            finished = self._finished(cur)
            if finished and data:
                # The unterminated last line of a finished file: handed out once.
                return self._batch(cur, cur.offset + len(data), [data])
            if not finished:
                return None
            return Finished(cur.path, cur.file_id or fingerprint(cur.fd), cur.offset)
        return None

    def advance(self) -> None:
        """Close the finished current file and go on with the next one."""
        cur = self._cur
        if cur is None:
            return
        log.info("finished the rotated usage file opened as %s at %d bytes", cur.path,
                 cur.offset)
        cur.close()
        self._cur = self._queue.pop(0) if self._queue else None

    def _overlong(self, cur: _Open) -> int:
        """Absolute offset of the next newline past a window with none; -1 if none yet."""
        off = cur.offset + self.max_bytes
        while True:
            chunk = os.pread(cur.fd, self.max_bytes, off)
            if not chunk:
                return -1
            i = chunk.find(b"\n")
            if i >= 0:
                return off + i
            off += len(chunk)

    def _batch(self, cur: _Open, end: int, lines: list[bytes]) -> Batch:
        if cur.file_id is None:
            cur.file_id = fingerprint(cur.fd)
            if cur.file_id is None:  # an unterminated first line shorter than the window
                cur.file_id = hashlib.sha256(os.pread(cur.fd, FINGERPRINT_BYTES, 0)) \
                    .hexdigest()[:32]
        return Batch(cur.path, cur.file_id, cur.offset, end, lines)

    def commit(self, batch: Batch) -> None:
        """Consume ``batch`` (it must be the one ``read()`` returned last)."""
        cur = self._cur
        if cur is None or cur.file_id != batch.file_id or cur.offset != batch.start:
            raise RuntimeError("commit of a batch that is not the current one")
        cur.offset = batch.end

    def lag_bytes(self) -> int:
        """Bytes written but not yet consumed, over the current and queued files."""
        total = 0
        for o in ([self._cur] if self._cur else []) + self._queue:
            total += max(0, os.fstat(o.fd).st_size - o.offset)
        return total

    def pending_line(self, limit: int = 1 << 16) -> bytes | None:
        """The oldest line written but not yet consumed (at most ``limit`` bytes, newline
        removed), over the current and queued files; ``None`` when there is none."""
        for o in ([self._cur] if self._cur else []) + self._queue:
            data = os.pread(o.fd, limit, o.offset)
            if data:
                return data.split(b"\n", 1)[0]
        return None

    def close(self) -> None:
        """Close every held file."""
        for o in ([self._cur] if self._cur else []) + self._queue:
            o.close()
        self._cur, self._queue = None, []
