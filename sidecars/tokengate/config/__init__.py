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

One module per part of the file: ``types`` (the field types and bounded numbers every
section uses), ``models``, ``keys``, ``billing``, ``sidecars`` (``redis``, ``ledger``,
``global_limits``, ``metrics``, ``tracing``), ``console`` (``ledger.console``), ``batch``, ``edge``
(``edge``, ``access_log``), ``schema`` (the
whole file, ``Config``, and the rules across sections) and ``loading`` (finding,
reading, checking and writing the file). This package re-exports what the rest of
tokengate uses, so callers import from ``tokengate.config``.
"""

from tokengate.config.batch import BatchConfig
from tokengate.config.billing import BillingConfig, ContextPenalty
from tokengate.config.console import ConsoleConfig
from tokengate.config.edge import (
    COUNTER_MAX_MESSAGE_BYTES,
    AccessLogConfig,
    EdgeConfig,
    StructuredOutputLimits,
)
from tokengate.config.keys import KEY_ID, KEY_ID_RULE, Budget, KeyConfig, Timestamp, rfc3339
from tokengate.config.loading import (
    CONFIG_ENV,
    LOOKUP_HELP,
    ConfigError,
    NotText,
    add_config_option,
    check_model_dirs,
    default_path,
    discover,
    load,
    load_for_command,
    load_or_exit,
    loads,
    parse,
    read_text,
    write_atomic,
)
from tokengate.config.models import ModelConfig, ModelCost
from tokengate.config.schema import Config
from tokengate.config.sidecars import RedisConfig, TracingConfig
from tokengate.config.teams import LEVELS, PooledLimits, TeamConfig, key_levels, level_id
from tokengate.config.types import MAX_AMOUNT, MAX_COUNT, _is_loopback, _Schema, redis_url_arg

__all__ = [
    "CONFIG_ENV",
    "COUNTER_MAX_MESSAGE_BYTES",
    "KEY_ID",
    "KEY_ID_RULE",
    "LEVELS",
    "LOOKUP_HELP",
    "MAX_AMOUNT",
    "MAX_COUNT",
    "AccessLogConfig",
    "BatchConfig",
    "BillingConfig",
    "Budget",
    "Config",
    "ConfigError",
    "ConsoleConfig",
    "ContextPenalty",
    "EdgeConfig",
    "KeyConfig",
    "ModelConfig",
    "ModelCost",
    "NotText",
    "PooledLimits",
    "RedisConfig",
    "StructuredOutputLimits",
    "TeamConfig",
    "Timestamp",
    "TracingConfig",
    "_Schema",
    "_is_loopback",
    "add_config_option",
    "check_model_dirs",
    "default_path",
    "discover",
    "key_levels",
    "level_id",
    "load",
    "load_for_command",
    "load_or_exit",
    "loads",
    "parse",
    "read_text",
    "redis_url_arg",
    "rfc3339",
    "write_atomic",
]
