"""tokengate-limits: the global-limit sidecar, served over gRPC.

NAME
    tokengate-limits - shared RPM/TPM windows for every edge node, in Redis

SYNOPSIS
    tokengate-limits [--config FILE] [--listen HOST:PORT]... [--unix-socket PATH]
                     [--redis-url URL] [--workers N] [--metrics-listen HOST:PORT]

DESCRIPTION
    Serves tokengate.v1.GlobalLimits (proto/tokengate/v1/limits.proto): Reserve
    charges a request and its tokens against its API key's 60 s sliding window in
    Redis, atomically for all edges; Settle corrects the reservation with the real
    usage. The algorithm and key layout are in tokengate.limits.window.
    ReserveBudget and SettleBudget do the same for a key's budgets (spend and
    tokens per UTC day or month; tokengate.limits.budget). Also
    serves grpc.health.v1.Health: "tokengate.v1.GlobalLimits" is NOT_SERVING while
    Redis is failing.

    Redis down or slow: each call fails within 2 x redis.timeout_ms (default 250
    ms; a first try that timed out is tried again within that deadline, as a loaded
    host can be late with Redis up) with UNAVAILABLE, and for the next 500 ms every
    call gets UNAVAILABLE at once without touching Redis; then one call probes again.
    The edge falls back to its local limits on UNAVAILABLE (or its own deadline,
    edge.global_limits_timeout_ms).

    SIGHUP (systemctl reload) reloads the configuration: a changed redis section
    (url, timeout_ms, ...) gets a new Redis client, swapped in at once; calls in
    flight finish on the old one, closed 5 s later. The limits themselves come with
    each call from the edge, so a key's change needs no reload here.

    --workers N runs N processes (the GIL: one Python process serves a few thousand
    calls per second): all listen on the TCP addresses (SO_REUSEPORT) and, with
    --unix-socket PATH, worker i on PATH.<i> (mode 0660: the owner and the process's
    group, nginx's workers' group under the systemd unit); the parent restarts a
    worker that dies. Server reflection is served too. --listen none serves the unix
    sockets only: on a TCP port any local user could call Reserve and Settle.

    --metrics-listen (metrics.limits_listen) serves Prometheus /metrics: calls by
    method and gRPC code, their latency, and the calls answered UNAVAILABLE (the
    edge's fallbacks) by reason, summed over the workers.

EXIT STATUS
    0 after SIGTERM/SIGINT, 2 on a usage or configuration error.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from grpc_health.v1 import health
from prometheus_client import Counter, Histogram
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokengate import config as tg_config
from tokengate import grpc_server, metrics, redis_client
from tokengate import version as tg_version
from tokengate.limits.budget import BudgetCounter, GlobalBudgets
from tokengate.limits.window import GlobalLimiter, LevelWindow
from tokengate.v1 import limits_pb2, limits_pb2_grpc

log = logging.getLogger("tokengate.limits")

SERVICE = limits_pb2.DESCRIPTOR.services_by_name["GlobalLimits"].full_name
BACKOFF_S = 0.5
_LIMIT_ENUM = {None: limits_pb2.LIMIT_NONE, "requests": limits_pb2.LIMIT_REQUESTS,
               "tokens": limits_pb2.LIMIT_TOKENS}
_BUDGET_ENUM = {None: limits_pb2.BUDGET_NONE, "spend": limits_pb2.BUDGET_SPEND,
                "tokens": limits_pb2.BUDGET_TOKENS,
                "rebuilding": limits_pb2.BUDGET_REBUILDING}
# the uint32 fields of ReserveReply are durations within the 60 s window; every count
# and limit is a uint64 (limits.proto), as large as the schema allows (MAX_COUNT)
_U32 = 2**32 - 1
T = TypeVar("T")
S = TypeVar("S")  # a servicer
Q = TypeVar("Q")  # a request message

# Metrics (tokengate.metrics serves them, summed over the worker processes).
CALLS = Counter("tokengate_limits_calls_total",
                "GlobalLimits calls, by method (Reserve, Settle, ReserveBudget, "
                "SettleBudget, Quota) and gRPC status code (OK, INVALID_ARGUMENT, UNAVAILABLE).",
                ["method", "code"])
CALL_SECONDS = Histogram("tokengate_limits_call_duration_seconds",
                         "Time to answer a GlobalLimits call inside the sidecar (Redis "
                         "included), by method.", ["method"],
                         buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                  0.5, 1.0))
FALLBACKS = Counter("tokengate_limits_fallbacks_total",
                    "Calls answered UNAVAILABLE, so that the edge decides on its local "
                    "limits, by method and reason (redis_error: Redis failed or timed out "
                    "on this call; backoff: within 0.5 s of such a failure, Redis not "
                    "asked).", ["method", "reason"])
RETRIES = Counter("tokengate_limits_retries_total",
                  "Calls whose first Redis try timed out and that were tried again within "
                  "the call's deadline (2 x redis.timeout_ms), by method.", ["method"])


def _measured(rpc: Callable[[S, Q, grpc.aio.ServicerContext], Awaitable[T]]
              ) -> Callable[[S, Q, grpc.aio.ServicerContext], Awaitable[T]]:
    """The RPC method ``rpc`` with each call counted in CALLS by its gRPC code and timed
    in CALL_SECONDS, under the method's name."""
    method = rpc.__name__

    @functools.wraps(rpc)
    async def measured(self: S, request: Q, context: grpc.aio.ServicerContext) -> T:
        t0 = time.perf_counter()
        try:
            answer = await rpc(self, request, context)
        except BaseException:
            code = context.code()  # set by context.abort; None: an unexpected error
            CALLS.labels(method, code.name if isinstance(code, grpc.StatusCode)
                         else "INTERNAL").inc()
            raise
        finally:
            CALL_SECONDS.labels(method).observe(time.perf_counter() - t0)
        CALLS.labels(method, "OK").inc()
        return answer

    return measured


