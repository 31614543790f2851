"""Every Redis key tokengate writes: the names, prefixes and their encoding, in one place
for the ledger, the global limits (windows and budgets), ``tokengate keys`` and
``tokengate usage``. Clients come from ``tokengate.redis_client``.

Key ids, model names, request ids and budget counters are percent-encoded where they are
part of a key (a missing key id or model as the empty string), so no name can reach
into another key's space. Each family has a Redis Cluster hash tag so that what one
script touches lives in one slot.

The ledger (``tokengate.ledger``): every key carries the hash tag ``{ledger}``, so one
script can update a whole batch of events and the ledger's checkpoint atomically on
Redis Cluster too (one script call per batch: its load on that one slot is small).
``<p>`` = ``tg:{ledger}``::

    <p>:usage:<day>:<key_id>:<model>   hash: counters of one key / model / UTC day
    <p>:idx:<day>                      set: JSON [key_id, model] pairs seen that day
    <p>:lusage:<day>:<level id>:<model> hash: the same counters of a team or an
                                       organization (``team:<name>``, ``org:<name>``):
                                       its members' requests, the key's levels when the
                                       ledger applied them
    <p>:lidx:<day>                     set: JSON [level id, model] pairs seen that day
    <p>:days                           zset: days with usage, score YYYYMMDD
    <p>:seen:<day>                     set: request ids applied, by the event's day;
                                       expires dedupe_days after its last addition
    <p>:audit                          stream: one entry per applied event (bounded)
    <p>:sess:<key_id>:<session_id>     hash: totals of one agent session of a key
                                       (SESSION_FIELDS); expires ledger.session_days
                                       after the session's last event was applied
    <p>:sessions:<key_id>              zset: the key's sessions, score the last event's
                                       time (epoch ms); trimmed to the
                                       ledger.sessions_per_key most recent, expires
                                       like the sessions
    <p>:ckpt:<ledger_id>               hash: pos (file_id:offset, or -file_id after
                                       a finished file), path, ts
    <p>:done:<ledger_id>               zset: ids of usage files read to their end
    <p>:stats:<ledger_id>              hash: applied, duplicates, bad_lines, batches,
                                       files_done; settled_engine, engine_missing,
                                       disagreements (of the events of its usage file);
                                       engine_records, engine_duplicates,
                                       engine_unmatched, engine_probes,
                                       engine_late (of an engine file)
    <p>:spans:<ledger_id>              hash: traced (spans of the events it applied,
                                       handed to the export), exported, lost:<reason>
                                       (tokengate.ledger.tracing.SpanStore)
    <p>:ready:<ledger_id>              string: the time the ledger last finished
                                       reading its files into this Redis (set once
                                       caught up); missing: Redis lost its data (or
                                       the ledger never ran here), and the ledger
                                       rebuilds before budgets admit again
    <p>:rebuilding                     zset: ledger ids rebuilding now, score the Redis
                                       time (ms) their lease ends

Budget alerts (``tokengate.ledger.alerts``)::

    <p>:alert:<alert id>               string: the alert was claimed (kept as long as
                                       its period's counters)
    <p>:alerts                         hash: "<alert id>|<webhook url>" -> JSON
                                       {alert, attempts, next_at}: deliveries not
                                       acknowledged yet
    <p>:alert_send:<field>             string: the ledger delivering it now (a lease)

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
                                       time (epoch s) the first of them was written
                                       (its ``ts``)
    <p>:open:<request_id>              hash: "#bill" -> the bill of a request that
                                       engine records can still correct (billed with
                                       the edge's numbers, or with some of its
                                       records), JSON (``tokengate.ledger.join``);
                                       record key -> line of each record it used;
                                       expires dedupe_days after its last change
    <p>:budget_fix                     hash: fix id -> JSON [key_id, [[counter,
                                       ttl_s], ...], cost_nano, tokens]: a change of a
                                       key's budget counters to its bill, not made yet
    <p>:eseen:<day>                    set: record keys read, by the record's ts day;
                                       expires dedupe_days after its last addition

Fields of a usage hash (integers unless noted)::

    requests  errors (status >= 400)  status:<code>  aborted  estimated (usage from the
    admission estimate)  prompt_tokens  completion_tokens  cached_tokens  system_tokens
    cost (float, INCRBYFLOAT, currency units)  settled_engine (billed with the engine's
    records)  engine_missing (no engine record within ledger.engine_wait_s: billed with
    the edge's numbers)  disagreements (edge and engine numbers differ)
    endpoint:<endpoint>:{requests,prompt_tokens,completion_tokens,cost} (the same per
    ENDPOINTS entry of the event's endpoint; cost a float)

The global-limit windows (``tokengate.limits.window``), hashed per API key (one slot per
key, keys spread over the cluster)::

    tg:gl:{<key_id>}:<scope>:z   zset  request_id -> admission time, ms
    tg:gl:{<key_id>}:<scope>:h   hash  request_id -> tokens reserved (settled);
                                       field "#sum" = tokens in the window
    scope = "all" (the key's own limits) | "m:<model>" (a per-model override)

The budgets (``tokengate.budget_store``, ``tokengate.limits.budget``), hashed per API
key too::

    tg:bg:{<key_id>}:<counter>:s        string  settled spend of the period, nano-units
    tg:bg:{<key_id>}:<counter>:t        string  settled tokens (prompt + completion)
    tg:bg:{<key_id>}:<counter>:rs:<h>   string  spend and tokens reserved in UTC hour h
    tg:bg:{<key_id>}:<counter>:rt:<h>   string    (hours since the epoch) by requests
                                                  not settled yet; kept two hours
    tg:bg:{<key_id>}:r:<request>        string  the reservation record of a request not
                                                settled yet (two hours); "settled" for
                                                ten minutes after its settlement
    tg:bg:{<key_id>}:ready              string  set by a ledger once the key's bill is
                                                whole in this Redis; a limits sidecar
                                                that saw it refuses the key's budgets
                                                while it is gone (lost with the data)
    tg:bg:{<key_id>}:rebuild            hash    ledger id -> the Redis time (ms) its
                                                hold ends: while one has not ended, the
                                                key's budgets admit nothing (the ledger
                                                rebuilds after Redis lost its data)
    tg:bg:{<key_id>}:fix:<fix id>       string  a budget fix made (one day): never twice
    counter = "<model or *>:<day|month>:<period id>"

A team's or organization's budget counters (``tokengate.config.teams``) are named
``<level id>/<counter>`` in a request's counters and reservation record, and kept under
the level's own tag, shared by every member key: ``tg:bg:{team:<name>}:<counter>:s``
and so on (``level_counter``). A script that touches a key's and its team's counters
spans two slots: pooled budgets need one Redis, not a Cluster (the schema says so).

A team's or organization's windows are ``tg:gl:{<level id>}:all:z`` and ``:h``.
"""

