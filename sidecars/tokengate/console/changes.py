"""Key changes made in the console, through what ``tokengate keys`` runs: the file edited
in place by ``tokengate.keys.edit`` (``add_key``, ``change_key``, ``remove_key``:
validated and compiled before an atomic write that keeps owner, group and mode), then
the running edges reloaded by ``tokengate.keys.reload.apply_to`` (new workers serve
before it returns). Every change, done or refused, is written to the ledger's audit
stream with the admin's name.

Two ways, by ``ledger.console.changes_dir``:

- direct (null): the console's own process edits and reloads. It must be allowed to
  write the file and signal nginx's master: ``make run``, where one user runs all.
- queued (a folder): under the systemd units the ledger runs as ``tokengate`` with a
  read-only /etc, and nginx's master is root's, so neither is allowed. The console
  writes each change as ``<dir>/requests/<id>.json`` and waits for
  ``<dir>/results/<id>.json``; ``tokengate console apply`` (root, started by
  ``tokengate-console-apply.path`` whenever a request appears) makes the change the
  same way and writes the result. A new key's secret never leaves the console: the
  request carries its SHA-256 only.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from ruamel.yaml.comments import CommentedMap

from tokengate import config as tg_config
from tokengate import redis_keys
from tokengate.keys.edit import (
    add_key,
    change_key,
    edit,
    keeping_heading,
    parse_budget,
    remove_key,
    rotate_key,
    set_disabled,
)
from tokengate.keys.reload import apply_to
from tokengate.redis_client import SyncRedis

QUEUE_WAIT_S = 30.0   # how long the console waits for `tokengate console apply`
VERBS = ("create", "set", "revoke", "rotate", "disable", "enable")
# the audit stream's action of each verb (the CLI's are the same)
ACTIONS = {"create": "key_created", "set": "key_changed", "revoke": "key_revoked",
           "rotate": "key_rotated", "disable": "key_disabled", "enable": "key_enabled"}


@dataclass(frozen=True)
class KeyChange:
    """One change of ``tokengate keys``: ``create`` (``sha256`` of the new key, rpm and
    tpm required), ``set`` (what is not None changes; ``budgets`` replace the key's
    when ``no_budgets``), ``revoke``, ``rotate`` (``sha256`` of the new secret; the old
    one valid ``overlap_s`` seconds more), ``disable`` or ``enable``. ``models``: "all"
    or "a,b"; ``budgets``: specs as ``--budget`` takes them (``[MODEL:]day=AMOUNT``)."""

    verb: Literal["create", "set", "revoke", "rotate", "disable", "enable"]
    name: str
    sha256: str | None = None
    rpm: int | None = None
    tpm: int | None = None
    models: str | None = None
    budgets: tuple[str, ...] | None = None
    no_budgets: bool = False
    priority: str | None = None
    overlap_s: int | None = None
    # optimistic concurrency of a ``set`` from a form: the version of the key's settings
    # the form showed (``forms.key_version``) and those settings (``forms.form_values``);
    # a file whose key is at another version by now is left as it is (``Stale``)
    version: str | None = None
    shown: dict[str, str] | None = None

    def change(self, data: CommentedMap) -> None:
        """Make the change in the round-trip YAML data (``tokengate.keys.edit``'s
        functions). Raises ``LookupError``, ``ConfigError``, ``ArgumentTypeError``."""
        budgets = [parse_budget(s) for s in self.budgets] if self.budgets else None
        if self.verb == "create":
            assert self.sha256 and self.rpm and self.tpm
            models = None if self.models in (None, "all") else \
                [m for m in (self.models or "").split(",") if m]
            add_key(data, self.name, self.sha256, self.rpm, self.tpm, models, budgets,
                    self.priority)
        elif self.verb == "set":
            change_key(data, self.name, self.rpm, self.tpm, self.models, budgets,
                       self.no_budgets, self.priority)
        elif self.verb == "rotate":
            assert self.sha256 and self.overlap_s is not None
            rotate_key(data, self.name, self.sha256, datetime.now(UTC),
                       timedelta(seconds=self.overlap_s))
        elif self.verb in ("disable", "enable"):
            set_disabled(data, self.name, self.verb == "disable")
        else:
            remove_key(data, self.name)

    def audit_detail(self) -> str:
        """What changed, for the audit stream (JSON; never a secret: a rotation's new
        digest is left out too, as the CLI's entries do)."""
        doc = {k: v for k, v in asdict(self).items()
               if v not in (None, False) and k not in ("verb", "name", "version", "shown")
               and not (k == "sha256" and self.verb == "rotate")}
        return json.dumps(doc, sort_keys=True)


@dataclass
class Outcome:
    """What became of a change: ``errors`` (the file is unchanged: one line per
    problem) or the edges ``applied`` / ``not_applied`` (with why)."""

    errors: list[str] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)
    not_applied: list[str] = field(default_factory=list)
    no_edge: str | None = None    # no running edge was found: said so
    # a stale form (409): per field, [what the form showed, what the file has now]
    stale: dict[str, list[str]] = field(default_factory=dict)
    not_audited: str | None = None  # the change is made but has no audit entry: why

    @property
    def ok(self) -> bool:
        return not self.errors


class Stale(Exception):
    """The key changed since its form was shown: ``changed`` per field, [shown, now]."""

    def __init__(self, changed: dict[str, list[str]]) -> None:
        super().__init__("changed since the form was shown")
        self.changed = changed


