"""The usage ledger: applies the edge's usage events to Redis, each exactly once, and
bills them with the engine's usage records where it tails those too.

(Long for one thing: the ``Ledger`` loop, whose steps (apply, sweep, rebuild) share its
sources and Redis state, and this docstring, the exactly-once contract they keep.)

``tokengate-ledger`` tails the usage file (``tokengate.ledger.tail``), parses each line
(``tokengate.ledger.event``), bills it (``tokengate.ledger.calculator``) and applies a
batch of events with one Redis script (``ledger_apply.lua``, ``tokengate.redis_scripts``)
that, atomically,

1. compares the ledger's checkpoint in Redis with the position the batch starts
   from (compare-and-set): a mismatch means Redis and the ledger disagree (Redis
   restarted from an older snapshot or without data, another process with the same
   ledger id ran, a reply was lost), and the ledger re-reads the checkpoint and
   re-positions itself before anything is applied;
2. for each event, adds its request id to the day's ``seen`` set (``SADD``); only
   when it is new, adds its tokens, counts and cost to the key / model / day
   counters, and to its agent session's totals when it names one (``session_id``:
   ``tokengate.redis_keys``, bounded by ``ledger.session_days`` and
   ``ledger.sessions_per_key``), and appends it to the audit stream (``XADD MAXLEN ~``);
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

A Redis without its data is noticed at once, not at the next event: every ledger keeps
a ready mark there (``redis_keys.ready_key``) and looks for it at every step. When it is
missing (Redis came back empty, or the ledger runs here for the first time) the ledger
rebuilds: it holds the budgets of every key that has some (``redis_keys.rebuild_key``,
a lease of ``HOLD_S`` renewed every ``HOLD_RENEW_S``: ``budget_reserve.lua`` admits
nothing while one runs), reads every usage and engine file again from the checkpoints
Redis holds (none after a loss: from their start), and once each was read to its end
after the rebuild began, no event of its own waits for engine records and no orphan
record is due, sets the mark and releases the hold. Events and records are joined as
they were the first time, so the rebuilt bill is the one before. It also marks every
budgeted key once its bill is whole (``redis_keys.ready_mark_key``): a limits sidecar
that saw a key's mark refuses its budgets while the mark is gone, from the moment Redis
comes back empty, before any ledger has noticed. Ledgers sharing one
Redis each hold until they are done (``redis_keys.REBUILDING_KEY`` lists who
rebuilds); records that name their key are not billed as orphans while another ledger
rebuilds (their events may not have been read again yet).

Engine records (``ledger.engine_usage_files``, the vLLM plugin's files): every engine
file is one more tailed file with its own checkpoint, and the join with the edge's
events lives in Redis (keys: ``tokengate.redis_keys``), so a ledger on a vLLM host
(``--engine-only``) and one on the edge host can share one Redis, in any order:

- an edge event whose records are all there is billed with them at once
  (``tokengate.ledger.reconcile``); otherwise it waits in ``pending`` (and its owner's
  ``wait`` zset) for ``engine_wait_s``;
- an engine record is kept in ``eng:<request id>`` until its event arrives; when the
  event waits and the records are now complete, the record's batch bills it;
- a waiting event whose time is up is billed by its owner's sweep with the records that
  arrived, or with its own numbers when none did (``engine_missing``); the sweep runs
  only once this ledger's own engine files have been read up to that time;
- records whose event never came ``engine_orphan_s`` after they were written are
  billed to the key they name (orphans: a ledger that reads a usage file does it,
  settling the request's open budget reservation first) or, naming none, dropped and
  counted as unmatched; records that are not an edge request's (no edge id in vLLM's
  id) are counted as unmatched at once;
- records of a request billed without all of its records (the edge's numbers after
  the wait, or some records) correct its bill (``tokengate.ledger.join``: a correction
  entry in the audit stream); records of a request whose bill is closed are counted as
  late.

Budget fixes: a bill with numbers other than the event's (the engine's, a correction)
queues, in its script, the change of the key's settled budget counters; every sweep
makes the queued fixes (``tokengate.ledger.budgets``), once each.

Several processes change that shared state, so every decision is taken in Python from
what it read and then applied by the same script, which first checks that each of
those reads still holds (a request's number of kept records, whether its event waits,
whether it was billed, whether a record was read before) and otherwise changes nothing
and answers ``retry``: the batch is read again and decided again. The checkpoint, the
records, the join and the bill of a batch still change in one script.

Budgets: before a batch of edge events is applied, the budget reservations of its
requests that are still open in Redis (the edge's settlement failed: the limits sidecar
or Redis was down when the request ended) are settled from the events, exactly once
(``tokengate.ledger.budgets``).

Redis down: the ledger logs, waits (0.1 s doubling to 5 s) and retries; the events
wait in the usage file, the edge never waits for the ledger.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from redis.exceptions import RedisError

from tokengate import redis_keys, redis_scripts
from tokengate.config import Config
from tokengate.ledger.budgets import BudgetFixes, Reservations
from tokengate.ledger.engine_record import parse_record
from tokengate.ledger.event import EventError, UsageEvent, parse_event, parse_ts
from tokengate.ledger.join import Item, Join, Keys
from tokengate.ledger.tail import Batch, Finished, Position, UsageTail
from tokengate.redis_client import SyncRedis

log = logging.getLogger("tokengate.ledger")

# KEYS[1] checkpoint hash, KEYS[2] stats hash (of the file read), KEYS[3] audit stream,
# KEYS[4] days zset, KEYS[5] done zset (finished files), KEYS[6] pending hash, KEYS[7]
# eng_wait zset, KEYS[8..] the batch's other keys, referenced by index from ARGV[5].
# ARGV: expected pos ("" = no checkpoint yet), new pos ("-<file_id>" = after that file),
# ttl of the seen sets and kept records (s), audit maxlen, items (JSON), bad lines, file
# path (for humans), wall-clock time (for humans), id of a file finished by this call
# ("" = none), engine wait (ms), "1" = compare and store the checkpoint ("0": a sweep,
# which reads no file), extra counts for KEYS[2] (JSON [field, n, ...]).
#
# Items (``t``): "b" bill a request, "c" correct a bill (the same counters, by the
# difference), "p" park an edge event until its engine records arrive, "s" keep engine
# records (``sc``: eng_wait's score, when the first was written), "l" remember records
# that bill nothing (late, unmatched), "o" drop the records of an edge request that
# never came. Checked before anything is written (``retry`` otherwise): ``e``/``h`` the
# request's kept records or its open bill (KEYS[e], HLEN h), ``pp`` whether its event
# waits (0/1), ``ns`` seen sets that must not hold the request, ``rec`` [eseen key,
# record key, line, ...] records that must be new. ``ed``: an edge event, a duplicate
# when its request id was billed or waits. A bill or correction may carry ``ob`` (the
# open bill to write: ``obv`` the bill, ``obr`` [record key, line, ...]; ``od``: delete
# it), ``bq``/``bf`` (a budget fix to queue: [fix id, JSON]) and, for an orphan, ``sx``
# (more seen sets to remember its id in).
APPLY_LUA = redis_scripts.read("ledger_apply")

# Redis's clock, read on the node that holds the ledger's keys (Redis Cluster: the
# node whose TIME the script used for the waits).
TIME_LUA = redis_scripts.read("ledger_time")

MEASURE_EVERY_S = 0.25  # lag refresh while the ledger is busy or Redis is down
SWEEP_EVERY_S = 0.1     # how often waiting events and old records are looked at
HOLD_S = 30.0           # lease of a rebuild's hold on the budgets, renewed every
HOLD_RENEW_S = 1.0      # this many seconds while the rebuild lasts
MAX_BACKOFF_S = 1.0     # the longest wait between tries while Redis is down: a Redis
                        # back without its data is noticed within it

_P = TypeVar("_P")


def _age_s(line: bytes | None) -> float | None:
    """Seconds since the line was written (its ``ts`` plus ``total_ms`` for an edge
    event: the request's start plus its duration; ``ts`` alone for an engine record,
    written when the request finished), at least 0; None for a line that is neither (it
    will be counted as a bad line)."""
    try:
        obj = json.loads(line or b"")
        written = parse_ts(obj["ts"]).timestamp() + float(obj.get("total_ms", 0)) / 1000
    except (ValueError, KeyError, TypeError, AttributeError, EventError):
        return None
    return max(0.0, round(time.time() - written, 3))


@dataclass
class Totals:
    """What this ledger process did so far (events, records, lines)."""

    applied: int = 0      # events billed (edge and engine files together)
    duplicates: int = 0   # events skipped: their request id was billed (or waits) already
    bad_lines: int = 0    # lines of the usage file that are not valid events (skipped)
    conflicts: int = 0    # checkpoint mismatches (re-positioned from Redis)
    batches: int = 0
    # -- with engine files (ledger.engine_usage_files) ------------------------------
    settled_engine: int = 0     # events billed with their engine records
    engine_missing: int = 0     # events billed with their own numbers: no record came
    disagreements: int = 0      # final usage of the edge != the engine's numbers
    parked: int = 0             # events that waited for their records
    engine_records: int = 0     # engine records read (each once)
    engine_duplicates: int = 0  # engine records read before (replays)
    engine_bad_lines: int = 0   # lines of the engine files that are not records
    engine_unmatched: int = 0   # records of no edge request (or of one that never came)
    engine_probes: int = 0      # records of tokengate doctor's probes (not billed)
    engine_late: int = 0        # records of a request billed before they came
    retries: int = 0            # batches decided again: another ledger changed a request
    redis_errors: int = 0       # steps that failed on Redis (retried: nothing is lost)
    budgets_settled: int = 0    # budget reservations the edge could not settle, settled
                                # from their events (tokengate.ledger.budgets)
    corrections: int = 0        # bills corrected by engine records that came after them
    orphans: int = 0            # requests billed from engine records alone (no event)
    budget_fixes: int = 0       # budget counters moved to the bill (tokengate.ledger.budgets)
    rebuilds: int = 0           # rebuilds begun (this ledger's ready mark was missing)


def default_ledger_id(usage_file: Path) -> str:
    """``<hostname>:<absolute usage file path>``: one checkpoint per usage file."""
    return f"{socket.gethostname()}:{Path(usage_file).resolve()}"


def engine_ledger_id(ledger_id: str, engine_file: Path) -> str:
    """``<ledger id>|engine:<absolute engine file path>``: the checkpoint of one engine
    file read by that ledger."""
    return f"{ledger_id}|engine:{Path(engine_file).resolve()}"


class _Source:
    """One tailed file (the usage file or an engine file) and its checkpoint."""

    def __init__(self, kind: str, path: Path, ledger_id: str, rotate_wait_s: float,
                 max_lines: int) -> None:
        self.kind = kind  # "edge" | "engine"
        self.path = path
        self.ledger_id = ledger_id
        self.tail = UsageTail(path, rotate_wait_s, max_lines)
        self.ckpt_key = redis_keys.ckpt_key(ledger_id)
        self.stats_key = redis_keys.stats_key(ledger_id)
        self.done_key = redis_keys.done_key(ledger_id)
        self.expected: str | None = None   # checkpoint Redis should hold; None: ask it
        self.committed: str | None = None  # last checkpoint this process wrote
        # monotonic time of the last read after which nothing was left to read: every
        # line written before it has been applied (None: not yet)
        self.caught_up: float | None = None


class Ledger:
    """Applies the usage file, and the engine files when configured, to Redis (see the
    module docstring).

    ``client``: a blocking Redis or RedisCluster client (``tokengate.redis_client.connect``);
    ``usage_file`` and ``ledger_id`` default to the configuration's file and
    ``default_ledger_id``; ``max_lines``: events (or records) per script call;
    ``engine_files``, ``engine_wait_s`` and ``engine_orphan_s`` default to
    ``ledger.engine_usage_files`` / ``engine_wait_s`` / ``engine_orphan_s``;
    ``engine_only``: read no usage file (a ledger on a vLLM host); ``on_events``: called
    with the events of every usage batch once Redis committed it (``tokengate.ledger.tracing``:
    their spans), from the ledger's thread; it must not block. Raises ``ValueError`` for
    ``engine_only`` without engine files.
    """

    def __init__(self, cfg: Config, client: SyncRedis, usage_file: Path | None = None,
                 ledger_id: str | None = None, max_lines: int = 500,
                 rotate_wait_s: float | None = None,
                 engine_files: Sequence[Path] | None = None, engine_only: bool = False,
                 engine_wait_s: float | None = None,
                 engine_orphan_s: float | None = None,
                 on_events: Callable[[list[UsageEvent]], None] | None = None) -> None:
        self.cfg = cfg
        self.client = client
        self.on_events = on_events
        self.usage_file = Path(usage_file or cfg.ledger.usage_file)
        self.ledger_id = ledger_id or default_ledger_id(self.usage_file)
        wait = cfg.ledger.rotate_wait_s if rotate_wait_s is None else rotate_wait_s
        files = list(cfg.ledger.engine_usage_files if engine_files is None else engine_files)
        # engine files named by the configuration are followed as it changes (reconfigure)
        self._files_of_config = engine_files is None
        self._adopt: list[Path] = []  # new engine files, taken up by the ledger's thread
        if engine_only and not files:
            raise ValueError("engine_only without engine files: nothing to read")
        # Without engine files every event is billed with its own numbers, at once.
        self.engine_mode = bool(files)
        self.engine_wait_s = cfg.ledger.engine_wait_s if engine_wait_s is None \
            else engine_wait_s
        self.engine_orphan_s = cfg.ledger.engine_orphan_s if engine_orphan_s is None \
            else engine_orphan_s
        self.max_lines = max_lines
        self.edge = None if engine_only else _Source("edge", self.usage_file, self.ledger_id,
                                                     wait, max_lines)
        self.engines = [_Source("engine", Path(f), engine_ledger_id(self.ledger_id, Path(f)),
                                wait, max_lines) for f in files]
        self.sources = ([self.edge] if self.edge else []) + self.engines
        self.tail = (self.edge or self.engines[0]).tail
        self.join = Join(cfg, client, self.ledger_id, self.engine_mode, self.engine_wait_s,
                         self.engine_orphan_s)
        self.totals = Totals()
        self.reservations = Reservations(cfg, client)
        self.fixes = BudgetFixes(client)
        self._ready_key = redis_keys.ready_key(self.ledger_id)
        # monotonic time this ledger began rebuilding (its ready mark was missing: Redis
        # lost its data, or it never ran here); None: not rebuilding. Read by other
        # threads (status).
        self.rebuilding: float | None = None
        self._seen_ready = False   # the mark was there at least once since the start
        self._marked: frozenset[str] = frozenset()  # budgeted keys given their ready mark
        # rebuilding after a loss this process saw: a kept record's wait counts from when
        # it was written (the orphans billed before are billed again at once)
        self._after_loss = False
        self._renew_at = 0.0
        self._script = client.register_script(APPLY_LUA)
        self._time = client.register_script(TIME_LUA)
        self._wait_key = redis_keys.wait_key(self.ledger_id)
        self._next_sweep = 0.0
        # Read by other threads (status); written by the thread that runs the ledger.
        # lag_bytes / lag_s: bytes of the usage files not applied yet, and the age of the
        # oldest of those events (s since the edge wrote it, 0.0 when none waits); None
        # until a checkpoint was read (Redis down since the start: nobody knows). With
        # engine_only they are the engine files'. engine_lag_bytes: the engine files'
        # bytes not read yet; waiting: this ledger's events waiting for engine records.
        self.redis_up = False
        self.lag_bytes: int | None = None
        self.lag_s: float | None = None
        self.engine_lag_bytes: int | None = None
        self.waiting: int | None = None
        self.position: str | None = None
        self._positioned = False

    def reconfigure(self, cfg: Config) -> None:
        """Bill the events applied from now on with ``cfg`` (models' weights, billing,
        ledger.dedupe_days and audit_maxlen); callable from another thread (each is one
        reference swap). Engine files that ``ledger.engine_usage_files`` adds (when the
        ledger follows the configuration's, in engine mode) are followed from the next
        step on; the usage file, removed engine files and Redis stay as they were
        opened."""
        self.join.reconfigure(cfg)
        self.reservations.reconfigure(cfg)
        self.cfg = cfg
        if self._files_of_config:
            known = {src.path.resolve() for src in self.engines}
            new = [Path(f) for f in cfg.ledger.engine_usage_files
                   if Path(f).resolve() not in known]
            if new and self.engine_mode:
                # a replica added by configuration: its records settle its requests
                # from now on (the ledger's thread adds them: one list swap)
                self._adopt = new
            elif new:
                log.warning("ledger %s: engine files are configured now (%s), but this "
                            "ledger started without any: restart it to settle with them",
                            self.ledger_id, ", ".join(map(str, new)))

    # -- positioning ---------------------------------------------------------------

    def resync(self) -> None:
        """Read every file's checkpoint from Redis and position its tail there (unless
        it already is). Raises ``RedisError``."""
        for src in self.sources:
            self._resync(src)

    def _resync(self, src: _Source) -> None:
        pos = self.client.hget(src.ckpt_key, "pos") or ""
        assert isinstance(pos, str)
        if src.committed is None or pos != src.committed:
            done = {str(f) for f in self.client.zrange(src.done_key, 0, -1)}
            log.info("ledger %s: starting from checkpoint %s (%d files done)", src.ledger_id,
                     pos or "(none)", len(done))
            src.tail.seek(Position.decode(pos), done)
        src.expected = src.committed = pos
        self._positioned = all(s.expected is not None for s in self.sources)

    # -- the script ------------------------------------------------------------------

    def _fixed_keys(self, src: _Source) -> list[str]:
        return [src.ckpt_key, src.stats_key, redis_keys.AUDIT_KEY, redis_keys.DAYS_KEY, src.done_key,
                redis_keys.PENDING_KEY, redis_keys.ENG_WAIT_KEY]

    def _apply(self, src: _Source, keys: Keys, items: list[Item], *, path: Path | None,
               new_pos: str | None, bad: int = 0, finished_id: str = "",
               extra: Sequence[str | int] = ()) -> str | None:
        """Run the script: a file's batch (``new_pos``: its checkpoint after it) or a
        sweep (``new_pos`` None: no checkpoint). The reply's mask ('1' applied, '0' a
        duplicate, one per item), or None after a conflict or a retry (nothing was
        applied). Raises ``RedisError``."""
        now = datetime.now(UTC).isoformat(timespec="milliseconds")
        argv: list[Any] = [src.expected or "", new_pos or "",
                           self.cfg.ledger.dedupe_days * 86400, self.cfg.ledger.audit_maxlen,
                           json.dumps([i.lua for i in items], separators=(",", ":"),
                                      ensure_ascii=False),
                           bad, str(path or ""), now, finished_id,
                           round(self.engine_wait_s * 1000),
                           "1" if new_pos is not None else "0",
                           json.dumps(list(extra), separators=(",", ":"))]
        try:
            res = self._script(keys=keys.names, args=argv)
        except RedisError:
            src.expected = None  # the script may have run: ask Redis before going on
            raise
        if res[0] == "conflict":
            self.totals.conflicts += 1
            log.warning("ledger %s: checkpoint in Redis is %r, expected %r (Redis restarted "
                        "or lost data, or another ledger uses this id): re-positioning",
                        src.ledger_id, res[1], src.expected)
            src.expected = None
            src.committed = None
            src.caught_up = None
            return None
        if res[0] == "retry":
            # Another ledger changed a request this batch decided on: decide again.
            self.totals.retries += 1
            log.debug("ledger %s: item %s changed meanwhile (%s): deciding again",
                      src.ledger_id, res[1], res[2])
            return None
        mask = str(res[1])
        for item, applied in zip(items, mask, strict=True):
            if applied == "1":
                for name, n in item.totals.items():
                    setattr(self.totals, name, getattr(self.totals, name) + n)
                for level, msg in item.logs:
                    log.log(level, "%s", msg)
            elif item.edge:
                self.totals.duplicates += 1
        return mask

    # -- the usage file --------------------------------------------------------------

    def _parse(self, batch: Batch, parser: Callable[[bytes], _P],
               what: str) -> tuple[list[_P], int]:
        out: list[_P] = []
        bad = 0
        offset = batch.start
        for line in batch.lines:
            try:
                if not line.strip():
                    raise EventError("empty line")
                out.append(parser(line))
            except EventError as e:
                bad += 1
                log.warning("%s:%d: bad %s line skipped (%s): %.200r", batch.path, offset,
                            what, e, line)
            offset += len(line) + 1
        return out, bad

    # -- stepping --------------------------------------------------------------------

    def _step_source(self, src: _Source) -> bool:
        if src.expected is None:
            self._resync(src)
        started = time.monotonic()
        item = src.tail.read()
        if item is None:
            src.caught_up = started
            return False
        keys = Keys(self._fixed_keys(src))
        if isinstance(item, Finished):
            if item.file_id is None:  # never had a line: nothing to remember
                src.tail.advance()
                return True
            after = "-" + item.file_id   # between files: after this one
            if self._apply(src, keys, [], path=item.path, new_pos=after,
                           finished_id=item.file_id) is not None:
                src.tail.advance()
                src.expected = src.committed = after
            return True
        new_pos = item.position.encode()
        if src.kind == "edge":
            events, bad = self._parse(item, parse_event, "usage")
            # before the batch is applied: a ledger killed in between settles on the replay
            settled = self.reservations.settle(events)
            if settled:
                self.totals.budgets_settled += settled
                log.info("ledger %s: settled %d budget reservation(s) the edge could not",
                         src.ledger_id, settled)
            items = self.join.edge_items(keys, events)
            extra: list[str | int] = []
        else:
            records, bad = self._parse(item, parse_record, "engine record")
            items, dups = self.join.engine_items(keys, src.stats_key, src.path, records,
                                                 by_written=self._after_loss)
            extra = ["engine_duplicates", dups, "engine_bad_lines", bad] if dups or bad else []
        mask = self._apply(src, keys, items, path=item.path, new_pos=new_pos,
                           bad=bad if src.kind == "edge" else 0, extra=extra)
        if mask is not None:
            src.tail.commit(item)
            src.expected = src.committed = new_pos
            self.totals.batches += 1
            if src.kind == "edge":
                self.totals.bad_lines += bad
                if self.on_events is not None and events:
                    self.on_events(events)
            else:
                self.totals.engine_duplicates += dups
                self.totals.engine_bad_lines += bad
            if src.tail.lag_bytes() == 0:
                src.caught_up = started
        return True

    def step(self) -> bool:
        """Apply the next batch of each file, if any, and every ``SWEEP_EVERY_S`` the
        waits that are over. True when something happened (a batch applied, a finished
        file recorded, a conflict re-positioned a tail, a batch to decide again, a
        request billed by the sweep), False when nothing new is there.

        Raises ``RedisError`` when Redis fails; the batch is then not consumed and the
        next call re-reads the checkpoint first.
        """
        self._watch_ready()
        busy = False
        adopt, self._adopt = self._adopt, []
        for f in adopt:
            src = _Source("engine", f, engine_ledger_id(self.ledger_id, f),
                          self.engines[0].tail.rotate_wait_s, self.max_lines)
            self.engines.append(src)
            self.sources = self.sources + [src]
            log.info("ledger %s: following the engine records of %s", self.ledger_id, f)
        for src in self.sources:
            busy = self._step_source(src) or busy
        if self.engine_mode and time.monotonic() >= self._next_sweep:
            busy = self.sweep() or busy
        if self.rebuilding is not None:
            self._finish_rebuild()
        return busy

    # -- sweeps ------------------------------------------------------------------------

    def _redis_now(self) -> tuple[int, int]:
        """(s, ms) of the clock the script uses."""
        s, us = self._time(keys=[redis_keys.PENDING_KEY])
        return int(s), int(s) * 1000 + int(us) // 1000

    @staticmethod
    def _stale_s(sources: Sequence[_Source]) -> float | None:
        """How long ago the least recently caught-up of ``sources`` had nothing left to
        read, s; None when one never had."""
        now = time.monotonic()
        worst = 0.0
        for s in sources:
            if s.caught_up is None:
                return None
            worst = max(worst, now - s.caught_up)
        return worst

    def sweep(self) -> bool:
        """Bill this ledger's waiting events whose wait is over, bill (or drop) the
        records whose edge event never came, and make the budget fixes queued (module
        docstring). True when anything changed. Raises ``RedisError``."""
        if not self.engine_mode:
            return False
        self._next_sweep = time.monotonic() + SWEEP_EVERY_S
        now_s, now_ms = self._redis_now()
        done = self._sweep_waiting(now_ms) if self.edge is not None else False
        done = self._sweep_orphans(now_s, now_ms) or done
        fixed = self.fixes.drain(self.max_lines)
        self.totals.budget_fixes += fixed
        return done or fixed > 0

    def _sweep_waiting(self, now_ms: int) -> bool:
        src = self.edge
        assert src is not None
        stale = self._stale_s(self.engines)
        if stale is None:  # an engine file not read to its end yet: its records may be there
            return False
        cutoff = now_ms - round(stale * 1000)
        rids = [str(r) for r in self.client.zrangebyscore(self._wait_key, "-inf", cutoff,
                                                          start=0, num=self.max_lines)]
        if not rids:
            self.waiting = int(self.client.zcard(self._wait_key))
            return False
        keys = Keys(self._fixed_keys(src))
        items = self.join.waiting_items(keys, rids)
        if items:
            self._apply(src, keys, items, path=None, new_pos=None)
        self.waiting = int(self.client.zcard(self._wait_key))
        return True

    def _orphan_cutoff(self, now_s: int) -> float | None:
        """The latest time (epoch s) a kept record may have been written for its event to
        count as never coming; None while this ledger's usage file is not read to its
        end (its event may be there)."""
        edge_stale = self._stale_s([self.edge]) if self.edge is not None else 0.0
        if edge_stale is None or not self.engines:
            return None
        return now_s - self.engine_orphan_s - edge_stale

    def _others_rebuilding(self, now_ms: int) -> bool:
        """Whether another ledger sharing this Redis is rebuilding (its lease runs)."""
        ids = self.client.zrangebyscore(redis_keys.REBUILDING_KEY, f"({now_ms}", "+inf")
        return any(str(i) != self.ledger_id for i in ids)

    def _sweep_orphans(self, now_s: int, now_ms: int) -> bool:
        cutoff = self._orphan_cutoff(now_s)
        if cutoff is None:
            return False
        rids = [str(r) for r in self.client.zrangebyscore(redis_keys.ENG_WAIT_KEY, "-inf", cutoff,
                                                          start=0, num=self.max_lines)]
        if not rids:
            return False
        src = self.engines[0]
        keys = Keys(self._fixed_keys(src))
        # Records that name their key are billed by a ledger that reads a usage file,
        # and not while another ledger rebuilds: their events may still be read again.
        bill_named = self.edge is not None and not self._others_rebuilding(now_ms)
        items = self.join.orphan_items(keys, src.stats_key, rids, bill_named)
        if not items:
            return False
        charges = [i.charge for i in items if i.charge is not None]
        # before the bills: a ledger killed in between settles them on the next sweep
        settled = self.reservations.settle_charges(charges) if charges else 0
        if settled:
            self.totals.budgets_settled += settled
            log.info("ledger %s: settled %d budget reservation(s) of orphan engine "
                     "records", self.ledger_id, settled)
        self._apply(src, keys, items, path=None, new_pos=None)
        return True

    # -- after Redis lost its data ----------------------------------------------------

    def _watch_ready(self) -> None:
        """Begin a rebuild when this ledger's ready mark is missing (module docstring);
        renew the rebuild's hold. Raises ``RedisError``."""
        if self.rebuilding is None:
            if self.client.exists(self._ready_key):
                self._seen_ready = True
                if self.join.budgeted - self._marked:  # keys given budgets since
                    self._mark(self.join.budgeted)
            else:
                self._begin_rebuild()
        elif time.monotonic() >= self._renew_at:
            now_ms = self._redis_now()[1]
            if self._hold(now_ms) is None:
                # the hold vanished: Redis lost its data again while this rebuild ran
                log.warning("ledger %s: Redis lost its data again during the rebuild; "
                            "starting it over", self.ledger_id)
                self._begin_rebuild()

    def _begin_rebuild(self) -> None:
        """Hold the budgets and read every file again from the checkpoints Redis holds
        (none after a loss: every usage and engine file still on disk, from its start)."""
        if self._seen_ready:
            log.warning("ledger %s: Redis lost its data (the ledger's ready mark is gone): "
                        "rebuilding from the usage and engine files on disk; budgets of "
                        "%d key(s) admit nothing until it is done", self.ledger_id,
                        len(self.join.budgeted))
        else:
            log.info("ledger %s: no ready mark in Redis (a first start, or Redis lost its "
                     "data): reading the files up to date before budgets admit",
                     self.ledger_id)
        self._after_loss = self._seen_ready
        self._seen_ready = False
        self._marked = frozenset()
        self.rebuilding = time.monotonic()
        self.totals.rebuilds += 1
        self._hold(self._redis_now()[1])
        for src in self.sources:
            src.expected = src.committed = None
            src.caught_up = None

    def _mark(self, key_ids: frozenset[str]) -> None:
        """Give each of ``key_ids`` (budgeted keys) its ready mark: its bill is whole
        here (``tokengate.limits.budget``). Raises ``RedisError``."""
        pipe = self.client.pipeline(transaction=False)
        for key_id in sorted(key_ids):
            pipe.set(redis_keys.ready_mark_key(key_id), self.ledger_id)
        pipe.execute()
        self._marked = key_ids

    def _hold(self, now_ms: int) -> float | None:
        """Renew this ledger's entry among the rebuilding ledgers and its hold on every
        budgeted key, for ``HOLD_S``; the entry's score before, None when it was gone (a
        first call, or Redis lost it). Raises ``RedisError``."""
        until = now_ms + round(HOLD_S * 1000)
        before = self.client.zscore(redis_keys.REBUILDING_KEY, self.ledger_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(redis_keys.REBUILDING_KEY, {self.ledger_id: until})
        pipe.pexpire(redis_keys.REBUILDING_KEY, round(HOLD_S * 1000))
        for key_id in sorted(self.join.budgeted):
            hold = redis_keys.rebuild_key(key_id)
            pipe.hset(hold, self.ledger_id, until)
            pipe.pexpire(hold, round(HOLD_S * 1000))
        pipe.execute()
        self._renew_at = time.monotonic() + HOLD_RENEW_S
        return None if before is None else float(before)

    def _finish_rebuild(self) -> None:
        """End the rebuild once every file was read to its end after it began, no event
        of this ledger waits for engine records, and (when no other ledger rebuilds) no
        orphan record is due: set the ready mark, release the holds. Raises
        ``RedisError``."""
        since = self.rebuilding
        assert since is not None
        if any(s.caught_up is None or s.caught_up < since for s in self.sources):
            return
        if self.edge is not None and self.engine_mode:
            if self.client.zcard(self._wait_key):
                return
            now_s, now_ms = self._redis_now()
            cutoff = self._orphan_cutoff(now_s)
            if cutoff is not None and not self._others_rebuilding(now_ms) and \
                    self.client.zcount(redis_keys.ENG_WAIT_KEY, "-inf", cutoff):
                return
        took = time.monotonic() - since
        now = datetime.now(UTC).isoformat(timespec="milliseconds")
        self._mark(self.join.budgeted)
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self._ready_key, now)
        for key_id in sorted(self.join.budgeted):
            pipe.hdel(redis_keys.rebuild_key(key_id), self.ledger_id)
        pipe.zrem(redis_keys.REBUILDING_KEY, self.ledger_id)
        pipe.execute()
        self.rebuilding = None
        self._seen_ready = True
        self._after_loss = False
        log.info("ledger %s: files read up to date in %.1f s (applied %d so far); budgets "
                 "admit again", self.ledger_id, took, self.totals.applied)

    # -- running -------------------------------------------------------------------------

    def measure(self) -> None:
        """Refresh ``lag_bytes``, ``lag_s``, ``engine_lag_bytes`` and ``position`` from
        the tails (from the thread that runs the ledger: the tails are not thread-safe).
        Before the first checkpoints are read they stay None."""
        if not self._positioned:
            return
        main = self.edge or self.engines[0]
        lag = main.tail.lag_bytes()
        self.lag_s = _age_s(main.tail.pending_line()) if lag else 0.0
        self.lag_bytes = lag
        if self.engines:
            self.engine_lag_bytes = sum(s.tail.lag_bytes() for s in self.engines)
        self.position = main.committed

    def _wait_measuring(self, stop: threading.Event, seconds: float) -> None:
        """Wait ``seconds`` (or until ``stop``), refreshing the lag meanwhile."""
        end = time.monotonic() + seconds
        while not stop.wait(max(0.0, min(MEASURE_EVERY_S, end - time.monotonic()))):
            self.measure()
            if time.monotonic() >= end:
                return

    def drain(self) -> Totals:
        """Apply everything there is now (and bill the waits that are over), then
        return; raises ``RedisError``."""
        while self.step() or self.sweep():
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
                self.totals.redis_errors += 1
                if not down:
                    down = True
                    log.warning("ledger %s: Redis unavailable (%s); events stay in the usage "
                                "file, retrying", self.ledger_id, e)
                self._wait_measuring(stop, backoff)
                measured = time.monotonic()
                backoff = min(backoff * 2, MAX_BACKOFF_S)
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
        """Close the tailed files (Redis client is the caller's)."""
        for src in self.sources:
            src.tail.close()