from __future__ import annotations

from urllib.parse import quote

PREFIX = "tg:{ledger}"     # the ledger's keys
WINDOW_PREFIX = "tg:gl"    # the global-limit windows
BUDGET_PREFIX = "tg:bg"    # the budgets


def _enc(name: str | None) -> str:
    return "" if name is None else quote(name, safe="")


# --- the ledger


# The endpoints a usage hash splits its requests, tokens and cost by (the usage event's
# endpoint, "batch" for the lines of batches; any other path counts as "other").
ENDPOINTS = ("chat", "completions", "messages", "count_tokens", "responses", "input_tokens",
             "response", "response_cancel", "embeddings", "models", "model", "batch")


def endpoint_bucket(endpoint: str) -> str:
    """The usage event's ``endpoint`` as the usage hash splits it: one of ENDPOINTS, or
    "other" for any other path."""
    return endpoint if endpoint in ENDPOINTS else "other"


def endpoint_field(endpoint: str, name: str) -> str:
    """The usage hash's field ``name`` (requests, prompt_tokens, completion_tokens, cost)
    of the usage event's ``endpoint`` (endpoint_bucket)."""
    return f"endpoint:{endpoint_bucket(endpoint)}:{name}"


def usage_key(day: str, key_id: str | None, model: str | None) -> str:
    """The counters hash of one key / model / day."""
    return f"{PREFIX}:usage:{day}:{_enc(key_id)}:{_enc(model)}"


