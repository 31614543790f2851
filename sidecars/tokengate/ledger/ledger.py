"""The usage ledger: applies the edge's usage events to Redis, each exactly once.

``tokengate-ledger`` tails the usage file (``tokengate.ledger.tail``), parses each line
(``tokengate.ledger.event``), bills it (``tokengate.ledger.calculator``) and applies a
batch of events with one Redis script (``APPLY_LUA``) that, atomically,

1. compares the ledger's checkpoint in Redis with the position the batch starts
   from (compare-and-set): a mismatch means Redis and the ledger disagree (Redis
   restarted from an older snapshot or without data, another process with the same
   ledger id ran, a reply was lost), and the ledger re-reads the checkpoint and
   re-positions itself before anything is applied;
2. for each event, adds its request id to the day's ``seen`` set (``SADD``); only
   when it is new, adds its tokens, counts and cost to the key / model / day
   counters and appends it to the audit stream (``XADD MAXLEN ~``);
3. stores the position after the batch as the new checkpoint.

When the tail has finished a rotated file, the same script (with no events) adds the
file's id to the ledger's ``done`` set and sets the checkpoint to ``-<file_id>``
(between files); a restart reads every usage file that is not done, the checkpointed
one from its offset, so the order of rotated files never matters. Every checkpoint
value is unique, and a missing one (a new ledger, or a Redis that lost its data)
differs from all of them, so the compare-and-set catches a Redis that came back empty
or older at any point.

Exactly once, by construction: the counters and the checkpoint change in the same
script, so a ``kill -9`` of the ledger at any point leaves Redis either before or
after the whole batch, and a restart resumes from the checkpoint Redis holds. The
``seen`` sets make a replay harmless where the checkpoint cannot help (a rescan after
the checkpointed file was deleted, a duplicated line, two ledgers on one file); they
expire ``dedupe_days`` after their day's last event. A Redis that comes back without
its data (no persistence) has no checkpoint: the ledger reads every usage file still
on disk from the start, rebuilding the counters from the durable record.

Redis down: the ledger logs, waits (0.1 s doubling to 5 s) and retries; the events
wait in the usage file, the edge never waits for the ledger.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from tokengate.config import Config
from tokengate.ledger import store
from tokengate.ledger.calculator import Calculator
from tokengate.ledger.event import EventError, UsageEvent, parse_event, parse_ts
from tokengate.ledger.tail import Batch, Finished, Position, UsageTail
from tokengate.redis_client import SyncRedis

log = logging.getLogger("tokengate.ledger")

# KEYS[1] checkpoint hash, KEYS[2] stats hash, KEYS[3] audit stream, KEYS[4] days zset,
# KEYS[5] done zset (finished files), KEYS[6..] the batch's seen / usage / idx keys,
# referenced by index from ARGV[5].
# ARGV: expected pos ("" = no checkpoint yet), new pos ("-<file_id>" = after that file), seen ttl
# (s), audit maxlen, batch (JSON), bad lines in the batch, file path (for humans),
# wall-clock time (for humans), id of a file finished by this call ("" = none).
APPLY_LUA = """
local pos = redis.call('HGET', KEYS[1], 'pos') or ''
if pos ~= ARGV[1] then
  return {'conflict', pos}
end
local ttl = tonumber(ARGV[3])
local batch = cjson.decode(ARGV[5])
local applied, dup = 0, 0
for i = 1, #batch do
  local e = batch[i]
  local seen = KEYS[e.s]
  if redis.call('SADD', seen, e.r) == 1 then
    redis.call('EXPIRE', seen, ttl)
    local u = KEYS[e.u]
    local n = e.n
    for j = 1, #n, 2 do
      redis.call('HINCRBY', u, n[j], n[j + 1])
    end
    if e.c ~= '0' then
      redis.call('HINCRBYFLOAT', u, 'cost', e.c)
    end
    redis.call('SADD', KEYS[e.x], e.m)
    redis.call('ZADD', KEYS[4], e.ds, e.d)
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', unpack(e.a))
    applied = applied + 1
  else
    dup = dup + 1
  end
end
if ARGV[9] ~= '' then
  redis.call('ZADD', KEYS[5], redis.call('TIME')[1], ARGV[9])
  redis.call('HINCRBY', KEYS[2], 'files_done', 1)
