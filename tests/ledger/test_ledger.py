"""The usage ledger against real Redis: counters, exactly-once, rotation, outages.
(Over 600 lines: the ledger's counting contract, every case checked against one
expected-rows model and one workload generator.)

In-process tests drive ``Ledger`` directly; the crash tests run the real
``tokengate-ledger`` process (devstack.ledger_service) and ``kill -9`` it, and kill and
restart a real redis-server under it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import redis
import yaml
from redis.exceptions import ConnectionError as RedisConnectionError
from tokengate import config as tg_config
from tokengate import redis_client
from tokengate import redis_keys as store
from tokengate.budget_store import (
    IN_FLIGHT_TTL_S,
    budget_keys,
    nano,
    record_tail,
    reserve_keys,
    this_hour,
)
from tokengate.ledger.calculator import Calculator
from tokengate.ledger.event import UsageEvent
from tokengate.ledger.ledger import Ledger
from tokengate.ledger.report import UsageRow, query
from tokengate.ledger.tail import UsageTail
from tokengate.limits.budget import RESERVE_LUA
from tokengate_dev import devstack

from tests.conftest import key_digest
from tests.fixtures_ledger import (
    PrivateRedis,
    UsageWriter,
    make_event,
    svc_name,
    wait_until,
)

Key = tuple[str, str | None, str | None]


def expected_rows(events: Iterable[UsageEvent], cfg: tg_config.Config) -> dict[Key, UsageRow]:
    """What the ledger must hold: the plain sum of the events, per day / key / model."""
    calc = Calculator(cfg)
    rows: dict[Key, UsageRow] = {}
    for ev in events:
        k = (ev.day, ev.key_id, ev.model)
        r = rows.setdefault(k, UsageRow(*k))
        r.requests += 1
        r.errors += ev.status >= 400
        r.aborted += ev.client_aborted
        r.estimated += ev.usage_source == "estimate"
        r.prompt_tokens += ev.prompt_tokens
        r.completion_tokens += ev.completion_tokens
        r.cached_tokens += ev.cached_tokens
        r.system_tokens += ev.system_tokens
        cost = calc.charge_event(ev).cost
        r.cost += cost
        r.statuses[str(ev.status)] = r.statuses.get(str(ev.status), 0) + 1
        ep = r.endpoints.setdefault(store.endpoint_bucket(ev.endpoint),
                                    {"requests": 0, "prompt_tokens": 0,
                                     "completion_tokens": 0, "cost": 0})
        ep["requests"] += 1
        ep["prompt_tokens"] += ev.prompt_tokens
        ep["completion_tokens"] += ev.completion_tokens
        ep["cost"] += cost
    return rows


def assert_ledger_equals(client: redis_client.SyncRedis, events: list[UsageEvent],
                         cfg: tg_config.Config) -> None:
    """Every counter equals the sum of the events; cost to 1e-9 relative."""
    want = expected_rows(events, cfg)
    got = {(r.day, r.key_id, r.model): r for r in query(client)}
    assert sorted(got, key=str) == sorted(want, key=str)
    for k, w in want.items():
        g = got[k]
        assert g.cost == pytest.approx(w.cost, rel=1e-9, abs=1e-12), k
        g.cost = w.cost
        for ep, counts in w.endpoints.items():
            assert g.endpoints[ep]["cost"] == pytest.approx(counts["cost"], rel=1e-9,
                                                            abs=1e-12), (k, ep)
            g.endpoints[ep]["cost"] = counts["cost"]
        assert g == w, k
    assert client.xlen(store.AUDIT_KEY) == len(events)


def workload(n: int, seed: int = 7, days: tuple[str, ...] = ("2026-11-28", "2026-11-29"),
             ) -> list[UsageEvent]:
    """A mixed workload: three keys (one null), two models, streams, disconnects,
    rejections with no usage, estimates, prefix-cache hits, long prompts."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        status = rng.choice([200] * 12 + [400, 401, 429, 503])
        forwarded = status in (200, 503)
        prompt = rng.randint(1, 60_000) if forwarded else 0
        cached = rng.choice([0, 0, prompt // 2]) if forwarded else 0
        aborted = forwarded and rng.random() < 0.1
        src = ("running" if aborted else rng.choice(["final"] * 9 + ["estimate"])) \
            if forwarded else "none"
        ms = rng.randint(0, 86_399_999)
        ts = (f"{rng.choice(days)}T{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:"
              f"{ms // 1000 % 60:02d}.{ms % 1000:03d}Z")
        out.append(make_event(
            rng, ts=ts, key_id=rng.choice(["alpha", "beta:β", None]),
            model=rng.choice(["tiny-qwen3", "other/model"]), status=status,
            stream=rng.random() < 0.5, prompt_tokens=prompt,
            completion_tokens=rng.randint(0, 2000) if forwarded else 0, cached_tokens=cached,
            system_tokens=min(prompt, rng.randint(0, 300)), usage_source=src,
            client_aborted=aborted, token_estimate=prompt, error=None if forwarded else "x"))
    return out


@pytest.fixture
def ledger_factory(cfg: tg_config.Config, ledger_redis: redis.Redis, redis_url: str,
                   usage_writer: UsageWriter) -> Iterator[object]:
    """``make(ledger_id="test", **Ledger kwargs)``: an in-process ledger on the session
    Redis and the test's usage file."""
    made: list[Ledger] = []

    def make(ledger_id: str = "test", **kw: object) -> Ledger:
        client = redis_client.connect(cfg.redis, url=redis_url)
        led = Ledger(cfg, client, usage_writer.path, ledger_id, **kw)  # type: ignore[arg-type]
        made.append(led)
        return led

    yield make
    for led in made:
        led.close()


def test_events_become_counters_per_key_model_day(cfg, ledger_redis, usage_writer,
                                                  ledger_factory):
    events = workload(1500)
    for ev in events:
        usage_writer.write(ev)
    led = ledger_factory()
    totals = led.drain()
    assert (totals.applied, totals.duplicates, totals.bad_lines) == (1500, 0, 0)
    assert_ledger_equals(ledger_redis, events, cfg)
    # One audit entry carries the event's numbers and its cost.
    ev = events[0]
    (_entry_id, fields), = ledger_redis.xrange(store.AUDIT_KEY, count=1)
    assert fields["rid"] == ev.request_id and fields["key"] == (ev.key_id or "")
    assert int(fields["prompt"]) == ev.prompt_tokens
    cost = Calculator(cfg).charge_event(ev).cost
    assert fields["cost"] == f"{cost:.15g}"  # no last-bit noise (0.00023610000000000002)
    assert float(fields["cost"]) == pytest.approx(cost, rel=1e-14)
    stats = ledger_redis.hgetall(store.stats_key("test"))
    assert stats["applied"] == "1500" and stats["bad_lines"] == "0"


def test_a_request_id_seen_twice_is_applied_once(cfg, ledger_redis, usage_writer,
                                                 ledger_factory):
    ev = make_event(prompt_tokens=100, completion_tokens=7)
    usage_writer.write(ev)
    usage_writer.write(ev)
    totals = ledger_factory().drain()
    assert (totals.applied, totals.duplicates) == (1, 1)
    assert_ledger_equals(ledger_redis, [ev], cfg)
    # Another ledger id over the same file (a checkpoint lost): everything is a duplicate.
    again = ledger_factory("other").drain()
    assert (again.applied, again.duplicates) == (0, 2)
    assert_ledger_equals(ledger_redis, [ev], cfg)


def test_bad_lines_are_counted_and_skipped(cfg, ledger_redis, usage_writer, ledger_factory):
    good = [make_event(prompt_tokens=10 * i, completion_tokens=i) for i in range(1, 4)]
    ok = json.loads(good[0].to_json())
    bad_lines = [
        b"not json",
        b"",
        b"[1, 2]",
        json.dumps({k: v for k, v in ok.items() if k != "status"}).encode(),
        json.dumps({**ok, "status": "200"}).encode(),
        json.dumps({**ok, "prompt_tokens": -1}).encode(),
        json.dumps({**ok, "usage_source": "guess"}).encode(),
        json.dumps({**ok, "cached_tokens": 11, "prompt_tokens": 10}).encode(),
        json.dumps({**ok, "ts": "2026-11-29 16:40:00"}).encode(),
        json.dumps({**ok, "request_id": "xyz"}).encode(),
        json.dumps(ok).encode()[:-1] + b', "status": 200}',      # duplicate key
        json.dumps(ok).replace('"total_ms": 410.25', '"total_ms": NaN').encode(),
        b"\xff\xfe garbage",
    ]
    usage_writer.write(good[0])
    for line in bad_lines:
        usage_writer.write_raw(line + b"\n")
    usage_writer.write(good[1])
    usage_writer.write(good[2])
    totals = ledger_factory().drain()
    assert (totals.applied, totals.bad_lines) == (3, len(bad_lines))
    assert_ledger_equals(ledger_redis, good, cfg)
    assert ledger_redis.hget(store.stats_key("test"), "bad_lines") == str(len(bad_lines))


def test_unknown_fields_are_ignored_not_rejected(cfg, ledger_redis, usage_writer,
                                                 ledger_factory):
    ev = make_event(prompt_tokens=5, completion_tokens=5)
    usage_writer.write_raw(json.dumps({**json.loads(ev.to_json()), "new_field": 1}).encode()
                           + b"\n")
    assert ledger_factory().drain().applied == 1
    assert_ledger_equals(ledger_redis, [ev], cfg)


def test_rotation_finishes_the_old_file_including_late_writes(cfg, ledger_redis,
                                                              usage_writer, ledger_factory):
    """nginx semantics: rename, workers keep writing to the old file until reopen."""
    events = workload(300, seed=11)
    led = ledger_factory(rotate_wait_s=0.3)
    stop = threading.Event()
    t = threading.Thread(target=led.run, args=(stop,), daemon=True)
    t.start()
    try:
        for ev in events[:100]:
            usage_writer.write(ev)
        usage_writer.path.rename(usage_writer.path.with_name("usage.jsonl.1"))
        for ev in events[100:150]:     # late writers: still the old descriptor
            usage_writer.write(ev)
        usage_writer.reopen()          # nginx -s reopen: a new usage.jsonl
        for ev in events[150:]:
            usage_writer.write(ev)
        wait_until(lambda: led.totals.applied == 300, what="300 events applied")
        time.sleep(0.5)  # nothing more arrives
    finally:
        stop.set()
        t.join(5)
    assert (led.totals.applied, led.totals.duplicates, led.totals.bad_lines) == (300, 0, 0)
    assert_ledger_equals(ledger_redis, events, cfg)


def test_restart_resumes_across_two_rotations(cfg, ledger_redis, usage_writer, ledger_factory):
    events = workload(400, seed=12)
    for ev in events[:100]:
        usage_writer.write(ev)
    first = ledger_factory()
    first.drain()
    first.close()
    for ev in events[100:200]:
        usage_writer.write(ev)
    usage_writer.rotate()              # usage.jsonl -> .1
    for ev in events[200:300]:
        usage_writer.write(ev)
    usage_writer.rotate()              # .1 -> .2, usage.jsonl -> .1
    for ev in events[300:]:
        usage_writer.write(ev)
    # A new process: checkpoint is inside what is now usage.jsonl.2.
    again = ledger_factory(rotate_wait_s=0.0)
    totals = again.drain()
    assert (totals.applied, totals.duplicates) == (300, 0)
    assert_ledger_equals(ledger_redis, events, cfg)


def test_a_rotation_while_the_ledger_starts_loses_no_file(cfg, ledger_redis, usage_writer,
                                                          ledger_factory, monkeypatch):
    """The ledger lists the usage folder and then opens each name; a logrotate between
    the two made it open the new file under the old name and never see the renamed one
    (150 of 300 events applied until the next restart)."""
    events = workload(300, seed=13)
    for ev in events[:150]:
        usage_writer.write(ev)
    listing = UsageTail._listing
    rotated = []

    def rotate_after_first_listing(self: UsageTail) -> dict[str, tuple[int, int]]:
        names = listing(self)
        if not rotated:
            rotated.append(usage_writer.rotate())
            for ev in events[150:]:
                usage_writer.write(ev)
        return names

    monkeypatch.setattr(UsageTail, "_listing", rotate_after_first_listing)
    totals = ledger_factory(rotate_wait_s=0.0).drain()
    assert rotated and (totals.applied, totals.duplicates) == (300, 0)
    assert_ledger_equals(ledger_redis, events, cfg)


def test_unterminated_last_line_of_a_rotated_file_is_a_bad_line(cfg, ledger_redis,
                                                                usage_writer, ledger_factory):
    ev1, ev2 = make_event(prompt_tokens=1), make_event(prompt_tokens=2)
    usage_writer.write(ev1)
    usage_writer.write_raw(ev2.to_json().encode()[:40])   # a writer died mid-line
    usage_writer.rotate()
    usage_writer.write(ev2)
    totals = ledger_factory(rotate_wait_s=0.0).drain()
    assert (totals.applied, totals.bad_lines) == (2, 1)
    assert_ledger_equals(ledger_redis, [ev1, ev2], cfg)


def test_events_wait_on_disk_while_redis_is_down(cfg, private_redis, usage_writer):
    r = private_redis()
    client = redis_client.connect(cfg.redis, timeout_s=0.5, url=r.url)
    led = Ledger(cfg, client, usage_writer.path, "down")
    events = workload(200, seed=13)
    for ev in events[:100]:
        usage_writer.write(ev)
    led.drain()
    r.kill()
    for ev in events[100:]:
        usage_writer.write(ev)
    with pytest.raises(redis.RedisError):
        led.step()
    r.start()   # no persistence: Redis comes back empty, the ledger rebuilds from the file
    led.drain()
    assert_ledger_equals(r.client(), events, cfg)
    led.close()


# -- the real process ---------------------------------------------------------------


class EdgeWriter(threading.Thread):
    """Writes events at a steady pace while a test breaks things; rotates the file
    (rename + reopen) before event ``rotate_at`` when given."""

    def __init__(self, writer: UsageWriter, events: list[UsageEvent], per_s: float,
                 rotate_at: int | None = None) -> None:
        super().__init__(daemon=True)
        self.writer, self.events, self.per_s = writer, events, per_s
        self.rotate_at = rotate_at

    def run(self) -> None:
        t0 = time.monotonic()
        for i, ev in enumerate(self.events):
            if i == self.rotate_at:
                self.writer.rotate()
            self.writer.write(ev)
            delay = t0 + (i + 1) / self.per_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)


def start_ledger(config_path: Path, usage_file: Path, redis_url: str,
                 name: str) -> devstack.Service:
    return devstack.ledger_service(config_path, usage_file, redis_url, ledger_id=name,
                                   name=name).start()


def status(name: str) -> dict[str, object]:
    return json.loads((devstack.VAR / "run" / f"{name}.status.json").read_text())


def applied(client: redis.Redis, name: str) -> int:
    return int(client.hget(store.stats_key(name), "applied") or 0)


@pytest.mark.slow
def test_kill_9_of_the_ledger_mid_file_loses_and_repeats_nothing(cfg, ledger_config_path,
                                                                 ledger_redis, redis_url,
                                                                 usage_writer):
    """Five SIGKILLs at random moments while the edge writes (and rotates the file)."""
    events = workload(30_000, seed=21)
    for ev in events[:25_000]:
        usage_writer.write(ev)
    edge = EdgeWriter(usage_writer, events[25_000:], per_s=2000, rotate_at=2000)
    name = svc_name("test-ledger-kill9")
    rng = random.Random(5)
    mid_file_kills = 0
    svc = start_ledger(ledger_config_path, usage_writer.path, redis_url, name)
    edge.start()
    try:
        for _ in range(5):
            before = applied(ledger_redis, name)
            time.sleep(rng.uniform(0.05, 0.4))
            assert svc.proc is not None
            os.kill(svc.proc.pid, signal.SIGKILL)
            svc.proc.wait(5)
            now = applied(ledger_redis, name)
            assert now >= before
            mid_file_kills += 0 < now < len(events)
            svc = start_ledger(ledger_config_path, usage_writer.path, redis_url, name)
        edge.join()
        wait_until(lambda: applied(ledger_redis, name) == len(events), 60,
                   what="every event applied")
    finally:
        svc.stop()
    assert mid_file_kills >= 3
    assert_ledger_equals(ledger_redis, events, cfg)
    stats = ledger_redis.hgetall(store.stats_key(name))
    assert (stats["applied"], stats.get("duplicates", "0"), stats["bad_lines"]) == \
        (str(len(events)), "0", "0")
    seen = sum(ledger_redis.scard(k) for k in ledger_redis.scan_iter(store.seen_key("*")))
    assert seen == len(events)


@pytest.mark.slow
def test_redis_restart_under_a_running_ledger_loses_and_repeats_nothing(
        cfg, ledger_config_path, private_redis, usage_writer):
    """Redis with AOF (appendfsync always) killed with SIGKILL and restarted while the
    edge keeps writing: the ledger waits, then applies what it missed, once."""
    r: PrivateRedis = private_redis(persist=True)
    events = workload(6000, seed=22)
    edge = EdgeWriter(usage_writer, events, per_s=2000)
    name = svc_name("test-ledger-redis-restart")
    svc = start_ledger(ledger_config_path, usage_writer.path, r.url, name)
    client = r.client()
    try:
        edge.start()
        wait_until(lambda: applied(client, name) > 1000, what="some events applied")
        r.kill()
        wait_until(lambda: status(name)["redis_up"] is False, what="the ledger noticed")
        time.sleep(0.5)
        r.start()
        edge.join()
        client = r.client()
        wait_until(lambda: applied(client, name) == len(events), 60,
                   what="every event applied")
        assert svc.proc is not None and svc.proc.poll() is None
    finally:
        svc.stop()
    assert_ledger_equals(client, events, cfg)
    assert client.hget(store.stats_key(name), "duplicates") == "0"


@pytest.mark.slow
def test_redis_back_without_its_data_is_rebuilt_from_the_usage_files(
        cfg, ledger_config_path, private_redis, usage_writer):
    """No persistence: the ledger's checkpoint vanished with the counters, so it reads
    every usage file still on disk (rotated ones too) and the totals are whole again."""
    r = private_redis(persist=False)
    events = workload(3000, seed=23)
    name = svc_name("test-ledger-redis-empty")
    for ev in events[:1000]:
        usage_writer.write(ev)
    svc = start_ledger(ledger_config_path, usage_writer.path, r.url, name)
    try:
        wait_until(lambda: applied(r.client(), name) == 1000, what="first part applied")
        usage_writer.rotate()
        for ev in events[1000:2000]:
            usage_writer.write(ev)
        wait_until(lambda: applied(r.client(), name) == 2000, 30, what="second part applied")
        r.stop()
        r.start()
        for ev in events[2000:]:
            usage_writer.write(ev)
        wait_until(lambda: applied(r.client(), name) == 3000, 30, what="rebuilt")
    finally:
        svc.stop()
    assert_ledger_equals(r.client(), events, cfg)


def test_the_ledger_waits_for_a_usage_file_that_does_not_exist_yet(cfg, ledger_redis,
                                                                   redis_url, tmp_path):
    path = tmp_path / "later" / "usage.jsonl"
    led = Ledger(cfg, redis_client.connect(cfg.redis, url=redis_url), path, "later")
    assert led.step() is False
    writer = UsageWriter(path)
    ev = make_event(prompt_tokens=4, completion_tokens=2)
    writer.write(ev)
    assert led.drain().applied == 1
    assert_ledger_equals(ledger_redis, [ev], cfg)
    writer.close()
    led.close()


def test_once_applies_what_is_there_and_exits(cfg, config_path, ledger_redis, redis_url,
                                              usage_writer):
    events = workload(50, seed=51)
    for ev in events[:30]:
        usage_writer.write(ev)
    usage_writer.rotate()
    for ev in events[30:]:
        usage_writer.write(ev)
    argv = [sys.executable, "-m", "tokengate.ledger.service", "--config", str(config_path),
            "--usage-file", str(usage_writer.path), "--redis-url", redis_url, "--once"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "applied 50, duplicates 0, bad lines 0"
    assert_ledger_equals(ledger_redis, events, cfg)
    r = subprocess.run(argv[:-3] + ["--redis-url", "redis://127.0.0.1:1/0", "--once"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 1 and "Redis unavailable" in r.stderr


def utc_ts(seconds_ago: float = 0.0) -> str:
    """An event timestamp (RFC 3339 UTC, ms) ``seconds_ago`` before now."""
    t = datetime.now(UTC) - timedelta(seconds=seconds_ago)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def test_the_status_shows_the_real_lag_while_redis_is_down(ledger_config_path, private_redis,
                                                           usage_writer):
    """Events written while Redis is down wait in the file: the status says how many
    bytes and how old the oldest is (not zero), and both are 0 again once Redis is back
    and the events are applied."""
    r = private_redis(persist=True)
    name = svc_name("test-ledger-lag")
    svc = start_ledger(ledger_config_path, usage_writer.path, r.url, name)
    try:
        usage_writer.write(make_event(ts=utc_ts()))
        wait_until(lambda: (status(name)["applied"], status(name)["lag_bytes"],
                            status(name)["lag_s"]) == (1, 0, 0.0), what="caught up")
        r.kill()
        # the oldest waiting event was written 2.5 s ago: started 3 s ago, took 500 ms
        waiting = [make_event(ts=utc_ts(3.0), total_ms=500.0)] + \
            [make_event(ts=utc_ts()) for _ in range(20)]
        for ev in waiting:
            usage_writer.write(ev)
        size = sum(len(ev.to_json().encode()) + 1 for ev in waiting)
        wait_until(lambda: status(name)["redis_up"] is False
                   and status(name)["lag_bytes"] == size, what="the lag of the waiting events")
        s1 = status(name)
        assert s1["lag_s"] >= 2.5
        # still waiting, older by now (the status file is rewritten periodically: wait for
        # a refresh rather than guessing when it comes)
        wait_until(lambda: status(name)["lag_s"] >= s1["lag_s"] + 1.0 and
                   status(name)["lag_bytes"] == size, 10, what="the lag growing")
        r.start()
        wait_until(lambda: (status(name)["applied"], status(name)["lag_bytes"],
                            status(name)["lag_s"], status(name)["redis_up"])
                   == (1 + len(waiting), 0, 0.0, True), 30, what="applied after Redis is back")
    finally:
        svc.stop()


def test_a_key_created_while_the_ledger_runs_is_known_to_it_without_a_signal(
        ledger_config_path, tmp_path, private_redis, usage_writer):
    # `tokengate keys create` reloads the edges only: the ledger, which repairs failed
    # budget settlements of the keys it knows, must see the new key by itself
    config = tmp_path / "tokengate.yaml"
    raw = yaml.safe_load(ledger_config_path.read_text())
    raw["global_limits"]["enabled"] = True  # budgets live in Redis
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    r = private_redis()
    name = svc_name("test-ledger-watch")
    svc = start_ledger(config, usage_writer.path, r.url, name)
    try:
        wait_until(lambda: status(name).get("config_reloads") == 0, what="the first status")
        keys = status(name)["config_keys"]
        subprocess.run([sys.executable, "-m", "tokengate.cli", "keys", "create", "late",
                        "--rpm", "5", "--tpm", "500", "--budget", "day=1", "--config",
                        str(config), "--no-apply"], capture_output=True, check=True)
        wait_until(lambda: (status(name)["config_reloads"], status(name)["config_keys"])
                   == (1, keys + 1), what="the reload")
        assert "late" in tg_config.load(config).keys
        # an invalid edit is refused once and the previous configuration kept
        config.write_text(config.read_text() + "\nnot_a_section: 1\n")
        wait_until(lambda: "reload failed, billing with the previous configuration"
                   in svc.log_path.read_text(), what="the refusal")
        assert (status(name)["config_reloads"], status(name)["config_keys"]) == (1, keys + 1)
    finally:
        svc.stop()


@pytest.mark.unit
def test_the_lag_is_unknown_until_the_checkpoint_was_read(cfg, usage_writer):
    usage_writer.write(make_event())
    led = Ledger(cfg, redis_client.connect(cfg.redis, timeout_s=0.2, url="redis://127.0.0.1:1/0"),
                 usage_writer.path, "never-up")
    stop = threading.Event()
    worker = threading.Thread(target=led.run, args=(stop,), daemon=True)
    worker.start()
    time.sleep(0.6)
    stop.set()
    worker.join(10)
    assert (led.redis_up, led.lag_bytes, led.lag_s) == (False, None, None)
    led.close()


def test_sighup_bills_later_events_with_the_reloaded_prices(ledger_config_path, redis_url,
                                                            ledger_redis, usage_writer,
                                                            tmp_path):
    raw = yaml.safe_load(ledger_config_path.read_text())
    path = tmp_path / "tokengate.yaml"
    path.write_text(yaml.safe_dump(raw))
    name = svc_name("test-ledger-reload")
    svc = devstack.ledger_service(path, usage_writer.path, redis_url, ledger_id=name, name=name)
    svc.log_path.unlink(missing_ok=True)  # its lines from an earlier run
    svc.start()
    try:
        usage_writer.write(make_event(key_id="before", prompt_tokens=1000,
                                      completion_tokens=100))
        wait_until(lambda: applied(ledger_redis, name) == 1, 20, what="the first event")
        raw["models"]["tiny-qwen3"]["cost"] = {"input": 2.0, "output": 3.0, "cached": 0.5}
        path.write_text(yaml.safe_dump(raw))
        assert svc.proc is not None
        os.kill(svc.proc.pid, signal.SIGHUP)
        wait_until(lambda: "configuration reloaded" in svc.log_path.read_text(), 10,
                   what="the reload")
        usage_writer.write(make_event(key_id="after", prompt_tokens=1000,
                                      completion_tokens=100))
        wait_until(lambda: applied(ledger_redis, name) == 2, 20, what="the second event")
        assert svc.proc.poll() is None
    finally:
        svc.stop()
    cost = {r.key_id: r.cost for r in query(ledger_redis)}
    # (1000 x 1.0 + 100 x 1.35) / 1e6, then (1000 x 2.0 + 100 x 3.0) / 1e6
    assert cost == pytest.approx({"before": 0.001135, "after": 0.0023})


def test_an_open_budget_reservation_is_settled_once_from_its_event(
        config_path, ledger_redis, redis_url, usage_writer, tmp_path, monkeypatch):
    """The edge's settlement of a budget reservation failed (the limits sidecar or Redis
    was down when the request ended): the ledger settles it from the usage event with
    the real usage, exactly once, also when the batch's script fails after the
    settlement and runs again; one the edge settled, and a key without budgets, are
    left alone."""
    raw = yaml.safe_load(config_path.read_text())
    raw["keys"]["bk"] = {"sha256": key_digest("tg-test-bk"), "rpm": 10, "tpm": 100_000,
                         "budgets": [{"period": "day", "tokens": 1000}]}
    raw["global_limits"] = {"enabled": True, "listen": "127.0.0.1:1"}
    path = tmp_path / "tokengate.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    cfg = tg_config.load(path)
    hour, counter = this_hour(), f"*:day:{int(time.time() // 86400)}"
    reserve = ledger_redis.register_script(RESERVE_LUA)
    phantom = make_event(request_id="a" * 32, key_id="bk", prompt_tokens=100,
                         completion_tokens=7)
    settled = make_event(request_id="b" * 32, key_id="bk", prompt_tokens=50,
                         completion_tokens=5)
    for ev in (phantom, settled):  # each reserved 100 + 500 tokens
        assert reserve(keys=reserve_keys("bk", ev.request_id, [counter], hour),
                       args=[0, 600, IN_FLIGHT_TTL_S, hour, 0, 0, 0, 0, "0",
                             record_tail([(counter, 172_800)])])[0] == 1
    # the edge settled the second (55 tokens): the first stays in flight
    ledger_redis.set(f"tg:bg:{{bk}}:r:{'b' * 32}", "settled")
    s, t, _rs, rt, *_ = budget_keys("bk", counter, hour)
    ledger_redis.decrby(rt, 600)
    ledger_redis.set(t, 55)
    other = make_event(request_id="c" * 32, key_id="demo")
    for ev in (phantom, settled, other):
        usage_writer.write(ev)
    led = Ledger(cfg, redis_client.connect(cfg.redis, url=redis_url), usage_writer.path,
                 "test")
    apply = led._script
    calls = []

    def fails_once(**kw):
        calls.append(1)
        if len(calls) == 1:
            raise RedisConnectionError("lost after the settlement")
        return apply(**kw)

    monkeypatch.setattr(led, "_script", fails_once)
    with pytest.raises(RedisConnectionError):
        led.step()
    totals = led.drain()
    assert (totals.applied, totals.budgets_settled) == (3, 1)
    assert ledger_redis.get(f"tg:bg:{{bk}}:r:{'a' * 32}") == "settled"
    assert (int(ledger_redis.get(t)), int(ledger_redis.get(rt))) == (55 + 107, 0)
    assert int(ledger_redis.get(s)) == nano(Calculator(cfg).charge_event(phantom).cost)
    # a replay of the file (another ledger id) settles nothing again
    again = Ledger(cfg, redis_client.connect(cfg.redis, url=redis_url), usage_writer.path,
                   "replay").drain()
    assert (again.duplicates, again.budgets_settled) == (3, 0)
    assert int(ledger_redis.get(t)) == 55 + 107
