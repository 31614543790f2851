"""Prometheus endpoints of the sidecars (``prometheus_client``), one loopback port each
(``metrics.*_listen`` of tokengate.yaml, ``--metrics-listen`` on the command line).

The counter and the global limits may run several worker processes
(``tokengate.grpc_server``): with more than one, ``serve`` (in the parent, before any
worker starts) points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh folder, the spawned workers
inherit it and import the modules that define their metrics afresh, so each writes its
own memory-mapped files there (prometheus_client's multiprocess mode), and the parent
serves the sum of them all on one port. A worker that dies and is restarted leaves its
counts in its files: counters keep growing, as Prometheus expects. With one worker
(which runs in the parent itself) and for the ledger (one process) the default registry
is served.

The ledger's port also serves the admin view (``admin``): JSON for dashboards, answered
to loopback clients only, whatever address the port is bound to, and only to a request
whose Host is the port's own address (``own_hosts``; with a loopback or wildcard
address, the loopback names on its port): a DNS-rebinding page, whose requests come
from the browser's own loopback with the page's host name, gets 421.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from http import HTTPStatus
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def parse_listen(value: str | None) -> tuple[str, int] | None:
    """``"127.0.0.1:8082"`` -> ``("127.0.0.1", 8082)``; ``None`` or ``"none"`` -> None."""
    if value is None or value == "none":
        return None
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


# admin(path) -> (HTTP status, JSON document) | None (not an admin path)
Admin = Callable[[str], tuple[int, Any] | None]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def own_hosts(listen: str) -> set[str]:
    """The Host header values a listener on ``listen`` (``host:port``) answers with
    data: the address itself and, for a loopback or wildcard address, the loopback
    names on its port (``127.0.0.1:P``, ``localhost:P``, ``[::1]:P``)."""
    host, _, port = listen.rpartition(":")
    out = {listen}
    if host.strip("[]") in ("0.0.0.0", "::", "127.0.0.1", "localhost", "::1"):
        out |= {f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"}
    return out


def _app(metrics_app: Callable[..., Iterable[bytes]], admin: Admin | None,
         hosts: set[str] | None = None) -> Callable[..., Iterable[bytes]]:
    """``/`` and ``/metrics``: Prometheus; an ``admin`` path: its JSON (GET and HEAD,
    loopback clients only, Host one of ``hosts`` when given, else 421); anything
    else: 404."""
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if path in ("/", "/metrics"):
            return metrics_app(environ, start_response)
        headers = [("Content-Type", "application/json")]
        method = environ.get("REQUEST_METHOD", "GET")
        peer = ipaddress.ip_address(environ["REMOTE_ADDR"])
        if isinstance(peer, ipaddress.IPv6Address) and peer.ipv4_mapped:
            peer = peer.ipv4_mapped
        host = environ.get("HTTP_HOST", "")
        wrong_host = admin is not None and hosts is not None and host not in hosts
        answer = admin(path) if admin is not None and peer.is_loopback \
            and not wrong_host and method in ("GET", "HEAD") else None
        if admin is not None and not peer.is_loopback:
            status, doc = 403, {"error": "the admin view answers loopback clients only"}
        elif wrong_host:
            status, doc = 421, {"error": f"the admin view does not answer to host "
                                         f"{host[:100]!r}: ask for {min(hosts or [''])}"}
        elif admin is not None and method not in ("GET", "HEAD"):
            status, doc = 405, {"error": f"{method[:20]} is not allowed here: GET or HEAD"}
            headers.append(("Allow", "GET, HEAD"))
        elif answer is None:
            status, doc = 404, {"error": f"no such path: {path[:200]}"}
        else:
            status, doc = answer
        body = json.dumps(doc, indent=1).encode() + b"\n"
        headers.append(("Content-Length", str(len(body))))
        start_response(f"{status} {HTTPStatus(status).phrase}", headers)
        return [b""] if method == "HEAD" else [body]
    return app


class _BuildInfo:
    """``tokengate_build_info{service, version, commit} 1``: what each sidecar runs
    (tokengate.version), so a dashboard sees an upgrade land, or a host left behind."""

    def __init__(self, service: str) -> None:
        self.service = service

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import GaugeMetricFamily

        from tokengate import version

        g = GaugeMetricFamily("tokengate_build_info", "The running tokengate release (label "
                              "version) and checkout commit (label commit, git describe; "
                              "empty outside a git work tree), by service; always 1.",
                              labels=["service", "version", "commit"])
        g.add_metric([self.service, version.version(), version.commit()], 1)
        yield g


def serve(listen: str | None, name: str, workers: int = 1, admin: Admin | None = None
          ) -> bool:
    """Serve ``/metrics`` on ``listen`` (``host:port``; None or "none": nothing) from a
    daemon thread of this process. ``name``: the sidecar, for the folder's name;
    ``workers``: the worker processes it is about to spawn (1: none, it serves in this
    process); ``admin``: other paths it answers with JSON (loopback clients only, else
    403). A port that cannot be bound is said on stderr and the sidecar goes on
    without metrics: an observability port never stops counting, limits or billing.
    Returns whether it serves."""
    addr = parse_listen(listen)
    if addr is None:
        return False
    multiprocess = workers > 1
    if multiprocess:
        folder = tempfile.mkdtemp(prefix=f"tokengate-{name}-metrics-")
        os.environ[MULTIPROC_ENV] = folder
        atexit.register(shutil.rmtree, folder, True)
    from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app

    registry = REGISTRY
    if multiprocess:
        from prometheus_client import multiprocess as mp

        registry = CollectorRegistry()
        mp.MultiProcessCollector(registry)
    registry.register(_BuildInfo(name))
    try:
        server = make_server(addr[0], addr[1], _app(make_wsgi_app(registry), admin,
                                                      own_hosts(listen or "")),
                             _Server6 if ":" in addr[0] else _Server, handler_class=_Quiet)
    except OSError as e:
        print(f"tokengate-{name}: metrics not served on {listen}: {e}", file=sys.stderr,
              flush=True)
        return False
    threading.Thread(target=server.serve_forever, name=f"{name}-metrics",
                     daemon=True).start()
    return True
