"""``tokengate console``: set an admin's password (``passwd``) and role (``role``), and
apply the key changes the console queued (``apply``, root's, under the systemd units)."""

from __future__ import annotations

import argparse
import getpass
import sys
from pathlib import Path

from ruamel.yaml.comments import CommentedMap

from tokengate import config as tg_config
from tokengate.config.console import ADMIN_NAME, ADMIN_NAME_RULE, ROLES

AUDIT_REDIS_HELP = "Redis of the audit stream (default: redis.url)"
CONSOLE_HELP = """\
The operator console (tokengate-console, a service of its own, on ledger.console.listen,
127.0.0.1:8085 by default).

  tokengate console passwd NAME [--password-stdin] [--role admin|read-only]
        sets NAME's password: its scrypt digest goes to ledger.console.admins.NAME in
        tokengate.yaml (the same in-place edit as `tokengate keys`: comments, owner and
        mode kept); the password is asked twice on the terminal, or read as one line
        from stdin. The console reads the file again at the next request: no restart.
        Sessions of NAME end. --role sets NAME's role too (ledger.console.roles): admin
        (every change) or read-only (every page, no change); without it an admin keeps
        theirs and a new one is an admin.
  tokengate console role NAME admin|read-only
        sets the role of the admin NAME (their password and sessions stay; the next
        request of a session has the new role)
  tokengate console passwd NAME --remove
        removes the admin (and their role); their sessions end
  tokengate console apply [--config FILE]
        makes the key changes the console queued in ledger.console.changes_dir (as
        root: tokengate-console-apply.service runs it whenever one is queued)

Each passwd and role is written to the ledger's audit stream (kind cli, the OS user,
admin_password_set, admin_role_set or admin_removed; never a password or its digest):
the console's Audit page lists it. With Redis down the change stands and says it was
not audited.

EXIT STATUS
  0 done; 1 refused (a short password, passwords that differ, a bad name, the file
  would not be valid: one line per problem); 2 usage error, no such admin, or the file
  cannot be read.
"""


def _path(args: argparse.Namespace) -> Path:
    return Path(args.config if args.config is not None else tg_config.default_path())


def _read_password(args: argparse.Namespace) -> str | None:
    from tokengate.console.password import check_new

    if args.password_stdin:
        line = sys.stdin.readline()
        pw = line.removesuffix("\n")
    else:
        pw = getpass.getpass(f"new password for {args.name}: ")
        if getpass.getpass("again: ") != pw:
            print("tokengate console: the passwords differ; nothing changed", file=sys.stderr)
            return None
    why = check_new(pw)
    if why is not None:
        print(f"tokengate console: {why}; nothing changed", file=sys.stderr)
        return None
    return pw


_KEEP = object()  # set_admin: leave the digest as it is


def set_admin(path: Path, name: str, digest: str | None | object = _KEEP,
              role: str | None = None) -> tg_config.Config:
    """Write ``ledger.console.admins.<name>: <digest>`` into the file (``digest`` None:
    remove the admin and their role; left out: keep the admin's digest, who must exist)
    and, with ``role`` (``ROLES``), ``ledger.console.roles.<name>`` (admin: the entry
    removed, admin being the default), with ``tokengate.keys.edit``'s round-trip edit.
    Raises ``ConfigError`` (nothing written), ``LookupError`` (no such admin to remove or
    to give a role) or ``OSError``."""
    from tokengate.keys.edit import edit, keeping_heading

    def section(parent: CommentedMap, key: str) -> CommentedMap:
        if parent.get(key) is None:
            parent[key] = CommentedMap()
        found: CommentedMap = parent[key]
        return found

    def change(data: CommentedMap) -> None:
        console = section(section(data, "ledger"), "console")
        admins = section(console, "admins")
        if (digest is None or digest is _KEEP) and name not in admins:
            raise LookupError(f"no admin {name!r}")
        if digest is None:
            del admins[name]
        elif digest is not _KEEP:
            admins[name] = digest
        roles = console.get("roles")
        if digest is None or role == "admin":
            if roles is not None and name in roles:
                del roles[name]
        elif role is not None:
            section(console, "roles")[name] = role
        # an emptied mapping goes (its default is empty): ruamel would write the next
        # section's heading comment between its key and a "{}", which does not parse
        for key in ("roles", "admins"):
            if key in console and not console[key]:
                del console[key]
        if not console:
            del data["ledger"]["console"]

    return edit(path, keeping_heading(change, "ledger"))


