"""What a Python service's entry point (``tokengate-ledger``, ``tokengate-console``) does
first: its arguments with ``-v``, its log, its configuration and its first line."""

from __future__ import annotations

import argparse
import logging
import sys

from tokengate import config as tg_config
from tokengate import version as tg_version


def start(parser: argparse.ArgumentParser, argv: list[str] | None
          ) -> tuple[argparse.Namespace, tg_config.Config]:
    """Parse ``argv`` (``parser`` gets ``-v/--verbose``: debug logging), log to stderr
    as ``<time> <level> <logger>: <message>``, load ``--config`` (exit status 2 and one
    line when it does not load: ``tokengate.config.load_or_exit``) and print ``<prog>
    <version>: starting`` on stderr, the first line of the service's log (stdout stays
    for what a command prints)."""
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = tg_config.load_or_exit(parser, args.config)
    print(f"{parser.prog} {tg_version.describe()}: starting", file=sys.stderr, flush=True)
    return args, cfg
