"""``tokengate``: the operator's command line (subcommands)."""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
from pathlib import Path

from tokengate import config as tg_config
from tokengate import version as tg_version

# The commands in the order of `tokengate --help`, each with the module whose
# ``add_parser(sub)`` registers it (None: this module's). A call imports only its own
# command's module (all of them for --help or an unknown command): `tokengate config
# check` does not pay for Redis's, the doctor's and the installer's imports (0.75 -> 0.35
# CPU-s a call, measured with bytecode cached; `keys` needs nearly all of them anyway).
COMMANDS = {"usage": "tokengate.ledger.report", "config": None,
            "install": "tokengate.install", "doctor": "tokengate.doctor",
            "keys": "tokengate.keys", "console": "tokengate.console.cli"}

CONFIG_HELP = """\
Validate tokengate.yaml, apply it to the running edges, or print what describes it.

  tokengate config check [FILE]   validate FILE (default: $TOKENGATE_CONFIG, else the
                                  installed /etc/tokengate/tokengate.yaml where it
                                  exists, else ./tokengate.yaml; a file not given is
                                  named on stderr first) the way the sidecars and the edge's compiler read it:
                                  the schema, the coupled settings, the models'
                                  upstream addresses and tokenizer files
  tokengate config apply [FILE] [--edge DIR]
                                  check FILE, then recompile the edge's edge.json and
                                  reload its nginx: FILE's own edge when it runs (an
                                  installed FILE's: /etc/tokengate/edge.json with
                                  /run/nginx.pid; any other's: `make run`'s
                                  var/run/nginx beside it), or each --edge DIR
                                  (holding edge.json and nginx.pid); returns
                                  once the new nginx workers serve. The sidecars read
                                  FILE on SIGHUP (systemctl reload tokengate-counter ...)
  tokengate config schema         print the JSON Schema of the file (for editors)
  tokengate config docs [--out F] print the configuration reference (docs/config.md)

EXIT STATUS
  check: 0 valid (one summary line on stdout); 1 invalid (one line per problem on
  stderr, each starting with the key's dotted path, e.g.
  `models.tiny-qwen3.max_token_cap: unknown key`); 2 the file cannot be read (one
  line: missing, not permitted, or not UTF-8 text).
  apply: check's statuses; then 1 when an edge could not be reloaded (its line says
  why), else 0 (also when no running edge was found: said on stderr).
"""


