"""The ``keys`` section: each API key's digest, limits (RPM/TPM, per model),
allowed models, budgets and admission priority. The rules that name other sections
(configured models, ``global_limits.enabled``, ``edge.admission.priorities``) are
checked on the whole file (``tokengate.config.schema.Config``)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, model_validator

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
    priority: NonEmpty = Field(
        default="normal",
        description="Admission priority: a name in edge.admission.priorities (a lower "
                    "priority is shed first when replicas fill up).")
    session_budget: SessionBudget | None = Field(
        default=None,
        description="Tokens and/or spend one agent session may use (the session id the "
                    "edge reads from the request: README, Sessions); its next request is "
                    "refused (403 `session_budget_exceeded`). null: none.")
    fair_share: Annotated[float, Field(ge=0.001, le=1000.0, allow_inf_nan=False)] = Field(
        default=1.0,
        description="Share of this key among the keys of its priority when requests "
                    "queue (edge.queue): its virtual token counter grows by its tokens "
                    "divided by this, so a key of share 2 is served twice the tokens; 0.001 to 1000.")
    max_tokens_cap: Positive | None = Field(
        default=None,
        description="Cap on this key's completion limits, tokens: applies where tighter "
                    "than the model's max_tokens_cap (lowered, never refused). null: the "
                    "model's alone.")
    cached_tokens_weight: Rate | None = Field(
        default=None,
        description="This key's weight of prefix-cache hits in its TPM limits, 0 to 1 "
                    "(see models.<name>.cached_tokens_weight). null: the model's.")