end
redis.call('HSET', KEYS[1], 'pos', ARGV[2], 'path', ARGV[7], 'ts', ARGV[8])
redis.call('HINCRBY', KEYS[2], 'applied', applied)
redis.call('HINCRBY', KEYS[2], 'duplicates', dup)
redis.call('HINCRBY', KEYS[2], 'bad_lines', tonumber(ARGV[6]))
redis.call('HINCRBY', KEYS[2], 'batches', 1)
return {'ok', applied, dup}
"""

MEASURE_EVERY_S = 0.25  # lag refresh while the ledger is busy or Redis is down


def _age_s(line: bytes | None) -> float | None:
    """Seconds since the edge wrote the event ``line`` (its ``ts``, the request's start,
    plus ``total_ms``), at least 0; None for a line that is not an event (it will be
    counted as a bad line)."""
    try:
        obj = json.loads(line or b"")
        written = parse_ts(obj["ts"]).timestamp() + float(obj["total_ms"]) / 1000
    except (ValueError, KeyError, TypeError, EventError):
        return None
    return max(0.0, round(time.time() - written, 3))


@dataclass
class Totals:
    """What this ledger process did so far (events, lines)."""

    applied: int = 0      # events applied to the counters
    duplicates: int = 0   # events skipped: their request id was applied before
    bad_lines: int = 0    # lines that are not valid events (logged, skipped)
    conflicts: int = 0    # checkpoint mismatches (re-positioned from Redis)
    batches: int = 0


def default_ledger_id(usage_file: Path) -> str:
    """``<hostname>:<absolute usage file path>``: one checkpoint per usage file."""
    return f"{socket.gethostname()}:{Path(usage_file).resolve()}"


class Ledger:
    """Applies the usage file to Redis (see the module docstring).

    ``client``: a blocking Redis or RedisCluster client (``tokengate.redis_client.connect``);
    ``usage_file`` and ``ledger_id`` default to the configuration's file and
    ``default_ledger_id``; ``max_lines``: events per script call.
    """

    def __init__(self, cfg: Config, client: SyncRedis, usage_file: Path | None = None,
                 ledger_id: str | None = None, max_lines: int = 500,
                 rotate_wait_s: float | None = None) -> None:
        self.cfg = cfg
        self.client = client
        self.usage_file = Path(usage_file or cfg.ledger.usage_file)
        self.ledger_id = ledger_id or default_ledger_id(self.usage_file)
        wait = cfg.ledger.rotate_wait_s if rotate_wait_s is None else rotate_wait_s
        self.tail = UsageTail(self.usage_file, wait, max_lines)
        self.calc = Calculator(cfg)
        self.totals = Totals()
        self._script = client.register_script(APPLY_LUA)
        self._ckpt_key = store.ckpt_key(self.ledger_id)
        self._stats_key = store.stats_key(self.ledger_id)
        self._done_key = store.done_key(self.ledger_id)
        self._expected: str | None = None   # checkpoint Redis should hold; None: ask it
        self._committed: str | None = None  # last checkpoint this process wrote
        # Read by other threads (status); written by the thread that runs the ledger.
        # lag_bytes / lag_s: bytes of the usage files not applied yet, and the age of the
        # oldest of those events (s since the edge wrote it, 0.0 when none waits); None
        # until a checkpoint was read (Redis down since the start: nobody knows).
        self.redis_up = False
        self.lag_bytes: int | None = None
        self.lag_s: float | None = None
        self.position: str | None = None
        self._positioned = False

    # -- positioning ---------------------------------------------------------------

    def resync(self) -> None:
        """Read the checkpoint from Redis and position the tail there (unless the tail
        already is). Raises ``RedisError``."""
        pos = self.client.hget(self._ckpt_key, "pos") or ""
        assert isinstance(pos, str)
        if self._committed is None or pos != self._committed:
            done = {str(f) for f in self.client.zrange(self._done_key, 0, -1)}
            log.info("ledger %s: starting from checkpoint %s (%d files done)", self.ledger_id,
                     pos or "(none)", len(done))
            self.tail.seek(Position.decode(pos), done)
        self._expected = self._committed = pos
        self._positioned = True

    # -- applying ------------------------------------------------------------------

    def _parse(self, batch: Batch) -> tuple[list[UsageEvent], int]:
        events: list[UsageEvent] = []
        bad = 0
        offset = batch.start
        for line in batch.lines:
            try:
                if not line.strip():
                    raise EventError("empty line")
                events.append(parse_event(line))
            except EventError as e:
                bad += 1
                log.warning("%s:%d: bad usage line skipped (%s): %.200r", batch.path, offset,
                            e, line)
            offset += len(line) + 1
        return events, bad

    def _build(self, path: Path, events: list[UsageEvent], bad: int, new_pos: str,
               finished_id: str = "") -> tuple[list[str], list[Any]]:
        keys = [self._ckpt_key, self._stats_key, store.AUDIT_KEY, store.DAYS_KEY,
                self._done_key]
        index: dict[str, int] = {}

        def k(name: str) -> int:
            if name not in index:
                keys.append(name)
                index[name] = len(keys)  # Lua indexes from 1
            return index[name]

        items = []
        for ev in events:
            day = ev.day
            ch = self.calc.charge_event(ev)
            counts = {"requests": 1, f"status:{ev.status}": 1,
                      "errors": int(ev.status >= 400), "aborted": int(ev.client_aborted),
                      "estimated": int(ev.usage_source == "estimate"),
                      "prompt_tokens": ev.prompt_tokens,
                      "completion_tokens": ev.completion_tokens,
                      "cached_tokens": ev.cached_tokens, "system_tokens": ev.system_tokens}
            n: list[str] = []
            for f, v in counts.items():
                if v:
                    n += [f, str(v)]
            cost = repr(ch.cost) if ch.cost else "0"
            audit = ["rid", ev.request_id, "ts", ev.ts, "key", ev.key_id or "",
                     "model", ev.model or "", "endpoint", ev.endpoint, "status", str(ev.status),
                     "prompt", str(ev.prompt_tokens), "completion", str(ev.completion_tokens),
                     "cached", str(ev.cached_tokens), "system", str(ev.system_tokens),
                     "cost", cost, "usage", ev.usage_source,
                     "aborted", str(int(ev.client_aborted)), "ledger", self.ledger_id]
            items.append({"s": k(store.seen_key(day)),
                          "u": k(store.usage_key(day, ev.key_id, ev.model)),
                          "x": k(store.idx_key(day)), "r": ev.request_id,
                          "m": json.dumps([ev.key_id, ev.model]), "d": day,
                          "ds": store.day_score(day), "n": n, "c": cost, "a": audit})
        now = datetime.now(UTC).isoformat(timespec="milliseconds")
        argv: list[Any] = [self._expected or "", new_pos, self.cfg.ledger.dedupe_days * 86400,
                           self.cfg.ledger.audit_maxlen,
                           json.dumps(items, separators=(",", ":"), ensure_ascii=False),
                           bad, str(path), now, finished_id]
        return keys, argv

    def step(self) -> bool:
        """Apply the next batch, if any. True when something happened (a batch applied,
        a finished file recorded, a conflict re-positioned the tail), False when
        nothing new is there.

        Raises ``RedisError`` when Redis fails; the batch is then not consumed and the
        next call re-reads the checkpoint first.
        """
        if self._expected is None:
            self.resync()
        item = self.tail.read()
        if item is None:
            return False
        if isinstance(item, Finished):
            if item.file_id is None:  # never had a line: nothing to remember
                self.tail.advance()
                return True
            after = "-" + item.file_id   # between files: after this one
            keys, argv = self._build(item.path, [], 0, after, item.file_id)
            if self._run(keys, argv):
                self.tail.advance()
                self._expected = self._committed = after
            return True
        events, bad = self._parse(item)
        new_pos = item.position.encode()
        keys, argv = self._build(item.path, events, bad, new_pos)
        res = self._run(keys, argv)
        if res:
            self.tail.commit(item)
            self._expected = self._committed = new_pos
            self.totals.applied += int(res[1])
            self.totals.duplicates += int(res[2])
            self.totals.bad_lines += bad
            self.totals.batches += 1
        return True

    def _run(self, keys: list[str], argv: list[Any]) -> list[Any] | None:
        """Run the script; None after a conflict (the tail will be re-positioned)."""
        try:
            res = self._script(keys=keys, args=argv)
        except RedisError:
            self._expected = None  # the script may have run: ask Redis before going on
            raise
        if res[0] == "conflict":
            self.totals.conflicts += 1
            log.warning("ledger %s: checkpoint in Redis is %r, expected %r (Redis restarted "
                        "or lost data, or another ledger uses this id): re-positioning",
                        self.ledger_id, res[1], self._expected)
            self._expected = None
            self._committed = None
            return None
        return list(res)

    def measure(self) -> None:
        """Refresh ``lag_bytes``, ``lag_s`` and ``position`` from the tail (from the thread
        that runs the ledger: the tail is not thread-safe). Before the first checkpoint
        is read they stay None."""
        if not self._positioned:
            return
        lag = self.tail.lag_bytes()
        self.lag_s = _age_s(self.tail.pending_line()) if lag else 0.0
        self.lag_bytes = lag
        self.position = self._committed

    def _wait_measuring(self, stop: threading.Event, seconds: float) -> None:
        """Wait ``seconds`` (or until ``stop``), refreshing the lag meanwhile."""
        end = time.monotonic() + seconds
        while not stop.wait(max(0.0, min(MEASURE_EVERY_S, end - time.monotonic()))):
            self.measure()
            if time.monotonic() >= end:
                return

    def drain(self) -> Totals:
        """Apply everything there is now, then return; raises ``RedisError``."""
        while self.step():
            pass
        return self.totals

    def run(self, stop: threading.Event, poll_s: float = 0.05) -> None:
        """Apply events as they come until ``stop`` is set, waiting out Redis outages."""
        backoff = 0.1
        down = False
        measured = 0.0
        while not stop.is_set():
            now = time.monotonic()
            if now - measured >= MEASURE_EVERY_S:
                # also while Redis is down or a backlog keeps every step busy: that is
                # when the lag grows
                self.measure()
                measured = now
            try:
                busy = self.step()
                self.redis_up = True
            except RedisError as e:
                self.redis_up = False
                if not down:
                    down = True
                    log.warning("ledger %s: Redis unavailable (%s); events stay in the usage "
                                "file, retrying", self.ledger_id, e)
                self._wait_measuring(stop, backoff)
                measured = time.monotonic()
                backoff = min(backoff * 2, 5.0)
                continue
            if down:
                log.info("ledger %s: Redis is back, resuming", self.ledger_id)
                down = False
            backoff = 0.1
            if not busy:
                self.measure()
                measured = time.monotonic()
                stop.wait(poll_s)

    def close(self) -> None:
        """Close the usage files (Redis client is the caller's)."""
        self.tail.close()
