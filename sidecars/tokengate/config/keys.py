"""The ``keys`` section: each API key's digest, limits (RPM/TPM, per model),
allowed models, budgets and admission priority. The rules that name other sections
(configured models, ``global_limits.enabled``, ``edge.admission.priorities``) are
checked on the whole file (``tokengate.config.schema.Config``)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    PlainSerializer,
    PlainValidator,
    WithJsonSchema,
    model_validator,
)

from tokengate.config.slo import LatencyTargets, SloClass
from tokengate.config.types import Amount, NonEmpty, Positive, Rate, Sha256, _Rules, _Schema


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
    alerts: list[Annotated[int, Field(ge=1, le=100)]] = Field(
        default=[], max_length=10,
        description="Percentages of `spend` and of `tokens` at which the ledger sends a "
                    "budget alert (`alerts.webhooks`, a log line, a metric), once per "
                    "threshold per period, e.g. [50, 80, 100]. []: none.")

    @model_validator(mode="after")
    def _something(self) -> Budget:
        if self.spend is None and self.tokens is None:
            raise _Rules([("spend", "a budget needs spend, tokens or both")])
        return self

    @property
    def scope(self) -> str:
        """What the budget counts: ``*`` (every model) or the model's name."""
        return self.model or "*"


def timestamp(value: Any) -> datetime:
    """An RFC 3339 date and time with its offset (``2027-01-01T00:00:00Z``): a string,
    or the datetime a YAML reader makes of one written without quotes. A time without an
    offset is refused: the edge compares it with its wall clock in UTC, and a local time
    would move by the host's time zone."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(f"expected an RFC 3339 time such as 2027-01-01T00:00:00Z, got "
                             f"{value!r}") from None
    if not isinstance(value, datetime):
        # ValueError, not TypeError: pydantic reports only the former as the key's error
        raise ValueError(f"expected an RFC 3339 time such as "  # noqa: TRY004
                         f"2027-01-01T00:00:00Z, got {value!r}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{value.isoformat()} has no offset: add Z (UTC) or +HH:MM")
    return value


def rfc3339(t: datetime) -> str:
    """``t`` as the file and ``keys list`` write it: UTC, seconds, ``Z``."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# A point in time: RFC 3339 in the file, seconds since the epoch in the edge's document
# (tokengate.tools.compile_config), where the edge compares it with ngx.time().
Timestamp = Annotated[datetime, PlainValidator(timestamp), PlainSerializer(rfc3339),
                      WithJsonSchema({"type": "string", "format": "date-time"})]
# Free text shown to operators (keys list, the console): one line, bounded.
OWNER_MAX, DESCRIPTION_MAX = 128, 500


def _one_line(value: str) -> str:
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError("one line of text: no line breaks or control characters")
    return value


class PreviousDigest(_Schema):
    """A digest the key had before ``tokengate keys rotate``: still accepted until
    ``expires_at`` (the rotation's overlap), so the tenant moves to the new key without
    a moment with none; refused afterwards like an unknown key, and dropped from the
    file by the next ``tokengate keys`` command."""

    sha256: Sha256 = Field(description="Hex SHA-256 digest of the key that was replaced.")
    expires_at: Timestamp = Field(
        description="RFC 3339 time from which this digest is refused (401).")


# a key id: what `tokengate keys create NAME` accepts
KEY_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
KEY_ID_RULE = "a key id is 1-64 letters, digits, '.', '_', '-' or '@', starting with a " \
              "letter or digit"


class SessionBudget(_Schema):
    """What one agent session of a key may use (``lua/tokengate/session.lua``): once a
    session's settled total reached ``tokens`` or ``spend``, its next request is refused
    with 403 ``session_budget_exceeded`` in the API's own error shape (403, not 429: the
    total never goes down, so a retry can never succeed, and the SDKs and Claude Code
    retry a 429). Counted by each edge (a shared dict, settled when a request ends): a
    session ends at most its in-flight requests' usage above the budget per edge."""

    tokens: Positive | None = Field(
        default=None,
        description="Tokens per session (prompt + completion). null: no token limit.")
    spend: Annotated[Amount, Field(ge=1e-6)] | None = Field(
        default=None,
        description="Spend per session, in `currency` (the cost `tokengate usage` "
                    "reports). null: no spend limit.")

    @model_validator(mode="after")
    def _something(self) -> SessionBudget:
        if self.spend is None and self.tokens is None:
            raise _Rules([("spend", "a session budget needs tokens, spend or both")])
        return self


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
    team: NonEmpty | None = Field(
        default=None,
        description="The team (a name in `teams`) the key belongs to: its requests also "
                    "count against the team's (and its organization's) pooled limits and "
                    "budgets. null: none.")
    priority: NonEmpty = Field(
        default="normal",
        description="Admission priority: a name in edge.admission.priorities (a lower "
                    "priority is shed first when replicas fill up).")
    session_budget: SessionBudget | None = Field(
        default=None,
        description="Tokens and/or spend one agent session may use (the session id the "
                    "edge reads from the request: docs/api/sessions.md); its next request is "
                    "refused (403 `session_budget_exceeded`). null: none.")
    slo: LatencyTargets | None = Field(
        default=None,
        description="This key's latency targets (routing.policy slo), over its model's. "
                    "null: the model's.")
    slo_class: SloClass = Field(
        default="interactive",
        description="What happens to this key's requests when no replica is predicted to "
                    "meet their targets: `interactive` waits until one is or the TTFT "
                    "target has passed, `sheddable` is refused at once (503 "
                    "slo_unattainable, Retry-After), `batch` goes only into spare capacity "
                    "(a replica with no other prefill queued, predicted at half its "
                    "targets), else refused the same way.")
    fair_share: Annotated[float, Field(ge=0.001, le=1000.0, allow_inf_nan=False)] = Field(
        default=1.0,
        description="Share of this key among the keys of its priority when requests "
                    "queue (edge.queue): its virtual token counter grows by its tokens "
                    "divided by this, so a key of share 2 is served twice the tokens; 0.001 to 1000.")
    max_tokens_cap: Positive | None = Field(
        default=None,
        description="Cap on this key's completion limits, tokens: applies where tighter "
                    "than the model's max_tokens_cap (lowered as it lowers, not refused). "
                    "null: the model's alone.")
    cached_tokens_weight: Rate | None = Field(
        default=None,
        description="This key's weight of prefix-cache hits in its TPM limits, 0 to 1 "
                    "(see models.<name>.cached_tokens_weight). null: the model's.")
    previous: list[PreviousDigest] = Field(
        default=[], max_length=16,
        description="Digests the key had before `tokengate keys rotate`, each accepted "
                    "until its expires_at (the overlap); written by the command.")
    expires_at: Timestamp | None = Field(
        default=None,
        description="RFC 3339 time from which the key is refused (401 \"This API key "
                    "expired ...\"), by the edge's wall clock. null: never.")
    disabled: bool = Field(
        default=False,
        description="Refuse the key (401 \"This API key is disabled.\") while keeping "
                    "its settings: `tokengate keys disable` / `enable`.")
    owner: Annotated[str, Field(min_length=1, max_length=OWNER_MAX),
                     AfterValidator(_one_line)] | None = Field(
        default=None,
        description=f"Who the key belongs to (free text, one line, at most {OWNER_MAX} "
                    "characters), shown by `tokengate keys list` and the console.")
    description: Annotated[str, Field(min_length=1, max_length=DESCRIPTION_MAX),
                           AfterValidator(_one_line)] | None = Field(
        default=None,
        description=f"What the key is for (free text, one line, at most "
                    f"{DESCRIPTION_MAX} characters), shown like owner.")
