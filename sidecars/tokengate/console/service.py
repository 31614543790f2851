"""``tokengate-console``: the operator console's process (see ``tokengate.console``)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

from tokengate import config as tg_config
from tokengate import entry, redis_client

log = logging.getLogger("tokengate.console")

DESCRIPTION = """\
Serve the operator console: keys, budgets, usage and spend, the request log, traffic
charts and the replicas, in a browser, behind admin logins.

The console is a process of its own: billing (tokengate-ledger) never shares a thread,
a socket or a crash with it. It reads

  tokengate.yaml     keys, admins and their roles, on every request when the file
                     changed (`tokengate keys`, `tokengate console passwd` need no
                     restart; a file that does not load leaves the last one that did)
  Redis (redis.url)  the ledger's rows, budgets, sessions and audit stream
  the usage files    ledger.usage_file and its rotated siblings (usage.jsonl.1, ...):
                     the request log, the Live page's refusals and charts
  the edges' status  ledger.console.edge_status, else edge.status_listen

and writes only key changes: the file and the edges' reload itself, or, with
ledger.console.changes_dir, a queue that root's `tokengate console apply` makes
(tokengate-console-apply.path, under the systemd units).

It serves on ledger.console.listen (or --listen) whether or not an admin exists: the
login page says how to set one (`tokengate console passwd NAME`), and an admin set
later can log in at once. 8 threads serve connections, 64 more wait (then 503), a read
times out after 10 s and a whole request after 30 s.

SIGNALS
  SIGTERM, SIGINT: stop (connections being served are cut). SIGHUP: nothing to do
  (the configuration is read again whenever the file changes); logged.

EXIT STATUS
  0 after SIGTERM/SIGINT; 1 the address cannot be bound; 2 a usage error or an
  invalid configuration.

EXAMPLES
  tokengate-console                                  # the configuration's file
  tokengate-console --listen 127.0.0.1:9466 --usage-file /var/lib/tokengate/usage/usage.jsonl
"""


def main(argv: list[str] | None = None) -> None:
    """``tokengate-console``: serve until SIGTERM / SIGINT (exit status in
    ``DESCRIPTION``)."""
    parser = argparse.ArgumentParser(prog="tokengate-console", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    tg_config.add_config_option(parser)
    parser.add_argument("--listen", default=None, metavar="HOST:PORT",
                        help="where to serve (default: ledger.console.listen); the Host "
                             "header must name it (or a loopback name on its port, or "
                             "an origin of ledger.console.origins)")
    parser.add_argument("--usage-file", type=Path, default=None,
                        help="the edge's usage file, its rotated siblings beside it "
                             "(default: ledger.usage_file)")
    parser.add_argument("--redis-url", default=None, type=tg_config.redis_url_arg,
                        help="Redis URL (default: redis.url), e.g. redis://127.0.0.1:6380/0")
    args, cfg = entry.start(parser, argv)
    from tokengate.console.app import Console
    from tokengate.http_server import listen, serve

    listen_at = args.listen or cfg.ledger.console.listen
    host, _, port = listen_at.rpartition(":")
    if not port.isdigit() or not host:
        parser.exit(2, f"tokengate-console: --listen {listen_at!r}: expected HOST:PORT\n")
    usage_file = (args.usage_file or cfg.ledger.usage_file).resolve()
    client = redis_client.connect(cfg.redis, timeout_s=5.0, url=args.redis_url)
    app = Console(cfg.path, client, usage_file, listen=listen_at)
    try:
        server = listen(host.strip("[]"), int(port), app)
    except OSError as e:
        print(f"tokengate-console: cannot serve on {listen_at}: {e}", file=sys.stderr)
        sys.exit(1)
    stop = serve(server)
    signal.signal(signal.SIGHUP, lambda *_: log.info(
        "SIGHUP: nothing to reload (the configuration is read whenever it changes)"))
    # the Live page's first read of the usage files (seconds for a day of busy traffic)
    # happens now, not on an operator's first page
    threading.Thread(target=app.traffic.update, name="traffic-first-read",
                     daemon=True).start()
    admins = len(cfg.ledger.console.admins)
    log.info("console on http://%s/ (%s), usage files %s*", listen_at,
             f"{admins} admin{'' if admins == 1 else 's'}" if admins else
             "no admin yet: tokengate console passwd NAME", usage_file)
    while not stop.wait(3600):
        pass
    server.shutdown()
    server.server_close()
    log.info("console stopped")


if __name__ == "__main__":
    main()