def _check_version(path: Path, change: KeyChange) -> None:
    """Raises ``Stale`` when key ``change.name`` of the file (read under the edit's
    lock, so no other ``keys`` edit lands between this check and the write) is not at
    the version the form showed."""
    from tokengate.console import forms

    key = tg_config.load(path).keys.get(change.name)
    if key is None:
        raise LookupError(f"no key {change.name!r}: it was revoked since the form was shown")
    now = forms.form_values(key)
    if forms.key_version(now) == change.version:
        return
    shown = change.shown if change.shown is not None \
        and forms.key_version(change.shown) == change.version else {}
    changed = {f: [shown.get(f, "?"), v] for f, v in now.items() if shown.get(f) != v}
    raise Stale(changed or {f: ["?", v] for f, v in now.items()})


def make(path: Path, change: KeyChange, edges: list[Path]) -> Outcome:
    """Edit ``path`` with ``change`` and reload its edges (``edges``: folders, as
    ``--edge``; empty: the file's own), as ``tokengate keys`` does. A change with a
    ``version`` that the key is no longer at is refused with ``stale`` set."""
    import argparse

    def checked(data: CommentedMap) -> None:
        if change.version is not None:
            _check_version(path, change)
        change.change(data)

    try:
        cfg = edit(path, keeping_heading(checked))
    except Stale as e:
        return Outcome(errors=[("the key was changed since this page was loaded (by the "
                                "command line or another admin): nothing saved")],
                       stale=e.changed)
    except tg_config.ConfigError as e:
        return Outcome(errors=list(e.errors))
    except (LookupError, argparse.ArgumentTypeError) as e:
        return Outcome(errors=[str(e.args[0])])
    except OSError as e:
        return Outcome(errors=[f"{path}: not changed: {e.strerror or e}"])
    out = Outcome()
    done = apply_to(cfg, edges)
    if not done:
        out.no_edge = f"no running edge of {path}: nothing reloaded"
    for target, error in done:
        if error is None:
            out.applied.append(str(target.edge_json))
        else:
            out.not_applied.append(f"{target.edge_json}: {error}")
    return out


def _write_json(path: Path, doc: dict[str, Any], mode: int | None = None) -> None:
    """``doc`` at ``path``, whole or not at all (renamed into place), with ``mode`` set
    before it appears: a reader may take it, and remove it, at once."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc))
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, path)


def submit(queue: Path, change: KeyChange, admin: str, wait_s: float = QUEUE_WAIT_S
           ) -> Outcome:
    """Queue ``change`` for ``tokengate console apply`` and wait for its result."""
    rid = f"{time.time_ns()}-{secrets.token_hex(4)}"
    requests, results = queue / "requests", queue / "results"
    try:
        requests.mkdir(parents=True, exist_ok=True)
        results.mkdir(parents=True, exist_ok=True)
        _write_json(requests / f"{rid}.json", {"change": asdict(change), "admin": admin})
    except OSError as e:
        return Outcome(errors=[f"cannot queue the change in {requests}: {e.strerror or e}"])
    result = results / f"{rid}.json"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            doc = json.loads(result.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
            continue
        result.unlink(missing_ok=True)
        return Outcome(**doc)
    return Outcome(errors=[(f"not applied within {wait_s:.0f} s: is "
                            f"tokengate-console-apply.path active (systemctl status "
                            f"tokengate-console-apply.path)? The request stays queued in "
                            f"{requests}")])


def apply_queued(path: Path, queue: Path, edges: list[Path]) -> int:
    """``tokengate console apply``: make every queued change (oldest first) and write
    its result; returns how many. A request that is not a change gets an error
    result."""
    requests, results = queue / "requests", queue / "results"
    results.mkdir(parents=True, exist_ok=True)
    done = 0
    for req in sorted(requests.glob("*.json")):
        try:
            doc = json.loads(req.read_text())
            c = doc["change"]
            change = KeyChange(**{**c, "budgets": tuple(c["budgets"])
                                  if c.get("budgets") is not None else None})
            if change.verb not in VERBS:
                raise ValueError(f"unknown verb {change.verb!r}")
            outcome = make(path, change, edges)
            print(f"{req.name}: {change.verb} {change.name} by {doc.get('admin')}: "
                  + ("; ".join(outcome.errors) or "done"), file=sys.stderr)
        except (OSError, ValueError, KeyError, TypeError) as e:
            outcome = Outcome(errors=[f"not a change request: {e}"])
        # readable by the console (its own user) that waits for it and removes it: a
        # chmod after the rename met a file already gone (FileNotFoundError ended apply)
        _write_json(results / req.name, asdict(outcome), 0o644)
        req.unlink(missing_ok=True)
        done += 1
    return done


def audit(client: SyncRedis, maxlen: int, admin: str, action: str, client_addr: str,
          key: str = "", detail: str = "", result: str = "ok") -> None:
    """One entry of the ledger's audit stream (``tokengate.redis_keys.AUDIT_KEY``) for a
    console action: ``kind`` console, the admin, the action (login, login_failed,
    ``ACTIONS``' values), the key, what changed and the result. The
    usage events' entries there have ``rid`` instead of ``kind``. Raises
    ``RedisError``."""
    ts = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    client.xadd(redis_keys.AUDIT_KEY, {"kind": "console", "ts": ts, "admin": admin,
                                       "action": action, "key": key, "detail": detail,
                                       "result": result, "client": client_addr},
                maxlen=maxlen, approximate=True)