class GlobalLimitsService(limits_pb2_grpc.GlobalLimitsServicer):
    """Reserve / Settle over a ``GlobalLimiter``, ReserveBudget / SettleBudget over
    ``GlobalBudgets``, with one fail-fast breaker."""

    def __init__(self, limiter: GlobalLimiter, budgets: GlobalBudgets, timeout_s: float,
                 on_health: Callable[[bool], Awaitable[None]] | None = None) -> None:
        self.limiter = limiter
        self.budgets = budgets
        self.timeout_s = timeout_s
        self.down_until = 0.0       # monotonic time until which calls fail fast; 0: up
        self.on_health = on_health

    async def _call(self, method: str, coro_fn: Callable[[], Awaitable[T]],
                    context: grpc.aio.ServicerContext) -> T:
        """Run one Redis call under the breaker; aborts the RPC with UNAVAILABLE."""
        now = time.monotonic()
        if now < self.down_until:
            FALLBACKS.labels(method, "backoff").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "redis unavailable (backing off): use local limits")
        try:
            result = await self._redis(method, coro_fn)
        except (TimeoutError, RedisError, OSError) as e:
            if self.down_until == 0.0:
                log.warning("Redis unavailable (%s): answering UNAVAILABLE", e or type(e))
                await self._health(False)
            self.down_until = time.monotonic() + BACKOFF_S
            FALLBACKS.labels(method, "redis_error").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"redis unavailable: {e or 'timeout'}")
        if self.down_until:
            log.info("Redis is back")
            self.down_until = 0.0
            await self._health(True)
        return result

    async def _redis(self, method: str, coro_fn: Callable[[], Awaitable[T]]) -> T:
        """``coro_fn()`` within ``timeout_s`` (2 x redis.timeout_ms) in all. A first try
        that timed out (after redis.timeout_ms, the client's read timeout and this try's
        deadline: on a loaded host the
        reply, or this event loop, can be late with Redis up) is tried again in what is
        left; an error that says Redis is unreachable is not. Every method is idempotent
        by request id (window_reserve.lua, budget_reserve.lua and the settle scripts
        answer a repeated request id from its record), so a first try that did reach
        Redis is not counted twice. Raises what the last try raised."""
        deadline = time.monotonic() + self.timeout_s
        try:
            return await asyncio.wait_for(coro_fn(), self.timeout_s / 2)
        except (TimeoutError, RedisTimeoutError):
            left = deadline - time.monotonic()
            if left <= 0:
                raise
        RETRIES.labels(method).inc()
        return await asyncio.wait_for(coro_fn(), left)

    async def _health(self, up: bool) -> None:
        if self.on_health is not None:
            await self.on_health(up)

    @staticmethod
    async def _check(context: grpc.aio.ServicerContext, ok: bool, msg: str) -> None:
        if not ok:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg)

    @_measured
    async def Reserve(self, request: limits_pb2.ReserveRequest,
                      context: grpc.aio.ServicerContext) -> limits_pb2.ReserveReply:
        """See proto/tokengate/v1/limits.proto."""
        await self._validate(request.key_id, request.request_id, request.per_model,
                             request.model, context)
        await self._check(context, request.rpm_limit >= 1, "rpm_limit: must be >= 1")
        await self._check(context, request.tpm_limit >= 1, "tpm_limit: must be >= 1")
        model = request.model if request.per_model else None
        await self._check(context, all(lv.id and lv.id != request.key_id and lv.rpm_limit >= 1
                                       and lv.tpm_limit >= 1 for lv in request.levels),
                          "levels: each needs an id (not the key's) and limits >= 1")
        levels = [LevelWindow(lv.id, lv.rpm_limit, lv.tpm_limit) for lv in request.levels]
        r = await self._call("Reserve", lambda: self.limiter.reserve(
            request.key_id, model, request.rpm_limit, request.tpm_limit, request.tokens,
            request.request_id, levels), context)
        return limits_pb2.ReserveReply(
            admitted=r.admitted, limited_by=_LIMIT_ENUM[r.limited_by], never_fits=r.never_fits,
            remaining_requests=r.remaining_requests,
            remaining_tokens=r.remaining_tokens,
            reset_requests_ms=min(r.reset_requests_ms, _U32),
            reset_tokens_ms=min(r.reset_tokens_ms, _U32),
            retry_after_ms=min(r.retry_after_ms, _U32), level=r.level)

    @_measured
    async def Settle(self, request: limits_pb2.SettleRequest,
                     context: grpc.aio.ServicerContext) -> limits_pb2.SettleReply:
        """See proto/tokengate/v1/limits.proto."""
        await self._validate(request.key_id, request.request_id, request.per_model,
                             request.model, context)
        model = request.model if request.per_model else None
        s = await self._call("Settle", lambda: self.limiter.settle(
            request.key_id, model, request.request_id, request.actual_tokens,
            [lv.id for lv in request.levels if lv.id]), context)
        return limits_pb2.SettleReply(found=s.found, delta=s.delta,
                                      window_tokens=max(0, s.window_tokens))

    @_measured
    async def ReserveBudget(self, request: limits_pb2.BudgetReserveRequest,
                            context: grpc.aio.ServicerContext
                            ) -> limits_pb2.BudgetReserveReply:
        """See proto/tokengate/v1/limits.proto."""
        counters = await self._counters(request, context)
        r = await self._call("ReserveBudget", lambda: self.budgets.reserve(
            request.key_id, request.request_id, counters, request.cost_nano, request.tokens),
            context)
        return limits_pb2.BudgetReserveReply(
            admitted=r.admitted, refused=r.refused, limited_by=_BUDGET_ENUM[r.limited_by],
            usage=[limits_pb2.BudgetUsage(spent_nano=max(0, s), tokens=max(0, t))
                   for s, t in r.usage])

    @_measured
    async def SettleBudget(self, request: limits_pb2.BudgetSettleRequest,
                           context: grpc.aio.ServicerContext) -> limits_pb2.BudgetSettleReply:
        """See proto/tokengate/v1/limits.proto."""
        counters = await self._counters(request, context)
        applied, reserved = await self._call("SettleBudget", lambda: self.budgets.settle(
            request.key_id, request.request_id, counters, request.cost_nano, request.tokens),
            context)
        return limits_pb2.BudgetSettleReply(applied=applied, reserved=reserved)

    @_measured
    async def Quota(self, request: limits_pb2.QuotaRequest,
                    context: grpc.aio.ServicerContext) -> limits_pb2.QuotaReply:
        """See proto/tokengate/v1/limits.proto."""
        await self._check(context, bool(request.key_id), "key_id: required")
        levels = [lv.id for lv in request.levels]
        await self._check(context, all(levels), "levels: each needs an id")
        names = [c.name for c in request.counters]
        await self._check(context, all(names), "counters: each needs a name")

        async def read() -> tuple[list[tuple[int, int, int]],
                                  list[tuple[int, int, int, int]]]:
            return (await self.limiter.usage(request.key_id, levels),
                    await self.budgets.usage(request.key_id, names))

        windows, counters = await self._call("Quota", read, context)
        return limits_pb2.QuotaReply(
            windows=[limits_pb2.WindowUsage(requests=r, tokens=max(0, t),
                                            reset_ms=min(ms, _U32))
                     for r, t, ms in windows],
            counters=[limits_pb2.CounterUsage(spent_nano=max(0, s), tokens=max(0, t),
                                              reserved_nano=rs, reserved_tokens=rt)
                      for s, t, rs, rt in counters])

    async def _counters(self, request: limits_pb2.BudgetReserveRequest
                        | limits_pb2.BudgetSettleRequest,
                        context: grpc.aio.ServicerContext) -> list[BudgetCounter]:
        await self._validate(request.key_id, request.request_id, False, "", context)
        await self._check(context, len(request.counters) > 0, "counters: required")
        await self._check(context, all(c.name and c.ttl_s >= 1 for c in request.counters),
                          "counters: name and ttl_s (>= 1) required")
        return [BudgetCounter(c.name, c.spend_limit_nano, c.token_limit, c.ttl_s)
                for c in request.counters]

    async def _validate(self, key_id: str, request_id: str, per_model: bool, model: str,
                        context: grpc.aio.ServicerContext) -> None:
        await self._check(context, bool(key_id), "key_id: required")
        await self._check(context, bool(request_id) and not request_id.startswith("#"),
                          "request_id: required, must not start with '#'")
        await self._check(context, not per_model or bool(model),
                          "model: required when per_model is true")


