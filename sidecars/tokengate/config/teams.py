"""The ``teams`` and ``orgs`` sections: pooled limits over the keys of a team (and of an
organization above teams). A key belongs to at most one team (``keys.<id>.team``), a
team to at most one organization (``teams.<name>.org``). Every level a request belongs
to (its key, the key's team, the team's organization) is reserved at admission in one
step and settled with the real usage (``lua/tokengate/limits.lua``), so the tightest
level applies. The rules that name other sections (configured models,
``global_limits.enabled``, ``redis.cluster``) are checked on the whole file
(``tokengate.config.schema.Config``)."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import Field, model_validator

from tokengate.config.keys import Budget
from tokengate.config.types import NonEmpty, Positive, _Rules, _Schema

# A level's id in the windows, budget counters and usage events: "<level>:<name>". A key
# id has no ':' (KEY_ID), so no level id is ever a key id.
LEVELS = ("team", "org")


def level_id(level: str, name: str) -> str:
    """The id of a team or organization where limits and budgets are kept: ``team:eng``,
    ``org:acme``."""
    return f"{level}:{name}"


class PooledLimits(_Schema):
    """What the members of an organization (``orgs.<name>``: the teams whose ``org``
    names it, and their keys) or of a team share."""

    rpm: Positive | None = Field(
        default=None,
        description="Requests per minute of all the members together (with tpm). null: "
                    "no pooled window.")
    tpm: Positive | None = Field(
        default=None,
        description="Tokens per minute (prompt + completion) of all the members together "
                    "(with rpm). null: no pooled window.")
    allowed_models: list[NonEmpty] | None = Field(
        default=None, min_length=1,
        description="Served models the members may use (a key may use a model only when "
                    "every level allows it). null: every model.")
    budgets: list[Budget] = Field(
        default=[],
        description="Spend limits and token quotas of all the members together, per UTC "
                    "day or month (429 `insufficient_quota` naming the level once spent).")

    @model_validator(mode="after")
    def _window(self) -> PooledLimits:
        if (self.rpm is None) != (self.tpm is None):
            raise _Rules([("tpm" if self.tpm is None else "rpm",
                           "a pooled window needs both rpm and tpm")])
        return self


class TeamConfig(PooledLimits):
    """One team (``teams.<name>``): its members are the keys whose ``team`` names it."""

    org: NonEmpty | None = Field(
        default=None,
        description="The organization (a name in `orgs`) the team belongs to. null: none.")


def key_levels(team: str | None, teams: Mapping[str, TeamConfig],
               orgs: Mapping[str, PooledLimits]) -> list[tuple[str, str, PooledLimits]]:
    """(level, name, settings) of every level above a key of ``team`` (its
    ``keys.<id>.team``): the team, then its organization; empty for no team."""
    if team is None:
        return []
    t = teams[team]
    out: list[tuple[str, str, PooledLimits]] = [("team", team, t)]
    if t.org is not None:
        out.append(("org", t.org, orgs[t.org]))
    return out
