"""Field types shared by the sections of ``tokengate.yaml``: paths resolved against the
file's folder, addresses, digests, origins, bounded numbers, and ``_Schema``, the base
of every section (frozen, strict, unknown keys refused).

A validator raises ``ValueError`` with the message shown after the key's dotted path;
one that checks several keys at once raises ``_Rules`` (``_check``), whose (path,
message) pairs ``tokengate.config.loading.errors_of`` turns into one line each.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationInfo,
    WithJsonSchema,
)


class _Rules(ValueError):
    """Raised by a validator that checks several keys at once: ``problems`` are
    (dotted path relative to the model being validated, message) pairs, so the error
    names the key to change rather than the section that holds it."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{p}: {m}" for p, m in problems))


def _check(problems: list[tuple[str, str]]) -> None:
    if problems:
        raise _Rules(problems)


# --- field types ---------------------------------------------------------------------

def _resolve(value: Path, info: ValidationInfo) -> Path:
    """Relative to the YAML's folder (``context["base"]``); models built in Python
    without that context keep the path as given."""
    base = (info.context or {}).get("base")
    return (base / value).resolve() if base is not None else value


def _optional_path(value: Any, info: ValidationInfo) -> Path | None:
    if value is None or value is False or value == "":
        return None
    if isinstance(value, (str, Path)):
        return _resolve(Path(value), info)
    raise ValueError(f"expected a path, or false for none, got {value!r}")


def _host_port(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port (port 1..65535), got {value!r}")
    return value


def _is_loopback(host_port: str) -> bool:
    host = host_port.rpartition(":")[0].strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _loopback_host_port(value: str) -> str:
    if not _is_loopback(value):
        raise ValueError(f"expected a loopback address (127.0.0.1:PORT, [::1]:PORT), "
                         f"got {value!r}")
    return value


def _network(value: str) -> str:
    try:
        return str(ipaddress.ip_network(value))
    except ValueError as e:
        raise ValueError(f"expected an address or CIDR network (10.0.0.0/8, 2001:db8::/32): "
                         f"{e}") from None


def _sha256(value: str) -> str:
    digest = value.lower()
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError("expected the key's SHA-256 as 64 hex digits "
                         "(printf %s \"$KEY\" | sha256sum)")
    return digest


# An origin as browsers send it in the Origin header (RFC 6454 §6.1): scheme, host and an
# optional port, lowercase, nothing after them.
_ORIGIN = re.compile(r"https?://(\[[0-9a-f:.]+\]|[a-z0-9]([a-z0-9.-]*[a-z0-9])?)(:[0-9]{1,5})?")


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin(value: str) -> str:
    origin = value.lower()
    if origin == "*":
        return origin
    m = _ORIGIN.fullmatch(origin)
    if not m:
        raise ValueError(f"expected an origin such as https://app.example.com or "
                         f"http://localhost:3000 (scheme, host, optional port; no path), or "
                         f"*, got {value!r}")
    if m.group(3):
        port, scheme = int(m.group(3)[1:]), origin.split(":", 1)[0]
        if not 0 < port < 65536:
            raise ValueError(f"port {port} is not 1..65535 in {value!r}")
        if port == _DEFAULT_PORTS[scheme]:
            # browsers leave a scheme's default port out of Origin (RFC 6454 §6.2)
            raise ValueError(f"browsers send {origin.rsplit(':', 1)[0]!r}, never the "
                             f"default port: list it without ':{port}'")
    return origin


def _redis_url(value: str) -> str:
    if not value.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"expected a redis://, rediss:// or unix:// URL, got {value!r}")
    return value


def redis_url_arg(value: str) -> str:
    """argparse ``type=`` of a ``--redis-url`` option: ``value`` when it is a redis://,
    rediss:// or unix:// URL (what ``redis.url`` accepts), else
    ``argparse.ArgumentTypeError``: a usage line and exit status 2 before the command
    changes anything (redis-py's own ValueError came later, as a traceback, after
    `tokengate keys set` had applied its change)."""
    try:
        return _redis_url(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


RelPath = Annotated[Path, Field(strict=False), AfterValidator(_resolve)]
OptionalPath = Annotated[
    Path | None, PlainValidator(_optional_path),
    WithJsonSchema({"anyOf": [{"type": "string", "format": "path"}, {"const": False},
                              {"type": "null"}]})]
# "format" values other than JSON Schema's own are annotations: editors show them,
# validators ignore them (the pattern is what they check)
HostPort = Annotated[str, AfterValidator(_host_port),
                     WithJsonSchema({"type": "string", "format": "host:port",
                                     "pattern": r"^.+:[0-9]{1,5}$"})]
LoopbackHostPort = Annotated[str, AfterValidator(_host_port), AfterValidator(_loopback_host_port),
                             WithJsonSchema({"type": "string", "format": "loopback host:port",
                                             "pattern": r"^.+:[0-9]{1,5}$"})]
Origin = Annotated[str, AfterValidator(_origin)]
Network = Annotated[str, AfterValidator(_network),
                    WithJsonSchema({"type": "string", "format": "CIDR network"})]
Sha256 = Annotated[str, AfterValidator(_sha256),
                   WithJsonSchema({"type": "string", "format": "sha256 hex",
                                   "pattern": "^[0-9a-fA-F]{64}$"})]
RedisUrl = Annotated[str, AfterValidator(_redis_url),
                     WithJsonSchema({"type": "string", "format": "uri",
                                     "pattern": "^(redis|rediss|unix)://"})]
# --- numbers ---------------------------------------------------------------------------
# Every number of the file has a type from here, so each is finite and bounded by what
# the code downstream holds: the edge computes in Lua numbers (doubles: integers exact
# up to 2^53) and writes them in headers as integers (%.14g, exact up to 10^14); the
# sidecars' messages carry them as uint64 varints (limits.proto); Redis keeps int64
# counters and long-double floats and refuses a result that is not finite. The unit is
# in each field's description. YAML's .inf and .nan are refused by every type.

# Counts (tokens, requests, bytes, entries) and durations (ms, s): at most a trillion.
# A field with bounds of its own has them within these (its Field's ge/le; pydantic
# keeps an Annotated type's bounds over a Field's, so such a field is a plain int).
MAX_COUNT = 10**12
# Amounts of the currency (a price per 1M tokens, a budget's spend): at most 1e9. The
# budgets count spend in integer nano-units (1e-9), so 1e9 is 1e18 nano-units, within
# Redis's int64 (9.2e18) and the wire's uint64.
MAX_AMOUNT = 1e9

Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Positive = Annotated[int, Field(ge=1, le=MAX_COUNT)]
# a duration or size given as a float (s, ms), like Count
Finite = Annotated[float, Field(ge=0.0, le=float(MAX_COUNT), allow_inf_nan=False)]
Rate = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
# an amount of the currency (a price is one per 1M tokens)
Amount = Annotated[float, Field(ge=0.0, le=MAX_AMOUNT, allow_inf_nan=False)]
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
NonEmpty = Annotated[str, Field(min_length=1)]


class _Schema(BaseModel):
    # strict: YAML already types its values, so "8" for an integer is a mistake
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