async def _close_later(client: redis_client.AsyncRedis, after_s: float = 5.0) -> None:
    """Close a Redis client replaced by a reload once its calls in flight are over
    (each is bounded by the service's timeout)."""
    await asyncio.sleep(after_s)
    await client.aclose()


def _serve_worker(config_path: str | None, listen: grpc_server.Listen,
                  redis_url: str | None, index: int) -> None:
    """One worker process: serve until SIGTERM."""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s limits[{index}]: %(message)s")
    cfg = tg_config.load(config_path)
    timeout_s = cfg.redis.timeout_ms / 1000.0

    async def main() -> None:
        client = redis_client.connect_async(cfg.redis, timeout_s, url=redis_url)
        closing: set[asyncio.Task[None]] = set()  # reloads' old clients, until closed
        server = grpc.aio.server(options=grpc_server.OPTIONS)
        health_servicer = health.aio.HealthServicer()

        async def on_health(up: bool) -> None:
            await health_servicer.set(SERVICE, grpc_server.SERVING if up
                                      else grpc_server.NOT_SERVING)

        models = list(cfg.models)  # the scope "*" of the ledger's bill; reloaded

        service = GlobalLimitsService(GlobalLimiter(client),
                                      GlobalBudgets(client, lambda: models),
                                      timeout_s * 2, on_health)
        limits_pb2_grpc.add_GlobalLimitsServicer_to_server(service, server)
        current = cfg.redis

        def reload() -> None:
            nonlocal current, models
            loaded = tg_config.load(config_path)
            models = list(loaded.models)
            new = loaded.redis
            if new == current:
                log.info("configuration reloaded: the redis section is unchanged")
                return
            t = new.timeout_ms / 1000.0
            fresh = redis_client.connect_async(new, t, url=redis_url)
            old = service.limiter.client
            service.limiter = GlobalLimiter(fresh)
            service.budgets = GlobalBudgets(fresh, lambda: models)
            service.timeout_s, current = t * 2, new
            task = asyncio.get_running_loop().create_task(_close_later(old))
            closing.add(task)
            task.add_done_callback(closing.discard)
            log.info("configuration reloaded: Redis %s", redis_url or new.url)

        def ready(addresses: list[str]) -> None:
            log.info("serving GlobalLimits on %s (Redis %s)", ", ".join(addresses),
                     redis_url or cfg.redis.url)

        await grpc_server.serve_async(server, [SERVICE], listen, index, grace_s=1.0,
                                      on_ready=ready, servicer=health_servicer,
                                      on_reload=reload)
        await service.limiter.client.aclose()

    asyncio.run(main())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tokengate-limits", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None,
                        help=f"tokengate.yaml ({tg_config.LOOKUP_HELP})")
    parser.add_argument("--listen", action="append", default=None, metavar="HOST:PORT",
                        help="TCP address, repeatable (default: global_limits.listen); "
                             "'none': unix sockets only (needs --unix-socket)")
    parser.add_argument("--unix-socket", default=None, metavar="PATH",
                        help="also listen on PATH.<i> per worker i (default: "
                             "global_limits.unix_socket; 'none': TCP only)")
    parser.add_argument("--redis-url", default=None, type=tg_config.redis_url_arg,
                        help="Redis URL (default: redis.url)")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="worker processes (default: 1)")
    parser.add_argument("--metrics-listen", default=None, metavar="HOST:PORT",
                        help="serve Prometheus /metrics there, all workers summed "
                             "(default: metrics.limits_listen; 'none': off)")
    args = parser.parse_args(argv)
    cfg = tg_config.load_or_exit(parser, args.config)
    if args.unix_socket is None and cfg.global_limits.unix_socket is not None:
        args.unix_socket = str(cfg.global_limits.unix_socket)
    elif args.unix_socket == "none":
        args.unix_socket = None
    tcp = tuple(a for a in args.listen or [cfg.global_limits.listen] if a != "none")
    if not tcp and args.unix_socket is None:
        parser.exit(2, "tokengate-limits: --listen none needs a unix socket\n")
    try:
        listen = grpc_server.Listen(tcp, args.unix_socket)
    except ValueError as e:
        parser.exit(2, f"tokengate-limits: {e}\n")
    print(f"tokengate-limits {tg_version.describe()}: starting", flush=True)
    metrics.serve(args.metrics_listen or cfg.metrics.limits_listen, "limits", args.workers)
    grpc_server.run_workers("limits", _serve_worker, (args.config, listen, args.redis_url),
                            args.workers)


if __name__ == "__main__":
    main()
