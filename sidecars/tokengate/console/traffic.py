"""The usage events of the last hours per UTC minute: requests (answered, refused by
reason), prompt / cached / completion tokens and the latency of answered requests, for
the Live page's refusals and charts, kept up to date as the usage files grow.

``Traffic.update`` reads the usage file and its rotated siblings
(``tokengate.ledger.tail.listing``), each known by its inode: a file seen for the first
time is read backwards from its end until its events are older than the window (at most
``FIRST_SCAN_BYTES``; a file last written before the window is not read at all), a file
seen before only from where the last update stopped (rotation renames a file, so the
lines a worker still appends to a renamed file count, and nothing is counted twice). A
file that shrank was truncated in place: it is read again from its start. A renamed
file keeps its place, a compressed or deleted one is forgotten (its counts stay).

Latencies are kept per minute as histograms with bins growing by ``RATIO`` (2^(1/4),
19 %): a percentile is the geometric middle of its bin, within 10 % of the value.
``total_ms`` is the edge's request time and ``ttft_ms`` its time to the first byte of
the answer (streams only), both on its monotonic clock (``tokengate.ledger.event``).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tokengate.console.requests import MAX_LINE, READ_CHUNK, event, lines_before
from tokengate.ledger import tail

KEEP_S = 24 * 3600            # the window kept, s
FIRST_SCAN_BYTES = 256 << 20  # read at most this much of a file seen for the first time
SLACK_S = 120                 # events of one file are in time order within this, s
RATIO = 2 ** 0.25             # latency histogram: each bin this much wider than the last
BINS = 80                     # bin 79 starts at 2^19.5 ms (about 12 minutes)


def latency_bin(ms: float) -> int:
    """The histogram bin of a latency: 0 below 1 ms, then ``1 + floor(log_RATIO(ms))``,
    the last bin open above."""
    if ms < 1.0:
        return 0
    return min(BINS - 1, 1 + int(math.log(ms, RATIO)))


def bin_value(b: int) -> float:
    """The latency a bin stands for, ms: the geometric middle of its bounds."""
    return 0.5 if b == 0 else RATIO ** (b - 0.5)


def percentile(hist: Counter[int], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a latency histogram, ms; None when it is empty."""
    total = sum(hist.values())
    if total == 0:
        return None
    rank, seen = q * total, 0
    for b in sorted(hist):
        seen += hist[b]
        if seen >= rank:
            return bin_value(b)
    return bin_value(max(hist))


@dataclass
class Minute:
    """One UTC minute's events (or several minutes', summed: ``Traffic.buckets``)."""

    requests: int = 0
    refused: int = 0                   # status >= 400
    prompt_tokens: int = 0             # includes cached_tokens
    cached_tokens: int = 0
    completion_tokens: int = 0
    total_ms: Counter[int] = field(default_factory=Counter)  # answered requests
    ttft_ms: Counter[int] = field(default_factory=Counter)   # answered streams
    reasons: Counter[tuple[str, int]] = field(default_factory=Counter)  # refused

    def add(self, ev: dict[str, Any]) -> None:
        """Count one usage event."""
        # `type(v) is int`, not isinstance: a bool is no count (and it runs per event)
        status = ev["status"]
        self.requests += 1
        v: Any = ev.get("prompt_tokens")
        if type(v) is int:
            self.prompt_tokens += v
        v = ev.get("cached_tokens")
        if type(v) is int:
            self.cached_tokens += v
        v = ev.get("completion_tokens")
        if type(v) is int:
            self.completion_tokens += v
        if status >= 400:
            self.refused += 1
            reason = ev.get("error")
            self.reasons[(reason if type(reason) is str and reason
                          else f"status_{status}", status)] += 1
            return
        ms: Any = ev.get("total_ms")
        if type(ms) in (int, float) and ms >= 0:
            self.total_ms[latency_bin(ms)] += 1
        ms = ev.get("ttft_ms")
        if type(ms) in (int, float) and ms >= 0:
            self.ttft_ms[latency_bin(ms)] += 1

    def merge(self, other: Minute) -> None:
        self.requests += other.requests
        self.refused += other.refused
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.completion_tokens += other.completion_tokens
        self.total_ms.update(other.total_ms)
        self.ttft_ms.update(other.ttft_ms)
        self.reasons.update(other.reasons)


@dataclass
class Bucket:
    """``step_s`` seconds of traffic from ``start`` (UTC): the minutes' sums and the
    latency percentiles of its answered requests (ms; None: none answered)."""

    start: datetime
    counts: Minute
    p50_ms: float | None
    p95_ms: float | None
    ttft_p50_ms: float | None


def _epoch(ts: Any) -> float | None:
    try:
        return datetime.fromisoformat(ts).timestamp() if isinstance(ts, str) else None
    except ValueError:
        return None


