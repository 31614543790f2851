"""``tokengate-batch``: the Batch API's process, its HTTP listener and its worker."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from tokengate import config as tg_config
from tokengate import entry, redis_client

log = logging.getLogger("tokengate.batch")

DESCRIPTION = """\
OpenAI's Files and Batch API on spare capacity (the batch section of tokengate.yaml).

It serves /v1/files and /v1/batches on batch.unix_socket, else batch.listen (loopback):
the edge forwards them there with the key's id. It keeps objects in Redis and file bytes
in batch.files_dir, and runs every batch: each line checked and counted by the edge at
creation, then sent through the edge (batch.edge_url) as batch.worker_key acting for the
batch's key, at that key's priority, as fast as admission lets it (docs/api/batch.md).
One process per Redis.

exit status: 0 after SIGTERM or SIGINT; 1 when it cannot listen or read the worker
key's secret; 2 for a bad configuration.
"""


def main(argv: list[str] | None = None) -> None:
    """``tokengate-batch``: serve and work until SIGTERM / SIGINT."""
    parser = argparse.ArgumentParser(prog="tokengate-batch", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=None,
                        help=f"tokengate.yaml ({tg_config.LOOKUP_HELP})")
    parser.add_argument("--listen", default=None, metavar="HOST:PORT|unix:PATH",
                        help="where to serve (default: batch.unix_socket, else "
                             "batch.listen)")
    parser.add_argument("--edge-url", default=None,
                        help="where lines go (default: batch.edge_url)")
    parser.add_argument("--redis-url", default=None, type=tg_config.redis_url_arg,
                        help="Redis URL (default: redis.url), e.g. redis://127.0.0.1:6380/0")
    args, cfg = entry.start(parser, argv)
    from tokengate.batch.api import BatchApi
    from tokengate.batch.edge import EdgeClient
    from tokengate.batch.store import Store
    from tokengate.batch.worker import Worker
    from tokengate.http_server import listen, listen_unix, serve

    b = cfg.batch
    try:
        secret = b.worker_secret_file.read_text().strip()
    except OSError as e:
        print(f"tokengate-batch: batch.worker_secret_file: {e}", file=sys.stderr)
        sys.exit(1)
    client = redis_client.connect(cfg.redis, timeout_s=5.0, url=args.redis_url)
    store = Store(client, b.files_dir, b.retention_days * 86_400)
    listen_at = args.listen or b.address
    try:
        if listen_at.startswith("unix:"):
            server = listen_unix(listen_at.removeprefix("unix:"), BatchApi(store, b))
        else:
            host, _, port = listen_at.rpartition(":")
            server = listen(host.strip("[]"), int(port), BatchApi(store, b))
    except (OSError, ValueError) as e:
        print(f"tokengate-batch: cannot serve on {listen_at}: {e}", file=sys.stderr)
        sys.exit(1)
    stop = serve(server)
    worker = Worker(cfg, store, EdgeClient(args.edge_url or b.edge_url, secret))
    log.info("batch API on %s, files in %s, lines through %s", listen_at,
             b.files_dir, args.edge_url or b.edge_url)
    worker.run(stop)
    server.shutdown()
    server.server_close()
    log.info("tokengate-batch stopped")


if __name__ == "__main__":
    main()
