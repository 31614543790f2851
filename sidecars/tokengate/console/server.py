"""The console's HTTP listener: a threaded WSGI server (the standard library's, as the
metrics port uses) on ``ledger.console.listen``, run from a daemon thread of the ledger
process."""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from tokengate import config as tg_config
from tokengate.console.app import Console
from tokengate.redis_client import SyncRedis

log = logging.getLogger("tokengate.console")


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(WSGIRequestHandler):
    # a form's fields come in the body; an overlong request line or header is refused
    # by http.server itself (414 / 431)
    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve(cfg: tg_config.Config, client: SyncRedis, usage_file: Path) -> bool:
    """Serve the console of ``cfg`` (its file is read again whenever it changes) from a
    daemon thread, when ``ledger.console.admins`` names someone; returns whether it
    serves. A port that cannot be bound is logged and the ledger goes on: the console
    never stops billing."""
    cc = cfg.ledger.console
    if not cc.admins:
        log.info("console off: no admin in ledger.console.admins (tokengate console "
                 "passwd NAME)")
        return False
    host, _, port = cc.listen.rpartition(":")
    host = host.strip("[]")
    app = Console(cfg.path, client, usage_file)
    try:
        server = make_server(host, int(port), app, _Server6 if ":" in host else _Server,
                             handler_class=_Handler)
    except OSError as e:
        log.error("console not served on %s: %s", cc.listen, e)
        return False
    threading.Thread(target=server.serve_forever, name="console", daemon=True).start()
    log.info("console on http://%s/ (%d admin%s)", cc.listen, len(cc.admins),
             "" if len(cc.admins) == 1 else "s")
    return True
