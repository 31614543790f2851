"""The ledger's Redis key layout (shared by the ledger and the report; clients come from
``tokengate.redis_client``).

Every ledger key carries the hash tag ``{ledger}``, so one script can update a whole
batch of events and the ledger's checkpoint atomically on Redis Cluster too (the
ledger writes one script call per batch: its load on that one slot is small). The
global-limit windows are hashed per API key instead (``tokengate.limits.window``).

Keys (``<p>`` = ``tg:{ledger}``; key ids and model names percent-encoded, a missing
one as the empty string)::

    <p>:usage:<day>:<key_id>:<model>   hash: counters of one key / model / UTC day
    <p>:idx:<day>                      set: JSON [key_id, model] pairs seen that day
    <p>:days                           zset: days with usage, score YYYYMMDD
    <p>:seen:<day>                     set: request ids applied, by the event's day;
                                       expires dedupe_days after its last addition
    <p>:audit                          stream: one entry per applied event (bounded)
    <p>:ckpt:<ledger_id>               hash: pos (file_id:offset, or -file_id after
                                       a finished file), path, ts
    <p>:done:<ledger_id>               zset: ids of usage files read to their end
    <p>:stats:<ledger_id>              hash: applied, duplicates, bad_lines, batches,
                                       files_done; settled_engine, engine_missing,
                                       disagreements (of the events of its usage file);
                                       engine_records, engine_duplicates,
                                       engine_unmatched, engine_late (of an engine file)

The join of edge events and engine records (``tokengate.ledger.reconcile``)::

    <p>:pending                        hash: request id -> {"o": owner ledger id,
                                       "ev": usage event line} of an edge event
                                       waiting for its engine records
    <p>:wait:<ledger_id>               zset: request ids its owner parked, score the
                                       Redis time (ms) its wait ends
    <p>:eng:<request_id>               hash: record key -> engine record line, records
                                       of an edge request not settled yet; expires
                                       dedupe_days after its last addition
    <p>:eng_wait                       zset: request ids with records kept, score the
                                       Redis time (s) the first arrived
    <p>:eseen:<day>                    set: record keys read, by the record's ts day;
                                       expires dedupe_days after its last addition

Fields of a usage hash (integers unless noted)::

    requests  errors (status >= 400)  status:<code>  aborted  estimated (usage from the
    admission estimate)  prompt_tokens  completion_tokens  cached_tokens  system_tokens
    cost (float, INCRBYFLOAT, currency units)  settled_engine (billed with the engine's
    records)  engine_missing (no engine record within ledger.engine_wait_s: billed with
    the edge's numbers)  disagreements (edge and engine numbers differ)
"""

from __future__ import annotations

from urllib.parse import quote

PREFIX = "tg:{ledger}"


def _enc(name: str | None) -> str:
    return "" if name is None else quote(name, safe="")


def usage_key(day: str, key_id: str | None, model: str | None) -> str:
    """The counters hash of one key / model / day."""
    return f"{PREFIX}:usage:{day}:{_enc(key_id)}:{_enc(model)}"


def idx_key(day: str) -> str:
    return f"{PREFIX}:idx:{day}"


def seen_key(day: str) -> str:
    return f"{PREFIX}:seen:{day}"


DAYS_KEY = f"{PREFIX}:days"
AUDIT_KEY = f"{PREFIX}:audit"


def ckpt_key(ledger_id: str) -> str:
    return f"{PREFIX}:ckpt:{_enc(ledger_id)}"


def done_key(ledger_id: str) -> str:
    return f"{PREFIX}:done:{_enc(ledger_id)}"


def stats_key(ledger_id: str) -> str:
    return f"{PREFIX}:stats:{_enc(ledger_id)}"


PENDING_KEY = f"{PREFIX}:pending"
ENG_WAIT_KEY = f"{PREFIX}:eng_wait"


def wait_key(ledger_id: str) -> str:
    return f"{PREFIX}:wait:{_enc(ledger_id)}"


def eng_key(request_id: str) -> str:
    return f"{PREFIX}:eng:{request_id}"


def eseen_key(day: str) -> str:
    return f"{PREFIX}:eseen:{day}"


def day_score(day: str) -> int:
    """``2026-11-29`` -> 20261129 (the ``days`` zset's score)."""
    return int(day.replace("-", ""))
