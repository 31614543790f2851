"""Redis clients of the sidecars, built one way from ``redis:`` in tokengate.yaml.

The ledger (blocking) and the global-limit sidecar (asyncio) talk to the same Redis or
Redis Cluster with the same rules: connect and read timeouts of ``timeout_s`` seconds,
decoded (str) replies, and no hidden retries, so callers decide how long to wait and
what to do when Redis is down. A cluster client may retry once, to follow a topology
change (MOVED, failover); a single node is never retried.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.retry
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from tokengate.config import RedisConfig

SyncRedis = redis.Redis | redis.cluster.RedisCluster
AsyncRedis = redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster


def _options(cfg: RedisConfig, timeout_s: float) -> tuple[int, dict[str, Any]]:
    """(retries, keyword arguments) shared by both clients."""
    return (1 if cfg.cluster else 0), {"socket_timeout": timeout_s,
                                       "socket_connect_timeout": timeout_s,
                                       "decode_responses": True}


def connect(cfg: RedisConfig, timeout_s: float = 5.0, url: str | None = None) -> SyncRedis:
    """A blocking client for ``url`` (default ``cfg.url``); Redis Cluster when
    ``cfg.cluster``. ``timeout_s``: connect and read timeout, seconds."""
    retries, kw = _options(cfg, timeout_s)
    cls = redis.cluster.RedisCluster if cfg.cluster else redis.Redis
    return cls.from_url(url or cfg.url, retry=Retry(NoBackoff(), retries), **kw)


def connect_async(cfg: RedisConfig, timeout_s: float, url: str | None = None) -> AsyncRedis:
    """The asyncio counterpart of ``connect``."""
    retries, kw = _options(cfg, timeout_s)
    cls = redis.asyncio.cluster.RedisCluster if cfg.cluster else redis.asyncio.Redis
    return cls.from_url(url or cfg.url, retry=redis.asyncio.retry.Retry(NoBackoff(), retries),
                        **kw)