def idx_key(day: str) -> str:
    return f"{PREFIX}:idx:{day}"


def level_usage_key(day: str, level_id: str, model: str | None) -> str:
    """The counters hash of one team or organization / model / day."""
    return f"{PREFIX}:lusage:{day}:{_enc(level_id)}:{_enc(model)}"


def level_idx_key(day: str) -> str:
    return f"{PREFIX}:lidx:{day}"


def seen_key(day: str) -> str:
    return f"{PREFIX}:seen:{day}"


# Fields of a session hash: requests, prompt_tokens, cached_tokens, completion_tokens
# (integers), cost (float, currency units), first and last (the events' ts, epoch ms).
SESSION_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost",
                  "first", "last")


def session_key(key_id: str | None, session_id: str) -> str:
    """The totals hash of one agent session of a key."""
    return f"{PREFIX}:sess:{_enc(key_id)}:{_enc(session_id)}"


def sessions_key(key_id: str | None) -> str:
    """The zset of a key's sessions, by last seen (epoch ms)."""
    return f"{PREFIX}:sessions:{_enc(key_id)}"


DAYS_KEY = f"{PREFIX}:days"
AUDIT_KEY = f"{PREFIX}:audit"


def ckpt_key(ledger_id: str) -> str:
    return f"{PREFIX}:ckpt:{_enc(ledger_id)}"


def done_key(ledger_id: str) -> str:
    return f"{PREFIX}:done:{_enc(ledger_id)}"


def stats_key(ledger_id: str) -> str:
    return f"{PREFIX}:stats:{_enc(ledger_id)}"


def spans_key(ledger_id: str) -> str:
    return f"{PREFIX}:spans:{_enc(ledger_id)}"


PENDING_KEY = f"{PREFIX}:pending"
ENG_WAIT_KEY = f"{PREFIX}:eng_wait"
BUDGET_FIX_KEY = f"{PREFIX}:budget_fix"
REBUILDING_KEY = f"{PREFIX}:rebuilding"


def ready_key(ledger_id: str) -> str:
    return f"{PREFIX}:ready:{_enc(ledger_id)}"


def open_key(request_id: str) -> str:
    """The bill of a request that engine records can still correct."""
    return f"{PREFIX}:open:{request_id}"


def wait_key(ledger_id: str) -> str:
    return f"{PREFIX}:wait:{_enc(ledger_id)}"


def eng_key(request_id: str) -> str:
    return f"{PREFIX}:eng:{request_id}"


def eseen_key(day: str) -> str:
    return f"{PREFIX}:eseen:{day}"


def day_score(day: str) -> int:
    """``2026-11-29`` -> 20261129 (the ``days`` zset's score)."""
    return int(day.replace("-", ""))


# --- the global-limit windows


def window_keys(key_id: str, model: str | None = None) -> tuple[str, str]:
    """The (zset, hash) of a key's window; per model when ``model`` is given."""
    tag = _enc(key_id)
    scope = "all" if model is None else "m:" + _enc(model)
    return f"{WINDOW_PREFIX}:{{{tag}}}:{scope}:z", f"{WINDOW_PREFIX}:{{{tag}}}:{scope}:h"


# --- the budgets


def encode_counter(name: str) -> str:
    """A budget counter as its keys (and a reservation record) hold it: percent-encoded,
    its ``*`` and ``:`` kept."""
    return quote(name, safe="*:")


def level_counter(counter: str) -> tuple[str, str] | None:
    """A team's or organization's budget counter, ``<level id>/<counter>``
    (``team:eng/*:day:20427``: lua/tokengate/budget.lua names them so), as (level id,
    counter); None for a key's own counter. A level id is ``team:`` or ``org:`` and a
    name without ``/`` or ``:`` (``tokengate.config.teams``); no configured model starts
    with either while teams exist, so a key's counter never reads as one."""
    head, sep, rest = counter.partition("/")
    level, colon, name = head.partition(":")
    if sep and colon and level in ("team", "org") and name and ":" not in name:
        return head, rest
    return None


