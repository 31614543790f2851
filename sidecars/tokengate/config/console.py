"""The ``ledger.console`` section: the operator console (``tokengate.console``, the
``tokengate-console`` process) and who may log in to it, with which role."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, WithJsonSchema, model_validator

from tokengate.config.types import (
    HostPort,
    LoopbackHostPort,
    OptionalPath,
    RelPath,
    _check,
    _Schema,
)

# an admin's name: what the audit stream records (the key id rule)
ADMIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
ADMIN_NAME_RULE = "an admin name is 1-64 letters, digits, '.', '_', '-' or '@', starting " \
                  "with a letter or digit"

# hashlib.scrypt's digest as `tokengate console passwd` writes it: the parameters, the
# salt and the derived key in the string (salt and key in unpadded URL-safe base64)
SCRYPT_DIGEST = re.compile(r"scrypt\$n=(?P<n>[0-9]{1,8}),r=(?P<r>[0-9]{1,3}),p=(?P<p>[0-9]{1,3})"
                           r"\$(?P<salt>[A-Za-z0-9_-]{16,128})\$(?P<key>[A-Za-z0-9_-]{32,128})")


def _digest(value: str) -> str:
    m = SCRYPT_DIGEST.fullmatch(value)
    n = int(m["n"]) if m else 0
    if not m or n < 2 or n & (n - 1) or not 1 <= int(m["r"]) <= 64 \
            or not 1 <= int(m["p"]) <= 16:
        raise ValueError("expected a digest written by `tokengate console passwd NAME` "
                         "(scrypt$n=N,r=R,p=P$SALT$KEY, N a power of two); never the "
                         "password itself")
    return value


ScryptDigest = Annotated[str, AfterValidator(_digest),
                         WithJsonSchema({"type": "string", "format": "scrypt digest",
                                         "pattern": r"^scrypt\$"})]


# what an admin may do: everything, or see every page and change nothing
ROLES = ("admin", "read-only")
Role = Literal["admin", "read-only"]


class ConsoleConfig(_Schema):
    """The operator console (``tokengate.console``): keys, budgets, usage, spend, the
    request log and the replicas in a browser, served by ``tokengate-console``, a process
    of its own. No one can log in while ``admins`` is empty. Key changes go through what
    ``tokengate keys`` runs (the file edited in place, the running edges reloaded)."""

    listen: HostPort = Field(
        default="127.0.0.1:8085",
        description="host:port of the console (HTTP). Loopback by default: anywhere else, "
                    "put a TLS proxy in front and list its origin in `origins`.")
    admins: dict[str, ScryptDigest] = Field(
        default={},
        description="Who may log in: admin name -> scrypt digest of the password, as "
                    "`tokengate console passwd NAME` writes it (never the password; an "
                    "API key is never accepted). Empty: no one can log in.")
    roles: dict[str, Role] = Field(
        default={},
        description="An admin's role: admin (every page and every change) or read-only "
                    "(every page, no change: each POST but logging out is 403 and no form "
                    "is shown). An admin not listed is admin. `tokengate console passwd "
                    "NAME --role read-only` or `tokengate console role NAME read-only` "
                    "set it; read on every request (a change applies at once).")
    origins: list[Annotated[str, Field(pattern=r"^https?://[^/\s]+$")]] = Field(
        default=[],
        description="Origins the console is also reached at (a proxy's "
                    "https://console.example.com): a change must come from the console's "
                    "own address or one of these (the Origin header).")
    session_ttl_s: int = Field(
        default=28800, ge=60, le=30 * 86400,
        description="A login lasts this long, s (kept on the server; 60 s to 30 days).")
    secure_cookie: bool = Field(
        default=True,
        description="The session cookie says Secure: browsers send it over HTTPS and to "
                    "http://localhost / 127.0.0.1 only. false: also over plain HTTP to "
                    "another host (not recommended).")
    login_attempts: int = Field(
        default=5, ge=1, le=1000,
        description="Failed logins allowed per client address (any names) within "
                    "`login_window_s`, and 10 times as many per admin name from every "
                    "address together, which an address the admin logged in from before "
                    "does not count; more are answered 429 until the window has passed. "
                    "An attempt counts as failed from before its password is checked.")
    login_window_s: int = Field(
        default=300, ge=1, le=86400,
        description="The window of `login_attempts`, s.")
    edges: list[RelPath] = Field(
        default=[],
        description="Edges a key change reloads: folders with edge.json and nginx.pid, as "
                    "`tokengate keys --edge DIR`. Empty: the file's own edge, as "
                    "`tokengate keys` finds it.")
    edge_status: list[LoopbackHostPort] = Field(
        default=[],
        description="Status servers (`/tokengate/status`) of the edges whose replicas and "
                    "refusals the live page shows. Empty: `edge.status_listen`.")
    changes_dir: OptionalPath = Field(
        default=None,
        description="null: the console edits this file and reloads the edges itself (its "
                    "process may write the file and signal nginx, as under `make run`). A "
                    "folder: each change is queued there for `tokengate console apply` "
                    "run by root (the systemd units: tokengate-console-apply.path).")

    @model_validator(mode="after")
    def _names(self) -> ConsoleConfig:
        _check([(f"admins.{name[:64]}", ADMIN_NAME_RULE) for name in self.admins
                if not ADMIN_NAME.fullmatch(name)]
               + [(f"roles.{name[:64]}", ("not an admin of admins (a role is an admin's: "
                                           "`tokengate console passwd NAME --role ROLE`)"))
                  for name in self.roles if name not in self.admins])
        return self

    def role(self, admin: str) -> Role:
        """``admin``'s role (``ROLES``): ``roles``' entry, else admin."""
        return self.roles.get(admin, "admin")
