"""Latency targets (``models.<name>.slo``, ``keys.<id>.slo``): what ``routing.policy:
slo`` routes and admits by (``lua/tokengate/slo.lua``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tokengate.config.types import _Schema

# the bounds the edge also applies to X-Tokengate-SLO-TTFT-Ms / -TPOT-Ms (tokengate.slo)
TTFT_MAX_MS = 600_000
TPOT_MAX_MS = 60_000

SloClass = Literal["interactive", "sheddable", "batch"]


class LatencyTargets(_Schema):
    """Time to first token and time per output token a request should meet, ms (null:
    no target of that kind). A key's override its model's; a request's
    ``X-Tokengate-SLO-TTFT-Ms`` / ``X-Tokengate-SLO-TPOT-Ms`` headers override both."""

    ttft_ms: int | None = Field(
        default=None, ge=1, le=TTFT_MAX_MS,
        description="Time to first token, ms, from the request's arrival at the edge.")
    tpot_ms: int | None = Field(
        default=None, ge=1, le=TPOT_MAX_MS,
        description="Time per output token after the first, ms.")
