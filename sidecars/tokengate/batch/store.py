"""The Batch API's state: file and batch objects in Redis (``tokengate.redis_keys``,
the ``{batch}`` family), file bytes in ``batch.files_dir``.

A file's bytes live at ``<files_dir>/<file_id>`` and nowhere else: ids are made here
(``file-`` and 24 hex digits) and checked against that shape before any path is built,
so no request can name a path outside the folder. Files are written to a temporary name
in the folder and renamed, mode 0640.

Objects follow OpenAI's Files and Batch API reference: a file is ``{id, object: "file",
bytes, created_at, filename, purpose, status: "processed", expires_at, status_details}``;
a batch is ``{id, object: "batch", endpoint, model, errors, input_file_id,
completion_window, status, output_file_id, error_file_id, created_at, in_progress_at,
expires_at, finalizing_at, completed_at, failed_at, expired_at, cancelling_at,
cancelled_at, request_counts: {total, completed, failed}, metadata, usage}``. Times are
whole seconds since the epoch (wall clock, as OpenAI's).

Each line's result (its line of the output or the error file) is written once, by the
``record`` script: the result, the batch's counters and its usage change together, and
a second result for the same line changes nothing (a line a crash made the worker send
again).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokengate import redis_keys as rk
from tokengate.redis_client import SyncRedis

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
# statuses of OpenAI's batch object; the last four are final
STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired",
            "cancelling", "cancelled")
FINAL = ("failed", "completed", "expired", "cancelled")
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
         "cancelling_at", "cancelled_at")
USAGE_FIELDS = ("input_tokens", "cached_tokens", "output_tokens")

# KEYS: batch hash, res hash, quota; ARGV: index, "o"/"e" + line, input, cached, output
RECORD_LUA = """
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then
  return 0