def passwd(args: argparse.Namespace) -> int:
    """``tokengate console passwd``."""
    from tokengate.console.password import digest

    if not ADMIN_NAME.fullmatch(args.name):
        print(f"tokengate console: {args.name[:64]!r}: {ADMIN_NAME_RULE}", file=sys.stderr)
        return 1
    new = None
    if not args.remove:
        pw = _read_password(args)
        if pw is None:
            return 1
        new = digest(pw)
    if args.remove:
        return _set(args, new, args.role, "removed", "admin_removed")
    return _set(args, new, args.role,
                "password set" + (f", role {args.role}" if args.role else ""),
                "admin_password_set")


def role(args: argparse.Namespace) -> int:
    """``tokengate console role``."""
    return _set(args, _KEEP, args.role, f"role {args.role}", "admin_role_set")


def _set(args: argparse.Namespace, digest: str | None | object, new_role: str | None,
         what: str, action: str) -> int:
    """An admin's password and role set (``set_admin``), said on stderr, and written to
    the audit stream as ``action`` (detail: the admin, the role given; never the
    password or its digest). Exit status 0, 1 (the file would not be valid) or 2."""
    from tokengate.keys.cli import audit

    try:
        cfg = set_admin(_path(args), args.name, digest, new_role)
    except tg_config.ConfigError as e:
        for line in e.errors:
            print(line, file=sys.stderr)
        print(f"{_path(args)}: not changed", file=sys.stderr)
        return 1
    except LookupError as e:
        print(f"tokengate console: {e.args[0]}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"tokengate console: {e}", file=sys.stderr)
        return 2
    left = "" if cfg.ledger.console.admins else " (no admin is left: no one can log in)"
    print(f"admin {args.name}: {what} ({cfg.path}); the console (tokengate-console) "
          f"serves http://{cfg.ledger.console.listen}/{left}", file=sys.stderr)
    detail = {"admin": args.name, **({"role": new_role} if new_role else {})}
    audit(cfg, action, "", detail, redis_url=args.redis_url, command="tokengate console")
    return 0


def apply(args: argparse.Namespace) -> int:
    """``tokengate console apply``."""
    from tokengate.console.changes import apply_queued

    cfg = tg_config.load_for_command(_path(args), "tokengate console")
    if cfg is None:
        return 2
    queue = cfg.ledger.console.changes_dir
    if queue is None:
        print("tokengate console: ledger.console.changes_dir is null: the console makes "
              "its changes itself; nothing to apply", file=sys.stderr)
        return 0
    n = apply_queued(cfg.path, queue, list(cfg.ledger.console.edges))
    print(f"applied {n} queued change{'s' if n != 1 else ''}", file=sys.stderr)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``console`` on a ``tokengate`` subcommand parser."""
    p = sub.add_parser("console", help="the operator console: admins, queued changes",
                       description=CONSOLE_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = p.add_subparsers(dest="verb", metavar="verb", required=True)
    pw = verbs.add_parser("passwd", help="set (or remove) an admin's password")
    pw.add_argument("name", help="the admin's name (what the audit stream records)")
    tg_config.add_config_option(pw)
    pw.add_argument("--password-stdin", action="store_true",
                    help="read the password as one line from stdin (scripts)")
    pw.add_argument("--remove", action="store_true", help="remove the admin")
    pw.add_argument("--role", choices=ROLES, default=None,
                    help="the admin's role: admin (every change) or read-only (every page, "
                         "no change); default: the admin's own, admin for a new one")
    pw.add_argument("--redis-url", default=None, type=tg_config.redis_url_arg,
                    help=AUDIT_REDIS_HELP)
    pw.set_defaults(func=passwd)
    ro = verbs.add_parser("role", help="set an admin's role (admin or read-only)")
    ro.add_argument("name", help="the admin's name")
    ro.add_argument("role", choices=ROLES, help="admin (every change) or read-only "
                                                "(every page, no change)")
    tg_config.add_config_option(ro)
    ro.add_argument("--redis-url", default=None, type=tg_config.redis_url_arg,
                    help=AUDIT_REDIS_HELP)
    ro.set_defaults(func=role)
    ap = verbs.add_parser("apply", help="make the key changes the console queued (root)")
    tg_config.add_config_option(ap)
    ap.set_defaults(func=apply)