def _config_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("config", help="check tokengate.yaml, print its schema or reference",
                       description=CONFIG_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = p.add_subparsers(dest="verb", metavar="verb", required=True)
    check = verbs.add_parser("check", help="validate a configuration file")
    check.add_argument("file", type=Path, nargs="?", default=None,
                       help=f"tokengate.yaml ({tg_config.LOOKUP_HELP})")
    check.add_argument("--config", type=Path, default=None, dest="config_file",
                       metavar="FILE", help="the same as FILE (as `tokengate keys` takes it)")
    check.set_defaults(func=config_check)
    apply_p = verbs.add_parser(
        "apply", help="check the file and reload the running edges with it",
        description="Check tokengate.yaml as `config check` does, then recompile its edge's "
                    "edge.json and reload its nginx: an installed file's (/etc/tokengate/"
                    "edge.json with /run/nginx.pid), any other file's make run edge "
                    "(var/run/nginx beside it), or each --edge DIR. Returns once the new nginx "
                    "workers serve.")
    apply_p.add_argument("file", type=Path, nargs="?", default=None,
                         help="tokengate.yaml (default: as for check)")
    apply_p.add_argument("--config", type=Path, default=None, dest="config_file",
                         metavar="FILE", help="the same as FILE (as `tokengate keys` takes it)")
    apply_p.add_argument("--edge", type=Path, action="append", metavar="DIR",
                         help="an edge to reload: DIR holds edge.json and nginx.pid "
                              "(repeatable; default: the ones found)")
    apply_p.set_defaults(func=config_apply, no_apply=False)
    schema = verbs.add_parser("schema", help="print the JSON Schema of tokengate.yaml")
    schema.set_defaults(func=config_schema)
    docs = verbs.add_parser("docs", help="print the configuration reference (Markdown)")
    docs.add_argument("--out", type=Path, default=None,
                      help="write it to this file instead (docs/config.md)")
    docs.set_defaults(func=config_docs)


def _checked(args: argparse.Namespace) -> tuple[tg_config.Config | None, int]:
    """``config check``'s work: (the configuration, 0), or (None, 1 invalid | 2
    unreadable) with the problems said on stderr."""
    from tokengate.tools.compile_config import compile_config

    path = args.file if args.file is not None else tg_config.default_path()
    try:
        cfg = tg_config.load(path)
        # what the edge would load: also resolves upstreams and reads tokenizer files
        compile_config(cfg)
    except tg_config.ConfigError as e:
        for line in e.errors:
            print(line, file=sys.stderr)
        n = len(e.errors)
        print(f"{Path(path).resolve()}: {n} problem{'s' if n != 1 else ''}", file=sys.stderr)
        return None, 1
    except OSError as e:
        print(f"tokengate config check: {e}", file=sys.stderr)
        return None, 2
    gl = "on" if cfg.global_limits.enabled else "off"
    log = "on" if cfg.access_log.file else "off"
    print(f"{cfg.path}: ok: {len(cfg.models)} model(s) ({', '.join(cfg.models)}), "
          f"{len(cfg.keys)} key(s), global limits {gl}, sampled access log {log}")
    return cfg, 0


def config_check(args: argparse.Namespace) -> int:
    """``tokengate config check``: 0 valid, 1 invalid, 2 unreadable."""
    return _checked(args)[1]


def config_apply(args: argparse.Namespace) -> int:
    """``tokengate config apply``: ``config check``, then every running edge reloaded
    with the file (tokengate.keys.apply, what ``tokengate keys`` does after an edit)."""
    from tokengate import keys

    cfg, status = _checked(args)
    if cfg is None:
        return status
    return keys.apply(args, cfg)


def config_schema(args: argparse.Namespace) -> int:
    """``tokengate config schema``: the JSON Schema on stdout."""
    from tokengate.tools.config_docs import json_schema

    print(json.dumps(json_schema(), indent=2))
    return 0


def config_docs(args: argparse.Namespace) -> int:
    """``tokengate config docs``: the Markdown reference on stdout or into ``--out``."""
    from tokengate.tools.config_docs import render

    text = render()
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")
    return 0


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    """``-v/--verbose`` on ``parser`` and on every command below it, so it may follow
    the command (``tokengate keys create ... -v``) or precede it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                child.add_argument("-v", "--verbose", action="store_true",
                                   default=argparse.SUPPRESS,
                                   help="also say which configuration file is used when it "
                                        "was given")
                _add_verbose(child)


def _config_used(args: argparse.Namespace) -> None:
    """Fix the configuration file of a command that reads one (``usage``, ``config
    check|apply``, ``doctor``, ``keys``; ``install``'s --config is the file to install)
    and say which: on stderr, first, whenever it was not given (``--verbose``: always).
    The command then uses exactly that file (``tokengate.config.discover``)."""
    attr = "file" if args.command == "config" else "config"
    if args.command == "install" or not hasattr(args, attr):
        return
    if getattr(args, "config_file", None) is not None:  # config check|apply --config FILE
        if args.file is not None and args.file != args.config_file:
            print(f"tokengate config {args.verb}: two files given ({args.file}, --config "
                  f"{args.config_file}): give one", file=sys.stderr)
            raise SystemExit(2)
        args.file = args.config_file
    given = getattr(args, attr)
    path, why = tg_config.discover(given)
    setattr(args, attr, path)
    if given is None or args.verbose:
        print(f"tokengate: configuration {path.absolute()} ({why})", file=sys.stderr,
              flush=True)


class _Version(argparse.Action):
    """``--version``: ``tokengate 0.2.0 (v0.1.0-12-g1a2b3c4)`` (tokengate.version), asked
    for only when the flag is given (git runs then, not on every command)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        print(f"tokengate {tg_version.describe()}")
        parser.exit(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="tokengate", description="tokengate operator commands; `tokengate <command> "
        "--help` describes each. A command that reads tokengate.yaml uses --config FILE, "
        "else $TOKENGATE_CONFIG, else the installed /etc/tokengate/tokengate.yaml where it "
        "exists, else ./tokengate.yaml, and says so on its first line (stderr).")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also say which configuration file is used when it was given")
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="print the release (and the checkout's commit) and exit")
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)
    given = sys.argv[1:] if argv is None else argv
    command = next((a for a in given if not a.startswith("-")), None)
    for name, module in COMMANDS.items():
        if command in COMMANDS and name != command:
            continue
        if module is None:
            _config_parser(sub)
        else:
            importlib.import_module(module).add_parser(sub)
    _add_verbose(parser)
    args = parser.parse_args(argv)
    if argv is None:
        # the command line's own process: `tokengate usage | head` ends quietly (a caller
        # in-process keeps Python's SIGPIPE handling: with the default action a write to
        # a closed socket would kill it)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    _config_used(args)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
