"""``tokengate console``: set an admin's password (``passwd``) and apply the key changes
the console queued (``apply``, root's, under the systemd units)."""

from __future__ import annotations

import argparse
import getpass
import sys
from pathlib import Path

from ruamel.yaml.comments import CommentedMap

from tokengate import config as tg_config
from tokengate.config.console import ADMIN_NAME, ADMIN_NAME_RULE

CONSOLE_HELP = """\
The operator console (served by tokengate-ledger on ledger.console.listen, 127.0.0.1:8085
by default, while ledger.console.admins names someone).

  tokengate console passwd NAME [--password-stdin]
        sets NAME's password: its scrypt digest goes to ledger.console.admins.NAME in
        tokengate.yaml (the same in-place edit as `tokengate keys`: comments, owner and
        mode kept); the password is asked twice on the terminal, or read as one line
        from stdin. A running tokengate-ledger reads the file again within a second
        (it watches it): the console it serves takes the new password at once, and a
        console that was off (no admin yet) starts listening then: no restart.
        Sessions of NAME end.
  tokengate console passwd NAME --remove
        removes the admin (the console turns off with the last one at the ledger's
        next start)
  tokengate console apply [--config FILE]
        makes the key changes the console queued in ledger.console.changes_dir (as
        root: tokengate-console-apply.service runs it whenever one is queued)

EXIT STATUS
  0 done; 1 refused (a short password, passwords that differ, a bad name, the file
  would not be valid: one line per problem); 2 usage error or the file cannot be read.
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


def set_admin(path: Path, name: str, digest: str | None) -> tg_config.Config:
    """Write ``ledger.console.admins.<name>: <digest>`` into the file (``digest`` None:
    remove the admin) with ``tokengate.keys.edit``'s round-trip edit. Raises
    ``ConfigError`` (nothing written), ``LookupError`` (no such admin to remove) or
    ``OSError``."""
    from tokengate.keys.edit import edit, keeping_heading

    def change(data: CommentedMap) -> None:
        ledger = data.get("ledger")
        if ledger is None:
            ledger = data["ledger"] = CommentedMap()
        console = ledger.get("console")
        if console is None:
            console = ledger["console"] = CommentedMap()
        admins = console.get("admins")
        if admins is None:
            admins = console["admins"] = CommentedMap()
        if digest is None:
            if name not in admins:
                raise LookupError(f"no admin {name!r}")
            del admins[name]
        else:
            admins[name] = digest

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
    try:
        cfg = set_admin(_path(args), args.name, new)
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
    what = "removed" if args.remove else "password set"
    if args.remove:
        where = "" if cfg.ledger.console.admins else \
            "; no admin is left: the console stops at the ledger's next start"
    else:
        # the running ledger watches the file: it serves the console within a second,
        # started then if it was off
        where = (f"; a running tokengate-ledger serves the console on "
                 f"http://{cfg.ledger.console.listen}/ within a second")
    print(f"admin {args.name}: {what} ({cfg.path}){where}", file=sys.stderr)
    return 0


def apply(args: argparse.Namespace) -> int:
    """``tokengate console apply``."""
    from tokengate.console.changes import apply_queued

    try:
        cfg = tg_config.load(_path(args))
    except (tg_config.ConfigError, OSError) as e:
        print(f"tokengate console: {e}", file=sys.stderr)
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
    pw.add_argument("--config", type=Path, default=None,
                    help=f"tokengate.yaml ({tg_config.LOOKUP_HELP})")
    pw.add_argument("--password-stdin", action="store_true",
                    help="read the password as one line from stdin (scripts)")
    pw.add_argument("--remove", action="store_true", help="remove the admin")
    pw.set_defaults(func=passwd)
    ap = verbs.add_parser("apply", help="make the key changes the console queued (root)")
    ap.add_argument("--config", type=Path, default=None,
                    help=f"tokengate.yaml ({tg_config.LOOKUP_HELP})")
    ap.set_defaults(func=apply)