class Traffic:
    """The per-minute counts of the usage events of ``usage_file`` and its rotated
    siblings over the last ``keep_s``; safe to share between threads. ``clock``: the
    wall clock (the events' ``ts`` are wall-clock times), s since the epoch."""

    def __init__(self, usage_file: Path, keep_s: float = KEEP_S,
                 clock: Callable[[], float] = time.time,
                 first_scan_bytes: int = FIRST_SCAN_BYTES) -> None:
        self.usage_file = usage_file
        self.keep_s = keep_s
        self.clock = clock
        self.first_scan_bytes = first_scan_bytes
        self._read: dict[tuple[int, int], int] = {}   # (dev, ino) -> bytes read
        self._minutes: dict[int, Minute] = {}          # epoch minute -> counts
        # where a first read stopped at FIRST_SCAN_BYTES: counts before are partial
        self.partial_before: float | None = None
        self._lock = threading.Lock()

    def _count(self, ev: dict[str, Any] | None, horizon: float) -> float | None:
        """Counts ``ev`` when it is an event within the window; returns its time."""
        if ev is None:
            return None
        at = _epoch(ev["ts"])
        if at is not None and at >= horizon:
            minute = self._minutes.get(int(at // 60))
            if minute is None:
                minute = self._minutes[int(at // 60)] = Minute()
            minute.add(ev)
        return at

    def _first_read(self, fd: int, size: int, horizon: float) -> int:
        """Count what a newly seen file holds within the window, from its end backwards;
        returns the offset just after its last complete line (where the next update goes
        on)."""
        end, scanned = None, 0
        for offset, line in lines_before(fd, size):
            if end is None:
                end = offset + len(line) + 1
            scanned += len(line) + 1
            at = self._count(event(line), horizon)
            if at is not None and at < horizon - SLACK_S:
                break
            if scanned >= self.first_scan_bytes:
                if at is not None:
                    self.partial_before = max(self.partial_before or 0.0, at)
                break
        return end or 0

    def _read_on(self, fd: int, start: int, size: int, horizon: float) -> int:
        """Count the complete lines of [start, size); returns where the next read
        starts."""
        pos = start
        while pos < size:
            data = os.pread(fd, min(size - pos, max(READ_CHUNK, MAX_LINE)), pos)
            cut = data.rfind(b"\n")
            if cut < 0 and len(data) < MAX_LINE:
                break   # a line still being written
            if cut < 0:   # a line longer than any event: skipped to its end
                nxt = self._next_newline(fd, pos + len(data), size)
                if nxt is None:
                    break
                pos = nxt + 1
                continue
            for line in data[:cut].split(b"\n"):
                self._count(event(line), horizon)
            pos += cut + 1
        return pos

    @staticmethod
    def _next_newline(fd: int, pos: int, size: int) -> int | None:
        while pos < size:
            data = os.pread(fd, min(size - pos, READ_CHUNK), pos)
            i = data.find(b"\n")
            if i >= 0:
                return pos + i
            pos += len(data)
        return None

    def update(self) -> None:
        """Read what the usage files gained since the last update (see the module
        docstring) and forget the minutes that left the window."""
        with self._lock:
            horizon = self.clock() - self.keep_s
            listed = tail.listing(self.usage_file)
            for name, ino in listed.items():
                try:
                    fd = os.open(self.usage_file.parent / name, os.O_RDONLY)
                except OSError:
                    continue
                try:
                    st = os.fstat(fd)
                    if (st.st_dev, st.st_ino) != ino:
                        continue   # renamed meanwhile: the next update sees it
                    done = self._read.get(ino)
                    if done is None:
                        self._read[ino] = st.st_size if st.st_mtime < horizon \
                            else self._first_read(fd, st.st_size, horizon)
                    else:
                        self._read[ino] = self._read_on(
                            fd, done if st.st_size >= done else 0, st.st_size, horizon)
                finally:
                    os.close(fd)
            for ino in set(self._read) - set(listed.values()):
                del self._read[ino]
            oldest = int(horizon // 60)
            for minute in [m for m in self._minutes if m < oldest]:
                del self._minutes[minute]

    def buckets(self, span_s: int, step_s: int) -> list[Bucket]:
        """The last ``span_s`` in buckets of ``step_s`` (a multiple of 60), oldest first,
        the last one holding the current minute."""
        with self._lock:
            now_min = int(self.clock() // 60)
            step_min = max(1, step_s // 60)
            last = now_min - now_min % step_min
            first = last - (span_s // 60 // step_min - 1) * step_min
            out = []
            for start in range(first, last + 1, step_min):
                c = Minute()
                for m in range(start, start + step_min):
                    if m in self._minutes:
                        c.merge(self._minutes[m])
                out.append(Bucket(datetime.fromtimestamp(start * 60, UTC), c,
                                  percentile(c.total_ms, 0.5), percentile(c.total_ms, 0.95),
                                  percentile(c.ttft_ms, 0.5)))
            return out

    def refusals(self, span_s: int) -> list[tuple[str, int, int]]:
        """(reason, status, requests) of the refusals of the last ``span_s`` (whole
        minutes, the current one included), most first."""
        with self._lock:
            since = int(self.clock() // 60) - span_s // 60 + 1
            counts: Counter[tuple[str, int]] = Counter()
            for m, c in self._minutes.items():
                if m >= since:
                    counts.update(c.reasons)
        return [(r, s, n) for (r, s), n in
                sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
