"""The recipe of docs/operators/redis-durability.md, step by step against a real redis-server 7.0
(Debian's): an online backup with ``redis-cli --rdb``, then a restore into an
append-only Redis that lost its data. What tokengate keeps there (the bill, budgets'
spend, the ledger's checkpoints) comes back as it was at the backup; the ledger then
re-applies the usage file's later events from its checkpoint, once each."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import redis

from tests.fixtures_ledger import PrivateRedis, wait_until


def cli(r: PrivateRedis, *args: str) -> str:
    return subprocess.run(["redis-cli", "-p", str(r.port), *args], capture_output=True,
                          text=True, timeout=60, check=True).stdout.strip()


def test_a_backup_restores_into_an_append_only_redis_that_lost_its_data(
        private_redis: Callable[..., PrivateRedis], tmp_path: Path) -> None:
    r = private_redis(persist=True)
    c: redis.Redis = r.client()
    c.hset("tg:{ledger}:ckpt:edge-1", mapping={"pos": "usage.jsonl:4096"})
    c.incrbyfloat("tg:{budget}:spend:demo:2026-12-05", 0.25)
    c.set("tg:{ledger}:stats:edge-1", "applied=12")
    want = {k: c.dump(k) for k in c.keys("*")}

    # backup, online: an RDB of the whole data set streamed to a file of the operator's
    backup = tmp_path / "backup" / "tokengate.rdb"
    backup.parent.mkdir()
    subprocess.run(["redis-cli", "-p", str(r.port), "--rdb", str(backup)],
                   capture_output=True, timeout=60, check=True)
    assert backup.stat().st_size > 0

    # the loss: a Redis whose data is gone (a new disk, a FLUSHALL, a wrong volume)
    c.flushall()
    r.stop()
    assert [p.name for p in r.data_dir.iterdir()] == ["appendonlydir"]

    # restore: the snapshot in place of the append-only files, loaded with appendonly
    # off, then the AOF turned on again (rewritten from the restored data)
    shutil.rmtree(r.data_dir / "appendonlydir")
    shutil.copyfile(backup, r.data_dir / "dump.rdb")
    r.persist = False
    r.start()
    assert cli(r, "CONFIG", "SET", "appendonly", "yes") == "OK"
    c = r.client()
    assert {k: c.dump(k) for k in c.keys("*")} == want
    assert cli(r, "CONFIG", "GET", "appendonly").splitlines() == ["appendonly", "yes"]
    # the rewrite runs in the background: done before Redis may stop
    wait_until(lambda: {"aof_rewrite_in_progress:0", "aof_rewrite_scheduled:0"}
               <= set(cli(r, "INFO", "persistence").splitlines()), 30,
               what="the append-only file's rewrite")

    # and it stays: a restart with the append-only file alone keeps the data
    r.persist = True
    r.stop()
    (r.data_dir / "dump.rdb").unlink()
    r.start()
    c = r.client()
    assert {k: c.dump(k) for k in c.keys("*")} == want
