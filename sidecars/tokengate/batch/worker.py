"""The batch worker: moves every active batch from ``validating`` to a final status.

validating
    The input file's shape is read (``tokengate.batch.lines``); a bad file fails the
    batch. Each line is then sent to the edge as a check (``X-Tokengate-Batch-Check``):
    validated, sanitized and counted by the code of an online request of its endpoint,
    answered with its prompt tokens and completion limit, never forwarded nor billed. A
    line the edge refuses gets its error-file line now, with the online answer (status,
    body). The lines' prompt tokens plus completion limits are then held against the
    key's quota (``batch.quota_tokens``): the batch runs (``in_progress``) or fails with
    ``token_limit_exceeded``.
in_progress
    Lines go through the edge as the worker key acting for the batch's key, at the
    worker key's (lowest) priority: admitted only where that priority finds room in the
    replicas' KV cache, queues, running seats and prefill lanes
    (``edge.admission.priorities``; a line finding none waits at the edge up to the
    priority's ``hold_ms``), so interactive traffic keeps its latency. How many are out
    at once follows TCP's congestion window (slow start, then AIMD: additive increase,
    multiplicative decrease, Chiu and Jain 1989; AIBrix ramps batch load the same
    way): one more per
    answer until the first refusal, then one more per window of answers, or per
    ``PROBE_ANSWERS`` answers when the window is larger: seats free and fill again
    many times per window, and the window must climb back within a few of them or
    stay below what the replicas hold on average. A refusal
    (429 or 503 that may be retried) cuts the window: an ``overloaded`` one by one line
    (additive decrease: the edge bounds what each replica takes at the priority, so
    this refusal says only that this line found no seat at this moment, and a seat
    comes back as soon as any request there ends: a window cut by half or to the lines
    out would follow every dip of the interactive traffic and leave seats empty on
    average; a burst of refusals still brings it down line by line); any other to
    half. Then a pause: the edge's Retry-After for a limit, but only
    ``REFUSED_PAUSE_S[0]`` for ``overloaded``, whose Retry-After estimates a queue
    that lines never join. Lines of different keys take turns (round robin over
    keys, then over a key's batches). Sends are paced, as TCP paces a window over its
    round trip (Linux's ``sk_pacing_rate``: 2 windows per smoothed round trip in slow
    start, 1.2 after): lines leave one by one at least ``srtt / (factor x window)``
    apart (``srtt``: the smoothed time a line takes to come back, RFC 6298's 1/8 gain),
    so a grown window does not land on a replica as one burst of prefills, which one
    engine step would compute at once while every interactive request waited on it.
finalizing
    When every line has a result, or the batch was cancelled or expired (lines that did
    not run get ``batch_cancelled`` / ``batch_expired`` error lines), the output and
    error files are written in line order and the quota is given back.

Exactly once: a line's request id is ``lines.request_id(batch, index, attempt)``. The
attempt changes only after an answer that billed nothing (a refusal); a line whose
outcome is unknown (the worker, the edge or Redis died while it was out) goes again
with the same id, so the ledger, which applies each request id once, bills it once, and
its result is written once (``Store.record``). A result the worker holds while Redis is
down is kept and written when Redis is back, and a line leaves the lines to send (or
the lines out) only after the Redis read or write it needs (its attempt) succeeded, so
Redis dying mid-step drops no line from both.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import redis

from tokengate.batch import lines as lines_mod
from tokengate.batch.edge import Answer, EdgeClient
from tokengate.batch.store import Store, now_s
from tokengate.config import Config

log = logging.getLogger("tokengate.batch")

CHECKS_AT_ONCE = 8          # lines checked at once while a batch validates
START_WINDOW = 2.0          # lines out at once when the worker starts
IDLE_S = 0.2                # the loop's sleep with nothing to do
REFUSED_PAUSE_S = (0.05, 2.0)  # bounds of the pause after a refusal, s
PACING = (2.0, 1.2)         # windows per srtt: in slow start, after (Linux TCP's)
SRTT_GAIN = 0.125           # weight of a new round trip in srtt (RFC 6298)
PROBE_ANSWERS = 10          # answers per line more once refused (at most a window's)
SWEEP_S = 60.0              # retention sweep period, s


@dataclass
class _Batch:
    """What the worker keeps of one running batch."""

    batch_id: str
    key_id: str
    endpoint: str
    lines: list[lines_mod.Line]
    pending: deque[int] = field(default_factory=deque)
    out: set[int] = field(default_factory=set)


def usage_of(body: Any) -> tuple[int, int, int]:
    """(input, cached, output tokens) of an answer's usage: OpenAI's chat, completions
    and embeddings shape (prompt_tokens, completion_tokens,
    prompt_tokens_details.cached_tokens) or the Responses API's (input_tokens,
    output_tokens, input_tokens_details.cached_tokens); zeros without one."""
    u = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(u, dict):
        return 0, 0, 0
    inp = u.get("prompt_tokens", u.get("input_tokens", 0)) or 0
    out = u.get("completion_tokens", u.get("output_tokens", 0)) or 0
    details = u.get("prompt_tokens_details") or u.get("input_tokens_details") or {}
    cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
    return int(inp), int(cached or 0), int(out)


def result_line(rid: str, custom_id: str, answer: Answer | None,
                error: tuple[str, str] | None = None) -> dict[str, Any]:
    """A line of the output or error file (OpenAI's batch request output object):
    ``{id, custom_id, response: {status_code, request_id, body} | null, error: {code,
    message} | null}``."""
    response = None
    if answer is not None:
        body = answer.json()
        response = {"status_code": answer.status, "request_id": answer.request_id or rid,
                    "body": body if body is not None else answer.body.decode("utf-8",
                                                                             "replace")}
    err = {"code": error[0], "message": error[1]} if error else None
    return {"id": f"batch_req_{rid}", "custom_id": custom_id, "response": response,
            "error": err}


def retryable(a: Answer) -> bool:
    """A refusal to send again later: a 429 or 503 that the edge says retrying can help,
    except an exhausted budget (insufficient_quota: it stays so for the period)."""
    return a.status in (429, 503) and a.should_retry and a.error_code() != "insufficient_quota"


class Worker:
    """Runs the batches of one ``Store`` through one edge (one worker per Redis)."""

    def __init__(self, cfg: Config, store: Store, edge: EdgeClient,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.store = store
        self.edge = edge
        self.clock = clock
        self.window = START_WINDOW
        self.slow_start_until = float(cfg.batch.max_in_flight)  # TCP's ssthresh
        self.paused_until = 0.0
        self.srtt: float | None = None   # smoothed time a line takes to come back, s
        self.next_send_at = 0.0
        self.running: dict[str, _Batch] = {}
        self.inflight: dict[Future[Answer], tuple[str, int, str, float]] = {}
        self.unrecorded: list[tuple[str, int, bool, dict[str, Any], tuple[int, int, int]]] = []
        self.turn = 0
        self.pool = ThreadPoolExecutor(cfg.batch.max_in_flight, thread_name_prefix="line")
        self.last_sweep = 0.0

    # the loop ----------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Work until ``stop`` is set; Redis or edge failures wait and try again."""
        while not stop.is_set():
            try:
                busy = self.step()
            except (redis.RedisError, OSError) as e:
                # a plain pause: answers taken back into inflight while Redis is down
                # would end _wait at once, and the log would fill with this line
                log.warning("tokengate-batch: %s; trying again", e)
                stop.wait(IDLE_S)
                continue
            if not busy:
                self._wait(IDLE_S)
        self.pool.shutdown(wait=False, cancel_futures=True)

    def step(self) -> bool:
        """One turn: results written, batches moved on, lines sent; True when anything
        happened (the caller sleeps otherwise)."""
        busy = self._collect()
        self._flush()
        for batch_id in self.store.active():
            try:
                busy = self._advance(batch_id) or busy
            except (redis.RedisError, OSError):
                raise  # the store or the edge: run() waits and tries again
            except Exception:  # one batch's fault must not stop every key's batches
                log.exception("tokengate-batch: %s failed on an internal error", batch_id)
                self._fail(batch_id)
                busy = True
        busy = self._dispatch() or busy
        if self.clock() - self.last_sweep > SWEEP_S:
            self.last_sweep = self.clock()
            self.store.expire_old(list(self.cfg.keys))
        return busy

    def _wait(self, seconds: float) -> None:
        if any(b.pending for b in self.running.values()):
            seconds = min(seconds, max(self.next_send_at, self.paused_until) - self.clock())
            if seconds <= 0:
                return
        if self.inflight:
            wait(list(self.inflight), timeout=seconds, return_when=FIRST_COMPLETED)
        else:
            time.sleep(seconds)

    # one batch ---------------------------------------------------------------------

    def _advance(self, batch_id: str) -> bool:
        h = self.store.raw(batch_id)
        if not h:
            return False
        status = h["status"]
        if status == "validating":
            self._validate(batch_id, h)
            return True
        b = self.running.get(batch_id) or self._load(batch_id, h)
        if b is None:
            return False
        if status == "in_progress" and now_s() >= json.loads(h["static"])["expires_at"]:
            status = "expired"
        if status in ("cancelling", "expired"):
            b.pending.clear()
            if b.out:
                return False
            self._finalize(b, "cancelled" if status == "cancelling" else "expired")
            return True
        if status in ("in_progress", "finalizing") and not b.pending and not b.out \
                and int(h["completed"]) + int(h["failed"]) >= int(h["total"]):
            self._finalize(b, "completed")
            return True
        return False

    def _fail(self, batch_id: str) -> None:
        """Fail a batch that raised (a defect, not its input: ``lines.parse`` refuses bad
        input with line errors): ``failed`` with one ``internal_error``, off the active
        list, so the worker goes on with the others instead of restarting for ever."""
        h = self.store.raw(batch_id)
        self.running.pop(batch_id, None)
        if not h:
            return
        self.store.set_fields(batch_id, errors={"object": "list", "data": [
            {"code": "internal_error", "message": "The batch could not be processed "
             "(tokengate-batch's log says why).", "line": None, "param": None}]})
        self.store.finish(batch_id, h["key_id"], "failed", None, None)

    def _load(self, batch_id: str, h: dict[str, str]) -> _Batch | None:
        """A batch in progress as the worker keeps it: its lines read again from its input
        file, those without a result pending (after a restart: every line that was out)."""
        static = json.loads(h["static"])
        try:
            data = self.store.content(h["key_id"], static["input_file_id"])
        except LookupError:
            self.store.finish(batch_id, h["key_id"], "failed", None, None)
            return None
        b = self.cfg.batch
        parsed, _ = lines_mod.parse(data, static["endpoint"], b.max_lines, b.max_line_bytes)
        batch = _Batch(batch_id, h["key_id"], static["endpoint"], parsed)
        done = self.store.done(batch_id)
        batch.pending.extend(i for i in sorted(self.store.counts(batch_id)) if i not in done)
        self.running[batch_id] = batch
        return batch

    def _validate(self, batch_id: str, h: dict[str, str]) -> None:
        static = json.loads(h["static"])
        key_id, endpoint = h["key_id"], static["endpoint"]
        b = self.cfg.batch
        try:
            data = self.store.content(key_id, static["input_file_id"])
        except LookupError:
            data = b""
        parsed, errors = lines_mod.parse(data, endpoint, b.max_lines, b.max_line_bytes)
        if errors:
            self.store.set_fields(batch_id, errors={"object": "list",
                                                    "data": [e.as_dict() for e in errors]})
            self.store.finish(batch_id, key_id, "failed", None, None)
            return
        model = next((json.loads(ln.body).get("model") for ln in parsed), None)
        self.store.set_fields(batch_id, total=len(parsed), model=str(model or ""))
        done = self.store.done(batch_id)
        todo = [ln for ln in parsed if ln.index not in done]
        counts: dict[int, tuple[int, int]] = {}
        with ThreadPoolExecutor(CHECKS_AT_ONCE, thread_name_prefix="check") as pool:
            answers = pool.map(lambda ln: self.edge.post(endpoint, ln.body, key_id, batch_id,
                                                         ln.custom_id, None), todo)
            for ln, a in zip(todo, answers, strict=True):
                if a.status == 200:
                    doc = a.json()
                    counts[ln.index] = (int(doc["prompt_tokens"]), int(doc["max_tokens"] or 0))
                elif retryable(a) and a.error_code() == "count_unavailable":
                    raise OSError("the edge could not count a line now")
                else:
                    # refused at validation: named by the edge's id of that check (its
                    # log line and usage event), as response.request_id is
                    rid = a.request_id or lines_mod.request_id(batch_id, ln.index, 0)
                    self.store.record(batch_id, ln.index, False,
                                      result_line(rid, ln.custom_id, a))
        self.store.set_counts(batch_id, counts)
        counts = self.store.counts(batch_id)
        tokens = sum(p + m for p, m in counts.values())
        quota = b.key_quota_tokens.get(key_id, b.quota_tokens)
        if self.store.reserve(batch_id, key_id, tokens, quota):
            log.info("tokengate-batch: %s in progress: %d lines, %d can run, %d tokens held",
                     batch_id, len(parsed), len(counts), tokens)

    def _finalize(self, b: _Batch, status: str) -> None:
        """Write the output and error files and make the batch final."""
        if status in ("cancelled", "expired"):
            code = f"batch_{status}"
            done = self.store.done(b.batch_id)
            for ln in b.lines:
                if ln.index not in done:
                    rid = lines_mod.request_id(b.batch_id, ln.index,
                                               self.store.attempt(b.batch_id, ln.index))
                    self.store.record(b.batch_id, ln.index, False, result_line(
                        rid, ln.custom_id, None,
                        (code, f"The batch was {status} before this request ran.")))
            # cancelled while validating: total was never set, yet every line now has
            # a result (request_counts said failed 20 of total 0)
            self.store.set_fields(b.batch_id, total=len(b.lines))
        else:
            self.store.set_fields(b.batch_id, status="finalizing", finalizing_at=now_s())
        out: list[str] = []
        err: list[str] = []
        for _, text in self.store.results(b.batch_id):
            (out if text[0] == "o" else err).append(text[1:] + "\n")
        ids: list[str | None] = []
        for kind, rows in (("output", out), ("error", err)):
            if not rows:
                ids.append(None)
                continue
            file_id = "file-" + hashlib.sha256(f"{b.batch_id}:{kind}".encode()).hexdigest()[:24]
            self.store.add_file(b.key_id, f"{b.batch_id}_{kind}.jsonl", "batch_output",
                                "".join(rows).encode(), file_id=file_id)
            ids.append(file_id)
        self.store.finish(b.batch_id, b.key_id, status, ids[0], ids[1])
        self.running.pop(b.batch_id, None)
        log.info("tokengate-batch: %s %s: %d output lines, %d error lines", b.batch_id, status,
                 len(out), len(err))

    # lines -------------------------------------------------------------------------

    def _dispatch(self) -> bool:
        """Send lines while the window has room and the pacing lets them go, one key
        after another."""
        now = self.clock()
        if now < self.paused_until:
            return False
        sent = False
        while len(self.inflight) < int(self.window) and now >= self.next_send_at:
            b = self._next_batch()
            if b is None:
                break
            # the attempt read first: a line leaves pending only once its id is known
            # (Redis down here must not drop it from both pending and out)
            index = b.pending[0]
            rid = lines_mod.request_id(b.batch_id, index,
                                       self.store.attempt(b.batch_id, index))
            b.pending.popleft()
            line = b.lines[index]
            fut = self.pool.submit(self.edge.post, b.endpoint, line.body, b.key_id,
                                   b.batch_id, line.custom_id, rid)
            self.inflight[fut] = (b.batch_id, index, rid, now)
            b.out.add(index)
            sent = True
            if self.srtt is not None:
                rate = PACING[0] if self.window < self.slow_start_until else PACING[1]
                self.next_send_at = max(self.next_send_at, now) + \
                    self.srtt / (rate * self.window)
        return sent

    def _next_batch(self) -> _Batch | None:
        """The next batch to send a line of: keys take turns, then a key's batches."""
        by_key: dict[str, list[_Batch]] = {}
        for b in self.running.values():
            if b.pending:
                by_key.setdefault(b.key_id, []).append(b)
        if not by_key:
            return None
        keys = sorted(by_key)
        self.turn += 1
        batches = by_key[keys[self.turn % len(keys)]]
        return batches[(self.turn // len(keys)) % len(batches)]

    def _collect(self) -> bool:
        """Take the answers that came back: results, retries, the window's changes."""
        finished = [f for f in self.inflight if f.done()]
        for fut in finished:
            batch_id, index, rid, sent_at = self.inflight[fut]
            b = self.running.get(batch_id)
            if b is None:
                del self.inflight[fut]
                continue
            line = b.lines[index]
            try:
                a = fut.result()
            except (OSError, http.client.HTTPException) as e:
                # the outcome is unknown: the same request id again, later
                log.warning("tokengate-batch: %s line %d: %s", batch_id, index, e)
                del self.inflight[fut]
                b.out.discard(index)
                b.pending.appendleft(index)
                self._refused(1.0)
                continue
            if retryable(a):
                # Redis first: when it is down the answer stays in inflight and is
                # taken again at the next step, the line still out
                self.store.next_attempt(batch_id, index)
            del self.inflight[fut]
            b.out.discard(index)
            if a.status == 200:
                body = a.json()
                self.unrecorded.append((batch_id, index, True,
                                        result_line(rid, line.custom_id, a), usage_of(body)))
                self._grow()
                rtt = self.clock() - sent_at
                self.srtt = rtt if self.srtt is None else \
                    self.srtt + SRTT_GAIN * (rtt - self.srtt)
            elif retryable(a):
                b.pending.appendleft(index)
                if a.error_code() == "overloaded":
                    self._refused(None, by_one=True)
                else:
                    self._refused(a.retry_after_s)
            else:
                self.unrecorded.append((batch_id, index, False,
                                        result_line(rid, line.custom_id, a), (0, 0, 0)))
        return bool(finished)

    def _grow(self) -> None:
        """An answer: one more line out (slow start), or one more per ``PROBE_ANSWERS``
        answers (per window when that is fewer)."""
        grow = 1.0 if self.window < self.slow_start_until \
            else 1.0 / min(self.window, PROBE_ANSWERS)
        self.window = min(float(self.cfg.batch.max_in_flight), self.window + grow)

    def _refused(self, retry_after_s: float | None, by_one: bool = False) -> None:
        """A refusal: the window to half, or one line less (``by_one``); new lines wait
        ``retry_after_s`` (s) within ``REFUSED_PAUSE_S``."""
        self.window = max(1.0, self.window - 1 if by_one else self.window / 2)
        self.slow_start_until = self.window
        lo, hi = REFUSED_PAUSE_S
        self.paused_until = self.clock() + min(hi, max(lo, retry_after_s or lo))

    def _flush(self) -> None:
        """Write the results held (kept while Redis is down)."""
        while self.unrecorded:
            batch_id, index, ok, line, usage = self.unrecorded[0]
            self.store.record(batch_id, index, ok, line, usage)
            self.unrecorded.pop(0)
