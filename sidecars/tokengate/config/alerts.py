"""The ``alerts`` section: where the ledger delivers budget alerts (``budgets.<i>.alerts``
of keys, teams and organizations; ``tokengate.ledger.alerts``). Never compiled into the
edge's document: the secrets stay with the ledger."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field

from tokengate.config.types import NonEmpty, _Schema


def _webhook_url(value: str) -> str:
    """An http:// or https:// URL with a host (a path and a query allowed)."""
    u = urlsplit(value)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"expected an http:// or https:// URL, got {value!r}")
    if any(not " " < c < "\x7f" for c in value):
        raise ValueError(f"{value!r} holds a space, a control or a non-ASCII character")
    return value


class Webhook(_Schema):
    """One receiver of budget alerts: a JSON POST, signed."""

    url: Annotated[str, AfterValidator(_webhook_url)] = Field(
        description="Where alerts are POSTed (JSON).")
    secret: NonEmpty = Field(
        description="Shared secret of the signature: `X-Tokengate-Signature: t=<unix s>,"
                    "v1=<hex HMAC-SHA256 of \\\"<t>.<body>\\\">` (keep the file readable by "
                    "the services only).")


class AlertsConfig(_Schema):
    """Budget alerts' delivery."""

    webhooks: list[Webhook] = Field(
        default=[],
        description="Receivers of every budget alert. []: alerts are log lines and "
                    "metrics only.")
    timeout_s: Annotated[float, Field(gt=0.0, le=60.0, allow_inf_nan=False)] = Field(
        default=5.0, description="One delivery's deadline, s.")
    retry_initial_s: Annotated[float, Field(gt=0.0, le=3600.0, allow_inf_nan=False)] = \
        Field(default=1.0, description="Wait after a first failed delivery, s; doubled "
                                       "after each further failure.")
    retry_max_s: Annotated[float, Field(gt=0.0, le=86400.0, allow_inf_nan=False)] = Field(
        default=300.0, description="Longest wait between two deliveries of one alert, s.")