end
local kind = string.sub(ARGV[2], 1, 1)
redis.call('HINCRBY', KEYS[1], kind == 'o' and 'completed' or 'failed', 1)
redis.call('HINCRBY', KEYS[1], 'input_tokens', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'cached_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'output_tokens', ARGV[5])
return 1
"""

# KEYS: batch hash, quota, active; ARGV: tokens, quota limit, now, in_progress/failed
# errors JSON -> 1 reserved and in progress | 0 over quota (failed, its request counts 0
# as of a batch that failed any other validation: no line ran)
RESERVE_LUA = """
if redis.call('HGET', KEYS[1], 'status') ~= 'validating' then
  return -1
end
local held = tonumber(redis.call('GET', KEYS[2]) or '0')
local want = tonumber(ARGV[1])
if held + want > tonumber(ARGV[2]) then
  redis.call('HSET', KEYS[1], 'status', 'failed', 'failed_at', ARGV[3], 'errors', ARGV[4],
             'total', 0, 'completed', 0, 'failed', 0)
  redis.call('ZREM', KEYS[3], ARGV[5])
  return 0
end
redis.call('INCRBY', KEYS[2], want)
redis.call('HSET', KEYS[1], 'status', 'in_progress', 'in_progress_at', ARGV[3],
           'reserved', want)
return 1
"""

# KEYS: batch hash, quota, active; ARGV: final status, its time field, now, batch id,
# output file id, error file id -> 1 | 0 (already final)
FINISH_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'failed' or status == 'completed' or status == 'expired'
   or status == 'cancelled' then
  return 0
end
local held = tonumber(redis.call('HGET', KEYS[1], 'reserved') or '0')
if held > 0 then
  local left = redis.call('DECRBY', KEYS[2], held)
  if left <= 0 then
    redis.call('DEL', KEYS[2])
  end
end
redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[2], ARGV[3], 'reserved', 0,
           'output_file_id', ARGV[5], 'error_file_id', ARGV[6])
redis.call('ZREM', KEYS[3], ARGV[4])
return 1
"""


class NotFound(LookupError):
    """No such object for this key (another key's object reads the same): ``kind``
    "file" or "batch", ``ident`` the id asked for."""

    def __init__(self, kind: str, ident: str) -> None:
        super().__init__(ident)
        self.kind, self.ident = kind, ident


@dataclass(frozen=True, slots=True)
class Page:
    """One page of a list: the objects and whether more follow."""

    data: list[dict[str, Any]]
    has_more: bool


def now_s() -> int:
    """Wall-clock seconds since the epoch: the objects' timestamps."""
    return int(time.time())


class Store:
    """File and batch objects of every key, in one Redis and one folder."""

    def __init__(self, redis: SyncRedis, files_dir: Path, retention_s: int,
                 create: bool = True) -> None:
        """``create``: make ``files_dir`` when it is missing (the service; a reader such as
        the console makes nothing)."""
        self.redis = redis
        self.files_dir = files_dir
        self.retention_s = retention_s
        if create:
            files_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        self._record = redis.register_script(RECORD_LUA)
        self._reserve = redis.register_script(RESERVE_LUA)
        self._finish = redis.register_script(FINISH_LUA)

    # files -------------------------------------------------------------------------

    def path(self, file_id: str) -> Path:
        """The bytes of ``file_id`` (a checked id: no other path can come out)."""
        if not FILE_ID.fullmatch(file_id):
            raise NotFound("file", file_id)
        return self.files_dir / file_id

    def add_file(self, key_id: str, filename: str, purpose: str, data: bytes,
                 file_id: str | None = None) -> dict[str, Any]:
        """Write ``data`` and its object; returns the object. ``file_id``: a given id (a
        batch's output, the same on a second try), else a new one."""
        file_id = file_id or "file-" + secrets.token_hex(12)
        path = self.path(file_id)
        tmp = path.with_name(f".{file_id}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        created = now_s()
        obj = {"id": file_id, "object": "file", "bytes": len(data), "created_at": created,
               "filename": filename, "purpose": purpose, "status": "processed",
               "expires_at": created + self.retention_s, "status_details": None}
        pipe = self.redis.pipeline()
        pipe.hset(rk.batch_key("file", file_id),
                  mapping={"obj": json.dumps(obj), "key_id": key_id})
        pipe.zadd(rk.batch_key("files", key_id), {file_id: created})
        pipe.execute()
        return obj

    def file(self, key_id: str, file_id: str) -> dict[str, Any]:
        """The object of ``key_id``'s file ``file_id``; NotFound for any other."""
        if not FILE_ID.fullmatch(file_id):
            raise NotFound("file", file_id)
        h = self.redis.hgetall(rk.batch_key("file", file_id))
        if not h or h.get("key_id") != key_id:
            raise NotFound("file", file_id)
        obj: dict[str, Any] = json.loads(h["obj"])
        return obj

    def content(self, key_id: str, file_id: str) -> bytes:
        """The bytes of ``key_id``'s file; NotFound for another key's or a missing one."""
        self.file(key_id, file_id)
        try:
            return self.path(file_id).read_bytes()
        except FileNotFoundError:
            raise NotFound("file", file_id) from None

    def files(self, key_id: str, purpose: str | None, limit: int, after: str | None,
              newest_first: bool) -> Page:
        """A page of ``key_id``'s files (OpenAI's list: ``after`` a file id)."""
        return self._page("files", "file", key_id, limit, after, newest_first,
                          lambda o: purpose is None or o["purpose"] == purpose)

    def delete_file(self, key_id: str, file_id: str) -> None:
        """Delete ``key_id``'s file (object and bytes); NotFound for any other."""
        self.file(key_id, file_id)
        pipe = self.redis.pipeline()
        pipe.delete(rk.batch_key("file", file_id))
        pipe.zrem(rk.batch_key("files", key_id), file_id)
        pipe.execute()
        self.path(file_id).unlink(missing_ok=True)

    # batches -----------------------------------------------------------------------

    def add_batch(self, key_id: str, input_file_id: str, endpoint: str, window_s: int,
                  metadata: dict[str, str] | None) -> dict[str, Any]:
        """A new batch, ``validating``, and active for the worker."""
        batch_id = "batch_" + secrets.token_hex(12)
        created = now_s()
        static = {"id": batch_id, "endpoint": endpoint, "input_file_id": input_file_id,
                  "completion_window": "24h", "created_at": created,
                  "expires_at": created + window_s, "metadata": metadata}
        pipe = self.redis.pipeline()
        pipe.hset(rk.batch_key("batch", batch_id), mapping={
            "static": json.dumps(static), "key_id": key_id, "status": "validating",
            "total": 0, "completed": 0, "failed": 0, "cursor": 0, "reserved": 0,
            **{f: 0 for f in USAGE_FIELDS}})
        pipe.zadd(rk.batch_key("batches", key_id), {batch_id: created})
        pipe.zadd(rk.BATCH_ACTIVE_KEY, {batch_id: created})
        pipe.execute()
        return self.batch(key_id, batch_id)

    def raw(self, batch_id: str) -> dict[str, str]:
        """A batch's hash as strings (empty: none)."""
        h = self.redis.hgetall(rk.batch_key("batch", batch_id))
        return {str(k): str(v) for k, v in h.items()}

    def batch(self, key_id: str, batch_id: str) -> dict[str, Any]:
        """The object of ``key_id``'s batch; NotFound for any other."""
        if not BATCH_ID.fullmatch(batch_id):
            raise NotFound("batch", batch_id)
        h = self.raw(batch_id)
        if not h or h["key_id"] != key_id:
            raise NotFound("batch", batch_id)
        return batch_object(h)

    def batches(self, key_id: str, limit: int, after: str | None) -> Page:
        """A page of ``key_id``'s batches, newest first."""
        return self._page("batches", "batch", key_id, limit, after, True, lambda o: True)

    def set_fields(self, batch_id: str, **fields: Any) -> None:
        """Set fields of a batch's hash (status, times, total, errors JSON, ...)."""
        self.redis.hset(rk.batch_key("batch", batch_id),
                        mapping={k: v if isinstance(v, (int, str)) else json.dumps(v)
                                 for k, v in fields.items()})

    def cancel(self, key_id: str, batch_id: str) -> dict[str, Any]:
        """Ask ``key_id``'s batch to stop: ``cancelling`` (the worker sends no more of
        its lines and finalizes it as ``cancelled``); a final batch stays as it is."""
        h = self.batch(key_id, batch_id)
        if h["status"] in ("validating", "in_progress"):
            self.set_fields(batch_id, status="cancelling", cancelling_at=now_s())
        return self.batch(key_id, batch_id)

    def active(self) -> list[str]:
        """Ids of the batches the worker has to move on, oldest first."""
        return _strs(self.redis.zrange(rk.BATCH_ACTIVE_KEY, 0, -1))

    def reserve(self, batch_id: str, key_id: str, tokens: int, quota: int) -> bool:
        """Hold ``tokens`` of ``key_id``'s quota for a validated batch and start it
        (``in_progress``); False: it does not fit, the batch ``failed`` with
        ``token_limit_exceeded`` (OpenAI's code for its enqueued-token limit)."""
        errors = {"object": "list", "data": [{
            "code": "token_limit_exceeded", "line": None, "param": None,
            "message": f"Enqueued token limit reached for key {key_id}: the batch needs "
                       f"{tokens} tokens (prompts plus completion limits), the key's "
                       f"quota is {quota} with the tokens of its running batches held."}]}
        r = self._reserve(keys=[rk.batch_key("batch", batch_id),
                                rk.batch_key("quota", key_id), rk.BATCH_ACTIVE_KEY],
                          args=[tokens, quota, now_s(), json.dumps(errors), batch_id])
        return int(r) == 1

    def held(self, key_id: str) -> int:
        """Tokens of ``key_id``'s quota its running batches hold."""
        return int(self.redis.get(rk.batch_key("quota", key_id)) or 0)

    def finish(self, batch_id: str, key_id: str, status: str, output_file_id: str | None,
               error_file_id: str | None) -> bool:
        """Make a batch final (``completed``, ``failed``, ``expired``, ``cancelled``):
        its quota given back, off the active list; False if it already was."""
        r = self._finish(keys=[rk.batch_key("batch", batch_id), rk.batch_key("quota", key_id),
                               rk.BATCH_ACTIVE_KEY],
                         args=[status, f"{status}_at", now_s(), batch_id,
                               output_file_id or "", error_file_id or ""])
        return int(r) == 1

    # lines -------------------------------------------------------------------------

    def set_counts(self, batch_id: str, counts: dict[int, tuple[int, int]]) -> None:
        """The edge's count of each line that can run: index -> (prompt, max_tokens)."""
        if counts:
            self.redis.hset(rk.batch_key("count", batch_id),
                            mapping={str(i): f"{p} {m}" for i, (p, m) in counts.items()})

    def counts(self, batch_id: str) -> dict[int, tuple[int, int]]:
        """The lines that can run: index -> (prompt tokens, completion limit)."""
        out = {}
        for k, v in self.redis.hgetall(rk.batch_key("count", batch_id)).items():
            p, m = v.split()
            out[int(k)] = (int(p), int(m))
        return out

    def record(self, batch_id: str, index: int, output: bool, line: dict[str, Any],
               usage: tuple[int, int, int] = (0, 0, 0)) -> bool:
        """Line ``index``'s result, once: its output-file line (``output``) or error-file
        line, with its usage (input, cached, output tokens) added to the batch's; False
        when it already had one."""
        text = ("o" if output else "e") + json.dumps(line, ensure_ascii=False,
                                                     separators=(",", ":"))
        r = self._record(keys=[rk.batch_key("batch", batch_id), rk.batch_key("res", batch_id)],
                         args=[index, text, *usage])
        return int(r) == 1

    def done(self, batch_id: str) -> set[int]:
        """Indexes of the lines that have a result."""
        return {int(k) for k in self.redis.hkeys(rk.batch_key("res", batch_id))}

    def results(self, batch_id: str) -> Iterator[tuple[int, str]]:
        """(index, "o<line>" | "e<line>") of every result, in line order."""
        h = self.redis.hgetall(rk.batch_key("res", batch_id))
        for k in sorted(h, key=int):
            yield int(k), str(h[k])

    def attempt(self, batch_id: str, index: int) -> int:
        """The attempt line ``index``'s request id names now (0 first)."""
        return int(self.redis.hget(rk.batch_key("att", batch_id), str(index)) or 0)

    def next_attempt(self, batch_id: str, index: int) -> int:
        """A new request id for line ``index``: its last one was answered without being
        billed (a refusal), so the ledger must not take the next for a replay."""
        return int(self.redis.hincrby(rk.batch_key("att", batch_id), str(index), 1))

    # retention ---------------------------------------------------------------------

    def expire_old(self, key_ids: list[str], now: int | None = None) -> int:
        """Delete the final batches and the files (uploads, outputs, errors) of
        ``key_ids`` made more than the retention before ``now`` (epoch s; default the
        wall clock), bytes included; returns how many objects went."""
        cutoff = (now_s() if now is None else now) - self.retention_s
        gone = 0
        for key_id in key_ids:
            for batch_id in _strs(self.redis.zrangebyscore(rk.batch_key("batches", key_id),
                                                           0, cutoff)):
                h = self.raw(batch_id)
                if h and h["status"] not in FINAL:
                    continue
                pipe = self.redis.pipeline()
                for kind in ("batch", "count", "res", "att"):
                    pipe.delete(rk.batch_key(kind, batch_id))
                pipe.zrem(rk.batch_key("batches", key_id), batch_id)
                pipe.execute()
                gone += 1
            for file_id in _strs(self.redis.zrangebyscore(rk.batch_key("files", key_id), 0,
                                                          cutoff)):
                self.delete_file(key_id, file_id)
                gone += 1
        return gone

    def _page(self, index: str, kind: str, key_id: str, limit: int, after: str | None,
              newest_first: bool, keep: Any) -> Page:
        ids = _strs((self.redis.zrevrange if newest_first
                     else self.redis.zrange)(rk.batch_key(index, key_id), 0, -1))
        if after is not None:
            ids = ids[ids.index(after) + 1:] if after in ids else []
        out: list[dict[str, Any]] = []
        for i in ids:
            try:
                obj = self.file(key_id, i) if kind == "file" else self.batch(key_id, i)
            except NotFound:
                continue
            if keep(obj):
                if len(out) == limit:
                    return Page(out, True)
                out.append(obj)
        return Page(out, False)


def _strs(items: Any) -> list[str]:
    """A Redis reply's members as strings (the clients decode replies)."""
    return [str(i) for i in items]


def batch_object(h: dict[str, str]) -> dict[str, Any]:
    """A batch's object in OpenAI's shape from its hash."""
    static = json.loads(h["static"])
    completed, failed = int(h["completed"]), int(h["failed"])
    inp, cached, out = (int(h[f]) for f in USAGE_FIELDS)
    obj: dict[str, Any] = {
        "id": static["id"], "object": "batch", "endpoint": static["endpoint"],
        "model": h.get("model") or None,
        "errors": json.loads(h["errors"]) if h.get("errors") else None,
        "input_file_id": static["input_file_id"],
        "completion_window": static["completion_window"], "status": h["status"],
        "output_file_id": h.get("output_file_id") or None,
        "error_file_id": h.get("error_file_id") or None,
        "created_at": static["created_at"], "expires_at": static["expires_at"],
        **{t: int(h[t]) if h.get(t) else None for t in TIMES},
        "request_counts": {"total": int(h["total"]), "completed": completed,
                           "failed": failed},
        "metadata": static["metadata"],
        "usage": {"input_tokens": inp, "input_tokens_details": {"cached_tokens": cached},
                  "output_tokens": out,
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": inp + out},
    }
    return obj
