"""Appends engine usage records to the engine usage file, durably enough to bill from.

Rules (the same the edge's usage file follows, so the ledger's tail,
``tokengate.ledger.tail.UsageTail``, reads both):

- one ``write(2)`` per batch (one ``record()`` call of the stat logger, one abort),
  with ``O_APPEND``: a batch leaves the process as soon as it exists, so a crash of
  vLLM loses nothing and a crash of the machine loses at most what the OS had not
  written; several writers (API server processes) never interleave inside a line;
- every line ends with a newline, and the reader takes only complete lines, so a line
  being written is never read as data; a write cut short (disk full) is finished by
  a newline before anything else is written, so the fragment stays a line of its own
  (a bad line for the reader, never glued to the next record), and the records not
  written are kept (up to ``max_pending``) and written again with the next batch;
- rotation by rename (logrotate without ``copytruncate``): before each batch the
  writer checks that the path still names the file it holds, and opens the new file
  when it does not; the old file gets nothing more, and the tail finishes it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("vllm.tokengate")

MAX_PENDING = 100_000     # records kept while the file cannot be written
ERROR_LOG_EVERY_S = 30.0  # one error line per this many seconds while writes fail


class RecordWriter:
    """One engine usage file, appended to by whole lines (see the module docstring).

    ``path``: the file (its folder is created); ``max_pending``: records kept in memory
    while writes fail, the oldest dropped beyond it (counted in ``dropped``).
    Thread-safe; in vLLM every call comes from the API server's event loop thread.
    """

    def __init__(self, path: Path, max_pending: int = MAX_PENDING) -> None:
        self.path = Path(path)
        self.max_pending = max_pending
        self.written = 0   # records written
        self.dropped = 0   # records given up (max_pending exceeded)
        self._pending: list[bytes] = []
        self._fd: int | None = None
        self._ino: tuple[int, int] | None = None
        self._torn = False  # the file ends inside a line a failed write left
        self._lock = threading.Lock()
        self._last_error_log = 0.0

    def write(self, lines: list[bytes]) -> bool:
        """Append ``lines`` (each newline-terminated) and any records a failed write
        left, in one write. True when nothing is left pending; never raises for I/O
        (an error is logged at most every ``ERROR_LOG_EVERY_S``)."""
        with self._lock:
            self._pending.extend(lines)
            if len(self._pending) > self.max_pending:
                over = len(self._pending) - self.max_pending
                del self._pending[:over]
                self.dropped += over
                log.error("engine usage file %s: %d records dropped after failed writes "
                          "(%d so far)", self.path, over, self.dropped)
            if not self._pending:
                return True
            try:
                self._flush()
            except OSError as e:
                now = time.monotonic()
                if now - self._last_error_log >= ERROR_LOG_EVERY_S:
                    self._last_error_log = now
                    log.error("engine usage file %s: write failed (%s); %d records kept "
                              "for the next write", self.path, e, len(self._pending))
                return False
            return True

    def pending(self) -> int:
        """Records not yet written."""
        with self._lock:
            return len(self._pending)

    def _open(self) -> int:
        """The descriptor of the file the path names now (reopened after a rotation)."""
        try:
            st = os.stat(self.path)
            current: tuple[int, int] | None = (st.st_dev, st.st_ino)
        except FileNotFoundError:
            current = None
        if self._fd is not None and current == self._ino:
            return self._fd
        if self._fd is not None:
            log.info("engine usage file %s was rotated: writing to the new file", self.path)
            self._close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_RDWR only to read the last byte back (below); every write appends.
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        st = os.fstat(fd)
        self._fd, self._ino = fd, (st.st_dev, st.st_ino)
        # A file another writer (or an earlier crash) left inside a line: close that
        # line first, so the fragment is not read together with our first record.
        self._torn = st.st_size > 0 and os.pread(fd, 1, st.st_size - 1) != b"\n"
        return fd

    def _flush(self) -> None:
        fd = self._open()
        lead = b"\n" if self._torn else b""
        data = memoryview(lead + b"".join(self._pending))
        done = 0
        try:
            while done < len(data):
                done += os.write(fd, data[done:])
        finally:
            self._account(done, len(lead))

    def _account(self, done: int, lead: int) -> None:
        """After ``done`` bytes of a write that began with ``lead`` newline bytes: drop
        the records written whole, and remember whether the file ends inside one."""
        if done == 0:
            return
        body = done - lead
        n = 0
        while n < len(self._pending) and body >= len(self._pending[n]):
            body -= len(self._pending[n])
            n += 1
        self._torn = body > 0
        del self._pending[:n]
        self.written += n

    def _close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = self._ino = None

    def close(self) -> None:
        """Close the file (records still pending stay pending)."""
        with self._lock:
            self._close()
