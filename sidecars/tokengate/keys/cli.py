"""``tokengate keys``'s subcommands: ``create``, ``set``, ``revoke`` (an edit of the file,
then the running edges reloaded) and ``list``; ``add_parser`` registers them."""

from __future__ import annotations

import argparse
import json
import os
import pwd
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError
from ruamel.yaml.comments import CommentedMap

from tokengate import config as tg_config
from tokengate import redis_keys
from tokengate.keys.edit import (
    Change,
    add_key,
    change_key,
    edit,
    keeping_heading,
    parse_budget,
    parse_duration,
    parse_models,
    parse_session_budget,
    parse_time,
    remove_key,
    rotate_key,
    set_disabled,
    set_session_budget,
    shown,
    time_text,
)
from tokengate.keys.reload import apply
from tokengate.keys.secret import digest, new_key
from tokengate.keys.usage import print_table
from tokengate.ledger.admin import snapshot
from tokengate.redis_client import connect

KEYS_HELP = """\
Create, list, change and revoke API keys in tokengate.yaml, and apply the change to the
running edges at once (no restart; streams in flight continue).

  tokengate keys create NAME --rpm N --tpm N [--models a,b] [--budget SPEC]...
        [--session-budget SPEC]... [--priority NAME] [--max-tokens-cap N]
        [--cached-tokens-weight W]
        prints the new key once (tg-...); the file stores only its SHA-256
  tokengate keys list [--json]
        names, limits, models, budgets and the spend of the current day / month
        (from the ledger's Redis: what `tokengate usage` reports, and what the budget
        counters hold with the reservations of requests in flight); never a key
  tokengate keys set NAME [--rpm N] [--tpm N] [--models a,b|all] [--budget SPEC]...
        [--no-budgets] [--session-budget SPEC]... [--no-session-budget] [--priority NAME]
        [--max-tokens-cap N|model] [--cached-tokens-weight W|model]
  tokengate keys revoke NAME
        removes the key: refused (401) once the command returns
  tokengate keys rotate NAME [--overlap DURATION]
        prints the key's new secret once; the old one stays valid for DURATION (default
        24h; 90s, 30m, 24h, 7d, or 0 to refuse it at once), then is refused (401) and
        dropped from the file by the next keys command
  tokengate keys disable NAME | enable NAME
        refuses the key (401 "This API key is disabled.") or admits it again; its
        settings stay

  create and set also take --expires-at TIME (RFC 3339 with its offset, e.g.
  2027-01-01T00:00:00Z; `set ... never` drops it: from then on the key is refused, 401
  "This API key expired at ..."), --owner TEXT and --description TEXT (one line each;
  `set ... ''` drops them), which `keys list` shows.

  --budget [MODEL:]day=AMOUNT | [MODEL:]month=AMOUNT, AMOUNT in the configuration's
  currency (day=5.00) or in tokens with a t (month=2000000t); repeat it for several.
  A spend SPEC and a token SPEC of one model and period make one budget; `set
  --budget` sets that kind of the key's budget of that model and period (the other
  kind stays; --no-budgets first to drop it).
  --session-budget AMOUNT | Nt: what one agent session of the key may use, in the
  currency (2.50) or in tokens (500000t); give both kinds for both. Its next request
  is refused (403 session_budget_exceeded); --no-session-budget drops it.

  --max-tokens-cap N caps the key's completion limits (tokens) where tighter than the
  model's max_tokens_cap; --cached-tokens-weight W (0 to 1) weighs the key's prefix-cache
  hits in its TPM limits instead of the model's cached_tokens_weight. `set ... model`
  drops the key's own value.

CONFIGURATION
  --config FILE, else $TOKENGATE_CONFIG, else the installed /etc/tokengate/tokengate.yaml
  where it exists (a checkout's ./tokengate.yaml only when named), else ./tokengate.yaml;
  a file not named is said on the first line (stderr). The file keeps its owner, group
  and mode (an install's is root:www-data 0640, read by the services through the group).

APPLYING
  The edges to reload are --edge DIR (a folder with edge.json and nginx.pid, as
  `make run` renders under var/run/nginx; repeatable), else the configuration's own
  edge when it runs: for an installed file (ROOT/etc/tokengate/tokengate.yaml, ROOT /
  or an install prefix) ROOT/etc/tokengate/edge.json with ROOT/run/nginx.pid; for any
  other file `make run`'s var/run/nginx beside it. Never both: a command acts on one
  deployment. --no-apply only writes the file.

AUDIT
  Every change is written to the ledger's audit stream (Redis, tg:{ledger}:audit) like the
  console's: kind cli, the OS user (and SUDO_USER), the action, the key and what changed,
  never a secret. When Redis cannot be reached the change still applies and stderr says
  it was not audited.

EXIT STATUS
  0 done; 1 the edit is invalid (the file is unchanged; one line per problem) or an
  edge did not reload; 2 usage error, unknown key, or the file cannot be read.
"""