def budget_keys(key_id: str, counter: str, hour: int) -> list[str]:
    """The Redis keys of one counter of ``key_id`` at UTC hour ``hour`` (hours since the
    epoch): settled spend and tokens, then the in-flight spend and tokens of ``hour`` and
    of ``hour - 1``. A level's counter (``level_counter``) is the level's, whichever
    member's request names it: ``tg:bg:{<level id>}:<counter>:...``."""
    level = level_counter(counter)
    if level is not None:
        key_id, counter = level
    base = f"{BUDGET_PREFIX}:{{{_enc(key_id)}}}:{encode_counter(counter)}"
    return [base + ":s", base + ":t", f"{base}:rs:{hour}", f"{base}:rt:{hour}",
            f"{base}:rs:{hour - 1}", f"{base}:rt:{hour - 1}"]


def reservation_key(key_id: str, request_id: str) -> str:
    """The Redis key of one request's budget reservation."""
    return f"{BUDGET_PREFIX}:{{{_enc(key_id)}}}:r:{_enc(request_id)}"


def ready_mark_key(key_id: str) -> str:
    """The mark a ledger sets once ``key_id``'s bill is whole in this Redis."""
    return f"{BUDGET_PREFIX}:{{{_enc(key_id)}}}:ready"


def rebuild_key(key_id: str) -> str:
    """The hash of the ledgers holding ``key_id``'s budgets while they rebuild."""
    return f"{BUDGET_PREFIX}:{{{_enc(key_id)}}}:rebuild"


def budget_fix_mark(key_id: str, fix_id: str) -> str:
    """The mark of one budget fix made to ``key_id``'s counters."""
    return f"{BUDGET_PREFIX}:{{{_enc(key_id)}}}:fix:{_enc(fix_id)}"


# --- budget alerts (tokengate.ledger.alerts), in the ledger's slot


ALERTS_KEY = f"{PREFIX}:alerts"    # hash: "<alert id>|<webhook url>" -> JSON delivery


def alert_mark(alert_id: str) -> str:
    """The mark that an alert was claimed (sent once per threshold per period)."""
    return f"{PREFIX}:alert:{_enc(alert_id)}"


def alert_lease(field: str) -> str:
    """The lease of the ledger delivering one pending alert to one webhook."""
    return f"{PREFIX}:alert_send:{_enc(field)}"


# The Batch API (``tokengate.batch``): every key carries the hash tag ``{batch}``, so a
# line's result, its batch's counters and a key's quota change in one script.
# ``<b>`` = ``tg:{batch}``::
#
#     <b>:file:<file_id>        hash: a file's object (OpenAI's fields) and key_id
#     <b>:files:<key_id>        zset: the key's files, score created_at
#     <b>:batch:<batch_id>      hash: a batch's object, counters, cursor and quota held
#     <b>:batches:<key_id>      zset: the key's batches, score created_at
#     <b>:count:<batch_id>      hash: line index -> "prompt max_tokens" of a line the
#                               edge checked and counted at creation
#     <b>:res:<batch_id>        hash: line index -> "o<line>" | "e<line>", each line of
#                               the output or error file, written once
#     <b>:att:<batch_id>        hash: line index -> the attempt its request id names
#     <b>:active                zset: batches validating, in progress or cancelling
#     <b>:quota:<key_id>        string: the key's enqueued tokens
BATCH_PREFIX = "tg:{batch}"
BATCH_ACTIVE_KEY = f"{BATCH_PREFIX}:active"


def batch_key(kind: str, ident: str) -> str:
    """``<b>:<kind>:<ident>``: kind one of file, files, batch, batches, count, res, att,
    quota (the layout above); ident a file, batch or key id."""
    return f"{BATCH_PREFIX}:{kind}:{_enc(ident)}"
