"""The one YAML configuration (``tokengate.yaml``): models, API keys, limits.

Every sidecar and the edge read the same file; the edge reads a compiled JSON form
of it (see ``tokengate.tools.compile_config``). Relative paths are resolved against
the directory of the YAML file.

Shapes::

    models:
      <served model name>:
        dir: <model directory: tokenizer.json + tokenizer_config.json>
        vocab: auto | hf | qwen3.6
        max_model_len: <tokens>
        output_reserve: <tokens reserved when max_tokens is absent>
        max_tokens_cap: <tokens, optional server-side cap>
        upstream: <host:port of the vLLM server>
        cost: {input: <per 1M tokens>, output: <...>, cached: <...>}
    currency: USD
    keys:
      <key id>:
        sha256: <hex digest of the API key>
        rpm: <requests per minute>
        tpm: <tokens per minute>
        models: {<model>: {rpm: .., tpm: ..}}   # optional per-model overrides
    redis:                       # ledger and global limits (optional section)
      url: redis://127.0.0.1:6380/0
      cluster: false             # true: Redis Cluster (keys carry hash tags)
      timeout_ms: 50             # connect/read timeout of the global-limit path
    billing:                     # see tokengate.ledger.calculator
      exclude_system_tokens: false
      context_penalty: {threshold: 32768, rate: 0.00015}
    ledger:
      usage_file: var/usage/usage.jsonl
      dedupe_days: 8             # request ids remembered for replays, days
      audit_maxlen: 100000       # approximate bound of the audit stream, entries
      rotate_wait_s: 5.0         # read a rotated file this long after its last write
    global_limits:
      enabled: false             # the edge reserves in Redis too (several edges)
      listen: 127.0.0.1:50061    # tokengate-limits gRPC address
      unix_socket: var/run/limits.sock   # optional; worker i listens on <path>.<i>
    access_log:                  # tiered sampling, see tokengate.ledger.sampling
      error_status: 400          # status >= this: always logged
      slow_ms: 5000              # total_ms > this: logged at slow_rate
      slow_rate: 0.1
      rate: 0.01                 # everything else

Errors: ``ConfigError`` with the path of the offending field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "tokengate.yaml"
VOCABS = ("auto", "hf", "qwen3.6")


class ConfigError(ValueError):
    """The configuration file is invalid; the message names the field."""


@dataclass(frozen=True)
class ModelCost:
    """Billing weights, in the configured currency per 1M tokens."""

    input: float = 1.0
    output: float = 1.35
    cached: float = 0.1


@dataclass(frozen=True)
class ModelConfig:
    """One served model."""

    name: str
    dir: Path
    max_model_len: int
    output_reserve: int = 256
    max_tokens_cap: int | None = None
    vocab: str = "auto"
    upstream: str = "127.0.0.1:8000"
    cost: ModelCost = field(default_factory=ModelCost)


@dataclass(frozen=True)
class Limits:
    """Per-minute limits: requests (RPM) and tokens (TPM)."""

    rpm: int
    tpm: int


@dataclass(frozen=True)
class KeyConfig:
    """One API key, identified by ``id``; only its SHA-256 digest is stored."""

    id: str
    sha256: str
    limits: Limits
    model_limits: dict[str, Limits] = field(default_factory=dict)


@dataclass(frozen=True)
class RedisConfig:
    """Where the ledger and the global limits keep their state."""

    url: str = "redis://127.0.0.1:6380/0"
    cluster: bool = False
    timeout_ms: int = 50


@dataclass(frozen=True)
class ContextPenalty:
    """Long-context surcharge on billed input: above ``threshold`` prompt tokens each
    billed input token counts ``1 + rate * (prompt_tokens - threshold)`` times."""

    threshold: int = 32768
    rate: float = 0.00015


@dataclass(frozen=True)
class BillingConfig:
    """Billing options shared by every model (weights are per model, ``ModelCost``)."""

    exclude_system_tokens: bool = False
    context_penalty: ContextPenalty = field(default_factory=ContextPenalty)


@dataclass(frozen=True)
class LedgerConfig:
    """The usage ledger sidecar (``tokengate-ledger``)."""

    usage_file: Path = Path("var/usage/usage.jsonl")
    dedupe_days: int = 8
    audit_maxlen: int = 100_000
    rotate_wait_s: float = 5.0


@dataclass(frozen=True)
class GlobalLimitsConfig:
    """The global-limit sidecar (``tokengate-limits``) and whether the edge uses it."""

    enabled: bool = False
    listen: str = "127.0.0.1:50061"
    unix_socket: Path | None = None


@dataclass(frozen=True)
class AccessLogConfig:
    """Tiered access-log sampling (usage events are never sampled)."""

    error_status: int = 400
    slow_ms: float = 5000.0
    slow_rate: float = 0.1
    rate: float = 0.01


@dataclass(frozen=True)
class Config:
    """The whole configuration file, parsed and validated."""

    path: Path
    models: dict[str, ModelConfig]
    keys: dict[str, KeyConfig]
    currency: str = "USD"
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    redis: RedisConfig = field(default_factory=RedisConfig)
    billing: BillingConfig = field(default_factory=BillingConfig)
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    global_limits: GlobalLimitsConfig = field(default_factory=GlobalLimitsConfig)
    access_log: AccessLogConfig = field(default_factory=AccessLogConfig)


def _int(value: Any, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value


def _limits(raw: Any, where: str) -> Limits:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping with rpm and tpm")
    return Limits(rpm=_int(raw.get("rpm"), f"{where}.rpm", 1),
                  tpm=_int(raw.get("tpm"), f"{where}.tpm", 1))


def _section(raw: dict[str, Any], name: str) -> dict[str, Any]:
    sec = raw.get(name) or {}
    if not isinstance(sec, dict):
        raise ConfigError(f"{name}: expected a mapping")
    return sec


def _number(value: Any, where: str, minimum: float = 0.0, maximum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum \
            or (maximum is not None and value > maximum):
        bound = f" and <= {maximum}" if maximum is not None else ""
        raise ConfigError(f"{where}: expected a number >= {minimum}{bound}, got {value!r}")
    return float(value)


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return value


def _ledger_sections(raw: dict[str, Any], base: Path) -> dict[str, Any]:
    """The optional sections read by the ledger, the global limits and the access log."""
    r = _section(raw, "redis")
    redis = RedisConfig(url=str(r.get("url", RedisConfig.url)),
                        cluster=_bool(r.get("cluster", False), "redis.cluster"),
                        timeout_ms=_int(r.get("timeout_ms", 50), "redis.timeout_ms", 1))
    b = _section(raw, "billing")
    cp = b.get("context_penalty") or {}
    if not isinstance(cp, dict):
        raise ConfigError("billing.context_penalty: expected a mapping")
    billing = BillingConfig(
        exclude_system_tokens=_bool(b.get("exclude_system_tokens", False),
                                    "billing.exclude_system_tokens"),
        context_penalty=ContextPenalty(
            threshold=_int(cp.get("threshold", 32768), "billing.context_penalty.threshold", 0),
            rate=_number(cp.get("rate", 0.00015), "billing.context_penalty.rate")))
    ld = _section(raw, "ledger")
    ledger = LedgerConfig(
        usage_file=(base / str(ld.get("usage_file", LedgerConfig.usage_file))).resolve(),
        dedupe_days=_int(ld.get("dedupe_days", 8), "ledger.dedupe_days", 1),
        audit_maxlen=_int(ld.get("audit_maxlen", 100_000), "ledger.audit_maxlen", 1),
        rotate_wait_s=_number(ld.get("rotate_wait_s", 5.0), "ledger.rotate_wait_s"))
    gl = _section(raw, "global_limits")
    sock = gl.get("unix_socket")
    global_limits = GlobalLimitsConfig(
        enabled=_bool(gl.get("enabled", False), "global_limits.enabled"),
        listen=str(gl.get("listen", GlobalLimitsConfig.listen)),
        unix_socket=(base / str(sock)).resolve() if sock else None)
    al = _section(raw, "access_log")
    access_log = AccessLogConfig(
        error_status=_int(al.get("error_status", 400), "access_log.error_status", 100),
        slow_ms=_number(al.get("slow_ms", 5000), "access_log.slow_ms"),
        slow_rate=_number(al.get("slow_rate", 0.1), "access_log.slow_rate", 0.0, 1.0),
        rate=_number(al.get("rate", 0.01), "access_log.rate", 0.0, 1.0))
    return {"redis": redis, "billing": billing, "ledger": ledger,
            "global_limits": global_limits, "access_log": access_log}


def load(path: str | os.PathLike[str] | None = None) -> Config:
    """Read and validate the configuration.

    ``path`` defaults to ``$TOKENGATE_CONFIG`` or the repository's ``tokengate.yaml``.
    Raises ``ConfigError`` (naming the field) or ``OSError``.
    """
    p = Path(path or os.environ.get("TOKENGATE_CONFIG") or DEFAULT_CONFIG).resolve()
    raw = yaml.safe_load(p.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: top level must be a mapping")
    base = p.parent
    models: dict[str, ModelConfig] = {}
    for name, m in (raw.get("models") or {}).items():
        where = f"models.{name}"
        if not isinstance(m, dict) or "dir" not in m:
            raise ConfigError(f"{where}.dir: required")
        vocab = m.get("vocab", "auto")
        if vocab not in VOCABS:
            raise ConfigError(f"{where}.vocab: one of {', '.join(VOCABS)}, got {vocab!r}")
        cap = m.get("max_tokens_cap")
        cost = m.get("cost") or {}
        models[name] = ModelConfig(
            name=name,
            dir=(base / m["dir"]).resolve(),
            max_model_len=_int(m.get("max_model_len"), f"{where}.max_model_len", 1),
            output_reserve=_int(m.get("output_reserve", 256), f"{where}.output_reserve", 1),
            max_tokens_cap=None if cap is None else _int(cap, f"{where}.max_tokens_cap", 1),
            vocab=vocab,
            upstream=str(m.get("upstream", "127.0.0.1:8000")),
            cost=ModelCost(**{k: float(v) for k, v in cost.items()}),
        )
    keys: dict[str, KeyConfig] = {}
    for key_id, k in (raw.get("keys") or {}).items():
        where = f"keys.{key_id}"
        if not isinstance(k, dict):
            raise ConfigError(f"{where}: expected a mapping")
        digest = str(k.get("sha256", "")).lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ConfigError(f"{where}.sha256: expected 64 hex digits")
        per_model = {
            mname: _limits(ml, f"{where}.models.{mname}")
            for mname, ml in (k.get("models") or {}).items()
        }
        keys[key_id] = KeyConfig(key_id, digest, _limits(k, where), per_model)
    return Config(path=p, models=models, keys=keys,
                  currency=str(raw.get("currency", "USD")), raw=raw,
                  **_ledger_sections(raw, base))