def _path(args: argparse.Namespace) -> Path:
    return Path(args.config if args.config is not None else tg_config.default_path())


def _run_edit(args: argparse.Namespace, change: Change
              ) -> tuple[int, tg_config.Config | None]:
    try:
        return 0, edit(_path(args), keeping_heading(change))
    except tg_config.ConfigError as e:
        for line in e.errors:
            print(line, file=sys.stderr)
        print(f"{_path(args)}: not changed", file=sys.stderr)
        return 1, None
    except LookupError as e:
        print(f"tokengate keys: {e.args[0]}", file=sys.stderr)
        return 2, None
    except OSError as e:
        print(f"tokengate keys: {e}", file=sys.stderr)
        return 2, None


# the per-key settings of KeyConfig that create and set take as options
_SETTINGS = ("max_tokens_cap", "cached_tokens_weight")
# the operators' own fields of KeyConfig and its team: "" (owner, description, team) or
# never (expires_at) on the command line drops them
_LABELS = ("owner", "description", "team")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The per-key settings given on the command line (field -> value; None: drop the
    key's own value, "model", "never" or "" on the command line)."""
    out: dict[str, Any] = {}
    for field in _SETTINGS:
        v = getattr(args, field)
        if v is not None:
            out[field] = None if v == "model" else v
    for field in _LABELS:
        v = getattr(args, field)
        if v is not None:
            out[field] = v or None
    if args.expires_at is not None:
        out["expires_at"] = None if args.expires_at == "never" \
            else time_text(args.expires_at)
    return out


def _time_or_never(text: str) -> datetime | str:
    """--expires-at: an aware datetime, or "never"."""
    return parse_time(text) or "never"


def _who() -> str:
    """The OS user running the command, as the audit stream records it (with the user
    that ran sudo)."""
    try:
        user = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        user = str(os.getuid())
    sudo = os.environ.get("SUDO_USER")
    return f"{user} (sudo by {sudo})" if sudo and sudo != user else user


def audit(cfg: tg_config.Config, action: str, key: str, detail: dict[str, Any],
          result: str = "ok", redis_url: str | None = None,
          command: str = "tokengate keys") -> bool:
    """One entry of the ledger's audit stream (``tokengate.redis_keys.AUDIT_KEY``) for a
    change made on the command line (``command``: ``tokengate keys``, ``tokengate
    console``), in the shape of the console's (``tokengate.console.changes.audit``):
    ``kind`` cli, ``admin`` the OS user (``_who``), the action (key_created, key_changed,
    key_revoked, key_rotated, key_disabled, key_enabled; admin_password_set,
    admin_role_set, admin_removed), the key ("" for an admin's change), ``detail`` (JSON
    of what changed; never a secret) and the result. Returns False, said on stderr, when
    Redis could not take it: the change stands (the file is the truth; the audit trail
    is a record of it)."""
    ts = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    entry = {"kind": "cli", "ts": ts, "admin": _who(), "action": action, "key": key,
             "detail": json.dumps(detail, sort_keys=True, default=str),
             "result": result, "client": "local"}
    try:
        client = connect(cfg.redis, timeout_s=2.0, url=redis_url)
        client.xadd(redis_keys.AUDIT_KEY, entry,  # type: ignore[arg-type]
                    maxlen=cfg.ledger.audit_maxlen, approximate=True)
    except (RedisError, OSError) as e:
        # the error names host and port, never the URL's password
        print(f"{command}: the change is made but was not audited (Redis: {e})",
              file=sys.stderr)
        return False
    return True


def _applied(args: argparse.Namespace, cfg: tg_config.Config, action: str,
             detail: dict[str, Any]) -> int:
    """The running edges reloaded (``apply``), then the change audited; the exit
    status of the reload."""
    status = apply(args, cfg)
    audit(cfg, action, args.name, detail,
          "ok" if status == 0 else "written; an edge did not reload",
          getattr(args, "redis_url", None))
    return status


def _changed(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Any]:
    """What a create or set asked for, for the audit stream (options given; no secret)."""
    out = {}
    for n in names:
        v = getattr(args, n, None)
        if v not in (None, False, []):
            out[n] = v
    return out


_AUDITED = ("rpm", "tpm", "models", "budget", "no_budgets", "session_budget",
            "no_session_budget", "priority", "max_tokens_cap", "cached_tokens_weight",
            "expires_at", "owner", "description", "team")


def _or_model(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """An option's type that also takes "model" (drop the key's own value)."""
    def parse(text: str) -> Any:
        if text == "model":
            return text
        try:
            return kind(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected a number or 'model', got {text!r}"
                                             ) from e
    return parse


def create(args: argparse.Namespace) -> int:
    """``tokengate keys create``: prints the new key on stdout (once)."""
    key = new_key()

    def change(data: CommentedMap) -> None:
        add_key(data, args.name, digest(key), args.rpm, args.tpm, args.models, args.budget,
                args.priority, _settings(args))
        set_session_budget(data, args.name, args.session_budget)

    status, cfg = _run_edit(args, change)
    if cfg is None:
        return status
    print(key)
    print(f"created key {shown(args.name)}: the key above is shown only now", file=sys.stderr)
    return _applied(args, cfg, "key_created", _changed(args, _AUDITED))


def set_(args: argparse.Namespace) -> int:
    """``tokengate keys set``: changes limits, models or budgets of a key."""

    def change(data: CommentedMap) -> None:
        settings = _settings(args)
        only_session = (args.rpm, args.tpm, args.models, args.budget, args.priority) == \
            (None,) * 5 and not args.no_budgets and not settings \
            and (args.session_budget or args.no_session_budget)
        if not only_session:
            change_key(data, args.name, args.rpm, args.tpm, args.models, args.budget,
                       args.no_budgets, args.priority, settings)
        set_session_budget(data, args.name, args.session_budget, args.no_session_budget)

    status, cfg = _run_edit(args, change)
    if cfg is None:
        return status
    print(f"changed key {shown(args.name)}", file=sys.stderr)
    return _applied(args, cfg, "key_changed", _changed(args, _AUDITED))


def revoke(args: argparse.Namespace) -> int:
    """``tokengate keys revoke``: removes the key from the file."""

    def change(data: CommentedMap) -> None:
        remove_key(data, args.name)

    status, cfg = _run_edit(args, change)
    if cfg is None:
        return status
    print(f"revoked key {shown(args.name)}", file=sys.stderr)
    return _applied(args, cfg, "key_revoked", {})


def rotate(args: argparse.Namespace) -> int:
    """``tokengate keys rotate``: a new secret on stdout (once); the old one valid for
    ``--overlap`` more."""
    key = new_key()
    now = datetime.now(UTC)
    until: list[datetime | None] = []

    def change(data: CommentedMap) -> None:
        until.append(rotate_key(data, args.name, digest(key), now, args.overlap))

    status, cfg = _run_edit(args, change)
    if cfg is None:
        return status
    print(key)
    old = f"the old one is valid until {tg_config.rfc3339(until[0])}" if until[0] \
        else "the old one is refused from now on"
    print(f"rotated key {shown(args.name)}: the key above is shown only now; {old}",
          file=sys.stderr)
    return _applied(args, cfg, "key_rotated",
                    {"previous_expires_at": until[0] and tg_config.rfc3339(until[0])})


def _switch(args: argparse.Namespace, disabled: bool) -> int:
    changed: list[bool] = []

    def change(data: CommentedMap) -> None:
        changed.append(set_disabled(data, args.name, disabled))

    status, cfg = _run_edit(args, change)
    if cfg is None:
        return status
    word = "disabled" if disabled else "enabled"
    print(f"{word} key {shown(args.name)}" + ("" if changed[0] else f" (it was {word})"),
          file=sys.stderr)
    return _applied(args, cfg, f"key_{word}", {"disabled": disabled})


def disable(args: argparse.Namespace) -> int:
    """``tokengate keys disable``: the key is refused (401) until enabled."""
    return _switch(args, True)


def enable(args: argparse.Namespace) -> int:
    """``tokengate keys enable``: a disabled key is admitted again."""
    return _switch(args, False)


def list_(args: argparse.Namespace) -> int:
    """``tokengate keys list``: a table, or ``--json``."""
    cfg = tg_config.load_for_command(_path(args), "tokengate keys")
    if cfg is None:
        return 2
    entries = snapshot(cfg, connect(cfg.redis, timeout_s=2.0, url=args.redis_url),
                       datetime.now(UTC).date())
    if args.json:
        json.dump({"currency": cfg.currency, "keys": entries}, sys.stdout, indent=1)
        print()
        return 0
    print_table(entries, cfg.currency)
    return 0


def _label_options(p: argparse.ArgumentParser, create: bool) -> None:
    """--expires-at, --owner, --description, --team of create and set."""
    drop = "" if create else "; never drops it"
    p.add_argument("--expires-at", type=_time_or_never, default=None, metavar="TIME",
                   help=f"RFC 3339 time from which the key is refused, e.g. "
                        f"2027-01-01T00:00:00Z{drop}")
    p.add_argument("--owner", default=None, metavar="TEXT",
                   help="who the key belongs to (one line)" + ("" if create else
                                                               "; '' drops it"))
    p.add_argument("--description", default=None, metavar="TEXT",
                   help="what the key is for (one line)" + ("" if create else
                                                            "; '' drops it"))
    p.add_argument("--team", default=None, metavar="NAME",
                   help="the team (a name in teams) whose pooled limits and budgets the "
                        "key also counts against" + ("" if create else "; '' drops it"))


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``keys`` on a ``tokengate`` subcommand parser."""
    p = sub.add_parser("keys", help="create, list, change and revoke API keys",
                       description=KEYS_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    # --config before the verb (keys --config F list) or after it (keys list --config F):
    # the verb's own default is SUPPRESS so that it does not undo the one given before
    config_help = f"tokengate.yaml ({tg_config.LOOKUP_HELP})"
    p.add_argument("--config", type=Path, default=None, help=config_help)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", type=Path, default=argparse.SUPPRESS, help=config_help)
    apply_opts = argparse.ArgumentParser(add_help=False)
    apply_opts.add_argument("--edge", type=Path, action="append", metavar="DIR",
                            help="an edge to reload: DIR holds edge.json and nginx.pid "
                                 "(repeatable; default: the ones found)")
    apply_opts.add_argument("--no-apply", action="store_true",
                            help="write the file only; reload nothing")
    audit_opts = argparse.ArgumentParser(add_help=False)
    audit_opts.add_argument("--redis-url", default=None, type=tg_config.redis_url_arg,
                            help="Redis of the audit stream (default: redis.url)")
    verbs = p.add_subparsers(dest="verb", metavar="verb", required=True)

    def editing(verb: str, func: Callable[[argparse.Namespace], int], help: str,
                name_help: str | None = None) -> argparse.ArgumentParser:
        """A verb that edits one key, named by its first argument, and applies the file."""
        v = verbs.add_parser(verb, parents=[common, apply_opts, audit_opts], help=help)
        v.add_argument("name", help=name_help)
        v.set_defaults(func=func)
        return v

    c = editing("create", create, "create a key", "key id (what usage events and reports show)")
    c.add_argument("--rpm", type=int, required=True, help="requests per minute")
    c.add_argument("--tpm", type=int, required=True, help="tokens per minute")
    c.add_argument("--models", type=parse_models, default=None, metavar="A,B",
                   help="the only models the key may use (default: all)")
    c.add_argument("--budget", type=parse_budget, action="append", metavar="SPEC",
                   help="[MODEL:]day=AMOUNT or [MODEL:]month=AMOUNT (AMOUNT in the "
                        "currency, or tokens: 2000000t); repeatable")
    c.add_argument("--session-budget", type=parse_session_budget, action="append",
                   metavar="SPEC", help="spend (AMOUNT) or tokens (Nt) per agent session")
    c.add_argument("--max-tokens-cap", type=int, default=None, metavar="N",
                   help="cap on the key's completion limits, tokens (where tighter than "
                        "the model's)")
    c.add_argument("--cached-tokens-weight", type=float, default=None, metavar="W",
                   help="weight of the key's prefix-cache hits in its TPM limits, 0 to 1 "
                        "(default: the model's)")
    c.add_argument("--priority", default=None, metavar="NAME",
                   help="admission priority, one of edge.admission.priorities "
                        "(default: normal)")
    _label_options(c, create=True)
    s = editing("set", set_, "change a key")
    s.add_argument("--rpm", type=int, default=None)
    s.add_argument("--tpm", type=int, default=None)
    s.add_argument("--models", default=None, metavar="A,B|all",
                   help="the only models the key may use; all: every model")
    s.add_argument("--budget", type=parse_budget, action="append", metavar="SPEC",
                   help="as for create; sets that kind (spend or tokens) of the budget of "
                        "that model and period")
    s.add_argument("--no-budgets", action="store_true",
                   help="remove the key's budgets (before adding --budget ones)")
    s.add_argument("--session-budget", type=parse_session_budget, action="append",
                   metavar="SPEC", help="as for create; sets that kind (spend or tokens)")
    s.add_argument("--no-session-budget", action="store_true",
                   help="remove the key's session budget (before adding --session-budget)")
    s.add_argument("--max-tokens-cap", type=_or_model(int), default=None, metavar="N|model")
    s.add_argument("--cached-tokens-weight", type=_or_model(float), default=None,
                   metavar="W|model")
    s.add_argument("--priority", default=None, metavar="NAME",
                   help="admission priority, one of edge.admission.priorities")
    _label_options(s, create=False)
    editing("revoke", revoke, "revoke a key")
    ro = editing("rotate", rotate, "a new secret; the old one valid for --overlap more")
    ro.add_argument("--overlap", type=parse_duration, default=parse_duration("24h"),
                    metavar="DURATION",
                    help="how long the old secret stays valid: 90s, 30m, 24h, 7d, or 0 "
                         "(default: 24h)")
    editing("disable", disable, "refuse a key, keeping its settings")
    editing("enable", enable, "admit a disabled key again")
    ls = verbs.add_parser("list", parents=[common], help="list the keys (never the key)")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.add_argument("--redis-url", default=None, type=tg_config.redis_url_arg,
                    help="Redis URL (default: redis.url)")
    ls.set_defaults(func=list_)
