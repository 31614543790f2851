"""The sections of the Python sidecars: ``redis`` (where the ledger and the global
limits keep their state), ``ledger`` (``tokengate-ledger``; its ``console``:
``tokengate.config.console``), ``global_limits``
(``tokengate-limits``) and ``metrics`` (their Prometheus endpoints)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from tokengate.config.console import ConsoleConfig
from tokengate.config.types import (
    MAX_COUNT,
    Finite,
    HostPort,
    LoopbackHostPort,
    OptionalPath,
    Positive,
    RedisUrl,
    RelPath,
    _Schema,
)


class RedisConfig(_Schema):
    """Where the ledger and the global limits keep their state."""

    url: RedisUrl = Field(
        default="redis://127.0.0.1:6380/0",
        description="Redis URL (redis://, rediss:// or unix://).")
    cluster: bool = Field(
        default=False,
        description="Redis Cluster (every key carries a hash tag).")
    timeout_ms: Positive = Field(
        default=50,
        description="Connect/read timeout of the global-limit path, ms (the limits "
                    "sidecar's Redis deadline is twice this).")


class LedgerConfig(_Schema):
    """The usage ledger sidecar (``tokengate-ledger``)."""

    usage_file: RelPath = Field(
        default=Path("var/usage/usage.jsonl"), validate_default=True,
        description="Usage event file the ledger tails.")
    dedupe_days: int = Field(
        default=8, ge=1, le=36500,
        description="Request ids remembered against replays, days (at most 36500: the "
                    "Redis expiry of a day's ids stays within its int64 ms clock).")
    audit_maxlen: Positive = Field(
        default=100_000,
        description="Approximate bound of the audit stream, entries.")
    rotate_wait_s: Finite = Field(
        default=5.0,
        description="Keep reading a rotated file this long after its last write, s.")
    engine_usage_files: list[RelPath] = Field(
        default=[],
        description="Engine usage files of the vLLM plugin (`TOKENGATE_ENGINE_USAGE_FILE`): "
                    "the ledger joins their records with the edge's events by request id "
                    "and bills the engine's numbers. Empty: the edge's numbers, at once. "
                    "One list for every host: a file that does not exist here is waited "
                    "for; on a vLLM host run `tokengate-ledger --engine-only`.")
    engine_wait_s: Finite = Field(
        default=5.0,
        description="How long an edge event waits for its engine records before it is "
                    "billed with its own numbers (counted as engine_missing), s.")
    engine_orphan_s: float = Field(
        default=3600.0, gt=0.0, le=MAX_COUNT, allow_inf_nan=False,
        description="Engine records whose edge event has not come after this long are "
                    "dropped and counted as unmatched (not billed), s.")
    console: ConsoleConfig = Field(
        default_factory=ConsoleConfig,
        description="The operator console the ledger serves (off without admins).")


class GlobalLimitsConfig(_Schema):
    """The global-limit sidecar (``tokengate-limits``) and whether the edge uses it."""

    enabled: bool = Field(
        default=False,
        description="The edge also reserves in Redis: one RPM/TPM window per key and the "
                    "keys' budgets, shared by every edge.")
    listen: HostPort = Field(
        default="127.0.0.1:50061",
        description="host:port of tokengate-limits (gRPC).")
    unix_socket: OptionalPath = Field(
        default=None,
        description="Unix socket of tokengate-limits: worker i listens on `<path>.<i>`. "
                    "null: TCP only.")


class MetricsConfig(_Schema):
    """Prometheus endpoints (``/metrics``, text format) of the sidecars, each on a
    loopback port of its own; the edge's ``/metrics`` is on ``edge.status_listen``."""

    counter_listen: LoopbackHostPort | None = Field(
        default="127.0.0.1:8082",
        description="Loopback host:port of tokengate-counter's metrics (all its worker "
                    "processes together). null: none.")
    ledger_listen: LoopbackHostPort | None = Field(
        default="127.0.0.1:8083",
        description="Loopback host:port of tokengate-ledger's metrics. null: none.")
    limits_listen: LoopbackHostPort | None = Field(
        default="127.0.0.1:8084",
        description="Loopback host:port of tokengate-limits' metrics (all its worker "
                    "processes together). null: none.")
