"""The sections of the Python sidecars: ``redis`` (where the ledger and the global
limits keep their state), ``ledger`` (``tokengate-ledger``; its ``console``:
``tokengate.config.console``), ``global_limits`` (``tokengate-limits``), ``metrics``
(their Prometheus endpoints) and ``tracing`` (the OTLP export of the edge's spans)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, field_validator, model_validator

from tokengate.config.console import ConsoleConfig
from tokengate.config.types import (
    MAX_COUNT,
    Finite,
    HostPort,
    LoopbackHostPort,
    OptionalPath,
    Positive,
    Rate,
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
        default=250,
        description="Connect/read timeout of the global-limit path, ms (the limits "
                    "sidecar's Redis deadline is twice this: a first try that times out "
                    "is tried again within it). 50 ms made the global tier fall back to "
                    "local limits 1,779 times in a 17-minute soak on a loaded 2-core host "
                    "with Redis up; the event loops there are late by tens of ms.")


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
    session_days: int = Field(
        default=30, ge=1, le=36500,
        description="Per-session totals are kept this long after the session's last "
                    "request, days (`tokengate usage --by session`, the console).")
    sessions_per_key: Positive = Field(
        default=1000,
        description="Sessions a key's index keeps, most recently seen first; older ones "
                    "leave the index (their totals expire after session_days).")
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
        default=300.0, gt=0.0, le=MAX_COUNT, allow_inf_nan=False,
        description="Engine records whose edge event has not come this long after they "
                    "were written (an nginx worker killed mid-stream writes none) are "
                    "billed to the API key they name (counted as orphans), or dropped and "
                    "counted as unmatched when they name none, s.")
    console: ConsoleConfig = Field(
        default_factory=ConsoleConfig,
        description="The operator console (tokengate-console; no login without admins).")


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


def _otlp_endpoint(value: str) -> str:
    """An OTLP collector's URL: http:// (plaintext) or https:// (TLS), a host and a port;
    a path only for OTLP/HTTP (``/v1/traces`` when none is given)."""
    u = urlsplit(value)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"expected http://host:port or https://host:port, got {value!r}")
    if any(not " " < c < "\x7f" for c in value):
        raise ValueError(f"{value!r} holds a space, a control or a non-ASCII character")
    try:
        port = u.port
    except ValueError:
        raise ValueError(f"{value!r}: the port is not in 1..65535") from None
    if port is None:
        raise ValueError(f"{value!r} names no port (OTLP's are 4317 for gRPC, 4318 for HTTP)")
    if u.query or u.fragment or u.username or u.password:
        raise ValueError(f"{value!r}: no query, fragment or credentials (use headers)")
    return value


OtlpEndpoint = Annotated[str, AfterValidator(_otlp_endpoint)]


def _printable(value: str) -> str:
    """Printable ASCII only: what gRPC metadata, HTTP headers and OpenTelemetry's
    resource attributes carry without loss."""
    if not value or any(not " " <= c < "\x7f" for c in value):
        raise ValueError(f"{value!r}: expected printable ASCII, not empty")
    return value


Printable = Annotated[str, AfterValidator(_printable)]
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")


class TracingConfig(_Schema):
    """OpenTelemetry traces of the edge's requests (``tracing``): the edge starts or
    continues a W3C trace for every request, forwards it to vLLM and writes the span data
    into the request's usage event; the ledger, off the request path, exports the spans
    over OTLP (``tokengate.ledger.tracing``). A collector that is down or slow loses spans
    (counted), never requests."""

    enabled: bool = Field(
        default=False,
        description="Trace requests: the edge sends `traceparent` to vLLM and back to "
                    "the client and records spans; the ledger exports them. Start vLLM "
                    "with `--otlp-traces-endpoint` at the same collector to get its span "
                    "in the same trace.")
    endpoint: OtlpEndpoint = Field(
        default="http://127.0.0.1:4317",
        description="The OTLP collector: http://host:port (plaintext) or https:// (TLS); "
                    "for http/protobuf the path (default /v1/traces) too.")
    protocol: Literal["grpc", "http/protobuf"] = Field(
        default="grpc",
        description="OTLP transport: grpc (port 4317) or http/protobuf (port 4318).")
    headers: dict[str, Printable] = Field(
        default={},
        description="Headers sent with every export (for example an authorization "
                    "token); kept out of the edge's compiled file.")
    timeout_s: Annotated[float, Field(gt=0.0, le=300.0, allow_inf_nan=False)] = Field(
        default=10.0,
        description="Longest one export (with the exporter's retries) may take, seconds; "
                    "spans that wait meanwhile stay queued up to max_queue_spans.")
    sample_ratio: Rate = Field(
        default=1.0,
        description="Share of new traces recorded (by the trace id, as OpenTelemetry's "
                    "TraceIdRatioBased); a request with a `traceparent` follows its "
                    "sampled flag; errors, refusals and aborted requests are always kept.")
    service_name: Printable = Field(
        default="tokengate",
        description="The spans' service.name resource attribute.")
    resource_attributes: dict[Printable, Printable] = Field(
        default={},
        description="More resource attributes of every span (deployment.environment, "
                    "service.instance.id, ...).")
    max_queue_spans: Annotated[int, Field(ge=1, le=1_000_000)] = Field(
        default=8192,
        description="Spans held for export; beyond it new spans are dropped (counted: "
                    "tokengate_trace_spans_lost_total{reason=\"queue_full\"}).")
    batch_spans: Annotated[int, Field(ge=1, le=100_000)] = Field(
        default=512,
        description="Most spans per export call.")
    schedule_delay_ms: Annotated[int, Field(ge=1, le=600_000)] = Field(
        default=1000,
        description="Longest a span waits for its batch to fill before it is exported, ms.")
    @field_validator("headers")
    @classmethod
    def _header_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not _HEADER_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not an HTTP header name")
        return value

    @field_validator("resource_attributes")
    @classmethod
    def _not_the_service_name(cls, value: dict[str, str]) -> dict[str, str]:
        if "service.name" in value:
            raise ValueError("service.name is tracing.service_name")
        return value

    @model_validator(mode="after")
    def _grpc_has_no_path(self) -> TracingConfig:
        path = urlsplit(self.endpoint).path
        if self.protocol == "grpc" and path not in ("", "/"):
            raise ValueError(f"endpoint: a gRPC collector is host:port only, got path "
                             f"{path!r} (a path is for protocol http/protobuf)")
        return self
