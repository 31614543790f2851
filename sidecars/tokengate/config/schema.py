"""The whole file: ``Config``, one field per section, and the rules that couple keys
of different sections (a key's models and priority, the listeners no two services may
share, the edge's deadline against Redis's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, PrivateAttr, ValidationInfo, model_validator

from tokengate.config.alerts import AlertsConfig
from tokengate.config.batch import BatchConfig
from tokengate.config.billing import BillingConfig
from tokengate.config.edge import AccessLogConfig, EdgeConfig
from tokengate.config.keys import BUDGETS_NEED_REDIS, KEY_ID, KEY_ID_RULE, KeyConfig
from tokengate.config.models import ModelConfig
from tokengate.config.sidecars import (
    GlobalLimitsConfig,
    LedgerConfig,
    MetricsConfig,
    RedisConfig,
    TracingConfig,
)
from tokengate.config.teams import LEVELS, PooledLimits, TeamConfig
from tokengate.config.types import NonEmpty, _check, _Schema


def _empty_is_defaults(value: Any) -> Any:
    """A section whose keys are all commented out reads as null: the defaults."""
    return {} if value is None else value


SECTIONS = ("keys", "teams", "orgs", "alerts", "redis", "billing", "ledger", "global_limits",
            "metrics", "access_log", "edge", "tracing", "batch")


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
    teams: dict[str, TeamConfig] = Field(
        default={},
        description="Teams: pooled limits and budgets over their member keys "
                    "(`keys.<id>.team`).")
    orgs: dict[str, PooledLimits] = Field(
        default={},
        description="Organizations: pooled limits and budgets over their teams "
                    "(`teams.<name>.org`).")
    alerts: AlertsConfig = Field(
        default_factory=AlertsConfig,
        description="Where the ledger delivers budget alerts (`budgets.<i>.alerts`).")
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
    tracing: TracingConfig = Field(
        default_factory=TracingConfig,
        description="OpenTelemetry traces of requests, exported over OTLP by the ledger.")
    batch: BatchConfig = Field(
        default_factory=BatchConfig,
        description="The Batch API (`tokengate-batch`): files and batches on spare "
                    "capacity.")


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

    def _batch_rules(self) -> list[tuple[str, str]]:
        """The batch section's ties to the others: its secret, its priority, its keys."""
        b = self.batch
        problems: list[tuple[str, str]] = []
        if b.enabled and b.worker_sha256 is None:
            problems.append(("batch.worker_sha256", "required when batch.enabled"))
        if b.worker_sha256 is not None and any(
                b.worker_sha256 in (k.sha256, *(p.sha256 for p in k.previous))
                for k in self.keys.values()):
            why = "the digest of an API key: the service's secret must be no key's"
            problems.append(("batch.worker_sha256", why))
        if b.priority not in self.edge.admission.priorities:
            names = ", ".join(self.edge.admission.priorities)
            problems.append(("batch.priority",
                             f"{b.priority!r} is not in edge.admission.priorities ({names})"))
        for key_id in b.key_quota_tokens:
            if key_id not in self.keys:
                problems.append((f"batch.key_quota_tokens.{key_id}", "not a configured key"))
        return problems

    @model_validator(mode="after")
    def _coupled(self, info: ValidationInfo) -> Config:
        problems: list[tuple[str, str]] = []
        owner: dict[str, str] = {}
        def known(model: str) -> str:
            return f"{model!r} is not a configured model ({', '.join(self.models)})"

        def shared(path: str, g: KeyConfig | PooledLimits) -> None:
            """The rules a key and a team or organization share: models and budgets."""
            if g.budgets and not self.global_limits.enabled:
                problems.append((f"{path}.budgets", BUDGETS_NEED_REDIS))
            for i, model in enumerate(g.allowed_models or []):
                if model not in self.models:
                    problems.append((f"{path}.allowed_models.{i}", known(model)))
                elif model in (g.allowed_models or [])[:i]:
                    problems.append((f"{path}.allowed_models.{i}", "listed twice"))
            seen: set[tuple[str, str]] = set()
            for i, b in enumerate(g.budgets):
                if b.model is not None and b.model not in self.models:
                    problems.append((f"{path}.budgets.{i}.model", known(b.model)))
                elif b.model is not None and g.allowed_models is not None \
                        and b.model not in g.allowed_models:
                    whose = "the key's" if path.startswith("keys.") else "its"
                    problems.append((f"{path}.budgets.{i}.model",
                                     f"not one of {whose} allowed_models"))
                if (b.scope, b.period) in seen:
                    why = f"a second {b.period} budget for {b.model or 'every model'}"
                    problems.append((f"{path}.budgets.{i}", why))
                seen.add((b.scope, b.period))

        groups: list[tuple[str, PooledLimits]] = [
            *((f"teams.{n}", t) for n, t in self.teams.items()),
            *((f"orgs.{n}", o) for n, o in self.orgs.items())]
        for path, g in groups:
            if not KEY_ID.fullmatch(path.split(".", 1)[1]):
                problems.append((path, KEY_ID_RULE.replace("a key id", "a name")))
            shared(path, g)
            # one slot holds what one script touches: a key's and its team's Redis keys
            # are hashed apart (redis_keys.window_keys, budget_keys)
            if self.global_limits.enabled and self.redis.cluster \
                    and (g.rpm is not None or g.budgets):
                problems.append((path, ("pooled limits and budgets in Redis need one "
                                        "Redis (redis.cluster: false)")))
        for name, t in self.teams.items():
            if t.org is not None and t.org not in self.orgs:
                problems.append((f"teams.{name}.org", f"{t.org!r} is not in orgs"))
        for name in self.models:
            if name.split(":", 1)[0] in LEVELS and (self.teams or self.orgs):
                problems.append((f"models.{name}", ("a model name may not start with "
                                 "'team:' or 'org:' while teams are configured")))
        for key_id, k in self.keys.items():
            if not KEY_ID.fullmatch(key_id):
                problems.append((f"keys.{key_id}", KEY_ID_RULE))
            shared(f"keys.{key_id}", k)
            if k.team is not None and k.team not in self.teams:
                problems.append((f"keys.{key_id}.team", f"{k.team!r} is not in teams"))
            for model in k.models:
                if model not in self.models:
                    problems.append((f"keys.{key_id}.models.{model}", known(model)))
            # a rotated key's previous digests are looked up like its current one
            for path, sha in [(f"keys.{key_id}.sha256", k.sha256)] + \
                    [(f"keys.{key_id}.previous.{i}.sha256", p.sha256)
                     for i, p in enumerate(k.previous)]:
                if sha in owner:
                    problems.append((path, f"same digest as keys.{owner[sha]}"))
                owner.setdefault(sha, key_id)
            if k.priority not in self.edge.admission.priorities:
                names = ", ".join(self.edge.admission.priorities)
                problems.append((f"keys.{key_id}.priority",
                                 f"{k.priority!r} is not in edge.admission.priorities ({names})"))
        problems += self._batch_rules()
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
                            ("metrics.limits_listen", self.metrics.limits_listen),
                            # the console's service listens with no admin too (its
                            # login page says how to add one)
                            ("ledger.console.listen", self.ledger.console.listen),
                            ("batch.listen",
                             self.batch.listen if self.batch.enabled
                             and self.batch.unix_socket is None else None)):
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
