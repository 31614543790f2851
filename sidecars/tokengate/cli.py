"""``tokengate``: the operator's command line (subcommands)."""

from __future__ import annotations

import argparse
import signal
import sys

from tokengate.ledger import report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="tokengate", description="tokengate operator commands; `tokengate <command> "
        "--help` describes each.")
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)
    report.add_parser(sub)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `tokengate usage | head` ends quietly
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
